"""The share of a script's main loop that is not the method (logging, timing, checkpoints, process checks), by lines.

    python tests/benchmarks/loop_share.py clear_impala.py reactor.py plr_ppo.py vracer_refer.py [--show]
    python tests/benchmarks/loop_share.py --cleanrl PATH/TO/cleanrl/ppo_atari.py   # the same rule on CleanRL

The main loop: the longest `for`/`while` loop inside the last `if __name__ == "__main__":` block (CleanRL: the
`for iteration in ...` loop). Its code lines (not blank, not comments) are counted once each; a line is plumbing
- if a section comment above it, at any depth, is one of `# LOG`, `# CHECKPOINT` (this repo's markers) or CleanRL's
  `# TRY NOT TO MODIFY: record rewards for plotting purposes` (until the next section comment, a blank line, or the
  end of the block the comment is in), or
- if the statement it belongs to (a simple statement, or a compound statement's header and, then, all of its body;
  the body of a `with` or `try` is classed by its own lines) names a logging, timing or run-control thing:
  PLUMBING_WORDS below.
Everything else counts as the method. A rule of thumb, not a proof: `--show` prints every line with its class, so
the count can be checked by eye.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

PLUMBING_WORDS = re.compile(
    r"logger\.|writer\.|print\(|time\.time\(\)|progress|checkpoint|\bsps\b|SPS|_seconds\b|_time\b|last_log|"
    r"last_step|averager|metrics\b|stats_sum|stats_count|_sum\b|_count\b|processes\.check|procs\.check|check_stop|"
    r"drain\(|episodic_return|episodic_length|explained_var|var_y|y_pred|y_true|recent_|clipfracs|final_info|"
    r"clock\b|clock\.|episode_stats|_counts\b"
)
PLUMBING_SECTIONS = re.compile(r"#\s*(LOG\b|CHECKPOINT\b|TRY NOT TO MODIFY: record)")
ANY_SECTION = re.compile(r"#\s*([A-Z]{3,}[A-Z :+]*)\b")
COMPOUND = (ast.If, ast.For, ast.While, ast.With, ast.Try)


def main_loop(tree: ast.Module) -> ast.AST:
    mains = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)
    ]
    if not mains:
        raise SystemExit("error: no `if __name__ == '__main__':` block")
    loops = [node for node in ast.walk(mains[-1]) if isinstance(node, (ast.For, ast.While))]
    if not loops:
        raise SystemExit("error: no loop in the __main__ block")
    return max(loops, key=lambda node: node.end_lineno - node.lineno)


def classify(source: str) -> dict[int, str]:
    """{line number: "method" | "plumbing"} for every code line of the main loop's body."""
    lines = source.splitlines()
    loop = main_loop(ast.parse(source))
    classes: dict[int, str] = {}

    def visit(statements, inherited: bool) -> None:
        for node in statements:
            if isinstance(node, COMPOUND):
                body_start = node.body[0].lineno
                header = "\n".join(lines[node.lineno - 1 : body_start - 1])
                plumbing = inherited or bool(PLUMBING_WORDS.search(header))
                for number in range(node.lineno, body_start):
                    classes[number] = "plumbing" if plumbing else "method"
                # a `with` (a timer around the method's lines) or a `try` passes on its parent's class, not its header's
                visit(node.body, inherited if isinstance(node, (ast.With, ast.Try)) else plumbing)
                for handler in getattr(node, "handlers", []):
                    classes[handler.lineno] = "plumbing" if plumbing else "method"
                    visit(handler.body, plumbing)
                for extra in ("orelse", "finalbody"):
                    body = getattr(node, extra, [])
                    if body:
                        # the `else:` / `finally:` line
                        classes[body[0].lineno - 1] = "plumbing" if plumbing else "method"
                        visit(body, plumbing)
            else:
                text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                plumbing = inherited or bool(PLUMBING_WORDS.search(text))
                for number in range(node.lineno, node.end_lineno + 1):
                    classes[number] = "plumbing" if plumbing else "method"

    visit(loop.body, False)
    # the section comments of the loop's body
    in_plumbing_section = False
    section_indent = 0
    for number in range(loop.body[0].lineno, loop.end_lineno + 1):
        line = lines[number - 1]
        text = line.strip()
        indent = len(line) - len(line.lstrip())
        if text.startswith("#") and ANY_SECTION.match(text):
            in_plumbing_section = bool(PLUMBING_SECTIONS.match(text))
            section_indent = indent
        elif not text or (indent < section_indent and not text.startswith("#")):
            # a section ends at a blank line or where the code leaves the block its comment is in
            in_plumbing_section = False
        if in_plumbing_section and number in classes:
            classes[number] = "plumbing"
    code = {
        number: kind
        for number, kind in classes.items()
        if lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")
    }
    return code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scripts", nargs="*", default=["clear_impala.py", "reactor.py", "plr_ppo.py", "vracer_refer.py"])
    parser.add_argument("--cleanrl", nargs="*", default=[], help="CleanRL files to measure with the same rule")
    parser.add_argument("--show", action="store_true", help="print every line of each loop with its class")
    options = parser.parse_args()
    print("| file | loop lines (code) | plumbing lines | plumbing share |")
    print("|---|---:|---:|---:|")
    for path in [*options.scripts, *options.cleanrl]:
        source = Path(path).read_text()
        classes = classify(source)
        plumbing = sum(kind == "plumbing" for kind in classes.values())
        print(f"| {Path(path).name} | {len(classes)} | {plumbing} | {plumbing / max(len(classes), 1):.0%} |")
        if options.show:
            lines = source.splitlines()
            for number in sorted(classes):
                mark = "P" if classes[number] == "plumbing" else " "
                print(f"{mark} {number:5d} {lines[number - 1]}", file=sys.stderr)


if __name__ == "__main__":
    main()

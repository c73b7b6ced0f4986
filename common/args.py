"""Command-line arguments shared by the four scripts: their common flags, declarative range checks and the one
`--resume` rule.

- `CommonArgs`: the flags every script has (seed, cuda, track, save_model, checkpoint_every, resume, ...); each
  script's `@dataclass class Args(CommonArgs)` adds its own.

- `parse_run_args(Args, script, env_flags, fixed)`: the start of every script: `cli`, then, with `--resume`, the
  checkpoint (`load_run_checkpoint`) and the resume rule; returns (args, checkpoint or None, overridden flag names).
- `cli(Args, env_flags)`: `tyro.cli(Args)` with `--help` in three groups (common, environment, method); the flags
  and the returned flat `Args` are unchanged.
- `check_args(args, rules)`: each rule names a field and what it must be, e.g. `{"learning_rate": "> 0",
  "gamma": "[0, 1]", "num_actors": ">= 1", "mode": ("sequential", "simultaneous")}`; the first violation stops the
  script with one line `error: --gamma must be in [0, 1], got 1.5`. A `None` value (an optional flag left unset)
  passes. Checks between fields stay a few explicit lines in each script.
- `resume_args(args, argv, ckpt_args, fixed)`: the resume rule of every script. A resumed run takes the
  checkpoint's flags; only the flags given on this command line override them, and a given flag named in `fixed`
  (one that changes the experiment: environment, seed, network, method) must equal the checkpoint's value. The
  resumed run writes into the checkpoint's run directory (`RunLogger(..., resume_step=...)` drops what was logged
  after the checkpoint, so metrics never go backwards).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import operator
import sys
from collections.abc import Iterable
from typing import Annotated, Any

import tyro

from common.checkpoint import load_run_checkpoint

COMMON_FLAGS = (
    "exp_name",
    "seed",
    "torch_deterministic",
    "cuda",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "capture_video",
    "save_model",
    "checkpoint_every",
    "checkpoint_replay",
    "resume",
    "progress",
    "start_method",
    "log_every",
    "log_every_seconds",
)
_COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


@dataclasses.dataclass
class CommonArgs:
    """The flags of all four scripts (each script's `Args` adds its environment and method flags)."""

    exp_name: str = ""
    """the name of this experiment (used in the run name; empty = the script's name)"""
    seed: int = 1
    """seed of the experiment (actor i uses seed + 1000 * i)"""
    torch_deterministic: bool = True
    """if toggled, sets `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """use CUDA for the learner when available (falls back to CPU)"""
    track: bool = False
    """log to Weights & Biases (lazy import, mirrors TensorBoard)"""
    wandb_project_name: str = "replay-rl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record videos of the first actor/eval env into videos/{run_name}"""
    save_model: bool = False
    """save the final model (state_dict + args) to runs/{run_name}/{exp_name}.model and evaluate it"""
    checkpoint_every: int = 0
    """write runs/{run_name}/checkpoint.pt atomically every this many env steps (0 = never)"""
    resume: str | None = None
    """path to a checkpoint.pt to resume from"""
    progress: bool = True
    """print a compact progress line"""
    start_method: str = "spawn"
    """multiprocessing start method for actor processes: spawn | forkserver"""


def _field_docs(cls) -> dict[str, str]:
    """{field: the docstring under it} from the source of the class and its dataclass bases (tyro's help texts)."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(inspect.getsource(klass)).body[0].body
        docs.update(
            {
                a.target.id: inspect.cleandoc(b.value.value)
                for a, b in zip(body, body[1:])
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
            }
        )
    return docs


def cli(args_class: type, env_flags: Iterable[str]) -> Any:
    """Parse the command line into `args_class` (a flat dataclass) with tyro, its `--help` grouped as "common options"
    (`COMMON_FLAGS`), "environment options" (`env_flags`) and "method options" (the rest), in field order."""
    docs, env_flags = _field_docs(args_class), set(env_flags)
    fields = dataclasses.fields(args_class)
    groups = {
        "common": [f for f in fields if f.name in COMMON_FLAGS],
        "environment": [f for f in fields if f.name in env_flags],
        "method": [f for f in fields if f.name not in COMMON_FLAGS and f.name not in env_flags],
    }
    nested = []
    for group, members in groups.items():
        spec = [
            (
                f.name,
                Annotated[f.type, tyro.conf.arg(help=docs.get(f.name))],
                dataclasses.field(default=f.default)
                if f.default is not dataclasses.MISSING
                else dataclasses.field(default_factory=f.default_factory),
            )
            for f in members
        ]
        sub = dataclasses.make_dataclass(group, spec)
        nested.append((group, Annotated[sub, tyro.conf.OmitArgPrefixes], dataclasses.field(default_factory=sub)))
    captured = io.StringIO()
    try:
        # tyro draws its errors in a box: read it, print one line instead
        with contextlib.redirect_stderr(captured):
            parsed = tyro.cli(
                dataclasses.make_dataclass(args_class.__name__, nested),
                description=inspect.getdoc(inspect.getmodule(args_class)).split("\n")[0],
            )
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise SystemExit(one_line_error(captured.getvalue())) from None
    return args_class(
        **{f.name: getattr(getattr(parsed, group), f.name) for group, members in groups.items() for f in members}
    )


def one_line_error(box: str) -> str:
    """tyro's error box as one line: `error: <its message> (did you mean --x?) (see --help)`. The box's first
    section is the message (wrapped at the terminal's width); a "Perhaps you meant:" line is followed by a flag."""
    sections = [[]]
    for line in box.splitlines():
        text = line.strip().strip("│").strip()
        if text.startswith("─"):
            sections.append([])
        elif text and not text.startswith(("╭", "╰")):
            sections[-1].append(text)
    message = " ".join(sections[0]) or "could not parse the command line"
    lines = [text for section in sections for text in section]
    suggestions = [lines[i + 1].split()[0] for i, text in enumerate(lines[:-1]) if text == "Perhaps you meant:"]
    hint = f" (did you mean {', '.join(suggestions)}?)" if suggestions else ""
    return f"error: {message}{hint} (see --help)"


def flag(name: str) -> str:
    """`--learning-rate` for the field `learning_rate`."""
    return "--" + name.replace("_", "-")


def _satisfies(value: Any, rule: str | tuple) -> bool:
    if isinstance(rule, tuple):  # a set of choices
        return value in rule
    rule = rule.strip()
    if rule[0] in "[(":  # an interval: [a, b], (a, b], [a, b), (a, b)
        low, high = (float(x) for x in rule[1:-1].split(","))
        above = low <= value if rule[0] == "[" else low < value
        return above and (value <= high if rule[-1] == "]" else value < high)
    op, bound = rule.split()
    return _COMPARISONS[op](value, float(bound))


def check_args(args: Any, rules: dict[str, str | tuple]) -> None:
    """Raise SystemExit('error: ...') on the first field of `args` that breaks its rule (see the module docstring)."""
    for name, rule in rules.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not _satisfies(value, rule):
            what = (
                f"one of {', '.join(map(str, rule))}"
                if isinstance(rule, tuple)
                else (f"in {rule}" if rule.strip()[0] in "[(" else rule)
            )
            raise SystemExit(f"error: {flag(name)} must be {what}, got {value!r}")


def explicit_flags(argv: Iterable[str], fields: Iterable[str]) -> set[str]:
    """The fields set on the command line `argv` (tyro style: `--total-timesteps 5`, `--x=5`, `--cuda`, `--no-cuda`)."""
    fields = set(fields)
    given = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name not in fields and name.startswith("no_") and name[3:] in fields:
            name = name[3:]
        if name in fields:
            given.add(name)
    return given


def resume_args(args: Any, argv: Iterable[str], ckpt_args: dict, fixed: Iterable[str]) -> tuple[Any, list[str]]:
    """(the resumed run's args, the names of the flags this command line overrides); see the module docstring."""
    fields = {f.name for f in dataclasses.fields(args)}
    given = explicit_flags(argv, fields) - {"resume"}
    restored = {}
    for name, value in ckpt_args.items():
        if name not in fields or name in given or name == "resume":
            continue  # a flag the script no longer has, one this command line sets, or the path resumed from
        restored[name] = tuple(value) if isinstance(getattr(args, name), tuple) and value is not None else value
    for name in sorted(given & set(fixed)):
        old = ckpt_args.get(name)
        old = tuple(old) if isinstance(getattr(args, name), tuple) and old is not None else old
        if name in ckpt_args and getattr(args, name) != old:
            raise SystemExit(
                f"error: --resume: {flag(name)} {getattr(args, name)!r} differs from the checkpoint's "
                f"{old!r}; it would change the experiment (leave it out to keep the checkpoint's value)"
            )
    return dataclasses.replace(args, **restored), sorted(given)


def parse_run_args(args_class: type, script: str, env_flags: Iterable[str], fixed: Iterable[str]):
    """(args, checkpoint or None, the flags this command line overrides): the command line parsed by `cli`, and with
    `--resume PATH` the checkpoint of `script` loaded and `resume_args` applied."""
    args = cli(args_class, env_flags)
    args.exp_name = args.exp_name or script[: -len(".py")]
    # numpy and the envs take seeds below 2**32; the scripts add per-actor and per-env offsets below 2**31
    if not 0 <= args.seed < 2**31:
        raise SystemExit(f"error: --seed must be in [0, 2**31), got {args.seed}")
    if not args.resume:
        return args, None, []
    ckpt = load_run_checkpoint(args.resume, script)
    args, overridden = resume_args(args, sys.argv[1:], ckpt["args"], fixed)
    return args, ckpt, overridden

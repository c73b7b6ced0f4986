"""Command-line arguments shared by the four scripts: their common flags, one-line errors and the `--resume` rule.

- `CommonArgs`: the flags every script has (seed, cuda, track, save_model, checkpoint_every, resume, ...); each
  script's `@dataclass class Args(CommonArgs)` adds its own. Choices are `Literal` types, checked by tyro.
- `parse_run_args(Args, script, fixed, applied, run_only, renamed)`: the start of every script: `cli`, the common
  flags' checks (`--track` needs wandb installed: checked here, before any folder), then, with `--resume`, the
  checkpoint (`load_run_checkpoint`) and the resume rule; returns (args, checkpoint or None, overridden flag names).
  `renamed` ({old field name: new field name}, each script's `RENAMED_FLAGS`): a checkpoint written before a flag
  was renamed resumes with its value under the new name; a checkpoint flag the script has under no name is refused
  in one line (its value would otherwise be dropped without a word).
- `resume_classes(Args, fixed, applied, run_only)`: every flag of a script in exactly one class on `--resume`
  (below); a flag in none, or in two, stops every start of the script (a programming error, so a new flag is
  classified the day it is added).
- `cli(Args)`: `tyro.cli(Args)`; a parse error becomes one line `error: ...` (`one_line_error`).
- `require(condition, message)`: a range check in a script's `validate_args`, e.g.
  `require(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma}")`; stops with one line `error: ...`.
- `resume_args(args, argv, ckpt_args, fixed)`: the resume rule of every script. A resumed run takes the
  checkpoint's flags; only the flags given on this command line override them, and a given flag named in `fixed`
  (one that changes the experiment: environment, seed, network, method) must equal the checkpoint's value. The
  resumed run writes into the checkpoint's run directory (`RunLogger(..., resume_step=...)` drops what was logged
  after the checkpoint, so metrics never go backwards).

The three classes of a flag on `--resume` (each script names its own flags in `FIXED_ON_RESUME`,
`APPLIED_ON_RESUME` and `RUN_ONLY_ON_RESUME`; the common flags' classes are `COMMON_*_ON_RESUME` below):
- fixed: a changed value is refused in one line (it would change the experiment);
- applied: a changed value takes effect from the resumed step on (the optimizer's settings, a schedule, a budget);
  each script's resume test changes every one of them and reads the value in effect;
- run only: how the run is executed and reported, never what it learns (logging, progress, checkpoint cadence, the
  device); read where it is used, so a changed value takes effect too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import io
import sys
from collections.abc import Iterable
from typing import Any, Literal

import tyro

from common.checkpoint import load_run_checkpoint


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
    start_method: Literal["spawn", "forkserver"] = "spawn"
    """multiprocessing start method for actor processes: spawn | forkserver"""


# the common flags' classes on --resume (see the module docstring)
COMMON_FIXED_ON_RESUME = ("exp_name", "seed")
COMMON_APPLIED_ON_RESUME = ()
COMMON_RUN_ONLY_ON_RESUME = (
    "torch_deterministic",
    "cuda",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "capture_video",
    "save_model",
    "checkpoint_every",
    "resume",
    "progress",
    "start_method",
)


def resume_classes(args_class: type, fixed: Iterable[str], applied: Iterable[str], run_only: Iterable[str]) -> dict:
    """{flag name: "fixed" | "applied" | "run_only"} for every field of `args_class`, the common flags' classes
    included; raises TypeError naming each field that is in no class, in two, or not a field at all."""
    classes = {
        "fixed": (*COMMON_FIXED_ON_RESUME, *fixed),
        "applied": (*COMMON_APPLIED_ON_RESUME, *applied),
        "run_only": (*COMMON_RUN_ONLY_ON_RESUME, *run_only),
    }
    fields = [f.name for f in dataclasses.fields(args_class)]
    found = {name: [kind for kind, names in classes.items() if name in names] for name in fields}
    problems = [f"{name} in no class" for name, kinds in found.items() if not kinds]
    problems += [f"{name} in {' and '.join(kinds)}" for name, kinds in found.items() if len(kinds) > 1]
    problems += [f"{name} is not a flag" for names in classes.values() for name in names if name not in found]
    if problems:
        raise TypeError(f"{args_class.__module__}.{args_class.__name__} on --resume: {'; '.join(problems)}")
    return {name: kinds[0] for name, kinds in found.items()}


def cli(args_class: type) -> Any:
    """`tyro.cli(args_class)`, its help headed by the first line of the script's docstring; a parse error becomes one
    line `error: ...` instead of tyro's box."""
    description = inspect.getdoc(sys.modules[args_class.__module__]).split("\n")[0]
    captured = io.StringIO()
    try:
        # tyro draws its errors in a box: read it, print one line instead
        with contextlib.redirect_stderr(captured):
            return tyro.cli(args_class, description=description)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise SystemExit(one_line_error(captured.getvalue())) from None


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


def require(condition: bool, message: str) -> None:
    """Stop the script with the one line `error: {message}` unless `condition` holds (a flag's range check)."""
    if not condition:
        raise SystemExit(f"error: {message}")


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
        # Skip a flag the script no longer has, one this command line sets, or the path resumed from.
        if name not in fields or name in given or name == "resume":
            continue
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


def check_renamed(args_class: type, renamed: dict[str, str]) -> None:
    """A script's RENAMED_FLAGS maps old names that are no longer flags to flags it has; raises TypeError naming each
    entry that does not (a programming error: checked at every start, as `resume_classes` is)."""
    fields = {f.name for f in dataclasses.fields(args_class)}
    bad = [f"{old} -> {new}" for old, new in renamed.items() if old in fields or new not in fields]
    if bad:
        raise TypeError(f"{args_class.__module__}.RENAMED_FLAGS: not an old name -> a flag: {', '.join(bad)}")


def checkpoint_flags(ckpt_args: dict, args_class: type, renamed: dict[str, str], path: str) -> dict:
    """The checkpoint's flags under this script's names: an old name in `renamed` becomes its new name; a flag the
    script has under no name stops the resume with one `error:` line."""
    fields = {f.name for f in dataclasses.fields(args_class)}
    flags = {renamed.get(name, name): value for name, value in ckpt_args.items()}
    unknown = sorted(set(flags) - fields)
    require(
        not unknown,
        f"--resume: {path} was written with {', '.join(flag(name) for name in unknown)}, which this script no longer "
        f"has; resume it with the version of the script that wrote it",
    )
    return flags


def parse_run_args(
    args_class: type,
    script: str,
    fixed: Iterable[str],
    applied: Iterable[str],
    run_only: Iterable[str],
    renamed: dict[str, str] | None = None,
) -> tuple[Any, dict | None, list[str]]:
    """(args, checkpoint or None, the flags this command line overrides): the command line parsed by `cli`, and with
    `--resume PATH` the checkpoint of `script` loaded and `resume_args` applied (`fixed`, `applied`, `run_only`: the
    script's classes of its own flags, checked by `resume_classes`; `renamed`: {old name: new name} of its renamed
    flags, `checkpoint_flags`)."""
    classes = resume_classes(args_class, fixed, applied, run_only)
    check_renamed(args_class, renamed or {})
    args = cli(args_class)
    args.exp_name = args.exp_name or script[: -len(".py")]
    # numpy and the envs take seeds below 2**32; the scripts add per-actor and per-env offsets below 2**31
    require(0 <= args.seed < 2**31, f"--seed must be in [0, 2**31), got {args.seed}")
    require(args.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    # wandb is imported lazily (not a requirement): check now, before any folder, that --track can work
    require(
        not args.track or importlib.util.find_spec("wandb") is not None,
        "--track needs wandb, which is not installed (pip install wandb, or leave out --track)",
    )
    if not args.resume:
        return args, None, []
    ckpt = load_run_checkpoint(args.resume, script)
    ckpt["args"] = checkpoint_flags(ckpt["args"], args_class, renamed or {}, args.resume)
    fixed_flags = [name for name, kind in classes.items() if kind == "fixed"]
    args, overridden = resume_args(args, sys.argv[1:], ckpt["args"], fixed_flags)
    return args, ckpt, overridden

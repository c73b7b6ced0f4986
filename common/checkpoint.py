"""Seeding, device choice and atomic checkpoints shared by the four scripts.

- `seed_everything(seed, torch_deterministic)`: python, numpy and torch (CleanRL's seeding block).
- `resumed_seed(seed, resume_step)`: the seed of an actor's streams in a run resumed at `resume_step`.
- `rng_state()` / `set_rng_state(state)`: capture and restore every global RNG, for `--resume`.
- `save_checkpoint(path, obj)`: `torch.save` to a temporary file in the same folder, fsync, then `os.replace`, so a
  crash mid-write never leaves a truncated checkpoint (the old one stays valid until the rename).
- `load_checkpoint(path)`: the inverse, with a one-line error for a missing or unreadable file.
- `save_run_checkpoint(logger, script, args, global_step, **state)`: the run's `checkpoint.pt`, with what every
  `--resume` reads (`script`, `run_name`, `args`, `global_step`, `rng`) and the script's own `state`.
- `next_checkpoint_step(global_step, every)`: the first multiple of `every` after `global_step` (None when 0).
- `CheckpointSchedule(global_step, every)`: `due(step)` once each time the steps pass the next such multiple
  (reactor.py's and plr_ppo.py's cadence).
- `load_run_checkpoint(path, script)`: for `--resume`: SystemExit('error: --resume: ...') unless `path` is a
  readable checkpoint written by `script` (every script stores `"script": "<name>.py"` in its checkpoints).
- `select_device(cuda)`: CUDA when asked for and present, else CPU.
- `state_dicts(**objects)` / `load_state_dicts(ckpt, **objects)`: what a checkpoint stores of each stateful object
  (model, optimizer, sampler, normalizer, ...: anything with `state_dict` / `load_state_dict`; None is skipped).
Multi-process runs are seeded, not bitwise deterministic: actors race with the learner.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, torch_deterministic: bool = True) -> None:
    """Seed python's `random`, numpy's global RNG and torch; `torch_deterministic` sets cudnn.deterministic."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = torch_deterministic


def resumed_seed(seed: int, resume_step: int) -> int:
    """The seed of a stream (an actor's actions, env resets, replay draws) in a run resumed at `resume_step`: drawn
    from (seed, resume_step) by numpy's SeedSequence, so that a resumed run's actors never replay the first run's
    streams; an int in [0, 2**31), as env seeds need."""
    return int(np.random.SeedSequence([seed, resume_step]).generate_state(1)[0]) % 2**31


def select_device(cuda: bool) -> torch.device:
    """`cuda` if requested and available, else `cpu`."""
    return torch.device("cuda" if cuda and torch.cuda.is_available() else "cpu")


def rng_state() -> dict[str, Any]:
    """Every global RNG state (python, numpy, torch CPU and CUDA) as a picklable dict."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states captured by `rng_state()`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def save_checkpoint(path: str | os.PathLike, obj: dict[str, Any]) -> None:
    """Atomically write `obj` with torch.save: temporary file + fsync + os.replace. A folder that cannot be written
    (permissions, a full disk) raises `CheckpointFailed` with one line; the previous checkpoint stays intact. (On a
    full disk torch.save raises RuntimeError, "unexpected pos", with the OSError as its context: that is a failed
    write too; an object that cannot be pickled raises its own error.)"""
    from common.processes import CheckpointFailed, disk_error

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        failed_write = e if isinstance(e, OSError) else disk_error(e)
        if failed_write is None:
            raise
        raise CheckpointFailed(f"{path.name} not written: {failed_write}") from None
    finally:
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()


def save_run_checkpoint(logger, script: str, args: Any, global_step: int, **state) -> None:
    """Atomically write `<run dir>/checkpoint.pt`: the keys every script's `--resume` reads (`script`, e.g.
    "reactor.py", `run_name`, `args`, `global_step`, `rng`: every global RNG) and the script's own `state`."""
    checkpoint = {
        "script": script,
        "run_name": logger.run_name,
        "args": vars(args),
        "global_step": global_step,
        "rng": rng_state(),
    }
    save_checkpoint(logger.dir / "checkpoint.pt", checkpoint | state)


def next_checkpoint_step(global_step: int, every: int) -> int | None:
    """The first multiple of `every` after `global_step`: when the next checkpoint is due (None when `every` is 0)."""
    if not every:
        return None
    return (global_step // every + 1) * every


class CheckpointSchedule:
    """--checkpoint-every as multiples of the period: `due(global_step)` is True once each time the steps reach the
    next multiple of `every` after the step the schedule started from (never with 0)."""

    def __init__(self, global_step: int, every: int):
        self.every = every
        self.next_step = next_checkpoint_step(global_step, every)

    def due(self, global_step: int) -> bool:
        if self.next_step is None or global_step < self.next_step:
            return False
        self.next_step += self.every
        return True


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint`; raises a one-line error if it is missing or unreadable."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} is a directory: give the checkpoint file in it, e.g. {str(path / 'checkpoint.pt')!r}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        # our own files: they hold numpy RNG states and args, which the weights-only unpickler refuses
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # noqa: BLE001 - one clear line instead of an unpickling traceback
        raise RuntimeError(f"checkpoint {str(path)!r} could not be read: {type(e).__name__}: {e}") from None


def load_run_checkpoint(path: str | os.PathLike, script: str, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint to resume `script` (e.g. "reactor.py") from, or stop with one `error: --resume: ...` line."""
    try:
        ckpt = load_checkpoint(path, map_location)
    except (FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: --resume: {e}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != script:
        found = ckpt.get("script", "an unknown script") if isinstance(ckpt, dict) else "an unknown script"
        raise SystemExit(f"error: --resume: {path} is a checkpoint of {found}, not of {script}")
    return ckpt


def state_dicts(**objects) -> dict[str, Any]:
    """{name: obj.state_dict()} for each object given (None stays None), to put into a checkpoint."""
    return {name: None if obj is None else obj.state_dict() for name, obj in objects.items()}


def load_state_dicts(ckpt: dict[str, Any], **objects) -> None:
    """obj.load_state_dict(ckpt[name]) for each object given that is not None (the inverse of `state_dicts`)."""
    for name, obj in objects.items():
        if obj is not None:
            obj.load_state_dict(ckpt[name])

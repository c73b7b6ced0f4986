"""Run logging shared by the four scripts: one folder per run, CleanRL metric names, files readable without TensorBoard.

`RunLogger(run_name, args)` creates `runs/{run_name}/` with
- TensorBoard event files (`SummaryWriter`) and the hyperparameter table as text (CleanRL's `hyperparameters`);
- `args.json`: the full configuration;
- `metrics.jsonl`: one flat JSON object per `log()` call, e.g.
  `{"global_step": 2048, "time": 12.3, "charts/SPS": 171.0, "losses/value_loss": 0.41}`;
- `summary.json`: written once by `summary()` at the end of a run (atomically).
A resumed run (`resume_step=S`, the checkpoint's global step) writes into the same folder: records logged after step
S (between the checkpoint and the stop) are dropped from metrics.jsonl and purged from TensorBoard, and the `time`
column continues from the last kept record, so neither steps nor times ever go backwards.
It also prints a compact progress line (`progress()`, switched off with `progress=False`) and mirrors everything to
Weights & Biases when `track=True` (imported lazily, so wandb is not a dependency).

Metric names follow CleanRL: `charts/episodic_return`, `charts/episodic_length`, `charts/SPS`,
`charts/learning_rate`, `losses/<name>`, `eval/<name>`; the x-axis is `global_step` in environment steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


def make_run_name(env_id: str, exp_name: str, seed: int) -> str:
    """CleanRL's run name `{env_id}__{exp_name}__{seed}__{unix time}`, safe as a folder name."""
    safe_env = env_id.replace("/", "-").replace(" ", "_")
    return f"{safe_env}__{exp_name}__{seed}__{int(time.time())}"


def start_run(args: Any, ckpt: dict | None, env_name: str) -> RunLogger:
    """The run's logger, from the common flags: a new `runs/{env_name}__{exp_name}__{seed}__{time}`, or with
    `--resume` the checkpoint's run directory, continued from its step."""
    run_name = ckpt["run_name"] if ckpt else make_run_name(env_name, args.exp_name, args.seed)
    return RunLogger(
        run_name,
        args,
        track=args.track,
        wandb_project_name=args.wandb_project_name,
        wandb_entity=args.wandb_entity,
        progress=args.progress,
        resume_step=ckpt["global_step"] if ckpt else None,
    )


def _to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _to_jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    try:
        f = float(value)  # floats, numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        return str(value)
    # JSON has no NaN/inf: keep them readable as strings.
    return f if math.isfinite(f) else str(f)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(_to_jsonable(data), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunLogger:
    """TensorBoard + metrics.jsonl + summary.json + progress line (+ optional wandb) for one run."""

    def __init__(
        self,
        run_name: str,
        args: Any,
        *,
        track: bool = False,
        wandb_project_name: str = "replay-rl",
        wandb_entity: str | None = None,
        progress: bool = True,
        root: str | os.PathLike = "runs",
        resume_step: int | None = None,
    ):
        self.run_name = run_name
        self.dir = Path(root) / run_name
        self.dir.mkdir(parents=True, exist_ok=True)
        elapsed = 0.0
        # On resume, keep what was logged up to the checkpoint and continue the time column.
        if resume_step is not None:
            kept = (
                [r for r in read_metrics(self.dir / "metrics.jsonl") if r["global_step"] <= resume_step]
                if (self.dir / "metrics.jsonl").exists()
                else []
            )
            elapsed = max((float(r["time"]) for r in kept), default=0.0)
            with open(self.dir / ".metrics.jsonl.tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.dir / ".metrics.jsonl.tmp", self.dir / "metrics.jsonl")
        self.show_progress = progress
        config = _to_jsonable(args)
        self.wandb = None
        if track:
            import wandb  # lazy: only needed with --track

            self.wandb = wandb
            wandb.init(
                project=wandb_project_name,
                entity=wandb_entity,
                sync_tensorboard=True,
                config=config,
                name=run_name,
                save_code=True,
            )
        self.writer = SummaryWriter(str(self.dir), purge_step=None if resume_step is None else resume_step + 1)
        table = "\n".join(f"|{k}|{v}|" for k, v in (config.items() if isinstance(config, dict) else []))
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        write_json_atomic(self.dir / "args.json", config)
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: one record per line
        self.start_time = time.time() - elapsed
        print(
            f"run directory: {self.dir}" + (f" (resumed at step {resume_step:,})" if resume_step is not None else ""),
            flush=True,
        )

    def log(self, global_step: int, metrics: dict[str, Any]) -> None:
        """Write each metric as a TensorBoard scalar and all of them as one JSON line in metrics.jsonl."""
        record: dict[str, Any] = {"global_step": int(global_step), "time": round(time.time() - self.start_time, 3)}
        for name, value in metrics.items():
            # Accepts python/numpy numbers and 0-d tensors (one sync per metric, per log call).
            value = float(value)
            self.writer.add_scalar(name, value, global_step)
            record[name] = value if math.isfinite(value) else str(value)
        self._metrics.write(json.dumps(record) + "\n")

    def progress(
        self,
        global_step: int,
        sps: float,
        episodic_return: float | None = None,
        loss_name: str | None = None,
        loss: float | None = None,
        extra: str = "",
    ) -> None:
        """Print one compact line: `step  12,288 | SPS   171 | return   -20.10 | value_loss 0.4123 | <extra>`."""
        if not self.show_progress:
            return
        parts = [f"step {int(global_step):>11,}", f"SPS {sps:>7.0f}"]
        parts.append(f"return {episodic_return:>9.2f}" if episodic_return is not None else "return         -")
        if loss_name is not None and loss is not None:
            parts.append(f"{loss_name} {float(loss):.4g}")
        if extra:
            parts.append(extra)
        print(" | ".join(parts), flush=True)

    def summary(self, data: dict[str, Any]) -> Path:
        """Write runs/{run_name}/summary.json (atomically) and return its path."""
        path = self.dir / "summary.json"
        write_json_atomic(path, {"run_name": self.run_name, "wall_time_s": round(time.time() - self.start_time, 1), **data})
        if self.wandb is not None:
            self.wandb.summary.update(_to_jsonable(data))
        return path

    def close(self) -> None:
        if self._metrics.closed:
            return
        self._metrics.close()
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file back into a list of dicts (for plots, tests and README tables)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

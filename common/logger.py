"""Run logging shared by the four scripts: one folder per run, CleanRL metric names, files readable without TensorBoard.

`RunLogger(run_name, args)` creates a new folder `runs/{run_name}/` (atomically: a run started in the same second
with the same name gets `runs/{run_name}-2/`, never the other run's folder) with
- TensorBoard event files (`SummaryWriter`) and the hyperparameter table as text (CleanRL's `hyperparameters`);
- `args.json`: the full configuration;
- `metrics.jsonl`: one flat JSON object per `log()` call, e.g.
  `{"global_step": 2048, "time": 12.3, "charts/SPS": 171.0, "losses/value_loss": 0.41}`;
- `summary.json`: written once by `summary()` at the end of a run (atomically).
A resumed run (`resume_step=S`, the checkpoint's global step) writes into the checkpoint's folder (`start_run`: the
folder that holds the checkpoint file, wherever the command runs): records logged after step S (between the
checkpoint and the stop) are dropped from metrics.jsonl and purged from TensorBoard, and the `time` column continues
from the last kept record, so neither steps nor times ever go backwards.
The disk: a folder that cannot be made or written at start-up (`runs` a file, a read-only working folder, a full
disk) stops `start_run` with one `error:` line (a new run's half-made folder is removed); a write that fails later
(metrics.jsonl, TensorBoard) raises `RunFolderFailed` once, which stops the run like a dead actor, and later records
are dropped, so that the run's end (`finish_run`) still writes what the disk allows.
It also prints a compact progress line (`progress()`, switched off with `progress=False`) and mirrors everything to
Weights & Biases when `track=True` (imported lazily, so wandb is not a dependency).
`MetricAverager`: the means of a loop's per-step metrics since the last log line, summed where they are made (the
learner's device), read with one transfer per log line; the four main loops use it for their learner metrics.

Metric names follow CleanRL: `charts/episodic_return`, `charts/episodic_length`, `charts/SPS`,
`charts/learning_rate`, `losses/<name>`, `eval/<name>`; the x-axis is `global_step` in environment steps.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from common.processes import RunFolderFailed, disk_error, run_started


def make_run_name(env_id: str, exp_name: str, seed: int) -> str:
    """CleanRL's run name `{env_id}__{exp_name}__{seed}__{unix time}`, safe as a folder name."""
    safe_env = env_id.replace("/", "-").replace(" ", "_")
    return f"{safe_env}__{exp_name}__{seed}__{int(time.time())}"


def start_run(args: Any, ckpt: dict | None, env_name: str) -> RunLogger:
    """The run's logger, from the common flags: a new `runs/{env_name}__{exp_name}__{seed}__{time}` (a suffix `-2`,
    `-3`, ... if another run took that name), or with `--resume` the folder that holds the checkpoint file, continued
    from its step. A folder that cannot be made or written stops the script with one `error:` line. From here on a
    stop signal stops the run at its next check (`run_started`)."""
    if ckpt:
        run_dir = Path(os.path.abspath(args.resume)).parent
        run_name = run_dir.name
        root = run_dir.parent
    else:
        run_name = make_run_name(env_name, args.exp_name, args.seed)
        root = Path("runs")
    try:
        logger = RunLogger(
            run_name,
            args,
            track=args.track,
            wandb_project_name=args.wandb_project_name,
            wandb_entity=args.wandb_entity,
            progress=args.progress,
            root=root,
            resume_step=ckpt["global_step"] if ckpt else None,
        )
    except RunFolderFailed as e:
        raise SystemExit(f"error: {e}") from None
    run_started(logger)
    return logger


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
    """Write `data` as JSON to `path` through a temporary file and a rename, so readers never see half a file (a
    failed write, e.g. a full disk, raises OSError and leaves the old file and no temporary file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    text = json.dumps(_to_jsonable(data), indent=2)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def make_new_folder(root: Path, name: str) -> Path:
    """Create `root/name`, or `root/name-2`, `root/name-3`, ... if it exists: mkdir is atomic, so two runs that start
    together never share a folder."""
    if root.exists() and not root.is_dir():
        # mkdir would say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        folder = root / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{root / name} and 998 suffixed folders exist")


class MetricAverager:
    """The means of a loop's metrics since the last log line. Tensors are summed where they are (on the learner's
    device, no sync per step); `means()` reads every sum with one transfer and starts over:

        averager.add({"losses/value_loss": value_loss, "charts/policy_lag": 3.0})  # every learner step
        logger.log(global_step, averager.means() | {"charts/SPS": sps})  # every log line

    Values: 0-d tensors (detached here) or numbers; a name's mean is its sum over the steps that added it, divided
    by their number (in float64)."""

    def __init__(self):
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, Any]) -> None:
        """Add one step's value of each metric in `metrics`."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
            # 0 + value: a new sum, never the caller's tensor
            self.sums[name] = self.sums.get(name, 0) + value
            self.counts[name] = self.counts.get(name, 0) + 1

    def __len__(self) -> int:
        """The number of steps added since the last `means()` (the most any metric has)."""
        return max(self.counts.values(), default=0)

    def means(self) -> dict[str, float]:
        """{name: mean since the last call} (one device-to-host transfer for all tensor sums), then start over."""
        tensor_names = [name for name, total in self.sums.items() if isinstance(total, torch.Tensor)]
        totals = {name: float(total) for name, total in self.sums.items() if name not in tensor_names}
        if tensor_names:
            device = self.sums[tensor_names[0]].device
            stacked = torch.stack([self.sums[name].to(device=device, dtype=torch.float64) for name in tensor_names])
            totals |= dict(zip(tensor_names, stacked.tolist()))
        means = {name: totals[name] / self.counts[name] for name in self.sums}
        self.sums = {}
        self.counts = {}
        return means


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
        self.dir = None
        self.new_folder = resume_step is None
        # the first write that failed (then the run stops, and later records are dropped); None while all is well
        self.failed: str | None = None
        self.closed = False
        self.last_step = resume_step or 0
        self._metrics = None
        self.writer = None
        self.wandb = None
        try:
            if self.new_folder:
                self.dir = make_new_folder(Path(root), run_name)
            else:
                self.dir = Path(root) / run_name
            self.run_name = self.dir.name
            self._open(args, resume_step, track, wandb_project_name, wandb_entity)
        except OSError as e:
            where = self.dir if self.dir is not None else Path(root) / run_name
            self._close_files()
            if self.new_folder and self.dir is not None:
                # nothing of a new run is worth keeping: leave no half-made folder behind
                shutil.rmtree(self.dir, ignore_errors=True)
            raise RunFolderFailed(f"run folder {where} not written: {e}") from None
        self.show_progress = progress
        print(
            f"run directory: {self.dir}" + (f" (resumed at step {resume_step:,})" if resume_step is not None else ""),
            flush=True,
        )

    def _open(self, args, resume_step, track, wandb_project_name, wandb_entity) -> None:
        """Write args.json, open metrics.jsonl and TensorBoard (raises OSError where the folder cannot be written)."""
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
        config = _to_jsonable(args)
        write_json_atomic(self.dir / "args.json", config)
        if track:
            import wandb  # lazy: only needed with --track (parse_run_args checks that it is installed)

            self.wandb = wandb
            wandb.init(
                project=wandb_project_name,
                entity=wandb_entity,
                sync_tensorboard=True,
                config=config,
                name=self.run_name,
                save_code=True,
            )
        self.writer = SummaryWriter(str(self.dir), purge_step=None if resume_step is None else resume_step + 1)
        table = "\n".join(f"|{k}|{v}|" for k, v in (config.items() if isinstance(config, dict) else []))
        self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        # TensorBoard writes in a thread: flush now, so that a folder that takes no file fails here
        self.writer.flush()
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: one record per line
        self.start_time = time.time() - elapsed

    def log(self, global_step: int, metrics: dict[str, Any]) -> None:
        """Write each metric as a TensorBoard scalar and all of them as one JSON line in metrics.jsonl. A failed
        write (a full disk) raises `RunFolderFailed` once; after it, records are dropped."""
        if self.failed:
            return
        self.last_step = int(global_step)
        record: dict[str, Any] = {"global_step": int(global_step), "time": round(time.time() - self.start_time, 3)}
        try:
            for name, value in metrics.items():
                # Accepts python/numpy numbers and 0-d tensors (one sync per metric, per log call).
                value = float(value)
                self.writer.add_scalar(name, value, global_step)
                record[name] = value if math.isfinite(value) else str(value)
            self._metrics.write(json.dumps(record) + "\n")
        except Exception as e:
            failed_write = disk_error(e)
            if failed_write is None:
                raise
            self.failed = f"metrics not written to {self.dir}: {failed_write}"
            raise RunFolderFailed(self.failed) from None

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
        """Flush and close metrics.jsonl, TensorBoard and wandb; safe to call twice. A flush that fails (a full disk)
        is kept in `failed`, not raised."""
        if self.closed:
            return
        self.closed = True
        self._close_files()
        if self.wandb is not None:
            self.wandb.finish()

    def _close_files(self) -> None:
        for close in (self._metrics.close if self._metrics else None, self.writer.close if self.writer else None):
            if close is None:
                continue
            try:
                close()
            except Exception as e:
                failed_write = disk_error(e)
                if failed_write is None:
                    raise
                self.failed = self.failed or f"metrics not written to {self.dir}: {failed_write}"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file back into a list of dicts (for plots, tests and README tables). A last line without
    its newline is a record cut short by a failed write (a full disk) and is left out."""
    with open(path) as f:
        lines = f.read().split("\n")
    # the text after the last newline: "" for a whole file, a partial record otherwise
    whole_lines = lines[:-1]
    return [json.loads(line) for line in whole_lines if line.strip()]

"""Stop times of the four scripts: from a stop signal to the last process of the run gone.

    python tests/benchmarks/bench_stop.py [--repeats 3] [--scripts plr_ppo.py ...] [--points imports start-up training]
        [--signals ctrl-c sigterm]

Each run is one script with the lifecycle tests' tiny configuration (tests/test_lifecycle.py: TINY and LONG, a budget
that does not end), started in its own process group from an empty folder. A signal is sent at a fixed point:
- `imports`: numpy's extension is loaded into the main process (the heavy imports are under way, torch not yet);
- `start-up`: the run printed `run directory: ` (its folder exists; networks, memory, actors and envs are being made);
- `training`: metrics.jsonl holds a `losses/` record (the learner is training);
- `first-eval` (plr_ppo.py only, with `--eval-every 1`): the evaluation env's worker process has appeared (the
  first evaluation is starting it).
`ctrl-c` sends SIGINT to the whole process group (what a terminal does), `sigterm` sends SIGTERM to the main process.
Measured: seconds from the signal to the moment no process of the group is alive (`gone`), to the `stopped:` line on
stdout (`stopped`), and the exit code. Prints a markdown table: per script, point and signal, the median and the
maximum over the repeats. Goal (issue 48): every stop within 3 s on an idle machine.
"""

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.test_lifecycle import LONG, TINY, group_members  # noqa: E402

POINTS = ("imports", "start-up", "training", "first-eval")
SIGNALS = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM}
# the first evaluation of plr_ppo.py: after every update, a few episodes on one eval env worker
FIRST_EVAL_FLAGS = ["--eval-every", "1", "--eval-episodes", "2"]


def mapped(pid: int, name: str) -> bool:
    """True when a file whose path contains `name` is mapped into process `pid` (a loaded extension module)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


def spawned_children(pgid: int) -> int:
    """How many processes of the group are multiprocessing children (spawned, or forked by the fork server)."""
    count = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                line = f.read()
        except OSError:
            continue
        count += "spawn_main" in line
    return count


def wait_for_point(point: str, proc: subprocess.Popen, folder: Path, timeout: float = 180.0) -> bool:
    """Wait (polling every 5 ms) until the run reaches `point`; False if it ended or timed out first."""
    deadline = time.time() + timeout
    stdout = folder / "stdout.txt"
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        if point == "imports":
            if mapped(proc.pid, "_multiarray_umath"):
                return True
        elif point == "start-up":
            if "run directory: " in stdout.read_text():
                return True
        elif point == "training":
            runs = list((folder / "runs").glob("*/metrics.jsonl")) if (folder / "runs").exists() else []
            if any('"losses/' in path.read_text() for path in runs):
                return True
        elif point == "first-eval":
            # one training env worker (--num-workers 1), then the eval env's worker at the first update
            if spawned_children(proc.pid) >= 2:
                return True
        time.sleep(0.005)
    return False


def measure(script: str, point: str, signal_name: str) -> dict:
    """One run: start, wait for `point`, signal, time the stop."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        flags = [*TINY[script], *LONG[script]]
        if point == "first-eval":
            # the lifecycle configuration has --eval-every 0: the later flag wins in tyro
            flags += FIRST_EVAL_FLAGS
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-u", str(ROOT / script), *flags],
                cwd=folder,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        try:
            if not wait_for_point(point, proc, folder):
                return {"reached": False, "stderr": (folder / "stderr.txt").read_text()[-500:]}
            signum = SIGNALS[signal_name]
            sent = time.perf_counter()
            if signal_name == "ctrl-c":
                os.killpg(proc.pid, signum)
            else:
                os.kill(proc.pid, signum)
            stopped = None
            gone = None
            while time.perf_counter() - sent < 120:
                now = time.perf_counter()
                if stopped is None and "stopped:" in (folder / "stdout.txt").read_text():
                    stopped = now - sent
                proc.poll()
                if not group_members(proc.pid):
                    gone = now - sent
                    break
                time.sleep(0.005)
            code = proc.wait(timeout=60) if gone is not None else None
            traceback = "Traceback" in (folder / "stderr.txt").read_text()
            return {"reached": True, "gone": gone, "stopped": stopped, "code": code, "traceback": traceback}
        finally:
            if group_members(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def seconds(values: list, missing: str) -> str:
    """`median / max` of the measured values, and how many runs gave none (`missing` says why)."""
    known = [v for v in values if v is not None]
    if not known:
        return f"- ({missing})"
    text = f"{statistics.median(known):.2f} / {max(known):.2f}"
    return text if len(known) == len(values) else f"{text} ({len(values) - len(known)} {missing})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scripts", nargs="+", default=list(TINY))
    parser.add_argument("--points", nargs="+", default=list(POINTS), choices=POINTS)
    parser.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=list(SIGNALS))
    options = parser.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = []
    for script in options.scripts:
        for point in options.points:
            if point == "first-eval" and script != "plr_ppo.py":
                continue
            for signal_name in options.signals:
                results = [measure(script, point, signal_name) for _ in range(options.repeats)]
                reached = [r for r in results if r["reached"]]
                codes = sorted({r["code"] for r in reached}, key=str)
                tracebacks = sum(r["traceback"] for r in reached)
                rows.append(
                    f"| `{script}` | {point} | {signal_name} | {len(reached)}/{len(results)} | "
                    f"{seconds([r['gone'] for r in reached], 'not gone in 120 s')} | "
                    f"{seconds([r['stopped'] for r in reached], 'line not seen: the process ended first')} | "
                    f"{', '.join(str(c) for c in codes)} | {tracebacks} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(
        f"Stop times, {options.repeats} repeats each ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; load average {' '.join(load_before)} before, {' '.join(load_after)} after)\n"
    )
    header = "| script | signal at | signal | reached | signal to group gone, s (median / max) | to `stopped:` line, s "
    print(header + "| exit codes | tracebacks |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))

"""The life of a run, the same for all four scripts (README "Conventions"): signals, dead actors, resume, bad input.

Each script runs for real in a subprocess, in its own process group, so that every process it starts can be found.
- SIGINT (also when the run was started with SIGINT ignored, as a background job is) and SIGTERM stop every
  process within seconds, write summary.json with the reason, and exit 128 + signal, with no traceback and no
  leaked-semaphore warning;
- a SIGKILLed actor or env worker stops the run with its reason and exit code 1, leaving no process behind;
- `--resume` follows the one rule of common/args.py: the checkpoint's flags, only given flags override, flags that
  change the experiment refused; the resumed run continues in the same folder and its metrics never go back;
- bad input stops the script at start-up with one `error:` line and no traceback.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tiny configurations: (script, flags that make a run start fast; an experiment-changing flag for the resume test)
TINY = {
    "clear_impala.py": (
        "--env-ids MiniGrid-Empty-5x5-v0 MiniGrid-LavaGapS5-v0 --num-actors 2 --batch-size 2 --unroll-length 20 "
        "--num-test-actors 1 --test-actor-max-sps 300 --start-method forkserver --log-every-seconds 0.5 "
        "--no-cuda --no-progress"
    ).split(),
    "reactor.py": (
        "--num-actors 2 --replay-size 1200 --learning-starts 100 --replay-ratio 60 --ratio-slack 32 "
        "--log-every 1 --lstm-size 32 --num-atoms 11 --sequence-length 8 --batch-size 2 "
        "--start-method forkserver --eval-episodes 0 --no-cuda --no-progress"
    ).split(),
    "plr_ppo.py": (
        "--env-id MultiRoom-N4-Random --num-envs 4 --num-steps 32 --num-minibatches 2 --num-train-levels 20 "
        "--eval-every 0 --final-eval-episodes 0 --num-eval-envs 1 --num-workers 1 --no-cuda --no-progress"
    ).split(),
    "vracer_refer.py": (
        "--env-id Hopper-v5 --num-actors 2 --learning-starts 500 --buffer-size 500 --batch-size 32 "
        "--log-every 100 --stats-every 200 --eval-episodes 0 --no-cuda --no-progress"
    ).split(),
}
# a budget that does not end during a test, one that ends quickly, and a longer one to resume to
LONG = {
    "clear_impala.py": ["--steps-per-task", "10000000"],
    "reactor.py": ["--total-timesteps", "10000000"],
    "plr_ppo.py": ["--total-timesteps", "10000000"],
    "vracer_refer.py": ["--total-timesteps", "10000000"],
}
SHORT = {
    "clear_impala.py": ["--steps-per-task", "240", "--checkpoint-every", "240"],
    "reactor.py": ["--total-timesteps", "260", "--checkpoint-every", "200"],
    "plr_ppo.py": ["--total-timesteps", "256", "--checkpoint-every", "128"],
    "vracer_refer.py": ["--total-timesteps", "1300", "--checkpoint-every", "500"],
}
# (--steps-per-task is fixed on resume: it places the task boundaries; a CLEAR run is extended by whole cycles)
RESUME_TO = {
    "clear_impala.py": ["--num-cycles", "3"],
    "reactor.py": ["--total-timesteps", "400"],
    "plr_ppo.py": ["--total-timesteps", "384"],
    "vracer_refer.py": ["--total-timesteps", "2000"],
}
# the step each resumed run reaches (CLEAR: 3 cycles of 2 tasks x 240 steps)
RESUMED_END = {"clear_impala.py": 1440, "reactor.py": 400, "plr_ppo.py": 384, "vracer_refer.py": 2000}
CHANGES_EXPERIMENT = {
    "clear_impala.py": ["--env-ids", "MiniGrid-Empty-5x5-v0", "MiniGrid-Empty-6x6-v0"],
    "reactor.py": ["--env-id", "ALE/Breakout-v5"],
    "plr_ppo.py": ["--env-id", "bigfish"],
    "vracer_refer.py": ["--env-id", "Walker2d-v5"],
}
SCRIPTS = list(TINY)


def environment():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_run_left_behind():
    """After each test, SIGKILL the process group of every run it started that is still there (a failed assertion
    must not leave a run training beside the next tests)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start(tmp_path, script, *flags, ignore_sigint=False):
    """The script in its own session (process group = its pid); stdout and stderr to files under tmp_path."""
    out = open(tmp_path / "stdout.txt", "w")
    err = open(tmp_path / "stderr.txt", "w")

    def preexec():
        os.setsid()
        if ignore_sigint:  # as a shell starts a background job
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-u", os.path.join(ROOT, script), *flags],
        cwd=tmp_path,
        env=environment(),
        stdout=out,
        stderr=err,
        preexec_fn=preexec,
    )
    STARTED.append(proc)
    return proc


def wait_for_metrics(tmp_path, proc, timeout=120.0, learning=False):
    """Wait until the run has logged a record (its actors are up; with `learning`, a `losses/` record: the learner
    is training), return the run folder."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        for run in (tmp_path / "runs").glob("*") if (tmp_path / "runs").exists() else []:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and metrics.stat().st_size > 0 and (not learning or '"losses/' in metrics.read_text()):
                return run
        time.sleep(0.5)
    raise AssertionError("no metrics within the time limit")


def finish(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the run did not stop within {timeout} s")


def processes_left(pgid: int, timeout: float = 5.0) -> list[int]:
    """Members of the run's process group still alive after `timeout` s (the resource tracker exits a moment after
    the last process that holds its pipe)."""
    deadline = time.time() + timeout
    while (left := group_members(pgid)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def assert_clean_end(tmp_path, proc):
    left = processes_left(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, [cmdline(p) for p in left]
    err = (tmp_path / "stderr.txt").read_text()
    assert "leaked semaphore" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "signum, ignore_sigint", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "SIGINT-inherited-ignored"]
)
def test_signal_stops_every_process_and_writes_the_summary(tmp_path, script, signum, ignore_sigint):
    proc = start(tmp_path, script, *TINY[script], *LONG[script], ignore_sigint=ignore_sigint)
    run = wait_for_metrics(tmp_path, proc)
    os.kill(proc.pid, signum)
    assert finish(proc, timeout=60) == 128 + signum
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == f"interrupted by {signal.Signals(signum).name}"
    assert_clean_end(tmp_path, proc)


def wait_for_output(tmp_path, proc, text, timeout=60.0):
    """Wait until the run's stdout holds `text`."""
    deadline = time.time() + timeout
    while text not in (tmp_path / "stdout.txt").read_text():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_signal_during_start_up_stops_cleanly_with_the_summary(tmp_path, script):
    """SIGTERM as soon as the run folder exists, while the script still builds its networks, memory and processes:
    the signal waits for the main loop's first check, then the run stops as from any other moment."""
    proc = start(tmp_path, script, *TINY[script], *LONG[script])
    wait_for_output(tmp_path, proc, "run directory: ")
    os.kill(proc.pid, signal.SIGTERM)
    assert finish(proc, timeout=60) == 143
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "interrupted by SIGTERM"
    assert_clean_end(tmp_path, proc)


OTHER_START_METHOD = {
    "clear_impala.py": "spawn",
    "reactor.py": "spawn",
    "plr_ppo.py": "forkserver",
    "vracer_refer.py": "forkserver",
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_learner_killed_by_sigkill_leaves_no_process_behind(tmp_path, script):
    """SIGKILL of the main process (out of memory, pre-emption) while it trains, with the start method the other
    tests do not use: every actor, worker, fork server and resource tracker of its group is gone within 15 s."""
    flags = [*TINY[script], *LONG[script], "--start-method", OTHER_START_METHOD[script]]
    proc = start(tmp_path, script, *flags)
    wait_for_metrics(tmp_path, proc, learning=True)
    assert len(group_members(proc.pid)) > 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = processes_left(proc.pid, timeout=15.0)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, [cmdline(p) for p in left]


def test_a_dead_fork_server_is_named_as_such(tmp_path):
    proc = start(tmp_path, "clear_impala.py", *TINY["clear_impala.py"], *LONG["clear_impala.py"])
    run = wait_for_metrics(tmp_path, proc)
    members = group_members(proc.pid)
    servers = [p for p in members if "multiprocessing.forkserver import main" in cmdline(p) and parent(p) == proc.pid]
    assert len(servers) == 1, [cmdline(p)[:120] for p in members]
    os.kill(servers[0], signal.SIGKILL)
    assert finish(proc, timeout=30) == 1
    assert "the fork server died" in json.loads((run / "summary.json").read_text())["stop_reason"]
    left = processes_left(proc.pid, timeout=15.0)
    assert not left, [cmdline(p) for p in left]


def parent(pid: int) -> int:
    """The parent pid of `pid` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_checkpoint_that_cannot_be_written_stops_the_run_with_one_line(tmp_path, script):
    """The checkpoint's path taken by a folder (as an unwritable run folder would, for root too): the run stops at
    its next checkpoint through the normal end (one "stopped:" line, summary.json with the reason, exit 1)."""
    proc = start(tmp_path, script, *TINY[script], *LONG[script], "--checkpoint-every", "1")
    wait_for_output(tmp_path, proc, "run directory: ")
    (run,) = (tmp_path / "runs").iterdir()
    blocked = run / "checkpoint.pt"
    while not blocked.is_dir():
        # the run may write a checkpoint between our two calls: try again
        blocked.unlink(missing_ok=True)
        try:
            blocked.mkdir()
        except FileExistsError:
            pass
    assert finish(proc, timeout=90) == 1
    out = (tmp_path / "stdout.txt").read_text()
    assert "stopped: checkpoint.pt not written: " in out, out[-2000:]
    assert json.loads((run / "summary.json").read_text())["stop_reason"].startswith("checkpoint.pt not written: ")
    assert_clean_end(tmp_path, proc)


def actor_or_worker(pid: int, main_pid: int) -> bool:
    """A process the run started to act: a spawned child, or a child of the fork server (not the server itself)."""
    line = cmdline(pid)
    if pid == main_pid or "resource_tracker" in line:
        return False
    if "forkserver" in line:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) != main_pid
    return "spawn_main" in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_killed_actor_stops_the_run_with_its_reason(tmp_path, script):
    proc = start(tmp_path, script, *TINY[script], *LONG[script])
    run = wait_for_metrics(tmp_path, proc, learning=True)  # the learner is training: it must still notice
    victims = [p for p in group_members(proc.pid) if actor_or_worker(p, proc.pid)]
    assert victims, [cmdline(p) for p in group_members(proc.pid)]
    os.kill(victims[0], signal.SIGKILL)
    assert finish(proc, timeout=30) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert "died" in summary["stop_reason"] and "-9" in summary["stop_reason"], summary["stop_reason"]
    left = processes_left(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, [cmdline(p) for p in left]


def run(tmp_path, script, *flags, timeout=240):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *flags],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_takes_the_checkpoints_flags_and_continues_the_same_run(tmp_path, script):
    first = run(tmp_path, script, *TINY[script], *SHORT[script], "--learning-rate", "0.000123")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    ckpt = run_dir / "checkpoint.pt"
    ckpt_step = torch.load(ckpt, weights_only=False)["global_step"]
    with open(run_dir / "metrics.jsonl", "a") as f:  # as if logged after the checkpoint, before a crash
        f.write(json.dumps({"global_step": ckpt_step + 10**9, "time": 0.0, "test/after_checkpoint": 1.0}) + "\n")
    refused = run(tmp_path, script, "--resume", str(ckpt), *CHANGES_EXPERIMENT[script], timeout=60)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1].startswith("error: --resume: ")
    second = run(tmp_path, script, "--resume", str(ckpt), *RESUME_TO[script])  # no other flag: the checkpoint's
    assert second.returncode == 0, second.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]  # the same folder, no new run
    args = json.loads((run_dir / "args.json").read_text())
    assert args["learning_rate"] == pytest.approx(0.000123)  # a flag of the first command, kept
    assert args[RESUME_TO[script][0][2:].replace("-", "_")] == int(RESUME_TO[script][1])  # the given flag wins
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["global_step"] for r in rows]
    times = [r["time"] for r in rows]
    assert not any("test/after_checkpoint" in r for r in rows)  # what followed the checkpoint was dropped
    assert steps == sorted(steps) and times == sorted(times) and steps[-1] > ckpt_step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] >= RESUMED_END[script] * 0.9


def junk_checkpoint(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a checkpoint")
    return str(path)


def foreign_checkpoint(tmp_path):
    """A checkpoint of another script (V-RACER's keys, no `script` entry of plr_ppo.py)."""
    path = tmp_path / "vracer.pt"
    torch.save({"args": {"env_id": "Hopper-v5", "seed": 1}, "model": {}, "global_step": 10, "run_name": "x"}, path)
    return str(path)


BAD_INPUT = [
    ("clear_impala.py", ["--resume", junk_checkpoint]),
    ("clear_impala.py", ["--buffer-frames", "-7"]),
    ("clear_impala.py", ["--gamma", "1.5"]),
    ("clear_impala.py", ["--minigrid-max-steps", "0"]),
    ("reactor.py", ["--learning-rate", "-1"]),
    ("reactor.py", ["--total-timesteps", "0"]),
    ("reactor.py", ["--lstm-size", "0"]),
    ("reactor.py", ["--learning-starts", "-1"]),
    ("vracer_refer.py", ["--buffer-size", "100000000000"]),
    ("vracer_refer.py", ["--hidden-size", "0"]),
    ("vracer_refer.py", ["--total-timesteps", "-3"]),
    ("plr_ppo.py", ["--num-workers", "-1"]),
    ("plr_ppo.py", ["--resume", foreign_checkpoint]),
    ("plr_ppo.py", ["--total-timesteps", "1000"]),
    ("vracer_refer.py", ["--leraning-rate", "3"]),
    ("reactor.py", ["--learning-rate", "abc"]),
    ("plr_ppo.py", ["--seed"]),
    ("clear_impala.py", ["--seed", "-1"]),
    ("vracer_refer.py", ["--seed", "4294967296"]),
    ("plr_ppo.py", ["--seed", "-1"]),
    ("reactor.py", ["--resume", lambda tmp_path: str(tmp_path)]),
    ("reactor.py", ["--replay-size", "100000000000"]),
]


@pytest.mark.parametrize(
    "script, flags",
    BAD_INPUT,
    ids=[f"{s}:{' '.join(f if isinstance(f, str) else f.__name__ for f in fl)}" for s, fl in BAD_INPUT],
)
def test_bad_input_stops_at_start_up_with_one_error_line(tmp_path, script, flags):
    flags = [f(tmp_path) if callable(f) else f for f in flags]
    r = run(tmp_path, script, *flags, "--no-cuda", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists(), r.stderr[-2000:]

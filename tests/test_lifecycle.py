"""The life of a run, the same for all four scripts (README "Conventions"): signals, dead actors, resume, bad input.

Each script runs for real in a subprocess, in its own process group, so that every process it starts can be found.
- SIGINT (also when the run was started with SIGINT ignored, as a background job is) and SIGTERM stop every
  process within seconds, write summary.json with the reason, and exit 128 + signal, with no traceback and no
  leaked-semaphore warning;
- a SIGKILLed actor or env worker stops the run with its reason and exit code 1, leaving no process behind;
- `--resume` follows the one rule of common/args.py: the checkpoint's flags, only given flags override, flags that
  change the experiment refused; the resumed run continues in the same folder and its metrics never go back;
- bad input stops the script at start-up with one `error:` line and no traceback.
What ends before the run folder (bad input, a refused resume, `--track` without wandb, `runs` a file) runs each
script's real `__main__` in this process (`run_main_in_process`: no interpreter and imports to start, 0.1 s instead
of 2-6 s a case); where a mechanism lives in common/ and every script reaches it the same way, one script runs it for
real and the reason is in the test's docstring.
"""

import ast
import json
import os
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import threading
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
        "--num-actors 2 --replay-size 1200 --learning-starts 100 --acting-learning-ratio 60 --ratio-slack 32 "
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
def test_signal_stops_every_process_and_writes_the_summary(tmp_path, script):
    """Contract: SIGTERM while the run trains stops every process, writes summary.json with the reason and exits 143,
    no traceback. Each script gets both stop signals, each at one moment: SIGTERM here, SIGINT (inherited as ignored,
    the harder case) during start-up in the next test; both go through one handler (common/processes.py, whose
    test_common_run.py tests record and raise every stop signal alike)."""
    proc = start(tmp_path, script, *TINY[script], *LONG[script])
    run = wait_for_metrics(tmp_path, proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert finish(proc, timeout=60) == 143
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted by SIGTERM"
    assert_clean_end(tmp_path, proc)


def wait_for_output(tmp_path, proc, text, timeout=60.0):
    """Wait until the run's stdout holds `text`."""
    deadline = time.time() + timeout
    while text not in (tmp_path / "stdout.txt").read_text():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_signal_during_start_up_stops_cleanly_with_the_summary(tmp_path, script):
    """Contract: SIGINT as soon as the run folder exists, while the script still builds its networks, memory and
    processes, in a run started with SIGINT ignored (as a shell starts a background job: the signal must not be
    lost): the signal waits for the first check, then the run stops as from any other moment (exit 130, summary.json
    "interrupted by SIGINT", no process left, no traceback)."""
    proc = start(tmp_path, script, *TINY[script], *LONG[script], ignore_sigint=True)
    wait_for_output(tmp_path, proc, "run directory: ")
    os.kill(proc.pid, signal.SIGINT)
    assert finish(proc, timeout=60) == 130
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "interrupted by SIGINT"
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


def test_a_full_disk_at_a_checkpoint_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Contract: the disk fills up after a first checkpoint (the learner's file size limit lowered below a checkpoint's
    size: a real failed write, for which torch.save raises RuntimeError as on a full disk): the run stops at its next
    checkpoint with one `error: checkpoint.pt not written: ...` line, exit 1, no traceback, the previous checkpoint
    intact and summary.json (small enough) written with the reason. One script, clear_impala.py (actors, test actors,
    a fork server, and a file written after its loop): the failed write is common/checkpoint.py's CheckpointFailed,
    a StopRun that every script's loop handles as it handles a dead actor (test_a_killed_actor_stops_the_run_with_its_
    reason, all four), the line and summary.json are common/processes.py's finish_run, and each script writes its
    checkpoints only through save_run_checkpoint (test_each_script_writes_its_checkpoints_through_common)."""
    script = "clear_impala.py"
    proc = start(tmp_path, script, *TINY[script], *LONG[script], "--checkpoint-every", "1")
    wait_for_output(tmp_path, proc, "run directory: ")
    (run,) = (tmp_path / "runs").iterdir()
    checkpoint = run / "checkpoint.pt"
    deadline = time.time() + 120
    while not checkpoint.exists():
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.05)
    limit = checkpoint.stat().st_size - 1
    # the other files are far smaller: the next checkpoint is the first write to meet the limit
    others = [path for path in run.iterdir() if "checkpoint.pt" not in path.name]
    assert max(path.stat().st_size for path in others) < limit // 2, [(p.name, p.stat().st_size) for p in others]
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
    assert finish(proc, timeout=90) == 1
    err = (tmp_path / "stderr.txt").read_text().strip().splitlines()
    assert err[-1] == "error: checkpoint.pt not written: [Errno 27] File too large", err[-20:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "checkpoint.pt not written: [Errno 27] File too large"
    kept = torch.load(checkpoint, weights_only=False)
    assert kept["script"] == script and 0 < kept["global_step"] <= summary["global_step"]
    assert not any(".tmp" in name for name in os.listdir(run))
    assert_clean_end(tmp_path, proc)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_writes_its_checkpoints_through_common(script):
    """Contract: a script writes its checkpoint with common/checkpoint.py's save_run_checkpoint (atomic; a failed
    write is CheckpointFailed, one line) and never calls torch.save itself, so that the full-disk run above, on one
    script, holds for all four."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    called = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    assert "save_run_checkpoint" in called and "torch.save" not in called and "save_checkpoint" not in called


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


def run(tmp_path, script, *flags, timeout=240, cwd=None):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *flags],
        cwd=cwd or tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def run_main_in_process(monkeypatch, capsys):
    """`run_main_in_process(tmp_path, script, *flags)` runs the script's real `__main__` in this process (runpy, with
    `flags` as its command line and tmp_path as its working folder) up to its start-up stop, and returns the
    SystemExit's message and what was printed on stderr. A run that got past its checks would make its folder:
    start_run then closes it and fails the test (the run never starts in the test process). What running a script's
    `__main__` changes in this process (signal handlers, sys.stdout and the hooks, common.processes' state) is put
    back afterwards."""
    import common.logger
    from common import processes

    handlers = {signum: signal.getsignal(signum) for signum in processes.STOP_SIGNALS}
    for name in ("stdout", "argv", "excepthook"):
        monkeypatch.setattr(sys, name, getattr(sys, name))
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(processes, "_exit_before_run", False)
    monkeypatch.setattr(processes, "_run_logger", None)
    real_start_run = common.logger.start_run

    def start_run_fails(*args):
        real_start_run(*args).close()
        processes._run_logger = None
        raise AssertionError("the script got past its start-up checks: it made its run folder")

    monkeypatch.setattr(common.logger, "start_run", start_run_fails)

    def run_main(tmp_path, script, *flags) -> tuple[str, str]:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [script, *flags])
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        return str(stop.value.code), capsys.readouterr().err

    yield run_main
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    processes._received_signals.clear()


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_takes_the_checkpoints_flags_and_continues_the_same_run(tmp_path, script, run_main_in_process):
    """Contract: --resume takes the checkpoint's flags (given ones override, experiment-changing ones are refused)
    and continues in the folder that holds the checkpoint, also from another working folder, with metrics that never
    go back."""
    first = run(tmp_path, script, *TINY[script], *SHORT[script], "--learning-rate", "0.000123")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    ckpt = run_dir / "checkpoint.pt"
    ckpt_step = torch.load(ckpt, weights_only=False)["global_step"]
    with open(run_dir / "metrics.jsonl", "a") as f:  # as if logged after the checkpoint, before a crash
        f.write(json.dumps({"global_step": ckpt_step + 10**9, "time": 0.0, "test/after_checkpoint": 1.0}) + "\n")
    # refused at start-up (in this process: the same parse_run_args as a second interpreter's)
    refused, printed = run_main_in_process(tmp_path, script, "--resume", str(ckpt), *CHANGES_EXPERIMENT[script])
    assert refused.startswith("error: --resume: ") and "\n" not in refused and printed == "", (refused, printed)
    # from another working folder, a relative path: the run continues in the folder that holds the checkpoint
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    relative = os.path.relpath(ckpt, elsewhere)
    second = run(tmp_path, script, "--resume", relative, *RESUME_TO[script], cwd=elsewhere)  # no other flag given
    assert second.returncode == 0, second.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]  # the same folder, no new run
    assert not (elsewhere / "runs").exists()
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
    ("clear_impala.py", ["--buffer-size", "-7"]),
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
def test_bad_input_stops_at_start_up_with_one_error_line(tmp_path, script, flags, run_main_in_process):
    """Contract: bad input stops the script at start-up with one `error:` line (the SystemExit's message, which the
    interpreter prints on stderr with exit 1), nothing else on stderr, no traceback (any other exception fails here),
    before any run folder."""
    flags = [f(tmp_path) if callable(f) else f for f in flags]
    message, printed = run_main_in_process(tmp_path, script, *flags, "--no-cuda")
    assert message.startswith("error: ") and "\n" not in message and printed == "", (message, printed)
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# The edges of a run: the first instants, a starting env worker, stdout, the folder, optional packages.
# Where the mechanism lives in common/ and every script reaches it the same way (install_stop_handling, start_run,
# parse_run_args, MiniGridVecEnv), one script runs it for real and `test_each_script_installs_stop_handling_first`
# checks that the four scripts reach it.
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_installs_stop_handling_before_its_heavy_imports(script):
    """Contract: each script's first statement after its standard-library imports is `install_stop_handling()`
    under `if __name__ == "__main__"` (not in an actor's or a test's import), before numpy and torch are imported:
    a signal during those imports is handled, not a traceback, and not lost where SIGINT was inherited ignored."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    early = [
        node.lineno
        for node in tree.body
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "__name__ == '__main__'"
        and [ast.unparse(statement) for statement in node.body] == ["install_stop_handling()"]
    ]
    heavy = [
        node.lineno
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(name.split(".")[0] not in sys.stdlib_module_names for name in imported_names(node))
        and imported_names(node) != ["common.processes.install_stop_handling"]
    ]
    assert len(early) == 1 and early[0] < min(heavy), (early, heavy)


def imported_names(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [f"{node.module}.{alias.name}" for alias in node.names]


def wait_for_numpy(proc, timeout=60.0):
    """Wait until numpy's extension is loaded into the process: its heavy imports are under way (torch follows)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                if "_multiarray_umath" in f.read():
                    return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError("the script did not reach its imports")


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["SIGINT", "SIGINT-inherited-ignored"])
def test_ctrl_c_during_the_imports_ends_the_script_at_once_with_one_line(tmp_path, ignore_sigint):
    """Contract: Ctrl-C while the script still imports (before any run folder) ends it with one `stopped:` line and
    exit 130: no KeyboardInterrupt traceback, no folder; also when SIGINT was inherited ignored (a background job),
    where it must not be lost. One script: the handler is common/processes.py's, installed first by each script."""
    script = "vracer_refer.py"
    proc = start(tmp_path, script, *TINY[script], *LONG[script], ignore_sigint=ignore_sigint)
    wait_for_numpy(proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert finish(proc, timeout=60) == 130
    out = (tmp_path / "stdout.txt").read_text().strip().splitlines()
    assert out == ["stopped: interrupted by SIGINT before the run started"], out
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text() and not (tmp_path / "runs").exists()
    assert_clean_end(tmp_path, proc)


def test_ctrl_c_while_an_env_worker_starts_stops_the_run_as_an_interruption(tmp_path):
    """Contract: Ctrl-C (SIGINT to the whole process group) while plr_ppo.py's MiniGrid env worker is still
    importing: the worker, started with SIGINT blocked and ignoring it from its first statement, does not die; the
    run (waiting for the worker's first reset, outside the script's loop) stops as interrupted: exit 130,
    summary.json "interrupted by SIGINT", no traceback, no process left, and not "MiniGrid worker 0 died"."""
    proc = start(tmp_path, "plr_ppo.py", *TINY["plr_ppo.py"], *LONG["plr_ppo.py"])
    deadline = time.time() + 120
    while not [p for p in group_members(proc.pid) if actor_or_worker(p, proc.pid)]:
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    assert finish(proc, timeout=60) == 130
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "interrupted by SIGINT"
    assert_clean_end(tmp_path, proc)


def test_a_closed_stdout_stops_the_run_cleanly_with_the_summary(tmp_path):
    """Contract: stdout's reader going away (`| head`) stops the run as a signal does: no BrokenPipeError traceback,
    exit 141, summary.json "interrupted by SIGPIPE (stdout closed)", no process left. One script: the guard is
    sys.stdout itself (install_stop_handling), so every print of every script goes through it."""
    script = "plr_ppo.py"
    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-u", os.path.join(ROOT, script), *TINY[script], *LONG[script], "--progress"],
        cwd=tmp_path,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=err,
        start_new_session=True,
    )
    STARTED.append(proc)
    while not proc.stdout.readline().startswith(b"step "):  # as `| head -n 3` would: read a few lines, then leave
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
    proc.stdout.close()
    assert finish(proc, timeout=60) == 141
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "interrupted by SIGPIPE (stdout closed)"
    assert_clean_end(tmp_path, proc)


def user_namespaces_work() -> bool:
    """True where `unshare -r -m` can mount a tmpfs (no root needed where user namespaces are allowed)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o ro,size=64k tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_being_a_file_stops_at_start_up_with_one_error_line(tmp_path, script, run_main_in_process):
    """Contract: `runs` being a file stops each script at its run folder with one `error:` line naming the folder and
    the reason, no traceback, and leaves the file alone (the real start_run, in this process)."""
    (tmp_path / "runs").write_text("not a folder")
    message, printed = run_main_in_process(tmp_path, script, *TINY[script], *LONG[script])
    assert message.startswith("error: run folder runs/") and "\n" not in message and printed == "", (message, printed)
    assert message.endswith("not written: [Errno 20] Not a directory: 'runs'") and (tmp_path / "runs").is_file()


def test_a_read_only_working_folder_stops_at_start_up_with_one_error_line(tmp_path):
    """Contract: a read-only working folder (a read-only tmpfs in a user and mount namespace: read-only even for
    root) stops the script at start-up with one `error:` line on stderr, exit 1, no traceback. One script, in a real
    interpreter: every script makes its folder through common/logger.py's start_run, whose error line for `runs`
    being a file the previous test reads in all four (a full disk at start: test_common_run.py)."""
    if not user_namespaces_work():
        pytest.skip("unshare -r -m cannot mount a tmpfs here (user namespaces disabled): no read-only folder")
    script = "plr_ppo.py"
    (tmp_path / "ro").mkdir()
    mount = 'mount -t tmpfs -o ro,size=64k tmpfs "$0" && cd "$0" && exec "$@"'
    command = [sys.executable, os.path.join(ROOT, script), *TINY[script], *LONG[script]]
    command = ["unshare", "-r", "-m", "sh", "-c", mount, str(tmp_path / "ro"), *command]
    r = subprocess.run(command, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: run folder runs/MultiRoom-N4-Random__plr_ppo__1__"), lines
    assert lines[0].endswith("not written: [Errno 30] Read-only file system: 'runs'"), lines


@pytest.mark.parametrize("script", SCRIPTS)
def test_track_without_wandb_stops_at_start_up_with_one_error_line(tmp_path, monkeypatch, script, run_main_in_process):
    """Contract: `--track` where wandb is not installed stops the script at start-up with one `error:` line, before
    any run folder (not a ModuleNotFoundError traceback once runs/ exists), wandb hidden where it is installed."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    message, printed = run_main_in_process(tmp_path, script, *TINY[script], *LONG[script], "--track")
    assert message == "error: --track needs wandb, which is not installed (pip install wandb, or leave out --track)"
    assert printed == "" and not (tmp_path / "runs").exists()

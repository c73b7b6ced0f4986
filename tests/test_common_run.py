"""common/logger.py, common/checkpoint.py, common/processes.py."""

import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from common.checkpoint import load_checkpoint, rng_state, save_checkpoint, seed_everything, select_device, set_rng_state
from common.logger import RunLogger, make_run_name, read_metrics
from common.processes import ActorDied, ProcessGroup, available_cores, set_learner_threads


@dataclass
class _Args:
    env_id: str = "ALE/Pong-v5"
    seed: int = 3
    learning_rate: float = 2.5e-4


def test_run_logger_writes_parseable_files(tmp_path, capsys):
    run_name = make_run_name("ALE/Pong-v5", "test", 3)
    assert "/" not in run_name and run_name.startswith("ALE-Pong-v5__test__3__")
    logger = RunLogger(run_name, _Args(), root=tmp_path)
    logger.log(100, {"charts/SPS": 12.5, "losses/value_loss": torch.tensor(0.25), "charts/episodic_return": np.float32(-21)})
    logger.log(200, {"charts/SPS": 13, "losses/value_loss": float("nan")})
    logger.progress(200, 13.0, episodic_return=-20.5, loss_name="value_loss", loss=0.25, extra="lr 2.5e-04")
    logger.summary({"final_return": -20.0, "per_task": {"a": 1.0}})
    logger.close()
    logger.close()  # idempotent
    records = read_metrics(tmp_path / run_name / "metrics.jsonl")
    assert records[0]["global_step"] == 100 and records[0]["charts/SPS"] == 12.5
    assert records[0]["losses/value_loss"] == 0.25 and records[0]["charts/episodic_return"] == -21.0
    assert records[1]["losses/value_loss"] == "nan"  # JSON has no NaN: kept as a string, file stays parseable
    summary = json.loads((tmp_path / run_name / "summary.json").read_text())
    assert summary["final_return"] == -20.0 and summary["per_task"] == {"a": 1.0} and summary["run_name"] == run_name
    assert json.loads((tmp_path / run_name / "args.json").read_text())["learning_rate"] == 2.5e-4
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / run_name))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "200" in line and "SPS" in line and "-20.50" in line and "value_loss 0.25" in line


def test_tensorboard_scalars_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger("tb", _Args(), root=tmp_path, progress=False)
    for step in range(3):
        logger.log(step * 10, {"charts/SPS": step + 1.0})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("charts/SPS")] == [1.0, 2.0, 3.0]
    assert [e.step for e in acc.Scalars("charts/SPS")] == [0, 10, 20]


def test_progress_can_be_switched_off(tmp_path, capsys):
    logger = RunLogger("quiet", _Args(), root=tmp_path, progress=False)
    logger.progress(1, 1.0)
    logger.close()
    assert capsys.readouterr().out == f"run directory: {tmp_path / 'quiet'}\n"  # the start-up line only, no progress


def test_checkpoint_round_trip_and_atomicity(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt" / "checkpoint.pt"
    save_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 7, "rng": rng_state()})
    assert os.listdir(path.parent) == ["checkpoint.pt"], "no temporary file is left behind"
    ckpt = load_checkpoint(path)
    model2 = torch.nn.Linear(3, 2)
    model2.load_state_dict(ckpt["model"])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert ckpt["global_step"] == 7

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # a failed write leaves the old checkpoint intact
        save_checkpoint(path, {"bad": Unpicklable()})
    assert load_checkpoint(path)["global_step"] == 7
    assert os.listdir(path.parent) == ["checkpoint.pt"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="could not be read"):
        load_checkpoint(tmp_path / "junk.pt")


def test_rng_state_round_trip_and_seeding():
    seed_everything(5)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
    state = rng_state()
    b = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == b
    assert select_device(False).type == "cpu"
    assert select_device(True).type == ("cuda" if torch.cuda.is_available() else "cpu")


def _crashing_actor(delay):
    time.sleep(delay)
    raise ValueError("env exploded")


def _actor_on_a_full_disk(path):
    with open(path, "wb") as f:
        f.write(b"a replay")
        raise OSError(28, "No space left on device", path)


def _waiting_actor(stop_event):
    while not stop_event.is_set():
        time.sleep(0.01)


def _spinning_actor(stop_event, started, i):
    started[i] = 1
    while not stop_event.is_set():  # polls as fast as it can, so a kill lands inside is_set() most of the time
        pass


def test_stop_does_not_hang_after_actors_are_killed_while_polling_the_stop_flag():
    # With multiprocessing.Event, is_set() takes a lock; an actor SIGKILLed inside it leaves the lock held and
    # stop()'s set() then blocks forever. Each kill below lands inside is_set() with high probability.
    ctx = mp.get_context("spawn")
    group = ProcessGroup(ctx)
    started = ctx.RawArray("b", 8)
    for i in range(8):
        group.start(_spinning_actor, (group.stop_event, started, i), f"actor-{i}")
    deadline = time.time() + 60
    while sum(started) < 8 and time.time() < deadline:
        time.sleep(0.05)
    assert sum(started) == 8
    time.sleep(0.2)
    for proc in group.procs:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)
    stopper = threading.Thread(target=group.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "ProcessGroup.stop() hung on a lock held by a killed actor"
    assert group.stop_event.is_set()


def test_process_group_reports_dead_actor_and_stops():
    group = ProcessGroup(mp.get_context("spawn"))
    group.start(_waiting_actor, (group.stop_event,), "actor-0")
    group.start(_crashing_actor, (0.1,), "actor-1")
    deadline = time.time() + 30
    with pytest.raises(ActorDied) as err:
        while time.time() < deadline:
            group.check()
            time.sleep(0.05)
    assert "actor-1 died (exit code 1)" in str(err.value) and "env exploded" in str(err.value)
    assert "Traceback" in err.value.traceback
    group.stop()
    assert all(not p.is_alive() for p in group.procs)
    group.check()  # no error while stopping
    group.stop()  # idempotent


def test_a_child_that_meets_a_full_disk_stops_the_run_in_one_line(tmp_path):
    """Contract: a child whose write fails on the disk (an actor saving its replay at a checkpoint on a full disk)
    stops the run with RunFolderFailed, one line naming the child and the failed write, not "died" with a traceback;
    finish_run then prints it as its one `error:` line."""
    from common.processes import RunFolderFailed

    group = ProcessGroup(mp.get_context("spawn"))
    group.start(_actor_on_a_full_disk, (str(tmp_path / "replay.npz"),), "actor-0")
    deadline = time.time() + 60
    with pytest.raises(RunFolderFailed) as err:
        while time.time() < deadline:
            group.check()
            time.sleep(0.05)
    group.stop()
    expected = f"actor-0 could not write to the run folder: [Errno 28] No space left on device: '{tmp_path / 'replay.npz'}'"
    assert str(err.value) == expected and not isinstance(err.value, ActorDied)


def test_stop_terminates_at_once_the_children_still_importing_and_lets_running_ones_return():
    """Contract (stop time): a child that has not reached its target yet (its interpreter still imports: it cannot
    see the stop flag) is terminated at once by stop() instead of using up the join budget; a child in its loop
    returns by itself when the flag is set (exit code 0, no kill)."""
    ctx = mp.get_context("spawn")
    group = ProcessGroup(ctx)
    started = ctx.RawArray("b", 1)
    group.start(_spinning_actor, (group.stop_event, started, 0), "actor-0")
    deadline = time.time() + 60
    while not started[0] and time.time() < deadline:
        time.sleep(0.05)
    group.start(_waiting_actor, (group.stop_event,), "actor-1")
    group.stop()
    assert [proc.exitcode for proc in group.procs] == [0, -signal.SIGTERM]


START_FIRST_CHILD = """
import multiprocessing, signal, sys, time
from common.processes import start_child

proc = multiprocessing.get_context(sys.argv[1]).Process(target=time.sleep, args=(30,))
start_child(proc)  # the first child of this process: the resource tracker is not running yet
with open(f"/proc/{proc.pid}/status") as f:
    blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
proc.kill()
print(all(blocked >> (signum - 1) & 1 for signum in (signal.SIGINT, signal.SIGHUP)))
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_the_first_child_starts_with_the_terminal_signals_blocked(start_method):
    """Contract: start_child's child starts with SIGINT and SIGHUP blocked, also the first child of a process, whose
    start also starts the resource tracker (and, under forkserver, the fork server): CPython's
    resource_tracker.ensure_running unblocks SIGINT once the tracker runs, so a child started after it in the same
    call would see a Ctrl-C during its imports as a KeyboardInterrupt traceback. Read from the kernel (/proc), at once."""
    out = subprocess.run(
        [sys.executable, "-c", START_FIRST_CHILD, start_method],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.parametrize("actors", [0, 1, 2, 64])
def test_set_learner_threads_gives_the_learner_the_cores_the_actors_leave(actors, monkeypatch, capsys):
    cores = 3  # pretend: the rule must not depend on this machine's core count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert available_cores() == cores
    before = torch.get_num_threads()
    try:
        n = set_learner_threads(actors)
        assert n == max(1, cores - actors) == torch.get_num_threads()
        assert capsys.readouterr().out == f"threads: learner {n} ({cores} cores, {actors} actor processes, 1 thread each)\n"
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before


def test_available_cores_falls_back_to_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert available_cores() == 5


@pytest.mark.parametrize("what", [None, "rollout"])
def test_check_memory_names_what_it_measures_and_the_flag_that_sizes_it(what, monkeypatch, capsys):
    """Contract: check_memory prints what the buffer needs at start-up, under the name given (`what`, by default
    "replay memory": the replays; plr_ppo.py's rollout passes "rollout"), and refuses one that would take more than
    `fraction` of the available RAM with one `error:` line naming the same thing and the flag that sizes it."""
    from common import processes

    monkeypatch.setattr(processes, "available_memory_bytes", lambda: 10 * 2**30)
    named = {} if what is None else {"what": what}
    name = what or "replay memory"
    processes.check_memory(9 * 2**30, "--buffer-size", **named)
    assert capsys.readouterr().out == f"{name}: 9.00 GiB (10.0 GiB available)\n"
    with pytest.raises(SystemExit) as e:
        processes.check_memory(9 * 2**30 + 1, "--buffer-size", 0.9, **named)
    assert capsys.readouterr().out == f"{name}: 9.00 GiB (10.0 GiB available)\n"
    assert str(e.value.code) == (
        f"error: the {name} needs 9.00 GiB, more than 90% of the 10.0 GiB of RAM available: lower --buffer-size"
    )


def test_run_checkpoint_holds_what_every_resume_reads_and_the_first_checkpoint_step(tmp_path):
    from common.checkpoint import load_run_checkpoint, next_checkpoint_step, save_run_checkpoint

    logger = RunLogger("run", _Args(), root=tmp_path, progress=False)
    random.seed(5)
    torch.manual_seed(5)
    save_run_checkpoint(logger, "a_script.py", _Args(seed=4), 1234, learn_steps=56, np_rng=np.random.default_rng(1))
    draws = random.random(), torch.rand(2)
    ckpt = load_run_checkpoint(logger.dir / "checkpoint.pt", "a_script.py")
    assert ckpt["script"] == "a_script.py" and ckpt["run_name"] == "run" and ckpt["global_step"] == 1234
    assert ckpt["args"] == {"env_id": "ALE/Pong-v5", "seed": 4, "learning_rate": 2.5e-4}
    assert ckpt["learn_steps"] == 56 and ckpt["np_rng"].random() == np.random.default_rng(1).random()
    # the global RNGs as they were at the save: the same draws again after restoring them
    set_rng_state(ckpt["rng"])
    assert random.random() == draws[0] and torch.equal(torch.rand(2), draws[1])
    assert not any(".tmp" in f for f in os.listdir(logger.dir))
    with pytest.raises(SystemExit, match="is a checkpoint of a_script.py, not of reactor.py"):
        load_run_checkpoint(logger.dir / "checkpoint.pt", "reactor.py")
    logger.close()
    assert next_checkpoint_step(0, 100) == 100
    assert next_checkpoint_step(99, 100) == 100
    assert next_checkpoint_step(100, 100) == 200
    assert next_checkpoint_step(250, 100) == 300
    assert next_checkpoint_step(250, 0) is None
    from common.checkpoint import CheckpointSchedule

    # reactor.py's and plr_ppo.py's cadence: once per multiple reached, counted from the (resumed) start step
    schedule = CheckpointSchedule(250, 100)
    assert [schedule.due(step) for step in (299, 300, 300, 450, 499, 500)] == [False, True, False, True, False, True]
    assert not CheckpointSchedule(0, 0).due(10**9)


def test_finish_run_writes_the_model_file_atomically_after_a_normal_end_only(tmp_path, capsys):
    from common.processes import finish_run

    weights = {"weight": torch.arange(6.0).reshape(2, 3)}
    logger = RunLogger("done", _Args(), root=tmp_path, progress=False)
    finish_run(logger, None, {"global_step": 10}, {"model": weights, "args": {"exp_name": "an_exp"}})
    saved = load_checkpoint(logger.dir / "an_exp.model")
    assert torch.equal(saved["model"]["weight"], weights["weight"]) and saved["args"] == {"exp_name": "an_exp"}
    assert not any(".tmp" in f for f in os.listdir(logger.dir))
    assert f"model saved to {logger.dir / 'an_exp.model'}" in capsys.readouterr().out
    assert json.loads((logger.dir / "summary.json").read_text())["stop_reason"] == "completed"
    # a run stopped by a dead actor: no model file, the stop's reason and exit code
    logger = RunLogger("died", _Args(), root=tmp_path, progress=False)
    with pytest.raises(SystemExit) as e:
        finish_run(logger, ActorDied("actor-0 died (exit code -9)"), {}, {"model": weights, "args": {"exp_name": "an_exp"}})
    assert e.value.code == 1 and not (logger.dir / "an_exp.model").exists()
    assert json.loads((logger.dir / "summary.json").read_text())["stop_reason"] == "actor-0 died (exit code -9)"
    # a model file that cannot be written: one error line, exit code 1, the summary says why
    logger = RunLogger("unwritable", _Args(), root=tmp_path, progress=False)
    (logger.dir / "an_exp.model").mkdir()
    with pytest.raises(SystemExit) as e:
        finish_run(logger, None, {}, {"model": weights, "args": {"exp_name": "an_exp"}})
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith("error: an_exp.model not written: ")
    assert json.loads((logger.dir / "summary.json").read_text())["stop_reason"].startswith("an_exp.model not written: ")


def test_signals_are_recorded_and_raised_at_the_next_check_and_stop_reason_names_the_end():
    import signal as sig

    from common.processes import (
        ActorDied,
        CheckpointFailed,
        Interrupted,
        check_stop,
        stop_on_signals,
        stop_reason,
        stop_requested,
    )

    old = sig.getsignal(sig.SIGINT), sig.getsignal(sig.SIGTERM)
    try:
        stop_on_signals()
        check_stop()  # nothing received: no stop
        os.kill(os.getpid(), sig.SIGTERM)
        time.sleep(0.2)  # the handler ran and returned: no exception here
        assert stop_requested()
        with pytest.raises(Interrupted) as e:
            check_stop()
        assert stop_reason(e.value) == ("interrupted by SIGTERM", 143)
        os.kill(os.getpid(), sig.SIGINT)  # a second signal: the first one still names the stop
        time.sleep(0.2)
        with pytest.raises(Interrupted) as e:
            check_stop()
        assert e.value.signum == sig.SIGTERM
        stop_on_signals()  # installing again starts afresh
        check_stop()
    finally:
        sig.signal(sig.SIGINT, old[0])
        sig.signal(sig.SIGTERM, old[1])
    assert stop_reason(None) == ("completed", 0)
    assert stop_reason(Interrupted(sig.SIGINT)) == ("interrupted by SIGINT", 130)
    assert stop_reason(ActorDied("actor-1 died (exit code -9): no traceback")) == (
        "actor-1 died (exit code -9): no traceback",
        1,
    )
    assert stop_reason(CheckpointFailed("checkpoint not written: [Errno 13] Permission denied")) == (
        "checkpoint not written: [Errno 13] Permission denied",
        1,
    )
    assert stop_reason(RuntimeError("MiniGrid worker 0 died (exit code -9)"))[1] == 1
    assert stop_reason(Interrupted(sig.SIGHUP)) == ("interrupted by SIGHUP", 129)
    # a child dead of SIGINT died of the run's own Ctrl-C (the whole process group gets it): the interruption
    from common.processes import died_or_interrupted

    assert isinstance(died_or_interrupted("worker 0 died (exit code -2)", -sig.SIGINT), Interrupted)
    died = died_or_interrupted("worker 0 died (exit code -9)", -sig.SIGKILL, "a traceback")
    assert isinstance(died, ActorDied) and str(died) == "worker 0 died (exit code -9)" and died.traceback == "a traceback"


SIGNALLED_LOGGING_LOOP = """
import os, random, signal, sys, threading, time
from common.logger import RunLogger
from common.processes import Interrupted, check_stop, stop_on_signals

rounds, slow = int(sys.argv[1]), []
for i in range(rounds):
    stop_on_signals()
    logger = RunLogger(f"run{i}", {"seed": i}, progress=False)
    delay = random.uniform(0.0, 0.02)
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    step = 0
    try:
        while True:
            step += 1
            logger.log(step, {"charts/a": step, "charts/b": 0.5, "losses/c": 1.0, "losses/d": 2.0})
            check_stop()
    except Interrupted:
        pass
    closer = threading.Thread(target=logger.close, daemon=True)
    start = time.time()
    closer.start()
    closer.join(timeout=10)
    if closer.is_alive() or time.time() - start > 5:
        print(f"round {i}: close() took {time.time() - start:.1f} s", flush=True)
        os._exit(1)
print("ok", rounds, flush=True)
"""


def test_a_signal_never_breaks_off_logging_so_close_returns_at_once(tmp_path):
    """300 rounds of a logging loop (TensorBoard + metrics.jsonl) each stopped by SIGTERM at a random moment: the
    signal is only recorded and raised at the loop's check, so no round leaves TensorBoard's writer waiting out its
    120 s flush or holding a lock (with a handler that raised on whatever line ran, about 1 round in 300 did)."""
    script = tmp_path / "loop.py"
    script.write_text(SIGNALLED_LOGGING_LOOP)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, str(script), "300"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ok 300", r.stdout[-2000:] + r.stderr[-2000:]


def _sleeping_child(seconds):
    time.sleep(seconds)


def _parent_with_actors(pid_file, start_method):
    """A learner stand-in: starts two actors through ProcessGroup, writes their pids, then waits to be killed."""
    group = ProcessGroup(mp.get_context(start_method))
    for i in range(2):
        group.start(_sleeping_child, (600,), f"actor-{i}")
    with open(pid_file, "w") as f:
        f.write(" ".join(str(p.pid) for p in group.procs))
    time.sleep(600)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_actors_exit_when_their_parent_is_killed(tmp_path, start_method):
    """SIGKILL the parent of a ProcessGroup: its actors read end-of-file on the lifeline and exit within seconds
    (os.getppid() would not tell: under forkserver the actors' parent is the fork server)."""
    pid_file = tmp_path / "pids"
    parent = mp.get_context("spawn").Process(target=_parent_with_actors, args=(str(pid_file), start_method))
    parent.start()
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    actors = [int(p) for p in pid_file.read_text().split()]
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.time() + 15
    while any(alive(pid) for pid in actors) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in actors), [pid for pid in actors if alive(pid)]


def alive(pid: int) -> bool:
    """True while `pid` runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_each_script_runs_help_with_exactly_the_common_files_readme_lists(tmp_path):
    """README's "Copying a script into your project" table: the script, `common/__init__.py` and the listed modules
    alone, in an empty folder, import and print --help (a module missing from the table fails here)."""
    import re
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    rows = re.findall(r"^\| `(\w+\.py)` \| ((?:`\w+\.py`(?:, )?)+) \|$", readme, flags=re.M)
    assert sorted(script for script, _ in rows) == ["clear_impala.py", "plr_ppo.py", "reactor.py", "vracer_refer.py"]
    for script, modules in rows:
        folder = tmp_path / script[:-3]
        (folder / "common").mkdir(parents=True)
        shutil.copy(os.path.join(root, script), folder)
        shutil.copy(os.path.join(root, "common", "__init__.py"), folder / "common")
        for module in re.findall(r"`(\w+\.py)`", modules):
            shutil.copy(os.path.join(root, "common", module), folder / "common")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        r = subprocess.run(
            [sys.executable, script, "--help"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and "usage:" in r.stdout, (script, r.stderr[-1500:])


def test_readme_commands_parse_and_pass_each_scripts_checks(monkeypatch):
    """Every `python <script>.py ...` line of README's bash blocks (except --resume, which needs a run) parses with the
    script's own command line and passes its start-up checks: a renamed or removed flag fails here."""
    import importlib
    import re

    from common.args import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "python" and re.fullmatch(r"\w+\.py", words[1]) and "--resume" not in words:
                commands.append(words[1:])
    assert {c[0] for c in commands} == {"clear_impala.py", "plr_ppo.py", "reactor.py", "vracer_refer.py"}
    for script, *flags in commands:
        module = importlib.import_module(script[: -len(".py")])
        monkeypatch.setattr(sys, "argv", [script, *flags])
        args = cli(module.Args)
        if hasattr(module, "resolve_defaults"):
            args = module.resolve_defaults(args)
        module.validate_args(args)


def test_ci_runs_exactly_readmes_test_command():
    """.ci/run's command is README Quickstart's command 2, line for line (one step per line in both)."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    quickstart = open(os.path.join(root, "README.md")).read().split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S).group(1)
    readme_command = block.split("# 2.", 1)[1].split("\n", 1)[1].strip()
    ci_command = open(os.path.join(root, ".ci", "run")).read().split("(keep the two identical):\n", 1)[1].strip()
    assert ci_command == readme_command
    assert readme_command.endswith("python -m pytest tests -q")


# ----------------------------------------------------------------------------------------------------------------
# The run folder, the disk and the signals at the edges. start_run and install_stop_handling change this
# process (signal handlers, sys.stdout, sys.excepthook, the run of the process): `process_state` puts them back.
@pytest.fixture
def process_state(monkeypatch):
    """What `start_run` and `install_stop_handling` change in this process, restored after the test (a registered
    run would make `finish_run` end the test process: the tests call finish_run on loggers of their own)."""
    from common import processes

    handlers = {signum: signal.getsignal(signum) for signum in processes.STOP_SIGNALS}
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(processes, "_run_logger", None)
    monkeypatch.setattr(processes, "_exit_before_run", False)
    monkeypatch.setattr(processes, "_to_stop", [])
    yield processes
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    processes._received_signals.clear()


def common_args(**changes):
    from common.args import CommonArgs

    return CommonArgs(**({"exp_name": "an_exp", "seed": 3, "progress": False} | changes))


@contextlib.contextmanager
def file_size_limit(limit_bytes: int):
    """RLIMIT_FSIZE in this process: a write that would make any file larger than `limit_bytes` fails with EFBIG, a
    real failed write without root (torch.save then raises RuntimeError with the OSError as its context, as on a
    full disk; Python ignores SIGXFSZ). The soft limit only: it can be raised back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_two_runs_started_in_the_same_second_get_two_folders(tmp_path, monkeypatch, process_state):
    """Contract: a new run never writes into an existing folder. Two start_run calls with the same env, seed,
    exp-name and second get `<name>` and `<name>-2`, each with its own args.json; 16 threads creating the same name
    at once get 16 folders (mkdir is atomic; a check-then-create would hand one folder to two runs)."""
    import common.logger as logger_module
    from common.logger import make_new_folder, start_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(logger_module, "make_run_name", lambda env, exp, seed: f"{env}__{exp}__{seed}__1700000000")
    first = start_run(common_args(), None, "Env-v0")
    second = start_run(common_args(wandb_project_name="other"), None, "Env-v0")
    assert first.dir != second.dir
    assert [first.run_name, second.run_name] == ["Env-v0__an_exp__3__1700000000", "Env-v0__an_exp__3__1700000000-2"]
    assert json.loads((first.dir / "args.json").read_text())["wandb_project_name"] == "replay-rl"
    assert json.loads((second.dir / "args.json").read_text())["wandb_project_name"] == "other"
    first.close()
    second.close()
    barrier = threading.Barrier(16)
    made = []

    def make():
        barrier.wait()
        for _ in range(8):
            made.append(make_new_folder(tmp_path / "race", "run"))

    threads = [threading.Thread(target=make) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == len(made) == 128 and len(os.listdir(tmp_path / "race")) == 128


def test_resume_continues_in_the_checkpoints_folder_from_any_working_folder(tmp_path, monkeypatch, process_state):
    """Contract: `--resume <path>/checkpoint.pt` given from another working folder continues in the checkpoint's
    folder (metrics after the checkpoint dropped there), never in a new ./runs/<same name>/ of the working folder."""
    from common.checkpoint import load_run_checkpoint, save_run_checkpoint
    from common.logger import start_run

    first = RunLogger("Env-v0__an_exp__3__1700000000", common_args(), root=tmp_path / "project" / "runs")
    first.log(10, {"charts/SPS": 1.0})
    save_run_checkpoint(first, "a_script.py", common_args(), 10)
    first.log(20, {"charts/SPS": 2.0})
    first.close()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    path = "../project/runs/Env-v0__an_exp__3__1700000000/checkpoint.pt"
    ckpt = load_run_checkpoint(path, "a_script.py")
    resumed = start_run(common_args(resume=path), ckpt, "Env-v0")
    resumed.log(11, {"charts/SPS": 3.0})
    resumed.close()
    assert resumed.dir == first.dir.resolve() and resumed.run_name == first.run_name
    assert not (tmp_path / "elsewhere" / "runs").exists()
    assert [r["global_step"] for r in read_metrics(first.dir / "metrics.jsonl")] == [10, 11]


def test_a_folder_that_cannot_be_made_or_written_stops_start_up_with_one_line(tmp_path, monkeypatch, process_state):
    """Contract: `runs` being a file, or a disk too full for args.json (a real failed write: RLIMIT_FSIZE), stop
    start_run with one `error:` line (SystemExit, no traceback) and leave no half-made run folder."""
    from common.logger import start_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where the runs folder goes")
    with pytest.raises(SystemExit) as e:
        start_run(common_args(), None, "Env-v0")
    assert str(e.value.code).startswith("error: run folder runs/Env-v0__an_exp__3__") and "\n" not in str(e.value.code)
    assert "Not a directory" in str(e.value.code) and (tmp_path / "runs").is_file()
    (tmp_path / "runs").unlink()
    with file_size_limit(8), pytest.raises(SystemExit) as e:
        start_run(common_args(), None, "Env-v0")
    assert str(e.value.code).startswith("error: run folder runs/Env-v0__an_exp__3__") and "\n" not in str(e.value.code)
    assert "File too large" in str(e.value.code) and os.listdir(tmp_path / "runs") == []
    assert process_state._run_logger is None  # no run started: a signal still ends the script at once


def test_a_checkpoint_on_a_full_disk_fails_in_one_line_and_keeps_the_previous_one(tmp_path):
    """Contract: a full disk at a checkpoint raises CheckpointFailed (one line, which stops the run), the previous
    checkpoint stays intact and no temporary file is left, whichever way the write fails: torch.save's RuntimeError
    ("unexpected pos", the OSError as its context: RLIMIT_FSIZE, as on a full tmpfs) or an OSError at the flush
    (the temporary file a link to /dev/full). An object that cannot be pickled keeps its own error."""
    from common.processes import CheckpointFailed

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"global_step": 1, "weights": torch.zeros(10)})
    big = {"global_step": 2, "weights": torch.zeros(100_000)}
    with file_size_limit(path.stat().st_size + 100), pytest.raises(CheckpointFailed) as e:
        save_checkpoint(path, big)
    assert str(e.value) == "checkpoint.pt not written: [Errno 27] File too large"
    os.symlink("/dev/full", tmp_path / f".checkpoint.pt.tmp{os.getpid()}")
    with pytest.raises(CheckpointFailed, match=r"^checkpoint.pt not written: \[Errno 28\] No space left on device$"):
        save_checkpoint(path, big)
    assert load_checkpoint(path)["global_step"] == 1 and os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_failed_write_mid_run_stops_the_run_once_and_its_end_writes_what_the_disk_allows(tmp_path, capsys, monkeypatch):
    """Contract: a full disk mid-run (metrics.jsonl or TensorBoard, a real failed write) raises RunFolderFailed
    once, which stops the run; later records are dropped; finish_run then ends with one `error:` line and exit 1,
    saying that summary.json could not be written while the disk is full, and writing it once the disk allows.
    metrics.jsonl stays readable (the record cut short is left out)."""
    from common.processes import RunFolderFailed, _quiet_disk_errors_in_threads, finish_run

    # as in a run: TensorBoard's writer thread meeting the full disk prints no traceback (the main thread reports it)
    monkeypatch.setattr(threading, "excepthook", _quiet_disk_errors_in_threads)
    for disk_frees_up in (False, True):
        logger = RunLogger(f"run{disk_frees_up}", _Args(), root=tmp_path, progress=False)
        logger.log(1, {"charts/SPS": 1.0})
        with file_size_limit((logger.dir / "metrics.jsonl").stat().st_size + 10):
            with pytest.raises(RunFolderFailed) as stop:
                for step in range(2, 10_000):
                    logger.log(step, {"charts/SPS": float(step), "losses/value_loss": 0.5})
            assert "not written" in str(stop.value) and "File too large" in str(stop.value)
            logger.log(10_001, {"charts/SPS": 1.0})  # dropped: the run is stopping
            capsys.readouterr()
            if not disk_frees_up:
                with pytest.raises(SystemExit) as e:
                    finish_run(logger, stop.value, {"global_step": logger.last_step})
        if disk_frees_up:
            with pytest.raises(SystemExit) as e:
                finish_run(logger, stop.value, {"global_step": logger.last_step})
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err) == 1 and err[0].startswith(f"error: {stop.value}"), err
        assert ("summary.json not written" in err[0]) == (not disk_frees_up)
        assert (logger.dir / "summary.json").exists() == disk_frees_up
        if disk_frees_up:
            assert json.loads((logger.dir / "summary.json").read_text())["stop_reason"] == str(stop.value)
        assert [r["global_step"] for r in read_metrics(logger.dir / "metrics.jsonl")][0] == 1
        assert not any(".tmp" in name for name in os.listdir(logger.dir))


STOP_HANDLING_PROBE = """
import os, signal, sys, time
from common import processes

case = sys.argv[1]
processes.install_stop_handling()
if case == "before-run":
    os.kill(os.getpid(), signal.SIGTERM)  # before run_started: the script ends at once
    time.sleep(5)
    print("not stopped", flush=True)
    sys.exit(0)
processes.run_started(type("Logger", (), {"closed": True})())  # from here on a stop is only recorded
if case == "closed-stdout":
    os.close(0)  # the reader of our stdout is gone (the test closed it): the next print meets a broken pipe
    time.sleep(0.2)
    print("a line nobody reads", flush=True)
    print("and another", flush=True)
else:
    os.kill(os.getpid(), getattr(signal, case))
    time.sleep(0.2)
try:
    processes.check_stop()
    sys.stderr.write("no stop requested\\n")
except processes.Interrupted as e:
    sys.stderr.write(f"{processes.stop_reason(e)}\\n")
"""


@pytest.mark.parametrize(
    "case, ignore_sighup, expected_code, expected",
    [
        ("before-run", False, 143, "stopped: interrupted by SIGTERM before the run started"),
        ("SIGHUP", False, 0, "('interrupted by SIGHUP', 129)"),
        ("SIGHUP", True, 0, "no stop requested"),
        ("closed-stdout", False, 0, "('interrupted by SIGPIPE (stdout closed)', 141)"),
    ],
    ids=["signal-before-the-run-folder", "SIGHUP", "SIGHUP-under-nohup", "closed-stdout"],
)
def test_stop_handling_at_the_edges_of_a_run(tmp_path, case, ignore_sighup, expected_code, expected):
    """Contract (install_stop_handling, each script's first statement): before the run folder exists a stop ends the
    process at once with one `stopped:` line and 128 + signal; after it, SIGHUP is recorded like SIGTERM (exit 129)
    unless inherited as ignored (nohup); a closed stdout (`| head`) raises nothing in a print and requests a stop,
    "interrupted by SIGPIPE (stdout closed)", exit 141."""
    script = tmp_path / "probe.py"
    script.write_text(STOP_HANDLING_PROBE)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def preexec():
        # the probe's inherited SIGHUP disposition, whatever this test process inherited (pytest under nohup)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_sighup else signal.SIG_DFL)

    read_end, write_end = os.pipe()
    # the probe's stdin is the read end of its own stdout: once it closes fd 0, no reader is left
    proc = subprocess.Popen(
        [sys.executable, str(script), case],
        stdin=read_end,
        stdout=write_end if case == "closed-stdout" else subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=preexec,
    )
    os.close(read_end)
    os.close(write_end)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == expected_code, stderr
    output = stdout.strip() if case == "before-run" else stderr.strip()
    assert output == expected and "Traceback" not in stderr, (stdout, stderr)

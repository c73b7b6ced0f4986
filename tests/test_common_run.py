"""common/logger.py, common/checkpoint.py, common/processes.py."""

import json
import multiprocessing as mp
import os
import random
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
    assert "error: an_exp.model not written: " in capsys.readouterr().out
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

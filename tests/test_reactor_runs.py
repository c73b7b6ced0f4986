"""Tests of reactor.py as a script: bad input fails in one line, short subprocess runs (MinAtar end to end, two actors
with a save/resume round trip, a run's priorities, target refreshes and acting:learning ratio), resume rules."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reactor_helpers
import torch
from reactor_helpers import ATARI

import reactor
from common.args import resume_args
from common.processes import check_memory

REPO = Path(__file__).resolve().parents[1]

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float64_by_default = reactor_helpers.float64_by_default


# ----------------------------------------------------------------------------------------------------------------
# the script: bad input, smoke runs, save/resume round-trip
SCRIPT = str(REPO / "reactor.py")


def run_script(tmp_path, *flags, timeout=150):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bad_input_fails_with_one_line():
    """In-process (fast); the subprocess cases of the run-lifecycle issue are in tests/test_lifecycle.py."""
    with pytest.raises(SystemExit, match="error: reactor.py is for Atari"):
        reactor.validate_args(reactor.Args(env_id="CartPole-v1"))
    with pytest.raises(SystemExit, match="error: the replay memory needs .* lower --replay-size"):  # start-up RAM check
        check_memory(reactor.SequenceReplay.bytes_needed(10**10, 6, 128, ATARI), "--replay-size", 0.8)  # as __main__ calls it
    with pytest.raises(SystemExit, match="error: --replay-ratio must be > 0, got 0"):
        reactor.validate_args(reactor.Args(replay_ratio=0))
    with pytest.raises(SystemExit, match="error: --torso paper needs 84x84 Atari frames"):
        reactor.validate_args(reactor.Args(env_id="MinAtar/Breakout-v0", torso="paper"))


def test_minatar_run_end_to_end(tmp_path, monkeypatch):
    """MinAtar: (4, 10, 10) 0/1 frames through the actors, the replay and MinAtar's torso; the loop learns, logs and
    saves; the network and replay take their input size from the env."""
    r = run_script(
        tmp_path,
        *(
            "--env-id MinAtar/Breakout-v0 --num-actors 1 --replay-size 600 --learning-starts 100 "
            "--replay-ratio 60 --ratio-slack 32 --lstm-size 16 --num-atoms 11 --sequence-length 8 "
            "--batch-size 2 --eval-episodes 1 --total-timesteps 300 --no-progress --no-cuda --save-model"
        ).split(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["learning_steps"] >= 1 and summary["eval_episodes"] == 1
    model = torch.load(run / "reactor.model", weights_only=False)
    assert model["model"]["torso.0.weight"].shape == (16, 4, 3, 3)  # MinAtar's 3x3 conv on 4 channels
    assert model["args"]["sticky_action_prob"] is None  # the family's standard (0.1) applied by make_env
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "benchmarks"))
    import learning_curves  # its --eval-reactor reads this real saved model

    torch.set_default_dtype(torch.float32)  # as in a real run (this module's fixture set float64; it restores it)
    assert learning_curves.eval_reactor(str(run), 1)["episodes"] == 1 and (run / "eval_greedy.json").exists()


def test_smoke_two_actors_and_resume_with_the_replay(tmp_path):
    """Resume with the replay saved in the checkpoint (--checkpoint-replay); tests/test_lifecycle.py resumes without."""
    # forkserver: the actors share one import of torch (faster here)
    common = (
        "--num-actors 2 --replay-size 1200 --learning-starts 100 --replay-ratio 60 --ratio-slack 32 --log-every 1 "
        "--lstm-size 32 --num-atoms 11 --no-progress --sequence-length 8 --batch-size 2 --eval-episodes 0 --no-cuda "
        "--start-method forkserver"
    ).split()
    r = run_script(tmp_path, *common, "--total-timesteps", "260", "--checkpoint-every", "200", "--checkpoint-replay")
    assert r.returncode == 0, r.stdout + r.stderr
    (run1,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run1 / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] >= 260 and summary["learning_steps"] >= 1
    metrics = [json.loads(line) for line in (run1 / "metrics.jsonl").read_text().splitlines()]
    logged = set().union(*metrics)
    for name in (
        "losses/value_loss",
        "losses/policy_loss",
        "losses/entropy",
        "charts/SPS",
        "replay/rho_mean",
        "replay/size",
        "replay/priority_mean",
        "charts/acting_learning_ratio",
        "replay/trace_cut_fraction",
    ):
        assert name in logged, name
    ckpt = torch.load(run1 / "checkpoint.pt", weights_only=False)
    assert ckpt["replay"] is not None and ckpt["learn_steps"] == summary["learning_steps"]
    # without its replay, the checkpoint must leave --learning-starts steps to refill it: refused in one line
    torch.save({**ckpt, "replay": None}, tmp_path / "no_replay.pt")
    r = run_script(tmp_path, "--resume", str(tmp_path / "no_replay.pt"), "--total-timesteps", str(ckpt["global_step"] + 50))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: --resume: ") and "no replay" in r.stderr
    # resume with the replay and run on (no flag repeated); the model is saved at the end
    r = run_script(tmp_path, "--total-timesteps", "360", "--resume", str(run1 / "checkpoint.pt"), "--save-model")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed {run1 / 'checkpoint.pt'} at step {ckpt['global_step']:,}: " in r.stdout
    assert "replay (" in r.stdout and "flags from this command line: save_model, total_timesteps" in r.stdout
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run1.name]
    summary2 = json.loads((run1 / "summary.json").read_text())
    assert summary2["global_step"] >= 360 and summary2["learning_steps"] > ckpt["learn_steps"]
    assert (run1 / "reactor.model").exists()
    # the resumed run cut each actor's segment at the checkpoint (its last stored slot became a pad)
    rep1 = ckpt["replay"]
    rep2 = torch.load(run1 / "checkpoint.pt", weights_only=False)["replay"]
    seg_cap = len(rep1["pad"]) // 2
    assert rep1["written"].max() > 0
    for segment, written in enumerate(rep1["written"]):
        if written == 0:  # (an actor that had sent nothing yet, e.g. one started late on a loaded machine: no head)
            continue
        assert not rep1["pad"][segment * seg_cap + (written - 1) % seg_cap]
        assert rep2["pad"][segment * seg_cap + (written - 1) % seg_cap], segment


def test_resume_may_not_change_gamma_or_the_policy_s_uniform_mix():
    """gamma and the uniform mix of the policy (part of the network's output) change the experiment: a resume refuses
    them, as every flag of FIXED_ON_RESUME; a flag outside it (the learning rate) may change."""
    saved = vars(reactor.Args())  # a checkpoint's flags
    for name, value in (("gamma", 0.9), ("policy_uniform_eps", 0.05)):
        flag = "--" + name.replace("_", "-")
        with pytest.raises(SystemExit, match=f"error: --resume: {flag} {value} differs from the checkpoint's"):
            resume_args(reactor.Args(**{name: value}), [flag, str(value)], saved, reactor.FIXED_ON_RESUME)
    args, given = resume_args(reactor.Args(learning_rate=1e-4), ["--learning-rate", "1e-4"], saved, reactor.FIXED_ON_RESUME)
    assert given == ["learning_rate"] and args.learning_rate == 1e-4


def test_run_writes_priorities_back_refreshes_the_target_and_keeps_the_ratio(tmp_path):
    """A real run (1 actor, MinAtar) with --target-update-period 1: its checkpoint's target network equals its model,
    its replay has known keys with priorities (written back by the learner), and each log line keeps
    (env steps - learning_starts) / replay_ratio within [learning steps - 1, learning steps + ratio_slack / replay_ratio]
    (the learner's gate and the actor's gate; the actor may take one step past its check)."""
    r = run_script(
        tmp_path,
        *(
            "--env-id MinAtar/Breakout-v0 --num-actors 1 --replay-size 600 --learning-starts 100 "
            "--replay-ratio 20 --ratio-slack 16 --lstm-size 16 --num-atoms 11 --sequence-length 8 "
            "--batch-size 2 --eval-episodes 0 --total-timesteps 300 --target-update-period 1 --log-every 1 "
            "--checkpoint-every 100000 --checkpoint-replay --start-method forkserver --no-progress --no-cuda"
        ).split(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt["learn_steps"] >= 5
    for name, tensor in ckpt["model"].items():
        assert torch.equal(ckpt["target_model"][name], tensor), name
    index = ckpt["replay"]["index"]
    capacity = len(index["priority"])
    known = index["known"][len(index["known"]) // 2 :][:capacity] > 0  # the sum tree's leaves
    assert known.sum() >= 2 and (index["priority"][known] > 0).all()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [(r["global_step"], r["charts/learning_steps"]) for r in records if "charts/learning_steps" in r]
    assert len(lines) >= ckpt["learn_steps"]
    for step, learned in lines:
        assert learned - 1 < (step - 100) / 20 <= learned + (16 + 1) / 20, (step, learned)
    logged = [r for r in records if "losses/loss" in r]
    assert len(logged) == ckpt["learn_steps"] and all(0 < r["replay/is_weight_mean"] <= 1 for r in logged)

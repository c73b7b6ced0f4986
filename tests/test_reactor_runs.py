"""Tests of reactor.py as a script: bad input fails in one line; three real tiny runs (MinAtar, one actor) through
`reactor_helpers.run_probed`, the script itself with spies on its loop: a new run A, A resumed with its replay and
every applied flag but one changed (B), A resumed without its replay with a new --learning-starts (C). The loop's
clauses (tests/test_reactor_loop.py's docstring) are checked on A and B; the run contract on --resume on B and C:

- Every flag is fixed (refused in one line if changed: it would change the experiment or the replay's layout),
  applied (a changed value takes effect from the resumed step on) or run-only (how the run is executed and reported);
  the tables below give each flag's reason, and each must equal its class of reactor.py exactly. Every applied flag
  is changed on B or C and the value in effect read back in the process (`APPLIED_PROBES`).
- A resumed run continues exactly: at its first step the resumed process holds the checkpoint's counters (global
  step, learning steps, episodes, each actor's env steps), the weights (online, target, the actors' copy) with the
  version and learner count the actors read, the optimizer state with this run's lr and beta1, the replay and its
  priorities (each actor's last slot cut to a pad: new episodes start), the replay's sampling RNG and every global
  RNG, and the checkpoint's ratio base, or the documented new one (`reactor.resumed_ratio_base`: a refill without
  the replay, a new --acting-learning-ratio counted from the resumed step); its learning steps follow the gates from there;
  its actors act with the resumed weights from their first step, on new seeds.
"""

import copy
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import reactor_helpers
import torch
from reactor_helpers import ATARI, run_probed, same_weights

import reactor
from common.args import COMMON_APPLIED_ON_RESUME, COMMON_FIXED_ON_RESUME, parse_run_args
from common.checkpoint import rng_state, seed_everything, set_rng_state
from common.processes import check_memory

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float64_by_default = reactor_helpers.float64_by_default


def test_bad_input_fails_with_one_line():
    """In-process (fast); the subprocess cases of the run-lifecycle issue are in tests/test_lifecycle.py."""
    with pytest.raises(SystemExit, match="error: reactor.py is for Atari"):
        reactor.validate_args(reactor.Args(env_id="CartPole-v1"))
    with pytest.raises(SystemExit, match="error: the replay memory needs .* lower --replay-size"):  # start-up RAM check
        check_memory(reactor.SequenceReplay.bytes_needed(10**10, 6, 128, ATARI), "--replay-size", 0.8)  # as __main__ calls it
    with pytest.raises(SystemExit, match="error: --acting-learning-ratio must be > 0, got 0"):
        reactor.validate_args(reactor.Args(acting_learning_ratio=0))
    with pytest.raises(SystemExit, match="error: --torso paper needs 84x84 Atari frames"):
        reactor.validate_args(reactor.Args(env_id="MinAtar/Breakout-v0", torso="paper"))


# ----------------------------------------------------------------------------------------------------------------
# the flags' classes on --resume
# fixed: (a changed value, as given on the command line; why it cannot take effect on a resume)
FIXED = {
    "exp_name": (["--exp-name", "other"], "names the run and its model file"),
    "seed": (["--seed", "2"], "every stream of the run derives from it"),
    "env_id": (["--env-id", "MinAtar/Asterix-v0"], "the environment, and the replay's frames and actions"),
    "sticky_action_prob": (["--sticky-action-prob", "0.2"], "the environment's dynamics"),
    "noop_max": (["--noop-max", "5"], "the environment's start states"),
    "torso": (["--torso", "paper"], "the network's layers (the checkpoint's weights would not fit)"),
    "lstm_size": (["--lstm-size", "32"], "the network's layers, and the LSTM states stored in the replay"),
    "crelu": (["--no-crelu"], "the network's layer widths"),
    "policy_uniform_eps": (["--policy-uniform-eps", "0.05"], "the policy itself (the network's output)"),
    "distributional": (["--no-distributional"], "the Q head and the method (Reactor or its ND ablation)"),
    "num_atoms": (["--num-atoms", "21"], "the Q head's size"),
    "v_min": (["--v-min", "-5"], "the support the Q head's atoms stand for"),
    "v_max": (["--v-max", "5"], "the support the Q head's atoms stand for"),
    "gamma": (["--gamma", "0.9"], "the return being learned"),
    "policy_gradient": (["--policy-gradient", "tislr"], "the method (beta-LOO or its TISLR ablation)"),
    "prioritized": (["--no-prioritized"], "the replay's sampler and its state"),
    "num_actors": (["--num-actors", "3"], "the replay's segments (one per actor) and the actors' step counts"),
    "replay_size": (["--replay-size", "3000"], "the replay's layout (its segments' sizes)"),
    "sequence_length": (["--sequence-length", "4"], "the replay's keys (a key is a sequence of this length)"),
}
# run-only: why a changed value never changes what the run learns (each is read where it is used)
RUN_ONLY = {
    "actor_chunk": "how many slots cross to the learner at once (the slots are the same)",
    "log_every": "how often the metrics are logged",
    "checkpoint_replay": "whether checkpoints hold the replay",
    "memory_fraction": "the start-up check of the replay's size against the RAM",
}


def test_every_fixed_flag_changed_on_resume_is_refused_in_one_line(tmp_path, monkeypatch):
    """The fixed class, with a reason per flag (FIXED: it must equal the class exactly, common flags included): a
    resume that changes one is refused at start-up in one `error: --resume:` line; the same value is accepted."""
    classes = set(reactor.FIXED_ON_RESUME) | set(COMMON_FIXED_ON_RESUME)
    assert set(FIXED) == classes, (set(FIXED) ^ classes, "every fixed flag needs a reason here")
    saved = vars(reactor.Args(exp_name="reactor", lstm_size=16, num_atoms=11))
    path = tmp_path / "checkpoint.pt"
    torch.save({"script": "reactor.py", "args": saved}, path)
    classes = (reactor.FIXED_ON_RESUME, reactor.APPLIED_ON_RESUME, reactor.RUN_ONLY_ON_RESUME)
    for name, (given, reason) in FIXED.items():
        monkeypatch.setattr(sys, "argv", ["reactor.py", "--resume", str(path), *given])
        with pytest.raises(SystemExit) as stop:
            parse_run_args(reactor.Args, "reactor.py", *classes)
        message = str(stop.value)
        assert message.startswith(f"error: --resume: {given[0].replace('--no-', '--')} ") and "\n" not in message, name
    monkeypatch.setattr(sys, "argv", ["reactor.py", "--resume", str(path), "--lstm-size", "16", "--gamma", "0.99"])
    args, ckpt, overridden = parse_run_args(reactor.Args, "reactor.py", *classes)
    assert overridden == ["gamma", "lstm_size"] and args.lstm_size == 16 and ckpt["args"] == saved


def test_the_run_only_class_holds_what_never_changes_learning():
    """The run-only class, with a reason per flag (RUN_ONLY: it must equal reactor.py's own run-only flags)."""
    assert set(RUN_ONLY) == set(reactor.RUN_ONLY_ON_RESUME), "every run-only flag needs a reason here"


def checkpoint_like(global_step=300, learn_steps=50, ratio_base=(100, 0), replay=True, **flags):
    """What `check_resume` and `resumed_ratio_base` read of a checkpoint."""
    args = vars(reactor.Args(learning_starts=100, acting_learning_ratio=4.0, total_timesteps=300, **flags))
    return {
        "args": args,
        "global_step": global_step,
        "learn_steps": learn_steps,
        "ratio_base": ratio_base,
        "actor_steps": [global_step, 0],
        "replay": {} if replay else None,
    }


def test_resume_checks_and_the_ratio_base_of_a_resumed_run():
    """`check_resume` refuses in one line a checkpoint of an older reactor.py, a budget that ends before learning
    resumes (without the replay: before the refill ends; with a replay still filling: before it is full), and a new
    --learning-starts where it cannot act (a replay restored after learning began). `resumed_ratio_base`: the
    checkpoint's base when nothing changes (one moved by an earlier refill too); a refill of learning_starts steps
    without the replay; a new --acting-learning-ratio counted from the resumed step; a new --learning-starts moves the start of
    a replay still filling, never before the resumed step."""
    args = reactor.Args(learning_starts=100, acting_learning_ratio=4.0, total_timesteps=400, resume="ckpt.pt")
    ckpt = checkpoint_like()
    old = {key: value for key, value in ckpt.items() if key not in ("ratio_base", "actor_steps")}
    with pytest.raises(SystemExit, match=r"^error: --resume: ckpt.pt was written by an older reactor.py"):
        reactor.check_resume(args, old)
    reactor.check_resume(args, ckpt)
    with pytest.raises(SystemExit, match=r"^error: --resume: --learning-starts cannot act on this checkpoint"):
        reactor.check_resume(reactor.Args(learning_starts=50, total_timesteps=400), ckpt)
    with pytest.raises(SystemExit, match=r"^error: --resume: the checkpoint is at step 300: give --total-timesteps > 300$"):
        reactor.check_resume(reactor.Args(learning_starts=100, total_timesteps=300), ckpt)
    without_replay = checkpoint_like(replay=False)
    message = r"^error: --resume: the checkpoint is at step 300 and has no replay \(50 steps refill it\): .* > 350$"
    with pytest.raises(SystemExit, match=message):
        reactor.check_resume(reactor.Args(learning_starts=50, total_timesteps=350), without_replay)
    filling = checkpoint_like(global_step=80, learn_steps=0, ratio_base=(100, 0))
    with pytest.raises(SystemExit, match=r"and its replay fills until step 150: give --total-timesteps > 150$"):
        reactor.check_resume(reactor.Args(learning_starts=150, total_timesteps=150), filling)
    base = reactor.resumed_ratio_base
    assert base(ckpt, args) == (100, 0)
    assert base(without_replay, reactor.Args(learning_starts=50)) == (350, 50)
    assert base(ckpt, reactor.Args(learning_starts=100, acting_learning_ratio=3.0)) == (300, 50)
    assert base(filling, reactor.Args(learning_starts=150)) == (150, 0)
    assert base(filling, reactor.Args(learning_starts=20)) == (80, 0)
    # (after a resume without the replay at step 500: the filling began there)
    refilling = checkpoint_like(global_step=560, learn_steps=90, ratio_base=(600, 90))
    assert base(refilling, reactor.Args(learning_starts=70)) == (570, 90)
    # (learning began there at step 600: its base is restored as it is, not a new run's (learning_starts, 0))
    refilled = checkpoint_like(global_step=900, learn_steps=165, ratio_base=(600, 90))
    assert base(refilled, reactor.Args(learning_starts=100, acting_learning_ratio=4.0)) == (600, 90)


# ----------------------------------------------------------------------------------------------------------------
# three real runs: A, A resumed with its replay (B), A resumed without it (C)
TINY = (
    "--env-id MinAtar/Breakout-v0 --num-actors 1 --replay-size 2000 --lstm-size 16 --num-atoms 11 --sequence-length 8 "
    "--no-progress --no-cuda"
).split()
A_FLAGS = {
    "total_timesteps": 300,
    "learning_starts": 100,
    "batch_size": 2,
    "acting_learning_ratio": 4.0,
    "ratio_slack": 16,
    "actor_chunk": 8,
    "actor_sync_every": 4,
    "target_update_period": 3,
    "log_every": 1,
    "checkpoint_every": 100_000,
    "checkpoint_replay": True,
    "eval_episodes": 0,
}
# the actors' episodes are truncated after this many steps in the runs below (pad slots happen)
EPISODE_LIMIT = 12
# every applied flag changed on a resumed run: (the run, the new value)
APPLIED_CHANGES = {
    "total_timesteps": ("B", 420),
    "learning_starts": ("C", 40),
    "batch_size": ("B", 3),
    "acting_learning_ratio": ("B", 3.0),
    "ratio_slack": ("B", 0),
    "learning_rate": ("B", 2e-4),
    "adam_beta1": ("B", 0.3),
    "max_grad_norm": ("B", 0.05),
    "target_update_period": ("B", 1000),
    "retrace_lambda": ("B", 0.9),
    "beta_loo_c": ("B", 2.0),
    "tislr_c": ("B", 5.0),
    "entropy_coef": ("B", 0.02),
    "replay_uniform_eps": ("B", 0.3),
    "priority_exponent": ("B", 0.5),
    "actor_sync_every": ("B", 5),
    "eval_episodes": ("B", 2),
}


def command_line(flags: dict) -> list:
    """tyro flags for a {field: value} dict."""
    out = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def finished_run(folder: Path, process, records) -> SimpleNamespace:
    """What a probed run left: its process, the spies' records, its run folder, checkpoint, summary and metrics."""
    assert process.returncode == 0, process.stdout + process.stderr
    (run_dir,) = (folder / "runs").iterdir()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(
        process=process,
        records=records,
        dir=run_dir,
        ckpt=torch.load(run_dir / "checkpoint.pt", weights_only=False),
        summary=json.loads((run_dir / "summary.json").read_text()),
        metrics=metrics,
    )


def rng_state_of_seed(seed: int) -> dict:
    """Every global RNG's state after seeding them with `seed` (this process's states are kept)."""
    kept = rng_state()
    seed_everything(seed)
    state = rng_state()
    set_rng_state(kept)
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The actors' episodes end after at most EPISODE_LIMIT steps (a time limit: truncations and pad slots).
    A: a new run to step 300 with a replay checkpoint at its end. B: A resumed with its replay and every applied
    flag of APPLIED_CHANGES["B"], with --save-model. C: A resumed from a copy of its checkpoint without the replay
    and with other global RNG states, with a new --learning-starts, to 80 steps past the refill. Each in its own
    folder (a copy of A's runs/); `resumed_from`: the checkpoint B and C resumed from."""
    base = tmp_path_factory.mktemp("reactor_runs")
    folders = {name: base / name for name in "ABC"}
    folders["A"].mkdir()
    a = finished_run(folders["A"], *run_probed(folders["A"], [*TINY, *command_line(A_FLAGS)], EPISODE_LIMIT))
    out = {"A": a}
    for name in "BC":
        shutil.copytree(folders["A"] / "runs", folders[name] / "runs")
    checkpoint = {name: folders[name] / "runs" / a.dir.name / "checkpoint.pt" for name in "BC"}
    b_flags = {flag: value for flag, (run, value) in APPLIED_CHANGES.items() if run == "B"}
    b_command_line = ["--resume", str(checkpoint["B"]), *command_line(b_flags), "--save-model"]
    process, records = run_probed(folders["B"], b_command_line, EPISODE_LIMIT)
    out["B"] = finished_run(folders["B"], process, records)
    out["B"].resumed_from = a.ckpt
    # (A's loop draws from no global RNG, so that its checkpoint holds a new set-up's states: C's holds others)
    c_checkpoint = {**a.ckpt, "replay": None, "rng": rng_state_of_seed(12345)}
    torch.save(c_checkpoint, checkpoint["C"])
    learning_starts = APPLIED_CHANGES["learning_starts"][1]
    c_flags = {"learning_starts": learning_starts, "total_timesteps": a.ckpt["global_step"] + learning_starts + 80}
    c_command_line = ["--resume", str(checkpoint["C"]), *command_line(c_flags)]
    out["C"] = finished_run(folders["C"], *run_probed(folders["C"], c_command_line, EPISODE_LIMIT))
    out["C"].resumed_from = c_checkpoint
    return out


def flag_values(run) -> dict:
    """The run's flags (args.json of its folder is the last run's; the spies keep each process's own)."""
    return run.records["first_step"]["args"]


def assert_same(got, want, path="state"):
    """Nested dicts, lists, tuples, arrays and tensors equal entry by entry (the failing entry named)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, sorted(got), sorted(want))
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(torch.as_tensor(got), want), path
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=path)
    else:
        assert got == want, (path, got, want)


# ----------------------------------------------------------------------------------------------------------------
# the loop's clauses on the real runs
def test_a_new_run_starts_from_the_documented_state(runs):
    """Clauses 5 and 6 at a new run's first step: nothing counted yet, the ratio base (learning_starts, 0), the
    target network and the actors' weights copies of the online network, version 0; the run logs the metrics
    README names, the policy lag among them."""
    first = runs["A"].records["first_step"]
    assert (first["global_step"], first["learn_steps"], first["episodes"], first["actor_steps"]) == (0, 0, 0, [0])
    assert first["ratio_base"] == (100, 0) and first["weights_version"] == first["learner_steps"] == 0
    assert same_weights(first["target_model"], first["model"]) and same_weights(first["shared_model"], first["model"])
    logged = set().union(*runs["A"].metrics)
    for name in (
        "losses/value_loss",
        "losses/policy_loss",
        "losses/entropy",
        "losses/loss",
        "charts/SPS",
        "charts/acting_learning_ratio",
        "charts/policy_lag",
        "replay/rho_mean",
        "replay/trace_cut_fraction",
        "replay/size",
        "replay/priority_mean",
        "replay/is_weight_mean",
    ):
        assert name in logged, name


def test_run_actors_act_with_rising_versions_and_a_bounded_lag(runs):
    """Clause 1 in A and B (one actor): every slot was acted with published weights (version >= 0; B's from its
    first step on: >= the checkpoint's learning steps); an actor's versions never fall; a new version appears only at
    a sync point (the actor's step count a multiple of actor_sync_every) or at its first step; and the lag at arrival
    stays below (actor_sync_every - 1 + ratio_slack) / acting_learning_ratio + 1."""
    for name in "AB":
        run = runs[name]
        flags = flag_values(run)
        chunks = run.records["chunks"]
        first_count = run.records["first_step"]["actor_steps"][0]
        steps = np.concatenate([chunk["steps_before"] + np.arange(len(chunk["versions"])) for chunk in chunks])
        versions = np.concatenate([chunk["versions"] for chunk in chunks])
        np.testing.assert_array_equal(steps, first_count + np.arange(len(steps)))
        assert versions.min() >= run.records["first_step"]["learn_steps"] and (np.diff(versions) >= 0).all(), name
        changed_at = steps[1:][np.diff(versions) > 0]
        assert len(changed_at) >= 5 and (changed_at % flags["actor_sync_every"] == 0).all(), (name, changed_at)
        bound = (flags["actor_sync_every"] - 1 + flags["ratio_slack"]) / flags["acting_learning_ratio"] + 1
        lags = np.concatenate([chunk["learn_steps"] - chunk["versions"] for chunk in chunks])
        assert lags.min() >= 0 and lags.max() < bound, (name, lags.max(), bound)


def test_run_counts_every_env_step_once(runs):
    """Clause 3 in A (episodes truncated after 12 steps): the env steps the learner counts (global_step, the actor's
    count, the summary) are the slots the actor sent less its pad slots, and the checkpoint's replay holds them all,
    in order, with a pad slot after each truncation."""
    a = runs["A"]
    sent = sum(len(chunk["versions"]) for chunk in a.records["chunks"])
    end = a.records["end"]
    assert end["global_step"] == sent == end["actor_steps"][0] == a.summary["global_step"] == a.ckpt["global_step"]
    replay = a.ckpt["replay"]
    written = int(replay["written"][0])
    pads = int(replay["pad"][:written].sum())
    assert written < len(replay["pad"]) and written - pads == sent and pads >= 3
    versions = replay["version"][:written][~replay["pad"][:written]]
    np.testing.assert_array_equal(versions, np.concatenate([chunk["versions"] for chunk in a.records["chunks"]]))


def test_run_learning_steps_follow_the_ratio_gates(runs):
    """Clause 6 in A, B and C, from each process's ratio base (G0, L0): at every learning step L (counted before
    it) at global step G, the learner's gate L - L0 < (G - G0) / acting_learning_ratio with a batch in the replay, and the
    actors' gate G - G0 <= acting_learning_ratio (L - L0) + ratio_slack + 1; every run learned."""
    for name in "ABC":
        run = runs[name]
        flags = flag_values(run)
        ratio = flags["acting_learning_ratio"]
        env_base, learn_base = run.records["first_step"]["ratio_base"]
        steps = run.records["learning_steps"]
        assert len(steps) >= 8, name
        for step in steps:
            env_steps = step["global_step"] - env_base
            learned = step["learn_steps"] - learn_base
            assert step["ratio_base"] == (env_base, learn_base) and step["num_sequences"] >= flags["batch_size"]
            assert learned < env_steps / ratio and env_steps <= ratio * learned + flags["ratio_slack"] + 1, (name, step)
        assert [step["learn_steps"] for step in steps] == list(range(steps[0]["learn_steps"], steps[-1]["learn_steps"] + 1))


def test_run_publishes_the_weights_and_refreshes_the_target_on_schedule(runs):
    """Clause 5 in A (target_update_period 3) and B (1000): after learning step n the actors' weights equal the online
    ones and the version and learner count they read are n; the target network becomes a copy of the online network
    iff n is a multiple of the period, else it is unchanged."""
    for name in "AB":
        period = flag_values(runs[name])["target_update_period"]
        publishes = runs[name].records["publishes"]
        assert len(publishes) == len(runs[name].records["learning_steps"])
        for publish in publishes:
            n = publish["learn_steps"]
            assert publish["weights_version"] == publish["learner_steps"] == n and publish["shared_is_online"], publish
            assert publish["target_is_online"] == (n % period == 0) and publish["target_unchanged"] == (n % period != 0)
    assert sum(publish["learn_steps"] % 3 == 0 for publish in runs["A"].records["publishes"]) >= 3


def test_run_learning_steps_apply_the_flags(runs):
    """Clause 4 in A (the defaults) and B: each step's Adam settings, batch size and loss settings are the run's flags;
    the gradient Adam applied has a norm of at most max_grad_norm (B: 0.05, below the unclipped norms); the keys
    trained on get priority (p + 1e-6) ** priority_exponent (A: the paper's 1)."""
    for name in "AB":
        flags = flag_values(runs[name])
        for step in runs[name].records["learning_steps"]:
            assert step["lr"] == flags["learning_rate"] and step["betas"] == (flags["adam_beta1"], 0.999)
            assert step["batch_size"] == flags["batch_size"]
            for setting in ("retrace_lambda", "beta_loo_c", "tislr_c", "entropy_coef"):
                assert step[setting] == flags[setting], (name, setting)
            assert step["grad_norm"] <= flags["max_grad_norm"] * (1 + 1e-5)
            keys, priorities = step["priorities"]
            last = {key: priority for key, priority in zip(keys.tolist(), priorities.tolist())}
            want = [(last[key] + 1e-6) ** flags["priority_exponent"] for key in keys.tolist()]
            np.testing.assert_allclose(step["stored_priorities"], want, rtol=1e-12)
    clipped = [abs(step["grad_norm"] - 0.05) < 1e-5 for step in runs["B"].records["learning_steps"]]
    assert sum(clipped) >= len(clipped) // 2


def test_saved_model_is_the_online_network_and_the_evaluation_plays_it(runs, monkeypatch):
    """Clause 7 in B (its target network is A's last refresh, no longer the online one): reactor.model holds the
    online network's weights and the flags; the final evaluation played the online network, eval_episodes games from
    seed + 10000; tests/benchmarks/learning_curves.py --eval-reactor reads the saved model."""
    b = runs["B"]
    saved = torch.load(b.dir / "reactor.model", weights_only=False)
    end = b.records["end"]
    assert same_weights(saved["model"], end["model"]) and not same_weights(saved["model"], end["target_model"])
    assert saved["model"]["torso.0.weight"].shape == (16, 4, 3, 3)  # MinAtar's 3x3 conv on 4 channels
    assert saved["args"]["sticky_action_prob"] is None and saved["args"]["learning_rate"] == 2e-4
    assert b.records["evaluations"] == [{"is_online": True, "episodes": 2, "seed": 1 + 10_000}]
    assert b.summary["eval_episodes"] == 2 and len(b.summary["eval_returns"]) == 2
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "benchmarks"))
    import learning_curves

    torch.set_default_dtype(torch.float32)  # as in a real run (this module's fixture set float64; it restores it)
    assert learning_curves.eval_reactor(str(b.dir), 1)["episodes"] == 1 and (b.dir / "eval_greedy.json").exists()


# ----------------------------------------------------------------------------------------------------------------
# the run contract on --resume
def test_resumed_process_holds_the_checkpoint_at_its_first_step(runs):
    """B (with the replay) and C (without) at their first step, entry by entry against the checkpoint each resumed
    from (A's; C's without the replay and with other global RNG states): counters, weights, the actors' version and
    learner count, the optimizer state (this run's lr and beta1: B's changed, C's the checkpoint's), the replay's
    sampling RNG, every global RNG, the replay and its priorities (B: each actor's last slot now a pad; C: empty), and
    the ratio base (B: counted from the resumed step for its new --acting-learning-ratio; C: after a refill of its
    --learning-starts). The actors' shared step counts start from the checkpoint's."""
    ckpt = runs["A"].ckpt
    global_step = ckpt["global_step"]
    learn_steps = ckpt["learn_steps"]
    assert learn_steps >= 20
    for name, ratio_base in (("B", (global_step, learn_steps)), ("C", (global_step + 40, learn_steps))):
        first = runs[name].records["first_step"]
        flags = flag_values(runs[name])
        assert (first["global_step"], first["learn_steps"], first["episodes"]) == (global_step, learn_steps, ckpt["episodes"])
        assert first["actor_steps"] == ckpt["actor_steps"] == [global_step]
        assert all(got >= want for got, want in zip(first["shared_actor_steps"], ckpt["actor_steps"]))
        assert first["ratio_base"] == ratio_base, name
        assert first["weights_version"] == first["learner_steps"] == learn_steps
        assert same_weights(first["model"], ckpt["model"]) and same_weights(first["target_model"], ckpt["target_model"])
        assert same_weights(first["shared_model"], ckpt["model"])
        optimizer = copy.deepcopy(ckpt["optimizer"])
        for group in optimizer["param_groups"]:
            group["lr"] = flags["learning_rate"]
            group["betas"] = (flags["adam_beta1"], 0.999)
        assert_same(first["optimizer"], optimizer, f"{name}: optimizer")
        assert_same(first["np_rng"], ckpt["np_rng"].bit_generator.state, f"{name}: the replay's RNG")
        assert_same(first["rng"], runs[name].resumed_from["rng"], f"{name}: the global RNGs")
    # (C's states are not those B holds)
    assert not torch.equal(runs["C"].resumed_from["rng"]["torch"], ckpt["rng"]["torch"])
    replay = copy.deepcopy(ckpt["replay"])
    head = int(replay["written"][0]) - 1
    assert not replay["pad"][head]
    replay["pad"][head] = True
    assert_same(runs["B"].records["first_step"]["replay"], replay, "B: replay")
    empty = runs["C"].records["first_step"]["replay"]
    assert empty["written"].tolist() == [0] and not empty["index"]["valid"].any()


def test_a_checkpoint_saved_with_replay_ratio_resumes_with_its_value_as_acting_learning_ratio(runs, tmp_path):
    """--replay-ratio was renamed --acting-learning-ratio (reactor.RENAMED_FLAGS): A's checkpoint, its ratio
    saved under the old name at a value neither A's nor the default (5), resumes as a real run with that value in
    effect: the resumed process's flags, the checkpoint's ratio base kept (the value is the checkpoint's, not a new
    one counted from the resumed step) and both gates at every learning step with ratio 5."""
    shutil.copytree(runs["A"].dir.parent, tmp_path / "runs")
    checkpoint = tmp_path / "runs" / runs["A"].dir.name / "checkpoint.pt"
    ckpt = torch.load(checkpoint, weights_only=False)
    old_value = 5.0
    assert old_value not in (A_FLAGS["acting_learning_ratio"], reactor.Args().acting_learning_ratio)
    del ckpt["args"]["acting_learning_ratio"]
    ckpt["args"]["replay_ratio"] = old_value
    torch.save(ckpt, checkpoint)
    # ratio 5 from A's base: the learner waits until 5 x A's learning steps are acted, then learns
    total_timesteps = ckpt["global_step"] + 140
    command = ["--resume", str(checkpoint), "--total-timesteps", str(total_timesteps)]
    run = finished_run(tmp_path, *run_probed(tmp_path, command, EPISODE_LIMIT))
    flags = flag_values(run)
    assert flags["acting_learning_ratio"] == old_value and "replay_ratio" not in flags
    assert run.records["first_step"]["ratio_base"] == tuple(ckpt["ratio_base"])
    assert len(run.records["learning_steps"]) >= 5
    probe_gates(run, old_value, slack=A_FLAGS["ratio_slack"])


def test_resumed_actors_play_new_streams_with_the_resumed_weights(runs):
    """B's actor from its first step: a version of at least the checkpoint's learning steps (the resumed weights,
    never its own random ones), and actions from a new stream (not A's first 40 again)."""
    a = runs["A"].ckpt["replay"]
    b = runs["B"].ckpt["replay"]
    start = int(a["written"][0])
    assert b["version"][start] >= runs["A"].ckpt["learn_steps"] and b["first"][start]
    resumed = b["action"][start : start + 40][~b["pad"][start : start + 40]]
    fresh = a["action"][:40][~a["pad"][:40]]
    length = min(len(resumed), len(fresh))
    assert not np.array_equal(resumed[:length], fresh[:length])
    assert "flags from this command line: " in runs["B"].process.stdout
    assert [p.name for p in (runs["B"].dir.parent).iterdir()] == [runs["A"].dir.name]


def probe_total_timesteps(run, value):
    """The run stops at the first drain of the actors' chunks past the budget."""
    flags = flag_values(run)
    overshoot = 4 * flags["num_actors"] * (flags["actor_chunk"] + 1)
    assert value <= run.records["end"]["global_step"] < value + overshoot and run.summary["stop_reason"] == "completed"


def probe_learning_starts(run, value):
    """Without the replay: the ratio counts from the resumed step plus the refill, and no step learns before."""
    env_base = run.records["first_step"]["global_step"] + value
    assert run.records["first_step"]["ratio_base"][0] == env_base
    assert min(step["global_step"] for step in run.records["learning_steps"]) >= env_base


def probe_gates(run, ratio, slack):
    """Both gates at every learning step, tight with ratio_slack 0: ratio (L - L0) < G - G0 <= ratio (L - L0) + 1."""
    env_base, learn_base = run.records["first_step"]["ratio_base"]
    for step in run.records["learning_steps"]:
        env_steps = step["global_step"] - env_base
        learned = step["learn_steps"] - learn_base
        assert ratio * learned < env_steps <= ratio * learned + slack + 1, step


def probe_every_step(run, key, value):
    """The setting every learning step ran with."""
    assert {step[key] for step in run.records["learning_steps"]} == {value}, key


def probe_max_grad_norm(run, value):
    """The norm of the gradient Adam applied: at most the clip, and the clip itself on most steps."""
    norms = np.array([step["grad_norm"] for step in run.records["learning_steps"]])
    assert (norms <= value * (1 + 1e-5)).all() and (abs(norms - value) < 1e-5 * value).mean() >= 0.5


def probe_target_update_period(run, value):
    """The target network is refreshed at the multiples of the new period only (A's period would have refreshed)."""
    publishes = run.records["publishes"]
    assert any(publish["learn_steps"] % A_FLAGS["target_update_period"] == 0 for publish in publishes)
    assert all(publish["target_unchanged"] == (publish["learn_steps"] % value != 0) for publish in publishes)


def probe_priority_exponent(run, value):
    """The priorities stored for the keys just trained on."""
    for step in run.records["learning_steps"]:
        keys, priorities = step["priorities"]
        last = dict(zip(keys.tolist(), priorities.tolist()))
        want = [(last[key] + 1e-6) ** value for key in keys.tolist()]
        np.testing.assert_allclose(step["stored_priorities"], want, rtol=1e-12)


def probe_actor_sync_every(run, value):
    """The actor takes new weights only at its new sync points (some of them none of A's)."""
    chunks = run.records["chunks"]
    steps = np.concatenate([chunk["steps_before"] + np.arange(len(chunk["versions"])) for chunk in chunks])
    versions = np.concatenate([chunk["versions"] for chunk in chunks])
    changed_at = steps[1:][np.diff(versions) > 0]
    assert (changed_at % value == 0).all() and (changed_at % A_FLAGS["actor_sync_every"] != 0).sum() >= 2, changed_at


def probe_replay_uniform_eps(run, value):
    """The sampler's uniform share."""
    assert run.records["first_step"]["replay_uniform_eps"] == value


def probe_eval_episodes(run, value):
    """The games the final evaluation played."""
    assert run.records["evaluations"][0]["episodes"] == value == run.summary["eval_episodes"]


# each applied flag: how its value in effect is read back in the resumed process (it must cover the class exactly)
APPLIED_PROBES = {
    "total_timesteps": probe_total_timesteps,
    "learning_starts": probe_learning_starts,
    "batch_size": lambda run, value: probe_every_step(run, "batch_size", value),
    "acting_learning_ratio": lambda run, value: probe_gates(run, value, slack=APPLIED_CHANGES["ratio_slack"][1]),
    "ratio_slack": lambda run, value: probe_gates(run, APPLIED_CHANGES["acting_learning_ratio"][1], value),
    "learning_rate": lambda run, value: probe_every_step(run, "lr", value),
    "adam_beta1": lambda run, value: probe_every_step(run, "betas", (value, 0.999)),
    "max_grad_norm": probe_max_grad_norm,
    "target_update_period": probe_target_update_period,
    "retrace_lambda": lambda run, value: probe_every_step(run, "retrace_lambda", value),
    "beta_loo_c": lambda run, value: probe_every_step(run, "beta_loo_c", value),
    # (the loss reads it at every step; it acts with --policy-gradient tislr only)
    "tislr_c": lambda run, value: probe_every_step(run, "tislr_c", value),
    "entropy_coef": lambda run, value: probe_every_step(run, "entropy_coef", value),
    "replay_uniform_eps": probe_replay_uniform_eps,
    "priority_exponent": probe_priority_exponent,
    "actor_sync_every": probe_actor_sync_every,
    "eval_episodes": probe_eval_episodes,
}


def test_every_applied_flag_takes_effect_on_a_real_resumed_run(runs):
    """Issue: a flag is applied or refused, never accepted and ignored. Every flag of reactor.py's applied class
    (APPLIED_PROBES must cover it exactly) is changed on B or C and its value in effect read back in the resumed
    process: the budget it stops at, the ratio base and both gates, Adam's param groups at every step, the batch
    and the loss's settings at every step, the norm of the gradient applied, the target's refreshes, the sampler's
    uniform share, the stored priorities, the actors' sync points (versions change only there), the games evaluated."""
    applied = set(reactor.APPLIED_ON_RESUME) | set(COMMON_APPLIED_ON_RESUME)
    assert set(APPLIED_PROBES) == applied == set(APPLIED_CHANGES), set(APPLIED_PROBES) ^ applied
    for flag, (name, value) in APPLIED_CHANGES.items():
        run = runs[name]
        assert value != A_FLAGS.get(flag, getattr(reactor.Args(), flag)), flag
        assert flag_values(run)[flag] == value, flag
        APPLIED_PROBES[flag](run, value)

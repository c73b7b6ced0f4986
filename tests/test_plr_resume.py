"""plr_ppo.py's loop contract, clause 6 (the list in tests/test_plr_loop.py): a resumed run continues the
checkpointed one. At its first update, counters, optimizer state, normaliser statistics, every RNG and the sampler
equal the checkpoint's (the partial scores and running returns of the restarted episodes dropped) and every flag of
APPLIED_ON_RESUME has its new value in effect, read back from behaviour; a run interrupted where every env starts a
new episode and resumed equals the uninterrupted run bit for bit. On the real tiny MiniGrid run and its resumption
with every applied flag changed (tests/plr_helpers.py), and on the deterministic fake env."""

import json
import random

import numpy as np
import pytest
import torch
from plr_helpers import (
    FAKE,
    FIRST,
    RESUMED,
    FakeLevelEnv,
    assert_same_state,
    check_normalized_rewards,
    check_run,
    check_update,
    fake_argv,
    periodic_evaluations,
    record_fake_run,
    run_main,
    settings_of,
    shared_minigrid_runs,
    snapshot_params,
)

import plr_ppo
from common.args import flag as flag_name


@pytest.fixture(scope="module")
def minigrid_runs(tmp_path_factory):
    """The real tiny MiniGrid run and its resumption (tests/plr_helpers.py: run once, shared by the test files)."""
    return shared_minigrid_runs(tmp_path_factory)


def test_resumed_run_acts_and_updates_with_the_new_flags(minigrid_runs):
    """Clauses 1-4 on the resumed run with every applied flag changed: the textbook with the new values holds, the
    restarted episodes are scored on their own steps only, and the rewards are normalised from the checkpoint's
    statistics with the new γ, every running return at 0."""
    _, checkpoint, resumed, _, _ = minigrid_runs
    settings = settings_of(FIRST | RESUMED, num_updates=3)
    _, norms, lengths = check_run(resumed.namespace, resumed.recorder, settings)
    normalizer = checkpoint["normalizer"]
    check_normalized_rewards(resumed.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    assert max(norms) > RESUMED["max_grad_norm"]
    assert len(lengths) >= FIRST["num_envs"]
    np.testing.assert_array_equal(resumed.recorder.first_levels(), checkpoint["env_levels"])


def test_the_runs_write_their_files_in_one_folder(minigrid_runs):
    """Both MiniGrid runs ran without procgen (it could not be imported); the first saved its model and logged Fig.
    4's replay mass by rooms once levels were scored; the resumed run said where it resumed and that its budget ends
    at the last whole batch, wrote into the same folder up to its end, every step logged once, and completed with
    its final evaluation."""
    first, _, resumed, run_dir, output = minigrid_runs
    assert (run_dir / "plr_ppo.model").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(name.startswith("plr/mass_rooms=") for row in rows for name in row)
    assert "resumed " in output and "at step 384" in output and "runs to step 768" in output
    assert "--total-timesteps 818 is not a multiple of one PPO batch (128 steps): the run ends at step 768" in output
    assert [row["global_step"] for row in rows if "losses/value_loss" in row] == [192, 384, 512, 640, 768]
    assert resumed.namespace["global_step"] == 768 and resumed.namespace["update"] == 5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] == 768 and "final_test_success" in summary


def test_resume_restores_the_checkpoint_one_by_one(minigrid_runs):
    """Clause 6 as a property: the checkpoint holds the first run's state when it was written (its end), and the
    resumed process, at its first update (the reset of its envs on the checkpoint's levels), holds it again: step and
    update counters, network,
    Adam's moments and settings (lr and eps: the new flags), the normaliser's statistics, the sampler's state and
    RNG, the evaluation RNG and every global RNG; at its first step the restarted episodes' partial scores S~ and
    running returns are 0."""
    first, checkpoint, resumed, _, _ = minigrid_runs
    end_of_first = first.recorder.checkpoint_states[-1]
    state = resumed.recorder.resume_states[0]
    for name in ("global_step", "update", "model", "optimizer", "sampler", "normalizer", "eval_rng"):
        assert_same_state(checkpoint[name], end_of_first[name], f"checkpoint {name}")
    assert_same_state(checkpoint["rng"]["python"], end_of_first["rng"]["python"])
    assert_same_state(checkpoint["rng"]["numpy"], end_of_first["rng"]["numpy"])
    assert_same_state(checkpoint["rng"]["torch"], end_of_first["rng"]["torch"])
    assert state["global_step"] == checkpoint["global_step"] == 384
    assert state["update"] == checkpoint["update"] == 2
    assert_same_state(state["model"], checkpoint["model"], "model")
    assert_same_state(state["optimizer"]["state"], checkpoint["optimizer"]["state"], "Adam moments")
    (group,) = state["optimizer"]["param_groups"]
    (saved_group,) = checkpoint["optimizer"]["param_groups"]
    assert group["lr"] == RESUMED["learning_rate"] and group["eps"] == RESUMED["adam_eps"]
    for name in set(saved_group) - {"lr", "eps"}:
        assert_same_state(group[name], saved_group[name], f"Adam {name}")
    assert_same_state(state["normalizer"], checkpoint["normalizer"], "normalizer")
    assert_same_state(state["sampler"], checkpoint["sampler"], "sampler")
    assert_same_state(state["eval_rng"], checkpoint["eval_rng"], "eval_rng")
    for name in ("python", "numpy", "torch"):
        assert_same_state(state["rng"][name], checkpoint["rng"][name], f"rng {name}")
    # the checkpoint's episodes were unfinished, so their restart drops their S~ (MultiRoom's rewards are 0 until a
    # goal is reached: the running returns' restart is checked on the fake env's resumed run)
    assert (checkpoint["sampler"]["partial_steps"] > 0).all()
    restarted = resumed.recorder.first_step_states[0]
    assert (restarted["partial_steps"] == 0).all() and (restarted["partial_score"] == 0).all()
    assert (restarted["normalizer_ret"] == 0).all()


def update_follows_textbook(run, settings):
    """Whether every recorded update of `run` is the textbook PPO update with `settings` (clause 3)."""
    agent = run.namespace["agent"]
    for k, update in enumerate(run.updates):
        next_params = run.updates[k + 1].adam_events()[0]["params"] if k + 1 < len(run.updates) else None
        next_params = next_params or snapshot_params(agent)
        try:
            check_update(agent, update, settings, next_params)
        except AssertionError:
            return False
    return True


def normalizer_follows_textbook(run, checkpoint, settings):
    normalizer = checkpoint["normalizer"]
    try:
        check_normalized_rewards(run.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    except AssertionError:
        return False
    return True


def probe_table(checkpoint):
    """For each flag of APPLIED_ON_RESUME: whether the resumed run's behaviour shows a given value in effect."""
    settings = settings_of(FIRST | RESUMED, num_updates=3)

    def with_value(flag):
        return lambda run, value: update_follows_textbook(run, settings | {flag: value})

    def sampler_config(field):
        return lambda run, value: getattr(run.namespace["sampler"].config, field) == value

    def epochs(run):
        return [sum(kind == "randperm" for kind, _ in update.events) for update in run.updates]

    def minibatches(run):
        return [sum(kind == "adam" for kind, _ in update.events) // epochs(run)[0] for update in run.updates]

    def eval_updates(run):
        return [update for update, _ in periodic_evaluations(run)[0]]

    first_update = checkpoint["update"] + 1
    updates_after_resume = range(first_update, first_update + 3)
    return {
        "total_timesteps": lambda run, value: run.namespace["end_step"] == 384 + (value - 384) // 128 * 128,
        "num_steps": lambda run, value: all(len(update.steps) == value for update in run.updates),
        "num_minibatches": lambda run, value: set(minibatches(run)) == {value},
        "update_epochs": lambda run, value: set(epochs(run)) == {value},
        "learning_rate": with_value("learning_rate"),
        "adam_eps": with_value("adam_eps"),
        "gamma": lambda run, value: (
            update_follows_textbook(run, settings | {"gamma": value})
            and normalizer_follows_textbook(run, checkpoint, settings | {"gamma": value})
        ),
        "gae_lambda": with_value("gae_lambda"),
        "clip_coef": with_value("clip_coef"),
        "clip_vloss": with_value("clip_vloss"),
        "ent_coef": with_value("ent_coef"),
        "vf_coef": with_value("vf_coef"),
        "max_grad_norm": with_value("max_grad_norm"),
        "norm_adv": with_value("norm_adv"),
        "eval_every": lambda run, value: eval_updates(run) == [u for u in updates_after_resume if value and u % value == 0],
        "eval_episodes": lambda run, value: {data["num_episodes"] for _, data in periodic_evaluations(run)[0]} == {value},
        "final_eval_episodes": lambda run, value: periodic_evaluations(run)[1]["num_episodes"] == value,
        "num_eval_envs": lambda run, value: (
            {data["num_envs"] for _, data in periodic_evaluations(run)[0]} | {periodic_evaluations(run)[1]["num_envs"]}
            == {value}
        ),
        "plr_temperature": sampler_config("temperature"),
        "plr_staleness_coef": sampler_config("staleness_coef"),
        "plr_replay_prob": sampler_config("replay_prob"),
        "plr_min_fill": sampler_config("min_fill"),
        "plr_score_alpha": sampler_config("score_alpha"),
    }


def test_every_applied_flag_takes_effect_on_resume(minigrid_runs):
    """Clause 6's flags: the resumed run changed every flag of APPLIED_ON_RESUME, and for each the behaviour read back
    from the run (the textbook update and normalisation with that value, the optimizer's steps, the rollout and
    minibatch sizes, the evaluations, the sampler's settings) shows the new value, not the checkpoint's. The probe
    table covers the class exactly, so a flag added to it without a probe fails here."""
    _, checkpoint, resumed, _, _ = minigrid_runs
    probes = probe_table(checkpoint)
    assert set(probes) == set(plr_ppo.APPLIED_ON_RESUME) == set(RESUMED)
    for flag, holds in probes.items():
        assert FIRST[flag] != RESUMED[flag], flag
        assert checkpoint["args"][flag] == FIRST[flag], flag
        assert holds(resumed, RESUMED[flag]), f"{flag_name(flag)} {RESUMED[flag]} is not in effect"
        assert not holds(resumed, FIRST[flag]), f"{flag_name(flag)}: the checkpoint's {FIRST[flag]} is still in effect"


def test_a_restored_return_normaliser_discounts_with_the_resumed_runs_gamma():
    """Clause 6, --gamma applied on resume: a return normaliser saved by a run at gamma 0.99 and restored into the
    resumed run's (gamma 0.9) keeps the saved running statistics and discounts from then on with 0.9: its returns and
    normalised rewards are the textbook's (gym's NormalizeReward: the statistics of all returns seen, Chan's pooled
    mean and variance) from the saved statistics on."""
    saved = plr_ppo.ReturnNormalizer(2, gamma=0.99)
    for rewards in ([1.0, 0.0], [0.5, 2.0], [0.0, 1.0]):
        saved(np.array(rewards), np.array([False, False]))
    state = saved.state_dict()
    restored = plr_ppo.ReturnNormalizer(2, gamma=0.9)
    restored.load_state_dict(state)
    restored.restart_episodes()
    first, second = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    restored(first, np.array([False, False]))
    normalized = restored(second, np.array([False, False]))
    returns = np.concatenate([first, 0.9 * first + second])
    count = state["count"] + returns.size
    mean = (state["count"] * state["mean"] + returns.sum()) / count
    var = (state["count"] * (state["var"] + (state["mean"] - mean) ** 2) + ((returns - mean) ** 2).sum()) / count
    np.testing.assert_allclose(restored.ret, 0.9 * first + second)
    np.testing.assert_allclose(normalized, np.clip(second / np.sqrt(var + 1e-8), -10, 10), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# A resume bit for bit, on the deterministic fake env
METRICS_OF_TIME = {"time", "charts/SPS", "charts/collect_seconds", "charts/plr_seconds"}


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    """Clause 6 in full: episodes of 4 steps in rollouts of 8, so that at the checkpoint every env starts a new episode
    and nothing is lost by the restart (env states are not saved; in general the episodes running at a checkpoint
    restart from their first frame, with their partial scores S~ and running returns dropped). A run of 4 updates,
    and one stopped by a SIGTERM after its checkpoint at 2 updates and resumed in a new process state, play the same
    actions and end with the same network, Adam state, sampler, normaliser, evaluation RNG, global RNGs, metrics
    (all but the clock's) and summary, bit for bit. The uninterrupted run also passes clauses 1-4 with truncations
    that bootstrap."""
    whole_dir = tmp_path / "whole"
    parts_dir = tmp_path / "parts"
    whole_dir.mkdir()
    parts_dir.mkdir()
    whole = record_fake_run(FakeLevelEnv, whole_dir, fake_argv(total_timesteps=96))
    check_run(whole.namespace, whole.recorder, settings_of(FAKE, bootstrap_truncation=True, num_updates=4))
    whole_state = whole.recorder.run_state()
    with pytest.raises(SystemExit) as stopped:
        record_fake_run(FakeLevelEnv, parts_dir, fake_argv(total_timesteps=96), stop_after_checkpoint=True)
    assert stopped.value.code == 143
    (run_dir,) = (parts_dir / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "interrupted by SIGTERM"
    # the process state the resumed run starts from is not the first run's
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)
    resumed = record_fake_run(FakeLevelEnv, parts_dir, ["--resume", str(run_dir / "checkpoint.pt")])
    resumed_state = resumed.recorder.run_state()
    for name in ("global_step", "update", "model", "optimizer", "sampler", "normalizer", "eval_rng"):
        assert_same_state(resumed_state[name], whole_state[name], name)
    for name in ("python", "numpy", "torch"):
        assert_same_state(resumed_state["rng"][name], whole_state["rng"][name], f"rng {name}")
    whole_actions = [step["actions"] for update in whole.updates for step in update.steps]
    resumed_actions = [step["actions"] for update in resumed.updates for step in update.steps]
    assert_same_state(resumed_actions, whole_actions[-len(resumed_actions) :], "actions")
    (whole_run,) = (whole_dir / "runs").iterdir()
    rows = [read_rows(run / "metrics.jsonl") for run in (whole_run, run_dir)]
    assert rows[0] == rows[1] and len(rows[0]) == 4 + 1
    summaries = [json.loads((run / "summary.json").read_text()) for run in (whole_run, run_dir)]
    for summary in summaries:
        del summary["wall_time_s"]
        del summary["run_name"]
    assert summaries[0] == summaries[1]


def read_rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{name: value for name, value in row.items() if name not in METRICS_OF_TIME} for row in rows]


# ----------------------------------------------------------------------------------------------------------------
# The per-domain defaults in a checkpoint
def test_a_checkpoint_holds_the_resolved_defaults_and_resumes_with_them(tmp_path, monkeypatch):
    """A run with every per-domain flag left out (DOMAIN_DEFAULTS) saves their resolved values in its checkpoint
    (`vars(args)` after resolve_defaults), as the sentinel rule's runs did, so that their checkpoints resume with those
    values in effect. A checkpoint holding a sentinel -1 (none was written: the values were resolved before saving) is
    refused in one line."""
    monkeypatch.setattr(plr_ppo, "MiniGridVecEnv", FakeLevelEnv)
    monkeypatch.chdir(tmp_path)
    run_flags = ["--num-envs", "2", "--num-steps", "8", "--num-minibatches", "2", "--eval-every", "0"]
    run_flags += ["--final-eval-episodes", "0", "--no-progress", "--no-cuda", "--checkpoint-every", "16"]
    run_main(["--env-id", "MiniGrid-Empty-5x5-v0", "--total-timesteps", "16", *run_flags])
    (run_dir,) = (tmp_path / "runs").iterdir()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    minigrid = plr_ppo.DOMAIN_DEFAULTS["minigrid"]
    assert {name: checkpoint["args"][name] for name in minigrid} == minigrid
    resumed = run_main(["--resume", str(run_dir / "checkpoint.pt"), "--total-timesteps", "32"])
    assert {name: getattr(resumed["args"], name) for name in minigrid} == minigrid
    assert resumed["optimizer"].param_groups[0]["lr"] == minigrid["learning_rate"]
    assert resumed["sampler"].seeds.tolist() == list(range(minigrid["num_train_levels"]))
    assert resumed["global_step"] == 32
    checkpoint["args"]["learning_rate"] = -1.0
    torch.save(checkpoint, tmp_path / "sentinel.pt")
    with pytest.raises(SystemExit) as refused:
        run_main(["--resume", str(tmp_path / "sentinel.pt")])
    assert str(refused.value) == "error: --learning-rate must be > 0, got -1.0"

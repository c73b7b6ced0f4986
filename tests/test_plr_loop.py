"""plr_ppo.py's training loop as a contract, each clause checked on the real `__main__` run in this process
(its code executed in the module's namespace, so that spies on the module's functions and classes see every call),
against textbook versions written from the papers (tests/plr_helpers.py). Clauses 1-4 and 7 are tested here, clause 5
in tests/test_plr_evaluation.py, clause 6 in tests/test_plr_resume.py:

1. Acting: each action is a sample of π_θ(·|s_t) with the parameters θ of the rollout's start, not its argmax.
2. The rollout the update sees: the env's transitions; rewards divided by the running std of the discounted return
   (γ; its statistics restored on --resume, each env's running return restarted with its episode); a timeout
   terminates (MiniGrid) or bootstraps from V(final obs) (--bootstrap-truncation).
3. One PPO update: --update-epochs passes, each over a fresh permutation of the batch in --num-minibatches
   minibatches; each step's gradient is that of the clipped surrogate (the ratio against the rollout's log-probs,
   with its gradient), the clipped value loss and the entropy bonus, with GAE advantages (γ, λ) normalised over the
   whole batch, clipped to --max-grad-norm after backward; then one Adam step (lr, eps) from the previous moments.
4. What the sampler is told, and when: each new episode starts on the level `sample` returned for its env;
   `update_with_rollouts` once per update, before the PPO update, with the behaviour policy's scores: every finished
   episode committed once, on the level it was played, with the mean |GAE| over its own steps stitched across
   rollouts (--plr-commit episode); with --plr-commit update also every unfinished one, by `after_update`, once per
   update after the PPO update.
5. Evaluation: the current network; actions sampled from its policy; each env's first episodes, as many as its share
   (`episodes_per_env`), whatever their lengths; test levels held out (never a training level), training levels the
   sampler's (the buffer's in unbounded mode); a stop signal ends it.
6. Resume: at its first update, counters, optimizer state, normaliser statistics, every RNG and the sampler equal the
   checkpoint's (the partial scores and running returns of the restarted episodes dropped) and every flag of
   APPLIED_ON_RESUME has its new value in effect; a run interrupted where every env starts a new episode and resumed
   equals the uninterrupted run bit for bit.
7. Start-up: a rollout too large for memory is one `error:` line before the run folder; the labelling of the training
   levels' difficulties stops at a stop signal.
"""

import json
import signal

import pytest
import torch
from plr_helpers import (
    FAKE,
    FIRST,
    FakeLevelEnv,
    UnalignedLevelEnv,
    check_initial_levels,
    check_normalized_rewards,
    check_run,
    fake_argv,
    record_fake_run,
    recorded_commits,
    run_main,
    settings_of,
    shared_minigrid_runs,
)

import plr_ppo
from common import processes


@pytest.fixture(scope="module")
def minigrid_runs(tmp_path_factory):
    """The real tiny MiniGrid run and its resumption (tests/plr_helpers.py: run once, shared by the test files)."""
    return shared_minigrid_runs(tmp_path_factory)


def test_first_run_acts_updates_and_tells_the_sampler_as_the_textbook(minigrid_runs):
    """Clauses 1-4 on a real MiniGrid run (a timeout terminates, --plr-commit episode): the actions are samples of
    π_θold, each minibatch step's gradient and Adam step are the textbook's, the sampler's levels, calls and commits
    are Algorithm 4's with the behaviour policy's |GAE|, and the rewards are the textbook normalisation."""
    first, _, _, _, _ = minigrid_runs
    settings = settings_of(FIRST)
    check_initial_levels(first.recorder, FIRST["num_envs"])
    _, norms, lengths = check_run(first.namespace, first.recorder, settings)
    check_normalized_rewards(first.updates, settings)
    # the gradient clip acted; episodes finished, stitched across the two rollouts, and others are unfinished
    assert max(norms) > FIRST["max_grad_norm"]
    assert len(lengths) >= FIRST["num_envs"] and max(lengths) > FIRST["num_steps"]
    assert (first.namespace["sampler"].partial_steps > 0).any()


# ----------------------------------------------------------------------------------------------------------------
# The loop on a deterministic fake env: truncations that bootstrap, --plr-commit update
def test_truncation_bootstrap_and_commit_after_update_on_a_resumed_run(tmp_path):
    """Clauses 1-4 with --bootstrap-truncation (a truncated episode bootstraps from V(final obs)) and --plr-commit
    update (`after_update` commits each unfinished episode after the PPO update), on episodes that run across
    rollouts; and clause 6's running returns: the resumed run normalises from the checkpoint's statistics, with the
    new --gamma and every env's running return restarted at 0 (the checkpoint's were not 0)."""
    first = record_fake_run(UnalignedLevelEnv, tmp_path, fake_argv(total_timesteps=48, plr_commit="update"))
    settings = settings_of(FAKE, bootstrap_truncation=True, plr_commit="update", num_updates=2)
    check_initial_levels(first.recorder, FAKE["num_envs"])
    check_run(first.namespace, first.recorder, settings)
    check_normalized_rewards(first.updates, settings)
    assert any(step["truncated"].any() for update in first.updates for step in update.steps)
    assert all(recorded_commits(update)[1] for update in first.updates)
    (run_dir,) = (tmp_path / "runs").iterdir()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert (checkpoint["normalizer"]["ret"] != 0).any()
    # --gamma changed on resume: the normaliser's discount too (MultiRoom's zero rewards cannot show it)
    resume_argv = ["--resume", str(run_dir / "checkpoint.pt"), "--total-timesteps", "96", "--gamma", "0.8"]
    resumed = record_fake_run(UnalignedLevelEnv, tmp_path, resume_argv)
    settings["gamma"] = 0.8
    check_run(resumed.namespace, resumed.recorder, settings)
    normalizer = checkpoint["normalizer"]
    check_normalized_rewards(resumed.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    assert (resumed.recorder.first_step_states[0]["normalizer_ret"] == 0).all()
    # an episode ended on a rollout's first step (its one-step segment must be scored on its own level)
    assert any(t == 0 for run in (first, resumed) for update in run.updates for t, _, _ in update.samples)


# ----------------------------------------------------------------------------------------------------------------
# Clause 7: start-up
@pytest.mark.parametrize("env_id", ["MultiRoom-N4-Random", "bigfish"])
def test_a_rollout_too_large_for_memory_is_one_error_line_before_the_run_folder(tmp_path, monkeypatch, capsys, env_id):
    """A huge --num-steps (within the budget: 8 x 10^8 steps) stops the start with one `error:` line naming the flags
    that size the rollout, before any run folder or env exists; a rollout that fits passes the same check."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        run_main(["--env-id", env_id, "--num-envs", "8", "--num-steps", "100000000", "--total-timesteps", "800000000"])
    message = str(stopped.value)
    assert message.startswith("error: the rollout needs") and "\n" not in message and "--num-steps" in message
    assert not (tmp_path / "runs").exists()
    capsys.readouterr()
    plr_ppo.check_rollout_memory(plr_ppo.resolve_defaults(plr_ppo.Args(env_id=env_id, cuda=False)))
    assert capsys.readouterr().out.startswith("rollout: ")


def test_labelling_the_training_levels_stops_at_a_stop_signal(tmp_path, monkeypatch):
    """The start-up labelling of every training level's difficulty (4,000 MultiRoom levels: seconds) checks for a stop
    at each level: a SIGINT recorded while the 3rd level is labelled stops the run before the 4th, with summary.json
    written and exit code 130."""
    labelled = []
    real_level_difficulty = plr_ppo.level_difficulty

    def level_difficulty(env_id, level):
        labelled.append(level)
        if len(labelled) == 3:
            processes._received_signals.append(signal.SIGINT)
        return real_level_difficulty(env_id, level)

    monkeypatch.setattr(plr_ppo, "level_difficulty", level_difficulty)
    monkeypatch.setattr(processes, "_received_signals", [])
    monkeypatch.setattr(plr_ppo, "MiniGridVecEnv", FakeLevelEnv)
    monkeypatch.chdir(tmp_path)
    try:
        run_main(["--env-id", "MultiRoom-N4-Random", "--num-envs", "2", "--num-steps", "8", "--no-progress", "--no-cuda"])
    except SystemExit as stopped:
        assert stopped.code == 130
    except KeyboardInterrupt:
        pytest.fail("the stop escaped the run's loop: a traceback and no summary.json")
    else:
        pytest.fail("the run did not stop")
    assert len(labelled) == 3
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "interrupted by SIGINT"


def test_on_a_cuda_learner_the_rollout_is_checked_against_free_gpu_memory(monkeypatch):
    """With the learner on CUDA (faked here: no GPU in CI), the rollout's buffers are checked against the GPU's free
    memory (100 MiB here): one `error:` line when they do not fit (the paper's 64 x 256 Procgen rollout, 0.19 GiB), and the
    start goes on when they do."""
    monkeypatch.setattr(plr_ppo, "select_device", lambda cuda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 2**31))
    args = plr_ppo.resolve_defaults(plr_ppo.Args(env_id="bigfish", num_envs=64, num_steps=256))
    with pytest.raises(SystemExit) as stopped:
        plr_ppo.check_rollout_memory(args)
    assert str(stopped.value).startswith("error: the rollout needs") and "GPU memory" in str(stopped.value)
    plr_ppo.check_rollout_memory(plr_ppo.resolve_defaults(plr_ppo.Args(env_id="bigfish", num_envs=4, num_steps=16)))

"""plr_ppo.py's loop contract, clause 5 (the list in tests/test_plr_loop.py): evaluation plays the current network,
samples its actions from the policy, counts each env's first episodes, as many as its share (`episodes_per_env`),
whatever their lengths, plays held-out test levels (never a training level) and training levels (the buffer's in
unbounded mode), and ends at a stop signal. `evaluate` on fake envs, and the evaluations of the real tiny MiniGrid
run's resumption (tests/plr_helpers.py). Also the held-out levels of tests/benchmarks/plr_eval_by_difficulty.py."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from plr_helpers import assert_same_state, periodic_evaluations, shared_minigrid_runs, snapshot_params
from scipy import stats

import plr_ppo
from plr_ppo import Args, SamplerConfig, UnboundedLevelSampler


@pytest.fixture(scope="module")
def minigrid_runs(tmp_path_factory):
    """The real tiny MiniGrid run and its resumption (tests/plr_helpers.py: run once, shared by the test files)."""
    return shared_minigrid_runs(tmp_path_factory)


def test_evaluation_in_the_loop_plays_the_current_network(minigrid_runs):
    """Clause 5 in the loop: each evaluation gets the run's network with the parameters of the last update, and the
    final evaluation those of the run's end."""
    _, _, resumed, _, _ = minigrid_runs
    periodic, final = periodic_evaluations(resumed)
    assert len(periodic) == 3 and final is not None
    for (_, data), update in zip(periodic, resumed.updates[1:]):
        assert data["agent"] is resumed.namespace["agent"]
        assert_same_state(data["params"], update.adam_events()[0]["params"])
    assert_same_state(final["params"], snapshot_params(resumed.namespace["agent"]))


# ----------------------------------------------------------------------------------------------------------------
# evaluate on fake envs: the episodes counted and the policy
class LevelOutcomeEnv:
    """The vector-env interface `evaluate` uses, with episodes whose length and return depend only on their level
    (`outcome(levels) -> (lengths, returns)`); `actions` holds every action it was given."""

    def __init__(self, num_envs, outcome):
        self.num_envs = num_envs
        self.outcome = outcome
        self.actions = []

    def reset(self, levels):
        self.levels = np.array(levels)
        self.t = np.zeros(self.num_envs, int)
        self.episodes = [[] for _ in range(self.num_envs)]
        return np.zeros((self.num_envs, 1))

    def step(self, actions, next_level):
        self.actions.append(np.array(actions))
        self.t += 1
        lengths, returns = self.outcome(self.levels)
        done = self.t >= lengths
        info = {"_episode": done, "episode_return": np.where(done, returns, 0.0)}
        for i in np.flatnonzero(done):
            self.episodes[i].append(int(self.levels[i]))
            self.levels[i] = next_level(i)
            self.t[i] = 0
        return np.zeros((self.num_envs, 1)), np.zeros(self.num_envs), done, done, info


def uniform_policy(obs):
    return torch.zeros(len(obs), 7), torch.zeros(len(obs))


def uniform_level_sets(rng):
    return {kind: (lambda: int(rng.integers(1000))) for kind in ("train", "test")}


def solved_in_5_or_timeout_at_20(levels):
    """The issue's first setup, in a quarter of the steps (the same order of episode ends): 1 level in 5 is solved
    with return 0.9, the others time out with 0 (true mean return 0.18, success 0.2)."""
    solved = levels % 5 == 0
    return np.where(solved, 5, 20), np.where(solved, 0.9, 0.0)


def win_in_1_or_lose_in_20(levels):
    """The issue's second setup: half the levels are won in 1 step (return 1), half lost in 20 (true mean 0.5)."""
    win = levels % 2 == 0
    return np.where(win, 1, 20), np.where(win, 1.0, 0.0)


@pytest.mark.parametrize(
    "outcome,true_return,true_success",
    [(solved_in_5_or_timeout_at_20, 0.18, 0.2), (win_in_1_or_lose_in_20, 0.5, 0.5)],
)
def test_evaluation_is_unbiased_when_short_episodes_are_better(outcome, true_return, true_success):
    """Clause 5: with 10 episodes on 8 envs (the defaults: not a whole number per env), where short episodes have the
    higher return, the mean over 200 evaluations is the true mean within 4 standard errors (counting the first 10
    episodes to finish measured 0.25 and 0.59 here)."""
    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    rng = np.random.default_rng(0)
    returns = []
    successes = []
    for _ in range(100):
        metrics = plr_ppo.evaluate(uniform_policy, LevelOutcomeEnv(8, outcome), uniform_level_sets(rng), 10, args, "cpu")
        returns += [metrics["eval/train_return"], metrics["eval/test_return"]]
        successes += [metrics["eval/train_success"], metrics["eval/test_success"]]
    for values, truth in ((returns, true_return), (successes, true_success)):
        standard_error = np.std(values, ddof=1) / np.sqrt(len(values))
        assert abs(np.mean(values) - truth) <= 4 * standard_error, (np.mean(values), truth, standard_error)


def test_evaluation_counts_each_envs_first_episodes_in_a_fixed_order():
    """Clause 5 exactly: 10 episodes on 4 envs whose episode lengths differ (env i's episodes last i + 1 steps): the
    episodes counted are envs 0-1's first 3 and envs 2-3's first 2 (`episodes_per_env`), none of the later ones that
    the fast envs finish while the slow ones play."""
    assert plr_ppo.episodes_per_env(10, 4) == [3, 3, 2, 2]
    assert plr_ppo.episodes_per_env(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert plr_ppo.episodes_per_env(16, 8) == [2] * 8
    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    # env i's episodes last i + 1 steps; an episode's return is its level, a number drawn once
    envs = LevelOutcomeEnv(4, lambda levels: (np.arange(1, 5), levels.astype(float)))
    counter = iter(range(1, 10**6))
    metrics = plr_ppo.evaluate(uniform_policy, envs, {"train": counter.__next__, "test": counter.__next__}, 10, args, "cpu")
    counted = [level for episodes, share in zip(envs.episodes, [3, 3, 2, 2]) for level in episodes[:share]]
    assert len(envs.episodes[0]) > 3  # the fast env went on playing, uncounted
    assert metrics["eval/test_return"] == pytest.approx(np.mean(counted))
    assert metrics["eval/test_return_se"] == pytest.approx(np.std(counted, ddof=1) / np.sqrt(10))


def test_evaluation_samples_the_policy():
    """Clause 5's policy: evaluation's actions on a fixed observation are distributed as softmax(logits) (Pearson
    chi-square, p > 1e-4), not the argmax. Its samples come from a seeded torch stream (forked: the tests after it
    see the global RNG as it was), so the outcome does not depend on which tests ran before."""
    probs = np.array([0.05, 0.1, 0.15, 0.2, 0.5])
    logits = torch.log(torch.as_tensor(probs, dtype=torch.float32))

    def policy(obs):
        return logits.repeat(len(obs), 1), torch.zeros(len(obs))

    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    envs = LevelOutcomeEnv(8, lambda levels: (np.full(len(levels), 50), np.zeros(len(levels))))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plr_ppo.evaluate(policy, envs, uniform_level_sets(np.random.default_rng(1)), 8, args, "cpu")
    actions = np.concatenate(envs.actions)
    counts = np.bincount(actions, minlength=len(probs))
    assert len(actions) == 2 * 50 * 8
    assert stats.chisquare(counts, probs * len(actions)).pvalue > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# Held-out evaluation: test levels are never training levels, train-level evaluation plays only training levels
class OneStepLevelEnv:
    """The vector-env interface `evaluate` uses: every episode lasts one step and returns 1 on a training level, 0 on any
    other; `played` holds the level of every episode, one list per reset (one per evaluated level set)."""

    def __init__(self, num_envs, training_levels):
        self.num_envs = num_envs
        self.training_levels = set(training_levels)
        self.levels = np.zeros(num_envs, np.int64)
        self.played = []

    def reset(self, levels):
        self.levels = np.array(levels, np.int64)
        self.played.append([])
        return np.zeros((self.num_envs, 1))

    def step(self, actions, next_level):
        self.played[-1] += self.levels.tolist()
        returns = np.array([float(s in self.training_levels) for s in self.levels])
        info = {"_episode": np.ones(self.num_envs, bool), "episode_return": returns}
        self.levels = np.array([next_level(i) for i in range(self.num_envs)], np.int64)
        return np.zeros((self.num_envs, 1)), returns, np.ones(self.num_envs, bool), np.zeros(self.num_envs, bool), info


def _evaluate_levels(args, sampler, training_levels, num_episodes=200):
    """Runs plr_ppo.evaluate with the script's level sets; returns its metrics and the levels each set played."""
    envs = OneStepLevelEnv(4, training_levels)
    level_sets = plr_ppo.eval_level_sets(args, sampler, np.random.default_rng(0))
    assert list(level_sets) == ["train", "test"]

    def uniform_policy(obs):
        return torch.zeros(len(obs), 7), torch.zeros(len(obs))

    metrics = plr_ppo.evaluate(uniform_policy, envs, level_sets, num_episodes, args, "cpu")
    train_played, test_played = envs.played
    return metrics, set(train_played), set(test_played)


def test_evaluation_test_levels_are_held_out(monkeypatch):
    """Training levels 10..49 of a seed space shrunk to [0, 60), so that test draws would hit them often if they could."""
    monkeypatch.setattr(plr_ppo, "MAX_SEED", 60)
    args = Args(env_id="MultiRoom-N4-Random", start_level=10, num_train_levels=40, num_envs=4)
    training_levels = set(range(10, 50))
    metrics, train_played, test_played = _evaluate_levels(args, plr_ppo.make_sampler(args, seed=0), training_levels)
    assert train_played <= training_levels and len(train_played) > 30
    assert test_played.isdisjoint(training_levels)
    assert test_played == set(range(10)) | set(range(50, 60))  # all held-out levels, on both sides of the range
    assert metrics["eval/train_return"] == 1.0 and metrics["eval/test_return"] == 0.0
    assert metrics["eval/generalization_gap"] == 1.0


def test_evaluation_unbounded_mode_train_is_the_buffer_test_is_not(monkeypatch):
    """Unbounded mode: training levels are the buffer's levels; test levels are any other seed of [0, 20)."""
    monkeypatch.setattr(plr_ppo, "MAX_SEED", 20)
    args = Args(env_id="MultiRoom-N4-Random", num_train_levels=0, plr_replay_schedule="fixed", num_envs=5)
    sampler = UnboundedLevelSampler(5, SamplerConfig(buffer_size=5, replay_schedule="fixed"))
    buffer = [3, 7, 11, 12, 19]
    sampler.update_with_rollouts(np.ones((1, 5)), np.ones((1, 5), bool), np.array([buffer]))
    assert set(sampler.slot_of) == set(buffer)
    metrics, train_played, test_played = _evaluate_levels(args, sampler, buffer)
    assert train_played == set(buffer)
    assert test_played == set(range(20)) - set(buffer)
    assert metrics["eval/train_return"] == 1.0 and metrics["eval/test_return"] == 0.0


def test_evaluation_stops_at_a_stop_signal(monkeypatch):
    """A recorded SIGTERM (common.processes: handlers only record) ends evaluate at its next step, as it ends the
    periodic and the final evaluations of a run."""
    import signal

    from common import processes

    monkeypatch.setattr(processes, "_received_signals", [signal.SIGTERM])
    args = Args(env_id="MultiRoom-N4-Random", num_train_levels=40, num_envs=4)
    envs = OneStepLevelEnv(4, range(40))
    level_sets = plr_ppo.eval_level_sets(args, plr_ppo.make_sampler(args, seed=0), np.random.default_rng(0))
    with pytest.raises(processes.Interrupted):
        plr_ppo.evaluate(lambda obs: (torch.zeros(len(obs), 7), torch.zeros(len(obs))), envs, level_sets, 10, args, "cpu")
    assert envs.played == [[]]  # reset, then stopped before the first step


# ----------------------------------------------------------------------------------------------------------------
# tests/benchmarks/plr_eval_by_difficulty.py: the held-out levels of each difficulty
class SmallSeedSpace:
    """An RNG of level seeds in [0, 60) (the benchmark's draws are in [0, 2^31 - 1)): most draws are training levels
    or seeds drawn before."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def integers(self, high):
        return int(self.rng.integers(60))


def test_held_out_levels_by_difficulty_are_never_played_twice(monkeypatch):
    """plr_eval_by_difficulty.py's levels: each difficulty's held-out levels are drawn as they are needed from one RNG
    stream, after the levels drawn at the start, so that however many episodes the envs past their share play, no
    level comes round again (a counted episode replaying a counted level) and none is a training level; the i-th
    level of a difficulty is the same whatever order the difficulties are asked in (every run of the benchmark plays
    the same levels). ObstructedMazeGamut-Easy: difficulty = variant seed mod 3; training levels 0-39 of [0, 60)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "benchmarks"))
    from plr_eval_by_difficulty import HeldOutLevels

    args = SimpleNamespace(env_id="ObstructedMazeGamut-Easy", start_level=0, num_train_levels=40)
    variants = ["1Dl", "1Dlh", "1Dlhb"]
    held_out_seeds = {variant: [seed for seed in range(40, 60) if seed % 3 == k] for k, variant in enumerate(variants)}
    streams = []
    for order in ("one difficulty after another", "in turn"):
        held_out = HeldOutLevels(args, seed=0)
        held_out.rng = SmallSeedSpace(0)
        # as the benchmark: some levels drawn at the start, then each difficulty's as they are needed
        for _ in range(6):
            held_out.draw()
        levels = {variant: held_out.levels(variant) for variant in variants}
        played = {variant: [] for variant in variants}
        if order == "in turn":
            for k in range(max(len(seeds) for seeds in held_out_seeds.values())):
                for variant in variants:
                    if k < len(held_out_seeds[variant]):
                        played[variant].append(next(levels[variant]))
        else:
            for variant in variants:
                played[variant] = [next(levels[variant]) for _ in held_out_seeds[variant]]
        for variant in variants:
            # every held-out level of the difficulty once: none twice, no training level
            assert sorted(played[variant]) == held_out_seeds[variant], (order, variant)
        streams.append(played)
    assert streams[0] == streams[1]

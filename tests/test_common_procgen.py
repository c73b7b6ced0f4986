"""common/procgen_env.py: shapes, level control by set_state, level seeds per transition, episode statistics."""

import numpy as np
import pytest
from procgen import ProcgenGym3Env

from common.procgen_env import ProcgenVecEnv


def _fresh(level, game="bigfish"):
    return ProcgenGym3Env(num=1, env_name=game, start_level=level, num_levels=1, distribution_mode="easy", num_threads=0)


def test_shapes_and_dtypes():
    env = ProcgenVecEnv("coinrun", 3, num_levels=10, num_threads=0)
    obs = env.reset()
    assert obs.shape == (3, 64, 64, 3) and obs.dtype == np.uint8
    assert env.single_observation_space.shape == (64, 64, 3) and env.single_action_space.n == 15
    obs, reward, terminated, truncated, info = env.step(np.zeros(3, dtype=np.int64))
    assert obs.shape == (3, 64, 64, 3) and obs.dtype == np.uint8
    assert reward.dtype == np.float32 and reward.shape == (3,)
    assert terminated.dtype == bool and truncated.dtype == bool
    assert info["level_seed"].shape == (3,) and info["_episode"].dtype == bool
    assert ((0 <= info["level_seed"]) & (info["level_seed"] < 10)).all()
    env.close()


@pytest.mark.parametrize("game", ["bigfish", "maze"])
def test_set_level_gives_same_first_obs_and_trajectory_as_fresh_env(game):
    env = ProcgenVecEnv(game, 4, num_threads=0)
    levels = [11, 42, 7, 42]
    obs = env.reset(levels)
    fresh = _fresh(42, game)
    assert np.array_equal(fresh.observe()[1]["rgb"][0], obs[1])
    assert np.array_equal(obs[1], obs[3]), "two envs on the same level start identically"
    assert not np.array_equal(obs[0], obs[1])
    rng = np.random.default_rng(0)
    mismatches = 0
    steps = 0
    for _ in range(200):
        a = rng.integers(0, 15, size=4)
        obs, reward, terminated, truncated, info = env.step(a, next_level=lambda i: levels[i])
        fresh.act(a[1:2].astype(np.int32))
        f_rew, f_obs, _ = fresh.observe()
        steps += 1
        mismatches += int(not np.array_equal(f_obs["rgb"][0], obs[1])) + int(f_rew[0] != reward[1])
        assert info["level_seed"][1] == 42
    assert mismatches == 0 and steps == 200


def test_after_episode_end_env_is_on_the_chosen_level():
    env = ProcgenVecEnv("bigfish", 4, num_threads=0, num_levels=5)
    env.reset([0, 1, 2, 3])
    chosen = {}
    counter = iter(range(1000, 10_000))

    def next_level(i):
        chosen[i] = next(counter)
        return chosen[i]

    ended = 0
    rng = np.random.default_rng(1)
    previous_next = env.levels.copy()
    for _ in range(2000):
        obs, reward, terminated, truncated, info = env.step(rng.integers(0, 15, size=4), next_level=next_level)
        np.testing.assert_array_equal(info["level_seed"], previous_next)  # transition played on the level set before
        for i in np.flatnonzero(info["_episode"]):
            ended += 1
            assert info["next_level_seed"][i] == chosen[i]
            fresh = _fresh(chosen[i])
            assert np.array_equal(fresh.observe()[1]["rgb"][0], obs[i]), "obs[i] is the chosen level's first frame"
            assert info["episode_length"][i] > 0
            assert terminated[i] != truncated[i]
        previous_next = info["next_level_seed"]
        if ended >= 3:
            break
    assert ended >= 3


def test_timeout_is_truncation_with_true_final_frame_and_episode_stats():
    """maze never ends by itself under the no-op action (4); the adapter cuts it one step before the game's own
    500-step limit, reports a truncation and keeps the true last frame in info["final_obs"]."""
    env = ProcgenVecEnv("maze", 2, num_threads=0)
    env.reset([5, 6])
    fresh = _fresh(5, "maze")
    returns = np.zeros(2)
    for t in range(600):
        obs, reward, terminated, truncated, info = env.step(np.full(2, 4), next_level=lambda i: 7)
        fresh.act(np.array([4], dtype=np.int32))
        returns += reward
        if info["_episode"].any():
            break
    assert t == 498 and truncated.all() and not terminated.any()
    np.testing.assert_array_equal(info["episode_length"], [499, 499])
    np.testing.assert_allclose(info["episode_return"], returns)
    assert np.array_equal(info["final_obs"][0], fresh.observe()[1]["rgb"][0]), "final_obs is the true last frame"
    assert np.array_equal(obs[0], _fresh(7, "maze").observe()[1]["rgb"][0]), "obs is the next level's first frame"
    np.testing.assert_array_equal(info["next_level_seed"], [7, 7])
    plain = ProcgenVecEnv("maze", 1, num_threads=0, num_levels=3, start_level=10)  # no callback: a level of the range
    plain.reset()
    for _ in range(499):
        obs, reward, terminated, truncated, info = plain.step(np.full(1, 4))
    assert truncated[0] and 10 <= info["next_level_seed"][0] < 13


def test_level_completion_is_termination():
    env = ProcgenVecEnv("bigfish", 2, num_threads=0)
    env.reset([1, 2])
    rng = np.random.default_rng(0)
    for _ in range(1000):
        obs, reward, terminated, truncated, info = env.step(rng.integers(0, 15, size=2))
        if info["_episode"].any():
            break
    i = np.flatnonzero(info["_episode"])[0]
    assert info["episode_length"][i] < 1000 and terminated[i] and not truncated[i]


def test_bad_options_fail_clearly():
    with pytest.raises(ValueError, match="unknown Procgen game"):
        ProcgenVecEnv("notagame", 2)
    with pytest.raises(ValueError, match="distribution mode"):
        ProcgenVecEnv("bigfish", 2, distribution_mode="medium")

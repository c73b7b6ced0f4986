"""common/mujoco_env.py: shapes, termination vs truncation, true final observation, refused envs."""

import numpy as np
import pytest

from common.mujoco_env import make_mujoco_env


def test_shapes_and_bounds():
    env = make_mujoco_env("HalfCheetah-v5", 0)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (17,) and env.action_space.shape == (6,)
    assert np.all(env.action_space.high == 1.0)


def test_time_limit_is_truncation_with_true_final_obs():
    env = make_mujoco_env("HalfCheetah-v5", 0, max_episode_steps=5)
    env.reset(seed=0)
    for t in range(5):
        obs, _, terminated, truncated, _ = env.step(np.zeros(6))
    assert truncated and not terminated
    # the returned obs is s_T of this episode (continuous with the previous step), not a reset observation
    qpos = env.unwrapped.data.qpos[1:]
    np.testing.assert_allclose(obs[: len(qpos)], qpos)
    reset_obs, _ = env.reset(seed=0)
    assert not np.allclose(obs, reset_obs)


def test_fall_is_termination():
    env = make_mujoco_env("Hopper-v5", 0)
    env.reset(seed=0)
    for t in range(1000):
        _, _, terminated, truncated, _ = env.step(np.ones(3))
        if terminated or truncated:
            break
    assert terminated and not truncated and t < 999


@pytest.mark.parametrize("env_id", ["CartPole-v1", "ALE/Pong-v5", "NoSuchEnv-v0"])
def test_refuses_non_mujoco(env_id):
    with pytest.raises(ValueError, match="non-MuJoCo"):
        make_mujoco_env(env_id, 0)

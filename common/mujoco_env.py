"""MuJoCo continuous-control tasks (gymnasium v5) for off-policy learners that must bootstrap on time limits.

`make_mujoco_env(env_id, seed)` returns a single gymnasium env with no autoreset, so:
- `terminated` (the body fell: no bootstrap) and `truncated` (the TimeLimit cut the episode: bootstrap V(s_T)) come
  apart exactly as gymnasium reports them;
- the observation returned with `truncated=True` is the true final observation s_T of the episode (a vector env in
  NEXT_STEP or SAME_STEP mode would hand back the next episode's first observation instead).
Observations are float64 vectors as gymnasium gives them; actions are a `Box` with the task's bounds.
Non-MuJoCo, discrete-action or image environments are refused with a one-line ValueError.
"""

from __future__ import annotations

import gymnasium as gym
from gymnasium.wrappers import RecordVideo

from common.video import check_video_support

MUJOCO_ENV_IDS = tuple(
    sorted(k for k, spec in gym.registry.items() if "mujoco" in str(spec.entry_point) and k.endswith("-v5"))
)


def check_mujoco_env_id(env_id: str) -> None:
    """Raise a one-line ValueError unless `env_id` is a gymnasium MuJoCo task."""
    spec = gym.registry.get(env_id)
    if spec is None or "mujoco" not in str(spec.entry_point):
        raise ValueError(f"unknown or non-MuJoCo env id {env_id!r}: use one of {', '.join(MUJOCO_ENV_IDS)}")


def make_mujoco_env(
    env_id: str,
    seed: int,
    *,
    capture_video: bool = False,
    video_folder: str | None = None,
    max_episode_steps: int | None = None,
) -> gym.Env:
    """A MuJoCo task with a continuous Box action space and vector observations; see the module docstring."""
    check_mujoco_env_id(env_id)
    if capture_video and not video_folder:
        raise ValueError("capture_video needs a video_folder")
    if capture_video:
        check_video_support()
    kwargs = {"max_episode_steps": max_episode_steps} if max_episode_steps is not None else {}
    env = gym.make(env_id, render_mode="rgb_array" if capture_video else None, **kwargs)
    if not isinstance(env.action_space, gym.spaces.Box):
        raise ValueError(f"{env_id} has a {type(env.action_space).__name__} action space: a continuous Box is needed")
    if len(env.observation_space.shape) != 1:
        raise ValueError(f"{env_id} has image/matrix observations {env.observation_space.shape}: a vector is needed")
    if capture_video:
        env = RecordVideo(env, video_folder, episode_trigger=lambda i: i % 10 == 0)
    env.action_space.seed(seed)
    env.observation_space.seed(seed)
    return env

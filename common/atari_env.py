"""Atari (gymnasium 1.x + ale-py, ROMs bundled) with the standard DQN/IMPALA preprocessing.

`make_atari_env(env_id, seed, ...)` stacks, from the emulator up:
1. `gym.make(env_id, frameskip=1, repeat_action_probability=p, full_action_space=...)` (sticky actions p = 0.25 by
   default as in ALE v5 / Machado et al. 2018; full 18-action space as an option, e.g. for multi-task heads);
   the episode is truncated after `max_episode_frames` emulator frames (108,000 = 30 minutes, the usual cap);
2. optional `RecordVideo` of the raw game into `video_folder` (whole games, not lives);
3. `AtariPreprocessing`: up to `noop_max` no-op starts, action repeat `frame_skip` with max-pooling of the last two
   frames, 84x84 grayscale;
4. `GameScore`: adds `info["episode"] = {"r": real game score, "l": agent steps}` on the step where the real game
   ends, so logged returns are the game score, never the clipped reward;
5. `LifeLossAsEpisodeEnd` (optional): a lost life ends the episode for learning (`terminated=True`), and the next
   `reset()` continues the same game with one no-op step instead of restarting it (Mnih et al. 2015);
   `info["game_over"]` says whether the game really ended;
6. `ClipReward` (optional): reward -> sign(reward);
7. frames as uint8 with a leading channel axis: (frame_stack, 84, 84); `frame_stack=1` for recurrent agents.

Use: `obs, info = env.reset(seed=seed)` (a seeded reset always starts a new game), then
`if terminated or truncated: obs, info = env.reset()`; bootstrap on `truncated`, not on `terminated`.
"""

from __future__ import annotations

import ale_py
import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, RecordVideo

from common.video import check_video_support

gym.register_envs(ale_py)
# no ALE banner on stderr (it came before a script's one-line start-up errors); ALE's errors are still printed
ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)

ATARI_ENV_IDS = tuple(sorted(k for k in gym.registry if k.startswith("ALE/") or k.endswith("NoFrameskip-v4")))


class GameScore(gym.Wrapper):
    """Puts the real (unclipped) score and length of a whole game in `info["episode"]` when the game ends."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.score = 0.0
        self.length = 0

    def reset(self, **kwargs):
        self.score = 0.0
        self.length = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        self.length += 1
        if terminated or truncated:
            info["episode"] = {"r": self.score, "l": self.length}
        return obs, reward, terminated, truncated, info


class LifeLossAsEpisodeEnd(gym.Wrapper):
    """A lost life ends the learning episode without resetting the game (`info["game_over"]` tells them apart)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        info["game_over"] = self.game_over
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs):
        # A seeded reset always starts a new game.
        if self.game_over or kwargs.get("seed") is not None:
            obs, info = self.env.reset(**kwargs)
        else:
            # Continue the same game after a lost life: one no-op step.
            obs, _, terminated, truncated, info = self.env.step(0)
            # The no-op ended the game: start a new one.
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        self.game_over = False
        self.lives = self.env.unwrapped.ale.lives()
        info["game_over"] = False
        return obs, info


class ClipReward(gym.RewardWrapper):
    """Reward -> sign(reward) in {-1, 0, 1} (DQN / IMPALA reward clipping)."""

    def reward(self, reward):
        return float(np.sign(reward))


class ChannelFirstUint8(gym.ObservationWrapper):
    """(84, 84) -> (1, 84, 84) so that every frame layout is (channels, height, width)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        h, w = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (1, h, w), np.uint8)

    def observation(self, obs):
        return obs[None]


def check_atari_env_id(env_id: str) -> None:
    """Raise a one-line ValueError unless `env_id` is a registered ALE id."""
    if env_id not in ATARI_ENV_IDS:
        raise ValueError(
            f"unknown Atari env id {env_id!r}: use an ALE id such as ALE/Pong-v5, ALE/Breakout-v5 or PongNoFrameskip-v4 "
            f"({len(ATARI_ENV_IDS)} registered)"
        )


def make_atari_env(
    env_id: str,
    seed: int,
    *,
    frame_stack: int = 4,
    clip_rewards: bool = True,
    terminal_on_life_loss: bool = True,
    full_action_space: bool = False,
    sticky_action_prob: float = 0.25,
    noop_max: int = 30,
    frame_skip: int = 4,
    max_episode_frames: int = 108_000,
    capture_video: bool = False,
    video_folder: str | None = None,
) -> gym.Env:
    """An Atari env with uint8 observations (frame_stack, 84, 84); see the module docstring for the wrapper stack."""
    check_atari_env_id(env_id)
    if frame_stack < 1 or frame_skip < 1 or noop_max < 0 or not 0.0 <= sticky_action_prob <= 1.0:
        raise ValueError("need frame_stack >= 1, frame_skip >= 1, noop_max >= 0 and 0 <= sticky_action_prob <= 1")
    if capture_video and not video_folder:
        raise ValueError("capture_video needs a video_folder")
    if capture_video:
        check_video_support()
    env = gym.make(
        env_id,
        frameskip=1,
        repeat_action_probability=sticky_action_prob,
        full_action_space=full_action_space,
        max_num_frames_per_episode=max_episode_frames,
        render_mode="rgb_array" if capture_video else None,
    )
    if capture_video:
        env = RecordVideo(env, video_folder, episode_trigger=lambda i: i % 10 == 0)
    env = AtariPreprocessing(env, noop_max=noop_max, frame_skip=frame_skip, screen_size=84, grayscale_obs=True)
    env = GameScore(env)
    if terminal_on_life_loss:
        env = LifeLossAsEpisodeEnd(env)
    if clip_rewards:
        env = ClipReward(env)
    env = FrameStackObservation(env, frame_stack) if frame_stack > 1 else ChannelFirstUint8(env)
    env.action_space.seed(seed)
    return env

"""MinAtar (Young & Tian 2019, https://arxiv.org/abs/1903.03176): five 10x10 Atari-like games as gymnasium 1.x envs.

`make_minatar_env(env_id, seed, ...)` returns one `MinAtarEnv` (no wrapper stack: the games step at 35k-170k
steps/s, so the adapter does its few jobs itself):
- ids as the `minatar` package registers them (`minatar.gym`): `MinAtar/<Game>-v0` plays the full action set of 6
  (shared by every game, as the full 18-action set of the Atari sequences in CLEAR's paper), `MinAtar/<Game>-v1`
  the game's minimal action set (e.g. Breakout: no-op, left, right). `MINATAR_ENV_IDS` lists all ten;
- observation: uint8 `(C, 10, 10)`, channels first, values 0/1 (MinAtar's bool `(10, 10, C)` state, transposed);
  `pad_channels=N` zero-pads the channels to N (`MINATAR_MAX_CHANNELS` = 10, Seaquest's count), so that one network
  can play a sequence of different games;
- MinAtar's own defaults: sticky actions with probability 0.1, difficulty ramping on;
- seeding through `reset(seed=...)`: MinAtar's one `RandomState` (game dynamics and sticky actions) is re-created from
  the seed; an unseeded reset continues the stream. The sticky action memory starts as no-op at every reset (as in
  ALE; MinAtar itself carries the last action of the previous episode over);
- MinAtar's own episode ends (a lost game, Freeway's 2,500-frame clock) are `terminated`; the adapter's time limit
  `max_episode_steps` (agent steps, default 10,000; None for none) is `truncated`, returned with the true last
  observation, so a learner can bootstrap from it;
- `info["episode"] = {"r": return, "l": length}` on the step that ends the episode (either way), as the Atari adapter.
The game classes are MinAtar's own (`minatar/environments/<game>.py`), loaded directly: MinAtar's thin `Environment`
wrapper imports matplotlib and seaborn for its display (about 2 s per process), so `MinAtarEnv` repeats its few
lines (one `RandomState` for the game and the sticky actions); a test checks both give identical trajectories.

Use: `obs, info = env.reset(seed=seed)`, then `if terminated or truncated: obs, info = env.reset()`; bootstrap on
`truncated`, not on `terminated`. One MinAtar frame is one agent step (no frame skip).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import gymnasium as gym
import numpy as np

MINATAR_GAMES = {
    "Asterix": "asterix",
    "Breakout": "breakout",
    "Freeway": "freeway",
    "Seaquest": "seaquest",
    "SpaceInvaders": "space_invaders",
}
MINATAR_ENV_IDS = tuple(f"MinAtar/{name}-v{v}" for v in (0, 1) for name in MINATAR_GAMES)
# Seaquest's; the others have 4 (Asterix, Breakout), 7 (Freeway), 6 (SpaceInvaders).
MINATAR_MAX_CHANNELS = 10


def check_minatar_env_id(env_id: str) -> None:
    """Raise a one-line ValueError unless `env_id` is one of `MINATAR_ENV_IDS`."""
    if env_id not in MINATAR_ENV_IDS:
        raise ValueError(
            f"unknown MinAtar env id {env_id!r}: use one of {', '.join(MINATAR_ENV_IDS)} "
            "(-v0: full 6-action set, -v1: the game's minimal action set)"
        )


@functools.cache
def _game_class(game: str):
    """MinAtar's `Env` class of one game, loaded from its file without importing the `minatar` package."""
    package_dir = os.path.dirname(importlib.util.find_spec("minatar").origin)
    path = os.path.join(package_dir, "environments", f"{game}.py")
    spec = importlib.util.spec_from_file_location(f"_minatar_{game}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Env


class MinAtarEnv(gym.Env):
    """One MinAtar game: uint8 (C, 10, 10) observations, optional channel padding, sticky actions, a time limit."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        env_id: str,
        *,
        pad_channels: int | None = None,
        sticky_action_prob: float = 0.1,
        difficulty_ramping: bool = True,
        max_episode_steps: int | None = 10_000,
    ):
        check_minatar_env_id(env_id)
        game, version = env_id.split("/")[1].rsplit("-v", 1)
        self.game = _game_class(MINATAR_GAMES[game])(ramping=difficulty_ramping)
        self.sticky_action_prob = sticky_action_prob
        self.last_action = 0
        # As MinAtar's Environment: one RandomState for the game and the sticky actions.
        self.rng = self.game.random
        self.channels = self.game.state_shape()[2]
        out_channels = self.channels if pad_channels is None else pad_channels
        if out_channels < self.channels:
            raise ValueError(f"pad_channels={pad_channels} is below {game}'s {self.channels} channels")
        if max_episode_steps is not None and max_episode_steps < 1:
            raise ValueError(f"max_episode_steps must be >= 1 or None, got {max_episode_steps}")
        self.action_set = self.game.minimal_action_set() if version == "1" else list(range(6))
        self.action_space = gym.spaces.Discrete(len(self.action_set))
        self.observation_space = gym.spaces.Box(0, 1, (out_channels, 10, 10), np.uint8)
        self.max_episode_steps = max_episode_steps
        self._obs = np.zeros((out_channels, 10, 10), np.uint8)  # padded channels stay zero
        self._return = 0.0
        self._length = 0

    def _observation(self) -> np.ndarray:
        self._obs[: self.channels] = self.game.state().transpose(2, 0, 1)
        return self._obs.copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self.rng = self.game.random = np.random.RandomState(seed)  # as minatar.Environment.seed
        self.game.reset()
        self.last_action = 0
        self._return = 0.0
        self._length = 0
        return self._observation(), {}

    def step(self, action):
        action = self.action_set[int(action)]
        # Sticky actions, as minatar.Environment.act.
        if self.rng.rand() < self.sticky_action_prob:
            action = self.last_action
        self.last_action = action
        reward, terminated = self.game.act(action)
        self._return += reward
        self._length += 1
        truncated = not terminated and self.max_episode_steps is not None and self._length >= self.max_episode_steps
        info = {"episode": {"r": self._return, "l": self._length}} if terminated or truncated else {}
        return self._observation(), float(reward), bool(terminated), truncated, info


def make_minatar_env(
    env_id: str,
    seed: int,
    *,
    pad_channels: int | None = None,
    sticky_action_prob: float = 0.1,
    difficulty_ramping: bool = True,
    max_episode_steps: int | None = 10_000,
) -> MinAtarEnv:
    """A MinAtar env with uint8 observations (C or pad_channels, 10, 10); see the module docstring.

    `seed` seeds the action space; pass it again to the first `reset(seed=...)` to seed the game."""
    if not 0.0 <= sticky_action_prob <= 1.0:
        raise ValueError(f"sticky_action_prob must be in [0, 1], got {sticky_action_prob}")
    env = MinAtarEnv(
        env_id,
        pad_channels=pad_channels,
        sticky_action_prob=sticky_action_prob,
        difficulty_ramping=difficulty_ramping,
        max_episode_steps=max_episode_steps,
    )
    env.action_space.seed(seed)
    return env

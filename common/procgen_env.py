"""Procgen as a numpy vector env whose every episode can start on a level chosen by the caller (for PLR).

`ProcgenVecEnv` wraps the gym3 `ProcgenGym3Env` (procgen 0.10.7, C++ envs stepped in native threads) and gives:
- numpy outputs: obs (N, 64, 64, 3) uint8, reward float32, explicit `terminated` / `truncated`. Procgen does not
  tell a timeout from a death and never shows the last frame of an episode it ends, so the adapter applies the time
  limit itself, one step before the game's own limit (`PROCGEN_TIMEOUTS`: 1000, maze 500): an episode that reaches
  `timeout - 1` steps is reported as truncated, its true last frame goes to `info["final_obs"]` (bootstrap from
  it), and the env moves to the next level; every end Procgen reports itself is a termination;
- per-env episode return and length, and the level seed of every transition;
- `set_level(i, seed)`: puts env i on level `seed` in about 0.3 ms. The start state of each level is built once
  with a throw-away 1-env `ProcgenGym3Env(start_level=seed, num_levels=1)` and cached; switching is the C
  `set_state` call on slot i, which restores the whole game (layout, RNG, level range) and refreshes its obs.
  Stock procgen offers no per-env seeding; level-replay used a patched fork (minqi/procgen) for this.

Autoreset is SAME_STEP: when an episode ends, `step` asks `next_level(i)` for the next level (without a callback
the env stays on Procgen's own level distribution), and the returned obs[i] is that level's first frame.
`info["final_obs"][i]` holds the true last frame of an episode truncated at step i (valid where `truncated`).

Order matters inside `step` (procgen writes reward 0 / first=True into a slot on `set_state`): act, read reward and
info, then switch the finished slots, then observe again.
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np

PROCGEN_GAMES = (
    "bigfish",
    "bossfight",
    "caveflyer",
    "chaser",
    "climber",
    "coinrun",
    "dodgeball",
    "fruitbot",
    "heist",
    "jumper",
    "leaper",
    "maze",
    "miner",
    "ninja",
    "plunder",
    "starpilot",
)
PROCGEN_DISTRIBUTION_MODES = ("easy", "hard", "extreme", "memory", "exploration")
# Cobbe et al. 2020 (arXiv 1912.01588, App. C) min-max return constants: game -> {mode: (R_min, R_max)}
PROCGEN_RETURN_BOUNDS = {
    "bigfish": {"easy": (1, 40), "hard": (0, 40)},
    "bossfight": {"easy": (0.5, 13), "hard": (0.5, 13)},
    "caveflyer": {"easy": (3.5, 12), "hard": (2, 13.4)},
    "chaser": {"easy": (0.5, 13), "hard": (0.5, 14.2)},
    "climber": {"easy": (2, 12.6), "hard": (1, 12.6)},
    "coinrun": {"easy": (5, 10), "hard": (5, 10)},
    "dodgeball": {"easy": (1.5, 19), "hard": (1.5, 19)},
    "fruitbot": {"easy": (-1.5, 32.4), "hard": (-0.5, 27.2)},
    "heist": {"easy": (3.5, 10), "hard": (2, 10)},
    "jumper": {"easy": (3, 10), "hard": (1, 10)},
    "leaper": {"easy": (3, 10), "hard": (1.5, 10)},
    "maze": {"easy": (5, 10), "hard": (4, 10)},
    "miner": {"easy": (1.5, 13), "hard": (1.5, 20)},
    "ninja": {"easy": (3.5, 10), "hard": (2, 10)},
    "plunder": {"easy": (4.5, 30), "hard": (3, 30)},
    "starpilot": {"easy": (2.5, 64), "hard": (1.5, 35)},
}


def procgen_normalized_return(game: str, distribution_mode: str, ret: float) -> float | None:
    """Cobbe et al. (2020) min-max normalization (R - R_min) / (R_max - R_min); None outside Procgen easy/hard."""
    if game not in PROCGEN_RETURN_BOUNDS or distribution_mode not in ("easy", "hard"):
        return None
    r_min, r_max = PROCGEN_RETURN_BOUNDS[game][distribution_mode]
    return (ret - r_min) / (r_max - r_min)


# Each game ends an episode by itself after `timeout` steps (BasicAbstractGame: 1000; maze.cpp sets 500).
PROCGEN_TIMEOUTS = {game: 500 if game == "maze" else 1000 for game in PROCGEN_GAMES}


class ProcgenVecEnv:
    """`num_envs` Procgen games stepped together; see the module docstring for the contract.

    reset(levels=None) -> obs
    step(actions, next_level=None) -> obs, reward, terminated, truncated, info with
        info["level_seed"] (N,) level each transition was played on, info["next_level_seed"] (N,) level of obs,
        info["_episode"] (N,) bool, info["episode_return"], info["episode_length"] valid where _episode,
        info["final_obs"] (N, 64, 64, 3), valid where truncated.
    """

    def __init__(
        self,
        env_name: str,
        num_envs: int,
        *,
        distribution_mode: str = "easy",
        num_levels: int = 0,
        start_level: int = 0,
        num_threads: int = 4,
        rand_seed: int = 0,
        max_cached_levels: int = 20_000,
    ):
        if env_name not in PROCGEN_GAMES:
            raise ValueError(f"unknown Procgen game {env_name!r}: use one of {', '.join(PROCGEN_GAMES)}")
        if distribution_mode not in PROCGEN_DISTRIBUTION_MODES:
            raise ValueError(
                f"unknown Procgen distribution mode {distribution_mode!r}: use one of {', '.join(PROCGEN_DISTRIBUTION_MODES)}"
            )
        if num_envs < 1 or num_levels < 0 or start_level < 0:
            raise ValueError("num_envs must be >= 1, num_levels and start_level >= 0")
        self.env_name = env_name
        self.num_envs = num_envs
        self.timeout = PROCGEN_TIMEOUTS[env_name]
        self._num_levels = int(num_levels)
        self._start_level = int(start_level)
        self._rng = np.random.default_rng(rand_seed)
        # gym3 wants plain ints and strs.
        self._options = dict(env_name=env_name, distribution_mode=distribution_mode)
        # Hide old gym's "unmaintained" notice, printed on import.
        with contextlib.redirect_stderr(io.StringIO()):
            # Imported here, not at the top: MiniGrid runs need no procgen install.
            from procgen import ProcgenGym3Env
        # Also builds each new level's start state (`_start_state`).
        self._gym3_env = ProcgenGym3Env
        self.env = ProcgenGym3Env(
            num=num_envs,
            num_levels=int(num_levels),
            start_level=int(start_level),
            num_threads=int(num_threads),
            rand_seed=int(rand_seed),
            **self._options,
        )
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(int(self.env.ac_space.eltype.n))
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._max_cached = max_cached_levels
        self._ep_return = np.zeros(num_envs, dtype=np.float64)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        self.levels = self._read_levels()

    def _default_level(self) -> int:
        """A level of the distribution given at construction (used when we end an episode without a callback)."""
        if self._num_levels > 0:
            return int(self._rng.integers(self._start_level, self._start_level + self._num_levels))
        return int(self._rng.integers(2**31 - 1))

    def _read_levels(self) -> np.ndarray:
        return np.array([i["level_seed"] for i in self.env.get_info()], dtype=np.int64)

    def _start_state(self, seed: int) -> bytes:
        if seed in self._cache:
            self._cache.move_to_end(seed)
            return self._cache[seed]
        one = self._gym3_env(num=1, start_level=seed, num_levels=1, num_threads=0, **self._options)
        state = one.get_state()[0]
        one.close()
        self._cache[seed] = state
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return state

    def _set_state(self, env_index: int, seed: int) -> None:
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"level seeds are non-negative ints, got {seed}")
        state = self._start_state(seed)
        self.env.call_c_func("set_state", int(env_index), state, len(state))
        self.levels[env_index] = seed

    def set_level(self, env_index: int, seed: int) -> np.ndarray:
        """Start a new episode of env `env_index` on level `seed` now; returns its first frame."""
        self._set_state(env_index, seed)
        self._ep_return[env_index] = 0.0
        self._ep_length[env_index] = 0
        return self.env.observe()[1]["rgb"][env_index]

    def reset(self, levels: Sequence[int] | None = None) -> np.ndarray:
        """Start new episodes everywhere: env i on `levels[i]`, or on Procgen's own distribution when None."""
        if levels is not None:
            if len(levels) != self.num_envs:
                raise ValueError(f"reset needs {self.num_envs} levels, got {len(levels)}")
            for i, seed in enumerate(levels):
                self._set_state(i, seed)
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        return self.env.observe()[1]["rgb"]

    def step(self, actions, next_level: Callable[[int], int] | None = None):
        self.env.act(np.asarray(actions, dtype=np.int32))
        # gym3 returns copies; read them before any set_state.
        reward, obs, first = self.env.observe()
        reward = reward.astype(np.float32)
        # Every end Procgen reports itself is a termination (our time limit comes one step earlier).
        terminated = first.astype(bool)
        self._ep_return += reward
        self._ep_length += 1
        truncated = ~terminated & (self._ep_length >= self.timeout - 1)
        done = terminated | truncated
        info = {
            "level_seed": self.levels.copy(),
            "_episode": done.copy(),
            "episode_return": np.where(done, self._ep_return, 0.0),
            "episode_length": np.where(done, self._ep_length, 0),
            # gym3 returned a copy: still the true last frame of truncated episodes.
            "final_obs": obs["rgb"],
        }
        done_idx = np.flatnonzero(done)
        if len(done_idx):
            if next_level is not None:
                for i in done_idx:
                    self._set_state(int(i), next_level(int(i)))
            else:
                # Terminated envs are already on a level of Procgen's own distribution; truncated ones get one.
                self.levels[done_idx] = self._read_levels()[done_idx]
                for i in np.flatnonzero(truncated):
                    self._set_state(int(i), self._default_level())
            if next_level is not None or truncated.any():
                obs = self.env.observe()[1]
            self._ep_return[done_idx] = 0.0
            self._ep_length[done_idx] = 0
        info["next_level_seed"] = self.levels.copy()
        return obs["rgb"], reward, terminated, truncated, info

    def close(self) -> None:
        getattr(self.env, "close", lambda: None)()

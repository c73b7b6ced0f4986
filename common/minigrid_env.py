"""MiniGrid environments for PLR and for CLEAR's CPU task sequences.

What this module gives:
- `make_minigrid_env(env_id, fully_observable=True)`: a gymnasium env with uint8 image observations (H, W, 3)
  (the whole grid with `fully_observable=True`, by `FullGridObsWrapper`; the agent's 7x7 egocentric view otherwise)
  and the 7 MiniGrid actions. Any registered MiniGrid id works (with or without the `MiniGrid-` prefix), plus three
  named environments from the PLR paper (Jiang et al. 2021, Sec. 5.2 and App. B.2):
  * `MultiRoom-N4-Random`: 1 to 4 rooms of size <= 5 in a 14x14 frame, 80 steps (level-replay's fork).
  * `ObstructedMazeGamut-Easy` / `-Medium`: 3 / 6 ObstructedMaze variants in a fixed 19x19 frame (3x3 rooms of
    size 7); the variant of level `s` is `s % k`.
- `MiniGridVecEnv`: a vector env whose members live in worker processes (one per available core by default) and
  start every new episode on a level (reset seed) chosen by the caller: the same interface as
  `common.procgen_env.ProcgenVecEnv`.
- `MiniGrid-DistShiftStraight-7x5-v0` / `MiniGrid-DistShiftDetour-7x5-v0`: two registered layouts whose routes
  conflict (each walks into the other's lava), for forgetting experiments with clear_impala.py;
  `MiniGrid-DistShiftStraightYellow-7x5-v0` / `MiniGrid-DistShiftDetourBlue-7x5-v0` are the same layouts on a
  yellow / blue floor, so that every view tells the tasks apart.
- `level_difficulty(env_id, seed)`: the difficulty label of a level (room count, maze variant) for curriculum plots.

A level is a reset seed: `env.reset(seed=s)` is deterministic in MiniGrid.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence

import gymnasium as gym
import minigrid  # noqa: F401  (the import registers the MiniGrid-* ids)
import numpy as np
from minigrid.core.constants import COLOR_NAMES, COLOR_TO_IDX, OBJECT_TO_IDX
from minigrid.core.mission import MissionSpace
from minigrid.core.roomgrid import RoomGrid
from minigrid.core.world_object import Floor
from minigrid.envs.distshift import DistShiftEnv
from minigrid.envs.multiroom import MultiRoomEnv
from minigrid.envs.obstructedmaze import ObstructedMaze_1Dlhb, ObstructedMaze_Full, ObstructedMazeEnv
from minigrid.wrappers import FullyObsWrapper, ImgObsWrapper

from common.processes import (
    available_cores,
    check_stop,
    died_or_interrupted,
    exit_now,
    ignore_terminal_signals,
    start_child,
    stop_when_run_ends,
)

MINIGRID_NAMED_ENVS = ("MultiRoom-N4-Random", "ObstructedMazeGamut-Easy", "ObstructedMazeGamut-Medium")


# Two small DistShift layouts whose routes conflict, for showing forgetting on a CPU (clear_impala.py task sequences):
# 7x5 grid, agent at (1, 2) facing right, goal at (5, 1). "Straight" has lava at (3, 1) and (3, 3) (the route is
# straight along row 2); "Detour" has lava at (3, 1) and (3, 2) (the route goes down to row 3). Each task's route
# walks into the other's lava, and the two start views differ in one cell.
# `MiniGrid-DistShiftStraightYellow-7x5-v0` / `MiniGrid-DistShiftDetourBlue-7x5-v0` are the same layouts with every
# free cell of the room covered by a yellow / blue floor tile (walkable, no effect on reward): the same conflicting
# routes, but every view tells the tasks apart (also from Empty-5x5's black floor), as the paper's DMLab tasks do.
class _DistShiftFloorEnv(DistShiftEnv):
    """DistShiftEnv whose free room cells are `Floor(floor_color)` tiles (a whole-room context cue)."""

    def __init__(self, floor_color: str, **kwargs):
        self.floor_color = floor_color
        super().__init__(**kwargs)

    def _gen_grid(self, width, height):
        super()._gen_grid(width, height)
        for x in range(1, width - 1):
            for y in range(1, height - 1):
                if self.grid.get(x, y) is None:
                    self.grid.set(x, y, Floor(self.floor_color))


_DISTSHIFT = "minigrid.envs.distshift:DistShiftEnv"
for _name, _lava_row, _entry, _extra in (
    ("MiniGrid-DistShiftStraight-7x5-v0", 3, _DISTSHIFT, {}),
    ("MiniGrid-DistShiftDetour-7x5-v0", 2, _DISTSHIFT, {}),
    ("MiniGrid-DistShiftStraightYellow-7x5-v0", 3, _DistShiftFloorEnv, {"floor_color": "yellow"}),
    ("MiniGrid-DistShiftDetourBlue-7x5-v0", 2, _DistShiftFloorEnv, {"floor_color": "blue"}),
):
    if _name not in gym.registry:
        gym.register(
            id=_name,
            entry_point=_entry,
            kwargs={"width": 7, "height": 5, "strip2_row": _lava_row, "agent_start_pos": (1, 2), **_extra},
        )


# --------------------------------------------------------------------------------------------------------------
# The paper's named environments
# --------------------------------------------------------------------------------------------------------------
class _FixedFrameObstructedMaze(ObstructedMazeEnv):
    """ObstructedMaze drawn in a fixed 19x19 frame (3x3 rooms of size 7), as level-replay's `fixed_grid` variants,
    so that every variant of the gamut has the same observation shape. Only `num_rows x num_cols` rooms are used."""

    def __init__(self, num_rows, num_cols, num_rooms_visited, max_steps=None, **kwargs):
        room_size = 7
        max_steps = max_steps or 4 * num_rooms_visited * room_size**2
        mission_space = MissionSpace(mission_func=self._gen_mission, ordered_placeholders=[[COLOR_NAMES[0]]])
        RoomGrid.__init__(
            self, mission_space=mission_space, room_size=room_size, num_rows=3, num_cols=3, max_steps=max_steps, **kwargs
        )
        # the rooms that the variant actually generates
        self.num_rows = num_rows
        self.num_cols = num_cols


class _Fixed1Dlhb(ObstructedMaze_1Dlhb, _FixedFrameObstructedMaze):
    pass


class _FixedFull(ObstructedMaze_Full, _FixedFrameObstructedMaze):
    pass


def _gamut_variants(difficulty: str) -> list[tuple[str, type, dict]]:
    """(name, class, kwargs) per variant; each name's kwargs are those minigrid registers for
    MiniGrid-ObstructedMaze-<name>-v0 (the authors' custom_envs/obstructedmaze_gamut.py), on the fixed 19x19 frame."""
    full = dict(agent_room=(2, 1), num_quarters=1, num_rooms_visited=4)
    variants = [
        ("1Dl", _Fixed1Dlhb, dict(key_in_box=False, blocked=False)),
        ("1Dlh", _Fixed1Dlhb, dict(key_in_box=True, blocked=False)),
        ("1Dlhb", _Fixed1Dlhb, dict(key_in_box=True, blocked=True)),
        ("2Dl", _FixedFull, dict(full, key_in_box=False, blocked=False)),
        ("2Dlh", _FixedFull, dict(full, key_in_box=True, blocked=False)),
        ("2Dlhb", _FixedFull, dict(full, key_in_box=True, blocked=True)),
    ]
    return variants[:3] if difficulty == "Easy" else variants


class ObstructedMazeGamut(gym.Env):
    """A gamut of ObstructedMaze variants of rising difficulty; level `seed` plays variant `seed % k` (k = 3 for
    Easy, 6 for Medium) generated from `seed`."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, difficulty: str = "Easy", render_mode: str | None = None):
        variants = _gamut_variants(difficulty)
        self.variant_names = [name for name, _, _ in variants]
        self.variants = [cls(**kwargs) for _, cls, kwargs in variants]
        for v in self.variants:
            v.render_mode = render_mode
        self.render_mode = render_mode
        self.observation_space = self.variants[0].observation_space
        self.action_space = self.variants[0].action_space
        self.current = self.variants[0]
        self._rng = np.random.default_rng()

    # FullyObsWrapper reads grid, agent_pos, ... of the variant being played
    def __getattr__(self, name):
        if name in ("variants", "current", "_rng"):
            raise AttributeError(name)
        return getattr(self.current, name)

    def reset(self, *, seed=None, options=None):
        if seed is None:
            seed = int(self._rng.integers(2**31 - 1))
        self.current = self.variants[seed % len(self.variants)]
        return self.current.reset(seed=seed, options=options)

    def step(self, action):
        return self.current.step(action)

    def render(self):
        return self.current.render()


def _direction_and_mission(env) -> dict:
    """MiniGridEnv.gen_obs without the image: the direction and mission entries of its observation dict."""
    return {"direction": env.agent_dir, "mission": env.mission}


class FullGridObsWrapper(FullyObsWrapper):
    """minigrid's FullyObsWrapper (the whole grid as (W, H, 3) cell encodings, the agent drawn in), made cheaper.

    A MiniGrid env builds the agent's 7x7 egocentric view on every step and reset (`gen_obs_grid`: slice, rotate,
    occlusion, then encode), over half of a step's time, and FullyObsWrapper throws that image away. Here each base
    env's `gen_obs` returns only the direction and mission, and the whole grid is encoded in one pass over its cells.
    The observations are the same arrays; `render()` still highlights the agent's view (it builds the view itself).
    """

    def __init__(self, env):
        super().__init__(env)
        if isinstance(env.unwrapped, ObstructedMazeGamut):
            base_envs = env.unwrapped.variants
        else:
            base_envs = [env.unwrapped]
        for base in base_envs:
            base.gen_obs = functools.partial(_direction_and_mission, base)

    def observation(self, obs):
        env = self.unwrapped
        # Grid.encode: "empty" for a free cell, else the object's (type, colour, state); cells are stored row by row
        empty = (OBJECT_TO_IDX["empty"], 0, 0)
        cells = [empty if cell is None else cell.encode() for cell in env.grid.grid]
        full_grid = np.array(cells, dtype=np.uint8).reshape(env.height, env.width, 3).transpose(1, 0, 2).copy()
        full_grid[env.agent_pos[0], env.agent_pos[1]] = (OBJECT_TO_IDX["agent"], COLOR_TO_IDX["red"], env.agent_dir)
        return {**obs, "image": full_grid}


def _make_named(env_id: str, render_mode: str | None) -> gym.Env:
    if env_id == "MultiRoom-N4-Random":
        return MultiRoomEnv(minNumRooms=1, maxNumRooms=4, maxRoomSize=5, width=14, height=14, render_mode=render_mode)
    return ObstructedMazeGamut(env_id.split("-")[1], render_mode=render_mode)


def _registered_minigrid_ids() -> list[str]:
    return sorted(k for k in gym.registry if k.startswith("MiniGrid-"))


def resolve_minigrid_id(env_id: str) -> str:
    """Return the canonical id (`MultiRoom-N4-Random` or `MiniGrid-...`) or raise a one-line ValueError."""
    if env_id in MINIGRID_NAMED_ENVS:
        return env_id
    for candidate in (env_id, f"MiniGrid-{env_id}"):
        if candidate in gym.registry and candidate.startswith("MiniGrid-"):
            return candidate
    raise ValueError(
        f"unknown MiniGrid env id {env_id!r}: use one of {', '.join(MINIGRID_NAMED_ENVS)} "
        f"or a registered MiniGrid id such as MiniGrid-DoorKey-5x5-v0 ({len(_registered_minigrid_ids())} registered)"
    )


def make_minigrid_env(
    env_id: str, *, fully_observable: bool = True, max_steps: int | None = None, render_mode: str | None = None
) -> gym.Env:
    """A MiniGrid env with uint8 image observations (H, W, 3) and Discrete(7) actions.

    fully_observable: the whole grid (FullyObsWrapper, as in PLR) or the 7x7 egocentric view (as in CLEAR's CPU
    sequences). `max_steps` overrides the episode limit (the env then reports `truncated`)."""
    env_id = resolve_minigrid_id(env_id)
    if env_id in MINIGRID_NAMED_ENVS:
        env = _make_named(env_id, render_mode)
        if max_steps is not None:
            for inner in getattr(env, "variants", [env]):
                inner.max_steps = max_steps
    else:
        kwargs = {"max_steps": max_steps} if max_steps is not None else {}
        env = gym.make(env_id, render_mode=render_mode, disable_env_checker=True, **kwargs)
    if fully_observable:
        env = FullGridObsWrapper(env)
    return ImgObsWrapper(env)


def level_difficulty(env_id: str, seed: int) -> str:
    """A label for how hard level `seed` is: `rooms=<n>` for MultiRoom envs, the maze variant for the gamut,
    `all` otherwise. Used for the PLR paper's Figure 4 (replay probability mass per difficulty)."""
    env_id = resolve_minigrid_id(env_id)
    if env_id.startswith("ObstructedMazeGamut"):
        names = [name for name, _, _ in _gamut_variants(env_id.split("-")[1])]
        return names[seed % len(names)]
    if "MultiRoom" in env_id:
        env = make_minigrid_env(env_id, fully_observable=False)
        env.reset(seed=int(seed))
        n = len(env.unwrapped.rooms)
        env.close()
        return f"rooms={n}"
    return "all"


# --------------------------------------------------------------------------------------------------------------
# Vector env with caller-chosen levels, envs in worker processes
# --------------------------------------------------------------------------------------------------------------
def _worker(conn, env_id: str, num_envs: int, fully_observable: bool, max_steps: int | None) -> None:
    """Worker process: holds `num_envs` envs, steps them without autoreset, resets the ones it is told to."""
    # the parent handles Ctrl-C and closes us (it started us with SIGINT blocked: ignored from our first instant)
    ignore_terminal_signals()
    envs = [make_minigrid_env(env_id, fully_observable=fully_observable, max_steps=max_steps) for _ in range(num_envs)]
    try:
        while True:
            cmd, data = conn.recv()
            if cmd == "step":
                out = [env.step(int(a)) for env, a in zip(envs, data)]
                obs = np.stack([o[0] for o in out])
                rew = np.array([o[1] for o in out], dtype=np.float32)
                term = np.array([o[2] for o in out], dtype=bool)
                trunc = np.array([o[3] for o in out], dtype=bool)
                conn.send((obs, rew, term, trunc))
            elif cmd == "reset":
                # data: a list of (local index, seed)
                conn.send([envs[i].reset(seed=int(s))[0] for i, s in data])
            elif cmd == "close":
                break
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        for env in envs:
            env.close()
        conn.close()
    # without the interpreter's teardown (a second or more with torch loaded): the parent is waiting for us
    exit_now(0)


class MiniGridVecEnv:
    """`num_envs` MiniGrid envs split over `num_workers` processes; every episode starts on a caller-chosen level.

    Same interface as `ProcgenVecEnv`:
      reset(levels) -> obs (N, H, W, 3) uint8
      step(actions, next_level=None) -> obs, reward, terminated, truncated, info
    Autoreset is SAME_STEP: for each env whose episode ended, `next_level(i)` picks the next level (a random seed
    when no callback is given) and `obs[i]` is that level's first observation; the true last observation of the
    finished episode is in `info["final_obs"][i]` (bootstrap from it on truncation).
    `info["level_seed"][i]` is the level the transition was played on, `info["next_level_seed"][i]` the level of
    `obs[i]`, and `info["episode_return"]`, `info["episode_length"]` hold finished episodes where `info["_episode"]`.
    """

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        *,
        num_workers: int | None = None,
        fully_observable: bool = True,
        max_steps: int | None = None,
        seed: int = 0,
        start_method: str = "spawn",
    ):
        env_id = resolve_minigrid_id(env_id)
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        num_workers = min(num_envs, num_workers or available_cores())
        probe = make_minigrid_env(env_id, fully_observable=fully_observable, max_steps=max_steps)
        self.single_observation_space = probe.observation_space
        self.single_action_space = probe.action_space
        probe.close()
        self.env_id = env_id
        self.num_envs = num_envs
        self.num_workers = num_workers
        self._rng = np.random.default_rng(seed)
        self._splits = np.array_split(np.arange(num_envs), num_workers)
        ctx = mp.get_context(start_method)
        self._conns = []
        self._procs = []
        # whether each worker has answered once (its imports are done)
        self._answered = [False] * num_workers
        self.closed = False
        stop_when_run_ends(self.close)
        for idx in self._splits:
            # a stop requested meanwhile: start nothing more
            check_stop()
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, env_id, len(idx), fully_observable, max_steps), daemon=True)
            start_child(p)
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._owner = [(w, j) for w, idx in enumerate(self._splits) for j in range(len(idx))]
        self.levels = np.zeros(num_envs, dtype=np.int64)
        self._ep_return = np.zeros(num_envs, dtype=np.float64)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        self._obs = np.zeros((num_envs, *self.single_observation_space.shape), dtype=np.uint8)

    def _random_level(self) -> int:
        return int(self._rng.integers(2**31 - 1))

    def _worker_died(self, w: int) -> BaseException:
        """ActorDied naming the worker, or `Interrupted` where the run's own stop signal ended it."""
        self._procs[w].join(timeout=1.0)
        exitcode = self._procs[w].exitcode
        return died_or_interrupted(f"MiniGrid worker {w} died (exit code {exitcode})", exitcode)

    def _send(self, w: int, message) -> None:
        try:
            self._conns[w].send(message)
        except OSError:
            # BrokenPipeError, ConnectionResetError: the worker is gone
            raise self._worker_died(w) from None

    def _recv(self, w: int):
        """The worker's answer; while waiting (a worker still importing takes seconds), a stop signal raises
        `Interrupted` and a worker that died raises at once."""
        conn = self._conns[w]
        try:
            check_stop()
            while not conn.poll(0.05):
                check_stop()
                if not self._procs[w].is_alive():
                    raise EOFError
            answer = conn.recv()
        except (EOFError, OSError):
            raise self._worker_died(w) from None
        self._answered[w] = True
        return answer

    def _reset_envs(self, env_indices: Sequence[int], seeds: Sequence[int]) -> None:
        per_worker: dict[int, list] = {}
        for i, s in zip(env_indices, seeds):
            w, j = self._owner[i]
            per_worker.setdefault(w, []).append((j, int(s)))
            self.levels[i] = int(s)
        for w, items in per_worker.items():
            self._send(w, ("reset", items))
        for w, items in per_worker.items():
            for (j, _), ob in zip(items, self._recv(w)):
                self._obs[self._splits[w][j]] = ob

    def set_level(self, env_index: int, seed: int) -> np.ndarray:
        """Put env `env_index` on level `seed` now (starts a new episode there); returns its first observation."""
        self._reset_envs([env_index], [seed])
        self._ep_return[env_index] = 0.0
        self._ep_length[env_index] = 0
        return self._obs[env_index].copy()

    def reset(self, levels: Sequence[int] | None = None) -> np.ndarray:
        if levels is None:
            levels = [self._random_level() for _ in range(self.num_envs)]
        if len(levels) != self.num_envs:
            raise ValueError(f"reset needs {self.num_envs} levels, got {len(levels)}")
        self._reset_envs(range(self.num_envs), levels)
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        return self._obs.copy()

    def step(self, actions, next_level: Callable[[int], int] | None = None):
        actions = np.asarray(actions)
        for w, idx in enumerate(self._splits):
            self._send(w, ("step", actions[idx]))
        reward = np.empty(self.num_envs, dtype=np.float32)
        terminated = np.empty(self.num_envs, dtype=bool)
        truncated = np.empty(self.num_envs, dtype=bool)
        for w, idx in enumerate(self._splits):
            self._obs[idx], reward[idx], terminated[idx], truncated[idx] = self._recv(w)
        self._ep_return += reward
        self._ep_length += 1
        done = terminated | truncated
        info = {
            "level_seed": self.levels.copy(),
            "_episode": done.copy(),
            "episode_return": np.where(done, self._ep_return, 0.0),
            "episode_length": np.where(done, self._ep_length, 0),
            "final_obs": self._obs.copy(),
        }
        done_idx = np.flatnonzero(done)
        if len(done_idx):
            seeds = [next_level(int(i)) if next_level is not None else self._random_level() for i in done_idx]
            self._reset_envs(done_idx, seeds)
            self._ep_return[done_idx] = 0.0
            self._ep_length[done_idx] = 0
        info["next_level_seed"] = self.levels.copy()
        return self._obs.copy(), reward, terminated, truncated, info

    def close(self, timeout: float = 2.0) -> None:
        """Close the workers: a worker that never answered (still importing) is terminated at once; the others get
        "close" and `timeout` s in all, then are terminated. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for conn, proc, answered in zip(self._conns, self._procs, self._answered):
            if not answered:
                proc.terminate()
                continue
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=1.0)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

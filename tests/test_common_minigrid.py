"""common/minigrid_env.py: named envs and their sizes, seeded determinism, the vector env's level plumbing."""

import os
import signal

import gymnasium as gym
import numpy as np
import pytest
from minigrid.wrappers import FullyObsWrapper, ImgObsWrapper

from common.minigrid_env import MINIGRID_NAMED_ENVS, MiniGridVecEnv, level_difficulty, make_minigrid_env


@pytest.mark.parametrize(
    "env_id, shape, max_steps",
    [
        ("MultiRoom-N4-Random", (14, 14, 3), 80),
        ("ObstructedMazeGamut-Easy", (19, 19, 3), None),
        ("ObstructedMazeGamut-Medium", (19, 19, 3), None),
        ("MiniGrid-DoorKey-5x5-v0", (5, 5, 3), 250),
    ],
)
def test_named_env_sizes(env_id, shape, max_steps):
    env = make_minigrid_env(env_id)
    assert env.observation_space.shape == shape and env.action_space.n == 7
    for seed in range(8):  # every gamut variant keeps the fixed frame
        obs, _ = env.reset(seed=seed)
        assert obs.shape == shape and obs.dtype == np.uint8
    if max_steps is not None:
        assert env.unwrapped.max_steps == max_steps


def test_gamut_variant_by_seed_and_max_steps():
    env = make_minigrid_env("ObstructedMazeGamut-Medium")
    gamut = env.unwrapped
    assert len(gamut.variants) == 6
    for seed in range(12):
        env.reset(seed=seed)
        assert gamut.current is gamut.variants[seed % 6]
    assert [v.max_steps for v in gamut.variants] == [392, 392, 392, 784, 784, 784]  # 4 * rooms visited * 7^2
    assert [level_difficulty("ObstructedMazeGamut-Easy", s) for s in range(4)] == ["1Dl", "1Dlh", "1Dlhb", "1Dl"]
    names = ["1Dl", "1Dlh", "1Dlhb", "2Dl", "2Dlh", "2Dlhb"]
    assert [level_difficulty("ObstructedMazeGamut-Medium", s) for s in range(6)] == names
    for name, variant in zip(names, gamut.variants):  # each label is built as minigrid registers that name
        registered = gym.make(f"MiniGrid-ObstructedMaze-{name}-v0").unwrapped
        for attr in ("key_in_box", "blocked", "agent_room", "num_quarters"):
            assert getattr(variant, attr, None) == getattr(registered, attr, None), (name, attr)
        assert isinstance(variant, type(registered)), name


def test_multiroom_has_one_to_four_rooms():
    counts = {level_difficulty("MultiRoom-N4-Random", s) for s in range(60)}
    assert counts == {"rooms=1", "rooms=2", "rooms=3", "rooms=4"}


@pytest.mark.parametrize("env_id", MINIGRID_NAMED_ENVS + ("DoorKey-5x5-v0",))
def test_seeded_reset_is_deterministic(env_id):
    env = make_minigrid_env(env_id)
    a, _ = env.reset(seed=7)
    env.reset(seed=8)
    b, _ = env.reset(seed=7)
    assert np.array_equal(a, b)
    differs = [not np.array_equal(a, env.reset(seed=s)[0]) for s in range(20, 30)]
    assert any(differs), "different seeds give different levels"
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 7, 30)
    traj = []
    for _ in range(2):
        env.reset(seed=7)
        traj.append([env.step(int(x))[0] for x in actions])
    assert all(np.array_equal(x, y) for x, y in zip(*traj))


def reference_full_grid_env(env_id, render_mode=None):
    """The same env with minigrid's own FullyObsWrapper, which builds the agent's 7x7 view on every step."""
    partial_view_env = make_minigrid_env(env_id, fully_observable=False, render_mode=render_mode)
    return ImgObsWrapper(FullyObsWrapper(partial_view_env.env))


@pytest.mark.parametrize("env_id", MINIGRID_NAMED_ENVS + ("MiniGrid-DoorKey-5x5-v0", "MiniGrid-KeyCorridorS3R3-v0"))
def test_full_grid_rollout_is_identical_to_minigrids_fully_obs_wrapper(env_id):
    """make_minigrid_env skips the egocentric view that FullyObsWrapper throws away: a fixed-seed random rollout gives
    bit-identical observations, rewards, terminations and truncations, and the same rendered frames (--capture-video)."""
    env = make_minigrid_env(env_id, render_mode="rgb_array")
    reference = reference_full_grid_env(env_id, render_mode="rgb_array")
    assert env.observation_space == reference.observation_space
    rng = np.random.default_rng(0)
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        reference_obs, _ = reference.reset(seed=seed)
        assert obs.dtype == reference_obs.dtype and np.array_equal(obs, reference_obs)
        for t in range(120):
            action = int(rng.integers(7))
            obs, reward, terminated, truncated, _ = env.step(action)
            reference_obs, reference_reward, reference_terminated, reference_truncated, _ = reference.step(action)
            assert obs.dtype == reference_obs.dtype and np.array_equal(obs, reference_obs), (seed, t)
            assert (reward, terminated, truncated) == (reference_reward, reference_terminated, reference_truncated)
            if t % 60 == 0:
                assert np.array_equal(env.render(), reference.render())
            if terminated or truncated:
                break


def test_partial_view_is_7x7():
    env = make_minigrid_env("MiniGrid-DoorKey-5x5-v0", fully_observable=False)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (7, 7, 3) and obs.dtype == np.uint8


def test_unknown_id_fails_clearly():
    with pytest.raises(ValueError, match="unknown MiniGrid env id"):
        make_minigrid_env("MultiRoom-N99")


def test_vector_env_level_plumbing_and_final_obs():
    envs = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 4, num_workers=2, max_steps=6)
    try:
        obs = envs.reset([10, 11, 12, 13])
        single = make_minigrid_env("MiniGrid-Empty-5x5-v0", max_steps=6)
        assert np.array_equal(obs[2], single.reset(seed=12)[0])
        chosen = iter(range(100, 200))
        picked = {}

        def next_level(i):
            picked[i] = next(chosen)
            return picked[i]

        actions = np.full(4, 2)  # forward: in Empty-5x5 the goal is not reached within 6 steps by going forward only
        for t in range(6):
            obs, reward, terminated, truncated, info = envs.step(actions, next_level=next_level)
        assert truncated.all() and not terminated.any(), "the 6-step limit is a truncation"
        np.testing.assert_array_equal(info["level_seed"], [10, 11, 12, 13])
        np.testing.assert_array_equal(info["next_level_seed"], [picked[i] for i in range(4)])
        np.testing.assert_array_equal(info["episode_length"], [6, 6, 6, 6])
        for i in range(4):
            assert np.array_equal(obs[i], single.reset(seed=picked[i])[0]), "obs is the chosen level's first obs"
        # the final obs is the true last observation of the finished episode
        single.reset(seed=12)
        for _ in range(6):
            last = single.step(2)[0]
        assert np.array_equal(info["final_obs"][2], last)
    finally:
        envs.close()


def test_dead_worker_is_reported_in_one_line():
    envs = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=2)
    try:
        envs.reset([0, 1])
        envs._procs[1].kill()
        envs._procs[1].join(timeout=5)
        with pytest.raises(RuntimeError, match=r"MiniGrid worker 1 died \(exit code -9\)"):
            for _ in range(3):
                envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_a_ctrl_c_while_the_workers_start_does_not_kill_them():
    """Contract: a worker ignores SIGINT and SIGHUP from its first instant (started with them blocked, ignored by its
    first statement): a Ctrl-C reaching it while it still imports, or later, leaves it alive and the vector env
    working (it used to die, "MiniGrid worker 0 died (exit code -2)")."""
    envs = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=2)
    try:
        for proc in envs._procs:  # at once: the spawned workers are still starting their interpreter
            os.kill(proc.pid, signal.SIGINT)
            os.kill(proc.pid, signal.SIGHUP)
        envs.reset([0, 1])
        for proc in envs._procs:
            os.kill(proc.pid, signal.SIGINT)
        envs.step(np.zeros(2, dtype=np.int64))
        assert all(proc.is_alive() for proc in envs._procs)
    finally:
        envs.close()


def test_after_a_stop_signal_a_wait_or_a_dead_worker_is_the_interruption(monkeypatch):
    """Contract: once the run received a stop signal, waiting for a worker (one still importing takes seconds: the
    first evaluation's start) raises the interruption at once, and close() terminates a worker that never answered
    instead of waiting for it; a worker found dead then (as the run's own Ctrl-C kills one) is the interruption too,
    not "MiniGrid worker died"."""
    from common import processes

    envs = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=2)
    monkeypatch.setattr(processes, "_received_signals", [signal.SIGINT])
    with pytest.raises(processes.Interrupted):
        envs.reset([0, 1])
    envs.close()
    assert [proc.exitcode for proc in envs._procs] == [-signal.SIGTERM] * 2
    monkeypatch.setattr(processes, "_received_signals", [])
    envs = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=2)
    try:
        envs.reset([0, 1])
        envs._procs[0].kill()
        envs._procs[0].join(timeout=5)
        monkeypatch.setattr(processes, "_received_signals", [signal.SIGTERM])
        with pytest.raises(processes.Interrupted, match="SIGTERM"):
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_distshift_pair_routes_conflict():
    """Straight's route (forward along row 2) reaches its goal region safely but walks into Detour's lava."""
    straight = make_minigrid_env("MiniGrid-DistShiftStraight-7x5-v0", fully_observable=False)
    detour = make_minigrid_env("MiniGrid-DistShiftDetour-7x5-v0", fully_observable=False)
    s_obs, _ = straight.reset(seed=0)
    d_obs, _ = detour.reset(seed=0)
    assert s_obs.shape == (7, 7, 3) and not np.array_equal(s_obs, d_obs)
    _, reward, terminated, _, _ = detour.step(2)  # forward from (1,2) to (2,2)
    assert not terminated
    _, reward, terminated, _, _ = detour.step(2)  # forward into (3,2): lava in Detour
    assert terminated and reward == 0
    straight.step(2)
    _, _, terminated, _, _ = straight.step(2)  # (3,2) is free in Straight
    assert not terminated


@pytest.mark.parametrize(
    "plain_id, floor_id, color, routes",
    [
        (
            "MiniGrid-DistShiftDetour-7x5-v0",
            "MiniGrid-DistShiftDetourBlue-7x5-v0",
            "blue",
            (([2, 2], "lava"), ([1, 2, 0, 2, 2, 2, 2, 0, 2, 2], "goal")),
        ),
        (
            "MiniGrid-DistShiftStraight-7x5-v0",
            "MiniGrid-DistShiftStraightYellow-7x5-v0",
            "yellow",
            (([1, 2, 0, 2, 2], "lava"), ([2, 2, 2, 2, 0, 2], "goal")),
        ),
    ],
)
def test_distshift_floor_variant_differs_only_in_the_view(plain_id, floor_id, color, routes):
    """The floor variant has the plain layout's lava and goal, every free room cell is a floor of its colour, and the
    floor changes nothing but the view: the same action sequences end the same way (lava or goal) in both."""
    from minigrid.core.constants import COLOR_TO_IDX, OBJECT_TO_IDX

    plain = make_minigrid_env(plain_id, fully_observable=False)
    floor = make_minigrid_env(floor_id, fully_observable=False)
    plain_obs, _ = plain.reset(seed=0)
    floor_obs, _ = floor.reset(seed=0)
    for x in range(7):
        for y in range(5):
            plain_cell = plain.unwrapped.grid.get(x, y)
            floor_cell = floor.unwrapped.grid.get(x, y)
            if plain_cell is None:  # a free cell of the plain layout is a floor tile of the variant's colour
                assert floor_cell is not None and (floor_cell.type, floor_cell.color) == ("floor", color)
            else:  # walls, lava and goal are where they were
                assert floor_cell.type == plain_cell.type
    is_floor_tile = (floor_obs[..., 0] == OBJECT_TO_IDX["floor"]) & (floor_obs[..., 1] == COLOR_TO_IDX[color])
    assert is_floor_tile.any() and not np.array_equal(plain_obs, floor_obs)
    for actions, ends_in in routes:
        plain.reset(seed=0)
        floor.reset(seed=0)
        for a in actions:
            plain_step = plain.step(a)
            floor_step = floor.step(a)
            assert plain_step[1:4] == floor_step[1:4]
        assert plain_step[2] and (plain_step[1] > 0) == (ends_in == "goal")

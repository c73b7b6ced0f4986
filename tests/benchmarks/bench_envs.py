"""Env-only throughput of the common/ adapters (random actions), the baseline each script's SPS is compared with.

    python tests/benchmarks/bench_envs.py [--seconds 3]

Prints a markdown table: adapter, configuration, environment steps per second. Also a quick demonstration that
every adapter installs and runs.
"""

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from common.atari_env import make_atari_env  # noqa: E402
from common.minatar_env import MINATAR_GAMES, make_minatar_env  # noqa: E402
from common.minigrid_env import MiniGridVecEnv, make_minigrid_env  # noqa: E402
from common.mujoco_env import make_mujoco_env  # noqa: E402
from common.procgen_env import ProcgenVecEnv  # noqa: E402


def single_env_sps(env, seconds):
    env.reset(seed=0)
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - start)


def vec_env_sps(envs, seconds, next_level=None, levels=None):
    envs.reset(levels)
    rng = np.random.default_rng(0)
    n = envs.single_action_space.n
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(rng.integers(0, n, envs.num_envs), next_level=next_level)
        steps += envs.num_envs
    return steps / (time.perf_counter() - start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    s = parser.parse_args().seconds
    rng = np.random.default_rng(0)
    rows = [
        ("Atari", "ALE/Pong-v5, 84x84 gray, skip 4, stack 4", single_env_sps(make_atari_env("ALE/Pong-v5", 0), s)),
        ("Atari", "ALE/Pong-v5, stack 1 (recurrent)", single_env_sps(make_atari_env("ALE/Pong-v5", 0, frame_stack=1), s)),
        ("Procgen", "bigfish easy, 64 envs, Procgen's levels", vec_env_sps(ProcgenVecEnv("bigfish", 64), s)),
        (
            "Procgen",
            "bigfish easy, 64 envs, set_level at every episode end (200 levels)",
            vec_env_sps(ProcgenVecEnv("bigfish", 64), s, lambda i: int(rng.integers(200)), list(range(64))),
        ),
        *[
            (
                "MinAtar",
                f"{g}-v0, single env, 6 actions, sticky 0.1",
                single_env_sps(make_minatar_env(f"MinAtar/{g}-v0", 0), s),
            )
            for g in MINATAR_GAMES
        ],
        (
            "MiniGrid",
            "MultiRoom-N4-Random, full view, single env",
            single_env_sps(make_minigrid_env("MultiRoom-N4-Random"), s),
        ),
        (
            "MiniGrid",
            "MultiRoom-N4-Random, full view, 16 envs in 2 workers",
            vec_env_sps(
                MiniGridVecEnv("MultiRoom-N4-Random", 16, num_workers=2), s, lambda i: int(rng.integers(4000)), list(range(16))
            ),
        ),
        (
            "MiniGrid",
            "DoorKey-8x8, 7x7 view, single env",
            single_env_sps(make_minigrid_env("MiniGrid-DoorKey-8x8-v0", fully_observable=False), s),
        ),
        ("MuJoCo", "HalfCheetah-v5, single env", single_env_sps(make_mujoco_env("HalfCheetah-v5", 0), s)),
        ("MuJoCo", "Hopper-v5, single env", single_env_sps(make_mujoco_env("Hopper-v5", 0), s)),
    ]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; {s:.0f} s each\n")
    print("| adapter | configuration | env steps/s |\n|---|---|---|")
    for adapter, config, sps in rows:
        print(f"| {adapter} | {config} | {sps:,.0f} |")

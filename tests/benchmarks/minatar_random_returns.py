"""Return of the uniformly random policy on the MinAtar games (the floor every learning curve is read against).

    python tests/benchmarks/minatar_random_returns.py [--episodes 200] [--games Breakout SpaceInvaders ...]

Full 6-action set (-v0), MinAtar's sticky actions 0.1, the adapter's defaults (common/minatar_env.py); prints a
markdown table of mean return ± standard error and mean episode length per game.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common.minatar_env import MINATAR_GAMES, make_minatar_env  # noqa: E402


def random_returns(env_id: str, episodes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    env = make_minatar_env(env_id, seed)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    returns = []
    lengths = []
    for _ in range(episodes):
        done = False
        ret = 0.0
        n = 0
        while not done:
            _, r, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            ret = ret + r
            n = n + 1
            done = term or trunc
        returns.append(ret)
        lengths.append(n)
        env.reset()
    return np.array(returns), np.array(lengths)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--games", nargs="+", default=list(MINATAR_GAMES))
    a = ap.parse_args()
    print(f"| game (MinAtar/<game>-v0, random policy, {a.episodes} episodes) | return ± SE | episode length |")
    print("|---|---|---|")
    for game in a.games:
        ret, length = random_returns(f"MinAtar/{game}-v0", a.episodes)
        print(f"| {game} | {ret.mean():.2f} ± {ret.std(ddof=1) / np.sqrt(len(ret)):.2f} | {length.mean():.0f} |")

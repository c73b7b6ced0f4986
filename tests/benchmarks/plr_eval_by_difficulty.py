"""Held-out success and return of saved plr_ppo.py runs, per level difficulty (MultiRoom: number of rooms; gamut:
variant), with standard errors (not collected by pytest). Uses each run's checkpoint.pt (written by
--checkpoint-every, and at the end of a run that has it; or a checkpoint file given directly) and the script's own
network and envs. Also the sampler's level scores per difficulty (PLR runs): mean and median score, the best rank,
and how many of the top 10 / top 100 levels are of that difficulty (with rank prioritisation and beta 0.1, the top
level alone holds about 1 - rho of the replay mass).

Usage (from the repo root):
  python tests/benchmarks/plr_eval_by_difficulty.py runs/MultiRoom-N4-Random__plr__1__* ... [--episodes 200]
      [--json out.json]   (the tables' numbers, per run)
"""

import argparse
import itertools
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import plr_ppo  # noqa: E402
from common.checkpoint import load_checkpoint  # noqa: E402
from common.minigrid_env import level_difficulty  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--episodes", type=int, default=200, help="held-out episodes per difficulty")
    p.add_argument("--seed", type=int, default=777, help="draws the held-out level seeds (the same for every run)")
    p.add_argument("--json", default=None, help="write the tables' numbers here")
    a = p.parse_args()
    torch.set_num_threads(1)
    paths = [d if d.endswith(".pt") else os.path.join(d, "checkpoint.pt") for d in a.runs]
    ckpts = [load_checkpoint(path) for path in paths]
    records = {}
    args = SimpleNamespace(**ckpts[0]["args"])
    held_out = HeldOutLevels(args, a.seed)
    # the difficulties: those met until each has --episodes + 64 levels (the levels themselves are drawn as needed)
    while min((len(v) for v in held_out.pools.values()), default=0) < a.episodes + 64 or len(held_out.pools) < 2:
        held_out.draw()
    difficulties = sorted(held_out.pools)
    print("| run | step | " + " | ".join(f"{k} success / return" for k in difficulties) + " |")
    print("|---|---|" + "---|" * len(difficulties))
    for d, ckpt in zip(a.runs, ckpts):
        envs = plr_ppo.make_env(SimpleNamespace(**ckpt["args"]), 8, seed=0, num_workers=1)
        agent = plr_ppo.make_agent(
            SimpleNamespace(**ckpt["args"]), envs.single_observation_space.shape, int(envs.single_action_space.n)
        )
        agent.load_state_dict(ckpt["model"])
        agent.eval()
        # the policy's samples: the same stream for every run
        torch.manual_seed(a.seed)
        cells = []
        results = {}
        for k in difficulties:
            # every episode on the next level of this difficulty, never one played before in this run: the envs that
            # have played their share go on playing (uncounted) on levels of their own
            it = held_out.levels(k)
            obs = envs.reset([next(it) for _ in range(envs.num_envs)])
            # as plr_ppo.evaluate: each env's first episodes, as many as its share, whatever their lengths
            share = plr_ppo.episodes_per_env(a.episodes, envs.num_envs)
            rets_per_env = [[] for _ in range(envs.num_envs)]
            while any(len(rets_per_env[env]) < share[env] for env in range(envs.num_envs)):
                # stochastic policy, every new episode on the next level of this difficulty
                with torch.no_grad():
                    logits = agent(torch.as_tensor(obs))[0]
                actions = torch.distributions.Categorical(logits=logits).sample().numpy()
                obs, _, _, _, info = envs.step(actions, next_level=lambda i: next(it))
                for env in np.flatnonzero(info["_episode"]):
                    rets_per_env[env].append(float(info["episode_return"][env]))
            rets = np.array([ret for env in range(envs.num_envs) for ret in rets_per_env[env][: share[env]]])
            succ = (rets > 0).mean()
            se = np.sqrt(succ * (1 - succ) / len(rets))
            cells.append(f"{succ:.2f} ± {se:.2f} / {rets.mean():.2f}")
            results[k] = {
                "success": float(succ),
                "success_se": float(se),
                "return": float(rets.mean()),
                "episodes": len(rets),
            }
        envs.close()
        print(f"| {os.path.basename(os.path.normpath(d))} | {ckpt['global_step']:,} | " + " | ".join(cells) + " |")
        records[os.path.basename(os.path.normpath(d))] = {
            "global_step": ckpt["global_step"],
            "held_out": results,
            "scores": level_scores(ckpt),
        }
    print("\n| run | difficulty | levels | score mean / median | best rank | in top 10 / top 100 |\n|---|---|---|---|---|---|")
    for name, record in records.items():
        for k, row in record["scores"].items():
            print(
                f"| {name} | {k} | {row['levels']} | {row['mean']:.3f} / {row['median']:.3f} | {row['best_rank']} | "
                f"{row['top10']} / {row['top100']} |"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"episodes": a.episodes, "seed": a.seed, "runs": records}, f, indent=1)


class HeldOutLevels:
    """Held-out level seeds by difficulty, in the order one RNG draws them (test levels come from the full
    distribution: any seed that is not a training level, never one drawn before). The i-th level of a difficulty is
    the same for every run, and the levels are drawn as they are needed, so that no level is played twice in a run,
    however many episodes the envs past their share play (a fixed pool that came round again replayed counted
    levels, and the standard error assumes independent ones)."""

    def __init__(self, args, seed: int):
        self.args = args
        self.rng = np.random.default_rng(seed)
        self.pools = {}
        self.drawn = set()

    def is_training_level(self, seed: int) -> bool:
        start = self.args.start_level
        return bool(self.args.num_train_levels) and start <= seed < start + self.args.num_train_levels

    def draw(self) -> None:
        """The next held-out seed, filed under its difficulty."""
        seed = int(self.rng.integers(2**31 - 1))
        while self.is_training_level(seed) or seed in self.drawn:
            seed = int(self.rng.integers(2**31 - 1))
        self.drawn.add(seed)
        self.pools.setdefault(level_difficulty(self.args.env_id, seed), []).append(seed)

    def levels(self, difficulty: str):
        """The held-out levels of `difficulty`, in order, without end."""
        for index in itertools.count():
            while len(self.pools[difficulty]) <= index:
                self.draw()
            yield self.pools[difficulty][index]


def level_scores(ckpt) -> dict:
    """The sampler's scores of its seen training levels, per difficulty (empty for a run that never scored them)."""
    sampler = ckpt["sampler"]
    seen = np.asarray(sampler["seen"], bool)
    scores = np.asarray(sampler["scores"], float)[seen]
    if not seen.any() or not scores.any():
        return {}
    seeds = np.asarray(sampler["seeds"])[seen]
    difficulty = np.array([level_difficulty(ckpt["args"]["env_id"], int(s)) for s in seeds])
    # rank 1 = the highest score, as rank prioritisation orders them
    rank = np.empty(len(scores), int)
    rank[np.argsort(-scores, kind="stable")] = np.arange(1, len(scores) + 1)
    table = {}
    for k in sorted(set(difficulty)):
        here = difficulty == k
        table[k] = {
            "levels": int(here.sum()),
            "mean": float(scores[here].mean()),
            "median": float(np.median(scores[here])),
            "best_rank": int(rank[here].min()),
            "top10": int((rank[here] <= 10).sum()),
            "top100": int((rank[here] <= 100).sum()),
        }
    return table


if __name__ == "__main__":
    main()

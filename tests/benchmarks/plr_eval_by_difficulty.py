"""Held-out success and return of saved plr_ppo.py runs, per level difficulty (MultiRoom: number of rooms; gamut:
variant), with standard errors (not collected by pytest). Uses each run's checkpoint.pt (written by
--checkpoint-every, and at the end of a run that has it) and the script's own network, envs and `evaluate`.

Usage (from the repo root):
  python tests/benchmarks/plr_eval_by_difficulty.py runs/MultiRoom-N4-Random__plr__1__* ... [--episodes 200]
"""

import argparse
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
    a = p.parse_args()
    torch.set_num_threads(1)
    ckpts = [load_checkpoint(os.path.join(d, "checkpoint.pt")) for d in a.runs]
    args = SimpleNamespace(**ckpts[0]["args"])
    rng = np.random.default_rng(a.seed)
    pools = {}
    while min((len(v) for v in pools.values()), default=0) < a.episodes + 64 or len(pools) < 2:
        s = int(rng.integers(2**31 - 1))  # held-out: test levels are drawn from the full distribution
        if args.num_train_levels and args.start_level <= s < args.start_level + args.num_train_levels:
            continue
        pools.setdefault(level_difficulty(args.env_id, s), []).append(s)
    print("| run | step | " + " | ".join(f"{k} success / return" for k in sorted(pools)) + " |")
    print("|---|---|" + "---|" * len(pools))
    for d, ckpt in zip(a.runs, ckpts):
        envs = plr_ppo.make_env(SimpleNamespace(**ckpt["args"]), 8, seed=0, num_workers=1)
        agent = plr_ppo.make_agent(
            SimpleNamespace(**ckpt["args"]), envs.single_observation_space.shape, int(envs.single_action_space.n)
        )
        agent.load_state_dict(ckpt["model"])
        agent.eval()
        cells = []
        for k in sorted(pools):
            it = iter(pools[k])
            obs = envs.reset([next(it) for _ in range(envs.num_envs)])
            rets = []
            while len(rets) < a.episodes:  # stochastic policy, every new episode on the next level of this difficulty
                with torch.no_grad():
                    logits = agent(torch.as_tensor(obs))[0]
                actions = torch.distributions.Categorical(logits=logits).sample().numpy()
                obs, _, _, _, info = envs.step(actions, next_level=lambda i: next(it))
                rets += [float(r) for r in info["episode_return"][info["_episode"]]]
            rets = np.array(rets[: a.episodes])
            succ = (rets > 0).mean()
            cells.append(f"{succ:.2f} ± {np.sqrt(succ * (1 - succ) / len(rets)):.2f} / {rets.mean():.2f}")
        envs.close()
        print(f"| {os.path.basename(os.path.normpath(d))} | {ckpt['global_step']:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

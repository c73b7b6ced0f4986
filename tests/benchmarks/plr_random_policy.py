"""Return and success of the uniformly random policy on plr_ppo.py's evaluation levels (the floor its learning curves
are read against), measured by the script's own `evaluate`: the same held-out ("test") and training-level draws, the
same episode quota per env, the same eval env count. Not collected by pytest.

    python tests/benchmarks/plr_random_policy.py [--env-id MultiRoom-N4-Random] [--episodes 1000] [--seed 1]
"""

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import plr_ppo  # noqa: E402


class UniformPolicy(nn.Module):
    """Equal logits for every action: `evaluate` samples the uniform distribution from them."""

    def __init__(self, num_actions: int):
        super().__init__()
        self.num_actions = num_actions

    def forward(self, obs):
        return torch.zeros(obs.shape[0], self.num_actions), None


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-id", default="MultiRoom-N4-Random")
    ap.add_argument("--episodes", type=int, default=1000, help="episodes per level set")
    ap.add_argument("--seed", type=int, default=1, help="the run seed whose evaluation level stream is used")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    args = plr_ppo.resolve_defaults(plr_ppo.Args(env_id=a.env_id, seed=a.seed))
    sampler = plr_ppo.make_sampler(args, a.seed)
    # the script's own eval RNG and eval envs
    eval_rng = plr_ppo.make_eval_rng(args)
    envs = plr_ppo.make_eval_envs(args)
    policy = UniformPolicy(int(envs.single_action_space.n))
    metrics = plr_ppo.evaluate(policy, envs, plr_ppo.eval_level_sets(args, sampler, eval_rng), a.episodes, args, "cpu")
    envs.close()
    print(f"| {a.env_id}, uniformly random policy, {a.episodes} episodes per level set | return ± SE | success |")
    print("|---|---|---|")
    for kind in ("test", "train"):
        success = metrics.get(f"eval/{kind}_success", float("nan"))
        print(f"| {kind} | {metrics[f'eval/{kind}_return']:.3f} ± {metrics[f'eval/{kind}_return_se']:.3f} | {success:.2f} |")

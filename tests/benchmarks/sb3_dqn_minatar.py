"""The baseline a user would pick instead of Reactor on MinAtar: Stable-Baselines3 DQN with MinAtar's network, on the
same environment adapter as reactor.py (common/minatar_env.py), logging like our scripts so that
tests/benchmarks/learning_curves.py reads both (not collected by pytest; benchmark-only dependency).

    pip install stable-baselines3==2.9.2   # not in requirements.txt
    python tests/benchmarks/sb3_dqn_minatar.py --env-id MinAtar/Breakout-v0 --total-timesteps 1000000 --seed 1

Network: MinAtar's (Young & Tian 2019): conv 3x3 16 channels, ReLU, 128 units, ReLU, Q head. DQN settings from the
MinAtar paper's DQN: replay 100k, batch 32, gamma 0.99, target update every 1,000 steps, learning from 5,000 steps,
epsilon 1 -> 0.1 over the first 100k steps, one update per step; Adam lr 2.5e-4 (the paper: RMSProp) and SB3's
gradient clip 10. Writes runs/{env}__sb3_dqn__{seed}__{time}/ with args.json, metrics.jsonl
(`charts/episodic_return` per training episode, `charts/SPS`) and summary.json (deterministic evaluation: greedy
actions, the env's sticky actions kept, --eval-episodes episodes; wall_time_s).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common.minatar_env import make_minatar_env  # noqa: E402

try:
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
except ImportError:
    raise SystemExit("error: this benchmark needs stable-baselines3: pip install stable-baselines3==2.9.2") from None


class MinAtarCNN(BaseFeaturesExtractor):
    """MinAtar's network body: conv 3x3 (16 channels, stride 1, no padding), ReLU, flatten, 128 units, ReLU."""

    def __init__(self, observation_space, features_dim: int = 128):
        super().__init__(observation_space, features_dim)
        c, h, w = observation_space.shape
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * (h - 2) * (w - 2), features_dim), nn.ReLU()
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float())


class JsonlLogger(BaseCallback):
    """metrics.jsonl records in our scripts' format: training episode returns and SPS."""

    def __init__(self, path: str, every: int = 10_000):
        super().__init__()
        self.file = open(path, "w")
        self.every = every
        self.start = time.time()
        self.last = 0

    def _on_step(self) -> bool:
        step = self.num_timesteps
        for info in self.locals["infos"]:
            if "episode" in info:
                self.write(
                    step,
                    {
                        "charts/episodic_return": float(info["episode"]["r"]),
                        "charts/episodic_length": int(info["episode"]["l"]),
                    },
                )
        if step - self.last >= self.every:
            self.write(step, {"charts/SPS": step / (time.time() - self.start)})
            self.last = step
        return True

    def write(self, step, metrics):
        self.file.write(json.dumps({"global_step": step, "time": round(time.time() - self.start, 3), **metrics}) + "\n")
        self.file.flush()


def evaluate(model, env_id: str, seed: int, episodes: int) -> list[float]:
    env = make_minatar_env(env_id, seed)
    obs, _ = env.reset(seed=seed)
    returns = []
    ret = 0.0
    while len(returns) < episodes:
        action, _ = model.predict(obs, deterministic=True)
        obs, r, term, trunc, _ = env.step(int(action))
        ret += r
        if term or trunc:
            returns.append(ret)
            ret = 0.0
            obs, _ = env.reset()
    return returns


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-id", default="MinAtar/Breakout-v0")
    ap.add_argument("--total-timesteps", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-episodes", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)
    run = f"runs/{a.env_id.replace('/', '-')}__sb3_dqn__{a.seed}__{int(time.time())}"
    os.makedirs(run)
    settings = dict(
        buffer_size=100_000,
        learning_starts=5_000,
        batch_size=32,
        gamma=0.99,
        learning_rate=2.5e-4,
        train_freq=1,
        gradient_steps=1,
        target_update_interval=1_000,
        exploration_initial_eps=1.0,
        exploration_final_eps=0.1,
        exploration_fraction=100_000 / a.total_timesteps,
    )
    with open(f"{run}/args.json", "w") as f:
        json.dump(
            {**vars(a), **settings, "network": "MinAtar CNN (conv 3x3 16, 128)", "library": "stable-baselines3"}, f, indent=1
        )
    env = make_minatar_env(a.env_id, a.seed)
    env.reset(seed=a.seed)
    model = DQN(
        "CnnPolicy",
        env,
        seed=a.seed,
        device="cpu",
        **settings,
        verbose=0,
        policy_kwargs=dict(features_extractor_class=MinAtarCNN, normalize_images=False, net_arch=[]),
    )
    start = time.time()
    model.learn(a.total_timesteps, callback=JsonlLogger(f"{run}/metrics.jsonl"))
    wall = time.time() - start
    returns = evaluate(model, a.env_id, a.seed + 10_000, a.eval_episodes)
    summary = {
        "global_step": a.total_timesteps,
        "wall_time_s": wall,
        "eval_episodes": len(returns),
        "eval_return_mean": float(np.mean(returns)),
        "eval_return_se": float(np.std(returns, ddof=1) / np.sqrt(len(returns))),
    }
    with open(f"{run}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(run, json.dumps(summary))

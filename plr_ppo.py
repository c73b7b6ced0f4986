# docs and results: README.md#plr_ppopy-prioritized-level-replay-on-ppo
"""Prioritized Level Replay on PPO (Jiang, Grefenstette, Rocktäschel 2021, https://arxiv.org/abs/2010.03934).

Symbols: a level l_i has the score S_i and the timestamp C_i (the value of c when it was last sampled), where c counts
the levels sampled so far (c - C_i: its staleness); Λ_train / Λ_seen: the training levels / those with a score; S~: an
actor's partial episode score; β: temperature, ρ: staleness mix, α: score update rate; M: level-buffer size.

Paper parts implemented here (Procgen and MiniGrid)
- Level scores (Sec. 3.1, Table 1) `step_scores`, averaged per episode by `LevelSampler.update_with_rollouts`:
  value_l1 (Eq. (2), default), gae, one_step_td, policy_entropy, least_confidence, min_margin; `random` = uniform.
- P_S (Eq. (3); rank / power / greedy) `score_distribution`; P_C (Eq. (4)) `staleness_distribution`;
  P_replay = (1-ρ) P_S + ρ P_C (Eq. (1)) `replay_distribution`.
- Replay decision P_D and P_new (Alg. 2 / 4) `LevelSampler.sample`: proportionate |Λ_seen|/|Λ_train| or fixed;
  the two level spaces: a fixed Λ_train `BoundedLevelSampler`, the unbounded level distribution with a top-M level
  buffer (App. B.3) `UnboundedLevelSampler`.
- Partial-episode scores stitched across rollouts (Alg. 3 / 4) `update_with_rollouts` (`--plr-commit episode`), or
  committed after every update as the authors' code (`--plr-commit update`, `after_update`).
- PPO with GAE `compute_gae`, `ppo_loss`; return normalization (Table 3) `ReturnNormalizer`;
  networks: IMPALA ResNet (Procgen) `ImpalaAgent`, the authors' MinigridPolicy `MiniGridAgent`.

Defaults (Table 3, Sec. 4, App. A.2): Procgen 64 envs x 256 steps, 3 epochs, 8 minibatches, lr 5e-4, Adam eps 1e-5,
γ 0.999, λ 0.95, clip 0.2, entropy 0.01, value 0.5, 25M steps, 200 easy levels; MiniGrid lr 7e-4, 4 epochs, 4000 / 3000 /
6000 levels (those that differ by domain: `DOMAIN_DEFAULTS`). PLR: value_l1, rank, β 0.1, ρ 0.1 (Procgen) / 0.3
(MiniGrid), P_D proportionate (Sec. 3); unbounded mode fixed replay p 0.95 and M 4000 (App. B.3). Authors' code: grad
clip 0.5, clipped value loss, batch advantage normalization.

Differences from the paper (long form: README.md, section plr_ppo.py)
- A level enters Λ_seen at its first committed score (authors' code), not when sampled (Alg. 2): no replay of an
  unscored level. Ranks among seen levels only, ties by index; P_C / P_S fall back to uniform over Λ_seen.
- Unbounded mode stages a new level until its first score, as facebookresearch/dcd's sampler (level-replay has none).
- one_step_td keeps γ and the last step (the authors' code drops them); entropy and min-margin as the authors' code.
- Time limits: MiniGrid's is a termination (authors' code), Procgen's bootstraps from V(final obs)
  (`--bootstrap-truncation`); Procgen episodes end one step before the game's limit.
- Return normalization uses args.gamma (authors: 0.99); evaluation samples from the policy, test levels exclude the
  training levels; `--resume` restarts the current levels from their first frame and drops their partial scores
  and running returns.
- Against the authors' level_sampler.py: staleness counted before a draw (Alg. 2 / 4; theirs after), a trailing
  partial episode scored on its own steps (theirs averages in one more row: −V(s_T) for gae, |V(s_T)| for value_l1),
  first levels drawn from P_new and counted.
Vector envs autoreset SAME_STEP (`next_level(i)`, `info["final_obs"]`). Copying this file: it needs
common/{procgen_env,minigrid_env,logger,checkpoint,args,processes}.py.
"""

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

from common.processes import install_stop_handling

# Ctrl-C, SIGTERM and SIGHUP are handled from here on, during the heavy imports below too (common/processes.py)
if __name__ == "__main__":
    install_stop_handling()

import numpy as np
import torch
import torch.nn as nn
from torch.distributions import Categorical

from common.args import CommonArgs, parse_run_args, require
from common.checkpoint import (
    CheckpointSchedule,
    load_state_dicts,
    save_run_checkpoint,
    seed_everything,
    select_device,
    set_rng_state,
    state_dicts,
)
from common.logger import start_run
from common.minigrid_env import MiniGridVecEnv, level_difficulty, resolve_minigrid_id
from common.processes import StopRun, check_stop, finish_run, set_learner_threads

MAX_SEED = 2**31 - 1

# The defaults that depend on the domain: a flag left at None takes its domain's value here (`resolve_defaults`).
DOMAIN_DEFAULTS = {
    "procgen": {
        # App. A: N_train = 200 levels of Procgen easy (Cobbe et al. 2020's protocol)
        "num_train_levels": 200,
        # Table 3 (CleanRL ppo_procgen: 3)
        "update_epochs": 3,
        # Table 3 (CleanRL ppo_procgen: 5e-4)
        "learning_rate": 5e-4,
        # Table 3: ρ
        "plr_staleness_coef": 0.1,
        # this script: Procgen's time limit is not part of the game, so a timeout bootstraps from V(final obs)
        "bootstrap_truncation": True,
    },
    "minigrid": {
        # Sec. 4: about 1000 levels of each difficulty (the paper's MiniGrid envs: MINIGRID_TRAIN_LEVELS)
        "num_train_levels": 1000,
        # Table 3
        "update_epochs": 4,
        # Table 3
        "learning_rate": 7e-4,
        # Table 3: ρ (Sec. 4: the best test performance on MiniGrid)
        "plr_staleness_coef": 0.3,
        # authors' code: MiniGrid's time limit is part of the task (a termination)
        "bootstrap_truncation": False,
    },
}
# |Λ_train| of the paper's MiniGrid envs (App. A.2: about 1000 training levels per difficulty)
MINIGRID_TRAIN_LEVELS = {"MultiRoom-N4-Random": 4000, "ObstructedMazeGamut-Easy": 3000, "ObstructedMazeGamut-Medium": 6000}


# CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
@dataclass
class Args(CommonArgs):
    # --- algorithm specific arguments ---
    env_id: str = "bigfish"
    """a Procgen game (bigfish, ...), MultiRoom-N4-Random, ObstructedMazeGamut-Easy/-Medium or a registered MiniGrid id"""
    total_timesteps: int = 25_000_000
    """total environment steps (paper: 25M Procgen)"""
    distribution_mode: str = "easy"
    """Procgen distribution mode (paper: easy)"""
    num_train_levels: int | None = None
    """|Λ_train| (seeds start_level, ...); 0 = the full distribution with a top-M buffer (App. B.3). Default: per domain:
    Procgen 200 (App. A), MiniGrid 1000 (Sec. 4), MultiRoom-N4-Random 4000, ObstructedMazeGamut-Easy 3000,
    ObstructedMazeGamut-Medium 6000 (App. A.2)"""
    start_level: int = 0
    """first training level seed"""
    num_envs: int = 64
    """N_b parallel environments (Table 3: 64 workers)"""
    num_steps: int = 256
    """T, rollout length per environment (Table 3)"""
    num_minibatches: int = 8
    """PPO minibatches per epoch (Table 3)"""
    update_epochs: int | None = None
    """PPO epochs. Default: per domain: Procgen 3 (Table 3), MiniGrid 4 (Table 3)"""
    learning_rate: float | None = None
    """Adam learning rate. Default: per domain: Procgen 5e-4 (Table 3), MiniGrid 7e-4 (Table 3)"""
    adam_eps: float = 1e-5
    """Adam epsilon (Table 3)"""
    gamma: float = 0.999
    """γ discount (Table 3)"""
    gae_lambda: float = 0.95
    """λ of GAE (Table 3)"""
    clip_coef: float = 0.2
    """PPO clip range ε (Table 3)"""
    clip_vloss: bool = True
    """clip the value loss as PPO's reference code does"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (Table 3)"""
    vf_coef: float = 0.5
    """value loss coefficient (Table 3)"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip (authors' code)"""
    norm_adv: bool = True
    """normalize advantages over the whole batch (authors' code)"""
    norm_reward: bool = True
    """return normalization: divide rewards by the running std of the discounted return (Table 3), clip ±10"""
    num_workers: int = 0
    """MiniGrid worker processes (0 = one per available CPU core)"""
    bootstrap_truncation: bool | None = None
    """on a time-limit truncation, bootstrap from V(final obs) (True) or treat it as a termination (False). Default:
    per domain: Procgen True (this script), MiniGrid False (authors' code: the limit is part of the task)"""
    eval_every: int = 50
    """evaluate on train and test levels every this many updates (0 = only at the end)"""
    eval_episodes: int = 10
    """episodes per level set at each periodic evaluation (the paper's 10 train + 10 test)"""
    final_eval_episodes: int = 100
    """episodes per level set at the final evaluation"""
    num_eval_envs: int = 8
    """parallel environments per evaluation set"""

    # --- PLR (paper symbols) ---
    plr_strategy: Literal["value_l1", "gae", "one_step_td", "policy_entropy", "least_confidence", "min_margin", "random"] = (
        "value_l1"
    )
    """score(τ, π) (Table 1): value_l1 (Eq. (2)) | gae | one_step_td | policy_entropy | least_confidence | min_margin |
    random (the uniform-sampling baseline)"""
    plr_transform: Literal["rank", "power", "greedy"] = "rank"
    """prioritization h of Eq. (3): rank (h = 1/rank) | power (h = S, 'proportional') | greedy (argmax)"""
    plr_temperature: float = 0.1
    """β, temperature of Eq. (3) (Table 3)"""
    plr_staleness_coef: float | None = None
    """ρ, staleness mixing of Eq. (1) in [0, 1]. Default: per domain: Procgen 0.1 (Table 3), MiniGrid 0.3 (Table 3)"""
    plr_replay_schedule: Literal["proportionate", "fixed"] = "proportionate"
    """P_D: proportionate (P_D(replay) = |Λ_seen|/|Λ_train|, Sec. 3) | fixed (P_D(replay) = --plr-replay-prob)"""
    plr_replay_prob: float = 0.95
    """P_D(replay) of the fixed schedule (App. B.3: 0.5 MultiRoom, 0.95 ObstructedMazeGamut-Easy)"""
    plr_min_fill: float = 0.0
    """no replay before |Λ_seen| >= min_fill |Λ_train| (authors' code `rho`; their default 1.0, the paper's rule is 0)"""
    plr_score_alpha: float = 1.0
    """α of the score EWA S <- (1-α) S + α score(τ) (authors' code; 1 = the paper's overwrite)"""
    plr_commit: Literal["episode", "update"] = "episode"
    """episode: stitch partial scores S~ across rollouts, commit at episode end (Alg. 4) | update: commit after every
    PPO update (authors' code)"""
    plr_buffer_size: int = 4000
    """M, level-buffer size in unbounded mode (--num-train-levels 0; App. B.3)"""


def is_procgen(env_id: str) -> bool:
    from common.procgen_env import PROCGEN_GAMES

    return env_id in PROCGEN_GAMES


def make_env(args: Args, num_envs: int, *, seed: int, num_workers: int | None = None):
    """A level-settable vector env: ProcgenVecEnv (native threads) or MiniGridVecEnv (worker processes)."""
    if is_procgen(args.env_id):
        from common.procgen_env import ProcgenVecEnv

        return ProcgenVecEnv(
            args.env_id,
            num_envs,
            distribution_mode=args.distribution_mode,
            num_threads=min(4, os.cpu_count() or 1),
            rand_seed=seed,
        )
    return MiniGridVecEnv(
        args.env_id,
        num_envs,
        num_workers=num_workers or args.num_workers or None,
        fully_observable=True,
        seed=seed,
        start_method=args.start_method,
    )


# NETWORKS
def layer_init(layer, std=np.sqrt(2)):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


# The standard pre-activation block: the authors' in-place ReLU also changes the skip connection's input.
class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaAgent(nn.Module):
    """IMPALA ResNet 16/32/32 + 256 hidden (Espeholt et al. 2018; Cobbe et al. 2020; PLR App. A.1): per stage a conv,
    a 3x3 stride-2 max-pool and two residual blocks."""

    def __init__(self, obs_shape, num_actions, hidden=256):
        super().__init__()
        height, width, channels = obs_shape
        stages = []
        for out_channels in (16, 32, 32):
            stages.append(nn.Conv2d(channels, out_channels, 3, padding=1))
            stages.append(nn.MaxPool2d(3, 2, padding=1))
            stages.append(ResidualBlock(out_channels))
            stages.append(ResidualBlock(out_channels))
            channels = out_channels
            height = (height + 1) // 2
            width = (width + 1) // 2
        self.trunk = nn.Sequential(*stages, nn.Flatten(), nn.ReLU(), nn.Linear(channels * height * width, hidden), nn.ReLU())
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs):  # obs: uint8 (B, H, W, C)
        hidden = self.trunk(obs.permute(0, 3, 1, 2).float() / 255.0)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)


class MiniGridAgent(nn.Module):
    """The authors' MinigridPolicy (level_replay/model.py; PLR App. A.2): conv 2x2 16, max-pool 2x2, conv 2x2 32,
    conv 2x2 32 (64 for ObstructedMazeGamut), then separate 64-unit tanh actor and critic layers. Inputs are
    MiniGrid's integer cell encodings as floats (unscaled, as theirs). Init as theirs: Xavier-uniform convs,
    orthogonal linears (gain sqrt 2; policy head 0.01, value head 1), zero biases.
    Oracle: tests/test_plr_wiring.py::test_minigrid_network_matches_the_authors_forward"""

    def __init__(self, obs_shape, num_actions, final_channels=32, hidden=64):
        super().__init__()
        height, width, channels = obs_shape
        self.trunk = nn.Sequential(
            nn.Conv2d(channels, 16, 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 2),
            nn.ReLU(),
            nn.Conv2d(32, final_channels, 2),
            nn.ReLU(),
            nn.Flatten(),
        )
        for layer in self.trunk:
            if isinstance(layer, nn.Conv2d):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
        # 2x2 conv: -1, 2x2 max-pool: //2, two 2x2 convs: -2
        embedding_size = final_channels * ((height - 1) // 2 - 2) * ((width - 1) // 2 - 2)
        # the authors' Categorical head is the actor's last Linear
        self.actor = nn.Sequential(
            layer_init(nn.Linear(embedding_size, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, num_actions), std=0.01)
        )
        self.critic = nn.Sequential(
            layer_init(nn.Linear(embedding_size, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, 1), std=1.0)
        )

    def forward(self, obs):
        embedding = self.trunk(obs.permute(0, 3, 1, 2).float())
        return self.actor(embedding), self.critic(embedding).squeeze(-1)


def make_agent(args: Args, obs_shape, num_actions) -> nn.Module:
    if is_procgen(args.env_id):
        return ImpalaAgent(obs_shape, num_actions)
    return MiniGridAgent(obs_shape, num_actions, final_channels=64 if "ObstructedMaze" in args.env_id else 32)


# ALGORITHM PIECES: PPO
class ReturnNormalizer:
    """Return normalization (Table 3), as gym's NormalizeReward: each env's reward is divided by the running standard
    deviation of the discounted returns, then clipped to ±clip. Call it once per vector-env step with that step's
    rewards and episode ends.
    Oracle: tests/test_plr_oracles.py::test_return_normalizer_and_cobbe_normalization"""

    def __init__(self, num_envs, gamma, clip=10.0, eps=1e-8):
        self.gamma = gamma
        self.clip = clip
        self.eps = eps
        self.ret = np.zeros(num_envs)  # each env's discounted return so far
        self.mean = 0.0
        self.var = 1.0
        self.count = 1e-4

    def __call__(self, rewards, dones):
        self.ret = self.ret * self.gamma + rewards
        # the running mean and variance take this step's returns as one batch (Chan et al.'s parallel update)
        batch_mean = self.ret.mean()
        batch_var = self.ret.var()
        batch_count = self.ret.size
        delta = batch_mean - self.mean
        total_count = self.count + batch_count
        self.mean += delta * batch_count / total_count
        sum_of_squares = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total_count
        self.var = sum_of_squares / total_count
        self.count = total_count
        self.ret[dones] = 0.0
        return np.clip(rewards / np.sqrt(self.var + self.eps), -self.clip, self.clip).astype(np.float32)

    def state_dict(self):
        return {"ret": self.ret.copy(), "mean": self.mean, "var": self.var, "count": self.count}

    def restart_episodes(self):
        """Every env's episode restarts from its first frame (`--resume`): its discounted return so far is 0 again;
        the running statistics are kept."""
        self.ret[:] = 0.0

    def load_state_dict(self, state):
        self.ret = state["ret"].copy()
        self.mean = state["mean"]
        self.var = state["var"]
        self.count = state["count"]


def compute_gae(rewards, values, next_value, terminated, dones, final_values, gamma, gae_lambda):
    """GAE over a T-step rollout of (T, N) tensors. dones[t]: the episode ended at t (terminated or truncated);
    terminated[t]: true termination (no bootstrap); final_values[t]: V(s_final) of an episode truncated at t (ignored
    elsewhere); next_value: V(s_T) after the rollout. Returns (advantages, deltas) with
    δ_t = r_t + γ V(s_{t+1}) (1 - terminal_t) - V(s_t) (PLR Sec. 3.1) and A_t = Σ_k (γλ)^{k-t} δ_k within the episode
    (Eq. (2) without the absolute value).
    Oracles: tests/test_plr_oracles.py::test_compute_gae_matches_textbook,
    tests/test_plr_oracles.py::test_gae_and_td_scores_hand_computed_with_stitching"""
    next_values = torch.cat([values[1:], next_value[None]], 0)
    # at an episode end the next obs belongs to a new episode: bootstrap from the true final obs (truncation) or 0
    bootstrap = torch.where(dones, final_values, next_values) * (1.0 - terminated.to(rewards.dtype))
    deltas = rewards + gamma * bootstrap - values
    advantages = torch.zeros_like(rewards)
    advantage = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        # Eq. (2) as a recursion: A_t = δ_t + γλ A_{t+1}, restarting at each episode end
        advantage = deltas[t] + gamma * gae_lambda * (1.0 - dones[t].to(rewards.dtype)) * advantage
        advantages[t] = advantage
    return advantages, deltas


class PPOLoss(NamedTuple):
    loss: torch.Tensor  # the minimised total: policy_loss - ent_coef entropy + vf_coef value_loss
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor
    clipfrac: torch.Tensor


def ppo_loss(agent, obs, actions, old_logprobs, advantages, returns, old_values, args: Args) -> PPOLoss:
    """Clipped surrogate objective, (clipped) value loss and entropy bonus (Schulman et al. 2017).
    Oracle: tests/test_plr_oracles.py::test_ppo_loss_hand_computed"""
    logits, values = agent(obs)
    dist = Categorical(logits=logits)
    logratio = dist.log_prob(actions) - old_logprobs
    ratio = logratio.exp()
    clipped_ratio = torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
    if args.clip_vloss:
        clipped_values = old_values + torch.clamp(values - old_values, -args.clip_coef, args.clip_coef)
        value_loss = 0.5 * torch.max((values - returns) ** 2, (clipped_values - returns) ** 2).mean()
    else:
        value_loss = 0.5 * ((values - returns) ** 2).mean()
    entropy = dist.entropy().mean()
    loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    return PPOLoss(loss, policy_loss, value_loss, entropy, approx_kl, clipfrac)


# ALGORITHM PIECES: PLR
def step_scores(strategy, advantages, deltas, logits=None):
    """Per-step quantity whose episode mean is score(τ, π) (Table 1); numpy (T, N) out.
    advantages, deltas: (T, N) GAE and one-step TD errors; logits: (T, N, |A|) of the behaviour policy.
    Oracles: tests/test_plr_oracles.py::test_policy_scores_uniform_onehot_and_handworked,
    tests/test_plr_oracles.py::test_gae_and_td_scores_hand_computed_with_stitching"""
    if strategy == "value_l1":
        return np.abs(advantages)  # Eq. (2): |Σ_k (γλ)^{k-t} δ_k|
    if strategy == "gae":
        return np.asarray(advantages)
    if strategy == "one_step_td":
        return np.abs(deltas)  # |δ_t|
    log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    probs = np.exp(log_probs)
    if strategy == "policy_entropy":
        # -Σ_a π log π, normalized by log|A| (authors' code)
        return -(probs * log_probs).sum(-1) / np.log(probs.shape[-1])
    if strategy == "least_confidence":
        return 1.0 - probs.max(-1)
    if strategy == "min_margin":
        # 1 - (p_(1) - p_(2)): higher = less confident (authors' code)
        top2 = np.sort(probs, axis=-1)[..., -2:]
        return 1.0 - (top2[..., 1] - top2[..., 0])
    raise ValueError(f"no per-step score for strategy {strategy!r}")


def score_distribution(scores, seen, transform="rank", temperature=0.1):
    """Eq. (3): P_S(l_i) = h(S_i)^(1/β) / Σ_j h(S_j)^(1/β) over the seen levels, 0 for the unseen ones.

    rank: h = 1/rank(S_i), the rank among seen levels in descending order (1 = highest; ties by index); power:
    h = max(S_i, 0) (the paper's "proportional"); greedy: all mass on the highest score. The weights are computed in
    log space so that a small β stays finite; if every weight is 0, P_S is uniform over the seen levels.
    Oracles: tests/test_plr_oracles.py::test_replay_distribution_matches_textbook,
    tests/test_plr_oracles.py::test_replay_distribution_properties"""
    seen = np.asarray(seen, dtype=bool)
    probs = np.zeros(len(seen))
    seen_slots = np.flatnonzero(seen)
    if seen_slots.size == 0:
        return probs
    seen_scores = np.asarray(scores, dtype=np.float64)[seen_slots]
    if transform == "greedy":
        probs[seen_slots[np.argmax(seen_scores)]] = 1.0
        return probs
    if transform == "rank":
        ranks = np.empty(seen_slots.size)
        ranks[np.argsort(-seen_scores, kind="stable")] = np.arange(1, seen_slots.size + 1)
        log_h = -np.log(ranks)
    elif transform == "power":
        with np.errstate(divide="ignore"):
            log_h = np.log(np.clip(seen_scores, 0.0, None))
    else:
        raise ValueError(f"unknown transform {transform!r}")
    # h^(1/β) / Σ h^(1/β) = exp((log h - max log h) / β) / Σ exp(...)
    max_log_h = log_h.max()
    if not np.isfinite(max_log_h):
        probs[seen_slots] = 1.0 / seen_slots.size
        return probs
    weights = np.exp((log_h - max_log_h) / temperature)
    probs[seen_slots] = weights / weights.sum()
    return probs


def staleness_distribution(staleness, seen):
    """Eq. (4): P_C(l_i) = (c - C_i) / Σ_j (c - C_j) over the seen levels; uniform over them if all are 0.
    Oracle: tests/test_plr_oracles.py::test_replay_distribution_matches_textbook"""
    seen = np.asarray(seen, dtype=bool)
    seen_staleness = np.where(seen, np.asarray(staleness, dtype=np.float64), 0.0)
    total = seen_staleness.sum()
    if total > 0:
        return seen_staleness / total
    num_seen = seen.sum()
    return seen / num_seen if num_seen else np.zeros(len(seen))


def replay_distribution(scores, staleness, seen, transform="rank", temperature=0.1, staleness_coef=0.1):
    """Eq. (1): P_replay = (1 - ρ) P_S + ρ P_C over all levels (0 for unseen; all 0 if nothing is seen).
    scores S, staleness c - C, seen: arrays over levels; transform: rank | power | greedy; temperature: β; ρ.
    Oracles: tests/test_plr_oracles.py::test_replay_distribution_matches_textbook,
    tests/test_plr_oracles.py::test_replay_distribution_properties"""
    score_probs = score_distribution(scores, seen, transform, temperature)
    if staleness_coef == 0.0:
        return score_probs
    return (1.0 - staleness_coef) * score_probs + staleness_coef * staleness_distribution(staleness, seen)


@dataclass(frozen=True)
class SamplerConfig:
    """The level sampler's settings; `make_sampler` reads them from the --plr-* flags (--plr-X is field X)."""

    strategy: str = "value_l1"
    transform: str = "rank"
    temperature: float = 0.1
    staleness_coef: float = 0.1
    replay_schedule: str = "proportionate"
    replay_prob: float = 0.95
    min_fill: float = 0.0
    score_alpha: float = 1.0
    commit: str = "episode"
    buffer_size: int = 0


class LevelSampler:
    """PLR's level sampler (Algorithm 4), the core both modes share: scores S, staleness c - C, the seen set Λ_seen,
    each actor's partial score S~. Per update: `sample` (inside env.step, at each episode end), `update_with_rollouts`,
    the PPO update, `after_update`. The level space is the mode's: `BoundedLevelSampler` (a fixed Λ_train, one slot per
    training level) or `UnboundedLevelSampler` (the full distribution, a top-M level buffer: App. B.3); each says where
    a new level comes from (P_new), the uniform baseline's level, whether Λ_train is exhausted and which slot a level's
    first score goes to."""

    def __init__(self, seeds, num_actors, config=SamplerConfig(), seed=0):
        self.config = config
        # the level in each slot (-1: an empty buffer slot), and the slot of each level
        self.seeds = seeds
        self.slot_of = {int(level): slot for slot, level in enumerate(self.seeds) if level >= 0}
        num_slots = len(self.seeds)
        self.scores = np.zeros(num_slots)  # S_i
        self.staleness = np.zeros(num_slots)  # c - C_i
        # Λ_seen: the levels with a committed score (unbounded: the filled buffer slots)
        self.seen = np.zeros(num_slots, bool)
        # S~: the mean score so far of each actor's unfinished episode, its length so far and its level
        self.partial_score = np.zeros(num_actors)
        self.partial_steps = np.zeros(num_actors, np.int64)
        self.partial_level = np.full(num_actors, -1, np.int64)
        # unbounded: new levels not yet in the buffer, level -> c when it was sampled
        self.staged = {}
        self.num_samples = 0  # c
        self.num_replays = 0
        self.num_seen = 0  # |Λ_seen|
        self.rng = np.random.default_rng(seed)

    # --- distributions ---
    def replay_probs(self) -> np.ndarray:
        """P_replay over the slots (Eq. (1))."""
        config = self.config
        return replay_distribution(
            self.scores, self.staleness, self.seen, config.transform, config.temperature, config.staleness_coef
        )

    def replay_decision_prob(self) -> float:
        """P_D(d = 1), the probability that the next level is a replay.
        Oracle: tests/test_plr_sampler.py::test_replay_decision_frequencies_and_unseen_uniform"""
        seen_fraction = self.num_seen / len(self.seeds)
        if self.num_seen == 0 or seen_fraction < self.config.min_fill:
            return 0.0
        if self._all_levels_seen():
            # Algorithm 2: no unseen level is left
            return 1.0
        if self.config.replay_schedule == "proportionate":
            return seen_fraction
        return self.config.replay_prob

    # --- sampleNextLevel (Algorithm 4) ---
    def sample(self, actor: int) -> int:
        """The level (seed) of actor `actor`'s next episode: c and the staleness c - C_i advance, d ~ P_D, then a
        replay l ~ P_replay or a new level l ~ P_new.
        Oracles: tests/test_plr_sampler.py::test_replay_decision_frequencies_and_unseen_uniform,
        tests/test_plr_sampler.py::test_staleness_is_episode_count_minus_timestamp"""
        if self.config.strategy == "random":
            # the uniform baseline: P_train = Uniform(Λ_train)
            return self._sample_uniform_level()
        self.num_samples += 1  # c <- c + 1
        self.staleness += 1.0
        # d ~ P_D: replay a seen level, or play a new one
        if self.rng.random() < self.replay_decision_prob():
            slot = self._sample_replay_slot()
            self.num_replays += 1
            level = int(self.seeds[slot])
        else:
            level = self._sample_unseen_level()
            slot = self.slot_of.get(level)
            if slot is None:
                # unbounded: staged until its first episode is scored
                self.staged[level] = self.num_samples
        if slot is not None:
            self.staleness[slot] = 0.0  # C_i <- c
        return level

    def _sample_replay_slot(self) -> int:
        """l ~ P_replay, by inverting its cumulative distribution (a slot of zero mass is never drawn).
        Oracle: tests/test_plr_sampler.py::test_replay_sampling_follows_replay_distribution"""
        cdf = np.cumsum(self.replay_probs())
        slot = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(slot, len(cdf) - 1)

    # --- scores ---
    def _commit_score(self, level: int, score: float) -> None:
        """S_i <- (1 - α) S_i + α score (α = 1: the paper's overwrite); the level's first score adds it to Λ_seen."""
        slot = self.slot_of.get(level)
        if slot is None:
            # unbounded: a level outside the buffer
            slot = self._admit_new_level(level, score)
            if slot is None:
                return
        elif not self.seen[slot]:
            self.num_seen += 1
        if self.seen[slot]:
            alpha = self.config.score_alpha
            self.scores[slot] = (1.0 - alpha) * self.scores[slot] + alpha * score
        else:
            # the first score: the level joins Λ_seen and becomes replayable
            self.scores[slot] = score
            self.seen[slot] = True

    def update_with_rollouts(self, scores, dones, levels) -> int:
        """Algorithm 4's scoring of a rollout. scores, dones, levels: (T, N) numpy arrays of the per-step scores, the
        episode ends and the level each step was played on. Each actor's rollout splits after every episode end; the
        first segment continues the actor's unfinished episode (its partial score S~), each finished episode commits
        the mean score of its steps, and the trailing unfinished one becomes the new S~. Returns the number of commits.
        Oracle: tests/test_plr_sampler.py::test_sampler_scores_match_textbook_algorithm4"""
        if self.config.strategy == "random":
            return 0
        scores = np.asarray(scores, np.float64)
        dones = np.asarray(dones, bool)
        levels = np.asarray(levels, np.int64)
        num_steps, num_actors = scores.shape
        num_commits = 0
        for actor in range(num_actors):
            start = 0
            episode_ends = np.flatnonzero(dones[:, actor]) + 1
            for end in [*episode_ends, num_steps]:
                if start == end:
                    # the rollout's last step ended an episode: no steps after it
                    continue
                level = int(levels[start, actor])
                total = 0.0
                for step_score in scores[start:end, actor].tolist():
                    total += step_score
                length = end - start
                if start == 0 and self.partial_steps[actor] > 0:
                    if self.partial_level[actor] == level:
                        # the same episode goes on: stitch its steps from earlier rollouts
                        total += self.partial_score[actor] * self.partial_steps[actor]
                        length += self.partial_steps[actor]
                    self.partial_steps[actor] = 0
                if dones[end - 1, actor]:
                    self._commit_score(level, total / length)
                    num_commits += 1
                else:
                    self.partial_score[actor] = total / length
                    self.partial_steps[actor] = length
                    self.partial_level[actor] = level
                start = end
        return num_commits

    def restart_episodes(self) -> None:
        """Every actor's episode restarts from its level's first frame (`--resume`: env states are not saved): drop the
        partial scores S~, so that the restarted episode is scored on its own steps only."""
        self.partial_score[:] = 0.0
        self.partial_steps[:] = 0

    def after_update(self) -> None:
        """`--plr-commit update` (authors' code): commit every partial score S~ as its level's score, reset S~."""
        if self.config.commit != "update" or self.config.strategy == "random":
            return
        for actor in np.flatnonzero(self.partial_steps > 0):
            self._commit_score(int(self.partial_level[actor]), float(self.partial_score[actor]))
            self.partial_steps[actor] = 0

    # --- checkpointing ---
    _ARRAYS = ("seeds", "scores", "staleness", "seen", "partial_score", "partial_steps", "partial_level")

    def state_dict(self) -> dict:
        state = {name: getattr(self, name).copy() for name in self._ARRAYS}
        state["staged"] = dict(self.staged)
        state["num_samples"] = self.num_samples
        state["num_replays"] = self.num_replays
        state["num_seen"] = self.num_seen
        state["rng"] = self.rng.bit_generator.state
        return state

    def load_state_dict(self, state: dict) -> None:
        for name in self._ARRAYS:
            setattr(self, name, np.array(state[name]).copy())
        self.staged = dict(state["staged"])
        self.num_samples = state["num_samples"]
        self.num_replays = state["num_replays"]
        self.num_seen = state["num_seen"]
        self.slot_of = {int(level): slot for slot, level in enumerate(self.seeds) if level >= 0}
        self.rng.bit_generator.state = state["rng"]

    def stats(self) -> dict:
        """plr/* metrics."""
        probs = self.replay_probs() if self.num_seen else np.zeros(1)
        positive = probs[probs > 0]
        out = {
            "plr/num_seen_levels": int(self.num_seen),
            "plr/replay_prob": self.replay_decision_prob(),
            "plr/num_replays": int(self.num_replays),
            "plr/replay_entropy": float(-(positive * np.log(positive)).sum()),
        }
        for name, values in (("score", self.scores[self.seen]), ("staleness", self.staleness[self.seen])):
            out[f"plr/{name}_mean"] = float(values.mean()) if values.size else 0.0
            out[f"plr/{name}_max"] = float(values.max()) if values.size else 0.0
        return out


class BoundedLevelSampler(LevelSampler):
    """PLR on a fixed set of training levels Λ_train (the paper's main setting): one slot per training level."""

    def __init__(self, levels, num_actors, config=SamplerConfig(), seed=0):
        super().__init__(np.asarray(levels, np.int64).copy(), num_actors, config, seed)

    def _all_levels_seen(self) -> bool:
        return self.num_seen == len(self.seeds)

    def _sample_uniform_level(self) -> int:
        """P_train = Uniform(Λ_train)."""
        return int(self.seeds[self.rng.integers(len(self.seeds))])

    def _sample_unseen_level(self) -> int:
        """P_new: uniform over Λ_train \\ Λ_seen. A new level joins Λ_seen at its first committed score (authors' code),
        not when sampled (Algorithm 2)."""
        unseen_slots = np.flatnonzero(~self.seen)
        return int(self.seeds[self.rng.choice(unseen_slots)])

    def _admit_new_level(self, level: int, score: float) -> None:
        """Every training level has its slot: a score for any other level is an error."""
        raise ValueError(f"level {level} is not a training level")


class UnboundedLevelSampler(LevelSampler):
    """PLR on the full level distribution (App. B.3): M slots holding the top-M levels; new levels are random seeds in
    [0, 2^31-1), staged until their first episode is scored."""

    def __init__(self, num_actors, config=SamplerConfig(), seed=0):
        # -1: an empty buffer slot
        super().__init__(np.full(config.buffer_size, -1, np.int64), num_actors, config, seed)

    def _all_levels_seen(self) -> bool:
        # the full distribution is never exhausted
        return False

    def _sample_uniform_level(self) -> int:
        """The uniform baseline over the full distribution: any seed."""
        return int(self.rng.integers(MAX_SEED))

    def _sample_unseen_level(self) -> int:
        """P_new: a random seed that is not in the buffer and not staged."""
        while True:
            level = int(self.rng.integers(MAX_SEED))
            if level not in self.slot_of and level not in self.staged:
                return level

    def _admit_new_level(self, level: int, score: float) -> int | None:
        """Unbounded mode (App. B.3): a level that is not in the top-M buffer takes a free slot, or the slot of
        l_min = argmin P_replay if its score is higher than l_min's. Returns the slot, or None if the level stays out.
        Oracle: tests/test_plr_sampler.py::test_unbounded_top_m_buffer"""
        sampled_at = self.staged.pop(level, self.num_samples)
        if self.num_seen < len(self.seeds):
            slot = self.num_seen
            self.num_seen += 1
        else:
            slot = int(np.argmin(self.replay_probs()))
            if not self.scores[slot] < score:
                return None
            del self.slot_of[int(self.seeds[slot])]
        self.seeds[slot] = level
        self.slot_of[level] = slot
        # the slot now holds a level without a score yet (its score is set by the caller)
        self.seen[slot] = False
        self.staleness[slot] = self.num_samples - sampled_at
        return slot


def make_sampler(args: Args, seed: int) -> LevelSampler:
    """The LevelSampler of the --plr-* flags."""
    if args.num_train_levels == 0:
        levels = None
    else:
        levels = np.arange(args.start_level, args.start_level + args.num_train_levels)
    config = SamplerConfig(
        strategy=args.plr_strategy,
        transform=args.plr_transform,
        temperature=args.plr_temperature,
        staleness_coef=args.plr_staleness_coef,
        replay_schedule=args.plr_replay_schedule,
        replay_prob=args.plr_replay_prob,
        min_fill=args.plr_min_fill,
        score_alpha=args.plr_score_alpha,
        commit=args.plr_commit,
        buffer_size=args.plr_buffer_size,
    )
    if levels is None:
        return UnboundedLevelSampler(args.num_envs, config, seed=seed)
    return BoundedLevelSampler(levels, args.num_envs, config, seed=seed)


# ROLLOUT STORAGE
@dataclass
class Rollout:
    """One rollout's buffers, indexed [t, i] for step t of env i; on the learner's device, except `levels`."""

    obs: torch.Tensor  # (T, N, H, W, C) uint8
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor  # normalized with --norm-reward
    terminated: torch.Tensor  # the episode ended here, with no bootstrap
    dones: torch.Tensor  # the episode ended here (terminated or truncated)
    final_values: torch.Tensor  # V(final obs) where an episode was truncated (--bootstrap-truncation)
    logits: torch.Tensor  # (T, N, |A|) behaviour logits, for the policy-based scores
    levels: np.ndarray  # the level each step was played on


def make_rollout(num_steps, num_envs, obs_shape, num_actions, device) -> Rollout:
    shape = (num_steps, num_envs)
    return Rollout(
        obs=torch.zeros((*shape, *obs_shape), dtype=torch.uint8, device=device),
        actions=torch.zeros(shape, dtype=torch.long, device=device),
        logprobs=torch.zeros(shape, device=device),
        values=torch.zeros(shape, device=device),
        rewards=torch.zeros(shape, device=device),
        terminated=torch.zeros(shape, dtype=torch.bool, device=device),
        dones=torch.zeros(shape, dtype=torch.bool, device=device),
        final_values=torch.zeros(shape, device=device),
        logits=torch.zeros((*shape, num_actions), device=device),
        levels=np.zeros(shape, np.int64),
    )


# EVALUATION
def is_training_level(seed: int, args: Args, sampler: LevelSampler) -> bool:
    """Whether `seed` is a training level: in [start_level, start_level + num_train_levels), or in unbounded mode a level
    in the sampler's buffer."""
    if args.num_train_levels:
        return args.start_level <= seed < args.start_level + args.num_train_levels
    return seed in sampler.slot_of


def draw_eval_level(kind: str, args: Args, sampler: LevelSampler, rng: np.random.Generator) -> int:
    """One evaluation level. "train": uniform over the training levels (unbounded mode: the buffer's levels; while the
    buffer is empty, as for the uniform baseline, the full distribution it trains on). "test": uniform over the held-out
    levels, every seed in [0, MAX_SEED) that is not a training level."""
    if args.num_train_levels:
        train_pool = np.arange(args.start_level, args.start_level + args.num_train_levels)
    else:
        train_pool = sampler.seeds[sampler.seen]
    if kind == "train" and len(train_pool):
        return int(train_pool[rng.integers(len(train_pool))])
    seed = int(rng.integers(MAX_SEED))
    # a test level is never a training level: redraw (rare: the training levels are a tiny part of the seed space)
    while kind == "test" and is_training_level(seed, args, sampler):
        seed = int(rng.integers(MAX_SEED))
    return seed


def eval_level_sets(args: Args, sampler: LevelSampler, rng: np.random.Generator) -> dict:
    """The level sets of `evaluate`: {"train": fn, "test": fn}, each fn returning the next episode's level
    (`draw_eval_level` of its kind)."""
    return {kind: functools.partial(draw_eval_level, kind, args, sampler, rng) for kind in ("train", "test")}


def make_eval_rng(args: Args) -> np.random.Generator:
    """The RNG that draws the evaluation levels: a stream of its own (saved in checkpoints), apart from training's."""
    return np.random.default_rng(args.seed + 12345)


def make_eval_envs(args: Args):
    """The evaluation envs: one worker, seeded apart from the training envs."""
    return make_env(args, args.num_eval_envs, seed=args.seed + 1, num_workers=1)


def episodes_per_env(num_episodes: int, num_envs: int) -> list[int]:
    """How many episodes each evaluation env contributes: the first `num_episodes` in the order "every env's first
    episode (env 0, 1, ..., n-1), then every env's second, ...". Fixed before any episode is played, so the episodes
    counted never depend on their lengths (the first episodes to finish would favour short ones)."""
    return [num_episodes // num_envs + (1 if env < num_episodes % num_envs else 0) for env in range(num_envs)]


def evaluate(agent, envs, level_sets, num_episodes, args: Args, device) -> dict:
    """eval/* metrics over `num_episodes` stochastic-policy episodes per level set ({"train": next_level fn, "test":
    ...}): each env plays until it has finished its share (`episodes_per_env`), and its first episodes are counted.
    Oracles: tests/test_plr_evaluation.py::test_evaluation_is_unbiased_when_short_episodes_are_better,
    tests/test_plr_evaluation.py::test_evaluation_test_levels_are_held_out"""
    metrics = {}
    num_envs = envs.num_envs
    share = episodes_per_env(num_episodes, num_envs)
    for kind, next_level in level_sets.items():
        returns_per_env = [[] for _ in range(num_envs)]
        obs = envs.reset([next_level() for _ in range(num_envs)])
        while any(len(returns_per_env[env]) < share[env] for env in range(num_envs)):
            # a stop signal ends the evaluation between steps
            check_stop()
            with torch.no_grad():
                logits = agent(torch.as_tensor(obs, device=device))[0]
            actions = Categorical(logits=logits).sample().cpu().numpy()
            obs, _, _, _, info = envs.step(actions, next_level=lambda i: next_level())
            for i in np.flatnonzero(info["_episode"]):
                returns_per_env[i].append(float(info["episode_return"][i]))
        returns = np.array([ret for env in range(num_envs) for ret in returns_per_env[env][: share[env]]])
        metrics[f"eval/{kind}_return"] = float(returns.mean())
        if len(returns) > 1:
            metrics[f"eval/{kind}_return_se"] = float(returns.std(ddof=1) / np.sqrt(len(returns)))
        else:
            metrics[f"eval/{kind}_return_se"] = 0.0
        if is_procgen(args.env_id):
            from common.procgen_env import procgen_normalized_return

            # Cobbe et al. (2020) min-max normalization (None for the other distribution modes)
            normalized = procgen_normalized_return(args.env_id, args.distribution_mode, returns.mean())
            if normalized is not None:
                metrics[f"eval/{kind}_normalized_return"] = normalized
        else:
            # MiniGrid: a success is any positive return
            metrics[f"eval/{kind}_success"] = float((returns > 0).mean())
    metrics["eval/generalization_gap"] = metrics["eval/train_return"] - metrics["eval/test_return"]
    return metrics


class Evaluator:
    """The run's evaluations (periodic and final): the agent in eval mode on `eval_level_sets`' training and held-out
    levels. Its evaluation envs (one worker, for both level sets) are created at the first call; `close` closes them."""

    def __init__(self, args: Args, agent: nn.Module, sampler: LevelSampler, rng: np.random.Generator, device):
        self.args = args
        self.agent = agent
        self.sampler = sampler
        self.rng = rng
        self.device = device
        self.envs = None

    def __call__(self, num_episodes: int) -> dict:
        """eval/* metrics of `num_episodes` episodes per level set (`evaluate`)."""
        if self.envs is None:
            self.envs = make_eval_envs(self.args)
        self.agent.eval()
        level_sets = eval_level_sets(self.args, self.sampler, self.rng)
        metrics = evaluate(self.agent, self.envs, level_sets, num_episodes, self.args, self.device)
        self.agent.train()
        return metrics

    def final(self, logger, global_step: int) -> dict:
        """The final evaluation (--final-eval-episodes), logged as eval/final_*; returns it as summary.json's final_*."""
        final = self(self.args.final_eval_episodes)
        logger.log(global_step, {name.replace("eval/", "eval/final_"): value for name, value in final.items()})
        return {name.replace("eval/", "final_"): value for name, value in final.items()}

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()


# LOGGING: one update's metrics
class UpdateClock:
    """The clock metrics of each update: charts/SPS (the steps of this process's updates over their seconds),
    charts/collect_seconds (the rollout) and charts/plr_seconds (the sampler's share: the scores,
    `update_with_rollouts`, `after_update`)."""

    def __init__(self):
        self.steps = 0
        self.seconds = 0.0

    def start_update(self) -> None:
        self.update_start = time.time()
        self.plr_seconds = 0.0

    def end_collect(self) -> None:
        self.collect_seconds = time.time() - self.update_start

    @contextlib.contextmanager
    def plr_phase(self):
        """Times the sampler's work inside the `with` block (added to charts/plr_seconds)."""
        start = time.time()
        yield
        self.plr_seconds += time.time() - start

    def end_update(self, num_steps: int) -> dict:
        """charts/SPS, charts/collect_seconds and charts/plr_seconds of the update that ends now."""
        self.steps += num_steps
        self.seconds += time.time() - self.update_start
        return {
            "charts/SPS": int(self.steps / max(self.seconds, 1e-9)),
            "charts/collect_seconds": self.collect_seconds,
            "charts/plr_seconds": self.plr_seconds,
        }


class EpisodeStats:
    """The training episodes finished since the last log line: `add` the infos of every env step, `means` once per
    log line (charts/episodic_return, charts/episodic_length; raw rewards, as the env reports them)."""

    def __init__(self):
        self.episodes = []  # (return, length)

    def add(self, info: dict) -> None:
        ended = np.flatnonzero(info["_episode"])
        self.episodes += list(zip(info["episode_return"][ended], info["episode_length"][ended]))

    def means(self) -> dict:
        """The means since the last call (nothing if no episode finished), then start over."""
        metrics = {}
        if self.episodes:
            mean_return, mean_length = np.mean(self.episodes, axis=0).tolist()
            metrics["charts/episodic_return"] = mean_return
            metrics["charts/episodic_length"] = mean_length
        self.episodes = []
        return metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the batch (CleanRL's losses/explained_variance); NaN if the returns do not vary."""
    y_pred = values.cpu().numpy()
    y_true = returns.cpu().numpy()
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


def ppo_metrics(terms: PPOLoss, clipfracs: list[torch.Tensor], explained_var: float) -> dict:
    """losses/*, as CleanRL's ppo logs them: the loss terms of the update's last minibatch, the mean clip fraction
    over all its minibatches and the explained variance of the rollout's values."""
    return {
        "losses/value_loss": terms.value_loss.item(),
        "losses/policy_loss": terms.policy_loss.item(),
        "losses/entropy": terms.entropy.item(),
        "losses/approx_kl": terms.approx_kl.item(),
        "losses/clipfrac": torch.stack(clipfracs).mean().item(),
        "losses/explained_variance": explained_var,
    }


def replay_mass_by_difficulty(sampler: LevelSampler, difficulties: np.ndarray) -> dict:
    """Figure 4: plr/mass_<label>, the P_replay mass of the training levels of each difficulty."""
    replay_probs = sampler.replay_probs()
    return {f"plr/mass_{label}": float(replay_probs[difficulties == label].sum()) for label in np.unique(difficulties)}


def plr_metrics(sampler: LevelSampler, counts_before: tuple[int, int], difficulties: np.ndarray | None) -> dict:
    """plr/*: the sampler's state (`LevelSampler.stats`), the fraction of this update's levels that were replays
    (`counts_before`: `sampler.num_samples` and `sampler.num_replays` at the update's start) and Figure 4's masses."""
    samples_before, replays_before = counts_before
    num_new_samples = sampler.num_samples - samples_before
    metrics = sampler.stats()
    metrics["plr/replay_fraction"] = (sampler.num_replays - replays_before) / max(num_new_samples, 1)
    if difficulties is not None and sampler.num_seen:
        metrics |= replay_mass_by_difficulty(sampler, difficulties)
    return metrics


def log_update(logger, global_step: int, metrics: dict, sampler: LevelSampler, args: Args) -> None:
    """One update's log line: every metric to TensorBoard / metrics.jsonl, and the progress line."""
    logger.log(global_step, metrics)
    logger.progress(
        global_step,
        metrics["charts/SPS"],
        episodic_return=metrics.get("charts/episodic_return"),
        loss_name="value_loss",
        loss=metrics["losses/value_loss"],
        extra=f"seen={sampler.num_seen}" if args.plr_strategy != "random" else "",
    )


# RUN PLUMBING: per-domain defaults, the resume classes, validation, start-up checks
def domain_defaults(env_id: str) -> dict:
    """The per-domain defaults of `env_id` (DOMAIN_DEFAULTS), with |Λ_train| of the paper's MiniGrid envs."""
    if is_procgen(env_id):
        return dict(DOMAIN_DEFAULTS["procgen"])
    defaults = dict(DOMAIN_DEFAULTS["minigrid"])
    if env_id in MINIGRID_TRAIN_LEVELS:
        defaults["num_train_levels"] = MINIGRID_TRAIN_LEVELS[env_id]
    return defaults


def resolve_defaults(args: Args) -> Args:
    """Each per-domain flag left at None takes its domain's default (`domain_defaults`); a given value is kept."""
    for name, value in domain_defaults(args.env_id).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# the flags a resumed run may not change: the environment and its levels, the seed, the method, the envs and sampler sizes
FIXED_ON_RESUME = (
    "env_id",
    "distribution_mode",
    "num_train_levels",
    "start_level",
    "num_envs",
    "norm_reward",
    "bootstrap_truncation",
    "plr_strategy",
    "plr_transform",
    "plr_replay_schedule",
    "plr_commit",
    "plr_buffer_size",
)
# flags a resumed run applies from its resumed step on (each is changed and read back by a resume test)
APPLIED_ON_RESUME = (
    "total_timesteps",
    "num_steps",
    "num_minibatches",
    "update_epochs",
    "learning_rate",
    "adam_eps",
    "gamma",
    "gae_lambda",
    "clip_coef",
    "clip_vloss",
    "ent_coef",
    "vf_coef",
    "max_grad_norm",
    "norm_adv",
    "eval_every",
    "eval_episodes",
    "final_eval_episodes",
    "num_eval_envs",
    "plr_temperature",
    "plr_staleness_coef",
    "plr_replay_prob",
    "plr_min_fill",
    "plr_score_alpha",
)
# how the run is executed and reported, never what it learns
RUN_ONLY_ON_RESUME = ("num_workers",)


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags (after resolve_defaults); one line `error: ...` on a violation."""
    require(args.total_timesteps >= 1, f"--total-timesteps must be >= 1, got {args.total_timesteps!r}")
    require(args.num_train_levels >= 0, f"--num-train-levels must be >= 0, got {args.num_train_levels!r}")
    require(args.start_level >= 0, f"--start-level must be >= 0, got {args.start_level!r}")
    require(args.num_envs >= 1, f"--num-envs must be >= 1, got {args.num_envs!r}")
    require(args.num_steps >= 1, f"--num-steps must be >= 1, got {args.num_steps!r}")
    require(args.num_minibatches >= 1, f"--num-minibatches must be >= 1, got {args.num_minibatches!r}")
    require(args.update_epochs >= 1, f"--update-epochs must be >= 1, got {args.update_epochs!r}")
    require(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate!r}")
    require(args.adam_eps > 0, f"--adam-eps must be > 0, got {args.adam_eps!r}")
    require(0 < args.gamma <= 1, f"--gamma must be in (0, 1], got {args.gamma!r}")
    require(0 <= args.gae_lambda <= 1, f"--gae-lambda must be in [0, 1], got {args.gae_lambda!r}")
    require(args.clip_coef > 0, f"--clip-coef must be > 0, got {args.clip_coef!r}")
    require(args.ent_coef >= 0, f"--ent-coef must be >= 0, got {args.ent_coef!r}")
    require(args.vf_coef >= 0, f"--vf-coef must be >= 0, got {args.vf_coef!r}")
    require(args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm!r}")
    require(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers!r}")
    require(args.eval_every >= 0, f"--eval-every must be >= 0, got {args.eval_every!r}")
    require(args.eval_episodes >= 0, f"--eval-episodes must be >= 0, got {args.eval_episodes!r}")
    require(args.final_eval_episodes >= 0, f"--final-eval-episodes must be >= 0, got {args.final_eval_episodes!r}")
    require(args.num_eval_envs >= 1, f"--num-eval-envs must be >= 1, got {args.num_eval_envs!r}")
    require(args.plr_temperature > 0, f"--plr-temperature must be > 0, got {args.plr_temperature!r}")
    require(0 <= args.plr_staleness_coef <= 1, f"--plr-staleness-coef must be in [0, 1], got {args.plr_staleness_coef!r}")
    require(0 <= args.plr_replay_prob <= 1, f"--plr-replay-prob must be in [0, 1], got {args.plr_replay_prob!r}")
    require(0 <= args.plr_min_fill <= 1, f"--plr-min-fill must be in [0, 1], got {args.plr_min_fill!r}")
    require(0 < args.plr_score_alpha <= 1, f"--plr-score-alpha must be in (0, 1], got {args.plr_score_alpha!r}")
    require(args.plr_buffer_size >= 1, f"--plr-buffer-size must be >= 1, got {args.plr_buffer_size!r}")
    from common.procgen_env import PROCGEN_DISTRIBUTION_MODES, PROCGEN_GAMES

    if args.env_id not in PROCGEN_GAMES:
        try:
            resolve_minigrid_id(args.env_id)
        except ValueError as e:
            raise SystemExit(f"error: --env-id: {e}; or a Procgen game: {', '.join(PROCGEN_GAMES)}") from None
    require(
        not is_procgen(args.env_id) or args.distribution_mode in PROCGEN_DISTRIBUTION_MODES,
        f"--distribution-mode must be one of {', '.join(PROCGEN_DISTRIBUTION_MODES)}, got {args.distribution_mode!r}",
    )
    require(
        args.start_level + args.num_train_levels <= MAX_SEED,
        f"--start-level + --num-train-levels must stay within level seeds [0, {MAX_SEED}]",
    )
    require(
        args.num_train_levels != 0 or args.plr_replay_schedule == "fixed" or args.plr_strategy == "random",
        "unbounded mode (--num-train-levels 0) needs --plr-replay-schedule fixed (App. B.3's Bernoulli P_D)",
    )
    batch_size = args.num_envs * args.num_steps
    require(
        batch_size % args.num_minibatches == 0,
        f"--num-envs x --num-steps ({batch_size}) must be divisible by --num-minibatches",
    )
    require(not args.capture_video, "--capture-video is not supported by plr_ppo.py (the vector adapters expose no frames)")


def observation_and_action_sizes(args: Args) -> tuple[tuple[int, ...], int]:
    """The env's observation shape and number of actions, without starting its envs (for the start-up checks)."""
    if is_procgen(args.env_id):
        # every Procgen game: 64x64 RGB frames, 15 actions
        return (64, 64, 3), 15
    from common.minigrid_env import make_minigrid_env

    probe = make_minigrid_env(args.env_id, fully_observable=True)
    sizes = (probe.observation_space.shape, int(probe.action_space.n))
    probe.close()
    return sizes


def check_rollout_memory(args: Args) -> None:
    """Refuse at start-up, with one `error:` line before the run folder, a rollout that does not fit in memory: the
    `make_rollout` buffers for --num-envs x --num-steps (on a CUDA learner: in GPU memory), and in RAM the batch-sized
    copies of the update (about 8 numbers per step for GAE and the scores, 3 logits-sized arrays for the policy-based
    scores) and the float copy of one minibatch's observations."""
    from common.processes import check_memory

    obs_shape, num_actions = observation_and_action_sizes(args)
    num_samples = args.num_envs * args.num_steps
    one_step = make_rollout(1, 1, obs_shape, num_actions, device="meta")
    buffer_bytes = [value.element_size() * value.numel() for value in vars(one_step).values() if torch.is_tensor(value)]
    rollout_bytes = num_samples * sum(buffer_bytes)
    host_bytes = num_samples * (one_step.levels.nbytes + 8 * 8 + 3 * 4 * num_actions)
    host_bytes += num_samples // args.num_minibatches * int(np.prod(obs_shape)) * 5
    device = select_device(args.cuda)
    if device.type == "cuda":
        free_bytes = torch.cuda.mem_get_info(device)[0]
        require(
            rollout_bytes <= 0.9 * free_bytes,
            f"the rollout needs {rollout_bytes / 2**30:.2f} GiB of GPU memory, more than 90% of the "
            f"{free_bytes / 2**30:.1f} GiB free: lower --num-steps or --num-envs",
        )
    else:
        host_bytes += rollout_bytes
    check_memory(host_bytes, "--num-steps or --num-envs", what="rollout")


def training_level_difficulties(args: Args) -> np.ndarray | None:
    """Figure 4: a difficulty label per training level (MultiRoom: rooms, ObstructedMazeGamut: variant), None for other
    envs and in unbounded mode. Builds each level (4,000 MultiRoom levels: seconds), so it checks for a stop at each."""
    if not args.num_train_levels or not ("MultiRoom" in args.env_id or "ObstructedMazeGamut" in args.env_id):
        return None
    labels = []
    for level in range(args.start_level, args.start_level + args.num_train_levels):
        check_stop()
        labels.append(level_difficulty(args.env_id, level))
    return np.array(labels)


def set_optimizer_settings(optimizer: torch.optim.Optimizer, args: Args) -> None:
    """Adam's settings from the flags. On --resume, `load_state_dict` restores the checkpoint's lr and eps with the
    moments; --learning-rate and --adam-eps are applied flags (APPLIED_ON_RESUME), so this run's values go back in."""
    for group in optimizer.param_groups:
        group["lr"] = args.learning_rate
        group["eps"] = args.adam_eps


if __name__ == "__main__":
    # --resume: the checkpoint's flags, overridden by the flags given on this command line
    args, ckpt, overridden = parse_run_args(Args, "plr_ppo.py", FIXED_ON_RESUME, APPLIED_ON_RESUME, RUN_ONLY_ON_RESUME)
    args = resolve_defaults(args)
    # every check before anything heavy starts and before RunLogger
    validate_args(args)
    check_rollout_memory(args)
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    start_step = ckpt["global_step"] if ckpt else 0
    # the run ends at the budget's last whole batch
    end_step = start_step + (args.total_timesteps - start_step) // batch_size * batch_size
    if end_step <= start_step:
        raise SystemExit(
            f"error: --total-timesteps {args.total_timesteps:,} leaves less than one PPO batch after step "
            f"{start_step:,} (--num-envs x --num-steps = {batch_size:,} steps)"
        )
    if end_step != args.total_timesteps:
        print(
            f"budget: --total-timesteps {args.total_timesteps:,} is not a multiple of one PPO batch ({batch_size:,} "
            f"steps): the run ends at step {end_step:,}",
            flush=True,
        )
    # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's run directory
    logger = start_run(args, ckpt, args.env_id)

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)

    # SETUP: envs, network, optimizer, level sampler
    envs = make_env(args, args.num_envs, seed=args.seed)
    # Torch threads. Acting: one thread. A forward pass on N small observations is too small to split, and a second
    # thread waits for a core held by an env worker or another run (10-40x slower per step on 2 busy cores). Learning:
    # the cores that the MiniGrid env workers leave, at least 1 (on 2 busy cores, a whole run was 3.5x faster with 1
    # thread than with 2); Procgen steps its envs in native threads inside envs.step, so the learner learns on every core.
    env_workers = envs.num_workers if isinstance(envs, MiniGridVecEnv) else 0
    learn_threads = set_learner_threads(env_workers)
    torch.set_num_threads(1)
    obs_shape = envs.single_observation_space.shape
    num_actions = int(envs.single_action_space.n)
    agent = make_agent(args, obs_shape, num_actions).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    sampler = make_sampler(args, seed=args.seed)
    normalizer = ReturnNormalizer(args.num_envs, args.gamma) if args.norm_reward else None
    eval_rng = make_eval_rng(args)

    global_step = start_step
    update = ckpt["update"] if ckpt else 0
    if ckpt:
        load_state_dicts(ckpt, model=agent, optimizer=optimizer, sampler=sampler, normalizer=normalizer)
        set_optimizer_settings(optimizer, args)
        eval_rng.bit_generator.state = ckpt["eval_rng"]
        set_rng_state(ckpt["rng"])
        # env states are not saved: each env restarts its level from the first frame
        next_obs = envs.reset([int(level) for level in ckpt["env_levels"]])
        # the saved partial scores S~ and discounted returns so far belong to frames that are lost: drop them
        sampler.restart_episodes()
        if normalizer is not None:
            normalizer.restart_episodes()
        print(
            f"resumed {args.resume} at step {global_step:,} ({update:,} updates, {sampler.num_seen:,} levels seen); each "
            f"env restarts its level; flags from this command line: {', '.join(overridden) or 'none'}; runs to step "
            f"{end_step:,}",
            flush=True,
        )
    else:
        next_obs = envs.reset([sampler.sample(i) for i in range(args.num_envs)])

    rollout = make_rollout(args.num_steps, args.num_envs, obs_shape, num_actions, device)
    evaluator = Evaluator(args, agent, sampler, eval_rng, device)
    clock = UpdateClock()
    episode_stats = EpisodeStats()

    def make_checkpoint():
        save_run_checkpoint(
            logger,
            "plr_ppo.py",
            args,
            global_step,
            update=update,
            eval_rng=eval_rng.bit_generator.state,
            env_levels=np.array(envs.levels, np.int64),
            **state_dicts(model=agent, optimizer=optimizer, sampler=sampler, normalizer=normalizer),
        )

    checkpoints = CheckpointSchedule(global_step, args.checkpoint_every)
    error = None
    try:
        # Figure 4's difficulty labels (seconds of start-up: a stop signal ends it here)
        difficulties = training_level_difficulties(args)
        while global_step < end_step:
            clock.start_update()
            sampler_counts = (sampler.num_samples, sampler.num_replays)
            # COLLECT: T steps on N envs; each new episode starts on the level the sampler returns
            for step in range(args.num_steps):
                # a stop signal (recorded by its handler) stops the run here, between env steps
                check_stop()
                obs = torch.as_tensor(next_obs, device=device)
                rollout.obs[step] = obs
                with torch.no_grad():
                    logits, value = agent(obs)
                dist = Categorical(logits=logits)
                action = dist.sample()
                rollout.actions[step] = action
                rollout.logprobs[step] = dist.log_prob(action)
                rollout.values[step] = value
                rollout.logits[step] = logits
                next_obs, reward, terminated, truncated, info = envs.step(action.cpu().numpy(), next_level=sampler.sample)
                done = terminated | truncated
                if not args.bootstrap_truncation:
                    # the time limit is part of the task (MiniGrid's default): no bootstrap
                    terminated = done
                    truncated = np.zeros_like(done)
                rollout.levels[step] = info["level_seed"]
                if normalizer is not None:
                    reward = normalizer(reward, done)
                rollout.rewards[step] = torch.as_tensor(reward, device=device)
                rollout.terminated[step] = torch.as_tensor(terminated, device=device)
                rollout.dones[step] = torch.as_tensor(done, device=device)
                if truncated.any():
                    # --bootstrap-truncation: a truncated episode bootstraps from V(s_final)
                    truncated_envs = np.flatnonzero(truncated)
                    final_obs = torch.as_tensor(info["final_obs"][truncated_envs], device=device)
                    with torch.no_grad():
                        final_values = agent(final_obs)[1]
                    rollout.final_values[step, torch.as_tensor(truncated_envs, device=device)] = final_values
                episode_stats.add(info)
            global_step += batch_size
            clock.end_collect()

            # LEARN: GAE, PLR scores with the behaviour policy, PPO update, then PLR's after-update commit
            with torch.no_grad():
                next_value = agent(torch.as_tensor(next_obs, device=device))[1]
            advantages, deltas = compute_gae(
                rollout.rewards,
                rollout.values,
                next_value,
                rollout.terminated,
                rollout.dones,
                rollout.final_values,
                args.gamma,
                args.gae_lambda,
            )
            returns = advantages + rollout.values
            with clock.plr_phase():
                if args.plr_strategy != "random":
                    # Algorithm 4: episode scores, stitched across rollouts
                    scores = step_scores(
                        args.plr_strategy, advantages.cpu().numpy(), deltas.cpu().numpy(), rollout.logits.cpu().numpy()
                    )
                    sampler.update_with_rollouts(scores, rollout.dones.cpu().numpy(), rollout.levels)

            b_obs = rollout.obs.reshape(-1, *obs_shape)
            b_actions = rollout.actions.reshape(-1)
            b_logprobs = rollout.logprobs.reshape(-1)
            b_adv = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = rollout.values.reshape(-1)
            if args.norm_adv:
                b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-5)
            clipfracs = []
            torch.set_num_threads(learn_threads)
            for epoch in range(args.update_epochs):
                permutation = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    mb = permutation[start : start + minibatch_size]
                    terms = ppo_loss(
                        agent, b_obs[mb], b_actions[mb], b_logprobs[mb], b_adv[mb], b_returns[mb], b_values[mb], args
                    )
                    optimizer.zero_grad()
                    terms.loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    clipfracs.append(terms.clipfrac)
            torch.set_num_threads(1)
            with clock.plr_phase():
                sampler.after_update()
            update += 1

            # LOG
            metrics = clock.end_update(batch_size) | {"charts/learning_rate": optimizer.param_groups[0]["lr"]}
            metrics |= ppo_metrics(terms, clipfracs, explained_variance(b_values, b_returns))
            metrics |= episode_stats.means()
            if args.plr_strategy != "random":
                metrics |= plr_metrics(sampler, sampler_counts, difficulties)
            if args.eval_every and update % args.eval_every == 0 and args.eval_episodes:
                metrics |= evaluator(args.eval_episodes)
            log_update(logger, global_step, metrics, sampler, args)

            # CHECKPOINT
            if checkpoints.due(global_step):
                make_checkpoint()
    except (KeyboardInterrupt, StopRun) as e:
        # StopRun: a dead MiniGrid env worker or an unwritable checkpoint
        error = e
    finally:
        envs.close()
    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    if error is None and args.checkpoint_every:
        make_checkpoint()

    summary = {"global_step": global_step, "updates": update}
    if args.plr_strategy != "random":
        summary |= {name.replace("plr/", "plr_"): value for name, value in sampler.stats().items()}
    model_file = {"model": agent.state_dict(), "args": vars(args)}
    final_eval = functools.partial(evaluator.final, logger, global_step) if args.final_eval_episodes else None
    try:
        finish_run(logger, error, summary, model_file if args.save_model else None, final_eval)
    finally:
        evaluator.close()

# docs and results: README.md#plr_ppopy-prioritized-level-replay-on-ppo
"""Prioritized Level Replay on PPO (Jiang, Grefenstette, Rocktäschel 2021, https://arxiv.org/abs/2010.03934).

Paper parts implemented here (Procgen and MiniGrid)
- Level scores (Sec. 3.1, Table 1) `step_scores`, averaged per episode by `LevelSampler.update_with_rollouts`:
  value_l1 (Eq. (2), default), gae, one_step_td, policy_entropy, least_confidence, min_margin; `random` = uniform.
- P_S (Eq. (3); rank / power / greedy) `score_distribution`; P_C (Eq. (4)) `staleness_distribution`;
  P_replay = (1-ρ) P_S + ρ P_C (Eq. (1)) `replay_distribution`.
- Replay decision P_D and P_new (Alg. 2 / 4) `LevelSampler.sample`: proportionate |Λ_seen|/|Λ_train| or fixed;
  unbounded level distribution with a top-M level buffer (App. B.3) in `LevelSampler`; a new level is staged until
  its first score as in facebookresearch/dcd's sampler (the authors' later code: level-replay has no unbounded mode).
- Partial-episode scores stitched across rollouts (Alg. 3 / 4) `update_with_rollouts` (`--plr-commit episode`), or
  committed after every update as the authors' code (`--plr-commit update`, `after_update`).
- PPO with GAE `compute_gae`, `ppo_loss`; return normalization (Table 3) `common.normalize.ReturnNormalizer`;
  networks: IMPALA ResNet (Procgen) `ImpalaAgent`, the authors' MinigridPolicy `MiniGridAgent`.

Defaults (Table 3, Sec. 4, App. A.2): Procgen 64 envs x 256 steps, 3 epochs, 8 minibatches, lr 5e-4, Adam eps 1e-5,
γ 0.999, λ 0.95, clip 0.2, entropy 0.01, value 0.5, 25M steps, 200 easy levels; MiniGrid lr 7e-4, 4 epochs, 4000 / 3000 /
6000 levels. PLR: value_l1, rank, β 0.1, ρ 0.1 (Procgen) / 0.3 (MiniGrid), P_D proportionate (Sec. 3); unbounded mode
fixed replay p 0.95 and M 4000 (App. B.3). Authors' code: grad clip 0.5, clipped value loss, batch advantage normalization.

Differences from the paper (long form: README.md, section plr_ppo.py)
- A level enters Λ_seen at its first committed score (authors' code), not when sampled (Alg. 2): no replay of an
  unscored level. Ranks among seen levels only, ties by index; P_C / P_S fall back to uniform over Λ_seen.
- one_step_td keeps γ and the last step (the authors' code drops them); entropy and min-margin as the authors' code.
- Time limits: MiniGrid's is a termination (authors' code), Procgen's bootstraps from V(final obs)
  (`--bootstrap-truncation`); Procgen episodes end one step before the game's limit.
- Return normalization uses args.gamma (authors: 0.99); evaluation samples from the policy, test levels exclude the
  training levels; `--resume` restarts the current levels from their first frame and drops their partial scores.
Vector envs autoreset SAME_STEP (`next_level(i)`, `info["final_obs"]`). Copying this file: it needs
common/{procgen_env,minigrid_env,normalize,logger,checkpoint,args,processes}.py.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
from torch.distributions import Categorical

from common.args import CommonArgs, parse_run_args, require
from common.checkpoint import (
    load_state_dicts,
    rng_state,
    save_checkpoint,
    seed_everything,
    select_device,
    set_rng_state,
    state_dicts,
)
from common.logger import start_run
from common.minigrid_env import MiniGridVecEnv, level_difficulty, resolve_minigrid_id
from common.normalize import ReturnNormalizer
from common.processes import StopRun, check_stop, finish_run, set_learner_threads, stop_on_signals

MAX_SEED = 2**31 - 1

# |Λ_train| per MiniGrid env (paper App. A.2: about 1000 levels per difficulty)
MINIGRID_TRAIN_LEVELS = {"MultiRoom-N4-Random": 4000, "ObstructedMazeGamut-Easy": 3000, "ObstructedMazeGamut-Medium": 6000}


@dataclass
class Args(CommonArgs):  # CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
    # --- algorithm specific arguments ---
    env_id: str = "bigfish"
    """a Procgen game (bigfish, ...), MultiRoom-N4-Random, ObstructedMazeGamut-Easy/-Medium or a registered MiniGrid id"""
    total_timesteps: int = 25_000_000
    """total environment steps (paper: 25M Procgen)"""
    distribution_mode: str = "easy"
    """Procgen distribution mode (paper: easy)"""
    num_train_levels: int = -1
    """|Λ_train| (seeds start_level, ...); -1 = the paper's (App. A: 200 Procgen, 4000 / 3000 / 6000 MultiRoom-N4-Random /
    ObstructedMazeGamut-Easy / -Medium, else 1000); 0 = the full distribution with a top-M buffer (App. B.3)"""
    start_level: int = 0
    """first training level seed"""
    num_envs: int = 64
    """N_b parallel environments (Table 3: 64 workers)"""
    num_steps: int = 256
    """T, rollout length per environment (Table 3)"""
    num_minibatches: int = 8
    """PPO minibatches per epoch (Table 3)"""
    update_epochs: int = -1
    """PPO epochs; -1 = Table 3 (3 Procgen, 4 MiniGrid)"""
    learning_rate: float = -1.0
    """Adam learning rate; -1 = Table 3 (5e-4 Procgen, 7e-4 MiniGrid)"""
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
    """MiniGrid worker processes (0 = one per CPU core)"""
    bootstrap_truncation: bool | None = None
    """on a time-limit truncation, bootstrap from V(final obs) (True) or treat it as a termination (False); None =
    per domain: False on MiniGrid (authors' code: the limit is part of the task), True on Procgen"""
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
    plr_staleness_coef: float = -1.0
    """ρ, staleness mixing of Eq. (1) in [0, 1]; -1 = Table 3 (0.1 Procgen, 0.3 MiniGrid)"""
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


def resolve_defaults(args: Args) -> Args:
    """Fill the -1 / None sentinels with the paper's per-domain values (Table 3, App. A.2)."""
    procgen = is_procgen(args.env_id)
    paper = {
        "num_train_levels": 200 if procgen else MINIGRID_TRAIN_LEVELS.get(args.env_id, 1000),
        "update_epochs": 3 if procgen else 4,
        "learning_rate": 5e-4 if procgen else 7e-4,
        "plr_staleness_coef": 0.1 if procgen else 0.3,
        "bootstrap_truncation": procgen,
    }
    for name, value in paper.items():
        if getattr(args, name) is None or getattr(args, name) == -1:
            setattr(args, name, value)
    return args


# the flags a resumed run may not change (environment and its levels, seed, method; sampler and envs per env), rules
FIXED_ON_RESUME = (
    "env_id",
    "seed",
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
    for bad, msg in (
        (
            is_procgen(args.env_id) and args.distribution_mode not in PROCGEN_DISTRIBUTION_MODES,
            f"--distribution-mode must be one of {', '.join(PROCGEN_DISTRIBUTION_MODES)}, got {args.distribution_mode!r}",
        ),
        (
            args.start_level + args.num_train_levels > MAX_SEED,
            f"--start-level + --num-train-levels must stay within level seeds [0, {MAX_SEED}]",
        ),
        (
            args.num_train_levels == 0 and args.plr_replay_schedule != "fixed" and args.plr_strategy != "random",
            "unbounded mode (--num-train-levels 0) needs --plr-replay-schedule fixed (App. B.3's Bernoulli P_D)",
        ),
        (
            (args.num_envs * args.num_steps) % args.num_minibatches,
            f"--num-envs x --num-steps ({args.num_envs * args.num_steps}) must be divisible by --num-minibatches",
        ),
        (args.capture_video, "--capture-video is not supported by plr_ppo.py (the vector adapters expose no frames)"),
    ):
        if bad:
            raise SystemExit(f"error: {msg}")


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
    nn.init.orthogonal_(layer.weight, std), nn.init.zeros_(layer.bias)
    return layer


class ResidualBlock(nn.Module):  # standard pre-activation block (the authors' in-place ReLU changes the skip)
    def __init__(self, channels):
        super().__init__()
        self.conv0, self.conv1 = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaAgent(nn.Module):
    """IMPALA ResNet 16/32/32 + 256 hidden (Espeholt et al. 2018; Cobbe et al. 2020; PLR App. A.1): per stage a conv,
    a 3x3 stride-2 max-pool and two residual blocks."""

    def __init__(self, obs_shape, num_actions, hidden=256):
        super().__init__()
        h, w, c = obs_shape
        stages = []
        for out in (16, 32, 32):
            stages += [nn.Conv2d(c, out, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), ResidualBlock(out), ResidualBlock(out)]
            c, h, w = out, (h + 1) // 2, (w + 1) // 2
        self.trunk = nn.Sequential(*stages, nn.Flatten(), nn.ReLU(), nn.Linear(c * h * w, hidden), nn.ReLU())
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs):  # obs uint8 (B, H, W, C)
        z = self.trunk(obs.permute(0, 3, 1, 2).float() / 255.0)
        return self.actor(z), self.critic(z).squeeze(-1)


class MiniGridAgent(nn.Module):
    """The authors' MinigridPolicy (level_replay/model.py; PLR App. A.2): conv 2x2 16, max-pool 2x2, conv 2x2 32,
    conv 2x2 32 (64 for ObstructedMazeGamut), then separate 64-unit tanh actor and critic layers. Inputs are
    MiniGrid's integer cell encodings as floats (unscaled, as theirs). Init as theirs: Xavier-uniform convs,
    orthogonal linears (gain sqrt 2; policy head 0.01, value head 1), zero biases."""

    def __init__(self, obs_shape, num_actions, final_channels=32, hidden=64):
        super().__init__()
        h, w, c = obs_shape
        self.trunk = nn.Sequential(
            nn.Conv2d(c, 16, 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 2),
            nn.ReLU(),
            nn.Conv2d(32, final_channels, 2),
            nn.ReLU(),
            nn.Flatten(),
        )
        for conv in (m for m in self.trunk if isinstance(m, nn.Conv2d)):
            nn.init.xavier_uniform_(conv.weight), nn.init.zeros_(conv.bias)
        n = final_channels * ((h - 1) // 2 - 2) * ((w - 1) // 2 - 2)
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, num_actions), std=0.01)
        )  # theirs: Categorical head
        self.critic = nn.Sequential(layer_init(nn.Linear(n, hidden)), nn.Tanh(), layer_init(nn.Linear(hidden, 1), std=1.0))

    def forward(self, obs):
        z = self.trunk(obs.permute(0, 3, 1, 2).float())
        return self.actor(z), self.critic(z).squeeze(-1)


def make_agent(args: Args, obs_shape, num_actions) -> nn.Module:
    if is_procgen(args.env_id):
        return ImpalaAgent(obs_shape, num_actions)
    return MiniGridAgent(obs_shape, num_actions, final_channels=64 if "ObstructedMaze" in args.env_id else 32)


# ALGORITHM PIECES: PPO
def compute_gae(rewards, values, next_value, terminated, dones, final_values, gamma, gae_lambda):
    """GAE over a T-step rollout of (T, N) tensors. dones[t]: the episode ended at t (terminated or truncated);
    terminated[t]: true termination (no bootstrap); final_values[t]: V(s_final) of an episode truncated at t (ignored
    elsewhere); next_value: V(s_T) after the rollout. Returns (advantages, deltas) with
    δ_t = r_t + γ V(s_{t+1}) (1 - terminal_t) - V(s_t) (PLR Sec. 3.1) and A_t = Σ_k (γλ)^{k-t} δ_k within the episode
    (Eq. (2) without the absolute value)."""
    next_values = torch.cat([values[1:], next_value[None]], 0)
    # at an episode end the next obs belongs to a new episode: bootstrap from the true final obs (truncation) or 0
    boot = torch.where(dones, final_values, next_values) * (1.0 - terminated.to(rewards.dtype))
    deltas = rewards + gamma * boot - values
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        last = deltas[t] + gamma * gae_lambda * (1.0 - dones[t].to(rewards.dtype)) * last  # Eq. (2) recursion
        advantages[t] = last
    return advantages, deltas


def ppo_loss(agent, obs, actions, old_logprobs, advantages, returns, old_values, args: Args):
    """Clipped surrogate objective, (clipped) value loss and entropy bonus (Schulman et al. 2017)."""
    logits, values = agent(obs)
    dist = Categorical(logits=logits)
    logratio = dist.log_prob(actions) - old_logprobs
    ratio = logratio.exp()
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
    if args.clip_vloss:
        v_clipped = old_values + torch.clamp(values - old_values, -args.clip_coef, args.clip_coef)
        v_loss = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((values - returns) ** 2).mean()
    entropy = dist.entropy().mean()
    loss = pg_loss - args.ent_coef * entropy + args.vf_coef * v_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
    return loss, pg_loss, v_loss, entropy, approx_kl, clipfrac


# ALGORITHM PIECES: PLR
def step_scores(strategy, advantages, deltas, logits=None):
    """Per-step quantity whose episode mean is score(τ, π) (Table 1); numpy (T, N) out.
    advantages, deltas: (T, N) GAE and one-step TD errors; logits: (T, N, |A|) of the behaviour policy."""
    if strategy == "value_l1":
        return np.abs(advantages)  # Eq. (2): |Σ_k (γλ)^{k-t} δ_k|
    if strategy == "gae":
        return np.asarray(advantages)
    if strategy == "one_step_td":
        return np.abs(deltas)  # |δ_t|
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    p = np.exp(logp)
    if strategy == "policy_entropy":  # -Σ_a π log π, normalized by log|A| (authors' code)
        return -(p * logp).sum(-1) / np.log(p.shape[-1])
    if strategy == "least_confidence":
        return 1.0 - p.max(-1)
    if strategy == "min_margin":  # 1 - (p_(1) - p_(2)), higher = less confident (authors' code)
        top2 = np.sort(p, axis=-1)[..., -2:]
        return 1.0 - (top2[..., 1] - top2[..., 0])
    raise ValueError(f"no per-step score for strategy {strategy!r}")


def score_distribution(scores, seen, transform="rank", temperature=0.1):
    """Eq. (3): P_S(l_i) = h(S_i)^(1/β) / Σ_j h(S_j)^(1/β) over seen levels, 0 for unseen. rank: h = 1/rank(S_i), rank
    among seen levels in descending order (1 = highest; ties by index); power: h = max(S_i, 0) (proportional); greedy:
    all mass on the highest score. In log space so that β -> 0 stays finite; uniform over seen levels if all weights are 0."""
    seen = np.asarray(seen, dtype=bool)
    p = np.zeros(len(seen))
    idx = np.flatnonzero(seen)
    if idx.size == 0:
        return p
    s = np.asarray(scores, dtype=np.float64)[idx]
    if transform == "greedy":
        p[idx[np.argmax(s)]] = 1.0
        return p
    if transform == "rank":
        ranks = np.empty(idx.size)
        ranks[np.argsort(-s, kind="stable")] = np.arange(1, idx.size + 1)
        log_h = -np.log(ranks)
    elif transform == "power":
        with np.errstate(divide="ignore"):
            log_h = np.log(np.clip(s, 0.0, None))
    else:
        raise ValueError(f"unknown transform {transform!r}")
    top = log_h.max()
    if not np.isfinite(top):
        p[idx] = 1.0 / idx.size
        return p
    w = np.exp((log_h - top) / temperature)
    p[idx] = w / w.sum()
    return p


def staleness_distribution(staleness, seen):
    """Eq. (4): P_C(l_i) = (c - C_i) / Σ_j (c - C_j) over seen levels; uniform over seen if all are 0."""
    seen = np.asarray(seen, dtype=bool)
    st = np.where(seen, np.asarray(staleness, dtype=np.float64), 0.0)
    z = st.sum()
    if z > 0:
        return st / z
    n = seen.sum()
    return seen / n if n else np.zeros(len(seen))


def replay_distribution(scores, staleness, seen, transform="rank", temperature=0.1, staleness_coef=0.1, p_s=None):
    """Eq. (1): P_replay = (1 - ρ) P_S + ρ P_C over all levels (0 for unseen; all 0 if nothing is seen).
    scores S, staleness c - C, seen: arrays over levels; transform: rank | power | greedy; temperature: β; ρ;
    p_s: P_S if already computed (then scores, transform and temperature are unused)."""
    p_s = score_distribution(scores, seen, transform, temperature) if p_s is None else p_s
    if staleness_coef == 0.0:
        return p_s
    return (1.0 - staleness_coef) * p_s + staleness_coef * staleness_distribution(staleness, seen)


class LevelSampler:
    """PLR's level sampler: scores S, staleness c - C, seen set Λ_seen, per-actor partial scores S~ (Algorithm 4).

    Bounded mode (`levels` given): one slot per training level. Unbounded mode (`levels=None`): M slots holding the
    top-M levels (App. B.3); new levels are random seeds in [0, 2^31-1) staged until their first episode ends (as
    facebookresearch/dcd's sampler; the authors' level-replay sampler has no unbounded mode).
    Per update: `sample` (inside env.step, at each episode end) ... `update_with_rollouts` -> PPO update -> `after_update`."""

    def __init__(
        self,
        levels,
        num_actors,
        *,
        strategy="value_l1",
        transform="rank",
        temperature=0.1,
        staleness_coef=0.1,
        replay_schedule="proportionate",
        replay_prob=0.95,
        min_fill=0.0,
        score_alpha=1.0,
        commit="episode",
        buffer_size=0,
        seed=0,
    ):
        self.unbounded = levels is None
        self.strategy, self.transform, self.temperature = strategy, transform, temperature
        self.staleness_coef, self.replay_schedule, self.replay_prob = staleness_coef, replay_schedule, replay_prob
        self.min_fill, self.score_alpha, self.commit = min_fill, score_alpha, commit
        size = buffer_size if self.unbounded else len(levels)
        self.seeds = np.full(size, -1, np.int64) if self.unbounded else np.asarray(levels, np.int64).copy()
        self.slot_of = {} if self.unbounded else {int(s): i for i, s in enumerate(self.seeds)}
        self.scores, self.staleness = np.zeros(size), np.zeros(size)  # S, c - C
        self.seen = np.zeros(size, bool)  # Λ_seen: levels with a committed score (unbounded: filled buffer slots)
        self.partial_score = np.zeros(num_actors)  # S~: time-averaged score of the unfinished episode
        self.partial_steps = np.zeros(num_actors, np.int64)  # |τ| of that partial episode
        self.partial_level = np.full(num_actors, -1, np.int64)
        self.staged = {}  # unbounded: seed -> c when sampled, for levels not yet in the buffer
        self.num_samples = self.num_replays = self.num_seen = 0  # num_samples: c
        self.rng = np.random.default_rng(seed)
        self._p_s = None  # cached P_S (scores change only in update_with_rollouts / after_update)

    # --- distributions ---
    def replay_probs(self) -> np.ndarray:
        """P_replay over slots (Eq. (1)): `replay_distribution` with P_S cached until the scores change."""
        if self._p_s is None:
            self._p_s = score_distribution(self.scores, self.seen, self.transform, self.temperature)
        return replay_distribution(None, self.staleness, self.seen, staleness_coef=self.staleness_coef, p_s=self._p_s)

    def replay_decision_prob(self) -> float:
        """P_D(d = 1), the probability that the next level is a replay."""
        frac = self.num_seen / len(self.seeds)
        if self.num_seen == 0 or frac < self.min_fill:
            return 0.0
        if not self.unbounded and frac == 1.0:
            return 1.0  # Algorithm 2: no unseen level left
        return frac if self.replay_schedule == "proportionate" else self.replay_prob

    # --- sampleNextLevel (Algorithm 4) ---
    def _draw_unseen(self) -> int:
        """P_new: uniform over Λ_train \\ Λ_seen (bounded), or a random seed not in the buffer (unbounded)."""
        if not self.unbounded:
            return int(self.rng.choice(np.flatnonzero(~self.seen)))
        while True:
            s = int(self.rng.integers(MAX_SEED))
            if s not in self.slot_of and s not in self.staged:
                return s

    def sample(self, actor: int) -> int:
        """Choose the level of actor `actor`'s next episode; returns its seed."""
        if self.strategy == "random":  # uniform baseline P_train = Uniform(Λ_train)
            if self.unbounded:
                return int(self.rng.integers(MAX_SEED))
            return int(self.seeds[self.rng.integers(len(self.seeds))])
        self.num_samples += 1  # c <- c + 1
        self.staleness += 1.0
        if self.rng.random() < self.replay_decision_prob():  # d ~ P_D
            cdf = np.cumsum(self.replay_probs())  # l ~ P_replay (inverse CDF; zero-mass slots are never drawn)
            slot = min(int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right")), len(cdf) - 1)
            self.num_replays += 1
            seed = int(self.seeds[slot])
        else:  # a new level joins Λ_seen at its first committed score (authors' code; Algorithm 2: when sampled)
            seed = self._draw_unseen()
            slot = self.slot_of.get(seed)
            if slot is None:  # unbounded: staged until its first episode is scored
                self.staged[seed] = self.num_samples
        if slot is not None:
            self.staleness[slot] = 0.0  # C_i <- c
        return seed

    # --- scores ---
    def _commit(self, seed: int, score: float) -> None:
        """S_i <- (1 - α) S_i + α score (α = 1: the paper's overwrite); unbounded: insert into the top-M buffer."""
        slot = self.slot_of.get(seed)
        if slot is None:  # unbounded, level not in the buffer
            timestamp = self.staged.pop(seed, self.num_samples)
            if self.num_seen < len(self.seeds):
                slot = self.num_seen
                self.num_seen += 1
            else:  # App. B.3: l_min = argmin P_replay(l), replaced only if its score is lower
                slot = int(np.argmin(self.replay_probs()))
                if not self.scores[slot] < score:
                    return
                del self.slot_of[int(self.seeds[slot])]
            self.seeds[slot] = seed
            self.slot_of[seed] = slot
            self.seen[slot] = False
            self.staleness[slot] = self.num_samples - timestamp
        elif not self.seen[slot]:
            self.num_seen += 1
        if self.seen[slot]:
            self.scores[slot] = (1.0 - self.score_alpha) * self.scores[slot] + self.score_alpha * score
        else:  # first score: l joins Λ_seen and becomes replayable
            self.scores[slot] = score
            self.seen[slot] = True
        self._p_s = None

    def update_with_rollouts(self, scores_tn, dones_tn, levels_tn) -> int:
        """Split each actor's rollout at episode ends, average the per-step scores of each segment, stitch the first
        segment to the actor's partial score S~ (Algorithm 4), commit finished episodes and keep the trailing
        unfinished one as the new partial score. (T, N) numpy arrays in; returns the number of committed scores."""
        if self.strategy == "random":
            return 0
        T, N = scores_tn.shape
        s = np.asarray(scores_tn, np.float64).T.reshape(-1)  # actor-major
        d = np.asarray(dones_tn, bool).T.reshape(-1)
        lv = np.asarray(levels_tn, np.int64).T.reshape(-1)
        start = np.zeros(N * T, bool)
        start[::T] = True
        start[1:] |= d[:-1]
        first = np.flatnonzero(start)
        last = np.r_[first[1:], N * T] - 1
        seg = np.cumsum(start) - 1
        sums = np.bincount(seg, weights=s, minlength=len(first))
        counts = np.bincount(seg, minlength=len(first)).astype(np.int64)
        seg_done, seg_level, seg_actor = d[last], lv[first], first // T
        seg_first_of_actor = first % T == 0
        committed = 0
        for k in range(len(first)):  # one iteration per episode segment (vectorized stats above)
            a, n, total = seg_actor[k], counts[k], sums[k]
            if seg_first_of_actor[k] and self.partial_steps[a] > 0:
                if self.partial_level[a] == seg_level[k]:  # continue S~ of the same episode
                    total += self.partial_score[a] * self.partial_steps[a]
                    n += self.partial_steps[a]
                self.partial_steps[a] = 0
            if seg_done[k]:
                self._commit(int(seg_level[k]), total / n)
                committed += 1
            else:
                self.partial_score[a], self.partial_steps[a], self.partial_level[a] = total / n, n, seg_level[k]
        return committed

    def restart_episodes(self) -> None:
        """Every actor's episode restarts from its level's first frame (`--resume`: env states are not saved): drop the
        partial scores S~, so that the restarted episode is scored on its own steps only."""
        self.partial_score[:] = 0.0
        self.partial_steps[:] = 0

    def after_update(self) -> None:
        """`--plr-commit update` (authors' code): commit every partial score S~ as its level's score, reset S~."""
        if self.commit != "update" or self.strategy == "random":
            return
        for a in np.flatnonzero(self.partial_steps > 0):
            self._commit(int(self.partial_level[a]), float(self.partial_score[a]))
            self.partial_steps[a] = 0

    # --- checkpointing ---
    _ARRAYS = ("seeds", "scores", "staleness", "seen", "partial_score", "partial_steps", "partial_level")

    def state_dict(self) -> dict:
        return {k: getattr(self, k).copy() for k in self._ARRAYS} | dict(
            staged=dict(self.staged),
            num_samples=self.num_samples,
            num_replays=self.num_replays,
            num_seen=self.num_seen,
            rng=self.rng.bit_generator.state,
        )

    def load_state_dict(self, d: dict) -> None:
        for k in self._ARRAYS:
            setattr(self, k, np.array(d[k]).copy())
        self.staged, self.num_samples = dict(d["staged"]), d["num_samples"]
        self.num_replays, self.num_seen = d["num_replays"], d["num_seen"]
        self.slot_of = {int(s): i for i, s in enumerate(self.seeds) if s >= 0}
        self.rng.bit_generator.state = d["rng"]
        self._p_s = None

    def stats(self) -> dict:
        """plr/* metrics."""
        p = self.replay_probs() if self.num_seen else np.zeros(1)
        out = {
            "plr/num_seen_levels": int(self.num_seen),
            "plr/replay_prob": self.replay_decision_prob(),
            "plr/num_replays": int(self.num_replays),
            "plr/replay_entropy": float(-(p[p > 0] * np.log(p[p > 0])).sum()),
        }
        for name, x in (("score", self.scores[self.seen]), ("staleness", self.staleness[self.seen])):
            out |= {
                f"plr/{name}_mean": float(x.mean()) if x.size else 0.0,
                f"plr/{name}_max": float(x.max()) if x.size else 0.0,
            }
        return out


def make_sampler(args: Args, seed: int) -> LevelSampler:
    """The LevelSampler of the --plr-* flags (--plr-X is its keyword X)."""
    levels = None if args.num_train_levels == 0 else np.arange(args.start_level, args.start_level + args.num_train_levels)
    names = (
        "strategy",
        "transform",
        "temperature",
        "staleness_coef",
        "replay_schedule",
        "replay_prob",
        "min_fill",
        "score_alpha",
        "commit",
        "buffer_size",
    )
    return LevelSampler(levels, args.num_envs, seed=seed, **{k: getattr(args, f"plr_{k}") for k in names})


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
    """The level sets of `evaluate`: {"train": fn, "test": fn}, each fn returning the next episode's level."""
    return {kind: lambda kind=kind: draw_eval_level(kind, args, sampler, rng) for kind in ("train", "test")}


def evaluate(agent, envs, level_sets, num_episodes, args: Args, device) -> dict:
    """eval/* metrics over `num_episodes` stochastic-policy episodes per level set ({"train": next_level fn, "test":
    ...}), each env contributing its first ceil(k/n) episodes (so short episodes are not over-represented)."""
    out, n = {}, envs.num_envs
    for kind, next_level in level_sets.items():
        quota, got = -(-num_episodes // n), [[] for _ in range(n)]
        obs = envs.reset([next_level() for _ in range(n)])
        while sum(min(len(g), quota) for g in got) < num_episodes:
            # a stop signal ends the evaluation between steps
            check_stop()
            with torch.no_grad():
                actions = Categorical(logits=agent(torch.as_tensor(obs, device=device))[0]).sample().cpu().numpy()
            obs, _, _, _, info = envs.step(actions, next_level=lambda i: next_level())
            for i in np.flatnonzero(info["_episode"]):
                got[i].append(float(info["episode_return"][i]))
        rets = np.array([r for g in got for r in g[:quota]][:num_episodes])
        out[f"eval/{kind}_return"] = float(rets.mean())
        out[f"eval/{kind}_return_se"] = float(rets.std(ddof=1) / np.sqrt(len(rets))) if len(rets) > 1 else 0.0
        if is_procgen(args.env_id):  # Cobbe et al. (2020) min-max normalization (None for other modes)
            from common.procgen_env import procgen_normalized_return

            norm = procgen_normalized_return(args.env_id, args.distribution_mode, rets.mean())
            out |= {} if norm is None else {f"eval/{kind}_normalized_return": norm}
        else:  # MiniGrid: a success is any positive return
            out[f"eval/{kind}_success"] = float((rets > 0).mean())
    return out | {"eval/generalization_gap": out["eval/train_return"] - out["eval/test_return"]}


if __name__ == "__main__":
    stop_on_signals()  # SIGINT (even inherited-ignored) and SIGTERM: stop every process, write summary.json
    # tyro (--help grouped: common / environment / method); --resume: the checkpoint's flags, given flags override
    args, ckpt, overridden = parse_run_args(Args, "plr_ppo.py", FIXED_ON_RESUME)
    args = resolve_defaults(args)
    validate_args(args)  # only the checks between flags; all before anything heavy and before RunLogger
    N, T = args.num_envs, args.num_steps
    batch_size, minibatch_size = N * T, N * T // args.num_minibatches  # the run ends at the budget's last whole batch
    start_step = ckpt["global_step"] if ckpt else 0
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
    logger = start_run(args, ckpt, args.env_id)  # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    # PPO acts and learns in turn: its env workers (MiniGrid) wait while it learns, so they take no core from it
    set_learner_threads(0)

    # SETUP: envs, network, optimizer, level sampler
    envs = make_env(args, N, seed=args.seed)
    eval_envs = None  # one evaluation env (one worker) for train and test levels, created at the first evaluation
    obs_shape, num_actions = envs.single_observation_space.shape, int(envs.single_action_space.n)
    agent = make_agent(args, obs_shape, num_actions).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    sampler = make_sampler(args, seed=args.seed)
    normalizer = ReturnNormalizer(N, args.gamma) if args.norm_reward else None
    eval_rng = np.random.default_rng(args.seed + 12345)
    train_levels = np.arange(args.start_level, args.start_level + args.num_train_levels)
    difficulties = None  # Figure 4: a difficulty label per training level (MultiRoom rooms, gamut variant)
    if args.num_train_levels and ("MultiRoom" in args.env_id or "ObstructedMazeGamut" in args.env_id):
        difficulties = np.array([level_difficulty(args.env_id, int(s)) for s in train_levels])

    global_step, update = start_step, ckpt["update"] if ckpt else 0
    if ckpt:  # restore, then one line
        load_state_dicts(ckpt, model=agent, optimizer=optimizer, sampler=sampler, normalizer=normalizer)
        eval_rng.bit_generator.state = ckpt["eval_rng"]
        set_rng_state(ckpt["rng"])
        next_obs = envs.reset([int(s) for s in ckpt["env_levels"]])  # env states are not saved: restart each level
        # the restarted episodes begin again at their first frame: their saved partial scores S~ belong to lost frames
        sampler.restart_episodes()
        print(
            f"resumed {args.resume} at step {global_step:,} ({update:,} updates, {sampler.num_seen:,} levels seen); each "
            f"env restarts its level; flags from this command line: {', '.join(overridden) or 'none'}; runs to step "
            f"{end_step:,}",
            flush=True,
        )
    else:
        next_obs = envs.reset([sampler.sample(i) for i in range(N)])

    obs_buf = torch.zeros((T, N, *obs_shape), dtype=torch.uint8, device=device)
    actions_buf = torch.zeros((T, N), dtype=torch.long, device=device)
    logprobs_buf, values_buf, rewards_buf, final_values_buf = (torch.zeros((T, N), device=device) for _ in range(4))
    term_buf, done_buf = (torch.zeros((T, N), dtype=torch.bool, device=device) for _ in range(2))
    levels_np = np.zeros((T, N), np.int64)
    logits_buf = torch.zeros((T, N, num_actions), device=device)  # behaviour logits (the policy-based scores)
    recent_returns, sps_steps, sps_time = [], 0, 0.0

    def run_eval(num_episodes):
        global eval_envs
        if eval_envs is None:
            eval_envs = make_env(args, args.num_eval_envs, seed=args.seed + 1, num_workers=1)
        agent.eval()
        out = evaluate(agent, eval_envs, eval_level_sets(args, sampler, eval_rng), num_episodes, args, device)
        agent.train()
        return out

    def save(path):
        save_checkpoint(
            path,
            {
                "script": "plr_ppo.py",
                "args": vars(args),
                "run_name": logger.run_name,
                "global_step": global_step,
                "update": update,
                "eval_rng": eval_rng.bit_generator.state,
                "rng": rng_state(),
                "env_levels": np.array(envs.levels, np.int64),
                **state_dicts(model=agent, optimizer=optimizer, sampler=sampler, normalizer=normalizer),
            },
        )

    next_checkpoint = (global_step // args.checkpoint_every + 1) * args.checkpoint_every if args.checkpoint_every else None
    error = None
    try:
        while global_step < end_step:
            t0 = time.time()
            replays_before, samples_before = sampler.num_replays, sampler.num_samples
            # COLLECT: T steps on N envs; each new episode starts on the level the sampler returns
            for step in range(T):
                # a stop signal (recorded by its handler) stops the run here, between env steps
                check_stop()
                obs_buf[step] = obs_t = torch.as_tensor(next_obs, device=device)
                with torch.no_grad():
                    logits, value = agent(obs_t)
                dist = Categorical(logits=logits)
                action = dist.sample()
                actions_buf[step], logprobs_buf[step], values_buf[step] = action, dist.log_prob(action), value
                logits_buf[step] = logits
                next_obs, reward, terminated, truncated, info = envs.step(action.cpu().numpy(), next_level=sampler.sample)
                done = terminated | truncated
                if not args.bootstrap_truncation:  # the time limit ends the task: no bootstrap (MiniGrid default)
                    terminated, truncated = done, np.zeros_like(done)
                levels_np[step] = info["level_seed"]
                if normalizer is not None:
                    reward = normalizer(reward, done)
                rewards_buf[step] = torch.as_tensor(reward, device=device)
                term_buf[step] = torch.as_tensor(terminated, device=device)
                done_buf[step] = torch.as_tensor(done, device=device)
                if truncated.any():  # --bootstrap-truncation: bootstrap truncations from V(s_final)
                    idx = np.flatnonzero(truncated)
                    with torch.no_grad():
                        final_values_buf[step, torch.as_tensor(idx, device=device)] = agent(
                            torch.as_tensor(info["final_obs"][idx], device=device)
                        )[1]
                ended = np.flatnonzero(info["_episode"])
                recent_returns += list(zip(info["episode_return"][ended], info["episode_length"][ended]))
            global_step += batch_size
            collect_time = time.time() - t0

            # LEARN: GAE, PLR scores with the behaviour policy, PPO update, then PLR's after-update commit
            with torch.no_grad():
                next_value = agent(torch.as_tensor(next_obs, device=device))[1]
            advantages, deltas = compute_gae(
                rewards_buf, values_buf, next_value, term_buf, done_buf, final_values_buf, args.gamma, args.gae_lambda
            )
            returns = advantages + values_buf
            t1 = time.time()
            if args.plr_strategy != "random":  # Algorithm 4: episode scores, stitched across rollouts
                scores = step_scores(
                    args.plr_strategy, advantages.cpu().numpy(), deltas.cpu().numpy(), logits_buf.cpu().numpy()
                )
                sampler.update_with_rollouts(scores, done_buf.cpu().numpy(), levels_np)
            plr_time = time.time() - t1

            b_obs, b_actions, b_logprobs = obs_buf.reshape(-1, *obs_shape), actions_buf.reshape(-1), logprobs_buf.reshape(-1)
            b_adv, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values_buf.reshape(-1)
            if args.norm_adv:
                b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-5)
            clipfracs = []
            for epoch in range(args.update_epochs):
                perm = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    mb = perm[start : start + minibatch_size]
                    loss, pg_loss, v_loss, entropy, approx_kl, clipfrac = ppo_loss(
                        agent, b_obs[mb], b_actions[mb], b_logprobs[mb], b_adv[mb], b_returns[mb], b_values[mb], args
                    )
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    clipfracs.append(clipfrac)
            t2 = time.time()
            sampler.after_update()
            plr_time += time.time() - t2
            update += 1

            # LOG
            sps_steps, sps_time = sps_steps + batch_size, sps_time + time.time() - t0
            sps = int(sps_steps / max(sps_time, 1e-9))
            y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
            var_y = np.var(y_true)
            metrics = {
                "charts/SPS": sps,
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "charts/collect_seconds": collect_time,
                "charts/plr_seconds": plr_time,
                "losses/value_loss": v_loss.item(),
                "losses/policy_loss": pg_loss.item(),
                "losses/entropy": entropy.item(),
                "losses/approx_kl": approx_kl.item(),
                "losses/clipfrac": torch.stack(clipfracs).mean().item(),
                "losses/explained_variance": float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y),
            }
            if recent_returns:
                metrics["charts/episodic_return"], metrics["charts/episodic_length"] = np.mean(recent_returns, 0).tolist()
            if args.plr_strategy != "random":
                new = sampler.num_samples - samples_before
                metrics |= sampler.stats() | {"plr/replay_fraction": (sampler.num_replays - replays_before) / max(new, 1)}
                if difficulties is not None and sampler.num_seen:  # Figure 4: P_replay mass per difficulty
                    p = sampler.replay_probs()
                    metrics |= {f"plr/mass_{lab}": float(p[difficulties == lab].sum()) for lab in np.unique(difficulties)}
            if args.eval_every and update % args.eval_every == 0 and args.eval_episodes:
                metrics |= run_eval(args.eval_episodes)
            logger.log(global_step, metrics)
            logger.progress(
                global_step,
                sps,
                episodic_return=metrics.get("charts/episodic_return"),
                loss_name="value_loss",
                loss=metrics["losses/value_loss"],
                extra=f"seen={sampler.num_seen}" if args.plr_strategy != "random" else "",
            )
            recent_returns = []

            # CHECKPOINT
            if next_checkpoint is not None and global_step >= next_checkpoint:
                save(logger.dir / "checkpoint.pt")
                next_checkpoint += args.checkpoint_every
    except (KeyboardInterrupt, StopRun) as e:  # StopRun: a dead MiniGrid env worker, an unwritable checkpoint
        error = e
    finally:
        envs.close()
    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    if error is None and args.checkpoint_every:
        save(logger.dir / "checkpoint.pt")

    def save_model():
        save_checkpoint(path := logger.dir / f"{args.exp_name}.model", {"model": agent.state_dict(), "args": vars(args)})
        return path

    def final_eval() -> dict:
        final = run_eval(args.final_eval_episodes)
        logger.log(global_step, {k.replace("eval/", "eval/final_"): v for k, v in final.items()})
        return {k.replace("eval/", "final_"): v for k, v in final.items()}

    summary = {"global_step": global_step, "updates": update}
    if args.plr_strategy != "random":
        summary |= {k.replace("plr/", "plr_"): v for k, v in sampler.stats().items()}
    try:
        finish_run(
            logger, error, summary, save_model if args.save_model else None, final_eval if args.final_eval_episodes else None
        )
    finally:
        if eval_envs is not None:
            eval_envs.close()

# docs and results: README.md#vracer_referpy-v-racer-with-remember-and-forget-experience-replay
"""V-RACER with Remember-and-Forget Experience Replay (Novati & Koumoutsakos 2019, https://arxiv.org/abs/1807.05827).

Paper parts (gymnasium MuJoCo tasks)
- Network (Sec. 2, App. A) `Agent`: MLP 2 x 128 Softsign, V(s) and the Gaussian mean, a state-independent std.
- Off-policy policy gradient (Eq. (5)) and value loss (Eq. (9)) `refer_loss`; Retrace / V^tbc (Eqs. (6)-(8))
  `vtbc_targets`, stored as Q^ret and refreshed by `EpisodeReplay.update_samples` / `refresh_delta`.
- ReF-ER Rules 1 and 2 (Eqs. (10)-(11)) `refer_loss`, `gaussian_kl`; beta (Eq. (12)) `refer_beta_update`; c_max and
  lr annealing (Eq. (13)) `refer_cmax`, `annealed_lr`; ablations (Sec. 5) `--refer full|rule1|rule2|none`, `--per rank`.
- Replay memory (Sec. 3, App. B, C) `EpisodeReplay`: whole episodes, FIFO, state standardisation and reward scaling
  (Eqs. (14)-(16)); truncated-normal actions rescaled to the bounds (App. A, B) `sample_noise`, `to_env_action`.
- Master algorithm (App. C Alg. 1): `actor_loop` streams to shared-memory rings (`store_episodes`); `train_step` keeps F = t/k.

Defaults: gamma 0.995, C 4, A 5e-7, D 0.1, N = N_start = 2**18, B 256, lr 1e-4, F 1, Sigma = 0.2 I, softplus std,
D_KL(mu || pi) (App. A, Sec. 3, Alg. 1); stats every 1000 steps, eps 1e-7 (App. B). Authors' code (paper silent):
beta_0 0, beta rate 1e-4, log rho clip 7, Adam eps 1.19e-7; PER alpha 0.5, beta0 0.5; no gradient clip or target net.

Differences from the paper (long form: README.md, section vracer_refer.py)
- The replay stores Q^ret_t (as the authors' code); V^tbc_t is rebuilt from it with the fresh V and rho (Eq. (7)).
- Prior steps are refreshed once per gradient step; Q^ret is recomputed at every reward-scale update (stored V keep
  their old scale until resampled); n_far is kept incrementally, recounted every `stats_every`.
- Eq. (13)'s t counts gradient steps; PER weights / batch max; PER re-sorts every `stats_every` steps, and steps stored
  since the last re-sort are drawn uniformly (probability 1/n each) until the next one.
- Glorot init U(+-sqrt(6/(fi+fo))) (the paper's formula read as a typo); rho and KL use untruncated densities.
- Actors may act with weights one iteration old; each transition stores the mu it used, so rho stays exact.
- Not implemented: `farpolfrac` forgetting, DDPG / NAF with ReF-ER, the advantage of App. E; `--residual` is off.
Autoreset: none (each actor resets its env; truncation bootstraps from the true s_T). `--resume` restores the learner
exactly; actors restart their episodes, re-seeded. Needs common/{mujoco_env,args,logger,checkpoint,processes,video}.py.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: actors' 1-row matvecs must not spin BLAS threads
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

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
from common.mujoco_env import check_mujoco_env_id, make_mujoco_env
from common.processes import ProcessGroup, StopRun, check_memory, check_stop, finish_run, set_learner_threads, stop_on_signals
from common.video import check_video_support


@dataclass
class Args(CommonArgs):  # CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
    # --- algorithm specific arguments ---
    env_id: str = "HalfCheetah-v5"
    """gymnasium MuJoCo task id (continuous Box actions, vector observations)"""
    total_timesteps: int = 1_000_000
    """total environment steps t (summed over actors)"""
    learning_starts: int = 2**18
    """N_start: env steps (complete episodes in the RM) collected before the first gradient step (App. C Alg. 1)"""
    buffer_size: int = 2**18
    """N: the replay memory keeps at least N samples; oldest whole episodes are removed first (Sec. 3)"""
    batch_size: int = 256
    """B: time steps per mini-batch (App. A)"""
    gamma: float = 0.995
    """gamma: discount factor (App. A)"""
    learning_rate: float = 1e-4
    """eta: initial Adam learning rate, annealed eta/(1 + A k) (Eq. (13), App. A)"""
    adam_eps: float = 1.19e-7
    """Adam epsilon (not in the paper; the authors' code adds float32 eps)"""
    F: float = 1.0
    """F = t/k: environment steps per gradient step (App. A)"""
    refer: Literal["full", "rule1", "rule2", "none"] = "full"
    """ReF-ER variant: full (Rules 1+2), rule1 (skip far-policy only), rule2 (KL penalty only), none (conventional ER)"""
    C: float = 4.0
    """C in c_max = 1 + C/(1 + A k) (Eq. (13))"""
    A: float = 5e-7
    """A: annealing of c_max and the learning rate per gradient step (Eq. (13))"""
    D: float = 0.1
    """D: target fraction of far-policy samples in the RM (Eq. (12))"""
    beta_init: float = 0.0
    """initial beta of Eq. (10) (paper silent; the authors' code starts at 0)"""
    beta_lr: float = 1e-4
    """eta of Eq. (12): rate of the beta update (fixed, as in the authors' code)"""
    kl_direction: Literal["mu_pi", "pi_mu"] = "mu_pi"
    """penalty direction: mu_pi = D_KL(mu||pi) (Eq. (11)); pi_mu = D_KL(pi||mu) (the authors' code)"""
    logrho_clip: float = 7.0
    """clip log(rho) to +-this (not in the paper; the authors' code uses 7)"""
    per: Literal["none", "rank"] = "none"
    """sampling: uniform, or rank-based prioritized experience replay (the paper's PER comparison)"""
    per_alpha: float = 0.5
    """rank-based PER exponent: p_i proportional to rank^-alpha (the authors' PER: 1/sqrt(rank))"""
    per_beta0: float = 0.5
    """PER importance-weight exponent, annealed to 1 as min(1, beta0 + (1 - beta0) A k)"""
    init_std: float = 0.2**0.5
    """initial policy std (App. A: covariance 0.2 I)"""
    std_map: Literal["softplus", "cheap_softplus"] = "softplus"
    """map from the std parameter to sigma: softplus (paper) or 0.5(x + sqrt(1 + x^2)) (the authors' code)"""
    hidden_size: int = 128
    """units per hidden layer (App. A)"""
    residual: bool = False
    """residual connection on hidden layer 2 (the authors' code; not in the paper)"""
    action_noise: Literal["truncnorm", "smarties", "normal"] = "truncnorm"
    """noise z for a = m + sigma z: normal truncated at 3 (App. A), smarties (|z|>3 -> U(-3,3)), or plain normal"""
    clip_actions: bool = False
    """clip actions to the bounds before env.step (the paper does not; MuJoCo clamps ctrl itself)"""
    stats_every: int = 1000
    """gradient steps between reward-scale updates, exact n_far recounts and PER re-sorts (App. B)"""
    state_stats_rate: float = 0.0
    """rate at which state mean/std move to the RM statistics every stats_every steps (0 = frozen, App. B)"""
    num_actors: int = 2
    """actor processes stepping one environment each (CPU, one thread each)"""
    ring_size: int = 4096
    """transitions each actor can stream ahead of the learner (shared-memory ring)"""
    log_every: int = 1000
    """gradient steps between two metric lines"""
    checkpoint_replay: bool = False
    """also store the replay memory in checkpoints (large: about 150 MB at N = 2**18 on Hopper)"""
    eval_episodes: int = 10
    """episodes of the deterministic (mean-action) policy evaluated after training with --save-model"""


RULE2_RHO_MAX = 1e3  # the rule2 ablation clips rho at this in the policy gradient (Sec. 5.3)
GRAD_STEPS_PER_READ = 64  # the learner reads the actor rings at least every this many gradient steps
# the flags a resumed run may not change (environment, seed, network, method, replay size), and the range rules
FIXED_ON_RESUME = (
    "env_id",
    "seed",
    "gamma",
    "hidden_size",
    "residual",
    "std_map",
    "refer",
    "kl_direction",
    "per",
    "buffer_size",
)


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags; the first violation stops the script with one line `error: ...`."""
    require(args.total_timesteps > 0, f"--total-timesteps must be > 0, got {args.total_timesteps!r}")
    require(args.learning_starts >= 1, f"--learning-starts must be >= 1, got {args.learning_starts!r}")
    require(args.buffer_size >= 1, f"--buffer-size must be >= 1, got {args.buffer_size!r}")
    require(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size!r}")
    require(0 < args.gamma <= 1, f"--gamma must be in (0, 1], got {args.gamma!r}")
    require(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate!r}")
    require(args.adam_eps > 0, f"--adam-eps must be > 0, got {args.adam_eps!r}")
    require(args.F > 0, f"--F must be > 0, got {args.F!r}")
    require(args.C >= 0, f"--C must be >= 0, got {args.C!r}")
    require(args.A >= 0, f"--A must be >= 0, got {args.A!r}")
    require(0 < args.D < 1, f"--D must be in (0, 1), got {args.D!r}")
    require(0 <= args.beta_init <= 1, f"--beta-init must be in [0, 1], got {args.beta_init!r}")
    require(0 < args.beta_lr < 1, f"--beta-lr must be in (0, 1), got {args.beta_lr!r}")
    require(args.logrho_clip > 0, f"--logrho-clip must be > 0, got {args.logrho_clip!r}")
    require(args.per_alpha >= 0, f"--per-alpha must be >= 0, got {args.per_alpha!r}")
    require(0 <= args.per_beta0 <= 1, f"--per-beta0 must be in [0, 1], got {args.per_beta0!r}")
    require(args.init_std > 0, f"--init-std must be > 0, got {args.init_std!r}")
    require(args.hidden_size >= 1, f"--hidden-size must be >= 1, got {args.hidden_size!r}")
    require(args.stats_every >= 1, f"--stats-every must be >= 1, got {args.stats_every!r}")
    require(0 <= args.state_stats_rate <= 1, f"--state-stats-rate must be in [0, 1], got {args.state_stats_rate!r}")
    require(args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors!r}")
    require(args.ring_size >= 2, f"--ring-size must be >= 2, got {args.ring_size!r}")
    require(args.log_every >= 1, f"--log-every must be >= 1, got {args.log_every!r}")
    require(args.eval_episodes >= 0, f"--eval-episodes must be >= 0, got {args.eval_episodes!r}")
    try:
        check_mujoco_env_id(args.env_id)
        if args.capture_video:
            check_video_support()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for bad, msg in (
        (args.buffer_size < args.batch_size, "--batch-size must be <= --buffer-size"),
        (
            args.learning_starts > args.buffer_size,
            "--learning-starts must be <= --buffer-size (the memory never holds more than N + one episode)",
        ),
        (
            args.learning_starts < args.batch_size,
            "--learning-starts must be >= --batch-size (the first batch needs that many samples)",
        ),
        (args.C <= 0 and args.refer != "none", "--C must be > 0 with ReF-ER (use --refer none for conventional ER)"),
    ):
        if bad:
            raise SystemExit(f"error: {msg}")


def make_env(env_id: str, seed: int, capture_video: bool = False, run_name: str = ""):
    return make_mujoco_env(
        env_id, seed, capture_video=capture_video, video_folder=f"videos/{run_name}" if capture_video else None
    )


# NETWORK
def std_from_param(x: torch.Tensor, std_map: str) -> torch.Tensor:
    """Map the state-independent parameter to sigma > 0: softplus (App. A) or the authors' "cheap softplus"."""
    return nn.functional.softplus(x) if std_map == "softplus" else 0.5 * (x + torch.sqrt(1.0 + x * x))


def std_param_init(std: float, std_map: str) -> float:
    """Inverse of `std_from_param`."""
    return float(np.log(np.expm1(std))) if std_map == "softplus" else (std * std - 0.25) / std


class Agent(nn.Module):
    """V-RACER's single MLP: s -> (mean m(s), sigma, V(s)); sigma is state independent (App. A)."""

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: int = 128,
        init_std: float = 0.2**0.5,
        std_map: str = "softplus",
        residual: bool = False,
    ):
        super().__init__()
        self.l1, self.l2 = nn.Linear(obs_dim, hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1 + act_dim)  # [V, mean]
        self.std_param = nn.Parameter(torch.full((act_dim,), std_param_init(init_std, std_map)))
        self.std_map, self.residual = std_map, residual
        for layer in (self.l1, self.l2):  # App. A: Glorot uniform (weights and, as the authors' code, biases)
            bound = float(np.sqrt(6.0 / (layer.in_features + layer.out_features)))
            for p in (layer.weight, layer.bias):
                nn.init.uniform_(p, -bound, bound)
        bound = 0.1 / float(np.sqrt(hidden))  # App. A: U(+-0.1/sqrt(f_i)) -> near-zero outputs
        nn.init.uniform_(self.out.weight, -bound, bound)
        nn.init.zeros_(self.out.bias)

    def forward(self, obs: torch.Tensor):
        h = nn.functional.softsign(self.l1(obs))
        h2 = nn.functional.softsign(self.l2(h))
        h = h + h2 if self.residual else h2
        o = self.out(h)
        std = std_from_param(self.std_param, self.std_map).expand(o.shape[0], -1)
        return o[:, 1:], std, o[:, 0]


# ALGORITHM PIECES: small pure functions, each with the paper's equation numbers in comments
def reverse_linear_scan(a: np.ndarray, b: np.ndarray, max_len: int | None = None) -> np.ndarray:
    """Solve x_t = b_t + a_t x_{t+1} backwards over a flat array (x beyond the end = 0). Segments (episodes, refreshed
    prefixes) end with a_t = 0, so one call handles many; Hillis-Steele doubling: ceil(log2(max_len)) numpy passes."""
    x, a = np.array(b, dtype=np.float64), np.array(a, dtype=np.float64)
    shift, stop = 1, len(x) if max_len is None else min(len(x), max_len)
    while shift < stop:
        x[:-shift] += a[:-shift] * x[shift:]  # numpy resolves the overlap as if from the old values
        a[:-shift] *= a[shift:]
        shift *= 2
    return x


def vtbc_targets(rewards: np.ndarray, values: np.ndarray, rhos: np.ndarray, gamma: float, terminated: bool) -> np.ndarray:
    """V^tbc_t for t = 0..L-1 of one episode (Eq. (8)): rewards[t] = r_{t+1}; values[t] = V(s_t), values[L] = V(s_L)
    (used on truncation; 0 when `terminated`); rhos[t] = pi(a_t|s_t)/mu(a_t|s_t).
    Eq. (8): V^tbc_t = V_t + min(1, rho_t) (r_{t+1} + gamma V^tbc_{t+1} - V_t),  V^tbc_L = V(s_L) or 0,
    i.e. x_t = b_t + a_t x_{t+1} with a_t = gamma c_t, b_t = (1 - c_t) V_t + c_t r_{t+1}."""
    rewards, values, rhos = (np.asarray(v, dtype=np.float64) for v in (rewards, values, rhos))
    L = len(rewards)
    c = np.minimum(1.0, rhos)  # rho-bar = min(1, rho) (Eq. (6))
    a, b = gamma * c, (1.0 - c) * values[:L] + c * rewards
    b[-1] += a[-1] * (0.0 if terminated else values[L])  # the tail V^tbc_L
    a[-1] = 0.0
    return reverse_linear_scan(a, b)


def refer_cmax(step: int, C: float, A: float) -> float:
    """Eq. (13): c_max(k) = 1 + C / (1 + A k), k = gradient steps."""
    return 1.0 + C / (1.0 + A * step)


def annealed_lr(step: int, lr: float, A: float) -> float:
    """Eq. (13): eta(k) = eta / (1 + A k)."""
    return lr / (1.0 + A * step)


def refer_beta_update(beta: float, far_fraction: float, D: float, eta: float) -> float:
    """Eq. (12): beta <- (1 - eta) beta if n_far/N > D, else (1 - eta) beta + eta."""
    return (1.0 - eta) * beta if far_fraction > D else (1.0 - eta) * beta + eta


def is_far_policy(rho, cmax: float):
    """Rule 1: near-policy iff 1/c_max < rho < c_max (Sec. 3), so a NaN rho is far; numpy arrays and tensors."""
    return ~((rho > 1.0 / cmax) & (rho < cmax))


def gaussian_kl(mean_p, std_p, mean_q, std_q):
    """D_KL(p || q) of diagonal Gaussians, summed over dimensions (closed form)."""
    return (torch.log(std_q / std_p) + (std_p**2 + (mean_p - mean_q) ** 2) / (2.0 * std_q**2) - 0.5).sum(-1)


def gaussian_logprob(act, mean, std):
    """log N(a; m, diag(std^2)) summed over dimensions (untruncated: the 3-sigma truncation constant cancels in rho)."""
    z = (act - mean) / std
    return (-0.5 * z * z - torch.log(std) - 0.5 * float(np.log(2.0 * np.pi))).sum(-1)


def refer_loss(
    mean,
    std,
    value,
    act,
    mu_mean,
    mu_std,
    qret,
    beta: float,
    cmax: float,
    refer: str = "full",
    kl_direction: str = "mu_pi",
    logrho_clip: float = 7.0,
    weights=None,
):
    """V-RACER + ReF-ER loss for one mini-batch; its gradient is -1/B sum_i g^ReF-ER_i (Eq. (10), App. C Alg. 3).

    Per sample: near-policy (1/c_max < rho < c_max): beta (L_offPG + L_tbc) + (1 - beta) D_KL; far: (1 - beta) D_KL
    (Rule 1). rule1: beta_eff = 1; rule2: all near (PG rho clipped at RULE2_RHO_MAX); none: all near, beta_eff = 1.
    Returns (loss, info): per-sample detached rho, far, kl_mu_pi, abs_err, and the scalar losses."""
    B = mean.shape[0]
    logmu = gaussian_logprob(act, mu_mean, mu_std)
    with torch.no_grad():  # rho = pi/mu; pi = mu = 0 (both log-densities -inf) gives NaN: far, finite downstream
        rho = torch.exp(torch.clamp(gaussian_logprob(act, mean, std) - logmu, -logrho_clip, logrho_clip))
        rho = torch.nan_to_num(rho, nan=0.0)
    far = is_far_policy(rho, cmax)  # Rule 1
    near = ~far if refer in ("full", "rule1") else torch.ones_like(far)
    # masked-out samples: log pi at a = mean, std 1 (double-where trick), so no 0 * inf = NaN reaches the gradient
    keep = near[:, None]
    logp = gaussian_logprob(torch.where(keep, act, mean.detach()), mean, torch.where(keep, std, torch.ones_like(std)))
    adv = qret - value.detach()  # Q^ret - V^w(s) (Eq. (5))
    cbar = torch.clamp(rho, max=1.0)  # rho-bar = min(1, rho)
    vtbc = value.detach() + cbar * adv  # Eq. (7): V^tbc = V + rho-bar (Q^ret - V)
    rho_pg = torch.clamp(rho, max=RULE2_RHO_MAX) if refer == "rule2" else rho
    zero = torch.zeros_like(rho)  # masks select (torch.where), never multiply
    pg_loss = torch.where(near, -(rho_pg * adv) * logp, zero)  # Eq. (5): rho (Q^ret - V) grad log pi, both detached
    v_loss = torch.where(near, 0.5 * (value - vtbc) ** 2, zero)  # Eq. (9)
    kl_mu_pi = gaussian_kl(mu_mean, mu_std, mean, std)  # Eq. (11): D_KL(mu || pi)
    kl = kl_mu_pi if kl_direction == "mu_pi" else gaussian_kl(mean, std, mu_mean, mu_std)
    beta_eff = beta if refer in ("full", "rule2") else 1.0
    w = 1.0 if weights is None else weights  # PER importance weights
    per_sample = w * beta_eff * (pg_loss + v_loss)  # Eq. (10); the KL term only where its weight 1 - beta is not 0
    per_sample = per_sample + (1.0 - beta_eff) * kl if beta_eff < 1.0 else per_sample
    return per_sample.sum() / B, {
        "rho": rho,
        "far": far,
        "kl_mu_pi": kl_mu_pi.detach(),
        "abs_err": (cbar * adv).abs(),
        "policy_loss": pg_loss.detach().sum() / B,
        "value_loss": v_loss.detach().sum() / B,
        "kl_loss": kl.detach().mean(),
    }


def sample_noise(rng: np.random.Generator, shape, mode: str = "truncnorm") -> np.ndarray:
    """z for a = m + sigma z: standard normal truncated at +-3 (App. A), or the authors' refill, or plain normal."""
    z = rng.standard_normal(shape)
    bad = np.abs(z) > 3.0
    while mode == "truncnorm" and bad.any():  # rejection: exact truncated normal
        z[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(z) > 3.0
    if mode == "smarties":
        z[bad] = rng.uniform(-3.0, 3.0, int(bad.sum()))
    return z


def to_env_action(u: np.ndarray, low: np.ndarray, high: np.ndarray, clip: bool = False) -> np.ndarray:
    """App. B: linear rescaling of the Gaussian sample u to the action bounds, a = low + (high - low)(u + 1)/2."""
    a = low + 0.5 * (high - low) * (u + 1.0)
    return np.clip(a, low, high) if clip else a


# REPLAY MEMORY
class EpisodeReplay:
    """Replay memory of whole episodes with per-step Q^ret, last V and last rho (Sec. 2-3, App. B-C).

    Episodes lie contiguously in flat arrays (the write head jumps to 0 when one does not fit before the end); the
    oldest whole episodes are removed while the memory would still hold >= N samples without them (FIFO)."""

    # per-slot arrays: name -> (width: "obs" | "act" | 1, dtype, initial value)
    ARRAYS = {
        "obs": ("obs", np.float32, 0),
        "act": ("act", np.float32, 0),  # s_t, u_t (normalised action space)
        "mu_mean": ("act", np.float32, 0),
        "mu_std": ("act", np.float32, 1),  # mu_t
        "rew": (1, np.float64, 0),
        "rs": (1, np.float64, 0),  # raw r_{t+1}; scaled r / (sigma_r + eps) (App. B)
        "val": (1, np.float64, 0),
        "rho": (1, np.float64, 1),  # most recent V(s_t) and rho_t
        "la": (1, np.float64, 0),  # log(gamma min(1, rho_t)), kept with rho (the trace coefficient)
        "qret": (1, np.float64, 0),
        "prio": (1, np.float64, 0),  # Q^ret_t = r_{t+1} + gamma V^tbc_{t+1}; PER |err|
        "ep_start": (1, np.int64, 0),
        "ep_last": (1, np.int64, 0),
        "valid": (1, bool, 0),
        "truncated_last": (1, bool, 0),
        "vboot": (1, np.float64, 0),
        "boot_obs": ("obs", np.float32, 0),  # last step: V(s_L) (0 if terminal), s_L
        "ranked": (1, bool, 0),
    }  # PER: the step was stored at the last re-sort (it has a rank)
    NOT_SAVED = ("la", "ranked")  # derived: la from rho; ranked at the next re-sort (a loaded memory starts unsorted)
    SCALARS = ("size", "head", "hi", "max_len", "reward_scale", "n_far", "cmax", "max_prio", "N", "cap")  # state_dict

    def __init__(self, N: int, obs_dim: int, act_dim: int, gamma: float, max_episode_len: int = 1000):
        self.N, self.gamma, self.cap = N, gamma, N + 4 * max_episode_len
        columns = {"obs": obs_dim, "act": act_dim}
        for name, (width, dtype, value) in self.ARRAYS.items():
            # s_t and u_t stay 2-D even with one action dimension (the actors hand over (L, act_dim) blocks)
            shape = (self.cap, columns[width]) if width in columns else self.cap
            setattr(self, name, np.full(shape, value, dtype))
        self.episodes: deque = deque()  # (start, length) oldest first
        self.size = self.head = self.hi = self.forced_removals = self.n_far = 0
        self.max_len, self.reward_scale, self.max_prio, self.cmax = 1, 1.0, 1.0, np.inf  # reward_scale = sigma_r + eps
        self.per_order, self.per_alpha, self.per_p, self.per_cdf, self.per_new = None, 0.5, None, None, None  # rank PER

    @staticmethod
    def bytes_needed(N: int, obs_dim: int, act_dim: int, max_episode_len: int = 1000) -> int:
        """RAM of the arrays in ARRAYS, computed before allocating them."""
        return (N + 4 * max_episode_len) * sum(
            {"obs": obs_dim, "act": act_dim}.get(w, w) * np.dtype(t).itemsize for w, t, _ in EpisodeReplay.ARRAYS.values()
        )

    # -- insertion and FIFO forgetting
    def _remove_oldest(self) -> None:
        start, length = self.episodes.popleft()
        sl = slice(start, start + length)
        self.n_far -= int(is_far_policy(self.rho[sl], self.cmax).sum())
        self.valid[sl] = self.truncated_last[sl] = False
        self.size -= length

    def add_episode(
        self, obs, act, mu_mean, mu_std, rew, val, terminated: bool, final_val: float = 0.0, final_obs=None
    ) -> None:
        """Store one complete episode (App. C Alg. 2) and compute its Q^ret with rho = 1 and acting-time V's."""
        L = len(rew)
        if L == 0:
            return
        if L > self.cap - self.N:
            raise ValueError(f"episode of {L} steps is longer than the memory's slack {self.cap - self.N}")
        lo = 0 if self.head + L > self.cap else self.head  # the write head jumps to 0 if the episode does not fit
        hi = lo + L
        while self.episodes and self.episodes[0][0] < hi and self.episodes[0][0] + self.episodes[0][1] > lo:
            self._remove_oldest()  # the region ahead of the head holds the oldest episodes
            self.forced_removals += 1
        sl = slice(lo, hi)
        self.obs[sl], self.act[sl], self.mu_mean[sl], self.mu_std[sl] = obs, act, mu_mean, mu_std
        self.rew[sl], self.rs[sl], self.val[sl] = rew, np.asarray(rew) / self.reward_scale, val
        self.rho[sl], self.la[sl] = 1.0, np.log(self.gamma)
        # counted as `_remove_oldest` uncounts them: rho = 1 is far when c_max <= 1 (--refer none --C 0)
        self.n_far += int(is_far_policy(self.rho[sl], self.cmax).sum())
        self.prio[sl] = self.max_prio  # PER: new samples get the maximal priority
        # PER: the new steps have no rank until the next re-sort (a recycled slot does not keep its old occupant's)
        self.ranked[sl] = False
        self.per_cdf = None
        self.ep_start[sl], self.ep_last[sl], self.valid[sl] = lo, hi - 1, True
        self.vboot[hi - 1] = 0.0 if terminated else final_val  # App. C Alg. 2 remark 2
        self.truncated_last[hi - 1] = not terminated
        if not terminated and final_obs is not None:
            self.boot_obs[hi - 1] = final_obs
        vals = np.append(np.asarray(val, np.float64), self.vboot[hi - 1])
        vt = vtbc_targets(self.rs[sl], vals, np.ones(L), self.gamma, terminated)
        self.qret[sl] = self.rs[sl] + self.gamma * np.append(vt[1:], self.vboot[hi - 1])  # Q^ret_t = r + gamma V^tbc_{t+1}
        self.episodes.append((lo, L))
        self.size, self.head, self.hi, self.max_len = self.size + L, hi, max(self.hi, hi), max(self.max_len, L)
        while self.episodes and self.size - self.episodes[0][1] >= self.N:  # FIFO: keep >= N samples
            self._remove_oldest()

    # -- sampling
    def sample(self, B: int, rng: np.random.Generator) -> np.ndarray:
        """B distinct stored steps, uniformly (rejection over the slots; App. C Alg. 1)."""
        if self.size < B:
            raise ValueError(f"replay holds {self.size} samples < batch size {B}")
        for _ in range(8):
            cand = rng.integers(0, self.hi, size=B + B // 2 + 16)
            cand = np.unique(cand[self.valid[cand]])
            if len(cand) >= B:
                return rng.permutation(cand)[:B]  # a uniformly random B-subset (the draws are exchangeable)
        return rng.choice(np.flatnonzero(self.valid[: self.hi]), size=B, replace=False)

    def per_rebuild(self) -> None:
        """Rank-based PER: sort the stored steps by decreasing priority (done every stats_every steps)."""
        idx = np.flatnonzero(self.valid[: self.hi])
        self.per_order = idx[np.argsort(-self.prio[idx], kind="stable")]
        self.per_p = np.arange(1, len(idx) + 1, dtype=np.float64) ** -self.per_alpha  # P(rank k) ~ k^-alpha
        self.ranked[:] = False
        self.ranked[idx] = True
        self.per_cdf = None

    def sample_per(self, B: int, rng: np.random.Generator, alpha: float, beta_is: float):
        """Rank-based PER (Schaul et al. 2015) between two re-sorts: a step stored since the last re-sort has no rank and
        is drawn with probability 1/n (n stored steps), as in uniform sampling; the others by rank, P(rank k) ~ k^-alpha,
        scaled to the remaining probability (ranks whose step has been removed since are skipped).
        Returns (indices, IS weights (n P)^-beta divided by the batch maximum); draws with replacement."""
        if self.per_order is None or alpha != self.per_alpha:
            self.per_alpha = alpha
            self.per_rebuild()
        if self.per_cdf is None:  # the memory changed since the last draw: the ranks still stored, the new steps
            still_stored = self.valid[self.per_order] & self.ranked[self.per_order]
            self.per_cdf = np.cumsum(np.where(still_stored, self.per_p, 0.0))
            self.per_new = np.flatnonzero(self.valid[: self.hi] & ~self.ranked[: self.hi])
        n = self.size
        new_share = len(self.per_new) / n
        is_new = rng.uniform(size=B) < new_share
        n_ranked = B - int(is_new.sum())
        idx = np.empty(B, dtype=np.int64)
        prob = np.empty(B)
        idx[is_new] = self.per_new[rng.integers(0, len(self.per_new), B - n_ranked)]
        prob[is_new] = 1.0 / n
        # side="right": a removed step's rank (zero probability, a flat step of the cdf) is never chosen
        ranks = np.searchsorted(self.per_cdf, rng.uniform(0.0, self.per_cdf[-1], n_ranked), side="right")
        idx[~is_new] = self.per_order[ranks]
        prob[~is_new] = (1.0 - new_share) * self.per_p[ranks] / self.per_cdf[-1]
        w = (n * prob) ** -beta_is  # (n P)^-beta
        return idx, w / w.max()

    # -- ReF-ER bookkeeping and Retrace refresh (App. C Alg. 3)
    def update_samples(
        self, idx: np.ndarray, rho: np.ndarray, val: np.ndarray, boot_idx=None, boot_val=None, prio=None
    ) -> None:
        """Store the new rho, V(s) of the sampled steps, keep n_far, and refresh Q^ret of all prior steps (Eq. (8))."""
        idx, rho, val = np.asarray(idx), np.asarray(rho, np.float64), np.asarray(val, np.float64)
        if len(np.unique(idx)) < len(idx):  # (PER draws with replacement) keep the last value of each slot
            keep = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
            idx, rho, val, prio = idx[keep], rho[keep], val[keep], None if prio is None else prio[keep]
        self.n_far += int(is_far_policy(rho, self.cmax).sum()) - int(is_far_policy(self.rho[idx], self.cmax).sum())
        c_old = np.minimum(1.0, self.rho[idx])
        vtbc_old = (1.0 - c_old) * self.val[idx] + c_old * self.qret[idx]  # Eq. (7) with the stored V, rho
        self.rho[idx], self.val[idx] = rho, val
        self._set_la(idx)
        if prio is not None:
            self.prio[idx] = prio
            self.max_prio = max(self.max_prio, float(prio.max()))
        if boot_idx is not None and len(boot_idx):  # truncated ends: V(s_L) refreshed with the current network
            self.vboot[boot_idx] = boot_val
            self.qret[boot_idx] = self.rs[boot_idx] + self.gamma * boot_val
        self.refresh_delta(idx, vtbc_old)

    def _set_la(self, idx) -> None:  # a cut trace (rho = 0) gives e^-690, i.e. 0 in every product that matters
        self.la[idx] = np.log(np.maximum(self.gamma * np.minimum(1.0, self.rho[idx]), 1e-300))

    def refresh_delta(self, idx: np.ndarray, vtbc_old: np.ndarray) -> None:
        """Eq. (8) for every step before each sampled step of its episode (App. C Alg. 3), as a change of Q^ret.

        Eq. (8) is linear between two sampled steps: a change delta_u of V^tbc_u changes V^tbc_j (j < u, down to the
        previous sample) by prod_{i=j}^{u-1} gamma min(1, rho_i) delta_u (one cumulative sum of log(gamma min(1, rho))
        over the concatenated prefixes; underflow to 0 is the right limit), and Q^ret_{j-1} by gamma times that. The
        deltas of one episode's samples are chained top-down (a short loop over a sample's rank in its episode)."""
        starts = self.ep_start[idx]
        order = np.lexsort((-idx, starts))  # by episode, latest sampled first
        t, st, vo = idx[order], starts[order], vtbc_old[order]
        n, first = len(t), np.append(True, st[1:] != st[:-1])  # first: the latest sample of its episode
        ep_first = np.flatnonzero(first)
        rank = np.arange(n) - np.repeat(ep_first, np.diff(np.append(ep_first, n)))
        m, s = t[first], st[first]
        lens = m - s + 1
        offs = np.cumsum(lens) - lens
        j = np.repeat(s - offs, lens) + np.arange(int(lens.sum()))  # concatenated slot indices of all prefixes [s, m]
        p_samp = np.repeat(offs - s, np.diff(np.append(ep_first, n))) + t  # positions of the samples in it
        R = np.cumsum(self.la[j][::-1])[::-1]  # R_p = sum_{q >= p} log a_q (differences give in-episode products)
        c = np.minimum(1.0, self.rho[t])
        base = (1.0 - c) * self.val[t]
        delta = np.zeros(n)
        for r in range(int(rank.max()) + 1):  # chain the samples of each episode from the latest one down
            sel = np.flatnonzero(rank == r)
            q = self.qret[t[sel]]
            if r > 0:  # Q^ret_t already moved by the change coming down from the sample above
                up = sel - 1
                q = q + self.gamma * np.exp(R[p_samp[sel] + 1] - R[p_samp[up]]) * delta[up]
            delta[sel] = base[sel] + c[sel] * q - vo[sel]  # Eq. (7): new V^tbc_t - old V^tbc_t
        by_pos = np.argsort(p_samp)  # pieces (previous sample, this sample] tile the concatenation
        piece = np.diff(np.append(-1, p_samp[by_pos]))
        # change of V^tbc_j (Eq. (8), linear between samples), times gamma: the change of Q^ret_{j-1} = r_j + gamma V^tbc_j
        dq = np.exp(R - np.repeat(R[p_samp[by_pos]], piece)) * np.repeat(self.gamma * delta[by_pos], piece)
        dq[offs] = 0.0  # the first step of an episode has no predecessor (slot j - 1 is another episode's: += 0)
        self.qret[j - 1] += dq

    def recompute_all(self) -> None:
        """Q^ret of every stored step from the stored V, rho and the current reward scale (one scan over the RM)."""
        if (n := self.hi) == 0:
            return
        valid = self.valid[:n]
        c = np.where(valid, np.minimum(1.0, self.rho[:n]), 0.0)
        last = valid & (np.arange(n) == self.ep_last[:n])
        a = np.where(last, 0.0, self.gamma * c)
        b = np.where(valid, (1.0 - c) * self.val[:n] + c * self.rs[:n], 0.0)
        b[last] += self.gamma * c[last] * self.vboot[:n][last]  # (a = 0 on empty slots: c = 0 there)
        x = reverse_linear_scan(a, b, self.max_len)
        nxt = np.append(x[1:], 0.0)
        nxt[last] = self.vboot[:n][last]
        self.qret[:n] = np.where(valid, self.rs[:n] + self.gamma * nxt, 0.0)

    def recount_far(self, cmax: float) -> None:
        """Exact n_far with the current c_max."""
        self.cmax = cmax
        self.n_far = int((is_far_policy(self.rho[: self.hi], cmax) & self.valid[: self.hi]).sum())

    def far_fraction(self) -> float:
        return self.n_far / max(1, self.size)

    # -- statistics (App. B)
    def state_stats(self):
        """Eqs. (14)-(15): mean and std (+ eps 1e-7) of the stored states; a constant input: std 1 (authors' code)."""
        o = self.obs[: self.hi][self.valid[: self.hi]].astype(np.float64)
        std = o.std(0)
        return o.mean(0), np.where(std < 1e-7, 1.0, std) + 1e-7

    def update_reward_scale(self, eps: float = 1e-7) -> float:
        """Eq. (16): sigma_r = sqrt(mean r^2) over the RM (no mean shift); rescale rewards and recompute Q^ret."""
        r = self.rew[: self.hi][self.valid[: self.hi]]
        self.reward_scale = float(np.sqrt(np.mean(r * r))) + eps if len(r) else 1.0
        self.rs[: self.hi] = self.rew[: self.hi] / self.reward_scale
        self.recompute_all()
        return self.reward_scale

    def state_dict(self) -> dict:
        return (
            {k: getattr(self, k)[: self.hi].copy() for k in self.ARRAYS if k not in self.NOT_SAVED}
            | {k: getattr(self, k) for k in self.SCALARS}
            | {"episodes": list(self.episodes)}
        )

    def load_state_dict(self, d: dict) -> None:
        if d["N"] != self.N or d["cap"] != self.cap:
            raise SystemExit(f"error: checkpoint replay has N={d['N']}, this run N={self.N}")
        for k in self.ARRAYS.keys() - set(self.NOT_SAVED):
            getattr(self, k)[: len(d[k])] = d[k]
        for k in self.SCALARS:
            setattr(self, k, d[k])
        self.episodes = deque(tuple(e) for e in d["episodes"])
        self._set_la(np.arange(self.hi))


# LEARNER STEP (App. C Alg. 3)
def train_step(
    agent,
    optimizer,
    rm: EpisodeReplay,
    state: dict,
    args: Args,
    device,
    rng: np.random.Generator,
    obs_mean: torch.Tensor,
    obs_std: torch.Tensor,
    bookkeeping: bool = True,
) -> torch.Tensor:
    """One gradient step: sample B steps, ReF-ER loss, Adam, write back rho/V, refresh Q^ret, update beta (`state`:
    k, beta). Returns CPU stats [loss, policy_loss, value_loss, kl_mu_pi, far_in_batch, mean_rho]; a non-finite
    loss raises FloatingPointError before the optimizer step and the replay are touched (the NaN guard).
    bookkeeping=False skips the write-back, Q^ret refresh and n_far (the benchmark's bare learner)."""
    k = state["k"]
    rm.cmax = cmax = refer_cmax(k, args.C, args.A)  # Eq. (13); --refer none: only to count far-policy samples
    for g in optimizer.param_groups:
        g["lr"] = annealed_lr(k, args.learning_rate, args.A)  # Eq. (13)
    if args.per == "rank":
        beta_is = min(1.0, args.per_beta0 + (1.0 - args.per_beta0) * args.A * k)
        idx, w = rm.sample_per(args.batch_size, rng, args.per_alpha, beta_is)
        weights = torch.as_tensor(w, dtype=torch.float32, device=device)
    else:
        idx, weights = rm.sample(args.batch_size, rng), None
    boot_idx = idx[rm.truncated_last[idx]]  # truncated last steps: also refresh V(s_L)
    obs = np.concatenate([rm.obs[idx], rm.boot_obs[boot_idx]]) if len(boot_idx) else rm.obs[idx]
    obs_t = (torch.as_tensor(obs, device=device) - obs_mean) / obs_std
    act, mu_mean, mu_std = (torch.as_tensor(x[idx], device=device) for x in (rm.act, rm.mu_mean, rm.mu_std))
    qret = torch.as_tensor(rm.qret[idx], dtype=torch.float32, device=device)
    mean, std, value = agent(obs_t)
    B = args.batch_size
    loss, info = refer_loss(
        mean[:B],
        std[:B],
        value[:B],
        act,
        mu_mean,
        mu_std,
        qret,
        state["beta"],
        cmax,
        args.refer,
        args.kl_direction,
        args.logrho_clip,
        weights,
    )
    # one device->host copy per step: per-sample rho, V, |err|, V(s_L) and the scalar stats
    stats = torch.stack(
        [
            loss.detach(),
            info["policy_loss"],
            info["value_loss"],
            info["kl_mu_pi"].mean(),
            info["far"].float().mean(),
            info["rho"].mean(),
        ]
    )
    host = torch.cat([info["rho"], value.detach(), info["abs_err"], stats]).double().cpu().numpy()
    # NaN guard before the step, so the weights and Adam's moments stay finite; on the loss terms only (a masked or
    # weight-0 D_KL may be inf)
    if not np.isfinite(host[-6:-3]).all():
        raise FloatingPointError(f"non-finite loss at gradient step {k}: loss, policy, value = {host[-6:-3]}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    nb = len(boot_idx)
    if bookkeeping:  # host = [rho (B) | V(s) (B) | V(s_L) (nb) | |err| (B) | stats (6)]
        rm.update_samples(
            idx,
            host[:B],
            host[B : 2 * B],
            boot_idx,
            host[2 * B : 2 * B + nb],
            prio=host[2 * B + nb : 3 * B + nb] if args.per == "rank" else None,
        )
    if args.refer != "none":  # Eq. (12), far fraction from each stored step's most recent rho
        state["beta"] = refer_beta_update(state["beta"], rm.far_fraction(), args.D, args.beta_lr)
    state["k"] = k + 1
    return torch.from_numpy(host[-6:])


def learn(
    agent,
    optimizer,
    rm: EpisodeReplay,
    state: dict,
    args: Args,
    device,
    rng: np.random.Generator,
    obs_mean: torch.Tensor,
    obs_std: torch.Tensor,
    steps_due: float,
    stats_sum: torch.Tensor,
    publish,
) -> int:
    """The learner's turn between two reads of the rings (App. C Alg. 1): gradient steps while k < steps_due = (t - t0)/F,
    at most GRAD_STEPS_PER_READ; every stats_every steps first the replay statistics (App. B); then `publish()` hands
    the new weights to the actors. Adds train_step's stats to `stats_sum`; moves obs_mean, obs_std in place (with
    --state-stats-rate). Returns the number of gradient steps done."""
    done = 0
    while state["k"] < steps_due and done < GRAD_STEPS_PER_READ:
        k = state["k"]
        if k > 0 and k % args.stats_every == 0:  # App. B: every 1000 steps
            rm.update_reward_scale()
            rm.recount_far(refer_cmax(k, args.C, args.A))
            if args.per == "rank":
                rm.per_rebuild()
            for current, target in zip((obs_mean, obs_std), rm.state_stats() if args.state_stats_rate else ()):
                current += args.state_stats_rate * (torch.as_tensor(target, device=device) - current)
        stats_sum += train_step(agent, optimizer, rm, state, args, device, rng, obs_mean, obs_std)
        done += 1
    if done:
        publish()
    return done


# ACTOR PROCESS (module-level so spawn can pickle it)
def ring_width(obs_dim: int, act_dim: int) -> int:
    """Columns of one ring row: [s_t | u_t | mean | std | V(s_t), r_{t+1}, terminated, truncated | s_T (truncated
    ends) | V(s_T), episodic return, episodic length]."""
    return 2 * obs_dim + 3 * act_dim + 7


def numpy_params(agent: Agent, std_map: str, norm: np.ndarray) -> dict:
    """float64 numpy copies of the weights, sigma and the state statistics for `numpy_forward`."""
    net = {name: p.detach().cpu().numpy().astype(np.float64) for name, p in agent.named_parameters()}
    std = std_from_param(agent.std_param.detach().cpu(), std_map).numpy().astype(np.float64)
    return net | {"std": std, "norm": np.array(norm, dtype=np.float64)}


def numpy_forward(net: dict, obs: np.ndarray, residual: bool = False):
    """Agent.forward for one raw state in numpy (actors: ~10x cheaper than a 1-row torch call): (mean, std, V)."""
    x = (obs - net["norm"][0]) / net["norm"][1]
    h = net["l1.weight"] @ x + net["l1.bias"]
    h = h / (1.0 + np.abs(h))  # Softsign
    h2 = net["l2.weight"] @ h + net["l2.bias"]
    h2 = h2 / (1.0 + np.abs(h2))
    h = h + h2 if residual else h2
    out = net["out.weight"] @ h + net["out.bias"]
    return out[1:], net["std"], float(out[0])


def actor_loop(
    actor_id: int,
    args: Args,
    obs_dim: int,
    act_dim: int,
    shared_weights: torch.Tensor,
    shared_norm: torch.Tensor,
    control: torch.Tensor,
    rings: torch.Tensor,
    written: torch.Tensor,
    read: torch.Tensor,
    seed: int,
    run_name: str,
    stop_event,
) -> None:
    """Step one env with the latest shared weights; write each transition with mu = (mean, std) and V(s) to the ring.
    control = [allowed total env steps, weights version]; written[i]/read[i]: ring counters of actor i."""
    env = make_env(args.env_id, seed, args.capture_video and actor_id == 0, run_name)
    low, high = env.action_space.low.astype(np.float64), env.action_space.high.astype(np.float64)
    rng = np.random.default_rng(seed)
    agent = Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual)
    version, net, ep_ret, ep_len = -1, {}, 0.0, 0
    ring, R = rings[actor_id].numpy(), rings.shape[1]
    written_np, read_np, control_np = written.numpy(), read.numpy(), control.numpy()
    obs, _ = env.reset(seed=seed)
    while not stop_event.is_set():
        n = int(written_np[actor_id])
        if n - int(read_np[actor_id]) >= R or int(written_np.sum()) >= int(control_np[0]):  # ring full or F gate
            time.sleep(0.002)  # gated by the learner: a 2 ms nap costs nothing against >= 32 steps of slack
            continue
        if int(control_np[1]) != version:  # latest weights and state statistics (shared memory)
            version = int(control_np[1])
            torch.nn.utils.vector_to_parameters(shared_weights.clone(), agent.parameters())
            net = numpy_params(agent, args.std_map, shared_norm.numpy().reshape(2, obs_dim))
        mean, std, v = numpy_forward(net, obs, args.residual)
        u = mean + std * sample_noise(rng, act_dim, args.action_noise)  # a ~ mu_t (App. C Alg. 2)
        next_obs, r, term, trunc, _ = env.step(to_env_action(u, low, high, args.clip_actions))
        ep_ret, ep_len = ep_ret + float(r), ep_len + 1
        truncated = trunc and not term  # time limit: s_T and V(s_T) for the bootstrap
        end = (next_obs, numpy_forward(net, next_obs, args.residual)[2]) if truncated else (np.zeros(obs_dim), 0.0)
        ring[n % R] = np.concatenate([obs, u, mean, std, (v, r, term, truncated), end[0], (end[1], ep_ret, ep_len)])
        written_np[actor_id] = n + 1  # publish after the row is complete
        obs = next_obs
        if term or trunc:
            (obs, _), ep_ret, ep_len = env.reset(), 0.0, 0
    env.close()


def store_episodes(ring, written, read, partial: list, rm: EpisodeReplay, obs_dim: int, act_dim: int) -> tuple:
    """The learner's reader: take one actor's new ring rows (read..written, modulo the ring size), advance `read`,
    append them to its running episode `partial` (row blocks) and store every episode they complete (App. C Alg. 2);
    returns (rows read, [(return, length)] of those episodes)."""
    n_written = int(written)
    rows = ring.numpy()[np.arange(int(read), n_written) % len(ring)]  # a copy (fancy indexing)
    read.fill_(n_written)  # the actor may overwrite these rows now
    p, q = obs_dim, obs_dim + 3 * act_dim
    finished, prev = [], 0
    for e in np.flatnonzero(rows[:, q + 2] + rows[:, q + 3] > 0):  # terminated or truncated at row e
        ep = np.concatenate(partial + [rows[prev : e + 1]])
        partial.clear()
        prev, last = e + 1, ep[-1]
        rm.add_episode(
            ep[:, :p],
            ep[:, p : p + act_dim],
            ep[:, p + act_dim : p + 2 * act_dim],
            ep[:, p + 2 * act_dim : q],
            ep[:, q + 1],
            ep[:, q],
            bool(last[q + 2]),
            final_val=float(last[q + 4 + obs_dim]),
            final_obs=last[q + 4 : q + 4 + obs_dim],
        )
        finished.append((float(last[-2]), int(last[-1])))
    if prev < len(rows):
        partial.append(rows[prev:])
    return len(rows), finished


@torch.no_grad()
def evaluate(agent, env_id: str, seed: int, episodes: int, obs_mean, obs_std, device, clip: bool = False) -> list[float]:
    """Deterministic policy (mean action) returns."""
    env = make_env(env_id, seed)
    low, high = env.action_space.low.astype(np.float64), env.action_space.high.astype(np.float64)
    returns = []
    for ep in range(episodes):
        # a stop signal ends the evaluation between episodes
        check_stop()
        (obs, _), done, ret = env.reset(seed=seed + ep), False, 0.0
        while not done:
            x = (torch.as_tensor(obs, dtype=torch.float32, device=device)[None] - obs_mean) / obs_std
            m = agent(x)[0][0].cpu().numpy().astype(np.float64)
            obs, r, term, trunc, _ = env.step(to_env_action(m, low, high, clip))
            ret, done = ret + float(r), term or trunc
        returns.append(ret)
    env.close()
    return returns


if __name__ == "__main__":
    stop_on_signals()  # SIGINT (even inherited-ignored) and SIGTERM: stop every process, write summary.json
    # tyro (--help grouped: common / environment / method); --resume: the checkpoint's flags, given flags override
    args, ckpt, overridden = parse_run_args(Args, "vracer_refer.py", FIXED_ON_RESUME)
    validate_args(args)  # only the checks between flags; all before anything heavy and before RunLogger
    left = args.total_timesteps - (ckpt["global_step"] if ckpt else 0)
    refill = 0 if ckpt and ckpt["replay"] is not None else args.learning_starts  # env steps before a gradient step
    if left <= refill:  # a run, resumed or not, that would end before it learns
        raise SystemExit(
            f"error: --total-timesteps {args.total_timesteps:,} leaves {left:,} env steps, not more than the "
            f"{refill:,} the replay memory must hold before the first gradient step (--learning-starts"
            f"{'; the checkpoint has no replay memory' if ckpt and refill else ''})"
        )

    # MEMORY: the replay's RAM, refused at start-up when it cannot fit
    probe = make_env(args.env_id, args.seed)
    obs_dim, act_dim = probe.observation_space.shape[0], probe.action_space.shape[0]
    max_ep_len = probe.spec.max_episode_steps or 1000
    probe.close()
    check_memory(EpisodeReplay.bytes_needed(args.buffer_size, obs_dim, act_dim, max_ep_len), "--buffer-size")

    logger = start_run(args, ckpt, args.env_id)  # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's
    run_name = logger.run_name

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    set_learner_threads(args.num_actors)  # the cores the actors leave free

    # SETUP: network, optimizer, replay, shared memory for the actors
    agent = Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
    rm = EpisodeReplay(args.buffer_size, obs_dim, act_dim, args.gamma, max_ep_len)
    rng = np.random.default_rng(args.seed)
    obs_mean, obs_std = torch.zeros(obs_dim, device=device), torch.ones(obs_dim, device=device)
    state = {"k": 0, "beta": args.beta_init if args.refer != "none" else 1.0}
    global_step, t0, started, stats_ready = 0, 0, False, False
    if ckpt:  # restore, then one line; with the replay memory, learning continues at once
        started = ckpt["replay"] is not None
        load_state_dicts(ckpt, model=agent, optimizer=optimizer, replay=rm if started else None)
        state, global_step, t0, stats_ready, rng, rm.reward_scale = (
            ckpt[k] for k in ("state", "global_step", "t0", "stats_ready", "np_rng", "reward_scale")
        )
        obs_mean, obs_std = ckpt["obs_mean"].to(device), ckpt["obs_std"].to(device)
        set_rng_state(ckpt["rng"])
        replay = f"replay memory ({rm.size:,} samples)" if started else f"no replay memory (refilled in {refill:,}+ steps)"
        print(
            f"resumed {args.resume} at step {global_step:,}: network, Adam, k = {state['k']:,}, beta, statistics, RNGs, "
            f"{replay}; flags from this command line: {', '.join(overridden) or 'none'}; runs to step "
            f"{args.total_timesteps:,}",
            flush=True,
        )

    procs = ProcessGroup(torch.multiprocessing.get_context(args.start_method))

    def shared(*shape, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype).share_memory_()

    shared_weights, shared_norm = shared(sum(p.numel() for p in agent.parameters())), shared(2 * obs_dim)
    control = shared(2, dtype=torch.int64)  # [allowed env steps, weights version]
    rings = shared(args.num_actors, args.ring_size, ring_width(obs_dim, act_dim), dtype=torch.float64)
    written, read = shared(args.num_actors, dtype=torch.int64), shared(args.num_actors, dtype=torch.int64)

    def publish() -> None:
        shared_weights.copy_(torch.nn.utils.parameters_to_vector(agent.parameters()).detach().cpu())
        shared_norm.copy_(torch.cat([obs_mean, obs_std]).cpu())
        control[1] += 1

    def allow_steps() -> None:  # App. C Alg. 1: "while t < F k: advance the environment", 32 steps/actor of slack
        limit = t0 + int(state["k"] * args.F) + 32 * args.num_actors if started else args.total_timesteps
        control[0] = min(args.total_timesteps, limit) - base_step

    base_step = global_step  # actors count env steps from 0 in this process: control[0] is relative to it
    publish()
    allow_steps()

    partial = [[] for _ in range(args.num_actors)]  # rows of each actor's running episode
    recent_returns: deque = deque(maxlen=20)
    acc, acc_n, last_log_k, last_ckpt, error = torch.zeros(6, dtype=torch.float64), 0, state["k"], global_step, None
    start_time, last_time, last_step = time.time(), time.time(), global_step
    try:
        for i in range(args.num_actors):
            actor_seed = args.seed + 1000 * i + global_step  # resumed runs do not replay the same noise
            procs.start(
                actor_loop,
                (
                    i,
                    args,
                    obs_dim,
                    act_dim,
                    shared_weights,
                    shared_norm,
                    control,
                    rings,
                    written,
                    read,
                    actor_seed,
                    run_name,
                    procs.stop_event,
                ),
                name=f"actor-{i}",
            )
        while True:
            # COLLECT: read the actor rings, assemble whole episodes, store them (App. C Alg. 2)
            for i in range(args.num_actors):
                n_rows, finished = store_episodes(rings[i], written[i], read[i], partial[i], rm, obs_dim, act_dim)
                global_step += n_rows
                for ep_return, ep_length in finished:
                    recent_returns.append(ep_return)
                    logger.log(global_step, {"charts/episodic_return": ep_return, "charts/episodic_length": ep_length})
            if not started and rm.size >= args.learning_starts:
                # App. C Alg. 1: initial state statistics (Eqs. (14)-(15)) and reward scale (Eq. (16))
                if not stats_ready:
                    obs_mean, obs_std = (torch.as_tensor(x, dtype=torch.float32, device=device) for x in rm.state_stats())
                    stats_ready = True
                rm.update_reward_scale()
                rm.recount_far(refer_cmax(state["k"], args.C, args.A))
                started, t0 = True, global_step - int(state["k"] * args.F)  # resumed runs: k continues at once
                publish()
                print(f"learning starts at env step {global_step} (replay holds {rm.size} samples)", flush=True)

            # LEARN: keep k <= (t - t0)/F (App. C Alg. 1), then publish the new weights
            did = 0
            if started:
                did = learn(
                    agent,
                    optimizer,
                    rm,
                    state,
                    args,
                    device,
                    rng,
                    obs_mean,
                    obs_std,
                    (global_step - t0) / args.F,
                    acc,
                    publish,
                )
                acc_n += did
            allow_steps()

            # LOG: metrics and a progress line every log_every gradient steps; a progress line every 10k collected
            k = state["k"]
            if (k - last_log_k >= args.log_every and acc_n) if started else global_step - last_step >= 10_000:
                now = time.time()
                sps = (global_step - last_step) / max(1e-9, now - last_time)
                loss, extra = None, f"collecting {rm.size}"
                if started:
                    a = (acc / acc_n).tolist()
                    sigma = float(std_from_param(agent.std_param.detach(), args.std_map).mean())
                    logger.log(
                        global_step,
                        {
                            "charts/SPS": sps,
                            "charts/learning_rate": annealed_lr(k, args.learning_rate, args.A),
                            "charts/grad_steps": k,
                            "losses/loss": a[0],
                            "losses/policy_loss": a[1],
                            "losses/value_loss": a[2],
                            "refer/kl": a[3],
                            "refer/far_policy_frac": rm.far_fraction(),
                            "refer/far_batch_frac": a[4],
                            "refer/avg_rho": a[5],
                            "refer/beta": state["beta"],
                            "refer/c_max": refer_cmax(k, args.C, args.A),
                            "stats/reward_scale": rm.reward_scale,
                            "stats/sigma_mean": sigma,
                            "stats/replay_size": rm.size,
                        },
                    )
                    loss, extra = a[2], f"beta {state['beta']:.3f} far {rm.far_fraction():.3f} kl {a[3]:.3g}"
                    acc.zero_()
                    acc_n, last_log_k = 0, k
                logger.progress(
                    global_step, sps, np.mean(recent_returns) if recent_returns else None, "value_loss", loss, extra
                )
                last_time, last_step = now, global_step

            # CHECKPOINT
            if args.checkpoint_every and global_step - last_ckpt >= args.checkpoint_every:
                save_checkpoint(
                    logger.dir / "checkpoint.pt",
                    {
                        "script": "vracer_refer.py",
                        "run_name": run_name,
                        "args": vars(args),
                        "dims": (obs_dim, act_dim),
                        "state": dict(state),
                        "global_step": global_step,
                        "t0": t0,
                        "stats_ready": stats_ready,
                        "obs_mean": obs_mean.cpu(),
                        "obs_std": obs_std.cpu(),
                        "reward_scale": rm.reward_scale,
                        "np_rng": rng,
                        "rng": rng_state(),
                        **state_dicts(
                            model=agent, optimizer=optimizer, replay=rm if args.checkpoint_replay and started else None
                        ),
                    },
                )
                last_ckpt = global_step

            if global_step >= args.total_timesteps and (not started or state["k"] >= (global_step - t0) / args.F):
                break
            procs.check()  # every iteration: a dead actor stops the run with its reason
            if not did:
                time.sleep(0.0005)
    except (KeyboardInterrupt, StopRun, FloatingPointError) as e:  # FloatingPointError: train_step's NaN guard
        error = e
    finally:
        procs.stop()

    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    def save_model():
        torch.save(
            {"model": agent.state_dict(), "args": vars(args), "obs_mean": obs_mean.cpu(), "obs_std": obs_std.cpu()},
            path := logger.dir / f"{args.exp_name}.model",
        )
        return path

    def final_eval() -> dict:
        returns = evaluate(
            agent, args.env_id, args.seed + 10_000, args.eval_episodes, obs_mean, obs_std, device, args.clip_actions
        )
        for r in returns:
            logger.log(global_step, {"eval/episodic_return": r})
        return {"eval_return_mean": float(np.mean(returns))}

    finish_run(
        logger,
        error,
        {
            "global_step": global_step,
            "grad_steps": state["k"],
            "beta": state["beta"],
            "final_return_mean20": float(np.mean(recent_returns)) if recent_returns else None,
            "env_steps_per_s": (global_step - base_step) / max(1e-9, time.time() - start_time),
        },
        save_model if args.save_model else None,
        final_eval if args.save_model and args.eval_episodes else None,
    )

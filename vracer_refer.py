# docs and results: README.md#vracer_referpy-v-racer-with-remember-and-forget-experience-replay
"""V-RACER with Remember-and-Forget Experience Replay (Novati & Koumoutsakos 2019, https://arxiv.org/abs/1807.05827).

Symbols: s_t state; u_t action in the normalised space, a_t = u_t rescaled to the bounds; r_{t+1} reward; L episode
length; mu_t the policy that acted, pi = N(m(s), sigma^2) the current one; rho_t = pi(u_t|s_t) / mu(u_t|s_t) and
c_t = min(1, rho_t); gamma discount; V(s) value; Q^ret and V^tbc the Retrace targets; t env steps, k gradient steps;
N, B, F, C, A, D, beta, eta: the paper's hyperparameters (see Args).

Paper parts (gymnasium MuJoCo tasks)
- Network (Sec. 2, App. A) `Agent`: MLP 2 x 128 Softsign, V(s) and the Gaussian mean, a state-independent std.
- Off-policy policy gradient (Eq. (5)) and value loss (Eq. (9)) `refer_loss`; Retrace / V^tbc (Eqs. (6)-(8))
  `EpisodeReplay.vtbc_at`, `qret_at`: the recursion over the stored V, rho, by blocks (`compose_maps`).
- ReF-ER Rules 1 and 2 (Eqs. (10)-(11)) `refer_loss`, `gaussian_kl`; beta (Eq. (12)) `refer_beta_update`; c_max and
  lr annealing (Eq. (13)) `refer_cmax`, `annealed_learning_rate`; ablations (Sec. 5) `--refer full|rule1|rule2|none`,
  `--per rank`.
- Replay memory (Sec. 3, App. B, C) `EpisodeReplay`: whole episodes, FIFO, state standardisation and reward scaling
  (Eqs. (14)-(16)); truncated-normal actions rescaled to the bounds (App. A, B) `sample_noise`, `to_env_action`.
- Master algorithm (App. C Alg. 1): `actor_loop` writes transitions to shared-memory rings, `store_episodes` reads them
  into the replay; `learn` keeps F = t/k.

Defaults: gamma 0.995, C 4, A 5e-7, D 0.1, N = N_start = 2**18, B 256, lr 1e-4, F 1, Sigma = 0.2 I, softplus std,
D_KL(mu || pi) (App. A, Sec. 3, Alg. 1); stats every 1000 steps, eps 1e-7 (App. B). Authors' code (paper silent;
cselab/smarties edaef91): beta_0 0, beta rate 1e-4, log rho clip 7, Adam eps 1.19e-7; PER alpha 0.5, beta0 0.5.

Differences from the paper (long form: README.md, section vracer_refer.py)
- The authors' code stores Q^ret_t and refreshes it for every prior step after each gradient step; here Q^ret_t is
  computed when read from the stored V and rho by the same recursion (the same values, a cost flat in N); at a
  reward-scale update the stored V keep their old scale until resampled; n_far is kept incrementally, recounted
  every `stats_every`.
- Eq. (13)'s t counts gradient steps; PER weights / batch max; PER re-sorts every `stats_every` steps, and steps stored
  since the last re-sort are drawn uniformly (probability 1/n each) until the next one.
- Glorot init U(+-sqrt(6/(fi+fo))) (the paper's formula read as a typo); rho and KL use untruncated densities.
- Actors may act with weights a publish or more old (read whole under a seqlock, `read_published`); each transition
  stores the mu it used and its version, so rho stays exact.
- Not implemented: `farpolfrac` forgetting, DDPG / NAF with ReF-ER, the advantage of App. E.
- `--residual` (authors' code: a residual connection on hidden layer 2) is off by default.
Autoreset: none (each actor resets its env; truncation bootstraps from the true s_T). `--resume` restores the learner
exactly; actors restart their episodes, re-seeded.
Copying this file: it needs common/{mujoco_env,args,logger,checkpoint,processes,video}.py.
"""

import os

# Before numpy is imported: the actors' 1-row matrix-vector products must not spin up BLAS threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

from common.processes import install_stop_handling

# Ctrl-C, SIGTERM and SIGHUP are handled from here on, during the heavy imports below too (common/processes.py)
if __name__ == "__main__":
    install_stop_handling()

import numpy as np
import torch
import torch.nn as nn

from common.args import CommonArgs, parse_run_args, require
from common.checkpoint import (
    load_state_dicts,
    save_run_checkpoint,
    seed_everything,
    select_device,
    set_rng_state,
    state_dicts,
)
from common.logger import MetricAverager, start_run
from common.mujoco_env import check_mujoco_env_id, make_mujoco_env
from common.processes import ProcessGroup, StopRun, check_memory, check_stop, finish_run, set_learner_threads
from common.video import check_video_support


# CommonArgs holds the flags all four scripts share: --seed, --cuda, --track, --save-model, --checkpoint-every, ...
@dataclass
class Args(CommonArgs):
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


# The rule2 ablation clips rho at this in the policy gradient (Sec. 5.3).
RULE2_RHO_MAX = 1e3
# The learner reads the actor rings at least every this many gradient steps.
GRAD_STEPS_PER_READ = 64


def make_env(env_id: str, seed: int, capture_video: bool = False, run_name: str = ""):
    video_folder = f"videos/{run_name}" if capture_video else None
    return make_mujoco_env(env_id, seed, capture_video=capture_video, video_folder=video_folder)


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
        self.l1 = nn.Linear(obs_dim, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        # one head: output 0 is V(s), outputs 1.. the mean
        self.out = nn.Linear(hidden, 1 + act_dim)
        self.std_param = nn.Parameter(torch.full((act_dim,), std_param_init(init_std, std_map)))
        self.std_map = std_map
        self.residual = residual
        # App. A: Glorot uniform for the weights and, as in the authors' code, the biases
        for layer in (self.l1, self.l2):
            bound = float(np.sqrt(6.0 / (layer.in_features + layer.out_features)))
            for p in (layer.weight, layer.bias):
                nn.init.uniform_(p, -bound, bound)
        # App. A: U(+-0.1/sqrt(f_i)) gives near-zero outputs at the start
        bound = 0.1 / float(np.sqrt(hidden))
        nn.init.uniform_(self.out.weight, -bound, bound)
        nn.init.zeros_(self.out.bias)

    def forward(self, obs: torch.Tensor):
        h = nn.functional.softsign(self.l1(obs))
        h2 = nn.functional.softsign(self.l2(h))
        h = h + h2 if self.residual else h2
        out = self.out(h)
        std = std_from_param(self.std_param, self.std_map).expand(out.shape[0], -1)
        # the head's output 0 is V(s), outputs 1.. the mean
        value = out[:, 0]
        mean = out[:, 1:]
        return mean, std, value


# ALGORITHM PIECES: small pure functions, each with the paper's equation numbers in comments
def compose_maps(decay: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The maps x_i = offset_i + decay_i x_{i+1} of each row composed from its first column to its last:
    x_0 = B + A x_end with A = prod_i decay_i and B = sum_i (prod_{j<i} decay_j) offset_i (the rows of Eq. (8)).
    Oracle: tests/test_vracer_replay.py::test_vtbc_read_by_blocks_matches_textbook."""
    product = np.cumprod(decay, axis=1)
    return product[:, -1], offset[:, 0] + np.einsum("ij,ij->i", product[:, :-1], offset[:, 1:])


def refer_cmax(step: int, C: float, A: float) -> float:
    """Eq. (13): c_max(k) = 1 + C / (1 + A k), k = gradient steps.
    Oracle: tests/test_vracer_estimators.py::test_refer_cmax_and_lr."""
    return 1.0 + C / (1.0 + A * step)


def annealed_learning_rate(step: int, lr: float, A: float) -> float:
    """Eq. (13): eta(k) = eta / (1 + A k). Oracle: tests/test_vracer_estimators.py::test_refer_cmax_and_lr."""
    return lr / (1.0 + A * step)


def refer_beta_update(beta: float, far_fraction: float, D: float, eta: float) -> float:
    """Eq. (12): beta <- (1 - eta) beta if n_far/N > D, else (1 - eta) beta + eta.
    Oracle: tests/test_vracer_estimators.py::test_refer_beta_update."""
    return (1.0 - eta) * beta if far_fraction > D else (1.0 - eta) * beta + eta


def is_far_policy(rho, cmax: float):
    """Rule 1: near-policy iff 1/c_max < rho < c_max (Sec. 3), so a NaN rho is far; numpy arrays and tensors."""
    return ~((rho > 1.0 / cmax) & (rho < cmax))


def gaussian_kl(mean_p, std_p, mean_q, std_q):
    """D_KL(p || q) of diagonal Gaussians, summed over dimensions (closed form).
    Oracle: tests/test_vracer_estimators.py::test_gaussian_kl_both_directions_against_torch."""
    return (torch.log(std_q / std_p) + (std_p**2 + (mean_p - mean_q) ** 2) / (2.0 * std_q**2) - 0.5).sum(-1)


def gaussian_logprob(act, mean, std):
    """log N(a; m, diag(std^2)) summed over dimensions (untruncated: the 3-sigma truncation constant cancels in rho)."""
    z = (act - mean) / std
    return (-0.5 * z * z - torch.log(std) - 0.5 * float(np.log(2.0 * np.pi))).sum(-1)


class Batch(NamedTuple):
    """What the replay stores of B sampled steps, as tensors: u_t, mu_t = N(mu_mean, mu_std^2) and Q^ret_t, plus the
    PER importance weights (None: uniform sampling)."""

    action: torch.Tensor
    mu_mean: torch.Tensor
    mu_std: torch.Tensor
    qret: torch.Tensor
    weights: torch.Tensor | None = None


def refer_loss(
    mean,
    std,
    value,
    batch: Batch,
    beta: float,
    cmax: float,
    refer: str = "full",
    kl_direction: str = "mu_pi",
    logrho_clip: float = 7.0,
):
    """V-RACER + ReF-ER loss for one mini-batch; its gradient is -1/B sum_i g^ReF-ER_i (Eq. (10), App. C Alg. 3).

    mean, std, value: the network's pi and V(s) at the sampled states. Per sample: near-policy (1/c_max < rho < c_max):
    beta (L_offPG + L_tbc) + (1 - beta) D_KL; far: (1 - beta) D_KL (Rule 1). rule1: beta_eff = 1; rule2: all near
    (PG rho clipped at RULE2_RHO_MAX); none: all near, beta_eff = 1.
    Returns (loss, info): per-sample detached rho, far, kl_mu_pi, abs_err, and the scalar losses.
    Oracles: tests/test_vracer_estimators.py::test_per_sample_gradient_matches_hand_derivation,
    ::test_ablations_change_the_gradient_as_described;
    tests/test_vracer_loop.py::test_two_learner_steps_equal_a_hand_written_update."""
    batch_size = mean.shape[0]
    logmu = gaussian_logprob(batch.action, batch.mu_mean, batch.mu_std)
    # rho = pi/mu; pi = mu = 0 (both log-densities -inf) gives NaN, which counts as far and is zeroed downstream
    with torch.no_grad():
        logpi = gaussian_logprob(batch.action, mean, std)
        rho = torch.exp(torch.clamp(logpi - logmu, -logrho_clip, logrho_clip))
        rho = torch.nan_to_num(rho, nan=0.0)
    # Rule 1
    far = is_far_policy(rho, cmax)
    near = ~far if refer in ("full", "rule1") else torch.ones_like(far)
    # Masked-out samples take log pi at a = mean with std 1 (the double-where trick), so that no 0 * inf = NaN reaches
    # the gradient.
    keep = near[:, None]
    safe_action = torch.where(keep, batch.action, mean.detach())
    logpi_near = gaussian_logprob(safe_action, mean, torch.where(keep, std, torch.ones_like(std)))
    # Eq. (5): the advantage estimate Q^ret - V(s)
    advantage = batch.qret - value.detach()
    # c = min(1, rho)
    trace = torch.clamp(rho, max=1.0)
    # Eq. (7): V^tbc = V + c (Q^ret - V)
    vtbc = value.detach() + trace * advantage
    rho_pg = torch.clamp(rho, max=RULE2_RHO_MAX) if refer == "rule2" else rho
    # the masks select (torch.where), never multiply
    zero = torch.zeros_like(rho)
    # Eq. (5): rho (Q^ret - V) grad log pi, with rho and the advantage detached
    pg_loss = torch.where(near, -(rho_pg * advantage) * logpi_near, zero)
    # Eq. (9)
    v_loss = torch.where(near, 0.5 * (value - vtbc) ** 2, zero)
    # Eq. (11): D_KL(mu || pi)
    kl_mu_pi = gaussian_kl(batch.mu_mean, batch.mu_std, mean, std)
    kl = kl_mu_pi if kl_direction == "mu_pi" else gaussian_kl(mean, std, batch.mu_mean, batch.mu_std)
    beta_eff = beta if refer in ("full", "rule2") else 1.0
    importance = 1.0 if batch.weights is None else batch.weights
    # Eq. (10); the KL term only where its weight 1 - beta is not 0
    per_sample = importance * beta_eff * (pg_loss + v_loss)
    if beta_eff < 1.0:
        per_sample = per_sample + (1.0 - beta_eff) * kl
    info = {
        "rho": rho,
        "far": far,
        "kl_mu_pi": kl_mu_pi.detach(),
        "abs_err": (trace * advantage).abs(),
        "policy_loss": pg_loss.detach().sum() / batch_size,
        "value_loss": v_loss.detach().sum() / batch_size,
        "kl_loss": kl.detach().mean(),
    }
    return per_sample.sum() / batch_size, info


def sample_noise(rng: np.random.Generator, shape, mode: str = "truncnorm") -> np.ndarray:
    """z for a = m + sigma z: standard normal truncated at +-3 (App. A), or the authors' refill, or plain normal.
    Oracle: tests/test_vracer_estimators.py::test_noise_and_action_scaling."""
    z = rng.standard_normal(shape)
    bad = np.abs(z) > 3.0
    # rejection sampling: an exact truncated normal
    while mode == "truncnorm" and bad.any():
        z[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(z) > 3.0
    if mode == "smarties":
        z[bad] = rng.uniform(-3.0, 3.0, int(bad.sum()))
    return z


def to_env_action(u: np.ndarray, low: np.ndarray, high: np.ndarray, clip: bool = False) -> np.ndarray:
    """App. B: linear rescaling of the Gaussian sample u to the action bounds, a = low + (high - low)(u + 1)/2.
    Oracle: tests/test_vracer_estimators.py::test_noise_and_action_scaling."""
    a = low + 0.5 * (high - low) * (u + 1.0)
    return np.clip(a, low, high) if clip else a


# REPLAY MEMORY
class EpisodeReplay:
    """Replay memory of whole episodes with per-step Q^ret, last V and last rho (Sec. 2-3, App. B-C).

    Episodes lie contiguously in flat arrays, one per field of a step (the write head jumps to 0 when one does not fit
    before the end); the oldest whole episodes are removed while the memory would still hold >= N samples without them
    (FIFO)."""

    # One array per field of a step: name -> (width: "obs" | "act" | 1, dtype, initial value).
    FIELDS = {
        "obs": ("obs", np.float32, 0),  # s_t
        "action": ("act", np.float32, 0),  # u_t, in the normalised action space
        "mu_mean": ("act", np.float32, 0),  # mu_t = N(mu_mean, mu_std^2), the policy that acted
        "mu_std": ("act", np.float32, 1),
        "policy_version": (1, np.int64, 0),  # the version of the published weights mu_t came from
        "reward": (1, np.float64, 0),  # r_{t+1} as received
        "scaled_reward": (1, np.float64, 0),  # r_{t+1} / (sigma_r + eps) (App. B)
        "value": (1, np.float64, 0),  # the most recent V(s_t)
        "rho": (1, np.float64, 1),  # the most recent rho_t
        "trace_decay": (1, np.float64, 0),  # Eq. (8) as V^tbc_t = vtbc_offset_t + trace_decay_t V^tbc_{t+1}
        "vtbc_offset": (1, np.float64, 0),
        "priority": (1, np.float64, 0),  # PER: |c_t (Q^ret_t - V(s_t))| at the step's last gradient step
        "episode_start": (1, np.int64, 0),  # slot of the episode's first step
        "episode_last": (1, np.int64, 0),  # slot of the episode's last step
        "valid": (1, bool, 0),  # the slot holds a stored step
        "truncated_last": (1, bool, 0),  # last step of an episode that a time limit ended
        "boot_value": (1, np.float64, 0),  # last steps: V(s_L), 0 after a termination
        "boot_obs": ("obs", np.float32, 0),  # last steps: s_L
        "ranked": (1, bool, 0),  # PER: the step was stored at the last re-sort (it has a rank)
    }
    # Derived fields, not saved: each step's map of Eq. (8), from its r, V, rho and V(s_L).
    NOT_SAVED = ("trace_decay", "vtbc_offset")
    # Steps per block of `vtbc_at` (one block map composes the maps of BLOCK steps).
    BLOCK = 32
    # The scalars of `state_dict`.
    SCALARS = ("size", "head", "high_water", "reward_scale", "n_far", "cmax", "max_priority", "N", "capacity")

    def __init__(self, N: int, obs_dim: int, act_dim: int, gamma: float, max_episode_len: int, per_alpha: float):
        """per_alpha: the rank-based PER exponent (--per-alpha; not saved: a resumed run samples with its own)."""
        self.N = N
        self.gamma = gamma
        self.per_alpha = per_alpha
        self.capacity = self.capacity_for(N, max_episode_len)
        widths = {"obs": obs_dim, "act": act_dim}
        for name, (width, dtype, value) in self.FIELDS.items():
            # s_t and u_t stay 2-D even with one action dimension (the actors hand over (L, act_dim) blocks)
            shape = (self.capacity, widths[width]) if width in widths else self.capacity
            setattr(self, name, np.full(shape, value, dtype))
        # the composed maps of the steps of each block: V^tbc at its first step = offset + decay V^tbc after its last
        self.block_decay = np.zeros(self.capacity // self.BLOCK)
        self.block_offset = np.zeros(self.capacity // self.BLOCK)
        # (first slot, length) of each stored episode, oldest first
        self.episodes: deque = deque()
        self.size = 0
        # the next episode is written from here (or from slot 0)
        self.head = 0
        # slots [0, high_water) have held steps
        self.high_water = 0
        self.forced_removals = 0
        self.n_far = 0
        self.reward_scale = 1.0  # sigma_r + eps (Eq. (16))
        self.max_priority = 1.0
        self.cmax = np.inf
        # rank-based PER: slots by decreasing priority, P(rank k) ~ k^-alpha, its cumulative sum, the unranked slots
        self.per_order = None
        self.per_rank_prob = None
        self.per_cdf = None
        self.per_unranked = None

    @classmethod
    def capacity_for(cls, N: int, max_episode_len: int) -> int:
        """Slots: N plus 4 episodes of slack for the FIFO and the jump to slot 0, in whole blocks."""
        slots = N + 4 * max_episode_len
        whole_blocks = (slots + cls.BLOCK - 1) // cls.BLOCK
        return whole_blocks * cls.BLOCK

    @classmethod
    def bytes_needed(cls, N: int, obs_dim: int, act_dim: int, max_episode_len: int = 1000) -> int:
        """RAM of the arrays in FIELDS and of the block maps, computed before allocating them."""
        widths = {"obs": obs_dim, "act": act_dim}
        bytes_per_slot = sum(widths.get(w, w) * np.dtype(t).itemsize for w, t, _ in cls.FIELDS.values())
        capacity = cls.capacity_for(N, max_episode_len)
        return capacity * bytes_per_slot + 2 * 8 * (capacity // cls.BLOCK)

    # -- insertion and FIFO forgetting
    def _remove_oldest(self) -> None:
        start, length = self.episodes.popleft()
        steps = slice(start, start + length)
        self.n_far -= int(is_far_policy(self.rho[steps], self.cmax).sum())
        self.valid[steps] = False
        self.truncated_last[steps] = False
        self.size -= length

    def add_episode(
        self,
        obs,
        action,
        mu_mean,
        mu_std,
        reward,
        value,
        terminated: bool,
        final_value: float = 0.0,
        final_obs=None,
        policy_version=0,
    ) -> None:
        """Store one complete episode (App. C Alg. 2); its Q^ret are those of rho = 1 and the acting-time V's.
        final_value, final_obs: V(s_L) and s_L after a truncation (not read after a termination); policy_version: the
        version of the weights each step was acted with."""
        length = len(reward)
        if length == 0:
            return
        if length > self.capacity - self.N:
            raise ValueError(f"episode of {length} steps is longer than the memory's slack {self.capacity - self.N}")
        # the write head jumps to 0 if the episode does not fit before the end
        start = 0 if self.head + length > self.capacity else self.head
        stop = start + length
        last = stop - 1
        # the region ahead of the head holds the oldest episodes
        while self.episodes:
            oldest_start, oldest_length = self.episodes[0]
            if oldest_start >= stop or oldest_start + oldest_length <= start:
                break
            self._remove_oldest()
            self.forced_removals += 1
        steps = slice(start, stop)
        self.obs[steps] = obs
        self.action[steps] = action
        self.mu_mean[steps] = mu_mean
        self.mu_std[steps] = mu_std
        self.policy_version[steps] = policy_version
        self.reward[steps] = reward
        self.scaled_reward[steps] = np.asarray(reward) / self.reward_scale
        self.value[steps] = value
        self.rho[steps] = 1.0
        # counted as `_remove_oldest` uncounts them: rho = 1 is far when c_max <= 1 (--refer none --C 0)
        self.n_far += int(is_far_policy(self.rho[steps], self.cmax).sum())
        # PER: new samples get the maximal priority, and no rank until the next re-sort (a recycled slot does not
        # keep its old occupant's)
        self.priority[steps] = self.max_priority
        self.ranked[steps] = False
        self.per_cdf = None
        self.episode_start[steps] = start
        self.episode_last[steps] = last
        self.valid[steps] = True
        self.boot_value[last] = 0.0 if terminated else final_value  # App. C Alg. 2 remark 2
        self.truncated_last[last] = not terminated
        if not terminated and final_obs is not None:
            self.boot_obs[last] = final_obs
        self._set_maps(np.arange(start, stop))
        self.episodes.append((start, length))
        self.size += length
        self.head = stop
        self.high_water = max(self.high_water, stop)
        # FIFO: keep >= N samples
        while self.episodes:
            _, oldest_length = self.episodes[0]
            if self.size - oldest_length < self.N:
                break
            self._remove_oldest()

    # -- sampling
    def sample(self, B: int, rng: np.random.Generator) -> np.ndarray:
        """B distinct stored steps, uniformly (rejection over the slots; App. C Alg. 1).
        Oracle: tests/test_vracer_replay.py::test_sampling_is_distinct_valid_and_roughly_uniform."""
        if self.size < B:
            raise ValueError(f"replay holds {self.size} samples < batch size {B}")
        for _ in range(8):
            candidates = rng.integers(0, self.high_water, size=B + B // 2 + 16)
            candidates = np.unique(candidates[self.valid[candidates]])
            if len(candidates) >= B:
                # a uniformly random B-subset (the draws are exchangeable)
                return rng.permutation(candidates)[:B]
        return rng.choice(np.flatnonzero(self.valid[: self.high_water]), size=B, replace=False)

    def per_rebuild(self) -> None:
        """Rank-based PER: sort the stored steps by decreasing priority (done every stats_every steps)."""
        stored = np.flatnonzero(self.valid[: self.high_water])
        self.per_order = stored[np.argsort(-self.priority[stored], kind="stable")]
        self.per_rank_prob = np.arange(1, len(stored) + 1, dtype=np.float64) ** -self.per_alpha  # P(rank k) ~ k^-alpha
        self.ranked[:] = False
        self.ranked[stored] = True
        self.per_cdf = None

    def sample_per(self, B: int, rng: np.random.Generator, beta_is: float):
        """Rank-based PER (Schaul et al. 2015) between two re-sorts: a step stored since the last re-sort has no rank and
        is drawn with probability 1/n (n stored steps), as in uniform sampling; the others by rank, P(rank k) ~ k^-alpha,
        scaled to the remaining probability (ranks whose step has been removed since are skipped).
        Returns (indices, IS weights (n P)^-beta divided by the batch maximum); draws with replacement.
        Oracles: tests/test_vracer_replay.py::test_rank_per_prefers_high_priorities,
        ::test_rank_per_draws_steps_stored_since_the_last_sort_uniformly."""
        if self.per_order is None:
            self.per_rebuild()
        # the memory changed since the last draw: find the ranks still stored and the new steps
        if self.per_cdf is None:
            still_stored = self.valid[self.per_order] & self.ranked[self.per_order]
            self.per_cdf = np.cumsum(np.where(still_stored, self.per_rank_prob, 0.0))
            in_use = slice(0, self.high_water)
            self.per_unranked = np.flatnonzero(self.valid[in_use] & ~self.ranked[in_use])
        n = self.size
        new_share = len(self.per_unranked) / n
        is_new = rng.uniform(size=B) < new_share
        n_ranked = B - int(is_new.sum())
        idx = np.empty(B, dtype=np.int64)
        prob = np.empty(B)
        idx[is_new] = self.per_unranked[rng.integers(0, len(self.per_unranked), B - n_ranked)]
        prob[is_new] = 1.0 / n
        # side="right": a removed step's rank (zero probability, a flat step of the cdf) is never chosen
        ranks = np.searchsorted(self.per_cdf, rng.uniform(0.0, self.per_cdf[-1], n_ranked), side="right")
        idx[~is_new] = self.per_order[ranks]
        prob[~is_new] = (1.0 - new_share) * self.per_rank_prob[ranks] / self.per_cdf[-1]
        weights = (n * prob) ** -beta_is  # (n P)^-beta
        return idx, weights / weights.max()

    # -- ReF-ER bookkeeping and the Retrace targets (App. C Alg. 3)
    def update_samples(
        self, idx: np.ndarray, rho: np.ndarray, value: np.ndarray, boot_idx=None, boot_value=None, priority=None
    ):
        """Store the new rho, V(s) of the sampled steps, keep n_far, and refresh Q^ret of all prior steps (Eq. (8)):
        `vtbc_at` reads Q^ret from the maps of the stored V and rho, which this updates for the sampled steps and their
        blocks. boot_idx, boot_value: sampled last steps of truncated episodes and their V(s_L) from the current
        network."""
        idx = np.asarray(idx)
        rho = np.asarray(rho, np.float64)
        value = np.asarray(value, np.float64)
        # PER draws with replacement: keep the last value of each slot
        if len(np.unique(idx)) < len(idx):
            keep = len(idx) - 1 - np.unique(idx[::-1], return_index=True)[1]
            idx = idx[keep]
            rho = rho[keep]
            value = value[keep]
            priority = None if priority is None else priority[keep]
        self.n_far += int(is_far_policy(rho, self.cmax).sum()) - int(is_far_policy(self.rho[idx], self.cmax).sum())
        self.rho[idx] = rho
        self.value[idx] = value
        if priority is not None:
            self.priority[idx] = priority
            self.max_priority = max(self.max_priority, float(priority.max()))
        if boot_idx is not None and len(boot_idx):
            self.boot_value[boot_idx] = boot_value
        # the sampled last steps of truncated episodes are among idx
        self._set_maps(idx)

    def _set_maps(self, slots: np.ndarray) -> None:
        """Eq. (8) for these steps as maps, V^tbc_t = vtbc_offset_t + trace_decay_t V^tbc_{t+1}: with c_t = min(1, rho_t),
        trace_decay_t = gamma c_t and vtbc_offset_t = (1 - c_t) V(s_t) + c_t r_{t+1}; an episode's last step ends the
        recursion (trace_decay 0, vtbc_offset + c gamma V(s_L), V(s_L) = 0 after a termination). Then the maps of their
        blocks."""
        trace = np.minimum(1.0, self.rho[slots])
        is_last = self.episode_last[slots] == slots
        boot = np.where(is_last, self.gamma * self.boot_value[slots], 0.0)
        self.trace_decay[slots] = np.where(is_last, 0.0, self.gamma * trace)
        self.vtbc_offset[slots] = (1.0 - trace) * self.value[slots] + trace * (self.scaled_reward[slots] + boot)
        blocks = np.unique(slots // self.BLOCK)
        decay = self.trace_decay.reshape(-1, self.BLOCK)[blocks]
        offset = self.vtbc_offset.reshape(-1, self.BLOCK)[blocks]
        self.block_decay[blocks], self.block_offset[blocks] = compose_maps(decay, offset)

    def vtbc_at(self, slots: np.ndarray) -> np.ndarray:
        """V^tbc_t of stored steps t from the stored r, V, rho and V(s_L), by the backward recursion of Eq. (8),

            V^tbc_t = V(s_t) + c_t (r_{t+1} + gamma V^tbc_{t+1} - V(s_t)),   c_t = min(1, rho_t),
            V^tbc_L = V(s_L) after a truncation, 0 after a termination,

        evaluated by blocks: the maps of t's steps to the end of its block, then the block maps (`_set_maps`) up to the
        block of the episode's last step, where the recursion ends. This is what refreshing Q^ret of every prior step
        after each gradient step keeps stored (App. C Alg. 3; `EagerReplay` in tests/benchmarks/bench_vracer_refer.py):
        the learner step is 3-4x faster than with that recursion at N = 2**18, and flat in N (the benchmark).
        Oracles: tests/test_vracer_replay.py::test_vtbc_read_by_blocks_matches_textbook (the recursion written out),
        ::test_vtbc_edge_cases."""
        slots = np.asarray(slots)
        if not len(slots):
            return np.zeros(0)
        block = slots // self.BLOCK
        # the steps of t's block from t on (identity maps before it)
        decay = self.trace_decay.reshape(-1, self.BLOCK)[block]
        offset = self.vtbc_offset.reshape(-1, self.BLOCK)[block]
        before = np.arange(self.BLOCK) < (slots % self.BLOCK)[:, None]
        np.putmask(decay, before, 1.0)
        np.putmask(offset, before, 0.0)
        first_decay, first_offset = compose_maps(decay, offset)
        # the following blocks, up to the one of the episode's last step (identity maps after it)
        blocks_after = self.episode_last[slots] // self.BLOCK - block
        following = block[:, None] + 1 + np.arange(max(1, int(blocks_after.max())))
        after_last = following > (block + blocks_after)[:, None]
        np.putmask(following, after_last, 0)
        decay = self.block_decay[following]
        offset = self.block_offset[following]
        np.putmask(decay, after_last, 1.0)
        np.putmask(offset, after_last, 0.0)
        _, rest = compose_maps(decay, offset)
        return first_offset + first_decay * rest

    def qret_at(self, slots: np.ndarray) -> np.ndarray:
        """Q^ret_t = r_{t+1} + gamma V^tbc_{t+1} (Eq. (6)), V^tbc_L = V(s_L) at an episode's last step.
        Oracle: tests/test_vracer_replay.py::test_insertion_targets_and_incremental_refresh_equal_full_recomputation."""
        slots = np.asarray(slots)
        is_last = self.episode_last[slots] == slots
        next_vtbc = np.where(is_last, self.boot_value[slots], self.vtbc_at(np.where(is_last, slots, slots + 1)))
        return self.scaled_reward[slots] + self.gamma * next_vtbc

    def recompute(self) -> None:
        """The maps of every stored step (after a reward-scale update or a load)."""
        self._set_maps(np.flatnonzero(self.valid[: self.high_water]))

    def recount_far(self, cmax: float) -> None:
        """Exact n_far with the current c_max."""
        self.cmax = cmax
        in_use = slice(0, self.high_water)
        self.n_far = int((is_far_policy(self.rho[in_use], cmax) & self.valid[in_use]).sum())

    def far_fraction(self) -> float:
        return self.n_far / max(1, self.size)

    # -- statistics (App. B)
    def state_stats(self):
        """Eqs. (14)-(15): mean and std (+ eps 1e-7) of the stored states; a constant input: std 1 (authors' code)."""
        in_use = slice(0, self.high_water)
        states = self.obs[in_use][self.valid[in_use]].astype(np.float64)
        std = states.std(0)
        return states.mean(0), np.where(std < 1e-7, 1.0, std) + 1e-7

    def update_reward_scale(self, eps: float = 1e-7) -> float:
        """Eq. (16): sigma_r = sqrt(mean r^2) over the RM (no mean shift); rescale rewards and recompute Q^ret.
        Oracle: tests/test_vracer_replay.py::test_reward_scaling_is_rms_without_mean_shift."""
        in_use = slice(0, self.high_water)
        r = self.reward[in_use][self.valid[in_use]]
        self.reward_scale = float(np.sqrt(np.mean(r * r))) + eps if len(r) else 1.0
        self.scaled_reward[in_use] = self.reward[in_use] / self.reward_scale
        self.recompute()
        return self.reward_scale

    def state_dict(self) -> dict:
        """The stored steps, the scalars and the PER sort (the sampler continues between two re-sorts as it would)."""
        fields = {k: getattr(self, k)[: self.high_water].copy() for k in self.FIELDS if k not in self.NOT_SAVED}
        scalars = {k: getattr(self, k) for k in self.SCALARS}
        per_order = None if self.per_order is None else self.per_order.copy()
        return fields | scalars | {"episodes": list(self.episodes), "per_order": per_order}

    @classmethod
    def saved_keys(cls) -> list[str]:
        """The keys of `state_dict`."""
        return [*(k for k in cls.FIELDS if k not in cls.NOT_SAVED), *cls.SCALARS, "episodes", "per_order"]

    def load_state_dict(self, saved: dict) -> None:
        if not set(self.saved_keys()) <= saved.keys():
            raise SystemExit("error: the checkpoint's replay memory has the field names of an older vracer_refer.py")
        if saved["N"] != self.N or saved["capacity"] != self.capacity:
            raise SystemExit(f"error: checkpoint replay has N={saved['N']}, this run N={self.N}")
        for k in self.FIELDS.keys() - set(self.NOT_SAVED):
            getattr(self, k)[: len(saved[k])] = saved[k]
        for k in self.SCALARS:
            setattr(self, k, saved[k])
        self.episodes = deque(tuple(e) for e in saved["episodes"])
        self.recompute()
        self.per_order = saved["per_order"]
        if self.per_order is not None:
            self.per_rank_prob = np.arange(1, len(self.per_order) + 1, dtype=np.float64) ** -self.per_alpha
        self.per_cdf = None


# LEARNER STEP (App. C Alg. 3)
@dataclass
class Learner:
    """The learner: network, Adam, replay memory, the state statistics (Eqs. (14)-(15), moved in place), the sampling
    generator, and what every gradient step moves: k, the gradient steps so far, and beta (Eq. (12))."""

    agent: Agent
    optimizer: torch.optim.Optimizer
    replay: EpisodeReplay
    obs_mean: torch.Tensor
    obs_std: torch.Tensor
    rng: np.random.Generator
    device: torch.device
    k: int = 0
    beta: float = 1.0


# The scalar statistics `train_step` returns, in this order (averaged and logged under these names).
STEP_STATS = ("losses/loss", "losses/policy_loss", "losses/value_loss", "refer/kl", "refer/far_batch_frac", "refer/avg_rho")


def train_step(learner: Learner, args: Args) -> torch.Tensor:
    """App. C Alg. 1's learner step: sample B steps, ReF-ER loss, Adam, write back rho/V (Q^ret follows), update beta,
    k += 1 (both on `learner`). Returns the CPU tensor of STEP_STATS (kl: the mean D_KL(mu || pi)); a non-finite loss raises
    FloatingPointError before the optimizer step and the replay are touched (the NaN guard)."""
    replay = learner.replay
    device = learner.device
    k = learner.k
    # Eq. (13); with --refer none c_max only counts the far-policy samples
    cmax = refer_cmax(k, args.C, args.A)
    replay.cmax = cmax
    for group in learner.optimizer.param_groups:
        group["lr"] = annealed_learning_rate(k, args.learning_rate, args.A)
    weights = None
    if args.per == "rank":
        beta_is = min(1.0, args.per_beta0 + (1.0 - args.per_beta0) * args.A * k)
        idx, per_weights = replay.sample_per(args.batch_size, learner.rng, beta_is)
        weights = torch.as_tensor(per_weights, dtype=torch.float32, device=device)
    else:
        idx = replay.sample(args.batch_size, learner.rng)
    # sampled last steps of truncated episodes: V(s_L) is refreshed too
    boot_idx = idx[replay.truncated_last[idx]]
    obs = np.concatenate([replay.obs[idx], replay.boot_obs[boot_idx]]) if len(boot_idx) else replay.obs[idx]
    obs = (torch.as_tensor(obs, device=device) - learner.obs_mean) / learner.obs_std
    batch = Batch(
        action=torch.as_tensor(replay.action[idx], device=device),
        mu_mean=torch.as_tensor(replay.mu_mean[idx], device=device),
        mu_std=torch.as_tensor(replay.mu_std[idx], device=device),
        qret=torch.as_tensor(replay.qret_at(idx), dtype=torch.float32, device=device),
        weights=weights,
    )
    mean, std, value = learner.agent(obs)
    B = args.batch_size
    loss, info = refer_loss(
        mean[:B], std[:B], value[:B], batch, learner.beta, cmax, args.refer, args.kl_direction, args.logrho_clip
    )
    # STEP_STATS, in that order
    step_stats = torch.stack(
        [
            loss.detach(),
            info["policy_loss"],
            info["value_loss"],
            info["kl_mu_pi"].mean(),
            info["far"].float().mean(),
            info["rho"].mean(),
        ]
    )
    # one device->host copy per step: per-sample rho, V(s) then V(s_L), |err| and the STEP_STATS
    host = torch.cat([info["rho"], value.detach(), info["abs_err"], step_stats]).double().cpu().numpy()
    n_boot = len(boot_idx)
    rho, value_now, boot_value, abs_err, stats = np.split(host, np.cumsum([B, B, n_boot, B]))
    named_stats = dict(zip(STEP_STATS, stats))
    losses = np.array([named_stats["losses/loss"], named_stats["losses/policy_loss"], named_stats["losses/value_loss"]])
    # The NaN guard comes before the step, so that the weights and Adam's moments stay finite. It looks at the loss
    # terms only: a masked or weight-0 D_KL may be inf.
    if not np.isfinite(losses).all():
        raise FloatingPointError(f"non-finite loss at gradient step {k}: loss, policy, value = {losses}")
    learner.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    learner.optimizer.step()
    # App. C Alg. 3: the sampled steps' rho and V written back (their Q^ret follow), and their PER priorities
    priority = abs_err if args.per == "rank" else None
    replay.update_samples(idx, rho, value_now, boot_idx, boot_value, priority=priority)
    # Eq. (12), with the far fraction from each stored step's most recent rho
    if args.refer != "none":
        learner.beta = refer_beta_update(learner.beta, replay.far_fraction(), args.D, args.beta_lr)
    learner.k = k + 1
    return torch.from_numpy(stats)


def learn(learner: Learner, args: Args, steps_due: float, step_stats: MetricAverager, publish) -> int:
    """The learner's turn between two reads of the rings (App. C Alg. 1): gradient steps while k < steps_due = (t - t0)/F,
    at most GRAD_STEPS_PER_READ; every stats_every steps first the replay statistics (App. B); then `publish()` hands
    the new weights to the actors. Adds each step's STEP_STATS to `step_stats`; moves obs_mean, obs_std in place (with
    --state-stats-rate). Returns the number of gradient steps done."""
    replay = learner.replay
    done = 0
    while learner.k < steps_due and done < GRAD_STEPS_PER_READ:
        k = learner.k
        # App. B: every 1000 steps
        if k > 0 and k % args.stats_every == 0:
            replay.update_reward_scale()
            replay.recount_far(refer_cmax(k, args.C, args.A))
            if args.per == "rank":
                replay.per_rebuild()
            if args.state_stats_rate:
                for current, target in zip((learner.obs_mean, learner.obs_std), replay.state_stats()):
                    current += args.state_stats_rate * (torch.as_tensor(target, device=learner.device) - current)
        step_stats.add(dict(zip(STEP_STATS, train_step(learner, args).tolist())))
        done += 1
    if done:
        publish()
    return done


def start_learning(learner: Learner, args: Args, shared, base_step: int, stats_ready: bool) -> int:
    """App. C Alg. 1 when the replay first holds N_start samples: the initial state statistics (Eqs. (14)-(15), unless a
    resumed run brought them), the reward scale (Eq. (16)) and the far-policy count; the F clock starts from every step
    the actors have taken, stored or still in their rings (a resumed run's k continues at once), and the actors' gate
    stays closed there until the main loop opens it to t0 + F k + slack. Returns t0, the env step from which k keeps
    up with (t - t0) / F."""
    replay = learner.replay
    if not stats_ready:
        mean, std = replay.state_stats()
        learner.obs_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        learner.obs_std.copy_(torch.as_tensor(std, dtype=torch.float32))
    replay.update_reward_scale()
    replay.recount_far(refer_cmax(learner.k, args.C, args.A))
    steps_written = int(shared.written.sum())
    shared.steps_allowed[0] = steps_written
    print(f"learning starts at env step {base_step + steps_written} (replay holds {replay.size} samples)", flush=True)
    return base_step + steps_written - int(learner.k * args.F)


# ACTOR PROCESSES (module level, so that spawn can pickle them)
# The ring of each actor holds one row per transition, one shared array per field: name -> (width, dtype).
RING_FIELDS = {
    "obs": ("obs", torch.float64),  # s_t
    "action": ("act", torch.float64),  # u_t
    "mu_mean": ("act", torch.float64),  # mu_t = N(mu_mean, mu_std^2)
    "mu_std": ("act", torch.float64),
    "policy_version": (1, torch.int64),  # the weights version mu_t came from
    "value": (1, torch.float64),  # V(s_t)
    "reward": (1, torch.float64),  # r_{t+1}
    "terminated": (1, torch.bool),
    "truncated": (1, torch.bool),  # ended by a time limit, not terminated
    "final_obs": ("obs", torch.float64),  # truncated ends: s_T (else 0)
    "final_value": (1, torch.float64),  # truncated ends: V(s_T) (else 0)
    "episode_return": (1, torch.float64),  # the episode's return so far
    "episode_length": (1, torch.int64),  # the episode's length so far
}


class SharedHandles(NamedTuple):
    """The shared memory of the learner and the actor processes."""

    weights: torch.Tensor  # the network's parameters as one vector
    obs_mean: torch.Tensor  # (obs_dim,): the state mean (Eq. (14))
    obs_std: torch.Tensor  # (obs_dim,): the state std (Eq. (15))
    steps_allowed: torch.Tensor  # (1,): env steps the actors may have taken in all (the F gate)
    # (1,): the seqlock of `weights`, obs_mean and obs_std: odd while a publish copies them, even after; version = seq / 2
    weights_seq: torch.Tensor
    rings: dict  # RING_FIELDS name -> (num_actors, ring_size, width)
    written: torch.Tensor  # (num_actors,): rows each actor has written
    read: torch.Tensor  # (num_actors,): rows of each actor the learner has read
    stop_event: object


def make_shared_handles(num_actors: int, ring_size: int, obs_dim: int, act_dim: int, num_params: int, stop_event):
    """Zero-filled SharedHandles in shared memory."""

    def shared(*shape, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype).share_memory_()

    widths = {"obs": (obs_dim,), "act": (act_dim,), 1: ()}
    rings = {name: shared(num_actors, ring_size, *widths[width], dtype=dtype) for name, (width, dtype) in RING_FIELDS.items()}
    return SharedHandles(
        weights=shared(num_params),
        obs_mean=shared(obs_dim),
        obs_std=shared(obs_dim),
        steps_allowed=shared(1, dtype=torch.int64),
        weights_seq=shared(1, dtype=torch.int64),
        rings=rings,
        written=shared(num_actors, dtype=torch.int64),
        read=shared(num_actors, dtype=torch.int64),
        stop_event=stop_event,
    )


def publish_weights(shared: SharedHandles, agent: Agent, obs_mean: torch.Tensor, obs_std: torch.Tensor) -> None:
    """Hand the learner's weights and state statistics (Eqs. (14)-(15)) to the actors as the next version, under a
    seqlock: the sequence number is odd while they are copied into shared memory and even after (version = seq / 2).
    The learner never waits; an actor keeps only a copy the sequence number was even and unchanged across
    (`read_published`). This relies on each process's stores becoming visible in program order (x86)."""
    weights = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().cpu()
    obs_mean = obs_mean.cpu()
    obs_std = obs_std.cpu()
    shared.weights_seq[0] += 1
    shared.weights.copy_(weights)
    shared.obs_mean.copy_(obs_mean)
    shared.obs_std.copy_(obs_std)
    shared.weights_seq[0] += 1


def published_version(shared: SharedHandles) -> int:
    """The version of the last complete publish (the learner's view: it is the only writer)."""
    return int(shared.weights_seq[0]) // 2


def read_published(shared: SharedHandles, version: int):
    """The actor's side of the seqlock of `publish_weights`: (version, weights, obs_mean, obs_std), copies, of the
    newest complete publish; None when that is `version` already, or when a publish was under way or began during the
    copy (the actor then acts once more with the version it holds, and reads again before its next step)."""
    seq = int(shared.weights_seq.numpy()[0])
    if seq % 2 == 1 or seq // 2 == version:
        return None
    weights = shared.weights.clone()
    obs_mean = shared.obs_mean.clone()
    obs_std = shared.obs_std.clone()
    if int(shared.weights_seq.numpy()[0]) != seq:
        return None
    return seq // 2, weights, obs_mean, obs_std


def numpy_params(agent: Agent, std_map: str, obs_mean: np.ndarray, obs_std: np.ndarray) -> dict:
    """float64 numpy copies of the weights, sigma and the state statistics for `numpy_forward`."""
    net = {name: p.detach().cpu().numpy().astype(np.float64) for name, p in agent.named_parameters()}
    std = std_from_param(agent.std_param.detach().cpu(), std_map).numpy().astype(np.float64)
    obs_stats = {"obs_mean": np.array(obs_mean, dtype=np.float64), "obs_std": np.array(obs_std, dtype=np.float64)}
    return net | {"std": std} | obs_stats


def numpy_forward(net: dict, obs: np.ndarray, residual: bool = False):
    """Agent.forward for one raw state in numpy (actors: ~10x cheaper than a 1-row torch call): (mean, std, V)."""
    x = (obs - net["obs_mean"]) / net["obs_std"]
    h = net["l1.weight"] @ x + net["l1.bias"]
    h = h / (1.0 + np.abs(h))  # Softsign
    h2 = net["l2.weight"] @ h + net["l2.bias"]
    h2 = h2 / (1.0 + np.abs(h2))
    h = h + h2 if residual else h2
    out = net["out.weight"] @ h + net["out.bias"]
    # the head's output 0 is V(s), outputs 1.. the mean (as Agent.forward)
    value = float(out[0])
    mean = out[1:]
    return mean, net["std"], value


def actor_loop(actor_id: int, args: Args, obs_dim: int, act_dim: int, shared: SharedHandles, seed: int, run_name: str):
    """Step one env with the latest shared weights; write each transition with mu = (mean, std) and V(s) to the ring
    (App. C Alg. 2)."""
    env = make_env(args.env_id, seed, args.capture_video and actor_id == 0, run_name)
    low = env.action_space.low.astype(np.float64)
    high = env.action_space.high.astype(np.float64)
    rng = np.random.default_rng(seed)
    agent = Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual)
    ring = {name: rings[actor_id].numpy() for name, rings in shared.rings.items()}
    ring_size = len(ring["obs"])
    written = shared.written.numpy()
    read = shared.read.numpy()
    steps_allowed = shared.steps_allowed.numpy()
    # version 0: nothing published yet
    version = 0
    net = {}
    episode_return = 0.0
    episode_length = 0
    obs, _ = env.reset(seed=seed)
    while not shared.stop_event.is_set():
        n = int(written[actor_id])
        # Wait while the ring is full or the learner's F gate is closed: a 2 ms nap costs nothing against >= 32 steps
        # of slack.
        if n - int(read[actor_id]) >= ring_size or int(written.sum()) >= int(steps_allowed[0]):
            time.sleep(0.002)
            continue
        # the latest weights and state statistics, each step labelled with the version they are (`read_published`)
        published = read_published(shared, version)
        if published is not None:
            version, weights, obs_mean, obs_std = published
            torch.nn.utils.vector_to_parameters(weights, agent.parameters())
            net = numpy_params(agent, args.std_map, obs_mean.numpy(), obs_std.numpy())
        if not net:
            # no complete publish read yet (one was under way)
            time.sleep(0.001)
            continue
        mean, std, value = numpy_forward(net, obs, args.residual)
        u = mean + std * sample_noise(rng, act_dim, args.action_noise)  # u ~ mu_t (App. C Alg. 2)
        next_obs, reward, terminated, time_limit, _ = env.step(to_env_action(u, low, high, args.clip_actions))
        episode_return += float(reward)
        episode_length += 1
        # a time limit that is not also a termination: the learner bootstraps from s_T and V(s_T)
        truncated = time_limit and not terminated
        final_value = 0.0
        if truncated:
            _, _, final_value = numpy_forward(net, next_obs, args.residual)
        transition = {
            "obs": obs,
            "action": u,
            "mu_mean": mean,
            "mu_std": std,
            "policy_version": version,
            "value": value,
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "final_obs": next_obs if truncated else 0.0,
            "final_value": final_value,
            "episode_return": episode_return,
            "episode_length": episode_length,
        }
        for name, field in transition.items():
            ring[name][n % ring_size] = field
        # publish the row after it is complete
        written[actor_id] = n + 1
        obs = next_obs
        if terminated or time_limit:
            obs, _ = env.reset()
            episode_return = 0.0
            episode_length = 0
    env.close()


def store_episodes(shared: SharedHandles, actor_id: int, partial: list, replay: EpisodeReplay) -> tuple:
    """The learner's reader: take one actor's new ring rows (read..written, modulo the ring size), advance `read`,
    append them to its running episode `partial` (blocks of rows) and store every episode they complete (App. C
    Alg. 2); returns (rows read, [(return, length)] of those episodes)."""
    n_written = int(shared.written[actor_id])
    ring_size = shared.rings["obs"].shape[1]
    positions = np.arange(int(shared.read[actor_id]), n_written) % ring_size
    # fancy indexing copies the rows, so the actor may overwrite them once `read` has moved on
    rows = {name: rings[actor_id].numpy()[positions] for name, rings in shared.rings.items()}
    shared.read[actor_id] = n_written
    finished = []
    begin = 0
    for end in np.flatnonzero(rows["terminated"] | rows["truncated"]):
        episode = {
            name: np.concatenate([block[name] for block in partial] + [field[begin : end + 1]]) for name, field in rows.items()
        }
        partial.clear()
        begin = end + 1
        replay.add_episode(
            episode["obs"],
            episode["action"],
            episode["mu_mean"],
            episode["mu_std"],
            episode["reward"],
            episode["value"],
            bool(episode["terminated"][-1]),
            final_value=float(episode["final_value"][-1]),
            final_obs=episode["final_obs"][-1],
            policy_version=episode["policy_version"],
        )
        finished.append((float(episode["episode_return"][-1]), int(episode["episode_length"][-1])))
    if begin < len(positions):
        partial.append({name: field[begin:] for name, field in rows.items()})
    return len(positions), finished


@torch.no_grad()
def evaluate(agent, env_id: str, seed: int, episodes: int, obs_mean, obs_std, device, clip: bool = False) -> list[float]:
    """Deterministic policy (mean action) returns."""
    env = make_env(env_id, seed)
    low = env.action_space.low.astype(np.float64)
    high = env.action_space.high.astype(np.float64)
    returns = []
    for episode in range(episodes):
        # a stop signal ends the evaluation between episodes
        check_stop()
        obs, _ = env.reset(seed=seed + episode)
        done = False
        episode_return = 0.0
        while not done:
            standardised = (torch.as_tensor(obs, dtype=torch.float32, device=device)[None] - obs_mean) / obs_std
            mean, _, _ = agent(standardised)
            mean_action = mean[0].cpu().numpy().astype(np.float64)
            obs, reward, terminated, truncated, _ = env.step(to_env_action(mean_action, low, high, clip))
            episode_return += float(reward)
            done = terminated or truncated
        returns.append(episode_return)
    env.close()
    return returns


# RUN PLUMBING: the resume rules, the flags' checks, what a checkpoint holds and what --resume puts back
# The flags a resumed run may not change: environment, seed, network, method and replay size.
FIXED_ON_RESUME = (
    "env_id",
    "gamma",
    "hidden_size",
    "residual",
    "std_map",
    "refer",
    "kl_direction",
    "per",
    "buffer_size",
    # beta_0 and sigma_0 only act at the start: a resumed run continues with the checkpoint's beta and std parameter
    "beta_init",
    "init_std",
)
# flags a resumed run applies from its resumed step on (each is changed and read back by a resume test)
APPLIED_ON_RESUME = (
    "total_timesteps",
    "learning_starts",
    "batch_size",
    "learning_rate",
    "adam_eps",
    "F",
    "C",
    "A",
    "D",
    "beta_lr",
    "logrho_clip",
    "per_alpha",
    "per_beta0",
    "action_noise",
    "clip_actions",
    "stats_every",
    "state_stats_rate",
    "num_actors",
    "eval_episodes",
)
# how the run is executed and reported, never what it learns
RUN_ONLY_ON_RESUME = (
    "ring_size",
    "log_every",
    "checkpoint_replay",
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
    require(args.buffer_size >= args.batch_size, "--batch-size must be <= --buffer-size")
    require(
        args.learning_starts <= args.buffer_size,
        "--learning-starts must be <= --buffer-size (the memory never holds more than N + one episode)",
    )
    require(
        args.learning_starts >= args.batch_size,
        "--learning-starts must be >= --batch-size (the first batch needs that many samples)",
    )
    require(args.C > 0 or args.refer == "none", "--C must be > 0 with ReF-ER (use --refer none for conventional ER)")


def checkpoint_contents(args: Args, learner: Learner, global_step: int, t0: int, started: bool, stats_ready: bool):
    """The script's part of checkpoint.pt (`save_run_checkpoint` adds the flags, the step and the global RNGs): the
    network, Adam, k and beta, the F clock t0, whether learning has started and the state statistics been computed,
    the state statistics, the reward scale, the sampler's generator and, with --checkpoint-replay, the replay memory
    (also before learning starts: a resumed run then keeps collecting into it)."""
    replay = learner.replay if args.checkpoint_replay else None
    return {
        "state": {"k": learner.k, "beta": learner.beta},
        "t0": t0,
        "started": started,
        "stats_ready": stats_ready,
        "obs_mean": learner.obs_mean.cpu(),
        "obs_std": learner.obs_std.cpu(),
        "reward_scale": learner.replay.reward_scale,
        "np_rng": learner.rng,
        **state_dicts(model=learner.agent, optimizer=learner.optimizer, replay=replay),
    }


# What `__main__` and `restore_run` read from a checkpoint (`save_run_checkpoint` writes the first two).
CHECKPOINT_KEYS = (
    "global_step",
    "rng",
    "state",
    "t0",
    "started",
    "stats_ready",
    "obs_mean",
    "obs_std",
    "reward_scale",
    "np_rng",
    "model",
    "optimizer",
    "replay",
    "weights_version",
)


def check_checkpoint(ckpt: dict | None, path: str) -> None:
    """--resume: stop at start-up with one line `error: --resume: ...` when the checkpoint lacks a key this script
    reads, or its replay memory a field (a checkpoint of an older vracer_refer.py)."""
    if ckpt is None:
        return
    missing = [key for key in CHECKPOINT_KEYS if key not in ckpt]
    if ckpt.get("replay") is not None:
        missing += [f"replay {key}" for key in EpisodeReplay.saved_keys() if key not in ckpt["replay"]]
    require(
        not missing,
        f"--resume: {path} lacks {', '.join(missing)}: it was written by an older vracer_refer.py (start a new run)",
    )


def steps_before_learning(ckpt: dict | None, args: Args) -> int:
    """Env steps the run collects before its first gradient step: none when the checkpoint brings a memory that learning
    has started on; else until the memory (the checkpoint's, or an empty one) holds N_start samples."""
    if ckpt is None or ckpt["replay"] is None:
        return args.learning_starts
    if ckpt["started"]:
        return 0
    return max(0, args.learning_starts - ckpt["replay"]["size"])


def restore_run(ckpt: dict, args: Args, learner: Learner) -> tuple[int, int, bool, bool]:
    """--resume: put the checkpoint's network, Adam state, k and beta, state statistics, reward scale, sampler generator,
    global RNGs and (when saved) replay memory in place, with this run's flags in effect (Adam's eps and lr are flags
    applied on resume; load_state_dict brought back the checkpoint's). Returns (global_step, t0, started, stats_ready);
    without the memory, learning starts again once N_start samples are collected, with the frozen state statistics."""
    replay = learner.replay if ckpt["replay"] is not None else None
    load_state_dicts(ckpt, model=learner.agent, optimizer=learner.optimizer, replay=replay)
    for group in learner.optimizer.param_groups:
        group["eps"] = args.adam_eps
        group["lr"] = annealed_learning_rate(ckpt["state"]["k"], args.learning_rate, args.A)
    learner.obs_mean.copy_(ckpt["obs_mean"])
    learner.obs_std.copy_(ckpt["obs_std"])
    learner.replay.reward_scale = ckpt["reward_scale"]
    learner.rng.bit_generator.state = ckpt["np_rng"].bit_generator.state
    set_rng_state(ckpt["rng"])
    learner.k = ckpt["state"]["k"]
    learner.beta = ckpt["state"]["beta"]
    started = ckpt["started"] and replay is not None
    return ckpt["global_step"], ckpt["t0"], started, ckpt["stats_ready"]


class LoopLog:
    """The main loop's records: each finished episode as it arrives; every --log-every gradient steps a metric line
    (the means of train_step's STEP_STATS since the last line, from a MetricAverager that `learn` adds to), SPS, the
    annealed lr, the policy lag and the ReF-ER state, with a progress line; while the replay fills, a progress line
    every 10,000 env steps."""

    def __init__(self, logger, args: Args, global_step: int, k: int):
        self.logger = logger
        self.args = args
        # train_step's STEP_STATS since the last metric line
        self.step_stats = MetricAverager()
        self.recent_returns: deque = deque(maxlen=20)
        self.last_k = k
        self.last_time = time.time()
        self.last_step = global_step

    def episodes(self, global_step: int, finished: list) -> None:
        for episode_return, episode_length in finished:
            self.recent_returns.append(episode_return)
            self.logger.log(global_step, {"charts/episodic_return": episode_return, "charts/episodic_length": episode_length})

    def line_if_due(self, global_step: int, started: bool, learner: Learner, shared) -> None:
        k = learner.k
        if started:
            due = k - self.last_k >= self.args.log_every and len(self.step_stats) > 0
        else:
            due = global_step - self.last_step >= 10_000
        if not due:
            return
        now = time.time()
        sps = (global_step - self.last_step) / max(1e-9, now - self.last_time)
        replay = learner.replay
        loss = None
        extra = f"collecting {replay.size}"
        if started:
            means = self.step_stats.means()
            sigma = float(std_from_param(learner.agent.std_param.detach(), self.args.std_map).mean())
            # publishes since the weights the newest stored step was acted with
            policy_lag = published_version(shared) - int(replay.policy_version[replay.head - 1])
            self.logger.log(
                global_step,
                {
                    "charts/SPS": sps,
                    "charts/learning_rate": annealed_learning_rate(k, self.args.learning_rate, self.args.A),
                    "charts/grad_steps": k,
                    "charts/policy_lag": policy_lag,
                    **means,
                    "refer/far_policy_frac": replay.far_fraction(),
                    "refer/beta": learner.beta,
                    "refer/c_max": refer_cmax(k, self.args.C, self.args.A),
                    "stats/reward_scale": replay.reward_scale,
                    "stats/sigma_mean": sigma,
                    "stats/replay_size": replay.size,
                },
            )
            loss = means["losses/value_loss"]
            extra = f"beta {learner.beta:.3f} far {replay.far_fraction():.3f} kl {means['refer/kl']:.3g}"
            self.last_k = k
        mean_return = np.mean(self.recent_returns) if self.recent_returns else None
        self.logger.progress(global_step, sps, mean_return, "value_loss", loss, extra)
        self.last_time = now
        self.last_step = global_step


class CheckpointCadence:
    """A checkpoint every --checkpoint-every env steps, counted from the last one (0: none)."""

    def __init__(self, every: int, global_step: int):
        self.every = every
        self.last = global_step

    def due(self, global_step: int) -> bool:
        if not self.every or global_step - self.last < self.every:
            return False
        self.last = global_step
        return True


if __name__ == "__main__":
    # with --resume: the checkpoint's flags, overridden by the flags given on this command line
    args, ckpt, overridden = parse_run_args(Args, "vracer_refer.py", FIXED_ON_RESUME, APPLIED_ON_RESUME, RUN_ONLY_ON_RESUME)
    # all checks come before anything heavy and before the run folder is made
    validate_args(args)
    check_checkpoint(ckpt, args.resume)
    steps_left = args.total_timesteps - (ckpt["global_step"] if ckpt else 0)
    # env steps before the first gradient step (none when the checkpoint brings a memory learning has started on)
    refill = steps_before_learning(ckpt, args)
    # a run, resumed or not, that would end before it learns
    if steps_left <= refill:
        no_memory = "; the checkpoint has no replay memory" if ckpt and ckpt["replay"] is None else ""
        raise SystemExit(
            f"error: --total-timesteps {args.total_timesteps:,} leaves {steps_left:,} env steps, not more than the "
            f"{refill:,} the replay memory must hold before the first gradient step (--learning-starts{no_memory})"
        )

    # MEMORY: the replay's RAM, refused at start-up when it cannot fit
    probe = make_env(args.env_id, args.seed)
    obs_dim = probe.observation_space.shape[0]
    act_dim = probe.action_space.shape[0]
    max_ep_len = probe.spec.max_episode_steps or 1000
    probe.close()
    check_memory(EpisodeReplay.bytes_needed(args.buffer_size, obs_dim, act_dim, max_ep_len), "--buffer-size")

    # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's run folder
    logger = start_run(args, ckpt, args.env_id)
    run_name = logger.run_name

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    # the learner takes the cores the actors leave free
    set_learner_threads(args.num_actors)

    # SETUP: network, optimizer, replay, shared memory for the actors
    agent = Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
    replay = EpisodeReplay(args.buffer_size, obs_dim, act_dim, args.gamma, max_ep_len, args.per_alpha)
    # a fresh run's values; with --resume, the checkpoint's (restore_run)
    rng = np.random.default_rng(args.seed)
    obs_mean = torch.zeros(obs_dim, device=device)
    obs_std = torch.ones(obs_dim, device=device)
    learner = Learner(
        agent, optimizer, replay, obs_mean, obs_std, rng, device, k=0, beta=args.beta_init if args.refer != "none" else 1.0
    )
    global_step = 0
    # the env step from which k keeps up with (t - t0)/F
    t0 = 0
    # learning has started (the replay held N_start samples); the state statistics have been computed
    started = False
    stats_ready = False
    if ckpt:
        global_step, t0, started, stats_ready = restore_run(ckpt, args, learner)
        if started:
            replay_note = f"replay memory ({replay.size:,} samples)"
        elif ckpt["replay"] is not None:
            replay_note = f"replay memory ({replay.size:,} samples, learning in {refill:,}+ steps)"
        else:
            replay_note = f"no replay memory (refilled in {refill:,}+ steps)"
        print(
            f"resumed {args.resume} at step {global_step:,}: network, Adam, k = {learner.k:,}, beta, statistics, RNGs, "
            f"{replay_note}; flags from this command line: {', '.join(overridden) or 'none'}; runs to step "
            f"{args.total_timesteps:,}",
            flush=True,
        )

    procs = ProcessGroup(torch.multiprocessing.get_context(args.start_method))
    num_params = sum(p.numel() for p in agent.parameters())
    shared = make_shared_handles(args.num_actors, args.ring_size, obs_dim, act_dim, num_params, procs.stop_event)
    # the versions of the published weights continue across a resume (the seqlock's number is twice the version)
    shared.weights_seq[0] = 2 * ckpt["weights_version"] if ckpt else 0

    def publish() -> None:
        publish_weights(shared, agent, obs_mean, obs_std)

    def allow_steps() -> None:
        """App. C Alg. 1: "while t < F k: advance the environment", with 32 steps of slack per actor."""
        limit = t0 + int(learner.k * args.F) + 32 * args.num_actors if started else args.total_timesteps
        shared.steps_allowed[0] = min(args.total_timesteps, limit) - base_step

    def save_checkpoint_now() -> None:
        contents = checkpoint_contents(args, learner, global_step, t0, started, stats_ready)
        weights_version = published_version(shared)
        save_run_checkpoint(logger, "vracer_refer.py", args, global_step, weights_version=weights_version, **contents)

    # the actors count env steps from 0 in this process: steps_allowed is relative to this step
    base_step = global_step
    publish()
    allow_steps()

    # blocks of ring rows of each actor's running episode
    partial = [[] for _ in range(args.num_actors)]
    checkpoints = CheckpointCadence(args.checkpoint_every, global_step)
    error = None
    start_time = time.time()
    loop_log = LoopLog(logger, args, global_step, learner.k)
    try:
        for i in range(args.num_actors):
            # resumed runs do not replay the same noise
            actor_seed = args.seed + 1000 * i + global_step
            procs.start(actor_loop, (i, args, obs_dim, act_dim, shared, actor_seed, run_name), name=f"actor-{i}")
        while True:
            # COLLECT: read the actor rings, assemble whole episodes, store them (App. C Alg. 2)
            for i in range(args.num_actors):
                n_rows, finished = store_episodes(shared, i, partial[i], replay)
                global_step += n_rows
                loop_log.episodes(global_step, finished)
            if not started and replay.size >= args.learning_starts:
                t0 = start_learning(learner, args, shared, base_step, stats_ready)
                started = True
                stats_ready = True
                publish()

            # LEARN: keep k <= (t - t0)/F (App. C Alg. 1), then publish the new weights
            grad_steps = 0
            if started:
                grad_steps = learn(learner, args, (global_step - t0) / args.F, loop_log.step_stats, publish)
            allow_steps()

            # LOG: metrics and a progress line every log_every gradient steps; a progress line every 10k collected
            loop_log.line_if_due(global_step, started, learner, shared)

            # CHECKPOINT
            if checkpoints.due(global_step):
                save_checkpoint_now()

            if global_step >= args.total_timesteps and (not started or learner.k >= (global_step - t0) / args.F):
                break
            # every iteration: a dead actor stops the run with its reason
            procs.check()
            if not grad_steps:
                time.sleep(0.0005)
    # FloatingPointError: train_step's NaN guard
    except (KeyboardInterrupt, StopRun, FloatingPointError) as e:
        error = e
    finally:
        procs.stop()
    # the run's last state, after a normal end (a resume continues from it)
    if args.checkpoint_every and error is None:
        try:
            save_checkpoint_now()
        except StopRun as e:
            error = e

    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    def final_eval() -> dict:
        eval_seed = args.seed + 10_000
        returns = evaluate(agent, args.env_id, eval_seed, args.eval_episodes, obs_mean, obs_std, device, args.clip_actions)
        for episode_return in returns:
            logger.log(global_step, {"eval/episodic_return": episode_return})
        return {"eval_return_mean": float(np.mean(returns))}

    model_file = {"model": agent.state_dict(), "args": vars(args), "obs_mean": obs_mean.cpu(), "obs_std": obs_std.cpu()}
    finish_run(
        logger,
        error,
        {
            "global_step": global_step,
            "grad_steps": learner.k,
            "beta": learner.beta,
            "final_return_mean20": float(np.mean(loop_log.recent_returns)) if loop_log.recent_returns else None,
            "env_steps_per_s": (global_step - base_step) / max(1e-9, time.time() - start_time),
        },
        model_file if args.save_model else None,
        final_eval if args.save_model and args.eval_episodes else None,
    )

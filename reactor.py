# docs and results: README.md#reactorpy-reactor
"""Reactor (Gruslys, Dabney, Azar, Piot, Bellemare, Munos 2018, https://arxiv.org/abs/1704.04651), one file.

Actor processes stream transitions to a learner that trains a recurrent categorical Q head with distributional
Retrace and a policy head with beta-LOO, from prioritized replay of 33-observation sequences.

Paper parts, in file order
- Network (3.4.1): conv torso, separate policy and Q LSTMs, categorical Q = value + action logits, uniform-mixed
  policy, CReLU `ReactorNetwork`.
- C51 projection (C51 Eq. (7)) `categorical_projection`; Retrace (Eqs. (3)-(4), the scalar "ND" ablation)
  `retrace_returns`; distributional Retrace, an alpha-mixture of n-step backups, cross-entropy (3.2, Eq. (12))
  `distributional_retrace_target`, `reactor_loss`.
- beta-LOO (Eq. (10), beta = min(c, 1/mu(A))) `beta_loo_policy_loss`; TISLR ablation (3.1) `tislr_policy_loss`.
- Prioritized sequence replay, lazy initialization (3.3) `LazyPriorities`, `SequenceReplay`; priorities = mean |TD|
  (ND) or total variation (distributional) in `reactor_loss`.
- Acting:learning ratio (3.4) `learner_may_learn`, `actor_loop`; Adam, priorities back, weights to the actors and the target
  network (3.4, 4.1) `learning_step`, `publish_weights`, `__main__`; no-op starts, whole games, real scores (4.1) `evaluate`.

Defaults: 32 transitions per sequence, batch 4, replay_ratio 4 (3.4); target update 1000, lambda 1, beta_loo_c 1 (4.1,
Fig. 3); lr 5e-5, Adam beta1 0 (3.4.1); IS exponent 1 (3.3). The appendix's tables are lost (its priority-tree text
is not): other values (C51's atoms and gamma, A3C's grad clip, ACER's tislr_c) are flags; fixed: layer sizes, Adam beta2/eps.

Differences from the paper (long form: README.md, section reactor.py)
- One machine: N actor processes and one learner with a local replay; hogwild shared weights, no parameter server.
- The appendix's Contextual Priority Tree (an AVL tree over time-ordered keys with subtree counts and mean estimates) ->
  three sum trees and a list of known keys with cell sizes; same estimate (cells' size-weighted mean, 3.3), O(log n).
- LSTM states stored (R2D2) in float16; loss averaged over a sequence's valid steps, then IS-weighted; IS weights
  normalized by their batch maximum; R(A) in beta-LOO is the scalar Retrace return; a lost life resets the LSTM.
- Both networks unroll all 33 frames (paper: online 1-32, target 2-33); a truncation's last frame is stored, bootstrapped.
- MinAtar (`--env-id MinAtar/...`, CPU scale): MinAtar's torso (one 3x3 conv, 16 channels) under the paper's linear,
  LSTMs and heads; 0/1 frames not rescaled, rewards unclipped, sticky actions 0.1 (MinAtar's standard).
Copying this file: it needs common/{atari_env,minatar_env,args,logger,checkpoint,processes,video,sum_tree}.py.
"""

import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.args import CommonArgs, parse_run_args, require
from common.atari_env import ATARI_ENV_IDS, make_atari_env
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
from common.minatar_env import MINATAR_ENV_IDS, make_minatar_env
from common.processes import (
    ChunkChannel,
    ProcessGroup,
    StopRun,
    check_memory,
    check_stop,
    finish_run,
    set_learner_threads,
    stop_on_signals,
)
from common.sum_tree import SumTree
from common.video import check_video_support


@dataclass
class Args(CommonArgs):  # CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
    # --- algorithm specific arguments ---
    env_id: str = "ALE/Pong-v5"
    """an Atari game (gymnasium ALE id, e.g. ALE/Pong-v5) or a MinAtar game (MinAtar/Breakout-v0, ...)"""
    total_timesteps: int = 50_000_000
    """total environment steps over all actors (agent steps; 1 step = 4 frames; paper: 200M frames = 50M steps)"""
    num_actors: int = 2
    """number of actor processes (CPU, one thread each); the paper used 10 actor-learner workers"""
    replay_size: int = 1_000_000
    """replay capacity in transitions (= sequence keys), split evenly between actors (not in the recovered paper)"""
    learning_starts: int = 10_000
    """env steps collected before learning starts (not in the recovered paper)"""
    batch_size: int = 4
    """sequences per learning step (paper 3.4)"""
    sequence_length: int = 32
    """transitions per sequence; the network sees sequence_length + 1 = 33 observations (paper 3.4)"""
    replay_ratio: float = 4.0
    """acting steps per learning step, enforced in both directions (paper 3.4: 4 to 6)"""
    ratio_slack: int = 512
    """env steps the actors may run ahead of replay_ratio * learning steps before they wait"""
    actor_chunk: int = 16
    """transitions an actor sends to the learner at once"""
    learning_rate: float = 5e-5
    """Adam learning rate (paper 3.4.1)"""
    adam_beta1: float = 0.0
    """Adam first-moment momentum (paper 3.4.1: zero momentum)"""
    max_grad_norm: float = 40.0
    """gradient clipping norm, 0 = off (A3C's value, not in the recovered paper)"""
    target_update_period: int = 1000
    """learning steps between target network copies (T_update, paper 4.1)"""
    gamma: float = 0.99
    """discount factor gamma (not in the recovered paper; C51/DQN value)"""
    retrace_lambda: float = 1.0
    """lambda in the traces c_s = lambda * min(1, pi/mu) (paper 4.1)"""
    distributional: bool = True
    """distributional Retrace with a categorical Q head; --no-distributional is the scalar 'Reactor ND' ablation"""
    num_atoms: int = 51
    """number of atoms N of the categorical return distribution (C51 value, not in the recovered paper)"""
    v_min: float = -10.0
    """lowest atom z_0 (C51 value, not in the recovered paper)"""
    v_max: float = 10.0
    """highest atom z_{N-1} (C51 value, not in the recovered paper)"""
    policy_gradient: Literal["beta-loo", "tislr"] = "beta-loo"
    """policy gradient estimator: beta-loo (Eq. (10)) | tislr (ACER, the paper's ablation)"""
    beta_loo_c: float = 1.0
    """c in beta = min(c, 1/mu(A)) of beta-LOO (paper: beta = 1, i.e. c = 1)"""
    tislr_c: float = 10.0
    """truncation c of TISLR (ACER's value)"""
    entropy_coef: float = 0.01
    """entropy regularization weight (the paper mentions an A3C-style entropy cost; value not recovered)"""
    policy_uniform_eps: float = 0.01
    """epsilon of the uniform mix pi = (1 - eps) softmax + eps / |A| (value not recovered)"""
    crelu: bool = True
    """concatenated ReLU activations (paper appendix comparison with Rainbow); --no-crelu uses ReLU"""
    lstm_size: int = 128
    """units of each LSTM (not recovered; unconfirmed Table 3 recollection)"""
    prioritized: bool = True
    """prioritized sequence replay with lazy initialization; --no-prioritized samples uniformly"""
    replay_uniform_eps: float = 0.1
    """probability of sampling uniformly instead of proportionally to the priority estimate (value not recovered)"""
    priority_exponent: float = 1.0
    """priorities are stored as p^exponent (paper samples proportionally to p: 1; PER would use 0.6)"""
    sticky_action_prob: float | None = None
    """sticky actions; None = the family's standard: Atari 0 (paper: DQN pipeline, none), MinAtar 0.1 (MinAtar's)"""
    noop_max: int = 30
    """maximum no-op actions at the start of an Atari game (acting and evaluation; MinAtar has none)"""
    torso: Literal["auto", "paper", "minatar"] = "auto"
    """paper (3.4.1's conv torso, 84x84 frames) | minatar (MinAtar's one 3x3 conv, 16 channels, 10x10) | auto (by env)"""
    actor_sync_every: int = 16
    """actor env steps between checks for new weights in shared memory"""
    eval_episodes: int = 10
    """whole games played by the final evaluation (paper: 200)"""
    log_every: int = 100
    """learning steps between metric log lines"""
    checkpoint_replay: bool = False
    """also store the replay memory in checkpoints (large)"""
    memory_fraction: float = 0.8
    """refuse a replay needing more than this fraction of the available RAM"""


# the flags a resumed run may not change (environment, seed, network, method; the replay is per actor), range rules
FIXED_ON_RESUME = (
    "env_id",
    "seed",
    "sticky_action_prob",
    "torso",
    "lstm_size",
    "crelu",
    "policy_uniform_eps",
    "distributional",
    "num_atoms",
    "v_min",
    "v_max",
    "gamma",
    "policy_gradient",
    "prioritized",
    "num_actors",
    "replay_size",
    "sequence_length",
)


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags; the first violation stops the script with one line `error: ...`."""
    require(args.total_timesteps > 0, f"--total-timesteps must be > 0, got {args.total_timesteps!r}")
    require(args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors!r}")
    require(args.learning_starts >= 0, f"--learning-starts must be >= 0, got {args.learning_starts!r}")
    require(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size!r}")
    require(args.sequence_length >= 1, f"--sequence-length must be >= 1, got {args.sequence_length!r}")
    require(args.replay_ratio > 0, f"--replay-ratio must be > 0, got {args.replay_ratio!r}")
    require(args.ratio_slack >= 0, f"--ratio-slack must be >= 0, got {args.ratio_slack!r}")
    require(args.actor_chunk >= 1, f"--actor-chunk must be >= 1, got {args.actor_chunk!r}")
    require(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate!r}")
    require(0 <= args.adam_beta1 < 1, f"--adam-beta1 must be in [0, 1), got {args.adam_beta1!r}")
    require(args.max_grad_norm >= 0, f"--max-grad-norm must be >= 0, got {args.max_grad_norm!r}")
    require(args.target_update_period >= 1, f"--target-update-period must be >= 1, got {args.target_update_period!r}")
    require(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma!r}")
    require(0 <= args.retrace_lambda <= 1, f"--retrace-lambda must be in [0, 1], got {args.retrace_lambda!r}")
    require(args.num_atoms >= 2, f"--num-atoms must be >= 2, got {args.num_atoms!r}")
    require(args.beta_loo_c >= 1, f"--beta-loo-c must be >= 1, got {args.beta_loo_c!r}")
    require(args.tislr_c > 0, f"--tislr-c must be > 0, got {args.tislr_c!r}")
    require(args.entropy_coef >= 0, f"--entropy-coef must be >= 0, got {args.entropy_coef!r}")
    require(0 <= args.policy_uniform_eps < 1, f"--policy-uniform-eps must be in [0, 1), got {args.policy_uniform_eps!r}")
    require(args.lstm_size >= 1, f"--lstm-size must be >= 1, got {args.lstm_size!r}")
    require(0 <= args.replay_uniform_eps <= 1, f"--replay-uniform-eps must be in [0, 1], got {args.replay_uniform_eps!r}")
    require(args.priority_exponent >= 0, f"--priority-exponent must be >= 0, got {args.priority_exponent!r}")
    require(
        args.sticky_action_prob is None or 0 <= args.sticky_action_prob <= 1,
        f"--sticky-action-prob must be in [0, 1], got {args.sticky_action_prob!r}",
    )
    require(args.noop_max >= 0, f"--noop-max must be >= 0, got {args.noop_max!r}")
    require(args.actor_sync_every >= 1, f"--actor-sync-every must be >= 1, got {args.actor_sync_every!r}")
    require(args.eval_episodes >= 0, f"--eval-episodes must be >= 0, got {args.eval_episodes!r}")
    require(args.log_every >= 1, f"--log-every must be >= 1, got {args.log_every!r}")
    require(0 < args.memory_fraction <= 1, f"--memory-fraction must be in (0, 1], got {args.memory_fraction!r}")
    minatar, slots = args.env_id in MINATAR_ENV_IDS, 2 * (args.sequence_length + 1) + args.actor_chunk + 2
    for bad, msg in (
        (
            args.env_id not in ATARI_ENV_IDS and not minatar,
            f"reactor.py is for Atari and MinAtar (discrete actions, image "
            f"frames): {args.env_id!r} is neither a registered ALE id (ALE/Pong-v5) nor a MinAtar id (MinAtar/Breakout-v0)",
        ),
        (minatar and args.torso == "paper", "--torso paper needs 84x84 Atari frames: MinAtar takes --torso minatar (or auto)"),
        (minatar and args.capture_video, "--capture-video needs an Atari game (MinAtar envs render no frames here)"),
        (
            args.total_timesteps <= args.learning_starts,
            f"--total-timesteps ({args.total_timesteps:,}) must be > --learning-starts ({args.learning_starts:,})",
        ),
        (args.v_max <= args.v_min, f"--v-max ({args.v_max}) must be > --v-min ({args.v_min})"),
        (
            args.policy_gradient == "tislr" and args.policy_uniform_eps == 0,
            "tislr needs --policy-uniform-eps > 0 so that mu(a) > 0 for all actions",
        ),
        (
            args.replay_size // args.num_actors < slots,
            f"--replay-size {args.replay_size} is too small: each of the {args.num_actors} actors needs >= {slots} slots",
        ),
    ):
        if bad:
            raise SystemExit(f"error: {msg}")
    try:
        if args.capture_video:
            check_video_support()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def make_env(env_id: str, seed: int, args: Args, *, evaluation: bool = False, video_folder: str | None = None):
    """Atari: (1, 84, 84) uint8, rewards clipped and life loss = episode end for learning only. MinAtar: (C, 10, 10) as is."""
    sticky = args.sticky_action_prob
    if env_id in MINATAR_ENV_IDS:
        return make_minatar_env(env_id, seed, sticky_action_prob=0.1 if sticky is None else sticky)
    return make_atari_env(
        env_id,
        seed,
        frame_stack=1,
        clip_rewards=not evaluation,
        terminal_on_life_loss=not evaluation,
        sticky_action_prob=sticky or 0.0,
        noop_max=args.noop_max,
        capture_video=video_folder is not None,
        video_folder=video_folder,
    )


# NETWORK
class CReLU(nn.Module):
    """Concatenated ReLU: [relu(x), relu(-x)] along the feature axis (doubles the width)."""

    def forward(self, x):
        return torch.cat([x, x.neg()], dim=1).relu_()  # = cat([relu(x), relu(-x)]), values and gradients, fewer passes


class NetOut(NamedTuple):
    q: torch.Tensor  # [B, L, A, K] categorical logits (distributional) or [B, L, A] action values (ND)
    pi: torch.Tensor  # [B, L, A] mixed policy probabilities
    state: tuple  # (h_q, c_q, h_pi, c_pi) after the last step


class ReactorNetwork(nn.Module):
    """Paper 3.4.1: conv torso -> shared linear -> {Q LSTM, policy LSTM} -> heads (one frame at a time)."""

    def __init__(
        self,
        num_actions: int,
        obs_shape: tuple,
        num_atoms: int = 51,
        lstm_size: int = 128,
        crelu: bool = True,
        distributional: bool = True,
        policy_uniform_eps: float = 0.01,
        torso: str = "paper",
        obs_scale: float = 255.0,
    ):
        super().__init__()
        (act, m), c = ((CReLU, 2) if crelu else (nn.ReLU, 1)), obs_shape[0]
        self.num_actions, self.num_atoms, self.lstm_size, self.obs_shape = num_actions, num_atoms, lstm_size, tuple(obs_shape)
        self.distributional, self.policy_uniform_eps, self.obs_scale = distributional, policy_uniform_eps, obs_scale
        if torso == "paper":  # layer sizes: not recovered (unconfirmed recollection of the paper's Table 3)
            convs = [
                nn.Conv2d(c, 16, 8, stride=4),
                act(),
                nn.Conv2d(16 * m, 32, 4, stride=2),
                act(),
                nn.Conv2d(32 * m, 32, 3, stride=1),
                act(),
                nn.Flatten(),
            ]
        else:  # MinAtar's network (Young & Tian 2019): one 3x3 conv with 16 channels
            convs = [nn.Conv2d(c, 16, 3, stride=1), act(), nn.Flatten()]
        with torch.no_grad():  # the size of the flattened conv output
            n = nn.Sequential(*convs)(torch.zeros(1, *self.obs_shape)).shape[1]
        self.torso = nn.Sequential(*convs, nn.Linear(n, 128), act())
        self.q_lstm, self.pi_lstm = (nn.LSTM(128 * m, lstm_size, batch_first=True) for _ in "qp")  # fused (cuDNN on a GPU)
        self.q_hidden, self.pi_hidden = (nn.Sequential(nn.Linear(lstm_size, 32), act()) for _ in "qp")
        k = num_atoms if distributional else 1
        self.value_logits = nn.Linear(32 * m, k)  # state-value logits
        self.action_logits = nn.Linear(32 * m, num_actions * k)  # action-specific logits
        self.pi_logits = nn.Linear(32 * m, num_actions)

    def initial_state(self, batch: int, device=None):
        return tuple(torch.zeros(batch, self.lstm_size, device=device) for _ in range(4))

    def forward(self, obs: torch.Tensor, first: torch.Tensor, state: tuple, policy: bool = True) -> NetOut:
        """obs [B, L, C, H, W] uint8, first [B, L] (episode starts: LSTM state reset before that frame). policy=False
        (the target network, whose policy is never used) skips the policy LSTM and head: pi and its state are None."""
        B, L = obs.shape[:2]
        x = self.torso(obs.reshape(B * L, *self.obs_shape).float() / self.obs_scale).reshape(B, L, -1)
        hq, cq, hp, cp = (h.unsqueeze(0) for h in state)
        keep = (~first.bool()).float().T[:, None, :, None]  # [L, 1, B, 1]
        # cut where any sequence starts an episode: fused pieces, the state reset at each cut (= step-by-step resets)
        cuts = [0, *(torch.nonzero(first[:, 1:].any(0)).flatten() + 1).tolist(), L]
        q_out, pi_out = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            hq, cq = hq * keep[a], cq * keep[a]
            yq, (hq, cq) = self.q_lstm(x[:, a:b], (hq, cq))
            q_out.append(yq)
            if policy:  # gradient blocking (3.4.1): only the Q LSTM back-propagates into the shared torso
                hp, cp = hp * keep[a], cp * keep[a]
                yp, (hp, cp) = self.pi_lstm(x[:, a:b].detach(), (hp, cp))
                pi_out.append(yp)
        hq_all = self.q_hidden(torch.cat(q_out, 1).reshape(B * L, -1))
        # "Final action-value logits are produced by summing state- and action-specific logits" (no mean subtraction)
        q = self.value_logits(hq_all).unsqueeze(1) + self.action_logits(hq_all).view(B * L, self.num_actions, -1)
        q = q.view(B, L, *q.shape[1:]) if self.distributional else q.view(B, L, self.num_actions)
        if not policy:
            return NetOut(q, None, (hq[0], cq[0], None, None))
        hp_all = self.pi_hidden(torch.cat(pi_out, 1).reshape(B * L, -1))
        # policy: softmax mixed with a fixed uniform distribution (3.4.1)
        pi = (1 - self.policy_uniform_eps) * F.softmax(self.pi_logits(hp_all), -1) + self.policy_uniform_eps / self.num_actions
        return NetOut(q, pi.view(B, L, self.num_actions), (hq[0], cq[0], hp[0], cp[0]))


def make_network(args: Args, num_actions: int, obs_shape) -> ReactorNetwork:
    """The network for this env family: the paper's torso on Atari (frames / 255), MinAtar's on MinAtar (0/1 frames)."""
    minatar = args.env_id in MINATAR_ENV_IDS
    torso = ("minatar" if minatar else "paper") if args.torso == "auto" else args.torso
    return ReactorNetwork(
        num_actions,
        obs_shape,
        args.num_atoms,
        args.lstm_size,
        args.crelu,
        args.distributional,
        args.policy_uniform_eps,
        torso,
        obs_scale=1.0 if minatar else 255.0,
    )


def make_learner(args: Args, num_actions: int, obs_shape, device):
    """The network, its target copy and Adam (3.4.1); channels-last convs, fused Adam: same up to rounding, faster on CPU."""
    net, target_net = (make_network(args, num_actions, obs_shape).to(device, memory_format=torch.channels_last) for _ in "ab")
    target_net.load_state_dict(net.state_dict())  # Adam's beta2 and eps: torch's defaults (not in the recovered paper)
    return net, target_net, torch.optim.Adam(net.parameters(), args.learning_rate, (args.adam_beta1, 0.999), fused=True)


# ALGORITHM PIECES: small pure functions, each with the paper's equation numbers in comments
def _at(x: torch.Tensor, a: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x at the actions a [...] (a gather): x [..., A] -> [...] (dim -1), or x [..., A, K] -> [..., K] (dim -2)."""
    idx = a.long().unsqueeze(-1)
    return torch.take_along_dim(x, idx if dim == -1 else idx.unsqueeze(-1), dim).squeeze(dim)


def categorical_projection(atoms: torch.Tensor, probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Project sum_j probs_j delta_{atoms_j} onto the fixed grid `support` (C51 Eq. (7), the kernel h_{z_i} of 3.2):
    out_i = sum_j probs_j * h_{z_i}(atoms_j), h_{z_i}(x) = clip(1 - |clip(x, v_min, v_max) - z_i| / dz, 0, 1). atoms,
    probs: [..., M] (broadcastable), support: [K] evenly spaced -> [..., K]; linear in probs (signed alpha is fine), O(M)."""
    atoms, probs = torch.broadcast_tensors(atoms, probs)
    K, v_min, v_max = support.shape[0], float(support[0]), float(support[-1])
    b = ((atoms - v_min) / ((v_max - v_min) / (K - 1))).clamp_(0, K - 1)  # grid position, atoms clipped to the range
    lower = b.floor()
    upper_w = probs * b.sub_(lower)  # the upper neighbour's share: 0 for an atom on a grid point
    lower = lower.long()
    out = probs.new_zeros(*probs.shape[:-1], K).scatter_add_(-1, lower, probs - upper_w)
    return out.scatter_add_(-1, (lower + 1).clamp_(max=K - 1), upper_w)


def _window_products(x: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """x [B, T] -> P [B, T(t), T(j)], P[t, j] = prod_{i=t}^{j} x_i (inclusive) or prod_{i=t}^{j-1} x_i for j >= t, by a
    cumulative product with 1 before t (zeros in x, cut traces or terminal discounts, stay exact); j < t: garbage."""
    later = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu()  # [t, i]: i >= t
    incl = torch.cumprod(torch.where(later, x[:, None, :], torch.ones((), dtype=x.dtype, device=x.device)), dim=-1)
    return incl if inclusive else torch.cat([torch.ones_like(incl[..., :1]), incl[..., :-1]], dim=-1)


def retrace_returns(rewards, discounts, c_next, v_next, q_next_a):
    """Scalar Retrace target Q^ret(x_t, a_t) (Eqs. (3)-(4)) on a sequence of T transitions: the backward recursion
        Q^ret_t = r_t + gamma_t [ E_pi Q(x_{t+1}, .) - c_{t+1} Q(x_{t+1}, a_{t+1}) + c_{t+1} Q^ret_{t+1} ]
    (= Q(x_t,a_t) + sum_{s>=t} gamma^{s-t} (c_{t+1}...c_s) delta_s), unrolled for all t at once: Q^ret_t =
    sum_{s>=t} (prod_{u=t}^{s-1} gamma_u c_{u+1}) x_s, x_s = r_s + gamma_s [E_pi Q(x_{s+1}, .) - c_{s+1} Q(x_{s+1}, a_{s+1})].
    All [B, T]: rewards r_t, discounts gamma_t (0 after a termination), c_next = c_{t+1} (the last one taken as 0),
    v_next = E_pi Q(x_{t+1}, .), q_next_a = Q(x_{t+1}, a_{t+1})."""
    T = rewards.shape[1]
    c = torch.cat([c_next[:, :-1], torch.zeros_like(c_next[:, -1:])], 1)  # the sequence end cuts the trace
    x = rewards + discounts * (v_next - c * q_next_a)
    later = torch.ones(T, T, dtype=torch.bool, device=rewards.device).triu()  # s >= t
    weights = torch.where(later, _window_products(discounts * c, inclusive=False), 0.0)  # [B, T(t), T(s)]
    return (weights @ x.unsqueeze(-1)).squeeze(-1)


def distributional_retrace_target(rewards, discounts, c_next, pi_next, q_next, a_next, support):
    """Distributional Retrace target q*_i(x_t, a_t) for every t of a sequence (paper 3.2):
        q*_i(x_t,a_t) = sum_{n>=1} sum_a alpha_{n,a} sum_j q_j(x_{t+n}, a) h_{z_i}(z^n_j),
        alpha_{n,a} = (c_{t+1}...c_{t+n-1}) (pi(a|x_{t+n}) - 1{a = a_{t+n}} c_{t+n}),
        z^n_j = sum_{s=t}^{t+n-1} gamma^{s-t} r_s + gamma^n z_j.
    rewards, discounts (gamma_t, 0 after termination), c_next (c_{t+1}), a_next (a_{t+1}): [B, T]; pi_next: [B, T, A];
    q_next (target-network probabilities): [B, T, A, K]; support z: [K]. The sequence end cuts the trace (c_{t+T} := 0):
    sum alpha = 1, total mass 1 (entries may be negative, not in expectation). [B, T, K], from the T (T + 1) / 2 pairs."""
    B, T, A, K = q_next.shape
    c = torch.cat([c_next[:, :-1], torch.zeros_like(c_next[:, -1:])], 1)  # c_{t+K} := 0 at the end of the sequence
    # Y_s = sum_a (pi(a|x_s) - 1{a=a_s} c_s) q(x_s, a) = E_pi q(x_s) - c_s q(x_s, a_s)       [B, T(s), K]
    y = (pi_next.unsqueeze(-1) * q_next).sum(2) - c.unsqueeze(-1) * _at(q_next, a_next, dim=-2)
    trace = _window_products(c, inclusive=False)  # [t, j]: c_{t+1} ... c_{s-1} for s = j + 1
    disc_incl = _window_products(discounts, inclusive=True)  # gamma^n (with cuts): prod_{u=t}^{s-1} gamma_u
    disc_excl = _window_products(discounts, inclusive=False)  # prod_{u=t}^{j-1} gamma_u: discount of r_j
    valid = torch.ones(T, T, dtype=torch.bool, device=rewards.device).triu()  # j >= t, i.e. n = j - t + 1 >= 1
    ret = torch.cumsum(torch.where(valid, disc_excl * rewards[:, None, :], 0.0), dim=-1)  # sum gamma^{s-t} r_s
    t_idx, j_idx = torch.triu_indices(T, T, device=rewards.device)  # the pairs (t, j >= t), t-major
    weights = trace[:, t_idx, j_idx, None] * y[:, j_idx]  # alpha-weighted q_j                               [B, P, K]
    atoms = ret[:, t_idx, j_idx, None] + disc_incl[:, t_idx, j_idx, None] * support  # z^n_j                [B, P, K]
    projected = categorical_projection(atoms, weights, support)  # each pair's K atoms                   [B, P, K]
    return projected.new_zeros(B, T, K).index_add_(1, t_idx, projected)  # summed over n, for each t


def beta_loo_policy_loss(pi, q, actions, returns, mu_a, c: float = 1.0):
    """Negative beta-LOO surrogate (Eq. (10)): its gradient is -[beta (R(A) - Q(A)) grad pi(A) + sum_a Q(a) grad pi(a)],
    beta = min(c, 1/mu(A)) (3.1; c = 1: the paper's beta = 1). Only pi [..., A] has a gradient: q, R(A), mu(A) constants."""
    beta, q = torch.clamp(1.0 / mu_a, max=c), q.detach()
    return -(beta * (returns - _at(q, actions)).detach() * _at(pi, actions) + (q * pi).sum(-1))


def tislr_policy_loss(pi, q, actions, returns, mu, c: float = 10.0):
    """Negative TISLR surrogate (ACER; paper 3.1), beta-LOO's ablation: min(c, rho(A)) (R(A) - V) grad log pi(A) +
    sum_a (rho(a) - c)_+ mu(a) (Q(a) - V) grad log pi(a), V = sum_a pi Q; only pi has a gradient; mu: [..., A], all of it."""
    q, pi_d, log_pi = q.detach(), pi.detach(), torch.log(pi)
    rho, v = pi_d / mu, (pi_d * q).sum(-1)
    term1 = torch.clamp(_at(rho, actions), max=c) * (returns - v).detach() * _at(log_pi, actions)
    return -(term1 + (F.relu(rho - c) * mu * (q - v.unsqueeze(-1)) * log_pi).sum(-1))


def discounts_and_traces(rho, term, pad, first, gamma: float, lam: float):
    """Discounts gamma_t, traces c_{t+1} (c_s = lambda min(1, rho_s), Eq. (4)) and loss mask from T+1 slots ([B, T+1]).
    An episode end cuts them: a termination at t gives gamma_t = 0, c_{t+1} = 0; a time-limit truncation at t is followed
    by a pad slot holding the true last frame: gamma_t stays (bootstrap from it), c_{t+1} = 0, and the pad slot carries
    no transition (mask 0, gamma 0). Returns (disc [B, T], c_next [B, T], mask [B, T])."""
    term, pad, first = term.to(rho.dtype), pad.to(rho.dtype), first.to(rho.dtype)
    mask = 1.0 - pad[:, :-1]
    disc = gamma * (1.0 - term[:, :-1]) * mask
    c_next = lam * torch.clamp(rho[:, 1:], max=1.0) * (1.0 - first[:, 1:]) * (1.0 - pad[:, 1:]) * mask  # Eq. (4)
    return disc, c_next, mask


class Batch(NamedTuple):
    obs: torch.Tensor  # [B, T+1, C, H, W] uint8
    actions: torch.Tensor  # [B, T+1]
    rewards: torch.Tensor  # [B, T+1] (r of the transition leaving each slot)
    term: torch.Tensor  # [B, T+1] transition from this slot terminated
    pad: torch.Tensor  # [B, T+1] slot is the last frame of a truncated episode (no transition from it)
    first: torch.Tensor  # [B, T+1] slot is the first frame of an episode
    mu: torch.Tensor  # [B, T+1, A] behaviour policy at acting time (with the uniform mix)
    state: tuple  # 4 x [B, H] LSTM state before slot 0
    weights: torch.Tensor  # [B] importance-sampling weights


def reactor_loss(net, target_net, batch: Batch, support, args: Args):
    """One Reactor loss on a batch of sequences. Returns (loss, per-sequence priorities, stats dict of tensors)."""
    out = net(batch.obs, batch.first, batch.state)
    with torch.no_grad():
        tout = target_net(batch.obs, batch.first, batch.state, policy=False)  # (its policy is never used)
    T, pi, a = batch.obs.shape[1] - 1, out.pi, batch.actions.long()  # pi: [B, T+1, A]
    pi_d, mu_a = pi.detach(), _at(batch.mu, a)
    rho = _at(pi_d, a) / mu_a
    disc, c_next, mask = discounts_and_traces(rho, batch.term, batch.pad, batch.first, args.gamma, args.retrace_lambda)
    rewards = batch.rewards[:, :T].float()
    if args.distributional:
        logq = F.log_softmax(out.q, -1)  # [B, T+1, A, K]
        q_online = (logq.exp() * support).sum(-1).detach()  # Eq. (5): Q = sum_i q_i z_i
        q_next = F.softmax(tout.q[:, 1:], -1)
        qbar_next = (q_next * support).sum(-1)
    else:
        q_online, qbar_next = out.q.detach(), tout.q[:, 1:]
    v_next, q_next_a = (pi_d[:, 1:] * qbar_next).sum(-1), _at(qbar_next, a[:, 1:])
    returns = retrace_returns(rewards, disc, c_next, v_next, q_next_a)  # R(A), Eq. (3)
    if args.distributional:
        target = distributional_retrace_target(rewards, disc, c_next, pi_d[:, 1:], q_next, a[:, 1:], support)
        logq_a = _at(logq[:, :T], a[:, :T], dim=-2)
        value_loss = -(target * logq_a).sum(-1)  # Eq. (12): cross-entropy with the (signed) target
        td_size = 0.5 * (target - logq_a.exp()).abs().sum(-1)  # total variation (3.3)
    else:
        q_taken = _at(out.q[:, :T], a[:, :T])
        value_loss = 0.5 * (returns - q_taken) ** 2
        td_size = (returns - q_taken).abs().detach()  # |TD| along the sequence (3.3)
    if args.policy_gradient == "beta-loo":
        policy_loss = beta_loo_policy_loss(pi[:, :T], q_online[:, :T], a[:, :T], returns, mu_a[:, :T], args.beta_loo_c)
    else:
        policy_loss = tislr_policy_loss(pi[:, :T], q_online[:, :T], a[:, :T], returns, batch.mu[:, :T], args.tislr_c)
    entropy = -(pi[:, :T] * torch.log(pi[:, :T])).sum(-1)
    per_step = value_loss + policy_loss - args.entropy_coef * entropy
    denom, n = mask.sum(1).clamp(min=1.0), mask.sum().clamp(min=1.0)
    loss = (batch.weights * (per_step * mask).sum(1) / denom).mean()  # IS-weighted mean over the valid steps
    priorities = (td_size.detach() * mask).sum(1) / denom  # mean |TD| (ND) or mean total variation
    stats = {
        "losses/value_loss": value_loss,
        "losses/policy_loss": policy_loss,
        "losses/entropy": entropy,
        "losses/q_values": _at(q_online, a)[:, :T],
        "losses/retrace_return": returns,
        "replay/rho_mean": rho[:, :T],
        "replay/trace_mean": c_next,
        "replay/trace_cut_fraction": (c_next < 0.99).float(),
    }  # c < 0.99 (episode ends too)
    return loss, priorities, {k: (x.detach() * mask).sum() / n for k, x in stats.items()}  # means over the valid steps


# PRIORITIZED SEQUENCE REPLAY WITH LAZY INITIALIZATION (paper 3.3)
class LazyPriorities:
    """Sequence keys 0..capacity-1 with lazily initialized priorities (paper 3.3), O(log n) per key and operation.

    A key is *valid* when its whole sequence is in memory, and *known* once trained on (it has a priority p). The
    known keys s_1 < s_2 < ... partition the valid keys into cells I_i = {valid keys from s_i up to s_{i+1}}
    (circularly), one known key each. J(t) = the cell of t and its two neighbour cells. An unknown key of cell i gets
        p_hat = sum_{j in J} w_j p_j / sum_{j in J} w_j,  w_j = |I_j| (cell sizes: inverse local density),
    so the cell's mass m_i = p_i + (|I_i| - 1) p_hat_i is held at s_i in a sum tree. Sampling: with probability eps
    uniformly over the valid keys, else proportionally to p_hat (a cell by mass, then its known key with probability
    p_i / m_i, else one of its unknown keys uniformly); uniform while no priority is known. Links and sizes of the
    known keys make an estimate O(1); a change at a key alters at most 4 cells' masses (`_touched`)."""

    num_valid = property(lambda self: int(self.valid.total))
    num_known = property(lambda self: int(self.known.total))

    def __init__(self, capacity: int, uniform_eps: float = 0.1):
        self.capacity, self.eps = capacity, uniform_eps
        self.valid, self.known = SumTree(capacity, np.int64), SumTree(capacity, np.int64)  # 0/1 flags
        self.mass = SumTree(capacity, np.float64)  # the mass of each cell, at its known key
        self.priority = np.zeros(capacity, np.float64)
        self.prev_known, self.next_known, self.cell_size = np.zeros((3, capacity), np.int64)  # known keys' links, |I|
        # scalar access to these four arrays (so write them in place only)
        self._views = tuple(memoryview(a) for a in (self.priority, self.prev_known, self.next_known, self.cell_size))

    def _is_known(self, k: int) -> bool:
        return self.known.nodes[k + self.known.size] != 0

    def _owner(self, k: int, guess: int = -1) -> int:
        """The last known key <= k, circularly (its cell holds k); `guess`, a known key, is checked first in O(1)."""
        n = self.capacity
        if guess >= 0 and (k - guess) % n < ((self._views[2][guess] - guess) % n or n):  # k in [guess, next known key)
            return guess
        return self.known.last_nonzero_at_or_before(k)

    def _cell_estimate(self, c: int) -> float:
        """p_hat of the unknown keys of known key c's cell: the cell-size weighted mean over J (distinct cells)."""
        p, prev, nxt, size = self._views
        a, b = prev[c], nxt[c]
        num, den = size[c] * p[c], size[c]
        for j in () if a == c else (a,) if b == a else (a, b):  # the distinct neighbour cells in J
            num, den = num + size[j] * p[j], den + size[j]
        return num / den

    def _touched(self, c: int) -> tuple:  # the cells whose mass depends on known key c's priority, size or links
        return self._views[1][c], c, self._views[2][c]

    def _set_masses(self, cells: set) -> None:
        """Recompute the masses of these cells (0 for keys no longer known), one combined tree walk."""
        cells, (p, _, _, size) = sorted(cells), self._views
        known, offset, estimate = self.known.nodes, self.known.size, self._cell_estimate
        self.mass.set_leaves(cells, [p[c] + (size[c] - 1) * estimate(c) if known[c + offset] else 0.0 for c in cells])

    def add(self, keys) -> None:
        """Keys become valid with an unknown priority (lazy initialization): each joins the cell that holds it."""
        valid, cells, o, size = self.valid, set(), -1, self._views[3]
        keys = [k for k in sorted(set(np.asarray(keys, np.int64).ravel().tolist())) if not valid.nodes[k + valid.size]]
        valid.set_leaves(keys, [1] * len(keys))
        if self.known.nodes[1]:
            for k in keys:
                o = self._owner(k, o)
                size[o] += 1
                cells.update(self._touched(o))
        self._set_masses(cells)

    def remove(self, keys) -> None:
        """Evict keys (sequence overwritten): an unknown key leaves its cell, a known key's cell merges into the previous."""
        valid, known, cells, o = self.valid, self.known, set(), -1
        _, prev, nxt, size = self._views
        keys = [k for k in sorted(set(np.asarray(keys, np.int64).ravel().tolist())) if valid.nodes[k + valid.size]]
        valid.set_leaves(keys, [0] * len(keys))
        for k in keys:
            if self._is_known(k):
                known.add_one(k, -1)
                cells.add(k)  # (mass 0)
                a, b = prev[k], nxt[k]
                o = a if a != k else -1  # (the next owner guess: a, now that k is no longer known)
                if a != k:  # other keys remain known: unlink k, a's cell takes k's other keys
                    nxt[a], prev[b] = b, a
                    size[a] += size[k] - 1
                    cells.update(self._touched(a))
            elif known.nodes[1]:  # an unknown key: the cell holding it shrinks by one
                o = self._owner(k, o)
                size[o] -= 1
                cells.update(self._touched(o))
        self._set_masses(cells)

    def set_priority(self, keys, priorities) -> None:
        """Priorities of keys just trained on (a repeated key's last; evicted keys skipped); a new known key splits a cell."""
        valid, known, cells = self.valid, self.known, set()
        p, prev, nxt, size = self._views
        last = dict(zip(np.asarray(keys, np.int64).ravel().tolist(), np.asarray(priorities, np.float64).ravel().tolist()))
        for k in sorted(last):
            if not valid.nodes[k + valid.size]:
                continue
            p[k] = last[k]
            if self._is_known(k):
                cells.update(self._touched(k))
                continue
            if not known.nodes[1]:  # the first known key: one cell of all valid keys
                known.add_one(k, 1)
                prev[k], nxt[k], size[k] = k, k, valid.nodes[1]
                cells.add(k)
                continue
            o = self._owner(k)  # k splits o's cell: k's cell is the valid keys [k, next known key)
            b = nxt[o]
            known.add_one(k, 1)
            w = valid.count(k, b) if b > k else valid.nodes[1] - valid.count(b, k)
            size[k], size[o] = w, size[o] - w
            nxt[o], prev[k], nxt[k], prev[b] = k, o, b, k
            cells.update((prev[o], o, k, b))  # the cells around the split
        self._set_masses(cells)

    def _estimate_one(self, k: int) -> float:  # p_hat of valid key k: its priority if known, else its cell's estimate
        return self._views[0][k] if self._is_known(k) else self._cell_estimate(self._owner(k))

    def estimate(self, keys):
        """p_hat for each (valid) key (NaN while none is known)."""
        keys = np.asarray(keys, np.int64)
        if not self.num_known:
            return np.full(keys.shape, np.nan)
        return np.array([self._estimate_one(k) for k in keys.ravel().tolist()], np.float64).reshape(keys.shape)

    def sample(self, batch: int, rng: np.random.Generator):
        """Sample `batch` valid keys: (keys, probabilities P(t) = eps / n + (1 - eps) p_hat_t / sum_k p_hat_k, uniform while
        nothing is known). A draw takes 5 uniforms in [0, 1) (one `rng.random` call): the uniform key's rank, the coin
        for the uniform part (< eps), the mass point, the choice of the cell's known key, the unknown key's offset."""
        valid, mass, eps = self.valid, self.mass, self.eps
        n, total = valid.nodes[1], mass.nodes[1]
        if n == 0:
            raise ValueError("cannot sample from an empty replay")
        (p, _, _, size), keys, probs = self._views, [], []
        prioritized = self.known.nodes[1] > 0 and total > 0
        for u_rank, u_coin, u_mass, u_known, u_offset in zip(*rng.random((5, batch)).tolist()):
            if prioritized and u_coin >= eps:  # a cell by mass, then its known key or one of its w - 1 unknown keys
                c = self._owner(mass.find_one(u_mass * total))  # (a round-off landing on an empty leaf: its cell)
                w = size[c]
                if w <= 1 or u_known * mass.nodes[c + mass.size] < p[c]:
                    k, est = c, p[c]
                else:
                    k, est = valid.nth_after(c, 1 + min(int(u_offset * (w - 1)), w - 2)), self._cell_estimate(c)
            else:  # uniform
                k = valid.find_one(min(int(u_rank * n), n - 1))
                est = self._estimate_one(k) if prioritized else None
            keys.append(k)
            probs.append(eps / n + (1 - eps) * est / total if prioritized else 1.0 / n)
        return np.array(keys, np.int64), np.array(probs, np.float64)

    def state_dict(self):
        return {k: getattr(self, k).tree.copy() for k in ("valid", "known", "mass")} | {"priority": self.priority.copy()}

    def load_state_dict(self, state):
        self.valid.tree[:], self.known.tree[:], self.mass.tree[:] = state["valid"], state["known"], state["mass"]
        self.priority[:] = state["priority"]
        known = np.flatnonzero(self.known.get(np.arange(self.capacity)))  # the links and sizes, from the trees
        if len(known):
            nxt, before = np.roll(known, -1), np.r_[0, np.cumsum(self.valid.get(np.arange(self.capacity)))]
            self.prev_known[known], self.next_known[known] = np.roll(known, 1), nxt
            self.cell_size[known] = np.where(nxt > known, 0, self.num_valid) + before[nxt] - before[known]


class SequenceReplay:
    """Per-actor ring segments of slots: x_t (uint8), the LSTM state before x_t, a_t, mu(.|x_t), r_t, flags. Key t is the
    sequence of slots t .. t+T (T+1 observations), valid from the writing of slot t+T until slot t is overwritten."""

    FIELDS = ("obs", "action", "reward", "term", "pad", "first", "mu", "state")

    @staticmethod
    def slot_fields(num_actions: int, lstm_size: int, obs_shape) -> dict:
        """{field: (dtype, shape)} of one slot, in FIELDS order (the replay arrays and the actors' chunk buffers)."""
        return {
            "obs": (np.uint8, tuple(obs_shape)),
            "action": (np.uint8, ()),
            "reward": (np.float32, ()),
            "term": (np.bool_, ()),
            "pad": (np.bool_, ()),
            "first": (np.bool_, ()),
            "mu": (np.float32, (num_actions,)),
            "state": (np.float16, (4, lstm_size)),
        }

    def __init__(
        self,
        capacity: int,
        num_segments: int,
        seq_len: int,
        num_actions: int,
        lstm_size: int,
        obs_shape: tuple,
        uniform_eps: float = 0.1,
        prioritized: bool = True,
    ):
        self.seg_cap = capacity // num_segments
        self.capacity = self.seg_cap * num_segments  # (whole segments)
        self.num_segments, self.seq_len, self.prioritized = num_segments, seq_len, prioritized
        for name, (dtype, shape) in self.slot_fields(num_actions, lstm_size, obs_shape).items():
            setattr(self, name, np.zeros((self.capacity, *shape), dtype))
        self.written = np.zeros(num_segments, np.int64)  # slots ever written per segment
        self.index = LazyPriorities(self.capacity, uniform_eps if prioritized else 1.0)

    @classmethod
    def bytes_needed(cls, capacity: int, num_actions: int, lstm_size: int, obs_shape: tuple) -> int:
        """The slot arrays, plus per key 3 sum trees (2 * 2^ceil(log2) 8-byte nodes) and LazyPriorities' 4 8-byte arrays."""
        fields = cls.slot_fields(num_actions, lstm_size, obs_shape).values()
        return capacity * (sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in fields) + 3 * 2 * 8 * 2 + 4 * 8)

    def __len__(self):
        return self.index.num_valid

    def add(self, segment: int, chunk: dict) -> None:
        """Append a chunk of slots to one segment: evict the keys being overwritten, write, add the new keys."""
        m = len(chunk["action"])
        assert m <= self.seg_cap - self.seq_len - 1, "chunk too large for the segment"
        abs_t = self.written[segment] + np.arange(m)
        slots = segment * self.seg_cap + abs_t % self.seg_cap
        self.index.remove(slots[abs_t >= self.seg_cap])  # key of an overwritten slot
        for name in self.FIELDS:
            getattr(self, name)[slots] = chunk[name]
        self.written[segment] += m
        new = abs_t[abs_t >= self.seq_len] - self.seq_len  # sequence t .. t+T now complete
        self.index.add(segment * self.seg_cap + new % self.seg_cap)

    def sample(self, batch: int, rng: np.random.Generator, device):
        keys, probs = self.index.sample(batch, rng)
        seg, local = keys // self.seg_cap, keys % self.seg_cap
        slots = seg[:, None] * self.seg_cap + (local[:, None] + np.arange(self.seq_len + 1)) % self.seg_cap
        weights = 1.0 / (len(self) * probs)  # PER Eq. (2) with exponent beta = 1 (3.3)

        def t(x, dtype=None):
            return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)

        st = self.state[keys].astype(np.float32)
        return keys, Batch(
            t(self.obs[slots]),
            t(self.action[slots], torch.int64),
            t(self.reward[slots]),
            t(self.term[slots]),
            t(self.pad[slots]),
            t(self.first[slots]),
            t(self.mu[slots]),
            tuple(t(st[:, i]) for i in range(4)),
            t(weights / weights.max(), torch.float32),
        )

    def cut_at_heads(self) -> None:
        """Resume: each segment's last written slot becomes a pad (as after a truncation): no sequence crosses episodes."""
        seg = np.flatnonzero(self.written > 0)
        self.pad[seg * self.seg_cap + (self.written[seg] - 1) % self.seg_cap] = True

    def update_priorities(self, keys, priorities, exponent: float = 1.0) -> None:
        if self.prioritized:
            self.index.set_priority(keys, (np.asarray(priorities, np.float64) + 1e-6) ** exponent)

    def state_dict(self):
        return {**{name: getattr(self, name) for name in (*self.FIELDS, "written")}, "index": self.index.state_dict()}

    def load_state_dict(self, d):
        for name in (*self.FIELDS, "written"):
            getattr(self, name)[:] = d[name]
        self.index.load_state_dict(d["index"])


# ACTOR PROCESS (module-level so spawn can pickle it)
@torch.no_grad()
def act(net, obs, state, rng: np.random.Generator, device="cpu"):
    """One step of the policy: (action sampled from pi, pi(.|x) as float64, the network's output)."""
    out = net(torch.from_numpy(obs)[None, None].to(device), torch.zeros(1, 1, dtype=torch.bool, device=device), state)
    mu = out.pi[0, 0].cpu().numpy().astype(np.float64)
    mu /= mu.sum()
    return int(rng.choice(len(mu), p=mu)), mu, out


def make_channel(ctx, args: Args, num_actions: int, obs_shape) -> ChunkChannel:
    """Actor -> learner slots (SequenceReplay's fields) in chunks of actor_chunk + 1 rows (room for a pad slot)."""
    fields = SequenceReplay.slot_fields(num_actions, args.lstm_size, obs_shape)
    return ChunkChannel(ctx, args.num_actors, args.actor_chunk + 1, fields)


def actor_loop(
    actor_id, args, run_name, shared_net, weights_version, actor_steps, learner_steps, ratio_base, channel, stop_event
):
    """Act with the shared weights (CPU, one thread), send slots to the learner in chunks; wait while ahead of the ratio."""
    torch.set_num_threads(1)
    seed = args.seed + 1000 * actor_id
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    video = f"videos/{run_name}" if args.capture_video and actor_id == 0 else None
    env = make_env(args.env_id, seed, args, video_folder=video)
    num_actions = env.action_space.n
    net = make_network(args, num_actions, env.observation_space.shape)
    obs, _ = env.reset(seed=seed)
    state, first, version = net.initial_state(1), True, -1
    steps = actor_steps[actor_id]  # actor 0 starts from the resumed global step
    while not stop_event.is_set():
        ahead = sum(actor_steps[:]) - ratio_base[0]  # enforce the acting:learning ratio (actors wait for the learner)
        if ahead >= 0 and ahead > args.replay_ratio * (learner_steps.value - ratio_base[1]) + args.ratio_slack:
            channel.send(actor_id)
            time.sleep(0.002)
            continue
        if not channel.reserve(actor_id):  # a free chunk buffer (the learner gives them back)
            continue
        if steps % args.actor_sync_every == 0 and weights_version.value != version:
            version = weights_version.value
            net.load_state_dict(shared_net.state_dict())
        action, mu, out = act(net, obs, state, rng)
        st = torch.cat(state, 0).numpy().astype(np.float16)  # state before x_t, [4, H]
        next_obs, reward, terminated, truncated, info = env.step(action)
        rows = channel.write(actor_id, obs, action, float(reward), bool(terminated), False, first, mu.astype(np.float32), st)
        actor_steps[actor_id] = steps = steps + 1
        if "episode" in info:
            channel.post("episode", float(info["episode"]["r"]), int(info["episode"]["l"]))
        if terminated or truncated:
            if truncated and not terminated:  # the true last frame, to bootstrap from (no transition leaves it)
                rows = channel.write(
                    actor_id,
                    next_obs,
                    0,
                    0.0,
                    False,
                    True,
                    False,
                    np.full(num_actions, 1.0 / num_actions, np.float32),
                    torch.cat(out.state, 0).numpy().astype(np.float16),
                )
            obs, _ = env.reset()
            state, first = net.initial_state(1), True
        else:
            obs, state, first = next_obs, out.state, False
        if rows >= args.actor_chunk:
            channel.send(actor_id)
    channel.send(actor_id)
    env.close()


# LEARNER STEPS (the loop in __main__ calls them)
def learner_may_learn(global_step: int, learn_steps: int, num_sequences: int, ratio_base: tuple, args: Args) -> bool:
    """The learner's side of the acting:learning ratio (3.4): learning steps <= (env steps - learning_starts) / replay_ratio,
    both counted from ratio_base = (env step, learning step); and at least a batch of sequences in the replay."""
    return (
        global_step >= ratio_base[0]
        and num_sequences >= args.batch_size
        and learn_steps - ratio_base[1] < (global_step - ratio_base[0]) / args.replay_ratio
    )


def learning_step(net, target_net, optimizer, replay: SequenceReplay, support, args: Args, rng, device) -> dict:
    """One learning step: a prioritized batch, the Reactor loss, Adam, the batch's new priorities into the replay (3.3).
    Returns the step's stats (0-d tensors on the device), the loss and the mean IS weight among them."""
    keys, batch = replay.sample(args.batch_size, rng, device)
    loss, priorities, stats = reactor_loss(net, target_net, batch, support, args)
    optimizer.zero_grad()
    loss.backward()
    if args.max_grad_norm > 0:
        nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)
    optimizer.step()
    replay.update_priorities(keys, priorities.cpu().numpy(), args.priority_exponent)
    return stats | {"losses/loss": loss.detach(), "replay/is_weight_mean": batch.weights.mean()}


def publish_weights(net, target_net, shared_net, weights_version, learner_steps, learn_steps: int, args: Args) -> None:
    """After learning step number `learn_steps`: the weights to the actors (shared tensors, then the version the actors
    check and the count their ratio gate reads), and every target_update_period steps to the target network (4.1)."""
    shared_net.load_state_dict(net.state_dict())  # (copies into the shared tensors)
    weights_version.value = learner_steps.value = learn_steps
    if learn_steps % args.target_update_period == 0:
        target_net.load_state_dict(net.state_dict())


def evaluate(net, args: Args, episodes: int, device, seed: int, greedy: bool = False):
    """Whole games, up to noop_max no-op starts, actions from pi (or argmax pi), real scores; a lost life resets the state."""
    env = make_env(args.env_id, seed, args, evaluation=True)
    rng, returns = np.random.default_rng(seed), []
    for ep in range(episodes):
        # a stop signal ends the evaluation between games
        check_stop()
        obs, info = env.reset(seed=seed + ep)
        state, lives = net.initial_state(1, device), info.get("lives")
        while True:
            action, mu, out = act(net, obs, state, rng, device)
            obs, _, terminated, truncated, info = env.step(int(mu.argmax()) if greedy else action)
            lost_life = lives is not None and info.get("lives", lives) < lives
            state, lives = net.initial_state(1, device) if lost_life else out.state, info.get("lives", lives)
            if "episode" in info:
                returns.append(float(info["episode"]["r"]))
            if terminated or truncated:
                break
    env.close()
    return returns


if __name__ == "__main__":
    stop_on_signals()  # SIGINT (even inherited-ignored) and SIGTERM: stop every process, write summary.json
    # tyro (--help grouped: common / environment / method); --resume: the checkpoint's flags, given flags override
    args, ckpt, overridden = parse_run_args(Args, "reactor.py", FIXED_ON_RESUME)
    validate_args(args)  # only the checks between flags; all before anything heavy and before RunLogger
    if ckpt:  # the budget must reach beyond the checkpoint, and beyond the refill of a replay not saved with it
        learns_from = ckpt["global_step"] + (args.learning_starts if ckpt["replay"] is None else 0)
        if args.total_timesteps <= learns_from:
            raise SystemExit(
                f"error: --resume: the checkpoint is at step {ckpt['global_step']:,}"
                + (f" and has no replay ({args.learning_starts:,} steps refill it)" if ckpt["replay"] is None else "")
                + f": give --total-timesteps > {learns_from:,}"
            )
    probe = make_env(args.env_id, args.seed, args)  # (Atari and MinAtar: discrete actions)
    num_actions, obs_shape = int(probe.action_space.n), probe.observation_space.shape
    probe.close()
    check_memory(
        SequenceReplay.bytes_needed(args.replay_size, num_actions, args.lstm_size, obs_shape),  # (prints it)
        "--replay-size",
        args.memory_fraction,
    )  # refuses a replay that does not fit in RAM, in one line
    logger = start_run(args, ckpt, args.env_id)  # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    set_learner_threads(args.num_actors)  # the cores the actors leave free
    rng = np.random.default_rng(args.seed)

    # SETUP: network, target network, optimizer, replay, shared weights, actors
    net, target_net, optimizer = make_learner(args, num_actions, obs_shape, device)
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms, device=device)
    replay = SequenceReplay(
        args.replay_size,
        args.num_actors,
        args.sequence_length,
        num_actions,
        args.lstm_size,
        obs_shape,
        args.replay_uniform_eps,
        args.prioritized,
    )
    global_step, learn_steps, episodes_done = 0, 0, 0
    ratio_base = (args.learning_starts, 0)  # the acting:learning ratio counts from (env step, learning step)
    if ckpt:  # restore, then one line
        load_state_dicts(
            ckpt, model=net, target_model=target_net, optimizer=optimizer, replay=None if ckpt["replay"] is None else replay
        )
        global_step, learn_steps, episodes_done = ckpt["global_step"], ckpt["learn_steps"], ckpt["episodes"]
        if ckpt["replay"] is not None:
            replay.cut_at_heads()  # the actors start new episodes: no bootstrap across the checkpoint
            what = f"replay ({len(replay):,} sequences, {replay.index.num_known:,} with a priority)"
        else:  # the first learning_starts steps refill the replay; the ratio counts from there
            ratio_base = (learns_from, learn_steps)
            what = (
                f"no replay (saved without --checkpoint-replay): the first {args.learning_starts:,} steps refill "
                f"it, the acting:learning ratio counts from step {learns_from:,}"
            )
        set_rng_state(ckpt["rng"])
        rng = ckpt["np_rng"]
        print(
            f"resumed {args.resume} at step {global_step:,}: model, target network, optimizer ({learn_steps:,} "
            f"learning steps), RNG, {what}; flags from this command line: {', '.join(overridden) or 'none'}; "
            f"runs to step {args.total_timesteps:,}",
            flush=True,
        )
    shared_net = make_network(args, num_actions, obs_shape).share_memory()
    shared_net.load_state_dict(net.state_dict())  # (copies into the shared tensors)
    ctx = torch.multiprocessing.get_context(args.start_method)
    # unlocked counters, one writer each (a killed actor leaves no lock held); actor 0 counts from the resumed step
    weights_version, learner_steps = ctx.Value("l", 0, lock=False), ctx.Value("l", learn_steps, lock=False)
    actor_steps = ctx.Array("l", [global_step] + [0] * (args.num_actors - 1), lock=False)
    channel = make_channel(ctx, args, num_actions, obs_shape)  # slot chunks in shared memory, episode scores
    procs = ProcessGroup(ctx)
    start_time, start_step, last_log_step = time.time(), global_step, learn_steps
    next_checkpoint = (global_step // args.checkpoint_every + 1) * args.checkpoint_every if args.checkpoint_every else None
    stats_acc, learn_time, recent_returns = {}, 0.0, deque(maxlen=100)

    def make_checkpoint():
        save_checkpoint(
            logger.dir / "checkpoint.pt",
            {
                "script": "reactor.py",
                "args": vars(args),
                "run_name": logger.run_name,
                "global_step": global_step,
                "learn_steps": learn_steps,
                "episodes": episodes_done,
                "rng": rng_state(),
                "np_rng": rng,
                **state_dicts(
                    model=net, target_model=target_net, optimizer=optimizer, replay=replay if args.checkpoint_replay else None
                ),
            },
        )

    error, can_learn = None, False
    try:
        for i in range(args.num_actors):
            procs.start(
                actor_loop,
                (
                    i,
                    args,
                    logger.run_name,
                    shared_net,
                    weights_version,
                    actor_steps,
                    learner_steps,
                    ratio_base,
                    channel,
                    procs.stop_event,
                ),
                name=f"actor-{i}",
            )
        while global_step < args.total_timesteps:
            # COLLECT: drain what the actors sent (at most 4 messages per actor, then learn)
            for got in range(4 * args.num_actors):
                try:
                    msg = channel.get(timeout=0.05 if got == 0 and not can_learn else None)
                except queue.Empty:
                    break
                if msg[0] == "chunk":
                    actor_id, chunk = channel.read(msg)
                    replay.add(actor_id, chunk)  # (copies)
                    global_step += int((~chunk["pad"]).sum())  # a pad slot is no env step
                    channel.release(msg)
                else:
                    _, ep_return, ep_len = msg
                    episodes_done += 1
                    recent_returns.append(ep_return)
                    logger.log(global_step, {"charts/episodic_return": ep_return, "charts/episodic_length": ep_len})
            # LEARN: enforced ratio: learning steps <= (env steps - learning_starts) / replay_ratio
            can_learn = learner_may_learn(global_step, learn_steps, len(replay), ratio_base, args)
            if can_learn:
                t0 = time.time()
                stats = learning_step(net, target_net, optimizer, replay, support, args, rng, device)
                learn_steps += 1
                publish_weights(net, target_net, shared_net, weights_version, learner_steps, learn_steps, args)
                stats_acc = {k: stats_acc.get(k, 0.0) + v.detach() for k, v in stats.items()}
                learn_time += time.time() - t0
                # LOG: the means since the last log line
                if learn_steps % args.log_every == 0:
                    n_logged, idx = learn_steps - last_log_step, replay.index
                    sps, lps = (global_step - start_step) / (time.time() - start_time), n_logged / max(learn_time, 1e-9)
                    known = idx.priority[idx.known.tree[idx.known.size :][: idx.capacity] > 0]  # the known priorities
                    # the stats summed on the device since the last log line (loss and IS weights too): one transfer
                    means = (torch.stack(list(stats_acc.values())) / n_logged).tolist()
                    metrics = dict(zip(stats_acc, means)) | {
                        "charts/SPS": sps,
                        "charts/learning_steps": learn_steps,
                        "charts/learner_steps_per_s": lps,
                        "charts/acting_learning_ratio": (global_step - ratio_base[0]) / max(learn_steps - ratio_base[1], 1),
                        "replay/size": len(replay),
                        "replay/known_fraction": idx.num_known / max(len(replay), 1),
                        "replay/priority_mean": float(known.mean()) if known.size else 0.0,
                        "replay/priority_max": float(known.max()) if known.size else 0.0,
                    }
                    logger.log(global_step, metrics)
                    logger.progress(
                        global_step,
                        sps,
                        np.mean(recent_returns) if recent_returns else None,
                        "value_loss",
                        float(metrics["losses/value_loss"]),
                        f"learn {learn_steps:,} ({lps:.1f}/s) rho {float(metrics['replay/rho_mean']):.2f}",
                    )
                    stats_acc, learn_time, last_log_step = {}, 0.0, learn_steps
            # CHECKPOINT
            if next_checkpoint is not None and global_step >= next_checkpoint:
                make_checkpoint()
                next_checkpoint += args.checkpoint_every
            procs.check()  # a dead actor stops the run with its reason
    except (KeyboardInterrupt, StopRun) as e:
        error = e
    finally:
        procs.stop()
    logger.log(
        global_step,
        {"charts/SPS": (global_step - start_step) / (time.time() - start_time), "charts/learning_steps": learn_steps},
    )  # the last record is at the last step
    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    if args.checkpoint_every and error is None:
        make_checkpoint()

    def save_model():
        torch.save({"model": net.state_dict(), "args": vars(args)}, path := logger.dir / f"{args.exp_name}.model")
        return path

    def final_eval() -> dict:
        returns = evaluate(net, args, args.eval_episodes, device, args.seed + 10_000)
        for r in returns:
            logger.log(global_step, {"eval/episodic_return": r})
        print(f"evaluation over {len(returns)} games: mean {np.mean(returns):.2f}, median {np.median(returns):.2f}")
        return {
            "eval_episodes": len(returns),
            "eval_return_mean": float(np.mean(returns)),
            "eval_return_median": float(np.median(returns)),
            "eval_returns": returns,
        }

    finish_run(
        logger,
        error,
        {
            "global_step": global_step,
            "learning_steps": learn_steps,
            "episodes": episodes_done,
            "train_return_mean_last100": float(np.mean(recent_returns)) if recent_returns else None,
        },
        save_model if args.save_model else None,
        final_eval if args.save_model and args.eval_episodes else None,
    )

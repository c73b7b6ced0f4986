# docs and results: README.md#reactorpy-reactor
"""Reactor (Gruslys, Dabney, Azar, Piot, Bellemare, Munos 2018, https://arxiv.org/abs/1704.04651), one file.

Actor processes stream transitions to a learner that trains a recurrent categorical Q head with distributional
Retrace and a policy head with beta-LOO, from prioritized replay of 33-observation sequences.

Symbols: x_t observation, a_t action, r_t reward, gamma discount, pi policy, mu behaviour policy, rho = pi / mu, traces
c = lambda min(1, rho), atoms z_i of probabilities q_i(x, a), Q = sum_i q_i z_i, alpha n-step backup weights, R(A) Retrace
return, p priority, p_hat its estimate. Shapes: B sequences, T transitions, L = T + 1 observations, A actions, K atoms,
H units. Steps are agent steps (Atari: 4 emulator frames each); frames are emulator frames only.

Paper parts, in file order
- Network (3.4.1): conv torso, separate policy and Q LSTMs, categorical Q = value + action logits, uniform-mixed
  policy, CReLU `ReactorNetwork`.
- C51 projection (C51 Eq. (7)) `categorical_projection`; Retrace (Eqs. (3)-(4), the scalar "ND" ablation)
  `retrace_returns`; distributional Retrace, an alpha-mixture of n-step backups, cross-entropy (3.2, Eq. (12))
  `distributional_retrace_target`, `reactor_loss`.
- beta-LOO (Eq. (10), beta = min(c, 1/mu(A))) `beta_loo_policy_loss`; TISLR ablation (3.1) `tislr_policy_loss`.
- Prioritized sequence replay, lazy initialization (3.3) `LazyPriorities`, `SequenceReplay`; priorities = mean |TD|
  (ND) or total variation (distributional) in `reactor_loss`.
- Acting:learning ratio (3.4) `learner_may_learn`, `actor_loop`; Adam, priorities back, weights to the actors and the
  target network (3.4, 4.1) `learning_step`, `publish_weights`, `__main__`; no-op starts, whole games (4.1) `evaluate`.
- The actors' chunks into the replay `store_chunk`; a resume's checks, ratio base and Adam flags, the loop's logging
  and checkpoint cadence (RUN PLUMBING) `check_resume`, `resumed_ratio_base`, `apply_optimizer_flags`, `LoopLog`,
  common/checkpoint.py's `CheckpointSchedule`. The loop's contract: tests/test_reactor_loop.py.

Defaults: 32 transitions per sequence, batch 4, acting:learning ratio 4 (3.4); target update 1000, lambda 1, beta_loo_c 1
(4.1, Fig. 3); lr 5e-5, Adam beta1 0 (3.4.1); IS exponent 1 (3.3). The appendix's tables are lost (its priority-tree text
is not): other values (C51's atoms and gamma, A3C's grad clip, ACER's tislr_c) are flags; fixed: layer sizes, Adam beta2/eps.

Differences from the paper (long form: README.md, section reactor.py)
- One machine: N actor processes and one learner with a local replay; hogwild shared weights, no parameter server.
- The appendix's Contextual Priority Tree (an AVL tree of time-ordered keys, subtree counts, mean estimates) -> three sum
  trees, prev/next links between known keys (a circular linked list), cell sizes; same estimate (size-weighted, 3.3), O(log n).
- LSTM states stored (R2D2) in float16; loss averaged over a sequence's valid steps, then IS-weighted; IS weights
  normalized by their batch maximum; R(A) in beta-LOO is the scalar Retrace return; a lost life resets the LSTM.
- Both networks unroll all 33 observations (paper: online 1-32, target 2-33); a truncation's last observation is stored,
  bootstrapped.
- MinAtar (`--env-id MinAtar/...`, CPU scale): MinAtar's torso (one 3x3 conv, 16 channels) under the paper's linear,
  LSTMs and heads; 0/1 observations not rescaled, rewards unclipped, sticky actions 0.1 (MinAtar's standard).
Copying this file: it needs common/{atari_env,minatar_env,args,logger,checkpoint,processes,video,sum_tree}.py.
"""

import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from common.processes import install_stop_handling

# Ctrl-C, SIGTERM and SIGHUP are handled from here on, during the heavy imports below too (common/processes.py)
if __name__ == "__main__":
    install_stop_handling()

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.args import CommonArgs, parse_run_args, require
from common.atari_env import ATARI_ENV_IDS, make_atari_env
from common.checkpoint import (
    CheckpointSchedule,
    load_state_dicts,
    resumed_seed,
    save_run_checkpoint,
    seed_everything,
    select_device,
    set_rng_state,
    state_dicts,
)
from common.logger import MetricAverager, start_run
from common.minatar_env import MINATAR_ENV_IDS, make_minatar_env
from common.processes import (
    ProcessGroup,
    StopRun,
    check_memory,
    check_stop,
    finish_run,
    set_learner_threads,
)
from common.sum_tree import SumTree
from common.video import check_video_support


# CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
@dataclass
class Args(CommonArgs):
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
    acting_learning_ratio: float = 4.0
    """env steps acted per learning step, enforced in both directions (paper 3.4's acting:learning ratio, 4 to 6; the
    inverse of the usual "replay ratio", updates per env step); formerly --replay-ratio"""
    ratio_slack: int = 512
    """env steps the actors may run ahead of acting_learning_ratio x (learning steps) before they wait"""
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

    def forward(self, inputs):
        # = cat([relu(inputs), relu(-inputs)]) in values and gradients, in fewer passes
        return torch.cat([inputs, inputs.neg()], dim=1).relu_()


class NetOut(NamedTuple):
    q: torch.Tensor  # [B, L, A, K] categorical logits (distributional) or [B, L, A] action values (ND)
    pi: torch.Tensor  # [B, L, A] mixed policy probabilities
    state: tuple | None  # (h_q, c_q, h_pi, c_pi) after a one-observation call (acting); None after a sequence


class EpisodePieces(NamedTuple):
    """[B, L] observations cut at episode starts into P pieces (a piece begins at position 0 and at each `first` one)."""

    index: torch.Tensor  # [P, longest] each piece's observations as flat indices b * L + t (past its end: its last one)
    sequence: torch.Tensor  # [P] the sequence b of each piece
    carries_state: torch.Tensor  # [P] the piece starts at position 0 of a sequence that does not start an episode there
    position: torch.Tensor  # [B * L] where each observation sits in the pieces' [P, longest] grid, flattened


def cut_at_episode_starts(first: torch.Tensor) -> EpisodePieces:
    """The pieces of `first` [B, L]: an LSTM state reset before observation t is the same as a new sequence starting at t."""
    batch_size, length = first.shape
    piece_starts = first.clone()
    piece_starts[:, 0] = True
    piece_starts = piece_starts.flatten()
    start_index = torch.nonzero(piece_starts).flatten()
    # each observation's piece, and its step within the piece
    piece = piece_starts.cumsum(0) - 1
    step = torch.arange(batch_size * length, device=first.device) - start_index[piece]
    longest = int(step.max()) + 1
    # a piece ends before the next one starts; the last one at the last observation
    end_index = torch.cat([start_index[1:] - 1, start_index.new_tensor([batch_size * length - 1])])
    index = torch.minimum(start_index[:, None] + torch.arange(longest, device=first.device), end_index[:, None])
    carries_state = (start_index % length == 0) & ~first.flatten()[start_index]
    return EpisodePieces(index, start_index // length, carries_state, piece * longest + step)


def unroll_lstm(lstm: nn.LSTM, inputs: torch.Tensor, state: tuple, pieces: EpisodePieces):
    """nn.LSTM over inputs [B, L, F] from state (h, c) [B, H], the state reset to zero before each episode start, in
    one fused call: the pieces run as the rows of one batch (each ends where the next episode starts, so none needs
    another's state), padded at their ends with repeats of their last observation (whose outputs are never read). The same as
    the step-by-step loop `for t: (h, c) = cell(x_t, (h, c) * (1 - first_t))` up to float rounding. Returns the outputs
    [B, L, H] and the state (h, c) after the last observation, the right one only for one-observation calls (acting): a longer
    call's last piece may end before its padding does.
    Oracle: tests/test_reactor_actors.py::test_fused_lstm_equals_step_by_step_reset."""
    batch_size, length, _ = inputs.shape
    keep = pieces.carries_state.to(inputs.dtype)[None, :, None]
    initial = tuple(part[pieces.sequence].unsqueeze(0) * keep for part in state)
    rows = inputs.reshape(batch_size * length, -1)[pieces.index]
    out, (h, c) = lstm(rows, initial)
    outputs = out.reshape(-1, out.shape[-1])[pieces.position].reshape(batch_size, length, -1)
    return outputs, (h[0], c[0])


class ReactorNetwork(nn.Module):
    """Paper 3.4.1: conv torso -> shared linear -> {Q LSTM, policy LSTM} -> heads (one observation at a time)."""

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
        self.num_actions = num_actions
        self.num_atoms = num_atoms
        self.lstm_size = lstm_size
        self.obs_shape = tuple(obs_shape)
        self.distributional = distributional
        self.policy_uniform_eps = policy_uniform_eps
        self.obs_scale = obs_scale
        activation = CReLU if crelu else nn.ReLU
        # CReLU doubles the width of each layer's output
        width = 2 if crelu else 1
        channels = obs_shape[0]
        if torso == "paper":
            # layer sizes: not recovered (unconfirmed recollection of the paper's Table 3)
            convs = [
                nn.Conv2d(channels, 16, 8, stride=4),
                activation(),
                nn.Conv2d(16 * width, 32, 4, stride=2),
                activation(),
                nn.Conv2d(32 * width, 32, 3, stride=1),
                activation(),
                nn.Flatten(),
            ]
        else:
            # MinAtar's network (Young & Tian 2019): one 3x3 conv with 16 channels
            convs = [nn.Conv2d(channels, 16, 3, stride=1), activation(), nn.Flatten()]
        with torch.no_grad():
            conv_output_size = nn.Sequential(*convs)(torch.zeros(1, *self.obs_shape)).shape[1]
        self.torso = nn.Sequential(*convs, nn.Linear(conv_output_size, 128), activation())
        # nn.LSTM runs a whole sequence in one fused call (cuDNN on a GPU)
        self.q_lstm = nn.LSTM(128 * width, lstm_size, batch_first=True)
        self.pi_lstm = nn.LSTM(128 * width, lstm_size, batch_first=True)
        self.q_hidden = nn.Sequential(nn.Linear(lstm_size, 32), activation())
        self.pi_hidden = nn.Sequential(nn.Linear(lstm_size, 32), activation())
        logits_per_action = num_atoms if distributional else 1
        self.value_logits = nn.Linear(32 * width, logits_per_action)
        self.action_logits = nn.Linear(32 * width, num_actions * logits_per_action)
        self.pi_logits = nn.Linear(32 * width, num_actions)

    def initial_state(self, batch: int, device=None):
        """The zero state (h_q, c_q, h_pi, c_pi), each [batch, H]."""
        return tuple(torch.zeros(batch, self.lstm_size, device=device) for _ in range(4))

    def forward(self, obs: torch.Tensor, first: torch.Tensor, state: tuple, policy: bool = True) -> NetOut:
        """obs [B, L, channels, height, width] uint8, first [B, L] (episode starts: LSTM state reset before that observation),
        state: 4 x [B, H] before observation 0. Both LSTMs run all pieces between episode starts in one call (`unroll_lstm`).
        policy=False (the target network, whose policy is never used) skips the policy LSTM and head: pi and its state are
        None."""
        batch_size, length = obs.shape[:2]
        frames = obs.reshape(batch_size * length, *self.obs_shape).float() / self.obs_scale
        features = self.torso(frames).reshape(batch_size, length, -1)
        h_q, c_q, h_pi, c_pi = state
        pieces = cut_at_episode_starts(first)
        q_lstm_out, q_state = unroll_lstm(self.q_lstm, features, (h_q, c_q), pieces)
        if policy:
            # gradient blocking (3.4.1): only the Q LSTM back-propagates into the shared torso
            pi_lstm_out, pi_state = unroll_lstm(self.pi_lstm, features.detach(), (h_pi, c_pi), pieces)
        q_hidden = self.q_hidden(q_lstm_out.reshape(batch_size * length, -1))
        # "Final action-value logits are produced by summing state- and action-specific logits" (no mean subtraction)
        action_logits = self.action_logits(q_hidden).view(batch_size * length, self.num_actions, -1)
        q = self.value_logits(q_hidden).unsqueeze(1) + action_logits
        q = q.view(batch_size, length, *q.shape[1:]) if self.distributional else q.view(batch_size, length, self.num_actions)
        # the state after a one-observation call (acting); the learner's sequences start from stored states and return none
        next_state = None
        if not policy:
            if length == 1:
                next_state = (*q_state, None, None)
            return NetOut(q, None, next_state)
        pi_hidden = self.pi_hidden(pi_lstm_out.reshape(batch_size * length, -1))
        # policy: softmax mixed with a fixed uniform distribution (3.4.1)
        eps = self.policy_uniform_eps
        pi = (1 - eps) * F.softmax(self.pi_logits(pi_hidden), -1) + eps / self.num_actions
        if length == 1:
            next_state = (*q_state, *pi_state)
        return NetOut(q, pi.view(batch_size, length, self.num_actions), next_state)


def make_network(args: Args, num_actions: int, obs_shape) -> ReactorNetwork:
    """The network for this env family: the paper's torso on Atari (pixels / 255), MinAtar's on MinAtar (0/1 planes)."""
    minatar = args.env_id in MINATAR_ENV_IDS
    torso = args.torso
    if torso == "auto":
        torso = "minatar" if minatar else "paper"
    return ReactorNetwork(
        num_actions,
        obs_shape,
        num_atoms=args.num_atoms,
        lstm_size=args.lstm_size,
        crelu=args.crelu,
        distributional=args.distributional,
        policy_uniform_eps=args.policy_uniform_eps,
        torso=torso,
        obs_scale=1.0 if minatar else 255.0,
    )


def make_learner(args: Args, num_actions: int, obs_shape, device):
    """The network, its target copy and Adam (3.4.1, fused: the same up to rounding)."""
    net = make_network(args, num_actions, obs_shape).to(device)
    target_net = make_network(args, num_actions, obs_shape).to(device)
    target_net.load_state_dict(net.state_dict())
    # Adam's beta2 and eps: torch's defaults (not in the recovered paper)
    optimizer = torch.optim.Adam(net.parameters(), args.learning_rate, (args.adam_beta1, 0.999), fused=True)
    return net, target_net, optimizer


# ALGORITHM PIECES: small pure functions, each with the paper's equation numbers in comments
def at_actions(values: torch.Tensor, actions: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The values of the actions taken (a gather): values [..., A] -> [...] (dim -1), or [..., A, K] -> [..., K] (dim -2)."""
    index = actions.long().unsqueeze(-1)
    if dim != -1:
        index = index.unsqueeze(-1)
    return torch.take_along_dim(values, index, dim).squeeze(dim)


def categorical_projection(atoms: torch.Tensor, probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Project sum_j probs_j delta_{atoms_j} onto the fixed grid `support` (C51 Eq. (7), the kernel h_{z_i} of 3.2):
    out_i = sum_j probs_j * h_{z_i}(atoms_j), h_{z_i}(x) = clip(1 - |clip(x, v_min, v_max) - z_i| / dz, 0, 1). atoms,
    probs: [..., M] (broadcastable), support: [K] evenly spaced -> [..., K]; linear in probs (signed alpha is fine), O(M).
    Oracle: tests/test_reactor_targets.py::test_projection_matches_textbook_signed_weights_and_outside_atoms."""
    atoms, probs = torch.broadcast_tensors(atoms, probs)
    num_atoms = support.shape[0]
    v_min = float(support[0])
    v_max = float(support[-1])
    # each atom's position on the grid (b_j in C51), atoms outside [v_min, v_max] clipped to its ends
    position = ((atoms - v_min) / ((v_max - v_min) / (num_atoms - 1))).clamp_(0, num_atoms - 1)
    lower = position.floor()
    # the upper neighbour's share: 0 for an atom on a grid point
    upper_weight = probs * position.sub_(lower)
    lower = lower.long()
    out = probs.new_zeros(*probs.shape[:-1], num_atoms).scatter_add_(-1, lower, probs - upper_weight)
    return out.scatter_add_(-1, (lower + 1).clamp_(max=num_atoms - 1), upper_weight)


def _cut_at_sequence_end(c_next: torch.Tensor) -> torch.Tensor:
    """c_{t+1} with the last one set to 0: nothing is known after the sequence's last observation, so its trace is cut."""
    return torch.cat([c_next[:, :-1], torch.zeros_like(c_next[:, -1:])], 1)


def retrace_returns(rewards, discounts, c_next, v_next, q_next_a):
    """Scalar Retrace target Q^ret(x_t, a_t) (Eqs. (3)-(4)) for every t of a sequence of T transitions, by the backward
    recursion over t
        Q^ret_t = r_t + gamma_t [E_pi Q(x_{t+1}, .) + c_{t+1} (Q^ret_{t+1} - Q(x_{t+1}, a_{t+1}))]
    (= Q(x_t, a_t) + sum_{s>=t} gamma^{s-t} (c_{t+1}...c_s) delta_s). All [B, T]: rewards r_t, discounts gamma_t (0 after
    a termination), c_next = c_{t+1} (the last one taken as 0: the sequence end cuts the trace), v_next =
    E_pi Q(x_{t+1}, .), q_next_a = Q(x_{t+1}, a_{t+1}).
    Oracle: tests/test_reactor_targets.py::test_scalar_retrace_matches_textbook."""
    c = _cut_at_sequence_end(c_next)
    # Q^ret_{t+1} after the last transition: multiplied by the cut trace c = 0
    next_return = torch.zeros_like(rewards[:, 0])
    returns = []
    for t in reversed(range(rewards.shape[1])):
        next_return = rewards[:, t] + discounts[:, t] * (v_next[:, t] + c[:, t] * (next_return - q_next_a[:, t]))
        returns.append(next_return)
    return torch.stack(returns[::-1], 1)


def distributional_retrace_target(rewards, discounts, c_next, pi_next, q_next, a_next, support):
    """Distributional Retrace target q*_i(x_t, a_t) for every t of a sequence (paper 3.2):
        q*_i(x_t,a_t) = sum_{n>=1} sum_a alpha_{n,a} sum_j q_j(x_{t+n}, a) h_{z_i}(z^n_j),
        alpha_{n,a} = (c_{t+1}...c_{t+n-1}) (pi(a|x_{t+n}) - 1{a = a_{t+n}} c_{t+n}),
        z^n_j = sum_{s=t}^{t+n-1} gamma^{s-t} r_s + gamma^n z_j.
    The n-step backups of t are those of t+1 one step further back, plus the 1-step backup: before the projection, by a
    backward recursion over t on atoms and weights,
        Z_t = r_t + gamma_t [Y_{t+1} + c_{t+1} Z_{t+1}],   Y_s = sum_a (pi(a|x_s) - 1{a = a_s} c_s) q(x_s, a),
    each Z_t projected once, as in the sum (shifting a projected Z_{t+1} would project twice). rewards, discounts
    (gamma_t, 0 after termination), c_next (c_{t+1}), a_next (a_{t+1}): [B, T]; pi_next: [B, T, A]; q_next
    (target-network probabilities): [B, T, A, K]; support z: [K]. The sequence end cuts the trace (c_{t+T} := 0):
    sum alpha = 1, total mass 1 (entries may be negative, not in expectation). Returns [B, T, K].
    Oracle: tests/test_reactor_targets.py::test_distributional_retrace_matches_textbook_mass_one_and_mean."""
    batch_size, num_steps, _, num_atoms = q_next.shape
    c = _cut_at_sequence_end(c_next)
    # Y_{t+1} = E_pi q(x_{t+1}) - c_{t+1} q(x_{t+1}, a_{t+1}), the 1-step backup's signed weights   [B, T, K]
    y = (pi_next.unsqueeze(-1) * q_next).sum(2) - c.unsqueeze(-1) * at_actions(q_next, a_next, dim=-2)
    # Z_{t+1} after the last transition: empty (its trace is cut)
    atoms = rewards.new_zeros(batch_size, 0)
    weights = rewards.new_zeros(batch_size, 0)
    grid = support.expand(batch_size, num_atoms)
    targets = []
    for t in reversed(range(num_steps)):
        # z^n_j of t: r_t + gamma_t (the 1-step atoms z_j, then the atoms of t+1)               [B, (T - t) K]
        atoms = rewards[:, t, None] + discounts[:, t, None] * torch.cat([grid, atoms], 1)
        weights = torch.cat([y[:, t], c[:, t, None] * weights], 1)
        targets.append(categorical_projection(atoms, weights, support))
    return torch.stack(targets[::-1], 1)


def beta_loo_policy_loss(pi, q, actions, returns, mu_a, c: float = 1.0):
    """Negative beta-LOO surrogate (Eq. (10)): its gradient is -[beta (R(A) - Q(A)) grad pi(A) + sum_a Q(a) grad pi(a)],
    beta = min(c, 1/mu(A)) (3.1; c = 1: the paper's beta = 1). Only pi [..., A] has a gradient: q, R(A), mu(A) constants.
    Oracle: tests/test_reactor_targets.py::test_beta_loo_gradient_equals_hand_derived_form."""
    beta = torch.clamp(1.0 / mu_a, max=c)
    q = q.detach()
    return -(beta * (returns - at_actions(q, actions)).detach() * at_actions(pi, actions) + (q * pi).sum(-1))


def tislr_policy_loss(pi, q, actions, returns, mu, c: float = 10.0):
    """Negative TISLR surrogate (ACER; paper 3.1), beta-LOO's ablation: min(c, rho(A)) (R(A) - V) grad log pi(A) +
    sum_a (rho(a) - c)_+ mu(a) (Q(a) - V) grad log pi(a), V = sum_a pi Q; only pi has a gradient; mu: [..., A], all of it.
    Oracle: tests/test_reactor_targets.py::test_beta_loo_with_c1_is_loo_and_tislr_gradient (TISLR's gradient by hand)."""
    q = q.detach()
    pi_const = pi.detach()
    log_pi = torch.log(pi)
    rho = pi_const / mu
    v = (pi_const * q).sum(-1)
    truncated_term = torch.clamp(at_actions(rho, actions), max=c) * (returns - v).detach() * at_actions(log_pi, actions)
    bias_correction = (F.relu(rho - c) * mu * (q - v.unsqueeze(-1)) * log_pi).sum(-1)
    return -(truncated_term + bias_correction)


def discounts_and_traces(rho, term, pad, first, gamma: float, lam: float):
    """Discounts gamma_t, traces c_{t+1} (c_s = lambda min(1, rho_s), Eq. (4)) and loss mask from T+1 slots ([B, T+1]).
    An episode end cuts them: a termination at t gives gamma_t = 0, c_{t+1} = 0; a time-limit truncation at t is followed
    by a pad slot holding the true last observation: gamma_t stays (bootstrap from it), c_{t+1} = 0, and the pad slot carries
    no transition (mask 0, gamma 0). Returns (discounts [B, T], c_next [B, T], mask [B, T]).
    Oracle: tests/test_reactor_targets.py::test_trace_cutting_at_episode_end_and_bootstrap_on_truncation."""
    term = term.to(rho.dtype)
    pad = pad.to(rho.dtype)
    first = first.to(rho.dtype)
    mask = 1.0 - pad[:, :-1]
    discounts = gamma * (1.0 - term[:, :-1]) * mask
    # Eq. (4)
    c_next = lam * torch.clamp(rho[:, 1:], max=1.0) * (1.0 - first[:, 1:]) * (1.0 - pad[:, 1:]) * mask
    return discounts, c_next, mask


class Batch(NamedTuple):
    obs: torch.Tensor  # [B, T+1, channels, height, width] uint8
    actions: torch.Tensor  # [B, T+1]
    rewards: torch.Tensor  # [B, T+1] (r of the transition leaving each slot)
    term: torch.Tensor  # [B, T+1] transition from this slot terminated
    pad: torch.Tensor  # [B, T+1] slot is the last observation of a truncated episode (no transition from it)
    first: torch.Tensor  # [B, T+1] slot is the first observation of an episode
    mu: torch.Tensor  # [B, T+1, A] behaviour policy at acting time (with the uniform mix)
    state: tuple  # 4 x [B, H] LSTM state before slot 0
    weights: torch.Tensor  # [B] importance-sampling weights


def reactor_loss(net, target_net, batch: Batch, support, args: Args):
    """One Reactor loss on a batch of sequences. Returns (loss, per-sequence priorities, stats dict of tensors).
    Oracle: tests/test_reactor_targets.py::test_reactor_loss_end_to_end_equals_a_slow_loop_of_the_paper."""
    out = net(batch.obs, batch.first, batch.state)
    with torch.no_grad():
        # (the target network's policy is never used)
        target_out = target_net(batch.obs, batch.first, batch.state, policy=False)
    num_steps = batch.obs.shape[1] - 1
    pi = out.pi  # [B, T+1, A]
    actions = batch.actions.long()
    pi_const = pi.detach()
    mu_a = at_actions(batch.mu, actions)
    rho = at_actions(pi_const, actions) / mu_a
    discounts, c_next, mask = discounts_and_traces(rho, batch.term, batch.pad, batch.first, args.gamma, args.retrace_lambda)
    rewards = batch.rewards[:, :num_steps].float()
    if args.distributional:
        log_q = F.log_softmax(out.q, -1)  # [B, T+1, A, K]
        # Eq. (5): Q = sum_i q_i z_i
        q_online = (log_q.exp() * support).sum(-1).detach()
        q_next = F.softmax(target_out.q[:, 1:], -1)
        q_mean_next = (q_next * support).sum(-1)
    else:
        q_online = out.q.detach()
        q_mean_next = target_out.q[:, 1:]
    v_next = (pi_const[:, 1:] * q_mean_next).sum(-1)
    q_next_a = at_actions(q_mean_next, actions[:, 1:])
    # R(A), Eq. (3)
    returns = retrace_returns(rewards, discounts, c_next, v_next, q_next_a)
    taken = actions[:, :num_steps]
    if args.distributional:
        target = distributional_retrace_target(rewards, discounts, c_next, pi_const[:, 1:], q_next, actions[:, 1:], support)
        log_q_a = at_actions(log_q[:, :num_steps], taken, dim=-2)
        # Eq. (12): cross-entropy with the (signed) target
        value_loss = -(target * log_q_a).sum(-1)
        # total variation (3.3)
        td_size = 0.5 * (target - log_q_a.exp()).abs().sum(-1)
    else:
        q_taken = at_actions(out.q[:, :num_steps], taken)
        value_loss = 0.5 * (returns - q_taken) ** 2
        # |TD| along the sequence (3.3)
        td_size = (returns - q_taken).abs().detach()
    pi_steps = pi[:, :num_steps]
    q_steps = q_online[:, :num_steps]
    if args.policy_gradient == "beta-loo":
        policy_loss = beta_loo_policy_loss(pi_steps, q_steps, taken, returns, mu_a[:, :num_steps], args.beta_loo_c)
    else:
        policy_loss = tislr_policy_loss(pi_steps, q_steps, taken, returns, batch.mu[:, :num_steps], args.tislr_c)
    entropy = -(pi_steps * torch.log(pi_steps)).sum(-1)
    per_step = value_loss + policy_loss - args.entropy_coef * entropy
    valid_steps = mask.sum(1).clamp(min=1.0)
    # IS-weighted mean over the valid steps
    loss = (batch.weights * (per_step * mask).sum(1) / valid_steps).mean()
    # mean |TD| (ND) or mean total variation
    priorities = (td_size.detach() * mask).sum(1) / valid_steps
    stats = {
        "losses/value_loss": value_loss,
        "losses/policy_loss": policy_loss,
        "losses/entropy": entropy,
        "losses/q_values": at_actions(q_online, actions)[:, :num_steps],
        "losses/retrace_return": returns,
        "replay/rho_mean": rho[:, :num_steps],
        "replay/trace_mean": c_next,
        # traces below 0.99 (episode ends too)
        "replay/trace_cut_fraction": (c_next < 0.99).float(),
    }
    # means over the valid steps
    all_valid_steps = mask.sum().clamp(min=1.0)
    return loss, priorities, {name: (x.detach() * mask).sum() / all_valid_steps for name, x in stats.items()}


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
    known keys make an estimate O(1); a change at a key alters at most 4 cells' masses (`_touched`).
    Oracle: tests/test_reactor_replay.py::test_lazy_priority_estimates_equal_brute_force,
    tests/test_reactor_replay.py::test_lazy_priority_sampling_frequencies_chi_square,
    tests/test_reactor_replay.py::test_lazy_priorities_random_operations_equal_slow_reference."""

    def __init__(self, capacity: int, uniform_eps: float = 0.1):
        self.capacity = capacity
        self.eps = uniform_eps
        # 0/1 flags: the valid keys, the known keys
        self.valid = SumTree(capacity, np.int64)
        self.known = SumTree(capacity, np.int64)
        # the mass of each cell, at its known key
        self.mass = SumTree(capacity, np.float64)
        self.priority = np.zeros(capacity, np.float64)
        # for each known key: the previous and the next known key (circularly), and the size |I| of its cell
        self.prev_known = np.zeros(capacity, np.int64)
        self.next_known = np.zeros(capacity, np.int64)
        self.cell_size = np.zeros(capacity, np.int64)

    @property
    def num_valid(self) -> int:
        return int(self.valid.total)

    @property
    def num_known(self) -> int:
        return int(self.known.total)

    def add(self, keys) -> None:
        """Keys become valid with an unknown priority (lazy initialization): each joins the cell that holds it."""
        new_keys = [key for key in np.unique(np.asarray(keys, np.int64)).tolist() if not self._is_valid(key)]
        self.valid.set_leaves(new_keys, [1] * len(new_keys))
        changed = set()
        if self.num_known:
            owner = -1
            for key in new_keys:
                owner = self._owner(key, guess=owner)
                self.cell_size[owner] += 1
                changed.update(self._touched(owner))
        self._set_masses(changed)

    def remove(self, keys) -> None:
        """Evict keys (sequence overwritten): an unknown key leaves its cell, a known key's cell merges into the previous."""
        old_keys = [key for key in np.unique(np.asarray(keys, np.int64)).tolist() if self._is_valid(key)]
        self.valid.set_leaves(old_keys, [0] * len(old_keys))
        changed = set()
        owner = -1
        for key in old_keys:
            if self._is_known(key):
                self.known.add_one(key, -1)
                # (its mass becomes 0)
                changed.add(key)
                prev_key = self.prev_known[key]
                next_key = self.next_known[key]
                if prev_key == key:
                    owner = -1
                    continue
                # other keys remain known: unlink key; prev_key's cell takes key's other keys
                self.next_known[prev_key] = next_key
                self.prev_known[next_key] = prev_key
                self.cell_size[prev_key] += self.cell_size[key] - 1
                changed.update(self._touched(prev_key))
                # (the next owner guess: prev_key holds the keys after key now)
                owner = prev_key
            elif self.num_known:
                # an unknown key: the cell holding it shrinks by one
                owner = self._owner(key, guess=owner)
                self.cell_size[owner] -= 1
                changed.update(self._touched(owner))
        self._set_masses(changed)

    def set_priority(self, keys, priorities) -> None:
        """Priorities of keys just trained on (a repeated key's last; evicted keys skipped); a new known key splits a cell."""
        keys = np.asarray(keys, np.int64).ravel().tolist()
        priorities = np.asarray(priorities, np.float64).ravel().tolist()
        last_priority = dict(zip(keys, priorities))
        changed = set()
        for key in sorted(last_priority):
            if not self._is_valid(key):
                continue
            self.priority[key] = last_priority[key]
            if self._is_known(key):
                changed.update(self._touched(key))
                continue
            if not self.num_known:
                # the first known key: one cell of all valid keys
                self.known.add_one(key, 1)
                self.prev_known[key] = key
                self.next_known[key] = key
                self.cell_size[key] = self.num_valid
                changed.add(key)
                continue
            # key splits its owner's cell: key's cell is the valid keys [key, next known key), circularly
            owner = self._owner(key)
            next_key = self.next_known[owner]
            self.known.add_one(key, 1)
            if next_key > key:
                size = self.valid.count(key, next_key)
            else:
                size = self.num_valid - self.valid.count(next_key, key)
            self.cell_size[key] = size
            self.cell_size[owner] -= size
            self.next_known[owner] = key
            self.prev_known[key] = owner
            self.next_known[key] = next_key
            self.prev_known[next_key] = key
            # the cells around the split
            changed.update((self.prev_known[owner], owner, key, next_key))
        self._set_masses(changed)

    def sample(self, batch: int, rng: np.random.Generator):
        """Sample `batch` valid keys: (keys, probabilities P(t) = eps / n + (1 - eps) p_hat_t / sum_k p_hat_k, uniform while
        nothing is known). A draw takes 5 uniforms in [0, 1) (one `rng.random` call): the uniform key's rank, the coin
        for the uniform part (< eps), the mass point, the choice of the cell's known key, the unknown key's offset."""
        num_valid = self.num_valid
        total_mass = self.mass.total
        if num_valid == 0:
            raise ValueError("cannot sample from an empty replay")
        prioritized = self.num_known > 0 and total_mass > 0
        keys = []
        probabilities = []
        for u_rank, u_coin, u_mass, u_known, u_offset in rng.random((5, batch)).T:
            if prioritized and u_coin >= self.eps:
                # a cell by mass (a round-off landing on an empty leaf: its cell), then its known key with probability
                # p_i / m_i, else one of its cell_size - 1 unknown keys
                cell = self._owner(self.mass.find_one(u_mass * total_mass))
                cell_size = self.cell_size[cell]
                if cell_size <= 1 or u_known * self.mass.get(cell) < self.priority[cell]:
                    key = cell
                    estimate = self.priority[cell]
                else:
                    offset = 1 + min(int(u_offset * (cell_size - 1)), cell_size - 2)
                    key = self.valid.nth_after(cell, offset)
                    estimate = self._cell_estimate(cell)
            else:
                # uniform
                key = self.valid.find_one(min(int(u_rank * num_valid), num_valid - 1))
                estimate = self._estimate_one(key) if prioritized else None
            keys.append(key)
            if prioritized:
                probabilities.append(self.eps / num_valid + (1 - self.eps) * estimate / total_mass)
            else:
                probabilities.append(1.0 / num_valid)
        return np.array(keys, np.int64), np.array(probabilities, np.float64)

    def estimate(self, keys):
        """p_hat for each (valid) key (NaN while none is known)."""
        keys = np.asarray(keys, np.int64)
        if not self.num_known:
            return np.full(keys.shape, np.nan)
        return np.array([self._estimate_one(key) for key in keys.ravel().tolist()], np.float64).reshape(keys.shape)

    def known_priorities(self) -> np.ndarray:
        """The priorities of the known keys."""
        return self.priority[self.known.get(np.arange(self.capacity)) > 0]

    def state_dict(self):
        trees = {name: getattr(self, name).tree.copy() for name in ("valid", "known", "mass")}
        return trees | {"priority": self.priority.copy()}

    def load_state_dict(self, state):
        self.valid.tree[:] = state["valid"]
        self.known.tree[:] = state["known"]
        self.mass.tree[:] = state["mass"]
        self.priority[:] = state["priority"]
        # the links and sizes of the known keys, rebuilt from the trees
        known_keys = np.flatnonzero(self.known.get(np.arange(self.capacity)))
        if len(known_keys) == 0:
            return
        next_keys = np.roll(known_keys, -1)
        self.prev_known[known_keys] = np.roll(known_keys, 1)
        self.next_known[known_keys] = next_keys
        # a cell: the valid keys from its known key up to the next one; the last cell wraps around the end
        valid_before = np.r_[0, np.cumsum(self.valid.get(np.arange(self.capacity)))]
        wraps = np.where(next_keys > known_keys, 0, self.num_valid)
        self.cell_size[known_keys] = wraps + valid_before[next_keys] - valid_before[known_keys]

    # the cell bookkeeping behind the public methods above
    def _is_valid(self, key: int) -> bool:
        return self.valid.get(key) != 0

    def _is_known(self, key: int) -> bool:
        return self.known.get(key) != 0

    def _owner(self, key: int, guess: int = -1) -> int:
        """The last known key <= key, circularly (its cell holds key); `guess`, a known key, is checked first in O(1)."""
        if guess >= 0:
            # guess's cell spans the keys [guess, next known key), circularly (every key when guess is the only one)
            span = (self.next_known[guess] - guess) % self.capacity or self.capacity
            if (key - guess) % self.capacity < span:
                return guess
        return self.known.last_nonzero_at_or_before(key)

    def _cell_estimate(self, cell: int) -> float:
        """p_hat of the unknown keys of known key `cell`'s cell: the cell-size weighted mean over J (distinct cells)."""
        # J: the cell, then its neighbour cells, each once (one, two or three cells)
        cells_in_j = dict.fromkeys((cell, self.prev_known[cell], self.next_known[cell]))
        weighted_sum = 0.0
        total_size = 0
        for j in cells_in_j:
            weighted_sum += self.cell_size[j] * self.priority[j]
            total_size += self.cell_size[j]
        return weighted_sum / total_size

    def _estimate_one(self, key: int) -> float:
        """p_hat of valid key `key`: its priority if known, else its cell's estimate."""
        if self._is_known(key):
            return self.priority[key]
        return self._cell_estimate(self._owner(key))

    def _touched(self, cell: int) -> tuple:
        """The cells whose mass depends on known key `cell`'s priority, size or links."""
        return self.prev_known[cell], cell, self.next_known[cell]

    def _set_masses(self, cells: set) -> None:
        """Recompute the masses of these cells (0 for keys no longer known), one combined tree walk."""
        cells = sorted(int(cell) for cell in cells)
        masses = []
        for cell in cells:
            if self._is_known(cell):
                masses.append(self.priority[cell] + (self.cell_size[cell] - 1) * self._cell_estimate(cell))
            else:
                masses.append(0.0)
        self.mass.set_leaves(cells, masses)


class SequenceReplay:
    """Per-actor ring segments of slots: x_t (uint8), the LSTM state before x_t, a_t, mu(.|x_t), r_t, flags, and the
    weights version a_t was drawn with. Key t is the sequence of slots t .. t+T (T+1 observations), valid from the
    writing of slot t+T until slot t is overwritten."""

    FIELDS = ("obs", "action", "reward", "term", "pad", "first", "mu", "state", "version")

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
            # the learning step of the weights the actor acted with (the policy lag: learning steps since then)
            "version": (np.int64, ()),
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
        # (whole segments)
        self.capacity = self.seg_cap * num_segments
        self.num_segments = num_segments
        self.seq_len = seq_len
        self.prioritized = prioritized
        for name, (dtype, shape) in self.slot_fields(num_actions, lstm_size, obs_shape).items():
            setattr(self, name, np.zeros((self.capacity, *shape), dtype))
        # slots ever written per segment
        self.written = np.zeros(num_segments, np.int64)
        self.index = LazyPriorities(self.capacity, uniform_eps if prioritized else 1.0)

    @classmethod
    def bytes_needed(cls, capacity: int, num_actions: int, lstm_size: int, obs_shape: tuple) -> int:
        """The slot arrays, plus per key 3 sum trees (2 * 2^ceil(log2) 8-byte nodes) and LazyPriorities' 4 8-byte arrays."""
        fields = cls.slot_fields(num_actions, lstm_size, obs_shape).values()
        slot_bytes = sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for dtype, shape in fields)
        return capacity * (slot_bytes + 3 * 2 * 8 * 2 + 4 * 8)

    def __len__(self):
        return self.index.num_valid

    def add(self, segment: int, chunk: dict) -> None:
        """Append a chunk of slots to one segment: evict the keys being overwritten, write, add the new keys."""
        num_slots = len(chunk["action"])
        assert num_slots <= self.seg_cap - self.seq_len - 1, "chunk too large for the segment"
        # the slots' times in their segment (counted from its first write) and their places in the arrays
        times = self.written[segment] + np.arange(num_slots)
        slots = segment * self.seg_cap + times % self.seg_cap
        # the key of an overwritten slot
        self.index.remove(slots[times >= self.seg_cap])
        for name in self.FIELDS:
            getattr(self, name)[slots] = chunk[name]
        self.written[segment] += num_slots
        # the sequences t .. t+T now complete
        new_starts = times[times >= self.seq_len] - self.seq_len
        self.index.add(segment * self.seg_cap + new_starts % self.seg_cap)

    def sample(self, batch: int, rng: np.random.Generator, device):
        keys, probs = self.index.sample(batch, rng)
        segments = keys // self.seg_cap
        starts = keys % self.seg_cap
        slots = segments[:, None] * self.seg_cap + (starts[:, None] + np.arange(self.seq_len + 1)) % self.seg_cap
        # PER Eq. (2) with exponent beta = 1 (3.3)
        weights = 1.0 / (len(self) * probs)

        def to_device(x, dtype=None):
            return torch.as_tensor(x, dtype=dtype).to(device, non_blocking=True)

        state = self.state[keys].astype(np.float32)
        return keys, Batch(
            obs=to_device(self.obs[slots]),
            actions=to_device(self.action[slots], torch.int64),
            rewards=to_device(self.reward[slots]),
            term=to_device(self.term[slots]),
            pad=to_device(self.pad[slots]),
            first=to_device(self.first[slots]),
            mu=to_device(self.mu[slots]),
            state=tuple(to_device(state[:, part]) for part in range(4)),
            weights=to_device(weights / weights.max(), torch.float32),
        )

    def cut_at_heads(self) -> None:
        """Resume: each segment's last written slot becomes a pad (as after a truncation): no sequence crosses episodes."""
        segments = np.flatnonzero(self.written > 0)
        self.pad[segments * self.seg_cap + (self.written[segments] - 1) % self.seg_cap] = True

    def update_priorities(self, keys, priorities, exponent: float = 1.0) -> None:
        if self.prioritized:
            self.index.set_priority(keys, (np.asarray(priorities, np.float64) + 1e-6) ** exponent)

    def state_dict(self):
        arrays = {name: getattr(self, name) for name in (*self.FIELDS, "written")}
        return arrays | {"index": self.index.state_dict()}

    def load_state_dict(self, state):
        for name in (*self.FIELDS, "written"):
            getattr(self, name)[:] = state[name]
        self.index.load_state_dict(state["index"])


# ACTOR PROCESS (module-level so spawn can pickle it)
class ChunkMessage(NamedTuple):
    """The rows an actor wrote into one of its buffers: all that crosses the queue for them."""

    # always "chunk": how a reader of the queue that takes any tuple (the tests, bench_reactor.py) tells chunks from an
    # actor's own messages (`post`); the learner's loop tells them apart by type
    kind: str
    actor: int
    buffer: int
    rows: int


class EpisodeMessage(NamedTuple):
    """An actor's finished episode (`info["episode"]`), posted to the learner for logging."""

    episodic_return: float
    episode_length: int


@dataclass
class FillingBuffer:
    """Actor side: the buffer an actor is writing into (held by the process that writes it, never shared)."""

    buffer: int
    views: dict  # {field: numpy view of the buffer's rows}
    rows: int = 0


class ChunkChannel:
    """Actor -> learner transport of rows with fixed fields ({name: (dtype, shape)}), through shared memory.

    Each actor owns `num_buffers` buffers of `rows` rows. It `reserve`s a free buffer, `write`s rows into it and
    `send`s it: only a `ChunkMessage` (actor, buffer index, row count) crosses the queue, with the actor's own small
    messages (`post`), so a killed actor can never leave a half-written large message that would block the learner's
    read. The learner `get`s messages; for a chunk `read` gives (actor, {field: rows}) as views into the buffer, and
    `release` returns the buffer to its actor once the rows are copied. Pass it to actor processes as a `Process`
    argument: the arrays and queues are shared; `filling`, the buffers being written, is each process's own (a
    pickled channel arrives without it, `__getstate__`).
    """

    def __init__(self, ctx, num_actors: int, rows: int, fields: dict, num_buffers: int = 4):
        self.arrays = {
            name: torch.from_numpy(np.zeros((num_actors, num_buffers, rows, *shape), dtype)).share_memory_()
            for name, (dtype, shape) in fields.items()
        }
        self.free = [ctx.Queue() for _ in range(num_actors)]
        for free in self.free:
            for buffer in range(num_buffers):
                free.put(buffer)
        self.queue = ctx.Queue()
        # actor side, this process's own: {actor: the buffer it is writing into} (threads of one process: one entry each)
        self.filling: dict[int, FillingBuffer] = {}

    def __getstate__(self) -> dict:
        """Pickled for an actor process: the shared arrays and queues, not this process's buffers being written."""
        return self.__dict__ | {"filling": {}}

    def reserve(self, actor: int, timeout: float = 0.1) -> bool:
        """Actor side: hold a free buffer to write into (False if none came back within `timeout` s)."""
        if actor not in self.filling:
            try:
                buffer = self.free[actor].get(timeout=timeout)
            except queue.Empty:
                return False
            views = {name: array[actor, buffer].numpy() for name, array in self.arrays.items()}
            self.filling[actor] = FillingBuffer(buffer, views)
        return True

    def write(self, actor: int, *values, **named_values) -> int:
        """Actor side: one row into the reserved buffer (its values in field order, or by field name); returns its rows."""
        filling = self.filling[actor]
        row = dict(zip(filling.views, values)) | named_values
        for name, value in row.items():
            filling.views[name][filling.rows] = value
        filling.rows += 1
        return filling.rows

    def send(self, actor: int) -> None:
        """Actor side: send the reserved buffer to the learner (if any row was written)."""
        if actor in self.filling and self.filling[actor].rows:
            filling = self.filling.pop(actor)
            self.queue.put(ChunkMessage("chunk", actor, filling.buffer, filling.rows))

    def post(self, message: tuple) -> None:
        """Actor side: a small message of the actor's own, a tuple (its first element must not be "chunk")."""
        self.queue.put(message)

    def get(self, timeout: float | None = None):
        """Learner side: the next message; raises queue.Empty (waits up to `timeout` s; None: does not wait)."""
        if timeout:
            return self.queue.get(timeout=timeout)
        return self.queue.get_nowait()

    def read(self, message: ChunkMessage) -> tuple[int, dict]:
        """Learner side: (actor, {field: its rows, views into the shared buffer}) of a chunk message."""
        rows = {name: array[message.actor, message.buffer, : message.rows].numpy() for name, array in self.arrays.items()}
        return message.actor, rows

    def release(self, message: ChunkMessage) -> None:
        """Learner side: give a read chunk's buffer back to its actor (its rows must have been copied)."""
        self.free[message.actor].put(message.buffer)


def make_channel(ctx, args: Args, num_actions: int, obs_shape) -> ChunkChannel:
    """Actor -> learner slots (SequenceReplay's fields) in chunks of actor_chunk + 1 rows (room for a pad slot)."""
    fields = SequenceReplay.slot_fields(num_actions, args.lstm_size, obs_shape)
    return ChunkChannel(ctx, args.num_actors, args.actor_chunk + 1, fields)


class RatioBase(NamedTuple):
    """Where the acting:learning ratio counts from (learning_starts, or a resume without its replay)."""

    env_step: int
    learn_step: int


class ActorHandles(NamedTuple):
    """What the learner shares with every actor process."""

    shared_net: nn.Module  # the learner's latest weights, in shared memory
    weights_version: Any  # the learning step of those weights (the learner writes it)
    actor_steps: Any  # env steps of each actor (each actor writes its own entry)
    learner_steps: Any  # learning steps done (the actors' ratio gate reads it)
    channel: ChunkChannel
    stop_event: Any  # set by the learner: the actors return


@torch.no_grad()
def act(net, obs, state, rng: np.random.Generator, device="cpu"):
    """One step of the policy: (action sampled from pi, pi(.|x) as float64, the network's output)."""
    first = torch.zeros(1, 1, dtype=torch.bool, device=device)
    out = net(torch.from_numpy(obs)[None, None].to(device), first, state)
    mu = out.pi[0, 0].cpu().numpy().astype(np.float64)
    mu /= mu.sum()
    return int(rng.choice(len(mu), p=mu)), mu, out


def actor_seed(seed: int, actor_id: int, start_step: int) -> int:
    """Actor i's seed: seed + 1000 i in a new run; a run resumed at global step start_step > 0 draws new streams from
    it (its actors must not replay the first run's env and action streams)."""
    actor_seed = seed + 1000 * actor_id
    if start_step == 0:
        return actor_seed
    return resumed_seed(actor_seed, start_step)


def actor_loop(actor_id: int, args: Args, run_name: str, handles: ActorHandles, ratio_base: RatioBase, start_step: int):
    """Act with the shared weights (CPU, one thread), send slots to the learner in chunks; wait while ahead of the ratio.
    start_step: the global step the run starts from (0, or the resumed checkpoint's), for the seeds."""
    torch.set_num_threads(1)
    seed = actor_seed(args.seed, actor_id, start_step)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    video_folder = f"videos/{run_name}" if args.capture_video and actor_id == 0 else None
    env = make_env(args.env_id, seed, args, video_folder=video_folder)
    num_actions = env.action_space.n
    net = make_network(args, num_actions, env.observation_space.shape)
    channel = handles.channel
    obs, _ = env.reset(seed=seed)
    state = net.initial_state(1)
    first = True
    # the learning step of the weights in `net` (-1: none loaded yet)
    version = -1
    # this actor's env steps so far (a resumed run: the learner's count at the checkpoint)
    steps = handles.actor_steps[actor_id]
    while not handles.stop_event.is_set():
        # the acting:learning ratio: wait for the learner while all actors together are ahead of it
        ahead = sum(handles.actor_steps[:]) - ratio_base.env_step
        allowed = args.acting_learning_ratio * (handles.learner_steps.value - ratio_base.learn_step) + args.ratio_slack
        if ahead >= 0 and ahead > allowed:
            channel.send(actor_id)
            time.sleep(0.002)
            continue
        # a free chunk buffer (the learner gives them back)
        if not channel.reserve(actor_id):
            continue
        # the learner's latest weights before the first step, then every actor_sync_every steps if they changed; the
        # version is read first, so the weights loaded are that version or newer (hogwild)
        at_sync_point = steps % args.actor_sync_every == 0
        if version < 0 or (at_sync_point and handles.weights_version.value != version):
            version = handles.weights_version.value
            net.load_state_dict(handles.shared_net.state_dict())
        action, mu, out = act(net, obs, state, rng)
        next_obs, reward, terminated, truncated, info = env.step(action)
        rows = channel.write(
            actor_id,
            obs=obs,
            action=action,
            reward=float(reward),
            term=bool(terminated),
            pad=False,
            first=first,
            mu=mu.astype(np.float32),
            # the LSTM state before x_t, [4, H]
            state=torch.cat(state, 0).numpy().astype(np.float16),
            version=version,
        )
        steps += 1
        handles.actor_steps[actor_id] = steps
        if "episode" in info:
            channel.post(EpisodeMessage(float(info["episode"]["r"]), int(info["episode"]["l"])))
        if terminated or truncated:
            if truncated and not terminated:
                # the true last observation, to bootstrap from (no transition leaves it)
                rows = channel.write(
                    actor_id,
                    obs=next_obs,
                    action=0,
                    reward=0.0,
                    term=False,
                    pad=True,
                    first=False,
                    mu=np.full(num_actions, 1.0 / num_actions, np.float32),
                    state=torch.cat(out.state, 0).numpy().astype(np.float16),
                    version=version,
                )
            obs, _ = env.reset()
            state = net.initial_state(1)
            first = True
        else:
            obs = next_obs
            state = out.state
            first = False
        if rows >= args.actor_chunk:
            channel.send(actor_id)
    channel.send(actor_id)
    env.close()


# LEARNER STEPS (the loop in __main__ calls them)
def store_chunk(channel: ChunkChannel, message: ChunkMessage, replay: SequenceReplay) -> tuple[int, np.ndarray]:
    """A chunk into its actor's replay segment, copied before its buffer goes back to the actor (who writes into it at
    once). Returns (the actor, the weights versions of the chunk's env steps: one per slot but its pad slots)."""
    actor_id, chunk = channel.read(message)
    # (copies)
    replay.add(actor_id, chunk)
    versions = chunk["version"][~chunk["pad"]].copy()
    channel.release(message)
    return actor_id, versions


def learner_may_learn(global_step: int, learn_steps: int, num_sequences: int, ratio_base: RatioBase, args: Args) -> bool:
    """The learner's side of the acting:learning ratio (3.4): learning steps <= (env steps - learning_starts) /
    acting_learning_ratio, both counted from ratio_base; and at least a batch of sequences in the replay."""
    env_steps = global_step - ratio_base.env_step
    return (
        env_steps >= 0
        and num_sequences >= args.batch_size
        and learn_steps - ratio_base.learn_step < env_steps / args.acting_learning_ratio
    )


def learning_step(net, target_net, optimizer, replay: SequenceReplay, support, args: Args, rng, device) -> dict:
    """One learning step: a prioritized batch, the Reactor loss, Adam, the batch's new priorities into the replay (3.3).
    Returns the step's stats (0-d tensors on the device), the loss and the mean IS weight among them.
    Oracle: tests/test_reactor_loop.py::test_learning_step_equals_a_hand_written_update_over_two_steps."""
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
    # (copies into the shared tensors)
    shared_net.load_state_dict(net.state_dict())
    weights_version.value = learn_steps
    learner_steps.value = learn_steps
    if learn_steps % args.target_update_period == 0:
        target_net.load_state_dict(net.state_dict())


def evaluate(net, args: Args, episodes: int, device, seed: int, greedy: bool = False):
    """Whole games, up to noop_max no-op starts, actions from pi (or argmax pi), real scores; a lost life resets the state."""
    env = make_env(args.env_id, seed, args, evaluation=True)
    rng = np.random.default_rng(seed)
    returns = []
    for episode in range(episodes):
        # a stop signal ends the evaluation between games
        check_stop()
        obs, info = env.reset(seed=seed + episode)
        state = net.initial_state(1, device)
        lives = info.get("lives")
        while True:
            action, mu, out = act(net, obs, state, rng, device)
            if greedy:
                action = int(mu.argmax())
            obs, _, terminated, truncated, info = env.step(action)
            lost_life = lives is not None and info.get("lives", lives) < lives
            state = net.initial_state(1, device) if lost_life else out.state
            lives = info.get("lives", lives)
            if "episode" in info:
                returns.append(float(info["episode"]["r"]))
            if terminated or truncated:
                break
    env.close()
    return returns


# RUN PLUMBING: the resume classes, validation, a resume's checks and what it restores
# the flags a resumed run may not change (environment, seed, network, method; the replay is per actor)
FIXED_ON_RESUME = (
    "env_id",
    "sticky_action_prob",
    "noop_max",
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
# flags a resumed run applies from its resumed step on (each is changed and read back by a resume test)
APPLIED_ON_RESUME = (
    "total_timesteps",
    "learning_starts",
    "batch_size",
    "acting_learning_ratio",
    "ratio_slack",
    "learning_rate",
    "adam_beta1",
    "max_grad_norm",
    "target_update_period",
    "retrace_lambda",
    "beta_loo_c",
    "tislr_c",
    "entropy_coef",
    "replay_uniform_eps",
    "priority_exponent",
    "actor_sync_every",
    "eval_episodes",
)
# how the run is executed and reported, never what it learns
RUN_ONLY_ON_RESUME = (
    "actor_chunk",
    "log_every",
    "checkpoint_replay",
    "memory_fraction",
)
# flags renamed since a checkpoint may have been written: {old field: new field} (a checkpoint's old name resumes)
RENAMED_FLAGS = {"replay_ratio": "acting_learning_ratio"}


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags; the first violation stops the script with one line `error: ...`."""
    require(args.total_timesteps > 0, f"--total-timesteps must be > 0, got {args.total_timesteps!r}")
    require(args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors!r}")
    require(args.learning_starts >= 0, f"--learning-starts must be >= 0, got {args.learning_starts!r}")
    require(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size!r}")
    require(args.sequence_length >= 1, f"--sequence-length must be >= 1, got {args.sequence_length!r}")
    require(args.acting_learning_ratio > 0, f"--acting-learning-ratio must be > 0, got {args.acting_learning_ratio!r}")
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
    # the checks between flags
    minatar = args.env_id in MINATAR_ENV_IDS
    require(
        args.env_id in ATARI_ENV_IDS or minatar,
        f"reactor.py is for Atari and MinAtar (discrete actions, image frames): {args.env_id!r} is neither a registered "
        "ALE id (ALE/Pong-v5) nor a MinAtar id (MinAtar/Breakout-v0)",
    )
    require(
        not (minatar and args.torso == "paper"),
        "--torso paper needs 84x84 Atari frames: MinAtar takes --torso minatar (or auto)",
    )
    require(not (minatar and args.capture_video), "--capture-video needs an Atari game (MinAtar envs render no frames here)")
    require(
        args.total_timesteps > args.learning_starts,
        f"--total-timesteps ({args.total_timesteps:,}) must be > --learning-starts ({args.learning_starts:,})",
    )
    require(args.v_max > args.v_min, f"--v-max ({args.v_max}) must be > --v-min ({args.v_min})")
    require(
        not (args.policy_gradient == "tislr" and args.policy_uniform_eps == 0),
        "tislr needs --policy-uniform-eps > 0 so that mu(a) > 0 for all actions",
    )
    slots_per_actor = 2 * (args.sequence_length + 1) + args.actor_chunk + 2
    require(
        args.replay_size // args.num_actors >= slots_per_actor,
        f"--replay-size {args.replay_size} is too small: each of the {args.num_actors} actors needs >= {slots_per_actor} "
        "slots",
    )
    if args.capture_video:
        try:
            check_video_support()
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


def resumed_ratio_base(ckpt: dict, args: Args) -> RatioBase:
    """Where a resumed run's acting:learning ratio counts from. Without its replay: after learning_starts steps that
    refill it. With it: the checkpoint's base, so that the run goes on exactly, except that a new --learning-starts
    moves the start of a replay still filling (never before the resumed step) and a new --acting-learning-ratio counts from the
    resumed step (from the old base it would owe or grant learning steps at once)."""
    global_step = ckpt["global_step"]
    learn_steps = ckpt["learn_steps"]
    if ckpt["replay"] is None:
        return RatioBase(env_step=global_step + args.learning_starts, learn_step=learn_steps)
    saved = RatioBase(*ckpt["ratio_base"])
    if global_step < saved.env_step:
        # still filling: learning starts learning_starts steps after the filling began
        filling_began = saved.env_step - ckpt["args"]["learning_starts"]
        return RatioBase(env_step=max(filling_began + args.learning_starts, global_step), learn_step=saved.learn_step)
    if args.acting_learning_ratio != ckpt["args"]["acting_learning_ratio"]:
        return RatioBase(env_step=global_step, learn_step=learn_steps)
    return saved


def check_resume(args: Args, ckpt: dict) -> None:
    """A resume's checks against its checkpoint, each failure one line `error: --resume: ...`: a checkpoint of this
    version; --learning-starts changed only where it can act (a replay still filling, or refilled: saved without
    --checkpoint-replay); a budget beyond the step where learning resumes."""
    require(
        "ratio_base" in ckpt and "actor_steps" in ckpt,
        f"--resume: {args.resume} was written by an older reactor.py (no ratio base, no actor step counts)",
    )
    global_step = ckpt["global_step"]
    replay_saved = ckpt["replay"] is not None
    learning_began = replay_saved and global_step >= ckpt["ratio_base"][0]
    require(
        not (learning_began and args.learning_starts != ckpt["args"]["learning_starts"]),
        f"--resume: --learning-starts cannot act on this checkpoint: learning began at step {ckpt['ratio_base'][0]:,} "
        "and its replay is restored (it acts on a replay still filling, or refilled after a checkpoint without "
        "--checkpoint-replay)",
    )
    learns_from = max(global_step, resumed_ratio_base(ckpt, args).env_step)
    if not replay_saved:
        refill = f" and has no replay ({args.learning_starts:,} steps refill it)"
    elif learns_from > global_step:
        refill = f" and its replay fills until step {learns_from:,}"
    else:
        refill = ""
    require(
        args.total_timesteps > learns_from,
        f"--resume: the checkpoint is at step {global_step:,}{refill}: give --total-timesteps > {learns_from:,}",
    )


def apply_optimizer_flags(optimizer: torch.optim.Optimizer, args: Args) -> None:
    """Adam's --learning-rate and --adam-beta1 into its param groups (a resume's optimizer state brings back the
    checkpoint's; the flags in effect are this run's)."""
    for group in optimizer.param_groups:
        group["lr"] = args.learning_rate
        group["betas"] = (args.adam_beta1, group["betas"][1])


class LoopLog:
    """The main loop's logging, none of it the method: episodes as they arrive, the policy lag of the env steps
    received, the learning steps' stats (`MetricAverager`: summed on the device, means in float64 with one transfer per
    log line) and their time, and every log_every learning steps one metrics record and one progress line."""

    def __init__(self, logger, global_step: int):
        self.logger = logger
        self.start_time = time.time()
        self.start_step = global_step
        self.recent_returns = deque(maxlen=100)
        # the learning steps' stats (loss and IS weights too) since the last log line, and their time
        self.learner_stats = MetricAverager()
        self.learn_time = 0.0
        # the policy lag (learning steps since the weights acted with) summed over the env steps received since then
        self.lag_sum = 0
        self.lag_count = 0

    def sps(self, global_step: int) -> float:
        """Env steps per second since the run (or its resume) started."""
        return (global_step - self.start_step) / (time.time() - self.start_time)

    def mean_recent_return(self) -> float | None:
        """The mean return of the last 100 training episodes (None before the first)."""
        return float(np.mean(self.recent_returns)) if self.recent_returns else None

    def episode(self, global_step: int, message: EpisodeMessage) -> None:
        """An actor's finished episode: its return and length logged at the step it arrived."""
        self.recent_returns.append(message.episodic_return)
        self.logger.log(
            global_step,
            {"charts/episodic_return": message.episodic_return, "charts/episodic_length": message.episode_length},
        )

    def received(self, learn_steps: int, versions: np.ndarray) -> None:
        """Env steps just received, one weights version each: their policy lag (learning steps since that version)."""
        self.lag_sum += int((learn_steps - versions).sum())
        self.lag_count += len(versions)

    def learned(self, stats: dict, step_start: float) -> None:
        """A learning step's stats (0-d tensors on the device) and its time since `step_start`."""
        self.learner_stats.add(stats)
        self.learn_time += time.time() - step_start

    def log_line(self, global_step: int, learn_steps: int, replay: SequenceReplay, ratio_base: RatioBase) -> None:
        """The means since the last log line (one record), the replay's priorities and the progress line."""
        steps_logged = len(self.learner_stats)
        sps = self.sps(global_step)
        learner_sps = steps_logged / max(self.learn_time, 1e-9)
        known = replay.index.known_priorities()
        acting_learning_ratio = (global_step - ratio_base.env_step) / max(learn_steps - ratio_base.learn_step, 1)
        metrics = self.learner_stats.means() | {
            "charts/SPS": sps,
            "charts/learning_steps": learn_steps,
            "charts/learner_steps_per_s": learner_sps,
            "charts/acting_learning_ratio": acting_learning_ratio,
            "charts/policy_lag": self.lag_sum / max(self.lag_count, 1),
            "replay/size": len(replay),
            "replay/known_fraction": replay.index.num_known / max(len(replay), 1),
            "replay/priority_mean": float(known.mean()) if known.size else 0.0,
            "replay/priority_max": float(known.max()) if known.size else 0.0,
        }
        self.logger.log(global_step, metrics)
        self.logger.progress(
            global_step,
            sps,
            self.mean_recent_return(),
            "value_loss",
            float(metrics["losses/value_loss"]),
            f"learn {learn_steps:,} ({learner_sps:.1f}/s) rho {float(metrics['replay/rho_mean']):.2f}",
        )
        self.learn_time = 0.0
        self.lag_sum = 0
        self.lag_count = 0

    def last_record(self, global_step: int, learn_steps: int) -> None:
        """The run's last record, at its last step."""
        self.logger.log(global_step, {"charts/SPS": self.sps(global_step), "charts/learning_steps": learn_steps})


if __name__ == "__main__":
    # tyro; --resume: the checkpoint's flags, given flags override
    args, ckpt, overridden = parse_run_args(
        Args, "reactor.py", FIXED_ON_RESUME, APPLIED_ON_RESUME, RUN_ONLY_ON_RESUME, renamed=RENAMED_FLAGS
    )
    # all checks before anything heavy and before the run folder
    validate_args(args)
    if ckpt:
        # a checkpoint of this version, a budget beyond where learning resumes, --learning-starts only where it acts
        check_resume(args, ckpt)
    # (Atari and MinAtar: discrete actions)
    probe = make_env(args.env_id, args.seed, args)
    num_actions = int(probe.action_space.n)
    obs_shape = probe.observation_space.shape
    probe.close()
    # prints what the replay needs; refuses one that does not fit in RAM, in one line
    check_memory(
        SequenceReplay.bytes_needed(args.replay_size, num_actions, args.lstm_size, obs_shape),
        "--replay-size",
        args.memory_fraction,
    )
    # runs/{env}__{exp_name}__{seed}__{time}, or the checkpoint's
    logger = start_run(args, ckpt, args.env_id)

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    # the learner takes the cores the actors leave free
    set_learner_threads(args.num_actors)
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
    global_step = 0
    learn_steps = 0
    episodes_done = 0
    # the env steps received from each actor (they sum to global_step)
    actor_env_steps = np.zeros(args.num_actors, np.int64)
    ratio_base = RatioBase(env_step=args.learning_starts, learn_step=0)
    if ckpt:
        replay_saved = ckpt["replay"] is not None
        load_state_dicts(
            ckpt, model=net, target_model=target_net, optimizer=optimizer, replay=replay if replay_saved else None
        )
        # this run's --learning-rate and --adam-beta1 over the ones the optimizer state brought back
        apply_optimizer_flags(optimizer, args)
        global_step = ckpt["global_step"]
        learn_steps = ckpt["learn_steps"]
        episodes_done = ckpt["episodes"]
        actor_env_steps[:] = ckpt["actor_steps"]
        ratio_base = resumed_ratio_base(ckpt, args)
        # the replay's sampling stream (the global RNGs: at the end of the set-up)
        rng = ckpt["np_rng"]
        if replay_saved:
            # the actors start new episodes: no bootstrap across the checkpoint
            replay.cut_at_heads()
            restored = f"replay ({len(replay):,} sequences, {replay.index.num_known:,} with a priority)"
        else:
            restored = f"no replay (saved without --checkpoint-replay): the first {args.learning_starts:,} steps refill it"
        print(
            f"resumed {args.resume} at step {global_step:,}: model, target network, optimizer ({learn_steps:,} "
            f"learning steps), RNG, {restored}; the acting:learning ratio counts from step {ratio_base.env_step:,}; "
            f"flags from this command line: {', '.join(overridden) or 'none'}; runs to step {args.total_timesteps:,}",
            flush=True,
        )
    shared_net = make_network(args, num_actions, obs_shape).share_memory()
    # (copies into the shared tensors)
    shared_net.load_state_dict(net.state_dict())
    ctx = torch.multiprocessing.get_context(args.start_method)
    procs = ProcessGroup(ctx)
    # unlocked counters, one writer each (a killed actor leaves no lock held), from the resumed step's values
    handles = ActorHandles(
        shared_net=shared_net,
        weights_version=ctx.Value("l", learn_steps, lock=False),
        actor_steps=ctx.Array("l", actor_env_steps.tolist(), lock=False),
        learner_steps=ctx.Value("l", learn_steps, lock=False),
        # slot chunks in shared memory, episode scores
        channel=make_channel(ctx, args, num_actions, obs_shape),
        stop_event=procs.stop_event,
    )
    channel = handles.channel
    if ckpt:
        # every global RNG as the checkpoint left it (last: the set-up above draws from torch's)
        set_rng_state(ckpt["rng"])
    start_step = global_step

    def make_checkpoint():
        save_run_checkpoint(
            logger,
            "reactor.py",
            args,
            global_step,
            learn_steps=learn_steps,
            episodes=episodes_done,
            actor_steps=actor_env_steps.tolist(),
            ratio_base=tuple(ratio_base),
            np_rng=rng,
            **state_dicts(
                model=net, target_model=target_net, optimizer=optimizer, replay=replay if args.checkpoint_replay else None
            ),
        )

    loop_log = LoopLog(logger, global_step)
    checkpoints = CheckpointSchedule(global_step, args.checkpoint_every)
    error = None
    can_learn = False
    try:
        for actor_id in range(args.num_actors):
            actor_args = (actor_id, args, logger.run_name, handles, ratio_base, start_step)
            procs.start(actor_loop, actor_args, name=f"actor-{actor_id}")
        while global_step < args.total_timesteps:
            # COLLECT: the actors' chunks into the replay (at most 4 messages per actor, then learn)
            for received in range(4 * args.num_actors):
                try:
                    message = channel.get(timeout=0.05 if received == 0 and not can_learn else None)
                except queue.Empty:
                    break
                if isinstance(message, ChunkMessage):
                    actor_id, versions = store_chunk(channel, message, replay)
                    # one version per env step (a pad slot is none)
                    global_step += len(versions)
                    actor_env_steps[actor_id] += len(versions)
                    loop_log.received(learn_steps, versions)
                else:
                    # the actors' only other message: an EpisodeMessage
                    episodes_done += 1
                    loop_log.episode(global_step, message)
            # LEARN: enforced ratio: learning steps <= (env steps - learning_starts) / acting_learning_ratio
            can_learn = learner_may_learn(global_step, learn_steps, len(replay), ratio_base, args)
            if can_learn:
                step_start = time.time()
                stats = learning_step(net, target_net, optimizer, replay, support, args, rng, device)
                learn_steps += 1
                publish_weights(net, target_net, shared_net, handles.weights_version, handles.learner_steps, learn_steps, args)
                # LOG: the step's stats; every log_every steps, their means since the last log line
                loop_log.learned(stats, step_start)
                if learn_steps % args.log_every == 0:
                    loop_log.log_line(global_step, learn_steps, replay, ratio_base)
            # CHECKPOINT
            if checkpoints.due(global_step):
                make_checkpoint()
            # a dead actor stops the run with its reason
            procs.check()
    except (KeyboardInterrupt, StopRun) as e:
        error = e
    finally:
        procs.stop()
    # the last record is at the last step
    loop_log.last_record(global_step, learn_steps)
    # SAVE + EVALUATE (after a normal end), summary.json, the exit code
    if args.checkpoint_every and error is None:
        make_checkpoint()

    def final_eval() -> dict:
        returns = evaluate(net, args, args.eval_episodes, device, args.seed + 10_000)
        for episodic_return in returns:
            logger.log(global_step, {"eval/episodic_return": episodic_return})
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
            "train_return_mean_last100": loop_log.mean_recent_return(),
        },
        {"model": net.state_dict(), "args": vars(args)} if args.save_model else None,
        final_eval if args.save_model and args.eval_episodes else None,
    )

# docs and results: README.md#clear_impalapy-clear-on-impala
"""CLEAR (Rolnick et al. 2019, https://arxiv.org/abs/1811.11682) on IMPALA (https://arxiv.org/abs/1802.01561).

Symbols: x_t, a_t, r_t state, action, reward at step t of a T-step unroll; B unrolls per batch; A actions; mu the
actors' policy, pi and V the learner's; rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu); v_s the V-trace target;
gamma the discount.

Paper parts implemented here
- IMPALA actor-learner (CLEAR App. A.1): `actor_loop` processes (CPU, `--envs-per-actor` envs, one batched forward)
  act with a shared-memory policy; each env's slot holds a (new, replay) unroll pair and its `SlotInfo`
  (`publish_pairs`: CLEAR's reservoir add, replay draw and publication) until the learner has copied it (`take_batch`,
  then `release_slots`); one update `learner_step`, whose weights reach the actors whole under a seqlock
  (`publish_weights`, `read_weights`).
- V-trace (IMPALA Eq. (1)) `vtrace_from_importance_weights`; value / pg / entropy losses (CLEAR Sec. 3) `impala_losses`.
- Per-actor reservoir replay of whole unrolls (App. A.3) `ReservoirBuffer`; new/replay choice per pair (App. A.1,
  Sec. 4.3) `select_pairs`; behavioural cloning on replay unrolls (Sec. 3) `policy_cloning_loss`, `value_cloning_loss`.
- Task sequences (App. A.6; sequential / simultaneous / separate, Fig. 1) `task_for_actor`; test actors per task
  (App. A.5) `test_actor_loop`; cumulative reward per task (App. C) `cumulative_returns`.

Defaults and their source
- T 20, B 32, gamma 0.99, grad clip 40, RMSProp lr 6e-4 annealed to 0 over the run's steps, alpha 0.99, eps 0.01
  (IMPALA Table G.1); rho_bar = c_bar = 1 (IMPALA Sec. 4.2); pg / value / entropy 1 / 0.5 / 0.005, cloning
  0.01 / 0.005 (CLEAR App. A.4); replay fraction 0.5 (Sec. 3's 50-50 new-replay split); buffer = half the run's
  steps (App. A.3).
- Loss sums over time and batch (scalable_agent). A "step" is one agent step of NEW experience (torchbeast counts
  them as "frames"); "frames" here are emulator frames only (Atari's `--max-episode-frames`).
- Atari (Sec. 4.6, IMPALA Table G.1): SpaceInvaders, Krull, BeamRider, Hero, StarGunner, MsPacman (ALE/*-v5), all
  18 actions, IMPALA preprocessing, no sticky actions.

Differences from the paper
- Feed-forward networks (Nature DQN CNN, IMPALA's deep ResNet, MinAtar's network, a small MiniGrid CNN); the paper
  used IMPALA's network with an LSTM (App. A.2). MinAtar sequences stand in for Atari on CPU (channels padded).
- Initialisation: CleanRL's orthogonal `layer_init`, except the ResNet's convolutions (PyTorch's default, as in
  torchbeast's ResNet); IMPALA's own code used Sonnet's default initialisers.
- A time limit bootstraps from the actor's V_mu of the final observation (Atari, MinAtar) or terminates (MiniGrid,
  whose limit is part of the task; `--bootstrap-truncation`); IMPALA terminates; `done` always cuts V-trace.
- torch RMSprop (eps outside the sqrt) as torchbeast; test actors sample from pi (the paper: silent); `--resume`
  restores replay only with `--checkpoint-replay`. Actors reset their own envs (no autoreset: true final obs).
Copying this file: it needs common/{atari_env,minatar_env,minigrid_env,logger,checkpoint,args,processes,video}.py.
"""

import collections
import json
import os
import queue
import time
from dataclasses import dataclass, field
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
from common.checkpoint import resumed_seed, save_run_checkpoint, seed_everything, select_device, set_rng_state
from common.logger import MetricAverager, start_run
from common.minatar_env import MINATAR_ENV_IDS, MINATAR_MAX_CHANNELS, make_minatar_env
from common.processes import ProcessGroup, StopRun, check_memory, finish_run, set_learner_threads
from common.video import check_video_support


# CommonArgs holds the flags every script shares: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
@dataclass
class Args(CommonArgs):
    # --- algorithm specific arguments ---
    env_ids: list[str] = field(default_factory=lambda: ["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"])
    """the task sequence: all Atari (the paper's 6 games: README), all MinAtar (-v0: 6 actions) or all MiniGrid"""
    steps_per_task: int = 200_000
    """agent steps of new experience per task visit, counted by the learner (CLEAR App. A.6)"""
    num_cycles: int = 2
    """how many times the whole task sequence is repeated (total steps = steps_per_task * len(env_ids) * num_cycles)"""
    mode: Literal["sequential", "simultaneous", "separate"] = "sequential"
    """sequential (one task at a time) | simultaneous (all at once) | separate (one network per task) (Sec. 4.1)"""
    num_actors: int = 32
    """training actor processes (CPU, one thread each); num_actors x envs_per_actor must be >= batch_size"""
    envs_per_actor: int = 1
    """envs per actor process, one batched forward; each env is one actor of the paper (one pair per batch at most)"""
    num_test_actors: int = 1
    """test actors PER TASK: always on their own task, current weights, no buffer, never feed the learner (App. A.5)"""
    batch_size: int = 32
    """B: unrolls per learner batch (IMPALA Table G.1)"""
    unroll_length: int = 20
    """T: agent steps per unroll (IMPALA Table G.1)"""
    replay_fraction: float = 0.5
    """the replayed share of each batch, the paper's new-replay mixture (CLEAR Sec. 3, 4.3): 0 = IMPALA, 0.5 = its
    50-50 new-replay, 1 = 100% replay (was --replay-ratio)"""
    buffer_size: int = -1
    """the paper's buffer size (App. A.3): replay capacity in agent steps, split over the actor processes; -1 = half of
    the run's steps; 0 = none (was --buffer-frames)"""
    behavior_cloning: bool = True
    """add the policy- and value-cloning losses on replay unrolls (CLEAR Sec. 3); --no-behavior-cloning: ablation"""
    policy_cloning_cost: float = 0.01
    """weight of L_policy-cloning = KL(mu || pi_theta) (CLEAR App. A.4)"""
    value_cloning_cost: float = 0.005
    """weight of L_value-cloning = ||V_theta - V_replay||^2 (CLEAR App. A.4)"""
    gamma: float = 0.99
    """discount gamma (IMPALA Table G.1)"""
    pg_cost: float = 1.0
    """weight of L_policy-gradient (CLEAR App. A.4)"""
    baseline_cost: float = 0.5
    """weight of L_value (CLEAR App. A.4)"""
    entropy_cost: float = 0.005
    """weight of L_entropy (CLEAR App. A.4 "~0.005"; IMPALA Atari uses 0.01)"""
    clip_rho_threshold: float = 1.0
    """rho_bar: clip of the importance weights in the V-trace TD errors (IMPALA Sec. 4.1)"""
    clip_pg_rho_threshold: float = 1.0
    """rho_bar_pg: clip of the importance weight in the policy-gradient advantage (IMPALA Sec. 4.2)"""
    learning_rate: float = 6e-4
    """RMSProp learning rate, annealed linearly to 0 over the whole run (IMPALA Table G.1)"""
    rmsprop_alpha: float = 0.99
    """RMSProp decay (torchbeast)"""
    rmsprop_eps: float = 0.01
    """RMSProp epsilon, added OUTSIDE the sqrt in PyTorch (TF/IMPALA: inside); torchbeast uses 0.01 as is"""
    max_grad_norm: float = 40.0
    """global gradient-norm clip (IMPALA Table G.1)"""
    torso: Literal["auto", "nature", "resnet", "minigrid", "minatar"] = "auto"
    """nature (Nature DQN CNN) | resnet (IMPALA deep) | minatar (MinAtar's) | minigrid (small CNN) | auto (by env)"""
    sticky_action_prob: float | None = None
    """sticky-action probability; None = per family: 0 on Atari (IMPALA/CLEAR used none), 0.1 on MinAtar (its own)"""
    max_episode_frames: int = 108_000
    """Atari episode cap in emulator frames (truncation, bootstrapped)"""
    checkpoint_replay: bool = False
    """each actor also saves its buffer next to checkpoint.pt (replay_actor{i}.npz); --resume restores those found"""
    minigrid_max_steps: int | None = None
    """override MiniGrid's episode limit (a truncation: see --bootstrap-truncation)"""
    bootstrap_truncation: bool | None = None
    """time limit: bootstrap from V_mu(true last obs) (Pardo et al. 2018) or terminate (IMPALA); None: MiniGrid terminates"""
    test_actor_max_sps: float = 0.0
    """cap on each test actor's steps/s (0 = none; keeps CPU for training on small machines; not in the paper)"""
    log_every_seconds: float = 5.0
    """how often the learner writes metrics and the progress line"""


# ENVIRONMENTS
def env_kind(env_id: str) -> str:
    from common.atari_env import ATARI_ENV_IDS

    if env_id in ATARI_ENV_IDS:
        return "atari"
    if env_id in MINATAR_ENV_IDS:
        return "minatar"
    from common.minigrid_env import resolve_minigrid_id

    try:
        resolve_minigrid_id(env_id)
        return "minigrid"
    except ValueError:
        raise ValueError(
            f"unknown env id {env_id!r}: use ALE Atari ids (e.g. ALE/Pong-v5), MinAtar ids (e.g. "
            f"MinAtar/Breakout-v0) or MiniGrid ids (e.g. MiniGrid-DoorKey-5x5-v0)"
        ) from None


def make_env(env_id: str, seed: int, args: Args, capture_video: bool = False, video_folder: str | None = None):
    """One gymnasium env; info["episode"]["r"] holds the real return on the step an episode (Atari: game) ends."""
    import gymnasium as gym

    kind = env_kind(env_id)
    if kind == "atari":
        # The full 18-action space, so one policy head serves every game (IMPALA multi-task, CLEAR Sec. 4.6); a lost
        # life ends the learning episode but not the game (IMPALA Table G.1).
        from common.atari_env import make_atari_env

        return make_atari_env(
            env_id,
            seed,
            full_action_space=True,
            terminal_on_life_loss=True,
            clip_rewards=True,
            sticky_action_prob=args.sticky_action_prob or 0.0,
            capture_video=capture_video,
            max_episode_frames=args.max_episode_frames,
            video_folder=video_folder,
        )
    if kind == "minatar":
        # Channels padded to 10: one network reads every game (the analogue of CLEAR Sec. 4.6).
        sticky = 0.1 if args.sticky_action_prob is None else args.sticky_action_prob
        return make_minatar_env(env_id, seed, pad_channels=MINATAR_MAX_CHANNELS, sticky_action_prob=sticky)
    from common.minigrid_env import make_minigrid_env

    render_mode = "rgb_array" if capture_video else None
    env = make_minigrid_env(env_id, fully_observable=False, max_steps=args.minigrid_max_steps, render_mode=render_mode)
    if capture_video:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda i: i % 20 == 0)
    # info["episode"]["r"] on terminated or truncated
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env.action_space.seed(seed)
    return env


# NETWORK
def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


def conv_sequence(in_channels, out_channels) -> nn.Sequential:
    """IMPALA ResNet stage: conv 3x3, max-pool 3x3/2, two residual blocks (IMPALA Fig. 3 right)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.MaxPool2d(3, stride=2, padding=1),
        ResidualBlock(out_channels),
        ResidualBlock(out_channels),
    )


def make_torso(torso: str, obs_shape: tuple[int, ...]) -> tuple[nn.Module, int]:
    """The convolutional torso named `torso` followed by one hidden layer; returns (torso, hidden units)."""
    if torso == "minigrid":
        # MiniGrid observations are HWC: the network reads CHW
        in_shape = (obs_shape[-1], *obs_shape[:-1])
    else:
        in_shape = obs_shape
    channels = in_shape[0]
    if torso == "nature":
        # the Nature DQN CNN (Mnih et al. 2015) as monobeast's AtariNet, without its LSTM
        conv = nn.Sequential(
            layer_init(nn.Conv2d(channels, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        hidden = 512
    elif torso == "resnet":
        # IMPALA "deep": channels 16/32/32, FC 256
        conv = nn.Sequential(
            conv_sequence(channels, 16), conv_sequence(16, 32), conv_sequence(32, 32), nn.Flatten(), nn.ReLU()
        )
        hidden = 256
    elif torso == "minatar":
        # MinAtar's network (Young & Tian 2019): one 3x3 conv with 16 channels, 128 units
        conv = nn.Sequential(layer_init(nn.Conv2d(channels, 16, 3)), nn.ReLU(), nn.Flatten())
        hidden = 128
    else:
        # minigrid: the 7x7x3 egocentric view (object, colour, state indices), our choice
        conv = nn.Sequential(
            layer_init(nn.Conv2d(channels, 16, 2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(16, 32, 2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 2)),
            nn.ReLU(),
            nn.Flatten(),
        )
        hidden = 256
    with torch.no_grad():
        conv_features = conv(torch.zeros(1, *in_shape)).shape[1]
    return nn.Sequential(conv, layer_init(nn.Linear(conv_features, hidden)), nn.ReLU()), hidden


class Agent(nn.Module):
    """Shared torso, one policy head over the full action space and one value head shared by all tasks."""

    def __init__(self, obs_shape, num_actions, torso):
        super().__init__()
        self.torso_name = torso
        self.torso, hidden = make_torso(torso, obs_shape)
        self.policy = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.baseline = layer_init(nn.Linear(hidden, 1), std=1.0)
        # the learner updates these weights have had: it travels with them (publish_weights, read_weights), so an
        # actor records the version of the weights it acted with (SlotInfo.policy_version)
        self.register_buffer("version", torch.zeros((), dtype=torch.int64))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs: uint8 [N, *obs_shape] -> (logits [N, A], value [N])."""
        x = obs.float()
        if self.torso_name == "minigrid":
            # MiniGrid indices are <= 10
            x = x.permute(0, 3, 1, 2) / 10.0
        elif self.torso_name != "minatar":
            # pixels; MinAtar observations are already 0/1
            x = x / 255.0
        features = self.torso(x)
        return self.policy(features), self.baseline(features).squeeze(-1)


# ALGORITHM PIECES
class VTraceReturns(NamedTuple):
    """What `vtrace_from_importance_weights` returns, time-major."""

    vs: torch.Tensor  # v_s [T, B]
    pg_advantages: torch.Tensor  # rho_s (r_s + gamma v_{s+1} - V(x_s)) [T, B]


@torch.no_grad()
def vtrace_from_importance_weights(
    log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0
) -> VTraceReturns:
    """V-trace targets v_s and policy-gradient advantages, time-major [T, B] (IMPALA Eq. (1), CLEAR Sec. 3).
    log_rhos[t] = log pi(a_t|x_t) - log mu(a_t|x_t); discounts[t] = gamma * (1 - done_t) (0 cuts the trace at an
    episode end); values[t] = V(x_t); bootstrap_value = V(x_T); a None clip threshold means no clipping.
    Eq. (1) is computed as its backward recursion over time (IMPALA Remark 1), as torchbeast's vtrace.py does:
        v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})),  v_T - V(x_T) = 0.
    Oracle: tests/test_clear_oracles.py::test_vtrace_matches_textbook (also ::test_vtrace_torchbeast_fixed_inputs,
    ::test_vtrace_rlax_reference_numbers, ::test_vtrace_no_value_leaks_across_episode_end)."""
    if bootstrap_value.shape != values.shape[1:]:
        raise ValueError(
            f"bootstrap_value shape {tuple(bootstrap_value.shape)} must be values.shape[1:] {tuple(values.shape[1:])}"
        )
    rhos = torch.exp(log_rhos)
    # rho_t = min(rho_bar, pi/mu)
    clipped_rhos = rhos if clip_rho_threshold is None else torch.clamp(rhos, max=clip_rho_threshold)
    # c_t = min(c_bar, pi/mu) with c_bar = 1 (IMPALA Sec. 4.1)
    cs = torch.clamp(rhos, max=1.0)
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    # delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    # acc holds v_{t+1} - V(x_{t+1}) on entry and v_t - V(x_t) after the update
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = []
    for t in reversed(range(log_rhos.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v.append(acc)
    vs = torch.stack(vs_minus_v[::-1]) + values
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    # rho_bar_pg clips the weight of the policy-gradient advantage rho_s (r_s + gamma v_{s+1} - V(x_s))
    clipped_pg_rhos = rhos if clip_pg_rho_threshold is None else torch.clamp(rhos, max=clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


UNROLL_FIELDS = ("obs", "action", "reward", "done", "truncated", "final_value", "logits", "baseline")


def unroll_specs(obs_shape, num_actions, T) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Row t = 0..T of an unroll holds x_t and what produced it: (x_t, a_{t-1}, r_{t-1}, done_{t-1}, truncated_{t-1},
    V_mu(final obs of a truncated episode), mu(.|x_{t-1}) logits, V_mu(x_{t-1})); row 0 repeats the previous unroll's
    row T (monobeast's layout). Observations are uint8."""
    rows = T + 1
    return {
        "obs": ((rows, *obs_shape), np.uint8),
        "action": ((rows,), np.int64),
        "reward": ((rows,), np.float32),
        "done": ((rows,), np.bool_),
        "truncated": ((rows,), np.bool_),
        "final_value": ((rows,), np.float32),
        "logits": ((rows, num_actions), np.float32),
        "baseline": ((rows,), np.float32),
    }


class SlotInfo(NamedTuple):
    """What the pair in each slot is, one int64 entry per slot (shared memory in a run): the actor writes it with the
    pair, the learner reads it when it takes the pair."""

    task: torch.Tensor  # the task the new unroll was played on
    start_step: torch.Tensor  # the learner-counted step at which the new unroll started
    policy_version: torch.Tensor  # the version (learner updates) of the weights that played the new unroll
    replay_valid: torch.Tensor  # 1: the replay half holds a stored unroll
    replay_task: torch.Tensor  # the task the replay unroll was played on (-1: none)
    buffer_unrolls: torch.Tensor  # unrolls in the actor's reservoir buffer

    @classmethod
    def zeros(cls, num_slots: int) -> "SlotInfo":
        return cls(*(torch.zeros(num_slots, dtype=torch.int64) for _ in cls._fields))

    def select(self, slot_ids: list[int]) -> "SlotInfo":
        """A copy of the entries of slots `slot_ids`, in that order."""
        slot_index = torch.tensor(slot_ids)
        return SlotInfo(*(entries[slot_index].clone() for entries in self))


class ReservoirBuffer:
    """One actor's replay memory of whole unrolls, filled by reservoir sampling (CLEAR App. A.3, Isele & Cosgun 2018).
    Each unroll gets a random key u ~ U(0, 1); the buffer keeps the `capacity` largest keys seen so far, i.e. the
    buffer is at any time a uniform sample without replacement of all unrolls offered. Actions are stored as int16.
    Oracle: tests/test_clear_oracles.py::test_reservoir_keeps_a_uniform_sample (also
    ::test_reservoir_stores_whole_unrolls_only, ::test_reservoir_fills_before_replacing)."""

    def __init__(self, capacity, obs_shape, num_actions, T, rng: np.random.Generator):
        self.capacity = capacity
        self.rng = rng
        self.size = 0
        self.num_seen = 0
        # np.zeros memory is committed lazily by the OS, as the buffer fills
        self.data = {
            k: np.zeros((capacity, *shape), dtype=np.int16 if k == "action" else dtype)
            for k, (shape, dtype) in unroll_specs(obs_shape, num_actions, T).items()
        }
        self.task = np.zeros(capacity, dtype=np.int16)
        # key -1: an empty row
        self.keys = np.full(capacity, -1.0)

    @staticmethod
    def bytes_per_unroll(obs_shape, num_actions, T) -> int:
        specs = unroll_specs(obs_shape, num_actions, T)
        field_bytes = sum(
            int(np.prod(shape)) * (2 if k == "action" else np.dtype(dtype).itemsize) for k, (shape, dtype) in specs.items()
        )
        # the int16 task id and the float64 key
        return field_bytes + 2 + 8

    def add(self, unroll: dict, task: int) -> int:
        """Offer one unroll; returns the row it went to, or -1 if it was discarded."""
        self.num_seen += 1
        key = self.rng.random()
        if self.size < self.capacity:
            row = self.size
            self.size += 1
        else:
            # the row of the smallest key: the current threshold
            row = int(np.argmin(self.keys))
            if key <= self.keys[row]:
                return -1
        for k, v in unroll.items():
            self.data[k][row] = v
        self.task[row] = task
        self.keys[row] = key
        return row

    def sample(self) -> int:
        """A uniformly random stored row (the replay half of the next pair)."""
        return int(self.rng.integers(self.size))

    def save(self, path: str) -> None:
        size = self.size
        tmp = f"{path}.tmp.npz"
        # the keep/drop stream too: a resumed buffer continues it
        rng_state = json.dumps(self.rng.bit_generator.state)
        np.savez(
            tmp,
            keys=self.keys[:size],
            task=self.task[:size],
            num_seen=self.num_seen,
            rng_state=rng_state,
            **{k: v[:size] for k, v in self.data.items()},
        )
        os.replace(tmp, path)

    @staticmethod
    def saved_counts(path: str) -> tuple[int, int]:
        """(unrolls held, unrolls offered) of the buffer saved at `path`, without reading its unrolls."""
        with np.load(path) as saved:
            return len(saved["keys"]), int(saved["num_seen"])

    def load(self, path: str) -> int:
        """Restore a saved buffer and its RNG; returns its size. Smaller now: the rows with the largest keys, still a
        uniform sample. Larger now: only if it never dropped an unroll (it then continues exactly as a buffer of this
        capacity would). A reservoir that has dropped unrolls cannot grow and stay uniform: the larger sample of all
        unrolls offered would hold some of those it dropped. Keeping every new unroll while it refills favours them;
        keeping only keys above its smallest disfavours them until it is full (each new unroll is kept with
        probability k / (n + 1) against k / n for each of the n it had seen).
        Oracle: tests/test_clear_oracles.py::test_reservoir_load_keeps_the_largest_keys_and_continues_its_stream (also
        ::test_a_restored_buffer_grows_only_while_it_has_dropped_nothing)."""
        held, offered = self.saved_counts(path)
        if self.capacity > held < offered:
            raise ValueError(
                f"{path} holds {held} of the {offered} unrolls it was offered: it cannot grow to {self.capacity} and stay "
                "a uniform sample"
            )
        with np.load(path) as saved:
            keep = np.argsort(-saved["keys"])[: self.capacity]
            self.size = len(keep)
            self.num_seen = int(saved["num_seen"])
            for k in self.data:
                self.data[k][: self.size] = saved[k][keep]
            self.task[: self.size] = saved["task"][keep]
            self.keys[: self.size] = saved["keys"][keep]
            self.rng.bit_generator.state = json.loads(str(saved["rng_state"]))
        return self.size


def buffer_capacity_per_actor(args: Args) -> int:
    """Unrolls per actor: --buffer-size steps split equally over the actors (CLEAR App. A.3), in whole unrolls.
    Oracle: tests/test_clear_oracles.py::test_buffer_capacity_split_over_actors."""
    if args.replay_fraction == 0 and args.buffer_size <= 0:
        # plain IMPALA: no buffer at all
        return 0
    steps = args.buffer_size if args.buffer_size > 0 else total_steps(args) // 2
    return max(1, steps // (args.num_actors * args.unroll_length))


def select_pairs(replay_valid: np.ndarray, replay_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Which half of each (new, replay) pair the learner trains on: 1 = replay, 0 = new (CLEAR App. A.1). Exactly
    floor or ceil of ratio * B replay unrolls (stochastic rounding: the expected fraction is the ratio), at random
    positions among the pairs that hold a valid replay unroll.
    Oracle: tests/test_clear_oracles.py::test_select_pairs_honours_replay_fraction (also
    ::test_select_pairs_never_takes_invalid_replay, ::test_select_pairs_spreads_positions)."""
    halves = np.zeros(len(replay_valid), dtype=np.int64)
    if replay_fraction <= 0:
        return halves
    target = replay_fraction * len(replay_valid)
    candidates = np.flatnonzero(replay_valid)
    rounded_target = int(np.floor(target)) + int(rng.random() < target - np.floor(target))
    num_replay = min(rounded_target, len(candidates))
    halves[rng.choice(candidates, size=num_replay, replace=False)] = 1
    return halves


class AlignedUnroll(NamedTuple):
    """Learner outputs and stored data lined up on the same time index t = 0..T-1 (the state x_t)."""

    target_logits: torch.Tensor  # pi(.|x_t) [T, B, A]
    values: torch.Tensor  # V_theta(x_t) [T, B]
    bootstrap_value: torch.Tensor  # V_theta(x_T) [B]
    behaviour_logits: torch.Tensor  # mu(.|x_t) [T, B, A]
    behaviour_values: torch.Tensor  # V_mu(x_t) [T, B]
    actions: torch.Tensor  # a_t
    rewards: torch.Tensor  # r_t
    done: torch.Tensor  # episode ended by a_t (terminated or truncated)
    truncated: torch.Tensor  # ended by a time limit
    final_value: torch.Tensor  # V_mu(x_final) of a truncated episode


def align_unroll(logits_all, values_all, batch) -> AlignedUnroll:
    """Learner outputs on rows 0..T against stored rows 1..T (monobeast's shift). Stored row t+1 holds mu(.|x_t) and
    V_mu(x_t), so BOTH V-trace and behavioural cloning compare the learner's outputs at row t with the stored behaviour
    at row t+1. Oracle: tests/test_clear_oracles.py::test_cloning_is_time_aligned_with_learner_outputs."""
    return AlignedUnroll(
        target_logits=logits_all[:-1],
        values=values_all[:-1],
        bootstrap_value=values_all[-1],
        behaviour_logits=batch["logits"][1:],
        behaviour_values=batch["baseline"][1:],
        actions=batch["action"][1:],
        rewards=batch["reward"][1:],
        done=batch["done"][1:],
        truncated=batch["truncated"][1:],
        final_value=batch["final_value"][1:],
    )


@torch.no_grad()
def truncated_importance_weights(unroll: AlignedUnroll) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho_t, mu_t) [T, B]: V-trace's weight min(1, pi(a_t|x_t) / mu(a_t|x_t)) and mu(a_t|x_t) of the stored action.
    A diagnostic per replayed task: rho_t near 0 on steps mu was sure of means replay no longer teaches them.
    Oracle: tests/test_clear_oracles.py::test_truncated_importance_weights_are_min_one_pi_over_mu_of_the_taken_action."""
    taken = unroll.actions.unsqueeze(-1)
    log_pi = F.log_softmax(unroll.target_logits, -1).gather(-1, taken).squeeze(-1)
    log_mu = F.log_softmax(unroll.behaviour_logits, -1).gather(-1, taken).squeeze(-1)
    return torch.exp(log_pi - log_mu).clamp(max=1.0), log_mu.exp()


def policy_cloning_loss(target_logits, behaviour_logits, replay_mask) -> torch.Tensor:
    """CLEAR Sec. 3: L_policy-cloning = sum_a mu(a|x_s) log(mu(a|x_s) / pi_theta(a|x_s)) = KL(mu || pi_theta), summed
    over time and the replay columns (replay_mask [B], 1 = replay unroll) only.
    Oracle: tests/test_clear_oracles.py::test_cloning_losses_zero_when_policy_equals_behaviour (also
    ::test_cloning_only_on_replay_columns,
    tests/test_clear_wiring.py::test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop)."""
    log_mu = F.log_softmax(behaviour_logits, dim=-1)
    log_pi = F.log_softmax(target_logits, dim=-1)
    kl = (log_mu.exp() * (log_mu - log_pi)).sum(-1)  # [T, B]
    return (kl * replay_mask).sum()


def value_cloning_loss(values, behaviour_values, replay_mask) -> torch.Tensor:
    """CLEAR Sec. 3: L_value-cloning = ||V_theta(x_s) - V_replay(x_s)||_2^2, summed over time and replay columns.
    Oracle: tests/test_clear_oracles.py::test_cloning_losses_zero_when_policy_equals_behaviour (also
    ::test_cloning_only_on_replay_columns)."""
    return (((values - behaviour_values) ** 2) * replay_mask).sum()


def impala_losses(unroll: AlignedUnroll, gamma, clip_rho_threshold, clip_pg_rho_threshold, bootstrap_truncation=True):
    """V-trace losses (CLEAR Sec. 3) on an aligned batch; returns (pg_loss, value_loss, entropy_loss, vtrace returns).
    Sums over [T, B] as in scalable_agent/torchbeast. bootstrap_truncation=False treats a time limit as a termination.
    Oracle:
    tests/test_clear_wiring.py::test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop (also
    tests/test_clear_oracles.py::test_truncation_bootstraps_from_final_value_and_termination_does_not)."""
    log_pi = F.log_softmax(unroll.target_logits, dim=-1)
    taken = unroll.actions.unsqueeze(-1)
    target_logp = log_pi.gather(-1, taken).squeeze(-1)
    behaviour_logp = F.log_softmax(unroll.behaviour_logits, dim=-1).gather(-1, taken).squeeze(-1)
    # an episode end (either kind) cuts the trace
    discounts = gamma * (~unroll.done).float()
    # a truncation bootstraps from V_mu of the true last obs (unless bootstrap_truncation=False)
    if bootstrap_truncation:
        rewards = unroll.rewards + gamma * unroll.truncated.float() * unroll.final_value
    else:
        rewards = unroll.rewards
    vtrace_returns = vtrace_from_importance_weights(
        (target_logp - behaviour_logp).detach(),
        discounts,
        rewards,
        unroll.values.detach(),
        unroll.bootstrap_value.detach(),
        clip_rho_threshold,
        clip_pg_rho_threshold,
    )
    # L_policy-gradient = -rho_s log pi(a_s|x_s) (r_s + gamma v_{s+1} - V(x_s))
    pg_loss = -(target_logp * vtrace_returns.pg_advantages).sum()
    # L_value = (V_theta(x_s) - v_s)^2, times 1/2 as in scalable_agent
    value_loss = 0.5 * ((vtrace_returns.vs - unroll.values) ** 2).sum()
    # L_entropy = sum_a pi log pi: minimising it raises the entropy
    entropy_loss = (log_pi.exp() * log_pi).sum()
    return pg_loss, value_loss, entropy_loss, vtrace_returns


def clear_loss(logits_all, values_all, batch, replay_mask, args: Args):
    """(loss, detached parts) of one batch: V-trace losses on all unrolls, cloning on the replay unrolls only.
    Oracle:
    tests/test_clear_wiring.py::test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop (also
    tests/test_clear_oracles.py::test_behaviour_cloning_flag_changes_total_loss_only_via_cloning)."""
    unroll = align_unroll(logits_all, values_all, batch)
    pg_loss, value_loss, entropy_loss, _ = impala_losses(
        unroll, args.gamma, args.clip_rho_threshold, args.clip_pg_rho_threshold, args.bootstrap_truncation
    )
    pc_loss = policy_cloning_loss(unroll.target_logits, unroll.behaviour_logits, replay_mask)
    vc_loss = value_cloning_loss(unroll.values, unroll.behaviour_values, replay_mask)
    loss = args.pg_cost * pg_loss + args.baseline_cost * value_loss + args.entropy_cost * entropy_loss
    if args.behavior_cloning:
        loss = loss + args.policy_cloning_cost * pc_loss + args.value_cloning_cost * vc_loss
    mean_entropy = -entropy_loss / unroll.actions.numel()
    parts = {
        "losses/pg_loss": pg_loss,
        "losses/value_loss": value_loss,
        "losses/entropy": mean_entropy,
        "losses/policy_cloning_loss": pc_loss,
        "losses/value_cloning_loss": vc_loss,
        "losses/total_loss": loss,
    }
    return loss, {k: v.detach() for k, v in parts.items()}


def wait_for_pairs(full_queue, batch_size: int, processes: ProcessGroup) -> list[int]:
    """The ids of the next `batch_size` slots whose pairs are ready on one network's queue, in the order they came;
    a dead actor stops the run with its traceback meanwhile."""
    slot_ids = []
    while len(slot_ids) < batch_size:
        if full_queue.empty():
            processes.check()
            time.sleep(0.002)
            continue
        slot_ids.append(full_queue.get())
    return slot_ids


def take_batch(slots: dict, slot_ids: list[int], halves: torch.Tensor) -> dict:
    """The learner's copy of its batch out of the shared-memory slots (CLEAR App. A.1): half `halves[j]` (1 = replay) of
    the pair in slot slot_ids[j]; returns the batch [T+1, B, ...]. Copy before `release_slots`: an actor writes its
    next unroll into its slot the moment the slot is free.
    Oracle: tests/test_clear_wiring.py::test_take_batch_copies_the_slots_before_an_actor_can_overwrite_them."""
    slot_index = torch.tensor(slot_ids)
    return {k: v[slot_index, halves].transpose(0, 1).contiguous() for k, v in slots.items()}


def release_slots(slot_ids: list[int], slot_free, global_step, unroll_length: int) -> None:
    """The end of the hand-off, once the batch is copied (`take_batch`): count the batch's steps of new experience
    (every pair carries one new unroll), then free its slots. Count before freeing: the actor's next unroll then
    starts at the updated step (the task switch, App. A.6).
    Oracle: tests/test_clear_wiring.py::test_take_batch_copies_the_slots_before_an_actor_can_overwrite_them."""
    global_step.value += len(slot_ids) * unroll_length
    for slot in slot_ids:
        slot_free[slot].release()


class BatchLoss(NamedTuple):
    """What `learner_loss` returns for one batch."""

    loss: torch.Tensor  # the weighted CLEAR loss, differentiable
    parts: dict[str, torch.Tensor]  # its terms, detached, by metric name (clear_loss)
    unroll: AlignedUnroll  # the learner's outputs lined up with the batch (the rho_t diagnostic reads them)


def learner_loss(model, batch: dict, halves: torch.Tensor, args: Args, device) -> BatchLoss:
    """The CLEAR loss of one batch from `take_batch` (halves[j] = 1: column j is a replay unroll), the learner's network
    run once over its T+1 rows.
    Oracle:
    tests/test_clear_wiring.py::test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop."""
    num_rows, B = batch["action"].shape
    logits_all, values_all = model(batch["obs"].to(device).flatten(0, 1))
    logits_all = logits_all.view(num_rows, B, -1)
    values_all = values_all.view(num_rows, B)
    # the batch's other fields: align_unroll reads them on the device
    device_batch = {k: v.to(device) for k, v in batch.items() if k != "obs"}
    loss, parts = clear_loss(logits_all, values_all, device_batch, halves.float().to(device), args)
    return BatchLoss(loss, parts, align_unroll(logits_all, values_all, device_batch))


def annealed_learning_rate(step: int, end_step: int, args: Args) -> float:
    """The lr of a batch taken at learner-counted step `step`: lr_0 (1 - step / end_step), linear to 0 over the run's
    steps of new experience (IMPALA Table G.1; torchbeast's lr_lambda counts them too, as frames). A function of the
    step, so a run resumed with another --learning-rate, --num-cycles or --batch-size continues on the schedule they
    define. Oracle: tests/test_clear_loop.py::test_one_learner_step_is_the_textbook_update_and_publishes_it."""
    return args.learning_rate * (1.0 - min(step, end_step) / end_step)


class SharedWeights(NamedTuple):
    """A network as the actors read it: a CPU copy in shared memory and its seqlock. `sequence` counts the learner's
    writes into the copy, twice each: odd while a write is under way, even when the copy is whole."""

    model: "Agent"
    sequence: torch.Tensor  # int64, shared

    @classmethod
    def share(cls, model: "Agent") -> "SharedWeights":
        """`model` (on the CPU) and a new sequence, moved to shared memory."""
        return cls(model.share_memory(), torch.zeros((), dtype=torch.int64).share_memory_())


def publish_weights(model, shared: SharedWeights) -> None:
    """The learner's write of `model` (its version included) into the actors' copy, as a seqlock's writer: the
    sequence turns odd before the first tensor is written and even after the last, so a reader can tell a copy it took
    during a write. (Each process's stores, and its loads, stay in program order on x86-64.)
    Oracle:
    tests/test_clear_loop.py::test_every_copy_read_while_the_learner_publishes_in_a_tight_loop_is_one_published_version."""
    shared.sequence.add_(1)
    shared.model.load_state_dict(model.state_dict())
    shared.sequence.add_(1)


def read_weights(model, shared: SharedWeights) -> int:
    """An actor's copy of the shared weights into `model`, as a seqlock's reader; returns their version. A copy is
    kept only if the sequence was even before it and unchanged after it (no write began or ran during it); else it
    is taken again. So the weights and the version are one published state, never parts of two.
    Oracle: tests/test_clear_loop.py::test_an_actor_retries_a_copy_the_learner_published_into."""
    while True:
        sequence_before = int(shared.sequence)
        if sequence_before % 2 == 0:
            model.load_state_dict(shared.model.state_dict())
            if int(shared.sequence) == sequence_before:
                return int(model.version)
        # the learner is writing: its copy takes a few milliseconds at most
        time.sleep(0.0001)


class LearnerUpdate(NamedTuple):
    """What `learner_step` returns: the batch's loss terms and what the loop logs of the update."""

    parts: dict[str, torch.Tensor]  # the loss terms, detached (clear_loss)
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    unroll: AlignedUnroll  # the learner's outputs (before the update) lined up with the batch


def learner_step(
    model, optimizer, shared: SharedWeights, batch: dict, halves: torch.Tensor, learning_rate: float, args: Args, device
) -> LearnerUpdate:
    """One update (IMPALA's learner, torchbeast's learn()): the gradient of this batch's CLEAR loss alone, clipped to a
    global norm of --max-grad-norm, one RMSProp step with `learning_rate` and the flags' alpha and eps; then the new
    weights and their version go to the actors' shared copy (publish_weights).
    Oracle: tests/test_clear_loop.py::test_one_learner_step_is_the_textbook_update_and_publishes_it."""
    # the optimizer's settings come from the flags at every step (a resumed run applies new ones)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
        group["alpha"] = args.rmsprop_alpha
        group["eps"] = args.rmsprop_eps
    batch_loss = learner_loss(model, batch, halves, args, device)
    optimizer.zero_grad()
    batch_loss.loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    model.version += 1
    publish_weights(model, shared)
    return LearnerUpdate(batch_loss.parts, grad_norm, batch_loss.unroll)


def total_steps(args: Args) -> int:
    """The run's steps of new experience: every task visited --num-cycles times (CLEAR App. A.6)."""
    return args.steps_per_task * len(args.env_ids) * args.num_cycles


def task_for_actor(slot: int, step: int, args: Args) -> int:
    """The task of actor `slot` (env e of process p) for an unroll that starts at learner-counted step `step` (CLEAR
    App. A.6: all actors switch at the same step). With n tasks: sequential: (step // steps_per_task) mod n, the last
    task after the end; simultaneous: slot mod n (tasks mix in every process and batch); separate: p mod n (one
    network per task).
    Oracle: tests/test_clear_oracles.py::test_task_switch_at_designated_step_for_all_actors (also
    tests/test_clear_wiring.py::test_actor_loop_plays_the_task_and_network_each_mode_assigns)."""
    num_tasks = len(args.env_ids)
    if args.mode == "sequential":
        return min(step // args.steps_per_task, num_tasks * args.num_cycles - 1) % num_tasks
    if args.mode == "simultaneous":
        return slot % num_tasks
    process = slot // args.envs_per_actor
    return process % num_tasks


def net_for_task(task: int, args: Args) -> int:
    return task if args.mode == "separate" else 0


def count_task_mismatches(slot_ids: list[int], batch_info: SlotInfo, net: int, args: Args) -> int:
    """The unrolls of a batch not on the task their start step designates (App. A.6) or not of network `net`'s task:
    0 in a correct run (charts/task_mismatch)."""
    mismatches = 0
    for slot, task, unroll_start in zip(slot_ids, batch_info.task.tolist(), batch_info.start_step.tolist()):
        mismatches += task != task_for_actor(slot, unroll_start, args) or net_for_task(task, args) != net
    return mismatches


def binned_returns(records, task: int, total: int, num_bins: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(bin end steps, mean test return of one task's episodes that ended in each of `num_bins` equal bins of [0, total]),
    forward-filled over empty bins (leading ones dropped). Averaging per bin, not per episode, keeps short (often
    successful or often failed) episodes from dominating. Bin k holds the steps in [k total / n, (k + 1) total / n),
    the last one also `total`, computed exactly (integer steps).
    Oracle: tests/test_clear_oracles.py::test_cumulative_and_binned_returns_equal_the_textbook_time_average."""
    steps = np.array([step for step, record_task, _ in records if record_task == task], dtype=float)
    returns = np.array([ret for _, record_task, ret in records if record_task == task], dtype=float)
    total = max(total, 1)
    edges = np.linspace(0, total, num_bins + 1)
    bins = np.clip((steps * num_bins) // total, 0, num_bins - 1).astype(np.int64)
    counts = np.bincount(bins, minlength=num_bins)
    means = np.bincount(bins, returns, minlength=num_bins) / np.maximum(counts, 1)
    # forward fill: each bin points at the last non-empty bin at or before it (-1: none yet)
    last_filled = np.maximum.accumulate(np.where(counts > 0, np.arange(num_bins), -1))
    return edges[1:][last_filled >= 0], means[last_filled[last_filled >= 0]]


def cumulative_returns(
    records: list[tuple[int, int, float]], num_tasks: int, total: int, num_bins: int = 100
) -> dict[int, float]:
    """Final cumulative reward per task (CLEAR App. C, Figs. 8 and 13): (1/t) sum_{s<t} r_s at the end of training, i.e.
    the time average of the task's test return over the run (on the `binned_returns` grid).
    Oracle: tests/test_clear_oracles.py::test_cumulative_and_binned_returns_equal_the_textbook_time_average (also
    ::test_cumulative_returns_are_time_averages)."""
    binned = [binned_returns(records, task, total, num_bins)[1] for task in range(num_tasks)]
    return {task: float(means.mean()) if len(means) else float("nan") for task, means in enumerate(binned)}


# ACTOR PROCESSES (module-level so spawn can pickle them)
def actor_seed(base_seed: int, args: Args, resume_step: int) -> int:
    """The seed of an actor's streams (actions, reservoir keep/drop draws, env seeds): `base_seed` in a new run; in a
    run started with --resume, a seed drawn from `base_seed` and the checkpoint's step, so that the first run's
    streams are not repeated (a restored buffer brings back its own keep/drop stream)."""
    if not args.resume:
        return base_seed
    return resumed_seed(base_seed, resume_step)


class ActorHandles(NamedTuple):
    """What the learner shares with every training actor process, in one picklable bundle."""

    shared_weights: list[SharedWeights]  # the networks the actors read (one per task with --mode separate)
    slots: dict  # field -> shared tensor [num_envs, 2 (new, replay), T+1, ...] (unroll_specs)
    slot_info: SlotInfo  # what each slot's pair is, shared
    full_queues: list  # one per network: ids of the slots whose pair is ready
    slot_free: list  # one semaphore per slot, released when the learner has copied its pair
    global_step: Any  # learner-counted steps of new experience (its only writer: the learner)
    resume_step: int  # the checkpoint's step in a run started with --resume (else 0)
    steps_done: Any  # agent steps played, one counter per actor process (each its only writer)
    stop: Any  # event: the run is stopping
    stats_queue: Any  # (task, return, length) of each finished training episode
    checkpoint_request: Any  # bumped at each checkpoint: actors then save their buffers
    run_dir: str


class ActorSlots(NamedTuple):
    """The slots of one actor process, one per env (actor_id * envs_per_actor + e): numpy views into shared memory."""

    ids: list[int]  # the slot of each env
    span: slice  # the same slots, as SlotInfo's index
    new: dict  # field -> [envs_per_actor, T+1, ...]: the new half of each slot's pair
    replay: dict  # field -> [envs_per_actor, T+1, ...]: the replay half

    @classmethod
    def of(cls, handles: ActorHandles, actor_id: int, envs_per_actor: int) -> "ActorSlots":
        first_slot = actor_id * envs_per_actor
        span = slice(first_slot, first_slot + envs_per_actor)
        return cls(
            ids=list(range(first_slot, first_slot + envs_per_actor)),
            span=span,
            new={k: handles.slots[k][span, 0].numpy() for k in UNROLL_FIELDS},
            replay={k: handles.slots[k][span, 1].numpy() for k in UNROLL_FIELDS},
        )


def publish_pairs(
    handles: ActorHandles, slots: ActorSlots, buffer, tasks: list[int], start_step: int, version: int, args: Args
) -> None:
    """CLEAR's step at the actors (Sec. 3; App. A.1 and A.3), once each env's new unroll is in its slot: add the new
    unrolls to the process's reservoir buffer, draw a stored unroll uniformly from the buffer as each replay half,
    and publish every (new, replay) pair: its SlotInfo, then its slot id on its network's queue. All new unrolls are
    added before the first draw (the buffer's stream in that order); without a buffer (--replay-fraction 0 and no
    --buffer-size) no pair holds a replay half.
    Oracle:
    tests/test_clear_wiring.py::test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop."""
    slot_info = handles.slot_info
    slot_info.task[slots.span] = torch.tensor(tasks)
    slot_info.start_step[slots.span] = start_step
    slot_info.policy_version[slots.span] = version
    if buffer is None:
        slot_info.replay_valid[slots.span] = 0
        slot_info.replay_task[slots.span] = -1
        slot_info.buffer_unrolls[slots.span] = 0
    else:
        # reservoir add (App. A.3)
        for e, task in enumerate(tasks):
            buffer.add({k: v[e] for k, v in slots.new.items()}, task)
        # replay draw: one stored unroll per env, uniformly (App. A.1)
        rows = [buffer.sample() for _ in tasks]
        for k in UNROLL_FIELDS:
            slots.replay[k][:] = buffer.data[k][rows]
        slot_info.replay_valid[slots.span] = 1
        slot_info.replay_task[slots.span] = torch.from_numpy(buffer.task[rows])
        slot_info.buffer_unrolls[slots.span] = buffer.size
    for slot, task in zip(slots.ids, tasks):
        handles.full_queues[net_for_task(task, args)].put(slot)


def actor_loop(actor_id, args: Args, obs_shape, num_actions, handles: ActorHandles):
    """One actor process: --envs-per-actor envs stepped in lock-step, one batched forward of the latest weights.
    Each env is an actor of the paper (CLEAR App. A.1): per unroll it adds its new unroll to the process's reservoir,
    samples a replay unroll, publishes the pair in its slot (actor_id * envs_per_actor + e; publish_pairs) and waits
    until the learner has copied it."""
    envs_per_actor = args.envs_per_actor
    T = args.unroll_length
    seed = actor_seed(args.seed + 1000 * actor_id, args, handles.resume_step)
    capacity = buffer_capacity_per_actor(args)
    torch.manual_seed(seed)
    buffer = None
    if capacity > 0:
        buffer = ReservoirBuffer(capacity, obs_shape, num_actions, T, np.random.default_rng(seed))
    replay_file = f"replay_actor{actor_id}.npz"
    keep_replay = buffer is not None and args.checkpoint_replay
    # a resumed run's buffers were saved next to its checkpoint
    restore_path = os.path.join(os.path.dirname(args.resume or ""), replay_file)
    if keep_replay and args.resume and os.path.exists(restore_path):
        print(f"actor-{actor_id} restored {buffer.load(restore_path)} replay unrolls from {restore_path}", flush=True)
    saved_request = handles.checkpoint_request.value
    model = Agent(obs_shape, num_actions, resolve_torso(args, obs_shape))
    run_name = os.path.basename(handles.run_dir)
    our_slots = ActorSlots.of(handles, actor_id, envs_per_actor)
    slot_ids = our_slots.ids
    new_half = our_slots.new
    tasks = [-1] * envs_per_actor
    envs = [None] * envs_per_actor
    episodes = 0
    acquired = 0
    while not handles.stop.is_set():
        if acquired < envs_per_actor:
            # the learner has not copied all our last pairs yet
            acquired += handles.slot_free[slot_ids[acquired]].acquire(timeout=0.2)
            continue
        acquired = 0
        if keep_replay and handles.checkpoint_request.value != saved_request:
            # the learner wrote a checkpoint: save the buffer too
            saved_request = handles.checkpoint_request.value
            buffer.save(os.path.join(handles.run_dir, replay_file))
        start_step = handles.global_step.value
        for e, slot in enumerate(slot_ids):
            task = task_for_actor(slot, start_step, args)
            # CLEAR App. A.6: the task switches at the designated learner-counted step; the buffer persists
            switch = task != tasks[e]
            # row 0 repeats the previous unroll's last row (zeros in a new env)
            for k in UNROLL_FIELDS:
                new_half[k][e, 0] = 0 if switch else new_half[k][e, T]
            if switch:
                if envs[e] is not None:
                    envs[e].close()
                video = args.capture_video and actor_id == 0 and e == 0 and task == 0
                tasks[e] = task
                envs[e] = make_env(args.env_ids[task], seed + e, args, video, f"videos/{run_name}")
                # reset seeds distinct per env (a prime stride apart) and per task switch (the episodes played so far)
                new_half["obs"][e, 0] = envs[e].reset(seed=seed + 1_000_003 * e + episodes)[0]
        # the latest weights of our network and their version, one published state (with --mode separate all envs of
        # a process play one task, hence one network)
        version = read_weights(model, handles.shared_weights[net_for_task(tasks[0], args)])
        episodes += play_unroll(model, envs, tasks, new_half, args, handles.stats_queue)
        # our own counter: no lock a killed actor could leave held
        handles.steps_done[actor_id] += T * envs_per_actor
        publish_pairs(handles, our_slots, buffer, tasks, start_step, version, args)
    if keep_replay and handles.checkpoint_request.value != saved_request:
        # the final checkpoint came after our last unroll
        buffer.save(os.path.join(handles.run_dir, replay_file))
    for env in envs:
        if env is not None:
            env.close()


def play_unroll(model, envs, tasks, unroll: dict, args: Args, stats_queue) -> int:
    """Step every env T times, one batched forward of `model` per step, and write rows 1..T of `unroll` (numpy views
    [num_envs, T+1, ...] whose row 0 holds x_0); returns how many episodes ended."""
    episodes_ended = 0
    for t in range(args.unroll_length):
        # row t + 1 holds what acting on x_t produced (unroll_specs)
        row = t + 1
        with torch.no_grad():
            logits, value = model(torch.from_numpy(unroll["obs"][:, t]))
            actions = torch.multinomial(F.softmax(logits, -1), 1).squeeze(1)
        unroll["action"][:, row] = actions
        unroll["logits"][:, row] = logits
        unroll["baseline"][:, row] = value
        unroll["final_value"][:, row] = 0.0
        # env -> the final obs of an episode that a time limit ended, for V_mu(final obs)
        truncated_obs = {}
        for e, env in enumerate(envs):
            obs, reward, terminated, truncated, info = env.step(int(actions[e]))
            if args.bootstrap_truncation and truncated and not terminated:
                truncated_obs[e] = obs
            if "episode" in info:
                stats_queue.put((tasks[e], float(info["episode"]["r"]), int(info["episode"]["l"])))
            if terminated or truncated:
                episodes_ended += 1
                obs, _ = env.reset()
            unroll["obs"][e, row] = obs
            unroll["reward"][e, row] = reward
            unroll["done"][e, row] = terminated or truncated
            unroll["truncated"][e, row] = truncated and not terminated
        if truncated_obs:
            with torch.no_grad():
                _, final_values = model(torch.from_numpy(np.stack(list(truncated_obs.values()))))
            unroll["final_value"][list(truncated_obs), row] = final_values.numpy()
    return episodes_ended


def test_actor_loop(test_id, task, args: Args, obs_shape, num_actions, shared_weights, resume_step, stop, eval_queue):
    """A test actor (CLEAR App. A.5): plays its own task forever, sampling from pi of its task's latest weights; no
    buffer, never feeds the learner; reports each finished episode's return (Atari: the game's score).
    Oracle: tests/test_clear_loop.py::test_a_test_actor_samples_from_pi_of_its_tasks_latest_weights."""
    seed = actor_seed(args.seed + 1000 * (args.num_actors + test_id) + 17, args, resume_step)
    torch.manual_seed(seed)
    env = make_env(args.env_ids[task], seed, args)
    model = Agent(obs_shape, num_actions, resolve_torso(args, obs_shape))
    obs, _ = env.reset(seed=seed)
    steps = 0
    start_time = time.time()
    while not stop.is_set():
        if args.test_actor_max_sps > 0 and steps > args.test_actor_max_sps * (time.time() - start_time):
            time.sleep(0.01)
            continue
        if steps % args.unroll_length == 0:
            # refresh the weights as often as a training actor does
            read_weights(model, shared_weights[net_for_task(task, args)])
        with torch.no_grad():
            logits, _ = model(torch.from_numpy(np.asarray(obs)).unsqueeze(0))
            action = int(torch.multinomial(F.softmax(logits, -1), 1).item())
        obs, _, terminated, truncated, info = env.step(action)
        steps += 1
        if "episode" in info:
            eval_queue.put((task, float(info["episode"]["r"]), int(info["episode"]["l"])))
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()


# EVALUATION: the test episodes at the end of a run
def summarize_test_episodes(eval_records: list, eval_queue, step: int, args: Args, run_dir) -> dict:
    """The end of a run's test record: the test episodes still queued (they ended after the loop's last drain) join
    `eval_records` at the step reached, the whole history is written to eval_records.json
    (tests/benchmarks/clear_forgetting_table.py plots it), and the summary's test entries are computed from it:
    per task the cumulative return over the steps reached (an interrupted run: its measured part), the mean of the
    last 20 test returns and the number of test episodes.
    Oracle: tests/test_clear_oracles.py::test_the_summary_counts_the_test_episodes_still_queued_at_the_end."""
    eval_records += [(step, task, episode_return) for task, episode_return, _ in drain(eval_queue)]
    with open(os.path.join(run_dir, "eval_records.json"), "w") as f:
        json.dump(eval_records, f)
    cumulative = cumulative_returns(eval_records, len(args.env_ids), step)
    returns = {
        env_id: [episode_return for _, record_task, episode_return in eval_records if record_task == task]
        for task, env_id in enumerate(args.env_ids)
    }
    return {
        "final_cumulative_return": {env_id: cumulative[task] for task, env_id in enumerate(args.env_ids)},
        "final_return_last20": {
            env_id: float(np.mean(task_returns[-20:])) if task_returns else float("nan")
            for env_id, task_returns in returns.items()
        },
        "num_eval_episodes": {env_id: len(task_returns) for env_id, task_returns in returns.items()},
    }


# RUN PLUMBING: the resume classes, validation, start-up probes and checks, default resolution
# the flags a resumed run may not change (replay and tasks are per actor)
FIXED_ON_RESUME = (
    "env_ids",
    "steps_per_task",
    "mode",
    "torso",
    "num_actors",
    "envs_per_actor",
    "unroll_length",
    "replay_fraction",
    "buffer_size",
    "behavior_cloning",
    "sticky_action_prob",
    "max_episode_frames",
    "minigrid_max_steps",
    "bootstrap_truncation",
)
# flags a resumed run applies from its resumed step on (each is changed and read back by a resume test)
APPLIED_ON_RESUME = (
    "num_cycles",
    "num_test_actors",
    "batch_size",
    "policy_cloning_cost",
    "value_cloning_cost",
    "gamma",
    "pg_cost",
    "baseline_cost",
    "entropy_cost",
    "clip_rho_threshold",
    "clip_pg_rho_threshold",
    "learning_rate",
    "rmsprop_alpha",
    "rmsprop_eps",
    "max_grad_norm",
)
# how the run is executed and reported, never what it learns
RUN_ONLY_ON_RESUME = (
    "checkpoint_replay",
    "test_actor_max_sps",
    "log_every_seconds",
)
# a checkpoint written before a flag was renamed resumes with its value under the new name (common/args.py)
RENAMED_FLAGS = {
    # the replayed share of a batch (the old name also meant reactor.py's acting steps per learning step)
    "replay_ratio": "replay_fraction",
    # capacity in agent steps, as vracer_refer.py's --buffer-size (frames: emulator frames only)
    "buffer_frames": "buffer_size",
}


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags; the first violation stops the script with one line `error: ...`."""
    require(args.steps_per_task >= 1, f"--steps-per-task must be >= 1, got {args.steps_per_task!r}")
    require(args.num_cycles >= 1, f"--num-cycles must be >= 1, got {args.num_cycles!r}")
    require(args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors!r}")
    require(args.envs_per_actor >= 1, f"--envs-per-actor must be >= 1, got {args.envs_per_actor!r}")
    require(args.num_test_actors >= 0, f"--num-test-actors must be >= 0, got {args.num_test_actors!r}")
    require(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size!r}")
    require(args.unroll_length >= 1, f"--unroll-length must be >= 1, got {args.unroll_length!r}")
    require(0 <= args.replay_fraction <= 1, f"--replay-fraction must be in [0, 1], got {args.replay_fraction!r}")
    require(args.buffer_size >= -1, f"--buffer-size must be >= -1, got {args.buffer_size!r}")
    require(args.policy_cloning_cost >= 0, f"--policy-cloning-cost must be >= 0, got {args.policy_cloning_cost!r}")
    require(args.value_cloning_cost >= 0, f"--value-cloning-cost must be >= 0, got {args.value_cloning_cost!r}")
    require(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma!r}")
    require(args.pg_cost >= 0, f"--pg-cost must be >= 0, got {args.pg_cost!r}")
    require(args.baseline_cost >= 0, f"--baseline-cost must be >= 0, got {args.baseline_cost!r}")
    require(args.entropy_cost >= 0, f"--entropy-cost must be >= 0, got {args.entropy_cost!r}")
    require(args.clip_rho_threshold > 0, f"--clip-rho-threshold must be > 0, got {args.clip_rho_threshold!r}")
    require(args.clip_pg_rho_threshold > 0, f"--clip-pg-rho-threshold must be > 0, got {args.clip_pg_rho_threshold!r}")
    require(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate!r}")
    require(0 <= args.rmsprop_alpha <= 1, f"--rmsprop-alpha must be in [0, 1], got {args.rmsprop_alpha!r}")
    require(args.rmsprop_eps >= 0, f"--rmsprop-eps must be >= 0, got {args.rmsprop_eps!r}")
    require(args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm!r}")
    require(
        args.sticky_action_prob is None or 0 <= args.sticky_action_prob <= 1,
        f"--sticky-action-prob must be in [0, 1], got {args.sticky_action_prob!r}",
    )
    require(args.max_episode_frames >= 1, f"--max-episode-frames must be >= 1, got {args.max_episode_frames!r}")
    require(
        args.minigrid_max_steps is None or args.minigrid_max_steps >= 1,
        f"--minigrid-max-steps must be >= 1, got {args.minigrid_max_steps!r}",
    )
    require(args.test_actor_max_sps >= 0, f"--test-actor-max-sps must be >= 0, got {args.test_actor_max_sps!r}")
    require(args.log_every_seconds >= 0, f"--log-every-seconds must be >= 0, got {args.log_every_seconds!r}")
    require(len(args.env_ids) > 0, "--env-ids needs at least one task")
    num_tasks = len(args.env_ids)
    num_envs = args.num_actors * args.envs_per_actor
    if args.mode == "separate":
        require(
            (args.num_actors // num_tasks) * args.envs_per_actor >= args.batch_size,
            f"--mode separate needs (--num-actors // tasks) x --envs-per-actor >= --batch-size ({args.batch_size}): "
            "each network's batch comes from its own task's envs, one pair each",
        )
        require(
            args.num_actors % num_tasks == 0,
            f"--mode separate needs --num-actors a multiple of the task count ({num_tasks})",
        )
    else:
        require(
            num_envs >= args.batch_size,
            f"--num-actors x --envs-per-actor ({num_envs}) must be >= --batch-size ({args.batch_size}): "
            "each env contributes at most one pair to a batch (CLEAR App. A.1)",
        )
    if args.mode == "simultaneous":
        require(
            num_envs % num_tasks == 0,
            f"--mode simultaneous needs --num-actors x --envs-per-actor a multiple of the number of tasks ({num_tasks}): "
            f"env i plays task i mod {num_tasks}, so any other count unbalances the tasks",
        )
    require(
        not (args.buffer_size == 0 and args.replay_fraction > 0),
        "--buffer-size 0 (no replay buffer) needs --replay-fraction 0",
    )
    require(
        not 0 < args.buffer_size < args.num_actors * args.unroll_length,
        f"--buffer-size {args.buffer_size} is less than one unroll per actor "
        f"({args.num_actors} actors x {args.unroll_length} steps)",
    )


def probe_envs(args: Args) -> tuple[tuple[int, ...], int, str]:
    """Build every task once: one env family, observation shape and action count, a torso that reads them; else exit.
    Also resolves the per-family default of --bootstrap-truncation (see the flag)."""
    shapes = set()
    actions = set()
    kinds = set()
    for env_id in args.env_ids:
        try:
            if args.capture_video:
                check_video_support()
            kinds.add(env_kind(env_id))
            env = make_env(env_id, args.seed, args)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        shapes.add(tuple(env.observation_space.shape))
        actions.add(int(env.action_space.n))
        env.close()
    if len(kinds) > 1:
        raise SystemExit(f"error: --env-ids mixes env families ({', '.join(sorted(kinds))}); one network reads one kind")
    if len(shapes) > 1 or len(actions) > 1:
        raise SystemExit(f"error: tasks differ in observation shape {shapes} or action count {actions} (one network)")
    obs_shape = shapes.pop()
    num_actions = actions.pop()
    kind = kinds.pop()
    torso = resolve_torso(args, obs_shape)
    if torso not in {"atari": ("nature", "resnet"), "minatar": ("minatar",), "minigrid": ("minigrid",)}[kind]:
        raise SystemExit(f"error: --torso {torso} does not read {kind} observations (use --torso auto)")
    if args.capture_video and kind == "minatar":
        raise SystemExit("error: --capture-video is not supported on MinAtar (its adapter renders no frames)")
    if args.bootstrap_truncation is None:
        # MiniGrid's step limit is part of the task: reaching it ends the episode
        args.bootstrap_truncation = kind != "minigrid"
    return obs_shape, num_actions, kind


def resolve_torso(args: Args, obs_shape) -> str:
    if args.torso != "auto":
        return args.torso
    if tuple(obs_shape[-2:]) == (10, 10):
        return "minatar"
    return "minigrid" if len(obs_shape) == 3 and obs_shape[-1] == 3 else "nature"


# what --resume restores from a checkpoint of this script (save_run_checkpoint's entries and the loop's)
CHECKPOINT_ENTRIES = ("global_step", "rng", "models", "optimizers", "learner_steps", "eval_records", "pair_rng")


def check_checkpoint_fits(checkpoint: dict, network: Agent, num_nets: int, path: str) -> None:
    """Refuse, in one `error: --resume: ...` line, a checkpoint this script cannot restore exactly: an entry missing,
    another number of networks, or a network state whose names or shapes differ from `network`'s (e.g. one written
    before the weights carried their version)."""
    missing = [key for key in CHECKPOINT_ENTRIES if key not in checkpoint]
    require(not missing, f"--resume: {path} has no {', '.join(missing)}: it was written by another clear_impala.py")
    counts = {len(checkpoint[key]) for key in ("models", "optimizers", "learner_steps")}
    require(counts == {num_nets}, f"--resume: {path} holds {sorted(counts)} networks where this run trains {num_nets}")
    expected = {name: tuple(tensor.shape) for name, tensor in network.state_dict().items()}
    for net, state in enumerate(checkpoint["models"]):
        found = {name: tuple(tensor.shape) for name, tensor in state.items()}
        differences = []
        if expected.keys() - found.keys():
            differences.append(f"lacks {sorted(expected.keys() - found.keys())}")
        if found.keys() - expected.keys():
            differences.append(f"has no place for {sorted(found.keys() - expected.keys())}")
        reshaped = sorted(name for name in expected.keys() & found.keys() if expected[name] != found[name])
        if reshaped:
            differences.append(f"has other shapes for {reshaped}")
        require(
            not differences,
            f"--resume: network {net} of {path} {', '.join(differences)}: it does not fit this clear_impala.py "
            "(a checkpoint written before the weights carried their version resumes with the script that wrote it)",
        )


def check_restored_buffers(args: Args, capacity: int) -> None:
    """Refuse, in one line, a resume whose actors would restore a buffer (--checkpoint-replay) into a larger capacity
    after it has dropped unrolls (ReservoirBuffer.load): with --buffer-size -1 the capacity is half of the run's
    steps, so a higher --num-cycles grows it. Refused, not resized: no refill makes such a buffer a uniform sample
    of all unrolls offered again (the larger sample would hold some of those it dropped)."""
    if not (args.checkpoint_replay and capacity):
        return
    checkpoint_dir = os.path.dirname(args.resume)
    for i in range(args.num_actors):
        path = os.path.join(checkpoint_dir, f"replay_actor{i}.npz")
        if not os.path.exists(path):
            continue
        held, offered = ReservoirBuffer.saved_counts(path)
        require(
            capacity <= held or held == offered,
            f"--resume: actor {i}'s buffer holds {held} of the {offered} unrolls it was offered and would grow to "
            f"{capacity} (--buffer-size -1: half of the run's {total_steps(args):,} steps), which no refill keeps a "
            "uniform sample of them all: keep --num-cycles, or resume with --no-checkpoint-replay (empty buffers)",
        )


def drain(q, limit=10_000):
    for _ in range(limit):
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


class ReplayImportanceWeights:
    """A diagnostic per replayed task: the mean V-trace weight rho_t (truncated_importance_weights) over the replayed
    steps whose stored action the behaviour policy was sure of (mu >= 0.5), since the last log line; near 0, replay
    no longer teaches that task those steps. Summed on the learner's device per task the unroll came from (no sync
    per batch).
    Oracle:
    tests/test_clear_oracles.py::test_replay_importance_weights_are_the_mean_rho_of_confident_replayed_steps_per_source_task."""

    def __init__(self, num_tasks: int, device):
        self.device = device
        self.rho_sum = torch.zeros(num_tasks, device=device)
        self.rho_count = torch.zeros(num_tasks, device=device)

    def add(self, unroll: AlignedUnroll, halves: torch.Tensor, replay_task: torch.Tensor) -> None:
        """The replay columns (halves 1) of one batch, each for the task its replay unroll was played on."""
        rho, mu_taken = truncated_importance_weights(unroll)
        confident = (mu_taken >= 0.5).float() * halves.float().to(self.device)
        replay_source = replay_task.clamp(min=0).to(self.device)
        self.rho_sum.index_add_(0, replay_source, (rho * confident).sum(0))
        self.rho_count.index_add_(0, replay_source, confident.sum(0))

    def means(self, names: list[str]) -> dict[str, float]:
        """{replay/<task>/importance_weight: mean rho_t} of the tasks with such steps since the last call; starts over."""
        means = {}
        for task, (task_rho_sum, task_rho_count) in enumerate(zip(self.rho_sum.tolist(), self.rho_count.tolist())):
            if task_rho_count > 0:
                means[f"replay/{names[task]}/importance_weight"] = task_rho_sum / task_rho_count
        self.rho_sum.zero_()
        self.rho_count.zero_()
        return means


class LoopLog:
    """What the learner loop writes: every training and test episode the actors queued (test episodes also join
    `eval_records`, the run's test history), and every --log-every-seconds and at the run's end one record of the
    learner's metrics averaged since the last (MetricAverager, ReplayImportanceWeights), the speeds, and the progress
    line."""

    def __init__(self, logger, args: Args, handles: ActorHandles, eval_queue, eval_records: list, capacity, end_step, device):
        self.logger = logger
        self.args = args
        self.handles = handles
        self.eval_queue = eval_queue
        self.eval_records = eval_records
        self.capacity = capacity
        self.end_step = end_step
        # task names as they appear in metric names
        self.names = [env_id.replace("/", "_") for env_id in args.env_ids]
        self.metrics = MetricAverager()
        self.replay_weights = ReplayImportanceWeights(len(args.env_ids), device)
        self.train_returns = collections.deque(maxlen=100)
        # the last test returns of each task
        self.recent_test_returns = collections.defaultdict(lambda: collections.deque(maxlen=20))
        self.start_time = time.time()
        self.start_step = handles.global_step.value
        self.last_log = self.start_time
        self.last_log_step = self.start_step
        self.last_actor_steps = 0
        # the learner's time since the last record: from a batch's pairs being ready to its update (charts/learner_SPS)
        self.learn_time = 0.0
        self.learn_start = self.start_time

    def start_learner_clock(self) -> None:
        self.learn_start = time.time()

    def stop_learner_clock(self) -> None:
        self.learn_time += time.time() - self.learn_start

    def add_learner_step(self, update: LearnerUpdate, halves: torch.Tensor, batch_info: SlotInfo, policy_lag) -> None:
        """One learner step's metrics; the loss terms stay on the device until the record (one sync, not 7 per batch)."""
        self.metrics.add(
            {
                **update.parts,
                "losses/grad_norm": update.grad_norm,
                "charts/replay_fraction": float(halves.float().mean()),
                "charts/policy_lag": float(policy_lag),
                "charts/buffer_fill": float(batch_info.buffer_unrolls.float().mean() / max(1, self.capacity)),
            }
        )
        if self.args.replay_fraction > 0:
            self.replay_weights.add(update.unroll, halves, batch_info.replay_task)

    def log(self, step: int, learning_rate: float, task_mismatch: int) -> None:
        """At the learner's `step`, after a learner step: the queued episodes, then the record if one is due."""
        self.log_episodes(step)
        self.log_learner_metrics(step, learning_rate, task_mismatch)

    def log_episodes(self, step: int) -> None:
        """The training and test episodes queued since the last call, at the learner's `step`."""
        for task, episode_return, length in drain(self.handles.stats_queue):
            self.train_returns.append(episode_return)
            self.logger.log(
                step,
                {
                    "charts/episodic_return": episode_return,
                    "charts/episodic_length": length,
                    f"train/{self.names[task]}/episodic_return": episode_return,
                },
            )
        for task, episode_return, length in drain(self.eval_queue):
            self.eval_records.append((step, task, episode_return))
            self.recent_test_returns[task].append(episode_return)
            self.logger.log(
                step,
                {
                    f"eval/{self.names[task]}/episodic_return": episode_return,
                    f"eval/{self.names[task]}/episodic_length": length,
                },
            )

    def log_learner_metrics(self, step: int, learning_rate: float, task_mismatch: int) -> None:
        """The learner's record and the progress line, if --log-every-seconds have passed since the last or the run
        has reached its end."""
        now = time.time()
        if now - self.last_log < self.args.log_every_seconds and step < self.end_step:
            return
        actor_steps = sum(self.handles.steps_done)
        record = {
            **self.metrics.means(),
            "charts/SPS": int((step - self.start_step) / (now - self.start_time)),
            "charts/learner_SPS": int((step - self.last_log_step) / max(1e-9, self.learn_time)),
            "charts/actor_SPS": int((actor_steps - self.last_actor_steps) / (now - self.last_log)),
            "charts/learning_rate": learning_rate,
            "charts/task": task_for_actor(0, step, self.args),
            "charts/task_mismatch": task_mismatch,
            **self.replay_weights.means(self.names),
        }
        self.logger.log(step, record)
        test_means = " ".join(
            f"{np.mean(self.recent_test_returns[task]):.2f}" if self.recent_test_returns[task] else "-"
            for task in range(len(self.names))
        )
        self.logger.progress(
            step,
            record["charts/SPS"],
            np.mean(self.train_returns) if self.train_returns else None,
            "total_loss",
            record["losses/total_loss"],
            f"task {record['charts/task']} replay {record['charts/replay_fraction']:.2f} eval [{test_means}]",
        )
        self.learn_time = 0.0
        self.last_log = now
        self.last_log_step = step
        self.last_actor_steps = actor_steps


class CheckpointCadence:
    """--checkpoint-every: a checkpoint every that many steps and at the run's end (none with 0); the actors then save
    their buffers at their next unroll (--checkpoint-replay)."""

    def __init__(self, logger, args: Args, handles: ActorHandles, end_step: int):
        self.logger = logger
        self.args = args
        self.handles = handles
        self.end_step = end_step
        self.last_step = handles.global_step.value

    def save_if_due(self, step: int, models, optimizers, learner_steps, eval_records, pair_rng) -> None:
        every = self.args.checkpoint_every
        if not every or (step - self.last_step < every and step < self.end_step):
            return
        self.last_step = step
        save_run_checkpoint(
            self.logger,
            "clear_impala.py",
            self.args,
            step,
            models=[model.state_dict() for model in models],
            optimizers=[optimizer.state_dict() for optimizer in optimizers],
            learner_steps=learner_steps,
            eval_records=eval_records,
            pair_rng=pair_rng.bit_generator.state,
        )
        self.handles.checkpoint_request.value += 1


if __name__ == "__main__":
    # --resume: the checkpoint's flags, the flags given on this command line override them
    args, checkpoint, overridden = parse_run_args(
        Args, "clear_impala.py", FIXED_ON_RESUME, APPLIED_ON_RESUME, RUN_ONLY_ON_RESUME, renamed=RENAMED_FLAGS
    )
    # all checks before anything heavy and before the run's folder exists
    validate_args(args)
    # probe_envs also resolves --bootstrap-truncation's default
    obs_shape, num_actions, _ = probe_envs(args)
    torso = resolve_torso(args, obs_shape)
    num_tasks = len(args.env_ids)
    T = args.unroll_length
    B = args.batch_size
    # the paper's actors: one (new, replay) pair each per batch at most
    num_envs = args.num_actors * args.envs_per_actor
    num_nets = num_tasks if args.mode == "separate" else 1
    end_step = total_steps(args)
    if checkpoint:
        # a checkpoint this script cannot restore exactly: refused before the run's folder is opened
        check_checkpoint_fits(checkpoint, Agent(obs_shape, num_actions, torso), num_nets, args.resume)
    if checkpoint and checkpoint["global_step"] >= end_step:
        raise SystemExit(
            f"error: --resume: the checkpoint is at step {checkpoint['global_step']:,}, the run ends at {end_step:,} "
            f"(--steps-per-task x tasks x --num-cycles): raise --steps-per-task or --num-cycles"
        )

    # MEMORY: bytes per stored step, refuse what cannot fit
    capacity = buffer_capacity_per_actor(args)
    if checkpoint:
        # replay buffers the actors cannot restore as uniform samples: refused before the run's folder is opened
        check_restored_buffers(args, capacity)
    bytes_per_unroll = ReservoirBuffer.bytes_per_unroll(obs_shape, num_actions, T)
    print(
        f"replay: {capacity} unrolls/actor x {args.num_actors} actors = {capacity * args.num_actors * T} steps, "
        f"{bytes_per_unroll / T:.0f} B per stored step (observation {int(np.prod(obs_shape))} B + the unroll's other "
        "fields)"
    )
    check_memory((capacity * args.num_actors + 2 * num_envs) * bytes_per_unroll, "--buffer-size")

    if num_tasks <= 3:
        run_label = "+".join(env_id.replace("ALE/", "") for env_id in args.env_ids)
    else:
        run_label = f"{num_tasks}tasks"
    logger = start_run(args, checkpoint, run_label)

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    # the learner gets the cores the actors leave free
    set_learner_threads(args.num_actors + num_tasks * args.num_test_actors)

    # SETUP: networks (one per task if separate), shared CPU copies, optimizers (the lr of each batch:
    # annealed_learning_rate, set by learner_step)
    models = [Agent(obs_shape, num_actions, torso).to(device) for _ in range(num_nets)]
    # the actors' copies: CPU, shared memory (built before the RNG states are restored: their init draws from them)
    shared_weights = [SharedWeights.share(Agent(obs_shape, num_actions, torso)) for _ in range(num_nets)]
    # momentum 0 (IMPALA Table G.1)
    optimizers = [
        torch.optim.RMSprop(model.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)
        for model in models
    ]
    global_step_value = 0
    learner_steps = [0] * num_nets
    # (global_step, task, return) of every test episode
    eval_records = []
    if checkpoint:
        # the weights with their versions and the optimizers' statistics; the lr, alpha and eps in effect come from
        # the flags (learner_step), the lr schedule from the restored step
        for objs, key in ((models, "models"), (optimizers, "optimizers")):
            for obj, state in zip(objs, checkpoint[key], strict=True):
                obj.load_state_dict(state)
        global_step_value = checkpoint["global_step"]
        learner_steps = checkpoint["learner_steps"]
        eval_records = [tuple(record) for record in checkpoint["eval_records"]]
        set_rng_state(checkpoint["rng"])
        # the buffers the actors will load
        restored = 0
        if args.checkpoint_replay and capacity:
            checkpoint_dir = os.path.dirname(args.resume)
            for i in range(args.num_actors):
                restored += os.path.exists(os.path.join(checkpoint_dir, f"replay_actor{i}.npz"))
        print(
            f"resumed {args.resume} at step {global_step_value:,}: model(s), optimizer(s), RNG, task "
            f"{task_for_actor(0, global_step_value, args)}, {len(eval_records)} test episodes, replay buffers of "
            f"{restored}/{args.num_actors} actors (others start empty); flags from this command line: "
            f"{', '.join(overridden) or 'none'}; runs to step {end_step:,}",
            flush=True,
        )
    # the actors' copies hold the learner's weights from now on
    for model, shared in zip(models, shared_weights):
        publish_weights(model, shared)

    # SETUP: shared-memory slots, one (new, replay) pair per env; only slot ids travel through queues
    ctx = torch.multiprocessing.get_context(args.start_method)
    if args.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "gymnasium", "common.minigrid_env", "common.minatar_env", "common.atari_env"])
    slots = {
        k: torch.from_numpy(np.zeros((num_envs, 2, *shape), dtype=dtype)).share_memory_()
        for k, (shape, dtype) in unroll_specs(obs_shape, num_actions, T).items()
    }
    slot_info = SlotInfo.zeros(num_envs)
    for entries in slot_info:
        entries.share_memory_()
    # one semaphore per slot (1 = free), not an Event: Event.set() hangs on an actor killed inside Event.wait()
    slot_free = [ctx.Semaphore(1) for _ in range(num_envs)]
    processes = ProcessGroup(ctx)
    handles = ActorHandles(
        shared_weights=shared_weights,
        slots=slots,
        slot_info=slot_info,
        full_queues=[ctx.SimpleQueue() for _ in range(num_nets)],
        slot_free=slot_free,
        global_step=ctx.Value("q", global_step_value, lock=False),
        resume_step=global_step_value if args.resume else 0,
        steps_done=ctx.Array("q", args.num_actors, lock=False),
        stop=processes.stop_event,
        stats_queue=ctx.Queue(),
        checkpoint_request=ctx.Value("q", 0, lock=False),
        run_dir=str(logger.dir),
    )
    global_step = handles.global_step
    eval_queue = ctx.Queue()
    pair_rng = np.random.default_rng(args.seed)
    if checkpoint:
        # the pair-selection stream continues where the checkpoint left it
        pair_rng.bit_generator.state = checkpoint["pair_rng"]
    task_mismatch = 0
    error = None
    try:
        for i in range(args.num_actors):
            processes.start(actor_loop, (i, args, obs_shape, num_actions, handles), name=f"actor-{i}")
        for task in range(num_tasks):
            for j in range(args.num_test_actors):
                test_id = task * args.num_test_actors + j
                test_args = (
                    test_id,
                    task,
                    args,
                    obs_shape,
                    num_actions,
                    shared_weights,
                    handles.resume_step,
                    processes.stop_event,
                    eval_queue,
                )
                processes.start(test_actor_loop, test_args, name=f"test-{task}-{j}")
        loop_log = LoopLog(logger, args, handles, eval_queue, eval_records, capacity, end_step, device)
        checkpoints = CheckpointCadence(logger, args, handles, end_step)
        while global_step.value < end_step:
            # COLLECT: B pairs, one per env, from the queue of the network to train next
            net = sum(learner_steps) % num_nets
            slot_ids = wait_for_pairs(handles.full_queues[net], B, processes)
            loop_log.start_learner_clock()
            batch_info = slot_info.select(slot_ids)
            # which half of each pair the batch trains on: --replay-fraction x B replay halves (App. A.1, Sec. 4.3)
            replay_valid = batch_info.replay_valid.numpy().astype(bool)
            halves = torch.from_numpy(select_pairs(replay_valid, args.replay_fraction, pair_rng))
            # every unroll must be on the task its start step designates (App. A.6), and of this network's task
            task_mismatch += count_task_mismatches(slot_ids, batch_info, net, args)
            learning_rate = annealed_learning_rate(global_step.value, end_step, args)
            # the chosen halves copied out, then the B x T new steps counted and the slots freed for the next pairs
            batch = take_batch(slots, slot_ids, halves)
            release_slots(slot_ids, slot_free, global_step, T)

            # LEARN
            update = learner_step(
                models[net], optimizers[net], shared_weights[net], batch, halves, learning_rate, args, device
            )
            # updates between the weights that acted and the weights that learn from it
            policy_lag = learner_steps[net] - batch_info.policy_version.float().mean()
            learner_steps[net] += 1
            loop_log.stop_learner_clock()

            # LOG
            loop_log.add_learner_step(update, halves, batch_info, policy_lag)
            loop_log.log(global_step.value, learning_rate, task_mismatch)

            # CHECKPOINT
            checkpoints.save_if_due(global_step.value, models, optimizers, learner_steps, eval_records, pair_rng)
            processes.check()
    except (KeyboardInterrupt, StopRun) as e:
        error = e
    finally:
        # actors with a buffer to save for the last checkpoint get time for it (a large .npz takes seconds)
        processes.stop(timeout=120.0 if args.checkpoint_replay and handles.checkpoint_request.value else 5.0)

    # SAVE + SUMMARY: the test returns averaged over the steps reached, the last test episodes included
    test_summary = summarize_test_episodes(eval_records, eval_queue, global_step.value, args, logger.dir)
    summary = {
        "global_step": global_step.value,
        "mode": args.mode,
        "replay_fraction": args.replay_fraction,
        "behavior_cloning": args.behavior_cloning,
        "env_ids": args.env_ids,
        **test_summary,
        "task_mismatch": task_mismatch,
    }
    print(json.dumps({key: summary[key] for key in ("global_step", "final_cumulative_return", "task_mismatch")}))

    model_file = {"models": [model.state_dict() for model in models], "args": vars(args)}
    finish_run(logger, error, summary, model_file if args.save_model else None)

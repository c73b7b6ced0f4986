# docs and results: README.md#clear_impalapy-clear-on-impala
"""CLEAR (Rolnick et al. 2019, https://arxiv.org/abs/1811.11682) on IMPALA (https://arxiv.org/abs/1802.01561).

Paper parts implemented here
- IMPALA actor-learner (CLEAR App. A.1): `actor_loop` processes (CPU, `--envs-per-actor` envs, one batched forward)
  act with a shared-memory policy; each env's slot holds a (new, replay) unroll pair until the learner has copied it
  (`take_batch`).
- V-trace (IMPALA Eq. (1)) `vtrace_from_importance_weights`; value / pg / entropy losses (CLEAR Sec. 3) `impala_losses`.
- Per-actor reservoir replay of whole unrolls (App. A.3) `ReservoirBuffer`; new/replay choice per pair (App. A.1,
  Sec. 4.3) `select_pairs`; behavioural cloning on replay unrolls (Sec. 3) `policy_cloning_loss`, `value_cloning_loss`.
- Task sequences (App. A.6; sequential / simultaneous / separate, Fig. 1) `task_for_actor`; test actors per task
  (App. A.5) `test_actor_loop`; cumulative reward per task (App. C) `cumulative_returns`.

Defaults and their source
- T 20, B 32, gamma 0.99, grad clip 40, RMSProp lr 6e-4 annealed to 0 over the whole run, alpha 0.99, eps 0.01
  (IMPALA Table G.1); rho_bar = c_bar = 1 (IMPALA Sec. 4.2); pg / value / entropy 1 / 0.5 / 0.005, cloning
  0.01 / 0.005 (CLEAR App. A.4); replay_ratio 0.5 (Sec. 3); buffer = half the training frames (App. A.3).
- Loss sums over time and batch (scalable_agent). A "frame" / "step" is one agent step of NEW experience.
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
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.args import CommonArgs, parse_run_args, require
from common.checkpoint import rng_state, save_checkpoint, seed_everything, select_device, set_rng_state
from common.logger import start_run
from common.minatar_env import MINATAR_ENV_IDS, MINATAR_MAX_CHANNELS, make_minatar_env
from common.processes import ProcessGroup, StopRun, check_memory, finish_run, set_learner_threads, stop_on_signals
from common.video import check_video_support


@dataclass
class Args(CommonArgs):  # CommonArgs: --seed, --cuda, --track, --save-model, --checkpoint-every, --resume, ...
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
    replay_ratio: float = 0.5
    """fraction of each batch from the pairs' replay halves: 0 = IMPALA, 0.5 = 50-50 (CLEAR), 1 = all (Sec. 4.3)"""
    buffer_frames: int = -1
    """replay capacity in frames, split over the actor processes (App. A.3); -1 = half of all frames; 0 = none"""
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


# the flags a resumed run may not change (replay and tasks are per actor)
FIXED_ON_RESUME = (
    "env_ids",
    "seed",
    "mode",
    "torso",
    "num_actors",
    "envs_per_actor",
    "unroll_length",
    "replay_ratio",
    "behavior_cloning",
)


def validate_args(args: Args) -> None:
    """Each flag's range, then the checks between flags; the first violation stops the script with one line `error: ...`."""
    require(args.steps_per_task >= 1, f"--steps-per-task must be >= 1, got {args.steps_per_task!r}")
    require(args.num_cycles >= 1, f"--num-cycles must be >= 1, got {args.num_cycles!r}")
    require(args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors!r}")
    require(args.envs_per_actor >= 1, f"--envs-per-actor must be >= 1, got {args.envs_per_actor!r}")
    require(args.num_test_actors >= 0, f"--num-test-actors must be >= 0, got {args.num_test_actors!r}")
    require(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size!r}")
    require(args.unroll_length >= 1, f"--unroll-length must be >= 1, got {args.unroll_length!r}")
    require(0 <= args.replay_ratio <= 1, f"--replay-ratio must be in [0, 1], got {args.replay_ratio!r}")
    require(args.buffer_frames >= -1, f"--buffer-frames must be >= -1, got {args.buffer_frames!r}")
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
    k, E, B, n = max(1, len(args.env_ids)), args.envs_per_actor, args.batch_size, args.num_actors
    for bad, msg in (
        (not args.env_ids, "--env-ids needs at least one task"),
        (
            args.mode == "separate" and (n // k) * E < B,
            f"--mode separate needs (--num-actors // tasks) x "
            f"--envs-per-actor >= --batch-size ({B}): each network's batch comes from its own task's envs, one pair each",
        ),
        (
            args.mode != "separate" and n * E < B,
            f"--num-actors x --envs-per-actor ({n * E}) must be >= --batch-size "
            f"({B}): each env contributes at most one pair to a batch (CLEAR App. A.1)",
        ),
        (
            args.mode == "simultaneous" and (n * E) % k,
            f"--mode simultaneous needs --num-actors x --envs-per-actor a "
            f"multiple of the number of tasks ({k}): env i plays task i mod {k}, so any other count unbalances the tasks",
        ),
        (args.mode == "separate" and n % k, f"--mode separate needs --num-actors a multiple of the task count ({k})"),
        (args.buffer_frames == 0 and args.replay_ratio > 0, "--buffer-frames 0 (no replay buffer) needs --replay-ratio 0"),
        (
            0 < args.buffer_frames < n * args.unroll_length,
            f"--buffer-frames {args.buffer_frames} is less than one "
            f"unroll per actor ({n} actors x {args.unroll_length} steps)",
        ),
    ):
        if bad:
            raise SystemExit(f"error: {msg}")


def total_steps(args: Args) -> int:
    return args.steps_per_task * len(args.env_ids) * args.num_cycles


def buffer_capacity_per_actor(args: Args) -> int:
    """Unrolls per actor: total frames split equally over the actors (CLEAR App. A.3), in whole unrolls."""
    if args.replay_ratio == 0 and args.buffer_frames <= 0:
        return 0  # plain IMPALA: no buffer at all
    frames = args.buffer_frames if args.buffer_frames > 0 else total_steps(args) // 2
    return max(1, frames // (args.num_actors * args.unroll_length))


# ENVIRONMENTS
def env_kind(env_id: str) -> str:
    from common.atari_env import ATARI_ENV_IDS

    if env_id in ATARI_ENV_IDS or env_id in MINATAR_ENV_IDS:
        return "atari" if env_id in ATARI_ENV_IDS else "minatar"
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
    if kind == "atari":  # full 18-action space so one policy head serves every game (IMPALA multi-task, CLEAR Sec.
        # 4.6); a lost life ends the learning episode but not the game (IMPALA Table G.1, notes P8)
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
    if kind == "minatar":  # channels padded to 10: one network reads every game (CLEAR Sec. 4.6 analogue)
        sticky = 0.1 if args.sticky_action_prob is None else args.sticky_action_prob
        return make_minatar_env(env_id, seed, pad_channels=MINATAR_MAX_CHANNELS, sticky_action_prob=sticky)
    from common.minigrid_env import make_minigrid_env

    env = make_minigrid_env(
        env_id, fully_observable=False, max_steps=args.minigrid_max_steps, render_mode="rgb_array" if capture_video else None
    )
    if capture_video:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda i: i % 20 == 0)
    env = gym.wrappers.RecordEpisodeStatistics(env)  # info["episode"]["r"] on terminated or truncated
    env.action_space.seed(seed)
    return env


def probe_envs(args: Args) -> tuple[tuple[int, ...], int, str]:
    """Build every task once: one env family, observation shape and action count, a torso that reads them; else exit.
    Also resolves the per-family default of --bootstrap-truncation (see the flag)."""
    shapes, actions, kinds = set(), set(), set()
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
    (obs_shape,), (num_actions,), (kind,) = shapes, actions, kinds
    torso = resolve_torso(args, obs_shape)
    if torso not in {"atari": ("nature", "resnet"), "minatar": ("minatar",), "minigrid": ("minigrid",)}[kind]:
        raise SystemExit(f"error: --torso {torso} does not read {kind} observations (use --torso auto)")
    if args.capture_video and kind == "minatar":
        raise SystemExit("error: --capture-video is not supported on MinAtar (its adapter renders no frames)")
    if args.bootstrap_truncation is None:
        # MiniGrid's step limit is part of the task: reaching it ends the episode
        args.bootstrap_truncation = kind != "minigrid"
    return obs_shape, num_actions, kind


# NETWORK
def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0, self.conv1 = nn.Conv2d(channels, channels, 3, padding=1), nn.Conv2d(channels, channels, 3, padding=1)

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
    in_shape = (obs_shape[-1], *obs_shape[:-1]) if torso == "minigrid" else obs_shape  # MiniGrid: HWC -> CHW
    c = in_shape[0]
    if torso == "nature":  # the Nature DQN CNN (Mnih et al. 2015) as monobeast's AtariNet, without its LSTM
        net, hidden = (
            nn.Sequential(
                layer_init(nn.Conv2d(c, 32, 8, stride=4)),
                nn.ReLU(),
                layer_init(nn.Conv2d(32, 64, 4, stride=2)),
                nn.ReLU(),
                layer_init(nn.Conv2d(64, 64, 3, stride=1)),
                nn.ReLU(),
                nn.Flatten(),
            ),
            512,
        )
    elif torso == "resnet":  # IMPALA "deep": channels 16/32/32, FC 256
        net, hidden = (
            nn.Sequential(conv_sequence(c, 16), conv_sequence(16, 32), conv_sequence(32, 32), nn.Flatten(), nn.ReLU()),
            256,
        )
    elif torso == "minatar":  # MinAtar's network (Young & Tian 2019): one 3x3 conv with 16 channels, 128 units
        net, hidden = nn.Sequential(layer_init(nn.Conv2d(c, 16, 3)), nn.ReLU(), nn.Flatten()), 128
    else:  # minigrid: the 7x7x3 egocentric view (object, colour, state indices), our choice
        net, hidden = (
            nn.Sequential(
                layer_init(nn.Conv2d(c, 16, 2)),
                nn.ReLU(),
                layer_init(nn.Conv2d(16, 32, 2)),
                nn.ReLU(),
                layer_init(nn.Conv2d(32, 64, 2)),
                nn.ReLU(),
                nn.Flatten(),
            ),
            256,
        )
    with torch.no_grad():
        n_flat = net(torch.zeros(1, *in_shape)).shape[1]
    return nn.Sequential(net, layer_init(nn.Linear(n_flat, hidden)), nn.ReLU()), hidden


class Agent(nn.Module):
    """Shared torso, one policy head over the full action space and one value head shared by all tasks."""

    def __init__(self, obs_shape, num_actions, torso):
        super().__init__()
        self.torso_name = torso
        self.torso, hidden = make_torso(torso, obs_shape)
        self.policy = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.baseline = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """obs: uint8 [N, *obs_shape] -> (logits [N, A], value [N])."""
        x = obs.float()
        if self.torso_name == "minigrid":
            x = x.permute(0, 3, 1, 2) / 10.0  # MiniGrid indices are <= 10
        elif self.torso_name != "minatar":  # MinAtar frames are 0/1
            x = x / 255.0
        h = self.torso(x)
        return self.policy(h), self.baseline(h).squeeze(-1)


# ALGORITHM PIECES
VTraceReturns = collections.namedtuple("VTraceReturns", ["vs", "pg_advantages"])  # [T, B] each


@torch.no_grad()
def vtrace_from_importance_weights(
    log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0
) -> VTraceReturns:
    """V-trace targets v_s and policy-gradient advantages, time-major [T, B] (IMPALA Eq. (1), CLEAR Sec. 3).
    log_rhos[t] = log pi(a_t|x_t) - log mu(a_t|x_t); discounts[t] = gamma * (1 - done_t) (0 cuts the trace at an
    episode end); values[t] = V(x_t); bootstrap_value = V(x_T); a None clip threshold means no clipping."""
    if bootstrap_value.shape != values.shape[1:]:
        raise ValueError(
            f"bootstrap_value shape {tuple(bootstrap_value.shape)} must be values.shape[1:] {tuple(values.shape[1:])}"
        )
    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else torch.clamp(rhos, max=clip_rho_threshold)  # rho_t
    cs = torch.clamp(rhos, max=1.0)  # c_i = min(c_bar, pi/mu), c_bar = 1 (IMPALA Sec. 4.1, torchbeast)
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    # delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    # Eq. (1) as the backward recursion v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))  (IMPALA Remark 1)
    acc, vs_minus_v = torch.zeros_like(bootstrap_value), []
    for t in reversed(range(log_rhos.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v.append(acc)
    vs = torch.stack(vs_minus_v[::-1]) + values
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    clipped_pg_rhos = rhos if clip_pg_rho_threshold is None else torch.clamp(rhos, max=clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)  # rho_s (r_s + g v_{s+1} - V(x_s))
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


UNROLL_FIELDS = ("obs", "action", "reward", "done", "truncated", "final_value", "logits", "baseline")


def unroll_specs(obs_shape, num_actions, T) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Row r = 0..T of an unroll holds x_r and what produced it: (x_r, a_{r-1}, r_{r-1}, done_{r-1}, truncated_{r-1},
    V_mu(final obs of a truncated episode), mu(.|x_{r-1}) logits, V_mu(x_{r-1})); row 0 repeats the previous unroll's
    row T (monobeast's layout). Frames are uint8."""
    R = T + 1
    return {
        "obs": ((R, *obs_shape), np.uint8),
        "action": ((R,), np.int64),
        "reward": ((R,), np.float32),
        "done": ((R,), np.bool_),
        "truncated": ((R,), np.bool_),
        "final_value": ((R,), np.float32),
        "logits": ((R, num_actions), np.float32),
        "baseline": ((R,), np.float32),
    }


class ReservoirBuffer:
    """One actor's replay memory of whole unrolls, filled by reservoir sampling (CLEAR App. A.3, Isele & Cosgun 2018).
    Each unroll gets a random key u ~ U(0, 1); the buffer keeps the `capacity` largest keys seen so far, i.e. the
    buffer is at any time a uniform sample without replacement of all unrolls offered. Actions are stored as int16."""

    def __init__(self, capacity, obs_shape, num_actions, T, rng: np.random.Generator):
        self.capacity, self.rng, self.size, self.num_seen = capacity, rng, 0, 0
        self.data = {
            k: np.zeros((capacity, *shape), dtype=np.int16 if k == "action" else dtype)  # lazily committed
            for k, (shape, dtype) in unroll_specs(obs_shape, num_actions, T).items()
        }  # by the OS as it fills
        self.task, self.keys = np.zeros(capacity, dtype=np.int16), np.full(capacity, -1.0)  # key -1: empty row

    @staticmethod
    def bytes_per_unroll(obs_shape, num_actions, T) -> int:
        specs = unroll_specs(obs_shape, num_actions, T)
        n = sum(int(np.prod(s)) * (2 if k == "action" else np.dtype(d).itemsize) for k, (s, d) in specs.items())
        return n + 2 + 8  # task id + key

    def add(self, unroll: dict, task: int) -> int:
        """Offer one unroll; returns the row it went to, or -1 if it was discarded."""
        self.num_seen += 1
        key = self.rng.random()
        if self.size < self.capacity:
            row, self.size = self.size, self.size + 1
        else:
            row = int(np.argmin(self.keys))  # the current threshold
            if key <= self.keys[row]:
                return -1
        for k, v in unroll.items():
            self.data[k][row] = v
        self.task[row], self.keys[row] = task, key
        return row

    def sample(self) -> int:
        """A uniformly random stored row (the replay half of the next pair)."""
        return int(self.rng.integers(self.size))

    def save(self, path: str) -> None:
        n, tmp = self.size, f"{path}.tmp.npz"
        # the keep/drop stream too: a resumed buffer continues it
        rng_state = json.dumps(self.rng.bit_generator.state)
        np.savez(
            tmp,
            keys=self.keys[:n],
            task=self.task[:n],
            num_seen=self.num_seen,
            rng_state=rng_state,
            **{k: v[:n] for k, v in self.data.items()},
        )
        os.replace(tmp, path)

    def load(self, path: str) -> int:
        """Restore a saved buffer and its RNG (if smaller now: the rows with the largest keys, still uniform); returns
        its size."""
        with np.load(path) as f:
            keep = np.argsort(-f["keys"])[: self.capacity]
            self.size, self.num_seen = len(keep), int(f["num_seen"])
            for k in self.data:
                self.data[k][: self.size] = f[k][keep]
            self.task[: self.size], self.keys[: self.size] = f["task"][keep], f["keys"][keep]
            self.rng.bit_generator.state = json.loads(str(f["rng_state"]))
        return self.size


def select_pairs(replay_valid: np.ndarray, replay_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Which half of each (new, replay) pair the learner trains on: 1 = replay, 0 = new (CLEAR App. A.1). Exactly
    floor or ceil of ratio * B replay unrolls (stochastic rounding: the expected fraction is the ratio), at random
    positions among the pairs that hold a valid replay unroll."""
    which = np.zeros(len(replay_valid), dtype=np.int64)
    if replay_ratio <= 0:
        return which
    target, candidates = replay_ratio * len(replay_valid), np.flatnonzero(replay_valid)
    n = min(int(np.floor(target)) + int(rng.random() < target - np.floor(target)), len(candidates))
    which[rng.choice(candidates, size=n, replace=False)] = 1
    return which


class AlignedUnroll(NamedTuple):
    """Learner outputs and stored data lined up on the same time index t = 0..T-1 (the state x_t)."""

    target_logits: torch.Tensor  # pi(.|x_t)           [T, B, A]
    values: torch.Tensor  # V_theta(x_t)        [T, B]
    bootstrap_value: torch.Tensor  # V_theta(x_T)      [B]
    behaviour_logits: torch.Tensor  # mu(.|x_t)        [T, B, A]
    behaviour_values: torch.Tensor  # V_mu(x_t)        [T, B]
    actions: torch.Tensor  # a_t
    rewards: torch.Tensor  # r_t
    done: torch.Tensor  # episode ended by a_t (terminated or truncated)
    truncated: torch.Tensor  # ended by a time limit
    final_value: torch.Tensor  # V_mu(x_final) of a truncated episode


def align_unroll(logits_all, values_all, batch) -> AlignedUnroll:
    """Learner outputs on rows 0..T against stored rows 1..T (monobeast's shift). Stored row t+1 holds mu(.|x_t) and
    V_mu(x_t), so BOTH V-trace and behavioural cloning compare the learner's outputs at row t with the stored behaviour
    at row t+1 (continual_rl compares row t with row t and is one step off, notes P1)."""
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
def truncated_importance_weights(u: AlignedUnroll) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho_t, mu_t) [T, B]: V-trace's weight min(1, pi(a_t|x_t) / mu(a_t|x_t)) and mu(a_t|x_t) of the stored action.
    A diagnostic per replayed task: rho_t near 0 on steps mu was sure of means replay no longer teaches them."""
    a = u.actions.unsqueeze(-1)
    log_pi = F.log_softmax(u.target_logits, -1).gather(-1, a).squeeze(-1)
    log_mu = F.log_softmax(u.behaviour_logits, -1).gather(-1, a).squeeze(-1)
    return torch.exp(log_pi - log_mu).clamp(max=1.0), log_mu.exp()


def policy_cloning_loss(target_logits, behaviour_logits, replay_mask) -> torch.Tensor:
    """CLEAR Sec. 3: L_policy-cloning = sum_a mu(a|h_s) log(mu(a|h_s) / pi_theta(a|h_s)) = KL(mu || pi_theta), summed
    over time and the replay columns (replay_mask [B], 1 = replay unroll) only."""
    log_mu, log_pi = F.log_softmax(behaviour_logits, dim=-1), F.log_softmax(target_logits, dim=-1)
    kl = (log_mu.exp() * (log_mu - log_pi)).sum(-1)  # [T, B]
    return (kl * replay_mask).sum()


def value_cloning_loss(values, behaviour_values, replay_mask) -> torch.Tensor:
    """CLEAR Sec. 3: L_value-cloning = ||V_theta(h_s) - V_replay(h_s)||_2^2, summed over time and replay columns."""
    return (((values - behaviour_values) ** 2) * replay_mask).sum()


def impala_losses(u: AlignedUnroll, gamma, clip_rho_threshold, clip_pg_rho_threshold, bootstrap_truncation=True):
    """V-trace losses (CLEAR Sec. 3) on an aligned batch; returns (pg_loss, value_loss, entropy_loss, vtrace returns).
    Sums over [T, B] as in scalable_agent/torchbeast. bootstrap_truncation=False treats a time limit as a termination."""
    log_pi, a = F.log_softmax(u.target_logits, dim=-1), u.actions.unsqueeze(-1)
    target_logp = log_pi.gather(-1, a).squeeze(-1)
    behaviour_logp = F.log_softmax(u.behaviour_logits, dim=-1).gather(-1, a).squeeze(-1)
    discounts = gamma * (~u.done).float()  # an episode end (either kind) cuts the trace
    # a truncation bootstraps from V_mu of the true last obs (unless bootstrap_truncation=False)
    rewards = u.rewards + gamma * u.truncated.float() * u.final_value if bootstrap_truncation else u.rewards
    vt = vtrace_from_importance_weights(
        (target_logp - behaviour_logp).detach(),
        discounts,
        rewards,
        u.values.detach(),
        u.bootstrap_value.detach(),
        clip_rho_threshold,
        clip_pg_rho_threshold,
    )
    pg_loss = -(target_logp * vt.pg_advantages).sum()  # L_policy-gradient = -rho_s log pi(a_s|h_s)(r_s + g v_{s+1} - V)
    value_loss = 0.5 * ((vt.vs - u.values) ** 2).sum()  # L_value = (V_theta(h_s) - v_s)^2 (x 1/2 as scalable_agent)
    entropy_loss = (log_pi.exp() * log_pi).sum()  # L_entropy = sum_a pi log pi (minimising it raises the entropy)
    return pg_loss, value_loss, entropy_loss, vt


def clear_loss(logits_all, values_all, batch, replay_mask, args: Args):
    """(loss, detached parts) of one batch: V-trace losses on all unrolls, cloning on the replay unrolls only."""
    u = align_unroll(logits_all, values_all, batch)
    pg_loss, value_loss, entropy_loss, _ = impala_losses(
        u, args.gamma, args.clip_rho_threshold, args.clip_pg_rho_threshold, args.bootstrap_truncation
    )
    pc_loss = policy_cloning_loss(u.target_logits, u.behaviour_logits, replay_mask)
    vc_loss = value_cloning_loss(u.values, u.behaviour_values, replay_mask)
    loss = args.pg_cost * pg_loss + args.baseline_cost * value_loss + args.entropy_cost * entropy_loss
    if args.behavior_cloning:
        loss = loss + args.policy_cloning_cost * pc_loss + args.value_cloning_cost * vc_loss
    mean_entropy = -entropy_loss / u.actions.numel()
    parts = {
        "losses/pg_loss": pg_loss,
        "losses/value_loss": value_loss,
        "losses/entropy": mean_entropy,
        "losses/policy_cloning_loss": pc_loss,
        "losses/value_cloning_loss": vc_loss,
        "losses/total_loss": loss,
    }
    return loss, {k: v.detach() for k, v in parts.items()}


def take_batch(slots: dict, idx: list[int], which: torch.Tensor, slot_free, global_step, unroll_length: int) -> dict:
    """The learner's side of the slot hand-off (CLEAR App. A.1): copy half `which[j]` (1 = replay) of the pair in slot
    idx[j] out of shared memory, count the batch's new frames, then free the slots. Returns the batch [T+1, B, ...].
    Copy before freeing: an actor writes its next unroll into its slot the moment the slot is free.
    Count before freeing: the actor's next unroll then starts at the updated step (the task switch, App. A.6)."""
    slot_index = torch.tensor(idx)
    batch = {k: v[slot_index, which].transpose(0, 1).contiguous() for k, v in slots.items()}
    # frames of NEW experience: every pair carries one new unroll
    global_step.value += len(idx) * unroll_length
    for slot in idx:
        slot_free[slot].release()
    return batch


def learner_loss(model, batch: dict, which: torch.Tensor, args: Args, device):
    """The loss of one batch from `take_batch` (which[j] = 1: column j is a replay unroll).
    Returns (loss, parts, logits [T+1, B, A], values [T+1, B], the batch on the device without frames)."""
    R, B = batch["action"].shape
    logits_all, values_all = model(batch["obs"].to(device).flatten(0, 1))
    logits_all, values_all = logits_all.view(R, B, -1), values_all.view(R, B)
    dev_batch = {k: v.to(device) for k, v in batch.items() if k != "obs"}
    loss, parts = clear_loss(logits_all, values_all, dev_batch, which.float().to(device), args)
    return loss, parts, logits_all, values_all, dev_batch


def task_for_actor(slot: int, step: int, args: Args) -> int:
    """The task of actor `slot` (env e of process p) for an unroll that starts at learner-counted step `step` (CLEAR
    App. A.6: all actors switch at the same step). sequential: (step // steps_per_task) mod K, the last task after the
    end; simultaneous: slot mod K (tasks mix in every process and batch); separate: p mod K (one network per task)."""
    k = len(args.env_ids)
    if args.mode == "sequential":
        return min(step // args.steps_per_task, k * args.num_cycles - 1) % k
    return slot % k if args.mode == "simultaneous" else (slot // args.envs_per_actor) % k


def net_for_task(task: int, args: Args) -> int:
    return task if args.mode == "separate" else 0


def binned_returns(records, task: int, total: int, num_bins: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(bin end steps, mean test return of one task's episodes that ended in each of `num_bins` equal bins of [0, total]),
    forward-filled over empty bins (leading ones dropped). Averaging per bin, not per episode, keeps short (often
    successful or often failed) episodes from dominating (notes P11)."""
    steps_returns = np.array([(step, ret) for step, tk, ret in records if tk == task], dtype=float).reshape(-1, 2)
    edges = np.linspace(0, max(total, 1), num_bins + 1)
    bins = np.clip(np.searchsorted(edges, steps_returns[:, 0], side="right") - 1, 0, num_bins - 1)
    counts = np.bincount(bins, minlength=num_bins)
    means = np.bincount(bins, steps_returns[:, 1], minlength=num_bins) / np.maximum(counts, 1)
    last_filled = np.maximum.accumulate(np.where(counts > 0, np.arange(num_bins), -1))  # forward fill
    return edges[1:][last_filled >= 0], means[last_filled[last_filled >= 0]]


def cumulative_returns(
    records: list[tuple[int, int, float]], num_tasks: int, total: int, num_bins: int = 100
) -> dict[int, float]:
    """Final cumulative reward per task (CLEAR App. C, Figs. 8 and 13): (1/t) sum_{s<t} r_s at the end of training, i.e.
    the time average of the task's test return over the run (on the `binned_returns` grid)."""
    vals = [binned_returns(records, task, total, num_bins)[1] for task in range(num_tasks)]
    return {task: float(v.mean()) if len(v) else float("nan") for task, v in enumerate(vals)}


# ACTOR PROCESSES (module-level so spawn can pickle them)
def actor_loop(
    actor_id,
    args: Args,
    obs_shape,
    num_actions,
    shared_models,
    slots,
    meta,
    full_queues,
    slot_free,
    global_step,
    policy_version,
    frames_done,
    stop,
    stats_queue,
    ckpt_request,
    run_dir,
):
    """One actor process: E = --envs-per-actor envs stepped in lock-step, one batched forward of the latest weights.
    Each env is an actor of the paper (CLEAR App. A.1): per unroll it adds its new unroll to the process's reservoir,
    samples a replay unroll, publishes the pair in its slot (actor_id * E + e) and waits until the learner read it."""
    E, T, seed = args.envs_per_actor, args.unroll_length, args.seed + 1000 * actor_id
    if global_step.value > 0:
        # a resumed run: new streams seeded by the step it resumes at, so the actions, keep/drop draws and env seeds of
        # the first run are not repeated (a restored buffer brings back its own keep/drop stream)
        seed = int(np.random.SeedSequence([seed, global_step.value]).generate_state(1)[0]) % 2**31
    capacity = buffer_capacity_per_actor(args)
    torch.manual_seed(seed)
    buffer = ReservoirBuffer(capacity, obs_shape, num_actions, T, np.random.default_rng(seed)) if capacity > 0 else None
    replay_file, keep_replay = f"replay_actor{actor_id}.npz", buffer is not None and args.checkpoint_replay
    restore = os.path.join(os.path.dirname(args.resume or ""), replay_file)  # saved next to the resumed checkpoint
    if keep_replay and args.resume and os.path.exists(restore):
        print(f"actor-{actor_id} restored {buffer.load(restore)} replay unrolls from {restore}", flush=True)
    saved_request, model = ckpt_request.value, Agent(obs_shape, num_actions, resolve_torso(args, obs_shape))
    ids, run_name = list(range(actor_id * E, (actor_id + 1) * E)), os.path.basename(run_dir)  # our slots, the run
    new = {k: slots[k][ids[0] : ids[-1] + 1, 0].numpy() for k in UNROLL_FIELDS}  # views into shared memory [E, T+1, ..]
    rep = {k: slots[k][ids[0] : ids[-1] + 1, 1].numpy() for k in UNROLL_FIELDS}
    tasks, envs, episode, acquired = [-1] * E, [None] * E, 0, 0
    while not stop.is_set():
        if acquired < E:  # the learner has not read all our last pairs yet
            acquired += slot_free[ids[acquired]].acquire(timeout=0.2)
            continue
        acquired = 0
        if keep_replay and ckpt_request.value != saved_request:  # the learner wrote a checkpoint: save the buffer too
            saved_request = ckpt_request.value
            buffer.save(os.path.join(run_dir, replay_file))
        start_step = global_step.value
        for e, i in enumerate(ids):
            task = task_for_actor(i, start_step, args)
            switch = task != tasks[e]  # CLEAR App. A.6: at the designated learner-counted step; the buffer persists
            for k in UNROLL_FIELDS:  # row 0 repeats the previous unroll's last row (zeros in a new env)
                new[k][e, 0] = 0 if switch else new[k][e, T]
            if switch:
                if envs[e] is not None:
                    envs[e].close()
                video = args.capture_video and actor_id == 0 and e == 0 and task == 0
                tasks[e], envs[e] = task, make_env(args.env_ids[task], seed + e, args, video, f"videos/{run_name}")
                new["obs"][e, 0] = envs[e].reset(seed=seed + 1_000_003 * e + episode)[0]
        version = policy_version.value
        model.load_state_dict(shared_models[net_for_task(tasks[0], args)].state_dict())  # separate: one task each
        for t in range(T):
            r = t + 1  # row r holds what acting on frame t produced (unroll_specs)
            with torch.no_grad():
                logits, value = model(torch.from_numpy(new["obs"][:, t]))
                actions = torch.multinomial(F.softmax(logits, -1), 1).squeeze(1)
            new["action"][:, r], new["logits"][:, r], new["baseline"][:, r] = actions, logits, value
            new["final_value"][:, r], truncated_obs = 0.0, {}  # truncated_obs: env -> final obs of a time limit
            for e, env in enumerate(envs):
                obs, reward, terminated, truncated, info = env.step(int(actions[e]))
                if args.bootstrap_truncation and truncated and not terminated:  # keep it for V_mu(final obs)
                    truncated_obs[e] = obs
                if "episode" in info:
                    stats_queue.put((tasks[e], float(info["episode"]["r"]), int(info["episode"]["l"])))
                if terminated or truncated:
                    episode += 1
                    obs, _ = env.reset()
                new["obs"][e, r], new["reward"][e, r] = obs, reward
                new["done"][e, r], new["truncated"][e, r] = terminated or truncated, truncated and not terminated
            if truncated_obs:
                with torch.no_grad():
                    final = model(torch.from_numpy(np.stack(list(truncated_obs.values()))))[1]
                new["final_value"][list(truncated_obs), r] = final.numpy()
        replay_valid, replay_task = np.zeros(E, np.int64), np.full(E, -1)
        if buffer is not None:  # CLEAR App. A.1: insert the new unrolls (reservoir) then sample replay unrolls
            for e in range(E):
                buffer.add({k: v[e] for k, v in new.items()}, tasks[e])
            rows = [buffer.sample() for _ in range(E)]
            for k in UNROLL_FIELDS:
                rep[k][:] = buffer.data[k][rows]
            replay_valid[:], replay_task[:] = 1, buffer.task[rows]
        meta[ids[0] : ids[-1] + 1] = torch.from_numpy(
            np.stack(
                [
                    np.array(tasks),
                    np.full(E, start_step),
                    np.full(E, version),
                    replay_valid,
                    replay_task,
                    np.full(E, buffer.size if buffer else 0),
                ],
                1,
            )
        )
        frames_done[actor_id] += T * E  # our own counter: no lock a killed actor could leave held
        for e, i in enumerate(ids):
            full_queues[net_for_task(tasks[e], args)].put(i)
    if keep_replay and ckpt_request.value != saved_request:
        buffer.save(os.path.join(run_dir, replay_file))  # the final checkpoint came after our last unroll
    for env in [x for x in envs if x is not None]:
        env.close()


def test_actor_loop(test_id, task, args: Args, obs_shape, num_actions, shared_models, stop, eval_queue):
    """A test actor (CLEAR App. A.5): plays its own task forever with the current weights; no buffer, never feeds the
    learner; reports each finished episode's return."""
    seed = args.seed + 1000 * (args.num_actors + test_id) + 17
    torch.manual_seed(seed)
    env, model = make_env(args.env_ids[task], seed, args), Agent(obs_shape, num_actions, resolve_torso(args, obs_shape))
    (obs, _), t, t0 = env.reset(seed=seed), 0, time.time()
    while not stop.is_set():
        if args.test_actor_max_sps > 0 and t > args.test_actor_max_sps * (time.time() - t0):
            time.sleep(0.01)
            continue
        if t % args.unroll_length == 0:  # refresh the weights as often as a training actor does
            model.load_state_dict(shared_models[net_for_task(task, args)].state_dict())
        with torch.no_grad():
            logits, _ = model(torch.from_numpy(np.asarray(obs)).unsqueeze(0))
            action = int(torch.multinomial(F.softmax(logits, -1), 1).item())
        obs, _, terminated, truncated, info = env.step(action)
        t += 1
        if "episode" in info:
            eval_queue.put((task, float(info["episode"]["r"]), int(info["episode"]["l"])))
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()


def resolve_torso(args: Args, obs_shape) -> str:
    if args.torso != "auto":
        return args.torso
    if tuple(obs_shape[-2:]) == (10, 10):
        return "minatar"
    return "minigrid" if len(obs_shape) == 3 and obs_shape[-1] == 3 else "nature"


def drain(q, limit=10_000):
    for _ in range(limit):
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


if __name__ == "__main__":
    stop_on_signals()  # SIGINT (even inherited-ignored) and SIGTERM: stop every process, write summary.json
    # tyro (--help grouped: common / environment / method); --resume: the checkpoint's flags, given flags override
    args, ckpt, overridden = parse_run_args(Args, "clear_impala.py", FIXED_ON_RESUME)
    validate_args(args)  # only the checks between flags; all before anything heavy and before RunLogger
    obs_shape, num_actions, kind = probe_envs(args)  # and the torso, and --bootstrap-truncation's default
    torso, K, T, B = resolve_torso(args, obs_shape), len(args.env_ids), args.unroll_length, args.batch_size
    num_envs = args.num_actors * args.envs_per_actor  # the paper's actors: one (new, replay) pair each per batch
    num_nets, TOTAL = K if args.mode == "separate" else 1, total_steps(args)
    if ckpt and ckpt["global_step"] >= TOTAL:
        raise SystemExit(
            f"error: --resume: the checkpoint is at step {ckpt['global_step']:,}, the run ends at {TOTAL:,} "
            f"(--steps-per-task x tasks x --num-cycles): raise --steps-per-task or --num-cycles"
        )

    # MEMORY: bytes per stored frame, refuse what cannot fit
    capacity, per_unroll = buffer_capacity_per_actor(args), ReservoirBuffer.bytes_per_unroll(obs_shape, num_actions, T)
    print(
        f"replay: {capacity} unrolls/actor x {args.num_actors} actors = {capacity * args.num_actors * T} frames, "
        f"{per_unroll / T:.0f} B per stored frame (frame {int(np.prod(obs_shape))} B + the unroll's other fields)"
    )
    check_memory((capacity * args.num_actors + 2 * num_envs) * per_unroll, "--buffer-frames")

    logger = start_run(args, ckpt, "+".join(e.replace("ALE/", "") for e in args.env_ids) if K <= 3 else f"{K}tasks")

    # TRY NOT TO MODIFY: seeding
    seed_everything(args.seed, args.torch_deterministic)
    device = select_device(args.cuda)
    set_learner_threads(args.num_actors + K * args.num_test_actors)  # the cores the actors leave free

    # SETUP: networks (one per task if separate), shared CPU copies, optimizers, lr annealed to 0 over the WHOLE run
    models = [Agent(obs_shape, num_actions, torso).to(device) for _ in range(num_nets)]
    shared_models = [Agent(obs_shape, num_actions, torso) for _ in range(num_nets)]
    updates_per_net = max(1, TOTAL // (T * B * num_nets))
    optimizers = [
        torch.optim.RMSprop(m.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)
        for m in models
    ]  # momentum 0 (IMPALA Table G.1)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda n: max(0.0, 1.0 - n / updates_per_net)) for o in optimizers]
    global_step_value, learner_steps, eval_records = 0, [0] * num_nets, []  # eval_records: (global_step, task, return)
    if ckpt:  # restore, then one line
        for objs, key in ((models, "models"), (optimizers, "optimizers"), (schedulers, "schedulers")):
            for obj, state in zip(objs, ckpt[key], strict=True):
                obj.load_state_dict(state)
        global_step_value, learner_steps = ckpt["global_step"], ckpt["learner_steps"]
        eval_records = [tuple(r) for r in ckpt["eval_records"]]
        set_rng_state(ckpt["rng"])
        restored = (
            sum(
                os.path.exists(os.path.join(os.path.dirname(args.resume), f"replay_actor{i}.npz"))
                for i in range(args.num_actors)
            )
            if args.checkpoint_replay and capacity
            else 0
        )  # actors load them
        print(
            f"resumed {args.resume} at step {global_step_value:,}: model(s), optimizer(s), lr schedule, RNG, task "
            f"{task_for_actor(0, global_step_value, args)}, {len(eval_records)} test episodes, replay buffers of "
            f"{restored}/{args.num_actors} actors (others start empty); flags from this command line: "
            f"{', '.join(overridden) or 'none'}; runs to step {TOTAL:,}",
            flush=True,
        )
    for m, s in zip(models, shared_models):  # the actors' copies: CPU, shared memory
        s.load_state_dict(m.state_dict())
        s.share_memory()

    # SETUP: shared-memory slots, one (new, replay) pair per actor; only indices travel through queues
    ctx = torch.multiprocessing.get_context(args.start_method)
    if args.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "gymnasium", "common.minigrid_env", "common.minatar_env", "common.atari_env"])
    slots = {
        k: torch.from_numpy(np.zeros((num_envs, 2, *shape), dtype=dtype)).share_memory_()
        for k, (shape, dtype) in unroll_specs(obs_shape, num_actions, T).items()
    }
    meta = torch.zeros(num_envs, 6, dtype=torch.int64).share_memory_()  # task, step, version, replay valid/task, fill
    full_queues = [ctx.SimpleQueue() for _ in range(num_nets)]
    # one semaphore per slot (1 = free), not an Event: Event.set() hangs on an actor killed inside Event.wait()
    slot_free = [ctx.Semaphore(1) for _ in range(num_envs)]
    global_step = ctx.Value("q", global_step_value, lock=False)  # single writer: the learner
    policy_version = ctx.Value("q", sum(learner_steps), lock=False)
    frames_done = ctx.Array("q", args.num_actors, lock=False)  # one counter per actor, each its only writer
    ckpt_request = ctx.Value("q", 0, lock=False)  # bumped at each checkpoint: actors then save their buffers
    stats_queue, eval_queue = ctx.Queue(), ctx.Queue()
    procs, rng = ProcessGroup(ctx), np.random.default_rng(args.seed)
    if ckpt:
        # the pair-selection stream continues where the checkpoint left it
        rng.bit_generator.state = ckpt["pair_rng"]
    task_mismatch, error = 0, None
    names = [e.replace("/", "_") for e in args.env_ids]  # in metric names
    try:
        for i in range(args.num_actors):
            procs.start(
                actor_loop,
                (
                    i,
                    args,
                    obs_shape,
                    num_actions,
                    shared_models,
                    slots,
                    meta,
                    full_queues,
                    slot_free,
                    global_step,
                    policy_version,
                    frames_done,
                    procs.stop_event,
                    stats_queue,
                    ckpt_request,
                    str(logger.dir),
                ),
                name=f"actor-{i}",
            )
        for task in range(K):
            for j in range(args.num_test_actors):
                procs.start(
                    test_actor_loop,
                    (
                        task * args.num_test_actors + j,
                        task,
                        args,
                        obs_shape,
                        num_actions,
                        shared_models,
                        procs.stop_event,
                        eval_queue,
                    ),
                    name=f"test-{task}-{j}",
                )
        start_time, start_step = time.time(), global_step_value
        last_log, last_log_step, last_frames, last_ckpt = start_time, global_step_value, 0, global_step_value
        train_returns = collections.deque(maxlen=100)
        window = collections.defaultdict(lambda: collections.deque(maxlen=20))  # last test returns per task
        metrics_acc, n_acc, learn_time = collections.defaultdict(float), 0, 0.0
        rho_sum, rho_count = torch.zeros(K, device=device), torch.zeros(K, device=device)  # per replayed task
        while global_step.value < TOTAL:
            # COLLECT: B pairs, one per actor, from the queue of the network to train next
            net, idx = sum(learner_steps) % num_nets, []
            while len(idx) < B:
                if full_queues[net].empty():
                    procs.check()  # a dead actor stops the run with its traceback
                    time.sleep(0.002)
                    continue
                idx.append(full_queues[net].get())
            t_learn = time.time()
            m = meta[torch.tensor(idx)].clone()
            which = torch.from_numpy(select_pairs(m[:, 3].numpy().astype(bool), args.replay_ratio, rng))
            # every unroll must be on the task its start step designates (App. A.6)
            task_mismatch += sum(row[0] != task_for_actor(a_id, row[1], args) for a_id, row in zip(idx, m.tolist()))
            batch = take_batch(slots, idx, which, slot_free, global_step, T)

            # LEARN
            model, optimizer = models[net], optimizers[net]
            loss, parts, logits_all, values_all, dev_batch = learner_loss(model, batch, which, args, device)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            schedulers[net].step()
            shared_models[net].load_state_dict(model.state_dict())
            learner_steps[net] += 1
            policy_version.value += 1
            learn_time += time.time() - t_learn
            # loss parts stay on the device and are summed there: one sync per log line, not 7 per batch
            for k, v in parts.items():
                metrics_acc[k] += v
            metrics_acc["losses/grad_norm"] += grad_norm.detach()
            metrics_acc["charts/replay_fraction"] += float(which.float().mean())
            metrics_acc["charts/policy_lag"] += float((policy_version.value - 1 - m[:, 2]).float().mean())
            metrics_acc["charts/buffer_fill"] += float(m[:, 5].float().mean() / max(1, capacity))
            n_acc += 1
            if args.replay_ratio > 0:  # DIAGNOSTIC: rho_t on the replayed steps whose stored action the behaviour
                # policy was sure of (mu >= 0.5), summed per task the unroll came from (no sync here)
                rho, mu_taken = truncated_importance_weights(align_unroll(logits_all, values_all, dev_batch))
                confident = (mu_taken >= 0.5).float() * which.float().to(device)
                replay_source = m[:, 4].clamp(min=0).to(device)
                rho_sum.index_add_(0, replay_source, (rho * confident).sum(0))
                rho_count.index_add_(0, replay_source, confident.sum(0))

            # LOG
            gs = global_step.value
            for task, ret, length in drain(stats_queue):
                train_returns.append(ret)
                logger.log(
                    gs,
                    {
                        "charts/episodic_return": ret,
                        "charts/episodic_length": length,
                        f"train/{names[task]}/episodic_return": ret,
                    },
                )
            for task, ret, length in drain(eval_queue):
                eval_records.append((gs, task, ret))
                window[task].append(ret)
                logger.log(gs, {f"eval/{names[task]}/episodic_return": ret, f"eval/{names[task]}/episodic_length": length})
            if (now := time.time()) - last_log >= args.log_every_seconds or gs >= TOTAL:
                frames = sum(frames_done)
                out = {
                    **{k: float(v) / n_acc for k, v in metrics_acc.items()},
                    "charts/SPS": int((gs - start_step) / (now - start_time)),
                    "charts/learner_SPS": int((gs - last_log_step) / max(1e-9, learn_time)),
                    "charts/actor_SPS": int((frames - last_frames) / (now - last_log)),
                    "charts/learning_rate": schedulers[net].get_last_lr()[0],
                    "charts/task": task_for_actor(0, gs, args),
                    "charts/task_mismatch": task_mismatch,
                }
                out.update(
                    {
                        f"replay/{names[k]}/importance_weight": rho / count
                        for k, (rho, count) in enumerate(zip(rho_sum.tolist(), rho_count.tolist()))
                        if count > 0
                    }
                )
                rho_sum.zero_()
                rho_count.zero_()
                logger.log(gs, out)
                evals = " ".join(f"{np.mean(window[k]):.2f}" if window[k] else "-" for k in range(K))
                logger.progress(
                    gs,
                    out["charts/SPS"],
                    np.mean(train_returns) if train_returns else None,
                    "total_loss",
                    out["losses/total_loss"],
                    f"task {out['charts/task']} replay {out['charts/replay_fraction']:.2f} eval [{evals}]",
                )
                metrics_acc.clear()
                n_acc, learn_time, last_log, last_log_step, last_frames = 0, 0.0, now, gs, frames

            # CHECKPOINT
            if args.checkpoint_every and (gs - last_ckpt >= args.checkpoint_every or gs >= TOTAL):
                last_ckpt = gs
                save_checkpoint(
                    logger.dir / "checkpoint.pt",
                    {
                        "script": "clear_impala.py",
                        "run_name": logger.run_name,
                        "args": vars(args),
                        "models": [x.state_dict() for x in models],
                        "optimizers": [o.state_dict() for o in optimizers],
                        "schedulers": [s.state_dict() for s in schedulers],
                        "global_step": gs,
                        "learner_steps": learner_steps,
                        "eval_records": eval_records,
                        "rng": rng_state(),
                        "pair_rng": rng.bit_generator.state,
                    },
                )
                ckpt_request.value += 1
            procs.check()
    except (KeyboardInterrupt, StopRun) as e:
        error = e
    finally:  # actors with a buffer to save for the last checkpoint get time for it (a large .npz takes seconds)
        procs.stop(timeout=120.0 if args.checkpoint_replay and ckpt_request.value else 5.0)

    # SAVE + SUMMARY: returns averaged over the steps reached (an interrupted run: its measured part)
    eval_records += [(global_step.value, task, ret) for task, ret, _ in drain(eval_queue)]
    (logger.dir / "eval_records.json").write_text(json.dumps(eval_records))  # clear_forgetting_table.py plots them
    cum = cumulative_returns(eval_records, K, global_step.value)
    returns = {e: [r for _, t, r in eval_records if t == k] for k, e in enumerate(args.env_ids)}
    summary = {
        "global_step": global_step.value,
        "mode": args.mode,
        "replay_ratio": args.replay_ratio,
        "behavior_cloning": args.behavior_cloning,
        "env_ids": args.env_ids,
        "final_cumulative_return": {e: cum[k] for k, e in enumerate(args.env_ids)},
        "final_return_last20": {e: float(np.mean(r[-20:])) if r else float("nan") for e, r in returns.items()},
        "num_eval_episodes": {e: len(r) for e, r in returns.items()},
        "task_mismatch": task_mismatch,
    }
    print(json.dumps({k: summary[k] for k in ("global_step", "final_cumulative_return", "task_mismatch")}))

    def save_model():
        torch.save(
            {"models": [x.state_dict() for x in models], "args": vars(args)}, path := logger.dir / f"{args.exp_name}.model"
        )
        return path

    finish_run(logger, error, summary, save_model if args.save_model else None)

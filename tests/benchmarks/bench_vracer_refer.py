"""Benchmark for vracer_refer.py (not collected by pytest).

1. Learner (`--skip-learner` to leave out): ms per gradient step at B = 256 on full replay memories of N = 2**14,
   2**16 and 2**18 (`--sizes`; Hopper-sized synthetic episodes of 250-1000 steps) with the full ReF-ER step (rho/V
   write-back, n_far, the Eq. (8) targets of the sampled steps, beta, and every `stats_every` steps the reward scale,
   the n_far recount and the maps' recomputation), for each form of the Eq. (8) targets at each N: the script's
   blocks (Q^ret read when sampled, `vtbc_at`), the vectorised eager refresh the script used before
   (`EagerVectorisedReplay`) and the readable eager refresh by the recursion of App. C Alg. 3 (`EagerReplay`; both
   left out with `--skip-forms`); interleaved in one process, in chunks of `--steps` steps, with SB3's SAC (`--sac`:
   the CleanRL/Zoo baseline, 2 x 256 ReLU actor and twin critics, B = 256, on random Hopper-v5 transitions; installs
   stable-baselines3==2.9.2 into this environment when it is missing, benchmark only, not in requirements.txt) and
   with a bare learner (no write-back, targets refresh or n_far: not a correct V-RACER) at the largest N. Then the
   split of one step of the script's form per N, timed inside real steps (interleaved across N only): sampling, the
   Eq. (8) targets (reading Q^ret of the batch and updating the maps of the written-back steps), network (forward,
   loss, backward, Adam), bookkeeping (the rest of the step: batch assembly, the host copy, write-back, n_far, beta),
   and the periodic work amortised over stats_every; and the time of reading the batch's rows alone (the fancy
   indexing of train_step's batch assembly) per N. Then that the forms' Q^ret agree after the same write-backs.
2. Actors (`--skip-actors` to leave out): env steps/s with `--num-actors` actor processes (policy forward + shared-memory
   ring) against env-only stepping of the same task in this process.

Usage: python tests/benchmarks/bench_vracer_refer.py [--sac] [--sizes 16384 65536 262144] [--steps 25] [--reps 12]
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import vracer_refer as vr  # noqa: E402
from common.logger import MetricAverager  # noqa: E402

OBS_DIM = 11
ACT_DIM = 3


def filled_replay(N, rng, replay_class=vr.EpisodeReplay, ep_len=1000):
    """A full memory of Hopper-sized episodes (250-1000 steps, the shorter ones terminated), with the spread of rho
    and V of a memory in training."""
    rm = replay_class(N, OBS_DIM, ACT_DIM, 0.995, ep_len, vr.Args.per_alpha)
    while rm.size < N:
        L = int(rng.integers(ep_len // 4, ep_len + 1))
        term = L < ep_len
        rm.add_episode(
            rng.normal(size=(L, OBS_DIM)),
            np.clip(rng.normal(size=(L, ACT_DIM)) * 0.45, -1.3, 1.3),
            np.zeros((L, ACT_DIM)),
            np.full((L, ACT_DIM), 0.2**0.5),
            rng.normal(size=L),
            np.zeros(L),
            term,
            final_value=0.0,
            final_obs=np.zeros(OBS_DIM),
        )
    stored = rm.valid[: rm.high_water]
    rm.rho[: rm.high_water][stored] = np.exp(0.3 * rng.normal(size=stored.sum()))
    rm.value[: rm.high_water][stored] = rng.normal(size=stored.sum())
    rm.update_reward_scale()
    rm.recount_far(vr.refer_cmax(0, 4.0, 5e-7))
    return rm


# ---------------------------------------------------------------- the stored-Q^ret forms of App. C Alg. 3
class EagerReplay(vr.EpisodeReplay):
    """The readable form: Q^ret stored per step; after each gradient step, the recursion of Eq. (8) from the latest
    sampled step of each sampled episode down to its first step (App. C Alg. 3),

        V^tbc_t = V(s_t) + c_t (Q^ret_t - V(s_t))   (Eq. (7)),   Q^ret_{t-1} = r_t + gamma V^tbc_t,

    all episodes at once, one numpy pass per time step; the whole memory at each recomputation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.qret = np.zeros(self.capacity)

    def qret_at(self, slots):
        return self.qret[np.asarray(slots)]

    def _set_maps(self, slots):
        """(The blocks' maps are the script's form: not kept here.)"""

    def add_episode(self, *args, **kwargs):
        super().add_episode(*args, **kwargs)
        start, length = self.episodes[-1]
        last = start + length - 1
        self.qret[last] = self.scaled_reward[last] + self.gamma * self.boot_value[last]
        self.recompute_qret(np.array([last]), np.array([start]))

    def update_samples(self, idx, rho, value, boot_idx=None, boot_value=None, priority=None):
        super().update_samples(idx, rho, value, boot_idx, boot_value, priority)
        if boot_idx is not None and len(boot_idx):
            self.qret[boot_idx] = self.scaled_reward[boot_idx] + self.gamma * self.boot_value[boot_idx]
        self.refresh(np.asarray(idx))

    def refresh(self, idx):
        descending = np.sort(idx)[::-1]
        latest = descending[np.unique(self.episode_start[descending], return_index=True)[1]]
        self.recompute_qret(latest, self.episode_start[latest])

    def recompute_qret(self, top, start):
        t = np.asarray(top)
        start = np.asarray(start)
        while len(t):
            has_prev = t > start
            t = t[has_prev]
            start = start[has_prev]
            trace = np.minimum(1.0, self.rho[t])
            vtbc = self.value[t] + trace * (self.qret[t] - self.value[t])
            self.qret[t - 1] = self.scaled_reward[t - 1] + self.gamma * vtbc
            t = t - 1

    def recompute(self):
        super().recompute()
        if not hasattr(self, "qret") or not self.episodes:
            return
        first = np.array([start for start, _ in self.episodes])
        last = self.episode_last[first]
        self.qret[last] = self.scaled_reward[last] + self.gamma * self.boot_value[last]
        self.recompute_qret(last, first)


class EagerVectorisedReplay(EagerReplay):
    """The vectorised form of `EagerReplay.refresh` the script used before (its `refresh_delta`): Eq. (8) is linear
    between two sampled steps, so a change delta_u of V^tbc_u changes V^tbc_j (j < u, down to the previous sample) by
    prod_{i=j}^{u-1} gamma c_i delta_u: one cumulative sum of log(gamma c) over the concatenated prefixes, the samples
    of one episode chained top-down."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # log(gamma c_t), kept as rho is written
        self.log_trace = np.zeros(self.capacity)

    def add_episode(self, *args, **kwargs):
        super().add_episode(*args, **kwargs)
        start, length = self.episodes[-1]
        self.log_trace[start : start + length] = np.log(self.gamma)

    def update_samples(self, idx, rho, value, boot_idx=None, boot_value=None, priority=None):
        idx = np.asarray(idx)
        unique = np.unique(idx)
        trace_old = np.minimum(1.0, self.rho[unique])
        self.vtbc_old = (1.0 - trace_old) * self.value[unique] + trace_old * self.qret[unique]
        super().update_samples(idx, rho, value, boot_idx, boot_value, priority)

    def recompute(self):
        if hasattr(self, "log_trace"):
            in_use = slice(0, self.high_water)
            self.log_trace[in_use] = np.log(np.maximum(self.gamma * np.minimum(1.0, self.rho[in_use]), 1e-300))
        super().recompute()

    def refresh(self, idx):
        idx = np.unique(idx)
        self.log_trace[idx] = np.log(np.maximum(self.gamma * np.minimum(1.0, self.rho[idx]), 1e-300))
        vtbc_old = self.vtbc_old
        log_trace = self.log_trace
        starts = self.episode_start[idx]
        order = np.lexsort((-idx, starts))
        sampled = idx[order]
        sampled_starts = starts[order]
        vtbc_old = vtbc_old[order]
        n = len(sampled)
        is_latest = np.append(True, sampled_starts[1:] != sampled_starts[:-1])
        latest_pos = np.flatnonzero(is_latest)
        rank = np.arange(n) - np.repeat(latest_pos, np.diff(np.append(latest_pos, n)))
        latest = sampled[is_latest]
        first = sampled_starts[is_latest]
        prefix_len = latest - first + 1
        offsets = np.cumsum(prefix_len) - prefix_len
        slots = np.repeat(first - offsets, prefix_len) + np.arange(int(prefix_len.sum()))
        sample_pos = np.repeat(offsets - first, np.diff(np.append(latest_pos, n))) + sampled
        log_tail = np.cumsum(log_trace[slots][::-1])[::-1]
        trace = np.minimum(1.0, self.rho[sampled])
        base = (1.0 - trace) * self.value[sampled]
        delta = np.zeros(n)
        for this_rank in range(int(rank.max()) + 1):
            sel = np.flatnonzero(rank == this_rank)
            q = self.qret[sampled[sel]]
            if this_rank > 0:
                above = sel - 1
                q = q + self.gamma * np.exp(log_tail[sample_pos[sel] + 1] - log_tail[sample_pos[above]]) * delta[above]
            delta[sel] = base[sel] + trace[sel] * q - vtbc_old[sel]
        by_pos = np.argsort(sample_pos)
        piece = np.diff(np.append(-1, sample_pos[by_pos]))
        dq = np.exp(log_tail - np.repeat(log_tail[sample_pos[by_pos]], piece)) * np.repeat(self.gamma * delta[by_pos], piece)
        dq[offsets] = 0.0
        self.qret[slots - 1] += dq


# ---------------------------------------------------------------- learners
def make_learner(rm, rng, refer="full", device=torch.device("cpu")):
    args = vr.Args(refer=refer, batch_size=256, buffer_size=rm.N)
    agent = vr.Agent(OBS_DIM, ACT_DIM).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
    obs_mean = torch.zeros(OBS_DIM, device=device)
    obs_std = torch.ones(OBS_DIM, device=device)
    beta = 0.5 if refer != "none" else 1.0
    learner = vr.Learner(agent, optimizer, rm, obs_mean, obs_std, rng, device, k=0, beta=beta)
    return learner, args


def learner_run(learner, args, bookkeeping=True):
    """n gradient steps as the script's `learn` does them (the stats_every updates included), or bare steps."""
    step_stats = MetricAverager()

    def run(n):
        if bookkeeping:
            done = 0
            while done < n:
                done += vr.learn(learner, args, learner.k + n - done, step_stats, lambda: None)
        else:
            # the script's train_step without its write-back: this instance's update_samples does nothing (the
            # replay is shared with another setup, so the class's method comes back after the steps)
            replay = learner.replay
            replay.update_samples = skip_write_back
            try:
                for _ in range(n):
                    vr.train_step(learner, args)
            finally:
                del replay.update_samples

    return run


def skip_write_back(*args, **kwargs) -> None:
    """The bare learner's stand-in for EpisodeReplay.update_samples: no rho / V write-back, no n_far, no priorities."""


def make_sac(env_id, device, transitions=10_000):
    """SB3 SAC with its defaults, its replay filled with random transitions, ready for `model.train(steps, 256)`."""
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        import subprocess

        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "stable-baselines3==2.9.2"])
    import gymnasium as gym
    from stable_baselines3 import SAC
    from stable_baselines3.common.logger import configure

    env = gym.make(env_id)
    model = SAC("MlpPolicy", env, batch_size=256, learning_starts=0, device=device, seed=0)
    model.set_logger(configure(None, []))
    obs, _ = env.reset(seed=0)
    for _ in range(transitions):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        model.replay_buffer.add(obs, next_obs, action, np.array([reward]), np.array([terminated]), [{}])
        obs = next_obs
        if terminated or truncated:
            obs, _ = env.reset()
    return model


def interleaved(setups: dict, steps: int, reps: int, device, warm_up: bool = True) -> dict:
    """Gradient steps/s (wall) of each setup, run in short alternating chunks so machine load hits all alike."""
    if warm_up:
        for run in setups.values():
            run(20)
    wall = {name: 0.0 for name in setups}
    for _ in range(reps):
        for name, run in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[name] += time.perf_counter() - start
    return {name: reps * steps / seconds for name, seconds in wall.items()}


class Split:
    """The script's learner (`learn`, as `learner_run`) with each part of `train_step` timed inside its real steps
    (module docstring): wrappers around the sampler, the Q^ret read and the maps' update, the network's forward, loss,
    backward and Adam step; the rest of the step is bookkeeping. Run as a setup of `interleaved`, so that its parts add
    up to the time the learner table shows."""

    def __init__(self, learner, args):
        self.learner = learner
        self.args = args
        self.learn = learner_run(learner, args)
        self.reset()

    def reset(self) -> None:
        self.spent = {}
        self.steps = 0
        self.total = 0.0

    def timed(self, owner, name, part):
        real = getattr(owner, name)
        spent = self.spent

        def wrapper(*a, **k):
            start = time.perf_counter()
            out = real(*a, **k)
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, wrapper)
        return real

    def __call__(self, steps: int) -> None:
        learner = self.learner
        replay = learner.replay
        real_loss = self.timed(vr, "refer_loss", "network")
        real_backward = self.timed(torch.Tensor, "backward", "network")
        self.timed(replay, "sample", "sampling")
        self.timed(replay, "qret_at", "Eq. (8) targets")
        self.timed(replay, "_set_maps", "maps")
        self.timed(replay, "update_samples", "write-back")
        self.timed(learner.agent, "forward", "network")
        self.timed(learner.optimizer, "step", "network")
        start = time.perf_counter()
        self.learn(steps)
        self.total += time.perf_counter() - start
        self.steps += steps
        vr.refer_loss = real_loss
        torch.Tensor.backward = real_backward
        for name in ("sample", "qret_at", "_set_maps", "update_samples"):
            vars(replay).pop(name)
        vars(learner.agent).pop("forward")
        vars(learner.optimizer).pop("step")

    def periodic_ms(self, calls: int = 2) -> float:
        """ms per step of the work of every stats_every steps (`learn`: the reward scale with the maps of every step,
        the n_far recount), amortised: timed apart, as no such step falls among the few hundred timed."""
        replay = self.learner.replay
        start = time.perf_counter()
        for _ in range(calls):
            replay.update_reward_scale()
            replay.recount_far(vr.refer_cmax(self.learner.k, self.args.C, self.args.A))
        return 1e3 * (time.perf_counter() - start) / calls / self.args.stats_every

    def ms(self) -> dict:
        ms = {part: 1e3 * seconds / self.steps for part, seconds in self.spent.items()}
        # the maps' update is inside the write-back call; it belongs to the targets
        ms["write-back"] -= ms["maps"]
        ms["Eq. (8) targets"] += ms.pop("maps")
        step_ms = 1e3 * self.total / self.steps
        measured = ("sampling", "Eq. (8) targets", "network")
        ms["bookkeeping"] = step_ms - sum(ms[part] for part in measured)
        ms["step"] = step_ms
        return {part: ms[part] for part in (*measured, "bookkeeping", "step")}


def episodes_hit(rm, rng, draws=50):
    """Mean distinct episodes per batch and the prior steps of them an eager refresh rewrites."""
    hit = []
    for _ in range(draws):
        idx = rm.sample(256, rng)
        starts = rm.episode_start[idx]
        latest = np.array([idx[starts == s].max() for s in np.unique(starts)])
        hit.append((len(latest), int((latest - np.unique(starts) + 1).sum())))
    return np.mean(hit, axis=0)


# the forms of the Eq. (8) targets: the script's, and the two stored-Q^ret forms above
FORMS = {
    "blocks (the script)": vr.EpisodeReplay,
    "eager, vectorised (before)": EagerVectorisedReplay,
    "eager recursion (readable)": EagerReplay,
}


def gather_ms(rm, rng, draws=400):
    """ms to read the batch's rows as train_step's batch assembly does (obs, action, mu_mean, mu_std, truncated_last of
    256 sampled slots), without the rest of the step."""
    batches = [rm.sample(256, rng) for _ in range(draws)]
    start = time.perf_counter()
    for idx in batches:
        rm.obs[idx]
        rm.action[idx]
        rm.mu_mean[idx]
        rm.mu_std[idx]
        rm.truncated_last[idx]
    return 1e3 * (time.perf_counter() - start) / draws


def bench_learner(a):
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    forms = {"blocks (the script)": vr.EpisodeReplay} if a.skip_forms else FORMS
    splits = {}
    setups = {}
    for N in a.sizes:
        for form, replay_class in forms.items():
            rng = np.random.default_rng(N)
            learner, args = make_learner(filled_replay(N, rng, replay_class), rng, device=device)
            if replay_class is vr.EpisodeReplay:
                splits[N] = Split(learner, args)
                setups[form, N] = splits[N]
            else:
                setups[form, N] = learner_run(learner, args)
    N_max = max(a.sizes)
    rng = np.random.default_rng(0)
    bare, bare_args = make_learner(splits[N_max].learner.replay, rng, "none", device)
    setups["bare", N_max] = learner_run(bare, bare_args, bookkeeping=False)
    if a.sac:
        sac = make_sac(a.env_id, device)
        setups["SAC", None] = lambda n: sac.train(gradient_steps=n, batch_size=256)
    for run in setups.values():
        run(20)  # warm-up
    for split in splits.values():
        split.reset()
    sps = interleaved(setups, a.steps, a.reps, device, warm_up=False)
    print(
        f"learner ({device}, B=256, {a.threads} thread(s), {a.reps} x {a.steps} steps each, interleaved, load average "
        f"{os.getloadavg()[0]:.1f} at the end), ms per gradient step:"
    )
    print("  | N | " + " | ".join(forms) + " | bare learner | SB3 SAC | " + " | ".join(f"{f} / SAC" for f in forms) + " |")
    print("  " + "|---" * (2 * len(forms) + 4) + "|")
    sac_sps = sps.get(("SAC", None))
    for N in a.sizes:
        times = [f"{1e3 / sps[form, N]:.2f}" for form in forms]
        bare_ms = f"{1e3 / sps['bare', N]:.2f}" if ("bare", N) in sps else ""
        sac_ms = f"{1e3 / sac_sps:.2f}" if sac_sps else ""
        ratios = [f"{sps[form, N] / sac_sps:.2f}x" if sac_sps else "" for form in forms]
        print(f"  | {N:,} | " + " | ".join(times) + f" | {bare_ms} | {sac_ms} | " + " | ".join(ratios) + " |")
    print("split of one step of the blocks, ms (timed inside the same steps as the table):")
    print(
        "  | N | episodes hit / their prior steps | sampling | Eq. (8) targets | network | bookkeeping | step | periodic, "
        "amortised | the batch's row reads alone |"
    )
    print("  |---|---|---|---|---|---|---|---|---|")
    gathers = {N: [] for N in a.sizes}
    for _ in range(5):
        for N, split in splits.items():
            gathers[N].append(gather_ms(split.learner.replay, rng))
    for N, split in splits.items():
        hit, prior = episodes_hit(split.learner.replay, rng)
        parts = " | ".join(f"{value:.3f}" for value in split.ms().values())
        print(f"  | {N:,} | {hit:.0f} / {prior:,.0f} | {parts} | {split.periodic_ms():.3f} | {np.median(gathers[N]):.3f} |")


def check_forms_agree(a):
    """The script's block form and the recursion give the same Q^ret after the same write-backs."""
    memories = [filled_replay(min(a.sizes), np.random.default_rng(2), form) for form in (vr.EpisodeReplay, EagerReplay)]
    rng = np.random.default_rng(3)
    for _ in range(50):
        idx = memories[0].sample(256, rng)
        rho = np.exp(0.3 * rng.normal(size=256))
        value = rng.normal(size=256)
        for memory in memories:
            memory.update_samples(idx, rho, value)
    stored = np.flatnonzero(memories[0].valid)
    gap = np.abs(memories[0].qret_at(stored) - memories[1].qret_at(stored)).max()
    print(f"forms: after 50 write-backs, max |Q^ret by blocks - Q^ret by the recursion| over the memory: {gap:.1e}")


def bench_actors(a):
    import torch.multiprocessing as mp

    from common.processes import ProcessGroup

    env = vr.make_env(a.env_id, 0)
    obs_dim = env.observation_space.shape[0]
    act_dim = env.action_space.shape[0]
    env.reset(seed=0)
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < a.seconds:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        n += 1
        if term or trunc:
            env.reset()
    env_only = n / (time.perf_counter() - t)
    env.close()
    args = vr.Args(env_id=a.env_id, num_actors=a.num_actors)
    agent = vr.Agent(obs_dim, act_dim)
    weights = torch.nn.utils.parameters_to_vector(agent.parameters()).detach()
    procs = ProcessGroup(mp.get_context("spawn"))
    shared = vr.make_shared_handles(a.num_actors, 4096, obs_dim, act_dim, len(weights), procs.stop_event)
    shared.weights.copy_(weights)
    shared.obs_std[:] = 1.0
    shared.steps_allowed[0] = 10**12
    shared.weights_seq[0] = 2  # version 1 (the seqlock of publish_weights counts twice per publish)
    written = shared.written
    for i in range(a.num_actors):
        procs.start(vr.actor_loop, (i, args, obs_dim, act_dim, shared, i, "bench"), name=f"actor-{i}")
    try:
        while int(written.sum()) == 0:  # start-up (spawn + imports)
            procs.check()
            time.sleep(0.05)
        n0 = int(written.sum())
        t = time.perf_counter()
        while time.perf_counter() - t < a.seconds:
            shared.read.copy_(written)  # a learner that consumes everything at once
            shared.weights_seq[0] += 2  # a new version every 10 ms, as a learner at ~100 steps/s publishing every step
            time.sleep(0.01)
            procs.check()
        actors = (int(written.sum()) - n0) / (time.perf_counter() - t)
    finally:
        procs.stop()
    print(
        f"actors ({a.env_id}): {a.num_actors} actor processes {actors:.0f} env steps/s vs env-only "
        f"(1 process, random actions) {env_only:.0f} env steps/s ({actors / env_only:.2f}x)"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[2**14, 2**16, 2**18], help="replay sizes N")
    p.add_argument("--steps", type=int, default=25, help="gradient steps per interleaved chunk")
    p.add_argument("--reps", type=int, default=12, help="interleaved chunks per setup")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--env-id", default="Hopper-v5")
    p.add_argument("--num-actors", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--skip-actors", action="store_true")
    p.add_argument("--skip-learner", action="store_true")
    p.add_argument("--skip-forms", action="store_true", help="the script's form only (no eager forms, no agreement check)")
    p.add_argument("--sac", action="store_true", help="add SB3 SAC to the learner comparison (installs it if missing)")
    a = p.parse_args()
    if not a.skip_learner:
        bench_learner(a)
    if not a.skip_forms:
        check_forms_agree(a)
    if not a.skip_actors:
        bench_actors(a)

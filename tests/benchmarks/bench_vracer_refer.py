"""Benchmark for vracer_refer.py (not collected by pytest).

1. Learner: gradient steps/s at B=256 on a full replay memory (N = 2**18 by default, Hopper-sized synthetic episodes)
   with the full ReF-ER bookkeeping (rho/V write-back, n_far, Q^ret refresh of prior steps, beta) against the same
   learner with `--refer none` (V-RACER with conventional ER, which still refreshes its Retrace targets) and against a
   bare learner with no write-back/refresh at all, interleaved in one process; plus a breakdown of the time.
2. Forms (`--skip-forms` to leave out): the recursion over time against the vectorised form, interleaved in one
   process on the same memory, for the three places the script computes Eq. (8):
   - the refresh of prior steps after each gradient step: `refresh_delta` (vectorised, kept) against
     `recompute_qret` run from the latest sampled step of each episode (the recursion), as learner steps/s;
   - `recompute_all` at every reward-scale update (every `stats_every` steps): the recursion (the script's form)
     against the doubling scan the script used before, per call and per gradient step;
   - `vtbc_targets` at each episode's insertion: the loop (the script's form) against the doubling scan.
   With `--sac`: SB3's SAC (the CleanRL/Zoo baseline: 2 x 256 ReLU actor and twin critics, B = 256, one
   gradient step per env step) in the same interleaved loop, on a replay of random Hopper-v5 transitions; installs
   stable-baselines3==2.9.2 into this environment when it is missing (benchmark only, not in requirements.txt).
3. Actors: env steps/s with `--num-actors` actor processes (policy forward + shared-memory ring) against env-only
   stepping of the same task in this process.

Usage: python tests/benchmarks/bench_vracer_refer.py [--steps 300] [--buffer-size 262144] [--env-id Hopper-v5]
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import vracer_refer as vr  # noqa: E402


def filled_replay(N, obs_dim, act_dim, ep_len, rng):
    rm = vr.EpisodeReplay(N, obs_dim, act_dim, 0.995, ep_len)
    while rm.size < N:
        L = int(rng.integers(ep_len // 4, ep_len + 1))
        term = L < ep_len
        rm.add_episode(
            rng.normal(size=(L, obs_dim)),
            np.clip(rng.normal(size=(L, act_dim)) * 0.45, -1.3, 1.3),
            np.zeros((L, act_dim)),
            np.full((L, act_dim), 0.2**0.5),
            rng.normal(size=L),
            np.zeros(L),
            term,
            final_value=0.0,
            final_obs=np.zeros(obs_dim),
        )
    rm.update_reward_scale()
    return rm


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


def train_steps(learner, state, args, bookkeeping: bool):
    """A function running n V-RACER gradient steps (bookkeeping=False: no write-back, refresh or n_far)."""

    def run(n):
        for _ in range(n):
            vr.train_step(learner, state, args, bookkeeping=bookkeeping)

    return run


def bench_learner(a):
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    obs_dim = 11
    act_dim = 3
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    rm = filled_replay(a.buffer_size, obs_dim, act_dim, 1000, rng)
    setups = {}
    for refer in ("full", "none", "bare"):
        args = vr.Args(refer="none" if refer == "bare" else refer, batch_size=a.batch_size, buffer_size=a.buffer_size)
        agent = vr.Agent(obs_dim, act_dim).to(device)
        opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
        state = {"k": 0, "beta": 0.5 if refer == "full" else 1.0}
        learner = vr.Learner(
            agent, opt, rm, torch.zeros(obs_dim, device=device), torch.ones(obs_dim, device=device), rng, device
        )
        setups[refer] = train_steps(learner, state, args, bookkeeping=refer != "bare")
    if a.sac:
        sac = make_sac(a.env_id, device)
        setups["sac"] = lambda n: sac.train(gradient_steps=n, batch_size=a.batch_size)
    wall = {k: 0.0 for k in setups}
    cpu = {k: 0.0 for k in setups}
    for run in setups.values():
        # warm-up
        run(20)
    for rep in range(a.reps):  # interleave short chunks of the two learners so machine load hits both alike
        for refer, run in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            c = time.process_time()
            run(a.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[refer] += time.perf_counter() - t
            cpu[refer] += time.process_time() - c
    n = a.reps * a.steps
    sps = {k: n / wall[k] for k in setups}
    cps = {k: n / cpu[k] for k in setups}
    print(
        f"learner ({device}, B={a.batch_size}, N={a.buffer_size}, {a.threads} thread(s), {n} steps each), "
        f"grad steps/s wall (CPU time):"
    )
    for k, name in (
        ("full", "full ReF-ER (rule 1+2, beta, n_far, rho/V write-back, Q^ret refresh)"),
        ("none", "--refer none (V-RACER + ER: same write-back and Q^ret refresh)"),
        ("bare", "bare learner (--refer none, no write-back, no refresh, no n_far)"),
    ):
        print(f"  {name}: {sps[k]:.0f} ({cps[k]:.0f})")
    if a.sac:
        ratio = sps["full"] / sps["sac"]
        print(f"  SB3 SAC (B={a.batch_size}): {sps['sac']:.0f} ({cps['sac']:.0f}); full ReF-ER / SAC: {ratio:.2f}x")
    print(
        f"  full vs --refer none: {100 * (sps['none'] / sps['full'] - 1):.1f}% wall, "
        f"{100 * (cps['none'] / cps['full'] - 1):.1f}% CPU; full vs bare: "
        f"{100 * (sps['bare'] / sps['full'] - 1):.1f}% wall, {100 * (cps['bare'] / cps['full'] - 1):.1f}% CPU"
    )
    full_c = cps["full"]
    # breakdown of the replay-side work common to both (V-RACER's Q^ret refresh) and ReF-ER's own
    idx = [rm.sample(a.batch_size, rng) for _ in range(200)]
    rhos = [np.exp(0.3 * rng.normal(size=a.batch_size)) for _ in idx]
    rm.cmax = 5.0
    t = time.process_time()
    for i, r in zip(idx, rhos):
        rm.update_samples(i, r, np.zeros(len(i)))  # write-back + n_far + Q^ret refresh (the path train_step uses)
    t_refresh = (time.process_time() - t) / 200
    t = time.perf_counter()
    for i in idx:
        vr.is_far_policy(rm.rho[i], 2.0).sum()
    t_far = (time.perf_counter() - t) / 200
    t = time.process_time()
    for _ in range(5):
        rm.recompute_all()
    t_all = (time.process_time() - t) / 5
    t = time.perf_counter()
    for _ in range(200):
        rm.sample(a.batch_size, rng)
    t_sample = (time.perf_counter() - t) / 200
    print(
        f"  CPU time per step: sample {1e3 * t_sample:.2f} ms, "
        f"write-back + Q^ret refresh of prior steps {1e3 * t_refresh:.2f} ms "
        f"n_far update {1e3 * t_far:.3f} ms; full Q^ret recomputation over the RM (every 1000 steps) "
        f"{1e3 * t_all:.1f} ms; learner total {1e3 / full_c:.2f} ms"
    )


def latest_sampled(rm, idx):
    """The latest sampled step of each sampled episode (episodes are contiguous: the largest slot)."""
    descending = np.sort(idx)[::-1]
    return descending[np.unique(rm.episode_start[descending], return_index=True)[1]]


def refresh_by_recursion(rm, idx, vtbc_old):
    """What `refresh_delta` computes, as the recursion: Eq. (8) backwards from the latest sampled step of each episode
    down to its first step (`vtbc_old`, the vectorised form's input, is not needed)."""
    latest = latest_sampled(rm, idx)
    rm.recompute_qret(latest, rm.episode_start[latest])


def doubling_scan(a, b, max_len=None):
    """x_t = b_t + a_t x_{t+1} backwards over a flat array (x beyond the end = 0; segments end with a_t = 0) by
    Hillis-Steele doubling, ceil(log2(max_len)) numpy passes: the vectorised form the script used before for
    `vtbc_targets` and `recompute_all`."""
    x = np.array(b, dtype=np.float64)
    a = np.array(a, dtype=np.float64)
    stop = len(x) if max_len is None else min(len(x), max_len)
    shift = 1
    while shift < stop:
        # numpy resolves the overlap as if from the old values
        x[:-shift] += a[:-shift] * x[shift:]
        a[:-shift] *= a[shift:]
        shift *= 2
    return x


def vtbc_by_scan(rewards, values, rhos, gamma, terminated):
    """`vtbc_targets` by the doubling scan: x_t = b_t + a_t x_{t+1}, a_t = gamma c_t, b_t = (1 - c_t) V_t + c_t r_{t+1}."""
    length = len(rewards)
    c = np.minimum(1.0, rhos)
    a = gamma * c
    b = (1.0 - c) * values[:length] + c * rewards
    b[-1] += a[-1] * (0.0 if terminated else values[length])
    a[-1] = 0.0
    return doubling_scan(a, b)


def recompute_all_by_scan(rm):
    """`recompute_all` by one doubling scan over the whole memory (the empty slots have a = b = 0)."""
    n = rm.high_water
    valid = rm.valid[:n]
    c = np.where(valid, np.minimum(1.0, rm.rho[:n]), 0.0)
    last = valid & (np.arange(n) == rm.episode_last[:n])
    a = np.where(last, 0.0, rm.gamma * c)
    b = np.where(valid, (1.0 - c) * rm.value[:n] + c * rm.scaled_reward[:n], 0.0)
    b[last] += rm.gamma * c[last] * rm.boot_value[:n][last]
    x = doubling_scan(a, b, max(length for _, length in rm.episodes))
    next_vtbc = np.append(x[1:], 0.0)
    next_vtbc[last] = rm.boot_value[:n][last]
    rm.qret[:n] = np.where(valid, rm.scaled_reward[:n] + rm.gamma * next_vtbc, 0.0)


def bench_forms(a):
    """The recursion over time against the vectorised form, interleaved in one process on the same memory."""
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(1)
    obs_dim = 11
    act_dim = 3
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    rm = filled_replay(a.buffer_size, obs_dim, act_dim, 1000, rng)
    args = vr.Args(batch_size=a.batch_size, buffer_size=a.buffer_size)
    agent = vr.Agent(obs_dim, act_dim).to(device)
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    learner = vr.Learner(agent, opt, rm, torch.zeros(obs_dim, device=device), torch.ones(obs_dim, device=device), rng, device)
    state = {"k": 0, "beta": 0.5}

    def use(form):
        if form == "recursion":
            rm.refresh_delta = lambda idx, vtbc_old: refresh_by_recursion(rm, idx, vtbc_old)
        else:
            vars(rm).pop("refresh_delta", None)

    wall = {"vectorised": 0.0, "recursion": 0.0}
    cpu = {"vectorised": 0.0, "recursion": 0.0}
    for form in wall:  # warm-up
        use(form)
        for _ in range(3):
            vr.train_step(learner, state, args)
    for _ in range(a.form_reps):
        for form in wall:
            use(form)
            t = time.perf_counter()
            c = time.process_time()
            for _ in range(a.form_steps):
                vr.train_step(learner, state, args)
            wall[form] += time.perf_counter() - t
            cpu[form] += time.process_time() - c
    use("vectorised")
    n = a.form_reps * a.form_steps
    step_ms = {form: 1e3 * seconds / n for form, seconds in wall.items()}
    cpu_ms = {form: 1e3 * seconds / n for form, seconds in cpu.items()}
    print(f"forms ({device}, B={a.batch_size}, N={a.buffer_size}, {n} learner steps each, interleaved):")
    print(
        f"  refresh of prior steps: learner step {step_ms['vectorised']:.2f} ms wall ({cpu_ms['vectorised']:.2f} ms CPU) "
        f"with refresh_delta (vectorised) vs {step_ms['recursion']:.2f} ms ({cpu_ms['recursion']:.2f} ms) with the "
        f"recursion: vectorised {step_ms['recursion'] / step_ms['vectorised']:.2f}x wall "
        f"({cpu_ms['recursion'] / cpu_ms['vectorised']:.2f}x CPU)"
    )
    per_call = {"recursion": 0.0, "doubling scan": 0.0}
    for _ in range(a.form_reps):
        t = time.perf_counter()
        rm.recompute_all()
        per_call["recursion"] += time.perf_counter() - t
        t = time.perf_counter()
        recompute_all_by_scan(rm)
        per_call["doubling scan"] += time.perf_counter() - t
    call_ms = {form: 1e3 * seconds / a.form_reps for form, seconds in per_call.items()}
    step = step_ms["vectorised"]
    per_step = {form: ms / args.stats_every for form, ms in call_ms.items()}
    print(
        f"  recompute_all (every {args.stats_every} steps): {call_ms['recursion']:.1f} ms by the recursion vs "
        f"{call_ms['doubling scan']:.1f} ms by the doubling scan; learner step with it amortised: "
        f"{step + per_step['recursion']:.3f} vs {step + per_step['doubling scan']:.3f} ms: doubling scan "
        f"{(step + per_step['recursion']) / (step + per_step['doubling scan']):.3f}x"
    )
    episodes = [
        (rng.normal(size=1000), rng.normal(size=1001), np.exp(0.3 * rng.normal(size=1000)), bool(i % 2)) for i in range(20)
    ]
    per_episode = {"loop": 0.0, "doubling scan": 0.0}
    for _ in range(a.form_reps):
        t = time.perf_counter()
        for episode in episodes:
            vr.vtbc_targets(*episode[:3], 0.995, episode[3])
        per_episode["loop"] += time.perf_counter() - t
        t = time.perf_counter()
        for episode in episodes:
            vtbc_by_scan(*episode[:3], 0.995, episode[3])
        per_episode["doubling scan"] += time.perf_counter() - t
    # one insertion per 1000-step episode, one env step per gradient step (F = 1)
    episode_ms = {form: 1e3 * seconds / (a.form_reps * len(episodes)) for form, seconds in per_episode.items()}
    print(
        f"  vtbc_targets at insertion (1000-step episode): {episode_ms['loop']:.2f} ms by the loop vs "
        f"{episode_ms['doubling scan']:.2f} ms by the doubling scan; learner step with it amortised (F = 1): "
        f"{step + episode_ms['loop'] / 1000:.3f} vs {step + episode_ms['doubling scan'] / 1000:.3f} ms: doubling scan "
        f"{(step + episode_ms['loop'] / 1000) / (step + episode_ms['doubling scan'] / 1000):.3f}x"
    )


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
    shared.weights_version[0] = 1
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
            shared.weights_version[0] += 1  # new weights every 10 ms, as a learner at ~100 steps/s publishing every step
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
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--buffer-size", type=int, default=2**18)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--env-id", default="Hopper-v5")
    p.add_argument("--num-actors", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--skip-actors", action="store_true")
    p.add_argument("--skip-learner", action="store_true")
    p.add_argument("--skip-forms", action="store_true")
    p.add_argument("--sac", action="store_true", help="add SB3 SAC to the learner comparison (installs it if missing)")
    p.add_argument("--form-steps", type=int, default=10)
    p.add_argument("--form-reps", type=int, default=6)
    a = p.parse_args()
    if not a.skip_learner:
        bench_learner(a)
    if not a.skip_forms:
        bench_forms(a)
    if not a.skip_actors:
        bench_actors(a)

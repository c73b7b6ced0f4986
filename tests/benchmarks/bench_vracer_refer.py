"""Benchmark for vracer_refer.py (not collected by pytest).

1. Learner: gradient steps/s at B=256 on a full replay memory (N = 2**18 by default, Hopper-sized synthetic episodes)
   with the full ReF-ER bookkeeping (rho/V write-back, n_far, Q^ret refresh of prior steps, beta) against the same
   learner with `--refer none` (V-RACER with conventional ER, which still refreshes its Retrace targets) and against a
   bare learner with no write-back/refresh at all, interleaved in one process; plus a breakdown of the time.
2. Actors: env steps/s with `--num-actors` actor processes (policy forward + shared-memory ring) against env-only
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
            final_val=0.0,
            final_obs=np.zeros(obs_dim),
        )
    rm.update_reward_scale()
    return rm


def bench_learner(a):
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    obs_dim, act_dim = 11, 3
    device = torch.device("cuda" if a.cuda and torch.cuda.is_available() else "cpu")
    rm = filled_replay(a.buffer_size, obs_dim, act_dim, 1000, rng)
    setups = {}
    for refer in ("full", "none", "bare"):
        args = vr.Args(refer="none" if refer == "bare" else refer, batch_size=a.batch_size, buffer_size=a.buffer_size)
        agent = vr.Agent(obs_dim, act_dim).to(device)
        opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
        state = {"k": 0, "beta": 0.5 if refer == "full" else 1.0}
        setups[refer] = (args, agent, opt, state)
    mean0, std0 = torch.zeros(obs_dim, device=device), torch.ones(obs_dim, device=device)
    wall = {k: 0.0 for k in setups}
    cpu = {k: 0.0 for k in setups}
    for refer, (args, agent, opt, state) in setups.items():
        for _ in range(20):  # warm-up
            vr.train_step(agent, opt, rm, state, args, device, rng, mean0, std0)
    for rep in range(a.reps):  # interleave short chunks of the two learners so machine load hits both alike
        for refer, (args, agent, opt, state) in setups.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                vr.train_step(agent, opt, rm, state, args, device, rng, mean0, std0, bookkeeping=refer != "bare")
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


def bench_actors(a):
    import torch.multiprocessing as mp

    from common.processes import ProcessGroup

    env = vr.make_env(a.env_id, 0)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    env.reset(seed=0)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < a.seconds:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        n += 1
        if term or trunc:
            env.reset()
    env_only = n / (time.perf_counter() - t)
    env.close()
    args = vr.Args(env_id=a.env_id, num_actors=a.num_actors)
    agent = vr.Agent(obs_dim, act_dim)
    shared_w = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone().share_memory_()
    shared_norm = torch.cat([torch.zeros(obs_dim), torch.ones(obs_dim)]).share_memory_()
    control = torch.tensor([10**12, 1], dtype=torch.int64).share_memory_()
    R = 4096
    rings = torch.zeros(a.num_actors, R, vr.ring_width(obs_dim, act_dim), dtype=torch.float64).share_memory_()
    written = torch.zeros(a.num_actors, dtype=torch.int64).share_memory_()
    read = torch.zeros(a.num_actors, dtype=torch.int64).share_memory_()
    procs = ProcessGroup(mp.get_context("spawn"))
    for i in range(a.num_actors):
        procs.start(
            vr.actor_loop,
            (i, args, obs_dim, act_dim, shared_w, shared_norm, control, rings, written, read, i, "bench", procs.stop_event),
            name=f"actor-{i}",
        )
    try:
        while int(written.sum()) == 0:  # start-up (spawn + imports)
            procs.check()
            time.sleep(0.05)
        n0, t = int(written.sum()), time.perf_counter()
        while time.perf_counter() - t < a.seconds:
            read.copy_(written)  # a learner that consumes everything at once
            control[1] += 1  # new weights every 10 ms, as a learner at ~100 steps/s publishing every step
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
    a = p.parse_args()
    if not a.skip_learner:
        bench_learner(a)
    if not a.skip_actors:
        bench_actors(a)

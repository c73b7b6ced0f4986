"""Learner steps/s under each script's OLD torch-thread rule vs `common.processes.set_learner_threads` (not collected
by pytest).

    python tests/benchmarks/bench_threads.py [--scripts clear_impala reactor vracer_refer plr_ppo] [--reps 4]

For each script, in this one process: build its learner step (as its bench_<script>.py does), start the script's
default number of actor/worker processes as background load, then time blocks of learner steps with the old thread
count and with the new one, alternating (old, new, new, old, ...) so that both see the same machine load. Prints
the median learner steps/s of each rule, the ratio new/old and the actors' env steps/s during the blocks.

Background load: each load process has 1 torch thread (started through `common.processes.ProcessGroup`) and runs
what an actor of the script does, flat out (never throttled by the learner, so the worst case for contention):
  clear_impala  MiniGrid env of its task + `Agent` forward (1 obs) + multinomial action (32 actors + 2 test actors)
  reactor       ALE/Pong-v5 + `ReactorNetwork` forward (1 frame, LSTM state carried), action from pi (2 actors)
  vracer_refer  HalfCheetah-v5 + `numpy_forward` of the policy (as `actor_loop`) + Gaussian action (2 actors)
  plr_ppo       none: bigfish (the default) is Procgen, stepped in the learner's process (no worker processes)
Learner steps: clear_impala `bench_clear_impala.bench_learner` (minigrid config, B=32, T=20, replay 0.5; it also
times a replay-0 step and the actor-side replay work per iteration, not counted); reactor the step of
`bench_reactor.learner_step` (batch 4 x 33 frames);
vracer_refer `train_step` on a full replay memory (`bench_vracer_refer.filled_replay`; default Args: B=256,
N=2**18; HalfCheetah sizes); plr_ppo one PPO minibatch update (ppo_loss + backward + clip + Adam) of
`--plr-minibatch` 64x64x3 frames through the default ImpalaAgent (the script's minibatch is 2048; 512 keeps the
benchmark short). About 4.5 minutes on 2 cores; the 34 clear_impala load processes need about 6 GB of RAM.
"""

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np
import torch

DEFAULT_THREADS = torch.get_num_threads()  # torch's own default in this process, before anything changes it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.processes import ProcessGroup, available_cores, set_learner_threads  # noqa: E402

SCRIPTS = ("clear_impala", "reactor", "vracer_refer", "plr_ppo")


# ---- background load: one actor-like loop per process (1 torch thread: ProcessGroup's child entry sets it) ----
def load_actor(script, i, steps, stop_event):
    rng = np.random.default_rng(i)
    if script == "clear_impala":
        import clear_impala as ci

        args = ci.Args()
        task = i % len(args.env_ids)
        env = ci.make_env(args.env_ids[task], i, args)
        obs_shape = env.observation_space.shape
        num_actions = int(env.action_space.n)
        model = ci.Agent(obs_shape, num_actions, ci.resolve_torso(args, obs_shape))
        obs, _ = env.reset(seed=i)

        def tick(obs):
            with torch.no_grad():
                logits, _ = model(torch.from_numpy(np.asarray(obs)).unsqueeze(0))
                action = int(torch.multinomial(torch.softmax(logits, -1), 1).item())
            return env.step(action)
    elif script == "reactor":
        import reactor

        args = reactor.Args()
        env = reactor.make_env(args.env_id, i, args)
        num_actions = int(env.action_space.n)
        net = reactor.make_network(args, num_actions, env.observation_space.shape)
        state = [net.initial_state(1)]
        obs, _ = env.reset(seed=i)

        def tick(obs):
            with torch.no_grad():
                out = net(torch.from_numpy(obs).view(1, 1, 84, 84), torch.zeros(1, 1, dtype=torch.bool), state[0])
            state[0] = out.state
            mu = out.pi[0, 0].numpy().astype(np.float64)
            return env.step(int(rng.choice(num_actions, p=mu / mu.sum())))
    elif script == "vracer_refer":
        import vracer_refer as vr

        args = vr.Args()
        env = vr.make_env(args.env_id, i)
        obs_dim = env.observation_space.shape[0]
        act_dim = env.action_space.shape[0]
        low = env.action_space.low.astype(np.float64)
        high = env.action_space.high.astype(np.float64)
        agent = vr.Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual)
        net = vr.numpy_params(agent, args.std_map, np.zeros(obs_dim), np.ones(obs_dim))
        obs, _ = env.reset(seed=i)

        def tick(obs):
            mean, std, _ = vr.numpy_forward(net, obs, args.residual)
            return env.step(vr.to_env_action(mean + std * rng.standard_normal(act_dim), low, high))
    else:
        raise ValueError(f"no load for {script}")
    while not stop_event.is_set():
        obs, _, term, trunc, _ = tick(obs)
        steps[i] += 1
        if term or trunc:
            obs, _ = env.reset()
            if script == "reactor":
                state[0] = net.initial_state(1)


# ---- learner steps and thread rules of each script (old rule: the line the script had before set_learner_threads) ----
def timed_blocks(step, max_seconds):
    """fn(threads, n) -> learner steps/s: set the threads, 1 warm-up step, then n steps or max_seconds, whichever
    comes first (at least 1 step: an oversubscribed learner can take seconds per step)."""

    def block(threads, n):
        torch.set_num_threads(threads)
        step()  # warm-up after a thread change
        done = 0
        t = time.perf_counter()
        while done < n and (done == 0 or time.perf_counter() - t < max_seconds):
            step()
            done += 1
        return done / (time.perf_counter() - t)

    return block


def setup(script, a, device):
    """-> (old threads, number of load processes, fn(threads, n) -> learner steps/s of a block of n steps)."""
    cpu = os.cpu_count() or 1
    if script == "clear_impala":
        import bench_clear_impala

        import clear_impala as ci

        args = ci.Args()
        K = len(args.env_ids)
        num_procs = args.num_actors + K * args.num_test_actors
        old = max(1, cpu - args.num_actors - K * args.num_test_actors)
        cfg = bench_clear_impala.CONFIGS["minigrid"]
        B = args.batch_size
        T = args.unroll_length

        def block(threads, n):  # its own warm-up; each iteration also times a replay-0 step (not counted)
            out = bench_clear_impala.bench_learner(cfg, B, T, n, device, threads)
            return out["learner_SPS_replay_0.5"] / (B * T)

        return old, num_procs, block
    if script == "reactor":
        import bench_reactor

        import reactor

        step = bench_reactor.learner_step(reactor, "ALE/Pong-v5", (1, 84, 84), device, start_fraction=0.01)
        return DEFAULT_THREADS, reactor.Args().num_actors, timed_blocks(step, a.max_block_seconds)  # old: it set nothing
    if script == "vracer_refer":
        import bench_vracer_refer

        import vracer_refer as vr

        args = vr.Args()
        # Hopper-sized episodes, as in bench_vracer_refer.py
        obs_dim = bench_vracer_refer.OBS_DIM
        act_dim = bench_vracer_refer.ACT_DIM
        rng = np.random.default_rng(0)
        rm = bench_vracer_refer.filled_replay(args.buffer_size, rng)
        agent = vr.Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual).to(device)
        opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
        mean0 = torch.zeros(obs_dim, device=device)
        std0 = torch.ones(obs_dim, device=device)
        learner = vr.Learner(agent, opt, rm, mean0, std0, rng, device, k=0, beta=args.beta_init)

        def step():
            vr.train_step(learner, args)

        return 1, args.num_actors, timed_blocks(step, a.max_block_seconds)  # old: --learner-threads, default 1
    if script == "plr_ppo":
        import plr_ppo

        args = plr_ppo.resolve_defaults(plr_ppo.Args())
        assert plr_ppo.is_procgen(args.env_id)  # the default env: no worker processes
        obs_shape = (64, 64, 3)
        num_actions = 15
        M = a.plr_minibatch
        agent = plr_ppo.make_agent(args, obs_shape, num_actions).to(device)
        opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
        g = torch.Generator().manual_seed(0)
        obs = torch.randint(0, 255, (M, *obs_shape), dtype=torch.uint8, generator=g).to(device)
        actions = torch.randint(0, num_actions, (M,), generator=g).to(device)
        logp, adv, ret, val = (torch.randn(M, generator=g).to(device) for _ in range(4))

        def step():
            loss = plr_ppo.ppo_loss(agent, obs, actions, logp - 2.7, adv, ret, val, args)[0]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            opt.step()

        return max(1, cpu // 2), 0, timed_blocks(step, a.max_block_seconds)  # old: half the cores
    raise ValueError(script)


def measure(script, a, device):
    old, num_procs, block = setup(script, a, device)
    new = set_learner_threads(num_procs)  # prints the scripts' start-up line
    n = getattr(a, f"steps_{script}")
    ctx = mp.get_context("spawn")
    steps = ctx.RawArray("l", max(1, num_procs))
    group = ProcessGroup(ctx)
    res = {"old": [], "new": []}
    act = {"old": [], "new": []}
    try:
        for i in range(num_procs):
            group.start(load_actor, (script, i, steps, group.stop_event), name=f"load-{i}")
        t0 = time.perf_counter()
        while num_procs and min(steps[:num_procs]) == 0:  # start-up (spawn, imports, env creation)
            group.check()
            time.sleep(0.2)
        startup = time.perf_counter() - t0
        for r in range(a.reps):
            for rule in ("old", "new") if r % 2 == 0 else ("new", "old"):
                s0 = sum(steps[:num_procs])
                t = time.perf_counter()
                res[rule].append(block(old if rule == "old" else new, n))
                act[rule].append((sum(steps[:num_procs]) - s0) / (time.perf_counter() - t))
                group.check()
    finally:
        group.stop()
    med = {k: float(np.median(v)) for k, v in res.items()}
    print(
        f"  {script}: old {old} / new {new} threads, {num_procs} load processes (start-up {startup:.0f} s), "
        f"blocks of {n} steps: old {[f'{x:.2f}' for x in res['old']]}, new {[f'{x:.2f}' for x in res['new']]}",
        flush=True,
    )
    return {
        "script": script,
        "old": old,
        "new": new,
        "procs": num_procs,
        "old_sps": med["old"],
        "new_sps": med["new"],
        "ratio": med["new"] / med["old"],
        "act_old": float(np.median(act["old"])),
        "act_new": float(np.median(act["new"])),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=SCRIPTS)
    p.add_argument("--reps", type=int, default=4, help="rounds; each has one old and one new block")
    p.add_argument("--max-block-seconds", type=float, default=15.0, help="a block stops after this (not clear_impala)")
    p.add_argument("--steps-clear_impala", type=int, default=4)
    p.add_argument("--steps-reactor", type=int, default=12)
    p.add_argument("--steps-vracer_refer", type=int, default=300)
    p.add_argument("--steps-plr_ppo", type=int, default=2)
    p.add_argument("--plr-minibatch", type=int, default=512)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    start = time.perf_counter()
    print(
        f"machine: {platform.machine()}, {available_cores()} cores available ({os.cpu_count()} in the machine), "
        f"python {platform.python_version()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, learner on {device}",
        flush=True,
    )
    rows = [measure(s, a, device) for s in a.scripts]
    print(
        "\n| script | load processes | learner threads old -> new | learner steps/s old | new | new/old "
        "| actor env steps/s old | new |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['script']} | {r['procs']} | {r['old']} -> {r['new']} | {r['old_sps']:.2f} | {r['new_sps']:.2f} "
            f"| {r['ratio']:.2f} | {r['act_old']:.0f} | {r['act_new']:.0f} |"
        )
    print(f"\n{a.reps} old and {a.reps} new blocks per script, medians; total {time.perf_counter() - start:.0f} s")

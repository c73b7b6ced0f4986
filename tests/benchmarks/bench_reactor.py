"""Reactor benchmarks: lazy prioritized sequence replay operations at 1e4 vs 1e6 keys, acting SPS vs env-only SPS
with the same number of processes, and learner steps per second.

    python tests/benchmarks/bench_reactor.py [--sizes 10000 1000000] [--num-actors 2] [--seconds 20] [--learn-steps 20]

Prints markdown tables. The replay rows time the key index (`LazyPriorities`: the sum trees that make every
operation O(log n)); `SequenceReplay` adds a constant-cost frame copy per slot on top. Keys are all valid with 10%
known priorities, as after a while of training.
"""
import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import reactor  # noqa: E402


def timeit(fn, repeats):
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6  # microseconds per call


def bench_replay(n, repeats):
    rng = np.random.default_rng(0)
    lp = reactor.LazyPriorities(n, 0.1)
    for start in range(0, n - 1, 1 << 17):  # fill: every key valid except one (the ring's write head)
        lp.add(np.arange(start, min(start + (1 << 17), n - 1)))
    known = rng.choice(n - 1, size=n // 10, replace=False)
    for start in range(0, len(known), 1 << 16):
        lp.set_priority(known[start: start + (1 << 16)], rng.uniform(0.01, 1.0, size=len(known[start: start + (1 << 16)])))
    head = [n - 1]

    def insert(m):
        def f():  # steady state of a ring: evict the oldest m keys, add m new ones
            new = (head[0] + np.arange(m)) % n
            old = (head[0] + 1 + np.arange(m)) % n
            lp.remove(old)
            lp.add(new)
            head[0] = (head[0] + m) % n
        return f

    def sample():
        lp.sample(4, rng)

    batches = [lp.sample(4, rng)[0] for _ in range(repeats + 1)]
    new_prios = rng.uniform(0.01, 1.0, size=(repeats + 1, 4))
    i = [0]

    def update():  # priorities of a sampled batch, after training on it
        lp.set_priority(batches[i[0]], new_prios[i[0]])
        i[0] += 1

    return {"insert (1 key, with 1 eviction)": timeit(insert(1), repeats),
            "insert (16-key chunk with 16 evictions, per key)": timeit(insert(16), repeats) / 16,
            "sample batch 4 (with probabilities)": timeit(sample, repeats), "priority update (4 keys)": timeit(update, repeats)}


def env_only(seconds, out, i):
    torch.set_num_threads(1)
    env = reactor.make_env("ALE/Pong-v5", i, reactor.Args())
    env.reset(seed=i)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        steps += 1
        if term or trunc:
            env.reset()
    out.put(steps / (time.perf_counter() - start))


def bench_acting(num_actors, seconds):
    """Env-only processes vs the real `actor_loop` processes (env + network + stream to a draining learner)."""
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=env_only, args=(seconds, q, i)) for i in range(num_actors)]
    [p.start() for p in procs]
    env_sps = sum(q.get() for _ in procs)
    [p.join() for p in procs]

    args = reactor.Args(num_actors=num_actors, learning_starts=10**12)  # no learner: never throttled
    args.run_name = "bench"
    net = reactor.ReactorNetwork(6)
    net.share_memory()
    version, steps, lsteps = ctx.Value("l", 0), ctx.Array("l", num_actors), ctx.Value("l", 0)
    data, stop = ctx.Queue(), ctx.Event()
    buffers = reactor.make_chunk_buffers(num_actors, args.actor_chunk, 6, args.lstm_size)
    views = {k: v.numpy() for k, v in buffers.items()}
    free = [ctx.Queue() for _ in range(num_actors)]
    for q_ in free:
        for j in range(reactor.CHUNK_SLOTS):
            q_.put(j)
    procs = [ctx.Process(target=reactor.actor_loop, args=(i, args, net, version, steps, lsteps, (10**12, 0), buffers,
                                                          free[i], data, stop)) for i in range(num_actors)]
    [p.start() for p in procs]
    replay = reactor.SequenceReplay(100_000, num_actors, 32, 6, 128)
    while sum(steps[:]) == 0:  # start-up (imports, ROM load)
        time.sleep(0.1)
    t0, s0 = time.perf_counter(), sum(steps[:])
    while time.perf_counter() - t0 < seconds:
        try:
            msg = data.get(timeout=0.1)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        if msg[0] == "chunk":
            _, i, slot, m, _ = msg
            replay.add(i, {k: v[i, slot, :m] for k, v in views.items()})
            free[i].put(slot)
    act_sps = (sum(steps[:]) - s0) / (time.perf_counter() - t0)
    stop.set()
    while any(p.is_alive() for p in procs):
        try:
            data.get(timeout=0.1)
        except Exception:  # noqa: BLE001
            pass
    return env_sps, act_sps


def learner_step(device):
    """One Reactor learning step (batch 4 x 33 frames, Atari sizes) on a filled replay, as a closure."""
    args = reactor.Args()
    net, target = reactor.ReactorNetwork(6).to(device), reactor.ReactorNetwork(6).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.learning_rate, betas=(0.0, 0.999))
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms, device=device)
    replay = reactor.SequenceReplay(20_000, 1, 32, 6, 128)
    rng = np.random.default_rng(0)
    m = 2000
    for start in range(0, 20_000 - 2000, m):
        replay.add(0, {"obs": rng.integers(0, 255, (m, 1, 84, 84), dtype=np.uint8), "action": rng.integers(0, 6, m),
                       "reward": rng.choice([-1.0, 0.0, 1.0], m), "term": rng.random(m) < 0.01, "pad": np.zeros(m, bool),
                       "first": np.zeros(m, bool), "mu": np.full((m, 6), 1 / 6), "state": np.zeros((m, 4, 128))})

    def step():
        keys, batch = replay.sample(4, rng, device)
        loss, prio, _ = reactor.reactor_loss(net, target, batch, support, args)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 40.0)
        opt.step()
        replay.update_priorities(keys, prio.cpu().numpy())

    return step


def bench_learner(steps, device):
    step = learner_step(device)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--num-actors", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--learn-steps", type=int, default=20)
    parser.add_argument("--skip", nargs="*", default=[], help="replay | acting | learner")
    a = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if "replay" not in a.skip:
        results = {n: bench_replay(n, a.repeats) for n in a.sizes}
        print("\n| operation | " + " | ".join(f"{n:,} keys (us)" for n in a.sizes) + " |")
        print("|---|" + "---|" * len(a.sizes))
        for op in results[a.sizes[0]]:
            print(f"| {op} | " + " | ".join(f"{results[n][op]:.0f}" for n in a.sizes) + " |")
    if "acting" not in a.skip:
        env_sps, act_sps = bench_acting(a.num_actors, a.seconds)
        print(f"\n| {a.num_actors} processes, ALE/Pong-v5 | steps/s |\n|---|---|\n| env only (random actions) | {env_sps:.0f} |\n"
              f"| Reactor actors (network on CPU, 1 thread each, streaming to the learner) | {act_sps:.0f} |")
    if "learner" not in a.skip:
        torch.set_num_threads(max(1, (os.cpu_count() or 2)))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"\nlearner ({device}, batch 4 x 33 frames, default network, sample + loss + backward + Adam + priorities): "
              f"{bench_learner(a.learn_steps, device):.2f} steps/s")

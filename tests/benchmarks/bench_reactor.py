"""Reactor benchmarks, each comparison measured within one run, variants interleaved round by round (medians):

- replay index (`LazyPriorities`) at 1e4 vs 1e6 keys, CPU time per call: insert (with eviction), batch-4 sample,
  4-key priority update, against the same operations of a C++ prioritized replay (cpprb's `PrioritizedReplayBuffer`:
  a segment tree, every item with its own priority; ours also keeps the lazy estimates of paper 3.3 over the cells
  of unknown keys, and runs in Python);
- acting steps/s of the real `actor_loop` processes vs env-only processes (random actions), same process count, on
  ALE/Pong-v5 and MinAtar/Breakout-v0;
- learner steps/s (sample + loss + backward + clipping + Adam + priorities + weight publication: the main loop's
  `learning_step` and `publish_weights`, or an earlier script's inline equivalent) for the Atari (1x84x84) and MinAtar
  Breakout (4x10x10) networks, 6 actions, on replays whose frames start an episode with probability `--start-fractions`
  (MinAtar Breakout's episodes last about 20 frames in its first 100k steps, 80-100 up to 500k, 170-300 after: 5%, 1%,
  0.5% of frames);
- where a learning step's time goes (`sections`): this script's step taken apart (sample, each forward pass, targets
  and losses, backward, clipping, Adam, priorities, the weight copy), thread time per section, MinAtar, 1 thread;
- the real loop (`run`): a 30k-step MinAtar Breakout run of this script and of the baseline, alone, one after the
  other (`--run-rounds` times): the learner steps/s the run logs once learning starts (`charts/learner_steps_per_s`,
  the learning step's own time: early training, ~20-frame episodes) and its wall time.

    pip install cpprb==11.0.0  # benchmark-only, not in requirements.txt; without it the cpprb columns are left out
    python tests/benchmarks/bench_reactor.py [--baseline-script PATH] [--sizes 10000 1000000] [--rounds 5]
        [--repeats 300] [--learn-seconds 5] [--learner-threads 1] [--start-fractions 0.01 0.05] [--num-actors 2]
        [--seconds 10] [--acting-rounds 2] [--run-rounds 1] [--section-steps 100]
        [--skip replay learner sections acting run]

--baseline-script: an earlier reactor.py (e.g. `git show HEAD:reactor.py > /tmp/reactor_before.py`), timed beside
this one in the replay and learner tables (one from before MinAtar, e.g. b311819 with its LSTMCell loops: Atari
only). Replay keys are all valid with 10% known priorities, as after a while of training; `SequenceReplay` adds a
constant-cost frame copy per slot on top.
"""

import argparse
import importlib.util
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import reactor  # noqa: E402
from common.logger import read_metrics  # noqa: E402

try:
    import cpprb
except ImportError:  # benchmark-only dependency
    cpprb = None


def cpprb_version():
    if cpprb is None:
        return "not installed (pip install cpprb==11.0.0)"
    from importlib.metadata import version

    return version("cpprb")


def load_script(path):
    """An earlier reactor.py as a module. Scripts from before ChunkChannel moved into reactor.py import it from
    common/processes.py, which no longer has it: it is lent to them from this reactor.py (the same class)."""
    import common.processes

    if not hasattr(common.processes, "ChunkChannel"):
        common.processes.ChunkChannel = reactor.ChunkChannel
    spec = importlib.util.spec_from_file_location("reactor_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call_us(fn, repeats):
    """CPU time of this thread per call (less disturbed by other processes than wall time on a busy machine)."""
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats * 1e6


# REPLAY INDEX
def ours_replay_ops(module, n, seed=0):
    """The four timed operations of a LazyPriorities (of this script's module) with n keys."""
    rng = np.random.default_rng(seed)
    lp = module.LazyPriorities(n, 0.1)
    for start in range(0, n - 1, 1 << 17):  # fill: every key valid except one (the ring's write head)
        lp.add(np.arange(start, min(start + (1 << 17), n - 1)))
    known = rng.choice(n - 1, size=n // 10, replace=False)
    for start in range(0, len(known), 1 << 16):
        part = known[start : start + (1 << 16)]
        lp.set_priority(part, rng.uniform(0.01, 1.0, size=len(part)))
    head = [n - 1]

    def insert(m):
        def f():  # steady state of a ring: evict the oldest m keys, add m new ones
            new = (head[0] + np.arange(m)) % n
            lp.remove((new + 1) % n)
            lp.add(new)
            head[0] = (head[0] + m) % n

        return f

    def sample():
        lp.sample(4, rng)

    batches = []

    def sample_batches(repeats):  # (untimed) batches to update, sampled just before
        batches[:] = [(lp.sample(4, rng)[0], rng.uniform(0.01, 1.0, size=4)) for _ in range(repeats)]

    def update():  # the priorities of a batch just sampled (as after training on it)
        lp.set_priority(*batches.pop())

    return {"insert": insert(1), "insert16": insert(16), "sample": sample, "update": (sample_batches, update)}


def cpprb_ops(n, seed=0):
    """The same operations on cpprb's PrioritizedReplayBuffer (alpha 1, full: every add evicts the oldest item)."""
    rng = np.random.default_rng(seed)
    rb = cpprb.PrioritizedReplayBuffer(n, {"obs": {"shape": 1}}, alpha=1.0)
    rb.add(obs=np.zeros((n, 1)), priorities=rng.uniform(0.01, 1.0, size=n))
    one = np.zeros((1, 1))
    sixteen = np.zeros((16, 1))
    batches = []

    def sample_batches(repeats):
        batches[:] = [(rb.sample(4)["indexes"], rng.uniform(0.01, 1.0, size=4)) for _ in range(repeats)]

    return {
        "insert": lambda: rb.add(obs=one, priorities=0.5),
        "insert16": lambda: rb.add(obs=sixteen, priorities=np.full(16, 0.5)),
        "sample": lambda: rb.sample(4),
        "update": (sample_batches, lambda: rb.update_priorities(*batches.pop())),
    }


REPLAY_ROWS = (
    ("insert", "insert 1 key (with 1 eviction)", 1),
    ("insert16", "insert a 16-key chunk (16 evictions), per key", 16),
    ("sample", "sample batch 4 (with probabilities)", 1),
    ("update", "priority update (4 keys)", 1),
)


def bench_replay(sizes, rounds, repeats, baseline):
    variants = {"ours": lambda n: ours_replay_ops(reactor, n)}
    if baseline is not None:
        variants["before"] = lambda n: ours_replay_ops(baseline, n)
    if cpprb is not None:
        variants["cpprb"] = cpprb_ops
    table = {}
    for n in sizes:
        ops = {name: make(n) for name, make in variants.items()}
        times = {(v, op): [] for v in ops for op in ops[v]}
        for r in range(rounds + 1):  # round 0: warm-up
            for v, fns in ops.items():
                count = repeats if v != "before" else max(1, repeats // 5)
                for op, fn in fns.items():
                    if isinstance(fn, tuple):  # (untimed preparation, timed call)
                        fn[0](count)
                        fn = fn[1]
                    t = per_call_us(fn, count)
                    if r:
                        times[v, op].append(t)
        for v in ops:
            for op, _, per in REPLAY_ROWS:
                table[n, v, op] = float(np.median(times[v, op])) / per
        del ops
    cols = list(variants)
    print(
        "\n| operation | keys | "
        + " | ".join(f"{v} (us)" for v in cols)
        + (" | before / ours" if "before" in cols else "")
        + (" | ours / cpprb" if "cpprb" in cols else "")
        + " |"
    )
    print("|---|---|" + "---|" * (len(cols) + ("before" in cols) + ("cpprb" in cols)))
    for op, label, _ in REPLAY_ROWS:
        for n in sizes:
            row = [f"{table[n, v, op]:.1f}" for v in cols]
            if "before" in cols:
                row.append(f"{table[n, 'before', op] / table[n, 'ours', op]:.1f}x")
            if "cpprb" in cols:
                row.append(f"{table[n, 'ours', op] / table[n, 'cpprb', op]:.1f}")
            print(f"| {label} | {n:,} | " + " | ".join(row) + " |")


# ACTING
def env_only(env_id, seconds, out, i):
    torch.set_num_threads(1)
    env = reactor.make_env(env_id, i, reactor.Args(env_id=env_id))
    env.reset(seed=i)
    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        steps += 1
        if term or trunc:
            env.reset()
    out.put(steps / (time.perf_counter() - start))


def run_env_only(ctx, env_id, num_actors, seconds):
    q = ctx.Queue()
    procs = [ctx.Process(target=env_only, args=(env_id, seconds, q, i)) for i in range(num_actors)]
    [p.start() for p in procs]
    sps = sum(q.get() for _ in procs)
    [p.join() for p in procs]
    return sps


def run_actors(ctx, env_id, num_actors, seconds):
    """The real `actor_loop` processes (env + network on CPU, 1 thread each) streaming into a draining learner loop
    that copies every chunk into a SequenceReplay, as the main loop (no learning, so never throttled)."""
    args = reactor.Args(env_id=env_id, num_actors=num_actors, learning_starts=10**12)
    probe = reactor.make_env(env_id, 0, args)
    num_actions = int(probe.action_space.n)
    obs_shape = probe.observation_space.shape
    probe.close()
    net = reactor.make_network(args, num_actions, obs_shape)
    net.share_memory()
    steps = ctx.Array("l", num_actors)
    channel = reactor.make_channel(ctx, args, num_actions, obs_shape)
    stop = ctx.Event()
    handles = reactor.ActorHandles(net, ctx.Value("l", 0), steps, ctx.Value("l", 0), channel, stop)
    # the ratio base far ahead: no acting:learning gate
    ratio_base = reactor.RatioBase(10**12, 0)
    procs = [
        ctx.Process(target=reactor.actor_loop, args=(i, args, "bench", handles, ratio_base, 0)) for i in range(num_actors)
    ]
    [p.start() for p in procs]
    replay = reactor.SequenceReplay(100_000, num_actors, 32, num_actions, 128, obs_shape=obs_shape)
    while min(steps[:]) == 0:  # start-up (imports, ROM load)
        if not all(p.is_alive() for p in procs):
            [p.kill() for p in procs]
            raise SystemExit("error: an actor died at start-up (see its traceback above)")
        time.sleep(0.1)
    t0 = time.perf_counter()
    s0 = sum(steps[:])
    while time.perf_counter() - t0 < seconds:
        try:
            msg = channel.get(timeout=0.1)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        if msg[0] == "chunk":
            replay.add(*channel.read(msg))
            channel.release(msg)
    act_sps = (sum(steps[:]) - s0) / (time.perf_counter() - t0)
    stop.set()
    while any(p.is_alive() for p in procs):
        # drain what the actors still send, so that none blocks on a full queue
        try:
            channel.get(timeout=0.1)
        except Exception:  # noqa: BLE001
            pass
    return act_sps


def bench_acting(num_actors, seconds, rounds):
    ctx = torch.multiprocessing.get_context("spawn")
    reactor.make_env("ALE/Pong-v5", 0, reactor.Args()).close()  # (ALE's start-up banner, before the table)
    print(
        f"\n| {num_actors} processes (1 thread each), median of {rounds} interleaved rounds | env only, random "
        f"actions (steps/s) | Reactor actors (steps/s) | actors / env only |\n|---|---|---|---|"
    )
    for env_id in ("ALE/Pong-v5", "MinAtar/Breakout-v0"):
        env_sps = []
        act_sps = []
        for _ in range(rounds):
            env_sps.append(run_env_only(ctx, env_id, num_actors, seconds))
            act_sps.append(run_actors(ctx, env_id, num_actors, seconds))
        e = float(np.median(env_sps))
        a = float(np.median(act_sps))
        print(f"| {env_id} | {e:,.0f} | {a:,.0f} | {a / e:.3f} |", flush=True)


# LEARNER
LEARNER_CONFIGS = (("Atari", "ALE/Pong-v5", (1, 84, 84)), ("MinAtar", "MinAtar/Breakout-v0", (4, 10, 10)))


def pre_minatar(module) -> bool:
    """A reactor.py from before MinAtar (e.g. b311819): Atari-only constructors, 84x84 frames in its replay."""
    return not hasattr(module, "make_network")


def learner_step(module, env_id, obs_shape, device, start_fraction, seed=0):
    """One learning step of `module`'s reactor.py as its main loop runs it, on a replay of random sequences."""
    args = module.Args(env_id=env_id)
    torch.manual_seed(seed)
    old = pre_minatar(module)
    make_network = (
        (
            lambda a, n, shape: module.ReactorNetwork(
                n, a.num_atoms, a.lstm_size, a.crelu, a.distributional, a.policy_uniform_eps
            )
        )
        if old
        else module.make_network
    )
    if hasattr(module, "make_learner"):
        net, target, opt = module.make_learner(args, 6, obs_shape, device)
    else:  # (the earlier script's __main__)
        net = make_network(args, 6, obs_shape).to(device)
        target = make_network(args, 6, obs_shape).to(device)
        target.load_state_dict(net.state_dict())
        opt = torch.optim.Adam(
            net.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
        )
    shared = make_network(args, 6, obs_shape)
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms, device=device)
    size = 20_000
    m = 2000
    replay = module.SequenceReplay(
        size, 1, args.sequence_length, 6, args.lstm_size, **({} if old else {"obs_shape": obs_shape})
    )
    rng = np.random.default_rng(seed)
    high = 256 if obs_shape[0] == 1 else 2  # Atari frames 0..255, MinAtar 0/1
    for _ in range(0, size - m, m):
        frames = (m, *obs_shape[1:]) if old else (m, *obs_shape)  # (the old replay kept 84x84 frames)
        replay.add(
            0,
            {
                "obs": rng.integers(0, high, frames, dtype=np.uint8),
                "action": rng.integers(0, 6, m),
                "reward": rng.choice([-1.0, 0.0, 1.0], m),
                "term": rng.random(m) < 0.01,
                "pad": np.zeros(m, bool),
                "first": rng.random(m) < start_fraction,
                "mu": np.full((m, 6), 1 / 6),
                "state": np.zeros((m, 4, args.lstm_size)),
                "version": np.zeros(m, np.int64),
            },
        )

    if hasattr(module, "publish_weights"):  # the main loop's own functions
        counters = SimpleNamespace(value=0)
        learn_steps = [0]

        def step():
            module.learning_step(net, target, opt, replay, support, args, rng, device)
            learn_steps[0] += 1
            module.publish_weights(net, target, shared, counters, counters, learn_steps[0], args)

        # (for `bench_sections`)
        step.learner = SimpleNamespace(
            net=net, target=target, optimizer=opt, replay=replay, support=support, args=args, rng=rng, shared=shared
        )
        return step

    def step():  # (an earlier script: its main loop's steps, inline)
        keys, batch = replay.sample(args.batch_size, rng, device)
        loss, priorities, _ = module.reactor_loss(net, target, batch, support, args)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)
        opt.step()
        replay.update_priorities(keys, priorities.cpu().numpy(), args.priority_exponent)
        shared.load_state_dict(net.state_dict())

    return step


def bench_learner(seconds, rounds, baseline, threads, start_fractions):
    """Steps/s by wall clock and per CPU-second of the learner thread (with 1 thread all of torch's work runs on it:
    the CPU rate is what an idle core would give, less disturbed by the machine's other processes)."""
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = {"ours": reactor} | ({"before": baseline} if baseline is not None else {})
    cols = [f"{v} (steps/s)" for v in variants] + (["ours / before"] if baseline else [])
    cols += [f"{v} (steps per CPU s)" for v in variants] + (["ours / before (CPU)"] if baseline else [])
    print(
        f"\n| learner ({device}, {threads} thread(s), batch 4 x 33 frames, 6 actions; median of {rounds} interleaved "
        f"rounds) | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols)
    )
    for (name, env_id, obs_shape), start_fraction in itertools.product(LEARNER_CONFIGS, start_fractions):
        runs_here = {v: m for v, m in variants.items() if obs_shape == (1, 84, 84) or not pre_minatar(m)}
        steps = {v: learner_step(mod, env_id, obs_shape, device, start_fraction) for v, mod in runs_here.items()}
        wall = {v: [] for v in steps}
        cpu = {v: [] for v in steps}
        for f in steps.values():
            f()
            f()  # warm-up
        for _ in range(rounds):
            for v, f in steps.items():
                n = 0
                start = time.perf_counter()
                start_cpu = time.thread_time()
                while time.perf_counter() - start < seconds:
                    f()
                    n += 1
                if device.type == "cuda":
                    torch.cuda.synchronize()
                wall[v].append(n / (time.perf_counter() - start))
                cpu[v].append(n / (time.thread_time() - start_cpu))
        row = []
        for rates in (wall, cpu):
            med = {v: float(np.median(r)) for v, r in rates.items()} | {v: np.nan for v in variants if v not in steps}
            row += [f"{med[v]:.2f}" for v in variants] + ([f"{med['ours'] / med['before']:.2f}"] if baseline else [])
        config = f"{name} {'x'.join(map(str, obs_shape))}, {start_fraction:.1%} episode starts"
        print(f"| {config} | " + " | ".join(row) + " |", flush=True)
        del steps


SECTIONS = (
    "sample",
    "online forward",
    "target forward",
    "targets and losses",
    "backward",
    "clipping",
    "Adam",
    "priorities",
    "weights to the actors",
)


def bench_sections(steps, start_fractions):
    """Where a learning step's time goes: this reactor.py's main-loop step (`learning_step` + `publish_weights`, taken
    apart), MinAtar Breakout network, CPU, 1 thread; thread time per section. The two forward passes are timed again on
    their own (`reactor_loss` runs them inside): "targets and losses" is the loss's time less theirs."""
    torch.set_num_threads(1)
    print(
        f"\n| MinAtar 4x10x10, CPU, 1 thread, ms per step (thread time, mean of {steps} steps) | "
        + " | ".join(SECTIONS)
        + " | step |\n|---|"
        + "---|" * (len(SECTIONS) + 1)
    )
    for start_fraction in start_fractions:
        step = learner_step(reactor, "MinAtar/Breakout-v0", (4, 10, 10), torch.device("cpu"), start_fraction)
        for _ in range(10):  # warm-up
            step()
        learner = step.learner
        args = learner.args
        counter = SimpleNamespace(value=0)
        times = dict.fromkeys(SECTIONS + ("loss",), 0.0)

        def timed(section, fn):
            start = time.thread_time()
            out = fn()
            times[section] += time.thread_time() - start
            return out

        for i in range(steps):
            keys, batch = timed("sample", lambda: learner.replay.sample(args.batch_size, learner.rng, "cpu"))
            timed("online forward", lambda: learner.net(batch.obs, batch.first, batch.state))
            with torch.no_grad():
                timed("target forward", lambda: learner.target(batch.obs, batch.first, batch.state, policy=False))
            loss, priorities, _ = timed(
                "loss", lambda: reactor.reactor_loss(learner.net, learner.target, batch, learner.support, args)
            )
            learner.optimizer.zero_grad()
            timed("backward", loss.backward)
            timed("clipping", lambda: torch.nn.utils.clip_grad_norm_(learner.net.parameters(), args.max_grad_norm))
            timed("Adam", learner.optimizer.step)
            timed(
                "priorities",
                lambda: learner.replay.update_priorities(keys, priorities.cpu().numpy(), args.priority_exponent),
            )
            timed(
                "weights to the actors",
                lambda: reactor.publish_weights(learner.net, learner.target, learner.shared, counter, counter, i + 1, args),
            )
        times["targets and losses"] = times["loss"] - times["online forward"] - times["target forward"]
        total = sum(times[s] for s in SECTIONS)
        cells = [f"{times[s] / steps * 1000:.2f} ({times[s] / total:.0%})" for s in SECTIONS]
        print(f"| {start_fraction:.1%} episode starts | " + " | ".join(cells) + f" | {total / steps * 1000:.2f} |", flush=True)


# THE REAL LOOP
def run_once(script, seconds_limit=900):
    """One 30k-step MinAtar Breakout run of `script` in a fresh folder (the repo's common/ beside it): the learner
    steps/s it logged and its wall time."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(script, os.path.join(folder, "reactor.py"))
        os.symlink(os.path.join(repo, "common"), os.path.join(folder, "common"))
        command = [sys.executable, "reactor.py", "--env-id", "MinAtar/Breakout-v0", "--total-timesteps", "30000"]
        command += ["--eval-episodes", "0", "--no-cuda", "--no-progress", "--exp-name", "bench"]
        subprocess.run(command, cwd=folder, check=True, timeout=seconds_limit, capture_output=True)
        (run_dir,) = [os.path.join(folder, "runs", d) for d in os.listdir(os.path.join(folder, "runs"))]
        records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        with open(os.path.join(run_dir, "summary.json")) as f:
            wall = json.load(f)["wall_time_s"]
    rates = [r["charts/learner_steps_per_s"] for r in records if "charts/learner_steps_per_s" in r]
    return float(np.median(rates)), wall


def bench_run(baseline_script, rounds):
    scripts = {"ours": reactor.__file__} | ({"before": baseline_script} if baseline_script else {})
    results = {v: [] for v in scripts}
    for _ in range(rounds):
        for v, script in scripts.items():
            results[v].append(run_once(script))
    print(
        f"\n| real loop, MinAtar/Breakout-v0, 30k steps (learning from 10k), 2 actors, median of {rounds} round(s) | "
        "learner steps/s (median of the logged values) | wall time (s) |\n|---|---|---|"
    )
    for v, runs in results.items():
        rate = float(np.median([r for r, _ in runs]))
        wall = float(np.median([w for _, w in runs]))
        print(f"| {v} | {rate:.1f} | {wall:.0f} |", flush=True)
    if baseline_script:
        ratio = np.median([r for r, _ in results["ours"]]) / np.median([r for r, _ in results["before"]])
        print(f"| ours / before | {ratio:.2f} | |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-script", default=None, help="an earlier reactor.py to time beside this one")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (replay, learner)")
    parser.add_argument("--repeats", type=int, default=300, help="calls per replay timing (the baseline: a fifth)")
    parser.add_argument("--num-actors", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="per acting measurement")
    parser.add_argument("--acting-rounds", type=int, default=2)
    parser.add_argument("--learn-seconds", type=float, default=5.0, help="per learner measurement")
    parser.add_argument(
        "--learner-threads",
        type=int,
        default=1,
        help="torch threads of the learner (set_learner_threads gives 1 with 2 actors on 2 cores)",
    )
    parser.add_argument(
        "--start-fractions", type=float, nargs="+", default=[0.01, 0.05], help="episode starts per replay frame (learner)"
    )
    parser.add_argument("--run-rounds", type=int, default=1, help="real runs of each script (run)")
    parser.add_argument("--section-steps", type=int, default=100, help="learning steps per row (sections)")
    parser.add_argument("--skip", nargs="*", default=[], help="replay | learner | sections | acting | run")
    a = parser.parse_args()
    baseline = load_script(a.baseline_script) if a.baseline_script else None
    t0 = time.time()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"cpprb {cpprb_version()}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if "replay" not in a.skip:
        bench_replay(a.sizes, a.rounds, a.repeats, baseline)
    if "learner" not in a.skip:
        bench_learner(a.learn_seconds, a.rounds, baseline, a.learner_threads, a.start_fractions)
    if "sections" not in a.skip:
        bench_sections(a.section_steps, a.start_fractions)
    if "acting" not in a.skip:
        bench_acting(a.num_actors, a.seconds, a.acting_rounds)
    if "run" not in a.skip:
        bench_run(a.baseline_script, a.run_rounds)
    print(f"\n{time.time() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")

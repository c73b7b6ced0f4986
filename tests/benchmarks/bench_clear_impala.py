"""Benchmarks for clear_impala.py (not collected by pytest).

1. learner: in one process, the learner's work per batch (pair selection, gather of the chosen halves from the
   shared slots, forward, V-trace + cloning losses, backward, RMSProp step, weight publish) and the actor's CLEAR
   work per unroll (reservoir insert, replay sampling, copy of the replay half into the slot), timed for
   --replay-fraction 0.5 and 0 interleaved, so that both see the same machine load. Learner SPS = B*T / learner time.
   The "CLEAR overhead" is the extra learner time plus the actor-side replay work of the B unrolls of a batch.
2. actors: end-to-end run of the script (N actors, batch N) for --seconds, charts/actor_SPS from its metrics.jsonl,
   against N processes that only step the same env with random actions (env-only SPS).
3. training: end-to-end training steps/s of the script (steady state: global steps / time between the records after
   --warmup s), replay off (--replay-fraction 0) vs CLEAR (50-50 + BC), interleaved A/B x --repeats in one invocation,
   and env-only SPS of the same number of processes x envs in the same invocation.

  python tests/benchmarks/bench_clear_impala.py learner --config atari
  python tests/benchmarks/bench_clear_impala.py learner --config minigrid
  python tests/benchmarks/bench_clear_impala.py actors --env-id MiniGrid-DoorKey-5x5-v0 --num-procs 2 --seconds 40
  python tests/benchmarks/bench_clear_impala.py training --env-id MinAtar/Breakout-v0 --num-procs 2 --envs-per-actor 16
"""

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import clear_impala as ci  # noqa: E402

CONFIGS = {
    "atari": dict(obs_shape=(4, 84, 84), num_actions=18, torso="nature"),
    "atari-resnet": dict(obs_shape=(4, 84, 84), num_actions=18, torso="resnet"),
    "minigrid": dict(obs_shape=(7, 7, 3), num_actions=7, torso="minigrid"),
    "minatar": dict(obs_shape=(10, 10, 10), num_actions=6, torso="minatar"),
}


def bench_learner(cfg, B, T, iters, device, threads):
    torch.set_num_threads(threads)
    obs_shape = cfg["obs_shape"]
    A = cfg["num_actions"]
    rng = np.random.default_rng(0)
    specs = ci.unroll_specs(obs_shape, A, T)
    N = B  # one slot per actor, num_actors = batch_size
    slots = {k: torch.from_numpy(np.zeros((N, 2, *s), dtype=d)).share_memory_() for k, (s, d) in specs.items()}
    slots["obs"].random_(0, 255)
    slots["action"].random_(0, A)
    model = ci.Agent(obs_shape, A, cfg["torso"]).to(device)
    shared = ci.SharedWeights.share(ci.Agent(obs_shape, A, cfg["torso"]))
    opt = torch.optim.RMSprop(model.parameters(), lr=6e-4, alpha=0.99, eps=0.01)
    buffer = ci.ReservoirBuffer(2000, obs_shape, A, T, rng)  # one actor's memory (capacity does not change the cost)
    new = {k: slots[k][0, 0].numpy() for k in ci.UNROLL_FIELDS}
    rep = {k: slots[k][0, 1].numpy() for k in ci.UNROLL_FIELDS}
    for _ in range(200):
        buffer.add(new, 0)

    replay_weights = ci.ReplayImportanceWeights(1, device)
    # the hand-off's counter and semaphores, as the learner has them
    global_step = SimpleNamespace(value=0)
    slot_free = [threading.Semaphore(0) for _ in range(N)]

    def learner_step(ratio):
        args = ci.Args(replay_fraction=ratio)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        which = torch.from_numpy(ci.select_pairs(np.ones(B, bool), ratio, rng))
        batch = ci.take_batch(slots, list(range(B)), which)
        ci.release_slots(list(range(B)), slot_free, global_step, T)
        update = ci.learner_step(model, opt, shared, batch, which, 6e-4, args, device)
        if ratio > 0:  # the learner's replay diagnostic (replay/<task>/importance_weight), as in clear_impala.py
            replay_weights.add(update.unroll, which, torch.zeros(B, dtype=torch.int64))
        float(update.parts["losses/total_loss"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def actor_replay_work():
        t0 = time.perf_counter()
        buffer.add(new, 0)
        row = buffer.sample()
        for k in ci.UNROLL_FIELDS:
            rep[k][:] = buffer.data[k][row]
        return time.perf_counter() - t0

    for r in (0.5, 0.0):  # warm-up
        learner_step(r)
    times = {0.5: [], 0.0: []}
    actor = []
    for i in range(iters):
        for r in (0.5, 0.0) if i % 2 == 0 else (0.0, 0.5):
            times[r].append(learner_step(r))
        actor.extend(actor_replay_work() for _ in range(B))
    med = {r: float(np.median(v)) for r, v in times.items()}
    actor_per_batch = float(np.median(actor)) * B
    out = {
        "config": cfg,
        "B": B,
        "T": T,
        "device": str(device),
        "threads": threads,
        "iters": iters,
        "learner_SPS_replay_0.5": B * T / med[0.5],
        "learner_SPS_replay_0": B * T / med[0.0],
        "learner_overhead_pct": 100 * (med[0.5] / med[0.0] - 1),
        "actor_replay_work_ms_per_unroll": 1000 * actor_per_batch / B,
        "clear_overhead_pct_incl_actor_work": 100 * ((med[0.5] + actor_per_batch) / med[0.0] - 1),
    }
    return out


def env_only_worker(env_id, seed, seconds, out_q, num_envs=1):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    envs = [ci.make_env(env_id, seed + e, ci.Args()) for e in range(num_envs)]
    for e, env in enumerate(envs):
        env.reset(seed=seed + e)
    n = 0
    t0 = time.time()
    while time.time() - t0 < seconds:
        for env in envs:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            n += 1
            if term or trunc:
                env.reset()
    out_q.put(n / (time.time() - t0))


def env_only_sps(env_id, num_procs, seconds, num_envs=1):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=env_only_worker, args=(env_id, i, seconds, q, num_envs)) for i in range(num_procs)]
    for p in procs:
        p.start()
    env_sps = sum(q.get() for _ in procs)
    for p in procs:
        p.join()
    return env_sps


def run_script_for(flags, seconds):
    """Run clear_impala.py with `flags` for `seconds` (after start-up), stop it like Ctrl-C, return its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "out.txt"), "w")
        p = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "clear_impala.py"), *flags],
            cwd=tmp,
            env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        time.sleep(seconds)
        os.killpg(p.pid, signal.SIGINT)  # like Ctrl-C in a terminal: the whole process group
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print(open(os.path.join(tmp, "out.txt")).read()[-3000:])
            os.killpg(p.pid, signal.SIGKILL)
            raise
        (run,) = os.listdir(os.path.join(tmp, "runs"))
        return [json.loads(x) for x in open(os.path.join(tmp, "runs", run, "metrics.jsonl"))]


def bench_training(env_id, num_procs, envs_per_actor, batch_size, seconds, warmup, repeats):
    """Steady-state training SPS, replay off vs CLEAR 50-50 + BC, interleaved; env-only SPS in the same invocation."""
    common = [
        "--env-ids",
        env_id,
        "--mode",
        "separate",
        "--steps-per-task",
        "100000000",
        "--num-cycles",
        "1",
        "--num-actors",
        str(num_procs),
        "--envs-per-actor",
        str(envs_per_actor),
        "--batch-size",
        str(batch_size),
        "--num-test-actors",
        "0",
        "--no-progress",
        "--log-every-seconds",
        "2",
        "--no-cuda",
        "--buffer-size",
        "500000",
    ]
    configs = {"replay off (--replay-fraction 0)": ["--replay-fraction", "0"], "CLEAR 50-50 + BC": []}
    sps = {name: [] for name in configs}
    for i in range(repeats):
        for name in list(configs) if i % 2 == 0 else list(configs)[::-1]:
            records = [r for r in run_script_for(common + configs[name], warmup + seconds) if "charts/SPS" in r]
            steady = [r for r in records if r["time"] >= warmup]
            sps[name].append((steady[-1]["global_step"] - steady[0]["global_step"]) / (steady[-1]["time"] - steady[0]["time"]))
    env_sps = env_only_sps(env_id, num_procs, 10, envs_per_actor)
    names = list(configs)
    return {
        "env_id": env_id,
        "num_procs": num_procs,
        "envs_per_actor": envs_per_actor,
        "batch_size": batch_size,
        "seconds": seconds,
        "warmup": warmup,
        "repeats": repeats,
        "training_SPS": sps,
        "mean_SPS": {k: float(np.mean(v)) for k, v in sps.items()},
        "clear_over_replay_off": float(np.mean(sps[names[1]]) / np.mean(sps[names[0]])),
        "env_only_SPS": env_sps,
    }


def bench_actors(env_id, num_procs, seconds):
    env_sps = env_only_sps(env_id, num_procs, seconds)
    lines = run_script_for(
        [
            "--env-ids",
            env_id,
            "--steps-per-task",
            "100000000",
            "--num-cycles",
            "1",
            "--num-actors",
            str(num_procs),
            "--batch-size",
            str(num_procs),
            "--num-test-actors",
            "0",
            "--no-progress",
            "--log-every-seconds",
            "2",
            "--no-cuda",
            "--start-method",
            "forkserver",
            "--buffer-size",
            "200000",
        ],
        seconds + 15,
    )  # start-up + measurement
    rows = [x for x in lines if "charts/actor_SPS" in x][2:]  # skip the start-up records
    actor_sps = float(np.mean([x["charts/actor_SPS"] for x in rows]))
    learner_sps = float(np.mean([x["charts/learner_SPS"] for x in rows]))
    return {
        "env_id": env_id,
        "num_procs": num_procs,
        "seconds": seconds,
        "env_only_SPS": env_sps,
        "actor_SPS": actor_sps,
        "actor_over_env_only": actor_sps / env_sps,
        "learner_SPS_in_run": learner_sps,
        "records": len(rows),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["learner", "actors", "training"])
    ap.add_argument("--config", default="atari", choices=list(CONFIGS))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--unroll-length", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--env-id", default="MiniGrid-DoorKey-5x5-v0")
    ap.add_argument("--num-procs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--envs-per-actor", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, torch {torch.__version__}")
    if a.what == "learner":
        res = bench_learner(CONFIGS[a.config], a.batch_size, a.unroll_length, a.iters, torch.device(a.device), a.threads)
    elif a.what == "training":
        res = bench_training(a.env_id, a.num_procs, a.envs_per_actor, a.batch_size, a.seconds, a.warmup, a.repeats)
    else:
        res = bench_actors(a.env_id, a.num_procs, a.seconds)
    print(json.dumps(res, indent=1))

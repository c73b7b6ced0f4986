"""Benchmark for plr_ppo.py (not collected by pytest).

1. PLR bookkeeping overhead: the training script run with --plr-strategy value_l1 and with random (uniform levels),
   same config, alternating A/B/A/B in this one invocation; reports training SPS and the share of wall time spent in
   the sampler (charts/plr_seconds: score computation, update_with_rollouts, after_update).
2. Sampler micro-benchmark: update_with_rollouts on a 64 x 256 rollout plus one sample() per finished episode, at
   200 levels (Procgen), 4,000 (MultiRoom), 10,000 bounded levels and a 10,000-level buffer (unbounded mode); with
   --baseline-script, the older script's sampler and this one's, alternating.
3. Environment-only SPS (random actions, with the sampler choosing the levels) beside training SPS.

Usage (from the repo root):
  python tests/benchmarks/bench_plr_ppo.py                      # all three, Procgen bigfish, small budget
  python tests/benchmarks/bench_plr_ppo.py --env-id MultiRoom-N4-Random --total-timesteps 32768 --repeats 2
  # before/after: git worktree add /tmp/plr_before <commit>; ... --baseline-script /tmp/plr_before/plr_ppo.py
  # the paper's MiniGrid batch, before/after, each run pinned to one core:
  python tests/benchmarks/bench_plr_ppo.py --env-id MultiRoom-N4-Random --num-steps 256 --total-timesteps 81920 \
      --skip sampler,env --baseline-script /tmp/plr_before/plr_ppo.py --taskset 0
SPS of a training run is measured over its updates after the first (the first holds start-up and warm-up).
"""

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import plr_ppo  # noqa: E402


def load_script(path):
    """An older plr_ppo.py as a module, importing the common/ beside it (e.g. a `git worktree` of an earlier commit)."""
    ours = {name: module for name, module in sys.modules.items() if name == "common" or name.startswith("common.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(Path(path).parent))
    try:
        spec = importlib.util.spec_from_file_location("baseline_plr_ppo", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
        for name in [name for name in sys.modules if name == "common" or name.startswith("common.")]:
            del sys.modules[name]
        sys.modules.update(ours)
    return module


def bench_sampler(module, num_levels, unbounded, N=64, T=256, mean_episode_len=100, reps=5, seed=0):
    """Seconds per rollout for update_with_rollouts + the sample() calls of its finished episodes, with the
    LevelSampler of `module` (this plr_ppo or an older one)."""
    rng = np.random.default_rng(seed)
    levels = None if unbounded else np.arange(num_levels)
    settings = dict(
        buffer_size=num_levels if unbounded else 0,
        staleness_coef=0.1,
        replay_schedule="fixed" if unbounded else "proportionate",
        replay_prob=0.95,
    )
    if hasattr(module, "UnboundedLevelSampler"):
        if unbounded:
            s = module.UnboundedLevelSampler(N, module.SamplerConfig(**settings), seed=seed)
        else:
            s = module.BoundedLevelSampler(levels, N, module.SamplerConfig(**settings), seed=seed)
    elif hasattr(module, "SamplerConfig"):
        # before the two modes were two classes
        s = module.LevelSampler(levels, N, module.SamplerConfig(**settings), seed=seed)
    else:
        # before the settings were bundled in SamplerConfig
        s = module.LevelSampler(levels, N, seed=seed, **settings)
    # start from a full sampler (every level seen and scored) so replays, the expensive path, happen
    if unbounded:
        s.seeds[:] = rng.choice(2**31 - 1, size=num_levels, replace=False)
        s.slot_of = {int(x): i for i, x in enumerate(s.seeds)}
    s.seen[:] = True
    s.num_seen = num_levels
    s.scores[:] = rng.random(num_levels)
    s.staleness[:] = rng.integers(0, 1000, num_levels)
    cur = np.array([s.sample(i) for i in range(N)])
    times_update = []
    times_sample = []
    n_eps = []
    for rep in range(reps + 2):
        dones = rng.random((T, N)) < 1.0 / mean_episode_len
        lv = np.zeros((T, N), np.int64)
        t_sample = 0.0
        for t in range(T):
            lv[t] = cur
            for i in np.flatnonzero(dones[t]):
                t0 = time.perf_counter()
                cur[i] = s.sample(int(i))
                t_sample += time.perf_counter() - t0
        adv = rng.normal(size=(T, N)).astype(np.float32)
        t0 = time.perf_counter()
        s.update_with_rollouts(module.step_scores("value_l1", adv, None), dones, lv)
        s.after_update()
        t_update = time.perf_counter() - t0
        if rep >= 2:
            times_update.append(t_update)
            times_sample.append(t_sample)
            n_eps.append(int(dones.sum()))
    return {
        "levels": num_levels,
        "mode": "unbounded buffer" if unbounded else "bounded",
        "num_seen": int(s.num_seen),
        "episodes_per_rollout": float(np.mean(n_eps)),
        "update_ms": 1e3 * float(np.median(times_update)),
        "sample_ms_total": 1e3 * float(np.median(times_sample)),
        "sample_us_each": 1e6 * float(np.sum(times_sample) / max(1, np.sum(n_eps))),
    }


def bench_env(env_id, num_envs, steps, num_train_levels):
    """Environment-only SPS with random actions and the PLR sampler choosing each new level."""
    args = plr_ppo.resolve_defaults(plr_ppo.Args(env_id=env_id, num_envs=num_envs, num_train_levels=num_train_levels))
    envs = plr_ppo.make_env(args, num_envs, seed=0)
    sampler = plr_ppo.make_sampler(args, seed=0)
    envs.reset([sampler.sample(i) for i in range(num_envs)])
    n = int(envs.single_action_space.n)
    rng = np.random.default_rng(0)
    for _ in range(5):
        envs.step(rng.integers(n, size=num_envs), next_level=sampler.sample)
    t0 = time.perf_counter()
    for _ in range(steps):
        envs.step(rng.integers(n, size=num_envs), next_level=sampler.sample)
    sps = steps * num_envs / (time.perf_counter() - t0)
    envs.close()
    return sps


def run_training(env_id, strategy, total, num_envs, num_steps, extra, script=ROOT / "plr_ppo.py", cpus=""):
    """One training run in a subprocess (pinned with `taskset -c cpus` if cpus is given); SPS after the first update."""
    with tempfile.TemporaryDirectory() as tmp:
        pin = ["taskset", "-c", cpus] if cpus else []
        cmd = [
            *pin,
            sys.executable,
            str(script),
            "--no-progress",
            "--env-id",
            env_id,
            "--plr-strategy",
            strategy,
            "--total-timesteps",
            str(total),
            "--num-envs",
            str(num_envs),
            "--num-steps",
            str(num_steps),
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "0",
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=str(Path(script).parent))
        subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True, text=True)
        (run,) = (Path(tmp) / "runs").iterdir()
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [x for x in lines if "charts/SPS" in x]
        # charts/SPS is cumulative since the start: the seconds of updates 2..K are K B / SPS_K - B / SPS_1
        batch = num_envs * num_steps
        seconds = len(rows) * batch / rows[-1]["charts/SPS"] - batch / rows[0]["charts/SPS"]
        rows = rows[1:]  # drop the first update (warm-up)
        wall = sum(x["charts/collect_seconds"] for x in rows)
        plr = sum(x["charts/plr_seconds"] for x in rows)
        return {
            "sps": len(rows) * batch / seconds,
            "plr_seconds": plr,
            "updates": len(rows),
            "collect_seconds": wall,
            "load": os.getloadavg()[0],
        }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="bigfish")
    p.add_argument("--total-timesteps", type=int, default=5 * 64 * 64)
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--env-steps", type=int, default=200)
    p.add_argument("--skip", default="", help="comma list of parts to skip: train,sampler,env")
    p.add_argument("--extra", default="", help="extra flags for plr_ppo.py, space separated")
    p.add_argument("--taskset", default="", help="pin each training run to these CPUs (taskset -c), e.g. 0")
    p.add_argument("--script", default=str(ROOT / "plr_ppo.py"), help="the plr_ppo.py to train with (default: this repo's)")
    p.add_argument(
        "--baseline-script",
        default="",
        help="an older plr_ppo.py (e.g. in a `git worktree` of an earlier "
        "commit): the training part then runs it and this one (value_l1 both), A/B, instead of value_l1 vs random",
    )
    a = p.parse_args()
    skip = set(a.skip.split(",")) - {""}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    if "sampler" not in skip:
        print("\n## sampler: update_with_rollouts + sample() per 64x256 rollout (value_l1, rank, rho=0.1)")
        modules = {"this": plr_ppo}
        if a.baseline_script:
            modules = {"before": load_script(a.baseline_script), "after": plr_ppo}
        for levels, unbounded in ((200, False), (4000, False), (10_000, False), (10_000, True)):
            totals = {}
            # A/B/A/B: each sampler twice, alternating
            for name, module in [*modules.items(), *modules.items()]:
                r = bench_sampler(module, levels, unbounded)
                totals.setdefault(name, []).append(r["update_ms"] + r["sample_ms_total"])
                print(
                    f"{name:>6} {r['mode']:>17} {levels:>6} levels (seen {r['num_seen']:>5}): "
                    f"update {r['update_ms']:.2f} ms, {r['episodes_per_rollout']:.0f} samples "
                    f"{r['sample_ms_total']:.2f} ms ({r['sample_us_each']:.0f} us each)"
                )
            if a.baseline_script:
                before = np.median(totals["before"])
                after = np.median(totals["after"])
                print(
                    f"  sampler ms per rollout: before {before:.2f}, after {after:.2f} (after / before {after / before:.2f})"
                )
    if "env" not in skip:
        print(f"\n## env-only SPS ({a.env_id}, {a.num_envs} envs, random actions, sampler picks levels)")
        print(f"env-only SPS: {bench_env(a.env_id, a.num_envs, a.env_steps, -1):.0f}")
    if "train" not in skip:
        print(
            f"\n## training SPS, value_l1 vs random ({a.env_id}, {a.num_envs}x{a.num_steps}, "
            f"{a.total_timesteps} steps, A/B x {a.repeats}{', taskset -c ' + a.taskset if a.taskset else ''})"
        )
        if a.baseline_script:  # before (an older script) vs after (this one), both value_l1
            runs = {"before": ("value_l1", a.baseline_script), "value_l1": ("value_l1", a.script)}
        else:
            runs = {"value_l1": ("value_l1", a.script), "random": ("random", a.script)}
        res = {k: [] for k in runs}
        for _ in range(a.repeats):
            for name, (strategy, script) in runs.items():
                extra = a.extra.split()
                r = run_training(a.env_id, strategy, a.total_timesteps, a.num_envs, a.num_steps, extra, script, a.taskset)
                res[name].append(r)
                print(
                    f"{name:>9}: SPS {r['sps']:.0f} (updates 2..{r['updates'] + 1}), sampler time {r['plr_seconds']:.3f} s, "
                    f"collect {r['collect_seconds']:.1f} s, load {r['load']:.1f}",
                    flush=True,
                )
        sps = {k: float(np.mean([r["sps"] for r in v])) for k, v in res.items()}
        if a.baseline_script:
            print(
                f"mean SPS before {sps['before']:.0f}, after {sps['value_l1']:.0f} "
                f"(ratio {sps['value_l1'] / sps['before']:.2f})"
            )
            return
        share = np.mean([r["plr_seconds"] / (r["updates"] * a.num_envs * a.num_steps / r["sps"]) for r in res["value_l1"]])
        print(
            f"mean SPS value_l1 {sps['value_l1']:.0f}, random {sps['random']:.0f} "
            f"(ratio {sps['value_l1'] / sps['random']:.3f}); sampler share of value_l1 wall time {100 * share:.2f}%"
        )


if __name__ == "__main__":
    main()

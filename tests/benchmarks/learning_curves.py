"""Learning-curve tables (and an optional plot) from runs' metrics.jsonl (not collected by pytest).

Prints, for each run directory, the mean of a metric in bins of environment steps, as the markdown table the README
Results sections use, plus the mean over the last `--last` values. `--eval-vracer K` also plays K episodes with the
deterministic policy (mean action) from each run's checkpoint.pt (vracer_refer.py runs only).

Usage:
  python tests/benchmarks/learning_curves.py runs/Hopper-v5__a runs/Hopper-v5__b [--bin 100000]
      [--metric charts/episodic_return] [--last 20] [--plot curves.png] [--eval-vracer 10]
      [--with refer/beta refer/far_policy_frac refer/kl]   (one more table per run: bin means of these metrics)
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common.checkpoint import load_checkpoint  # noqa: E402
from common.logger import read_metrics  # noqa: E402


def label(end: int, bin_size: int) -> str:
    """'600k-700k' for the bin (600k, 700k]."""
    k = lambda x: f"{x / 1e6:g}M" if x >= 1_000_000 and x % 1_000_000 == 0 else f"{x / 1e3:g}k"
    return f"{k(end - bin_size) if end > bin_size else '0'}-{k(end)}"


def binned(rows, metric: str, bin_size: int):
    """({bin end: mean of `metric` over the rows whose global_step falls in (end - bin_size, end]},
    {bin end: number of those rows}, all values in order)."""
    steps = np.array([r["global_step"] for r in rows if metric in r], dtype=np.int64)
    vals = np.array([r[metric] for r in rows if metric in r], dtype=np.float64)
    ends = ((steps - 1) // bin_size + 1) * bin_size
    bins = np.unique(ends)
    return ({int(e): float(vals[ends == e].mean()) for e in bins},
            {int(e): int((ends == e).sum()) for e in bins}, vals)


def eval_vracer(run_dir: str, episodes: int) -> tuple[float, int]:
    """Mean return of `episodes` deterministic-policy episodes from run_dir/checkpoint.pt, and its env step."""
    import torch

    import vracer_refer as vr
    try:
        ckpt = load_checkpoint(os.path.join(run_dir, "checkpoint.pt"))
    except (FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"error: {e} (run with --checkpoint-every N to have one)") from None
    a = ckpt["args"]
    obs_dim, act_dim = ckpt["dims"]
    agent = vr.Agent(obs_dim, act_dim, a["hidden_size"], a["init_std"], a["std_map"], a["residual"])
    agent.load_state_dict(ckpt["model"])
    returns = vr.evaluate(agent, a["env_id"], a["seed"] + 10_000, episodes, ckpt["obs_mean"], ckpt["obs_std"],
                          torch.device("cpu"), a["clip_actions"])
    return float(np.mean(returns)), ckpt["global_step"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--metric", default="charts/episodic_return")
    p.add_argument("--bin", type=int, default=100_000)
    p.add_argument("--last", type=int, default=20)
    p.add_argument("--plot", default=None)
    p.add_argument("--eval-vracer", type=int, default=0)
    p.add_argument("--with", dest="extra", nargs="*", default=[])
    a = p.parse_args()
    runs_rows = [read_metrics(os.path.join(d, "metrics.jsonl")) for d in a.runs]  # read each file once
    tables, lasts, names = [], [], []
    for d, rows in zip(a.runs, runs_rows):
        t, _, vals = binned(rows, a.metric, a.bin)
        tables.append(t)
        lasts.append(float(vals[-a.last:].mean()) if len(vals) else float("nan"))
        names.append(os.path.basename(os.path.normpath(d)))
    ends = sorted(set().union(*tables))
    print("| env steps | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for e in ends:
        print(f"| {label(e, a.bin)} | " + " | ".join(f"{t[e]:.0f}" if e in t else "-" for t in tables) + " |")
    print(f"| mean of last {a.last} | " + " | ".join(f"{v:.0f}" for v in lasts) + " |")
    if a.eval_vracer:
        cells = []
        for d in a.runs:
            m, step = eval_vracer(d, a.eval_vracer)
            cells.append(f"{m:.0f} (at {step:,})")
        print(f"| deterministic policy, {a.eval_vracer} episodes | " + " | ".join(cells) + " |")
    for rows, name in zip(runs_rows, names) if a.extra else ():
        ret, count, _ = binned(rows, a.metric, a.bin)
        cols = [binned(rows, m, a.bin)[0] for m in a.extra]
        print(f"\n{name}\n| env steps | episodes | mean return | " + " | ".join(a.extra) + " |")
        print("|---|---|---|" + "---|" * len(a.extra))
        for e in sorted(ret):
            print(f"| {label(e, a.bin)} | {count.get(e, 0)} | {ret[e]:.0f} | "
                  + " | ".join(f"{c[e]:.3g}" if e in c else "-" for c in cols) + " |")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for all_rows, name in zip(runs_rows, names):
            rows = [r for r in all_rows if a.metric in r]
            x = np.array([r["global_step"] for r in rows])
            y = np.array([r[a.metric] for r in rows])
            k = max(1, a.last)
            if len(y) >= k:
                y = np.convolve(y, np.ones(k) / k, mode="valid")
                x = x[k - 1:]
            ax.plot(x, y, label=name)
        ax.set_xlabel("environment steps")
        ax.set_ylabel(a.metric + f" (moving mean of {a.last})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)
        print(f"plot: {a.plot}")
    print(json.dumps({"runs": names, "last_mean": lasts}))


if __name__ == "__main__":
    main()

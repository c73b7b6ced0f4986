"""Learning-curve tables and figures from runs' metrics.jsonl (not collected by pytest).

Prints, for each run directory, the mean of a metric in bins of environment steps, as the markdown table the README
Results sections use, plus the mean over the last `--last` values. `--eval-vracer K` also plays K episodes with the
deterministic policy (mean action) from each run's checkpoint.pt (vracer_refer.py runs only); `--eval-reactor K` plays
K games with the greedy policy (argmax pi) of each reactor.py run's saved model (kept as the run's eval_greedy.json).

`--plot FILE.png` draws one curve per configuration: runs are grouped by their directory name without seed and time
(`{env}__{exp_name}__{seed}__{time}` -> `{env}__{exp_name}`, or `--labels`, one per run); the line is the mean over
seeds of the per-bin means and the band spans the lowest to the highest seed. Only measured bins are drawn, and only
those that every seed of the configuration reached (a mean over fewer seeds would jump); the legend gives the seeds.
README figures go to tests/benchmarks/results/ (small PNGs).

Usage:
  python tests/benchmarks/learning_curves.py runs/Hopper-v5__a runs/Hopper-v5__b [--bin 100000]
      [--metric charts/episodic_return] [--last 20] [--plot curves.png] [--title T] [--labels A B] [--eval-vracer 10]
      [--with refer/beta refer/far_policy_frac refer/kl]   (one more table per run: bin means of these metrics)
      [--series plr/mass_rooms=1 plr/mass_rooms=2 ...]      (with --plot: one line per metric, over the runs given)
      [--summary final_test_return wall_time_s ...]         (a table of summary.json values, mean ± sd per config)
      [--hline 0.49 random]                                 (with --plot: a dashed reference line, e.g. a random policy)
      [--point 20000000 0.45 "PLR, published (approx.)"]    (with --plot, repeatable: a labelled marker, e.g. a
                                                              published figure read off a paper's plot)
      [--legend-below] [--open-points]                      (with --plot: the legend under the axes, for long labels;
                                                              hollow markers in colours of their own)
      [--max-step 1000000]                                  (tables and plots leave out records past this step)
      [--eval-reactor 100]                                  (reactor.py runs with --save-model: greedy games)
      [--export tests/benchmarks/results/<experiment>]       (keep each run's returns and --with metrics as
                                                              <run>/metrics.jsonl.gz, with its summary.json, args.json,
                                                              eval_greedy.json: read back like a run directory)
"""

import argparse
import gzip
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common.args import resume_args  # noqa: E402
from common.checkpoint import load_checkpoint  # noqa: E402
from common.logger import read_metrics  # noqa: E402


def label(end: int, bin_size: int) -> str:
    """'600k-700k' for the bin (600k, 700k]."""

    def short(x):
        return f"{x / 1e6:g}M" if x >= 1_000_000 and x % 1_000_000 == 0 else f"{x / 1e3:g}k"

    return f"{short(end - bin_size) if end > bin_size else '0'}-{short(end)}"


def binned(rows, metric: str, bin_size: int):
    """({bin end: mean of `metric` over the rows whose global_step falls in (end - bin_size, end]},
    {bin end: number of those rows}, all values in order). Step 0 (an episode logged before the learner counted a
    step) falls in the first bin."""
    steps = np.array([r["global_step"] for r in rows if metric in r], dtype=np.int64)
    vals = np.array([r[metric] for r in rows if metric in r], dtype=np.float64)
    ends = np.maximum((steps - 1) // bin_size + 1, 1) * bin_size
    bins = np.unique(ends)
    return ({int(e): float(vals[ends == e].mean()) for e in bins}, {int(e): int((ends == e).sum()) for e in bins}, vals)


def read_run(run_dir: str) -> list[dict]:
    """A run's metrics.jsonl, or the metrics.jsonl.gz that --export kept of it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        return read_metrics(path)
    with gzip.open(path + ".gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def export_run(run_dir: str, rows: list[dict], metrics: list[str], out_dir: str) -> None:
    """Keep `metrics` and eval/ records (global_step and those keys) as out_dir/<run>/metrics.jsonl.gz, and the run's
    summary.json, args.json, eval_greedy.json and eval_records.json (clear_impala.py's test-actor records)."""
    dest = os.path.join(out_dir, os.path.basename(os.path.normpath(run_dir)))
    os.makedirs(dest, exist_ok=True)
    kept = [{k: v for k, v in r.items() if k == "global_step" or k in metrics or k.startswith("eval/")} for r in rows]
    with gzip.open(os.path.join(dest, "metrics.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in kept if len(r) > 1)
    for name in ("summary.json", "args.json", "eval_greedy.json", "eval_records.json"):
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy(os.path.join(run_dir, name), dest)
    print(f"export: {dest}")


def config_name(run_dir: str) -> str:
    """'Hopper-v5__vracer_refer' for runs/Hopper-v5__vracer_refer__3__1700000000 (the seed and start time dropped)."""
    parts = os.path.basename(os.path.normpath(run_dir)).split("__")
    return "__".join(parts[:-2]) if len(parts) >= 4 else "__".join(parts)


def plot_groups(
    tables: list[dict],
    groups: list[str],
    path: str,
    metric: str,
    bin_size: int,
    title: str,
    hline: list | None = None,
    ylim: list | None = None,
    points: list | None = None,
    legend_below: bool = False,
    open_points: bool = False,
) -> None:
    """Mean over the runs of each group of their bin means (line), lowest to highest run (band), vs environment steps;
    `ylim` cuts the y axis (a curve that leaves it is drawn up to where it does); `points`: (step, value, label)
    markers, one legend entry per label; `legend_below`: the legend under the axes (long labels); `open_points`: the
    markers hollow and in colours of their own (nearby values stay legible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.2) if legend_below else (6, 3.6))
    for group in dict.fromkeys(groups):  # first-seen order
        members = [t for t, g in zip(tables, groups) if g == group]
        ends = sorted(set.intersection(*(set(t) for t in members)))  # bins every seed reached
        vals = [[t[e] for t in members if e in t] for e in ends]
        mean = np.array([np.mean(v) for v in vals])
        (line,) = ax.plot(ends, mean, label=f"{group} ({len(members)} seed{'s' * (len(members) > 1)})")
        ax.fill_between(ends, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.2)
    if hline:
        ax.axhline(float(hline[0]), color="gray", linestyle="--", linewidth=1, label=" ".join(hline[1:]) or None)
    markers = iter("oD^sv<>p")
    point_colours = iter(["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black"])
    for point_label in dict.fromkeys(text for _, _, text in points or []):
        steps = [float(step) for step, _, text in points if text == point_label]
        values = [float(value) for _, value, text in points if text == point_label]
        if open_points:
            colour = next(point_colours)
            style = {"facecolors": "none", "edgecolors": colour, "linewidths": 1.3, "s": 36}
        else:
            style = {"color": "black", "s": 25}
        ax.scatter(steps, values, marker=next(markers), zorder=3, label=point_label, **style)
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_xlabel("environment steps")
    ax.set_ylabel(f"{metric}\n(mean per {bin_size:,} steps)", fontsize=8)
    ax.set_title(title, fontsize=9)
    if legend_below:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    else:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


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
    returns = vr.evaluate(
        agent,
        a["env_id"],
        a["seed"] + 10_000,
        episodes,
        ckpt["obs_mean"],
        ckpt["obs_std"],
        torch.device("cpu"),
        a["clip_actions"],
    )
    return float(np.mean(returns)), ckpt["global_step"]


def eval_reactor(run_dir: str, episodes: int) -> dict:
    """`episodes` games with the greedy policy (argmax pi) of run_dir's saved model (reactor.py --save-model), on the
    final evaluation's game seeds; kept as run_dir/eval_greedy.json (which --export keeps)."""
    import torch

    import reactor

    models = [f for f in os.listdir(run_dir) if f.endswith(".model")]
    if not models:
        raise SystemExit(f"error: no saved model in {run_dir} (run reactor.py with --save-model)")
    try:
        saved = load_checkpoint(os.path.join(run_dir, models[0]))
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    args, _ = resume_args(reactor.Args(), (), saved["args"], ())  # --resume's reader: skips non-flags (run_name)
    probe = reactor.make_env(args.env_id, args.seed, args)
    net = reactor.make_network(args, int(probe.action_space.n), probe.observation_space.shape)
    probe.close()
    net.load_state_dict(saved["model"])
    with torch.no_grad():
        returns = reactor.evaluate(net, args, episodes, "cpu", args.seed + 10_000, greedy=True)
    out = {
        "episodes": len(returns),
        "return_mean": float(np.mean(returns)),
        "return_se": float(np.std(returns, ddof=1) / np.sqrt(len(returns))) if len(returns) > 1 else 0.0,
        "returns": returns,
    }
    with open(os.path.join(run_dir, "eval_greedy.json"), "w") as f:
        json.dump(out, f)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--metric", default="charts/episodic_return")
    p.add_argument("--bin", type=int, default=100_000)
    p.add_argument("--last", type=int, default=20)
    p.add_argument("--plot", default=None)
    p.add_argument("--title", default="")
    p.add_argument("--ylabel", default=None, help="y-axis label (default: the metric)")
    p.add_argument("--labels", nargs="*", default=None)
    p.add_argument("--eval-vracer", type=int, default=0)
    p.add_argument("--eval-reactor", type=int, default=0)
    p.add_argument("--with", dest="extra", nargs="*", default=[])
    p.add_argument(
        "--summary",
        nargs="*",
        default=[],
        help="also a table of these summary.json keys per run and their "
        "mean ± sd per configuration (e.g. final_test_return wall_time_s)",
    )
    p.add_argument(
        "--series",
        nargs="*",
        default=[],
        help="with --plot: one line per metric named here (mean and "
        "band over the runs given, e.g. plr/mass_rooms=1 ... for PLR's Figure 4) instead of per configuration",
    )
    p.add_argument("--hline", nargs="+", default=None, help="with --plot: VALUE [LABEL], a dashed reference line")
    p.add_argument("--ylim", type=float, nargs=2, default=None, help="with --plot: LOW HIGH of the y axis")
    p.add_argument(
        "--point",
        nargs=3,
        action="append",
        default=[],
        metavar=("STEP", "VALUE", "LABEL"),
        help="with --plot (repeatable): a labelled marker, e.g. a published figure",
    )
    p.add_argument("--legend-below", action="store_true", help="with --plot: the legend under the axes (long labels)")
    p.add_argument("--open-points", action="store_true", help="with --point: hollow markers, a colour each (nearby values)")
    p.add_argument("--export", default=None, help="keep each run's returns under this folder (see the usage)")
    p.add_argument(
        "--max-step",
        type=int,
        default=None,
        help="tables and plots leave out records past this env step "
        "(a run's last actor chunk can pass --total-timesteps by a few steps); --export keeps them",
    )
    a = p.parse_args()
    runs_rows = [read_run(d) for d in a.runs]  # read each file once
    shown = [[r for r in rows if a.max_step is None or r["global_step"] <= a.max_step] for rows in runs_rows]
    tables = []
    lasts = []
    names = []
    for d, rows in zip(a.runs, shown):
        t, _, vals = binned(rows, a.metric, a.bin)
        tables.append(t)
        lasts.append(float(vals[-a.last :].mean()) if len(vals) else float("nan"))
        names.append(os.path.basename(os.path.normpath(d)))
    ends = sorted(set().union(*tables))
    print("| env steps | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for e in ends:
        print(f"| {label(e, a.bin)} | " + " | ".join(f"{t[e]:.4g}" if e in t else "-" for t in tables) + " |")
    print(f"| mean of last {a.last} | " + " | ".join(f"{v:.4g}" for v in lasts) + " |")
    if a.eval_vracer or a.eval_reactor:
        import torch

        torch.set_num_threads(1)  # one small network: more threads only contend with training runs for the cores
    if a.eval_vracer:
        cells = []
        for d in a.runs:
            m, step = eval_vracer(d, a.eval_vracer)
            cells.append(f"{m:.0f} (at {step:,})")
        print(f"| deterministic policy, {a.eval_vracer} episodes | " + " | ".join(cells) + " |")
    if a.eval_reactor:
        cells = [eval_reactor(d, a.eval_reactor) for d in a.runs]
        print(
            f"| greedy policy (argmax pi), {a.eval_reactor} games | "
            + " | ".join(f"{c['return_mean']:.3g} ± {c['return_se']:.2g}" for c in cells)
            + " |"
        )
    for d, rows in zip(a.runs, runs_rows) if a.export else ():  # after --eval-reactor: keeps its eval_greedy.json
        export_run(d, rows, [a.metric, *a.extra], a.export)
    for rows, name in zip(shown, names) if a.extra else ():
        ret, count, _ = binned(rows, a.metric, a.bin)
        cols = [binned(rows, m, a.bin)[0] for m in a.extra]
        print(f"\n{name}\n| env steps | episodes | mean return | " + " | ".join(a.extra) + " |")
        print("|---|---|---|" + "---|" * len(a.extra))
        for e in sorted(ret):
            print(
                f"| {label(e, a.bin)} | {count.get(e, 0)} | {ret[e]:.0f} | "
                + " | ".join(f"{c[e]:.3g}" if e in c else "-" for c in cols)
                + " |"
            )
    if a.summary:
        sums = []
        for d in a.runs:
            with open(os.path.join(d, "summary.json")) as f:
                sums.append(json.load(f))
        print("\n| run | " + " | ".join(a.summary) + " |\n|---|" + "---|" * len(a.summary))
        for name, sm in zip(names, sums):
            print(f"| {name} | " + " | ".join(f"{sm.get(k, float('nan')):.4g}" for k in a.summary) + " |")
        groups = [config_name(d) for d in a.runs]
        for g in dict.fromkeys(groups):
            vals = np.array([[sm.get(k, np.nan) for k in a.summary] for sm, gg in zip(sums, groups) if gg == g], float)
            print(
                f"| **{g}** ({len(vals)} runs) | "
                + " | ".join(
                    f"{m:.4g} ± {sd:.2g}" for m, sd in zip(vals.mean(0), vals.std(0, ddof=1) if len(vals) > 1 else 0 * vals[0])
                )
                + " |"
            )
    if a.plot and a.series:
        tables = [binned(rows, m, a.bin)[0] for m in a.series for rows in shown]
        plot_groups(tables, [m for m in a.series for _ in shown], a.plot, a.ylabel or "value", a.bin, a.title)
    elif a.plot:
        if a.labels and len(a.labels) != len(a.runs):
            raise SystemExit(f"error: --labels needs one label per run ({len(a.runs)}), got {len(a.labels)}")
        plot_groups(
            tables,
            a.labels or [config_name(d) for d in a.runs],
            a.plot,
            a.ylabel or a.metric,
            a.bin,
            a.title,
            a.hline,
            a.ylim,
            a.point,
            a.legend_below,
            a.open_points,
        )
    print(json.dumps({"runs": names, "last_mean": lasts}))


if __name__ == "__main__":
    main()

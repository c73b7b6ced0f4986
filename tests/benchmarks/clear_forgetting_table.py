"""Forgetting tables for clear_impala.py task-sequence runs (README Results; not collected by pytest).

Reads each run's args.json, summary.json and eval_records.json (the test actors' (step, task, return) records) and
prints, grouped by configuration (replay fraction, behavioural cloning):
1. the paper's Figure 8 table: final cumulative return per task (`final_cumulative_return` in summary.json, the time
   average of the test return over the whole run), mean over seeds, with each seed's value;
2. the per-visit table: each task's mean test return during each visit of the sequence (mean over seeds), which shows
   when a task is learned and when it is forgotten;
3. with `--displaced A --displacing B` (task indices): per run, the moment B is first learned in its first visit
   (the first 2.5k-step window whose mean test return reaches 0.5), and A's mean test return in the 5k steps before
   that moment, in the 5k steps after it, and in the last 5k steps of the visit after B's. This separates the
   collapse of A when B is learned from A's recovery (from replay only) while other tasks train;
4. the forgetting table: each task's test return over the last --window steps of its (last) visit and of the run,
   mean ± sd over seeds (in non-sequential modes every task trains all the time: "end of visit" = the same steps);
5. with `--plot PATH`: the paper's Figure 2 for every configuration (one panel each): test return of every task vs
   training steps, mean and min-max spread over seeds (1% bins, `binned_returns`), the visits shaded.

    python tests/benchmarks/clear_forgetting_table.py runs/<run 1> runs/<run 2> ... [--displaced 1 --displacing 2]
        [--window 100000] [--plot tests/benchmarks/results/clear_minatar.png] [--random 0.49 3.06 0.11]
"""

from __future__ import annotations

import argparse
import json
import os
import sys  # noqa: E402
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from clear_impala import binned_returns  # noqa: E402


def load_run(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "args.json")) as f:
        args = json.load(f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "eval_records.json")) as f:
        records = np.asarray(json.load(f), dtype=float).reshape(-1, 3)  # (global_step, task, return)
    return {"args": args, "summary": summary, "records": records}


def replay_fraction(args: dict) -> float:
    """The run's --replay-fraction; args.json of a run from before the rename (the exports) names it replay_ratio."""
    return args["replay_fraction"] if "replay_fraction" in args else args["replay_ratio"]


def config_name(args: dict) -> str:
    flags = "" if args.get("bootstrap_truncation") in (True, None) else ", --bootstrap-truncation False"
    if args.get("entropy_cost", 0.005) != 0.005:
        flags += f", --entropy-cost {args['entropy_cost']:g}"
    mode = args.get("mode", "sequential")
    fraction = replay_fraction(args)
    if fraction == 0:  # the paper's Fig. 1 baselines: sequential / simultaneous / separate
        return f"{mode}, no replay (--replay-fraction 0{flags})"
    mode = "" if mode == "sequential" else f"{mode}, "
    bc = "+ BC" if args["behavior_cloning"] else "no BC (--no-behavior-cloning)"
    return f"{mode}CLEAR {1 - fraction:.0%}-{fraction:.0%} {bc}{flags}"


def per_visit_means(records: np.ndarray, num_tasks: int, steps_per_task: int, num_visits: int) -> np.ndarray:
    """[task, visit] mean test return while visit v (task v mod K) was being trained; nan where no episode ended."""
    out = np.full((num_tasks, num_visits), np.nan)
    visit = (records[:, 0] // steps_per_task).astype(int)
    for k in range(num_tasks):
        for v in range(num_visits):
            m = (records[:, 1] == k) & (visit == v)
            if m.any():
                out[k, v] = records[m, 2].mean()
    return out


def window_mean(records: np.ndarray, task: int, start: float, end: float) -> float:
    """Mean test return of `task` over episodes reported in [start, end) steps; nan where none ended."""
    m = (records[:, 1] == task) & (records[:, 0] >= start) & (records[:, 0] < end)
    return float(records[m, 2].mean()) if m.any() else float("nan")


def collapse_and_recovery(
    records: np.ndarray,
    displaced: int,
    displacing: int,
    steps_per_task: int,
    threshold: float = 0.5,
    step: int = 2500,
    window: int = 5000,
):
    """(t_learned, before, after, end_of_next_visit) for the displaced task around the moment the displacing task
    is first learned in its first visit; t_learned is None (and before/after nan) if it is not learned there."""
    # the displacing task's first visit
    v0 = displacing * steps_per_task
    v1 = (displacing + 1) * steps_per_task
    end_next = window_mean(records, displaced, v1 + steps_per_task - window, v1 + steps_per_task)
    for t in range(v0, v1, step):
        if window_mean(records, displacing, t, t + step) >= threshold:
            return (
                t,
                window_mean(records, displaced, t - window, t),
                window_mean(records, displaced, t + step, t + step + window),
                end_next,
            )
    return None, float("nan"), float("nan"), end_next


def sd(values: np.ndarray) -> float:
    """The sample standard deviation over seeds (ddof 1); 0 for one seed."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def short(env_id: str) -> str:
    return env_id.replace("MiniGrid-", "").replace("MinAtar/", "").replace("-v0", "")


def plot_configs(groups: dict, env_ids: list, L: int, V: int, path: str, random_returns: list | None) -> None:
    """Rows: tasks, columns: configurations; test return vs steps (2% bins), mean and min-max over seeds, the task's
    visits shaded (sequential modes), the random policy's return dotted. Each row's y range: 1.5 x its highest mean,
    so a spike of one seed's bin does not flatten the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(env_ids)
    total = V * L
    fig, axes = plt.subplots(
        K, len(groups), figsize=(2.3 * len(groups), 1.5 * K + 0.5), sharex=True, sharey="row", squeeze=False
    )
    row_max = np.zeros(K)
    for col, (name, rs) in enumerate(groups.items()):
        for k in range(K):
            ax = axes[k][col]
            curves = [binned_returns([tuple(x) for x in r["records"]], k, total, num_bins=50) for r in rs]
            n = min(len(c[0]) for c in curves)
            steps = curves[0][0][-n:] / 1e6
            ys = np.array([c[1][-n:] for c in curves])
            ax.plot(steps, ys.mean(0), lw=1, color=f"C{k}")
            row_max[k] = max(row_max[k], ys.mean(0).max())
            ax.fill_between(steps, ys.min(0), ys.max(0), color=f"C{k}", alpha=0.25, lw=0)
            if rs[0]["args"].get("mode", "sequential") == "sequential":
                for v in range(k, V, K):
                    ax.axvspan(v * L / 1e6, (v + 1) * L / 1e6, color="grey", alpha=0.12, lw=0)
            if random_returns:
                ax.axhline(random_returns[k], color="black", lw=0.8, ls=":")
            ax.tick_params(labelsize=6)
            if col == 0:
                ax.set_ylabel(short(env_ids[k]), fontsize=7)
        axes[0][col].set_title(f"{name.split(' (')[0]} ({len(rs)} seeds)", fontsize=7)
        axes[-1][col].set_xlabel("training steps (M)", fontsize=7)
    for k in range(K):
        axes[k][0].set_ylim(min(0.0, axes[k][0].get_ylim()[0]), 1.5 * row_max[k])
    random_line = "; dotted: random policy" if random_returns else ""
    fig.suptitle(f"test return per task (mean, min-max over seeds; grey: the task's visit{random_line})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"\nwrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--displaced", type=int, help="task index whose collapse and recovery to report (e.g. 1)")
    p.add_argument("--displacing", type=int, help="task index whose first learning displaces it (e.g. 2)")
    p.add_argument("--window", type=int, default=100_000, help="steps at the end of a visit / of the run (table 4)")
    p.add_argument("--plot", help="write the per-configuration Figure 2 to this PNG")
    p.add_argument("--random", type=float, nargs="+", help="the random policy's return per task, in the runs' task order")
    cli = p.parse_args()
    runs = [load_run(d) for d in cli.runs]
    env_ids = runs[0]["args"]["env_ids"]
    K = len(env_ids)
    L = runs[0]["args"]["steps_per_task"]
    V = K * runs[0]["args"]["num_cycles"]
    for r in runs:
        same = (r["args"]["env_ids"], r["args"]["steps_per_task"], r["args"]["num_cycles"]) == (
            env_ids,
            L,
            runs[0]["args"]["num_cycles"],
        )
        if not same or r["summary"]["global_step"] < V * L:
            raise SystemExit("error: runs differ in tasks, steps per task or cycles, or one did not finish")
    groups: dict[str, list[dict]] = defaultdict(list)
    modes = ("separate", "simultaneous", "sequential")
    for r in sorted(
        runs,
        key=lambda r: (
            modes.index(r["args"].get("mode", "sequential")),
            replay_fraction(r["args"]),
            not r["args"]["behavior_cloning"],
        ),
    ):
        groups[config_name(r["args"])].append(r)  # by mode, then no replay, CLEAR + BC, CLEAR without BC

    print("Final cumulative test return per task (paper's Figure 8): mean ± sd over seeds [per seed, by seed]")
    print("| run | " + " | ".join(short(e) for e in env_ids) + " | mean over tasks |")
    print("|---" * (K + 2) + "|")
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["args"]["seed"])
        cum = np.array([[r["summary"]["final_cumulative_return"][e] for e in env_ids] for r in rs])  # [seed, task]
        task_mean = cum.mean(1)
        columns = [cum[:, k] for k in range(K)] + [task_mean]
        cells = [f"{c.mean():.2f} ± {sd(c):.2f} [{' / '.join(f'{x:.2f}' for x in c)}]" for c in columns]
        seeds = ",".join(str(r["args"]["seed"]) for r in rs)
        print(f"| {name}, seeds {seeds} | " + " | ".join(cells) + " |")
    if cli.random:
        print("| random policy | " + " | ".join(f"{x:.2f}" for x in cli.random) + f" | {np.mean(cli.random):.2f} |")

    visit_names = [f"{v + 1}: {short(env_ids[v % K])}" for v in range(V)]
    for name, rs in groups.items():
        pv = np.nanmean([per_visit_means(r["records"], K, L, V) for r in rs], axis=0)
        print(f"\n{name}: mean test return during each visit (mean over {len(rs)} seed(s))")
        print("| task | " + " | ".join(visit_names) + " |")
        print("|---" * (V + 1) + "|")
        for k in range(K):
            print(
                f"| {short(env_ids[k])} | "
                + " | ".join((f"**{pv[k, v]:.2f}**" if v % K == k else f"{pv[k, v]:.2f}") for v in range(V))
                + " |"
            )

    W = cli.window
    print(
        f"\nForgetting: test return over the last {W // 1000}k steps of each task's last visit -> of the run, "
        f"mean ± sd over seeds"
    )
    print("| run | " + " | ".join(short(e) for e in env_ids) + " |")
    print("|---" * (K + 1) + "|")
    for name, rs in groups.items():
        cells = []
        for k in range(K):
            sequential = rs[0]["args"].get("mode", "sequential") == "sequential"
            visit_end = (max(v for v in range(V) if v % K == k) + 1) * L if sequential else V * L
            end = np.array(
                [
                    [window_mean(r["records"], k, visit_end - W, visit_end), window_mean(r["records"], k, V * L - W, V * L)]
                    for r in rs
                ]
            )
            cells.append(f"{end[:, 0].mean():.2f} ± {sd(end[:, 0]):.2f} -> {end[:, 1].mean():.2f} ± {sd(end[:, 1]):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if cli.plot:
        plot_configs(groups, env_ids, L, V, cli.plot, cli.random)

    if cli.displaced is not None and cli.displacing is not None:
        a = cli.displaced
        b = cli.displacing
        print(
            f"\n{short(env_ids[a])} around the moment {short(env_ids[b])} is first learned (test return >= 0.5 "
            f"in a 2.5k-step window of its first visit), and at the end of the next visit"
        )
        print(f"| run, seed | {short(env_ids[b])} learned at | before (5k) | after (5k) | end of next visit (5k) |")
        print("|---|---|---|---|---|")
        for name, rs in groups.items():
            for r in sorted(rs, key=lambda r: r["args"]["seed"]):
                t, before, after, end_next = collapse_and_recovery(r["records"], a, b, L)
                when = "not learned" if t is None else f"{t / 1000:g}k"
                print(f"| {name}, {r['args']['seed']} | {when} | {before:.2f} | {after:.2f} | {end_next:.2f} |")


if __name__ == "__main__":
    main()

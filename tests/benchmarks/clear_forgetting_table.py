"""Forgetting tables for clear_impala.py task-sequence runs (README Results; not collected by pytest).

Reads each run's args.json, summary.json and eval_records.json (the test actors' (step, task, return) records) and
prints, grouped by configuration (replay ratio, behavioural cloning):
1. the paper's Figure 8 table: final cumulative return per task (`final_cumulative_return` in summary.json, the time
   average of the test return over the whole run), mean over seeds, with each seed's value;
2. the per-visit table: each task's mean test return during each visit of the sequence (mean over seeds), which shows
   when a task is learned and when it is forgotten.

    python tests/benchmarks/clear_forgetting_table.py runs/<run 1> runs/<run 2> ...
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import numpy as np


def load_run(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "args.json")) as f:
        args = json.load(f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "eval_records.json")) as f:
        records = np.asarray(json.load(f), dtype=float).reshape(-1, 3)  # (global_step, task, return)
    return {"args": args, "summary": summary, "records": records}


def config_name(args: dict) -> str:
    timeouts = "" if args.get("bootstrap_truncation", True) else ", --no-bootstrap-truncation"
    if args["replay_ratio"] == 0:
        return f"no replay (--replay-ratio 0{timeouts})"
    bc = "+ BC" if args["behavior_cloning"] else "no BC (--no-behavior-cloning)"
    return f"CLEAR {1 - args['replay_ratio']:.0%}-{args['replay_ratio']:.0%} {bc}{timeouts}"


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


def short(env_id: str) -> str:
    return env_id.replace("MiniGrid-", "").replace("-v0", "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    cli = p.parse_args()
    runs = [load_run(d) for d in cli.runs]
    env_ids = runs[0]["args"]["env_ids"]
    K, L = len(env_ids), runs[0]["args"]["steps_per_task"]
    V = K * runs[0]["args"]["num_cycles"]
    for r in runs:
        same = (r["args"]["env_ids"], r["args"]["steps_per_task"], r["args"]["num_cycles"]) == (
            env_ids, L, runs[0]["args"]["num_cycles"])
        if not same or r["summary"]["global_step"] < V * L:
            raise SystemExit("error: runs differ in tasks, steps per task or cycles, or one did not finish")
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (r["args"]["replay_ratio"], not r["args"]["behavior_cloning"])):
        groups[config_name(r["args"])].append(r)  # no replay first, then CLEAR + BC, then CLEAR without BC

    print("Final cumulative test return per task (paper's Figure 8): mean over seeds [per seed, by seed]")
    print("| run | " + " | ".join(short(e) for e in env_ids) + " | mean over tasks |")
    print("|---" * (K + 2) + "|")
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["args"]["seed"])
        cum = np.array([[r["summary"]["final_cumulative_return"][e] for e in env_ids] for r in rs])  # [seed, task]
        cells = [f"{cum[:, k].mean():.3f} [{' / '.join(f'{c:.2f}' for c in cum[:, k])}]" for k in range(K)]
        task_mean = cum.mean(1)
        cells.append(f"{task_mean.mean():.3f} [{' / '.join(f'{c:.2f}' for c in task_mean)}]")
        seeds = ",".join(str(r["args"]["seed"]) for r in rs)
        print(f"| {name}, seeds {seeds} | " + " | ".join(cells) + " |")

    visit_names = [f"{v + 1}: {short(env_ids[v % K])}" for v in range(V)]
    for name, rs in groups.items():
        pv = np.nanmean([per_visit_means(r["records"], K, L, V) for r in rs], axis=0)
        print(f"\n{name}: mean test return during each visit (mean over {len(rs)} seed(s))")
        print("| task | " + " | ".join(visit_names) + " |")
        print("|---" * (V + 1) + "|")
        for k in range(K):
            print(f"| {short(env_ids[k])} | " + " | ".join(
                (f"**{pv[k, v]:.2f}**" if v % K == k else f"{pv[k, v]:.2f}") for v in range(V)) + " |")


if __name__ == "__main__":
    main()

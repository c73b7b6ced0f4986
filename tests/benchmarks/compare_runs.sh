#!/usr/bin/env bash
# Two commits of the repo, the same tiny run of each script in each: the metric names of metrics.jsonl compared, and
# plr_ppo.py's records value by value (one process, deterministic; the time columns left out). For a refactor that
# must keep the outputs (run from the repository root, its venv active):
#   BASE=1c63510 NEWREF=HEAD bash tests/benchmarks/compare_runs.sh
# CLEAR_NEW_FLAGS / REACTOR_NEW_FLAGS: the new tree's names of the flags the old tree spells --replay-ratio, --buffer-frames.
set -u
BASE=${BASE:?set BASE to the old commit}
NEWREF=${NEWREF:-HEAD}
REPO=$(git rev-parse --show-toplevel)
W=${W:-/tmp/compare_runs}
rm -rf $W && mkdir -p $W/old $W/new
git -C "$REPO" archive $BASE | tar -x -C $W/old
git -C "$REPO" archive $NEWREF | tar -x -C $W/new
export OMP_NUM_THREADS=1
run() {  # tree script flags...
  local tree=$1; shift
  (cd $W/$tree && PYTHONPATH=$W/$tree timeout 600 python "$@" > $W/$tree/$(basename $1 .py).log 2>&1; echo "$tree $1 rc=$?")
}
CLEAR="--env-ids MiniGrid-Empty-5x5-v0 MiniGrid-LavaGapS5-v0 --num-actors 2 --batch-size 2 --unroll-length 20 --num-test-actors 1 --test-actor-max-sps 300 --log-every-seconds 0.5 --no-cuda --no-progress --steps-per-task 3000"
REACTOR="--env-id MinAtar/Breakout-v0 --num-actors 2 --replay-size 1200 --learning-starts 100 --ratio-slack 32 --log-every 1 --lstm-size 32 --num-atoms 11 --sequence-length 8 --batch-size 2 --eval-episodes 0 --no-cuda --no-progress --total-timesteps 3000"
PLR="--env-id MultiRoom-N4-Random --num-envs 4 --num-steps 32 --num-minibatches 2 --num-train-levels 20 --eval-every 4 --eval-episodes 4 --final-eval-episodes 4 --num-eval-envs 1 --num-workers 1 --no-cuda --no-progress --total-timesteps 2048"
VRACER="--env-id Hopper-v5 --num-actors 2 --learning-starts 500 --buffer-size 500 --batch-size 32 --log-every 100 --stats-every 200 --eval-episodes 0 --no-cuda --no-progress --total-timesteps 3000"
run old clear_impala.py $CLEAR --replay-ratio 0.5 --buffer-frames 2000
run new clear_impala.py $CLEAR ${CLEAR_NEW_FLAGS:---replay-fraction 0.5 --buffer-size 2000}
run old reactor.py $REACTOR --replay-ratio 60
run new reactor.py $REACTOR ${REACTOR_NEW_FLAGS:---acting-learning-ratio 60}
run old plr_ppo.py $PLR
run new plr_ppo.py $PLR
run old vracer_refer.py $VRACER
run new vracer_refer.py $VRACER
W=$W python - <<'PY'
import glob, json, os
W = os.environ["W"]
TIME = {"time", "charts/SPS", "charts/collect_seconds", "charts/plr_seconds"}
def records(tree, prefix):
    paths = sorted(glob.glob(f"{W}/{tree}/runs/{prefix}*/metrics.jsonl"))
    return [json.loads(line) for line in open(paths[-1])] if paths else None
for prefix in ("MiniGrid-Empty-5x5-v0+MiniGrid-LavaGapS5-v0", "MinAtar-Breakout-v0", "MultiRoom-N4-Random", "Hopper-v5"):
    old, new = records("old", prefix), records("new", prefix)
    if old is None and new is None:
        continue
    if old is None or new is None:
        print(prefix, "missing run:", "old" if old is None else "new")
        continue
    old_names = set().union(*old)
    new_names = set().union(*new)
    print(f"{prefix}: {len(old)} / {len(new)} records; names only old {sorted(old_names - new_names)}, only new {sorted(new_names - old_names)}")
    summaries = [json.load(open(sorted(glob.glob(f"{W}/{tree}/runs/{prefix}*/summary.json"))[-1])) for tree in ("old", "new")]
    print(f"  summary.json keys only old {sorted(set(summaries[0]) - set(summaries[1]))}, only new {sorted(set(summaries[1]) - set(summaries[0]))}")
    if prefix.startswith("MultiRoom"):
        same = len(old) == len(new) and all({k: v for k, v in a.items() if k not in TIME} == {k: v for k, v in b.items() if k not in TIME} for a, b in zip(old, new))
        print(f"  PLR records identical except time columns: {same}")
        same = [{k: v for k, v in summary.items() if k not in ("wall_time_s", "run_name")} for summary in summaries]
        print(f"  PLR summary.json identical except wall time and run name: {same[0] == same[1]}")
PY

#!/usr/bin/env bash
# The CLEAR MinAtar protocol (README, clear_impala.py "Results"): runs the given jobs one at a time, each NAME:SEED,
# from the folder it is started in (a frozen copy of the code: `git archive <commit> | tar -x -C DIR`), skipping jobs
# whose run folder already exists. Not collected by pytest.
#
#   cd DIR && bash /path/to/run_clear_minatar.sh clear_sequential:2 clear:2 clear_nobc:2 ...
#
# NAME: clear_sequential | clear | clear_nobc | clear_simultaneous | clear_separate. A cut run is started again,
# not resumed (without --checkpoint-replay its replay would restart empty). Logs go to logs/NAME_SEED.txt.
set -u
BASE=(--env-ids MinAtar/Breakout-v0 MinAtar/SpaceInvaders-v0 MinAtar/Seaquest-v0 --steps-per-task 1000000
      --num-cycles 1 --num-actors 3 --envs-per-actor 32 --batch-size 32 --num-test-actors 1 --test-actor-max-sps 100
      --no-cuda --checkpoint-every 500000 --no-progress)
declare -A CONFIG=(
  [clear_sequential]="--replay-fraction 0"
  [clear]=""
  [clear_nobc]="--no-behavior-cloning"
  [clear_simultaneous]="--mode simultaneous --replay-fraction 0"
  [clear_separate]="--mode separate --replay-fraction 0"
)
mkdir -p logs
for job in "$@"; do
  name=${job%:*}
  seed=${job#*:}
  if ls runs 2>/dev/null | grep -q "__${name}__${seed}__"; then
    echo "skip $job (its run folder exists)"
    continue
  fi
  echo "$(date +%T) start $job"
  # shellcheck disable=SC2086
  python clear_impala.py "${BASE[@]}" ${CONFIG[$name]} --seed "$seed" --exp-name "$name" > "logs/${name}_${seed}.txt" 2>&1
  echo "$(date +%T) end $job rc=$?"
done

"""Small helpers shared by the four scripts: environment adapters, run logging, checkpoints, process supervision.

No algorithm logic lives here. Each script names the modules it needs in its docstring; copy those with it.
- atari_env.py     Atari with DQN/IMPALA preprocessing (ale-py, gymnasium 1.x)
- procgen_env.py   Procgen vector env with per-episode level choice (PLR)
- minatar_env.py   MinAtar's five 10x10 games, uint8 (C, 10, 10), optional channel padding, full 6-action set
- minigrid_env.py  MiniGrid envs, the PLR paper's named envs, a vector env with per-episode level choice
- mujoco_env.py    MuJoCo v5 tasks with termination and truncation kept apart
- args.py          the common flags, one-line errors (require) and the --resume rule
- logger.py        runs/{run_name}: TensorBoard, metrics.jsonl, summary.json, progress line, optional wandb
- checkpoint.py    seeding, RNG state, device choice, atomic checkpoints
- processes.py     actor process start / death detection / shutdown, signals, thread and memory budget
- video.py         the --capture-video support check (RecordVideo needs moviepy)
- sum_tree.py      a sum tree over n leaves (prefix sums, sampling by mass; Reactor's lazy priorities)
"""

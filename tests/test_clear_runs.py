"""clear_impala.py, real runs (subprocesses) for the clauses of tests/test_clear_loop.py marked [runs], three runs
shared by the tests (module-scoped fixtures, each read once):
- a sequential two-task MiniGrid run with one pair per env in every batch (tests/clear_helpers.py TINY), checkpoints,
  --save-model and --checkpoint-replay;
- its resume with a new value for every flag of APPLIED_ON_RESUME, under a spy that records what the learner holds
  and uses at its first step and queues a test episode once the loop has stopped (RESUME_SPY), stopped by SIGTERM
  once both actors have restored their buffers and the test actors of both tasks have reported;
- a --mode separate run (two networks, one pair per env of each network in its batches);
and start-ups refused in one line (two resumes of the sequential run's checkpoint, clause R5, and a replay memory
that cannot fit), sharing one import.
No assertion depends on how fast a process starts or runs: a run of about a second may end before a test actor has
finished an episode, so test episodes are asserted only of the resumed run, which waits for them; the counts asserted
(learner steps, new steps per batch, unrolls seen, a lag of at most one update) are those the loop's mechanism fixes.
Signals, a killed actor, the resume rule and bad input: tests/test_lifecycle.py."""

import collections
import json
import math
import os
import random
import shutil
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from clear_helpers import QUEUED_AT_STOP, TINY, run_script, run_script_starts, start_spied_run, textbook_cumulative_return

import clear_impala as ci
from common.logger import read_metrics

STEPS_PER_TASK = 240
T = 20


def read_run(run_dir, stdout=""):
    """Everything a test reads from a run folder, read once (a later run in the same folder cannot change it)."""
    run = SimpleNamespace(dir=run_dir, stdout=stdout)
    run.summary = json.loads((run_dir / "summary.json").read_text())
    run.metrics = read_metrics(run_dir / "metrics.jsonl")
    run.eval_records = [tuple(r) for r in json.loads((run_dir / "eval_records.json").read_text())]
    run.checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    model_path = run_dir / "clear_impala.model"
    run.model_file = torch.load(model_path, weights_only=False) if model_path.exists() else None
    run.replay = {}
    for i in range(2):
        path = run_dir / f"replay_actor{i}.npz"
        if path.exists():
            with np.load(path) as saved:
                run.replay[i] = {"obs": saved["obs"], "num_seen": int(saved["num_seen"])}
    return run


def learner_records(run):
    """The metrics records of the learner's steps (--log-every-seconds 0: one record per learner step)."""
    return [m for m in run.metrics if "losses/total_loss" in m]


@pytest.fixture(scope="module")
def sequential_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sequential")
    # buffers of 6 unrolls per actor (240 steps / (2 actors x 20)), whatever --num-cycles the resume gives
    flags = "--num-cycles 1 --buffer-size 240 --checkpoint-every 240 --save-model --checkpoint-replay".split()
    r = run_script(tmp_path, *TINY, *flags)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    return read_run(run_dir, r.stdout)


def test_a_sequential_run_learns_logs_and_saves_what_readme_says(sequential_run):
    """Clauses B1 and F1 on a real run: 480 steps (two tasks of 240), every unroll on its designated task, CleanRL's
    and the README's metric names, the task switch in charts/task, the model file equal to the final checkpoint's
    weights; summary.json's final_cumulative_return is the textbook time average of eval_records.json over the 480
    steps reached (NaN for a task without test episodes: a run this short may end before a test actor has finished
    one, so their number is not asserted here but in the resumed run)."""
    run = sequential_run
    summary = run.summary
    assert summary["global_step"] == 480 and summary["task_mismatch"] == 0 and summary["stop_reason"] == "completed"
    env_ids = ["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"]
    names = set().union(*run.metrics)
    for name in (
        "losses/pg_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/policy_cloning_loss",
        "losses/value_cloning_loss",
        "losses/grad_norm",
        "charts/learner_SPS",
        "charts/actor_SPS",
        "charts/replay_fraction",
        "charts/buffer_fill",
        "charts/policy_lag",
        "charts/learning_rate",
        "charts/SPS",
        "charts/episodic_return",
    ):
        assert name in names, name
    tasks = [m["charts/task"] for m in run.metrics if "charts/task" in m]
    assert tasks[0] == 0 and tasks[-1] == 1
    assert len(run.eval_records) == sum(summary["num_eval_episodes"].values())
    for task, env_id in enumerate(env_ids):
        expected = textbook_cumulative_return(run.eval_records, task, 480)
        if expected is None:
            assert math.isnan(summary["final_cumulative_return"][env_id]), env_id
            assert summary["num_eval_episodes"][env_id] == 0, env_id
        else:
            assert summary["final_cumulative_return"][env_id] == pytest.approx(expected, rel=1e-9), env_id
    assert run.checkpoint["global_step"] == 480 and run.checkpoint["learner_steps"] == [12]
    for k, v in run.model_file["models"][0].items():
        assert torch.equal(v, run.checkpoint["models"][0][k]), k


def test_every_batch_lags_by_one_update_at_most_and_follows_the_lr_schedule(sequential_run):
    """Clauses W2, B1 and L1 on a real run with 2 envs and B = 2: one record per learner step, 40 new steps each
    (B x T); the batch's unrolls lag the learner by at most one update (the mechanism's bound, whatever the speeds);
    exactly one replay half per batch (--replay-fraction 0.5); the lr of each batch is 6e-4 (1 - steps before it / 480)."""
    records = learner_records(sequential_run)
    assert [m["global_step"] for m in records] == list(range(40, 481, 40))
    for m in records:
        step = m["global_step"]
        assert 0 <= m["charts/policy_lag"] <= 1, (step, m["charts/policy_lag"])
        assert m["charts/replay_fraction"] == 0.5, step
        assert m["charts/learning_rate"] == pytest.approx(6e-4 * (1 - (step - 40) / 480), rel=1e-9), step
        assert m["charts/task_mismatch"] == 0


def test_the_final_checkpoint_comes_with_every_actors_buffer_of_that_moment(sequential_run):
    """Clause R1 on a real run: each actor's replay_actor{i}.npz, saved with the final checkpoint (step 480), has seen
    at least the 12 unrolls the learner took from that actor's env by then (a file left from the checkpoint at step
    240 has seen about 7); its frames are uint8 unrolls of T + 1 rows, as many as the buffer holds (240 / (2 x 20))."""
    for i in range(2):
        saved = sequential_run.replay[i]
        assert saved["num_seen"] >= 12, (i, saved["num_seen"])
        assert saved["obs"].dtype == np.uint8 and saved["obs"].shape == (6, 21, 7, 7, 3)


# ----------------------------------------------------------------------------------------------------------------
# The resumed run: every applied flag changed, a spy on its first learner step, stopped early
# flag -> (the resumed run's value, how to read the value in effect from the spy's records at the first step)
APPLIED_PROBES = {
    # a run far longer than the test waits for (it is stopped by SIGTERM)
    "num_cycles": (10_000, lambda seen: seen["learner_step"]["end_step"] // (STEPS_PER_TASK * 2)),
    "num_test_actors": (2, lambda seen: len(seen["learner_step"]["test_actors"]) // 2),
    "batch_size": (1, lambda seen: seen["learner_step"]["batch_size"]),
    "policy_cloning_cost": (0.03, lambda seen: seen["clear_loss"]["args"]["policy_cloning_cost"]),
    "value_cloning_cost": (0.02, lambda seen: seen["clear_loss"]["args"]["value_cloning_cost"]),
    "pg_cost": (0.7, lambda seen: seen["clear_loss"]["args"]["pg_cost"]),
    "baseline_cost": (0.3, lambda seen: seen["clear_loss"]["args"]["baseline_cost"]),
    "entropy_cost": (0.02, lambda seen: seen["clear_loss"]["args"]["entropy_cost"]),
    "gamma": (0.9, lambda seen: seen["impala_losses"]["gamma"]),
    "clip_rho_threshold": (0.8, lambda seen: seen["impala_losses"]["clip_rho_threshold"]),
    "clip_pg_rho_threshold": (0.6, lambda seen: seen["impala_losses"]["clip_pg_rho_threshold"]),
    # the lr in the optimizer at the step, over the schedule's factor at the checkpoint's step
    "learning_rate": (1e-3, lambda seen: seen["param_groups"][0]["lr"] / (1 - 480 / seen["learner_step"]["end_step"])),
    "rmsprop_alpha": (0.95, lambda seen: seen["param_groups"][0]["alpha"]),
    "rmsprop_eps": (0.02, lambda seen: seen["param_groups"][0]["eps"]),
    "max_grad_norm": (20.0, lambda seen: seen["clip_grad_norm_"]["max_norm"]),
}


def written_records(run_dir):
    """The complete lines of a running run's metrics.jsonl (the last one may be half written)."""
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


ENV_IDS = ["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"]


def tasks_reported_after(records, step):
    """The tasks whose test episodes the learner logged (eval/<task>/episodic_return) after `step`."""
    return {env_id for env_id in ENV_IDS for m in records if m["global_step"] > step and f"eval/{env_id}/episodic_return" in m}


@pytest.fixture(scope="module")
def resumed_run(sequential_run, tmp_path_factory):
    """The sequential run resumed (a copy of its folder) with every APPLIED_PROBES value, under RESUME_SPY; stopped by
    SIGTERM once the spy has its records, both actors have restored their buffers and the resumed run's test actors of
    both tasks have reported an episode."""
    tmp_path = tmp_path_factory.mktemp("resumed")
    run_dir = tmp_path / "runs" / sequential_run.dir.name
    shutil.copytree(sequential_run.dir, run_dir)
    # a test-episode history of both tasks whatever the first run's test actors managed, with returns that rise with
    # the step (a random policy's MiniGrid returns are all 0), so that averaging over the steps reached and over the
    # planned run give different cumulative returns
    resumed_from = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    resumed_from["eval_records"] = [(step, task, task + step / 480) for step in (40, 160, 280, 400, 480) for task in (0, 1)]
    # global RNG states no fresh start has (the learner draws none after its set-up, so the saved ones would be)
    resumed_from["rng"] = {
        "python": random.Random(7).getstate(),
        "numpy": np.random.RandomState(7).get_state(),
        "torch": torch.Generator().manual_seed(7).get_state(),
    }
    torch.save(resumed_from, run_dir / "checkpoint.pt")
    spy_out = tmp_path / "spy.pt"
    flags = [f"--{name.replace('_', '-')}={value}" for name, (value, _) in APPLIED_PROBES.items()]
    proc = start_spied_run(tmp_path, spy_out, "--resume", str(run_dir / "checkpoint.pt"), *flags)
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "spied.out").read_text()[-2000:] + (tmp_path / "spied.err").read_text()
            assert time.time() < deadline, "the resumed run's actors did not restore their buffers and report both tasks"
            # each actor restores its buffer before its first unroll, but the learner (--batch-size 1) need not wait
            # for both actors: how far each has got is up to the scheduler, so the test waits for all three events
            restored = (tmp_path / "spied.out").read_text().count("replay unrolls from")
            if spy_out.exists() and restored == 2 and tasks_reported_after(written_records(run_dir), 480) == set(ENV_IDS):
                break
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run = read_run(run_dir, (tmp_path / "spied.out").read_text())
    run.returncode = proc.returncode
    run.resumed_from = resumed_from
    run.seen = torch.load(spy_out, weights_only=False)
    return run


def test_a_resumed_run_starts_from_exactly_what_the_checkpoint_holds(resumed_run):
    """Clause R3, in the resumed process at its first learner step (RESUME_SPY), compared one by one with the
    checkpoint at step 480: the global step at its first batch, the learner steps, the weights with their version,
    the optimizer's statistics (square averages, step counts), the test-episode history, the pair-selection stream at
    its first draw, the python, numpy and torch RNG states; its lr is the schedule's at the restored step; every
    actor restored its replay buffer."""
    checkpoint = resumed_run.resumed_from
    seen = resumed_run.seen
    first = seen["learner_step"]
    assert seen["global_step"] == checkpoint["global_step"] == 480
    assert first["learner_steps"] == checkpoint["learner_steps"] == [12]
    assert set(first["model"]) == set(checkpoint["models"][0]) and int(first["model"]["version"]) == 12
    for key, value in checkpoint["models"][0].items():
        assert torch.equal(first["model"][key], value), key
    restored_state = first["optimizer"]["state"]
    saved_state = checkpoint["optimizers"][0]["state"]
    assert set(restored_state) == set(saved_state) and saved_state
    for index, state in saved_state.items():
        for key, value in state.items():
            assert torch.equal(restored_state[index][key], value), (index, key)
    assert first["eval_records"] == [tuple(r) for r in checkpoint["eval_records"]] and first["eval_records"]
    assert seen["pair_rng"] == checkpoint["pair_rng"]
    assert first["rng"]["python"] == checkpoint["rng"]["python"]
    for saved, restored in zip(checkpoint["rng"]["numpy"], first["rng"]["numpy"]):
        assert np.array_equal(np.asarray(saved), np.asarray(restored))
    assert torch.equal(first["rng"]["torch"], checkpoint["rng"]["torch"])
    assert first["learning_rate"] == pytest.approx(1e-3 * (1 - 480 / first["end_step"]), rel=1e-12)
    assert "replay buffers of 2/2 actors" in resumed_run.stdout
    assert resumed_run.stdout.count("replay unrolls from") == 2


def test_every_applied_flag_takes_effect_from_the_resumed_step(sequential_run, resumed_run):
    """Clause R4: the resumed run was given a new value for every flag in APPLIED_PROBES, whose keys must be exactly
    APPLIED_ON_RESUME (a flag added to the class without a probe fails here); each value differs from the
    checkpoint's and is the value in effect at the first learner step (the optimizer's param groups, the lr over the
    schedule's factor, the loss's and V-trace's arguments, the clip's max norm, the batch's width, the test actor
    processes, the run's end)."""
    assert set(APPLIED_PROBES) == set(ci.APPLIED_ON_RESUME)
    checkpoint_args = sequential_run.checkpoint["args"]
    for name, (value, probe) in APPLIED_PROBES.items():
        assert checkpoint_args[name] != value, name
        assert probe(resumed_run.seen) == pytest.approx(value, rel=1e-9), name


def test_a_run_stopped_early_reports_cumulative_returns_over_the_steps_it_reached(resumed_run):
    """Clause F1 on the resumed run stopped by SIGTERM far before its end (4,800,000 steps): its test-episode history
    continues the checkpoint's (whose returns rise with the step), and summary.json's final_cumulative_return is the
    textbook time average of eval_records.json over the steps reached, not over the planned run (which differs)."""
    run = resumed_run
    summary = run.summary
    assert run.returncode == 128 + signal.SIGTERM and summary["stop_reason"] == "interrupted by SIGTERM"
    reached = summary["global_step"]
    end_step = STEPS_PER_TASK * 2 * APPLIED_PROBES["num_cycles"][0]
    assert 480 < reached < end_step
    first_history = run.seen["learner_step"]["eval_records"]
    assert run.eval_records[: len(first_history)] == first_history
    assert any(step > 480 for step, _, _ in run.eval_records)
    planned_differs = False
    for task, env_id in enumerate(ENV_IDS):
        expected = textbook_cumulative_return(run.eval_records, task, reached)
        assert summary["final_cumulative_return"][env_id] == pytest.approx(expected, rel=1e-9), env_id
        planned = textbook_cumulative_return(run.eval_records, task, end_step)
        planned_differs |= abs(planned - expected) > 1e-6
    assert planned_differs


def test_a_test_episode_still_queued_when_the_loop_stops_joins_the_record_and_the_summary(resumed_run):
    """Clause F1 on the real loop: RESUME_SPY puts a test episode no MiniGrid task can produce (QUEUED_AT_STOP, return
    4242.5) on the resumed run's eval queue once the loop's ProcessGroup.stop has stopped every process, and it is
    in the queue before the loop moves on. eval_records.json holds it once, at the step reached, after every
    episode the learner drained itself; the summary counts it (num_eval_episodes of its task is the number of that
    task's records) and final_return_last20 is the mean of that task's last 20 returns, it included."""
    task, episode_return, _ = QUEUED_AT_STOP
    env_id = ENV_IDS[task]
    reached = resumed_run.summary["global_step"]
    records = resumed_run.eval_records
    assert [record for record in records if record[2] == episode_return] == [(reached, task, episode_return)]
    assert records[-1] == (reached, task, episode_return)
    task_returns = [record_return for _, record_task, record_return in records if record_task == task]
    assert resumed_run.summary["num_eval_episodes"][env_id] == len(task_returns)
    assert resumed_run.summary["final_return_last20"][env_id] == pytest.approx(np.mean(task_returns[-20:]), rel=1e-9)


def test_the_test_actors_of_every_task_report_during_a_run(resumed_run):
    """Clause T1 on a real run: the resumed run's test actors (2 per task) played both tasks, and the learner logged
    their episodes under the README's names (eval/<task>/episodic_return and _length) while it ran; each logged
    episode is in eval_records.json at the step it was logged at, and the only ones not logged are those still
    queued at the end, recorded at the step reached."""
    records = resumed_run.metrics
    reached = resumed_run.summary["global_step"]
    assert tasks_reported_after(records, 480) == set(ENV_IDS)
    for task, env_id in enumerate(ENV_IDS):
        name = f"eval/{env_id}/episodic_return"
        logged = [m for m in records if m["global_step"] > 480 and name in m]
        assert all(f"eval/{env_id}/episodic_length" in m for m in logged)
        logged_episodes = collections.Counter((m["global_step"], m[name]) for m in logged)
        recorded = collections.Counter((step, ret) for step, t, ret in resumed_run.eval_records if t == task and step > 480)
        assert not logged_episodes - recorded, env_id
        assert all(step == reached for step, _ in (recorded - logged_episodes).elements()), env_id


# ----------------------------------------------------------------------------------------------------------------
# Start-ups refused in one line before any run folder: a resume that cannot continue exactly (R5), a memory that won't fit
def folder_snapshot(folder):
    """Every file under `folder` and its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def buffers_that_would_grow(checkpoint):
    """The first run as if given --buffer-size -1 (half its 480 steps: 6 unrolls per actor, as its saved buffers
    hold, each of at least 12 offered); --num-cycles 2 would grow them to 12."""
    checkpoint["args"]["buffer_size"] = -1
    return ["--num-cycles", "2"], "would grow to 12"


def weights_without_version(checkpoint):
    """A checkpoint of clear_impala.py before its weights carried their version."""
    for state in checkpoint["models"]:
        del state["version"]
    return ["--num-cycles", "2"], "'version'"


def old_replay_ratio_changed(checkpoint):
    """A checkpoint with the flags' old names (with_old_flag_names), resumed with another --replay-fraction: a fixed
    flag, refused under its new name against the value saved under its old one."""
    with_old_flag_names(checkpoint)
    return ["--replay-fraction", "0.5"], "--replay-fraction 0.5 differs from the checkpoint's 0.25"


def old_buffer_frames_changed(checkpoint):
    """As old_replay_ratio_changed, for --buffer-size (saved as buffer_frames)."""
    with_old_flag_names(checkpoint)
    return ["--buffer-size", "480"], "--buffer-size 480 differs from the checkpoint's 320"


REFUSED_CHANGES = {
    "buffers_that_would_grow": buffers_that_would_grow,
    "weights_without_version": weights_without_version,
    "old_replay_ratio_changed": old_replay_ratio_changed,
    "old_buffer_frames_changed": old_buffer_frames_changed,
}
# a replay memory of 10^13 steps
MEMORY_THAT_CANNOT_FIT = (
    "--env-ids MiniGrid-Empty-5x5-v0 --num-actors 2 --batch-size 2 --buffer-size 10000000000000 --no-progress"
)


@pytest.fixture(scope="module")
def refused_start_ups(sequential_run, tmp_path_factory):
    """Per REFUSED_CHANGES entry: a copy of the sequential run's folder whose checkpoint is changed as it says, resumed
    from its own directory; and a new run with MEMORY_THAT_CANNOT_FIT. They share one import of torch
    (run_script_starts)."""
    cases = {}
    for name, change in REFUSED_CHANGES.items():
        tmp_path = tmp_path_factory.mktemp(name)
        run_dir = tmp_path / "runs" / sequential_run.dir.name
        shutil.copytree(sequential_run.dir, run_dir)
        checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
        flags, reason = change(checkpoint)
        torch.save(checkpoint, run_dir / "checkpoint.pt")
        flags = ["--resume", str(run_dir / "checkpoint.pt"), *flags]
        cases[name] = SimpleNamespace(tmp_path=tmp_path, run_dir=run_dir, flags=flags, reason=reason)
        cases[name].before = folder_snapshot(run_dir)
    cases["memory"] = SimpleNamespace(tmp_path=tmp_path_factory.mktemp("memory"), flags=MEMORY_THAT_CANNOT_FIT.split())
    results = run_script_starts([(case.tmp_path, case.flags) for case in cases.values()])
    for case, result in zip(cases.values(), results, strict=True):
        case.returncode = result.returncode
        case.stdout = result.stdout
        case.stderr = result.stderr
    return cases


@pytest.mark.parametrize("change", list(REFUSED_CHANGES))
def test_a_resume_that_cannot_continue_exactly_is_refused_before_the_run_folder(refused_start_ups, change):
    """Clause R5: a copy of the sequential run's folder whose checkpoint is changed as `change` says, resumed: the
    script stops with one `error: --resume: ...` line (no traceback), leaves every file of the folder as it was and
    opens no other run folder (the refusal comes before any run folder is opened)."""
    r = refused_start_ups[change]
    assert r.returncode != 0, r.stdout[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --resume: ") and r.reason in last, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert folder_snapshot(r.run_dir) == r.before
    assert list((r.tmp_path / "runs").iterdir()) == [r.run_dir]


def test_buffer_that_cannot_fit_is_refused_at_start_up(refused_start_ups):
    """Start-up checks: a replay memory larger than the machine's is reported (bytes per stored step) and refused in
    one `error: the replay memory needs ...` line naming --buffer-size, before any run folder."""
    r = refused_start_ups["memory"]
    assert r.returncode != 0
    assert "B per stored step (observation 147 B" in r.stdout  # the start-up memory report
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the replay memory needs") and "--buffer-size" in last and "Traceback" not in r.stderr
    assert not (r.tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint written before --replay-ratio and --buffer-frames were renamed (RENAMED_FLAGS)
def with_old_flag_names(checkpoint):
    """`checkpoint` as clear_impala.py wrote it before --replay-ratio became --replay-fraction and --buffer-frames
    became --buffer-size, each with a value the sequential run did not use (0.25 and 320, not 0.5 and 240)."""
    flags = checkpoint["args"]
    del flags["replay_fraction"]
    del flags["buffer_size"]
    flags["replay_ratio"] = 0.25
    flags["buffer_frames"] = 320


@pytest.fixture(scope="module")
def resumed_from_old_flag_names(sequential_run, tmp_path_factory):
    """A copy of the sequential run's folder whose checkpoint has the old flag names (with_old_flag_names), resumed to
    its end with --num-cycles 2 (960 steps) and --no-checkpoint-replay (a buffer of 8 unrolls per actor would not
    take the saved 6 of 12 offered: check_restored_buffers)."""
    tmp_path = tmp_path_factory.mktemp("old_flag_names")
    run_dir = tmp_path / "runs" / sequential_run.dir.name
    shutil.copytree(sequential_run.dir, run_dir)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    with_old_flag_names(checkpoint)
    torch.save(checkpoint, run_dir / "checkpoint.pt")
    flags = ["--resume", str(run_dir / "checkpoint.pt"), "--num-cycles", "2", "--no-checkpoint-replay"]
    r = run_script(tmp_path, *flags)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return read_run(run_dir, r.stdout)


def test_a_checkpoint_with_the_old_flag_names_resumes_with_their_values_under_the_new_names(resumed_from_old_flag_names):
    """RENAMED_FLAGS on a real resume: the checkpoint's replay_ratio 0.25 and buffer_frames 320 are the run's
    --replay-fraction and --buffer-size: the summary's replay_fraction, the replay capacity the start-up reports (320
    steps: 8 unrolls of 20 for each of 2 actors), the batches' replay share (B = 2: 0 or 1 replay half, never both
    halves' 0.5 alone as at 0.5), and the new names (only) in the checkpoints the resumed run writes."""
    run = resumed_from_old_flag_names
    assert run.summary["global_step"] == 960 and run.summary["stop_reason"] == "completed"
    assert run.summary["replay_fraction"] == 0.25
    assert "replay: 8 unrolls/actor x 2 actors = 320 steps" in run.stdout
    fractions = [m["charts/replay_fraction"] for m in learner_records(run) if m["global_step"] > 480]
    assert len(fractions) == 12 and set(fractions) == {0.0, 0.5}
    saved_flags = run.checkpoint["args"]
    assert run.checkpoint["global_step"] == 960
    assert (saved_flags["replay_fraction"], saved_flags["buffer_size"]) == (0.25, 320)
    assert "replay_ratio" not in saved_flags and "buffer_frames" not in saved_flags


# ----------------------------------------------------------------------------------------------------------------
# --mode separate
@pytest.fixture(scope="module")
def separate_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("separate")
    flags = "--mode separate --envs-per-actor 2 --num-cycles 1 --checkpoint-every 240 --save-model".split()
    r = run_script(tmp_path, *TINY, *flags)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    return read_run(run_dir, r.stdout)


def test_separate_mode_trains_each_network_on_its_own_task_and_saves_them_all(separate_run):
    """Clauses L3, W2 and B1 with --mode separate (2 processes of 2 envs, one per task and network, B = 2): the
    networks take turns, 6 learner steps each, each batch of its own task (task_mismatch 0) and lagging its own
    network's version by at most one update; the lr follows the run's steps; the two networks differ, their
    versions count their own steps, each has its optimizer state, and --save-model keeps both, equal to the final
    checkpoint's; the pair-selection stream is the seeded one advanced once per learner step."""
    run = separate_run
    checkpoint = run.checkpoint
    assert run.summary["global_step"] == 480 and run.summary["task_mismatch"] == 0
    assert checkpoint["learner_steps"] == [6, 6]
    assert [int(model["version"]) for model in checkpoint["models"]] == [6, 6]
    records = learner_records(run)
    assert [m["global_step"] for m in records] == list(range(40, 481, 40))
    for m in records:
        assert 0 <= m["charts/policy_lag"] <= 1, (m["global_step"], m["charts/policy_lag"])
        assert m["charts/learning_rate"] == pytest.approx(6e-4 * (1 - (m["global_step"] - 40) / 480), rel=1e-9)
    assert all(optimizer["state"] for optimizer in checkpoint["optimizers"])
    assert any(not torch.equal(checkpoint["models"][0][k], checkpoint["models"][1][k]) for k in checkpoint["models"][0])
    assert len(run.model_file["models"]) == 2
    for saved, final in zip(run.model_file["models"], checkpoint["models"]):
        for k, v in final.items():
            assert torch.equal(saved[k], v), k
    rng = np.random.default_rng(checkpoint["args"]["seed"])
    for _ in range(sum(checkpoint["learner_steps"])):
        ci.select_pairs(np.ones(2, dtype=bool), 0.5, rng)
    assert checkpoint["pair_rng"] == rng.bit_generator.state

"""vracer_refer.py run for real: the loop's contract (the list in tests/test_vracer_loop.py) seen on real runs, and
the run contract of --resume (README "Conventions"): a resumed run continues exactly, every flag of
APPLIED_ON_RESUME takes effect, every flag of FIXED_ON_RESUME is refused.

Three runs in a chain, each the real `__main__` under the probe of tests/vracer_helpers.py (it records what the loop
hands the learner step, the actors, the checkpoints and the evaluation, and changes nothing):
- fresh: Hopper-v5, 2 actors, --per rank, N = N_start = 600, checkpoints (with the memory) every 300 steps, to 1,400;
- resumed: from the fresh run's end, with its memory, nothing else changed, 300 steps more, its checkpoints without
  the memory;
- refilled: from the resumed run's end (no memory: refilled), every flag of APPLIED_ON_RESUME changed.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vracer_helpers import load_records, run_probed, run_script

import vracer_refer as vr
from common.args import resume_args

FRESH = (
    "--env-id Hopper-v5 --num-actors 2 --learning-starts 600 --buffer-size 600 --batch-size 32 --log-every 100 "
    "--stats-every 200 --per rank --total-timesteps 1400 --checkpoint-every 300 --checkpoint-replay --save-model "
    "--eval-episodes 1"
).split()
OBS_DIM = 11
ACT_DIM = 3


def checkpoints_of(probe_dir) -> list[dict]:
    """Every checkpoint a run wrote, in order (the probe keeps a copy of each)."""
    files = sorted(Path(probe_dir).glob("checkpoint_*.pt"), key=lambda f: int(f.stem.split("_")[1]))
    return [torch.load(f, weights_only=False) for f in files]


def stats_every_not_dividing(k: int) -> int:
    """A --stats-every for the refilled run whose first update comes after its first gradient step."""
    return next(s for s in (47, 53, 59, 61) if k % s)


def applied_flag_changes(k: int, global_step: int) -> dict:
    """The refilled run's value of every flag of APPLIED_ON_RESUME (the resumed run ended at k, global_step)."""
    return {
        "total_timesteps": global_step + 700,
        "learning_starts": 100,
        "batch_size": 16,
        "learning_rate": 1e-3,
        "adam_eps": 1e-5,
        "F": 2.0,
        "C": 0.02,
        "A": 1e-3,
        "D": 0.999,
        "beta_lr": 0.01,
        "logrho_clip": 0.05,
        "per_alpha": 0.7,
        "per_beta0": 0.2,
        "action_noise": "normal",
        "clip_actions": True,
        "stats_every": stats_every_not_dividing(k),
        "state_stats_rate": 0.5,
        "num_actors": 1,
        "eval_episodes": 2,
    }


def command_line(changes: dict) -> list[str]:
    flags = []
    for name, value in changes.items():
        if isinstance(value, bool):
            flags.append(f"--{name.replace('_', '-')}" if value else f"--no-{name.replace('_', '-')}")
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def completed(process, what):
    assert process.returncode == 0, f"{what}: {process.stdout[-2000:]}\n{process.stderr[-4000:]}"
    return process


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The fresh, resumed and refilled runs (module docstring), with their records and checkpoints."""
    root = tmp_path_factory.mktemp("vracer_runs")
    fresh = completed(run_probed(root, root / "fresh", *FRESH), "fresh run")
    run_dir = next((root / "runs").iterdir())
    fresh_end = checkpoints_of(root / "fresh")[-1]
    resumed = completed(
        run_probed(
            root,
            root / "resumed",
            "--resume",
            str(run_dir / "checkpoint.pt"),
            "--total-timesteps",
            str(fresh_end["global_step"] + 300),
            "--no-checkpoint-replay",
        ),
        "resumed run",
    )
    resumed_end = checkpoints_of(root / "resumed")[-1]
    changes = applied_flag_changes(resumed_end["state"]["k"], resumed_end["global_step"])
    shutil.copy(run_dir / "checkpoint.pt", root / "resumed_end.pt")
    refilled = completed(
        run_probed(
            root, root / "refilled", "--resume", str(run_dir / "checkpoint.pt"), "--save-model", *command_line(changes)
        ),
        "refilled run",
    )
    return SimpleNamespace(
        root=root,
        run_dir=run_dir,
        fresh=SimpleNamespace(process=fresh, records=load_records(root / "fresh"), checkpoints=checkpoints_of(root / "fresh")),
        resumed=SimpleNamespace(
            process=resumed, records=load_records(root / "resumed"), checkpoints=checkpoints_of(root / "resumed")
        ),
        refilled=SimpleNamespace(
            process=refilled, records=load_records(root / "refilled"), checkpoints=checkpoints_of(root / "refilled")
        ),
        changes=changes,
        summary=json.loads((run_dir / "summary.json").read_text()),
    )


def network(weights: torch.Tensor) -> vr.Agent:
    agent = vr.Agent(OBS_DIM, ACT_DIM)
    torch.nn.utils.vector_to_parameters(weights.float(), agent.parameters())
    return agent


# ----------------------------------------------------------------------------------------------------------------
# The fresh run
def test_a_fresh_run_completes_logs_saves_and_checkpoints_at_its_end(chain):
    """The fresh run: CleanRL's and the method's metrics, the saved model, a checkpoint every --checkpoint-every env
    steps and one at the normal end (its step and k are the run's last)."""
    records = [json.loads(line) for line in (chain.run_dir / "metrics.jsonl").read_text().splitlines()]
    fresh_end = chain.fresh.checkpoints[-1]
    names = set().union(*(r for r in records if r["global_step"] <= fresh_end["global_step"]))
    for name in (
        "charts/episodic_return",
        "charts/SPS",
        "charts/policy_lag",
        "losses/policy_loss",
        "losses/value_loss",
        "refer/beta",
        "refer/far_policy_frac",
        "refer/c_max",
        "refer/kl",
        "charts/learning_rate",
        "eval/episodic_return",
    ):
        assert name in names, name
    assert (chain.run_dir / "vracer_refer.model").exists()
    steps = [c["global_step"] for c in chain.fresh.checkpoints]
    assert all(b - a >= 300 for a, b in zip(steps, steps[1:-1])) and len(steps) >= 4
    last_step = chain.fresh.records["steps"][-1]
    assert fresh_end["state"]["k"] == last_step["k"] + 1 and fresh_end["global_step"] >= 1400
    assert fresh_end["replay"] is not None and fresh_end["started"]


def test_actors_act_with_the_weights_and_statistics_of_the_version_they_record(chain):
    """Clause 1 on a real run: every step in the fresh run's final memory that was acted with one of the last 400
    publishes has mu = the network of that publish on the state standardised with that publish's statistics, and those
    steps are most of the memory (the versions rise with the publishes)."""
    memory = chain.fresh.checkpoints[-1]["replay"]
    publishes = chain.fresh.records["publishes"]
    stored = np.flatnonzero(memory["valid"])
    versions = memory["policy_version"][stored]
    checked = stored[np.isin(versions, list(publishes))]
    assert len(checked) >= 0.8 * len(stored) and len(set(versions[np.isin(stored, checked)])) >= 5
    for version in set(memory["policy_version"][checked]):
        steps = checked[memory["policy_version"][checked] == version]
        weights, obs_mean, obs_std, _ = publishes[version]
        with torch.no_grad():
            mean, std, _ = network(weights)((torch.as_tensor(memory["obs"][steps]) - obs_mean) / obs_std)
        np.testing.assert_allclose(memory["mu_mean"][steps], mean.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(memory["mu_std"][steps], std.numpy(), rtol=1e-5)


def test_actors_start_from_sigma_0_and_the_initial_network(chain):
    """Clause 2 on a real run: in the memory of the checkpoint written before learning started, every step was acted
    with the default initial std sigma_0 = sqrt(0.2) (App. A: Sigma = 0.2 I) and the initial network on the raw state
    (statistics 0 and 1 until learning starts), and u - m within 3 sigma (the truncated normal)."""
    before = next(c for c in chain.fresh.checkpoints if not c["started"] and c["replay"] is not None)
    memory = before["replay"]
    stored = np.flatnonzero(memory["valid"])
    assert len(stored) > 100 and not before["stats_ready"]
    np.testing.assert_allclose(memory["mu_std"][stored], np.sqrt(0.2), rtol=1e-6)
    agent = vr.Agent(OBS_DIM, ACT_DIM)
    agent.load_state_dict(before["model"])
    with torch.no_grad():
        mean, _, _ = agent(torch.as_tensor(memory["obs"][stored]))
    np.testing.assert_allclose(memory["mu_mean"][stored], mean.numpy(), rtol=1e-4, atol=1e-6)
    z = (memory["action"][stored] - memory["mu_mean"][stored]) / memory["mu_std"][stored]
    assert np.abs(z).max() <= 3.0 + 1e-4


def test_learning_starts_at_N_start_with_the_memory_statistics_then_frozen(chain):
    """Clause 5 on a real run: learning starts once the memory holds N_start = 600 samples; the state mean and std the
    first gradient step standardises with are the memory's at that moment (Eqs. (14)-(15)), the reward scale its RMS
    (Eq. (16)); the state statistics then stay as they were at every later step (--state-stats-rate 0, computed once)."""
    [start] = chain.fresh.records["state_stats_calls"]
    first = chain.fresh.records["first_step"]
    assert start["k"] == 0 and len(start["obs"]) >= 600 and first["state"]["k"] == 0
    states = start["obs"].astype(np.float64)
    torch.testing.assert_close(first["obs_mean"], torch.as_tensor(states.mean(0), dtype=torch.float32))
    torch.testing.assert_close(first["obs_std"], torch.as_tensor(states.std(0) + 1e-7, dtype=torch.float32))
    assert first["reward_scale"] == pytest.approx(np.sqrt(np.mean(start["reward"] ** 2)) + 1e-7, rel=1e-12)
    for step in chain.fresh.records["steps"]:
        assert torch.equal(step["obs_mean"], first["obs_mean"]) and torch.equal(step["obs_std"], first["obs_std"])


@pytest.mark.parametrize("run", ["fresh", "resumed", "refilled"])
def test_the_F_gate_holds_at_every_gradient_step(chain, run):
    """Clause 3 on each real run: before every gradient step k < (t - t0)/F, and the actors are at most 32 steps each
    (plus the one in flight) past t0 + F k; at the end k has caught up with (t - t0)/F."""
    records = getattr(chain, run).records
    F = chain.changes["F"] if run == "refilled" else 1.0
    num_actors = chain.changes["num_actors"] if run == "refilled" else 2
    for step in records["steps"]:
        t = step["global_step"] - step["t0"]
        assert step["k"] < t / F, step
        assert t <= F * step["k"] + 33 * num_actors, step
    end = getattr(chain, run).checkpoints[-1]
    assert end["state"]["k"] >= (end["global_step"] - end["t0"]) / F


# ----------------------------------------------------------------------------------------------------------------
# Resume
def test_a_resumed_run_starts_from_exactly_what_the_checkpoint_holds(chain):
    """Issue 48's property on a real resume with the memory: in the resumed process, at its first gradient step, k,
    beta, t0, the network, Adam's state and settings, the state statistics, the reward scale, the sampler's generator,
    the global RNGs and the whole memory (PER sort included) equal the checkpoint's one by one; the step uses lr and
    c_max of Eq. (13) at that k; the actors are re-seeded from the resumed step; publish versions continue."""
    ckpt = chain.fresh.checkpoints[-1]
    first = chain.resumed.records["first_step"]
    assert first["state"] == ckpt["state"] and first["t0"] == ckpt["t0"] and first["global_step"] >= ckpt["global_step"]
    for name, tensor in ckpt["model"].items():
        assert torch.equal(first["model"][name], tensor), name
    for index, saved in ckpt["optimizer"]["state"].items():
        for name, tensor in saved.items():
            assert torch.equal(first["optimizer"]["state"][index][name], tensor), (index, name)
    settings = {name: value for name, value in ckpt["optimizer"]["param_groups"][0].items() if name != "lr"}
    assert {name: first["optimizer"]["param_groups"][0][name] for name in settings} == settings
    k = ckpt["state"]["k"]
    assert first["optimizer"]["param_groups"][0]["lr"] == pytest.approx(vr.annealed_learning_rate(k, 1e-4, 5e-7), rel=1e-12)
    assert torch.equal(first["obs_mean"], ckpt["obs_mean"]) and torch.equal(first["obs_std"], ckpt["obs_std"])
    assert first["reward_scale"] == ckpt["reward_scale"]
    assert first["np_rng"] == ckpt["np_rng"].bit_generator.state
    assert first["rng"]["python"] == ckpt["rng"]["python"] and torch.equal(first["rng"]["torch"], ckpt["rng"]["torch"])
    for a, b in zip(first["rng"]["numpy"], ckpt["rng"]["numpy"]):
        np.testing.assert_array_equal(a, b)
    for name, saved in ckpt["replay"].items():
        if isinstance(saved, np.ndarray):
            np.testing.assert_array_equal(first["replay"][name], saved, err_msg=name)
        else:
            assert first["replay"][name] == saved, name
    assert ckpt["replay"]["per_order"] is not None
    step = chain.resumed.records["steps"][0]
    assert step["lr"] == pytest.approx(vr.annealed_learning_rate(k, 1e-4, 5e-7), rel=1e-12)
    assert step["cmax"] == pytest.approx(vr.refer_cmax(k, 4.0, 5e-7), rel=1e-12)
    assert [seed for _, seed, _ in chain.resumed.records["actors"]] == [1 + 1000 * i + ckpt["global_step"] for i in (0, 1)]
    assert min(chain.resumed.records["publishes"]) == ckpt["weights_version"] + 1
    out = chain.resumed.process.stdout
    assert "replay memory (" in out and "command line: checkpoint_replay, cuda, progress, total_timesteps;" in out
    resumed_end = chain.resumed.checkpoints[-1]
    assert resumed_end["replay"] is None and resumed_end["state"]["k"] > k
    assert float(resumed_end["optimizer"]["state"][0]["step"]) == resumed_end["state"]["k"]


def test_a_resume_without_memory_refills_it_with_the_frozen_statistics_and_the_restored_generator(chain):
    """Issue 48's property on a real resume without the memory: the refilled run learns again only once the memory
    holds --learning-starts samples, and at its first gradient step k, beta, the frozen state statistics (not
    recomputed from the new memory) and the sampler's generator are the checkpoint's."""
    ckpt = chain.resumed.checkpoints[-1]
    first = chain.refilled.records["first_step"]
    assert first["state"] == ckpt["state"]
    assert torch.equal(first["obs_mean"], ckpt["obs_mean"]) and torch.equal(first["obs_std"], ckpt["obs_std"])
    assert first["np_rng"] == ckpt["np_rng"].bit_generator.state
    assert first["replay"]["valid"].sum() >= chain.changes["learning_starts"]
    states = first["replay"]["obs"][first["replay"]["valid"]].astype(np.float64)
    assert np.abs(states.mean(0) - ckpt["obs_mean"].numpy()).max() > 1e-3  # the new memory's would differ
    assert all(call["k"] > first["state"]["k"] for call in chain.refilled.records["state_stats_calls"])
    assert "no replay memory (refilled in" in chain.refilled.process.stdout


def test_every_applied_flag_takes_effect_on_resume(chain):
    """Issue 48's rule for APPLIED_ON_RESUME: the refilled run changed every one of its flags (`applied_flag_changes`)
    and each is read back where it acts in the resumed process: Adam's param groups, the schedules' values at each k,
    Eq. (12)'s step, the batch, the written-back rho, the samplers' exponents, the actors' settings and number, the F
    gate, the statistics updates, the run's end and its evaluation. The probe table must cover the class exactly."""
    changes = chain.changes
    records = chain.refilled.records
    steps = records["steps"]
    samples = records["samples"]
    assert len(steps) == len(samples) > 150
    stats_every = changes["stats_every"]

    def stats_updates():
        return [(before, after) for before, after in zip(steps, steps[1:]) if after["reward_scale"] != before["reward_scale"]]

    def probe_total_timesteps():
        assert chain.summary["global_step"] >= changes["total_timesteps"]
        assert steps[-1]["global_step"] <= changes["total_timesteps"] + 33

    def probe_learning_starts():
        # a single read adds far fewer than the 500 steps between the old value (600) and the new one
        assert changes["learning_starts"] <= steps[0]["replay_size"] < 600

    def probe_batch_size():
        assert {size for size, _, _ in samples} == {changes["batch_size"]}

    def probe_learning_rate():
        for step in steps:
            assert step["lr"] == pytest.approx(
                vr.annealed_learning_rate(step["k"], changes["learning_rate"], changes["A"]), rel=1e-12
            )

    def probe_adam_eps():
        assert {step["eps"] for step in steps} == {changes["adam_eps"]}

    def probe_F():
        # t0 puts k on the F clock where learning restarts; then F k < t - t0 <= F k + 33 (test_the_F_gate_...)
        restart = int(chain.refilled.process.stdout.split("learning starts at env step ")[1].split()[0])
        assert steps[0]["t0"] == restart - int(steps[0]["k"] * changes["F"])
        for step in steps:
            assert changes["F"] * step["k"] < step["global_step"] - step["t0"] <= changes["F"] * step["k"] + 33

    def probe_C():
        for step in steps:
            assert step["cmax"] == pytest.approx(vr.refer_cmax(step["k"], changes["C"], changes["A"]), rel=1e-12)

    def probe_A():
        probe_learning_rate()
        probe_C()

    def probe_D():
        for step in steps:
            expected = vr.refer_beta_update(step["beta_before"], step["far_fraction"], changes["D"], changes["beta_lr"])
            assert step["beta_after"] == pytest.approx(expected, rel=1e-12)
        # where the old D (0.1) would have lowered beta, the new one raised it
        assert max(step["far_fraction"] for step in steps) > 0.1
        assert all(step["beta_after"] > step["beta_before"] for step in steps)

    def probe_beta_lr():
        probe_D()

    def probe_logrho_clip():
        log_rho = np.abs(np.log(np.concatenate([step["rho"] for step in steps])))
        assert log_rho.max() <= changes["logrho_clip"] * (1 + 1e-5)
        assert np.isclose(log_rho, changes["logrho_clip"], rtol=1e-4).any()

    def probe_per_alpha():
        # the probabilities each draw used: P(rank 2) / P(rank 1) = 2^-alpha
        for _, rank_ratio, _ in samples:
            assert rank_ratio == pytest.approx(2.0 ** -changes["per_alpha"], rel=1e-12)

    def probe_per_beta0():
        for step, (_, _, beta_is) in zip(steps, samples):
            assert beta_is == pytest.approx(
                min(1.0, changes["per_beta0"] + (1 - changes["per_beta0"]) * changes["A"] * step["k"])
            )

    def probe_action_noise():
        assert [args.action_noise for _, _, args in records["actors"]] == [changes["action_noise"]]

    def probe_clip_actions():
        assert [args.clip_actions for _, _, args in records["actors"]] == [True]
        assert [clip for _, clip, _, _ in records["evaluations"]] == [True]

    def probe_stats_every():
        updates = stats_updates()
        assert updates and all(after["k"] % stats_every == 0 for _, after in updates)
        assert set(records["stats"]) == {step["k"] for step in steps if step["k"] % stats_every == 0}

    def probe_state_stats_rate():
        before, after = stats_updates()[0]
        target_mean, _ = records["stats"][after["k"]]
        target_mean = torch.as_tensor(target_mean, dtype=torch.float32)
        expected = before["obs_mean"] + changes["state_stats_rate"] * (target_mean - before["obs_mean"])
        torch.testing.assert_close(after["obs_mean"], expected)
        assert not torch.equal(after["obs_mean"], before["obs_mean"])

    def probe_num_actors():
        assert [name for name, _, _ in records["actors"]] == ["actor-0"]

    def probe_eval_episodes():
        assert [episodes for episodes, _, _, _ in records["evaluations"]] == [changes["eval_episodes"]]
        assert chain.summary["stop_reason"] == "completed" and "eval_return_mean" in chain.summary

    probes = {name[len("probe_") :]: probe for name, probe in locals().items() if name.startswith("probe_")}
    assert set(probes) == set(changes) == set(vr.APPLIED_ON_RESUME)
    for name, probe in probes.items():
        probe()


def test_the_evaluation_plays_with_the_learner_s_final_statistics(chain):
    """Clause 6 on real runs: the final evaluation of --save-model gets the learner's state statistics and the
    --eval-episodes count."""
    for run in (chain.fresh, chain.refilled):
        [(episodes, _, obs_mean, obs_std)] = run.records["evaluations"]
        assert torch.equal(obs_mean, run.checkpoints[-1]["obs_mean"]) and torch.equal(obs_std, run.checkpoints[-1]["obs_std"])
    assert chain.fresh.records["evaluations"][0][0] == 1


@pytest.mark.parametrize("name", vr.FIXED_ON_RESUME)
def test_resume_refuses_every_fixed_flag(name):
    """FIXED_ON_RESUME: a changed value of any of them on --resume stops with one `error: --resume:` line (beta_init
    and init_std only act at the start; the others change the experiment)."""
    default = getattr(vr.Args(), name)
    choices = {"env_id": "Walker2d-v5", "std_map": "cheap_softplus", "refer": "rule1", "kl_direction": "pi_mu", "per": "rank"}
    value = choices.get(name, not default if isinstance(default, bool) else default * 2 if default else 1)
    flag = f"--{name.replace('_', '-')}"
    argv = [flag] if value is True else [f"--no-{name.replace('_', '-')}"] if value is False else [flag, str(value)]
    with pytest.raises(SystemExit, match=f"^error: --resume: {flag} "):
        resume_args(vr.Args(**{name: value}), argv, vars(vr.Args()), vr.FIXED_ON_RESUME)


def test_a_resume_without_memory_that_cannot_learn_is_refused(chain, tmp_path):
    """A resumed run without its memory must have the steps to refill it (--learning-starts) and learn, or it stops at
    start-up with one line."""
    p = run_script(tmp_path, "--total-timesteps", "1000", "--resume", str(chain.root / "resumed_end.pt"), timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].endswith("(--learning-starts; the checkpoint has no replay memory)")


def test_a_checkpoint_of_an_older_script_is_refused_before_the_run_folder(chain, tmp_path):
    """--resume from a checkpoint written before its keys `started` and `weights_version` and its memory's PER sort
    existed stops at start-up with one `error: --resume:` line naming what it lacks, before anything is written to the
    run's folder (it was a KeyError traceback)."""
    old = dict(chain.fresh.checkpoints[-1])
    del old["started"]
    del old["weights_version"]
    old["replay"] = {name: value for name, value in old["replay"].items() if name != "per_order"}
    old_run = tmp_path / "runs" / old["run_name"]
    old_run.mkdir(parents=True)
    torch.save(old, old_run / "checkpoint.pt")
    p = run_script(tmp_path, "--resume", str(old_run / "checkpoint.pt"), timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    [line] = p.stderr.strip().splitlines()
    assert line.startswith("error: --resume: ") and all(key in line for key in ("started", "weights_version", "per_order"))
    assert [f.name for f in old_run.iterdir()] == ["checkpoint.pt"]


# ----------------------------------------------------------------------------------------------------------------
# Other tasks, bad input
def test_one_action_dimension_task_runs(tmp_path):
    """InvertedPendulum-v5 has one action dimension: collection, storage, learning and the evaluation of the saved
    model run (before, the first stored episode crashed)."""
    p = run_script(
        tmp_path,
        *(
            "--env-id InvertedPendulum-v5 --num-actors 1 --learning-starts 64 --buffer-size 64 --batch-size 16 "
            "--total-timesteps 200 --log-every 20 --stats-every 50 --save-model --eval-episodes 1"
        ).split(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "learning starts at env step" in p.stdout
    summary = json.loads(next((tmp_path / "runs").iterdir()).joinpath("summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] >= 200
    assert summary["eval_return_mean"] >= 1.0


def test_bad_inputs_fail_with_one_line(tmp_path):
    p = run_script(tmp_path, "--env-id", "CartPole-v1", timeout=60)  # discrete-action env: refused at start-up
    assert p.returncode != 0
    assert "error: unknown or non-MuJoCo env id 'CartPole-v1'" in p.stderr and "Traceback" not in p.stderr, p.stderr
    for kw in [
        dict(env_id="NoSuchEnv-v0"),
        dict(env_id="ALE/Pong-v5"),
        dict(batch_size=512, learning_starts=100),
        dict(num_actors=0),
        dict(refer="full", C=0.0),
        dict(F=0.0),
        dict(gamma=0.0),
        dict(learning_starts=2**19),
        dict(adam_eps=0.0),
    ]:
        with pytest.raises(SystemExit, match="^error: "):  # the ranges, then the checks between flags
            vr.validate_args(vr.Args(**kw))
    # the defaults are valid
    vr.validate_args(vr.Args())

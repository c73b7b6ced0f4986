"""clear_impala.py, its wiring: what the real actor loop writes equals a direct env rollout and the learner's loss on it
equals a slow implementation (values and gradients); the slot hand-off; the task and network of each actor per mode;
what the network sees per env family (clause E of tests/test_clear_loop.py: Atari through common/atari_env.py with
life loss, clipped rewards and per-game returns; MinAtar's sticky actions; each torso's input scaling); start-up
checks and one-line errors (a replay memory that cannot fit: tests/test_clear_runs.py, with the other refusals)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from clear_helpers import (
    ONE_TERM,
    check_direct_rollout,
    gradients,
    recording_make_env,
    run_actor_loops,
    slow_clear_loss,
)

import clear_impala as ci
from common.minatar_env import make_minatar_env


@pytest.mark.parametrize(
    "over,msg",
    [
        (dict(num_actors=4, batch_size=8), "--num-actors"),
        (dict(replay_fraction=1.5), "--replay-fraction"),
        (dict(buffer_size=0), "--buffer-size 0"),
        (dict(mode="separate", num_actors=32, batch_size=32), "separate"),
        (dict(gamma=1.5), "--gamma must be in [0, 1], got 1.5"),
        (
            dict(env_ids=["a", "b", "c"], mode="simultaneous", num_actors=4, batch_size=4),
            "a multiple of the number of tasks (3)",
        ),
    ],
)
def test_validate_args_one_line_errors(over, msg):
    with pytest.raises(SystemExit) as e:  # the ranges, then the checks between flags
        ci.validate_args(ci.Args(**over))
    assert str(e.value).startswith("error:") and msg in str(e.value) and "\n" not in str(e.value)


def test_bad_env_id_and_mixed_tasks_fail_with_one_line():
    with pytest.raises(SystemExit) as e:
        ci.probe_envs(ci.Args(env_ids=["MiniGrid-Empty-5x5-v0", "NoSuchEnv-v9"]))
    assert str(e.value).startswith("error: unknown env id 'NoSuchEnv-v9'") and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        ci.probe_envs(ci.Args(env_ids=["MiniGrid-Empty-5x5-v0", "ALE/Pong-v5"]))
    assert str(e.value).startswith("error: --env-ids mixes env families (atari, minigrid)")
    assert ci.probe_envs(ci.Args(env_ids=["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"])) == ((7, 7, 3), 7, "minigrid")
    # MinAtar games: channels padded to 10, the full 6-action set, MinAtar's network
    args = ci.Args(env_ids=["MinAtar/Breakout-v0", "MinAtar/SpaceInvaders-v0", "MinAtar/Asterix-v0"])
    assert ci.probe_envs(args) == ((10, 10, 10), 6, "minatar") and ci.resolve_torso(args, (10, 10, 10)) == "minatar"


def test_probe_envs_resolves_bootstrap_truncation_per_env_family():
    minatar = ci.Args(env_ids=["MinAtar/Breakout-v0"])
    minigrid = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0"])
    minigrid_asked = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0"], bootstrap_truncation=True)
    for args in (minatar, minigrid, minigrid_asked):
        ci.probe_envs(args)
    assert minatar.bootstrap_truncation is True
    assert minigrid.bootstrap_truncation is False
    assert minigrid_asked.bootstrap_truncation is True


# ----------------------------------------------------------------------------------------------------------------
# Wiring: what the real actor loop writes, and the loss the real learner function computes on it
@pytest.mark.parametrize("envs_per_actor", [1, 3])
def test_actor_loop_writes_a_direct_rollout_and_the_learner_loss_on_it_equals_a_slow_loop(tmp_path, envs_per_actor):
    """The real actor loop on LavaGap (lava terminates, a 6-step limit truncates), 2 processes x 1 or 3 envs: each
    stored unroll equals a direct rollout of the same env with its actions, row r holds mu and V_mu of the SHARED
    network at frame r - 1 (catches an actor writing them one row early), the replay half is one of the process's
    earlier unrolls; then the real `learner_loss` on the pairs the loop published, with a different learner network,
    equals `slow_clear_loss` (catches an inverted replay mask and a flipped entropy sign)."""
    E = envs_per_actor
    args = ci.Args(
        env_ids=["MiniGrid-LavaGapS5-v0"],
        minigrid_max_steps=6,
        num_actors=2,
        envs_per_actor=E,
        batch_size=2,
        unroll_length=12,
        steps_per_task=10_000,
        replay_fraction=0.5,
        bootstrap_truncation=True,
        seed=3,
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    torch.manual_seed(0)
    shared = ci.Agent(obs_shape, num_actions, ci.resolve_torso(args, obs_shape))
    with torch.no_grad():
        # mostly "forward" (p 0.55): the agent walks into the lava (terminated) unless the gap is in its row (then the
        # 6-step limit truncates), so both ends occur whatever the threads' shared torch stream draws
        shared.policy.bias[2] += 2.0
    pairs, slots, _ = run_actor_loops(
        args, obs_shape, num_actions, [ci.SharedWeights.share(shared)], unrolls=4, tmp_path=tmp_path
    )
    T = args.unroll_length
    ends = {"terminated": 0, "truncated": 0}
    earlier = {p: [] for p in range(args.num_actors)}  # new halves of each process: its reservoir's content
    for i, published in pairs.items():
        p, e = divmod(i, E)
        seed = args.seed + 1000 * p
        env = ci.make_env(args.env_ids[0], seed + e, args)
        obs, _ = env.reset(seed=seed + 1_000_003 * e)
        new_halves = earlier[p]
        previous = None
        for n, pair in enumerate(published):
            new = {k: v[0] for k, v in pair.items() if k not in ("info", "queue")}
            if n == 0:
                assert (new["obs"][0] == torch.from_numpy(obs)).all()
            else:  # row 0 repeats the previous unroll's last row
                for k in new:
                    assert torch.equal(new[k][0], previous[k][T]), k
            with torch.no_grad():
                logits, values = shared(new["obs"][:T])
            torch.testing.assert_close(new["logits"][1:], logits)  # mu(.|x_{r-1}) at row r
            torch.testing.assert_close(new["baseline"][1:], values)  # V_mu(x_{r-1}) at row r
            for r in range(1, T + 1):
                obs, reward, term, trunc, _ = env.step(int(new["action"][r]))
                assert float(new["reward"][r]) == pytest.approx(reward)
                assert bool(new["done"][r]) == (term or trunc) and bool(new["truncated"][r]) == (trunc and not term)
                if trunc and not term:
                    with torch.no_grad():
                        fv = shared(torch.from_numpy(obs)[None])[1]
                    assert float(new["final_value"][r]) == pytest.approx(float(fv), rel=1e-5, abs=1e-6)
                else:
                    assert float(new["final_value"][r]) == 0.0
                ends["terminated"] += term
                ends["truncated"] += trunc and not term
                if term or trunc:
                    obs, _ = env.reset()
                assert (new["obs"][r] == torch.from_numpy(obs)).all(), (i, n, r)
            new_halves.append(new)
            previous = new
    for i, published in pairs.items():  # a replay half is an unroll of the same process, published no later
        for pair in published:
            rep = {k: v[1] for k, v in pair.items() if k not in ("info", "queue")}
            assert pair["info"]["replay_valid"] == 1
            assert any(all(torch.equal(rep[k], h[k]) for k in h) for h in earlier[i // E])
    assert ends["terminated"] > 0 and ends["truncated"] > 0, ends
    # the learner: the real batch hand-off and loss on the slots as the loop left them, a different network
    torch.manual_seed(1)
    learner = ci.Agent(obs_shape, num_actions, ci.resolve_torso(args, obs_shape))
    with torch.no_grad():
        learner.policy.weight.mul_(100.0)  # a policy far from the actors' near-uniform one: cloning terms matter
    cpu = torch.device("cpu")
    for which in ([0, 1], [1, 0]):
        which = torch.tensor(which)
        batch = ci.take_batch(slots, [0, 1], which)
        loss, parts, _ = ci.learner_loss(learner, batch, which, args, cpu)
        halves = [{k: slots[k][i, int(which[i])] for k in slots} for i in range(2)]
        slow = slow_clear_loss(learner, halves, which, args)
        for k, v in slow.items():
            if k in parts:
                assert float(parts[k]) == pytest.approx(v.item(), rel=1e-4, abs=1e-5), k
        assert slow["losses/policy_cloning_loss"].item() > 0.01 and slow["losses/value_cloning_loss"].item() > 1e-3
        # gradients, parameter by parameter: each term alone, then the weighted total
        for term, cost in [*ONE_TERM.items(), ("losses/total_loss", None)]:
            if cost is None:
                term_args = args
            else:
                term_args = ci.Args(**{**vars(args), **{c: 0.0 for c in ONE_TERM.values()}, cost: 1.0})
            real = gradients(learner, ci.learner_loss(learner, batch, which, term_args, cpu)[0])
            slow_grads = gradients(learner, slow_clear_loss(learner, halves, which, args)[term])
            assert any(g.abs().max() > 1e-6 for g in slow_grads.values()), term
            # float32 sums over T x B rows: a parameter whose gradient nearly cancels (a bias) is compared against a
            # thousandth of the term's largest gradient too, not only its own magnitude
            term_scale = max(float(g.abs().max()) for g in slow_grads.values())
            for name, grad in slow_grads.items():
                scale = float(grad.abs().max()) + 1e-3 * term_scale + 1e-6
                error = float((real[name] - grad).abs().max()) / scale
                assert error < 2e-4, (term, name, error)


def test_take_batch_copies_the_slots_before_an_actor_can_overwrite_them():
    """The learner's hand-off (take_batch, then release_slots, as the loop calls them) against an actor stand-in that
    rewrites its slot (both halves) the moment the learner frees it: the batch must equal what the slots held when the
    learner took them, and the global step must already count the batch's new steps when an actor sees its slot free
    (its next unroll starts at the updated step)."""
    N = 5
    T = 4
    obs_shape = (3, 3)
    num_actions = 2
    g = torch.Generator().manual_seed(0)
    slots = {}
    for k, (shape, dtype) in ci.unroll_specs(obs_shape, num_actions, T).items():
        values = torch.randint(0, 100, (N, 2, *shape), generator=g)
        slots[k] = values.bool() if dtype == np.bool_ else values.to(torch.from_numpy(np.zeros(1, dtype)).dtype)
    snapshot = {k: v.clone() for k, v in slots.items()}
    global_step = SimpleNamespace(value=1000)

    class ActorWritesOnRelease:
        def __init__(self, slot):
            self.slot = slot
            self.step_seen = None

        def release(self):
            self.step_seen = global_step.value
            for v in slots.values():
                v[self.slot] = ~v[self.slot] if v.dtype == torch.bool else -1 - v[self.slot]

    slot_free = [ActorWritesOnRelease(i) for i in range(N)]
    idx = [3, 0, 4]
    which = torch.tensor([1, 0, 1])
    batch = ci.take_batch(slots, idx, which)
    ci.release_slots(idx, slot_free, global_step, T)
    for k, v in batch.items():
        for j, (slot, half) in enumerate(zip(idx, which.tolist())):
            assert torch.equal(v[:, j], snapshot[k][slot, half]), (k, j)
    assert global_step.value == 1000 + len(idx) * T
    assert [slot_free[i].step_seen for i in idx] == [global_step.value] * len(idx)
    assert slot_free[1].step_seen is None and slot_free[2].step_seen is None


def test_slot_info_select_copies_the_chosen_slots_in_batch_order():
    """The learner's copy of what the pairs in its batch are: in the batch's slot order, and unchanged when an actor
    rewrites its slot's entries after the learner freed it."""
    slot_info = ci.SlotInfo.zeros(4)
    for field_index, entries in enumerate(slot_info):
        entries.copy_(torch.arange(4) * 10 + field_index)
    chosen = slot_info.select([2, 0])
    slot_info.task[2] = -5
    assert chosen.task.tolist() == [20, 0]
    assert chosen.buffer_unrolls.tolist() == [25, 5]
    assert chosen._fields == ("task", "start_step", "policy_version", "replay_valid", "replay_task", "buffer_unrolls")


@pytest.mark.parametrize("mode, envs_per_actor", [("simultaneous", 3), ("separate", 2)])
def test_actor_loop_plays_the_task_and_network_each_mode_assigns(tmp_path, mode, envs_per_actor):
    """simultaneous: env slot i plays task i mod K, so tasks mix within a process; separate: every env of process p
    plays task p mod K with network p mod K and publishes through that network's queue. Each stored unroll must equal
    a direct rollout of that task's env with mu and V_mu of that network (the two networks differ)."""
    E = envs_per_actor
    K = 2
    args = ci.Args(
        env_ids=["MiniGrid-LavaGapS5-v0", "MiniGrid-Empty-5x5-v0"],
        mode=mode,
        minigrid_max_steps=6,
        num_actors=2,
        envs_per_actor=E,
        batch_size=2,
        unroll_length=8,
        steps_per_task=10_000,
        seed=5,
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    torch.manual_seed(0)
    networks = [ci.Agent(obs_shape, num_actions, "minigrid") for _ in range(K)]
    shared = [ci.SharedWeights.share(network) for network in (networks if mode == "separate" else networks[:1])]
    pairs, _, _ = run_actor_loops(args, obs_shape, num_actions, shared, unrolls=2, tmp_path=tmp_path)
    tasks_seen = set()
    for i, published in pairs.items():
        process, e = divmod(i, E)
        task = i % K if mode == "simultaneous" else process % K
        network = networks[task] if mode == "separate" else networks[0]
        tasks_seen.add((process, task))
        seed = args.seed + 1000 * process
        env = ci.make_env(args.env_ids[task], seed + e, args)
        obs, _ = env.reset(seed=seed + 1_000_003 * e)
        for pair in published:
            assert pair["info"]["task"] == task
            assert pair["queue"] == (task if mode == "separate" else 0)
            new = {k: v[0] for k, v in pair.items() if k not in ("info", "queue")}
            obs = check_direct_rollout(env, obs, new, network, args.unroll_length)
    if mode == "simultaneous":
        assert tasks_seen == {(0, 0), (0, 1), (1, 0), (1, 1)}
    else:
        assert tasks_seen == {(0, 0), (1, 1)}


# ----------------------------------------------------------------------------------------------------------------
# What the network sees, per env family (clause E)
def test_an_atari_task_is_the_game_with_life_loss_clipped_rewards_and_per_game_returns(monkeypatch):
    """Clause E1, through clear_impala's own env construction (probe_envs, make_env) on SpaceInvaders (5-30 points per
    alien, 3 lives), stepped with random actions and compared with what its emulator did (RecordingALE): 4 stacked
    84x84 uint8 frames, all 18 actions, the Nature torso, sticky probability 0 unless given; each step's reward is the
    sign of its frames' raw rewards; a step is terminated exactly when it lost a life or ended the game, and the
    reset() after a lost life continues the same game; info["episode"] comes once per game, with the game's whole
    score. A given --sticky-action-prob reaches the emulator."""
    recorders = recording_make_env(monkeypatch)
    args = ci.Args(env_ids=["ALE/SpaceInvaders-v5"])
    assert ci.probe_envs(args) == ((4, 84, 84), 18, "atari")
    assert ci.resolve_torso(args, (4, 84, 84)) == "nature"
    env = ci.make_env("ALE/SpaceInvaders-v5", 3, args)
    ale = recorders[-1]
    assert ale.getFloat("repeat_action_probability") == 0.0
    env.reset(seed=3)
    ale.take_frames()
    rng = np.random.default_rng(0)
    lives = ale.lives()
    games = 0
    lives_lost = 0
    raw_rewards = set()
    reported_scores = []
    while games < 2:
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(18)))
        frame_rewards = ale.take_frames()
        raw_rewards.update(frame_rewards)
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        assert reward == np.sign(sum(frame_rewards))
        lost_life = ale.lives() < lives
        game_over = ale.game_over()
        assert terminated == (lost_life or game_over) and not truncated
        assert ("episode" in info) == game_over
        if game_over:
            reported_scores.append(info["episode"]["r"])
        lives = ale.lives()
        if terminated:
            games_before = len(ale.game_scores)
            env.reset()
            # a reset's frames (no-op starts, the no-op after a lost life) are no step's reward
            ale.take_frames()
            if game_over:
                games += 1
                assert len(ale.game_scores) == games_before + 1
            else:
                lives_lost += 1
                assert len(ale.game_scores) == games_before and ale.lives() == lives, "a lost life restarted the game"
            lives = ale.lives()
    assert lives_lost >= 2 and max(raw_rewards) > 1, (lives_lost, raw_rewards)
    assert reported_scores == ale.game_scores[:2] and min(reported_scores) > 1
    ci.make_env("ALE/SpaceInvaders-v5", 3, ci.Args(env_ids=["ALE/SpaceInvaders-v5"], sticky_action_prob=0.25))
    assert recorders[-1].getFloat("repeat_action_probability") == pytest.approx(0.25)


@pytest.mark.parametrize("given, expected", [(None, 0.1), (0.0, 0.0), (0.3, 0.3)])
def test_a_minatar_task_plays_with_the_sticky_probability_given_or_minatars_own(given, expected):
    """Clause E2: clear_impala's MinAtar env with --sticky-action-prob `given` plays exactly as the MinAtar adapter
    with probability `expected` (None: MinAtar's 0.1; 0 is 0) and channels padded to 10, on the same seed and
    actions, and unlike the other probabilities (the test can fail)."""
    rng = np.random.default_rng(0)
    actions = rng.integers(6, size=500)

    def frames(env):
        obs, _ = env.reset(seed=5)
        out = [obs]
        for action in actions:
            obs, _, terminated, truncated, _ = env.step(int(action))
            out.append(obs)
            if terminated or truncated:
                obs, _ = env.reset()
                out.append(obs)
        return np.stack(out)

    played = frames(ci.make_env("MinAtar/Breakout-v0", 5, ci.Args(env_ids=["MinAtar/Breakout-v0"], sticky_action_prob=given)))
    assert played.shape[1:] == (10, 10, 10) and played.dtype == np.uint8
    for probability in (0.0, 0.1, 0.3):
        twin = make_minatar_env("MinAtar/Breakout-v0", 5, pad_channels=10, sticky_action_prob=probability)
        assert np.array_equal(played, frames(twin)) == (probability == expected), probability


@pytest.mark.parametrize(
    "torso, obs_shape, values, scale",
    [
        ("nature", (4, 84, 84), 256, lambda x: x / 255.0),
        ("resnet", (4, 84, 84), 256, lambda x: x / 255.0),
        ("minatar", (10, 10, 10), 2, lambda x: x),
        ("minigrid", (7, 7, 3), 11, lambda x: x.permute(0, 3, 1, 2) / 10.0),
    ],
)
def test_each_torso_reads_its_familys_frames_scaled_as_documented(torso, obs_shape, values, scale):
    """Clause E: what the torso's first layer receives from `Agent.forward` on uint8 frames: Atari pixels / 255 (both
    the Nature CNN and IMPALA's ResNet), MinAtar's 0/1 planes as they are, MiniGrid's object/colour/state indices
    / 10 moved to channels-first; and the heads read the torso's features."""
    torch.manual_seed(0)
    agent = ci.Agent(obs_shape, 5, torso)
    seen = []
    agent.torso.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    frames = torch.randint(0, values, (3, *obs_shape), dtype=torch.uint8)
    logits, value = agent(frames)
    torch.testing.assert_close(seen[0], scale(frames.float()))
    features = agent.torso(scale(frames.float()))
    torch.testing.assert_close(logits, agent.policy(features))
    torch.testing.assert_close(value, agent.baseline(features).squeeze(-1))

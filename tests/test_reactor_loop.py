"""The contract of reactor.py's loop, one clause per line of behaviour, each with the tests that check it on the real
loop (tests/test_reactor_runs.py runs the script with spies on its loop) or on the real functions it calls:

1. Actors act with the learner's weights: an actor loads the published weights before its first step (a resumed
   run's too) and then at each sync point (every actor_sync_every of its own steps) if they changed; each slot
   carries the learning step of those weights (its version); an actor's versions never fall, and with one actor the
   policy lag at arrival (learning steps since that version) stays below (actor_sync_every - 1 + ratio_slack) /
   acting_learning_ratio + 1, a bound that follows from the two gates of clause 6.
   test_actor_writes_into_replay_what_a_direct_rollout_gives, test_actor_loads_new_weights_at_its_sync_points_...
   (tests/test_reactor_actors.py); test_run_actors_act_with_rising_versions_and_a_bounded_lag (runs).
2. Actors are seeded apart: actor i draws its env resets and actions from seed + 1000 i; in a run resumed at step
   S > 0 from a seed drawn from (seed + 1000 i, S), never the first run's streams again.
   test_actor_writes_into_replay_what_a_direct_rollout_gives, test_actor_seeds_differ_between_actors_... (actors);
   test_resumed_actors_play_new_streams_with_the_resumed_weights (runs).
3. The replay holds what the actors wrote: each chunk is copied into its actor's segment before its buffer goes back
   to the actor (`store_chunk`); the env steps counted (per actor and in all, `global_step`) are the non-pad slots.
   test_store_chunk_copies_each_chunk_before_its_actor_can_write_into_the_buffer_again;
   test_actor_writes_into_replay_what_a_direct_rollout_gives (actors); test_run_counts_every_env_step_once (runs).
4. One learning step: batch_size sequences sampled by priority, the Reactor loss, gradients zeroed, backward, clipped
   to a total norm of max_grad_norm (0: not clipped), then Adam (learning_rate, betas (adam_beta1, 0.999), eps 1e-8);
   each sampled key's priority becomes (p + 1e-6) ** priority_exponent (p: the loss's mean total variation, ND: mean
   |TD|; the paper samples proportionally to p: exponent 1).
   test_learning_step_equals_a_hand_written_update_over_two_steps; test_run_learning_steps_apply_the_flags (runs).
5. The target network starts as a copy of the online network and after learning step n becomes one again iff n is a
   multiple of target_update_period, else it is unchanged; after every step the actors' shared weights equal the
   online ones and the version and learner count they read are n.
   test_make_learner_starts_the_target_network_as_a_copy_of_the_online_one;
   test_learning_step_writes_priorities_back_publishes_weights_and_refreshes_the_target (actors);
   test_run_publishes_the_weights_and_refreshes_the_target_on_schedule (runs).
6. The acting:learning gates, counted from the ratio base (G0, L0) = (learning_starts, 0) in a new run: the learner
   takes a step only while L - L0 < (G - G0) / acting_learning_ratio and the replay holds a batch; the actors wait as soon as
   their steps together exceed G0 + acting_learning_ratio (L - L0) + ratio_slack. So at every learning step
   G - G0 <= acting_learning_ratio (L - L0) + ratio_slack + 1 (an actor may take one step past its check).
   test_learner_may_learn_..., test_actor_waits_for_the_learner_at_the_ratio_bound (actors);
   test_run_learning_steps_follow_the_ratio_gates (runs).
7. --save-model writes {"model": the online network's state dict, "args"} to runs/<run>/<exp_name>.model after a
   completed run; the final evaluation plays that network.
   test_saved_model_is_the_online_network_and_the_evaluation_plays_it (runs).
8. Evaluation plays eval_episodes whole games (a lost life is no episode end; the LSTM state is reset there as in
   training), game e reset with seed + e (seed = --seed + 10000), real scores, actions sampled from pi (greedy:
   argmax), the evaluation env of its family (clause 9).
   test_evaluation_plays_seeded_whole_games_with_the_network_it_is_given; test_evaluation_resets_the_lstm_...,
   test_evaluate_greedy_plays_argmax_pi (actors).
9. What the network sees, per env family. Atari (common/atari_env.py, ALE): (1, 84, 84) uint8 grayscale frames,
   divided by 255 in the network; learning rewards clipped to their sign and a lost life ends the learning episode
   (evaluation: real scores, whole games); sticky actions 0 unless --sticky-action-prob says otherwise; up to
   noop_max no-ops at a reset. MinAtar: (C, 10, 10) 0/1 frames as they are, rewards as the game gives them, sticky
   actions with probability 0.1 unless --sticky-action-prob gives another (0 included).
   test_atari_env_and_network_input_as_documented, test_minatar_env_and_network_input_as_documented;
   test_training_env_ends_the_learning_episode_at_a_lost_life (actors).
What a resume restores and which flags it applies: tests/test_reactor_runs.py (its docstring).
"""

import copy
import queue

import numpy as np
import pytest
import reactor_helpers
import torch
from reactor_helpers import MINATAR

import reactor
from common.atari_env import make_atari_env
from common.minatar_env import make_minatar_env

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float32 = reactor_helpers.float32
float64_by_default = reactor_helpers.float64_by_default


def random_slots(rng, m, num_actions, lstm_size, first_every=13):
    """m replay slots of random content (MinAtar frames), an episode start every `first_every` slots."""
    return {
        "obs": rng.integers(0, 2, (m, *MINATAR)).astype(np.uint8),
        "action": rng.integers(0, num_actions, m),
        "reward": rng.normal(size=m),
        "term": np.zeros(m, bool),
        "pad": np.zeros(m, bool),
        "first": np.arange(m) % first_every == 0,
        "mu": rng.dirichlet(np.ones(num_actions), m),
        "state": rng.normal(size=(m, 4, lstm_size)) * 0.1,
        "version": np.zeros(m, np.int64),
    }


# ----------------------------------------------------------------------------------------------------------------
# clauses 4 and 5: the learner's update and the target network
@pytest.mark.parametrize("max_grad_norm, adam_beta1", [(1e-6, None), (0.0, 0.5)])
def test_learning_step_equals_a_hand_written_update_over_two_steps(float32, monkeypatch, max_grad_norm, adam_beta1):
    """Clause 4: two consecutive `learning_step`s equal, parameter by parameter, an update written here from the
    loss on the batch each step sampled: gradients of that loss alone (no accumulation), clipped to a total norm of
    max_grad_norm (1e-6: the clipped gradient's entries are below Adam's eps, so that the update follows its scale;
    0: off), then Adam with the flags' lr and betas (adam_beta1: the default, the paper's 0, or 0.5) written out;
    and each sampled key's priority becomes (p + 1e-6) ** priority_exponent with the default exponent (1:
    proportional to p, paper 3.3). The target network is the loss's, never updated here."""
    flags = {} if adam_beta1 is None else {"adam_beta1": adam_beta1}
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0",
        lstm_size=8,
        num_atoms=11,
        sequence_length=4,
        batch_size=3,
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
        **flags,
    )
    num_actions = 3
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    net, target_net, optimizer = reactor.make_learner(args, num_actions, MINATAR, "cpu")
    # a target network other than the online one
    with torch.no_grad():
        for parameter in target_net.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    target_before = copy.deepcopy(target_net.state_dict())
    replay = reactor.SequenceReplay(200, 1, args.sequence_length, num_actions, args.lstm_size, MINATAR)
    replay.add(0, random_slots(rng, 60, num_actions, args.lstm_size))
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms)
    sampled = []
    sample = replay.sample

    def sample_spy(*a, **k):
        sampled.append(sample(*a, **k))
        return sampled[-1]

    monkeypatch.setattr(replay, "sample", sample_spy)
    hand = copy.deepcopy(net)
    beta1 = args.adam_beta1
    beta2 = 0.999
    first_moment = [torch.zeros_like(p) for p in hand.parameters()]
    second_moment = [torch.zeros_like(p) for p in hand.parameters()]
    clipped = []
    for t in (1, 2):
        reactor.learning_step(net, target_net, optimizer, replay, support, args, rng, "cpu")
        keys, batch = sampled[-1]
        assert batch.obs.shape[0] == args.batch_size
        loss, priorities, _ = reactor.reactor_loss(hand, target_net, batch, support, args)
        gradients = torch.autograd.grad(loss, list(hand.parameters()))
        if max_grad_norm > 0:
            norm = torch.sqrt(sum((g**2).sum() for g in gradients))
            clipped.append(float(norm) > max_grad_norm)
            gradients = [g * min(1.0, max_grad_norm / (float(norm) + 1e-6)) for g in gradients]
        with torch.no_grad():
            for p, g, m, v in zip(hand.parameters(), gradients, first_moment, second_moment):
                # Adam (Kingma & Ba 2015, Algorithm 1, torch's eps placement)
                m.mul_(beta1).add_((1 - beta1) * g)
                v.mul_(beta2).add_((1 - beta2) * g * g)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                p.sub_(args.learning_rate * m_hat / (v_hat.sqrt() + 1e-8))
        for (name, got), want in zip(net.named_parameters(), hand.parameters()):
            # (float32: the second step's gradients come from weights that differ by rounding)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=f"step {t}: {name}")
        last_priority = dict(zip(keys.tolist(), priorities.tolist()))
        for key, priority in last_priority.items():
            np.testing.assert_allclose(replay.index.priority[key], priority + 1e-6, rtol=0, atol=1e-7, err_msg=f"key {key}")
    if max_grad_norm > 0:
        # (the clip bound both steps, so that its place in the step shows)
        assert clipped == [True, True]
    assert all(torch.equal(target_net.state_dict()[k], v) for k, v in target_before.items())


def test_make_learner_starts_the_target_network_as_a_copy_of_the_online_one():
    """Clause 5 at the start of a run: the target network equals the online network (a copy: other tensors), and
    Adam holds the online network's parameters with the flags' settings."""
    args = reactor.Args(env_id="MinAtar/Breakout-v0", lstm_size=8, num_atoms=11, learning_rate=3e-4, adam_beta1=0.2)
    torch.manual_seed(0)
    net, target_net, optimizer = reactor.make_learner(args, 3, MINATAR, "cpu")
    online = net.state_dict()
    target = target_net.state_dict()
    assert online.keys() == target.keys()
    for name, tensor in online.items():
        assert torch.equal(target[name], tensor) and target[name].data_ptr() != tensor.data_ptr(), name
    (group,) = optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in net.parameters()]
    assert group["lr"] == 3e-4 and group["betas"] == (0.2, 0.999) and group["eps"] == 1e-8


# ----------------------------------------------------------------------------------------------------------------
# clause 3: the chunks into the replay
def test_store_chunk_copies_each_chunk_before_its_actor_can_write_into_the_buffer_again():
    """Clause 3 under the race a loaded machine makes likely: an actor stand-in rewrites every row of its buffer the
    moment the learner hands it back. What the replay holds must equal what the actors wrote, segment by segment in
    order; `store_chunk` returns, per chunk, the actor and the versions of its env steps (its pad slots excluded)."""
    args = reactor.Args(env_id="MinAtar/Breakout-v0", num_actors=2, lstm_size=4, sequence_length=4, actor_chunk=5)
    num_actions = 3
    channel = reactor.make_channel(torch.multiprocessing.get_context("spawn"), args, num_actions, MINATAR)
    release = channel.release

    def actor_writes_on_release(message):
        release(message)
        # the actor's next rows, at once
        for array in channel.arrays.values():
            array[message.actor, message.buffer] = torch.from_numpy(np.ones(array.shape[2:], array.numpy().dtype) * 3)

    channel.release = actor_writes_on_release
    replay = reactor.SequenceReplay(200, 2, args.sequence_length, num_actions, args.lstm_size, MINATAR)
    rng = np.random.default_rng(1)
    written = {0: [], 1: []}
    for actor, rows, pads in ((0, 5, [2]), (1, 6, [5]), (0, 4, []), (1, 3, [0, 2]), (0, 6, [4])):
        assert channel.reserve(actor)
        slots = random_slots(rng, rows, num_actions, args.lstm_size)
        slots["pad"][pads] = True
        slots["version"] = rng.integers(0, 50, rows)
        for row in range(rows):
            channel.write(actor, **{name: values[row] for name, values in slots.items()})
        channel.send(actor)
        written[actor].append(slots)
        message = channel.get(timeout=10)
        got_actor, versions = reactor.store_chunk(channel, message, replay)
        assert got_actor == actor
        np.testing.assert_array_equal(versions, slots["version"][~slots["pad"]])
    for actor, chunks in written.items():
        n = sum(len(chunk["action"]) for chunk in chunks)
        assert replay.written[actor] == n
        segment = slice(actor * replay.seg_cap, actor * replay.seg_cap + n)
        for name in reactor.SequenceReplay.FIELDS:
            want = np.concatenate([chunk[name] for chunk in chunks]).astype(getattr(replay, name).dtype)
            np.testing.assert_array_equal(getattr(replay, name)[segment], want, err_msg=f"actor {actor}: {name}")
    with pytest.raises(queue.Empty):
        channel.get()


# ----------------------------------------------------------------------------------------------------------------
# clause 8: what evaluation plays
def test_evaluation_plays_seeded_whole_games_with_the_network_it_is_given(float32, monkeypatch):
    """Clause 8: `evaluate` asks for its family's evaluation env and resets game e with seed + e (all distinct), and
    each game's score equals a direct rollout written here: the same network, actions sampled from pi with one
    numpy stream seeded by `seed` across the games, the game played to its end."""
    args = reactor.Args(env_id="MinAtar/Breakout-v0", lstm_size=8, num_atoms=11)
    made = []
    resets = []
    make_env = reactor.make_env

    def recording_make_env(env_id, seed, args, **kwargs):
        made.append(kwargs.get("evaluation", False))
        env = make_env(env_id, seed, args, **kwargs)
        reset = env.reset

        def recording_reset(**reset_kwargs):
            resets.append(reset_kwargs.get("seed"))
            return reset(**reset_kwargs)

        env.reset = recording_reset
        return env

    monkeypatch.setattr(reactor, "make_env", recording_make_env)
    torch.manual_seed(3)
    net = reactor.make_network(args, 6, MINATAR)
    returns = reactor.evaluate(net, args, 3, "cpu", seed=40)
    assert made == [True] and resets == [40, 41, 42]
    env = make_minatar_env(args.env_id, 40)
    rng = np.random.default_rng(40)
    want = []
    for game in range(3):
        obs, _ = env.reset(seed=40 + game)
        state = net.initial_state(1)
        score = 0.0
        done = False
        while not done:
            with torch.no_grad():
                out = net(torch.from_numpy(obs)[None, None], torch.zeros(1, 1, dtype=torch.bool), state)
            mu = out.pi[0, 0].numpy().astype(np.float64)
            obs, reward, terminated, truncated, _ = env.step(int(rng.choice(6, p=mu / mu.sum())))
            score += reward
            state = out.state
            done = terminated or truncated
        want.append(score)
    assert returns == want


# ----------------------------------------------------------------------------------------------------------------
# clause 9: per env family, what the network sees
def network_input(args, obs):
    """What the first layer of the network built for `args` receives when an actor acts on frame `obs`."""
    net = reactor.make_network(args, 6, obs.shape)
    seen = []
    net.torso[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].clone()))
    reactor.act(net, obs, net.initial_state(1), np.random.default_rng(0))
    return seen[0].reshape(obs.shape)


@pytest.mark.parametrize("sticky, noop_max, documented_sticky", [(None, 30, 0.0), (0.25, 0, 0.25)])
def test_atari_env_and_network_input_as_documented(float32, sticky, noop_max, documented_sticky):
    """Clause 9, Atari: the actors' env and the evaluation env of `make_env` against the documented settings of
    common/atari_env.py (one frame, sticky actions 0 unless given, the given no-ops), played with the same actions
    and seeds from a reset to the first lost life: the same (1, 84, 84) uint8 frames; learning rewards = the signs
    of the real ones (SpaceInvaders scores 5 to 30), evaluation rewards = the real ones; the learning episode ends
    at the lost life, the evaluation one goes on. The network sees each frame divided by 255."""
    env_id = "ALE/SpaceInvaders-v5"
    args = reactor.Args(env_id=env_id, sticky_action_prob=sticky, noop_max=noop_max)
    training = reactor.make_env(env_id, 3, args)
    evaluation = reactor.make_env(env_id, 3, args, evaluation=True)
    documented = dict(frame_stack=1, sticky_action_prob=documented_sticky, noop_max=noop_max)
    direct = make_atari_env(env_id, 3, clip_rewards=False, terminal_on_life_loss=False, **documented)
    for env in (training, evaluation):
        assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(documented_sticky)
    frames = [env.reset(seed=3)[0] for env in (training, evaluation, direct)]
    lives = direct.unwrapped.ale.lives()
    rng = np.random.default_rng(0)
    real_rewards = []
    for _ in range(1000):
        action = int(rng.integers(6))
        trained, evaluated, want = (env.step(action) for env in (training, evaluation, direct))
        assert trained[0].shape == (1, 84, 84) and trained[0].dtype == np.uint8
        assert np.array_equal(trained[0], want[0]) and np.array_equal(evaluated[0], want[0])
        assert trained[1] == np.sign(want[1]) and evaluated[1] == want[1]
        real_rewards.append(want[1])
        lost_life = direct.unwrapped.ale.lives() < lives
        assert trained[2] == (lost_life or want[2]) and evaluated[2] == want[2] and not evaluated[2]
        if lost_life:
            break
    assert lost_life and max(real_rewards) > 1
    for env in (training, evaluation, direct):
        env.close()
    frame = frames[0]
    assert frame.max() > 1
    torch.testing.assert_close(network_input(args, frame), torch.from_numpy(frame).float() / 255.0)


@pytest.mark.parametrize("sticky, documented_sticky", [(None, 0.1), (0.0, 0.0), (0.3, 0.3)])
def test_minatar_env_and_network_input_as_documented(float32, sticky, documented_sticky):
    """Clause 9, MinAtar: the actors' env and the evaluation env of `make_env` against common/minatar_env.py with
    the documented sticky probability (MinAtar's 0.1 unless given; a given 0 is 0), the same actions and seeds over
    300 steps and the resets after each episode: the same (4, 10, 10) 0/1 uint8 frames, rewards and ends. The network
    sees the 0/1 frames as they are (no / 255)."""
    env_id = "MinAtar/Breakout-v0"
    args = reactor.Args(env_id=env_id, sticky_action_prob=sticky)
    envs = [reactor.make_env(env_id, 4, args), reactor.make_env(env_id, 4, args, evaluation=True)]
    direct = make_minatar_env(env_id, 4, sticky_action_prob=documented_sticky)
    assert [env.sticky_action_prob for env in envs] == [documented_sticky, documented_sticky]
    frames = [env.reset(seed=4)[0] for env in (*envs, direct)]
    assert all(np.array_equal(frame, frames[-1]) for frame in frames)
    rng = np.random.default_rng(0)
    for _ in range(300):
        action = int(rng.integers(6))
        *got, want = (env.step(action) for env in (*envs, direct))
        for step in got:
            assert step[0].shape == MINATAR and step[0].dtype == np.uint8 and set(np.unique(step[0])) <= {0, 1}
            assert np.array_equal(step[0], want[0]) and step[1:4] == want[1:4]
        if want[2] or want[3]:
            for env in (*envs, direct):
                env.reset()
    frame = frames[0]
    assert frame.max() == 1
    torch.testing.assert_close(network_input(args, frame), torch.from_numpy(frame).float())

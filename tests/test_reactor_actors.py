"""Tests of reactor.py's network, actors and learner steps: shapes, gradient blocking and the fused LSTM; evaluation;
the real `actor_loop` in a thread against a direct rollout, its weight syncs and its ratio gate; the learner's gate
and its step (priorities back, weights published, target refreshed); the `ChunkChannel` between actors and learner."""

import math
import multiprocessing as mp
import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import reactor_helpers
import torch
from reactor_helpers import ATARI, MINATAR

import reactor
from reactor import SequenceReplay

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float32 = reactor_helpers.float32
float64_by_default = reactor_helpers.float64_by_default


# ----------------------------------------------------------------------------------------------------------------
# the network
def test_network_shapes_uniform_mix_and_gradient_blocking(float32):
    A = 4
    K = 11
    H = 16
    net = reactor.ReactorNetwork(A, ATARI, K, H, crelu=True, policy_uniform_eps=0.1)
    obs = torch.randint(0, 255, (2, 5, 84, 84), dtype=torch.uint8)
    first = torch.zeros(2, 5, dtype=torch.bool)
    out = net(obs, first, net.initial_state(2))
    assert out.q.shape == (2, 5, A, K) and out.pi.shape == (2, 5, A)
    torch.testing.assert_close(out.pi.sum(-1), torch.ones(2, 5))
    assert (out.pi >= 0.1 / A - 1e-7).all()  # fixed uniform mix
    # policy-LSTM gradients do not reach the torso; Q gradients do
    out.pi[..., 0].sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in net.torso.parameters())
    assert net.pi_lstm.weight_ih_l0.grad.abs().sum() > 0
    net.zero_grad()
    out = net(obs, first, net.initial_state(2))
    out.q.sum().backward()
    assert net.torso[0].weight.grad.abs().sum() > 0
    assert net.pi_lstm.weight_ih_l0.grad is None or net.pi_lstm.weight_ih_l0.grad.abs().sum() == 0
    # a "first" flag resets the LSTM state: the outputs from there on equal a fresh unroll
    first[:, 2] = True
    with torch.no_grad():
        full = net(obs, first, tuple(torch.randn(2, H) for _ in range(4)))
        tail = net(obs[:, 2:], first[:, 2:], net.initial_state(2))
    torch.testing.assert_close(full.q[:, 2:], tail.q)
    torch.testing.assert_close(full.pi[:, 2:], tail.pi)
    # ND head and plain ReLU
    nd = reactor.ReactorNetwork(A, ATARI, K, H, crelu=False, distributional=False)
    assert nd(obs, first, nd.initial_state(2)).q.shape == (2, 5, A)


def test_crelu_and_the_q_only_unroll_of_the_target_network(float32):
    """CReLU equals [relu(x), relu(-x)] in values and gradients (zeros included); policy=False (the target network)
    gives the full unroll's Q across episode starts (sequences return no state), and a one-frame call's Q-LSTM state."""
    x = torch.randn(3, 4, 5, 5)
    x[0, 0, :2] = 0.0
    x.requires_grad_()
    g = torch.randn(3, 8, 5, 5)
    got = reactor.CReLU()(x)
    want = torch.cat([torch.relu(x), torch.relu(-x)], 1)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    net = reactor.ReactorNetwork(4, ATARI, 11, 16)
    obs = torch.randint(0, 255, (2, 6, 84, 84), dtype=torch.uint8)
    first = torch.zeros(2, 6, dtype=torch.bool)
    first[0, 2] = True
    first[1, 4] = True
    state = tuple(torch.randn(2, 16) for _ in range(4))
    with torch.no_grad():
        full = net(obs, first, state)
        q_only = net(obs, first, state, policy=False)
    assert torch.equal(q_only.q, full.q) and q_only.pi is None and q_only.state is None and full.state is None
    with torch.no_grad():
        full = net(obs[:, :1], first[:, :1], state)
        q_only = net(obs[:, :1], first[:, :1], state, policy=False)
    assert torch.equal(q_only.q, full.q) and q_only.state[2:] == (None, None)
    assert torch.equal(q_only.state[0], full.state[0]) and torch.equal(q_only.state[1], full.state[1])


def test_fused_lstm_equals_step_by_step_reset(float32):
    """The fused nn.LSTM over pieces cut at episode starts gives the outputs and gradients (the torso's included) of a
    step-by-step LSTMCell unroll that zeroes each sequence's state right before its `first` frames (the reference);
    acting one frame at a time, carrying the state, ends in the reference's final state."""
    A = 3
    K = 7
    H = 8
    B = 4
    L = 9
    torch.manual_seed(0)
    net = reactor.ReactorNetwork(A, ATARI, K, H)
    obs = torch.randint(0, 255, (B, L, 84, 84), dtype=torch.uint8)
    first = torch.zeros(B, L, dtype=torch.bool)
    # starts at 0, mid, shared, on two frames in a row (a one-frame piece), last
    first[0, 0] = True
    first[1, 3] = True
    first[1, 7] = True
    first[2, 3] = True
    first[2, 4] = True
    first[3, 8] = True
    state = tuple(torch.randn(B, H) for _ in range(4))

    def cell_like(lstm):
        cell = torch.nn.LSTMCell(lstm.input_size, lstm.hidden_size)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(cell, name).copy_(getattr(lstm, name + "_l0"))
        return cell

    def reference(net):
        q_cell = cell_like(net.q_lstm)
        pi_cell = cell_like(net.pi_lstm)
        x = net.torso(obs.reshape(B * L, 1, 84, 84).float() / 255.0).reshape(B, L, -1)
        hq, cq, hp, cp = state
        qs = []
        ps = []
        for t in range(L):
            k = (~first[:, t]).float()[:, None]
            hq, cq = q_cell(x[:, t], (hq * k, cq * k))
            hp, cp = pi_cell(x[:, t].detach(), (hp * k, cp * k))
            qs.append(hq)
            ps.append(hp)
        return torch.stack(qs, 1), torch.stack(ps, 1), (hq, cq, hp, cp), (q_cell, pi_cell)

    captured = {}
    net.q_hidden.register_forward_hook(lambda m, i, o: captured.__setitem__("q", i[0]))
    net.pi_hidden.register_forward_hook(lambda m, i, o: captured.__setitem__("pi", i[0]))
    out = net(obs, first, state)
    q_ref, pi_ref, state_ref, cells = reference(net)
    torch.testing.assert_close(captured["q"], q_ref.reshape(B * L, H))
    torch.testing.assert_close(captured["pi"], pi_ref.reshape(B * L, H))
    assert out.state is None
    (captured["q"].square().sum() + captured["pi"].sum()).backward()
    # the torso's gradient comes back through the pieces (the reference shares the torso: its gradient is taken apart)
    fused_torso_grads = [p.grad.clone() for p in net.torso.parameters()]
    net.torso.zero_grad()
    (q_ref.square().sum() + pi_ref.sum()).backward()
    for got, p in zip(fused_torso_grads, net.torso.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)
    for lstm, cell in zip((net.q_lstm, net.pi_lstm), cells):
        torch.testing.assert_close(lstm.weight_hh_l0.grad, cell.weight_hh.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lstm.weight_ih_l0.grad, cell.weight_ih.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        carried = state
        for t in range(L):
            carried = net(obs[:, t : t + 1], first[:, t : t + 1], carried).state
    for got, want in zip(carried, state_ref):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------------------------
# evaluation
def test_evaluation_resets_the_lstm_at_a_lost_life_as_training_does(float32, monkeypatch):
    """Training ends a learning episode at a lost life (the actor resets its LSTM state); evaluation plays whole games
    and must reset the state at the same points: zero state at the start and right after each lost life only."""
    lives_after_step = [3, 3, 2, 2, 2, 1, 1]

    class LivesEnv:  # Atari-like: lives in info, one game of 7 steps
        def reset(self, seed=None):
            self.t = 0
            return np.zeros((1, 84, 84), np.uint8), {"lives": 3}

        def step(self, action):
            self.t += 1
            info = {"lives": lives_after_step[self.t - 1]}
            if self.t == len(lives_after_step):
                info["episode"] = {"r": 1.0, "l": self.t}
            return np.zeros((1, 84, 84), np.uint8), 0.0, self.t == len(lives_after_step), False, info

        def close(self):
            pass

    monkeypatch.setattr(reactor, "make_env", lambda *a, **k: LivesEnv())
    net = reactor.ReactorNetwork(3, ATARI, 11, 8)
    zero_state_at = []
    forward = net.forward

    def spy(obs, first, state):
        zero_state_at.append(all(bool((h == 0).all()) for h in state))
        return forward(obs, first, state)

    monkeypatch.setattr(net, "forward", spy)
    assert reactor.evaluate(net, reactor.Args(), 1, "cpu", seed=0) == [1.0]
    # steps 0..6 are acted on; lives drop on steps 2 (3 -> 2) and 5 (2 -> 1): fresh state at steps 0, 3 and 6
    assert zero_state_at == [True, False, False, True, False, False, True]


def test_training_env_ends_the_learning_episode_at_a_lost_life():
    """The training side of the agreement above: the actors' env (`make_env`, not evaluation) terminates at each lost
    life, so the actor starts a new sequence episode there (first = True, zero LSTM state: the wiring test below);
    the evaluation env plays on through it."""
    for evaluation in (False, True):
        env = reactor.make_env("ALE/Breakout-v5", 0, reactor.Args(sticky_action_prob=0.0), evaluation=evaluation)
        _, info = env.reset(seed=0)
        lives = info["lives"]
        rng = np.random.default_rng(0)
        for _ in range(2000):
            _, _, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
            if info["lives"] < lives or terminated or truncated:
                break
        assert info["lives"] == lives - 1 and terminated != evaluation, evaluation
        env.close()


def test_evaluate_plays_whole_games(float32):
    args = reactor.Args(env_id="ALE/Breakout-v5", lstm_size=16)
    net = reactor.ReactorNetwork(4, ATARI, 51, 16)
    returns = reactor.evaluate(net, args, 1, "cpu", seed=3)
    assert len(returns) == 1 and returns[0] >= 0


def test_evaluate_greedy_plays_argmax_pi(monkeypatch):
    played = []

    class ThreeStepEnv:
        def reset(self, seed=None):
            played.append([])
            return np.zeros((1, 84, 84), np.uint8), {}

        def step(self, action):
            played[-1].append(action)
            done = len(played[-1]) == 3
            return np.zeros((1, 84, 84), np.uint8), 0.0, done, False, {"episode": {"r": 0.0, "l": 3}} if done else {}

        def close(self):
            pass

    class StubNet:
        def initial_state(self, batch, device=None):
            return None

    mu = np.array([0.3, 0.1, 0.6])  # the sampled action (0) is not the argmax (2)
    monkeypatch.setattr(reactor, "make_env", lambda *a, **k: ThreeStepEnv())
    monkeypatch.setattr(reactor, "act", lambda net, obs, state, rng, device: (0, mu, type("Out", (), {"state": None})))
    assert reactor.evaluate(StubNet(), reactor.Args(), 1, "cpu", seed=0, greedy=True) == [0.0]
    assert reactor.evaluate(StubNet(), reactor.Args(), 1, "cpu", seed=0) == [0.0]
    assert played == [[2, 2, 2], [0, 0, 0]]


# ----------------------------------------------------------------------------------------------------------------
# the loop's wiring: the actor's stores, weight syncs and gate, the learner's gate and step
def documented_actor_seed(seed: int, actor_id: int, start_step: int) -> int:
    """README: actor i uses seed + 1000 i; a run resumed at step S > 0 draws its actors' seeds from (that seed, S)."""
    if start_step == 0:
        return seed + 1000 * actor_id
    return int(np.random.SeedSequence([seed + 1000 * actor_id, start_step]).generate_state(1)[0]) % 2**31


@pytest.mark.parametrize("start_step, own_steps", [(0, 0), (700, 13)])
def test_actor_writes_into_replay_what_a_direct_rollout_gives(float32, monkeypatch, start_step, own_steps):
    """Contract, clauses 1-3: the real `actor_loop` of actor 1 (in a thread) and the learner's `store_chunk` store
    exactly what a direct rollout written here gives with the published weights and the documented seed (seed + 1000 i;
    a run resumed at step S: drawn from (seed + 1000 i, S), never the first run's streams): frames, actions, rewards,
    mu, the float16 LSTM state before each frame, term / first flags, a pad slot (true last frame, uniform mu) after
    each truncation, and the weights version on every slot. Resumed with its own step count at 13 (no sync point of
    actor_sync_every = 16), the actor still acts with the published weights from its first step. MinAtar Breakout
    with an 8-step limit has terminations and truncations; a wrapper adds 0.25 x (step in episode) to its rewards so
    that a dropped or shifted reward shows."""
    import gymnasium as gym

    from common.minatar_env import make_minatar_env

    class StepReward(gym.Wrapper):
        def reset(self, **kwargs):
            self.t = 0
            return self.env.reset(**kwargs)

        def step(self, action):
            obs, r, term, trunc, info = self.env.step(action)
            self.t += 1
            return obs, r + 0.25 * self.t, term, trunc, info

    limit = 8
    steps = 150
    monkeypatch.setattr(
        reactor,
        "make_env",
        lambda env_id, seed, args, **k: StepReward(make_minatar_env(env_id, seed, max_episode_steps=limit)),
    )
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0", num_actors=2, lstm_size=8, num_atoms=11, actor_chunk=16, seed=5, actor_sync_every=16
    )
    probe = reactor.make_env(args.env_id, 0, args)
    A = int(probe.action_space.n)
    shape = probe.observation_space.shape
    torch.manual_seed(0)
    shared = reactor.make_network(args, A, shape)
    channel = reactor.make_channel(torch.multiprocessing.get_context("spawn"), args, A, shape)
    stop = threading.Event()
    actor_steps = [0, own_steps]
    threads = torch.get_num_threads()
    # (the learner's count and the weights' version: 7 learning steps so far)
    handles = reactor.ActorHandles(shared, SimpleNamespace(value=7), actor_steps, SimpleNamespace(value=7), channel, stop)
    # ratio base far ahead: no acting:learning gate
    actor = threading.Thread(
        target=reactor.actor_loop, args=(1, args, "test", handles, reactor.RatioBase(10**12, 0), start_step)
    )
    replay = reactor.SequenceReplay(8000, 2, 8, A, args.lstm_size, obs_shape=shape)
    actor.start()
    try:
        while replay.written[1] < steps:
            msg = channel.get(timeout=30)
            if msg[0] == "chunk":
                reactor.store_chunk(channel, msg, replay)
    finally:
        stop.set()
        actor.join()
        torch.set_num_threads(threads)

    seed = documented_actor_seed(args.seed, 1, start_step)
    env = StepReward(make_minatar_env(args.env_id, seed, max_episode_steps=limit))  # the direct rollout
    net = reactor.make_network(args, A, shape)
    net.load_state_dict(shared.state_dict())
    rng = np.random.default_rng(seed)
    rows = []
    ends = {"term": 0, "trunc": 0}
    obs, _ = env.reset(seed=seed)
    state = net.initial_state(1)
    first = True
    while len(rows) < replay.written[1]:
        with torch.no_grad():
            o = net(torch.from_numpy(obs)[None, None], torch.zeros(1, 1, dtype=torch.bool), state)
        mu = o.pi[0, 0].numpy().astype(np.float64)
        mu /= mu.sum()
        a = int(rng.choice(A, p=mu))
        nxt, r, term, trunc, _ = env.step(a)
        rows.append((obs, a, r, term, False, first, mu, torch.cat(state, 0).numpy(), 7))
        if term or trunc:
            ends["term" if term else "trunc"] += 1
            if not term:
                rows.append((nxt, 0, 0.0, False, True, False, np.full(A, 1 / A), torch.cat(o.state, 0).numpy(), 7))
            obs, _ = env.reset()
            state = net.initial_state(1)
            first = True
        else:
            obs = nxt
            state = o.state
            first = False
    assert ends["term"] >= 1 and ends["trunc"] >= 1
    n = int(replay.written[1])
    assert len({row[2] for row in rows[:n]}) >= 8  # rewards that differ from step to step
    # the actor counts on from its own steps (it may have taken a chunk's steps more before it saw the stop)
    received = sum(1 for row in rows[:n] if not row[4])
    assert replay.written[0] == 0 and 0 <= actor_steps[1] - own_steps - received <= args.actor_chunk
    segment = slice(replay.seg_cap, replay.seg_cap + n)
    for k, name in enumerate(reactor.SequenceReplay.FIELDS):
        want = np.array([row[k] for row in rows[:n]])
        got = getattr(replay, name)[segment]
        if name in ("mu", "state"):
            np.testing.assert_allclose(got, want.astype(got.dtype), rtol=1e-3, atol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=name)


def test_actor_seeds_differ_between_actors_and_from_the_run_resumed():
    """Contract, clause 2: the seeds actors draw their env and action streams from are distinct per actor, and a
    resumed run's are new (never the first run's, nor another resume's), by the documented rule."""
    seeds = {(i, step): reactor.actor_seed(1, i, step) for i in range(4) for step in (0, 500, 501, 10**6)}
    assert len(set(seeds.values())) == len(seeds)
    assert seeds == {key: documented_actor_seed(1, *key) for key in seeds}
    assert all(0 <= seed < 2**31 for seed in seeds.values())


class EpisodeStub:
    """A stand-in env with MinAtar's frame shape and 3 actions: pixels (0, 0, 0) and (0, 0, 1) of each frame hold the
    episode and the step in it; episode e is cut by a time limit (truncated, never terminated) after
    lengths[e % len(lengths)] steps; on_step(n) runs within the n-th step of the whole run (n = 1, 2, ...)."""

    def __init__(self, lengths, on_step=lambda n: None):
        self.observation_space = SimpleNamespace(shape=MINATAR)
        self.action_space = SimpleNamespace(n=3)
        self.lengths = lengths
        self.on_step = on_step
        self.episode = -1
        self.t = 0
        self.steps = 0

    def frame(self):
        obs = np.zeros(MINATAR, np.uint8)
        obs[0, 0, :2] = self.episode % 256, self.t
        return obs

    def reset(self, seed=None):
        self.episode = self.episode + 1
        self.t = 0
        return self.frame(), {}

    def step(self, action):
        self.t += 1
        self.steps += 1
        self.on_step(self.steps)
        truncated = self.t == self.lengths[self.episode % len(self.lengths)]
        return self.frame(), 0.0, False, truncated, {}

    def close(self):
        pass


def run_actor_thread(
    monkeypatch, args, env, shared, weights_version, learner_steps, actor_steps, ratio_base, stop, slots_wanted=None
):
    """The real `actor_loop` (actor 0, in a thread, acting in `env`) and the learner's lines that store its chunks
    (`SequenceReplay.add`), until `slots_wanted` slots are stored or `stop` is set. Returns the replay; an exception
    of the actor is raised here."""
    monkeypatch.setattr(reactor, "make_env", lambda *a, **k: env)
    A = env.action_space.n
    shape = env.observation_space.shape
    channel = reactor.make_channel(torch.multiprocessing.get_context("spawn"), args, A, shape)
    replay = SequenceReplay(args.replay_size, 1, args.sequence_length, A, args.lstm_size, shape)
    errors = []
    threads = torch.get_num_threads()

    def actor():
        try:
            handles = reactor.ActorHandles(shared, weights_version, actor_steps, learner_steps, channel, stop)
            reactor.actor_loop(0, args, "test", handles, reactor.RatioBase(*ratio_base), 0)
        except Exception as e:
            errors.append(e)
            stop.set()

    thread = threading.Thread(target=actor)
    thread.start()
    try:
        while not stop.is_set() and (slots_wanted is None or replay.written[0] < slots_wanted):
            try:
                msg = channel.get(timeout=0.05)
            except queue.Empty:
                continue
            if msg[0] == "chunk":
                reactor.store_chunk(channel, msg, replay)
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return replay


def test_actor_loads_new_weights_at_its_sync_points_and_pads_a_truncation_on_a_chunk_s_last_row(float32, monkeypatch):
    """Contract, clauses 1 and 3. Episodes of 5, 6, 3 and 9 steps (actor_chunk = 5) put time-limit truncations on
    several rows of the chunks, a chunk's last row among them: each pad slot (the true last frame) follows its
    episode, in the chunk's spare row when needed. Within step 6 the learner publishes new weights (a policy that all
    but always picks action 2) and bumps the version: the actor acts with the old weights up to its next sync point
    (step 8, actor_sync_every = 4) and with the new ones from there on (the stored mu and version show which)."""
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0",
        num_actors=1,
        lstm_size=8,
        num_atoms=11,
        sequence_length=4,
        replay_size=400,
        actor_chunk=5,
        actor_sync_every=4,
        seed=3,
    )
    torch.manual_seed(0)
    shared = reactor.make_network(args, 3, MINATAR)
    version = SimpleNamespace(value=0)
    new_mu = np.array([0.01 / 3, 0.01 / 3, 0.99 + 0.01 / 3])  # (1 - eps) softmax([0, 0, 30]) + eps / 3, eps = 0.01

    def publish(n):
        if n == 6:
            with torch.no_grad():
                shared.pi_logits.weight.zero_()
                shared.pi_logits.bias.copy_(torch.tensor([0.0, 0.0, 30.0]))
            version.value = 1

    lengths = [5, 6, 3, 9] * 2
    # each episode: its steps (frames 0 .. n - 1), then its pad slot holding frame n, the true last frame
    episode_rows = np.concatenate([np.full(n + 1, e) for e, n in enumerate(lengths)])
    step_in_episode = np.concatenate([np.arange(n + 1) for n in lengths])
    is_pad = np.concatenate([np.arange(n + 1) == n for n in lengths])
    rows = len(episode_rows)
    replay = run_actor_thread(
        monkeypatch,
        args,
        EpisodeStub(lengths, publish),
        shared,
        version,
        SimpleNamespace(value=0),
        [0],
        (10**12, 0),
        threading.Event(),
        slots_wanted=rows,
    )
    np.testing.assert_array_equal(replay.obs[:rows, 0, 0, 0], episode_rows)
    np.testing.assert_array_equal(replay.obs[:rows, 0, 0, 1], step_in_episode)
    np.testing.assert_array_equal(replay.pad[:rows], is_pad)
    np.testing.assert_array_equal(replay.first[:rows], step_in_episode == 0)
    assert not replay.term[:rows].any()
    np.testing.assert_allclose(replay.mu[:rows][is_pad], 1 / 3)
    mu = replay.mu[:rows][~is_pad]  # one row per env step
    assert (mu[:8, 2] < 0.9).all()
    np.testing.assert_allclose(mu[8:], np.broadcast_to(new_mu, mu[8:].shape), rtol=1e-5)
    # each slot carries the version of the weights it was acted with (a pad slot: its episode's last)
    version = replay.version[:rows][~is_pad]
    np.testing.assert_array_equal(version, np.repeat([0, 1], [8, len(version) - 8]))


def test_actor_waits_for_the_learner_at_the_ratio_bound(float32, monkeypatch):
    """The actors' side of the acting:learning ratio: an actor acts while the env steps of all actors, counted from
    ratio_base[0], are at most acting_learning_ratio x (learning steps - ratio_base[1]) + ratio_slack, and waits as soon as one
    more step would pass that bound. The real `actor_loop` in a thread; another actor's 5 steps count too; the learner
    is simulated by the actor's wait (each wait: one more learning step), so that nothing depends on timing."""
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0",
        num_actors=2,
        lstm_size=8,
        num_atoms=11,
        sequence_length=4,
        replay_size=4000,
        actor_chunk=4,
        acting_learning_ratio=2.5,
        ratio_slack=6,
    )
    base = (20, 3)
    stop = threading.Event()
    # (actor 1: 5 steps, then no more)
    learner_steps = SimpleNamespace(value=base[1])
    actor_steps = [0, 5]
    # (env steps since base[0], learning steps since base[1]) at each step, at each wait
    acted = []
    waited = []

    def on_step(n):
        acted.append((sum(actor_steps) - base[0], learner_steps.value - base[1]))
        # (reached only without the gate)
        if n == 300:
            stop.set()

    def wait(seconds):
        waited.append((sum(actor_steps) - base[0], learner_steps.value - base[1]))
        learner_steps.value += 1
        if learner_steps.value - base[1] == 12:
            stop.set()

    monkeypatch.setattr(reactor, "time", SimpleNamespace(sleep=wait))  # actor_loop's wait
    run_actor_thread(
        monkeypatch,
        args,
        EpisodeStub([7], on_step),
        reactor.make_network(args, 3, MINATAR),
        SimpleNamespace(value=0),
        learner_steps,
        actor_steps,
        base,
        stop,
    )
    assert all(ahead <= 2.5 * learned + 6 for ahead, learned in acted)
    assert acted[0][0] == -15  # before learning_starts (base[0]) too
    # it waits right at the bound: one step more would pass it
    assert waited == [(math.floor(2.5 * learned + 6) + 1, learned) for learned in range(12)]
    assert len(acted) == waited[-1][0] + 15


def test_learner_may_learn_keeps_learning_steps_at_the_acting_ratio():
    """The learner's side: env steps arrive one at a time and the learner takes every step it may; its learning
    steps since ratio_base[1] stay exactly ceil((env steps - ratio_base[0]) / acting_learning_ratio) (none before
    ratio_base[0], e.g. learning_starts), and none while the replay holds less than a batch."""
    args = reactor.Args(acting_learning_ratio=2.5, batch_size=4)
    base = reactor.RatioBase(100, 7)
    learn_steps = 7
    for global_step in range(0, 160):
        assert not reactor.learner_may_learn(global_step, learn_steps, 3, base, args)  # (3 sequences < a batch)
        # (at most 10 tries: a broken gate fails here rather than looping for ever)
        for _ in range(10):
            if not reactor.learner_may_learn(global_step, learn_steps, 4, base, args):
                break
            learn_steps += 1
        assert learn_steps - base[1] == max(0, math.ceil((global_step - base[0]) / 2.5)), global_step


def test_learning_step_writes_priorities_back_publishes_weights_and_refreshes_the_target(float32, monkeypatch):
    """The learner's step on a real network, optimizer and replay: each step writes the batch's new priorities
    (mean total variation + 1e-6, to the power priority_exponent) back for its keys; `publish_weights` then copies
    the weights to the actors' shared network, sets the version and the learner count the actors read, and copies
    the weights to the target network every target_update_period steps (and only then). The step's stats carry its
    loss and mean IS weight (the log line's means over the steps since the last line)."""
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0",
        lstm_size=8,
        num_atoms=11,
        sequence_length=4,
        batch_size=3,
        target_update_period=3,
        priority_exponent=0.5,
        learning_rate=1e-3,
    )
    A = 3
    T = args.sequence_length
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    net, target_net, optimizer = reactor.make_learner(args, A, MINATAR, "cpu")
    shared = reactor.make_network(args, A, MINATAR)
    shared.load_state_dict(net.state_dict())
    replay = SequenceReplay(200, 1, T, A, args.lstm_size, MINATAR, args.replay_uniform_eps)
    m = 40
    replay.add(
        0,
        {
            "obs": rng.integers(0, 2, (m, *MINATAR)).astype(np.uint8),
            "action": rng.integers(0, A, m),
            "reward": rng.normal(size=m),
            "term": np.zeros(m, bool),
            "pad": np.zeros(m, bool),
            "first": np.arange(m) % 13 == 0,
            "mu": rng.dirichlet(np.ones(A), m),
            "state": np.zeros((m, 4, args.lstm_size)),
            "version": np.zeros(m, np.int64),
        },
    )
    support = torch.linspace(args.v_min, args.v_max, args.num_atoms)
    seen = {}

    def spy_sample(*a, **k):
        seen["keys"], seen["batch"] = replay_sample(*a, **k)
        return seen["keys"], seen["batch"]

    def spy_loss(*a, **k):
        seen["loss"], seen["priorities"], stats = loss_fn(*a, **k)
        return seen["loss"], seen["priorities"], stats

    replay_sample = replay.sample
    loss_fn = reactor.reactor_loss
    monkeypatch.setattr(replay, "sample", spy_sample)
    monkeypatch.setattr(reactor, "reactor_loss", spy_loss)
    version = SimpleNamespace(value=0)
    learner_steps = SimpleNamespace(value=0)

    def weights(model):
        return {k: v.clone() for k, v in model.state_dict().items()}

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    target_weights = weights(target_net)
    for learn_steps in range(1, 8):
        before = weights(net)
        stats = reactor.learning_step(net, target_net, optimizer, replay, support, args, rng, "cpu")
        assert not same(weights(net), before)  # the step changed the weights (so the equalities below mean something)
        new = dict(zip(seen["keys"].tolist(), seen["priorities"].detach().double().numpy().tolist()))  # (last of a key)
        for key, priority in new.items():
            assert replay.index.known.get(np.array([key]))[0] == 1
            np.testing.assert_allclose(replay.index.priority[key], (priority + 1e-6) ** 0.5, rtol=1e-12)
        assert stats["losses/loss"] == seen["loss"] and stats["replay/is_weight_mean"] == seen["batch"].weights.mean()
        reactor.publish_weights(net, target_net, shared, version, learner_steps, learn_steps, args)
        assert same(weights(shared), weights(net)) and version.value == learner_steps.value == learn_steps
        refreshed = learn_steps % 3 == 0
        if refreshed:
            target_weights = weights(net)
        assert same(weights(target_net), target_weights) and same(weights(target_net), weights(net)) == refreshed
    assert replay.index.num_known > 3


def _chunk_writer(channel, actor, rows):
    """Child process: write `rows` rows (value = row number) in chunks of 3, then a message of its own."""
    n = 0
    for r in range(rows):
        while not channel.reserve(actor):
            pass
        n = channel.write(actor, r, np.full(2, r, np.float32))
        if n == 3:
            channel.send(actor)
    channel.send(actor)
    while not channel.reserve(actor):
        pass
    channel.send(actor)  # a reserved buffer with no rows: nothing is sent
    channel.post(("done", actor))


def test_chunk_channel_carries_every_row_once_in_order_and_recycles_its_buffers():
    """Two writer processes, 2 buffers of 4 rows each: 11 rows each arrive once, in order, in chunks of 3 and 2,
    with each buffer given back and reused; only the small messages cross the queue."""
    ctx = mp.get_context("spawn")
    channel = reactor.ChunkChannel(ctx, 2, 4, {"step": (np.int64, ()), "vec": (np.float32, (2,))}, num_buffers=2)
    procs = [ctx.Process(target=_chunk_writer, args=(channel, a, 11)) for a in range(2)]
    [p.start() for p in procs]
    got = {0: [], 1: []}
    done = set()
    sizes = []
    while len(done) < 2:
        msg = channel.get(timeout=60)
        if msg[0] == "chunk":
            actor, rows = channel.read(msg)
            assert len(msg) == 4 and (rows["vec"] == rows["step"][:, None]).all()
            got[actor] += rows["step"].tolist()
            sizes.append(len(rows["step"]))
            channel.release(msg)
        else:
            done.add(msg[1])
    [p.join(timeout=30) for p in procs]
    assert got == {0: list(range(11)), 1: list(range(11))}
    assert sorted(sizes) == [2, 2, 3, 3, 3, 3, 3, 3]

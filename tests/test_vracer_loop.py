"""vracer_refer.py's loop (App. C Alg. 1-3) as a contract. Each clause is checked here on the real functions and in
tests/test_vracer_runs.py on a real run (the probe records what the real loop hands them):

1. Actors act with the latest published weights and state statistics: `publish_weights` copies the learner's
   parameters, obs_mean and obs_std into shared memory as the next version; an actor copies them before its next
   step and keeps only a copy no publish overlapped (a seqlock), so each transition's mu_t is exactly the network of
   the version it records, on the state standardised with that publish's statistics (Eqs. (14)-(15)), even while
   the learner publishes; versions rise with the learner's publishes.
2. Noise: u_t = m(s_t) + sigma z, z from --action-noise (normal truncated at +-3, App. A), sigma the network's
   state-independent std (sqrt(0.2) until the first update); the env gets u_t rescaled to the bounds (clipped only
   with --clip-actions); what the actors write equals a direct rollout.
3. The F gate: nothing is learned before the memory holds N_start samples; then k < (t - t0)/F before each gradient
   step and t <= t0 + F k + 33 per actor (32 steps of slack, one in flight), and k catches up with (t - t0)/F by the
   end (App. C Alg. 1).
4. One learner step (`train_step`) on the batch it draws applies Eq. (10) with the off-policy PG (Eq. (5)) and the
   value loss (Eq. (9)) on V^tbc (Eq. (7)) from Q^ret in the current reward scale (Eq. (16)); Rule 1 (rho outside
   (1/c_max, c_max): only the KL term) and Rule 2 (the -(1 - beta) grad D_KL of Eq. (11)) as --refer says; PER
   weights (n P)^-beta / max with beta annealed to 1; c_max(k) and lr(k) of Eq. (13); one Adam step. It then writes
   back rho, V and (truncated ends) V(s_L), keeps Q^ret equal to the Eq. (8) recursion, keeps n_far, moves beta by
   Eq. (12) with the far fraction and, with PER, writes the priorities |c (Q^ret - V)|; new steps get the largest
   priority so far.
5. Every stats_every steps (`learn`): the reward scale (Eq. (16)), the n_far recount, the PER re-sort and, with
   --state-stats-rate, the state statistics move toward the memory's; at the first step the state statistics are the
   memory's (Eqs. (14)-(15)), frozen after (rate 0); the new weights are published after each learner turn.
6. Evaluation plays the deterministic policy: the mean action of the state standardised with the learner's
   statistics, in a fresh env.
7. Resume: a checkpoint holds, and `restore_run` puts back, everything the next step reads (network, Adam, k, beta,
   t0, whether learning started, the statistics, the reward scale, the sampler's generator and memory, the global
   RNGs): the resumed learner's next steps equal the uninterrupted learner's, bit for bit.
"""

import copy
import io
import multiprocessing
import threading

import numpy as np
import pytest
import torch
from vracer_helpers import check_qret_consistent, cpu_learner, fill, stored_qret, textbook_memory_qret

import vracer_refer as vr
from common.checkpoint import rng_state
from common.logger import MetricAverager


# ----------------------------------------------------------------------------------------------------------------
# 1-2. what the actors act with
def start_actor(args, shared, obs_dim, act_dim, seed):
    """The real `actor_loop` in a thread (the processes' shared memory works the same within one process)."""
    actor = threading.Thread(target=vr.actor_loop, args=(0, args, obs_dim, act_dim, shared, seed, "test"), daemon=True)
    actor.start()
    return actor


def wait_for_rows(shared, rows, timeout=120.0):
    """Until actor 0 has written `rows` rows (the F gate, `steps_allowed`, holds it there)."""
    waited = 0.0
    while int(shared.written[0]) < rows:
        assert waited < timeout, f"actor wrote {int(shared.written[0])} of {rows} rows"
        threading.Event().wait(0.005)
        waited += 0.005


def test_actors_act_with_the_latest_published_weights_and_statistics(monkeypatch):
    """Clause 1: after each `publish_weights`, the real actor acts with the published network on the state standardised
    with the published statistics: every ring row's mu = (mean, std) and V equal the network of the version the row
    records, applied to (s - obs_mean) / obs_std of that publish; the rows after the second publish carry version 2
    and differ from what the first weights would give."""
    from common.mujoco_env import make_mujoco_env

    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=30))
    obs_dim = 11
    act_dim = 3
    args = vr.Args(env_id="Hopper-v5", num_actors=1, ring_size=256)
    torch.manual_seed(4)
    agent = vr.Agent(obs_dim, act_dim)
    with torch.no_grad():
        agent.out.weight.mul_(20.0)  # means that depend clearly on the state
    num_params = sum(p.numel() for p in agent.parameters())
    shared = vr.make_shared_handles(1, args.ring_size, obs_dim, act_dim, num_params, threading.Event())
    rng = np.random.default_rng(5)
    published = {}  # version -> (a copy of the network, obs_mean, obs_std)
    for version in (1, 2):
        obs_mean = torch.tensor(rng.normal(size=obs_dim), dtype=torch.float32)
        obs_std = torch.tensor(rng.uniform(0.3, 3.0, obs_dim), dtype=torch.float32)
        if version == 2:
            with torch.no_grad():
                for p in agent.parameters():
                    p.add_(0.1 * torch.randn_like(p))
        vr.publish_weights(shared, agent, obs_mean, obs_std)
        published[version] = (copy.deepcopy(agent), obs_mean, obs_std)
        # the F gate opens 40 more steps; the actor waits there before the next publish
        shared.steps_allowed[0] = 40 * version
        if version == 1:
            actor = start_actor(args, shared, obs_dim, act_dim, seed=6)
        try:
            wait_for_rows(shared, 40 * version)
        except AssertionError:
            shared.stop_event.set()
            raise
    shared.stop_event.set()
    actor.join()
    rows = {name: ring[0, :80].numpy() for name, ring in shared.rings.items()}
    np.testing.assert_array_equal(rows["policy_version"], [1] * 40 + [2] * 40)
    for version in (1, 2):
        rows_of = rows["policy_version"] == version
        network, obs_mean, obs_std = published[version]
        with torch.no_grad():
            mean, std, value = network((torch.as_tensor(rows["obs"][rows_of], dtype=torch.float32) - obs_mean) / obs_std)
        np.testing.assert_allclose(rows["mu_mean"][rows_of], mean.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rows["mu_std"][rows_of], std.numpy(), rtol=1e-5)
        np.testing.assert_allclose(rows["value"][rows_of], value.numpy(), rtol=1e-4, atol=1e-5)
    first_network, obs_mean, obs_std = published[1]
    with torch.no_grad():
        stale, _, _ = first_network((torch.as_tensor(rows["obs"][40:], dtype=torch.float32) - obs_mean) / obs_std)
    assert np.abs(rows["mu_mean"][40:] - stale.numpy()).max() > 0.05


class PublishedStates:
    """What a learner stand-in publishes as version v: the weights w_0 + cos(phi_v) d and statistics that move with
    phi_v too, phi_v = 2 pi (v mod 16) / 16 + 0.5 (each version differs from the next in every number, so a copy torn
    between two publishes, or labelled with the next version, matches no version; precomputed, so that publishing is
    mostly copying)."""

    CYCLE = 16

    def __init__(self, agent, obs_dim, rng):
        weights = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().double()
        weights_step = torch.as_tensor(0.05 * rng.normal(size=len(weights)))
        obs_mean = torch.as_tensor(rng.normal(size=obs_dim))
        obs_std = torch.as_tensor(rng.uniform(0.5, 2.0, obs_dim))
        self.states = []
        for phase in 2 * np.pi * np.arange(self.CYCLE) / self.CYCLE + 0.5:
            state = (
                (weights + np.cos(phase) * weights_step).float(),
                (obs_mean + 0.5 * np.cos(phase)).float(),
                (obs_std * (1.0 + 0.3 * np.sin(phase))).float(),
            )
            self.states.append(state)

    def __call__(self, version: int):
        """(weights, obs_mean, obs_std) of `version`, float32 as the shared memory holds them."""
        return self.states[version % self.CYCLE]


class NetworkStandIn:
    """What `publish_weights` reads of the learner's network: its parameters, here one vector."""

    def __init__(self):
        self.vector = None

    def parameters(self):
        return [self.vector]


def publish_in_a_tight_loop(shared, published, stop):
    """The learner stand-in: the real `publish_weights` of version 1, 2, ... with no pause between two publishes."""
    torch.set_num_threads(1)
    network = NetworkStandIn()
    version = 0
    while not stop.is_set():
        version += 1
        network.vector, obs_mean, obs_std = published(version)
        vr.publish_weights(shared, network, obs_mean, obs_std)


def start_publishing(shared, published):
    """The learner stand-in in a process of its own, as the learner is (forked: the shared memory and the precomputed
    versions come along). Returns the process and the event that stops it."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    learner = context.Process(target=publish_in_a_tight_loop, args=(shared, published, stop), daemon=True)
    learner.start()
    return learner, stop


class CopiedWith:
    """A shared tensor whose copies (`clone`, `copy_`) first run `during`: what another process does meanwhile."""

    def __init__(self, tensor, during):
        self.tensor = tensor
        self.during = during

    def clone(self):
        self.during()
        return self.tensor.clone()

    def copy_(self, source):
        self.during()
        return self.tensor.copy_(source)


def seqlock_setup(seed, ring_size=8):
    """Shared memory for one actor, the versions a learner stand-in publishes and the stand-in's network."""
    obs_dim = 11
    torch.manual_seed(seed)
    agent = vr.Agent(obs_dim, 3)
    published = PublishedStates(agent, obs_dim, np.random.default_rng(seed))
    num_params = sum(p.numel() for p in agent.parameters())
    shared = vr.make_shared_handles(1, ring_size, obs_dim, 3, num_params, threading.Event())
    return shared, published, NetworkStandIn()


def publish(shared, network, published, version):
    """The learner stand-in's publish of `version` (the real `publish_weights`)."""
    network.vector, obs_mean, obs_std = published(version)
    vr.publish_weights(shared, network, obs_mean, obs_std)


def assert_copy_of(copy_kept, published, version):
    assert copy_kept is not None and copy_kept[0] == version
    for kept, expected in zip(copy_kept[1:], published(version)):
        assert torch.equal(kept, expected)


def test_the_seqlock_keeps_only_a_copy_that_no_publish_overlapped():
    """Clause 1, the seqlock's rules one by one: `publish_weights` makes the sequence number odd for the copies of the
    weights and both statistics and even after them (+2 per publish, version = seq / 2); `read_published` returns the
    newest version's weights and statistics, and None (the actor keeps acting with its version) when that version
    is the one it holds, while a publish is under way, and when a publish begins or completes during any of its
    three copies."""
    shared, published, network = seqlock_setup(13)
    numbers_seen = []
    watched = {
        name: CopiedWith(getattr(shared, name), lambda: numbers_seen.append(int(shared.weights_seq[0])))
        for name in ("weights", "obs_mean", "obs_std")
    }
    network.vector, obs_mean, obs_std = published(1)
    vr.publish_weights(shared._replace(**watched), network, obs_mean, obs_std)
    assert numbers_seen == [1, 1, 1] and int(shared.weights_seq[0]) == 2 and vr.published_version(shared) == 1
    assert_copy_of(vr.read_published(shared, 0), published, 1)
    assert vr.read_published(shared, 1) is None
    # under way
    shared.weights_seq[0] += 1
    assert vr.read_published(shared, 0) is None
    shared.weights_seq[0] -= 1
    for name in ("weights", "obs_mean", "obs_std"):
        version = vr.published_version(shared)
        begins = shared._replace(**{name: CopiedWith(getattr(shared, name), lambda: shared.weights_seq.add_(1))})
        assert vr.read_published(begins, version - 1) is None, name
        # the publish that began ends
        shared.weights_seq.add_(1)
        completes = shared._replace(
            **{name: CopiedWith(getattr(shared, name), lambda: publish(shared, network, published, version + 2))}
        )
        assert vr.read_published(completes, version) is None, name
        assert_copy_of(vr.read_published(shared, version), published, version + 2)


def assert_rows_acted_with(ring, rows, published, std_map):
    """Every ring row's mu = (mean, std) and V are those of the version it records, exactly."""
    policy_version = ring["policy_version"][0, :rows].numpy()
    network = vr.Agent(11, 3)
    for version in np.unique(policy_version):
        weights, obs_mean, obs_std = published(int(version))
        torch.nn.utils.vector_to_parameters(weights, network.parameters())
        net = vr.numpy_params(network, std_map, obs_mean.numpy(), obs_std.numpy())
        for row in np.flatnonzero(policy_version == version):
            mean, std, value = vr.numpy_forward(net, ring["obs"][0, row].numpy())
            message = f"row {row}, version {version}"
            np.testing.assert_array_equal(ring["mu_mean"][0, row].numpy(), mean, err_msg=message)
            np.testing.assert_array_equal(ring["mu_std"][0, row].numpy(), std, err_msg=message)
            assert float(ring["value"][0, row]) == value, message


def test_an_actor_acts_with_the_copy_it_kept_when_a_publish_follows_at_once(monkeypatch):
    """Clause 1: the actor acts with the weights and statistics of the copy `read_published` handed it, not with what
    the shared memory holds by the time it acts: here a new version is published right after every copy the actor
    keeps, and every ring row's mu and V are still those of the version it records (one version per row)."""
    from common.mujoco_env import make_mujoco_env

    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=30))
    shared, published, network = seqlock_setup(14)
    real_read_published = vr.read_published

    def read_then_publish(shared, version):
        copy_kept = real_read_published(shared, version)
        if copy_kept is not None:
            publish(shared, network, published, copy_kept[0] + 1)
        return copy_kept

    monkeypatch.setattr(vr, "read_published", read_then_publish)
    publish(shared, network, published, 1)
    shared.steps_allowed[0] = 8
    args = vr.Args(env_id="Hopper-v5", num_actors=1)
    actor = start_actor(args, shared, 11, 3, seed=15)
    try:
        wait_for_rows(shared, 8)
    finally:
        shared.stop_event.set()
        actor.join()
    np.testing.assert_array_equal(shared.rings["policy_version"][0].numpy(), np.arange(1, 9))
    assert_rows_acted_with(shared.rings, 8, published, args.std_map)


def test_every_copy_an_actor_keeps_is_one_complete_publish():
    """Clause 1 under a race: while a learner stand-in publishes in a tight loop from another process, an actor
    stand-in copies with `read_published` as fast as it can; every copy it keeps (not None) is the weights and
    statistics published as the version it returns, exactly, and the versions it keeps rise."""
    shared, published, _ = seqlock_setup(12)
    learner, stop_publishing = start_publishing(shared, published)
    kept = []
    # version 0: nothing published yet
    version = 0
    tries = 0
    try:
        # most tries overlap a publish (the stand-in publishes some 40,000 times a second)
        while len(kept) < 50 and tries < 2_000_000:
            tries += 1
            copy_kept = vr.read_published(shared, version)
            if copy_kept is not None:
                version = copy_kept[0]
                kept.append(copy_kept)
    finally:
        stop_publishing.set()
        learner.join()
    assert len(kept) >= 10
    versions = [version for version, _, _, _ in kept]
    assert all(a < b for a, b in zip(versions, versions[1:]))
    for copy_kept in kept:
        assert_copy_of(copy_kept, published, copy_kept[0])


def test_actors_act_with_exactly_the_version_they_record_while_the_learner_publishes(monkeypatch):
    """Clause 1 under a race: a learner stand-in publishes with the real `publish_weights` in a tight loop from another
    process while the real actor steps; every ring row's mu = (mean, std) and V are those of the network and
    statistics published as the version the row records, exactly (an actor that reads the version and then copies
    weights that a publish in between has changed, or half changed, acts with another version than it records), and
    the actor takes up new versions as it goes."""
    from common.mujoco_env import make_mujoco_env

    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=30))
    args = vr.Args(env_id="Hopper-v5", num_actors=1, ring_size=3072)
    shared, published, _ = seqlock_setup(8, args.ring_size)
    learner, stop_publishing = start_publishing(shared, published)
    actor = start_actor(args, shared, 11, 3, seed=10)
    versions_seen = 0
    rows = 0
    try:
        # steps until the rows hold 400 different versions or the ring is full (the F gate opens 200 steps at a time)
        while versions_seen < 400 and rows < args.ring_size - 200:
            rows += 200
            shared.steps_allowed[0] = rows
            wait_for_rows(shared, rows)
            versions_seen = len(np.unique(shared.rings["policy_version"][0, :rows].numpy()))
    finally:
        stop_publishing.set()
        shared.stop_event.set()
        learner.join()
        actor.join()
    # most reads overlap a publish and are dropped: some 100 versions in 4,000 steps
    assert versions_seen >= 10
    assert_rows_acted_with(shared.rings, rows, published, args.std_map)


def test_actor_rings_into_replay_equal_a_direct_rollout(monkeypatch):
    """Clause 2: what the real `actor_loop` writes into its ring and `store_episodes` (the learner's reader, draining the
    ring while it wraps, episodes spanning several reads) puts into the replay (s_t, u_t, mu_t, r_{t+1}, V(s_t),
    terminated / truncated, s_T and V(s_T) of a truncated end) equals a direct rollout of the same env, written here
    from the paper's Alg. 2, with the same weights, state statistics and noise: --action-noise normal (this seed draws
    |z| > 3, which the default truncation would redraw) and --clip-actions (|u| > 1 occurs; MuJoCo's control cost
    sees the clipped action); sigma is the network's, sqrt(0.2) at the start. A 25-step time limit gives both
    terminations (Hopper falls) and truncations."""
    from common.mujoco_env import make_mujoco_env

    limit = 25
    seed = 3
    steps = 400
    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=limit))
    # the ring wraps 8 times, read while written
    args = vr.Args(env_id="Hopper-v5", num_actors=1, ring_size=48, action_noise="normal", clip_actions=True)
    obs_dim = 11
    act_dim = 3
    torch.manual_seed(0)
    agent = vr.Agent(obs_dim, act_dim, args.hidden_size, args.init_std, args.std_map, args.residual)
    rng = np.random.default_rng(0)
    # state statistics (App. B)
    obs_mean = 0.1 * rng.normal(size=obs_dim)
    obs_std = rng.uniform(0.5, 2.0, obs_dim)
    weights = torch.nn.utils.parameters_to_vector(agent.parameters()).detach()
    shared = vr.make_shared_handles(1, args.ring_size, obs_dim, act_dim, len(weights), threading.Event())
    shared.weights.copy_(weights)
    shared.obs_mean.copy_(torch.tensor(obs_mean, dtype=torch.float32))
    shared.obs_std.copy_(torch.tensor(obs_std, dtype=torch.float32))
    shared.steps_allowed[0] = steps  # the F gate lets the actor run `steps` env steps
    shared.weights_seq[0] = 2  # version 1 (the seqlock of publish_weights counts twice per publish)
    actor = start_actor(args, shared, obs_dim, act_dim, seed)
    rm = vr.EpisodeReplay(10_000, obs_dim, act_dim, args.gamma, max_episode_len=limit, per_alpha=0.5)
    partial = []
    n_read = 0
    n_finished = 0
    try:
        for _ in range(6000):  # the main loop's COLLECT: drain the ring while the actor fills it
            n, finished = vr.store_episodes(shared, 0, partial, rm)
            n_read += n
            n_finished += len(finished)
            if n_read >= steps:
                break
            threading.Event().wait(0.002)
    finally:
        # whatever raised above, stop the actor: a thread left running keeps pytest from exiting
        shared.stop_event.set()
        actor.join()
    assert n_read == steps == int(shared.read[0]) and n_finished == len(rm.episodes)

    # the direct rollout (independent of the ring format): a ~ mu = N(mean, std) with the actor's noise stream
    env = make_mujoco_env("Hopper-v5", seed, max_episode_steps=limit)
    net = vr.numpy_params(agent, args.std_map, shared.obs_mean.numpy(), shared.obs_std.numpy())
    low = env.action_space.low.astype(np.float64)
    high = env.action_space.high.astype(np.float64)
    noise = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    episodes = []
    cur = []
    noise_drawn = []
    for t in range(steps):
        mean, std, v = vr.numpy_forward(net, obs)
        z = vr.sample_noise(noise, act_dim, args.action_noise)
        noise_drawn.append(z)
        u = mean + std * z
        nxt, r, term, trunc, _ = env.step(vr.to_env_action(u, low, high, args.clip_actions))
        cur.append((obs, u, mean, std, r, v))
        if term or trunc:
            boot = (nxt, vr.numpy_forward(net, nxt)[2]) if not term else None
            episodes.append((cur, term, boot))
            cur = []
            obs, _ = env.reset()
        else:
            obs = nxt
    kinds = {term for _, term, _ in episodes}
    assert kinds == {True, False}, "need both terminated and truncated episodes"
    # the rollout exercises both flags: a draw beyond 3 sigma, an action beyond the bounds
    assert np.abs(noise_drawn).max() > 3.0 and np.abs([u for e in episodes for (_, u, *_) in e[0]]).max() > 1.0
    np.testing.assert_allclose(rm.mu_std[rm.valid], np.sqrt(0.2), rtol=1e-6)
    assert len(rm.episodes) == len(episodes) and sum(len(block["reward"]) for block in partial) == len(cur)
    for (start, L), (steps_, term, boot) in zip(rm.episodes, episodes):
        sl = slice(start, start + L)
        o, u, mean, std, r, v = (np.array([s[k] for s in steps_]) for k in range(6))
        assert L == len(steps_)
        np.testing.assert_allclose(rm.obs[sl], o, rtol=1e-6)
        np.testing.assert_allclose(rm.action[sl], u, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rm.mu_mean[sl], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rm.mu_std[sl], std, rtol=1e-5)
        np.testing.assert_allclose(rm.reward[sl], r, rtol=1e-12)
        np.testing.assert_allclose(rm.value[sl], v, rtol=1e-12)
        assert rm.truncated_last[start + L - 1] == (not term)
        if term:
            assert rm.boot_value[start + L - 1] == 0.0
        else:
            np.testing.assert_allclose(rm.boot_obs[start + L - 1], boot[0], rtol=1e-6)
            assert rm.boot_value[start + L - 1] == pytest.approx(boot[1], rel=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# 4. one learner step, by hand
def textbook_loss(net, obs, act, mu_mean, mu_std, qret, weights, beta, cmax, args):
    """Eq. (10) per sample, written from the paper with torch.distributions: rho = pi(u|s) / mu(u|s) (log clipped at
    +-logrho_clip), c = min(1, rho); near-policy iff 1/c_max < rho < c_max (Rule 1); g = beta (rho (Q^ret - V) grad
    log pi - grad 1/2 (V - V^tbc)^2) for near samples (Eqs. (5), (7), (9); --refer rule2 and none keep every sample,
    rule2 clips the PG's rho at 1e3), plus -(1 - beta) grad D_KL(mu || pi) for all (Eq. (11), Rule 2; rule1 and none:
    beta = 1); PER weights multiply the PG and value terms. Returns (loss = -(1/B) sum g, rho, far, priorities)."""
    Normal = torch.distributions.Normal
    batch_size = len(obs)
    total = 0.0
    rhos = []
    fars = []
    priorities = []
    for i in range(batch_size):
        mean, std, value = (x[0] for x in net(obs[i : i + 1]))
        pi = Normal(mean, std)
        mu = Normal(mu_mean[i], mu_std[i])
        log_rho = (pi.log_prob(act[i]) - mu.log_prob(act[i])).sum().detach()
        rho = float(torch.exp(torch.clamp(log_rho, -args.logrho_clip, args.logrho_clip)))
        c = min(1.0, rho)
        far = not (1.0 / cmax < rho < cmax)
        advantage = float(qret[i]) - value.item()
        vtbc = value.item() + c * advantage
        pg_rho = min(rho, vr.RULE2_RHO_MAX) if args.refer == "rule2" else rho
        pg = pg_rho * advantage * pi.log_prob(act[i]).sum()
        value_loss = 0.5 * (value - vtbc) ** 2
        if args.kl_direction == "mu_pi":
            kl = torch.distributions.kl_divergence(mu, pi).sum()
        else:
            kl = torch.distributions.kl_divergence(pi, mu).sum()
        beta_eff = beta if args.refer in ("full", "rule2") else 1.0
        skipped = far and args.refer in ("full", "rule1")
        g = 0.0 if skipped else float(weights[i]) * beta_eff * (value_loss - pg)
        total = total + g + (1.0 - beta_eff) * kl
        rhos.append(rho)
        fars.append(far)
        priorities.append(abs(c * advantage))
    return total / batch_size, np.array(rhos), np.array(fars), np.array(priorities)


def random_behaviour_memory(rng, N=400, obs_dim=3, act_dim=2):
    """A memory of random episodes acted by random Gaussian behaviour policies (rho spreads around 1)."""
    rm = vr.EpisodeReplay(N, obs_dim, act_dim, 0.99, max_episode_len=40, per_alpha=0.5)
    while rm.size < N:
        L = int(rng.integers(3, 16))
        mu_mean = 0.3 * rng.normal(size=(L, act_dim))
        mu_std = rng.uniform(0.3, 1.0, (L, act_dim))
        rm.add_episode(
            rng.normal(size=(L, obs_dim)),
            mu_mean + mu_std * rng.normal(size=(L, act_dim)),
            mu_mean,
            mu_std,
            3.0 * rng.normal(size=L),
            rng.normal(size=L),
            bool(rng.uniform() < 0.2),
            final_value=float(rng.normal()),
            final_obs=rng.normal(size=obs_dim),
        )
    rm.update_reward_scale()
    return rm


@pytest.mark.parametrize(
    "refer,per,kl_direction,D",
    [
        ("full", "none", "mu_pi", 0.001),
        ("rule1", "none", "mu_pi", 0.001),
        ("rule2", "none", "mu_pi", 0.999),
        ("none", "none", "mu_pi", 0.001),
        ("full", "rank", "mu_pi", 0.001),
        ("full", "none", "pi_mu", 0.999),
    ],
)
def test_two_learner_steps_equal_a_hand_written_update(refer, per, kl_direction, D):
    """Clause 4: two consecutive `train_step`s on the batches they draw equal the update written here from the paper,
    parameter by parameter: the gradient of `textbook_loss` (float64) at Q^ret from the textbook recursion over the
    memory's r / sigma_r, V, rho and V(s_L) (Eqs. (8), (16)), the PER weights with beta annealed to
    min(1, beta0 + (1 - beta0) A k), c_max(k) and lr(k) of Eq. (13) at each k, Adam written out; after each step the
    written-back rho, V, V(s_L) and priorities, Q^ret equal to the recursion again, and beta moved by Eq. (12) with
    the exact far fraction, down where it is above D and up where below (--refer none keeps beta = 1)."""
    rng = np.random.default_rng(30)
    rm = random_behaviour_memory(rng)
    if per == "rank":
        rm.priority[rm.valid] = rng.uniform(0.1, 3.0, rm.valid.sum())
        rm.per_rebuild()
    args = vr.Args(
        batch_size=32,
        buffer_size=400,
        refer=refer,
        per=per,
        kl_direction=kl_direction,
        learning_rate=1e-3,
        adam_eps=1e-4,
        C=0.5,
        A=0.05,
        # below the far fraction (0.001: Eq. (12) lowers beta) or above it (0.999: raises it)
        D=D,
        beta_lr=0.05,
        logrho_clip=2.0,
        per_beta0=0.3,
    )
    torch.manual_seed(31)
    agent = vr.Agent(3, 2)
    with torch.no_grad():
        agent.out.weight.mul_(10.0)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
    obs_mean = torch.tensor([0.2, -0.1, 0.3])
    obs_std = torch.tensor([1.5, 0.7, 1.1])
    k0 = 10
    learner = vr.Learner(
        agent, optimizer, rm, obs_mean, obs_std, rng, torch.device("cpu"), k0, 1.0 if refer == "none" else 0.3
    )
    rm.recount_far(vr.refer_cmax(k0, args.C, args.A))
    # Adam written out (torch's defaults: beta1 0.9, beta2 0.999)
    moments = [
        (torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)) for p in agent.parameters()
    ]
    saw = {"far": False, "near": False, "truncated end": False}
    for step in range(2):
        k = k0 + step
        cmax = 1.0 + args.C / (1.0 + args.A * k)  # Eq. (13)
        lr = args.learning_rate / (1.0 + args.A * k)  # Eq. (13)
        # the batch train_step will draw: the same generator state
        if per == "rank":
            beta_is = min(1.0, args.per_beta0 + (1.0 - args.per_beta0) * args.A * k)
            idx, weights = rm.sample_per(args.batch_size, copy.deepcopy(rng), beta_is)
            assert weights.min() < 0.9
        else:
            idx = rm.sample(args.batch_size, copy.deepcopy(rng))
            weights = np.ones(args.batch_size)
        qret = textbook_memory_qret(rm)[idx]
        standardise = lambda x: (torch.as_tensor(x, dtype=torch.float64) - obs_mean.double()) / obs_std.double()  # noqa: E731
        net = copy.deepcopy(agent).double()
        loss, rho, far, priority = textbook_loss(
            net,
            standardise(rm.obs[idx]),
            torch.as_tensor(rm.action[idx], dtype=torch.float64),
            torch.as_tensor(rm.mu_mean[idx], dtype=torch.float64),
            torch.as_tensor(rm.mu_std[idx], dtype=torch.float64),
            qret,
            weights,
            learner.beta,
            cmax,
            args,
        )
        loss.backward()
        with torch.no_grad():
            value_before = net(standardise(rm.obs[idx]))[2].numpy()
            boot = idx[rm.truncated_last[idx]]
            boot_value = net(standardise(rm.boot_obs[boot]))[2].numpy()
        saw["far"] |= bool(far.any())
        saw["near"] |= bool((~far).any())
        saw["truncated end"] |= len(boot) > 0
        before = [p.detach().double().clone() for p in agent.parameters()]
        beta_before = learner.beta
        stats = vr.train_step(learner, args)
        assert float(stats[0]) == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
        for p, p_before, textbook_p, (m, v) in zip(agent.parameters(), before, net.parameters(), moments):
            torch.testing.assert_close(p.grad.double(), textbook_p.grad, rtol=1e-4, atol=1e-6)
            m.mul_(0.9).add_(0.1 * textbook_p.grad)
            v.mul_(0.999).add_(0.001 * textbook_p.grad**2)
            m_hat = m / (1.0 - 0.9 ** (step + 1))
            v_hat = v / (1.0 - 0.999 ** (step + 1))
            expected = p_before - lr * m_hat / (v_hat.sqrt() + args.adam_eps)
            torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-6 * lr / 1e-3)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)
        assert rm.cmax == pytest.approx(cmax, rel=1e-12)
        # the write-back
        np.testing.assert_allclose(rm.rho[idx], rho, rtol=1e-4)
        np.testing.assert_allclose(rm.value[idx], value_before, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rm.boot_value[boot], boot_value, rtol=1e-4, atol=1e-5)
        if per == "rank":
            np.testing.assert_allclose(rm.priority[idx], priority, rtol=1e-4, atol=1e-6)
        stored_steps = np.flatnonzero(rm.valid)
        np.testing.assert_allclose(stored_qret(rm, stored_steps), textbook_memory_qret(rm)[stored_steps], rtol=1e-9, atol=1e-9)
        # Eq. (12) with the far fraction of the memory's latest rho
        stored = rm.rho[rm.valid]
        far_fraction = np.mean(~((stored > 1.0 / cmax) & (stored < cmax)))
        assert (far_fraction > args.D) == (args.D == 0.001)
        if refer == "none":
            assert learner.beta == 1.0
        elif far_fraction > args.D:
            assert learner.beta == pytest.approx((1.0 - args.beta_lr) * beta_before, rel=1e-12)
        else:
            assert learner.beta == pytest.approx((1.0 - args.beta_lr) * beta_before + args.beta_lr, rel=1e-12)
        assert learner.k == k + 1
    assert all(saw.values()), saw


def test_train_step_nan_guard():
    """train_step's NaN guard: a poisoned target raises FloatingPointError before the replay is touched (the main loop
    then stops with the reason); an overflowing D_KL(mu || pi) that is masked (rule 1) or of weight 0 (--refer none)
    does not stop the run."""
    rng = np.random.default_rng(14)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 30)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-4)

    def step(learner, refer):
        args = vr.Args(batch_size=16, buffer_size=300, refer=refer)
        return vr.train_step(learner, args)

    learner = cpu_learner(agent, opt, rm, rng, k=0, beta=0.5)
    assert torch.isfinite(step(learner, "full")).all() and learner.k == 1 and 0.5 < learner.beta < 0.51
    rm.mu_std[rm.valid] = 1e30  # sigma_mu^2 / sigma_pi^2 overflows float32: D_KL(mu || pi) = inf; log rho clips (far)
    for refer in ("rule1", "none"):
        stats = step(cpu_learner(agent, opt, rm, rng, k=1, beta=0.5), refer)
        assert torch.isfinite(stats[:3]).all() and torch.isinf(stats[3]), refer
    rm.mu_std[rm.valid] = 1.0
    rm.value[rm.valid] = np.nan  # V^tbc and Q^ret of every step become NaN
    rm.recompute()
    rho_before = rm.rho.copy()
    weights_before = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()
    adam_before = [{name: v.clone() for name, v in s.items()} for s in opt.state.values()]
    with pytest.raises(FloatingPointError, match="non-finite loss at gradient step 1"):
        step(learner, "full")
    np.testing.assert_array_equal(rm.rho, rho_before)
    assert learner.k == 1
    # the guard fires before the optimizer step: weights and Adam's moments are untouched (finite)
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(agent.parameters()), weights_before)
    for s, before in zip(opt.state.values(), adam_before):
        for name, value in before.items():
            torch.testing.assert_close(s[name], value)


@pytest.mark.parametrize(
    "refer,per", [("full", "none"), ("rule1", "none"), ("rule2", "none"), ("none", "none"), ("none", "rank"), ("full", "rank")]
)
def test_train_step_all_variants(refer, per):
    rng = np.random.default_rng(15)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 40)
    rm.update_reward_scale()
    args = vr.Args(batch_size=32, buffer_size=400, refer=refer, per=per, C=0.5)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-2)
    learner = cpu_learner(agent, opt, rm, rng, k=0, beta=1.0 if refer == "none" else 0.0)
    for _ in range(30):
        stats = vr.train_step(learner, args)
        assert torch.isfinite(stats).all()
    check_qret_consistent(rm)  # the refresh keeps Q^ret equal to the full recursion in every variant
    assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum())
    assert learner.k == 30
    assert (learner.beta == 1.0) if refer == "none" else (0.0 < learner.beta < 0.01)


def test_train_step_anneals_learning_rate_and_cmax():
    """Eq. (13) in train_step: gradient step k uses eta/(1 + A k) (a first Adam step moves each weight by about the
    learning rate) and c_max = 1 + C/(1 + A k) (the replay's far-policy count uses it)."""
    rng = np.random.default_rng(25)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 30)
    args = vr.Args(batch_size=16, buffer_size=300, learning_rate=1e-3, A=0.1, C=2.0)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-12)
    learner = cpu_learner(agent, opt, rm, rng, k=3, beta=0.5)
    before = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()
    vr.train_step(learner, args)
    moved = (torch.nn.utils.parameters_to_vector(agent.parameters()).detach() - before).abs().max()
    assert float(moved) == pytest.approx(vr.annealed_learning_rate(3, 1e-3, 0.1), rel=1e-3)  # 1e-3 / 1.3
    for k in range(4, 8):
        vr.train_step(learner, args)
        assert opt.param_groups[0]["lr"] == pytest.approx(vr.annealed_learning_rate(k, 1e-3, 0.1))
        assert rm.cmax == pytest.approx(vr.refer_cmax(k, 2.0, 0.1))
    assert learner.k == 8


def test_rank_per_step_weights_the_loss_and_writes_priorities_back():
    """--per rank in train_step: the loss is the one weighted by the batch's IS weights, and the sampled steps'
    priorities become |rho-bar (Q^ret - V)| of this step (the next re-sort ranks by them)."""
    rng = np.random.default_rng(26)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 40)
    rm.update_reward_scale()
    rm.priority[rm.valid] = rng.uniform(0.1, 2.0, rm.valid.sum())
    rm.per_rebuild()
    args = vr.Args(batch_size=32, buffer_size=400, per="rank", A=0.1)
    torch.manual_seed(3)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    learner = cpu_learner(agent, opt, rm, rng, k=2, beta=0.5)
    # the batch train_step will draw (the same generator state) and the loss it should minimise
    beta_is = min(1.0, args.per_beta0 + (1.0 - args.per_beta0) * args.A * 2)
    idx, w = rm.sample_per(args.batch_size, copy.deepcopy(rng), beta_is)
    assert w.min() < 0.9  # weights that matter
    act = torch.as_tensor(rm.action[idx])
    mu_mean = torch.as_tensor(rm.mu_mean[idx])
    mu_std = torch.as_tensor(rm.mu_std[idx])
    qret = torch.as_tensor(rm.qret_at(idx), dtype=torch.float32)
    with torch.no_grad():
        mean, std, value = agent(torch.as_tensor(rm.obs[idx]))
    cmax = vr.refer_cmax(2, args.C, args.A)
    weights = torch.as_tensor(w, dtype=torch.float32)
    weighted, info = vr.refer_loss(mean, std, value, vr.Batch(act, mu_mean, mu_std, qret, weights), 0.5, cmax)
    unweighted, _ = vr.refer_loss(mean, std, value, vr.Batch(act, mu_mean, mu_std, qret), 0.5, cmax)
    assert abs(float(weighted) - float(unweighted)) > 0.01 * abs(float(unweighted))
    stats = vr.train_step(learner, args)
    assert float(stats[0]) == pytest.approx(float(weighted), rel=1e-5)
    np.testing.assert_allclose(rm.priority[idx], info["abs_err"].double().numpy(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# 5. the learner's turn
def test_learn_updates_statistics_every_stats_every_steps_then_publishes():
    """`learn`, the main loop's LEARN phase: gradient steps while k < (t - t0)/F (at most GRAD_STEPS_PER_READ); at
    k = stats_every, first the reward scale (Eq. (16)), the PER re-sort and the state statistics (--state-stats-rate);
    after the steps the new weights are published to the actors."""
    rng = np.random.default_rng(27)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 40)
    scale_before = rm.update_reward_scale()
    rm.reward[rm.valid] *= 10.0  # the next reward-scale update must see this
    args = vr.Args(batch_size=16, buffer_size=400, stats_every=5, state_stats_rate=0.5, per="rank")
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    obs_mean = torch.zeros(3)
    obs_std = torch.ones(3)
    learner = vr.Learner(agent, opt, rm, obs_mean, obs_std, rng, torch.device("cpu"), k=0, beta=0.0)
    step_stats = MetricAverager()
    published = []  # the weights each publish() hands to the actors

    def weights():
        return torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()

    def learn_until(steps_due):
        return vr.learn(learner, args, steps_due, step_stats, lambda: published.append(weights()))

    initial = weights()
    assert learn_until(5) == 5 and learner.k == 5
    assert rm.reward_scale == scale_before  # not yet: the update comes before gradient step k = stats_every
    assert len(published) == 1 and not torch.equal(published[0], initial)
    torch.testing.assert_close(published[0], weights())  # the weights after the steps
    assert torch.isfinite(torch.tensor(list(step_stats.sums.values()))).all() and step_stats.sums["losses/loss"] != 0
    fill(rm, rng, 2)  # new steps, unranked until the re-sort
    assert learn_until(5.5) == 1 and learner.k == 6 and len(published) == 2
    torch.testing.assert_close(published[1], weights())
    r = rm.reward[rm.valid]
    assert rm.reward_scale == pytest.approx(np.sqrt(np.mean(r * r)) + 1e-7)
    np.testing.assert_allclose(rm.scaled_reward[rm.valid], r / rm.reward_scale)
    assert rm.ranked[rm.valid].all()  # re-sorted
    target_mean, target_std = rm.state_stats()
    torch.testing.assert_close(obs_mean, 0.5 * torch.as_tensor(target_mean, dtype=torch.float32))
    torch.testing.assert_close(obs_std, 1.0 + 0.5 * (torch.as_tensor(target_std, dtype=torch.float32) - 1.0))
    assert learn_until(6) == 0 and len(published) == 2  # nothing due: no step, nothing published
    assert learn_until(1e9) == vr.GRAD_STEPS_PER_READ  # then the rings are read again


def test_state_statistics_stay_frozen_with_rate_zero():
    """Clause 5, the default --state-stats-rate 0: the stats_every updates rescale the rewards but leave the state
    mean and std the learner standardises with (and publishes) exactly as they were (App. B: frozen)."""
    rng = np.random.default_rng(32)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 40)
    rm.update_reward_scale()
    args = vr.Args(batch_size=16, buffer_size=400, stats_every=3)
    assert args.state_stats_rate == 0.0
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    obs_mean = torch.tensor([0.5, -0.5, 0.1])
    obs_std = torch.tensor([2.0, 0.5, 1.0])
    learner = vr.Learner(agent, opt, rm, obs_mean, obs_std, rng, torch.device("cpu"), k=0, beta=0.0)
    rm.reward[rm.valid] *= 4.0
    assert vr.learn(learner, args, 10, MetricAverager(), lambda: None) == 10
    r = rm.reward[rm.valid]
    assert rm.reward_scale == pytest.approx(np.sqrt(np.mean(r * r)) + 1e-7)
    torch.testing.assert_close(obs_mean, torch.tensor([0.5, -0.5, 0.1]), rtol=0, atol=0)
    torch.testing.assert_close(obs_std, torch.tensor([2.0, 0.5, 1.0]), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# 6. evaluation
def test_evaluate_standardises_the_state(monkeypatch):
    """`evaluate` acts with the mean action of the standardised state (s - mean) / std (Eqs. (14)-(15)), as the
    network was trained; the direct rollout here is written from that."""
    from common.mujoco_env import make_mujoco_env

    limit = 30
    seed = 7
    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=limit))
    torch.manual_seed(2)
    agent = vr.Agent(11, 3)
    with torch.no_grad():
        agent.out.weight.mul_(30.0)  # actions that depend clearly on the state
    rng = np.random.default_rng(28)
    obs_mean = torch.tensor(rng.normal(size=11), dtype=torch.float32)
    obs_std = torch.tensor(rng.uniform(0.2, 0.5, 11), dtype=torch.float32)
    returns = vr.evaluate(agent, "Hopper-v5", seed, 2, obs_mean, obs_std, torch.device("cpu"))
    env = make_mujoco_env("Hopper-v5", seed, max_episode_steps=limit)
    low = env.action_space.low.astype(np.float64)
    high = env.action_space.high.astype(np.float64)
    expected = []
    for episode in range(2):
        obs, _ = env.reset(seed=seed + episode)
        done = False
        ret = 0.0
        while not done:
            standardised = (torch.as_tensor(obs, dtype=torch.float32) - obs_mean) / obs_std
            with torch.no_grad():
                action = agent(standardised[None])[0][0].numpy().astype(np.float64)
            obs, r, term, trunc, _ = env.step(vr.to_env_action(action, low, high))
            ret += float(r)
            done = term or trunc
        expected.append(ret)
    np.testing.assert_allclose(returns, expected, rtol=1e-9)
    raw = vr.evaluate(agent, "Hopper-v5", seed, 2, torch.zeros(11), torch.ones(11), torch.device("cpu"))
    assert np.abs(np.array(raw) - expected).max() > 0.01  # the standardisation changes the returns here


# ----------------------------------------------------------------------------------------------------------------
# 7. what a resume restores
def learner_for_resume(seed, args, obs_dim=3, act_dim=2):
    """A learner as `__main__` builds one before `restore_run` (its own initial weights, generator and statistics)."""
    torch.manual_seed(seed)
    agent = vr.Agent(obs_dim, act_dim)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps, foreach=True)
    replay = vr.EpisodeReplay(args.buffer_size, obs_dim, act_dim, args.gamma, max_episode_len=40, per_alpha=args.per_alpha)
    rng = np.random.default_rng(seed)
    zeros = torch.zeros(obs_dim)
    ones = torch.ones(obs_dim)
    return vr.Learner(agent, optimizer, replay, zeros, ones, rng, torch.device("cpu"), k=0, beta=args.beta_init)


def saved_and_loaded(ckpt):
    """What torch.save writes and torch.load reads back (the checkpoint file)."""
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("per", ["none", "rank"])
def test_a_restored_learner_continues_exactly(per):
    """Clause 7: `checkpoint_contents` + `restore_run` (with a memory, learning started) give a learner whose next
    learner turns (gradient steps, a reward-scale update, a PER re-sort, draws between two re-sorts) equal the
    uninterrupted learner's bit for bit: weights, Adam, every array of the memory, k, beta and the sampler's generator;
    the global RNGs are the checkpoint's."""
    args = vr.Args(batch_size=16, buffer_size=300, per=per, stats_every=7, checkpoint_replay=True, learning_rate=1e-3)
    rng = np.random.default_rng(33)
    learner = learner_for_resume(1, args)
    fill(learner.replay, rng, 30)
    learner.replay.update_reward_scale()
    learner.obs_mean.copy_(torch.tensor([0.1, 0.2, -0.3]))
    learner.obs_std.copy_(torch.tensor([1.1, 0.9, 2.0]))
    step_stats = MetricAverager()
    vr.learn(learner, args, 12, step_stats, lambda: None)
    fill(learner.replay, rng, 2)  # steps stored since the last PER re-sort: unranked
    ckpt = vr.checkpoint_contents(args, learner, global_step=1234, t0=56, started=True, stats_ready=True)
    ckpt = saved_and_loaded({"rng": rng_state(), "global_step": 1234, **ckpt})
    uninterrupted = copy.deepcopy(learner)
    vr.learn(uninterrupted, args, 30, step_stats, lambda: None)
    torch.manual_seed(99)  # the resumed process's own global RNG states, replaced by the checkpoint's
    resumed = learner_for_resume(2, args)
    assert vr.restore_run(ckpt, args, resumed) == (1234, 56, True, True)
    assert rng_state()["torch"].equal(ckpt["rng"]["torch"]) and rng_state()["python"] == ckpt["rng"]["python"]
    vr.learn(resumed, args, 30, step_stats, lambda: None)
    assert (resumed.k, resumed.beta) == (uninterrupted.k, uninterrupted.beta) and resumed.k == 30
    for p, q in zip(resumed.agent.parameters(), uninterrupted.agent.parameters()):
        assert torch.equal(p, q)
    for s, t in zip(resumed.optimizer.state.values(), uninterrupted.optimizer.state.values()):
        assert all(torch.equal(s[name], t[name]) for name in s)
    for name in vr.EpisodeReplay.FIELDS:
        # the derived maps only where a step is stored
        slots = resumed.replay.valid if name in vr.EpisodeReplay.NOT_SAVED else slice(None)
        resumed_field = getattr(resumed.replay, name)[slots]
        np.testing.assert_array_equal(resumed_field, getattr(uninterrupted.replay, name)[slots], err_msg=name)
    assert resumed.rng.bit_generator.state == uninterrupted.rng.bit_generator.state
    torch.testing.assert_close(resumed.obs_mean, uninterrupted.obs_mean, rtol=0, atol=0)


def test_resume_applies_adam_eps_the_learning_rate_and_the_per_exponent_of_its_command_line():
    """Clause 7 with applied flags: `restore_run` keeps the checkpoint's Adam moments but sets this run's --adam-eps
    (load_state_dict brings back the checkpoint's) and the learning rate of this run's schedule at k; the restored
    memory keeps its PER sort and draws by this run's --per-alpha: P(rank 2) / P(rank 1) = 2^-alpha."""
    args = vr.Args(batch_size=16, buffer_size=300, checkpoint_replay=True, per="rank")
    rng = np.random.default_rng(34)
    learner = learner_for_resume(1, args)
    fill(learner.replay, rng, 30)
    vr.learn(learner, args, 5, MetricAverager(), lambda: None)
    ckpt = vr.checkpoint_contents(args, learner, global_step=500, t0=0, started=True, stats_ready=True)
    ckpt = saved_and_loaded({"rng": rng_state(), "global_step": 500, **ckpt})
    changed = vr.Args(batch_size=16, buffer_size=300, adam_eps=1e-3, learning_rate=3e-4, A=0.01, per="rank", per_alpha=0.9)
    resumed = learner_for_resume(2, changed)
    vr.restore_run(ckpt, changed, resumed)
    group = resumed.optimizer.param_groups[0]
    assert group["eps"] == 1e-3 and group["lr"] == pytest.approx(3e-4 / (1.0 + 0.01 * 5))
    for s, t in zip(resumed.optimizer.state.values(), learner.optimizer.state.values()):
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["step"], t["step"])
    np.testing.assert_array_equal(resumed.replay.per_order, learner.replay.per_order)
    vr.train_step(resumed, changed)
    rank_prob = resumed.replay.per_rank_prob
    assert rank_prob[1] / rank_prob[0] == pytest.approx(2.0**-0.9, rel=1e-12)


def test_a_checkpoint_from_before_learning_keeps_its_memory_and_waits_for_N_start():
    """Clause 7 before learning starts: with --checkpoint-replay the memory collected so far is in the checkpoint;
    `restore_run` puts it back with `started` False and the state statistics not yet computed, and the run collects
    only the N_start - stored samples still missing before its first gradient step (without the memory: N_start);
    a checkpoint of a memory learning has started on learns at once."""
    args = vr.Args(batch_size=16, buffer_size=300, learning_starts=300, checkpoint_replay=True)
    rng = np.random.default_rng(35)
    learner = learner_for_resume(1, args)
    while learner.replay.size < 150:
        fill(learner.replay, rng, 1)
    ckpt = vr.checkpoint_contents(args, learner, global_step=170, t0=0, started=False, stats_ready=False)
    ckpt = saved_and_loaded({"rng": rng_state(), "global_step": 170, **ckpt})
    assert vr.steps_before_learning(ckpt, args) == 300 - learner.replay.size
    resumed = learner_for_resume(2, args)
    assert vr.restore_run(ckpt, args, resumed) == (170, 0, False, False)
    assert resumed.replay.size == learner.replay.size and list(resumed.replay.episodes) == list(learner.replay.episodes)
    np.testing.assert_array_equal(resumed.replay.obs, learner.replay.obs)
    assert vr.steps_before_learning({**ckpt, "replay": None}, args) == 300
    assert vr.steps_before_learning({**ckpt, "started": True}, args) == 0
    assert vr.steps_before_learning(None, args) == 300

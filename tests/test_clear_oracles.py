"""clear_impala.py, the method's pieces against their papers: V-trace against a slow textbook implementation of IMPALA
Eq. (1) and published numbers, truncation vs termination, the importance weights, reservoir sampling (uniform
inclusion, whole unrolls, restore), pair selection (--replay-fraction), the behavioural-cloning losses, the task of each
actor per mode, the buffer's size, and the forgetting statistics (CLEAR App. C). The loop's contract is in
tests/test_clear_loop.py."""

import json
import math
import queue

import numpy as np
import pytest
import torch
from clear_helpers import act_like_an_actor, chi2_upper, textbook_cumulative_return, textbook_vtrace, unroll_with_id

import clear_impala as ci


# ----------------------------------------------------------------------------------------------------------------
# V-trace
@pytest.mark.parametrize("clips", [(1.0, 1.0), (3.7, 2.2), (None, None)])
def test_vtrace_matches_textbook(clips):
    rng = np.random.default_rng(0)
    for case in range(40):
        T = rng.integers(1, 9)
        B = rng.integers(1, 5)
        log_rhos = rng.normal(0, 1.5, (T, B))
        discounts = 0.99 * (rng.random((T, B)) > 0.25)  # episode ends inside the unroll
        rewards = rng.normal(0, 2, (T, B))
        values = rng.normal(0, 2, (T, B))
        bootstrap = rng.normal(0, 2, B)
        out = ci.vtrace_from_importance_weights(
            *(torch.tensor(x) for x in (log_rhos, discounts, rewards, values, bootstrap)),
            clip_rho_threshold=clips[0],
            clip_pg_rho_threshold=clips[1],
        )
        vs, adv = textbook_vtrace(log_rhos, discounts, rewards, values, bootstrap, *clips)
        np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-6, atol=1e-6, err_msg=f"case {case}")
        np.testing.assert_allclose(out.pg_advantages.numpy(), adv, rtol=1e-6, atol=1e-6, err_msg=f"case {case}")


def test_vtrace_torchbeast_fixed_inputs():
    """torchbeast/scalable_agent's test inputs (rho in [0.08, 12.2), clips 3.7 / 2.2) against the textbook."""
    for B in (1, 5):
        T = 5
        n = B * T
        log_rhos = 5 * (np.arange(n, dtype=np.float64).reshape(T, B) / n - 0.5)
        discounts = np.stack([np.full(B, 0.9) / (np.arange(B) + 1)] * T)
        rewards = np.arange(n, dtype=np.float64).reshape(T, B)
        values = np.arange(n, dtype=np.float64).reshape(T, B) / B
        bootstrap = np.arange(B, dtype=np.float64) + 1
        out = ci.vtrace_from_importance_weights(
            *(torch.tensor(x) for x in (log_rhos, discounts, rewards, values, bootstrap)), 3.7, 2.2
        )
        vs, adv = textbook_vtrace(log_rhos, discounts, rewards, values, bootstrap, 3.7, 2.2)
        np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(out.pg_advantages.numpy(), adv, rtol=1e-6, atol=1e-5)


def test_vtrace_rlax_reference_numbers():
    """rlax's published expectations (discount 0 at t=0 of batch 0), converted to time-major."""
    bl = np.array([[[8.9, 0.7], [5.0, 1.0], [0.6, 0.1], [-0.9, -0.1]], [[0.3, -5.0], [1.0, -8.0], [0.3, 1.7], [4.7, 3.3]]])
    tl = np.array([[[0.4, 0.5], [9.2, 8.8], [0.7, 4.4], [7.9, 1.4]], [[1.0, 0.9], [1.0, -1.0], [-4.3, 8.7], [0.8, 0.3]]])
    actions = np.array([[0, 1, 0, 0], [1, 0, 0, 1]])
    rewards = np.array([[-1.3, -1.3, 2.3, 42.0], [1.3, 5.3, -3.3, -5.0]])
    discounts = np.array([[0.0, 0.89, 0.85, 0.99], [0.88, 1.0, 0.83, 0.95]])
    values = np.array([[2.1, 1.1, -3.1, 0.0], [3.1, 0.1, -1.1, 7.4]])
    bootstrap = np.array([8.4, -1.2])
    logp = lambda lg: np.take_along_axis(lg - np.log(np.exp(lg).sum(-1, keepdims=True)), actions[..., None], -1)[..., 0]  # noqa
    log_rhos = logp(tl) - logp(bl)
    out = ci.vtrace_from_importance_weights(
        *(torch.tensor(x.T if x.ndim == 2 else x) for x in (log_rhos, discounts, rewards, values, bootstrap))
    )
    exp_td = np.array([[-1.6155143, -3.4973226, 1.8670533, 50.316002], [1.4662437, 3.6116405, -8.3327293e-5, -13.54]])
    exp_pg = np.array([[-1.6155143, -3.4973226, 1.8670534, 50.316002], [1.4662433, 3.6116405, -8.3369283e-5, -13.54]])
    np.testing.assert_allclose((out.vs.numpy() - values.T).T, exp_td, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(out.pg_advantages.numpy().T, exp_pg, rtol=1e-3, atol=1e-5)


def test_vtrace_no_value_leaks_across_episode_end():
    rng = np.random.default_rng(1)
    # the episode ends with the action at t = k
    T = 10
    B = 3
    k = 4
    args = [torch.tensor(rng.normal(size=(T, B))) for _ in range(4)] + [torch.tensor(rng.normal(size=B))]
    args[1] = torch.full((T, B), 0.99, dtype=torch.float64)
    args[1][k] = 0.0
    a = ci.vtrace_from_importance_weights(*args)
    changed = [x.clone() for x in args]
    changed[2][k + 1 :] += 100.0  # rewards of the next episode
    changed[3][k + 1 :] -= 50.0  # values of the next episode
    changed[4] += 7.0  # bootstrap
    b = ci.vtrace_from_importance_weights(*changed)
    np.testing.assert_allclose(a.vs[: k + 1].numpy(), b.vs[: k + 1].numpy())
    np.testing.assert_allclose(a.pg_advantages[: k + 1].numpy(), b.pg_advantages[: k + 1].numpy())
    assert not np.allclose(a.vs[k + 1 :].numpy(), b.vs[k + 1 :].numpy())  # the test can fail


def test_vtrace_rejects_bad_bootstrap_shape():
    with pytest.raises(ValueError):
        ci.vtrace_from_importance_weights(
            torch.zeros(5, 2), torch.zeros(5, 2), torch.zeros(5, 2), torch.zeros(5, 2), torch.zeros(5, 2)
        )


def make_aligned(T, B, A, **over):
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    fields = dict(
        target_logits=z(T, B, A),
        values=z(T, B),
        bootstrap_value=z(B),
        behaviour_logits=z(T, B, A),
        behaviour_values=z(T, B),
        actions=torch.zeros(T, B, dtype=torch.int64),
        rewards=z(T, B),
        done=torch.zeros(T, B, dtype=torch.bool),
        truncated=torch.zeros(T, B, dtype=torch.bool),
        final_value=z(T, B),
    )
    fields.update(over)
    return ci.AlignedUnroll(**fields)


def test_truncation_bootstraps_from_final_value_and_termination_does_not():
    T = 6
    B = 2
    A = 3
    k = 2
    values = torch.arange(T * B, dtype=torch.float32).view(T, B)
    rewards = torch.ones(T, B)
    done = torch.zeros(T, B, dtype=torch.bool)
    done[k] = True
    truncated = torch.zeros(T, B, dtype=torch.bool)
    truncated[k, 0] = True  # column 0: time limit; column 1: real termination
    final_value = torch.full((T, B), 5.0)
    u = make_aligned(
        T,
        B,
        A,
        values=values,
        rewards=rewards,
        done=done,
        truncated=truncated,
        final_value=final_value,
        bootstrap_value=torch.full((B,), 3.0),
    )
    _, _, _, vt = ci.impala_losses(u, 0.9, 1.0, 1.0)  # on-policy: rho = c = 1
    assert vt.vs[k, 0] == pytest.approx(1.0 + 0.9 * 5.0)  # r + gamma V(x_final), the next episode not used
    assert vt.vs[k, 1] == pytest.approx(1.0)  # termination: r only
    assert vt.pg_advantages[k, 0] == pytest.approx(1.0 + 0.9 * 5.0 - float(values[k, 0]))
    # --no-bootstrap-truncation: a time limit is a termination (IMPALA/monobeast), the final value is ignored
    _, _, _, vt_term = ci.impala_losses(u, 0.9, 1.0, 1.0, bootstrap_truncation=False)
    assert vt_term.vs[k, 0] == pytest.approx(1.0) and vt_term.vs[k, 1] == pytest.approx(1.0)
    assert torch.allclose(vt_term.vs[k + 1 :], vt.vs[k + 1 :])  # the next episode is the same either way


def test_truncated_importance_weights_are_min_one_pi_over_mu_of_the_taken_action():
    T = 4
    B = 3
    A = 5
    g = torch.Generator().manual_seed(0)
    target = torch.randn(T, B, A, generator=g)
    behaviour = torch.randn(T, B, A, generator=g)
    actions = torch.randint(0, A, (T, B), generator=g)
    u = make_aligned(T, B, A, target_logits=target, behaviour_logits=behaviour, actions=actions)
    rho, mu_taken = ci.truncated_importance_weights(u)
    for t in range(T):
        for b in range(B):
            a = int(actions[t, b])
            mu = float(torch.softmax(behaviour[t, b], 0)[a])
            ratio = float(torch.softmax(target[t, b], 0)[a]) / mu
            assert float(rho[t, b]) == pytest.approx(min(1.0, ratio), rel=1e-5)
            assert float(mu_taken[t, b]) == pytest.approx(mu, rel=1e-5)
    assert (rho < 1).any() and (rho == 1).any()  # the random case exercises both sides of the truncation
    on_policy = make_aligned(T, B, A, target_logits=target, behaviour_logits=target, actions=actions)
    assert torch.allclose(ci.truncated_importance_weights(on_policy)[0], torch.ones(T, B))


def test_replay_importance_weights_are_the_mean_rho_of_confident_replayed_steps_per_source_task():
    """The replay/<task>/importance_weight diagnostic (ReplayImportanceWeights) over two batches, slowly: per task a
    replay unroll came from, the mean of min(1, pi/mu) over the replayed steps whose stored action had mu >= 0.5; new
    columns (halves 0) and less confident steps are left out, a task without such steps has no entry, and the sums
    start over after each means()."""
    T = 6
    B = 4
    A = 3
    g = torch.Generator().manual_seed(2)
    names = ["task_a", "task_b", "task_c"]
    weights = ci.ReplayImportanceWeights(len(names), torch.device("cpu"))
    # column 1 is new: its replay_task -1 would fall on task 0 (clamped) if it were counted; task 2 is never replayed
    halves = torch.tensor([1, 0, 1, 1])
    replay_task = torch.tensor([1, -1, 0, 1])
    rho_of_task = {0: [], 1: []}
    for _ in range(2):
        # behaviour logits spread wide, so that mu >= 0.5 on some steps and not on others
        behaviour = 3 * torch.randn(T, B, A, generator=g)
        target = torch.randn(T, B, A, generator=g)
        actions = torch.randint(0, A, (T, B), generator=g)
        weights.add(
            make_aligned(T, B, A, target_logits=target, behaviour_logits=behaviour, actions=actions), halves, replay_task
        )
        for t in range(T):
            for b in range(B):
                a = int(actions[t, b])
                mu = float(torch.softmax(behaviour[t, b], 0)[a])
                if halves[b] and mu >= 0.5:
                    rho_of_task[int(replay_task[b])].append(min(1.0, float(torch.softmax(target[t, b], 0)[a]) / mu))
    assert all(len(rhos) > 1 for rhos in rho_of_task.values())
    means = weights.means(names)
    assert set(means) == {"replay/task_a/importance_weight", "replay/task_b/importance_weight"}
    for task, rhos in rho_of_task.items():
        assert means[f"replay/{names[task]}/importance_weight"] == pytest.approx(np.mean(rhos), rel=1e-5)
    assert weights.means(names) == {}


# ----------------------------------------------------------------------------------------------------------------
# Reservoir buffer
def test_reservoir_keeps_a_uniform_sample():
    cap = 8
    n_unrolls = 40
    reps = 1500
    counts = np.zeros(n_unrolls)
    rng = np.random.default_rng(0)
    unrolls = [unroll_with_id(i) for i in range(n_unrolls)]
    for _ in range(reps):
        buf = ci.ReservoirBuffer(cap, (2, 2), 2, 3, rng)
        for i in range(n_unrolls):
            buf.add(unrolls[i], task=0)
        assert buf.size == cap and buf.num_seen == n_unrolls
        counts[buf.data["reward"][:, 0].astype(int)] += 1
    expected = reps * cap / n_unrolls
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < chi2_upper(n_unrolls - 1), f"inclusion counts not uniform: chi2 {chi2:.1f}"
    # and it CAN fail: a FIFO ring (keeps the last cap unrolls) is far from uniform
    fifo = np.zeros(n_unrolls)
    fifo[-cap:] = reps
    assert ((fifo - expected) ** 2 / expected).sum() > chi2_upper(n_unrolls - 1)


def test_reservoir_stores_whole_unrolls_only():
    rng = np.random.default_rng(1)
    buf = ci.ReservoirBuffer(5, (3, 3), 4, 6, rng)
    for i in range(200):
        row = buf.add(unroll_with_id(i, T=6, obs_shape=(3, 3), A=4), task=i % 3)
        if row >= 0:
            assert buf.task[row] == i % 3
    for row in range(buf.size):  # every field of every time step of a stored row comes from the same unroll
        ids = {
            int(np.unique(buf.data[k][row].astype(np.int64)).item())
            for k in ci.UNROLL_FIELDS
            if k not in ("done", "truncated")
        }
        assert len(ids) == 1
    assert buf.data["obs"].dtype == np.uint8
    assert all(0 <= buf.sample() < buf.size for _ in range(100))


def test_reservoir_fills_before_replacing():
    buf = ci.ReservoirBuffer(4, (1,), 2, 2, np.random.default_rng(2))
    rows = [buf.add(unroll_with_id(i, T=2, obs_shape=(1,)), 0) for i in range(4)]
    assert rows == [0, 1, 2, 3]
    assert buf.size == 4
    assert (buf.keys >= 0).all()


def test_reservoir_load_keeps_the_largest_keys_and_continues_its_stream(tmp_path):
    T = 2
    obs_shape = (2, 2)
    original = ci.ReservoirBuffer(6, obs_shape, 2, T, np.random.default_rng(0))
    for i in range(20):
        original.add(unroll_with_id(i, T, obs_shape), task=i % 3)
    path = str(tmp_path / "replay.npz")
    original.save(path)
    smaller = ci.ReservoirBuffer(4, obs_shape, 2, T, np.random.default_rng(99))
    assert smaller.load(path) == 4 and smaller.num_seen == 20
    largest = np.sort(original.keys)[-4:]
    assert np.array_equal(np.sort(smaller.keys[:4]), largest)
    for row in range(4):  # each kept row's unroll and task came with its key
        source = int(np.flatnonzero(original.keys == smaller.keys[row])[0])
        assert smaller.task[row] == original.task[source]
        assert np.array_equal(smaller.data["obs"][row], original.data["obs"][source])
    # same capacity: the restored buffer takes the same keep/drop decisions as the original would have
    same = ci.ReservoirBuffer(6, obs_shape, 2, T, np.random.default_rng(99))
    same.load(path)
    for i in range(20, 40):
        kept = same.add(unroll_with_id(i, T, obs_shape), 0) >= 0
        assert kept == (original.add(unroll_with_id(i, T, obs_shape), 0) >= 0), i
    assert np.array_equal(np.sort(same.keys), np.sort(original.keys))


def test_a_restored_buffer_grows_only_while_it_has_dropped_nothing(tmp_path):
    """Clause R5, ReservoirBuffer.load: a buffer loaded into a larger capacity (a resume whose --buffer-size -1
    follows a higher --num-cycles) stays a uniform sample only if it never dropped an unroll: the larger sample of
    everything offered would hold some it no longer has. One that has dropped none (6 rows of 6 offered) grows and
    continues exactly as an uninterrupted buffer of the larger capacity fed the same stream; one that has (6 of 9)
    is refused by load, and by saved_counts' numbers at start-up (tests/test_clear_runs.py)."""
    T = 2
    obs_shape = (2, 2)
    unrolls = [unroll_with_id(i, T, obs_shape) for i in range(30)]
    path = str(tmp_path / "replay.npz")
    full = ci.ReservoirBuffer(6, obs_shape, 2, T, np.random.default_rng(5))
    for i in range(6):
        full.add(unrolls[i], task=0)
    full.save(path)
    assert ci.ReservoirBuffer.saved_counts(path) == (6, 6)
    grown = ci.ReservoirBuffer(10, obs_shape, 2, T, np.random.default_rng(99))
    assert grown.load(path) == 6
    uninterrupted = ci.ReservoirBuffer(10, obs_shape, 2, T, np.random.default_rng(5))
    for i in range(6):
        uninterrupted.add(unrolls[i], task=0)
    for i in range(6, 30):
        assert (grown.add(unrolls[i], 0) >= 0) == (uninterrupted.add(unrolls[i], 0) >= 0), i
    # the same unrolls under the same keys (in other rows: a loaded buffer's rows are in key order)
    grown_order = np.argsort(grown.keys)
    uninterrupted_order = np.argsort(uninterrupted.keys)
    assert np.array_equal(grown.keys[grown_order], uninterrupted.keys[uninterrupted_order])
    assert np.array_equal(grown.data["obs"][grown_order], uninterrupted.data["obs"][uninterrupted_order])
    for i in range(6, 9):
        full.add(unrolls[i], task=0)
    full.save(path)
    assert ci.ReservoirBuffer.saved_counts(path) == (6, 9)
    with pytest.raises(ValueError, match="holds 6 of the 9 unrolls"):
        ci.ReservoirBuffer(10, obs_shape, 2, T, np.random.default_rng(99)).load(path)
    assert ci.ReservoirBuffer(6, obs_shape, 2, T, np.random.default_rng(99)).load(path) == 6


# ----------------------------------------------------------------------------------------------------------------
# Pair selection (--replay-fraction)
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.3, 1.0])
def test_select_pairs_honours_replay_fraction(ratio):
    rng = np.random.default_rng(0)
    B = 32
    fracs = []
    for _ in range(2000):
        which = ci.select_pairs(np.ones(B, dtype=bool), ratio, rng)
        assert set(np.unique(which)) <= {0, 1}
        assert math.floor(ratio * B) <= which.sum() <= math.ceil(ratio * B)
        fracs.append(which.mean())
    assert np.mean(fracs) == pytest.approx(ratio, abs=2e-3)


def test_select_pairs_never_takes_invalid_replay():
    rng = np.random.default_rng(0)
    valid = np.array([True, False, True, False])
    for _ in range(200):
        which = ci.select_pairs(valid, 1.0, rng)
        assert (which[~valid] == 0).all() and (which[valid] == 1).all()
    assert ci.select_pairs(np.zeros(4, bool), 0.5, rng).sum() == 0


def test_select_pairs_spreads_positions():
    rng = np.random.default_rng(3)
    hits = sum(ci.select_pairs(np.ones(8, bool), 0.25, rng) for _ in range(4000))
    assert hits.min() > 0.8 * hits.mean()  # every pair position gets replay


# ----------------------------------------------------------------------------------------------------------------
# Behavioural cloning
def test_cloning_losses_zero_when_policy_equals_behaviour():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 6, generator=g)
    values = torch.randn(5, 4, generator=g)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert ci.policy_cloning_loss(logits, logits.clone(), mask).abs() < 1e-6
    assert ci.value_cloning_loss(values, values.clone(), mask) == 0
    other = torch.randn(5, 4, 6, generator=g)
    assert ci.policy_cloning_loss(other, logits, mask) > 0.1
    assert ci.value_cloning_loss(values + 1, values, mask) == pytest.approx(5 * 3)
    # KL(mu || pi), not KL(pi || mu)
    mu = torch.log_softmax(logits, -1)
    pi = torch.log_softmax(other, -1)
    kl = (mu.exp() * (mu - pi)).sum(-1)
    assert ci.policy_cloning_loss(other, logits, mask) == pytest.approx(float((kl * mask).sum()), rel=1e-5)


def test_cloning_only_on_replay_columns():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 3, 4, generator=g)
    b = torch.randn(5, 3, 4, generator=g)
    assert ci.policy_cloning_loss(a, b, torch.zeros(3)) == 0
    assert ci.value_cloning_loss(a[..., 0], b[..., 0], torch.zeros(3)) == 0


def test_cloning_is_time_aligned_with_learner_outputs():
    torch.manual_seed(0)
    T = 5
    B = 3
    obs_shape = (7, 7, 3)
    model = ci.Agent(obs_shape, 7, "minigrid")
    with torch.no_grad():
        model.policy.weight.mul_(300.0)  # a peaked policy, so that a one-step misalignment shows
    batch = act_like_an_actor(model, T, B, obs_shape)
    logits_all, values_all = model(batch["obs"].reshape(-1, *obs_shape))
    logits_all = logits_all.view(T + 1, B, 7)
    values_all = values_all.view(T + 1, B)
    args = ci.Args()
    _, parts = ci.clear_loss(logits_all, values_all, {k: v for k, v in batch.items() if k != "obs"}, torch.ones(B), args)
    assert parts["losses/policy_cloning_loss"].abs() < 1e-5
    assert parts["losses/value_cloning_loss"].abs() < 1e-8
    # the same policy scored on-policy: rho = 1 everywhere (the V-trace log-rhos use the same alignment)
    u = ci.align_unroll(logits_all, values_all, batch)
    assert torch.allclose(u.target_logits, u.behaviour_logits, atol=1e-6)
    # continual_rl's off-by-one (stored rows 0..T vs learner rows 0..T) is NOT zero: the test can fail
    off = ci.policy_cloning_loss(logits_all[1:], batch["logits"][1:], torch.ones(B))
    assert off > 0.1
    assert ci.value_cloning_loss(values_all[1:], batch["baseline"][1:], torch.ones(B)) > 1e-3


def test_behaviour_cloning_flag_changes_total_loss_only_via_cloning():
    torch.manual_seed(0)
    T = 4
    B = 2
    obs_shape = (7, 7, 3)
    actor = ci.Agent(obs_shape, 7, "minigrid")
    learner = ci.Agent(obs_shape, 7, "minigrid")
    batch = act_like_an_actor(actor, T, B, obs_shape)
    lg, v = learner(batch["obs"].reshape(-1, *obs_shape))
    lg = lg.view(T + 1, B, 7)
    v = v.view(T + 1, B)
    rest = {k: x for k, x in batch.items() if k != "obs"}
    on, p_on = ci.clear_loss(lg, v, rest, torch.tensor([1.0, 0.0]), ci.Args())
    off, _ = ci.clear_loss(lg, v, rest, torch.tensor([1.0, 0.0]), ci.Args(behavior_cloning=False))
    extra = 0.01 * p_on["losses/policy_cloning_loss"] + 0.005 * p_on["losses/value_cloning_loss"]
    assert (on - off).item() == pytest.approx(extra.item(), rel=1e-4, abs=1e-6)
    assert float(extra) > 0


# ----------------------------------------------------------------------------------------------------------------
# Tasks, buffer size, forgetting statistics
def test_task_switch_at_designated_step_for_all_actors():
    args = ci.Args(env_ids=["a", "b", "c"], steps_per_task=1000, num_cycles=2)
    for actor in range(5):
        assert [ci.task_for_actor(actor, s, args) for s in (0, 999, 1000, 1999, 2000, 2999, 3000, 5999, 6000, 9999)] == [
            0,
            0,
            1,
            1,
            2,
            2,
            0,
            2,
            2,
            2,
        ]
    sim = ci.Args(env_ids=["a", "b", "c"], mode="simultaneous")
    assert [ci.task_for_actor(i, s, sim) for i in range(4) for s in (0, 10**6)] == [0, 0, 1, 1, 2, 2, 0, 0]
    assert ci.net_for_task(2, ci.Args(mode="separate")) == 2 and ci.net_for_task(2, sim) == 0
    # several envs per actor process (slot = process * E + env): simultaneous mixes the tasks within a process (and
    # so within a batch); separate gives a process's envs its task, whose network they all use
    sim3 = ci.Args(env_ids=["a", "b", "c"], mode="simultaneous", num_actors=2, envs_per_actor=3)
    assert [ci.task_for_actor(slot, 0, sim3) for slot in range(6)] == [0, 1, 2, 0, 1, 2]
    sep3 = ci.Args(env_ids=["a", "b"], mode="separate", num_actors=2, envs_per_actor=3)
    assert [ci.task_for_actor(slot, 0, sep3) for slot in range(6)] == [0, 0, 0, 1, 1, 1]


def test_buffer_capacity_split_over_actors():
    args = ci.Args(env_ids=["a", "b"], steps_per_task=100_000, num_cycles=2, num_actors=10, unroll_length=20)
    assert ci.buffer_capacity_per_actor(args) == 200_000 // (10 * 20)  # half the run's steps by default
    args.buffer_size = 40_000
    assert ci.buffer_capacity_per_actor(args) == 200
    assert ci.buffer_capacity_per_actor(ci.Args(replay_fraction=0.0)) == 0


def test_cumulative_returns_are_time_averages():
    # task 0: one failed episode in the first half, then many short successful ones: time average 0.5, not ~1
    recs = [(5, 0, 0.0)] + [(50 + i * 0.5, 0, 1.0) for i in range(100)] + [(20, 1, 5.0)]
    cum = ci.cumulative_returns(recs, 3, total=100, num_bins=10)
    assert cum[0] == pytest.approx(0.5) and cum[1] == pytest.approx(5.0)
    assert math.isnan(cum[2])
    steps, vals = ci.binned_returns(recs, 0, 100, 10)
    assert list(vals) == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1] and steps[0] == 10  # forward-filled
    # a run stopped at step 60 is averaged over what it measured (total = the steps reached), not filled to the end
    cut = [r for r in recs if r[0] <= 60]
    assert ci.cumulative_returns(cut, 1, total=60, num_bins=6)[0] == pytest.approx(1 / 6)


def test_the_summary_counts_the_test_episodes_still_queued_at_the_end(tmp_path):
    """Clause F1, the end of a run (summarize_test_episodes): the test episodes still in the queue when the loop stops
    (they ended after its last drain) join the history at the step reached, eval_records.json holds them all, and
    the summary's final_cumulative_return, final_return_last20 and num_eval_episodes are computed from that whole
    history (textbook_cumulative_return over [0, the step reached]). The late returns differ from the earlier ones,
    so a summary computed before the last drain differs."""
    args = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"])
    eval_records = [(40, 0, 0.0), (120, 0, 1.0), (200, 1, 0.5)]
    late = queue.SimpleQueue()
    for task, episode_return in ((0, 9.0), (1, 4.0), (0, 7.0)):
        late.put((task, episode_return, 8))
    step = 240
    summary = ci.summarize_test_episodes(eval_records, late, step, args, tmp_path)
    written = [tuple(r) for r in json.loads((tmp_path / "eval_records.json").read_text())]
    assert written == [(40, 0, 0.0), (120, 0, 1.0), (200, 1, 0.5), (240, 0, 9.0), (240, 1, 4.0), (240, 0, 7.0)]
    assert eval_records == written
    for task, env_id in enumerate(args.env_ids):
        expected = textbook_cumulative_return(written, task, step)
        assert summary["final_cumulative_return"][env_id] == pytest.approx(expected, rel=1e-12), env_id
        assert expected != pytest.approx(textbook_cumulative_return(written[:3], task, step)), env_id
    assert summary["final_return_last20"] == {"MiniGrid-Empty-5x5-v0": 17 / 4, "MiniGrid-LavaGapS5-v0": 2.25}
    assert summary["num_eval_episodes"] == {"MiniGrid-Empty-5x5-v0": 4, "MiniGrid-LavaGapS5-v0": 2}


@pytest.mark.parametrize("total", [480, 1000, 4_321])
def test_cumulative_and_binned_returns_equal_the_textbook_time_average(total):
    """Clause F1: `cumulative_returns` and `binned_returns` against `textbook_cumulative_return` on random test-episode
    records (steps at multiples of a batch's steps, as the learner records them; some on the bin edges; one task
    with none, one with a single late episode), and the per-episode mean it is not (the test can fail)."""
    rng = np.random.default_rng(total)
    records = []
    for _ in range(300):
        step = int(rng.integers(0, total // 40 + 1)) * 40
        records.append((step, int(rng.integers(0, 2)), float(rng.normal(1.0, 2.0))))
    records.append((total, 3, 7.5))
    cumulative = ci.cumulative_returns(records, 4, total)
    for task in range(4):
        expected = textbook_cumulative_return(records, task, total)
        if expected is None:
            assert math.isnan(cumulative[task]), task
        else:
            assert cumulative[task] == pytest.approx(expected, rel=1e-12, abs=1e-12), task
    for task in (0, 1):
        ends, values = ci.binned_returns(records, task, total)
        assert values.mean() == pytest.approx(cumulative[task], rel=1e-12)
        assert ends[-1] == total and len(ends) == len(values)
        per_episode = np.mean([ret for _, record_task, ret in records if record_task == task])
        assert abs(per_episode - cumulative[task]) > 1e-6

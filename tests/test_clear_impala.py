"""Tests for clear_impala.py: V-trace against a slow textbook implementation of IMPALA Eq. (1), reservoir sampling
uniformity (chi-square), pair selection, behavioural-cloning losses (zero when equal, time alignment), task switching,
start-up errors, and a subprocess smoke run + save/resume round trip of a two-task MiniGrid sequence (signals, a killed
actor, the resume rule and bad input: tests/test_lifecycle.py)."""

import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import clear_impala as ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "clear_impala.py")


# ----------------------------------------------------------------------------------------------------------------
# V-trace
# ----------------------------------------------------------------------------------------------------------------
def textbook_vtrace(log_rhos, discounts, rewards, values, bootstrap, clip_rho, clip_pg_rho):
    """Deliberately slow, straight from IMPALA Eq. (1) with per-step discounts gamma_t:
    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),
    pg_adv_s = rho_pg_s (r_s + gamma_s v_{s+1} - V(x_s)), with V(x_T) = v_T = bootstrap."""
    T, B = log_rhos.shape
    rhos = np.exp(log_rhos)
    vs = np.zeros((T, B))
    adv = np.zeros((T, B))
    for b in range(B):
        v_next = lambda t: values[t + 1, b] if t + 1 < T else bootstrap[b]  # noqa: E731
        for s in range(T):
            total = values[s, b]
            for t in range(s, T):
                prod = 1.0
                for i in range(s, t):
                    prod *= discounts[i, b] * min(1.0, rhos[i, b])
                rho_t = rhos[t, b] if clip_rho is None else min(clip_rho, rhos[t, b])
                total += prod * rho_t * (rewards[t, b] + discounts[t, b] * v_next(t) - values[t, b])
            vs[s, b] = total
        for s in range(T):
            vs_next = vs[s + 1, b] if s + 1 < T else bootstrap[b]
            rho_pg = rhos[s, b] if clip_pg_rho is None else min(clip_pg_rho, rhos[s, b])
            adv[s, b] = rho_pg * (rewards[s, b] + discounts[s, b] * vs_next - values[s, b])
    return vs, adv


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


# ----------------------------------------------------------------------------------------------------------------
# Reservoir buffer
# ----------------------------------------------------------------------------------------------------------------
def unroll_with_id(i, T=3, obs_shape=(2, 2), A=2):
    return {k: np.full(shape, i % 100, dtype=dtype) for k, (shape, dtype) in ci.unroll_specs(obs_shape, A, T).items()}


def chi2_upper(df, z=3.29):
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.9995)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


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


# ----------------------------------------------------------------------------------------------------------------
# Pair selection (--replay-ratio)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.3, 1.0])
def test_select_pairs_honours_replay_ratio(ratio):
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
# ----------------------------------------------------------------------------------------------------------------
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


def act_like_an_actor(model, T, B, obs_shape, seed=0):
    """Build a stored batch the way actor_loop writes it: row t+1 holds mu(.|x_t), V_mu(x_t), a_t, ..."""
    g = torch.Generator().manual_seed(seed)
    specs = ci.unroll_specs(obs_shape, 7, T)
    batch = {
        k: torch.zeros((shape[0], B, *shape[1:]), dtype=getattr(torch, np.dtype(d).name if d != np.bool_ else "bool"))
        for k, (shape, d) in specs.items()
    }
    batch["obs"] = torch.randint(0, 11, (T + 1, B, *obs_shape), generator=g, dtype=torch.uint8)
    with torch.no_grad():
        logits, values = model(batch["obs"].reshape(-1, *obs_shape))
    logits = logits.view(T + 1, B, -1)
    values = values.view(T + 1, B)
    batch["logits"][1:] = logits[:-1]
    batch["baseline"][1:] = values[:-1]
    batch["action"][1:] = torch.randint(0, 7, (T, B), generator=g)
    batch["reward"][1:] = torch.rand(T, B, generator=g)
    return batch


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
# Tasks, flags
# ----------------------------------------------------------------------------------------------------------------
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
    assert ci.buffer_capacity_per_actor(args) == 200_000 // (10 * 20)  # half the training frames by default
    args.buffer_frames = 40_000
    assert ci.buffer_capacity_per_actor(args) == 200
    assert ci.buffer_capacity_per_actor(ci.Args(replay_ratio=0.0)) == 0


@pytest.mark.parametrize(
    "over,msg",
    [
        (dict(num_actors=4, batch_size=8), "--num-actors"),
        (dict(replay_ratio=1.5), "--replay-ratio"),
        (dict(buffer_frames=0), "--buffer-frames 0"),
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


# ----------------------------------------------------------------------------------------------------------------
# Subprocess runs
# ----------------------------------------------------------------------------------------------------------------
def run_script(tmp_path, *flags, timeout=80):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


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


def test_buffer_that_cannot_fit_is_refused_at_start_up(tmp_path):
    r = run_script(
        tmp_path,
        *"--env-ids MiniGrid-Empty-5x5-v0 --num-actors 2 --batch-size 2 --buffer-frames".split(),
        str(10**13),
        "--no-progress",
        timeout=60,
    )
    assert r.returncode != 0
    assert "B per stored frame (frame 147 B" in r.stdout  # the start-up memory report
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the replay memory needs") and "--buffer-frames" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


# a log record per learner step and episodes of <= 8 steps: the run lasts about a second, so wall-clock logging could
# skip task 0 and a test actor could finish no 100-step episode before the end
TINY = (
    "--env-ids MiniGrid-Empty-5x5-v0 MiniGrid-LavaGapS5-v0 --steps-per-task 240 --num-actors 2 --batch-size 2 "
    "--unroll-length 20 --num-test-actors 1 --test-actor-max-sps 300 --start-method forkserver --no-progress "
    "--no-cuda --log-every-seconds 0 --minigrid-max-steps 8"
).split()


def test_smoke_two_task_sequence_and_resume_round_trip(tmp_path):
    r = run_script(tmp_path, *TINY, *"--num-cycles 1 --checkpoint-every 240 --save-model --checkpoint-replay".split())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 480
    assert summary["task_mismatch"] == 0  # every unroll was played on the task its start step designates
    assert set(summary["final_cumulative_return"]) == {"MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"}
    assert all(n > 0 for n in summary["num_eval_episodes"].values()), summary  # test actors of BOTH tasks reported
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = set().union(*metrics)
    for name in (
        "losses/pg_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/policy_cloning_loss",
        "losses/value_cloning_loss",
        "charts/learner_SPS",
        "charts/actor_SPS",
        "charts/replay_fraction",
        "charts/buffer_fill",
        "charts/policy_lag",
        "charts/SPS",
    ):
        assert name in names, name
    assert any(n.startswith("eval/MiniGrid-LavaGapS5-v0/") for n in names)
    tasks = [m["charts/task"] for m in metrics if "charts/task" in m]
    assert tasks[0] == 0 and tasks[-1] == 1
    assert len(json.loads((run_dir / "eval_records.json").read_text())) == sum(summary["num_eval_episodes"].values())
    # SAVE/RESUME: the checkpoint holds the final weights, optimizer state, schedule and step
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    saved = torch.load(run_dir / "clear_impala.model", weights_only=False)
    assert ckpt["global_step"] == 480
    for k, v in saved["models"][0].items():
        assert torch.equal(v, ckpt["models"][0][k]), k
    assert ckpt["optimizers"][0]["state"] and ckpt["schedulers"][0]["last_epoch"] == 12
    for i in range(2):  # each actor saved its replay buffer next to the checkpoint
        with np.load(run_dir / f"replay_actor{i}.npz") as f:
            assert f["obs"].dtype == np.uint8 and f["obs"].shape == (6, 21, 7, 7, 3) and f["num_seen"] >= 6
    # resume (the checkpoint's flags; the same run folder): weights, optimizer, task position, evaluation history and
    # each actor's replay buffer come back
    r2 = run_script(tmp_path, "--num-cycles", "2", "--resume", str(run_dir / "checkpoint.pt"))
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-3000:]
    assert "at step 480: " in r2.stdout and "task 0, " in r2.stdout and "replay buffers of 2/2 actors" in r2.stdout
    assert r2.stdout.count("replay unrolls from") == 2, r2.stdout[-2000:]
    s2 = json.loads((run_dir / "summary.json").read_text())
    assert s2["global_step"] == 960 and s2["task_mismatch"] == 0 and s2["stop_reason"] == "completed"
    n1 = sum(summary["num_eval_episodes"].values())
    n2 = sum(s2["num_eval_episodes"].values())
    assert n2 >= n1  # the evaluation history continues
    # the pair-selection stream continued across the resume: the seeded stream advanced once per learner step
    # (every pair holds a replay half), the first run's steps included
    ckpt2 = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    rng = np.random.default_rng(ckpt2["args"]["seed"])
    for _ in range(sum(ckpt2["learner_steps"])):
        ci.select_pairs(np.ones(2, dtype=bool), 0.5, rng)
    assert ckpt2["learner_steps"] == [24] and ckpt2["pair_rng"] == rng.bit_generator.state


# ----------------------------------------------------------------------------------------------------------------
# Wiring: what the real actor loop writes, and the loss the real learner function computes on it
# ----------------------------------------------------------------------------------------------------------------
def run_actor_loops(args, obs_shape, num_actions, shared_models, unrolls, tmp_path, start_step=0):
    """Run the real `actor_loop` of every actor process in a thread with the script's shared structures (a slot per
    env, its SlotInfo entries, one full queue per network, a semaphore per slot) and collect `unrolls` published pairs
    per slot: {slot: [{field: [2, T+1, ...], "info": {SlotInfo field: int}, "queue": the network it came through}, ...]}."""
    import queue
    import threading

    A = args.num_actors
    T = args.unroll_length
    N = args.num_actors * args.envs_per_actor
    slots = {
        k: torch.from_numpy(np.zeros((N, 2, *shape), dtype=dtype))
        for k, (shape, dtype) in ci.unroll_specs(obs_shape, num_actions, T).items()
    }
    slot_info = ci.SlotInfo.zeros(N)
    full_queues = [queue.SimpleQueue() for _ in shared_models]
    slot_free = [threading.Semaphore(1) for _ in range(N)]
    stop = threading.Event()
    handles = ci.ActorHandles(
        shared_models=shared_models,
        slots=slots,
        slot_info=slot_info,
        full_queues=full_queues,
        slot_free=slot_free,
        global_step=SimpleNamespace(value=start_step),
        policy_version=SimpleNamespace(value=0),
        frames_done=[0] * A,
        stop=stop,
        stats_queue=queue.SimpleQueue(),
        checkpoint_request=SimpleNamespace(value=0),
        run_dir=str(tmp_path),
    )
    threads = [
        threading.Thread(target=ci.actor_loop, daemon=True, args=(i, args, obs_shape, num_actions, handles)) for i in range(A)
    ]
    for th in threads:
        th.start()
    pairs = {i: [] for i in range(N)}
    deadline = time.time() + 60
    try:
        while min(len(p) for p in pairs.values()) < unrolls:
            assert time.time() < deadline, "the actors published too few unrolls"
            for net, full in enumerate(full_queues):
                if full.empty():
                    continue
                i = full.get()
                info = {name: int(entries[i]) for name, entries in slot_info._asdict().items()}
                pairs[i].append({k: v[i].clone() for k, v in slots.items()} | {"info": info, "queue": net})
                if len(pairs[i]) < unrolls:
                    slot_free[i].release()
            time.sleep(0.001)
    finally:
        stop.set()
        for i in range(N):
            slot_free[i].release()
        for th in threads:
            th.join(timeout=30)
    return pairs, slots


def check_direct_rollout(env, obs, new, network, T):
    """The new half of a published pair against a direct rollout of `env` from `obs` with the stored actions: each
    frame, reward and end flag, and mu, V_mu of `network` at frame r - 1 in row r. Returns the env's last obs."""
    with torch.no_grad():
        logits, values = network(new["obs"][:T])
    torch.testing.assert_close(new["logits"][1:], logits)
    torch.testing.assert_close(new["baseline"][1:], values)
    for r in range(1, T + 1):
        obs, reward, term, trunc, _ = env.step(int(new["action"][r]))
        assert float(new["reward"][r]) == pytest.approx(reward)
        assert bool(new["done"][r]) == (term or trunc)
        if term or trunc:
            obs, _ = env.reset()
        assert (new["obs"][r] == torch.from_numpy(obs)).all(), r
    return obs


def slow_clear_loss(learner, half_per_column, which, args):
    """CLEAR's loss terms written per element from the papers, for stored unrolls (row r = 1..T holds a_{r-1}, r_{r-1},
    done_{r-1}, mu(.|x_{r-1}), V_mu(x_{r-1}); row r's frame is x_r), as float64 tensors with autograd back to the
    learner's parameters: IMPALA Eq. (1) V-trace targets (`textbook_vtrace`, constants: no gradient flows through v_s
    or the advantage) with gamma cut at every episode end and a truncation bootstrapped through V_mu(final obs);
    pg = -sum log pi(a_t|x_t) adv_t, value = 1/2 sum (v_t - V(x_t))^2, entropy = sum pi log pi, and on replay columns
    KL(mu || pi) and (V - V_mu)^2 (CLEAR Sec. 3). Returns the unweighted terms and the weighted total."""
    T = args.unroll_length
    B = len(half_per_column)
    g = args.gamma
    log_rhos, disc, rew, vals = (np.zeros((T, B)) for _ in range(4))
    boot = np.zeros(B)
    log_pi = {}
    mu = {}
    act = {}
    vmu = {}
    value_of = {}
    for b, u in enumerate(half_per_column):
        lg, v = learner(u["obs"])
        for t in range(T + 1):
            if t == T:
                boot[b] = v[T].item()
                break
            log_pi[t, b] = torch.log_softmax(lg[t].double(), -1)
            mu[t, b] = torch.softmax(u["logits"][t + 1].double(), -1)
            act[t, b] = int(u["action"][t + 1])
            vmu[t, b] = float(u["baseline"][t + 1])
            value_of[t, b] = v[t].double()
            vals[t, b] = v[t].item()
            log_rhos[t, b] = log_pi[t, b][act[t, b]].item() - math.log(mu[t, b][act[t, b]].item())
            done = bool(u["done"][t + 1])
            trunc = bool(u["truncated"][t + 1])
            disc[t, b] = 0.0 if done else g
            rew[t, b] = float(u["reward"][t + 1]) + (g * float(u["final_value"][t + 1]) if trunc else 0.0)
    vs, adv = textbook_vtrace(log_rhos, disc, rew, vals, boot, args.clip_rho_threshold, args.clip_pg_rho_threshold)
    pg = torch.zeros((), dtype=torch.float64)
    value = torch.zeros((), dtype=torch.float64)
    entropy = torch.zeros((), dtype=torch.float64)
    pc = torch.zeros((), dtype=torch.float64)
    vc = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            pg = pg - log_pi[t, b][act[t, b]] * adv[t, b]
            value = value + 0.5 * (vs[t, b] - value_of[t, b]) ** 2
            entropy = entropy + (log_pi[t, b].exp() * log_pi[t, b]).sum()
            if which[b]:
                pc = pc + (mu[t, b] * (mu[t, b].log() - log_pi[t, b])).sum()
                vc = vc + (value_of[t, b] - vmu[t, b]) ** 2
    total = args.pg_cost * pg + args.baseline_cost * value + args.entropy_cost * entropy
    if args.behavior_cloning:
        total = total + args.policy_cloning_cost * pc + args.value_cloning_cost * vc
    return {
        "losses/pg_loss": pg,
        "losses/value_loss": value,
        "losses/policy_cloning_loss": pc,
        "losses/value_cloning_loss": vc,
        "losses/total_loss": total,
        "entropy_sum": entropy,
    }


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    zero = torch.zeros((), dtype=torch.float64)
    return {name: zero if p.grad is None else p.grad.double().clone() for name, p in model.named_parameters()}


class ReleaseCounter:
    """A stand-in for a slot's semaphore on the learner's side: counts releases and nothing else."""

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


# each term alone through the real loss (its cost 1, every other 0), then the paper's weights
ONE_TERM = {
    "losses/pg_loss": "pg_cost",
    "losses/value_loss": "baseline_cost",
    "entropy_sum": "entropy_cost",
    "losses/policy_cloning_loss": "policy_cloning_cost",
    "losses/value_cloning_loss": "value_cloning_cost",
}


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
        replay_ratio=0.5,
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
    pairs, slots = run_actor_loops(args, obs_shape, num_actions, [shared], unrolls=4, tmp_path=tmp_path)
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
        counter = SimpleNamespace(value=0)
        batch = ci.take_batch(slots, [0, 1], which, [ReleaseCounter(), ReleaseCounter()], counter, T)
        loss, parts, _, _, _ = ci.learner_loss(learner, batch, which, args, cpu)
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
    """The learner's hand-off against an actor stand-in that rewrites its slot (both halves) the moment the learner
    frees it: the batch must equal what the slots held when the learner took them, and the global step must already
    count the batch's new frames when an actor sees its slot free (its next unroll starts at the updated step)."""
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
    batch = ci.take_batch(slots, idx, which, slot_free, global_step, T)
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
    assert chosen.buffer_size.tolist() == [25, 5]
    assert chosen._fields == ("task", "start_step", "policy_version", "replay_valid", "replay_task", "buffer_size")


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
    shared = networks if mode == "separate" else networks[:1]
    pairs, _ = run_actor_loops(args, obs_shape, num_actions, shared, unrolls=2, tmp_path=tmp_path)
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


def test_a_resumed_actor_does_not_replay_the_first_runs_streams(tmp_path):
    """An actor started at a resumed step draws new actions and env seeds; one started at step 0 twice repeats
    itself (one actor: the torch stream is not shared between threads)."""
    args = ci.Args(
        env_ids=["MiniGrid-LavaGapS5-v0"], num_actors=1, batch_size=1, unroll_length=10, steps_per_task=10_000, seed=2
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    torch.manual_seed(0)
    shared = ci.Agent(obs_shape, num_actions, "minigrid")
    first_unrolls = []
    for start_step in (0, 0, 480):
        pairs, _ = run_actor_loops(args, obs_shape, num_actions, [shared], 1, tmp_path, start_step=start_step)
        first_unrolls.append(pairs[0][0])
    same = [all(torch.equal(first_unrolls[0][k], u[k]) for k in ci.UNROLL_FIELDS) for u in first_unrolls[1:]]
    assert same == [True, False]


def test_test_actors_refresh_the_network_of_their_task_during_the_run():
    """A test actor reloads its task's shared network every unroll_length steps (the forgetting curves follow the
    learner), and in separate mode only its own task's network."""
    import queue
    import threading

    reads = [0, 0]

    class CountingAgent(ci.Agent):
        def __init__(self, index, *a):
            super().__init__(*a)
            self.index = index

        def state_dict(self, *a, **kw):
            reads[self.index] += 1
            return super().state_dict(*a, **kw)

    args = ci.Args(
        env_ids=["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"],
        mode="separate",
        minigrid_max_steps=5,
        num_actors=2,
        batch_size=1,
        unroll_length=4,
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    shared = [CountingAgent(k, obs_shape, num_actions, "minigrid") for k in range(2)]
    reads[:] = [0, 0]
    stop = threading.Event()
    eval_queue = queue.SimpleQueue()
    thread = threading.Thread(
        target=ci.test_actor_loop, daemon=True, args=(0, 1, args, obs_shape, num_actions, shared, stop, eval_queue)
    )
    thread.start()
    episodes = []
    try:
        while len(episodes) < 3:
            episodes.append(eval_queue.get(timeout=30))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert all(task == 1 for task, _, _ in episodes)
    # three episodes of <= 5 steps: at least 15 steps, a reload every 4
    assert reads[0] == 0 and reads[1] >= 3, reads


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


def test_separate_mode_trains_and_anneals_one_network_per_task(tmp_path):
    """--mode separate: each network takes every other learner step from its own task's queue; each has its own
    optimizer and linear lr schedule (stepped once per own step); the pair-selection stream in the checkpoint is the
    seeded stream advanced once per learner step (every pair holds a replay half)."""
    r = run_script(tmp_path, *TINY, *"--mode separate --envs-per-actor 2 --num-cycles 1 --checkpoint-every 240".split())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert ckpt["global_step"] == 480 and ckpt["learner_steps"] == [6, 6]
    assert [s["last_epoch"] for s in ckpt["schedulers"]] == [6, 6]
    updates_per_net = 480 // (20 * 2 * 2)
    for scheduler, steps in zip(ckpt["schedulers"], ckpt["learner_steps"]):
        assert scheduler["_last_lr"][0] == pytest.approx(6e-4 * max(0.0, 1 - steps / updates_per_net))
    assert all(o["state"] for o in ckpt["optimizers"])
    assert any(not torch.equal(ckpt["models"][0][k], ckpt["models"][1][k]) for k in ckpt["models"][0])
    rng = np.random.default_rng(ckpt["args"]["seed"])
    for _ in range(sum(ckpt["learner_steps"])):
        ci.select_pairs(np.ones(2, dtype=bool), 0.5, rng)
    assert ckpt["pair_rng"] == rng.bit_generator.state


def test_probe_envs_resolves_bootstrap_truncation_per_env_family():
    minatar = ci.Args(env_ids=["MinAtar/Breakout-v0"])
    minigrid = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0"])
    minigrid_asked = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0"], bootstrap_truncation=True)
    for args in (minatar, minigrid, minigrid_asked):
        ci.probe_envs(args)
    assert minatar.bootstrap_truncation is True
    assert minigrid.bootstrap_truncation is False
    assert minigrid_asked.bootstrap_truncation is True

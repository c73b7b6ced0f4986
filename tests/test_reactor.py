"""Tests of reactor.py: each estimator and sampler against a deliberately slow textbook version written from the
paper's equations (Gruslys et al. 2018), property tests, edge cases, and short subprocess smoke runs."""

import json
import math
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import reactor  # noqa: E402
from common.args import resume_args  # noqa: E402
from common.processes import check_memory  # noqa: E402
from common.sum_tree import SumTree  # noqa: E402
from reactor import (  # noqa: E402
    LazyPriorities,
    SequenceReplay,
    beta_loo_policy_loss,
    categorical_projection,
    discounts_and_traces,
    distributional_retrace_target,
    retrace_returns,
    tislr_policy_loss,
)

ATARI = (1, 84, 84)  # an Atari frame's shape


@pytest.fixture(autouse=True)
def float64_by_default():
    """Textbook comparisons run in float64; the default is restored so other test files keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# ----------------------------------------------------------------------------------------------------------------
# slow textbook versions
def textbook_projection(atoms, probs, support):
    """C51 Eq. (7): out_i = sum_j p_j clip(1 - |clip(x_j, vmin, vmax) - z_i| / dz, 0, 1), one loop per atom and bin."""
    vmin, vmax = support[0], support[-1]
    dz = (vmax - vmin) / (len(support) - 1)
    out = np.zeros(len(support))
    for x, p in zip(atoms, probs):
        xc = min(max(x, vmin), vmax)
        for i, z in enumerate(support):
            out[i] += p * min(max(1.0 - abs(xc - z) / dz, 0.0), 1.0)
    return out


def textbook_retrace(rewards, discounts, c, pi, Q, actions):
    """Eq. (3): Q^ret(x_t,a_t) = Q(x_t,a_t) + sum_{s=t}^{T-1} (prod_{u=t}^{s-1} gamma_u) (c_{t+1}...c_s) delta_s,
    delta_s = r_s + gamma_s E_pi Q(x_{s+1}, .) - Q(x_s, a_s). One sequence: rewards, discounts [T]; c, actions [T+1]
    (c[u] = trace at x_u); pi, Q [T+1, A]."""
    T = len(rewards)
    out = np.zeros(T)
    for t in range(T):
        total = Q[t, actions[t]]
        for s in range(t, T):
            disc = 1.0
            for u in range(t, s):
                disc *= discounts[u]
            trace = 1.0
            for u in range(t + 1, s + 1):
                trace *= c[u]
            delta = rewards[s] + discounts[s] * np.dot(pi[s + 1], Q[s + 1]) - Q[s, actions[s]]
            total += disc * trace * delta
        out[t] = total
    return out


def textbook_distributional_retrace(rewards, discounts, c, pi, q, actions, support):
    """Paper 3.2 literally: q*(x_t,a_t) = sum_n sum_a alpha_{n,a} sum_j q_j(x_{t+n},a) h(z^n_j), with
    alpha_{n,a} = (c_{t+1}..c_{t+n-1})(pi(a|x_{t+n}) - 1{a=a_{t+n}} c_{t+n}), c_T := 0. q [T+1, A, K]."""
    T = len(rewards)
    A = pi.shape[1]
    c = c.copy()
    c[T] = 0.0
    out = np.zeros((T, len(support)))
    for t in range(T):
        atoms, probs = [], []
        for n in range(1, T - t + 1):
            g, disc = 0.0, 1.0
            for s in range(t, t + n):
                g += disc * rewards[s]
                disc *= discounts[s]
            trace = 1.0
            for u in range(t + 1, t + n):
                trace *= c[u]
            for a in range(A):
                alpha = trace * (pi[t + n, a] - (a == actions[t + n]) * c[t + n])
                for j, z in enumerate(support):
                    atoms.append(g + disc * z)
                    probs.append(alpha * q[t + n, a, j])
        out[t] = textbook_projection(atoms, probs, support)
    return out


# ----------------------------------------------------------------------------------------------------------------
# categorical projection
def test_projection_matches_textbook_signed_weights_and_outside_atoms():
    rng = np.random.default_rng(0)
    for _ in range(30):
        K = int(rng.integers(2, 12))
        vmin = rng.uniform(-5, 0)
        support = np.linspace(vmin, vmin + rng.uniform(0.5, 10), K)
        M = int(rng.integers(1, 20))
        atoms = rng.uniform(support[0] - 3, support[-1] + 3, size=(3, M))  # many outside the support
        probs = rng.normal(size=(3, M))  # signed weights
        got = categorical_projection(torch.tensor(atoms), torch.tensor(probs), torch.tensor(support)).numpy()
        for b in range(3):
            np.testing.assert_allclose(got[b], textbook_projection(atoms[b], probs[b], support), atol=1e-10)
            np.testing.assert_allclose(got[b].sum(), probs[b].sum(), atol=1e-10)  # mass is kept


def test_projection_atoms_on_grid_points():
    support = torch.linspace(-2, 2, 5)  # -2 -1 0 1 2
    atoms = torch.tensor([[-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, -7.0]])
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.05, 0.1, 0.1]])
    got = categorical_projection(atoms, probs, support)[0].numpy()
    np.testing.assert_allclose(got, [0.2, 0.2, 0.3, 0.15, 0.15], atol=1e-12)
    # an atom halfway between two grid points splits evenly; linear in probs
    got = categorical_projection(torch.tensor([0.5]), torch.tensor([-2.0]), support).numpy()
    np.testing.assert_allclose(got, [0, 0, -1.0, -1.0, 0], atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# Retrace (scalar and distributional)
def random_sequence(rng, T, A, K, terminal_prob=0.0):
    rewards = rng.uniform(-0.1, 0.1, size=T)
    term = rng.random(T) < terminal_prob
    discounts = 0.9 * (1 - term)
    c = np.minimum(1.0, rng.uniform(0, 2, size=T + 1))
    for t in range(T):  # trace cut after an episode end
        if term[t]:
            c[t + 1] = 0.0
    logits = rng.normal(size=(T + 1, A))
    pi = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    actions = rng.integers(0, A, size=T + 1)
    q = rng.random((T + 1, A, K))
    q[:, :, : K // 4] = 0.0  # no mass on the extreme atoms: nothing gets clipped
    q[:, :, K - K // 4 :] = 0.0
    q /= q.sum(-1, keepdims=True)
    return rewards, discounts, c, pi, q, actions


def test_scalar_retrace_matches_textbook():
    rng = np.random.default_rng(1)
    for case in range(20):
        T, A = int(rng.integers(1, 9)), int(rng.integers(2, 5))
        rewards, discounts, c, pi, _, actions = random_sequence(rng, T, A, 4, terminal_prob=0.2 * (case % 2))
        Q = rng.normal(size=(T + 1, A))
        want = textbook_retrace(rewards, discounts, np.r_[c[:T], 0.0], pi, Q, actions)
        got = retrace_returns(
            torch.tensor(rewards)[None],
            torch.tensor(discounts)[None],
            torch.tensor(c[1:])[None],
            torch.tensor((pi[1:] * Q[1:]).sum(1))[None],
            torch.tensor(Q[np.arange(1, T + 1), actions[1:]])[None],
        )[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-10)


def test_distributional_retrace_matches_textbook_mass_one_and_mean():
    rng = np.random.default_rng(2)
    K = 21
    support = np.linspace(-10, 10, K)
    for case in range(12):
        T, A = int(rng.integers(1, 7)), int(rng.integers(2, 4))
        rewards, discounts, c, pi, q, actions = random_sequence(rng, T, A, K, terminal_prob=0.25 * (case % 2))
        got = distributional_retrace_target(
            torch.tensor(rewards)[None],
            torch.tensor(discounts)[None],
            torch.tensor(c[1:])[None],
            torch.tensor(pi[1:])[None],
            torch.tensor(q[1:])[None],
            torch.tensor(actions[1:])[None],
            torch.tensor(support),
        )[0].numpy()
        want = textbook_distributional_retrace(rewards, discounts, c, pi, q, actions, support)
        np.testing.assert_allclose(got, want, atol=1e-10)
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-10)  # sum_{n,a} alpha_{n,a} = 1
        # the mean equals scalar Retrace (Eq. (3)) on the expected Q when nothing is clipped
        Q = (q * support).sum(-1)
        Q[0] = rng.normal(size=A)  # Q(x_t,a_t) cancels: any value
        scalar = textbook_retrace(rewards, discounts, np.r_[c[:T], 0.0], pi, Q, actions)
        np.testing.assert_allclose((got * support).sum(-1), scalar, atol=1e-10)


def test_distributional_target_can_be_signed_but_keeps_mass():
    rng = np.random.default_rng(3)
    B, T, A, K = 16, 8, 4, 11
    support = torch.linspace(-10, 10, K)
    q = torch.softmax(torch.tensor(rng.normal(size=(B, T, A, K))) * 3, -1)
    pi = torch.softmax(torch.tensor(rng.normal(size=(B, T, A))), -1)
    target = distributional_retrace_target(
        torch.tensor(rng.uniform(-1, 1, (B, T))),
        torch.full((B, T), 0.99),
        torch.tensor(rng.uniform(0, 1, (B, T))),
        pi,
        q,
        torch.tensor(rng.integers(0, A, (B, T))),
        support,
    )
    np.testing.assert_allclose(target.sum(-1).numpy(), 1.0, atol=1e-10)
    assert (target < -1e-6).any(), "alpha has negative entries: some target bins should be negative"


def test_trace_cutting_at_episode_end_and_bootstrap_on_truncation():
    # slots 0..5; transition 2 terminates -> slot 3 starts a new episode
    T, A, K = 5, 3, 11
    rho = torch.ones(1, T + 1)
    term = torch.zeros(1, T + 1, dtype=torch.bool)
    pad = torch.zeros_like(term)
    first = torch.zeros_like(term)
    term[0, 2], first[0, 3] = True, True
    disc, c_next, mask = discounts_and_traces(rho, term, pad, first, 0.9, 1.0)
    np.testing.assert_allclose(disc[0].numpy(), [0.9, 0.9, 0.0, 0.9, 0.9])
    np.testing.assert_allclose(c_next[0].numpy(), [1, 1, 0, 1, 1])
    np.testing.assert_allclose(mask[0].numpy(), 1.0)
    rng = np.random.default_rng(4)
    support = torch.linspace(-10, 10, K)
    rewards = torch.tensor(rng.uniform(-1, 1, (1, T)))
    pi = torch.softmax(torch.tensor(rng.normal(size=(1, T, A))), -1)
    q = torch.softmax(torch.tensor(rng.normal(size=(1, T, A, K))), -1)
    a = torch.tensor(rng.integers(0, A, (1, T)))
    target = distributional_retrace_target(rewards, disc, c_next, pi, q, a, support)
    # nothing after the episode end reaches t <= 2: change everything after it
    rewards2, q2, pi2 = rewards.clone(), q.clone(), pi.clone()
    rewards2[0, 3:] = 0.7
    q2[0, 2:] = torch.softmax(torch.tensor(rng.normal(size=(T - 2, A, K))), -1)
    pi2[0, 2:] = 1.0 / A
    target2 = distributional_retrace_target(rewards2, disc, c_next, pi2, q2, a, support)
    np.testing.assert_allclose(target[0, :3].numpy(), target2[0, :3].numpy(), atol=1e-12)
    # at the terminal transition the target is the projected point mass at r_2
    np.testing.assert_allclose(target[0, 2].numpy(), categorical_projection(rewards[0, 2:3], torch.ones(1), support))
    # truncation at transition 2: slot 3 is the true last frame (pad), slot 4 starts a new episode
    term[0, 2], first[0, 3] = False, False
    pad[0, 3], first[0, 4] = True, True
    disc, c_next, mask = discounts_and_traces(rho, term, pad, first, 0.9, 1.0)
    np.testing.assert_allclose(disc[0].numpy(), [0.9, 0.9, 0.9, 0.0, 0.9])  # bootstrap on truncation
    np.testing.assert_allclose(c_next[0].numpy(), [1, 1, 0, 0, 1])
    np.testing.assert_allclose(mask[0].numpy(), [1, 1, 1, 0, 1])
    target = distributional_retrace_target(rewards, disc, c_next, pi, q, a, support)
    boot = (pi[0, 2, :, None] * q[0, 2]).sum(0)  # r_2 + gamma E_pi q(x_3)
    np.testing.assert_allclose(
        target[0, 2].numpy(), categorical_projection(rewards[0, 2] + 0.9 * support, boot, support).numpy(), atol=1e-12
    )


# ----------------------------------------------------------------------------------------------------------------
# beta-LOO and TISLR
def test_beta_loo_gradient_equals_hand_derived_form():
    rng = np.random.default_rng(5)
    for _ in range(20):
        A = int(rng.integers(2, 6))
        eps = 0.05
        theta = torch.tensor(rng.normal(size=A), requires_grad=True)
        sm = torch.softmax(theta, -1)
        pi = (1 - eps) * sm + eps / A
        q = torch.tensor(rng.normal(size=A))
        act = int(rng.integers(A))
        R = float(rng.normal())
        mu_a = float(rng.uniform(0.05, 1.0))
        c = float(rng.choice([1.0, 3.0, 100.0]))
        loss = beta_loo_policy_loss(pi[None], q[None], torch.tensor([act]), torch.tensor([R]), torch.tensor([mu_a]), c)
        loss.sum().backward()
        # Eq. (10) by hand: G = beta (R - Q(A)) dpi(A) + sum_a Q(a) dpi(a), dpi_a/dtheta_b = (1-eps) s_a (1{a=b} - s_b)
        s = sm.detach().numpy()
        beta = min(c, 1.0 / mu_a)
        coef = q.numpy().copy()
        coef[act] += beta * (R - q[act].item())
        jac = (1 - eps) * (np.diag(s) - np.outer(s, s))  # [a, b]
        np.testing.assert_allclose(theta.grad.numpy(), -(coef @ jac), atol=1e-12)


def test_beta_loo_with_c1_is_loo_and_tislr_gradient():
    # c = 1 gives beta = 1 for any mu(A) (Eq. (9)); TISLR's gradient by hand
    A = 3
    theta = torch.tensor([0.2, -0.4, 0.9], requires_grad=True)
    pi = torch.softmax(theta, -1)
    q, R = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5])
    l1 = beta_loo_policy_loss(pi[None], q[None], torch.tensor([1]), R, torch.tensor([0.01]), 1.0)
    l2 = beta_loo_policy_loss(pi[None], q[None], torch.tensor([1]), R, torch.tensor([0.9]), 1.0)
    assert torch.allclose(l1, l2)
    mu = torch.tensor([0.05, 0.9, 0.05])
    c = 2.0
    loss = tislr_policy_loss(pi[None], q[None], torch.tensor([1]), R, mu[None], c)
    (g,) = torch.autograd.grad(loss.sum(), theta)
    p = pi.detach().numpy()
    rho = p / mu.numpy()
    v = (p * q.numpy()).sum()
    dlog = np.eye(A) - p[None, :]  # d log pi_a / d theta_b
    want = min(c, rho[1]) * (0.5 - v) * dlog[1]
    for a in range(A):
        want = want + max(rho[a] - c, 0) * mu[a].item() * (q[a].item() - v) * dlog[a]
    np.testing.assert_allclose(g.numpy(), -want, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# prioritized sequence replay with lazy initialization
def brute_force_probabilities(valid, known, priority, eps):
    """Paper 3.3 estimator by brute force for our partition: cell of known key s_i = s_i and the valid keys after it
    up to the next known key (circular); J(t) = the cell of t and its two neighbour cells (distinct);
    p_hat_t = sum_{J} |I_j| p_j / sum_{J} |I_j|; P(t) = eps / n + (1 - eps) p_hat_t / sum p_hat."""
    N = len(valid)
    keys = [t for t in range(N) if valid[t]]
    n = len(keys)
    ks = [t for t in range(N) if known[t]]
    if not ks:
        return {t: 1.0 / n for t in keys}, {}
    owner = {}
    for t in keys:
        cands = [s for s in ks if s <= t]
        owner[t] = cands[-1] if cands else ks[-1]
    size = {s: sum(1 for t in keys if owner[t] == s) for s in ks}
    p_hat = {}
    for t in keys:
        if known[t]:
            p_hat[t] = priority[t]
            continue
        i = ks.index(owner[t])
        J = {ks[(i - 1) % len(ks)], ks[i], ks[(i + 1) % len(ks)]}
        p_hat[t] = sum(size[s] * priority[s] for s in J) / sum(size[s] for s in J)
    total = sum(p_hat.values())
    return {t: eps / n + (1 - eps) * p_hat[t] / total for t in keys}, p_hat


def numpy_tree(leaves, dtype):
    """A SumTree filled level by level with numpy, every parent left + right (the reference for the walks)."""
    tree = SumTree(len(leaves), dtype)
    t = tree.tree
    t[tree.size : tree.size + len(leaves)] = leaves
    for level in range(tree.depth - 1, -1, -1):
        lo = 1 << level
        t[lo : 2 * lo] = t[2 * lo : 4 * lo : 2] + t[2 * lo + 1 : 4 * lo : 2]
    return tree


def test_sum_tree_prefix_and_find():
    rng = np.random.default_rng(6)
    n = 300
    vals = rng.random(n)
    ftree = SumTree(n, np.float64)
    ftree.set_leaves(list(range(n)), vals.tolist())  # all leaves in one walk
    np.testing.assert_array_equal(ftree.tree, numpy_tree(vals, np.float64).tree)
    ftree.set_leaves([5, 17], [0.0, 2.5])
    vals[[5, 17]] = [0.0, 2.5]
    np.testing.assert_allclose([ftree.prefix_one(i) for i in range(n + 1)], np.r_[0, np.cumsum(vals)], rtol=1e-12)
    u = rng.random(100) * vals.sum()
    assert [ftree.find_one(v) for v in u.tolist()] == np.searchsorted(np.cumsum(vals), u, side="right").tolist()


def test_lazy_priority_estimates_equal_brute_force():
    rng = np.random.default_rng(7)
    for case in range(15):
        N = int(rng.integers(3, 50))
        eps = float(rng.choice([0.0, 0.1, 0.5]))
        lp = LazyPriorities(N, eps)
        valid = np.zeros(N, bool)
        known = np.zeros(N, bool)
        prio = np.zeros(N)
        for step in range(40):  # random interleaving of the four operations, checked after each one
            op = rng.integers(4)
            if op == 0:
                ks = rng.choice(N, size=int(rng.integers(1, 4)), replace=False)
                lp.add(ks)
                valid[ks] = True
            elif op == 1 and valid.any():
                ks = rng.choice(np.flatnonzero(valid), size=int(rng.integers(1, 3)))
                p = rng.uniform(0.01, 2.0, size=len(ks))
                lp.set_priority(ks, p)
                for k_, p_ in zip(ks, p):
                    prio[k_], known[k_] = p_, True
            elif op == 2 and valid.any():
                ks = rng.choice(np.flatnonzero(valid), size=int(rng.integers(1, 3)))
                lp.remove(ks)
                valid[ks] = known[ks] = False
            if not valid.any():
                continue
            want, p_hat = brute_force_probabilities(valid, known, prio, eps)
            keys = np.array(sorted(want))
            drawn, probs = lp.sample(8, np.random.default_rng(step))  # the probabilities the learner's IS weights use
            np.testing.assert_allclose(probs, [want[k] for k in drawn], rtol=1e-10)
            if p_hat:
                np.testing.assert_allclose(lp.estimate(keys), [p_hat[k] for k in keys], rtol=1e-10)
                np.testing.assert_allclose(lp.mass.total, sum(p_hat.values()), rtol=1e-10)
            assert lp.num_valid == valid.sum() and lp.num_known == known.sum()


def chi_square_ok(counts, probs):
    """Pearson chi-square against a Wilson-Hilferty approximation of the 0.999 quantile (no scipy here)."""
    n = counts.sum()
    expected = probs * n
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(probs) - 1
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_lazy_priority_sampling_frequencies_chi_square():
    rng = np.random.default_rng(8)
    N = 60
    lp = LazyPriorities(N, 0.2)
    valid = rng.random(N) < 0.8
    lp.add(np.flatnonzero(valid))
    ks = rng.choice(np.flatnonzero(valid), size=8, replace=False)
    p = rng.uniform(0.1, 3.0, size=8)
    lp.set_priority(ks, p)
    known = np.zeros(N, bool)
    known[ks] = True
    prio = np.zeros(N)
    prio[ks] = p
    want, _ = brute_force_probabilities(valid, known, prio, 0.2)
    keys = np.array(sorted(want))
    samples = np.concatenate([lp.sample(1000, rng)[0] for _ in range(60)])
    counts = np.array([(samples == k).sum() for k in keys])
    assert counts.sum() == len(samples), "sampled an invalid key"
    stat, crit = chi_square_ok(counts, np.array([want[k] for k in keys]))
    assert stat < crit, (stat, crit)
    # the probability returned with each sample is the brute-force one
    s, probs = lp.sample(50, rng)
    np.testing.assert_allclose(probs, [want[k] for k in s], rtol=1e-10)


def test_lazy_priorities_empty_and_uniform_until_known():
    lp = LazyPriorities(10, 0.1)
    with pytest.raises(ValueError):
        lp.sample(4, np.random.default_rng(0))
    lp.add([2, 3, 4])
    keys, probs = lp.sample(100, np.random.default_rng(0))
    assert set(keys) <= {2, 3, 4} and np.allclose(probs, 1 / 3)
    lp.set_priority([3], [2.0])  # one known key: every unknown key's estimate is its priority
    np.testing.assert_allclose(lp.estimate([2, 3, 4]), 2.0)
    lp.remove([3])
    assert lp.num_known == 0 and lp.mass.total == 0.0


def test_sum_tree_scalar_walks_equal_numpy():
    """The node-by-node queries against numpy on random trees, every argument."""
    rng = np.random.default_rng(11)
    for n in (1, 2, 5, 37, 300):
        leaves = (rng.random(n) < rng.choice([0.1, 0.5, 1.0])).astype(np.int64)
        tree = numpy_tree(leaves, np.int64)
        for i in rng.permutation(n)[:8].tolist():  # exact deltas, one leaf at a time
            tree.add_one(i, 1 - 2 * int(leaves[i]))
            leaves[i] = 1 - leaves[i]
        cum = np.r_[0, np.cumsum(leaves)]
        assert [tree.prefix_one(i) for i in range(n + 1)] == cum.tolist()
        assert all(tree.count(a, b) == cum[b] - cum[a] for a in range(n + 1) for b in range(a, n + 1))
        ones = np.flatnonzero(leaves).tolist()
        if not ones:
            continue
        assert [tree.find_one(v) for v in range(len(ones))] == ones
        for i in range(n):  # the last set leaf <= i, circularly; the m-th set leaf after i, circularly
            before = [j for j in ones if j <= i]
            assert tree.last_nonzero_at_or_before(i) == (before[-1] if before else ones[-1])
            after = [j for j in ones if j > i] + [j for j in ones if j <= i]
            for m in range(1, len(ones)):
                assert tree.nth_after(i, m) == after[m - 1], (n, i, m)
    vals = rng.random(100)
    ftree = numpy_tree(vals, np.float64)
    for _ in range(20):  # several leaves at once, sharing parts of their paths: the same tree as setting each alone
        idx = np.sort(rng.choice(100, size=int(rng.integers(1, 6)), replace=False))
        v = rng.random(len(idx))
        ftree.set_leaves(idx.tolist(), v.tolist())
        vals[idx] = v
        np.testing.assert_array_equal(ftree.tree, numpy_tree(vals, np.float64).tree)


class SlowLazyPriorities:
    """Paper 3.3 by brute force over a set of valid keys and a dict of known priorities, and the sampler of
    `LazyPriorities.sample` written plainly (sorted lists, cumulative masses) drawing the same random numbers: the
    keys it samples must be the same."""

    def __init__(self, N, eps):
        self.N, self.eps, self.valid, self.prio = N, eps, set(), {}

    def add(self, keys):
        self.valid |= set(int(k) for k in keys)

    def remove(self, keys):
        for k in keys:
            self.valid.discard(int(k))
            self.prio.pop(int(k), None)

    def set_priority(self, keys, ps):
        for k, p in zip(keys, ps):
            if int(k) in self.valid:
                self.prio[int(k)] = float(p)

    def cells(self):
        """Sorted valid keys, sorted known keys, owner of each valid key, cell size of each known key."""
        keys, ks = sorted(self.valid), sorted(self.prio)
        owner = {t: max([s for s in ks if s <= t], default=ks[-1] if ks else None) for t in keys}
        return keys, ks, owner, {s: sum(owner[t] == s for t in keys) for s in ks}

    def p_hat(self):
        keys, ks, owner, size = self.cells()
        out = {}
        for t in keys if ks else []:
            i = ks.index(owner[t])
            J = {ks[(i - 1) % len(ks)], ks[i], ks[(i + 1) % len(ks)]}
            known = t in self.prio
            out[t] = self.prio[t] if known else sum(size[s] * self.prio[s] for s in J) / sum(size[s] for s in J)
        return out

    def masses(self):
        _, ks, owner, size = self.cells()
        p_hat = self.p_hat()
        return {s: self.prio[s] + sum(p_hat[t] for t in owner if owner[t] == s and t != s) for s in ks}

    def probability(self, keys):
        n, p_hat = len(self.valid), self.p_hat()
        total = sum(p_hat.values())
        if not self.prio or total <= 0:
            return [1.0 / n] * len(keys)
        return [self.eps / n + (1 - self.eps) * p_hat[int(t)] / total for t in keys]

    def sample(self, batch, rng):
        """5 uniforms per draw (LazyPriorities.sample's docstring): rank, uniform coin, mass point, known or not,
        offset; cells by a search in the cumulative masses, keys by position in the sorted list."""
        keys, ks, _, size = self.cells()
        n, masses = len(keys), self.masses()
        total = sum(masses.values())
        cum = np.cumsum([masses[s] for s in ks])
        out = []
        for u_rank, u_coin, u_mass, u_known, u_offset in rng.random((5, batch)).T:
            if ks and total > 0 and u_coin >= self.eps:
                c = ks[min(int(np.searchsorted(cum, u_mass * total, side="right")), len(ks) - 1)]
                w = size[c]
                known = w <= 1 or u_known * masses[c] < self.prio[c]
                out.append(c if known else keys[(keys.index(c) + 1 + min(int(u_offset * (w - 1)), w - 2)) % n])
            else:
                out.append(keys[min(int(u_rank * n), n - 1)])
        return out, self.probability(out)


def check_equals_slow(lp, slow):
    """Every observable of `lp` (and its stored links, sizes, masses and tree sums) against the slow reference."""
    keys, ks, _, size = slow.cells()
    assert lp.num_valid == len(keys) and lp.num_known == len(ks)
    np.testing.assert_array_equal(lp.valid.get(np.arange(lp.capacity)), np.isin(np.arange(lp.capacity), keys))
    np.testing.assert_array_equal(lp.known.get(np.arange(lp.capacity)), np.isin(np.arange(lp.capacity), ks))
    for tree in (lp.valid, lp.known, lp.mass):  # every parent is exactly the sum of its children
        t = tree.tree
        np.testing.assert_array_equal(t[1 : tree.size], t[2 : 2 * tree.size : 2] + t[3 : 2 * tree.size : 2])
    if ks:
        assert lp.prev_known[ks].tolist() == ks[-1:] + ks[:-1] and lp.next_known[ks].tolist() == ks[1:] + ks[:1]
        assert lp.cell_size[ks].tolist() == [size[s] for s in ks]
        masses = slow.masses()
        np.testing.assert_allclose(lp.mass.get(ks), [masses[s] for s in ks], rtol=1e-10)
        p_hat = slow.p_hat()
        np.testing.assert_allclose(lp.estimate(keys), [p_hat[t] for t in keys], rtol=1e-10)
    unknown_leaves = np.setdiff1d(np.arange(lp.capacity), ks)
    assert (lp.mass.get(unknown_leaves) == 0).all()
    if keys:  # the probabilities returned with samples (the IS weights' input)
        drawn, probs = lp.sample(8, np.random.default_rng(0))
        np.testing.assert_allclose(probs, slow.probability(drawn), rtol=1e-10)


@pytest.mark.parametrize("seed", [12, 14, 76])
def test_lazy_priorities_random_operations_equal_slow_reference(seed):
    """Random sequences of add / remove / set_priority / sample / checkpoint round trips (repeated, invalid and
    already-valid keys included) on small key spaces: after each operation every observable equals the slow
    reference, and `sample` returns the same keys as the reference sampler from the same random numbers."""
    rng = np.random.default_rng(seed)
    for case in range(12):
        N = int(rng.integers(3, 60))
        eps = float(rng.choice([0.0, 0.1, 0.5]))
        lp, slow = LazyPriorities(N, eps), SlowLazyPriorities(N, eps)
        for step in range(60):
            op = int(rng.integers(6))
            valid = sorted(slow.valid)
            if op <= 1:  # new keys (some of them already valid)
                ks = rng.choice(N, size=int(rng.integers(1, 6)), replace=True)
                lp.add(ks)
                slow.add(ks)
            elif op == 2 and valid:  # priorities of sampled keys, repeats and a stale key included
                ks = np.append(rng.choice(valid, size=int(rng.integers(1, 5))), rng.integers(N))
                ps = rng.uniform(0.01, 2.0, size=len(ks))
                lp.set_priority(ks, ps)
                slow.set_priority(ks, ps)
            elif op == 3 and valid:  # evictions, known keys and invalid keys among them
                ks = rng.choice(N, size=int(rng.integers(1, 4)), replace=True)
                if slow.prio and rng.random() < 0.3:  # around the wrap: before the first known key, the last one, after it
                    ks = np.array([rng.integers(min(slow.prio) + 1), max(slow.prio), rng.integers(max(slow.prio), N)])
                lp.remove(ks)
                slow.remove(ks)
            elif op == 4 and valid:
                seed = int(rng.integers(1 << 30))
                batch = int(rng.integers(1, 9))
                got, probs = lp.sample(batch, np.random.default_rng(seed))
                want, want_probs = slow.sample(batch, np.random.default_rng(seed))
                assert got.tolist() == want, (case, step)
                np.testing.assert_allclose(probs, want_probs, rtol=1e-10)
            elif op == 5:  # checkpoint round trip into a fresh index (links and sizes rebuilt from the trees)
                fresh = LazyPriorities(N, eps)
                fresh.load_state_dict(lp.state_dict())
                lp = fresh
            check_equals_slow(lp, slow)


def fill_chunk(start, m, A=3, H=4, first_at=(), term_at=()):
    """Slots whose frame encodes their absolute time (so gathers can be checked)."""
    t = np.arange(start, start + m)
    obs = np.zeros((m, 1, 84, 84), np.uint8)
    obs[:, 0, 0, 0] = t % 256
    obs[:, 0, 0, 1] = t // 256
    return {
        "obs": obs,
        "action": (t % A).astype(np.uint8),
        "reward": t.astype(np.float32),
        "term": np.isin(t, term_at),
        "pad": np.zeros(m, bool),
        "first": np.isin(t, first_at),
        "mu": np.full((m, A), 1 / A, np.float32),
        "state": np.full((m, 4, H), 0.5, np.float16),
    }


def test_sequence_replay_keys_eviction_and_gathers():
    T, seg = 4, 20
    rp = SequenceReplay(2 * seg, 2, T, 3, 4, ATARI, uniform_eps=0.1)
    rp.add(0, fill_chunk(0, 3))
    assert len(rp) == 0  # no complete sequence of T + 1 = 5 slots yet
    rp.add(0, fill_chunk(3, 3))
    assert len(rp) == 2  # keys 0 and 1 (slots 0..4 and 1..5)
    rp.add(1, fill_chunk(0, 10))
    assert len(rp) == 2 + 6
    # frames are stored once: one uint8 frame per slot
    assert rp.obs.shape == (2 * seg, 1, 84, 84) and rp.obs.dtype == np.uint8
    # wrap segment 0 around: slots 0..5 are overwritten by times 20..25
    written = 6
    rng = np.random.default_rng(0)
    rp.update_priorities(np.array([0, 1]), np.array([1.0, 2.0]))
    assert rp.index.num_known == 2
    for _ in range(4):
        rp.add(0, fill_chunk(written, 5))
        written += 5
    # times 0..25 written in segment 0; live slots hold times 6..25; valid keys: times 6..21
    valid0 = np.flatnonzero(rp.index.valid.get(np.arange(seg)))
    assert sorted(valid0.tolist()) == sorted([t % seg for t in range(6, 22)])
    assert rp.index.num_known == 0  # the keys that had priorities were evicted
    # every sampled sequence is T + 1 consecutive times of one actor
    for _ in range(20):
        keys, batch = rp.sample(4, rng, "cpu")
        times = batch.obs[:, :, 0, 0, 0].long() + 256 * batch.obs[:, :, 0, 0, 1].long()
        assert (times[:, 1:] - times[:, :-1] == 1).all()
        np.testing.assert_array_equal(batch.rewards.numpy(), times.numpy().astype(np.float32))
        assert batch.obs.shape == (4, T + 1, 1, 84, 84) and batch.weights.max() == 1.0
    # every key known: P(k) = eps / n + (1 - eps) p_k / sum p (3.3), IS weights 1 / (n P(k)) over their batch maximum
    valid = np.flatnonzero(rp.index.valid.get(np.arange(rp.capacity)))
    prio = rng.uniform(0.1, 5.0, len(valid))
    rp.update_priorities(valid, prio)
    keys, batch = rp.sample(64, rng, "cpu")
    p_key = dict(zip(valid.tolist(), (0.1 / len(valid) + 0.9 * prio / prio.sum()).tolist()))
    w = np.array([1.0 / (len(valid) * p_key[k]) for k in keys.tolist()])
    np.testing.assert_allclose(batch.weights.numpy(), w / w.max(), rtol=1e-6)
    assert batch.weights.min() < 0.9


def test_resumed_replay_cuts_each_segment_at_the_checkpoint():
    """--checkpoint-replay resume: each actor's last stored transition was followed by a frame the run never saw, and
    the resumed actor starts a new episode (first). After `cut_at_heads` the last stored slot is a pad: the
    transition into it bootstraps from it (gamma, trace cut), the one out of it carries no loss; without the cut the
    old episode's last transition bootstrapped from the new episode's first frame."""
    T, seg = 4, 40
    rp = reactor.SequenceReplay(2 * seg, 2, T, 3, 4, ATARI, uniform_eps=1.0)
    for segment in (0, 1):
        rp.add(segment, fill_chunk(0, 10))  # an episode still running at the checkpoint
    resumed = reactor.SequenceReplay(2 * seg, 2, T, 3, 4, ATARI, uniform_eps=1.0)
    resumed.load_state_dict(rp.state_dict())
    resumed.cut_at_heads()
    for segment in (0, 1):
        resumed.add(segment, fill_chunk(10, 10, first_at=(10,)))  # the resumed actor's new episode
    for segment in (0, 1):
        slots = segment * seg + np.arange(6, 6 + T + 1)  # key 6: slots 6..10, across the checkpoint at 9 | 10
        f = {k: torch.as_tensor(getattr(resumed, k)[slots][None]) for k in ("term", "pad", "first")}
        disc, c_next, mask = reactor.discounts_and_traces(torch.ones(1, T + 1), f["term"], f["pad"], f["first"], 0.9, 1.0)
        # transitions 6, 7, 8 -> 9: normal; 8 -> 9 bootstraps from x_9 (gamma kept, trace cut); 9 -> 10: no loss
        np.testing.assert_allclose(disc[0].numpy(), [0.9, 0.9, 0.9, 0.0])
        np.testing.assert_allclose(c_next[0].numpy(), [1.0, 1.0, 0.0, 0.0])
        np.testing.assert_allclose(mask[0].numpy(), [1.0, 1.0, 1.0, 0.0])
    assert rp.pad.sum() == 0  # the original replay is untouched


def test_sequence_replay_episode_boundaries_in_batches():
    T = 4
    rp = SequenceReplay(40, 1, T, 3, 4, ATARI, uniform_eps=1.0)
    rp.add(0, fill_chunk(0, 12, first_at=(0, 6), term_at=(5,)))
    keys, batch = rp.sample(32, np.random.default_rng(1), "cpu")
    times = (batch.obs[:, :, 0, 0, 0].long()).numpy()
    np.testing.assert_array_equal(batch.first.numpy(), np.isin(times, [0, 6]))
    np.testing.assert_array_equal(batch.term.numpy(), times == 5)
    # the discount and the traces are cut right after the termination in every sequence that holds it
    disc, c_next, _ = discounts_and_traces(torch.ones(32, T + 1), batch.term, batch.pad, batch.first, 0.99, 1.0)
    assert ((disc == 0) == torch.tensor(times[:, :T] == 5)).all()
    assert ((c_next == 0) == torch.tensor(times[:, :T] == 5)).all()


# ----------------------------------------------------------------------------------------------------------------
# network and loss
def make_batch(B, T, A, H, rng, pad_at=None):
    term = torch.zeros(B, T + 1, dtype=torch.bool)
    pad = torch.zeros_like(term)
    first = torch.zeros_like(term)
    term[0, 3], first[0, 4] = True, True
    if pad_at is not None:
        pad[1, pad_at], first[1, pad_at + 1] = True, True
    mu = torch.softmax(torch.tensor(rng.normal(size=(B, T + 1, A)), dtype=torch.float32), -1)
    return reactor.Batch(
        torch.randint(0, 255, (B, T + 1, 84, 84), dtype=torch.uint8),
        torch.tensor(rng.integers(0, A, (B, T + 1))),
        torch.randn(B, T + 1, dtype=torch.float32),
        term,
        pad,
        first,
        mu,
        tuple(torch.zeros(B, H, dtype=torch.float32) for _ in range(4)),
        torch.ones(B, dtype=torch.float32),
    )


@pytest.fixture
def float32(float64_by_default):
    torch.set_default_dtype(torch.float32)
    yield


def test_network_shapes_uniform_mix_and_gradient_blocking(float32):
    A, K, H = 4, 11, 16
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
    gives the full unroll's Q and Q-LSTM state, across episode starts."""
    x = torch.randn(3, 4, 5, 5)
    x[0, 0, :2] = 0.0
    x.requires_grad_()
    g = torch.randn(3, 8, 5, 5)
    got, want = reactor.CReLU()(x), torch.cat([torch.relu(x), torch.relu(-x)], 1)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
    net = reactor.ReactorNetwork(4, ATARI, 11, 16)
    obs = torch.randint(0, 255, (2, 6, 84, 84), dtype=torch.uint8)
    first = torch.zeros(2, 6, dtype=torch.bool)
    first[0, 2] = first[1, 4] = True
    state = tuple(torch.randn(2, 16) for _ in range(4))
    with torch.no_grad():
        full, q_only = net(obs, first, state), net(obs, first, state, policy=False)
    assert torch.equal(q_only.q, full.q) and q_only.pi is None and q_only.state[2:] == (None, None)
    assert torch.equal(q_only.state[0], full.state[0]) and torch.equal(q_only.state[1], full.state[1])


def test_fused_lstm_equals_step_by_step_reset(float32):
    """The fused nn.LSTM over pieces cut at episode starts gives the outputs, final state and gradients of a
    step-by-step LSTMCell unroll that zeroes each sequence's state right before its `first` frames (the reference)."""
    A, K, H, B, L = 3, 7, 8, 4, 9
    torch.manual_seed(0)
    net = reactor.ReactorNetwork(A, ATARI, K, H)
    obs = torch.randint(0, 255, (B, L, 84, 84), dtype=torch.uint8)
    first = torch.zeros(B, L, dtype=torch.bool)
    first[0, 0] = first[1, 3] = first[1, 7] = first[2, 3] = first[3, 8] = True  # starts at 0, mid, shared, last
    state = tuple(torch.randn(B, H) for _ in range(4))

    def cell_like(lstm):
        cell = torch.nn.LSTMCell(lstm.input_size, lstm.hidden_size)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(cell, name).copy_(getattr(lstm, name + "_l0"))
        return cell

    def reference(net):
        q_cell, pi_cell = cell_like(net.q_lstm), cell_like(net.pi_lstm)
        x = net.torso(obs.reshape(B * L, 1, 84, 84).float() / 255.0).reshape(B, L, -1)
        hq, cq, hp, cp = state
        qs, ps = [], []
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
    for got, want in zip(out.state, state_ref):
        torch.testing.assert_close(got, want)
    (captured["q"].square().sum() + captured["pi"].sum()).backward()
    (q_ref.square().sum() + pi_ref.sum()).backward()
    for lstm, cell in zip((net.q_lstm, net.pi_lstm), cells):
        torch.testing.assert_close(lstm.weight_hh_l0.grad, cell.weight_hh.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lstm.weight_ih_l0.grad, cell.weight_ih.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("distributional,pg", [(True, "beta-loo"), (False, "beta-loo"), (True, "tislr")])
def test_reactor_loss_runs_and_priorities(float32, distributional, pg):
    A, K, H, B, T = 3, 11, 16, 3, 6
    args = reactor.Args(distributional=distributional, policy_gradient=pg, num_atoms=K, lstm_size=H)
    net = reactor.ReactorNetwork(A, ATARI, K, H, distributional=distributional)
    target = reactor.ReactorNetwork(A, ATARI, K, H, distributional=distributional)
    batch = make_batch(B, T, A, H, np.random.default_rng(0), pad_at=2)
    support = torch.linspace(-10, 10, K)
    loss, prio, stats = reactor.reactor_loss(net, target, batch, support, args)
    loss.backward()
    assert torch.isfinite(loss) and prio.shape == (B,) and (prio >= 0).all()
    if distributional:
        assert (prio <= 1 + 1e-6).all()  # mean total variation
    assert all(torch.isfinite(v) for v in stats.values())
    assert net.torso[0].weight.grad.abs().sum() > 0 and net.pi_logits.weight.grad.abs().sum() > 0
    # a pad slot carries no loss: changing its reward and action changes nothing
    batch2 = batch._replace(rewards=batch.rewards.clone(), actions=batch.actions.clone())
    batch2.rewards[1, 2] += 5.0
    batch2.actions[1, 2] = (batch2.actions[1, 2] + 1) % A
    loss2, _, _ = reactor.reactor_loss(net, target, batch2, support, args)
    torch.testing.assert_close(loss, loss2)


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
        lives, rng = info["lives"], np.random.default_rng(0)
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
# the script: bad input, smoke run with 2 actors, save/resume round-trip
SCRIPT = str(REPO / "reactor.py")


def run_script(tmp_path, *flags, timeout=150):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bad_input_fails_with_one_line():
    """In-process (fast); the subprocess cases of the run-lifecycle issue are in tests/test_lifecycle.py."""
    with pytest.raises(SystemExit, match="error: reactor.py is for Atari"):
        reactor.validate_args(reactor.Args(env_id="CartPole-v1"))
    with pytest.raises(SystemExit, match="error: the replay memory needs .* lower --replay-size"):  # start-up RAM check
        check_memory(reactor.SequenceReplay.bytes_needed(10**10, 6, 128, ATARI), "--replay-size", 0.8)  # as __main__ calls it
    with pytest.raises(SystemExit, match="error: --replay-ratio must be > 0, got 0"):
        reactor.validate_args(reactor.Args(replay_ratio=0))
    with pytest.raises(SystemExit, match="error: --torso paper needs 84x84 Atari frames"):
        reactor.validate_args(reactor.Args(env_id="MinAtar/Breakout-v0", torso="paper"))


def test_minatar_run_end_to_end(tmp_path, monkeypatch):
    """MinAtar: (4, 10, 10) 0/1 frames through the actors, the replay and MinAtar's torso; the loop learns, logs and
    saves; the network and replay take their input size from the env."""
    r = run_script(
        tmp_path,
        "--env-id",
        "MinAtar/Breakout-v0",
        "--num-actors",
        "1",
        "--replay-size",
        "600",
        "--learning-starts",
        "100",
        "--replay-ratio",
        "60",
        "--ratio-slack",
        "32",
        "--lstm-size",
        "16",
        "--num-atoms",
        "11",
        "--sequence-length",
        "8",
        "--batch-size",
        "2",
        "--eval-episodes",
        "1",
        "--total-timesteps",
        "300",
        "--no-progress",
        "--no-cuda",
        "--save-model",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["learning_steps"] >= 1 and summary["eval_episodes"] == 1
    model = torch.load(run / "reactor.model", weights_only=False)
    assert model["model"]["torso.0.weight"].shape == (16, 4, 3, 3)  # MinAtar's 3x3 conv on 4 channels
    assert model["args"]["sticky_action_prob"] is None  # the family's standard (0.1) applied by make_env
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "benchmarks"))
    import learning_curves  # its --eval-reactor reads this real saved model

    torch.set_default_dtype(torch.float32)  # as in a real run (this module's fixture set float64; it restores it)
    assert learning_curves.eval_reactor(str(run), 1)["episodes"] == 1 and (run / "eval_greedy.json").exists()


def test_smoke_two_actors_and_resume_with_the_replay(tmp_path):
    """Resume with the replay saved in the checkpoint (--checkpoint-replay); tests/test_lifecycle.py resumes without."""
    common = [
        "--num-actors",
        "2",
        "--replay-size",
        "1200",
        "--learning-starts",
        "100",
        "--replay-ratio",
        "60",
        "--ratio-slack",
        "32",
        "--log-every",
        "1",
        "--lstm-size",
        "32",
        "--num-atoms",
        "11",
        "--no-progress",
        "--sequence-length",
        "8",
        "--batch-size",
        "2",
        "--eval-episodes",
        "0",
        "--no-cuda",
        "--start-method",
        "forkserver",
    ]  # forkserver: the actors share one import of torch (faster here)
    r = run_script(tmp_path, *common, "--total-timesteps", "260", "--checkpoint-every", "200", "--checkpoint-replay")
    assert r.returncode == 0, r.stdout + r.stderr
    (run1,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((run1 / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] >= 260 and summary["learning_steps"] >= 1
    metrics = [json.loads(line) for line in (run1 / "metrics.jsonl").read_text().splitlines()]
    logged = set().union(*metrics)
    for name in (
        "losses/value_loss",
        "losses/policy_loss",
        "losses/entropy",
        "charts/SPS",
        "replay/rho_mean",
        "replay/size",
        "replay/priority_mean",
        "charts/acting_learning_ratio",
        "replay/trace_cut_fraction",
    ):
        assert name in logged, name
    ckpt = torch.load(run1 / "checkpoint.pt", weights_only=False)
    assert ckpt["replay"] is not None and ckpt["learn_steps"] == summary["learning_steps"]
    # without its replay, the checkpoint must leave --learning-starts steps to refill it: refused in one line
    torch.save({**ckpt, "replay": None}, tmp_path / "no_replay.pt")
    r = run_script(tmp_path, "--resume", str(tmp_path / "no_replay.pt"), "--total-timesteps", str(ckpt["global_step"] + 50))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: --resume: ") and "no replay" in r.stderr
    # resume with the replay and run on (no flag repeated); the model is saved at the end
    r = run_script(tmp_path, "--total-timesteps", "360", "--resume", str(run1 / "checkpoint.pt"), "--save-model")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed {run1 / 'checkpoint.pt'} at step {ckpt['global_step']:,}: " in r.stdout
    assert "replay (" in r.stdout and "flags from this command line: save_model, total_timesteps" in r.stdout
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run1.name]
    summary2 = json.loads((run1 / "summary.json").read_text())
    assert summary2["global_step"] >= 360 and summary2["learning_steps"] > ckpt["learn_steps"]
    assert (run1 / "reactor.model").exists()
    # the resumed run cut each actor's segment at the checkpoint (its last stored slot became a pad)
    rep1, rep2 = ckpt["replay"], torch.load(run1 / "checkpoint.pt", weights_only=False)["replay"]
    seg_cap = len(rep1["pad"]) // 2
    assert rep1["written"].max() > 0
    for segment, written in enumerate(rep1["written"]):
        if written == 0:  # (an actor that had sent nothing yet, e.g. one started late on a loaded machine: no head)
            continue
        assert not rep1["pad"][segment * seg_cap + (written - 1) % seg_cap]
        assert rep2["pad"][segment * seg_cap + (written - 1) % seg_cap], segment


def test_learner_fits_a_fixed_batch(float32):
    """A few Adam steps on one batch lower the distributional cross-entropy (the gradients point the right way). 12
    steps: the loss bottoms out near step 10 (the target moves with pi); after that it drifts on a plateau where float
    round-off alone decides whether the end lands 0.2 below the start."""
    torch.manual_seed(0)
    A, K, H, B, T = 3, 11, 16, 2, 5
    args = reactor.Args(num_atoms=K, lstm_size=H, v_min=-2.0, v_max=2.0)
    net = reactor.ReactorNetwork(A, ATARI, K, H)
    target = reactor.ReactorNetwork(A, ATARI, K, H)
    target.load_state_dict(net.state_dict())
    batch = make_batch(B, T, A, H, np.random.default_rng(1))
    support = torch.linspace(-2.0, 2.0, K)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, betas=(0.0, 0.999))
    losses = []
    for _ in range(12):
        loss, _, stats = reactor.reactor_loss(net, target, batch, support, args)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(stats["losses/value_loss"]))
    assert losses[-1] < losses[0] - 0.2, losses


def test_actor_writes_into_replay_what_a_direct_rollout_gives(float32, monkeypatch):
    """Wiring: the real `actor_loop` (in a thread) and `SequenceReplay.add` (the learner's one line per chunk) store
    exactly what a direct rollout written here gives with the same weights and seeds: frames, actions, rewards,
    mu, the float16 LSTM state before each frame, term / first flags, and a pad slot (true last frame, uniform mu)
    after each truncation. MinAtar Breakout with an 8-step limit has terminations and truncations; a wrapper adds
    0.25 x (step in episode) to its rewards so that a dropped or shifted reward shows."""
    import threading
    from types import SimpleNamespace

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

    limit, steps = 8, 150
    monkeypatch.setattr(
        reactor,
        "make_env",
        lambda env_id, seed, args, **k: StepReward(make_minatar_env(env_id, seed, max_episode_steps=limit)),
    )
    args = reactor.Args(
        env_id="MinAtar/Breakout-v0", num_actors=1, lstm_size=8, num_atoms=11, actor_chunk=16, seed=5, actor_sync_every=1
    )
    probe = reactor.make_env(args.env_id, 0, args)
    A, shape = int(probe.action_space.n), probe.observation_space.shape
    torch.manual_seed(0)
    shared = reactor.make_network(args, A, shape)
    channel, stop = reactor.make_channel(torch.multiprocessing.get_context("spawn"), args, A, shape), threading.Event()
    actor_steps, threads = [0], torch.get_num_threads()
    actor = threading.Thread(
        target=reactor.actor_loop,
        args=(
            0,
            args,
            "test",
            shared,
            SimpleNamespace(value=0),
            actor_steps,
            SimpleNamespace(value=0),
            (10**12, 0),
            channel,
            stop,
        ),
    )  # ratio base far ahead: no acting:learning gate
    replay = reactor.SequenceReplay(4000, 1, 8, A, args.lstm_size, obs_shape=shape)
    actor.start()
    try:
        while replay.written[0] < steps:
            msg = channel.get(timeout=30)
            if msg[0] == "chunk":
                replay.add(*channel.read(msg))  # the main loop's lines
                channel.release(msg)
    finally:
        stop.set()
        actor.join()
        torch.set_num_threads(threads)

    env = StepReward(make_minatar_env(args.env_id, args.seed, max_episode_steps=limit))  # the direct rollout
    net = reactor.make_network(args, A, shape)
    net.load_state_dict(shared.state_dict())
    rng, rows, ends = np.random.default_rng(args.seed), [], {"term": 0, "trunc": 0}
    obs, _ = env.reset(seed=args.seed)
    state, first = net.initial_state(1), True
    while len(rows) < replay.written[0]:
        with torch.no_grad():
            o = net(torch.from_numpy(obs)[None, None], torch.zeros(1, 1, dtype=torch.bool), state)
        mu = o.pi[0, 0].numpy().astype(np.float64)
        mu /= mu.sum()
        a = int(rng.choice(A, p=mu))
        nxt, r, term, trunc, _ = env.step(a)
        rows.append((obs, a, r, term, False, first, mu, torch.cat(state, 0).numpy()))
        if term or trunc:
            ends["term" if term else "trunc"] += 1
            if not term:
                rows.append((nxt, 0, 0.0, False, True, False, np.full(A, 1 / A), torch.cat(o.state, 0).numpy()))
            obs, _ = env.reset()
            state, first = net.initial_state(1), True
        else:
            obs, state, first = nxt, o.state, False
    assert ends["term"] >= 1 and ends["trunc"] >= 1
    n = int(replay.written[0])
    assert len({row[2] for row in rows[:n]}) >= 8  # rewards that differ from step to step
    for k, name in enumerate(reactor.SequenceReplay.FIELDS):
        want = np.array([row[k] for row in rows[:n]])
        got = getattr(replay, name)[:n]
        if name in ("mu", "state"):
            np.testing.assert_allclose(got, want.astype(got.dtype), rtol=1e-3, atol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=name)


@pytest.mark.parametrize("distributional,policy_gradient", [(True, "beta-loo"), (False, "beta-loo"), (True, "tislr")])
def test_reactor_loss_end_to_end_equals_a_slow_loop_of_the_paper(float64_by_default, distributional, policy_gradient):
    """reactor_loss through a stub network (parameters = the online Q logits and policy logits; a different target
    net) against a slow loop written from the paper: rho_t = pi(a_t|x_t) / mu(a_t|x_t), c_u = lambda min(1, rho_u)
    cut at episode starts and pads, gamma cut at terminations and pads (Eq. (4)); the distributional Retrace target
    from the *target* net's q and the online pi (3.2, textbook above); Eq. (12) cross-entropy; beta-LOO (Eq. (10))
    with R(A) = scalar Retrace (Eq. (3)) on the target's expected Q; entropy bonus; each sequence's mean over its
    valid steps times its IS weight, averaged over the batch; priorities = mean total variation (3.3). Loss,
    gradients and priorities must agree (they do not if the bootstrap uses the online net, the IS weights are
    dropped, or rho is shifted by one step). The ablations too: Reactor ND (scalar Q, Eq. (3) target, squared error,
    priority mean |TD|) and TISLR (ACER's truncated IS with bias correction, c = 1 so that both terms act)."""
    rng = np.random.default_rng(11)
    B, T, A, K, gamma, lam, c_loo, c_tislr, ent = 3, 6, 3, 11, 0.9, 1.0, 1.0, 1.0, 0.01
    support = torch.linspace(-2.0, 2.0, K)
    args = reactor.Args(
        num_atoms=K,
        v_min=-2.0,
        v_max=2.0,
        gamma=gamma,
        retrace_lambda=lam,
        beta_loo_c=c_loo,
        entropy_coef=ent,
        distributional=distributional,
        policy_gradient=policy_gradient,
        tislr_c=c_tislr,
    )
    q_shape = (B, T + 1, A, K) if distributional else (B, T + 1, A)
    q_on, pl_on = rng.normal(size=q_shape), rng.normal(size=(B, T + 1, A))
    q_tg = rng.normal(size=q_shape)

    class Stub(torch.nn.Module):
        def __init__(self, q, pl):
            super().__init__()
            self.q, self.pl = torch.nn.Parameter(torch.tensor(q)), torch.nn.Parameter(torch.tensor(pl))

        def forward(self, obs, first, state, policy=True):
            return reactor.NetOut(self.q, torch.softmax(self.pl, -1), state)

    term = np.zeros((B, T + 1), bool)
    pad, first = term.copy(), term.copy()
    term[0, 2], first[0, 3] = True, True  # a termination, then a new episode
    pad[1, 4], first[1, 5] = True, True  # a truncation: pad slot (true last frame), then a new episode
    first[2, 0] = True
    actions = rng.integers(0, A, (B, T + 1))
    mu = rng.dirichlet(np.ones(A), size=(B, T + 1))
    rewards = rng.uniform(-0.5, 0.5, (B, T + 1)).astype(np.float32).astype(np.float64)  # stored as float32
    weights = np.array([1.0, 0.4, 0.7])
    batch = reactor.Batch(
        torch.zeros(B, T + 1, 1, 2, 2, dtype=torch.uint8),
        torch.tensor(actions),
        torch.tensor(rewards),
        torch.tensor(term),
        torch.tensor(pad),
        torch.tensor(first),
        torch.tensor(mu),
        tuple(torch.zeros(B, 2) for _ in range(4)),
        torch.tensor(weights),
    )
    net, target = Stub(q_on, pl_on), Stub(q_tg, rng.normal(size=(B, T + 1, A)))
    loss, prios, _ = reactor.reactor_loss(net, target, batch, support, args)
    loss.backward()

    ref = Stub(q_on, pl_on)  # the slow loop, differentiable in the same parameters
    z, total, want_prios = support.double().numpy(), 0.0, []
    for b in range(B):
        pi = torch.softmax(ref.pl[b], -1)
        pi_np = pi.detach().numpy()
        rho = [pi_np[t, actions[b, t]] / mu[b, t, actions[b, t]] for t in range(T + 1)]
        c = np.zeros(T + 1)
        for u in range(1, T + 1):
            if not (first[b, u] or pad[b, u] or pad[b, u - 1]):
                c[u] = lam * min(1.0, rho[u])
        disc = np.array([0.0 if term[b, t] or pad[b, t] else gamma for t in range(T)])
        if distributional:
            q_next = np.exp(q_tg[b]) / np.exp(q_tg[b]).sum(-1, keepdims=True)  # target net's return distributions
            target_dist = textbook_distributional_retrace(rewards[b, :T], disc, c, pi_np, q_next, actions[b], z)
            R = textbook_retrace(rewards[b, :T], disc, np.r_[c[:T], 0.0], pi_np, (q_next * z).sum(-1), actions[b])
        else:  # Reactor ND: the target net's scalar Q in Eq. (3)
            R = textbook_retrace(rewards[b, :T], disc, np.r_[c[:T], 0.0], pi_np, q_tg[b], actions[b])
        per_step, tv = [], []
        for t in range(T):
            if pad[b, t]:
                continue
            a = actions[b, t]
            if distributional:
                logq = torch.log_softmax(ref.q[b, t, a], -1)
                value_loss = -(torch.tensor(target_dist[t]) * logq).sum()
                Q = (torch.softmax(ref.q[b, t], -1) * torch.tensor(z)).sum(-1).detach()
                tv.append(0.5 * np.abs(target_dist[t] - np.exp(logq.detach().numpy())).sum())
            else:
                value_loss = 0.5 * (R[t] - ref.q[b, t, a]) ** 2
                Q = ref.q[b, t].detach()
                tv.append(abs(R[t] - q_on[b, t, a]))
            if policy_gradient == "beta-loo":
                beta = min(c_loo, 1.0 / mu[b, t, a])
                policy_loss = -(beta * (R[t] - Q[a]) * pi[t, a] + (Q * pi[t]).sum())
            else:  # ACER's TISLR: min(c, rho_a)(R - V) log pi(a) + sum_b [rho_b - c]_+ mu_b (Q_b - V) log pi(b)
                V = float((pi_np[t] * Q.numpy()).sum())
                rho_all = pi_np[t] / mu[b, t]
                policy_loss = -(min(c_tislr, rho_all[a]) * (R[t] - V) * torch.log(pi[t, a]))
                for b2 in range(A):
                    correction = max(0.0, rho_all[b2] - c_tislr) * mu[b, t, b2] * (Q[b2] - V)
                    policy_loss = policy_loss - correction * torch.log(pi[t, b2])
            entropy = -(pi[t] * torch.log(pi[t])).sum()
            per_step.append(value_loss + policy_loss - ent * entropy)
        total = total + weights[b] * torch.stack(per_step).mean()
        want_prios.append(np.mean(tv))
    want = total / B
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(net.q.grad, ref.q.grad, rtol=1e-6, atol=1e-8)  # (rewards: float32)
    torch.testing.assert_close(net.pl.grad, ref.pl.grad, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(prios.detach().numpy(), want_prios, rtol=1e-8, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------
# the loop's wiring: the learner's steps, the actor's gate and weight syncs, the replay's gathers, a real run
MINATAR = (4, 10, 10)  # a MinAtar frame's shape


def test_sequence_replay_sample_reads_state_and_mu_of_the_right_slots():
    """Slots whose LSTM state and mu encode (segment, time) (elsewhere they hold constants, where any slot looks right):
    a sampled sequence starts from the state stored with its first slot (its key), each of the 4 parts (h_q, c_q,
    h_pi, c_pi) in its place, and its mu rows are those of its own T + 1 slots, across the wrap of a segment's ring."""
    T, seg, A, H = 4, 20, 3, 4
    rp = SequenceReplay(2 * seg, 2, T, A, H, ATARI, uniform_eps=1.0)

    def encoded_chunk(segment, start, m):
        chunk = fill_chunk(start, m, A, H)
        t = np.arange(start, start + m)
        # part i of the state = 512 i + 128 segment + time: integers < 2048, exact in float16
        state = 512 * np.arange(4)[None, :, None] + 128 * segment + t[:, None, None]
        chunk["state"] = np.broadcast_to(state, (m, 4, H)).astype(np.float16)
        chunk["mu"] = (1000 * segment + 10 * t[:, None] + np.arange(A)).astype(np.float32)
        return chunk

    for start in range(0, 45, 5):  # segment 0 wraps twice (times 25..44 live)
        rp.add(0, encoded_chunk(0, start, 5))
    rp.add(1, encoded_chunk(1, 0, 13))
    keys, batch = rp.sample(200, np.random.default_rng(0), "cpu")
    segment = keys // seg
    assert set(segment.tolist()) == {0, 1} and (keys % seg + T >= seg).any()  # both segments, sequences across the wrap
    times = (batch.obs[:, :, 0, 0, 0].long() + 256 * batch.obs[:, :, 0, 0, 1].long()).numpy()
    for i in range(4):
        want = 512 * i + 128 * segment + times[:, 0]
        np.testing.assert_array_equal(batch.state[i].numpy(), np.repeat(want[:, None], H, 1).astype(np.float32))
    want_mu = 1000 * segment[:, None, None] + 10 * times[:, :, None] + np.arange(A)
    np.testing.assert_array_equal(batch.mu.numpy(), want_mu.astype(np.float32))


class EpisodeStub:
    """A stand-in env with MinAtar's frame shape and 3 actions: pixels (0, 0, 0) and (0, 0, 1) of each frame hold the
    episode and the step in it; episode e is cut by a time limit (truncated, never terminated) after
    lengths[e % len(lengths)] steps; on_step(n) runs within the n-th step of the whole run (n = 1, 2, ...)."""

    def __init__(self, lengths, on_step=lambda n: None):
        self.observation_space, self.action_space = SimpleNamespace(shape=MINATAR), SimpleNamespace(n=3)
        self.lengths, self.on_step, self.episode, self.t, self.steps = lengths, on_step, -1, 0, 0

    def frame(self):
        obs = np.zeros(MINATAR, np.uint8)
        obs[0, 0, :2] = self.episode % 256, self.t
        return obs

    def reset(self, seed=None):
        self.episode, self.t = self.episode + 1, 0
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
    A, shape = env.action_space.n, env.observation_space.shape
    channel = reactor.make_channel(torch.multiprocessing.get_context("spawn"), args, A, shape)
    replay = SequenceReplay(args.replay_size, 1, args.sequence_length, A, args.lstm_size, shape)
    errors, threads = [], torch.get_num_threads()

    def actor():
        try:
            reactor.actor_loop(0, args, "test", shared, weights_version, actor_steps, learner_steps, ratio_base, channel, stop)
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
                replay.add(*channel.read(msg))  # the main loop's lines
                channel.release(msg)
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return replay


def test_actor_loads_new_weights_at_its_sync_points_and_pads_a_truncation_on_a_chunk_s_last_row(float32, monkeypatch):
    """Episodes of 5, 6, 3 and 9 steps (actor_chunk = 5) put time-limit truncations on several rows of the chunks, a
    chunk's last row among them: each pad slot (the true last frame) follows its episode, in the chunk's spare row
    when needed. Within step 6 the learner publishes new weights (a policy that all but always picks action 2) and
    bumps the version: the actor acts with the old weights up to its next sync point (step 8, actor_sync_every = 4)
    and with the new ones from there on (the stored mu shows which)."""
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
    shared, version = reactor.make_network(args, 3, MINATAR), SimpleNamespace(value=0)
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


def test_actor_waits_for_the_learner_at_the_ratio_bound(float32, monkeypatch):
    """The actors' side of the acting:learning ratio: an actor acts while the env steps of all actors, counted from
    ratio_base[0], are at most replay_ratio x (learning steps - ratio_base[1]) + ratio_slack, and waits as soon as one
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
        replay_ratio=2.5,
        ratio_slack=6,
    )
    base, stop = (20, 3), threading.Event()
    learner_steps, actor_steps = SimpleNamespace(value=base[1]), [0, 5]  # (actor 1: 5 steps, then no more)
    acted, waited = [], []  # (env steps since base[0], learning steps since base[1]) at each step, at each wait

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
    steps since ratio_base[1] stay exactly ceil((env steps - ratio_base[0]) / replay_ratio) (none before ratio_base[0],
    e.g. learning_starts), and none while the replay holds less than a batch."""
    args = reactor.Args(replay_ratio=2.5, batch_size=4)
    base, learn_steps = (100, 7), 7
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
    A, T, rng = 3, args.sequence_length, np.random.default_rng(0)
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

    replay_sample, loss_fn = replay.sample, reactor.reactor_loss
    monkeypatch.setattr(replay, "sample", spy_sample)
    monkeypatch.setattr(reactor, "reactor_loss", spy_loss)
    version, learner_steps = SimpleNamespace(value=0), SimpleNamespace(value=0)

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


def test_resume_may_not_change_gamma_or_the_policy_s_uniform_mix():
    """gamma and the uniform mix of the policy (part of the network's output) change the experiment: a resume refuses
    them, as every flag of FIXED_ON_RESUME; a flag outside it (the learning rate) may change."""
    saved = vars(reactor.Args())  # a checkpoint's flags
    for name, value in (("gamma", 0.9), ("policy_uniform_eps", 0.05)):
        flag = "--" + name.replace("_", "-")
        with pytest.raises(SystemExit, match=f"error: --resume: {flag} {value} differs from the checkpoint's"):
            resume_args(reactor.Args(**{name: value}), [flag, str(value)], saved, reactor.FIXED_ON_RESUME)
    args, given = resume_args(reactor.Args(learning_rate=1e-4), ["--learning-rate", "1e-4"], saved, reactor.FIXED_ON_RESUME)
    assert given == ["learning_rate"] and args.learning_rate == 1e-4


def test_run_writes_priorities_back_refreshes_the_target_and_keeps_the_ratio(tmp_path):
    """A real run (1 actor, MinAtar) with --target-update-period 1: its checkpoint's target network equals its model,
    its replay has known keys with priorities (written back by the learner), and each log line keeps
    (env steps - learning_starts) / replay_ratio within [learning steps - 1, learning steps + ratio_slack / replay_ratio]
    (the learner's gate and the actor's gate; the actor may take one step past its check)."""
    r = run_script(
        tmp_path,
        "--env-id",
        "MinAtar/Breakout-v0",
        "--num-actors",
        "1",
        "--replay-size",
        "600",
        "--learning-starts",
        "100",
        "--replay-ratio",
        "20",
        "--ratio-slack",
        "16",
        "--lstm-size",
        "16",
        "--num-atoms",
        "11",
        "--sequence-length",
        "8",
        "--batch-size",
        "2",
        "--eval-episodes",
        "0",
        "--total-timesteps",
        "300",
        "--target-update-period",
        "1",
        "--log-every",
        "1",
        "--checkpoint-every",
        "100000",
        "--checkpoint-replay",
        "--start-method",
        "forkserver",
        "--no-progress",
        "--no-cuda",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt["learn_steps"] >= 5
    for name, tensor in ckpt["model"].items():
        assert torch.equal(ckpt["target_model"][name], tensor), name
    index = ckpt["replay"]["index"]
    capacity = len(index["priority"])
    known = index["known"][len(index["known"]) // 2 :][:capacity] > 0  # the sum tree's leaves
    assert known.sum() >= 2 and (index["priority"][known] > 0).all()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [(r["global_step"], r["charts/learning_steps"]) for r in records if "charts/learning_steps" in r]
    assert len(lines) >= ckpt["learn_steps"]
    for step, learned in lines:
        assert learned - 1 < (step - 100) / 20 <= learned + (16 + 1) / 20, (step, learned)
    logged = [r for r in records if "losses/loss" in r]
    assert len(logged) == ckpt["learn_steps"] and all(0 < r["replay/is_weight_mean"] <= 1 for r in logged)

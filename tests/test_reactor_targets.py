"""Tests of reactor.py's targets and losses: the C51 projection, scalar and distributional Retrace, beta-LOO and TISLR
against deliberately slow textbook versions written from the paper's equations (Gruslys et al. 2018), and the whole
Reactor loss against a slow loop of the paper."""

import numpy as np
import pytest
import reactor_helpers
import torch
from reactor_helpers import ATARI, make_batch

import reactor
from reactor import (
    beta_loo_policy_loss,
    categorical_projection,
    discounts_and_traces,
    distributional_retrace_target,
    retrace_returns,
    tislr_policy_loss,
)

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float32 = reactor_helpers.float32
float64_by_default = reactor_helpers.float64_by_default


# ----------------------------------------------------------------------------------------------------------------
# slow textbook versions
def textbook_projection(atoms, probs, support):
    """C51 Eq. (7): out_i = sum_j p_j clip(1 - |clip(x_j, vmin, vmax) - z_i| / dz, 0, 1), one loop per atom and bin."""
    vmin = support[0]
    vmax = support[-1]
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
        atoms = []
        probs = []
        for n in range(1, T - t + 1):
            g = 0.0
            disc = 1.0
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
        T = int(rng.integers(1, 9))
        A = int(rng.integers(2, 5))
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
        T = int(rng.integers(1, 7))
        A = int(rng.integers(2, 4))
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
    B = 16
    T = 8
    A = 4
    K = 11
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
    T = 5
    A = 3
    K = 11
    rho = torch.ones(1, T + 1)
    term = torch.zeros(1, T + 1, dtype=torch.bool)
    pad = torch.zeros_like(term)
    first = torch.zeros_like(term)
    term[0, 2] = True
    first[0, 3] = True
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
    rewards2 = rewards.clone()
    q2 = q.clone()
    pi2 = pi.clone()
    rewards2[0, 3:] = 0.7
    q2[0, 2:] = torch.softmax(torch.tensor(rng.normal(size=(T - 2, A, K))), -1)
    pi2[0, 2:] = 1.0 / A
    target2 = distributional_retrace_target(rewards2, disc, c_next, pi2, q2, a, support)
    np.testing.assert_allclose(target[0, :3].numpy(), target2[0, :3].numpy(), atol=1e-12)
    # at the terminal transition the target is the projected point mass at r_2
    np.testing.assert_allclose(target[0, 2].numpy(), categorical_projection(rewards[0, 2:3], torch.ones(1), support))
    # truncation at transition 2: slot 3 is the true last frame (pad), slot 4 starts a new episode
    term[0, 2] = False
    first[0, 3] = False
    pad[0, 3] = True
    first[0, 4] = True
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
    q = torch.tensor([1.0, 2.0, -1.0])
    R = torch.tensor([0.5])
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
# the Reactor loss
@pytest.mark.parametrize("distributional,pg", [(True, "beta-loo"), (False, "beta-loo"), (True, "tislr")])
def test_reactor_loss_runs_and_priorities(float32, distributional, pg):
    A = 3
    K = 11
    H = 16
    B = 3
    T = 6
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


def test_learner_fits_a_fixed_batch(float32):
    """A few Adam steps on one batch lower the distributional cross-entropy (the gradients point the right way). 12
    steps: the loss bottoms out near step 10 (the target moves with pi); after that it drifts on a plateau where float
    round-off alone decides whether the end lands 0.2 below the start."""
    torch.manual_seed(0)
    A = 3
    K = 11
    H = 16
    B = 2
    T = 5
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
    B = 3
    T = 6
    A = 3
    K = 11
    gamma = 0.9
    lam = 1.0
    c_loo = 1.0
    c_tislr = 1.0
    ent = 0.01
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
    q_on = rng.normal(size=q_shape)
    pl_on = rng.normal(size=(B, T + 1, A))
    q_tg = rng.normal(size=q_shape)

    class Stub(torch.nn.Module):
        def __init__(self, q, pl):
            super().__init__()
            self.q = torch.nn.Parameter(torch.tensor(q))
            self.pl = torch.nn.Parameter(torch.tensor(pl))

        def forward(self, obs, first, state, policy=True):
            return reactor.NetOut(self.q, torch.softmax(self.pl, -1), state)

    term = np.zeros((B, T + 1), bool)
    pad = term.copy()
    first = term.copy()
    # a termination, then a new episode
    term[0, 2] = True
    first[0, 3] = True
    # a truncation: pad slot (true last frame), then a new episode
    pad[1, 4] = True
    first[1, 5] = True
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
    net = Stub(q_on, pl_on)
    target = Stub(q_tg, rng.normal(size=(B, T + 1, A)))
    loss, prios, _ = reactor.reactor_loss(net, target, batch, support, args)
    loss.backward()

    ref = Stub(q_on, pl_on)  # the slow loop, differentiable in the same parameters
    z = support.double().numpy()
    total = 0.0
    want_prios = []
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
        per_step = []
        tv = []
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

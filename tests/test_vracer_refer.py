"""Tests for vracer_refer.py: estimators against slow textbook loops written from the paper's equations, ReF-ER
bookkeeping, the replay memory, and end-to-end smoke / resume runs with 2 actor processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vracer_refer as vr

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "vracer_refer.py")


# ---------------------------------------------------------------- textbook implementations (paper notation, slow)
def textbook_vtbc(rewards, values, rhos, gamma, terminated):
    """Eq. (8) as a backward loop: V^tbc_t = V_t + min(1, rho_t) [r_{t+1} + gamma V^tbc_{t+1} - V_t]."""
    L = len(rewards)
    nxt = 0.0 if terminated else values[L]  # V^tbc_L: bootstrap V(s_L) on truncation, 0 on termination
    out = np.zeros(L)
    for t in reversed(range(L)):
        rho_bar = min(1.0, rhos[t])
        out[t] = values[t] + rho_bar * (rewards[t] + gamma * nxt - values[t])
        nxt = out[t]
    return out


def textbook_qret(rewards, values, rhos, gamma, terminated):
    """Q^ret_t = r_{t+1} + gamma V^tbc_{t+1} (from Eqs. (6)-(7))."""
    vt = textbook_vtbc(rewards, values, rhos, gamma, terminated)
    tail = 0.0 if terminated else values[len(rewards)]
    return np.array([rewards[t] + gamma * (vt[t + 1] if t + 1 < len(rewards) else tail) for t in range(len(rewards))])


def random_episode(rng, L, terminated):
    rewards = rng.normal(size=L)
    values = rng.normal(size=L + 1)
    if terminated:
        values[L] = 0.0
    rhos = np.exp(rng.normal(scale=1.0, size=L))
    return rewards, values, rhos


# ---------------------------------------------------------------- V^tbc (Eq. (8))
@pytest.mark.parametrize("terminated", [True, False])
def test_vtbc_matches_textbook(terminated):
    rng = np.random.default_rng(0)
    for _ in range(200):
        L = int(rng.integers(1, 60))
        gamma = float(rng.uniform(0.5, 1.0))
        r, v, rho = random_episode(rng, L, terminated)
        np.testing.assert_allclose(
            vr.vtbc_targets(r, v, rho, gamma, terminated), textbook_vtbc(r, v, rho, gamma, terminated), rtol=1e-10, atol=1e-10
        )


def test_vtbc_edge_cases():
    # length-1 episodes: terminal -> V + c (r - V); truncated -> V + c (r + gamma V(s_1) - V)
    out = vr.vtbc_targets([2.0], [0.5, 3.0], [0.5], 0.9, True)
    np.testing.assert_allclose(out, [0.5 + 0.5 * (2.0 - 0.5)])
    out = vr.vtbc_targets([2.0], [0.5, 3.0], [4.0], 0.9, False)
    np.testing.assert_allclose(out, [2.0 + 0.9 * 3.0])
    # terminated ignores whatever is in the tail slot
    np.testing.assert_allclose(vr.vtbc_targets([1.0, 1.0], [0, 0, 100.0], [1, 1], 0.5, True), [1.5, 1.0])
    # rho >= 1 everywhere: V^tbc is the bootstrapped discounted return, independent of V
    rng = np.random.default_rng(1)
    r, v, _ = random_episode(rng, 30, False)
    disc = sum(0.99**k * r[k] for k in range(30)) + 0.99**30 * v[30]
    assert vr.vtbc_targets(r, v, np.full(30, 2.0), 0.99, False)[0] == pytest.approx(disc)
    # rho tiny: trace cut, V^tbc ~ V
    np.testing.assert_allclose(vr.vtbc_targets(r, v, np.full(30, 1e-12), 0.99, False), v[:30], atol=1e-9)


def test_recompute_qret_runs_the_recursion_in_every_episode_at_once():
    """`EpisodeReplay.recompute_qret(top, start)`: from Q^ret at each episode's step `top`, Q^ret_{t-1} = r_t + gamma V^tbc_t
    with V^tbc_t = V_t + min(1, rho_t)(Q^ret_t - V_t), down to the episode's first step, as a loop over one episode does;
    the steps after `top` stay as they were."""
    rng = np.random.default_rng(2)
    for _ in range(10):
        rm = vr.EpisodeReplay(400, 3, 2, 0.97, max_episode_len=40)
        fill(rm, rng, 30)
        rm.rho[:] = np.exp(rng.normal(size=rm.capacity))
        rm.rho[rng.uniform(size=rm.capacity) < 0.05] = 0.0
        rm.qret[:] = rng.normal(size=rm.capacity)
        start = np.array([s for s, _ in rm.episodes])
        top = start + np.array([int(rng.integers(0, L)) for _, L in rm.episodes])
        expected = rm.qret.copy()
        for first, t_top in zip(start, top):
            for t in range(t_top, first, -1):
                vtbc = rm.value[t] + min(1.0, rm.rho[t]) * (expected[t] - rm.value[t])
                expected[t - 1] = rm.scaled_reward[t - 1] + rm.gamma * vtbc
        rm.recompute_qret(top, start)
        np.testing.assert_allclose(rm.qret, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- ReF-ER schedules (Eqs. (12), (13))
def test_refer_cmax_and_lr():
    assert vr.refer_cmax(0, 4.0, 5e-7) == pytest.approx(5.0)
    assert vr.refer_cmax(1_000_000, 4.0, 5e-7) == pytest.approx(1 + 4 / 1.5)
    assert vr.refer_cmax(10**7, 4.0, 5e-7) == pytest.approx(1 + 4 / 6)
    c = [vr.refer_cmax(k, 4.0, 5e-7) for k in range(0, 10**9, 10**7)]
    assert all(x > y for x, y in zip(c, c[1:])) and c[-1] > 1.0  # decreasing towards 1, never below
    assert vr.annealed_lr(2_000_000, 1e-4, 5e-7) == pytest.approx(1e-4 / 2)


def test_refer_beta_update():
    def textbook(beta, frac, D, eta):
        if frac > D:
            return (1 - eta) * beta
        return (1 - eta) * beta + eta

    rng = np.random.default_rng(3)
    for _ in range(100):
        beta = rng.uniform()
        frac = rng.uniform(0, 0.3)
        D = rng.uniform(0.01, 0.3)
        eta = rng.uniform(1e-5, 0.1)
        assert vr.refer_beta_update(beta, frac, D, eta) == pytest.approx(textbook(beta, frac, D, eta))
    # fixed points: 0 when too many far-policy samples, 1 otherwise; stays in [0, 1]
    assert vr.refer_beta_update(0.0, 0.5, 0.1, 1e-4) == 0.0
    assert vr.refer_beta_update(1.0, 0.05, 0.1, 1e-4) == pytest.approx(1.0)
    b = 0.0
    for _ in range(20000):
        b = vr.refer_beta_update(b, 0.0, 0.1, 1e-4)
    assert b == pytest.approx(1 - (1 - 1e-4) ** 20000)
    assert vr.refer_beta_update(0.5, 0.1, 0.1, 0.1) > 0.5  # frac == D is "otherwise" (not >)


# ---------------------------------------------------------------- KL (Eq. (11)) and the per-sample gradient (Eq. (10))
def test_gaussian_kl_both_directions_against_torch():
    g = torch.Generator().manual_seed(0)
    m1 = torch.randn(50, 6, generator=g, dtype=torch.float64)
    m2 = torch.randn(50, 6, generator=g, dtype=torch.float64)
    s1 = torch.rand(50, 6, generator=g, dtype=torch.float64) + 0.1
    s2 = torch.rand(50, 6, generator=g, dtype=torch.float64) + 0.1
    N = torch.distributions.Normal
    ref_mu_pi = torch.distributions.kl_divergence(N(m1, s1), N(m2, s2)).sum(-1)
    ref_pi_mu = torch.distributions.kl_divergence(N(m2, s2), N(m1, s1)).sum(-1)
    torch.testing.assert_close(vr.gaussian_kl(m1, s1, m2, s2), ref_mu_pi)
    torch.testing.assert_close(vr.gaussian_kl(m2, s2, m1, s1), ref_pi_mu)
    assert not torch.allclose(ref_mu_pi, ref_pi_mu)  # the two directions really differ
    torch.testing.assert_close(vr.gaussian_logprob(m1, m2, s2), N(m2, s2).log_prob(m1).sum(-1))


def hand_gradient(mean, std, value, act, mu_mean, mu_std, qret, beta, cmax, kl_direction):
    """d loss / d (mean, std, V) per sample, derived by hand from Eqs. (5), (7), (9)-(11), with loss = -(1/B) sum g."""
    B = mean.shape[0]
    logp = (-0.5 * ((act - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)).sum(-1)
    logmu = (-0.5 * ((act - mu_mean) / mu_std) ** 2 - np.log(mu_std) - 0.5 * np.log(2 * np.pi)).sum(-1)
    rho = np.exp(np.clip(logp - logmu, -7, 7))
    adv = qret - value
    gm = np.zeros_like(mean)
    gs = np.zeros_like(std)
    gv = np.zeros_like(value)
    for i in range(B):
        d = mean[i] - mu_mean[i]
        if kl_direction == "mu_pi":  # D_KL(mu || pi)
            kl_m = d / std[i] ** 2
            kl_s = (std[i] ** 2 - mu_std[i] ** 2 - d**2) / std[i] ** 3
        else:  # D_KL(pi || mu)
            kl_m = d / mu_std[i] ** 2
            kl_s = std[i] / mu_std[i] ** 2 - 1 / std[i]
        gm[i] = (1 - beta) * kl_m
        gs[i] = (1 - beta) * kl_s
        if 1 / cmax < rho[i] < cmax:  # near-policy: + beta * (off-PG and value) gradients
            dlogp_m = (act[i] - mean[i]) / std[i] ** 2
            dlogp_s = ((act[i] - mean[i]) ** 2 / std[i] ** 2 - 1) / std[i]
            gm[i] += -beta * rho[i] * adv[i] * dlogp_m
            gs[i] += -beta * rho[i] * adv[i] * dlogp_s
            gv[i] = -beta * min(1.0, rho[i]) * adv[i]  # V - V^tbc
    return gm / B, gs / B, gv / B, rho


@pytest.mark.parametrize("kl_direction", ["mu_pi", "pi_mu"])
def test_per_sample_gradient_matches_hand_derivation(kl_direction):
    rng = np.random.default_rng(4)
    B = 12
    dA = 3
    mean = rng.normal(size=(B, dA))
    mu_mean = rng.normal(size=(B, dA)) * 0.3
    std = rng.uniform(0.3, 1.0, (B, dA))
    mu_std = rng.uniform(0.3, 1.0, (B, dA))
    mean[:4] = mu_mean[:4] + 0.01  # some near-policy samples
    std[:4] = mu_std[:4]
    act = mu_mean + mu_std * rng.normal(size=(B, dA))
    value = rng.normal(size=B)
    qret = rng.normal(size=B)
    beta = 0.3
    cmax = 2.0
    t = {
        k: torch.tensor(v, requires_grad=k in ("mean", "std", "value"))
        for k, v in dict(mean=mean, std=std, value=value, act=act, mu_mean=mu_mean, mu_std=mu_std, qret=qret).items()
    }
    batch = vr.Batch(t["act"], t["mu_mean"], t["mu_std"], t["qret"])
    loss, info = vr.refer_loss(t["mean"], t["std"], t["value"], batch, beta, cmax, "full", kl_direction)
    loss.backward()
    gm, gs, gv, rho = hand_gradient(mean, std, value, act, mu_mean, mu_std, qret, beta, cmax, kl_direction)
    far = ~((rho > 1 / cmax) & (rho < cmax))
    assert 0 < far.sum() < B  # both kinds present
    np.testing.assert_allclose(info["rho"].numpy(), rho, rtol=1e-10)
    np.testing.assert_array_equal(info["far"].numpy(), far)
    np.testing.assert_allclose(t["mean"].grad.numpy(), gm, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(t["std"].grad.numpy(), gs, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(t["value"].grad.numpy(), gv, rtol=1e-8, atol=1e-12)
    assert np.all(t["value"].grad.numpy()[far] == 0)  # far-policy: no value gradient


def test_ablations_change_the_gradient_as_described():
    rng = np.random.default_rng(5)
    B = 16
    dA = 2
    args = [
        torch.tensor(x)
        for x in (
            rng.normal(size=(B, dA)),
            rng.uniform(0.3, 1, (B, dA)),
            rng.normal(size=B),
            rng.normal(size=(B, dA)),
            rng.normal(size=(B, dA)),
            rng.uniform(0.3, 1, (B, dA)),
            rng.normal(size=B),
        )
    ]

    def grads(refer, beta):
        ps = [a.clone().requires_grad_(i < 3) for i, a in enumerate(args)]
        loss, info = vr.refer_loss(*ps[:3], vr.Batch(*ps[3:]), beta=beta, cmax=1.5, refer=refer)
        loss.backward()
        return ps[0].grad, ps[2].grad, info["far"]

    gm_none, gv_none, _ = grads("none", 0.2)
    gm_r1, gv_r1, far = grads("rule1", 0.2)
    assert far.any() and (~far).any()
    assert torch.all(gm_r1[far] == 0) and torch.all(gv_r1[far] == 0)  # rule 1 only: far samples give nothing
    torch.testing.assert_close(gv_r1[~far], gv_none[~far])  # near samples: plain gradient (beta ignored)
    gm_full_b1, _, _ = grads("full", 1.0)
    torch.testing.assert_close(gm_full_b1, gm_r1)  # full with beta = 1 is rule 1
    _, gv_r2, _ = grads("rule2", 0.2)
    assert torch.all(gv_r2 != 0)  # rule 2: every sample has a value gradient


def test_overflowing_sample_leaves_loss_and_gradient_finite():
    """Far-policy samples whose log pi overflows to -inf, whose rho is NaN, or whose D_KL(mu || pi) is inf: the masks
    select (torch.where) instead of multiplying (0 * inf = NaN), a NaN rho counts as far, and the KL is skipped where
    its weight 1 - beta is 0 (then --refer none, which keeps every sample, stays finite too). float32, as in training."""
    rng = np.random.default_rng(9)
    B = 8
    dA = 2
    mean = rng.normal(size=(B, dA))
    std = rng.uniform(0.3, 1, (B, dA))
    mu_mean = mean + 0.05 * rng.normal(size=(B, dA))
    mu_std = std.copy()
    act = mu_mean + mu_std * rng.normal(size=(B, dA))
    # sample 0: log pi(a_0) = -inf, so rho clamps to e^-7 (far); D_KL(mu_0 || pi_0) = inf
    std[0] = 1e-20
    act[0] = mean[0] + 1.0
    # sample 1: log pi = log mu = -inf, so rho is NaN
    mean[1] = 0.0
    std[1] = 1e-20
    mu_mean[1] = 0.0
    mu_std[1] = 1e-20
    act[1] = 1.0
    # sample 2: log pi finite, D_KL(mu_2 || pi_2) = inf (far)
    act[2] = mean[2]
    std[2] = 1e-20
    mu_mean[2] = mean[2] + 1.0
    value = rng.normal(size=B)
    qret = rng.normal(size=B)
    for refer, beta, rows in (("rule1", 0.5, slice(None)), ("full", 1.0, slice(None)), ("none", 0.5, slice(2, None))):
        ps = [
            torch.tensor(np.asarray(x[rows], np.float32)).requires_grad_(i < 3)
            for i, x in enumerate((mean, std, value, act, mu_mean, mu_std, qret))
        ]
        loss, info = vr.refer_loss(*ps[:3], vr.Batch(*ps[3:]), beta=beta, cmax=2.0, refer=refer)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in ps[:3]), refer
        if refer != "none":
            assert info["far"][:3].all() and not info["far"][3:].all()
            assert torch.isinf(info["kl_mu_pi"][[0, 2]]).all()  # the overflow is there, and masked
    np.testing.assert_array_equal(vr.is_far_policy(np.array([np.nan, 1.0, 5.0, 0.1]), 2.0), [True, False, True, True])


# ---------------------------------------------------------------- replay memory
def fill(rm, rng, n_episodes, lmin=1, lmax=40, obs_dim=3, act_dim=2):
    lens = []
    for _ in range(n_episodes):
        L = int(rng.integers(lmin, lmax + 1))
        term = bool(rng.uniform() < 0.5)
        rm.add_episode(
            rng.normal(size=(L, obs_dim)),
            rng.normal(size=(L, act_dim)),
            np.zeros((L, act_dim)),
            np.ones((L, act_dim)),
            rng.normal(size=L),
            rng.normal(size=L),
            term,
            final_value=float(rng.normal()),
            final_obs=rng.normal(size=obs_dim),
        )
        lens.append(L)
    return lens


def cpu_learner(agent, optimizer, rm, rng, obs_dim=3):
    """The learner's handles on the CPU, with state statistics mean 0 and std 1."""
    return vr.Learner(agent, optimizer, rm, torch.zeros(obs_dim), torch.ones(obs_dim), rng, torch.device("cpu"))


def test_fifo_removal_keeps_at_least_N():
    rng = np.random.default_rng(6)
    N = 300
    rm = vr.EpisodeReplay(N, 3, 2, 0.99, max_episode_len=40)
    inserted = 0
    order = []
    for _ in range(400):
        lens = fill(rm, rng, 1)
        inserted += lens[0]
        order.append(rm.episodes[-1][0])
        assert rm.size >= min(N, inserted)  # never below N once N samples were seen
        assert rm.size - rm.episodes[0][1] < N  # removing one more episode would go below N
        assert rm.size == rm.valid.sum() == sum(L for _, L in rm.episodes)
    assert rm.forced_removals == 0
    # FIFO: stored episodes are the most recently inserted ones, in order
    assert [s for s, _ in rm.episodes] == order[-len(rm.episodes) :]
    # episodes are contiguous and bookkeeping is consistent
    for s, L in rm.episodes:
        assert np.all(rm.episode_start[s : s + L] == s) and np.all(rm.episode_last[s : s + L] == s + L - 1)


def test_empty_and_small_memory():
    rm = vr.EpisodeReplay(100, 3, 2, 0.99, max_episode_len=40)
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError):
        rm.sample(4, rng)
    assert rm.far_fraction() == 0.0
    rm.recompute_all()  # no-op on an empty memory
    fill(rm, rng, 1, lmin=5, lmax=5)
    assert sorted(rm.sample(5, rng)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        rm.add_episode(
            np.zeros((200, 3)), np.zeros((200, 2)), np.zeros((200, 2)), np.ones((200, 2)), np.zeros(200), np.zeros(200), True
        )


def test_sampling_is_distinct_valid_and_roughly_uniform():
    rng = np.random.default_rng(8)
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 200)
    counts = np.zeros(rm.capacity)
    for _ in range(400):
        idx = rm.sample(64, rng)
        assert len(np.unique(idx)) == 64 and rm.valid[idx].all()
        counts[idx] += 1
    c = counts[rm.valid]
    assert abs(c.mean() - 400 * 64 / rm.size) < 1e-9
    assert c.std() / c.mean() < 0.25  # binomial spread, no region starved


def check_qret_consistent(rm):
    """Stored Q^ret equals the full Eq. (8) recursion over the stored V, rho and vboot of every episode."""
    for s, L in rm.episodes:
        sl = slice(s, s + L)
        term = not rm.truncated_last[s + L - 1]
        vals = np.append(rm.value[sl], rm.boot_value[s + L - 1])
        np.testing.assert_allclose(
            rm.qret[sl], textbook_qret(rm.scaled_reward[sl], vals, rm.rho[sl], rm.gamma, term), rtol=1e-9, atol=1e-9
        )


def test_insertion_targets_and_incremental_refresh_equal_full_recomputation():
    rng = np.random.default_rng(9)
    rm = vr.EpisodeReplay(400, 3, 2, 0.97, max_episode_len=40)
    fill(rm, rng, 40)
    check_qret_consistent(rm)  # insertion: rho = 1 and acting-time V
    rm.cmax = 2.0
    rm.recount_far(2.0)
    for step in range(30):
        idx = rm.sample(32, rng)
        boot = idx[rm.truncated_last[idx]]
        rm.update_samples(idx, np.exp(rng.normal(size=32)), rng.normal(size=32), boot, rng.normal(size=len(boot)))
        check_qret_consistent(rm)  # incremental refresh == full recomputation
        n_far_incremental = rm.n_far
        assert n_far_incremental == int((vr.is_far_policy(rm.rho, 2.0) & rm.valid).sum())
        if step % 10 == 0:
            fill(rm, rng, 3)  # insertions/removals in between keep the invariant
            assert rm.n_far == int((vr.is_far_policy(rm.rho, 2.0) & rm.valid).sum())
    for step in range(5):  # traces cut to exactly 0 (rho = 0, e.g. a NaN rho) keep the invariant
        idx = rm.sample(32, rng)
        rho = np.exp(rng.normal(size=32))
        rho[:3] = 0.0
        rm.update_samples(idx, rho, rng.normal(size=32))
        check_qret_consistent(rm)
    before = rm.qret.copy()
    rm.recompute_all()
    np.testing.assert_allclose(rm.qret[rm.valid], before[rm.valid], rtol=1e-9, atol=1e-9)


def test_refresh_delta_equals_the_recursion_from_the_latest_sampled_step():
    """`refresh_delta`, the vectorised refresh of prior steps, gives the Q^ret of the recursion it stands for: Eq. (8)
    run backwards (`recompute_qret`) from the latest sampled step of each sampled episode to the episode's first step."""
    import copy

    rng = np.random.default_rng(16)
    rm = vr.EpisodeReplay(400, 3, 2, 0.97, max_episode_len=40)
    fill(rm, rng, 40)
    recursion = copy.deepcopy(rm)
    for _ in range(30):
        idx = rm.sample(32, rng)
        rho = np.exp(rng.normal(size=32))
        rho[:2] = 0.0
        value = rng.normal(size=32)
        rm.update_samples(idx, rho, value)
        recursion.rho[idx] = rho
        recursion.value[idx] = value
        descending = np.sort(idx)[::-1]
        latest = descending[np.unique(recursion.episode_start[descending], return_index=True)[1]]
        recursion.recompute_qret(latest, recursion.episode_start[latest])
        np.testing.assert_allclose(rm.qret, recursion.qret, rtol=1e-9, atol=1e-9)


def test_reward_scaling_is_rms_without_mean_shift():
    rng = np.random.default_rng(10)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 30)
    for i in range(len(rm.reward)):
        rm.reward[i] += 5.0 * rm.valid[i]
    scale = rm.update_reward_scale()
    r = rm.reward[rm.valid]
    assert scale == pytest.approx(np.sqrt(np.mean(r**2)) + 1e-7)  # Eq. (16)
    np.testing.assert_allclose(rm.scaled_reward[rm.valid], r / scale)  # r / (sigma_r + eps), mean kept
    assert rm.scaled_reward[rm.valid].mean() > 0.5
    check_qret_consistent(rm)  # targets recomputed in the new scale
    m, s = rm.state_stats()
    np.testing.assert_allclose(m, rm.obs[rm.valid].mean(0), rtol=1e-5)  # Eq. (14)
    np.testing.assert_allclose(s, rm.obs[rm.valid].std(0), rtol=1e-5)  # Eq. (15)


def test_rank_per_prefers_high_priorities():
    rng = np.random.default_rng(11)
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 100)
    rm.priority[rm.valid] = rng.uniform(size=rm.valid.sum())
    rm.per_rebuild()
    idx, w = rm.sample_per(2000, rng, 0.7, 0.5)
    assert rm.valid[idx].all() and w.max() == pytest.approx(1.0) and np.all(w > 0)
    assert rm.priority[idx].mean() > rm.priority[rm.valid].mean() + 0.1
    assert np.all(np.diff(w[np.argsort(rm.priority[idx])]) <= 1e-12)  # higher priority -> smaller IS weight


def test_rank_per_draws_steps_stored_since_the_last_sort_uniformly():
    """Between two re-sorts, the steps stored since the last one have no rank, also those written into the slots of
    removed steps: each is drawn with probability 1/n (n stored steps) as under uniform sampling; the ranked steps
    still stored share the rest by rank, P ~ rank^-alpha; IS weights (n P)^-beta over the batch maximum."""
    rng = np.random.default_rng(21)
    alpha = 0.5
    beta = 0.6
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=10)
    fill(rm, rng, 200, lmax=10)
    rm.priority[rm.valid] = rng.uniform(size=rm.valid.sum())
    rm.sample_per(1, rng, alpha, beta)  # sorts
    rank_of = {int(slot): r for r, slot in enumerate(rm.per_order, start=1)}
    valid_at_sort = rm.valid.copy()
    fill(rm, rng, 20, lmax=10)
    new = np.zeros(rm.capacity, bool)
    for start, length in list(rm.episodes)[-20:]:
        new[start : start + length] = True
    assert (new & valid_at_sort).sum() >= 20  # recycled slots: before, their new steps inherited the old ranks
    # the textbook probabilities of the rule
    n = rm.size
    n_new = int(new.sum())
    ranked = [slot for slot in rank_of if rm.valid[slot] and not new[slot]]
    total = sum(rank_of[slot] ** -alpha for slot in ranked)
    P = np.zeros(rm.capacity)
    P[new] = 1.0 / n
    for slot in ranked:
        P[slot] = (1.0 - n_new / n) * rank_of[slot] ** -alpha / total
    assert P.sum() == pytest.approx(1.0)
    draws = 400_000
    idx, w = rm.sample_per(draws, rng, alpha, beta)
    assert rm.valid[idx].all()
    share_new = new[idx].mean()
    assert abs(share_new - n_new / n) < 4 * np.sqrt(n_new / n / draws)  # binomial: 4 standard deviations
    np.testing.assert_allclose(w, (n * P[idx]) ** -beta / ((n * P[idx]) ** -beta).max(), rtol=1e-9)
    top = [slot for slot in ranked if rank_of[slot] <= 20]  # the most likely ranked steps, drawn as often as P says
    counts = np.bincount(idx, minlength=rm.capacity)
    np.testing.assert_allclose(counts[top] / draws, P[top], rtol=0.1)
    rm.per_rebuild()  # the next re-sort ranks the new steps too
    assert rm.ranked[rm.valid].all() and not rm.ranked[~rm.valid].any()


def test_episode_stored_after_a_reward_scale_update_is_scaled():
    """Eq. (16): an episode stored after `update_reward_scale` holds r / scale, and its Q^ret is in that scale."""
    rng = np.random.default_rng(22)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 20)
    rm.reward[rm.valid] *= 5.0
    scale = rm.update_reward_scale()
    assert scale > 3.0
    fill(rm, rng, 3)
    for start, length in list(rm.episodes)[-3:]:
        sl = slice(start, start + length)
        np.testing.assert_allclose(rm.scaled_reward[sl], rm.reward[sl] / scale, rtol=1e-12)
    check_qret_consistent(rm)


def test_far_count_stays_exact_when_cmax_is_one():
    """--refer none --C 0 gives c_max = 1: even the rho = 1 of a new step is far. Insertion counts it as removal
    uncounts it, so n_far stays the exact count through insertions, FIFO removals and gradient steps (was negative)."""
    rng = np.random.default_rng(23)
    rm = vr.EpisodeReplay(200, 3, 2, 0.99, max_episode_len=40)
    rm.recount_far(vr.refer_cmax(0, 0.0, 5e-7))
    assert rm.cmax == 1.0
    for _ in range(40):
        fill(rm, rng, 1)
        assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum()) == rm.size
    args = vr.Args(batch_size=16, buffer_size=200, refer="none", C=0.0)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-4)
    state = {"k": 0, "beta": 1.0}
    for _ in range(10):
        vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
        fill(rm, rng, 1)
        assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum())
        assert 0.0 <= rm.far_fraction() <= 1.0


def test_replay_and_train_step_with_one_action_dimension():
    """1-D action tasks (InvertedPendulum): the actors hand over (L, 1) action blocks; the memory keeps them 2-D, and
    sampling (uniform and rank PER), the loss, the write-back and a checkpoint round trip work as with several."""
    rng = np.random.default_rng(24)
    rm = vr.EpisodeReplay(300, 3, 1, 0.99, max_episode_len=40)
    act = rng.normal(size=(7, 1))
    rm.add_episode(
        rng.normal(size=(7, 3)), act, np.zeros((7, 1)), np.ones((7, 1)), rng.normal(size=7), rng.normal(size=7), True
    )
    assert rm.action.shape == rm.mu_mean.shape == rm.mu_std.shape == (rm.capacity, 1)
    np.testing.assert_array_equal(rm.action[:7], act.astype(np.float32))
    fill(rm, rng, 30, act_dim=1)
    rm.update_reward_scale()
    agent = vr.Agent(3, 1)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    state = {"k": 0, "beta": 0.0}
    for per in ("none", "rank"):
        args = vr.Args(batch_size=16, buffer_size=300, per=per)
        for _ in range(5):
            stats = vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
            assert torch.isfinite(stats).all()
    check_qret_consistent(rm)
    restored = vr.EpisodeReplay(300, 3, 1, 0.99, max_episode_len=40)
    restored.load_state_dict(rm.state_dict())
    np.testing.assert_array_equal(restored.action, rm.action)
    np.testing.assert_array_equal(restored.qret, rm.qret)


def test_noise_and_action_scaling():
    rng = np.random.default_rng(12)
    z = vr.sample_noise(rng, (200_000,), "truncnorm")
    assert np.abs(z).max() <= 3.0 and abs(z.std() - 0.9866) < 0.01  # std of N(0,1) truncated at +-3
    z = vr.sample_noise(rng, (200_000,), "smarties")
    assert np.abs(z).max() <= 3.0
    assert np.abs(vr.sample_noise(rng, (200_000,), "normal")).max() > 3.0
    low = np.array([-0.4, 0.0])
    high = np.array([0.4, 2.0])
    np.testing.assert_allclose(vr.to_env_action(np.array([-1.0, 1.0]), low, high), [-0.4, 2.0])
    np.testing.assert_allclose(vr.to_env_action(np.array([0.0, 0.0]), low, high), [0.0, 1.0])
    np.testing.assert_allclose(vr.to_env_action(np.array([2.0, -3.0]), low, high, clip=True), [0.4, 0.0])


def test_agent_initialisation():
    torch.manual_seed(0)
    for std_map in ("softplus", "cheap_softplus"):
        agent = vr.Agent(11, 3, 128, 0.2**0.5, std_map)
        m, s, v = agent(torch.randn(64, 11))
        torch.testing.assert_close(s, torch.full((64, 3), 0.2**0.5))  # Sigma_0 = 0.2 I
        assert m.abs().max() < 0.2 and v.abs().max() < 0.2  # near-zero outputs
    assert vr.Agent(11, 3, 128, residual=True)(torch.randn(2, 11))[0].shape == (2, 3)


# ---------------------------------------------------------------- end to end (subprocess, 2 actors)
def run_script(tmp_path, *flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, "--no-progress", "--no-cuda", *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


SMALL = (
    "--env-id Hopper-v5 --num-actors 2 --learning-starts 500 --buffer-size 500 --batch-size 32 --log-every 100 "
    "--stats-every 200"
).split()


def test_smoke_two_actors_and_resume_round_trip(tmp_path):
    p = run_script(
        tmp_path,
        *SMALL,
        *"--total-timesteps 1300 --checkpoint-every 400 --checkpoint-replay --save-model --eval-episodes 1".split(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = next((tmp_path / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] >= 1300
    assert summary["grad_steps"] >= 600  # F = 1 after learning starts
    names = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        names |= set(json.loads(line))
    for n in (
        "charts/episodic_return",
        "charts/SPS",
        "losses/policy_loss",
        "losses/value_loss",
        "refer/beta",
        "refer/far_policy_frac",
        "refer/c_max",
        "refer/kl",
        "charts/learning_rate",
        "eval/episodic_return",
    ):
        assert n in names, n
    assert (run / "vracer_refer.model").exists()
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt["replay"] is not None and ckpt["state"]["k"] > 0
    # resume (the checkpoint's flags, the same run folder): network, optimizer, beta, k, statistics and the replay
    # memory come back; learning continues at once
    p2 = run_script(
        tmp_path,
        "--total-timesteps",
        str(ckpt["global_step"] + 300),
        "--checkpoint-every",
        "150",
        "--resume",
        str(run / "checkpoint.pt"),
    )
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "replay memory (" in p2.stdout and "checkpoint_every, cuda, progress, total_timesteps; runs to" in p2.stdout
    ckpt2 = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ckpt2["global_step"] > ckpt["global_step"] and ckpt2["t0"] == ckpt["t0"]  # the same F clock
    resumed = [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "charts/grad_steps" in r and r["global_step"] > ckpt["global_step"]
    ]
    assert resumed and min(r["charts/grad_steps"] for r in resumed) > ckpt["state"]["k"]  # k continues, no restart
    assert float(ckpt2["optimizer"]["state"][0]["step"]) == ckpt2["state"]["k"]  # one Adam step per k, across the resume
    first = min(resumed, key=lambda r: r["global_step"])  # Eq. (12) moves beta by at most beta_lr per step
    assert abs(first["refer/beta"] - ckpt["state"]["beta"]) <= 1e-4 * (first["charts/grad_steps"] - ckpt["state"]["k"])
    for r in resumed + [{"global_step": ckpt2["global_step"], "charts/grad_steps": ckpt2["state"]["k"]}]:
        due = (r["global_step"] - ckpt["t0"]) / ckpt["args"]["F"]  # k keeps up with (t - t0)/F (App. C Alg. 1)
        assert due - vr.GRAD_STEPS_PER_READ - 64 <= r["charts/grad_steps"] <= due + 1, (r, due)
    torch.testing.assert_close(ckpt2["obs_mean"], ckpt["obs_mean"])  # frozen state statistics restored
    # without its replay memory, a resumed run must have the steps to refill it (learning_starts) and learn, or refuse
    del ckpt2["replay"]
    torch.save({**ckpt2, "replay": None}, tmp_path / "no_replay.pt")
    p3 = run_script(
        tmp_path, "--total-timesteps", str(ckpt2["global_step"] + 400), "--resume", str(tmp_path / "no_replay.pt"), timeout=60
    )
    assert p3.returncode != 0 and "Traceback" not in p3.stderr, p3.stderr[-2000:]
    assert p3.stderr.strip().splitlines()[-1].endswith("(--learning-starts; the checkpoint has no replay memory)")


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


def test_resume_refuses_another_gamma():
    """gamma is in FIXED_ON_RESUME: the stored Q^ret and trace coefficients were computed with the old one."""
    from common.args import resume_args

    with pytest.raises(SystemExit, match="^error: --resume: --gamma "):
        resume_args(vr.Args(gamma=0.99), ["--gamma", "0.99"], vars(vr.Args()), vr.FIXED_ON_RESUME)


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


def test_replay_memory_need_is_the_size_of_its_arrays():
    """The start-up refusal of a replay that cannot fit (`--buffer-size`) uses this count before allocating."""
    rm = vr.EpisodeReplay(3000, 11, 3, 0.99, max_episode_len=1000)
    arrays = sum(v.nbytes for v in vars(rm).values() if isinstance(v, np.ndarray))
    assert vr.EpisodeReplay.bytes_needed(3000, 11, 3, 1000) == arrays


@pytest.mark.parametrize("residual", [False, True])
def test_numpy_actor_forward_matches_agent(residual):
    torch.manual_seed(1)
    agent = vr.Agent(11, 3, 128, 0.5, "cheap_softplus", residual)
    obs_mean = np.random.default_rng(0).normal(size=11)
    obs_std = np.full(11, 2.0)
    obs = np.random.default_rng(1).normal(size=(5, 11))
    with torch.no_grad():
        m, s, v = agent(
            (torch.as_tensor(obs, dtype=torch.float32) - torch.as_tensor(obs_mean, dtype=torch.float32))
            / torch.as_tensor(obs_std, dtype=torch.float32)
        )
    net = vr.numpy_params(agent, "cheap_softplus", obs_mean, obs_std)
    for i in range(5):
        mi, si, vi = vr.numpy_forward(net, obs[i], residual)
        np.testing.assert_allclose(mi, m[i].numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(si, s[i].numpy(), rtol=1e-5)
        assert vi == pytest.approx(float(v[i]), abs=1e-5)


def test_train_step_nan_guard():
    """train_step's NaN guard: a poisoned target raises FloatingPointError before the replay is touched (the main loop
    then stops with the reason); an overflowing D_KL(mu || pi) that is masked (rule 1) or of weight 0 (--refer none)
    does not stop the run."""
    rng = np.random.default_rng(14)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 30)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-4)

    def step(state, refer):
        args = vr.Args(batch_size=16, buffer_size=300, refer=refer)
        return vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)

    state = {"k": 0, "beta": 0.5}
    assert torch.isfinite(step(state, "full")).all() and state["k"] == 1 and 0.5 < state["beta"] < 0.51
    rm.mu_std[rm.valid] = 1e30  # sigma_mu^2 / sigma_pi^2 overflows float32: D_KL(mu || pi) = inf; log rho clips (far)
    for refer in ("rule1", "none"):
        stats = step({"k": 1, "beta": 0.5}, refer)
        assert torch.isfinite(stats[:3]).all() and torch.isinf(stats[3]), refer
    rm.mu_std[rm.valid] = 1.0
    rm.qret[rm.valid] = np.nan
    rho_before = rm.rho.copy()
    weights_before = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()
    adam_before = [{name: v.clone() for name, v in s.items()} for s in opt.state.values()]
    with pytest.raises(FloatingPointError, match="non-finite loss at gradient step 1"):
        step(state, "full")
    np.testing.assert_array_equal(rm.rho, rho_before)
    assert state["k"] == 1
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
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 40)
    rm.update_reward_scale()
    args = vr.Args(batch_size=32, buffer_size=400, refer=refer, per=per, C=0.5)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-2)
    state = {"k": 0, "beta": 1.0 if refer == "none" else 0.0}
    for _ in range(30):
        stats = vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
        assert torch.isfinite(stats).all()
    check_qret_consistent(rm)  # the refresh keeps Q^ret equal to the full recursion in every variant
    assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum())
    assert state["k"] == 30
    assert (state["beta"] == 1.0) if refer == "none" else (0.0 < state["beta"] < 0.01)


def test_train_step_anneals_learning_rate_and_cmax():
    """Eq. (13) in train_step: gradient step k uses eta/(1 + A k) (a first Adam step moves each weight by about the
    learning rate) and c_max = 1 + C/(1 + A k) (the replay's far-policy count uses it)."""
    rng = np.random.default_rng(25)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 30)
    args = vr.Args(batch_size=16, buffer_size=300, learning_rate=1e-3, A=0.1, C=2.0)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-12)
    state = {"k": 3, "beta": 0.5}
    before = torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()
    vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
    moved = (torch.nn.utils.parameters_to_vector(agent.parameters()).detach() - before).abs().max()
    assert float(moved) == pytest.approx(vr.annealed_lr(3, 1e-3, 0.1), rel=1e-3)  # 1e-3 / 1.3
    for k in range(4, 8):
        vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
        assert opt.param_groups[0]["lr"] == pytest.approx(vr.annealed_lr(k, 1e-3, 0.1))
        assert rm.cmax == pytest.approx(vr.refer_cmax(k, 2.0, 0.1))
    assert state["k"] == 8


def test_rank_per_step_weights_the_loss_and_writes_priorities_back():
    """--per rank in train_step: the loss is the one weighted by the batch's IS weights, and the sampled steps'
    priorities become |rho-bar (Q^ret - V)| of this step (the next re-sort ranks by them)."""
    import copy

    rng = np.random.default_rng(26)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 40)
    rm.update_reward_scale()
    rm.priority[rm.valid] = rng.uniform(0.1, 2.0, rm.valid.sum())
    rm.per_rebuild()
    args = vr.Args(batch_size=32, buffer_size=400, per="rank", A=0.1)
    torch.manual_seed(3)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    state = {"k": 2, "beta": 0.5}
    # the batch train_step will draw (the same generator state) and the loss it should minimise
    beta_is = min(1.0, args.per_beta0 + (1.0 - args.per_beta0) * args.A * 2)
    idx, w = rm.sample_per(args.batch_size, copy.deepcopy(rng), args.per_alpha, beta_is)
    assert w.min() < 0.9  # weights that matter
    act = torch.as_tensor(rm.action[idx])
    mu_mean = torch.as_tensor(rm.mu_mean[idx])
    mu_std = torch.as_tensor(rm.mu_std[idx])
    qret = torch.as_tensor(rm.qret[idx], dtype=torch.float32)
    with torch.no_grad():
        mean, std, value = agent(torch.as_tensor(rm.obs[idx]))
    cmax = vr.refer_cmax(2, args.C, args.A)
    weights = torch.as_tensor(w, dtype=torch.float32)
    weighted, info = vr.refer_loss(mean, std, value, vr.Batch(act, mu_mean, mu_std, qret, weights), 0.5, cmax)
    unweighted, _ = vr.refer_loss(mean, std, value, vr.Batch(act, mu_mean, mu_std, qret), 0.5, cmax)
    assert abs(float(weighted) - float(unweighted)) > 0.01 * abs(float(unweighted))
    stats = vr.train_step(cpu_learner(agent, opt, rm, rng), state, args)
    assert float(stats[0]) == pytest.approx(float(weighted), rel=1e-5)
    np.testing.assert_allclose(rm.priority[idx], info["abs_err"].double().numpy(), rtol=1e-5)


def test_learn_updates_statistics_every_stats_every_steps_then_publishes():
    """`learn`, the main loop's LEARN phase: gradient steps while k < (t - t0)/F (at most GRAD_STEPS_PER_READ); at
    k = stats_every, first the reward scale (Eq. (16)), the PER re-sort and the state statistics (--state-stats-rate);
    after the steps the new weights are published to the actors."""
    rng = np.random.default_rng(27)
    rm = vr.EpisodeReplay(400, 3, 2, 0.99, max_episode_len=40)
    fill(rm, rng, 40)
    scale_before = rm.update_reward_scale()
    rm.reward[rm.valid] *= 10.0  # the next reward-scale update must see this
    args = vr.Args(batch_size=16, buffer_size=400, stats_every=5, state_stats_rate=0.5, per="rank")
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    state = {"k": 0, "beta": 0.0}
    obs_mean = torch.zeros(3)
    obs_std = torch.ones(3)
    stats_sum = torch.zeros(6, dtype=torch.float64)
    published = []  # the weights each publish() hands to the actors

    def weights():
        return torch.nn.utils.parameters_to_vector(agent.parameters()).detach().clone()

    def learn_until(steps_due):
        learner = vr.Learner(agent, opt, rm, obs_mean, obs_std, rng, torch.device("cpu"))
        return vr.learn(learner, state, args, steps_due, stats_sum, lambda: published.append(weights()))

    initial = weights()
    assert learn_until(5) == 5 and state["k"] == 5
    assert rm.reward_scale == scale_before  # not yet: the update comes before gradient step k = stats_every
    assert len(published) == 1 and not torch.equal(published[0], initial)
    torch.testing.assert_close(published[0], weights())  # the weights after the steps
    assert torch.isfinite(stats_sum).all() and stats_sum[0] != 0
    fill(rm, rng, 2)  # new steps, unranked until the re-sort
    assert learn_until(5.5) == 1 and state["k"] == 6 and len(published) == 2
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


# ---------------------------------------------------------------- wiring: actor ring -> replay
def test_actor_rings_into_replay_equal_a_direct_rollout(monkeypatch):
    """What the real `actor_loop` writes into its ring and `store_episodes` (the learner's reader, draining the ring
    while it wraps, episodes spanning several reads) puts into the replay
    (s_t, u_t, mu_t, r_{t+1}, V(s_t), terminated / truncated, s_T and V(s_T) of a truncated end) equals a direct
    rollout of the same env, written here from the paper's Alg. 2, with the same weights, state statistics and noise;
    a 25-step time limit gives both terminations (Hopper falls) and truncations."""
    import threading

    from common.mujoco_env import make_mujoco_env

    limit = 25
    seed = 3
    steps = 400
    monkeypatch.setattr(vr, "make_env", lambda env_id, s, *a, **k: make_mujoco_env(env_id, s, max_episode_steps=limit))
    args = vr.Args(env_id="Hopper-v5", num_actors=1, ring_size=48)  # the ring wraps 8 times, read while written
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
    shared.weights_version[0] = 1
    actor = threading.Thread(target=vr.actor_loop, args=(0, args, obs_dim, act_dim, shared, seed, "test"), daemon=True)
    rm = vr.EpisodeReplay(10_000, obs_dim, act_dim, args.gamma, max_episode_len=limit)
    partial = []
    n_read = 0
    n_finished = 0
    actor.start()
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
    for t in range(steps):
        mean, std, v = vr.numpy_forward(net, obs)
        u = mean + std * vr.sample_noise(noise, act_dim, args.action_noise)
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

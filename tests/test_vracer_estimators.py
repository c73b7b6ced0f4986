"""vracer_refer.py, the method's pieces against slow textbook versions written from the paper (V^tbc of Eq. (8), read
from the replay memory, is in tests/test_vracer_replay.py): the c_max, learning-rate and beta schedules (Eqs. (12)-
(13)), the KL of Eq. (11) and the per-sample ReF-ER gradient of Eq. (10) with its ablations, the action noise and
scaling (App. A-B), the network's initialisation and the actors' numpy forward."""

import numpy as np
import pytest
import torch

import vracer_refer as vr


# ----------------------------------------------------------------------------------------------------------------
# ReF-ER schedules (Eqs. (12), (13))
def test_refer_cmax_and_lr():
    assert vr.refer_cmax(0, 4.0, 5e-7) == pytest.approx(5.0)
    assert vr.refer_cmax(1_000_000, 4.0, 5e-7) == pytest.approx(1 + 4 / 1.5)
    assert vr.refer_cmax(10**7, 4.0, 5e-7) == pytest.approx(1 + 4 / 6)
    c = [vr.refer_cmax(k, 4.0, 5e-7) for k in range(0, 10**9, 10**7)]
    assert all(x > y for x, y in zip(c, c[1:])) and c[-1] > 1.0  # decreasing towards 1, never below
    assert vr.annealed_learning_rate(2_000_000, 1e-4, 5e-7) == pytest.approx(1e-4 / 2)


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


# ----------------------------------------------------------------------------------------------------------------
# KL (Eq. (11)) and the per-sample gradient (Eq. (10))
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


# ----------------------------------------------------------------------------------------------------------------
# Actions, network (App. A, B)
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

"""plr_ppo.py's estimators against their oracles: PLR's replay distribution (Eqs. (1), (3), (4)) against a slow
textbook version, the level scores (Table 1) and GAE with termination vs truncation hand-computed and against the
textbook GAE (tests/plr_helpers.py), a hand-computed PPO loss and the return normaliser against gym's
NormalizeReward. The sampler: tests/test_plr_sampler.py; the wiring: tests/test_plr_wiring.py; the loop's
contract: tests/test_plr_loop.py."""

import math

import numpy as np
import pytest
import torch
from plr_helpers import textbook_gae

import plr_ppo
from plr_ppo import (
    Args,
    BoundedLevelSampler,
    SamplerConfig,
    compute_gae,
    replay_distribution,
    score_distribution,
    staleness_distribution,
    step_scores,
)


# ----------------------------------------------------------------------------------------------------------------
# Textbook implementations (deliberately slow loops in the paper's notation)
def textbook_replay_distribution(S, C, c, seen, transform, beta, rho):
    """Eq. (1) with Eq. (3) and Eq. (4): loops over Λ_seen; C_i = timestamps, c = episode count."""
    L = len(S)
    seen_idx = [i for i in range(L) if seen[i]]
    P_S = np.zeros(L)
    P_C = np.zeros(L)
    if not seen_idx:
        return np.zeros(L)
    h = {}
    for i in seen_idx:
        if transform == "rank":  # rank among seen scores sorted in descending order; ties by index
            rank = 1 + sum(1 for j in seen_idx if S[j] > S[i] or (S[j] == S[i] and j < i))
            h[i] = 1.0 / rank
        elif transform == "power":
            h[i] = max(S[i], 0.0)
    if transform == "greedy":
        best = max(seen_idx, key=lambda i: (S[i], -i))
        P_S[best] = 1.0
    else:
        z = sum(h[j] ** (1.0 / beta) for j in seen_idx)
        for i in seen_idx:  # all-zero weights: uniform over Λ_seen (our documented fallback)
            P_S[i] = h[i] ** (1.0 / beta) / z if z > 0 else 1.0 / len(seen_idx)
    zc = sum(c - C[j] for j in seen_idx)
    for i in seen_idx:
        P_C[i] = (c - C[i]) / zc if zc > 0 else 1.0 / len(seen_idx)
    return np.array([(1 - rho) * P_S[i] + rho * P_C[i] for i in range(L)])


# ----------------------------------------------------------------------------------------------------------------
# replay_distribution: Eqs. (1), (3), (4)
@pytest.mark.parametrize("transform", ["rank", "power", "greedy"])
def test_replay_distribution_matches_textbook(transform):
    rng = np.random.default_rng(0)
    for case in range(300):
        L = int(rng.integers(1, 30))
        S = rng.random(L) * rng.choice([0.1, 1.0, 10.0])
        if case % 5 == 0:
            S = np.round(S, 1)  # ties
        c = int(rng.integers(1, 100))
        C = rng.integers(0, c + 1, size=L)
        seen = rng.random(L) < 0.7
        beta = float(rng.choice([0.1, 0.3, 1.0, 2.0]))
        rho = float(rng.choice([0.0, 0.1, 0.3, 1.0, rng.random()]))
        got = replay_distribution(S, c - C, seen, transform, beta, rho)
        want = textbook_replay_distribution(S, C, c, seen, transform, beta, rho)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"case {case}")


def test_replay_distribution_properties():
    rng = np.random.default_rng(1)
    for _ in range(200):
        L = int(rng.integers(2, 50))
        S = rng.normal(size=L)
        st = rng.integers(0, 20, size=L).astype(float)
        seen = rng.random(L) < 0.6
        seen[rng.integers(L)] = True
        for transform in ("rank", "power", "greedy"):
            p = replay_distribution(S, st, seen, transform, 0.3, 0.2)
            assert abs(p.sum() - 1) < 1e-9 and (p >= 0).all()  # sums to 1
            assert (p[~seen] == 0).all()  # unseen gets 0
        # ρ = 1 is pure staleness, Eq. (4)
        np.testing.assert_allclose(replay_distribution(S, st, seen, "rank", 0.1, 1.0), staleness_distribution(st, seen))
        # rank is invariant to monotone rescaling of the scores
        np.testing.assert_allclose(
            replay_distribution(S, st, seen, "rank", 0.5, 0.3),
            replay_distribution(np.exp(3 * S) + 7, st, seen, "rank", 0.5, 0.3),
        )
    # β -> 0 concentrates on the argmax (rank and power)
    S = np.array([0.3, 2.0, 1.0, 1.9])
    seen = np.ones(4, bool)
    for transform in ("rank", "power"):
        p = score_distribution(S, seen, transform, 1e-3)
        assert p[1] > 0.999, (transform, p)
    # large β flattens rank prioritization toward uniform
    assert np.ptp(score_distribution(S, seen, "rank", 1e4)) < 1e-3
    # nothing seen: all zeros; all-zero power scores: uniform over seen
    assert (replay_distribution(S, np.ones(4), np.zeros(4, bool)) == 0).all()
    np.testing.assert_allclose(
        score_distribution(np.zeros(4), np.array([1, 1, 0, 1], bool), "power", 0.1), [1 / 3, 1 / 3, 0, 1 / 3]
    )


# ----------------------------------------------------------------------------------------------------------------
# Scores: hand-computed cases
def test_policy_scores_uniform_onehot_and_handworked():
    uniform = np.zeros((1, 1, 7))
    assert step_scores("policy_entropy", None, None, uniform)[0, 0] == pytest.approx(1.0)
    assert step_scores("least_confidence", None, None, uniform)[0, 0] == pytest.approx(1 - 1 / 7)
    assert step_scores("min_margin", None, None, uniform)[0, 0] == pytest.approx(1.0)
    onehot = np.array([[[100.0, 0, 0, 0, 0, 0, 0]]])
    for s in ("policy_entropy", "least_confidence", "min_margin"):
        assert step_scores(s, None, None, onehot)[0, 0] == pytest.approx(0.0, abs=1e-6)
    p = np.array([0.7, 0.2, 0.1])
    logits = np.log(p)[None, None]
    assert step_scores("policy_entropy", None, None, logits)[0, 0] == pytest.approx(-(p * np.log(p)).sum() / np.log(3))
    assert step_scores("least_confidence", None, None, logits)[0, 0] == pytest.approx(0.3)
    assert step_scores("min_margin", None, None, logits)[0, 0] == pytest.approx(0.5)


def _hand_rollout(truncate_at_1):
    """γ = λ = 0.5; r = [1, 0, 0, 2], V = [0.5, 1, 0.5, 1], episode ends at t = 1, V(s_T) = 2."""
    rewards = torch.tensor([[1.0], [0.0], [0.0], [2.0]])
    values = torch.tensor([[0.5], [1.0], [0.5], [1.0]])
    dones = torch.tensor([[False], [True], [False], [False]])
    terminated = dones.clone() if not truncate_at_1 else torch.zeros_like(dones)
    final_values = torch.tensor([[0.0], [4.0], [0.0], [0.0]])  # V(final obs) = 4 of the truncated episode
    return compute_gae(rewards, values, torch.tensor([2.0]), terminated, dones, final_values, 0.5, 0.5), dones


def test_gae_and_td_scores_hand_computed_with_stitching():
    (adv, delta), dones = _hand_rollout(truncate_at_1=False)
    # δ = [1 + .5*1 - .5, 0 + 0 - 1, 0 + .5*1 - .5, 2 + .5*2 - 1] ; A_t = δ_t + .25 A_{t+1} within the episode
    np.testing.assert_allclose(delta[:, 0], [1.0, -1.0, 0.0, 2.0])
    np.testing.assert_allclose(adv[:, 0], [0.75, -1.0, 0.5, 2.0])
    levels = np.array([[3], [3], [5], [5]])
    s = BoundedLevelSampler(np.arange(10), 1, SamplerConfig(strategy="value_l1"))
    s.update_with_rollouts(step_scores("value_l1", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert s.scores[3] == pytest.approx((0.75 + 1.0) / 2)  # finished episode, Eq. (2)
    assert s.partial_steps[0] == 2 and s.partial_score[0] == pytest.approx((0.5 + 2.0) / 2)  # S~ of level 5
    # the episode on level 5 continues in the next rollout: |A| = [0.5, 0.25], then it ends
    s.update_with_rollouts(np.array([[0.5], [0.25]]), np.array([[False], [True]]), np.array([[5], [5]]))
    assert s.scores[5] == pytest.approx((0.5 + 2.0 + 0.5 + 0.25) / 4)  # stitched over the whole episode
    assert s.partial_steps[0] == 0
    # signed GAE and one-step TD
    t = BoundedLevelSampler(np.arange(10), 1, SamplerConfig(strategy="one_step_td"))
    t.update_with_rollouts(step_scores("one_step_td", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert t.scores[3] == pytest.approx(1.0)
    g = BoundedLevelSampler(np.arange(10), 1, SamplerConfig(strategy="gae"))
    g.update_with_rollouts(step_scores("gae", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert g.scores[3] == pytest.approx((0.75 - 1.0) / 2)
    # time-limit truncation at t = 1 bootstraps from V(final obs) = 4: δ_1 = .5*4 - 1 = 1, A_0 = 1 + .25 = 1.25
    (adv_tr, delta_tr), _ = _hand_rollout(truncate_at_1=True)
    np.testing.assert_allclose(delta_tr[:, 0], [1.0, 1.0, 0.0, 2.0])
    np.testing.assert_allclose(adv_tr[:, 0], [1.25, 1.0, 0.5, 2.0])


# ----------------------------------------------------------------------------------------------------------------
# GAE against the textbook
def test_compute_gae_matches_textbook():
    rng = np.random.default_rng(3)
    for _ in range(50):
        T = int(rng.integers(1, 20))
        N = int(rng.integers(1, 5))
        r = rng.normal(size=(T, N))
        v = rng.normal(size=(T, N))
        nv = rng.normal(size=N)
        fv = rng.normal(size=(T, N))
        ends = rng.random((T, N)) < 0.3
        trunc = ends & (rng.random((T, N)) < 0.5)
        term = ends & ~trunc
        gamma = float(rng.uniform(0.5, 1))
        lam = float(rng.uniform(0, 1))
        f = lambda x: torch.as_tensor(x)  # noqa: E731
        A, d = compute_gae(f(r), f(v), f(nv), f(term), f(ends), f(fv), gamma, lam)
        A_ref, d_ref = textbook_gae(r, v, nv, term, trunc, fv, gamma, lam)
        np.testing.assert_allclose(A.numpy(), A_ref, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d.numpy(), d_ref, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# PPO loss: a hand-computed case
class FixedOutputAgent(torch.nn.Module):
    """An agent whose logits and values are fixed tensors (ppo_loss only calls agent(obs))."""

    def __init__(self, logits, values):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)
        self.values = torch.nn.Parameter(values)

    def forward(self, obs):
        return self.logits, self.values


def test_ppo_loss_hand_computed():
    """Five samples, ε = 0.2, π = (0.6, 0.4) for every state. old log-probs are set so that the ratios r = π/π_old are
    1.5, 0.5, 0.5, 1.5, 1.1: clipped above with A > 0, below with A < 0, and the three cases where the pessimistic
    max(-A r, -A clip(r)) keeps the unclipped term."""
    probs = torch.tensor([0.6, 0.4], dtype=torch.float64)
    actions = torch.tensor([0, 1, 0, 1, 0])
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1], dtype=torch.float64)
    old_logprobs = torch.log(probs[actions] / ratios)
    advantages = torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0], dtype=torch.float64)
    # value cases: (new V, old V, return)
    values = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    old_values = torch.tensor([0.5, 0.5, 2.1, 0.0, 0.0], dtype=torch.float64)
    returns = torch.tensor([1.0, 1.0, 0.0, -0.5, 2.0], dtype=torch.float64)
    agent = FixedOutputAgent(torch.log(probs).repeat(5, 1), values)
    args = Args(clip_coef=0.2, ent_coef=0.1, vf_coef=0.25, clip_vloss=True)
    obs = torch.zeros(5)

    loss, pg_loss, v_loss, entropy, approx_kl, clipfrac = plr_ppo.ppo_loss(
        agent, obs, actions, old_logprobs, advantages, returns, old_values, args
    )
    # per sample max(-A r, -A clip(r, 0.8, 1.2)):
    # max(-1.5, -1.2) = -1.2; max(0.5, 0.8) = 0.8; max(-1.0, -1.6) = -1.0; max(3.0, 2.4) = 3.0; max(-1.1, -1.1) = -1.1
    want_pg = (-1.2 + 0.8 - 1.0 + 3.0 - 1.1) / 5
    # clipped V = V_old + clip(V - V_old, ±0.2) = 0.7, 0.3, 2.0, -0.2, 0.2; per sample max((V - R)², (V_clip - R)²):
    # max(0, 0.09) = 0.09; max(1, 0.49) = 1; max(4, 4) = 4; max(0.25, 0.09) = 0.25; max(2.25, 3.24) = 3.24
    want_v = 0.5 * (0.09 + 1.0 + 4.0 + 0.25 + 3.24) / 5
    want_entropy = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4))
    # the entropy is a bonus: it lowers the loss
    want_loss = want_pg - 0.1 * want_entropy + 0.25 * want_v
    # approx KL = mean((r - 1) - log r); clip fraction: |r - 1| > 0.2 for four of five samples
    want_kl = sum((r - 1) - math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.1)) / 5
    assert pg_loss.item() == pytest.approx(want_pg, rel=1e-9)
    assert v_loss.item() == pytest.approx(want_v, rel=1e-9)
    assert entropy.item() == pytest.approx(want_entropy, rel=1e-9)
    assert loss.item() == pytest.approx(want_loss, rel=1e-9)
    assert approx_kl.item() == pytest.approx(want_kl, rel=1e-9)
    assert clipfrac.item() == pytest.approx(0.8)

    # without value clipping: 0.5 mean (V - R)² = 0.5 (0 + 1 + 4 + 0.25 + 2.25) / 5
    args.clip_vloss = False
    v_loss_unclipped = plr_ppo.ppo_loss(agent, obs, actions, old_logprobs, advantages, returns, old_values, args)[2]
    assert v_loss_unclipped.item() == pytest.approx(0.5 * 7.5 / 5, rel=1e-9)


# ----------------------------------------------------------------------------------------------------------------
# Return normalisation and Procgen's normalized return
def test_return_normalizer_and_cobbe_normalization():
    rng = np.random.default_rng(8)
    norm = plr_ppo.ReturnNormalizer(3, gamma=0.9, clip=1e9)
    ret = np.zeros(3)
    seen = []
    for step in range(200):
        r = rng.normal(size=3)
        d = rng.random(3) < 0.1
        out = norm(r.copy(), d)
        ret = 0.9 * ret + r  # textbook discounted return, reset after an episode end
        seen.append(ret.copy())
        if step >= 3:  # after the (count 1e-4) prior has washed out: the std of every discounted return so far
            np.testing.assert_allclose(out, r / np.sqrt(np.var(np.concatenate(seen)) + 1e-8), rtol=1e-4)
        ret[d] = 0.0
    from common.procgen_env import procgen_normalized_return

    assert procgen_normalized_return("bigfish", "easy", 40.0) == pytest.approx(1.0)
    assert procgen_normalized_return("jumper", "easy", 3.0) == pytest.approx(0.0)  # easy R_min is 3 (not 1)
    assert procgen_normalized_return("starpilot", "hard", 18.25) == pytest.approx(0.5)
    assert procgen_normalized_return("MultiRoom-N4-Random", "easy", 0.5) is None

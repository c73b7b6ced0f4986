"""Tests for plr_ppo.py's pieces: PLR's distributions and level sampler against slow textbook versions written from
the paper's equations (Eqs. (1)-(4), Algorithm 4), hand-computed scores, GAE with termination vs truncation, a
hand-computed PPO loss, the return normaliser, the MiniGrid network against the authors' MinigridPolicy, per-domain
defaults, replay-decision frequencies, level plumbing through the vector adapters, CLI errors and a tiny Procgen
run. The training loop's contract: tests/test_plr_loop.py (evaluation: tests/test_plr_evaluation.py; resume:
tests/test_plr_resume.py); the textbook GAE: tests/plr_helpers.py."""

import json
import math

import numpy as np
import pytest
import torch
from plr_helpers import run_main, textbook_gae

import plr_ppo
from plr_ppo import (
    Args,
    LevelSampler,
    SamplerConfig,
    compute_gae,
    replay_distribution,
    resolve_defaults,
    score_distribution,
    staleness_distribution,
    step_scores,
    validate_args,
)


# ---------------------------------------------------------------------------------------------------------------
# Textbook implementations (deliberately slow loops in the paper's notation)
# ---------------------------------------------------------------------------------------------------------------
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


def textbook_scores(rollouts, num_levels, alpha=1.0, flush_each_update=False):
    """Algorithm 4: per actor, the trajectory τ of the current episode grows across rollouts; at d_t the level's
    score is the mean per-step score over the whole episode (S~ stitching). With flush_each_update (authors' code),
    the partial τ is committed at the end of each rollout and τ restarts."""
    S = np.zeros(num_levels)
    scored = np.zeros(num_levels, bool)
    tau = {}

    def commit(level, value):
        S[level] = value if not scored[level] else (1 - alpha) * S[level] + alpha * value
        scored[level] = True

    for scores, dones, levels in rollouts:
        T, N = scores.shape
        for a in range(N):  # actor-major commit order, as the sampler (and the authors' code)
            for t in range(T):
                tau.setdefault(a, []).append((levels[t, a], scores[t, a]))
                if dones[t, a]:
                    commit(levels[t, a], np.mean([s for _, s in tau[a]]))
                    tau[a] = []
            if flush_each_update and tau.get(a):
                commit(tau[a][-1][0], np.mean([s for _, s in tau[a]]))
                tau[a] = []
    return S, scored


def random_rollouts(rng, num_rollouts, T, N, levels_per_actor, p_done=0.15):
    """Synthetic rollouts where actor a plays only levels of its own set (so commit order is unambiguous)."""
    out = []
    cur = [int(rng.integers(levels_per_actor)) + a * levels_per_actor for a in range(N)]
    for _ in range(num_rollouts):
        scores = rng.normal(size=(T, N))
        dones = rng.random((T, N)) < p_done
        levels = np.zeros((T, N), np.int64)
        for a in range(N):
            for t in range(T):
                levels[t, a] = cur[a]
                if dones[t, a]:
                    cur[a] = int(rng.integers(levels_per_actor)) + a * levels_per_actor
        out.append((scores, dones, levels))
    return out


# ---------------------------------------------------------------------------------------------------------------
# replay_distribution: Eqs. (1), (3), (4)
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# Scores: hand-computed cases
# ---------------------------------------------------------------------------------------------------------------
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
    s = LevelSampler(np.arange(10), 1, SamplerConfig(strategy="value_l1"))
    s.update_with_rollouts(step_scores("value_l1", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert s.scores[3] == pytest.approx((0.75 + 1.0) / 2)  # finished episode, Eq. (2)
    assert s.partial_steps[0] == 2 and s.partial_score[0] == pytest.approx((0.5 + 2.0) / 2)  # S~ of level 5
    # the episode on level 5 continues in the next rollout: |A| = [0.5, 0.25], then it ends
    s.update_with_rollouts(np.array([[0.5], [0.25]]), np.array([[False], [True]]), np.array([[5], [5]]))
    assert s.scores[5] == pytest.approx((0.5 + 2.0 + 0.5 + 0.25) / 4)  # stitched over the whole episode
    assert s.partial_steps[0] == 0
    # signed GAE and one-step TD
    t = LevelSampler(np.arange(10), 1, SamplerConfig(strategy="one_step_td"))
    t.update_with_rollouts(step_scores("one_step_td", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert t.scores[3] == pytest.approx(1.0)
    g = LevelSampler(np.arange(10), 1, SamplerConfig(strategy="gae"))
    g.update_with_rollouts(step_scores("gae", adv.numpy(), delta.numpy()), dones.numpy(), levels)
    assert g.scores[3] == pytest.approx((0.75 - 1.0) / 2)
    # time-limit truncation at t = 1 bootstraps from V(final obs) = 4: δ_1 = .5*4 - 1 = 1, A_0 = 1 + .25 = 1.25
    (adv_tr, delta_tr), _ = _hand_rollout(truncate_at_1=True)
    np.testing.assert_allclose(delta_tr[:, 0], [1.0, 1.0, 0.0, 2.0])
    np.testing.assert_allclose(adv_tr[:, 0], [1.25, 1.0, 0.5, 2.0])


def test_commit_after_update_mode_flushes_partials():
    s = LevelSampler(np.arange(10), 1, SamplerConfig(commit="update"))
    s.update_with_rollouts(np.array([[1.0], [3.0]]), np.array([[False], [False]]), np.array([[4], [4]]))
    assert not s.seen[4]
    s.after_update()  # authors' code: the partial score becomes the level's score
    assert s.seen[4] and s.scores[4] == pytest.approx(2.0) and s.partial_steps[0] == 0
    s.update_with_rollouts(np.array([[5.0], [7.0]]), np.array([[True], [False]]), np.array([[4], [8]]))
    assert s.scores[4] == pytest.approx(5.0)  # only the tail after the flush
    e = LevelSampler(np.arange(10), 1, SamplerConfig(commit="episode"))
    e.update_with_rollouts(np.array([[1.0], [3.0]]), np.array([[False], [False]]), np.array([[4], [4]]))
    e.after_update()
    assert not e.seen[4]


def test_restart_episodes_drops_partial_scores():
    """`--resume` restarts each env's level from its first frame: the restarted episode is scored on its own steps."""
    s = LevelSampler(np.arange(10), 2)
    s.update_with_rollouts(np.array([[1.0, 2.0], [3.0, 4.0]]), np.zeros((2, 2), bool), np.array([[4, 6], [4, 6]]))
    assert s.partial_steps.tolist() == [2, 2]
    s.restart_episodes()
    assert s.partial_steps.tolist() == [0, 0] and s.partial_score.tolist() == [0.0, 0.0]
    s.update_with_rollouts(
        np.array([[5.0, 6.0], [7.0, 8.0]]), np.array([[False, False], [True, False]]), np.array([[4, 6], [4, 6]])
    )
    assert s.scores[4] == pytest.approx(6.0)  # (5 + 7) / 2, not (1 + 3 + 5 + 7) / 4
    assert s.partial_steps[1] == 2 and s.partial_score[1] == pytest.approx(7.0)  # (6 + 8) / 2, not (2 + 4 + 6 + 8) / 4


@pytest.mark.parametrize("alpha,flush", [(1.0, False), (0.5, False), (1.0, True), (0.3, True)])
def test_sampler_scores_match_textbook_algorithm4(alpha, flush):
    rng = np.random.default_rng(int(alpha * 10) + flush)
    for case in range(20):
        T = int(rng.integers(1, 12))
        N = int(rng.integers(1, 6))
        per = 4
        rollouts = random_rollouts(rng, int(rng.integers(1, 6)), T, N, per, p_done=float(rng.choice([0.05, 0.2, 0.6])))
        s = LevelSampler(np.arange(N * per), N, SamplerConfig(score_alpha=alpha, commit="update" if flush else "episode"))
        for scores, dones, levels in rollouts:
            s.update_with_rollouts(scores, dones, levels)
            s.after_update()
        S, scored = textbook_scores(rollouts, N * per, alpha=alpha, flush_each_update=flush)
        np.testing.assert_array_equal(s.seen, scored)
        np.testing.assert_allclose(s.scores, S, rtol=1e-10, atol=1e-12, err_msg=f"case {case}")


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


# ---------------------------------------------------------------------------------------------------------------
# PPO loss: a hand-computed case
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# MiniGrid network (the authors' MinigridPolicy) and the per-domain defaults
# ---------------------------------------------------------------------------------------------------------------
# Expected sizes from the authors' level_replay/model.py MinigridPolicy, by hand (7 actions, 3 input channels):
# conv 2x2 3->16: 3*16*4 + 16 = 208; conv 2x2 16->32: 16*32*4 + 32 = 2,080; conv 2x2 32->F: 32*F*4 + F;
# embedding E = F * ((H-1)//2 - 2) * ((W-1)//2 - 2) (2x2 conv: -1, max-pool: //2, two 2x2 convs: -2);
# actor Linear(E, 64) + head Linear(64, 7): 64 E + 64 and 64*7 + 7 = 455;
# critic Linear(E, 64) + Linear(64, 1): 64 E + 64 and 64 + 1 = 65.
# MultiRoom-N4-Random, 14x14 grid, F = 32: conv3 4,128; E = 32*4*4 = 512; actor 512*64+64 = 32,832 and 64*7+7 = 455;
#   critic 32,832 and 64+1 = 65; total 208 + 2,080 + 4,128 + 32,832 + 455 + 32,832 + 65 = 72,600.
# ObstructedMazeGamut, 19x19 grid, F = 64: conv3 8,256; E = 64*7*7 = 3,136; actor 3,136*64+64 = 200,768 and 455;
#   critic 200,768 and 65; total 208 + 2,080 + 8,256 + 200,768 + 455 + 200,768 + 65 = 412,600.
MINIGRID_NETWORKS = [
    ("MultiRoom-N4-Random", (14, 14, 3), 32, 4, 72_600),
    ("ObstructedMazeGamut-Easy", (19, 19, 3), 64, 7, 412_600),
    ("ObstructedMazeGamut-Medium", (19, 19, 3), 64, 7, 412_600),
]


def authors_minigrid_forward(params, obs):
    """MinigridPolicy.act of the authors' code with functional calls: image_conv (conv 2x2, ReLU, max-pool 2x2, conv 2x2,
    ReLU, conv 2x2, ReLU), flatten, actor_base (Linear, Tanh) and the Categorical head's Linear, critic (Linear, Tanh,
    Linear). params: the 14 weight / bias tensors in that order; obs (B, H, W, 3) as channels-first floats."""
    import torch.nn.functional as F

    conv1_w, conv1_b, conv2_w, conv2_b, conv3_w, conv3_b = params[:6]
    actor_w, actor_b, head_w, head_b, critic_w, critic_b, value_w, value_b = params[6:]
    x = obs.permute(0, 3, 1, 2).float()
    x = F.max_pool2d(F.relu(F.conv2d(x, conv1_w, conv1_b)), 2)
    x = F.relu(F.conv2d(x, conv2_w, conv2_b))
    x = F.relu(F.conv2d(x, conv3_w, conv3_b)).flatten(1)
    logits = F.linear(torch.tanh(F.linear(x, actor_w, actor_b)), head_w, head_b)
    value = F.linear(torch.tanh(F.linear(x, critic_w, critic_b)), value_w, value_b)
    return logits, value.squeeze(-1)


@pytest.mark.parametrize("env_id,obs_shape,final_channels,embedding_side,num_params", MINIGRID_NETWORKS)
def test_minigrid_network_shapes_and_parameter_counts(env_id, obs_shape, final_channels, embedding_side, num_params):
    from common.minigrid_env import make_minigrid_env

    env = make_minigrid_env(env_id)
    assert env.observation_space.shape == obs_shape and env.action_space.n == 7
    env.close()
    agent = plr_ppo.make_agent(resolve_defaults(Args(env_id=env_id)), obs_shape, 7)
    convs = [m for m in agent.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(16, (2, 2)), (32, (2, 2)), (final_channels, (2, 2))]
    assert sum(p.numel() for p in agent.parameters()) == num_params
    embedding = agent.trunk(torch.zeros(1, *obs_shape).permute(0, 3, 1, 2))
    assert embedding.shape == (1, final_channels * embedding_side * embedding_side)
    logits, value = agent(torch.zeros(5, *obs_shape, dtype=torch.uint8))
    assert logits.shape == (5, 7) and value.shape == (5,)


@pytest.mark.parametrize("env_id,obs_shape", [network[:2] for network in MINIGRID_NETWORKS[:2]])
def test_minigrid_network_matches_the_authors_forward(env_id, obs_shape):
    """Tanh hidden layers, ReLU convs and the max-pool: the network equals the authors' forward on its own weights,
    on MiniGrid-like integer cell encodings (0..10) large enough that a ReLU hidden layer would differ from tanh."""
    torch.manual_seed(0)
    agent = plr_ppo.make_agent(resolve_defaults(Args(env_id=env_id)), obs_shape, 7)
    obs = torch.randint(0, 11, (6, *obs_shape), dtype=torch.uint8)
    with torch.no_grad():
        logits, value = agent(obs)
        want_logits, want_value = authors_minigrid_forward(list(agent.parameters()), obs)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "env_id,num_levels,epochs,lr,rho,bootstrap",
    [
        ("bigfish", 200, 3, 5e-4, 0.1, True),
        ("MultiRoom-N4-Random", 4000, 4, 7e-4, 0.3, False),
        ("ObstructedMazeGamut-Easy", 3000, 4, 7e-4, 0.3, False),
        ("ObstructedMazeGamut-Medium", 6000, 4, 7e-4, 0.3, False),
        ("MiniGrid-Empty-5x5-v0", 1000, 4, 7e-4, 0.3, False),
    ],
)
def test_resolved_defaults_per_domain(env_id, num_levels, epochs, lr, rho, bootstrap):
    """Table 3 / App. A.2 per domain; a MiniGrid timeout terminates (authors' code), a Procgen one bootstraps."""
    args = resolve_defaults(Args(env_id=env_id))
    resolved = (args.num_train_levels, args.update_epochs, args.learning_rate, args.plr_staleness_coef)
    assert resolved == (num_levels, epochs, pytest.approx(lr), pytest.approx(rho))
    assert args.bootstrap_truncation is bootstrap
    # flags given on the command line are kept, including 0 / False
    given = dict(
        num_train_levels=0, update_epochs=7, learning_rate=1e-3, plr_staleness_coef=0.0, bootstrap_truncation=not bootstrap
    )
    args = resolve_defaults(Args(env_id=env_id, **given))
    assert {k: getattr(args, k) for k in given} == given


# ---------------------------------------------------------------------------------------------------------------
# Sampling: P_D, P_new, P_replay, staleness, unbounded buffer, state round-trip
# ---------------------------------------------------------------------------------------------------------------
def _binomial_ok(k, n, p, z=5.0):
    return abs(k - n * p) <= z * np.sqrt(n * p * (1 - p)) + 1


def test_replay_decision_frequencies_and_unseen_uniform():
    s = LevelSampler(np.arange(100), 1, seed=1)
    n = 10000
    replays = 0
    new_counts = np.zeros(100, int)
    for trial in range(n):  # 30 of 100 levels seen; one sampleNextLevel call per trial
        s.seen[:] = False
        s.seen[:30] = True
        s.num_seen = 30
        s.num_replays = 0
        lvl = s.sample(0)
        if s.num_replays:
            replays += 1
            assert lvl < 30
        else:
            new_counts[lvl] += 1
    assert _binomial_ok(replays, n, 0.3), replays  # P_D(replay) = |Λ_seen| / |Λ_train|
    assert new_counts[:30].sum() == 0
    m = new_counts.sum()
    for k in new_counts[30:]:  # P_new uniform over the 70 unseen levels
        assert _binomial_ok(k, m, 1 / 70)
    # fixed schedule and min fill
    f = LevelSampler(np.arange(100), 1, SamplerConfig(replay_schedule="fixed", replay_prob=0.8, min_fill=0.2))
    f.seen[:10] = True
    f.num_seen = 10
    assert f.replay_decision_prob() == 0.0
    f.seen[:40] = True
    f.num_seen = 40
    assert f.replay_decision_prob() == 0.8
    f.seen[:] = True
    f.num_seen = 100
    assert f.replay_decision_prob() == 1.0


def test_replay_sampling_follows_replay_distribution():
    rng = np.random.default_rng(4)
    s = LevelSampler(np.arange(8), 1, SamplerConfig(transform="power", temperature=1.0, staleness_coef=0.0), seed=5)
    s.seen[:] = True
    s.num_seen = 8
    s.scores[:] = rng.random(8)
    p = replay_distribution(s.scores, s.staleness, s.seen, "power", 1.0, 0.0)
    n = 8000
    counts = np.bincount([s.sample(0) for _ in range(n)], minlength=8)
    for k, pk in zip(counts, p):
        assert _binomial_ok(k, n, pk)


def test_staleness_is_episode_count_minus_timestamp():
    s = LevelSampler(np.arange(20), 3, SamplerConfig(staleness_coef=0.5), seed=2)
    C = np.zeros(20)
    rng = np.random.default_rng(2)
    for c in range(1, 200):
        lvl = s.sample(c % 3)
        C[lvl] = c  # timestamp C_i <- c
        if c % 3 == 0:  # some episodes finish: their levels get scores and join Λ_seen
            s.update_with_rollouts(np.array([[rng.random()]]), np.array([[True]]), np.array([[lvl]]))
        seen = s.seen
        np.testing.assert_allclose(s.staleness[seen], (c - C)[seen])
    assert 5 < s.num_seen < 20
    np.testing.assert_allclose(
        s.replay_probs(), replay_distribution(s.scores, s.staleness, s.seen, "rank", 0.1, 0.5), rtol=1e-12
    )


def test_no_replay_until_scored_then_only_scored_levels():
    """Authors' code: a sampled level is not in Λ_seen until its first score is committed, so early samples are all
    new levels (P_D = 0) and replays only ever go to scored levels (no zero-score rank ties at the start)."""
    s = LevelSampler(np.arange(1000), 64, seed=3)
    first = [s.sample(i) for i in range(64)]  # the initial levels of 64 actors, as in the training loop
    first += [s.sample(i % 64) for i in range(64)]  # and 64 more before anything is scored
    assert s.num_seen == 0 and s.num_replays == 0 and s.replay_decision_prob() == 0.0
    assert len(set(first)) > 100  # uniform new levels, not one level replayed
    scored = first[:5]
    for lvl, score in zip(scored, [0.3, 0.1, 0.5, 0.2, 0.4]):
        s.update_with_rollouts(np.array([[score]]), np.array([[True]]), np.array([[lvl]]))
    assert s.num_seen == 5 and set(np.flatnonzero(s.seen)) == set(scored)
    assert s.replay_decision_prob() == pytest.approx(5 / 1000)
    p = s.replay_probs()
    assert set(np.flatnonzero(p)) == set(scored) and abs(p.sum() - 1) < 1e-12
    s.replay_decision_prob = lambda: 1.0  # force replays: every one lands on a scored level
    assert {s.sample(0) for _ in range(300)} <= set(scored)


def test_unbounded_top_m_buffer():
    s = LevelSampler(None, 2, SamplerConfig(buffer_size=3, replay_schedule="fixed", replay_prob=0.5), seed=0)
    assert s.replay_decision_prob() == 0.0
    lv = [s.sample(0), s.sample(1)]
    assert all(x not in s.slot_of for x in lv) and len(s.staged) == 2  # staged, not yet in the buffer
    # finish one episode per actor: both enter the buffer
    s.update_with_rollouts(np.array([[1.0, 2.0]]), np.array([[True, True]]), np.array([lv]))
    assert s.num_seen == 2 and s.replay_decision_prob() == 0.5
    extra = 10**6
    s.update_with_rollouts(np.array([[0.5]]), np.array([[True]]), np.array([[extra]]))
    assert s.num_seen == 3 and extra in s.slot_of
    # full: a new level replaces l_min = argmin P_replay only if S(l_min) < its score
    lmin = int(s.seeds[np.argmin(s.replay_probs())])
    s.update_with_rollouts(np.array([[0.1]]), np.array([[True]]), np.array([[extra + 1]]))
    assert extra + 1 not in s.slot_of
    s.update_with_rollouts(np.array([[5.0]]), np.array([[True]]), np.array([[extra + 2]]))
    assert extra + 2 in s.slot_of and lmin not in s.slot_of and s.num_seen == 3
    assert sorted(s.slot_of.values()) == [0, 1, 2]
    # new seeds avoid the buffer
    for _ in range(50):
        s.sample(0)
    assert len(set(s.seeds.tolist())) == 3


def test_sampler_state_round_trip_continues_identically():
    rng = np.random.default_rng(7)
    a = LevelSampler(np.arange(50), 4, SamplerConfig(staleness_coef=0.3), seed=11)
    for scores, dones, levels in random_rollouts(rng, 3, 16, 4, 12):
        for i in range(4):
            a.sample(i)
        a.update_with_rollouts(scores, dones, levels)
    b = LevelSampler(np.arange(50), 4, SamplerConfig(staleness_coef=0.3), seed=999)
    b.load_state_dict(a.state_dict())
    more = random_rollouts(rng, 2, 16, 4, 12)
    for sampler in (a, b):
        sampler.trace = [sampler.sample(i % 4) for i in range(40)]
        for scores, dones, levels in more:
            sampler.update_with_rollouts(scores, dones, levels)
    assert a.trace == b.trace
    for k in LevelSampler._ARRAYS:
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k))


def test_random_strategy_is_uniform_over_train_levels():
    s = LevelSampler(np.arange(5, 10), 1, SamplerConfig(strategy="random"), seed=0)
    counts = np.bincount([s.sample(0) for _ in range(5000)], minlength=10)
    assert counts[:5].sum() == 0 and all(_binomial_ok(k, 5000, 0.2) for k in counts[5:])


# ---------------------------------------------------------------------------------------------------------------
# Level plumbing through the vector adapters
# ---------------------------------------------------------------------------------------------------------------
def _check_plumbing(envs, max_steps, min_ends=2):
    chosen = iter(range(100, 100_000, 7))
    returned = {}

    def next_level(i):
        returned[i] = next(chosen)
        return returned[i]

    envs.reset([1, 2])
    prev = np.array([1, 2])
    ends = 0
    for _ in range(max_steps):
        returned.clear()
        _, _, term, trunc, info = envs.step(np.zeros(2, int), next_level=next_level)
        np.testing.assert_array_equal(info["level_seed"], prev)  # transitions are played on the current level
        done = term | trunc
        assert set(returned) == set(np.flatnonzero(done).tolist())
        for i, lvl in returned.items():  # after an episode end each env is on the level the sampler returned
            assert info["next_level_seed"][i] == lvl and envs.levels[i] == lvl
        prev = info["next_level_seed"]
        ends += int(done.sum())
        if ends >= min_ends:
            break
    assert ends >= min_ends


def test_level_plumbing_minigrid_and_procgen():
    from common.minigrid_env import MiniGridVecEnv
    from common.procgen_env import ProcgenVecEnv

    mg = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=1, max_steps=3)
    try:
        _check_plumbing(mg, 20, min_ends=6)
    finally:
        mg.close()
    pg = ProcgenVecEnv("bigfish", 2, num_threads=0)
    try:
        _check_plumbing(pg, 600)
    finally:
        pg.close()


# ---------------------------------------------------------------------------------------------------------------
# CLI validation and end-to-end runs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(env_id="nope"), "unknown MiniGrid env id"),
        (dict(plr_temperature=0.0), "--plr-temperature must be > 0"),
        (dict(plr_staleness_coef=1.5), "--plr-staleness-coef must be in [0, 1], got 1.5"),
        (dict(num_train_levels=2**31), "--num-train-levels"),
        (dict(num_train_levels=0), "needs --plr-replay-schedule fixed"),
        (dict(num_envs=3, num_steps=5, num_minibatches=2), "divisible"),
        (dict(num_workers=-1), "--num-workers must be >= 0"),
    ],
)
def test_validate_args_one_line(flags, needle):
    """The ranges, then the checks between flags (in-process; the subprocess cases are in tests/test_lifecycle.py)."""
    args = resolve_defaults(Args(**flags))
    with pytest.raises(SystemExit) as e:
        validate_args(args)
    msg = str(e.value)
    assert msg.startswith("error: ") and needle in msg and "\n" not in msg


def test_smoke_procgen(tmp_path, monkeypatch):
    """A tiny Procgen run, the real `__main__` in this process (--plr-commit update; one epoch per update, the
    per-domain defaults are checked above): it trains, scores levels, evaluates with Cobbe et al.'s normalized return
    and writes its summary (MiniGrid runs: tests/test_plr_loop.py, and in subprocesses tests/test_lifecycle.py)."""
    monkeypatch.chdir(tmp_path)
    run_main(
        (
            "--env-id bigfish --num-envs 2 --num-steps 16 --total-timesteps 64 --num-minibatches 2 --update-epochs 1 "
            "--num-train-levels 5 --eval-every 0 --final-eval-episodes 1 --num-eval-envs 1 --plr-commit update "
            "--no-progress --no-cuda"
        ).split()
    )
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 64 and "final_test_normalized_return" in summary
    assert 1 <= summary["plr_num_seen_levels"] <= 5
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("plr/replay_entropy" in x for x in lines) and any("eval/final_generalization_gap" in x for x in lines)


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

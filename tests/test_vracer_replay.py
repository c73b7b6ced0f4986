"""vracer_refer.py's replay memory (Sec. 3, App. B-C): FIFO forgetting of whole episodes, uniform and rank-based
sampling, the Q^ret targets kept equal to the Eq. (8) recursion over the stored V and rho (insertion, refresh after
each step, recomputation at a reward-scale update), the statistics of Eqs. (14)-(16), the far-policy count, PER
priorities and the memory's checkpoint round trip."""

import copy

import numpy as np
import pytest
import torch
from vracer_helpers import check_qret_consistent, cpu_learner, fill, random_episode, textbook_qret, textbook_vtbc

import vracer_refer as vr


# ----------------------------------------------------------------------------------------------------------------
# V^tbc and Q^ret (Eqs. (6)-(8)), read by blocks
def one_episode_memory(rewards, values, rhos, gamma, terminated, offset=0):
    """A memory holding one episode (after `offset` padding steps of another), with the given r, V, rho and V(s_L)."""
    L = len(rewards)
    rm = vr.EpisodeReplay(offset + L + 1, 2, 1, gamma, max_episode_len=max(L, offset, 1), per_alpha=0.5)
    if offset:
        rm.add_episode(
            np.zeros((offset, 2)),
            np.zeros((offset, 1)),
            np.zeros((offset, 1)),
            np.ones((offset, 1)),
            np.ones(offset),
            np.ones(offset),
            True,
        )
    start = rm.head
    rm.add_episode(
        np.zeros((L, 2)),
        np.zeros((L, 1)),
        np.zeros((L, 1)),
        np.ones((L, 1)),
        rewards,
        values[:L],
        terminated,
        final_value=float(values[L]),
    )
    rm.rho[start : start + L] = rhos
    rm.recompute()
    return rm, np.arange(start, start + L)


@pytest.mark.parametrize("terminated", [True, False])
def test_vtbc_read_by_blocks_matches_textbook(terminated):
    """`EpisodeReplay.vtbc_at` / `qret_at`, Eq. (8) evaluated by blocks of BLOCK steps, equal the textbook backward loop
    over one episode (tests/vracer_helpers.py) for episodes shorter than a block and spanning many, starting anywhere in
    a block."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        L = int(rng.integers(1, 300))
        offset = int(rng.integers(0, 70))
        gamma = float(rng.uniform(0.5, 1.0))
        r, v, rho = random_episode(rng, L, terminated)
        rm, steps = one_episode_memory(r, v, rho, gamma, terminated, offset)
        np.testing.assert_allclose(rm.vtbc_at(steps), textbook_vtbc(r, v, rho, gamma, terminated), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rm.qret_at(steps), textbook_qret(r, v, rho, gamma, terminated), rtol=1e-10, atol=1e-10)


def test_vtbc_edge_cases():
    """Length-1 episodes, a terminal tail slot that must be ignored, rho >= 1 (V^tbc is the bootstrapped discounted
    return, independent of V) and cut traces (V^tbc = V)."""
    rm, steps = one_episode_memory([2.0], np.array([0.5, 3.0]), [0.5], 0.9, True)
    np.testing.assert_allclose(rm.vtbc_at(steps), [0.5 + 0.5 * (2.0 - 0.5)])
    rm, steps = one_episode_memory([2.0], np.array([0.5, 3.0]), [4.0], 0.9, False)
    np.testing.assert_allclose(rm.vtbc_at(steps), [2.0 + 0.9 * 3.0])
    rm, steps = one_episode_memory([1.0, 1.0], np.array([0, 0, 100.0]), [1, 1], 0.5, True)
    np.testing.assert_allclose(rm.vtbc_at(steps), [1.5, 1.0])
    rng = np.random.default_rng(1)
    r, v, _ = random_episode(rng, 70, False)
    disc = sum(0.99**k * r[k] for k in range(70)) + 0.99**70 * v[70]
    rm, steps = one_episode_memory(r, v, np.full(70, 2.0), 0.99, False, offset=5)
    assert rm.vtbc_at(steps)[0] == pytest.approx(disc)
    rm, steps = one_episode_memory(r, v, np.full(70, 1e-12), 0.99, False, offset=5)
    np.testing.assert_allclose(rm.vtbc_at(steps), v[:70], atol=1e-9)


def test_recompute_reads_the_recursion_of_the_stored_values_in_every_episode():
    """After arbitrary stored rho (cut traces too), V and V(s_L), `recompute` (a reward-scale update, a load) gives
    every stored step the Q^ret of the textbook loop over its episode."""
    rng = np.random.default_rng(2)
    for _ in range(10):
        rm = vr.EpisodeReplay(400, 3, 2, 0.97, max_episode_len=40, per_alpha=0.5)
        fill(rm, rng, 30)
        rm.rho[:] = np.exp(rng.normal(size=rm.capacity))
        rm.rho[rng.uniform(size=rm.capacity) < 0.05] = 0.0
        rm.value[:] = rng.normal(size=rm.capacity)
        rm.boot_value[rm.truncated_last] = rng.normal(size=rm.truncated_last.sum())
        rm.recompute()
        check_qret_consistent(rm)


def test_fifo_removal_keeps_at_least_N():
    rng = np.random.default_rng(6)
    N = 300
    rm = vr.EpisodeReplay(N, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
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
    rm = vr.EpisodeReplay(100, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError):
        rm.sample(4, rng)
    assert rm.far_fraction() == 0.0
    rm.recompute()  # no-op on an empty memory
    fill(rm, rng, 1, lmin=5, lmax=5)
    assert sorted(rm.sample(5, rng)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        rm.add_episode(
            np.zeros((200, 3)), np.zeros((200, 2)), np.zeros((200, 2)), np.ones((200, 2)), np.zeros(200), np.zeros(200), True
        )


def test_sampling_is_distinct_valid_and_roughly_uniform():
    rng = np.random.default_rng(8)
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 200)
    counts = np.zeros(rm.capacity)
    for _ in range(400):
        idx = rm.sample(64, rng)
        assert len(np.unique(idx)) == 64 and rm.valid[idx].all()
        counts[idx] += 1
    c = counts[rm.valid]
    assert abs(c.mean() - 400 * 64 / rm.size) < 1e-9
    assert c.std() / c.mean() < 0.25  # binomial spread, no region starved


def test_insertion_targets_and_incremental_refresh_equal_full_recomputation():
    rng = np.random.default_rng(9)
    rm = vr.EpisodeReplay(400, 3, 2, 0.97, max_episode_len=40, per_alpha=0.5)
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
    stored = np.flatnonzero(rm.valid)
    before = rm.qret_at(stored)
    rm.recompute()
    np.testing.assert_allclose(rm.qret_at(stored), before, rtol=1e-9, atol=1e-9)


def test_reward_scaling_is_rms_without_mean_shift():
    rng = np.random.default_rng(10)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
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
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=40, per_alpha=0.7)
    fill(rm, rng, 100)
    rm.priority[rm.valid] = rng.uniform(size=rm.valid.sum())
    rm.per_rebuild()
    idx, w = rm.sample_per(2000, rng, 0.5)
    assert rm.valid[idx].all() and w.max() == pytest.approx(1.0) and np.all(w > 0)
    assert rm.priority[idx].mean() > rm.priority[rm.valid].mean() + 0.1
    assert np.all(np.diff(w[np.argsort(rm.priority[idx])]) <= 1e-12)  # higher priority -> smaller IS weight


def test_rank_per_draws_steps_stored_since_the_last_sort_uniformly():
    """Between two re-sorts, the steps stored since the last one have no rank, also those written into the slots of
    removed steps: each is drawn with probability 1/n (n stored steps) as under uniform sampling; the ranked steps
    still stored share the rest by rank, P ~ rank^-alpha with the memory's alpha (--per-alpha; 0.7 here, not the
    default); IS weights (n P)^-beta over the batch maximum."""
    rng = np.random.default_rng(21)
    alpha = 0.7
    beta = 0.6
    rm = vr.EpisodeReplay(500, 3, 2, 0.99, max_episode_len=10, per_alpha=alpha)
    fill(rm, rng, 200, lmax=10)
    rm.priority[rm.valid] = rng.uniform(size=rm.valid.sum())
    rm.sample_per(1, rng, beta)  # sorts
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
    idx, w = rm.sample_per(draws, rng, beta)
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
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
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
    rm = vr.EpisodeReplay(200, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    rm.recount_far(vr.refer_cmax(0, 0.0, 5e-7))
    assert rm.cmax == 1.0
    for _ in range(40):
        fill(rm, rng, 1)
        assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum()) == rm.size
    args = vr.Args(batch_size=16, buffer_size=200, refer="none", C=0.0)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-4)
    learner = cpu_learner(agent, opt, rm, rng, k=0, beta=1.0)
    for _ in range(10):
        vr.train_step(learner, args)
        fill(rm, rng, 1)
        assert rm.n_far == int((vr.is_far_policy(rm.rho, rm.cmax) & rm.valid).sum())
        assert 0.0 <= rm.far_fraction() <= 1.0


def test_replay_and_train_step_with_one_action_dimension():
    """1-D action tasks (InvertedPendulum): the actors hand over (L, 1) action blocks; the memory keeps them 2-D, and
    sampling (uniform and rank PER), the loss, the write-back and a checkpoint round trip work as with several."""
    rng = np.random.default_rng(24)
    rm = vr.EpisodeReplay(300, 3, 1, 0.99, max_episode_len=40, per_alpha=0.5)
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
    learner = cpu_learner(agent, opt, rm, rng, k=0, beta=0.0)
    for per in ("none", "rank"):
        args = vr.Args(batch_size=16, buffer_size=300, per=per)
        for _ in range(5):
            stats = vr.train_step(learner, args)
            assert torch.isfinite(stats).all()
    check_qret_consistent(rm)
    restored = vr.EpisodeReplay(300, 3, 1, 0.99, max_episode_len=40, per_alpha=0.5)
    restored.load_state_dict(rm.state_dict())
    np.testing.assert_array_equal(restored.action, rm.action)
    stored = np.flatnonzero(rm.valid)
    np.testing.assert_array_equal(restored.qret_at(stored), rm.qret_at(stored))


def test_replay_memory_need_is_the_size_of_its_arrays():
    """The start-up refusal of a replay that cannot fit (`--buffer-size`) uses this count before allocating."""
    rm = vr.EpisodeReplay(3000, 11, 3, 0.99, max_episode_len=1000, per_alpha=0.5)
    arrays = sum(v.nbytes for v in vars(rm).values() if isinstance(v, np.ndarray))
    assert vr.EpisodeReplay.bytes_needed(3000, 11, 3, 1000) == arrays


def test_new_steps_get_the_largest_priority_written_so_far():
    """Rank-based PER (Schaul et al. 2015): a newly stored step has no TD error yet and gets the largest priority any
    step has had so far, so that it is drawn soon; priorities written by gradient steps raise that maximum (here far
    above 1: large rewards), and it stays when the step that had it is overwritten."""
    rng = np.random.default_rng(40)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 30)
    rm.reward[rm.valid] *= 50.0
    args = vr.Args(batch_size=32, buffer_size=300, per="rank", learning_rate=1e-3)
    agent = vr.Agent(3, 2)
    opt = torch.optim.Adam(agent.parameters(), lr=args.learning_rate)
    learner = cpu_learner(agent, opt, rm, rng, k=0, beta=0.5)
    written = []
    for _ in range(5):
        vr.train_step(learner, args)
        written.append(rm.priority[rm.valid].max())
    largest = max(written)
    assert largest > 2.0
    rm.priority[rm.valid] = 0.0  # the steps that had it are gone or re-prioritised
    start = rm.head
    fill(rm, rng, 1, lmin=5, lmax=5)
    np.testing.assert_array_equal(rm.priority[start : start + 5], largest)


@pytest.mark.parametrize("per", ["none", "rank"])
def test_memory_state_dict_round_trip_continues_sampling_exactly(per):
    """`state_dict` / `load_state_dict` (--checkpoint-replay): every stored field, the scalars and the PER sort (ranks
    of the last re-sort, unranked steps stored since) come back, so a loaded memory draws the same batches with the
    same weights as the original from the same generator state, and the next gradient steps write the same values."""
    rng = np.random.default_rng(41)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 30)
    rm.update_reward_scale()
    rm.priority[rm.valid] = rng.uniform(0.1, 2.0, rm.valid.sum())
    rm.per_rebuild()
    fill(rm, rng, 3)
    saved = copy.deepcopy(rm.state_dict())
    loaded = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    loaded.load_state_dict(saved)
    for name in vr.EpisodeReplay.FIELDS:
        # the derived maps only where a step is stored
        slots = rm.valid if name in vr.EpisodeReplay.NOT_SAVED else slice(None)
        np.testing.assert_array_equal(getattr(loaded, name)[slots], getattr(rm, name)[slots], err_msg=name)
    for name in vr.EpisodeReplay.SCALARS:
        assert getattr(loaded, name) == getattr(rm, name), name
    draws = {}
    for memory in (rm, loaded):
        generator = np.random.default_rng(42)
        if per == "rank":
            draws[id(memory)] = [memory.sample_per(64, generator, 0.6) for _ in range(3)]
        else:
            draws[id(memory)] = [(memory.sample(64, generator), None) for _ in range(3)]
    for (idx, weights), (idx_loaded, weights_loaded) in zip(draws[id(rm)], draws[id(loaded)]):
        np.testing.assert_array_equal(idx, idx_loaded)
        np.testing.assert_array_equal(weights, weights_loaded)


def test_a_refreshed_V_of_the_final_state_moves_the_targets_of_its_episode():
    """`update_samples` with the sampled last steps of truncated episodes: their V(s_L) is stored, and Q^ret of the
    last step (r_L + gamma V(s_L)) and of every prior step of the episode follow it (Eq. (8) from the new bootstrap)."""
    rng = np.random.default_rng(43)
    rm = vr.EpisodeReplay(300, 3, 2, 0.99, max_episode_len=40, per_alpha=0.5)
    fill(rm, rng, 30)
    last = np.flatnonzero(rm.truncated_last)[:5]
    assert len(last) == 5
    before = rm.qret_at(rm.episode_start[last])
    new_boot = rm.boot_value[last] + 10.0
    rm.update_samples(last, rm.rho[last], rm.value[last], last, new_boot)
    np.testing.assert_array_equal(rm.boot_value[last], new_boot)
    np.testing.assert_allclose(rm.qret_at(last), rm.scaled_reward[last] + rm.gamma * new_boot, rtol=1e-12)
    assert np.all(rm.qret_at(rm.episode_start[last]) > before)
    check_qret_consistent(rm)

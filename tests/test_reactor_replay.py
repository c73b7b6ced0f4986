"""Tests of reactor.py's prioritized sequence replay: the lazy priority estimates and sampler (paper 3.3) against brute
force and a slow reference, the sum tree walks against numpy, and the replay's keys, evictions and gathers."""

import math

import numpy as np
import pytest
import reactor_helpers
import torch
from reactor_helpers import ATARI

import reactor
from common.sum_tree import SumTree
from reactor import LazyPriorities, SequenceReplay, discounts_and_traces

# pytest fixtures of reactor_helpers (float64_by_default: autouse, every test of this file runs in float64)
float64_by_default = reactor_helpers.float64_by_default


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
                    prio[k_] = p_
                    known[k_] = True
            elif op == 2 and valid.any():
                ks = rng.choice(np.flatnonzero(valid), size=int(rng.integers(1, 3)))
                lp.remove(ks)
                valid[ks] = False
                known[ks] = False
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
        self.N = N
        self.eps = eps
        self.valid = set()
        self.prio = {}

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
        keys = sorted(self.valid)
        ks = sorted(self.prio)
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
        n = len(self.valid)
        p_hat = self.p_hat()
        total = sum(p_hat.values())
        if not self.prio or total <= 0:
            return [1.0 / n] * len(keys)
        return [self.eps / n + (1 - self.eps) * p_hat[int(t)] / total for t in keys]

    def sample(self, batch, rng):
        """5 uniforms per draw (LazyPriorities.sample's docstring): rank, uniform coin, mass point, known or not,
        offset; cells by a search in the cumulative masses, keys by position in the sorted list."""
        keys, ks, _, size = self.cells()
        n = len(keys)
        masses = self.masses()
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
        lp = LazyPriorities(N, eps)
        slow = SlowLazyPriorities(N, eps)
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


# ----------------------------------------------------------------------------------------------------------------
# the sequence replay
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
        "version": t // 7,
    }


def test_sequence_replay_keys_eviction_and_gathers():
    T = 4
    seg = 20
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
    T = 4
    seg = 40
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


def test_sequence_replay_sample_reads_state_and_mu_of_the_right_slots():
    """Slots whose LSTM state and mu encode (segment, time) (elsewhere they hold constants, where any slot looks right):
    a sampled sequence starts from the state stored with its first slot (its key), each of the 4 parts (h_q, c_q,
    h_pi, c_pi) in its place, and its mu rows are those of its own T + 1 slots, across the wrap of a segment's ring."""
    T = 4
    seg = 20
    A = 3
    H = 4
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

"""plr_ppo.py's level sampler (Algorithm 4, App. B.3): the committed scores against a slow textbook Algorithm 4
(tests/plr_helpers.py), --plr-commit update and --resume's restart, the replay decision P_D, P_new and P_replay's
frequencies, staleness, the unbounded top-M buffer, the state round trip, and both modes (BoundedLevelSampler,
UnboundedLevelSampler) against the sampler as it was before they were split, from its saved states
(tests/plr_sampler_golden.json)."""

import json
from pathlib import Path

import numpy as np
import pytest
from plr_helpers import random_rollouts, textbook_scores

from plr_ppo import (
    BoundedLevelSampler,
    LevelSampler,
    SamplerConfig,
    UnboundedLevelSampler,
    replay_distribution,
)


# ----------------------------------------------------------------------------------------------------------------
# Committed scores: Algorithm 4's stitching, --plr-commit update, --resume's restart
def test_commit_after_update_mode_flushes_partials():
    s = BoundedLevelSampler(np.arange(10), 1, SamplerConfig(commit="update"))
    s.update_with_rollouts(np.array([[1.0], [3.0]]), np.array([[False], [False]]), np.array([[4], [4]]))
    assert not s.seen[4]
    s.after_update()  # authors' code: the partial score becomes the level's score
    assert s.seen[4] and s.scores[4] == pytest.approx(2.0) and s.partial_steps[0] == 0
    s.update_with_rollouts(np.array([[5.0], [7.0]]), np.array([[True], [False]]), np.array([[4], [8]]))
    assert s.scores[4] == pytest.approx(5.0)  # only the tail after the flush
    e = BoundedLevelSampler(np.arange(10), 1, SamplerConfig(commit="episode"))
    e.update_with_rollouts(np.array([[1.0], [3.0]]), np.array([[False], [False]]), np.array([[4], [4]]))
    e.after_update()
    assert not e.seen[4]


def test_restart_episodes_drops_partial_scores():
    """`--resume` restarts each env's level from its first frame: the restarted episode is scored on its own steps."""
    s = BoundedLevelSampler(np.arange(10), 2)
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
        s = BoundedLevelSampler(
            np.arange(N * per), N, SamplerConfig(score_alpha=alpha, commit="update" if flush else "episode")
        )
        for scores, dones, levels in rollouts:
            s.update_with_rollouts(scores, dones, levels)
            s.after_update()
        S, scored = textbook_scores(rollouts, N * per, alpha=alpha, flush_each_update=flush)
        np.testing.assert_array_equal(s.seen, scored)
        np.testing.assert_allclose(s.scores, S, rtol=1e-10, atol=1e-12, err_msg=f"case {case}")


# ----------------------------------------------------------------------------------------------------------------
# Sampling: P_D, P_new, P_replay, staleness, unbounded buffer, state round-trip
def _binomial_ok(k, n, p, z=5.0):
    return abs(k - n * p) <= z * np.sqrt(n * p * (1 - p)) + 1


def test_replay_decision_frequencies_and_unseen_uniform():
    s = BoundedLevelSampler(np.arange(100), 1, seed=1)
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
    f = BoundedLevelSampler(np.arange(100), 1, SamplerConfig(replay_schedule="fixed", replay_prob=0.8, min_fill=0.2))
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
    s = BoundedLevelSampler(np.arange(8), 1, SamplerConfig(transform="power", temperature=1.0, staleness_coef=0.0), seed=5)
    s.seen[:] = True
    s.num_seen = 8
    s.scores[:] = rng.random(8)
    p = replay_distribution(s.scores, s.staleness, s.seen, "power", 1.0, 0.0)
    n = 8000
    counts = np.bincount([s.sample(0) for _ in range(n)], minlength=8)
    for k, pk in zip(counts, p):
        assert _binomial_ok(k, n, pk)


def test_staleness_is_episode_count_minus_timestamp():
    s = BoundedLevelSampler(np.arange(20), 3, SamplerConfig(staleness_coef=0.5), seed=2)
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
    s = BoundedLevelSampler(np.arange(1000), 64, seed=3)
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
    s = UnboundedLevelSampler(2, SamplerConfig(buffer_size=3, replay_schedule="fixed", replay_prob=0.5), seed=0)
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
    a = BoundedLevelSampler(np.arange(50), 4, SamplerConfig(staleness_coef=0.3), seed=11)
    for scores, dones, levels in random_rollouts(rng, 3, 16, 4, 12):
        for i in range(4):
            a.sample(i)
        a.update_with_rollouts(scores, dones, levels)
    b = BoundedLevelSampler(np.arange(50), 4, SamplerConfig(staleness_coef=0.3), seed=999)
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
    s = BoundedLevelSampler(np.arange(5, 10), 1, SamplerConfig(strategy="random"), seed=0)
    counts = np.bincount([s.sample(0) for _ in range(5000)], minlength=10)
    assert counts[:5].sum() == 0 and all(_binomial_ok(k, 5000, 0.2) for k in counts[5:])


# ----------------------------------------------------------------------------------------------------------------
# Both modes against the sampler before its split (its saved states: an old checkpoint's)
# the saved scenarios: name -> (levels, None in unbounded mode; num_actors; SamplerConfig fields; seed)
GOLDEN_SCENARIOS = {
    "bounded_proportionate": (list(range(50)), 4, dict(staleness_coef=0.3), 11),
    "bounded_power_commit_update": (
        list(range(30)),
        3,
        dict(transform="power", temperature=0.5, commit="update", score_alpha=0.5, min_fill=0.1),
        12,
    ),
    "bounded_fixed_greedy": (list(range(20)), 2, dict(transform="greedy", replay_schedule="fixed", replay_prob=0.7), 13),
    "unbounded_fixed": (None, 3, dict(buffer_size=6, replay_schedule="fixed", replay_prob=0.5, staleness_coef=0.3), 14),
    "random_bounded": (list(range(10, 20)), 2, dict(strategy="random"), 15),
    "random_unbounded": (None, 2, dict(strategy="random", buffer_size=4, replay_schedule="fixed"), 16),
}


def drive_sampler(sampler, rng, num_rollouts, num_steps, levels_now=None):
    """A rollout driver as the training loop: each actor plays its level, an episode end (probability 0.2 per step)
    draws the actor's next level from the sampler inside the step; after each rollout, update_with_rollouts with
    random per-step scores, then after_update. Returns (every level drawn, the actors' current levels)."""
    num_actors = len(sampler.partial_score)
    drawn = []
    if levels_now is None:
        levels_now = [sampler.sample(actor) for actor in range(num_actors)]
        drawn += levels_now
    levels_now = list(levels_now)
    for _ in range(num_rollouts):
        scores = rng.normal(size=(num_steps, num_actors))
        dones = rng.random((num_steps, num_actors)) < 0.2
        levels = np.zeros((num_steps, num_actors), np.int64)
        for t in range(num_steps):
            for actor in range(num_actors):
                levels[t, actor] = levels_now[actor]
                if dones[t, actor]:
                    levels_now[actor] = sampler.sample(actor)
                    drawn.append(levels_now[actor])
        sampler.update_with_rollouts(scores, dones, levels)
        sampler.after_update()
    return drawn, levels_now


def encode_state(state):
    """A sampler state_dict as JSON (arrays with their dtypes, the staged levels as pairs, the RNG state)."""
    out = {}
    for name, value in state.items():
        if isinstance(value, np.ndarray):
            out[name] = {"dtype": str(value.dtype), "values": value.tolist()}
        elif name == "staged":
            out[name] = [[int(level), int(count)] for level, count in value.items()]
        else:
            out[name] = value
    return out


def decode_state(encoded):
    state = {}
    for name, value in encoded.items():
        if isinstance(value, dict) and "dtype" in value:
            state[name] = np.array(value["values"], dtype=value["dtype"])
        elif name == "staged":
            state[name] = {level: count for level, count in value}
        else:
            state[name] = value
    return state


GOLDEN = Path(__file__).parent / "plr_sampler_golden.json"


@pytest.mark.parametrize("name", list(GOLDEN_SCENARIOS))
def test_both_modes_draw_and_save_as_the_sampler_before_its_split(name):
    """tests/plr_sampler_golden.json holds, for each scenario, what the one-class LevelSampler (before the two modes
    were BoundedLevelSampler and UnboundedLevelSampler) drew and saved while `drive_sampler` ran it for 4 rollouts
    (its state_dict then: an old checkpoint's "sampler"), and what it drew over 4 more rollouts and its state at the
    end. Today's mode class makes the same draws from the same seed and saves the same state; loaded from the old
    state into a sampler of another seed, it continues with the same draws, the same RNG state and the same stats."""
    levels, num_actors, config, seed = GOLDEN_SCENARIOS[name]
    golden = json.loads(GOLDEN.read_text())[name]

    def make_sampler(seed):
        if levels is None:
            return UnboundedLevelSampler(num_actors, SamplerConfig(**config), seed=seed)
        return BoundedLevelSampler(np.array(levels), num_actors, SamplerConfig(**config), seed=seed)

    sampler = make_sampler(seed)
    rng = np.random.default_rng(seed + 100)
    drawn, levels_now = drive_sampler(sampler, rng, 4, 12)
    assert drawn == golden["warmup_drawn"] and levels_now == golden["levels_now"]
    assert json.loads(json.dumps(encode_state(sampler.state_dict()))) == golden["state"]
    resumed = make_sampler(seed + 999)
    resumed.load_state_dict(decode_state(golden["state"]))
    drawn, _ = drive_sampler(resumed, rng, 4, 12, golden["levels_now"])
    assert drawn == golden["drawn"]
    assert json.loads(json.dumps(encode_state(resumed.state_dict()))) == golden["final_state"]
    assert resumed.stats() == golden["stats"]


def test_new_and_replayed_levels_are_training_levels_whatever_the_start_level():
    """Λ_train = [start_level, start_level + n) (--start-level 5 here): P_new is uniform over its unseen levels (a level
    seed, not a slot index), and once some are scored every level drawn, new or replayed, is still a training level."""
    s = BoundedLevelSampler(np.arange(5, 35), 4, seed=0)
    n = 6000
    counts = np.bincount([s.sample(0) for _ in range(n)], minlength=35)
    assert counts[:5].sum() == 0
    assert all(_binomial_ok(k, n, 1 / 30) for k in counts[5:])
    scored = [5, 9, 20, 34]
    s.update_with_rollouts(np.ones((1, 4)), np.ones((1, 4), bool), np.array([scored]))
    assert set(np.flatnonzero(s.seen)) == {level - 5 for level in scored} and s.num_seen == 4
    drawn = [s.sample(0) for _ in range(2000)]
    assert set(drawn) <= set(range(5, 35)) and s.num_replays > 0

"""common/minatar_env.py: shapes, padding, seeding, MinAtar's own dynamics, termination vs truncation, random return."""

import numpy as np
import pytest
from minatar import Environment

from common.minatar_env import MINATAR_ENV_IDS, MINATAR_GAMES, MINATAR_MAX_CHANNELS, make_minatar_env

CHANNELS = {"Asterix": 4, "Breakout": 4, "Freeway": 7, "Seaquest": 10, "SpaceInvaders": 6}
MINIMAL_ACTIONS = {"Asterix": 5, "Breakout": 3, "Freeway": 3, "Seaquest": 6, "SpaceInvaders": 4}


def game_of(env_id):
    return env_id.split("/")[1].rsplit("-v", 1)[0]


def rollout(env, seed, steps, action_seed=0):
    """Observations, rewards and end flags of `steps` random-action steps from a seeded reset (resets at episode ends)."""
    rng = np.random.default_rng(action_seed)
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        out.append((obs, reward, terminated, truncated))
        if terminated or truncated:
            out.append(env.reset()[0])
    return out


def same(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else all(np.array_equal(u, v) for u, v in zip(x, y))
        for x, y in zip(a, b)
    )


def test_ids_are_minatars_registered_names_for_all_five_games():
    assert len(MINATAR_ENV_IDS) == 10 and MINATAR_MAX_CHANNELS == max(CHANNELS.values())
    assert {game_of(e) for e in MINATAR_ENV_IDS} == set(MINATAR_GAMES) == set(CHANNELS)
    with pytest.raises(ValueError, match="unknown MinAtar env id"):
        make_minatar_env("MinAtar/Pong-v0", 0)


@pytest.mark.parametrize("env_id", MINATAR_ENV_IDS)
def test_shapes_dtypes_and_action_sets(env_id):
    env = make_minatar_env(env_id, 0)
    game = game_of(env_id)
    obs, info = env.reset(seed=0)
    assert obs.shape == env.observation_space.shape == (CHANNELS[game], 10, 10) and obs.dtype == np.uint8
    assert set(np.unique(obs)) <= {0, 1} and info == {}
    assert env.action_space.n == (6 if env_id.endswith("-v0") else MINIMAL_ACTIONS[game])
    for _ in range(50):
        obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        assert obs.shape == (CHANNELS[game], 10, 10) and obs.dtype == np.uint8 and env.observation_space.contains(obs)
        assert isinstance(reward, float) and isinstance(terminated, bool) and isinstance(truncated, bool)
        if terminated or truncated:
            env.reset()


@pytest.mark.parametrize("game", list(MINATAR_GAMES))
def test_padding_adds_zero_channels_and_keeps_the_game(game):
    env_id = f"MinAtar/{game}-v0"
    plain = rollout(make_minatar_env(env_id, 0), seed=5, steps=200)
    padded = rollout(make_minatar_env(env_id, 0, pad_channels=MINATAR_MAX_CHANNELS), seed=5, steps=200)
    c = CHANNELS[game]
    for p, q in zip(plain, padded):
        p_obs, q_obs = (p, q) if isinstance(p, np.ndarray) else (p[0], q[0])
        assert q_obs.shape == (MINATAR_MAX_CHANNELS, 10, 10)
        assert np.array_equal(q_obs[:c], p_obs) and not q_obs[c:].any()
        if not isinstance(p, np.ndarray):
            assert p[1:] == q[1:]
    with pytest.raises(ValueError, match="pad_channels"):
        make_minatar_env("MinAtar/Seaquest-v0", 0, pad_channels=4)


@pytest.mark.parametrize("game", list(MINATAR_GAMES))
def test_same_trajectories_as_minatars_own_environment(game):
    """The adapter repeats minatar.Environment's sticky-action and seeding logic: the same seed and actions must give
    the same states, rewards and ends (MinAtar's sticky memory is reset to no-op at each reset, as the adapter does)."""
    env = make_minatar_env(f"MinAtar/{game}-v0", 0)
    ref = Environment(MINATAR_GAMES[game])  # sticky 0.1, ramping on: the defaults of both
    rng = np.random.default_rng(1)
    obs, _ = env.reset(seed=7)
    ref.seed(7)
    ref.reset()
    ref.last_action = 0
    ends = 0
    for _ in range(3000):
        action = int(rng.integers(6))
        obs, reward, terminated, truncated, _ = env.step(action)
        ref_reward, ref_terminal = ref.act(action)
        assert np.array_equal(obs.transpose(1, 2, 0).astype(bool), ref.state())
        assert (reward, terminated, truncated) == (ref_reward, ref_terminal, False)
        if terminated:
            ends += 1
            env.reset()
            ref.reset()
            ref.last_action = 0
    assert ends > 0 or game == "Freeway"


@pytest.mark.parametrize("env_id", ["MinAtar/Breakout-v0", "MinAtar/SpaceInvaders-v1"])
def test_a_seed_determines_the_episode(env_id):
    a = rollout(make_minatar_env(env_id, 0), seed=3, steps=300)
    b = rollout(make_minatar_env(env_id, 0), seed=3, steps=300)
    c = rollout(make_minatar_env(env_id, 0), seed=4, steps=300)
    assert same(a, b) and not same(a, c)
    env = make_minatar_env(env_id, 0)  # a seeded reset of a used env starts the same episode again
    rollout(env, seed=9, steps=123, action_seed=5)
    assert same(rollout(env, seed=3, steps=300), a)


def test_time_limit_is_a_truncation_with_the_true_last_observation():
    limited = make_minatar_env("MinAtar/Freeway-v0", 0, max_episode_steps=40)
    free = make_minatar_env("MinAtar/Freeway-v0", 0, max_episode_steps=None)
    limited.reset(seed=2)
    free.reset(seed=2)
    for t in range(1, 41):
        obs, reward, terminated, truncated, info = limited.step(1)
        free_obs, free_reward, free_terminated, free_truncated, _ = free.step(1)
        assert np.array_equal(obs, free_obs) and reward == free_reward and not terminated and not free_truncated
        assert truncated == (t == 40) and ("episode" in info) == (t == 40)
    assert info["episode"]["l"] == 40
    with pytest.raises(ValueError, match="max_episode_steps"):
        make_minatar_env("MinAtar/Freeway-v0", 0, max_episode_steps=0)


def test_games_own_ends_are_terminations():
    """Freeway's 2,500-frame clock and a lost Breakout game end the episode as terminated, never truncated."""
    env = make_minatar_env("MinAtar/Freeway-v0", 0)  # default limit 10,000 > Freeway's clock
    env.reset(seed=0)
    total = 0.0
    while True:
        _, reward, terminated, truncated, info = env.step(2)  # always up (action 2 of the full set): scores
        total += reward
        if terminated or truncated:
            break
    assert terminated and not truncated and info["episode"]["l"] == 2501 and info["episode"]["r"] == total > 0
    env = make_minatar_env("MinAtar/Breakout-v0", 0)
    env.reset(seed=0)
    for _ in range(10_000):
        _, _, terminated, truncated, info = env.step(0)
        if terminated or truncated:
            break
    assert terminated and not truncated and info["episode"]["l"] < 100


def test_random_policy_breakout_return_matches_minatars_published_figure():
    """MinAtar's README: a uniformly random policy scores 0.5 +- 0.02 on Breakout (full action set, sticky 0.1)."""
    env = make_minatar_env("MinAtar/Breakout-v0", 0)
    env.reset(seed=0)
    returns = []
    while len(returns) < 4000:
        _, _, terminated, truncated, info = env.step(env.action_space.sample())
        if terminated or truncated:
            returns.append(info["episode"]["r"])
            env.reset()
    mean = np.mean(returns)
    stderr = np.std(returns) / np.sqrt(len(returns))
    assert abs(mean - 0.5) < 0.05 and stderr < 0.02, (mean, stderr)

"""common/atari_env.py: shapes, dtypes, clipping vs real score, life loss without game reset, bad ids."""

import numpy as np
import pytest

from common.atari_env import make_atari_env


def _play(env, steps, seed=0):
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    out = []
    for _ in range(steps):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        out.append((obs, reward, terminated, truncated, info))
        if terminated or truncated:
            env.reset()
    return out


@pytest.mark.parametrize("frame_stack", [1, 4])
def test_shapes_and_dtypes(frame_stack):
    env = make_atari_env("ALE/Pong-v5", 0, frame_stack=frame_stack)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (frame_stack, 84, 84) and obs.dtype == np.uint8
    assert env.observation_space.shape == (frame_stack, 84, 84)
    obs, *_ = env.step(0)
    assert obs.shape == (frame_stack, 84, 84) and obs.dtype == np.uint8
    assert env.action_space.n == 6
    assert make_atari_env("ALE/Pong-v5", 0, full_action_space=True).action_space.n == 18


def test_real_score_while_rewards_clipped():
    """SpaceInvaders pays 5..30 points per alien: the clipped rewards are in {-1,0,1} but info['episode'] holds the
    real score, which equals the unclipped sum of an identically seeded env."""
    kw = dict(frame_stack=1, terminal_on_life_loss=False, sticky_action_prob=0.0, noop_max=0, max_episode_frames=1000)
    clipped_env = make_atari_env("ALE/SpaceInvaders-v5", 3, clip_rewards=True, **kw)
    raw_env = make_atari_env("ALE/SpaceInvaders-v5", 3, clip_rewards=False, **kw)
    steps = 1000 // 4 + 5
    clipped = _play(clipped_env, steps, seed=3)
    raw = _play(raw_env, steps, seed=3)
    clipped_rewards = np.array([t[1] for t in clipped])
    raw_rewards = np.array([t[1] for t in raw])
    assert set(np.unique(clipped_rewards)) <= {-1.0, 0.0, 1.0}
    assert raw_rewards.max() > 1.0  # real points
    assert np.array_equal(np.sign(raw_rewards), clipped_rewards)
    episodes = [t[4]["episode"] for t in clipped if "episode" in t[4]]
    assert episodes, "the frame limit must end the game within the run"
    end = next(i for i, t in enumerate(clipped) if "episode" in t[4])
    assert episodes[0]["r"] == pytest.approx(raw_rewards[: end + 1].sum())
    assert episodes[0]["r"] > clipped_rewards[: end + 1].sum()
    assert clipped[end][3] and not clipped[end][2], "the frame limit is a truncation"


def test_life_loss_ends_episode_without_resetting_game():
    env = make_atari_env("ALE/Breakout-v5", 0, frame_stack=1, sticky_action_prob=0.0)
    env.reset(seed=0)
    ale = env.unwrapped.ale
    rng = np.random.default_rng(0)
    life_ends = 0
    game_ends = 0
    for _ in range(3000):
        _, _, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            frame_before = ale.getEpisodeFrameNumber()
            lives_before = ale.lives()
            env.reset()
            if info["game_over"]:
                game_ends += 1
                assert "episode" in info and ale.lives() == 5
                assert ale.getEpisodeFrameNumber() < 200  # a fresh game (only no-op starts)
                if game_ends == 2:
                    break
            else:
                life_ends += 1
                assert "episode" not in info, "a lost life is not the end of the game's score"
                assert ale.lives() == lives_before and ale.getEpisodeFrameNumber() > frame_before  # same game goes on
    assert life_ends >= 4 and game_ends >= 1


def test_unknown_id_and_bad_options_fail_clearly():
    with pytest.raises(ValueError, match="unknown Atari env id"):
        make_atari_env("ALE/NoSuchGame-v5", 0)
    with pytest.raises(ValueError, match="frame_stack"):
        make_atari_env("ALE/Pong-v5", 0, frame_stack=0)
    with pytest.raises(ValueError, match="video_folder"):
        make_atari_env("ALE/Pong-v5", 0, capture_video=True)


def test_capture_video_without_moviepy_fails_clearly(tmp_path):
    try:
        import moviepy  # noqa: F401

        pytest.skip("moviepy is installed: videos can be recorded")
    except ImportError:
        pass
    with pytest.raises(ValueError, match="capture-video needs a working moviepy"):
        make_atari_env("ALE/Pong-v5", 0, capture_video=True, video_folder=str(tmp_path))

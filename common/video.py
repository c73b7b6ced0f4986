"""Video recording support check shared by the environment adapters and the scripts' `--capture-video` flag.

gymnasium's `RecordVideo` writes mp4 files through moviepy, which is not in requirements.txt (moviepy 2.x with the
imageio-ffmpeg 0.3.0 that gym3 pins needs pkg_resources and pillow<12). `check_video_support()` turns its absence
into a one-line error at start-up instead of a traceback from inside an actor process.
"""


def check_video_support() -> None:
    """Raise a one-line error unless gymnasium's RecordVideo can write files (it needs moviepy, which is not in
    requirements.txt: its ffmpeg wheel pin clashes with gym3's; install `moviepy` to use --capture-video)."""
    try:
        import moviepy  # noqa: F401 (imported only to see that it loads)
    except Exception as e:  # ImportError, or a broken ffmpeg backend
        raise ValueError(
            f"--capture-video needs a working moviepy ({type(e).__name__}: {e}); install it to record videos"
        ) from None

"""plr_ppo.py end to end: a tiny Procgen run (MiniGrid runs: tests/test_plr_loop.py, tests/test_plr_resume.py, and in
subprocesses tests/test_lifecycle.py)."""

import json

from plr_helpers import run_main


# ----------------------------------------------------------------------------------------------------------------
# A tiny Procgen run
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

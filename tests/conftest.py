"""Test configuration: make the repository root importable (`import common`, `import plr_ppo`, ...)."""

import os
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _end_of_an_in_process_run(code: int) -> None:
    """`exit_now` for a run made in the test process: the stop's code as SystemExit (a normal end returns)."""
    if code:
        raise SystemExit(code)


@pytest.fixture(autouse=True, scope="session")
def in_process_runs_never_end_pytest():
    """A script's `__main__` run in this process (tests/plr_helpers.py's run_main, tests/vracer_helpers.py's
    probe_main, also from session fixtures) makes its logger this process's run (`common.processes.run_started`),
    and `finish_run` would end pytest itself (`exit_now`: os._exit, no report, exit code 0). For the whole session
    such a run ends as any other logger's does: SystemExit with a stop's code, a return after a normal end."""
    from common import processes

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processes, "exit_now", _end_of_an_in_process_run)
        yield


@pytest.fixture(autouse=True)
def run_state_put_back(monkeypatch):
    """The run an in-process `__main__` registered (`run_started`) and the hooks it installed end with the test."""
    from common import processes

    monkeypatch.setattr(processes, "_run_logger", None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)

"""Supervision of actor processes, identical in every script: start, watch, report a death, shut down.

`ProcessGroup(ctx)` starts module-level functions in child processes (`ctx` from
`multiprocessing.get_context("spawn" | "forkserver")`; never `fork` once a learner may hold a CUDA context).
In each child, SIGINT is ignored (Ctrl-C reaches the whole process group; the parent alone handles it and stops the
children), torch uses one thread, and an exception's traceback is sent back to the parent through a queue.
Each child also holds the read end of a `Lifeline`, a pipe whose write end only the parent holds: when the parent
dies, even by SIGKILL (out of memory, pre-emption), the kernel closes that end and a thread in the child reads
end-of-file and ends the child. `os.getppid()` cannot tell: under forkserver the parent is the fork server.
Actors receive `group.stop_event` (a lock-free `StopFlag`) and return when it is set. `check()` raises `ActorDied`
naming the process, its exit code and its traceback; `stop()` sets the flag, then joins, terminates and kills; it is
safe to call twice.

No lock is shared between the parent and the actors for supervision: a child killed while holding a lock (SIGKILL,
out-of-memory) would leave it held forever, and the parent would hang on its next acquire. So the stop signal is one
shared byte (single writer: the parent), and counters written by actors are unlocked shared values, one writer each.

Signals and stop reasons, the same in every script: after `stop_on_signals()`, SIGINT (Ctrl-C, also when the run
was started with SIGINT ignored, as a background job) and SIGTERM are only recorded; `check_stop()`, called by the
main loops and their waits (and by `ProcessGroup.check()`), raises `Interrupted` there, at a safe point. A handler
that raised could break off any line, TensorBoard's writer queue included (a lost wake-up or a lock left held, and
`close()` then waits 120 s or forever). The script's main loop catches `Interrupted` and `StopRun` (a dead actor:
`ActorDied`; an unwritable run folder: `CheckpointFailed`), stops its processes in `finally`, and
`stop_reason(error)` gives summary.json's `stop_reason` ("completed", "interrupted by SIGTERM", "actor-1 died (exit
code -9): ...") and the exit code (0, 128 + signal, 1); `finish_run` is the end of every script (model, final
evaluation, summary.json, exit code).
`check_memory(need, flag)` refuses at start-up a replay memory that does not fit in RAM.

Threads: every actor/worker process uses 1 torch thread; `set_learner_threads(n)` gives the learner the cores that
its n other CPU processes do not use (at least 1), so that the learner does not fight its own actors.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as in a container or under taskset), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo: what a replay memory may take (no limit where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 62


def check_memory(need: int, flag: str, fraction: float = 0.9) -> None:
    """Print what a replay memory needs at start-up; refuse with one line (`error: ...`) when it would take more than
    `fraction` of the available RAM, naming the flag that sizes it."""
    avail = available_memory_bytes()
    print(f"replay memory: {need / 2**30:.2f} GiB ({avail / 2**30:.1f} GiB available)", flush=True)
    if need > fraction * avail:
        raise SystemExit(
            f"error: the replay memory needs {need / 2**30:.2f} GiB, more than {fraction:.0%} of the "
            f"{avail / 2**30:.1f} GiB of RAM available: lower {flag}"
        )


def set_learner_threads(num_actor_processes: int) -> int:
    """Give the learner's torch the cores that the actor/worker processes (1 thread each) do not use, at least 1.

    Pass every other CPU-bound process of the run (actors, test actors, env workers). The rule is the same with the
    learner on an accelerator: its CPU-side work (batch assembly, copies) must not fight the actors either.
    Prints one start-up line, the same in every script, and returns the learner's thread count.
    """
    import torch

    cores = available_cores()
    threads = max(1, cores - num_actor_processes)
    torch.set_num_threads(threads)
    print(f"threads: learner {threads} ({cores} cores, {num_actor_processes} actor processes, 1 thread each)", flush=True)
    return threads


class Interrupted(KeyboardInterrupt):
    """Raised in the main process by SIGINT (Ctrl-C) or SIGTERM once `stop_on_signals()` is installed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        # The shell's convention: 130 for SIGINT, 143 for SIGTERM.
        self.exit_code = 128 + signum


# the signals received since `stop_on_signals()`, in order (written by the handler only)
_received_signals: list[int] = []


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM request a stop: the handler records the signal and returns, and the next
    `check_stop()` raises `Interrupted`, so the run stops its actors, writes summary.json and exits 130 / 143.
    Installed explicitly, so a run started in the background with SIGINT ignored still stops."""
    _received_signals.clear()

    def handler(signum, frame):
        _received_signals.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def stop_requested() -> bool:
    """True once SIGINT or SIGTERM arrived (after `stop_on_signals()`)."""
    return bool(_received_signals)


def check_stop() -> None:
    """Raise `Interrupted` for the first signal received, if any: call it where the main process may stop."""
    if _received_signals:
        raise Interrupted(_received_signals[0])


def stop_reason(error: BaseException | None) -> tuple[str, int]:
    """(summary.json's `stop_reason`, the exit code) for how the main loop ended: normally (None), by a signal, by
    a dead actor or worker, or by another exception."""
    if error is None:
        return "completed", 0
    if isinstance(error, Interrupted):
        return f"interrupted by {error}", error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(error, StopRun):
        return str(error), 1
    return f"error: {type(error).__name__}: {error}", 1


def finish_run(
    logger, error: BaseException | None, summary: dict, model_file: dict | None = None, final_eval: Callable | None = None
) -> None:
    """The end of every script, once its processes are stopped: print why the run stopped; after a normal end write
    `model_file` (the weights and `args`) atomically to `<run dir>/<exp_name>.model` and run the final evaluation
    (`final_eval()` logs and returns summary entries; a signal during either stops it and keeps the summary); write
    summary.json with `stop_reason`, close the logger and exit with the stop's code (0, 128 + signal, 1)."""
    # imported here like torch elsewhere in this module: common.checkpoint imports torch
    from common.checkpoint import save_checkpoint

    reason, exit_code = stop_reason(error)
    if isinstance(error, ActorDied) and error.traceback:
        print(error.traceback, flush=True)
    if exit_code:
        print(f"stopped: {reason}", flush=True)
    summary["stop_reason"] = reason
    if not exit_code:
        try:
            check_stop()
            if model_file is not None:
                path = logger.dir / f"{model_file['args']['exp_name']}.model"
                save_checkpoint(path, model_file)
                print(f"model saved to {path}", flush=True)
            if final_eval is not None:
                summary.update(final_eval())
            check_stop()
        except KeyboardInterrupt as e:
            reason, exit_code = stop_reason(e)
            summary["stop_reason"] = f"{reason} during the final evaluation"
            print(f"stopped: {summary['stop_reason']}", flush=True)
        except CheckpointFailed as e:
            # an unwritable run folder: the model file is lost; the summary says so if it can still be written
            summary["stop_reason"] = str(e)
            print(f"error: {e}", flush=True)
            exit_code = 1
    try:
        logger.summary(summary)
    except OSError as e:
        # an unwritable run folder: say so in one line, keep the stop's exit code (or 1)
        print(f"error: summary.json not written: {e}", flush=True)
        exit_code = exit_code or 1
    logger.close()
    if exit_code:
        raise SystemExit(exit_code)


class StopRun(RuntimeError):
    """A reason to stop the run early other than a signal; its message is summary.json's `stop_reason`."""


class CheckpointFailed(StopRun):
    """The run folder can no longer be written (`save_checkpoint`): the run stops rather than lose its progress."""


class ActorDied(StopRun):
    """A child process ended while the run was going; `.traceback` holds the child's traceback if it sent one."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback = traceback_text


class Lifeline:
    """A pipe whose write end only the parent holds; each child gets the read end (`reader`, a `Process` argument) and
    calls `exit_with_parent(reader)`. Nothing is ever written: the child's read returns only when the parent died."""

    def __init__(self, ctx):
        self.reader, self._writer = ctx.Pipe(duplex=False)


def exit_with_parent(reader) -> None:
    """Child side: a daemon thread that ends this process as soon as the parent's end of the lifeline closes."""

    def watch():
        try:
            reader.recv()
        except (EOFError, OSError):
            pass
        # the parent is gone: nobody reads our results, and nothing else would stop us
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _guarded(target: Callable, args: tuple, name: str, error_queue, lifeline_reader) -> None:
    """Child entry point: one thread, parent handles Ctrl-C, tracebacks go back to the parent, exit with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(lifeline_reader)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        target(*args)
    except Exception:
        error_queue.put((name, traceback.format_exc()))
        raise SystemExit(1)


class StopFlag:
    """A shared stop signal with `set()` / `is_set()` like `multiprocessing.Event`, but without a lock.

    `Event.is_set()` takes the event's internal lock, so an actor killed inside it would leave that lock held and the
    parent's `set()` would then block forever. Here the parent alone writes one shared byte and children only read it.
    Pass it to children as a `Process` argument (it holds a `RawValue`, which can only be inherited at start).
    """

    def __init__(self, ctx):
        self._flag = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return self._flag.value != 0


class ProcessGroup:
    """The actor processes of one run."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.procs: list[Any] = []
        self.errors = ctx.Queue()
        # Pass it to the actors: they return when it is set.
        self.stop_event = StopFlag(ctx)
        self.stopping = False
        self._tracebacks: dict[str, str] = {}
        self.lifeline = Lifeline(ctx)

    def start(self, target: Callable, args: tuple, name: str):
        """Start `target(*args)` (a module-level function) in a child process called `name`."""
        child_args = (target, args, name, self.errors, self.lifeline.reader)
        proc = self.ctx.Process(target=_guarded, args=child_args, name=name, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def check(self) -> None:
        """Raise `Interrupted` if a stop signal arrived, ActorDied if any child has exited (while the run is not
        stopping)."""
        if self.stopping:
            return
        check_stop()
        for proc in self.procs:
            if proc.exitcode is not None:
                if not fork_server_alive(self.ctx):
                    raise ActorDied(f"the fork server died (its children {proc.name} and others with it)")
                try:
                    while True:
                        name, text = self.errors.get(timeout=0.2)
                        self._tracebacks[name] = text
                except queue.Empty:
                    pass
                tb = self._tracebacks.get(proc.name, "")
                last = tb.strip().splitlines()[-1] if tb.strip() else "no traceback (killed or exited)"
                raise ActorDied(f"{proc.name} died (exit code {proc.exitcode}): {last}", tb)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every child: set `stop_event`, wait up to `timeout` s in total, then terminate, then kill."""
        self.stopping = True
        self.stop_event.set()
        for proc in self.procs:
            proc.join(timeout=max(0.0, timeout / max(1, len(self.procs))))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=1.0)
        # Stop the fork server too: no process outlives the run.
        if self.ctx.get_start_method() == "forkserver":
            from multiprocessing import forkserver

            forkserver._forkserver._stop()


def fork_server_alive(ctx) -> bool:
    """False when `ctx` is forkserver's and its server process has died (True for other start methods)."""
    if ctx.get_start_method() != "forkserver":
        return True
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")

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

Signals and stop reasons, the same in every script. `install_stop_handling()` is each script's first statement,
before its heavy imports: from then on SIGINT (Ctrl-C, also when the run was started with SIGINT ignored, as a
background job), SIGTERM and SIGHUP (a closed terminal; left ignored under `nohup`) are only recorded, and so is a
closed stdout (`| head`: the next print meets a broken pipe; stdout then goes to /dev/null and the run stops as on
SIGPIPE). Before the run folder exists (`start_run` calls `run_started`), a stop ends the script at once: one
`stopped:` line, exit 128 + signal, nothing to save. After it, `check_stop()`, called by the main loops and their
waits (and by `ProcessGroup.check()` and `ProcessGroup.start()`), raises `Interrupted` there, at a safe point. A
handler that raised could break off any line, TensorBoard's writer queue included (a lost wake-up or a lock left
held, and `close()` then waits 120 s or forever). The script's main loop catches `Interrupted` and `StopRun` (a dead
actor: `ActorDied`; an unwritable run folder or a full disk: `RunFolderFailed`, `CheckpointFailed`), stops its
processes in `finally`, and `stop_reason(error)` gives summary.json's `stop_reason` ("completed", "interrupted by
SIGTERM", "actor-1 died (exit code -9): ...") and the exit code (0, 128 + signal, 1); `finish_run` is the end of every
script (model, final evaluation, summary.json, exit code). A stop raised outside the script's `try` (during its
start-up or after its loop) ends the run the same way (`sys.excepthook`, installed by `run_started`): its processes
stopped, summary.json with the reason, no traceback; any other exception keeps its traceback and is recorded too.
The run's process then ends by `exit_now(code)`: the atexit functions, then `os._exit`, without the interpreter's
teardown (1-2 s with torch loaded); actors and env workers end the same way.
`check_memory(need, flag, what=...)` refuses at start-up a replay memory (or a rollout) that does not fit in RAM.

Threads: every actor/worker process uses 1 torch thread; `set_learner_threads(n)` gives the learner the cores that
its n other CPU processes do not use (at least 1), so that the learner does not fight its own actors.
"""

from __future__ import annotations

import atexit
import errno
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NoReturn


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


def check_memory(need: int, flag: str, fraction: float = 0.9, what: str = "replay memory") -> None:
    """Print what a large buffer (`what`: the replay memory, a rollout) needs at start-up; refuse with one line
    (`error: ...`) when it would take more than `fraction` of the available RAM, naming the flag that sizes it."""
    avail = available_memory_bytes()
    print(f"{what}: {need / 2**30:.2f} GiB ({avail / 2**30:.1f} GiB available)", flush=True)
    if need > fraction * avail:
        raise SystemExit(
            f"error: the {what} needs {need / 2**30:.2f} GiB, more than {fraction:.0%} of the "
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
    """Raised in the main process by SIGINT (Ctrl-C), SIGTERM, SIGHUP or a closed stdout (recorded as SIGPIPE) once
    `stop_on_signals()` is installed."""

    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__(f"{name} (stdout closed)" if signum == signal.SIGPIPE else name)
        self.signum = signum
        # The shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP, 141 for a broken pipe.
        self.exit_code = 128 + signum


# the signals received since `stop_on_signals()`, in order (written by the handler only)
_received_signals: list[int] = []
# the run of this process, once `start_run` made its folder (`run_started`); None before
_run_logger = None
# with `install_stop_handling()`: a stop before `run_started` ends the process at once
_exit_before_run = False
# what must be stopped when the run ends outside its loop (ProcessGroup.stop, MiniGridVecEnv.close): weak references
_to_stop: list[weakref.WeakMethod] = []
# signals that stop a run; SIGHUP only where it is not inherited as ignored (nohup)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _record_signal(signum, frame) -> None:
    _received_signals.append(signum)
    if _exit_before_run and _run_logger is None:
        # nothing is written before the run folder exists: end at once (os.write: no buffered stream to re-enter)
        try:
            os.write(sys.stdout.fileno(), f"stopped: interrupted by {Interrupted(signum)} before the run started\n".encode())
        except (OSError, ValueError):
            pass
        os._exit(128 + signum)


def stop_on_signals() -> None:
    """From now on SIGINT, SIGTERM and SIGHUP request a stop: the handler records the signal and returns, and the next
    `check_stop()` raises `Interrupted`, so the run stops its actors, writes summary.json and exits 128 + signal.
    SIGINT is installed explicitly, so a run started in the background with SIGINT ignored still stops; SIGHUP is
    left ignored where it was inherited so (`nohup`)."""
    _received_signals.clear()
    for signum in STOP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
            continue
        signal.signal(signum, _record_signal)


def install_stop_handling() -> None:
    """The first statement of every script, before its heavy imports: `stop_on_signals()`; a closed stdout requests
    a stop too (`StdoutGuard`); until `run_started` (the run folder exists) a stop ends the script at once with one
    `stopped:` line and exit 128 + signal (no traceback from inside an import, no folder, nothing to save)."""
    global _exit_before_run
    _exit_before_run = True
    stop_on_signals()
    if not isinstance(sys.stdout, StdoutGuard):
        sys.stdout = StdoutGuard(sys.stdout)


class StdoutGuard:
    """sys.stdout, except that its reader going away (`| head`: BrokenPipeError on a write or flush) sends the rest
    of the output to /dev/null and requests a stop, recorded as SIGPIPE, instead of raising inside a print."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)
        _record_signal(signal.SIGPIPE, None)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run_started(logger) -> None:
    """Called by `start_run` once the run folder exists: from now on a stop is raised at the next check, and an
    exception that leaves the script (outside its `try`) still ends the run with its processes stopped, summary.json
    written and the exit code of its reason (`_end_run_on_uncaught`)."""
    global _run_logger
    _run_logger = logger
    sys.excepthook = _end_run_on_uncaught
    threading.excepthook = _quiet_disk_errors_in_threads


def stop_when_run_ends(stop: Callable[[], Any]) -> None:
    """Register a bound method (`ProcessGroup.stop`, `MiniGridVecEnv.close`) that ends what it owns when the run
    ends outside the script's loop (weakly held: a closed, collected object is skipped)."""
    _to_stop.append(weakref.WeakMethod(stop))


def stop_registered() -> None:
    """Call every method registered by `stop_when_run_ends` (the newest first); each is safe to call twice."""
    while _to_stop:
        stop = _to_stop.pop()()
        if stop is not None:
            stop()


def disk_error(error: BaseException) -> OSError | None:
    """The OSError of a failed write to the disk (full, over quota, read-only, a file too large), found in `error` or
    in the chain of exceptions behind it (torch.save raises RuntimeError with the OSError as its context); else None."""
    disk_errnos = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO, errno.EACCES, errno.EPERM}
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in disk_errnos:
            return error
        error = error.__cause__ or error.__context__
    return None


def _quiet_disk_errors_in_threads(hook_args) -> None:
    """threading.excepthook: TensorBoard's writer thread failing on a full disk prints nothing (the main thread gets
    the same error at its next write, and stops the run with one line); other errors keep their traceback."""
    if disk_error(hook_args.exc_value) is None:
        threading.__excepthook__(hook_args)


def _end_run_on_uncaught(exc_type, error, tb) -> None:
    """sys.excepthook after `run_started`: an exception that escaped the script ends the run as `finish_run` does:
    the run's processes stopped, summary.json with the reason, the exit code; a stop (signal, dead actor, the disk)
    prints one line, anything else its traceback."""
    logger = _run_logger
    if logger is None or logger.closed:
        sys.__excepthook__(exc_type, error, tb)
        return
    if not isinstance(error, (KeyboardInterrupt, StopRun)):
        failed_write = disk_error(error)
        if failed_write is not None:
            error = RunFolderFailed(f"run folder not writable: {failed_write}")
        else:
            sys.__excepthook__(exc_type, error, tb)
    stop_registered()
    finish_run(logger, error, {"global_step": logger.last_step})


def exit_now(code: int) -> NoReturn:
    """End this process with `code` as a normal exit would, without the interpreter's teardown (1-2 s once torch is
    loaded): the atexit functions (multiprocessing joins its children and queue threads and tells the resource
    tracker what was freed), a flush of stdout and stderr, then `os._exit`."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def stop_requested() -> bool:
    """True once a stop signal arrived (after `stop_on_signals()`)."""
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
    """The end of every script, once its processes are stopped: after a normal end write `model_file` (the weights
    and `args`) atomically to `<run dir>/<exp_name>.model` and run the final evaluation (`final_eval()` logs and
    returns summary entries; a stop during either ends there and keeps the summary); write summary.json with
    `stop_reason`, close the logger, print why the run stopped (`stopped: <reason>`; a disk or folder failure: one
    `error: <reason>` line on stderr) and end with the stop's code (0, 128 + signal, 1). The run of a script
    (`run_started`) ends its process here (`exit_now`); any other logger returns, or raises SystemExit(code)."""
    # imported here like torch elsewhere in this module: common.checkpoint imports torch
    from common.checkpoint import save_checkpoint

    reason, exit_code = stop_reason(error)
    if isinstance(error, ActorDied) and error.traceback:
        print(error.traceback, flush=True)
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
            error = e
            reason, exit_code = stop_reason(e)
            reason = f"{reason} during the final evaluation"
        except StopRun as e:
            # the model file not written (CheckpointFailed), or a dead worker or a full disk during the evaluation
            error = e
            reason, exit_code = stop_reason(e)
    summary["stop_reason"] = reason
    summary_error = None
    try:
        logger.summary(summary)
    except OSError as e:
        summary_error = f"summary.json not written: {e}"
    logger.close()
    if logger.failed and not exit_code:
        # the disk failed while the last records were flushed
        error = RunFolderFailed(logger.failed)
        reason = logger.failed
    if isinstance(error, RunFolderFailed):
        # the disk or the folder: the one line says what was lost
        print(f"error: {reason}" + (f"; {summary_error}" if summary_error else ""), file=sys.stderr, flush=True)
    else:
        if exit_code:
            print(f"stopped: {reason}", flush=True)
        if summary_error:
            print(f"error: {summary_error}", file=sys.stderr, flush=True)
    if error is not None or summary_error:
        exit_code = exit_code or 1
    if logger is _run_logger:
        stop_registered()
        exit_now(exit_code)
    if exit_code:
        raise SystemExit(exit_code)


class StopRun(RuntimeError):
    """A reason to stop the run early other than a signal; its message is summary.json's `stop_reason`."""


class RunFolderFailed(StopRun):
    """The run folder can no longer be written (a full disk, a read-only or vanished folder): the run stops rather
    than go on without its records."""


class CheckpointFailed(RunFolderFailed):
    """The checkpoint or the model file could not be written (`save_checkpoint`); the previous file stays intact."""


class ActorDied(StopRun):
    """A child process ended while the run was going; `.traceback` holds the child's traceback if it sent one."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback = traceback_text


def died_or_interrupted(message: str, exitcode: int | None, traceback_text: str = "") -> BaseException:
    """What a dead child means: the run's own stop (a stop signal was received, or the child died of SIGINT, as a
    Ctrl-C to the whole process group kills a child that has not yet ignored it) is `Interrupted`; else `ActorDied`."""
    if stop_requested():
        return Interrupted(_received_signals[0])
    if exitcode == -signal.SIGINT:
        return Interrupted(signal.SIGINT)
    return ActorDied(message, traceback_text)


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


# the terminal's signals reach the whole process group; a child ignores them and the parent stops its children
CHILD_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGHUP)


def start_child(proc) -> None:
    """`proc.start()` with SIGINT and SIGHUP blocked in this thread: the child starts with them blocked (the signal
    mask survives fork and exec; a fork server started now passes it on to its children), so a Ctrl-C during the
    child's imports waits until the child ignores it (`ignore_terminal_signals`), where it is dropped. This process
    receives a signal that came meanwhile when its mask is restored. CPython starts its resource tracker the same way
    (bpo-33613). The tracker is started first, unmasked: when `proc.start()` starts it, its
    `resource_tracker.ensure_running` ends by unblocking SIGINT in this thread, and the child would then start with
    SIGINT deliverable (the run's first child: a Ctrl-C during its imports was a KeyboardInterrupt traceback)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_IGNORED_SIGNALS)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def ignore_terminal_signals() -> None:
    """A child's first statement: ignore SIGINT and SIGHUP (the parent handles them and stops its children), then
    lift the mask `start_child` set; a signal pending since the start is dropped."""
    for signum in CHILD_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_IGNORED_SIGNALS)


def _guarded(target: Callable, args: tuple, name: str, error_queue, lifeline_reader, running) -> None:
    """Child entry point: Ctrl-C is the parent's, one thread, tracebacks go back to the parent, exit with the parent;
    `running` is set once the imports are done (from then on the child sees the stop flag)."""
    ignore_terminal_signals()
    exit_with_parent(lifeline_reader)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    running.value = 1
    exit_code = 0
    try:
        target(*args)
    except Exception as e:
        # a failed write to the disk (an actor saving its replay at a checkpoint on a full disk) is the run folder's
        # failure, reported in one line; any other error keeps its traceback
        failed_write = disk_error(e)
        error_queue.put((name, traceback.format_exc(), None if failed_write is None else str(failed_write)))
        exit_code = 1
    exit_now(exit_code)


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
        # one shared byte per child, set once its imports are done and its target runs
        self._running: list[Any] = []
        self.errors = ctx.Queue()
        # Pass it to the actors: they return when it is set.
        self.stop_event = StopFlag(ctx)
        self.stopping = False
        self._tracebacks: dict[str, str] = {}
        # the failed disk write that ended a child (a full disk), by name; None for any other error
        self._failed_writes: dict[str, str | None] = {}
        self.lifeline = Lifeline(ctx)
        stop_when_run_ends(self.stop)

    def start(self, target: Callable, args: tuple, name: str):
        """Start `target(*args)` (a module-level function) in a child process called `name`; after a stop signal,
        raise `Interrupted` instead (a run stopping during its start-up starts nothing more)."""
        check_stop()
        running = self.ctx.RawValue("b", 0)
        child_args = (target, args, name, self.errors, self.lifeline.reader, running)
        proc = self.ctx.Process(target=_guarded, args=child_args, name=name, daemon=True)
        start_child(proc)
        self.procs.append(proc)
        self._running.append(running)
        return proc

    def check(self) -> None:
        """Raise `Interrupted` if a stop signal arrived, ActorDied if any child has exited (while the run is not
        stopping), RunFolderFailed (one line, no traceback) if it ended on a failed write to the disk."""
        if self.stopping:
            return
        check_stop()
        for proc in self.procs:
            if proc.exitcode is not None:
                if not fork_server_alive(self.ctx):
                    raise ActorDied(f"the fork server died (its children {proc.name} and others with it)")
                try:
                    while True:
                        name, text, failed_write = self.errors.get(timeout=0.2)
                        self._tracebacks[name] = text
                        self._failed_writes[name] = failed_write
                except queue.Empty:
                    pass
                if self._failed_writes.get(proc.name):
                    raise RunFolderFailed(f"{proc.name} could not write to the run folder: {self._failed_writes[proc.name]}")
                tb = self._tracebacks.get(proc.name, "")
                last = tb.strip().splitlines()[-1] if tb.strip() else "no traceback (killed or exited)"
                raise died_or_interrupted(f"{proc.name} died (exit code {proc.exitcode}): {last}", proc.exitcode, tb)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every child: set `stop_event`; terminate at once the children still importing (they cannot see the
        flag before their target runs, and hold nothing yet); give the others `timeout` s in all to return, then
        terminate, then kill. Safe to call twice."""
        self.stopping = True
        self.stop_event.set()
        for proc, running in zip(self.procs, self._running):
            if not running.value and proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
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

"""Worker processes for plugin code that may hang or crash: pebble's ProcessPool (spawn start method), calls with a
deadline, and their outcomes in our words.

A call that passes its deadline, or whose future is cancelled while it runs, has its worker killed (pebble stops it:
SIGTERM, then SIGKILL) and a fresh worker started; a worker that dies mid-call (a crash, os._exit, a signal) fails
that call with WorkerDied and is replaced. Used by the sync reward functions given by import path
(rollout/rewards/pool.py) and by tools given by import path (rollout/tools/process_tool.py).

pebble does not report a worker that exits with status 0 mid-call: that call ends at its deadline. A worker ends
with its driver, even in a call that hangs (within PARENT_POLL_S of the driver's death).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pebble import ProcessExpired, ProcessPool

PARENT_POLL_S = 0.5  # how often a worker looks whether its driver still lives


class CallTimeout(Exception):
    """A call passed its deadline (its worker process was killed, or its thread abandoned)."""


class WorkerDied(Exception):
    """The worker process running a call died (a crash, os._exit, the OOM killer); `exit_code` says how (a negative
    one is the signal's number)."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def call_contained(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, with a SystemExit or KeyboardInterrupt it raises turned into a RuntimeError: the
    function's own exit ends its call, never the process that awaits the call's future."""
    try:
        return fn(*args, **kwargs)
    except (SystemExit, KeyboardInterrupt) as e:
        raise RuntimeError(f"raised {type(e).__name__}({e})") from None


def spawn_pool(max_workers: int) -> ProcessPool:
    """A pool of `max_workers` spawned workers (pebble starts them all on the first call)."""
    return ProcessPool(max_workers=max_workers, context=multiprocessing.get_context("spawn"),
                       initializer=_exit_with_parent, initargs=(os.getpid(),))


def _exit_with_parent(parent: int) -> None:
    """In a worker: end it once `parent` has died. An idle worker ends anyway (its pipe closes); this one may be in
    a call that hangs. Not PR_SET_PDEATHSIG: that fires when the thread that started the worker ends."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run_in_pool(pool: ProcessPool, fn: Callable[..., Any], args: tuple, timeout_s: float | None) -> Future:
    """Schedule `fn(*args)` in one of `pool`'s workers (`fn` must be importable there); the future raises CallTimeout
    past `timeout_s` (counted from the call's start in a worker) or WorkerDied, and cancelling it while the call runs
    kills that call's worker."""
    inner = pool.schedule(fn, args=args, timeout=timeout_s)
    outer: Future = Future()
    inner.add_done_callback(lambda f: _translate(f, outer, timeout_s))
    outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)  # a cancelled call frees its worker
    return outer


def _translate(inner: Future, outer: Future, timeout_s: float | None) -> None:
    """pebble's outcome as ours: its own TimeoutError is the deadline; the function's errors pass through (pebble
    gives those the worker's traceback as __cause__, so a TimeoutError the function raised is told apart)."""
    if outer.done():
        return
    if inner.cancelled():
        outer.cancel()
        return
    exc = inner.exception()
    if exc is None:
        outer.set_result(inner.result())
    elif isinstance(exc, TimeoutError) and exc.__cause__ is None:
        outer.set_exception(CallTimeout(f"timed out after {timeout_s:g}s"))
    elif isinstance(exc, ProcessExpired):
        outer.set_exception(WorkerDied(f"its worker process died (exit code {exc.exitcode})", exc.exitcode))
    else:
        outer.set_exception(exc)

"""SIGTERM taken as Ctrl-C, and remembered: Python drops the exception a signal handler raises when the handler
happens to run inside a finalizer or a garbage-collector callback ("Exception ignored in ..."), so the step loops
also check whether one arrived (`raise_if_terminated`) and stop at the next step instead of running on.

Inside `run` (asyncio.run for the commands) SIGTERM cancels the main task, as asyncio.run does for Ctrl-C, instead of
raising in whichever task the signal lands on: that task's exception would never be retrieved, and asyncio would
print "Task exception was never retrieved" and its traceback after the command's last line."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

_terminated = threading.Event()
_main_task: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None
T = TypeVar("T")


class Terminated(KeyboardInterrupt):
    """SIGTERM's KeyboardInterrupt. A subclass because CPython (3.11, 3.12) marks a plain KeyboardInterrupt that leaves
    a string `exec`/`eval` as unhandled, and then a `python -m` process dies by SIGINT (exit -2) after `main` returned
    130, even though `main` caught it; the mark compares the exception's type exactly."""


def terminate(signum: int, frame: object) -> None:
    """The SIGTERM handler: remember it, then cancel `run`'s main task, or raise Terminated where the process is."""
    _terminated.set()
    if _main_task is not None:
        loop, task = _main_task
        if not task.done() and not task.cancelling():  # a second SIGTERM raises, as a second Ctrl-C does
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)  # wakes a loop that waits in select()
            return
    raise Terminated


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, where SIGTERM stops `main` the way Ctrl-C does: its cleanup runs, then Terminated is raised."""
    try:
        return asyncio.run(_as_main_task(main))
    except asyncio.CancelledError:
        if _terminated.is_set():
            raise Terminated from None
        raise


async def _as_main_task(main: Coroutine[Any, Any, T]) -> T:
    global _main_task
    previous = _main_task
    if threading.current_thread() is threading.main_thread():  # where signal handlers run
        _main_task = (asyncio.get_running_loop(), asyncio.current_task())
    try:
        return await main
    finally:
        _main_task = previous


def raise_if_terminated() -> None:
    """Raise Terminated if a SIGTERM arrived whose exception was lost; call it once per step."""
    if _terminated.is_set():
        raise Terminated


def reset() -> None:
    """Forget a SIGTERM once it has stopped what it was meant to stop."""
    _terminated.clear()


def run_writing(write: Callable[[], None], out: Path, errors: tuple[type[BaseException], ...]) -> int:
    """A script's exit code for `write()` of the directory `out`: 0; 2 with one line for `errors`; 130 with one line
    for Ctrl-C or SIGTERM (taken as Ctrl-C here), whose temporary directory durable.write_directory has removed."""
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        write()
    except errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {out} not written (an earlier one is left as it was)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        reset()
    return 0

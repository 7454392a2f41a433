"""SIGTERM taken as Ctrl-C, and remembered: Python drops the exception a signal handler raises when the handler
happens to run inside a finalizer or a garbage-collector callback ("Exception ignored in ..."), so the step loops
also check whether one arrived (`raise_if_terminated`) and stop at the next step instead of running on."""

from __future__ import annotations

import threading

_terminated = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM's KeyboardInterrupt. A subclass because CPython (3.11, 3.12) marks a plain KeyboardInterrupt that leaves
    a string `exec`/`eval` as unhandled, and then a `python -m` process dies by SIGINT (exit -2) after `main` returned
    130, even though `main` caught it; the mark compares the exception's type exactly."""


def terminate(signum: int, frame: object) -> None:
    """The SIGTERM handler: remember it, then raise Terminated where the process is."""
    _terminated.set()
    raise Terminated


def raise_if_terminated() -> None:
    """Raise Terminated if a SIGTERM arrived whose exception was lost; call it once per step."""
    if _terminated.is_set():
        raise Terminated


def reset() -> None:
    """Forget a SIGTERM once it has stopped what it was meant to stop."""
    _terminated.clear()

"""What runs inside a tool worker process (rollout/tools/process_tool.py drives it from the rollout's side).

A worker makes its tool once, by the tool's import path (registry.make_tool), on its first call, and keeps it for
every later call it serves: a tool's state (counters, caches, an HTTP session) lives per worker process, not per
run. The pool of one tool has several workers, each with its own copy; a worker that is replaced (below) starts
with a fresh one. A sync `call` runs in the worker's thread; an async one runs on the worker's own event loop,
kept for the worker's life (an async client made there stays usable), one call at a time.

Limits, set before each call, in the worker itself:
- memory: RLIMIT_AS at the address space the worker had mapped once the tool was made, plus `memory_mb` (soft =
  hard: the tool cannot raise it). A MemoryError out of the call ends the worker (EXIT_OUT_OF_MEMORY), so the call
  fails as out of memory and the worker is replaced; a tool that catches it itself carries on. glibc is asked for at
  most two malloc arenas, so that threads (asyncio.to_thread) do not map 64 MiB each.
- CPU: the soft RLIMIT_CPU, `cpu_s` past the worker's CPU time at the call's start: past it the kernel ends the
  worker with SIGXCPU. The hard limit stays unlimited (the budget is per call and a soft limit can be raised
  again), so this limit is for runaway code, not for code that lifts it on purpose.
- printing: sys.stdout and sys.stderr are counted during the call; past `max_print_bytes` the worker ends
  (EXIT_PRINTED_TOO_MUCH). What a tool prints is discarded, and file descriptors 1 and 2 point at /dev/null, so
  neither print nor C code writes to the run's terminal or log.
- output: what the call returns is cut to `max_output_chars` in the worker, before it is sent back.
- wall time: the driver's (the call's deadline; the worker is killed then).
- core files: none (RLIMIT_CORE 0), so a worker ended by SIGXCPU or a crash leaves nothing behind.
An exception the tool raises is its call's output, as when it runs inline; SystemExit and KeyboardInterrupt too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import io
import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout.tools.base import ToolResult, truncate
from rollout.tools.plugin import make_tool

EXIT_OUT_OF_MEMORY = 97
EXIT_PRINTED_TOO_MUCH = 98
PRINT_LIMIT_BYTES = 1 << 20  # what one call may print (to stdout and stderr together) before its worker is ended

_M_ARENA_MAX = -8  # glibc's mallopt parameter


@dataclass(frozen=True)
class WorkerLimits:
    """What one call in a tool worker may use (see the module docstring)."""

    memory_mb: int
    cpu_s: int
    max_output_chars: int
    max_print_bytes: int = PRINT_LIMIT_BYTES


_tools: dict[str, Any] = {}  # spec -> the tool this worker made
_loop: asyncio.AbstractEventLoop | None = None


def call_in_worker(spec: str, arguments: dict[str, Any], limits: WorkerLimits, driver_path: list[str]) -> ToolResult:
    """One call of the tool at `spec`, made in this worker on its first call; runs in a worker process."""
    tool = _tools.get(spec)
    if tool is None:
        tool = _tools[spec] = _make(spec, limits, driver_path)
    try:
        with _cpu_budget(limits.cpu_s), _printing_capped(limits.max_print_bytes):
            out = tool.call(**arguments)
            if inspect.isawaitable(out):
                out = _worker_loop().run_until_complete(_awaited(out))
            result = out if isinstance(out, ToolResult) else ToolResult(str(out))
    except MemoryError:
        os._exit(EXIT_OUT_OF_MEMORY)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - the call's output, as inline
        return ToolResult(f"error: {tool.name} failed: {type(e).__name__}: {e}", "error")
    return ToolResult(truncate(result.output, limits.max_output_chars), result.status)


def _make(spec: str, limits: WorkerLimits, driver_path: list[str]) -> Any:
    """This worker's tool; then its output silenced and its memory limited."""
    sys.path.extend(entry for entry in driver_path if entry not in sys.path)  # the driver's sys.path edits
    _silence_file_descriptors()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU and crashes would dump core in the run's directory
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)
    tool = make_tool(spec)
    _limit_memory(limits.memory_mb)
    return tool


def _silence_file_descriptors() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _limit_memory(memory_mb: int) -> None:
    mapped = _mapped_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + (memory_mb << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _mapped_bytes() -> int:
    """The worker's address space now (VmSize)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def _cpu_budget(cpu_s: int) -> Iterator[None]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + cpu_s
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


class _CappedWriter(io.TextIOBase):
    """Counts what is written and drops it; ends the worker past `limit` bytes."""

    def __init__(self, limit: int, counter: list[int]) -> None:
        self.limit, self.counter = limit, counter

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.counter[0] += len(text.encode("utf-8", errors="replace"))
        if self.counter[0] > self.limit:
            os._exit(EXIT_PRINTED_TOO_MUCH)
        return len(text)


@contextlib.contextmanager
def _printing_capped(limit: int) -> Iterator[None]:
    counter = [0]  # stdout and stderr together
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _CappedWriter(limit, counter), _CappedWriter(limit, counter)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _worker_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
    return _loop


async def _awaited(awaitable: Any) -> Any:
    return await awaitable

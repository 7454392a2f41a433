"""Tools given by import path, run in worker processes (an agent's `tool_isolation: process`, the default).

A ProcessTool is the tool made in the driver (for its name, description and parameters) with its calls sent to a
pool of worker processes (rollout/worker_pool.py, the machinery the sync reward functions use), where the tool is
made again, once per worker, by its import path (worker.py says how a call runs there and under which limits). One
pool per tool and limits, `workers` processes (default TOOL_WORKERS), started on the first call and shared by every
AgentRuntime that loads the same tool with the same limits; stopped at exit (close_tool_pools).

A worker runs one call at a time, so at most `workers` calls of a tool run at once; the others wait for a worker,
and the call's deadline (tool_timeout_s) counts from when the trajectory made the call, waiting included, as inline.
A call that passes its deadline while it runs has its worker killed. A call whose worker dies (a crash, os._exit,
a signal, past tool_cpu_s of CPU, a MemoryError past tool_memory_mb, printing more than worker.PRINT_LIMIT_BYTES)
ends as an error output with status `crashed` that says why, counted as a tool failure by the trajectory and logged
(a WARNING per tool, the first few and then one in LOG_EVERY); the pool starts a fresh worker, and the trajectory
goes on. Cost: each call crosses two pipes and pickles its arguments and output (benchmarks/tool_isolation.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import sys
import threading
from collections import Counter
from typing import Any

from pebble import ProcessPool

from rollout.plugin_loop import PluginTimeout
from rollout.tools.base import PluginTool, Tool, ToolResult
from rollout.tools.sandbox import SandboxLimits
from rollout.tools.worker import EXIT_OUT_OF_MEMORY, EXIT_PRINTED_TOO_MUCH, WorkerLimits, call_in_worker
from rollout.worker_pool import WorkerDied, run_in_pool, spawn_pool

logger = logging.getLogger(__name__)

TOOL_WORKERS = min(4, os.cpu_count() or 1)
LOG_FIRST = 5  # per tool: the first failures logged; after those, one in LOG_EVERY
LOG_EVERY = 100


class ProcessTool(PluginTool):
    """A tool by import path whose calls run in worker processes (module docstring); its attributes are the driver's
    copy's."""

    def __init__(self, tool: Tool, spec: str, limits: SandboxLimits, workers: int | None = None) -> None:
        super().__init__(tool)
        self.spec = spec
        self.workers = workers or TOOL_WORKERS
        # the worker cuts the output to the sandbox's byte budget (at least max_tool_output_chars); call_tool cuts on
        self.limits = WorkerLimits(memory_mb=limits.memory_mb, cpu_s=limits.cpu_s,
                                   max_output_chars=limits.max_output_bytes)

    async def call_within(self, timeout_s: float | None, **arguments: Any) -> str | ToolResult:
        """The call's output; PluginTimeout (a TimeoutError) past `timeout_s`, its worker killed if it was running."""
        pool = _pool(self.spec, self.limits, self.workers)
        future = run_in_pool(pool, call_in_worker, (self.spec, arguments, self.limits, list(sys.path)), None)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:  # wait_for cancelled the future: pebble kills the worker if the call ran
            _log(self.name, f"passed its {timeout_s:g}s deadline (its worker, if it had started, was replaced)")
            raise PluginTimeout(f"timed out after {timeout_s:g}s") from None
        except WorkerDied as e:
            why = worker_death(e.exit_code, self.limits)
            _log(self.name, why)
            return ToolResult(f"error: {self.name} {why}; its worker process was replaced", "crashed")


def worker_death(exit_code: int | None, limits: WorkerLimits) -> str:
    """Why a tool worker that ended with `exit_code` died, in words."""
    if exit_code == EXIT_OUT_OF_MEMORY:
        return f"ran out of memory (MemoryError past tool_memory_mb, {limits.memory_mb} MiB)"
    if exit_code == EXIT_PRINTED_TOO_MUCH:
        return f"printed more than {limits.max_print_bytes} bytes"
    if exit_code == -signal.SIGXCPU:
        return f"used more than tool_cpu_s ({limits.cpu_s} s of CPU)"
    if exit_code is not None and exit_code < 0:
        try:
            return f"crashed ({signal.Signals(-exit_code).name})"
        except ValueError:
            return f"crashed (signal {-exit_code})"
    return f"ended its worker process (exit status {exit_code})"


_failures: Counter[str] = Counter()


def _log(name: str, what: str) -> None:
    _failures[name] += 1
    count = _failures[name]
    if count <= LOG_FIRST or count % LOG_EVERY == 0:
        logger.warning("tool %s %s [%d worker failure(s) of this tool so far]", name, what, count)


_pools: dict[tuple[str, WorkerLimits, int], ProcessPool] = {}
_pools_lock = threading.Lock()


def _pool(spec: str, limits: WorkerLimits, workers: int) -> ProcessPool:
    with _pools_lock:
        key = (spec, limits, workers)
        pool = _pools.get(key)
        if pool is None or not pool.active:
            if not _pools:
                atexit.register(close_tool_pools)
            pool = _pools[key] = spawn_pool(workers)
        return pool


def close_tool_pools() -> None:
    """Stop every tool worker (calls running there fail); the next call starts its tool's pool again."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
        atexit.unregister(close_tool_pools)
    for pool in pools:
        pool.stop()
        pool.join(timeout=10)

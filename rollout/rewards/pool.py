"""Where sync reward calls run: worker processes killed and replaced at a call's deadline, or threads.

Processes (rollout/worker_pool.py: pebble's ProcessPool, spawn start method) run the functions given as
"package.module:function": a worker imports the function by that path, and a call that passes its deadline has its
worker killed and a fresh one started, so a hung function costs one sample and never a worker. Threads run the
callables no worker could import; a thread cannot be killed, so once half the threads are stuck past their deadlines
a fresh thread pool takes over (the stuck threads end when their functions return).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pebble import ProcessPool

from rollout.worker_pool import CallTimeout, WorkerDied, call_contained, run_in_pool, spawn_pool

__all__ = ["CallTimeout", "WorkerDied", "RewardPools", "call_contained", "close_reward_pools", "reward_pools"]

logger = logging.getLogger(__name__)

MAX_WORKERS = min(32, os.cpu_count() or 1)


_resolved: dict[str, Callable[..., Any]] = {}  # in a worker: spec -> function


def _call_by_spec(spec: str, args: tuple, kwargs: dict[str, Any], driver_path: list[str]) -> Any:
    """Runs in a worker process: resolve the import path once, call the function."""
    fn = _resolved.get(spec)
    if fn is None:
        from rollout.rewards.registry import load_reward_fn  # noqa: PLC0415 - only workers need it

        # The driver may have made the module importable after this worker started (sys.path edits).
        sys.path.extend(entry for entry in driver_path if entry not in sys.path)
        fn = _resolved[spec] = load_reward_fn(spec).fn
    return call_contained(fn, *args, **kwargs)


class RewardPools:
    """A process pool and a thread pool, both started on first use."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self.max_threads = max_workers + 4  # threads mostly wait (math_verify's checks run in its own processes)
        self._lock = threading.Lock()
        self._processes: ProcessPool | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._stuck: set[Future] = set()  # thread calls past their deadline, still running in the current pool

    def run_in_process(self, spec: str, args: tuple, kwargs: dict[str, Any], timeout_s: float | None) -> Future:
        """Schedule `spec(*args, **kwargs)` in a worker; the future raises CallTimeout or WorkerDied on those."""
        with self._lock:
            if self._processes is None or not self._processes.active:  # inactive: in a child forked since it started
                self._processes = spawn_pool(self.max_workers)
            return run_in_pool(self._processes, _call_by_spec, (spec, args, kwargs, list(sys.path)), timeout_s)

    def run_in_thread(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Future:
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(max_workers=self.max_threads, thread_name_prefix="reward")
            return self._threads.submit(call_contained, fn, *args, **kwargs)

    def abandon(self, future: Future) -> None:
        """A thread call passed its deadline: count its thread as stuck; replace the pool once half are stuck."""
        with self._lock:
            if future.done() or self._threads is None:
                return
            self._stuck = {f for f in self._stuck if not f.done()} | {future}
            if 2 * len(self._stuck) < self.max_threads:
                return
            logger.warning("reward: %d threads are stuck in reward calls past their deadline; starting a fresh thread "
                           "pool (a thread cannot be killed: give the function as 'package.module:function' to run it "
                           "in a worker process that can)", len(self._stuck))
            self._threads.shutdown(wait=False)
            self._threads, self._stuck = None, set()

    def close(self) -> None:
        """Stop the worker processes (running calls are killed) and let idle threads go."""
        with self._lock:
            processes, threads = self._processes, self._threads
            self._processes = self._threads = None
            self._stuck = set()
        if processes is not None:
            processes.stop()
            processes.join(timeout=10)
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)


_pools: RewardPools | None = None
_pools_lock = threading.Lock()


def reward_pools() -> RewardPools:
    """The process-wide pools (closed at exit)."""
    global _pools
    with _pools_lock:
        if _pools is None:
            _pools = RewardPools()
            atexit.register(_pools.close)
        return _pools


def close_reward_pools() -> None:
    """Stop the process-wide pools; the next reward call starts new ones (with the sys.path of that moment)."""
    global _pools
    with _pools_lock:
        pools, _pools = _pools, None
    if pools is not None:
        atexit.unregister(pools.close)
        pools.close()

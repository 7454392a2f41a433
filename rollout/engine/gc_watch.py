"""Python's garbage collector in an engine's process: its pauses counted into the engine's stats, and a full
collection run while the engine is paused rather than in the middle of a rollout.

A collection stops every thread of the process, the engine's steps included, and a full one (generation 2) scans
every object that outlived two younger collections since the last full one: with an RL step's thousands of requests
alive at once, the one Python starts on its own can fall inside a rollout. A paused engine (a colocated trainer is
computing) runs nothing, so a full collection then costs no step.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

WARN_S = 0.05  # a collection that stops the engine longer than this is logged


class GcWatch:
    """Adds each collection's seconds to stats["gc_s"] (full ones also count in stats["gc_full"]), those run by
    collect_paused to stats["gc_paused_s"] instead, and logs any longer than WARN_S. One per engine; process-wide."""

    def __init__(self, stats: MutableMapping[str, float]) -> None:
        self.stats = stats
        for key in ("gc_s", "gc_full", "gc_paused_s"):
            stats.setdefault(key, 0)
        self._started = 0.0
        self._ours = False

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def collect_paused(self) -> None:
        """A full collection now, counted apart (gc_paused_s): call it while the engine has nothing to run."""
        self._ours = True
        try:
            gc.collect()
        finally:
            self._ours = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        stats = self.stats
        if self._ours:
            stats["gc_paused_s"] = stats.get("gc_paused_s", 0) + seconds
            return
        stats["gc_s"] = stats.get("gc_s", 0) + seconds
        if info.get("generation") == 2:
            stats["gc_full"] = stats.get("gc_full", 0) + 1
        if seconds > WARN_S:
            logger.warning("engine: a garbage collection of generation %s stopped the process for %.0f ms "
                           "(%s objects collected)", info.get("generation"), seconds * 1e3, info.get("collected"))

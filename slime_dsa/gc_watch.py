"""Python's garbage collector in a service's process (an engine, a trainer rank): its pauses counted, the objects
that live for the whole run frozen once started, and a full collection run when the process has nothing to do.

A collection stops every thread of the process, and a full one (generation 2) scans every tracked object that is
not frozen: after start-up that is the model's modules, the tokenizer and the libraries' own objects, hundreds of
thousands of them, which no step frees. `freeze_after_startup` moves them out of every later collection (as vLLM
does after capturing its graphs, and SGLang's /freeze_gc), so the full collections Python starts during a rollout
or a train call scan only what the steps made. An Engine freezes what exists when it is built (once per process); a
service process freezes again after its warm-up, taking what that made: compiled kernels, captured graphs, the
server. `collect_paused` runs a full one at a moment that costs no step: an engine paused for a colocated trainer.
The RL driver (`slime-dsa train`, or a script calling run_training) freezes for the length of a run
(`frozen_during`), since it may live on after the run returns.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

WARN_S = 0.05  # a collection that stops the process longer than this is logged
KEYS = ("gc_s", "gc_full", "gc_paused_s")


class GcWatch:
    """Adds each collection's seconds to stats["gc_s"] (full ones also count in stats["gc_full"]), those run by
    collect_paused to stats["gc_paused_s"] instead, and logs any longer than WARN_S. One per process."""

    def __init__(self, stats: MutableMapping[str, float], who: str = "engine") -> None:
        self.stats = stats
        self.who = who
        for key in KEYS:
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
        """A full collection now, counted apart (gc_paused_s): call it while the process has nothing to run."""
        self._ours = True
        try:
            gc.collect()
        finally:
            self._ours = False

    def take(self) -> dict[str, float]:
        """The counts since the last take, and zero them (for a caller that reports per step)."""
        out = {key: float(self.stats.get(key, 0)) for key in KEYS}
        for key in KEYS:
            self.stats[key] = 0
        return out

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
            logger.warning("%s: a garbage collection of generation %s stopped the process for %.0f ms "
                           "(%s objects collected)", self.who, info.get("generation"), seconds * 1e3,
                           info.get("collected"))


def freeze_after_startup(who: str) -> int:
    """Collect once, then freeze every object alive (gc.freeze): later collections skip them. Returns how many
    objects are frozen. Call it once the process has loaded and warmed up, before its first step."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects alive after start-up frozen out of garbage collection (%.0f ms)", who, frozen,
                (time.perf_counter() - start) * 1e3)
    return frozen


@contextmanager
def frozen_during(who: str) -> Iterator[GcWatch]:
    """Freeze what is alive now and count every collection until the block ends; then unfreeze everything, so
    what dies after the run (in the caller's process, which may go on) is collected, never held frozen. An
    in-process Engine's own freeze goes with it: a cost in speed, not memory. Yields the watch (take() per step)."""
    freeze_after_startup(who)
    watch = GcWatch({}, who=who)
    watch.install()
    try:
        yield watch
    finally:
        watch.uninstall()
        gc.unfreeze()

"""Python's garbage collections in a service's process (slime_dsa/gc_watch.py): counted apart from the full collection
an engine runs once it is paused, a long one logged, the start-up objects frozen out of later collections."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
from pathlib import Path

from rollout.engine.async_engine import AsyncEngine
from rollout.engine.engine import Engine
from rollout.engine.types import GenerateRequest, SamplingParams
from slime_dsa import gc_watch
from slime_dsa.gc_watch import GcWatch

ROOT = Path(__file__).resolve().parents[1]


def test_collections_python_starts_and_ours_are_counted_apart(monkeypatch, caplog):
    stats: dict[str, float] = {}
    watch = GcWatch(stats)
    watch.install()
    try:
        watch.install()  # once per watch, however often installed
        assert gc.callbacks.count(watch._callback) == 1
        gc.collect()  # as Python's own would: counted in gc_s, and as a full one
        assert stats["gc_s"] > 0 and stats["gc_full"] == 1 and stats["gc_paused_s"] == 0
        before = stats["gc_s"]
        watch.collect_paused()
        assert stats["gc_paused_s"] > 0 and stats["gc_s"] == before and stats["gc_full"] == 1
        monkeypatch.setattr(gc_watch, "WARN_S", 0.0)
        with caplog.at_level(logging.WARNING, logger="slime_dsa.gc_watch"):
            gc.collect(1)
        assert "engine: a garbage collection of generation 1 stopped the process" in caplog.text
        taken = watch.take()  # a trainer rank reports per call: the counts since the last take
        assert taken["gc_s"] > 0 and taken["gc_full"] == 1 and taken["gc_paused_s"] > 0
        assert watch.take() == {"gc_s": 0.0, "gc_full": 0.0, "gc_paused_s": 0.0}
    finally:
        watch.uninstall()
    assert watch._callback not in gc.callbacks


def test_freezing_after_start_up_takes_the_live_objects_out_of_later_full_collections():
    # In a process of its own: a frozen pytest process would keep every later test's cycles alive.
    code = """
import gc, time
from slime_dsa.gc_watch import freeze_after_startup
import torch  # a service's start-up: libraries and their objects
cycles = [[i] for i in range(200_000)]
for c in cycles:
    c.append(c)  # tracked container objects that live for the run
def full_ms():
    start = time.perf_counter(); gc.collect(); return (time.perf_counter() - start) * 1e3
before = min(full_ms() for _ in range(3))
frozen = freeze_after_startup("test")
assert frozen == gc.get_freeze_count() >= 200_000, frozen
assert not [o for o in gc.get_objects(2) if o is cycles], "the start-up objects are still in generation 2"
garbage = [[i] for i in range(1000)]
for g in garbage:
    g.append(g)
del garbage, g
assert gc.collect() >= 1000  # what the steps make is still collected
after = min(full_ms() for _ in range(3))
print(before, after)
assert after < before / 5, (before, after)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_paused_engine_collects_once_the_caller_has_its_answer(tmp_path):
    import slime_dsa
    from tests.hf_reference import make_hf_checkpoint

    make_hf_checkpoint(tmp_path, seed=0)
    model = slime_dsa.load_model(tmp_path).eval()

    async def main():
        engine = AsyncEngine(Engine(model, max_cache_tokens=256, block_size=4))
        off = AsyncEngine(Engine(model, max_cache_tokens=256, block_size=4), collect_when_paused=False)
        for e in (engine, off):
            await e.start()
            await e.finals([GenerateRequest(input_ids=[5, 6, 7], rid="a",
                                            sampling=SamplingParams(max_new_tokens=2, temperature=0))])
            await e.pause("retract")
            await e.resume()  # a command behind the collection: it has run by now
        assert engine.engine.stats["gc_paused_s"] > 0
        assert off.engine.stats["gc_paused_s"] == 0
        for e in (engine, off):
            await e.stop()
        assert engine.gc_watch._callback not in gc.callbacks

    asyncio.run(main())


def test_the_driver_is_frozen_for_a_run_and_its_collections_counted():
    # In a process of its own: a pytest process's other objects stay out of it.
    code = """
import gc
from slime_dsa.gc_watch import frozen_during
cycles = [[i] for i in range(10_000)]
for c in cycles:
    c.append(c)
gc.freeze()  # an in-process Engine's freeze before the run: unfrozen with the run's, so nothing is held after it
with frozen_during("driver") as watch:
    assert gc.get_freeze_count() >= 10_000
    assert watch._callback in gc.callbacks
    gc.collect()
    assert watch.take()["gc_full"] == 1 and watch.take()["gc_full"] == 0
assert gc.get_freeze_count() == 0, "a run left the caller's objects frozen"
assert watch._callback not in gc.callbacks
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

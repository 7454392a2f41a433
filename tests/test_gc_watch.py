"""The engine process's garbage collections: counted into the engine's stats apart from the full collection an
engine runs once it is paused (rollout/engine/gc_watch.py), and a long one logged."""

from __future__ import annotations

import asyncio
import gc
import logging

from rollout.engine import gc_watch
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.engine import Engine
from rollout.engine.gc_watch import GcWatch
from rollout.engine.types import GenerateRequest, SamplingParams


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
        with caplog.at_level(logging.WARNING, logger="rollout.engine.gc_watch"):
            gc.collect(1)
        assert "garbage collection of generation 1 stopped the process" in caplog.text
    finally:
        watch.uninstall()
    assert watch._callback not in gc.callbacks


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

"""benchmarks/engine_gc.py's side on CPU, small: the paused collection runs at each hand-over and is counted apart
from the collections Python starts inside rollouts (the 64 x 16 figures: RESULTS.md)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_side_reports_collections_inside_rollouts_and_while_paused(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import engine_gc

    args = argparse.Namespace(steps=3, prompts=2, group_size=2, train_ms=1.0)
    on = asyncio.run(engine_gc.one_side(True, args))
    off = asyncio.run(engine_gc.one_side(False, args))
    assert on["steps"] == off["steps"] == 3 and on["rollout_ms_median"] > 0
    assert on["paused_gc_ms_median"] > 0 and off["paused_gc_ms_max"] == 0
    assert on["in_rollouts_full"] >= 0 and on["in_rollouts_gc_ms"] >= 0

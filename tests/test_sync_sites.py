"""benchmarks/sync_sites.py: sync warnings recorded by project site and engine step kind (the warning is raised by
hand here: CPU torch has no sync debug mode)."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sync_sites  # noqa: E402


def _sync_in_a_thread() -> None:
    warnings.warn(f"an op {sync_sites.SYNC_MESSAGE}", UserWarning)


def test_sync_warnings_are_counted_per_call_and_kind_and_others_pass_through():
    recorder = sync_sites.SyncSites()
    shown = []
    start = time.time_ns()
    previous = warnings.showwarning
    warnings.showwarning = lambda message, *rest: shown.append(str(message))
    try:
        with recorder:
            for _ in range(3):  # the same line thrice: three records, not one
                _sync_in_a_thread()
            worker = threading.Thread(target=_sync_in_a_thread, name="engine")
            worker.start()
            worker.join()
            warnings.warn("an unrelated warning", UserWarning)
    finally:
        warnings.showwarning = previous
    end = time.time_ns()
    assert len(recorder.records) == 4
    assert {name for _, name, _ in recorder.records} == {"MainThread", "engine"}
    assert shown == ["an unrelated warning"]
    summary = recorder.summary([(start, end, True)])
    assert summary["syncs"] == 4 and summary["by_step_kind"] == {"decode": 4}
    assert summary["steps"] == {"decode": 1, "other": 0}
    assert summary["sites"][0]["decode"] == 4 and "_sync_in_a_thread" in summary["sites"][0]["site"]


def test_step_kind_of_a_time():
    windows = [(10, 20, True), (30, 40, False)]
    assert [sync_sites.step_kind(t, windows) for t in (15, 35, 25)] == ["decode", "other", "between"]

"""benchmarks/trace_steps.py: GPU-busy time per engine step window from a Chrome trace (synthetic trace here)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_NS = 1_000_000_000_000


def _trace(path: Path) -> Path:
    """Two step windows (0-10 ms other, 10-14 ms decode) and kernels inside, overlapping and crossing them."""
    def kernel(ts_us, dur_us, corr, name):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts_us, "dur": dur_us, "args": {"correlation": corr}}

    def launch(ts_us, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts_us, "dur": 5,
                "args": {"correlation": corr}}

    events = [launch(100, 1), kernel(1000, 2000, 1, "gemm"), launch(200, 2), kernel(2500, 1000, 2, "norm"),
              launch(10500, 3), kernel(9000, 3000, 3, "graph")]  # 1-3 ms and 2.5-3.5 ms overlap: union 2.5 ms
    with gzip.open(path, "wt") as f:
        json.dump({"baseTimeNanoseconds": BASE_NS, "traceEvents": events}, f)
    return path


def test_busy_share_per_step_kind_and_top_kernels(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import trace_steps

    ms = 1_000_000
    windows = [(BASE_NS, BASE_NS + 10 * ms, False), (BASE_NS + 10 * ms, BASE_NS + 14 * ms, True)]
    out = trace_steps.summarize(_trace(tmp_path / "t.json.gz"), windows)
    assert out["steps_traced"] == 2
    assert out["other"]["gpu_busy_ms"] == pytest.approx(2.5 + 1.0)  # 1-3.5 ms, and 9-10 ms of the crossing kernel
    assert out["decode"]["gpu_busy_ms"] == pytest.approx(2.0)  # 10-12 ms
    assert out["all"]["gpu_busy_share"] == pytest.approx(5.5 / 14)
    assert out["other"]["top_kernels_ms"] == {"gemm": 2.0, "norm": 1.0}  # by launch: the crossing one is decode's
    assert out["decode"]["top_kernels_ms"] == {"graph": 3.0}

"""GPU-busy share per engine step from a torch.profiler Chrome trace: where a step's wall time leaves the GPU idle.

A step is a wall-clock window (start ns, end ns, decode-only) that the caller records around each engine step, in any
thread (torch.profiler's CPU ranges cover only the thread that started it; its trace times are wall-clock µs after
the trace's baseTimeNanoseconds). Its GPU-busy time is the union of all kernel
intervals inside its wall window (with the overlap scheduler a step's kernels run partly in the next window, so the
window is what the device saw, not what the step launched). Kernels are attributed to the step that launched them
(runtime launch and kernel share a correlation id) for the per-kind top-kernel table.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

def _union_ms(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length in ms of the union of (start, end) µs intervals clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def summarize(trace_path: str | Path, windows: list[tuple[int, int, bool]], top: int = 12) -> dict:
    """Per step kind (decode / other): steps, wall ms, GPU-busy ms and share, and the top kernels by device ms."""
    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    events, base = trace["traceEvents"], trace.get("baseTimeNanoseconds", 0)
    steps = [((a - base) / 1e3, (b - base) / 1e3) for a, b, _ in windows]
    flags = [decode for _, _, decode in windows]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    intervals = [(k["ts"], k["ts"] + k["dur"]) for k in kernels]
    out: dict = {"steps_traced": len(steps)}
    if steps:
        out["all"] = {"wall_ms": (steps[-1][1] - steps[0][0]) / 1e3,
                      "gpu_busy_ms": _union_ms(intervals, steps[0][0], steps[-1][1])}
        out["all"]["gpu_busy_share"] = out["all"]["gpu_busy_ms"] / max(out["all"]["wall_ms"], 1e-9)
    by_kind: dict[str, dict] = defaultdict(lambda: {"steps": 0, "wall_ms": 0.0, "gpu_busy_ms": 0.0})
    step_walls = []
    for (lo, hi), decode in zip(steps, flags):
        kind = by_kind["decode" if decode else "other"]
        kind["steps"] += 1
        kind["wall_ms"] += (hi - lo) / 1e3
        busy = _union_ms(intervals, lo, hi)
        kind["gpu_busy_ms"] += busy
        step_walls.append({"decode": decode, "wall_ms": round((hi - lo) / 1e3, 3), "gpu_busy_ms": round(busy, 3)})
    kernel_ms: dict[str, dict[str, float]] = {"decode": defaultdict(float), "other": defaultdict(float)}
    starts = [lo for lo, _ in steps]
    for k in kernels:
        t = launches.get(k.get("args", {}).get("correlation"))
        if t is None:
            continue
        i = max((j for j, s in enumerate(starts) if s <= t), default=None)
        if i is None or t > steps[i][1]:
            continue
        kernel_ms["decode" if flags[i] else "other"][k["name"][:90]] += k["dur"] / 1e3
    for name, kind in by_kind.items():
        kind["gpu_busy_share"] = kind["gpu_busy_ms"] / max(kind["wall_ms"], 1e-9)
        kind["top_kernels_ms"] = dict(sorted(kernel_ms[name].items(), key=lambda kv: -kv[1])[:top])
    out.update(by_kind)
    out["per_step"] = step_walls
    return out

"""One profiled RL step as a device timeline: the kernels of every process that used a GPU (engines, trainer ranks),
merged per GPU, against the orchestrator's phases; where the GPU sat idle, and what each process was doing then.

    python -m slime_dsa.logging.timeline RUN_DIR/profile/step_5

reads the traces that `logging.profile_steps` wrote (slime_dsa/logging/torch_profile.py) and `phases.json`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_dsa.trace_recorder import META_SUFFIX, TRACE_SUFFIX

PHASES_FILE = "phases.json"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
Interval = tuple[int, int]  # [start, end) in wall-clock nanoseconds


@dataclass
class CpuEvent:
    start: int
    end: int
    name: str
    annotation: bool  # a record_function range (ours or torch's), not a single op


@dataclass
class ProcessTrace:
    """One process's trace: its GPU activity and its CPU events, on the wall clock."""

    name: str
    device: str  # the physical GPU it used ("" without GPU activity)
    gpu: list[Interval] = field(default_factory=list)
    cpu: list[CpuEvent] = field(default_factory=list)


def _read_json(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def load_trace(path: Path) -> ProcessTrace:
    """A Kineto chrome trace (and its .meta.json, when there is one) as a ProcessTrace."""
    name = path.name.removesuffix(TRACE_SUFFIX).removesuffix(".json.gz").removesuffix(".json")
    data = _read_json(path)
    meta_path = path.with_name(name + META_SUFFIX)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    base = int(data.get("baseTimeNanoseconds", 0))
    trace = ProcessTrace(name=name, device="")
    device_ids: set[Any] = set()
    for event in data.get("traceEvents", []):
        if event.get("ph") != "X" or "ts" not in event:
            continue
        start = base + round(float(event["ts"]) * 1000)
        end = start + round(float(event.get("dur", 0)) * 1000)
        category = event.get("cat", "")
        if category in GPU_CATEGORIES:
            trace.gpu.append((start, end))
            device_ids.add(event.get("args", {}).get("device"))
        elif category in ("user_annotation", "cpu_op", "python_function"):
            trace.cpu.append(CpuEvent(start, end, str(event.get("name", "")), category == "user_annotation"))
    if trace.gpu:
        host = meta.get("host") or data.get("host_name", "")
        trace.device = meta.get("gpu_uuid") or f"{host}:cuda{sorted(map(str, device_ids))[0]}"
    trace.gpu.sort()
    trace.cpu.sort(key=lambda e: (e.start, -e.end))
    return trace


def union(intervals: list[Interval]) -> list[Interval]:
    """The sorted, non-overlapping union of intervals."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered(merged: list[Interval], start: int, end: int) -> int:
    """Nanoseconds of [start, end) that the merged intervals cover."""
    total = 0
    i = max(bisect_right(merged, (start, start)) - 1, 0)
    while i < len(merged) and merged[i][0] < end:
        s, e = merged[i]
        total += max(0, min(e, end) - max(s, start))
        i += 1
    return total


def idle_gaps(merged: list[Interval], start: int, end: int) -> list[Interval]:
    """The spans of [start, end) that no interval covers, longest first."""
    gaps, cursor = [], start
    for s, e in merged:
        if e <= cursor:
            continue
        if s >= end:
            break
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))
    return sorted(gaps, key=lambda g: g[0] - g[1])


def doing_at(trace: ProcessTrace, when: int) -> str:
    """What the process's CPU was inside at `when`: its record_function ranges outermost first, else the op, else
    'no op recorded' (waiting, or Python between ops)."""
    ranges = [e for e in trace.cpu if e.start <= when < e.end]
    annotations = [e.name for e in ranges if e.annotation and not e.name.startswith("ProfilerStep")]
    if annotations:
        return " > ".join(annotations[:3])
    ops = [e.name for e in ranges if not e.annotation]
    return ops[0] if ops else "no op recorded"


@dataclass
class Phase:
    name: str
    start: int
    end: int


def load_phases(directory: Path) -> tuple[int | None, list[Phase]]:
    """(the step, its phases in order) from phases.json; (None, []) without one."""
    path = directory / PHASES_FILE
    if not path.exists():
        return None, []
    data = json.loads(path.read_text())
    return data.get("step"), [Phase(p["name"], int(p["start_ns"]), int(p["end_ns"])) for p in data["phases"]]


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def trace_paths(directory: Path) -> list[Path]:
    """The traces in a profiled step's directory: ours (*.trace.json.gz) and any Kineto trace an engine wrote
    there (SGLang names its own *.trace.json.gz too); not their meta files, not a partial write."""
    return [p for p in sorted(directory.glob("*.json.gz")) + sorted(directory.glob("*.trace.json"))
            if not p.name.startswith(".")]


def by_gpu(traces: list[ProcessTrace]) -> dict[str, list[ProcessTrace]]:
    """The traces with GPU activity, by the physical GPU they used."""
    return {d: [t for t in traces if t.device == d] for d in sorted({t.device for t in traces if t.gpu})}


def report(directory: Path, top_gaps: int = 10) -> str:
    """The step's device timeline as markdown: per GPU and phase, the wall time, the GPU-busy time (union of every
    process's kernels) and each process's share; then the longest idle spans and what each process was doing."""
    traces = [load_trace(p) for p in trace_paths(directory)]
    if not traces:
        raise FileNotFoundError(f"no traces (*{TRACE_SUFFIX}) in {directory}")
    step, phases = load_phases(directory)
    gpu_traces = [t for t in traces if t.gpu]
    if not phases:  # the window the traces span
        start = min(min(i[0] for i in t.gpu) if t.gpu else t.cpu[0].start for t in traces if t.gpu or t.cpu)
        end = max(max(i[1] for i in t.gpu) if t.gpu else t.cpu[-1].end for t in traces if t.gpu or t.cpu)
        phases = [Phase("traced", start, end)]
    window = Phase("step", phases[0].start, phases[-1].end)
    lines = [f"# Device timeline{f' of step {step}' if step is not None else ''}: {directory}", ""]
    if not gpu_traces:
        lines.append("No GPU activity in these traces (a CPU run): only the phases' wall times.")
    for device, members in by_gpu(traces).items():
        merged = union([i for t in members for i in t.gpu])
        own = {t.name: union(t.gpu) for t in members}
        lines += [f"## GPU {device}: {', '.join(own)}", "",
                  "| phase | wall ms | GPU busy ms | busy | " + " | ".join(f"{n} ms" for n in own) + " |",
                  "|---|---:|---:|---:|" + "---:|" * len(own)]
        for phase in [*phases, window]:
            wall = phase.end - phase.start
            busy = covered(merged, phase.start, phase.end)
            cells = " | ".join(_ms(covered(m, phase.start, phase.end)) for m in own.values())
            label = f"**{phase.name}**" if phase is window else phase.name
            lines.append(f"| {label} | {_ms(wall)} | {_ms(busy)} | {_share(busy, wall)} | {cells} |")
        gaps = idle_gaps(merged, window.start, window.end)
        lines += ["", f"Longest idle spans of this GPU (of {len(gaps)}):", "",
                  "| at ms | idle ms | phase | " + " | ".join(t.name for t in traces) + " |",
                  "|---:|---:|---|" + "---|" * len(traces)]
        for start, end in gaps[:top_gaps]:
            middle = (start + end) // 2
            phase = next((p.name for p in phases if p.start <= middle < p.end), "-")
            doing = " | ".join(doing_at(t, middle) for t in traces)
            lines.append(f"| {_ms(start - window.start)} | {_ms(end - start)} | {phase} | {doing} |")
        lines.append("")
    if not gpu_traces:
        lines += ["| phase | wall ms |", "|---|---:|"]
        lines += [f"| {p.name} | {_ms(p.end - p.start)} |" for p in [*phases, window]]
    return "\n".join(lines)


def busy_share(directory: Path) -> dict[str, float]:
    """Each phase's GPU-busy share (0-1), the mean over GPUs of the union of their processes' kernels, and 'step' for
    the whole window; empty without GPU activity or phases."""
    traces = [load_trace(p) for p in trace_paths(directory)]
    _, phases = load_phases(directory)
    per_device = [union([i for t in members for i in t.gpu]) for members in by_gpu(traces).values()]
    if not per_device or not phases:
        return {}
    window = Phase("step", phases[0].start, phases[-1].end)
    return {p.name: sum(covered(m, p.start, p.end) for m in per_device) / len(per_device) / max(p.end - p.start, 1)
            for p in [*phases, window]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="a profiled step's directory (RUN_DIR/profile/step_N)")
    parser.add_argument("--top-gaps", type=int, default=10, help="how many of the longest idle spans to list")
    args = parser.parse_args(argv)
    try:
        print(report(args.directory, args.top_gaps))
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

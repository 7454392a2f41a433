"""Where an engine's step loop spends its time, from two readings of its cumulative counters (`Engine.stats`, also
`stats_*` in /get_server_info). Light: no torch, so the orchestrator reads it as plain numbers.

Device time (`device_s`): on CUDA, each step's span on the device, from its inputs being queued to its results'
copy to the host (CUDA events, read when the step's results are); on CPU the forward and the sampling, which run on
the engine's own thread. Host gap: the time in steps the device is not working, 1 - device time / step time. With the engine's
overlap scheduler the device computes step N+1 while the host reads step N, so the gap falls towards 0 as long as
the host keeps up; without it, every host action of a step (scheduling, block tables, launching, stop checks,
outputs) leaves the device idle. Step time counts only time in `Engine.step()`: time the caller spends between
steps is not in it (an orchestrator reports it separately), and with overlap the device may work through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

COUNTERS = ("steps", "generated_tokens", "step_s", "device_s", "decode_steps", "decode_step_s", "decode_device_s",
            "running_sum")
# Counted outside the steps, 0 when an engine does not report them (an older build): CUDA graphs captured and the
# seconds they took, and the seconds spent handing memory to a colocated trainer and taking it back.
# commands / command_s: calls run on the engine thread between steps (adding requests, aborts, weights, memory);
# weights_update_s: of them, applying weight updates (checks, copies, derived caches); gather_s: time an idle
# engine waited for the rest of a burst of calls before its first step (AsyncEngine's gather_ms); gc_s, gc_full:
# seconds the process spent in garbage collections Python started (any thread: they stop the steps too) and the full
# ones among them; gc_paused_s: in the full collections the engine ran while paused (slime_dsa/gc_watch.py);
# sample_graph_captures / sample_graph_capture_s: the decode steps' sampling graphs (sample_graph.py), captured when a
# batch bucket or sampling variant is first met.
OPTIONAL_COUNTERS = ("graph_captures", "graph_capture_s", "memory_release_s", "memory_resume_s", "commands",
                     "command_s", "weights_update_s", "gather_s", "gc_s", "gc_full", "gc_paused_s",
                     "sample_graph_captures", "sample_graph_capture_s")


def counters(stats: Mapping[str, float], prefix: str = "") -> dict[str, float] | None:
    """The step-loop counters of one reading (`prefix` "stats_" for /get_server_info), or None when the engine has
    none (an SGLang server)."""
    if any(prefix + k not in stats for k in COUNTERS):
        return None
    return {k: float(stats.get(prefix + k, 0.0)) for k in (*COUNTERS, *OPTIONAL_COUNTERS)}


def delta(before: Mapping[str, float] | None, after: Mapping[str, float]) -> dict[str, float]:
    """after - before, counter by counter; no earlier reading (a new engine) counts from its start."""
    return {k: after.get(k, 0.0) - (before or {}).get(k, 0.0) for k in (*COUNTERS, *OPTIONAL_COUNTERS)}


def step_metrics(deltas: Sequence[Mapping[str, float]], max_running: Sequence[int]) -> dict[str, float]:
    """Metrics of one interval over engines (one delta and max_running_requests each); {} when none stepped.

    steps, decode_steps: forward steps (all, and those where every request decoded one token; a launch of several
    decode steps, Engine.num_continuous_decode_steps, counts each);
    tok_s: generated tokens per second in steps, summed over engines (they run side by side);
    step_ms, decode_step_ms: mean wall time of a step; batch: tokens sampled per step; occupancy: running requests
    per step over max_running_requests; host_gap_s / host_gap_share: time in steps the device is not working
    (decode_host_gap_share: of decode-only steps); device_s: the device's time; busy_s: seconds in steps;
    OPTIONAL_COUNTERS summed over engines (a graph capture runs inside a step: in busy_s and host_gap_s too).
    """
    active = [(d, m) for d, m in zip(deltas, max_running) if d["steps"] > 0 and d["step_s"] > 0]
    if not active:
        return {}
    total = {k: sum(d[k] for d, _ in active) for k in COUNTERS}
    steps, step_s = total["steps"], total["step_s"]
    out = {
        "steps": steps,
        "decode_steps": total["decode_steps"],
        "tok_s": sum(d["generated_tokens"] / d["step_s"] for d, _ in active),
        "step_ms": step_s / steps * 1e3,
        "batch": total["generated_tokens"] / steps,
        "occupancy": sum(d["running_sum"] / max(m, 1) for d, m in active) / steps,
        "host_gap_s": step_s - total["device_s"],
        "host_gap_share": max(0.0, 1.0 - total["device_s"] / step_s),
        "device_s": total["device_s"],
        "busy_s": step_s,
    }
    out.update({k: sum(d.get(k, 0.0) for d, _ in active) for k in OPTIONAL_COUNTERS})
    if total["decode_steps"] > 0 and total["decode_step_s"] > 0:
        out["decode_step_ms"] = total["decode_step_s"] / total["decode_steps"] * 1e3
        out["decode_host_gap_share"] = max(0.0, 1.0 - total["decode_device_s"] / total["decode_step_s"])
    return out

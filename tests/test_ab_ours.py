"""benchmarks/ab_ours.py: a before/after table over the steps whose rollout was short (no answer at the token cap),
without the profiled step, the one after it and the last."""

from __future__ import annotations

import json

import pytest

from benchmarks import ab_ours


def _write(prefix, steps, busy):
    with open(f"{prefix}_metrics.jsonl", "w") as f:
        for step, (seconds, decode_steps) in enumerate(steps, start=1):
            f.write(json.dumps({"step": step, "perf/step_time_s": seconds, "perf/engine_decode_steps": decode_steps,
                                "perf/sync_time_s": 0.02, "perf/trainer_dispatch_s": 0.005}) + "\n")
    with open(f"{prefix}_result.json", "w") as f:
        json.dump({"gpu_busy_steps": busy}, f)


def test_medians_cover_the_short_steps_alone(tmp_path):
    # step 1 warm-up; 3 capped (255 decode steps); 5 profiled, 6 after it; 7 the last
    steps = [(2.0, 26), (0.40, 26), (0.90, 255), (0.44, 27), (0.10, 26), (5.0, 26), (3.0, 26)]
    _write(tmp_path / "ab_new1", steps, [10, 40, 70, 50, 5, 20, 30])
    row = ab_ours.run_row(tmp_path / "ab_new1", short_decode_steps=60, profiled=[5])
    assert (row["short_steps"], row["long_steps"]) == (2, 1)  # steps 2 and 4
    assert row["step s"] == pytest.approx(0.42) and row["NVML busy %"] == 45.0
    assert row["sync ms"] == pytest.approx(20.0) and row["dispatch ms"] == pytest.approx(5.0) and row["rollout s"] is None
    text = ab_ours.main([str(tmp_path / "ab_new1"), "--profiled", "5"])
    assert text.splitlines()[2].startswith("| ab_new1 | 2 | 1 | 0.420 |")

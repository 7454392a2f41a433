"""benchmarks/engine_throughput.py on CPU with the tiny preset: the simple path and the rollout path (as rollout/
drives the engine) both run and report decode step time, host gap and tokens/s (the H200 numbers: RESULTS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_both_paths_report_decode_step_and_host_gap(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import engine_throughput

    out = tmp_path / "engine.md"
    text = engine_throughput.main(["--device", "cpu", "--preset", "tiny", "--batch-sizes", "16", "--group-size", "8",
                                   "--new-tokens", "8", "--threads", "1", "--overlap", "--out", str(out)])
    assert out.read_text().strip() == text.strip()
    simple = next(line for line in text.splitlines() if line.startswith("| 16 |"))
    rollout = next(line for line in text.splitlines() if line.startswith("| 16 | 2 x 8 |"))
    cells = [c.strip() for c in rollout.strip("|").split("|")]
    assert float(cells[2]) > 0 and cells[3].endswith("x")  # tok/s and the ratio to transformers
    assert float(cells[4]) > 0 and cells[5].endswith("%") and cells[6].endswith("%")  # decode step ms, host gaps
    assert int(cells[7]) >= 8 and int(cells[8]) >= 1  # steps, decode steps
    assert simple.split("|")[10].strip() == "100%"  # greedy float32: the engine's outputs are transformers'
    assert 0 < float(simple.split("|")[11].strip().rstrip("%")) and 0 < float(cells[11].rstrip("%"))  # device busy
    assert "overlap scheduler on" in text
    sys.modules.pop("engine_throughput", None)


def test_release_kv_times_the_rollout_again_after_the_kv_cache_is_handed_over(tmp_path, monkeypatch):
    """--release-kv: the same rollout timed again after releasing and re-allocating the KV cache (a colocated RL
    step's hand-over), with the graphs each run captured (none on CPU: only the line's presence and numbers here)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import engine_throughput

    text = engine_throughput.main(["--device", "cpu", "--preset", "tiny", "--batch-sizes", "16", "--group-size", "8",
                                   "--new-tokens", "8", "--threads", "1", "--paths", "rollout", "--hf-batch-sizes",
                                   "none", "--release-kv"])
    line = next(line for line in text.splitlines() if line.startswith("- batch 16, KV cache released"))
    assert " tok/s kept (" in line and line.endswith("0 in 0.000 s released, 0 in 0.000 s kept")
    sys.modules.pop("engine_throughput", None)


def test_rollout_call_host_time_reports_the_host_work_around_the_steps(monkeypatch):
    """benchmarks/rollout_call_host_time.py (the rollout path with a zero forward): every figure, the engine's phases
    and a digest of the responses that is the same from run to run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import rollout_call_host_time as bench

    argv = ["--shape", "tiny", "--batch-sizes", "16", "--group-size", "8"]
    runs = [bench.main(argv)["this"]["16"] for _ in range(2)]
    for r in runs:
        assert all(r[f] >= 0 for f in bench.FIGURES) and r["wall_ms"] >= r["in_steps_ms"] > 0
        assert r["tokens"] > 0 and r["steps"] >= 64 and set(r["phase_ms"]) == {"schedule", "launch", "resolve",
                                                                               "stop_strings", "finish"}
        # nested thread-CPU readings: a sandboxed clock (CI's) can cross by a tick, so the part may exceed the whole
        # by a hair; a base64 timed outside build_response would exceed it by far more. The event loop's whole
        # (~3 ms here) was once read 0.6 ms below its responses' part on CI's clock: a millisecond of slack there.
        assert 0 < r["replay_base64_cpu_ms"] <= 1.05 * r["responses_cpu_ms"] + 0.05
        assert r["responses_cpu_ms"] <= 1.05 * r["main_cpu_ms"] + 1.0
    assert runs[0]["digest"] == runs[1]["digest"]
    for name in ("rollout_call_host_time", "rollout_http_client", "engine_throughput", "baseline_tree"):
        sys.modules.pop(name, None)


def test_rollout_call_host_time_over_http_answers_as_in_process(monkeypatch):
    """--paths inprocess,http --lengths rl (the RL loop's calls: the embedded server on 127.0.0.1, a client process,
    answers ending at varied steps): the same responses both ways, and the client's figures over HTTP."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import rollout_call_host_time as bench

    argv = ["--shape", "tiny", "--batch-sizes", "32", "--group-size", "8", "--lengths", "rl", "--paths",
            "inprocess,http", "--no-replay"]
    result = bench.main(argv)["this"]
    local, http = result["32"], result["32 http"]
    assert local["digest"] == http["digest"]
    for r in (local, http):
        assert all(r[f] >= 0 for f in bench.FIGURES) and 0 < r["decode_steps"] < 48  # capped at 64 new tokens
    assert http["client_cpu_ms"] > 0 and http["client_wall_ms"] <= http["wall_ms"]
    for name in ("rollout_call_host_time", "rollout_http_client", "engine_throughput", "baseline_tree"):
        sys.modules.pop(name, None)


def test_rollout_call_host_time_coalesced_calls_answer_as_the_n_form(monkeypatch):
    """--call-form n,batch,batch:16 (the calls merged by a coalescing client into one body, or into bodies of 16
    samples, two groups): the same responses as one call per group, side by side in one process; batch needs --paths
    http."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import rollout_call_host_time as bench

    argv = ["--shape", "tiny", "--batch-sizes", "32", "--group-size", "8", "--lengths", "rl", "--paths", "http",
            "--no-replay", "--call-form", "n,batch,batch:16"]
    result = bench.main(argv)["this"]
    assert set(result) == {"32 http n", "32 http batch", "32 http batch:16"}
    assert len({r["digest"] for r in result.values()}) == 1
    assert all(r["client_cpu_ms"] > 0 for r in result.values())
    with pytest.raises(SystemExit):
        bench.main(["--call-form", "batch", "--paths", "inprocess"])
    for name in ("rollout_call_host_time", "rollout_http_client", "engine_throughput", "baseline_tree"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("script, args", [
    ("engine_host_time.py", ["--batch", "32", "--group-size", "8", "--new-tokens", "4", "--reps", "1", "--count-ops"]),
    ("engine_throughput_compute.py", ["--device", "cpu", "--preset", "tiny", "--batch-sizes", "8", "--group-size", "4",
                                      "--new-tokens", "4", "--threads", "1", "--paths", "rollout"]),
])
def test_the_instrumented_engine_benchmarks_run(script, args):
    """Both wrap the engine's functions by name (timers, op counters): a renamed function must fail here, not on the
    device. Each in its own process: the wrappers stay on the modules."""
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]

"""logging.profile_steps' parts: the trace recorder, the engine's /start_profile and /stop_profile over real HTTP on
127.0.0.1, the device timeline's arithmetic and report, and the recipe's checks. The whole path through a Ray run
(engines and trainer ranks writing one step's traces) is in tests/test_rl_loop.py."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
import requests
import torch
from hypothesis import given
from hypothesis import strategies as st

from slime_dsa.config import RecipeConfig
from slime_dsa.logging.timeline import (PHASES_FILE, busy_share, covered, doing_at, idle_gaps, load_trace, main,
                                        report, union)
from slime_dsa.trace_recorder import META_SUFFIX, TRACE_SUFFIX, ProfileError, TraceRecorder, annotate
from tests.hf_reference import make_hf_checkpoint
from tests.test_server import serving

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- the recorder -------------------------------------------------------------------------------------------

def test_the_recorder_writes_a_trace_with_its_annotations_and_meta(tmp_path):
    recorder = TraceRecorder()
    with pytest.raises(ProfileError, match="no profile"):
        recorder.stop()
    with pytest.raises(ProfileError, match="profile name"):
        recorder.start(tmp_path, "../escape")
    recorder.start(tmp_path, "rank0")
    with pytest.raises(ProfileError, match="already"):
        recorder.start(tmp_path, "rank0")
    with annotate("train.forward"):
        torch.ones(4).sum()
    path = recorder.stop()
    assert path == tmp_path / f"rank0{TRACE_SUFFIX}" and not recorder.running
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "train.forward" and e.get("cat") == "user_annotation" for e in events)
    meta = json.loads((tmp_path / f"rank0{META_SUFFIX}").read_text())
    assert meta["pid"] > 0 and "host" in meta
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial file left
    assert type(annotate("x")).__name__ == "nullcontext"  # no profiler: not even the op call


# ---- the engine's endpoints ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer, save_tokenizer

    d = tmp_path_factory.mktemp("profiled_model")
    make_hf_checkpoint(d, seed=0, vocab_size=MODEL_VOCAB_SIZE, eos_token_id=build_tokenizer().eos_token_id)
    save_tokenizer(d)
    with serving(d, api_key=KEY) as srv:
        yield srv


def _post(srv, path, body, headers=AUTH):
    r = requests.post(srv.url + path, json=body, headers=headers, timeout=60)
    return r.status_code, r.text


def test_start_and_stop_profile_trace_the_engines_steps(server, tmp_path):
    assert _post(server, "/start_profile", {"output_dir": str(tmp_path)}, headers={})[0] == 401
    assert _post(server, "/start_profile", {"output_dir": str(tmp_path), "activities": ["CPU", "GPU"]}) == (
        200, "Start profiling.\n")
    assert _post(server, "/start_profile", {"output_dir": str(tmp_path)})[0] == 400  # one at a time
    status, _ = _post(server, "/generate", {"input_ids": list(range(5, 25)), "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                "ignore_eos": True}})
    assert status == 200
    status, text = _post(server, "/stop_profile", {})
    assert status == 200 and "Stop profiling" in text
    traces = list(tmp_path.glob(f"engine-*{TRACE_SUFFIX}"))
    assert len(traces) == 1 and str(traces[0]) in text
    names = {e.name for e in load_trace(traces[0]).cpu}
    # the engine thread's own ranges: the profile was started on that thread
    assert {"engine.step", "engine.schedule", "engine.launch"} <= names
    status, text = _post(server, "/stop_profile", {})
    assert status == 400 and "no profile" in text


class RefusingTrainers:
    """FAKE trainer group (the Ray one is in tests/test_rl_loop.py): its ranks cannot profile."""

    def start_profile(self, directory, activities):
        raise RuntimeError("profiler busy")

    def stop_profile(self):
        raise RuntimeError("no profile is being recorded")


def test_a_step_goes_on_when_a_process_cannot_profile(server, tmp_path, caplog):
    """An engine that refuses (a profile of its own already running) and trainers that fail cost their traces and
    a warning each; the step's phases are still written."""
    import asyncio

    from rollout.client import EngineClient
    from slime_dsa.orchestrator.profile import StepProfiler

    assert _post(server, "/start_profile", {"output_dir": str(tmp_path / "mine")})[0] == 200

    async def step():
        client = EngineClient([server.url], api_key=KEY)
        try:
            profiler = StepProfiler([2], tmp_path, client, RefusingTrainers(), ["GPU"])
            async with profiler.window(1) as clock:  # not listed: nothing started
                clock.mark("rollout")
            async with profiler.window(2) as clock:
                clock.mark("rollout")
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="slime_dsa.orchestrator.profile"):
        asyncio.run(step())
    assert "engines did not start their profiles" in caplog.text and "already" in caplog.text
    assert "the trainer ranks did not start their profiles: profiler busy" in caplog.text
    assert "the trainer ranks did not stop their profiles" in caplog.text
    step_dir = tmp_path / "profile" / "step_2"
    assert [p["name"] for p in json.loads((step_dir / PHASES_FILE).read_text())["phases"]] == ["rollout"]
    assert not (tmp_path / "profile" / "step_1").exists()
    # the orchestrator's stop ended the engine's own profile, whose trace went where that one asked
    assert list((tmp_path / "mine").glob(f"engine-*{TRACE_SUFFIX}"))


@pytest.mark.parametrize("body, named", [
    ({}, "output_dir"),
    ({"output_dir": ""}, "output_dir"),
    ({"output_dir": "/tmp/x", "activities": ["MEM"]}, "activities"),
    ({"output_dir": "/tmp/x", "activities": []}, "activities"),
    ({"output_dir": "/tmp/x", "num_steps": 5}, "num_steps"),
    ({"output_dir": "/tmp/x", "with_stack": True}, "with_stack"),
    ({"output_dir": "/tmp/x", "profile_by_stage": True}, "profile_by_stage"),
])
def test_a_start_the_engine_cannot_honour_is_a_400_naming_the_field(server, body, named):
    status, text = _post(server, "/start_profile", body)
    assert status == 400 and named in text
    assert _post(server, "/stop_profile", {})[0] == 400  # nothing was started


# ---- the timeline -------------------------------------------------------------------------------------------

intervals = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=30)


@given(intervals, st.integers(0, 600), st.integers(0, 600))
def test_busy_and_idle_spans_partition_any_window(spans, a, length):
    start, end = a, a + length
    merged = union(spans)
    assert all(s1 < e0 or e0 < s1 for (_, e0), (s1, _) in zip(merged, merged[1:]))  # disjoint, sorted
    idle = sum(e - s for s, e in idle_gaps(merged, start, end))
    assert covered(merged, start, end) + idle == end - start
    brute = sum(1 for t in range(start, end) if any(s <= t < e for s, e in spans))
    assert covered(merged, start, end) == brute


def _trace(path, events, base=1_000_000_000, meta=None):
    """A Kineto-shaped chrome trace: (cat, name, start µs, duration µs) events."""
    data = {"baseTimeNanoseconds": base, "host_name": "h",
            "traceEvents": [{"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d, "args": {"device": 0}}
                            for c, n, ts, d in events]}
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    if meta is not None:
        path.with_name(path.name.removesuffix(TRACE_SUFFIX) + META_SUFFIX).write_text(json.dumps(meta))


def test_the_report_merges_processes_on_one_gpu_and_names_idle_spans(tmp_path):
    gpu = {"gpu_uuid": "GPU-1", "host": "h"}
    ms = 1000  # trace times are in µs
    # engine: kernels in 0-40 ms; trainer: 60-100 ms; 40-60 ms the engine gathers calls and the GPU idles
    _trace(tmp_path / f"engine-h-1{TRACE_SUFFIX}",
           [("kernel", "decode", 0, 40 * ms), ("user_annotation", "engine.gather", 40 * ms, 20 * ms)], meta=gpu)
    _trace(tmp_path / f"trainer-rank0{TRACE_SUFFIX}",
           [("kernel", "gemm", 60 * ms, 30 * ms), ("kernel", "gemm", 70 * ms, 30 * ms),
            ("user_annotation", "train.forward", 58 * ms, 50 * ms)], meta=gpu)
    base = 1_000_000_000
    phases = [("rollout", 0, 55), ("train", 55, 100), ("log", 100, 200)]
    (tmp_path / PHASES_FILE).write_text(json.dumps(
        {"step": 3, "phases": [{"name": n, "start_ns": base + s * 10**6, "end_ns": base + e * 10**6}
                               for n, s, e in phases]}))
    shares = busy_share(tmp_path)
    assert shares["rollout"] == pytest.approx(40 / 55) and shares["train"] == pytest.approx(40 / 45)
    assert shares["log"] == 0 and shares["step"] == pytest.approx(0.4)
    text = report(tmp_path)
    assert "GPU GPU-1: engine-h-1, trainer-rank0" in text
    assert "| rollout | 55.0 | 40.0 | 73% | 40.0 | 0.0 |" in text
    assert "| **step** | 200.0 | 80.0 | 40% | 40.0 | 40.0 |" in text
    gaps = text[text.index("| at ms"):].splitlines()[2:]
    assert gaps[0] == "| 100.0 | 100.0 | log | no op recorded | no op recorded |"  # the longest first
    assert gaps[1] == "| 40.0 | 20.0 | rollout | engine.gather | no op recorded |"
    assert main([str(tmp_path)]) == 0


def test_processes_on_different_gpus_are_not_merged(tmp_path):
    _trace(tmp_path / f"a{TRACE_SUFFIX}", [("kernel", "k", 0, 10)], meta={"gpu_uuid": "GPU-A"})
    _trace(tmp_path / f"b{TRACE_SUFFIX}", [("kernel", "k", 0, 10)], meta={"gpu_uuid": "GPU-B"})
    (tmp_path / PHASES_FILE).write_text(json.dumps(
        {"step": 1, "phases": [{"name": "rollout", "start_ns": 1_000_000_000, "end_ns": 1_000_020_000}]}))
    assert busy_share(tmp_path)["rollout"] == pytest.approx(0.5)  # each GPU busy half, not the union of both
    text = report(tmp_path)
    assert "## GPU GPU-A: a" in text and "## GPU GPU-B: b" in text


def test_doing_at_prefers_annotations_over_ops(tmp_path):
    _trace(tmp_path / f"p{TRACE_SUFFIX}", [("cpu_op", "aten::mm", 0, 10), ("user_annotation", "train.backward", 0, 50)])
    trace = load_trace(tmp_path / f"p{TRACE_SUFFIX}")
    at = 1_000_000_000
    assert doing_at(trace, at + 5_000) == "train.backward"
    assert doing_at(trace, at + 60_000) == "no op recorded"


def test_a_directory_without_traces_is_one_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no traces" in capsys.readouterr().err


# ---- the recipe ---------------------------------------------------------------------------------------------

def _recipe(**logging) -> dict:
    return {"model": {"preset": "tiny"}, "data": {"tasks": [{"kind": "arithmetic"}]},
            "trainer": {"num_steps": 3}, "logging": logging}


def test_a_gpu_only_profile_records_no_cpu_ops(tmp_path):
    recorder = TraceRecorder()
    with pytest.raises(ProfileError, match="activities"):
        recorder.start(tmp_path, "r", ["MEM"])
    recorder.start(tmp_path, "r", ["GPU"])
    with annotate("train.forward"):
        torch.ones(4).sum()
    trace = load_trace(recorder.stop())
    assert trace.cpu == [] and trace.gpu == []  # no GPU here: nothing at all


def test_profile_steps_are_checked():
    assert RecipeConfig.model_validate(_recipe(profile_steps=[3, 1])).logging.profile_steps == [1, 3]
    assert RecipeConfig.model_validate(_recipe()).logging.profile_steps == []
    for steps, named in (([0], "counted from 1"), ([2, 2], "twice"), ([4], "past trainer.num_steps")):
        with pytest.raises(ValueError, match=named):
            RecipeConfig.model_validate(_recipe(profile_steps=steps))
    gpu_only = _recipe(profile_steps=[1], profile_activities=["GPU"])
    assert RecipeConfig.model_validate(gpu_only).logging.profile_activities == ["GPU"]
    for activities in ([], ["GPU", "GPU"]):
        with pytest.raises(ValueError, match="once each"):
            RecipeConfig.model_validate(_recipe(profile_activities=activities))
    with pytest.raises(ValueError):
        RecipeConfig.model_validate(_recipe(profile_activities=["MEM"]))
    asynchronous = _recipe(profile_steps=[1])
    asynchronous["algorithm"] = {"name": "async_reinforce"}
    with pytest.raises(ValueError, match="synchronous loop"):
        RecipeConfig.model_validate(asynchronous)

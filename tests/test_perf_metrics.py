"""Performance metrics on CPU: the engine's step-loop counters and the rates made of them (perf/engine_*), the
trainer's model FLOPs and MFU (perf/train_model_tflops, perf/train_mfu), and an engine actor's own log file.
The same keys through the real Ray loop: tests/test_rl_loop.py."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.engine import perf

ROOT = Path(__file__).resolve().parents[1]


def _tiny_model():
    from slime_dsa.checkpoint import build_model
    from slime_dsa.models.presets import preset_config

    return build_model(preset_config("tiny", vocab_size=384, eos_token_id=0), seed=0).eval()


def test_engine_counts_its_steps_and_where_their_time_goes():
    from rollout.engine import Engine, GenerateRequest, SamplingParams

    engine = Engine(_tiny_model(), max_cache_tokens=1024, max_running_requests=8, seed=0)
    before = perf.counters(engine.stats)
    for i in range(4):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=i)
        engine.add_request(GenerateRequest(input_ids=[5 + i, 6, 7, 8], sampling=params, rid=str(i), stream=False))
    while engine.num_running or engine.num_queued:
        engine.step()
    after = perf.counters(engine.stats)
    d = perf.delta(before, after)
    assert d["generated_tokens"] == 24 and d["steps"] == 6 and d["decode_steps"] == 5  # one prefill, then decodes
    assert 0 < d["device_s"] < d["step_s"] and 0 < d["decode_device_s"] < d["decode_step_s"] <= d["step_s"]
    assert d["running_sum"] == 24
    m = perf.step_metrics([d], [8])
    assert m["steps"] == 6 and m["batch"] == 4 and m["occupancy"] == pytest.approx(0.5)
    assert m["tok_s"] == pytest.approx(24 / d["step_s"]) and 0 < m["host_gap_share"] < 1
    assert m["host_gap_s"] == pytest.approx(d["step_s"] - d["device_s"])
    assert m["decode_step_ms"] == pytest.approx(d["decode_step_s"] / 5 * 1e3) and 0 < m["decode_host_gap_share"] < 1


def test_step_metrics_over_engines():
    one = dict(zip(perf.COUNTERS, (10, 100, 2.0, 1.5, 8, 1.0, 0.8, 40)))
    two = dict(zip(perf.COUNTERS, (10, 300, 1.0, 0.5, 10, 1.0, 0.5, 80)))
    idle = dict.fromkeys(perf.COUNTERS, 0.0)
    m = perf.step_metrics([one, two, idle], [8, 16, 4])
    assert m["steps"] == 20 and m["decode_steps"] == 18
    assert m["tok_s"] == pytest.approx(100 / 2 + 300 / 1)  # engines run side by side: their rates add
    assert m["step_ms"] == pytest.approx(3.0 / 20 * 1e3) and m["batch"] == 20
    assert m["occupancy"] == pytest.approx((40 / 8 + 80 / 16) / 20)
    assert m["host_gap_share"] == pytest.approx(1 - 2.0 / 3.0) and m["decode_host_gap_share"] == pytest.approx(0.35)
    assert perf.step_metrics([idle], [4]) == {}
    # an SGLang server's /get_server_info has no such counters: it adds nothing
    assert perf.counters({"stats_steps": 3}, prefix="stats_") is None
    server_info = {f"stats_{k}": v for k, v in one.items()}
    assert perf.counters(server_info, prefix="stats_") == {**{k: float(v) for k, v in one.items()},
                                                           **dict.fromkeys(perf.OPTIONAL_COUNTERS, 0.0)}
    assert perf.delta(None, one) == {**one, **dict.fromkeys(perf.OPTIONAL_COUNTERS, 0.0)}  # counts from its start


def test_active_parameters_count_the_routed_experts_a_token_visits():
    from slime_dsa.models.flops import active_params, peak_tflops, train_flops
    from slime_dsa.models.presets import preset_config

    config = preset_config("tiny", vocab_size=384, eos_token_id=0)
    model = _tiny_model()
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    embedding = params["model.embed_tokens.weight"].numel()
    total = sum(p.numel() for p in params.values())
    expected = total - embedding - routed + routed * config.num_experts_per_tok / config.n_routed_experts
    assert active_params(config) == int(expected) and 0 < expected < total
    assert train_flops(1000, 10) == 6e4 and train_flops(1000, 10, recompute_forward=True) == 8e4
    assert peak_tflops("NVIDIA H200", bf16=True) == 989.0 and peak_tflops("NVIDIA H100 PCIe", bf16=True) == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", bf16=False) == 67.0
    assert peak_tflops(None, bf16=True) is None and peak_tflops("Some New GPU", bf16=True) is None


def test_train_flops_metrics():
    from slime_dsa.orchestrator.perf import TrainFlops

    m = TrainFlops(active_params=10**9, peak_tflops=1000.0, devices=2).metrics(tokens=10_000, seconds=0.1,
                                                                                recompute_forward=True)
    assert m["perf/train_model_tflops"] == pytest.approx(8e9 * 1e4 / 0.1 / 2 / 1e12)  # per device
    assert m["perf/train_mfu"] == pytest.approx(m["perf/train_model_tflops"] / 1000)
    assert "perf/train_mfu" not in TrainFlops(10**9, None, 1).metrics(10, 1.0, False)  # no peak: no MFU


def test_engine_actor_log_file_takes_info_and_stderr_keeps_warnings(tmp_path):
    # a fresh interpreter: the root logger is changed for good, as in an engine's Ray worker
    log = tmp_path / "run" / "engine_0.log"
    code = ("import logging; from rollout.actors import log_to; log_to(%r); "
            "logging.getLogger('rollout.engine').info('engine: up'); logging.getLogger('x').warning('careful')")
    done = subprocess.run([sys.executable, "-c", code % str(log)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert "INFO rollout.engine: engine: up" in text and "WARNING x: careful" in text
    assert "careful" in done.stderr and "engine: up" not in done.stderr  # stderr (Ray's worker log) as before


def test_host_gap_is_finite_when_nothing_decoded():
    d = dict(zip(perf.COUNTERS, (1, 4, 0.01, 0.01, 0, 0.0, 0.0, 4)))
    m = perf.step_metrics([d], [4])
    assert m["host_gap_share"] == 0.0 and "decode_step_ms" not in m and all(math.isfinite(v) for v in m.values())


def test_engine_stats_reads_every_engine_between_steps():
    import asyncio

    from slime_dsa.orchestrator.perf import EngineStats

    def info(steps: int, tokens: int, seconds: float) -> dict:
        counters = dict(zip(perf.COUNTERS, (steps, tokens, seconds, seconds / 2, steps, seconds, seconds / 2, tokens)))
        return {"max_running_requests": 8, **{f"stats_{k}": v for k, v in counters.items()}}

    class Client:  # EngineClient.broadcast's reply: {url: body}; an SGLang server's body has no counters
        replies: list[dict] = []

        async def broadcast(self, path, json=None, *, method="POST", timeout_s=None, check=True):
            assert (path, method, check) == ("/get_server_info", "GET", False)
            return self.replies.pop(0)

    async def scenario() -> list[dict]:
        client = Client()
        client.replies = [{"a": info(1, 4, 0.1), "sglang": {"version": "x"}},  # reset before step 1
                          {"a": info(11, 44, 1.1), "sglang": {"version": "x"}},  # step 1
                          {"a": info(30, 100, 3.0)},  # reset after an evaluation
                          {"a": info(40, 140, 4.0), "b": info(5, 10, 0.5)}]  # step 2; engine b joined meanwhile
        stats = EngineStats(client)
        await stats.reset()
        first = await stats.metrics()
        await stats.reset()
        return [first, await stats.metrics()]

    first, second = asyncio.run(scenario())
    assert first["perf/engine_steps"] == 10 and first["perf/engine_tok_s"] == pytest.approx(40 / 1.0)
    assert second["perf/engine_steps"] == 10 + 5  # the evaluation's 19 steps are left out; b counts from its start
    assert second["perf/engine_tok_s"] == pytest.approx(40 / 1.0 + 10 / 0.5)
    assert second["perf/engine_host_gap_share"] == pytest.approx(0.5)

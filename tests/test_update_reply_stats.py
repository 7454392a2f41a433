"""The engines' step-loop counters ride in a weight update's reply (issue 19): the synchronous loop reads its
perf/engine_* metrics from the push's replies, one /get_server_info request per step less, with the same numbers.
Engines whose replies carry no counters (SGLang) still get the request."""

from __future__ import annotations

import asyncio

import pytest

from rollout.engine import perf
from slime_dsa.orchestrator.perf import EngineStats
from tests.test_server import checkpoints, get, post, serving  # noqa: F401 (checkpoints is a fixture)


def _stats(body: dict) -> dict:
    return {k: v for k, v in body.items() if k.startswith("stats_") or k == "max_running_requests"}


def test_an_update_reply_carries_the_counters_a_server_info_read_after_it_gives(checkpoints):  # noqa: F811
    """Bit for bit, its own command included (counted before the reply is sent), for both update paths."""
    from slime_dsa.checkpoint import read_state_dict
    from slime_dsa.weights.safetensors_b64 import tensor_update_payloads

    body = {"input_ids": list(range(10, 30)), "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                   "ignore_eos": True}}
    with serving(checkpoints[0], weight_dirs=[str(checkpoints[2].parent)]) as srv:
        post(srv, "/generate", body, headers={})
        payload = tensor_update_payloads(read_state_dict(checkpoints[1]), weight_version="1", bucket_bytes=1 << 40)
        assert len(payload) == 1
        status, reply = post(srv, "/update_weights_from_tensor", {**payload[0], "pause_mode": "abort"}, headers={})
        assert status == 200 and reply["success"] is True
        info = get(srv, "/get_server_info", headers={})[1]
        assert _stats(reply) == _stats(info) and perf.counters(reply, prefix="stats_") is not None
        assert reply["stats_commands"] >= 2 and reply["stats_weights_update_s"] > 0  # the update's own command

        post(srv, "/generate", body, headers={})
        status, reply = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[2]),
                                                                "weight_version": "2", "pause_mode": "abort"},
                             headers={})
        assert status == 200 and reply["success"] is True
        assert _stats(reply) == _stats(get(srv, "/get_server_info", headers={})[1])
        status, reply = post(srv, "/update_weights_from_disk", {"model_path": str(checkpoints[2].parent / "no")},
                             headers={})
        assert status == 400 and "stats_steps" not in reply  # a failed update says only why


def _info(steps: int, tokens: int, seconds: float) -> dict:
    counters = dict(zip(perf.COUNTERS, (steps, tokens, seconds, seconds / 2, steps, seconds, seconds / 2, tokens)))
    return {"max_running_requests": 8, "stats_commands": steps, "stats_command_s": seconds / 10,
            **{f"stats_{k}": v for k, v in counters.items()}}


class _Client:  # FAKE: EngineClient's engines and /get_server_info broadcast, counting the requests
    def __init__(self, urls: list[str], readings: list[dict]) -> None:
        self.engines = dict.fromkeys(urls)
        self.readings, self.requests = readings, 0

    async def broadcast(self, path, json=None, *, method="POST", timeout_s=None, check=True):
        assert (path, method) == ("/get_server_info", "GET")
        self.requests += 1
        return self.readings.pop(0)


def _interval(offer: dict | None, readings: list[dict], urls=("a", "b")) -> tuple[dict, int]:
    client = _Client(list(urls), readings)
    stats = EngineStats(client)

    async def scenario() -> dict:
        await stats.reset()
        stats.offer(offer)
        return await stats.metrics()
    return asyncio.run(scenario()), client.requests


def test_offered_update_replies_give_the_metrics_of_the_request_and_save_it():
    start = {"a": _info(1, 4, 0.1), "b": _info(2, 8, 0.2)}
    end = {"a": {"success": True, **_info(11, 44, 1.1)}, "b": {"success": True, **_info(7, 30, 0.9)}}
    by_request, requests = _interval(None, [start, end])
    by_reply, replied = _interval(end, [start])
    assert requests == 2 and replied == 1
    assert by_reply == by_request and by_reply["perf/engine_steps"] == 15
    assert by_reply["perf/engine_commands"] == 15


@pytest.mark.parametrize("offer", [
    {"a": {"success": True}, "b": {"success": True}},  # SGLang's replies: no counters
    {"a": {"success": True, **_info(11, 44, 1.1)}},  # an engine's reply missing
    {"a": {"success": True, **_info(11, 44, 1.1)}, "b": {"success": True, "message": "old build"}},
])
def test_replies_without_every_engines_counters_fall_back_to_the_request(offer):
    start = {"a": _info(1, 4, 0.1), "b": _info(2, 8, 0.2)}
    end = {"a": _info(11, 44, 1.1), "b": _info(7, 30, 0.9)}
    metrics, requests = _interval(offer, [start, end])
    assert requests == 2 and metrics["perf/engine_steps"] == 15


def test_an_offer_serves_one_read_only():
    client = _Client(["a"], [{"a": _info(1, 4, 0.1)}, {"a": _info(30, 90, 3.0)}])
    stats = EngineStats(client)

    async def scenario() -> tuple[dict, dict]:
        await stats.reset()
        stats.offer({"a": _info(11, 44, 1.1)})
        first = await stats.metrics()
        return first, await stats.metrics()  # no new offer: asks the engines
    first, second = asyncio.run(scenario())
    assert first["perf/engine_steps"] == 10 and second["perf/engine_steps"] == 19 and client.requests == 2


def test_a_one_request_push_keeps_its_replies_and_a_paused_push_does_not():
    from slime_dsa.orchestrator.weight_sync import CudaIpcTransport

    class Trainers:  # FAKE: CUDA IPC needs a GPU (the real path: test_cuda_ipc.py)
        def share_weights(self, engine_dtype):
            return {"buffer": {}, "tensors": []}

    class Client:  # FAKE
        engines = {"e": None}
        staged: list = []

        def admit_staged(self):
            return []

        async def broadcast(self, path, body, **options):
            return {"e": {"success": True, "path": path}}

    sync = CudaIpcTransport(Client(), Trainers(), engine_dtype="bfloat16")
    asyncio.run(sync.push(1))
    assert sync.last_replies is None  # pause, update, continue: the continue ran after the update's reply
    sync.engines_pause = True
    asyncio.run(sync.push(2))
    assert sync.last_replies == {"e": {"success": True, "path": "/update_weights_from_tensor"}}


def test_the_sync_loop_offers_the_push_replies_to_its_tail(monkeypatch):
    from slime_dsa.orchestrator import train
    from tests.fake_step_run import FakeStepRun

    offered = []

    class Stats:  # FAKE: records what _one_step offers
        def offer(self, bodies):
            offered.append(bodies)

    class Weights:  # FAKE transport
        last_replies = {"e": {"stats_steps": 3}}
        last_read_s = 0.0

        async def push(self, version, pause_mode="abort", want_state=False):
            return None

    async def train_on_samples(run, step, samples, resume_engines=True, clock=None, while_training=None):
        return {}
    monkeypatch.setattr(train, "train_on_samples", train_on_samples)
    run = FakeStepRun(type("C", (), {"engines": {"e": 1}})(), Weights(), Stats())
    asyncio.run(train._one_step(run, 0))
    assert offered == [{"e": {"stats_steps": 3}}]

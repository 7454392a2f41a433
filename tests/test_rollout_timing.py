"""Where a rollout phase's time goes (issue 19): the driver's perf/rollout_* breakdown (rollout.timing), the engines'
graph-capture and memory counters (perf/engine_*), and the colocated memory hand-over that keeps a small KV cache
(slime_dsa.orchestrator.colocation) instead of releasing it and capturing the decode graphs again."""

from __future__ import annotations

import asyncio

import pytest

from rollout.engine import perf
from rollout.timing import RolloutClock

MINIMAL_RECIPE = {"model": {"path": "m"}, "data": {"tasks": [{"kind": "arithmetic"}]}}
COLOCATED_GPU = {"placement": "colocated", "num_gpus_per_engine": 0.5, "num_gpus_per_trainer": 0.5}


def test_rollout_clock_splits_the_phase_into_dispatch_generate_and_tail(monkeypatch):
    from rollout import timing

    now = iter([10.0, 10.5, 10.6, 11.5, 12.0])  # start, two sends, then both answers
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(now))
    clock = RolloutClock()
    clock.start()
    a, b = clock.sent(), clock.sent()
    clock.answered(a, server_s=0.8)  # 11.5 - 10.5 = 1.0 s round trip, 0.8 s of it in the engine
    clock.answered(b, server_s=None)  # no e2e_latency reported: all of it counts as the engine's
    clock.assemble_s, clock.reward_s = 0.03, 0.02
    m = clock.metrics(end=12.25)
    assert m["perf/rollout_dispatch_s"] == pytest.approx(0.5)
    assert m["perf/rollout_generate_s"] == pytest.approx(1.5)  # first send to last answer
    assert m["perf/rollout_tail_s"] == pytest.approx(0.25)
    assert m["perf/rollout_calls"] == 2 and m["perf/rollout_call_ms"] == pytest.approx((1.0 + 1.4) / 2 * 1e3)
    assert m["perf/rollout_transport_ms"] == pytest.approx(0.2 / 2 * 1e3)
    assert m["perf/rollout_assemble_s"] == 0.03 and m["perf/rollout_reward_s"] == 0.02
    assert RolloutClock().metrics() == {}  # never started: nothing to report


def test_a_step_reports_its_rollout_breakdown():
    from tests.test_collection import _collector

    collector = _collector(n_samples_per_prompt=2, prompts_per_step=4)
    groups, m = asyncio.run(collector.collect())
    assert m["perf/rollout_calls"] == 4  # one /generate per group
    parts = m["perf/rollout_dispatch_s"] + m["perf/rollout_generate_s"] + m["perf/rollout_tail_s"]
    assert parts == pytest.approx(m["perf/rollout_time_s"], abs=1e-3)
    assert m["perf/rollout_assemble_s"] > 0 and m["perf/rollout_reward_s"] > 0
    # a second step starts its clock afresh
    _, again = asyncio.run(collector.collect())
    assert again["perf/rollout_calls"] == 4


def test_optional_engine_counters_are_summed_and_default_to_zero():
    base = dict(zip(perf.COUNTERS, (10, 100, 2.0, 1.5, 8, 1.0, 0.8, 40)))
    with_extra = {**base, "graph_captures": 3, "graph_capture_s": 0.3, "memory_release_s": 0.01,
                  "memory_resume_s": 0.02}
    assert perf.counters(base)["graph_captures"] == 0.0  # an engine without them reads 0
    m = perf.step_metrics([with_extra, base], [8, 8])
    assert m["graph_captures"] == 3 and m["graph_capture_s"] == pytest.approx(0.3)
    assert m["memory_resume_s"] == pytest.approx(0.02)


def test_the_engine_times_its_memory_hand_over_and_reports_the_pool_size():
    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from rollout.engine.async_engine import AsyncEngine
    from tests.test_perf_metrics import _tiny_model

    engine = Engine(_tiny_model(), max_cache_tokens=1024, max_running_requests=8, seed=0)
    allocated = engine.cache.nbytes
    assert allocated > 0 and engine.cache.pool_nbytes == allocated
    engine.release_memory(["kv_cache"])
    assert engine.cache.nbytes == 0 and engine.cache.pool_nbytes == allocated  # the size it comes back with
    info = AsyncEngine(engine).server_info()
    assert info["kv_cache_bytes"] == allocated and info["device_memory_bytes"] is None  # CPU
    engine.resume_memory(["kv_cache"])
    assert engine.stats["memory_release_s"] > 0 and engine.stats["memory_resume_s"] > 0
    assert engine.stats["graph_captures"] == 0  # CPU: no CUDA graphs
    engine.update_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, "1")
    assert engine.stats["weights_update_s"] > 0
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest(input_ids=[5, 6, 7], sampling=params, rid="a", stream=False))
    while engine.num_running or engine.num_queued:
        engine.step()  # the re-allocated pool serves again
    assert engine.stats["generated_tokens"] == 3


@pytest.mark.parametrize(("mode", "infos", "keep"), [
    ("auto", {"a": {"kv_cache_bytes": 1 << 30, "device_memory_bytes": 140 << 30}}, True),
    ("auto", {"a": {"kv_cache_bytes": 20 << 30, "device_memory_bytes": 140 << 30}}, False),  # above 10%
    ("auto", {"a": {"kv_cache_bytes": 1 << 30, "device_memory_bytes": 140 << 30}, "sglang": {"version": "x"}}, False),
    ("auto", {}, False),
    ("keep", {}, True),
    ("release", {"a": {"kv_cache_bytes": 1, "device_memory_bytes": 100}}, False),
])
def test_auto_keeps_only_a_small_kv_cache(mode, infos, keep):
    from slime_dsa.orchestrator.colocation import keeps_kv_cache

    assert keeps_kv_cache(mode, infos) is keep


class _Client:
    def __init__(self, kv_bytes: int) -> None:
        self.calls: list[str] = []
        self.kv_bytes = kv_bytes

    async def broadcast(self, path, json=None, *, method="POST", timeout_s=None, check=True):
        self.calls.append(path)
        if path == "/get_server_info":
            return {"u": {"kv_cache_bytes": self.kv_bytes, "device_memory_bytes": 100}}
        return {"u": None}


class _Trainers:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def resume_memory(self) -> None:
        self.calls.append("trainer resume")

    def release_memory(self, min_free_share: float | None = None) -> None:
        self.calls.append(f"trainer release {min_free_share}")


@pytest.mark.parametrize(("kv_bytes", "expected"), [
    (5, ["/pause_generation", "trainer release 0.15", "/continue_generation"]),  # the trainer keeps its cache too
    (50, ["/pause_generation", "/release_memory_occupation", "trainer resume", "trainer release None",
          "/resume_memory_occupation", "/continue_generation"]),
])
def test_the_hand_over_releases_the_kv_cache_only_when_auto_does_not_keep_it(kv_bytes, expected):
    from slime_dsa.orchestrator.colocation import MemoryHandOver

    client = _Client(kv_bytes)
    hand_over = MemoryHandOver(client, _Trainers(client.calls), "auto")

    async def two_steps() -> None:
        for _ in range(2):
            await hand_over.to_trainer()
            await hand_over.to_engines()

    asyncio.run(two_steps())
    assert client.calls[0] == "/get_server_info" and client.calls.count("/get_server_info") == 1  # decided once
    assert client.calls[1:] == expected * 2


def test_the_recipe_refuses_a_kv_cache_choice_where_nothing_is_handed_over():
    from slime_dsa.config import RecipeConfig

    with pytest.raises(ValueError, match="engine_kv_cache_in_training"):
        RecipeConfig.model_validate({**MINIMAL_RECIPE, "cluster": {"engine_kv_cache_in_training": "keep"}})  # CPU engines
    gpu = {**COLOCATED_GPU, "engine_kv_cache_in_training": "keep"}
    assert RecipeConfig.model_validate({**MINIMAL_RECIPE, "cluster": gpu}).cluster.engine_kv_cache_in_training == "keep"


def test_the_engine_thread_counts_the_commands_it_runs_between_steps():
    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from rollout.engine.async_engine import AsyncEngine
    from rollout.server.run import run_all
    from tests.test_perf_metrics import _tiny_model

    engine = Engine(_tiny_model(), max_cache_tokens=1024, max_running_requests=8, seed=0)

    async def three_requests() -> None:
        front = AsyncEngine(engine)
        await front.start()
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        await run_all(front, [GenerateRequest(input_ids=[5, 6, i], sampling=params, rid=str(i)) for i in range(3)])
        await front.stop()

    asyncio.run(three_requests())
    # run_all admits the three in one command (AsyncEngine.finals); how many more run depends on timing
    assert engine.stats["commands"] >= 1 and engine.stats["command_s"] > 0
    assert perf.counters(engine.stats)["commands"] == engine.stats["commands"]


@pytest.mark.parametrize("ids", [[5, True], [5, 2.0], [5, "6"], [5, None], [5, -1], [5, 384]])
def test_prompt_token_ids_are_checked_in_one_pass_on_both_sides(ids):
    """The server's and the engine's prompt checks (one C pass each, issue 19): a bool, a float, a string, None or an
    id out of [0, vocab) is refused by both, with the server's message naming the field."""
    from rollout.engine import Engine, GenerateRequest, SamplingParams
    from rollout.engine.types import RequestError
    from rollout.server.protocol import check_input_ids
    from tests.test_perf_metrics import _tiny_model

    with pytest.raises(RequestError, match="input_ids"):
        check_input_ids(ids, "input_ids", vocab_size=384, max_prompt_tokens=None)
    engine = Engine(_tiny_model(), max_cache_tokens=256, max_running_requests=2, seed=0)
    with pytest.raises(RequestError, match="input_ids"):
        engine.add_request(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=1), rid="r"))
    assert check_input_ids([0, 5, 383], "input_ids", vocab_size=384, max_prompt_tokens=None) == [0, 5, 383]


@pytest.mark.parametrize(("kv_mode", "trainer_mode", "share"), [
    ("keep", "auto", 0.15), ("release", "auto", None), ("keep", "release", None), ("keep", "keep", 0.0),
])
def test_the_trainer_keeps_its_cache_as_cluster_trainer_cache_in_rollout_says(kv_mode, trainer_mode, share):
    """auto keeps the trainer's cache (while 15% of the GPU is free) only when the engines keep their KV cache: a
    released cache comes back after the trainer's release and needs the room."""
    from slime_dsa.orchestrator.colocation import MemoryHandOver

    client = _Client(5)
    hand_over = MemoryHandOver(client, _Trainers(client.calls), kv_mode, trainer_mode)

    async def step() -> None:
        await hand_over.to_trainer()
        await hand_over.to_engines()

    asyncio.run(step())
    assert f"trainer release {share}" in client.calls


def test_the_recipe_refuses_a_trainer_cache_choice_where_nothing_is_handed_over():
    from slime_dsa.config import RecipeConfig

    with pytest.raises(ValueError, match="trainer_cache_in_rollout"):
        RecipeConfig.model_validate({**MINIMAL_RECIPE, "cluster": {"trainer_cache_in_rollout": "keep"}})
    gpu = {**COLOCATED_GPU, "trainer_cache_in_rollout": "release"}
    assert RecipeConfig.model_validate({**MINIMAL_RECIPE, "cluster": gpu}).cluster.trainer_cache_in_rollout == "release"
    with pytest.raises(ValueError, match="the trainer must give its cached memory back"):
        RecipeConfig.model_validate({**MINIMAL_RECIPE, "cluster": {**gpu, "trainer_cache_in_rollout": "keep",
                                                          "engine_kv_cache_in_training": "release"}})


def test_a_rank_keeps_its_cached_blocks_while_enough_of_the_gpu_is_free(monkeypatch):
    # The device's free share and torch's empty_cache are stand-ins (fakes): what empty_cache gives back depends on
    # what earlier tests left in the allocator's segments; this checks when the rank asks for it.
    import torch

    from trainers.rank import TrainerRank

    emptied = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    rank = TrainerRank.__new__(TrainerRank)  # release_memory reads only the device
    rank.device = torch.device("cuda")
    rank.release_memory(0.25)  # 37.5% free, at least 25%: kept
    assert emptied == []
    rank.release_memory(0.5)  # under 50% free: released
    assert emptied == [True]
    rank.release_memory(None)  # always released
    assert emptied == [True, True]
    rank.device = torch.device("cpu")
    rank.release_memory(None)  # nothing to release on a CPU
    assert emptied == [True, True]


def test_rollout_overlap_schedule_reaches_embedded_engines_and_is_refused_for_others(tmp_path, engine_actor_kwargs):
    from slime_dsa.config import RecipeConfig
    from slime_dsa.orchestrator import setup

    recipe = RecipeConfig.model_validate({**MINIMAL_RECIPE, "rollout": {"overlap_schedule": True}})
    setup.create_engines(recipe, tmp_path, use_async=False, access=None, count=1)
    assert engine_actor_kwargs["engine_kwargs"]["overlap"] is True
    assert engine_actor_kwargs["engine_kwargs"]["num_continuous_decode_steps"] == 4  # null: the RL default
    recipe = RecipeConfig.model_validate({**MINIMAL_RECIPE, "rollout": {"num_continuous_decode_steps": 1}})
    setup.create_engines(recipe, tmp_path, use_async=False, access=None, count=1)
    assert engine_actor_kwargs["engine_kwargs"]["num_continuous_decode_steps"] == 1
    with pytest.raises(ValueError, match="rollout.overlap_schedule applies to embedded engines"):
        RecipeConfig.model_validate({**MINIMAL_RECIPE, "rollout": {"overlap_schedule": True, "engine": "external",
                                                         "engine_urls": ["http://127.0.0.1:1"]}})

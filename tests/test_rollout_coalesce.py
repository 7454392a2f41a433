"""Coalesced group calls (rollout/coalesce.py): the rules that decide what merges, the same samples as uncoalesced
calls on a real embedded server over loopback, and failures (an error answer, a timeout, a cancelled caller) that
cost only their own call."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tests.hf_reference import make_hf_checkpoint

GROUP = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("coalesce")
    make_hf_checkpoint(directory)
    return directory


def _body(ids, n=1, seed=1, rid="r", **flags):
    sp = {"max_new_tokens": 4, "sampling_seed": seed, **({"n": n} if n > 1 else {})}
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "rid": rid, **flags}


# ---- the rules -----------------------------------------------------------------------------------------------

def test_calls_merge_only_with_the_same_n_flags_and_timeout():
    from rollout.coalesce import merge_key

    base = merge_key(_body([1, 2], n=4), 60.0)
    assert base is not None
    assert merge_key(_body([7, 8, 9], n=4, seed=99, rid="other", session_id="group-3"), 60.0) == base
    assert merge_key(_body([1, 2], n=2), 60.0) != base
    assert merge_key(_body([1, 2], n=4), 30.0) != base  # another timeout
    for flags in ({"return_logprob": False}, {"return_indexer_topk": True},
                  {"return_indexer_topk": True, "indexer_topk_start_len": 0}):
        assert merge_key(_body([1, 2], n=4, **flags), 60.0) != base
    batch = {"input_ids": [[1], [2]], "sampling_params": [{"sampling_seed": 1}, {"sampling_seed": 2}],
             "return_logprob": True, "rid": ["a", "b"]}
    assert merge_key(batch, 60.0) == merge_key(_body([3]), 60.0)  # n = 1 both
    # never merged: text, a stream, prompts of one call with different n, a per-prompt list field
    assert merge_key({"text": "hi", "sampling_params": {}}, 60.0) is None
    assert merge_key(_body([1], stream=True), 60.0) is None
    assert merge_key({**batch, "sampling_params": [{"n": 2}, {"n": 3}]}, 60.0) is None
    assert merge_key({**batch, "logprob_start_len": [-1, -1]}, 60.0) is None


def test_merged_body_keeps_each_prompts_seed_and_rid_and_splits_back():
    from rollout.coalesce import merge_bodies, split_answer

    calls = [_body([1, 2], n=2, seed=10, rid="a", session_id="g0"),
             _body([3], n=2, seed=20, rid="b", session_id="g1")]
    merged = merge_bodies(calls)
    assert merged["input_ids"] == [[1, 2], [3]] and merged["rid"] == ["a", "b"]
    assert [sp["sampling_seed"] for sp in merged["sampling_params"]] == [10, 20]
    assert merged["return_logprob"] is True and "session_id" not in merged  # two sessions: none
    assert merge_bodies([calls[0], {**calls[1], "session_id": "g0"}])["session_id"] == "g0"
    assert split_answer(["a0", "a1", "b0", "b1"], calls, 2) == [["a0", "a1"], ["b0", "b1"]]
    singles = [_body([1]), {"input_ids": [[2], [3]], "sampling_params": [{}, {}], "rid": ["x", "y"]}]
    assert split_answer(["s", "x", "y"], singles, 1) == ["s", ["x", "y"]]  # a single prompt with n 1: a dict
    with pytest.raises(ValueError, match="expected a list of 4 results"):
        split_answer(["a0"], calls, 2)


def test_chunks_respect_the_servers_limits():
    from rollout import coalesce
    from rollout.server.protocol import MAX_EXPANDED_REQUESTS

    assert coalesce.MAX_MERGED_GENERATIONS == MAX_EXPANDED_REQUESTS
    calls = [SimpleNamespace(generations=1024, tokens=10) for _ in range(9)]
    assert [len(c) for c in coalesce.chunks(calls, coalesce.MAX_MERGED_GENERATIONS)] == [4, 4, 1]
    groups = [SimpleNamespace(generations=16, tokens=200) for _ in range(20)]
    assert [len(c) for c in coalesce.chunks(groups)] == [4] * 5  # DEFAULT_MAX_SAMPLES 64
    assert [len(c) for c in coalesce.chunks(groups[:3], 20)] == [1, 1, 1]  # a call is never split
    big = [SimpleNamespace(generations=1, tokens=coalesce.MAX_MERGED_PROMPT_TOKENS // 2 + 1) for _ in range(3)]
    assert [len(c) for c in coalesce.chunks(big, 4096)] == [1, 1, 1]


def test_the_server_seeds_sample_j_of_each_batch_prompt_its_own_seed_plus_j():
    from rollout.server.protocol import parse_generate

    call = parse_generate({"input_ids": [[1, 2], [3]], "rid": ["a", "b"],
                           "sampling_params": [{"n": 3, "sampling_seed": 10}, {"n": 3, "sampling_seed": 50}]},
                          vocab_size=97)
    assert [r.sampling.sampling_seed for r in call.requests] == [10, 11, 12, 50, 51, 52]
    assert [r.rid for r in call.requests] == ["a_0", "a_1", "a_2", "b_0", "b_1", "b_2"]
    assert [r.input_ids for r in call.requests] == [[1, 2]] * 3 + [[3]] * 3


# ---- over loopback -------------------------------------------------------------------------------------------

def _setup(groups: int, **rollout_fields):
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task

    prompts = [Prompt(task="t", split="train", index=i, prompt_ids=[3 + i, 4, 5 + 2 * i, 6, 7 + i][: 3 + i % 3],
                      prompt_text="", answer="mixed") for i in range(groups)]
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=prompts, eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=groups, max_response_length=8,
                             temperature=1.0, return_indexer_topk=True, **rollout_fields)
    return prompts, task, rollout


def _rollout(client, task, rollout):
    from rollout.groups import GroupRollout

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return GroupRollout(client, [task], tokenizer, rollout, seed=3)


def _serve(checkpoint, main, **engine_kwargs):
    """Run main(server) against one embedded server on 127.0.0.1."""
    from rollout.server.launch import EmbeddedServer, load_engine

    async def run():
        engine, _ = load_engine(checkpoint, max_cache_tokens=8192, **engine_kwargs)
        server = await EmbeddedServer.start(engine)
        server.engine = engine  # for tests that watch its queue
        try:
            return await main(server)
        finally:
            await server.stop()

    return asyncio.run(run())


def test_coalesced_groups_get_the_same_samples_in_one_body(checkpoint):
    """Five groups gathered as the RL step gathers them, coalesced and not (cache flushed between): one body instead
    of five, and every sample equal bit for bit (tokens, log-probs, finish, reward, replay rows)."""
    import numpy as np

    from rollout.client import EngineClient
    from rollout.groups import SampleNumbering

    prompts, task, rollout = _setup(5)

    async def main(server):
        out = {}
        for coalesce in (False, True, 2 * GROUP):  # 2 * GROUP: bodies of two groups, the fifth alone
            async with EngineClient([server.url], coalesce=coalesce) as client:
                await client.broadcast("/flush_cache")
                numbering = SampleNumbering()
                groups = _rollout(client, task, rollout)
                fresh = [numbering.new_group(p, GROUP) for p in prompts]
                # Held until every sample is queued, so both forms prefill them in one step: samples equal bit for
                # bit only where their batches are (an idle engine's 3 ms gathering window splits a slow burst)
                await client.broadcast("/pause_generation", {"mode": "in_place"})
                calls = [asyncio.create_task(groups.generate_group(g)) for g in fresh]
                while server.engine.num_queued < len(prompts) * GROUP:
                    await asyncio.sleep(0.002)
                await client.broadcast("/continue_generation")
                done = await asyncio.gather(*calls)
                out[coalesce] = done, client.stats()[server.url]["completed"], dict(client.coalescer.counts
                                                                                    if coalesce else {})
        return out

    out = _serve(checkpoint, main, keep_indexer_topk=True)
    (alone, alone_calls, _), (merged, merged_calls, counts) = out[False], out[True]
    assert alone_calls == merged_calls == out[2 * GROUP][1] == 5  # calls answered, as the engine stats count them
    assert counts == {"merged_bodies": 1, "merged_calls": 5}
    assert out[2 * GROUP][2] == {"merged_bodies": 2, "merged_calls": 4, "alone": 1}
    flat_a, flat_m = [s for g in alone for s in g], [s for g in merged for s in g]
    flat_c = [s for g in out[2 * GROUP][0] for s in g]
    assert [s.index for s in flat_a] == [s.index for s in flat_m] == list(range(5 * GROUP))
    assert len({tuple(s.response_ids) for s in flat_m}) > GROUP  # the seeds differ per sample
    for x, y in [*zip(flat_a, flat_m), *zip(flat_a, flat_c)]:
        assert x.response_ids == y.response_ids and x.rollout_logprobs == y.rollout_logprobs  # bit for bit
        assert x.status == y.status and x.reward == y.reward and x.response_text == y.response_text
        assert x.indexer_topk_start == y.indexer_topk_start and np.array_equal(x.indexer_topk, y.indexer_topk)


def test_a_bad_prompt_in_a_merged_body_fails_only_its_group(checkpoint):
    """A prompt the server refuses (a token id outside the vocabulary: 400 for the whole merged body): its group's
    samples fail, the others, sent again alone, succeed."""
    from rollout.client import EngineClient
    from rollout.groups import SampleNumbering
    from slime_dsa.data.prompts import Prompt
    from slime_dsa.data.sample import SampleStatus

    prompts, task, rollout = _setup(3)
    prompts[1] = Prompt(task="t", split="train", index=1, prompt_ids=[3, 4, 10_000], prompt_text="", answer="x")

    async def main(server):
        async with EngineClient([server.url], coalesce=True, max_retries=0) as client:
            numbering = SampleNumbering()
            groups = _rollout(client, task, rollout)
            done = await asyncio.gather(*(groups.generate_group(numbering.new_group(p, GROUP)) for p in prompts))
            return done, dict(client.coalescer.counts)

    done, counts = _serve(checkpoint, main, keep_indexer_topk=True)
    assert [s.status for s in done[1]] == [SampleStatus.FAILED] * GROUP
    assert "not a token id" in done[1][0].metadata["error"]
    for g in (done[0], done[2]):
        assert all(s.status != SampleStatus.FAILED and s.response_ids for s in g)
    assert counts == {"failed_merges": 1, "alone": 3}


def _slow_and_fast(client, timeout_s: float):
    """Two calls merged into one body: a slow one (480 tokens, no EOS) and a fast one (2 tokens)."""
    slow = client.generate([3, 4, 5], {"max_new_tokens": 480, "ignore_eos": True, "sampling_seed": 1, "n": 2},
                           session_id="slow", timeout_s=timeout_s)
    fast = client.generate([6, 7], {"max_new_tokens": 2, "sampling_seed": 2, "n": 2}, session_id="fast",
                           timeout_s=timeout_s)
    return slow, fast


def test_a_timed_out_merged_body_is_aborted_and_its_calls_go_alone(checkpoint):
    """The merged body times out (its slow member): its rids are aborted on the engine, each call is sent again alone;
    the fast one answers, the slow one times out again alone and fails, and nothing is left running."""
    from rollout.client import EngineClient, EngineUnavailableError

    async def main(server):
        async with EngineClient([server.url], coalesce=True, max_retries=0) as client:
            slow, fast = _slow_and_fast(client, timeout_s=1.0)
            results = await asyncio.gather(slow, fast, return_exceptions=True)
            await asyncio.sleep(0.2)
            info = await client.get(server.url, "/get_server_info")
            return results, dict(client.coalescer.counts), info

    (slow, fast), counts, info = _serve(checkpoint, main)
    assert isinstance(slow, EngineUnavailableError) and "TimeoutError" in str(slow)
    assert len(fast) == 2 and all(r["meta_info"]["finish_reason"]["type"] == "length" for r in fast)
    assert counts == {"failed_merges": 1, "alone": 2}
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0


def test_a_cancelled_member_is_aborted_and_the_others_answer(checkpoint):
    """A caller cancels its call inside a merged body: its samples are aborted on the engine (so the body answers
    without waiting for its 480 tokens) and the other call gets its answer."""
    from rollout.client import EngineClient

    async def main(server):
        async with EngineClient([server.url], coalesce=True) as client:
            slow, fast = _slow_and_fast(client, timeout_s=120.0)
            slow_task, fast_task = asyncio.ensure_future(slow), asyncio.ensure_future(fast)
            await asyncio.sleep(0.3)
            assert not fast_task.done()  # merged: it waits for the slow member
            start = time.perf_counter()
            slow_task.cancel()
            fast_answer = await asyncio.wait_for(fast_task, 60)
            return fast_answer, time.perf_counter() - start, dict(client.coalescer.counts)

    fast, waited, counts = _serve(checkpoint, main)
    assert [r["meta_info"]["finish_reason"]["type"] for r in fast] == ["length", "length"]
    assert len(fast[0]["output_ids"]) == 2
    assert counts == {"merged_bodies": 1, "merged_calls": 2}
    assert waited < 5.0


def test_rollout_coalesce_calls_is_off_by_default_and_for_embedded_engines_only():
    from slime_dsa.config import RecipeConfig
    from slime_dsa.config.schema import RolloutSection

    assert RolloutSection().coalesces_calls() is False
    assert RolloutSection(coalesce_calls=True).coalesces_calls() is True
    assert RolloutSection(engine="sglang", coalesce_calls=True).coalesces_calls() is False
    recipe = {"model": {"path": "m"}, "data": {"tasks": [{"kind": "arithmetic"}]},
              "rollout": {"coalesce_calls": True, "engine": "external", "engine_urls": ["http://127.0.0.1:1"]}}
    with pytest.raises(ValueError, match="rollout.coalesce_calls applies to embedded engines"):
        RecipeConfig.model_validate(recipe)
    assert RolloutSection(coalesce_calls=True).client_coalesce() == 64
    assert RolloutSection(coalesce_calls=True, coalesce_max_samples=32).client_coalesce() == 32
    assert RolloutSection().client_coalesce() is False
    recipe["rollout"] = {"coalesce_calls": False, "coalesce_max_samples": 32}
    with pytest.raises(ValueError, match="coalesce_max_samples .32. applies with coalesce_calls"):
        RecipeConfig.model_validate(recipe)


def test_a_merged_body_whose_engine_is_unreachable_is_sent_again_alone_elsewhere(checkpoint):
    """Two engines, one of them not listening: the calls routed to it (merged) fail to connect once, count one failure
    against it, and each is sent again alone, routed and retried as without coalescing, to the live engine."""
    from rollout.client import EngineClient

    dead = "http://127.0.0.1:9"  # nothing listens there

    async def main(server):
        async with EngineClient([dead, server.url], coalesce=True, max_retries=1, backoff_s=0.0) as client:
            calls = [client.generate([3 + i, 4, 5], {"max_new_tokens": 3, "sampling_seed": i, "n": 2},
                                     session_id=f"group-{i}") for i in range(4)]
            answers = await asyncio.gather(*calls)
            return answers, dict(client.coalescer.counts), client.stats()

    answers, counts, stats = _serve(checkpoint, main)
    assert all(len(a) == 2 and a[0]["meta_info"]["completion_tokens"] == 3 for a in answers)
    assert counts == {"merged_bodies": 1, "merged_calls": 2, "failed_merges": 1, "alone": 2}
    assert stats[dead]["failures"] >= 1 and stats[dead]["completed"] == 0
    assert all(e["outstanding"] == 0 for e in stats.values())


def test_a_synchronous_step_reports_the_bodies_that_carried_its_group_calls(checkpoint):
    """StepCollector (the synchronous loop's rollout) over a coalescing client: 6 group calls of 4 samples in bodies of
    at most 8 samples, perf/rollout_calls 6 and perf/rollout_requests 3; every sample generated."""
    from rollout.client import EngineClient
    from rollout.groups import SampleNumbering
    from slime_dsa.data.prompts import TaskMixture
    from slime_dsa.data.sample import SampleStatus
    from slime_dsa.orchestrator.collection import StepCollector

    _, task, rollout = _setup(6)
    rollout = rollout.model_copy(update={"return_indexer_topk": False})

    async def main(server):
        async with EngineClient([server.url], coalesce=2 * GROUP) as client:
            collector = StepCollector(_rollout(client, task, rollout), TaskMixture([task]), SampleNumbering(), rollout,
                                      show_progress=False)
            return await collector.collect()

    groups, metrics = _serve(checkpoint, main)
    assert len(groups) == 6 and all(s.status != SampleStatus.FAILED for g in groups for s in g)
    assert metrics["perf/rollout_calls"] == 6 and metrics["perf/rollout_requests"] == 3

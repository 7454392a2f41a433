"""One /generate per group: GroupRollout (rollout.groups) sends a group's n samples in one request (real embedded
server over loopback), with the same per-sample seeds, so the samples equal those of one request per sample; to an
embedded engine the request carries the prompt once (n and the first seed), to SGLang one prompt per sample, with the
same samples."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.hf_reference import make_hf_checkpoint

GROUP = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batching")
    make_hf_checkpoint(directory)
    return directory


def _groups(client, tasks, rollout):
    from rollout.groups import GroupRollout

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    return GroupRollout(client, tasks, tokenizer, rollout, seed=3)


def test_a_group_is_one_request_with_the_per_sample_seeds(checkpoint):
    from rollout.client import EngineClient
    from rollout.groups import SampleNumbering
    from rollout.server.launch import EmbeddedServer, load_engine
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task

    prompt = Prompt(task="t", split="train", index=0, prompt_ids=[3, 4, 5, 6, 7], prompt_text="", answer="mixed")
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=[prompt], eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=1, max_response_length=6, temperature=1.0)

    async def main():
        engine, _ = load_engine(checkpoint, max_cache_tokens=4096)
        server = await EmbeddedServer.start(engine)
        try:
            async with EngineClient([server.url]) as client:
                samples = SampleNumbering().new_group(prompt, GROUP)
                grouped = await _groups(client, [task], rollout).generate_group(samples)
                requests = client.stats()[server.url]["completed"]
                one_by_one = _groups(client, [task], rollout)
                single = [(await one_by_one.generate_group([s]))[0] for s in SampleNumbering().new_group(prompt, GROUP)]
                return grouped, single, requests
        finally:
            await server.stop()

    grouped, single, requests = asyncio.run(main())
    assert requests == 1
    assert [s.index for s in grouped] == [s.index for s in single] == list(range(GROUP))
    assert len({tuple(s.response_ids) for s in grouped}) > 1  # seeds differ per sample
    for a, b in zip(grouped, single):
        assert a.response_ids == b.response_ids
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
        assert a.reward == b.reward and a.status == b.status


def _recording_client(url: str):
    from rollout.client import EngineClient

    class RecordingClient(EngineClient):
        """# SPY: keeps each request's body, then sends it unchanged (to tell which form a group's call took)."""

        async def request(self, path, payload, **options):
            self.bodies.append(payload)
            return await super().request(path, payload, **options)

    client = RecordingClient([url])
    client.bodies = []
    return client


def _replay_setup(**rollout_fields):
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task

    prompt = Prompt(task="t", split="train", index=0, prompt_ids=list(range(3, 12)), prompt_text="", answer="mixed")
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=[prompt], eval=None)
    rollouts = {kind: RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=1, max_response_length=8,
                                     temperature=1.0, return_indexer_topk=True, engine=kind, **rollout_fields)
                for kind in ("embedded", "sglang")}
    return prompt, task, rollouts


def _same_samples(a, b) -> None:
    import numpy as np

    assert [s.index for s in a] == [s.index for s in b]
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.rollout_logprobs == y.rollout_logprobs  # bit for bit
        assert x.status == y.status and x.reward == y.reward and x.response_text == y.response_text
        assert x.indexer_topk_start == y.indexer_topk_start and np.array_equal(x.indexer_topk, y.indexer_topk)


def _run_kinds(checkpoint, numbering_at: int):
    """One group per engine kind on one embedded server (over loopback, its prefix cache flushed between them):
    {kind: (samples, the /generate bodies sent)}."""
    from rollout.groups import SampleNumbering
    from rollout.server.launch import EmbeddedServer, load_engine

    prompt, task, rollouts = _replay_setup()

    async def main():
        engine, _ = load_engine(checkpoint, max_cache_tokens=4096, keep_indexer_topk=True)
        server = await EmbeddedServer.start(engine)
        out = {}
        try:
            for kind, rollout in rollouts.items():
                async with _recording_client(server.url) as client:
                    await client.broadcast("/flush_cache")
                    samples = SampleNumbering(next_sample_index=numbering_at).new_group(prompt, GROUP)
                    out[kind] = await _groups(client, [task], rollout).generate_group(samples), client.bodies
        finally:
            await server.stop()
        return out

    return asyncio.run(main())


def test_embedded_engines_get_the_prompt_once_and_the_same_samples(checkpoint):
    """rollout.engine embedded: one prompt with n and the first seed; sglang: one prompt per sample. Same samples:
    tokens, log-probs, finish, replay rows."""
    out = _run_kinds(checkpoint, numbering_at=0)
    (compact, [n_body]), (per_sample, [batch_body]) = out["embedded"], out["sglang"]
    seeds = [(3 * 1_000_003 + k) % 2**31 for k in range(GROUP)]  # GroupRollout.sample_seed at seed 3
    assert n_body["input_ids"] == list(range(3, 12)) and n_body["rid"] and isinstance(n_body["rid"], str)
    assert n_body["sampling_params"]["n"] == GROUP and n_body["sampling_params"]["sampling_seed"] == seeds[0]
    assert batch_body["input_ids"] == [list(range(3, 12))] * GROUP
    assert [sp["sampling_seed"] for sp in batch_body["sampling_params"]] == seeds
    assert all("n" not in sp for sp in batch_body["sampling_params"])
    assert len({tuple(s.response_ids) for s in compact}) > 1  # the seeds differ per sample
    assert all(s.indexer_topk is not None for s in compact)
    _same_samples(compact, per_sample)


def test_a_group_whose_seeds_wrap_is_sent_one_prompt_per_sample(checkpoint):
    from rollout.client import n_sample_params

    first = 2**31 - 2 - 3 * 1_000_003  # sample index whose seed (at seed 3) is 2**31 - 2: the group's seeds wrap
    out = _run_kinds(checkpoint, numbering_at=first)
    (wrapped, [body]), (per_sample, _) = out["embedded"], out["sglang"]
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [2**31 - 2, 2**31 - 1, 0, 1]
    assert isinstance(body["input_ids"][0], list)  # the per-sample form: n would give seeds 2**31 and 2**31 + 1
    _same_samples(wrapped, per_sample)
    assert n_sample_params({"top_k": 5}, [7, 8, 9]) == {"top_k": 5, "n": 3, "sampling_seed": 7}
    assert n_sample_params({}, [2**31 - 1, 0]) is None and n_sample_params({}, [7, 9]) is None
    assert n_sample_params({}, [7]) is None


def test_a_failed_group_request_costs_its_samples_not_the_step():
    from rollout.client import EngineClient
    from rollout.groups import SampleNumbering
    from slime_dsa.config.schema import RolloutSection
    from slime_dsa.data.prompts import Prompt, Task
    from slime_dsa.data.sample import SampleStatus

    prompt = Prompt(task="t", split="train", index=0, prompt_ids=[3, 4, 5], prompt_text="", answer="x")
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=[prompt], eval=None)
    rollout = RolloutSection(n_samples_per_prompt=GROUP, prompts_per_step=1, max_response_length=4,
                             request_timeout_s=1.0)

    async def main():
        # Nothing listens there: every attempt fails to connect.
        async with EngineClient(["127.0.0.1:9"], max_retries=0) as client:
            return await _groups(client, [task], rollout).generate_group(SampleNumbering().new_group(prompt, GROUP))

    group = asyncio.run(main())
    assert [s.status for s in group] == [SampleStatus.FAILED] * GROUP
    assert all("EngineUnavailableError" in s.metadata["error"] for s in group)


def test_generate_batch_needs_one_sampling_params_per_prompt():
    from rollout.client import EngineClient

    async def main():
        async with EngineClient(["127.0.0.1:9"]) as client:
            await client.generate_batch([[1, 2], [3]], [{}])

    with pytest.raises(ValueError, match="one sampling_params per prompt"):
        asyncio.run(main())


def test_sample_limiter_counts_samples_and_never_deadlocks():
    from rollout.limiter import SampleLimiter

    async def main():
        limiter = SampleLimiter(6)
        peak = 0

        async def group(n: int) -> None:
            nonlocal peak
            async with limiter.hold(n):
                peak = max(peak, limiter.in_flight)
                await asyncio.sleep(0.01)

        await asyncio.wait_for(asyncio.gather(*(group(n) for n in [4, 4, 4, 1, 9, 2])), timeout=5)
        return peak, limiter.in_flight

    peak, left = asyncio.run(main())
    assert peak == 6 and left == 0  # 9 > the limit runs alone, holding all 6 places
    with pytest.raises(ValueError):
        SampleLimiter(0)


def test_logprob_agreement_counts_trained_tokens_only():
    import torch

    from slime_dsa.orchestrator.batching import logprob_agreement
    from trainers.base import TrainBatch

    batch = TrainBatch(input_ids=torch.zeros(6, dtype=torch.long), seqlens=[3, 3],
                       loss_mask=torch.tensor([0.0, 1, 1, 0, 1, 1]), advantages=torch.zeros(6),
                       rollout_logprobs=torch.tensor([-1.0, -2, -3, -4, -5, -6]))
    batch.old_logprobs = torch.tensor([9.0, -2, -3.5, 9, -5, -6.25])  # prompt rows (mask 0) far off: not counted
    assert logprob_agreement(batch) == {"sync_logprob_abs_diff": 0.1875, "sync_logprob_abs_diff_max": 0.5,
                                        "sync_logprob_exact": 0.5}

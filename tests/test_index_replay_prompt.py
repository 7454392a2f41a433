"""Index replay of the PROMPT rows: exact even where the prompt's top-k is fragile, also across a reused prefix.

The fragile case: the indexer's query ignores position (its rope slice is zeroed), its key projection sees half of
the hidden dims, and eight token ids have embeddings that are near-copies (1e-4 apart) in that half and distinct in
the other: in the first full layer their index keys, and so every prompt row's scores over them, are near-tied,
while their attention keys and values differ. The engine runs an indexer kernel that rounds q and k to bfloat16 (a
stand-in for a lower-precision GPU kernel), which turns those near-ties into exact ties; the trainer's float32
reference orders them by the 1e-4 noise. So engine and trainer select different keys at prompt rows, and the keys
and values of those rows feed every generated token.

End to end over loopback HTTP: an EmbeddedServer (keep_indexer_topk) -> GroupRollout.generate_group (EngineClient,
indexer_topk_start_len 0) -> Samples -> TrainBatch -> an FSDP2 rank (gloo). The three samples
share the prompt's cached prefix (admitted together; or computed earlier by a request that asked for no top-k).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout.client import EngineClient
from rollout.engine import Engine, GenerateRequest, SamplingParams
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.types import RequestError
from rollout.groups import GroupRollout, SampleNumbering
from rollout.server.launch import EmbeddedServer
from slime_dsa import ops
from slime_dsa.algorithms.indexer_loss import topk_overlap
from slime_dsa.checkpoint import build_model, save_pretrained
from slime_dsa.config.schema import RolloutSection
from slime_dsa.data.sample import Sample
from slime_dsa.models import ModelConfig, PackedBatch
from slime_dsa.ops import reference
from slime_dsa.orchestrator.batching import build_train_batch
from trainers.process_group import free_port

CONFIG = dict(
    vocab_size=53, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=12,
    q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=4, index_head_dim=8,
    index_topk=6, indexer_types=["full", "shared", "full"], max_position_embeddings=256, eos_token_id=None,
)
K = CONFIG["index_topk"]
NEAR = list(range(10, 18))  # token ids whose embedding rows are near-copies
PROMPT = [3, *NEAR, 21, *NEAR[::-1], 5, *NEAR[2:], *NEAR[:5], 30, *NEAR[1::2], 7, 10, 12]  # 38 tokens
BLOCK = 4
N = 3


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = build_model(ModelConfig(**CONFIG), seed=0).eval()
    c = m.config
    half = c.hidden_size // 2
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        noise = torch.randn(len(NEAR), half, generator=torch.Generator().manual_seed(3))
        emb[NEAR, :half] = emb[NEAR[0], :half] + 1e-4 * noise  # the other half stays distinct: so do their K/V
        for layer in c.full_layer_ids:
            indexer = m.model.layers[layer].self_attn.indexer
            indexer.wk.weight[:, half:] = 0  # index keys see only the near-copied half (k_norm drops the scale)
            indexer.wq_b.weight.view(c.index_n_heads, c.index_head_dim, -1)[:, : c.qk_rope_head_dim] = 0  # no position
    return m


def bf16_kernel_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk, scale, **_):
    """The engine's indexer: q and k rounded to bfloat16 before scoring (near-ties become exact ties)."""
    return reference.indexer_topk(q.to(torch.bfloat16).float(), k.to(torch.bfloat16).float(), weights,
                                  cu_seqlens_q, cu_seqlens_k, topk, scale)


def rollout(model, monkeypatch, *, warm_prefix: bool) -> tuple[list[Sample], int]:
    """One group of N samples of PROMPT through GroupRollout over HTTP (every row's top-k asked for), and the
    prompt tokens the engine took from its prefix cache; warm_prefix first runs a request that caches the prompt."""
    from slime_dsa.data.prompts import Prompt, Task

    rollout_cfg = RolloutSection(n_samples_per_prompt=N, prompts_per_step=1, max_response_length=10,
                                 return_indexer_topk=True)
    prompt = Prompt(task="t", split="train", index=0, prompt_ids=list(PROMPT), prompt_text="", answer=None)
    task = Task(name="t", kind="arithmetic", weight=1.0, reward_fn="tests.plugins.rewards:digit_fraction",
                train=[prompt], eval=None)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))

    async def main() -> tuple[list[Sample], int]:
        engine = Engine(model, max_cache_tokens=1024, block_size=BLOCK, seed=1, keep_indexer_topk=True)
        server = await EmbeddedServer.start(AsyncEngine(engine))
        try:
            async with EngineClient([server.url]) as client:
                if warm_prefix:
                    await client.generate(PROMPT, {"max_new_tokens": 1})
                groups = GroupRollout(client, [task], tokenizer, rollout_cfg)
                return await groups.generate_group(SampleNumbering().new_group(prompt, N)), engine.stats["cached_tokens"]
        finally:
            await server.stop()

    with monkeypatch.context() as m:
        m.setattr(ops, "indexer_topk", bf16_kernel_topk)
        samples, cached = asyncio.run(main())
    for s in samples:
        assert s.status.value == "truncated", s.metadata
        s.validate()
    return samples, cached


def output_rows_only(samples: list[Sample]) -> list[Sample]:
    """The same samples with only the rows that produced output tokens (what the engine returned before)."""
    out = []
    for s in samples:
        first = len(s.prompt_ids) - 1 - s.indexer_topk_start
        c = Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                   rollout_logprobs=s.rollout_logprobs, weight_versions=s.weight_versions, reward=s.reward,
                   index=s.index, group_id=s.group_id, indexer_topk=s.indexer_topk[first:])
        out.append(c.validate())
    return out


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    from slime_dsa.algorithms import PPOLoss  # noqa: PLC0415
    from trainers.base import OptimizerConfig, policy_config  # noqa: PLC0415
    from trainers.fsdp.worker import FSDPWorker  # noqa: PLC0415

    path = tmp_path_factory.mktemp("fragile")
    save_pretrained(model, path)
    config = policy_config(str(path), PPOLoss(eps_low=0.2, eps_high=0.28), OptimizerConfig(learning_rate=1e-3),
                           frozen=(".indexer.",), ops_backend="torch", micro_batch_tokens=64)
    w = FSDPWorker(0, 1, "127.0.0.1", free_port(), config)
    yield w
    w.shutdown()


def test_prompt_row_replay_is_exact_where_the_prompt_is_fragile(model, worker, monkeypatch):
    P = len(PROMPT)
    advantages = torch.tensor([-1.0, 0.0, 1.0])
    for warm_prefix in (False, True):  # the prefix shared within the step; or cached by an earlier request
        samples, cached = rollout(model, monkeypatch, warm_prefix=warm_prefix)
        # The samples reused the prompt's cached blocks (all N, or all but the one that computed them first): those
        # prompt rows' top-k came from the cache.
        # (Samples admitted together fork from the first and count its last prompt row as cached too.)
        assert cached >= (P - 1) // BLOCK * BLOCK * (N if warm_prefix else N - 1)
        for s in samples:  # every row from index_topk on; rows below it select every causal key
            assert s.indexer_topk_start == K
            assert s.indexer_topk.shape == (P + len(s.response_ids) - 1 - K, len(model.config.full_layer_ids), K)
            assert np.array_equal(s.indexer_topk[: P - 1 - K], samples[0].indexer_topk[: P - 1 - K])
            assert (s.indexer_topk >= 0).all()  # a row past index_topk has more keys than it selects

        # The prompt rows are fragile: the trainer's own selection there is not the engine's.
        ids = torch.tensor(samples[0].tokens)
        with torch.no_grad():
            own = model.forward_packed(ids, PackedBatch.from_seqlens([len(ids)]), return_topk=True).topk_indices
        engine_prompt = torch.tensor(samples[0].indexer_topk[: P - 1 - K]).long().permute(1, 0, 2)
        assert 1 - float(topk_overlap(engine_prompt, own[:, K : P - 1]).mean()) > 0.05

        engine_logp = build_train_batch(samples, advantages).rollout_logprobs
        replayed = build_train_batch(samples, advantages, index_replay=True)
        mask = replayed.loss_mask.bool()
        gap = (worker.compute_logprobs(replayed)[mask] - engine_logp[mask]).abs().max().item()
        assert gap <= 1e-5, f"every row replayed: max |log p_train - log p_engine| = {gap:.2e}"

        # Only the output rows replayed (the trainer selects at the prompt rows itself): the log-probs differ.
        partial = build_train_batch(output_rows_only(samples), advantages, index_replay=True)
        partial_gap = (worker.compute_logprobs(partial)[mask] - engine_logp[mask]).abs().max().item()
        assert partial_gap > 1e-3, f"output rows only: max gap {partial_gap:.2e}, the fragile prompt did not matter"
        logging.getLogger(__name__).info("warm_prefix=%s: max |logp gap| every row replayed %.2e, output rows only %.2e",
                                         warm_prefix, gap, partial_gap)

    # Replay off: the mismatch over every returned row, prompt rows included, is measured and logged.
    compared = build_train_batch(samples, advantages)
    compared.old_logprobs = worker.compute_logprobs(compared)
    metrics = worker.train_step(compared, float(compared.loss_mask.sum()), len(samples))  # last: it moves the weights
    assert 0.02 < metrics["index_topk_mismatch"] <= 1.0


def test_prompt_rows_need_an_engine_that_keeps_them(model):
    engine = Engine(model, max_cache_tokens=256, block_size=BLOCK)
    with pytest.raises(RequestError, match="keep_indexer_topk"):
        engine.add_request(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2), return_indexer_topk=True,
                                           indexer_topk_start_len=0))
    with pytest.raises(RequestError, match="indexer_topk_start_len"):
        Engine(model, max_cache_tokens=256, keep_indexer_topk=True).add_request(
            GenerateRequest(PROMPT, return_indexer_topk=True, indexer_topk_start_len=-2))


@pytest.mark.parametrize("paged_decode,overlap", [(False, True), (True, True), (True, False)])
def test_start_len_leaves_out_rows_below_it_and_below_index_topk(model, paged_decode, overlap):
    """indexer_topk_start_len = s returns rows max(s, index_topk) .. P+R-2, equal to the engine's full-row answer,
    on both decode paths (the paged one stores the decode rows' selections at its own write slots), with and without
    the overlap scheduler."""
    engine = Engine(model, max_cache_tokens=512, block_size=BLOCK, keep_indexer_topk=True, paged_decode=paged_decode,
                    overlap=overlap)
    short = PROMPT[:4]  # P - 1 < index_topk: no prompt row is returned, and the first output rows neither
    for rid, (ids, start_len) in {"all": (PROMPT, 0), "late": (PROMPT, 20), "short": (short, 0),
                                  "legacy": (PROMPT, -1)}.items():
        engine.add_request(GenerateRequest(ids, SamplingParams(max_new_tokens=5, temperature=0.0), rid=rid,
                                           return_indexer_topk=True, indexer_topk_start_len=start_len))
    finals = {}
    while engine.has_work:
        finals.update({o.rid: o for o in engine.step() if o.finish_reason is not None})
    P, R = len(PROMPT), 5
    assert finals["all"].indexer_topk_start == K and len(finals["all"].indexer_topk) == P + R - 1 - K
    assert finals["late"].indexer_topk_start == 20
    assert np.array_equal(finals["late"].indexer_topk, finals["all"].indexer_topk[20 - K :])
    assert finals["legacy"].indexer_topk_start == P - 1
    assert np.array_equal(finals["legacy"].indexer_topk, finals["all"].indexer_topk[P - 1 - K :])
    assert finals["short"].indexer_topk_start == K and finals["short"].indexer_topk.shape[0] == len(short) + R - 1 - K
    ids = torch.tensor(PROMPT + finals["all"].output_ids)
    with torch.no_grad():
        own = model.forward_packed(ids, PackedBatch.from_seqlens([len(ids)]), return_topk=True).topk_indices
    # Same kernel in engine and here: every returned row is the selection a full forward makes.
    assert torch.equal(own[:, K:-1], torch.tensor(finals["all"].indexer_topk).long().permute(1, 0, 2))  # last row: never fed
    # A prompt prefilled in chunks of 8 rows over several steps: the same rows.
    chunked = Engine(model, max_cache_tokens=512, block_size=BLOCK, keep_indexer_topk=True, max_prefill_tokens=8,
                     overlap=overlap)
    chunked.add_request(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=5, temperature=0.0), rid="c",
                                        return_indexer_topk=True, indexer_topk_start_len=0))
    while chunked.has_work:
        finals.update({o.rid: o for o in chunked.step() if o.finish_reason is not None})
    assert chunked.stats["steps"] >= len(PROMPT) // 8 + R - 1
    assert np.array_equal(finals["c"].indexer_topk, finals["all"].indexer_topk)


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_rows_survive_a_retract(model, overlap):
    """A request retracted mid-generation (pause retract) is re-prefilled; its answer keeps the prompt rows of its
    first prefill and one row per output token, as an uninterrupted request has."""
    def run(retract: bool):
        engine = Engine(model, max_cache_tokens=512, block_size=BLOCK, keep_indexer_topk=True, overlap=overlap)
        engine.add_request(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0), rid="r",
                                           return_indexer_topk=True, indexer_topk_start_len=0))
        finals, steps = {}, 0
        while engine.has_work:
            finals.update({o.rid: o for o in engine.step() if o.finish_reason is not None})
            steps += 1
            if retract and steps == 3:
                engine.pause("retract")
                engine.update_weights({})  # as a weight push does: the prefix cache is dropped, so all is re-prefilled
                engine.resume()
        return finals["r"], engine.stats["prefill_tokens"]

    (plain, prefilled), (retracted, re_prefilled) = run(False), run(True)
    assert re_prefilled > prefilled + len(PROMPT)  # the retract did re-prefill the prompt and the tokens so far
    assert retracted.output_ids == plain.output_ids and retracted.indexer_topk_start == plain.indexer_topk_start == K
    assert np.array_equal(retracted.indexer_topk, plain.indexer_topk)

"""The embedded engine: greedy parity with transformers, log-prob parity with the trainer forward, prefix reuse,
memory budget, abort / pause / weight updates, index replay, seeds, stop rules, and the asyncio wrapper.

CPU, float32, a random glm_moe_dsa checkpoint with index_topk (4) far below the sequence lengths, so the
sparse selection matters, and IndexShare layers (full, full, shared, full).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import slime_dsa
from rollout.engine import AsyncEngine, Engine, EngineStoppedError, GenerateRequest, RequestError, SamplingParams
from rollout.engine.rows import SamplingRows
from slime_dsa.models import PackedBatch
from tests.hf_reference import TINY, make_hf_checkpoint

MODEL = dict(index_topk=4, num_hidden_layers=4, index_topk_freq=2)
VOCAB = TINY["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", autouse=True, params=["packed", "paged", "packed-sync", "paged-sync"])
def decode_path(request):
    """Every test runs on both decode paths: the packed forward (paged_decode off) and the paged decode (the
    default, whose CUDA graphs replay exactly this forward), so the paged path inherits every parity test; each with
    the overlap scheduler (the default: a step launches before the previous step's tokens reach the host) and
    without it (-sync)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(Engine.__init__.__kwdefaults__, "paged_decode", request.param.startswith("paged"))
        mp.setitem(Engine.__init__.__kwdefaults__, "overlap", not request.param.endswith("-sync"))
        yield request.param.removesuffix("-sync")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    hf = make_hf_checkpoint(directory, **MODEL)
    return directory, hf


@pytest.fixture(scope="module")
def model(checkpoint):
    return slime_dsa.load_model(checkpoint[0]).eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(engine, arrivals=None, max_steps=10_000):
    """Step until idle; arrivals maps step index -> requests added before that step. Returns final outputs by rid."""
    arrivals = dict(arrivals or {})
    finals, step, peak = {}, 0, 0
    while arrivals or engine.num_running or engine.num_queued:
        for req in arrivals.pop(step, []):
            engine.add_request(req)
        for out in engine.step():
            assert len(out.output_ids) == len(out.output_token_logprobs) == len(out.output_token_versions)
            if out.finish_reason is not None:
                finals[out.rid] = out
        peak = max(peak, engine.num_running)
        step += 1
        assert step < max_steps
    run.peak_running = peak
    return finals


def trainer_logits(model, prompt, output):
    """Teacher-forced logits over prompt + output: row p is the distribution of token p + 1."""
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        return model.forward_packed(ids, PackedBatch.from_seqlens([len(ids)])).logits.float()


# ----------------------------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_greedy_matches_transformers_generate_with_staggered_arrivals(checkpoint, model, decode_path, decode_steps):
    """decode_steps: Engine.num_continuous_decode_steps (several decode steps a launch on the paged path)."""
    _, hf = checkpoint
    lengths, n_new = (3, 7, 12, 5, 17), 20
    ps = prompts(lengths)
    reference = []
    for p in ps:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
        reference.append(out[0, len(p) :].tolist())
    # block_size 4 and an 8-token prefill budget: blocks fill mid-sequence, long prompts prefill in chunks
    engine = Engine(model, max_cache_tokens=1024, block_size=4, max_prefill_tokens=8,
                    num_continuous_decode_steps=decode_steps)
    arrivals = {0: [], 2: [], 5: [], 9: []}
    for i, (p, at) in enumerate(zip(ps, (0, 0, 2, 5, 9))):
        arrivals[at].append(GenerateRequest(input_ids=p, sampling=greedy(n_new), rid=str(i), stream=False))
    finals = run(engine, arrivals)
    assert run.peak_running == len(ps)  # they shared the running batch
    paged_steps = engine.stats["paged_decode_steps"]
    assert (paged_steps > n_new // 2) if decode_path == "paged" else paged_steps == 0
    assert (engine.stats["continued_decode_steps"] > 0) == (decode_path == "paged" and decode_steps > 1)
    for i, ref in enumerate(reference):
        assert finals[str(i)].output_ids == ref, f"request {i} (prompt {lengths[i]} tokens) diverged from transformers"
        assert finals[str(i)].finish_reason == {"type": "length", "length": n_new}
    # Greedy log-probs are log_softmax of the raw logits at the argmax.
    out = finals["3"]
    logp = torch.log_softmax(trainer_logits(model, ps[3], out.output_ids), -1)
    rows = torch.arange(len(ps[3]) - 1, len(ps[3]) - 1 + n_new)
    expect = logp[rows, torch.tensor(out.output_ids)]
    assert torch.allclose(torch.tensor(out.output_token_logprobs), expect, atol=1e-5)


def test_non_streaming_requests_emit_only_their_final_output(model):
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    engine.add_request(GenerateRequest(input_ids=[5, 6, 7], sampling=greedy(6), rid="quiet", stream=False))
    engine.add_request(GenerateRequest(input_ids=[5, 6, 7], sampling=greedy(6), rid="loud"))
    seen = {"quiet": [], "loud": []}
    while engine.has_work:
        for out in engine.step():
            seen[out.rid].append(out)
    assert len(seen["loud"]) == 6 and len(seen["quiet"]) == 1
    assert seen["quiet"][0].finish_reason is not None and seen["quiet"][0].output_ids == seen["loud"][-1].output_ids


def test_sampled_logprobs_match_trainer_token_logprobs(model):
    ps = prompts((6, 11, 4, 9), seed=1)
    engine = Engine(model, max_cache_tokens=1024, block_size=4, seed=0)
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=16, temperature=0.7, ignore_eos=True), rid=str(i)))
    finals = run(engine)
    seqs = [ps[i] + finals[str(i)].output_ids for i in range(len(ps))]
    batch = PackedBatch.from_seqlens([len(s) for s in seqs])
    with torch.no_grad():
        logp, _ = model.token_logprobs(torch.tensor(sum(seqs, [])), batch, temperature=0.7)
    for i, p in enumerate(ps):
        start = int(batch.cu_seqlens_q[i]) + len(p)
        trainer = logp[start : start + 16]
        engine_lp = torch.tensor(finals[str(i)].output_token_logprobs)
        assert (trainer - engine_lp).abs().max().item() <= 1e-5


def _filtered_logprob(logits_row: torch.Tensor, token: int, temperature: float, top_k: int, top_p: float, min_p: float) -> float:
    """Direct transcription: temperature, keep top_k, keep the smallest prefix of mass >= top_p, drop p < min_p * p_max."""
    probs = torch.softmax(logits_row.double() / temperature, -1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    keep, mass = [], 0.0
    for rank, tok in enumerate(order):
        if rank > 0 and (rank >= top_k or mass > top_p or probs[tok] < min_p * probs[order[0]]):
            break
        keep.append(tok)
        mass += probs[tok].item()
    assert token in keep, "sampled a token outside the kept set"
    return float(torch.log(probs[token] / probs[keep].sum()))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.9, 5, 1.0, 0.0), (1.0, -1, 0.8, 0.0), (0.7, 8, 0.9, 0.05)])
def test_filtered_sampling_logprobs_are_renormalised(model, temperature, top_k, top_p, min_p):
    ps = prompts((5, 8), seed=2)
    engine = Engine(model, max_cache_tokens=512, block_size=4, seed=1)
    params = dict(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(input_ids=p, sampling=SamplingParams(**params), rid=str(i)))
    finals = run(engine)
    for i, p in enumerate(ps):
        out = finals[str(i)]
        logits = trainer_logits(model, p, out.output_ids)
        for j, (tok, lp) in enumerate(zip(out.output_ids, out.output_token_logprobs)):
            ref = _filtered_logprob(logits[len(p) - 1 + j], tok, temperature, top_k if top_k > 0 else VOCAB, top_p, min_p)
            assert abs(ref - lp) <= 1e-5, (i, j, ref, lp)


# ----------------------------------------------------------------------------------------------
# prefix reuse and memory


def test_prefix_reuse_hits_and_changes_nothing(model):
    prompt = prompts((13,), seed=3)[0]

    def session(engine):
        samples = [
            GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=s, ignore_eos=True), rid=f"s{s}")
            for s in range(4)
        ]
        first = run(engine, {0: samples})
        turn2 = prompt + first["s0"].output_ids + [5, 6, 7]
        second = run(engine, {0: [GenerateRequest(input_ids=turn2, sampling=greedy(8), rid="turn2")]})
        return {**first, **second}

    reused = session(Engine(model, max_cache_tokens=1024, block_size=4))
    fresh = session(Engine(model, max_cache_tokens=1024, block_size=4, enable_prefix_caching=False))
    # The n samples arrived together: the first computes the prompt, the others read its full blocks in the same
    # forward and copy the rest (the partial last block, the last row) from it: nothing of the prompt is recomputed.
    assert sorted(reused[f"s{s}"].cached_tokens for s in range(4)) == [0, 13, 13, 13]
    assert reused["turn2"].cached_tokens >= 20  # prompt and most of the first answer
    assert all(out.cached_tokens == 0 for out in fresh.values())
    assert len({tuple(reused[f"s{s}"].output_ids) for s in range(4)}) > 1  # distinct samples
    for rid, out in fresh.items():
        assert reused[rid].output_ids == out.output_ids, rid
        assert np.allclose(reused[rid].output_token_logprobs, out.output_token_logprobs, atol=1e-5), rid


def test_samples_of_one_prompt_fork_and_equal_separate_runs(model):
    """n samples of one prompt admitted together: one computes the prompt (here all of it sits in a partial block),
    the others copy its cache rows and sample from its last row. Each must equal the same request run alone."""
    prompt = prompts((13,), seed=6)[0]
    req = lambda s: GenerateRequest(input_ids=prompt, rid=f"s{s}", return_indexer_topk=True,  # noqa: E731
                                    sampling=SamplingParams(max_new_tokens=7, sampling_seed=s, ignore_eos=True))
    engine = Engine(model, max_cache_tokens=1024, block_size=16)
    together = run(engine, {0: [req(s) for s in range(4)]})
    assert engine.stats["prefill_tokens"] == 13  # the prompt once
    assert sorted(out.cached_tokens for out in together.values()) == [0, 13, 13, 13]
    assert len({tuple(out.output_ids) for out in together.values()}) > 1
    for s in range(4):
        alone = run(Engine(model, max_cache_tokens=1024, block_size=16), {0: [req(s)]})[f"s{s}"]
        got = together[f"s{s}"]
        assert got.output_ids == alone.output_ids, s
        assert np.allclose(got.output_token_logprobs, alone.output_token_logprobs, atol=1e-5), s
        assert np.array_equal(got.indexer_topk, alone.indexer_topk), s


@dataclasses.dataclass(eq=False)  # hashed by identity, as the engine's sequences
class _Rows:
    num_computed: int
    blocks: list[int]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fork_rows_are_copied_slot_for_slot_from_the_twins_blocks(data):
    """Engine._copy_fork_rows (vectorised over rows) copies row p of each fork from its twin's row p: the slots of
    the per-row definition, for forks whose new rows start anywhere and span several blocks."""
    bs = data.draw(st.sampled_from([1, 4, 16]))
    copied, forks, scheduled, expect_src, expect_dst = {}, {}, [], [], []
    engine = types.SimpleNamespace(block_size=bs, _forks=forks, device=torch.device("cpu"), cache=types.SimpleNamespace(
        copy_rows=lambda src, dst: copied.update(src=src.tolist(), dst=dst.tolist())))
    ids = iter(range(10**6))
    for _ in range(data.draw(st.integers(0, 6))):
        start, n = data.draw(st.integers(0, 40)), data.draw(st.integers(0, 40))
        blocks = -(-(start + n) // bs) + data.draw(st.integers(0, 2))
        seq = _Rows(start, [next(ids) for _ in range(blocks)])
        twin = _Rows(0, [next(ids) for _ in range(blocks)])
        forks[seq] = twin
        scheduled.append((seq, n))
        if data.draw(st.booleans()):
            scheduled.append((_Rows(0, [next(ids)]), 1))  # not a fork
        for pos in range(start, start + n):
            expect_src.append(twin.blocks[pos // bs] * bs + pos % bs)
            expect_dst.append(seq.blocks[pos // bs] * bs + pos % bs)
    Engine._copy_fork_rows(engine, scheduled)
    assert (copied.get("src", []), copied.get("dst", [])) == (expect_src, expect_dst)


def test_packed_steps_give_the_indexer_host_offsets_equal_to_the_device_ones(model, monkeypatch):
    """The engine's packed forwards pass cu_seqlens as host lists too (the Triton indexer then never reads them back
    from the device): they must equal the device offsets, with cached prefixes, forks and staggered arrivals."""
    from slime_dsa import ops

    seen = []
    real = ops.indexer_topk

    def spy(q, k, weights, cu_q, cu_k, topk, scale, host_cu_seqlens=None):
        seen.append((cu_q.tolist(), cu_k.tolist(), host_cu_seqlens))
        return real(q, k, weights, cu_q, cu_k, topk, scale, host_cu_seqlens=host_cu_seqlens)

    monkeypatch.setattr(ops, "indexer_topk", spy)
    prompt = prompts((13,), seed=8)[0]
    samples = [GenerateRequest(input_ids=prompt, rid=f"s{s}",
                               sampling=SamplingParams(max_new_tokens=6, sampling_seed=s, ignore_eos=True))
               for s in range(3)]
    later = [GenerateRequest(input_ids=p, sampling=greedy(5), rid=f"late{i}") for i, p in enumerate(prompts((9, 21)))]
    run(Engine(model, max_cache_tokens=1024, block_size=4), {0: samples, 2: later})
    assert seen
    for cu_q, cu_k, host in seen:
        assert host is not None and (list(host[0]), list(host[1])) == (cu_q, cu_k)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_cache_budget_queues_and_completes(model, prefix_caching):
    ps = prompts([6] * 10, seed=4)
    reqs = lambda: [GenerateRequest(input_ids=p, sampling=greedy(8), rid=str(i)) for i, p in enumerate(ps)]  # noqa: E731
    small = Engine(model, max_cache_tokens=32, block_size=4, enable_prefix_caching=prefix_caching)  # 8 blocks, 4 per request
    for r in reqs():
        small.add_request(r)
    assert small.num_queued == 10
    finals = run(small)
    assert run.peak_running == 2 and len(finals) == 10
    assert all(out.finish_reason["type"] == "length" for out in finals.values())
    big = run(Engine(model, max_cache_tokens=1024, block_size=4), {0: reqs()})
    assert all(finals[r].output_ids == big[r].output_ids for r in big)
    assert small.blocks.available == small.blocks.num_blocks  # every block came back (idle cached ones count)
    if prefix_caching:
        assert 0 < small.blocks.num_cached_blocks <= small.blocks.num_blocks  # older prefixes were evicted
    with pytest.raises(RequestError, match="max_new_tokens"):
        small.add_request(GenerateRequest(input_ids=ps[0], sampling=greedy(40)))


def test_inverse_cdf_never_draws_a_removed_token():
    from rollout.engine.sampling import sample_inverse_cdf

    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.3, 0.7, 0.0]]))
    for u in (0.0, 0.4999, 0.5, 0.9999999, 1.0 - 2**-53):
        tokens = sample_inverse_cdf(logprobs, torch.tensor([u, u], dtype=torch.float64))
        assert tokens[0] in (0, 1) and tokens[1] in (1, 2), (u, tokens)


def test_bad_requests_name_the_field(model):
    engine = Engine(model, max_cache_tokens=256)
    engine.add_request(GenerateRequest(input_ids=[1, 2], sampling=greedy(0), rid="zero"))
    (out,) = engine.step()
    assert out.rid == "zero" and out.output_ids == [] and out.finish_reason == {"type": "length", "length": 0}
    with pytest.raises(RequestError, match="input_ids"):
        engine.add_request(GenerateRequest(input_ids=[1, VOCAB]))
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request(GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(top_p=0.0)))
    with pytest.raises(RequestError, match="sampling_params.stop"):
        engine.add_request(GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(stop=["x"])))  # no tokenizer
    engine.add_request(GenerateRequest(input_ids=[1, 2], rid="dup"))
    with pytest.raises(RequestError, match="rid 'dup'"):
        engine.add_request(GenerateRequest(input_ids=[3], rid="dup"))


# ----------------------------------------------------------------------------------------------
# control


def test_abort_one_queued_and_all(model):
    engine = Engine(model, max_cache_tokens=64, block_size=4, max_running_requests=2)
    for i, p in enumerate(prompts((5, 6, 7, 8), seed=5)):
        engine.add_request(GenerateRequest(input_ids=p, sampling=greedy(10), rid=str(i)))
    engine.step()
    assert engine.num_running == 2 and engine.num_queued == 2
    aborted = engine.abort("0") + engine.abort("3")
    assert [o.rid for o in aborted] == ["0", "3"]
    assert all(o.finish_reason["type"] == "abort" for o in aborted)
    assert len(aborted[0].output_ids) == 1 and aborted[1].output_ids == []
    engine.step()
    assert engine.num_running == 2 and engine.num_queued == 0  # "2" took the free slot
    rest = engine.abort(abort_all=True)
    assert sorted(o.rid for o in rest) == ["1", "2"] and engine.num_running == 0
    assert engine.blocks.available == engine.blocks.num_blocks


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_resume_keep_greedy_outputs(model, mode):
    ps = prompts((9, 5), seed=6)
    reqs = lambda: [GenerateRequest(input_ids=p, sampling=greedy(12), rid=str(i)) for i, p in enumerate(ps)]  # noqa: E731
    expect = run(Engine(model, max_cache_tokens=512, block_size=4), {0: reqs()})
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    for r in reqs():
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    assert engine.pause(mode) == []
    assert engine.step() == [] and not engine.has_work
    assert (engine.num_running, engine.num_queued) == ((0, 2) if mode == "retract" else (2, 0))
    engine.resume()
    finals = run(engine)
    for rid, out in expect.items():
        assert finals[rid].output_ids == out.output_ids
        assert np.allclose(finals[rid].output_token_logprobs, out.output_token_logprobs, atol=1e-5)


def test_pause_abort_ends_requests_and_holds_new_ones(model):
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    engine.add_request(GenerateRequest(input_ids=[1, 2, 3], sampling=greedy(10), rid="a"))
    engine.step()
    aborted = engine.pause("abort")
    assert [o.rid for o in aborted] == ["a"] and aborted[0].finish_reason["type"] == "abort"
    engine.add_request(GenerateRequest(input_ids=[4, 5], sampling=greedy(3), rid="b"))
    assert engine.step() == [] and engine.num_queued == 1
    engine.resume()
    assert run(engine)["b"].finish_reason == {"type": "length", "length": 3}
    with pytest.raises(RequestError, match="pause mode"):
        engine.pause("later")


def test_update_weights_in_place(checkpoint, tmp_path):
    model = slime_dsa.load_model(checkpoint[0]).eval()
    make_hf_checkpoint(tmp_path, seed=1, **MODEL)
    other = slime_dsa.load_model(tmp_path).eval()
    prompt = prompts((10,), seed=7)[0]
    expect_new = run(Engine(other, max_cache_tokens=512, block_size=4), {0: [GenerateRequest(input_ids=prompt, sampling=greedy(8), rid="r")]})["r"]

    engine = Engine(model, max_cache_tokens=512, block_size=4)
    before = run(engine, {0: [GenerateRequest(input_ids=prompt, sampling=greedy(8), rid="r")]})["r"]
    assert before.output_ids != expect_new.output_ids and set(before.output_token_versions) == {0}
    # Bad dicts change nothing and name the tensor.
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(RequestError, match=rf"{name} has shape \(3, 3\)"):
        engine.update_weights({"lm_head.weight": other.lm_head.weight, name: torch.zeros(3, 3)}, "1")
    with pytest.raises(RequestError, match="no tensor named model.surprise"):
        engine.update_weights({"model.surprise": torch.zeros(1)}, "1")
    assert torch.equal(model.lm_head.weight, slime_dsa.load_model(checkpoint[0]).lm_head.weight)
    # A partial dict updates only its tensors.
    engine.update_weights({"lm_head.weight": other.lm_head.weight}, "1")
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    engine.update_weights(other.state_dict(), "2")
    after = run(engine, {0: [GenerateRequest(input_ids=prompt, sampling=greedy(8), rid="r")]})["r"]
    assert after.output_ids == expect_new.output_ids
    assert after.cached_tokens == 0  # the old weights' prefix was flushed
    assert after.weight_version == "2" and set(after.output_token_versions) == {2}


def test_weight_version_per_token_across_in_place_update(checkpoint, tmp_path):
    model = slime_dsa.load_model(checkpoint[0]).eval()
    make_hf_checkpoint(tmp_path, seed=1, **MODEL)
    new_state = slime_dsa.load_model(tmp_path).state_dict()
    engine = Engine(model, max_cache_tokens=512, block_size=4, weight_version="3")
    engine.add_request(GenerateRequest(input_ids=[1, 2, 3, 4], sampling=greedy(6), rid="r"))
    for _ in range(3):
        engine.step()
    engine.pause("in_place")
    engine.update_weights(new_state, "4")
    assert engine.flush_cache() is False  # a request still holds the cache
    engine.resume()
    out = run(engine)["r"]
    assert out.output_token_versions == [3, 3, 3, 4, 4, 4] and out.weight_version == "4"
    assert engine.flush_cache() is True


# ----------------------------------------------------------------------------------------------
# index replay, seeds, stop rules


def test_index_replay_reproduces_engine_logprobs(model):
    ps = prompts((9, 14), seed=8)
    engine = Engine(model, max_cache_tokens=512, block_size=4, seed=3)
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=15, ignore_eos=True), rid=str(i), return_indexer_topk=True))
    engine.add_request(GenerateRequest(input_ids=ps[0], sampling=greedy(5), rid="plain"))  # shares the batch, asks nothing
    finals = run(engine)
    assert finals["plain"].indexer_topk is None
    n_full, K = len(model.config.full_layer_ids), model.config.index_topk
    for i, p in enumerate(ps):
        out = finals[str(i)]
        P, R = len(p), len(out.output_ids)
        topk = out.indexer_topk
        assert topk.dtype == np.int32 and topk.shape == (R, n_full, K)
        ids = torch.tensor(p + out.output_ids)
        batch = PackedBatch.from_seqlens([P + R])
        with torch.no_grad():
            plain = model.forward_packed(ids, batch, return_topk=True).topk_indices  # (n_full, T, K)
        # Output token j was produced by row P - 1 + j: the engine's selection there is the teacher-forced one.
        assert torch.equal(plain[:, P - 1 : P - 1 + R], torch.from_numpy(topk).long().permute(1, 0, 2))
        replay = plain.clone()
        replay[:, P - 1 : P - 1 + R] = torch.from_numpy(topk).long().permute(1, 0, 2)
        with torch.no_grad():
            logp, _ = model.token_logprobs(ids, batch, replay_topk=replay)
        assert (logp[P:] - torch.tensor(out.output_token_logprobs)).abs().max().item() <= 1e-5
        # Off by one row, the replay is wrong: the alignment above is not vacuous.
        shifted = plain.clone()
        shifted[:, P : P + R - 1] = torch.from_numpy(topk[:-1]).long().permute(1, 0, 2)
        with torch.no_grad():
            wrong, _ = model.token_logprobs(ids, batch, replay_topk=shifted)
        assert (wrong[P:] - torch.tensor(out.output_token_logprobs)).abs().max().item() > 1e-3


def test_same_seed_same_tokens_alone_or_in_a_batch(model):
    prompt = prompts((7,), seed=9)[0]
    seeded = lambda rid, seed: GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12, sampling_seed=seed, ignore_eos=True), rid=rid)  # noqa: E731
    alone = run(Engine(model, max_cache_tokens=512, block_size=4, seed=0), {0: [seeded("x", 42)]})["x"]
    others = [GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=9, ignore_eos=True), rid=f"o{i}") for i, p in enumerate(prompts((3, 11, 6), seed=10))]
    crowd = run(Engine(model, max_cache_tokens=512, block_size=4, seed=7), {0: others[:2], 3: [seeded("x", 42), seeded("y", 43)] + others[2:]})
    assert crowd["x"].output_ids == alone.output_ids
    assert np.allclose(crowd["x"].output_token_logprobs, alone.output_token_logprobs, atol=1e-5)
    assert crowd["y"].output_ids != alone.output_ids


def test_add_requests_shares_a_groups_checks_and_equals_adding_one_by_one(model):
    """add_requests (a /generate call's requests at once): the samples of a group share one prompt check, stop rules
    and row; seeds (given or drawn from the engine's generator) and outputs equal those of add_request one by one; a
    refused request takes back the ones before it."""
    ps = prompts((6, 9), seed=23)
    params = lambda seed, temperature=1.0: SamplingParams(  # noqa: E731
        max_new_tokens=8, temperature=temperature, sampling_seed=seed, min_new_tokens=2,
        stop_token_ids=list(range(0, VOCAB, 3)))
    reqs = lambda: ([GenerateRequest(input_ids=list(ps[0]), sampling=params(10 + j), rid=f"a{j}") for j in range(3)]  # noqa: E731
                    + [GenerateRequest(input_ids=list(ps[0]), sampling=params(None), rid=f"u{j}") for j in range(2)]
                    + [GenerateRequest(input_ids=list(ps[1]), sampling=params(20), rid="b0"),
                       GenerateRequest(input_ids=list(ps[1]), sampling=params(21, 0.7), rid="b1")])
    one_by_one = Engine(model, max_cache_tokens=1024, block_size=4, seed=5)
    for req in reqs():
        one_by_one.add_request(req)
    at_once = Engine(model, max_cache_tokens=1024, block_size=4, seed=5)
    batch = reqs()
    at_once.add_requests(batch)
    seqs = [at_once._active[req.rid] for req in batch]
    assert all(seq.stop is seqs[0].stop for seq in seqs[1:5])  # one group: its checks and stop rules made once
    assert seqs[5].stop is not seqs[0].stop and seqs[6].stop is not seqs[5].stop  # another prompt; another temperature
    assert [seq.row for seq in seqs] == [one_by_one._active[req.rid].row for req in batch]  # seeds drawn alike
    expected, got = run(one_by_one), run(at_once)
    assert len({tuple(got[f"a{j}"].output_ids) for j in range(3)}) > 1
    for rid, out in expected.items():
        assert (got[rid].output_ids, got[rid].finish_reason) == (out.output_ids, out.finish_reason), rid
        assert np.allclose(got[rid].output_token_logprobs, out.output_token_logprobs, atol=1e-5), rid
    with pytest.raises(RequestError, match="already in use"):
        at_once.add_requests(reqs()[:3] + reqs()[:1])
    assert at_once.num_queued == 0 and not at_once.has_work


def test_mixed_sampling_rows_across_batch_changes_equal_each_request_alone(model):
    """Requests with different sampling params, seeds, limits and stop tokens join and leave the batch at different
    steps (the engine keeps their rows on the device and updates them): each gets what it gets alone."""
    ps = prompts((5, 9, 4, 7, 6, 8), seed=16)
    params = [
        SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, sampling_seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=1.2, top_k=7, sampling_seed=2, stop_token_ids=list(range(0, VOCAB, 2)),
                       min_new_tokens=3),
        SamplingParams(max_new_tokens=6, temperature=1.0, min_p=0.05, sampling_seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, sampling_seed=4, stop_token_ids=list(range(1, VOCAB, 5))),
        SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=[2]),
    ]
    req = lambda i: GenerateRequest(input_ids=ps[i], sampling=params[i], rid=str(i))  # noqa: E731
    together = run(Engine(model, max_cache_tokens=1024, block_size=4), {0: [req(0), req(1)], 2: [req(2), req(3)],
                                                                        3: [req(4)], 6: [req(5)]})
    for i in range(len(ps)):
        alone = run(Engine(model, max_cache_tokens=1024, block_size=4), {0: [req(i)]})[str(i)]
        assert together[str(i)].output_ids == alone.output_ids, i
        assert together[str(i)].finish_reason == alone.finish_reason, i
        assert np.allclose(together[str(i)].output_token_logprobs, alone.output_token_logprobs, atol=1e-5), i


def test_seeded_tokens_survive_a_retract(model):
    """Draws hash the seed and the token index: a request retracted and re-prefilled mid-answer draws on as before."""
    prompt = prompts((6,), seed=17)[0]
    req = lambda: GenerateRequest(input_ids=prompt, rid="r", sampling=SamplingParams(  # noqa: E731
        max_new_tokens=10, temperature=1.0, sampling_seed=5, ignore_eos=True))
    plain = run(Engine(model, max_cache_tokens=512, block_size=4), {0: [req()]})["r"]
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    engine.add_request(req())
    for _ in range(4):
        engine.step()
    engine.pause("retract")
    engine.resume()
    assert run(engine)["r"].output_ids == plain.output_ids


def test_seeded_tokens_survive_a_step_that_fails_after_its_draw(model, monkeypatch):
    """A launch that fails after drawing its uniforms (the rows draw ahead) is rerun with the same draws."""
    ps = prompts((6, 5), seed=18)
    reqs = lambda: [GenerateRequest(input_ids=p, rid=str(i), sampling=SamplingParams(  # noqa: E731
        max_new_tokens=10, temperature=1.0, sampling_seed=5 + i, ignore_eos=True)) for i, p in enumerate(ps)]
    plain = run(Engine(model, max_cache_tokens=512, block_size=4), {0: reqs()})
    calls, finish_codes = [0], SamplingRows.finish_codes

    def fails_once(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected")
        return finish_codes(self, *args, **kwargs)

    monkeypatch.setattr(SamplingRows, "finish_codes", fails_once)
    failed = run(Engine(model, max_cache_tokens=512, block_size=4), {0: reqs()})
    assert calls[0] > 5
    for rid in plain:
        assert failed[rid].output_ids == plain[rid].output_ids, rid


def test_non_streaming_requests_get_only_their_final_output(model):
    engine = Engine(model, max_cache_tokens=512, block_size=4, seed=0)
    for rid, stream in (("s", True), ("q", False)):
        engine.add_request(GenerateRequest(input_ids=prompts((5,), seed=4)[0], rid=rid, stream=stream,
                                           sampling=SamplingParams(max_new_tokens=6, sampling_seed=1, ignore_eos=True)))
    seen = {"s": [], "q": []}
    while engine.has_work:
        for out in engine.step():
            seen[out.rid].append(out)
    assert len(seen["s"]) == 6 and [len(o.output_ids) for o in seen["s"]] == [1, 2, 3, 4, 5, 6]
    assert len(seen["q"]) == 1 and seen["q"][0].finish_reason == {"type": "length", "length": 6}
    assert seen["q"][0].output_ids == seen["s"][-1].output_ids  # same seed, same tokens


def test_stop_tokens_eos_and_min_new_tokens(model):
    prompt = prompts((6,), seed=11)[0]
    free = run(Engine(model, max_cache_tokens=512, block_size=4), {0: [GenerateRequest(input_ids=prompt, sampling=greedy(16), rid="r")]})["r"].output_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = run(Engine(model, max_cache_tokens=512, block_size=4), {0: [
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[stop_at]), rid="stop"),
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0), rid="eos"),
    ]})
    engine_eos = Engine(model, max_cache_tokens=512, block_size=4, eos_token_ids=[stop_at])
    eos = run(engine_eos, {0: [
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0), rid="eos"),
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0, min_new_tokens=first + 2), rid="min"),
    ]})
    assert out["stop"].output_ids == free[: first + 1] and out["stop"].finish_reason == {"type": "stop", "matched": stop_at}
    assert eos["eos"].output_ids == free[: first + 1] and eos["eos"].finish_reason == {"type": "stop", "matched": stop_at}
    assert stop_at not in eos["min"].output_ids[: first + 2]  # masked while under min_new_tokens
    assert len(eos["min"].output_ids) >= first + 2
    # SGLang's ignore_eos: neither EOS nor stop_token_ids end the answer, and min_new_tokens still masks them.
    ignored = run(Engine(model, max_cache_tokens=512, block_size=4, eos_token_ids=[stop_at]), {0: [
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True,
                                                                  stop_token_ids=[stop_at]), rid="ignore"),
        GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True,
                                                                  min_new_tokens=first + 2), rid="min"),
    ]})
    assert ignored["ignore"].output_ids == free and ignored["ignore"].finish_reason == {"type": "length", "length": 16}
    assert stop_at not in ignored["min"].output_ids[: first + 2] and len(ignored["min"].output_ids) == 16


def test_max_new_tokens_wins_over_min_new_tokens(model):
    engine = Engine(model, max_cache_tokens=16, block_size=4)  # 4 blocks: a runaway would outgrow its reservation
    finals = run(engine, {0: [GenerateRequest(input_ids=[1, 2, 3], sampling=greedy(4, min_new_tokens=40), rid="min"),
                              GenerateRequest(input_ids=[4, 5, 6], sampling=greedy(4), rid="other")]})
    assert len(finals["min"].output_ids) == 4 and finals["min"].finish_reason == {"type": "length", "length": 4}
    assert len(finals["other"].output_ids) == 4 and finals["other"].finish_reason == {"type": "length", "length": 4}
    assert engine.blocks.available == engine.blocks.num_blocks


def test_context_caps_generation_and_the_others_go_on(model):
    context = model.config.max_position_embeddings
    long, short = prompts((context - 3, 6), seed=14)
    alone = run(Engine(model, max_cache_tokens=1024, block_size=4), {0: [GenerateRequest(input_ids=short, sampling=greedy(12), rid="s")]})
    engine = Engine(model, max_cache_tokens=1024, block_size=4)
    finals = run(engine, {0: [GenerateRequest(input_ids=long, sampling=greedy(100, min_new_tokens=50), rid="long"),
                              GenerateRequest(input_ids=short, sampling=greedy(12), rid="s")]})
    assert len(finals["long"].output_ids) == 3 and finals["long"].finish_reason == {"type": "length", "length": 3}
    assert finals["s"].output_ids == alone["s"].output_ids
    assert engine.blocks.available == engine.blocks.num_blocks


def test_a_scheduling_failure_costs_only_its_request(model):
    ps = prompts((5, 7, 6), seed=15)
    expect = run(Engine(model, max_cache_tokens=512, block_size=4), {0: [GenerateRequest(input_ids=p, sampling=greedy(8), rid=str(i)) for i, p in enumerate(ps)]})
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    grow, failed_at = engine._grow, []

    def failing_grow(seq, rows):  # fault injection: this request's cache growth fails mid-generation, taking a block
        if seq.req.rid == "1" and seq.num_output >= 3 and rows > len(seq.blocks) * engine.block_size:
            failed_at.append(seq.num_output)
            raise RuntimeError("no block for you")
        return grow(seq, rows)

    engine._grow = failing_grow
    finals = run(engine, {0: [GenerateRequest(input_ids=p, sampling=greedy(8), rid=str(i)) for i, p in enumerate(ps)]})
    assert finals["1"].finish_reason["type"] == "abort" and "no block for you" in finals["1"].finish_reason["message"]
    assert failed_at and finals["1"].output_ids == expect["1"].output_ids[: failed_at[0]] and failed_at[0] < 8
    for rid in ("0", "2"):
        assert finals[rid].output_ids == expect[rid].output_ids and finals[rid].finish_reason["type"] == "length"
    assert engine.blocks.available == engine.blocks.num_blocks


def test_stop_strings_with_tokenizer():
    from rollout.server.protocol import response_text
    from slime_dsa.checkpoint import build_model
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer
    from slime_dsa.models import ModelConfig

    tokenizer = build_tokenizer()
    model = build_model(ModelConfig.from_dict({**TINY, **MODEL, "vocab_size": MODEL_VOCAB_SIZE, "index_topk_freq": 1}), seed=0).eval()
    prompt = tokenizer.encode("the answer is", add_special_tokens=False)
    engine = Engine(model, max_cache_tokens=512, block_size=4, tokenizer=tokenizer)
    free = run(engine, {0: [GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, skip_special_tokens=False), rid="r")]})["r"]
    text = tokenizer.decode(free.output_ids, skip_special_tokens=False)
    assert response_text(tokenizer, free, SamplingParams(skip_special_tokens=False)) == text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and stop in text
    req = lambda rid, **kw: GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop], skip_special_tokens=False, **kw), rid=rid)  # noqa: E731
    got = run(engine, {0: [req("trim"), req("keep", no_stop_trim=True)]})
    for out in got.values():
        assert out.finish_reason == {"type": "stop", "matched": stop}
        decoded = tokenizer.decode(out.output_ids, skip_special_tokens=False)
        assert stop in decoded and stop not in tokenizer.decode(out.output_ids[:-1], skip_special_tokens=False)
    # The engine leaves the text to the response: trimmed at the matched stop string unless no_stop_trim.
    assert response_text(tokenizer, got["trim"], req("trim").sampling) == text[: text.index(stop)]
    assert response_text(tokenizer, got["keep"], req("keep", no_stop_trim=True).sampling) == tokenizer.decode(
        got["keep"].output_ids, skip_special_tokens=False)


def test_skipping_stop_checks_changes_no_output(monkeypatch):
    """Tails are decoded only after tokens that may complete a stop string (stop_chars.py): every output (streamed
    ones too, in order) is what checking every step gives, with fewer tails decoded."""
    import rollout.engine.engine as engine_module
    from rollout.engine.stop_chars import StopCompleters
    from slime_dsa.checkpoint import build_model
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer
    from slime_dsa.models import ModelConfig

    tokenizer = build_tokenizer()
    model = build_model(ModelConfig.from_dict({**TINY, **MODEL, "vocab_size": MODEL_VOCAB_SIZE, "index_topk_freq": 1}), seed=0).eval()
    prompt = tokenizer.encode("the answer is", add_special_tokens=False)
    sampling = lambda i, **kw: SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=i, ignore_eos=True, **kw)  # noqa: E731
    # No EOS ids: min_new_tokens masks them even under ignore_eos, which would move the draws away from `free`'s.
    engine = Engine(model, max_cache_tokens=2048, block_size=4, tokenizer=tokenizer, eos_token_ids=[])
    free = run(engine, {0: [GenerateRequest(input_ids=prompt, sampling=sampling(i), rid=str(i)) for i in range(12)]})
    texts = [tokenizer.decode(free[str(i)].output_ids, skip_special_tokens=False) for i in range(12)]
    stops = [[t[len(t) // 2 : len(t) // 2 + 2], "</answer>"] if t[len(t) // 2 :].strip() else ["\n"] for t in texts]
    decoded = []
    match = engine_module.match_stop_strings
    monkeypatch.setattr(engine_module, "match_stop_strings", lambda stops, tails: decoded.append(len(tails)) or match(stops, tails))

    def trace():
        engine = Engine(model, max_cache_tokens=2048, block_size=4, tokenizer=tokenizer, eos_token_ids=[])
        for i in range(12):
            engine.add_request(GenerateRequest(input_ids=prompt, sampling=sampling(i, stop=stops[i], min_new_tokens=i % 3 * 3),
                                               rid=str(i), stream=i % 2 == 0))
        outputs = []
        while engine.num_running or engine.num_queued:
            outputs += [(o.rid, o.output_ids, o.output_token_logprobs, o.finish_reason) for o in engine.step()]
        return outputs

    skipping = trace()
    skipped_to = sum(decoded)
    decoded.clear()
    monkeypatch.setattr(StopCompleters, "mask", lambda self, stop_strings: None)
    assert skipping == trace()
    assert 0 < skipped_to < sum(decoded)
    assert sum(out[3] is not None and out[3]["matched"] in stops[int(out[0])] for out in skipping) >= 6


def test_a_failing_forward_costs_only_its_request(model):
    engine = Engine(model, max_cache_tokens=512, block_size=4)
    poison = 13
    forward = model.forward_packed

    def flaky(input_ids, batch, **kw):
        if bool((input_ids == poison).any()):
            raise RuntimeError("poisoned token")
        return forward(input_ids, batch, **kw)

    good = prompts((5, 8), seed=12)
    good = [[t for t in p if t != poison] or [1] for p in good]
    expect = run(Engine(model, max_cache_tokens=512, block_size=4), {0: [GenerateRequest(input_ids=p, sampling=greedy(6), rid=str(i)) for i, p in enumerate(good)]})
    model.forward_packed = flaky
    try:
        finals = run(engine, {0: [GenerateRequest(input_ids=good[0], sampling=greedy(6), rid="0")],
                              2: [GenerateRequest(input_ids=[1, poison, 2], sampling=greedy(6), rid="bad"),
                                  GenerateRequest(input_ids=good[1], sampling=greedy(6), rid="1")]})
    finally:
        del model.forward_packed
    assert finals["bad"].finish_reason["type"] == "abort" and "poisoned token" in finals["bad"].finish_reason["message"]
    for rid in ("0", "1"):
        assert finals[rid].output_ids == expect[rid].output_ids
    assert engine.blocks.available == engine.blocks.num_blocks


# ----------------------------------------------------------------------------------------------
# the overlap scheduler


def test_the_decode_plan_schedules_what_testing_every_request_would(model, monkeypatch):
    """Decode rows carried between steps (decode_plan.py) against a test of every running request each step: the same
    rows each step and the same outputs, through block boundaries (4-token blocks), token limits, sampled stop tokens,
    staggered arrivals, an abort, an in-place weight update and a retract."""
    from rollout.engine import engine as engine_module  # noqa: PLC0415

    def workload(engine):
        rng = np.random.default_rng(3)
        reqs = [GenerateRequest(input_ids=p, rid=f"r{i}", sampling=SamplingParams(
            max_new_tokens=int(rng.integers(1, 24)), temperature=1.0, sampling_seed=i,
            stop_token_ids=[7, 11])) for i, p in enumerate(prompts(rng.integers(3, 14, size=24).tolist(), seed=5))]
        arrivals = {0: reqs[:10], 3: reqs[10:16], 9: reqs[16:]}
        schedules, finals, used = [], {}, [0]
        planned_rows = engine._planned_rows

        def counted():
            rows = planned_rows()
            used[0] += rows is not None
            return rows

        engine._planned_rows = counted
        schedule = engine._schedule

        def recorded():
            scheduled = schedule()
            schedules.append([(seq.req.rid, n) for seq, n in scheduled])
            return scheduled

        engine._schedule = recorded
        for step in range(200):
            for req in arrivals.pop(step, []):
                engine.add_request(req)
            if step == 6:
                engine.abort("r3")
            if step == 12:
                engine.pause("in_place")
                engine.update_weights({}, "1")
                engine.resume()
            if step == 15:
                engine.pause("retract")
                engine.resume()
            finals.update({out.rid: (out.output_ids, out.output_token_logprobs, out.finish_reason)
                           for out in engine.step() if out.finish_reason is not None})
            if not (arrivals or engine.has_work):
                break
        return schedules, finals, used[0]

    planned = workload(Engine(model, max_cache_tokens=2048, block_size=4, seed=0, eos_token_ids=[]))
    monkeypatch.setattr(engine_module.Engine, "_planned_rows", lambda self: None)
    every = workload(Engine(model, max_cache_tokens=2048, block_size=4, seed=0, eos_token_ids=[]))
    assert planned[0] == every[0] and planned[1] == every[1] and len(planned[1]) == 24
    assert planned[2] >= 10  # steps scheduled from the plan


def test_overlap_equals_sync_with_stops_arrivals_replay_and_prefix_reuse(model):
    """The same requests with and without overlap: the same tokens, log-probs, versions, streamed states, replay rows,
    finish reasons and prefix reuse; requests that a stop token ends have their next step (already launched) dropped,
    their blocks freed. With overlap the decode steps really launch before the previous tokens reach the host."""
    if not Engine.__init__.__kwdefaults__["overlap"]:
        pytest.skip("compares both modes itself")
    ps = prompts((5, 9, 4, 7, 6), seed=21)
    params = [
        SamplingParams(max_new_tokens=11, temperature=0.9, sampling_seed=1, stop_token_ids=list(range(0, VOCAB, 9))),
        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=13, temperature=1.1, top_k=7, sampling_seed=2, min_new_tokens=3,
                       stop_token_ids=list(range(0, VOCAB, 4))),
        SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=[5]),
    ]

    def go(overlap: bool):
        engine = Engine(model, max_cache_tokens=512, block_size=4, overlap=overlap)
        fed, feed = [], engine._feed
        engine._feed = lambda *a: (fed.append(len(a[1])), feed(*a))  # noqa: E731 - counts inputs taken from the device
        picked = []  # decode steps whose block table rows come from the last one's (paged decode)
        if engine.decoder is not None:
            forward = engine.decoder.forward
            engine.decoder.forward = lambda *a, **k: (picked.append(k.get("rows_from") is not None), forward(*a, **k))[1]  # noqa: E731
        req = lambda i, rid: GenerateRequest(input_ids=ps[i], sampling=params[i], rid=rid, return_indexer_topk=True)  # noqa: E731
        streamed, finals, step = {}, {}, 0
        arrivals = {0: [req(0, "0"), req(1, "1")], 2: [req(2, "2"), req(3, "3")], 5: [req(4, "4")]}
        while arrivals or engine.has_work:
            for r in arrivals.pop(step, []):
                engine.add_request(r)
            for out in engine.step():
                streamed.setdefault(out.rid, []).append((list(out.output_ids), out.finish_reason))
                if out.finish_reason is not None:
                    finals[out.rid] = out
            step += 1
        assert engine.blocks.available == engine.blocks.num_blocks
        # A second wave: each prompt continued by its answer, so prefix reuse covers blocks registered while decoding.
        wave = {0: [GenerateRequest(input_ids=ps[i] + finals[str(i)].output_ids, sampling=greedy(3), rid=f"w{i}")
                    for i in range(len(ps))]}
        again = run(engine, wave)
        return finals, streamed, again, sum(fed), sum(picked)

    sync, sync_streamed, sync_again, sync_fed, sync_picked = go(False)
    over, over_streamed, over_again, over_fed, over_picked = go(True)
    assert sync_fed == 0 and over_fed > 20
    if Engine.__init__.__kwdefaults__["paged_decode"]:
        assert sync_picked > 0 and over_picked > 0  # requests ended while others decoded on
    assert {o.finish_reason["type"] for o in sync.values()} == {"stop", "length"}
    assert over_streamed == sync_streamed
    for rid, out in sync.items():
        got = over[rid]
        assert got.output_ids == out.output_ids and got.finish_reason == out.finish_reason, rid
        assert got.output_token_logprobs == out.output_token_logprobs and got.output_token_versions == out.output_token_versions
        assert np.array_equal(got.indexer_topk, out.indexer_topk) and got.indexer_topk_start == out.indexer_topk_start
    for rid, out in sync_again.items():
        assert over_again[rid].output_ids == out.output_ids
        assert over_again[rid].cached_tokens == out.cached_tokens > 0, rid


def _chain_workload(engine: Engine, requests: list[GenerateRequest], events: dict[int, Callable] | None = None) -> dict:
    """Step `engine` through `requests` (a third arrives at step 3) and `events` (step -> a call on the engine that
    returns final outputs); the final outputs by rid."""
    third = 2 * len(requests) // 3
    arrivals, events, finals = {0: requests[:third], 3: requests[third:]}, dict(events or {}), {}
    for step in range(500):
        for req in arrivals.pop(step, []):
            engine.add_request(req)
        if step in events:
            finals.update({out.rid: out for out in events.pop(step)(engine)})
        finals.update({out.rid: out for out in engine.step() if out.finish_reason is not None})
        if not (arrivals or events or engine.has_work):
            break
    assert engine.blocks.available == engine.blocks.num_blocks
    return finals


def test_continuous_decode_steps_equal_single_steps(model, decode_path):
    """Several decode steps a launch (num_continuous_decode_steps) against one: the same tokens, finish reasons,
    versions and replay rows (kept in the cache) and log-probs within 1e-5 (batches differ: a request that ends inside a
    launch still fills its rows until the launch ends), through block boundaries, token limits, sampled stop tokens,
    min_new_tokens, a group's forked samples, a late arrival, an abort and a retract."""
    if decode_path != "paged":
        pytest.skip("several steps a launch are paged decode steps")
    rng = np.random.default_rng(11)
    group = prompts((9,), seed=31) * 4  # one prompt's four samples (forks)
    ps = group + prompts(rng.integers(3, 14, size=14).tolist(), seed=32)
    requests = [GenerateRequest(input_ids=p, rid=f"r{i}", return_indexer_topk=i % 3 == 0, stream=False,
                                sampling=SamplingParams(max_new_tokens=int(rng.integers(1, 40)),
                                                        temperature=0.0 if i % 5 == 0 else 1.0, sampling_seed=i,
                                                        min_new_tokens=2 if i % 4 == 0 else 0,
                                                        stop_token_ids=[7] if i % 2 else []))
                for i, p in enumerate(ps)]
    aborted = max(requests, key=lambda r: r.sampling.max_new_tokens).rid

    def retract(engine: Engine) -> list:
        outputs = engine.pause("retract")
        engine.resume()
        return outputs

    events = {6: lambda e: e.abort(aborted), 9: retract}

    def go(steps: int) -> tuple[dict, Engine]:
        engine = Engine(model, max_cache_tokens=2048, block_size=4, seed=0, eos_token_ids=[], keep_indexer_topk=True,
                        num_continuous_decode_steps=steps)
        return _chain_workload(engine, [dataclasses.replace(r) for r in requests], events), engine

    single, _ = go(1)
    chained, engine = go(4)
    assert engine.stats["continued_decode_steps"] >= 6
    assert {o.finish_reason["type"] for o in single.values()} == {"stop", "length", "abort"}
    for rid, out in single.items():
        got = chained[rid]
        if rid == aborted:  # at a step call: a chained engine is further along by then
            shorter = min(len(got.output_ids), len(out.output_ids))
            assert got.finish_reason["type"] == "abort" and got.output_ids[:shorter] == out.output_ids[:shorter]
            continue
        assert got.output_ids == out.output_ids and got.finish_reason == out.finish_reason, rid
        assert got.output_token_versions == out.output_token_versions
        assert np.allclose(got.output_token_logprobs, out.output_token_logprobs, atol=1e-5), rid
        assert np.array_equal(got.indexer_topk, out.indexer_topk) and got.indexer_topk_start == out.indexer_topk_start


@settings(max_examples=int(os.environ.get("ENGINE_CHAIN_EXAMPLES", "6")), deadline=None)
@given(seed=st.integers(0, 2**16), block_size=st.sampled_from([2, 4, 8]), chain=st.integers(2, 5),
       budget=st.sampled_from([8192, 6]))
def test_random_workloads_decode_alike_in_chains_and_single_steps(model, decode_path, seed, block_size, chain, budget):
    """Random workloads (prompt lengths, groups, token limits, stop tokens, temperatures, arrivals) give the same
    outputs with `chain` decode steps a launch as with one; ENGINE_CHAIN_EXAMPLES sets the examples tried."""
    if decode_path != "paged":
        pytest.skip("several steps a launch are paged decode steps")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 12, size=int(rng.integers(1, 10))).tolist()
    ps = [p for p, copies in zip(prompts(lengths, seed=seed), rng.integers(1, 4, size=len(lengths))) for _ in
          range(copies)]  # some prompts sampled several times (forks)
    requests = [GenerateRequest(input_ids=p, rid=f"r{i}", return_indexer_topk=bool(rng.integers(2)), stream=False,
                                sampling=SamplingParams(max_new_tokens=int(rng.integers(1, 3 * chain + 4)),
                                                        temperature=float(rng.choice([0.0, 1.0])), sampling_seed=i,
                                                        min_new_tokens=int(rng.integers(0, 3)),
                                                        stop_token_ids=[int(rng.integers(VOCAB))]))
                for i, p in enumerate(ps)]

    def go(steps: int) -> dict:
        engine = Engine(model, max_cache_tokens=2048, block_size=block_size, seed=0, eos_token_ids=[],
                        keep_indexer_topk=True, max_prefill_tokens=budget, num_continuous_decode_steps=steps)
        return _chain_workload(engine, [dataclasses.replace(r) for r in requests])

    single, chained = go(1), go(chain)
    assert single.keys() == chained.keys() == {r.rid for r in requests}
    for rid, out in single.items():
        got = chained[rid]
        assert got.output_ids == out.output_ids and got.finish_reason == out.finish_reason, rid
        assert got.output_token_versions == out.output_token_versions
        assert np.allclose(got.output_token_logprobs, out.output_token_logprobs, atol=1e-5), rid
        assert np.array_equal(got.indexer_topk, out.indexer_topk) and got.indexer_topk_start == out.indexer_topk_start


def test_continuous_decode_steps_with_stop_strings_and_streams(decode_path):
    """Stop strings end a request at the step whose token completes one, inside a launch of several steps; a streaming
    request makes the engine launch one step at a time (its streamed states are those of one-step launches)."""
    if decode_path != "paged":
        pytest.skip("several steps a launch are paged decode steps")
    from slime_dsa.checkpoint import build_model
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer
    from slime_dsa.models import ModelConfig

    tokenizer = build_tokenizer()
    config = ModelConfig.from_dict({**TINY, **MODEL, "vocab_size": MODEL_VOCAB_SIZE, "index_topk_freq": 1})
    model = build_model(config, seed=0).eval()
    prompt = tokenizer.encode("the answer is", add_special_tokens=False)

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=i, ignore_eos=True, stop=["e", "th"],
                              skip_special_tokens=False)

    def go(steps: int, stream: bool) -> tuple[dict, dict]:
        engine = Engine(model, max_cache_tokens=1024, block_size=4, tokenizer=tokenizer,
                        num_continuous_decode_steps=steps)
        streamed: dict[str, list] = {}
        for i in range(8):
            engine.add_request(GenerateRequest(input_ids=prompt, sampling=sampling(i), rid=str(i),
                                               stream=stream and i == 0))
        while engine.has_work:
            for out in engine.step():
                streamed.setdefault(out.rid, []).append((list(out.output_ids), out.finish_reason))
        return streamed, engine.stats

    single, _ = go(1, False)
    chained, stats = go(3, False)
    assert {s[-1][1]["type"] for s in single.values()} >= {"stop"} and stats["continued_decode_steps"] > 0
    assert chained == single
    single_streams, _ = go(1, True)
    chained_streams, stats = go(3, True)
    assert chained_streams == single_streams and stats["continued_decode_steps"] == 0


def test_overlap_engine_drains_before_weight_update_and_abort(checkpoint, tmp_path):
    """The step in flight is read before a weight update (its tokens keep the old version) and before an abort (the
    aborted output holds it); a final output read by that drain comes with the next step."""
    model = slime_dsa.load_model(checkpoint[0]).eval()
    make_hf_checkpoint(tmp_path, seed=1, **MODEL)
    engine = Engine(model, max_cache_tokens=512, block_size=4, weight_version="1", overlap=True)
    engine.add_request(GenerateRequest(input_ids=[1, 2, 3, 4], sampling=greedy(6), rid="r"))
    engine.add_request(GenerateRequest(input_ids=[5, 6, 7], sampling=greedy(3), rid="short"))
    for _ in range(3):
        engine.step()
    assert engine._pending is not None
    engine.update_weights(slime_dsa.load_model(tmp_path).state_dict(), "2")
    assert engine._pending is None
    (done,) = engine.step()  # "short" ended in the drained step
    assert done.rid == "short" and len(done.output_ids) == 3 and done.output_token_versions == [1, 1, 1]
    engine.step()  # reads the step launched by the call before, launches the fifth
    (aborted,) = engine.abort("r")
    assert aborted.output_token_versions == [1, 1, 1, 2, 2] and aborted.finish_reason["type"] == "abort"
    assert engine.blocks.available == engine.blocks.num_blocks and not engine.has_work


# ----------------------------------------------------------------------------------------------
# asyncio wrapper


def test_async_engine_streams_cancels_and_updates(checkpoint, tmp_path):
    model = slime_dsa.load_model(checkpoint[0]).eval()
    make_hf_checkpoint(tmp_path, seed=1, **MODEL)
    ps = prompts((6, 9, 4), seed=13)
    expect_new = run(Engine(slime_dsa.load_model(tmp_path), max_cache_tokens=512, block_size=4), {0: [GenerateRequest(input_ids=ps[0], sampling=greedy(8), rid="n")]})["n"]

    async def main():
        engine = AsyncEngine(Engine(model, max_cache_tokens=512, block_size=4), model_path=str(checkpoint[0]))
        await engine.start()

        async def collect(req):
            return [out async for out in engine.generate(req)]

        streams = await asyncio.gather(*(collect(GenerateRequest(input_ids=p, sampling=greedy(10), rid=str(i))) for i, p in enumerate(ps)))
        for chunks in streams:
            assert chunks[-1].finish_reason == {"type": "length", "length": 10}
            assert all(c.finish_reason is None for c in chunks[:-1])
            lengths = [len(c.output_ids) for c in chunks]
            assert lengths == sorted(lengths) and chunks[0].output_ids == chunks[-1].output_ids[: lengths[0]]  # cumulative

        with pytest.raises(RequestError, match="input_ids"):
            await collect(GenerateRequest(input_ids=[]))

        # A consumer that goes away aborts its request.
        async def consume_two():
            async for out in engine.generate(GenerateRequest(input_ids=ps[1], sampling=greedy(400), rid="long")):
                if len(out.output_ids) >= 2:
                    break

        async def consume_forever(first_token: asyncio.Event):
            async for _ in engine.generate(GenerateRequest(input_ids=ps[2], sampling=greedy(400), rid="cancelled")):
                first_token.set()

        async def idle():
            for _ in range(200):
                if engine.num_running == 0 and engine.num_queued == 0:
                    return True
                await asyncio.sleep(0.01)
            return False

        await asyncio.create_task(consume_two())
        assert await idle()
        event = asyncio.Event()
        task = asyncio.create_task(consume_forever(event))
        await event.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await idle()

        assert await engine.flush_cache() is True
        await engine.update_weights_from_disk(tmp_path, weight_version="5")
        assert engine.weight_version == "5" and engine.model_info()["weight_version"] == "5"
        out = (await collect(GenerateRequest(input_ids=ps[0], sampling=greedy(8), rid="after")))[-1]
        assert out.output_ids == expect_new.output_ids and set(out.output_token_versions) == {5}
        with pytest.raises(RequestError, match="update_weights"):
            await engine.update_weights({"nope": torch.zeros(1)})

        await engine.pause("in_place")
        gen = asyncio.create_task(collect(GenerateRequest(input_ids=ps[2], sampling=greedy(4), rid="held")))
        await asyncio.sleep(0.1)
        assert not gen.done() and engine.num_queued == 1
        await engine.resume()
        assert (await gen)[-1].finish_reason["type"] == "length"
        info = engine.server_info()
        assert info["engine"] == "embedded" and info["max_cache_tokens"] == 512
        assert info["num_continuous_decode_steps"] == 1
        await engine.stop()
        with pytest.raises(EngineStoppedError):
            await collect(GenerateRequest(input_ids=[1, 2]))

    asyncio.run(main())


def test_async_engine_finals_add_a_call_at_once(model):
    """AsyncEngine.finals (the server's non-streaming path): the final outputs of separate generate() calls; a call
    with one refused request runs none of them; cancelling it aborts those left."""
    ps = prompts((6, 9, 4), seed=21)

    def reqs(tag, n=8):
        return [GenerateRequest(input_ids=p, sampling=greedy(n), rid=f"{tag}{i}") for i, p in enumerate(ps)]

    async def main():
        engine = AsyncEngine(Engine(model, max_cache_tokens=512, block_size=4))
        await engine.start()
        alone = [[out async for out in engine.generate(req)][-1] for req in reqs("a")]
        together = await engine.finals(reqs("b"))
        assert [(o.output_ids, o.finish_reason) for o in together] == [(o.output_ids, o.finish_reason) for o in alone]
        for a, b in zip(alone, together):  # alone and in one batch: equal up to the packed forward's batch numerics
            assert np.allclose(a.output_token_logprobs, b.output_token_logprobs, rtol=0, atol=1e-5)
        generated = engine.engine.stats["generated_tokens"]
        with pytest.raises(RequestError, match="input_ids"):
            await engine.finals(reqs("c") + [GenerateRequest(input_ids=[], rid="bad")])
        with pytest.raises(RequestError, match="already in use"):
            await engine.finals(reqs("d") + reqs("d"))
        assert await engine.finals(reqs("c", 2)) and engine.engine.stats["generated_tokens"] == generated + 6
        task = asyncio.create_task(engine.finals(reqs("e", 400)))
        while engine.engine.stats["generated_tokens"] < generated + 9:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if engine.num_running == 0 and engine.num_queued == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 0 and engine.engine.stats["generated_tokens"] < generated + 6 + 3 * 300
        await engine.stop()

    asyncio.run(main())


def test_async_engine_gathers_a_burst_of_calls_into_one_prefill(model):
    """An idle engine waits for the rest of a burst (calls arriving within gather_ms of each other) before its first
    step: 12 calls started together are prefilled in one step; gather_ms < 0 is refused."""
    ps = prompts([5 + i for i in range(12)], seed=3)

    async def main():
        engine = AsyncEngine(Engine(model, max_cache_tokens=2048, block_size=4), gather_ms=200.0)
        await engine.start()
        await engine.finals([GenerateRequest(input_ids=ps[0], sampling=greedy(1), rid="warm")])
        stats = engine.engine.stats
        steps, decode_steps, gathered = stats["steps"], stats["decode_steps"], stats["gather_s"]
        outs = await asyncio.gather(*(engine.finals([GenerateRequest(input_ids=p, sampling=greedy(3), rid=f"r{i}")])
                                      for i, p in enumerate(ps)))
        assert all(len(o[0].output_ids) == 3 for o in outs)
        assert (stats["steps"] - steps) - (stats["decode_steps"] - decode_steps) == 1  # one prefill step for all
        assert stats["gather_s"] > gathered
        await engine.stop()

    asyncio.run(main())
    with pytest.raises(ValueError, match="gather_ms"):
        AsyncEngine(Engine(model, max_cache_tokens=64, block_size=4), gather_ms=-1)


def test_a_request_while_memory_is_released_is_refused_or_waits(model):
    """After release_memory without pause, a request crashed the engine's step (IndexError on the freed KV pool) and
    came back as an abort naming it; unpaused it is now refused, paused (a colocated loop's prefetch) it waits."""
    engine = Engine(model, max_cache_tokens=256, block_size=4)
    ps = prompts([5], seed=9)
    engine.release_memory(["kv_cache"])
    with pytest.raises(RequestError, match="kv_cache.*resume_memory_occupation"):
        engine.add_request(GenerateRequest(input_ids=ps[0], sampling=greedy(3), rid="a"))
    engine.pause("in_place")
    engine.add_request(GenerateRequest(input_ids=ps[0], sampling=greedy(3), rid="b"))
    engine.resume()  # continue before the memory is back: the request waits, no step runs on the freed pool
    assert not engine.has_work and engine.step() == []
    engine.resume_memory(["kv_cache"])
    finals = run(engine)
    assert finals["b"].finish_reason == {"type": "length", "length": 3}

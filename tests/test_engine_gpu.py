"""The engine's CUDA-graph decode on a GPU (skipped without one).

Graph replays run the same kernels as the eager paged decode, so both must give the same tokens and the same
log-probs bit for bit, also after an in-place weight update (the graphs keep reading the updated buffers, the
experts' stacked copies included) and after a release / resume of the engine's memory (graphs recaptured).
The seeded draws hash on the device the same way as on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from rollout.engine import Engine, GenerateRequest, SamplingParams
from rollout.engine.warmup import warm_up_engine
from slime_dsa.checkpoint import build_model
from slime_dsa.models import ModelConfig
from tests.triton_cache import compiled_kernels, new_compiles

pytestmark = pytest.mark.gpu

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, index_topk=16, index_head_dim=32, index_n_heads=8, index_topk_freq=2,
    max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=1,
)


def _model(seed: int):
    return build_model(ModelConfig.from_dict(CONFIG), dtype=torch.bfloat16, device="cuda", seed=seed).eval()


def _requests(n: int, seed: int = 0, new_tokens: int = 24) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        prompt = torch.randint(2, CONFIG["vocab_size"], (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
        sampling = SamplingParams(max_new_tokens=new_tokens - i % 5, temperature=1.0, top_p=0.9, sampling_seed=100 + i, ignore_eos=True)
        reqs.append(GenerateRequest(input_ids=prompt, sampling=sampling, rid=str(i), return_indexer_topk=i % 2 == 0))
    return reqs


def _generate(engine: Engine, reqs: list[GenerateRequest]) -> dict:
    for req in reqs:
        engine.add_request(req)
    finals = {}
    while engine.num_running or engine.num_queued:
        for out in engine.step():
            if out.finish_reason is not None:
                finals[out.rid] = out
    return finals


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].output_ids == b[rid].output_ids, rid
        assert a[rid].output_token_logprobs == b[rid].output_token_logprobs, rid
        if a[rid].indexer_topk is not None:
            assert (a[rid].indexer_topk == b[rid].indexer_topk).all(), rid


def _engine(model, graphs: bool) -> Engine:
    return Engine(model, max_cache_tokens=8192, block_size=16, paged_decode=True, cuda_graphs=graphs, seed=0)


def test_graph_replay_equals_eager_paged_decode():
    model = _model(0)
    reqs = _requests(37)  # not a bucket size: padded rows must not leak into real ones
    graphed = _engine(model, True)
    out_graph = _generate(graphed, reqs)
    assert graphed.decoder.num_graphs > 0 and graphed.stats["paged_decode_steps"] > 10
    _assert_same(out_graph, _generate(_engine(model, False), _requests(37)))


def test_torch_compiled_engine_replays_its_eager_steps_and_decodes_as_the_plain_engine():
    """enable_torch_compile: the model's pointwise chains compiled into fused kernels, captured in the decode graphs.
    Its graph replays equal its eager steps bit for bit; against an engine without it (emulated roundings, so the
    same values but for the order of a norm's float32 sum) the greedy tokens agree and the log-probs within bf16
    noise."""
    greedy = lambda: [GenerateRequest(input_ids=r.input_ids, rid=r.rid, stream=False,  # noqa: E731
                                      sampling=SamplingParams(max_new_tokens=24, temperature=0.0))
                      for r in _requests(37)]

    def compiled(graphs: bool) -> Engine:
        return Engine(_model(0), max_cache_tokens=8192, block_size=16, cuda_graphs=graphs, seed=0,
                      enable_torch_compile=True)

    graphed = compiled(True)
    out_graph = _generate(graphed, _requests(37))
    assert graphed.decoder.num_graphs > 0 and graphed.stats["paged_decode_steps"] > 10
    _assert_same(out_graph, _generate(compiled(False), _requests(37)))
    plain, fused = _generate(_engine(_model(0), True), greedy()), _generate(compiled(True), greedy())
    agree = sum(plain[rid].output_ids == fused[rid].output_ids for rid in plain)
    assert agree >= 33, agree  # a near-tie of the greedy argmax may flip on a rounding
    first = [abs(plain[rid].output_token_logprobs[0] - fused[rid].output_token_logprobs[0]) for rid in plain]
    assert max(first) < 0.05, max(first)


def test_fp8_index_keys_graph_replay_equals_eager_paged_decode():
    """rollout.index_key_cache_dtype fp8_e4m3: the paged indexer reads 1-byte keys with their scales, in graphs too."""
    model = _model(0)

    def engine(graphs: bool) -> Engine:
        return Engine(model, max_cache_tokens=8192, block_size=16, paged_decode=True, cuda_graphs=graphs, seed=0,
                      index_key_cache_dtype="fp8_e4m3")
    graphed = engine(True)
    out_graph = _generate(graphed, _requests(37))
    assert graphed.cache.index_k.dtype == torch.float8_e4m3fn and graphed.decoder.num_graphs > 0
    _assert_same(out_graph, _generate(engine(False), _requests(37)))


def test_graphs_follow_weight_updates_and_memory_release():
    model, other = _model(0), _model(1)
    expect = _generate(_engine(other, False), _requests(20, seed=3))
    engine = _engine(model, True)
    _generate(engine, _requests(20, seed=3))  # captures graphs under the old weights
    captured = engine.decoder.num_graphs
    engine.update_weights(other.state_dict(), "1")
    _assert_same(_generate(engine, _requests(20, seed=3)), expect)
    assert engine.decoder.num_graphs == captured  # still the same graphs, reading the updated buffers
    engine.release_memory()
    engine.resume_memory()
    assert engine.decoder.num_graphs == 0
    _assert_same(_generate(engine, _requests(20, seed=3)), expect)


def test_graph_captures_are_counted_once_while_the_kv_cache_is_kept():
    """stats graph_captures / graph_capture_s (perf/engine_*): a second run with the KV cache kept captures nothing
    (cluster.engine_kv_cache_in_training keep); after a release and resume every graph is captured again."""
    engine = _engine(_model(0), True)
    _generate(engine, _requests(20, seed=3))
    first = engine.stats["graph_captures"]
    assert first == engine.decoder.num_graphs > 0 and engine.stats["graph_capture_s"] > 0
    _generate(engine, _requests(20, seed=3))
    assert engine.stats["graph_captures"] == first
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    _generate(engine, _requests(20, seed=3))
    assert engine.stats["graph_captures"] == 2 * first
    assert engine.stats["memory_release_s"] > 0 and engine.stats["memory_resume_s"] > 0


def test_the_first_step_at_a_width_captures_every_batch_size_the_engine_runs():
    """The batch shrinks as requests finish; graphs for all its buckets come with the first step at a table width,
    so a later run of another batch size at that width captures none."""
    engine = Engine(_model(0), max_cache_tokens=8192, block_size=16, paged_decode=True, cuda_graphs=True, seed=0,
                    max_running_requests=48)
    _generate(engine, _requests(20, seed=3))
    widths = {w for _, w in engine.decoder._graphs}
    assert set(engine.decoder._graphs) == {(b, w) for w in widths for b in (1, 2, 4, 8, 12, 16, 24, 32, 48)}
    captured = engine.stats["graph_captures"]
    _generate(engine, _requests(7, seed=4))
    new_widths = {w for _, w in engine.decoder._graphs} - widths
    assert engine.stats["graph_captures"] - captured == 9 * len(new_widths)  # none at the widths already seen


def test_float32_engine_decodes_without_graphs():
    """float32 on CUDA: the experts take the loop, which reads counts on the host, so no graph is captured (the
    SFT's greedy eval runs the float32 master weights); eager paged decode still gives the same tokens."""
    model = build_model(ModelConfig.from_dict(CONFIG), dtype=torch.float32, device="cuda", seed=0).eval()
    engine = _engine(model, True)
    assert not engine.decoder.use_cuda_graphs
    out = _generate(engine, _requests(9))
    assert engine.decoder.num_graphs == 0 and engine.stats["paged_decode_steps"] > 10
    _assert_same(out, _generate(_engine(model, False), _requests(9)))


def test_seeded_uniforms_are_the_same_on_cuda_and_cpu():
    """The per-request draws (splitmix64 on int64 tensors) wrap the same way on both: a seed gives the same
    tokens on a GPU engine as on a CPU one."""
    from rollout.engine.sampling import counter_uniforms, seed_to_int64

    g = torch.Generator().manual_seed(0)
    seeds = torch.tensor([seed_to_int64(s) for s in [0, -1, 2**63 - 1, -(2**63), 2**64 - 1]]
                         + torch.randint(-(2**63), 2**63 - 1, (1000,), generator=g).tolist())
    counters = torch.randint(0, 2**40, seeds.shape, generator=g)
    assert torch.equal(counter_uniforms(seeds.cuda(), counters.cuda()).cpu(), counter_uniforms(seeds, counters))


def test_overlap_scheduler_equals_the_synchronous_loop_on_cuda_graphs():
    """With overlap, each decode graph gets its input ids from the previous step's sampled tokens on the device, and
    the host reads step N while the GPU runs N+1. Lengths alone end these requests, so both loops run the same batches:
    the same tokens, log-probs and replay rows bit for bit. With stop tokens, a request's already-launched next step is
    dropped: the stop token ends its output and every block is freed."""
    model = _model(0)
    for keep in (False, True):  # replay rows from each step's copy, or from the cache pool (a side stream reads it)
        sync = _generate(Engine(model, max_cache_tokens=8192, block_size=16, seed=0, overlap=False,
                                keep_indexer_topk=keep), _requests(37))
        engine = Engine(model, max_cache_tokens=8192, block_size=16, seed=0, overlap=True, keep_indexer_topk=keep)
        fed, feed = [], engine._feed
        engine._feed = lambda *a, feed=feed, fed=fed: (fed.append(len(a[1])), feed(*a))
        _assert_same(_generate(engine, _requests(37)), sync)
        assert engine.decoder.num_graphs > 0 and len(fed) > 10 and engine.stats["decode_device_s"] > 0
    stop_ids = set(range(2, CONFIG["vocab_size"], 7)) | {CONFIG["eos_token_id"]}  # EOS ends answers too
    stopping = [GenerateRequest(input_ids=r.input_ids, rid=r.rid, sampling=SamplingParams(
        max_new_tokens=40, temperature=1.0, sampling_seed=7 + i, stop_token_ids=sorted(stop_ids)),
        return_indexer_topk=r.return_indexer_topk) for i, r in enumerate(_requests(37, seed=1))]
    finals = _generate(engine, stopping)
    stopped = [o for o in finals.values() if o.finish_reason["type"] == "stop"]
    assert len(stopped) > 10 and len(finals) == 37
    for out in finals.values():
        assert not stop_ids & set(out.output_ids[:-1]) and len(out.output_ids) == len(out.output_token_logprobs)
    assert all(o.output_ids[-1] in stop_ids for o in stopped)
    assert all(len(o.indexer_topk) == len(o.output_ids) for o in finals.values() if o.indexer_topk is not None)
    assert engine.blocks.available == engine.blocks.num_blocks


def test_continuous_decode_steps_equal_single_steps_on_cuda_graphs():
    """Several decode steps a launch (num_continuous_decode_steps) chain graph replays on the device, each fed the last
    one's sampled tokens. Requests of one length run the same batches either way: the same tokens, log-probs and kept
    replay rows bit for bit. With stop tokens and mixed lengths a request ends inside a launch: its output stops at the
    stop token, the later steps' tokens are dropped and every block is freed."""
    model = _model(0)

    def requests(seed: int, **sampling) -> list[GenerateRequest]:
        return [GenerateRequest(input_ids=r.input_ids, rid=r.rid, stream=False,
                                return_indexer_topk=r.return_indexer_topk,
                                sampling=SamplingParams(**{"temperature": 1.0, "sampling_seed": 100 + i, **sampling}))
                for i, r in enumerate(_requests(37, seed=seed))]

    def engine(steps: int) -> Engine:
        return Engine(model, max_cache_tokens=8192, block_size=16, seed=0, overlap=True, keep_indexer_topk=True,
                      num_continuous_decode_steps=steps)

    single = _generate(engine(1), requests(0, max_new_tokens=40, ignore_eos=True))
    chained_engine = engine(4)
    _assert_same(_generate(chained_engine, requests(0, max_new_tokens=40, ignore_eos=True)), single)
    assert chained_engine.stats["continued_decode_steps"] >= 20
    stop_ids = set(range(2, CONFIG["vocab_size"], 7)) | {CONFIG["eos_token_id"]}
    finals = _generate(chained_engine, requests(1, max_new_tokens=60, stop_token_ids=sorted(stop_ids)))
    stopped = [o for o in finals.values() if o.finish_reason["type"] == "stop"]
    assert len(stopped) > 10 and len(finals) == 37
    for out in finals.values():
        assert not stop_ids & set(out.output_ids[:-1]) and len(out.output_ids) == len(out.output_token_logprobs)
        assert out.indexer_topk is None or len(out.indexer_topk) == len(out.output_ids)
    assert chained_engine.blocks.available == chained_engine.blocks.num_blocks


def test_kept_replay_rows_read_at_the_end_equal_each_steps_copy():
    """With keep_indexer_topk, a request's replay rows are read from the cache pool when it ends (one contiguous block,
    copied into pinned memory on a side stream); without, each step copies its own. Same rows, same values."""
    model = _model(0)
    reqs = lambda: [r for r in _requests(37) if r.return_indexer_topk]  # noqa: E731
    per_step = _generate(Engine(model, max_cache_tokens=8192, block_size=16, seed=0), reqs())
    kept = _generate(Engine(model, max_cache_tokens=8192, block_size=16, seed=0, keep_indexer_topk=True), reqs())
    assert kept.keys() == per_step.keys() and len(kept) > 10
    for rid, out in kept.items():
        assert out.output_ids == per_step[rid].output_ids, rid
        assert out.indexer_topk.dtype == per_step[rid].indexer_topk.dtype and out.indexer_topk.flags.c_contiguous
        assert out.indexer_topk_start == per_step[rid].indexer_topk_start
        assert (out.indexer_topk == per_step[rid].indexer_topk).all(), rid


def test_after_the_warmup_a_rollout_compiles_and_captures_nothing():
    """An engine warmed up for samples of up to 64 tokens (prompts of 5-40 and 24 new tokens): a rollout of such
    requests, log-probs and top-k rows included, captures no decode graph and compiles no Triton kernel."""
    engine = Engine(_model(0), max_cache_tokens=8192, max_running_requests=64, keep_indexer_topk=True)
    assert warm_up_engine(engine, 64) > 0
    # captured in inference mode: no graph's outputs hold an autograd graph (and with it every activation)
    assert not any(graph.hidden.requires_grad for graph in engine.decoder._graphs.values())
    captures, before = engine.stats["graph_captures"], compiled_kernels()
    reqs = _requests(48)
    for req in reqs:
        req.return_logprob = True
    finals = _generate(engine, reqs)
    assert len(finals) == 48
    assert engine.stats["graph_captures"] == captures
    assert not new_compiles(before, compiled_kernels())


def test_sampling_graphs_of_each_variant_equal_eager_sampling():
    """A graphed decode step samples from a graph of its own per (batch bucket, variant): greedy, top-k, min-p, a
    temperature, stop ids under min_new_tokens, stop strings (the completer table), mixed in one batch that changes as
    requests end. Same tokens, log-probs and finish reasons as the eager engine, with and without overlap."""
    from slime_dsa.data.tokenizer import MODEL_VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(ModelConfig.from_dict({**CONFIG, "vocab_size": MODEL_VOCAB_SIZE}), dtype=torch.bfloat16,
                        device="cuda", seed=0).eval()
    variants = [dict(temperature=0.0), dict(top_k=20), dict(temperature=0.8, min_p=0.05), dict(temperature=1.3),
                dict(stop_token_ids=[5, 9, 17, 30], min_new_tokens=3), dict(stop=["e ", "a"])]

    def requests() -> list[GenerateRequest]:
        g = torch.Generator().manual_seed(5)
        out = []
        for i in range(41):
            prompt = torch.randint(2, MODEL_VOCAB_SIZE, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g)
            sampling = SamplingParams(max_new_tokens=8 + i % 13, sampling_seed=i, ignore_eos=True,
                                      skip_special_tokens=False, **variants[i % len(variants)])
            out.append(GenerateRequest(input_ids=prompt.tolist(), sampling=sampling, rid=str(i), stream=i % 7 == 0,
                                       return_logprob=True))
        return out

    def engine(graphs: bool, overlap: bool) -> Engine:
        return Engine(model, max_cache_tokens=8192, block_size=16, seed=0, cuda_graphs=graphs, overlap=overlap,
                      tokenizer=tokenizer)

    expect = _generate(engine(False, False), requests())
    assert {o.finish_reason["type"] for o in expect.values()} == {"stop", "length"}
    for overlap in (False, True):
        graphed = engine(True, overlap)
        got = _generate(graphed, requests())
        _assert_same(got, expect)
        assert all(got[rid].finish_reason == expect[rid].finish_reason for rid in expect)
        assert graphed.stats["sample_graph_captures"] == graphed.decoder.sampling.num_graphs > 2


def test_a_failed_sampling_capture_samples_eagerly_from_then_on():
    """A sampling graph that cannot be captured costs no request: that step and every later one sample eagerly."""
    model = _model(0)
    engine = _engine(model, True)

    def fail(*args, **kwargs):
        raise RuntimeError("capture failed (injected)")
    engine.decoder.sampling._capture = fail
    _assert_same(_generate(engine, _requests(37)), _generate(_engine(model, False), _requests(37)))
    assert not engine.decoder.sampling.enabled and engine.decoder.sampling.num_graphs == 0
    assert engine.decoder.num_graphs > 0  # the forwards still replay

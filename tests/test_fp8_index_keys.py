"""Engines that cache the DSA indexer keys in FP8 (rollout.index_key_cache_dtype: fp8_e4m3), on CPU.

The quantization (slime_dsa/ops/fp8_keys.py), the torch reference's scoring of FP8 keys (exactly the formula the
Triton kernels compute: the scale after the head sum), the paged cache's FP8 pools, and engines end to end: a
selection that covers every key gives the same tokens as model-dtype keys, and otherwise the engine's decode
selections are the teacher-forced selection over the same quantized keys. The kernels' own checks are in
tests/interpret_checks.py (Triton's interpreter) and tests/test_ops_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.engine import Engine, GenerateRequest, SamplingParams
from rollout.engine.defaults import INDEX_KEY_CACHE_DTYPES
from rollout.engine.engine import index_key_dtype
from rollout.engine.kv_cache import PagedKVCache
from slime_dsa import ops
from slime_dsa.checkpoint import build_model
from slime_dsa.models import ModelConfig, PackedBatch
from slime_dsa.ops import reference
from slime_dsa.ops.fp8_keys import E4M3_MAX, FP8_DTYPE, Fp8Keys, quantize_keys

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFIG = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=12,
    q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=4, index_head_dim=8,
    index_topk=5, indexer_types=["full", "shared", "full"], max_position_embeddings=256, eos_token_id=None,
)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**CONFIG), seed=0).eval()


def test_quantized_rows_keep_e4m3_precision_relative_to_their_largest_element():
    keys = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    keys[5] = 0.0
    fp8 = quantize_keys(keys.to(torch.bfloat16))
    assert fp8.values.dtype == FP8_DTYPE and fp8.scales.dtype == torch.float32 and fp8.scales.shape == (64,)
    back = fp8.dequantize()
    amax = keys.to(torch.bfloat16).float().abs().amax(-1)
    assert torch.all(fp8.values.float().abs().amax(-1)[amax > 0] == E4M3_MAX)  # each row spans e4m3's range
    # 3 mantissa bits: half a unit in the last place is 2^-4 of a value; below e4m3's normals, 2^-10 of amax
    err = (back - keys.to(torch.bfloat16).float()).abs()
    bound = torch.maximum(keys.to(torch.bfloat16).float().abs() * 2**-4, amax[:, None] / E4M3_MAX * 2**-10)
    assert torch.all(err <= bound * 1.0001)
    assert torch.equal(back[5], torch.zeros(128))


def test_fp8_keys_refuse_mismatched_parts():
    with pytest.raises(ValueError, match="float8_e4m3fn values and float32 scales"):
        Fp8Keys(torch.zeros(3, 4), torch.ones(3))
    with pytest.raises(ValueError, match="do not match"):
        Fp8Keys(torch.zeros(3, 4, dtype=FP8_DTYPE), torch.ones(4))


def exact_fp8_keys(rows: int, dim: int, seed: int) -> Fp8Keys:
    """Keys whose products are exact in float32: small-integer e4m3 values, power-of-two scales."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-6, 7, (rows, dim), generator=g).float().to(FP8_DTYPE)
    scales = 2.0 ** torch.randint(-4, 3, (rows,), generator=g).float()
    return Fp8Keys(values, scales)


def test_fp8_scores_equal_the_dequantized_keys_scores_where_the_arithmetic_is_exact():
    """The scale after the head sum (the kernels' order) equals scoring the dequantized keys, when nothing rounds:
    so the FP8 path selects what the keys it stores say."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-3, 4, (7, 4, 16), generator=g).float()
    weights = torch.randint(1, 4, (7, 4), generator=g).float()
    keys = exact_fp8_keys(40, 16, seed=2)
    plain = keys.dequantize()
    cu_q = torch.tensor([0, 3, 7])
    cu_k = torch.tensor([0, 17, 40])
    expected = reference.indexer_topk(q, plain, weights, cu_q, cu_k, 6, 0.5)
    assert torch.equal(reference.indexer_topk(q, keys, weights, cu_q, cu_k, 6, 0.5), expected)
    assert torch.equal(reference.indexer_scores(q, keys, weights, 0.5), reference.indexer_scores(q, plain, weights, 0.5))
    # Paged: the same keys behind slots, in a shuffled pool
    perm = torch.randperm(40, generator=g)
    pool = Fp8Keys(keys.values[perm], keys.scales[perm])
    where = torch.empty(40, dtype=torch.long)
    where[perm] = torch.arange(40)
    # The last query of each sequence decodes: q rows 2 and 6 see keys 0..16 and 17..39
    slots = torch.full((2, 24), 0, dtype=torch.long)
    slots[0, :17] = where[:17]
    slots[1, :23] = where[17:]
    paged = ops.indexer_topk_paged(q[[2, 6]], pool, weights[[2, 6]], slots, torch.tensor([17, 23]), 6, 0.5)
    assert torch.equal(paged, expected[[2, 6]])


def test_batch_invariant_ops_refuse_fp8_keys():
    keys = exact_fp8_keys(8, 16, seed=0)
    q, w = torch.ones(1, 4, 16), torch.ones(1, 4)
    ops.invariant.set_enabled(True)
    try:
        with pytest.raises(ValueError, match="batch-invariant ops .* not FP8"):
            ops.indexer_topk_paged(q, keys, w, torch.arange(8)[None], torch.tensor([8]), 4, 1.0)
        with pytest.raises(ValueError, match="cannot run with batch-invariant ops"):  # what an engine is built with
            index_key_dtype("fp8_e4m3")
    finally:
        ops.invariant.set_enabled(False)


def test_paged_cache_keeps_fp8_keys_and_scales(model):
    config = model.config
    cache = PagedKVCache(config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu",
                         index_key_dtype=FP8_DTYPE)
    plain = PagedKVCache(config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    assert cache.index_k.dtype == FP8_DTYPE and cache.index_k_scale.shape == (len(config.full_layer_ids), 20)
    assert cache.pool_nbytes == cache.nbytes < plain.pool_nbytes  # 1 byte + a float32 a row, against 4 bytes
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(3, config.kv_lora_rank + config.qk_rope_head_dim, generator=g)
    index_k = torch.randn(3, config.index_head_dim, generator=g)
    layer = config.full_layer_ids[-1]
    keys = cache.bind(torch.tensor([5, 6, 9]), None).update(layer, kv, index_k)[1]
    assert isinstance(keys, Fp8Keys) and torch.equal(keys.dequantize(), quantize_keys(index_k).dequantize())
    gathered = cache.bind(torch.tensor([10]), torch.tensor([9, 5, 10])).update(layer, kv[:1], index_k[:1])[1]
    assert torch.equal(gathered.values.view(torch.uint8), quantize_keys(index_k[[2, 0, 0]]).values.view(torch.uint8))
    pool = cache.bind_pool(torch.tensor([11])).update(layer, kv[:1], index_k[:1])[1]
    assert pool.values.data_ptr() == cache.index_k[cache.full_index[layer]].data_ptr()
    cache.copy_rows(torch.tensor([5]), torch.tensor([12]))
    assert torch.equal(pool.dequantize()[12], pool.dequantize()[5])
    cache.release()
    assert cache.nbytes == 0
    cache.allocate()
    assert cache.index_k.dtype == FP8_DTYPE and cache.nbytes == cache.pool_nbytes
    with pytest.raises(ValueError, match="index_key_dtype"):
        PagedKVCache(config, 4, 4, torch.float32, "cpu", index_key_dtype=torch.float16)


def generate(model, prompts, *, index_key_cache_dtype: str, paged_decode: bool, max_new_tokens: int = 12):
    engine = Engine(model, max_cache_tokens=256, block_size=4, seed=0, paged_decode=paged_decode,
                    keep_indexer_topk=True, index_key_cache_dtype=index_key_cache_dtype)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(
            input_ids=p, rid=str(i), return_indexer_topk=True, indexer_topk_start_len=0,
            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)))
    finals = {}
    while engine.num_running or engine.num_queued:
        finals.update({out.rid: out for out in engine.step() if out.finish_reason is not None})
    return engine, [finals[str(i)] for i in range(len(prompts))]


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("paged_decode", [True, False], ids=["paged", "packed"])
def test_fp8_keys_change_nothing_while_the_selection_covers_every_key(paged_decode):
    """With index_topk past every context, the indexer selects all causal keys whatever their scores."""
    wide = build_model(ModelConfig(**{**CONFIG, "index_topk": 64}), seed=0).eval()
    ps = prompts((6, 11, 3), seed=1)
    _, auto = generate(wide, ps, index_key_cache_dtype="auto", paged_decode=paged_decode)
    engine, fp8 = generate(wide, ps, index_key_cache_dtype="fp8_e4m3", paged_decode=paged_decode)
    assert engine.cache.index_k.dtype == FP8_DTYPE and bool(engine.cache.index_k_scale.any())
    from rollout.engine.async_engine import AsyncEngine

    assert AsyncEngine(engine).server_info()["index_key_cache_dtype"] == "float8_e4m3fn"
    for a, b in zip(auto, fp8):
        assert a.output_ids == b.output_ids and a.output_token_logprobs == b.output_token_logprobs


@pytest.mark.parametrize("paged_decode", [True, False], ids=["paged", "packed"])
def test_engine_selections_are_the_teacher_forced_selection_over_the_quantized_keys(model, paged_decode):
    """Every row's top-k that an FP8 engine returns (prompt rows included) equals one prefill of the whole sequence
    through an FP8 cache; and those rows replayed give the engine's log-probs. The last prompt repeats the second:
    its rows come from the other's (a fork's copied rows, or the prefix cache), FP8 values and scales alike."""
    ps = prompts((9, 14, 20), seed=2)
    ps.append(list(ps[1]))
    _, outs = generate(model, ps, index_key_cache_dtype="fp8_e4m3", paged_decode=paged_decode, max_new_tokens=15)
    for p, out in zip(ps, outs):
        ids = torch.tensor(p + out.output_ids)
        T = len(ids)
        cache = PagedKVCache(model.config, num_blocks=T // 4 + 1, block_size=4, dtype=model.dtype, device="cpu",
                             index_key_dtype=FP8_DTYPE)
        batch = PackedBatch.from_seqlens([T])
        batch.kv_cache = cache.bind(torch.arange(T), None)
        with torch.no_grad():
            forced = model.forward_packed(ids, batch, return_topk=True).topk_indices  # (n_full, T, K)
        start = out.indexer_topk_start  # rows below index_topk select every causal key: left out
        engine_rows = torch.from_numpy(np.asarray(out.indexer_topk)).long().permute(1, 0, 2)  # rows start .. T - 2
        assert start == CONFIG["index_topk"] and start + engine_rows.shape[1] == T - 1
        assert torch.equal(forced[:, start : T - 1], engine_rows)
        plain_batch = PackedBatch.from_seqlens([T])
        with torch.no_grad():
            logp, _ = model.token_logprobs(ids, plain_batch, replay_topk=forced)
        assert (logp[len(p):] - torch.tensor(out.output_token_logprobs)).abs().max().item() <= 1e-5


def test_the_engine_option_names_match_the_recipe_key():
    from typing import get_args

    from slime_dsa.config.schema import RolloutSection

    assert get_args(RolloutSection.model_fields["index_key_cache_dtype"].annotation) == INDEX_KEY_CACHE_DTYPES
    with pytest.raises(ValueError, match="index_key_cache_dtype must be one of"):
        Engine(build_model(ModelConfig(**CONFIG), seed=0), max_cache_tokens=64, index_key_cache_dtype="fp8")


def test_the_recipe_key_reaches_embedded_engines_and_is_refused_where_it_cannot_hold(tmp_path, engine_actor_kwargs):
    from slime_dsa.config import RecipeConfig
    from slime_dsa.orchestrator import setup

    minimal = {"model": {"path": "m"}, "data": {"tasks": [{"kind": "arithmetic"}]}}
    recipe = RecipeConfig.model_validate({**minimal, "rollout": {"index_key_cache_dtype": "fp8_e4m3"}})
    setup.create_engines(recipe, tmp_path, use_async=False, access=None, count=1)
    assert engine_actor_kwargs["engine_kwargs"]["index_key_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(ValueError, match="rollout.index_key_cache_dtype applies to embedded engines"):
        RecipeConfig.model_validate({**minimal, "rollout": {"index_key_cache_dtype": "fp8_e4m3", "engine": "external",
                                                            "engine_urls": ["http://127.0.0.1:1"]}})
    with pytest.raises(ValueError, match="true_on_policy.s batch-invariant ops do not"):
        RecipeConfig.model_validate({**minimal, "model": {"path": "m", "true_on_policy": True},
                                     "rollout": {"index_key_cache_dtype": "fp8_e4m3"}})
    with pytest.raises(ValueError, match="index_key_cache_dtype"):
        RecipeConfig.model_validate({**minimal, "rollout": {"index_key_cache_dtype": "fp8"}})

"""Our GLM-MoE-DSA equals transformers' GlmMoeDsaForCausalLM: logits, gradients, packing, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import slime_dsa
from slime_dsa.checkpoint import CheckpointError, save_pretrained
from slime_dsa.checkpoint.hf_format import build_model
from slime_dsa.models import ModelConfig, PackedBatch, chunked_token_logprobs, derive_indexer_types
from tests.hf_reference import TINY, make_hf_checkpoint

PARITY_CONFIGS = {
    "indexshare_freq1": dict(index_topk_freq=1),
    "indexshare_freq4_offset1": dict(num_hidden_layers=6, index_topk_freq=4, index_skip_topk_offset=1),
    "indexshare_freq4_offset2": dict(num_hidden_layers=7, index_topk_freq=4, index_skip_topk_offset=2),
    "indexshare_pattern": dict(num_hidden_layers=5, index_topk_pattern="FSFSS"),
    "moe_grouped": dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3),
    "odd_dims": dict(hidden_size=30, q_lora_rank=13, kv_lora_rank=11, qk_nope_head_dim=7, v_head_dim=5,
                     index_head_dim=9, num_attention_heads=3, intermediate_size=35, moe_intermediate_size=9),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "topk_covers_all": dict(index_topk=64),
}


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf = make_hf_checkpoint(tmp_path, **PARITY_CONFIGS[name])
    ours = slime_dsa.load_model(tmp_path).eval()
    assert ours.config.indexer_types == hf.config.indexer_types
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 23))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs logit diff {diff}"


def test_padded_batch_of_different_lengths(tmp_path):
    hf = make_hf_checkpoint(tmp_path, num_hidden_layers=6, index_topk_freq=4, index_skip_topk_offset=1)
    ours = slime_dsa.load_model(tmp_path).eval()
    lengths = [19, 7, 12]
    ids = torch.randint(0, TINY["vocab_size"], (3, 19))
    mask = torch.zeros(3, 19, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    with torch.no_grad():
        ref, got = hf(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (ref[valid] - got[valid]).abs().max().item() <= 1e-4
    # And each row alone gives the same logits as inside the batch.
    for row, n in enumerate(lengths):
        with torch.no_grad():
            alone = ours(ids[row : row + 1, :n]).logits[0]
        assert (alone - got[row, :n]).abs().max().item() <= 1e-5


def test_packed_forward_equals_separate_forwards(tmp_path):
    make_hf_checkpoint(tmp_path)
    model = slime_dsa.load_model(tmp_path).eval()
    seqs = [torch.randint(0, TINY["vocab_size"], (n,)) for n in (11, 3, 17, 1)]
    batch = PackedBatch.from_seqlens([len(s) for s in seqs])
    with torch.no_grad():
        packed = model.forward_packed(torch.cat(seqs), batch, return_topk=True)
        starts = batch.cu_seqlens_q.tolist()
        for i, seq in enumerate(seqs):
            alone = model(seq[None]).logits[0]
            assert (alone - packed.logits[starts[i] : starts[i + 1]]).abs().max().item() <= 1e-5
    # Selected keys are sequence-local and causal.
    topk = packed.topk_indices
    assert topk.shape == (len(model.config.full_layer_ids), batch.positions.numel(), model.config.index_topk)
    assert bool(((topk <= batch.positions[None, :, None]) | (topk == -1)).all())



def test_dense_attention_path_equals_the_gather_path(tmp_path, monkeypatch):
    """A top-k that covers every sequence runs dense causal attention on the torch path: same logits and gradients
    as gathering the selected rows."""
    from slime_dsa.ops import reference  # noqa: PLC0415

    make_hf_checkpoint(tmp_path, index_topk=64)
    model = slime_dsa.load_model(tmp_path, dtype=torch.float64)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,)) for n in (11, 3, 40, 1)]
    batch = PackedBatch.from_seqlens([len(s) for s in seqs])

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model.forward_packed(torch.cat(seqs), batch).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    calls, dense_attention = [], reference.dense_mla_attention
    monkeypatch.setattr(reference, "dense_mla_attention", lambda *args: calls.append(1) or dense_attention(*args))
    dense = run()
    assert len(calls) == model.config.num_hidden_layers  # every layer took the dense path
    monkeypatch.setattr(reference, "selects_all_causal", lambda indices, cu_seqlens: False)
    gathered = run()
    torch.testing.assert_close(dense[0], gathered[0], rtol=1e-10, atol=1e-12)
    assert len(dense[1]) == len(gathered[1])
    for got, want in zip(dense[1], gathered[1]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

def test_gradients_match_transformers_and_float64(tmp_path):
    hf = make_hf_checkpoint(tmp_path, num_hidden_layers=3, n_group=2, topk_group=1)
    ours = slime_dsa.load_model(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (2, 13))

    def loss_of(model, dtype=torch.float32):
        logits = model(ids).logits.to(dtype)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    loss_of(hf).backward()
    loss_of(ours).backward()
    ours64 = slime_dsa.load_model(tmp_path, dtype=torch.float64)
    loss_of(ours64, torch.float64).backward()
    hf_grads = _per_expert_grads(hf)
    checked = 0
    for name, p in ours.named_parameters():
        if p.grad is None:
            # Top-k selection is discrete, and an expert no token was routed to gets nothing.
            assert "indexer" in name or ".experts." in name, f"{name} got no gradient"
            continue
        assert torch.isfinite(p.grad).all(), name
        ref64 = dict(ours64.named_parameters())[name].grad
        scale = ref64.abs().max().item() + 1e-12
        assert (p.grad.double() - ref64).abs().max().item() <= 1e-4 * max(scale, 1.0), name
        assert torch.allclose(p.grad, hf_grads[name], atol=1e-5, rtol=1e-4), name
        checked += 1
    assert checked > 20


def _per_expert_grads(hf) -> dict[str, torch.Tensor]:
    """HF keeps experts fused in memory (gate_up_proj (E, 2I, D)); split its grads into checkpoint names."""
    grads = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("experts.gate_up_proj"):
            for e, g in enumerate(p.grad):
                gate, up = g.chunk(2, dim=0)
                grads[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                grads[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e, g in enumerate(p.grad):
                grads[name.replace("down_proj", f"{e}.down_proj.weight")] = g
        else:
            grads[name] = p.grad
    return grads


def test_activation_checkpointing_gives_same_gradients(tmp_path):
    make_hf_checkpoint(tmp_path, num_hidden_layers=2)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9))
    grads = []
    for ckpt in (False, True):
        model = slime_dsa.load_model(tmp_path)
        model.gradient_checkpointing = ckpt
        model(ids).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_log_softmax(temperature, recompute, monkeypatch):
    """Kept logits blocks and blocks recomputed in backward (activation checkpointing) give the same values."""
    from slime_dsa.models import logprobs  # noqa: PLC0415

    monkeypatch.setattr(logprobs, "KEEP_LOGITS_ELEMENTS", 0 if recompute else 1 << 20)
    monkeypatch.setattr(logprobs, "KEEP_CALL_LOGITS_ELEMENTS", 0 if recompute else 1 << 24)
    torch.manual_seed(0)
    hidden = torch.randn(37, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    logp, ent = chunked_token_logprobs(hidden, weight, targets, temperature, chunk_size=5, return_entropy=True)
    full = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    ref = full.gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(logp, ref, atol=1e-6)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)
    g1 = torch.autograd.grad(logp.sum(), (hidden, weight))
    g2 = torch.autograd.grad(ref.sum(), (hidden, weight))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_small_vocabulary_takes_more_rows_a_chunk_on_a_gpu(monkeypatch, device):
    """On a GPU, chunk_size rows a chunk or as many as CHUNK_LOGITS_ELEMENTS logits hold where the vocabulary is
    small: the same values from fewer chunks (each costs a dozen kernel launches each way). On a CPU chunk_size rows
    (below). "meta" runs the rule's arithmetic without values."""
    from slime_dsa.models import logprobs  # noqa: PLC0415

    torch.manual_seed(0)
    hidden, weight, targets = (t.to(device) for t in (torch.randn(37, 8), torch.randn(50, 8),
                                                      torch.randint(0, 50, (37,))))
    chunks = []
    real_chunk = logprobs._chunk
    monkeypatch.setattr(logprobs, "_chunk", lambda h, *rest: chunks.append(len(h)) or real_chunk(h, *rest))
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS_ELEMENTS", 50 * 16)
    widened = chunked_token_logprobs(hidden, weight, targets, chunk_size=5)[0]
    assert chunks == [16, 16, 5]
    chunks.clear()
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS_ELEMENTS", 0)
    narrow = chunked_token_logprobs(hidden, weight, targets, chunk_size=5)[0]
    assert chunks == [5] * 7 + [2]
    if device != "meta":
        torch.testing.assert_close(narrow, widened, rtol=0, atol=1e-6)


def test_a_cpu_keeps_chunk_size_rows_a_chunk(monkeypatch):
    from slime_dsa.models import logprobs  # noqa: PLC0415

    chunks = []
    real_chunk = logprobs._chunk
    monkeypatch.setattr(logprobs, "_chunk", lambda h, *rest: chunks.append(len(h)) or real_chunk(h, *rest))
    chunked_token_logprobs(torch.randn(37, 8), torch.randn(50, 8), torch.randint(0, 50, (37,)), chunk_size=5)
    assert chunks == [5] * 7 + [2]


def test_model_token_logprobs_match_full_logits(tmp_path):
    make_hf_checkpoint(tmp_path)
    model = slime_dsa.load_model(tmp_path).eval()
    seqs = [torch.randint(0, TINY["vocab_size"], (n,)) for n in (6, 9)]
    batch = PackedBatch.from_seqlens([6, 9])
    ids = torch.cat(seqs)
    with torch.no_grad():
        logp, _ = model.token_logprobs(ids, batch, chunk_size=4)
        for i, seq in enumerate(seqs):
            full = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
            ref = torch.cat([torch.zeros(1), full[:-1].gather(1, seq[1:, None]).squeeze(1)])
            start = batch.cu_seqlens_q[i]
            assert torch.allclose(logp[start : start + len(seq)], ref, atol=1e-5)


def test_round_trip_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_dict({**TINY, "num_hidden_layers": 5, "index_topk_freq": 2})
    ours = build_model(config, seed=3).eval()
    for shard_bytes, sub in ((10**9, "single"), (20_000, "sharded")):
        save_pretrained(ours, tmp_path / sub, max_shard_bytes=shard_bytes)
        hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / sub, output_loading_info=True, attn_implementation="eager")
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        ids = torch.randint(0, TINY["vocab_size"], (2, 15))
        with torch.no_grad():
            assert (hf.float()(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4
        again = slime_dsa.load_model(tmp_path / sub)
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()


def test_mtp_layer_saves_and_loads(tmp_path):
    config = ModelConfig.from_dict({**TINY, "num_nextn_predict_layers": 1})
    model = build_model(config, seed=0).eval()
    names = [n for n in model.state_dict() if n.startswith(f"model.layers.{TINY['num_hidden_layers']}.")]
    assert any("eh_proj" in n for n in names) and any("shared_head.norm" in n for n in names)
    save_pretrained(model, tmp_path)
    again = slime_dsa.load_model(tmp_path).eval()
    ids = torch.randint(0, TINY["vocab_size"], (10,))
    with torch.no_grad():
        a = model.forward_packed(ids, PackedBatch.from_seqlens([10]), return_mtp=True)
        b = again.forward_packed(ids, PackedBatch.from_seqlens([10]), return_mtp=True)
    assert len(a.mtp_hidden) == 1 and torch.allclose(a.mtp_hidden[0], b.mtp_hidden[0], atol=1e-5)


def test_checkpoint_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    name = "model.layers.0.self_attn.o_proj.weight"
    bad = dict(state)
    bad[name] = torch.zeros(3, 3)
    save_file(bad, file)
    with pytest.raises(CheckpointError, match=r"o_proj.weight has shape \(3, 3\).*expects \(32, 48\)"):
        slime_dsa.load_model(tmp_path)
    del bad[name]
    save_file(bad, file)
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.self_attn.o_proj.weight"):
        slime_dsa.load_model(tmp_path)
    bad = dict(state)
    bad["model.layers.0.surprise"] = torch.zeros(2)
    save_file(bad, file)
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.surprise"):
        slime_dsa.load_model(tmp_path)
    file.unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never loaded"):
        slime_dsa.load_model(tmp_path)


@pytest.mark.parametrize("layers,freq,offset", [(8, 1, 2), (8, 4, 2), (9, 4, 1), (12, 3, 0), (6, 2, 5)])
def test_indexer_types_derived_as_transformers_does(layers, freq, offset):
    from transformers import GlmMoeDsaConfig

    ref = GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset).indexer_types
    assert derive_indexer_types(layers, freq, offset) == ref
    raw = json.loads(GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset).to_json_string())
    raw.pop("indexer_types")
    if ref[0] == "shared":  # transformers accepts it and fails at the first forward; we fail at load
        with pytest.raises(ValueError, match="indexer_types"):
            ModelConfig.from_dict(raw)
    else:
        assert ModelConfig.from_dict(raw).indexer_types == ref


def test_bfloat16_keeps_router_and_indexer_head_in_float32(tmp_path):
    make_hf_checkpoint(tmp_path)
    model = slime_dsa.load_model(tmp_path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    logits = model(torch.randint(0, TINY["vocab_size"], (1, 8))).logits
    assert torch.isfinite(logits.float()).all()


def test_bfloat16_holds_the_router_as_transformers_does(tmp_path):
    """Loaded in bf16 from a float32 checkpoint, transformers holds the router weight and selection bias in float32
    with the file's values (_keep_in_fp32_modules_strict), and so do we. Its indexer head it rounds to bf16 (its
    _keep_in_fp32_modules applies to float16 only, transformers 5.x); we keep that in float32 with the file's values
    too, in every path (engine, FSDP2, the bf16 copy, Megatron), so there ours and transformers' bf16 differ."""
    from transformers import AutoModelForCausalLM

    from slime_dsa.checkpoint.hf_format import read_state_dict

    make_hf_checkpoint(tmp_path)
    saved = read_state_dict(tmp_path)
    ours = slime_dsa.load_model(tmp_path, dtype="bfloat16").state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    routers = [n for n in saved if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))]
    heads = [n for n in saved if n.endswith("indexer.weights_proj.weight")]
    assert routers and heads and not torch.equal(saved[routers[0]], saved[routers[0]].bfloat16().float())
    for name in routers:
        assert ours[name].dtype == theirs[name].dtype == torch.float32, name
        assert torch.equal(ours[name], saved[name]) and torch.equal(theirs[name], saved[name]), name
    for name in heads:
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], saved[name]), name
        assert theirs[name].dtype == torch.bfloat16, name

"""The DSA indexer loss (docs/algorithms.md section 6): equal to a direct, unchunked transcription of the formula, in
the dense and the sparse stage; its gradient reaches only indexer parameters; recall and overlap metrics; a short
dense warm-up that lowers the loss. CPU, float64, a tiny model with IndexShare groups of 1, 2 and 3 layers.
"""

from __future__ import annotations

import pytest
import torch

from slime_dsa.algorithms.indexer_loss import (
    dsa_indexer_loss,
    group_recall,
    indexer_kl_loss,
    indexshare_groups,
    topk_overlap,
)
from slime_dsa.checkpoint import build_model
from slime_dsa.models import ModelConfig, PackedBatch
from slime_dsa.ops import reference
from slime_dsa.ops.reference import indexer_scores

CONFIG = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=6,
    num_attention_heads=3, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=12,
    q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=4, index_head_dim=8,
    index_topk=5, indexer_types=["full", "shared", "shared", "full", "full", "shared"], max_position_embeddings=256,
    eos_token_id=None,
)
SEQLENS = [13, 9]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(ModelConfig(**CONFIG), seed=0).double()


def forward(model, index_topk=None):
    batch = PackedBatch.from_seqlens(SEQLENS)
    ids = torch.randint(0, CONFIG["vocab_size"], (sum(SEQLENS),), generator=torch.Generator().manual_seed(1))
    out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False, index_topk=index_topk)
    return out, batch


def direct_loss(capture, batch, stage, indexer_types, target="group"):
    """docs/algorithms.md section 6 written out query by query: no chunks, no helpers shared with the code under test."""
    by_layer = {c["layer"]: c for c in capture}
    per_group = []
    for full, members in indexshare_groups(indexer_types).items():
        members = members if target == "group" else [full]
        c = by_layer[full]
        kl_rows = []
        for s in range(len(batch.cu_seqlens_q) - 1):
            k0, k1 = int(batch.cu_seqlens_k[s]), int(batch.cu_seqlens_k[s + 1])
            for t in range(k0, k1):
                keys = torch.arange(k0, t + 1) if stage == "dense" else c["rows"][t][c["rows"][t] >= 0]
                p_bar = 0
                for m in members:
                    L = by_layer[m]
                    scores = torch.einsum("hd,kd->hk", L["q"][t].double(), L["kv"][keys].double()) * L["scale"]
                    p = torch.softmax(scores, dim=-1).sum(0)
                    p_bar = p_bar + p / p.sum()
                p_bar = p_bar / len(members)
                index = indexer_scores(c["index_q"][t : t + 1].double(), c["index_k"][keys].double(),
                                       c["index_weights"][t : t + 1].double(), c["index_scale"])[0]
                log_q = torch.log_softmax(index, dim=-1)
                kl_rows.append((p_bar * (p_bar.log() - log_q)).sum())
        per_group.append(torch.stack(kl_rows))
    return torch.stack(per_group).mean(0).sum()


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_loss_equals_direct_formula_and_grads_reach_only_indexers(model, stage):
    model.zero_grad(set_to_none=True)
    out, batch = forward(model, index_topk=64 if stage == "dense" else None)
    types = model.config.indexer_types
    res = dsa_indexer_loss(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, stage=stage)
    with torch.no_grad():
        ref = direct_loss(out.dsa_layers, batch, stage, types)
    assert abs(res.loss_sum.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert res.num_rows == sum(SEQLENS)
    assert sorted(res.metrics) == ["indexer_kl/0", "indexer_kl/3", "indexer_kl/4"]
    res.loss_sum.backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None, name
        else:
            assert p.grad is None or p.grad.abs().max() == 0, f"{name} got a gradient from the indexer loss"
    # Every indexer tensor that shapes the scores learns.
    for layer in model.config.full_layer_ids:
        ix = model.model.layers[layer].self_attn.indexer
        assert ix.wq_b.weight.grad.abs().sum() > 0 and ix.wk.weight.grad.abs().sum() > 0
        assert ix.weights_proj.weight.grad.abs().sum() > 0


def test_chunking_and_lse_do_not_change_the_loss(model, monkeypatch):
    out, batch = forward(model)
    c = {x["layer"]: x for x in out.dsa_layers}
    args = (c[0]["index_q"], c[0]["index_k"], c[0]["index_weights"], c[0]["index_scale"],
            [c[i]["q"] for i in (0, 1, 2)], [c[i]["kv"] for i in (0, 1, 2)])
    with torch.no_grad():
        whole = indexer_kl_loss(*args, [c[i]["lse"] for i in (0, 1, 2)], c[0]["scale"], batch.cu_seqlens_q,
                                batch.cu_seqlens_k, rows=c[0]["rows"])
        monkeypatch.setattr(reference, "QUERY_CHUNK", 3)
        chunked = indexer_kl_loss(*args, None, c[0]["scale"], batch.cu_seqlens_q, batch.cu_seqlens_k,
                                  rows=c[0]["rows"])
    assert whole.shape == (sum(SEQLENS),) and (whole >= -1e-12).all()
    assert torch.allclose(whole, chunked, atol=1e-10)


def test_own_target_differs_from_group_mean(model):
    out, batch = forward(model)
    types = model.config.indexer_types
    with torch.no_grad():
        group = dsa_indexer_loss(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, target="group")
        own = dsa_indexer_loss(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, target="own")
        ref = direct_loss(out.dsa_layers, batch, "sparse", types, target="own")
    assert abs(own.loss_sum.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    assert group.metrics["indexer_kl/4"] != own.metrics["indexer_kl/4"]  # group {4, 5} vs layer 4 alone
    assert group.metrics["indexer_kl/3"] == own.metrics["indexer_kl/3"]  # a group of one is its own layer


def test_recall_and_overlap(model):
    out, batch = forward(model)
    types = model.config.indexer_types
    recall = group_recall(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, per_layer=True)
    assert set(recall) == {"recall/0", "recall/3", "recall/4"} | {f"recall_layer/{i}" for i in range(6)}
    for value in recall.values():
        assert ((value > 0) & (value <= 1 + 1e-9)).all()
    # Rows with at most index_topk causal keys keep all of their attention.
    pos = batch.positions
    assert torch.allclose(recall["recall/0"][pos < CONFIG["index_topk"]], torch.ones(1, dtype=torch.float64))
    # Selecting every causal key gives recall 1 everywhere.
    dense, _ = forward(model, index_topk=64)
    rows = {x["layer"]: x["rows"] for x in dense.dsa_layers if x["layer"] in (0, 3, 4)}
    full = group_recall(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, selected=rows)
    assert all(torch.allclose(v, torch.ones_like(v)) for v in full.values())
    a = torch.tensor([[0, 3, 5, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[5, 7, 0, 1], [0, 1, 2, 3]])
    assert topk_overlap(a, b).tolist() == pytest.approx([2 / 3, 1.0])


def test_dense_warmup_steps_lower_the_loss():
    """Training only the indexers against the dense attention lowers the KL and raises recall (a few Adam steps)."""
    from slime_dsa.indexer.warmup import freeze_all_but_indexers, reinit_indexers  # noqa: PLC0415

    model = build_model(ModelConfig(**CONFIG), seed=0)
    reinit_indexers(model, seed=3)
    params = freeze_all_but_indexers(model)
    opt = torch.optim.Adam(params, lr=1e-2)
    batch = PackedBatch.from_seqlens(SEQLENS)
    ids = torch.randint(0, CONFIG["vocab_size"], (sum(SEQLENS),), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(15):
        out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False, index_topk=64)
        res = dsa_indexer_loss(out.dsa_layers, model.config.indexer_types, batch.cu_seqlens_q, batch.cu_seqlens_k,
                               stage="dense")
        loss = res.loss_sum / res.num_rows
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses

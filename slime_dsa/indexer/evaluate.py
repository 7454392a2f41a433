"""How good a model's indexers are: recall of their top-k against the dense attention, and the LM loss with them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime_dsa import ops
from slime_dsa.algorithms.indexer_loss import dsa_indexer_loss, group_recall, indexshare_groups
from slime_dsa.models import GlmMoeDsaForCausalLM, PackedBatch


def indexer_selection(capture: list[dict], batch: PackedBatch, topk: int) -> dict[int, torch.Tensor]:
    """{full layer: (T, topk) global key rows} the captured indexer tensors select at `topk`."""
    out = {}
    for c in capture:
        if c["index_q"] is not None:
            local = ops.indexer_topk(c["index_q"].detach(), c["index_k"].detach(), c["index_weights"].detach(),
                                     batch.cu_seqlens_q, batch.cu_seqlens_k, topk, c["index_scale"])
            out[c["layer"]] = batch.to_rows(local)
    return out


def lm_loss(model: GlmMoeDsaForCausalLM, ids: torch.Tensor, batch: PackedBatch, index_topk: int | None) -> float:
    """Mean next-token NLL of a packed batch (every token after each sequence's first) at the given top-k."""
    logp, _ = model.token_logprobs(ids, batch, index_topk=index_topk)
    keep = torch.ones_like(logp, dtype=torch.bool)
    keep[batch.cu_seqlens_q[:-1]] = False
    return float(-logp[keep].mean())


@torch.no_grad()
def evaluate_indexers(
    model: GlmMoeDsaForCausalLM, sequences: Sequence[torch.Tensor], topk: int, dense_topk: int, target: str = "group",
) -> dict[str, float]:
    """Recall at `topk` (mean over query rows; per group and per shared layer), dense-stage KL, and LM losses.

    Keys: recall (mean over groups), recall/<full layer>, recall_shared (the selection against each shared layer's
    own attention, averaged over shared layers), indexer_kl, lm_loss_sparse (DSA at topk), lm_loss_dense.
    """
    ids = torch.cat(list(sequences)).to(model.device)
    batch = PackedBatch.from_seqlens([len(s) for s in sequences], model.device)
    out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False, index_topk=dense_topk)
    types = model.config.indexer_types
    selected = indexer_selection(out.dsa_layers, batch, topk)
    recalls = group_recall(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, selected, per_layer=True)
    kl = dsa_indexer_loss(out.dsa_layers, types, batch.cu_seqlens_q, batch.cu_seqlens_k, stage="dense", target=target)
    metrics = {k: float(v.float().mean()) for k, v in recalls.items()}
    groups = indexshare_groups(types)
    metrics["recall"] = sum(metrics[f"recall/{g}"] for g in groups) / len(groups)
    shared = [m for g, members in groups.items() for m in members if m != g]
    if shared:
        metrics["recall_shared"] = sum(metrics[f"recall_layer/{m}"] for m in shared) / len(shared)
    metrics["indexer_kl"] = float(kl.loss_sum) / kl.num_rows
    metrics["lm_loss_sparse"] = lm_loss(model, ids, batch, topk)
    metrics["lm_loss_dense"] = lm_loss(model, ids, batch, dense_topk)
    return metrics

"""DSA indexer training against the attention of its IndexShare group (docs/algorithms.md section 6), as pure functions.

For a full layer l with group G_l (l and the shared layers that reuse its top-k), the target at query t is
  p_bar[t] = mean over l' in G_l of L1-normalise(sum over heads of softmax(attn_scale * q[t] . kv[s]))
over a key set (every causal key: dense stage; the selected rows: sparse stage), and the loss per query is
  KL(p_bar[t] || softmax(I[t])) on that key set, I = the indexer scores (`slime_dsa.ops.reference.indexer_scores`).
Everything is chunked over queries: at most (chunk, heads, keys) is alive, never (heads, T, T). The target runs
without gradient; only index_q / index_k / index_weights receive one.

Shapes: Tq query rows, Tk key rows (packed by cu_seqlens_k; queries are the last rows of their sequence), H heads,
Hi indexer heads, W keys of one chunk's key set. `rows` are global key rows, -1 unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from slime_dsa import ops

QUERY_CHUNK = 256
Stage = Literal["dense", "sparse"]
Target = Literal["group", "own"]


def indexshare_groups(indexer_types: Sequence[str]) -> dict[int, list[int]]:
    """{full layer: [that layer, then every shared layer that reuses its top-k]} (transformers' IndexShare rule)."""
    groups: dict[int, list[int]] = {}
    owner = None
    for layer, kind in enumerate(indexer_types):
        if kind == "full":
            owner = layer
            groups[layer] = []
        if owner is None:
            raise ValueError(f"indexer_types[{layer}] is 'shared' with no preceding 'full' layer")
        groups[owner].append(layer)
    return groups


def _query_positions(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first key row of each query's sequence, its sequence-local position), bottom-right aligned."""
    lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    seq_id = torch.repeat_interleave(torch.arange(len(lens_q), device=lens_q.device), lens_q)
    row_in_seq = torch.arange(int(cu_seqlens_q[-1]), device=lens_q.device) - cu_seqlens_q[seq_id]
    return cu_seqlens_k[seq_id], (lens_k - lens_q)[seq_id] + row_in_seq


def _chunk_rows(c0: int, c1: int, rows: torch.Tensor | None, key_start: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Key rows (C, W) of queries c0:c1: `rows` if given, else every causal key of the query's sequence."""
    if rows is not None:
        return rows[c0:c1]
    cols = torch.arange(int(pos[c0:c1].max()) + 1, device=pos.device)
    return torch.where(cols <= pos[c0:c1, None], key_start[c0:c1, None] + cols, -1)


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.no_grad()
def _group_target(
    attn_q: Sequence[torch.Tensor], attn_kv: Sequence[torch.Tensor], attn_lse: Sequence[torch.Tensor | None] | None,
    attn_scale: float, c0: int, c1: int, rows: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype,
) -> torch.Tensor:
    """p_bar (C, W) over one chunk's key rows: mean of the layers' head-summed, L1-normalised attention."""
    target = torch.zeros(rows.shape, dtype=dtype, device=rows.device)
    for g in range(len(attn_q)):
        s = torch.einsum("chd,cwd->chw", attn_q[g][c0:c1].to(dtype), attn_kv[g][rows].to(dtype)) * attn_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))  # (C, H, W)
        lse = None if attn_lse is None else attn_lse[g]
        lse = torch.logsumexp(s, dim=-1) if lse is None else lse[c0:c1].to(dtype)  # (C, H)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0).sum(1)  # (C, W)
        target += p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return target / len(attn_q)


def indexer_kl_loss(*args, **kwargs) -> torch.Tensor:
    """Per-query KL(p_bar || softmax(I)) of one IndexShare group: `slime_dsa.ops.indexer_kl_loss` (torch reference
    or the fused Triton kernel, one contract; see `slime_dsa.ops.reference.indexer_kl_loss`)."""
    return ops.indexer_kl_loss(*args, **kwargs)


@torch.no_grad()
def attention_recall(
    attn_q: Sequence[torch.Tensor],
    attn_kv: Sequence[torch.Tensor],
    attn_scale: float,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    selected_rows: torch.Tensor,
    chunk_size: int = QUERY_CHUNK,
) -> torch.Tensor:
    """Per-query share of the dense p_bar's mass that falls on `selected_rows` (Tq, K) global rows -> (Tq,).

    p_bar is the group mean over all causal keys (the attention a dense model would use); 1 = the selection keeps
    all of it. A single layer in attn_q gives that layer's own recall.
    """
    dtype = _acc(attn_q[0])
    key_start, pos = _query_positions(cu_seqlens_q, cu_seqlens_k)
    out = []
    for c0 in range(0, attn_q[0].shape[0], chunk_size):
        c1 = min(c0 + chunk_size, attn_q[0].shape[0])
        r = _chunk_rows(c0, c1, None, key_start, pos)  # (C, W) dense causal rows
        valid = r >= 0
        target = _group_target(attn_q, attn_kv, None, attn_scale, c0, c1, r.clamp(min=0), valid, dtype)
        sel = selected_rows[c0:c1]  # (C, K)
        local = torch.where(sel >= 0, sel - key_start[c0:c1, None], 0)
        mass = target.gather(1, local.clamp(max=target.shape[1] - 1)) * (sel >= 0)
        out.append(mass.sum(-1))
    return torch.cat(out) if out else attn_q[0].new_zeros(0, dtype=dtype)


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row share of a's selected keys (entries >= 0) that b selects too: (..., K) x (..., K) -> (...,).

    Rows where a selects nothing count as full overlap. 1 - overlap is the selection mismatch.
    """
    valid = a >= 0
    big = torch.iinfo(b.dtype).max
    b_sorted = torch.where(b >= 0, b, big).sort(dim=-1).values.contiguous()  # membership by binary search:
    at = torch.searchsorted(b_sorted, a.contiguous()).clamp(max=b.shape[-1] - 1)  # O(K log K), not K x K
    hit = (b_sorted.gather(-1, at) == a) & valid
    return torch.where(valid.any(-1), hit.sum(-1) / valid.sum(-1).clamp(min=1), torch.ones_like(hit[..., 0], dtype=torch.float32))


@dataclass
class IndexerLossOutput:
    """Sum over query rows of the mean-over-groups KL (scalar, with grad), and per-group detached metrics (0-dim
    tensors on the loss's device: reading them is the caller's one host sync, not one per group)."""

    loss_sum: torch.Tensor
    num_rows: int
    metrics: dict[str, torch.Tensor]


def dsa_indexer_loss(
    capture: list[dict],
    indexer_types: Sequence[str],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    stage: Stage = "sparse",
    target: Target = "group",
    lse_matches_stage: bool = True,
    row_mask: torch.Tensor | None = None,
) -> IndexerLossOutput:
    """The indexer loss of a whole model from `forward_packed(capture_dsa=True)`'s per-layer tensors.

    stage dense: every causal key; sparse: the rows each group attended to. target group: p_bar over the whole
    IndexShare group; own: the full layer's attention only (Megatron's choice, kept for comparison).
    lse_matches_stage: the captured lse is over the stage's key set (sparse stage; or a dense forward in the dense
    stage), else it is recomputed. row_mask (Tq,) selects the query rows that count (default: all).
    Metrics per group g (its full layer's id): indexer_kl/g, the KL summed over counted rows (callers normalise).
    """
    by_layer = {c["layer"]: c for c in capture}
    losses, metrics = [], {}
    mask = None if row_mask is None else row_mask.bool()
    for full, members in indexshare_groups(indexer_types).items():
        if full not in by_layer:
            continue
        layers = [by_layer[m] for m in (members if target == "group" else [full])]
        c = by_layer[full]
        kl = ops.indexer_kl_loss(
            c["index_q"], c["index_k"], c["index_weights"], c["index_scale"],
            [x["q"] for x in layers], [x["kv"] for x in layers],
            [x["lse"] for x in layers] if lse_matches_stage else None, c["scale"],
            cu_seqlens_q, cu_seqlens_k, rows=c["rows"] if stage == "sparse" else None,
        )
        if mask is not None:
            kl = kl[mask]
        losses.append(kl)
        metrics[f"indexer_kl/{full}"] = kl.detach().sum()
    if not losses:
        raise ValueError("dsa_indexer_loss: the capture holds no full layer; run forward_packed(capture_dsa=True)")
    per_row = torch.stack(losses).mean(0)  # (rows,) mean over groups
    return IndexerLossOutput(loss_sum=per_row.sum(), num_rows=per_row.numel(), metrics=metrics)


@torch.no_grad()
def group_recall(
    capture: list[dict],
    indexer_types: Sequence[str],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    selected: dict[int, torch.Tensor] | None = None,
    per_layer: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-query recall of each group's selection: {"recall/<full layer>": (Tq,)} against the group's dense p_bar.

    selected {full layer: (Tq, K) global rows} overrides the captured rows (e.g. a top-k at another K).
    per_layer adds "recall_layer/<layer>": the selection against each member layer's own attention.
    """
    by_layer = {c["layer"]: c for c in capture}
    out = {}
    for full, members in indexshare_groups(indexer_types).items():
        if full not in by_layer:
            continue
        rows = selected[full] if selected is not None else by_layer[full]["rows"]
        layers = [by_layer[m] for m in members]
        scale = by_layer[full]["scale"]
        out[f"recall/{full}"] = attention_recall([x["q"] for x in layers], [x["kv"] for x in layers], scale,
                                                 cu_seqlens_q, cu_seqlens_k, rows)
        if per_layer:
            for m in members:
                out[f"recall_layer/{m}"] = attention_recall([by_layer[m]["q"]], [by_layer[m]["kv"]], scale,
                                                            cu_seqlens_q, cu_seqlens_k, rows)
    return out

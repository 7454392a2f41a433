"""Torch reference of the DSA ops: exact, chunked over queries, runs anywhere. The ground truth for kernels.

Conventions shared by every backend (see slime_dsa/ops/__init__.py):
- Packed varlen batches: sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] and key rows
  cu_seqlens_k[i]:cu_seqlens_k[i+1]; queries are the *last* rows of their sequence (bottom-right causal
  alignment), so query j of a sequence with Lq queries and Lk keys sits at position Lk - Lq + j.
- Top-k tie rule: higher score first; equal scores prefer the lower key position. The returned indices are
  the selected *sequence-local* key positions in ascending order, then -1 padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slime_dsa.ops.fp8_keys import Fp8Keys, split_keys

QUERY_CHUNK = 256


def _query_positions(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For every query row: its sequence id and its position within the sequence (bottom-right aligned).
    total: the number of query rows when the caller knows it (no host sync on CUDA then)."""
    lens_q = cu_seqlens_q.diff()
    lens_k = cu_seqlens_k.diff()
    total = int(cu_seqlens_q[-1]) if total is None else total
    seq_id = torch.repeat_interleave(torch.arange(len(lens_q), device=lens_q.device), lens_q, output_size=total)
    row_in_seq = torch.arange(total, device=lens_q.device) - cu_seqlens_q[seq_id]
    return seq_id, (lens_k - lens_q)[seq_id] + row_in_seq


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 math for low-precision inputs; float64 inputs stay float64 (gradcheck, exact tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def indexer_scores(q: torch.Tensor, k: torch.Tensor | Fp8Keys, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s] * scale), in float32 (float64 for float64 q).

    q (Tq, Hi, Di), k (Tk, Di) or its FP8 rows, weights (Tq, Hi) -> (Tq, Tk). No mask.
    """
    acc = _acc_dtype(q)
    k, key_scales = split_keys(k)
    # The op order follows transformers' indexer, so near-ties break the same way.
    logits = torch.matmul(q.to(acc), k.to(acc).T) * scale  # (Tq, Hi, Tk)
    scores = torch.matmul(weights.to(acc).unsqueeze(-2), logits.relu()).squeeze(-2)  # (Tq, Tk)
    return scores if key_scales is None else scores * key_scales.to(acc)  # fp8_keys.py: the scale after the sum


def select_topk(scores: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """Deterministic top-k of masked scores: (Tq, Tk) -> (Tq, topk) positions ascending, -1 padded."""
    masked = scores.masked_fill(~valid, float("-inf"))
    k = min(topk, scores.shape[-1])
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]  # (Tq, k)
    chosen_valid = valid.gather(1, order)
    order = torch.where(chosen_valid, order, torch.full_like(order, torch.iinfo(order.dtype).max))
    order = order.sort(dim=-1).values
    order = torch.where(order == torch.iinfo(order.dtype).max, torch.full_like(order, -1), order)
    if k < topk:
        order = torch.cat([order, order.new_full((order.shape[0], topk - k), -1)], dim=-1)
    return order


SHORT_KEYS = 512  # sequences with at most this many keys are scored row by row in batches, longer ones one by one
BATCH_ELEMENTS = 1 << 24  # most elements of one batched (rows, heads or dim, keys) block


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor | Fp8Keys,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """Causal lightning-indexer top-k per query: (Tq, topk) int64 sequence-local key positions, -1 padded.

    Three paths, one result: a query with at most `topk` causal keys takes them all (no scoring); queries of
    short sequences (decode rows, RL samples) are scored together across sequences; long sequences are scored
    one at a time, their queries in chunks over the shared key block.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    if q.shape[0] == 0:
        return out
    seq_id, pos = _query_positions(cu_seqlens_q, cu_seqlens_k)  # (Tq,) each
    cols = torch.arange(topk, device=q.device)
    few = pos < topk  # every causal key fits in the top-k: positions 0..pos ascending, then -1
    out[few] = torch.where(cols[None, :] <= pos[few, None], cols[None, :], -1)
    lens_k = cu_seqlens_k.diff()
    short = (lens_k <= SHORT_KEYS)[seq_id]
    rows = (~few & short).nonzero().flatten()
    if len(rows):
        _batched_topk(q, k, weights, rows, cu_seqlens_k[seq_id[rows]], pos[rows] + 1, topk, scale, out)
    long_rows = ~few & ~short
    for i in seq_id[long_rows].unique().tolist() if bool(long_rows.any()) else []:
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        seq_k = k[k0:k1] if isinstance(k, torch.Tensor) else k.rows(slice(k0, k1))
        for c0 in range(q0, q1, QUERY_CHUNK):
            c1 = min(c0 + QUERY_CHUNK, q1)
            scores = indexer_scores(q[c0:c1], seq_k, weights[c0:c1], scale)  # (C, Lk)
            chunk_pos = (k1 - k0) - (q1 - q0) + torch.arange(c0 - q0, c1 - q0, device=q.device)  # (C,)
            valid = torch.arange(k1 - k0, device=q.device)[None, :] <= chunk_pos[:, None]
            out[c0:c1] = select_topk(scores, valid, topk)
    return out


def _batched_topk(q, k, weights, q_rows, k_starts, n_keys, topk: int, scale: float, out: torch.Tensor) -> None:
    """Query rows scored together instead of one Python iteration per sequence: row q_rows[j] sees the n_keys[j]
    keys from k_starts[j] on (its causal keys), padded to the chunk's widest row."""
    acc = _acc_dtype(q)
    width_all = int(n_keys.max())
    chunk = max(1, min(QUERY_CHUNK, BATCH_ELEMENTS // (width_all * max(q.shape[1], q.shape[2]))))
    for c0 in range(0, len(q_rows), chunk):
        rows, starts, lens = q_rows[c0 : c0 + chunk], k_starts[c0 : c0 + chunk], n_keys[c0 : c0 + chunk]
        cols = torch.arange(int(lens.max()), device=q.device)
        valid = cols[None, :] < lens[:, None]  # (C, W)
        key_rows = (starts[:, None] + cols).masked_fill(~valid, 0)
        if isinstance(k, Fp8Keys):
            keys = k.rows(key_rows)  # (C, W, Di) values, (C, W) scales
        else:
            keys = k.index_select(0, key_rows.reshape(-1)).view(*key_rows.shape, k.shape[-1]).to(acc)  # (C, W, Di)
        out[rows] = _score_and_select(q[rows], keys, weights[rows], valid, topk, scale)


def _score_and_select(q, keys, weights, valid, topk: int, scale: float) -> torch.Tensor:
    """One query per row against its own keys: q (C, Hi, Di), keys (C, W, Di) or their FP8 rows, weights (C, Hi)
    -> (C, topk)."""
    acc = _acc_dtype(q)
    keys, key_scales = split_keys(keys)
    logits = torch.matmul(q.to(acc), keys.to(acc).transpose(1, 2)) * scale  # (C, Hi, W), op order as indexer_scores
    scores = torch.matmul(weights.to(acc).unsqueeze(-2), logits.relu()).squeeze(-2)  # (C, W)
    if key_scales is not None:
        scores = scores * key_scales.to(acc)
    return select_topk(scores, valid, topk)


@torch.no_grad()
def indexer_topk_paged(
    q: torch.Tensor, k_pool: torch.Tensor | Fp8Keys, weights: torch.Tensor, key_slots: torch.Tensor, seq_lens: torch.Tensor,
    topk: int, scale: float,
) -> torch.Tensor:
    """Decode top-k over keys that stay in a paged pool: one query per sequence, no host sync (CUDA-graph safe).

    q (B, Hi, Di), k_pool (slots, Di) or its FP8 rows, weights (B, Hi); key_slots (B, W) pool slot of each key position (any
    slot past seq_lens[b]); seq_lens (B,) keys of each sequence, the query's own included. Returns (B, topk)
    sequence-local positions, ascending, -1 padded: the same selection `indexer_topk` makes on packed keys.
    """
    cols = torch.arange(key_slots.shape[1], device=q.device)
    valid = cols[None, :] < seq_lens[:, None]  # (B, W)
    keys = k_pool.rows(key_slots) if isinstance(k_pool, Fp8Keys) else k_pool[key_slots]
    return _score_and_select(q, keys, weights, valid, topk, scale)


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA-mode sparse attention over shared latent rows.

    q (Tq, H, D); kv (Tk, D) with the value in kv[:, :v_dim]; indices (Tq, K) rows of kv, -1 unused.
    Returns out (Tq, H, v_dim) and lse (Tq, H) float32 (natural log, of the scaled scores).
    Softmax runs in float32 (float64 for float64 inputs); out has q's dtype.
    """
    acc = _acc_dtype(q)
    outs, lses = [], []
    for c0 in range(0, q.shape[0], QUERY_CHUNK):
        idx = indices[c0 : c0 + QUERY_CHUNK]  # (C, K)
        valid = idx >= 0
        used = valid.any(0)  # (K,)
        if not bool(used.all()):
            # Columns no query of the chunk uses add nothing: a top-k at or above the sequence length (dense
            # attention) is mostly -1, and gathering it would cost K rows per query anyway.
            idx, valid = idx[:, used], valid[:, used]
        # index_select on the flat indices: on CPU several times faster than kv[idx], and its backward is an
        # index_add rather than an accumulating index_put.
        rows = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, kv.shape[-1])  # (C, K, D)
        scores = torch.einsum("chd,ckd->chk", q[c0 : c0 + QUERY_CHUNK].to(acc), rows.to(acc)) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))  # (C, H, K)
        lse = torch.logsumexp(scores, dim=-1)  # (C, H)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # all-masked rows -> 0
        outs.append(torch.einsum("chk,ckv->chv", probs.to(q.dtype), rows[..., :v_dim]))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)



def selects_all_causal(indices: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether `indices` (T, K) global rows pick every causal key of every query of sequences packed by cu_seqlens
    (queries = keys, no cache), in order, -1 after: what a top-k at or above the sequence length selects."""
    lens = cu_seqlens.diff()
    if len(lens) == 0 or int(lens.max()) > indices.shape[1]:
        return False
    starts = torch.repeat_interleave(cu_seqlens[:-1], lens)  # (T,) first row of each row's sequence
    positions = torch.arange(indices.shape[0], device=indices.device) - starts  # (T,)
    cols = torch.arange(indices.shape[1], device=indices.device)
    expected = torch.where(cols[None, :] <= positions[:, None], starts[:, None] + cols[None, :], -1)  # (T, K)
    return torch.equal(indices, expected)


def dense_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal MQA attention of each query over every earlier key of its sequence: `sparse_mla_attention` with
    indices that select all causal keys, by matmuls over each sequence instead of a gather of K rows per query.

    q (T, H, D), kv (T, D), both packed by cu_seqlens (S+1,). Returns out (T, H, v_dim), lse (T, H) float32.
    """
    acc = _acc_dtype(q)
    outs, lses = [], []
    bounds = cu_seqlens.tolist()
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        keys = kv[s0:s1]  # (L, D)
        for c0 in range(s0, s1, QUERY_CHUNK):
            c1 = min(c0 + QUERY_CHUNK, s1)
            scores = torch.einsum("chd,kd->chk", q[c0:c1].to(acc), keys[: c1 - s0].to(acc)) * scale  # (C, H, W)
            cols = torch.arange(c1 - s0, device=q.device)
            future = cols[None, :] > cols[c0 - s0 :, None]  # (C, W): key after the query
            scores = scores.masked_fill(future[:, None, :], float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)  # (C, H)
            probs = torch.exp(scores - lse[..., None])
            outs.append(torch.einsum("chk,kv->chv", probs.to(q.dtype), keys[: c1 - s0, :v_dim]))
            lses.append(lse)
    if not outs:
        return q.new_zeros(0, q.shape[1], v_dim), torch.zeros(0, q.shape[1], dtype=acc, device=q.device)
    return torch.cat(outs), torch.cat(lses)


def _loss_key_rows(
    c0: int, c1: int, rows: torch.Tensor | None, key_start: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Key rows of query rows c0:c1 as (C, W) global rows, -1 unused: `rows` if given, else every causal key."""
    if rows is not None:
        return rows[c0:c1]
    width = int(pos[c0:c1].max()) + 1
    cols = torch.arange(width, device=pos.device)
    return torch.where(cols <= pos[c0:c1, None], key_start[c0:c1, None] + cols, -1)  # (C, W)


def _kl_chunk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
    target: torch.Tensor, scale: float,
) -> torch.Tensor:
    """KL(target || softmax(I)) per query of one chunk: q (C, Hi, Di), k (Tk, Di), w (C, Hi), rows (C, W) -> (C,)."""
    dtype = target.dtype
    logits = torch.einsum("cjd,cwd->cjw", q.to(dtype), k[rows].to(dtype)) * scale  # (C, Hi, W)
    scores = torch.einsum("cj,cjw->cw", w.to(dtype), logits.relu()).masked_fill(~valid, float("-inf"))  # (C, W)
    log_q = F.log_softmax(scores, dim=-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(-1)


def indexer_kl_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    index_scale: float,
    attn_q: Sequence[torch.Tensor],
    attn_kv: Sequence[torch.Tensor],
    attn_lse: Sequence[torch.Tensor | None] | None,
    attn_scale: float,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """DSA indexer KL loss of one IndexShare group, per query row (docs/algorithms.md section 6).

    index_q (Tq, Hi, Di), index_k (Tk, Di), index_weights (Tq, Hi): the group's full-layer indexer inputs;
    index_scale as in `indexer_scores`. attn_q[g] (Tq, H, D), attn_kv[g] (Tk, D): the MQA-mode attention
    inputs of each layer g of the group (kv rows packed like index_k, by cu_seqlens_k); attn_lse[g] (Tq, H)
    the lse that layer's attention returned over the *same key set*, or None to recompute it.
    rows (Tq, K): the selected global key rows, -1 unused (sparse stage); None = every causal key (dense stage).

    Target p_bar[t] = mean over layers of L1-normalise(sum over heads of softmax(attn_scale * q . kv)) on the
    key set; returns KL(p_bar[t] || softmax(I[t])) on that set, (Tq,) float32 (float64 for float64 inputs).
    Gradients reach index_q, index_k and index_weights only. Chunked over queries: no (H, T, T) tensor.
    """
    acc = _acc_dtype(index_q)
    seq_id, pos = _query_positions(cu_seqlens_q, cu_seqlens_k)
    key_start = cu_seqlens_k[seq_id]
    n_layers = len(attn_q)
    losses = []
    for c0 in range(0, index_q.shape[0], QUERY_CHUNK):
        c1 = min(c0 + QUERY_CHUNK, index_q.shape[0])
        r = _loss_key_rows(c0, c1, rows, key_start, pos)  # (C, W)
        valid, r0 = r >= 0, r.clamp(min=0)
        with torch.no_grad():
            target = torch.zeros(r.shape, dtype=acc, device=r.device)  # (C, W)
            for g in range(n_layers):
                s = torch.einsum("chd,cwd->chw", attn_q[g][c0:c1].to(acc), attn_kv[g][r0].to(acc)) * attn_scale
                s = s.masked_fill(~valid[:, None, :], float("-inf"))  # (C, H, W)
                lse = attn_lse[g] if attn_lse is not None else None
                lse = torch.logsumexp(s, dim=-1) if lse is None else lse[c0:c1].to(acc)  # (C, H)
                p = torch.exp(s - lse[..., None]).nan_to_num(0.0).sum(1)  # (C, W) head-summed probabilities
                target += p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
            target /= n_layers
        # Recompute the (C, Hi, W) index logits in backward instead of keeping them for every chunk.
        losses.append(checkpoint(
            _kl_chunk, index_q[c0:c1], index_k, index_weights[c0:c1], r0, valid, target, index_scale,
            use_reentrant=False,
        ))
    return torch.cat(losses) if losses else index_q.new_zeros(0, dtype=acc)

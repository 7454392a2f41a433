"""Torch reference of the DSA ops: exact, chunked over queries, runs anywhere. The ground truth for kernels.

Conventions shared by every backend (see slime_dsa/ops/__init__.py):
- Packed varlen batches: sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] and key rows
  cu_seqlens_k[i]:cu_seqlens_k[i+1]; queries are the *last* rows of their sequence (bottom-right causal
  alignment), so query j of a sequence with Lq queries and Lk keys sits at position Lk - Lq + j.
- Top-k tie rule: higher score first; equal scores prefer the lower key position. The returned indices are
  the selected *sequence-local* key positions in ascending order, then -1 padding.
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 256


def _query_positions(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every query row: its sequence id and its position within the sequence (bottom-right aligned)."""
    lens_q = cu_seqlens_q.diff()
    lens_k = cu_seqlens_k.diff()
    seq_id = torch.repeat_interleave(torch.arange(len(lens_q), device=lens_q.device), lens_q)
    row_in_seq = torch.arange(int(cu_seqlens_q[-1]), device=lens_q.device) - cu_seqlens_q[seq_id]
    return seq_id, (lens_k - lens_q)[seq_id] + row_in_seq


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s] * scale), in float32.

    q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi) -> (Tq, Tk). No mask.
    """
    # The op order follows transformers' indexer, so near-ties break the same way.
    logits = torch.matmul(q.float(), k.float().T) * scale  # (Tq, Hi, Tk)
    return torch.matmul(weights.float().unsqueeze(-2), logits.relu()).squeeze(-2)  # (Tq, Tk)


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


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """Causal lightning-indexer top-k per query: (Tq, topk) int64 sequence-local key positions, -1 padded."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        seq_k = k[k0:k1]
        for c0 in range(q0, q1, QUERY_CHUNK):
            c1 = min(c0 + QUERY_CHUNK, q1)
            scores = indexer_scores(q[c0:c1], seq_k, weights[c0:c1], scale)  # (C, Lk)
            pos = (k1 - k0) - (q1 - q0) + torch.arange(c0 - q0, c1 - q0, device=q.device)  # (C,)
            valid = torch.arange(k1 - k0, device=q.device)[None, :] <= pos[:, None]
            out[c0:c1] = select_topk(scores, valid, topk)
    return out


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA-mode sparse attention over shared latent rows.

    q (Tq, H, D); kv (Tk, D) with the value in kv[:, :v_dim]; indices (Tq, K) rows of kv, -1 unused.
    Returns out (Tq, H, v_dim) and lse (Tq, H) float32 (natural log, of the scaled scores).
    Softmax runs in float32; out has q's dtype.
    """
    outs, lses = [], []
    for c0 in range(0, q.shape[0], QUERY_CHUNK):
        idx = indices[c0 : c0 + QUERY_CHUNK]  # (C, K)
        valid = idx >= 0
        rows = kv[idx.clamp(min=0)]  # (C, K, D)
        scores = torch.einsum("chd,ckd->chk", q[c0 : c0 + QUERY_CHUNK].float(), rows.float()) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))  # (C, H, K)
        lse = torch.logsumexp(scores, dim=-1)  # (C, H)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # all-masked rows -> 0
        outs.append(torch.einsum("chk,ckv->chv", probs.to(q.dtype), rows[..., :v_dim]))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)

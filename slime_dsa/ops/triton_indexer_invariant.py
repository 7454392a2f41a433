"""Batch-invariant lightning-indexer top-k (Triton), for true on-policy (slime_dsa/ops/invariant.py, issue 23).

I[t, s] = sum_j w[t, j] * relu(scale * q[t, j] . k[s]), as `triton_indexer.py`, but every score of a query comes
from one code path whatever the batch: one program scores one query against BLOCK_N key positions (block b holds
positions b * BLOCK_N .. b * BLOCK_N + BLOCK_N - 1), all index heads in one (heads x keys) tile, then sums the heads
as a fixed binary tree. Packed prefill and training rows address key s at row key_start[t] + s, paged decode rows at
pool slot key_slots[t, s]; the arithmetic is the same code with the same tile, so a decode row's scores equal the
same query's scores in a packed batch bit for bit. `triton_topk.topk_select` then picks the top-k, a function of
the row's valid scores alone (higher score first, the lower position on ties).

The paged entry waits on no host (CUDA-graph safe); the packed one reads the longest query's key count on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_topk import topk_select

BLOCK_N = 64  # key positions per program
CHUNK_ELEMS = 1 << 28  # float32 scores per packed chunk (1 GiB)


@triton.jit
def _head_tree_sum(s, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_HI, BLOCK_N) -> (BLOCK_N,): heads 2i and 2i + 1 added, repeated; no order left to the compiler."""
    for i in tl.static_range(BLOCK_HI.bit_length() - 1):
        s = tl.sum(tl.reshape(s, (BLOCK_HI >> (i + 1), 2, BLOCK_N)), axis=1)
    return tl.reshape(s, (BLOCK_N,))


@triton.jit(do_not_specialize=["row0", "width", "stride_slots", "stride_scores"])
def _invariant_scores_kernel(
    q_ptr, w_ptr, k_ptr, slots_ptr, key_start_ptr, n_keys_ptr, scores_ptr,
    row0, width, stride_slots, stride_scores, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr,
):
    """Scores of query row0 + program_id(0) at key positions of block program_id(1): -inf past its n_keys."""
    r = tl.program_id(0).to(tl.int64)
    t = row0 + r  # query row of q, w, n_keys (and of key_slots / key_start)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = offs_n < width
    n_keys = tl.load(n_keys_ptr + t)
    valid = offs_n < n_keys
    score = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_N < n_keys:
        offs_h = tl.arange(0, BLOCK_HI)
        offs_d = tl.arange(0, BLOCK_DI)
        h_ok, d_ok = offs_h < HI, offs_d < DI
        q = tl.load(q_ptr + t * (HI * DI) + offs_h[:, None] * DI + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # (BH, BD)
        w = tl.load(w_ptr + t * HI + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale  # relu(s x) = relu(x) s
        if PAGED:
            key_row = tl.load(slots_ptr + t * stride_slots + offs_n, mask=valid, other=0).to(tl.int64)
        else:
            key_row = tl.load(key_start_ptr + t).to(tl.int64) + offs_n
        k = tl.load(k_ptr + key_row[:, None] * DI + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        s = tl.maximum(tl.dot(q, tl.trans(k.to(q.dtype))), 0.0) * w[:, None]  # (BH, BN) fp32
        summed = _head_tree_sum(s, BLOCK_HI, BLOCK_N)
        summed = tl.where(summed == 0.0, 0.0, summed)  # -0.0 -> +0.0: zeros tie and break by position
        score = tl.where(valid, summed, score)
    tl.store(scores_ptr + r * stride_scores + offs_n, score, mask=in_row)


def _launch(q, weights, k, slots, key_start, n_keys, scores, row0: int, scale: float, paged: bool) -> None:
    rows, width = scores.shape
    if not (rows and width):
        return
    Hi, Di = q.shape[1], q.shape[2]
    _invariant_scores_kernel[(rows, triton.cdiv(width, BLOCK_N))](
        q, weights, k, slots, key_start, n_keys, scores, row0, width, slots.stride(0) if paged else 0,
        scores.stride(0), float(scale), HI=Hi, DI=Di, BLOCK_HI=max(16, triton.next_power_of_2(Hi)),
        BLOCK_DI=max(16, triton.next_power_of_2(Di)), BLOCK_N=BLOCK_N, PAGED=paged, num_warps=4,
    )


def _check(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, op: str) -> None:
    if q.dim() != 3 or k.dim() != 2 or weights.shape != q.shape[:2] or q.shape[2] != k.shape[1]:
        raise ValueError(f"{op} expects q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}")


@torch.no_grad()
def indexer_scores_paged(q, k_pool, weights, key_slots, seq_lens, scale: float) -> torch.Tensor:
    """(B, W) float32 scores of each query (one per sequence) over its first seq_lens[b] keys, -inf after."""
    _check(q, k_pool, weights, "indexer_topk_paged")
    key_slots = key_slots.contiguous()
    scores = torch.empty(key_slots.shape, dtype=torch.float32, device=q.device)
    _launch(q.contiguous(), weights.contiguous(), k_pool.contiguous(), key_slots, key_slots, seq_lens.contiguous(),
            scores, 0, scale, paged=True)
    return scores


@torch.no_grad()
def indexer_topk_paged(q, k_pool, weights, key_slots, seq_lens, topk: int, scale: float) -> torch.Tensor:
    """`ops.indexer_topk_paged`, batch-invariant: (B, topk) sequence-local positions, ascending, -1 padded."""
    return topk_select(indexer_scores_paged(q, k_pool, weights, key_slots, seq_lens, scale), seq_lens, topk)


def _packed_rows(q: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_start (Tq,), n_keys (Tq,)) of every packed query: its sequence's key row 0 and its causal key count."""
    lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    Tq = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(len(lens_q), device=q.device), lens_q, output_size=Tq)  # (Tq,)
    pos = (lens_k - lens_q)[seq] + torch.arange(Tq, device=q.device) - cu_seqlens_q[seq]  # (Tq,)
    return cu_seqlens_k[seq].contiguous(), (pos + 1).contiguous()


def _packed_scores(q, k, weights, key_start, n_keys, r0: int, r1: int, width: int, scale: float) -> torch.Tensor:
    scores = torch.empty(r1 - r0, width, dtype=torch.float32, device=q.device)  # every entry written
    _launch(q, weights, k, key_start, key_start, n_keys, scores, r0, scale, paged=False)
    return scores


@torch.no_grad()
def indexer_scores(q, k, weights, cu_seqlens_q, cu_seqlens_k, scale: float) -> torch.Tensor:
    """(Tq, W) float32 scores of packed queries over their causal keys, -inf after; W is the longest query's key
    count. What `indexer_topk` selects from (there in chunks of rows); for tests and benchmarks."""
    _check(q, k, weights, "indexer_topk")
    q, k, weights = q.contiguous(), k.contiguous().to(q.dtype), weights.contiguous()
    key_start, n_keys = _packed_rows(q, cu_seqlens_q, cu_seqlens_k)
    width = int(n_keys.max()) if q.shape[0] else 0
    return _packed_scores(q, k, weights, key_start, n_keys, 0, q.shape[0], width, scale)


@torch.no_grad()
def indexer_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk: int, scale: float) -> torch.Tensor:
    """`ops.indexer_topk`, batch-invariant: (Tq, topk) sequence-local key positions, ascending, -1 padded."""
    _check(q, k, weights, "indexer_topk")
    Tq = q.shape[0]
    out = torch.full((Tq, topk), -1, dtype=torch.long, device=q.device)
    if Tq == 0 or topk == 0:
        return out
    q, k, weights = q.contiguous(), k.contiguous().to(q.dtype), weights.contiguous()
    key_start, n_keys = _packed_rows(q, cu_seqlens_q, cu_seqlens_k)
    width = int(n_keys.max())  # one host sync: prefill and training are not captured in graphs
    step = max(1, CHUNK_ELEMS // width)
    for r0 in range(0, Tq, step):
        r1 = min(Tq, r0 + step)
        scores = _packed_scores(q, k, weights, key_start, n_keys, r0, r1, width, scale)
        topk_select(scores, n_keys[r0:r1], topk, out=out[r0:r1])
    return out


__all__ = ["indexer_topk", "indexer_topk_paged", "indexer_scores", "indexer_scores_paged"]

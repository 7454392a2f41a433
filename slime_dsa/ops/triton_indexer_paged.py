"""Decode-time lightning-indexer top-k over a paged key pool (Triton), with no host sync: CUDA-graph safe.

One program scores BLOCK_N key positions of one sequence with all index heads. It reads the keys through
their pool slots, so nothing is first gathered into a packed copy, and writes each score as a unique int64
sort key: the float's bits made order-preserving in the high half, (2^32 - 1 - position) in the low half.
One `torch.topk` over those keys then applies the tie rule of `reference.py` (equal scores prefer the lower
position) exactly, and a sort of the k winners gives the ascending positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # key positions per program
LOW32 = 4294967295


@triton.jit
def _paged_keys_kernel(
    q_ptr, w_ptr, k_ptr, slots_ptr, lens_ptr, keys_ptr, width, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    h_ok, d_ok = offs_h < HI, offs_d < DI
    q = tl.load(q_ptr + b * HI * DI + offs_h[:, None] * DI + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + b * HI + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale  # relu(s x) = relu(x) s, s > 0
    in_row = offs_n < width
    valid = offs_n < tl.load(lens_ptr + b)
    slot = tl.load(slots_ptr + b * width + offs_n, mask=in_row, other=0).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * DI + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    s = tl.maximum(tl.dot(q, tl.trans(k.to(q.dtype))), 0.0) * w[:, None]  # (BH, BN) fp32
    score = tl.sum(s, axis=0)  # (BN,)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: zeros tie and break by position
    score = tl.where(valid, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # integer order == float order
    low = 4294967295 - offs_n.to(tl.int64)  # int64 first: the constant does not fit in int32
    tl.store(keys_ptr + b * width + offs_n, (ordered << 32) + low, mask=in_row)


@torch.no_grad()
def indexer_topk_paged(
    q: torch.Tensor, k_pool: torch.Tensor, weights: torch.Tensor, key_slots: torch.Tensor, seq_lens: torch.Tensor,
    topk: int, scale: float,
) -> torch.Tensor:
    """Same contract as `reference.indexer_topk_paged`: (B, topk) sequence-local positions, ascending, -1 padded."""
    B, Hi, Di = q.shape
    width = key_slots.shape[1]
    keys = torch.empty(B, width, dtype=torch.int64, device=q.device)
    if B and width:
        _paged_keys_kernel[(B, triton.cdiv(width, BLOCK_N))](
            q.contiguous(), weights.contiguous(), k_pool, key_slots.contiguous(), seq_lens.contiguous(), keys, width,
            float(scale), HI=Hi, DI=Di, BLOCK_HI=max(16, triton.next_power_of_2(Hi)),
            BLOCK_DI=max(16, triton.next_power_of_2(Di)), BLOCK_N=BLOCK_N, num_warps=4,
        )
    k = min(topk, width)
    pos = LOW32 - (torch.topk(keys, k, dim=-1, sorted=False).values & LOW32)  # (B, k)
    big = torch.iinfo(torch.int64).max
    pos = torch.where(pos < seq_lens[:, None], pos, big).sort(dim=-1).values  # unused slots last
    pos = torch.where(pos == big, -1, pos)
    if k < topk:
        pos = torch.cat([pos, pos.new_full((B, topk - k), -1)], dim=-1)
    return pos


__all__ = ["indexer_topk_paged"]

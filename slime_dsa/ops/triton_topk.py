"""Exact per-row top-k of float32 scores (Triton radix select), with the tie rule of `reference.py`.

One program per row. The scores become order-preserving 32-bit keys; four passes over the row's first
n_valid[r] entries build a 256-bin histogram of one byte of the key each, most significant first, which
pins down the k-th largest key T exactly and how many entries equal to T still fit. A last pass in position
order writes the positions of every key above T and of the first entries equal to T (equal scores prefer the
lower position), so the output comes out ascending with no sort, then -1 padding. Rows with at most k valid
entries keep all of them. No host sync: a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # entries per step of a pass
NUM_WARPS = 8


@triton.jit
def _order_key(x):
    """float32 -> int64 key in [0, 2^32) with the same order; -0.0 counts as +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)


# One variant for every call: widths vary with the lengths, and n_valid / out are often row slices of larger tensors.
@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr", "out_ptr"])
def _topk_select_kernel(
    scores_ptr, n_valid_ptr, out_ptr, stride_s, stride_o, width, K, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    s_row = scores_ptr + row * stride_s
    o_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    # Radix select: after the pass on bits SHIFT..SHIFT+7, `prefix` holds the k-th largest key's bits from SHIFT
    # up and `need` how many entries sharing those bits belong to the top k.
    prefix = tl.zeros([], tl.int64)
    need = tl.minimum(n, K)
    for r in tl.static_range(4):
        SHIFT = 24 - 8 * r  # constexpr: static_range unrolls the passes
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, n, BLOCK):
            cols = c0 + offs
            in_row = cols < n
            key = _order_key(tl.load(s_row + cols, mask=in_row, other=0.0))
            match = in_row & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            digit = tl.where(match, (key >> SHIFT) & 255, 0).to(tl.int32)
            # entries outside the match were counted in bin 0: take them out again
            hist += tl.histogram(digit, 256) - tl.where(bins == 0, tl.sum((~match).to(tl.int32)), 0)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # (256,) matching entries with digit >= bin
        d = tl.max(tl.where(at_or_above >= need, bins, -1))  # the k-th largest key's digit
        need -= tl.sum(tl.where(bins == d, at_or_above - hist, 0))  # minus those with a larger digit
        prefix = prefix | (d.to(tl.int64) << SHIFT)

    # Selection in position order: keys above the threshold, and the first `need` keys equal to it.
    taken = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for c0 in range(0, n, BLOCK):
        cols = c0 + offs
        in_row = cols < n
        key = _order_key(tl.load(s_row + cols, mask=in_row, other=0.0))
        tie = (in_row & (key == prefix)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie  # ties before this entry
        take = (in_row & (key > prefix)) | ((tie != 0) & (tie_rank < need))
        take_i = take.to(tl.int32)
        slot = taken + tl.cumsum(take_i, 0) - take_i
        tl.store(o_row + slot, cols.to(tl.int64), mask=take)
        taken += tl.sum(take_i)
        ties_seen += tl.sum(tie)
    for c0 in range(taken, K, BLOCK):
        cols = c0 + offs
        tl.store(o_row + cols, tl.full([BLOCK], -1, tl.int64), mask=cols < K)


def topk_select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Top-`topk` positions of each row of scores (R, W) float32 among its first n_valid[r] entries.

    Returns (R, topk) int64: positions ascending, then -1 (rows with fewer valid entries keep all of them).
    Higher score first; equal scores prefer the lower position. `out` (R, topk) int64 is written if given.
    """
    R, W = scores.shape
    if out is None:
        out = torch.empty(R, topk, dtype=torch.int64, device=scores.device)
    if R == 0 or topk == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    _topk_select_kernel[(R,)](
        scores, n_valid.contiguous(), out, scores.stride(0), out.stride(0), W, topk, BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return out


__all__ = ["topk_select"]

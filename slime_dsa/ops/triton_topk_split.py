"""Exact per-row top-k of float32 scores, each row split over several programs (Triton radix select).

Same result as `triton_topk.topk_select`: the tie rule of `reference.py`, positions ascending, then -1. There one
program walks a whole row five times, so at decode (rows 64K wide, batch 1-128) most of the GPU idles and every
step waits on memory. Here each pass is a launch over (row, slice) programs: four passes add the slices' 256-bin
histograms of one key byte into the row's histogram (global atomics), one counts each slice's keys above and equal
to the threshold, and the last writes the positions, each slice after the counts of the slices before it.
No host sync: a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_topk import _order_key

BLOCK = 1024  # entries per step of a slice
NUM_WARPS = 4
PROGRAMS_PER_SM = 4  # slices are sized so that rows x slices fill the GPU this many times over
MAX_SLICES = 256  # one bound for every call, so that no batch size compiles a new variant


@triton.jit
def _threshold(hist_ptr, n, K, LEVELS):
    """(prefix, need) from the row's first LEVELS histograms: the k-th largest key's top 8 * LEVELS bits, and how
    many keys with those bits belong to the top k."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    need = tl.minimum(n, K)
    for r in range(LEVELS):
        hist = tl.load(hist_ptr + r * 256 + bins)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # (256,) matching keys with digit >= bin
        d = tl.max(tl.where(at_or_above >= need, bins, -1))
        need -= tl.sum(tl.where(bins == d, at_or_above - hist, 0))
        prefix = prefix | (d.to(tl.int64) << (24 - 8 * r))
    return prefix, need


# As in triton_topk, one variant for every call: widths vary with the lengths, and n_valid / out may be row slices.
@triton.jit(do_not_specialize=["width", "level"], do_not_specialize_on_alignment=["n_valid_ptr"])
def _hist_kernel(
    scores_ptr, n_valid_ptr, hist_ptr, stride_s, width, K, slice_len, level, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    h_row = hist_ptr + row * 1024
    prefix, need = _threshold(h_row, n, K, level)  # a runtime level: one compiled kernel for the four passes
    shift = 24 - 8 * level
    start = tl.program_id(1) * slice_len
    end = tl.minimum(start + slice_len, n)
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + offs
        in_slice = cols < end
        key = _order_key(tl.load(scores_ptr + row * stride_s + cols, mask=in_slice, other=0.0))
        match = in_slice & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        digit = tl.where(match, (key >> shift) & 255, 0).to(tl.int32)
        # entries outside the match were counted in bin 0: take them out again
        hist += tl.histogram(digit, 256) - tl.where(bins == 0, tl.sum((~match).to(tl.int32)), 0)
    tl.atomic_add(h_row + level * 256 + bins, hist, mask=hist != 0)


@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr"])
def _count_kernel(scores_ptr, n_valid_ptr, hist_ptr, counts_ptr, stride_s, width, K, slice_len, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    threshold, need = _threshold(hist_ptr + row * 1024, n, K, 4)
    start = tl.program_id(1) * slice_len
    end = tl.minimum(start + slice_len, n)
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + offs
        in_slice = cols < end
        key = _order_key(tl.load(scores_ptr + row * stride_s + cols, mask=in_slice, other=0.0))
        above += tl.sum((in_slice & (key > threshold)).to(tl.int32))
        ties += tl.sum((in_slice & (key == threshold)).to(tl.int32))
    c = counts_ptr + (row * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(c, above)
    tl.store(c + 1, ties)


@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr", "out_ptr"])
def _write_kernel(
    scores_ptr, n_valid_ptr, hist_ptr, counts_ptr, out_ptr, stride_s, stride_o, width, K, slice_len,
    BLOCK: tl.constexpr, MAX_SLICES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    threshold, need = _threshold(hist_ptr + row * 1024, n, K, 4)
    prev = tl.arange(0, MAX_SLICES)
    c_row = counts_ptr + row * tl.num_programs(1) * 2
    ties_seen = tl.sum(tl.load(c_row + prev * 2 + 1, mask=prev < s, other=0))
    taken = tl.sum(tl.load(c_row + prev * 2, mask=prev < s, other=0)) + tl.minimum(ties_seen, need)
    o_row = out_ptr + row * stride_o
    start = s * slice_len
    end = tl.minimum(start + slice_len, n)
    offs = tl.arange(0, BLOCK)
    for c0 in range(start, end, BLOCK):
        cols = c0 + offs
        in_slice = cols < end
        key = _order_key(tl.load(scores_ptr + row * stride_s + cols, mask=in_slice, other=0.0))
        tie = (in_slice & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, 0) - tie  # ties before this entry
        take = (in_slice & (key > threshold)) | ((tie != 0) & (tie_rank < need))
        take_i = take.to(tl.int32)
        tl.store(o_row + taken + tl.cumsum(take_i, 0) - take_i, cols.to(tl.int64), mask=take)
        taken += tl.sum(take_i)
        ties_seen += tl.sum(tie)
    if s == 0:  # the row holds min(n, K) positions in all; the rest is padding
        for c0 in range(tl.minimum(n, K), K, BLOCK):
            cols = c0 + offs
            tl.store(o_row + cols, tl.full([BLOCK], -1, tl.int64), mask=cols < K)


def split_slices(rows: int, width: int, block: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Slices per row so that rows x slices fill every SM `per_sm` times, at least one block a slice."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(per_sm * sms, max(rows, 1)), triton.cdiv(width, block), MAX_SLICES))


def select_operands(scores: torch.Tensor, n_valid: torch.Tensor, topk: int, out: torch.Tensor | None = None):
    """(scores with unit column stride, contiguous n_valid, the (R, topk) int64 output, `out` if given) of a select
    call."""
    if out is None:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int64, device=scores.device)
    return (scores if scores.stride(1) == 1 else scores.contiguous()), n_valid.contiguous(), out


def topk_select_split(
    scores: torch.Tensor, n_valid: torch.Tensor, topk: int, slices: int | None = None, block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`triton_topk.topk_select` with each row cut into `slices` slices (default: `split_slices`): (R, topk) int64."""
    scores, n_valid, out = select_operands(scores, n_valid, topk)
    R, W = scores.shape
    if R == 0 or topk == 0:
        return out
    slices = min(slices or split_slices(R, W, block, scores.device), MAX_SLICES)
    slice_len = triton.cdiv(triton.cdiv(W, slices), block) * block
    slices = triton.cdiv(W, slice_len) if W else 1
    hist = torch.zeros(R, 4, 256, dtype=torch.int32, device=scores.device)
    counts = torch.empty(R, slices, 2, dtype=torch.int32, device=scores.device)
    grid = (R, slices)
    for level in range(4):
        _hist_kernel[grid](scores, n_valid, hist, scores.stride(0), W, topk, slice_len, level, BLOCK=block,
                           num_warps=num_warps)
    _count_kernel[grid](scores, n_valid, hist, counts, scores.stride(0), W, topk, slice_len, BLOCK=block,
                        num_warps=num_warps)
    _write_kernel[grid](scores, n_valid, hist, counts, out, scores.stride(0), out.stride(0), W, topk, slice_len,
                        BLOCK=block, MAX_SLICES=MAX_SLICES, num_warps=num_warps)
    return out


__all__ = ["select_operands", "split_slices", "topk_select_split"]

"""Exact per-row top-k of float32 scores from one full read of the row: a sampled floor, then a radix select on
the entries at or above it (Triton).

Same result as `triton_topk_split.topk_select_split` (the tie rule of `reference.py`, positions ascending, then -1),
which reads the whole row six times. Here one program per row samples 4,096 of the row's scores and sets a floor: the
24-bit key prefix of a sample rank safely past k's share of the sample. One pass over the row (a program per row
slice) then keeps the entries (position, key) at or above the floor, in position order, in the slice's own region.
Four histogram passes and the write, as in the split select, run on the kept entries alone: a few thousand a row
for decode scores instead of 64K. By default (fused_tail) one program a row runs them all, its histograms in
registers, looping over the row's slices in order; otherwise each is a launch over (row, slice) programs adding into
a global histogram, the last histogram pass also counting per slice what the write needs of the slices before it.
A row that kept fewer than its top k (the sample misjudged the row) reads all its positions in those passes instead,
so the result is exact for any scores; heavy ties only keep more. No host sync: a CUDA graph can capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_topk_split import BLOCK, MAX_SLICES, NUM_WARPS, _threshold, select_operands, split_slices

SAMPLE = 4096  # sampled entries a row: rows up to this long are read whole
CHUNK = 4  # adjacent positions a sample takes together: fewer memory sectors, little correlation
SAMPLE_WARPS = 8
# The floor is the prefix of the sample's (mu + MARGIN_SIGMAS sqrt(mu) + MARGIN_MIN)-th largest key, mu = k's share of
# the sample: with scores in random order a row keeps fewer than k about once in a billion (6 sigma of a binomial
# count). Such a row falls back to reading everything, still exact; a wider margin only keeps more.
MARGIN_SIGMAS = 6.0
MARGIN_MIN = 16
# The four histogram passes and the write in one launch of a program a row (`_tail_kernel`, fused_tail), instead of
# five launches over (row, slice) programs: TAIL_BLOCK entries a step, TAIL_WARPS warps. H100: decode batch 128 x 64K
# 0.085 ms against 0.091, prefill chunks at 64K / 128K 19.6 / 57.3 ms against 20.8 / 60.2 (RESULTS.md, 2026-12-07).
TAIL_BLOCK = 1024
TAIL_WARPS = 8


@triton.jit
def _key32(x):
    """float32 -> uint32 key with the same order (`triton_topk._order_key` in 32 bits); -0.0 counts as +0.0."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _digit_at_rank(hist, want):
    """(digit, want left): the bin holding the want-th largest of a 256-bin histogram, and that entry's rank among
    the bin's entries."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # (256,) entries with digit >= bin
    d = tl.max(tl.where(at_or_above >= want, bins, -1))
    return d, want - tl.sum(tl.where(bins == d, at_or_above - hist, 0))


@triton.jit
def _sample_positions(idx, n, SAMPLE: tl.constexpr, CHUNK: tl.constexpr):
    """Positions of the sample: the whole row up to SAMPLE entries, else CHUNK adjacent positions from each of
    SAMPLE / CHUNK equal strata, at an offset that varies by stratum (no aliasing with a periodic row)."""
    stratum = (idx // CHUNK).to(tl.int64)
    first = stratum * n // (SAMPLE // CHUNK)
    length = tl.maximum((stratum + 1) * n // (SAMPLE // CHUNK) - first, CHUNK)
    offset = (stratum * 7919) % (length - CHUNK + 1)
    return tl.where(n <= SAMPLE, idx, first + offset + idx % CHUNK)


@triton.jit
def _exclusive_cumsum(x, BLOCK: tl.constexpr):
    """Exclusive prefix sum of (BLOCK,) int32, four entries a group: fewer shuffles than tl.cumsum (sm_90 SASS)."""
    x4 = tl.reshape(x, [BLOCK // 4, 4])
    group = tl.sum(x4, 1)
    return tl.reshape((tl.cumsum(group, 0) - group)[:, None] + tl.cumsum(x4, 1) - x4, [BLOCK])


# As in triton_topk_split, one variant for every call: widths vary with the lengths; n_valid / out may be row slices.
@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr"])
def _floor_kernel(
    scores_ptr, n_valid_ptr, floor_ptr, hist_ptr, total_ptr, stride_s, width, K, margin_sigmas, margin_min,
    SAMPLE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Per row: the floor (a key, 0 keeps every entry), and the row's histograms and kept total set to zero."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    tl.store(hist_ptr + row * 1024 + tl.arange(0, 1024), tl.zeros([1024], tl.int32))
    tl.store(total_ptr + row, 0)
    idx = tl.arange(0, SAMPLE)
    m = tl.minimum(n, SAMPLE)
    sampled = idx < m
    key = _key32(tl.load(scores_ptr + row * stride_s + _sample_positions(idx, n, SAMPLE, CHUNK), mask=sampled,
                         other=0.0))
    mu = tl.minimum(n, K).to(tl.float32) * m / tl.maximum(n, 1)  # the top k's expected share of the sample
    want = tl.ceil(mu + margin_sigmas * tl.sqrt(mu)).to(tl.int32) + margin_min
    d0, rest = _digit_at_rank(tl.histogram((key >> 24).to(tl.int32), 256, mask=sampled), want)
    top = sampled & ((key >> 24) == d0.to(tl.uint32))
    d1, rest = _digit_at_rank(tl.histogram(((key >> 16) & 255).to(tl.int32), 256, mask=top), rest)
    top = top & (((key >> 16) & 255) == d1.to(tl.uint32))
    d2, rest = _digit_at_rank(tl.histogram(((key >> 8) & 255).to(tl.int32), 256, mask=top), rest)
    floor = (d0.to(tl.int64) << 24) | (d1.to(tl.int64) << 16) | (d2.to(tl.int64) << 8)
    tl.store(floor_ptr + row, tl.where(want >= m, 0, floor))  # rows of k or fewer: want > m


@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr"])
def _compact_kernel(
    scores_ptr, n_valid_ptr, floor_ptr, pos_ptr, key_ptr, counts_ptr, total_ptr, stride_s, stride_k, width, slice_len,
    BLOCK: tl.constexpr,
):
    """The one full read: each slice's entries (position, key) at or above the floor, in order, into its region."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    floor = tl.load(floor_ptr + row).to(tl.uint32)
    start = s * slice_len
    end = tl.minimum(start + slice_len, n)
    region = row * stride_k + start
    offs = tl.arange(0, BLOCK)
    kept = tl.zeros([], tl.int32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + offs
        key = _key32(tl.load(scores_ptr + row * stride_s + cols, mask=cols < end, other=0.0))
        keep = (cols < end) & (key >= floor)
        keep_i = keep.to(tl.int32)
        slot = region + kept + _exclusive_cumsum(keep_i, BLOCK)
        tl.store(pos_ptr + slot, cols, mask=keep)
        tl.store(key_ptr + slot, key.to(tl.int32, bitcast=True), mask=keep)
        kept += tl.sum(keep_i)
    tl.store(counts_ptr + (row * tl.num_programs(1) + s) * 2, kept)
    tl.atomic_add(total_ptr + row, kept)


@triton.jit
def _slice_count(counts_row, s, start, n, slice_len, full):
    """Entries of the row's slice s (first position `start`): those it kept, or all its positions when full."""
    return tl.where(full, tl.maximum(tl.minimum(slice_len, n - start), 0), tl.load(counts_row + s * 2))


@triton.jit
def _slice(n_valid_ptr, counts_ptr, total_ptr, width, K, slice_len):
    """(row, slice, n, first position, entries, full) of this program. A slice's entries are its kept positions, or
    all its positions when the row kept fewer than its top k (full)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    start = s * slice_len
    full = tl.load(total_ptr + row) < tl.minimum(n, K)
    count = _slice_count(counts_ptr + row * tl.num_programs(1) * 2, s, start, n, slice_len, full)
    return row, s, n, start, count, full


@triton.jit
def _entries(scores_row, kept_pos, kept_key, start, idx, count, full):
    """(positions, keys, valid) of a slice's entries idx: from its region of kept entries, or its own positions.
    The region holds the keys too, so that nothing waits on a gather."""
    ok = idx < count
    if full:
        pos = start + idx
        key = _key32(tl.load(scores_row + pos, mask=ok, other=0.0))
    else:
        pos = tl.load(kept_pos + idx, mask=ok, other=0)
        key = tl.load(kept_key + idx, mask=ok, other=0).to(tl.uint32, bitcast=True)
    return pos, key, ok


@triton.jit(do_not_specialize=["width", "level"], do_not_specialize_on_alignment=["n_valid_ptr"])
def _hist_kernel(
    scores_ptr, n_valid_ptr, pos_ptr, key_ptr, counts_ptr, total_ptr, hist_ptr, tails_ptr, stride_s, stride_k, width, K,
    slice_len, level, BLOCK: tl.constexpr,
):
    """Adds the slice's 256-bin histogram of key byte `level` (entries matching the higher bytes) into the row's.
    The last level also keeps what the write pass needs of the slice, whatever the threshold's last byte is."""
    row, s, n, start, count, full = _slice(n_valid_ptr, counts_ptr, total_ptr, width, K, slice_len)
    region = row * stride_k + start
    h_row = hist_ptr + row * 1024
    prefix, need = _threshold(h_row, n, K, level)  # a runtime level: one compiled kernel for the four passes
    shift = 24 - 8 * level
    high = (tl.full([], -1, tl.int64) << (shift + 8)).to(tl.uint32)  # the bytes above this one; none at level 0
    above = prefix.to(tl.uint32) & high
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    higher = tl.zeros([], tl.int32)
    for c0 in range(0, count, BLOCK):
        pos, key, ok = _entries(scores_ptr + row * stride_s, pos_ptr + region, key_ptr + region, start, c0 + offs,
                                count, full)
        digit = ((key >> shift.to(tl.uint32)) & 255).to(tl.int32)
        hist += tl.histogram(digit, 256, mask=ok & ((key & high) == above))
        higher += tl.sum((ok & ((key & high) > above)).to(tl.int32))
    bins = tl.arange(0, 256)
    tl.atomic_add(h_row + level * 256 + bins, hist, mask=hist != 0)
    if level == 3:  # entries above the threshold's top 24 bits, and those at or above each last byte after them
        tl.store(counts_ptr + (row * tl.num_programs(1) + s) * 2 + 1, higher)
        tails = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        tl.store(tails_ptr + (row * 256 + bins) * tl.num_programs(1) + s, tails)


@triton.jit
def _write_step(o_row, pos, key, ok, t, need, taken, ties_seen, BLOCK: tl.constexpr):
    """Write the selected of BLOCK entries (in position order) after `taken` earlier ones: keys above the threshold
    t, and ties with it while fewer than `need` ties came before; returns (taken, ties_seen) after them."""
    tie = (ok & (key == t)).to(tl.int32)
    tie_rank = ties_seen + _exclusive_cumsum(tie, BLOCK)  # ties before this entry
    take = (ok & (key > t)) | ((tie != 0) & (tie_rank < need))
    take_i = take.to(tl.int32)
    tl.store(o_row + taken + _exclusive_cumsum(take_i, BLOCK), pos.to(tl.int64), mask=take)
    return taken + tl.sum(take_i), ties_seen + tl.sum(tie)


@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["n_valid_ptr", "out_ptr"])
def _write_kernel(
    scores_ptr, n_valid_ptr, pos_ptr, key_ptr, counts_ptr, total_ptr, hist_ptr, tails_ptr, out_ptr, stride_s, stride_k,
    stride_o, width, K, slice_len, BLOCK: tl.constexpr, MAX_SLICES: tl.constexpr,
):
    """The slice's selected positions, after those of the slices before it; slice 0 also pads the row with -1."""
    row, s, n, start, count, full = _slice(n_valid_ptr, counts_ptr, total_ptr, width, K, slice_len)
    region = row * stride_k + start
    threshold, need = _threshold(hist_ptr + row * 1024, n, K, 4)
    t = threshold.to(tl.uint32)
    # the slices before this one: entries above the threshold, and ties with it
    d = (threshold & 255).to(tl.int32)
    prev = tl.arange(0, MAX_SLICES)
    before = prev < s
    at_d = tl.load(tails_ptr + (row * 256 + d) * tl.num_programs(1) + prev, mask=before, other=0)
    past_d = tl.load(tails_ptr + (row * 256 + d + 1) * tl.num_programs(1) + prev, mask=before & (d < 255), other=0)
    higher = tl.load(counts_ptr + (row * tl.num_programs(1) + prev) * 2 + 1, mask=before, other=0)
    ties_seen = tl.sum(at_d - past_d)
    taken = tl.sum(higher + past_d) + tl.minimum(ties_seen, need)
    o_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, count, BLOCK):
        pos, key, ok = _entries(scores_ptr + row * stride_s, pos_ptr + region, key_ptr + region, start, c0 + offs,
                                count, full)
        taken, ties_seen = _write_step(o_row, pos, key, ok, t, need, taken, ties_seen, BLOCK)
    if s == 0:  # the row holds min(n, K) positions in all; the rest is padding
        for c0 in range(tl.minimum(n, K), K, BLOCK):
            cols = c0 + offs
            tl.store(o_row + cols, tl.full([BLOCK], -1, tl.int64), mask=cols < K)


@triton.jit
def _tail_in_steps(scores_row, pos_ptr, key_ptr, counts_row, o_row, region0, n, slices, slice_len, need, full,
                   BLOCK: tl.constexpr):
    """The four histogram levels and the write of any row: each a loop over the row's slices in order and over
    BLOCK of each slice's entries (kept ones, or all its positions when full)."""
    offs = tl.arange(0, BLOCK)
    prefix = tl.zeros([], tl.int64)
    for level in tl.static_range(4):
        shift = 24 - 8 * level  # not annotated constexpr: the unrolled loop assigns it again
        high = (tl.full([], -1, tl.int64) << (shift + 8)).to(tl.uint32)  # the bytes above this one; none at level 0
        above = prefix.to(tl.uint32) & high
        hist = tl.zeros([256], tl.int32)
        for s in range(0, slices):
            start = s * slice_len
            count = _slice_count(counts_row, s, start, n, slice_len, full)
            for c0 in range(0, count, BLOCK):
                pos, key, ok = _entries(scores_row, pos_ptr + region0 + start, key_ptr + region0 + start, start,
                                        c0 + offs, count, full)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=ok & ((key & high) == above))
        d, need = _digit_at_rank(hist, need)
        prefix = prefix | (d.to(tl.int64) << shift)
    t = prefix.to(tl.uint32)
    taken = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for s in range(0, slices):
        start = s * slice_len
        count = _slice_count(counts_row, s, start, n, slice_len, full)
        for c0 in range(0, count, BLOCK):
            pos, key, ok = _entries(scores_row, pos_ptr + region0 + start, key_ptr + region0 + start, start,
                                    c0 + offs, count, full)
            taken, ties_seen = _write_step(o_row, pos, key, ok, t, need, taken, ties_seen, BLOCK)


@triton.jit(do_not_specialize=["width", "slices"], do_not_specialize_on_alignment=["n_valid_ptr", "out_ptr"])
def _tail_kernel(
    scores_ptr, n_valid_ptr, pos_ptr, key_ptr, counts_ptr, total_ptr, out_ptr, stride_s, stride_k, stride_o, width, K,
    slice_len, slices, BLOCK: tl.constexpr,
):
    """One program a row: the four histogram passes (histograms in registers) and the write, then the padding."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(n_valid_ptr + row).to(tl.int32), width)
    need = tl.minimum(n, K)
    full = tl.load(total_ptr + row) < need
    o_row = out_ptr + row * stride_o
    _tail_in_steps(scores_ptr + row * stride_s, pos_ptr, key_ptr, counts_ptr + row * slices * 2, o_row, row * stride_k,
                   n, slices, slice_len, need, full, BLOCK)
    offs = tl.arange(0, BLOCK)
    for c0 in range(need, K, BLOCK):  # min(n, K) positions in all; the rest is padding
        cols = c0 + offs
        tl.store(o_row + cols, tl.full([BLOCK], -1, tl.int64), mask=cols < K)


class Kept(NamedTuple):
    """What the floor pass and the compaction leave for the select passes."""

    floor: torch.Tensor  # (R,) int64: the key floor
    total: torch.Tensor  # (R,) int32: entries kept
    hist: torch.Tensor  # (R, 4, 256) int32: zeroed, for the four histogram passes
    counts: torch.Tensor  # (R, slices, 2) int32: a slice's entries kept, and above the threshold's top 24 bits
    tails: torch.Tensor  # (R, 256, slices) int32: a slice's entries at the threshold's top 24 bits, last byte >= b
    pos: torch.Tensor  # (R, slices x slice_len) int32: a slice's kept positions, from the slice's first position on
    key: torch.Tensor  # (R, slices x slice_len) int32: their keys (uint32 bits)
    slice_len: int


def keep_above_floor(scores: torch.Tensor, n_valid: torch.Tensor, topk: int, slices: int, block: int,
                     num_warps: int) -> Kept:
    """The sampled floor of each row, then the one full read: each slice's entries at or above it."""
    R, W = scores.shape
    slice_len = triton.cdiv(triton.cdiv(W, slices), block) * block
    slices = triton.cdiv(W, slice_len) if W else 1
    region = lambda: torch.empty(R, max(slices * slice_len, 1), dtype=torch.int32, device=scores.device)  # noqa: E731
    st = Kept(torch.empty(R, dtype=torch.int64, device=scores.device),
              torch.empty(R, dtype=torch.int32, device=scores.device),  # zeroed by _floor_kernel, as is hist
              torch.empty(R, 4, 256, dtype=torch.int32, device=scores.device),
              torch.empty(R, slices, 2, dtype=torch.int32, device=scores.device),
              torch.empty(R, 256, slices, dtype=torch.int32, device=scores.device), region(), region(), slice_len)
    _floor_kernel[(R,)](scores, n_valid, st.floor, st.hist, st.total, scores.stride(0), W, topk, MARGIN_SIGMAS,
                        MARGIN_MIN, SAMPLE=SAMPLE, CHUNK=CHUNK, num_warps=SAMPLE_WARPS)
    _compact_kernel[(R, slices)](scores, n_valid, st.floor, st.pos, st.key, st.counts, st.total, scores.stride(0),
                                 st.pos.stride(0), W, slice_len, BLOCK=block, num_warps=num_warps)
    return st


def topk_select_sampled(
    scores: torch.Tensor, n_valid: torch.Tensor, topk: int, slices: int | None = None, block: int = BLOCK,
    num_warps: int = NUM_WARPS, out: torch.Tensor | None = None, fused_tail: bool = True,
    tail_block: int = TAIL_BLOCK, tail_warps: int = TAIL_WARPS,
) -> torch.Tensor:
    """`topk_select_split`'s result from one full read of each row (sampled floor, then kept entries): (R, topk)
    int64, written into `out` if given. fused_tail: the passes after the compaction in one launch of a program a row
    (tail_warps warps, tail_block entries a step), else five launches over (row, slice) programs."""
    scores, n_valid, out = select_operands(scores, n_valid, topk, out)
    R, W = scores.shape
    if R == 0 or topk == 0:
        return out
    st = keep_above_floor(scores, n_valid, topk, min(slices or split_slices(R, W, block, scores.device), MAX_SLICES),
                          block, num_warps)
    grid = (R, st.counts.shape[1])
    if fused_tail:
        _tail_kernel[(R,)](scores, n_valid, st.pos, st.key, st.counts, st.total, out, scores.stride(0),
                           st.pos.stride(0), out.stride(0), W, topk, st.slice_len, grid[1], BLOCK=tail_block,
                           num_warps=tail_warps)
        return out
    args = (scores, n_valid, st.pos, st.key, st.counts, st.total, st.hist, st.tails)
    for level in range(4):
        _hist_kernel[grid](*args, scores.stride(0), st.pos.stride(0), W, topk, st.slice_len, level, BLOCK=block,
                           num_warps=num_warps)
    _write_kernel[grid](*args, out, scores.stride(0), st.pos.stride(0), out.stride(0), W, topk, st.slice_len,
                        BLOCK=block, MAX_SLICES=MAX_SLICES, num_warps=num_warps)
    return out


__all__ = ["Kept", "keep_above_floor", "topk_select_sampled"]

"""Lightning-indexer scoring with a fused, deterministic top-k (Triton), bf16 (keys bf16, or fp8 with row scales).

I[t, s] = sum_j w[t, j] * relu(scale * q[t, j] . k[s]) over the causal keys s of query t's sequence. Keys may be
float8_e4m3fn with one float32 scale per row (k[s] = values[s] * key_scales[s]): the kernel loads the 1-byte keys,
converts them and q to fp16 (exact, `triton_indexer_paged.fp16_queries`) for the dot and multiplies each key's score
by its scale after the sum over heads.

Two passes per chunk of query rows, so no T x T score matrix ever exists:
1. A Triton kernel scores a (queries x keys) tile per program: a product on the tensor cores (SCORES_PRODUCT: keys
   x (query, head) columns, keys x heads a query, or (query, head) rows x keys), relu, weighted sum over heads;
   non-causal entries are -inf. The chunk's float32 scores (at most CHUNK_ELEMS of them) are the largest buffer.
   A program takes up to BLOCK_M queries of one sequence; at decode (one query per sequence) BLOCK_M is 1, so no
   tile rows are spent on absent queries.
2. A select picks each row's top-k exactly with the tie rule of `reference.py` (equal scores prefer the lower
   position) and writes the positions ascending, -1 padded: `triton_topk_sampled.topk_select_sampled` for chunks
   wider than SAMPLED_SELECT_MIN_WIDTH (PREFILL_SELECT_SAMPLED; its kept entries take up to 2 GiB more for a full
   chunk), else `triton_topk.topk_select` (a radix select, a program a row).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from slime_dsa.devices import upload
from slime_dsa.ops.indexer_plan import plan_chunks
from slime_dsa.ops.reference import _query_positions
from slime_dsa.ops.triton_indexer_paged import fp16_queries, key_scales_arg
from slime_dsa.ops.triton_topk import topk_select
from slime_dsa.ops.triton_topk_sampled import topk_select_sampled

CHUNK_ELEMS = 1 << 28  # float32 scores per chunk (1 GiB)
# The scoring product of a tile (benchmarks/indexer_scores_variants.py times them):
ROWS_BY_KEYS = 0  # one ((query, head) rows x keys) product: the sum over heads crosses warps (shared memory)
KEYS_BY_HEADS = 1  # a (keys x heads) product a query: the sum over heads stays in each thread's quad
KEYS_BY_QUERY_HEADS = 2  # one (keys x (query, head) columns) product: one wide MMA, q read once a program
PRODUCTS = {"rows_by_keys": ROWS_BY_KEYS, "keys_by_heads": KEYS_BY_HEADS, "keys_by_query_heads": KEYS_BY_QUERY_HEADS}
# keys_by_query_heads over 8 queries and 8 tiles of 64 keys against keys_by_heads over 4 queries and 4 tiles of 128:
# H100, 128K tokens, scoring 267 -> 178 ms, the same selection (RESULTS.md, 2026-12-07 twenty-first session).
SCORES_PRODUCT = "keys_by_query_heads"
ROWS_PER_PROGRAM = 256  # (query, head) rows of one program's tile: BLOCK_M queries x BLOCK_HI heads
BLOCK_N = 64  # keys per tile
TILES_PER_PROGRAM = 8  # key tiles per program (q stays on chip across them)
SCORES_WARPS, SCORES_STAGES = 8, 2
# Chunks of rows wider than this take `triton_topk_sampled.topk_select_sampled` (one full read of each row, then a
# radix select on the entries above a sampled floor; same positions) instead of `topk_select`'s program a row: H100,
# 64K tokens, 53 -> 20 ms (benchmarks/RESULTS.md, 2026-12-05).
PREFILL_SELECT_SAMPLED = True
SAMPLED_SELECT_MIN_WIDTH = 8192


@triton.jit
def _query_heads(q_ptr, w_ptr, row, ok, scale, HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr,
                 BLOCK_DI: tl.constexpr, HAS_KEY_SCALES: tl.constexpr):
    """One query row's heads (BLOCK_HI, BLOCK_DI) and scaled head weights (BLOCK_HI,), zero when not ok."""
    offs_j = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    mask_j = (offs_j < HI) & ok
    q = tl.load(q_ptr + row * (HI * DI) + offs_j[:, None] * DI + offs_d[None, :],
                mask=mask_j[:, None] & (offs_d < DI)[None, :], other=0.0)
    w = tl.load(w_ptr + row * HI + offs_j, mask=mask_j, other=0.0).to(tl.float32) * scale
    if HAS_KEY_SCALES:
        q, w = fp16_queries(q, w)
    return q, w


# Lengths vary from call to call; specialising on them (an int's divisibility by 16, a block row's alignment) would
# compile new variants mid-run. The scores' row stride is kept a multiple of 16 instead (score_rows): stores stay wide.
@triton.jit(do_not_specialize=["chunk_q0", "width"],
            do_not_specialize_on_alignment=["blk_q_ptr", "blk_n_ptr", "blk_kstart_ptr", "blk_pos_ptr"])
def _indexer_scores_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, scores_ptr,
    blk_q_ptr, blk_n_ptr, blk_kstart_ptr, blk_pos_ptr,
    chunk_q0, width, stride_scores, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, HAS_KEY_SCALES: tl.constexpr,
    PRODUCT: tl.constexpr = 0,
):
    """One program: BLOCK_M consecutive queries of one sequence x TILES * BLOCK_N keys -> float32 scores.

    Non-causal entries get -inf; -0.0 becomes +0.0 so that zeros tie (and break by position) like the reference.
    """
    ROWS: tl.constexpr = BLOCK_M * BLOCK_HI
    b = tl.program_id(0)
    q0 = tl.load(blk_q_ptr + b).to(tl.int64)  # first query row of the block
    n_q = tl.load(blk_n_ptr + b)  # valid queries in the block
    key_start = tl.load(blk_kstart_ptr + b).to(tl.int64)  # row of the sequence's key 0
    pos0 = tl.load(blk_pos_ptr + b)  # causal position of the block's first query

    r = tl.arange(0, ROWS)
    m_of_r = r // BLOCK_HI  # query of each (query, head) row
    j_of_r = r % BLOCK_HI  # head of each row
    row_ok = (m_of_r < n_q) & (j_of_r < HI)
    offs_d = tl.arange(0, BLOCK_DI)
    q_off = (q0 + m_of_r)[:, None] * (HI * DI) + j_of_r[:, None] * DI + offs_d[None, :]
    qt = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (offs_d < DI)[None, :], other=0.0)  # (ROWS, DI)
    w = tl.load(w_ptr + (q0 + m_of_r) * HI + j_of_r, mask=row_ok, other=0.0).to(tl.float32) * scale  # (ROWS,)

    if HAS_KEY_SCALES:
        qt, w = fp16_queries(qt, w)
    offs_m = tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_m  # (BM,) causal position of each query
    pos_max = pos0 + n_q - 1
    for tile in tl.static_range(TILES):
        n0 = (tl.program_id(1) * TILES + tile) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)  # key positions
        score = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
        if n0 <= pos_max:  # the tile holds a causal key of some query
            k_ok = offs_n <= pos_max
            kt = tl.load(k_ptr + (key_start + offs_n)[:, None] * DI + offs_d[None, :],
                         mask=k_ok[:, None] & (offs_d < DI)[None, :], other=0.0)  # (BN, DI)
            if PRODUCT == 1:  # KEYS_BY_HEADS: its sum over heads stays within each thread's quad
                kk = kt.to(qt.dtype)  # a no-op but for fp8 keys (to fp16)
                sc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for m in tl.static_range(BLOCK_M):
                    qm, wm = _query_heads(q_ptr, w_ptr, q0 + m, m < n_q, scale, HI, DI, BLOCK_HI, BLOCK_DI,
                                          HAS_KEY_SCALES)
                    sm = tl.sum(tl.maximum(tl.dot(kk, tl.trans(qm)), 0.0) * wm[None, :], axis=1)  # (BN,)
                    sc = tl.where((offs_m == m)[:, None], sm[None, :], sc)
            elif PRODUCT == 2:  # KEYS_BY_QUERY_HEADS: each query's heads are adjacent columns of one product
                s = tl.dot(kt.to(qt.dtype), tl.trans(qt))  # (BN, ROWS) fp32
                s = tl.maximum(s, 0.0) * w[None, :]
                sc = tl.trans(tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, BLOCK_HI)), axis=2))  # (BM, BN)
            else:
                s = tl.dot(qt, tl.trans(kt.to(qt.dtype)))  # (ROWS, BN) fp32; the cast: see kk above
                s = tl.maximum(s, 0.0) * w[:, None]
                sc = tl.sum(tl.reshape(s, (BLOCK_M, BLOCK_HI, BLOCK_N)), axis=1)  # (BM, BN): sum over heads
            if HAS_KEY_SCALES:  # fp8 keys: one scale per key, applied once after the sum over heads
                sc = sc * tl.load(ks_ptr + key_start + offs_n, mask=k_ok, other=0.0)[None, :]
            sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0
            causal = (offs_n[None, :] <= pos_m[:, None]) & (offs_m < n_q)[:, None]
            score = tl.where(causal, sc, score)
        out_row = q0 - chunk_q0 + offs_m
        tl.store(scores_ptr + out_row[:, None] * stride_scores + offs_n[None, :], score,
                 mask=(offs_m < n_q)[:, None] & (offs_n < width)[None, :])


def _plan_chunks(cu_q: list[int], cu_k: list[int], topk: int, block_m: int):
    """indexer_plan.plan_chunks at this module's CHUNK_ELEMS."""
    return plan_chunks(cu_q, cu_k, topk, block_m, CHUNK_ELEMS)


def block_queries(Hi: int, cu_q: list[int]) -> int:
    """Queries per scoring program: fill ROWS_PER_PROGRAM (query, head) rows, but no more than the longest
    sequence's queries (1 at decode), since a block never spans sequences; at least 16 rows for tl.dot."""
    block_hi = triton.next_power_of_2(Hi)
    longest = int(np.diff(cu_q).max())
    fill = max(1, ROWS_PER_PROGRAM // block_hi)
    return max(16 // block_hi, 1, min(fill, triton.next_power_of_2(max(1, longest))))


def score_rows(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """An uninitialised float32 (rows, width) view whose row stride is a multiple of 16 (one kernel variant)."""
    return torch.empty(rows, -(-width // 16) * 16, dtype=torch.float32, device=device)[:, :width]


def launch_scores(q, k, weights, scores, blocks, chunk_q0: int, width: int, scale: float, block_m: int,
                  key_scales: torch.Tensor | None = None) -> None:
    """Score one chunk: `blocks` (4, n) from `_plan_chunks` (made with the same block_m) into scores (rows, width);
    k in q's dtype, or float8_e4m3fn with key_scales (Tk,) float32 (contiguous, as `indexer_topk` passes them)."""
    Hi, Di = q.shape[1], q.shape[2]
    blocks_dev = upload(torch.from_numpy(blocks), q.device)  # (4, n_blocks)
    grid = (blocks.shape[1], triton.cdiv(width, BLOCK_N * TILES_PER_PROGRAM))
    _indexer_scores_kernel[grid](
        q, k, k if key_scales is None else key_scales, weights, scores, *blocks_dev.unbind(0), chunk_q0, width,
        scores.stride(0), scale,
        HI=Hi, DI=Di, BLOCK_HI=triton.next_power_of_2(Hi), BLOCK_DI=max(16, triton.next_power_of_2(Di)),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, TILES=TILES_PER_PROGRAM, HAS_KEY_SCALES=key_scales is not None,
        PRODUCT=PRODUCTS[SCORES_PRODUCT], num_warps=SCORES_WARPS, num_stages=SCORES_STAGES,
    )


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    scale: float,
    host_cu_seqlens: tuple[list[int], list[int]] | None = None,
    key_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal lightning-indexer top-k, same contract as `reference.indexer_topk`.

    q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi), packed by cu_seqlens_q / cu_seqlens_k (S+1,).
    Returns (Tq, topk) int64 sequence-local key positions, ascending, -1 padded. host_cu_seqlens: the same offsets
    as host lists, when the caller has them; with them the call reads nothing back from the device. k may be
    float8_e4m3fn with key_scales (Tk,) float32, one scale per key row (the keys stay fp8 up to the kernel).
    """
    if q.dim() != 3 or k.dim() != 2 or weights.shape != q.shape[:2] or q.shape[2] != k.shape[1]:
        raise ValueError(f"indexer_topk expects q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}")
    key_scales = key_scales_arg(k, key_scales, "indexer_topk")
    Tq, Hi, Di = q.shape
    out = torch.full((Tq, topk), -1, dtype=torch.long, device=q.device)
    if Tq == 0 or topk == 0:
        return out
    k = k.contiguous() if key_scales is not None else k.contiguous().to(q.dtype)  # fp8 keys: cast in the kernel
    q, weights = q.contiguous(), weights.contiguous()
    if host_cu_seqlens is None:
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    else:
        cu_q, cu_k = host_cu_seqlens
    block_m = block_queries(Hi, cu_q)
    n_valid = _query_positions(cu_seqlens_q, cu_seqlens_k, Tq)[1] + 1  # (Tq,) causal keys per query
    for r0, r1, width, blocks in _plan_chunks(cu_q, cu_k, topk, block_m):
        scores = score_rows(r1 - r0, width, q.device)  # every entry written below
        launch_scores(q, k, weights, scores, blocks, r0, width, float(scale), block_m, key_scales)
        if PREFILL_SELECT_SAMPLED and width > SAMPLED_SELECT_MIN_WIDTH:
            topk_select_sampled(scores, n_valid[r0:r1], topk, out=out[r0:r1])
        else:
            topk_select(scores, n_valid[r0:r1], topk, out=out[r0:r1])
    return out


__all__ = ["indexer_topk"]

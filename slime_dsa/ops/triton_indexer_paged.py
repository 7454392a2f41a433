"""Decode-time lightning-indexer top-k over a paged key pool (Triton), with no host sync: CUDA-graph safe.

One program scores TILES x BLOCK_N key positions of one sequence with all index heads. It reads the keys through
their pool slots, so nothing is first gathered into a packed copy, and writes float32 scores (-inf past the
sequence's length). `triton_topk.topk_select` then picks the top-k with the tie rule of `reference.py`
(equal scores prefer the lower position), positions ascending; from SPLIT_MIN_WIDTH key positions on,
`triton_topk_sampled.topk_select_sampled` does, with each row spread over many programs (same result).

The pool holds bf16 keys, or float8_e4m3fn keys with one float32 scale per slot (key = values * scale): the kernel
loads the 1-byte keys, converts them and q to fp16 (exact: `fp16_queries`) for the dot, and scales each key's score
after the sum over heads: score[n] = key_scales[n] * sum_j w_j scale relu(q_j . k_n).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_topk import topk_select
from slime_dsa.ops.triton_topk_sampled import topk_select_sampled

BLOCK_N = 64  # key positions per tile
TILES = 4  # tiles per program, q and w loaded once for them (faster at large batches: paged_indexer_variants.py)
# fp8 keys: (BLOCK_N, TILES, num_stages). H200, batch 128 x 64K: 0.370 ms against 0.483 at the bf16 keys' launch
# (64, 4, 3); bf16 keys' scoring 0.53 ms (benchmarks/RESULTS.md, 2026-12-05).
FP8_LAUNCH = (128, 8, 5)
# One program per row leaves most SMs idle on long rows at small batches (H200, 64K keys: batch 1 0.345 -> 0.035 ms,
# batch 128 0.358 -> 0.257 ms; benchmarks/paged_indexer_variants.py); short rows keep the single launch.
SPLIT_MIN_WIDTH = 8192
# The select for those rows: `triton_topk_sampled.topk_select_sampled` gives the split select's result from one full
# read of the scores instead of six (H100, batch 128 x 64K: 0.092 ms against 0.258; benchmarks/RESULTS.md, 2026-12-05).
LONG_ROW_SELECT: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = topk_select_sampled


def key_scales_arg(keys: torch.Tensor, key_scales: torch.Tensor | None, where: str) -> torch.Tensor | None:
    """key_scales, contiguous, once checked: float8_e4m3fn keys, and only they, come with (rows,) float32 scales."""
    fp8 = keys.dtype == torch.float8_e4m3fn
    if key_scales is None and not fp8:
        return None
    if not fp8 or key_scales is None or key_scales.dtype != torch.float32 or key_scales.shape != keys.shape[:1]:
        got = "none" if key_scales is None else f"{key_scales.dtype} {tuple(key_scales.shape)}"
        raise ValueError(f"{where}: float8_e4m3fn keys need key_scales, float32 of shape ({keys.shape[0]},), and other "
                         f"keys none; got keys {keys.dtype} {tuple(keys.shape)}, key_scales {got}")
    return key_scales.contiguous()


# fp8 keys are scored as the rows of the dot (keys x heads: a wgmma on Hopper, the keys converted in registers) against
# fp16 queries (e4m3 -> fp16 is one exact instruction per pair of keys; e4m3 -> bf16 goes through fp16). Compiled for
# sm_90a (tools/kernel_resources.py), 64 keys a tile: 320 instructions against 539 as heads x keys with the bf16
# conversion. bf16 keys stay heads x keys: as keys x heads they took 0.533-0.540 ms against 0.526-0.557 on the H200.
# Queries whose largest entry exceeds this are divided by a power of two first (fp16 ends at 65504; bf16 does not).
FP16_QUERY_MAX = tl.constexpr(16384.0)


@triton.jit
def fp16_queries(q, w):
    """q as fp16 for a dot with fp8 keys, and w rescaled so that relu(q . k) w is unchanged (relu(x / s) s = relu(x),
    s > 0). Exact for q's normal values, s = 1 unless q holds an entry above FP16_QUERY_MAX."""
    q = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q), axis=1), axis=0)
    shift = tl.where(amax > FP16_QUERY_MAX, tl.exp2(tl.ceil(tl.log2(amax / FP16_QUERY_MAX))), 1.0)
    return (q / shift).to(tl.float16), w * shift


@triton.jit
def _paged_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, slots_ptr, lens_ptr, scores_ptr, width, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, HAS_KEY_SCALES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    h_ok, d_ok = offs_h < HI, offs_d < DI
    q = tl.load(q_ptr + b * HI * DI + offs_h[:, None] * DI + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + b * HI + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale  # relu(s x) = relu(x) s, s > 0
    n_keys = tl.load(lens_ptr + b)
    if HAS_KEY_SCALES:
        q, w = fp16_queries(q, w)
    for tile in range(TILES):  # q and w are loaded once for several tiles
        offs_n = (tl.program_id(1) * TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_row = offs_n < width
        valid = offs_n < n_keys
        slot = tl.load(slots_ptr + b * width + offs_n, mask=in_row, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * DI + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if HAS_KEY_SCALES:  # fp8 keys as the dot's rows, scaled once after the sum over heads
            s = tl.maximum(tl.dot(k.to(q.dtype), tl.trans(q)), 0.0) * w[None, :]  # (BN, BH) fp32
            score = tl.sum(s, axis=1) * tl.load(ks_ptr + slot, mask=valid, other=0.0)  # (BN,)
        else:
            s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0) * w[:, None]  # (BH, BN) fp32
            score = tl.sum(s, axis=0)  # (BN,)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: zeros tie and break by position
        tl.store(scores_ptr + b * width + offs_n, tl.where(valid, score, float("-inf")), mask=in_row)


def paged_scores(
    q: torch.Tensor, k_pool: torch.Tensor, weights: torch.Tensor, key_slots: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, key_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer scores (B, W) float32 of every key position, -inf past seq_lens[b]; fp8 keys with key_scales (slots,)."""
    key_scales = key_scales_arg(k_pool, key_scales, "paged_scores")
    B, Hi, Di = q.shape
    width = key_slots.shape[1]
    scores = torch.empty(B, width, dtype=torch.float32, device=q.device)
    if B and width:
        fp8 = key_scales is not None
        block_n, tiles, stages = FP8_LAUNCH if fp8 else (BLOCK_N, TILES, 3)
        _paged_scores_kernel[(B, triton.cdiv(width, block_n * tiles))](
            q.contiguous(), weights.contiguous(), k_pool, k_pool if key_scales is None else key_scales,
            key_slots.contiguous(), seq_lens.contiguous(), scores, width, float(scale), HI=Hi, DI=Di,
            BLOCK_HI=max(16, triton.next_power_of_2(Hi)), BLOCK_DI=max(16, triton.next_power_of_2(Di)), BLOCK_N=block_n,
            TILES=tiles, HAS_KEY_SCALES=fp8, num_warps=4, num_stages=stages,
        )
    return scores


@torch.no_grad()
def indexer_topk_paged(
    q: torch.Tensor, k_pool: torch.Tensor, weights: torch.Tensor, key_slots: torch.Tensor, seq_lens: torch.Tensor,
    topk: int, scale: float, key_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference.indexer_topk_paged` (fp8 keys with key_scales (slots,)): (B, topk) sequence-local
    positions, ascending, -1 padded."""
    scores = paged_scores(q, k_pool, weights, key_slots, seq_lens, scale, key_scales)
    select = LONG_ROW_SELECT if scores.shape[1] >= SPLIT_MIN_WIDTH else topk_select
    return select(scores, seq_lens, topk)


__all__ = ["indexer_topk_paged", "paged_scores"]

"""The sparse MLA backward for Hopper in Gluon (issue 20 item 1): dQ, dKV or both in one kernel, with the gather and
its pipeline written out as in `gluon_sparse_mla`. The general backward calls it (both halves in one kernel) where
`supported` holds (`triton_sparse_mla.GLUON_BWD`, on):
benchmarks/sparse_mla_bwd_variants.py times it (`--modes split64_gluon_dkv gluon_split gluon_fused`) and
tests/test_ops_gpu.py checks it against the reference.

One program is one query row and 64 heads, 8 warps; each step takes 32 kv rows, gathered with cp.async one step ahead
into one of two buffers (q, dO, two kv buffers and P, dS fill 216 KB of shared memory). Per step:
- S = q k^T and dP = dO v^T (each warp group on 16 of the keys), P = exp(S scale - lse), dS = P (dP - delta) scale,
  both to shared memory as bf16;
- dQ += dS k (64 heads x 576, each warp group on half the columns, as the forward's O);
- dKV^T (576 x 32) = [dO^T P + q_nope^T dS ; q_rope^T dS]: 512 rows a tile, so wgmma reads dO and q from the same
  shared copies as the score products (64 accumulator registers a thread), added to dkv (float32) at the step's rows
  with relaxed reductions (the rows are shared between queries) of 4 floats, the tiles moved through shared memory
  (the step's kn buffer; STAGED_REDUCTIONS, the default), or of REDUCTION_WIDTH floats moved by shuffles.
Both halves in one kernel compute S, P and dS once (split64 computes them twice, 1.4x the counted work). Compiled for
sm_90a by Triton 3.6 at 255 registers: dKV alone spills nothing, dQ alone 108 bytes, both 132.
-1 slots read kv row 0 and add nothing (their P and dS are 0 and their reductions are masked).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from slime_dsa.ops.gluon_sparse_mla import (
    BLOCK_H, D_R, D_V, LOG2E, NUM_WARPS, _block_idx, _cta_barrier, _gather_ahead, _gather_first_steps, _row_end,
    _store_rows,
)
from slime_dsa.ops.gluon_sparse_mla import supported as forward_supported

BLOCK_N = 32  # kv rows a step: dKV^T's tile is 576 x BLOCK_N, and 64 does not fit beside q and dO
STAGES = 2
# A fused step issues its dQ products after dKV^T's and waits for them after the step's dkv reductions, so that the
# tensor cores work while the reductions go out. Off until timed on a GPU (sparse_mla_bwd_variants.py
# --modes gluon_fused gluon_fused_late_dq).
LATE_DQ = False
# Floats a dkv reduction adds (1, 2 or 4: the tile moved within each warp to runs along d first). 2: H100, 64K, fused
# 252 ms against 302 at 1 and 337 at 4 (whose second swap costs more than it saves; benchmarks/RESULTS.md, 2026-12-05).
REDUCTION_WIDTH = 2
# Reductions of 4 floats with the tile moved through shared memory (kn's buffer of the step, free once its products
# are done) instead of shuffles: each warp adds 512 contiguous bytes of one key's row an instruction, at the cost of
# four more barriers a step. H100, 64K, fused: 233 ms against width 2's 252 (benchmarks/RESULTS.md, 2026-12-05).
STAGED_REDUCTIONS = True


def supported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dout: torch.Tensor, v_dim: int) -> bool:
    """`gluon_sparse_mla.supported`'s shapes, with dout (T, H, 512) bf16 (dq is then like q, dkv float32 like kv)."""
    return (forward_supported(q, kv, indices, v_dim) and dout.dtype == torch.bfloat16 and dout.stride(-1) == 1
            and dout.stride(0) % 8 == 0 and dout.stride(1) % 8 == 0 and dout.data_ptr() % 16 == 0)


@gluon.jit
def _add_rows(dkv_ptr, rows, col0, tile, valid, stride_dkvt, ROW64: gl.constexpr, STORES: gl.constexpr,
              half_layout: gl.constexpr, vec_layout: gl.constexpr):
    """dkv[rows[k], col0 + d] += tile[d, k] for the valid keys k (relaxed float32 reductions; STORES: plain stores
    instead, a wrong dkv that times the kernel without its reductions). half_layout, then vec_layout (each or None):
    the tile moves to them first, within each warp, so that each reduction adds a run of 2 or 4 floats along d."""
    if half_layout is not None:
        tile = gl.convert_layout(tile, half_layout)
        rows = gl.convert_layout(rows, gl.SliceLayout(0, half_layout))
        valid = gl.convert_layout(valid, gl.SliceLayout(0, half_layout))
    if vec_layout is not None:
        tile = gl.convert_layout(tile, vec_layout)
        rows = gl.convert_layout(rows, gl.SliceLayout(0, vec_layout))
        valid = gl.convert_layout(valid, gl.SliceLayout(0, vec_layout))
    layout: gl.constexpr = tile.type.layout
    cols = col0 + gl.arange(0, tile.shape[0], gl.SliceLayout(1, layout))
    if ROW64:
        base = rows.to(gl.int64) * stride_dkvt
    else:
        base = rows * stride_dkvt
    ptrs = dkv_ptr + base[None, :] + cols[:, None]
    mask = valid[None, :] & (cols[:, None] >= 0)
    if STORES:
        gl.store(ptrs, tile, mask=mask)
    else:
        gl.atomic_add(ptrs, tile, mask=mask, sem="relaxed")


@gluon.jit
def _halves(tile):
    """tile (2n, k) as its two blocks of n rows (register renaming only where row n is a register bit)."""
    return gl.split(gl.permute(gl.reshape(tile, [2, tile.shape[0] // 2, tile.shape[1]]), (1, 2, 0)))


@gluon.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dot, stride_doh, stride_lt, stride_dqt, stride_dqh,
    stride_dkvt, K, scale, scale_log2,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SCAN: gl.constexpr,
    STAGES: gl.constexpr, DO_DQ: gl.constexpr, DO_DKV: gl.constexpr, ROW64: gl.constexpr, LATE_DQ: gl.constexpr,
    RED_STORES: gl.constexpr, RED_VEC: gl.constexpr, RED_SMEM: gl.constexpr, num_warps: gl.constexpr,
):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    WG: gl.constexpr = num_warps // 4

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, BLOCK_N // WG, 16])
    # dQ's tiles (64 heads x 512 and x 64): each warp group on half the columns, as the forward's O
    qn_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, D_V // WG, 16])
    qr_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, D_R // WG, 16])
    # dKV^T's latent tile (512 x BLOCK_N): every warp along its 512 rows; the rope tile (64 x BLOCK_N) as S
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    # With RED_VEC > 1, t_layout and s_layout (the rope tile's) with one lane bit swapped for a register bit (runs of
    # 2 along d), then (RED_VEC 4) a second: one at a time, as Triton moves a tile within the warp by shuffles for one
    # swap and through shared memory for two. Each warp still owns the same rows and columns.
    gl.static_assert(RED_VEC == 1 or (BLOCK_N == 32 and num_warps == 8 and D_V == 512 and D_R == 64))
    t_half: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [0, 8], [0, 16], [128, 0], [256, 0]],
        lane_bases=[[0, 2], [0, 4], [0, 1], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [64, 0]],
        block_bases=[], shape=[D_V, BLOCK_N]) if RED_VEC > 1 else None
    t_vec: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [0, 8], [0, 16], [128, 0], [256, 0]],
        lane_bases=[[0, 2], [0, 4], [0, 1], [8, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [64, 0]],
        block_bases=[], shape=[D_V, BLOCK_N]) if RED_VEC > 2 else None
    r_half: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [0, 8]], lane_bases=[[0, 2], [0, 4], [0, 1], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 16]], block_bases=[], shape=[D_R, BLOCK_N]) if RED_VEC > 1 else None
    r_vec: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [0, 8]], lane_bases=[[0, 2], [0, 4], [0, 1], [8, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 16]], block_bases=[], shape=[D_R, BLOCK_N]) if RED_VEC > 2 else None
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, copy_layout)
    heads_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    scan_layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    hv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V], gl.bfloat16)
    hr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)

    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], hv_sl)
    qp_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_R], hr_sl)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], hv_sl)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_V], v_sl)
    kp_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_R], r_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    if RED_SMEM:
        # dKV^T reaches runs of 4 along d through shared memory: half its rows at a time in the step's kn buffer
        # (free once the step's products are done: the next gather into it follows the next step's first barrier),
        # the rope tile in 8 KB of its own (224 KB in all).
        gl.static_assert(not LATE_DQ and RED_VEC == 1 and D_V == 512 and BLOCK_N == 32)
        # d contiguous, its 4-float chunks swizzled by the key: a wgmma-layout store (8 d x 4 keys) hits 32 banks
        stage_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[0, 1])
        stage = kn_smem._reinterpret(gl.float32, [STAGES, D_V // 2, BLOCK_N], stage_sl)
        rstage = gl.allocate_shared_memory(gl.float32, [D_R, BLOCK_N], stage_sl)
        # a warp's reduction adds 128 contiguous floats of one key's row (64 and two keys for the rope tile)
        red_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
        rred_layout: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, num_warps], [0, 1])

    heads = h0 + gl.arange(0, BLOCK_H, rows_layout)
    cols_v = gl.arange(0, D_V, gl.SliceLayout(0, copy_layout))
    q_rows = q_ptr + t * stride_qt + heads.to(gl.int64)[:, None] * stride_qh
    cp.async_copy_global_to_shared(qn_smem, q_rows + cols_v[None, :])
    cp.async_copy_global_to_shared(qp_smem, q_rows + D_V + gl.arange(0, D_R, gl.SliceLayout(0, copy_layout))[None, :])
    cp.async_copy_global_to_shared(do_smem, dout_ptr + t * stride_dot + heads.to(gl.int64)[:, None] * stride_doh
                                   + cols_v[None, :])
    # Rows without keys have lse = -inf: +inf makes every P of theirs 0.
    lse = gl.load(lse_ptr + t * stride_lt + h0 + gl.arange(0, BLOCK_H, heads_layout))
    lse = gl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # log2 domain
    delta = gl.load(delta_ptr + t * stride_lt + h0 + gl.arange(0, BLOCK_H, heads_layout))

    idx_row = idx_ptr + t * stride_it
    k_end = _row_end(idx_row, K, SCAN, scan_layout)
    idx_next = _gather_first_steps(kn_smem, kp_smem, kv_ptr, idx_row, k_end, stride_kvt, copy_layout, ROW64)

    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    t_zero = gl.zeros([D_V, BLOCK_N], gl.float32, t_layout)
    r_zero = gl.zeros([D_R, BLOCK_N], gl.float32, s_layout)
    dq_n = gl.zeros([BLOCK_H, D_V], gl.float32, qn_layout)
    dq_r = gl.zeros([BLOCK_H, D_R], gl.float32, qr_layout)
    n_steps = gl.cdiv(k_end, BLOCK_N)
    for j in range(n_steps):
        buf = j % STAGES
        idx_s = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, gl.SliceLayout(0, s_layout))
        # step j's rows (and, at j = 0, q and dO) in shared memory; every warp group past step j - 1's products
        idx_next = _gather_ahead(kn_smem, kp_smem, kv_ptr, idx_row, idx_next, j, n_steps, k_end, stride_kvt,
                                 copy_layout, ROW64)

        kn = kn_smem.index(buf)
        s = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_smem, kp_smem.index(buf).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        p = gl.where((idx_s >= 0)[None, :], gl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        if DO_DKV:
            p_smem.store(p.to(gl.bfloat16))
        ds_smem.store(ds.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # P and dS are whole

        if DO_DQ and not LATE_DQ:
            dq_n = warpgroup_mma(ds_smem, kn, dq_n, is_async=True)
            dq_r = warpgroup_mma(ds_smem, kp_smem.index(buf), dq_r, is_async=True)
        if DO_DKV:
            dkv_t = warpgroup_mma(do_smem.permute((1, 0)), p_smem, t_zero, use_acc=False, is_async=True)
            dkv_t = warpgroup_mma(qn_smem.permute((1, 0)), ds_smem, dkv_t, is_async=True)
            dkr_t = warpgroup_mma(qp_smem.permute((1, 0)), ds_smem, r_zero, use_acc=False, is_async=True)
            if LATE_DQ:  # issued after dKV^T's, so that they run on the tensor cores while the step's reductions go out
                dq_n = warpgroup_mma(ds_smem, kn, dq_n, is_async=True)
                dq_r = warpgroup_mma(ds_smem, kp_smem.index(buf), dq_r, is_async=True)
                dkv_t, dkr_t = warpgroup_mma_wait(num_outstanding=2, deps=(dkv_t, dkr_t))
            else:
                dkv_t, dkr_t = warpgroup_mma_wait(num_outstanding=0, deps=(dkv_t, dkr_t))
            if RED_SMEM:
                _cta_barrier()  # both warp groups' products are done with kn's buffer: it stages the tiles
                idx_c = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, gl.SliceLayout(0, red_layout))
                idx_r = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, gl.SliceLayout(0, rred_layout))
                lo, hi = _halves(dkv_t)
                stage.index(buf).store(lo)
                rstage.store(dkr_t)
                _cta_barrier()
                _add_rows(dkv_ptr, idx_c, 0, stage.index(buf).load(red_layout), idx_c >= 0, stride_dkvt, ROW64,
                          RED_STORES, None, None)
                _add_rows(dkv_ptr, idx_r, D_V, rstage.load(rred_layout), idx_r >= 0, stride_dkvt, ROW64,
                          RED_STORES, None, None)
                _cta_barrier()  # every warp has read the low half
                stage.index(buf).store(hi)
                _cta_barrier()
                _add_rows(dkv_ptr, idx_c, D_V // 2, stage.index(buf).load(red_layout), idx_c >= 0, stride_dkvt,
                          ROW64, RED_STORES, None, None)
            else:
                idx_t = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, gl.SliceLayout(0, t_layout))
                _add_rows(dkv_ptr, idx_t, 0, dkv_t, idx_t >= 0, stride_dkvt, ROW64, RED_STORES, t_half, t_vec)
                _add_rows(dkv_ptr, idx_s, D_V, dkr_t, idx_s >= 0, stride_dkvt, ROW64, RED_STORES, r_half, r_vec)
        if DO_DQ:
            dq_n, dq_r = warpgroup_mma_wait(num_outstanding=0, deps=(dq_n, dq_r))
    cp.wait_group(0)

    if DO_DQ:
        dq_rows = dq_ptr + t * stride_dqt
        _store_rows(dq_rows, h0, stride_dqh, 0, dq_n)
        _store_rows(dq_rows, h0, stride_dqh, D_V, dq_r)


def sparse_mla_bwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, scale: float, dq: torch.Tensor | None, dkv: torch.Tensor | None, *,
    late_dq: bool | None = None, timing_only_stores: bool = False, reduction_width: int | None = None,
    staged_reductions: bool | None = None,
) -> None:
    """Writes the attention's q gradient into dq (T, H, 576) and/or adds its kv gradient into dkv (Tk, 576) float32
    (None skips that half): q (T, H, 576), dout (T, H, 512), lse and delta = rowsum(dout * out) (T, H) float32
    (`supported` holds). Both halves at once share S, P and dS; apart, each recomputes them (split64's way).
    late_dq (default LATE_DQ) overlaps a fused step's dQ products with its dKV reductions; timing_only_stores writes
    a wrong dkv with plain stores (the benchmark's measure of what the reductions cost); staged_reductions (default
    STAGED_REDUCTIONS) adds runs of 4 moved through shared memory, instead of reduction_width's shuffles."""
    T, H, _ = q.shape
    K = indices.shape[1]
    if T == 0 or (dq is None and dkv is None):
        return
    if (dq is not None and (dq.shape != q.shape or dq.stride(-1) != 1)) or (
            dkv is not None and (dkv.dtype != torch.float32 or dkv.shape != kv.shape or dkv.stride(-1) != 1)):
        raise ValueError("gluon sparse_mla_bwd: dq must be like q and dkv float32 like kv, each with unit last stride")
    late_dq = dq is not None and dkv is not None and (LATE_DQ if late_dq is None else late_dq)
    if staged_reductions is None:  # the default: staged unless the call asks for shuffles or late dQ
        staged = STAGED_REDUCTIONS and reduction_width is None and not late_dq
    else:
        staged = staged_reductions
    if staged and (late_dq or reduction_width not in (None, 4)):
        raise ValueError(f"gluon sparse_mla_bwd: staged reductions add 4 floats and need kn's buffer free (got "
                         f"late_dq={late_dq}, reduction_width={reduction_width})")
    lse, delta = lse.contiguous(), delta.contiguous()
    dq_arg = q if dq is None else dq  # an unused pointer argument when DO_DQ is off
    dkv_arg = kv if dkv is None else dkv
    _sparse_mla_bwd_kernel[(T, H // BLOCK_H)](
        q, kv, indices, dout, lse, delta, dq_arg, dkv_arg,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
        dq_arg.stride(0), dq_arg.stride(1), dkv_arg.stride(0), K, scale, scale * LOG2E,
        D_V=D_V, D_R=D_R, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, SCAN=min(triton.next_power_of_2(K), 1024),
        STAGES=STAGES, DO_DQ=dq is not None, DO_DKV=dkv is not None,
        LATE_DQ=late_dq, RED_STORES=timing_only_stores, RED_SMEM=staged,
        RED_VEC=1 if staged else REDUCTION_WIDTH if reduction_width is None else reduction_width,
        ROW64=max(kv.numel(), dkv_arg.numel()) >= 2**31, num_warps=NUM_WARPS,
    )

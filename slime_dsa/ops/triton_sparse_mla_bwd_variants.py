"""Variants of the general (atomic) sparse MLA backward, selectable as modes of `triton_sparse_mla.BWD_MODES`.

The general backward (`triton_sparse_mla._sparse_mla_bwd_kernel`) runs one program per query row and 32 heads:
at 32 heads its tensor-core tiles have 32 rows, too few for Hopper's wgmma (64 rows per warpgroup), so every
product is an mma.sync; and 64 heads do not fit in shared memory because its dKV products (dS^T @ q, P^T @ dO)
take q and dO as the other operand of an mma.sync, so both sit in shared memory twice (311 KB). The variants:
- 64 heads per program (each query's kv rows gathered and its dKV added once, not twice), with dKV computed
  transposed, dKV^T (D, BN) = q^T @ dS: 512 tile rows, so a wgmma that reads q and dO from the same shared copy
  as the score products do.
- dKV added either by `tl.atomic_add` (Triton 3.6 converts the tile through shared memory to a layout of 4
  consecutive columns per thread and emits red.global.add.v4.f32) or by inline PTX `red.global.add` straight from
  the tensor-core layout ("red": no conversion scratch; two adjacent columns go as one v2 red, sm_90+; "red4": lane
  pairs swap halves first so that four adjacent columns go as one v4 red; CUDA only, not in Triton's interpreter).
- "rot": each row's key loop starts at a block chosen by its row number and wraps, so neighbouring queries, whose
  ascending index rows overlap, do not add to the same kv rows at the same moment.
- split: dQ alone (no atomics) and dKV alone (no dQ accumulator, so more keys per step), at 64 heads; "par" runs
  the two on two streams at once.
Every variant stops at a row's last used slot when `SKIP_EMPTY_SLOTS` is set and masks -1 slots before it.
benchmarks/sparse_mla_bwd_variants.py checks and times them at GLM-5 sizes; tools/kernel_resources.py compiles them
for sm_90a without a GPU (shared memory, registers, spills).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_sparse_mla_launch import (
    LOG2E, KernelConfig, _chosen, _launch, _pow2, _scan_block, _used_slots_end,
)

# dkv[base + 4 * col] += val for two elements: one v2 red when their addresses are adjacent and 8-byte aligned (sm_90+),
# else one red each; an element whose row or column mask is 0 adds nothing. Operands: $0 $1 dummy outputs, $2 $3 row
# base addresses, $4 $5 columns, $6 $7 values, $8 $9 row masks, $10 $11 column masks. Bases and columns come in
# broadcast, so a thread keeps one register per distinct row and column rather than a 64-bit address per element.
_RED_ADD_F32X2 = tl.constexpr("""{
.reg .pred m0, m1, c0, c1, pv, pn;
.reg .b64 a0, a1, nxt, low;
setp.ne.b32 m0, $8, 0;
setp.ne.b32 m1, $9, 0;
setp.ne.b32 c0, $10, 0;
setp.ne.b32 c1, $11, 0;
and.pred m0, m0, c0;
and.pred m1, m1, c1;
mad.wide.s32 a0, $4, 4, $2;
mad.wide.s32 a1, $5, 4, $3;
add.s64 nxt, a0, 4;
and.b64 low, a0, 7;
setp.eq.and.s64 pv, nxt, a1, m0;
setp.eq.and.s64 pv, low, 0, pv;
and.pred pv, pv, m1;
not.pred pn, pv;
and.pred m0, m0, pn;
and.pred m1, m1, pn;
@pv red.global.add.v2.f32 [a0], {$6, $7};
@m0 red.global.add.f32 [a0], $6;
@m1 red.global.add.f32 [a1], $7;
mov.b32 $0, 0;
mov.b32 $1, 0;
}""")


# The same for four elements, packed as a tensor-core accumulator holds them: (row g, columns 2c and 2c+1) and
# (row g+8, the same columns), c = lane % 4. Lanes 2k and 2k+1 swap half of them (shfl.bfly 1): the even lane keeps
# row g and takes its partner's two columns of row g, the odd one keeps row g+8 and takes its partner's, so each holds
# four adjacent columns: one v4 red when their addresses are adjacent and 16-byte aligned, else one red each. Every
# (address, value, mask) triple moves whole, so each element is added exactly once whatever the layout; only the v4
# needs the layout above. Operands: $0-$3 dummy outputs, $4-$7 row bases, $8-$11 columns, $12-$15 values,
# $16-$19 row masks, $20-$23 column masks. All lanes of a warp must run it together (no divergent branch around it).
_RED_ADD_F32X4 = tl.constexpr("""{
.reg .pred odd, p4, q, f0, f1, f2, f3;
.reg .b32 lane, m0, m1, m2, m3, sv0, sv1, sm0, sm1, rv0, rv1, rm0, rm1, v0, v1, v2, v3, k0, k1, k2, k3, lo, hi;
.reg .b64 a0, a1, a2, a3, sa0, sa1, ra0, ra1, b0, b1, b2, b3, t;
and.b32 m0, $16, $20;
and.b32 m1, $17, $21;
and.b32 m2, $18, $22;
and.b32 m3, $19, $23;
mad.wide.s32 a0, $8, 4, $4;
mad.wide.s32 a1, $9, 4, $5;
mad.wide.s32 a2, $10, 4, $6;
mad.wide.s32 a3, $11, 4, $7;
mov.u32 lane, %laneid;
and.b32 lane, lane, 1;
setp.ne.b32 odd, lane, 0;
selp.b32 sv0, $12, $14, odd;
selp.b32 sv1, $13, $15, odd;
selp.b32 sm0, m0, m2, odd;
selp.b32 sm1, m1, m3, odd;
selp.b64 sa0, a0, a2, odd;
selp.b64 sa1, a1, a3, odd;
shfl.sync.bfly.b32 rv0, sv0, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 rv1, sv1, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 rm0, sm0, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 rm1, sm1, 1, 0x1f, 0xffffffff;
mov.b64 {lo, hi}, sa0;
shfl.sync.bfly.b32 lo, lo, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 hi, hi, 1, 0x1f, 0xffffffff;
mov.b64 ra0, {lo, hi};
mov.b64 {lo, hi}, sa1;
shfl.sync.bfly.b32 lo, lo, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 hi, hi, 1, 0x1f, 0xffffffff;
mov.b64 ra1, {lo, hi};
selp.b64 b0, ra0, a0, odd;
selp.b64 b1, ra1, a1, odd;
selp.b64 b2, a2, ra0, odd;
selp.b64 b3, a3, ra1, odd;
selp.b32 v0, rv0, $12, odd;
selp.b32 v1, rv1, $13, odd;
selp.b32 v2, $14, rv0, odd;
selp.b32 v3, $15, rv1, odd;
selp.b32 k0, rm0, m0, odd;
selp.b32 k1, rm1, m1, odd;
selp.b32 k2, m2, rm0, odd;
selp.b32 k3, m3, rm1, odd;
setp.ne.b32 f0, k0, 0;
setp.ne.b32 f1, k1, 0;
setp.ne.b32 f2, k2, 0;
setp.ne.b32 f3, k3, 0;
and.pred p4, f0, f1;
and.pred p4, p4, f2;
and.pred p4, p4, f3;
add.s64 t, b0, 4;
setp.eq.and.s64 p4, t, b1, p4;
add.s64 t, b0, 8;
setp.eq.and.s64 p4, t, b2, p4;
add.s64 t, b0, 12;
setp.eq.and.s64 p4, t, b3, p4;
and.b64 t, b0, 15;
setp.eq.and.s64 p4, t, 0, p4;
not.pred q, p4;
and.pred f0, f0, q;
and.pred f1, f1, q;
and.pred f2, f2, q;
and.pred f3, f3, q;
@p4 red.global.add.v4.f32 [b0], {v0, v1, v2, v3};
@f0 red.global.add.f32 [b0], v0;
@f1 red.global.add.f32 [b1], v1;
@f2 red.global.add.f32 [b2], v2;
@f3 red.global.add.f32 [b3], v3;
mov.b32 $0, 0;
mov.b32 $1, 0;
mov.b32 $2, 0;
mov.b32 $3, 0;
}""")


@triton.jit
def _red_add4(base, cols, vals, row_mask, col_mask):
    """`_red_add` with lane pairs swapping halves so that each thread adds four adjacent columns as one v4 red."""
    tl.inline_asm_elementwise(_RED_ADD_F32X4, "=r,=r,=r,=r" + ",l" * 4 + ",r" * 16,
                              [base.to(tl.int64), cols, vals, row_mask.to(tl.int32), col_mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _red_add(base, cols, vals, row_mask, col_mask):
    """dkv[base + cols] += vals where row_mask & col_mask (base: float32 pointers, broadcast against cols), in the
    layout vals already have (no conversion through shared memory)."""
    tl.inline_asm_elementwise(_RED_ADD_F32X2, "=r,=r,l,l,r,r,r,r,r,r,r,r",
                              [base.to(tl.int64), cols, vals, row_mask.to(tl.int32), col_mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=2)


# RED value of a launch that writes its dKV tiles with plain stores: the sums are wrong (a kv row keeps the last
# tile written to it), so only TIMING_ONLY launches use it, to time the dKV kernel without its atomics.
RED_STORES = 3


@triton.jit
def _add_dkv(base, cols, vals, row_mask, col_mask, RED: tl.constexpr):
    """dkv[base + cols] += vals where both masks hold: RED 0 tl.atomic_add, 1 PTX v2 reds, 2 PTX v4 reds;
    RED_STORES (timing only) dkv[base + cols] = vals."""
    if RED == 3:
        tl.store(base + cols, vals, mask=row_mask & col_mask)
    elif RED == 2:
        _red_add4(base, cols, vals, row_mask, col_mask)
    elif RED == 1:
        _red_add(base, cols, vals, row_mask, col_mask)
    else:
        tl.atomic_add(base + cols, vals, mask=row_mask & col_mask, sem="relaxed")


@triton.jit
def _bwd_variant_kernel(
    q_ptr, kv_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dot, stride_doh, stride_lt,
    stride_dqt, stride_dqh, stride_dkvt,
    H, K, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DO_DQ: tl.constexpr, DO_DKV: tl.constexpr,
    DKV_T: tl.constexpr, RED: tl.constexpr, ROTATE: tl.constexpr, SCAN: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):
    """Gradients for one query row and a block of heads: dQ (stored) and/or dKV (added), as the module says."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    mask_v = offs_v < D_V
    mask_r = offs_r < D_R
    mask_hv = mask_h[:, None] & mask_v[None, :]
    mask_hr = mask_h[:, None] & mask_r[None, :]

    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_v[None, :], mask=mask_hv, other=0.0)  # (BH, DV)
    q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_hr, other=0.0)  # (BH, DR)
    do = tl.load(dout_ptr + t * stride_dot + offs_h[:, None] * stride_doh + offs_v[None, :], mask=mask_hv, other=0.0)
    # Padded heads and rows without keys get lse = +inf, so every probability below is exactly 0.
    lse = tl.load(lse_ptr + t * stride_lt + offs_h, mask=mask_h, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # (BH,) log2 domain
    delta = tl.load(delta_ptr + t * stride_lt + offs_h, mask=mask_h, other=0.0)  # (BH,)

    dq_nope = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    dq_pe = tl.zeros([BLOCK_H, BLOCK_DR], tl.float32)
    k_end = K
    if SKIP_EMPTY:
        k_end = _used_slots_end(idx_ptr + t * stride_it, 0, K, SCAN)
    n_blocks = tl.cdiv(k_end, BLOCK_N)
    first = 0
    if ROTATE:
        first = (t % tl.maximum(n_blocks, 1)).to(tl.int32)
    for j in range(0, n_blocks):
        blk = j + first
        blk = tl.where(blk >= n_blocks, blk - n_blocks, blk)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * stride_it + offs_n, mask=offs_n < K, other=-1)  # (BN,) K: see the forward
        valid = idx >= 0
        row = tl.where(valid, idx, 0).to(tl.int64)
        kv_rows = kv_ptr + row[:, None] * stride_kvt
        k_nope = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)  # (BN, DV)
        k_pe = tl.load(kv_rows + D_V + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)  # (BN, DR)

        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))  # (BH, BN)
        p = tl.exp2(s * scale_log2 - lse[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_nope))  # (BH, BN): dO . V with V = kv[:, :D_V]
        ds = (p * (dp - delta[:, None]) * scale).to(k_nope.dtype)  # dL/d(q.k)

        if DO_DQ:
            dq_nope += tl.dot(ds, k_nope)
            dq_pe += tl.dot(ds, k_pe)
        if DO_DKV:
            dkv_rows = dkv_ptr + row * stride_dkvt  # (BN,)
            if DKV_T:  # key + value gradient, transposed: (DV, BN) and (DR, BN)
                dk_nope = tl.dot(tl.trans(q_nope), ds) + tl.dot(tl.trans(do), p.to(do.dtype))
                dk_pe = tl.dot(tl.trans(q_pe), ds)
                _add_dkv(dkv_rows[None, :], offs_v[:, None], dk_nope, valid[None, :], mask_v[:, None], RED)
                _add_dkv(dkv_rows[None, :], D_V + offs_r[:, None], dk_pe, valid[None, :], mask_r[:, None], RED)
            else:  # (BN, DV) and (BN, DR)
                dk_nope = tl.dot(tl.trans(ds), q_nope) + tl.dot(tl.trans(p.to(do.dtype)), do)
                dk_pe = tl.dot(tl.trans(ds), q_pe)
                _add_dkv(dkv_rows[:, None], offs_v[None, :], dk_nope, valid[:, None], mask_v[None, :], RED)
                _add_dkv(dkv_rows[:, None], D_V + offs_r[None, :], dk_pe, valid[:, None], mask_r[None, :], RED)

    if DO_DQ:
        dq_rows = dq_ptr + t * stride_dqt + offs_h[:, None] * stride_dqh
        tl.store(dq_rows + offs_v[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=mask_hv)
        tl.store(dq_rows + D_V + offs_r[None, :], dq_pe.to(dq_ptr.dtype.element_ty), mask=mask_hr)


@dataclass(frozen=True)
class Launch:
    """One kernel of a backward mode: the halves it computes, how it forms and adds dKV, the configs to try."""

    kind: str  # the `_chosen` key of its config
    do_dq: bool
    do_dkv: bool
    dkv_t: bool  # dKV^T = q^T @ dS (wgmma-sized at 64 heads) instead of dS^T @ q
    red: int  # 0 tl.atomic_add; inline PTX from the tensor-core layout (CUDA only, see red_fits): 1 v2 reds, 2 v4 reds
    rotate: bool  # start each row's key loop at a block set by its row number
    configs: tuple[KernelConfig, ...]


# Ordered by what Triton 3.6 compiles for sm_90a at GLM-5 sizes (64 heads, 512 + 64, bf16, tl.atomic_add builds):
# shared memory and bytes spilled per thread, all at 255 registers (the H200 decides on time:
# benchmarks/sparse_mla_bwd_variants.py). The red builds of the first entries spill 564 B (fused64), 44 B (dkv64)
# and nothing (fused32), and need less shared memory (no conversion scratch).
# No single-stage configs of the 64-head kernels that add dKV: on the H200 (2026-12-03, RESULTS.md) every one measured
# either hit an illegal memory access or returned a wrong dKV (rel L2 485 or NaN), at 200+ B spilled per thread;
# the same kernels at two stages were correct. The cause is not found.
FUSED64 = (KernelConfig(64, 16, 8, 2),  # 188 KB, 424 B spilled
           KernelConfig(64, 32, 8, 2))  # 224 KB (Hopper's limit is 227 KB), 756 B
DQ64 = (KernelConfig(64, 32, 8, 1),  # 172 KB, 92 B
        KernelConfig(64, 16, 8, 1),  # 154 KB, 368 B
        KernelConfig(64, 64, 8, 1))  # 208 KB, 276 B
# dKV: (64, 32, 8, 2) first, the fastest on the H200 at 8K and 32K (32.37 and 141.66 ms; RESULTS.md, 2026-12-03); with
# (64, 16, 8, 2) first, split64's backward at 32K took 274 ms against fused's 241.
DKV64 = (KernelConfig(64, 32, 8, 2),  # 224 KB, 196 B
         KernelConfig(64, 16, 8, 2),  # 188 KB, none
         # one warpgroup: the score products (64 rows) read q and dO from shared memory once, not once per
         # warpgroup, at the cost of registers
         KernelConfig(64, 16, 4, 2),  # 180 KB, 444 B
         KernelConfig(64, 32, 4, 2))  # 216 KB, 884 B
FUSED32 = (KernelConfig(32, 32, 8, 1), KernelConfig(32, 16, 4, 1))  # 132 KB, 28 B; 100 KB, 460 B


def _fused(kind: str, red: int, rotate: bool, dkv_t: bool = True, configs=FUSED64) -> tuple[Launch, ...]:
    return (Launch(kind, True, True, dkv_t, red, rotate, configs),)


def _split(kind: str, red: int, rotate: bool) -> tuple[Launch, ...]:
    return (Launch("bwd_v_dq64", True, False, True, 0, False, DQ64),
            Launch(kind, False, True, True, red, rotate, DKV64))


MODES: dict[str, tuple[Launch, ...]] = {
    "fused64": _fused("bwd_v_fused64", red=0, rotate=False),
    "fused64_rot": _fused("bwd_v_fused64_rot", red=0, rotate=True),
    "fused64_red": _fused("bwd_v_fused64_red", red=1, rotate=False),
    "fused64_red_rot": _fused("bwd_v_fused64_red_rot", red=1, rotate=True),
    "split64": _split("bwd_v_dkv64", red=0, rotate=False),
    "split64_rot": _split("bwd_v_dkv64_rot", red=0, rotate=True),
    "split64_red_rot": _split("bwd_v_dkv64_red_rot", red=1, rotate=True),
    "split64_par": _split("bwd_v_dkv64", red=0, rotate=False),  # split64 with its two kernels side by side
    "fused32_red": _fused("bwd_v_fused32_red", red=1, rotate=False, dkv_t=False, configs=FUSED32),
    "fused32_red4": _fused("bwd_v_fused32_red4", red=2, rotate=False, dkv_t=False, configs=FUSED32),
    "fused32_rot": _fused("bwd_v_fused32_rot", red=0, rotate=True, dkv_t=False, configs=FUSED32),
}


# Not backward modes (their dKV is wrong): split64 with the dKV kernel's atomics replaced by plain stores, for
# benchmarks/sparse_mla_bwd_variants.py to time what the atomics cost (--modes split64_stores): the time any atomic-free
# dKV scheme of the same kernel could at best reach.
TIMING_ONLY: dict[str, tuple[Launch, ...]] = {
    "split64_stores": (MODES["split64"][0], Launch("bwd_v_dkv64_stores", False, True, True, RED_STORES, False, DKV64)),
}


# Split modes whose dQ kernel runs on a side stream while the dKV kernel runs (CUDA): an SM that the atomic-bound dKV
# kernel leaves takes dQ programs (tensor-core bound), so the two overlap instead of running one after the other.
PARALLEL = {"split64_par"}


def cuda_only(mode: str) -> bool:
    """True for modes that use inline PTX, which Triton's interpreter cannot run."""
    return any(launch.red for launch in MODES[mode])


def red_fits(red: int, dkv_t: bool, cfg: KernelConfig, block_dv: int, block_dr: int) -> bool:
    """Whether the inline PTX reduction may add this launch's dKV tiles: only where each tile element lives in one
    thread. tl.atomic_add skips the replicas a small tile has when its tensor-core layout covers more than the
    tile; the inline asm cannot, so it would add them twice. Checked on Triton 3.6's sm_90 layouts: transposed
    tiles (128 k, BN) and (64, BN) at 4 or 8 warps, BN 16 to 64; untransposed (BN, 512) and (BN, 64) at 8 warps x
    32 keys and 4 warps x 16 keys. Any other shape takes tl.atomic_add. The v4 form (red 2) pairs columns, so only
    the untransposed tiles (whose thread-held pairs run along columns)."""
    if dkv_t:
        if red == 2:
            return False
        return cfg.num_warps in (4, 8) and block_dv % 128 == 0 and block_dr == 64 and cfg.block_n in (16, 32, 64)
    return (block_dv, block_dr) == (512, 64) and (cfg.num_warps, cfg.block_n) in ((8, 32), (4, 16))


def launch_variant(launch: Launch, cfg: KernelConfig, q, kv, indices, dout, lse, delta, dq, dkv,
                   scale: float, v_dim: int, skip_empty: bool = True):
    """One launch: dq (written) and/or dkv (float32, added to) for all query rows; returns the compiled kernel.
    skip_empty: key loops stop at a row's last used slot (triton_sparse_mla.SKIP_EMPTY_SLOTS)."""
    T, H, D = q.shape
    block_h = min(cfg.block_h, _pow2(H))
    block_dv, block_dr = _pow2(v_dim), _pow2(D - v_dim)
    fits = launch.red == RED_STORES or red_fits(launch.red, launch.dkv_t, cfg, block_dv, block_dr)
    red = launch.red if launch.do_dkv and fits else 0
    return _bwd_variant_kernel[(T, triton.cdiv(H, block_h))](
        q, kv, indices, dout, lse, delta, dq, dkv,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), dout.stride(0), dout.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1), dkv.stride(0),
        H, indices.shape[1], scale, scale * LOG2E,
        D_V=v_dim, D_R=D - v_dim, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
        BLOCK_H=block_h, BLOCK_N=cfg.block_n, DO_DQ=launch.do_dq, DO_DKV=launch.do_dkv,
        DKV_T=launch.dkv_t, RED=red, ROTATE=launch.rotate,
        SCAN=_scan_block(indices.shape[1]), SKIP_EMPTY=skip_empty,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def run_mode(mode: str, key: tuple, q, kv, indices, dout, lse, delta, dq, dkv, scale: float, v_dim: int,
             skip_empty: bool = True) -> None:
    """The backward of `mode`: each of its launches with the first of its configs that works (kept for `key`).

    dkv (float32) must be zero on entry; raises RuntimeError when a launch has no config that fits."""
    if cuda_only(mode) and q.device.type != "cuda":
        raise RuntimeError(f"backward mode {mode} uses inline PTX: CUDA only")

    def run_launch(launch: Launch) -> None:
        def run(cfg: KernelConfig) -> None:
            if launch.do_dkv:
                dkv.zero_()  # a failed attempt may have added into it
            launch_variant(launch, cfg, q, kv, indices, dout, lse, delta, dq, dkv, scale, v_dim, skip_empty)

        _launch(launch.kind, key, list(launch.configs), run)

    if mode in PARALLEL and q.device.type == "cuda":
        first, *rest = MODES[mode]
        main = torch.cuda.current_stream(q.device)
        side = torch.cuda.Stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run_launch(first)
        for launch in rest:
            run_launch(launch)
        main.wait_stream(side)  # dq is ready for whatever the main stream does next
        return
    for launch in MODES[mode]:
        run_launch(launch)


def force_mode(mode: str | None, key: tuple) -> None:
    """Make `sparse_mla_bwd` use `mode` for problems of `key` (H, D, v_dim, dtype); None forgets the choice."""
    if mode is None:
        _chosen.pop(("bwd_mode", key), None)
    else:
        _chosen[("bwd_mode", key)] = mode


__all__ = ["MODES", "TIMING_ONLY", "RED_STORES", "Launch", "launch_variant", "run_mode", "cuda_only", "force_mode"]

"""Candidate variants of the sparse MLA forward (issue 20, item 2: >= 350 TFLOP/s at GLM-5 sizes on the H200).

Same contract as `triton_sparse_mla._sparse_mla_fwd_kernel` (one program per query row and head block, -1 slots
masked, the stop at a row's last used slot, the decode key split, lse = -inf and out = 0 for rows without keys);
`triton_sparse_mla.FWD_VARIANT = "<name>"` routes the non-invariant forward here; by default prefill rows with 64+
heads come here as `triton_sparse_mla.PREFILL_FWD_VARIANT` (idx_reg). The invariant forward never does.

Why the current kernel sits at ~230 TFLOP/s (its sm_90 TTGIR and SASS, compiled here without a GPU by Triton 3.6, the
H200's version, and 3.8, with the H200's argument specialisations): the kv gather is cp.async into two buffers, but
Triton's pipeliner issues the gather of step i + 1 at the end of step i, after a synchronous load of step i + 1's
indices (the gather's address depends on a load of its own iteration), and step i + 1 begins by waiting for it. Only
the PV wgmma of step i overlaps that index load and gather, so each step pays most of a memory round trip. The
RESULTS sweep agrees: 32 keys a step took 13.6 ms at 8K against 9.5 ms at 64 (twice the steps, twice the exposed
latency: ~43% of the 64-key time). Compiled with 3.6 for sm_90 (registers, spills, shared memory; loop body in SASS):
current 255 / 0 / 217 KB; idx_reg 32 keys 4 stages 211 / 0 / 224 KB, two gathers in flight, 694 instructions a step;
idx_reg 64 keys 243 / 0 / 224 KB; every variant compiles except `ws` at 4 warps. The variants:
- `idx_reg`: the program's whole index range (up to IDX_REG_MAX_SLOTS slots) loaded once into registers; each step
  takes its slice with tl.gather, so the gather's address depends on no load in the loop and the pipeliner keeps
  1-2 gathers in flight while a step computes (32 keys a step, 3-4 stages: 188-224 KB of shared memory). Expected
  the winner; at 64 keys (2 buffers) it only saves the index load. The slice wraps inside the range (`_idx_slice`:
  the pipeliner's steps past the loop's end read past the block's shared memory otherwise: the likely cause of the
  H200's illegal memory access of 2026-12-03).
- `idx_reg_nomask`: the same, -1 slots reading kv row 0 with no mask (their scores are masked, p = 0); fewer
  predicate registers; kv must be finite (0 * inf = nan), which the model's kv is.
- `exact`: no dimension masks when D_V and D_R are powers of two, int32 row offsets when kv fits, int32 indices
  (fewer address registers); same schedule as the current kernel.
- `exact_nomask`: `exact` with the unmasked -1 rows of `idx_reg_nomask`.
- `split_v`: the value columns as two 256-wide accumulators and PV dots, QK as three dots (FlashMLA's split over its
  two consumer warp groups; Triton already gives each of the two warp groups 256 columns, so maybe no change).
- `lazy`: skip the accumulator rescale in steps where no row max grew (FA3); saves 128 multiplies a thread a step.
- `idx_ahead`: the next step's indices loaded one step ahead (loop-carried); the pipeliner then turns them into
  cp.async too, so the gather no longer waits for a synchronous index load; it is still issued at the step's end.
- `idx_ahead_nomask_lazy`: the three together at 64 keys a step.
- `exact16`: 16 warps: 64 accumulator registers a thread instead of 128, narrower QK wgmmas (4 warp groups).
- `prefetch`: next step's kv rows loaded into registers before this step's dots (register double buffer): issued
  early, but no cp.async and 300-480 bytes of spills (3.6); kept as the counter-example.
- `ws`: `tl.range(..., warp_specialize=True)`. On sm_90 this goes to Meta's Hopper auto warp specialisation
  (`add_hopper_warpspec`), written for TMA-fed matmul loops: compiled here (3.6 and 3.8) it changes nothing at 8
  warps (same TTGIR as without) and the pass fails at 4 warps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime_dsa.ops.triton_sparse_mla_launch import KernelConfig, _used_slots_end


@dataclass(frozen=True)
class FwdVariant:
    """Compile-time switches of `_fwd_variant_kernel` and the launch configs to try, fastest-expected first."""

    name: str
    configs: list[KernelConfig]
    exact: bool = False  # no dimension masks when the dims are powers of two; int32 rows and indices
    prefetch: bool = False  # kv rows of the next step loaded into registers before this step's dots
    idx_ahead: bool = False  # indices of the next step loaded one step ahead
    idx_in_registers: bool = False  # the program's whole index range loaded once; each step takes its slice
    split_v: bool = False  # two accumulators of BLOCK_DV // 2 columns
    loop_stages: int = 0  # tl.range(num_stages=...) on the key loop: > 0 that, -1 the launch's num_stages, 0 unset
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the key loop
    lazy_rescale: bool = False  # skip acc * alpha when no row max changed in the step
    no_mask: bool = False  # -1 slots read kv row 0 unmasked (scores masked): kv must be finite


IDX_REG_MAX_SLOTS = 4096  # index slots a program holds in registers with idx_in_registers (16 a thread at 8 warps)
_C = KernelConfig
# Configs per variant, the expected fastest first. The current kernel's pipeliner keeps two kv buffers at 3-4 stages
# too (the gather's address depends on a load), so only the idx_reg variants list deeper ones.
VARIANTS: dict[str, FwdVariant] = {v.name: v for v in [
    FwdVariant("idx_reg", [_C(64, 64, 8, 2), _C(64, 32, 8, 4), _C(64, 32, 8, 3)], exact=True, idx_in_registers=True),
    FwdVariant("idx_reg_nomask", [_C(64, 32, 8, 4), _C(64, 32, 8, 3)], exact=True, idx_in_registers=True,
               no_mask=True),
    FwdVariant("idx_reg_lazy", [_C(64, 32, 8, 4)], exact=True, idx_in_registers=True, lazy_rescale=True),
    FwdVariant("exact", [_C(64, 64, 8, 2), _C(64, 32, 8, 2)], exact=True),
    FwdVariant("exact_nomask", [_C(64, 64, 8, 2), _C(64, 32, 8, 2)], exact=True, no_mask=True),
    FwdVariant("split_v", [_C(64, 64, 8, 2), _C(64, 32, 8, 2)], exact=True, split_v=True),
    FwdVariant("lazy", [_C(64, 64, 8, 2), _C(64, 32, 8, 2)], exact=True, lazy_rescale=True),
    FwdVariant("idx_ahead", [_C(64, 64, 8, 2)], exact=True, idx_ahead=True, loop_stages=-1),
    FwdVariant("idx_ahead_nomask_lazy", [_C(64, 64, 8, 2)], exact=True, idx_ahead=True, no_mask=True,
               lazy_rescale=True, loop_stages=-1),
    FwdVariant("exact16", [_C(64, 32, 16, 2), _C(64, 64, 16, 2)], exact=True),
    FwdVariant("prefetch", [_C(64, 16, 8, 1), _C(64, 32, 8, 1)], exact=True, prefetch=True),
    FwdVariant("ws", [_C(64, 64, 8, 2), _C(64, 64, 4, 2)], exact=True, loop_stages=-1, warp_specialize=True),
]}


@triton.jit
def _load_idx(idx_row_ptr, n0, k_hi, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """Indices of slots n0..n0+BLOCK_N-1 (-1 past k_hi); int32 when EXACT."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_row_ptr + offs_n, mask=offs_n < k_hi, other=-1)  # (BN,)
    if EXACT:
        idx = idx.to(tl.int32)
    return idx


@triton.jit
def _idx_slice(idx_all, n0, k_lo, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Slots n0 - k_lo .. + BLOCK_N - 1 of the program's (BLOCK_K,) index range, wrapped to stay inside it."""
    # The pipeliner also runs this for the num_stages - 1 steps past the loop's end (their kv copies are predicated
    # off, the gather is not). tl.gather reads idx_all back from a shared memory scratch, the last 8 KB of the
    # block's (sm_90a TTGIR/LLVM IR, Triton 3.6 and 3.8), unchecked: slots past BLOCK_K read past the block's shared
    # memory: the likely cause of the H200's illegal memory access at 32K (rows there use all 2048 slots). Real steps
    # have n0 - k_lo < keys_per_split <= BLOCK_K (no wrap); both are multiples of BLOCK_N, so a wrapped slice is whole.
    return tl.gather(idx_all, ((n0 - k_lo) & (BLOCK_K - 1)) + tl.arange(0, BLOCK_N), 0)


@triton.jit
def _gather_kv(kv_ptr, idx, stride_kvt, D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_DR: tl.constexpr, SPLIT_V: tl.constexpr, EXACT: tl.constexpr, ROW64: tl.constexpr,
               NO_MASK: tl.constexpr):
    """kv rows of `idx` as (valid, latent columns 0..BLOCK_V-1, latent columns BLOCK_V.. (SPLIT_V) or a dummy,
    rope columns); -1 slots read as zeros (NO_MASK: as kv row 0)."""
    valid = idx >= 0
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_DR)
    # The row offset stays a plain product idx * stride: a select on it (tl.where(valid, idx * stride, 0)) hides its
    # divisibility by 16 and the gather is then not turned into cp.async (seen in the sm_90 TTGIR). -1 rows are
    # never read: the mask covers them.
    if NO_MASK:  # row 0 for -1 slots, by arithmetic (not a select); every load is then unconditional
        idx = idx * valid.to(idx.dtype)
    if ROW64:
        rows = kv_ptr + idx.to(tl.int64)[:, None] * stride_kvt
    else:  # int32 offsets: the launcher checks that every kv offset fits
        rows = kv_ptr + (idx * stride_kvt)[:, None]
    if EXACT:  # dims are powers of two: no dimension masks
        mask_v, mask_v2, mask_r = valid[:, None], valid[:, None], valid[:, None]
    else:
        mask_v = valid[:, None] & (offs_v < D_V)[None, :]
        mask_v2 = valid[:, None] & (BLOCK_V + offs_v < D_V)[None, :]
        mask_r = valid[:, None] & (offs_r < D_R)[None, :]
    k_a = _load_masked(rows + offs_v[None, :], mask_v, NO_MASK)  # (BN, BLOCK_V)
    if SPLIT_V:
        k_b = _load_masked(rows + BLOCK_V + offs_v[None, :], mask_v2, NO_MASK)  # (BN, BLOCK_V)
    else:
        k_b = tl.zeros([1, 16], k_a.dtype)  # unused
    k_pe = _load_masked(rows + D_V + offs_r[None, :], mask_r, NO_MASK)  # (BN, DR)
    return valid, k_a, k_b, k_pe


@triton.jit
def _load_masked(ptrs, mask, NO_MASK: tl.constexpr):
    if NO_MASK:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _fwd_variant_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it,
    stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
    H, K, keys_per_split, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, SKIP_EMPTY: tl.constexpr,
    EXACT: tl.constexpr, PREFETCH: tl.constexpr, IDX_AHEAD: tl.constexpr, SPLIT_V: tl.constexpr,
    LAZY: tl.constexpr, ROW64: tl.constexpr, NO_MASK: tl.constexpr, IDX_REG: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """`_sparse_mla_fwd_kernel` with the switches of `FwdVariant` (module docstring)."""
    BLOCK_V: tl.constexpr = BLOCK_DV // 2 if SPLIT_V else BLOCK_DV  # columns per accumulator
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H

    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_a = tl.load(q_rows + offs_v[None, :], mask=mask_h[:, None] & (offs_v < D_V)[None, :], other=0.0)  # (BH, BV)
    if SPLIT_V:
        q_b = tl.load(q_rows + BLOCK_V + offs_v[None, :], mask=mask_h[:, None] & (BLOCK_V + offs_v < D_V)[None, :],
                      other=0.0)  # (BH, BV)
    q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_h[:, None] & (offs_r < D_R)[None, :], other=0.0)
    idx_row = idx_ptr + t * stride_it

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)  # value columns 0..BLOCK_V-1
    acc_b = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)  # BLOCK_V..2 BLOCK_V-1 with SPLIT_V (else unused)

    k_lo = split * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, K)  # index loads stay masked here, as in the main forward kernel
    k_end = k_hi
    if SKIP_EMPTY:
        k_end = _used_slots_end(idx_row, k_lo, k_hi, SCAN)
    if PREFETCH:
        valid, k_a, k_b, k_pe = _gather_kv(kv_ptr, _load_idx(idx_row, k_lo, k_hi, BLOCK_N, EXACT), stride_kvt, D_V,
                                           D_R, BLOCK_V, BLOCK_DR, SPLIT_V, EXACT, ROW64, NO_MASK)
    if IDX_AHEAD:
        idx = _load_idx(idx_row, k_lo, k_hi, BLOCK_N, EXACT)
    if IDX_REG:  # (BLOCK_K,) every index of this program, so the gather's address depends on no load in the loop
        idx_all = _load_idx(idx_row, k_lo, k_hi, BLOCK_K, EXACT)
    for n0 in tl.range(k_lo, k_end, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WARP_SPEC):
        if PREFETCH:  # this step's rows came in the previous step; issue the next step's gather now
            cur_valid, cur_a, cur_b, cur_pe = valid, k_a, k_b, k_pe
            next_idx = _load_idx(idx_row, n0 + BLOCK_N, k_hi, BLOCK_N, EXACT)
            valid, k_a, k_b, k_pe = _gather_kv(kv_ptr, next_idx, stride_kvt, D_V, D_R, BLOCK_V, BLOCK_DR, SPLIT_V,
                                               EXACT, ROW64, NO_MASK)
        elif IDX_AHEAD:  # this step's indices came in the previous step
            cur_valid, cur_a, cur_b, cur_pe = _gather_kv(kv_ptr, idx, stride_kvt, D_V, D_R, BLOCK_V, BLOCK_DR,
                                                         SPLIT_V, EXACT, ROW64, NO_MASK)
            idx = _load_idx(idx_row, n0 + BLOCK_N, k_hi, BLOCK_N, EXACT)
        else:
            if IDX_REG:
                cur_idx = _idx_slice(idx_all, n0, k_lo, BLOCK_N, BLOCK_K)
            else:
                cur_idx = _load_idx(idx_row, n0, k_hi, BLOCK_N, EXACT)
            cur_valid, cur_a, cur_b, cur_pe = _gather_kv(kv_ptr, cur_idx, stride_kvt, D_V, D_R, BLOCK_V, BLOCK_DR,
                                                         SPLIT_V, EXACT, ROW64, NO_MASK)
        s = tl.dot(q_a, tl.trans(cur_a)) + tl.dot(q_pe, tl.trans(cur_pe))  # (BH, BN) fp32
        if SPLIT_V:
            s += tl.dot(q_b, tl.trans(cur_b))
        s = tl.where(cur_valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet stays at 0/0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # (BH, BN)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pb = p.to(cur_a.dtype)
        if LAZY:  # alpha is exactly 1 where no row max grew
            if tl.min(alpha, axis=0) < 1.0:
                acc = acc * alpha[:, None]
                if SPLIT_V:
                    acc_b = acc_b * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
            if SPLIT_V:
                acc_b = acc_b * alpha[:, None]
        acc = tl.dot(pb, cur_a, acc)
        if SPLIT_V:
            acc_b = tl.dot(pb, cur_b, acc_b)
        m_i = m_new

    has_keys = l_i > 0.0
    inv = 1.0 / tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    out_rows = out_ptr + t * stride_ot + split * stride_os + offs_h[:, None] * stride_oh
    tl.store(out_rows + offs_v[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask_h[:, None] & (offs_v < D_V)[None, :])
    if SPLIT_V:
        tl.store(out_rows + BLOCK_V + offs_v[None, :], (acc_b * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask_h[:, None] & (BLOCK_V + offs_v < D_V)[None, :])
    tl.store(lse_ptr + t * stride_lt + split * stride_ls + offs_h, lse, mask=mask_h)


def variant_configs(name: str) -> list[KernelConfig]:
    """Launch configs to try for variant `name`, in order."""
    if name not in VARIANTS:
        raise ValueError(f"FWD_VARIANT {name!r} is not one of {sorted(VARIANTS)}")
    return VARIANTS[name].configs


def kernel_switches(name: str, cfg: KernelConfig, kv: torch.Tensor, v_dim: int, d_r: int, keys_per_split: int) -> dict:
    """Compile-time arguments of `_fwd_variant_kernel` for variant `name` at this launch: no dimension masks only
    where the dims are powers of two, int32 row offsets only where every kv offset fits, the index range in registers
    only up to IDX_REG_MAX_SLOTS slots."""
    v = VARIANTS[name]
    pow2 = triton.next_power_of_2
    exact = v.exact and v_dim == pow2(v_dim) and d_r == pow2(d_r) and v_dim >= 16 and d_r >= 16
    row64 = not exact or kv.shape[0] * kv.stride(0) >= 2**31
    idx_reg = v.idx_in_registers and not v.prefetch and not v.idx_ahead and keys_per_split <= IDX_REG_MAX_SLOTS
    stages = v.loop_stages if v.loop_stages > 0 else (cfg.num_stages if v.loop_stages < 0 else None)
    return dict(EXACT=exact, PREFETCH=v.prefetch, IDX_AHEAD=v.idx_ahead and not v.prefetch,
                SPLIT_V=v.split_v and v_dim >= 32, LAZY=v.lazy_rescale, ROW64=row64, NO_MASK=v.no_mask and exact,
                IDX_REG=idx_reg, BLOCK_K=pow2(keys_per_split) if idx_reg else 1, LOOP_STAGES=stages,
                WARP_SPEC=v.warp_specialize)

"""Sparse MLA attention in MQA mode (Triton): forward (out, lse) and backward (dQ, dKV) over gathered kv rows.

Every query row t attends, with all of its H heads, to the K latent rows `indices[t]` of the shared kv
tensor (-1 = unused slot). The score of head h for row r is scale * q[t, h] . kv[r] over D = D_V + D_R dims
(latent + rope); the value is kv[r, :D_V]. Conventions follow `slime_dsa/ops/reference.py`. The key loops of
the forward and of the general backward end at a row's last used slot (one scan of its indices first), so a
row with 256 keys in 2,048 slots costs about 256 keys; -1 slots before that one are masked, not skipped.

One program handles one query row and a block of heads (64 for GLM-5, so kv rows are gathered once per
query): the tensor-core tiles are (heads x keys) and the kv block is shared by every head, which is what
makes MQA-mode sparse attention compute-bound rather than gather-bound. D is split into the latent part
(a power of two, 512) and the rope part (64) because Triton tiles must be powers of two.

Decode (few query rows) splits each row's K keys over several programs and merges the partial results
(flash-decoding), so a batch of single-token requests still fills the GPU. With `invariant=True` (true on-policy,
slime_dsa/ops/invariant.py) it never splits and launches one config per problem shape (INVARIANT_FWD_CONFIGS): each
row is then one program per head block walking its slots in BLOCK_N blocks from slot 0, so its bits depend on its own
q and indices alone, whatever the batch (decode against the paged pool, prefill, training). A block of -1 slots past a
row's keys would change nothing (the running max stays, alpha = exp2(0) = 1, p = 0), and the key loop stops before
such blocks anyway. Rows that need no key split with 64 heads or more (prefill, training) run PREFILL_FWD_VARIANT of
triton_sparse_mla_fwd_variants.py instead (idx_reg: each program's index range held in registers).

Backward, two paths (both recompute the probabilities from the saved lse):
- Key ranges (`key_ranges`): when every row selects a run of consecutive kv rows lo[t] <= r < hi[t], with lo
  and hi non-decreasing over rows (index_topk >= the sequence length: every query takes all its causal keys,
  which is dense causal attention; also sliding windows), the (query, head) pairs are flattened into rows
  t * H + h and the backward is a dense varlen flash-attention backward with a per-row key range: dQ programs
  own a block of query rows and loop over the kv rows of their ranges; dKV programs own a block of kv rows and
  loop over the one run of queries that select any of them (found by binary search on hi and lo). No atomics,
  deterministic, and no work on -1 slots. Each kernel's launch config is measured on first use per problem
  shape (some configs spill registers badly at some dims: 0.9 vs 23 ms on the same problem, RESULTS.md).
- Masked key ranges (`selection_ranges`): when rows select subsets of short ranges (packed sequences up to a few
  times index_topk long, as RL batches are), the same two kernels run over each row's range with a byte map of the
  selected keys. They do up to MASKED_RANGE_MAX_RATIO times the selected work but no atomics, which serialise when
  many queries share kv rows and few heads share each query; so only for few heads x head dim
  (MASKED_RANGE_MAX_HEAD_WORK), where they were measured to win.
- General: one program per query row and 32 heads (64 do not fit in shared memory with dQ and dKV together);
  with 64 heads or more, triton_sparse_mla_bwd_variants.py's split64 first (64 heads a program, dQ and dKV in two
  kernels; its other modes of BWD_MODES run only when chosen). dQ is accumulated in
  registers; dKV rows are shared between queries, so their contributions are added with float32 atomics (the
  summation order, and so the last bits of dKV, can change from run to run). It runs at about 40% of the
  forward's TFLOP/s at GLM-5 sizes.
Choosing the path is one pass over `indices` and one host sync (two with a byte map) per selection: the backwards
of the layers that share one (IndexShare), run one after another, reuse its cover (`_LastCover`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime_dsa.ops import triton_sparse_mla_bwd_variants as bwd_variants
from slime_dsa.ops import triton_sparse_mla_fwd_variants as fwd_variants
from slime_dsa.ops.triton_sparse_mla_launch import (
    LOG2E, KernelConfig, _chosen, _launch, _launch_fastest, _launch_first_fitting, _num_sms, _pow2, _scan_block,
    _used_slots_end,
)

logger = logging.getLogger(__name__)

# Tried in order; the first that compiles and fits on the device is kept for that problem shape.
# benchmarks/dsa_kernels.py checks and times every entry (H200, GLM-5 sizes: benchmarks/RESULTS.md); the
# first entries are the fastest there. Configs with 64 heads per backward program need more shared memory
# than Hopper has (q and dO both stay resident), so the backward works on 32 heads per program.
FWD_CONFIGS = [
    KernelConfig(64, 64, 8, 2), KernelConfig(64, 64, 8, 3), KernelConfig(64, 32, 8, 2), KernelConfig(64, 128, 8, 2),
    KernelConfig(32, 32, 4, 1),
]
# Backward, either one fused kernel or two ("split"): dQ alone (no atomics) and dKV alone (no dQ accumulator),
# which recompute the scores twice but relieve register pressure. Fused was faster on the H200 (61 vs 69 ms
# at 8K); split stays as the fallback. The other modes are the variants of triton_sparse_mla_bwd_variants.py (64 heads
# per program, PTX reductions, rotated key loops), tried only when chosen (benchmarks/sparse_mla_bwd_variants.py).
BWD_MODES = ["fused", "split", "fused64", "fused64_rot", "fused64_red", "fused64_red_rot", "split64", "split64_rot",
             "split64_red_rot", "split64_par", "fused32_red", "fused32_red4", "fused32_rot"]
# The modes the general backward tries, in order, until one runs (the first that does is kept per problem). With 64
# heads or more, split64 (64 heads a program, dQ and dKV apart) first: 46.2 against 50.2 ms at 8K and 215.8 against
# 227.4 ms at 32K on the H200 (RESULTS.md, 2026-12-03), and right at the GPU tests' shapes.
BWD_DEFAULT_MODES = ["fused", "split"]
BWD_DEFAULT_MODES_64_HEADS = ["split64", *BWD_DEFAULT_MODES]
BWD_FUSED_CONFIGS = [KernelConfig(32, 32, 8, 1), KernelConfig(32, 16, 4, 1)]
BWD_DQ_CONFIGS = [KernelConfig(64, 32, 8, 1), KernelConfig(32, 32, 4, 1), KernelConfig(64, 16, 8, 1)]
BWD_DKV_CONFIGS = [KernelConfig(32, 16, 4, 1), KernelConfig(32, 32, 8, 1)]
# Key-range backward (every row selects a run of consecutive kv rows, e.g. index_topk >= sequence length):
# block_h = (query, head) rows per tile, block_n = kv rows per tile. dQ programs own block_h rows, dKV programs
# own block_n kv rows, so neither needs atomics.
RANGE_DQ_CONFIGS = [KernelConfig(64, 32, 8, 1), KernelConfig(64, 64, 8, 2), KernelConfig(32, 32, 4, 1)]
RANGE_DKV_CONFIGS = [KernelConfig(64, 32, 8, 2), KernelConfig(32, 16, 4, 1), KernelConfig(64, 16, 4, 1),
                     KernelConfig(32, 32, 4, 1)]
USE_KEY_RANGES = True  # False forces the general (atomic) backward; benchmarks compare both
# Selections that are a subset of short ranges (packed sequences up to a few times index_topk) take the range
# backward with a byte map of the selected keys instead of the atomic kernel: the dense work over the ranges,
# at most this many times the selected keys, costs less than atomics that serialise on shared kv rows.
USE_MASKED_RANGES = True
MASKED_RANGE_MAX_RATIO = 4.0
# ...but only where that was measured to win (benchmarks/sparse_mla_bwd_paths.py, RESULTS.md): heads x head dim up
# to the small preset's 12 x 288. At 16 x 576 and 64 x 576 the atomic kernel was 2.2-6.7x faster at ratios 1.3-4.3.
MASKED_RANGE_MAX_HEAD_WORK = 12 * 288
MASKED_RANGE_MAX_BYTES = 1 << 30
# Key loops stop after a row's last used slot (found by one scan of its indices), so rows with few keys (early
# causal rows, short packed sequences) cost what they use. False walks every slot; benchmarks compare both.
SKIP_EMPTY_SLOTS = True
# Batch-invariant forward: no key split, and the first of these configs that compiles and fits for the problem's
# (heads, dims, dtype) on this device model, never chosen by row count or by timing, so an engine and a trainer on
# the same GPU model take the same one. The first fits bf16 up to GLM-5's 64 x 576 on Hopper; the second is for
# float32 at such sizes.
INVARIANT_FWD_CONFIGS = [KernelConfig(64, 64, 8, 2), KernelConfig(32, 32, 4, 1)]
# The non-invariant forward's kernel: None chooses by shape (`_forward_variant`); PLAIN_FWD always runs the kernel
# below; any other name runs that variant of slime_dsa/ops/triton_sparse_mla_fwd_variants.py with its own configs.
# benchmarks/sparse_mla_fwd_variants.py compares them.
FWD_VARIANT: str | None = None
PLAIN_FWD = "plain"
# Rows that fill the GPU without a key split (prefill, training) with 64+ heads run idx_reg: 1.10x the kernel below at
# 32K and 1.12x on 64 packed sequences of 1K on the H200 (benchmarks/RESULTS.md, 2026-12-03 third session). Decode,
# which splits keys, stays on the kernel below, which was faster there.
PREFILL_FWD_VARIANT = "idx_reg"
PREFILL_FWD_MIN_HEADS = 64
_unfit_variants: set[tuple] = set()  # (variant, problem key) with no config that compiles and fits here
# The Gluon kernels for Hopper (gluon_sparse_mla.py, gluon_sparse_mla_bwd.py) take the forward of rows that need no key
# split (prefill, training) / the general backward (both halves in one kernel) where their `supported` holds (sm_90,
# bf16, 64k heads, 512 + 64), the Triton kernels otherwise: on an H100 the forward 1.35-1.45x idx_reg (368-402 TFLOP/s
# at 32K-64K) and the backward 1.45x split64 at 64K (benchmarks/RESULTS.md, 2026-12-05). benchmarks/dsa_kernels.py
# --no-gluon times the Triton kernels alone.
GLUON_FWD = True
GLUON_BWD = True
# Rows that the Triton forward would split by keys (decode) but that fill about one wave of 64-head programs on their
# own take the Gluon forward unsplit: at batch 128 x 64K context on an H100 0.176 ms against the split Triton kernel's
# 0.478 (benchmarks/RESULTS.md, 2026-12-05). Fewer rows keep the split kernel (the Gluon one has no key split).
GLUON_DECODE_MIN_WAVE = 0.9


# ----------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it,
    stride_ot, stride_os, stride_oh, stride_lt, stride_ls,
    H, K, keys_per_split, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, SKIP_EMPTY: tl.constexpr,
    DIMS_POW2: tl.constexpr, ROW64: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H
    mask_v = offs_v < D_V
    mask_r = offs_r < D_R

    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)  # (BH, DV)
    q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # (BH, DR)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    k_lo = split * keys_per_split
    k_hi = tl.minimum(k_lo + keys_per_split, K)
    k_end = k_hi
    if SKIP_EMPTY:
        k_end = _used_slots_end(idx_ptr + t * stride_it, k_lo, k_hi, SCAN)
    for n0 in range(k_lo, k_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # Masked at k_hi, not k_end: slots k_end..k_hi-1 hold no key anyway, and k_hi is a multiple of 16 the compiler
        # can see, so the mask is uniform over 16 slots (one predicate, 16-byte copies); a mask at the scanned k_end
        # is built per slot, about 140 more instructions per key block on sm_90a.
        idx = tl.load(idx_ptr + t * stride_it + offs_n, mask=offs_n < k_hi, other=-1)  # (BN,)
        valid = idx >= 0
        # The row offset stays a plain product: a select on it (where(valid, idx, 0)) hides its divisibility by 16,
        # and the gather then does not become cp.async copies that overlap the next step. -1 rows are masked off.
        if ROW64:
            kv_rows = kv_ptr + idx.to(tl.int64)[:, None] * stride_kvt
        else:  # int32 offsets: the launcher checks that every kv offset fits
            kv_rows = kv_ptr + (idx.to(tl.int32) * stride_kvt)[:, None]
        mask_nv = valid[:, None] if DIMS_POW2 else valid[:, None] & mask_v[None, :]  # no column masks when exact
        mask_nr = valid[:, None] if DIMS_POW2 else valid[:, None] & mask_r[None, :]
        k_nope = tl.load(kv_rows + offs_v[None, :], mask=mask_nv, other=0.0)  # (BN, DV)
        k_pe = tl.load(kv_rows + D_V + offs_r[None, :], mask=mask_nr, other=0.0)  # (BN, DR)

        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))  # (BH, BN) fp32
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet stays at 0/0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # (BH, BN)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    out_ptrs = out_ptr + t * stride_ot + split * stride_os + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_v[None, :])
    tl.store(lse_ptr + t * stride_lt + split * stride_ls + offs_h, lse, mask=mask_h)


def gather_switches(kv: torch.Tensor, dkv: torch.Tensor, v_dim: int, d_r: int) -> dict[str, bool]:
    """Compile-time switches of the kv-row gathers: no column masks when both dims are powers of two, int64 row
    offsets only when some offset of kv (or dkv) does not fit in int32."""
    return dict(DIMS_POW2=v_dim == _pow2(v_dim) and d_r == _pow2(d_r),
                ROW64=max(kv.shape[0] * kv.stride(0), dkv.shape[0] * dkv.stride(0)) >= 2**31)


def _decode_splits(T: int, head_blocks: int, K: int, block_n: int, device: torch.device) -> int:
    """Key splits per query row so that few rows (decode) still give every SM about two programs."""
    programs = T * head_blocks
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    # At least 4 key blocks per split: merging the splits costs several small kernels of its own.
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(K, 4 * block_n)))


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D), kv (Tk, D), indices (T, K) -> out (T, H, v_dim) in q's dtype, lse (T, H) float32.

    invariant: no key split and a config that depends on no row count, so each row's bits do not depend on the batch."""
    T, H, D = q.shape
    K = indices.shape[1]
    variant = _forward_variant(invariant, T, H, K, q.dtype, D, v_dim, q.device) if T and K else None
    gluon_rows = variant is not None or (T and K and _fills_a_wave_unsplit(invariant, T, H, q.device))
    if GLUON_FWD and gluon_rows and (gluon := _gluon_module("gluon_sparse_mla")) is not None:
        if gluon.supported(q, kv, indices, v_dim):
            return gluon.sparse_mla_fwd(q, kv, indices, scale, v_dim)  # it allocates its own out and lse
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    if K == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    d_r = D - v_dim
    block_dv, block_dr = _pow2(v_dim), _pow2(d_r)

    def launch(cfg: KernelConfig) -> None:
        block_h = min(cfg.block_h, _pow2(H))
        head_blocks = triton.cdiv(H, block_h)
        splits = 1 if invariant else _decode_splits(T, head_blocks, K, cfg.block_n, q.device)
        keys_per_split = triton.cdiv(triton.cdiv(K, splits), cfg.block_n) * cfg.block_n
        splits = triton.cdiv(K, keys_per_split)
        if splits == 1:
            o, l_ = out, lse
            so, sl = 0, 0
        else:  # partial results per split, merged below
            o = torch.empty(T, splits, H, v_dim, dtype=torch.float32, device=q.device)
            l_ = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
            so, sl = o.stride(1), l_.stride(1)
        kernel = _sparse_mla_fwd_kernel
        switches = gather_switches(kv, kv, v_dim, d_r)
        if variant is not None:
            kernel = fwd_variants._fwd_variant_kernel
            switches = fwd_variants.kernel_switches(variant, cfg, kv, v_dim, d_r, keys_per_split)
        kernel[(T, splits, head_blocks)](
            q, kv, indices, o, l_,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            o.stride(0), so, o.stride(-2), l_.stride(0), sl,
            H, K, keys_per_split, scale * LOG2E,
            D_V=v_dim, D_R=d_r, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
            BLOCK_H=block_h, BLOCK_N=cfg.block_n, SCAN=_scan_block(K), SKIP_EMPTY=SKIP_EMPTY_SLOTS, **switches,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if splits > 1:
            lse.copy_(torch.logsumexp(l_, dim=1))  # (T, H)
            weight = torch.exp(l_ - lse[:, None]).nan_to_num(0.0)  # (T, S, H); all -inf rows -> 0
            out.copy_((weight[..., None] * o).sum(dim=1))

    key = (H, D, v_dim, q.dtype)
    if invariant:
        _launch_first_fitting("fwd_invariant", key, INVARIANT_FWD_CONFIGS, launch)
    elif variant is None:
        _launch("fwd", key, FWD_CONFIGS, launch)
    else:
        try:
            _launch("fwd", key + (variant,), fwd_variants.variant_configs(variant), launch)
        except RuntimeError as err:
            if FWD_VARIANT is not None or "no fwd kernel config fits" not in str(err):
                raise  # a variant asked for by name fails loudly
            logger.warning("sparse MLA forward: %s does not fit here, using the plain kernel: %s", variant, err)
            _unfit_variants.add((variant,) + key)
            variant = None
            _launch("fwd", key, FWD_CONFIGS, launch)
    return out, lse


@functools.cache
def _gluon_module(name: str):
    """slime_dsa.ops.<name>, or None where this Triton has no Gluon (before 3.5)."""
    try:
        return importlib.import_module(f"slime_dsa.ops.{name}")
    except ImportError as err:
        logger.warning("sparse MLA: the Gluon kernels need Triton 3.5+ (%s); the Triton kernels run", err)
        return None


def _fills_a_wave_unsplit(invariant: bool, T: int, H: int, device: torch.device) -> bool:
    """Whether rows the Triton forward would split by keys are enough for the unsplit Gluon forward
    (GLUON_DECODE_MIN_WAVE of the SMs, one 64-head program each)."""
    if invariant or FWD_VARIANT is not None:
        return False
    return T * triton.cdiv(H, 64) >= GLUON_DECODE_MIN_WAVE * _num_sms(device)


def _forward_variant(invariant: bool, T: int, H: int, K: int, dtype: torch.dtype, D: int, v_dim: int,
                     device: torch.device) -> str | None:
    """The forward variant for this call (None: the plain kernel): FWD_VARIANT when set, else PREFILL_FWD_VARIANT
    for rows that need no key split with PREFILL_FWD_MIN_HEADS heads or more."""
    if invariant or FWD_VARIANT == PLAIN_FWD:
        return None
    if FWD_VARIANT is not None:
        return FWD_VARIANT
    head_blocks = triton.cdiv(H, 64)  # every variant config has 64 heads a program
    if (H < PREFILL_FWD_MIN_HEADS or K > fwd_variants.IDX_REG_MAX_SLOTS
            or _decode_splits(T, head_blocks, K, 64, device) > 1
            or (PREFILL_FWD_VARIANT, H, D, v_dim, dtype) in _unfit_variants):
        return None
    return PREFILL_FWD_VARIANT


# ----------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_dot, stride_doh, stride_lt,
    stride_dqt, stride_dqh, stride_dkvt,
    H, K, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DO_DQ: tl.constexpr, DO_DKV: tl.constexpr,
    SCAN: tl.constexpr, SKIP_EMPTY: tl.constexpr, DIMS_POW2: tl.constexpr, ROW64: tl.constexpr,
):
    """Gradients for one query row and a block of heads: dQ (stored) and/or dKV (atomically added)."""
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
    for n0 in range(0, k_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * stride_it + offs_n, mask=offs_n < K, other=-1)  # (BN,) masked at K: see the forward
        valid = idx >= 0
        row = idx.to(tl.int64) if ROW64 else idx.to(tl.int32)  # a plain product below, as in the forward
        kv_rows = kv_ptr + row[:, None] * stride_kvt
        mask_nv = valid[:, None] if DIMS_POW2 else valid[:, None] & mask_v[None, :]
        mask_nr = valid[:, None] if DIMS_POW2 else valid[:, None] & mask_r[None, :]
        k_nope = tl.load(kv_rows + offs_v[None, :], mask=mask_nv, other=0.0)  # (BN, DV)
        k_pe = tl.load(kv_rows + D_V + offs_r[None, :], mask=mask_nr, other=0.0)  # (BN, DR)

        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))  # (BH, BN)
        p = tl.exp2(s * scale_log2 - lse[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(k_nope))  # (BH, BN): dO . V with V = kv[:, :D_V]
        ds = (p * (dp - delta[:, None]) * scale).to(k_nope.dtype)  # dL/d(q.k)

        if DO_DQ:
            dq_nope += tl.dot(ds, k_nope)
            dq_pe += tl.dot(ds, k_pe)
        if DO_DKV:
            dk_nope = tl.dot(tl.trans(ds), q_nope) + tl.dot(tl.trans(p.to(do.dtype)), do)  # (BN, DV): key + value
            dk_pe = tl.dot(tl.trans(ds), q_pe)  # (BN, DR)
            dkv_rows = dkv_ptr + row[:, None] * stride_dkvt
            tl.atomic_add(dkv_rows + offs_v[None, :], dk_nope, mask=mask_nv, sem="relaxed")
            tl.atomic_add(dkv_rows + D_V + offs_r[None, :], dk_pe, mask=mask_nr, sem="relaxed")

    if DO_DQ:
        dq_rows = dq_ptr + t * stride_dqt + offs_h[:, None] * stride_dqh
        tl.store(dq_rows + offs_v[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=mask_hv)
        tl.store(dq_rows + D_V + offs_r[None, :], dq_pe.to(dq_ptr.dtype.element_ty), mask=mask_hr)


@dataclass
class SelectionRanges:
    """How the range backward covers a selection: each row t selects kv rows within lo[t] <= r < hi[t], either
    all of them (sel None) or those whose byte sel[t, r - lo[t]] is set."""

    lo: torch.Tensor  # (T,) int32, non-decreasing
    hi: torch.Tensor  # (T,) int32, non-decreasing
    sel: torch.Tensor | None  # (T, W) uint8


def selection_ranges(indices: torch.Tensor, max_ratio: float = MASKED_RANGE_MAX_RATIO,
                     max_bytes: int = MASKED_RANGE_MAX_BYTES) -> SelectionRanges | None:
    """The range backward's cover of `indices` (T, K), or None when the general (atomic) kernel should run.

    Whole runs (`key_ranges`) need no map. Otherwise each row's range is widened to make lo and hi
    non-decreasing (a suffix minimum of the rows' first keys, a prefix maximum of their last), and a byte map marks
    the selected keys: taken when every row has a key, the ranges hold at most max_ratio times the selected keys
    (packed sequences not much longer than index_topk) and the map fits in max_bytes. Rows must not repeat a key
    (the indexer's top-k never does); a map whose count falls short of the selected keys is refused. Two host
    syncs at most.
    """
    T = indices.shape[0]
    valid = indices >= 0
    n = valid.sum(1)
    rows = indices.long()
    exact, lo_run, hi_run = _whole_runs(indices)
    row_min = torch.where(valid, rows, torch.iinfo(torch.long).max).amin(1)
    lo = row_min.flip(0).cummin(0).values.flip(0)
    hi = torch.where(valid, rows + 1, 0).amax(1).cummax(0).values
    width = (hi - lo).clamp_min(0)
    nonempty = (n > 0).all()
    exact_ok, nonempty_ok, max_width, dense, selected = torch.stack(
        [exact, nonempty, width.max(), width.sum(), n.sum()]).tolist()
    if exact_ok:
        return SelectionRanges(lo_run, hi_run, None)
    if not nonempty_ok or dense > max_ratio * selected or T * (max_width + 1) > max_bytes:
        return None
    sel = torch.zeros(T, max_width + 1, dtype=torch.uint8, device=indices.device)  # column max_width: -1 slots
    sel.scatter_(1, torch.where(valid, rows - lo[:, None], max_width), 1)
    if int(sel[:, :max_width].sum()) != selected:  # a row repeats a key: the map would count it once
        return None
    return SelectionRanges(lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous(), sel)


class _LastCover:
    """The last backward's `selection_ranges` result, for the next backward over the same indices tensor: the layers
    of an IndexShare group share their full layer's selection and run their backwards one after another, so the group
    pays one pass over the indices and one host sync instead of one per layer. Dropped when the indices are freed."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.indices: weakref.ref | None = None
        self.cover: SelectionRanges | None = None

    def get(self, indices: torch.Tensor, max_ratio: float) -> SelectionRanges | None:
        key = (indices._version, max_ratio)
        if self.indices is not None and self.indices() is indices and self.key == key:
            return self.cover
        self.indices, self.cover = None, None  # a new selection: the last one's cover is not kept meanwhile
        cover = selection_ranges(indices, max_ratio)
        self.key, self.cover = key, cover
        self.indices = weakref.ref(indices, self._forget)
        return cover

    def _forget(self, _ref: weakref.ref) -> None:
        if self.indices is _ref:
            self.indices, self.key, self.cover = None, None, None


_last_cover = _LastCover()


def key_ranges(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(lo, hi) int32 (T,) if every row of `indices` is lo, lo+1, ..., hi-1 then -1 padding; else None.

    Also required (else None): every row has a key, and lo and hi never decrease from one row to the next, so
    the queries that select any kv row of a block are one run of rows. This is what the indexer returns when
    index_topk >= the sequence length (every query takes all its causal keys, ascending) for packed sequences
    in order. One pass over `indices` and one host sync.
    """
    ok, lo, hi = _whole_runs(indices)
    return (lo, hi) if bool(ok) else None


def _whole_runs(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ok, lo, hi) of `key_ranges` without the host sync: ok a bool tensor, lo and hi int32 (T,)."""
    T, K = indices.shape
    n = (indices >= 0).sum(1)  # (T,)
    lo = indices[:, 0].long()
    hi = lo + n
    col = torch.arange(K, device=indices.device)
    expected = torch.where(col[None, :] < n[:, None], lo[:, None] + col[None, :], -1)  # (T, K)
    ok = (indices == expected).all() & (n > 0).all() & (lo[1:] >= lo[:-1]).all() & (hi[1:] >= hi[:-1]).all()
    return ok, lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


@triton.jit
def _range_mla_bwd_dq_kernel(
    q_ptr, kv_ptr, lo_ptr, hi_ptr, sel_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qt, stride_qh, stride_kvt, stride_dot, stride_doh, stride_lt, stride_dqt, stride_dqh, stride_sel,
    H, TH, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEL: tl.constexpr,
):
    """dQ of BLOCK_M (query, head) rows (row i = t * H + h), over kv rows lo[t] <= r < hi[t] (and, with HAS_SEL,
    only those whose byte sel[t, r - lo[t]] is set)."""
    offs_i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    mask_i = offs_i < TH
    t = offs_i // H
    h = offs_i - t * H
    t64 = t.to(tl.int64)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_v = offs_v < D_V
    mask_r = offs_r < D_R
    mask_iv = mask_i[:, None] & mask_v[None, :]
    mask_ir = mask_i[:, None] & mask_r[None, :]

    lo = tl.load(lo_ptr + t, mask=mask_i, other=2147483647)  # (BM,) padded rows select nothing
    hi = tl.load(hi_ptr + t, mask=mask_i, other=0)
    r_lo = tl.min(lo, axis=0)
    r_hi = tl.max(hi, axis=0)
    q_rows = q_ptr + t64[:, None] * stride_qt + h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_v[None, :], mask=mask_iv, other=0.0)  # (BM, DV)
    q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_ir, other=0.0)  # (BM, DR)
    do = tl.load(dout_ptr + t64[:, None] * stride_dot + h[:, None] * stride_doh + offs_v[None, :], mask=mask_iv,
                 other=0.0)  # (BM, DV)
    lse = tl.load(lse_ptr + t64 * stride_lt + h, mask=mask_i, other=float("inf")) * 1.4426950408889634  # (BM,)
    delta = tl.load(delta_ptr + t64 * stride_lt + h, mask=mask_i, other=0.0)  # (BM,)

    dq_nope = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    dq_pe = tl.zeros([BLOCK_M, BLOCK_DR], tl.float32)
    for n0 in range(r_lo, r_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,)
        mask_n = offs_n < r_hi
        kv_rows = kv_ptr + offs_n.to(tl.int64)[:, None] * stride_kvt
        k_nope = tl.load(kv_rows + offs_v[None, :], mask=mask_n[:, None] & mask_v[None, :], other=0.0)  # (BN, DV)
        k_pe = tl.load(kv_rows + D_V + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BN, DR)

        s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))  # (BM, BN)
        sel = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        if HAS_SEL:
            picked = tl.load(sel_ptr + t64[:, None] * stride_sel + (offs_n[None, :] - lo[:, None]), mask=sel, other=0)
            sel = sel & (picked != 0)
        p = tl.where(sel, tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(k_nope))  # (BM, BN)
        ds = (p * (dp - delta[:, None]) * scale).to(k_nope.dtype)
        dq_nope += tl.dot(ds, k_nope)
        dq_pe += tl.dot(ds, k_pe)

    dq_rows = dq_ptr + t64[:, None] * stride_dqt + h[:, None] * stride_dqh
    tl.store(dq_rows + offs_v[None, :], dq_nope.to(dq_ptr.dtype.element_ty), mask=mask_iv)
    tl.store(dq_rows + D_V + offs_r[None, :], dq_pe.to(dq_ptr.dtype.element_ty), mask=mask_ir)


@triton.jit
def _range_mla_bwd_dkv_kernel(
    q_ptr, kv_ptr, lo_ptr, hi_ptr, sel_ptr, t_first_ptr, t_last_ptr, dout_ptr, lse_ptr, delta_ptr, dkv_ptr,
    stride_qt, stride_qh, stride_kvt, stride_dot, stride_doh, stride_lt, stride_dkvt, stride_sel,
    H, Tk, scale, scale_log2,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEL: tl.constexpr,
):
    """dKV of BLOCK_N kv rows, summed over the (query, head) rows of queries t_first[b] <= t < t_last[b] (with
    HAS_SEL, only the pairs whose byte sel[t, r - lo[t]] is set)."""
    blk = tl.program_id(0)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    mask_n = offs_n < Tk
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_v = offs_v < D_V
    mask_r = offs_r < D_R
    mask_nv = mask_n[:, None] & mask_v[None, :]
    mask_nr = mask_n[:, None] & mask_r[None, :]

    kv_rows = kv_ptr + offs_n.to(tl.int64)[:, None] * stride_kvt
    k_nope = tl.load(kv_rows + offs_v[None, :], mask=mask_nv, other=0.0)  # (BN, DV), also the value
    k_pe = tl.load(kv_rows + D_V + offs_r[None, :], mask=mask_nr, other=0.0)  # (BN, DR)
    i_lo = tl.load(t_first_ptr + blk) * H
    i_hi = tl.load(t_last_ptr + blk) * H

    dkv_nope = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)  # dK + dV: key and value share the row
    dkv_pe = tl.zeros([BLOCK_N, BLOCK_DR], tl.float32)
    for i0 in range(i_lo, i_hi, BLOCK_M):
        offs_i = i0 + tl.arange(0, BLOCK_M)  # (BM,) row i = t * H + h
        mask_i = offs_i < i_hi
        t = offs_i // H
        h = offs_i - t * H
        t64 = t.to(tl.int64)
        lo = tl.load(lo_ptr + t, mask=mask_i, other=0)
        hi = tl.load(hi_ptr + t, mask=mask_i, other=0)  # padded rows select nothing
        q_rows = q_ptr + t64[:, None] * stride_qt + h[:, None] * stride_qh
        q_nope = tl.load(q_rows + offs_v[None, :], mask=mask_i[:, None] & mask_v[None, :], other=0.0)  # (BM, DV)
        q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_i[:, None] & mask_r[None, :], other=0.0)  # (BM, DR)
        do = tl.load(dout_ptr + t64[:, None] * stride_dot + h[:, None] * stride_doh + offs_v[None, :],
                     mask=mask_i[:, None] & mask_v[None, :], other=0.0)  # (BM, DV)
        lse = tl.load(lse_ptr + t64 * stride_lt + h, mask=mask_i, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_ptr + t64 * stride_lt + h, mask=mask_i, other=0.0)  # (BM,)

        s_t = tl.dot(k_nope, tl.trans(q_nope)) + tl.dot(k_pe, tl.trans(q_pe))  # (BN, BM) scores, transposed
        sel = (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
        if HAS_SEL:
            picked = tl.load(sel_ptr + t64[None, :] * stride_sel + (offs_n[:, None] - lo[None, :]), mask=sel, other=0)
            sel = sel & (picked != 0)
        p_t = tl.where(sel, tl.exp2(s_t * scale_log2 - lse[None, :]), 0.0)
        dp_t = tl.dot(k_nope, tl.trans(do))  # (BN, BM)
        ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q_nope.dtype)
        dkv_nope += tl.dot(ds_t, q_nope) + tl.dot(p_t.to(do.dtype), do)
        dkv_pe += tl.dot(ds_t, q_pe)

    dkv_rows = dkv_ptr + offs_n.to(tl.int64)[:, None] * stride_dkvt
    tl.store(dkv_rows + offs_v[None, :], dkv_nope.to(dkv_ptr.dtype.element_ty), mask=mask_nv)
    tl.store(dkv_rows + D_V + offs_r[None, :], dkv_pe.to(dkv_ptr.dtype.element_ty), mask=mask_nr)


def range_mla_bwd(
    q, kv, lo, hi, dout, lse, delta, dq, dkv, scale: float, v_dim: int,
    dq_cfg: KernelConfig | None = None, dkv_cfg: KernelConfig | None = None, do_dq: bool = True, do_dkv: bool = True,
    sel: torch.Tensor | None = None,
) -> None:
    """Key-range backward: writes dq (T, H, D) and dkv (Tk, D) for rows that select kv rows lo[t] <= r < hi[t];
    with `sel` (T, W) uint8, only the rows r whose sel[t, r - lo[t]] is set (a subset of each range).

    dq_cfg / dkv_cfg pin a config and do_dq / do_dkv skip a half (benchmarks); by default the fastest of
    RANGE_*_CONFIGS on this device is measured on first use and kept for the problem shape.
    """
    T, H, D = q.shape
    Tk = kv.shape[0]
    d_r = D - v_dim
    dims = dict(D_V=v_dim, D_R=d_r, BLOCK_DV=_pow2(v_dim), BLOCK_DR=_pow2(d_r), HAS_SEL=sel is not None)
    common = (scale, scale * LOG2E)
    sel_arg, stride_sel = (sel, sel.stride(0)) if sel is not None else (lo, 0)  # lo: any pointer, never read

    def launch_dq(cfg: KernelConfig) -> None:
        _range_mla_bwd_dq_kernel[(triton.cdiv(T * H, cfg.block_h),)](
            q, kv, lo, hi, sel_arg, dout, lse, delta, dq,
            q.stride(0), q.stride(1), kv.stride(0), dout.stride(0), dout.stride(1), lse.stride(0),
            dq.stride(0), dq.stride(1), stride_sel, H, T * H, *common, **dims,
            BLOCK_M=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def launch_dkv(cfg: KernelConfig) -> None:
        starts = torch.arange(0, Tk, cfg.block_n, device=q.device, dtype=torch.int32)  # (B,) first kv row of block
        t_first = torch.searchsorted(hi, starts, right=True).to(torch.int32)  # first query with hi > start
        t_last = torch.searchsorted(lo, starts + cfg.block_n).to(torch.int32)  # first query with lo >= block end
        _range_mla_bwd_dkv_kernel[(len(starts),)](
            q, kv, lo, hi, sel_arg, t_first, t_last, dout, lse, delta, dkv,
            q.stride(0), q.stride(1), kv.stride(0), dout.stride(0), dout.stride(1), lse.stride(0), dkv.stride(0),
            stride_sel, H, Tk, *common, **dims,
            BLOCK_M=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    key = (H, D, v_dim, q.dtype, sel is not None)
    if do_dq:
        if dq_cfg is not None:
            launch_dq(dq_cfg)
        else:
            _launch_fastest("range_dq", key, RANGE_DQ_CONFIGS, launch_dq, q.device)
    if do_dkv:
        if dkv_cfg is not None:
            launch_dkv(dkv_cfg)
        else:
            _launch_fastest("range_dkv", key, RANGE_DKV_CONFIGS, launch_dkv, q.device)


@triton.jit
def _bwd_delta_kernel(out_ptr, dout_ptr, dlse_ptr, delta_ptr, n_rows, V, HAS_DLSE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """delta[r] = sum_v dout[r, v] * out[r, v] (float32) - dlse[r] for BLOCK_R rows of V contiguous values."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n_rows
    acc = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = mask_r[:, None] & (cols < V)[None, :]
        o = tl.load(out_ptr + rows[:, None] * V + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        do = tl.load(dout_ptr + rows[:, None] * V + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(o * do, axis=1)
    if HAS_DLSE:
        acc -= tl.load(dlse_ptr + rows, mask=mask_r, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, acc, mask=mask_r)


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta (T, H) float32 = rowsum(dO * O) - dL/dlse, so that dL/ds = p * (dO . v - delta)."""
    if out.is_cuda:
        return bwd_delta_triton(out, dout, dlse)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:  # lse depends on every score through p
        delta = delta - dlse.float()
    return delta.contiguous()


def bwd_delta_triton(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """bwd_delta in one pass over dO and O in their own dtype (torch's float32 copies and product of the (T, H, V)
    tensors took ~10% of the backward at 64K tokens)."""
    out, dout = out.contiguous(), dout.contiguous()
    *lead, V = out.shape
    delta = torch.empty(lead, dtype=torch.float32, device=out.device)
    if delta.numel():
        block_r = 16
        _bwd_delta_kernel[(triton.cdiv(delta.numel(), block_r),)](
            out, dout, dlse.contiguous() if dlse is not None else delta, delta, delta.numel(), V,
            HAS_DLSE=dlse is not None, BLOCK_R=block_r, BLOCK_V=min(_pow2(V), 512), num_warps=4,
        )
    return delta


def launch_bwd_kernel(
    cfg: KernelConfig, do_dq: bool, do_dkv: bool, q, kv, indices, dout, lse, delta, dq, dkv, scale: float, v_dim: int
):
    """One backward launch: dq (written) and/or dkv (float32, added to) for all query rows; returns the compiled
    kernel (its registers and spills, for benchmarks)."""
    T, H, D = q.shape
    block_h = min(cfg.block_h, _pow2(H))
    return _sparse_mla_bwd_kernel[(T, triton.cdiv(H, block_h))](
        q, kv, indices, dout, lse, delta, dq, dkv,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), dout.stride(0), dout.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1), dkv.stride(0),
        H, indices.shape[1], scale, scale * LOG2E,
        D_V=v_dim, D_R=D - v_dim, BLOCK_DV=_pow2(v_dim), BLOCK_DR=_pow2(D - v_dim),
        BLOCK_H=block_h, BLOCK_N=cfg.block_n, DO_DQ=do_dq, DO_DKV=do_dkv,
        SCAN=_scan_block(indices.shape[1]), SKIP_EMPTY=SKIP_EMPTY_SLOTS, **gather_switches(kv, dkv, v_dim, D - v_dim),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def sparse_mla_bwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, dlse: torch.Tensor | None, scale: float, v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dq (T, H, D), dkv (Tk, D)) of sparse_mla_fwd, given dout (T, H, v_dim) and optional dlse (T, H)."""
    T, H, D = q.shape
    K = indices.shape[1]
    dout = dout.contiguous()
    delta = bwd_delta(out, dout, dlse)
    dq = torch.empty_like(q)
    if T > 0 and K > 0 and USE_KEY_RANGES and lse.stride(1) == 1:
        masked = USE_MASKED_RANGES and H * D <= MASKED_RANGE_MAX_HEAD_WORK
        ranges = _last_cover.get(indices, MASKED_RANGE_MAX_RATIO if masked else 0.0)
        if ranges is not None:
            dkv = torch.empty_like(kv)
            try:
                range_mla_bwd(q, kv, ranges.lo, ranges.hi, dout, lse, delta, dq, dkv, scale, v_dim, sel=ranges.sel)
                return dq, dkv
            except RuntimeError:  # no config fits this device: the general kernel below
                pass
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if T == 0 or K == 0:
        return dq.zero_(), dkv.to(kv.dtype)

    def launcher(do_dq: bool, do_dkv: bool):
        def launch(cfg: KernelConfig) -> None:
            if do_dkv:
                dkv.zero_()  # a failed attempt may have added into it
            launch_bwd_kernel(cfg, do_dq, do_dkv, q, kv, indices, dout, lse, delta, dq, dkv, scale, v_dim)

        return launch

    if GLUON_BWD and (gluon := _gluon_module("gluon_sparse_mla_bwd")) is not None:
        if gluon.supported(q, kv, indices, dout, v_dim):
            gluon.sparse_mla_bwd(q, kv, indices, dout, lse, delta, scale, dq, dkv)
            return dq, dkv.to(kv.dtype)
    key = (H, D, v_dim, q.dtype)
    if ("bwd_mode", key) in _chosen:
        modes = [_chosen[("bwd_mode", key)]]
    else:
        modes = BWD_DEFAULT_MODES_64_HEADS if H >= 64 and q.device.type == "cuda" else BWD_DEFAULT_MODES
    errors = []
    for mode in modes:
        try:
            if mode == "fused":
                _launch("bwd_fused", key, BWD_FUSED_CONFIGS, launcher(True, True))
            elif mode == "split":
                _launch("bwd_dq", key, BWD_DQ_CONFIGS, launcher(True, False))
                _launch("bwd_dkv", key, BWD_DKV_CONFIGS, launcher(False, True))
            else:
                dkv.zero_()
                bwd_variants.run_mode(mode, key, q, kv, indices, dout, lse, delta, dq, dkv, scale, v_dim,
                                      skip_empty=SKIP_EMPTY_SLOTS)
        except RuntimeError as err:
            errors.append(str(err))
            continue
        _chosen[("bwd_mode", key)] = mode
        break
    else:
        raise RuntimeError("\n".join(errors))
    return dq, dkv.to(kv.dtype)


class SparseMLAFunction(torch.autograd.Function):
    """Autograd wrapper: gradients flow into q and kv (indices are integers)."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale: float, v_dim: int, invariant: bool):
        out, lse = sparse_mla_fwd(q, kv, indices, scale, v_dim, invariant)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.v_dim = scale, v_dim
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dkv = sparse_mla_bwd(q, kv, indices, out, lse, dout, dlse, ctx.scale, ctx.v_dim)
        return dq, dkv, None, None, None, None


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA-mode sparse attention, same contract as `reference.sparse_mla_attention`.

    q (T, H, D); kv (Tk, D), value = kv[:, :v_dim]; indices (T, K) rows of kv, -1 unused (any int dtype).
    Returns out (T, H, v_dim) in q's dtype and lse (T, H) float32 (natural log of the scaled scores' sum).
    invariant: the batch-invariant forward (see the module docstring); the backward is the same either way.
    """
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2 or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"sparse_mla_attention expects q (T, H, D), kv (Tk, D), indices (T, K); got "
                         f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    if not 0 < v_dim <= q.shape[-1]:
        raise ValueError(f"v_dim ({v_dim}) must be in 1..D ({q.shape[-1]})")
    q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
    if kv.dtype != q.dtype:
        kv = kv.to(q.dtype)
    return SparseMLAFunction.apply(q, kv, indices, float(scale), int(v_dim), bool(invariant))


def sparse_mla_flops(T: int, H: int, K: int, D: int, v_dim: int) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs of sparse MLA with K keys per query (all slots used)."""
    fwd = 2.0 * T * H * K * (D + v_dim)
    bwd = 2.0 * T * H * K * (D + v_dim + D + D + v_dim)  # recompute s, dP, dQ, dK, dV
    return fwd, bwd


__all__ = ["sparse_mla_attention", "sparse_mla_fwd", "sparse_mla_bwd", "SparseMLAFunction", "sparse_mla_flops"]

"""Sparse MLA forward for Hopper in Gluon (Triton's explicit-layout dialect, 3.5+): the gather, the pipeline and the
wgmma split written out rather than left to Triton's pipeliner (issue 20 item 2). The model's prefill and training
forward call it where `supported` holds (`triton_sparse_mla.GLUON_FWD`, on). benchmarks/sparse_mla_fwd_variants.py times its CONFIGS against
the Triton kernels (`gluon_<config>`) and tests/test_ops_gpu.py checks each against the torch reference.

Same contract as `triton_sparse_mla.sparse_mla_fwd` without the decode key split: q (T, H, 576) and kv (Tk, 576) in
bf16, indices (T, K) with -1 for unused slots -> out (T, H, 512), lse (T, H) float32 (-inf and 0 for rows without
keys). One program is one query row and 64 heads, 8 warps (two warp groups):
- q is copied to shared memory once; each step's BLOCK_N kv rows are gathered with cp.async into one of `stages`
  buffers, stages - 1 steps ahead (their indices loaded one step before that);
- S = q k^T: each warp group takes half of the step's keys over all 576 dims (wgmma, q and k from shared memory);
- P goes through shared memory; O += P v: each warp group owns 256 of the 512 value columns (128 accumulator
  registers a thread).
The `ws_` configs split the program by warp specialisation (`_sparse_mla_fwd_ws_kernel`): a producer partition of
PRODUCER_WARPS warps gathers q and the kv rows, and mbarriers hand each buffer to the 8 computing warps and back, so
that the gathers' address work and issue leave the computing warps' loop (their registers go up with setmaxnreg).
-1 slots read kv row 0 (their scores are set to -inf, so p = 0 and kv must be finite) and the key loop ends after a
row's last used slot. Requires sm_90 (`supported`). Compiled for sm_90a by Triton 3.6 (the H200's) no config spills;
Triton 3.8 spills 116-148 bytes at 64 keys a step (tools/kernel_resources.py). tests/test_gluon_emulated.py runs every
config's code on CPU through a FAKE Gluon (tools/gluon_emulator.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

# A barrier of the program's threads: thread_barrier in Triton 3.5-3.6 (the H200's), barrier from 3.7
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
LOG2E = 1.4426950408889634
BLOCK_H = 64
NUM_WARPS = 8
PRODUCER_WARPS = 4
PRODUCER_REGS = 56  # registers a producer thread keeps; the computing warps get the rest (setmaxnreg)
D_V, D_R = 512, 64


@dataclass(frozen=True)
class GluonFwdConfig:
    """Compile-time choices of the kernel."""

    block_n: int  # kv rows a step
    stages: int  # kv buffers: a step's rows are gathered stages - 1 steps ahead (64 x 2 or 32 x 4 fill shared memory)
    # Each thread keeps its own running sums of p and reduces them across the warp groups once, after the key loop,
    # instead of a cross-warp-group sum (shared memory and a barrier) every step.
    row_sum_at_end: bool = True
    # The next step's QK wgmma runs while this step's softmax computes (flash attention 3's intra-warp-group
    # pipelining); needs stages >= 3 (with warp_specialized, 3 or more keep the producer a step ahead).
    overlap: bool = False
    # A producer partition of PRODUCER_WARPS warps gathers the kv rows (mbarriers hand each buffer over) while the
    # 8 warps of the default partition only compute: Hopper's warp specialisation.
    warp_specialized: bool = False


CONFIGS = {
    "n64_s2": GluonFwdConfig(64, 2),
    "n64_s2_rowsum_each_step": GluonFwdConfig(64, 2, row_sum_at_end=False),
    "n32_s4": GluonFwdConfig(32, 4),
    "overlap_n32_s3": GluonFwdConfig(32, 3, overlap=True),
    "overlap_n32_s4": GluonFwdConfig(32, 4, overlap=True),
    "ws_n64_s2": GluonFwdConfig(64, 2, warp_specialized=True),
    "ws_n32_s4": GluonFwdConfig(32, 4, warp_specialized=True),
    "ws_overlap_n32_s4": GluonFwdConfig(32, 4, overlap=True, warp_specialized=True),
}
DEFAULT_CONFIG = "n64_s2"


def supported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, v_dim: int) -> bool:
    """The shapes, dtypes and device this kernel is built for (GLM-5's MLA on Hopper)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype == kv.dtype == torch.bfloat16
            and v_dim == D_V and q.shape[-1] == D_V + D_R and kv.shape[-1] == D_V + D_R and q.shape[1] % BLOCK_H == 0
            and q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1
            and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and kv.stride(0) % 8 == 0  # 16-byte cp.async
            and q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0 and indices.shape[1] > 0 and kv.shape[0] > 0)


@gluon.jit
def _row_end(idx_row_ptr, K, SCAN: gl.constexpr, layout: gl.constexpr):
    """One past the row's last used slot (0 for a row of -1)."""
    offs = gl.arange(0, SCAN, layout)
    end = gl.zeros([SCAN], gl.int32, layout)
    for k0 in range(0, K, SCAN):
        idx = gl.load(idx_row_ptr + k0 + offs, mask=k0 + offs < K, other=-1)
        end = gl.maximum(end, gl.where(idx >= 0, k0 + offs + 1, 0))
    return gl.max(end, axis=0)


@gluon.jit
def _block_idx(idx_row_ptr, n0, k_end, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The step's kv rows (-1 past k_end)."""
    offs = n0 + gl.arange(0, BLOCK_N, layout)
    return gl.load(idx_row_ptr + offs, mask=offs < k_end, other=-1).to(gl.int32)


@gluon.jit
def _gather(kn_buf, kp_buf, kv_ptr, idx, stride_kvt, D_V: gl.constexpr, D_R: gl.constexpr, layout: gl.constexpr,
            ROW64: gl.constexpr):
    """cp.async of kv rows `idx` (-1 reads row 0) into one stage's latent and rope buffers."""
    if ROW64:  # a paged decode pool can hold more than 2^31 elements
        rows = kv_ptr + (gl.maximum(idx, 0).to(gl.int64) * stride_kvt)[:, None]
    else:
        rows = kv_ptr + (gl.maximum(idx, 0) * stride_kvt)[:, None]
    cols_v = gl.arange(0, D_V, gl.SliceLayout(0, layout))
    cols_r = gl.arange(0, D_R, gl.SliceLayout(0, layout))
    cp.async_copy_global_to_shared(kn_buf, rows + cols_v[None, :])
    cp.async_copy_global_to_shared(kp_buf, rows + D_V + cols_r[None, :])


@gluon.jit
def _gather_first_steps(kn_smem, kp_smem, kv_ptr, idx_row, k_end, stride_kvt, layout: gl.constexpr,
                        ROW64: gl.constexpr):
    """cp.async of steps 0 .. STAGES - 2's kv rows, a commit group each; returns step STAGES - 1's rows."""
    STAGES: gl.constexpr = kn_smem.shape[0]
    BLOCK_N: gl.constexpr = kn_smem.shape[1]
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    for b in gl.static_range(STAGES - 1):
        _gather(kn_smem.index(b), kp_smem.index(b), kv_ptr, _block_idx(idx_row, b * BLOCK_N, k_end, BLOCK_N,
                rows_layout), stride_kvt, kn_smem.shape[2], kp_smem.shape[2], layout, ROW64)
        cp.commit_group()
    return _block_idx(idx_row, (STAGES - 1) * BLOCK_N, k_end, BLOCK_N, rows_layout)


@gluon.jit
def _gather_ahead(kn_smem, kp_smem, kv_ptr, idx_row, idx_next, j, n_steps, k_end, stride_kvt, layout: gl.constexpr,
                  ROW64: gl.constexpr):
    """Step j's start: wait for its rows (and the copies before them), then gather step j + STAGES - 1's rows
    (idx_next) into the buffer step j - 1 read, a commit group; returns the rows of the step after that."""
    STAGES: gl.constexpr = kn_smem.shape[0]
    BLOCK_N: gl.constexpr = kn_smem.shape[1]
    cp.wait_group(STAGES - 2)
    fence_async_shared()
    _cta_barrier()  # every thread's copies landed; every warp group is done with step j - 1's buffer
    ahead = j + STAGES - 1
    if ahead < n_steps:
        _gather(kn_smem.index(ahead % STAGES), kp_smem.index(ahead % STAGES), kv_ptr, idx_next, stride_kvt,
                kn_smem.shape[2], kp_smem.shape[2], layout, ROW64)
    cp.commit_group()
    return _block_idx(idx_row, (ahead + 1) * BLOCK_N, k_end, BLOCK_N, gl.SliceLayout(1, layout))


@gluon.jit
def _allocate_buffers(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_V: gl.constexpr,
                      D_R: gl.constexpr):
    """Shared memory of the forward: q (latent, rope), `STAGES` kv buffers (latent, rope) and P."""
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    return (gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], v_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_R], r_sl),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_V], v_sl),
            gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_R], r_sl),
            gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl))


@gluon.jit
def _copy_q(qn_smem, qp_smem, q_row_ptr, h0, stride_qh, layout: gl.constexpr):
    """cp.async of one query row's head block (latent and rope) into shared memory."""
    BLOCK_H: gl.constexpr = qn_smem.shape[0]
    D_V: gl.constexpr = qn_smem.shape[1]
    D_R: gl.constexpr = qp_smem.shape[1]
    q_rows = q_row_ptr + (h0 + gl.arange(0, BLOCK_H, gl.SliceLayout(1, layout))).to(gl.int64)[:, None] * stride_qh
    cp.async_copy_global_to_shared(qn_smem, q_rows + gl.arange(0, D_V, gl.SliceLayout(0, layout))[None, :])
    cp.async_copy_global_to_shared(qp_smem, q_rows + D_V + gl.arange(0, D_R, gl.SliceLayout(0, layout))[None, :])


@gluon.jit
def _online_softmax(s, valid, m_i, l_i, l_acc, scale_log2, ROW_SUM_AT_END: gl.constexpr):
    """One step of the online softmax in the log2 domain: (p, alpha, m, l, l_acc) after scores s of the step."""
    s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet stays at 0/0
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    if ROW_SUM_AT_END:
        l_acc = l_acc * alpha[:, None] + p
    else:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i, l_acc


@gluon.jit
def _store_rows(row_ptr, h0, stride_h, col0, tile):
    """row_ptr[h0 + h, col0 + c] = tile[h, c] in the pointer's dtype."""
    layout: gl.constexpr = tile.type.layout
    heads = h0 + gl.arange(0, tile.shape[0], gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, tile.shape[1], gl.SliceLayout(0, layout))
    gl.store(row_ptr + heads.to(gl.int64)[:, None] * stride_h + cols[None, :], tile.to(row_ptr.dtype.element_ty))


@gluon.jit
def _store_out(acc, m_i, l_i, l_acc, out_row_ptr, lse_row_ptr, h0, stride_oh, ROW_SUM_AT_END: gl.constexpr):
    """out = acc / l in bf16 and lse (natural log; -inf and 0 for rows without keys) of one row's head block."""
    if ROW_SUM_AT_END:
        l_i = gl.sum(l_acc, axis=1)
    BLOCK_H: gl.constexpr = acc.shape[0]
    o_layout: gl.constexpr = acc.type.layout
    has_keys = l_i > 0.0
    lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    inv_l = gl.convert_layout(1.0 / gl.where(has_keys, l_i, 1.0), gl.SliceLayout(1, o_layout))
    _store_rows(out_row_ptr, h0, stride_oh, 0, acc * inv_l[:, None])
    gl.store(lse_row_ptr + h0 + gl.arange(0, BLOCK_H, m_i.type.layout), lse)


@gluon.jit
def _scores(qn_smem, qp_smem, kn, kp, s_zero):
    """S = q k^T of one step (latent and rope dims) as an asynchronous wgmma; wait on it before use."""
    s = warpgroup_mma(qn_smem, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(qp_smem, kp.permute((1, 0)), s, is_async=True)


@gluon.jit
def _key_loop_overlapped(qn_smem, qp_smem, kn_smem, kp_smem, p_smem, kv_ptr, idx_row, idx_next, valid, m_i, l_i,
                         l_acc, acc, s_zero, n_steps, k_end, stride_kvt, scale_log2, ROW_SUM_AT_END: gl.constexpr,
                         ROW64: gl.constexpr):
    """The key loop with step j + 1's QK wgmma running while step j's softmax computes. No wgmma stays in flight
    across the loop's back edge: ptxas serialises every wgmma of the kernel when one does (measured on sm_90a)."""
    STAGES: gl.constexpr = kn_smem.shape[0]
    BLOCK_N: gl.constexpr = kn_smem.shape[1]
    D_V: gl.constexpr = kn_smem.shape[2]
    D_R: gl.constexpr = kp_smem.shape[2]
    o_layout: gl.constexpr = acc.type.layout
    keys_layout: gl.constexpr = valid.type.layout
    rows_layout: gl.constexpr = idx_next.type.layout
    copy_layout: gl.constexpr = rows_layout.parent
    cp.wait_group(STAGES - 2)  # step 0's rows and q
    fence_async_shared()
    _cta_barrier()
    s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(qn_smem, qp_smem, kn_smem.index(0), kp_smem.index(0),
                                                            s_zero),))
    for j in range(n_steps):
        nxt = (j + 1) % STAGES
        cp.wait_group(STAGES - 3)  # step j + 1's rows (a stale buffer past the last step: its scores go unused)
        fence_async_shared()
        _cta_barrier()  # every warp group is past step j - 1's PV: its kv buffer and P are free
        ahead = j + STAGES - 1
        if ahead < n_steps:
            _gather(kn_smem.index(ahead % STAGES), kp_smem.index(ahead % STAGES), kv_ptr, idx_next, stride_kvt,
                    D_V, D_R, copy_layout, ROW64)
        cp.commit_group()
        s_next = _scores(qn_smem, qp_smem, kn_smem.index(nxt), kp_smem.index(nxt), s_zero)
        p, alpha, m_i, l_i, l_acc = _online_softmax(s, valid, m_i, l_i, l_acc, scale_log2, ROW_SUM_AT_END)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # both halves of P are written
        acc_token = warpgroup_mma(p_smem, kn_smem.index(j % STAGES), acc, is_async=True)
        valid = _block_idx(idx_row, (j + 1) * BLOCK_N, k_end, BLOCK_N, keys_layout) >= 0
        idx_next = _block_idx(idx_row, (ahead + 1) * BLOCK_N, k_end, BLOCK_N, rows_layout)
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc_token))
    return acc, m_i, l_i, l_acc


@gluon.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_lt,
    K, scale_log2,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SCAN: gl.constexpr,
    STAGES: gl.constexpr, ROW_SUM_AT_END: gl.constexpr, OVERLAP: gl.constexpr, ROW64: gl.constexpr,
    num_warps: gl.constexpr,
):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    WG: gl.constexpr = num_warps // 4  # warp groups, side by side along the keys (S) and the value columns (O)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, BLOCK_N // WG, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, D_V // WG, 16])
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte cp.async
    keys_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    scan_layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    qn_smem, qp_smem, kn_smem, kp_smem, p_smem = _allocate_buffers(BLOCK_H, BLOCK_N, STAGES, D_V, D_R)
    _copy_q(qn_smem, qp_smem, q_ptr + t * stride_qt, h0, stride_qh, copy_layout)

    idx_row = idx_ptr + t * stride_it
    k_end = _row_end(idx_row, K, SCAN, scan_layout)
    idx_next = _gather_first_steps(kn_smem, kp_smem, kv_ptr, idx_row, k_end, stride_kvt, copy_layout, ROW64)
    valid = _block_idx(idx_row, 0, k_end, BLOCK_N, keys_layout) >= 0

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)  # with ROW_SUM_AT_END: per-slot running sums
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    n_steps = gl.cdiv(k_end, BLOCK_N)
    if OVERLAP:
        acc, m_i, l_i, l_acc = _key_loop_overlapped(qn_smem, qp_smem, kn_smem, kp_smem, p_smem, kv_ptr, idx_row,
                                                    idx_next, valid, m_i, l_i, l_acc, acc, s_zero, n_steps, k_end,
                                                    stride_kvt, scale_log2, ROW_SUM_AT_END, ROW64)
    else:
        for j in range(n_steps):
            buf = j % STAGES
            # step j's rows (and, at j = 0, q) in shared memory; every warp group past step j - 1's PV
            idx_next = _gather_ahead(kn_smem, kp_smem, kv_ptr, idx_row, idx_next, j, n_steps, k_end, stride_kvt,
                                     copy_layout, ROW64)
            valid_next = _block_idx(idx_row, (j + 1) * BLOCK_N, k_end, BLOCK_N, keys_layout) >= 0

            kn = kn_smem.index(buf)
            s = _scores(qn_smem, qp_smem, kn, kp_smem.index(buf), s_zero)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_i, l_acc = _online_softmax(s, valid, m_i, l_i, l_acc, scale_log2, ROW_SUM_AT_END)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()  # both halves of P are written
            acc = warpgroup_mma(p_smem, kn, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            valid = valid_next
    cp.wait_group(0)

    _store_out(acc, m_i, l_i, l_acc, out_ptr + t * stride_ot, lse_ptr + t * stride_lt, h0, stride_oh,
               ROW_SUM_AT_END)


@gluon.jit
def _ws_producer(q_ptr, kv_ptr, idx_row, qn_smem, qp_smem, kn_smem, kp_smem, q_ready, kv_ready, kv_free, k_end,
                 n_steps, q_row_offset, stride_qh, stride_kvt, h0, ROW64: gl.constexpr, WARPS: gl.constexpr):
    """The warp-specialised forward's producer: q, then every buffer's first step, then for each step j: hand step
    j + 1 over (kv_ready) once its rows have landed, wait for the computing warps to free step j's buffer and gather
    step j + STAGES into it. So a gather is issued a whole step before its rows are needed, and the issuing is never
    what the computing warps wait on."""
    STAGES: gl.constexpr = kn_smem.shape[0]
    BLOCK_N: gl.constexpr = kn_smem.shape[1]
    D_V: gl.constexpr = kn_smem.shape[2]
    D_R: gl.constexpr = kp_smem.shape[2]
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, copy_layout)
    _copy_q(qn_smem, qp_smem, q_ptr + q_row_offset, h0, stride_qh, copy_layout)
    cp.commit_group()
    for b in gl.static_range(STAGES):
        if b < n_steps:
            _gather(kn_smem.index(b), kp_smem.index(b), kv_ptr, _block_idx(idx_row, b * BLOCK_N, k_end, BLOCK_N,
                    rows_layout), stride_kvt, D_V, D_R, copy_layout, ROW64)
        cp.commit_group()  # an empty group past the last step keeps the counts below fixed
    cp.wait_group(STAGES - 1)  # q and step 0
    fence_async_shared()  # the copies are visible to wgmma's reads
    mbarrier.arrive(q_ready)
    if n_steps > 0:
        mbarrier.arrive(kv_ready.index(0))
    for j in range(n_steps):
        if j + 1 < n_steps:
            cp.wait_group(STAGES - 2)  # step j + 1 (gathered at step j + 1 - STAGES or in the prologue)
            fence_async_shared()
            mbarrier.arrive(kv_ready.index((j + 1) % STAGES))
        buf = j % STAGES
        mbarrier.wait(kv_free.index(buf), (j // STAGES) & 1)  # the computing warps are done with step j
        if j + STAGES < n_steps:
            _gather(kn_smem.index(buf), kp_smem.index(buf), kv_ptr, _block_idx(idx_row, (j + STAGES) * BLOCK_N,
                    k_end, BLOCK_N, rows_layout), stride_kvt, D_V, D_R, copy_layout, ROW64)
        cp.commit_group()
    cp.wait_group(0)


@gluon.jit
def _ws_compute(qn_smem, qp_smem, kn_smem, kp_smem, p_smem, q_ready, kv_ready, kv_free, idx_row, k_end, n_steps,
                scale_log2, out_row_ptr, lse_row_ptr, h0, stride_oh, ROW_SUM_AT_END: gl.constexpr,
                OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    """The warp-specialised forward's computing warps: the key loop of `_sparse_mla_fwd_kernel` without its copies,
    each buffer taken when the producer hands it over and given back after its PV. With OVERLAP, step j + 1's QK
    runs while step j's softmax computes, as in `_key_loop_overlapped`."""
    STAGES: gl.constexpr = kn_smem.shape[0]
    BLOCK_N: gl.constexpr = kn_smem.shape[1]
    D_V: gl.constexpr = kn_smem.shape[2]
    BLOCK_H: gl.constexpr = qn_smem.shape[0]
    WG: gl.constexpr = num_warps // 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, BLOCK_N // WG, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, D_V // WG, 16])
    keys_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    if OVERLAP:  # step 0's scores before the loop (a row without keys computes them from an unfilled buffer, unused)
        if n_steps > 0:
            mbarrier.wait(kv_ready.index(0), 0)
        fence_async_shared()
        s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(qn_smem, qp_smem, kn_smem.index(0),
                                                                kp_smem.index(0), s_zero),))
    for j in range(n_steps):
        buf = j % STAGES
        valid = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, keys_layout) >= 0
        kn = kn_smem.index(buf)
        if OVERLAP:
            nxt = (j + 1) % STAGES
            if j + 1 < n_steps:
                mbarrier.wait(kv_ready.index(nxt), ((j + 1) // STAGES) & 1)
                fence_async_shared()
            # past the last step the buffer holds an earlier step's rows, which the producer no longer writes: the
            # scores are computed and not used
            s_next = _scores(qn_smem, qp_smem, kn_smem.index(nxt), kp_smem.index(nxt), s_zero)
        else:
            mbarrier.wait(kv_ready.index(buf), (j // STAGES) & 1)
            fence_async_shared()
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(qn_smem, qp_smem, kn, kp_smem.index(buf),
                                                                    s_zero),))
        p, alpha, m_i, l_i, l_acc = _online_softmax(s, valid, m_i, l_i, l_acc, scale_log2, ROW_SUM_AT_END)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()  # both halves of P are written
        if OVERLAP:
            s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, warpgroup_mma(p_smem, kn, acc, is_async=True)))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(p_smem, kn, acc, is_async=True),))
        mbarrier.arrive(kv_free.index(buf))
    _store_out(acc, m_i, l_i, l_acc, out_row_ptr, lse_row_ptr, h0, stride_oh, ROW_SUM_AT_END)


@gluon.jit
def _sparse_mla_fwd_ws_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_lt,
    K, scale_log2,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SCAN: gl.constexpr,
    STAGES: gl.constexpr, ROW_SUM_AT_END: gl.constexpr, OVERLAP: gl.constexpr, ROW64: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    qn_smem, qp_smem, kn_smem, kp_smem, p_smem = _allocate_buffers(BLOCK_H, BLOCK_N, STAGES, D_V, D_R)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for b in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(kv_free.index(b), count=1)

    idx_row = idx_ptr + t * stride_it
    k_end = _row_end(idx_row, K, SCAN, gl.BlockedLayout([4], [32], [num_warps], [0]))
    n_steps = gl.cdiv(k_end, BLOCK_N)
    gl.warp_specialize([
        (_ws_compute, (qn_smem, qp_smem, kn_smem, kp_smem, p_smem, q_ready, kv_ready, kv_free, idx_row, k_end,
                       n_steps, scale_log2, out_ptr + t * stride_ot, lse_ptr + t * stride_lt, h0, stride_oh,
                       ROW_SUM_AT_END, OVERLAP, num_warps)),
        (_ws_producer, (q_ptr, kv_ptr, idx_row, qn_smem, qp_smem, kn_smem, kp_smem, q_ready, kv_ready, kv_free, k_end,
                        n_steps, t * stride_qt, stride_qh, stride_kvt, h0, ROW64, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def sparse_mla_fwd(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int, config: str = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, 576), kv (Tk, 576), indices (T, K) -> out (T, H, 512) bf16, lse (T, H) float32 (`supported` holds)."""
    T, H, _ = q.shape
    K = indices.shape[1]
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    cfg = CONFIGS[config]
    args = (q, kv, indices, out, lse, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0),
            out.stride(1), lse.stride(0), K, scale * LOG2E)
    constexprs = dict(D_V=D_V, D_R=D_R, BLOCK_H=BLOCK_H, BLOCK_N=cfg.block_n, SCAN=min(triton.next_power_of_2(K), 1024),
                      STAGES=cfg.stages, ROW_SUM_AT_END=cfg.row_sum_at_end, ROW64=kv.numel() >= 2**31,
                      num_warps=NUM_WARPS)
    kernel = _sparse_mla_fwd_ws_kernel if cfg.warp_specialized else _sparse_mla_fwd_kernel
    producer = dict(PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS) if cfg.warp_specialized else {}
    kernel[(T, H // BLOCK_H)](*args, **constexprs, OVERLAP=cfg.overlap, **producer)
    return out, lse

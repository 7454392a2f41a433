"""The indexer KL loss's attention target on Hopper in Gluon: per query row, each selected key's softmax probability
summed over the 64 heads, recomputed from q, kv and the layer's own lse (the sparse stage's target,
`triton_indexer_loss._attn_probs_kernel`'s contract with lse given). The Triton kernel was 85% of the loss's time
at 64K tokens (benchmarks/RESULTS.md); this one runs the Gluon forward's gather pipeline and QK wgmma
(gluon_sparse_mla.py) without its PV product and online softmax.

One program is one query row and 64 heads, 8 warps: q in shared memory once, each step's BLOCK_N kv rows gathered by
cp.async STAGES - 1 steps ahead, S = q k^T split between the two warp groups by keys, p = exp2(S scale - lse) and its
column sums over heads stored as the step's slots. The key loop ends after the row's last used slot; the caller
zeroes the row first, so later slots read 0 as the Triton kernel writes them. Requires sm_90 (`supported`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from slime_dsa.ops.gluon_sparse_mla import (
    BLOCK_H, D_R, D_V, LOG2E, NUM_WARPS, _block_idx, _copy_q, _gather_ahead, _gather_first_steps, _row_end, _scores,
)

# (kv rows a step, kv buffers): each fills the shared memory next to q (64 x 576 bf16)
CONFIGS = {"n64_s2": (64, 2), "n32_s4": (32, 4)}
DEFAULT_CONFIG = "n64_s2"


def supported(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, lse: torch.Tensor | None) -> bool:
    """GLM-5's MLA (64 heads, 512 + 64) on Hopper, with the layer's lse and a selection of rows."""
    return (lse is not None and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype == kv.dtype == torch.bfloat16 and q.shape[1] == BLOCK_H and q.shape[-1] == D_V + D_R
            and kv.shape[-1] == D_V + D_R and q.stride(-1) == 1 and kv.stride(-1) == 1 and rows.stride(-1) == 1
            and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and kv.stride(0) % 8 == 0  # 16-byte cp.async
            and q.data_ptr() % 16 == 0 and kv.data_ptr() % 16 == 0 and rows.shape[1] > 0 and kv.shape[0] > 0)


@gluon.jit
def _attn_probs_kernel(
    q_ptr, kv_ptr, lse_ptr, idx_ptr, probs_ptr, c0,
    stride_qt, stride_qh, stride_kvt, stride_lt, stride_it, stride_pt,
    K, scale_log2,
    D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, SCAN: gl.constexpr,
    STAGES: gl.constexpr, ROW64: gl.constexpr, num_warps: gl.constexpr,
):
    t_local = gl.program_id(0).to(gl.int64)
    t = c0 + t_local
    WG: gl.constexpr = num_warps // 4  # warp groups, side by side along the step's keys
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, BLOCK_N // WG, 16])
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte cp.async
    keys_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    scan_layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_R], gl.bfloat16)
    qn_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], v_sl)
    qp_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_R], r_sl)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_V], v_sl)
    kp_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D_R], r_sl)
    _copy_q(qn_smem, qp_smem, q_ptr + t * stride_qt, 0, stride_qh, copy_layout)

    idx_row = idx_ptr + t * stride_it
    k_end = _row_end(idx_row, K, SCAN, scan_layout)
    idx_next = _gather_first_steps(kn_smem, kp_smem, kv_ptr, idx_row, k_end, stride_kvt, copy_layout, ROW64)
    heads = gl.arange(0, BLOCK_H, gl.SliceLayout(1, s_layout))
    lse_log2 = gl.load(lse_ptr + t * stride_lt + heads) * 1.4426950408889634
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    probs_row = probs_ptr + t_local * stride_pt
    n_steps = gl.cdiv(k_end, BLOCK_N)
    for j in range(n_steps):
        buf = j % STAGES
        # step j's rows (and, at j = 0, q) in shared memory; every warp group past step j - 1's QK
        idx_next = _gather_ahead(kn_smem, kp_smem, kv_ptr, idx_row, idx_next, j, n_steps, k_end, stride_kvt,
                                 copy_layout, ROW64)
        slots = j * BLOCK_N + gl.arange(0, BLOCK_N, keys_layout)
        valid = _block_idx(idx_row, j * BLOCK_N, k_end, BLOCK_N, keys_layout) >= 0
        s = _scores(qn_smem, qp_smem, kn_smem.index(buf), kp_smem.index(buf), s_zero)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p = gl.where(valid[None, :], gl.exp2(s * scale_log2 - lse_log2[:, None]), 0.0)
        gl.store(probs_row + slots, gl.sum(p, axis=0), mask=slots < K)
    cp.wait_group(0)


def attn_probs(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, c0: int, c1: int,
               scale: float, probs: torch.Tensor, config: str | None = None) -> None:
    """probs[t - c0, n] = sum_h softmax probability of head h of query t for key rows[t, n], for t in c0:c1 (slots
    past a row's last used one are left as they are: the caller zeroes probs). `supported` holds."""
    K = rows.shape[1]
    if c1 <= c0:
        return
    block_n, stages = CONFIGS[config or DEFAULT_CONFIG]
    lse = lse.float().contiguous()
    _attn_probs_kernel[(c1 - c0,)](
        q, kv, lse, rows, probs, c0,
        q.stride(0), q.stride(1), kv.stride(0), lse.stride(0), rows.stride(0), probs.stride(0),
        K, scale * LOG2E,
        D_V=D_V, D_R=D_R, BLOCK_H=BLOCK_H, BLOCK_N=block_n, SCAN=min(triton.next_power_of_2(K), 1024),
        STAGES=stages, ROW64=kv.numel() >= 2**31, num_warps=NUM_WARPS,
    )

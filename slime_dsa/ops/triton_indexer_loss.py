"""Fused DSA indexer KL loss (Triton): KL(p_bar || softmax(I)) per query, gradients into the indexer only.

Contract and notation: `reference.indexer_kl_loss` (docs/algorithms.md section 6). Work goes by chunks of
query rows, and per chunk only (rows x keys) float32 matrices exist, never (heads x T x T):
1. `_attn_probs_kernel`, once per layer of the group: one program per query recomputes that layer's
   softmax probabilities from q, kv and lse (lse is recomputed in-kernel when not given) and writes their
   sum over heads; torch L1-normalises each layer and averages them into the target p_bar. On Hopper at
   GLM-5's MLA shapes with the layer's lse, slime_dsa/ops/gluon_attn_probs.py computes the same sums.
2. `_index_scores_kernel`: the index scores I on the same key set.
3. torch: KL per row from (p_bar, I); the gradient w.r.t. I is softmax(I) * sum(p_bar) - p_bar.
4. backward, `_index_scores_bwd_kernel`: dI -> d index_q, d index_weights (per query, in registers) and
   d index_k (float32 atomics, since a key row is shared by many queries).
The targets are kept for backward while they fit in SAVE_TARGET_ELEMS; otherwise backward recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slime_dsa.ops.reference import _query_positions

CHUNK_ELEMS = 1 << 26  # query rows x keys per chunk (256 MiB per float32 matrix)
SAVE_TARGET_ELEMS = 1 << 28  # keep p_bar for backward up to this many entries (1 GiB)
# The sparse stage's target on Hopper at GLM-5's MLA shapes through slime_dsa/ops/gluon_attn_probs.py
GLUON_PROBS = True
LOG2E = 1.4426950408889634


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


@triton.jit
def _key_block(rows_ptr, stride_rt, t, kstart, pos, n0, W, BLOCK_N: tl.constexpr, DENSE: tl.constexpr):
    """Global key rows (BN,) int64 and their validity for columns n0:n0+BN of query row t's key set."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if DENSE:  # every causal key of the sequence: rows kstart .. kstart + pos
        valid = offs_n <= pos
        row = kstart + offs_n.to(tl.int64)
    else:  # the selected rows, -1 unused
        row = tl.load(rows_ptr + t * stride_rt + offs_n, mask=offs_n < W, other=-1).to(tl.int64)
        valid = row >= 0
    return tl.where(valid, row, 0), valid, offs_n


@triton.jit
def _attn_probs_kernel(
    q_ptr, kv_ptr, lse_ptr, rows_ptr, kstart_ptr, pos_ptr, probs_ptr,
    c0, W, H, scale_log2,
    stride_qt, stride_qh, stride_kvt, stride_lt, stride_rt, stride_pt,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LSE: tl.constexpr, DENSE: tl.constexpr,
):
    """probs[t, n] = sum_h softmax_n(scale * q[t, h] . kv[row n]) for one query row t (one program)."""
    t_local = tl.program_id(0).to(tl.int64)
    t = c0 + t_local
    kstart = tl.load(kstart_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_v = offs_v < D_V
    mask_r = offs_r < D_R
    n_end = tl.minimum(W, pos + 1) if DENSE else W
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
        q_nope = tl.load(q_rows + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)  # (BH, DV)
        q_pe = tl.load(q_rows + D_V + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)  # (BH, DR)
        if HAS_LSE:
            lse = tl.load(lse_ptr + t * stride_lt + offs_h, mask=mask_h, other=float("inf")) * 1.4426950408889634
        else:  # online logsumexp over the key set first
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            for n0 in range(0, n_end, BLOCK_N):
                row, valid, offs_n = _key_block(rows_ptr, stride_rt, t, kstart, pos, n0, W, BLOCK_N, DENSE)
                k_nope = tl.load(kv_ptr + row[:, None] * stride_kvt + offs_v[None, :],
                                 mask=valid[:, None] & mask_v[None, :], other=0.0)
                k_pe = tl.load(kv_ptr + row[:, None] * stride_kvt + D_V + offs_r[None, :],
                               mask=valid[:, None] & mask_r[None, :], other=0.0)
                s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))
                s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # (BH, BN)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
                m_i = m_new
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("inf"))
        lse = tl.where(mask_h, lse, float("inf"))  # padded heads contribute exactly 0
        for n0 in range(0, n_end, BLOCK_N):
            row, valid, offs_n = _key_block(rows_ptr, stride_rt, t, kstart, pos, n0, W, BLOCK_N, DENSE)
            k_nope = tl.load(kv_ptr + row[:, None] * stride_kvt + offs_v[None, :],
                             mask=valid[:, None] & mask_v[None, :], other=0.0)
            k_pe = tl.load(kv_ptr + row[:, None] * stride_kvt + D_V + offs_r[None, :],
                           mask=valid[:, None] & mask_r[None, :], other=0.0)
            s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))  # (BH, BN)
            p = tl.exp2(s * scale_log2 - lse[:, None])
            p = tl.sum(tl.where(valid[None, :], p, 0.0), axis=0)  # (BN,) summed over heads
            out = probs_ptr + t_local * stride_pt + offs_n
            tl.store(out, tl.load(out, mask=offs_n < W, other=0.0) + p, mask=offs_n < W)


@triton.jit
def _index_scores_kernel(
    q_ptr, k_ptr, w_ptr, rows_ptr, kstart_ptr, pos_ptr, scores_ptr,
    c0, W, scale, stride_rt, stride_st,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
):
    """scores[t, n] = sum_j w[t, j] relu(scale q[t, j] . k[row n]), -inf outside the key set."""
    t_local = tl.program_id(0).to(tl.int64)
    t = c0 + t_local
    kstart = tl.load(kstart_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_j = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    mask_d = offs_d < DI
    q = tl.load(q_ptr + t * HI * DI + offs_j[:, None] * DI + offs_d[None, :],
                mask=(offs_j < HI)[:, None] & mask_d[None, :], other=0.0)  # (BHI, DI)
    w = tl.load(w_ptr + t * HI + offs_j, mask=offs_j < HI, other=0.0).to(tl.float32) * scale  # (BHI,)
    for n0 in range(0, W, BLOCK_N):
        row, valid, offs_n = _key_block(rows_ptr, stride_rt, t, kstart, pos, n0, W, BLOCK_N, DENSE)
        k = tl.load(k_ptr + row[:, None] * DI + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k))  # (BHI, BN)
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)  # (BN,)
        tl.store(scores_ptr + t_local * stride_st + offs_n, tl.where(valid, score, float("-inf")), mask=offs_n < W)


@triton.jit
def _index_scores_bwd_kernel(
    q_ptr, k_ptr, w_ptr, rows_ptr, kstart_ptr, pos_ptr, dscores_ptr, dq_ptr, dk_ptr, dw_ptr,
    c0, W, scale, stride_rt, stride_st,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
):
    """Backward of `_index_scores_kernel` for one query row, given dscores (zero outside the key set)."""
    t_local = tl.program_id(0).to(tl.int64)
    t = c0 + t_local
    kstart = tl.load(kstart_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs_j = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    mask_j = offs_j < HI
    mask_d = offs_d < DI
    q = tl.load(q_ptr + t * HI * DI + offs_j[:, None] * DI + offs_d[None, :],
                mask=mask_j[:, None] & mask_d[None, :], other=0.0)  # (BHI, DI)
    w = tl.load(w_ptr + t * HI + offs_j, mask=mask_j, other=0.0).to(tl.float32)  # (BHI,)
    dq = tl.zeros([BLOCK_HI, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_HI], tl.float32)
    for n0 in range(0, W, BLOCK_N):
        row, valid, offs_n = _key_block(rows_ptr, stride_rt, t, kstart, pos, n0, W, BLOCK_N, DENSE)
        k = tl.load(k_ptr + row[:, None] * DI + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0)
        g = tl.load(dscores_ptr + t_local * stride_st + offs_n, mask=valid & (offs_n < W), other=0.0)  # (BN,)
        s = tl.dot(q, tl.trans(k)) * scale  # (BHI, BN)
        dw += tl.sum(tl.maximum(s, 0.0) * g[None, :], axis=1)
        # dL/d(q.k), kept in float32 (tf32 products): a bf16 dS costs ~1e-2 relative error in d index_k,
        # which sums many small contributions per key.
        ds = tl.where(s > 0.0, g[None, :] * w[:, None] * scale, 0.0)
        dq += tl.dot(ds, k.to(tl.float32))
        dk = tl.dot(tl.trans(ds), q.to(tl.float32))  # (BN, DI)
        tl.atomic_add(dk_ptr + row[:, None] * DI + offs_d[None, :], dk, mask=valid[:, None] & mask_d[None, :],
                      sem="relaxed")
    tl.store(dq_ptr + t * HI * DI + offs_j[:, None] * DI + offs_d[None, :], dq, mask=mask_j[:, None] & mask_d[None, :])
    tl.store(dw_ptr + t * HI + offs_j, dw, mask=mask_j)


class _Plan:
    """Per-query key sets and the chunking of query rows."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, rows: torch.Tensor | None, n_rows: int, device) -> None:
        seq_id, pos = _query_positions(cu_seqlens_q.to(device), cu_seqlens_k.to(device), total=n_rows)
        self.pos = pos.to(torch.int32).contiguous()  # (Tq,)
        self.key_start = cu_seqlens_k.to(device)[seq_id].to(torch.int64).contiguous()  # (Tq,)
        self.rows = rows.contiguous() if rows is not None else None
        self.dense = rows is None
        pos_cpu = pos.cpu() if self.dense else None
        width = (int(pos_cpu.max()) + 1 if n_rows else 1) if self.dense else max(rows.shape[1], 1)
        step = max(1, CHUNK_ELEMS // width)
        self.chunks = []  # (c0, c1, width)
        for c0 in range(0, n_rows, step):
            c1 = min(c0 + step, n_rows)
            w = int(pos_cpu[c0:c1].max()) + 1 if self.dense else width
            self.chunks.append((c0, c1, w))

    def rows_arg(self, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        return (self.rows, self.rows.stride(0)) if self.rows is not None else (like, 0)


def _target(plan: _Plan, c0: int, c1: int, W: int, attn_q, attn_kv, attn_lse, attn_scale: float) -> torch.Tensor:
    """p_bar (C, W) float32 for query rows c0:c1: mean over layers of L1-normalised head-summed probabilities."""
    target = torch.zeros(c1 - c0, W, dtype=torch.float32, device=plan.pos.device)
    probs = torch.empty_like(target)
    for g in range(len(attn_q)):
        q, kv = attn_q[g].contiguous(), attn_kv[g].contiguous().to(attn_q[g].dtype)
        lse = attn_lse[g] if attn_lse is not None else None
        H, D = q.shape[1], q.shape[2]
        d_main = triton.next_power_of_2(D) // 2 if D & (D - 1) else D  # D = d_main + rest, 576 = 512 + 64
        rows, stride_rt = plan.rows_arg(plan.pos)
        probs.zero_()
        if (gluon := _gluon_probs(q, kv, plan.rows, lse)) is not None:
            gluon.attn_probs(q, kv, lse, plan.rows, c0, c1, attn_scale, probs)
        else:
            _attn_probs_kernel[(c1 - c0,)](
                q, kv, lse.float().contiguous() if lse is not None else q, rows, plan.key_start, plan.pos, probs,
                c0, W, H, attn_scale * LOG2E,
                q.stride(0), q.stride(1), kv.stride(0), lse.stride(0) if lse is not None else 0, stride_rt,
                probs.stride(0),
                D_V=d_main, D_R=D - d_main, BLOCK_DV=_pow2(d_main), BLOCK_DR=_pow2(D - d_main),
                BLOCK_H=min(64, _pow2(H)), BLOCK_N=64 if H >= 64 else 32, HAS_LSE=lse is not None, DENSE=plan.dense,
                num_warps=8 if H >= 64 else 4, num_stages=2 if H >= 64 else 1,
            )
        target += probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return target.div_(len(attn_q))


def _gluon_probs(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None, lse: torch.Tensor | None):
    """slime_dsa.ops.gluon_attn_probs where it takes this layer (GLUON_PROBS on, a selection, Hopper, GLM-5's
    MLA, the layer's lse), else None."""
    if not GLUON_PROBS or rows is None or lse is None or not q.is_cuda:
        return None
    try:
        from slime_dsa.ops import gluon_attn_probs  # noqa: PLC0415 (Triton 3.5+ only)
    except ImportError:
        return None
    return gluon_attn_probs if gluon_attn_probs.supported(q, kv, rows, lse) else None


def _index_args(index_q: torch.Tensor, dense: bool) -> dict:
    Hi, Di = index_q.shape[1], index_q.shape[2]
    return dict(HI=Hi, DI=Di, BLOCK_HI=_pow2(Hi), BLOCK_DI=_pow2(Di), BLOCK_N=64, DENSE=dense, num_warps=4)


def _scores(plan: _Plan, c0: int, c1: int, W: int, index_q, index_k, index_weights, index_scale) -> torch.Tensor:
    scores = torch.empty(c1 - c0, W, dtype=torch.float32, device=index_q.device)
    rows, stride_rt = plan.rows_arg(plan.pos)
    _index_scores_kernel[(c1 - c0,)](
        index_q, index_k, index_weights, rows, plan.key_start, plan.pos, scores,
        c0, W, index_scale, stride_rt, scores.stride(0), **_index_args(index_q, plan.dense),
    )
    return scores


class IndexerKLFunction(torch.autograd.Function):
    """Per-query KL; the target is a constant, gradients go to index_q, index_k, index_weights."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_weights, index_scale, attn_q, attn_kv, attn_lse, attn_scale,
                cu_seqlens_q, cu_seqlens_k, rows):
        plan = _Plan(cu_seqlens_q, cu_seqlens_k, rows, index_q.shape[0], index_q.device)
        kl = torch.zeros(index_q.shape[0], dtype=torch.float32, device=index_q.device)
        keep = sum((c1 - c0) * w for c0, c1, w in plan.chunks) <= SAVE_TARGET_ELEMS
        targets = []
        for c0, c1, W in plan.chunks:
            target = _target(plan, c0, c1, W, attn_q, attn_kv, attn_lse, attn_scale)
            log_q = torch.log_softmax(_scores(plan, c0, c1, W, index_q, index_k, index_weights, index_scale), -1)
            kl[c0:c1] = (torch.xlogy(target, target) - target * log_q.nan_to_num(0.0, 0.0, 0.0)).sum(-1)
            targets.append(target if keep else None)
        ctx.plan, ctx.targets = plan, targets
        ctx.index_scale, ctx.attn = index_scale, (attn_q, attn_kv, attn_lse, attn_scale)
        ctx.save_for_backward(index_q, index_k, index_weights)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        index_q, index_k, index_weights = ctx.saved_tensors
        plan = ctx.plan
        dq = torch.zeros(index_q.shape, dtype=torch.float32, device=index_q.device)
        dk = torch.zeros(index_k.shape, dtype=torch.float32, device=index_k.device)
        dw = torch.zeros(index_weights.shape, dtype=torch.float32, device=index_q.device)
        grad_kl = grad_kl.float()
        for (c0, c1, W), target in zip(plan.chunks, ctx.targets):
            if target is None:
                target = _target(plan, c0, c1, W, *ctx.attn)
            scores = _scores(plan, c0, c1, W, index_q, index_k, index_weights, ctx.index_scale)
            # d KL / d I = softmax(I) * sum(p_bar) - p_bar; zero outside the key set (softmax and p_bar are 0).
            dscores = (torch.softmax(scores, -1) * target.sum(-1, keepdim=True) - target) * grad_kl[c0:c1, None]
            rows, stride_rt = plan.rows_arg(plan.pos)
            _index_scores_bwd_kernel[(c1 - c0,)](
                index_q, index_k, index_weights, rows, plan.key_start, plan.pos, dscores.contiguous(), dq, dk, dw,
                c0, W, ctx.index_scale, stride_rt, dscores.stride(0), **_index_args(index_q, plan.dense),
            )
        return (dq.to(index_q.dtype), dk.to(index_k.dtype), dw.to(index_weights.dtype),
                None, None, None, None, None, None, None, None)


def indexer_kl_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_weights: torch.Tensor,
    index_scale: float,
    attn_q: Sequence[torch.Tensor],
    attn_kv: Sequence[torch.Tensor],
    attn_lse: Sequence[torch.Tensor | None] | None,
    attn_scale: float,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-query indexer KL (Tq,) float32; same contract as `reference.indexer_kl_loss`."""
    if len(attn_q) != len(attn_kv) or (attn_lse is not None and len(attn_lse) != len(attn_q)) or not attn_q:
        raise ValueError(f"indexer_kl_loss needs one (q, kv[, lse]) per layer of the group; got {len(attn_q)} q, "
                         f"{len(attn_kv)} kv, {None if attn_lse is None else len(attn_lse)} lse")
    index_q, index_k = index_q.contiguous(), index_k.contiguous().to(index_q.dtype)
    return IndexerKLFunction.apply(
        index_q, index_k, index_weights.contiguous(), float(index_scale), list(attn_q), list(attn_kv),
        list(attn_lse) if attn_lse is not None else None, float(attn_scale), cu_seqlens_q, cu_seqlens_k, rows,
    )


__all__ = ["indexer_kl_loss", "IndexerKLFunction"]

"""Batch-invariant primitives for true on-policy RL (recipe key model.true_on_policy, issue 23).

With the mode on (`set_enabled(True)`, once per process, by the engine and the trainer alike) every op whose result
for one row could depend on the other rows of its batch goes through this module: a row's result is then a function
of that row alone, whatever the batch size, its other rows, or whether it is a decode row, a prefill row or a
training row. The engine's log-probs then equal the trainer's bit for bit under the same weights.

How, on the torch path (any device):
- matmuls run in fixed-shape row chunks: rows are padded to a multiple of ROW_CHUNK and every chunk is one
  (ROW_CHUNK, K) x (K, N) GEMM call. A BLAS picks its kernel and its reduction order from the shape, so the same
  shape gives each row the same bits (a plain GEMM does not: on MKL an M=1 product is a GEMV, M=2..3 differ too);
- attention of a query over its selected key rows runs blockwise (KEY_BLOCK keys at a time, online softmax, in
  QUERY_CHUNK query chunks), always over the gathered rows: no dense shortcut, no split over keys. A block past a
  query's last key adds exactly nothing, so the width of the batch does not matter;
- indexer scores come from the same fixed blocks, so the top-k is the same in prefill, decode and training;
- element-wise transcendental ops (the router's sigmoid, the MLP's activation, RoPE's cos and sin) run on
  fixed-shape row pieces too (`rowwise`): on CPU a vectorised and a scalar-tail exp can differ in the last bit;
- RMSNorm, LayerNorm and log-softmax are row-wise kernels already (tests/test_true_on_policy.py checks them).
MoE experts run the per-expert loop (each expert's rows through `linear`), or the kernels' grouped GEMM where
there is one; either way each token's outputs are summed in ascending expert order.

On CUDA, `slime_dsa.ops.triton_invariant` replaces these functions when it imports, with the same signatures and
semantics, differentiable (the trainer back-propagates through them), whatever the recipe's model.ops_backend (the
mode picks its kernels per device, engine and trainer alike):

    linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor
        x (..., K), weight (N, K), bias (N,) -> (..., N) in x's dtype: F.linear, each row independent of the others.
    rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor
        x (..., D), weight (D,) -> weight * rms_norm(x in float32, eps) cast to x's dtype (the model's RMSNorm).
    log_softmax_gather(logits: Tensor, ids: Tensor, temperature: float) -> Tensor
        logits (T, V), ids (T,) -> (T,) float32: log_softmax(logits.float() / temperature)[t, ids[t]].
    head_matmul(x: Tensor, weight: Tensor) -> Tensor   (optional; else a `linear` per head)
        x (T, H, A), weight (H, A, B) -> (T, H, B): out[:, h] = x[:, h] @ weight[h].
    grouped_linear(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor   (optional; else the experts' loop)
        x (M, K) rows sorted by expert, weight (E, N, K), offs (E,) end row of each expert -> (M, N).
    mla_attention, indexer_topk, indexer_topk_paged   (optional; else the torch blocks below)
        as this module's functions of those names, in the kernels' own fixed blocks, with no host sync at decode.
With all of grouped_linear, mla_attention and indexer_topk_paged there, decode can run in CUDA graphs (`graph_safe`).

Same thread count on both sides: on CPU a BLAS may split one GEMM differently over more threads, so the engine and
the trainer must run with the same torch thread count (the recipe gives both cluster.num_cpus_per_actor).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
import torch.nn.functional as F

from slime_dsa.ops import reference
from slime_dsa.ops.reference import select_topk

ROW_CHUNK = 64  # rows of every GEMM the torch path runs
QUERY_CHUNK = 32  # query rows of every attention / indexer block
KEY_BLOCK = 64  # keys of every attention / indexer block

_enabled = False


def set_enabled(on: bool) -> None:
    """Turn batch-invariant mode on or off for the whole process."""
    global _enabled
    _enabled = bool(on)


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Batch-invariant mode on (or off) inside the block."""
    before = _enabled
    set_enabled(on)
    try:
        yield
    finally:
        set_enabled(before)


_gpu_module: ModuleType | None | bool = False  # False: not looked up yet


def _gpu(x: torch.Tensor) -> ModuleType | None:
    """slime_dsa.ops.triton_invariant for CUDA tensors when it imports, else None (the torch path)."""
    global _gpu_module
    if x.device.type != "cuda":
        return None
    if _gpu_module is False:
        try:  # by name: the module is optional (no Triton, or not written yet)
            _gpu_module = importlib.import_module("slime_dsa.ops.triton_invariant")
        except ImportError:
            _gpu_module = None
    return _gpu_module  # type: ignore[return-value]


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x


# ----------------------------------------------------------------------------------------------
# Row-wise primitives (the interface shared with triton_invariant)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is computed by the same fixed-shape GEMM: x (..., K), weight (N, K) -> (..., N)."""
    gpu = _gpu(x)
    if gpu is not None:
        return gpu.linear(x, weight, bias)
    return _ChunkedLinear.apply(x, weight, bias)


def _chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    if M == 0:
        return F.linear(x, weight, bias)
    # One call per chunk, each of the same shape: a batched GEMM over the chunks would let the BLAS split the work
    # over threads by the number of chunks (seen with MKL at 4 threads), and a single GEMM picks its kernel by M.
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in _pad_rows(rows, ROW_CHUNK).split(ROW_CHUNK)])
    return out[:M].view(*lead, weight.shape[0])


class _ChunkedLinear(torch.autograd.Function):
    """The chunked forward; a plain backward (gradients need not be batch-invariant, only the log-probs)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _chunked_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0])  # (M, N)
        grad_x = (g @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        grad_w = g.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: normalise in float32, cast to x's dtype, times weight. Row-wise on the torch path."""
    gpu = _gpu(x)
    if gpu is not None:
        return gpu.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def log_softmax_gather(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at ids: logits (T, V), ids (T,) -> (T,) float32."""
    gpu = _gpu(logits)
    if gpu is not None:
        return gpu.log_softmax_gather(logits, ids, temperature)
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(1, ids[:, None]).squeeze(1)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn, an element-wise op (exp, sigmoid, silu, cos...), on x (T, ...) with each row's result independent of T.

    On CPU, ATen runs such an op vectorised (SLEEF) except on the elements of a scalar tail, whose libm result can
    differ in the last bit, and where the tail falls depends on the element count (and on the thread split). So fn
    runs on ROW_CHUNK-row pieces of the same shape, each a multiple of any vector width. CUDA kernels compute every
    element alike: fn(x) as it is.
    """
    if x.device.type == "cuda" or x.shape[0] == 0:
        return fn(x)
    T = x.shape[0]
    padded = _pad_rows(x, ROW_CHUNK)
    return torch.cat([fn(piece) for piece in padded.split(ROW_CHUNK)])[:T]


def graph_safe(x: torch.Tensor) -> bool:
    """Whether this mode's inference forward on x's device waits on no host, so a CUDA graph can capture it: the
    Triton kernels for the experts (grouped), attention and the paged indexer are there. The torch path syncs."""
    gpu = _gpu(x)
    return gpu is not None and all(hasattr(gpu, f) for f in ("grouped_linear", "mla_attention", "indexer_topk_paged"))


def grouped_linear_kernel(x: torch.Tensor) -> Callable | None:
    """triton_invariant.grouped_linear for x's device when it is there (rows sorted by expert, one launch, no host
    sync), else None: the experts then run the per-expert loop through `linear`."""
    gpu = _gpu(x)
    return getattr(gpu, "grouped_linear", None) if gpu is not None else None


# ----------------------------------------------------------------------------------------------
# Built on them


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head products, each head's rows through `linear`: x (T, H, A), weight (H, A, B) -> (T, H, B)."""
    gpu = _gpu(x)
    if gpu is not None and hasattr(gpu, "head_matmul"):  # one launch for every head
        return gpu.head_matmul(x, weight)
    return torch.stack([linear(x[:, h], weight[h].T) for h in range(weight.shape[0])], dim=1)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.sparse_mla_attention` with one reduction order for every batch: q (Tq, H, D) over kv rows
    indices (Tq, K) (-1 unused) in KEY_BLOCK blocks with an online softmax. Returns out (Tq, H, v_dim), lse (Tq, H).
    On CUDA, triton_invariant's kernel (same contract, its own fixed blocks, no host sync)."""
    gpu = _gpu(q)
    if gpu is not None and hasattr(gpu, "mla_attention"):
        return gpu.mla_attention(q, kv, indices, scale, v_dim)
    return _BlockedAttention.apply(q, kv, indices, scale, v_dim)


class _BlockedAttention(torch.autograd.Function):
    """The blockwise forward; the backward recomputes the reference's attention and differentiates it (the same
    function, so the same gradient up to rounding: only the forward must be batch-invariant)."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale, v_dim):
        ctx.save_for_backward(q, kv, indices)
        ctx.scale, ctx.v_dim = scale, v_dim
        return _blocked_attention(q, kv, indices, scale, v_dim)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, kv, indices = ctx.saved_tensors
        with torch.enable_grad():
            q_, kv_ = q.detach().requires_grad_(), kv.detach().requires_grad_()
            out, lse = reference.sparse_mla_attention(q_, kv_, indices, ctx.scale, ctx.v_dim)
            pairs = [(t, g) for t, g in ((out, grad_out), (lse, grad_lse)) if g is not None]
            grad_q, grad_kv = torch.autograd.grad([t for t, _ in pairs], (q_, kv_), [g for _, g in pairs],
                                                  allow_unused=True)
        return grad_q, grad_kv, None, None, None


def _blocked_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    Tq, H, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if Tq == 0:
        return q.new_zeros(0, H, v_dim), torch.zeros(0, H, dtype=acc, device=q.device)
    used = (indices >= 0).any(0).nonzero()
    width = int(used.max()) + 1 if len(used) else 1
    width = -(-width // KEY_BLOCK) * KEY_BLOCK
    pad_q = (-Tq) % QUERY_CHUNK
    idx = F.pad(indices[:, :width], (0, width - min(width, indices.shape[1]), 0, pad_q), value=-1)  # (Tq+, W)
    qp = _pad_rows(q, QUERY_CHUNK).to(acc)
    outs, lses = [], []
    for c0 in range(0, qp.shape[0], QUERY_CHUNK):
        qc, ic = qp[c0:c0 + QUERY_CHUNK], idx[c0:c0 + QUERY_CHUNK]  # (C, H, D), (C, W)
        m = torch.full((QUERY_CHUNK, H), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros(QUERY_CHUNK, H, dtype=acc, device=q.device)
        o = torch.zeros(QUERY_CHUNK, H, v_dim, dtype=acc, device=q.device)
        for b0 in range(0, width, KEY_BLOCK):
            block = ic[:, b0:b0 + KEY_BLOCK]  # (C, B)
            valid = block >= 0
            keys = kv.index_select(0, block.clamp(min=0).reshape(-1)).view(*block.shape, kv.shape[-1]).to(acc)
            s = torch.bmm(qc, keys.transpose(1, 2)) * scale  # (C, H, B)
            s = s.masked_fill(~valid[:, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a query with no key yet
            alpha = torch.exp(m - m_safe)  # exactly 1 when the max did not move
            p = torch.exp(s - m_safe[..., None])  # (C, H, B), 0 on masked keys
            l = l * alpha + p.sum(-1)
            o = o * alpha[..., None] + torch.bmm(p, keys[..., :v_dim])
            m = m_new
        l_safe = l.clamp_min(torch.finfo(acc).tiny)  # padding rows (no key at all) give 0, not 0/0
        outs.append((o / l_safe[..., None]).to(q.dtype))
        lses.append(m.masked_fill(m == float("-inf"), 0.0) + torch.log(l_safe))
    return torch.cat(outs)[:Tq], torch.cat(lses)[:Tq]


def _block_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, key_rows: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """Indexer scores I[c, j] = sum_h w[c, h] relu(q[c, h] . k[key_rows[c, j]] * scale) in fixed blocks:
    q (QUERY_CHUNK, Hi, Di), weights (QUERY_CHUNK, Hi), key_rows (QUERY_CHUNK, W) -> (QUERY_CHUNK, W), W % KEY_BLOCK == 0."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qa, wa = q.to(acc), weights.to(acc)[:, None, :]  # (C, Hi, Di), (C, 1, Hi)
    parts = []
    for b0 in range(0, key_rows.shape[1], KEY_BLOCK):
        rows = key_rows[:, b0:b0 + KEY_BLOCK].clamp(min=0)
        keys = k.index_select(0, rows.reshape(-1)).view(*rows.shape, k.shape[-1]).to(acc)  # (C, B, Di)
        logits = torch.bmm(qa, keys.transpose(1, 2)) * scale  # (C, Hi, B)
        parts.append(torch.bmm(wa, logits.relu()).squeeze(1))  # (C, B)
    return torch.cat(parts, dim=1)


def _topk_over_rows(q, k, weights, key_rows: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    """Top-k of each query over its own key rows (Tq, W) (-1 = none), in query chunks: (Tq, topk) column positions."""
    Tq = q.shape[0]
    out = torch.full((Tq, topk), -1, dtype=torch.long, device=q.device)
    for c0 in range(0, Tq, QUERY_CHUNK):
        rows = key_rows[c0:c0 + QUERY_CHUNK]
        n = rows.shape[0]
        valid = rows >= 0
        width = int(valid.sum(1).max()) if n else 0
        width = max(KEY_BLOCK, -(-width // KEY_BLOCK) * KEY_BLOCK)
        rows = F.pad(rows[:, :width], (0, width - min(width, rows.shape[1])), value=-1)
        rows = F.pad(rows, (0, 0, 0, QUERY_CHUNK - n), value=-1)
        scores = _block_scores(_pad_rows(q[c0:c0 + n], QUERY_CHUNK), k, _pad_rows(weights[c0:c0 + n], QUERY_CHUNK),
                               rows, scale)
        out[c0:c0 + n] = select_topk(scores[:n], rows[:n] >= 0, topk)
    return out


@torch.no_grad()
def indexer_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk: int, scale: float) -> torch.Tensor:
    """`ops.indexer_topk` from fixed-shape score blocks: (Tq, topk) sequence-local key positions, ascending, -1 padded.
    On CUDA, triton_invariant's scoring kernel, the one `indexer_topk_paged` runs."""
    gpu = _gpu(q)
    if gpu is not None and hasattr(gpu, "indexer_topk"):
        return gpu.indexer_topk(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk, scale)
    lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    seq_id = torch.repeat_interleave(torch.arange(len(lens_q), device=q.device), lens_q, output_size=q.shape[0])
    pos = (lens_k - lens_q)[seq_id] + torch.arange(q.shape[0], device=q.device) - cu_seqlens_q[seq_id]  # (Tq,)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for c0 in range(0, q.shape[0], QUERY_CHUNK):  # key rows per chunk: a (Tq, Tk) table would not fit long packs
        p = pos[c0:c0 + QUERY_CHUNK]
        cols = torch.arange(int(p.max()) + 1, device=q.device)
        rows = torch.where(cols <= p[:, None], cu_seqlens_k[seq_id[c0:c0 + QUERY_CHUNK], None] + cols, -1)
        out[c0:c0 + QUERY_CHUNK] = _topk_over_rows(q[c0:c0 + QUERY_CHUNK], k, weights[c0:c0 + QUERY_CHUNK], rows,
                                                   topk, scale)
    return out


@torch.no_grad()
def indexer_topk_paged(q, k_pool, weights, key_slots, seq_lens, topk: int, scale: float) -> torch.Tensor:
    """`ops.indexer_topk_paged` from the same blocks as `indexer_topk`: (B, topk) sequence-local positions.
    On CUDA, triton_invariant's kernel, which waits on no host (the torch path reads key widths on the host)."""
    gpu = _gpu(q)
    if gpu is not None and hasattr(gpu, "indexer_topk_paged"):
        return gpu.indexer_topk_paged(q, k_pool, weights, key_slots, seq_lens, topk, scale)
    cols = torch.arange(key_slots.shape[1], device=q.device)
    rows = torch.where(cols[None, :] < seq_lens[:, None], key_slots, -1)
    return _topk_over_rows(q, k_pool, weights, rows, topk, scale)

"""Batch-invariant Triton kernels: a row's result is bitwise the same whatever the other rows and the row count.

What makes them invariant (the recipe of public batch-invariant work: Thinking Machines' batch_invariant_ops,
SGLang's deterministic mode, vLLM's batch invariance):
- matmuls use one tile shape per dtype, never chosen by M; no split-K; each output element accumulates its own
  K-blocks in ascending order in float32, so a row's sums never depend on how many rows share its tile;
- RMSNorm and log-softmax give each row one program that reduces over the row in fixed blocks whose size depends
  only on the row width, then sums each block's lanes as a fixed binary tree (never tl.sum's layout-chosen order).
Each function takes part in autograd: the forward is the invariant kernel, the backward is plain torch (a
gradient need not be batch-invariant, only the log-probs the engine and the trainer compare).

The functions (slime_dsa/ops/invariant.py dispatches CUDA tensors here):
    linear(x, weight, bias=None)          x (..., K), weight (N, K) -> (..., N) in x's dtype
    head_matmul(x, weight)                x (T, H, K), weight (H, K, N) -> (T, H, N), a linear per head
    grouped_linear(x, weight, offs)       rows sorted by expert, weight (E, N, K), offs (E,) end rows -> (M, N)
    rms_norm(x, weight, eps)              the model's RMSNorm over the last dim
    log_softmax_gather(logits, ids, t)    (T, V), (T,) -> (T,) float32 log-probs at temperature t
    mla_attention(q, kv, indices, scale, v_dim)   sparse MLA, triton_sparse_mla's forward unsplit with one config
    indexer_topk(...), indexer_topk_paged(...)    DSA indexer top-k, one scoring kernel (triton_indexer_invariant)
The attention and indexer forwards wait on no host at decode (paged), so an engine captures decode in CUDA graphs.
bf16 and fp16 inputs multiply on tensor cores with float32 sums; float32 inputs by IEEE fused multiply-adds (no tf32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slime_dsa.ops import triton_sparse_mla
from slime_dsa.ops.triton_indexer_invariant import indexer_topk, indexer_topk_paged


@dataclass(frozen=True)
class Tiles:
    """One matmul tile configuration; which one is used depends on the dtype only, never on the row count."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # programs swept down M before moving along N (L2 reuse; does not change any sum)


TILES: dict[torch.dtype, Tiles] = {
    torch.bfloat16: Tiles(128, 128, 64, num_warps=8, num_stages=3),
    torch.float16: Tiles(128, 128, 64, num_warps=8, num_stages=3),
    torch.float32: Tiles(64, 64, 32, num_warps=4, num_stages=2),  # IEEE products (no tf32): CPU-parity tests
}
ROW_BLOCK = 4096  # largest block of a row one RMSNorm / log-softmax step reads


@triton.jit
def _tile_of(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program `pid`, grouped GROUP_M tile rows at a time."""
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _matmul_tile(x_ptr, w_ptr, rows, row_end, cols, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """float32 (BLOCK_M, BLOCK_N) tile of x[rows] @ w[cols]ᵀ, K-blocks accumulated in ascending order."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a_mask, b_mask = rows[:, None] < row_end, cols[None, :] < N
        if not EVEN_K:  # K % BLOCK_K != 0: the last block reads zeros past K
            a_mask, b_mask = a_mask & (k[None, :] < K), b_mask & (k[:, None] < K)
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk, mask=a_mask, other=0.0)  # (BM, BK)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk, mask=b_mask, other=0.0)  # (BK, BN)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # M == 1 must not compile a kernel of its own
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xh, stride_xm, stride_xk, stride_wh, stride_wn,
                   stride_wk, stride_oh, stride_om, stride_on, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """out[h] = x[h] @ w[h]ᵀ (+ bias) for head h = program_id(1); one head (strides 0) for a plain linear."""
    tile_m, tile_n = _tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    head = tl.program_id(1).to(tl.int64)
    x_ptr, w_ptr, out_ptr = x_ptr + head * stride_xh, w_ptr + head * stride_wh, out_ptr + head * stride_oh
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = _matmul_tile(x_ptr, w_ptr, rows, M, cols, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _grouped_linear_kernel(x_ptr, w_ptr, offs_ptr, out_ptr, N, K, E, stride_xm, stride_xk, stride_we, stride_wn,
                           stride_wk, stride_om, stride_on, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    tile = tl.program_id(0)
    # Which expert's rows this tile covers: tiles never straddle two experts, the experts' tiles come in order.
    expert, row0, row_end, seen, start = -1, 0, 0, 0, 0
    for e in range(0, E):
        end = tl.load(offs_ptr + e)
        n_tiles = tl.cdiv(end - start, BLOCK_M)
        hit = (tile >= seen) & (tile < seen + n_tiles)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (tile - seen) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        seen += n_tiles
        start = end
    if expert >= 0:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = _matmul_tile(x_ptr, w_ptr + expert.to(tl.int64) * stride_we, rows, row_end, cols, N, K,
                           stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < N))


@triton.jit
def _tree_sum(v, BLOCK: tl.constexpr):
    """Sum of a (BLOCK,) vector, BLOCK a power of 2, as a fixed binary tree: neighbours 2i and 2i + 1 added, repeated.

    tl.sum's order follows the register layout the compiler picks, and that follows the input's alignment (a row
    view that starts off a 16-byte boundary gets another layout): two calls on the same row could round apart."""
    for i in tl.static_range(BLOCK.bit_length() - 1):
        v = tl.sum(tl.reshape(v, (BLOCK >> (i + 1), 2)), axis=1)  # two terms per sum: no order to choose
    return tl.sum(v, axis=0)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, width, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, o_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        x = tl.load(x_row + n0 + offs, mask=n0 + offs < N, other=0.0).to(tl.float32)
        squares += x * x
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(_tree_sum(squares, BLOCK), width) + eps))
    for n0 in range(0, N, BLOCK):
        mask = n0 + offs < N
        x = tl.load(x_row + n0 + offs, mask=mask, other=0.0)
        normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)  # rounded to x's dtype before the weight
        w = tl.load(w_ptr + n0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + n0 + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _log_softmax_gather_kernel(logits_ptr, ids_ptr, out_ptr, V, stride_t, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row = logits_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    maxes = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(l_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        maxes = tl.maximum(maxes, tl.math.div_rn(x, temperature))
    top = tl.max(maxes, axis=0)
    sums = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(l_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        sums += tl.exp(tl.math.div_rn(x, temperature) - top)
    target = tl.math.div_rn(tl.load(l_row + tl.load(ids_ptr + row)).to(tl.float32), temperature)
    tl.store(out_ptr + row, (target - top) - tl.log(_tree_sum(sums, BLOCK)))


def _check_dtype(x: torch.Tensor, op: str) -> None:
    if x.dtype not in TILES:
        raise ValueError(f"{op}: no tiles for {x.dtype}; expected one of {sorted(map(str, TILES))}")


def _unit_stride(t: torch.Tensor, either: bool = False) -> torch.Tensor:
    """t with a unit stride along its last dim (or, with `either`, one of its last two): the kernels' loads are
    vectorised and pipelined only then. A matmul's bits do not depend on which."""
    return t if t.stride(-1) == 1 or (either and t.stride(-2) == 1) else t.contiguous()


def _row_block(width: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(max(width, 16)))


def _row_warps(block: int) -> int:
    return 8 if block >= 2048 else 4 if block >= 512 else 1


def _launch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[h] = x[h] @ weight[h]ᵀ (+ bias) for x (H, M, K), weight (H, N, K), out (H, M, N), any strides."""
    (H, M, K), N = x.shape, weight.shape[1]
    if not (H and M and N):
        return
    t = TILES[x.dtype]
    grid = (triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n), H)
    # One head: stride 0, not the M-dependent M * K, whose divisibility would pick the compiled variant by M.
    strides = [(0, *a.stride()[1:]) if H == 1 else a.stride() for a in (x, weight, out)]
    _linear_kernel[grid](x, weight, bias if bias is not None else x, out, M, N, K, *strides[0], *strides[1],
                         *strides[2], HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=t.block_m,
                         BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=K % t.block_k == 0, GROUP_M=t.group_m,
                         num_warps=t.num_warps, num_stages=t.num_stages)


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear: x ({x.dtype}), weight ({weight.dtype}) and bias must share a dtype")
    _check_dtype(x, "linear")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"linear: x has {x.shape[-1]} features, weight (N={N}, K={K}) expects {K}")
    x2 = _unit_stride(x.reshape(-1, K))  # (M, K)
    out = x2.new_empty(x2.shape[0], N)
    _launch_linear(x2[None], _unit_stride(weight, either=True)[None], bias, out[None])  # one head
    return out.view(*x.shape[:-1], N)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, weight.shape[0])  # (M, N)
        grad_x = (g2 @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        grad_w = g2.T @ x.reshape(-1, weight.shape[1]) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weightᵀ (+ bias), weight (N, K) as nn.Linear holds it -> (..., N) in x's dtype, float32 sums."""
    return _Linear.apply(x, weight, bias)


class _HeadMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        if x.dtype != weight.dtype:
            raise ValueError(f"head_matmul: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
        _check_dtype(x, "head_matmul")
        (T, H, K), N = x.shape, weight.shape[-1]
        if weight.shape != (H, K, N):
            raise ValueError(f"head_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit (T, H, K), "
                             "(H, K, N)")
        out = x.new_empty(T, H, N)
        _launch_linear(_unit_stride(x).transpose(0, 1), _unit_stride(weight, either=True).transpose(1, 2), None,
                       out.transpose(0, 1))  # (H, T, K) @ (H, N, K)ᵀ -> (H, T, N)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.einsum("thn,hkn->thk", grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.einsum("thk,thn->hkn", x, grad) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head products in one launch: x (T, H, K), weight (H, K, N) -> (T, H, N), out[:, h] = x[:, h] @ weight[h]
    (MLA's absorbed projections), each head with linear's tiles and K order."""
    return _HeadMatmul.apply(x, weight)


def _grouped_linear_forward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if x.dtype != weight.dtype:
        raise ValueError(f"grouped_linear: x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    _check_dtype(x, "grouped_linear")
    E, N, K = weight.shape
    if x.shape[-1] != K or offs.shape != (E,):
        raise ValueError(f"grouped_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, offs {tuple(offs.shape)} "
                         "do not fit (M, K), (E, N, K), (E,)")
    x, weight, M = _unit_stride(x), _unit_stride(weight, either=True), x.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N and E:
        t = TILES[x.dtype]
        grid = (triton.cdiv(M, t.block_m) + E, triton.cdiv(N, t.block_n))  # each expert wastes at most one tile
        _grouped_linear_kernel[grid](x, weight, offs.to(torch.int32), out, N, K, E, x.stride(0), x.stride(1),
                                     weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
                                     IEEE=x.dtype == torch.float32, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                                     BLOCK_K=t.block_k, EVEN_K=K % t.block_k == 0, num_warps=t.num_warps,
                                     num_stages=t.num_stages)
    return out


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        return _grouped_linear_forward(x, weight, offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
        start = 0
        for e, end in enumerate(offs.tolist()):  # one host sync: the gradient need not be graph-capturable
            if end > start:
                grad_x[start:end] = grad[start:end] @ weight[e]
                grad_w[e] = grad[start:end].T @ x[start:end]
            start = end
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert x @ weight[e]ᵀ over rows sorted by expert: x (M, K), weight (E, N, K), offs (E,) the end row of each
    expert's rows (torch's grouped_mm convention) -> (M, N) in x's dtype; rows past offs[-1] are left unwritten. The
    forward never syncs with the host; the backward is a per-expert torch loop."""
    return _GroupedLinear.apply(x, weight, offs)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        N = x.shape[-1]
        x2 = _unit_stride(x.reshape(-1, N))  # (M, N)
        out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        if x2.shape[0] and N:
            block = _row_block(N)
            _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, N, float(N), x2.stride(0), out.stride(0),
                                             eps, BLOCK=block, num_warps=_row_warps(block))
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(_rms_norm_reference(x_, w_, ctx.eps), (x_, w_), grad)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as the model's RMSNorm computes it: normalised in float32, rounded to x's dtype,
    then times the weight (the product in float32, rounded to the promoted dtype of x and weight)."""
    return _RMSNorm.apply(x, weight, eps)


class _LogSoftmaxGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        ctx.save_for_backward(logits, ids)
        ctx.temperature = temperature
        T, V = logits.shape
        out = torch.empty(T, dtype=torch.float32, device=logits.device)
        if T:
            logits = _unit_stride(logits)
            block = _row_block(V)
            _log_softmax_gather_kernel[(T,)](logits, ids.contiguous(), out, V, logits.stride(0), float(temperature),
                                             BLOCK=block, num_warps=_row_warps(block))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, ids = ctx.saved_tensors
        probs = torch.softmax(logits.float() / ctx.temperature, dim=-1)  # (T, V)
        grad_logits = -probs
        grad_logits[torch.arange(len(ids), device=ids.device), ids] += 1.0
        return (grad_logits * (grad / ctx.temperature)[:, None]).to(logits.dtype), None, None


def log_softmax_gather(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[t, ids[t]] as float32 (T,), logits (T, V) of any float dtype, ids (T,).

    The logits are upcast to float32, then divided by the temperature with correctly rounded float32 division (as
    torch's tensor-by-tensor division; torch's CUDA division by a Python float multiplies by the reciprocal, which
    can differ by one ulp), then log-prob = (x[id] - max x) - log(sum exp(x - max x))."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if logits.dim() != 2 or ids.shape != logits.shape[:1]:
        raise ValueError(f"log_softmax_gather: logits {tuple(logits.shape)} and ids {tuple(ids.shape)} must be (T, V) "
                         "and (T,)")
    return _LogSoftmaxGather.apply(logits, ids, temperature)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA of q (T, H, D) over kv rows indices (T, K) (-1 unused) -> out (T, H, v_dim), lse (T, H) float32:
    one program per row and head block, keys in fixed blocks from slot 0, no split. The backward is the Triton one
    (gradients need not be batch-invariant)."""
    return triton_sparse_mla.sparse_mla_attention(q, kv, indices, scale, v_dim, invariant=True)


__all__ = ["linear", "head_matmul", "grouped_linear", "rms_norm", "log_softmax_gather", "mla_attention",
           "indexer_topk", "indexer_topk_paged"]

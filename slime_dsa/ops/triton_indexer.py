"""Lightning-indexer scoring with a fused, deterministic top-k (Triton + torch.topk), bf16 or FP8.

I[t, s] = sum_j w[t, j] * relu(scale * q[t, j] . k[s]) over the causal keys s of query t's sequence.

Two passes per chunk of query rows, so no T x T score matrix ever exists:
1. A Triton kernel scores a (queries x keys) tile per program: (query, head) rows x keys on the tensor
   cores, relu, weighted sum over heads; non-causal entries are -inf. The chunk's float32 scores (at most
   CHUNK_ELEMS of them) are the only large buffer.
2. `torch.topk` (radix select) picks the top-k set per row. It is exact except when several entries equal
   the k-th largest score and only some fit; such rows (exact float ties, rare outside constructed inputs)
   are redone with unique int64 keys (order-preserving score bits << 32 | (2^32 - 1 - position)), which
   makes the tie rule of `reference.py` (equal scores prefer the lower position) plain integer order.
   Positions come out ascending, -1 padded.

FP8 (`fp8=True`, DeepSeek-V3.2's indexer): q and k are cast to float8 e4m3 with one scale per 128-dim block
of each (token, head) row (the whole row when index_head_dim is 128), and the scales are folded into
the weights (relu commutes with a positive scale), so the kernel runs an FP8 tensor-core dot.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from slime_dsa.ops.reference import _query_positions

CHUNK_ELEMS = 1 << 28  # float32 scores per chunk (1 GiB)
FP8_MAX = 448.0  # largest finite float8 e4m3fn
ROWS_PER_PROGRAM = 128  # (query, head) rows of one program's tile: BLOCK_M queries x BLOCK_HI heads
BLOCK_N = 128  # keys per tile
TILES_PER_PROGRAM = 4  # key tiles per program (q stays in registers across them)
_fp8_dot_ok: bool | None = None  # None: not tried yet on this process' GPU


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, qs_ptr, ks_ptr, scores_ptr,
    blk_q_ptr, blk_n_ptr, blk_kstart_ptr, blk_pos_ptr,
    chunk_q0, width, stride_scores, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, FP8: tl.constexpr, FP8_DOT: tl.constexpr,
):
    """One program: BLOCK_M consecutive queries of one sequence x TILES * BLOCK_N keys -> float32 scores.

    Non-causal entries get -inf; -0.0 becomes +0.0 so that zeros tie (and break by position) like the reference.
    """
    ROWS: tl.constexpr = BLOCK_M * BLOCK_HI
    b = tl.program_id(0)
    q0 = tl.load(blk_q_ptr + b).to(tl.int64)  # first query row of the block
    n_q = tl.load(blk_n_ptr + b)  # valid queries in the block
    key_start = tl.load(blk_kstart_ptr + b).to(tl.int64)  # row of the sequence's key 0
    pos0 = tl.load(blk_pos_ptr + b)  # causal position of the block's first query

    r = tl.arange(0, ROWS)
    m_of_r = r // BLOCK_HI  # query of each (query, head) row
    j_of_r = r % BLOCK_HI  # head of each row
    row_ok = (m_of_r < n_q) & (j_of_r < HI)
    offs_d = tl.arange(0, BLOCK_DI)
    q_off = (q0 + m_of_r)[:, None] * (HI * DI) + j_of_r[:, None] * DI + offs_d[None, :]
    qt = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (offs_d < DI)[None, :], other=0.0)  # (ROWS, DI)
    w = tl.load(w_ptr + (q0 + m_of_r) * HI + j_of_r, mask=row_ok, other=0.0).to(tl.float32) * scale  # (ROWS,)
    if FP8:
        w = w * tl.load(qs_ptr + (q0 + m_of_r) * HI + j_of_r, mask=row_ok, other=0.0)
        if not FP8_DOT:  # e4m3 values are exact in bf16: same scores on bf16 tensor cores
            qt = qt.to(tl.bfloat16)

    offs_m = tl.arange(0, BLOCK_M)
    pos_m = pos0 + offs_m  # (BM,) causal position of each query
    pos_max = pos0 + n_q - 1
    for tile in tl.static_range(TILES):
        n0 = (tl.program_id(1) * TILES + tile) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)  # key positions
        score = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
        if n0 <= pos_max:  # the tile holds a causal key of some query
            k_ok = offs_n <= pos_max
            kt = tl.load(k_ptr + (key_start + offs_n)[:, None] * DI + offs_d[None, :],
                         mask=k_ok[:, None] & (offs_d < DI)[None, :], other=0.0)  # (BN, DI)
            if FP8:
                if not FP8_DOT:
                    kt = kt.to(tl.bfloat16)
            s = tl.dot(qt, tl.trans(kt))  # (ROWS, BN) fp32
            if FP8:
                s = s * tl.load(ks_ptr + key_start + offs_n, mask=k_ok, other=0.0)[None, :]
            s = tl.maximum(s, 0.0) * w[:, None]
            sc = tl.sum(tl.reshape(s, (BLOCK_M, BLOCK_HI, BLOCK_N)), axis=1)  # (BM, BN): sum over heads
            sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 -> +0.0
            causal = (offs_n[None, :] <= pos_m[:, None]) & (offs_m < n_q)[:, None]
            score = tl.where(causal, sc, score)
        out_row = q0 - chunk_q0 + offs_m
        tl.store(scores_ptr + out_row[:, None] * stride_scores + offs_n[None, :], score,
                 mask=(offs_m < n_q)[:, None] & (offs_n < width)[None, :])


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (float8_e4m3fn x / scale, scale (...) float32): one scale per row, amax / 448.

    A row is one (token, head) vector: DeepSeek-V3.2's 128-dim block when index_head_dim is 128.
    """
    amax = x.float().abs().amax(dim=-1).clamp_min(1e-12)  # (...)
    scale = amax / FP8_MAX
    xq = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def _plan_chunks(cu_q: list[int], cu_k: list[int], topk: int, block_m: int):
    """Split the packed query rows into chunks of at most CHUNK_ELEMS scores.

    Yields (first row, end row, width, blocks); a block is up to `block_m` consecutive queries of one sequence,
    given as (first query row, count, row of the sequence's key 0, causal position of the first query).
    Chunks hold consecutive rows and may span sequences (many short decode requests share one launch).
    """
    pieces = []  # (first row, end row, width, seq id)
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if lq > lk:
            raise ValueError(f"indexer_topk: sequence {i} has more queries ({lq}) than keys ({lk})")
        step = max(block_m, (CHUNK_ELEMS // max(lk, topk)) // block_m * block_m)
        for a in range(0, lq, step):
            b = min(a + step, lq)
            pieces.append((cu_q[i] + a, cu_q[i] + b, lk - lq + b, i))

    def emit(chunk: list, width: int):
        blocks = []
        for r0, r1, _, i in chunk:
            first_pos = (cu_k[i + 1] - cu_k[i]) - (cu_q[i + 1] - cu_q[i]) - cu_q[i]  # position = row + this
            for r in range(r0, r1, block_m):
                blocks.append((r, min(block_m, r1 - r), cu_k[i], first_pos + r))
        return chunk[0][0], chunk[-1][1], width, blocks

    chunk, width = [], 0
    for piece in pieces:
        new_width = max(width, piece[2], topk)
        if chunk and (piece[1] - chunk[0][0]) * new_width > CHUNK_ELEMS:
            yield emit(chunk, width)
            chunk, new_width = [], max(piece[2], topk)
        chunk.append(piece)
        width = new_width
    if chunk:
        yield emit(chunk, width)


def _exact_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Tie-exact top-k positions (R, topk), unsorted: higher score first, equal scores prefer lower positions.

    Each entry becomes one unique int64: the score's bits made order-preserving in the high half and
    (2^32 - 1 - position) in the low half, so integer order is the tie rule. -inf entries never win over a
    finite one; the caller only asks rows that hold at least `topk` finite scores.
    """
    bits = (scores + 0.0).view(torch.int32).long()  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order == float order
    position = torch.arange(scores.shape[1], device=scores.device)
    keys = (ordered << 32) + (4294967295 - position)
    return 4294967295 - (torch.topk(keys, topk, dim=-1, sorted=False).values & 4294967295)


def _select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of one chunk of scores (R, W) (-inf outside the causal prefix of n_valid keys) -> (R, topk).

    torch.topk on float32 picks the right *set* except where several entries equal the k-th largest value and
    only some of them fit: those rows (rare: exact float ties) are redone with `_exact_topk`.
    Output: positions ascending, -1 padded (rows with fewer than topk keys keep all of them).
    """
    k = min(topk, scores.shape[1])
    values, pos = torch.topk(scores, k, dim=-1, sorted=False)  # (R, k)
    kth = values.amin(dim=-1, keepdim=True)  # (R, 1)
    ambiguous = (n_valid > k) & ((scores == kth).sum(-1) != (values == kth).sum(-1))
    if ambiguous.any():
        rows = ambiguous.nonzero().squeeze(1)
        pos[rows] = _exact_topk(scores[rows], k)
    big = torch.iinfo(torch.int64).max
    pos = torch.where(values == float("-inf"), big, pos).sort(dim=-1).values  # unused slots last
    return torch.where(pos == big, -1, pos)


def _launch_scores(q, k, weights, q_scale, k_scale, scores, blocks_dev, n_blocks, chunk_q0, width, scale, fp8):
    global _fp8_dot_ok
    Hi, Di = q.shape[1], q.shape[2]
    block_hi = triton.next_power_of_2(Hi)
    block_m = max(1, ROWS_PER_PROGRAM // block_hi)
    grid = (n_blocks, triton.cdiv(width, BLOCK_N * TILES_PER_PROGRAM))

    def run(fp8_dot: bool) -> None:
        _indexer_scores_kernel[grid](
            q, k, weights, q_scale, k_scale, scores, *blocks_dev, chunk_q0, width, scores.stride(0), scale,
            HI=Hi, DI=Di, BLOCK_HI=block_hi, BLOCK_DI=max(16 if not fp8 else 32, triton.next_power_of_2(Di)),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, TILES=TILES_PER_PROGRAM, FP8=fp8, FP8_DOT=fp8_dot,
            num_warps=8, num_stages=2,
        )

    if not fp8:
        run(False)
        return
    if _fp8_dot_ok is None:
        try:
            run(True)
            _fp8_dot_ok = True
            return
        except Exception as err:  # noqa: BLE001 (any compiler failure: fall back to bf16 tensor cores)
            warnings.warn(f"FP8 tensor-core dot unavailable ({type(err).__name__}); indexer upcasts FP8 to bf16")
            _fp8_dot_ok = False
    run(_fp8_dot_ok)


@torch.no_grad()
def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    topk: int,
    scale: float,
    fp8: bool = False,
) -> torch.Tensor:
    """Causal lightning-indexer top-k, same contract as `reference.indexer_topk`.

    q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi), packed by cu_seqlens_q / cu_seqlens_k (S+1,).
    Returns (Tq, topk) int64 sequence-local key positions, ascending, -1 padded. `fp8` scores with
    float8 e4m3 inputs (per-row scales) instead of q/k's own dtype.
    """
    if q.dim() != 3 or k.dim() != 2 or weights.shape != q.shape[:2] or q.shape[2] != k.shape[1]:
        raise ValueError(f"indexer_topk expects q (Tq, Hi, Di), k (Tk, Di), weights (Tq, Hi); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}")
    Tq, Hi, Di = q.shape
    out = torch.full((Tq, topk), -1, dtype=torch.long, device=q.device)
    if Tq == 0 or topk == 0:
        return out
    if fp8:
        q, q_scale = quantize_fp8_rows(q)  # (Tq, Hi, Di), (Tq, Hi)
        k, k_scale = quantize_fp8_rows(k)  # (Tk, Di), (Tk,)
    else:
        q, k = q.contiguous(), k.contiguous().to(q.dtype)
        q_scale = k_scale = weights  # unused placeholders
    weights = weights.contiguous()
    block_m = max(1, ROWS_PER_PROGRAM // triton.next_power_of_2(Hi))
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    n_valid = _query_positions(cu_seqlens_q, cu_seqlens_k)[1] + 1  # (Tq,) causal keys per query
    for r0, r1, width, blocks in _plan_chunks(cu_q, cu_k, topk, block_m):
        scores = torch.empty(r1 - r0, width, dtype=torch.float32, device=q.device)  # every entry written below
        blocks_dev = torch.tensor(blocks, dtype=torch.int32).T.contiguous().to(q.device)  # (4, n_blocks)
        _launch_scores(q, k, weights, q_scale, k_scale, scores, blocks_dev.unbind(0), len(blocks), r0, width,
                       float(scale), fp8)
        selected = _select(scores, n_valid[r0:r1], topk)  # (rows, min(topk, width))
        out[r0:r1, : selected.shape[1]] = selected
    return out


__all__ = ["indexer_topk", "quantize_fp8_rows"]

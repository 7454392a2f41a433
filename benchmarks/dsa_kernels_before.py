"""The DSA kernel paths as they were before issue 20, kept so that benchmarks/dsa_kernels.py measures before and
after in one run.

- `indexer_topk_before`: scoring tiles of 128 (query, head) rows even at decode (4 query slots for 1 query),
  then `torch.topk` on float32 scores, a tie repair for rows where the k-th score is tied, and a sort.
- `skip_empty_slots(False)`: the plain sparse MLA forward (no idx_reg for prefill), and the forward and general
  backward walking all K index slots of every row.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import triton

from slime_dsa.ops import triton_indexer as ti
from slime_dsa.ops import triton_sparse_mla as mla
from slime_dsa.ops.reference import _query_positions


def _exact_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Tie-exact top-k positions (R, topk), unsorted, through unique int64 keys (score bits, then position)."""
    bits = (scores + 0.0).view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    position = torch.arange(scores.shape[1], device=scores.device)
    keys = (ordered << 32) + (4294967295 - position)
    return 4294967295 - (torch.topk(keys, topk, dim=-1, sorted=False).values & 4294967295)


def _select_before(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
    k = min(topk, scores.shape[1])
    values, pos = torch.topk(scores, k, dim=-1, sorted=False)  # (R, k)
    kth = values.amin(dim=-1, keepdim=True)
    ambiguous = (n_valid > k) & ((scores == kth).sum(-1) != (values == kth).sum(-1))
    if ambiguous.any():
        rows = ambiguous.nonzero().squeeze(1)
        pos[rows] = _exact_topk(scores[rows], k)
    big = torch.iinfo(torch.int64).max
    pos = torch.where(values == float("-inf"), big, pos).sort(dim=-1).values
    return torch.where(pos == big, -1, pos)


@torch.no_grad()
def indexer_topk_before(q, k, weights, cu_seqlens_q, cu_seqlens_k, topk: int, scale: float) -> torch.Tensor:
    """`triton_indexer.indexer_topk` before issue 20 (bf16): same result, old tiling and selection."""
    Tq, Hi, _ = q.shape
    out = torch.full((Tq, topk), -1, dtype=torch.long, device=q.device)
    block_m = max(1, ti.ROWS_PER_PROGRAM // triton.next_power_of_2(Hi))
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    n_valid = _query_positions(cu_seqlens_q, cu_seqlens_k)[1] + 1
    for r0, r1, width, blocks in ti._plan_chunks(cu_q, cu_k, topk, block_m):
        scores = torch.empty(r1 - r0, width, dtype=torch.float32, device=q.device)
        ti.launch_scores(q, k, weights, scores, blocks, r0, width, float(scale), block_m)
        selected = _select_before(scores, n_valid[r0:r1], topk)
        out[r0:r1, : selected.shape[1]] = selected
    return out


@contextmanager
def skip_empty_slots(on: bool):
    """Sparse MLA as it is (after) or as before issue 20 (before): the plain forward kernel (no idx_reg for
    prefill), walking every slot (no stop at each row's last used slot)."""
    saved = mla.SKIP_EMPTY_SLOTS, mla.FWD_VARIANT
    mla.SKIP_EMPTY_SLOTS = on
    if not on:
        mla.FWD_VARIANT = mla.PLAIN_FWD
    try:
        yield
    finally:
        mla.SKIP_EMPTY_SLOTS, mla.FWD_VARIANT = saved

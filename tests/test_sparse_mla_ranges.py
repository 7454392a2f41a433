"""Which backward the sparse MLA kernel takes for a selection (on CPU: the cover is plain torch). The masked range
backward's gradients are checked in Triton's interpreter (tests/interpret_checks.py) and on the GPU (test_ops_gpu)."""

from __future__ import annotations

import pytest
import torch

mla = pytest.importorskip("slime_dsa.ops.triton_sparse_mla")


def causal_topk(lens: list[int], K: int, seed: int = 0) -> torch.Tensor:
    """(T, K) distinct causal key rows per query of packed sequences, ascending, -1 padded (the indexer's layout)."""
    g = torch.Generator().manual_seed(seed)
    out, key0 = [], 0
    for n in lens:
        score = torch.rand(n, n, generator=g).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1.0)
        top = score.topk(min(K, n), dim=-1)
        rows = torch.where(top.values >= 0, top.indices + key0, n + key0).sort(-1).values
        rows = torch.where(rows == n + key0, -1, rows)
        out.append(torch.nn.functional.pad(rows, (0, K - rows.shape[1]), value=-1))
        key0 += n
    return torch.cat(out)


def test_whole_causal_runs_need_no_map():
    cover = mla.selection_ranges(causal_topk([3, 20, 7], K=32))
    assert cover is not None and cover.sel is None
    assert cover.lo.tolist()[:4] == [0, 0, 0, 3] and cover.hi.tolist()[:4] == [1, 2, 3, 4]
    shuffled = causal_topk([3, 20, 7], K=32).flip(1)  # the same sets in another slot order: covered with a map
    assert mla.selection_ranges(shuffled).sel is not None


def test_subsets_of_short_sequences_get_a_byte_map_of_exactly_the_selection():
    indices = causal_topk([5, 40, 23], K=16)
    cover = mla.selection_ranges(indices)
    assert cover is not None and cover.sel is not None
    lo, hi = cover.lo.long(), cover.hi.long()
    assert (lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all()
    for t in range(indices.shape[0]):
        chosen = {int(r) for r in indices[t] if r >= 0}
        assert all(lo[t] <= r < hi[t] for r in chosen)
        marked = {int(lo[t]) + int(c) for c in cover.sel[t].nonzero().flatten() if lo[t] + c < hi[t]}
        assert marked == chosen, t


def test_general_kernel_where_the_cover_would_not_pay():
    long_rows = causal_topk([400], K=16)  # ranges ~12x the selection
    assert mla.selection_ranges(long_rows) is None
    assert mla.selection_ranges(long_rows, max_ratio=100.0).sel is not None
    assert mla.selection_ranges(causal_topk([5, 40], K=16), max_bytes=10) is None
    empty_row = causal_topk([5, 40], K=16)
    empty_row[7] = -1
    assert mla.selection_ranges(empty_row) is None
    repeated = causal_topk([5, 40], K=16)
    repeated[30, 1] = repeated[30, 0]  # the forward would count that key twice; a byte map counts it once
    assert mla.selection_ranges(repeated) is None


def test_layers_sharing_a_selection_share_its_cover(monkeypatch):
    """The backwards of an IndexShare group (one indices tensor, one backward after another) compute its cover once;
    another tensor, an in-place change or another ratio computes it again, and the cover goes with its tensor."""
    calls = []
    compute = mla.selection_ranges
    monkeypatch.setattr(mla, "selection_ranges", lambda *args: calls.append(args) or compute(*args))
    last = mla._LastCover()
    indices = causal_topk([5, 40, 23], K=16)
    first = last.get(indices, 4.0)
    assert first is not None and all(last.get(indices, 4.0) is first for _ in range(3)) and len(calls) == 1
    assert last.get(indices.clone(), 4.0) is not first and len(calls) == 2  # equal values, another selection
    assert last.get(indices, 0.0) is None and len(calls) == 3  # another ratio: the general kernel
    before = last.get(indices, 4.0)
    indices[3, 0] = -1  # changed in place: computed again
    after = last.get(indices, 4.0)
    assert len(calls) == 5 and after is not before and int(after.sel.sum()) == int(before.sel.sum()) - 1
    calls.clear()  # they hold the tensor too
    del indices
    assert last.cover is None and last.indices is None

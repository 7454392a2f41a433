"""`triton_topk_sampled.topk_select_sampled` on CUDA against the torch reference (skipped without a GPU): exact on
long rows, random, tied or decode-like, at several slice counts and inside a CUDA graph. The interpreter checks
(tests/interpret_checks.py) cover the same on CPU at small shapes."""

from __future__ import annotations

import pytest
import torch

from slime_dsa.ops import reference

pytestmark = pytest.mark.gpu


def _scores(kind: str, rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Random, small-integer (many ties) or decode-like (sum_j w_j relu(q_j . k_n), weights of both signs)."""
    if kind == "tied":
        return torch.randint(-3, 4, (rows, width), device="cuda", generator=g).float()
    if kind == "random":
        return torch.randn(rows, width, device="cuda", generator=g)
    q, k = torch.randn(rows, 32, 128, device="cuda", generator=g), torch.randn(width, 128, device="cuda", generator=g)
    w = torch.randn(rows, 32, device="cuda", generator=g) * 32**-0.5
    return (w[:, :, None] * torch.einsum("rhd,nd->rhn", q, k).clamp_min(0)).sum(1)


@pytest.mark.parametrize("kind", ["random", "tied", "decode"])
def test_topk_select_sampled_matches_reference_in_a_cuda_graph(kind):
    from slime_dsa.ops.triton_topk_sampled import keep_above_floor, topk_select_sampled

    g = torch.Generator(device="cuda").manual_seed(8)
    R, W, k = 8, 96 * 1024, 2048
    scores = _scores(kind, R, W, g)
    n_valid = torch.tensor([W, 1, 0, k, k + 1, 5000, W - 1, 70000], device="cuda")
    valid = torch.arange(W, device="cuda")[None, :] < n_valid[:, None]
    want = reference.select_topk(scores, valid, k)
    for slices in (None, 1, 7, 96):
        assert torch.equal(topk_select_sampled(scores, n_valid, k, slices=slices), want), f"slices {slices}"
    if kind == "decode":  # one full read: the rows keep their top k and not twice as much
        total, k_eff = keep_above_floor(scores, n_valid, k, 12, 1024, 4).total, n_valid.clamp(max=k)
        assert bool((total >= k_eff).all() and (total <= 2 * k_eff).all()), total.tolist()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = topk_select_sampled(scores, n_valid, k)
    scores.neg_()  # new inputs in the same buffers
    graph.replay()
    assert torch.equal(got, reference.select_topk(scores, valid, k))

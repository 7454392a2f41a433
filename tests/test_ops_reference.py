"""The torch reference DSA ops equal direct transcriptions of their formulas (CPU, float64, tiny shapes).

Naive versions below loop over queries and heads with no chunking, masking tricks or batching, so they read
as the definitions: dense masked softmax, brute-force sorted top-k, and docs/algorithms.md section 6's KL.
"""

from __future__ import annotations

import pytest
import torch

from slime_dsa import ops
from slime_dsa.ops import reference

F64 = torch.float64


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


def _positions(lens_q: list[int], lens_k: list[int]) -> list[tuple[int, int, int]]:
    """(query row, first key row of its sequence, causal position) for every packed query."""
    out, row, key0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        for j in range(lq):
            out.append((row + j, key0, lk - lq + j))
        row, key0 = row + lq, key0 + lk
    return out


# ----------------------------------------------------------------------------------------------
# Naive formulas


def naive_sparse_attention(q, kv, indices, scale, v_dim):
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_dim, dtype=F64)
    lse = torch.full((T, H), float("-inf"), dtype=F64)
    for t in range(T):
        rows = [int(r) for r in indices[t] if r >= 0]
        for h in range(H):
            if not rows:
                continue
            s = torch.stack([scale * (q[t, h].double() @ kv[r].double()) for r in rows])
            lse[t, h] = torch.log(torch.exp(s - s.max()).sum()) + s.max()
            p = torch.exp(s - lse[t, h])
            out[t, h] = sum(p[i] * kv[r, :v_dim].double() for i, r in enumerate(rows))
    return out, lse


def naive_index_score(q, k, w, t, s, scale) -> float:
    """I[t, s] = sum_j w[t, j] relu(scale q[t, j] . k[s])."""
    return sum(float(w[t, j]) * max(0.0, scale * float(q[t, j].double() @ k[s].double())) for j in range(q.shape[1]))


def naive_topk(q, k, w, lens_q, lens_k, topk, scale):
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long)
    for t, key0, pos in _positions(lens_q, lens_k):
        scored = [(naive_index_score(q, k, w, t, key0 + s, scale), s) for s in range(pos + 1)]
        chosen = sorted(sorted(scored, key=lambda x: (-x[0], x[1]))[:topk], key=lambda x: x[1])
        out[t, : len(chosen)] = torch.tensor([s for _, s in chosen])
    return out


def naive_kl(iq, ik, iw, iscale, attn_q, attn_kv, ascale, lens_q, lens_k, rows):
    """docs/algorithms.md section 6, one query at a time, everything dense."""
    kl = torch.zeros(iq.shape[0], dtype=F64)
    for t, key0, pos in _positions(lens_q, lens_k):
        keys = [int(r) for r in rows[t] if r >= 0] if rows is not None else list(range(key0, key0 + pos + 1))
        p_bar = torch.zeros(len(keys), dtype=F64)
        for q, kv in zip(attn_q, attn_kv):
            s = ascale * (q[t].double() @ kv[keys].double().T)  # (H, n)
            p = torch.softmax(s, dim=-1).sum(0)  # sum over heads
            p_bar += p / p.sum() / len(attn_q)
        scores = torch.stack([
            sum(iw[t, j].double() * torch.relu(iscale * (iq[t, j].double() @ ik[r].double())) for j in range(iq.shape[1]))
            for r in keys
        ])
        log_q = torch.log_softmax(scores, dim=0)
        kl[t] = (p_bar * (torch.log(p_bar) - log_q)).sum()
    return kl


def _rows_from_local(local: torch.Tensor, lens_q: list[int], lens_k: list[int]) -> torch.Tensor:
    key0 = torch.tensor([k0 for _, k0, _ in _positions(lens_q, lens_k)])
    return torch.where(local >= 0, local + key0[:, None], local)


# ----------------------------------------------------------------------------------------------
# Sparse MLA attention


def test_sparse_attention_matches_dense_masked_softmax():
    torch.manual_seed(0)
    T, Tk, H, D, v_dim, K = 6, 11, 3, 7, 5, 6
    q, kv = torch.randn(T, H, D, dtype=F64), torch.randn(Tk, D, dtype=F64)
    indices = torch.stack([torch.randperm(Tk)[:K] for _ in range(T)])
    indices[0, 3:] = -1  # padding slots
    indices[2] = -1  # a row with no key at all: out 0, lse -inf
    out, lse = reference.sparse_mla_attention(q, kv, indices, 0.37, v_dim)
    want_out, want_lse = naive_sparse_attention(q, kv, indices, 0.37, v_dim)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)


def test_sparse_attention_gradcheck():
    torch.manual_seed(1)
    q = torch.randn(3, 2, 6, dtype=F64, requires_grad=True)
    kv = torch.randn(7, 6, dtype=F64, requires_grad=True)
    indices = torch.tensor([[0, 3, -1, 5], [6, 1, 2, -1], [4, -1, -1, -1]])
    assert torch.autograd.gradcheck(lambda a, b: reference.sparse_mla_attention(a, b, indices, 0.5, 4), (q, kv))


def _all_causal(lens: list[int], k: int) -> torch.Tensor:
    """Global rows of every causal key of every query, -1 after: what a top-k >= the sequence length selects."""
    rows = [[key0 + j if j <= pos else -1 for j in range(k)] for _, key0, pos in _positions(lens, lens)]
    return torch.tensor(rows)


def test_dense_attention_equals_sparse_attention_over_every_causal_key():
    torch.manual_seed(2)
    lens = [5, 300, 1, 40]  # one sequence longer than a query chunk
    T, H, D, v_dim = sum(lens), 3, 7, 5
    q = torch.randn(T, H, D, dtype=F64, requires_grad=True)
    kv = torch.randn(T, D, dtype=F64, requires_grad=True)
    indices = _all_causal(lens, 512)
    assert reference.selects_all_causal(indices, _cu(lens))
    sparse = reference.sparse_mla_attention(q, kv, indices, 0.3, v_dim)
    dense = reference.dense_mla_attention(q, kv, _cu(lens), 0.3, v_dim)
    for got, want in zip(dense, sparse):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grads = [torch.autograd.grad((out**2).sum() + lse.sum(), (q, kv)) for out, lse in (sparse, dense)]
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    via_ops = ops.sparse_mla_attention(q, kv, indices, 0.3, v_dim, _cu(lens))
    torch.testing.assert_close(via_ops[0], sparse[0], rtol=1e-10, atol=1e-12)


def test_selects_all_causal_only_for_every_causal_key():
    lens = [3, 6]
    indices = _all_causal(lens, 8)
    assert reference.selects_all_causal(indices, _cu(lens))
    assert not reference.selects_all_causal(indices[:, :5], _cu(lens))  # a top-k below the longest sequence
    dropped = indices.clone()
    dropped[7, 1] = -1  # one key left out (a sparse selection of a short row)
    assert not reference.selects_all_causal(dropped, _cu(lens))
    assert not reference.selects_all_causal(indices, _cu([4, 5]))  # other packing


def test_sparse_attention_skips_columns_no_query_uses():
    torch.manual_seed(3)
    q, kv = torch.randn(4, 2, 6, dtype=F64), torch.randn(9, 6, dtype=F64)
    indices = torch.tensor([[0, 3, -1, -1, -1], [6, -1, 2, -1, -1], [4, -1, -1, -1, -1], [1, 2, 8, -1, -1]])
    out, lse = reference.sparse_mla_attention(q, kv, indices, 0.5, 4)
    want_out, want_lse = naive_sparse_attention(q, kv, indices, 0.5, 4)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Indexer top-k

TOPK_CASES = {
    # lens_q, lens_k, topk
    "packed": ([4, 9, 6], [4, 9, 6], 3),
    "topk_larger_than_prefix": ([12], [12], 8),
    "bottom_right_tq_lt_tk": ([3, 1, 5], [10, 7, 5], 4),
    "topk_covers_all": ([5, 2], [5, 2], 16),
}


@pytest.mark.parametrize("name", sorted(TOPK_CASES))
def test_indexer_topk_matches_brute_force(name):
    lens_q, lens_k, topk = TOPK_CASES[name]
    torch.manual_seed(2)
    q, k = torch.randn(sum(lens_q), 3, 8, dtype=F64), torch.randn(sum(lens_k), 8, dtype=F64)
    w = torch.randn(sum(lens_q), 3, dtype=F64)
    got = reference.indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, 8**-0.5)
    assert torch.equal(got, naive_topk(q, k, w, lens_q, lens_k, topk, 8**-0.5))


@pytest.mark.parametrize("short_keys,batch_elements", [(0, 1 << 24), (512, 1 << 24), (512, 64)])
def test_indexer_topk_paths_agree_with_brute_force(monkeypatch, short_keys, batch_elements):
    """The three paths (all keys fit, short sequences batched across sequences in chunks, long ones one by one)
    select what the definition does; short_keys 0 sends every scored row down the long path, a tiny
    batch_elements forces one-row chunks in the batched one."""
    monkeypatch.setattr(reference, "SHORT_KEYS", short_keys)
    monkeypatch.setattr(reference, "BATCH_ELEMENTS", batch_elements)
    lens_q, lens_k, topk = [3, 9, 1, 6, 12], [3, 14, 20, 6, 12], 4
    torch.manual_seed(5)
    q, k = torch.randn(sum(lens_q), 3, 8, dtype=F64), torch.randn(sum(lens_k), 8, dtype=F64)
    w = torch.randn(sum(lens_q), 3, dtype=F64)
    got = reference.indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, 8**-0.5)
    assert torch.equal(got, naive_topk(q, k, w, lens_q, lens_k, topk, 8**-0.5))


def test_indexer_topk_tie_rule():
    """Integer inputs make exact ties: equal scores must prefer the lower position."""
    torch.manual_seed(3)
    lens = [9, 14]
    q = torch.randint(-1, 2, (sum(lens), 2, 4)).double()
    k = torch.randint(-1, 2, (sum(lens), 4)).double()
    w = torch.randint(0, 2, (sum(lens), 2)).double()
    got = reference.indexer_topk(q, k, w, _cu(lens), _cu(lens), 5, 1.0)
    assert torch.equal(got, naive_topk(q, k, w, lens, lens, 5, 1.0))
    scores = [naive_index_score(q, k, w, 20, 9 + s, 1.0) for s in range(12)]
    assert len(set(scores)) < len(scores), "the test needs ties"


def test_select_topk_all_ties_take_lowest_positions():
    scores = torch.zeros(2, 6)
    valid = torch.tensor([[True] * 6, [True, True, False, False, False, False]])
    got = reference.select_topk(scores, valid, 3)
    assert got.tolist() == [[0, 1, 2], [0, 1, -1]]


# ----------------------------------------------------------------------------------------------
# Indexer KL loss


def _kl_inputs(lens_q, lens_k, sparse_topk, seed=4, groups=2, H=2, D=5, Hi=2, Di=4):
    torch.manual_seed(seed)
    Tq, Tk = sum(lens_q), sum(lens_k)
    iq = torch.randn(Tq, Hi, Di, dtype=F64, requires_grad=True)
    ik = torch.randn(Tk, Di, dtype=F64, requires_grad=True)
    iw = torch.randn(Tq, Hi, dtype=F64, requires_grad=True)
    attn_q = [torch.randn(Tq, H, D, dtype=F64) for _ in range(groups)]
    attn_kv = [torch.randn(Tk, D, dtype=F64) for _ in range(groups)]
    rows = None
    if sparse_topk:
        local = reference.indexer_topk(iq.detach(), ik.detach(), iw.detach(), _cu(lens_q), _cu(lens_k), sparse_topk, 0.5)
        rows = _rows_from_local(local, lens_q, lens_k)
    return iq, ik, iw, attn_q, attn_kv, rows


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_kl_matches_formula(stage):
    lens_q, lens_k = [3, 6, 4], [5, 6, 9]
    iq, ik, iw, attn_q, attn_kv, rows = _kl_inputs(lens_q, lens_k, 3 if stage == "sparse" else 0)
    want = naive_kl(iq, ik, iw, 0.5, attn_q, attn_kv, 0.4, lens_q, lens_k, rows)
    got = reference.indexer_kl_loss(iq, ik, iw, 0.5, attn_q, attn_kv, None, 0.4, _cu(lens_q), _cu(lens_k), rows)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if rows is not None:  # the lse that sparse attention returns gives the same target
        lses = [reference.sparse_mla_attention(q, kv, rows, 0.4, 5)[1] for q, kv in zip(attn_q, attn_kv)]
        again = reference.indexer_kl_loss(iq, ik, iw, 0.5, attn_q, attn_kv, lses, 0.4, _cu(lens_q), _cu(lens_k), rows)
        torch.testing.assert_close(again, want, rtol=1e-10, atol=1e-12)
    # The dispatcher sends CPU tensors to the reference.
    torch.testing.assert_close(
        ops.indexer_kl_loss(iq, ik, iw, 0.5, attn_q, attn_kv, None, 0.4, _cu(lens_q), _cu(lens_k), rows), got
    )


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_kl_gradcheck(stage):
    lens_q, lens_k = [2, 3], [4, 3]
    iq, ik, iw, attn_q, attn_kv, rows = _kl_inputs(lens_q, lens_k, 2 if stage == "sparse" else 0, seed=5)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def loss(a, b, c):
        return reference.indexer_kl_loss(a, b, c, 0.5, attn_q, attn_kv, None, 0.4, cu_q, cu_k, rows)

    assert torch.autograd.gradcheck(loss, (iq, ik, iw))


def test_indexer_kl_is_zero_when_indexer_matches_target():
    """One layer, one head, one indexer head with the same scores: softmax(I) == p, KL == 0."""
    torch.manual_seed(6)
    lens = [5]
    kv = torch.randn(5, 4, dtype=F64).abs()  # positive dot products, so relu is the identity
    q = torch.randn(5, 1, 4, dtype=F64).abs()
    got = reference.indexer_kl_loss(q, kv, torch.ones(5, 1, dtype=F64), 0.7, [q], [kv], None, 0.7, _cu(lens), _cu(lens))
    torch.testing.assert_close(got, torch.zeros(5, dtype=F64), atol=1e-12, rtol=0)


def test_decode_rows_batched_equal_one_by_one():
    """Sequences with a single query (decode) take a batched path; it must select exactly what the loop does."""
    from slime_dsa.ops import reference

    torch.manual_seed(3)
    lens_k = [5, 17, 1, 30, 9]
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)))
    cu_q = torch.arange(len(lens_k) + 1)
    k = torch.randn(int(cu_k[-1]), 16)
    q = torch.randn(len(lens_k), 4, 16)
    w = torch.randn(len(lens_k), 4)
    batched = reference.indexer_topk(q, k, w, cu_q, cu_k, 8, 0.25)
    for i, n in enumerate(lens_k):
        scores = reference.indexer_scores(q[i : i + 1], k[cu_k[i] : cu_k[i + 1]], w[i : i + 1], 0.25)
        one = reference.select_topk(scores, torch.ones(1, n, dtype=torch.bool), 8)
        assert torch.equal(batched[i], one[0])


@pytest.mark.parametrize("host", [True, False], ids=["host-offsets", "cpu-offsets"])
def test_ops_skip_the_indexer_when_every_causal_key_fits(monkeypatch, host):
    """Sequences no longer than topk (RL samples under index_topk) select every causal key whatever the scores:
    `ops` returns that selection without scoring, equal to the brute force; one key more and it scores."""
    lens_q, lens_k, topk = [3, 1, 5, 8], [10, 7, 5, 8], 10
    torch.manual_seed(4)
    q, k = torch.randn(sum(lens_q), 3, 8, dtype=F64), torch.randn(sum(lens_k), 8, dtype=F64)
    w = torch.randn(sum(lens_q), 3, dtype=F64)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    offsets = (cu_q.tolist(), cu_k.tolist()) if host else None
    expected = naive_topk(q, k, w, lens_q, lens_k, topk, 8**-0.5)
    scored = []
    monkeypatch.setattr(reference, "indexer_topk", lambda *a, **kw: scored.append(1))  # must not be called
    got = ops.indexer_topk(q, k, w, cu_q, cu_k, topk, 8**-0.5, host_cu_seqlens=offsets)
    assert torch.equal(got, expected) and not scored
    ops.indexer_topk(q, k, w, cu_q, cu_k, topk - 1, 8**-0.5, host_cu_seqlens=offsets)
    assert scored  # the 10-key sequence does not fit 9
    monkeypatch.undo()
    # Paged (decode): the block table's width bounds every sequence
    seq_lens = torch.tensor([10, 7, 5, 8])
    slots = torch.arange(40).view(4, 10)
    keys = torch.randn(40, 8, dtype=F64)
    q1, w1 = torch.randn(4, 3, 8, dtype=F64), torch.randn(4, 3, dtype=F64)
    fitting = ops.indexer_topk_paged(q1, keys, w1, slots, seq_lens, topk, 8**-0.5)
    assert torch.equal(fitting, reference.indexer_topk_paged(q1, keys, w1, slots, seq_lens, topk, 8**-0.5))
    assert fitting.dtype == torch.int64 and fitting[1].tolist() == [*range(7), -1, -1, -1]

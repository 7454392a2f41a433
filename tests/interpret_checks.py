"""Triton kernels run by Triton's CPU interpreter against the torch reference, at small shapes.

Run as `TRITON_INTERPRET=1 python -m tests.interpret_checks` (tests/test_ops_interpret.py does): the interpreter is
picked when a kernel is defined, so the variable must be set before the kernel modules are imported. Inputs are
float32 holding small integers (the interpreter's bf16 dot is not faithful), so scores are exact and the top-k
must equal the reference slot for slot, ties included.
"""

from __future__ import annotations

import os
import sys

import torch

from slime_dsa.ops import reference


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


def _ints(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-2, 3, shape, generator=g).float()


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_topk_select() -> None:
    """Random and heavily tied rows (zeros of both signs, a -inf), valid prefixes from 0 to the whole row."""
    from slime_dsa.ops.triton_topk import topk_select  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    for width, k, tied in ((300, 64, False), (4100, 2100, True), (2500, 100, True)):
        scores = _ints(6, width, g=g) if tied else torch.randn(6, width, generator=g)
        scores[scores == 0] = -0.0
        scores[0, 7] = float("-inf")
        n_valid = torch.tensor([width, min(k, width), 0, 1, width - 1, k + 1])
        got = topk_select(scores, n_valid, k)
        valid = torch.arange(width)[None, :] < n_valid[:, None]
        assert torch.equal(got, reference.select_topk(scores, valid, k)), f"topk_select width {width} k {k}"


def check_topk_select_split() -> None:
    """The split radix select on the rows of check_topk_select, cut into one to many slices."""
    from slime_dsa.ops.triton_topk_split import topk_select_split  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    cases = ((300, 64, False, 3, 64), (4100, 2100, True, 5, 256), (2500, 100, True, None, 128), (700, 50, True, 1, 1024))
    for width, k, tied, slices, block in cases:
        scores = _ints(6, width, g=g) if tied else torch.randn(6, width, generator=g)
        scores[scores == 0] = -0.0
        scores[0, 7] = float("-inf")
        n_valid = torch.tensor([width, min(k, width), 0, 1, width - 1, k + 1])
        got = topk_select_split(scores, n_valid, k, slices=slices, block=block)
        valid = torch.arange(width)[None, :] < n_valid[:, None]
        assert torch.equal(got, reference.select_topk(scores, valid, k)), f"topk_select_split width {width} k {k}"


def _relu_scores(rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Decode-like scores sum_j w_j relu(q_j . k_n), weights of both signs: distinct values of similar magnitudes."""
    q, k = torch.randn(rows, 8, 32, generator=g), torch.randn(width, 32, generator=g)
    w = torch.randn(rows, 8, generator=g)
    return (w[:, :, None] * torch.einsum("rhd,nd->rhn", q, k).clamp_min(0)).sum(1)


def check_topk_select_sampled() -> None:
    """The sampled-floor select on the rows of check_topk_select_split."""
    g = torch.Generator().manual_seed(4)
    for width, k, tied, slices, block in ((300, 64, False, 3, 64), (4100, 2100, True, 5, 512),
                                          (2500, 100, True, None, 128), (700, 50, True, 1, 1024)):
        scores = _ints(6, width, g=g) if tied else torch.randn(6, width, generator=g)
        scores[scores == 0] = -0.0
        scores[0, 7] = float("-inf")
        n_valid = torch.tensor([width, min(k, width), 0, 1, width - 1, k + 1])
        _check_sampled(scores, n_valid, k, slices, block, f"width {width} k {k}")


def check_topk_select_sampled_wide_rows() -> None:
    """Rows wider than the sample: decode-like and ragged, where the floor keeps under 2k entries (one full read);
    rows of one value, of negatives, of -inf, of signed zeros, of keys alike but for a tied last byte; and rows whose
    floor is forced too high, which read everything again."""
    from slime_dsa.ops import triton_topk_sampled as sampled  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    width, k = 3 * sampled.SAMPLE + 5, 256
    scores = _relu_scores(5, width, g)
    n_valid = torch.tensor([width, width - 1000, sampled.SAMPLE + 1, 2 * k, k - 3])
    state = sampled.keep_above_floor(scores, n_valid, k, 4, 512, 4)
    k_eff = n_valid.clamp(max=k).int()
    assert bool((state.total >= k_eff).all() and (state.total < 2 * k_eff).all()), f"kept {state.total.tolist()}"
    _check_sampled(scores, n_valid, k, 4, 512, "decode-like rows")
    scores[0], scores[1] = 1.5, -scores[1].abs()  # one value; negatives only
    scores[2, : k // 2], scores[2, k // 2 :] = torch.randn(k // 2, generator=g), float("-inf")
    scores[3] = torch.where(torch.rand(width, generator=g) < 0.5, 0.0, -0.0)  # zeros of both signs tie
    scores[3, torch.randperm(width, generator=g)[:50]] = 1.0
    # keys alike but for the last byte, and tied: the slices before a slice hold entries on both sides of the threshold
    u = torch.rand(width, generator=g)  # last bytes 0-1 mostly, 2 (the threshold's) at 8%, 3-5 at 2%
    last = torch.where(u < 0.1, 2, torch.randint(0, 2, (width,), generator=g)) + (u < 0.02) * (1 + (u * 150).int())
    scores[4] = (last + 0x3F800000).int().view(torch.float32)
    _check_sampled(scores, n_valid, k, 4, 512, "tied, negative, -inf, signed-zero rows")
    alike = torch.stack([(last + 0x3F8000FD).int().view(torch.float32), scores[4]])  # threshold's last byte 255, 2
    _check_sampled(alike, torch.tensor([width, width]), 3 * k, 7, 256, "last-byte ties")
    saved = sampled.MARGIN_SIGMAS
    sampled.MARGIN_SIGMAS = -1e4  # a floor above every key: no row longer than k keeps its top k
    try:
        total = sampled.keep_above_floor(scores, n_valid, k, 4, 512, 4).total
        assert bool((total < k_eff)[n_valid > k].all()), f"kept {total.tolist()} with the floor too high"
        _check_sampled(scores, n_valid, k, 4, 512, "floor too high")
        sampled.MARGIN_SIGMAS = -3.0  # in one call, rows that keep their top k and rows that read everything again
        mixed = torch.cat([_relu_scores(2, width, g), _ints(2, width, g=g)])
        n_mixed = torch.tensor([width, width - 7, width, 3000])
        full = sampled.keep_above_floor(mixed, n_mixed, k, 3, 512, 4).total < k
        assert bool(full[:2].all() and not full[2:].any()), f"full rows {full.tolist()}"
        _check_sampled(mixed, n_mixed, k, 3, 512, "rows full and kept in one call")
    finally:
        sampled.MARGIN_SIGMAS = saved


def _check_sampled(scores: torch.Tensor, n_valid: torch.Tensor, k: int, slices: int | None, block: int,
                   what: str) -> None:
    """Each tail against the reference: five launches; one launch a row, in steps of 1,024 and (rows up to 4,096
    wide) of 64 entries."""
    from slime_dsa.ops import triton_topk_sampled as sampled  # noqa: PLC0415

    valid = torch.arange(scores.shape[1])[None, :] < n_valid[:, None]
    want = reference.select_topk(scores, valid, k)
    tails = [{"fused_tail": False}, {"fused_tail": True}]
    if scores.shape[1] <= 4096:  # several steps a slice; wider rows take minutes at this step in the interpreter
        tails.append({"fused_tail": True, "tail_block": 64, "tail_warps": 2})
    for tail in tails:
        got = sampled.topk_select_sampled(scores, n_valid, k, slices=slices, block=block, **tail)
        assert torch.equal(got, want), f"topk_select_sampled {tail}, {what}"


def check_indexer_topk() -> None:
    """Packed prefill and decode rows (one query per sequence), several heads per tile row."""
    from slime_dsa.ops.triton_indexer import indexer_topk  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    for lens_q, lens_k, Hi, Di, topk in (([1, 1, 1], [5, 300, 40], 4, 16, 32), ([3, 7, 1], [50, 400, 100], 4, 32, 64),
                                         ([1] * 4, [1, 60, 200, 129], 32, 16, 64)):
        q, k, w = _ints(sum(lens_q), Hi, Di, g=g), _ints(sum(lens_k), Di, g=g), _ints(sum(lens_q), Hi, g=g)
        got = indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, 1.0)
        want = reference.indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, 1.0)
        assert torch.equal(got, want), f"indexer_topk lens_k {lens_k}"


def check_indexer_scores_products() -> None:
    """Each scoring product (`triton_indexer.PRODUCTS`) gives check_indexer_topk's and check_indexer_topk_fp8_keys'
    selections (bf16-exact integer inputs, ties included)."""
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    default = ti.SCORES_PRODUCT
    try:
        for product in ti.PRODUCTS:
            ti.SCORES_PRODUCT = product
            check_indexer_topk()
            check_indexer_topk_fp8_keys()
    finally:
        ti.SCORES_PRODUCT = default


def check_indexer_prefill_sampled_select() -> None:
    """indexer_topk with its chunks' rows through the sampled select gives check_indexer_topk's and
    check_indexer_topk_fp8_keys' selections."""
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    saved = ti.PREFILL_SELECT_SAMPLED, ti.SAMPLED_SELECT_MIN_WIDTH
    ti.PREFILL_SELECT_SAMPLED, ti.SAMPLED_SELECT_MIN_WIDTH = True, 0
    try:
        check_indexer_topk()
        check_indexer_topk_fp8_keys()
    finally:
        ti.PREFILL_SELECT_SAMPLED, ti.SAMPLED_SELECT_MIN_WIDTH = saved


def check_indexer_topk_paged() -> None:
    from slime_dsa.ops.triton_indexer_paged import indexer_topk_paged  # noqa: PLC0415

    g = torch.Generator().manual_seed(2)
    B, Hi, Di, width, pool = 6, 4, 16, 100, 2000
    q, k_pool, w = _ints(B, Hi, Di, g=g), _ints(pool, Di, g=g), _ints(B, Hi, g=g)
    slots = torch.randperm(pool, generator=g)[: B * width].view(B, width)
    lens = torch.tensor([1, 100, 37, 64, 65, 5])
    want = reference.indexer_topk_paged(q, k_pool, w, slots, lens, 32, 1.0)
    assert torch.equal(indexer_topk_paged(q, k_pool, w, slots, lens, 32, 1.0), want), "indexer_topk_paged"
    from slime_dsa.ops import triton_indexer_paged  # noqa: PLC0415
    from slime_dsa.ops.triton_topk_split import topk_select_split  # noqa: PLC0415

    wide, triton_indexer_paged.SPLIT_MIN_WIDTH = triton_indexer_paged.SPLIT_MIN_WIDTH, width  # the long-row select
    long_rows = triton_indexer_paged.LONG_ROW_SELECT
    try:
        assert torch.equal(indexer_topk_paged(q, k_pool, w, slots, lens, 32, 1.0), want), "indexer_topk_paged (sampled)"
        triton_indexer_paged.LONG_ROW_SELECT = topk_select_split
        assert torch.equal(indexer_topk_paged(q, k_pool, w, slots, lens, 32, 1.0), want), "indexer_topk_paged (split)"
    finally:
        triton_indexer_paged.SPLIT_MIN_WIDTH, triton_indexer_paged.LONG_ROW_SELECT = wide, long_rows


def _fp8_keys(rows: int, Di: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn keys of small integers and power-of-two row scales: both exact, so every score is exact."""
    values = torch.randint(-3, 4, (rows, Di), generator=g).float()
    scales = 2.0 ** torch.randint(-2, 3, (rows,), generator=g).float()
    values[1], scales[1] = 2 * values[0], scales[0] / 2  # an equal key through other values and scale: a tie
    return values.to(torch.float8_e4m3fn), scales


def _scaled_scores(q: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor, w: torch.Tensor, scale: float,
                   n_valid: torch.Tensor) -> torch.Tensor:
    """score[r, n] = scales[r, n] * sum_j w[r, j] scale relu(q[r, j] . keys[r, n]) in float32, -inf from n_valid[r].

    q (R, Hi, Di), keys (R, N, Di) fp8 values, scales (R, N), w (R, Hi)."""
    dots = torch.einsum("rhd,rnd->rhn", q.float(), keys.float())
    score = scales * ((w.float() * scale)[:, :, None] * dots.clamp_min(0)).sum(1)
    return score.masked_fill(torch.arange(keys.shape[1])[None, :] >= n_valid[:, None], float("-inf"))


def _select(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> torch.Tensor:
    """The top min(topk, n_valid) positions per row, ties to the lower position, ascending, -1 padded."""
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :topk]  # stable: equal scores keep position order
    keep = torch.arange(order.shape[1])[None, :] < n_valid.clamp(max=topk)[:, None]
    picked = torch.where(keep, order, torch.iinfo(torch.long).max).sort(1).values
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.long)
    out[:, : picked.shape[1]] = torch.where(keep, picked, -1)
    return out


def _ties_at_boundary(scores: torch.Tensor, n_valid: torch.Tensor, topk: int) -> int:
    """Rows whose topk-th and next score are equal: there the tie rule decides the selection."""
    top = scores.sort(1, descending=True).values
    return int(((top[:, topk - 1] == top[:, topk]) & (n_valid > topk)).sum()) if scores.shape[1] > topk else 0


def _raises_value_error(fn) -> bool:
    try:
        fn()
    except ValueError:
        return True
    return False


def check_indexer_topk_fp8_keys() -> None:
    """Packed prefill and decode rows with float8_e4m3fn keys and per-row scales against the scaled-score formula."""
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    g = torch.Generator().manual_seed(12)
    ties = 0
    for lens_q, lens_k, Hi, Di, topk in (([1, 1, 1], [5, 300, 600], 4, 16, 32), ([3, 7, 1], [50, 400, 100], 4, 32, 64),
                                         ([1] * 4, [1, 60, 200, 129], 32, 16, 64)):
        q, w = _ints(sum(lens_q), Hi, Di, g=g), _ints(sum(lens_q), Hi, g=g)
        k, ks = _fp8_keys(sum(lens_k), Di, g)
        got = ti.indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, 0.5, key_scales=ks)
        width = max(lens_k)
        rows_q, rows_k, rows_s, n_valid = [], [], [], []
        for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            k0 = sum(lens_k[:i])
            for t in range(lq):  # query t of the sequence sees keys 0 .. lk - lq + t
                rows_q.append(sum(lens_q[:i]) + t)
                rows_k.append(torch.cat([k[k0 : k0 + lk].float(), torch.zeros(width - lk, Di)]))
                rows_s.append(torch.cat([ks[k0 : k0 + lk], torch.zeros(width - lk)]))
                n_valid.append(lk - lq + t + 1)
        n_valid = torch.tensor(n_valid)
        scores = _scaled_scores(q[rows_q], torch.stack(rows_k), torch.stack(rows_s), w[rows_q], 0.5, n_valid)
        assert torch.equal(got, _select(scores, n_valid, topk)), f"indexer_topk fp8 keys, lens_k {lens_k}"
        big = ti.indexer_topk(q * 2.0**20, k, w, _cu(lens_q), _cu(lens_k), topk, 0.5, key_scales=ks)  # past fp16
        assert torch.equal(big, got), f"indexer_topk fp8 keys, queries past fp16's range, lens_k {lens_k}"
        ties += _ties_at_boundary(scores, n_valid, topk)
    assert ties, "no tie at a top-k boundary: the inputs no longer check the tie rule"
    args = q, k, w, _cu(lens_q), _cu(lens_k), topk, 0.5
    assert _raises_value_error(lambda: ti.indexer_topk(*args)), "fp8 keys without key_scales"
    assert _raises_value_error(lambda: ti.indexer_topk(*args, key_scales=ks[:-1])), "key_scales of the wrong shape"
    assert _raises_value_error(lambda: ti.indexer_topk(q, k.float(), *args[2:], key_scales=ks)), "scales, float keys"


def check_indexer_topk_paged_fp8_keys() -> None:
    """The paged indexer with float8_e4m3fn keys and per-slot scales: scores equal the formula exactly; the top-k by
    the single-launch and the split select (forced at this small width) equals the formula's, ties included."""
    from slime_dsa.ops import triton_indexer_paged as tip  # noqa: PLC0415

    g = torch.Generator().manual_seed(13)
    B, Hi, Di, width, pool, topk = 7, 4, 16, 300, 2500, 64
    q, w = _ints(B, Hi, Di, g=g), _ints(B, Hi, g=g)
    k_pool, ks = _fp8_keys(pool, Di, g)
    slots = torch.randperm(pool, generator=g)[: B * width].view(B, width)
    slots[1, 5], slots[1, 200] = 1, 0  # the equal keys of _fp8_keys: equal scores, the lower position first
    lens = torch.tensor([1, 300, 37, 0, 257, 5, 33])
    scores = _scaled_scores(q, k_pool[slots], ks[slots], w, 0.5, lens)
    assert torch.equal(tip.paged_scores(q, k_pool, w, slots, lens, 0.5, key_scales=ks), scores), "paged_scores fp8"
    want = _select(scores, lens, topk)
    assert _ties_at_boundary(scores, lens, topk), "no tie at a top-k boundary: the inputs no longer check the tie rule"
    assert torch.equal(tip.indexer_topk_paged(q, k_pool, w, slots, lens, topk, 0.5, ks), want), "paged fp8 keys"
    wide, tip.SPLIT_MIN_WIDTH = tip.SPLIT_MIN_WIDTH, width  # the split select
    try:
        assert torch.equal(tip.indexer_topk_paged(q, k_pool, w, slots, lens, topk, 0.5, ks), want), "paged fp8 (split)"
    finally:
        tip.SPLIT_MIN_WIDTH = wide
    big = 2.0**20  # queries past fp16's range: divided by a power of two before the fp16 dot, scores unchanged
    assert torch.equal(tip.paged_scores(q * big, k_pool, w, slots, lens, 0.5, key_scales=ks), scores * big), "big q"
    args = q, k_pool, w, slots, lens, topk, 0.5
    assert _raises_value_error(lambda: tip.indexer_topk_paged(*args)), "fp8 keys without key_scales"
    assert _raises_value_error(lambda: tip.indexer_topk_paged(*args, ks[:, None])), "key_scales of the wrong shape"
    assert _raises_value_error(lambda: tip.indexer_topk_paged(*args, ks.double())), "float64 key_scales"
    assert _raises_value_error(lambda: tip.indexer_topk_paged(q, k_pool.float(), *args[2:], ks)), "scales, float keys"


def _mostly_empty_indices(T: int, Tk: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Rows with few keys: a short prefix, holes before the last used slot, only the last slot, none at all."""
    idx = torch.full((T, K), -1, dtype=torch.long)
    idx[0, :3] = torch.tensor([0, 5, 7])
    n = min(Tk, K)
    idx[1, :n] = torch.randperm(Tk, generator=g)[:n]  # a full row
    idx[2, [1, K // 2, K - 3]] = torch.tensor([3, 9, Tk - 1])
    idx[4, K - 1] = 12  # row 3 and 5 have no key
    return idx


def check_sparse_mla() -> None:
    """Forward and gradients (general backward) with and without skipping empty slots; a decode split case."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    T, Tk, H, v_dim, d_r, K = 6, 40, 16, 32, 16, 48
    D = v_dim + d_r
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(Tk, D, generator=g)
    idx = _mostly_empty_indices(T, Tk, K, g)
    saved = mla.SKIP_EMPTY_SLOTS, mla.USE_KEY_RANGES
    try:
        mla.USE_KEY_RANGES = False
        for skip in (True, False):
            mla.SKIP_EMPTY_SLOTS = skip
            q1, kv1 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
            out, lse = mla.sparse_mla_attention(q1, kv1, idx, D**-0.5, v_dim)
            q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
            ref_out, ref_lse = reference.sparse_mla_attention(q2, kv2, idx, D**-0.5, v_dim)
            has = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), has) and (lse[has] - ref_lse[has]).abs().max() < 1e-4
            assert _rel_l2(out, ref_out) < 1e-4, f"out, skip={skip}"
            dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g).masked_fill(~has, 0)
            grads = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~has, 0) * dlse).sum(), (q1, kv1))
            ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse.masked_fill(~has, 0) * dlse).sum(), (q2, kv2))
            assert _rel_l2(grads[0], ref[0]) < 1e-4 and _rel_l2(grads[1], ref[1]) < 1e-4, f"grads, skip={skip}"
        # decode: two rows, K split over several programs; keys only in the first split / only in the last one
        mla.SKIP_EMPTY_SLOTS = True
        Tk, K = 700, 600
        kv = torch.randn(Tk, D, generator=g)
        idx = torch.full((2, K), -1, dtype=torch.long)
        idx[0, :100] = torch.randperm(Tk, generator=g)[:100]
        idx[1, K - 50 :] = torch.randperm(Tk, generator=g)[:50]
        out, lse = mla.sparse_mla_attention(q[:2], kv, idx, D**-0.5, v_dim)
        ref_out, ref_lse = reference.sparse_mla_attention(q[:2], kv, idx, D**-0.5, v_dim)
        assert _rel_l2(out, ref_out) < 1e-4 and (lse - ref_lse).abs().max() < 1e-4, "decode split"
        # dims that are not powers of two: the forward's column masks
        v_dim, D = 24, 36
        q, kv = torch.randn(T, H, D, generator=g), torch.randn(Tk, D, generator=g)
        idx = _mostly_empty_indices(T, Tk, 48, g)
        out, lse = mla.sparse_mla_fwd(q, kv, idx, D**-0.5, v_dim)
        ref_out, ref_lse = reference.sparse_mla_attention(q, kv, idx, D**-0.5, v_dim)
        has = torch.isfinite(ref_lse)
        assert _rel_l2(out, ref_out) < 1e-4 and (lse[has] - ref_lse[has]).abs().max() < 1e-4, "dims not powers of 2"
    finally:
        mla.SKIP_EMPTY_SLOTS, mla.USE_KEY_RANGES = saved


def _forget_fwd_configs(mla) -> None:
    for key in [k for k in mla._chosen if k[0] == "fwd"]:
        del mla._chosen[key]


def check_sparse_mla_fwd_variants() -> None:
    """Every forward variant (slime_dsa/ops/triton_sparse_mla_fwd_variants.py) at its first config: rows of mostly
    -1 slots and rows without keys, at power-of-two dims (the unmasked paths) and odd ones; a decode split."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_fwd_variants as fv  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    T, Tk, K = 6, 40, 48
    decode_idx = torch.full((2, 600), -1, dtype=torch.long)
    decode_idx[0, :100] = torch.randperm(700, generator=g)[:100]
    decode_idx[1, 550:] = torch.randperm(700, generator=g)[:50]
    idx = _mostly_empty_indices(T, Tk, K, g)
    saved = mla.FWD_VARIANT
    try:
        for H, v_dim, d_r in ((16, 32, 16), (3, 40, 8)):
            D = v_dim + d_r
            q, kv = torch.randn(T, H, D, generator=g), torch.randn(Tk, D, generator=g)
            kv_dec = torch.randn(700, D, generator=g)
            cases = ((q, kv, idx), (q[:2], kv_dec, decode_idx))
            refs = [reference.sparse_mla_attention(*case, D**-0.5, v_dim) for case in cases]
            for name in fv.VARIANTS:
                mla.FWD_VARIANT = name
                for case, (ref_out, ref_lse) in zip(cases, refs):
                    _forget_fwd_configs(mla)  # each variant at its first config, as on a GPU where it fits
                    out, lse = mla.sparse_mla_attention(*case, D**-0.5, v_dim)
                    has = torch.isfinite(ref_lse)
                    where = f"variant {name}, dims {v_dim}+{d_r}, rows {case[0].shape[0]}"
                    assert torch.equal(torch.isfinite(lse), has) and (out[~has] == 0).all(), where
                    assert (lse[has] - ref_lse[has]).abs().max() < 1e-4 and _rel_l2(out, ref_out) < 1e-4, where
    finally:
        mla.FWD_VARIANT = saved
        _forget_fwd_configs(mla)


def check_prefill_forward_choice() -> None:
    """The default forward runs PREFILL_FWD_VARIANT for rows that need no key split with 64+ heads, the plain kernel
    for decode rows (split keys), fewer heads, the invariant forward and FWD_VARIANT = PLAIN_FWD; each against the
    reference."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    g = torch.Generator().manual_seed(11)
    H, v_dim, d_r, Tk = 64, 32, 16, 700
    D = v_dim + d_r
    kv = torch.randn(Tk, D, generator=g)
    saved = mla.FWD_VARIANT, mla._num_sms
    mla._num_sms = lambda device: 4  # a GPU of 4 SMs: 8 rows of 64 heads need no key split, and interpret quickly
    rows = 8
    try:
        for T, K, heads, forced, invariant, expected in (
                (rows, 32, H, None, False, mla.PREFILL_FWD_VARIANT), (2, 600, H, None, False, None),
                (rows, 32, 32, None, False, None), (rows, 32, H, None, True, None),
                (rows, 32, H, mla.PLAIN_FWD, False, None)):
            mla.FWD_VARIANT = forced
            _forget_fwd_configs(mla)
            q = torch.randn(T, heads, D, generator=g)
            idx = torch.stack([torch.randperm(Tk, generator=g)[:K] for _ in range(T)])
            idx[::7, K // 2:] = -1  # some rows with half their slots empty
            out, lse = mla.sparse_mla_fwd(q, kv, idx, D**-0.5, v_dim, invariant=invariant)
            ref_out, ref_lse = reference.sparse_mla_attention(q, kv, idx, D**-0.5, v_dim)
            where = f"T {T}, K {K}, heads {heads}, FWD_VARIANT {forced}, invariant {invariant}"
            assert _rel_l2(out, ref_out) < 1e-4 and (lse - ref_lse).abs().max() < 1e-4, where
            ran = {key[-1] if isinstance(key[-1], str) else None for kind, key in mla._chosen if kind == "fwd"}
            assert ran == (set() if invariant else {expected}), f"{where}: ran {ran}, expected {expected}"
    finally:
        mla.FWD_VARIANT, mla._num_sms = saved
        _forget_fwd_configs(mla)


def check_idx_reg_slices() -> None:
    """The idx_reg variants' per-step slice of the index range: the right slots in every step, and inside the range in
    the steps past the loop's end, which Triton's pipeliner also runs (up to num_stages - 1 of them, their kv copies
    predicated off) and where a slot past BLOCK_K read past the block's shared memory on the H200."""
    import triton  # noqa: PLC0415
    from triton.runtime.errors import InterpreterError  # noqa: PLC0415

    from slime_dsa.ops import triton_sparse_mla_fwd_variants as fv  # noqa: PLC0415
    from tests.interpret_probes import idx_slice_probe  # noqa: PLC0415

    configs = [c for v in fv.VARIANTS.values() if v.idx_in_registers for c in v.configs]
    ahead = max(c.num_stages for c in configs) - 1
    for block_n in sorted({c.block_n for c in configs}):
        for keys_per_split in (2048, 3 * block_n, block_n):  # GLM-5's top-k; a range short of a power of two
            block_k = triton.next_power_of_2(keys_per_split)
            idx_all = torch.arange(block_k, dtype=torch.int32) + 100
            steps = keys_per_split // block_n
            for k_lo in (0, keys_per_split):  # the first and the second key split
                for step in range(max(0, steps - 2), steps + ahead):
                    out, n0 = torch.empty(block_n, dtype=torch.int32), k_lo + step * block_n
                    where = f"block_n {block_n}, keys_per_split {keys_per_split}, k_lo {k_lo}, step {step}"
                    try:
                        idx_slice_probe[(1,)](idx_all, out, n0, k_lo, BLOCK_N=block_n, BLOCK_K=block_k)
                    except InterpreterError as err:  # the interpreter's gather checks the range; a GPU's does not
                        raise AssertionError(f"{where}: slice outside the index range ({err})") from None
                    if step < steps:
                        assert torch.equal(out, idx_all[step * block_n:(step + 1) * block_n]), where


def check_sparse_mla_bwd_variants() -> None:
    """Each backward variant the interpreter can run (no inline PTX) on rows of mostly -1 slots, with and without the
    stop at the last used slot, against the reference; heads and dims off the powers of two (masked tiles)."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    T, Tk, H, v_dim, d_r, K = 6, 40, 12, 40, 8, 48
    D = v_dim + d_r
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(Tk, D, generator=g)
    idx = _mostly_empty_indices(T, Tk, K, g)
    q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q2, kv2, idx, D**-0.5, v_dim)
    has = torch.isfinite(ref_lse)
    dout, dlse = torch.randn(ref_out.shape, generator=g), torch.randn(ref_lse.shape, generator=g).masked_fill(~has, 0)
    ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse.masked_fill(~has, 0) * dlse).sum(), (q2, kv2))
    key = (H, D, v_dim, q.dtype)
    saved = mla.SKIP_EMPTY_SLOTS, mla.USE_KEY_RANGES
    try:
        mla.USE_KEY_RANGES = False
        for mode in variants.MODES:
            if variants.cuda_only(mode):
                continue
            for skip in (True, False) if mode == "fused64_rot" else (True,):
                mla.SKIP_EMPTY_SLOTS = skip
                variants.force_mode(mode, key)
                q1, kv1 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
                out, lse = mla.sparse_mla_attention(q1, kv1, idx, D**-0.5, v_dim)
                grads = torch.autograd.grad((out * dout).sum() + (lse.masked_fill(~has, 0) * dlse).sum(), (q1, kv1))
                errs = _rel_l2(grads[0], ref[0]), _rel_l2(grads[1], ref[1])
                assert max(errs) < 1e-4, f"backward mode {mode}, skip={skip}: rel L2 dq, dkv {errs}"
    finally:
        variants.force_mode(None, key)
        mla.SKIP_EMPTY_SLOTS, mla.USE_KEY_RANGES = saved


def check_dkv_stores_timing_launch() -> None:
    """The timing-only split64_stores (variants.TIMING_ONLY: dKV by plain stores): where every kv row is selected by
    one query alone, a store is the sum, so its dq and dkv equal split64's; it runs where benchmarks time it."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla_launch import KernelConfig  # noqa: PLC0415

    g = torch.Generator().manual_seed(6)
    T, H, v_dim, d_r, K = 5, 12, 40, 8, 48
    D = v_dim + d_r
    kv_rows = torch.randperm(T * 8, generator=g)[: T * 6].reshape(T, 6)  # disjoint rows per query
    idx = torch.full((T, K), -1, dtype=torch.int32)
    idx[:, 3:9] = kv_rows.to(torch.int32)
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(T * 8, D, generator=g)
    out, lse = mla.sparse_mla_fwd(q, kv, idx, D**-0.5, v_dim)
    dout = torch.randn(out.shape, generator=g)
    delta = mla.bwd_delta(out, dout, None)
    cfg = KernelConfig(64, 16, 4, 1)
    got, want = [], []
    for launches, grads in ((variants.TIMING_ONLY["split64_stores"], got), (variants.MODES["split64"], want)):
        dq, dkv = torch.zeros_like(q), torch.zeros(kv.shape, dtype=torch.float32)
        for launch in launches:
            variants.launch_variant(launch, cfg, q, kv, idx, dout, lse, delta, dq, dkv, D**-0.5, v_dim)
        grads += [dq, dkv]
    assert variants.TIMING_ONLY["split64_stores"][1].red == variants.RED_STORES
    assert "split64_stores" not in variants.MODES and "split64_stores" not in mla.BWD_MODES  # never a backward
    assert float(want[1].abs().max()) > 0
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=0, atol=1e-6), "stores != sums"


def check_bwd_delta() -> None:
    """The backward's delta kernel against torch's float32 rowsum, with and without dlse, rows not a multiple of
    its block and values wider than one block."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    g = torch.Generator().manual_seed(7)
    for T, H, V, with_dlse in ((5, 3, 40, False), (7, 5, 1100, True)):
        out, dout = (torch.randn(T, H, V, generator=g).to(torch.bfloat16) for _ in range(2))
        dlse = torch.randn(T, H, generator=g) if with_dlse else None
        want = (dout.float() * out.float()).sum(-1) - (dlse if with_dlse else 0)
        got = mla.bwd_delta_triton(out, dout, dlse)
        assert got.dtype == torch.float32 and got.shape == (T, H)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), f"delta off by {(got - want).abs().max():.3g}"


def check_masked_ranges() -> None:
    """The range backward over a byte map of selected keys (subsets of short packed sequences), and the general
    backward on the same selection, against the reference."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from tests.test_sparse_mla_ranges import causal_topk  # noqa: PLC0415

    g = torch.Generator().manual_seed(4)
    indices = causal_topk([5, 40, 23], K=16)
    assert mla.selection_ranges(indices).sel is not None
    T, H, v_dim, d_r = indices.shape[0], 3, 32, 16
    q, kv = torch.randn(T, H, v_dim + d_r, generator=g), torch.randn(T, v_dim + d_r, generator=g)
    saved = mla.USE_MASKED_RANGES
    try:
        for masked in (True, False):
            mla.USE_MASKED_RANGES = masked
            q1, kv1 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
            out, lse = mla.sparse_mla_attention(q1, kv1, indices, 0.2, v_dim)
            q2, kv2 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
            ref_out, ref_lse = reference.sparse_mla_attention(q2, kv2, indices, 0.2, v_dim)
            dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
            grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q1, kv1))
            ref = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q2, kv2))
            assert _rel_l2(grads[0], ref[0]) < 1e-5 and _rel_l2(grads[1], ref[1]) < 1e-5, f"grads, masked={masked}"
    finally:
        mla.USE_MASKED_RANGES = saved


CHECKS = [check_topk_select, check_topk_select_split, check_topk_select_sampled, check_topk_select_sampled_wide_rows,
          check_indexer_topk, check_indexer_scores_products, check_indexer_prefill_sampled_select,
          check_indexer_topk_paged, check_indexer_topk_fp8_keys,
          check_indexer_topk_paged_fp8_keys, check_sparse_mla, check_sparse_mla_fwd_variants,
          check_prefill_forward_choice, check_idx_reg_slices, check_sparse_mla_bwd_variants,
          check_dkv_stores_timing_launch, check_bwd_delta, check_masked_ranges]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    failed = []
    for check in CHECKS:
        try:
            check()
        except AssertionError as err:
            failed.append(f"{check.__name__}: {err}")
    for line in failed:
        print("FAILED", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

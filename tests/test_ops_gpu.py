"""Triton DSA kernels against the torch reference on random CUDA inputs (skipped without a GPU).

Tolerances (bf16 inputs; the reference runs in float32 on the same bf16 values):
- sparse MLA: relative L2 error ||x - ref|| / ||ref|| <= 1e-2 for out, dq, dkv (the kernel rounds P and dS to
  bf16 before their tensor-core products, as flash attention does); lse max abs error <= 1e-3.
- indexer top-k: exact on integer inputs (exact ties, checks the tie rule); on random inputs the selected set
  must be a top-k set up to float32 rounding (min selected score >= max unselected score - 1e-5 * max|score|)
  and differ from the reference in at most 0.1% of slots.
- indexer KL loss: per-query KL within 1e-3 (abs and rel); gradients relative L2 <= 1e-2 (reference gradients
  in float32).
"""

from __future__ import annotations

import functools

import pytest
import torch

from slime_dsa import ops
from slime_dsa.ops import reference
from slime_dsa.ops.fp8_keys import quantize_keys

pytestmark = pytest.mark.gpu

REL_L2 = 1e-2


def _kernels():
    from slime_dsa.ops import triton_kernels  # noqa: PLC0415 (imports triton; only with a GPU)

    return triton_kernels


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], device="cuda").cumsum(0)


def causal_rows(lens_q: list[int], lens_k: list[int], K: int, seed: int = 0) -> torch.Tensor:
    """(Tq, K) random distinct causal key rows per query (global rows, ascending, -1 padded)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out, key0 = [], 0
    for lq, lk in zip(lens_q, lens_k):
        pos = torch.arange(lk - lq, lk, device="cuda")
        r = torch.rand(lq, lk, device="cuda", generator=g)
        r = r.masked_fill(torch.arange(lk, device="cuda")[None, :] > pos[:, None], -1.0)
        top = r.topk(min(K, lk), dim=-1)
        rows = torch.where(top.values >= 0, top.indices + key0, -1)
        rows = torch.where(rows < 0, torch.iinfo(torch.long).max, rows).sort(-1).values
        rows = torch.where(rows == torch.iinfo(torch.long).max, -1, rows)
        out.append(torch.nn.functional.pad(rows, (0, K - rows.shape[1]), value=-1))
        key0 += lk
    return torch.cat(out)


def scatter_empty(indices: torch.Tensor, keep: float, seed: int = 0) -> torch.Tensor:
    """Drop slots to -1 with probability 1 - keep and shuffle every row, so -1 slots sit anywhere in a row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dropped = indices.masked_fill(torch.rand(indices.shape, device="cuda", generator=g) > keep, -1)
    order = torch.rand(indices.shape, device="cuda", generator=g).argsort(dim=-1)
    return dropped.gather(1, order)


# ----------------------------------------------------------------------------------------------
# Sparse MLA attention

MLA_CASES = {
    # lens_q, lens_k, H, v_dim, rope_dim, K, check_grad
    "packed_short": ([1, 37, 300], [1, 37, 300], 16, 64, 32, 128, True),
    "odd_dims_tq_lt_tk": ([5, 60], [90, 200], 3, 40, 8, 48, True),
    "heads128": ([500], [500], 128, 128, 64, 256, True),
    "glm5": ([2048], [2048], 64, 512, 64, 2048, True),  # K >= length: the key-range backward
    # K >= every sequence's keys: each query selects all its causal keys (key-range backward); packed
    # sequences share nothing, queries of one sequence share keys, -1 padding, K and lengths off the block sizes
    "all_keys_packed": ([1, 37, 122, 300], [1, 37, 122, 300], 12, 256, 32, 304, True),
    "all_keys_tq_lt_tk_odd_dims": ([5, 60, 1], [90, 200, 7], 3, 40, 8, 200, True),
    "all_keys_sft_small": ([122] * 24, [122] * 24, 12, 256, 32, 256, True),
    "glm5_packed_long": ([3000, 9000], [3000, 9000], 64, 512, 64, 2048, False),
    "glm5_decode": ([1] * 8, [100, 3000, 10000, 1, 2047, 2048, 2049, 65000], 64, 512, 64, 2048, False),
    "glm5_decode_single": ([1], [30000], 64, 512, 64, 2048, False),
    # the small preset's RL batches: sequences a little longer than index_topk (the masked range backward)
    "rl_small_packed": ([300] * 4 + [1000, 700], [300] * 4 + [1000, 700], 12, 256, 32, 256, True),
    # mostly -1 slots: short packed sequences under a 2048-slot top-k (rows end early; the longer sequence's late
    # rows select a real subset: the masked range backward, or the general one in SUBSET_CASES' second run), and
    # decode rows with few keys
    "glm5_mostly_empty_packed": ([2500, 600, 37], [2500, 600, 37], 64, 512, 64, 2048, True),
    "glm5_mostly_empty_decode": ([1] * 6, [1, 40, 300, 2047, 5000, 1], 64, 512, 64, 2048, False),
}
# Real subsets of short sequences: the masked range backward by default, the atomic kernel when it is off
SUBSET_CASES = ["packed_short", "odd_dims_tq_lt_tk", "heads128", "rl_small_packed", "glm5_mostly_empty_packed"]


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_sparse_mla_matches_reference(name):
    lens_q, lens_k, H, v_dim, d_r, K, check_grad = MLA_CASES[name]
    torch.manual_seed(0)
    D = v_dim + d_r
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(sum(lens_k), D, device="cuda", dtype=torch.bfloat16)
    indices = causal_rows(lens_q, lens_k, K)
    scale = D**-0.5
    kern = _kernels()
    if not check_grad:
        with torch.no_grad():
            out, lse = kern.sparse_mla_attention(q, kv, indices, scale, v_dim)
            ref_out, ref_lse = reference.sparse_mla_attention(q.float(), kv.float(), indices, scale, v_dim)
        assert rel_l2(out, ref_out) <= REL_L2, f"out rel L2 {rel_l2(out, ref_out):.2e}"
        assert (lse - ref_lse).abs().max().item() <= 1e-3
        return
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, lse = kern.sparse_mla_attention(q, kv, indices, scale, v_dim)
    q32, kv32 = q.detach().float().requires_grad_(True), kv.detach().float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, scale, v_dim)
    assert rel_l2(out, ref_out) <= REL_L2, f"out rel L2 {rel_l2(out, ref_out):.2e}"
    assert (lse - ref_lse).abs().max().item() <= 1e-3
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)  # lse feeds the indexer loss; its gradient must be right too
    dq, dkv = torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout.float()).sum() + (ref_lse * dlse).sum(), (q32, kv32))
    assert rel_l2(dq, ref_dq) <= REL_L2, f"dq rel L2 {rel_l2(dq, ref_dq):.2e}"
    assert rel_l2(dkv, ref_dkv) <= REL_L2, f"dkv rel L2 {rel_l2(dkv, ref_dkv):.2e}"


def gradient_errors(mla, q, kv, indices, v_dim: int, scale: float = 0.1) -> tuple[float, float]:
    """Relative L2 errors of the kernel's (dq, dkv) against the float32 reference, for random dout and dlse."""
    q, kv = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
    out, lse = mla.sparse_mla_attention(q, kv, indices, scale, v_dim)
    q32, kv32 = q.detach().float().requires_grad_(True), kv.detach().float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, scale, v_dim)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq, dkv = torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout.float()).sum() + (ref_lse * dlse).sum(), (q32, kv32))
    return rel_l2(dq, ref_dq), rel_l2(dkv, ref_dkv)


@pytest.mark.parametrize("masked", [True, False])
def test_sparse_mla_subset_backward_paths(masked, monkeypatch):
    """Both backward paths for subsets of short sequences (byte-mapped ranges, atomics) match the reference."""
    from slime_dsa.ops import triton_sparse_mla as mla

    monkeypatch.setattr(mla, "USE_MASKED_RANGES", masked)
    monkeypatch.setattr(mla, "MASKED_RANGE_MAX_HEAD_WORK", 1 << 30)  # the masked kernel at every case's heads
    for name in SUBSET_CASES:
        lens_q, lens_k, H, v_dim, d_r, K, _ = MLA_CASES[name]
        indices = causal_rows(lens_q, lens_k, K)
        cover = mla.selection_ranges(indices, mla.MASKED_RANGE_MAX_RATIO if masked else 0.0)
        assert (cover is not None and cover.sel is not None) if masked else cover is None, name
        torch.manual_seed(1)
        q = torch.randn(sum(lens_q), H, v_dim + d_r, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(sum(lens_k), v_dim + d_r, device="cuda", dtype=torch.bfloat16)
        dq_err, dkv_err = gradient_errors(mla, q, kv, indices, v_dim)
        assert dq_err <= REL_L2 and dkv_err <= REL_L2, f"{name}: dq {dq_err:.2e}, dkv {dkv_err:.2e}"


@pytest.mark.parametrize("shape", ["packed_short", "glm5"])
def test_sparse_mla_scattered_empty_slots(shape, monkeypatch):
    """-1 slots anywhere in a row (shuffled rows, 80% dropped), at the GLM-5 shape too: the general backward."""
    from slime_dsa.ops import triton_sparse_mla as mla

    monkeypatch.setattr(mla, "USE_MASKED_RANGES", False)
    lens_q, lens_k, H, v_dim, d_r, K, _ = MLA_CASES[shape]
    torch.manual_seed(0)
    D = v_dim + d_r
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(sum(lens_k), D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    indices = scatter_empty(causal_rows(lens_q, lens_k, K), keep=0.2)
    indices[0] = -1  # one row without keys
    out, lse = _kernels().sparse_mla_attention(q, kv, indices, D**-0.5, v_dim)
    q32, kv32 = q.detach().float().requires_grad_(True), kv.detach().float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, D**-0.5, v_dim)
    has = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), has) and (out[~has] == 0).all()
    assert rel_l2(out, ref_out) <= REL_L2, f"out rel L2 {rel_l2(out, ref_out):.2e}"
    assert (lse[has] - ref_lse[has]).abs().max().item() <= 1e-3
    dout, dlse = torch.randn_like(out), torch.randn_like(lse).masked_fill(~has, 0.0)
    dq, dkv = torch.autograd.grad((out.float() * dout).sum() + (lse.masked_fill(~has, 0) * dlse).sum(), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad(
        (ref_out * dout.float()).sum() + (ref_lse.masked_fill(~has, 0) * dlse).sum(), (q32, kv32))
    assert rel_l2(dq, ref_dq) <= REL_L2, f"dq rel L2 {rel_l2(dq, ref_dq):.2e}"
    assert rel_l2(dkv, ref_dkv) <= REL_L2, f"dkv rel L2 {rel_l2(dkv, ref_dkv):.2e}"


def test_sparse_mla_skipping_empty_slots_changes_nothing(monkeypatch):
    """The forward and the general backward give the same values whether they stop at the last used slot or not."""
    from slime_dsa.ops import triton_sparse_mla as mla

    monkeypatch.setattr(mla, "USE_MASKED_RANGES", False)

    lens = [2500, 600, 37]
    torch.manual_seed(0)
    q = torch.randn(sum(lens), 64, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(sum(lens), 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    indices = causal_rows(lens, lens, 2048)
    dout = torch.randn(sum(lens), 64, 512, device="cuda", dtype=torch.bfloat16)
    results = {}
    try:
        for skip in (False, True):
            mla.SKIP_EMPTY_SLOTS = skip
            out, lse = mla.sparse_mla_attention(q, kv, indices, 576**-0.5, 512)
            results[skip] = (out, lse, *torch.autograd.grad(out, (q, kv), dout))
    finally:
        mla.SKIP_EMPTY_SLOTS = True
    out0, lse0, dq0, dkv0 = results[False]
    out1, lse1, dq1, dkv1 = results[True]
    # Slots past the last used one add exact zeros; only instruction scheduling may differ between the builds.
    assert rel_l2(out1, out0) <= 1e-4 and (lse1 - lse0).abs().max().item() <= 1e-5 and rel_l2(dq1, dq0) <= 1e-4
    assert rel_l2(dkv1, dkv0) <= 1e-3  # float32 atomics: the summation order may differ


# The general backward's modes (BWD_MODES: fused, split and the variants of triton_sparse_mla_bwd_variants.py) run on
# these shapes, plus rows of mostly -1 slots anywhere at the GLM-5 shape ("glm5_scattered").
BWD_MODE_CASES = ["packed_short", "odd_dims_tq_lt_tk", "heads128", "glm5_mostly_empty_packed", "glm5_scattered"]


@functools.cache
def _bwd_mode_case(name: str) -> dict:
    """Inputs, upstream gradients and the float32 reference (out, lse, dq, dkv) of one case, shared by every mode."""
    lens_q, lens_k, H, v_dim, d_r, K, _ = MLA_CASES["glm5" if name == "glm5_scattered" else name]
    indices = causal_rows(lens_q, lens_k, K)
    if name == "glm5_scattered":
        indices = scatter_empty(indices, keep=0.2)
        indices[0] = -1  # one row without keys
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(lens_q), H, v_dim + d_r, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(sum(lens_k), v_dim + d_r, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = (v_dim + d_r) ** -0.5
    q32, kv32 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, scale, v_dim)
    has = torch.isfinite(ref_lse)
    dout = torch.randn(ref_out.shape, device="cuda", generator=g)
    dlse = torch.randn(ref_lse.shape, device="cuda", generator=g).masked_fill(~has, 0.0)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout).sum() + (ref_lse.masked_fill(~has, 0) * dlse).sum(),
                                          (q32, kv32))
    return dict(q=q, kv=kv, indices=indices, v_dim=v_dim, scale=scale, dout=dout, dlse=dlse, has=has,
                out=ref_out.detach(), lse=ref_lse.detach(), dq=ref_dq, dkv=ref_dkv)


def _mode_list() -> list[str]:
    try:
        from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    except ImportError:  # no triton: the tests are skipped anyway (no GPU)
        return ["fused"]
    return sorted(mla.BWD_MODES, key=lambda m: "red" in m)  # inline PTX last: a fault there kills the CUDA context


# Some backward variants faulted on the H200 (illegal memory access: the 64-head dKV kernels at one stage, since
# removed; benchmarks/RESULTS.md, 2026-12-03), and a fault loses the CUDA context for every later test of the session.
# The modes on a default path (fused, split; split64 with 64 heads) and split64_par ran right on the H200 one per
# process; the others stay opt-in (BWD_MODES) and are not run here until a GPU session has run them apart. The
# forward variants (FWD_VARIANT) all ran right on the H200 on 2026-12-03 (idx_reg's index slice now wraps).
VARIANTS_FAULT = pytest.mark.xfail(run=False, reason="some variants fault on the H200 (RESULTS.md, 2026-12-03)")
CHECKED_MODES = {"fused", "split", "split64", "split64_par"}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=() if m in CHECKED_MODES else VARIANTS_FAULT)
                                  for m in _mode_list()])
def test_sparse_mla_backward_modes(mode, monkeypatch):
    """Each mode of the general (atomic) backward, forced, against the float32 reference: forward and gradients."""
    from slime_dsa.ops import triton_sparse_mla as mla
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants

    monkeypatch.setattr(mla, "USE_KEY_RANGES", False)
    for name in BWD_MODE_CASES:
        c = _bwd_mode_case(name)
        key = (c["q"].shape[1], c["q"].shape[2], c["v_dim"], c["q"].dtype)
        variants.force_mode(mode, key)
        try:
            q, kv = c["q"].clone().requires_grad_(True), c["kv"].clone().requires_grad_(True)
            out, lse = mla.sparse_mla_attention(q, kv, c["indices"], c["scale"], c["v_dim"])
            has = c["has"]
            dq, dkv = torch.autograd.grad(
                (out.float() * c["dout"]).sum() + (lse.masked_fill(~has, 0) * c["dlse"]).sum(), (q, kv))
            assert mla._chosen[("bwd_mode", key)] == mode
        finally:
            variants.force_mode(None, key)
        errs = rel_l2(out, c["out"]), rel_l2(dq, c["dq"]), rel_l2(dkv, c["dkv"])
        assert max(errs) <= REL_L2, f"{mode} on {name}: rel L2 out, dq, dkv {errs}"
        assert torch.equal(torch.isfinite(lse), has) and (lse[has] - c["lse"][has]).abs().max().item() <= 1e-3


def test_sparse_mla_key_range_detection():
    """The key-range backward is taken exactly when every row is a run of consecutive kv rows, in row order."""
    from slime_dsa.ops import triton_sparse_mla as mla

    for name in ("glm5", "all_keys_packed", "all_keys_tq_lt_tk_odd_dims", "all_keys_sft_small"):
        lens_q, lens_k, *_, K, _ = MLA_CASES[name]
        assert mla.key_ranges(causal_rows(lens_q, lens_k, K)) is not None, name
    for name in ("packed_short", "odd_dims_tq_lt_tk", "heads128"):  # K < some sequence's keys: a real subset
        lens_q, lens_k, *_, K, _ = MLA_CASES[name]
        assert mla.key_ranges(causal_rows(lens_q, lens_k, K)) is None, name
    full = causal_rows([20, 30], [20, 30], 32)
    assert mla.key_ranges(full.int()) is not None  # any int dtype
    gap = full.clone()
    gap[25, 3] = -1  # a hole inside a row
    assert mla.key_ranges(gap) is None
    assert mla.key_ranges(full.flip(0)) is None  # rows out of order: the queries of a kv block are not one run
    empty = full.clone()
    empty[0] = -1  # a row without keys
    assert mla.key_ranges(empty) is None


def test_sparse_mla_sliding_window_uses_key_ranges():
    """Runs that are not whole causal prefixes (a sliding window) take the key-range backward too, exactly."""
    from slime_dsa.ops import triton_sparse_mla as mla

    T, H, v_dim, d_r, W = 300, 16, 64, 32, 50
    start = (torch.arange(T, device="cuda") - W + 1).clamp_min(0)
    col = torch.arange(W + 7, device="cuda")
    indices = torch.where(start[:, None] + col[None, :] <= torch.arange(T, device="cuda")[:, None],
                          start[:, None] + col[None, :], -1)
    assert mla.key_ranges(indices) is not None
    torch.manual_seed(0)
    q = torch.randn(T, H, v_dim + d_r, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, v_dim + d_r, device="cuda", dtype=torch.bfloat16)
    dq_err, dkv_err = gradient_errors(mla, q, kv, indices, v_dim)
    assert dq_err <= REL_L2 and dkv_err <= REL_L2


def test_sparse_mla_rows_without_keys():
    q = torch.randn(4, 16, 96, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(10, 96, device="cuda", dtype=torch.bfloat16)
    indices = torch.tensor([[0, 1, -1, -1], [-1, -1, -1, -1], [3, -1, 9, -1], [-1, -1, -1, -1]], device="cuda")
    out, lse = _kernels().sparse_mla_attention(q, kv, indices, 0.1, 64)
    assert torch.isneginf(lse[[1, 3]]).all() and (out[[1, 3]] == 0).all()
    assert torch.isfinite(lse[[0, 2]]).all()


@pytest.mark.parametrize("with_dlse", [False, True])
def test_sparse_mla_bwd_delta_matches_torch(with_dlse):
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    torch.manual_seed(0)
    out, dout = (torch.randn(37, 64, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dlse = torch.randn(37, 64, device="cuda") if with_dlse else None
    want = (dout.float() * out.float()).sum(-1) - (dlse if with_dlse else 0)
    got = mla.bwd_delta(out, dout, dlse)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-4)


# The forward variants of slime_dsa/ops/triton_sparse_mla_fwd_variants.py: dims off the powers of two (masked path),
# GLM-5 prefill, packed, decode (key split) and mostly -1 slots
FWD_VARIANT_CASES = ["odd_dims_tq_lt_tk", "heads128", "glm5", "glm5_packed_long", "glm5_decode", "glm5_decode_single",
                     "glm5_mostly_empty_packed", "glm5_mostly_empty_decode"]


def mla_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """An MLA_CASES case's bf16 q and kv (seed 0) and causal indices, with its v_dim and D."""
    lens_q, lens_k, H, v_dim, d_r, K, _ = MLA_CASES[name]
    torch.manual_seed(0)
    D = v_dim + d_r
    q = torch.randn(sum(lens_q), H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(sum(lens_k), D, device="cuda", dtype=torch.bfloat16)
    return q, kv, causal_rows(lens_q, lens_k, K), v_dim, D


def fwd_case_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """mla_inputs of a case, or "glm5_scattered_empty": glm5 with 80% of slots -1 anywhere and a row without keys."""
    if name != "glm5_scattered_empty":
        return mla_inputs(name)
    q, kv, indices, v_dim, D = mla_inputs("glm5")
    indices = scatter_empty(indices, keep=0.2)
    indices[0] = -1
    return q, kv, indices, v_dim, D


def fwd_mismatch(out, lse, ref_out, ref_lse) -> str | None:
    """Why a forward's (out, lse) fails the tolerances against the reference, or None: rows without keys must give
    lse -inf and out 0."""
    has = torch.isfinite(ref_lse)
    err_out = rel_l2(out, ref_out)
    err_lse = (lse[has] - ref_lse[has]).abs().max().item() if has.any() else 0.0
    if torch.equal(torch.isfinite(lse), has) and (out[~has] == 0).all() and err_out <= REL_L2 and err_lse <= 1e-3:
        return None
    return f"out rel L2 {err_out:.2e}, lse {err_lse:.2e}"


@pytest.mark.parametrize("name", FWD_VARIANT_CASES + ["glm5_scattered_empty"])
def test_sparse_mla_fwd_variants_match_reference(name, monkeypatch):
    """Every forward variant, at the first of its configs that compiles and fits, against the torch reference; a
    variant with no config that compiles is listed, not failed (benchmarks/sparse_mla_fwd_variants.py reports it)."""
    from slime_dsa.ops import triton_sparse_mla as mla
    from slime_dsa.ops.triton_sparse_mla_fwd_variants import VARIANTS

    q, kv, indices, v_dim, D = fwd_case_inputs(name)
    ref_out, ref_lse = reference.sparse_mla_attention(q.float(), kv.float(), indices, D**-0.5, v_dim)
    failed, uncompiled = [], []
    for variant in VARIANTS:
        monkeypatch.setattr(mla, "FWD_VARIANT", variant)
        try:
            with torch.no_grad():
                out, lse = mla.sparse_mla_attention(q, kv, indices, D**-0.5, v_dim)
        except RuntimeError as err:
            if "no fwd kernel config fits" not in str(err):
                raise
            uncompiled.append(variant)
            continue
        if (mismatch := fwd_mismatch(out, lse, ref_out, ref_lse)) is not None:
            failed.append(f"{variant}: {mismatch}")
    assert not failed, failed
    if uncompiled:
        print(f"{name}: no config of {uncompiled} compiles here")
    assert len(uncompiled) < len(VARIANTS)


GLUON_FWD_CASES = ["glm5", "glm5_packed_long", "glm5_decode", "glm5_decode_single", "glm5_mostly_empty_packed",
                   "glm5_mostly_empty_decode", "glm5_scattered_empty"]


@pytest.mark.parametrize("name", GLUON_FWD_CASES)
def test_gluon_sparse_mla_fwd_matches_reference(name):
    """The Gluon forward (slime_dsa/ops/gluon_sparse_mla.py) at each of its configs against the torch reference at
    GLM-5 sizes, rows of mostly -1 slots and rows without keys included."""
    gluon_mla = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla", exc_type=ImportError)
    q, kv, indices, v_dim, D = fwd_case_inputs(name)
    if not gluon_mla.supported(q, kv, indices, v_dim):
        pytest.skip("the Gluon forward needs sm_90")
    ref_out, ref_lse = reference.sparse_mla_attention(q.float(), kv.float(), indices, D**-0.5, v_dim)
    failed = []
    for config in gluon_mla.CONFIGS:  # every config: the benchmark may make any of them the default
        out, lse = gluon_mla.sparse_mla_fwd(q, kv, indices, D**-0.5, v_dim, config=config)
        if (mismatch := fwd_mismatch(out, lse, ref_out, ref_lse)) is not None:
            failed.append(f"{config}: {mismatch}")
    assert not failed, failed


@pytest.mark.parametrize("name", ["glm5", "glm5_mostly_empty_packed", "glm5_scattered_empty"])
def test_gluon_sparse_mla_bwd_matches_reference(name):
    """The Gluon backward (slime_dsa/ops/gluon_sparse_mla_bwd.py), dQ and dKV apart and in one kernel, against the
    torch reference's gradients, with the lse and delta of the reference forward (rows of mostly -1 slots and a row
    without keys included)."""
    gluon_bwd = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla_bwd", exc_type=ImportError)
    q, kv, indices, v_dim, D = fwd_case_inputs(name)
    dout = torch.randn(q.shape[0], q.shape[1], v_dim, device="cuda", dtype=torch.bfloat16)
    if not gluon_bwd.supported(q, kv, indices, dout, v_dim):
        pytest.skip("the Gluon backward needs sm_90")
    q32, kv32 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, D**-0.5, v_dim)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout.float()).sum(), (q32, kv32))
    delta = (ref_out.detach() * dout.float()).sum(-1)
    failed, dkv_by_width = [], {}
    for do_dq, do_dkv, late_dq, width in ((True, False, False, 1), (False, True, False, 1), (True, True, False, 1),
                                          (True, True, True, 1), (True, True, False, 2), (True, True, False, 4),
                                          (False, True, False, "staged"), (True, True, False, "staged")):
        dq = torch.zeros_like(q) if do_dq else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda") if do_dkv else None
        gluon_bwd.sparse_mla_bwd(q, kv, indices, dout, ref_lse.detach(), delta, D**-0.5, dq, dkv, late_dq=late_dq,
                                 reduction_width=None if width == "staged" else width,
                                 staged_reductions=width == "staged")
        what = f"dq {do_dq} dkv {do_dkv} late dq {late_dq} reduction width {width}"
        for name_, got, want in (("dq", dq, ref_dq), ("dkv", dkv, ref_dkv)):
            if got is not None and rel_l2(got, want) > REL_L2:
                failed.append(f"{what}: {name_} rel L2 {rel_l2(got, want):.2e}")
        if do_dq and do_dkv and not late_dq:
            dkv_by_width[width] = dkv
    for width in (2, 4, "staged"):  # the same sums as width 1 but for the order of the atomics
        if (err := rel_l2(dkv_by_width[width], dkv_by_width[1])) > 1e-5:
            failed.append(f"reduction width {width}: dkv differs from width 1's by rel L2 {err:.2e}")
    assert not failed, failed


@pytest.mark.parametrize("name", ["glm5_packed_long", "glm5_decode"])
def test_sparse_mla_default_forward_choice(name, monkeypatch):
    """The Triton forward runs PREFILL_FWD_VARIANT at GLM-5 prefill and the plain kernel at decode; either way its
    output is the plain kernel's within bf16 tolerance (the Gluon forward, which prefill takes first on sm_90, is
    off here: test_gluon_sparse_mla_fwd_matches_reference checks it)."""
    from slime_dsa.ops import triton_sparse_mla as mla

    monkeypatch.setattr(mla, "GLUON_FWD", False)

    q, kv, indices, v_dim, D = mla_inputs(name)
    for key in [k for k in mla._chosen if k[0] == "fwd"]:
        del mla._chosen[key]  # only this call's choices remain to be read
    with torch.no_grad():
        out, lse = mla.sparse_mla_attention(q, kv, indices, D**-0.5, v_dim)
        ran = {key[-1] if isinstance(key[-1], str) else None for kind, key in mla._chosen if kind == "fwd"}
        monkeypatch.setattr(mla, "FWD_VARIANT", mla.PLAIN_FWD)
        plain_out, plain_lse = mla.sparse_mla_attention(q, kv, indices, D**-0.5, v_dim)
    assert ran == ({mla.PREFILL_FWD_VARIANT} if name == "glm5_packed_long" else {None}), ran
    has = torch.isfinite(plain_lse)
    assert torch.equal(torch.isfinite(lse), has) and rel_l2(out, plain_out) <= REL_L2
    assert (lse[has] - plain_lse[has]).abs().max().item() <= 1e-3


def test_dispatcher_uses_triton_on_cuda():
    q = torch.randn(8, 16, 96, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(8, 96, device="cuda", dtype=torch.bfloat16)
    idx = causal_rows([8], [8], 4)
    ops.set_backend("triton")
    try:
        out, _ = ops.sparse_mla_attention(q, kv, idx, 0.1, 64)
    finally:
        ops.set_backend("auto")
    ref_out, _ = reference.sparse_mla_attention(q.float(), kv.float(), idx, 0.1, 64)
    assert rel_l2(out, ref_out) <= REL_L2


# ----------------------------------------------------------------------------------------------
# Indexer top-k

TOPK_CASES = {
    # lens_q, lens_k, Hi, Di, topk
    "packed_short_topk_gt_prefix": ([5, 100, 3000], [5, 100, 3000], 8, 64, 256),
    "tq_lt_tk": ([3, 7, 1], [500, 4000, 100], 4, 32, 64),
    "glm5_packed": ([6000, 2500], [6000, 2500], 32, 128, 2048),
    "glm5_decode": ([1] * 16, [1, 100, 2047, 2048, 2049, 5000, 20000, 7] + [3000] * 8, 32, 128, 2048),
    "glm5_decode_long": ([1] * 4, [65536, 70000, 3000, 100000], 32, 128, 2048),
}


def _assert_topk_conventions(got: torch.Tensor, lens_q, lens_k, topk):
    """Ascending causal positions, then -1 padding, min(topk, prefix) of them."""
    pos = reference._query_positions(_cu(lens_q), _cu(lens_k))[1]  # (Tq,)
    filled = torch.arange(topk, device="cuda")[None, :] < torch.clamp(pos + 1, max=topk)[:, None]  # (Tq, topk)
    assert torch.equal(got >= 0, filled), "wrong number of selected keys or bad -1 padding"
    assert ((got[:, 1:] > got[:, :-1]) | ~filled[:, 1:]).all(), "positions not strictly ascending"
    assert (got <= pos[:, None]).all(), "non-causal key selected"


def _assert_is_topk(got, q, k, w, lens_q, lens_k, topk, scale):
    """got selects a top-k set of the float32 reference scores, up to rounding; nearly equal to the reference."""
    want = reference.indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, scale)
    mismatch = (got != want).float().mean().item()
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        scores = torch.cat([  # (lq, lk), in query chunks to bound the (rows, Hi, lk) intermediate
            reference.indexer_scores(q[c : min(c + 512, q0 + lq)], k[k0 : k0 + lk], w[c : min(c + 512, q0 + lq)], scale)
            for c in range(q0, q0 + lq, 512)
        ])
        pos = torch.arange(lk - lq, lk, device="cuda")
        causal = torch.arange(lk, device="cuda")[None, :] <= pos[:, None]
        g = got[q0 : q0 + lq]
        sel = torch.zeros(causal.shape, device="cuda").scatter_add_(1, g.clamp(min=0), (g >= 0).float()) > 0
        tol = 1e-5 * scores.abs().amax(-1) + 1e-6
        min_in = scores.masked_fill(~sel, float("inf")).amin(-1)
        max_out = scores.masked_fill(sel | ~causal, float("-inf")).amax(-1)
        assert (min_in >= max_out - tol).all(), "selected set is not a top-k set"
        q0, k0 = q0 + lq, k0 + lk
    assert mismatch <= 1e-3, f"{mismatch:.2e} of slots differ from the reference"


@pytest.mark.parametrize("name", list(TOPK_CASES))
def test_indexer_topk_matches_reference(name):
    lens_q, lens_k, Hi, Di, topk = TOPK_CASES[name]
    torch.manual_seed(1)
    q = torch.randn(sum(lens_q), Hi, Di, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), Di, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(sum(lens_q), Hi, device="cuda") * Hi**-0.5
    got = _kernels().indexer_topk(q, k, w, _cu(lens_q), _cu(lens_k), topk, Di**-0.5)
    _assert_topk_conventions(got, lens_q, lens_k, topk)
    _assert_is_topk(got, q, k, w, lens_q, lens_k, topk, Di**-0.5)


@pytest.mark.parametrize("Hi,Di", [(32, 128), (4, 16)])
def test_indexer_topk_tie_rule_exact(Hi, Di):
    """Small integer inputs make every score exact in float32, with many ties: results must be identical."""
    torch.manual_seed(2)
    lens = [700, 1500]
    q = torch.randint(-2, 3, (sum(lens), Hi, Di), device="cuda").bfloat16()
    k = torch.randint(-2, 3, (sum(lens), Di), device="cuda").bfloat16()
    w = torch.randint(-2, 3, (sum(lens), Hi), device="cuda").float()
    got = _kernels().indexer_topk(q, k, w, _cu(lens), _cu(lens), 256, 1.0)
    want = reference.indexer_topk(q, k, w, _cu(lens), _cu(lens), 256, 1.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tied", [False, True])
def test_topk_select_matches_reference(tied):
    """The radix select alone on long rows (decode at 96K), random or heavily tied, any valid prefix: exact."""
    from slime_dsa.ops.triton_topk import topk_select

    g = torch.Generator(device="cuda").manual_seed(6)
    R, W, k = 8, 96 * 1024, 2048
    scores = (torch.randint(-3, 4, (R, W), device="cuda", generator=g).float() if tied
              else torch.randn(R, W, device="cuda", generator=g))
    n_valid = torch.tensor([W, 1, 0, k, k + 1, 5000, W - 1, 70000], device="cuda")
    got = topk_select(scores, n_valid, k)
    valid = torch.arange(W, device="cuda")[None, :] < n_valid[:, None]
    assert torch.equal(got, reference.select_topk(scores, valid, k))


@pytest.mark.parametrize("tied", [False, True])
def test_topk_select_split_matches_reference_in_a_cuda_graph(tied):
    """The split radix select (the paged indexer's, for long rows) on the rows above, at several slice counts, and
    in a CUDA graph."""
    from slime_dsa.ops.triton_topk_split import topk_select_split

    g = torch.Generator(device="cuda").manual_seed(7)
    R, W, k = 8, 96 * 1024, 2048
    scores = (torch.randint(-3, 4, (R, W), device="cuda", generator=g).float() if tied
              else torch.randn(R, W, device="cuda", generator=g))
    assert_long_row_select_exact(topk_select_split, scores, k)


def select_lengths(W: int, k: int) -> torch.Tensor:
    """Ragged row lengths for the long-row selects: full, 1, 0, k, k + 1, 5000, W - 1, 70000."""
    return torch.tensor([W, 1, 0, k, k + 1, 5000, W - 1, 70000], device="cuda")


def assert_long_row_select_exact(select, scores: torch.Tensor, k: int) -> None:
    """A long-row select (`select(scores, n_valid, k, slices=...)`) equals the reference on rows of ragged lengths at
    several slice counts, and in a CUDA graph replayed on new scores in the same buffers."""
    W = scores.shape[1]
    n_valid = select_lengths(W, k)
    valid = torch.arange(W, device="cuda")[None, :] < n_valid[:, None]
    want = reference.select_topk(scores, valid, k)
    for slices in (None, 1, 7, 96):
        assert torch.equal(select(scores, n_valid, k, slices=slices), want), f"slices {slices}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = select(scores, n_valid, k)
    scores.neg_()  # new inputs in the same buffers
    graph.replay()
    assert torch.equal(got, reference.select_topk(scores, valid, k))


def _select_scores(kind: str, rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Random, small-integer (many ties) or decode-like (sum_j w_j relu(q_j . k_n), weights of both signs)."""
    if kind == "tied":
        return torch.randint(-3, 4, (rows, width), device="cuda", generator=g).float()
    if kind == "random":
        return torch.randn(rows, width, device="cuda", generator=g)
    q, k = torch.randn(rows, 32, 128, device="cuda", generator=g), torch.randn(width, 128, device="cuda", generator=g)
    w = torch.randn(rows, 32, device="cuda", generator=g) * 32**-0.5
    return (w[:, :, None] * torch.einsum("rhd,nd->rhn", q, k).clamp_min(0)).sum(1)


@pytest.mark.parametrize("fused_tail", [True, False])
@pytest.mark.parametrize("kind", ["random", "tied", "decode"])
def test_topk_select_sampled_matches_reference_in_a_cuda_graph(kind, fused_tail):
    """`triton_topk_sampled.topk_select_sampled` (one full read of the scores), with either tail, as the split select
    above, and on decode-like scores its rows keep their top k and at most a quarter more than the floor's margin asks
    for (the margin's (mu + 6 sqrt(mu) + 16) / mu: 1.8x at k = 2,048 of 96K)."""
    from functools import partial

    from slime_dsa.ops import triton_topk_sampled as sampled

    g = torch.Generator(device="cuda").manual_seed(8)
    R, W, k = 8, 96 * 1024, 2048
    scores = _select_scores(kind, R, W, g)
    if kind == "decode":
        n_valid = select_lengths(W, k)
        total = sampled.keep_above_floor(scores, n_valid, k, 12, 1024, 4).total
        n = n_valid.clamp(max=W).double()
        k_eff = n.clamp(max=k)
        mu = k_eff * n.clamp(max=sampled.SAMPLE) / n.clamp(min=1)
        margin = (mu + sampled.MARGIN_SIGMAS * mu.sqrt() + sampled.MARGIN_MIN) / mu.clamp(min=1)
        assert bool((total >= k_eff).all() and (total <= (1.25 * margin * k_eff).clamp(min=k_eff)).all()), \
            (total.tolist(), (margin * k_eff).tolist())
    assert_long_row_select_exact(partial(sampled.topk_select_sampled, fused_tail=fused_tail), scores, k)


def _paged_case(B: int, Hi: int, Di: int, integer: bool, seed: int, width: int = 384):
    """Keys scattered over a pool in random slots; per-sequence lengths from 1 to the table width."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pool = max(40_000, B * width)
    draw = (lambda *s: torch.randint(-2, 3, s, device="cuda", generator=g).float()) if integer else \
        (lambda *s: torch.randn(*s, device="cuda", generator=g))
    q, k_pool, w = draw(B, Hi, Di).bfloat16(), draw(pool, Di).bfloat16(), draw(B, Hi) * (1.0 if integer else Hi**-0.5)
    key_slots = torch.randperm(pool, device="cuda", generator=g)[: B * width].view(B, width)
    seq_lens = torch.randint(1, width + 1, (B,), device="cuda", generator=g)
    seq_lens[:3] = torch.tensor([1, 100, width], device="cuda")
    return q, k_pool, w, key_slots, seq_lens


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("batch,width", [(64, 384), (8, 12_000)])  # the wide rows take the split select
def test_indexer_topk_paged_matches_reference(integer, batch, width):
    """Integer inputs: exact scores with many ties, so identical results; random ones: at most 0.1% of slots differ."""
    q, k_pool, w, key_slots, seq_lens = _paged_case(batch, 16, 64, integer, seed=4, width=width)
    scale = 1.0 if integer else 64**-0.5
    got = _kernels().indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, 128, scale)
    want = reference.indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, 128, scale)
    if integer:
        assert torch.equal(got, want)
    else:
        assert torch.equal(got >= 0, want >= 0)
        assert (got != want).float().mean().item() <= 1e-3


def test_indexer_topk_paged_in_a_cuda_graph():
    q, k_pool, w, key_slots, seq_lens = _paged_case(32, 16, 64, False, seed=5)
    kern = _kernels()
    kern.indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, 64, 0.125)  # warms up the kernel outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = kern.indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, 64, 0.125)
    seq_lens.fill_(7)  # new inputs in the same buffers
    graph.replay()
    assert torch.equal(got, kern.indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, 64, 0.125))
    assert ((got >= 0).sum(-1) == 7).all()


# FP8 index keys: float8_e4m3fn rows and one float32 scale per row, the scale applied after the sum over heads.


def _fp8_inputs(rows: int, B: int, Hi: int, Di: int, integer: bool, seed: int):
    """q (B, Hi, Di) bf16, fp8 key values (rows, Di), scales (rows,) float32, w (B, Hi). Integer inputs (small
    integers, power-of-two scales) make every score exact; random keys are quantised as the engine does."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if integer:
        q = torch.randint(-2, 3, (B, Hi, Di), device="cuda", generator=g).bfloat16()
        values = torch.randint(-3, 4, (rows, Di), device="cuda", generator=g).float().to(torch.float8_e4m3fn)
        scales = 2.0 ** torch.randint(-2, 3, (rows,), device="cuda", generator=g).float()
        return q, values, scales, torch.randint(-2, 3, (B, Hi), device="cuda", generator=g).float()
    q = torch.randn(B, Hi, Di, device="cuda", generator=g).bfloat16()
    fp8 = quantize_keys(torch.randn(rows, Di, device="cuda", generator=g))
    values, scales = fp8.values, fp8.scales
    return q, values, scales, torch.randn(B, Hi, device="cuda", generator=g) * Hi**-0.5


def _fp8_scores(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor, w: torch.Tensor,
                scale: float) -> torch.Tensor:
    """score[r, n] = key_scales[.., n] * sum_j w[r, j] scale relu(q[r, j] . keys[.., n]) in float32: q (R, Hi, Di),
    keys (N, Di) or (R, N, Di) float32 holding the fp8 values, key_scales (N,) or (R, N)."""
    dots = torch.einsum("rhd,nd->rhn" if keys.dim() == 2 else "rhd,rnd->rhn", q.float(), keys)
    return key_scales * ((w.float() * scale)[:, :, None] * dots.clamp_min(0)).sum(1)


def _assert_scores_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same -inf entries; the finite ones within rtol 1e-5 / atol 1e-5 (float32 sums in another order)."""
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf entries differ"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("batch,Hi,width", [(16, 64, 2048), (4, 32, 9000)])  # 9000: the split select
def test_indexer_topk_paged_fp8_keys(integer, batch, Hi, width):
    """The paged indexer on fp8 keys: scores match the formula (exactly on integer inputs) and integer inputs, full
    of ties, give the formula's selection exactly."""
    from slime_dsa.ops.triton_indexer_paged import paged_scores

    Di, topk, pool = 128, 256, 40_000
    q, values, key_scales, w = _fp8_inputs(pool, batch, Hi, Di, integer, seed=8)
    g = torch.Generator(device="cuda").manual_seed(9)
    key_slots = torch.randperm(pool, device="cuda", generator=g)[: batch * width].view(batch, width)
    seq_lens = torch.randint(1, width + 1, (batch,), device="cuda", generator=g)
    seq_lens[:4] = torch.tensor([width, 0, 1, 300], device="cuda")
    scale = 1.0 if integer else Di**-0.5
    valid = torch.arange(width, device="cuda")[None, :] < seq_lens[:, None]
    # fp8 lacks some CUDA indexing kernels: gather the keys as float32
    want = _fp8_scores(q, values.float()[key_slots], key_scales[key_slots], w, scale).masked_fill(~valid, float("-inf"))
    got = paged_scores(q, values, w, key_slots, seq_lens, scale, key_scales=key_scales)
    if integer:
        assert torch.equal(got, want)
        sel = _kernels().indexer_topk_paged(q, values, w, key_slots, seq_lens, topk, scale, key_scales=key_scales)
        assert torch.equal(sel, reference.select_topk(want, valid, topk))
    else:
        _assert_scores_close(got, want)


def _packed_scores(q, k, w, lens_q: list[int], lens_k: list[int], topk: int, scale: float, key_scales):
    """The packed kernel's float32 scores (Tq, width) as `indexer_topk` makes them (one chunk at these sizes)."""
    from slime_dsa.ops import triton_indexer as ti

    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    block_m = ti.block_queries(q.shape[1], cu_q)
    (r0, r1, width, blocks), = ti._plan_chunks(cu_q, cu_k, topk, block_m)
    scores = ti.score_rows(r1 - r0, width, q.device)
    ti.launch_scores(q, k, w, scores, blocks, r0, width, scale, block_m, key_scales)
    return scores


FP8_PACKED_CASES = {
    # lens_q, lens_k, Hi
    "decode": ([1] * 12, [1, 100, 2047, 2048, 700, 5, 1500, 129, 256, 257, 1024, 2000], 64),
    "prefill": ([300, 700, 1], [300, 1200, 64], 32),
}


@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("name", list(FP8_PACKED_CASES))
def test_indexer_topk_fp8_keys(name, integer):
    """The packed indexer on fp8 keys: scores match the formula (exactly on integer inputs) and integer inputs give
    the formula's selection exactly."""
    lens_q, lens_k, Hi = FP8_PACKED_CASES[name]
    Di, topk = 128, 256
    q, values, key_scales, w = _fp8_inputs(sum(lens_k), sum(lens_q), Hi, Di, integer, seed=10)
    scale = 1.0 if integer else Di**-0.5
    got = _packed_scores(q, values, w, lens_q, lens_k, topk, scale, key_scales)
    want = torch.full_like(got, float("-inf"))
    pos = reference._query_positions(_cu(lens_q), _cu(lens_k))[1]
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        rows = slice(q0, q0 + lq)
        scores = _fp8_scores(q[rows], values[k0 : k0 + lk].float(), key_scales[k0 : k0 + lk], w[rows], scale)
        causal = torch.arange(lk, device="cuda")[None, :] <= pos[rows, None]
        want[rows, :lk] = scores.masked_fill(~causal, float("-inf"))
        q0, k0 = q0 + lq, k0 + lk
    if integer:
        assert torch.equal(got, want)
        sel = _kernels().indexer_topk(q, values, w, _cu(lens_q), _cu(lens_k), topk, scale, key_scales=key_scales)
        valid = torch.arange(want.shape[1], device="cuda")[None, :] <= pos[:, None]
        assert torch.equal(sel, reference.select_topk(want, valid, topk))
    else:
        _assert_scores_close(got, want)


# ----------------------------------------------------------------------------------------------
# Indexer KL loss

KL_CASES = {
    # lens_q, lens_k, H, D, layers, Hi, Di, topk (0 = dense stage), give lse
    "sparse_small_lse": ([37, 300], [37, 300], 16, 96, 2, 8, 64, 64, True),
    "sparse_small_no_lse": ([5, 60], [90, 200], 4, 40, 3, 3, 20, 32, False),
    "dense_packed": ([200, 700], [200, 700], 16, 96, 2, 8, 64, 0, False),
    "glm5_sparse": ([2048], [2048], 64, 576, 2, 32, 128, 2048, True),
    "glm5_sparse_packed": ([300, 700, 1100], [300, 700, 1100], 64, 576, 2, 32, 128, 2048, True),  # mostly -1 slots
}


@pytest.mark.parametrize("name", list(KL_CASES))
def test_indexer_kl_matches_reference(name):
    lens_q, lens_k, H, D, layers, Hi, Di, topk, give_lse = KL_CASES[name]
    torch.manual_seed(4)
    Tq, Tk = sum(lens_q), sum(lens_k)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(Tq, Hi, Di, **bf).requires_grad_(True)
    ik = torch.randn(Tk, Di, **bf).requires_grad_(True)
    iw = (torch.randn(Tq, Hi, device="cuda") * Hi**-0.5).requires_grad_(True)
    attn_q = [torch.randn(Tq, H, D, **bf) for _ in range(layers)]
    attn_kv = [torch.randn(Tk, D, **bf) for _ in range(layers)]
    rows = causal_rows(lens_q, lens_k, topk, seed=5) if topk else None
    scale, iscale = D**-0.5, Di**-0.5
    lses = None
    if give_lse:
        v_dim = 512 if D == 576 else D // 2
        with torch.no_grad():
            lses = [_kernels().sparse_mla_attention(q, kv, rows, scale, v_dim)[1] for q, kv in zip(attn_q, attn_kv)]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    got = _kernels().indexer_kl_loss(iq, ik, iw, iscale, attn_q, attn_kv, lses, scale, cu_q, cu_k, rows)
    # float32 leaves for the reference: with bf16 leaves autograd would sum d index_k in bf16.
    iq32, ik32, iw32 = (x.detach().float().requires_grad_(True) for x in (iq, ik, iw))
    want = reference.indexer_kl_loss(iq32, ik32, iw32, iscale, attn_q, attn_kv, lses, scale, cu_q, cu_k, rows)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    g = torch.rand_like(got)
    grads = torch.autograd.grad((got * g).sum(), (iq, ik, iw))
    ref_grads = torch.autograd.grad((want * g).sum(), (iq32, ik32, iw32))
    for label, x, ref in zip(("d index_q", "d index_k", "d index_weights"), grads, ref_grads):
        assert rel_l2(x, ref) <= REL_L2, f"{label} rel L2 {rel_l2(x, ref):.2e}"


@pytest.mark.parametrize("lens", [[3000], [300, 700, 1100]])
def test_indexer_kl_target_gluon_equals_triton(lens, monkeypatch):
    """The sparse stage's target p_bar through gluon_attn_probs and through the Triton kernel, GLM-5's MLA."""
    from slime_dsa.ops import triton_indexer_loss as loss  # noqa: PLC0415

    torch.manual_seed(6)
    T = sum(lens)
    q = torch.randn(T, 64, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, 576, device="cuda", dtype=torch.bfloat16)
    rows = causal_rows(lens, lens, 2048, seed=7)
    with torch.no_grad():
        lse = _kernels().sparse_mla_attention(q, kv, rows, 576**-0.5, 512)[1]
    plan = loss._Plan(_cu(lens), _cu(lens), rows, T, q.device)
    assert loss._gluon_probs(q, kv, rows, lse) is not None
    targets = []
    for gluon in (True, False):
        monkeypatch.setattr(loss, "GLUON_PROBS", gluon)
        targets.append(loss._target(plan, 0, T, rows.shape[1], [q], [kv], [lse], 576**-0.5))
    torch.testing.assert_close(targets[0], targets[1], atol=1e-6, rtol=1e-4)
    assert (targets[0][rows < 0] == 0).all()


@pytest.mark.parametrize("index_topk", [64, 512])  # 512 > every length: dense selection, key-range backward
def test_model_forward_backward_triton_matches_torch(index_topk):
    """The whole model on CUDA with ops backend triton agrees with the torch reference path (bf16)."""
    from slime_dsa.checkpoint import build_model
    from slime_dsa.models import ModelConfig, PackedBatch

    config = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=16, q_lora_rank=192, kv_lora_rank=128,
                         qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8,
                         num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=8, index_head_dim=64,
                         index_topk=index_topk, indexer_types=["full", "shared", "full", "shared"], eos_token_id=None)
    model = build_model(config, dtype="bfloat16", device="cuda", seed=0)
    ids = torch.randint(0, 512, (700,), device="cuda")
    batch = PackedBatch.from_seqlens([300, 250, 150], "cuda")
    results = {}
    try:
        for backend in ("torch", "triton"):
            ops.set_backend(backend)
            model.zero_grad(set_to_none=True)
            logp, _ = model.token_logprobs(ids, batch)
            logp.sum().backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            results[backend] = (logp.detach().float(), grads)
    finally:
        ops.set_backend("auto")
    assert rel_l2(results["triton"][0], results["torch"][0]) <= 2e-2
    assert rel_l2(results["triton"][1], results["torch"][1]) <= 5e-2

"""Batch-invariant sparse MLA and DSA indexer on the Triton path (slime_dsa/ops/triton_invariant.py, issue 23).

A row's bits must not depend on its batch: attention's out and lse of row r computed among T rows (T = 1, 7, 64, 256,
1000), alone, through a wider index table, and through the decode entry (the same keys in scattered pool slots) are
the same bits; the indexer's scores and top-k of a query are the same in a packed prefill/training batch, in an
engine prefill after a cached prefix (queries the last rows of their sequence), alone, and at decode against a paged
pool. And the results are close to the torch reference (tests/test_ops_gpu.py's bf16 tolerances).

On CPU the checks run in Triton's interpreter at tiny shapes in float32 (the interpreter is chosen when a kernel is
defined, so in a child process); on CUDA at the shapes of recipes/gpu_single.yaml's `small` preset and the 300m
preset (attention 12 / 16 heads over kv_lora 256 + rope 32, indexer 16 heads of 64, top-k 256) in bf16 (`gpu`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.test_invariant_kernels import _rel_l2, _same_bits, run_in_interpreter

ROOT = Path(__file__).resolve().parents[1]
REL_L2 = 1e-2  # tests/test_ops_gpu.py's bf16 tolerance for sparse MLA's out; lse within 1e-3


def _inv():
    from slime_dsa.ops import triton_invariant  # noqa: PLC0415 (imports triton)

    return triton_invariant


def _cu(lens: list[int], device: str) -> torch.Tensor:
    return F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(device)


# ----------------------------------------------------------------------------------------------
# Sparse MLA


def _attention_case(rows: int, H: int, d_v: int, d_r: int, topk: int, dtype, device: str, seed: int):
    """q (rows, H, D), kv (Tk, D) and a top-k table (rows, topk): ascending distinct key rows then -1, a row's key
    count anywhere in 0..topk (a third of the rows mostly -1), and a few rows with -1 holes among their keys."""
    g = torch.Generator().manual_seed(seed)
    D, Tk = d_v + d_r, 3 * topk
    q = torch.randn(rows, H, D, generator=g).to(device, dtype)
    kv = torch.randn(Tk, D, generator=g).to(device, dtype)
    counts = torch.randint(0, topk + 1, (rows,), generator=g)
    counts[: rows // 3] = torch.randint(0, max(2, topk // 16), (rows // 3,), generator=g)  # mostly -1
    counts[-1] = topk
    table = torch.full((rows, topk), -1, dtype=torch.long)
    for r in range(rows):
        keys = torch.randperm(Tk, generator=g)[: int(counts[r])].sort().values
        table[r, : len(keys)] = keys
    holes = torch.rand(rows, topk, generator=g) < 0.1
    holes[: rows - rows // 10] = False  # the last tenth of the rows have holes
    table = table.masked_fill(holes, -1)
    return q, kv, table.to(device), D**-0.5


def check_attention(device: str, dtype, H: int, d_v: int, d_r: int, topk: int, sizes: list[int], seed: int = 0) -> None:
    """Row r of out/lse: the same bits in every batch, alone, through a wider table and through pool slots."""
    inv = _inv()
    rows = max(sizes)
    q, kv, table, scale = _attention_case(rows, H, d_v, d_r, topk, dtype, device, seed)
    what = f"mla_attention {dtype} H={H} D={d_v}+{d_r} topk={topk}"
    out, lse = inv.mla_attention(q, kv, table, scale, d_v)
    g = torch.Generator().manual_seed(seed + 1)
    for T in sizes:
        pick = torch.randperm(rows, generator=g)[:T].to(device)
        o, l_ = inv.mla_attention(q[pick], kv, table[pick], scale, d_v)
        assert _same_bits(o, out[pick]) and _same_bits(l_, lse[pick]), f"{what}: {T} rows in a batch differ"
    for r in (0, rows // 2, rows - 1):
        o, l_ = inv.mla_attention(q[r : r + 1], kv, table[r : r + 1], scale, d_v)
        assert _same_bits(o, out[r : r + 1]) and _same_bits(l_, lse[r : r + 1]), f"{what}: row {r} alone differs"
    wide = F.pad(table, (0, 100), value=-1)  # another batch's wider top-k table
    o, l_ = inv.mla_attention(q, kv, wide, scale, d_v)
    assert _same_bits(o, out) and _same_bits(l_, lse), f"{what}: a wider index table changes bits"
    # Decode: the same key rows at scattered slots of a larger pool (the paged KV cache), read in place.
    pool_rows = 4 * kv.shape[0]
    slot_of = torch.randperm(pool_rows, generator=g)[: kv.shape[0]].to(device)
    pool = torch.randn(pool_rows, kv.shape[1], generator=g).to(device, dtype)
    pool[slot_of] = kv
    slots = torch.where(table >= 0, slot_of[table.clamp(min=0)], -1)
    for T in (1, min(7, rows), rows):
        o, l_ = inv.mla_attention(q[-T:], pool, slots[-T:], scale, d_v)
        assert _same_bits(o, out[-T:]) and _same_bits(l_, lse[-T:]), f"{what}: decode through pool slots differs"
    from slime_dsa.ops import reference  # noqa: PLC0415

    ref_out, ref_lse = reference.sparse_mla_attention(q.float(), kv.float(), table, scale, d_v)
    has = (table >= 0).any(1)
    assert _rel_l2(out[has], ref_out[has]) <= REL_L2, f"{what}: out rel L2 {_rel_l2(out[has], ref_out[has]):.2e}"
    assert (lse[has] - ref_lse[has]).abs().max().item() <= 1e-3, f"{what}: lse"


def check_attention_gradient(device: str, dtype, H: int, d_v: int, d_r: int, topk: int) -> None:
    """The trainer back-propagates through it: the Triton backward, close to the reference's gradients."""
    from slime_dsa.ops import reference  # noqa: PLC0415

    q, kv, table, scale = _attention_case(64, H, d_v, d_r, topk, dtype, device, seed=5)
    has = (table >= 0).any(1)  # rows without keys have lse -inf
    q, table = q[has].contiguous().requires_grad_(), table[has]
    kv = kv.requires_grad_()
    out, lse = _inv().mla_attention(q, kv, table, scale, d_v)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, table, scale, d_v)
    g = torch.Generator().manual_seed(6)
    dout, dlse = torch.randn(out.shape, generator=g).to(device), torch.randn(lse.shape, generator=g).to(device)
    dq, dkv = torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (q, kv))
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q32, kv32))
    assert _rel_l2(dq, ref_dq) <= REL_L2 and _rel_l2(dkv, ref_dkv) <= REL_L2, (
        f"gradients: dq {_rel_l2(dq, ref_dq):.2e}, dkv {_rel_l2(dkv, ref_dkv):.2e}")


# ----------------------------------------------------------------------------------------------
# Indexer


def check_indexer(device: str, dtype, Hi: int, Di: int, topk: int, lens: list[int], seed: int = 0) -> None:
    """A query's scores and top-k: training pack, another pack order, engine prefill after a cached prefix, alone,
    and paged decode all give the same bits; close to the reference."""
    from slime_dsa.ops import reference  # noqa: PLC0415

    inv = _inv()
    from slime_dsa.ops import triton_indexer_invariant as tii  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, Hi, Di, generator=g).to(device, dtype)
    k = torch.randn(T, Di, generator=g).to(device, dtype)
    w = (torch.randn(T, Hi, generator=g) * Hi**-0.5).to(device)
    scale = Di**-0.5
    cu = _cu(lens, device)
    what = f"indexer {dtype} Hi={Hi} Di={Di} topk={topk} lens={lens}"
    scores = tii.indexer_scores(q, k, w, cu, cu, scale)  # (T, max len)
    top = inv.indexer_topk(q, k, w, cu, cu, topk, scale)
    starts = cu[:-1].tolist()

    def seq_rows(i: int) -> slice:
        return slice(starts[i], starts[i] + lens[i])

    # Another pack: the sequences reversed, so every query sits at another row among other neighbours.
    order = list(range(len(lens)))[::-1]
    idx = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in order]).to(device)
    cu_rev = _cu([lens[i] for i in order], device)
    if device == "cuda":  # the top-k is a function of a row's scores, compared below; slow in the interpreter
        top_rev = inv.indexer_topk(q[idx], k[idx], w[idx], cu_rev, cu_rev, topk, scale)
        assert torch.equal(top_rev, top[idx]), f"{what}: top-k changes with the pack"
    sc_rev = tii.indexer_scores(q[idx], k[idx], w[idx], cu_rev, cu_rev, scale)
    for j, i in enumerate(order):
        r, r_rev = seq_rows(i), slice(int(cu_rev[j]), int(cu_rev[j]) + lens[i])
        assert _same_bits(sc_rev[r_rev, : lens[i]], scores[r, : lens[i]]), f"{what}: scores of sequence {i} change"
    # Engine prefill after a cached prefix: the last q_len queries of each sequence against all of its keys.
    q_lens = [max(1, n // 3) for n in lens]
    q_idx = torch.cat([torch.arange(starts[i] + lens[i] - q_lens[i], starts[i] + lens[i]) for i in range(len(lens))])
    q_idx = q_idx.to(device)
    top_pre = inv.indexer_topk(q[q_idx], k, w[q_idx], _cu(q_lens, device), cu, topk, scale)
    assert torch.equal(top_pre, top[q_idx]), f"{what}: prefill after a cached prefix differs"
    # Alone: one sequence's last query as a one-query prefill.
    i = len(lens) - 1
    last = starts[i] + lens[i] - 1
    one = inv.indexer_topk(q[last : last + 1], k[seq_rows(i)], w[last : last + 1], _cu([1], device),
                           _cu([lens[i]], device), topk, scale)
    assert torch.equal(one, top[last : last + 1]), f"{what}: a query alone differs"
    # Paged decode: each sequence's keys at scattered pool slots, one query per sequence at several positions.
    pool_rows, block = 4 * T, 16
    perm = torch.randperm(pool_rows, generator=g).to(device)
    k_pool = torch.randn(pool_rows, Di, generator=g).to(device, dtype)
    k_pool[perm[:T]] = k
    width = -(-max(lens) // block) * block * 2  # scratch-padded table, wider than any sequence
    rows_q, slot_rows, seq_lens = [], [], []
    for i, n in enumerate(lens):
        for p in sorted({0, n // 2, n - 1}):
            rows_q.append(starts[i] + p)
            slot = torch.full((width,), int(perm[-1]), dtype=torch.long, device=device)  # padding: any slot
            slot[:n] = perm[starts[i] : starts[i] + n]
            slot_rows.append(slot)
            seq_lens.append(p + 1)
    rows_q_t = torch.tensor(rows_q, device=device)
    key_slots, seq_lens_t = torch.stack(slot_rows), torch.tensor(seq_lens, device=device)
    paged_scores = tii.indexer_scores_paged(q[rows_q_t], k_pool, w[rows_q_t], key_slots, seq_lens_t, scale)
    paged_top = inv.indexer_topk_paged(q[rows_q_t], k_pool, w[rows_q_t], key_slots, seq_lens_t, topk, scale)
    for b, (r, n) in enumerate(zip(rows_q, seq_lens)):
        assert _same_bits(paged_scores[b, :n], scores[r, :n]), f"{what}: decode scores of row {r} differ"
        assert torch.isinf(paged_scores[b, n:]).all()
    assert torch.equal(paged_top, top[rows_q_t]), f"{what}: decode top-k differs from the packed forward"
    # Close to the reference: scores within float32-of-bf16 rounding, top-k mostly the same slots.
    for i in range(len(lens)):
        r = seq_rows(i)
        ref = reference.indexer_scores(q[r].float(), k[r].float(), w[r], scale)  # (n, n)
        got = scores[r][:, : lens[i]]
        ok = torch.ones(lens[i], lens[i], dtype=torch.bool, device=device).tril()  # causal
        tol = 1e-2 * ref.abs().amax() + 1e-5
        assert ((got - ref).abs()[ok] <= tol).all(), f"{what}: scores far from the reference"
        assert (got[~ok] == float("-inf")).all(), f"{what}: non-causal scores are not -inf"
    want = reference.indexer_topk(q, k, w, cu, cu, topk, scale)
    assert torch.equal(top >= 0, want >= 0), f"{what}: selected-key counts differ from the reference"
    assert (top != want).float().mean().item() <= 1e-3, f"{what}: {(top != want).float().mean().item():.2e} differ"


def check_paged_decode_in_a_cuda_graph(Hi: int = 16, Di: int = 64, topk: int = 256) -> None:
    """The paged top-k and the attention forward captured in a CUDA graph give the eager bits: no host sync."""
    inv = _inv()
    g = torch.Generator().manual_seed(9)
    B, width, pool_rows, H, d_v, d_r = 64, 1024, 80_000, 12, 256, 32
    q = torch.randn(B, Hi, Di, generator=g).cuda().bfloat16()
    k_pool = torch.randn(pool_rows, Di, generator=g).cuda().bfloat16()
    w = torch.randn(B, Hi, generator=g).cuda()
    key_slots = torch.randperm(pool_rows, generator=g)[: B * width].view(B, width).cuda()
    seq_lens = torch.randint(1, width + 1, (B,), generator=g).cuda()
    aq = torch.randn(B, H, d_v + d_r, generator=g).cuda().bfloat16()
    kv_pool = torch.randn(pool_rows, d_v + d_r, generator=g).cuda().bfloat16()

    def step():
        top = inv.indexer_topk_paged(q, k_pool, w, key_slots, seq_lens, topk, Di**-0.5)
        rows = torch.where(top >= 0, key_slots.gather(1, top.clamp(min=0)), -1)
        return top, *inv.mla_attention(aq, kv_pool, rows, 0.06, d_v)

    step()  # compiles outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    seq_lens.copy_(torch.randint(1, width + 1, (B,), generator=g).cuda())  # new inputs in the same buffers
    graph.replay()
    for got, want in zip(captured, step()):
        assert _same_bits(got, want), "a replayed graph differs from the eager call"


# ----------------------------------------------------------------------------------------------
# CPU


def test_invariant_mode_is_graph_safe_only_with_its_kernels(monkeypatch):
    """Decode graphs in the mode need the kernels that wait on no host: grouped experts, attention, paged indexer."""
    from types import SimpleNamespace  # noqa: PLC0415

    from slime_dsa.checkpoint import build_model  # noqa: PLC0415
    from slime_dsa.models.presets import preset_config  # noqa: PLC0415
    from slime_dsa.ops import invariant  # noqa: PLC0415

    model = build_model(preset_config("tiny", 97), seed=0)
    kernels = dict(grouped_linear=None, mla_attention=None, indexer_topk_paged=None)
    with invariant.enabled(True):
        assert not model.graph_safe()  # CPU: the mode's torch path reads key widths and expert counts on the host
        monkeypatch.setattr(invariant, "_gpu", lambda x: SimpleNamespace(**kernels))
        assert model.graph_safe()
        for missing in kernels:
            monkeypatch.setattr(invariant, "_gpu", lambda x, m=missing: SimpleNamespace(
                **{k: v for k, v in kernels.items() if k != m}))
            assert not model.graph_safe(), missing


@pytest.mark.slow  # ~5 s of CPU: Triton's compiler for sm90, no GPU needed
def test_packed_and_paged_scoring_compile_to_one_layout():
    """The indexer's packed and paged variants differ only in how they address keys: compiled for an H100 / H200,
    their tensor-core and reduction layouts are the same (so are the sums they run in that layout)."""
    pytest.importorskip("triton")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from slime_dsa.ops import triton_indexer_invariant as tii  # noqa: PLC0415

    fn = tii._invariant_scores_kernel
    args = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*bf16", slots_ptr="*i64", key_start_ptr="*i64",
                n_keys_ptr="*i64", scores_ptr="*fp32", row0="i64", width="i32", stride_slots="i32",
                stride_scores="i32", scale="fp32")
    layouts = {}
    for paged in (False, True):
        consts = dict(HI=16, DI=64, BLOCK_HI=16, BLOCK_DI=64, BLOCK_N=tii.BLOCK_N, PAGED=paged)
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, ty in args.items() if ty.startswith("*")}
        src = ASTSource(fn, {**args, **{c: "constexpr" for c in consts}}, consts, aligned)
        ir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ttgir"]
        layouts[paged] = [line for line in ir.splitlines() if line.startswith("#mma") or line.startswith("#linear")]
        assert any(line.startswith("#mma") for line in layouts[paged])
    assert layouts[False] == layouts[True]


# Triton's interpreter at tiny shapes, float32 (its bf16 dot is not faithful)


def run_interpret_checks() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    torch.set_num_threads(1)
    # tiny preset's attention (2 heads, 16 + 8 dims; BLOCK_N 64, so topk 80 crosses a key block) and indexer
    check_attention("cpu", torch.float32, H=2, d_v=16, d_r=8, topk=80, sizes=[1, 7, 20])
    check_indexer("cpu", torch.float32, Hi=4, Di=16, topk=16, lens=[1, 5, 70])
    print("invariant attention and indexer checks passed (interpreter)")


def test_invariant_attention_and_indexer_in_the_interpreter():
    run_in_interpreter("tests.test_invariant_attention")


# ----------------------------------------------------------------------------------------------
# CUDA: the presets' shapes in bf16

SIZES = [1, 7, 64, 256, 1000]


@pytest.mark.gpu
@pytest.mark.parametrize("H", [12, 16], ids=["small", "300m"])
def test_attention_rows_are_batch_invariant_on_cuda(H):
    check_attention("cuda", torch.bfloat16, H=H, d_v=256, d_r=32, topk=256, sizes=SIZES)


@pytest.mark.gpu
def test_attention_gradient_on_cuda():
    check_attention_gradient("cuda", torch.bfloat16, H=12, d_v=256, d_r=32, topk=256)


@pytest.mark.gpu
def test_indexer_is_batch_invariant_on_cuda():
    check_indexer("cuda", torch.bfloat16, Hi=16, Di=64, topk=256, lens=[1, 7, 64, 256, 300, 1000, 2100])


@pytest.mark.gpu
def test_paged_decode_in_a_cuda_graph():
    check_paged_decode_in_a_cuda_graph()


@pytest.mark.gpu
def test_invariant_mode_dispatches_to_triton_on_cuda():
    """ops.* in invariant mode take triton_invariant's kernels on CUDA (whatever the ops backend), and the model's
    experts report graph-safe there, so engines decode in CUDA graphs."""
    from slime_dsa import ops  # noqa: PLC0415
    from slime_dsa.ops import invariant  # noqa: PLC0415

    q, kv, table, scale = _attention_case(9, 12, 256, 32, 256, torch.bfloat16, "cuda", seed=3)
    before = ops.get_backend()
    try:
        ops.set_backend("torch")
        with invariant.enabled(True):
            out, lse = ops.sparse_mla_attention(q, kv, table, scale, 256)
            assert invariant.graph_safe(q)
    finally:
        ops.set_backend(before)
    want = _inv().mla_attention(q, kv, table, scale, 256)
    assert _same_bits(out, want[0]) and _same_bits(lse, want[1])

"""The Gluon sparse MLA kernels' own code run on CPU by a FAKE Gluon (tools/gluon_emulator.py), against the torch
reference: indexing, masks, -1 slots, rows without keys, the end at a row's last used slot, the host wrappers' strides,
the 64-bit row path, and the cp.async / wgmma schedule under each timing of its asynchronous work. Layouts, warps
and barriers are not modelled: tests/test_ops_gpu.py checks the kernels on sm_90."""

from __future__ import annotations

import pytest
import torch

from slime_dsa.ops import reference

pytest.importorskip("triton.experimental.gluon")
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait  # noqa: E402

from tools.gluon_emulator import ALL_TIMINGS, EmulatedKernel, Timing  # noqa: E402

REL_L2 = 1e-2  # tests/test_ops_gpu.py's bf16 tolerance
D_V, D_R = 512, 64


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _inputs(T: int = 6, H: int = 128, Tk: int = 150, K: int = 100, seed: int = 0):
    """bf16 q (T, H, 576) and kv (Tk, 576) as strided views, and indices (T, K) whose rows are: all slots used, no slot
    used, a prefix of 10, 20% of slots scattered, only the last slot, and all but the first 33; keys are shared
    between rows (so dKV sums over queries)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H + 8, D_V + D_R, generator=g).to(torch.bfloat16)[:, 4:H + 4]  # stride(1) != row size
    kv = torch.randn(Tk, D_V + D_R + 64, generator=g).to(torch.bfloat16)[:, :D_V + D_R]  # a pool's rows: stride 640
    rows = torch.stack([torch.randperm(Tk, generator=g)[:K] for _ in range(T)])
    slot = torch.arange(K)
    keep = torch.stack([slot >= 0, slot < 0, slot < 10, torch.rand(K, generator=g) < 0.2, slot == K - 1, slot >= 33])
    indices = torch.where(keep[torch.arange(T) % len(keep)], rows, -1)
    return q, kv, indices


FWD_KERNELS = ("_sparse_mla_fwd_kernel", "_sparse_mla_fwd_ws_kernel")  # the plain and the warp-specialised one


def _forward(module, timing: Timing, overrides: dict | None, monkeypatch, *args, **kwargs):
    kernels = {name: EmulatedKernel(getattr(module, name), timing, overrides) for name in FWD_KERNELS}
    for name, kernel in kernels.items():
        monkeypatch.setattr(module, name, kernel)
    out = module.sparse_mla_fwd(*args, **kwargs)
    monkeypatch.undo()
    assert sum(kernel.launches for kernel in kernels.values()) == 1
    return out


@pytest.mark.parametrize("timing", ALL_TIMINGS, ids=lambda t: f"copies@{t.copies_land}-mma@{t.mma_reads}")
def test_gluon_forward_matches_reference_under_every_timing(timing, monkeypatch):
    gluon_mla = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla", exc_type=ImportError)
    q, kv, indices = _inputs(Tk=400, K=300)  # 5-10 steps a row: every buffer refilled
    scale = (D_V + D_R) ** -0.5
    ref_out, ref_lse = reference.sparse_mla_attention(q.float(), kv.float(), indices, scale, D_V)
    has = torch.isfinite(ref_lse)
    assert not has[1].any() and has[0].all()
    for config in gluon_mla.CONFIGS:
        for overrides in (None, {"ROW64": True}) if timing == Timing() else (None,):
            out, lse = _forward(gluon_mla, timing, overrides, monkeypatch, q, kv, indices, scale, D_V, config=config)
            what = f"{config} {overrides}"
            assert torch.equal(torch.isfinite(lse), has), what
            assert (out[~has] == 0).all(), what
            assert _rel_l2(out, ref_out) <= REL_L2, (what, _rel_l2(out, ref_out))
            assert (lse[has] - ref_lse[has]).abs().max() <= 1e-3, what


def _backward(module, timing: Timing, monkeypatch, *args, **options) -> None:
    kernel = EmulatedKernel(module._sparse_mla_bwd_kernel, timing)
    monkeypatch.setattr(module, "_sparse_mla_bwd_kernel", kernel)
    module.sparse_mla_bwd(*args, **options)
    monkeypatch.undo()
    assert kernel.launches == 1


@pytest.mark.parametrize("timing", ALL_TIMINGS, ids=lambda t: f"copies@{t.copies_land}-mma@{t.mma_reads}")
def test_gluon_backward_matches_reference_under_every_timing(timing, monkeypatch):
    gluon_bwd = pytest.importorskip("slime_dsa.ops.gluon_sparse_mla_bwd", exc_type=ImportError)
    q, kv, indices = _inputs(T=6, H=64, K=80, seed=1)
    scale = (D_V + D_R) ** -0.5
    dout = torch.randn(q.shape[0], q.shape[1], D_V, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q32, kv32 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref_out, ref_lse = reference.sparse_mla_attention(q32, kv32, indices, scale, D_V)
    ref_dq, ref_dkv = torch.autograd.grad((ref_out * dout.float()).sum(), (q32, kv32))
    delta = (ref_out.detach() * dout.float()).sum(-1)
    for do_dq, do_dkv, late_dq, width in ((True, False, False, 1), (False, True, False, 1), (True, True, False, 1),
                                          (True, True, True, 1), (True, True, False, 2), (False, True, False, 4),
                                          (True, True, False, 4), (False, True, False, "staged"),
                                          (True, True, False, "staged")):
        dq = torch.full(q.shape, float("nan"), dtype=q.dtype) if do_dq else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32) if do_dkv else None
        _backward(gluon_bwd, timing, monkeypatch, q, kv, indices, dout, ref_lse.detach(), delta, scale, dq, dkv,
                  late_dq=late_dq, reduction_width=None if width == "staged" else width,
                  staged_reductions=width == "staged")
        if dq is not None:
            assert _rel_l2(dq, ref_dq) <= REL_L2, (do_dq, do_dkv, _rel_l2(dq, ref_dq))
            assert (dq[1] == 0).all()  # a row without keys: every slot -1
        if dkv is not None:
            assert _rel_l2(dkv, ref_dkv) <= REL_L2, (do_dq, do_dkv, _rel_l2(dkv, ref_dkv))
            unused = torch.ones(kv.shape[0], dtype=torch.bool)
            unused[indices[indices >= 0]] = False
            assert (dkv[unused] == 0).all()


@gluon.jit
def _copy_then_read(src_ptr, dst_ptr, WAIT: gl.constexpr):
    """Copies 4 floats to shared memory and stores them back, waiting for the copy first only with WAIT."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    smem = gl.allocate_shared_memory(gl.float32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    offs = gl.arange(0, 4, layout)
    cp.async_copy_global_to_shared(smem, src_ptr + offs)
    cp.commit_group()
    if WAIT:
        cp.wait_group(0)
    gl.store(dst_ptr + offs, smem.load(layout))
    cp.wait_group(0)


@gluon.jit
def _mma_then_overwrite(a_ptr, out_ptr, USE_BEFORE_WAIT: gl.constexpr):
    """An async wgmma of a (64 x 16) by its transpose, its A operand overwritten before the wait (a hazard), or its
    result used before the wait (an error)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 16], gl.bfloat16)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 16])
    rows = gl.arange(0, 64, gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, gl.SliceLayout(0, layout))
    a = gl.load(a_ptr + rows[:, None] * 16 + cols[None, :])
    smem = gl.allocate_shared_memory(gl.bfloat16, [64, 16], sl, a)
    acc = warpgroup_mma(smem, smem.permute((1, 0)), gl.zeros([64, 64], gl.float32, acc_layout), is_async=True)
    if USE_BEFORE_WAIT:
        acc = acc * 2.0
    smem.store(a * 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out_rows = gl.arange(0, 64, gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, 64, gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + out_rows[:, None] * 64 + out_cols[None, :], acc)


def test_emulator_shows_a_read_before_its_copy_lands():
    """The emulator itself: shared memory read before its copy's wait is NaN when copies land at the wait."""
    src = torch.arange(4, dtype=torch.float32)
    for wait, timing, want_nan in ((True, Timing("wait"), False), (False, Timing("issue"), False),
                                   (False, Timing("wait"), True)):
        dst = torch.zeros(4)
        EmulatedKernel(_copy_then_read, timing)[(1,)](src, dst, WAIT=wait)
        assert torch.isnan(dst).all() if want_nan else torch.equal(dst, src), (wait, timing)


def test_emulator_shows_an_operand_overwritten_under_a_wgmma():
    """The emulator itself: a wgmma's shared operand overwritten before its wait changes the result when the wgmma
    reads at the wait (so the timings disagree), and a result used before its wait raises."""
    a = torch.randn(64, 16).to(torch.bfloat16)
    results = []
    for timing in (Timing(mma_reads="issue"), Timing(mma_reads="wait")):
        out = torch.zeros(64, 64)
        EmulatedKernel(_mma_then_overwrite, timing)[(1,)](a, out, USE_BEFORE_WAIT=False)
        results.append(out)
    assert torch.allclose(results[0], a.float() @ a.float().T) and (results[1] == 0).all()
    with pytest.raises(TypeError):
        EmulatedKernel(_mma_then_overwrite, Timing())[(1,)](a, torch.zeros(64, 64), USE_BEFORE_WAIT=True)


def test_the_model_path_through_the_gluon_switches(monkeypatch):
    """triton_sparse_mla's autograd path with GLUON_FWD / GLUON_BWD on, routed to the Gluon modules whose kernels run
    emulated (their `supported` forced, as on sm_90): out, lse and the gradients of a loss of both (so dlse enters
    delta) against the reference's."""
    pytest.importorskip("slime_dsa.ops.gluon_sparse_mla", exc_type=ImportError)
    from slime_dsa.ops import gluon_sparse_mla, gluon_sparse_mla_bwd
    from slime_dsa.ops import triton_sparse_mla as mla

    q, kv, indices = _inputs(T=6, H=64, K=64, seed=3)
    assert mla._forward_variant(False, 6, 64, 64, q.dtype, 576, D_V, q.device) is not None  # a prefill-shaped call
    kernels = []
    kernels_by_module = ((gluon_sparse_mla, "_sparse_mla_fwd_kernel"), (gluon_sparse_mla_bwd, "_sparse_mla_bwd_kernel"))
    for module, name in kernels_by_module:
        kernels.append(EmulatedKernel(getattr(module, name)))
        monkeypatch.setattr(module, name, kernels[-1])
        monkeypatch.setattr(module, "supported", lambda *args: True)
    monkeypatch.setattr(mla, "GLUON_FWD", True)
    monkeypatch.setattr(mla, "GLUON_BWD", True)
    monkeypatch.setattr(mla, "USE_KEY_RANGES", False)
    scale = (D_V + D_R) ** -0.5
    g = torch.Generator().manual_seed(4)
    dout, dlse = torch.randn(6, 64, D_V, generator=g), torch.randn(6, 64, generator=g)

    def loss_and_grads(fn, q_, kv_):
        q_, kv_ = q_.detach().requires_grad_(True), kv_.detach().requires_grad_(True)
        out, lse = fn(q_, kv_, indices, scale, D_V)
        has = torch.isfinite(lse)
        loss = (out.float() * dout).sum() + (torch.where(has, lse, 0.0) * dlse).sum()
        return (out, lse, *torch.autograd.grad(loss, (q_, kv_)))

    got = loss_and_grads(mla.sparse_mla_attention, q, kv)
    assert [k.launches for k in kernels] == [1, 1]
    want = loss_and_grads(reference.sparse_mla_attention, q.float(), kv.float())
    assert got[2].dtype == q.dtype and got[3].dtype == kv.dtype
    has = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(got[1]), has) and (got[1][has] - want[1][has]).abs().max() <= 1e-3
    for name, a, b in zip(("out", "dq", "dkv"), (got[0], got[2], got[3]), (want[0], want[2], want[3])):
        assert _rel_l2(a, b) <= REL_L2, (name, _rel_l2(a, b))


def _head_summed_probs(q, kv, indices, lse, scale) -> torch.Tensor:
    """(T, K) float32: each slot's softmax probability summed over heads (0 on -1 slots), torch in float32."""
    valid = indices >= 0
    s = torch.einsum("thd,tkd->thk", q.float(), kv.float()[indices.clamp(min=0)]) * scale
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0) * valid[:, None, :]
    return p.sum(1)


@pytest.mark.parametrize("timing", ALL_TIMINGS, ids=lambda t: f"copies@{t.copies_land}-mma@{t.mma_reads}")
def test_gluon_attn_probs_matches_reference_under_every_timing(timing, monkeypatch):
    gluon_probs = pytest.importorskip("slime_dsa.ops.gluon_attn_probs", exc_type=ImportError)
    q, kv, indices = _inputs(T=6, H=64, Tk=300, K=200, seed=5)  # 4-7 steps a row at 32 or 64 keys a step
    scale = (D_V + D_R) ** -0.5
    _, lse = reference.sparse_mla_attention(q.float(), kv.float(), indices, scale, D_V)
    want = _head_summed_probs(q, kv, indices, lse, scale)
    for config in gluon_probs.CONFIGS:
        for c0, c1 in ((0, 6), (2, 5)):  # a chunk of rows writes rows 0.. of probs
            probs = torch.zeros(c1 - c0, indices.shape[1])
            kernel = EmulatedKernel(gluon_probs._attn_probs_kernel, timing)
            monkeypatch.setattr(gluon_probs, "_attn_probs_kernel", kernel)
            gluon_probs.attn_probs(q, kv, lse, indices, c0, c1, scale, probs, config=config)
            monkeypatch.undo()
            assert kernel.launches == 1
            assert torch.allclose(probs, want[c0:c1], rtol=2e-3, atol=1e-5), (config, c0, c1)
            assert (probs[indices[c0:c1] < 0] == 0).all()


def test_indexer_loss_target_through_gluon_matches_reference(monkeypatch):
    """The KL loss's target p_bar (`_target`) with the Gluon probabilities, two layers, against the reference's."""
    gluon_probs = pytest.importorskip("slime_dsa.ops.gluon_attn_probs", exc_type=ImportError)
    from slime_dsa.ops import triton_indexer_loss as loss  # noqa: PLC0415

    kernel = EmulatedKernel(gluon_probs._attn_probs_kernel)
    monkeypatch.setattr(gluon_probs, "_attn_probs_kernel", kernel)
    monkeypatch.setattr(loss, "_gluon_probs", lambda q, kv, rows, lse: gluon_probs)
    scale = (D_V + D_R) ** -0.5
    layers = [_inputs(T=6, H=64, Tk=120, K=90, seed=s) for s in (6, 7)]
    indices = layers[0][2]
    lses = [reference.sparse_mla_attention(q.float(), kv.float(), indices, scale, D_V)[1] for q, kv, _ in layers]
    cu = torch.tensor([0, 6])
    plan = loss._Plan(cu, torch.tensor([0, 120]), indices, 6, "cpu")
    got = loss._target(plan, 0, 6, indices.shape[1], [q for q, _, _ in layers], [kv for _, kv, _ in layers], lses,
                       scale)
    assert kernel.launches == 2
    want = torch.zeros_like(got)
    for (q, kv, _), lse in zip(layers, lses):
        p = _head_summed_probs(q, kv, indices, lse, scale)
        want += p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 2
    assert torch.allclose(got, want, rtol=2e-3, atol=1e-6)

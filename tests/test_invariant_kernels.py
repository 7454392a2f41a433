"""The batch-invariant Triton kernels (slime_dsa/ops/triton_invariant.py): row invariance, bit for bit, and
closeness to torch.

Row invariance: f(x)[rows] has the same bits as f(x[rows]) for row subsets of several sizes (1, 7, 64, ...), for a
shuffled batch, and for the rows among different neighbours. Closeness: float32 within 1e-5 relative (IEEE
products, no tf32); bf16 within relative L2 1e-2 of torch's own bf16 op (one bf16 rounding of the output is 4e-3).

On CPU the checks run in Triton's interpreter, at tiny shapes, in a child process (the interpreter is chosen
when a kernel is defined, so TRITON_INTERPRET=1 must be set before the module is imported); on CUDA they run at
the 300m preset's layer shapes with up to 65,536 rows (`gpu` tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _kernels():
    from slime_dsa.ops import triton_invariant  # noqa: PLC0415 (imports triton)

    return triton_invariant


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype == torch.float32 and want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    else:
        assert _rel_l2(got, want) <= 1e-2, f"{what}: relative L2 {_rel_l2(got, want):.2e} against torch"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal counts -0.0 equal to 0.0 and NaN unequal to itself)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        a, b = a.view(ints[a.element_size()]), b.view(ints[b.element_size()])
    return torch.equal(a, b)


def _subsets(M: int, sizes: list[int], g: torch.Generator, device: str) -> list[torch.Tensor]:
    """Row index sets of the given sizes (those <= M): the first row alone, then random rows in random order."""
    out = [torch.tensor([0], device=device)]
    out += [torch.randperm(M, generator=g)[:n].to(device) for n in sizes if n <= M]
    return out


def _assert_row_invariant(f, x: torch.Tensor, sizes: list[int], what: str, g: torch.Generator) -> torch.Tensor:
    """f's rows computed in the whole batch equal them computed in smaller, shuffled and differently mixed batches."""
    full = f(x)
    M = x.shape[0]
    for rows in _subsets(M, sizes, g, x.device.type):
        assert _same_bits(f(x[rows]), full[rows]), f"{what}: {len(rows)} of {M} rows differ from the full batch"
    others = torch.randn(x.shape, generator=g).to(x.device, x.dtype) if x.is_floating_point() else x
    mixed = torch.cat([others[: M // 3], x, others[M // 3:]])
    assert _same_bits(f(mixed)[M // 3: M // 3 + M], full), f"{what}: rows change with their neighbours"
    return full


def check_linear(device: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]], sizes: list[int]) -> None:
    """shapes: (M, N, K); x (M, K) against weight (N, K), every other shape with a bias."""
    k = _kernels()
    g = torch.Generator().manual_seed(0)
    for i, (M, N, K) in enumerate(shapes):
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
        bias = torch.randn(N, generator=g).to(device, dtype) if i % 2 else None
        what = f"linear {dtype} M={M} N={N} K={K} bias={bias is not None}"
        full = _assert_row_invariant(lambda t: k.linear(t, w, bias), x, sizes, what, g)
        _assert_close(full, F.linear(x, w, bias), what)
        assert _same_bits(k.linear(x.view(M, 1, K), w, bias), full.view(M, 1, N)), f"{what}: (..., K) leading dims"


def check_head_matmul(device: str, dtype: torch.dtype, T: int, H: int, K: int, N: int, sizes: list[int]) -> None:
    """x (T, H, K) times weight (H, K, N) per head: rows invariant, close to einsum, weight given either way round."""
    k = _kernels()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, K, generator=g).to(device, dtype)
    w = (torch.randn(H, K, N, generator=g) / K**0.5).to(device, dtype)
    what = f"head_matmul {dtype} T={T} H={H} K={K} N={N}"
    full = _assert_row_invariant(lambda t: k.head_matmul(t, w), x, sizes, what, g)
    _assert_close(full, torch.einsum("thk,hkn->thn", x, w), what)
    w_nk = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, K the unit-stride dim
    assert _same_bits(k.head_matmul(x, w_nk), full), f"{what}: weight layout changes the bits"


def check_grouped_linear(device: str, dtype: torch.dtype, counts: list[int], N: int, K: int) -> None:
    """Rows sorted by expert, `counts` rows per expert; a row's output is the same in a batch of other counts."""
    k = _kernels()
    g = torch.Generator().manual_seed(1)
    E, M = len(counts), sum(counts)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(E, N, K, generator=g) / K**0.5).to(device, dtype)
    ends = torch.tensor(counts).cumsum(0)
    out = k.grouped_linear(x, w, ends.to(device, torch.int32))
    for e in range(E):
        rows = slice(int(ends[e]) - counts[e], int(ends[e]))
        _assert_close(out[rows], F.linear(x[rows], w[e]), f"grouped_linear {dtype} expert {e}")
    # Another batch: every other row of each expert, so each expert's rows and the tiles they fall in change.
    keep = torch.cat([torch.arange(int(ends[e]) - c, int(ends[e]))[::2] for e, c in enumerate(counts)]).to(device)
    sub_ends = torch.tensor([(c + 1) // 2 for c in counts]).cumsum(0).to(device, torch.int32)
    assert _same_bits(k.grouped_linear(x[keep], w, sub_ends), out[keep]), f"grouped_linear {dtype}: rows differ"


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # the model's RMSNorm


def check_rms_norm(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], sizes: list[int]) -> None:
    k = _kernels()
    g = torch.Generator().manual_seed(2)
    for M, N in shapes:
        x = (3 * torch.randn(M, N, generator=g)).to(device, dtype)
        w = (1 + torch.randn(N, generator=g) / 4).to(device, dtype)
        what = f"rms_norm {dtype} M={M} N={N}"
        full = _assert_row_invariant(lambda t: k.rms_norm(t, w, 1e-6), x, sizes, what, g)
        _assert_close(full, _rms_reference(x, w, 1e-6), what)
        assert full.dtype == dtype


def check_log_softmax_gather(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], sizes: list[int]) -> None:
    k = _kernels()
    g = torch.Generator().manual_seed(3)
    for T, V in shapes:
        logits = (4 * torch.randn(T, V, generator=g)).to(device, dtype)
        ids = torch.randint(0, V, (T,), generator=g).to(device)
        ids[0] = logits[0].argmax()
        for temperature in (1.0, 0.7):
            what = f"log_softmax_gather {dtype} T={T} V={V} temperature={temperature}"
            rows = torch.arange(T, device=device)
            full = _assert_row_invariant(lambda r: k.log_softmax_gather(logits[r], ids[r], temperature), rows, sizes,
                                         what, g)
            want = torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, ids[:, None]).squeeze(1)
            assert full.dtype == torch.float32
            torch.testing.assert_close(full, want, rtol=0, atol=2e-5, msg=lambda m: f"{what}: {m}")


def check_gradients(device: str) -> None:
    """The backward passes (plain torch) against torch's autograd of the same ops, float32."""
    k = _kernels()
    g = torch.Generator().manual_seed(4)

    def grads(f, *tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = f(*leaves)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(device))
        return [leaf.grad for leaf in leaves]

    x, w, b = (torch.randn(*s, generator=g).to(device) for s in ((5, 3, 40), (24, 40), (24,)))
    for got, want in zip(grads(k.linear, x, w, b), grads(F.linear, x, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    nw = torch.randn(40, generator=g).to(device)
    for got, want in zip(grads(lambda a, c: k.rms_norm(a, c, 1e-6), x, nw),
                         grads(lambda a, c: _rms_reference(a, c, 1e-6), x, nw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ends = torch.tensor([2, 2, 9]).to(device, torch.int32)  # an empty expert; x's last 6 rows are no expert's
    gw = torch.randn(3, 24, 40, generator=g).to(device)

    def grouped_reference(a, c):
        return torch.cat([a[:2] @ c[0].T, a[2:9] @ c[2].T, torch.zeros(6, 24, device=device)])

    x2 = x.view(15, 40)
    def grouped(a, c):  # rows past the last expert are left unwritten: zeros there, as the reference
        return torch.cat([k.grouped_linear(a, c, ends)[:9], torch.zeros(6, 24, device=device)])

    for got, want in zip(grads(grouped, x2, gw), grads(grouped_reference, x2, gw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hx, hw = torch.randn(5, 3, 8, generator=g).to(device), torch.randn(3, 8, 6, generator=g).to(device)
    for got, want in zip(grads(k.head_matmul, hx, hw), grads(lambda a, c: torch.einsum("thk,hkn->thn", a, c), hx, hw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits, ids = torch.randn(6, 50, generator=g).to(device), torch.randint(0, 50, (6,), generator=g).to(device)
    ref = lambda z: torch.log_softmax(z / 0.7, -1).gather(1, ids[:, None]).squeeze(1)  # noqa: E731
    torch.testing.assert_close(grads(lambda z: k.log_softmax_gather(z, ids, 0.7), logits)[0], grads(ref, logits)[0],
                               rtol=1e-5, atol=1e-6)


def check_strided_inputs(device: str) -> None:
    """Views with a non-unit last stride (a transposed weight, a column of ids) give the contiguous inputs' bits."""
    k = _kernels()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 40, generator=g).to(device), torch.randn(40, 24, generator=g).to(device)
    assert _same_bits(k.linear(x.T.contiguous().T, w.T), k.linear(x, w.T.contiguous())), "linear: strided views"
    nw = torch.randn(40, 2, generator=g).to(device)
    assert _same_bits(k.rms_norm(x, nw[:, 0], 1e-6), k.rms_norm(x, nw[:, 0].contiguous(), 1e-6)), "rms_norm: strided"
    logits, ids = torch.randn(9, 50, generator=g).to(device), torch.randint(0, 50, (9, 2), generator=g).to(device)
    assert _same_bits(k.log_softmax_gather(logits, ids[:, 1], 0.7),
                       k.log_softmax_gather(logits, ids[:, 1].contiguous(), 0.7)), "log_softmax_gather: strided ids"


def check_misaligned_rows(device: str, M: int, N: int, V: int) -> None:
    """Rows read through a view that starts off a 16-byte boundary (another compiled layout on a GPU) give the
    contiguous rows' bits: the row reductions do not follow the layout."""
    k = _kernels()
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(M, N + 1, generator=g).to(device, dtype)[:, 1:]  # (M, N), row stride N + 1
        w = torch.randn(N, generator=g).to(device, dtype)
        assert _same_bits(k.rms_norm(x, w, 1e-6), k.rms_norm(x.contiguous(), w, 1e-6)), f"rms_norm {dtype}: view"
        logits = torch.randn(M, V + 1, generator=g).to(device, dtype)[:, 1:]  # (M, V)
        ids = torch.randint(0, V, (M,), generator=g).to(device)
        got, want = k.log_softmax_gather(logits, ids, 0.7), k.log_softmax_gather(logits.contiguous(), ids, 0.7)
        assert _same_bits(got, want), f"log_softmax_gather {dtype}: view"


def run_interpret_checks() -> None:
    """Tiny shapes that still cross every tile and block edge (float32 tiles are 64 x 64 x 32; rows in 4096s)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    torch.set_num_threads(1)
    from tests.interpret_dot import use_row_invariant_dot  # noqa: PLC0415 (imports triton)

    use_row_invariant_dot()
    # float32 only: the interpreter's bf16 dot is not faithful. K = 100 ends in a partial block, K = 64 does not.
    check_linear("cpu", torch.float32, [(100, 72, 100), (70, 40, 64)], sizes=[7])
    for dtype in (torch.float32, torch.bfloat16):
        check_rms_norm("cpu", dtype, [(12, 100), (3, 4100)], sizes=[5])
        check_log_softmax_gather("cpu", dtype, [(5, 4200)], sizes=[3])
    check_grouped_linear("cpu", torch.float32, [70, 0, 5, 80], N=40, K=50)
    check_gradients("cpu")
    check_strided_inputs("cpu")
    check_head_matmul("cpu", torch.float32, 70, 3, 40, 24, sizes=[7])
    check_misaligned_rows("cpu", 3, 100, 300)


def run_in_interpreter(module: str) -> None:
    """`module`'s run_interpret_checks in a fresh process under Triton's interpreter (set before triton imports)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = f"from {module} import run_interpret_checks; run_interpret_checks()"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def test_invariant_kernels_in_the_interpreter():
    run_in_interpreter("tests.test_invariant_kernels")


@pytest.mark.slow  # ~5 s of CPU: four kernels through Triton's whole compiler and ptxas
def test_kernels_compile_for_sm90_with_wgmma():
    """Compiled ahead of time for an H100 / H200 (no GPU needed): the bf16 matmuls use wgmma with pipelined loads.
    Unit strides, 16-byte aligned pointers and sizes and strides that are multiples of 16 are specialised, as the
    JIT does for the 300m preset's tensors."""
    pytest.importorskip("triton")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    k = _kernels()
    t = k.TILES[torch.bfloat16]
    tiles = dict(IEEE=False, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=True)
    unit = dict(stride_xk=1, stride_wk=1, stride_on=1)
    cases = [  # (kernel, runtime args: type, constexprs, a matmul?)
        (k._linear_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32",
                                K="i32", stride_xh="i32", stride_xm="i32", stride_wh="i32", stride_wn="i32",
                                stride_oh="i32", stride_om="i32"),
         dict(unit, HAS_BIAS=False, GROUP_M=t.group_m, **tiles), True),
        (k._grouped_linear_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", offs_ptr="*i32", out_ptr="*bf16", N="i32",
                                        K="i32", E="i32", stride_xm="i32", stride_we="i32", stride_wn="i32",
                                        stride_om="i32"), dict(unit, **tiles), True),
        (k._rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", N="i32", width="fp32",
                                  stride_x="i32", stride_o="i32", eps="fp32"), dict(BLOCK=1024), False),
        (k._log_softmax_gather_kernel, dict(logits_ptr="*bf16", ids_ptr="*i64", out_ptr="*fp32", V="i32",
                                            stride_t="i32", temperature="fp32"), dict(BLOCK=4096), False),
    ]
    for fn, args, consts, matmul in cases:
        # The JIT marks 16-byte aligned pointers and integers that are multiples of 16 (the 300m's sizes) so.
        aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, ty in args.items()
                   if ty.startswith("*") or n in ("N", "K") or n.startswith("stride")}
        src = ASTSource(fn, {**args, **{c: "constexpr" for c in consts}}, consts, aligned)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=t.num_warps if matmul else 4, num_stages=t.num_stages))
        if matmul:
            assert "wgmma.mma_async" in compiled.asm["ptx"], f"{fn.__name__}: no wgmma"
            assert "async_copy_global_to_local" in compiled.asm["ttgir"], f"{fn.__name__}: loads not pipelined"


# --- CUDA, at the 300m preset's shapes (hidden 1024, q_lora 384, kv_lora 256, MLP 2816, 16 heads, vocab 32000) ---

SIZES = [7, 64, 256, 4096]
LINEAR_SHAPES = [(65536, 1024, 1024), (8192, 2816, 1024), (8192, 1024, 2816), (4096, 288, 1024), (1024, 32000, 1024),
                 (2048, 384, 1000)]  # the last: K not a multiple of the K tile


@pytest.mark.gpu
def test_linear_is_row_invariant_on_cuda():
    check_linear("cuda", torch.bfloat16, LINEAR_SHAPES + LINEAR_SHAPES[:1], SIZES)  # odd-numbered shapes with a bias
    check_linear("cuda", torch.float32, [(4096, 384, 1024), (4096, 384, 1000)], SIZES)


@pytest.mark.gpu
def test_head_matmul_is_row_invariant_on_cuda():
    check_head_matmul("cuda", torch.bfloat16, 8192, 16, 64, 256, SIZES)  # q_nope @ w_uk (nope 64 -> kv_lora 256)
    check_head_matmul("cuda", torch.bfloat16, 8192, 16, 256, 64, SIZES)  # latent out @ w_uv (256 -> v 64)


@pytest.mark.gpu
def test_grouped_linear_is_row_invariant_on_cuda():
    counts = torch.randint(0, 600, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    counts[3] = 0
    check_grouped_linear("cuda", torch.bfloat16, counts, N=512, K=1024)  # gate_up of 32 experts of 256
    check_grouped_linear("cuda", torch.bfloat16, counts, N=1024, K=256)  # down


@pytest.mark.gpu
def test_rms_norm_is_row_invariant_on_cuda():
    check_rms_norm("cuda", torch.bfloat16, [(65536, 1024), (8192, 384), (8192, 256), (512, 6000)], SIZES)
    check_rms_norm("cuda", torch.float32, [(4096, 1024)], SIZES)


@pytest.mark.gpu
def test_log_softmax_gather_is_row_invariant_on_cuda():
    check_log_softmax_gather("cuda", torch.bfloat16, [(8192, 32000)], SIZES)
    check_log_softmax_gather("cuda", torch.float32, [(4096, 32000)], SIZES)


@pytest.mark.gpu
def test_invariant_kernel_gradients_on_cuda():
    check_gradients("cuda")


@pytest.mark.gpu
def test_strided_and_misaligned_inputs_on_cuda():
    check_strided_inputs("cuda")
    check_misaligned_rows("cuda", 257, 1024, 32000)
    check_misaligned_rows("cuda", 64, 6000, 151552)  # two RMSNorm blocks; GLM-5's vocabulary

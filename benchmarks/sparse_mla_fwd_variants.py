"""Sparse MLA forward: the current kernel against the variants of slime_dsa/ops/triton_sparse_mla_fwd_variants.py, at
every launch config of each (issue 20, item 2: >= 350 TFLOP/s at GLM-5 sizes on the H200).

    PYTHONPATH=. python benchmarks/sparse_mla_fwd_variants.py --out $OUT/fwd_variants.json
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/sparse_mla_fwd_variants.py --smoke   # CPU, tiny shapes

Shapes (bf16, 64 heads, latent 512 + rope 64, value 512, top-k 2048, rows as `dsa_kernels.py` makes them: the Triton
indexer's causal top-k on random inputs): one sequence of each `--lengths` (32K and 64K); 64 sequences of 1K packed
into 64K tokens (most slots -1); decode, 128 requests of one query at a 64K context. The first shape runs every
(variant, config); the others the `--top` fastest correct ones of the first shape, plus the current kernel. A
(variant, config) whose out differs from the current kernel's by more than 2e-2 relative L2 (or whose lse pattern of
-inf differs) is marked wrong and not timed; one that does not compile or fit is a row saying so. TFLOP/s count the
keys used (2 matmuls). Times: median of CUDA-event launches after a warm-up, `--budget` seconds each. Registers,
spills and shared memory are those of the compiled kernel. The JSON is rewritten after every row, so a run stopped by
`--time-limit` keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger("sparse_mla_fwd_variants")

H, D, V_DIM, TOPK = 64, 576, 512, 2048  # dsa_kernels.py's GLM-5 sizes
WRONG_REL_L2 = 2e-2
GOAL_TFLOPS = 350.0
CURRENT = "current"
GLUON = "gluon_"  # gluon_<config>: slime_dsa/ops/gluon_sparse_mla.py's kernel at CONFIGS[<config>]


@dataclass
class Row:
    """One (shape, variant, config) measurement; ms is None when it was not timed (see note)."""

    shape: str
    variant: str
    config: str
    ms: float | None = None
    tflops: float | None = None
    out_rel_l2: float | None = None
    lse_max_abs: float | None = None
    regs: str = "?"
    spills: str = "?"
    shared: str = "?"
    note: str = ""


@dataclass
class Problem:
    name: str
    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    flops: float


def gpu_problems(lengths: list[int]) -> Iterator[Callable[[], Problem]]:
    """Builders of the GLM-5 problems, one at a time (a 64K problem holds ~10 GB)."""
    from benchmarks.dsa_kernels import _indices, _indices_cache, sparse_flops  # noqa: PLC0415

    def seq(T: int, seq_len: int, name: str) -> Callable[[], Problem]:
        def build() -> Problem:
            _indices_cache.clear()
            indices = _indices(T, seq_len)
            g = torch.Generator(device="cuda").manual_seed(T + seq_len)
            q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
            return Problem(name, q, kv, indices, sparse_flops(indices)[0])

        return build

    def decode(batch: int = 128, ctx: int = 65536) -> Problem:
        g = torch.Generator(device="cuda").manual_seed(batch)
        kv = torch.randn(batch * ctx, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        picks = torch.rand(batch, ctx, device="cuda", generator=g).topk(TOPK, dim=1).indices.sort(dim=1).values
        indices = picks + torch.arange(batch, device="cuda")[:, None] * ctx  # (batch, TOPK) global kv rows
        return Problem(f"decode {batch} x ctx {ctx}", q, kv, indices, sparse_flops(indices)[0])

    for T in lengths:
        yield seq(T, T, f"seq {T}")
    yield seq(65536, 1024, "packed 64 x 1024")
    yield decode


def smoke_problems() -> Iterator[Callable[[], Problem]]:
    """Tiny float32 problems for the interpreter (CPU): mostly -1 slots, rows without keys, and a decode split."""
    from tests.interpret_checks import _mostly_empty_indices  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    h, d = 16, 48

    def build(T: int, Tk: int, K: int, name: str) -> Callable[[], Problem]:
        def make() -> Problem:
            idx = _mostly_empty_indices(T, Tk, K, g) if T > 4 else torch.randperm(Tk, generator=g)[: T * K].view(T, K)
            q, kv = torch.randn(T, h, d, generator=g), torch.randn(Tk, d, generator=g)
            return Problem(name, q, kv, idx, 2.0 * h * float((idx >= 0).sum()) * (d + 32))

        return make

    yield build(6, 40, 48, "smoke rows")
    yield build(2, 700, 300, "smoke decode")


def candidates(only: list[str] | None = None) -> list[tuple[str, object]]:
    """(variant, config) pairs: the current kernel at its first config, then every variant (or those of `only`) at
    each of its configs."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla_fwd_variants import VARIANTS  # noqa: PLC0415

    pairs = [(CURRENT, mla.FWD_CONFIGS[0])] + [(name, cfg) for name, v in VARIANTS.items() for cfg in v.configs
                                               if only is None or name in only]
    try:
        from slime_dsa.ops.gluon_sparse_mla import CONFIGS  # noqa: PLC0415 (Triton 3.5+ with Gluon)
    except ImportError:
        return pairs
    gluon = [(GLUON + name, mla.KernelConfig(64, c.block_n, 8, c.stages)) for name, c in CONFIGS.items()]
    return pairs + [(name, cfg) for name, cfg in gluon if only is None or name in only]


def run_forward(problem: Problem, variant: str, cfg, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with `variant` pinned to `cfg` (its compile errors propagate)."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    H_, D_ = problem.q.shape[1:]
    if variant.startswith(GLUON):
        from slime_dsa.ops import gluon_sparse_mla  # noqa: PLC0415 (Triton 3.5+ with Gluon)

        if not gluon_sparse_mla.supported(problem.q, problem.kv, problem.indices, v_dim):
            raise RuntimeError("no fwd kernel config fits: the Gluon forward needs sm_90, bf16, 64k heads, 512 + 64")
        with torch.no_grad():
            return gluon_sparse_mla.sparse_mla_fwd(problem.q, problem.kv, problem.indices, D_**-0.5, v_dim,
                                                   config=variant.removeprefix(GLUON))
    saved = mla.FWD_VARIANT
    mla.FWD_VARIANT = mla.PLAIN_FWD if variant == CURRENT else variant
    key = (H_, D_, v_dim, problem.q.dtype) + (() if variant == CURRENT else (variant,))
    mla._chosen[("fwd", key)] = cfg
    try:
        with torch.no_grad():
            return mla.sparse_mla_fwd(problem.q, problem.kv, problem.indices, D_**-0.5, v_dim)
    finally:
        mla._chosen.pop(("fwd", key), None)
        mla.FWD_VARIANT = saved


def timed(fn: Callable[[], object], budget_s: float, device: str) -> float:
    """Median ms of fn() after a warm-up, repetitions fitting in budget_s (CUDA events; wall clock on CPU)."""
    if device == "cuda":
        from benchmarks.dsa_kernels import timed as cuda_timed  # noqa: PLC0415

        return cuda_timed(fn, budget_s, max_reps=10)
    fn()
    times = []
    while not times or (sum(times) < budget_s * 1e3 and len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def resources(variant: str) -> tuple[str, str, str]:
    """(registers, spills, shared bytes) of the most recently compiled kernel of `variant`, if Triton says."""
    if not torch.cuda.is_available():
        return "?", "?", "?"
    from benchmarks.dsa_kernels import _resources  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_fwd_variants as fv  # noqa: PLC0415

    kernel = mla._sparse_mla_fwd_kernel if variant == CURRENT else fv._fwd_variant_kernel
    if variant.startswith(GLUON):
        from slime_dsa.ops import gluon_sparse_mla  # noqa: PLC0415

        warp_specialized = gluon_sparse_mla.CONFIGS[variant[len(GLUON):]].warp_specialized
        kernel = gluon_sparse_mla._sparse_mla_fwd_ws_kernel if warp_specialized else gluon_sparse_mla._sparse_mla_fwd_kernel
    regs, spills = _resources(kernel)
    try:
        compiled = list(kernel.device_caches[torch.cuda.current_device()][0].values())[-1]
        shared = str(compiled.metadata.shared)
    except Exception:  # noqa: BLE001 (Triton-version dependent; informational)
        shared = "?"
    return regs, spills, shared


_resources_seen: dict[tuple[str, str], tuple[str, str, str]] = {}  # a pair's kernel as first compiled (first shape)


def measure(problem: Problem, pairs, budget_s: float, v_dim: int, deadline: float, emit) -> None:
    """Check every (variant, config) of `pairs` against the current kernel on `problem`, and time the correct ones."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    device = problem.q.device.type
    ref_out, ref_lse = run_forward(problem, CURRENT, mla.FWD_CONFIGS[0], v_dim)
    ref_out = ref_out.float()
    has = torch.isfinite(ref_lse)
    for variant, cfg in pairs:
        row = Row(problem.name, variant, f"{cfg.block_h}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}")
        if time.time() > deadline:
            row.note = "skipped: past --time-limit"
            emit(row)
            continue
        try:
            out, lse = run_forward(problem, variant, cfg, v_dim)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 (a config that does not compile or fit is a row, not a crash)
            row.note = f"failed: {type(err).__name__}: {str(err).strip().splitlines()[-1][:160] if str(err) else ''}"
            logger.warning("%s %s %s: %s", problem.name, variant, row.config, str(err)[-2000:])
            emit(row)
            continue
        if (variant, row.config) not in _resources_seen:  # later shapes may reuse an older specialisation
            _resources_seen[(variant, row.config)] = resources(variant)
        row.regs, row.spills, row.shared = _resources_seen[(variant, row.config)]
        row.out_rel_l2 = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
        row.lse_max_abs = (lse[has] - ref_lse[has]).abs().max().item() if has.any() else 0.0
        same_rows = torch.equal(torch.isfinite(lse), has) and bool((out[~has] == 0).all())
        del out, lse
        if not same_rows or not row.out_rel_l2 <= WRONG_REL_L2:
            row.note = "wrong: " + ("rows without keys differ" if not same_rows else f"rel L2 > {WRONG_REL_L2}")
            emit(row)
            continue
        row.ms = timed(lambda: run_forward(problem, variant, cfg, v_dim), budget_s, device)
        row.tflops = problem.flops / (row.ms * 1e-3) / 1e12
        emit(row)


def markdown(rows: list[Row]) -> str:
    """The rows as one table, with each shape's speedup over the current kernel."""
    base = {r.shape: r.ms for r in rows if r.variant == CURRENT and r.ms}
    lines = ["| shape | variant | heads, keys/step, warps, stages | ms | TFLOP/s | vs current | out rel L2 | "
             "lse max abs | regs | spills | smem B | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        speed = f"{base[r.shape] / r.ms:.2f}x" if r.ms and base.get(r.shape) else "-"
        lines.append(f"| {r.shape} | {r.variant} | {r.config} | {f(r.ms, '.3f')} | {f(r.tflops, '.0f')} | {speed} | "
                     f"{f(r.out_rel_l2, '.1e')} | {f(r.lse_max_abs, '.1e')} | {r.regs} | {r.spills} | {r.shared} | "
                     f"{r.note} |")
    lines.append("")
    for shape in dict.fromkeys(r.shape for r in rows):
        timed_rows = [r for r in rows if r.shape == shape and r.ms]
        if timed_rows:
            best = min(timed_rows, key=lambda r: r.ms)
            lines.append(f"- {shape}: fastest {best.variant} ({best.config}), {best.ms:.3f} ms, "
                         f"{best.tflops:.0f} TFLOP/s (goal {GOAL_TFLOPS:.0f}; current {f(base.get(shape), '.3f')} ms)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536], help="one-sequence lengths")
    parser.add_argument("--out", help="write the rows as JSON here (after every row)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of repetitions per measurement")
    parser.add_argument("--time-limit", type=float, default=200.0, help="seconds; later rows are marked skipped")
    parser.add_argument("--top", type=int, default=6, help="(variant, config) pairs kept after the first shape; 0 all")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these variants (and the current kernel); a kernel that faults poisons the process's "
                             "CUDA context, so run one at a time to see each")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("sparse_mla_fwd_variants.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    import triton  # noqa: PLC0415

    t0 = time.time()
    deadline = t0 + args.time_limit
    meta = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv)}
    logger.info("%s; torch %s, Triton %s", meta["device"], meta["torch"], meta["triton"])
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        logger.info("[%6.1fs] %s | %s | %s | %s ms | %s TFLOP/s | %s", time.time() - t0, row.shape, row.variant,
                    row.config, f"{row.ms:.3f}" if row.ms else "-", f"{row.tflops:.0f}" if row.tflops else "-",
                    row.note)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)

    pairs = candidates(args.variants)
    v_dim = 32 if args.smoke else V_DIM
    for i, build in enumerate(smoke_problems() if args.smoke else gpu_problems(args.lengths)):
        if time.time() > deadline:
            logger.info("past --time-limit: the remaining shapes are skipped")
            break
        problem = build()
        measure(problem, pairs, args.budget, v_dim, deadline, emit)
        if i == 0 and args.top > 0:  # the fastest correct pairs of the first shape go on, and the current kernel
            timed_rows = sorted((r for r in rows if r.ms and r.variant != CURRENT), key=lambda r: r.ms)
            keep = {(r.variant, r.config) for r in timed_rows[: args.top]}
            pairs = [(v, c) for v, c in pairs if v == CURRENT or
                     (v, f"{c.block_h}, {c.block_n}, {c.num_warps}, {c.num_stages}") in keep]
        del problem
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{meta['device']}; torch {meta['torch']}; Triton {meta['triton']}\n")
    print(markdown(rows))
    if args.smoke and any(r.note.startswith(("wrong", "failed")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Sparse MLA general (atomic) backward: every mode of `triton_sparse_mla.BWD_MODES` at GLM-5 sizes, checked
against the "fused" mode and timed (issue 20: the backward's goal is >= 200 TFLOP/s).

    PYTHONPATH=. python benchmarks/sparse_mla_bwd_variants.py --out $OUT/bwd_variants.json

One causal sequence of T tokens per length (default 8K, 32K, 64K), 64 heads, latent 512 + rope 64 (value 512),
bf16, top-k 2048 chosen by the Triton indexer on random inputs (benchmarks/dsa_kernels.py's rows, so early
queries have fewer keys); TFLOP/s count the keys used (5 matmuls, flash-attention's convention). Each mode is one
kernel or two (split: dQ alone, dKV alone); each of its launches is run with every config of its list at the first
length, then with its fastest correct config at the others. A launch whose dq or dkv differs from the fused mode's
by more than 2e-2 relative L2 is marked wrong and not timed; one that does not compile is a row saying so. A mode's
time is the sum of its launches' best times, or for the variants of several kernels their time run together as
the backward runs them (row "whole": split64_par overlaps its two on two streams). `--modes split64_stores` adds
split64 with its dKV atomics replaced by plain stores (wrong dKV, timed unchecked): what the atomics cost, the bound of
any atomic-free dKV in that kernel; `--modes split64_gluon_dkv gluon_split gluon_fused` the Gluon kernel
(slime_dsa/ops/gluon_sparse_mla_bwd.py) as split64's dKV half, as both halves, and fused. Each row gives the compiled
kernel's registers, spilled bytes per thread and shared memory. --time-limit stops cleanly between measurements;
--max-configs N sweeps only the first N configs of each launch; the JSON (and the tables, .md beside it) hold what
ran. `--selection window` gives each query its last 2,048 keys instead of the indexer's (as many keys a row, shared
by neighbouring queries): against the default it shows what the indexer's scattered keys cost the gathers and the
dKV reductions at a length.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.dsa_kernels import D, H, TOPK, V_DIM, _indices, sparse_flops, timed

log = logging.getLogger("sparse_mla_bwd_variants")
MAX_REL_ERR = 2e-2
WHOLE = "whole"  # the launch label of a multi-kernel mode timed as a whole (its kernels' fastest configs)
# gluon_sparse_mla_bwd.py's kernel (not a backward mode: the general backward calls it fused, GLUON_BWD): its dKV half
# after split64's dQ kernel, its two halves apart, or both in one kernel
GLUON_DKV = "split64_gluon_dkv"
# gluon_fused_late_dq: its dQ products issued after dKV^T's, over the step's reductions (LATE_DQ);
# gluon_fused_stores: plain stores instead of the dkv reductions (timing only: what they cost);
# gluon_fused_v2, gluon_fused_v4: each dkv reduction adds 2 or 4 floats (REDUCTION_WIDTH);
# gluon_fused_staged: 4 floats, the tile moved through shared memory instead of shuffles (STAGED_REDUCTIONS)
GLUON_MODES = (GLUON_DKV, "gluon_split", "gluon_fused", "gluon_fused_late_dq", "gluon_fused_stores", "gluon_fused_v2",
               "gluon_fused_v4", "gluon_fused_staged")


@dataclass
class Unit:
    """One launch of a mode: which halves it computes, its configs, and how to run one config."""

    label: str
    do_dq: bool
    do_dkv: bool
    configs: list
    run: Callable  # (cfg, problem, dq, dkv) -> compiled kernel
    timing_only: bool = False  # its dKV is wrong by design (variants.TIMING_ONLY): timed, not checked


@dataclass
class Result:
    """One measured (or failed, or skipped) launch config at one length."""

    T: int
    mode: str
    unit: str
    config: str
    ms: float | None = None
    tflops: float | None = None  # for a whole-mode launch; split halves get the mode's total in the summary
    err_dq: float | None = None
    err_dkv: float | None = None
    regs: int | None = None
    spills: int | None = None
    shared_kb: float | None = None
    note: str = ""


@dataclass
class Problem:
    q: torch.Tensor
    kv: torch.Tensor
    idx: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    bwd_flops: float
    scale: float = D**-0.5
    ref: tuple = field(default_factory=tuple)  # (dq, dkv) of the fused mode


def mode_units(mode: str) -> list[Unit]:
    """The launches of a backward mode, each runnable with any of its configs."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415

    def original(do_dq: bool, do_dkv: bool):
        return lambda cfg, p, dq, dkv: mla.launch_bwd_kernel(cfg, do_dq, do_dkv, p.q, p.kv, p.idx, p.dout, p.lse,
                                                             p.delta, dq, dkv, p.scale, V_DIM)

    if mode == "fused":
        return [Unit("fused", True, True, mla.BWD_FUSED_CONFIGS, original(True, True))]
    if mode in GLUON_MODES:
        from slime_dsa.ops import gluon_sparse_mla_bwd as gluon_bwd  # noqa: PLC0415 (Triton 3.5+ with Gluon)

        def gluon(do_dq: bool, do_dkv: bool, **options) -> Callable:
            def run_gluon(cfg, p, dq, dkv):
                if not gluon_bwd.supported(p.q, p.kv, p.idx, p.dout, V_DIM):
                    raise RuntimeError("the Gluon backward needs sm_90, bf16, 64k heads, 512 + 64")
                gluon_bwd.sparse_mla_bwd(p.q, p.kv, p.idx, p.dout, p.lse, p.delta, p.scale, dq if do_dq else None,
                                         dkv if do_dkv else None, **options)

            return run_gluon

        config = [mla.KernelConfig(64, gluon_bwd.BLOCK_N, 8, gluon_bwd.STAGES)]
        gluon_dq = Unit("gluon_dq", True, False, config, gluon(True, False))
        gluon_dkv = Unit("gluon_dkv", False, True, config, gluon(False, True))
        return {GLUON_DKV: [mode_units("split64")[0], gluon_dkv], "gluon_split": [gluon_dq, gluon_dkv],
                "gluon_fused": [Unit("gluon_fused", True, True, config,
                                     gluon(True, True, late_dq=False, reduction_width=1))],
                "gluon_fused_v2": [Unit("gluon_fused_v2", True, True, config,
                                        gluon(True, True, late_dq=False, reduction_width=2))],
                "gluon_fused_v4": [Unit("gluon_fused_v4", True, True, config,
                                        gluon(True, True, late_dq=False, reduction_width=4))],
                "gluon_fused_staged": [Unit("gluon_fused_staged", True, True, config,
                                            gluon(True, True, late_dq=False, staged_reductions=True))],
                "gluon_fused_late_dq": [Unit("gluon_fused_late_dq", True, True, config,
                                             gluon(True, True, late_dq=True))],
                "gluon_fused_stores": [Unit("gluon_fused_stores", True, True, config,
                                            gluon(True, True, late_dq=False, timing_only_stores=True),
                                            timing_only=True)]}[mode]

    def variant(launch):
        return lambda cfg, p, dq, dkv: variants.launch_variant(launch, cfg, p.q, p.kv, p.idx, p.dout, p.lse, p.delta,
                                                               dq, dkv, p.scale, V_DIM)

    launches = variants.MODES.get(mode) or variants.TIMING_ONLY[mode]
    return [Unit(launch.kind, launch.do_dq, launch.do_dkv, list(launch.configs), variant(launch),
                 timing_only=launch.red == variants.RED_STORES) for launch in launches]


def window_indices(T: int, topk: int = TOPK, device: str = "cuda") -> torch.Tensor:
    """Each query's last `topk` keys, itself included, -1 before the sequence's start: as many keys per row as the
    indexer's causal rows, with neighbouring queries sharing nearly all of them (the gathers' best case for L2)."""
    rows = torch.arange(T, device=device)[:, None] - torch.arange(topk, device=device)[None, :]
    return torch.where(rows >= 0, rows, -1).to(torch.int32)


def make_problem(T: int, selection: str = "indexer") -> Problem:
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415

    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(T, H, V_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = _indices(T) if selection == "indexer" else window_indices(T)
    out, lse = mla.sparse_mla_fwd(q, kv, idx, D**-0.5, V_DIM)
    delta = mla.bwd_delta(out, dout, None)
    return Problem(q, kv, idx, dout, lse, delta, sparse_flops(idx)[1])


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, in float32 chunks (the 64K tensors are several GB)."""
    num = den = 0.0
    for a, b in zip(x.flatten().split(1 << 26), ref.flatten().split(1 << 26)):
        a, b = a.float(), b.float()
        num += float((a - b).square().sum())
        den += float(b.square().sum())
    return math.sqrt(num / max(den, 1e-30))


def resources(kernel) -> tuple[int | None, int | None, float | None]:
    """Registers, spilled bytes per thread and shared memory (KB) of a compiled Triton kernel, if it tells."""
    try:
        kernel._init_handles()
        return int(kernel.n_regs), int(kernel.n_spills), kernel.metadata.shared / 1024
    except Exception:  # noqa: BLE001 (Triton-version dependent; informational)
        return None, None, None


def measure(T: int, mode: str, unit: Unit, cfg, p: Problem, budget_s: float) -> Result:
    """Run one launch config once (checked against the fused mode), then time it."""
    label = config_label(cfg)
    res = Result(T, mode, unit.label, label)
    dq = torch.zeros_like(p.q)
    dkv = torch.zeros(p.kv.shape, dtype=torch.float32, device=p.kv.device)
    try:
        kernel = unit.run(cfg, p, dq, dkv)
        if dq.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit is a row, not a crash)
        res.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        log.info("T=%d %s %s %s: %s", T, mode, unit.label, label, res.note)
        return res
    res.regs, res.spills, res.shared_kb = resources(kernel)
    if p.ref:
        res.err_dq = rel_l2(dq, p.ref[0]) if unit.do_dq else None
        res.err_dkv = rel_l2(dkv, p.ref[1]) if unit.do_dkv else None
    if unit.timing_only:
        res.note = "timing only: dKV by plain stores, not summed"
    if not unit.timing_only and max(e for e in (res.err_dq, res.err_dkv, 0.0) if e is not None) > MAX_REL_ERR:
        res.note = f"wrong: rel L2 above {MAX_REL_ERR}"
    else:
        def once():
            if unit.do_dkv:
                dkv.zero_()
            unit.run(cfg, p, dq, dkv)

        res.ms = timed(once, budget_s, max_reps=10)
        if unit.do_dq and unit.do_dkv:
            res.tflops = p.bwd_flops / (res.ms * 1e-3) / 1e12
    log.info("T=%d %s %s %s: %s ms, err dq %s dkv %s, regs %s spills %s %s", T, mode, unit.label, label, res.ms,
             res.err_dq, res.err_dkv, res.regs, res.spills, res.note)
    return res


def summarize(results: list[Result], flops: dict[int, float]) -> dict[str, dict[int, dict]]:
    """Per mode and length: the time of the whole mode where it was measured (launch "whole"), else the sum over its
    launches of their fastest correct times; and its TFLOP/s."""
    best: dict[tuple, Result] = {}
    units: dict[str, set] = {}
    for r in results:
        units.setdefault(r.mode, set()).add(r.unit)
        k = (r.mode, r.T, r.unit)
        if r.ms is not None and (k not in best or r.ms < best[k].ms):
            best[k] = r
    out: dict[str, dict[int, dict]] = {}
    for mode, names in units.items():
        for T in sorted({r.T for r in results if r.mode == mode}):
            picked = [best.get((mode, T, u)) for u in sorted(names - {WHOLE})]
            whole = best.get((mode, T, WHOLE))
            if whole or all(picked):
                ms = whole.ms if whole else sum(r.ms for r in picked)
                out.setdefault(mode, {})[T] = dict(ms=ms, tflops=flops[T] / (ms * 1e-3) / 1e12,
                                                   configs={r.unit: r.config for r in picked if r})
    return out


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(results: list[Result], summary: dict, lengths: list[int], notes: list[str]) -> str:
    """The summary table (mode x length) and every measured row."""
    header = " | ".join(f"{T} ms | TFLOP/s" for T in lengths)
    lines = [f"| mode | {header} | configs (heads, keys, warps, stages) |",
             "|---|" + "---|---|" * len(lengths) + "---|"]
    ranked = sorted(summary, key=lambda m: summary[m].get(lengths[0], {}).get("ms", math.inf))
    for mode in ranked:
        cells = []
        for T in lengths:
            s = summary[mode].get(T)
            cells.append(f"{s['ms']:.2f} | {s['tflops']:.0f}" if s else " | ")
        cfgs = next(iter(summary[mode].values()))["configs"]
        configs = "; ".join(f"{u}: {c}" for u, c in cfgs.items())
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {configs} |")
    lines += ["", "| T | mode | launch | config | ms | TFLOP/s | rel L2 dq | rel L2 dkv | regs | spilled B | shared KB "
                  "| note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.T} | {r.mode} | {r.unit} | {r.config} | {_fmt(r.ms, '.2f')} | {_fmt(r.tflops, '.0f')} | "
                     f"{_fmt(r.err_dq, '.1e')} | {_fmt(r.err_dkv, '.1e')} | {_fmt(r.regs, 'd')} | "
                     f"{_fmt(r.spills, 'd')} | {_fmt(r.shared_kb, '.0f')} | {r.note} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def config_label(cfg) -> str:
    return "fastest of each" if cfg is None else f"{cfg.block_h}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}"


def whole_mode(mode: str, fastest: dict[str, object]) -> Unit | None:
    """A variant mode of several kernels run as `run_mode` runs it (streams included), each kernel at its fastest
    config; None for one-kernel modes, the original split, or a kernel without a correct config."""
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415

    launches = variants.MODES.get(mode, ())
    if len(launches) < 2 or any(launch.kind not in fastest for launch in launches):
        return None
    key = (H, D, V_DIM, torch.bfloat16)
    for launch in launches:
        mla._chosen[(launch.kind, key)] = fastest[launch.kind]

    def run(cfg, p, dq, dkv):
        variants.run_mode(mode, key, p.q, p.kv, p.idx, p.dout, p.lse, p.delta, dq, dkv, p.scale, V_DIM)

    return Unit(WHOLE, True, True, [None], run)


def run(lengths: list[int], modes: list[str], budget_s: float, time_limit: float, results: list[Result],
        flops: dict[int, float], notes: list[str], max_configs: int | None = None, selection: str = "indexer") -> None:
    """Every mode at every length (configs swept at the first), until the time limit; appends to results, flops
    (backward FLOPs by length) and notes as it goes, so a crash still leaves what ran."""
    t0 = time.time()
    chosen: dict[tuple[str, str], list] = {}  # (mode, launch) -> configs to run at later lengths
    for i, T in enumerate(lengths):
        if time.time() - t0 > time_limit:
            notes.append(f"T={T} not run: past the time limit ({time_limit:.0f} s)")
            continue
        p = make_problem(T, selection)
        flops[T] = p.bwd_flops
        reference = mode_units("fused")[0]
        dq = torch.zeros_like(p.q)
        dkv = torch.zeros(p.kv.shape, dtype=torch.float32, device=p.kv.device)
        reference.run(reference.configs[0], p, dq, dkv)
        p.ref = (dq, dkv)
        done: dict[tuple[str, str], Result] = {}  # a launch shared by several modes (split's dQ) runs once
        for mode in modes:
            fastest = {}  # launch -> its fastest correct config at this length
            for unit in mode_units(mode):
                tried = []
                for cfg in unit.configs[:max_configs] if i == 0 else chosen.get((mode, unit.label), []):
                    if time.time() - t0 > time_limit:
                        notes.append(f"T={T} {mode} {unit.label} {config_label(cfg)}: not run, past the time limit")
                        continue
                    key = (unit.label, config_label(cfg))
                    res = done[key] = done.get(key) or measure(T, mode, unit, cfg, p, budget_s)
                    results.append(Result(**{**asdict(res), "mode": mode}))
                    tried.append((res, cfg))
                timed_ok = [(r.ms, n, cfg) for n, (r, cfg) in enumerate(tried) if r.ms is not None]
                if timed_ok:
                    fastest[unit.label] = min(timed_ok)[2]
                if i == 0 and timed_ok:
                    chosen[(mode, unit.label)] = [min(timed_ok)[2]]
            unit = whole_mode(mode, fastest)
            if unit is not None and time.time() - t0 <= time_limit:
                results.append(measure(T, mode, unit, None, p, budget_s))
        p = dq = dkv = None
        torch.cuda.empty_cache()


def main() -> None:
    from slime_dsa.ops import triton_sparse_mla as mla  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla_bwd_variants as variants  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536])
    # inline PTX modes last: a fault there (a bad address kills the CUDA context) leaves the others measured
    # split64_stores (not a mode: variants.TIMING_ONLY) times split64 without its dKV atomics, when asked
    parser.add_argument("--modes", nargs="+", default=sorted(mla.BWD_MODES, key=lambda m: "red" in m),
                        choices=[*mla.BWD_MODES, *variants.TIMING_ONLY, *GLUON_MODES])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repetitions per measurement")
    parser.add_argument("--max-configs", type=int, default=None, help="sweep only the first N configs of a launch")
    parser.add_argument("--time-limit", type=float, default=200.0, help="stop starting measurements after this")
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here (tables: .md)")
    parser.add_argument("--selection", choices=["indexer", "window"], default="indexer",
                        help="each query's keys: the indexer's top-k on random inputs, or its last top-k keys")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.time()
    results: list[Result] = []
    flops: dict[int, float] = {}
    notes: list[str] = []
    try:
        run(args.lengths, args.modes, args.budget, args.time_limit, results, flops, notes, args.max_configs,
            args.selection)
    except Exception as exc:  # noqa: BLE001 (report what ran before the failure)
        log.exception("run stopped")
        notes.append(f"run stopped: {type(exc).__name__}: {str(exc)[:300]}")
    notes.append(f"selection: {args.selection}; {torch.cuda.get_device_name()}; torch {torch.__version__}; triton "
                 f"{__import__('triton').__version__}; {time.time() - started:.0f} s")
    summary = summarize(results, flops)
    table = markdown(results, summary, args.lengths, notes)
    print(table)
    if args.out:  # the JSON, and the tables beside it (.md)
        out = Path(args.out)
        out.write_text(json.dumps(dict(results=[asdict(r) for r in results], summary=summary, notes=notes), indent=1))
        out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()

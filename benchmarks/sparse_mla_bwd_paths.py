"""The sparse MLA backward's two paths for subset selections, side by side on one GPU: the masked key-range kernels
(dense work over each row's range, a byte map of the selected keys, no atomics) against the general kernel (the
selected keys only, float32 atomics on dKV). The data for `MASKED_RANGE_MAX_RATIO`, the rule that picks between them.

    PYTHONPATH=. python benchmarks/sparse_mla_bwd_paths.py --out paths.md

Causal top-k rows from the Triton indexer on random inputs (benchmarks/dsa_kernels.py's), one sequence per length,
bf16, D = 576 (latent 512 + rope 64), value 512; heads as given (GLM-5: 64; the small preset: 12).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from benchmarks.dsa_kernels import _indices, timed


def time_paths(T: int, heads: int, topk: int, budget_s: float) -> dict:
    """Milliseconds of the masked range backward and of the general one at this shape, and the range/selected ratio."""
    import benchmarks.dsa_kernels as bench  # noqa: PLC0415
    from slime_dsa.ops import triton_sparse_mla as k  # noqa: PLC0415

    bench.TOPK = topk
    bench._indices_cache.clear()
    indices = _indices(T).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, heads, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(T, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(T, heads, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 576**-0.5
    out, lse = k.sparse_mla_fwd(q, kv, indices, scale, 512)
    ranges = k.selection_ranges(indices, max_ratio=1e9)
    selected = float((indices >= 0).sum())
    row = {"T": T, "heads": heads, "topk": topk,
           "ratio": float((ranges.hi - ranges.lo).sum()) / selected if ranges is not None else None}

    def general() -> None:
        k.USE_KEY_RANGES = False
        try:
            k.sparse_mla_bwd(q, kv, indices, out, lse, dout, None, scale, 512)
        finally:
            k.USE_KEY_RANGES = True

    def masked() -> None:
        delta = k.bwd_delta(out, dout, None)
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        k.range_mla_bwd(q, kv, ranges.lo, ranges.hi, dout, lse, delta, dq, dkv, scale, 512, sel=ranges.sel)

    row["general_ms"] = timed(general, budget_s)
    row["masked_ms"] = timed(masked, budget_s) if ranges is not None else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="64:2048:4096,64:2048:8192,64:2048:16384,16:512:1024,16:512:2048,"
                                            "12:256:300,12:256:1000,12:256:4096",
                        help="heads:topk:tokens, comma-separated (64:2048 GLM-5; 16:512 megatron_vs_fsdp.py's 1b)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of repetitions per measurement")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"Date: {datetime.date.today()}; GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}",
             f"Command: `PYTHONPATH=. python {' '.join(sys.argv)}`", "",
             "| heads | top-k | tokens | range / selected keys | general (atomic) ms | masked range ms | general / masked |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in args.shapes.split(","):
        heads, topk, tokens = (int(x) for x in shape.split(":"))
        r = time_paths(tokens, heads, topk, args.budget)
        speed = f"{r['general_ms'] / r['masked_ms']:.2f}x" if r["masked_ms"] else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "map too large"
        lines.append(f"| {heads} | {topk} | {tokens} | {ratio} | {r['general_ms']:.2f} | "
                     f"{r['masked_ms'] or float('nan'):.2f} | {speed} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""The prefill indexer's scoring kernel with (query, head) rows x keys (now) against one (keys x heads) product a
query (`triton_indexer.SCORES_KEYS_BY_HEADS`), at issue 20's lengths, in one process.

    PYTHONPATH=. python benchmarks/indexer_scores_variants.py --lengths 32768 65536

`dsa_kernels.py`'s indexer inputs (32 heads x 128, top-k 2048, one causal sequence, bf16 random values). Each
length times the scoring pass alone and the whole `indexer_topk`, the two variants alternating, and compares the
variant's scores and selection with the current kernel's (a different summation order may move a near-tie).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.dsa_kernels import DI, HI, TOPK, indexer_scores_only, tflops, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repetitions per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("indexer_scores_variants.py needs a CUDA GPU")
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    print(f"{torch.cuda.get_device_name()}; `{' '.join(sys.argv)}`\n")
    print("| T | variant | scoring ms | scoring TFLOP/s | indexer_topk ms | selection differs (share of slots) |")
    print("|---|---|---:|---:|---:|---:|")
    for T in args.lengths:
        torch.manual_seed(T)
        q = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(T, HI, device="cuda") * HI**-0.5
        cu = torch.tensor([0, T], device="cuda")
        flops = 2.0 * HI * DI * T * (T + 1) / 2
        results, selections = {}, {}
        for _ in range(2):  # alternating rounds; each variant keeps its faster round
            for variant in (False, True):
                ti.SCORES_KEYS_BY_HEADS = variant
                score_ms = timed(lambda: indexer_scores_only(q, k, w, cu, TOPK, DI**-0.5), args.budget)
                topk_ms = timed(lambda: ti.indexer_topk(q, k, w, cu, cu, TOPK, DI**-0.5), args.budget)
                best = results.get(variant, (float("inf"), float("inf")))
                results[variant] = (min(best[0], score_ms), min(best[1], topk_ms))
                selections[variant] = ti.indexer_topk(q, k, w, cu, cu, TOPK, DI**-0.5)
        ti.SCORES_KEYS_BY_HEADS = False
        differs = (selections[True] != selections[False]).float().mean().item()
        for variant, label in ((False, "(query, head) rows x keys"), (True, "keys x heads, a product a query")):
            score_ms, topk_ms = results[variant]
            print(f"| {T} | {label} | {score_ms:.2f} | {tflops(flops, score_ms):.0f} | {topk_ms:.2f} | "
                  f"{'-' if not variant else f'{differs:.2e}'} |", flush=True)
        del q, k, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

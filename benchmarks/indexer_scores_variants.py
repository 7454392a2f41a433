"""The prefill indexer's scoring kernel with (query, head) rows x keys against one (keys x heads) product a query
(`triton_indexer.SCORES_KEYS_BY_HEADS`), and its select (`triton_topk.topk_select`, a program a row) against the
sampled select (`triton_topk_sampled.topk_select_sampled`, its tail in five launches and in one), at issue 20's lengths.

    PYTHONPATH=. python benchmarks/indexer_scores_variants.py --lengths 32768 65536

`dsa_kernels.py`'s indexer inputs (32 heads x 128, top-k 2048, one causal sequence, bf16 random values). Each
length times the scoring pass alone and the whole `indexer_topk`, the two variants alternating, and compares the
variant's scores and selection with the current kernel's (a different summation order may move a near-tie). The
selects run on each chunk's scores in turn (summed over the chunks) and must agree exactly.
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
    default, selects = ti.SCORES_KEYS_BY_HEADS, []
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
        ti.SCORES_KEYS_BY_HEADS = default
        differs = (selections[True] != selections[False]).float().mean().item()
        for variant, label in ((False, "(query, head) rows x keys"), (True, "keys x heads, a product a query")):
            score_ms, topk_ms = results[variant]
            print(f"| {T} | {label} | {score_ms:.2f} | {tflops(flops, score_ms):.0f} | {topk_ms:.2f} | "
                  f"{'-' if not variant else f'{differs:.2e}'} |", flush=True)
        selects.append(time_selects(T, q, k, w, cu, args.budget))
        del q, k, w
        torch.cuda.empty_cache()
    print("\n| T | radix select, a program a row: ms | sampled select, tail in five launches ms | sampled, tail in one "
          "launch a row ms | equal |\n|---|---:|---:|---:|---|")
    for T, (radix_ms, sampled_ms, fused_ms, equal) in zip(args.lengths, selects):
        print(f"| {T} | {radix_ms:.2f} | {sampled_ms:.2f} | {fused_ms:.2f} | {equal} |")


def time_selects(T: int, q, k, w, cu, budget_s: float) -> tuple[float, float, float, bool]:
    """(radix ms, sampled ms with its tail in five launches, the same with its tail in one launch a row, all three give
    the same positions) of the selects over every chunk of the indexer's plan."""
    from functools import partial  # noqa: PLC0415

    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415
    from slime_dsa.ops.reference import _query_positions  # noqa: PLC0415
    from slime_dsa.ops.triton_topk import topk_select  # noqa: PLC0415
    from slime_dsa.ops.triton_topk_sampled import topk_select_sampled  # noqa: PLC0415

    cu_list = cu.tolist()
    block_m = ti.block_queries(q.shape[1], cu_list)
    n_valid = _query_positions(cu, cu, T)[1] + 1
    selects = (topk_select, partial(topk_select_sampled, fused_tail=False),
               partial(topk_select_sampled, fused_tail=True))
    total_ms = [0.0] * len(selects)
    equal = True
    for r0, r1, width, blocks in ti._plan_chunks(cu_list, cu_list, TOPK, block_m):
        scores = ti.score_rows(r1 - r0, width, q.device)
        ti.launch_scores(q, k, w, scores, blocks, r0, width, DI**-0.5, block_m)
        rows_valid = n_valid[r0:r1]
        chunk_budget = budget_s * (r1 - r0) / T
        for i, select in enumerate(selects):
            total_ms[i] += timed(lambda: select(scores, rows_valid, TOPK), chunk_budget, max_reps=3)
        want = topk_select(scores, rows_valid, TOPK)
        equal &= all(torch.equal(want, select(scores, rows_valid, TOPK)) for select in selects[1:])
    return (*total_ms, equal)


if __name__ == "__main__":
    main()

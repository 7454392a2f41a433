"""The prefill indexer's scoring kernel in its products and launch shapes (`triton_indexer.SCORES_PRODUCT`,
ROWS_PER_PROGRAM, BLOCK_N, TILES_PER_PROGRAM, SCORES_WARPS), and its select (`triton_topk.topk_select`, a program a row)
against the sampled select (`triton_topk_sampled.topk_select_sampled`, its tail in five launches and in one), at issue
20's lengths.

    PYTHONPATH=. python benchmarks/indexer_scores_variants.py --lengths 32768 65536

`dsa_kernels.py`'s indexer inputs (32 heads x 128, top-k 2048, one causal sequence, bf16 random values). Each
length times the scoring pass alone and the whole `indexer_topk` of every variant, in alternating rounds (each keeps
its fastest), and compares each variant's selection with the current settings' (a different summation order may move
a near-tie). The selects run on each chunk's scores in turn (summed over the chunks) and must agree exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import torch

from benchmarks.dsa_kernels import DI, HI, TOPK, indexer_scores_only, tflops, timed

def launch(product: str, rows: int = 128, block_n: int = 128, tiles: int = 4, warps: int = 8, stages: int = 2) -> dict:
    """The module settings of slime_dsa/ops/triton_indexer.py that make one scoring variant."""
    return {"SCORES_PRODUCT": product, "ROWS_PER_PROGRAM": rows, "BLOCK_N": block_n, "TILES_PER_PROGRAM": tiles,
            "SCORES_WARPS": warps, "SCORES_STAGES": stages}


COLUMNS = "keys x (query, head) columns"
# "current" changes nothing (the module's defaults); the others set every launch setting.
VARIANTS: dict[str, dict] = {
    "current": {},
    "(query, head) rows x keys": launch("rows_by_keys"),
    "keys x heads, a product a query (the default before 2026-12-07)": launch("keys_by_heads"),
    f"{COLUMNS}, 4 queries": launch("keys_by_query_heads"),
    f"{COLUMNS}, 4 queries, 4 warps": launch("keys_by_query_heads", warps=4),
    f"{COLUMNS}, 4 queries, 8 tiles, 3 stages": launch("keys_by_query_heads", tiles=8, stages=3),
    f"{COLUMNS}, 8 queries": launch("keys_by_query_heads", rows=256),
    f"{COLUMNS}, 8 queries, 64-key tiles x 4": launch("keys_by_query_heads", rows=256, block_n=64, tiles=4),
    f"{COLUMNS}, 8 queries, 64-key tiles x 8": launch("keys_by_query_heads", rows=256, block_n=64, tiles=8),
    f"{COLUMNS}, 8 queries, 64-key tiles x 16": launch("keys_by_query_heads", rows=256, block_n=64, tiles=16),
    f"{COLUMNS}, 8 queries, 64-key tiles x 8, 3 stages": launch("keys_by_query_heads", rows=256, block_n=64, tiles=8,
                                                                  stages=3),
    f"{COLUMNS}, 16 queries, 64-key tiles x 8": launch("keys_by_query_heads", rows=512, block_n=64, tiles=8),
}


def settings(module, values: dict):
    """A context in which the module's attributes take `values` (unittest.mock.patch.multiple; none: no change)."""
    return mock.patch.multiple(module, **values) if values else contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repetitions per measurement")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--no-selects", action="store_true", help="skip the select comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("indexer_scores_variants.py needs a CUDA GPU")
    from slime_dsa.ops import triton_indexer as ti  # noqa: PLC0415

    names = ["current"] + [n for n in args.variants if n != "current"]
    print(f"{torch.cuda.get_device_name()}; `{' '.join(sys.argv)}`; current: {ti.SCORES_PRODUCT}, "
          f"{ti.ROWS_PER_PROGRAM} rows, {ti.BLOCK_N} x {ti.TILES_PER_PROGRAM} keys, {ti.SCORES_WARPS} warps\n")
    selects = []
    print("| T | variant | scoring ms | scoring TFLOP/s | indexer_topk ms | / current | selection differs (share of slots) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for T in args.lengths:
        torch.manual_seed(T)
        q = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(T, DI, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(T, HI, device="cuda") * HI**-0.5
        cu = torch.tensor([0, T], device="cuda")
        flops = 2.0 * HI * DI * T * (T + 1) / 2
        results, differs = {}, {}
        want = ti.indexer_topk(q, k, w, cu, cu, TOPK, DI**-0.5)
        for _ in range(2):  # alternating rounds; each variant keeps its faster round
            for name in names:
                with settings(ti, VARIANTS[name]):
                    score_ms = timed(lambda: indexer_scores_only(q, k, w, cu, TOPK, DI**-0.5), args.budget)
                    topk_ms = timed(lambda: ti.indexer_topk(q, k, w, cu, cu, TOPK, DI**-0.5), args.budget)
                    got = ti.indexer_topk(q, k, w, cu, cu, TOPK, DI**-0.5)
                best = results.get(name, (float("inf"), float("inf")))
                results[name] = (min(best[0], score_ms), min(best[1], topk_ms))
                differs[name] = (got != want).float().mean().item()
                del got
        for name in names:
            score_ms, topk_ms = results[name]
            print(f"| {T} | {name} | {score_ms:.2f} | {tflops(flops, score_ms):.0f} | {topk_ms:.2f} | "
                  f"{topk_ms / results['current'][1]:.3f} | {differs[name]:.2e} |", flush=True)
        if not args.no_selects:
            selects.append(time_selects(T, q, k, w, cu, args.budget))
        del q, k, w, want
        torch.cuda.empty_cache()
    if selects:
        print("\n| T | radix select, a program a row: ms | sampled select, tail in five launches ms | sampled, tail in "
              "one launch a row ms | equal |\n|---|---:|---:|---:|---|")
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

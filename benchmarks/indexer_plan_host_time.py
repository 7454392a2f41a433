"""The Triton indexer's launch plan on the host, per full-indexer layer of a training forward: the numpy plan
(slime_dsa/ops/indexer_plan.py) against the loop over sequences and blocks it replaced (tests/test_indexer_plan.py's
reference, its blocks then made a tensor from Python lists as the loop's were), alternating in one process.

The batch is the one-GPU recipe's 64 x 16 countdown step in the shared-prompt layout: per group a prompt sequence of
70-100 tokens and 16 response sequences of 10-30 that see it first (1,088 sequences); top-k 256, 16 indexer heads.

    PYTHONPATH=$PWD python benchmarks/indexer_plan_host_time.py --rounds 9
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import ratio_in_turn, time_in_turn  # noqa: E402  (beside this script)

from slime_dsa.ops.indexer_plan import plan_chunks  # noqa: E402
from tests.test_indexer_plan import loop_plan  # noqa: E402

CHUNK_ELEMS = 1 << 28  # triton_indexer.CHUNK_ELEMS (that module needs Triton)
BLOCK_M = 8  # triton_indexer.block_queries(16 heads, this batch)


def shared_prompt_batch(groups: int, group_size: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lens_q, lens_k = [], []
    for _ in range(groups):
        prompt = rng.randint(70, 100)
        lens_q.append(prompt)
        lens_k.append(prompt)
        for _ in range(group_size):
            answer = rng.randint(10, 30)
            lens_q.append(answer)
            lens_k.append(prompt + answer)
    return list(itertools.accumulate(lens_q, initial=0)), list(itertools.accumulate(lens_k, initial=0))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    cu_q, cu_k = shared_prompt_batch(args.groups, args.group_size)

    def loop() -> None:
        for *_, blocks in loop_plan(cu_q, cu_k, args.topk, BLOCK_M, CHUNK_ELEMS):
            torch.tensor([tuple(column) for column in blocks.T.tolist()], dtype=torch.int32).T.contiguous()

    def vectorised() -> None:
        for *_, blocks in plan_chunks(cu_q, cu_k, args.topk, BLOCK_M, CHUNK_ELEMS):
            torch.from_numpy(blocks)

    sides = {"loop (before)": loop, "numpy (this tree)": vectorised}
    times = time_in_turn(sides, args.rounds, clock=time.perf_counter)
    result = {side: statistics.median(v) for side, v in times.items()}
    ratio, low, high = ratio_in_turn(times, "numpy (this tree)", "loop (before)")
    print(f"{len(cu_q) - 1} sequences, {cu_q[-1]} query rows; ms per layer's plan, median of {args.rounds}: "
          + ", ".join(f"{side} {ms:.3f}" for side, ms in result.items())
          + f"; numpy / loop median {ratio:.3f} ({low:.3f}-{high:.3f})")
    return {"ms": result, "ratio": ratio}


if __name__ == "__main__":
    main()

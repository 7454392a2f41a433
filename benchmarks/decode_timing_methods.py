"""Decode sparse MLA and the paged indexer at batch 128 x 64K, each timed three ways: eagerly with a sync a
repetition (`dsa_kernels.timed`, which also counts the host's launch), eagerly with the repetitions queued back to
back, and as CUDA-graph replays (how the engine's decode step runs them). Issue 20's decode goal compares the two
kernels' device times, so its yardstick must not carry sparse MLA's host launch.

    PYTHONPATH=. python benchmarks/decode_timing_methods.py
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch


def back_to_back(fn: Callable[[], object], reps: int = 50) -> float:
    """Median ms of eager calls queued without a sync between them."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("decode_timing_methods.py needs a CUDA GPU")
    from benchmarks.dsa_kernels import DI, TOPK, V_DIM, D, decode_case, graph_timed, timed  # noqa: PLC0415
    from slime_dsa.ops.triton_indexer_paged import indexer_topk_paged  # noqa: PLC0415
    from slime_dsa.ops.triton_sparse_mla import sparse_mla_attention  # noqa: PLC0415

    batch, ctx = 128, 65536
    c = decode_case(batch, ctx)
    kernels = {
        "sparse MLA": lambda: sparse_mla_attention(c.q, c.kv, c.rows, D**-0.5, V_DIM),
        "paged indexer bf16": lambda: indexer_topk_paged(c.iq, c.ik, c.iw, c.slots, c.lens, TOPK, DI**-0.5),
        "paged indexer fp8": lambda: indexer_topk_paged(c.iq, c.ik8, c.iw, c.slots, c.lens, TOPK, DI**-0.5,
                                                        c.key_scales),
    }
    print(f"{torch.cuda.get_device_name()}; batch {batch} x {ctx}; ms\n")
    print("| round | kernel | a sync a repetition | back to back | CUDA-graph replay |\n|---:|---|---:|---:|---:|")
    with torch.no_grad():
        for round_ in range(2):
            for name, fn in kernels.items():
                print(f"| {round_} | {name} | {timed(fn, 0.5):.3f} | {back_to_back(fn):.3f} | {graph_timed(fn):.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()

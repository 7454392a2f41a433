"""The policy's log-probs over a train call's response rows, forward and backward, in chunks of 1,024 rows (before)
against chunks as wide as CHUNK_LOGITS_ELEMENTS logits (slime_dsa/models/logprobs.py now does so on a GPU),
alternating in one process. At countdown's 384-token vocabulary a 64 x 16 step's ~26,000 rows took ~25 chunks,
each a dozen ops each way; now one. On a GPU the figure is each call's wall time (synchronised), on a CPU the
thread's CPU time (time.thread_time); the wide side is asked for explicitly, so a CPU runs it too.

    PYTHONPATH=$PWD python benchmarks/logprob_chunks_host_time.py --rows 25794 --vocab 384 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slime_dsa.models import logprobs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=25794)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(args.rows, args.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)
    widest = logprobs.CHUNK_LOGITS_ELEMENTS
    wide_rows = max(1024, widest // args.vocab)
    sides = {"1,024 rows a chunk (before)": (0, 1024), "wide chunks (this tree)": (widest, wide_rows)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time

    def call(rows: int) -> torch.Tensor:
        logp, entropy = logprobs.chunked_token_logprobs(hidden, weight, targets, chunk_size=rows, return_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        return logp.detach().float().cpu()

    times: dict[str, list[float]] = {side: [] for side in sides}
    values = {}
    for _ in range(args.rounds):
        for side, (elements, rows) in sides.items():
            logprobs.CHUNK_LOGITS_ELEMENTS = elements
            values[side] = call(rows)
            sync()
            start = clock()
            for _ in range(args.calls):
                call(rows)
            sync()
            times[side].append((clock() - start) / args.calls * 1e3)
    logprobs.CHUNK_LOGITS_ELEMENTS = widest
    result = {side: statistics.median(v) for side, v in times.items()}
    ratios = [b / a for a, b in zip(*times.values())]
    close = torch.allclose(*values.values(), atol=1e-5 if dtype == torch.float32 else 1e-2)
    print(f"{args.rows} rows, vocab {args.vocab}, {device.type}: forward + backward, ms a call (median of {args.rounds}): "
          + ", ".join(f"{side} {ms:.2f}" for side, ms in result.items())
          + f"; this / before median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
          f"log-probs close: {close}")
    return {"ms": result, "ratio": statistics.median(ratios), "close": close}


if __name__ == "__main__":
    main()

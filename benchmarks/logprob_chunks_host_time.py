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
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import ratio_in_turn, time_in_turn  # noqa: E402  (beside this script)

from slime_dsa.models import logprobs  # noqa: E402


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

    def side(elements: int, rows: int) -> torch.Tensor:
        logprobs.CHUNK_LOGITS_ELEMENTS = elements
        return call(rows)

    values = {name: side(*widths) for name, widths in sides.items()}
    times = time_in_turn({name: lambda w=widths: side(*w) for name, widths in sides.items()}, args.rounds,
                         args.calls, clock=clock, sync=sync, warm_up=True)
    logprobs.CHUNK_LOGITS_ELEMENTS = widest
    result = {name: statistics.median(v) for name, v in times.items()}
    ratio, low, high = ratio_in_turn(times, "wide chunks (this tree)", "1,024 rows a chunk (before)")
    close = torch.allclose(*values.values(), atol=1e-5 if dtype == torch.float32 else 1e-2)
    print(f"{args.rows} rows, vocab {args.vocab}, {device.type}: forward + backward, ms a call (median of {args.rounds}): "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in result.items())
          + f"; this / before median {ratio:.2f} ({low:.2f}-{high:.2f}); "
          f"log-probs close: {close}")
    return {"ms": result, "ratio": ratio, "close": close}


if __name__ == "__main__":
    main()

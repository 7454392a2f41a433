"""One micro-batch through the one-GPU rank's bf16 compute copy (trainers/fsdp/bf16_compute.py): forward, backward
and the sums into the master's float32 gradients, this tree's copy against another checkout's, in turn in one process.

The copy is built from one float32 master by each tree's `Bf16Compute` and gradient sums (grad_bookkeeping_host_time's
`copy_class`; the model code is this tree's in both); the experts take their grouped GEMM (a GPU's bf16 path). Per
call, timed on the calling thread's CPU clock (time.thread_time), or on a GPU (where torch sees one) on the wall clock
between synchronised ends: the log-probs of --samples sequences of --length tokens, the backward of their mean, then
`accumulate_gradients` and `zero_grad`. --narrow keeps the preset's structure (the same parameter tensors and ops) at
the tiny preset's widths, so the host work of ops and autograd nodes shows rather than the matmuls'. Counted once per
side: the aten ops dispatched in the forward and in the backward (views among them, which launch no kernel on a GPU
but cost host time), the autograd nodes of the loss's graph and its gradient accumulations, and whether the master's
gradients of both sides are equal.

    PYTHONPATH=$PWD python benchmarks/copy_micro_batch_host_time.py --preset small --narrow --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import add_in_turn_arguments, report_in_turn, time_in_turn  # noqa: E402
from grad_bookkeeping_host_time import copy_class  # noqa: E402
from train_call_host_time import NARROW  # noqa: E402

from slime_dsa.checkpoint.hf_format import build_model  # noqa: E402
from slime_dsa.models import PackedBatch  # noqa: E402
from slime_dsa.models.glm_moe_dsa import Experts  # noqa: E402
from slime_dsa.models.presets import preset_config  # noqa: E402


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def graph_counts(loss: torch.Tensor) -> tuple[int, int]:
    """(autograd nodes, gradient accumulations) of the graph behind `loss`."""
    seen, stack, accumulations = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        accumulations += hasattr(node, "variable")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen), accumulations


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--narrow", action="store_true", help="the preset's structure at the tiny preset's widths")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--length", type=int, default=16, help="tokens per sample")
    add_in_turn_arguments(parser, calls=5, rounds=9)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    Experts.use_grouped_mm = True
    config = preset_config(args.preset, vocab_size=384, eos_token_id=1, **(NARROW if args.narrow else {}))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    master = build_model(config, seed=0, dtype=torch.float32).to(device)
    trees = {"this tree": None} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    copies = {name: copy_class(tree)(master) for name, tree in trees.items()}
    ids = torch.randint(2, config.vocab_size, (args.samples * args.length,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    packed = PackedBatch.from_seqlens([args.length] * args.samples, device)

    def call(copy) -> None:
        loss = -copy.module.token_logprobs(ids, packed)[0].mean()
        loss.backward()
        copy.accumulate_gradients()
        copy.zero_grad()

    counts, grads = {}, {}
    for name, copy in copies.items():
        forward, backward = _OpCounter(), _OpCounter()
        with forward:
            loss = -copy.module.token_logprobs(ids, packed)[0].mean()
        nodes, accumulations = graph_counts(loss)
        with backward:
            loss.backward()
        copy.accumulate_gradients()
        grads[name] = [None if p.grad is None else p.grad.clone() for p in master.parameters()]
        copy.zero_grad()
        counts[name] = {"forward_ops": sum(forward.ops.values()), "backward_ops": sum(backward.ops.values()),
                        "autograd_nodes": nodes, "accumulations": accumulations}
    times = time_in_turn({name: lambda copy=copy: call(copy) for name, copy in copies.items()}, args.rounds,
                         args.calls, clock=time.perf_counter if device.type == "cuda" else None, sync=sync,
                         warm_up=True)
    same = len(grads) == 1 or all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                                  for a, b in zip(*grads.values()))
    tokens = args.samples * args.length
    what = f"{len(list(master.parameters()))} parameter tensors, {tokens} tokens on {device}: forward, backward and the"
    result = report_in_turn(times, what + " gradient sums" + (" (wall ms)" if device.type == "cuda" else ""))
    for name, count in counts.items():
        print(f"  {name}: {count}")
    print(f"  master gradients equal between the sides: {same}")
    Experts.use_grouped_mm = None
    return {"ms": result, "counts": counts, "same_gradients": same}


if __name__ == "__main__":
    main()

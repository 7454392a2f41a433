"""The rank's shared-prompt work on the host before a train call's first kernel, for the one-GPU recipe's 64 x 16
batch: `shared_prompt_lengths` (the micro-batching's scan) and `pack_shared_prefixes` (the layout, built on the host),
this tree's slime_dsa/models/prefix_sharing.py against --baseline-tree's, alternating in one process.

    PYTHONPATH=$PWD python benchmarks/shared_prompt_pack_host_time.py --baseline-tree /tmp/base --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import module_of  # noqa: E402  (beside this script)
from train_call_dispatch import make_batch  # noqa: E402


def _module(tree: str | None):
    return module_of(tree, "slime_dsa/models/prefix_sharing.py", "slime_dsa.models.prefix_sharing")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--baseline-tree", default=None)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batch = make_batch(args.groups, args.group_size)
    trees = {"this tree": None} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    modules = {name: _module(tree) for name, tree in trees.items()}
    reference = modules["this tree"].pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)

    def work(module) -> None:
        module.shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
        module.pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)

    for name, module in modules.items():
        pack = module.pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)
        assert torch.equal(pack.input_ids, reference.input_ids) and torch.equal(pack.response_rows,
                                                                                  reference.response_rows), name
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(args.rounds):
        for name, module in modules.items():
            start = time.thread_time()
            for _ in range(args.calls):
                work(module)
            times[name].append((time.thread_time() - start) / args.calls * 1e3)
    result = {name: statistics.median(v) for name, v in times.items()}
    line = (f"{len(batch.seqlens)} samples, {sum(batch.seqlens)} tokens: scan + pack, thread CPU ms (median of "
            f"{args.rounds}): " + ", ".join(f"{name} {ms:.2f}" for name, ms in result.items()))
    if args.baseline_tree:
        ratios = [a / b for a, b in zip(times["this tree"], times["baseline"])]
        result["ratio"] = statistics.median(ratios)
        line += f"; this / baseline median {result['ratio']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}); same layout"
    print(line)
    return result


if __name__ == "__main__":
    main()

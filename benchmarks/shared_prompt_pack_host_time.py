"""The rank's shared-prompt work on the host before a train call's first kernel, for the one-GPU recipe's 64 x 16
batch: `shared_prompt_lengths` (the micro-batching's scan) and `pack_shared_prefixes` (the layout, built on the host),
this tree's slime_dsa/models/prefix_sharing.py against --baseline-tree's, alternating in one process.

    PYTHONPATH=$PWD python benchmarks/shared_prompt_pack_host_time.py --baseline-tree /tmp/base --rounds 9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import add_in_turn_arguments, modules_in_turn, report_in_turn, time_in_turn  # noqa: E402  (beside this script)
from train_call_dispatch import make_batch  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    add_in_turn_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batch = make_batch(args.groups, args.group_size)
    modules = modules_in_turn(args.baseline_tree, "slime_dsa/models/prefix_sharing.py", "slime_dsa.models.prefix_sharing")
    reference = modules["this tree"].pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)

    def work(module) -> None:
        module.shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
        module.pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)

    for name, module in modules.items():
        pack = module.pack_shared_prefixes(batch.input_ids, batch.seqlens, batch.prompt_lens)
        assert torch.equal(pack.input_ids, reference.input_ids) and torch.equal(pack.response_rows,
                                                                                  reference.response_rows), name
    times = time_in_turn({name: lambda m=module: work(m) for name, module in modules.items()}, args.rounds, args.calls)
    return report_in_turn(times, f"{len(batch.seqlens)} samples, {sum(batch.seqlens)} tokens: scan + pack (same layout)")


if __name__ == "__main__":
    main()

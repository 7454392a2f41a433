"""The driver's packing of a step's samples into the TrainBatch (`build_train_batch`, what perf/batch_build_s
times) for the one-GPU recipe's 64 x 16 countdown step, this tree's slime_dsa/orchestrator/batching.py against
--baseline-tree's, alternating in one process.

    PYTHONPATH=$PWD python benchmarks/batch_build_host_time.py --baseline-tree /tmp/base --rounds 9
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_tree import add_in_turn_arguments, modules_in_turn, report_in_turn, time_in_turn  # noqa: E402  (beside this script)

from slime_dsa.data.sample import Sample  # noqa: E402


def countdown_samples(groups: int, group_size: int, seed: int = 0) -> list[Sample]:
    """Prompts of 70-100 tokens shared by a group (a copy per sample, as the prompt source hands them out), answers of
    10-30, as a 64 x 16 countdown step's."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(384) for _ in range(rng.randint(70, 100))]
        for s in range(group_size):
            n = rng.randint(10, 30)
            samples.append(Sample(prompt_ids=list(prompt), response_ids=[rng.randrange(384) for _ in range(n)],
                                  loss_mask=[1] * n, rollout_logprobs=[-rng.random() for _ in range(n)],
                                  reward=float(rng.random() < 0.2), group_id=g, index=g * group_size + s))
    return samples


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    add_in_turn_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    samples = countdown_samples(args.groups, args.group_size)
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))
    modules = modules_in_turn(args.baseline_tree, "slime_dsa/orchestrator/batching.py", "slime_dsa.orchestrator.batching")
    built = {name: m.build_train_batch(samples, advantages) for name, m in modules.items()}
    same = all(torch.equal(getattr(b, f), getattr(built["this tree"], f)) for b in built.values()
               for f in ("input_ids", "loss_mask", "rollout_logprobs", "advantages"))
    times = time_in_turn({name: lambda m=module: m.build_train_batch(samples, advantages)
                          for name, module in modules.items()}, args.rounds, args.calls)
    return report_in_turn(times, f"{len(samples)} samples: build_train_batch", f"; same batch: {same}")


if __name__ == "__main__":
    main()

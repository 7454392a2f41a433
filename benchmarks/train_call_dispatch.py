"""How long an RL step's batch takes to reach a trainer rank through Ray: torch's tensor pickling against the byte
arrays TrainBatch now travels as, in one process, alternating, on a batch of the one-GPU recipe's shape.

Per call: the driver's split of the batch by data-parallel rank (`RayTrainerGroup._shards`, one rank: the old split
against the one-rank shortcut), then a real Ray actor call whose method returns the wall-clock time it started
(the arguments' transfer and unpickling included). "torch" sends the batch as TrainBatch was pickled before (each
tensor through torch's reducer); "bytes" sends the TrainBatch itself.

    python benchmarks/train_call_dispatch.py --groups 64 --group-size 16 --rounds 5
"""

from __future__ import annotations

import argparse
import copyreg
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_dsa.models.prefix_sharing import shared_prompt_lengths  # noqa: E402
from trainers.base import TrainBatch, balance_across_ranks  # noqa: E402


def make_batch(groups: int, group_size: int, seed: int = 0) -> TrainBatch:
    """A packed batch like a 64 x 16 countdown step's: prompts of 70-100 tokens shared by a group, answers of 10-30."""
    rng = random.Random(seed)
    seqlens, prompt_lens, ids = [], [], []
    for _ in range(groups):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(70, 100))]
        for _ in range(group_size):
            answer = [rng.randrange(1000) for _ in range(rng.randint(10, 30))]
            ids += prompt + answer
            seqlens.append(len(prompt) + len(answer))
            prompt_lens.append(len(prompt))
    T = len(ids)
    return TrainBatch(input_ids=torch.tensor(ids), seqlens=seqlens, loss_mask=torch.rand(T).round(),
                      rollout_logprobs=-torch.rand(T), advantages=torch.randn(T), old_logprobs=-torch.rand(T),
                      prompt_lens=prompt_lens)


def old_split(batch: TrainBatch) -> list[TrainBatch]:
    """The split before the one-rank shortcut: shared prompts found, then balanced over one rank."""
    shared = shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
    return [batch.select(ids) for ids in balance_across_ranks(batch.seqlens, 1, shared)]


class TorchPickled:
    """The batch's fields, pickled as TrainBatch was before: every tensor through torch's own reducer."""

    def __init__(self, batch: TrainBatch) -> None:
        self.fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}

    def __reduce__(self):
        return (copyreg._reconstructor, (TorchPickled, object, None), {"fields": self.fields})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurements of each side")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import ray  # noqa: PLC0415

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Rank:
        def train_batches(self, shards, *rest) -> float:
            return time.time()

    rank = Rank.remote()
    batch = make_batch(args.groups, args.group_size)
    ray.get(rank.train_batches.remote([batch]))  # warm: the worker imports torch and trainers.base
    ray.get(rank.train_batches.remote([TorchPickled(batch)]))
    sides = {
        "torch": lambda: [TorchPickled(b) for b in old_split(batch)],
        "bytes": lambda: [batch],
    }
    results: dict[str, list[float]] = {name: [] for name in sides}
    split_ms: dict[str, list[float]] = {"old split": [], "one-rank shortcut": []}
    for _ in range(args.rounds):
        for name, shards in sides.items():
            times = []
            for _ in range(args.calls):
                called = time.time()
                started = ray.get(rank.train_batches.remote(shards(), [(1.0, 1)], False, True, "policy"))
                times.append(started - called)
            results[name].append(1e3 * statistics.median(times))
        for name, split in (("old split", old_split), ("one-rank shortcut", lambda b: [b])):
            start = time.perf_counter()
            for _ in range(args.calls):
                split(batch)
            split_ms[name].append(1e3 * (time.perf_counter() - start) / args.calls)
    ray.shutdown()
    print(f"batch: {len(batch.seqlens)} samples, {batch.num_tokens} tokens; {args.rounds} rounds x {args.calls} calls")
    print("| measure | before | after | after / before | before, each round | after, each round |")
    print("|---|---:|---:|---:|---|---|")
    rows = (("call to the rank's start (split, pickling, Ray), ms", results["torch"], results["bytes"]),
            ("the driver's split alone, ms", split_ms["old split"], split_ms["one-rank shortcut"]))
    for label, before, after in rows:
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {label} | {b:.2f} | {a:.2f} | {a / b:.2f} | {' '.join(f'{x:.2f}' for x in before)} | "
              f"{' '.join(f'{x:.2f}' for x in after)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"call_ms": results, "split_ms": split_ms}, indent=1))


if __name__ == "__main__":
    main()

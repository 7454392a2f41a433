"""Time one step's scoring: `compute_reward` over N samples at once, as the rollout loop calls it.

    PYTHONPATH=. python benchmarks/reward_scoring.py --samples 256 --reward arithmetic
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from rollout.rewards.compute import RewardStats, compute_reward
from rollout.rewards.registry import load_reward_fn
from slime_dsa.data.sample import Sample


def samples(n: int) -> list[Sample]:
    """Arithmetic-style samples, half right and half wrong, with answers tagged or not."""
    out = []
    for i in range(n):
        answer = str(17 * i + 3)
        text = f"Let me think. {i} plus things... <answer>{answer if i % 2 else int(answer) + 1}</answer>"
        out.append(Sample(prompt_ids=[1, 2, 3], prompt_text=f"What is {i}?", response_text=text, answer=answer,
                          task="arithmetic", index=i))
    return out


async def step(fn, batch: list[Sample]) -> float:
    stats = RewardStats()
    start = time.perf_counter()
    await asyncio.gather(*(compute_reward(fn, s, stats=stats) for s in batch))
    elapsed = time.perf_counter() - start
    assert stats.calls == len(batch) and stats.failures == 0, stats
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--reward", default="arithmetic", help="a registered name or 'package.module:function'")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    fn, batch = load_reward_fn(args.reward), samples(args.samples)

    async def run() -> list[float]:
        await step(fn, batch)  # warm-up: pools start here
        return [await step(fn, batch) for _ in range(args.repeats)]

    times = asyncio.run(run())
    print(f"{args.reward}: {args.samples} samples, scoring time per step: median {statistics.median(times) * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms over {args.repeats} steps")


if __name__ == "__main__":
    main()

"""Where the engine thread's steps spend their time, from a py-spy raw (folded) profile of a rollout benchmark.

    py-spy record -r 500 --threads --idle -f raw -o spy.txt -- python benchmarks/rollout_call_host_time.py ...
    python benchmarks/spy_steps.py spy.txt --top 25

py-spy samples every thread from outside the process, so unlike cProfile it does not slow the Python it measures.
Only samples inside `Engine.step` count. Each is charged to the innermost frame of the project's code (rollout/,
slime_dsa/) and, separately, to the innermost frame of all (torch, numpy and waits included); with --idle, samples of
a thread that waits (a CUDA event, the GIL) are in, under the frame that waits.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable

STEP_FRAME = "step (rollout/engine/engine.py"
PROJECT_PATHS = ("rollout/", "slime_dsa/")


def step_samples(lines: Iterable[str]) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples in Engine.step, samples by innermost project frame, samples by innermost frame) of folded lines
    "frame;frame;... count"."""
    by_project, by_leaf, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if STEP_FRAME not in stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        project = [f for f in frames if any(p in f for p in PROJECT_PATHS)]
        by_project[project[-1] if project else "?"] += n
        by_leaf[frames[-1]] += n
        total += n
    return total, by_project, by_leaf


def report(path: str, top: int) -> str:
    """The two tables of `path` as text: share of the step samples, frame."""
    with open(path) as f:
        total, by_project, by_leaf = step_samples(f)
    if not total:
        return f"{path}: no sample inside Engine.step"
    lines = [f"{path}: {total} samples inside Engine.step", "", "by the innermost project frame:"]
    lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in by_project.most_common(top)]
    lines += ["", "by the innermost frame:"]
    lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in by_leaf.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    args = parser.parse_args()
    print(report(args.path, args.top))


if __name__ == "__main__":
    main()

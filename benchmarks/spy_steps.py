"""Where the engine thread's steps spend their time, from a py-spy raw (folded) profile of a rollout benchmark.

    py-spy record -r 500 --threads --idle -f raw -o spy.txt -- python benchmarks/rollout_call_host_time.py ...
    python benchmarks/spy_steps.py spy.txt --top 25

py-spy samples every thread from outside the process, so unlike cProfile it does not slow the Python it measures.
Only samples inside `Engine.step` count. Each is charged to the innermost frame of the project's code (rollout/,
slime_dsa/) and, separately, to the innermost frame of all (torch, numpy and waits included); with --idle, samples of
a thread that waits (a CUDA event, the GIL) are in, under the frame that waits.

--threads adds, for each process that ran Engine.step (a recording of many processes: `py-spy record --subprocesses`,
or `--pid` of a Ray engine actor), every thread's samples and its innermost frames: what else runs in the engine's
process and may hold the GIL while a step waits for it.
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


def split_stack(stack: str) -> tuple[str, str, list[str]]:
    """A folded stack -> (its innermost process frame or "", its thread frame or "", the Python frames after it)."""
    frames = stack.split(";")
    process, thread, start = "", "", 0
    for i, frame in enumerate(frames):
        if frame.startswith("process "):
            process, start = frame, i + 1
        elif frame.startswith("thread ("):
            thread, start = frame, i + 1
            break
    return process, thread, frames[start:]


def thread_samples(lines: Iterable[str], every_process: bool = False) -> dict[str, dict[str, collections.Counter]]:
    """{process: {thread: samples by innermost frame}} of the processes that ran Engine.step (`every_process`: of all
    of them, e.g. a trainer rank's recording); a frame is shown with
    the innermost project frame above it, when there is one ("project frame <- leaf")."""
    by_process: dict[str, dict[str, collections.Counter]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter))
    engine_processes, names = set(), {}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        process, thread, frames = split_stack(stack)
        if STEP_FRAME in stack:
            engine_processes.add(process)
        project = [f for f in frames if any(p in f for p in PROJECT_PATHS)]
        leaf = frames[-1] if frames else "?"
        label = f"{project[-1]} <- {leaf}" if project and project[-1] != leaf else leaf
        tid, _, name = thread.partition(": ")  # py-spy leaves the name out of some samples of a named thread
        if name or tid not in names:
            names[tid] = name
        by_process[process][tid][label] += int(count)
    return {p: {f"{tid}: {names[tid]}" if names[tid] else tid: c for tid, c in threads.items()}
            for p, threads in by_process.items() if every_process or p in engine_processes}


def report(path: str, top: int, threads: bool = False, every_process: bool = False) -> str:
    """The two tables of `path` as text: share of the step samples, frame; `threads`: and the thread table
    (`every_process`: of every process, with or without engine steps)."""
    with open(path) as f:
        total, by_project, by_leaf = step_samples(f)
    lines = [f"{path}: {total} samples inside Engine.step"]
    if total:
        lines += ["", "by the innermost project frame:"]
        lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in by_project.most_common(top)]
        lines += ["", "by the innermost frame:"]
        lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in by_leaf.most_common(top)]
    if threads or every_process:
        with open(path) as f:
            processes = thread_samples(f, every_process)
        for process, by_thread in processes.items():
            every = sum(sum(c.values()) for c in by_thread.values())
            lines += ["", f"threads of {process or 'the process'} ({every} samples):"]
            for thread, counter in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
                n = sum(counter.values())
                lines += [f"{100 * n / every:6.1f}%  {thread}"]
                lines += [f"          {100 * k / n:5.1f}%  {frame}" for frame, k in counter.most_common(top // 4 or 1)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("--threads", action="store_true", help="also every thread of the engine's process")
    parser.add_argument("--every-process", action="store_true",
                        help="the thread table of every process (a recording without engine steps: a trainer rank)")
    args = parser.parse_args()
    print(report(args.path, args.top, args.threads, args.every_process))


if __name__ == "__main__":
    main()

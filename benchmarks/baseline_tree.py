"""A benchmark's measurement in child processes on this tree and on another checkout, alternately.

The child runs the same script with `--child` and the other tree first on PYTHONPATH, and prints its result as one
JSON line; timings on these noisy machines only count as ratios of runs taken in turn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

THIS_TREE = str(Path(__file__).resolve().parents[1])


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The script's arguments plus --out and this module's; args.forward is what a child gets. Sets up logging."""
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    add_arguments(parser)
    args, _ = parser.parse_known_args(argv)
    args.forward = forwarded_argv(argv, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return args


def answered_as_child(args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict]) -> bool:
    """In a child process: print measure(args) as the JSON line the parent reads, and say so."""
    if args.child:
        print(json.dumps(measure(args)))
    return args.child


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--baseline-tree, --rounds and the hidden --child flag."""
    parser.add_argument("--baseline-tree", default=None, help="another checkout to compare with, in child processes")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline-tree: alternating process pairs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def forwarded_argv(argv: list[str] | None, args: argparse.Namespace) -> list[str]:
    """The command line a child gets: this one without --child and --baseline-tree."""
    return [a for a in (argv if argv is not None else sys.argv[1:])
            if a != "--child" and not a.startswith("--baseline-tree") and a != args.baseline_tree]


def child_result(script: str, argv: list[str], tree: str) -> dict:
    """`script --child argv` in a fresh process with `tree` first on the path (this tree off it, other entries such as
    installed wheels kept); its last stdout line as JSON."""
    tree = str(Path(tree).resolve())
    command = [sys.executable, str(Path(script).resolve()), "--child", *argv]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(THIS_TREE)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, *rest]), "OMP_NUM_THREADS": "1"}  # wheels kept
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternate(script: str, argv: list[str], baseline_tree: str, rounds: int) -> list[dict]:
    """`rounds` pairs {"baseline": result, "this": result}, the baseline first in each."""
    return [{"baseline": child_result(script, argv, baseline_tree), "this": child_result(script, argv, THIS_TREE)}
            for _ in range(rounds)]


def module_of(tree: str | None, path: str, module: str):
    """This tree's `module` (imported by name), or `tree`'s file `path` loaded as a module of its own, so that both
    can be timed in turn in one process (its own imports still resolve to this tree)."""
    import importlib  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415

    if tree is None:
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location(f"baseline_{module.replace('.', '_')}", Path(tree) / path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # dataclasses look their module up there
    spec.loader.exec_module(loaded)
    return loaded


def time_in_turn(sides: dict[str, Callable[[], object]], rounds: int, calls: int = 1,
                 clock: Callable[[], float] | None = None, sync: Callable[[], None] = lambda: None,
                 warm_up: bool = False) -> dict[str, list[float]]:
    """Each side's mean ms a call over `calls` calls, per round, the sides taken in turn in one process (each call
    untimed once first with warm_up; `sync` before each reading, for a GPU). clock: default the thread's CPU time."""
    import time  # noqa: PLC0415

    clock = clock or time.thread_time
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, run in sides.items():
            if warm_up:
                run()
            sync()
            start = clock()
            for _ in range(calls):
                run()
            sync()
            times[side].append((clock() - start) / calls * 1e3)
    return times


def ratio_in_turn(times: dict[str, list[float]], this: str, other: str) -> tuple[float, float, float]:
    """Median, lowest and highest of the rounds' `this` / `other` ratios (from time_in_turn)."""
    import statistics  # noqa: PLC0415

    ratios = [a / b for a, b in zip(times[this], times[other])]
    return statistics.median(ratios), min(ratios), max(ratios)


def add_in_turn_arguments(parser: argparse.ArgumentParser, calls: int = 10, rounds: int = 9) -> None:
    """--baseline-tree, --calls and --rounds of a benchmark timing two trees' modules in one process (time_in_turn)."""
    parser.add_argument("--baseline-tree", default=None, help="another checkout whose module to time in turn")
    parser.add_argument("--calls", type=int, default=calls, help="timed calls per side per round")
    parser.add_argument("--rounds", type=int, default=rounds)


def modules_in_turn(baseline_tree: str | None, path: str, module: str) -> dict:
    """{"this tree": this tree's `module`} and, with a baseline tree, {"baseline": its file `path`} (module_of)."""
    trees = {"this tree": None} | ({"baseline": baseline_tree} if baseline_tree else {})
    return {name: module_of(tree, path, module) for name, tree in trees.items()}


def report_in_turn(times: dict[str, list[float]], what: str, note: str = "") -> dict:
    """Print and return each side's median ms (time_in_turn's), with "this tree" / "baseline" where both ran."""
    import statistics  # noqa: PLC0415

    result = {name: statistics.median(v) for name, v in times.items()}
    rounds = len(next(iter(times.values())))
    line = (f"{what}, thread CPU ms (median of {rounds}): "
            + ", ".join(f"{name} {ms:.2f}" for name, ms in result.items()) + note)
    if "baseline" in times:
        result["ratio"], low, high = ratio_in_turn(times, "this tree", "baseline")
        line += f"; this / baseline median {result['ratio']:.2f} ({low:.2f}-{high:.2f})"
    print(line)
    return result

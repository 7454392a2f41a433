"""Ten teachers at once on a CPU (issue 16's scale demo): recipes/opd_ten_teachers.yaml on tiny models, six teachers
on engines of their own and four in turns on one shared engine; reports the step time, how long rollout with
teacher scoring took, and each teacher's samples, scoring throughput, retries and swaps.

    python benchmarks/opd_ten_teachers.py --steps 5 --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.opd_swap_gpu import make_model  # noqa: E402

logger = logging.getLogger("opd_ten_teachers")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "opd_ten_teachers.yaml"


def markdown(args: argparse.Namespace, records: list[dict], setup_s: float) -> str:
    import torch

    later = records[1:] or records
    lines = [
        "### Ten teachers at once: recipes/opd_ten_teachers.yaml on tiny models (CPU)",
        "",
        f"- date: {datetime.date.today().isoformat()}; hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared), load average {os.getloadavg()[0]:.1f} at the end; torch {torch.__version__}",
        f"- command: `python benchmarks/opd_ten_teachers.py {shlex.join(sys.argv[1:])}`",
        f"- 10 domains x 4 prompts x 4 samples a step ({args.steps} steps), tiny preset (random weights), 2 rollout "
        f"engines, 1 trainer, t0-t5 on engines of their own, t6-t9 in turns on one shared engine; setup (Ray, 2 + 7 "
        f"engines, 1 trainer, a probe score per teacher) {setup_s:.0f} s",
        f"- step time, median over steps 2..N: {statistics.median(r['perf/step_time_s'] for r in later):.2f} s; "
        f"rollout with teacher scoring: {statistics.median(r['perf/rollout_time_s'] for r in later):.2f} s",
        "",
        "| teacher | serving | samples | scoring tok/s | retried | swaps | swap time (mean) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for i in range(10):
        key = f"teacher/t{i}/"
        samples = sum(r.get(key + "samples", 0) for r in records)
        tokens, busy = (sum(r.get(key + k, 0) for r in records) for k in ("tokens", "busy_s"))
        swaps, swap_s = (sum(r.get(key + k, 0) for r in records) for k in ("swaps", "swap_s"))
        retried = sum(r.get(key + "retried_samples", 0) for r in records)
        lines.append(f"| t{i} | {'swap' if i >= 6 else 'own engine'} | {samples:.0f} | "
                     f"{tokens / busy if busy else 0:.0f} | {retried:.0f} | {swaps:.0f} | "
                     f"{1000 * swap_s / swaps if swaps else 0:.1f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/opd_ten_teachers"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import time

    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import run_training

    sets = [f"model.path={make_model(args.workdir / 'student', 'tiny', 0)}", f"trainer.num_steps={args.steps}",
            f"logging.run_dir={args.workdir / 'run'}"]
    sets += [f"teachers.{i}.path={make_model(args.workdir / 'teachers' / f't{i}', 'tiny', 100 + i)}" for i in range(10)]
    start = time.perf_counter()
    run_dir = run_training(load_recipe(RECIPE, sets))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    setup_s = time.perf_counter() - start - sum(r["perf/step_time_s"] for r in records)
    text = markdown(args, records, setup_s)
    logger.info("\n%s", text)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

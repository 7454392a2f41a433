"""vs_trl.py's side of ours alone: the same recipe (recipe_dict) trained by the same `run_ours` (the step windows
between weight pushes, the GPU-busy sampler on cuda), without the TRL side or the evaluation; for profiling ours'
step (--profile-steps) or a longer run of ours' GPU-busy share in a short device call.

    PYTHONPATH=$PWD python benchmarks/vs_trl_ours.py --device cuda --task countdown --model DIR --steps 12 \
        --prompts-per-step 64 --group-size 16 --max-new-tokens 256 --lr 1e-5 --profile-steps 8 9 10 \
        --profile-activities GPU --workdir /tmp/ours

Takes vs_trl.py's arguments (those about TRL are ignored); the run directory is <workdir>/ours. Prints the median
step, the GPU busy share over steps 2..N and per step, and writes <workdir>/ours_result.json.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.vs_trl as vs_trl  # noqa: E402 (after the path)
from benchmarks.gpu_busy import busy_cell, nvml_sources  # noqa: E402


def summary(ours: dict[str, Any]) -> str:
    """One line: median step of steps 2..N, GPU busy over steps 2..N and per step (polled, then by the driver's
    samples where there are any)."""
    steps = ours["step_times"]
    median = statistics.median(steps[1:] or steps)
    per_step = " ".join(busy_cell(b) for b in ours["gpu_busy_steps"]) or "-"
    line = (f"ours: {len(steps)} steps, median step {median:.3f} s (steps 2..N), GPU busy "
            f"{busy_cell(ours['gpu_busy'])} (steps 2..N); per step: {per_step}")
    if ours.get("gpu_busy_driver_steps"):
        per_step = " ".join(busy_cell(b) for b in ours["gpu_busy_driver_steps"])
        line += f"; by the driver's samples {busy_cell(ours['gpu_busy_driver'])}, per step: {per_step}"
    return line


def main(argv: list[str] | None = None) -> int:
    args = vs_trl.parse_args(argv)
    work = args.workdir or Path("vs_trl_ours")
    work.mkdir(parents=True, exist_ok=True)
    model_dir, _ = vs_trl.resolve_model(args, work)
    ours = vs_trl.run_ours(args, model_dir, work, nvml_sources() if args.device == "cuda" else {})
    print(summary(ours))
    keys = ("step_times", "rewards", "response_lengths", "gpu_busy", "gpu_busy_steps", "gpu_busy_driver",
            "gpu_busy_driver_steps", "parts", "breakdown")
    (work / "ours_result.json").write_text(json.dumps({k: ours[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

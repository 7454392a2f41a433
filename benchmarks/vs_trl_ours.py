"""vs_trl.py's side of ours alone: the same recipe (recipe_dict) trained with run_training, without the TRL side, the
evaluation or the GPU-busy sampler; for profiling ours' step (--profile-steps) in a short device call.

    PYTHONPATH=$PWD python benchmarks/vs_trl_ours.py --device cuda --task countdown --model DIR --steps 12 \
        --prompts-per-step 64 --group-size 16 --max-new-tokens 256 --lr 1e-5 --profile-steps 8 9 10 \
        --profile-activities GPU --workdir /tmp/ours

Takes vs_trl.py's arguments (those about TRL are ignored); the run directory is <workdir>/ours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.vs_trl as vs_trl  # noqa: E402 (after the path)
from slime_dsa.config import load_recipe  # noqa: E402
from slime_dsa.orchestrator.train import run_training  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = vs_trl.parse_args(argv)
    work = args.workdir or Path("vs_trl_ours")
    work.mkdir(parents=True, exist_ok=True)
    model_dir, _ = vs_trl.resolve_model(args, work)
    path = work / "ours.yaml"
    path.write_text(yaml.safe_dump(vs_trl.recipe_dict(args, model_dir, work / "ours")))
    run_training(load_recipe(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

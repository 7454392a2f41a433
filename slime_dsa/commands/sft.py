"""`slime-dsa sft RECIPE [--set k=v]`: supervised fine-tuning on the tasks' reference solutions."""

from __future__ import annotations

import argparse

from slime_dsa.config.command import add_recipe_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sft", help="fine-tune on the tasks' reference solutions (makes RL starting policies)")
    add_recipe_arguments(parser)
    parser.set_defaults(run=run, console_log_level="WARNING")  # one line a step; INFO in the run's log


def run(args: argparse.Namespace) -> int:
    from slime_dsa.commands.recipe import check_recipe_plugins  # noqa: PLC0415
    from slime_dsa.config import load_recipe  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415
    from slime_dsa.config.sft import check_sft_keys  # noqa: PLC0415

    recipe = load_recipe(args.recipe, args.overrides)
    check_recipe_paths(recipe, trainer_workers=False)
    check_recipe_plugins(recipe)  # reward functions, agent loops and tools by import path
    check_sft_keys(recipe)  # train's keys that one process does not honour: refused, not ignored
    _refuse_an_earlier_runs_metrics(recipe)
    from slime_dsa.sft import run_sft  # noqa: PLC0415

    print(f"model written: {run_sft(recipe)}")
    return 0


def _refuse_an_earlier_runs_metrics(recipe) -> None:
    """sft has no --resume: a second run in a run directory would append its steps to the earlier run's metrics.jsonl
    (and W&B run), two step 1s in one file, as `train` refuses to mix runs. UserError."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import resolve_run_dir  # noqa: PLC0415

    metrics = resolve_run_dir(recipe) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        raise UserError(f"{metrics} holds an earlier run's metrics: sft cannot continue a run; give this one another "
                        "logging.run_dir, or remove that run directory to start over")

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
    from slime_dsa.run_dir import refuse_an_earlier_runs_metrics  # noqa: PLC0415

    recipe = load_recipe(args.recipe, args.overrides)
    check_recipe_paths(recipe, trainer_workers=False)
    check_recipe_plugins(recipe)  # reward functions, agent loops and tools by import path
    check_sft_keys(recipe)  # train's keys that one process does not honour: refused, not ignored
    refuse_an_earlier_runs_metrics(recipe, "sft")
    from slime_dsa.sft import run_sft  # noqa: PLC0415

    print(f"model written: {run_sft(recipe)}")
    return 0

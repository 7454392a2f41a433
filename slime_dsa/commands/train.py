"""`slime-dsa train RECIPE [--set k=v] [--resume]`: the main job."""

from __future__ import annotations

import argparse

from slime_dsa.config.command import add_recipe_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="run an RL recipe (rollout → train → weight sync)",
                                   description="Run an RL recipe to trainer.num_steps.")
    add_recipe_arguments(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint of the run (same as --set checkpoint.resume=true)")
    parser.set_defaults(run=run, console_log_level="WARNING")  # one line a step; INFO in the run's log


def run(args: argparse.Namespace) -> int:
    from slime_dsa.commands.recipe import check_recipe_plugins  # noqa: PLC0415
    from slime_dsa.config import load_recipe  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415

    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    recipe = load_recipe(args.recipe, overrides)
    check_recipe_paths(recipe)  # before Ray, engines and trainers start
    check_recipe_plugins(recipe)  # reward functions, agent loops and tools by import path
    if not recipe.checkpoint.resume:
        _refuse_an_earlier_runs_checkpoints(recipe)
    from slime_dsa.orchestrator.train import run_training  # noqa: PLC0415 (torch, ray: only now)

    run_dir = run_training(recipe, resume=args.resume)
    print(f"run finished: {run_dir}")
    return 0


def _refuse_an_earlier_runs_checkpoints(recipe) -> None:
    """A fresh run where an earlier run left checkpoints would mix the two: its own saves pruned as older than the
    earlier run's (keep_last), a later --resume continuing the earlier run, metrics.jsonl holding both. UserError."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import resolve_run_dir  # noqa: PLC0415

    directory = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else resolve_run_dir(recipe) / "checkpoints"
    found = sorted(p.name for p in directory.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name))
    if found:
        raise UserError(f"{directory} holds an earlier run's checkpoints (newest {found[-1]}): continue that run with "
                        "--resume, or give this one another logging.run_dir")


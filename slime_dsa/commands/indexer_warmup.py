"""`slime-dsa indexer-warmup RECIPE [--set k=v]`: train only the DSA indexers against the dense attention."""

from __future__ import annotations

import argparse

from slime_dsa.config.command import add_recipe_arguments


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "indexer-warmup", help="turn a dense-attention checkpoint into a DSA model (train the indexers only)",
        description="Dense indexer warm-up: train only the indexers, against the mean attention of their IndexShare "
                    "group, on a text corpus; writes the model with index_topk set (see indexer_warmup.*).")
    add_recipe_arguments(parser)
    parser.set_defaults(run=run, console_log_level="WARNING")  # one line a step; INFO in the run's log


def run(args: argparse.Namespace) -> int:
    from slime_dsa.config import load_recipe  # noqa: PLC0415
    from slime_dsa.config.indexer_warmup import check_indexer_warmup_keys  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415
    from slime_dsa.run_dir import refuse_an_earlier_runs_metrics  # noqa: PLC0415

    recipe = load_recipe(args.recipe, args.overrides)
    check_recipe_paths(recipe, trainer_workers=False)  # before the model loads and the warm-up runs (as train and sft)
    check_indexer_warmup_keys(recipe)  # keys of train and sft it does not honour: refused, not ignored
    refuse_an_earlier_runs_metrics(recipe, "indexer-warmup")
    from slime_dsa.indexer.warmup import run_indexer_warmup  # noqa: PLC0415 (torch: only now)

    print(f"model written: {run_indexer_warmup(recipe)}")
    return 0

"""`slime-dsa recipe explain | check`: the recipe schema for people, and validation of recipe files."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from slime_dsa.config.errors import UserError


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe file and its `--set` overrides, for every command that takes a recipe."""
    parser.add_argument("recipe", metavar="FILE", help="recipe YAML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set rollout.temperature=0.7 or --set data.tasks.0.weight=2 "
             "(VALUE is YAML; repeatable, later wins)")


def add_parser(subparsers: argparse._SubParsersAction, check_plugins: Callable[[Any], None] | None = None) -> None:
    """Register `recipe` and its actions; `check` also runs `check_plugins(config)` (slime_dsa/commands/recipe.py
    passes the one that resolves the recipe's reward functions, agent loops and tools, a floor above this one)."""
    parser = subparsers.add_parser("recipe", help="explain the recipe schema, check recipe files",
                                   description="Explain the recipe schema and check recipe files.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    explain = actions.add_parser("explain", help="list every recipe key with its type, default and meaning")
    explain.add_argument("section", nargs="?", metavar="SECTION",
                         help="one section, e.g. rollout, rollout.sglang, data.tasks, or the keys one algorithm reads, "
                              "e.g. sao (default: all)")
    explain.add_argument("--yaml", action="store_true",
                         help="print every default as a commented YAML recipe instead")
    explain.set_defaults(run=run_explain)

    check = actions.add_parser("check", help="load and validate a recipe, print a one-line summary and the resolved "
                                             "rollout concurrency")
    add_recipe_arguments(check)
    check.add_argument("--for", dest="command", choices=["train", "sft", "indexer-warmup"], default="train",
                       help="the command the recipe is for: sft and indexer-warmup also refuse the keys of train's "
                            "trainer workers and cluster that they, one process, do not read (default: train)")
    check.add_argument("--print", dest="print_recipe", action="store_true",
                       help="also print the resolved recipe (defaults, inheritance and overrides applied) as YAML")
    check.set_defaults(run=run_check, check_plugins=check_plugins)


def run_explain(args: argparse.Namespace) -> int:
    """Print the schema, one section or all."""
    from slime_dsa.config import defaults_yaml, explain  # noqa: PLC0415 (keeps --help light)

    if args.yaml and args.section:
        raise UserError("recipe explain --yaml prints the whole recipe; leave out SECTION")
    print(defaults_yaml() if args.yaml else explain(args.section), end="")
    return 0


def run_check(args: argparse.Namespace) -> int:
    """Validate a recipe, the files it points at and the plugins it names; print 'ok: FILE' and what it trains."""
    from slime_dsa.config import dump_recipe, load_recipe  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415

    config = load_recipe(args.recipe, args.overrides)
    check_recipe_paths(config, trainer_workers=args.command == "train")
    if getattr(args, "check_plugins", None) is not None and args.command != "indexer-warmup":  # it scores nothing
        args.check_plugins(config)
    if args.command == "sft":  # in the order `slime-dsa sft` checks
        from slime_dsa.config.sft import check_sft_keys, sft_summary  # noqa: PLC0415

        check_sft_keys(config)
    if args.command == "indexer-warmup":
        from slime_dsa.config.indexer_warmup import check_indexer_warmup_keys, indexer_warmup_summary  # noqa: PLC0415

        check_indexer_warmup_keys(config)
    print(f"ok: {args.recipe}")
    if args.command == "sft":
        print(f"sft: {sft_summary(config)}")
    elif args.command == "indexer-warmup":
        print(f"indexer-warmup: {indexer_warmup_summary(config)}")
    else:
        print(f"train: {config.summary()}")
        print(config.concurrency_line())
    if args.print_recipe:
        print(dump_recipe(config), end="")
    return 0

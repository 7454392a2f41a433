"""`slime-dsa recipe explain | check` (slime_dsa/config/command.py), whose check also resolves the reward functions,
agent loops and tools the recipe names (rollout/recipe_plugins.py, a floor below the drivers, above the config)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from slime_dsa.config import command

if TYPE_CHECKING:  # pydantic only when a recipe is checked
    from slime_dsa.config.schema import RecipeConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    command.add_parser(subparsers, check_plugins=check_recipe_plugins)


def check_recipe_plugins(config: RecipeConfig) -> None:
    """RecipeError naming the first data.tasks key whose plugin does not resolve (rollout/recipe_plugins.py)."""
    from rollout.recipe_plugins import check_recipe_plugins as check  # noqa: PLC0415 - imports only what is named

    check(config)

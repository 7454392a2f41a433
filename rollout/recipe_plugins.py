"""The plugins a recipe names by import path (reward functions, agent loops, tools), resolved before anything slow
starts: at `recipe check` and at the start of train and sft, so that a misspelt module or function, or a function of
the wrong shape, is one line naming its key instead of a failure after Ray, the engines or training steps.

Built-in names cost nothing to check; only the modules the recipe names are imported (what its run imports anyway).
"""

from __future__ import annotations

from collections.abc import Callable

from slime_dsa.config.errors import UserError, raise_first_problem
from slime_dsa.config.schema import RecipeConfig


def plugin_problems(config: RecipeConfig) -> list[tuple[str, str]]:
    """(key, what is wrong) for every reward function, agent loop and tool of data.tasks that does not resolve."""
    problems: list[tuple[str, str]] = []
    for i, task in enumerate(config.data.tasks):
        if task.reward_fn is not None:
            from rollout.rewards.registry import load_reward_fn  # noqa: PLC0415 - only recipes that name one

            problems += _problem(f"data.tasks.{i}.reward_fn", load_reward_fn, task.reward_fn)
        if task.agent is None:
            continue
        if ":" in task.agent.loop:
            from rollout.agents.runtime import load_agent_loop  # noqa: PLC0415

            problems += _problem(f"data.tasks.{i}.agent.loop", load_agent_loop, task.agent.loop)
        named: dict[str, int] = {}  # tool name -> index in agent.tools: the model calls tools by name
        for j, tool in enumerate(task.agent.tools):
            key, name = f"data.tasks.{i}.agent.tools.{j}", tool  # a built-in tool is named as it is spelt
            if ":" in tool:  # built-in tools always load
                from rollout.tools.registry import load_tool  # noqa: PLC0415

                try:
                    name = load_tool(tool).name
                except UserError as e:  # ToolLoadError: one line naming the spec
                    problems.append((key, str(e)))
                    continue
            if name in named:
                problems.append((key, f"tool {tool!r} is named {name!r}, as is data.tasks.{i}.agent.tools."
                                      f"{named[name]}; the model calls tools by name"))
            else:
                named[name] = j
    return problems


def _problem(key: str, load: Callable[[str], object], spec: str) -> list[tuple[str, str]]:
    try:
        load(spec)
    except UserError as e:  # RewardLoadError, AgentLoadError, ToolLoadError: one line naming the spec
        return [(key, str(e))]
    return []


def check_recipe_plugins(config: RecipeConfig) -> None:
    """Raise RecipeError naming the first key whose plugin does not resolve (and how many more do not)."""
    raise_first_problem(plugin_problems(config))

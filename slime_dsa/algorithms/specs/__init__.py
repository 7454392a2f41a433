"""The algorithm registry: a recipe's algorithm.name -> its spec class (one file per algorithm beside this one).

Adding an algorithm is one new file and one line in ALGORITHMS. Names listed in PLANNED are refused by
`recipe check` with one line until they are built.
"""

from __future__ import annotations

from typing import Any

from slime_dsa.algorithms.specs.async_reinforce import AsyncReinforce
from slime_dsa.algorithms.specs.base import COMMON_OPTIONS, AdvantageInputs, Algorithm, Loop, OldLogprobs
from slime_dsa.algorithms.specs.grpo import GRPO
from slime_dsa.algorithms.specs.sao import SAO

ALGORITHMS: dict[str, type[Algorithm]] = {
    "grpo": GRPO,
    "async_reinforce": AsyncReinforce,
    "sao": SAO,
}

# Promised and not built yet: recipe check says so in one line instead of running something else.
PLANNED: dict[str, str] = {
    "opd": "on-policy distillation from teacher models",
}


def algorithm_class(name: str) -> type[Algorithm]:
    """The spec class registered as `name`; ValueError naming the choices otherwise."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if name in PLANNED:
        raise ValueError(f"'{name}' ({PLANNED[name]}) is not available yet; choose one of {', '.join(ALGORITHMS)}")
    raise ValueError(f"unknown algorithm '{name}'; choose one of {', '.join(ALGORITHMS)}")


def build_algorithm(section: Any) -> Algorithm:
    """The spec object of a recipe's algorithm section."""
    return algorithm_class(section.name)(section)


__all__ = ["ALGORITHMS", "COMMON_OPTIONS", "PLANNED", "AdvantageInputs", "Algorithm", "Loop", "OldLogprobs",
           "algorithm_class", "build_algorithm"]

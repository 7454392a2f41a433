"""A small fictional world for the search tool: towns, each with a population and a founding year, one document each.

Fictional, so that no model knows the answers without looking them up; deterministic (names and numbers come from a
fixed seed), so the `fact_lookup` task's reference solutions match what the search tool returns.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

NUM_TOWNS = 120
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kl", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "nd", "rk")


@dataclass(frozen=True)
class Town:
    """One town of the fictional world."""

    name: str
    population: int
    founded: int


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2)).title()


@functools.cache
def towns() -> tuple[Town, ...]:
    """The NUM_TOWNS towns, in a fixed order."""
    rng = random.Random("slime-dsa:facts")
    names: dict[str, None] = {}
    while len(names) < NUM_TOWNS:
        names[_name(rng)] = None
    return tuple(Town(name, rng.randint(1000, 99999), rng.randint(1000, 1999)) for name in names)


def document(town: Town) -> str:
    """The one document about `town`."""
    return f"{town.name} is a town with a population of {town.population}. It was founded in {town.founded}."


def documents() -> list[str]:
    """Every town's document, in the order of `towns()`."""
    return [document(t) for t in towns()]

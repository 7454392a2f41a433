"""Parameters of the built-in task generators (`data.tasks.<i>.task_args`), apart from the generators so that
`recipe check` validates them without importing `datasets`.

`task_params(kind, **args)` checks names, types and ranges, and raises a one-line ValueError naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArithmeticParams:
    """Addition/subtraction of `num_operands` integers of min_digits..max_digits digits each."""

    min_digits: int = 1
    max_digits: int = 3
    num_operands: int = 2
    ops: str = "+-"
    allow_negative: bool = True  # False: redraw problems whose result is negative

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(f"arithmetic: need 1 <= min_digits ({self.min_digits}) <= max_digits "
                             f"({self.max_digits}) <= 18")
        if self.num_operands < 2:
            raise ValueError(f"arithmetic: num_operands ({self.num_operands}) must be at least 2")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"arithmetic: ops ({self.ops!r}) must be a non-empty string of '+' and '-'")


@dataclass(frozen=True)
class CountdownParams:
    """min_numbers..max_numbers numbers in 1..max_number and a reachable target in 1..max_target."""

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 20
    max_target: int = 100
    ops: str = "+-*/"
    use_all: bool = False  # True: each number exactly once (TinyZero's rule); False: at most once
    # True: the reference solution works the steps out in <think> (one line per combination, then a check) before
    # <answer>: long answers to train on (~150 tokens at 3-4 numbers, ~260 at 5-6 with the built-in tokenizer)
    worked_steps: bool = False
    # True (with worked_steps): <think> first lists every pair of the given numbers combined by each allowed op (the
    # search's first level), then the steps: ~280 tokens at 3 numbers (~360 at 3-4, ~480 at 4): long answers to a
    # problem no harder than 3 numbers
    worked_search: bool = False

    def __post_init__(self) -> None:
        if self.worked_search and not self.worked_steps:
            raise ValueError("countdown: worked_search (True) lists the search inside the worked steps; it needs "
                             "worked_steps true, got false")
        if not 2 <= self.min_numbers <= self.max_numbers <= 8:
            raise ValueError(f"countdown: need 2 <= min_numbers ({self.min_numbers}) <= max_numbers "
                             f"({self.max_numbers}) <= 8")
        if self.max_number < 2 or self.max_target < 1:
            raise ValueError(f"countdown: max_number ({self.max_number}) must be >= 2 and max_target "
                             f"({self.max_target}) >= 1")
        if not self.ops or set(self.ops) - set("+-*/"):
            raise ValueError(f"countdown: ops ({self.ops!r}) must be a non-empty string of '+', '-', '*', '/'")


@dataclass(frozen=True)
class SortParams:
    """min_numbers..max_numbers integers in 0..max_number (repeats allowed) to put in ascending order."""

    min_numbers: int = 3
    max_numbers: int = 5
    max_number: int = 99

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers <= 16:
            raise ValueError(f"sort: need 2 <= min_numbers ({self.min_numbers}) <= max_numbers "
                             f"({self.max_numbers}) <= 16")
        if self.max_number < 1:
            raise ValueError(f"sort: max_number ({self.max_number}) must be >= 1")


@dataclass(frozen=True)
class CalcChainParams:
    """A start number of start_digits digits, then min_steps..max_steps operations (+, -, *), one per tool call."""

    start_digits: int = 3
    min_steps: int = 2
    max_steps: int = 3
    operand_digits: int = 2  # of + and - operands; multipliers have one digit less (at least one)
    ops: str = "+-*"

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps <= 8:
            raise ValueError(f"calc_chain: need 1 <= min_steps ({self.min_steps}) <= max_steps ({self.max_steps}) <= 8")
        if not 1 <= self.start_digits <= 9 or not 1 <= self.operand_digits <= 9:
            raise ValueError(f"calc_chain: start_digits ({self.start_digits}) and operand_digits "
                             f"({self.operand_digits}) must be in 1..9")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"calc_chain: ops ({self.ops!r}) must be a non-empty string of '+', '-', '*'")


@dataclass(frozen=True)
class FactLookupParams:
    """Two different towns of the fact corpus; questions of the given kinds ("sum", "difference")."""

    questions: str = "sum,difference"

    def __post_init__(self) -> None:
        kinds = self.questions.split(",")
        if not kinds or set(kinds) - {"sum", "difference"}:
            raise ValueError(f"fact_lookup: questions ({self.questions!r}) must list some of 'sum', 'difference'")

PARAMS: dict[str, type] = {
    "arithmetic": ArithmeticParams,
    "countdown": CountdownParams,
    "sort": SortParams,
    "calc_chain": CalcChainParams,
    "fact_lookup": FactLookupParams,
}


def task_params(kind: str, **params: Any) -> Any:
    """The task's parameter object; an unknown parameter, a value of the wrong type or out of range is a ValueError
    that names it."""
    if kind not in PARAMS:
        raise ValueError(f"unknown built-in task {kind!r}; expected one of {sorted(PARAMS)}")
    cls = PARAMS[kind]
    types = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key, value in params.items():
        if key not in allowed:
            raise ValueError(f"{kind}: unknown task parameter {key!r}; expected some of {allowed}")
        if not _has_type(value, types[key]):
            raise ValueError(f"{kind}: task parameter {key} ({value!r}) must be of type {types[key].__name__}")
    return cls(**params)


def _has_type(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)

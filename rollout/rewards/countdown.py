"""Verifier of the built-in `countdown` task: an expression over the given numbers that equals the target.

Accepted: integers, + - * /, parentheses, spaces; `×`/`÷`/`−` are read as `*`/`/`/`-`; a trailing "= target" is
ignored. Each number may be used at most once (exactly once when the answer says `use_all`). Arithmetic is exact
(fractions), so 7 / 2 * 2 == 7.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from rollout.rewards.answer import answer_text

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200  # countdown answers are short; a cap keeps ast.parse and the tree walk bounded
# Only what an accepted expression can hold reaches ast.parse, which warns (SyntaxWarning, once per reward call in
# the logs) on model text such as "17e" or "3and".
_EXPRESSION_CHARS = re.compile(r"[\d\s()+\-*/]+")


# ASCII digits, operators, parentheses and plain spaces: what a model writes nearly always, parsed without ast.
_PLAIN_CHARS = re.compile(r"[0-9 ()+\-*/]+")
_PLAIN_TOKEN = re.compile(r"\d+|\*\*|//|\S")


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals used) of an arithmetic expression, or None if it is not one."""
    text = text.replace("×", "*").replace("÷", "/").replace("−", "-").replace("\\times", "*").replace("\\div", "/")
    text = text.strip().strip("$").split("=")[0].strip()
    if not text or len(text) > _MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(text):
        return None
    if _PLAIN_CHARS.fullmatch(text):
        return _parse_plain(text)
    try:
        tree = ast.parse(text, mode="eval")
        literals: list[int] = []
        return _evaluate(tree.body, literals), literals
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, literals), _evaluate(node.right, literals))
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def _parse_plain(text: str) -> tuple[Fraction, list[int]] | None:
    """parse_expression of a text of ASCII digits, + - * / ( ) and spaces, as ast.parse and _evaluate would read it:
    binary operators over integer literals only (no unary sign, no // or **, no leading zeros but in 0, 00, ...)."""
    tokens = _PLAIN_TOKEN.findall(text)
    literals: list[int] = []
    try:
        value, end = _sum(tokens, 0, literals)
    except (ValueError, ZeroDivisionError, IndexError, RecursionError):
        return None
    return (Fraction(value), literals) if end == len(tokens) else None


def _sum(tokens: list[str], i: int, literals: list[int]) -> tuple[int | Fraction, int]:
    """term (('+' | '-') term)* from tokens[i]; (value, index after it)."""
    value, i = _product(tokens, i, literals)
    while i < len(tokens) and tokens[i] in "+-":
        op = tokens[i]
        right, i = _product(tokens, i + 1, literals)
        value = value + right if op == "+" else value - right
    return value, i


def _product(tokens: list[str], i: int, literals: list[int]) -> tuple[int | Fraction, int]:
    """factor (('*' | '/') factor)* from tokens[i]; exact: an inexact quotient of integers becomes a Fraction."""
    value, i = _factor(tokens, i, literals)
    while i < len(tokens) and tokens[i] in "*/":
        op = tokens[i]
        right, i = _factor(tokens, i + 1, literals)
        if op == "*":
            value = value * right
        elif type(value) is int and type(right) is int and right and value % right == 0:
            value = value // right
        else:
            value = Fraction(value) / right  # ZeroDivisionError for a zero divisor, as Fraction division raises
    return value, i


def _factor(tokens: list[str], i: int, literals: list[int]) -> tuple[int | Fraction, int]:
    """An integer literal or a parenthesised sum from tokens[i]; ValueError for anything else."""
    token = tokens[i]
    if token == "(":
        value, i = _sum(tokens, i + 1, literals)
        if tokens[i] != ")":
            raise ValueError("unclosed parenthesis")
        return value, i + 1
    if not token.isdigit() or (token[0] == "0" and token.strip("0")):  # Python refuses leading zeros: 007
        raise ValueError(f"not an integer literal: {token}")
    literals.append(int(token))
    return literals[-1], i + 1


def _ground_truth(answer: Any) -> tuple[int, list[int], bool]:
    if isinstance(answer, str):  # a dataset file may store the answer as a JSON string
        answer = json.loads(answer)
    if not isinstance(answer, dict) or "target" not in answer or "numbers" not in answer:
        raise ValueError(f"countdown: ground-truth answer must be a dict with 'target' and 'numbers', got {answer!r}")
    return int(answer["target"]), [int(n) for n in answer["numbers"]], bool(answer.get("use_all", False))


def countdown_reward(sample: Any, response: str, answer: Any, **metadata: Any) -> dict[str, float]:
    """1.0 when the answer is an expression over the numbers (each at most/exactly once) equal to the target."""
    target, numbers, use_all = _ground_truth(answer)
    text, tagged = answer_text(response)
    if not tagged:
        text = text.splitlines()[-1] if text else ""  # untagged: the last line is the expression
    parsed = parse_expression(text)
    if parsed is None:
        return {"reward": 0.0, "answer_found": 0.0, "answer_tagged": float(tagged)}
    value, used = parsed
    available, counts = Counter(numbers), Counter(used)
    numbers_ok = counts == available if use_all else not counts - available
    correct = numbers_ok and value == target
    return {"reward": 1.0 if correct else 0.0, "answer_found": 1.0, "answer_tagged": float(tagged)}

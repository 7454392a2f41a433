"""`calculator`: arithmetic on one expression, evaluated by walking its syntax tree (no eval).

Numbers, + - * / // % ** and parentheses, unary minus. Bounds keep one call cheap: an exponent above 64 or a result
above 10^100 is an error, as is division by zero. Integer results stay exact; a float that is a whole number prints
as an integer, others with 12 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**100
MAX_EXPRESSION_CHARS = 500

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression.strip()[:80]!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("the result is out of range")
        return value
    raise CalculatorError(f"unsupported element {type(node).__name__} (numbers, + - * / // % ** and parentheses)")


def format_number(value: int | float) -> str:
    """Exact integers; whole floats without '.0'; other floats with 12 significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if value.is_integer():
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


class Calculator:
    """The calculator tool."""

    name = "calculator"
    description = "Evaluate an arithmetic expression (+, -, *, /, //, %, ** and parentheses)."
    parameters: dict[str, Any] = {"type": "object", "required": ["expression"],
                                  "properties": {"expression": {"type": "string", "description": "e.g. 37 * (12 - 5)"}}}

    async def call(self, expression: str) -> str:
        return format_number(evaluate(expression))

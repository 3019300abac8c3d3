"""The ``calculator`` tool: arithmetic on numbers, evaluated from the expression's syntax tree, never ``eval``.

    calculator({"expression": "(2 + 3) * -4 ** 2"}, {})  # -> ToolOutcome("-80")

Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Anything else (names,
calls, attributes, strings, comparisons) is refused with the reason. Sizes are bounded so that no call can
take the worker's time or memory: the expression has at most ``MAX_EXPRESSION_CHARS`` characters, an integer
result at most ``MAX_INT_BITS`` bits (``**`` is refused before it computes one larger), and a float result must
be finite. Every refusal is an error observation (``ToolOutcome(error_kind="error")``), never an exception.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from .base import ToolOutcome, string_argument

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4000  # ~1200 digits: printable (Python refuses int -> str past 4300 digits) and cheap

Number = int | float


class CalcError(ValueError):
    """Why an expression is refused or has no value (shown to the model)."""


def _power(base: Number, exponent: Number) -> Number:
    # |base| >= 2 ** (bits - 1), so the result has at least (bits - 1) * exponent + 1 bits: refused before it is
    # computed when that is too many; below it, the result has at most twice the limit (cheap), checked after
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and (abs(base).bit_length() - 1) * exponent >= MAX_INT_BITS:
        raise CalcError(f"the result has more than {MAX_INT_BITS} bits")
    value = base**exponent
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    return value


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _power,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalcError(f"the result has more than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not finite")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refused with str, complex, None
            raise CalcError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name):
        raise CalcError(f"names are not allowed (got {node.id!r}): use numbers only")
    if isinstance(node, ast.Call):
        raise CalcError("function calls are not allowed: use + - * / // % ** and parentheses")
    raise CalcError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; raises CalcError with the reason."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"not an arithmetic expression: {e.msg}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("the result is too large") from None
    except (RecursionError, MemoryError):
        raise CalcError("the expression is nested too deeply") from None


def calculator(arguments: dict[str, Any], state: dict[str, Any]) -> ToolOutcome:
    """The tool: ``{"expression": str}`` -> its value (an int exactly, a float as Python prints it)."""
    expression = string_argument(arguments, "expression")
    try:
        return ToolOutcome(repr(evaluate(expression)))
    except CalcError as e:
        return ToolOutcome(f"error: {e}", "error")

"""Built-in tools for multi-turn rollouts (``rl.tools=[calculator]``, ``rl.tools=[python]`` -- the policy's
code in a sandbox, :mod:`syncwise.sandbox` -- or ``syncwise.tools:calculator``), in the form every tool takes:
a function with typed parameters and a Google-style docstring, from which the chat template is shown its JSON
schema (transformers' ``get_json_schema``)."""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable
from fractions import Fraction
from typing import Any


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: The arithmetic to evaluate, e.g. "(1234 + 567) * 89 / 4": numbers, + - * / // % **, and parentheses.
    """
    with warnings.catch_warnings():  # '12abc' warns before it fails: the error is the answer, not a warning
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))  # a division that does not come out even: as Python prints it


_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b), ast.Mod: operator.mod,
}
_LIMIT = 10**100  # magnitudes beyond it (or, but for 0, below its inverse) are refused
# An exact value's numerator and denominator stay below this many bits (~6,000 digits): each operation on them
# takes microseconds, and a power is refused before it is computed if its result would exceed it
_MAX_BITS = 20_000


def _evaluate(node: ast.AST) -> Fraction:
    """An arithmetic expression's exact value: numbers (a decimal as written: 0.1 is 1/10), + - * / // % **
    and unary signs, nothing else; magnitudes within 1e-100 .. 1e100 (or 0)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("the number is too large")
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        value = _power(_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    else:
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")
    return _checked(value)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` for a whole exponent, refused before computing when it would leave the bounds."""
    if exponent.denominator != 1 or abs(exponent) > 1000:
        raise ValueError("** takes a whole exponent of at most 1000")
    if base == 0:
        if exponent < 0:
            raise ZeroDivisionError("0 to a negative power")
        return Fraction(0 if exponent else 1)
    magnitude = float(exponent) * (math.log10(abs(base.numerator)) - math.log10(base.denominator))
    if magnitude > 100:
        raise ValueError("the result is too large")
    if magnitude < -100:
        raise ValueError("the result is too small (below 1e-100 in magnitude)")
    if abs(exponent) * max(base.numerator.bit_length(), base.denominator.bit_length()) > _MAX_BITS:
        raise ValueError("the exact result has too many digits; round the operands first")
    return base ** int(exponent)


def _checked(value: Fraction) -> Fraction:
    if abs(value) > _LIMIT:
        raise ValueError("the result is too large")
    if value and abs(value) * _LIMIT < 1:
        raise ValueError("the result is too small (below 1e-100 in magnitude)")
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ValueError("the exact result has too many digits; round the operands first")
    return value


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: The program; what it prints (stdout, and stderr where it writes any) is the answer.
    """
    from .runtime.sandbox import run_python

    return run_python(code)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}

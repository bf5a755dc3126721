"""Built-in tools for multi-turn rollouts (``rl.tools=[calculator]``, or ``syncwise.tools:calculator``), in
the form every tool takes: a function with typed parameters and a Google-style docstring, from which the
chat template is shown its JSON schema (transformers' ``get_json_schema``)."""

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
_LIMIT = 10**100  # operands and results beyond it are refused (a ** b could otherwise fill the memory)


def _evaluate(node: ast.AST) -> Fraction:
    """An arithmetic expression's exact value: numbers, + - * / // % ** and unary signs, nothing else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _evaluate(node.left), _evaluate(node.right)
        if exponent.denominator != 1 or abs(exponent) > 1000:
            raise ValueError("** takes a whole exponent of at most 1000")
        if base == 0 and exponent < 0:
            raise ZeroDivisionError("0 to a negative power")
        if base != 0 and abs(exponent) * math.log10(max(abs(base), 1 / abs(base))) > 100:
            raise ValueError("the result is too large")
        value = base ** int(exponent)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    else:
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")
    if abs(value) > _LIMIT:
        raise ValueError("the result is too large")
    return value


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}

"""Shapes whose dims are ints or sympy expressions over named dynamic dims.

A saving is kept as a formula (`640*batch*seq**2`) and turned into bytes with
the graph's example values for its dims.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import reduce
import operator

import sympy

Dim = int | sympy.Expr


def symbol(name: str) -> sympy.Symbol:
    """Dynamic dims are positive integers; sympy uses that to decide comparisons."""
    return sympy.Symbol(name, integer=True, positive=True)


def as_dim(value: int | str | sympy.Expr) -> Dim:
    if isinstance(value, str):
        return symbol(value)
    if isinstance(value, sympy.Expr):
        return int(value) if value.is_Integer else value
    return int(value)


def numel(shape: Sequence[Dim]) -> Dim:
    return simplify(reduce(operator.mul, shape, 1))


def simplify(expr: Dim) -> Dim:
    if isinstance(expr, sympy.Expr):
        expr = sympy.expand(expr)
        return int(expr) if expr.is_Integer else expr
    return expr


def is_static(expr: Dim) -> bool:
    return not isinstance(expr, sympy.Expr) or expr.is_Integer


def free_dims(expr: Dim) -> set[str]:
    return {s.name for s in expr.free_symbols} if isinstance(expr, sympy.Expr) else set()


def evaluate(expr: Dim, examples: Mapping[str, int]) -> int | None:
    """The value of `expr` at the example sizes, or None when a dim has no example."""
    if not isinstance(expr, sympy.Expr):
        return int(expr)
    missing = free_dims(expr) - set(examples)
    if missing:
        return None
    return int(expr.subs({symbol(n): v for n, v in examples.items() if n in free_dims(expr)}))


def format_dim(expr: Dim) -> str:
    return str(expr).replace(" ", "") if isinstance(expr, sympy.Expr) else str(expr)


def format_shape(shape: Sequence[Dim] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join(format_dim(d) for d in shape) + "]"


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"

"""Shapes whose dims are ints or sympy expressions over named dynamic dims.

A saving is kept as a formula (`640*batch*seq**2`) and turned into bytes with
the graph's example values for its dims.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import reduce
import numbers
import operator
import re

import sympy

from .errors import GraphError

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


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_dim(text: str) -> Dim:
    """A dim written as text: `batch`, `batch*seq`, `2*batch`, `seq - 1`.

    Names become positive-integer symbols; text that is not an arithmetic
    expression of names and integers becomes one opaque symbol.
    """
    text = text.strip()
    if _IDENT.fullmatch(text):
        return symbol(text)
    names = {n: symbol(n) for n in _IDENT.findall(text)}
    if re.fullmatch(r"[A-Za-z0-9_+\-*/() ]+", text):
        try:
            return as_dim(sympy.sympify(text, locals=names))
        except (sympy.SympifyError, SyntaxError, TypeError):
            pass
    return symbol(re.sub(r"\W", "_", text))


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


def check_example(name: str, value: object) -> int:
    """An example size of a dynamic dim: a positive integer, else GraphError naming the dim."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise GraphError(f"dim {name!r} has example size {value!r}; sizes are positive integers")
    return int(value)


def evaluate(expr: Dim, examples: Mapping[str, int]) -> int | None:
    """The value of `expr` at the example sizes, or None when a dim has no example."""
    if not isinstance(expr, sympy.Expr):
        return int(expr)
    names = free_dims(expr)
    missing = names - set(examples)
    if missing:
        return None
    return int(expr.subs({symbol(n): check_example(n, examples[n]) for n in names}))


def format_dim(expr: Dim) -> str:
    return str(expr).replace(" ", "") if isinstance(expr, sympy.Expr) else str(expr)


def format_shape(shape: Sequence[Dim] | None) -> str:
    if shape is None:
        return "[?]"
    return "[" + ", ".join(format_dim(d) for d in shape) + "]"


def format_bytes(n: int | None) -> str:
    """`1.50 MiB`; `?` for a size that depends on a dim with no example. A negative count (a
    saving that costs more than it saves) keeps its sign."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"

"""Shapes whose dims are ints or sympy expressions over named dynamic dims.

A saving is kept as a formula (`640*batch*seq**2`) and turned into bytes with
the graph's example values for its dims.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache, reduce
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
    """A formula in one form for one value: expanded, or, where it divides by sizes (a symbol
    united_sizes solved as a quotient), one fraction in lowest terms, which `expand` is not."""
    if isinstance(expr, sympy.Expr):
        return _simplified(expr)
    return expr


@lru_cache(maxsize=8192)
def _simplified(expr: sympy.Expr) -> Dim:
    """Memoized: a peak simulation asks for the bytes of every value at every step, and a dynamic
    graph's are the same few formulas. tests/test_onnx_chunk.py asked for 249,158 of them (13.8 s
    under cProfile); the file took 79.8 s before and 77.0 s after."""
    expr = sympy.cancel(expr) if is_quotient(expr) else sympy.expand(expr)
    return int(expr) if expr.is_Integer else expr


def is_quotient(expr: sympy.Expr) -> bool:
    """Whether a formula divides by a size (a symbol united_sizes solved as a quotient)."""
    return any(p.exp.is_negative for p in expr.atoms(sympy.Pow))


def united_sizes(facts: Sequence[tuple[Dim, Dim]], lower_bounds: Mapping[str, int] | None = None,
                 uses: Mapping[str, int] | None = None) -> dict[sympy.Symbol, Dim]:
    """Symbols that `facts` (pairs of formulas equal at every run of the graph) prove equal to a
    formula of others, each mapped to it. Backends have such facts where a graph's inputs name
    one size with two symbols: Dynamo names the dims of the logits and of the targets apart
    when a graph break separates them, and `F.cross_entropy` guards their row counts equal:
    `s27*s77 == s24*s27`, the batches named apart (s77 -> s24, as no size can make the factor
    s27 zero), or `s27*s77 == s13*s24`, both dims (the targets' batch s24 -> s27*s77/s13: a
    quotient, exact at every run, which is all a slice of the flattened rows needs). With them
    substituted, the engine's formulas compare equal where the sizes are.

    A fact is factored; the factors that cannot vanish for sizes at their lower bounds (1
    where `lower_bounds` does not say) are dropped; the one factor left is solved for a symbol
    it is linear in, one with a unit coefficient first, else one whose coefficient no size can
    make zero; among those, the one in the fewest of the graph's sizes (`uses`: the targets'
    dims, not the hidden states', which a quotient would make every formula of the model's),
    then the later by name. Not a decision procedure: a fact it cannot solve is left unused."""
    lower_bounds, uses = lower_bounds or {}, uses or {}
    united: dict[sympy.Symbol, Dim] = {}
    for lhs, rhs in facts:
        fact = substitute(simplify(sympy.sympify(lhs) - rhs), united)
        if not isinstance(fact, sympy.Expr) or fact.is_Number:
            continue
        numerator, _ = sympy.fraction(sympy.together(fact))      # a quotient's denominator is no size's zero
        _, factors = sympy.factor_list(numerator)
        zeroable = [f for f, _ in factors if not _positive(f, lower_bounds)]
        if len(zeroable) != 1:
            continue
        solved = _solved(zeroable[0], lower_bounds, uses)
        if solved is not None:
            s, solution = solved
            united = {k: substitute(v, {s: solution}) for k, v in united.items()}
            united[s] = solution
    return united


def _solved(factor: sympy.Expr, lower_bounds: Mapping[str, int], uses: Mapping[str, int]
            ) -> tuple[sympy.Symbol, Dim] | None:
    """`factor == 0` solved for one of its symbols (united_sizes says which)."""
    candidates = []
    factor = sympy.expand(factor)
    for s in factor.free_symbols:
        coefficient = factor.coeff(s)
        rest = sympy.expand(factor - coefficient * s)
        if s in rest.free_symbols or s in coefficient.free_symbols:
            continue
        if coefficient in (1, -1):
            candidates.append((0, s, -rest / coefficient))
        elif rest.free_symbols and (_positive(coefficient, lower_bounds) or _positive(-coefficient, lower_bounds)):
            # a quotient of sizes (not of a constant: `s1*s2 == 64` is a static view's guard)
            candidates.append((1, s, -rest / coefficient))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[1].name, reverse=True)
    _, s, solution = min(candidates, key=lambda c: (c[0], uses.get(c[1].name, 0)))
    return s, simplify(solution)


def _positive(expr: sympy.Expr, lower_bounds: Mapping[str, int]) -> bool:
    """Whether `expr` is positive for every size at or above its lower bound."""
    shifted = {s: lower_bounds.get(s.name, 1) + sympy.Symbol(f"_{s.name}_above", nonnegative=True, integer=True)
               for s in expr.free_symbols}
    return bool(sympy.expand(expr.subs(shifted)).is_positive)


def substitute(expr: Dim, united: Mapping[sympy.Symbol, Dim]) -> Dim:
    """`expr` with the symbols `united` maps written as what they equal."""
    if not united or not isinstance(expr, sympy.Expr):
        return expr
    return simplify(expr.subs(united))


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

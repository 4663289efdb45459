"""Evaluating `require` guards over a match.

Sizes are sympy expressions over the dynamic dims. A comparison is decided
symbolically when sympy can (dims are positive integers); otherwise at the
graph's example dim values; otherwise it is *unproven* and the rule does not
fire. Nothing is assumed in between.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from .dtypes import DType
from .ir import Value
from .patterns import Expr
from .shapes import evaluate, format_dim, simplify

if TYPE_CHECKING:
    from .matcher import MatchContext

SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


class Unproven(Exception):
    """A guard depends on something that cannot be decided (a dim without an example)."""


@dataclass(frozen=True)
class Builtin:
    arity: tuple[int, int]           # min, max args
    takes_values: bool               # first argument must be a capture
    fn: Callable[..., Any]
    doc: str


def _value(arg: Any, name: str) -> Value:
    if isinstance(arg, list):
        raise Unproven(f"{name}() takes one value, got a variadic capture")
    if not isinstance(arg, Value):
        raise Unproven(f"{name}() needs a captured value")
    return arg


def _size(expr: Any, what: str) -> Any:
    if expr is None:
        raise Unproven(f"{what} is unknown (no shape or dtype)")
    return expr


def _saved(ctx: "MatchContext", v: Any) -> bool:
    return ctx.is_saved(_value(v, "saved"))


def _bytes(ctx: "MatchContext", v: Any) -> Any:
    if isinstance(v, list):
        return simplify(sum(_size(x.nbytes, f"bytes({x.name})") for x in v))
    return _size(_value(v, "bytes").nbytes, f"bytes({v.name})")


def _numel(ctx: "MatchContext", v: Any) -> Any:
    return _size(_value(v, "numel").numel, f"numel({v.name})")


def _rank(ctx: "MatchContext", v: Any) -> int:
    shape = _value(v, "rank").shape
    if shape is None:
        raise Unproven(f"rank({v.name}) is unknown")
    return len(shape)


def _dim(ctx: "MatchContext", v: Any, index: Any) -> Any:
    shape = _value(v, "dim").shape
    if shape is None:
        raise Unproven(f"shape of {v.name} is unknown")
    if not isinstance(index, int) or not -len(shape) <= index < len(shape):
        raise Unproven(f"dim({v.name}, {index}) is out of range for rank {len(shape)}")
    return shape[index]


def _dtype(ctx: "MatchContext", v: Any) -> DType:
    return _value(v, "dtype").dtype


def _uses(ctx: "MatchContext", v: Any) -> int:
    return len(_value(v, "uses").users)


def _is_input(ctx: "MatchContext", v: Any) -> bool:
    return _value(v, "is_input").is_input


def _is_weight(ctx: "MatchContext", v: Any) -> bool:
    return _value(v, "is_weight").is_initializer


def _in_forward(ctx: "MatchContext", v: Any) -> bool:
    producer = _value(v, "in_forward").producer
    return producer is not None and ctx.analysis.is_forward(producer)


def _available(ctx: "MatchContext", v: Any) -> bool:
    return all(ctx.is_available(x) for x in (v if isinstance(v, list) else [_value(v, "available")]))


def _count(ctx: "MatchContext", v: Any) -> int:
    return len(v) if isinstance(v, list) else 1


BUILTINS: dict[str, Builtin] = {
    "saved": Builtin((1, 1), True, _saved, "the value, or a view of it, is kept from forward to backward"),
    "bytes": Builtin((1, 1), True, _bytes, "size in bytes (a formula in the dynamic dims)"),
    "numel": Builtin((1, 1), True, _numel, "number of elements"),
    "rank": Builtin((1, 1), True, _rank, "number of dims"),
    "dim": Builtin((2, 2), True, _dim, "dim(v, i): size of dim i"),
    "dtype": Builtin((1, 1), True, _dtype, "element type"),
    "uses": Builtin((1, 1), True, _uses, "number of nodes reading the value"),
    "is_input": Builtin((1, 1), True, _is_input, "a graph input"),
    "is_weight": Builtin((1, 1), True, _is_weight, "an initializer (weight or constant)"),
    "in_forward": Builtin((1, 1), True, _in_forward, "produced by the forward part"),
    "available": Builtin((1, 1), True, _available, "readable in backward without recompute: stashed, "
                         "an input, a weight or a constant (every value of a variadic capture)"),
    "count": Builtin((1, 1), True, _count, "number of values in a variadic capture"),
    "ceil": Builtin((1, 1), False, lambda ctx, x: sympy.ceiling(x) if isinstance(x, sympy.Expr) else math.ceil(x), "round up"),
    "floor": Builtin((1, 1), False, lambda ctx, x: sympy.floor(x) if isinstance(x, sympy.Expr) else math.floor(x), "round down"),
    "min": Builtin((2, 8), False, lambda ctx, *xs: sympy.Min(*xs) if any(isinstance(x, sympy.Expr) for x in xs) else min(xs), "smallest"),
    "max": Builtin((2, 8), False, lambda ctx, *xs: sympy.Max(*xs) if any(isinstance(x, sympy.Expr) for x in xs) else max(xs), "largest"),
}

CONSTANTS = {"true": True, "false": False}

_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
          "//": operator.floordiv, "%": operator.mod}
_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
            "==": operator.eq, "!=": operator.ne}


def decide(value: Any, examples: dict[str, int], what: str) -> bool:
    """Turn a (possibly symbolic) truth value into a bool, or raise Unproven."""
    if isinstance(value, (bool, sympy.logic.boolalg.BooleanAtom)):
        return bool(value)
    if isinstance(value, sympy.Basic):
        free = {s.name for s in value.free_symbols}
        missing = free - set(examples)
        if missing:
            raise Unproven(f"cannot prove `{what}`: it depends on {', '.join(sorted(missing))}, "
                           f"which has no example value")
        return bool(value.subs({s: examples[s.name] for s in value.free_symbols}))
    return bool(value)


def evaluate_expr(expr: Expr, bindings: dict[str, Any], ctx: "MatchContext") -> Any:
    kind = expr.kind
    if kind in ("num", "bool", "str", "dtype"):
        return expr.value
    if kind == "ref":
        return bindings[expr.value]
    if kind == "call":
        fn = BUILTINS[expr.value]
        return fn.fn(ctx, *(evaluate_expr(a, bindings, ctx) for a in expr.args))
    if kind == "not":
        return not decide(evaluate_expr(expr.args[0], bindings, ctx), ctx.examples, expr.args[0].text)
    if kind == "neg":
        return -evaluate_expr(expr.args[0], bindings, ctx)
    op = expr.value
    if op in ("and", "or"):
        left = decide(evaluate_expr(expr.args[0], bindings, ctx), ctx.examples, expr.args[0].text)
        if (op == "and" and not left) or (op == "or" and left):
            return left
        return decide(evaluate_expr(expr.args[1], bindings, ctx), ctx.examples, expr.args[1].text)
    lhs = evaluate_expr(expr.args[0], bindings, ctx)
    rhs = evaluate_expr(expr.args[1], bindings, ctx)
    if op in _ARITH:
        return _ARITH[op](lhs, rhs)
    if isinstance(lhs, DType) or isinstance(rhs, DType):
        return _COMPARE[op](lhs, rhs) if op in ("==", "!=") else False
    if isinstance(lhs, sympy.Basic) or isinstance(rhs, sympy.Basic):
        relation = _COMPARE[op](sympy.sympify(lhs), sympy.sympify(rhs))
        if op in ("==", "!="):
            diff = sympy.simplify(sympy.sympify(lhs) - sympy.sympify(rhs))
            if diff.is_zero is not None:
                return diff.is_zero == (op == "==")
            return relation if isinstance(relation, bool) else relation
        return relation
    return _COMPARE[op](lhs, rhs)


def describe(value: Any, examples: dict[str, int]) -> str:
    """A value as a guard explanation shows it: `4*batch*seq (= 16.0 MiB at the examples)`."""
    if isinstance(value, Value):
        return f"%{value.name}"
    if isinstance(value, sympy.Basic) and value.free_symbols:
        at = evaluate(value, examples)
        return f"{format_dim(value)}" + (f" (= {at} at the example dims)" if at is not None else "")
    return str(value)

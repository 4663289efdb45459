"""Static types of guard and chunk-count expressions, and folding of their constant parts.

Every expression has one type: a condition (bool), a number (sizes, counts, dims), a captured
value, a variadic capture, a dtype or a string. `require` needs a condition, `and`/`or`/`not`
need conditions, arithmetic needs numbers, comparisons need two things of one comparable type,
and each built-in (engine.guards.BUILTINS) declares its argument and result types below. A
constant part that divides by zero or overflows is refused here rather than at match time.

The walk recurses over the expression; dsl.limits bounds its depth first.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import patterns as P
from engine.errors import SourceLocation

from .limits import MAX_LITERAL

BOOL, NUMBER, VALUE, VARIADIC, DTYPE, STRING = "bool", "number", "value", "variadic", "dtype", "string"
ANY = "any"     # a part that already has an error: checked no further, so one mistake is one error

_DESCRIBE = {BOOL: "a condition", NUMBER: "a number", VALUE: "a captured value",
             VARIADIC: "a variadic capture", DTYPE: "a dtype", STRING: "a string"}


@dataclass(frozen=True)
class FnType:
    params: tuple[frozenset[str], ...]    # accepted types of each argument; the last one repeats
    result: str


_ONE = frozenset({VALUE})
_ONE_OR_MANY = frozenset({VALUE, VARIADIC})
_NUM = frozenset({NUMBER})

# The types of engine.guards.BUILTINS (tests check that the two tables name the same functions).
BUILTIN_TYPES: dict[str, FnType] = {
    "saved": FnType((_ONE,), BOOL),
    "bytes": FnType((_ONE_OR_MANY,), NUMBER),
    "numel": FnType((_ONE,), NUMBER),
    "rank": FnType((_ONE,), NUMBER),
    "dim": FnType((_ONE, _NUM), NUMBER),
    "dtype": FnType((_ONE,), DTYPE),
    "uses": FnType((_ONE,), NUMBER),
    "is_input": FnType((_ONE,), BOOL),
    "is_weight": FnType((_ONE,), BOOL),
    "in_forward": FnType((_ONE,), BOOL),
    "available": FnType((_ONE_OR_MANY,), BOOL),
    "count": FnType((frozenset({VARIADIC}),), NUMBER),
    "ceil": FnType((_NUM,), NUMBER),
    "floor": FnType((_NUM,), NUMBER),
    "min": FnType((_NUM,), NUMBER),
    "max": FnType((_NUM,), NUMBER),
}

_FOLD_CALLS: dict[str, Callable[..., Any]] = {"ceil": math.ceil, "floor": math.floor, "min": min, "max": max}
_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a / b, "//": lambda a, b: a // b, "%": lambda a, b: a % b}
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
_EQUALITY = frozenset({"==", "!="})
_NOT_CONSTANT = object()


def describe(type_: str) -> str:
    return _DESCRIBE.get(type_, type_)


@dataclass
class Typed:
    type: str
    const: Any = _NOT_CONSTANT

    @property
    def is_const(self) -> bool:
        return self.const is not _NOT_CONSTANT


class TypeChecker:
    """Types one rule's expressions. `captures`: name -> VALUE or VARIADIC; `ranks`: the rank
    the rule's type annotations fix for a capture (no `...`), to check constant dims against."""

    def __init__(self, captures: dict[str, str], ranks: dict[str, int],
                 error: Callable[[str, SourceLocation, str], None]):
        self.captures = captures
        self.ranks = ranks
        self.error = error

    def check(self, expr: P.Expr) -> Typed:
        kind = expr.kind
        if kind == "num":
            return Typed(NUMBER, expr.value)
        if kind == "bool":
            return Typed(BOOL, expr.value)
        if kind == "str":
            return Typed(STRING, expr.value)
        if kind == "dtype":
            return Typed(DTYPE, expr.value)
        if kind == "ref":
            return Typed(self.captures.get(expr.value, VALUE))
        if kind == "call":
            return self._call(expr)
        args = [self.check(a) for a in expr.args]
        if kind == "not":
            if not self.expect(BOOL, args[0], expr.args[0], "`not` needs a condition"):
                return Typed(ANY)
            return Typed(BOOL, not args[0].const) if args[0].is_const else Typed(BOOL)
        if kind == "neg":
            if not self.expect(NUMBER, args[0], expr.args[0], "`-` needs a number"):
                return Typed(ANY)
            return self._constant(expr, lambda: -args[0].const) if args[0].is_const else Typed(NUMBER)
        return self._binop(expr, args)

    # ---------------------------------------------------------------------------------
    def expect(self, want: str, got: Typed, expr: P.Expr, what: str) -> bool:
        """Whether `got` has type `want`; an error at `expr` if not (nothing for ANY)."""
        if got.type == want:
            return True
        if got.type != ANY:
            self.error(f"{what}, but `{_short(expr.text)}` is {describe(got.type)}", expr.location,
                       _hint(want, got.type, expr))
        return False

    def _call(self, expr: P.Expr) -> Typed:
        fn = BUILTIN_TYPES.get(expr.value)
        args = [self.check(a) for a in expr.args]
        if fn is None:       # a built-in this table does not know yet: unchecked
            return Typed(ANY)
        ok = True
        for i, (arg, node) in enumerate(zip(args, expr.args)):
            accepted = fn.params[min(i, len(fn.params) - 1)]
            if arg.type not in accepted and arg.type != ANY:
                wants = " or ".join(describe(t) for t in sorted(accepted))
                self.error(f"{expr.value}() takes {wants} as argument {i + 1}, but `{_short(node.text)}` "
                           f"is {describe(arg.type)}", node.location, _hint(min(accepted), arg.type, node))
                ok = False
        if not ok or any(a.type == ANY for a in args):
            return Typed(ANY if not ok else fn.result)
        if expr.value == "dim" and args[1].is_const:
            self._check_dim_index(expr, args[1].const)
        if expr.value in _FOLD_CALLS and all(a.is_const for a in args):
            return self._constant(expr, lambda: _FOLD_CALLS[expr.value](*(a.const for a in args)))
        return Typed(fn.result)

    def _check_dim_index(self, expr: P.Expr, index: Any) -> None:
        node = expr.args[1]
        if isinstance(index, float) and not index.is_integer():
            self.error(f"dim() takes an integer dim index, not {index}", node.location)
            return
        rank = self.ranks.get(expr.args[0].value)
        if rank is not None and not -rank <= int(index) < rank:
            self.error(f"dim {int(index)} is out of range: the rule's type annotation gives "
                       f"{expr.args[0].value} rank {rank}", node.location,
                       f"dims of a rank-{rank} value are {-rank} to {rank - 1}" if rank else "")

    def _binop(self, expr: P.Expr, args: list[Typed]) -> Typed:
        op = expr.value
        lhs, rhs = args
        if op in ("and", "or"):
            ok = [self.expect(BOOL, a, node, f"`{op}` needs a condition on each side")
                  for a, node in zip(args, expr.args)]
            if not all(ok):
                return Typed(ANY)
            if lhs.is_const and rhs.is_const:
                return Typed(BOOL, (lhs.const and rhs.const) if op == "and" else (lhs.const or rhs.const))
            return Typed(BOOL)
        if op in _ARITH:
            ok = [self.expect(NUMBER, a, node, f"`{op}` needs numbers")
                  for a, node in zip(args, expr.args)]
            if not all(ok):
                return Typed(ANY)
            if op in ("/", "//", "%") and rhs.is_const and rhs.const == 0:
                divisor = _short(expr.args[1].text)
                self.error("division by zero" + (f": `{divisor}` is 0" if divisor.strip("()0. ") else ""),
                           expr.args[1].location)
                return Typed(ANY)
            if lhs.is_const and rhs.is_const:
                return self._constant(expr, lambda: _ARITH[op](lhs.const, rhs.const))
            return Typed(NUMBER)
        return self._comparison(expr, lhs, rhs)

    def _comparison(self, expr: P.Expr, lhs: Typed, rhs: Typed) -> Typed:
        op = expr.value
        if ANY in (lhs.type, rhs.type):
            return Typed(ANY)
        left, right = expr.args
        for side, node in ((lhs, left), (rhs, right)):
            if side.type in (VALUE, VARIADIC):
                self.error(f"`{op}` cannot compare {describe(side.type)}: `{_short(node.text)}`", node.location,
                           _hint(NUMBER, side.type, node))
                return Typed(ANY)
        if lhs.type != rhs.type:
            self.error(f"`{op}` compares {describe(lhs.type)} with {describe(rhs.type)}: "
                       f"`{_short(right.text)}` can never equal `{_short(left.text)}`"
                       if op in _EQUALITY else
                       f"`{op}` compares {describe(lhs.type)} with {describe(rhs.type)}", right.location)
            return Typed(ANY)
        if lhs.type in (DTYPE, BOOL) and op not in _EQUALITY:
            self.error(f"{'dtypes' if lhs.type == DTYPE else 'conditions'} compare only with == and !=, "
                       f"not `{op}`", expr.location)
            return Typed(ANY)
        if lhs.is_const and rhs.is_const:
            return Typed(BOOL, _COMPARE[op](lhs.const, rhs.const))
        return Typed(BOOL)

    def _constant(self, expr: P.Expr, compute: Callable[[], Any]) -> Typed:
        """Fold a constant part; one that overflows or leaves the literal range is an error."""
        try:
            value = compute()
        except (OverflowError, ZeroDivisionError, ValueError) as exc:
            self.error(f"`{_short(expr.text)}` cannot be computed: {exc}", expr.location)
            return Typed(ANY)
        if (isinstance(value, float) and not math.isfinite(value)) or abs(value) >= MAX_LITERAL:
            self.error(f"`{_short(expr.text)}` is out of range", expr.location,
                       "numbers lie strictly between -2**63 and 2**63")
            return Typed(ANY)
        return Typed(NUMBER, value)


def _hint(want: str, got: str, expr: P.Expr) -> str:
    if got in (VALUE, VARIADIC) and want in (BOOL, NUMBER):
        name = expr.text.strip()
        if want == BOOL:
            return f"a captured value is not a condition: test something about it, e.g. saved({name})"
        if got == VARIADIC:
            return f"use count({name}) or bytes({name})"
        return f"use a size of it, e.g. bytes({name}), numel({name}) or dim({name}, 0)"
    if got == NUMBER and want == BOOL:
        return "compare it with something, e.g. `... >= 1 MiB`"
    if got == BOOL and want == NUMBER:
        return "conditions are not numbers"
    return ""


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:40] + " ... " + text[-15:]

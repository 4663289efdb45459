"""What an op costs: floating-point operations and bytes moved, from the rule files' `cost` facts.

    cost y = MatMul(a, b) flops 2 * numel(y) * dim(a, -1)
    cost y = LayerNormalization(x, rest...) flops 8 * numel(y) bytes 2 * bytes(x) + bytes(y)

A declaration binds the node's outputs and inputs by position (captures, `_`, a variadic tail)
and gives `flops` and optionally `bytes` in the guard expression language; without `bytes`, the
op moves the bytes of every input and output. The compiler (dsl.compiler) checks the types and
puts the formulas in `RuleSet.costs`, keyed by every op name a declaration resolves to.

`node_cost(node, rules)` evaluates a node's formula: an int, a float or a sympy expression over
the dynamic dims for each of flops and bytes; None for one that cannot be computed (an unknown
shape, an input the node lacks), never an exception. It returns None when no formula covers the
op; `default_cost(node)` is then the fallback (one flop per output element, the bytes of every
input and output), and `total_cost(nodes, rules)` adds a region up with it.

Which formula: a node answers to its IR op (`Transpose`) and, from some backends, to its native
spelling (`aten::permute`), which says more about what it does (a view in torch, a copy in ONNX
Runtime). The native spelling's formula wins, unless the IR op's comes from a later file: a
user's file that tunes `Gelu` then covers the Gelu of every backend.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from .guards import Unproven, evaluate_expr
from .ir import Node
from .patterns import CostFormula, Expr, RuleSet
from .shapes import simplify

# The built-ins a cost formula may call: those that read only the op's own values. (`saved`,
# `uses`, `available`, ... read the graph around the op; the compiler refuses them in a cost.)
COST_BUILTINS = frozenset({"bytes", "numel", "rank", "dim", "dtype", "count", "ceil", "floor", "min", "max"})

Number = int | float | sympy.Expr


@dataclass(frozen=True)
class OpCost:
    """An op's cost: `flops` (floating-point operations; a multiply-add is 2) and `bytes` (memory
    read and written), each an int, a float or a sympy expression over the dynamic dims, or None
    when it cannot be computed. `formula`: the declaration it came from (None: the default)."""

    flops: Number | None
    bytes: Number | None
    formula: CostFormula | None = None


class CostContext:
    """What evaluate_expr needs to evaluate a cost formula: the built-ins in COST_BUILTINS read
    only their arguments, and `and`/`or`/`not` decide symbolic conditions at `examples`."""

    def __init__(self, examples: Mapping[str, int] | None = None):
        self.examples = dict(examples or {})


def formula_for(node: Node, rules: RuleSet) -> CostFormula | None:
    """The cost formula that covers `node` (see the module docstring), or None."""
    costs = rules.costs
    if not costs:
        return None
    own = costs.get(node.op)
    native = costs.get(node.native_op) if node.native_op is not None else None
    if native is None or native is own:
        return own
    if own is not None and own.file_order > native.file_order:
        return own
    return native


def bindings(node: Node, formula: CostFormula) -> dict[str, Any]:
    """The formula's captures bound to the node's values by position. An output or input the node
    lacks (an optional input left out) stays unbound; the variadic capture takes the inputs after
    the named ones, missing ones dropped."""
    out: dict[str, Any] = {}
    for name, value in zip(formula.outputs, node.outputs):
        if name is not None and value is not None:
            out[name] = value
    for name, value in zip(formula.inputs, node.inputs):
        if name is not None and value is not None:
            out[name] = value
    if formula.variadic is not None:
        out[formula.variadic] = [v for v in node.inputs[len(formula.inputs):] if v is not None]
    return out


def node_cost(node: Node, rules: RuleSet, examples: Mapping[str, int] | None = None) -> OpCost | None:
    """The cost of `node` by the formula that covers its op, or None when none does. `examples`:
    example sizes of the dynamic dims, used only where a formula compares sizes."""
    formula = formula_for(node, rules)
    if formula is None:
        return None
    bound = bindings(node, formula)
    ctx = CostContext(examples)
    flops = evaluate(formula.flops, bound, ctx)
    moved = evaluate(formula.bytes, bound, ctx) if formula.bytes is not None else io_bytes(node)
    return OpCost(flops, moved, formula)


def default_cost(node: Node) -> OpCost:
    """The cost of an op no formula covers: one flop per output element, and the bytes of every
    input and output."""
    return OpCost(_total(v.numel for v in node.outputs), io_bytes(node))


def total_cost(nodes: Iterable[Node], rules: RuleSet, examples: Mapping[str, int] | None = None) -> OpCost:
    """The summed cost of `nodes` (a recompute region, say), each by its formula or the default;
    a sum is None when one of its terms is."""
    costs = [node_cost(n, rules, examples) or default_cost(n) for n in nodes]
    return OpCost(_total(c.flops for c in costs), _total(c.bytes for c in costs))


def io_bytes(node: Node) -> Number | None:
    """The bytes of every input and output of `node` (None if one is unknown)."""
    return _total(v.nbytes for v in (*node.present_inputs(), *node.outputs))


def evaluate(expr: Expr, bound: dict[str, Any], ctx: CostContext) -> Number | None:
    """A formula's value, or None when it cannot be computed here (unknown shape or dtype, an
    unbound capture, a dim out of range, a division by zero)."""
    try:
        value = evaluate_expr(expr, bound, ctx)
    except (Unproven, KeyError, IndexError, TypeError, ValueError, ArithmeticError):
        return None
    return _number(value)


def _number(value: Any) -> Number | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, sympy.Basic):
        if not isinstance(value, sympy.Expr):
            return None
        value = simplify(value)
        if isinstance(value, sympy.Expr) and value.is_number:
            if not value.is_finite:
                return None
            value = int(value) if value.is_Integer else float(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return int(value) if value.is_integer() else value
    return value if isinstance(value, (int, sympy.Expr)) else None


def _total(terms: Iterable[Number | None]) -> Number | None:
    total: Number = 0
    for term in terms:
        if term is None:
            return None
        total = total + term
    return _number(total)


__all__ = ["COST_BUILTINS", "CostContext", "OpCost", "bindings", "default_cost", "formula_for",
           "io_bytes", "node_cost", "total_cost"]

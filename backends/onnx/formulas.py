"""Sizes written as formulas over a graph's dynamic dims, computed in the ONNX graph itself.

A chunk region over a dynamic size (`remat export-gpt --dynamic`: batch and seq are `dim_param`s)
gets its slice size and its number of slices from the graph's own `Shape`s, so one rewritten
graph serves every size. `emit_dim` writes a sympy formula (what the engine computed from the
rule's `chunk ... into N`: `ceiling(batch*seq/Min(...))`) as int64 ops on 1-D tensors of one
element: each dim read from a graph input that has it (`Shape(x, start=k, end=k+1)`), then
`Add`, `Mul`, `Div`, `Min`, `Max`; `ceiling(p/q)` is `(p + q - 1) / q` (sizes are positive).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Value

AddNode = Callable[..., Value]     # _Graph.add: (op, inputs, base, dtype, shape, attrs) -> output
Const = Callable[[str, np.ndarray], Value]


class DimEmitter:
    """Emits formulas over the dims of `graph`'s inputs through `add` and `const` (a builder's)."""

    def __init__(self, graph: Graph, add: AddNode, const: Const):
        self.add = add
        self.const = const
        self.sources: dict[sympy.Symbol, tuple[Value, int]] = {}
        for v in graph.inputs:
            for k, d in enumerate(v.shape or ()):
                if isinstance(d, sympy.Symbol) and d not in self.sources:
                    self.sources[d] = (v, k)
        self.made: dict[sympy.Basic, Value] = {}

    def emit(self, expr) -> Value:
        """`expr` (an integer-valued formula) as a 1-D int64 tensor of one element."""
        expr = sympy.sympify(expr)
        if expr in self.made:
            return self.made[expr]
        num, den = sympy.fraction(sympy.together(expr))
        value = self._term(num) if den == 1 else self._op("Div", self._term(num), self._term(den))
        self.made[expr] = value
        return value

    def can_emit(self, exprs) -> bool:
        """Whether every symbol of `exprs` is a dim of a graph input (`emit` raises otherwise)."""
        return all(s in self.sources for e in exprs for s in sympy.sympify(e).free_symbols)

    def _op(self, op: str, *inputs: Value) -> Value:
        return self.add(op, list(inputs), f"dim_{op.lower()}", DType.INT64, (1,))

    def _term(self, expr: sympy.Expr) -> Value:
        if expr.is_Integer:
            return self.const("dim_const", np.array([int(expr)], np.int64))
        if isinstance(expr, sympy.Symbol):
            if expr not in self.sources:
                raise GraphError(f"the size formula reads dim {expr}, which no graph input has")
            v, k = self.sources[expr]
            return self.add("Shape", [v], f"dim_{expr}", DType.INT64, (1,), {"start": k, "end": k + 1})
        if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Min, sympy.Max)):
            op = {sympy.Add: "Add", sympy.Mul: "Mul", sympy.Min: "Min", sympy.Max: "Max"}[type(expr)]
            args = [self.emit(a) for a in expr.args]
            out = args[0]
            for a in args[1:]:
                out = self._op(op, out, a)
            return out
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
            base = self.emit(expr.base)
            out = base
            for _ in range(int(expr.exp) - 1):
                out = self._op("Mul", out, base)
            return out
        if isinstance(expr, (sympy.floor, sympy.ceiling)):
            num, den = sympy.fraction(sympy.together(expr.args[0]))
            p, q = self.emit(num), self.emit(den)
            if isinstance(expr, sympy.ceiling):
                p = self._op("Sub", self._op("Add", p, q), self.emit(1))
            return self._op("Div", p, q)
        raise GraphError(f"the size formula {expr} has a part remat cannot compute in the graph "
                         f"({type(expr).__name__})")

    def scalar(self, value: Value, base: str) -> Value:
        """A 1-D one-element tensor as a scalar (a Loop's trip count)."""
        return self.add("Reshape", [value, self.const("scalar_shape", np.zeros(0, np.int64))], base,
                        DType.INT64, ())

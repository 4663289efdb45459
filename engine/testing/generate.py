"""Hypothesis strategies for training graphs a rule matches, built from the rule's own pattern.

A rule's pattern is a DAG of op patterns (engine.patterns): each becomes one node, its op drawn
from the pattern's alternatives that engine.testing can build (engine.testing.ops), its
attributes those the pattern requires (the others drawn), its captures one value wherever they
are read. An input no pattern node makes (a capture, a wildcard, a variadic tail) is a *leaf*:
a graph input, a parameter, or a value computed from both, drawn with a dtype the capture's
type annotation allows and a shape the op fits. What the pattern leaves dangling goes through
a drawn tail (multiplied by a parameter, a matmul, tanh, log-softmax, or nothing) into a summed
loss, and engine.testing.autodiff writes the backward. So the values the rule targets are real
stashed activations whenever a backward formula reads them.

Dims are symbols while the graph is built. Their sizes start small and drawn, then grow
(doubling one dim at a time, the one that brings the rule's guards and chunk count closest to
holding) until the rule fires or a value would pass `max_bytes`; then every dim is made static
but those drawn to stay dynamic (kept only where the rule still fires with them). Hypothesis
shrinks the structure and the starting sizes; the growth is a function of them, so a shrunk
example is the smallest graph that still fails.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import sympy
from hypothesis import strategies as st

from ..dtypes import DType
from ..ir import Graph, Value
from ..matcher import Match, MatchContext, try_match
from ..patterns import CaptureRef, Chunk, Expr, NodePattern, OutputRef, Rule, RuleSet, Wildcard
from ..shapes import symbol
from .autodiff import add_backward
from .check import load
from .graphs import GraphBuilder, TrainingGraph, random_feeds, static_sizes
from .ops import FLOATS, INT64_MAX, NUMPY, OPS

MiB = 2**20
MAX_BYTES = 64 * MiB          # no generated value larger (a guard that wants more never holds)
MAX_GROWTH = 40               # doublings of one dim at a time

# Ops whose inputs must stay positive (logarithms, roots, divisors).
POSITIVE = {"Log": (0,), "Sqrt": (0,), "Reciprocal": (0,), "Div": (1,), "Pow": (0,)}


class CannotBuild(Exception):
    """The drawn choices do not make a graph (shapes that do not fit): Hypothesis draws again."""


@dataclass
class Hole:
    """An input of a pattern node that no pattern node makes: the generator makes a leaf."""

    capture: str | None


def supported_ops(pattern: NodePattern) -> list[str]:
    """The pattern's ops engine.testing can build with the pattern's number of inputs."""
    n = len(pattern.args)
    return sorted(op for op in pattern.ops if op in OPS and op in FILL
                  and (OPS[op].arity[0] <= n <= OPS[op].arity[1] or
                       (pattern.variadic is not None and n <= OPS[op].arity[1])))


def unsupported(rule: Rule) -> list[str]:
    """Why no graph can be built for `rule`: the patterns with no op engine.testing builds."""
    return [f"`{p.text}` ({'|'.join(sorted(p.ops))})" for p in rule.node_patterns() if not supported_ops(p)]


class _Builder:
    """One draw: the graph under construction, the dims and their starting sizes."""

    def __init__(self, draw, rule: Rule):
        self.draw = draw
        self.rule = rule
        self.b = GraphBuilder()
        self.sizes: dict[str, int] = {}
        self.domains: dict[str, str] = {}
        self.bound: dict[str, Value] = {}
        self.built: dict[int, list[Value]] = {}
        self.types = {t.capture: t for t in rule.types}
        self.leaves = 0

    # dims and leaves ----------------------------------------------------------------------
    def dim(self, name: str | None = None) -> sympy.Symbol:
        name = name or f"d{len(self.sizes)}"
        if name not in self.sizes:
            self.sizes[name] = self.draw(st.integers(2, 6), label=f"size of {name}")
        return symbol(name)

    def shape(self, rank: int | None = None) -> tuple:
        rank = rank if rank is not None else self.draw(st.sampled_from([2, 3, 1]), label="rank")
        return tuple(self.dim() for _ in range(rank))

    def dtype_for(self, hole: Hole | None) -> DType:
        tp = self.types.get(hole.capture) if hole is not None and hole.capture else None
        allowed = [d for d in FLOATS if tp is None or tp.dtypes is None or d in tp.dtypes]
        if tp is not None and tp.dtypes is not None and not allowed:
            raise CannotBuild(f"no float dtype engine.testing makes fits `{tp.text}`")
        choices = allowed if tp is not None and tp.dtypes is not None else [DType.FLOAT32, DType.FLOAT16]
        return self.draw(st.sampled_from(choices), label="dtype")

    def prescribed_shape(self, hole: Hole) -> tuple | None:
        """The shape a capture's type annotation writes out (`x : float16[B, _, 4096]`)."""
        tp = self.types.get(hole.capture) if hole.capture else None
        if tp is None or tp.dims is None:
            return None
        dims = []
        for d in tp.dims:
            if d.kind == "int":
                dims.append(int(d.value))
            elif d.kind == "name":
                dims.append(self.dim(f"{d.value}"))
            elif d.kind == "any":
                dims.append(self.dim())
            else:
                dims.extend(self.dim() for _ in range(self.draw(st.integers(0, 2), label="rest dims")))
        return tuple(dims)

    def leaf(self, hole: Hole | None, dtype: DType, shape: tuple, domain: str = "real",
             differentiable: bool = True) -> Value:
        """A graph input, a parameter, or a parameter times an input (a forward value the
        backward reads); bound to the hole's capture."""
        if hole is not None and hole.capture and hole.capture in self.bound:
            return self.bound[hole.capture]
        self.leaves += 1
        name = hole.capture if hole is not None and hole.capture else "leaf"
        kinds = ["param", "hidden", "input"] if differentiable and dtype in FLOATS else ["input"]
        kind = self.draw(st.sampled_from(kinds), label="leaf kind")
        base = dtype if dtype in NUMPY else DType.FLOAT32        # bfloat16: made from float32
        if kind == "param":
            v = self.b.param(f"{name}_w{self.leaves}", base, shape)
        elif kind == "input":
            v = self.b.input(f"{name}_in{self.leaves}", base, shape)
        else:
            x = self.b.input(f"{name}_x{self.leaves}", base, shape)
            w = self.b.param(f"{name}_w{self.leaves}", base, shape)
            self.domains[x.name] = self.domains[w.name] = domain
            v = self.b.emit("Mul", [x, w], f"{name}_h")
        if v.producer is None:
            self.domains[v.name] = domain
        if base is not dtype:
            v = self.b.emit("Cast", [v], f"{name}_cast", to=dtype)
        if hole is not None and hole.capture:
            self.bound[hole.capture] = v
        return v

    def value(self, arg, dtype: DType, shape: tuple, domain: str = "real", free: bool = False) -> Value:
        """`arg` itself if it is a value; a leaf of this type if it is a hole (with `free`, the
        shape and dtype its capture's annotation writes, where it writes them)."""
        if isinstance(arg, Value):
            return arg
        if free:
            shape = self.prescribed_shape(arg) or shape
            dtype = self.dtype_for(arg) if arg.capture in self.types else dtype
        return self.leaf(arg, dtype, shape, domain)

    def bool_leaf(self, arg, shape: tuple) -> Value:
        if isinstance(arg, Value):
            return arg
        v = self.b.input(f"{arg.capture or 'mask'}_in{self.leaves + 1}", DType.BOOL, shape)
        self.leaves += 1
        if arg.capture:
            self.bound[arg.capture] = v
        return v

    def ints(self, values: Iterable[int], base: str = "axes") -> Value:
        return self.b.const(list(values), np.int64, base)

    # patterns -----------------------------------------------------------------------------
    def build(self, pattern: NodePattern) -> list[Value]:
        if id(pattern) in self.built:
            return self.built[id(pattern)]
        ops = supported_ops(pattern)
        if not ops:
            raise CannotBuild(f"no op of `{pattern.text}` can be built")
        op = self.draw(st.sampled_from(ops), label=f"op of `{pattern.text}`")
        args: list[Any] = []
        for a in pattern.args:
            if isinstance(a, Wildcard):
                args.append(Hole(None))
            elif isinstance(a, CaptureRef):
                args.append(self.bound.get(a.name) or Hole(a.name))
            elif isinstance(a, NodePattern):
                args.append(self.build(a)[0])
            elif isinstance(a, OutputRef):
                outs = self.build(a.pattern)
                if a.output >= len(outs):
                    raise CannotBuild(f"{a.pattern.text} has no output {a.output}")
                args.append(outs[a.output])
        low, high = OPS[op].arity
        if pattern.variadic is not None:
            more = self.draw(st.integers(max(0, low - len(args)), max(0, high - len(args))), label="variadic")
            args += [Hole(None)] * more
        attrs = dict(pattern.attrs)
        try:
            outs = FILL[op](self, op, args, attrs, max(1, len(pattern.outputs)))
        except ValueError as err:          # the drawn shapes do not fit the op
            raise CannotBuild(str(err)) from None
        outs = outs if isinstance(outs, list) else [outs]
        # Captures bind the values of holes the fill made.
        for a, made in zip(pattern.args, outs[0].producer.inputs if outs and outs[0].producer else ()):
            if isinstance(a, CaptureRef) and a.name not in self.bound and made is not None:
                self.bound[a.name] = made
        for name, v in zip(pattern.outputs, outs):
            if name:
                self.bound[name] = v
        self.built[id(pattern)] = outs
        return outs

    def emit(self, op: str, inputs: list, attrs: dict, outputs: int | None = None):
        return self.b.emit(op, inputs, op.lower(), outputs=outputs, **attrs)


# how each op's inputs are made ----------------------------------------------------------------
def _float_input(g: _Builder, args: list, k: int, like: Value | None = None, rank: int | None = None,
                 domain: str = "real") -> Value:
    if isinstance(args[k], Value):
        return args[k]
    if like is not None:
        return g.value(args[k], like.dtype, like.shape, domain)
    return g.value(args[k], g.dtype_for(args[k]), g.shape(rank), domain, free=True)


def _unary(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0, domain="positive" if op in POSITIVE else "real")
    if op == "Gelu" and "approximate" not in attrs:
        attrs["approximate"] = g.draw(st.sampled_from(["none", "tanh"]), label="approximate")
    if op in ("LeakyRelu", "Elu", "Celu") and "alpha" not in attrs:
        attrs["alpha"] = g.draw(st.sampled_from([0.1, 1.0, 0.5]), label="alpha")
    return g.emit(op, [x], attrs)


def _binary(g: _Builder, op: str, args: list, attrs: dict, n: int):
    first = next((a for a in args if isinstance(a, Value)), None)
    positive = POSITIVE.get(op, ())
    if op == "Pow":
        a = _float_input(g, args, 0, domain="positive")
        b = args[1] if isinstance(args[1], Value) else g.b.const(
            g.draw(st.sampled_from([2.0, 3.0, 0.5]), label="exponent"), NUMPY.get(a.dtype, np.float32), "exponent")
        return g.emit(op, [a, b], attrs)
    if first is None:
        first = _float_input(g, args, 0, domain="positive" if 0 in positive else "real")
    ins = []
    for k, arg in enumerate(args):
        if isinstance(arg, Value):
            ins.append(arg)
            continue
        shape = first.shape
        if arg is not args[0] and g.draw(st.integers(0, 3), label="broadcast") == 0 and shape:
            shape = shape[-1:]                                    # a bias-like operand
        ins.append(g.value(arg, first.dtype, shape, "positive" if k in positive else "real"))
    return g.emit(op, ins, attrs)


def _compare(g: _Builder, op: str, args: list, attrs: dict, n: int):
    if op in ("And", "Or", "Xor", "Not"):
        first = next((a for a in args if isinstance(a, Value)), None)
        shape = first.shape if first is not None else g.shape()
        return g.emit(op, [g.bool_leaf(a, shape) for a in args], attrs)
    return _binary(g, op, args, attrs, n)


def _where(g: _Builder, op: str, args: list, attrs: dict, n: int):
    data = next((a for a in args[1:] if isinstance(a, Value)), None)
    if data is None:
        data = _float_input(g, args, 1)
    shape = data.shape
    cond = g.bool_leaf(args[0], shape) if not isinstance(args[0], Value) else args[0]
    ins = [cond] + [a if isinstance(a, Value) else g.value(a, data.dtype, shape) for a in args[1:]]
    return g.emit(op, ins, attrs)


def _clip(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    dt = NUMPY.get(x.dtype, np.float32)
    low = args[1] if isinstance(args[1], Value) else g.b.const(-0.5, dt, "low")
    high = args[2] if isinstance(args[2], Value) else g.b.const(0.5, dt, "high")
    return g.emit(op, [x, low, high], attrs)


def _cast(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    if op == "CastLike":
        like = args[1] if isinstance(args[1], Value) else g.leaf(
            args[1], g.draw(st.sampled_from([d for d in FLOATS if d is not x.dtype]), label="like dtype"),
            (1,), differentiable=False)
        return g.emit(op, [x, like], attrs)
    if "to" not in attrs:
        attrs["to"] = g.draw(st.sampled_from([d for d in FLOATS if d is not x.dtype]), label="to")
    return g.emit(op, [x], attrs)


def _softmax(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    if "axis" not in attrs:
        attrs["axis"] = g.draw(st.sampled_from([-1] + list(range(len(x.shape)))), label="axis")
    return g.emit(op, [x], attrs)


def _layer_norm(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0, rank=g.draw(st.sampled_from([2, 3]), label="rank"))
    if attrs.setdefault("axis", -1) != -1:
        raise CannotBuild("engine.testing normalizes over the last dim only")
    ins = [x] + [g.value(a, x.dtype, x.shape[-1:]) for a in args[1:]]
    return g.emit(op, ins, attrs)


def _matmul(g: _Builder, op: str, args: list, attrs: dict, n: int):
    a, b = args[:2]
    if not isinstance(a, Value) and not isinstance(b, Value):
        a = _float_input(g, args, 0, rank=g.draw(st.sampled_from([2, 3]), label="rank"))
    if isinstance(a, Value) and not isinstance(b, Value):
        if len(a.shape) < 2:
            raise CannotBuild("a matmul operand of rank 1")
        batched = len(a.shape) > 2 and g.draw(st.booleans(), label="batched")
        shape = (*(a.shape[:-2] if batched else ()), a.shape[-1], g.dim())
        b = g.value(b, a.dtype, shape)
    elif not isinstance(a, Value):
        if len(b.shape) < 2:
            raise CannotBuild("a matmul operand of rank 1")
        a = g.value(a, b.dtype, (*b.shape[:-2], g.dim(), b.shape[-2]))
    return g.emit(op, [a, b], attrs)


def _gemm(g: _Builder, op: str, args: list, attrs: dict, n: int):
    for key in ("transA", "transB"):
        attrs.setdefault(key, g.draw(st.sampled_from([0, 1]), label=key))
    m, k, cols = g.dim(), g.dim(), g.dim()
    a = args[0] if isinstance(args[0], Value) else g.value(args[0], g.dtype_for(args[0]),
                                                           (k, m) if attrs["transA"] else (m, k))
    if len(a.shape) != 2:
        raise CannotBuild("Gemm of a value that is not a matrix")
    k = a.shape[0] if attrs["transA"] else a.shape[1]
    b = args[1] if isinstance(args[1], Value) else g.value(args[1], a.dtype, (cols, k) if attrs["transB"] else (k, cols))
    ins = [a, b]
    if len(args) > 2:
        out_cols = b.shape[0] if attrs["transB"] else b.shape[1]
        ins.append(g.value(args[2], a.dtype, (out_cols,)))
    return g.emit(op, ins, attrs)


def _transpose(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0, rank=g.draw(st.sampled_from([2, 3]), label="rank"))
    if "perm" not in attrs:
        attrs["perm"] = g.draw(st.permutations(range(len(x.shape))), label="perm")
    return g.emit(op, [x], attrs)


def _reshape(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0, rank=g.draw(st.sampled_from([2, 3]), label="rank"))
    if op == "Flatten":
        attrs.setdefault("axis", g.draw(st.integers(0, len(x.shape)), label="axis"))
        return g.emit(op, [x], attrs)
    target = args[1] if isinstance(args[1], Value) else g.ints(
        g.draw(st.sampled_from([[0, -1], [-1]]), label="target"), "target")
    return g.emit(op, [x, target], attrs)


def _unsqueeze(g: _Builder, op: str, args: list, attrs: dict, n: int):
    if op == "Unsqueeze":
        x = _float_input(g, args, 0)
        axis = g.draw(st.sampled_from([0, -1]), label="axis")
    else:
        axis = g.draw(st.integers(0, 2), label="axis")
        x = args[0] if isinstance(args[0], Value) else None
        if x is None:
            shape = list(g.shape(2))
            shape.insert(axis, 1)
            x = g.value(args[0], g.dtype_for(args[0]), tuple(shape))
        ones = [k for k, d in enumerate(x.shape) if d == 1]
        if not ones:
            raise CannotBuild("Squeeze of a value with no dim of size 1")
        axis = ones[0]
    axes = args[1] if isinstance(args[1], Value) else g.ints([axis])
    return g.emit(op, [x, axes], attrs)


def _expand(g: _Builder, op: str, args: list, attrs: dict, n: int):
    if isinstance(args[0], Value):
        x = args[0]
        full = tuple(g.dim() if d == 1 else d for d in x.shape)
    else:
        full = g.shape(g.draw(st.sampled_from([2, 3]), label="rank"))
        x = g.value(args[0], g.dtype_for(args[0]), (1, *full[1:]))
    target = args[1] if isinstance(args[1], Value) else g.b.emit(
        "Shape", [g.b.input(f"like_in{g.leaves + 1}", x.dtype if x.dtype in NUMPY else DType.FLOAT32, full)])
    return g.emit(op, [x, target], attrs)


def _split(g: _Builder, op: str, args: list, attrs: dict, n: int):
    parts = n if n > 1 else g.draw(st.integers(2, 3), label="parts")
    if isinstance(args[0], Value):
        x = args[0]
        axis = attrs.get("axis", 0)
    else:
        shape = list(g.shape(g.draw(st.sampled_from([2, 3]), label="rank")))
        axis = attrs.get("axis", g.draw(st.integers(-len(shape), len(shape) - 1), label="axis"))
        shape[axis] = parts * shape[axis]
        x = g.value(args[0], g.dtype_for(args[0]), tuple(shape))
    attrs.setdefault("axis", axis)
    attrs["num_outputs"] = parts
    return g.emit(op, [x], attrs, outputs=parts)


def _concat(g: _Builder, op: str, args: list, attrs: dict, n: int):
    first = next((a for a in args if isinstance(a, Value)), None)
    if first is None:
        first = _float_input(g, args, 0)
    axis = attrs.setdefault("axis", g.draw(st.integers(-len(first.shape), len(first.shape) - 1), label="axis"))
    ins = []
    for arg in args:
        if isinstance(arg, Value):
            ins.append(arg)
        else:
            shape = list(first.shape)
            shape[axis] = g.dim()
            ins.append(g.value(arg, first.dtype, tuple(shape)))
    return g.emit(op, ins, attrs)


def _slice(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    axis = g.draw(st.integers(-len(x.shape), len(x.shape) - 1), label="axis")
    start, end = g.draw(st.sampled_from([(1, INT64_MAX), (0, 1)]), label="slice")
    consts = [g.ints([start], "starts"), g.ints([end], "ends"), g.ints([axis], "slice_axes")]
    return g.emit(op, [x, *(a if isinstance(a, Value) else c for a, c in zip(args[1:], consts))], attrs)


def _cumsum(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    axis = args[1] if isinstance(args[1], Value) else g.b.const(
        g.draw(st.integers(-len(x.shape), len(x.shape) - 1), label="axis"), np.int64, "axis")
    for key in ("exclusive", "reverse"):
        attrs.setdefault(key, g.draw(st.sampled_from([0, 1]), label=key))
    return g.emit(op, [x, axis], attrs)


def _reduce(g: _Builder, op: str, args: list, attrs: dict, n: int):
    x = _float_input(g, args, 0)
    ins = [x]
    if len(args) > 1:
        axes = sorted(g.draw(st.sets(st.integers(0, len(x.shape) - 1), min_size=1), label="axes"))
        ins.append(args[1] if isinstance(args[1], Value) else g.ints(axes))
    attrs.setdefault("keepdims", g.draw(st.sampled_from([1, 0]), label="keepdims"))
    return g.emit(op, ins, attrs)


def _gather_nd(g: _Builder, op: str, args: list, attrs: dict, n: int):
    """Rows of a table picked by an index input of small integers (random_feeds draws them in
    [0, 4), so the table has 4 rows): embedding rows, or a mixture of experts' weights gathered
    per token."""
    if isinstance(args[0], Value):
        table = args[0]
        if not table.shape or table.shape[0] != 4:
            raise CannotBuild("GatherND of a table engine.testing did not make (its indices are in [0, 4))")
    else:
        table = g.leaf(args[0], g.dtype_for(args[0]), (4, *g.shape(g.draw(st.sampled_from([2, 1]), label="rank"))))
    index = args[1] if isinstance(args[1], Value) else g.leaf(args[1], DType.INT64, (g.dim(), 1), differentiable=False)
    if index.dtype is not DType.INT64 or not index.shape or index.shape[-1] != 1:
        raise CannotBuild("GatherND of an index engine.testing did not make")
    return g.emit(op, [table, index], attrs)


FILL: dict[str, Callable] = {
    **{op: _unary for op in ("Gelu", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid",
                             "HardSwish", "Tanh", "Softplus", "Softsign", "Mish", "Erf", "Exp", "Log", "Neg",
                             "Abs", "Sqrt", "Reciprocal", "Identity", "Sign", "Floor", "Ceil", "Round")},
    **{op: _binary for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")},
    **{op: _compare for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or",
                               "Xor", "Not")},
    "Where": _where, "Clip": _clip, "Cast": _cast, "CastLike": _cast, "Softmax": _softmax,
    "LogSoftmax": _softmax, "LayerNormalization": _layer_norm, "MatMul": _matmul, "Gemm": _gemm,
    "Transpose": _transpose, "Reshape": _reshape, "Flatten": _reshape, "Unsqueeze": _unsqueeze,
    "Squeeze": _unsqueeze, "Expand": _expand, "Split": _split, "Concat": _concat, "Slice": _slice,
    "CumSum": _cumsum, "ReduceSum": _reduce, "ReduceMean": _reduce, "ReduceMax": _reduce, "ReduceMin": _reduce,
    "GatherND": _gather_nd,
}


# the rest of the step: tails into a loss, the backward ------------------------------------------
TAILS = ("mul", "matmul", "tanh", "none", "log_softmax")


def _dangling(b: GraphBuilder) -> list[Value]:
    read = {id(v) for n in b.nodes for v in n.present_inputs()}
    return [o for n in b.nodes for o in n.outputs if id(o) not in read and n.op != "Shape"]


def _tail(g: _Builder, v: Value) -> Value | None:
    """`v` on its way into the loss, through a drawn op; None for a value that cannot reach it."""
    b = g.b
    if v.dtype is DType.BOOL:
        g.leaves += 1
        w = g.b.param(f"tail_w{g.leaves}", DType.FLOAT32, v.shape)
        v, kind = b.emit("Where", [v, w, b.const(0.0, np.float32, "zero")], "masked"), "none"
    elif v.dtype not in FLOATS:
        return None
    else:
        kind = g.draw(st.sampled_from(TAILS), label="tail")
    if kind == "mul" and v.dtype in NUMPY:
        g.leaves += 1
        v = b.emit("Mul", [v, b.param(f"tail_w{g.leaves}", v.dtype, v.shape)], "tail")
    elif kind == "matmul" and len(v.shape) >= 2 and v.dtype in NUMPY:
        g.leaves += 1
        v = b.emit("MatMul", [v, b.param(f"tail_w{g.leaves}", v.dtype, (v.shape[-1], g.dim()))], "tail")
    elif kind == "tanh":
        v = b.emit("Tanh", [v], "tail")
    elif kind == "log_softmax" and v.shape:
        v = b.emit("LogSoftmax", [v], "tail", axis=-1)
    if v.dtype is not DType.FLOAT32:
        v = b.emit("Cast", [v], "to_float", to=DType.FLOAT32)
    if len(v.shape) > 1:
        # Rows first: one float32 sum over millions of same-signed terms (a log-softmax) is off by
        # 1e-3 in ONNX Runtime, more than the rewrite's own reordering; a sum of sums is not.
        v = b.emit("ReduceSum", [v, b.const([-1], np.int64, "axes")], "rows", keepdims=0)
    return b.emit("ReduceSum", [v], "part", keepdims=0)


def _step(g: _Builder) -> tuple[Graph, list[str]]:
    """The loss from every dangling value, the backward, the graph with its gradient outputs."""
    parts = [p for p in (_tail(g, v) for v in _dangling(g.b)) if p is not None]
    if not parts:
        raise CannotBuild("nothing the pattern makes can reach a loss")
    loss = parts[0]
    for p in parts[1:]:
        loss = g.b.emit("Add", [loss, p], "loss")
    return with_backward(g.b, loss)


def with_backward(b: GraphBuilder, loss: Value) -> tuple[Graph, list[str]]:
    """The builder's forward nodes, named `loss` at `loss`, and their backward: the training
    step's graph (the loss, then `grad.<param>` of each param that has one) and those params.
    CannotBuild where no param reaches the loss."""
    loss.name = "loss"
    forward = len(b.nodes)
    grads = add_backward(b, loss)
    if not grads:
        raise CannotBuild("no parameter reaches the loss: there is no backward")
    outputs = [loss]
    for param, grad in grads:
        out = b.emit("Identity", [grad], "grad")
        out.name = f"grad.{param.name}"
        outputs.append(out)
    _drop_dead(b, outputs, forward)
    graph = b.graph(outputs, forward_outputs=[loss.name])
    graph.meta["forward_nodes"] = forward
    return graph, [p.name for p, _ in grads]


def training_graph(b: GraphBuilder, loss: Value, seed: int = 0, dynamic: frozenset[str] = frozenset()) -> TrainingGraph:
    """A step written by hand with a GraphBuilder, as the strategies draw theirs: `with_backward`,
    random feeds from `seed`, the dims in `dynamic` kept symbolic (the builder's examples size them)."""
    graph, params = with_backward(b, loss)
    return TrainingGraph(graph, params, graph.meta["forward_nodes"], random_feeds(graph, seed), dynamic=dynamic)


def _drop_dead(b: GraphBuilder, outputs: list[Value], forward: int) -> None:
    """Drop the backward nodes no output needs (a formula's gradient of an input that has none),
    as a training-step exporter does."""
    needed = {id(v) for v in outputs}
    keep = []
    for k in range(len(b.nodes) - 1, -1, -1):
        node = b.nodes[k]
        if k < forward or any(id(o) in needed for o in node.outputs):
            keep.append(node)
            needed.update(id(v) for v in node.present_inputs())
    b.nodes = keep[::-1]
    used = {id(v) for n in b.nodes for v in n.present_inputs()}
    b.weights = [w for w in b.weights if id(w) in used]


# growing the sizes until the rule fires ----------------------------------------------------------
def rule_alone(rules: RuleSet, rule: Rule) -> RuleSet:
    """`rule` with every op fact of `rules` (views, recomputable and chunkable ops, costs)."""
    return replace(rules, rules=[rule])


def fires(graph: Graph, rules: RuleSet, rule: Rule) -> bool:
    from ..apply import plan

    planning = plan(graph, rule_alone(rules, rule), tiers=sorted(rules.tiers()), strict=True)
    return any(region.match.rule.name == rule.name for p in planning.plans for region in p.occurrences)


@functools.lru_cache(maxsize=4096)
def _lambdified(expr: sympy.Expr, names: tuple[str, ...]) -> Callable:
    return sympy.lambdify([symbol(n) for n in names], expr,
                          modules=["math", {"ceiling": math.ceil, "floor": math.floor}])


def _number(x: Any, names: tuple[str, ...]) -> Callable[[tuple], float] | None:
    """A function of the sizes (in `names` order) for a numeric guard value, None if not one."""
    if isinstance(x, bool) or isinstance(x, DType):
        return None
    if isinstance(x, (int, float)):
        return lambda values, x=x: float(x)
    if isinstance(x, sympy.Expr):
        fn = _lambdified(x, names)
        return lambda values, fn=fn: float(fn(*values))
    return None


@dataclass
class _Closeness:
    """A function of the sizes: 1 where a guard holds, towards 0 the farther it is from holding.
    `hopeless`: no sizes make it hold (it does not depend on them, and it is false)."""

    of: Callable[[tuple], float]
    hopeless: bool = False


def _closeness(expr: Expr, bindings: dict, ctx: MatchContext, names: tuple[str, ...]) -> _Closeness:
    """A comparison of sizes scores by their ratio; `and` the mean of its sides, `or` the better."""
    from ..guards import decide, evaluate_expr

    if expr.kind == "binop" and expr.value in ("and", "or"):
        left, right = (_closeness(a, bindings, ctx, names) for a in expr.args)
        if expr.value == "and":
            return _Closeness(lambda v: (left.of(v) + right.of(v)) / 2, left.hopeless or right.hopeless)
        return _Closeness(lambda v: max(left.of(v), right.of(v)), left.hopeless and right.hopeless)
    try:
        if expr.kind == "binop" and expr.value in (">=", ">", "<=", "<"):
            lhs, rhs = (_number(evaluate_expr(a, bindings, ctx), names) for a in expr.args)
            if lhs is not None and rhs is not None:
                bigger, smaller = (lhs, rhs) if expr.value in (">=", ">") else (rhs, lhs)
                strict = expr.value in (">", "<")

                def ratio(v):
                    big, small = bigger(v), smaller(v)
                    if big > small or (big == small and not strict):
                        return 1.0
                    return max(0.0, big) / small if small > 0 else 0.0

                return _Closeness(ratio)
        held = decide(evaluate_expr(expr, bindings, ctx), dict(ctx.examples), expr.text)
    except Exception:        # noqa: BLE001 - a guard the sizes cannot decide counts as not holding
        held = False
    return _Closeness(lambda v, held=held: 1.0 if held else 0.0, not held)


def _score(rule: Rule, match: Match, ctx: MatchContext, names: tuple[str, ...]) -> _Closeness:
    """The mean closeness of the rule's guards, and of its chunk count to 2, at one match."""
    parts = [_closeness(g.expr, match.bindings, ctx, names) for g in rule.guards]
    for action in rule.actions:
        if isinstance(action, Chunk):
            two = Expr("num", action.location, 2)
            parts.append(_closeness(Expr("binop", action.location, ">=", [action.count, two], "count >= 2"),
                                    match.bindings, ctx, names))
    if not parts:
        return _Closeness(lambda v: 1.0)
    return _Closeness(lambda v: sum(p.of(v) for p in parts) / len(parts), any(p.hopeless for p in parts))


def grow_sizes(graph: Graph, rules: RuleSet, rule: Rule, sizes: dict[str, int],
               max_bytes: int = MAX_BYTES) -> dict[str, int]:
    """Double one dim at a time, the one that brings the rule's guards closest to holding, while
    any do not hold and no value passes `max_bytes` (not at all where no sizes can help)."""
    names = tuple(sorted(sizes))
    ctx = MatchContext(graph, rule_alone(rules, rule).enabled(rules.tiers()))
    unguarded = replace(rule, guards=[])
    matches = [m for m in (try_match(unguarded, n, ctx) for n in graph.nodes if rule.root.accepts(n.op, n.native_op))
               if isinstance(m, Match)]
    scores = [c for c in (_score(rule, m, ctx, names) for m in matches) if not c.hopeless]
    if not scores:
        return sizes
    largest = _largest(graph, names)

    def score(values: tuple) -> float:
        return max(s.of(values) for s in scores)

    values = tuple(sizes[n] for n in names)
    current = score(values)
    for _ in range(MAX_GROWTH):
        if current >= 1.0:
            break
        best = None
        for k in range(len(names)):
            trial = values[:k] + (values[k] * 2,) + values[k + 1:]
            if largest(trial) > max_bytes:
                continue
            s = score(trial)
            # Ties go to the smallest dim, so equal dims grow together.
            if best is None or (s, -values[k]) > (best[0], -best[2]):
                best = (s, trial, values[k])
        if best is None or best[0] <= current:
            break
        current, values = best[0], best[1]
    return dict(zip(names, values))


def _largest(graph: Graph, names: tuple[str, ...]) -> Callable[[tuple], float]:
    exprs = {v.nbytes for v in graph.values() if v.nbytes is not None}
    fns = [f for f in (_number(e, names) for e in exprs) if f is not None]
    return lambda values: max((f(values) for f in fns), default=0.0)


# the strategies ---------------------------------------------------------------------------------
@st.composite
def _for_rule(draw, rules: RuleSet, rule: Rule, max_bytes: int, dynamic: bool, only_firing: bool) -> TrainingGraph:
    from hypothesis import reject

    g = _Builder(draw, rule)
    try:
        g.build(rule.root)
        graph, params = _step(g)
    except CannotBuild:
        reject()
    sizes = grow_sizes(graph, rules, rule, g.sizes, max_bytes)
    static = static_sizes(graph, sizes)
    if only_firing and not fires(static, rules, rule):
        reject()
    keep: frozenset[str] = frozenset()
    if dynamic and sizes and draw(st.integers(0, 4), label="dynamic dims") == 0:
        keep = frozenset(draw(st.sets(st.sampled_from(sorted(sizes)), min_size=1, max_size=2), label="dynamic"))
        trial = static_sizes(graph, sizes, keep)
        if fires(trial, rules, rule) or not fires(static, rules, rule):
            static = trial
        else:
            keep = frozenset()
    seed = draw(st.integers(0, 2**16), label="seed")
    feeds = random_feeds(static, seed, g.domains)
    return TrainingGraph(static, params, graph.meta["forward_nodes"], feeds, rule.name, keep, sizes)


def training_graphs(rules: RuleSet | str | Iterable | None = None, rule: str | None = None, *,
                    max_bytes: int = MAX_BYTES, dynamic: bool = True, only_firing: bool = True):
    """Training graphs the rules (a RuleSet, or rule files and folders; the shipped library by
    default) match: for `rule`, or for a rule drawn from them. Each is built from a rule's own
    pattern (see the module docstring) and sized so the rule fires where its guards allow it,
    no value larger than `max_bytes`; `dynamic`: some dims may stay symbolic. With `only_firing`
    (the default) every graph is one the rule fires on (as `engine.plan` sees it; a backend may
    still refuse to build a plan), so shrinking keeps it firing too."""
    ruleset = load(rules)
    chosen = [r for r in ruleset.rules if rule is None or r.name == rule]
    if not chosen:
        from ..errors import RuleError

        raise RuleError(f"no rule named {rule!r}; rules: {', '.join(r.name for r in ruleset.rules)}")
    buildable = [r for r in chosen if not unsupported(r)]
    if not buildable:
        from ..errors import RuleError

        raise RuleError(f"engine.testing builds no graph for {', '.join(r.name for r in chosen)}: "
                        + "; ".join(f"{r.name}: {', '.join(unsupported(r))}" for r in chosen))
    return st.sampled_from(buildable).flatmap(lambda r: _for_rule(ruleset, r, max_bytes, dynamic, only_firing))

"""The ops engine.testing builds graphs from: each op's output types and its gradient.

Ops are ONNX operators (the IR's vocabulary). A gradient is a vector-Jacobian product written
as more ops against an `Emitter`, so the same formulas build the backward of an IR graph
(engine.testing.autodiff) and of the ONNX graphs the test suite writes by hand
(tests/training_graphs.py). What a generated graph feeds each op is in
engine.testing.generate; how torch runs each op, in backends/fx/testing.py.

Shapes are tuples of ints and sympy expressions over dim symbols, as everywhere in the IR.
No formula here writes a size into a constant: a constant holds axes, scalars and
permutations only, so a graph built over symbolic dims can be instantiated at any sizes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import sympy

from ..dtypes import DType
from ..shapes import Dim, simplify

Shape = tuple[Dim, ...]
INT64_MAX = 2**63 - 1

FLOATS = (DType.FLOAT32, DType.FLOAT16, DType.FLOAT64, DType.BFLOAT16)
# numpy spells these; bfloat16 it cannot (a bfloat16 constant is a float32 one, cast).
NUMPY = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.FLOAT64: np.float64,
         DType.INT64: np.int64, DType.INT32: np.int32, DType.BOOL: np.bool_}


class Emitter(Protocol):
    """What a gradient formula writes with: `op` adds a node and returns its first output (or
    all of them, with `outputs=N`); `const` adds a constant."""

    def op(self, op: str, inputs: list, base: str | None = None, **attrs) -> Any: ...

    def const(self, value: Any, dtype: Any = np.float32, base: str = "c") -> Any: ...


@dataclass
class Call:
    """One forward node, as its gradient formula sees it: the emitter's handles of its inputs and
    outputs, its attributes, and the types of its inputs and outputs (None where the emitter
    keeps no types: the hand-written ONNX graphs, float32 throughout)."""

    inputs: list
    outputs: list
    attrs: dict
    shapes: list[Shape | None] | None = None
    out_shapes: list[Shape | None] | None = None
    dtype: DType = DType.FLOAT32
    ints: list[list[int] | None] | None = None     # the content of each integer-constant input

    def shape(self, i: int) -> Shape:
        if self.shapes is None or self.shapes[i] is None:
            raise ValueError("this gradient needs the input shapes")
        return self.shapes[i]


def scalar(e: Emitter, value: float, dtype: DType = DType.FLOAT32, base: str = "c"):
    """A float constant of `dtype` (a bfloat16 one is a float32 constant, cast)."""
    if dtype in NUMPY:
        return e.const(value, NUMPY[dtype], base)
    return e.op("Cast", [e.const(value, np.float32, base)], f"{base}_cast", to=dtype)


def ints(e: Emitter, values: Sequence[int], base: str = "axes"):
    return e.const(list(values), np.int64, base)


# shapes ---------------------------------------------------------------------------------------
def broadcast(*shapes: Shape) -> Shape:
    """numpy broadcasting over symbolic dims: equal dims, or a 1 against anything."""
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = [s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0]
        other = [d for d in dims if d != 1]
        if any(simplify(d - other[0]) != 0 for d in other[1:]):
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(other[0] if other else 1)
    return tuple(out)


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def _prod(dims: Sequence[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = simplify(out * d)
    return out


# gradient helpers -----------------------------------------------------------------------------
def unbroadcast(e: Emitter, g, g_shape: Shape, target: Shape):
    """The gradient of a broadcast operand: `g` summed over the dims broadcasting added."""
    lead = len(g_shape) - len(target)
    if lead > 0:
        g = e.op("ReduceSum", [g, ints(e, range(lead))], "unbroadcast", keepdims=0)
    kept = [k for k, (have, want) in enumerate(zip(g_shape[lead:], target)) if want == 1 and have != 1]
    if kept:
        g = e.op("ReduceSum", [g, ints(e, kept)], "unbroadcast", keepdims=1)
    return g


def _swap_last(rank: int) -> list[int]:
    perm = list(range(rank))
    perm[-2:] = perm[-2:][::-1]
    return perm


def _zeros_like(e: Emitter, value, dtype: DType):
    return e.op("Expand", [scalar(e, 0.0, dtype), e.op("Shape", [value], "zshape")], "zeros")


def _where_positive(e: Emitter, x, dtype: DType, yes, no):
    return e.op("Where", [e.op("Greater", [x, scalar(e, 0.0, dtype)], "pos"), yes, no], "where")


# gradients: (emitter, call, output gradients) -> input gradients (None: no gradient) ------------
def _gelu(e: Emitter, c: Call, g):
    x, t = c.inputs[0], c.dtype
    if c.attrs.get("approximate", "none") == "tanh":
        k = math.sqrt(2 / math.pi)
        x2 = e.op("Mul", [x, x], "x2")
        inner = e.op("Mul", [scalar(e, k, t), e.op("Add", [x, e.op("Mul", [scalar(e, 0.044715, t),
                                                                          e.op("Mul", [x2, x], "x3")])])])
        th = e.op("Tanh", [inner], "th")
        du = e.op("Mul", [scalar(e, k, t), e.op("Add", [scalar(e, 1.0, t),
                                                        e.op("Mul", [scalar(e, 3 * 0.044715, t), x2])])])
        sech2 = e.op("Sub", [scalar(e, 1.0, t), e.op("Mul", [th, th])])
        left = e.op("Mul", [scalar(e, 0.5, t), e.op("Add", [scalar(e, 1.0, t), th])])
        right = e.op("Mul", [e.op("Mul", [scalar(e, 0.5, t), x]), e.op("Mul", [sech2, du])])
        return [e.op("Mul", [g, e.op("Add", [left, right])], "dgelu")]
    # d/dx x*Phi(x) = Phi(x) + x*phi(x)
    cdf = e.op("Mul", [scalar(e, 0.5, t), e.op("Add", [scalar(e, 1.0, t), e.op(
        "Erf", [e.op("Mul", [x, scalar(e, 1 / np.sqrt(2.0), t)], "xs")], "erf")], "one_erf")], "cdf")
    pdf = e.op("Mul", [e.op("Exp", [e.op("Mul", [e.op("Mul", [x, x], "x2"), scalar(e, -0.5, t)], "nx2")],
                            "e"), scalar(e, 1 / np.sqrt(2 * np.pi), t)], "pdf")
    deriv = e.op("Add", [cdf, e.op("Mul", [x, pdf], "xpdf")], "dgelu_dx")
    return [e.op("Mul", [g, deriv], "dgelu")]


def _relu(e: Emitter, c: Call, g):
    mask = e.op("Greater", [c.inputs[0], scalar(e, 0.0, c.dtype)], "mask")
    return [e.op("Where", [mask, g, scalar(e, 0.0, c.dtype)], "drelu")]


def _leaky_relu(e: Emitter, c: Call, g):
    alpha = c.attrs.get("alpha", 0.01)
    return [_where_positive(e, c.inputs[0], c.dtype, g, e.op("Mul", [g, scalar(e, alpha, c.dtype)]))]


def _elu(e: Emitter, c: Call, g):
    alpha = c.attrs.get("alpha", 1.0)
    below = e.op("Mul", [g, e.op("Add", [c.outputs[0], scalar(e, alpha, c.dtype)])])
    return [_where_positive(e, c.inputs[0], c.dtype, g, below)]


def _selu(e: Emitter, c: Call, g):
    alpha, gamma = c.attrs.get("alpha", 1.67326319217681884765625), c.attrs.get("gamma", 1.05070102214813232421875)
    above = e.op("Mul", [g, scalar(e, gamma, c.dtype)])
    below = e.op("Mul", [g, e.op("Add", [c.outputs[0], scalar(e, alpha * gamma, c.dtype)])])
    return [_where_positive(e, c.inputs[0], c.dtype, above, below)]


def _celu(e: Emitter, c: Call, g):
    alpha = c.attrs.get("alpha", 1.0)
    below = e.op("Mul", [g, e.op("Exp", [e.op("Div", [c.inputs[0], scalar(e, alpha, c.dtype)])])])
    return [_where_positive(e, c.inputs[0], c.dtype, g, below)]


def _sigmoid(e: Emitter, c: Call, g):
    act = c.outputs[0]
    one_minus = e.op("Sub", [scalar(e, 1.0, c.dtype), act], "one_minus")
    return [e.op("Mul", [g, e.op("Mul", [act, one_minus], "dsig")], "dsigmoid")]


def _hard_sigmoid_mask(e: Emitter, c: Call, alpha: float, beta: float):
    t = c.dtype
    v = e.op("Add", [e.op("Mul", [c.inputs[0], scalar(e, alpha, t)]), scalar(e, beta, t)], "hs_in")
    return e.op("And", [e.op("Greater", [v, scalar(e, 0.0, t)]), e.op("Less", [v, scalar(e, 1.0, t)])], "hs_mask")


def _hard_sigmoid(e: Emitter, c: Call, g):
    alpha, beta = c.attrs.get("alpha", 0.2), c.attrs.get("beta", 0.5)
    mask = _hard_sigmoid_mask(e, c, alpha, beta)
    return [e.op("Where", [mask, e.op("Mul", [g, scalar(e, alpha, c.dtype)]), scalar(e, 0.0, c.dtype)])]


def _hard_swish(e: Emitter, c: Call, g):
    # x * hardsigmoid(x) with alpha 1/6, beta 1/2: hardsigmoid(x) + x * alpha inside the ramp.
    x, t = c.inputs[0], c.dtype
    mask = _hard_sigmoid_mask(e, c, 1 / 6, 0.5)
    ramp = e.op("Where", [mask, e.op("Mul", [x, scalar(e, 1 / 6, t)]), scalar(e, 0.0, t)])
    return [e.op("Mul", [g, e.op("Add", [e.op("HardSigmoid", [x], alpha=1 / 6, beta=0.5), ramp])])]


def _tanh(e: Emitter, c: Call, g):
    act = c.outputs[0]
    sq = e.op("Mul", [act, act], "tsq")
    return [e.op("Mul", [g, e.op("Sub", [scalar(e, 1.0, c.dtype), sq], "dt")], "dtanh")]


def _softplus(e: Emitter, c: Call, g):
    return [e.op("Mul", [g, e.op("Sigmoid", [c.inputs[0]])])]


def _softsign(e: Emitter, c: Call, g):
    d = e.op("Add", [scalar(e, 1.0, c.dtype), e.op("Abs", [c.inputs[0]])])
    return [e.op("Div", [g, e.op("Mul", [d, d])])]


def _mish(e: Emitter, c: Call, g):
    x, t = c.inputs[0], c.dtype
    th = e.op("Tanh", [e.op("Softplus", [x])])
    sech2 = e.op("Sub", [scalar(e, 1.0, t), e.op("Mul", [th, th])])
    return [e.op("Mul", [g, e.op("Add", [th, e.op("Mul", [e.op("Mul", [x, e.op("Sigmoid", [x])]), sech2])])])]


def _erf(e: Emitter, c: Call, g):
    x, t = c.inputs[0], c.dtype
    d = e.op("Mul", [scalar(e, 2 / math.sqrt(math.pi), t), e.op("Exp", [e.op("Neg", [e.op("Mul", [x, x])])])])
    return [e.op("Mul", [g, d])]


def _exp(e: Emitter, c: Call, g):
    return [e.op("Mul", [g, c.outputs[0]])]


def _log(e: Emitter, c: Call, g):
    return [e.op("Div", [g, c.inputs[0]])]


def _neg(e: Emitter, c: Call, g):
    return [e.op("Neg", [g])]


def _abs(e: Emitter, c: Call, g):
    return [e.op("Mul", [g, e.op("Sign", [c.inputs[0]])])]


def _sqrt(e: Emitter, c: Call, g):
    return [e.op("Div", [g, e.op("Mul", [scalar(e, 2.0, c.dtype), c.outputs[0]])])]


def _reciprocal(e: Emitter, c: Call, g):
    y = c.outputs[0]
    return [e.op("Neg", [e.op("Mul", [g, e.op("Mul", [y, y])])])]


def _identity(e: Emitter, c: Call, g):
    return [g]


def _none(e: Emitter, c: Call, g):
    return [None] * len(c.inputs)


def _cast(e: Emitter, c: Call, g):
    return [e.op("Cast", [g], "dcast", to=c.dtype)] + [None] * (len(c.inputs) - 1)


def _softmax(e: Emitter, c: Call, g):
    act, axis = c.outputs[0], c.attrs.get("axis", -1)
    dot = e.op("ReduceSum", [e.op("Mul", [g, act], "ga"), ints(e, [axis])], "dot", keepdims=1)
    return [e.op("Mul", [act, e.op("Sub", [g, dot], "gs")], "dsoftmax")]


def _log_softmax(e: Emitter, c: Call, g):
    axis = c.attrs.get("axis", -1)
    total = e.op("ReduceSum", [g, ints(e, [axis])], "gsum", keepdims=1)
    return [e.op("Sub", [g, e.op("Mul", [e.op("Exp", [c.outputs[0]]), total])], "dlogsoftmax")]


def _binary_grads(e: Emitter, c: Call, ga, gb):
    out = c.out_shapes[0] if c.out_shapes else None
    grads = []
    for k, grad in enumerate((ga, gb)):
        if grad is not None and out is not None and c.shapes is not None and c.shapes[k] is not None:
            grad = unbroadcast(e, grad, out, c.shapes[k])
        grads.append(grad)
    return grads


def _add(e: Emitter, c: Call, g):
    return _binary_grads(e, c, g, g)


def _sub(e: Emitter, c: Call, g):
    return _binary_grads(e, c, g, e.op("Neg", [g]))


def _mul(e: Emitter, c: Call, g):
    a, b = c.inputs
    return _binary_grads(e, c, e.op("Mul", [g, b]), e.op("Mul", [g, a]))


def _div(e: Emitter, c: Call, g):
    a, b = c.inputs
    ga = e.op("Div", [g, b])
    # d(a/b)/db = -a/b^2 = -(1/b) * y
    return _binary_grads(e, c, ga, e.op("Neg", [e.op("Mul", [ga, c.outputs[0]])]))


def _pow(e: Emitter, c: Call, g):
    """The exponent is a constant (engine.testing makes it one): no gradient for it."""
    a, b = c.inputs
    one = scalar(e, 1.0, c.dtype)
    da = e.op("Mul", [g, e.op("Mul", [b, e.op("Pow", [a, e.op("Sub", [b, one])])])])
    return [_binary_grads(e, c, da, None)[0], None]


def _max_min(op: str):
    test = "GreaterOrEqual" if op == "Max" else "LessOrEqual"

    def vjp(e: Emitter, c: Call, g):
        a, b = c.inputs
        zero = scalar(e, 0.0, c.dtype)
        mask = e.op(test, [a, b], "pick")
        return _binary_grads(e, c, e.op("Where", [mask, g, zero]), e.op("Where", [mask, zero, g]))

    return vjp


def _where(e: Emitter, c: Call, g):
    cond = c.inputs[0]
    zero = scalar(e, 0.0, c.dtype)
    grads = [e.op("Where", [cond, g, zero]), e.op("Where", [cond, zero, g])]
    out = c.out_shapes[0] if c.out_shapes else None
    if out is not None and c.shapes is not None:
        grads = [unbroadcast(e, gr, out, c.shapes[k + 1]) for k, gr in enumerate(grads)]
    return [None, *grads]


def _clip(e: Emitter, c: Call, g):
    x, low, high = c.inputs
    inside = e.op("And", [e.op("GreaterOrEqual", [x, low]), e.op("LessOrEqual", [x, high])])
    return [e.op("Where", [inside, g, scalar(e, 0.0, c.dtype)]), None, None]


def _matmul(e: Emitter, c: Call, g):
    a, b = c.inputs
    ra, rb = len(c.shape(0)), len(c.shape(1))
    out = c.out_shapes[0]
    ga = e.op("MatMul", [g, e.op("Transpose", [b], "bt", perm=_swap_last(rb))], "da")
    gb = e.op("MatMul", [e.op("Transpose", [a], "at", perm=_swap_last(ra)), g], "db")
    ga_shape = (*out[:-1], c.shape(0)[-1])
    gb_shape = (*out[:-2], c.shape(1)[-2], out[-1])
    return [unbroadcast(e, ga, ga_shape, c.shape(0)), unbroadcast(e, gb, gb_shape, c.shape(1))]


def _gemm(e: Emitter, c: Call, g):
    a, b = c.inputs[:2]
    trans_a, trans_b = c.attrs.get("transA", 0), c.attrs.get("transB", 0)
    a_eff = e.op("Transpose", [a], "at", perm=[1, 0]) if trans_a else a
    b_eff = e.op("Transpose", [b], "bt", perm=[1, 0]) if trans_b else b
    da = e.op("MatMul", [g, e.op("Transpose", [b_eff], perm=[1, 0])], "da")
    db = e.op("MatMul", [e.op("Transpose", [a_eff], perm=[1, 0]), g], "db")
    grads = [e.op("Transpose", [da], perm=[1, 0]) if trans_a else da,
             e.op("Transpose", [db], perm=[1, 0]) if trans_b else db]
    if len(c.inputs) > 2:
        grads.append(unbroadcast(e, g, c.out_shapes[0], c.shape(2)))
    return grads


def _layer_norm(e: Emitter, c: Call, g):
    """Over the last dim (engine.testing generates axis=-1); the statistics are recomputed."""
    x, scale = c.inputs[:2]
    t, eps = c.dtype, c.attrs.get("epsilon", 1e-5)
    last = ints(e, [-1])
    mean = e.op("ReduceMean", [x, last], "mean", keepdims=1)
    xc = e.op("Sub", [x, mean], "xc")
    var = e.op("ReduceMean", [e.op("Mul", [xc, xc]), last], "var", keepdims=1)
    inv = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, scalar(e, eps, t)])])], "inv")
    xhat = e.op("Mul", [xc, inv], "xhat")
    gs = e.op("Mul", [g, scale], "gs")
    mean_gs = e.op("ReduceMean", [gs, last], keepdims=1)
    mean_gsx = e.op("ReduceMean", [e.op("Mul", [gs, xhat]), last], keepdims=1)
    dx = e.op("Mul", [inv, e.op("Sub", [e.op("Sub", [gs, mean_gs]), e.op("Mul", [xhat, mean_gsx])])], "dx")
    out = c.out_shapes[0]
    grads = [dx, unbroadcast(e, e.op("Mul", [g, xhat]), out, c.shape(1))]
    if len(c.inputs) > 2:
        grads.append(unbroadcast(e, g, out, c.shape(2)))
    return grads


def _transpose(e: Emitter, c: Call, g):
    perm = c.attrs.get("perm") or list(range(len(c.shape(0))))[::-1]
    inverse = [0] * len(perm)
    for k, p in enumerate(perm):
        inverse[p] = k
    return [e.op("Transpose", [g], "dt", perm=inverse)]


def _reshape_back(e: Emitter, c: Call, g):
    grad = e.op("Reshape", [g, e.op("Shape", [c.inputs[0]], "xshape")], "dreshape")
    return [grad] + [None] * (len(c.inputs) - 1)


def _expand(e: Emitter, c: Call, g):
    return [unbroadcast(e, g, c.out_shapes[0], c.shape(0)), None]


def _gather_nd(e: Emitter, c: Call, g):
    """The picked rows' gradients added back at their index tuples, into zeros (torch's
    `index_put(..., accumulate=True)` of `table[ids]`'s backward, ONNX's ScatterND)."""
    table, index = c.inputs
    return [e.op("ScatterND", [_zeros_like(e, table, c.dtype), index, g], "dtable", reduction="add"), None]


def _split(e: Emitter, c: Call, *grads):
    axis = c.attrs.get("axis", 0)
    parts = [gr if gr is not None else _zeros_like(e, out, c.dtype) for gr, out in zip(grads, c.outputs)]
    return [e.op("Concat", parts, "dsplit", axis=axis)] + [None] * (len(c.inputs) - 1)


def _concat(e: Emitter, c: Call, g):
    axis = _axis(c.attrs["axis"], len(c.shape(0)))
    sizes = e.op("Concat", [e.op("Shape", [x], "part", start=axis, end=axis + 1) for x in c.inputs],
                 "sizes", axis=0)
    return e.op("Split", [g, sizes], "dconcat", axis=axis, outputs=len(c.inputs),
                output_shapes=list(c.shapes))


def _slice(e: Emitter, c: Call, g):
    """Slices of one axis, `starts=[s]`, `ends=[t]` (t may be INT64_MAX): zeros either side."""
    x, starts, ends, axes = c.inputs[:4]
    (start,), (end,), (axis,) = c.ints[1], c.ints[2], c.ints[3]
    parts = []
    if start:
        parts.append(_zeros_like(e, e.op("Slice", [x, ints(e, [0]), starts, axes], "before"), c.dtype))
    parts.append(g)
    if end != INT64_MAX:
        parts.append(_zeros_like(e, e.op("Slice", [x, ends, ints(e, [INT64_MAX]), axes], "after"), c.dtype))
    grad = parts[0] if len(parts) == 1 else e.op("Concat", parts, "dslice", axis=axis)
    return [grad, None, None, None]


def _cumsum(e: Emitter, c: Call, g):
    return [e.op("CumSum", [g, c.inputs[1]], "dcumsum", exclusive=c.attrs.get("exclusive", 0),
                 reverse=1 - c.attrs.get("reverse", 0)), None]


def _reduce(op: str):
    def vjp(e: Emitter, c: Call, g):
        x = c.inputs[0]
        axes = c.ints[1] if len(c.inputs) > 1 and c.ints[1] is not None else list(range(len(c.shape(0))))
        if not c.attrs.get("keepdims", 1):
            g = e.op("Unsqueeze", [g, ints(e, axes)], "keep")
        wide = e.op("Expand", [g, e.op("Shape", [x])], "dreduce")
        if op == "ReduceMean":
            count = e.op("Div", [e.op("Cast", [e.op("Size", [x])], to=c.dtype),
                                 e.op("Cast", [e.op("Size", [c.outputs[0]])], to=c.dtype)], "count")
            wide = e.op("Div", [wide, count])
        elif op in ("ReduceMax", "ReduceMin"):
            y = c.outputs[0]
            if not c.attrs.get("keepdims", 1):
                y = e.op("Unsqueeze", [y, ints(e, axes)])
            hit = e.op("Cast", [e.op("Equal", [x, y])], to=c.dtype)
            wide = e.op("Mul", [wide, hit])
        return [wide] + [None] * (len(c.inputs) - 1)

    return vjp


# output types ---------------------------------------------------------------------------------
@dataclass
class In:
    """An input as type inference sees it: dtype, shape and, for a small integer constant or the
    Shape of a value, its integer content."""

    dtype: DType
    shape: Shape | None
    ints: list[int] | None = None
    shape_of: Shape | None = None       # the input is Shape(v): v's shape


Types = list[tuple[DType, Shape]]


def _same(ins: list[In], attrs: dict) -> Types:
    return [(ins[0].dtype, ins[0].shape)]


def _broadcasting(ins: list[In], attrs: dict) -> Types:
    return [(ins[0].dtype, broadcast(*(i.shape for i in ins)))]


def _compare(ins: list[In], attrs: dict) -> Types:
    return [(DType.BOOL, broadcast(*(i.shape for i in ins)))]


def _where_type(ins: list[In], attrs: dict) -> Types:
    return [(ins[1].dtype, broadcast(*(i.shape for i in ins)))]


def _cast_type(ins: list[In], attrs: dict) -> Types:
    return [(attrs["to"], ins[0].shape)]


def _cast_like_type(ins: list[In], attrs: dict) -> Types:
    return [(ins[1].dtype, ins[0].shape)]


def _matmul_type(ins: list[In], attrs: dict) -> Types:
    a, b = ins[0].shape, ins[1].shape
    if len(a) < 2 or len(b) < 2 or simplify(a[-1] - b[-2]) != 0:
        raise ValueError(f"MatMul of {a} and {b}")
    return [(ins[0].dtype, (*broadcast(a[:-2], b[:-2]), a[-2], b[-1]))]


def _gemm_type(ins: list[In], attrs: dict) -> Types:
    a, b = ins[0].shape, ins[1].shape
    m = a[1] if attrs.get("transA") else a[0]
    n = b[0] if attrs.get("transB") else b[1]
    return [(ins[0].dtype, (m, n))]


def _transpose_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    perm = attrs.get("perm") or list(range(len(shape)))[::-1]
    return [(ins[0].dtype, tuple(shape[p] for p in perm))]


def _reshape_type(ins: list[In], attrs: dict) -> Types:
    src, target = ins[0].shape, ins[1].shape_of or ins[1].ints
    if target is None:
        raise ValueError("Reshape to a shape engine.testing cannot read")
    if ins[1].shape_of is not None:
        return [(ins[0].dtype, tuple(target))]
    dims = [src[k] if d == 0 else d for k, d in enumerate(target)]
    if -1 in dims:
        known = _prod([d for d in dims if d != -1])
        dims[dims.index(-1)] = simplify(_prod(src) / known)
    return [(ins[0].dtype, tuple(dims))]


def _flatten_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    axis = _axis(attrs.get("axis", 1), len(shape) + 1) if shape else 0
    return [(ins[0].dtype, (_prod(shape[:axis]), _prod(shape[axis:])))]


def _unsqueeze_type(ins: list[In], attrs: dict) -> Types:
    shape = list(ins[0].shape)
    rank = len(shape) + len(ins[1].ints)
    for a in sorted(_axis(a, rank) for a in ins[1].ints):
        shape.insert(a, 1)
    return [(ins[0].dtype, tuple(shape))]


def _squeeze_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    gone = {_axis(a, len(shape)) for a in ins[1].ints}
    return [(ins[0].dtype, tuple(d for k, d in enumerate(shape) if k not in gone))]


def _expand_type(ins: list[In], attrs: dict) -> Types:
    target = ins[1].shape_of if ins[1].shape_of is not None else tuple(ins[1].ints or ())
    return [(ins[0].dtype, broadcast(ins[0].shape, target))]


def _shape_type(ins: list[In], attrs: dict) -> Types:
    rank = len(ins[0].shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start, end = (s % rank if s < 0 else min(s, rank) for s in (start, end))
    return [(DType.INT64, (max(0, end - start),))]


def _size_type(ins: list[In], attrs: dict) -> Types:
    return [(DType.INT64, ())]


def _split_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    axis = _axis(attrs.get("axis", 0), len(shape))
    given = attrs.get("output_shapes")
    if given is not None:
        return [(ins[0].dtype, tuple(s)) for s in given]
    n = attrs.get("num_outputs")
    if len(ins) > 1 and ins[1].ints is not None:
        sizes = ins[1].ints
    elif n:
        part = simplify(shape[axis] / n)
        if not (isinstance(part, int) or part.is_integer):
            raise ValueError(f"Split of {shape[axis]} into {n}")
        sizes = [part] * n
    else:
        raise ValueError("Split needs num_outputs or constant sizes")
    return [(ins[0].dtype, (*shape[:axis], s, *shape[axis + 1:])) for s in sizes]


def _concat_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    axis = _axis(attrs["axis"], len(shape))
    total = simplify(sum(i.shape[axis] for i in ins))
    return [(ins[0].dtype, (*shape[:axis], total, *shape[axis + 1:]))]


def _slice_type(ins: list[In], attrs: dict) -> Types:
    shape = list(ins[0].shape)
    (start,), (end,), (axis,) = ins[1].ints, ins[2].ints, ins[3].ints
    axis = _axis(axis, len(shape))
    shape[axis] = simplify((shape[axis] if end == INT64_MAX else end) - start)
    return [(ins[0].dtype, tuple(shape))]


def _reduce_type(ins: list[In], attrs: dict) -> Types:
    shape = ins[0].shape
    axes = ins[1].ints if len(ins) > 1 and ins[1].ints is not None else list(range(len(shape)))
    axes = {_axis(a, len(shape)) for a in axes}
    keep = attrs.get("keepdims", 1)
    return [(ins[0].dtype, tuple(1 if k in axes else d for k, d in enumerate(shape) if keep or k not in axes))]


def _index_tuples(ins: list[In]) -> int:
    """The length of GatherND's and ScatterND's index tuples (the index's last dim), at most the
    data's rank; batch_dims is 0 (engine.testing writes none)."""
    data, index = ins[0].shape, ins[1].shape
    if ins[1].dtype is not DType.INT64 or not index or not isinstance(index[-1], int) or not 1 <= index[-1] <= len(data):
        raise ValueError(f"index tuples of {index} into {data}")
    return index[-1]


def _gather_nd_type(ins: list[In], attrs: dict) -> Types:
    k = _index_tuples(ins)
    return [(ins[0].dtype, (*ins[1].shape[:-1], *ins[0].shape[k:]))]


def _scatter_nd_type(ins: list[In], attrs: dict) -> Types:
    k = _index_tuples(ins)
    if tuple(ins[2].shape) != (*ins[1].shape[:-1], *ins[0].shape[k:]):
        raise ValueError(f"ScatterND updates of {ins[2].shape} at {ins[1].shape} into {ins[0].shape}")
    return [(ins[0].dtype, ins[0].shape)]


def _layer_norm_type(ins: list[In], attrs: dict) -> Types:
    return [(ins[0].dtype, ins[0].shape)]


@dataclass(frozen=True)
class OpDef:
    """An op engine.testing can build: its tensor inputs (`arity`: fewest, most), output types,
    gradient (None: no input has one), and the attributes it writes where a node leaves them out
    (ONNX's defaults, which patterns match against)."""

    name: str
    arity: tuple[int, int]
    infer: Callable[[list[In], dict], Types]
    vjp: Callable | None
    defaults: tuple[tuple[str, Any], ...] = ()


def _defs() -> dict[str, OpDef]:
    defs: list[OpDef] = []

    def add(name, arity, infer, vjp, **defaults):
        defs.append(OpDef(name, arity, infer, vjp, tuple(defaults.items())))

    unary = {"Gelu": (_gelu, {"approximate": "none"}), "Relu": (_relu, {}),
             "LeakyRelu": (_leaky_relu, {"alpha": 0.01}), "Elu": (_elu, {"alpha": 1.0}),
             "Selu": (_selu, {}), "Celu": (_celu, {"alpha": 1.0}), "Sigmoid": (_sigmoid, {}),
             "HardSigmoid": (_hard_sigmoid, {"alpha": 0.2, "beta": 0.5}), "HardSwish": (_hard_swish, {}),
             "Tanh": (_tanh, {}), "Softplus": (_softplus, {}), "Softsign": (_softsign, {}), "Mish": (_mish, {}),
             "Erf": (_erf, {}), "Exp": (_exp, {}), "Log": (_log, {}), "Neg": (_neg, {}), "Abs": (_abs, {}),
             "Sqrt": (_sqrt, {}), "Reciprocal": (_reciprocal, {}), "Identity": (_identity, {}),
             "Sign": (_none, {}), "Floor": (_none, {}), "Ceil": (_none, {}), "Round": (_none, {})}
    for name, (vjp, defaults) in unary.items():
        add(name, (1, 1), _same, vjp, **defaults)
    for name, vjp in (("Add", _add), ("Sub", _sub), ("Mul", _mul), ("Div", _div), ("Pow", _pow),
                      ("Max", _max_min("Max")), ("Min", _max_min("Min"))):
        add(name, (2, 2), _broadcasting, vjp)
    for name in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor"):
        add(name, (2, 2), _compare, None)
    add("Not", (1, 1), _same, None)
    add("Where", (3, 3), _where_type, _where)
    add("Clip", (3, 3), _same, _clip)
    add("Cast", (1, 1), _cast_type, _cast, saturate=1)
    add("CastLike", (2, 2), _cast_like_type, _cast, saturate=1)
    add("Softmax", (1, 1), _same, _softmax, axis=-1)
    add("LogSoftmax", (1, 1), _same, _log_softmax, axis=-1)
    add("LayerNormalization", (2, 3), _layer_norm_type, _layer_norm, axis=-1, epsilon=1e-5, stash_type=1)
    add("MatMul", (2, 2), _matmul_type, _matmul)
    add("Gemm", (2, 3), _gemm_type, _gemm, alpha=1.0, beta=1.0, transA=0, transB=0)
    add("Transpose", (1, 1), _transpose_type, _transpose)
    add("Reshape", (2, 2), _reshape_type, _reshape_back, allowzero=0)
    add("Flatten", (1, 1), _flatten_type, _reshape_back, axis=1)
    add("Unsqueeze", (2, 2), _unsqueeze_type, _reshape_back)
    add("Squeeze", (2, 2), _squeeze_type, _reshape_back)
    add("Expand", (2, 2), _expand_type, _expand)
    add("Shape", (1, 1), _shape_type, None)
    add("Size", (1, 1), _size_type, None)
    add("Split", (1, 2), _split_type, _split, axis=0)
    add("Concat", (2, 4), _concat_type, _concat)
    add("Slice", (4, 4), _slice_type, _slice)
    add("CumSum", (2, 2), _same, _cumsum, exclusive=0, reverse=0)
    add("GatherND", (2, 2), _gather_nd_type, _gather_nd, batch_dims=0)
    add("ScatterND", (3, 3), _scatter_nd_type, None, reduction="none")
    for name in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"):
        add(name, (1, 2), _reduce_type, _reduce(name), keepdims=1, noop_with_empty_axes=0)
    return {d.name: d for d in defs}


OPS: dict[str, OpDef] = _defs()


def infer(op: str, ins: list[In], attrs: dict) -> Types:
    """The output types of `op` on inputs of these types; ValueError when they do not fit."""
    if op not in OPS:
        raise ValueError(f"engine.testing has no type rule for {op}")
    return OPS[op].infer(ins, attrs)


def gradient(op: str) -> Callable | None:
    """The op's vector-Jacobian product `(emitter, call, *output_grads) -> input grads`."""
    return OPS[op].vjp if op in OPS else None


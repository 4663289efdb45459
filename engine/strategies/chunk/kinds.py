"""Chunk kinds: how each kind of op carries a sliced dim from its inputs to its output.

The rule files declare each op's kind (`chunkable pointwise Add, Mul`); `dim_map` knows what
each kind does with dims. Attributes are read by their ONNX names: importers spell every
backend's arguments that way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import sympy

from ...ir import Node, Value
from ...shapes import is_static, simplify

CHUNK_KINDS = {
    "pointwise": "broadcasting elementwise: each output dim is the same dim of every input",
    "matmul": "batch dims and rows from the first input, columns from the second; the "
              "contracted dim is summed (transA and transB, as Gemm and FusedMatMul write them, swap an "
              "input's last two dims; Gemm's third input is broadcast to the output)",
    "transpose": "output dim i is input dim perm[i]",
    "reshape": "a dim is kept where it has the same size after the same number of elements; a dim split "
               "or merged with the dims after it ((batch * seq) -> (batch, seq)) carries the slices in "
               "whole rows of its leading dim, so the slices become coarser",
    "sum": "a sum over axes: slicing a summed axis gives partial sums",
    "reduce": "a reduction (max, mean) over axes: a reduced axis cannot be sliced",
    "axis": "an op along one axis (softmax): every other dim can be sliced",
    "unsqueeze": "inserts a dim of size 1",
    "squeeze": "removes dims of size 1",
    "gather_elements": "output dims follow the index; the data's other dims follow too",
    "scatter_elements": "output dims follow the data; index and updates follow except the axis",
    "gather_nd": "rows of the data picked by index tuples (ONNX GatherND, batch_dims 0): the output's leading "
                 "dims follow the index's, its trailing dims the data's dims after those the tuples pick",
    "scatter_nd": "the updates added at index tuples into the data (ONNX ScatterND, batch_dims 0): the output "
                  "follows the data; slices of the index's leading dims (and the updates') are partial sums, "
                  "when the data is zeros and the reduction `add` (the gradient of GatherND)",
    "fill": "a new tensor from a shape: sliced by writing the chunk's size into the shape",
    "like": "a new tensor shaped like its input (ones_like): dims follow, values do not depend on it",
    "shape": "the shape of its input (ONNX Shape, Size): a slice's shape, computed per slice",
    "cast_like": "its first input, cast to the type of its second (ONNX CastLike), read for its type only",
    "expand": "broadcasts its input to a shape: sliced like pointwise, with the shape rewritten",
    "slice": "a slice of its input along `axes` (ONNX Slice, its starts, ends, axes and steps as "
             "attributes or constant inputs): the other dims are carried; a sliced dim is carried when the "
             "slice is one contiguous run of it (step 1, constant bounds), each slice of the chunk holding "
             "the rows of it that fall there (`logits[:-1]`: the last slice a row fewer)",
    "slice_scatter": "its second input written into a slice (`axes`, `starts`, `ends`) of its first "
                     "(ATen slice_scatter, the gradient of a slice): dims off the axes are carried, and a "
                     "sliced dim as for `slice`, the rows around the written ones coming from the first input",
    "pad": "pads its input (ONNX Pad, its pads as an attribute or a constant input): the dims it does "
           "not pad are carried; a padded dim too when the padding falls within the chunked rows (the "
           "gradient of `logits[:-1]`)",
    "nll_loss": "a loss over the class dim 1 of its input, picked by a target of the other dims (ONNX "
                "NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss): those dims are kept (reduction none) "
                "or summed; a mean runs as a sum in each slice, divided by the total weight of every "
                "slice's targets; a second output (SoftmaxCrossEntropyLoss's log_prob) has the input's dims",
    "random": "an elementwise op on its first input that draws a random value per element (Dropout): "
              "each output (its result, its mask) has the input's dims, each slice draws its own; a "
              "region's backward slices replay it from the random values its kept output holds (std.ops's "
              "`replay`), never draw again",
    "norm": "a normalization over the dims from `axis` on (LayerNormalization): the dims before it are "
            "carried, to its statistics outputs (mean, inverse deviation) too; the others cannot be sliced",
}

# Inputs an op of a kind reads only for their shape or type, not their values: nothing the
# region computes flows through them, and a slice read there needs no dim in the output.
TYPE_ONLY = {"like": {0}, "shape": {0}, "cast_like": {1}}
# Of those, the inputs read for their element type alone: a slice serves as well as the whole.
DTYPE_ONLY = {"cast_like": {1}}
# Inputs an op of a kind reads only where its index points (a gather's data): a slice of the
# index reads the rows it picks, never the whole input.
INDEXED = {"gather_elements": {0}, "gather_nd": {0}}

# The operands each kind reads by position: a node with fewer is refused, not indexed past.
MIN_INPUTS = {"matmul": 2, "cast_like": 2, "gather_elements": 2, "scatter_elements": 2, "fill": 0, "shape": 1,
              "nll_loss": 2, "norm": 1, "slice_scatter": 2, "gather_nd": 2, "scatter_nd": 3}



class Refused(Exception):
    """A region cannot be chunked; the message names the op and why."""

    def reason_fields(self) -> dict[str, Any]:
        """What the Reason for this refusal records beside its message (engine.matcher.Reason)."""
        return {}


class RefusedDynamic(Refused):
    """A region refused only because the chunked dim's size is symbolic (a graph compiled for
    every size) where its slices must be built at static sizes: the same region at fixed sizes
    would chunk (Reason.dynamic_sizes)."""

    def reason_fields(self) -> dict[str, Any]:
        return {"dynamic_sizes": True}


class RefusedUnproven(RefusedDynamic):
    """A region that needs two sizes equal which are equal at the example sizes but written
    with different symbols (a tracer that named two inputs' dims apart, or the sizes of two
    graph pieces anew): it chunks where the graph says they are equal (Reason.unproven_sizes)."""

    def __init__(self, message: str, sizes: tuple[Any, Any]):
        super().__init__(message)
        self.sizes = sizes

    def reason_fields(self) -> dict[str, Any]:
        return {**super().reason_fields(), "unproven_sizes": self.sizes}


class RefusedConstrained(Refused):
    """A region whose slices would be sized by dims with a declared range every guard must
    follow from (Graph.constrained_dims): the slices' guards break it (Reason.constrained_dims)."""

    def __init__(self, message: str, dims: tuple[str, ...]):
        super().__init__(message)
        self.dims = dims

    def reason_fields(self) -> dict[str, Any]:
        return {"constrained_dims": self.dims}


class RefusedReturned(Refused):
    """A region whose every large value the step returns (the logits of a graph whose loss is
    computed by its caller): `values` names them (Reason.returned_values)."""

    def __init__(self, message: str, values: tuple[str, ...]):
        super().__init__(message)
        self.values = values

    def reason_fields(self) -> dict[str, Any]:
        return {"returned_values": self.values}


@dataclass
class DimMap:
    """How one node's output dims relate to its inputs' dims."""

    maps: list[dict[int, int]]                  # per input position: output dim -> input dim
    summed: list[list[tuple[int, int]]] = field(default_factory=list)   # (input, dim) summed together
    blocked: set[tuple[int, int]] = field(default_factory=set)          # (input, dim) never sliced
    mean: bool = False      # the summed dims are averaged: a slice sums, the builder divides once
    # outputs after the first, each as output dim -> dim of input 0 (its statistics, its log_prob)
    extra_outputs: list[dict[int, int]] = field(default_factory=list)
    # (input, dim) -> (output dim, factor): a reshape's leading dim of a split or merged group,
    # whose output size is `factor` times the input's ((tokens) -> (batch, seq): 1 / seq)
    regrouped: dict[tuple[int, int], tuple[int, Fraction]] = field(default_factory=dict)
    # (input, dim) -> (output dim, lead, tail): the output's rows along that dim are the input's
    # from row `lead` to `tail` rows before its end (a slice `x[1:]`: 1, 0); negative for rows
    # the op adds (a pad; a slice_scatter's output around the slice it writes)
    shifted: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    # the input whose values a partial sum adds to (a scatter-add's data): the slices' sums are the
    # whole's only where it is zeros, each slice adding its part into zeros
    zero_base: int | None = None


def _int_list(x: Any) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, int):
        return [x]
    try:
        return [int(d) for d in x]
    except (TypeError, ValueError):
        return None


def attr_text(attr: Any) -> str:
    """A string attribute as text (ONNX stores them as bytes)."""
    return attr.decode() if isinstance(attr, bytes) else str(attr)


def _param(node: Node, name: str) -> Any:
    """An attribute by its ONNX name (importers spell every backend's arguments that way)."""
    return node.attrs.get(name)


def operand(node: Node, position: int | None) -> Value | None:
    """The node's input at `position` of its op's signature, None where it is absent. ONNX keeps
    the place of an optional input left out (`Slice(x, starts, ends, "", steps)`, `Pad(x, pads,
    "", axes)`), so parameters are read from the node's own inputs, never from its present ones,
    where a later input would take an absent one's place (a Slice's steps read as its axes)."""
    if position is None or len(node.inputs) <= position:
        return None
    return node.inputs[position]


def int_param(node: Node, name: str, position: int | None = None) -> list[int] | None:
    """An int-list parameter by its ONNX name: the attribute, or, in the opsets that made it an
    input, the constant input at `position`; None where neither is known. The grower and the
    ONNX chunk builder both read slice and pad bounds so."""
    got = _int_list(_param(node, name))
    given = operand(node, position)
    if got is None and given is not None:
        got = given.ints
    return got


def _axes(node: Node) -> list[int] | None:
    """The `axes` attribute, or, from ONNX opset 13, the constant second input."""
    axes = int_param(node, "axes", 1)
    if axes is None and operand(node, 1) is not None:
        raise Refused(f"{node.op} {node.name}: its axes are computed, not constant")
    return axes


# ONNX Slice's inputs from opset 10 (data, starts, ends, axes, steps): where its parameters are
# when they are not attributes.
_SLICE_INPUTS = {"starts": 1, "ends": 2, "axes": 3, "steps": 4}


def _slice_axes(node: Node, rank: int, onnx_inputs: bool) -> set[int]:
    """The axes a slice works along: the `axes` attribute, or with `onnx_inputs` (ONNX Slice)
    its constant input (absent: the first len(starts) dims)."""
    at = _SLICE_INPUTS if onnx_inputs else {}
    axes = int_param(node, "axes", at.get("axes"))
    if axes is None and onnx_inputs:
        if operand(node, at["axes"]) is not None:
            raise Refused(f"{node.op} {node.name}: its axes are computed, not constant")
        starts = int_param(node, "starts", at["starts"])
        if starts is None:
            raise Refused(f"{node.op} {node.name}: its starts are computed, not constant")
        axes = list(range(len(starts)))
    if axes is None:
        raise Refused(f"{node.op} {node.name} names no axes")
    return {norm_dim(a, rank) for a in axes}


def slice_range(start: int, end: int, size: int) -> tuple[int, int]:
    """The rows [start, end) a step-1 slice takes of `size`, its bounds as Python and ONNX read
    them: negative from the end, clamped to the size, an end before the start an empty slice."""
    start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
    return start, max(end, start)


_TO_THE_END = 2**62     # an end past any size: INT64_MAX as exporters write `x[a:]`


def _slice_bounds(node: Node, rank: int, size: Any, onnx_inputs: bool) -> dict[int, tuple[int, int]]:
    """Axis -> (rows dropped at its start, rows dropped at its end) for the axes a slice
    takes a contiguous run of (step 1, constant bounds, a static size `size(axis)`, or any size
    for a slice to the end): its
    `starts`, `ends`, `axes` and `steps` as attributes or, with `onnx_inputs` (ONNX Slice),
    constant inputs."""
    at = _SLICE_INPUTS if onnx_inputs else {}
    starts, ends, steps, listed = (int_param(node, name, at.get(name))
                                   for name in ("starts", "ends", "steps", "axes"))
    if starts is None or ends is None or len(starts) != len(ends):
        return {}
    listed = list(range(len(starts))) if listed is None else listed
    found = {}
    for k, axis in enumerate(listed):
        axis = norm_dim(axis, rank)
        n = size(axis)
        if k >= len(starts) or (steps is not None and steps[k] != 1):
            continue
        if not isinstance(n, int):
            # At a symbolic size a slice's rows are known where its bounds count from the start
            # and from the end: `x[:, :-1]` slices dim 0 whole (0 to INT64_MAX, which Dynamo keeps
            # at dynamic sizes) and drops the last row of dim 1 (an end of -1).
            if isinstance(starts[k], int) and isinstance(ends[k], int) and 0 <= starts[k]:
                if ends[k] >= _TO_THE_END:
                    found[axis] = (starts[k], 0)
                elif ends[k] < 0:
                    found[axis] = (starts[k], -ends[k])
            continue
        start, end = slice_range(starts[k], ends[k], n)
        found[axis] = (start, n - end)
    return found


def rank_of(v: Value) -> int:
    if v.shape is None:
        raise Refused(f"%{v.name} has no known shape")
    return len(v.shape)


def norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def same_size(a: Any, b: Any) -> bool:
    """Equal sizes: numbers, or formulas equal for every size (`s1*(s0 - 1)` and `s0*s1 - s1`)."""
    try:
        if isinstance(a, sympy.Expr) or isinstance(b, sympy.Expr):
            return simplify(sympy.sympify(a) - b) == 0
        return bool(a == b)
    except (TypeError, sympy.SympifyError):
        return False


def _shape(v: Value) -> tuple:
    rank_of(v)
    return v.shape


def _prefix_products(shape: tuple) -> list:
    """The number of elements before each dim of `shape`, then the total."""
    prefix = [1]
    for d in shape:
        prefix.append(prefix[-1] * d)
    return prefix


def reshape_map(src: tuple, out: tuple) -> dict[int, int]:
    """Output dim -> input dim, for the dims a reshape keeps: same size, same number of
    elements before them."""
    mapping = {}
    prefix_in, prefix_out = _prefix_products(src), _prefix_products(out)
    for i, d in enumerate(src):
        for o, d_out in enumerate(out):
            if same_size(prefix_out[o], prefix_in[i]) and same_size(d_out, d):
                mapping[o] = i
                break
    return mapping


def regrouped_dims(src: tuple, out: tuple) -> dict[int, tuple[int, Any]]:
    """Input dim -> (output dim, output size / input size) for the dims a reshape splits or
    merges as the leading dim of a group: the same number of elements before them, and the
    group's sizes multiply to the same number ((8192,) -> (16, 512): dim 0 -> dim 0, 1/512;
    (16, 511) -> (8176,): dim 0 -> dim 0, 511). The factor is a Fraction at static sizes and a
    formula at symbolic ones ((4*s0, V) -> (4, s0, V): 1/s0), whose sizes are compared as
    formulas."""
    static = all(isinstance(d, int) for d in (*src, *out))
    prefix_in, prefix_out = _prefix_products(src), _prefix_products(out)
    found = {}
    for i, d in enumerate(src):
        if isinstance(d, int) and d <= 1:
            continue
        for o, d_out in enumerate(out):
            if same_size(prefix_out[o], prefix_in[i]) and not (isinstance(d_out, int) and d_out <= 1) \
                    and not same_size(d_out, d):
                # dim i splits into dims o.. (its end is an end of an output dim), or dims i..
                # merge into dim o (its end is an end of an input dim)
                if any(same_size(prefix_in[i + 1], p) for p in prefix_out[o + 1:]) or \
                        any(same_size(prefix_out[o + 1], p) for p in prefix_in[i + 1:]):
                    found[i] = (o, Fraction(d_out, d) if static else sympy.cancel(sympy.sympify(d_out) / d))
                break
    return found


def grouped_dim(src: tuple, out: tuple, dim: int, per: Any) -> tuple[int, Any] | None:
    """Where a reshape from `src` to `out` puts dim `dim` of `src`, whose index is
    `g * per + r` for `r` a row of the chunked value (groups of `per` rows, Rows.outer): the
    dim of `out` after which as many elements follow (the same stride), if its size is whole
    groups of `per` rows, with its number of groups ((tokens, vocab) -> (batch, seq, vocab)
    with the sequence chunked, per = seq: dim 0 of the tokens -> dim 1, 1 group; the way back,
    dim 1 -> dim 0, `batch` groups). At dynamic sizes `per` and the dims may be formulas
    (`2*s0` tokens, `s0` a sequence), and so may the number of groups (`b*s0` tokens, `b`
    sequences of `s0`): a formula where it is whole at every size. None where no such dim is."""
    if not 0 <= dim < len(src) or (is_static(per) and per < 1):
        return None
    try:
        if not same_size(math.prod(src), math.prod(out)):
            return None
        after = simplify(sympy.sympify(math.prod(src[dim + 1:])))
        for o in range(len(out)):
            if same_size(math.prod(out[o + 1:]), after):
                groups = sympy.sympify(simplify(sympy.cancel(sympy.sympify(out[o]) / per)))
                if groups.is_Integer:
                    return (o, int(groups)) if groups >= 1 else None
                whole = simplify(sympy.fraction(groups)[1]) == 1 and not groups.is_number
                return (o, groups) if whole else None
    except (TypeError, sympy.SympifyError):
        return None
    return None


def _broadcast(v: Value, out: Value, dims: int) -> dict[int, int]:
    """Output dim -> dim of `v` for the first `dims` output dims, numpy-aligned from the right,
    where `v` has the output's size (a broadcast dim of size 1 is not carried)."""
    shift = rank_of(out) - rank_of(v)
    return {o: o - shift for o in range(dims) if o - shift >= 0 and same_size(v.shape[o - shift], out.shape[o])}


def dim_map(node: Node, kind: str, inputs: list[Value] | None = None) -> DimMap:
    """The DimMap of `node` under its declared kind; Refused when its parameters are unknown.
    `inputs` stands for the node's inputs where the grower reads through skipped reshapes.
    Inputs a kind does not map (a shape, the axes of an ONNX reduction) carry no dim."""
    inputs = list(node.present_inputs()) if inputs is None else inputs
    if not node.outputs:
        raise Refused(f"{node.op} {node.name} has no output")
    need = MIN_INPUTS.get(kind, 1)
    if len(inputs) < need:
        raise Refused(f"{node.op} {node.name} has {len(inputs)} operand(s); a `{kind}` op reads {need}")
    try:
        dm = _kind_map(node, kind, inputs)
    except (TypeError, ValueError) as exc:     # an attribute that is not what its kind reads
        raise Refused(f"{node.op} {node.name}: an attribute `{kind}` reads is malformed ({exc})") from None
    dm.maps += [{} for _ in inputs[len(dm.maps):]]
    return dm


def _kind_map(node: Node, kind: str, inputs: list[Value]) -> DimMap:
    out = node.outputs[0]
    if kind in ("fill", "shape"):       # a shape's output may be a size, of no shape (a SymInt)
        return DimMap([{} for _ in inputs])
    rank = rank_of(out)
    if kind in ("pointwise", "expand", "like", "cast_like"):
        return DimMap([_broadcast(v, out, rank) for v in (inputs if kind == "pointwise" else inputs[:1])])
    if kind == "matmul":
        a, b = inputs[0], inputs[1]
        ra, rb = rank_of(a), rank_of(b)
        if ra < 2 or rb < 2:
            raise Refused(f"{node.op} {node.name}: a 1-D operand")
        if _param(node, "transBatchA") or _param(node, "transBatchB"):
            raise Refused(f"{node.op} {node.name}: it transposes batch dims (transBatchA, transBatchB)")
        ta, tb = bool(_param(node, "transA")), bool(_param(node, "transB"))
        ma, mb = _broadcast(a, out, rank - 2), _broadcast(b, out, rank - 2)
        rows, k_a = (ra - 1, ra - 2) if ta else (ra - 2, ra - 1)
        cols, k_b = (rb - 2, rb - 1) if tb else (rb - 1, rb - 2)
        ma[rank - 2] = rows
        mb[rank - 1] = cols
        contracted = [(0, k_a), (1, k_b)]
        if len(inputs) > 2:     # Gemm's C, broadcast to the output: added once, so never a partial sum
            return DimMap([ma, mb, _broadcast(inputs[2], out, rank)], blocked=set(contracted))
        return DimMap([ma, mb], summed=[contracted])
    if kind == "random":        # the ratio and mode operands are scalars: they carry no dim
        same = _broadcast(inputs[0], out, rank)
        return DimMap([same], extra_outputs=[dict(same) for _ in node.outputs[1:]])
    if kind == "norm":
        r = rank_of(inputs[0])
        axis = norm_dim(int(_param(node, "axis") if _param(node, "axis") is not None else -1), r)
        kept = {o: o for o in range(axis)}
        return DimMap([dict(kept)], blocked={(0, d) for d in range(axis, r)},
                      extra_outputs=[dict(kept) for _ in node.outputs[1:]])
    if kind == "transpose":
        perm = _int_list(_param(node, "perm"))
        if perm is None:
            if rank != 2:
                raise Refused(f"{node.op} {node.name}: no permutation")
            perm = [1, 0]
        return DimMap([{o: norm_dim(p, rank) for o, p in enumerate(perm)}])
    if kind == "reshape":
        src = _shape(inputs[0])
        return DimMap([reshape_map(src, out.shape)],
                      regrouped={(0, i): g for i, g in regrouped_dims(src, out.shape).items()})
    if kind == "slice":
        axes = _slice_axes(node, rank, onnx_inputs=True)
        bounds = _slice_bounds(node, rank, lambda a: inputs[0].shape[a], onnx_inputs=True)
        return DimMap([{o: o for o in range(rank) if o not in axes}], blocked={(0, a) for a in axes},
                      shifted={(0, a): (a, lead, tail) for a, (lead, tail) in bounds.items()})
    if kind == "pad":
        pads = int_param(node, "pads", 1)
        axes = int_param(node, "axes", 3) if operand(node, 3) is not None else list(range(rank))
        if pads is None or axes is None:
            raise Refused(f"{node.op} {node.name}: its pads are computed, not constant")
        axes = [norm_dim(a, rank) for a in axes]
        padded = {a: (pads[k], pads[k + len(axes)]) for k, a in enumerate(axes) if pads[k] or pads[k + len(axes)]}
        return DimMap([{o: o for o in range(rank) if o not in padded}], blocked={(0, a) for a in padded},
                      shifted={(0, a): (a, -before, -after) for a, (before, after) in padded.items()})
    if kind == "slice_scatter":
        axes = _slice_axes(node, rank, onnx_inputs=False)
        kept = {o: o for o in range(rank) if o not in axes}
        bounds = _slice_bounds(node, rank, lambda a: out.shape[a], onnx_inputs=False)
        # the output has the rows of the value written into (input 0); the slice written is
        # the rows between `lead` and `tail` of it
        return DimMap([{**kept, **{a: a for a in bounds}}, dict(kept)],
                      blocked={(1, a) for a in axes} | {(0, a) for a in axes if a not in bounds},
                      shifted={(1, a): (a, -lead, -tail) for a, (lead, tail) in bounds.items()})
    if kind in ("sum", "reduce", "axis"):
        src = inputs[0]
        r = rank_of(src)
        if kind == "axis":
            axis = _param(node, "axis")
            axes = [norm_dim(-1 if axis is None else int(axis), r)]
            keep = True
        else:
            axes = _axes(node)
            axes = list(range(r)) if not axes else [norm_dim(a, r) for a in axes]
            keepdims = _param(node, "keepdims")
            keep = rank == r if keepdims is None else bool(keepdims)
        kept = [i for i in range(r) if keep or i not in axes]
        mapping = {o: i for o, i in enumerate(kept) if keep is False or i not in axes}
        if kind == "sum":
            return DimMap([mapping], summed=[[(0, a)] for a in axes])
        return DimMap([mapping], blocked={(0, a) for a in axes})
    if kind == "unsqueeze":
        axes = [norm_dim(a, rank) for a in _axes(node) or []]
        kept = [o for o in range(rank) if o not in axes]
        return DimMap([{o: i for i, o in enumerate(kept)}])
    if kind == "squeeze":
        src = inputs[0]
        r = rank_of(src)
        axes = _axes(node)
        axes = [i for i in range(r) if same_size(src.shape[i], 1)] if axes is None else [norm_dim(a, r) for a in axes]
        kept = [i for i in range(r) if i not in axes]
        return DimMap([{o: i for o, i in enumerate(kept)}])
    if kind in ("gather_elements", "scatter_elements"):
        axis = norm_dim(int(_param(node, "axis") or 0), rank)
        every = {o: o for o in range(rank)}
        others = {o: o for o in range(rank) if o != axis}
        if kind == "gather_elements":       # (data, index)
            return DimMap([others, every], blocked={(0, axis)})
        return DimMap([every] + [others for _ in inputs[1:]], blocked={(i, axis) for i in range(1, len(inputs))})
    if kind in ("gather_nd", "scatter_nd"):
        return _nd_map(node, kind, inputs)
    if kind == "nll_loss":
        return _nll_loss_map(node, inputs)
    raise Refused(f"unknown chunk kind {kind!r}")


def _nd_map(node: Node, kind: str, inputs: list[Value]) -> DimMap:
    """GatherND (data, indices) and ScatterND (data, indices, updates): the indices' last dim, of
    static size k, holds tuples into the data's first k dims; the indices' other dims index the
    tuples, and the data's dims after the first k ride along."""
    if int(_param(node, "batch_dims") or 0):
        raise Refused(f"{node.op} {node.name}: batch_dims is not 0")
    data, indices = inputs[0], inputs[1]
    r, q = rank_of(data), rank_of(indices)
    k = indices.shape[-1] if q else None
    if q < 1 or not isinstance(k, int) or not 1 <= k <= r:
        raise Refused(f"{node.op} {node.name}: its index tuples' length {k} is not a static size at most the "
                      f"data's rank {r}")
    lead = q - 1        # the index dims that count tuples
    blocked = {(0, d) for d in range(k)} | {(1, lead)}
    if kind == "gather_nd":
        return DimMap([{lead + j: k + j for j in range(r - k)}, {j: j for j in range(lead)}], blocked=blocked)
    reduction = attr_text(_param(node, "reduction") or "none")
    every = {d: d for d in range(r)}
    updates = {d: lead + d - k for d in range(k, r)}
    tuples = [[(1, j), (2, j)] for j in range(lead)]
    if reduction != "add":      # written, not added: slices would not sum to the whole
        return DimMap([every, {}, updates], blocked=blocked | {t for group in tuples for t in group})
    return DimMap([every, {}, updates], summed=tuples, blocked=blocked, zero_base=0)


def _nll_loss_map(node: Node, inputs: list[Value]) -> DimMap:
    """(input (N, C, d...), target (N, d...), weight (C)?): the target's dims are the input's
    without the class dim 1, which is never sliced."""
    r = rank_of(inputs[0])
    if r < 2 or rank_of(inputs[1]) != r - 1:
        raise Refused(f"{node.op} {node.name}: an input of rank {r} with a target of rank "
                      f"{rank_of(inputs[1])}, not one less")
    reduction = attr_text(_param(node, "reduction") or "mean")
    target_dims = {0: 0, **{d: d - 1 for d in range(2, r)}}     # input dim -> target dim
    blocked = {(0, 1)}
    # SoftmaxCrossEntropyLoss's log_prob has the input's dims (not a total weight, a scalar)
    log_prob = [{d: d for d in range(r)} for o in node.outputs[1:2]
                if o is not None and o.shape is not None and len(o.shape) == r]
    if reduction == "none":
        return DimMap([{t: d for d, t in target_dims.items()}, {t: t for t in target_dims.values()}],
                      blocked=blocked, extra_outputs=log_prob)
    if reduction not in ("sum", "mean"):
        raise Refused(f"{node.op} {node.name}: unknown reduction {reduction!r}")
    return DimMap([{}, {}], summed=[[(0, d), (1, t)] for d, t in target_dims.items()], blocked=blocked,
                  mean=reduction == "mean", extra_outputs=log_prob)



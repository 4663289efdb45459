"""Chunk regions on an ONNX training graph: one `Loop` per phase, one iteration per slice.

The engine decides the region and each value's ChunkMeta (engine.strategies.chunk); this
module builds it in the IR, which the exporter writes as ONNX. Each phase becomes a `Loop`
whose body is the phase's nodes on one slice: the body slices the inputs it reads with
`Slice` at `iteration * size`, partial sums (the loss, the weight gradient) are loop-carried
and added in the body, and sliced outputs are scan outputs, which the Loop stacks and a
Reshape (after a Transpose when the dim is not the first) turns back into the concatenation.
Slices of another size (the remainder) get a Loop of their own, so every shape stays static.

Why a Loop and not the unrolled sequence of slices: ONNX Runtime does not run nodes in file
order (see ort_schedule): it walks depth-first from the graph's leaves. An unrolled region has
one leaf per output, so the walk from the loss runs every slice's forward before the walk from
the weight gradient runs any slice's backward, and every slice's log-softmax is alive at once.
A Loop is one node to that walk; its body runs the slices one after another, and ONNX Runtime
frees each iteration's values before the next. Measured on the GPT-like step of docs/design.md
(vocab 32768, batch 4; only the loss chunked, 16 slices; bench/chunk.py): 1333 MiB above rest
unchunked, 887 MiB unrolled, 411 MiB as a Loop; step time 1.05x and 1.09x the original's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import sympy
from onnx import numpy_helper

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Node, Value
from engine.order import order_near, producers
from engine.shapes import Dim, simplify
from engine.strategies.chunk import ChunkMeta, ChunkPhase, ChunkRegion, grouped, shifted_edges
from engine.strategies.chunk.kinds import int_param
from engine.strategies.replay import instantiate

from .formulas import DimEmitter

# Where an op's target shape sits among its inputs: rewritten to the slice's size when the op
# makes a sliced value from a constant shape.
_SHAPE_INPUT = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0}


def _moves_nothing(node: Node) -> bool:
    """A Transpose to the same order or an Expand or Reshape to its input's own shape: the
    exporters write them (transformers' `index_put` of an expert weight's gradient), and ONNX
    Runtime drops them from the main graph, where it knows both shapes; in a Loop body, which
    reads the target shape from the slice, it copies the slice instead."""
    if not node.inputs or node.inputs[0] is None or len(node.outputs) != 1:
        return False
    src, out = node.inputs[0].shape, node.outputs[0].shape
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    return (node.op in ("Expand", "Reshape") and src is not None and out is not None and len(src) == len(out)
            and all(isinstance(a, int) and a == b for a, b in zip(src, out)))


def _constant(names: Callable[[str], str], base: str, array: np.ndarray) -> Value:
    name = names(base)
    v = Value(name, _IR_DTYPES[array.dtype.type], tuple(array.shape), is_initializer=True,
              data=numpy_helper.from_array(array, name))
    if array.dtype.kind == "i" and array.size <= 16:
        v.ints = [int(x) for x in array.reshape(-1)]
    return v


_IR_DTYPES = {np.int64: DType.INT64, np.float32: DType.FLOAT32, np.float64: DType.FLOAT64,
              np.float16: DType.FLOAT16, np.bool_: DType.BOOL, np.int32: DType.INT32}


def _numpy_dtype(dtype: DType) -> type:
    for np_type, ir in _IR_DTYPES.items():
        if ir is dtype:
            return np_type
    raise GraphError(f"a partial sum of type {dtype} cannot start from zero here")


def _sum_dtype(output: Value) -> DType:
    """The type a region output's partial sums accumulate in (DType.accumulates_in)."""
    return output.dtype.accumulates_in


def _rank(v: Value) -> int:
    if v.shape is None:
        raise GraphError(f"%{v.name} has no known rank; the ONNX backend slices values of known rank only")
    return len(v.shape)


@dataclass
class _Run:
    """`count` slices of `size` rows from `offset`: numbers, or, in a region over a dynamic size,
    values computed in the graph (`count` a scalar), with their formulas for the IR's shapes."""

    size: int | Value
    count: int | Value
    offset: int | Value
    size_dim: Dim
    count_dim: Dim
    total: int | None = None    # the chunked value's rows, in a static region
    last: bool = False          # in a dynamic region: the run of what is left, which holds the last rows

    @property
    def static(self) -> bool:
        return isinstance(self.size, int) and isinstance(self.count, int)

    def rows(self, meta: ChunkMeta) -> Dim:
        """A value's rows in each slice of the run (its first slice's: a run is slices of one
        class, ChunkRegion.slice_class, so all have the same)."""
        if meta.rows.shifted:
            if self.total is None:      # dynamic: rows from the start, the last run a tail short
                return simplify(self.size_dim - meta.rows.tail) if self.last else self.size_dim
            return meta.length(self.offset, self.offset + self.size, self.total)
        return meta.rows.scale(self.size_dim)

    def edges(self, outer: ChunkMeta, inner: ChunkMeta) -> tuple[int, int] | None:
        """The rows of `outer` before and after those of `inner` in the run's slices (engine
        shifted_edges)."""
        if self.total is None:
            return shifted_edges(outer.rows, inner.rows, None, None, None, self.last)
        return shifted_edges(outer.rows, inner.rows, self.offset, self.offset + self.size, self.total)


def _runs(g: "_Graph", region: ChunkRegion, graph: Graph) -> list[_Run]:
    """The region's slices as runs of one size. A dynamic region: slices of `region.slice_size`
    computed from the graph's shapes (at least one), then one more of what is left, which may be
    empty (every shape stays the same from slice to slice, as a Loop's scan outputs must). A
    value that ends `tail` rows short of the chunked value's (the label shift of one sequence,
    `logits[:-1]`) has every row of the full slices where what is left holds at least `tail`
    rows: they are counted in the rows that are not full slices."""
    if region.extent is None:
        return [_Run(size, count, offset, size, count, sum(region.chunks)) for size, count, offset in _groups(region)]
    dims = DimEmitter(graph, g.add, g.const)
    extent, size_dim = region.extent, region.slice_size
    tail = region.edges[1]
    n, size = dims.emit(extent), dims.emit(size_dim)
    full = g.add("Sub", [n, g.const("tail_rows", np.array([tail], np.int64))], "rows_before_tail",
                 DType.INT64, (1,)) if tail else n
    count = g.add("Div", [full, size], "slice_count", DType.INT64, (1,))
    done = g.add("Mul", [count, size], "sliced_rows", DType.INT64, (1,))
    rest = g.add("Sub", [n, done], "rest_rows", DType.INT64, (1,))
    count_dim = sympy.floor((extent - tail) / size_dim)
    left = simplify(extent - count_dim * size_dim)
    runs = [_Run(size, dims.scalar(count, "trip_count"), 0, size_dim, count_dim)]
    if left != 0:       # nothing is left where the slices are whole groups a static count divides
        runs.append(_Run(rest, 1, done, left, 1, last=True))
    return runs


def _sliced_shape(v: Value, meta: ChunkMeta, run: _Run, slices: Dim = 1) -> tuple | None:
    """`v`'s shape in a slice of `run` (`slices` of them side by side)."""
    if v.shape is None or meta.dim is None:
        return v.shape
    shape = list(v.shape)
    shape[meta.dim] = simplify(slices * run.rows(meta)) if slices != 1 else run.rows(meta)
    return tuple(shape)


class _Graph:
    """A graph under construction: nodes appended in order, with fresh names."""

    def __init__(self, names: Callable[[str], str]):
        self.names = names
        self.nodes: list[Node] = []
        self.initializers: list[Value] = []

    def const(self, base: str, array) -> Value:
        v = _constant(self.names, base, np.asarray(array))
        self.initializers.append(v)
        return v

    def add(self, op: str, inputs: list[Value | None], base: str, dtype: DType, shape: tuple | None,
            attrs: dict | None = None) -> Value:
        out = Value(self.names(base), dtype, shape)
        self.nodes.append(Node(op, inputs, [out], dict(attrs or {}), self.names(f"{base}_node"),
                               meta={"attr_defaults": {}}))
        return out


def _detach_type_reads(graph: Graph, region: ChunkRegion, names: Callable[[str], str]) -> None:
    """The region reads values computed, through a shape or a type only, from its own outputs
    (the gradient seed `ones_like(loss)` is built from the loss's shape and type). Written
    with the shape and type as constants, they no longer wait for the region. Only such cycles,
    phase by phase: a two-phase region's backward inputs wait for everything after its forward
    phase, and rewriting every type read there would replace nodes other regions hold."""
    region_ids = {id(n) for n in region.nodes}
    cycles: set[int] = set()        # nodes a phase's inputs wait for that read its outputs' type
    for phase in region.phases:
        after = _downstream(graph, {id(o) for o in phase.outputs})
        before: set[int] = set()
        stack = list(phase.inputs)
        while stack:
            v = stack.pop()
            p = v.producer
            if p is None or id(p) in region_ids or id(p) in before:
                continue
            before.add(id(p))
            stack.extend(p.present_inputs())
        cycles.update(id(n) for n in graph.nodes if id(n) in before and (
            (n.op == "Shape" and id(n.inputs[0]) in after) or (n.op == "CastLike" and id(n.inputs[1]) in after)))
    g = _Graph(names)
    dims = DimEmitter(graph, g.add, g.const)
    nodes = []
    for node in graph.nodes:
        if id(node) not in cycles:
            nodes.append(node)
        elif node.op == "Shape":
            c = _shape_without_reading(node, g, dims)
            nodes.extend(g.nodes)
            g.nodes = []
            for user in node.outputs[0].users:
                user.replace_input(node.outputs[0], c)
            graph.outputs = [c if v is node.outputs[0] else v for v in graph.outputs]
        else:
            nodes.append(Node("Cast", [node.inputs[0]], node.outputs, {"to": node.inputs[1].dtype}, node.name))
    graph.nodes = nodes
    graph.initializers.extend(g.initializers)
    graph.link()


def _shape_without_reading(node: Node, g: "_Graph", dims: DimEmitter) -> Value:
    """What `Shape` node reads of its input, without reading it: a constant, or, over dynamic
    dims (a per-token loss of batch * seq rows), the sizes computed from the graph inputs' shapes."""
    v = node.inputs[0]
    if v.shape is None:
        raise GraphError(f"%{v.name} has no known shape; the ONNX backend cannot compute its size "
                         f"without waiting for the region that computes it")
    start, end = node.attrs.get("start", 0), node.attrs.get("end")
    part = list(v.shape)[start:end]
    name = node.outputs[0].name
    if len(part) == 1 and not isinstance(part[0], int):
        return dims.emit(part[0])
    return _shape_value(g, dims, part, f"{name}_dims", target=False)


def _shape_value(g: "_Graph", dims: DimEmitter, shape, base: str, target: bool = True,
                 infer: int | None = None) -> Value:
    """`shape` as an int64 tensor: a constant at static sizes; a Reshape's `target` with one
    dynamic dim, a constant with -1 there (no other dim is 0); else computed before the Loops
    from the graph inputs' dims (DimEmitter). `infer`: the dim of a target that may be 0 (a
    slice's rows, none in the last run of a label shift at some lengths), written -1 for the
    Reshape to infer, beside dims that are never 0: a computed 0 in a target would copy the
    input's dim (allowzero, which the opsets before 14 lack, is not set)."""
    shape = list(shape)
    dynamic = [k for k, d in enumerate(shape) if not isinstance(d, int)]
    if not target or infer not in dynamic:
        infer = dynamic[0] if target and len(dynamic) == 1 and all(d != 0 for d in shape) else None
    if all(k == infer for k in dynamic):
        return g.const(base, np.array([-1 if k == infer else d for k, d in enumerate(shape)], np.int64))
    parts = [g.const("inferred_dim", np.array([-1], np.int64)) if k == infer else dims.emit(d)
             for k, d in enumerate(shape)]
    return g.add("Concat", parts, base, DType.INT64, (len(shape),), {"axis": 0})


def _downstream(graph: Graph, seeds: set[int]) -> set[int]:
    out = set(seeds)
    for n in graph.nodes:
        if any(id(v) in out for v in n.reads()):
            out.update(id(o) for o in n.outputs)
    return out


def _total_weight(g: _Graph, node: Node, region: ChunkRegion) -> Value:
    """The total weight a NegativeLogLikelihoodLoss mean divides by, over its whole target:
    the summed class weight of the labels not ignored (their count without a weight)."""
    target, weight = node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None
    if any(target.producer is n for n in region.nodes):
        raise GraphError(f"{node.op} {node.name}: its target %{target.name} is computed slice by slice")
    dtype = node.outputs[0].dtype
    ignore = node.attrs.get("ignore_index")
    kept = None
    if ignore is not None:
        equal = g.add("Equal", [target, g.const("ignore_index", np.array(int(ignore), np.int64))],
                      f"{node.name}_ignored", DType.BOOL, target.shape)
        kept = g.add("Not", [equal], f"{node.name}_kept", DType.BOOL, target.shape)
    if weight is None:
        if kept is None:
            count = g.add("Size", [target], f"{node.name}_count", DType.INT64, ())
            return g.add("Cast", [count], f"{node.name}_total_weight", dtype, (), {"to": dtype})
        weights = g.add("Cast", [kept], f"{node.name}_weights", dtype, target.shape, {"to": dtype})
    else:
        label = target if kept is None else g.add(
            "Where", [kept, target, g.const("label_zero", np.array(0, np.int64))], f"{node.name}_label",
            target.dtype, target.shape)
        weights = g.add("Gather", [weight, label], f"{node.name}_weights", dtype, target.shape)
        if kept is not None:
            weights = g.add("Mul", [weights, g.add("Cast", [kept], f"{node.name}_kept_weight", dtype,
                                                   target.shape, {"to": dtype})],
                            f"{node.name}_kept_weights", dtype, target.shape)
    return g.add("ReduceSum", [weights], f"{node.name}_total_weight", dtype, (), {"keepdims": 0})


def _body(phase: ChunkPhase, region: ChunkRegion, names: Callable[[str], str], run: _Run,
          sums: list[Value], scans: list[Value], divisors: dict[int, Value], dims: DimEmitter) -> Graph:
    """The Loop body for the slices of `run`: (iteration, cond, partial sums) in, (cond, partial
    sums, sliced outputs) out. A mean in `divisors` (region.means) runs as a sum, divided by its
    total weight over every slice. `dims` computes sizes before the Loop (the body reads them)."""
    g = _Graph(names)
    iteration = Value(names("iteration"), DType.INT64, ())
    cond = Value(names("cond"), DType.BOOL, ())
    # A partial sum of a dynamic shape starts as a scalar zero and takes its shape from the first slice.
    carried = [Value(names(f"{o.name}_sum_in"), _sum_dtype(o), o.shape if o.has_static_shape else None) for o in sums]
    size = run.size if isinstance(run.size, Value) else g.const("slice_size", np.array([run.size], np.int64))
    offset = run.offset if isinstance(run.offset, Value) else g.const("first_offset",
                                                                      np.array([run.offset], np.int64))
    index = g.add("Reshape", [iteration, g.const("one_dim", np.array([1], np.int64))], "slice_index",
                  DType.INT64, (1,))
    start = g.add("Add", [g.add("Mul", [index, size], "slice_offset", DType.INT64, (1,)), offset],
                  "slice_start", DType.INT64, (1,))
    end = g.add("Add", [start, size], "slice_end", DType.INT64, (1,))
    env: dict[int, Value] = {}

    def size_value(d, base: str) -> Value:
        """A size as a 1-element tensor: a constant, or a formula computed before the Loop."""
        if isinstance(d, (int, sympy.Integer)):
            return g.const(base, np.array([int(d)], np.int64))
        return dims.emit(d)

    def rows(x: Value, unit) -> Value:
        """`x` rows of the chunked value as rows of a value with this unit (ChunkMeta.unit)."""
        if unit == 1:
            return x
        # A group's rows may be a formula (a sequence of seq tokens): computed before the Loop.
        numerator, denominator = ((unit.numerator, unit.denominator) if isinstance(unit, Fraction)
                                  else sympy.fraction(sympy.cancel(unit)))
        scaled = g.add("Mul", [x, size_value(numerator, "unit_rows")], f"{x.name}_scaled", DType.INT64, (1,))
        if denominator == 1:
            return scaled
        return g.add("Div", [scaled, size_value(denominator, "unit_per")], f"{x.name}_rows", DType.INT64, (1,))

    def short(x: Value, m: ChunkMeta) -> Value:
        """`x` less the rows a value ends short, in a dynamic region's last run (_Run.rows)."""
        if not (m.rows.tail and run.last and run.total is None):
            return x
        return g.add("Sub", [x, g.const("tail_rows", np.array([m.rows.tail], np.int64))], f"{x.name}_short",
                     DType.INT64, (1,))

    def slice_rows(m: ChunkMeta) -> Value:
        """The rows a value with `m` has in this run's slices along its chunk dim (_Run.rows):
        in a static region a number, or a formula where its groups are (a dynamic batch over a
        static sequence, a value a row short in the last slice)."""
        if run.total is not None:
            return size_value(run.rows(m), "slice_rows")
        own = short(rows(size, m.unit), m)
        if m.rows.outer == 1:
            return own
        return g.add("Mul", [own, size_value(m.rows.outer, "groups")], f"{own.name}_in_groups",
                     DType.INT64, (1,))

    def span(m: ChunkMeta) -> tuple[Value, Value]:
        """The value's own rows of the slice [start, end) (Rows.span), computed in the body."""
        if not m.rows.shifted:
            return rows(start, m.unit), rows(end, m.unit)
        if run.total is None:       # dynamic: rows from the start, the last run a tail short
            return start, short(end, m)
        lead = g.const("lead_rows", np.array([m.rows.lead], np.int64))
        lo = g.add("Max", [g.add("Sub", [start, lead], "shifted_start", DType.INT64, (1,)),
                           g.const("zero", np.array([0], np.int64))], "own_start", DType.INT64, (1,))
        last = g.const("own_end", np.array([run.total - m.rows.tail], np.int64))
        hi = g.add("Sub", [g.add("Min", [end, last], "kept_end", DType.INT64, (1,)), lead], "own_end",
                   DType.INT64, (1,))
        return lo, hi

    for v in phase.inputs:
        m = region.meta_of(v)
        if m.dim is None:
            continue
        shaped, whole = region.shaped_like(v), v
        if shaped is not v:     # read in the shape from before a skipped reshape (ChunkRegion.reshaped_to)
            whole = g.add("Reshape", [v, _shape_value(g, dims, region.reshaped_to(v), f"{v.name}_shape")],
                          f"{v.name}_reshaped", v.dtype, shaped.shape)
        in_groups = m.rows.outer != 1       # groups of the chunked rows: sliced inside each (Rows.outer)
        flat = _sliced_shape(shaped, m, run)
        if in_groups:
            split, m = grouped(m, tuple(shaped.shape))
            whole = g.add("Reshape", [whole, _shape_value(g, dims, split, f"{v.name}_groups")],
                          f"{v.name}_grouped", v.dtype, split)
        axis = g.const("slice_axis", np.array([m.dim % _rank(whole)], np.int64))
        env[id(v)] = g.add("Slice", [whole, *span(m), axis], f"{v.name}_slice", v.dtype,
                           _sliced_shape(whole, m, run))
        if in_groups:
            env[id(v)] = g.add("Reshape", [env[id(v)], _shape_value(g, dims, flat, f"{v.name}_slice_shape",
                                                                    infer=m.dim - 1 if run.last else None)],
                               f"{v.name}_slice_rows", v.dtype, flat)
    elided = {id(n) for n in region.elided}

    def sliced(o: Value) -> Value:
        """A new value for one slice of the region value `o`."""
        return Value(names(f"{o.name}_slice"), o.dtype, _sliced_shape(region.shaped_like(o), region.meta_of(o), run))

    returned = {id(o) for o in (*sums, *scans)}
    for node in phase.nodes:
        if id(node) in elided or (_moves_nothing(node) and id(node.inputs[0]) in env
                                  and id(node.outputs[0]) not in returned):
            env[id(node.outputs[0])] = env[id(node.inputs[0])]
            continue
        if id(node) in phase.replayed:      # a dropout again, from the mask the forward slices kept
            bound = phase.replayed[id(node)]
            env[id(bound.replayed)] = out = sliced(bound.replayed)
            g.nodes.extend(instantiate(bound, lambda v: env.get(id(v), v), names, out))
            continue
        m = region.meta_of(node.outputs[0])
        inputs = [None if v is None else env.get(id(v), v) for v in node.inputs]
        position = _SHAPE_INPUT.get(node.op)
        if m.dim is not None and position is not None and id(node.inputs[position]) not in env:
            out = node.outputs[0]
            inputs[position] = _resized_shape(g, dims, node, node.inputs[position], m, run, slice_rows(m),
                                              _sliced_shape(region.shaped_like(out), m, run))
        attrs = dict(node.attrs)
        if node.op in _SHIFTS and m.dim is not None:
            _SHIFTS[node.op](g, node, region, run, inputs, attrs)
        outs = [sliced(o) for o in node.outputs]
        written = outs
        if id(node) in divisors:
            attrs["reduction"] = "sum"
            written = [Value(names(f"{node.outputs[0].name}_slice_sum"), outs[0].dtype, outs[0].shape), *outs[1:]]
        g.nodes.append(Node(node.op, inputs, written, attrs, names(f"{node.name}_slice"),
                            attr_defaults=node.attr_defaults))
        if id(node) in divisors:
            g.nodes.append(Node("Div", [written[0], divisors[id(node)]], outs[:1], {}, names(f"{node.name}_mean")))
        for o, new in zip(node.outputs, outs):
            env[id(o)] = new
    cond_out = g.add("Identity", [cond], "cond_out", DType.BOOL, ())
    partials = [env[id(o)] if _sum_dtype(o) is o.dtype else
                g.add("Cast", [env[id(o)]], f"{o.name}_partial", _sum_dtype(o), o.shape, {"to": _sum_dtype(o)})
                for o in sums]
    sum_outs = [g.add("Add", [acc, part], f"{o.name}_sum_out", acc.dtype, o.shape)
                for acc, part, o in zip(carried, partials, sums)]
    return Graph(g.nodes, [iteration, cond, *carried], [cond_out, *sum_outs, *(env[id(o)] for o in scans)],
                 g.initializers, name=names("chunk_body"))


def _resized_shape(g: _Graph, dims: DimEmitter, node: Node, shape: Value, meta: ChunkMeta, run: _Run,
                   size: Value, out_shape: tuple) -> Value:
    """`shape` (the target shape an op reads) with the slice's size at the dim of `meta`
    (a region whose values' rows are not the chunked value's has static slices). A -1 at
    another dim becomes that dim of the op's output in the slice (`out_shape`): beside a
    slice of no rows it would be no size at all."""
    dim = meta.dim
    ints = shape.ints
    if ints is not None:
        dim = dim % len(ints)
        if ints[dim] == -1:
            return shape
        ints = [out_shape[k] if d == -1 and out_shape is not None else d for k, d in enumerate(ints)]
        if isinstance(run.size, int):
            ints[dim] = run.rows(meta)
            return _shape_value(g, dims, ints, f"{shape.name}_slice", target=False)
        parts = [_shape_value(g, dims, ints[:dim], f"{shape.name}_head", target=False), size,
                 _shape_value(g, dims, ints[dim + 1:], f"{shape.name}_tail", target=False)]
    else:
        if shape.shape is None or len(shape.shape) != 1 or not isinstance(shape.shape[0], int):
            raise GraphError(f"{node.op} {node.name} makes a sliced value from the shape %{shape.name}, "
                             f"whose length is not known")
        dim = dim % shape.shape[0]
        parts = [g.add("Slice", [shape, g.const("zero", np.array([0], np.int64)),
                                 g.const("dim", np.array([dim], np.int64))], f"{shape.name}_head", DType.INT64,
                       (dim,)),
                 size,
                 g.add("Slice", [shape, g.const("after_dim", np.array([dim + 1], np.int64)),
                                 g.const("end", np.array([shape.shape[0]], np.int64))], f"{shape.name}_tail",
                       DType.INT64, (shape.shape[0] - dim - 1,))]
    return g.add("Concat", parts, f"{shape.name}_slice", DType.INT64, shape.shape, {"axis": 0})


def _groups(region: ChunkRegion) -> list[tuple[int, int, int]]:
    """(size, count, offset) for each run of slices of one class (ChunkRegion.slice_class: one
    size; the first and last slices apart where a value starts in or ends short there)."""
    groups, last = [], None
    for start, end in region.slices():
        key = region.slice_class(start, end)
        if groups and key == last:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1, groups[-1][2])
        else:
            groups.append((end - start, 1, start))
        last = key
    return groups


def _bounds_at(region: ChunkRegion, run: _Run, outer: Value, inner: Value) -> tuple[int, int, int] | None:
    """(the chunk dim, then how many rows of `outer` lie before and after those of `inner` in the
    slices of `run`, engine shifted_edges), for a slice or pad that shifts the chunk dim's rows;
    None for one that does not (its bounds on it are the whole slice whatever its size, or it
    works along other dims)."""
    o, i = region.meta_of(outer), region.meta_of(inner)
    if o.dim is None:
        return None
    edges = run.edges(o, i)
    return None if edges is None else (o.dim % _rank(outer), *edges)


def _constant_ints(node: Node, name: str, position: int) -> list[int]:
    """A parameter the grower read as constant (kinds.int_param): the attribute or the input."""
    got = int_param(node, name, position)
    if got is None:
        raise GraphError(f"{node.op} {node.name}: its {name} are computed, not constant")
    return list(got)


def _shift_slice(g: _Graph, node: Node, region: ChunkRegion, run: _Run, inputs: list, attrs: dict) -> None:
    """A Slice along the chunk dim (the label shift of one sequence), given the bounds of its
    output's rows in the slices of `run`: nothing, or a row less in the first or last slice."""
    bounds = _bounds_at(region, run, node.inputs[0], node.outputs[0])
    if bounds is None:
        return
    dim, before, after = bounds
    starts, ends = _constant_ints(node, "starts", 1), _constant_ints(node, "ends", 2)
    axes = int_param(node, "axes", 3)
    rank = _rank(node.inputs[0])
    axes = list(range(len(starts))) if axes is None else [a % rank for a in axes]
    if dim not in axes:
        return
    k = axes.index(dim)
    starts[k], ends[k] = before, -after if after else _END      # from the slice's ends: any size
    if "starts" in attrs:           # opset 1-9: attributes
        attrs["starts"], attrs["ends"] = starts, ends
    else:
        inputs[1] = g.const("slice_starts", np.array(starts, np.int64))
        inputs[2] = g.const("slice_ends", np.array(ends, np.int64))


def _shift_pad(g: _Graph, node: Node, region: ChunkRegion, run: _Run, inputs: list, attrs: dict) -> None:
    """A Pad along the chunk dim (a slice's gradient): its zeros where the slices of `run` hold
    rows the padded value does not have."""
    bounds = _bounds_at(region, run, node.outputs[0], node.inputs[0])
    if bounds is None:
        return
    dim, before, after = bounds
    rank = _rank(node.inputs[0])
    pads = _constant_ints(node, "pads", 1)
    axes = int_param(node, "axes", 3)
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    if dim not in axes:
        return
    k = axes.index(dim)
    pads[k], pads[k + len(axes)] = before, after
    if "pads" in attrs:
        attrs["pads"] = pads
    else:
        inputs[1] = g.const("pads", np.array(pads, np.int64))


# Ops along the chunk dim whose bounds differ from slice to slice (engine Rows.lead, Rows.tail).
_END = np.iinfo(np.int64).max       # a Slice's end past any size
_SHIFTS = {"Slice": _shift_slice, "Pad": _shift_pad}


def _phase_nodes(phase: ChunkPhase, region: ChunkRegion, graph: Graph,
                 unrolled: bool = False) -> tuple[list[Node], list[Value]]:
    """The Loops of one phase (or, `unrolled`, their bodies written out once per slice) and
    what combines their results into the phase's outputs (the original output Values, so
    readers and graph outputs keep their names)."""
    names = graph.fresh_name
    g = _Graph(names)
    if unrolled and region.extent is not None:
        raise GraphError("slices of a dynamic size run as Loops only, not unrolled")
    sums = [o for o in phase.outputs if region.meta_of(o).need_sum]
    scans = [o for o in phase.outputs if not region.meta_of(o).need_sum]   # sliced: the grower refuses others
    # the shape each has in the slices: its own, or the one from before a skipped reshape; one
    # of groups of the chunked rows joins its slices in the shape that splits them (Rows.outer)
    own = [region.shaped_like(o) for o in scans]
    shaped = list(own)
    scan_meta = [region.meta_of(o) for o in scans]
    in_groups = [m.rows.outer != 1 for m in scan_meta]
    for k, (o, like, m) in enumerate(zip(scans, shaped, scan_meta)):
        if in_groups[k]:
            split, scan_meta[k] = grouped(m, tuple(like.shape))
            shaped[k] = Value(names(f"{o.name}_groups"), o.dtype, split)
    scan_dims = [m.dim % _rank(like) for m, like in zip(scan_meta, shaped)]
    totals = [g.add("ConstantOfShape", [g.const(f"{o.name}_shape", np.array(o.shape, np.int64))],
                    f"{o.name}_zero", _sum_dtype(o), o.shape,
                    {"value": numpy_helper.from_array(np.zeros(1, _numpy_dtype(_sum_dtype(o))))}) if o.has_static_shape
              else g.const(f"{o.name}_zero", np.zeros((), _numpy_dtype(_sum_dtype(o)))) for o in sums]
    pieces: list[list[Value]] = [[] for _ in scans]
    means = {id(n) for n in region.means}
    divisors = {id(n): _total_weight(g, n, region) for n in phase.nodes if id(n) in means}
    dims = DimEmitter(graph, g.add, g.const)
    for run in _runs(g, region, graph):
        body = _body(phase, region, names, run, sums, scans, divisors, dims)
        if unrolled:
            g.initializers.extend(body.initializers)
            for it in range(run.count):
                totals, sliced = _inline(g, body, it, totals)
                for k, s in enumerate(sliced):
                    pieces[k].append(_in_groups(g, dims, s, shaped[k], scan_meta[k], run) if in_groups[k] else s)
            continue
        outs = [Value(names(f"{o.name}_total"), _sum_dtype(o), o.shape) for o in sums]
        stacked = [Value(names(f"{o.name}_stacked"), o.dtype,
                         (run.count_dim, *_sliced_shape(like, region.meta_of(o), run)))
                   for o, like in zip(scans, own)]
        trip = run.count if isinstance(run.count, Value) else g.const("trip_count", np.array(run.count, np.int64))
        g.nodes.append(Node("Loop", [trip, None, *totals], [*outs, *stacked], {}, names("chunk_loop"),
                            {"body": body}))
        totals = outs
        for k, (o, s, dim, like) in enumerate(zip(scans, stacked, scan_dims, shaped)):
            if in_groups[k]:
                s = _in_groups(g, dims, s, like, scan_meta[k], run, stacked=True)
            pieces[k].append(_unstack(g, dims, s, like, dim, run, scan_meta[k]))
    for o, total in zip(sums, totals):
        if total.dtype is o.dtype:
            g.nodes.append(Node("Identity", [total], [o], {}, names(f"{o.name}_chunked")))
        else:
            g.nodes.append(Node("Cast", [total], [o], {"to": o.dtype}, names(f"{o.name}_chunked")))
    for o, parts, dim, like in zip(scans, pieces, scan_dims, shaped):
        whole = o if like is o else Value(names(f"{o.name}_joined"), o.dtype, like.shape)
        if len(parts) > 1:
            g.nodes.append(Node("Concat", parts, [whole], {"axis": dim}, names(f"{o.name}_chunked")))
        elif whole is o:
            g.nodes.append(Node("Identity", parts, [o], {}, names(f"{o.name}_chunked")))
        else:
            whole = parts[0]
        if whole is not o:
            g.nodes.append(Node("Reshape", [whole, _shape_value(g, dims, o.shape, f"{o.name}_shape")], [o],
                                {}, names(f"{o.name}_reshaped")))
    return g.nodes, g.initializers


def _inline(g: _Graph, body: Graph, iteration: int, carried: list[Value]) -> tuple[list[Value], list[Value]]:
    """`body` written out for one iteration: (partial sums, sliced outputs)."""
    env = {id(body.inputs[0]): g.const("iteration", np.array(iteration, np.int64)),
           id(body.inputs[1]): g.const("cond", np.array(True)),
           **{id(v): c for v, c in zip(body.inputs[2:], carried)}}
    for node in body.nodes:
        outs = [Value(g.names(f"{o.name}_{iteration}"), o.dtype, o.shape) for o in node.outputs]
        g.nodes.append(Node(node.op, [None if v is None else env.get(id(v), v) for v in node.inputs], outs,
                            dict(node.attrs), g.names(f"{node.name}_{iteration}"),
                            meta=dict(node.meta), chunk_slice=True))
        env.update((id(o), new) for o, new in zip(node.outputs, outs))
    results = [env[id(v)] for v in body.outputs[1:]]
    return results[:len(carried)], results[len(carried):]


def _in_groups(g: _Graph, dims: DimEmitter, piece: Value, like: Value, meta: ChunkMeta, run: _Run,
               stacked: bool = False) -> Value:
    """A slice of an output of groups of the chunked rows (or the Loop's stack of them), its
    rows (groups x rows) split into the shape `like` joins them in (engine `grouped`)."""
    shape = (*((run.count_dim,) if stacked else ()), *_sliced_shape(like, meta, run))
    # Only the last run's rows may be none (_runs); the full slices' run may run none of them,
    # and -1 beside that 0 would be no size at all: its target is computed whole, the 0 of the
    # count first, where a 0 copies the stack's own 0.
    rows = meta.dim % _rank(like) + (1 if stacked else 0) if run.last else None
    return g.add("Reshape", [piece, _shape_value(g, dims, shape, f"{like.name}_slice_groups", infer=rows)],
                 f"{piece.name}_grouped", piece.dtype, shape)


def _unstack(g: _Graph, dims: DimEmitter, stacked: Value, like: Value, dim: int, run: _Run,
             meta: ChunkMeta) -> Value:
    """(count, ..., size, ...) -> (..., count * size, ...): the slices side by side along `dim`."""
    rank = len(like.shape)
    shape = _sliced_shape(like, meta, run)
    if dim:
        perm = [*range(1, dim + 1), 0, *range(dim + 1, rank + 1)]
        shape = (*shape[:dim], run.count_dim, *shape[dim:])
        stacked = g.add("Transpose", [stacked], f"{like.name}_gathered", like.dtype, shape, {"perm": perm})
    merged = _sliced_shape(like, meta, run, run.count_dim)
    target = None
    if run.static and all(isinstance(d, int) for d in merged):
        target = g.const(f"{like.name}_merged_shape", np.array(merged, np.int64))
    elif not run.static and not run.last and dims.can_emit(merged):
        # The full slices' Loop may run none (a count formula of 1 at small sizes, a label shift's
        # row left for the last run): ONNX Runtime then stacks its scan outputs as zeros in every
        # dim it cannot infer, so the target is computed from the formulas, where the inputs' dims
        # give them (its 0 rows at `dim` copy the stack's count, 0 too).
        target = _shape_value(g, dims, merged, f"{like.name}_merged_shape", target=False)
    if target is None:      # the dims around the slices' two, read from the stacked value itself
        parts = [g.add("Shape", [stacked], f"{like.name}_lead", DType.INT64, (dim,), {"start": 0, "end": dim})] \
            if dim else []
        parts += [g.const("rows", np.array([-1], np.int64)),
                  g.add("Shape", [stacked], f"{like.name}_trail", DType.INT64, (rank - dim - 1,), {"start": dim + 2})]
        target = g.add("Concat", parts, f"{like.name}_merged_shape", DType.INT64, (rank,), {"axis": 0})
    return g.add("Reshape", [stacked, target], f"{like.name}_part", like.dtype, merged)


def apply_chunk(graph: Graph, region: ChunkRegion, unrolled: bool = False) -> None:
    """Rewrite `graph` in place so `region` runs slice by slice, one Loop per phase (`unrolled`:
    the slices written out one after another, which bench/chunk.py measures against Loops)."""
    names = graph.fresh_name
    built = [_phase_nodes(phase, region, graph, unrolled) for phase in region.phases]   # raises before editing
    graph.link()        # a body's own link() cleared the users of the outer values it reads
    restore = graph.checkpoint()
    try:
        _put_in(graph, region, built, names)
    except Exception:
        restore()       # the driver runs a region it could not build whole, on the graph as it was
        raise


def _put_in(graph: Graph, region: ChunkRegion, built: list, names: Callable[[str], str]) -> None:
    """The phases' Loops (or unrolled slices) in the region's place, the graph sorted again."""
    _detach_type_reads(graph, region, names)
    region_ids = {id(n) for n in region.nodes}
    position = graph.node_index()
    rank: dict[int, tuple] = {id(n): (position[id(n)], 0) for n in graph.nodes}
    for phase, (nodes, initializers) in zip(region.phases, built):
        first = min(position[id(n)] for n in phase.nodes if n not in phase.recomputed)
        for n in nodes:
            rank[id(n)] = (first, 1)
            n.plan = region.key
            if n.op == "Loop":      # what it runs slice by slice, for a picture of the original
                n.meta["replaces"] = [m.name for m in phase.nodes]
        graph.nodes.extend(nodes)
        graph.initializers.extend(initializers)
    graph.nodes = [n for n in graph.nodes if id(n) not in region_ids]
    graph.link()
    sort_near(graph, rank)
    graph.verify()


def sort_near(graph: Graph, rank: dict[int, tuple]) -> None:
    """Reorder `graph` topologically, each node as close to its `rank` as its inputs allow."""
    order = order_near(graph.nodes, producers, lambda n: rank[id(n)])
    if order is None:
        raise GraphError("chunking left a cycle in the graph")
    graph.nodes = order

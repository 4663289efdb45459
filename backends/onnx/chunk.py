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
frees each iteration's values before the next. Measured on the GPT-like step of DESIGN.md
(vocab 32768, batch 4; only the loss chunked, 16 slices; bench/chunk.py): 1333 MiB above rest
unchunked, 887 MiB unrolled, 411 MiB as a Loop; step time 1.05x and 1.09x the original's.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import numpy_helper

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Node, Value
from engine.strategies.chunk import ChunkPhase, ChunkRegion

# Where an op's target shape sits among its inputs: rewritten to the slice's size when the op
# makes a sliced value from a constant shape.
_SHAPE_INPUT = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0}


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


def _static(v: Value) -> list[int]:
    if v.shape is None or not all(isinstance(d, int) for d in v.shape):
        raise GraphError(f"%{v.name} has no static shape ({v.type_str}); the ONNX backend builds chunk "
                         f"regions of static shapes only")
    return list(v.shape)


def _sliced_shape(v: Value, dim: int | None, size: int) -> tuple | None:
    if v.shape is None or dim is None:
        return v.shape
    shape = list(v.shape)
    shape[dim] = size
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
    made = []
    for k, node in enumerate(graph.nodes):
        if id(node) not in cycles:
            continue
        if node.op == "Shape":
            shape = _static(node.inputs[0])
            start, end = node.attrs.get("start", 0), node.attrs.get("end")
            c = _constant(names, f"{node.outputs[0].name}_static", np.array(shape[start:end], np.int64))
            made.append(c)
            for user in node.outputs[0].users:
                user.replace_input(node.outputs[0], c)
            graph.outputs = [c if v is node.outputs[0] else v for v in graph.outputs]
            graph.nodes[k] = None
        else:
            graph.nodes[k] = Node("Cast", [node.inputs[0]], node.outputs, {"to": node.inputs[1].dtype},
                                  node.name)
    graph.nodes = [n for n in graph.nodes if n is not None]
    graph.initializers.extend(made)
    graph.link()


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


def _body(phase: ChunkPhase, region: ChunkRegion, names: Callable[[str], str], size: int, offset: int,
          sums: list[Value], scans: list[Value], divisors: dict[int, Value]) -> Graph:
    """The Loop body for slices of `size` starting at `offset`: (iteration, cond, partial sums)
    in, (cond, partial sums, sliced outputs) out. A mean in `divisors` (region.means) runs as a
    sum, divided by its total weight over every slice."""
    g = _Graph(names)
    iteration = Value(names("iteration"), DType.INT64, ())
    cond = Value(names("cond"), DType.BOOL, ())
    carried = [Value(names(f"{o.name}_sum_in"), o.dtype, o.shape) for o in sums]
    index = g.add("Reshape", [iteration, g.const("one_dim", np.array([1], np.int64))], "slice_index",
                  DType.INT64, (1,))
    start = g.add("Add", [g.add("Mul", [index, g.const("slice_size", np.array([size], np.int64))],
                                "slice_offset", DType.INT64, (1,)),
                          g.const("first_offset", np.array([offset], np.int64))], "slice_start", DType.INT64, (1,))
    end = g.add("Add", [start, g.const("slice_size", np.array([size], np.int64))], "slice_end",
                DType.INT64, (1,))
    env: dict[int, Value] = {}
    for v in phase.inputs:
        m = region.meta_of(v)
        if m.dim is None:
            continue
        rank = len(_static(v))
        env[id(v)] = g.add("Slice", [v, start, end, g.const("slice_axis", np.array([m.dim % rank], np.int64))],
                           f"{v.name}_slice", v.dtype, _sliced_shape(v, m.dim, size))
    elided = {id(n) for n in region.elided}
    for node in phase.nodes:
        if id(node) in elided:
            env[id(node.outputs[0])] = env[id(node.inputs[0])]
            continue
        m = region.meta_of(node.outputs[0])
        inputs = [None if v is None else env.get(id(v), v) for v in node.inputs]
        position = _SHAPE_INPUT.get(node.op)
        if m.dim is not None and position is not None and id(node.inputs[position]) not in env:
            inputs[position] = _resized_shape(g, node, node.inputs[position], m.dim, size)
        outs = [Value(names(f"{o.name}_slice"), o.dtype, _sliced_shape(o, region.meta_of(o).dim, size))
                for o in node.outputs]
        attrs = dict(node.attrs)
        if id(node) in divisors:
            attrs["reduction"] = "sum"
            summed = Value(names(f"{node.outputs[0].name}_slice_sum"), outs[0].dtype, outs[0].shape)
            g.nodes.append(Node(node.op, inputs, [summed], attrs, names(f"{node.name}_slice"),
                                attr_defaults=node.attr_defaults))
            g.nodes.append(Node("Div", [summed, divisors[id(node)]], outs, {}, names(f"{node.name}_mean")))
            env[id(node.outputs[0])] = outs[0]
            continue
        g.nodes.append(Node(node.op, inputs, outs, attrs, names(f"{node.name}_slice"),
                            attr_defaults=node.attr_defaults))
        for o, new in zip(node.outputs, outs):
            env[id(o)] = new
    cond_out = g.add("Identity", [cond], "cond_out", DType.BOOL, ())
    sum_outs = [g.add("Add", [acc, env[id(o)]], f"{o.name}_sum_out", o.dtype, o.shape)
                for acc, o in zip(carried, sums)]
    return Graph(g.nodes, [iteration, cond, *carried], [cond_out, *sum_outs, *(env[id(o)] for o in scans)],
                 g.initializers, name=names("chunk_body"))


def _resized_shape(g: _Graph, node: Node, shape: Value, dim: int, size: int) -> Value:
    ints = shape.ints
    if ints is None:
        raise GraphError(f"{node.op} {node.name} makes a sliced value from a computed shape (%{shape.name}); "
                         f"remat can rewrite only a constant one")
    ints = list(ints)
    dim = dim % len(ints)
    if ints[dim] != -1:
        ints[dim] = size
    return g.const(f"{shape.name}_slice", np.array(ints, np.int64))


def _groups(chunks: list[int]) -> list[tuple[int, int, int]]:
    """(size, count, offset) for each run of equal slice sizes."""
    groups, offset = [], 0
    for size in chunks:
        if groups and groups[-1][0] == size:
            groups[-1] = (size, groups[-1][1] + 1, groups[-1][2])
        else:
            groups.append((size, 1, offset))
        offset += size
    return groups


def _phase_nodes(phase: ChunkPhase, region: ChunkRegion, names: Callable[[str], str],
                 unrolled: bool = False) -> tuple[list[Node], list[Value]]:
    """The Loops of one phase (or, `unrolled`, their bodies written out once per slice) and
    what combines their results into the phase's outputs (the original output Values, so
    readers and graph outputs keep their names)."""
    g = _Graph(names)
    sums = [o for o in phase.outputs if region.meta_of(o).need_sum]
    scans = [o for o in phase.outputs if not region.meta_of(o).need_sum]   # sliced: the grower refuses others
    scan_dims = [region.meta_of(o).dim % len(_static(o)) for o in scans]
    totals = [g.add("ConstantOfShape", [g.const(f"{o.name}_shape", np.array(_static(o), np.int64))],
                    f"{o.name}_zero", o.dtype, o.shape,
                    {"value": numpy_helper.from_array(np.zeros(1, _numpy_dtype(o.dtype)))}) for o in sums]
    pieces: list[list[Value]] = [[] for _ in scans]
    means = {id(n) for n in region.means}
    divisors = {id(n): _total_weight(g, n, region) for n in phase.nodes if id(n) in means}
    for size, count, offset in _groups(region.chunks):
        body = _body(phase, region, names, size, offset, sums, scans, divisors)
        if unrolled:
            g.initializers.extend(body.initializers)
            for it in range(count):
                totals, sliced = _inline(g, body, it, totals)
                for k, s in enumerate(sliced):
                    pieces[k].append(s)
            continue
        outs = [Value(names(f"{o.name}_total"), o.dtype, o.shape) for o in sums]
        stacked = [Value(names(f"{o.name}_stacked"), o.dtype, (count, *_sliced_shape(o, dim, size)))
                   for o, dim in zip(scans, scan_dims)]
        trip = g.const("trip_count", np.array(count, np.int64))
        g.nodes.append(Node("Loop", [trip, None, *totals], [*outs, *stacked], {}, names("chunk_loop"),
                            {"body": body}))
        totals = outs
        for k, (o, s, dim) in enumerate(zip(scans, stacked, scan_dims)):
            pieces[k].append(_unstack(g, s, o, dim, count, size))
    for o, total in zip(sums, totals):
        g.nodes.append(Node("Identity", [total], [o], {}, names(f"{o.name}_chunked")))
    for o, parts, dim in zip(scans, pieces, scan_dims):
        op, attrs = ("Concat", {"axis": dim}) if len(parts) > 1 else ("Identity", {})
        g.nodes.append(Node(op, parts, [o], attrs, names(f"{o.name}_chunked")))
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


def _unstack(g: _Graph, stacked: Value, like: Value, dim: int, count: int, size: int) -> Value:
    """(count, ..., size, ...) -> (..., count * size, ...): the slices side by side along `dim`."""
    rank = len(like.shape)
    shape = _sliced_shape(like, dim, size)
    if dim:
        perm = [*range(1, dim + 1), 0, *range(dim + 1, rank + 1)]
        shape = (*shape[:dim], count, *shape[dim:])
        stacked = g.add("Transpose", [stacked], f"{like.name}_gathered", like.dtype, shape, {"perm": perm})
    merged = _sliced_shape(like, dim, count * size)
    return g.add("Reshape", [stacked, g.const(f"{like.name}_merged_shape", np.array(merged, np.int64))],
                 f"{like.name}_part", like.dtype, merged)


def apply_chunk(graph: Graph, region: ChunkRegion, unrolled: bool = False) -> None:
    """Rewrite `graph` in place so `region` runs slice by slice, one Loop per phase (`unrolled`:
    the slices written out one after another, which bench/chunk.py measures against Loops)."""
    names = graph.fresh_name
    built = [_phase_nodes(phase, region, names, unrolled) for phase in region.phases]   # raises before editing
    graph.link()        # a body's own link() cleared the users of the outer values it reads
    _detach_type_reads(graph, region, names)
    region_ids = {id(n) for n in region.nodes}
    position = graph.node_index()
    rank: dict[int, tuple] = {id(n): (position[id(n)], 0) for n in graph.nodes}
    for phase, (nodes, initializers) in zip(region.phases, built):
        first = min(position[id(n)] for n in phase.nodes if n not in phase.recomputed)
        for n in nodes:
            rank[id(n)] = (first, 1)
        graph.nodes.extend(nodes)
        graph.initializers.extend(initializers)
    graph.nodes = [n for n in graph.nodes if id(n) not in region_ids]
    graph.link()
    sort_near(graph, rank)
    graph.verify()


def sort_near(graph: Graph, rank: dict[int, tuple]) -> None:
    """Reorder `graph` topologically, each node as close to its `rank` as its inputs allow."""
    import heapq

    producer = {id(o): n for n in graph.nodes for o in n.outputs}
    deps: dict[int, set[int]] = {}
    for n in graph.nodes:
        deps[id(n)] = {id(producer[id(v)]) for v in n.reads() if id(v) in producer}
    users: dict[int, list[Node]] = {id(n): [] for n in graph.nodes}
    for n in graph.nodes:
        for d in deps[id(n)]:
            users[d].append(n)
    seq = {id(n): k for k, n in enumerate(graph.nodes)}
    waiting = {id(n): len(deps[id(n)]) for n in graph.nodes}
    ready = [(rank[id(n)], seq[id(n)], n) for n in graph.nodes if not waiting[id(n)]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[id(n)]:
            waiting[id(u)] -= 1
            if not waiting[id(u)]:
                heapq.heappush(ready, (rank[id(u)], seq[id(u)], u))
    if len(order) != len(graph.nodes):
        stuck = next(n for n in graph.nodes if waiting[id(n)])
        raise GraphError(f"chunking left a cycle in the graph through {stuck.name} ({stuck.op})")
    graph.nodes = order

"""Chunk regions on the ATen joint graph: one `invoke_subgraph` call per slice.

The engine decides the region and each value's ChunkMeta (engine.strategies.chunk); this
module builds it. The region's fx nodes are copied into a subgraph (one per distinct slice
size, so shapes stay static), called once per slice with `invoke_subgraph` — Inductor
compiles the body once and cannot fuse the slices back together, and `scan` is not used
because its gradients are wrong when the body holds a matmul (docs/design.md). Outputs sliced
along a dim are concatenated, partial sums are added as the slices finish, and outputs
computed with the incoming gradient as one are multiplied by it once. The nodes between the
incoming gradient and the region are redone with a tensor of ones in its place, so nothing
in the slices waits for backward and the partitioner keeps them in the forward graph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import fx
from torch._dynamo.utils import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils.checkpoint import CheckpointPolicy

from engine.dtypes import DType
from engine.errors import GraphError
from engine.order import order_near
from engine.shapes import is_static
from engine.strategies.chunk import ChunkMeta, ChunkRegion, Rows, inside_groups, shifted_edges

from .aten_ops import ATTRIBUTE_ARGS, SLICE_DEFAULTS, slice_arguments
from .exact_sums import count_broadcast_sums
from .importer import _DTYPES, TORCH_DTYPES
from .sizes import SizeNodes, free_symbols, lower_formula

aten = torch.ops.aten

# Where an op's target shape sits among its arguments: rewritten to the slice's size.
_SHAPE_ARG = {aten.full.default: 0, aten.view.default: 1, aten._unsafe_view.default: 1,
              aten.reshape.default: 1, aten.expand.default: 1, aten.zeros.default: 0,
              aten.ones.default: 0, aten.empty.memory_format: 0}


# Slices along the chunk dim (the label shift of one sequence, `logits[:-1]`) and the gradient's
# slice_scatter: (its ATen name, the argument whose rows the bounds pick from, the one whose rows
# they pick; None: the node's output).
_SLICE_BOUNDS = {aten.slice.Tensor: ("slice", 0, None), aten.slice_scatter.default: ("slice_scatter", None, 1)}


def _along_chunk_dim(node: fx.Node, meta_of: dict) -> bool:
    """Whether a slice (or slice_scatter) works along the chunk dim of the value it slices."""
    m = meta_of.get(node.args[0])
    return m is not None and m.dim is not None and _slice_dim(node) == m.dim


def _slice_dim(node: fx.Node) -> int:
    dim = slice_arguments(_SLICE_BOUNDS[node.target][0], node.args, node.kwargs)[0]
    return dim % node.args[0].meta["val"].dim()


def _with_bounds(node: fx.Node, meta_of: dict, piece: "_Slice", env: dict[fx.Node, fx.Node],
                 graph: fx.Graph) -> fx.Node:
    """Copy a slice along the chunk dim into the body of `piece`: its bounds are where, in that
    slice, the rows of its output (a slice_scatter: of the value it writes) lie among the rows
    of its input (a slice_scatter: of its output) (engine shifted_edges), counted from the
    slice's ends, so that they hold at a dynamic size too."""
    base, outer_arg, inner_arg = _SLICE_BOUNDS[node.target]
    outer = meta_of[node.args[outer_arg]] if outer_arg is not None else meta_of[node]
    inner = meta_of[node.args[inner_arg]] if inner_arg is not None else meta_of[node]
    copy = graph.node_copy(node, lambda x: env[x])
    edges = shifted_edges(outer.rows, inner.rows, piece.start, piece.end, piece.total,
                          piece.last if piece.dynamic else None)
    if edges is None:
        return copy         # it keeps every row (x[0:n]): its bounds hold for any slice
    before, after = edges
    tensors = min(ATTRIBUTE_ARGS[base])       # the tensor arguments before the dim
    copy.args = (*copy.args[:tensors], _slice_dim(node), before, -after if after else SLICE_DEFAULTS["ends"], 1)
    copy.kwargs = {}
    return copy


def _fx(node_name: str, by_name: dict[str, fx.Node]) -> fx.Node:
    try:
        return by_name[node_name]
    except KeyError:
        raise GraphError(f"chunk region names {node_name!r}, which the fx graph does not have") from None


def _with_size(node: fx.Node, dim: int, size: int, env: dict[fx.Node, fx.Node], graph: fx.Graph) -> fx.Node:
    """Copy `node` into `graph`, its target shape sliced to `size` along `dim`."""
    position = _SHAPE_ARG.get(node.target)
    if position is None:
        raise GraphError(f"{node.name} ({node.target}) makes a sliced value from a shape remat cannot rewrite")
    copy = graph.node_copy(node, lambda x: env[x])
    args = list(copy.args)
    shape = list(args[position])
    if shape[dim] != -1:
        shape[dim] = size
    args[position] = shape
    copy.args = tuple(args)
    return copy


@dataclass(frozen=True)
class _Slice:
    """Slice `index` of `count`: rows [start, end) of the `total` rows of the chunked value at the
    example sizes. Over a dynamic size (the region's `extent`; SliceSizes.FIXED_COUNT) its
    bounds are SymInts of that size, laid out as engine even_slices does: floor(size / count)
    rows each, the last the rest."""

    start: int
    end: int
    total: int
    index: int
    count: int
    dynamic: bool

    def bounds(self, meta: ChunkMeta, size, apply=lambda f, a, b: f(a, b), groups=None, lower=None) -> tuple:
        """The rows of a value with `meta` in this slice. `size`, where dynamic: the rows of the
        values of its unit along their chunk dim, counted unshifted (a value a row short, the
        label shift's `logits[:-1]`, has `size - 1`: Rows.tail), a SymInt or the fx node of one
        (`apply` then emitting the arithmetic as nodes). A region sliced in whole groups (a unit
        other than one: the value has `size // groups` rows per group) needs `groups`, the
        region's extent, of the same kind as `size`. The grower plans dynamic regions with no
        rows dropped at the start (Rows.lead): the first slice may be empty. `lower`: a formula
        as the kind of size it is sliced with (a SymInt, or a node), for a static region's rows
        of a value whose rows per chunked row are a formula (a batch sliced where a dynamic dim
        is merged into it: 256 rows of a (256 * s0, n) view, in slices of 64 * s0)."""
        if not self.dynamic:
            bounds = meta.span(self.start, self.end, self.total)
            if lower is None or all(is_static(b) for b in bounds):
                return bounds
            return tuple(int(b) if is_static(b) else lower(b) for b in bounds)
        if meta.rows.lead or (meta.unit != 1 and groups is None):
            raise GraphError(f"remat bug: a region over a dynamic size has rows {meta.rows}")

        op = _arithmetic(apply)
        step = op(operator.floordiv, size if meta.unit == 1 else groups, self.count)
        per = 1 if meta.unit == 1 else op(operator.floordiv, size, groups)     # its rows per group

        def rows(k: int):
            first = op(operator.mul, step, k)
            return first if per == 1 else op(operator.mul, per, first)

        start = 0 if self.index == 0 else rows(self.index)
        if self.index < self.count - 1:
            return start, rows(self.index + 1)
        return start, op(operator.sub, size, meta.rows.tail) if meta.rows.tail else size

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def _arithmetic(apply):
    """`f(a, b)` on two ints, `apply(f, a, b)` otherwise (an fx node, or a SymInt's arithmetic)."""
    return lambda f, a, b: f(a, b) if isinstance(a, int) and isinstance(b, int) else apply(f, a, b)


def _fake_slice(t: torch.Tensor, meta: ChunkMeta, piece: _Slice, groups=None, rows=None, outer=1,
                value=None) -> torch.Tensor:
    """`rows`: the rows the slice bounds are laid out over where not `t`'s own (the first operand
    of its unit's, as _rewire slices them: a size written with other symbols, proven equal).
    `outer`: the value's number of groups (Rows.outer), a SymInt where dynamic. `value`: a
    formula as its SymInt (SizeNodes.value)."""
    if meta.dim is None:
        return t
    bounds = piece.bounds(meta, t.shape[meta.dim] if rows is None else rows, groups=groups, lower=value)
    return _slice_rows(lambda f, *args: f(*args), t, tuple(t.shape), meta, bounds, outer=outer)


def _outer(rows: Rows, value):
    """The number of groups of `rows` (Rows.outer): an int, else its formula through `value`
    (to a SymInt of the graph, or a node of its value)."""
    return int(rows.outer) if is_static(rows.outer) else value(rows.outer)


def _slice_rows(call, x, shape: tuple, meta: ChunkMeta, bounds: tuple, shape_of=list, outer=1):
    """`x`'s rows `bounds` along its chunk dim, through `call(op, *args)` (an fx node or a
    fake tensor): where the dim holds groups of the chunked rows (Rows.outer; `outer` their
    number, an int or a SymInt), the rows of every group, in the shape that splits them (engine
    `grouped`), then as one dim again. `shape_of`: a shape as the reshape's argument (in an fx
    graph, a SymInt as its node)."""
    if meta.rows.outer == 1:
        return call(aten.slice.Tensor, x, meta.dim, *bounds)
    split, inner = _split(meta, shape, outer)
    rows = call(aten.slice.Tensor, call(aten.reshape.default, x, shape_of(split)), inner.dim, *bounds)
    flat = list(shape)
    flat[meta.dim] = -1
    return call(aten.reshape.default, rows, shape_of(flat))


def _join_rows(call, pieces: list, shape: tuple, meta: ChunkMeta, shape_of=list, outer=1):
    """The slices of an output along its chunk dim, side by side: where the dim holds groups of
    the chunked rows, joined inside every group (the inverse of _slice_rows)."""
    if meta.rows.outer == 1:
        return call(aten.cat.default, pieces, meta.dim)
    split, inner = _split(meta, shape, outer)
    parts = [call(aten.reshape.default, p, shape_of(split)) for p in pieces]
    return call(aten.reshape.default, call(aten.cat.default, parts, inner.dim), shape_of(list(shape)))


def _split(meta: ChunkMeta, shape: tuple, outer) -> tuple[list, ChunkMeta]:
    """engine `grouped` with `outer` groups (an int or a SymInt), the rows per group left for
    the reshape to infer (-1): at a dynamic length a formula, and a slice's rows differ from
    the whole's."""
    inner = inside_groups(meta, len(shape))
    return [*shape[:inner.dim - 1], outer, -1, *shape[inner.dim:]], inner


def _chunked_rows(size, rows: Rows, call, outer=None):
    """The chunked value's rows for a value whose `size` rows along its chunk dim lie as `rows`
    says: those of one of its groups (Rows.outer; `outer` their number, of the kind of `size`,
    where a formula), unshifted (Rows.tail), through `call(op, a, b)` where `size` is a node."""
    if rows.outer != 1:
        size = call(operator.floordiv, size, rows.outer if outer is None else outer)
    return call(operator.add, size, rows.tail) if rows.tail else size


def apply_chunk(graph: fx.Graph, region: ChunkRegion, name: str) -> None:
    """Rewrite `graph` (owned by a GraphModule) so `region` runs slice by slice, one pass
    over the slices per phase."""
    gm = graph.owning_module
    before = set(graph.nodes)
    by_name = {n.name: n for n in graph.nodes}
    in_region = {_fx(n.backend_nodes[0], by_name) for n in region.nodes}
    elided = {_fx(n.backend_nodes[0], by_name) for n in region.elided}
    phases = []
    shapes = SizeNodes(graph)
    try:
        # A dynamic region sliced in whole groups: its extent, the number of groups, as a SymInt
        # (or an int) for the bodies' fake inputs.
        in_groups = region.extent is not None and any(m.unit != 1 for m in region.meta.values() if m.dim is not None)
        groups = shapes.value(region.extent) if in_groups else None
        grouped_by_symbol = any(not is_static(m.rows.outer) for m in region.meta.values() if m.dim is not None)
        for phase in region.phases:
            body = [_fx(n.backend_nodes[0], by_name) for n in phase.nodes]
            meta_by_fx = {fx_node: region.meta_of(ir.outputs[0]) for ir, fx_node in zip(phase.nodes, body)}
            # A literal operand (`x / 8.0`) is written inline in the node that reads it.
            read = [v for v in phase.inputs if not v.literal]
            inputs = [_fx(v.name, by_name) for v in read]
            input_meta = [_read(region, v, by_name) for v in read]
            outputs = [_fx(v.name, by_name) for v in phase.outputs]
            output_meta = [_read(region, v, by_name) for v in phase.outputs]
            recomputed = {_fx(n.backend_nodes[0], by_name) for n in phase.recomputed}
            # The sizes the body reads from outside (a dynamic graph's SymInts in a view's shape):
            # arguments of every call.
            sizes = list(dict.fromkeys(a for n in body for a in n.all_input_nodes if a not in meta_by_fx
                                       and a not in inputs and isinstance(a.meta.get("val"), torch.SymInt)))
            if region.extent is not None or grouped_by_symbol:
                # ... and each symbol of the inputs' sizes, by itself: Inductor compiles a body for
                # symbolic shapes only where it can read every symbol in them from its inputs (a
                # slice of (2 * s0) // 4 rows does not give s0), nor write a slice's rows in a
                # dynamic number of groups (a dynamic batch over a static sequence).
                symbols = [shapes.symbol(s) for s in free_symbols([x.meta["val"] for x in inputs + sizes])]
                sizes = list(dict.fromkeys(sizes + [x for x in symbols if x not in inputs]))
            # The subgraphs first, one per class of slice (its size; the first or last where the
            # region's values start in or end short, Rows): a region that cannot be built raises
            # before the graph is touched.
            built = {}
            for piece in _slices(region):
                key = region.slice_class(piece.start, piece.end)
                if key not in built:
                    built[key] = _build(body, inputs, input_meta, sizes, outputs, meta_by_fx, elided, piece, groups,
                                        shapes.value)
            phases.append((body, inputs, input_meta, sizes, outputs, output_meta, recomputed, built))
    except Exception:
        shapes.discard()      # the size nodes made for a region that is not built
        raise
    combined: dict[fx.Node, fx.Node] = {}      # an earlier phase's outputs, as its slices combined
    for k, (body, inputs, input_meta, sizes, outputs, output_meta, recomputed, built) in enumerate(phases):
        subgraphs = {key: _attribute(gm, sub, f"{name}_{k}_{j}") for j, (key, sub) in enumerate(built.items())}
        combined.update(_rewire(graph, region, [combined.get(x, x) for x in inputs], input_meta, sizes, outputs,
                                output_meta, body, recomputed, in_region, subgraphs, shapes))
    for fx_node in reversed(list(graph.nodes)):     # what only a later phase read (the returned logits)
        if fx_node in in_region and not fx_node.users:
            graph.erase_node(fx_node)
    graph.lint()
    _propagate_fake(gm, {n for n in graph.nodes if n not in before})


def _slices(region: ChunkRegion) -> list[_Slice]:
    total, count = sum(region.chunks), len(region.chunks)
    return [_Slice(start, end, total, k, count, region.extent is not None)
            for k, (start, end) in enumerate(region.slices())]


def _attribute(gm: fx.GraphModule, sub: fx.GraphModule, attr: str) -> str:
    """The attribute of `gm` that holds `sub`: an earlier one holding the same body (each layer's
    attention, slice for slice) is shared, so Inductor lowers and compiles the body once for
    every region that runs it (it keys subgraphs by attribute), not once per layer."""
    bodies = gm.meta.setdefault("remat_chunk_bodies", {})
    key = _body_key(sub)
    if key in bodies and hasattr(gm, bodies[key]):
        return bodies[key]
    setattr(gm, attr, sub)
    bodies[key] = attr
    return attr


def _body_key(sub: fx.GraphModule) -> str:
    """What a chunk body computes, names aside: its nodes' ops and arguments by position, and
    each input's shape, strides, dtype and device (Inductor compiles a body for its inputs'
    layout)."""
    index: dict[fx.Node, int] = {}

    def canon(a):
        if isinstance(a, fx.Node):
            return ("%", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(canon(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, canon(v)) for k, v in a.items()))
        return repr(a)

    parts = []
    for k, node in enumerate(sub.graph.nodes):
        index[node] = k
        if node.op == "placeholder":
            val = node.meta.get("val")
            parts.append(("size", str(val)) if isinstance(val, torch.SymInt) else
                         ("in", tuple(val.shape), tuple(val.stride()), str(val.dtype), str(val.device)))
        else:
            parts.append((node.op, str(node.target), canon(node.args), canon(node.kwargs)))
    return repr(parts)


@dataclass(frozen=True)
class _Read:
    """How a region input is sliced, or a region output combined: its chunk meta, and the shape
    it has in the slices where that is not its own (ChunkRegion.reshaped_to), ints and SymInts."""

    meta: ChunkMeta
    reshaped: tuple | None = None
    shape: tuple = ()       # the shape it is sliced or joined in: `reshaped`, or its own


def _read(region: ChunkRegion, v, by_name: dict[str, fx.Node]) -> _Read:
    like = region.shaped_like(v)
    shape = tuple(getattr(_fx(like.name, by_name).meta["val"], "shape", ()))      # () for a size read
    return _Read(region.meta_of(v), None if like is v else shape, shape)


def _rewire(graph: fx.Graph, region: ChunkRegion, inputs: list[fx.Node], input_meta: list[_Read],
            sizes: list[fx.Node], outputs: list[fx.Node], output_meta: list[_Read], body: list[fx.Node],
            recomputed: set[fx.Node], in_region: set[fx.Node], subgraphs: dict[tuple, str],
            shapes: SizeNodes) -> dict[fx.Node, fx.Node]:
    """Call the subgraphs once per slice in place of `body`, and send the region's readers
    (never its other phase) to the combined outputs, which are returned: a later phase reads
    them too."""
    rank = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    tangent = _fx(region.tangent.name, by_name) if region.tangent is not None else None
    chain = [_fx(n.backend_nodes[0], by_name) for n in region.tangent_chain]
    out_node = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out_node):
        unscaled: dict[fx.Node, fx.Node] = {}
        if tangent is not None:
            unscaled[tangent] = _full(graph, tangent, 1.0, shapes)
            for fx_node in chain:
                unscaled[fx_node] = graph.node_copy(fx_node, lambda x: unscaled.get(x, x))
        operands = [_detached_like(graph, unscaled.get(x, x), shapes) for x in inputs]
        operands = [x if r.reshaped is None else
                    graph.call_function(aten.reshape.default, (x, shapes.shape(r.reshaped)))
                    for x, r in zip(operands, input_meta)]

        pieces: list[list[fx.Node]] = [[] for _ in outputs]
        sums = {k: _full(graph, o, 0.0, shapes, _sum_dtype(o)) for k, (o, r) in enumerate(zip(outputs, output_meta))
                if r.meta.need_sum}
        # A dynamic region: its chunked rows, read once per unit (the operands of a unit have the
        # same rows), the region's extent in groups where it is sliced in whole groups, and each
        # slice's bounds emitted once for all its operands.
        rows: dict = {}
        groups = None
        emitted: dict[tuple, fx.Node] = {}

        def emit(f, a, b):
            if (f, a, b) not in emitted:
                emitted[f, a, b] = graph.call_function(f, (a, b))
            return emitted[f, a, b]

        def node(f, *args):
            return graph.call_function(f, args)

        outers = [_outer(r.meta.rows, shapes.value) for r in input_meta]      # each input's groups, once
        for piece in _slices(region):
            args = []
            for x, r, outer in zip(operands, input_meta, outers):
                m = r.meta
                if m.dim is None:
                    args.append(x)
                    continue
                if piece.dynamic and m.unit not in rows:
                    # A static dim (the batch, sliced in whole rows over a dynamic sequence) is its
                    # number: a sym_size node of an int is a graph the partitioner refuses. Counted
                    # unshifted: a value a row short (Rows.tail) gives its rows and the one.
                    size = r.shape[m.dim]
                    size = size if isinstance(size, int) else graph.call_function(aten.sym_size.int, (x, m.dim))
                    rows[m.unit] = _chunked_rows(size, m.rows, _arithmetic(emit), _outer(m.rows, shapes.formula))
                if piece.dynamic and m.unit != 1 and groups is None:
                    groups = shapes.formula(region.extent)
                args.append(_slice_rows(node, x, r.shape, m, piece.bounds(m, rows.get(m.unit), emit, groups,
                                                                      shapes.formula),
                                        shapes.shape, outer))
            attr = subgraphs[region.slice_class(piece.start, piece.end)]
            call = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                       (graph.get_attr(attr), attr, *args, *sizes, *sums.values()))
            call.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for k, r in enumerate(output_meta):
                item = graph.call_function(operator.getitem, (call, k))
                if r.meta.need_sum:
                    sums[k] = item
                else:
                    pieces[k].append(item)

        combined = {}
        for k, (orig, r) in enumerate(zip(outputs, output_meta)):
            m = r.meta
            whole = sums[k] if m.need_sum else _join_rows(node, pieces[k], r.shape, m, shapes.shape,
                                                          _outer(m.rows, shapes.value))
            if m.need_sum and _sum_dtype(orig) is not orig.meta["val"].dtype:
                whole = graph.call_function(torch.ops.prims.convert_element_type.default,
                                            (whole, orig.meta["val"].dtype))
            if r.reshaped is not None:      # computed in the shape from before a skipped reshape
                whole = graph.call_function(aten.reshape.default, (whole, shapes.shape(orig.meta["val"].shape)))
            if m.scaled:
                whole = graph.call_function(aten.mul.Tensor, (whole, tangent))
            orig.replace_all_uses_with(whole, delete_user_cb=lambda user: user not in in_region)
            combined[orig] = whole

    for fx_node in reversed(body):
        if not fx_node.users:
            graph.erase_node(fx_node)
    for fx_node in reversed(list(unscaled)):
        if fx_node is not tangent and not fx_node.users:
            graph.erase_node(fx_node)
    first = min(rank[n] for n in body if n not in recomputed)
    _sort_near(graph, {n: (r, 0) for n, r in rank.items()}, (first, 1))
    return combined


_LIKE = {aten.full_like.default: None, aten.zeros_like.default: 0.0, aten.ones_like.default: 1.0}


def _detached_like(graph: fx.Graph, x: fx.Node, shapes: SizeNodes) -> fx.Node:
    """A `ones_like(loss)` the region reads is made anew from its shape: the loss it is shaped
    like comes after the region."""
    if x.op != "call_function" or x.target not in _LIKE:
        return x
    return _full(graph, x, x.args[1] if x.target is aten.full_like.default else _LIKE[x.target], shapes)


def _full(graph: fx.Graph, like: fx.Node, fill: float, shapes: SizeNodes, dtype=None) -> fx.Node:
    """A new tensor of `fill` with the shape, dtype (or `dtype`) and device of `like`'s value."""
    val = like.meta["val"]
    return graph.call_function(aten.full.default, (shapes.shape(val.shape), fill),
                               {"dtype": dtype or val.dtype, "device": val.device})


def _sum_dtype(output: fx.Node) -> torch.dtype:
    """The dtype a region output's partial sums accumulate in (engine DType.accumulates_in: the
    head's weight gradient under bf16 autocast, summed in bf16, was 1.4x plain Inductor's error
    against float32); a dtype the IR does not know, its own."""
    dtype = output.meta["val"].dtype
    return TORCH_DTYPES.get(_DTYPES.get(dtype, DType.UNKNOWN).accumulates_in, dtype)


def _sort_near(graph: fx.Graph, rank: dict[fx.Node, tuple], new_rank: tuple) -> None:
    """Reorder `graph` topologically, each node as close to its old place as its inputs allow
    (new nodes go where the region began). The partitioner and Inductor schedule the backward
    from this order, so a global re-sort that drifts a weight gradient to the end would keep
    recomputed activations alive until then."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    seq = {n: k for k, n in enumerate(nodes)}
    order = order_near(nodes, lambda n: n.all_input_nodes, lambda n: (*rank.get(n, new_rank), seq[n]))
    if order is None:
        raise RuntimeError("remat bug: chunking left a cycle in the fx graph")
    output = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in order if n.op == "placeholder"]
    for n in placeholders + [n for n in order if n.op != "placeholder"]:
        output.prepend(n)


def _build(body, inputs, input_meta, sizes, outputs, meta_by_fx, elided, piece: _Slice,
           groups=None, value=None) -> fx.GraphModule:
    """The body of one slice (and of every slice of its class, ChunkRegion.slice_class). `groups`:
    the region's extent (a SymInt or an int) where it is sliced in whole groups. `value`: a
    formula over the graph's symbols as its SymInt (SizeNodes.value)."""
    start, end, total = piece.start, piece.end, piece.total
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    meta_of = {x: r.meta for x, r in zip(inputs, input_meta)} | meta_by_fx
    rows: dict = {}     # the rows of each unit, read from its first operand (as _rewire does)
    for x, r in zip(inputs, input_meta):
        p = sub.placeholder(x.name)
        val = x.meta["val"] if r.reshaped is None else x.meta["val"].reshape(r.reshaped)
        outer = _outer(r.meta.rows, value)
        if r.meta.dim is not None:
            rows.setdefault(r.meta.unit, _chunked_rows(val.shape[r.meta.dim], r.meta.rows, lambda f, a, b: f(a, b),
                                                       outer))
        p.meta["val"] = _fake_slice(val, r.meta, piece, groups, rows.get(r.meta.unit) if piece.dynamic else None,
                                    outer, value)
        env[x] = p
    for x in sizes:
        env[x] = sub.placeholder(x.name)
        env[x].meta["val"] = x.meta["val"]
    # A dynamic region's slice length, as the body's own size: read from its first sliced input.
    first = next(((env[x], r.meta.dim) for x, r in zip(inputs, input_meta) if r.meta.dim is not None), None)
    if piece.dynamic:
        if first is None:
            raise GraphError("a chunk region over a dynamic size reads no sliced input")
        length = sub.call_function(aten.sym_size.int, first)
        length.meta["val"] = first[0].meta["val"].shape[first[1]]
        env[length] = length
    symbols = {str(env[x].meta["val"].node.expr): env[x] for x in sizes if isinstance(env[x].meta["val"], torch.SymInt)}
    lengths = _Lengths(sub, length, next(r.meta for r in input_meta if r.meta.dim is not None),
                       symbols, piece.last) if piece.dynamic else None
    sliced = {x for x, r in zip(inputs, input_meta) if r.meta.dim is not None}
    for fx_node in body:
        m = meta_by_fx[fx_node]
        if m.dim is not None:
            sliced.add(fx_node)
        if fx_node in elided:
            env[fx_node] = env[fx_node.args[0]]
        elif m.dim is not None and (fx_node.target in _SHAPE_ARG or not sliced & set(fx_node.all_input_nodes)):
            # Its output shape is written in its arguments (a view's target, the zeros a loss
            # gradient scatters into): the slice's size goes there.
            rows = lengths.of(m) if piece.dynamic else _lowered_in(m.length(start, end, total), symbols)
            env[fx_node] = _with_size(fx_node, m.dim, rows, env, sub)
        elif fx_node.target in _SLICE_BOUNDS and _along_chunk_dim(fx_node, meta_of):
            env[fx_node] = _with_bounds(fx_node, meta_of, piece, env, sub)
        else:
            env[fx_node] = sub.node_copy(fx_node, lambda x: env[x])
        if env[fx_node].op == "call_function" and env[fx_node].target is aten.view.default \
                and sliced & set(fx_node.all_input_nodes):
            # A slice of rows inside each sequence (a (batch, seq, vocab) value sliced along the
            # sequence) is strided: a view that merges its dims, as `logits.view(-1, V)` does, has
            # no strides to view it with. A reshape is that view where there are, else a copy.
            env[fx_node].target = aten.reshape.default
    # A slice along the chunk dim is a view into the body's own buffer at an offset: Inductor
    # returns such a subgraph output wrong (garbage rows; torch 2.13), so it leaves as a copy, a
    # slice_copy (Inductor's remove_noop_ops drops a clone of it: same size and strides).
    results = [sub.call_function(aten.slice_copy.Tensor, env[o].args) if o.target is aten.slice.Tensor
               and _along_chunk_dim(o, meta_of) else env[o] for o in outputs]
    for k, o in enumerate(outputs):       # partial sums accumulate inside: one buffer, not one per slice
        if meta_by_fx[o].need_sum:
            dtype = _sum_dtype(o)
            acc = sub.placeholder(f"{o.name}_sum")
            acc.meta["val"] = o.meta["val"].to(dtype)
            part = results[k]
            if dtype is not o.meta["val"].dtype:
                part = sub.call_function(torch.ops.prims.convert_element_type.default, (part, dtype))
            results[k] = sub.call_function(aten.add.Tensor, (acc, part))
    sub.output(tuple(results))
    count_broadcast_sums(sub)       # label smoothing's sum over the vocabulary, exact_sums.py
    sub.eliminate_dead_code()
    sub.lint()
    module = fx.GraphModule(torch.nn.Module(), sub)
    module.meta["produced_by_chunker"] = True
    _propagate_fake(module)
    return module


def _lowered_in(formula, symbols: dict[str, fx.Node]):
    """A size in a body (a slice's rows, rows per group, a number of groups): a number, or a
    formula over the body's own size placeholders (`symbols`, by name)."""
    try:
        return lower_formula(formula, symbols)
    except KeyError as missing:
        raise GraphError(f"a chunk body's size {formula} needs the size {missing}, which it is not given") from None


class _Lengths:
    """In a dynamic slice's body, the slice's rows of a value of each unit: `length`, the rows
    of the first sliced input (unit `first`), in groups where the units differ (a region sliced
    in whole groups: `length // first` groups, `unit` rows each), the units' formulas written
    with the body's own symbols (`symbols`, by name)."""

    def __init__(self, graph: fx.Graph, length: fx.Node, first: ChunkMeta, symbols: dict[str, fx.Node],
                 last: bool):
        self.graph, self.symbols, self.first, self.last = graph, symbols, first.unit, last
        # the chunked rows in this slice: those of one group, and the row a value a row short
        # lacks in the last slice
        rows = replace(first.rows, tail=first.rows.tail if last else 0)
        self.known = {first.unit: _chunked_rows(length, rows, self._call, _outer(rows, self._lowered))}

    def _call(self, f, a, b):
        return self.graph.call_function(f, (a, b))

    def of(self, meta: ChunkMeta) -> fx.Node:
        if meta.unit not in self.known:
            if 1 not in self.known:
                self.known[1] = self._call(operator.floordiv, self.known[self.first], self._lowered(self.first))
            if meta.unit not in self.known:
                self.known[meta.unit] = self._call(operator.mul, self.known[1], self._lowered(meta.unit))
        tail = meta.rows.tail if self.last else 0
        key = (meta.unit, tail, meta.rows.outer)
        if key not in self.known:
            rows = self.known[meta.unit]
            rows = self._call(operator.sub, rows, tail) if tail else rows
            self.known[key] = self._call(operator.mul, rows, _outer(meta.rows, self._lowered)) \
                if meta.rows.outer != 1 else rows
        return self.known[key]

    def _lowered(self, formula):
        return _lowered_in(formula, self.symbols)


def _same_layout(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    return type(a) is type(b)


def _propagate_fake(gm: fx.GraphModule, fresh: set[fx.Node] | None = None) -> None:
    """Fresh `meta["val"]` for every node, or, given `fresh`, for those nodes and the readers
    whose values they change (a reader of a region output now reads the concatenated slices,
    whose strides may differ): the partitioner and Inductor read them. Every other node keeps
    its value; propagating the whole graph after each region cost a second per region at 16
    layers."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    prop = FakeTensorProp(gm, mode=mode)
    if fresh is None:
        prop.propagate_dont_convert_inputs(*vals)
    else:
        changed: set[fx.Node] = set()
        with mode:
            for node in gm.graph.nodes:
                if node.op in ("placeholder", "output") or (
                        node not in fresh and not any(i in fresh or i in changed for i in node.all_input_nodes)):
                    continue
                for i in node.all_input_nodes:
                    if i not in prop.env:
                        prop.env[i] = getattr(gm, i.target) if i.op == "get_attr" else i.meta["val"]
                old = node.meta.get("val")
                prop.env[node] = prop.run_node(node)
                if node not in fresh and not _same_layout(old, node.meta.get("val")):
                    changed.add(node)
    # torch 2.13 leaves the first call of a subgraph without `val` (its later calls get one);
    # the getitems that unpack it have theirs.
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.invoke_subgraph and node.meta.get("val") is None:
            items = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
            node.meta["val"] = tuple(u.meta["val"] for u in items)

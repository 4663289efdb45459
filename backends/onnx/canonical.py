"""Copies that change nothing, read through (at import, and before a static graph's shapes are
hidden from ONNX Runtime: ort_schedule.hide_static_shapes).

torch.onnx writes an in-place `copy_(dst, src)` as `Expand(CastLike(src, dst), Shape(dst))`: the
source cast to the destination's type and broadcast to its shape. Where the two already have the
same type and shape, that is the source itself. In a model exported with dynamic dims the
destination is often a fresh buffer of the source's shape, `new_empty_strided` (ConstantOfShape of
the sizes, CastLike the source), which the copy only reads for its shape and type: left in, the
chunk grower sees an attention score's gradient built from a value it cannot slice (the buffer's
shape comes from sizes, not from the region), and the attention region of an in-place model
(`scores.masked_fill_`, `scores /= ...`) was refused on every dynamic export. Read through,
the buffer is dead and goes too.
"""
from __future__ import annotations

from engine.dtypes import DType
from engine.ir import Graph, Node, Value
from engine.shapes import free_dims


def read_through_copies(graph: Graph, constant_targets: bool = False) -> int:
    """Replace every read of a no-op CastLike, Cast or Expand (as `_same_as`: the same type, and
    for an Expand the shape of its input, from `Shape`, or with `constant_targets` from a
    constant) by its input, and drop them with what only they read. Returns how many were read
    through. The import leaves an Expand to a constant as it is: torch.fx's graph of the same
    model has it too (aten.expand before a bmm), and the two backends match the same plans."""
    kept = {id(v) for v in graph.outputs}
    symbols = {name for v in graph.inputs for d in v.shape or () for name in free_dims(d)}
    unread: list[Node] = []
    for node in graph.nodes:
        source = _same_as(node, constant_targets)
        if source is None or id(node.outputs[0]) in kept:
            continue
        out = node.outputs[0]
        if _known(out.shape, symbols) and not _known(source.shape, symbols):
            # The same tensor: the output's declared sizes (the fresh buffer's, in the sizes of the
            # graph's inputs) hold for the source, whose own inference did not get them (`unk__N`).
            source.shape = out.shape
        for user in list(out.users):
            user.replace_input(out, source)
            source.users.append(user)
        out.users = []
        unread.append(node)
    if unread:
        drop_unread(graph, unread, kept)
    return len(unread)


def _same_as(node: Node, constant_targets: bool) -> Value | None:
    """The input `node` gives back unchanged, if it is one of the no-ops above."""
    if len(node.outputs) != 1 or node.subgraphs or not node.inputs or node.inputs[0] is None:
        return None
    source, out = node.inputs[0], node.outputs[0]
    if not same_activation_type(source, out):
        return None
    if node.op in ("Cast", "CastLike"):
        return source
    if node.op == "Expand" and len(node.inputs) == 2 and _known(source.shape):
        target = _shape_of(node.inputs[1])
        if target is not None and _known(target.shape):
            return source if tuple(source.shape) == tuple(target.shape) else None
        ints = node.inputs[1].ints if constant_targets else None
        if ints is not None and all(isinstance(d, int) for d in source.shape) and list(ints) == list(source.shape):
            return source
    return None


# Integers are shape arithmetic, not activations: left as written (ort_schedule.hide_static_shapes
# reads shapes through a CastLike to int64 on purpose, so that ONNX Runtime does not know them).
_SHAPE_DTYPES = (DType.INT64, DType.INT32)


def same_activation_type(source: Value, out: Value) -> bool:
    """`out` has `source`'s known type, and it is not shape arithmetic's (_SHAPE_DTYPES)."""
    return source.dtype is not DType.UNKNOWN and source.dtype is out.dtype and source.dtype not in _SHAPE_DTYPES


def _shape_of(shape: Value | None) -> Value | None:
    """The value whose whole shape `shape` is (`Shape(v)` with no start or end)."""
    p = shape.producer if shape is not None else None
    if p is None or p.op != "Shape" or p.attrs.get("start", 0) != 0 or p.attrs.get("end") is not None:
        return None
    return p.inputs[0]


def _known(shape, symbols: set[str] | None = None) -> bool:
    """Every dim known: a number or, with `symbols`, a formula of those alone."""
    return shape is not None and all(d is not None and (symbols is None or free_dims(d) <= symbols)
                                     for d in shape)


def drop_unread(graph: Graph, unread: list[Node], kept: set[int]) -> None:
    """Drop `unread` and then every node that only they read (the fresh buffer and its shape),
    nothing else: a node the model itself leaves unread stays as it was."""
    dropped: set[int] = set()
    stack = list(unread)
    while stack:
        node = stack.pop()
        if id(node) in dropped or any(v.users or id(v) in kept for v in node.outputs):
            continue
        dropped.add(id(node))
        for v in node.reads():
            v.users = [u for u in v.users if u is not node]
            if v.producer is not None:
                stack.append(v.producer)
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    graph.link()

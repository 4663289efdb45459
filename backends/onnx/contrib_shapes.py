"""Output types of ONNX Runtime's contrib ops, which ONNX's shape inference does not know.

`onnx.shape_inference` leaves the outputs of a `com.microsoft` node untyped, and with them every
value computed from them, so the logits of a graph ONNX Runtime's optimizer wrote
(`FusedMatMul` for a matmul of a transposed weight) have no size and no rule sees them.
ONNX Runtime's own `symbolic_shape_infer` stops at the first op it cannot type (its
SoftmaxCrossEntropyLoss's log_prob, for one), so the ops ORT's optimizers write into training
graphs are typed here, from their schemas, and ONNX's inference runs again from them.
"""
from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper, shape_inference

CONTRIB = "com.microsoft"
Dim = int | str | None
Shape = list[Dim]


def _broadcast(a: Shape, b: Shape) -> Shape | None:
    """numpy broadcasting of two batch shapes; None where two different symbols meet."""
    out: Shape = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return out[::-1]


def _fused_matmul(node: onnx.NodeProto, shapes: list[Shape]) -> list[Shape] | None:
    """alpha * op(A) @ op(B), op a swap of the last two dims under transA / transB."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("transBatchA") or attrs.get("transBatchB") or len(shapes) < 2:
        return None
    a, b = shapes[0], shapes[1]
    if len(a) < 2 or len(b) < 2:
        return None
    rows = a[-1] if attrs.get("transA") else a[-2]
    cols = b[-2] if attrs.get("transB") else b[-1]
    batch = _broadcast(a[:-2], b[:-2])
    return None if batch is None else [batch + [rows, cols]]


def _like_first(node: onnx.NodeProto, shapes: list[Shape]) -> list[Shape] | None:
    return [shapes[0]] if shapes else None


# op -> its outputs' shapes from its inputs' (None: not known); each output has input 0's type.
SHAPES: dict[str, Callable[[onnx.NodeProto, list[Shape]], list[Shape] | None]] = {
    "FusedMatMul": _fused_matmul,
    "BiasGelu": _like_first,
    "FastGelu": _like_first,
    "Gelu": _like_first,
    "QuickGelu": _like_first,
}


def _shape_of(type_proto: onnx.TypeProto) -> tuple[int, Shape] | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims: Shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                   for d in type_proto.tensor_type.shape.dim]
    return type_proto.tensor_type.elem_type, dims


def _known(graph: onnx.GraphProto) -> dict[str, tuple[int, Shape]]:
    known = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        typed = _shape_of(vi.type)
        if typed is not None:
            known[vi.name] = typed
    for t in graph.initializer:
        known[t.name] = (t.data_type, list(t.dims))
    return known


def _typed_contrib_outputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """value_info for the untyped outputs of contrib nodes whose inputs are all typed."""
    known = _known(graph)
    found = []
    for node in graph.node:
        rule = SHAPES.get(node.op_type) if node.domain == CONTRIB else None
        if rule is None or all(o in known for o in node.output if o):
            continue
        inputs = [known.get(i) for i in node.input if i]
        if not inputs or any(i is None for i in inputs):
            continue
        shapes = rule(node, [list(s) for _, s in inputs])
        if shapes is None:
            continue
        for name, shape in zip(node.output, shapes):
            if name and name not in known:
                found.append(helper.make_tensor_value_info(name, inputs[0][0], shape))
    return found


def infer_shapes(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """`onnx.shape_inference.infer_shapes`, then the contrib ops' outputs typed and inference run
    again from them, until nothing new is typed (once per contrib op on the longest chain)."""
    inferred = shape_inference.infer_shapes(model, **options)
    typed: set[str] = set()
    while True:
        found = [vi for vi in _typed_contrib_outputs(inferred.graph) if vi.name not in typed]
        if not found:
            return inferred
        typed.update(vi.name for vi in found)
        inferred.graph.value_info.extend(found)
        inferred = shape_inference.infer_shapes(inferred, **options)

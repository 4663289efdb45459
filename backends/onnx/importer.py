"""ONNX ModelProto -> IR, with shape inference; `dim_param` dims become sympy symbols."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from onnx import helper, shape_inference

from engine.errors import GraphError
from engine.ir import Graph, Node, Value
from engine.shapes import parse_dim, symbol

from .dtypes import DTYPE_ATTRIBUTES, to_ir

DIM_EXAMPLES_KEY = "remat.dim_examples"
FORWARD_OUTPUTS_KEY = "remat.forward_outputs"


def load_model(source: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    path = Path(source)
    if not path.exists():
        raise GraphError(f"{path}: no such file")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # protobuf raises DecodeError and others
        raise GraphError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None


def import_model(source: str | Path | onnx.ModelProto,
                 dim_examples: dict[str, int] | None = None) -> Graph:
    """Load a model into the IR. Example dim values come from the model's metadata, then `dim_examples`."""
    model = load_model(source)
    try:
        inferred = shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise GraphError(f"ONNX shape inference failed: {exc}") from None
    opsets = {op.domain or "": op.version for op in model.opset_import}
    graph = _import_graph(inferred.graph, opsets, outer={})
    meta = {p.key: p.value for p in model.metadata_props}
    if DIM_EXAMPLES_KEY in meta:
        graph.dim_examples.update(json.loads(meta[DIM_EXAMPLES_KEY]))
    if FORWARD_OUTPUTS_KEY in meta:
        graph.meta["forward_outputs"] = json.loads(meta[FORWARD_OUTPUTS_KEY])
    graph.dim_examples.update(dim_examples or {})
    graph.meta["onnx_model"] = model
    return graph


def _value_from_type(name: str, type_proto: onnx.TypeProto | None) -> Value:
    value = Value(name)
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return value
    tensor = type_proto.tensor_type
    value.dtype = to_ir(tensor.elem_type)
    if tensor.HasField("shape"):
        dims = []
        for i, d in enumerate(tensor.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(parse_dim(d.dim_param))
            else:
                dims.append(symbol(f"{name}_dim{i}"))
        value.shape = tuple(dims)
    return value


def _attribute_defaults(op_type: str, domain: str, opsets: dict[str, int]) -> dict[str, Any]:
    try:
        schema = onnx.defs.get_schema(op_type, opsets.get(domain, 1), domain)
    except Exception:
        return {}
    defaults = {}
    for name, attr in schema.attributes.items():
        if attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            defaults[name] = _attribute_value(op_type, attr.default_value)
    return defaults


def _attribute_value(op_type: str, attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", "replace") for v in value]
    if (op_type, attr.name) in DTYPE_ATTRIBUTES:
        return to_ir(int(value))
    return value


_SMALL_INTS = 16


def _note_small_ints(v: Value, tensor: onnx.TensorProto) -> None:
    """A small integer constant (axes, a shape) goes into `meta["ints"]`, so the engine reads
    it without ONNX."""
    if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        array = onnx.numpy_helper.to_array(tensor)
        if array.size <= _SMALL_INTS:
            v.meta["ints"] = [int(x) for x in array.reshape(-1)]


def _note_constant_ints(node: Node) -> None:
    """`meta["ints"]` for a Constant's small integer output, and for the Concat of such
    values (the exporter writes a reshape's target shape as a Concat of one-element constants)."""
    out = node.outputs[0] if node.outputs else None
    if node.op == "Constant":
        if isinstance(node.attrs.get("value"), onnx.TensorProto):
            _note_small_ints(out, node.attrs["value"])
        elif "value_ints" in node.attrs and len(node.attrs["value_ints"]) <= _SMALL_INTS:
            out.meta["ints"] = [int(x) for x in node.attrs["value_ints"]]
        elif "value_int" in node.attrs:
            out.meta["ints"] = [int(node.attrs["value_int"])]
    elif node.op == "Concat" and node.attrs.get("axis") == 0:
        parts = [v.meta.get("ints") if v is not None else None for v in node.inputs]
        if parts and all(p is not None for p in parts) and sum(map(len, parts)) <= _SMALL_INTS:
            out.meta["ints"] = [x for p in parts for x in p]


def _import_graph(proto: onnx.GraphProto, opsets: dict[str, int], outer: dict[str, Value]) -> Graph:
    types = {vi.name: vi.type for vi in list(proto.input) + list(proto.value_info) + list(proto.output)}
    scope: dict[str, Value] = dict(outer)
    defaults_cache: dict[tuple[str, str], dict[str, Any]] = {}

    def lookup(name: str, node: onnx.NodeProto) -> Value:
        if name not in scope:
            raise GraphError(f"node {node.name or node.op_type!r} ({node.op_type}) reads {name!r}, "
                             f"which no input, initializer or earlier node defines")
        return scope[name]

    initializers = []
    for init in proto.initializer:
        v = Value(init.name, to_ir(init.data_type), tuple(int(d) for d in init.dims),
                  is_initializer=True, data=init)
        _note_small_ints(v, init)
        scope[init.name] = v
        initializers.append(v)
    inputs = []
    for vi in proto.input:
        if vi.name in scope and scope[vi.name].is_initializer:
            continue
        v = _value_from_type(vi.name, vi.type)
        v.is_input = True
        scope[vi.name] = v
        inputs.append(v)
    nodes = []
    for i, np_ in enumerate(proto.node):
        domain = "" if np_.domain in ("", "ai.onnx") else np_.domain
        op = np_.op_type if not domain else f"{domain}::{np_.op_type}"
        ins = [lookup(n, np_) if n else None for n in np_.input]
        attrs, subgraphs = {}, {}
        for a in np_.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                subgraphs[a.name] = _import_graph(a.g, opsets, scope)
            else:
                attrs[a.name] = _attribute_value(np_.op_type, a)
        outs = []
        for n in np_.output:
            v = _value_from_type(n or f"__unused_{i}_{len(outs)}", types.get(n))
            if n:
                scope[n] = v
            outs.append(v)
        key = (op, domain)
        if key not in defaults_cache:
            defaults_cache[key] = _attribute_defaults(np_.op_type, domain, opsets)
        node = Node(op, ins, outs, attrs, np_.name or f"{np_.op_type}_{i}", subgraphs)
        _note_constant_ints(node)
        node.meta["attr_defaults"] = defaults_cache[key]
        if not np_.output or any(not n for n in np_.output):
            node.meta["unnamed_outputs"] = [k for k, n in enumerate(np_.output) if not n]
        nodes.append(node)
    outputs = []
    for vi in proto.output:
        if vi.name not in scope:
            raise GraphError(f"graph output {vi.name!r} is never defined")
        outputs.append(scope[vi.name])
    return Graph(nodes, inputs, outputs, initializers, name=proto.name or "graph")

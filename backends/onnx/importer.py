"""ONNX ModelProto -> IR, with shape inference; `dim_param` dims become sympy symbols."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Node, SliceSizes, Value
from engine.onnx_ops import DTYPE_ATTRIBUTES
from engine.report import symbolic_dims
from engine.shapes import check_example, evaluate, format_dim, free_dims, is_static, parse_dim, symbol

from .broadcast import read_matmul_broadcasts
from .canonical import read_through_copies
from .contrib_shapes import infer_shapes
from .dtypes import to_ir

DIM_EXAMPLES_KEY = "remat.dim_examples"
FORWARD_OUTPUTS_KEY = "remat.forward_outputs"
# The shapes remat knew, at the example dim sizes, of the values of a model it wrote (a JSON
# object of value name to a list of ints): ONNX shape inference loses some (a Loop's computed trip
# count, `Range(0, seq)`, a chunk body's slice at a computed offset, the views the exporter hides
# static shapes behind), and the estimate of the file's peak reads them back as sizes only, not
# as what ORT's inference knows (ort_order.FILLED_SHAPELESS). Metadata, not value_info: ONNX
# Runtime plans buffer reuse from declared shapes.
EXAMPLE_SHAPES_KEY = "remat.example_shapes"
# Node metadata: the plan whose rewrite made a node, the node a recompute clone recomputes, and
# the nodes a chunk Loop runs slice by slice (exporter._provenance writes them).
PLAN_KEY = "remat.plan"
RECOMPUTE_OF_KEY = "remat.recompute_of"
REPLACES_KEY = "remat.replaces"


def load_model(source: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    path = Path(source)
    if not path.exists():
        raise GraphError(f"{path}: no such file")
    if path.is_dir():
        raise GraphError(f"{path}: is a directory, not an ONNX model file")
    try:
        if path.stat().st_size == 0:
            raise GraphError(f"{path}: is empty, not an ONNX model")
        return onnx.load(str(path))
    except GraphError:
        raise
    except PermissionError:
        raise GraphError(f"{path}: cannot read it (permission denied)") from None
    except Exception as exc:  # protobuf raises DecodeError and others
        raise GraphError(f"{path}: not a readable ONNX model ({type(exc).__name__}: "
                         f"{one_line(str(exc))})") from None


def _inferred_shapes(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Strict shape inference with ONNX's data propagation (the values of shape computations:
    a ConstantOfShape's or Reshape's target computed from `Shape` ops, whose sizes the rules read).

    Data propagation takes any small tensor whose values it knows for a 1-D shape and, strict,
    fails a valid graph where two such tensors of other ranks broadcast: BLOOM's ALiBi bias,
    slopes[:, None, None] * arange(seq), [heads, 1, 1] times [seq], is refused as "Invalid rank
    for Mul broadcasting: (4) vs (64)". Such a graph is checked without data propagation (the
    same strict checks of every op: a graph wrong there is a GraphError), then propagated again
    with the refused nodes' inputs passed through an op that carries shapes but no values."""
    try:
        return infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - judged below, without data propagation
        refused = exc
    try:
        plain = infer_shapes(model, check_type=True, strict_mode=True, data_prop=False)
    except Exception as exc:
        raise GraphError(f"{label}: {describe_onnx_error(exc)} (ONNX shape inference)") from None
    return _propagated_around(model, refused) or plain


_NO_VALUES = ".remat_no_data_prop"


def _propagated_around(model: onnx.ModelProto, refused: Exception) -> onnx.ModelProto | None:
    """Data propagation on a copy of `model` whose refused nodes read their inputs through
    Expand(x, Shape(x)) (x itself; ONNX propagates no values through Expand), the copy's
    inferred graph with those Expands taken out again; None where a refusal names no node."""
    barred: set[str] = set()
    work = onnx.ModelProto()
    work.CopyFrom(model)
    while True:
        found = _INFERENCE_NODE.search(str(refused))
        name = found.group(2) if found else ""
        if not name or name in barred:
            return None
        barred.add(name)
        nodes = []
        for node in work.graph.node:
            if node.name == name:
                for k, value in enumerate(node.input):
                    if value and not value.endswith(_NO_VALUES):
                        nodes.append(helper.make_node("Shape", [value], [value + _NO_VALUES + ".shape"]))
                        nodes.append(helper.make_node("Expand", [value, value + _NO_VALUES + ".shape"],
                                                      [value + _NO_VALUES]))
                        node.input[k] = value + _NO_VALUES
            nodes.append(node)
        del work.graph.node[:]
        work.graph.node.extend(nodes)
        try:
            inferred = infer_shapes(work, check_type=True, strict_mode=True, data_prop=True)
            break
        except Exception as exc:  # noqa: BLE001 - another node refused: bar it too
            refused = exc
    kept = [n for n in inferred.graph.node if not any(o.endswith((_NO_VALUES, _NO_VALUES + ".shape"))
                                                      for o in n.output)]
    for node in kept:
        for k, value in enumerate(node.input):
            if value.endswith(_NO_VALUES):
                node.input[k] = value[:-len(_NO_VALUES)]
    del inferred.graph.node[:]
    inferred.graph.node.extend(kept)
    infos = [v for v in inferred.graph.value_info if _NO_VALUES not in v.name]
    del inferred.graph.value_info[:]
    inferred.graph.value_info.extend(infos)
    return inferred


def import_model(source: str | Path | onnx.ModelProto,
                 dim_examples: dict[str, int] | None = None, read_through: bool = True) -> Graph:
    """Load a model into the IR. Example dim values come from the model's metadata, then `dim_examples`.
    `read_through`: copies, casts and expands that change nothing are read through (canonical.py),
    and a MatMul operand broadcast over batch dims by an Expand is read unbroadcast (broadcast.py),
    as remat rewrites and writes a model; off for a file read as ONNX Runtime will run it (its
    estimated peak: ORT removes some such nodes and keeps others, ort_order._eliminate).

    The model is validated first (remat's structural checks, `onnx.checker`, strict shape
    inference): a malformed model is a GraphError naming the model and the node, never a graph
    that is rewritten and written out."""
    model = load_model(source)
    label = model_label(source, model)
    check_structure(model.graph, label)
    check_onnx(model if isinstance(source, onnx.ModelProto) else Path(source), label)
    inferred = _inferred_shapes(model, label)
    opsets = {op.domain or "": op.version for op in model.opset_import}
    graph = _import_graph(inferred.graph, opsets, outer={})
    if read_through:
        read_through_copies(graph)
        read_matmul_broadcasts(graph)
    graph.verify()
    _check_inferred_dims(graph, label)
    examples, forward_outputs = read_metadata(model, label)
    graph.dim_examples.update(examples)
    if forward_outputs is not None:
        graph.forward_outputs = forward_outputs
    graph.dim_examples.update(_check_dim_examples(graph, dim_examples or {}, label))
    _check_dims_at_examples(graph, label)
    graph.meta["onnx_model"] = model
    graph.slicing = SliceSizes.COMPUTED      # backends.onnx.chunk computes dynamic slices from `Shape`
    return graph


def model_label(source: str | Path | onnx.ModelProto, model: onnx.ModelProto) -> str:
    """How errors name a model: its path as given, else its graph's name."""
    if isinstance(source, onnx.ModelProto):
        return f"model {model.graph.name or '(unnamed)'!r}"
    return str(source)


def one_line(text: str) -> str:
    return " ".join(text.split())


_CHECKER_NODE = re.compile(r"==> Context: Bad node spec for node\. Name: (\S*) OpType: (\S+)")
_INFERENCE_NODE = re.compile(r"\(op_type:([^,]+), node name: ([^)]*)\): (?:\[\w+\] )?([^\n]*)")


def describe_onnx_error(exc: Exception) -> str:
    """One line from an `onnx.checker` or shape-inference error, naming the node it is about."""
    text = str(exc)
    inferred = _INFERENCE_NODE.search(text)
    if inferred:
        op, name, message = inferred.groups()
        return f"{_node_words(name, op)}: {one_line(message)}"
    checked = _CHECKER_NODE.search(text)
    if checked:
        name, op = checked.groups()
        return f"{_node_words(name, op)}: {one_line(text[:checked.start()])}"
    return one_line(text) or type(exc).__name__


def _node_words(name: str, op: str) -> str:
    return f"node {name!r} ({op.strip()})" if name else f"an unnamed {op.strip()} node"


def check_onnx(model: onnx.ModelProto | Path, label: str) -> None:
    """`onnx.checker.check_model` (a path is checked from the file, so models over 2 GiB work)."""
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model)
    except Exception as exc:  # ValidationError, and ValueError for a proto over 2 GiB
        raise GraphError(f"{label}: {describe_onnx_error(exc)} (onnx.checker)") from None


_ELEM_TYPES = set(onnx.TensorProto.DataType.values())


def check_structure(graph: onnx.GraphProto, label: str, outer: frozenset[str] = frozenset()) -> None:
    """remat's own checks, each naming the node or value: every name assigned once and defined
    before it is read (a cycle reads a value before it is defined), an op on every node,
    known element types, no negative dims, positive dims on graph inputs."""
    where = "" if not outer else f" of subgraph {graph.name!r}"
    defined: dict[str, str] = {}

    def define(name: str, what: str) -> None:
        if name in defined:
            raise GraphError(f"{label}: {what} assigns {name!r}, which {defined[name]} already "
                             f"assigns (each value name is assigned once)")
        defined[name] = what

    for init in graph.initializer:
        define(init.name, f"initializer {init.name!r}{where}")
        _check_tensor_type(init.data_type, init.dims, f"initializer {init.name!r}", label, positive=False)
    for vi in graph.input:
        if defined.get(vi.name, "").startswith("initializer"):
            continue
        define(vi.name, f"graph input {vi.name!r}{where}")
        _check_value_info(vi, f"graph input {vi.name!r}", label, positive=True)
    for vi in list(graph.output) + list(graph.value_info):
        _check_value_info(vi, f"value {vi.name!r}", label, positive=False)
    for i, node in enumerate(graph.node):
        what = _node_words(node.name, node.op_type) if node.name else f"node #{i} ({node.op_type})"
        if not node.op_type:
            raise GraphError(f"{label}: node #{i}{where} {node.name!r} has no op_type")
        for name in node.input:
            if name and name not in defined and name not in outer:
                raise GraphError(f"{label}: {what} reads {name!r}, which no input, initializer "
                                 f"or earlier node defines")
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                check_structure(sub, label, outer | frozenset(defined))
        for name in node.output:
            if name:
                define(name, what)
    for vi in graph.output:
        if vi.name not in defined and vi.name not in outer:
            raise GraphError(f"{label}: graph output {vi.name!r}{where} is never defined")
    if not outer and not graph.output:
        raise GraphError(f"{label}: the graph has no outputs (a training graph outputs its loss "
                         f"first, then the gradients)")


def _check_value_info(vi: onnx.ValueInfoProto, what: str, label: str, positive: bool) -> None:
    if not vi.type.HasField("tensor_type"):
        return
    tensor = vi.type.tensor_type
    dims = [d.dim_value for d in tensor.shape.dim if d.HasField("dim_value")]
    _check_tensor_type(tensor.elem_type, dims, what, label, positive)


def _check_tensor_type(elem_type: int, dims, what: str, label: str, positive: bool) -> None:
    if positive and elem_type == onnx.TensorProto.UNDEFINED:
        raise GraphError(f"{label}: {what} has no element type")
    if elem_type not in _ELEM_TYPES:
        raise GraphError(f"{label}: {what} has element type {elem_type}, which is not an ONNX "
                         f"tensor type")
    for k, d in enumerate(dims):
        if d < 0 or (positive and d == 0):
            raise GraphError(f"{label}: {what} has dim {k} = {d}; dims are "
                             f"{'positive' if positive else 'not negative'}")


def _check_inferred_dims(graph: Graph, label: str) -> None:
    for node in graph.nodes:
        for out in node.outputs:
            for k, d in enumerate(out.shape or ()):
                if is_static(d) and int(d) < 0:
                    raise GraphError(f"{label}: node {node.name!r} ({node.op}) output {out.name!r} has "
                                     f"dim {k} = {d} after shape inference; dims are not negative")


def _check_dims_at_examples(graph: Graph, label: str) -> None:
    """A dim written as a formula (`seq - 2`) must be positive at the example sizes."""
    for v in graph.values():
        for k, d in enumerate(v.shape or ()):
            if is_static(d) or d.is_positive:
                continue
            n = evaluate(d, graph.dim_examples)
            if n is not None and n <= 0:
                sizes = ", ".join(f"{name}={graph.dim_examples[name]}" for name in sorted(free_dims(d)))
                raise GraphError(f"{label}: value {v.name!r} has dim {k} = {format_dim(d)}, which is "
                                 f"{n} at the example sizes {sizes}; dims are positive")


def read_metadata(model: onnx.ModelProto, label: str) -> tuple[dict[str, int], list[str] | None]:
    """remat's metadata_props: example dim sizes (a JSON object of dim name to a positive
    integer) and the forward outputs (a JSON list of output names); malformed is a GraphError."""
    meta: dict[str, str] = {}
    for prop in model.metadata_props:
        if prop.key in (DIM_EXAMPLES_KEY, FORWARD_OUTPUTS_KEY) and prop.key in meta \
                and meta[prop.key] != prop.value:
            raise GraphError(f"{label}: metadata {prop.key!r} is set twice, to different values")
        meta[prop.key] = prop.value
    examples: dict[str, int] = {}
    if DIM_EXAMPLES_KEY in meta:
        data = _metadata_json(meta, DIM_EXAMPLES_KEY, label)
        shape = 'a JSON object of dim name to example size, like {"batch": 8}'
        if not isinstance(data, dict):
            raise GraphError(f"{label}: metadata {DIM_EXAMPLES_KEY!r} is not {shape}")
        for name, value in data.items():
            if not name.strip():
                raise GraphError(f"{label}: metadata {DIM_EXAMPLES_KEY!r} names a dim with an empty name")
            try:
                examples[name] = check_example(name, value)
            except GraphError as err:
                raise GraphError(f"{label}: metadata {DIM_EXAMPLES_KEY!r}: {err}") from None
    forward = None
    if FORWARD_OUTPUTS_KEY in meta:
        forward = _metadata_json(meta, FORWARD_OUTPUTS_KEY, label)
        if not isinstance(forward, list) or not forward or not all(isinstance(n, str) and n for n in forward):
            raise GraphError(f"{label}: metadata {FORWARD_OUTPUTS_KEY!r} is not a JSON list of "
                             f"output names, like [\"loss\"]")
    return examples, forward


def _metadata_json(meta: dict[str, str], key: str, label: str) -> Any:
    try:
        return json.loads(meta[key])
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise GraphError(f"{label}: metadata {key!r} is not valid JSON ({reason}): "
                         f"{meta[key][:60]!r}") from None


def _check_dim_examples(graph: Graph, examples: dict[str, int], label: str) -> dict[str, int]:
    """Example sizes given by the caller (`--dim`): dims the model has, positive integers."""
    if not examples:
        return {}
    known = symbolic_dims(graph)
    named = sorted(symbolic_dims(graph, inputs_only=True))
    for name, value in examples.items():
        check_example(name, value)
        if name not in known:
            listing = ", ".join(named[:12]) + (" ..." if len(named) > 12 else "")
            has = f"its inputs' dims are {listing}" if named else "its inputs' shapes are all static"
            raise GraphError(f"{label}: the model has no dim {name!r} (given the example size "
                             f"{name}={value}); {has}")
    return dict(examples)


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


def _note_tensor(v: Value, tensor: onnx.TensorProto) -> None:
    """A small integer constant (axes, a shape) goes into `Value.ints`, so the engine reads
    it without ONNX; one whose elements are all one number into `Value.filled`."""
    if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        array = onnx.numpy_helper.to_array(tensor)
        if array.size <= _SMALL_INTS:
            v.ints = [int(x) for x in array.reshape(-1)]
    v.filled = _tensor_fill(tensor, v.ints)


def _tensor_fill(tensor: onnx.TensorProto, ints: list[int] | None = None) -> float | None:
    """The number every element of a constant holds: small integers (`ints`, as read) all the
    same, or a tensor of one element (by its dims first: exporters write constants of many
    elements, index tables, that are not converted to arrays for this); else None."""
    if ints:
        return float(ints[0]) if len(set(ints)) == 1 else None
    if math.prod(tensor.dims) != 1:
        return None
    array = onnx.numpy_helper.to_array(tensor)
    return float(array.reshape(-1)[0]) if array.dtype.kind in "fiub" else None


def _note_fill(node: Node) -> None:
    """`Value.filled` for a ConstantOfShape (its `value`, or ONNX's default zero) and a Constant of
    one number (`value_float`, `value_int`, or lists of one number; a tensor `value`:
    `_note_tensor`)."""
    out = node.outputs[0] if node.outputs else None
    if out is None:
        return
    numbers = next((node.attrs[k] for k in ("value_float", "value_int", "value_floats", "value_ints")
                    if k in node.attrs), None)
    numbers = [numbers] if isinstance(numbers, (int, float)) else list(numbers or [])
    if node.op == "Constant" and numbers and len(set(numbers)) == 1:
        out.filled = float(numbers[0])
    elif node.op == "ConstantOfShape":
        value = node.attrs.get("value")
        if value is None:
            out.filled = 0.0
        elif isinstance(value, onnx.TensorProto):
            out.filled = _tensor_fill(value)


def _note_constant_ints(node: Node) -> None:
    """`Value.ints` for a Constant's small integer output, for the Concat of such values (the
    exporter writes a reshape's target shape as a Concat of one-element constants), and for
    such a value cast to an integer type or reshaped."""
    out = node.outputs[0] if node.outputs else None
    if node.op == "Constant":
        if isinstance(node.attrs.get("value"), onnx.TensorProto):
            _note_tensor(out, node.attrs["value"])
        elif "value_ints" in node.attrs and len(node.attrs["value_ints"]) <= _SMALL_INTS:
            out.ints = [int(x) for x in node.attrs["value_ints"]]
        elif "value_int" in node.attrs:
            out.ints = [int(node.attrs["value_int"])]
    elif (node.op in ("Reshape", "Squeeze", "Unsqueeze", "Identity") or (
            node.op == "Cast" and node.attrs.get("to") in (DType.INT64, DType.INT32))):
        # torch.onnx writes a slice's bounds and axis as a scalar constant cast to int64 and
        # reshaped to one element: the same numbers
        first = node.inputs[0] if node.inputs else None
        if first is not None and first.ints is not None and out is not None:
            out.ints = list(first.ints)
    elif node.op == "Concat" and node.attrs.get("axis") == 0:
        parts = [v.ints if v is not None else None for v in node.inputs]
        if parts and all(p is not None for p in parts) and sum(map(len, parts)) <= _SMALL_INTS:
            out.ints = [x for p in parts for x in p]


def ir_op(node: onnx.NodeProto) -> str:
    """A node's op as the IR names it: `Add`, `com.microsoft::FusedMatMul`."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def graph_protos(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and, depth first, the graphs its nodes hold as attributes (a Loop's body)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from graph_protos(attr.g)


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
        _note_tensor(v, init)
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
        op = ir_op(np_)
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
        node = Node(op, ins, outs, attrs, np_.name or f"{np_.op_type}_{i}", subgraphs, scope=_scope(np_))
        _read_provenance(node, np_)
        _note_constant_ints(node)
        _note_fill(node)
        node.attr_defaults = defaults_cache[key]
        if not np_.output or any(not n for n in np_.output):
            node.meta["unnamed_outputs"] = [k for k, n in enumerate(np_.output) if not n]
        nodes.append(node)
    outputs = []
    for vi in proto.output:
        if vi.name not in scope:
            raise GraphError(f"graph output {vi.name!r} is never defined")
        outputs.append(scope[vi.name])
    return Graph(nodes, inputs, outputs, initializers, name=proto.name or "graph")


def _read_provenance(node: Node, node_proto) -> None:
    """What remat's exporter wrote about the rewrite that made the node (exporter._provenance)."""
    for prop in node_proto.metadata_props:
        if prop.key == PLAN_KEY:
            node.plan = prop.value
        elif prop.key == RECOMPUTE_OF_KEY:
            node.recompute_of = prop.value
        elif prop.key == REPLACES_KEY:
            node.meta["replaces"] = prop.value.split(",")


def _scope(node_proto) -> str | None:
    """The module path an exporter recorded: torch.onnx's `pkg.torch.onnx.name_scopes` metadata
    (`['', 'blocks.0', 'attn']`), or a TorchScript-style node name (`/blocks.0/attn/MatMul`)."""
    for prop in node_proto.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            parts = [p for p in prop.value.strip("[]").replace("'", "").replace('"', "").split(",")]
            path = ".".join(p.strip() for p in parts if p.strip())
            return path or None
    if node_proto.name.startswith("/") and node_proto.name.count("/") >= 2:
        return ".".join(node_proto.name.strip("/").split("/")[:-1]) or None
    return None

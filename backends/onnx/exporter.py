"""IR -> ONNX ModelProto.

Recompute clones get a CSE barrier. ONNX Runtime's common-subexpression
elimination merges a clone with its original (same op, same inputs) and the
saving vanishes; measured: 4 cloned Gelu nodes were merged back in a default
session. Each original tensor a recompute region reads therefore passes through
`Reshape(leaf, Shape(leaf))`: a zero-copy view in ONNX Runtime that CSE has
never seen, so the clones downstream of it are new expressions. It also keeps
the clones where the schedule put them, because ONNX Runtime orders nodes by
a depth-first walk from the outputs and the clones are reachable only from
their backward consumers.
"""
from __future__ import annotations

import json
from typing import Any

import onnx
from onnx import helper

from engine.dtypes import DType
from engine.errors import RematError
from engine.ir import Graph, Node, Value
from engine.onnx_ops import DTYPE_ATTRIBUTES
from engine.shapes import format_dim, is_static, parse_dim

from .dtypes import to_onnx
from .importer import (DIM_EXAMPLES_KEY, EXAMPLE_SHAPES_KEY, FORWARD_OUTPUTS_KEY, PLAN_KEY, RECOMPUTE_OF_KEY,
                       REPLACES_KEY, describe_onnx_error)
from .ort_order import ort_constants
from .ort_schedule import schedule_for_onnxruntime

PROTOBUF_LIMIT = 2**31 - 1      # bytes: a larger ModelProto cannot be serialized in one piece


class ExportBug(RuntimeError):
    """A model remat wrote is not valid ONNX: a bug in remat, never a problem with the input."""


def check_exported(model: onnx.ModelProto, what: str = "the rewritten model") -> None:
    """`onnx.checker` with strict shape inference on a model remat built, before anyone writes
    it: an invalid one raises ExportBug naming the node."""
    size = model.ByteSize()
    if size > PROTOBUF_LIMIT:
        raise RematError(f"{what} is {size / 2**30:.1f} GiB, over protobuf's 2 GiB limit for one "
                         f"model file; remat does not write weights as external data")
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise ExportBug(f"remat bug: {what} is not valid ONNX: {describe_onnx_error(exc)}; "
                        f"nothing was written") from None



def export_model(graph: Graph, base: onnx.ModelProto | None = None,
                 for_onnxruntime: bool = True, estimate: bool = True) -> onnx.ModelProto:
    """Write `graph` as a model; opsets, IR version and metadata come from the model it was read from.

    With `for_onnxruntime` the nodes are ordered for ONNX Runtime's scheduler (see ort_schedule:
    of two leaf placements, the one with the lower estimated peak; without `estimate`, for a run
    that checks numbers only, the leaves last).
    """
    base = base if base is not None else graph.meta.get("onnx_model")
    if for_onnxruntime:
        graph = schedule_for_onnxruntime(graph, estimate=estimate).graph
    proto = _export_graph(graph, with_barriers=True)
    if base is not None:
        model = helper.make_model(proto, opset_imports=list(base.opset_import),
                                  producer_name="remat", ir_version=base.ir_version)
        model.functions.extend(base.functions)
        keep = {p.key: p.value for p in base.metadata_props}
    else:
        model = helper.make_model(proto, opset_imports=[helper.make_opsetid("", 20)],
                                  producer_name="remat")
        model.ir_version = 10
        keep = {}
    keep.pop(EXAMPLE_SHAPES_KEY, None)         # the base model's, if remat wrote it: stale here
    if graph.dim_examples:
        keep[DIM_EXAMPLES_KEY] = json.dumps(graph.dim_examples)
    if for_onnxruntime:
        # What ONNX inference cannot follow when the file is read back (a chunk Loop body's slices
        # at a computed offset), static or not: estimated_ort_peak(path), `remat measure --timeline`
        keep[EXAMPLE_SHAPES_KEY] = json.dumps(example_shapes(graph), separators=(",", ":"))
    if graph.forward_outputs:
        keep[FORWARD_OUTPUTS_KEY] = json.dumps(graph.forward_outputs)
    helper.set_model_props(model, keep)
    return model


def example_shapes(graph: Graph) -> dict[str, list[int]]:
    """Each computed value's shape at the graph's example dim sizes, in every subgraph, where
    it has one there (EXAMPLE_SHAPES_KEY)."""
    from engine.shapes import evaluate

    out: dict[str, list[int]] = {}

    def visit(g: Graph) -> None:
        for node in g.nodes:
            for v in node.outputs:
                dims = [evaluate(d, graph.dim_examples) for d in v.shape] if v.shape is not None else [None]
                if all(d is not None for d in dims):
                    out[v.name] = [int(d) for d in dims]
            for sub in node.subgraphs.values():
                visit(sub)

    visit(graph)
    return out


def value_info(value: Value) -> onnx.ValueInfoProto:
    if value.dtype is DType.UNKNOWN:
        return helper.make_empty_tensor_value_info(value.name)
    shape = None
    if value.shape is not None:
        shape = [int(d) if is_static(d) else _dim_param(d) for d in value.shape]
    return helper.make_tensor_value_info(value.name, to_onnx(value.dtype), shape)


def _dim_param(d) -> str | None:
    """A symbolic dim as `dim_param` text, when reading the text back gives the same formula
    (`batch*seq`); a dim the importer could not read back (a chunk slice's `ceiling(...)`) is
    written as unknown."""
    text = format_dim(d)
    return text if parse_dim(text) == d else None


def _attribute(node: Node, name: str, value: Any) -> onnx.AttributeProto:
    if isinstance(value, DType) and (node.op_type, name) in DTYPE_ATTRIBUTES:
        value = to_onnx(value)
    if isinstance(value, (list, tuple)) and not value:
        # An empty list has no element to tell its type by (torch.onnx writes `Constant(value_ints=[])`
        # for an empty shape): the op's schema says it.
        domain, _, op_type = node.op.rpartition("::")
        try:
            return helper.make_attribute(name, value, attr_type=onnx.defs.get_schema(op_type, domain=domain)
                                         .attributes[name].type)
        except (onnx.defs.SchemaError, KeyError):
            raise RematError(f"node {node.name or node.op}: cannot write its empty list attribute {name!r}, "
                             f"whose type no ONNX schema gives") from None
    return helper.make_attribute(name, value)


def _export_node(node: Node, inputs: list[str]) -> onnx.NodeProto:
    domain, _, op_type = node.op.rpartition("::")
    unnamed = set(node.meta.get("unnamed_outputs", ()))
    outputs = ["" if k in unnamed else o.name for k, o in enumerate(node.outputs)]
    proto = helper.make_node(op_type, inputs, outputs, name=node.name or None, domain=domain or None)
    for key, value in node.attrs.items():
        proto.attribute.append(_attribute(node, key, value))
    for key, sub in node.subgraphs.items():
        proto.attribute.append(helper.make_attribute(key, _export_graph(sub, with_barriers=True)))
    helper.set_metadata_props(proto, _provenance(node))
    return proto


def _provenance(node: Node) -> dict[str, str]:
    """What a rewrite made the node for, as the node's metadata (the importer reads it back):
    `remat.plan`, `remat.recompute_of`, and a chunk Loop's `remat.replaces` (the region's nodes)."""
    props = {}
    if node.plan:
        props[PLAN_KEY] = node.plan
    if node.recompute_of:
        props[RECOMPUTE_OF_KEY] = node.recompute_of
    if node.meta.get("replaces"):
        props[REPLACES_KEY] = ",".join(node.meta["replaces"])
    return props


def _export_graph(graph: Graph, with_barriers: bool) -> onnx.GraphProto:
    """`graph` as a GraphProto. With barriers, a recompute clone reads each tensor from outside its
    region through `Reshape(x, Shape(x))` (the module docstring), except a constant ORT folds:
    folded, a clone of constants is a constant too and costs nothing, and a barrier there hides
    the constant from ONNX shape inference (an `Unsqueeze` whose axes pass through one has an
    unknown rank, and so has everything after it, and ORT's planner reuses no buffer for a value
    of unknown shape: checked with ONNX shape inference on DeepSeek-V3's recomputed expert
    gathers, every value from the routing's `Unsqueeze` to the expert weight gradient)."""
    nodes: list[onnx.NodeProto] = []
    barrier_of: dict[tuple[int, int], str] = {}
    constant = ort_constants(graph)[0] if with_barriers else set()
    for node in graph.nodes:
        region = node.recompute_region
        inputs = []
        for v in node.inputs:
            if v is None:
                inputs.append("")
                continue
            name = v.name
            if (with_barriers and region is not None and v.dtype is not DType.UNKNOWN and id(v) not in constant
                    and (v.producer is None or v.producer.recompute_region is None)):
                key = (region, id(v))
                if key not in barrier_of:
                    shape = graph.fresh_name(f"{v.name}_rc_shape")
                    barrier = graph.fresh_name(f"{v.name}_rc_view")
                    nodes.append(helper.make_node("Shape", [v.name], [shape], name=f"{shape}_node"))
                    nodes.append(helper.make_node("Reshape", [v.name, shape], [barrier],
                                                  name=f"{barrier}_node"))
                    barrier_of[key] = barrier
                name = barrier_of[key]
            inputs.append(name)
        nodes.append(_export_node(node, inputs))
    initializers = [v.data for v in graph.initializers]
    return helper.make_graph(nodes, graph.name, [value_info(v) for v in graph.inputs],
                             [value_info(v) for v in graph.outputs], initializers)

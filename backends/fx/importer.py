"""A torch.fx graph of ATen ops (a joint forward + backward graph) -> the shared IR."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Node, Value
from engine.shapes import parse_dim

from .aten_ops import ATEN_TO_ONNX, ATTRIBUTE_ARGS

_DTYPES = {
    torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
    torch.float64: DType.FLOAT64, torch.int8: DType.INT8, torch.int16: DType.INT16,
    torch.int32: DType.INT32, torch.int64: DType.INT64, torch.uint8: DType.UINT8, torch.bool: DType.BOOL,
}


def _dim(d: Any):
    """An int, or a SymInt's expression (`s0*s1`) as a formula."""
    return d if isinstance(d, int) else parse_dim(str(d))


def _value(name: str, example: Any) -> Value:
    if isinstance(example, torch.Tensor):
        return Value(name, _DTYPES.get(example.dtype, DType.UNKNOWN), tuple(_dim(d) for d in example.shape))
    return Value(name)


def _op_name(target: Any) -> tuple[str, str]:
    """(IR op, native ATen name) for an fx call_function target."""
    packet = getattr(target, "overloadpacket", None)
    base = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    native = f"aten::{base}"
    return ATEN_TO_ONNX.get(base, native), native


def import_fx(gm: fx.GraphModule, forward_outputs: int = 1) -> Graph:
    """Placeholders become inputs, the output tuple the outputs (its first `forward_outputs`
    are the forward part's outputs: the loss)."""
    values: dict[fx.Node, list[Value] | Value] = {}
    inputs, nodes = [], []
    for fx_node in gm.graph.nodes:
        example = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            v = _value(fx_node.name, example)
            v.is_input = True
            values[fx_node] = v
            inputs.append(v)
        elif fx_node.op == "call_function" and fx_node.target is operator.getitem:
            source, index = fx_node.args
            outs = values[source]
            if not isinstance(outs, list) or index >= len(outs):
                raise GraphError(f"{fx_node.name}: getitem {index} of {source.name}, which has no such output")
            outs[index].name = fx_node.name
            values[fx_node] = outs[index]
        elif fx_node.op == "call_function":
            op, native = _op_name(fx_node.target)
            tensor_args, attrs = [], {}
            renames = ATTRIBUTE_ARGS.get(native.split("::")[1], {})
            for i, arg in enumerate(fx_node.args):
                if isinstance(arg, fx.Node):
                    tensor_args.append(values[arg])
                elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, fx.Node) for a in arg):
                    tensor_args.extend(values[a] for a in arg)
                else:
                    attrs[renames.get(i, f"arg{i}")] = arg
            for key, arg in fx_node.kwargs.items():
                if isinstance(arg, fx.Node):
                    tensor_args.append(values[arg])
                elif key == "dtype" and arg in _DTYPES:
                    attrs["to"] = _DTYPES[arg]
                else:
                    attrs[key] = arg
            if isinstance(example, (list, tuple)):
                outs = [_value(f"{fx_node.name}_{k}", e) for k, e in enumerate(example)]
            else:
                outs = [_value(fx_node.name, example)]
            original = fx_node.meta.get("original_aten")  # what Inductor's decompositions came from
            if original is not None:
                native = f"aten::{getattr(original, '_opname', str(original).split('.')[-2])}"
            meta = {"native_op": native, "fx_node": fx_node.name}
            nodes.append(Node(op, tensor_args, outs, attrs, fx_node.name, meta=meta))
            values[fx_node] = outs if isinstance(example, (list, tuple)) else outs[0]
        elif fx_node.op == "output":
            outputs = [values[a] for a in fx_node.args[0] if isinstance(a, fx.Node)]
            graph = Graph(nodes, inputs, outputs, [], name="joint")
            graph.meta["forward_outputs"] = [v.name for v in outputs[:forward_outputs]]
            graph.verify()
            return graph
    raise GraphError("the fx graph has no output node")

"""Small ONNX training graphs (forward + hand-written backward) for tests.

Torch export takes seconds per graph, too slow for Hypothesis; these build in
milliseconds and can keep batch and sequence dims symbolic. The backward of
each op is written out (the activations' with engine.testing's gradient
formulas), so the forward values it reads are real stashed activations, as in
an exported training graph.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from backends.onnx.importer import DIM_EXAMPLES_KEY, FORWARD_OUTPUTS_KEY
from engine.testing.ops import Call, gradient

ACTIVATIONS = ("Gelu", "Relu", "Sigmoid", "Tanh", "Softmax")


@dataclass
class _Builder:
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    count: int = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def op(self, op: str, inputs: list[str], base: str | None = None, **attrs) -> str:
        out = self.name(base or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n_{out}", **attrs))
        return out

    def const(self, value, dtype=np.float32, base: str = "c") -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name


@dataclass
class Layer:
    width: int
    activation: str
    cast_roundtrip: bool = False    # fp32 -> fp16 -> fp32 before the next layer


def build_mlp(d_in: int, layers: list[Layer], dims: tuple = ("batch", "seq"),
              examples: dict[str, int] | None = None, seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """x[*dims, d_in] -> (MatMul + bias -> activation [-> cast round trip])* -> MSE loss.

    Outputs: loss, then the gradient of every weight and bias. Returns the model and inputs.
    """
    b = _Builder()
    rng = np.random.default_rng(seed)
    examples = examples or {d: 3 for d in dims if isinstance(d, str)}
    shape_in = [*dims, d_in]
    weights = []
    h, width = "x", d_in
    tape = []
    for i, layer in enumerate(layers):
        w = f"w{i}"
        bias = f"b{i}"
        weights += [(w, (rng.standard_normal((width, layer.width)) / np.sqrt(width)).astype(np.float32)),
                    (bias, (rng.standard_normal(layer.width) * 0.1).astype(np.float32))]
        mm = b.op("MatMul", [h, w], "mm")
        pre = b.op("Add", [mm, bias], "pre")
        kw = {"axis": -1} if layer.activation == "Softmax" else {}
        act = b.op(layer.activation, [pre], layer.activation.lower(), **kw)
        tape.append(("dense", h, w, bias, width, layer.width))
        tape.append(("act", layer.activation, pre, act))
        h, width = act, layer.width
        if layer.cast_roundtrip:
            half = b.op("Cast", [h], "half", to=TensorProto.FLOAT16)
            back = b.op("Cast", [half], "widened", to=TensorProto.FLOAT)
            tape.append(("cast",))
            h = back
    target_shape = [*dims, width]
    diff = b.op("Sub", [h, "target"], "diff")
    sq = b.op("Mul", [diff, diff], "sq")
    loss = b.op("ReduceMean", [sq], "loss", keepdims=0)
    count = b.op("Cast", [b.op("Size", [diff], "size")], "count", to=TensorProto.FLOAT)
    grad = b.op("Div", [b.op("Mul", [diff, b.const(2.0)], "diff2"), count], "g")
    grads = {}
    for entry in reversed(tape):
        if entry[0] == "cast":
            grad = b.op("Cast", [b.op("Cast", [grad], "gh", to=TensorProto.FLOAT16)], "gc",
                        to=TensorProto.FLOAT)
        elif entry[0] == "act":
            _, kind, pre, act = entry
            grad = _activation_grad(b, kind, pre, act, grad)
        else:
            _, x, w, bias, k, n = entry
            flat_x = b.op("Reshape", [x, b.const([-1, k], np.int64)], "flat_x")
            flat_g = b.op("Reshape", [grad, b.const([-1, n], np.int64)], "flat_g")
            grads[w] = b.op("MatMul", [b.op("Transpose", [flat_x], "xt", perm=[1, 0]), flat_g], "dw")
            grads[bias] = b.op("ReduceSum", [flat_g, b.const([0], np.int64)], "db", keepdims=0)
            grad = b.op("MatMul", [grad, b.op("Transpose", [w], "wt", perm=[1, 0])], "dx")
    # Weights are inputs of a training step, as in the torch export.
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape_in),
              helper.make_tensor_value_info("target", TensorProto.FLOAT, target_shape)]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in weights]
    outputs = [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(grads[n], TensorProto.FLOAT, list(v.shape)) for n, v in weights]
    graph = helper.make_graph(b.nodes, "mlp_step", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    helper.set_model_props(model, {FORWARD_OUTPUTS_KEY: json.dumps([loss]),
                                   DIM_EXAMPLES_KEY: json.dumps(examples)})
    concrete = [examples.get(d, d) if isinstance(d, str) else d for d in dims]
    feeds = {"x": rng.standard_normal([*concrete, d_in]).astype(np.float32),
             "target": rng.standard_normal([*concrete, width]).astype(np.float32)}
    feeds.update(weights)
    return model, feeds


def _activation_grad(b: _Builder, kind: str, pre: str, act: str, grad: str) -> str:
    """The activation's gradient: engine.testing's formula, written into this ONNX graph."""
    attrs = {"axis": -1} if kind == "Softmax" else {}
    return gradient(kind)(b, Call([pre], [act], attrs), grad)[0]

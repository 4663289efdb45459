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


ORT_MATMULS = ("MatMul", "FusedMatMul", "Gemm")


def build_ort_loss_head(tokens: int, d: int, vocab: int, ignored: int = 0, reduction: str = "mean",
                        matmul: str = "MatMul", seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """A language model's head as ONNX Runtime's training graphs spell it: LayerNormalization
    (its mean and inverse deviation outputs read by the backward), a projection to the vocabulary
    and SoftmaxCrossEntropyLoss (its log_prob read by the backward), which ignores label -100.

    The projection is spelled `matmul`: MatMul of w[d, vocab]; com.microsoft::FusedMatMul of a
    Linear's weight w[vocab, d] with transB=1 (ORT's MatmulTransposeFusion), its weight gradient
    a FusedMatMul with transA=1; Gemm with transB=1 and a bias (ORT's MatMulAddFusion); or
    `MatMul+Add`, MatMul of w[d, vocab] then Add of a bias (a biased Linear as exporters that do
    not write Gemm spell it).

    x[tokens, d], scale[d], bias[d], w, (b[vocab],) labels[tokens] -> loss and the gradients.
    The backward is written in standard ops (this onnxruntime has no SoftmaxCrossEntropyLossGrad)."""
    if matmul not in (*ORT_MATMULS, "MatMul+Add"):
        raise ValueError(f"matmul {matmul!r}: one of {ORT_MATMULS} or MatMul+Add")
    biased = matmul in ("Gemm", "MatMul+Add")
    b = _Builder()
    rng = np.random.default_rng(seed)
    y, mean, inv = b.name("ln"), b.name("ln_mean"), b.name("ln_inv")
    b.nodes.append(helper.make_node("LayerNormalization", ["x", "scale", "bias"], [y, mean, inv], name="n_ln",
                                    axis=-1, epsilon=1e-5))
    transposed = matmul not in ("MatMul", "MatMul+Add")     # w[vocab, d], as a Linear keeps it
    if matmul == "MatMul":
        logits = b.op("MatMul", [y, "w"], "logits")
    elif matmul == "MatMul+Add":
        logits = b.op("Add", [b.op("MatMul", [y, "w"], "product"), "b"], "logits")
    elif matmul == "FusedMatMul":
        logits = b.op("FusedMatMul", [y, "w"], "logits", domain="com.microsoft", transB=1)
    else:
        logits = b.op("Gemm", [y, "w", "b"], "logits", transB=1)
    loss, log_prob = b.name("loss"), b.name("log_prob")
    b.nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [logits, "labels"],
                                    [loss, log_prob], name="n_sce", reduction=reduction, ignore_index=-100))
    # d logits = (softmax - onehot(label)) * kept / total weight (a mean), the kept rows only.
    kept = b.op("Not", [b.op("Equal", ["labels", b.const(-100, np.int64)], "ignored")], "kept")
    kept_f = b.op("Cast", [kept], "kept_f", to=TensorProto.FLOAT)
    safe = b.op("Where", [kept, "labels", b.const(0, np.int64)], "safe")
    zeros = b.op("ConstantOfShape", [b.op("Shape", [log_prob], "lp_shape")], "zeros",
                 value=numpy_helper.from_array(np.zeros(1, np.float32)))
    column = b.op("Unsqueeze", [safe, b.const([1], np.int64)], "column")
    onehot = b.op("ScatterElements", [zeros, column, b.op("Unsqueeze", [kept_f, b.const([1], np.int64)], "ones")],
                  "onehot", axis=1)
    grad = b.op("Sub", [b.op("Exp", [log_prob], "p"), onehot], "p_minus")
    grad = b.op("Mul", [grad, b.op("Unsqueeze", [kept_f, b.const([1], np.int64)], "row_kept")], "g_kept")
    if reduction == "mean":
        total = b.op("ReduceSum", [kept_f], "total", keepdims=0)
        grad = b.op("Div", [grad, total], "g_logits")
    grads = {}
    if matmul in ("MatMul", "MatMul+Add"):
        grads["w"] = b.op("MatMul", [b.op("Transpose", [y], "yt", perm=[1, 0]), grad], "dw")
        dy = b.op("MatMul", [grad, b.op("Transpose", ["w"], "wt", perm=[1, 0])], "dy")
        if biased:
            grads["b"] = b.op("ReduceSum", [grad, b.const([0], np.int64)], "db", keepdims=0)
    elif matmul == "FusedMatMul":
        grads["w"] = b.op("FusedMatMul", [grad, y], "dw", domain="com.microsoft", transA=1)
        dy = b.op("MatMul", [grad, "w"], "dy")
    else:
        grads["w"] = b.op("Gemm", [grad, y], "dw", transA=1)
        grads["b"] = b.op("ReduceSum", [grad, b.const([0], np.int64)], "db", keepdims=0)
        dy = b.op("Gemm", [grad, "w"], "dy")
    # LayerNormalization's backward from its saved statistics.
    xhat = b.op("Mul", [b.op("Sub", ["x", mean], "centered"), inv], "xhat")
    grads["scale"] = b.op("ReduceSum", [b.op("Mul", [dy, xhat], "dy_xhat"), b.const([0], np.int64)], "dscale",
                          keepdims=0)
    grads["bias"] = b.op("ReduceSum", [dy, b.const([0], np.int64)], "dbias", keepdims=0)
    dxhat = b.op("Mul", [dy, "scale"], "dxhat")
    mean1 = b.op("ReduceMean", [dxhat, b.const([-1], np.int64)], "m1", keepdims=1)
    mean2 = b.op("ReduceMean", [b.op("Mul", [dxhat, xhat], "dxhat_xhat"), b.const([-1], np.int64)], "m2",
                 keepdims=1)
    inner = b.op("Sub", [b.op("Sub", [dxhat, mean1], "s1"), b.op("Mul", [xhat, mean2], "xm2")], "s2")
    grads["x"] = b.op("Mul", [inner, inv], "dx")
    shapes = {"x": [tokens, d], "scale": [d], "bias": [d], "w": [vocab, d] if transposed else [d, vocab]}
    if biased:
        shapes["b"] = [vocab]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    inputs.append(helper.make_tensor_value_info("labels", TensorProto.INT64, [tokens]))
    outputs = [helper.make_tensor_value_info(loss, TensorProto.FLOAT, [])]
    outputs += [helper.make_tensor_value_info(grads[n], TensorProto.FLOAT, shapes[n]) for n in shapes]
    graph = helper.make_graph(b.nodes, "ort_loss_head", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    helper.set_model_props(model, {FORWARD_OUTPUTS_KEY: json.dumps([loss])})
    labels = rng.integers(0, vocab, tokens)
    labels[rng.choice(tokens, size=min(ignored, tokens), replace=False)] = -100
    feeds = {"x": rng.standard_normal((tokens, d)).astype(np.float32),
             "scale": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
             "bias": (0.1 * rng.standard_normal(d)).astype(np.float32),
             "w": (rng.standard_normal(shapes["w"]) / np.sqrt(d)).astype(np.float32), "labels": labels}
    if biased:
        feeds["b"] = (0.1 * rng.standard_normal(vocab)).astype(np.float32)
    return model, feeds

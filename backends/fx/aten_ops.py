"""ATen ops -> the IR's op vocabulary (ONNX operator names).

Where an ONNX operator computes the same thing, the node gets its name so one rule
matches both backends; the ATen spelling stays in `meta["native_op"]` (`aten::gelu`),
which rules may name too. Ops with no ONNX twin keep their native name as the op.
"""
from __future__ import annotations

ATEN_TO_ONNX = {
    "gelu": "Gelu", "relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "erf": "Erf", "exp": "Exp",
    "log": "Log", "neg": "Neg", "sqrt": "Sqrt", "reciprocal": "Reciprocal", "abs": "Abs", "pow": "Pow",
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "where": "Where", "bitwise_not": "Not",
    "logical_not": "Not", "bitwise_and": "And", "logical_and": "And", "bitwise_or": "Or",
    "logical_or": "Or", "eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater",
    "ge": "GreaterOrEqual", "clamp": "Clip", "maximum": "Max", "minimum": "Min",
    "mm": "MatMul", "bmm": "MatMul", "matmul": "MatMul", "addmm": "Gemm",
    "view": "Reshape", "_unsafe_view": "Reshape", "reshape": "Reshape", "squeeze": "Squeeze",
    "unsqueeze": "Unsqueeze", "alias": "Identity", "clone": "Identity", "permute": "Transpose",
    "transpose": "Transpose", "t": "Transpose", "expand": "Expand", "split_with_sizes": "Split",
    "split": "Split", "slice": "Slice", "cat": "Concat", "embedding": "Gather",
    "_softmax": "Softmax", "_log_softmax": "LogSoftmax", "native_layer_norm": "LayerNormalization",
    "_to_copy": "Cast", "sum": "ReduceSum", "mean": "ReduceMean", "amax": "ReduceMax",
}

# Positional arguments that are attributes rules constrain, by ONNX name.
ATTRIBUTE_ARGS = {"_softmax": {1: "axis"}, "_log_softmax": {1: "axis"}}

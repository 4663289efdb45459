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

# Positional arguments that are operands, even when the model passes a Python number (`x / 8.0`,
# `torch.where(m, x, 0.0)`): the importer makes such a number a constant value at that position,
# so ATen's scalar overloads read like ONNX's tensor operands.
SCALAR_OPERANDS = {
    "add": (0, 1), "sub": (0, 1), "rsub": (0, 1), "mul": (0, 1), "div": (0, 1), "pow": (0, 1),
    "where": (1, 2), "eq": (0, 1), "ne": (0, 1), "lt": (0, 1), "le": (0, 1), "gt": (0, 1), "ge": (0, 1),
    "maximum": (0, 1), "minimum": (0, 1), "clamp": (1, 2), "clamp_min": (1,), "clamp_max": (1,),
    "fmod": (1,), "remainder": (1,), "masked_fill": (2,), "bitwise_and": (1,), "bitwise_or": (1,),
    "bitwise_xor": (1,), "atan2": (0, 1), "floor_divide": (1,),
}

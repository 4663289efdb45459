"""ATen ops -> the IR's op vocabulary (ONNX operator names).

Where an ONNX operator computes the same thing, the node gets its name so one rule
matches both backends; the ATen spelling stays in `Node.native_op` (`aten::gelu`),
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
    "isnan": "IsNaN", "isinf": "IsInf",
    "_to_copy": "Cast", "sum": "ReduceSum", "mean": "ReduceMean", "amax": "ReduceMax", "amin": "ReduceMin",
    # Random ops: ONNX's names, which std.ops declares nondeterministic. native_dropout(x, p, train)
    # is ONNX's Dropout(x, ratio, training_mode), (y, mask) both; the importer makes it Dropout only
    # in training mode, and folds Inductor's decomposition of it (rand, gt, mul, mul) back into one.
    "native_dropout": "Dropout", "rand": "RandomUniform", "rand_like": "RandomUniformLike",
    "randn": "RandomNormal", "randn_like": "RandomNormalLike", "bernoulli": "Bernoulli",
}

# Positional arguments that are attributes, by ONNX name: the IR spells an attribute one way
# whichever exporter made the graph, and the engine never reads ATen argument positions.
ATTRIBUTE_ARGS = {
    "_softmax": {1: "axis"}, "_log_softmax": {1: "axis"}, "gather": {1: "axis"}, "scatter": {1: "axis"},
    "scatter_add": {1: "axis"},
    "permute": {1: "perm"}, "sum": {1: "axes", 2: "keepdims"}, "mean": {1: "axes", 2: "keepdims"},
    "amax": {1: "axes", 2: "keepdims"}, "amin": {1: "axes", 2: "keepdims"}, "any": {1: "axes", 2: "keepdims"},
    "all": {1: "axes", 2: "keepdims"}, "unsqueeze": {1: "axes"},
    "squeeze": {1: "axes"}, "full": {0: "shape", 1: "value"}, "scalar_tensor": {0: "value"},
    "full_like": {1: "value"}, "native_dropout": {2: "training_mode"},
    "slice": {1: "axes", 2: "starts", 3: "ends", 4: "steps"},
    "slice_scatter": {2: "axes", 3: "starts", 4: "ends", 5: "steps"},
    "_scaled_dot_product_flash_attention_for_cpu": {3: "dropout_p", 4: "is_causal"},
    "_scaled_dot_product_flash_attention": {3: "dropout_p", 4: "is_causal", 5: "return_debug_mask"},
    "_scaled_dot_product_efficient_attention": {4: "compute_log_sumexp", 5: "dropout_p", 6: "is_causal"},
    "_scaled_dot_product_cudnn_attention": {4: "compute_log_sumexp", 5: "dropout_p", 6: "is_causal",
                                            7: "return_debug_mask"},
}
# ATen defaults the IR writes out, so a rule can require them (`dropout_p=0.0`: a fused attention
# kernel that draws no random numbers, which recomputing it would not reproduce).
EXPLICIT_DEFAULTS = {op: {"dropout_p": 0.0, "is_causal": False} for op in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")}
KEYWORD_ATTRIBUTES = {"keepdim": "keepdims", "dim": "axes"}
# Ops whose every element is one number: the canonical attribute that holds it, or the number
# (the importer sets Value.filled, so the engine knows a gradient's zeros without ATen's arguments).
FILLS = {"full": "value", "scalar_tensor": "value", "full_like": "value", "new_full": "fill_value",
         "zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0, "ones": 1.0, "ones_like": 1.0, "new_ones": 1.0}


def canonical_attributes(base: str, attrs: dict, rank: int | None) -> dict:
    """ATen's argument conventions in ONNX's: `axes` a list (or absent for every axis),
    `keepdims` 0 or 1 and explicit (ATen keeps no dims by default, ONNX does), `perm` for every
    transpose. `rank` is that of the first tensor input, where a convention needs it."""
    out = {KEYWORD_ATTRIBUTES.get(k, k) if base in REDUCTIONS | {"squeeze", "unsqueeze"} else k: v
           for k, v in attrs.items()}
    if base in REDUCTIONS:
        axes = out.get("axes")
        out["axes"] = None if axes is None or axes == [] else [int(a) for a in _as_list(axes)]
        if out["axes"] is None:
            del out["axes"]
        out["keepdims"] = int(bool(out.get("keepdims", False)))
    elif base in ("squeeze", "unsqueeze") and "axes" in out:
        out["axes"] = [int(a) for a in _as_list(out["axes"])]
    elif base == "transpose" and rank is not None and "arg1" in out and "arg2" in out:
        a, b = (int(out.pop(k)) % max(rank, 1) for k in ("arg1", "arg2"))
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
        out["perm"] = perm
    elif base == "t" and rank is not None:
        out["perm"] = list(range(rank))[::-1]
    elif base in ("slice", "slice_scatter"):
        # ONNX Slice's parameters, as lists: one axis, from 0 to the end unless given
        # (keyword arguments by ATen's names; a symbolic bound stays as it is)
        given = {key: out.pop(aten, out.get(key)) for key, aten in _SLICE_NAMES}
        out.update({key: [int(v) if isinstance(v, int) else v]
                    for key, v in ((k, SLICE_DEFAULTS[k] if given[k] is None else given[k]) for k in SLICE_DEFAULTS)})
    elif base == "permute" and "perm" in out:
        out["perm"] = [int(p) for p in out["perm"]]
    for key, default in EXPLICIT_DEFAULTS.get(base, {}).items():
        out[key] = type(default)(out.get(key, default))
    return out


# Reductions: ONNX's conventions for their `axes` and `keepdims`. ATen's any and all (a row fully
# masked: `_safe_softmax` in SDPA's math path) keep their names; ONNX has no boolean reduction.
REDUCTIONS = {"sum", "mean", "amax", "amin", "any", "all"}
_END = 2**63 - 1        # ATen's and ONNX's "to the end" of a slice
# A slice's parameters by their ONNX and ATen names, and ATen's defaults for them.
_SLICE_NAMES = (("axes", "dim"), ("starts", "start"), ("ends", "end"), ("steps", "step"))
SLICE_DEFAULTS = {"axes": 0, "starts": 0, "ends": _END, "steps": 1}


def slice_arguments(base: str, args: tuple, kwargs: dict) -> tuple:
    """(dim, start, end, step) of an ATen `slice` or `slice_scatter` call (`base`), by position
    or keyword, ATen's defaults where not given."""
    position = {name: k for k, name in ATTRIBUTE_ARGS[base].items()}
    got = []
    for key, aten in _SLICE_NAMES:
        k = position[key]
        v = args[k] if len(args) > k else kwargs.get(aten)
        got.append(SLICE_DEFAULTS[key] if v is None else v)
    return tuple(got)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]

# Positional arguments that are operands, even when the model passes a Python number (`x / 8.0`,
# `torch.where(m, x, 0.0)`): the importer makes such a number a constant value at that position,
# so ATen's scalar overloads read like ONNX's tensor operands.
# ATen operand orders that differ from their ONNX twin's, as the ONNX op's inputs by ATen position:
# addmm(c, a, b) is Gemm(a, b, c), so a rule's `Gemm(h, w, rest...)` binds the same values on
# both backends (the fx backend copies its own nodes, never these inputs, when it rewrites).
OPERAND_ORDER = {"addmm": (1, 2, 0)}

SCALAR_OPERANDS = {
    "add": (0, 1), "sub": (0, 1), "rsub": (0, 1), "mul": (0, 1), "div": (0, 1), "pow": (0, 1),
    "where": (1, 2), "eq": (0, 1), "ne": (0, 1), "lt": (0, 1), "le": (0, 1), "gt": (0, 1), "ge": (0, 1),
    "maximum": (0, 1), "minimum": (0, 1), "clamp": (1, 2), "clamp_min": (1,), "clamp_max": (1,),
    "fmod": (1,), "remainder": (1,), "masked_fill": (2,), "bitwise_and": (1,), "bitwise_or": (1,),
    "bitwise_xor": (1,), "atan2": (0, 1), "floor_divide": (1,), "native_dropout": (1,),
}

"""ONNX TensorProto element types <-> the IR's DType."""
from __future__ import annotations

from onnx import TensorProto

from engine.dtypes import DType

_TO_IR = {
    TensorProto.FLOAT: DType.FLOAT32, TensorProto.FLOAT16: DType.FLOAT16,
    TensorProto.BFLOAT16: DType.BFLOAT16, TensorProto.DOUBLE: DType.FLOAT64,
    TensorProto.INT8: DType.INT8, TensorProto.INT16: DType.INT16, TensorProto.INT32: DType.INT32,
    TensorProto.INT64: DType.INT64, TensorProto.UINT8: DType.UINT8, TensorProto.BOOL: DType.BOOL,
    TensorProto.FLOAT8E4M3FN: DType.FLOAT8E4M3, TensorProto.FLOAT8E5M2: DType.FLOAT8E5M2,
    TensorProto.COMPLEX64: DType.COMPLEX64, TensorProto.COMPLEX128: DType.COMPLEX128,
}
_TO_ONNX = {v: k for k, v in _TO_IR.items()}

def to_ir(elem_type: int) -> DType:
    return _TO_IR.get(elem_type, DType.UNKNOWN)


def to_onnx(dtype: DType) -> int:
    return _TO_ONNX.get(dtype, TensorProto.UNDEFINED)

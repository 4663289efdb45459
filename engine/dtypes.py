"""Element types, named as ONNX names them (the IR's lingua franca)."""
from __future__ import annotations

from enum import Enum


class DType(Enum):
    FLOAT32 = ("float32", 4)
    FLOAT16 = ("float16", 2)
    BFLOAT16 = ("bfloat16", 2)
    FLOAT64 = ("float64", 8)
    INT8 = ("int8", 1)
    INT16 = ("int16", 2)
    INT32 = ("int32", 4)
    INT64 = ("int64", 8)
    UINT8 = ("uint8", 1)
    BOOL = ("bool", 1)
    FLOAT8E4M3 = ("float8e4m3", 1)
    FLOAT8E5M2 = ("float8e5m2", 1)
    # A (real, imaginary) pair: rotary positions in complex numbers (Meta's Llama code, Llama 4).
    COMPLEX64 = ("complex64", 8)
    COMPLEX128 = ("complex128", 16)
    UNKNOWN = ("unknown", 0)

    @property
    def type_name(self) -> str:
        return self.value[0]

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def accumulates_in(self) -> "DType":
        """The type partial sums of this type add up in (a chunk region's weight gradient, summed
        slice by slice): float32 for a 16-bit float, whose sums rounded at every slice drift
        where the unchunked op sums in float32 inside one kernel; its own otherwise."""
        return DType.FLOAT32 if self in (DType.FLOAT16, DType.BFLOAT16) else self

    def __str__(self) -> str:
        return self.type_name

    @classmethod
    def from_name(cls, name: str) -> "DType":
        """Accepts the IR names and the common aliases (`float`, `half`, `double`, `long`)."""
        key = _ALIASES.get(name.lower(), name.lower())
        for member in cls:
            if member.type_name == key:
                return member
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(dtype_names())}")


_ALIASES = {
    "float": "float32", "fp32": "float32", "f32": "float32",
    "half": "float16", "fp16": "float16", "f16": "float16",
    "bf16": "bfloat16", "double": "float64", "fp64": "float64",
    "long": "int64", "int": "int32",
}


def dtype_names() -> list[str]:
    return [d.type_name for d in DType if d is not DType.UNKNOWN]

"""Op signatures: how many outputs an op has and which attributes it takes, and of which type.

They come from ONNX's schemas (onnx.defs, imported on first use) or from a custom op's
declaration, `op com.example::MyOp outputs 1 attrs alpha: float`. A rule whose attribute
constraint or bound output no signature allows could never match: the compiler refuses it.
Ops with no signature (aten::*, com.microsoft::*) accept anything.

An op's ONNX signature is the union of every version of its schema: a model of an older opset
carries the attributes later opsets turned into inputs (Split's `split`, Squeeze's and
ReduceSum's `axes` before opset 13, Dropout's `ratio`, Clip's `min`), and a rule can match it.
So an attribute is accepted when any version had it, with any type some version gave it
(Cast's `to` was a string in opset 1), and the outputs a statement may bind are the widest
range over the versions (BatchNormalization had 5 outputs before opset 9, 3 after).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from engine.dtypes import DType
from engine.errors import SourceLocation
from engine.onnx_ops import DTYPE_ATTRIBUTES

from . import ast
from .errors import did_you_mean

Report = Callable[[str, SourceLocation, str], None]     # message, where, hint

# Attribute kinds a declared signature may name; "other" stands for ONNX attribute types a rule
# cannot write (tensors, graphs, type protos).
ATTR_KINDS = ("int", "float", "string", "ints", "floats", "strings", "dtype")

_DESCRIBE = {
    "int": "an int", "float": "a float", "string": "a string", "ints": "a list of ints",
    "floats": "a list of floats", "strings": "a list of strings",
    "dtype": "a data type (a dtype name such as float32)",
    "other": "a tensor, graph or type, which a rule cannot constrain",
}


@dataclass(frozen=True)
class Signature:
    outputs: tuple[int, int | None]          # min, max (None: any number, a variadic output)
    attrs: dict[str, tuple[str, ...]] | None  # name -> its kinds (several: versions differ); None: unchecked
    origin: str                              # "the ONNX schema" or "the declaration at file:line:col"


def describe_kind(kind: str) -> str:
    return _DESCRIBE.get(kind, kind)


def describe_value(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, DType):
        return "a data type"
    if isinstance(value, int):
        return "an int"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        kinds = sorted({describe_value(v).split(" ", 1)[1] for v in value})
        return f"a list of {' and '.join(kinds)}s" if kinds else "an empty list"
    return type(value).__name__


def accepts(kind: str, value: Any) -> bool:
    """Whether an attribute of `kind` can ever equal `value` as the matcher compares them."""
    if kind in ("ints", "floats", "strings"):
        return isinstance(value, list) and all(accepts(kind[:-1], v) for v in value)
    if isinstance(value, list):
        return False
    if kind == "int":
        return (isinstance(value, (bool, int)) or
                (isinstance(value, float) and value.is_integer()))
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "dtype":
        return isinstance(value, DType)
    return False


@lru_cache(maxsize=1)
def _onnx_schemas() -> dict[tuple[str, str], list[Any]]:
    """Every version of every ONNX schema, by (domain, op name); empty without onnx."""
    try:
        from onnx import defs
    except ImportError:        # pragma: no cover - onnx is a dependency; without it, no checks
        return {}
    out: dict[tuple[str, str], list[Any]] = {}
    for schema in defs.get_all_schemas_with_history():
        out.setdefault((schema.domain, schema.name), []).append(schema)
    return out


@lru_cache(maxsize=None)
def onnx_signature(op: str) -> Signature | None:
    """The signature of `op` ("Relu", "ai.onnx.ml::LabelEncoder") over every version of its
    ONNX schema (see the module docstring), or None when ONNX has no such op."""
    domain, sep, name = op.rpartition("::")
    if not sep or domain == "ai.onnx":
        domain = ""
    versions = _onnx_schemas().get((domain, name))
    if not versions:
        return None
    from onnx import defs

    types = defs.OpSchema.AttrType
    kinds = {types.INT: "int", types.FLOAT: "float", types.STRING: "string", types.INTS: "ints",
             types.FLOATS: "floats", types.STRINGS: "strings"}
    attrs: dict[str, set[str]] = {}
    low, high = None, 0
    for schema in versions:
        for attr_name, attr in schema.attributes.items():
            kind = kinds.get(attr.type, "other")
            if kind == "int" and not domain and (name, attr_name) in DTYPE_ATTRIBUTES:
                kind = "dtype"
            attrs.setdefault(attr_name, set()).add(kind)
        variadic = (bool(schema.outputs)
                    and schema.outputs[-1].option == defs.OpSchema.FormalParameterOption.Variadic)
        most = None if variadic or schema.max_output >= 2**31 - 1 else schema.max_output
        low = schema.min_output if low is None else min(low, schema.min_output)
        high = None if high is None or most is None else max(high, most)
    return Signature((low, high), {a: tuple(sorted(k)) for a, k in attrs.items()}, "the ONNX schema")


def op_name(name: str) -> str:
    """`ai.onnx::Relu` is `Relu`."""
    domain, sep, op = name.rpartition("::")
    return op if sep and domain in ("", "ai.onnx") else name


def declare_signature(decl: ast.OpDecl, signatures: dict[str, tuple[Signature, SourceLocation]],
                      error: Report) -> None:
    """`op domain::Name outputs 1..2 attrs alpha: float`: record the signature of each op named,
    which rules are then checked against as against an ONNX schema."""
    sig = decl.signature
    attrs: dict[str, tuple[str, ...]] | None = None
    if sig.attrs is not None:
        attrs = {}
        for a in sig.attrs:
            if a.kind not in ATTR_KINDS:
                error(f"unknown attribute type {a.kind!r}", a.kind_loc,
                      did_you_mean(a.kind, set(ATTR_KINDS)) or f"the types are: {', '.join(ATTR_KINDS)}")
            elif a.name in attrs:
                error(f"attribute {a.name!r} is declared twice", a.loc, "")
            else:
                attrs[a.name] = (a.kind,)
    signature = Signature(sig.outputs or (1, None), attrs, f"the declaration at {sig.loc}")
    for ref in decl.ops:
        name = op_name(ref.name)
        if name in signatures:
            error(f"the signature of {name!r} is declared twice (first at {signatures[name][1]})", sig.loc, "")
        elif onnx_signature(name) is not None:
            error(f"{name!r} has an ONNX schema; a rule file cannot declare another signature for it",
                  ref.loc, "")
        else:
            signatures[name] = (signature, sig.loc)


def check_signatures(sigs: dict[str, Signature | None], constrained: list[tuple[ast.Arg, Any]],
                     targets: list[ast.Target], error: Report) -> None:
    """Attribute constraints (`constrained`: the argument and its value, None when the value was
    already refused) and bound outputs that no alternative's signature allows. An op with no
    signature (aten::*, an undeclared custom op) allows anything, so then nothing is refused."""
    if any(s is None for s in sigs.values()):
        return
    for arg, value in constrained:
        having = {op: s for op, s in sigs.items() if s.attrs is None or arg.name in s.attrs}
        if not having:
            names = set().union(*(s.attrs for s in sigs.values()))
            listed = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
            error(_no_attribute(sigs, arg.name), arg.loc,
                  did_you_mean(arg.name, names) or (f"its attributes are: {listed}" if names else
                                                    "it has no attributes"))
            continue
        if value is None or any(s.attrs is None or any(accepts(k, value) for k in s.attrs[arg.name])
                                for s in having.values()):
            continue
        kinds = sorted({k for s in having.values() for k in s.attrs[arg.name]})
        error(f"attribute {arg.name!r} of {_ops_text(having)} takes "
              f"{' or '.join(describe_kind(k) for k in kinds)}, not {describe_value(value)}",
              arg.value.loc, _attr_hint(kinds, value))
    most = [s.outputs[1] for s in sigs.values()]
    if targets and None not in most and len(targets) > max(most):
        n = max(most)
        at_most = "has" if len(sigs) == 1 else "have at most"
        error(f"{_ops_text(sigs)} {at_most} {n} output{'s' if n != 1 else ''}, but the statement "
              f"binds {len(targets)}", targets[n].loc,
              f"bind at most {n}: `{', '.join(t.name or '_' for t in targets[:n])} = ...`")


def _ops_text(ops: dict[str, Any]) -> str:
    """`Softmax`, `LogSoftmax|Softmax`, or `Celu|Elu|Gelu|... (12 ops)`."""
    names = sorted(ops)
    return "|".join(names) if len(names) <= 4 else f"{'|'.join(names[:3])}|... ({len(names)} ops)"


def _no_attribute(ops: dict[str, Any], name: str) -> str:
    if len(ops) == 1:
        return f"{_ops_text(ops)} has no attribute {name!r}"
    return f"none of {_ops_text(ops)} has an attribute {name!r}"


def _attr_hint(kinds: list[str], value: Any) -> str:
    if "dtype" in kinds and not isinstance(value, DType):
        return "write a dtype name, such as float32 or float16"
    if isinstance(value, DType):
        return "a dtype name stands for a data type only where the attribute holds one (Cast's `to`)"
    if any(k in ("ints", "floats", "strings") for k in kinds) and not isinstance(value, list):
        return "write a list, such as [1, 2]"
    return ""

"""The rule language's AST. Every node keeps its SourceLocation (file:line:col)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import SourceLocation


@dataclass
class OpRef:
    name: str
    loc: SourceLocation


@dataclass
class Use:
    module: str
    loc: SourceLocation


@dataclass
class FamilyDecl:
    name: str
    ops: list[OpRef]
    loc: SourceLocation


@dataclass
class AttrSig:
    """`alpha: float` in a custom op's signature."""

    name: str
    kind: str
    loc: SourceLocation
    kind_loc: SourceLocation


@dataclass
class OpSignature:
    """`outputs 1..2 attrs alpha: float, mode: string` after `op domain::Name`. A clause
    left out leaves that part unchecked; `attrs` with no names declares no attributes."""

    loc: SourceLocation
    outputs: tuple[int, int | None] | None = None       # min, max (None: no upper bound)
    outputs_loc: SourceLocation | None = None
    attrs: list[AttrSig] | None = None


@dataclass
class OpDecl:
    """`op`, `recomputable`, `view`, `nondeterministic`, `chunkable KIND`,
    `linear_in_gradient` or `additive_in_gradient` followed by ops."""

    kind: str
    ops: list[OpRef]
    loc: SourceLocation
    tier: str | None = None
    detail: tuple[str, SourceLocation] | None = None    # the KIND of `chunkable KIND`
    signature: OpSignature | None = None                # `op ... outputs N attrs ...`


@dataclass
class Target:
    name: str | None           # None for `_`
    loc: SourceLocation


@dataclass
class AttrValue:
    kind: str                  # number | string | name | list
    value: Any
    loc: SourceLocation


@dataclass
class Arg:
    kind: str                  # capture | wildcard | variadic | attr | nested
    loc: SourceLocation
    name: str | None = None
    value: "AttrValue | NodePat | None" = None


@dataclass
class NodePat:
    ops: list[OpRef]
    args: list[Arg]
    commutative: bool
    loc: SourceLocation
    text: str = ""


@dataclass
class Binding:
    targets: list[Target]
    pattern: NodePat
    loc: SourceLocation
    text: str = ""


@dataclass
class Dim:
    kind: str                  # int | name | any | rest
    value: int | str | None
    loc: SourceLocation


@dataclass
class TypeAnnot:
    name: str
    dtypes: list[tuple[str, SourceLocation]]
    dims: list[Dim] | None
    loc: SourceLocation
    text: str = ""


@dataclass
class Expr:
    kind: str                  # number | string | name | call | binop | not | neg
    loc: SourceLocation
    value: Any = None          # number, string, name, operator or function name
    args: list["Expr"] = field(default_factory=list)
    unit: tuple[str, SourceLocation] | None = None
    text: str = ""
    span: tuple[int, int] = (0, 0)       # offsets of `text` in the file


@dataclass
class Require:
    expr: Expr
    loc: SourceLocation
    text: str = ""


@dataclass
class RecomputeAction:
    target: tuple[str, SourceLocation]
    sources: list[tuple[str, SourceLocation]]
    loc: SourceLocation


@dataclass
class SaveAction:
    names: list[tuple[str, SourceLocation]]
    loc: SourceLocation


@dataclass
class ChunkAction:
    names: list[tuple[str, SourceLocation]]
    dim: int
    count: Expr
    loc: SourceLocation
    dim_loc: SourceLocation | None = None


@dataclass
class CostDecl:
    """`cost y = MatMul(a, b) flops 2 * numel(y) * dim(a, -1) bytes ...`: what an op costs, from
    its values. `pattern` is parsed as a match pattern; the compiler takes captures, `_` and a
    variadic tail only."""

    targets: list[Target]
    pattern: NodePat
    flops: Expr
    bytes: Expr | None
    loc: SourceLocation
    text: str = ""


@dataclass
class TemplateArg:
    kind: str                  # capture | literal | nested | attr
    loc: SourceLocation
    name: str | None = None    # the capture, or the attribute's name
    value: Any = None          # the literal, the nested TemplateCall, or the attribute's AttrValue


@dataclass
class TemplateCall:
    """An op applied in a replay's template: `CastLike(mask, x)`."""

    op: OpRef
    args: list[TemplateArg]
    loc: SourceLocation


@dataclass
class ReplayDecl:
    """`replay y, mask = Dropout(x, ratio, _) as TEMPLATE`: a nondeterministic op recomputed from
    the random values an output keeps. `pattern` is parsed as a match pattern; the compiler takes
    captures and `_` only."""

    targets: list[Target]
    pattern: NodePat
    template: TemplateCall
    loc: SourceLocation
    text: str = ""


@dataclass
class RuleDecl:
    name: str
    loc: SourceLocation
    priority: int = 0
    tier: str | None = None
    bindings: list[Binding] = field(default_factory=list)
    types: list[TypeAnnot] = field(default_factory=list)
    requires: list[Require] = field(default_factory=list)
    actions: list[Any] = field(default_factory=list)


@dataclass
class RuleFile:
    path: str
    uses: list[Use] = field(default_factory=list)
    families: list[FamilyDecl] = field(default_factory=list)
    op_decls: list[OpDecl] = field(default_factory=list)
    costs: list[CostDecl] = field(default_factory=list)
    replays: list[ReplayDecl] = field(default_factory=list)
    rules: list[RuleDecl] = field(default_factory=list)

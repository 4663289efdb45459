"""Compiled rules: what the DSL produces and the matcher runs.

Language-neutral dataclasses. A rule's pattern is a tree of NodePatterns rooted
at one node; arguments refer to captures, wildcards or nested patterns. The
rule set indexes rules by the op names their root accepts, so a node whose op
no rule roots at costs one dict lookup (the tinygrad/UPat idea).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import DType
from .errors import RuleError, SourceLocation
from .plan_type import PlanType

DEFAULT_TIER = "default"

# The matcher and the guard evaluator recurse over patterns and expressions; a Rule refuses
# deeper ones (the rule compiler reports them first, with positions: dsl/limits.py).
MAX_PATTERN_DEPTH = 64
MAX_EXPR_DEPTH = 256


@dataclass(frozen=True)
class Wildcard:
    location: SourceLocation


@dataclass(frozen=True)
class CaptureRef:
    name: str
    location: SourceLocation


@dataclass
class NodePattern:
    """One op in a pattern: `y = Gelu|FastGelu(x, approximate="none")`."""

    ops: frozenset[str]
    args: list["Arg"]
    attrs: dict[str, Any]
    outputs: list[str | None]           # capture names of the node's outputs; None = not captured
    location: SourceLocation
    commutative: bool = False
    variadic: str | None = None          # capture bound to the remaining inputs
    text: str = ""                       # the source text, for explanations

    def accepts(self, op: str, native: str | None = None) -> bool:
        return op in self.ops or (native is not None and native in self.ops)


@dataclass(frozen=True)
class OutputRef:
    """An input that must be output `output` (> 0) of a node matching `pattern`."""

    pattern: NodePattern
    output: int
    location: SourceLocation


Arg = Wildcard | CaptureRef | NodePattern | OutputRef


@dataclass(frozen=True)
class DimPattern:
    kind: str                 # "int" | "name" | "any" | "rest"
    value: int | str | None = None


@dataclass
class TypePattern:
    """`x : float16|bfloat16[B, _, 4096]`."""

    capture: str
    dtypes: frozenset[DType] | None
    dims: list[DimPattern] | None
    location: SourceLocation
    text: str = ""


@dataclass
class Expr:
    """A guard expression tree: kind in num, bool, str, dtype, ref, call, binop, not, neg."""

    kind: str
    location: SourceLocation
    value: Any = None
    args: list["Expr"] = field(default_factory=list)
    text: str = ""


def expr_depth(expr: Expr) -> int:
    """The depth of an expression tree (a leaf is 1), measured with an explicit stack."""
    deepest, stack = 0, [(expr, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((a, depth + 1) for a in node.args)
    return deepest


def pattern_depth(root: "NodePattern") -> int:
    """Ops nested in ops, through nested patterns and captured outputs (an explicit stack; a
    pattern several inputs share is measured once)."""
    depth: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[NodePattern, bool]] = [(root, False)]
    while stack:
        pat, children_done = stack.pop()
        inputs = [a if isinstance(a, NodePattern) else a.pattern
                  for a in pat.args if isinstance(a, (NodePattern, OutputRef))]
        if children_done:
            open_.discard(id(pat))
            depth[id(pat)] = 1 + max((depth.get(id(p), 0) for p in inputs), default=0)
        elif id(pat) not in depth and id(pat) not in open_:
            open_.add(id(pat))
            stack.append((pat, True))
            stack.extend((p, False) for p in inputs)
    return depth[id(root)]


def _check_depth(expr: Expr, location: SourceLocation) -> None:
    if expr_depth(expr) > MAX_EXPR_DEPTH:
        raise RuleError(f"expression nested too deeply (limit {MAX_EXPR_DEPTH})", location)


@dataclass
class Guard:
    expr: Expr
    location: SourceLocation
    text: str

    def __post_init__(self) -> None:
        _check_depth(self.expr, self.location)


@dataclass
class Recompute:
    """`recompute y` (type 1) or `recompute y from x` with x a new, smaller stash (type 2)."""

    target: str
    sources: list[str]
    location: SourceLocation


@dataclass
class Save:
    captures: list[str]
    location: SourceLocation


@dataclass
class Chunk:
    """`chunk over a, b along DIM into COUNT`: run the region that grows from the `over`
    values in COUNT slices of them along DIM (engine.strategies.chunk)."""

    captures: list[str]
    dim: int
    count: "Expr"
    location: SourceLocation

    def __post_init__(self) -> None:
        _check_depth(self.count, self.location)


Action = Recompute | Save | Chunk


@dataclass
class Rule:
    name: str
    root: NodePattern
    types: list[TypePattern]
    guards: list[Guard]
    actions: list[Action]
    location: SourceLocation
    priority: int = 0
    tier: str = DEFAULT_TIER
    order: int = 0                  # position among all rules, for deterministic tie-breaks

    def __post_init__(self) -> None:
        if pattern_depth(self.root) > MAX_PATTERN_DEPTH:
            raise RuleError(f"pattern nested too deeply (limit {MAX_PATTERN_DEPTH})", self.location)

    @property
    def plan_type(self) -> PlanType:
        """Recompute, recompute with compromise (a new stash), or chunk, by the rule's actions."""
        if any(isinstance(a, Chunk) for a in self.actions):
            return PlanType.CHUNK
        for a in self.actions:
            if isinstance(a, Save) or (isinstance(a, Recompute) and a.sources):
                return PlanType.RECOMPUTE_WITH_COMPROMISE
        return PlanType.RECOMPUTE

    def node_patterns(self) -> Iterable[NodePattern]:
        """Each pattern of the rule once (a statement several inputs read is one shared pattern)."""
        seen = {id(self.root)}
        stack = [self.root]
        while stack:
            pat = stack.pop()
            yield pat
            for a in pat.args:
                if isinstance(a, (NodePattern, OutputRef)):
                    child = a if isinstance(a, NodePattern) else a.pattern
                    if id(child) not in seen:
                        seen.add(id(child))
                        stack.append(child)


@dataclass(eq=False)
class CostFormula:
    """`cost y = MatMul(a, b) flops 2 * numel(y) * dim(a, -1) [bytes EXPR]`: what one op costs,
    computed from its own values (engine.op_cost evaluates it). `outputs` and `inputs` name the
    node's outputs and inputs by position (None: `_`); `variadic` takes the inputs after them.
    Without `bytes`, the op moves the bytes of every input and output. `file_order`: the place of
    the declaring file in load order (a later file's declaration overrides an earlier one's)."""

    ops: frozenset[str]
    outputs: tuple[str | None, ...]
    inputs: tuple[str | None, ...]
    variadic: str | None
    flops: Expr
    bytes: Expr | None
    location: SourceLocation
    text: str = ""
    file_order: int = 0

    def __post_init__(self) -> None:
        _check_depth(self.flops, self.location)
        if self.bytes is not None:
            _check_depth(self.bytes, self.location)


@dataclass(frozen=True)
class TemplateCall:
    """An op a replay's template applies: its arguments are capture names (str), number literals
    (int, float) and nested calls; `attrs` as (name, value) pairs."""

    op: str
    args: tuple["str | int | float | TemplateCall", ...]
    attrs: tuple[tuple[str, Any], ...]
    location: SourceLocation


@dataclass(eq=False)
class Replay:
    """`replay y, mask = Dropout(x, ratio, _) as TEMPLATE`: a nondeterministic op run again from
    the random values its `saved` outputs keep. `outputs` and `inputs` name the node's outputs and
    inputs by position (None: `_`); the template computes output `replayed` from them
    (engine.strategies.replay). `file_order` as for CostFormula."""

    ops: frozenset[str]
    outputs: tuple[str | None, ...]
    inputs: tuple[str | None, ...]
    template: TemplateCall
    replayed: int
    saved: tuple[int, ...]
    location: SourceLocation
    text: str = ""
    file_order: int = 0


@dataclass
class RuleSet:
    """Rules plus the op facts the rule files declare (which ops are views, recomputable, random,
    how chunking carries dims through them, what they cost)."""

    rules: list[Rule] = field(default_factory=list)
    recomputable: dict[str, str] = field(default_factory=dict)   # op -> tier
    views: frozenset[str] = frozenset()
    nondeterministic: frozenset[str] = frozenset()
    sources: list[str] = field(default_factory=list)             # files, for reports and cache keys
    digest: str = ""                                             # content hash of the rule sources
    chunkable: dict[str, str] = field(default_factory=dict)      # op -> how chunk dims propagate
    linear_in_gradient: frozenset[str] = frozenset()
    additive_in_gradient: frozenset[str] = frozenset()
    # op -> its cost formula, for every name a `cost` declaration resolves to (backend spellings
    # such as aten::addmm included); engine.op_cost.node_cost picks a node's
    costs: dict[str, CostFormula] = field(default_factory=dict)
    # op -> how it replays its random values (a nondeterministic op without one is not recomputed)
    replays: dict[str, Replay] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index: dict[str, list[Rule]] | None = None

    def by_root_op(self) -> dict[str, list[Rule]]:
        if self._index is None:
            index: dict[str, list[Rule]] = {}
            for rule in sorted(self.rules, key=lambda r: (-r.priority, r.order)):
                for op in rule.root.ops:
                    index.setdefault(op, []).append(rule)
            self._index = index
        return self._index

    def is_random(self, node) -> bool:
        """Whether the rule files declare `node`'s op (under its IR or its native name) nondeterministic."""
        return node.op in self.nondeterministic or (node.native_op or "") in self.nondeterministic

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def enabled(self, tiers: Iterable[str]) -> "RuleSet":
        """The rules and recomputable ops of the given tiers (the default tier is always on)."""
        allowed = {DEFAULT_TIER, *tiers}
        return replace(self, rules=[r for r in self.rules if r.tier in allowed],
                       recomputable={op: t for op, t in self.recomputable.items() if t in allowed})

    def of_types(self, types: Iterable[int]) -> "RuleSet":
        """The same facts with only the rules of the given plan types (3: chunk rules)."""
        wanted = set(types)
        return replace(self, rules=[r for r in self.rules if r.plan_type in wanted])

    def tiers(self) -> set[str]:
        return {r.tier for r in self.rules} | set(self.recomputable.values())

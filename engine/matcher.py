"""Matching compiled rules against a graph, and explaining why a rule did not fire.

Rules are indexed by the ops their root accepts; each node costs one dict
lookup unless some rule roots at its op. Matching walks from the root node up
through producers. Results come in schedule order, then rule priority order,
so they are deterministic.

A statement whose capture several inputs read (`a1 = Add(a0, a0)`, `a2 = Add(a1, a1)`) is
one pattern shared in the rule's pattern DAG; a pattern inside a commutative one is tried in
both orders of its operands. Both are matched once per (pattern, node) in one match attempt
(`_memo_arg`), never once per path to them, which would take exponential time.
"""
from __future__ import annotations

import copy
import math

from dataclasses import dataclass, field
from typing import Any

from .analysis import Analysis, analyze
from .collector import collector_paused
from .dtypes import DType
from .errors import SourceLocation
from .failures import PlanFailure, Site, check_injected, injection_active
from .guards import Unproven, decide, describe, evaluate_expr
from .ir import Graph, Node, Value
from .plan_type import PlanType
from .patterns import (CaptureRef, Expr, NodePattern, OutputRef, Rule, RuleSet, TypePattern,
                       Wildcard)
from .shapes import format_shape

_MISSING = object()


@dataclass(slots=True)
class Match:
    rule: Rule
    root: Node
    nodes: list[Node]
    bindings: dict[str, Any]

    def value(self, name: str) -> Value:
        return self.bindings[name]

    @property
    def site(self) -> Site:
        """The match's name in plan selections and failures: its rule at its root."""
        return Site(self.rule.name, self.root.name)


@dataclass
class Reason:
    """Why a rule did not match at a node: the rule's source position and what failed there."""

    location: SourceLocation
    message: str
    # A chunk region refused only because its sizes are symbolic (the graph serves every size)
    # where the backend builds slices at static sizes: at fixed sizes it would chunk.
    dynamic_sizes: bool = False
    # Of those, a region that needs two sizes equal (formulas) which are equal at the example
    # sizes but written with different symbols: a graph that says they are equal chunks.
    unproven_sizes: tuple[Any, Any] | None = None
    # A chunk rule's guard false at the example sizes and true at longer ones (Graph.open_dims):
    # planned at the size the graph was traced at, the graph runs longer inputs unchunked. The
    # open dims at their examples times `longer_from` are the shortest tried where it holds.
    longer_from: float | None = None
    # A region refused because its slices would be of a size over these dims (Graph.constrained_dims).
    constrained_dims: tuple[str, ...] = ()
    # A region refused because the step returns its every large value (a loss computed by the
    # graph's caller): those values, by name.
    returned_values: tuple[str, ...] = ()

    @property
    def longer_inputs(self) -> bool:
        return self.longer_from is not None

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class MatchContext:
    """What guards may ask about a graph. The analysis is computed on first use only."""

    def __init__(self, graph: Graph, rules: RuleSet, analysis: Analysis | None = None,
                 forward_outputs: list[str] | None = None, excluded: frozenset[Site] = frozenset(),
                 strict: bool = True):
        self.graph = graph
        self.excluded = excluded                  # sites dropped after an internal failure
        self.strict = strict                      # raise internal failures instead of collecting them
        self.failures: list[PlanFailure] = []     # internal failures at sites, collected when not strict
        # Chunk rules whose guards fail at the example sizes and hold at longer ones (longer_inputs)
        self.longer: list[tuple[Match, Reason]] = []
        self.rules = rules
        self._analysis = analysis
        self._forward_outputs = forward_outputs or graph.forward_outputs
        self._saved: dict[int, bool] = {}
        self.examples = graph.dim_examples
        # The chunk grower's index of the graph (engine.strategies.chunk.grow.GraphIndex), made by
        # the first chunk match and shared by the others.
        self.chunk_index = None

    def at(self, examples: dict[str, int]) -> "MatchContext":
        """This context at other example sizes (a guard tried at longer inputs), sharing what it
        knows of the graph."""
        other = copy.copy(self)
        other.examples = examples
        return other

    @property
    def analysis(self) -> Analysis:
        if self._analysis is None:
            self._analysis = analyze(self.graph, self._forward_outputs)
        return self._analysis

    def view_closure(self, value: Value) -> list[Value]:
        """`value` and the forward views of it (through ops the rules declare `view`)."""
        out, stack = [], [value]
        views = self.rules.views
        while stack:
            v = stack.pop()
            out.append(v)
            for user in v.users:
                if (user.op in views and user.inputs and user.inputs[0] is v
                        and self.analysis.is_forward(user)):
                    stack.extend(user.outputs)
        return out

    def is_available(self, value: Value) -> bool:
        a = self.analysis
        return (value.is_input or value.is_initializer or value.producer is None
                or a.is_stashed(value) or a.is_constant(value))

    def is_saved(self, value: Value) -> bool:
        key = id(value)
        if key not in self._saved:
            self._saved[key] = any(self.analysis.is_stashed(v) for v in self.view_closure(value))
        return self._saved[key]


class _Fail(Exception):
    def __init__(self, location: SourceLocation, message: str, longer_from: float | None = None):
        self.reason = Reason(location, message, longer_from=longer_from)

    @classmethod
    def again(cls, reason: Reason) -> "_Fail":
        """A new exception for a failure the memo recorded (not the same object raised twice,
        whose traceback would grow with each raise)."""
        err = cls.__new__(cls)
        err.reason = reason
        return err


def _bind(bindings: dict[str, Any], name: str, value: Any, loc: SourceLocation) -> None:
    have = bindings.get(name, _MISSING)
    if have is _MISSING:
        bindings[name] = value
    elif have is not value and not (isinstance(have, list) and isinstance(value, list)
                                     and len(have) == len(value)
                                     and all(a is b for a, b in zip(have, value))):
        raise _Fail(loc, f"capture {name!r} would be both %{_name(have)} and %{_name(value)}")


def _name(v: Any) -> str:
    return v.name if isinstance(v, Value) else str([x.name for x in v])


def _attr_equal(want: Any, have: Any) -> bool:
    if isinstance(want, DType) or isinstance(have, DType):
        return want == have
    if isinstance(want, list):
        return isinstance(have, (list, tuple)) and len(want) == len(have) and all(
            _attr_equal(w, h) for w, h in zip(want, have))
    if isinstance(want, float) or isinstance(have, float):
        try:
            return abs(float(want) - float(have)) <= 1e-6 * max(1.0, abs(float(want)))
        except (TypeError, ValueError):
            return False
    return want == have


def _compiled(pat: NodePattern):
    """The pattern's matcher, built once: arity, attributes and argument kinds are decided here,
    so matching a node is a few dict lookups and calls (the hot loop of `match`)."""
    fn = pat.__dict__.get("_matcher")
    if fn is None:
        fn = _compile_node(pat)
        pat.__dict__["_matcher"] = fn
    return fn


def _compile_node(pat: NodePattern):
    ops = pat.ops
    attrs = list(pat.attrs.items())
    outputs = [(i, name) for i, name in enumerate(pat.outputs) if name is not None]
    n_args = len(pat.args)
    variadic = pat.variadic
    commutative = pat.commutative
    arg_fns = [_compile_arg(a) for a in pat.args]
    apply_args = _args_applier([(k, fn) for k, (a, fn) in enumerate(zip(pat.args, arg_fns))
                                if not isinstance(a, Wildcard)])

    def fail_op(node: Node) -> _Fail:
        return _Fail(pat.location, f"`{pat.text}` needs op {'|'.join(sorted(ops))}, "
                                   f"found {node.op} ({node.name})")

    simple = (not attrs and variadic is None and not commutative and n_args <= 2
              and all(i == 0 for i, _ in outputs))
    out_name = outputs[0][1] if outputs else None

    def match_node(node: Node, bindings: dict[str, Any], matched: list[Node]) -> None:
        if node.op not in ops and node.native_op not in ops:
            raise fail_op(node)
        for key, want in attrs:
            have = node.attrs.get(key, _MISSING)
            if have is _MISSING:
                have = node.attr_defaults.get(key, _MISSING)
                if have is _MISSING:
                    raise _Fail(pat.location, f"`{pat.text}`: {node.name} has no attribute {key!r}")
            if have != want and not _attr_equal(want, have):
                raise _Fail(pat.location, f"`{pat.text}`: {node.name} has {key}={have}, not {want}")
        node_outputs = node.outputs
        for i, name in outputs:
            if i >= len(node_outputs):
                raise _Fail(pat.location, f"`{pat.text}`: {node.name} has {len(node_outputs)} output(s)")
            _bind(bindings, name, node_outputs[i], pat.location)
        matched.append(node)
        inputs = node.inputs
        if len(inputs) > n_args and inputs[-1] is None:
            inputs = list(inputs)
            while inputs and inputs[-1] is None and len(inputs) > n_args:
                inputs.pop()
        if variadic is not None:
            if len(inputs) < n_args:
                raise _Fail(pat.location, f"`{pat.text}`: {node.name} has {len(inputs)} inputs, "
                                          f"needs at least {n_args}")
            rest = list(inputs[n_args:])
            if any(v is None for v in rest):
                raise _Fail(pat.location, f"`{pat.text}`: {node.name} has a missing variadic input")
            _bind(bindings, variadic, rest, pat.location)
        elif len(inputs) != n_args:
            raise _Fail(pat.location, f"`{pat.text}`: {node.name} has {len(inputs)} input(s), "
                                      f"the pattern {n_args}")
        if not commutative:
            apply_args(inputs, bindings, matched)
            return
        first_error: _Fail | None = None
        operands = inputs[:n_args]
        orders = (operands,) if operands[0] is operands[1] else (operands, operands[::-1])
        for order in orders:
            trial, trial_nodes = dict(bindings), list(matched)
            try:
                for fn, value in zip(arg_fns, order):
                    fn(value, trial, trial_nodes)
            except _Fail as err:
                first_error = first_error or err
                continue
            bindings.clear()
            bindings.update(trial)
            matched[:] = trial_nodes
            return
        raise first_error  # type: ignore[misc]

    def match_simple(node: Node, bindings: dict[str, Any], matched: list[Node]) -> None:
        """match_node for the common case: fixed arity <= 2, no attributes, output 0 at most."""
        if node.op not in ops and node.native_op not in ops:
            raise fail_op(node)
        inputs = node.inputs
        if len(inputs) != n_args:
            match_node(node, bindings, matched)  # trailing missing inputs, or a mismatch to report
            return
        if out_name is not None:
            _bind(bindings, out_name, node.outputs[0], pat.location)
        matched.append(node)
        apply_args(inputs, bindings, matched)

    return match_simple if simple else match_node


def _args_applier(checked: list[tuple[int, Any]]):
    """Apply the argument matchers of a non-commutative pattern; unrolled for one and two."""
    if len(checked) == 2:
        (i0, f0), (i1, f1) = checked

        def two(inputs, bindings, matched):
            f0(inputs[i0], bindings, matched)
            f1(inputs[i1], bindings, matched)

        return two
    if len(checked) == 1:
        (i0, f0), = checked
        return lambda inputs, bindings, matched: f0(inputs[i0], bindings, matched)

    def many(inputs, bindings, matched):
        for k, fn in checked:
            fn(inputs[k], bindings, matched)

    return many


def _compile_arg(arg: Any):
    if isinstance(arg, Wildcard):
        return lambda value, bindings, matched: None
    if isinstance(arg, CaptureRef):
        name, loc = arg.name, arg.location

        def capture(value: Value | None, bindings: dict[str, Any], matched: list[Node]) -> None:
            if value is None:
                raise _Fail(loc, "the input is missing")
            have = bindings.get(name, _MISSING)
            if have is _MISSING:
                bindings[name] = value
            elif have is not value:
                _bind(bindings, name, value, loc)

        return capture
    pattern, index = (arg, 0) if isinstance(arg, NodePattern) else (arg.pattern, arg.output)
    match_producer = _compiled(pattern)
    memo = pattern.__dict__.get("_memo")

    def not_produced(value: Value | None) -> _Fail:
        if value is None:
            return _Fail(pattern.location, "the input is missing")
        producer = value.producer
        if producer is None:
            kind = ("a graph input" if value.is_input else "a weight" if value.is_initializer
                    else "not produced by a node")
            return _Fail(pattern.location, f"`{pattern.text}`: %{value.name} is {kind}")
        return _Fail(pattern.location, f"`{pattern.text}`: %{value.name} is not output {index} "
                                       f"of {producer.name}")

    if memo is not None:
        return _memo_arg(pattern, index, match_producer, memo, not_produced)
    if index == 0:
        def produced(value: Value | None, bindings: dict[str, Any], matched: list[Node]) -> None:
            producer = value.producer if value is not None else None
            if producer is None or producer.outputs[0] is not value:
                raise not_produced(value)
            match_producer(producer, bindings, matched)
    else:
        def produced(value: Value | None, bindings: dict[str, Any], matched: list[Node]) -> None:
            producer = value.producer if value is not None else None
            if producer is None or len(producer.outputs) <= index or producer.outputs[index] is not value:
                raise not_produced(value)
            match_producer(producer, bindings, matched)

    return produced


_MEMO = object()     # the bindings key of one match attempt's memo (`_memo_arg`)


class _Memoised:
    """Marks a pattern that may be reached by several paths in one match attempt (`_root_matcher`):
    several inputs read it, or it lies inside a commutative pattern, whose two operand orders may
    reach the same node. `alternatives`: a commutative pattern lies in it, so it can match a node
    in more than one way."""

    __slots__ = ("alternatives",)

    def __init__(self, alternatives: bool):
        self.alternatives = alternatives


def _memo_arg(pattern: NodePattern, index: int, match_producer, memoised: _Memoised, not_produced):
    """The argument matcher of a memoised pattern: matched once per (pattern, node) in a match
    attempt, however many paths reach it.

    The first time, the pattern is matched at the node on its own, from no bindings; the memo
    (a dict in the attempt's bindings under _MEMO, shared by every trial of a commutative
    pattern) keeps the failure, or the bindings it made and the nodes it matched. Matching only
    ever adds `capture = value` constraints, so a failure from no bindings is a failure from any;
    a success is merged into the bindings when it agrees with them: a shared capture binds the
    same value, else the conflict fails as `_bind` does. Only a pattern with a commutative part
    can match the node in another way that agrees; it is then matched again in the current
    bindings. A key (pattern, node) in the bindings records that it matched here, so later paths
    to it in the same bindings cost one lookup (and a failed commutative trial, which drops its
    copy of the bindings, drops the record too). `_root_matcher` removes these keys."""
    location = pattern.location

    def produced(value: Value | None, bindings: dict[Any, Any], matched: list[Node]) -> None:
        producer = value.producer if value is not None else None
        if producer is None or len(producer.outputs) <= index or producer.outputs[index] is not value:
            raise not_produced(value)
        mark = (memoised, producer)
        if mark in bindings:
            return
        memo = bindings.get(_MEMO)
        if memo is None:          # reached through a rule whose root did not set up the memo
            match_producer(producer, bindings, matched)
            return
        entry = memo.get(mark)
        if entry is None:
            fresh: dict[Any, Any] = {_MEMO: memo}
            nodes: list[Node] = []
            try:
                match_producer(producer, fresh, nodes)
            except _Fail as fail:
                memo[mark] = fail.reason
                raise
            del fresh[_MEMO]
            fresh[mark] = True
            entry = memo[mark] = (fresh, nodes)
        elif entry.__class__ is Reason:
            raise _Fail.again(entry)
        delta, nodes = entry
        conflict = _conflict(bindings, delta)
        if conflict is None:
            bindings.update(delta)
            matched.extend(nodes)
            return
        if not memoised.alternatives:
            name, have, want = conflict
            raise _Fail(location, f"capture {name!r} would be both %{_name(have)} and %{_name(want)}")
        match_producer(producer, bindings, matched)
        bindings[mark] = True

    return produced


def _conflict(bindings: dict[Any, Any], delta: dict[Any, Any]) -> tuple[Any, Any, Any] | None:
    """The first capture `delta` binds to another value than `bindings` does, or None."""
    for name, value in delta.items():
        have = bindings.get(name, _MISSING)
        if have is _MISSING or have is value:
            continue
        if (isinstance(have, list) and isinstance(value, list) and len(have) == len(value)
                and all(a is b for a, b in zip(have, value))):
            continue
        return name, have, value
    return None


def _inputs(pat: NodePattern) -> list[NodePattern]:
    return [a if isinstance(a, NodePattern) else a.pattern
            for a in pat.args if isinstance(a, (NodePattern, OutputRef))]


def _below(roots: list[NodePattern], seen: set[int]) -> list[NodePattern]:
    """The patterns `roots` read, directly or not, that are not in `seen` (which grows)."""
    out, stack = [], list(roots)
    while stack:
        for child in _inputs(stack.pop()):
            if id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                stack.append(child)
    return out


def _memoised_patterns(root: NodePattern) -> list[NodePattern]:
    """The patterns of `root`'s pattern DAG that more than one argument reads, and those inside
    a commutative pattern (explicit stacks, each pattern visited once per walk)."""
    patterns = [root, *_below([root], {id(root)})]
    readers: dict[int, int] = {}
    for pat in patterns:
        for child in _inputs(pat):
            readers[id(child)] = readers.get(id(child), 0) + 1
    inside = _below([p for p in patterns if p.commutative], set())
    chosen = {id(p) for p in inside} | {k for k, n in readers.items() if n > 1}
    return [p for p in patterns if id(p) in chosen]


def _has_commutative(root: NodePattern) -> bool:
    return root.commutative or any(p.commutative for p in _below([root], {id(root)}))


def _root_matcher(root: NodePattern):
    """The matcher of a rule's whole pattern, built once. Without memoised patterns it is the
    root's node matcher, which lists each matched node once where two argument patterns can meet
    one node; with them, a wrapper that gives each attempt its memo and removes it (and the records
    of `_memo_arg`) from the bindings of a match, and lists each matched node once."""
    fn = root.__dict__.get("_root_matcher")
    if fn is not None:
        return fn
    memoised = _memoised_patterns(root)
    for pat in memoised:               # before compiling, so the readers' matchers see the mark
        if "_memo" not in pat.__dict__:
            pat.__dict__["_memo"] = _Memoised(_has_commutative(pat))
    inner = _compiled(root)
    if not memoised and len(_below([root], {id(root)})) < 2:
        fn = inner                      # one node pattern below the root at most: no node twice
    elif not memoised:
        def fn(node: Node, bindings: dict[Any, Any], matched: list[Node]) -> None:
            inner(node, bindings, matched)
            if len(matched) > 2:        # two argument patterns met one node (Add(v0, v0))
                matched[:] = dict.fromkeys(matched)
    else:
        def fn(node: Node, bindings: dict[Any, Any], matched: list[Node]) -> None:
            bindings[_MEMO] = {}
            inner(node, bindings, matched)
            for key in [k for k in bindings if k.__class__ is not str]:
                del bindings[key]
            if len(matched) > 1:
                matched[:] = dict.fromkeys(matched)
    root.__dict__["_root_matcher"] = fn
    return fn


def _check_type(tp: TypePattern, value: Any, dims: dict[str, Any]) -> None:
    if not isinstance(value, Value):
        raise _Fail(tp.location, f"`{tp.text}`: a variadic capture has no single type")
    if tp.dtypes is not None and value.dtype not in tp.dtypes:
        raise _Fail(tp.location, f"`{tp.text}`: %{value.name} is {value.dtype}")
    if tp.dims is None:
        return
    shape = value.shape
    if shape is None:
        raise _Fail(tp.location, f"`{tp.text}`: the shape of %{value.name} is unknown")
    pats = tp.dims
    rest = next((i for i, d in enumerate(pats) if d.kind == "rest"), None)
    if rest is None:
        if len(pats) != len(shape):
            raise _Fail(tp.location, f"`{tp.text}`: %{value.name} is {format_shape(shape)}")
        pairs = list(zip(pats, shape))
    else:
        tail = len(pats) - rest - 1
        if len(shape) < len(pats) - 1:
            raise _Fail(tp.location, f"`{tp.text}`: %{value.name} is {format_shape(shape)}")
        pairs = list(zip(pats[:rest], shape[:rest])) + (
            list(zip(pats[rest + 1:], shape[len(shape) - tail:])) if tail else [])
    for dp, dim in pairs:
        if dp.kind == "int" and dim != dp.value:
            raise _Fail(tp.location, f"`{tp.text}`: %{value.name} is {format_shape(shape)}")
        if dp.kind == "name":
            have = dims.setdefault(dp.value, dim)
            if have != dim:
                raise _Fail(tp.location, f"`{tp.text}`: dim {dp.value} would be both {have} and {dim}")


def _guard_failure(expr: Expr, bindings: dict[str, Any], ctx: MatchContext) -> str:
    """Name the part of a false guard that is false, with the values it compared."""
    if expr.kind == "binop" and expr.value == "and":
        for part in expr.args:
            try:
                ok = decide(evaluate_expr(part, bindings, ctx), ctx.examples, part.text)
            except Unproven:
                ok = False
            if not ok:
                return _guard_failure(part, bindings, ctx)
    if expr.kind == "binop" and expr.value in (">=", "<=", ">", "<", "==", "!="):
        lhs = evaluate_expr(expr.args[0], bindings, ctx)
        rhs = evaluate_expr(expr.args[1], bindings, ctx)
        return (f"`{expr.text}` is false: {expr.args[0].text} = {describe(lhs, ctx.examples)}, "
                f"{expr.args[1].text} = {describe(rhs, ctx.examples)}")
    return f"`{expr.text}` is false"


def _check_types_and_guards(rule: Rule, bindings: dict[str, Any], ctx: MatchContext) -> None:
    if rule.types:
        dims: dict[str, Any] = {}
        for tp in rule.types:
            _check_type(tp, bindings[tp.capture], dims)
    for guard in rule.guards:
        try:
            value = decide(evaluate_expr(guard.expr, bindings, ctx), ctx.examples, guard.text)
        except Unproven as why:
            raise _Fail(guard.location, str(why)) from None
        except (TypeError, ValueError, ArithmeticError) as exc:   # / 0, a float too large, ...
            raise _Fail(guard.location, f"`{guard.text}` cannot be evaluated: {exc}") from None
        if not value:
            raise _Fail(guard.location, _guard_failure(guard.expr, bindings, ctx),
                        longer_from=_holds_from(guard, bindings, ctx) if rule.plan_type == PlanType.CHUNK else None)


# How much longer than traced the open dims (Graph.open_dims) are tried for a chunk rule's guard.
LONGER = (1.25, 1.5, 2, 3, 4, 6, 8)


def longer_examples(examples: dict[str, int], open_dims: frozenset[str], factor: float) -> dict[str, int]:
    """The example sizes with each open dim `factor` times as long."""
    return {d: int(n * factor) if d in open_dims else n for d, n in examples.items()}


def _holds_from(guard, bindings: dict[str, Any], ctx: "MatchContext") -> float | None:
    """The least factor, to a hundredth, at which a guard false at the example sizes holds with
    the graph's open dims that many times their examples (the sizes were only those the graph
    was traced at): the first of LONGER where it holds, then bisected down from there (a guard
    over sizes grows with them); None where it holds at none of LONGER."""
    open_dims = ctx.graph.open_dims
    if not open_dims or not any(d in open_dims for d in ctx.examples):
        return None

    def holds(factor: float) -> bool:
        longer = ctx.at(longer_examples(ctx.examples, open_dims, factor))
        return bool(decide(evaluate_expr(guard.expr, bindings, longer), longer.examples, guard.text))

    try:
        below = 1.0
        for factor in LONGER:
            if holds(factor):
                while factor - below > 0.01:
                    middle = math.ceil((below + factor) * 50) / 100
                    if middle >= factor:
                        break
                    below, factor = (below, middle) if holds(middle) else (middle, factor)
                return factor
            below = factor
        return None
    except Exception:       # unproven, or not evaluable at those sizes: say nothing
        return None


def try_match(rule: Rule, node: Node, ctx: MatchContext) -> Match | Reason:
    bindings: dict[str, Any] = {}
    matched: list[Node] = []
    try:
        _root_matcher(rule.root)(node, bindings, matched)
        _check_types_and_guards(rule, bindings, ctx)
    except _Fail as fail:
        return fail.reason
    return Match(rule, node, matched, bindings)


def match(graph: Graph, rules: RuleSet, analysis: Analysis | None = None,
          forward_outputs: list[str] | None = None, context: MatchContext | None = None) -> list[Match]:
    """Every match of every rule, in schedule order (then priority, then file order)."""
    ctx = context or MatchContext(graph, rules, analysis, forward_outputs)
    index = {op: [(r, _root_matcher(r.root), bool(r.types or r.guards)) for r in rs]
             for op, rs in rules.by_root_op().items()}
    qualified = any("::" in op for op in index)  # only then can a node's native op name matter
    found: list[Match] = []
    get = index.get
    excluded = ctx.excluded
    injecting = injection_active()
    with collector_paused():
        for node in graph.nodes:
            candidates = get(node.op)
            if qualified:
                native = node.native_op
                if native is not None and native in index:
                    seen = {id(c[0]) for c in candidates or ()}
                    candidates = list(candidates or ()) + [c for c in index[native] if id(c[0]) not in seen]
            if not candidates:
                continue
            for rule, match_root, checks in candidates:
                if excluded and Site(rule.name, node.name) in excluded:
                    continue
                bindings: dict[str, Any] = {}
                matched: list[Node] = []
                try:
                    if injecting:
                        check_injected("match", rule.name, node.name)
                    match_root(node, bindings, matched)
                    if checks:
                        _check_types_and_guards(rule, bindings, ctx)
                except _Fail as fail:
                    if fail.reason.longer_inputs:
                        ctx.longer.append((Match(rule, node, matched, bindings), fail.reason))
                    continue
                except Exception as exc:    # a bug: drop this site, or raise when strict
                    failure = PlanFailure(Site(rule.name, node.name), "match", exc)
                    if ctx.strict:
                        raise failure from exc
                    ctx.failures.append(failure)
                    continue
                found.append(Match(rule, node, matched, bindings))
    return found


@dataclass
class Explanation:
    rule: Rule
    node: Node | None
    matched: bool
    reasons: list[Reason] = field(default_factory=list)

    def __str__(self) -> str:
        where = f"{self.node.name} ({self.node.op})" if self.node else "the graph"
        if self.matched:
            return f"{self.rule.name} matches at {where}" + "".join(f"\n    {r}" for r in self.reasons)
        return f"{self.rule.name} does not match at {where}:" + "".join(f"\n    {r}" for r in self.reasons)


def explain(graph: Graph, rules: RuleSet, rule_name: str, node_name: str | None = None,
            context: MatchContext | None = None) -> list[Explanation]:
    """For each node the rule's root op accepts (or the named node), whether and why not it matched."""
    rule = rules.rule(rule_name)
    if rule is None:
        from .errors import RuleError

        raise RuleError(f"no rule named {rule_name!r}; rules: {', '.join(r.name for r in rules.rules)}")
    ctx = context or MatchContext(graph, rules)
    if node_name is not None:
        nodes = [n for n in graph.nodes if n.name == node_name or any(o.name == node_name for o in n.outputs)]
        if not nodes:
            from .errors import GraphError

            raise GraphError(f"no node or value named {node_name!r} in the graph")
    else:
        nodes = [n for n in graph.nodes if rule.root.accepts(n.op, n.native_op)]
    if not nodes:
        return [Explanation(rule, None, False, [Reason(rule.root.location,
                f"no node has op {'|'.join(sorted(rule.root.ops))}, the root of `{rule.root.text}`")])]
    out = []
    for node in nodes:
        result = try_match(rule, node, ctx)
        out.append(Explanation(rule, node, isinstance(result, Match),
                               [] if isinstance(result, Match) else [result]))
    return out

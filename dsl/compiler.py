"""AST -> engine.patterns, with the semantic checks.

Rules become engine.patterns.Rule; op facts (families, views, recomputable, chunkable, ...)
and `cost` and `replay` declarations become the RuleSet's tables (engine.patterns.CostFormula and
Replay, one per op name; a later file's declaration overrides an earlier file's, two in one file
are an error).

Every problem becomes a Diagnostic with its file:line:col; all of a file's
problems are reported together. Names that are close to a known one get a
"did you mean". Beyond names, a rule is refused when it could never do what it
says: an attribute or output no op's signature has (dsl.schemas), a guard of the
wrong type or a constant that divides by zero (dsl.typecheck), a chunk dim or count
that cannot work, a pattern or expression past the nesting limits (dsl.limits).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import patterns as P
from engine.dtypes import DType, dtype_names
from engine.errors import RuleError, SourceLocation
from engine.guards import BUILTINS, CONSTANTS, SIZE_UNITS
from engine.onnx_ops import ONNX_OPS
from engine.op_cost import COST_BUILTINS
from engine.strategies.chunk import CHUNK_KINDS
from engine.strategies.replay import TEMPLATE_OPS
from engine.strategies.replay import captures as replay_captures

from . import ast
from .errors import Diagnostic, did_you_mean
from .limits import MAX_CHUNK_DIM, MAX_EXPR_DEPTH, MAX_LITERAL, MAX_PATTERN_DEPTH, expr_too_deep, pattern_shape
from .schemas import Report, Signature, check_signatures, declare_signature, onnx_signature, op_name
from .typecheck import ANY, BOOL, NUMBER, VALUE, VARIADIC, TypeChecker

KNOWN_DOMAINS = {"com.microsoft", "aten", "prims", "ai.onnx.ml", "ai.onnx.preview.training",
                 "org.pytorch.aten", "pkg.onnxscript.torch_lib"}


@dataclass
class Scope:
    """What the loaded files declared: families, custom ops and their signatures, op facts."""

    families: dict[str, ast.FamilyDecl] = field(default_factory=dict)
    custom_ops: set[str] = field(default_factory=set)
    custom_domains: set[str] = field(default_factory=set)
    signatures: dict[str, tuple[Signature, SourceLocation]] = field(default_factory=dict)
    recomputable: dict[str, str] = field(default_factory=dict)
    views: set[str] = field(default_factory=set)
    nondeterministic: set[str] = field(default_factory=set)
    chunkable: dict[str, str] = field(default_factory=dict)
    linear_in_gradient: set[str] = field(default_factory=set)
    additive_in_gradient: set[str] = field(default_factory=set)
    rule_names: dict[str, SourceLocation] = field(default_factory=dict)


class Compiler:
    def __init__(self) -> None:
        self.scope = Scope()
        self.diagnostics: list[Diagnostic] = []
        self.rules: list[P.Rule] = []
        self.costs: dict[str, P.CostFormula] = {}
        self.replays: dict[str, P.Replay] = {}
        self._family_ops: dict[str, frozenset[str]] = {}

    def error(self, message: str, loc: SourceLocation, hint: str = "") -> None:
        self.diagnostics.append(Diagnostic(message, loc, hint))

    # declarations -----------------------------------------------------------------
    def declare(self, file: ast.RuleFile) -> None:
        self._family_ops.clear()
        for decl in file.op_decls:
            if decl.kind == "op":
                for ref in decl.ops:
                    domain, sep, _ = ref.name.rpartition("::")
                    if sep:
                        self.scope.custom_domains.add(domain)
                    self.scope.custom_ops.add(ref.name)
                if decl.signature is not None:
                    declare_signature(decl, self.scope.signatures, self.error)
        for fam in file.families:
            if fam.name in self.scope.families:
                prev = self.scope.families[fam.name].loc
                self.error(f"family {fam.name!r} is defined twice (first at {prev})", fam.loc)
            elif fam.name in ONNX_OPS:
                self.error(f"family {fam.name!r} has the name of an ONNX op; pick another name", fam.loc)
            else:
                self.scope.families[fam.name] = fam
        for decl in file.op_decls:
            if decl.kind == "op":
                continue
            ops = self.resolve_ops(decl.ops)
            if decl.kind == "chunkable" and decl.detail[0] not in CHUNK_KINDS:
                self.error(f"unknown chunk kind {decl.detail[0]!r}", decl.detail[1],
                           did_you_mean(decl.detail[0], set(CHUNK_KINDS)) or
                           f"the kinds are: {', '.join(sorted(CHUNK_KINDS))}")
                continue
            for op in ops:
                if decl.kind == "recomputable":
                    self.scope.recomputable[op] = decl.tier or P.DEFAULT_TIER
                elif decl.kind == "view":
                    self.scope.views.add(op)
                elif decl.kind == "chunkable":
                    self.scope.chunkable[op] = decl.detail[0]
                elif decl.kind == "linear_in_gradient":
                    self.scope.linear_in_gradient.add(op)
                elif decl.kind == "additive_in_gradient":
                    self.scope.additive_in_gradient.add(op)
                else:
                    self.scope.nondeterministic.add(op)

    def signature(self, op: str) -> Signature | None:
        declared = self.scope.signatures.get(op)
        return declared[0] if declared else onnx_signature(op)

    def resolve_ops(self, refs: list[ast.OpRef]) -> frozenset[str]:
        """The op names `refs` stand for, families expanded (with an explicit stack, each family
        once; a family that reaches itself is an error)."""
        out: set[str] = set()
        stack: list[tuple[Any, str | None, set[str]]] = [(iter(refs), None, out)]
        expanding: list[str] = []
        while stack:
            refs_left, family, acc = stack[-1]
            ref = next(refs_left, None)
            if ref is None:
                stack.pop()
                if family is not None:
                    expanding.pop()
                    self._family_ops[family] = frozenset(acc)
                    stack[-1][2].update(acc)
                continue
            name = ref.name
            if "::" in name:
                domain = name.rpartition("::")[0]
                if domain not in ("", "ai.onnx") and domain not in KNOWN_DOMAINS | self.scope.custom_domains:
                    hint = did_you_mean(domain, KNOWN_DOMAINS | self.scope.custom_domains)
                    self.error(f"unknown op domain {domain!r} in {ref.name!r}", ref.loc,
                               hint or "declare it with `op domain::Name` if it is a custom op")
                    continue
                acc.add(op_name(name))
            elif name in self.scope.families:
                if name in expanding:
                    self.error(f"family {name!r} refers to itself", ref.loc)
                elif name in self._family_ops:
                    acc.update(self._family_ops[name])
                else:
                    expanding.append(name)
                    stack.append((iter(self.scope.families[name].ops), name, set()))
            elif name in ONNX_OPS or name in self.scope.custom_ops:
                acc.add(name)
            else:
                known = ONNX_OPS | set(self.scope.families) | self.scope.custom_ops
                self.error(f"unknown op {name!r}", ref.loc,
                           did_you_mean(name, known) or "ops are ONNX operator names, families, "
                           "`domain::Name` (aten::gelu, com.microsoft::BiasGelu), or declared with `op`")
        return frozenset(out)

    # costs -----------------------------------------------------------------------
    def compile_costs(self, file: ast.RuleFile, file_order: int) -> None:
        """`cost` declarations: one formula per op name. A declaration in a later file (in load
        order: a module before the files that `use` it) overrides an earlier file's for every op
        it names; two declarations in one file for one op are an error."""
        for decl in file.costs:
            self._per_op(self.costs, _CostCompiler(self, decl, file_order).compile(), decl, "cost")

    def compile_replays(self, file: ast.RuleFile, file_order: int) -> None:
        """`replay` declarations: one per op name, as for costs."""
        for decl in file.replays:
            self._per_op(self.replays, _ReplayCompiler(self, decl, file_order).compile(), decl, "replay")

    def _per_op(self, table: dict[str, Any], item: Any, decl: Any, what: str) -> None:
        """`item` (compiled from `decl`, None when refused) as the `what` of each op it names."""
        if item is None:
            return
        for op in sorted(item.ops):
            prev = table.get(op)
            if prev is not None and prev.location.file == decl.loc.file:
                self.error(f"the {what} of {op!r} is declared twice in this file (first at {prev.location})",
                           self._ref_naming(decl.pattern.ops, op),
                           f"a file declares one {what} per op (a later file may override it)")
                continue
            table[op] = item

    def _ref_naming(self, refs: list[ast.OpRef], op: str) -> SourceLocation:
        """Where `refs` name `op`: the ref itself, or the family that stands for it."""
        for ref in refs:
            if op_name(ref.name) == op:
                return ref.loc
        for ref in refs:
            if op in self._family_ops.get(ref.name, ()):
                return ref.loc
        return refs[0].loc

    # rules -----------------------------------------------------------------------
    def compile_rules(self, file: ast.RuleFile) -> None:
        for decl in file.rules:
            if decl.name in self.scope.rule_names:
                self.error(f"rule {decl.name!r} is defined twice (first at "
                           f"{self.scope.rule_names[decl.name]})", decl.loc)
                continue
            self.scope.rule_names[decl.name] = decl.loc
            before = len(self.diagnostics)
            try:
                rule = _RuleCompiler(self, decl).compile()
            except RecursionError:      # the last resort: the limits should make this unreachable
                self.error(f"rule {decl.name!r} is nested too deeply to compile", decl.loc,
                           "split deep patterns and long expressions into several statements or rules")
                continue
            except RuleError as err:    # engine.patterns refused what the checks here let through
                self.error(err.message, err.location or decl.loc)
                continue
            if rule is not None and len(self.diagnostics) == before:
                rule.order = len(self.rules)
                self.rules.append(rule)


class _RuleCompiler:
    def __init__(self, owner: Compiler, decl: ast.RuleDecl):
        self.owner = owner
        self.decl = decl
        self.defined: dict[str, tuple[int, int, SourceLocation]] = {}   # capture -> (binding, output, loc)
        self.inputs: set[str] = set()                                    # captures bound to inputs
        self.variadic: dict[str, SourceLocation] = {}                    # captures bound by `xs...`
        self.single: dict[str, SourceLocation] = {}                      # captures of one value
        self.built: dict[int, P.NodePattern] = {}
        self.building: set[int] = set()

    def error(self, message: str, loc: SourceLocation, hint: str = "") -> None:
        self.owner.error(message, loc, hint)

    def compile(self) -> P.Rule | None:
        decl = self.decl
        if not decl.bindings:
            self.error(f"rule {decl.name!r} matches nothing: its match block has no `y = Op(...)` "
                       "statement", decl.loc)
            return None
        for i, binding in enumerate(decl.bindings):
            for k, target in enumerate(binding.targets):
                if target.name is None:
                    continue
                if target.name in self.defined:
                    first = self.defined[target.name][2]
                    self.error(f"capture {target.name!r} is bound twice (first at {first})", target.loc)
                else:
                    self.defined[target.name] = (i, k, target.loc)
                    self.single.setdefault(target.name, target.loc)
        # A statement is referenced when another one uses its captures (using its own is an error).
        referenced = {self.defined[name][0] for i, b in enumerate(decl.bindings)
                      for name in _arg_names(b.pattern)
                      if name in self.defined and self.defined[name][0] != i}
        roots = [i for i in range(len(decl.bindings)) if i not in referenced]
        if not roots:
            self.error("the match statements refer to each other in a cycle, so the pattern has no root",
                       decl.bindings[0].loc)
            return None
        if len(roots) > 1:
            second = decl.bindings[roots[1]]
            self.error(f"statement `{second.text}` is not connected to the pattern's root "
                       f"`{decl.bindings[roots[0]].text}`", second.loc,
                       "a rule matches one connected pattern: use the captured value as an input "
                       "of another statement, or move it to its own rule")
            return None
        if not self._pattern_within_limits():
            return None
        root = self._build(roots[0])
        self._check_capture_kinds()
        captures = set(self.defined) | self.inputs
        kinds = {name: VARIADIC if name in self.variadic else VALUE for name in captures}
        ranks = self._fixed_ranks()
        checker = TypeChecker(kinds, ranks, self.error)
        types = [t for t in (self._type(a, captures) for a in decl.types) if t is not None]
        guards = []
        for r in decl.requires:
            expr = self._checked_expr(r.expr, captures)
            if expr is not None and self._guard_type(expr, checker):
                guards.append(P.Guard(expr, r.loc, r.text))
        actions = self._actions(captures, checker, ranks)
        if not decl.actions:
            self.error(f"rule {decl.name!r} has no rewrite action", decl.loc,
                       "add `recompute y` or `recompute y from x` to its rewrite block")
        if root is None or not actions:
            return None
        return P.Rule(decl.name, root, types, guards, actions, decl.loc, decl.priority,
                      decl.tier or P.DEFAULT_TIER)

    # patterns ---------------------------------------------------------------------
    def _pattern_within_limits(self) -> bool:
        """Patterns nest through nested ops and through captured outputs of other statements;
        the matcher walks them recursively, so their depth is bounded. (Their size is not: a
        statement read by several inputs is one shared pattern, built once here and matched
        once per node by engine.matcher.)"""
        producers = {name: index for name, (index, _, _) in self.defined.items()}
        _, where = pattern_shape(self.decl, producers)
        if where is not None:
            self.error(f"pattern nested too deeply (limit {MAX_PATTERN_DEPTH}), counting the statements "
                       f"whose captured outputs it reads", where.loc,
                       "split the rule, or match fewer ops in one pattern")
            return False
        return True

    def _build(self, index: int) -> P.NodePattern | None:
        if index in self.built:
            return self.built[index]
        binding = self.decl.bindings[index]
        self.building.add(index)
        pattern = self._node(binding.pattern, binding.targets)
        self.building.discard(index)
        if pattern is not None:
            pattern.text = binding.text
            self.built[index] = pattern
        return pattern

    def _node(self, pat: ast.NodePat, targets: list[ast.Target] | None) -> P.NodePattern | None:
        """One op of a pattern; `targets` are the statement's outputs (None: a nested pattern)."""
        ops = self.owner.resolve_ops(pat.ops)
        if not ops:
            return None
        args: list[P.Arg] = []
        attrs: dict[str, Any] = {}
        constrained: list[tuple[ast.Arg, Any]] = []
        variadic = None
        for arg in pat.args:
            if variadic is not None and arg.kind != "attr":
                self.error("a variadic capture `xs...` must be the last input", arg.loc)
            if arg.kind == "attr":
                if arg.name in attrs:
                    self.error(f"attribute {arg.name!r} is constrained twice", arg.loc)
                value = self._attr(arg.value)
                constrained.append((arg, None if value is _INVALID else value))
                if value is not _INVALID:
                    attrs[arg.name] = value
            elif arg.kind == "wildcard":
                args.append(P.Wildcard(arg.loc))
            elif arg.kind == "variadic":
                if pat.commutative:
                    self.error("a commutative pattern `Op{...}` cannot take a variadic capture", arg.loc)
                variadic = arg.name
                self.inputs.add(arg.name)
                self.variadic.setdefault(arg.name, arg.loc)
            elif arg.kind == "nested":
                nested = self._node(arg.value, None)
                if nested is not None:
                    nested.text = arg.value.text
                    args.append(nested)
            elif arg.name in self.defined:
                self.single.setdefault(arg.name, arg.loc)
                index, output, _ = self.defined[arg.name]
                if index in self.building:
                    self.error(f"capture {arg.name!r} is used by the statement that defines it", arg.loc)
                    continue
                producer = self._build(index)
                if producer is not None:
                    args.append(producer if output == 0 else P.OutputRef(producer, output, arg.loc))
            else:
                self.inputs.add(arg.name)
                self.single.setdefault(arg.name, arg.loc)
                args.append(P.CaptureRef(arg.name, arg.loc))
        if pat.commutative and variadic is None and len(args) != 2:
            self.error(f"a commutative pattern `Op{{a, b}}` takes exactly two inputs, got {len(args)}",
                       pat.loc)
        if constrained or (targets is not None and len(targets) > 1):
            sigs = {op: self.owner.signature(op) for op in sorted(ops)}
            check_signatures(sigs, constrained, targets or [], self.error)
        outputs = [t.name for t in targets] if targets is not None else [None]
        return P.NodePattern(ops, args, attrs, outputs, pat.loc, pat.commutative, variadic, pat.text)

    def _check_capture_kinds(self) -> None:
        """A capture is one value or a variadic list of them, never both (it could never match)."""
        for name, loc in self.variadic.items():
            if name in self.single:
                self.error(f"capture {name!r} is a variadic capture `{name}...` here but one value at "
                           f"{self.single[name]}", loc, "give the variadic capture a name of its own")

    def _attr(self, value: ast.AttrValue) -> Any:
        return attr_value(value, self.error)

    def _type(self, annot: ast.TypeAnnot, captures: set[str]) -> P.TypePattern | None:
        if annot.name not in captures:
            self.error(f"type annotation for unknown capture {annot.name!r}", annot.loc,
                       did_you_mean(annot.name, captures))
            return None
        if annot.name in self.variadic:
            self.error(f"{annot.name!r} is a variadic capture: it has no single type", annot.loc,
                       "annotate a capture of one value")
            return None
        dtypes = set()
        for name, loc in annot.dtypes:
            try:
                dtypes.add(DType.from_name(name))
            except ValueError:
                self.error(f"unknown dtype {name!r}", loc,
                           did_you_mean(name, dtype_names()) or f"known: {', '.join(dtype_names())}")
        dims = None
        if annot.dims is not None:
            rests = [d for d in annot.dims if d.kind == "rest"]
            if len(rests) > 1:
                self.error("a shape may contain `...` at most once", rests[1].loc)
            dims = [P.DimPattern(d.kind, d.value) for d in annot.dims]
        return P.TypePattern(annot.name, frozenset(dtypes) or None, dims, annot.loc, annot.text)

    def _fixed_ranks(self) -> dict[str, int]:
        """The rank a type annotation without `...` gives a capture (the smallest, if several)."""
        ranks: dict[str, int] = {}
        for annot in self.decl.types:
            if annot.dims is not None and not any(d.kind == "rest" for d in annot.dims):
                ranks[annot.name] = min(len(annot.dims), ranks.get(annot.name, len(annot.dims)))
        return ranks

    # expressions ------------------------------------------------------------------
    def _checked_expr(self, expr: ast.Expr, captures: set[str]) -> P.Expr | None:
        return compile_expr(expr, captures, self.error)

    def _guard_type(self, expr: P.Expr, checker: TypeChecker) -> bool:
        """Whether a guard is a condition that can hold; errors for the rest. (ANY without an
        error: a built-in the type table does not know, kept unchecked.)"""
        before = len(self.owner.diagnostics)
        typed = checker.check(expr)
        if len(self.owner.diagnostics) > before:
            return False
        if typed.type not in (BOOL, ANY):
            checker.expect(BOOL, typed, expr, "`require` needs a condition")
            return False
        if typed.is_const and not typed.const:
            self.error(f"`{expr.text}` is always false, so the rule never fires", expr.location)
            return False
        return True

    # actions ----------------------------------------------------------------------
    def _actions(self, captures: set[str], checker: TypeChecker, ranks: dict[str, int]) -> list[P.Action]:
        actions: list[P.Action] = []
        for action in self.decl.actions:
            if isinstance(action, ast.RecomputeAction):
                names = [action.target, *action.sources]
            else:
                names = action.names
            bad = [(n, loc) for n, loc in names if n not in captures]
            for name, loc in bad:
                self.error(f"unknown capture {name!r}", loc,
                           did_you_mean(name, captures) or
                           f"the rule's captures are: {', '.join(sorted(captures)) or 'none'}")
            if bad:
                continue
            for name, loc in names:
                if name in self.variadic:
                    self.error(f"{name!r} is a variadic capture; a rewrite action takes one value", loc)
            if any(name in self.variadic for name, _ in names):
                continue
            if isinstance(action, ast.RecomputeAction):
                actions.append(P.Recompute(action.target[0], [n for n, _ in action.sources], action.loc))
            elif isinstance(action, ast.ChunkAction):
                chunk = self._chunk(action, captures, checker, ranks)
                if chunk is not None:
                    actions.append(chunk)
            else:
                actions.append(P.Save([n for n, _ in action.names], action.loc))
        chunk = next((a for a in actions if isinstance(a, P.Chunk)), None)
        if chunk is not None and len(actions) > 1:
            self.error("a chunk rule cannot also recompute or save", chunk.location,
                       "put the recompute in a rule of its own")
            return []
        return actions

    def _chunk(self, action: ast.ChunkAction, captures: set[str], checker: TypeChecker,
               ranks: dict[str, int]) -> P.Chunk | None:
        """`chunk over h along D into N`: what the rule alone can tell about D and N."""
        ok = True
        dim_loc = action.dim_loc or action.loc
        if not -MAX_CHUNK_DIM < action.dim < MAX_CHUNK_DIM:
            self.error(f"chunk dim {action.dim} is out of range", dim_loc,
                       f"a dim lies between -{MAX_CHUNK_DIM - 1} and {MAX_CHUNK_DIM - 1} "
                       "(a negative dim counts from the end)")
            ok = False
        else:
            for name, _ in action.names:
                rank = ranks.get(name)
                if rank is not None and not -rank <= action.dim < rank:
                    self.error(f"chunk dim {action.dim} is out of range: the rule's type annotation "
                               f"gives {name} rank {rank}", dim_loc,
                               f"dims of a rank-{rank} value are {-rank} to {rank - 1}" if rank else
                               "a rank-0 value has no dim to chunk")
                    ok = False
        count = self._checked_expr(action.count, captures)
        if count is None:
            return None
        before = len(self.owner.diagnostics)
        typed = checker.check(count)
        if len(self.owner.diagnostics) > before:
            return None
        if typed.type not in (NUMBER, ANY):
            checker.expect(NUMBER, typed, count, "`into` needs a number of chunks")
            return None
        if typed.is_const and typed.const < 2:
            shown = f"`{count.text}` is {typed.const}" if count.text.strip() != str(typed.const) else str(typed.const)
            self.error(f"the chunk count {shown}: a chunk rule runs at least 2 slices", count.location,
                       "write a count of 2 or more, or a formula such as ceil(bytes(x) / 8 MiB)")
            return None
        if not ok:
            return None
        return P.Chunk([n for n, _ in action.names], action.dim, count, action.loc)


def compile_expr(expr: ast.Expr, captures: set[str], error: Report,
                 functions: frozenset[str] | None = None) -> P.Expr | None:
    """A guard, chunk-count or cost expression, names resolved and built-ins checked (`functions`:
    the built-ins it may call, None for all); None after an error. Depth is checked first."""
    deep = expr_too_deep(expr)
    if deep is not None:
        error(f"expression nested too deeply (limit {MAX_EXPR_DEPTH})", deep.loc,
              "split it into several `require` lines or simpler expressions")
        return None
    return _expr(expr, captures, error, functions)


def _expr(expr: ast.Expr, captures: set[str], error: Report,
          functions: frozenset[str] | None) -> P.Expr | None:
    kind = expr.kind
    if kind == "number":
        value = expr.value
        if expr.unit is not None:
            unit, loc = expr.unit
            if unit not in SIZE_UNITS:
                error(f"unknown size unit {unit!r}", loc,
                      did_you_mean(unit, SIZE_UNITS) or f"units: {', '.join(SIZE_UNITS)}")
                return None
            value = value * SIZE_UNITS[unit]
            value = int(value) if float(value).is_integer() else value
            if abs(value) >= MAX_LITERAL:
                error(f"`{expr.text}` is out of range", expr.loc,
                      "numbers lie strictly between -2**63 and 2**63")
                return None
        return P.Expr("num", expr.loc, value, text=expr.text)
    if kind == "string":
        return P.Expr("str", expr.loc, expr.value, text=expr.text)
    if kind == "name":
        name = expr.value
        if name in captures:
            return P.Expr("ref", expr.loc, name, text=expr.text)
        if name in CONSTANTS:
            return P.Expr("bool", expr.loc, CONSTANTS[name], text=expr.text)
        try:
            return P.Expr("dtype", expr.loc, DType.from_name(name), text=expr.text)
        except ValueError:
            pass
        error(f"unknown name {name!r}", expr.loc,
              did_you_mean(name, captures | set(dtype_names()) | set(CONSTANTS))
              or f"the captures are: {', '.join(sorted(captures)) or 'none'}")
        return None
    if kind == "call":
        fn = BUILTINS.get(expr.value)
        if fn is not None and functions is not None and expr.value not in functions:
            error(f"{expr.value}() reads the graph around the op; a cost formula reads only the op's "
                  f"own values", expr.loc, f"a cost formula may call: {', '.join(sorted(functions))}")
            return None
        if fn is None:
            known = BUILTINS if functions is None else functions
            error(f"unknown function {expr.value!r}", expr.loc,
                  did_you_mean(expr.value, known) or f"functions: {', '.join(sorted(known))}")
            return None
        lo, hi = fn.arity
        if not lo <= len(expr.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            error(f"{expr.value}() takes {want} argument{'s' if hi > 1 else ''}, "
                  f"got {len(expr.args)}", expr.loc)
            return None
        if fn.takes_values and expr.args[0].kind != "name":
            error(f"{expr.value}() takes a captured value as its first argument",
                  expr.args[0].loc)
            return None
        args = [_expr(a, captures, error, functions) for a in expr.args]
        if any(a is None for a in args):
            return None
        if fn.takes_values and args[0].kind != "ref":
            error(f"{expr.value}() takes a captured value, not {expr.args[0].text!r}",
                  expr.args[0].loc, did_you_mean(expr.args[0].value, captures))
            return None
        return P.Expr("call", expr.loc, expr.value, args, expr.text)
    args = [_expr(a, captures, error, functions) for a in expr.args]
    if any(a is None for a in args):
        return None
    return P.Expr(kind, expr.loc, expr.value, args, expr.text)


class _PositionalCompiler:
    """A declaration that binds one op's outputs and inputs by position (`cost`, `replay`)."""

    what = "a declaration"

    def __init__(self, owner: Compiler, decl, file_order: int):
        self.owner = owner
        self.decl = decl
        self.file_order = file_order
        self.bound: dict[str, SourceLocation] = {}

    def error(self, message: str, loc: SourceLocation, hint: str = "") -> None:
        self.owner.error(message, loc, hint)

    def _bind(self, name: str, loc: SourceLocation) -> None:
        if name in self.bound:
            self.error(f"capture {name!r} is bound twice (first at {self.bound[name]})", loc)
        else:
            self.bound[name] = loc

    def bind_positions(self, variadic_allowed: bool) -> tuple[frozenset[str], list[str | None],
                                                              list[str | None], str | None]:
        """The op names, the outputs and inputs bound by position, and the variadic tail."""
        decl = self.decl
        pat = decl.pattern
        what = self.what
        ops = self.owner.resolve_ops(pat.ops)
        if pat.commutative:
            self.error(f"{what} binds the op's inputs by position: write `Op(a, b)`, not `Op{{a, b}}`", pat.loc)
        outputs: list[str | None] = []
        for target in decl.targets:
            outputs.append(target.name)
            if target.name is not None:
                self._bind(target.name, target.loc)
        inputs: list[str | None] = []
        variadic = None
        for arg in pat.args:
            if variadic is not None:
                self.error("a variadic capture `xs...` must be the last input", arg.loc)
            if arg.kind == "attr":
                self.error(f"{what} does not constrain attributes: it covers every node of the op", arg.loc,
                           "bind the op's inputs with captures (x), `_` or a variadic tail (rest...)")
            elif arg.kind == "nested":
                self.error(f"{what} binds the op's own inputs: it takes no nested pattern", arg.loc,
                           "write a capture (x) or `_` here")
            elif arg.kind == "wildcard":
                inputs.append(None)
            elif arg.kind == "variadic":
                if not variadic_allowed:
                    self.error(f"{what} binds each input it reads by position: no variadic tail", arg.loc,
                               "write a capture (x) or `_` for each input up to the last one read")
                variadic = arg.name
                self._bind(arg.name, arg.loc)
            else:
                inputs.append(arg.name)
                self._bind(arg.name, arg.loc)
        if ops and len(decl.targets) > 1:
            check_signatures({op: self.owner.signature(op) for op in sorted(ops)}, [], decl.targets, self.error)
        return ops, outputs, inputs, variadic


class _CostCompiler(_PositionalCompiler):
    """`cost y = Op(a, b, rest...) flops EXPR [bytes EXPR]` -> engine.patterns.CostFormula."""

    what = "a cost"

    def compile(self) -> P.CostFormula | None:
        decl = self.decl
        before = len(self.owner.diagnostics)
        ops, outputs, inputs, variadic = self.bind_positions(variadic_allowed=True)
        kinds = {name: VARIADIC if name == variadic else VALUE for name in self.bound}
        checker = TypeChecker(kinds, {}, self.error)
        flops = self._formula(decl.flops, "flops", checker)
        moved = self._formula(decl.bytes, "bytes", checker) if decl.bytes is not None else None
        if len(self.owner.diagnostics) > before or not ops or flops is None:
            return None
        return P.CostFormula(ops, tuple(outputs), tuple(inputs), variadic, flops, moved, decl.loc,
                             decl.text, self.file_order)

    def _formula(self, expr: ast.Expr, what: str, checker: TypeChecker) -> P.Expr | None:
        """A number-valued formula over the captures, calling only COST_BUILTINS."""
        compiled = compile_expr(expr, set(self.bound), self.error, COST_BUILTINS)
        if compiled is None:
            return None
        before = len(self.owner.diagnostics)
        typed = checker.check(compiled)
        if len(self.owner.diagnostics) > before:
            return None
        if typed.type not in (NUMBER, ANY):
            checker.expect(NUMBER, typed, compiled, f"`{what}` needs a number")
            return None
        if typed.is_const and typed.const < 0:
            self.error(f"`{what}` is {typed.const}: a cost cannot be negative", compiled.location)
            return None
        return compiled


class _ReplayCompiler(_PositionalCompiler):
    """`replay y, mask = Op(x, ratio, _) as TEMPLATE` -> engine.patterns.Replay."""

    what = "a replay"

    def compile(self) -> P.Replay | None:
        decl = self.decl
        before = len(self.owner.diagnostics)
        ops, outputs, inputs, _ = self.bind_positions(variadic_allowed=False)
        for op in sorted(ops):
            if op not in self.owner.scope.nondeterministic:
                self.error(f"{op!r} is not declared nondeterministic: it recomputes as it is, with no replay",
                           self.owner._ref_naming(decl.pattern.ops, op),
                           f"declare it `nondeterministic {op}`, or drop the replay")
        template = self._call(decl.template)
        read = set() if template is None else replay_captures(template)
        saved = [k for k, name in enumerate(outputs) if name is not None and name in read]
        unread = [k for k, name in enumerate(outputs) if name is not None and name not in read]
        if template is not None and not saved:
            self.error("the template reads none of the op's outputs: a replay computes one output from the "
                       "random values another keeps", decl.template.loc,
                       f"read the kept output ({', '.join(n for n in outputs if n) or 'bind it first'})")
        if template is not None and len(unread) != 1:
            self.error(f"a replay computes one output, the one its template does not read; this one leaves "
                       f"{len(unread)} unread", decl.loc,
                       "bind the replayed output and the outputs the template reads; write `_` for the rest")
        if len(self.owner.diagnostics) > before or not ops or template is None:
            return None
        return P.Replay(ops, tuple(outputs), tuple(inputs), template, unread[0], tuple(saved), decl.loc,
                        decl.text, self.file_order)

    def _call(self, call: ast.TemplateCall) -> P.TemplateCall | None:
        ok = True
        ops = self.owner.resolve_ops([call.op])
        op = next(iter(ops), None)
        if op is not None and (len(ops) != 1 or op not in TEMPLATE_OPS):
            self.error(f"a replay's template applies elementwise ops, casts and Where, not {call.op.name!r}",
                       call.op.loc, did_you_mean(call.op.name, set(TEMPLATE_OPS))
                       or f"the ops a template may apply: {', '.join(sorted(TEMPLATE_OPS))}")
            ok = False
        args: list[Any] = []
        attrs: list[tuple[str, Any]] = []
        constrained = []
        for arg in call.args:
            if arg.kind == "capture":
                if arg.name not in self.bound:
                    self.error(f"unknown capture {arg.name!r} in the template", arg.loc,
                               did_you_mean(arg.name, set(self.bound)) or
                               "a template reads the op's inputs and outputs the replay binds")
                    ok = False
                args.append(arg.name)
            elif arg.kind == "literal":
                args.append(arg.value)
            elif arg.kind == "nested":
                inner = self._call(arg.value)
                ok = ok and inner is not None
                args.append(inner)
            else:
                value = attr_value(arg.value, self.error)
                ok = ok and value is not _INVALID
                attrs.append((arg.name, value))
                constrained.append((arg, None if value is _INVALID else value))
        if op is not None and ok:
            check_signatures({op: self.owner.signature(op)}, constrained, [], self.error)
        if op == "Cast" and "to" not in dict(attrs):
            self.error("Cast needs its `to` attribute in a template: `Cast(x, to=float32)`", call.loc)
            ok = False
        if not ok or op is None:
            return None
        return P.TemplateCall(op, tuple(args), tuple(attrs), call.loc)


def attr_value(value: ast.AttrValue, error: Callable[..., None]) -> Any:
    """An attribute value as the engine compares it: numbers, strings, lists, constants (true,
    false) and dtype names (DType); _INVALID, reported, for an unknown name."""
    if value.kind in ("number", "string"):
        return value.value
    if value.kind == "list":
        items = [attr_value(v, error) for v in value.value]
        return _INVALID if _INVALID in items else items
    name = value.value
    if name in CONSTANTS:
        return CONSTANTS[name]
    try:
        return DType.from_name(name)
    except ValueError:
        error(f"unknown attribute value {name!r}", value.loc,
              did_you_mean(name, set(dtype_names()) | set(CONSTANTS))
              or "attribute values are numbers, \"strings\", lists, true/false or dtype names")
        return _INVALID


def _arg_names(pat: ast.NodePat) -> set[str]:
    """The captures a pattern reads, nested patterns included (an explicit stack)."""
    out, stack = set(), [pat]
    while stack:
        p = stack.pop()
        for arg in p.args:
            if arg.kind == "capture":
                out.add(arg.name)
            elif arg.kind == "nested":
                stack.append(arg.value)
    return out


_INVALID = object()

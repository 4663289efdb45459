"""AST -> engine.patterns, with the semantic checks.

Every problem becomes a Diagnostic with its file:line:col; all of a file's
problems are reported together. Names that are close to a known one get a
"did you mean".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import patterns as P
from engine.dtypes import DType, dtype_names
from engine.errors import SourceLocation
from engine.guards import BUILTINS, CONSTANTS, SIZE_UNITS
from engine.onnx_ops import ONNX_OPS
from engine.strategies.chunk import CHUNK_KINDS

from . import ast
from .errors import Diagnostic, did_you_mean

KNOWN_DOMAINS = {"com.microsoft", "aten", "prims", "ai.onnx.ml", "ai.onnx.preview.training",
                 "org.pytorch.aten", "pkg.onnxscript.torch_lib"}


@dataclass
class Scope:
    """What the loaded files declared: families, custom ops, op facts."""

    families: dict[str, ast.FamilyDecl] = field(default_factory=dict)
    custom_ops: set[str] = field(default_factory=set)
    custom_domains: set[str] = field(default_factory=set)
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

    def error(self, message: str, loc: SourceLocation, hint: str = "") -> None:
        self.diagnostics.append(Diagnostic(message, loc, hint))

    # declarations -----------------------------------------------------------------
    def declare(self, file: ast.RuleFile) -> None:
        for decl in file.op_decls:
            if decl.kind == "op":
                for ref in decl.ops:
                    domain, sep, _ = ref.name.rpartition("::")
                    if sep:
                        self.scope.custom_domains.add(domain)
                    self.scope.custom_ops.add(ref.name)
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

    def resolve_ops(self, refs: list[ast.OpRef], _seen: frozenset[str] = frozenset()) -> frozenset[str]:
        out: set[str] = set()
        for ref in refs:
            name = ref.name
            if "::" in name:
                domain, _, op = name.rpartition("::")
                if domain in ("", "ai.onnx"):
                    name = op
                elif domain not in KNOWN_DOMAINS | self.scope.custom_domains:
                    hint = did_you_mean(domain, KNOWN_DOMAINS | self.scope.custom_domains)
                    self.error(f"unknown op domain {domain!r} in {ref.name!r}", ref.loc,
                               hint or "declare it with `op domain::Name` if it is a custom op")
                    continue
                out.add(name)
                continue
            if name in self.scope.families:
                if name in _seen:
                    self.error(f"family {name!r} refers to itself", ref.loc)
                    continue
                out |= self.resolve_ops(self.scope.families[name].ops, _seen | {name})
            elif name in ONNX_OPS or name in self.scope.custom_ops:
                out.add(name)
            else:
                known = ONNX_OPS | set(self.scope.families) | self.scope.custom_ops
                self.error(f"unknown op {name!r}", ref.loc,
                           did_you_mean(name, known) or "ops are ONNX operator names, families, "
                           "`domain::Name` (aten::gelu, com.microsoft::BiasGelu), or declared with `op`")
        return frozenset(out)

    # rules -----------------------------------------------------------------------
    def compile_rules(self, file: ast.RuleFile) -> None:
        for decl in file.rules:
            if decl.name in self.scope.rule_names:
                self.error(f"rule {decl.name!r} is defined twice (first at "
                           f"{self.scope.rule_names[decl.name]})", decl.loc)
                continue
            self.scope.rule_names[decl.name] = decl.loc
            before = len(self.diagnostics)
            rule = _RuleCompiler(self, decl).compile()
            if rule is not None and len(self.diagnostics) == before:
                rule.order = len(self.rules)
                self.rules.append(rule)


class _RuleCompiler:
    def __init__(self, owner: Compiler, decl: ast.RuleDecl):
        self.owner = owner
        self.decl = decl
        self.defined: dict[str, tuple[int, int, SourceLocation]] = {}   # capture -> (binding, output, loc)
        self.inputs: set[str] = set()                                    # captures bound to inputs
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
        # A statement is referenced when another one uses its captures (using its own is an error).
        referenced = {self.defined[name][0] for i, b in enumerate(decl.bindings)
                      for name in self._arg_names(b.pattern)
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
        root = self._build(roots[0])
        captures = set(self.defined) | self.inputs
        types = [t for t in (self._type(a, captures) for a in decl.types) if t is not None]
        guards = [P.Guard(e, r.loc, r.text) for r in decl.requires
                  if (e := self._expr(r.expr, captures)) is not None]
        actions = self._actions(captures)
        if not decl.actions:
            self.error(f"rule {decl.name!r} has no rewrite action", decl.loc,
                       "add `recompute y` or `recompute y from x` to its rewrite block")
        if root is None or not actions:
            return None
        return P.Rule(decl.name, root, types, guards, actions, decl.loc, decl.priority,
                      decl.tier or P.DEFAULT_TIER)

    def _arg_names(self, pat: ast.NodePat) -> set[str]:
        out = set()
        for arg in pat.args:
            if arg.kind == "capture":
                out.add(arg.name)
            elif arg.kind == "nested":
                out |= self._arg_names(arg.value)
        return out

    def _build(self, index: int) -> P.NodePattern | None:
        if index in self.built:
            return self.built[index]
        binding = self.decl.bindings[index]
        self.building.add(index)
        pattern = self._node(binding.pattern, [t.name for t in binding.targets])
        self.building.discard(index)
        if pattern is not None:
            pattern.text = binding.text
            self.built[index] = pattern
        return pattern

    def _node(self, pat: ast.NodePat, outputs: list[str | None]) -> P.NodePattern | None:
        ops = self.owner.resolve_ops(pat.ops)
        if not ops:
            return None
        args: list[P.Arg] = []
        attrs: dict[str, Any] = {}
        variadic = None
        for arg in pat.args:
            if variadic is not None and arg.kind != "attr":
                self.error("a variadic capture `xs...` must be the last input", arg.loc)
            if arg.kind == "attr":
                if arg.name in attrs:
                    self.error(f"attribute {arg.name!r} is constrained twice", arg.loc)
                value = self._attr(arg.value)
                if value is not _INVALID:
                    attrs[arg.name] = value
            elif arg.kind == "wildcard":
                args.append(P.Wildcard(arg.loc))
            elif arg.kind == "variadic":
                if pat.commutative:
                    self.error("a commutative pattern `Op{...}` cannot take a variadic capture", arg.loc)
                variadic = arg.name
                self._input_capture(arg.name, arg.loc)
            elif arg.kind == "nested":
                nested = self._node(arg.value, [None])
                if nested is not None:
                    nested.text = arg.value.text
                    args.append(nested)
            elif arg.name in self.defined:
                index, output, _ = self.defined[arg.name]
                if index in self.building:
                    self.error(f"capture {arg.name!r} is used by the statement that defines it", arg.loc)
                    continue
                producer = self._build(index)
                if producer is not None:
                    args.append(producer if output == 0 else P.OutputRef(producer, output, arg.loc))
            else:
                self._input_capture(arg.name, arg.loc)
                args.append(P.CaptureRef(arg.name, arg.loc))
        if pat.commutative and variadic is None and len(args) != 2:
            self.error(f"a commutative pattern `Op{{a, b}}` takes exactly two inputs, got {len(args)}",
                       pat.loc)
        return P.NodePattern(ops, args, attrs, outputs, pat.loc, pat.commutative, variadic, pat.text)

    def _input_capture(self, name: str, loc: SourceLocation) -> None:
        self.inputs.add(name)

    def _attr(self, value: ast.AttrValue) -> Any:
        if value.kind in ("number", "string"):
            return value.value
        if value.kind == "list":
            items = [self._attr(v) for v in value.value]
            return _INVALID if _INVALID in items else items
        name = value.value
        if name in CONSTANTS:
            return CONSTANTS[name]
        try:
            return DType.from_name(name)
        except ValueError:
            self.error(f"unknown attribute value {name!r}", value.loc,
                       did_you_mean(name, set(dtype_names()) | set(CONSTANTS))
                       or "attribute values are numbers, \"strings\", lists, true/false or dtype names")
            return _INVALID

    def _type(self, annot: ast.TypeAnnot, captures: set[str]) -> P.TypePattern | None:
        if annot.name not in captures:
            self.error(f"type annotation for unknown capture {annot.name!r}", annot.loc,
                       did_you_mean(annot.name, captures))
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

    def _expr(self, expr: ast.Expr, captures: set[str]) -> P.Expr | None:
        kind = expr.kind
        if kind == "number":
            value = expr.value
            if expr.unit is not None:
                unit, loc = expr.unit
                if unit not in SIZE_UNITS:
                    self.error(f"unknown size unit {unit!r}", loc,
                               did_you_mean(unit, SIZE_UNITS) or f"units: {', '.join(SIZE_UNITS)}")
                    return None
                value = value * SIZE_UNITS[unit]
                value = int(value) if float(value).is_integer() else value
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
            self.error(f"unknown name {name!r}", expr.loc,
                       did_you_mean(name, captures | set(dtype_names()) | set(CONSTANTS))
                       or f"the rule's captures are: {', '.join(sorted(captures)) or 'none'}")
            return None
        if kind == "call":
            fn = BUILTINS.get(expr.value)
            if fn is None:
                self.error(f"unknown function {expr.value!r}", expr.loc,
                           did_you_mean(expr.value, BUILTINS) or f"functions: {', '.join(sorted(BUILTINS))}")
                return None
            lo, hi = fn.arity
            if not lo <= len(expr.args) <= hi:
                want = str(lo) if lo == hi else f"{lo} to {hi}"
                self.error(f"{expr.value}() takes {want} argument{'s' if hi > 1 else ''}, "
                           f"got {len(expr.args)}", expr.loc)
                return None
            if fn.takes_values and expr.args[0].kind != "name":
                self.error(f"{expr.value}() takes a captured value as its first argument",
                           expr.args[0].loc)
                return None
            args = [self._expr(a, captures) for a in expr.args]
            if any(a is None for a in args):
                return None
            if fn.takes_values and args[0].kind != "ref":
                self.error(f"{expr.value}() takes a captured value, not {expr.args[0].text!r}",
                           expr.args[0].loc, did_you_mean(expr.args[0].value, captures))
                return None
            return P.Expr("call", expr.loc, expr.value, args, expr.text)
        args = [self._expr(a, captures) for a in expr.args]
        if any(a is None for a in args):
            return None
        return P.Expr(kind, expr.loc, expr.value, args, expr.text)

    def _actions(self, captures: set[str]) -> list[P.Action]:
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
            if isinstance(action, ast.RecomputeAction):
                actions.append(P.Recompute(action.target[0], [n for n, _ in action.sources], action.loc))
            elif isinstance(action, ast.ChunkAction):
                count = self._expr(action.count, captures)
                if count is not None:
                    actions.append(P.Chunk([n for n, _ in action.names], action.dim, count, action.loc))
            else:
                actions.append(P.Save([n for n, _ in action.names], action.loc))
        chunk = next((a for a in actions if isinstance(a, P.Chunk)), None)
        if chunk is not None and len(actions) > 1:
            self.error("a chunk rule cannot also recompute or save", chunk.location,
                       "put the recompute in a rule of its own")
            return []
        return actions


_INVALID = object()

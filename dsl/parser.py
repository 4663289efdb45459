"""Text -> AST with Lark (LALR). Syntax errors become positioned Diagnostics.

Lark's LALR parser keeps its own stack, and the parse tree becomes the AST through a
non-recursive transformer, so no nesting reaches Python's recursion limit here; the
nesting limits (dsl.limits) are checked on the parse tree before the AST is built.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Tree, v_args
from lark.exceptions import (UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken,
                             VisitError)
from lark.visitors import Transformer_NonRecursive

from engine.errors import SourceLocation

from . import ast
from .errors import Diagnostic, RuleCompileError
from .limits import MAX_LITERAL, check_tree

_GRAMMAR = Path(__file__).with_name("grammar.lark")

_READABLE = {
    "_NL": "end of line", "NAME": "a name", "QUALNAME": "a qualified op (domain::Op)",
    "NUMBER": "a number", "SIGNED_NUMBER": "a number", "SIGNED_INT": "an integer", "INT": "an integer",
    "STRING": "a string", "WILDCARD": "'_'", "ELLIPSIS": "'...'", "COMP_OP": "a comparison",
    "ADD_OP": "'+' or '-'", "MUL_OP": "'*' or '/'", "$END": "end of file",
    "LPAR": "'('", "RPAR": "')'", "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'",
    "COMMA": "','", "EQUAL": "'='", "COLON": "':'", "DOT": "'.'", "VBAR": "'|'", "MINUS": "'-'",
    "RANGE": "'..'",
}


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(_GRAMMAR.read_text(), parser="lalr", propagate_positions=True,
                maybe_placeholders=False)


def _readable(name: str) -> str:
    if name in _READABLE:
        return _READABLE[name]
    try:
        pattern = _parser().get_terminal(name).pattern
        if pattern.type == "str":
            return repr(pattern.value)
    except KeyError:
        pass
    return name


def _describe_token(token: Token) -> str:
    if token.type == "_NL":
        return "end of line"
    if token.type == "$END":
        return "end of file"
    return repr(_short(str(token)))


def _syntax_error(err: UnexpectedInput, path: str, text: str) -> Diagnostic:
    line = getattr(err, "line", None) or 1
    column = getattr(err, "column", None) or 1
    if line < 0 or column < 0:  # UnexpectedEOF without a position: point past the text
        lines = text.rstrip("\n").split("\n")
        line, column = len(lines), len(lines[-1]) + 1
    expected = sorted({_readable(t) for t in (getattr(err, "expected", None) or ())
                       if not t.startswith("__")})
    hint = f"expected {', '.join(expected[:8])}{', ...' if len(expected) > 8 else ''}" if expected else ""
    if isinstance(err, UnexpectedCharacters):
        ch = text[err.pos_in_stream] if 0 <= err.pos_in_stream < len(text) else "?"
        message = f"unexpected character {ch!r}"
    elif isinstance(err, UnexpectedToken):
        token = err.token
        if token.type == "_NL":  # a newline token starts on the line it ends
            line, column = token.line, token.column
        message = f"unexpected {_describe_token(token)}"
    elif isinstance(err, UnexpectedEOF):
        message = "unexpected end of file"
    else:
        message = "syntax error"
    return Diagnostic(message, SourceLocation(path, line, column), hint)


def parse(text: str, path: str = "<string>") -> ast.RuleFile:
    """Parse one rule file. Raises RuleCompileError (never a Lark or Python error)."""
    source = text if text.endswith("\n") else text + "\n"
    try:
        tree = _parser().parse(source)
        diagnostics = check_tree(tree, path)
        if diagnostics:
            raise RuleCompileError(diagnostics, {path: source})
        builder = _Builder(path, source)
        file = builder.build(tree)
    except UnexpectedInput as err:
        raise RuleCompileError([_syntax_error(err, path, source)], {path: source}) from None
    except VisitError as err:
        if not isinstance(err.orig_exc, RecursionError):
            raise
        raise RuleCompileError([too_deep_anywhere(path)], {path: source}) from None
    except RecursionError:
        raise RuleCompileError([too_deep_anywhere(path)], {path: source}) from None
    if builder.diagnostics:
        raise RuleCompileError(builder.diagnostics, {path: source})
    return file


def too_deep_anywhere(path: str) -> Diagnostic:
    """The last resort when a limit check missed something: still a diagnostic, not a traceback."""
    return Diagnostic("the file is nested too deeply to process", SourceLocation(path, 1, 1),
                      "split deep patterns and long expressions into several statements or rules")


class _Builder(Transformer_NonRecursive):
    """Parse tree -> AST with an explicit stack (no recursion, whatever the nesting). Bad
    literals and repeated rule options are collected in `diagnostics`."""

    def __init__(self, path: str, text: str):
        super().__init__(visit_tokens=False)
        self.path = path
        self.text = text
        self.diagnostics: list[Diagnostic] = []

    def error(self, message: str, loc: SourceLocation, hint: str = "") -> None:
        self.diagnostics.append(Diagnostic(message, loc, hint))

    def build(self, tree: Tree) -> ast.RuleFile:
        out = ast.RuleFile(self.path)
        for item in self.transform(tree).children:
            if isinstance(item, ast.Use):
                out.uses.append(item)
            elif isinstance(item, ast.FamilyDecl):
                out.families.append(item)
            elif isinstance(item, ast.OpDecl):
                out.op_decls.append(item)
            elif isinstance(item, ast.CostDecl):
                out.costs.append(item)
            elif isinstance(item, ast.ReplayDecl):
                out.replays.append(item)
            elif isinstance(item, ast.RuleDecl):
                out.rules.append(item)
        return out

    def _loc(self, item) -> SourceLocation:
        return SourceLocation(self.path, getattr(item, "line", None) or 1, getattr(item, "column", None) or 1)

    def _text(self, meta) -> str:
        if getattr(meta, "empty", True):
            return ""
        return self.text[meta.start_pos:meta.end_pos]

    def _named(self, tok: Token) -> tuple[str, SourceLocation]:
        return str(tok), self._loc(tok)

    @v_args(meta=True)
    def use_decl(self, meta, children):
        return ast.Use(children[0], self._loc(meta))

    def module_name(self, children):
        return ".".join(str(c) for c in children)

    def op_ref(self, children):
        tok = children[0]
        return ast.OpRef(str(tok), self._loc(tok))

    def op_list(self, children):
        return list(children)

    op_alts = op_list

    @v_args(meta=True)
    def family_decl(self, meta, children):
        return ast.FamilyDecl(str(children[0]), children[1], self._loc(meta))

    def tier_clause(self, children):
        return str(children[0])

    def _op_decl(kind):  # noqa: N805 - a small factory used at class creation
        @v_args(meta=True)
        def build(self, meta, children):
            if kind == "chunkable":
                return ast.OpDecl(kind, children[1], self._loc(meta), detail=self._named(children[0]))
            if kind == "op":
                signature = children[1] if len(children) > 1 else None
                return ast.OpDecl(kind, children[0], self._loc(meta), signature=signature)
            tier = children[1] if len(children) > 1 else None
            return ast.OpDecl(kind, children[0], self._loc(meta), tier)

        return build

    op_decl = _op_decl("op")
    recomputable_decl = _op_decl("recomputable")
    view_decl = _op_decl("view")
    nondet_decl = _op_decl("nondeterministic")
    chunkable_decl = _op_decl("chunkable")
    linear_decl = _op_decl("linear_in_gradient")
    additive_decl = _op_decl("additive_in_gradient")

    # `op domain::Name outputs 1..2 attrs alpha: float`
    @v_args(meta=True)
    def op_signature(self, meta, children):
        sig = ast.OpSignature(self._loc(meta))
        for kind, value, loc in children:
            if kind == "outputs":
                sig.outputs, sig.outputs_loc = value, loc
            else:
                sig.attrs = value
        return sig

    @v_args(meta=True)
    def outputs_clause(self, meta, children):
        ints = [t for t in children if t.type == "INT"]
        low = self._int(ints[0])
        if not any(t.type == "RANGE" for t in children):
            high: int | None = low
        else:
            high = self._int(ints[1]) if len(ints) > 1 else None
        if low < 1:
            self.error("an op has at least one output", self._loc(ints[0]))
        elif high is not None and high < low:
            self.error(f"empty output range {low}..{high}", self._loc(ints[1]))
        return ("outputs", (low, high), self._loc(meta))

    @v_args(meta=True)
    def attrs_clause(self, meta, children):
        return ("attrs", list(children), self._loc(meta))

    def attr_sig(self, children):
        name, kind = children
        return ast.AttrSig(str(name), str(kind), self._loc(name), self._loc(kind))

    @v_args(meta=True)
    def cost_decl(self, meta, children):
        targets, pattern, flops = children[:3]
        extra = children[3] if len(children) > 3 else None
        return ast.CostDecl(targets, pattern, flops, extra[1] if extra else None, self._loc(meta),
                            self._text(meta).strip())

    @v_args(meta=True)
    def replay_decl(self, meta, children):
        targets, pattern, template = children
        return ast.ReplayDecl(targets, pattern, template, self._loc(meta), self._text(meta).strip())

    @v_args(meta=True)
    def template(self, meta, children):
        return ast.TemplateCall(children[0], list(children[1:]), self._loc(meta))

    def template_attr(self, children):
        return ast.TemplateArg("attr", self._loc(children[0]), str(children[0]), children[1])

    def template_capture(self, children):
        return ast.TemplateArg("capture", self._loc(children[0]), str(children[0]))

    def template_literal(self, children):
        tok = children[0]
        return ast.TemplateArg("literal", self._loc(tok), value=self._number(tok))

    def template_nested(self, children):
        return ast.TemplateArg("nested", children[0].loc, value=children[0])

    def cost_bytes(self, children):
        return ("bytes", children[0])

    @v_args(meta=True)
    def rule(self, meta, children):
        name = children[0]
        decl = ast.RuleDecl(str(name), self._loc(name))
        options: dict[str, SourceLocation] = {}
        for child in children[1:]:
            if isinstance(child, tuple) and child[0] in ("priority", "tier"):
                option, value, loc = child
                if option in options:
                    self.error(f"rule {decl.name!r} gives its {option} twice (first at {options[option]})",
                               loc, f"a rule has one {option}")
                    continue
                options[option] = loc
                setattr(decl, option, value)
            elif isinstance(child, tuple) and child[0] == "match":
                for stmt in child[1]:
                    if isinstance(stmt, ast.Binding):
                        decl.bindings.append(stmt)
                    elif isinstance(stmt, ast.TypeAnnot):
                        decl.types.append(stmt)
                    else:
                        decl.requires.append(stmt)
            elif isinstance(child, tuple) and child[0] == "rewrite":
                decl.actions = child[1]
        return decl

    @v_args(meta=True)
    def priority(self, meta, children):
        return ("priority", self._int(children[0]), self._loc(meta))

    @v_args(meta=True)
    def tier(self, meta, children):
        return ("tier", str(children[0]), self._loc(meta))

    def match_block(self, children):
        return ("match", list(children))

    def rewrite_block(self, children):
        return ("rewrite", list(children))

    @v_args(meta=True)
    def binding(self, meta, children):
        return ast.Binding(children[0], children[1], self._loc(meta), self._text(meta))

    def targets(self, children):
        return list(children)

    def target(self, children):
        tok = children[0]
        return ast.Target(None if tok.type == "WILDCARD" else str(tok), self._loc(tok))

    @v_args(meta=True)
    def ordered_pat(self, meta, children):
        return ast.NodePat(children[0], list(children[1:]), False, self._loc(meta), self._text(meta))

    @v_args(meta=True)
    def commutative_pat(self, meta, children):
        return ast.NodePat(children[0], list(children[1:]), True, self._loc(meta), self._text(meta))

    def attr_arg(self, children):
        return ast.Arg("attr", self._loc(children[0]), str(children[0]), children[1])

    def variadic_arg(self, children):
        return ast.Arg("variadic", self._loc(children[0]), str(children[0]))

    def wildcard_arg(self, children):
        return ast.Arg("wildcard", self._loc(children[0]))

    def capture_arg(self, children):
        return ast.Arg("capture", self._loc(children[0]), str(children[0]))

    def nested_arg(self, children):
        return ast.Arg("nested", children[0].loc, value=children[0])

    def attr_number(self, children):
        tok = children[0]
        return ast.AttrValue("number", self._number(tok), self._loc(tok))

    def attr_string(self, children):
        tok = children[0]
        return ast.AttrValue("string", self._unquote(tok), self._loc(tok))

    def attr_name(self, children):
        tok = children[0]
        return ast.AttrValue("name", str(tok), self._loc(tok))

    @v_args(meta=True)
    def attr_list(self, meta, children):
        return ast.AttrValue("list", list(children), self._loc(meta))

    @v_args(meta=True)
    def type_annot(self, meta, children):
        dtypes, dims = children[1]
        return ast.TypeAnnot(str(children[0]), dtypes, dims, self._loc(meta), self._text(meta))

    def type_spec(self, children):
        dtypes, dims = [], None
        for c in children:
            if isinstance(c, tuple) and c[0] == "dtypes":
                dtypes = c[1]
            else:
                dims = c
        return dtypes, dims

    def dtype_alts(self, children):
        return ("dtypes", [self._named(t) for t in children])

    def shape(self, children):
        return list(children)

    def dim_int(self, children):
        return ast.Dim("int", self._int(children[0]), self._loc(children[0]))

    def dim_name(self, children):
        return ast.Dim("name", str(children[0]), self._loc(children[0]))

    def dim_any(self, children):
        return ast.Dim("any", None, self._loc(children[0]))

    def dim_rest(self, children):
        return ast.Dim("rest", None, self._loc(children[0]))

    @v_args(meta=True)
    def require(self, meta, children):
        return ast.Require(children[0], self._loc(meta), self._text(meta))

    @v_args(meta=True)
    def recompute_action(self, meta, children):
        named = [self._named(t) for t in children]
        return ast.RecomputeAction(named[0], named[1:], self._loc(meta))

    @v_args(meta=True)
    def save_action(self, meta, children):
        return ast.SaveAction([self._named(t) for t in children], self._loc(meta))

    @v_args(meta=True)
    def chunk_action(self, meta, children):
        names = [self._named(t) for t in children if isinstance(t, Token) and t.type == "NAME"]
        dim = next(t for t in children if isinstance(t, Token) and t.type == "SIGNED_INT")
        return ast.ChunkAction(names, self._int(dim), children[-1], self._loc(meta), self._loc(dim))

    # expressions
    def _expr(self, meta, kind, value=None, args=(), unit=None):
        span = (0, 0) if getattr(meta, "empty", True) else (meta.start_pos, meta.end_pos)
        return ast.Expr(kind, self._loc(meta), value, list(args), unit, self.text[span[0]:span[1]], span)

    @v_args(meta=True)
    def or_expr(self, meta, children):
        return self._left_fold(meta, children, ["or"] * (len(children) - 1))

    @v_args(meta=True)
    def and_expr(self, meta, children):
        return self._left_fold(meta, children, ["and"] * (len(children) - 1))

    def _left_fold(self, meta, operands, operators):
        """`a + b - c` -> ((a + b) - c); each binop's text is its own part of the chain."""
        result = operands[0]
        start = meta.start_pos
        for op, rhs in zip(operators, operands[1:]):
            span = (start, rhs.span[1])
            result = ast.Expr("binop", self._loc(meta), str(op), [result, rhs], None,
                              self.text[span[0]:span[1]], span)
        return result

    @v_args(meta=True)
    def not_op(self, meta, children):
        return self._expr(meta, "not", None, children)

    @v_args(meta=True)
    def comparison(self, meta, children):
        return self._expr(meta, "binop", str(children[1]), [children[0], children[2]])

    @v_args(meta=True)
    def sum(self, meta, children):
        return self._left_fold(meta, children[0::2], children[1::2])

    product = sum

    @v_args(meta=True)
    def neg(self, meta, children):
        return self._expr(meta, "neg", None, children)

    @v_args(meta=True)
    def number(self, meta, children):
        unit = self._named(children[1]) if len(children) > 1 else None
        return self._expr(meta, "number", self._number(children[0]), unit=unit)

    @v_args(meta=True)
    def call(self, meta, children):
        return self._expr(meta, "call", str(children[0]), children[1:])

    @v_args(meta=True)
    def name(self, meta, children):
        return self._expr(meta, "name", str(children[0]))

    @v_args(meta=True)
    def string(self, meta, children):
        return self._expr(meta, "string", self._unquote(children[0]))

    # literals
    def _number(self, tok: Token) -> int | float:
        """A number literal; one that is not finite or not strictly between -2**63 and 2**63 is
        refused (and read as 0) before Python's int-string limit or an infinity can bite."""
        text = str(tok)
        if not any(c in text for c in ".eE"):
            return self._int(tok)
        value = float(text)
        if not math.isfinite(value) or abs(value) >= MAX_LITERAL:
            self.error(f"number {_short(text)} is out of range", self._loc(tok),
                       "numbers lie strictly between -2**63 and 2**63")
            return 0
        mantissa = text.lstrip("+-").lower().split("e")[0]
        if value == 0 and mantissa.strip("0.") != "":
            self.error(f"number {_short(text)} is too small: it would be read as 0", self._loc(tok))
            return 0
        return value

    def _int(self, tok: Token) -> int:
        text = str(tok)
        digits = text.lstrip("+-").lstrip("0") or "0"
        value = int(digits) if len(digits) <= 19 else MAX_LITERAL   # 19 digits: far from int()'s limit
        if value >= MAX_LITERAL:
            self.error(f"integer {_short(text)} is out of range", self._loc(tok),
                       "integers lie strictly between -2**63 and 2**63")
            return 0
        return -value if text.startswith("-") else value

    def _unquote(self, tok: Token) -> str:
        """A string literal's value. The escapes are the ones _ESCAPES lists; any other is an error."""
        body = str(tok)[1:-1]
        if "\\" not in body:
            return body
        out, i = [], 0
        while i < len(body):
            if body[i] != "\\":
                out.append(body[i])
                i += 1
                continue
            escape = body[i + 1]    # the STRING terminal never ends in a lone backslash
            if escape not in _ESCAPES:
                self.error(f"unknown escape {body[i:i + 2]!r} in a string",
                           SourceLocation(self.path, tok.line, tok.column + 1 + i),
                           "the escapes are " + " ".join("\\" + e for e in _ESCAPES))
                return body
            out.append(_ESCAPES[escape])
            i += 2
        return "".join(out)


_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]} ({len(text)} characters)"

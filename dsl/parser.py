"""Text -> AST with Lark (LALR). Syntax errors become positioned Diagnostics."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from engine.errors import SourceLocation

from . import ast
from .errors import Diagnostic, RuleCompileError

_GRAMMAR = Path(__file__).with_name("grammar.lark")

_READABLE = {
    "_NL": "end of line", "NAME": "a name", "QUALNAME": "a qualified op (domain::Op)",
    "NUMBER": "a number", "SIGNED_NUMBER": "a number", "SIGNED_INT": "an integer", "INT": "an integer",
    "STRING": "a string", "WILDCARD": "'_'", "ELLIPSIS": "'...'", "COMP_OP": "a comparison",
    "ADD_OP": "'+' or '-'", "MUL_OP": "'*' or '/'", "$END": "end of file",
    "LPAR": "'('", "RPAR": "')'", "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'",
    "COMMA": "','", "EQUAL": "'='", "COLON": "':'", "DOT": "'.'", "VBAR": "'|'", "MINUS": "'-'",
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
    return repr(str(token))


def _syntax_error(err: UnexpectedInput, path: str, text: str) -> Diagnostic:
    line = getattr(err, "line", None) or 1
    column = getattr(err, "column", None) or 1
    if line < 0 or column < 0:  # UnexpectedEOF without a position: point past the text
        lines = text.splitlines() or [""]
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
    except UnexpectedInput as err:
        raise RuleCompileError([_syntax_error(err, path, source)], {path: source}) from None
    except RecursionError:
        raise RuleCompileError([Diagnostic("expression nested too deeply",
                                           SourceLocation(path, 1, 1))], {path: source}) from None
    return _Builder(path, source).build(tree)


class _Builder(Transformer):
    def __init__(self, path: str, text: str):
        super().__init__(visit_tokens=False)
        self.path = path
        self.text = text

    def build(self, tree: Tree) -> ast.RuleFile:
        out = ast.RuleFile(self.path)
        for item in self.transform(tree).children:
            if isinstance(item, ast.Use):
                out.uses.append(item)
            elif isinstance(item, ast.FamilyDecl):
                out.families.append(item)
            elif isinstance(item, ast.OpDecl):
                out.op_decls.append(item)
            elif isinstance(item, ast.RuleDecl):
                out.rules.append(item)
        return out

    def _loc(self, item) -> SourceLocation:
        if isinstance(item, Token):
            return SourceLocation(self.path, item.line, item.column)
        return SourceLocation(self.path, item.line, item.column)

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

    @v_args(meta=True)
    def rule(self, meta, children):
        name = children[0]
        decl = ast.RuleDecl(str(name), self._loc(name))
        for child in children[1:]:
            if isinstance(child, tuple) and child[0] == "priority":
                decl.priority = child[1]
            elif isinstance(child, tuple) and child[0] == "tier":
                decl.tier = child[1]
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

    def priority(self, children):
        return ("priority", int(children[0]))

    def tier(self, children):
        return ("tier", str(children[0]))

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
        return ast.AttrValue("number", _number(str(tok)), self._loc(tok))

    def attr_string(self, children):
        tok = children[0]
        return ast.AttrValue("string", _unquote(str(tok)), self._loc(tok))

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
        return ast.Dim("int", int(children[0]), self._loc(children[0]))

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
        dim = next(int(t) for t in children if isinstance(t, Token) and t.type == "SIGNED_INT")
        return ast.ChunkAction(names, dim, children[-1], self._loc(meta))

    # expressions
    def _expr(self, meta, kind, value=None, args=(), unit=None):
        return ast.Expr(kind, self._loc(meta), value, list(args), unit, self._text(meta))

    @v_args(meta=True)
    def or_expr(self, meta, children):
        return self._left_fold(meta, children, ["or"] * (len(children) - 1))

    @v_args(meta=True)
    def and_expr(self, meta, children):
        return self._left_fold(meta, children, ["and"] * (len(children) - 1))

    def _left_fold(self, meta, operands, operators):
        result = operands[0]
        for op, rhs in zip(operators, operands[1:]):
            result = self._expr(meta, "binop", str(op), [result, rhs])
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
        return self._expr(meta, "number", _number(str(children[0])), unit=unit)

    @v_args(meta=True)
    def call(self, meta, children):
        return self._expr(meta, "call", str(children[0]), children[1:])

    @v_args(meta=True)
    def name(self, meta, children):
        return self._expr(meta, "name", str(children[0]))

    @v_args(meta=True)
    def string(self, meta, children):
        return self._expr(meta, "string", _unquote(str(children[0])))


def _number(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)


def _unquote(text: str) -> str:
    body = text[1:-1]
    return body.encode("utf-8").decode("unicode_escape") if "\\" in body else body

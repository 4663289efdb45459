"""Size limits of the rule language, and the checks that enforce them without recursion.

Patterns and guard expressions are trees that the compiler, the matcher and the guard
evaluator walk recursively. Bounding their depth here (with explicit stacks, so that a
file of any depth is measured safely) is what keeps every later pass far from Python's
recursion limit: a rule that is too deep gets a positioned error instead of a traceback.
"""
from __future__ import annotations

from lark import Token, Tree

from engine.errors import SourceLocation
from engine.patterns import MAX_EXPR_DEPTH, MAX_PATTERN_DEPTH

from . import ast
from .errors import Diagnostic

# MAX_PATTERN_DEPTH (64, engine.patterns): ops nested in ops, through nested patterns and
# captured outputs. MAX_EXPR_DEPTH (256, engine.patterns): guard and chunk-count expressions,
# where a chain `a + b + ...` counts its length. The engine refuses deeper rules too.
# A pattern's size is not limited: a statement several inputs read is one shared pattern, which
# the compiler builds once and the matcher matches once per node (engine.matcher), so `a1 =
# Add(a0, a0)`, `a2 = Add(a1, a1)`, ... costs its number of statements, not 2**n.
MAX_LITERAL = 2**63           # every number literal lies strictly between -MAX_LITERAL and MAX_LITERAL
MAX_CHUNK_DIM = 64            # `chunk ... along D` needs |D| < MAX_CHUNK_DIM

_PATTERNS = {"ordered_pat", "commutative_pat", "template"}
_CHAINS = {"or_expr", "and_expr", "sum", "product"}      # n operands fold into n - 1 nested binops
_EXPRS = _CHAINS | {"not_op", "comparison", "neg", "number", "call", "name", "string"}
_STATEMENTS = {"binding", "require", "chunk_action", "replay_decl"}


def too_deep(what: str, limit: int, loc: SourceLocation) -> Diagnostic:
    return Diagnostic(f"{what} nested too deeply (limit {limit})", loc,
                      "split it into several statements or rules")


def _loc(path: str, node: Tree | Token) -> SourceLocation:
    if isinstance(node, Token):
        return SourceLocation(path, node.line or 1, node.column or 1)
    return SourceLocation(path, getattr(node.meta, "line", 1), getattr(node.meta, "column", 1))


def check_tree(tree: Tree, path: str) -> list[Diagnostic]:
    """Nesting limits on the parse tree, before it is transformed into the AST: patterns in
    patterns, expression depth (as the AST will have it) and lists in attribute lists. One
    diagnostic per statement: where its first node crosses a limit."""
    diagnostics: list[Diagnostic] = []
    reported: set[int] = set()
    # (node, patterns around it, expression depth of its parent, inside an attribute list, statement)
    stack: list[tuple[Tree, int, int, bool, int]] = [(tree, 0, 0, False, 0)]
    while stack:
        node, patterns, depth, in_list, statement = stack.pop()
        if statement in reported:
            continue
        data = node.data
        problem = None
        if data in _PATTERNS:
            patterns += 1
            if patterns > MAX_PATTERN_DEPTH:
                problem = too_deep("pattern", MAX_PATTERN_DEPTH, _loc(path, node))
        if data == "attr_list":
            if in_list:
                problem = Diagnostic("attribute lists cannot be nested", _loc(path, node),
                                     "an attribute value is a number, a string, a name or one flat list of them")
            in_list = True
        children = [c for c in node.children if isinstance(c, Tree)]
        if data in _EXPRS and problem is None:
            width = len(children) - 1 if data in _CHAINS else 1    # the operands sit below n - 1 binops
            if depth + width > MAX_EXPR_DEPTH:
                where = children[min(len(children) - 1, MAX_EXPR_DEPTH - depth)] if data in _CHAINS else node
                problem = too_deep("expression", MAX_EXPR_DEPTH, _loc(path, where))
            depth += width
        elif data not in _EXPRS:
            depth = 0
        if problem is not None:
            diagnostics.append(problem)
            reported.add(statement)
            continue
        if data in _STATEMENTS:
            statement = id(node)
        stack.extend((c, patterns, depth, in_list, statement) for c in reversed(children))
    return diagnostics


def expr_too_deep(expr: ast.Expr) -> ast.Expr | None:
    """The first sub-expression deeper than MAX_EXPR_DEPTH (the AST as built), or None."""
    stack = [(expr, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_EXPR_DEPTH:
            return node
        stack.extend((a, depth + 1) for a in node.args)
    return None


def pattern_shape(rule: ast.RuleDecl, producers: dict[str, int]) -> tuple[int, ast.NodePat | None]:
    """Depth of each statement's pattern, captured outputs followed into the statements that
    produce them (`producers`: capture -> statement index), each statement measured once.
    Returns the largest depth and a pattern where the depth limit is crossed (or None).
    Statements in a cycle count as leaves there (the compiler reports the cycle)."""
    n = len(rule.bindings)
    depth = [0] * n
    state = [0] * n               # 0 new, 1 on the stack, 2 done
    worst: ast.NodePat | None = None
    for start in range(n):
        if state[start]:
            continue
        stack = [start]
        while stack:
            i = stack[-1]
            if state[i] == 0:
                state[i] = 1
                stack.extend(j for j in _references(rule.bindings[i].pattern, producers) if state[j] == 0)
                continue
            stack.pop()
            if state[i] == 2:
                continue
            state[i] = 2
            depth[i], where = _measure(rule.bindings[i].pattern, producers, depth, state)
            worst = worst or where
    return max(depth, default=0), worst


def _references(pat: ast.NodePat, producers: dict[str, int]) -> list[int]:
    out, stack = [], [pat]
    while stack:
        p = stack.pop()
        for arg in p.args:
            if arg.kind == "nested":
                stack.append(arg.value)
            elif arg.kind == "capture" and arg.name in producers:
                out.append(producers[arg.name])
    return out


def _measure(pat: ast.NodePat, producers: dict[str, int], depth: list[int],
             state: list[int]) -> tuple[int, ast.NodePat | None]:
    """Depth of one statement's pattern, its producers already measured."""
    best_depth, where = 0, None
    stack = [(pat, 1)]
    while stack:
        p, level = stack.pop()
        best_depth = max(best_depth, level)
        if level > MAX_PATTERN_DEPTH and where is None:
            where = p
        for arg in p.args:
            if arg.kind == "nested":
                stack.append((arg.value, level + 1))
            elif arg.kind == "capture" and arg.name in producers and state[producers[arg.name]] == 2:
                j = producers[arg.name]
                best_depth = max(best_depth, level + depth[j])
                if level + depth[j] > MAX_PATTERN_DEPTH and where is None:
                    where = p
    return best_depth, where

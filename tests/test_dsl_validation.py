"""Rules that could never do what they say, or that broke the compiler, are refused with a
positioned diagnostic: nesting limits, number literals, attributes and outputs against op
schemas, guard types, repeated rule options, chunk dims and counts. One class per section."""
import time

import pytest
from ir_graphs import GraphBuilder

from dsl.errors import RuleCompileError
from dsl.loader import compile_text
from dsl.typecheck import BUILTIN_TYPES
from engine import patterns as P
from engine.errors import RuleError, SourceLocation
from engine.guards import BUILTINS
from engine.matcher import MatchContext, match, try_match


def diagnostics(text: str):
    with pytest.raises(RuleCompileError) as info:
        compile_text(text, "t.rule")
    return info.value.diagnostics


def diag(text: str):
    return diagnostics(text)[0]


def rule(match: str, rewrite: str = "recompute y", header: str = "rule r") -> str:
    """A rule whose match statements start on line 3, column 5."""
    body = "\n".join("    " + line for line in match.strip().splitlines())
    return f"{header} {{\n  match {{\n{body}\n  }}\n  rewrite {{ {rewrite} }}\n}}\n"


def assert_diag(text: str, message: str, line: int, col: int) -> None:
    d = diag(text)
    assert message in d.message or message in d.hint, d.message
    assert (d.loc.file, d.loc.line, d.loc.column) == ("t.rule", line, col), str(d.loc)
    with pytest.raises(RuleCompileError) as info:
        compile_text(text, "t.rule")
    assert f"t.rule:{line}:{col}: error: " in str(info.value)


# 1. nesting: limits, measured without recursion --------------------------------------------

def _nested(n: int) -> str:
    return "y = " + "Relu(" * n + "x" + ")" * n


@pytest.mark.parametrize("text, line, col", [
    # the 65th Relu: `    y = ` is 8 characters, each `Relu(` 5
    (rule(_nested(2000)), 3, 9 + 5 * 64),
    (rule(_nested(65)), 3, 9 + 5 * 64),
    # statement k+1 (line k+3) is `a{k+1} = Relu(a{k})`: a65's pattern is the 65th op deep
    (rule("\n".join(f"a{i + 1} = Relu(a{i})" for i in range(2000)), "recompute a2000"), 67, 11),
])
def test_deep_patterns_are_refused_at_the_op_past_the_limit(text, line, col):
    assert_diag(text, "pattern nested too deeply (limit 64)", line, col)


def test_patterns_at_the_limit_compile():
    compile_text(rule(_nested(64)), "t.rule")
    compile_text(rule("\n".join(f"a{i + 1} = Relu(a{i})" for i in range(64)), "recompute a64"), "t.rule")


@pytest.mark.parametrize("require, col", [
    # 20,000 terms: the comparison is one level, the fold of n operands n - 1 more; the 256th
    # operand (index 255, `1+` is 2 characters, the expression starts at column 13) crosses it
    ("+".join(["1"] * 20000) + " > 0", 13 + 2 * 255),
    (" and ".join(["saved(y)"] * 2000), 13 + 13 * 256),
    ("not " * 2000 + "saved(y)", 13 + 4 * 256),
    ("-" * 2000 + "bytes(y) > 0", 13 + 255),
    ("ceil(" * 2000 + "1" + ")" * 2000 + " > 0", 13 + 5 * 255),
    # nested parens around sums, `(1 + ` per level: level k's `1` is at depth 1 + k + 1
    ("(1 + " * 2000 + "1" + ")" * 2000 + " > 0", 13 + 5 * 254 + 1),
])
def test_deep_expressions_are_refused(require, col):
    assert_diag(rule("y = Gelu(x)\nrequire " + require), "expression nested too deeply (limit 256)", 4, col)


def test_deep_chunk_count_is_refused():
    text = rule("y = MatMul(x, w)", "chunk over y along 0 into " + "+".join(["1"] * 5000))
    d = diag(text)
    assert "expression nested too deeply (limit 256)" in d.message and d.loc.line == 5


def test_parens_alone_add_no_depth_and_the_limit_holds_exactly():
    compile_text(rule("y = Gelu(x)\nrequire " + "(" * 3000 + "saved(y)" + ")" * 3000), "t.rule")
    compile_text(rule("y = Gelu(x)\nrequire " + "not " * 254 + "saved(y)"), "t.rule")   # depth 256
    assert "limit 256" in diag(rule("y = Gelu(x)\nrequire " + "not " * 255 + "saved(y)")).message


def test_nested_attribute_lists_are_refused():
    assert_diag(rule("y = Softmax(x, axis=" + "[" * 3000 + "]" * 3000 + ")"),
                "attribute lists cannot be nested", 3, 26)


def _chain_rule(n: int, bottom: str = "Relu", commutative: bool = False) -> str:
    """`a1 = Relu(a0)`, `a2 = Add(a1, a1)`, ... `an = Add(a{n-1}, a{n-1})`: 2**(n-1) ops expanded."""
    o, c = "{}" if commutative else "()"
    stmts = [f"a1 = {bottom}(a0)"] + [f"a{i + 1} = Add{o}a{i}, a{i}{c}" for i in range(1, n)]
    return rule("\n".join(stmts), f"recompute a{n}")


def _chain_graph(n: int):
    """a1 = Relu(x), a{i+1} = Add(a{i}, a{i})."""
    b = GraphBuilder()
    a = b.op("Relu", [b.input("x", shape=(4, 4))], name="a1")
    for i in range(1, n):
        a = b.op("Add", [a, a], name=f"a{i + 1}")
    return b.graph([a])


@pytest.mark.parametrize("commutative", [False, True])
def test_a_pattern_that_reuses_statements_compiles_and_matches_in_linear_time(commutative):
    """Each statement is one pattern however many inputs read it, matched once per node: 63
    statements (the depth limit is 64) expand to 2**62 ops, which the matcher never walks."""
    n = 63
    start = time.perf_counter()
    rules = compile_text(_chain_rule(n, commutative=commutative), "t.rule")
    graph = _chain_graph(n)
    [found] = match(graph, rules)
    assert found.root is graph.nodes[-1]
    assert [node.name for node in found.nodes] == [f"n_a{i}" for i in range(n, 0, -1)]   # each once
    assert set(found.bindings) == {f"a{i}" for i in range(n + 1)}                          # captures only
    assert found.bindings["a0"] is graph.nodes[0].inputs[0]
    failing = compile_text(_chain_rule(n, bottom="Gelu", commutative=commutative), "t.rule")
    assert match(graph, failing) == []
    reason = try_match(failing.rules[0], graph.nodes[-1], MatchContext(graph, failing))
    assert "`a1 = Gelu(a0)` needs op Gelu, found Relu (n_a1)" in str(reason)
    assert time.perf_counter() - start < 20      # 2**63 steps would never finish


def test_a_statement_read_twice_binds_one_node():
    rules = compile_text(rule("s = Relu(x)\ny = Add(s, s)"), "t.rule")
    b = GraphBuilder()
    x = b.input("x", shape=(4, 4))
    r1, r2 = b.op("Relu", [x], name="r1"), b.op("Relu", [x], name="r2")
    b.op("Add", [r1, r1], name="same")
    b.op("Add", [r1, r2], name="two")
    graph = b.graph([b.nodes[-1].outputs[0]])
    [found] = match(graph, rules)
    assert found.root.name == "n_same" and found.bindings["s"] is r1 and found.nodes == [graph.nodes[2], graph.nodes[0]]
    reason = try_match(rules.rules[0], graph.nodes[3], MatchContext(graph, rules))
    assert "capture 's' would be both %r1 and %r2" in str(reason)


def test_a_shared_commutative_statement_takes_the_order_the_other_inputs_agree_with():
    """`s = Add{a, b}` read twice, with `a` bound first by another input: matched on its own,
    s binds a to Add's first operand; the Where needs the second, and gets it."""
    rules = compile_text(rule("s = Add{a, b}\ny = Where(a, s, s)"), "t.rule")
    b = GraphBuilder()
    u, v = b.input("u", shape=(4,)), b.input("v", shape=(4,))
    s = b.op("Add", [u, v], name="s")
    b.op("Where", [v, s, s], name="y")
    graph = b.graph([b.nodes[-1].outputs[0]])
    [found] = match(graph, rules)
    assert (found.bindings["a"], found.bindings["b"], found.bindings["s"]) == (v, u, s)


def test_split_outputs_read_by_two_inputs_come_from_one_node():
    rules = compile_text(rule("p, r = Split(x)\ny = Add(p, r)"), "t.rule")
    b = GraphBuilder()
    x = b.input("x", shape=(4, 4))
    p1, r1 = b.op("Split", [x], outputs=2, name="sp1")
    p2, _ = b.op("Split", [x], outputs=2, name="sp2")
    b.op("Add", [p1, r1], name="ok")
    b.op("Add", [p2, r1], name="mixed")
    b.op("Add", [r1, p1], name="swapped")
    graph = b.graph([b.nodes[-1].outputs[0]])
    [found] = match(graph, rules)
    assert found.root.name == "n_ok" and found.nodes == [graph.nodes[2], graph.nodes[0]]


def test_nested_commutative_patterns_do_not_retry_a_node_per_order():
    """Both operand orders of each `Add{...}` reach the same node below: 31 levels (63 ops deep,
    the limit is 64) would be 2**31 attempts if a pattern were matched again at a node it was
    already tried at."""
    n = 31
    pat = "Relu(x)"
    for _ in range(n):
        pat = f"Add{{Elementwise({pat}), _}}"
    rules = compile_text("use std.ops\n" + rule(f"y = {pat}"), "t.rule")
    b = GraphBuilder()
    a = b.op("Gelu", [b.input("x", shape=(4,))], name="a0")     # Gelu, not Relu: every attempt fails
    for i in range(n):
        a = b.op("Add", [b.op("Neg", [a], name=f"n{i}"), b.op("Abs", [a], name=f"m{i}")], name=f"a{i + 1}")
    graph = b.graph([a])
    start = time.perf_counter()
    assert match(graph, rules) == []
    assert time.perf_counter() - start < 20


def test_long_family_chains_resolve_without_recursion():
    text = "family F0 = Relu\n" + "".join(f"family F{i + 1} = F{i} | F{i}\n" for i in range(3000))
    rules = compile_text(text + rule("y = F3000(x)"), "t.rule")
    assert rules.rule("r").root.ops == {"Relu"}


def test_recursion_error_anywhere_is_still_a_diagnostic(monkeypatch):
    import dsl.compiler
    import dsl.parser

    def boom(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(dsl.compiler._RuleCompiler, "compile", boom)
    d = diag(rule("y = Gelu(x)"))
    assert "nested too deeply" in d.message and (d.loc.line, d.loc.column) == (1, 6)
    monkeypatch.setattr(dsl.parser._Builder, "build", boom)
    d = diag(rule("y = Gelu(x)"))
    assert "nested too deeply" in d.message and (d.loc.line, d.loc.column) == (1, 1)


def test_the_engine_refuses_expressions_and_patterns_past_the_limits():
    """Guard evaluation recurses over P.Expr: a deeper one cannot even be built into a rule."""
    loc = SourceLocation("t.rule", 1, 1)
    expr = P.Expr("bool", loc, True)
    for _ in range(P.MAX_EXPR_DEPTH):
        expr = P.Expr("not", loc, None, [expr])
    with pytest.raises(RuleError, match="limit 256"):
        P.Guard(expr, loc, "deep")
    with pytest.raises(RuleError, match="limit 256"):
        P.Chunk(["x"], 0, expr, loc)
    pat = P.NodePattern(frozenset({"Relu"}), [P.CaptureRef("x", loc)], {}, [None], loc)
    for _ in range(P.MAX_PATTERN_DEPTH):
        pat = P.NodePattern(frozenset({"Relu"}), [pat], {}, [None], loc)
    with pytest.raises(RuleError, match="limit 64"):
        P.Rule("r", pat, [], [], [P.Recompute("y", [], loc)], loc)


# 2. number literals -------------------------------------------------------------------

@pytest.mark.parametrize("text, message, line, col", [
    (rule("y = Gelu(x)\nrequire bytes(y) > 1e999"), "number 1e999 is out of range", 4, 24),
    (rule("y = Gelu(x)\nrequire bytes(y) > " + "9" * 5000), "out of range", 4, 24),
    (rule("y = Gelu(x)\nrequire bytes(y) > 9223372036854775808"), "out of range", 4, 24),
    (rule("y = Gelu(x)\nrequire bytes(y) > 1e-999"), "too small", 4, 24),
    (rule("y = Gelu(x)\nrequire bytes(y) > 9000000000 GiB"), "out of range", 4, 24),
    (rule("y = Softmax(x, axis=1e999)"), "out of range", 3, 25),
    (rule("y = Softmax(x, axis=-" + "1" * 5000 + ")"), "out of range", 3, 25),
    (rule("y = Gelu(x)", header="rule r priority " + "9" * 5000), "out of range", 1, 17),
    (rule("y = Gelu(x)\nx : float32[99999999999999999999]"), "out of range", 4, 17),
    (rule("y = MatMul(x, w)", "chunk over x along " + "9" * 5000 + " into 4"), "out of range", 5, 32),
    (rule("y = Gelu(x)\nrequire bytes(y) > 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 "
          "* 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18 * 1e18"), "out of range", 4, 24),
])
def test_number_literals_out_of_range(text, message, line, col):
    assert_diag(text, message, line, col)


def test_numbers_in_range_compile():
    compile_text(rule("y = Gelu(x)\nrequire bytes(y) > " + "0" * 5000 + "1"), "t.rule")   # leading zeros
    r = compile_text(rule("y = Gelu(x)\nrequire bytes(y) > 9223372036854775807 and bytes(y) > 1.5e18",
                          header="rule r priority -9223372036854775807"), "t.rule").rule("r")
    assert r.priority == -9223372036854775807


def test_unknown_string_escapes_are_refused_not_decoded():
    assert_diag(rule('y = Gelu(x, approximate="\\x")'), "unknown escape '\\\\x'", 3, 30)
    r = compile_text(rule('y = Gelu(x, approximate="t\\"a\\\\nh")'), "t.rule").rule("r")
    assert r.root.attrs["approximate"] == 't"a\\nh'


# 3. attributes and outputs against op schemas ------------------------------------------

@pytest.mark.parametrize("text, message, line, col", [
    (rule('y = Softmax(x, axis="last")'), "attribute 'axis' of Softmax takes an int, not a string", 3, 25),
    (rule("y = Softmax(x, axis=[1, 2])"), "takes an int, not a list of ints", 3, 25),
    (rule("y = Softmax(x, axis=1.5)"), "takes an int, not a float", 3, 25),
    (rule("y = Softmax(x, axsi=-1)"), "Softmax has no attribute 'axsi'", 3, 20),
    (rule("a, b, c, d, e = Relu(x)", "recompute a"), "Relu has 1 output, but the statement binds 5", 3, 8),
    (rule("a, b, c, d = LayerNormalization(x)", "recompute a"), "has 3 outputs", 3, 14),
    (rule("a, b, c = Dropout(x)", "recompute a"), "has 2 outputs", 3, 11),
    (rule("y = Cast(x, to=1)"), "takes a data type", 3, 20),
    (rule("y = LayerNormalization(x, stash_type=float32)"), "takes an int, not a data type", 3, 42),
    (rule("y = Transpose(x, perm=1)"), "takes a list of ints, not an int", 3, 27),
    (rule("y = Softmax|LogSoftmax(x, axsi=-1)"), "none of LogSoftmax|Softmax has an attribute 'axsi'", 3, 31),
    (rule("y = Constant(value=1)"), "which a rule cannot constrain", 3, 24),
    (rule("y = Softmax(Relu(x, alpha=1.0))"), "Relu has no attribute 'alpha'", 3, 25),
    ("use std.ops\n" + rule('y = Elementwise(x, _, fmod="a")'), "'fmod' of Mod takes an int", 4, 32),
])
def test_attributes_and_outputs_no_schema_allows(text, message, line, col):
    assert_diag(text, message, line, col)


@pytest.mark.parametrize("statement", [
    "y = Split(x, axis=0, split=[2, 2])",            # an input since opset 13
    "y = Squeeze(x, axes=[0])",                      # opset 1 and 11
    "y = Unsqueeze(x, axes=[0])",
    "y = ReduceSum(x, axes=[1], keepdims=0)",       # before opset 13
    "y = ReduceMean(x, axes=[-1])",                 # before opset 18
    "y = Dropout(x, ratio=0.1)",                    # opset 7 and 10
    "y = Clip(x, min=0.0, max=6)",                  # before opset 11
    "y = Pad(x, pads=[0, 1, 0, 1], mode=\"constant\")",
    "y = Relu(x, consumed_inputs=[0])",             # opset 1
    'y = Cast(x, to="FLOAT")',                      # a string in opset 1, a dtype since 6
    "y = LpPool(x, p=2.0)",                         # a float in opset 1, an int since 2
    "a, b, c, d, e = BatchNormalization(x, _, _, _, _)",   # 5 outputs before opset 9
])
def test_attributes_and_outputs_of_any_schema_version_compile(statement):
    compile_text(rule(statement, "recompute " + statement.split("=")[0].split(",")[0].strip()), "t.rule")


@pytest.mark.parametrize("text, message, line, col, hint", [
    (rule("y = Squeeze(x, axis=[0])"), "Squeeze has no attribute 'axis'", 3, 20, "did you mean 'axes'"),
    (rule("y = Split(x, splits=[2, 2])"), "Split has no attribute 'splits'", 3, 18, "did you mean 'split'"),
    (rule("y = Dropout(x, ration=0.5)"), "Dropout has no attribute 'ration'", 3, 20, "did you mean 'ratio'"),
    (rule("y = Squeeze(x, axes=0)"), "attribute 'axes' of Squeeze takes a list of ints, not an int", 3, 25,
     "write a list"),
    (rule("y = Cast(x, to=1)"), "takes a data type (a dtype name such as float32) or a string", 3, 20, ""),
    (rule("a, b, c, d, e, f = BatchNormalization(x, _, _, _, _)", "recompute a"),
     "BatchNormalization has 5 outputs, but the statement binds 6", 3, 20, "bind at most 5"),
])
def test_names_no_schema_version_had_are_refused(text, message, line, col, hint):
    assert_diag(text, message, line, col)
    assert hint in diag(text).hint


def test_an_opset_11_attribute_matches_a_node_that_carries_it():
    rules = compile_text(rule("y = Squeeze(x, axes=[0])"), "t.rule")
    b = GraphBuilder()
    x = b.input("x", shape=(1, 4))
    b.op("Squeeze", [x], shape=(4,), name="sq", axes=[0])
    b.op("Squeeze", [b.nodes[0].outputs[0]], shape=(4,), name="other", axes=[1])
    graph = b.graph([b.nodes[-1].outputs[0]])
    assert [m.root.name for m in match(graph, rules)] == ["n_sq"]


def test_misspelled_attribute_gets_a_did_you_mean():
    assert "did you mean 'axis'" in diag(rule("y = Softmax(x, axsi=-1)")).hint
    assert "did you mean 'approximate'" in diag(rule('y = Gelu(x, aproximate="tanh")')).hint


def test_attributes_some_alternative_accepts_compile():
    compile_text(rule("y = Softmax(x, axis=-1)"), "t.rule")
    compile_text(rule("y = Cast(x, to=float16, saturate=true)"), "t.rule")
    compile_text(rule("y = Transpose(x, perm=[])"), "t.rule")
    compile_text(rule("y = LeakyRelu|Relu(x, alpha=1)"), "t.rule")          # an int is a fine float
    compile_text(rule("y = Softmax|aten::softmax(x, axsi=1)"), "t.rule")    # aten::softmax: no schema
    compile_text("use std.ops\n" + rule("y = Activation(x, alpha=0.1)"), "t.rule")
    compile_text(rule("a, b, c, d = Split(x)", "recompute a"), "t.rule")    # variadic outputs
    compile_text(rule("a, b, c = com.microsoft::Foo(x, anything=[1.5])", "recompute a"), "t.rule")


# custom op signatures: `op NAME outputs N|N..M|N.. attrs NAME: TYPE, ...`
SIG = "op com.example::MyOp outputs 1..2 attrs alpha: float, mode: string, to: dtype\n"


@pytest.mark.parametrize("text, message, line, col", [
    (SIG + rule("y = com.example::MyOp(x, alhpa=1)"), "com.example::MyOp has no attribute 'alhpa'", 4, 30),
    (SIG + rule("y = com.example::MyOp(x, mode=1)"), "'mode' of com.example::MyOp takes a string", 4, 35),
    (SIG + rule("y = com.example::MyOp(x, to=1)"), "takes a data type", 4, 33),
    (SIG + rule("y, z, w = com.example::MyOp(x)"), "has 2 outputs, but the statement binds 3", 4, 11),
    ("op com.example::MyOp attrs\n" + rule("y = com.example::MyOp(x, a=1)"), "it has no attributes", 4, 30),
    ("op com.example::MyOp attrs a: flaot\n", "unknown attribute type 'flaot'", 1, 31),
    ("op com.example::MyOp attrs a: int, a: float\n", "attribute 'a' is declared twice", 1, 36),
    ("op com.example::MyOp outputs 0\n", "at least one output", 1, 30),
    ("op com.example::MyOp outputs 3..2\n", "empty output range 3..2", 1, 33),
    ("op com.example::A outputs 1\nop com.example::A outputs 2\n", "declared twice (first at t.rule:1:19)", 2, 19),
    ("op Relu outputs 2\n", "'Relu' has an ONNX schema", 1, 4),
])
def test_custom_op_signatures(text, message, line, col):
    assert_diag(text, message, line, col)


def test_custom_op_signatures_that_allow_compile():
    compile_text(SIG + rule('y, z = com.example::MyOp(x, alpha=1, mode="m", to=float16)', "recompute y"),
                 "t.rule")
    compile_text("op com.example::V outputs 2..\n" + rule("a, b, c, d, e = com.example::V(x, any=1)",
                                                          "recompute a"), "t.rule")
    compile_text("op com.example::U\n" + rule("a, b = com.example::U(x, any=1)", "recompute a"), "t.rule")
    compile_text("op com.example::W attrs k: ints\n" + rule("y = com.example::W|Relu(x)"), "t.rule")


# 4. guard types --------------------------------------------------------------------------

@pytest.mark.parametrize("require, message, col", [
    ("y", "`require` needs a condition, but `y` is a captured value", 13),
    ("bytes(y)", "`require` needs a condition, but `bytes(y)` is a number", 13),
    ("saved(y) and bytes(y)", "`and` needs a condition on each side, but `bytes(y)` is a number", 26),
    ("not bytes(y)", "`not` needs a condition", 17),
    ("bytes(y) + saved(y) > 1", "`+` needs numbers, but `saved(y)` is a condition", 24),
    ("-saved(y) < 0", "`-` needs a number", 14),
    ("dtype(y) > float16", "dtypes compare only with == and !=", 13),
    ("dtype(y) == 3", "`==` compares a dtype with a number", 25),
    ('bytes(y) == "big"', "`==` compares a number with a string", 25),
    ("y == x", "`==` cannot compare a captured value", 13),
    ("count(y) > 1", "count() takes a variadic capture as argument 1, but `y` is a captured value", 19),
    ("saved(x) == 1", "`==` compares a condition with a number", 25),
    ("dim(y, saved(x)) > 1", "dim() takes a number as argument 2", 20),
    ("min(bytes(y), saved(y)) > 1", "min() takes a number as argument 2", 27),
    ("dim(y, 1.5) > 1", "dim() takes an integer dim index", 20),
    ("1 > 2", "`1 > 2` is always false", 13),
    ("false", "`false` is always false", 13),
])
def test_guard_types(require, message, col):
    assert_diag(rule("y = Gelu(x)\nrequire " + require), message, 4, col)


def test_guard_type_hints_say_what_to_write():
    assert "saved(y)" in diag(rule("y = Gelu(x)\nrequire y")).hint
    assert "count(xs)" in diag(rule("y = Concat(xs...)\nrequire xs > 1")).hint


@pytest.mark.parametrize("text, message, line, col", [
    (rule("y = Concat(xs...)\nrequire saved(xs)"), "saved() takes a captured value as argument 1, but `xs` "
                                                   "is a variadic capture", 4, 19),
    (rule("y = Concat(xs...)\nxs : float32"), "'xs' is a variadic capture: it has no single type", 4, 5),
    (rule("y = Concat(xs...)", "recompute xs"), "'xs' is a variadic capture; a rewrite action", 5, 23),
    (rule("y = Concat(x, xs...)\nz = Add(y, xs)", "recompute z"), "capture 'xs' is a variadic capture", 3, 19),
    (rule("y = Gelu(x)\ny : float32[a, b]\nrequire dim(y, 2) > 1"), "dim 2 is out of range", 5, 20),
])
def test_captures_used_as_what_they_are_not(text, message, line, col):
    assert_diag(text, message, line, col)


def test_well_typed_guards_compile():
    text = rule("y = Concat(xs...)\ny : float32[a, b]\n"
                "require count(xs) >= 2 and bytes(xs) > 1 MiB and available(xs)\n"
                "require dtype(y) == float32 and dtype(y) != float16 and \"a\" < \"b\"\n"
                "require (saved(y) == true) or not is_input(y) and dim(y, -2) % 8 == 0\n"
                "require min(bytes(y), 2 KiB, 3) + ceil(numel(y) / 3) - floor(rank(y) // 2) > -1")
    assert len(compile_text(text, "t.rule").rule("r").guards) == 4


def test_every_builtin_has_a_type():
    assert set(BUILTIN_TYPES) == set(BUILTINS)


# 5. repeated rule options ------------------------------------------------------------------

@pytest.mark.parametrize("header, message, col", [
    ("rule r tier a tier b", "rule 'r' gives its tier twice (first at t.rule:1:8)", 15),
    ("rule r priority 1 tier a priority 2", "gives its priority twice (first at t.rule:1:8)", 26),
    ("rule r priority 1 priority 1", "gives its priority twice", 19),
])
def test_repeated_rule_options(header, message, col):
    assert_diag(rule("y = Gelu(x)", header=header), message, 1, col)


# 6. chunk dims and counts, and constants that divide by zero ---------------------------------

@pytest.mark.parametrize("match, rewrite, message, line, col", [
    ("y = MatMul(h, w)", "chunk over h along 99 into 4", "chunk dim 99 is out of range", 5, 32),
    ("y = MatMul(h, w)", "chunk over h along -64 into 4", "chunk dim -64 is out of range", 5, 32),
    ("y = MatMul(h, w)\nh : float32[a, b]", "chunk over h along 2 into 4",
     "the rule's type annotation gives h rank 2", 6, 32),
    ("y = MatMul(h, w)\nh : [a, b]", "chunk over h along -3 into 4", "gives h rank 2", 6, 32),
    ("y = MatMul(h, w)", "chunk over h along 0 into 1", "the chunk count 1: a chunk rule runs at least 2", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into 4 - 3", "the chunk count `4 - 3` is 1", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into min(8, 1)", "is 1", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into 0.5", "the chunk count 0.5", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into bytes(h) / 0", "division by zero", 5, 50),
    ("y = MatMul(h, w)", "chunk over h along 0 into bytes(h) // (2 - 2)", "division by zero: `2 - 2` is 0", 5, 52),
    ("y = MatMul(h, w)", "chunk over h along 0 into saved(h)", "`into` needs a number of chunks, but "
                                                               "`saved(h)` is a condition", 5, 39),
    ("y = MatMul(h, w)", 'chunk over h along 0 into "4"', "but `\"4\"` is a string", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into float16", "is a dtype", 5, 39),
    ("y = MatMul(h, w)", "chunk over h along 0 into h", "is a captured value", 5, 39),
    ("y = MatMul(h, w)\nrequire bytes(y) % 0 == 0", "chunk over h along 0 into 4", "division by zero", 4, 24),
    ("y = MatMul(h, w)\nrequire bytes(y) / (1 - 1.0) > 1", "recompute y", "division by zero", 4, 25),
])
def test_chunk_dims_counts_and_zero_divisors(match, rewrite, message, line, col):
    assert_diag(rule(match, rewrite), message, line, col)


def test_chunk_rules_that_can_work_compile():
    rules = compile_text(rule("y = MatMul(h, w)\nh : float32[a, b]",
                              "chunk over h along -2 into min(ceil(bytes(y) / 8 MiB), ceil(dim(h, 0) / 128))"),
                         "t.rule")
    assert rules.rule("r").actions[0].dim == -2
    compile_text(rule("y = MatMul(h, w)\nh : float32[...]", "chunk over h along 9 into 2 + 1"), "t.rule")


def test_shipped_rules_pass_the_checks():
    from dsl.loader import load_rules

    assert len(load_rules().rules) >= 10


# rendering ---------------------------------------------------------------------------------

def test_lines_are_counted_as_the_parser_counts_them_and_long_lines_are_cut():
    text = "# a\u2028b\x0cc\n" + rule("y = Gelo(x)")
    d = diag(text)
    assert (d.loc.line, d.loc.column) == (4, 9)
    with pytest.raises(RuleCompileError) as info:
        compile_text(text, "t.rule")
    lines = str(info.value).splitlines()
    assert lines[1].strip() == "y = Gelo(x)" and lines[2].index("^") == lines[1].index("Gelo")
    long = rule("y = Gelu(x)\nrequire " + " and ".join(["saved(y)"] * 100) + " and saved(z)")
    with pytest.raises(RuleCompileError) as info:
        compile_text(long, "t.rule")
    shown, caret = str(info.value).splitlines()[1:3]
    assert len(shown) < 120 and shown[caret.index("^"):].startswith("z)")


def test_a_builtin_the_type_table_does_not_know_is_kept_unchecked(monkeypatch):
    """A built-in added to engine.guards before dsl.typecheck knows its types: its guards are
    kept, unchecked, never dropped silently."""
    from engine.guards import Builtin

    monkeypatch.setitem(BUILTINS, "twice", Builtin((1, 1), False, lambda ctx, x: 2 * x, "2x"))
    r = compile_text(rule("y = Gelu(x)\nrequire twice(bytes(y)) > 1 and saved(y)"), "t.rule").rule("r")
    assert len(r.guards) == 1

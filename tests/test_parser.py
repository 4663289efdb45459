"""One bad snippet per diagnostic: the message, and the file:line:col it points at."""
import pytest

from dsl.errors import RuleCompileError
from dsl.loader import compile_text
from dsl.parser import parse

OK_RULE = """rule r {
  match {
    y = Gelu(x)
    require saved(y)
  }
  rewrite { recompute y }
}
"""


def diag(text: str):
    with pytest.raises(RuleCompileError) as info:
        compile_text(text, "t.rule")
    return info.value.diagnostics[0]


def rule(match: str, rewrite: str = "recompute y", header: str = "rule r") -> str:
    body = "\n".join("    " + line for line in match.strip().splitlines())
    return f"{header} {{\n  match {{\n{body}\n  }}\n  rewrite {{ {rewrite} }}\n}}\n"


@pytest.mark.parametrize("text, message, line, col", [
    ("rule r { $ }", "unexpected character '$'", 1, 10),
    (rule("y = Gelu(x,)"), "unexpected ')'", 3, 16),
    (rule("y = Gelu(x)\nrequire bytes(y) >="), "unexpected end of line", 4, 24),
    ("rule r {\n  match {\n    y = Gelu(x)\n", "unexpected end of file", 3, 16),
    (rule("y = Gelo(x)"), "unknown op 'Gelo'", 3, 9),
    (rule("y = foo.bar::Baz(x)"), "unknown op domain 'foo.bar'", 3, 9),
    ("family A = A | Relu\n" + rule("y = A(x)"), "family 'A' refers to itself", 1, 12),
    ("family A = Relu\nfamily A = Gelu\n", "family 'A' is defined twice", 2, 1),
    ("family Relu = Gelu\n", "family 'Relu' has the name of an ONNX op", 1, 1),
    (OK_RULE + OK_RULE, "rule 'r' is defined twice", 8, 6),
    (rule("y = Gelu(x)\ny = Relu(x)"), "capture 'y' is bound twice", 4, 5),
    (rule("y = Gelu(x)\nz = Relu(w)"), "is not connected to the pattern's root", 4, 5),
    (rule("a = Relu(b)\nb = Relu(a)", "recompute a"), "cycle", 3, 5),
    (rule("y = Concat(xs..., z)"), "must be the last input", 3, 23),
    (rule("y = Add{a, b, c}"), "takes exactly two inputs, got 3", 3, 9),
    (rule("y = Add{a, xs...}"), "cannot take a variadic capture", 3, 16),
    (rule("y = Cast(x, to=flaot32)"), "unknown attribute value 'flaot32'", 3, 20),
    (rule("y = Softmax(x, axis=1, axis=2)"), "attribute 'axis' is constrained twice", 3, 28),
    (rule("y = Gelu(x)\nz : float16"), "type annotation for unknown capture 'z'", 4, 5),
    (rule("y = Gelu(x)\nx : flot16"), "unknown dtype 'flot16'", 4, 9),
    (rule("y = Gelu(x)\nx : float16[..., 3, ...]"), "at most once", 4, 25),
    (rule("y = Gelu(x)\nrequire bytes(y) >= 1 MeB"), "unknown size unit 'MeB'", 4, 27),
    (rule("y = Gelu(x)\nrequire bytes(z) >= 1"), "unknown name 'z'", 4, 19),
    (rule("y = Gelu(x)\nrequire byte(y) >= 1"), "unknown function 'byte'", 4, 13),
    (rule("y = Gelu(x)\nrequire bytes(y, x) >= 1"), "bytes() takes 1 argument, got 2", 4, 13),
    (rule("y = Gelu(x)\nrequire saved(1)"), "saved() takes a captured value as its first argument", 4, 19),
    (rule("y = Gelu(x)", "recompute z"), "unknown capture 'z'", 5, 23),
    (rule("y = Gelu(x)", "recompute y from q"), "unknown capture 'q'", 5, 30),
    (rule("y = Gelu(x)", ""), "has no rewrite action", 1, 6),
    (rule("y = Gelu(x)", "chunk over q along 0 into 4"), "unknown capture 'q'", 5, 24),
    ("rule r {\n  match {\n    y = Gelu(x)\n  }\n  rewrite {\n    recompute y\n    chunk over x along 0 into 4\n"
     "  }\n}\n", "a chunk rule cannot also recompute or save", 7, 5),
    ("chunkable pointwize Add\n", "unknown chunk kind 'pointwize'", 1, 11),
    ("rule r {\n  match {\n    require true\n  }\n  rewrite { recompute y }\n}\n", "matches nothing", 1, 6),
    ("use std.nothing\n", "cannot find module 'std.nothing'", 1, 1),
    (rule("y = Relu(y)"), "used by the statement that defines it", 3, 14),
])
def test_diagnostic(text, message, line, col):
    d = diag(text)
    assert message in d.message or message in d.hint
    assert (d.loc.file, d.loc.line, d.loc.column) == ("t.rule", line, col)


def test_did_you_mean_in_hint():
    assert "did you mean 'Gelu'" in diag(rule("y = Gelo(x)")).hint
    assert "did you mean 'float32'" in diag(rule("y = Cast(x, to=flaot32)")).hint
    assert "did you mean 'bytes'" in diag(rule("y = Gelu(x)\nrequire byte(y) >= 1")).hint


def test_rendered_error_has_location_source_line_and_caret():
    with pytest.raises(RuleCompileError) as info:
        compile_text(rule("y = Gelo(x)"), "t.rule")
    lines = str(info.value).splitlines()
    assert lines[0] == "t.rule:3:9: error: unknown op 'Gelo'"
    assert lines[1].strip() == "y = Gelo(x)"
    assert lines[2].index("^") == lines[1].index("Gelo")


def test_every_error_in_a_file_is_reported():
    with pytest.raises(RuleCompileError) as info:
        compile_text(rule("y = Gelo(x)\nrequire bytes(z) >= 1"), "t.rule")
    messages = [d.message for d in info.value.diagnostics]
    assert any("Gelo" in m for m in messages) and any("'z'" in m for m in messages)


def test_positions_on_ast_nodes():
    f = parse(OK_RULE, "p.rule")
    r = f.rules[0]
    assert (r.loc.line, r.loc.column) == (1, 6)
    b = r.bindings[0]
    assert (b.loc.line, b.loc.column) == (3, 5)
    assert (b.pattern.ops[0].loc.line, b.pattern.ops[0].loc.column) == (3, 9)
    assert (r.requires[0].expr.loc.line, r.requires[0].expr.loc.column) == (4, 13)
    assert r.actions[0].target[1].line == 6


def test_language_features_compile():
    text = """
use std.ops
family Act = Gelu | com.microsoft::BiasGelu | aten::gelu
op com.example::MyAct
recomputable com.example::MyAct tier expensive

rule everything priority 7 tier expensive {
  match {
    x32 = Cast(x, to=float32)
    s = Softmax(Mul{x32, _}, axis=-1)
    c = Concat(s, rest...)
    a, _ = Split(c)
    y = Act|com.example::MyAct(a)
    x : float16|bfloat16[B, _, ...]
    require saved(y) and bytes(y) >= 1.5 MiB and dtype(x) == float16
    require not is_weight(x) or uses(y) > 2 and rank(y) >= 2 and dim(y, -1) % 8 == 0
  }
  rewrite {
    save x
    recompute y from x
  }
}
"""
    rules = compile_text(text, "all.rule")
    r = rules.rule("everything")
    assert r.priority == 7 and r.tier == "expensive" and r.plan_type == 2
    assert r.root.ops == {"Gelu", "com.microsoft::BiasGelu", "aten::gelu", "com.example::MyAct"}
    assert rules.recomputable["com.example::MyAct"] == "expensive"
    assert len(list(r.node_patterns())) == 6
    assert r.guards[0].expr.args[0].args[1].args[1].value == int(1.5 * 2**20)


def test_line_continuation_and_comments():
    text = "# a comment\n#\nfamily A = Relu \\\n  | Gelu  # trailing\n\n" + rule("y = A(x)")
    rules = compile_text(text, "c.rule")
    assert rules.rule("r").root.ops == {"Relu", "Gelu"}

"""The engine on hand-built IR graphs: analysis, matching, explanations, recompute, plans."""
from fractions import Fraction

import numpy as np
import pytest
import sympy

from dsl.loader import compile_text, load_rules
from engine.analysis import analyze, estimate_peak
from engine.apply import apply, plan
from engine.errors import ConfigError, GraphError, RuleError
from engine.ir import Graph, Node, SliceSizes, Value
from engine.matcher import explain, match
from engine.plans import parse_config
from engine.shapes import evaluate, parse_dim, symbol
from ir_graphs import CHUNK_HEAD_RULE, GraphBuilder, gelu_training_graph

GELU_RULE = """
view Reshape
recomputable Reshape
rule recompute_gelu {
  match {
    y = Gelu(x)
    require saved(y) and bytes(y) >= 1 MiB
  }
  rewrite { recompute y }
}
"""


def test_forward_backward_split_and_stash():
    g = gelu_training_graph()
    a = analyze(g)
    names = {v.name for v in a.stashed}
    assert names == {"h", "av"}  # x is an input and loss an output: neither is a stash cost
    assert {n.name for n in g.nodes if a.is_forward(n)} == {"n_h", "n_a", "n_av", "n_y", "n_loss"}
    assert a.stashed_bytes() == 2 * 4096 * symbol("batch")


def test_forward_outputs_configurable_and_checked():
    g = gelu_training_graph()
    assert len(analyze(g, ["y"]).forward) == 4
    with pytest.raises(GraphError, match="forward output.*nope.*not found"):
        analyze(g, ["nope"])


def test_peak_estimate_counts_views_as_aliases():
    g = gelu_training_graph(examples={"batch": 4096})
    act = 4096 * 1024 * 4
    with_alias = estimate_peak(g, {"Reshape"})
    live = {v.name for v in with_alias.live_at_peak}
    assert "a" in live and "av" not in live, "the view is free and keeps its base alive"
    without = estimate_peak(g)
    assert "av" in {v.name for v in without.live_at_peak}
    assert with_alias.peak_bytes == 4 * act + 4  # h, a (through av), g, avt and the scalar loss
    assert estimate_peak(gelu_training_graph(examples={})).peak_bytes is None


def _links(graph: Graph) -> dict[str, tuple]:
    return {v.name: (v.producer, [id(u) for u in v.users]) for v in graph.values()}


def test_relink_after_an_edit_equals_a_full_link():
    """`Graph.relink(values)` gives the values an edit touched the producers and users, in node
    order and with a node once per read, that `link()` gives them; a subgraph's reads count."""
    g = gelu_training_graph()
    erf = next(n for n in g.nodes if n.op == "Erf")
    h, dgelu = erf.inputs[0], erf.outputs[0]
    # An Identity between h and its GELU, and Erf replaced by a node that reads h twice and
    # holds a subgraph reading h and the loss.
    gelu = next(n for n in g.nodes if n.op == "Gelu")
    hid = Value("h_id", h.dtype, h.shape)
    ident = Node("Identity", [h], [hid], {}, "ident")
    loss = g.outputs[0]
    body = Graph([Node("Add", [h, loss], [Value("inner", h.dtype, h.shape)], {}, "inner_add")],
                 outputs=[])
    twice = Node("Mul", [h, h], [dgelu], {}, "twice", subgraphs={"body": body})
    g.link()            # the body's own link() took h and the loss as its own: linked before the edit
    g.nodes[g.nodes.index(gelu):g.nodes.index(gelu)] = [ident]
    gelu.inputs = [hid]
    g.nodes[g.nodes.index(erf)] = twice
    g.relink([h, hid, dgelu, loss, *gelu.inputs], added=[ident, twice])
    got = _links(g)
    g.link()
    assert got == _links(g)
    assert [u.name for u in h.users] == ["ident", "twice", "twice", "twice"]   # two inputs, a capture
    assert loss.users[-1] is twice and dgelu.producer is twice and erf not in dgelu.users


def test_state_key_changes_with_any_edit_and_only_then():
    g = gelu_training_graph()
    body = Graph([Node("Relu", [g.inputs[0]], [Value("inner", g.inputs[0].dtype, g.inputs[0].shape)], {}, "r")])
    loop = Node("Loop", [], [], {"perm": [0, 1]}, "loop", subgraphs={"body": body})
    g.nodes.append(loop)
    key = g.state_key()
    assert g.state_key() == key
    edits = [lambda: loop.attrs["perm"].append(2),                      # a list attribute, in place
             lambda: setattr(g.values().__next__(), "shape", (7, 7)),    # a value's shape
             lambda: g.nodes[1].inputs.__setitem__(0, g.inputs[0]),      # an input replaced
             lambda: setattr(body.nodes[0], "op", "Gelu"),               # a subgraph's node
             lambda: setattr(g.nodes[0], "plan", "recompute"),           # any field of a node
             lambda: g.nodes.reverse()]                                  # the order
    for edit in edits:
        edit()
        assert g.state_key() != key
        key = g.state_key()


def _head_graph(n: int, open_dims: frozenset = frozenset()) -> Graph:
    b = GraphBuilder({"n": n})
    h = b.input("h", shape=("n", 256))
    w = b.input("w", shape=(256, 4096), weight=True)
    logits = b.op("MatMul", [h, w], shape=("n", 4096), name="logits")
    g = b.graph([b.op("ReduceSum", [logits], shape=(), name="loss")])
    g.open_dims = open_dims
    return g


def test_a_chunk_guard_that_holds_at_longer_open_dims_is_a_refusal_that_says_so():
    """A graph traced at n = 256 (4 MiB of logits) that will run longer inputs (n open): the
    chunk rule's 16 MiB guard holds from 4x n, so the match is refused with `longer_from` 4 for
    the backend to tell the user; not where n has its largest size, nor where 8x is too short."""
    rules = compile_text(CHUNK_HEAD_RULE.replace("require bytes(logits) >= 4 * bytes(h)",
                                                 "require bytes(logits) >= 16 MiB").format(count=4), "head.rule")
    [refusal] = plan(_head_graph(256, frozenset({"n"})), rules).refusals
    assert refusal.reason.longer_from == 4 and "16 MiB" in refusal.reason.message      # 4 MiB at n = 256
    assert not plan(_head_graph(256), rules).refusals
    assert not plan(_head_graph(64, frozenset({"n"})), rules).refusals       # 8 MiB at 8x
    [matched] = plan(_head_graph(1024, frozenset({"n"})), rules).refusals    # 16 MiB: it matches (and
    assert matched.reason.dynamic_sizes and not matched.reason.longer_inputs  # wants static slices here)


@pytest.mark.parametrize("rows, constrained, slices", [
    ("4*n", {"n"}, 4),          # 4 slices of n rows: sizes the declared range bounds
    ("2*n", {"n"}, 2),          # the most slices that divide the rows
    ("2*n", set(), 4),          # no constraint: floor(2n / 4) rows each
    ("n", {"n"}, None),         # no count divides n rows: refused, naming n
])
def test_rows_over_a_constrained_dim_are_sliced_only_where_a_count_divides_them(rows, constrained, slices):
    """A dim whose declared range every guard must follow from (Graph.constrained_dims: fx's
    mark_dynamic with min and max) cannot take slices of floor(rows / count) rows, whose sizes
    guard themselves; exact slices it can."""
    b, rows = GraphBuilder({"n": 64}), parse_dim(rows)
    h = b.input("h", shape=(rows, 256))
    w = b.input("w", shape=(256, 4096), weight=True)
    logits = b.op("MatMul", [h, w], shape=(rows, 4096), name="logits")
    g = b.graph([b.op("ReduceSum", [logits], shape=(), name="loss")])
    g.slicing, g.dynamic_reshapes, g.constrained_dims = SliceSizes.FIXED_COUNT, True, frozenset(constrained)
    planning = plan(g, compile_text(CHUNK_HEAD_RULE.format(count=4), "head.rule"))
    if slices is None:
        [refusal] = planning.refusals
        assert refusal.reason.constrained_dims == ("n",) and "declared range" in refusal.reason.message
    else:
        [chunk_plan] = planning.plans
        [region] = chunk_plan.occurrences
        assert len(region.chunks) == region.count == slices and not planning.refusals


def test_verify_names_the_node():
    x = Value("x", shape=(1,))
    ghost = Value("ghost")
    out = Value("y")
    node = Node("Relu", [ghost], [out], name="bad_relu")
    g = Graph([node], [x], [out])
    with pytest.raises(GraphError, match=r"bad_relu \(Relu\) reads 'ghost'.*\n>> #0"):
        g.verify()


def test_match_through_view_and_guard_with_symbolic_bytes():
    g = gelu_training_graph()
    rules = compile_text(GELU_RULE, "g.rule")
    found = match(g, rules)
    assert [m.root.name for m in found] == ["n_a"]
    assert found[0].bindings["x"].name == "h"


def test_unproven_guard_does_not_fire_and_says_why():
    g = gelu_training_graph(examples={})
    rules = compile_text(GELU_RULE, "g.rule")
    assert match(g, rules) == []
    [why] = explain(g, rules, "recompute_gelu")
    assert not why.matched
    assert "g.rule:7:5" in str(why.reasons[0]) and "batch" in why.reasons[0].message
    assert "no example value" in why.reasons[0].message


def test_symbolic_guard_proven_without_examples():
    g = gelu_training_graph(examples={})
    rules = compile_text(GELU_RULE.replace(">= 1 MiB", ">= 4 KiB"), "g.rule")
    assert len(match(g, rules)) == 1  # 4096*batch >= 4096 for every batch >= 1


def test_explain_names_rule_line_and_failed_guard():
    g = gelu_training_graph(examples={"batch": 1})
    rules = compile_text(GELU_RULE, "g.rule")
    [why] = explain(g, rules, "recompute_gelu")
    text = str(why)
    assert "does not match at n_a (Gelu)" in text
    assert "g.rule:7:5" in text and "bytes(y) >= 1 MiB" in text and "4096*batch (= 4096" in text
    with pytest.raises(RuleError, match="no rule named 'nope'"):
        explain(g, rules, "nope")


def test_alternatives_commutative_variadic_attributes_and_types():
    b = GraphBuilder()
    x = b.input("x", "float16", shape=(4, 8))
    c = b.input("c", shape=(4, 8))
    x32 = b.op("Cast", [x], dtype="float32", name="x32", to=__import__("engine.dtypes").dtypes.DType.FLOAT32)
    m = b.op("Mul", [c, x32], name="m")
    s = b.op("Softmax", [m], name="s", axis=-1)
    cat = b.op("Concat", [s, c, c], shape=(12, 8), name="cat", axis=0)
    g = b.graph([cat])
    text = """
rule r {
  match {
    x32 = Cast(x, to=float32)
    s = Softmax|LogSoftmax(Mul{x32, _}, axis=-1)
    y = Concat(s, rest...)
    x : float16[4, ...]
    require count(rest) == 2
  }
  rewrite { recompute y }
}
"""
    [m_] = match(g, compile_text(text, "r.rule"))
    assert m_.bindings["x"] is x and [v.name for v in m_.bindings["rest"]] == ["c", "c"]
    for bad in ("axis=1", "to=float16", "x : float32", "x : float16[5, ...]", "count(rest) == 3"):
        key = bad.split("=")[0].split(":")[0].split("(")[0].strip()
        variant = text.replace({"axis": "axis=-1", "to": "to=float32", "x": "x : float16[4, ...]",
                                "count": "count(rest) == 2"}[key], bad)
        assert match(g, compile_text(variant, "r.rule")) == [], bad


def test_attribute_default_from_schema_is_used():
    b = GraphBuilder()
    x = b.input("x", shape=(4, 8))
    s = b.op("Softmax", [x], name="s")
    g = b.graph([s])
    g.nodes[0].attr_defaults = {"axis": -1}
    rules = compile_text("rule r {\n match {\n y = Softmax(x, axis=-1)\n }\n rewrite { recompute y }\n}\n")
    assert len(match(g, rules)) == 1
    g.nodes[0].attr_defaults = {}
    [why] = explain(g, rules, "r")
    assert "has no attribute 'axis'" in why.reasons[0].message


def test_rules_are_indexed_by_root_op():
    rules = compile_text(GELU_RULE + "\nrule relu {\n match {\n y = Relu(x)\n }\n rewrite { recompute y }\n}\n")
    index = rules.by_root_op()
    assert set(index) == {"Gelu", "Relu"}


def test_recompute_clones_before_first_backward_use_and_is_idempotent():
    g = gelu_training_graph()
    rules = compile_text(GELU_RULE, "g.rule")
    result = apply(g, rules)
    out = result.graph
    out.verify()
    [p] = result.plans
    assert (p.key, p.type, p.frequency, p.applied) == ("Gelu+Reshape+", 1, 1, 1)
    assert p.saving() == 4096 * symbol("batch")
    assert evaluate(p.saving(), g.dim_examples) == 2 * 2**20
    names = [n.name for n in out.nodes]
    assert names.index("n_a_rc") < names.index("n_av_rc") < names.index("n_avt")
    assert names.index("n_av_rc") > names.index("n_g")
    assert {v.name for v in analyze(out).stashed} == {"h"}
    assert [n.name for n in g.nodes] == [n.name for n in gelu_training_graph().nodes], "input untouched"
    again = apply(out, rules)
    assert again.plans == [] and len(again.graph.nodes) == len(out.nodes)


def test_a_clone_waits_for_a_target_shape_the_exporter_computes_late():
    """torch.onnx writes the backward's alias of an activation right after it, inside the forward,
    and a reshape's target shape lazily, right before the reshape. The region's clones go before
    their first backward reader (the alias), but the reshape's clone cannot read its target
    before it is computed: it waits for it, and everything else keeps its place."""
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    w1 = b.input("w1", shape=(1024, 1024), weight=True)
    w2 = b.input("w2", shape=(1024, 1024), weight=True)
    h = b.op("MatMul", [x, w1], name="h")
    a = b.op("Gelu", [h], name="a")
    alias = b.op("Identity", [a], name="alias")                   # for the backward, written here
    target = b.op("Shape", [x], dtype="int64", shape=(2,), name="target")   # right before its reader
    av = b.op("Reshape", [a, target], name="av")
    y = b.op("MatMul", [av, w2], name="y")
    loss = b.op("ReduceSum", [y], shape=(), name="loss")
    g = b.op("Expand", [loss], shape=("batch", 1024), name="g")
    dw2 = b.op("MatMul", [b.op("Transpose", [av], name="avt"), g], shape=(1024, 1024), name="dw2")
    dh = b.op("Mul", [b.op("MatMul", [g, w2], name="ga"), b.op("Erf", [h], name="dgelu")], name="dh")
    dh = b.op("Mul", [dh, alias], name="dh_alias")
    dw1 = b.op("MatMul", [b.op("Transpose", [x], name="xt"), dh], shape=(1024, 1024), name="dw1")
    graph = b.graph([loss, dw1, dw2])
    result = apply(graph, compile_text(GELU_RULE, "g.rule"))
    assert [(p.key, p.applied) for p in result.plans] == [("Gelu+Reshape+", 1)]
    result.graph.verify()
    names = [n.name for n in result.graph.nodes]
    assert names.index("n_a_rc") < names.index("n_alias") < names.index("n_target") < names.index("n_av_rc")
    assert [n for n in names if not n.endswith("_rc")] == [n.name for n in graph.nodes]


def test_not_recomputable_producer_is_refused_with_reason():
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    h = b.op("MatMul", [x, b.input("w", shape=(1024, 1024), weight=True)], name="h")
    s = b.op("Sigmoid", [b.op("Softmax", [h], name="sm")], name="s")
    loss = b.op("ReduceSum", [s], shape=(), name="loss")
    d = b.op("Mul", [b.op("Expand", [loss], shape=("batch", 1024), name="g"), s], name="d")
    g = b.graph([loss, d])
    rules = compile_text("rule r {\n match {\n y = Sigmoid(x)\n require saved(y)\n }\n rewrite { recompute y }\n}\n")
    planning = plan(g, rules)
    assert planning.plans == []
    [refusal] = planning.refusals
    assert "%sm is not stashed" in refusal.reason.message and "Softmax" in refusal.reason.message


def test_nondeterministic_op_is_refused():
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    drop = b.op("Dropout", [x], name="drop")
    s = b.op("Relu", [drop], name="s")
    loss = b.op("ReduceSum", [s], shape=(), name="loss")
    d = b.op("Mul", [b.op("Expand", [loss], shape=("batch", 1024), name="g"), s], name="d")
    g = b.graph([loss, d])
    rules = compile_text("nondeterministic Dropout\nrecomputable Dropout\nrule r {\n match {\n"
                         " y = Relu(x)\n require saved(y)\n }\n rewrite { recompute y }\n}\n")
    [refusal] = plan(g, rules).refusals
    assert "nondeterministic" in refusal.reason.message and "n_drop" in refusal.reason.message


def test_compromise_cast_reports_fraction_and_needs_config():
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    half = b.op("Cast", [b.op("Relu", [x], name="r")], dtype="float16", name="half")
    wide = b.op("Cast", [half], dtype="float32", name="wide")
    loss = b.op("ReduceSum", [wide], shape=(), name="loss")
    d = b.op("Mul", [b.op("Expand", [loss], shape=("batch", 1024), name="g"), wide], name="d")
    g = b.graph([loss, d])
    rules = load_rules()
    result = apply(g, rules)
    [p] = result.plans
    assert (p.key, p.type, p.requested, p.applied) == ("Cast+", 2, 0, 0)
    assert p.kept_fraction() == 0.5 and p.saving() == 2048 * symbol("batch")
    applied = apply(g, rules, config="Cast+:2:-1")
    assert applied.plans[0].applied == 1
    assert {v.name for v in analyze(applied.graph).stashed} == {"half"}


def test_config_errors_list_the_plans():
    g = gelu_training_graph()
    rules = compile_text(GELU_RULE, "g.rule")
    with pytest.raises(ConfigError, match=r"names no plan; the plans are:\n  Gelu\+Reshape\+:1:-1"):
        apply(g, rules, config="Relu+:1:-1")
    with pytest.raises(ConfigError, match="has type 1, not 2"):
        apply(g, rules, config="Gelu+Reshape+:2:-1")
    for bad, msg in (("Gelu+", "expected KEY:TYPE:COUNT"), ("A:x:1", "must be integers"),
                     ("A:4:1", "TYPE 4 is not one of"), ("A:1:0", "COUNT must be"),
                     ("[1, 2]", "list of"), ("[oops", "not valid JSON"), ("nofile.json", "cannot read")):
        with pytest.raises(ConfigError, match=msg):
            parse_config(bad)


def test_config_first_n_and_json(tmp_path):
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    outs = []
    acts = []
    h = x
    for i in range(3):
        h = b.op("Gelu", [h], name=f"a{i}")
        acts.append(h)
    loss = b.op("ReduceSum", [h], shape=(), name="loss")
    g0 = b.op("Expand", [loss], shape=("batch", 1024), name="g")
    for i, a in enumerate(acts):
        outs.append(b.op("Mul", [g0, a], name=f"d{i}"))
    g = b.graph([loss, *outs])
    rules = compile_text(GELU_RULE, "g.rule")
    assert apply(g, rules, config="Gelu+:1:2").plans[0].applied == 2
    path = tmp_path / "plans.json"
    path.write_text('["Gelu+:1:-1"]')
    assert apply(g, rules, config=str(path)).plans[0].applied == 3


def test_tiers_gate_rules_and_growth():
    rules = load_rules()
    with pytest.raises(RuleError, match="unknown tier"):
        plan(gelu_training_graph(), rules, ["cheap"])
    assert {r.tier for r in rules.enabled([]).rules} == {"default"}
    assert "MatMul" not in rules.enabled([]).recomputable
    assert rules.enabled(["expensive"]).recomputable["MatMul"] == "expensive"


def test_shapes_formula_and_examples():
    batch, seq = symbol("batch"), symbol("seq")
    assert evaluate(640 * batch * seq**2, {"batch": 2, "seq": 3}) == 640 * 18
    assert evaluate(batch * seq, {"batch": 2}) is None
    assert isinstance(640 * batch, sympy.Expr)


def _dropout_graph(mask_kept_for_backward: bool) -> Graph:
    """Dropout as the torch export decomposes it: a random draw, a mask, a scaled multiply."""
    b = GraphBuilder({"batch": 512})
    x = b.input("x", shape=("batch", 1024))
    noise = b.op("RandomUniformLike", [x], name="noise")
    mask = b.op("Greater", [noise, b.input("p", shape=(), weight=True)], dtype="bool", name="mask")
    y = b.op("Mul", [x, b.op("Cast", [mask], dtype="float32", name="maskf")], name="y")
    loss = b.op("ReduceSum", [y], shape=(), name="loss")
    g = b.op("Expand", [loss], shape=("batch", 1024), name="g")
    outs = [b.op("Mul", [g, y], name="dy")]
    if mask_kept_for_backward:
        outs.append(b.op("Mul", [g, b.op("Cast", [mask], dtype="float32", name="maskb")], name="dx"))
    return b.graph([loss, *outs])


DROPOUT_RULES = """
use std.ops
rule recompute_scaled {
  match {
    y = Mul(x, m)
    require saved(y)
  }
  rewrite { recompute y }
}
"""


def test_dropout_replays_from_its_saved_mask():
    rules = compile_text(DROPOUT_RULES, "d.rule")
    result = apply(_dropout_graph(mask_kept_for_backward=True), rules)
    [p] = result.plans
    assert p.key == "Cast+Mul+" and p.applied == 1, "reads the kept mask: same random values"
    assert not any(n.op == "RandomUniformLike" and n.name.endswith("_rc") for n in result.graph.nodes)


def test_dropout_without_saved_mask_is_refused():
    rules = compile_text(DROPOUT_RULES, "d.rule")
    planning = plan(_dropout_graph(mask_kept_for_backward=False), rules)
    assert planning.plans == []
    assert "RandomUniformLike" in planning.refusals[0].reason.message
    assert "nondeterministic" in planning.refusals[0].reason.message


def test_reshape_map_keeps_dims_with_the_same_size_after_the_same_elements():
    from engine.strategies.chunk import reshape_map

    assert reshape_map((2, 16, 512), (32, 512)) == {1: 2}
    assert reshape_map((32, 512), (2, 16, 512)) == {2: 1}
    assert reshape_map((8, 4, 64), (8, 256)) == {0: 0}
    assert reshape_map((32, 512), (32, 512)) == {0: 0, 1: 1}


def test_sizes_that_facts_prove_equal_are_written_with_one_symbol():
    """Dynamo names the batch of the logits and of the targets apart after a graph break, and
    F.cross_entropy guards their row counts equal: s24 and s77 are one size."""
    from engine.shapes import parse_dim, substitute, united_sizes

    s24, s27, s77 = symbol("s24"), symbol("s27"), symbol("s77")
    united = united_sizes([(parse_dim("s27*s77"), parse_dim("s24*s27"))])
    assert united == {s77: s24}
    assert substitute(parse_dim("s27*s77 - s77"), united) == parse_dim("s24*(s27 - 1)").expand()
    # s27 - 1 is zero at s27 = 1, where the fact says nothing of s77; Dynamo's sizes start at 2
    shifted = [(parse_dim("s77*(s27 - 1)"), parse_dim("s24*(s27 - 1)"))]
    assert united_sizes(shifted) == {} and united_sizes(shifted, {"s27": 2}) == {s77: s24}
    # chained: both onto one symbol; a fact with no unit-coefficient solution is left unused
    assert united_sizes([(s27 * s77, s24 * s27), (s24, symbol("s9"))]) == {s77: s24, symbol("s9"): s24}
    assert united_sizes([(s24 * s27, 64)]) == {} and united_sizes([(2 * s24, 2 * s77)]) == {s77: s24}
    # both dims named apart: the symbol of the fewest sizes as a quotient, whose formulas then
    # compare equal where the row counts do, and a graph's shapes written with it
    s13 = symbol("s13")
    united = united_sizes([(s27 * s77, s13 * s24)], uses={"s24": 2, "s13": 3, "s27": 9, "s77": 9})
    assert united == {s24: s27 * s77 / s13}
    assert substitute(s24 * s13, united) == substitute(s77 * s27, united)
    targets = Value("targets", shape=(s24, s13))
    hidden = Value("hidden", shape=(s77, s27, 64))
    graph = Graph([Node("Add", [hidden, hidden], [Value("sum", shape=(s77, s27, 64))])], [hidden, targets])
    assert graph.unite_sizes([(s27 * s77, s13 * s24)]) == {s24: s27 * s77 / s13}
    assert targets.shape == (s27 * s77 / s13, s13) and hidden.shape == (s77, s27, 64)


def test_chunk_sizes_cover_the_dim_with_at_most_count_slices():
    from engine.strategies.chunk import Refused, slice_sizes

    assert slice_sizes(10, 3) == [4, 4, 2]
    assert slice_sizes(4096, 8) == [512] * 8
    assert slice_sizes(5, 8) == [1] * 5
    import sympy
    with pytest.raises(Refused, match="symbolic size"):
        slice_sizes(sympy.Symbol("n", positive=True, integer=True), 4)


def test_a_fixed_count_of_slices_of_a_dynamic_size_is_never_negative_and_its_largest_is_the_last():
    """SliceSizes.FIXED_COUNT (fx): the same count at every size, floor(n / count) rows each and the
    rest in the last, which ChunkRegion.slice_size gives as a formula: the region's saving."""
    from engine.strategies.chunk import ChunkRegion, even_slices
    from engine.ir import SliceSizes

    assert even_slices(10, 4) == [2, 2, 2, 4] and even_slices(512, 4) == [128] * 4
    for n in range(0, 40):
        for count in range(1, 9):
            sizes = even_slices(n, count)
            assert len(sizes) == count and sum(sizes) == n and min(sizes) >= 0 and max(sizes) == sizes[-1]
    n = sympy.Symbol("n", positive=True, integer=True)
    region = ChunkRegion(None, [], {}, [], even_slices(100, 8), extent=n, count=8, slicing=SliceSizes.FIXED_COUNT)
    assert all(int(region.slice_size.subs(n, k)) == even_slices(k, 8)[-1] for k in (8, 13, 100, 1023))
    region.reslice(3)
    assert region.chunks == [33, 33, 34] and region.count == 3
    region.reslice(4)
    # the last slice has a size formula of its own, though here it has the others' size
    assert region.chunks == [25] * 4 and region.slice_class(75, 100) != region.slice_class(25, 50)



def test_onnx_parameters_keep_their_places_past_an_absent_optional_input():
    """ONNX writes an optional input it leaves out as "" and keeps the later ones in place:
    `Slice(x, starts, ends, "", steps)` slices the first len(starts) axes, `Pad(x, pads, "",
    axes)` pads `axes`. Read by the node's present inputs, the Slice's steps ([1]) were its axes
    (dim 1 sliced, dim 0 carried whole: a silently wrong region) and the Pad's axes were missed."""
    from engine.strategies.chunk.kinds import dim_map

    def ints(name, values):
        return Value(name, shape=(len(values),), ints=list(values))

    x = Value("x", shape=(8, 16))
    cut = Node("Slice", [x, ints("starts", [0]), ints("ends", [7]), None, ints("steps", [1])],
               [Value("y", shape=(7, 16))], name="shift")
    dm = dim_map(cut, "slice")
    assert dm.maps[0] == {1: 1} and dm.blocked == {(0, 0)} and dm.shifted == {(0, 0): (0, 0, 1)}
    pad = Node("Pad", [x, ints("pads", [1, 0]), None, ints("axes", [0])], [Value("z", shape=(9, 16))], name="grad")
    dm = dim_map(pad, "pad")
    assert dm.maps[0] == {1: 1} and dm.shifted == {(0, 0): (0, -1, 0)}

def test_slices_hold_rows_of_a_value_that_starts_in_or_ends_short():
    """A value with the chunked rows [lead:-tail] (a label shift's `logits[:-1]`): the first
    slice is longer than `lead`, the last longer than `tail`, and each slice holds its share."""
    from engine.strategies.chunk import Rows, shifted_edges, slice_sizes

    assert slice_sizes(10, 3, tail=1) == [4, 4, 2]
    assert slice_sizes(10, 3, tail=2) == [4, 6]           # a last slice of 2 holds none of [:-2]
    assert slice_sizes(12, 6, lead=2, tail=4) == [4, 2, 6]
    shifted = Rows(lead=1, tail=2)                         # rows [1:-2] of 10
    assert shifted.total(10) == 7
    assert [shifted.span(a, b, 10) for a, b in [(0, 4), (4, 8), (8, 10)]] == [(0, 3), (3, 7), (7, 7)]
    assert Rows(unit=Fraction(1, 4)).span(8, 16, 32) == (2, 4)
    # a slice x[1:-2] in the slice [0, 4): the output's rows 1..3 of the input's 0..3, none after
    assert shifted_edges(Rows(), shifted, 0, 4, 10) == (1, 0)
    assert shifted_edges(Rows(), shifted, 4, 8, 10) == (0, 0)
    assert shifted_edges(Rows(), shifted, 6, 10, 10) == (0, 2)
    assert shifted_edges(Rows(), Rows(), 0, 4, 10) is None       # x[0:n]: its own bounds hold
    # at a dynamic size only the last slice drops rows (no lead there): those it lacks at the end
    short = Rows(tail=1)
    assert shifted_edges(Rows(), short, None, None, None, last=False) == (0, 0)
    assert shifted_edges(Rows(), short, None, None, None, last=True) == (0, 1)
    assert shifted_edges(short, Rows(tail=3), None, None, None, last=True) == (0, 2)


def test_rows_in_groups_are_sliced_inside_every_group_and_follow_reshapes():
    """A value holding `outer` groups of the chunked rows (the flat logits of 2 batch rows, the
    sequence chunked): a slice holds its rows of every group, in the shape that splits the dim;
    a reshape moves such rows to the dim after which as many elements follow, its groups
    counted there."""
    from engine.strategies.chunk import ChunkMeta, Rows, grouped
    from engine.strategies.chunk.kinds import grouped_dim

    rows = Rows(outer=2, tail=1)                   # 2 rows of logits[:, :-1] of a sequence of 10
    assert rows.total(10) == 18 and rows.span(4, 10, 10) == (4, 9) and rows.scale(3) == 6
    meta = ChunkMeta(0, rows=rows)
    assert meta.length(4, 10, 10) == 10            # 5 rows of each of the 2 sequences
    assert grouped(meta, (18, 300)) == ((2, 9, 300), ChunkMeta(1, rows=Rows(tail=1)))
    # (tokens, vocab) -> (batch, seq, vocab) with the sequence chunked: dim 1, one group; and back
    assert grouped_dim((48, 300), (2, 24, 300), 0, 24) == (1, 1)
    assert grouped_dim((2, 24, 300), (48, 300), 1, 24) == (0, 2)
    # the (N, C, L) form's (N, C, 1, L) view: the sequence is the last dim, after no element
    assert grouped_dim((2, 300, 24), (2, 300, 1, 24), 2, 24) == (3, 1)
    # the batch as the chunked rows is the leading dim of a group, not the lowest: no such dim
    assert grouped_dim((48, 300), (2, 24, 300), 0, 48) is None
    assert grouped_dim((48, 300), (2, 24, 300), 0, 5) is None          # 24 is not whole groups of 5
    # at a dynamic length: 2 sequences of s0 tokens, and back
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    assert grouped_dim((2 * s0, 300), (2, s0, 300), 0, s0) == (1, 1)
    assert grouped_dim((2, s0, 300), (2 * s0, 300), 1, s0) == (0, 2)
    assert grouped_dim((2 * s0, 300), (2, s0, 300), 0, 2 * s0) is None
    assert grouped_dim((s0, 300), (2, 300), 0, 2) is None               # not a reshape of it


@pytest.mark.parametrize("whole_first", [True, False])
def test_an_outside_value_read_sliced_and_whole_in_one_region_is_refused(whole_first):
    """The backends slice an input from outside a chunk region once for all the region's readers:
    `z` read whole by `q @ z` and in rows by `q * z` cannot be both. Refused with the reader named,
    whichever comes first (it was once registered for the first reader and the second silently
    got the first's)."""
    b = GraphBuilder()
    h = b.input("h", shape=(32, 8))
    w = b.input("w", shape=(8, 32), weight=True)
    z = b.input("z", shape=(32, 32))
    q = b.op("MatMul", [h, w], shape=(32, 32), name="q")
    readers = [("MatMul", "m"), ("Mul", "a")]
    outs = [b.op(op, [q, z], shape=(32, 32), name=name) for op, name in (readers if whole_first else readers[::-1])]
    total = b.op("ReduceSum", [b.op("Add", outs, shape=(32, 32), name="s")], shape=(), name="r", keepdims=0)
    planning = plan(b.graph([total]), compile_text(CHUNK_HEAD_RULE.format(count=4), "chunk_head.rule"))
    assert not planning.plans
    [refusal] = planning.refusals
    reason = str(refusal.reason)
    assert reason.startswith("chunk_head.rule:9:5:"), reason
    if whole_first:
        assert "Mul n_a reads %z sliced along dim 0, where another node of the region reads it whole" in reason
    else:
        assert "MatMul n_m: its inputs are sliced along different dims" in reason


def test_a_region_whose_every_large_value_the_step_returns_is_refused():
    """A large value the step returns (nanoGPT's logits) may leave a chunk region whole; but a
    region whose only large value that is would save nothing: refused, said so."""
    b = GraphBuilder()
    x = b.input("x", shape=(512, 16))
    logits = b.op("MatMul", [x, b.input("w", shape=(16, 4096), weight=True)], shape=(512, 4096), name="logits")
    total = b.op("ReduceSum", [logits], shape=(), name="total", keepdims=0)
    planning = plan(b.graph([logits, total]), compile_text(CHUNK_HEAD_RULE.format(count=4), "chunk_head.rule"))
    assert not planning.plans
    [refusal] = planning.refusals
    assert "every large value of the region is returned by the step" in refusal.reason.message, refusal.reason


# A batch of outer products (each token's gradient and input, an expert weight's gradient), its
# slices added into zeros by a ScatterND (the gradient of gathered rows).
SCATTER_RULE = """use std.ops

rule chunk_outer_products {
  match {
    dw = MatMul(a, g)
    require rank(dw) == 3 and dim(a, -1) == 1
  }
  rewrite {
    chunk over a along 0 into 4
  }
}
"""


@pytest.mark.parametrize("base, reduction, fires", [
    ("zeros", "add", True),     # the gradient of a gather: each slice adds its part into zeros
    ("fill", "add", True),      # zeros an importer marks filled (ONNX's ConstantOfShape)
    ("input", "add", False),    # into a value: the slices' sums would add it four times
    ("zeros", "none", False),   # written, not added: the slices' writes do not sum to the whole's
])
def test_a_scatter_nd_of_sliced_updates_is_a_partial_sum_only_into_zeros_and_adding(base, reduction, fires):
    b = GraphBuilder({})
    x = b.input("x", shape=(64, 32))
    loss = b.op("ReduceSum", [x], shape=(), name="loss")
    a = b.input("a", shape=(64, 32, 1))
    g = b.op("Expand", [loss, b.const([64, 1, 48], np.int64)], shape=(64, 1, 48), name="g")
    dw = b.op("MatMul", [a, g], shape=(64, 32, 48), name="dw")
    ids = b.input("ids", "int64", shape=(64, 1))
    if base == "zeros":
        into = b.op("Transpose", [b.op("Expand", [b.const(0.0), b.const([4, 32, 48], np.int64)], shape=(4, 32, 48))],
                    perm=[0, 1, 2], name="zeros")
    elif base == "fill":
        into = b.op("ConstantOfShape", [b.const([4, 32, 48], np.int64)], "float32", (4, 32, 48), name="zeros")
        into.filled = 0.0
    else:
        into = b.input("table", shape=(4, 32, 48))
    out = b.op("ScatterND", [into, ids, dw], shape=(4, 32, 48), name="grad", reduction=reduction)
    planning = plan(b.graph([loss, out], forward_outputs=["loss"]), compile_text(SCATTER_RULE, "scatter.rule"))
    if fires:
        [chunk_plan] = planning.plans
        [region] = chunk_plan.occurrences
        assert region.meta[id(out)].need_sum and len(region.chunks) == 4
    else:
        [refusal] = planning.refusals
        why = "not zeros" if base == "input" else "works along dim 0"
        assert "ScatterND n_grad" in refusal.reason.message and why in refusal.reason.message, refusal.reason.message

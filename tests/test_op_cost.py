"""Per-op cost formulas: `cost y = Op(a, b) flops EXPR [bytes EXPR]` in the rule files, compiled
into RuleSet.costs and evaluated on IR nodes by engine.op_cost.node_cost."""
import pytest
import sympy
from ir_graphs import GraphBuilder, gelu_training_graph

from dsl.errors import RuleCompileError
from dsl.loader import compile_text, load_rules
from dsl.typecheck import BUILTIN_TYPES
from engine.guards import BUILTINS
from engine.op_cost import COST_BUILTINS, OpCost, default_cost, formula_for, node_cost, total_cost
from engine.shapes import symbol

STD = load_rules()        # the shipped library: std/ops.rule's costs


def node(op: str, shapes, out_shape, dtype: str = "float32", native: str | None = None, outputs: int = 1,
         **attrs):
    """One node of `op` over inputs of `shapes` (None: a missing optional input), built with
    GraphBuilder; `native`: the backend's spelling of the op."""
    b = GraphBuilder()
    inputs = [None if s is None else b.input(f"i{k}", dtype=dtype, shape=s) for k, s in enumerate(shapes)]
    b.op(op, inputs, shape=out_shape, outputs=outputs, name="y", dtype=dtype, **attrs)
    n = b.nodes[-1]
    n.native_op = native
    return n


B, M, K, N = 4, 32, 64, 16


# formulas on nodes ------------------------------------------------------------------------

def test_matmul_is_two_flops_per_multiply_add_with_batch_dims():
    n = node("MatMul", [(B, M, K), (K, N)], (B, M, N))
    cost = node_cost(n, STD)
    assert isinstance(cost, OpCost)
    assert cost.flops == 2 * B * M * N * K
    assert cost.bytes == 4 * (B * M * K + K * N + B * M * N)          # no `bytes`: inputs and outputs
    assert cost.formula is STD.costs["MatMul"] and "MatMul" in cost.formula.text


def test_symbolic_dims_stay_formulas():
    batch, seq = symbol("batch"), symbol("seq")
    n = node("MatMul", [("batch", "seq", K), (K, N)], ("batch", "seq", N))
    cost = node_cost(n, STD)
    assert isinstance(cost.flops, sympy.Expr)
    assert sympy.simplify(cost.flops - 2 * batch * seq * N * K) == 0
    assert sympy.simplify(cost.bytes - 4 * (batch * seq * K + K * N + batch * seq * N)) == 0
    assert node_cost(n, STD, {"batch": 2, "seq": 8}).flops == cost.flops     # examples: only for conditions


@pytest.mark.parametrize("native", ["aten::mm", "aten::bmm", "aten::matmul", None])
def test_the_aten_matmul_spellings(native):
    n = node("MatMul", [(B, M, K), (B, K, N)], (B, M, N), native=native)
    assert node_cost(n, STD).flops == 2 * B * M * N * K


def test_gemm_with_a_transposed_and_a_bias():
    plain = node("Gemm", [(M, K), (K, N)], (M, N))
    assert node_cost(plain, STD).flops == 2 * M * N * K
    transposed = node("Gemm", [(K, M), (N, K), (N,)], (M, N), transA=1, transB=1)
    assert node_cost(transposed, STD).flops == 2 * M * N * K + M * N


def test_addmm_is_costed_as_the_gemm_it_is_imported_as():
    """The fx importer makes aten::addmm(bias, a, b) Gemm(a, b, bias), ONNX's operand order, so
    Gemm's formula is its (no ATen-order formula that would read the bias as A)."""
    n = node("Gemm", [(M, K), (K, N), (N,)], (M, N), native="aten::addmm")
    assert formula_for(n, STD) is STD.costs["Gemm"]
    assert node_cost(n, STD).flops == 2 * M * N * K + M * N


def test_fused_matmul_with_a_transposed():
    n = node("com.microsoft::FusedMatMul", [(B, K, M), (B, K, N)], (B, M, N), transA=1)
    assert node_cost(n, STD).flops == 2 * B * M * N * K


def test_softmax_layer_norm_and_their_spellings():
    x = (B, M, K)
    for op, native in [("Softmax", None), ("LogSoftmax", None), ("Softmax", "aten::_softmax")]:
        cost = node_cost(node(op, [x], x), STD)
        assert (cost.flops, cost.bytes) == (5 * B * M * K, 3 * 4 * B * M * K), (op, native)
    ln = node("LayerNormalization", [x, (K,), (K,)], x, outputs=3)
    assert node_cost(ln, STD) == OpCost(8 * B * M * K, 4 * (2 * B * M * K + B * M * K + 2 * K), STD.costs[
        "LayerNormalization"])
    rms = node("com.microsoft::SimplifiedLayerNormalization", [x, (K,)], x)
    assert node_cost(rms, STD).flops == 4 * B * M * K


@pytest.mark.parametrize("op, per_element", [
    ("Relu", 1), ("LeakyRelu", 2), ("Tanh", 4), ("Sigmoid", 7), ("Gelu", 8), ("Erf", 4), ("Mish", 14),
    ("com.microsoft::BiasGelu", 9), ("aten::silu", 8), ("Add", 1), ("Where", 1), ("Exp", 4), ("Clip", 2),
])
def test_activations_and_elementwise_per_element(op, per_element):
    arity = {"Add": 2, "Where": 3, "com.microsoft::BiasGelu": 2}.get(op, 1)
    n = node(op, [(M, K)] * arity, (M, K))
    assert node_cost(n, STD).flops == per_element * M * K


def test_a_variadic_tail_counts_its_inputs():
    assert node_cost(node("Max", [(M,)] * 3, (M,)), STD).flops == 2 * M
    assert node_cost(node("Max", [(M,)], (M,)), STD).flops == 0
    assert node_cost(node("Mean", [(M,)] * 4, (M,)), STD).flops == 4 * M
    concat = node("Concat", [(M, K), (M, N)], (M, K + N), axis=1)
    assert node_cost(concat, STD) == OpCost(0, 4 * 2 * M * (K + N), STD.costs["Concat"])


def test_views_move_nothing_and_copies_move_their_bytes():
    size = 4 * M * K
    reshape = node("Reshape", [(M, K), (2,)], (K, M))
    assert (node_cost(reshape, STD).flops, node_cost(reshape, STD).bytes) == (0, 0)
    onnx_transpose = node("Transpose", [(M, K)], (K, M), perm=[1, 0])
    assert node_cost(onnx_transpose, STD).bytes == 2 * size                    # ONNX Runtime copies
    permute = node("Transpose", [(M, K)], (K, M), native="aten::permute", perm=[1, 0])
    assert node_cost(permute, STD).bytes == 0                                  # a torch view
    clone = node("Identity", [(M, K)], (M, K), native="aten::clone")
    assert node_cost(clone, STD).bytes == 2 * size                             # Identity is a view, clone copies
    gather = node("Gather", [(50000, K), (M,)], (M, K), dtype="float32")
    gather.inputs[1].dtype = gather.inputs[1].dtype.from_name("int64")
    assert node_cost(gather, STD).bytes == 2 * size + 8 * M                    # not the whole table


def test_casts_and_reductions():
    cast = node("Cast", [(M, K)], (M, K), dtype="float16")
    assert node_cost(cast, STD) == OpCost(0, 2 * M * K * 2, STD.costs["Cast"])
    assert node_cost(node("ReduceSum", [(M, K)], (M, 1), keepdims=1), STD).flops == M * K


# what cannot be computed --------------------------------------------------------------------

def test_an_unknown_shape_gives_none_never_an_exception():
    n = node("MatMul", [(M, K), (K, N)], (M, N))
    n.inputs[0].shape = None
    cost = node_cost(n, STD)
    assert cost.flops is None and cost.bytes is None
    n.inputs[0].shape = (K,)          # rank 1: dim(a, -1) is K, still fine
    assert node_cost(n, STD).flops == 2 * M * N * K
    fused = node("com.microsoft::FusedMatMul", [(K,), (K, N)], (N,))      # dim(a, -2) out of range
    assert node_cost(fused, STD).flops is None


def test_an_input_the_node_lacks_leaves_its_capture_unbound():
    rules = compile_text("cost y = Gemm(a, b, c) flops numel(y) + numel(c)\n", "t.rule")
    assert node_cost(node("Gemm", [(M, K), (K, N), None], (M, N)), rules).flops is None
    assert node_cost(node("Gemm", [(M, K), (K, N)], (M, N)), rules).flops is None
    assert node_cost(node("Gemm", [(M, K), (K, N), (N,)], (M, N)), rules).flops == M * N + N


def test_a_division_by_zero_at_run_time_gives_none():
    rules = compile_text("cost y = Relu(x) flops numel(y) / (rank(x) - 2)\n", "t.rule")
    assert node_cost(node("Relu", [(M, K)], (M, K)), rules).flops is None
    assert node_cost(node("Relu", [(M, K, 2)], (M, K, 2)), rules).flops == 2 * M * K


def test_no_formula_and_the_default():
    rules = compile_text("cost y = Relu(x) flops numel(y)\n", "t.rule")
    n = node("Tanh", [(M, K)], (M, K))
    assert node_cost(n, rules) is None
    assert default_cost(n) == OpCost(M * K, 2 * 4 * M * K)
    assert node_cost(n, compile_text("rule r {\n match {\n y = Relu(x)\n }\n rewrite { recompute y }\n}\n")) is None


def test_total_cost_of_a_region():
    graph = gelu_training_graph(shape=(512, 1024))
    forward = graph.nodes[:3]                              # MatMul, Gelu, Reshape
    total = total_cost(forward, STD)
    assert total.flops == 2 * 512 * 1024 * 1024 + 8 * 512 * 1024 + 0
    unknown = [*forward, graph.nodes[0]]
    unknown[-1] = node("Tanh", [(M, K)], (M, K))
    unknown[-1].outputs[0].shape = None
    assert total_cost(unknown, STD).flops is None


# overrides ---------------------------------------------------------------------------------

def test_a_later_file_overrides_with_no_error():
    rules = compile_text("use std.ops\ncost y = Gelu(x) flops 20 * numel(y)\n", "mine.rule")
    gelu = node("Gelu", [(M, K)], (M, K))
    assert node_cost(gelu, rules).flops == 20 * M * K
    assert rules.costs["Gelu"].location.file == "mine.rule"
    assert node_cost(node("Relu", [(M, K)], (M, K)), rules).flops == M * K          # the rest is std's
    # an op's override in a later file wins over the earlier file's backend spelling
    rules = compile_text("use std.ops\ncost y = MatMul(a, b) flops 7\n", "mine.rule")
    assert node_cost(node("MatMul", [(M, K), (K, N)], (M, N), native="aten::mm"), rules).flops == 7


def test_later_files_of_a_folder_override_earlier_ones(tmp_path):
    (tmp_path / "a.rule").write_text("cost y = Relu(x) flops 1\n")
    (tmp_path / "b.rule").write_text("cost y = Relu(x) flops 2\n")
    rules = load_rules(tmp_path)
    assert node_cost(node("Relu", [(M,)], (M,)), rules).flops == 2


def test_two_costs_for_one_op_in_one_file_are_an_error():
    with pytest.raises(RuleCompileError) as info:
        compile_text("use std.ops\ncost y = Relu(x) flops 1\ncost y = Activation(x) flops 2\n", "t.rule")
    d = info.value.diagnostics[0]
    assert "the cost of 'Relu' is declared twice in this file (first at t.rule:2:1)" in d.message
    assert (d.loc.line, d.loc.column) == (3, 10) and "a later file may override" in d.hint


# checks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, message, col", [
    ("cost y = Relu(x) flops saved(y)", "saved() reads the graph around the op", 24),
    ("cost y = Relu(x) flops uses(x) * 2", "uses() reads the graph around the op", 24),
    ("cost y = Relu(x) flops x", "`flops` needs a number, but `x` is a captured value", 24),
    ("cost y = Relu(x) flops numel(y) bytes numel(y) > 1", "`bytes` needs a number, but `numel(y) > 1` is "
                                                          "a condition", 39),
    ("cost y = Relu(x) flops numel(y) + dtype(x)", "`+` needs numbers, but `dtype(x)` is a dtype", 35),
    ("cost y = Concat(xs...) flops numel(xs)", "numel() takes a captured value as argument 1, but `xs` "
                                              "is a variadic capture", 36),
    ("cost y = Relu(x) flops count(x)", "count() takes a variadic capture", 30),
    ("cost y = Relu(x) flops numel(z)", "unknown name 'z'", 30),
    ("cost y = Relu(x) flops numl(y)", "unknown function 'numl'", 24),
    ("cost y = Relu(x) flops 1 - 2", "`flops` is -1: a cost cannot be negative", 24),
    ("cost y = Relu(x) flops numel(y) // (1 - 1)", "division by zero", 37),
    ("cost y = Relu(x) flops 1e999", "out of range", 24),
    ("cost y = Relu(x) flops 1 MeB", "unknown size unit 'MeB'", 26),
    ("cost y = Relu(x, axis=1) flops 1", "a cost does not constrain attributes", 18),
    ("cost y = Relu(Neg(x)) flops 1", "a cost binds the op's own inputs: it takes no nested pattern", 15),
    ("cost y = Add{a, b} flops 1", "a cost binds the op's inputs by position", 10),
    ("cost y = Concat(xs..., z) flops 1", "a variadic capture `xs...` must be the last input", 24),
    ("cost y = Relu(y) flops 1", "capture 'y' is bound twice (first at t.rule:1:6)", 15),
    ("cost a, b = Relu(x) flops 1", "Relu has 1 output, but the statement binds 2", 9),
    ("cost y = Rleu(x) flops 1", "unknown op 'Rleu'", 10),
    ("cost y = com.example::Op(x) flops 1", "unknown op domain 'com.example'", 10),
    ("cost y = Relu(x) flops " + "(" * 300 + "1" + ")" * 300, "", 1),     # parens add no depth: fine
    ("cost y = Relu(x) flops " + "-" * 300 + "1", "expression nested too deeply (limit 256)", 24 + 256),
    ("cost y = Relu(x) bytes 1", "unexpected 'bytes'", 18),
    ("cost y = Relu(x)", "unexpected end of line", 17),
])
def test_cost_declarations_are_checked_with_positions(text, message, col):
    if not message:
        compile_text(text, "t.rule")
        return
    with pytest.raises(RuleCompileError) as info:
        compile_text(text, "t.rule")
    d = info.value.diagnostics[0]
    assert message in d.message, d.message
    assert (d.loc.file, d.loc.line, d.loc.column) == ("t.rule", 1, col), str(d.loc)
    assert f"t.rule:1:{col}: error: " in str(info.value)


def test_the_cost_builtins_read_only_the_ops_values():
    assert COST_BUILTINS <= set(BUILTINS) and COST_BUILTINS <= set(BUILTIN_TYPES)
    assert not COST_BUILTINS & {"saved", "uses", "available", "is_input", "is_weight", "in_forward"}


def test_cost_and_its_keywords_stay_usable_as_names():
    text = ("cost y = Relu(x) flops 8 bytes 2 * bytes(x)\n"        # `8 bytes`: the clause, not a unit
            "rule r {\n  match {\n    flops = Relu(cost)\n    bytes = Neg(flops)\n"
            "    require bytes(bytes) > 8 and numel(cost) > 1\n  }\n  rewrite { recompute bytes }\n}\n")
    rules = compile_text(text, "t.rule")
    assert rules.rule("r") is not None
    cost = node_cost(node("Relu", [(M,)], (M,)), rules)
    assert (cost.flops, cost.bytes) == (8, 8 * M)


# custom ops ----------------------------------------------------------------------------------

def test_a_custom_op_declares_its_cost():
    text = ("op com.example::Attn outputs 1..2\n"
            "cost out, _ = com.example::Attn(q, k, v, rest...) \\\n"
            "    flops 4 * numel(q) * dim(k, -2) + count(rest) * numel(out) bytes bytes(q) * 3 + bytes(out)\n")
    rules = compile_text(text, "t.rule")
    q = (B, M, K)
    n = node("com.example::Attn", [q, q, q], q, outputs=2)
    cost = node_cost(n, rules)
    assert cost.flops == 4 * B * M * K * M and cost.bytes == 4 * 4 * B * M * K
    masked = node("com.example::Attn", [q, q, q, (M, M)], q)
    assert node_cost(masked, rules).flops == 4 * B * M * K * M + B * M * K
    with pytest.raises(RuleCompileError, match="has 2 outputs, but the statement binds 3"):
        compile_text("op com.example::Attn outputs 1..2\ncost a, b, c = com.example::Attn(q) flops 1\n", "t.rule")


# the shipped library ---------------------------------------------------------------------------

def test_every_shipped_formula_evaluates_or_gives_none_on_any_node():
    """Each op the library covers, on nodes of ranks 0 to 4 with one to four inputs and outputs:
    a number, a formula or None, never an exception."""
    for op, formula in sorted(STD.costs.items()):
        for rank in range(5):
            for inputs in range(1, 5):
                shape = tuple(range(2, 2 + rank))
                n = node(op, [shape] * inputs, shape, outputs=1 + inputs % 2)
                cost = node_cost(n, STD)
                assert cost is not None and cost.formula is formula
                for part in (cost.flops, cost.bytes):
                    assert part is None or (isinstance(part, (int, float)) and part >= 0), (op, rank, inputs, part)

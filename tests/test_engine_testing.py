"""engine.testing: its gradients are torch's, its graphs make the shipped rules fire, its
assertions fail with the shrunk graph, the plan and the "why not", and it imports no backend."""
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from dsl.loader import compile_text, load_rules
from engine.testing import (assert_rule_fires, assert_rule_refuses, assert_rules_preserve_numerics,
                            training_graphs)
from engine.testing.generate import FILL, fires, rule_alone, supported_ops, training_graph, unsupported
from engine.testing.ops import OPS
from engine.why_not import why_not
from ir_graphs import GraphBuilder, gelu_training_graph

ROOT = Path(__file__).resolve().parent.parent
RULES = load_rules()
QUICK = settings(max_examples=12, derandomize=True, database=None, deadline=None,
                 suppress_health_check=list(HealthCheck))


def _one(strategy):
    """The first graph the strategy draws (derandomized, not shrunk)."""
    return find(strategy, lambda tg: True, settings=settings(QUICK, phases=[Phase.generate]))

def _rule_over(op: str):
    return compile_text(f"use std.ops\nrule over_{op.lower()} {{\n  match {{\n    y = {op}(x, rest...)\n  }}\n"
                        f"  rewrite {{ recompute y }}\n}}\n", f"{op}.rule")


@pytest.mark.parametrize("op", sorted(op for op in FILL if OPS[op].vjp is not None))
def test_the_backward_engine_testing_writes_is_torch_autograd(op):
    """The ONNX graph's gradients (engine.testing.ops' formulas) against torch's autograd on the
    same forward (backends/fx/testing.py), op by op, on graphs through the op."""
    torch = pytest.importorskip("torch")
    from backends.fx.testing import GraphModule, _step
    from backends.onnx.exporter import export_model
    from backends.onnx.runtime import run
    from backends.onnx.testing import _with_tensor_payloads
    from engine.testing.check import FLOAT32_EPS, tolerance

    compared = []

    @settings(QUICK, max_examples=3)
    @given(training_graphs(_rule_over(op), dynamic=False, only_firing=False))
    def gradients_agree(tg):
        try:
            got = run(export_model(_with_tensor_payloads(tg.graph), estimate=False), tg.feeds)
        except Exception:      # noqa: BLE001 - ONNX Runtime lacks this op at this dtype
            return
        module = GraphModule(tg)
        want = _step(module, module, [torch.from_numpy(tg.feeds[n].copy()) for n in module.input_names])
        limit = max(tolerance(v.dtype, 1e-4) for v in tg.graph.values()) * 10
        for name, value in want.items():     # a gradient that is exactly zero (the sum of a
            # softmax) comes out at rounding level: float32's epsilon of the loss's unit seed
            assert abs(got[name] - value).max() <= limit * abs(value).max() + FLOAT32_EPS, (name, tg)
        compared.append(tg)

    gradients_agree()
    assert compared, f"no graph through {op} ran in ONNX Runtime"


BUILT = [r.name for r in RULES.rules if not unsupported(r)]


def test_the_shipped_rules_engine_testing_cannot_build_name_only_backend_ops():
    """engine.testing builds graphs of deterministic ONNX ops (both backends run those, and two
    runs must agree); a rule whose pattern names only torch's spelling of an op (a fused attention
    kernel) or a random op (Dropout) is skipped by the plugin."""
    for rule in RULES.rules:
        if rule.name not in BUILT:
            assert all("::" in op or op in RULES.nondeterministic
                       for p in rule.node_patterns() if not supported_ops(p) for op in p.ops), rule.name
    assert len(BUILT) >= 10


@pytest.mark.parametrize("rule", BUILT)
def test_every_shipped_rule_has_generated_graphs_it_fires_on(rule):
    tg = _one(training_graphs(RULES, rule))
    assert fires(tg.graph, RULES, RULES.rule(rule))
    fired = assert_rule_fires(rule, tg)
    assert fired and all(" fires at " in line for line in fired)


def test_rule_assertions_carry_the_why_not():
    graph = gelu_training_graph()
    assert "plan Gelu+" in assert_rule_fires("recompute_activation", graph)[0]
    with pytest.raises(AssertionError) as failed:
        assert_rule_fires("recompute_softmax", graph)
    assert "why not" in str(failed.value) and "no node has op" in str(failed.value)
    with pytest.raises(AssertionError, match="expected to refuse, but it fires:\n.*fires at n_a"):
        assert_rule_refuses("recompute_activation", graph)
    assert assert_rule_refuses("recompute_norm", graph, because="no node has op")
    with pytest.raises(AssertionError, match="no reason says 'dropout'"):
        assert_rule_refuses("recompute_norm", graph, because="dropout")


WRONG = """use std.ops
chunkable pointwise CumSum
rule chunk_running_total {
  match {
    y = CumSum(x, axis)
    require bytes(y) >= 1 MiB
  }
  rewrite { chunk over x along -1 into 4 }
}
"""


def test_a_false_op_fact_fails_with_the_shrunk_graph_and_the_plan():
    rules = compile_text(WRONG, "wrong.rule")
    with pytest.raises(AssertionError) as failed:
        assert_rules_preserve_numerics(rules, training_graphs(rules), backends=("onnx",),
                                       settings=settings(QUICK, max_examples=6))
    message = str(failed.value)
    assert "the rules changed the numbers on onnx" in message
    assert "the plan that broke it: CumSum+:3:-1 (rule chunk_running_total at" in message
    assert "= CumSum(" in message and "%axis" in message


def test_a_backend_not_installed_is_skipped_and_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    tg = _one(training_graphs(RULES, "recompute_activation"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checked = assert_rules_preserve_numerics(RULES, tg)
    assert checked.skipped == {"fx": "torch is not installed"}
    assert checked.graphs == {"onnx": 1} and checked.fired["recompute_activation"] == {"onnx": 1}
    assert any("the fx backend is skipped: torch is not installed" in str(w.message) for w in caught)


def test_a_chunk_region_nothing_reads_is_refused():
    """Generated graphs found it: a dead MatMul (a gradient nobody needs) matched a chunk rule,
    and the ONNX backend wrote a Loop with no outputs, which ONNX Runtime rejects."""
    b = GraphBuilder()
    h = b.input("h", shape=(2048, 2048))
    w = b.input("w", shape=(2048, 2))
    y = b.emit("MatMul", [h, w])
    loss = b.emit("ReduceSum", [y], keepdims=0)
    b.emit("MatMul", [b.input("g", shape=(2048, 2)), b.emit("Transpose", [w], perm=[1, 0])])   # dead
    graph = b.graph([loss])
    lines = why_not(graph, RULES, "chunk_linear_cross_entropy")
    assert any("nothing outside the region reads its values" in line for line in lines), lines


def test_engine_testing_imports_no_backend():
    code = ("import sys, engine.testing, engine.testing.generate, engine.testing.check, engine.testing.plugin; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnx', 'onnxruntime'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_outputs_are_compared_above_the_noise_floor():
    """`remat measure --compare` said ALBERT's rewrite was 1.21 off: on an attention key bias's
    gradient, 3.6e-12 where the largest gradient is 8.3 (zero in exact arithmetic). An output is
    compared against at least 1e-6 of the largest output, as the export check compares; a
    difference in a sizable output, or a NaN on one side only, still counts in full."""
    import numpy as np

    from engine.testing.compare import max_relative_error

    want = {"loss": np.array(8.3), "grad.key_bias": np.array([3.6e-12, -2e-12])}
    got = {"loss": np.array(8.3), "grad.key_bias": np.array([-0.8e-12, 2.4e-12])}
    error, where = max_relative_error(got, want)
    assert error < 1e-6
    got["loss"] = np.array(8.4)
    assert max_relative_error(got, want) == (pytest.approx(0.1 / 8.3), "loss")
    got["grad.key_bias"] = np.array([np.nan, 0.0])
    assert max_relative_error(got, want) == (float("inf"), "grad.key_bias")


def _softmax_sum_step():
    """`sum(softmax(w))` over 393216 float32 elements: 1 whatever w is, so w's gradient is zero in
    exact arithmetic and rounding noise in any computer's."""
    b = GraphBuilder()
    w = b.param("w", shape=(393216,))
    return training_graph(b, b.emit("ReduceSum", [b.emit("Softmax", [w], axis=0)], keepdims=0))


def _float16_norm_step():
    """A float16 layer norm of 768 rows whose weight's gradient sums the rows: the decomposition
    Inductor compiles sums it in float32, eager's kernel in float16, 3% apart."""
    b = GraphBuilder()
    x = b.param("x", "float16", (768, 1024))
    scale, bias = b.param("scale", "float16", (1024,)), b.param("bias", "float16", (1024,))
    y = b.emit("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-5)
    loss = b.emit("ReduceSum", [b.emit("MatMul", [y, b.param("tail", "float16", (1024, 2))])], keepdims=0)
    return training_graph(b, loss, seed=3)


@pytest.mark.parametrize("step, rule", [(_softmax_sum_step, "recompute_softmax"),
                                        (_float16_norm_step, "recompute_norm")])
def test_the_torch_runner_compares_the_rewrite_with_the_same_compile_without_the_rules(step, rule):
    """Under a random Hypothesis profile (a user's `pytest --remat-rules`, not CI's derandomized
    one) `recompute_softmax[fx]` and `recompute_norm[fx]` failed: the torch runner compared the
    rewrite with eager torch, and these graphs differ between eager and Inductor's decompositions
    by 100% (noise against noise) and 3% (a float16 sum against a float32 one). The rewrite equals
    the decomposed graph compiled without the rules to the bit; that is now the original."""
    pytest.importorskip("torch")
    from backends.fx.testing import run
    from engine.testing.check import differences

    tg = step()
    done = run(tg, RULES, ("expensive",))
    assert rule in done.fired() and not differences(tg, done, 1e-4)
    assert all(np.array_equal(done.rewritten[k], v) for k, v in done.original.items())


def test_the_torch_runner_plans_on_the_joint_graph_as_the_pass_sees_it():
    """A random profile drew `Concat(w, v, x)` summed, `x` dynamic: the backward reads the concat's
    size alone, so the joint graph as imported kept it saved and offered `Concat+`; remat's pass,
    whose copy reads that size from the inputs, found no such plan, and the runner's config
    naming it failed the rule's item ("names no plan"). The runner plans on the pass's view."""
    pytest.importorskip("torch")
    from backends.fx.testing import run

    b = GraphBuilder({"d0": 65536})
    w, v = b.param("w", shape=("d0",)), b.param("v", shape=(2,))
    loss = b.emit("ReduceSum", [b.emit("Concat", [w, v, b.input("x", shape=(2,))], axis=0)], keepdims=0)
    tg = training_graph(b, loss, dynamic=frozenset({"d0"}))
    done = run(tg, rule_alone(RULES, RULES.rule("recompute_layout")))
    assert set(done.original) == {"loss", "grad.w", "grad.v"}
    assert all(np.array_equal(done.rewritten[k], value) for k, value in done.original.items())


def _float16_loss_of_a_norm_step():
    """A float16 layer norm, its product with a (768, 2) weight summed in float32 for the loss
    (Hypothesis's random profile drew it): the products cancel, the loss is 1.26 where its
    terms are 30 times that, and ONNX Runtime's original graph computes it 0.036 from float64."""
    from engine.dtypes import DType

    b = GraphBuilder()
    x, lx, lw = b.param("x", "float16", (768, 768)), b.input("lx", "float16", (768,)), b.param("lw", "float16", (768,))
    y = b.emit("LayerNormalization", [x, b.emit("Mul", [lx, lw])], axis=-1)
    t = b.emit("Cast", [b.emit("MatMul", [y, b.param("tail", "float16", (768, 2))])], to=DType.FLOAT32)
    loss = b.emit("ReduceSum", [b.emit("ReduceSum", [t, b.const([-1], np.int64)], keepdims=0)], keepdims=0)
    return training_graph(b, loss, seed=1)


def test_a_rewrite_that_rounds_otherwise_is_judged_against_the_step_in_float64():
    """Recomputing the norm changes which kernels ONNX Runtime runs the forward with, and the
    loss moved by 2.8% of itself: over float16's 1% relative to the output, and yet the
    rewritten loss is 3e-5 from the float64 step where the original's is 0.036. A difference is
    the rules' only beyond ROUNDING_FACTOR times what rounding alone moves the original (its
    distance from float64, its change for inputs one ulp away)."""
    from backends.onnx.testing import run
    from engine.testing.check import _SecondOpinion, beyond_rounding, differences

    tg = _float16_loss_of_a_norm_step()
    rules = rule_alone(RULES, RULES.rule("recompute_norm"))
    done = run(tg, rules, ("expensive",))
    assert [name for name, _, _ in differences(tg, done, 1e-4)] == ["loss"]        # relative to the loss alone
    assert not beyond_rounding(tg, done, 1e-4, _SecondOpinion("onnx", tg))
    assert_rules_preserve_numerics(rules, tg, backends=("onnx",), tiers=("expensive",))
    done.rewritten["grad.tail"] = done.rewritten["grad.tail"] * 1.05      # a scale the rules got wrong
    assert [name for name, _, _ in beyond_rounding(tg, done, 1e-4, _SecondOpinion("onnx", tg))] == ["grad.tail"]


def test_on_torch_the_second_opinion_measures_rounding_on_the_compile_path():
    """The float16 layer norm whose weight gradient eager torch and Inductor's decomposition sum 3%
    apart: the second opinion runs the compile path without the rules, as the original is run,
    so that gap is no allowance, and a gradient 5% off is still a difference."""
    pytest.importorskip("torch")
    from backends.fx.testing import run
    from engine.testing.check import _SecondOpinion, beyond_rounding

    tg = _float16_norm_step()
    done = run(tg, RULES, ("expensive",))
    done.rewritten["grad.bias"] = done.rewritten["grad.bias"] * 1.05
    assert [name for name, _, _ in beyond_rounding(tg, done, 1e-4, _SecondOpinion("fx", tg))] == ["grad.bias"]

"""engine.match against onnxscript's pattern rewriter on the same 100,000-node ONNX graph.

The graph is blocks of MatMul -> Add -> Relu -> Cast(fp16) -> Cast(fp32) -> Softmax -> Mul;
both sides get the same three patterns (MatMul+Add+Relu, Cast+Cast+Softmax, Mul). Loading
the graph (into our IR, into onnxscript's IR) is not timed on either side.

onnxscript's rewriter runs `RewriteRuleSet.apply_to_model` with a condition that declines
every match: it does all of its matching (every rule tried at every node) and rewrites
nothing, which is what engine.match does too. (With a replacement identical to the pattern
it rewrites every match and re-matches the new nodes: 7,000 nodes took over two minutes.)
The ratio is printed last as `NNx`.

    python bench/match_speed.py [--nodes 100000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Benchmarks run remat strict: an internal error is raised, never hidden by a fallback.
os.environ.setdefault("REMAT_STRICT", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.onnx.importer import import_model  # noqa: E402
from dsl.loader import compile_text  # noqa: E402
from engine.matcher import match  # noqa: E402

RULES = """
rule matmul_add_relu {
  match {
    y = Relu(Add(MatMul(x, w), b))
  }
  rewrite { recompute y }
}

rule cast_cast_softmax {
  match {
    y = Softmax(Cast(Cast(x, to=float16), to=float32))
  }
  rewrite { recompute y }
}

rule mul {
  match {
    y = Mul(a, b)
  }
  rewrite { recompute y }
}
"""


def build(n_nodes: int) -> onnx.ModelProto:
    blocks = n_nodes // 7
    nodes = []
    h = "x"
    for i in range(blocks):
        names = [f"{k}{i}" for k in ("mm", "add", "relu", "half", "full", "sm", "mul")]
        nodes += [
            helper.make_node("MatMul", [h, "w"], [names[0]]),
            helper.make_node("Add", [names[0], "b"], [names[1]]),
            helper.make_node("Relu", [names[1]], [names[2]]),
            helper.make_node("Cast", [names[2]], [names[3]], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [names[3]], [names[4]], to=TensorProto.FLOAT),
            helper.make_node("Softmax", [names[4]], [names[5]], axis=-1),
            helper.make_node("Mul", [names[5], "s"], [names[6]]),
        ]
        h = names[6]
    inits = [numpy_helper.from_array(np.eye(16, dtype=np.float32), "w"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b"),
             numpy_helper.from_array(np.ones(16, np.float32), "s")]
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [4, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    return model


def onnxscript_rules():
    from onnxscript.rewriter import pattern

    def mm_add_relu(op, x, w, b):
        return op.Relu(op.Add(op.MatMul(x, w), b))

    def cast_cast_softmax(op, x):
        return op.Softmax(op.Cast(op.Cast(x, to=TensorProto.FLOAT16), to=TensorProto.FLOAT), axis=-1)

    def mul(op, a, b):
        return op.Mul(a, b)

    def condition(*args, **kwargs):
        return False

    return pattern.RewriteRuleSet([
        pattern.RewriteRule(mm_add_relu, mm_add_relu, condition),
        pattern.RewriteRule(cast_cast_softmax, cast_cast_softmax, condition),
        pattern.RewriteRule(mul, mul, condition),
    ])


def time_onnxscript(model: onnx.ModelProto, repeats: int) -> tuple[float, int]:
    import onnx_ir as ir

    times, count = [], 0
    for _ in range(repeats):
        ir_model = ir.from_proto(model)
        rules = onnxscript_rules()
        start = time.perf_counter()
        count = rules.apply_to_model(ir_model)
        times.append(time.perf_counter() - start)
    return min(times), count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5, help="each side's best time of this many runs")
    args = ap.parse_args()
    model = build(args.nodes)
    graph = import_model(model)
    rules = compile_text(RULES, "bench.rule")
    times, found = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        found = match(graph, rules)
        times.append(time.perf_counter() - start)
    ours = min(times)
    per_rule = {r.name: sum(1 for m in found if m.rule is r) for r in rules.rules}
    theirs, rewrites = time_onnxscript(model, args.repeats)
    assert rewrites == 0
    n = len(graph.nodes)
    print(f"graph: {n} nodes; remat matches per rule: {per_rule}")
    print(f"{'':28}{'seconds':>10}{'nodes/s':>14}")
    print(f"{'remat engine.match':28}{ours:>10.3f}{n / ours:>14,.0f}")
    print(f"{'onnxscript rewriter':28}{theirs:>10.3f}{n / theirs:>14,.0f}")
    print("remat speed-up over onnxscript's rewriter (same graph, same three patterns):")
    print(f"{theirs / ours:.0f}x")


if __name__ == "__main__":
    main()

"""The shipped loss chunk rule on training graphs spelled as ONNX Runtime writes them:
SoftmaxCrossEntropyLoss with its log_prob output, LayerNormalization with its statistics outputs,
com.microsoft::FusedMatMul and Gemm with transposed operands (tests/training_graphs.py
build_ort_loss_head), and a graph ONNX Runtime's own optimizer wrote. Each rewrite runs in ONNX
Runtime and gives the original's loss and gradients."""
from __future__ import annotations

import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import FORWARD_OUTPUTS_KEY, import_model  # noqa: E402
from backends.onnx.rewrite import apply_rules  # noqa: E402
from backends.onnx.runtime import max_relative_error, run  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.ir import DType, Node, Value  # noqa: E402
from engine.why_not import why_not  # noqa: E402
from engine.strategies.chunk.kinds import dim_map  # noqa: E402

from training_graphs import ORT_MATMULS, build_ort_loss_head  # noqa: E402

# 512 tokens x 8192 classes: 16 MiB of logits, the shipped rule's threshold, in two slices
TOKENS, D, VOCAB = 512, 32, 8192


@pytest.fixture(scope="module")
def shipped():
    return load_rules(["rules"])


def _largest_outside_loops(graph) -> int:
    return max(o.numel for n in graph.nodes if n.op != "Loop" for o in n.outputs if o.shape is not None)


def _chunked_matches(model, feeds, rules, reference=None):
    rewrite = apply_rules(import_model(model), rules, strict=True)
    assert rewrite.chunked == 1 and not rewrite.failures, rewrite.report()
    assert _largest_outside_loops(rewrite.graph) < TOKENS * VOCAB
    error, where = max_relative_error(run(export_model(rewrite.graph), feeds), reference or run(model, feeds))
    assert error <= 1e-4, where
    return rewrite


@pytest.mark.parametrize("matmul", ORT_MATMULS)
@pytest.mark.parametrize("ignored,reduction", [(0, "mean"), (37, "mean"), (37, "sum")])
def test_ort_spelled_loss_head_is_chunked_by_the_shipped_rule(shipped, matmul, ignored, reduction):
    model, feeds = build_ort_loss_head(TOKENS, D, VOCAB, ignored, reduction, matmul)
    assert (feeds["labels"] == -100).sum() == ignored
    rewrite = _chunked_matches(model, feeds, shipped)
    loops = [n for n in rewrite.graph.nodes if n.op == "Loop"]
    body_ops = {n.op for loop in loops for g in loop.subgraphs.values() for n in g.nodes}
    assert "SoftmaxCrossEntropyLoss" in body_ops        # the two-output loss runs in the slices
    assert {"MatMul": "MatMul", "FusedMatMul": "com.microsoft::FusedMatMul", "Gemm": "Gemm"}[matmul] in body_ops


def test_a_graph_onnx_runtimes_optimizer_wrote_is_chunked(shipped, tmp_path):
    """ORT's extended optimizations fuse the weight gradient's transpose into a FusedMatMul,
    whose output ONNX's shape inference leaves untyped (backends/onnx/contrib_shapes.py types it)."""
    model, feeds = build_ort_loss_head(TOKENS, D, VOCAB, ignored=5)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    assert any(n.domain == "com.microsoft" and n.op_type == "FusedMatMul" for n in optimized.graph.node)
    assert any(p.key == FORWARD_OUTPUTS_KEY for p in optimized.metadata_props)
    graph = import_model(optimized)
    fused = [n for n in graph.nodes if n.op == "com.microsoft::FusedMatMul"]
    assert fused and all(n.outputs[0].shape is not None for n in fused)
    _chunked_matches(optimized, feeds, shipped, reference=run(model, feeds))


def test_slicing_the_dim_a_transposed_matmul_contracts_is_refused(shipped):
    """FusedMatMul(h, w, transA=1): `chunk over h along 0` slices the contracted dim, which would
    give partial sums of the whole logits, not slices of them."""
    from onnx import TensorProto, helper
    tokens, d = 512, 512
    nodes = [helper.make_node("FusedMatMul", ["h", "w"], ["logits"], domain="com.microsoft", transA=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss", "log_prob"])]
    graph = helper.make_graph(nodes, "transposed", [
        helper.make_tensor_value_info("h", TensorProto.FLOAT, [d, tokens]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [d, VOCAB]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, [tokens])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, [tokens, VOCAB])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    ir = import_model(model)
    assert apply_rules(ir, shipped, strict=True).chunked == 0
    text = "\n".join(why_not(ir, shipped, "chunk_linear_cross_entropy"))
    assert "does not fire" in text and "contracts" in text and "partial sum" in text, text


def _node(op, input_shapes, output_shapes, **attrs) -> Node:
    ins = [Value(f"i{k}", DType.FLOAT32, s) for k, s in enumerate(input_shapes)]
    outs = [Value(f"o{k}", DType.FLOAT32, s) for k, s in enumerate(output_shapes)]
    return Node(op, ins, outs, attrs, op.lower())


def test_norm_kind_carries_the_leading_dims_to_its_statistics():
    ln = _node("LayerNormalization", [(4, 6, 8), (8,), (8,)], [(4, 6, 8), (4, 6, 1), (4, 6, 1)], axis=-1)
    dm = dim_map(ln, "norm")
    assert dm.maps[0] == {0: 0, 1: 1} and dm.maps[1] == {} and dm.blocked == {(0, 2)}
    assert dm.extra_outputs == [{0: 0, 1: 1}, {0: 0, 1: 1}]
    ln1 = _node("LayerNormalization", [(4, 6, 8)], [(4, 6, 8), (4, 1, 1)], axis=1)
    assert dim_map(ln1, "norm").blocked == {(0, 1), (0, 2)}


def test_matmul_kind_reads_transposes_and_never_sums_over_gemms_bias():
    fused = _node("com.microsoft::FusedMatMul", [(32, 512), (8192, 32)], [(512, 8192)], transA=1, transB=1)
    dm = dim_map(fused, "matmul")
    assert dm.maps[0] == {0: 1} and dm.maps[1] == {1: 0} and dm.summed == [[(0, 0), (1, 1)]]
    gemm = _node("Gemm", [(512, 32), (8192, 32), (8192,)], [(512, 8192)], transB=1)
    dm = dim_map(gemm, "matmul")
    assert dm.maps == [{0: 0}, {1: 0}, {1: 0}]
    assert dm.summed == [] and dm.blocked == {(0, 1), (1, 1)}    # C would be added once per slice


def test_contrib_outputs_are_typed_and_inference_runs_on_from_them():
    """A chain through two FusedMatMuls with symbolic dims: each output typed in turn, and the
    standard op after them typed by ONNX's inference."""
    from onnx import TensorProto, helper
    from backends.onnx.contrib_shapes import infer_shapes
    nodes = [helper.make_node("FusedMatMul", ["x", "w"], ["h"], domain="com.microsoft", transB=1),
             helper.make_node("FusedMatMul", ["h", "v"], ["o"], domain="com.microsoft", alpha=0.5),
             helper.make_node("Softmax", ["o"], ["p"], axis=-1)]
    graph = helper.make_graph(nodes, "chain", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [32, 16]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 32, 8])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid("com.microsoft", 1)])
    inferred = infer_shapes(model, strict_mode=True)
    shapes = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
              for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    assert shapes["h"] == ["batch", "seq", 32] and shapes["o"] == ["batch", "seq", 8]
    assert shapes["p"] == ["batch", "seq", 8]

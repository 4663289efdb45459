"""A MatMul operand broadcast by an Expand is read unbroadcast at import (backends/onnx/broadcast.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("onnxruntime")

from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.runtime import max_relative_error, run  # noqa: E402


def _bmm_by_broadcast_weight(reader: str = "MatMul", batch_dims=("seq", 3)) -> onnx.ModelProto:
    """torch's matmul of a transposed [seq, batch, k] input by W.t() as make_fx writes it: the
    weight expanded to [seq, k, n] and viewed, a bmm; and the input's gradient's bmm by the
    expanded weight transposed. `reader` reads the expanded weight in place of the bmm."""
    seq, batch = batch_dims
    k, n = 8, 12
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, k])
    g = helper.make_tensor_value_info("g", TensorProto.FLOAT, [seq, batch, n])
    w = helper.make_tensor("w", TensorProto.FLOAT, [n, k], np.random.default_rng(0).standard_normal(n * k))
    y = [seq, batch, n] if reader == "MatMul" else [seq, k, n]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, y),
            helper.make_tensor_value_info("dx", TensorProto.FLOAT, [seq, batch, k])]
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Shape", ["x"], ["xs"], start=0, end=1),
        helper.make_node("Constant", [], ["kn"], value=helper.make_tensor("kn", TensorProto.INT64, [2], [k, n])),
        helper.make_node("Concat", ["xs", "kn"], ["target"], axis=0),
        helper.make_node("Expand", ["wt", "target"], ["wide"]),
        helper.make_node("Reshape", ["wide", "target"], ["wide_view"]),
        helper.make_node(reader, ["x", "wide_view"], ["y"]) if reader == "MatMul"
        else helper.make_node(reader, ["wide_view", "wide_view"], ["y"]),
        helper.make_node("Transpose", ["wide_view"], ["wide_t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["g", "wide_t"], ["dx"]),
    ]
    graph = helper.make_graph(nodes, "bmm", [x, g], outs, [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _feeds(seq: int = 5, batch: int = 3):
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((seq, batch, 8)).astype(np.float32),
            "g": rng.standard_normal((seq, batch, 12)).astype(np.float32)}


@pytest.mark.parametrize("batch_dims", [("seq", 3), (5, 3)], ids=["dynamic", "static"])
def test_a_weight_broadcast_for_a_bmm_is_read_by_the_matmul_itself(batch_dims):
    model = _bmm_by_broadcast_weight(batch_dims=batch_dims)
    dynamic = batch_dims[0] == "seq"
    graph = import_model(model, dim_examples={"seq": 5} if dynamic else None)
    assert not [n for n in graph.nodes if n.op in ("Expand", "Reshape", "Concat")]
    [back] = [n for n in graph.nodes if n.op == "Transpose" and n.inputs[0].name == "wt"]
    assert back.attrs["perm"] == [1, 0] and back.outputs[0].shape == (12, 8)
    written = export_model(graph)
    for seq in (5, 2) if dynamic else (5,):
        feeds = _feeds(seq)
        assert max_relative_error(run(written, feeds), run(model, feeds))[0] <= 1e-6


def test_an_expand_read_by_anything_but_a_matmul_stays():
    graph = import_model(_bmm_by_broadcast_weight(reader="Add"), dim_examples={"seq": 5})
    assert [n.op for n in graph.nodes if n.op == "Expand"] == ["Expand"]


def test_lora_style_frozen_attention_exports_without_its_weights_copied_per_position():
    """nn.MultiheadAttention(batch_first=True) projects a transposed input, and torch's matmul
    folds such an input into a matrix only for a weight that trains: with the weight frozen (LoRA
    fine-tuning) the export broadcasts it over the sequence, seq copies that the backward keeps.
    Read unbroadcast, the step holds no such value, and its outputs and gradients are torch's."""
    torch = pytest.importorskip("torch")
    from backends.onnx.torch_export import export_training_step

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(16, 16)
            self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.mha.in_proj_weight.requires_grad_(False)

        def forward(self, x):
            out, _ = self.mha(*[self.embed(x)] * 3)
            return out.square().mean()

    torch.manual_seed(0)
    exported = export_training_step(Attention(), (torch.randn(2, 24, 16),), ["x"])
    raw = import_model(exported.model, read_through=False)
    graph = import_model(exported.model)
    weight = 3 * 16 * 16 * 4

    def broadcast_weights(g):
        return [n for n in g.nodes if n.op == "Expand" and n.outputs[0].nbytes >= 24 * weight]

    assert broadcast_weights(raw) and not broadcast_weights(graph)
    out = run(export_model(graph), exported.feeds)
    assert max_relative_error(out, exported.reference)[0] <= 1e-5


def test_on_torch_a_frozen_weights_expand_is_a_view_no_plan_recomputes():
    """The same model's joint graph keeps `expand(W.t())` for the bmm's backward; in torch that
    is a view of the weight (stride 0), so recomputing it saves nothing: the layout rule's match
    is refused with that reason, and the peak simulation counts the view as the weight's."""
    torch = pytest.importorskip("torch")
    import backends.fx as fx_backend
    from backends.fx.importer import import_fx
    from dsl.loader import load_rules
    from engine.analysis import estimate_peak

    class Projection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(64, 64)
            self.frozen = torch.nn.Linear(64, 192)
            self.frozen.weight.requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.embed(x).transpose(0, 1)).square().mean()

    model, x = Projection(), torch.randn(2, 256, 64)
    planning = fx_backend.analyze(model, (x,), show=False)
    assert not planning.plans
    [refusal] = [r for r in planning.refusals if r.match.rule.name == "recompute_layout"]
    assert "is a view of %primals" in refusal.reason.message and "saves nothing" in refusal.reason.message
    graph = import_fx(fx_backend.joint_graph(model, (x,)))
    [expand] = [n for n in graph.nodes if n.native_op == "aten::expand" and n.outputs[0].nbytes >= 256 * 64 * 192 * 4]
    views = load_rules().views
    with_views, without = estimate_peak(graph, views).peak_bytes, estimate_peak(graph).peak_bytes
    assert without - with_views >= expand.outputs[0].nbytes

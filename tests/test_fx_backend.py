"""The torch side: the ATen joint graph in the IR, and the same rules giving the same plans."""
import pytest

torch = pytest.importorskip("torch")

import backends.fx as fx_backend  # noqa: E402
from backends.fx.importer import import_fx  # noqa: E402
from backends.models import GPTConfig, gpt  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.torch_export import export_training_step  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.analysis import analyze  # noqa: E402
from engine.apply import plan  # noqa: E402

CFG = GPTConfig(vocab=1024, d_model=128, layers=2, heads=4, seq=256, batch=8)

# Each difference between the backends' plan keys, with its reason.
KNOWN_DIFFERENCES = {
    # torch.onnx exports aten.split_with_sizes (one node, several outputs) as SplitToSequence + SequenceAt.
    "SplitToSequence+SequenceAt+": "Split+",
}


@pytest.fixture(scope="module")
def model():
    return gpt(CFG)


def test_joint_graph_imports_with_onnx_names_and_native_ops(model):
    graph = import_fx(fx_backend.joint_graph(model, model.example_inputs()))
    graph.verify()
    ops = {n.op for n in graph.nodes}
    assert {"Gelu", "Softmax", "LayerNormalization", "MatMul", "Gemm", "Reshape"} <= ops
    gelu = next(n for n in graph.nodes if n.op == "Gelu")
    assert gelu.meta["native_op"] == "aten::gelu"
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    assert softmax.attrs["axis"] == -1
    a = analyze(graph, graph.meta["forward_outputs"])
    assert graph.meta["forward_outputs"] == [graph.outputs[0].name] and a.stashed


def test_same_rules_same_plans_on_both_backends(model):
    fx_plans = fx_backend.analyze(model, model.example_inputs(), tiers=["expensive"], show=False).plans
    exported = export_training_step(model, model.example_inputs(), ["idx", "targets"])
    onnx_plans = plan(import_model(exported.model), load_rules(), ["expensive"]).plans

    def normalized(plans):
        out = {}
        for p in plans:
            key = p.key
            for onnx_spelling, torch_spelling in KNOWN_DIFFERENCES.items():
                key = key.replace(onnx_spelling, torch_spelling)
            out[(key, p.type)] = p.frequency
        return out

    fx_keys, onnx_keys = normalized(fx_plans), normalized(onnx_plans)
    assert len(fx_keys) >= 8
    assert fx_keys == onnx_keys

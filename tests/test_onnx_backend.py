"""The ONNX backend: import/export, CSE-proof clones in a default session, measurement."""
import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from backends.onnx.exporter import export_model
from backends.onnx.importer import import_model
from backends.onnx.runtime import max_relative_error, measure, run
from dsl.loader import load_rules
from engine.apply import apply
from engine.errors import GraphError
from engine.shapes import symbol
from training_graphs import Layer, build_mlp

RULES = load_rules()


def optimized_op_counts(model: onnx.ModelProto, tmp_path) -> collections.Counter:
    """Op types of the graph a default ONNX Runtime session actually runs."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)


def test_import_symbolic_dims_and_roundtrip():
    model, feeds = build_mlp(8, [Layer(16, "Gelu")], examples={"batch": 2, "seq": 5})
    graph = import_model(model)
    graph.verify()
    x = graph.inputs[0]
    assert x.shape == (symbol("batch"), symbol("seq"), 8)
    assert graph.dim_examples == {"batch": 2, "seq": 5}
    again = export_model(graph, for_onnxruntime=False)
    onnx.checker.check_model(again)
    assert [d.dim_param for d in again.graph.input[0].type.tensor_type.shape.dim[:2]] == ["batch", "seq"]
    assert max_relative_error(run(again, feeds), run(model, feeds))[0] == 0.0


def test_recompute_clones_survive_default_session_cse(tmp_path):
    model, feeds = build_mlp(64, [Layer(256, "Gelu"), Layer(256, "Gelu"), Layer(64, "Gelu")],
                             dims=(512,), examples={})
    result = apply(import_model(model), RULES)
    assert [(p.key, p.applied) for p in result.plans] == [("Gelu+", 2)]
    rewritten = export_model(result.graph)
    before = optimized_op_counts(model, tmp_path)
    after = optimized_op_counts(rewritten, tmp_path)
    assert after["Gelu"] == before["Gelu"] + 2
    assert max_relative_error(run(rewritten, feeds), run(model, feeds))[0] == 0.0


def test_without_barrier_cse_merges_the_clones(tmp_path):
    """The trap docs/design.md records, kept as a test: plain clones are merged back."""
    model, _ = build_mlp(64, [Layer(256, "Gelu"), Layer(64, "Gelu")], dims=(512,), examples={})
    result = apply(import_model(model), RULES)
    assert result.plans[0].applied == 1
    plain = result.graph.copy()
    for node in plain.nodes:
        node.recompute_region = None
    counts = optimized_op_counts(export_model(plain), tmp_path)
    assert counts["Gelu"] == optimized_op_counts(model, tmp_path)["Gelu"]


def test_measured_peak_drops(tmp_path):
    model, feeds = build_mlp(256, [Layer(1024, "Gelu"), Layer(1024, "Gelu"), Layer(1024, "Gelu"),
                                   Layer(256, "Gelu")], dims=(2048,), examples={})
    rewritten = export_model(apply(import_model(model), RULES).graph)
    before, after = measure(model, feeds, repeats=1), measure(rewritten, feeds, repeats=1)
    assert after.peak_above_rest < 0.85 * before.peak_above_rest, (before, after)
    assert after.seconds > 0 and before.provider == "CPUExecutionProvider"


def test_bad_model_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(GraphError, match="not a readable ONNX model"):
        import_model(bad)
    with pytest.raises(GraphError, match="no such file"):
        import_model(tmp_path / "missing.onnx")


def test_undefined_input_names_the_node():
    node = onnx.helper.make_node("Relu", ["ghost"], ["y"], name="lonely")
    graph = onnx.helper.make_graph([node], "g", [], [onnx.helper.make_tensor_value_info("y", 1, [1])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    with pytest.raises(GraphError, match="lonely.*reads 'ghost'"):
        import_model(model)


def test_empty_list_attribute_roundtrips():
    """torch.onnx writes `Constant(value_ints=[])` (an empty shape; the aot-joint export of Hugging
    Face's GPT-2): written back with the type its schema gives, not refused by onnx.helper."""
    empty = onnx.helper.make_attribute("value_ints", [], attr_type=onnx.AttributeProto.INTS)
    const = onnx.helper.make_node("Constant", [], ["shape"], name="empty_shape")
    const.attribute.append(empty)
    reshape = onnx.helper.make_node("Reshape", ["x", "shape"], ["y"], name="to_scalar")
    graph = onnx.helper.make_graph([const, reshape], "g", [onnx.helper.make_tensor_value_info("x", 1, [1])],
                                   [onnx.helper.make_tensor_value_info("y", 1, [])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])
    again = export_model(import_model(model), for_onnxruntime=False)
    written = next(n for n in again.graph.node if n.op_type == "Constant").attribute[0]
    assert (written.name, written.type, list(written.ints)) == ("value_ints", onnx.AttributeProto.INTS, [])
    feeds = {"x": np.array([3.0], dtype=np.float32)}
    assert run(again, feeds)["y"].shape == ()


def test_fills_import_with_the_number_every_element_holds():
    """`Value.filled`: a ConstantOfShape's value, ONNX's zero where it gives none (AOTAutograd's
    exports start the experts' gradients so), a one-element Constant's or initializer's (or its
    `value_float`), small integers all the same; not a Constant of different numbers."""
    h, T = onnx.helper, onnx.TensorProto
    shape = h.make_node("Constant", [], ["shape"], value=h.make_tensor("s", T.INT64, [2], [3, 4]))
    nodes = [shape, h.make_node("ConstantOfShape", ["shape"], ["zeros"]),
             h.make_node("ConstantOfShape", ["shape"], ["twos"], value=h.make_tensor("v", T.FLOAT, [1], [2.0])),
             h.make_node("Constant", [], ["half"], value=h.make_tensor("c", T.FLOAT, [], [0.5])),
             h.make_node("Constant", [], ["nought"], value_float=0.0),
             h.make_node("Constant", [], ["pads"], value_ints=[0, 0]),
             h.make_node("Add", ["zeros", "twos"], ["a"]), h.make_node("Add", ["a", "half"], ["b"]),
             h.make_node("Add", ["b", "nought"], ["c"]), h.make_node("Mul", ["c", "three"], ["y"])]
    graph = h.make_graph(nodes, "fills", [], [h.make_tensor_value_info("y", T.FLOAT, [3, 4])],
                         initializer=[h.make_tensor("three", T.FLOAT, [1], [3.0])])
    imported = import_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    filled = {o.name: o.filled for n in imported.nodes for o in n.outputs}
    assert filled == {"shape": None, "zeros": 0.0, "twos": 2.0, "half": 0.5, "nought": 0.0, "pads": 0.0,
                      "a": None, "b": None, "c": None, "y": None}
    values = {v.name: v for v in imported.values()}
    assert values["three"].filled == 3.0
    assert values["twos"].ints is None and values["pads"].ints == [0, 0]

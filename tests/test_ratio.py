"""`--ratio R`: layers found from module paths or from the forward's repetition, and the budget a
ratio stands for, solved by the same planner."""
from __future__ import annotations

import numpy as np
import pytest

from backends.onnx.importer import import_model
from backends.onnx.rewrite import apply_rules
from dsl.loader import load_rules
from engine.analysis import analyze
from engine.budget import find_layers, parse_ratio, preset
from engine.budget.layers import _longest_repetition, _numbered_prefixes
from engine.errors import ConfigError
from training_graphs import Layer, build_mlp

RULES = load_rules()
DEVICE = preset("cpu-default")


@pytest.mark.parametrize("seq, want", [
    (list("xabcabcabcy"), (1, 3, 3)),
    (list("abab"), (0, 2, 2)),
    (list("abcd"), (0, 0, 0)),
    (list("xxaab"), (0, 1, 2)),
])
def test_the_longest_repetition(seq, want):
    assert _longest_repetition(seq) == want


def test_numbered_module_paths():
    assert _numbered_prefixes("blocks.3.attn.0") == [("blocks", "3"), ("blocks.3.attn", "0")]
    assert _numbered_prefixes("head") == []


def test_ratios_are_fractions():
    assert parse_ratio("0.5").ratio == 0.5
    for bad in ("0", "1.5", "half", "nan"):
        with pytest.raises(ConfigError, match="ratio"):
            parse_ratio(bad)


def _repeated_mlp(n: int, width: int = 256):
    model, feeds = build_mlp(width, [Layer(width, "Gelu") for _ in range(n)], examples={"batch": 8, "seq": 64})
    return model, feeds, import_model(model)


def test_an_onnx_graph_without_module_paths_has_its_repeated_layers_found():
    _, _, graph = _repeated_mlp(4)
    layers, how = find_layers(graph, analyze(graph, graph.forward_outputs))
    assert how == "repeated subgraphs"
    assert len(layers) == 4
    sizes = {len(layer.nodes) for layer in layers[:-1]}
    assert len(sizes) == 1


def test_module_paths_name_the_layers_when_an_exporter_wrote_them():
    _, _, graph = _repeated_mlp(3)
    analysis = analyze(graph, graph.forward_outputs)
    forward = [n for n in graph.nodes if analysis.is_forward(n)]
    for k, node in enumerate(forward):
        node.scope = f"model.blocks.{min(k * 3 // len(forward), 2)}.mlp"
    layers, how = find_layers(graph, analysis)
    assert how == "module paths"
    assert [layer.name for layer in layers] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]


def test_a_higher_ratio_never_gives_a_higher_peak():
    from backends.onnx.ort_order import estimated_ort_peak

    _, _, graph = _repeated_mlp(4, 512)
    original = estimated_ort_peak(graph).peak_bytes
    peaks = []
    for ratio in (0.25, 0.5, 1.0):
        rewrite = apply_rules(graph, RULES, tiers=["expensive"], budget=parse_ratio(ratio), device=DEVICE)
        assert "layers found from repeated subgraphs" in rewrite.choice.note
        assert rewrite.simulated_peak <= max(rewrite.choice.budget, peaks[-1] if peaks else 0)
        peaks.append(rewrite.simulated_peak)
    assert peaks[0] < original
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks


def test_a_graph_without_layers_refuses_a_ratio():
    model, _ = build_mlp(64, [Layer(128, "Gelu"), Layer(256, "Relu")], examples={"batch": 8, "seq": 64})
    graph = import_model(model)
    with pytest.raises(ConfigError, match="needs the model's layers"):
        apply_rules(graph, RULES, budget=parse_ratio(0.5), device=DEVICE)


def test_the_cli_takes_a_ratio(tmp_path, capsys):
    import onnx

    from backends.cli import main

    model, feeds, _ = _repeated_mlp(4, 512)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    np.savez(path.with_suffix(".inputs.npz"), **feeds)
    assert main(["analyze", str(path), "--ratio", "0.5", "--device", "cpu-default"]) == 0
    assert "ratio 0.5: 4 layers found from repeated subgraphs" in capsys.readouterr().out
    assert main(["apply", str(path), "-o", str(tmp_path / "r.onnx"), "--ratio", "0.5",
                 "--device", "cpu-default"]) == 0
    assert main(["analyze", str(path), "--ratio", "0.5", "--budget", "0.5"]) == 1
    assert "not allowed with argument" in capsys.readouterr().err

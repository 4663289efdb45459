"""An internal failure never kills a training step: remat warns once and compiles without the
plan that failed (or without remat); strict mode raises. Scalars are operands on every path."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.importer import import_fx  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import MLP  # noqa: E402
from backends.onnx.rewrite import apply_rules  # noqa: E402
from dsl.loader import compile_text, load_rules  # noqa: E402
from engine.apply import plan  # noqa: E402
from engine.failures import PlanFailure, inject_failure  # noqa: E402
from ir_graphs import CHUNK_HEAD_RULE  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    # One GELU of 512 KiB: recompute_activation has exactly one site.
    return MLP([256, 1024, 64], "gelu"), (torch.randn(128, 256, generator=g), torch.randn(128, 64, generator=g))


def _remat_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("remat:")]


def test_an_injected_rewrite_failure_warns_once_and_the_step_matches_torch_compile(fresh_compiles):
    model, inputs = _mlp()
    want_loss, want_grads, _ = training_step(model, torch.compile(model), inputs)
    torch._dynamo.reset()
    remat = fx_backend.backend(strict=False)
    with inject_failure("recompute_activation", "rewrite"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, _ = training_step(model, torch.compile(model, backend=remat), inputs)
    [message] = _remat_warnings(caught)
    assert "recompute_activation" in message and "at node" in message and "InjectedFailure" in message
    assert "compiling without that plan" in message
    [result] = remat.remat_pass.results
    assert not any("recompute_activation" in p.rules and p.applied for p in result.plans)
    assert relative_error(loss, want_loss) <= 1e-6
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-6


def test_strict_raises_the_injected_failure(fresh_compiles):
    model, inputs = _mlp()
    remat = fx_backend.backend(strict=True)
    with inject_failure("recompute_activation", "rewrite"), pytest.raises(Exception, match="failure injected"):
        training_step(model, torch.compile(model, backend=remat), inputs)


def test_remat_strict_environment_variable_decides_the_default(fresh_compiles, monkeypatch):
    model, inputs = _mlp()
    monkeypatch.setenv("REMAT_STRICT", "1")
    with inject_failure("recompute_activation", "match"), pytest.raises(Exception, match="failure injected"):
        training_step(model, torch.compile(model, backend=fx_backend.backend()), inputs)
    torch._dynamo.reset()
    monkeypatch.setenv("REMAT_STRICT", "0")
    remat = fx_backend.backend()
    with inject_failure("recompute_activation", "match"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training_step(model, torch.compile(model, backend=remat), inputs)
    messages = _remat_warnings(caught)     # one per site the rule was tried at, each once
    assert messages and len(set(messages)) == len(messages)
    assert all(", match)" in m and "recompute_activation" in m for m in messages)


def test_a_failure_remat_cannot_place_compiles_the_graph_without_remat(fresh_compiles, monkeypatch):
    import backends.fx.compile as compile_module

    model, inputs = _mlp()
    want_loss, want_grads, _ = training_step(model, torch.compile(model), inputs)
    torch._dynamo.reset()

    def broken(*args, **kwargs):
        raise KeyError("an importer bug")

    monkeypatch.setattr(compile_module, "import_fx", broken)
    remat = fx_backend.backend(strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, _ = training_step(model, torch.compile(model, backend=remat), inputs)
    [message] = _remat_warnings(caught)
    assert "compiled without remat" in message and "an importer bug" in message
    assert not remat.remat_pass.results
    assert relative_error(loss, want_loss) <= 1e-6
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-6


def _onnx_mlp():
    from backends.onnx.importer import import_model
    from training_graphs import Layer, build_mlp

    model, feeds = build_mlp(64, [Layer(256, "Gelu"), Layer(256, "Sigmoid"), Layer(256, "Relu", True),
                                  Layer(64, "Gelu")],
                             examples={"batch": 8, "seq": 128})
    return model, feeds, import_model(model)


def test_the_onnx_path_refuses_the_failed_plan_applies_the_others_and_reports_it():
    from backends.onnx.exporter import export_model
    from backends.onnx.runtime import max_relative_error, run

    model, feeds, graph = _onnx_mlp()
    rules = load_rules()
    config = "Gelu+:1:-1,Cast+:2:-1"
    full = apply_rules(graph, rules, config, strict=False)
    sites = [r for r in full.result.applied if r.match.rule.name == "recompute_activation"]
    assert sites and len(full.result.applied) >= 2
    first = sites[0].match.root.name
    heard = []
    with inject_failure("recompute_activation", "rewrite", node=first):
        rewrite = apply_rules(graph, rules, config, strict=False, on_failure=heard.append)
    [failure] = rewrite.failures
    assert heard == [failure] and failure.site.node == first and failure.stage == "rewrite"
    applied = {(r.match.rule.name, r.match.root.name) for r in rewrite.result.applied}
    assert ("recompute_activation", first) not in applied and len(applied) == len(full.result.applied) - 1
    assert f"rule recompute_activation at node {first}" in rewrite.report()
    assert "Skipped after an internal error" in rewrite.report()
    got = run(export_model(rewrite.graph), feeds)
    want = run(model, feeds)
    assert max_relative_error(got, want)[0] <= 1e-5
    with inject_failure("recompute_activation", "rewrite", node=first), pytest.raises(PlanFailure):
        apply_rules(graph, rules, config, strict=True)


def test_a_failure_while_matching_becomes_a_refusal_and_strict_raises_it():
    _, _, graph = _onnx_mlp()
    rules = load_rules()
    with inject_failure("recompute_activation", "match"):
        planning = plan(graph, rules, strict=False)
        assert planning.failures and all(f.stage == "match" for f in planning.failures)
        assert not any("recompute_activation" in p.rules for p in planning.plans)
        with pytest.raises(PlanFailure, match="recompute_activation"):
            plan(graph, rules, strict=True)


class TemperatureHead(nn.Module):
    """Cross-entropy of logits divided by a Python float: ATen's `div.Tensor(x, 2.0)`."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 256, bias=False)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(x) / 2.0, labels)


def test_python_scalars_are_operands_in_the_ir():
    model = TemperatureHead()
    x, labels = torch.randn(64, 16), torch.randint(0, 256, (64,))
    graph = import_fx(fx_backend.joint_graph(model, (x, labels)), fold=False)
    divs = [n for n in graph.nodes if n.op == "Div" and any(v.literal for v in n.inputs)]
    assert divs, "the division by 2.0 has its divisor as an operand"
    for node in divs:
        assert len(node.inputs) == 2
        [literal] = [v for v in node.inputs if v.literal]
        assert literal.shape == () and float(np.asarray(literal.data)) == 2.0


def test_a_chunk_region_through_a_division_by_a_python_float_matches_eager(fresh_compiles):
    """The class of the crash users saw: `check_linear` indexed a Div's missing second operand."""
    rules = compile_text(CHUNK_HEAD_RULE.format(count=4), "chunk_head.rule")
    torch.manual_seed(0)
    model = TemperatureHead()
    inputs = (torch.randn(64, 16), torch.randint(0, 256, (64,)))
    want_loss, want_grads, _ = training_step(model, model, inputs)
    remat = fx_backend.backend(rules=rules, strict=True)
    loss, grads, _ = training_step(model, torch.compile(model, backend=remat), inputs)
    assert remat.remat_pass.chunked == 1
    assert relative_error(loss, want_loss) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-5


def test_the_pass_pauses_the_garbage_collector_and_always_gives_it_back(monkeypatch):
    """The pass runs with Python's cyclic collector off (each collection would scan the whole
    compile process), and leaves it as it found it: on after a pass, after a pass that raised,
    and off where the user had turned it off."""
    from backends.fx import compile as fx_compile

    model, inputs = _mlp()
    joint = fx_backend.joint_graph(model, inputs)
    seen = []
    real = fx_compile.rewrite
    monkeypatch.setattr(fx_compile, "rewrite", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    assert gc.isenabled()
    fx_compile.RematPass(load_rules(), strict=True)(joint.graph)
    assert seen == [False] and gc.isenabled()
    assert any(n.meta.get("recompute") is not None for n in joint.graph.nodes)

    def injected(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(fx_compile, "rewrite", injected)
    with pytest.raises(RuntimeError, match="injected"):
        fx_compile.RematPass(load_rules(), strict=True)(joint.graph)
    assert gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings(record=True):
            fx_compile.RematPass(load_rules(), strict=False)(joint.graph)
        assert not gc.isenabled()
    finally:
        gc.enable()

"""Exporting torch training steps to ONNX: gradients checked against torch; symbolic dims."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.models import GPTConfig  # noqa: E402
from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.runtime import max_relative_error, run  # noqa: E402
from backends.onnx.torch_export import export_gpt  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.apply import apply, plan  # noqa: E402
from engine.report import plan_json  # noqa: E402

TINY = GPTConfig(vocab=512, d_model=64, layers=2, heads=4, seq=128, batch=4)


@pytest.fixture(scope="module")
def gpt_static(tmp_path_factory):
    path, error = export_gpt(TINY, tmp_path_factory.mktemp("gpt") / "gpt.onnx")
    return path, error


def test_exported_gradients_match_torch(gpt_static):
    _, error = gpt_static
    assert error < 1e-4


def test_shipped_rules_keep_gpt_outputs_within_1e_4(gpt_static):
    path, _ = gpt_static
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    result = apply(import_model(path), load_rules(), tiers=["expensive"])
    keys = {p.key for p in result.plans if p.applied}
    assert "Gelu+Reshape+" in keys and any(k.endswith("Softmax+") for k in keys)
    err, where = max_relative_error(run(export_model(result.graph), feeds), run(path, feeds))
    assert err <= 1e-4, where


def test_dynamic_batch_and_seq_give_formulas(tmp_path):
    path, error = export_gpt(TINY, tmp_path / "dyn.onnx", dynamic=True)
    assert error < 1e-4
    graph = import_model(path)
    assert graph.dim_examples == {"batch": TINY.batch, "seq": TINY.seq}
    data = plan_json(plan(graph, load_rules(), ["expensive"]))
    formulas = {p["plan"]: p["saving_formula"] for p in data["plans"]}
    assert formulas["Gelu+Reshape+"] == f"{4 * 4 * TINY.d_model * TINY.layers}*batch*seq"
    softmax = next(f for k, f in formulas.items() if k.endswith("Softmax+"))
    assert "seq**2" in softmax and "batch" in softmax
    gelu = next(p for p in data["plans"] if p["plan"] == "Gelu+Reshape+")
    assert gelu["bytes_saved"] == 4 * 4 * TINY.d_model * TINY.layers * TINY.batch * TINY.seq
    assert json.loads(json.dumps(data))
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    rewritten = export_model(apply(graph, load_rules(), tiers=["expensive"]).graph)
    assert max_relative_error(run(rewritten, feeds), run(path, feeds))[0] <= 1e-4


class _ScaledByBuffer(torch.nn.Module):
    """A module with a buffer (as Llama's rotary frequencies, BERT's position ids)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, x):
        return (self.linear(x) * self.scale).square().mean()


def test_aot_joint_exports_a_module_with_buffers(tmp_path):
    from backends.onnx.torch_export import export_checked

    torch.manual_seed(0)
    module = _ScaledByBuffer()
    path, error = export_checked(module, (torch.randn(4, 8),), tmp_path / "buf.onnx", ["x"], exporter="aot-joint")
    assert error < 1e-4
    import onnx

    inputs = [i.name for i in onnx.load(str(path)).graph.input]
    assert inputs == ["x", "linear_weight", "linear_bias"]        # the buffer is a constant, not an input


def test_gradient_check_treats_rounding_noise_as_zero():
    from backends.onnx.torch_export import relative_errors

    want = {"loss": np.array(2.0), "grad.w": np.array([1.0, -0.5]), "grad.key_bias": np.array([3e-12, -1e-12])}
    got = {"loss": np.array(2.0), "grad.w": np.array([1.0, -0.5]), "grad.key_bias": np.array([5e-12, 2e-12])}
    assert max(relative_errors(got, want).values()) < 1e-4         # not 1.0, the noise against itself
    got["grad.w"] = np.array([1.001, -0.5])
    assert relative_errors(got, want)["grad.w"] == pytest.approx(1e-3)

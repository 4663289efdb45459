"""Memory timelines: the rewritten model says which plan made each node, and `remat measure
--timeline` draws the simulated and the measured curve of both models."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from backends.onnx.exporter import export_model
from backends.onnx.importer import import_model
from backends.onnx.rewrite import apply_rules
from backends.onnx.timeline import replaced_by_plan
from dsl.loader import load_rules
from engine.timeline import MemoryCurve
from training_graphs import Layer, build_mlp

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small MLP step and its rewrite (a GELU recomputed), with its inputs."""
    folder = tmp_path_factory.mktemp("timeline")
    model, feeds = build_mlp(64, [Layer(256, "Gelu"), Layer(64, "Gelu")], dims=(512,), examples={})
    original = folder / "mlp.onnx"
    onnx.save(model, str(original))
    np.savez(original.with_suffix(".inputs.npz"), **feeds)
    done = apply_rules(import_model(model), load_rules())
    rewritten = folder / "mlp.remat.onnx"
    onnx.save(export_model(done.graph), str(rewritten))
    return original, rewritten


def test_the_rewritten_model_says_which_plan_made_each_node(models):
    original, rewritten = models
    graph = import_model(rewritten)
    clones = [n for n in graph.nodes if n.recompute_of]
    assert clones and {n.plan for n in clones} == {"Gelu+"}
    replaced = replaced_by_plan(rewritten)
    assert replaced and set(replaced.values()) == {"Gelu+"}
    assert set(replaced) <= {n.name for n in import_model(original).nodes}


def test_a_curve_takes_the_plans_of_the_nodes_it_ran():
    curve = MemoryCurve("simulated", ["a", "b", "c"], [1, 5, 2], [None, None, "Gelu+"])
    shaded = curve.coloured({"a": "Cast+"})
    assert shaded.plans == ["Cast+", None, "Gelu+"] and (shaded.peak, shaded.peak_index) == (5, 1)


def test_measure_draws_a_timeline_of_both_models(models, tmp_path):
    pytest.importorskip("matplotlib")
    original, rewritten = models
    out = tmp_path / "timeline.svg"
    r = subprocess.run([sys.executable, "-m", "backends.cli", "measure", str(original), "--compare", str(rewritten),
                        "--repeats", "1", "--timeline", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == f"wrote {out}"
    # one line per model: the simulated and the measured peak, and VmHWM
    for name, line in zip((original, rewritten), lines[-3:-1]):
        assert line.startswith(f"{name}: simulated ") and ", measured " in line and ", VmHWM " in line
    svg = out.read_text()
    assert "Gelu+" in svg and "measured peak (VmHWM)" in svg and "simulated" in svg


def test_a_timeline_that_cannot_be_drawn_says_why_before_measuring(models, tmp_path):
    original, _ = models
    r = subprocess.run([sys.executable, "-m", "backends.cli", "measure", str(original), "--timeline",
                        str(tmp_path / "timeline.gif")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip() == f"remat: error: --timeline {tmp_path / 'timeline.gif'}: write a .png, .svg or .pdf"


def test_the_torch_path_draws_its_timeline(tmp_path):
    """backends.fx.analyze(..., timeline=...): the peak model's curve before and after remat's
    rewrite, the rewritten step's recomputed nodes shaded with their plan."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import backends.fx
    from backends.fx.timeline import fx_timeline
    from backends.models import MLP
    from backends.plots import timeline_plot
    from engine.errors import RematError

    torch.manual_seed(0)
    model = MLP([64, 256, 256, 64])
    inputs = (torch.randn(8, 128, 64), torch.randn(8, 128, 64))
    before, after = fx_timeline(model, inputs, load_rules())
    assert before.title == "torch.compile(model)" and after.title.endswith("backend=remat)")
    plans = {p for p in after.curves[0].plans if p}
    assert "Gelu+Reshape+" in plans and plans <= {p for p in before.curves[0].plans if p}
    assert after.curves[0].peak < before.curves[0].peak
    out = tmp_path / "torch.png"
    timeline_plot([before, after], out, "torch")
    assert out.stat().st_size > 10_000
    with pytest.raises(RematError, match=r"timeline='torch.gif': write a .png, .svg or .pdf"):
        backends.fx.analyze(model, inputs, show=False, timeline="torch.gif")

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
from engine.timeline import MemoryCurve, Panel
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

"""The `remat` command line, run as a user runs it (a subprocess)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from training_graphs import Layer, build_mlp

ROOT = Path(__file__).resolve().parent.parent


def remat(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backends.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlp")
    model, feeds = build_mlp(64, [Layer(256, "Gelu"), Layer(256, "Sigmoid"), Layer(256, "Relu", True),
                                  Layer(64, "Gelu")], examples={"batch": 8, "seq": 128})
    path = folder / "mlp.onnx"
    onnx.save(model, str(path))
    np.savez(path.with_suffix(".inputs.npz"), **feeds)
    return path


def test_check_shipped_rules_passes():
    r = remat("check", "rules/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: ") and "recompute_activation" in r.stdout


def test_check_broken_rule_file_reports_position_caret_no_traceback(tmp_path):
    bad = tmp_path / "bad.rule"
    bad.write_text("use std.ops\nrule r {\n  match {\n    y = Activaton(x)\n  }\n  rewrite { recompute y }\n}\n")
    r = remat("check", bad)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert lines[0].endswith("bad.rule:4:9: error: unknown op 'Activaton'")
    assert lines[2].strip() == "^" and lines[2].index("^") == lines[1].index("Activaton")
    assert "did you mean 'Activation'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_analyze_shows_formulas_and_bytes_json(mlp):
    r = remat("analyze", mlp, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["dims"] == {"batch": 8, "seq": 128}
    rows = {p["config"]: p for p in data["plans"]}
    gelu = rows["Gelu+:1:-1"]
    assert gelu["saving_formula"] == "1024*batch*seq" and gelu["bytes_saved"] == 1024 * 8 * 128
    cast = rows["Cast+:2:-1"]
    assert cast["fraction_saved"] == 0.5 and cast["status"] == "off"


def test_analyze_table_with_other_example_dims(mlp):
    r = remat("analyze", mlp, "--dim", "batch=2", "--dim", "seq=1024", "--tier", "expensive")
    assert r.returncode == 0, r.stderr
    assert "1024*batch*seq" in r.stdout and "2.00 MiB" in r.stdout and "Tiers: default, expensive" in r.stdout


def test_apply_writes_a_model_that_runs_the_same(mlp, tmp_path):
    out = tmp_path / "out.onnx"
    r = remat("apply", mlp, "-o", out, "--config", "Gelu+:1:-1,Cast+:2:-1")
    assert r.returncode == 0, r.stderr
    assert "on (all, applied 1)" in r.stdout and out.exists()
    m = remat("measure", mlp, "--compare", out, "--repeats", "1")
    assert m.returncode == 0, m.stderr
    assert "peak ratio" in m.stdout and "largest relative output difference 0.00e+00" in m.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "Nope+:1:-1"], "names no plan; the plans are:"),
    (["--rules", "nowhere.rule"], "no such rule file"),
    (["--tier", "turbo"], "unknown tier(s) turbo"),
    (["--dim", "batch"], "expected NAME=INTEGER"),
    (["--forward-output", "zzz"], "forward output(s) zzz not found"),
])
def test_apply_bad_input_is_a_clear_error(mlp, tmp_path, args, message):
    r = remat("apply", mlp, "-o", tmp_path / "x.onnx", *args)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_malformed_model_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_text("garbage")
    r = remat("analyze", bad)
    assert r.returncode == 1 and "not a readable ONNX model" in r.stderr and "Traceback" not in r.stderr


def test_explain_says_why_a_rule_does_not_fire(mlp):
    r = remat("explain", mlp, "--rule", "recompute_softmax")
    assert "tier 'expensive'" in r.stdout and "--tier expensive" in r.stdout
    r = remat("explain", mlp, "--rule", "recompute_activation", "--dim", "batch=1", "--dim", "seq=1")
    assert r.returncode == 0, r.stderr
    assert "does not match" in r.stdout and "rules/activations.rule:12:5" in r.stdout
    assert "bytes(y) >= 256 KiB` is false" in r.stdout
    r = remat("explain", mlp, "--rule", "recompute_activation")
    assert "fires at" in r.stdout and "Gelu+:1:-1" in r.stdout
    assert "matches at" in r.stdout and "but does not fire" in r.stdout and "not declared recomputable" in r.stdout


def test_measure_with_relative_paths_from_another_directory(mlp, tmp_path):
    import shutil

    shutil.copy(mlp, tmp_path / "m.onnx")
    shutil.copy(mlp.with_suffix(".inputs.npz"), tmp_path / "m.inputs.npz")
    r = remat("measure", "m.onnx", "--repeats", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("m.onnx: peak ") and "MiB above rest" in r.stdout
    r = remat("measure", "missing.onnx", cwd=tmp_path)
    assert r.returncode == 1 and "missing.onnx: no such file" in r.stderr and "Traceback" not in r.stderr

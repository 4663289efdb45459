"""Bad input to the `remat` command line: one clear line, `remat: error: ...`, exit status 1.

Never a traceback, never `remat: internal error` (exit status 3, a bug), never a silently
wrong or silently accepted result. Most cases run `backends.cli.main` in-process (fast); a
few run the command as a user does, in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backends.cli import main
from backends.onnx.importer import DIM_EXAMPLES_KEY, FORWARD_OUTPUTS_KEY, import_model
from engine.errors import ConfigError, GraphError
from engine.plans import parse_config
from engine.shapes import evaluate, symbol
from training_graphs import Layer, build_mlp

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"batch": 64, "seq": 32}


def remat(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clear_error(code: int, err: str, *needles: str) -> None:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("remat: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, err


def save(model: onnx.ModelProto, path: Path, feeds: dict | None = None) -> Path:
    onnx.save(model, str(path))
    if feeds is not None:
        np.savez(path.with_suffix(".inputs.npz"), **feeds)
    return path


def mlp_model(**kw) -> tuple[onnx.ModelProto, dict]:
    return build_mlp(8, [Layer(32, "Gelu"), Layer(8, "Relu")], examples=dict(EXAMPLES), **kw)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    model, feeds = mlp_model()
    small = {k: v[:2, :3] if k in ("x", "target") else v for k, v in feeds.items()}
    return save(model, tmp_path_factory.mktemp("mlp") / "mlp.onnx", small)


def _set_meta(model: onnx.ModelProto, key: str, value: str) -> onnx.ModelProto:
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
    return model


# 1. measure: options, inputs files, sizes that do not fit ------------------------------------

@pytest.mark.parametrize("option, value", [("--repeats", "0"), ("--repeats", "-2"), ("--threads", "0")])
def test_measure_counts_must_be_positive(capsys, mlp, option, value):
    code, _, err = remat(capsys, "measure", mlp, option, value)
    assert_clear_error(code, err, f"{option} must be at least 1, not {value}")


def _inputs(tmp_path: Path, name: str, edit) -> Path:
    _, feeds = mlp_model()
    feeds = {k: v[:2, :3] if k in ("x", "target") else v for k, v in feeds.items()}
    edit(feeds)
    path = tmp_path / name
    np.savez(path, **feeds)
    return path


def test_measure_inputs_file_missing_an_input(capsys, mlp, tmp_path):
    path = _inputs(tmp_path, "missing.npz", lambda f: f.pop("x"))
    code, _, err = remat(capsys, "measure", mlp, "--inputs", path)
    assert_clear_error(code, err, "missing.npz has no array for input(s) x of", "mlp.onnx")


def test_measure_inputs_file_of_the_wrong_dtype(capsys, mlp, tmp_path):
    path = _inputs(tmp_path, "dtype.npz", lambda f: f.update(w0=f["w0"].astype(np.float64)))
    code, _, err = remat(capsys, "measure", mlp, "--inputs", path)
    assert_clear_error(code, err, "input 'w0' is float64", "takes float32")


@pytest.mark.parametrize("edit, needle", [
    (lambda f: f.update(w0=f["w0"][:4]), "input 'w0' has shape (4, 32), but"),
    (lambda f: f.update(x=f["x"][0]), "input 'x' has shape (3, 8)"),
    (lambda f: f.update(target=f["target"][:, :2]), "seq is 2 there but 3 in input 'x'"),
])
def test_measure_inputs_file_of_the_wrong_shape(capsys, mlp, tmp_path, edit, needle):
    path = _inputs(tmp_path, "shape.npz", edit)
    code, _, err = remat(capsys, "measure", mlp, "--inputs", path)
    assert_clear_error(code, err, needle)


def test_measure_inputs_disagreeing_with_dim(capsys, mlp, tmp_path):
    path = _inputs(tmp_path, "ok.npz", lambda f: None)
    code, _, err = remat(capsys, "measure", mlp, "--inputs", path, "--dim", "batch=5")
    assert_clear_error(code, err, "batch is 2 there, but --dim batch=5")


@pytest.mark.parametrize("content, needle", [
    (b"just some text\n", "not a readable .npz file of inputs"),
    (b"", "not a readable .npz file of inputs"),
    (None, "not a readable .npz file of inputs"),          # a truncated npz
])
def test_measure_inputs_file_that_is_not_an_npz(capsys, mlp, tmp_path, content, needle):
    path = tmp_path / "bad.npz"
    path.write_bytes(content if content is not None else mlp.with_suffix(".inputs.npz").read_bytes()[:300])
    code, _, err = remat(capsys, "measure", mlp, "--inputs", path)
    assert_clear_error(code, err, "bad.npz", needle)


def test_measure_inputs_file_that_does_not_exist(capsys, mlp, tmp_path):
    code, _, err = remat(capsys, "measure", mlp, "--inputs", tmp_path / "nowhere.npz")
    assert_clear_error(code, err, "nowhere.npz: no such input file")


def test_measure_refuses_inputs_that_do_not_fit_in_memory(capsys, tmp_path):
    model, _ = mlp_model()
    path = save(model, tmp_path / "m.onnx")            # no inputs file: they are generated
    code, _, err = remat(capsys, "measure", path, "--dim", "batch=1000000000000")
    assert_clear_error(code, err, "input 'x' of shape (1000000000000, 32, 8)", "TiB",
                       "more than the", "memory available")


def test_measure_errors_in_a_real_process_are_one_line(mlp):
    r = subprocess.run([sys.executable, "-m", "backends.cli", "measure", str(mlp), "--repeats", "0"],
                       capture_output=True, text=True, cwd=ROOT)
    assert_clear_error(r.returncode, r.stderr, "--repeats must be at least 1")


# 2. -o: missing folder, a directory, unwritable ---------------------------------------------

@pytest.mark.parametrize("command", ["apply", "export-gpt"])
def test_output_into_a_missing_folder(capsys, mlp, tmp_path, command):
    out = tmp_path / "nowhere" / "out.onnx"
    args = ["apply", mlp, "-o", out] if command == "apply" else ["export-gpt", "-o", out]
    code, _, err = remat(capsys, *args)
    assert_clear_error(code, err, f"-o {out}: folder {out.parent} does not exist")


@pytest.mark.parametrize("command", ["apply", "export-gpt"])
def test_output_onto_a_directory(capsys, mlp, tmp_path, command):
    args = ["apply", mlp, "-o", tmp_path] if command == "apply" else ["export-gpt", "-o", tmp_path]
    code, _, err = remat(capsys, *args)
    assert_clear_error(code, err, f"-o {tmp_path}: is a directory")


def test_output_that_cannot_be_written(capsys, mlp, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    code, _, err = remat(capsys, "apply", mlp, "-o", blocker / "out.onnx")
    assert_clear_error(code, err, "is not a folder")
    code, _, err = remat(capsys, "apply", mlp, "-o", "/proc/remat-cannot-write-here.onnx")
    assert_clear_error(code, err, "cannot write it")


# 3. configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    (bytes(range(256)) * 2, "is not UTF-8 text"),
    (b"", "is empty"),
    (b"  \n", "is empty"),
    (b"[]", "names no plan"),
    (b'{"Gelu+": 1}', "expected KEY:TYPE:COUNT"),
])
def test_bad_config_files(capsys, mlp, tmp_path, content, needle):
    config = tmp_path / "plans.json"
    config.write_bytes(content)
    code, _, err = remat(capsys, "apply", mlp, "-o", tmp_path / "out.onnx", "--config", config)
    assert_clear_error(code, err, needle)
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("config, needle", [
    ("[]", "--config names no plan"),
    ("", "--config is empty"),
    (",", "--config names no plan"),
    ("Gelu+:1:-1,Gelu+:1:2", "plan Gelu+:1 is already configured by entry 1 'Gelu+:1:-1'"),
    ('["Gelu+:1:-1", "Gelu+:1:-1"]', "is already configured"),
])
def test_bad_inline_configs(capsys, mlp, tmp_path, config, needle):
    code, _, err = remat(capsys, "apply", mlp, "-o", tmp_path / "out.onnx", "--config", config)
    assert_clear_error(code, err, needle)


def test_parse_config_rejects_what_used_to_pass():
    for text in ("", "[]", "A:1:1,A:1:2"):
        with pytest.raises(ConfigError):
            parse_config(text)
    assert [e.type for e in parse_config("A:1:1,A:2:1")] == [1, 2]     # one key, two plans


# 4. --dim ------------------------------------------------------------------------------------

def test_dim_the_model_does_not_have(capsys, mlp):
    code, _, err = remat(capsys, "analyze", mlp, "--dim", "zzz=3")
    assert_clear_error(code, err, "the model has no dim 'zzz'", "its inputs' dims are batch, seq")


def test_dim_on_a_static_model(capsys, tmp_path):
    model, _ = build_mlp(8, [Layer(8, "Gelu")], dims=(4,), examples={})
    code, _, err = remat(capsys, "analyze", save(model, tmp_path / "s.onnx"), "--dim", "batch=3")
    assert_clear_error(code, err, "no dim 'batch'", "all static")


@pytest.mark.parametrize("item, needle", [
    ("batch=0", "dims are positive, not 0"), ("batch=-4", "dims are positive, not -4"),
    ("batch", "expected NAME=INTEGER"), ("=4", "expected NAME=INTEGER"), ("batch=x", "expected NAME=INTEGER"),
])
def test_dim_values(capsys, mlp, item, needle):
    code, _, err = remat(capsys, "analyze", mlp, "--dim", item)
    assert_clear_error(code, err, needle)


def test_dim_given_twice_differently(capsys, mlp):
    code, _, err = remat(capsys, "analyze", mlp, "--dim", "batch=2", "--dim", "batch=3")
    assert_clear_error(code, err, "--dim batch is given twice, as 2 and 3")


# 5. remat.dim_examples and remat.forward_outputs metadata --------------------------------------

@pytest.mark.parametrize("key, value, needle", [
    (DIM_EXAMPLES_KEY, "{batch: 8", "is not valid JSON"),
    (DIM_EXAMPLES_KEY, "[8, 16]", "is not a JSON object of dim name to example size"),
    (DIM_EXAMPLES_KEY, '"batch=8"', "is not a JSON object"),
    (DIM_EXAMPLES_KEY, '{"batch": "8", "seq": 4}', "dim 'batch' has example size '8'"),
    (DIM_EXAMPLES_KEY, '{"batch": 2.5, "seq": 4}', "dim 'batch' has example size 2.5"),
    (DIM_EXAMPLES_KEY, '{"batch": -8, "seq": 4}', "dim 'batch' has example size -8"),
    (DIM_EXAMPLES_KEY, '{"batch": 0, "seq": 4}', "dim 'batch' has example size 0"),
    (DIM_EXAMPLES_KEY, '{"batch": true, "seq": 4}', "dim 'batch' has example size True"),
    (FORWARD_OUTPUTS_KEY, "loss", "is not valid JSON"),
    (FORWARD_OUTPUTS_KEY, "[]", "is not a JSON list of output names"),
    (FORWARD_OUTPUTS_KEY, "[3]", "is not a JSON list of output names"),
])
def test_malformed_metadata(capsys, tmp_path, key, value, needle):
    model, _ = mlp_model()
    path = save(_set_meta(model, key, value), tmp_path / "meta.onnx")
    code, _, err = remat(capsys, "analyze", path)
    assert_clear_error(code, err, f"meta.onnx: metadata {key!r}", needle)
    with pytest.raises(GraphError, match=f"model 'mlp_step': metadata '{key}'"):
        import_model(model)


# 6. malformed models: validated on import; the rewritten model validated before it is written --

def _mutated(edit) -> onnx.ModelProto:
    model, _ = mlp_model()
    edit(model.graph)
    return model


def _rename_output(g):
    g.node[1].output[0] = g.node[0].output[0]


def _unknown_op(g):
    g.node[2].op_type = "Frobnicate"


def _extra_input(g):
    g.node[1].input.append("x")


def _negative_dim(g):
    g.input[2].type.tensor_type.shape.dim[0].dim_value = -8


def _zero_input_dim(g):
    g.input[2].type.tensor_type.shape.dim[0].dim_value = 0


def _bad_elem_type(g):
    g.input[2].type.tensor_type.elem_type = 99


def _cycle(g):
    g.node[0].input[0] = g.node[3].output[0]


def _wrong_dtype(g):
    g.input[0].type.tensor_type.elem_type = TensorProto.INT64


def _wrong_shape(g):
    g.input[2].type.tensor_type.shape.dim[0].dim_value = 9


def _no_op(g):
    g.node[2].op_type = ""


def _no_outputs(g):
    del g.output[:]


@pytest.mark.parametrize("edit, needles", [
    (_rename_output, ["node 'n_pre_2' (Add) assigns 'mm_1', which node 'n_mm_1' (MatMul) already assigns"]),
    (_unknown_op, ["node 'n_gelu_3' (Frobnicate): No Op registered for Frobnicate"]),
    (_extra_input, ["node 'n_pre_2' (Add):", "has input size 3 not in range"]),
    (_negative_dim, ["graph input 'w0' has dim 0 = -8; dims are positive"]),
    (_zero_input_dim, ["graph input 'w0' has dim 0 = 0; dims are positive"]),
    (_bad_elem_type, ["graph input 'w0' has element type 99, which is not an ONNX tensor type"]),
    (_cycle, ["node 'n_mm_1' (MatMul) reads", "which no input, initializer or earlier node defines"]),
    (_wrong_dtype, ["node 'n_mm_1' (MatMul):", "(ONNX shape inference)"]),
    (_wrong_shape, ["node 'n_mm_1' (MatMul): Incompatible dimensions"]),
    (_no_op, ["has no op_type"]),
    (_no_outputs, ["the graph has no outputs"]),
])
def test_malformed_models_are_refused_naming_the_node(capsys, tmp_path, edit, needles):
    path = save(_mutated(edit), tmp_path / "bad.onnx")
    out = tmp_path / "out.onnx"
    for args in (["analyze", path], ["apply", path, "-o", out]):
        code, _, err = remat(capsys, *args)
        assert_clear_error(code, err, f"{path}: ", *needles)
    assert not out.exists()


def test_an_invalid_rewritten_model_is_a_remat_bug_and_is_not_written(capsys, mlp, tmp_path, monkeypatch):
    from backends.onnx import exporter

    real = exporter.export_model

    def broken(graph, *args, **kw):
        model = real(graph, *args, **kw)
        model.graph.node[-1].op_type = "NotAnOp"       # an exporter bug, simulated
        return model

    monkeypatch.setattr(exporter, "export_model", broken)
    out = tmp_path / "out.onnx"
    code, _, err = remat(capsys, "apply", mlp, "-o", out)
    assert code == 3, err
    assert len(err.strip().splitlines()) == 1 and "remat bug: the rewritten model is not valid ONNX" in err
    assert "(NotAnOp)" in err and "nothing was written" in err
    assert not out.exists()


def test_a_strict_internal_failure_is_exit_status_3_not_a_user_error(capsys, tmp_path, monkeypatch):
    from engine.failures import inject_failure

    model, _ = mlp_model()
    path = save(model, tmp_path / "m.onnx")
    monkeypatch.setenv("REMAT_STRICT", "1")
    with inject_failure("recompute_activation", "rewrite"):
        code, _, err = remat(capsys, "apply", path, "-o", tmp_path / "out.onnx")
    assert code == 3, err
    assert err.startswith("remat: internal error (rule recompute_activation at node ") and len(err.splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()


# 7. the plan table: symbolic dims with no example size, never negative sizes -------------------

def test_symbolic_dims_without_examples_are_named_not_called_static(capsys, tmp_path):
    model, _ = mlp_model()
    del model.metadata_props[:]
    code, out, err = remat(capsys, "analyze", save(model, tmp_path / "nometa.onnx"))
    assert code == 0, err
    assert "all static" not in out
    assert "Dims: batch, seq symbolic with no example size" in out and "--dim batch=N" in out
    code, out, err = remat(capsys, "analyze", tmp_path / "nometa.onnx", "--dim", "batch=4")
    assert "Dims: batch=4; seq symbolic with no example size" in out
    code, out, err = remat(capsys, "analyze", tmp_path / "nometa.onnx", "--json")
    assert json.loads(out)["dims_without_example"] == ["batch", "seq"]


def test_static_models_say_all_static(capsys, tmp_path):
    model, _ = build_mlp(8, [Layer(8, "Gelu")], dims=(4,), examples={})
    code, out, err = remat(capsys, "analyze", save(model, tmp_path / "s.onnx"))
    assert code == 0 and "Dims: all static" in out, err


def test_a_dim_formula_that_is_negative_at_the_example_sizes(capsys, tmp_path):
    model, _ = build_mlp(8, [Layer(8, "Gelu")], dims=("batch", "seq - 2"),
                         examples={"batch": 2, "seq": 1, "seq - 2": 1})
    path = save(model, tmp_path / "expr.onnx")
    code, _, err = remat(capsys, "analyze", path)
    assert_clear_error(code, err, "value 'x' has dim 1 = seq-2, which is -1 at the example sizes seq=1")
    code, out, err = remat(capsys, "analyze", path, "--dim", "seq=5")
    assert code == 0 and "Stashed activations: 2 values, 384 B" in out, err


def test_non_positive_example_sizes_never_become_bytes():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(GraphError, match="dim 'batch' has example size"):
            evaluate(symbol("batch") * 4, {"batch": bad})
    assert evaluate(symbol("batch") * 4, {"batch": np.int64(3)}) == 12


# 8. measure --compare: outputs that cannot be compared ---------------------------------------

def _renamed_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    other = onnx.ModelProto()
    other.CopyFrom(model)
    g = other.graph
    for out in g.output:
        g.node.append(helper.make_node("Identity", [out.name], [f"other_{out.name}"]))
        out.name = f"other_{out.name}"
    _set_meta(other, FORWARD_OUTPUTS_KEY, json.dumps([g.output[0].name]))
    return other


def _reshaped_loss(model: onnx.ModelProto) -> onnx.ModelProto:
    other = onnx.ModelProto()
    other.CopyFrom(model)
    g = other.graph
    loss = g.output[0]
    for node in g.node:
        node.output[:] = [f"{o}_raw" if o == loss.name else o for o in node.output]
        node.input[:] = [f"{i}_raw" if i == loss.name else i for i in node.input]
    g.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "zero_axis"))
    g.node.append(helper.make_node("Unsqueeze", [f"{loss.name}_raw", "zero_axis"], [loss.name]))
    loss.type.tensor_type.shape.dim.add().dim_value = 1
    _set_meta(other, FORWARD_OUTPUTS_KEY, json.dumps([f"{loss.name}_raw"]))
    return other


def test_compare_models_with_no_output_in_common(capsys, mlp, tmp_path):
    other = save(_renamed_outputs(onnx.load(str(mlp))), tmp_path / "other.onnx")
    code, _, err = remat(capsys, "measure", mlp, "--compare", other, "--repeats", "1")
    assert_clear_error(code, err, f"{other} and {mlp} have no output in common",
                       "other_loss", f"{mlp}: loss")


def test_compare_models_whose_outputs_differ_in_shape(capsys, mlp, tmp_path):
    other = save(_reshaped_loss(onnx.load(str(mlp))), tmp_path / "other.onnx")
    code, _, err = remat(capsys, "measure", mlp, "--compare", other, "--repeats", "1")
    assert_clear_error(code, err, "has shape (1,) in", "but () in", "cannot be compared")


def test_compare_with_a_model_whose_inputs_the_data_lacks(capsys, mlp, tmp_path):
    other = onnx.load(str(mlp))
    other.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [2]))
    other = save(other, tmp_path / "other.onnx")
    code, _, err = remat(capsys, "measure", mlp, "--compare", other, "--repeats", "1")
    data = mlp.with_suffix(".inputs.npz")
    assert_clear_error(code, err, f"{data} has no array for input(s) extra of {other}")


def test_compare_nan_against_a_number_is_an_infinite_difference():
    from backends.onnx.runtime import max_relative_error

    err, where = max_relative_error({"a": np.array([1.0, np.nan])}, {"a": np.array([1.0, 2.0])})
    assert err == float("inf") and where == "a"
    assert max_relative_error({"a": np.array([np.nan])}, {"a": np.array([np.nan])})[0] == 0.0


# 9. the other paths ----------------------------------------------------------------------------

@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_text("garbage"), "not a readable ONNX model"),
    (lambda p: p.write_bytes(b""), "is empty, not an ONNX model"),
    (lambda p: p.mkdir(), "is a directory, not an ONNX model file"),
    (lambda p: None, "no such file"),
])
@pytest.mark.parametrize("command", ["analyze", "apply", "explain", "measure"])
def test_model_that_is_not_an_onnx_file(capsys, tmp_path, make, needle, command):
    path = tmp_path / "model.onnx"
    make(path)
    extra = {"apply": ["-o", tmp_path / "out.onnx"], "explain": ["--rule", "recompute_activation"],
             "measure": ["--repeats", "1"]}.get(command, [])
    code, _, err = remat(capsys, command, path, *extra)
    assert_clear_error(code, err, str(path), needle)


@pytest.mark.parametrize("args, needle", [
    (["analyze", "{mlp}", "--forward-output", "zzz"], "forward output(s) zzz not found"),
    (["analyze", "{mlp}", "--tier", "turbo"], "unknown tier(s) turbo"),
    (["explain", "{mlp}", "--rule", "no_such_rule"], "no rule named 'no_such_rule'"),
    (["explain", "{mlp}", "--rule", "recompute_activation", "--node", "zzz"], "no node or value named 'zzz'"),
    (["measure", "{mlp}", "--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    (["analyze"], "the following arguments are required: model"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_other_bad_arguments(capsys, mlp, args, needle):
    code, _, err = remat(capsys, *[a.format(mlp=mlp) for a in args])
    assert_clear_error(code, err, needle)


@pytest.mark.parametrize("args, needle", [
    (["--vocab", "0"], "--vocab must be at least 1, not 0"),
    (["--layers", "-1"], "--layers must be at least 1, not -1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--heads", "3"], "--d-model 256 is not a multiple of --heads 3"),
    (["--vocab", "1000000000"], "more than the"),
])
def test_export_gpt_sizes(capsys, tmp_path, args, needle):
    out = tmp_path / "gpt.onnx"
    code, _, err = remat(capsys, "export-gpt", "-o", out, *args)
    assert_clear_error(code, err, needle)
    assert not out.exists()


def test_demo_workdir_that_cannot_be_made(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, _, err = remat(capsys, "demo", "--workdir", blocker / "demo")
    assert_clear_error(code, err, "--workdir", "cannot create it")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_model_file_that_cannot_be_read(capsys, mlp, tmp_path):
    path = tmp_path / "locked.onnx"
    path.write_bytes(mlp.read_bytes())
    path.chmod(0)
    code, _, err = remat(capsys, "analyze", path)
    assert_clear_error(code, err, f"{path}: cannot read it (permission denied)")


def test_analyze_formats_and_version(tmp_path, capsys):
    model, feeds = mlp_model()
    path = save(model, tmp_path / "m.onnx", feeds)
    code, out, _ = remat(capsys, "analyze", str(path), "--format", "markdown")
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("| Plan |"))
    rows = [line for line in out.splitlines() if line.startswith("| ") and line != header]
    assert rows and all(r.count("|") == header.count("|") for r in rows)
    code, out, _ = remat(capsys, "analyze", str(path), "--format", "json")
    assert code == 0 and json.loads(out)["plans"]
    code, out, _ = remat(capsys, "analyze", str(path), "--json")
    assert code == 0 and "plans" in json.loads(out)
    code, out, _ = remat(capsys, "--version")
    assert code == 0 and out.startswith("remat ")

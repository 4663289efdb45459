"""Malformed models through the CLI: a clear error or a valid result, never a crash.

A small valid training graph (tests/training_graphs.py) gets random mutations: names made to
collide, nodes dropped or reordered into a cycle, op types and element types changed, inputs
removed or added, dims set to 0, negative or huge, metadata corrupted, initializers deleted,
the serialized bytes truncated. `remat analyze`, `remat apply -o` and (for a few)
`remat measure` run in-process on the result. The property: exit status 0 with a valid
result (the model `apply` wrote passes `onnx.checker` with strict shape inference, and
imports again), or exit status 1 with one line on stderr, `remat: error: ...`. Never exit
status 3 (an internal error), never an exception out of `main`. Internal failures are raised
(REMAT_STRICT=1), so a fallback cannot hide one.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from backends.cli import main
from backends.onnx.importer import DIM_EXAMPLES_KEY, FORWARD_OUTPUTS_KEY, import_model
from training_graphs import Layer, build_mlp

# Example sizes large enough that the shipped rules fire (a recompute needs 256 KiB), so the
# rewrite and the writer run; the data `measure` makes at these sizes is still small.
BASE, FEEDS = build_mlp(8, [Layer(32, "Gelu"), Layer(16, "Relu", True), Layer(8, "Softmax")],
                        examples={"batch": 64, "seq": 64})
BASE_BYTES = BASE.SerializeToString()

OPS = ["Frobnicate", "", "Relu", "Gelu", "Sigmoid", "Tanh", "Exp", "Neg", "Identity", "Add", "Mul",
       "Sub", "MatMul", "Softmax", "Cast", "Loop", "Transpose", "Reshape"]
DIMS = [0, -1, -7, 1, 3, 10**12, 2**62]
ELEM_TYPES = [TensorProto.INT64, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL,
              TensorProto.STRING, TensorProto.UNDEFINED, 99]
METADATA = {
    DIM_EXAMPLES_KEY: ["{", "[]", "5", '{"batch": -1}', '{"batch": 0}', '{"batch": "8"}',
                       '{"batch": 2.5}', '{"batch": true}', '{"zzz": 4}', '{"": 4}',
                       '{"batch": 10000000000000}', "\u00ff\u0000"],
    FORWARD_OUTPUTS_KEY: ["", "[]", '["nope"]', "[1]", '"loss"', "{}", '["loss", "loss"]'],
}


def _values(model: onnx.ModelProto) -> list[str]:
    g = model.graph
    return [i.name for i in g.input] + [i.name for i in g.initializer] + [o for n in g.node for o in n.output]


def _tensor_types(model: onnx.ModelProto) -> list[onnx.TypeProto.Tensor]:
    g = model.graph
    return [vi.type.tensor_type for vi in list(g.input) + list(g.output) + list(g.value_info)]


@st.composite
def mutation(draw, model: onnx.ModelProto) -> str:
    """Apply one random mutation to `model` in place; returns what it did (for the report)."""
    g = model.graph
    nodes = len(g.node)
    kind = draw(st.sampled_from(["collide", "drop", "op", "remove_input", "add_input", "dim",
                                 "dim_param", "metadata", "dtype", "initializer", "cycle",
                                 "swap", "attribute", "output"]))
    i = draw(st.integers(0, nodes - 1))
    node = g.node[i]
    if kind == "collide":
        name = draw(st.sampled_from(_values(model)))
        node.output[0] = name
        return f"node {i} output renamed to {name}"
    if kind == "drop":
        del g.node[i]
        return f"node {i} dropped"
    if kind == "op":
        node.op_type = draw(st.sampled_from(OPS))
        return f"node {i} op -> {node.op_type!r}"
    if kind == "remove_input":
        if node.input:
            node.input.pop(draw(st.integers(0, len(node.input) - 1)))
        return f"node {i} lost an input"
    if kind == "add_input":
        node.input.append(draw(st.sampled_from(_values(model) + ["", "ghost"])))
        return f"node {i} got input {node.input[-1]!r}"
    if kind in ("dim", "dim_param"):
        types = [t for t in _tensor_types(model) if t.shape.dim]
        t = draw(st.sampled_from(types))
        dim = t.shape.dim[draw(st.integers(0, len(t.shape.dim) - 1))]
        if kind == "dim":
            dim.dim_value = draw(st.sampled_from(DIMS))
        else:
            dim.dim_param = draw(st.sampled_from(["batch", "seq", "other", "batch*seq", "2*batch",
                                                  "seq - 1", "a b", ""]))
        return f"a dim -> {dim}"
    if kind == "metadata":
        key = draw(st.sampled_from(sorted(METADATA)))
        value = draw(st.sampled_from(METADATA[key]))
        for prop in model.metadata_props:
            if prop.key == key:
                prop.value = value
        return f"metadata {key} = {value!r}"
    if kind == "dtype":
        types = _tensor_types(model)
        t = draw(st.sampled_from(types))
        t.elem_type = draw(st.sampled_from(ELEM_TYPES))
        return f"an element type -> {t.elem_type}"
    if kind == "initializer":
        if g.initializer:
            del g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        return "an initializer deleted"
    if kind == "cycle":
        j = draw(st.integers(i, nodes - 1))
        if node.input:
            node.input[0] = g.node[j].output[0]
        return f"node {i} reads node {j}'s output"
    if kind == "swap":
        j = draw(st.integers(0, nodes - 1))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(g.node[i])
        b.CopyFrom(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
        return f"nodes {i} and {j} swapped"
    if kind == "attribute":
        node.attribute.append(onnx.helper.make_attribute(
            draw(st.sampled_from(["axis", "to", "perm", "keepdims", "bogus"])),
            draw(st.sampled_from([-5, 0, 1, 7, 99, [1, 0], [0]]))))
        return f"node {i} got attribute {node.attribute[-1].name}"
    del g.output[draw(st.integers(0, len(g.output) - 1))]
    return "an output removed"


@st.composite
def mutated_model(draw) -> tuple[bytes, list[str]]:
    model = onnx.ModelProto()
    model.ParseFromString(BASE_BYTES)
    done = [draw(mutation(model)) for _ in range(draw(st.integers(1, 2)))]
    data = model.SerializeToString()
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(1, len(data) - 1))
        data = data[:cut]
        done.append(f"truncated to {cut} bytes")
    return data, done


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch.dict(os.environ, {"REMAT_STRICT": "1"}):
        try:
            code = main(list(args))
        except SystemExit as done:   # main returns its status; a SystemExit is still allowed
            code = done.code
    return code, out.getvalue(), err.getvalue()


def check_outcome(command: str, code: int, err: str, what: list[str]) -> None:
    context = f"remat {command} after {what}: exit {code}, stderr {err!r}"
    assert code in (0, 1), context
    assert "Traceback" not in err and "internal error" not in err, context
    if code == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("remat: error: ") and len(lines[0]) > 20, context


def check_written(path: Path, what: list[str]) -> None:
    written = onnx.load(str(path))
    onnx.checker.check_model(written, full_check=True)
    import_model(written)   # and it imports again


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_model())
def test_mutated_models_give_a_result_or_a_clear_error(case):
    data, what = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(data)
        code, _, err = run_cli("analyze", str(path))
        check_outcome("analyze", code, err, what)
        out = Path(tmp) / "out.onnx"
        code, _, err = run_cli("apply", str(path), "-o", str(out))
        check_outcome("apply", code, err, what)
        if code == 0:
            check_written(out, what)
        else:
            assert not out.exists(), f"apply failed after {what} but wrote {out}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_model(), st.booleans())
@example((BASE_BYTES, []), True)      # the unmutated model measures, on its inputs and on made ones
@example((BASE_BYTES, []), False)
def test_mutated_models_measure_or_fail_clearly(case, with_inputs):
    data, what = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(data)
        if with_inputs:
            small = {k: v[:2, :3] if k in ("x", "target") else v for k, v in FEEDS.items()}
            np.savez(path.with_suffix(".inputs.npz"), **small)
        code, _, err = run_cli("measure", str(path), "--repeats", "1")
        check_outcome("measure", code, err, what)


def test_the_unmutated_model_passes():
    """The property's baseline: the base model analyzes, rewrites (some plan fires) and writes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(BASE_BYTES)
        out = Path(tmp) / "out.onnx"
        code, stdout, err = run_cli("apply", str(path), "-o", str(out))
        assert code == 0, err
        assert "applied 1" in stdout or "applied 2" in stdout, stdout
        check_written(out, [])
        assert json.loads(onnx.load(str(out)).metadata_props[0].value) is not None

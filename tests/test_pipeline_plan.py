"""The pipeline planner (engine.pipeline, seed 004): the seed's case, the solver against brute
force, the schedules' in-flight counts, infeasible and malformed specs."""
from __future__ import annotations

import copy
import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.cli import main
from engine.errors import ConfigError
from engine.pipeline import (GB, InfeasibleError, describe, in_flight, parse_spec, plan, solve, table,
                             uniform)
from engine.pipeline.schedule import interleaved_order, moments

SEED = {"stages": 4, "microbatches": 4, "schedule": "1f1b", "memory_per_stage": 20,
        "layers": {"count": 32, "forward": 1, "backward": 2, "activation": 1.25,
                   "options": [{"name": "checkpoint", "activation": 0.125, "extra": 1}]}}
ATTENTION = {"name": "attention", "activation": 0.5, "extra": 0.15}


def with_attention() -> dict:
    spec = copy.deepcopy(SEED)
    spec["layers"]["options"].append(ATTENTION)
    return spec


def remat(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_seed_004s_case_through_the_command_line(capsys, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SEED))
    code, out, err = remat(capsys, "pipeline-plan", path, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["slowdown"] <= 1.125 + 1e-9
    assert [len(s["layers"]) for s in result["stages"]] != [8, 8, 8, 8]
    assert sum(len(s["layers"]) for s in result["stages"]) == 32
    for stage in result["stages"]:
        assert stage["memory"] <= 20 + 1e-9
        assert stage["time"] <= 27 + 1e-9
    # The seed's optimum: no partition does better than 27 (1.125x).
    assert result["slowdown"] == pytest.approx(1.125)


def test_a_cheaper_partial_option_goes_strictly_below_the_seeds_optimum(capsys, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(with_attention()))
    code, out, err = remat(capsys, "pipeline-plan", path, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["slowdown"] < 1.125
    assert all(s["memory"] <= 20 + 1e-9 for s in result["stages"])
    assert any(s["option_counts"].get("attention") for s in result["stages"])


def test_the_uniform_ratio_is_the_seeds_baseline():
    """ColossalAI's ratio 5/8 per stage: 121% of the time, 17.5 / 13.1 / 8.8 / 4.4 GB (the seed's table)."""
    baseline = uniform(parse_spec(SEED), 0.625)
    assert baseline.slowdown == pytest.approx(29 / 24)
    assert [round(s.memory / GB, 1) for s in baseline.stages] == [17.5, 13.1, 8.8, 4.4]
    assert [s.option_counts() for s in baseline.stages] == [{"none": 3, "checkpoint": 5}] * 4
    unchecked = uniform(parse_spec(SEED), 0)
    assert [s.memory / GB for s in unchecked.stages] == [40, 30, 20, 10] and not unchecked.fits


def test_the_table_and_the_ratio_flag(capsys, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SEED))
    code, out, err = remat(capsys, "pipeline-plan", path, "--ratio", "0.625")
    assert code == 0, err
    assert "planned: slowest stage 27 per micro-batch, 1.125x" in out
    assert "uniform ratio 0.625: slowest stage 29 per micro-batch, 1.208x" in out
    lines = [line for line in out.splitlines() if line.strip().startswith("0 ")]
    assert len(lines) == 2 and "17.00" in lines[0] and "17.50" in lines[1]


def test_in_flight_counts_come_from_the_schedule():
    spec = parse_spec(SEED)
    assert [m for device in in_flight(spec) for m in device] == [(4,), (3,), (2,), (1,)]
    assert moments("gpipe", 4, 6, 1, 3) == [(6,)]
    assert moments("1f1b", 4, 8, 1, 0) == [(4,)]
    # Interleaving raises the first device's count: 4 stages, 8 micro-batches, 2 virtual stages.
    first = moments("interleaved-1f1b", 4, 8, 2, 0)
    assert max(sum(m) for m in first) == 4 + 2 * 3 + 1
    assert max(sum(m) for m in moments("interleaved-1f1b", 4, 8, 2, 3)) == 4 + 1


@pytest.mark.parametrize("stages, microbatches, virtual", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (3, 6, 3), (4, 6, 2)])
def test_the_interleaved_order_is_torchs(stages, microbatches, virtual):
    """The same forwards and backwards, per virtual stage, in the order torch's
    ScheduleInterleaved1F1B builds (its idle slots dropped)."""
    pytest.importorskip("torch")
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = virtual, stages, microbatches
    schedule.number_of_rounds = max(1, microbatches // stages)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    for rank in range(stages):
        actions = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
        theirs = [("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index // stages) for a in actions]
        assert theirs == interleaved_order(stages, microbatches, virtual, rank)


# Brute force: every contiguous split into the virtual stages, every option per layer.

def _split_sizes(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(k)]


def brute_force(spec) -> tuple[float | None, float]:
    """(the least slowest-device time over the partitions that fit, or None; the least factor on
    the limits that some partition fits)."""
    moments_of = in_flight(spec)
    best, least_scale = None, float("inf")
    n, k, p = len(spec.layers), spec.chunks, spec.stages
    for sizes in _split_sizes(n, k):
        chunk_of = [c for c, size in enumerate(sizes) for _ in range(size)]
        for options in itertools.product(*(range(len(layer.options)) for layer in spec.layers)):
            slowest, scale = 0.0, 0.0
            for d in range(p):
                mine = [l for l in range(n) if chunk_of[l] % p == d]
                time = sum(spec.layers[l].forward + spec.layers[l].backward
                           + spec.layers[l].options[options[l]].extra for l in mine)
                held = {}
                for l in mine:
                    held[chunk_of[l] // p] = held.get(chunk_of[l] // p, 0) + spec.layers[l].options[options[l]].activation
                    if l == n - 1 or chunk_of[l + 1] != chunk_of[l]:      # the stage keeps its output
                        held[chunk_of[l] // p] += spec.layers[l].output
                static = sum(spec.layers[l].weights + spec.layers[l].optimizer for l in mine)
                workspace = max((spec.layers[l].options[options[l]].workspace for l in mine), default=0)
                memory = static + workspace + max(sum(m[j] * held.get(j, 0) for j in range(len(m)))
                                                  for m in moments_of[d])
                slowest = max(slowest, time)
                scale = max(scale, memory / spec.memory[d])
            least_scale = min(least_scale, scale)
            if scale <= 1 + 1e-9 and (best is None or slowest < best):
                best = slowest
    return best, least_scale


def _layer(draw) -> dict:
    halves = st.integers(0, 8).map(lambda v: v / 2)
    layer = {"forward": draw(st.integers(1, 3)), "backward": draw(st.integers(1, 4)),
             "activation": draw(st.integers(1, 8).map(lambda v: v / 2)), "weights": draw(halves),
             "workspace": draw(st.sampled_from([0, 0, 0.5, 1])), "output": draw(st.sampled_from([0, 0, 0.5, 1]))}
    options = []
    for i in range(draw(st.integers(0, 2))):
        options.append({"name": f"o{i}", "activation": draw(halves), "extra": draw(st.integers(0, 3) | halves)})
    layer["options"] = options
    return layer


@st.composite
def small_specs(draw) -> dict:
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b"]))
    stages = draw(st.integers(1, 3))
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    layers = draw(st.integers(stages * virtual, min(6, stages * virtual + 3)))
    microbatches = draw(st.integers(stages, stages + 3))
    if schedule == "interleaved-1f1b":
        microbatches = stages * draw(st.integers(1, 2))
    same = draw(st.booleans())
    figures = [_layer(draw)] * layers if same else [_layer(draw) for _ in range(layers)]
    memory = [draw(st.integers(4, 40)) for _ in range(stages)]
    spec = {"stages": stages, "microbatches": microbatches, "schedule": schedule,
            "memory_per_stage": memory, "layers": figures}
    if schedule == "interleaved-1f1b":
        spec["virtual_stages"] = virtual
    return spec


@given(small_specs())
def test_the_solver_finds_the_brute_force_optimum(data):
    spec = parse_spec(data)
    best, least_scale = brute_force(spec)
    if best is None:
        with pytest.raises(InfeasibleError) as info:
            solve(spec)
        assert info.value.scale == pytest.approx(least_scale, rel=1e-6)
        return
    result = solve(spec)
    assert result.time == pytest.approx(best, rel=1e-6)
    assert result.fits
    assert sorted(l for s in result.stages for l in s.layers) == list(range(len(spec.layers)))


def test_an_infeasible_limit_names_the_smallest_memory_that_works(capsys, tmp_path):
    spec = copy.deepcopy(SEED)
    spec["memory_per_stage"] = 1
    with pytest.raises(InfeasibleError) as info:
        plan(spec)
    smallest = info.value.smallest[0] / GB
    assert f"the smallest memory per stage that works is {smallest:.4g} GB" in str(info.value)
    # Every layer checkpointed, 4 + 5 + 8 + 15 layers (4, 3, 2, 1 in flight at 0.125 GB): 2 GB; it
    # works, a bit less does not.
    assert smallest == pytest.approx(2.0)
    spec["memory_per_stage"] = smallest
    assert plan(spec).fits
    spec["memory_per_stage"] = smallest * 0.99
    with pytest.raises(InfeasibleError):
        plan(spec)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**SEED, "memory_per_stage": [1, 1, 1, 0.5]}))
    code, _, err = remat(capsys, "pipeline-plan", path)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "the limits would have to be" in err and "memory_per_stage" in err


def _edit(path: str, value):
    spec = copy.deepcopy(SEED)
    target = spec
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is KeyError:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return spec


@pytest.mark.parametrize("spec, needle", [
    (_edit("stages", KeyError), "stages: missing"),
    (_edit("stages", 0), "stages: must be at least 1"),
    (_edit("stages", "four"), "stages: expected a whole number"),
    (_edit("microbatches", 2), "microbatches: 1f1b needs at least as many micro-batches as stages (4)"),
    (_edit("schedule", "zigzag"), "schedule: expected one of gpipe, 1f1b, interleaved-1f1b"),
    (_edit("virtual_stages", 2), "virtual_stages: only interleaved-1f1b has virtual stages"),
    (_edit("memory_per_stage", [20, 20]), "memory_per_stage: a list gives one limit per stage: expected 4"),
    (_edit("memory_per_stage", "20 parsecs"), "memory_per_stage: expected GB"),
    (_edit("memory_per_stage", 0), "memory_per_stage: stage 0's limit must be positive"),
    (_edit("memory_per_stage", KeyError), "memory_per_stage: missing"),
    (_edit("layers.count", 3), "layers: 3 layer(s) cannot fill 4 stages"),
    (_edit("layers.forward", -1), "layers.forward: must not be negative"),
    (_edit("layers.activation", KeyError), "layers.activation: missing"),
    (_edit("layers.actvation", 1), "layers.actvation: unknown field"),
    (_edit("layers.options", {"name": "x"}), "layers.options: expected a list of objects"),
    (_edit("layers.options.0.extra", "1"), "layers.options[0].extra: expected a number, got the string '1'"),
    (_edit("layers.options.0.name", "none"), "layers.options[0].name: 'none' is already an option"),
    (_edit("layers", []), "layers: expected an object (with `count`) or a non-empty list"),
    (_edit("layers", KeyError), "give either `layers`"),
    ({**SEED, "model": {"name": "gpt"}}, "not both"),
    ({**SEED, "model": {"name": "gpt"}, "layers": KeyError} if False else
     {k: v for k, v in {**SEED, "model": {"name": "gpt", "d_model": "big"}}.items() if k != "layers"},
     "model.d_model: expected a positive whole number"),
    ([1, 2], "expected a JSON object, got a list"),
    ({**SEED, "schedule": "interleaved-1f1b", "microbatches": 9}, "microbatches: interleaved-1f1b runs"),
])
def test_bad_specs_are_one_clear_line(capsys, tmp_path, spec, needle):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=None) as info:
        parse_spec(spec, str(path))
    assert needle in str(info.value)
    code, out, err = remat(capsys, "pipeline-plan", path)
    assert code == 1 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"remat: error: {path}: "), err
    assert needle in err and "Traceback" not in err


def test_a_json_syntax_error_names_its_line_and_column(capsys, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text('{"stages": 4,\n "microbatches": 4,,\n}')
    code, _, err = remat(capsys, "pipeline-plan", path)
    assert code == 1 and f"{path}:2:20: invalid JSON" in err and len(err.strip().splitlines()) == 1
    code, _, err = remat(capsys, "pipeline-plan", tmp_path / "missing.json")
    assert code == 1 and "cannot read it" in err
    code, _, err = remat(capsys, "pipeline-plan", path, "--ratio", "2")
    assert code == 1 and "ratio '2'" in err


def test_per_layer_figures_memory_units_and_python_use():
    spec = {"stages": 2, "microbatches": 2, "schedule": "gpipe", "memory_per_stage": ["600MiB", "900MiB"],
            "layers": [{"name": "embed", "forward": 1, "backward": 1, "activation": "100MiB", "weights": "50MiB"},
                       {"count": 3, "forward": 2, "backward": 4, "activation": "200MiB",
                        "options": [{"name": "checkpoint", "activation": "20MiB", "extra": 2}]}]}
    result = plan(spec)
    assert result.fits and [s.layers for s in result.stages] in ([[0, 1], [2, 3]], [[0], [1, 2, 3]])
    assert "MiB" in table(result).splitlines()[0]
    assert "every stage within its limit" in describe(result)
    assert result.to_json()["stages"][0]["limit"] == pytest.approx(600 * 2**20 / GB)


def test_the_planner_imports_neither_torch_nor_onnx():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, engine.pipeline; engine.pipeline.plan; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnx', 'onnxruntime'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]"

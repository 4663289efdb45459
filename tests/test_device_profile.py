"""Device profiles: float32 work is costed at the float32 rate, 16-bit work at the tensor cores'."""
from __future__ import annotations

import pytest

from dsl.loader import load_rules
from engine.budget import preset
from engine.budget.cost import work
from engine.dtypes import DType
from engine.ir import Node, Value

RULES = load_rules()


def matmul(dtype: DType) -> Node:
    a = Value("a", dtype, (1024, 1024), is_input=True)
    b = Value("b", dtype, (1024, 1024), is_input=True)
    return Node("MatMul", [a, b], [Value("y", dtype, (1024, 1024))], name="mm")


def test_half_precision_flops_are_counted_apart():
    flops, half, moved = work([matmul(DType.FLOAT32), matmul(DType.BFLOAT16)], RULES, {})
    assert flops == half == 2 * 1024 ** 3
    assert moved > 0


def test_float32_matmul_costs_more_than_bfloat16_on_an_h100():
    h100 = preset("h100")
    f32, _, moved32 = work([matmul(DType.FLOAT32)], RULES, {})
    _, b16, moved16 = work([matmul(DType.BFLOAT16)], RULES, {})
    assert h100.seconds(f32, moved32, 1) > 5 * h100.seconds(0.0, moved16, 1, b16)


def test_tf32_raises_the_float32_rate_only_where_the_profile_knows_it():
    h100 = preset("h100")
    assert h100.with_tf32().flops_per_s > 5 * h100.flops_per_s
    cpu = preset("cpu-default")
    assert cpu.with_tf32() is cpu
    assert cpu.seconds(1e9, 0.0, 0, half_flops=1e9) == 2 * cpu.seconds(1e9, 0.0, 0)


def test_a_chunk_slice_reads_the_weight_again_at_the_profiles_operand_rate():
    """Each slice of the loss's chunk reads the projection's weight whole: on a CPU its matmul packs
    the weight at every call (146 ms for 14 more slices of a 32 MiB weight, where the launches and
    sums came to a few ms), so a slower operand rate makes more slices dearer, by exactly the
    weight's bytes read again."""
    from dataclasses import replace

    from backends.onnx.importer import import_model
    from engine.apply import plan
    from engine.budget.cost import chunk_seconds, whole_inputs
    from engine.strategies.chunk import ChunkRegion
    from training_graphs import build_ort_loss_head

    model, _ = build_ort_loss_head(4096, 64, 8192)
    graph = import_model(model)
    planning = plan(graph, RULES)
    [region] = [o for p in planning.plans for o in p.occurrences if isinstance(o, ChunkRegion)]
    weight = next(v for v in whole_inputs(region) if v.shape == (64, 8192))
    assert all(region.meta_of(v).dim is None for v in whole_inputs(region))
    cpu = preset("cpu-default")
    fast, slow = replace(cpu, operand_bytes_per_s=1e12), replace(cpu, operand_bytes_per_s=1e9)

    def dearer(profile, k):
        return chunk_seconds(region, k, RULES, graph.dim_examples, profile) - \
            chunk_seconds(region, 2, RULES, graph.dim_examples, profile)

    reread = sum(v.nbytes for v in whole_inputs(region)) * 14
    assert reread >= 14 * weight.nbytes
    assert abs((dearer(slow, 16) - dearer(fast, 16)) - (reread / 1e9 - reread / 1e12)) < 1e-9
    assert cpu.seconds(0, 0, 0, reread=1e9) == cpu.seconds(0, 1e9, 0)      # unmeasured: the bandwidth


def test_a_cpu_profile_cached_before_the_operand_rate_was_measured_is_measured_again(tmp_path, monkeypatch):
    import json

    import backends.device as device
    from engine.budget.device import DeviceProfile

    cached = tmp_path / "cpu.json"
    cached.write_text(json.dumps({"name": "cpu", "flops_per_s": 1e11, "bytes_per_s": 4e10, "launch_s": 1e-5,
                                  "half_flops_per_s": None, "tf32_flops_per_s": None}))
    monkeypatch.setattr(device, "cache_file", lambda: cached)
    monkeypatch.setattr(device, "busy", lambda: False)
    monkeypatch.setattr(device, "_UNCACHED", [])     # no profile this process measured on a busy machine
    measured = DeviceProfile("cpu", 2e11, 4e10, 1e-5, operand_bytes_per_s=8e9)
    monkeypatch.setattr(device, "measure_cpu", lambda: measured)
    assert device.cpu_profile() == measured
    assert json.loads(cached.read_text())["operand_bytes_per_s"] == 8e9
    monkeypatch.setattr(device, "measure_cpu", lambda: 1 / 0)      # now cached: not measured again
    assert device.cpu_profile() == measured


def test_a_cpu_profile_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    """Measured under load, the rates are low and unevenly so: the profile serves this process
    (measured once) and is not written, and a process on an idle machine measures again and caches."""
    import backends.device as device
    from engine.budget.device import DeviceProfile

    cached = tmp_path / "cpu.json"
    monkeypatch.setattr(device, "cache_file", lambda: cached)
    monkeypatch.setattr(device, "_UNCACHED", [])
    loaded, idle = DeviceProfile("cpu", 1e11, 4e10, 7e-5, operand_bytes_per_s=6e10), \
        DeviceProfile("cpu", 2.5e11, 4.6e10, 1e-5, operand_bytes_per_s=7e9)
    monkeypatch.setattr(device, "busy", lambda: True)
    calls = []
    monkeypatch.setattr(device, "measure_cpu", lambda: calls.append(1) or loaded)
    assert device.cpu_profile() == loaded and device.cpu_profile() == loaded
    assert len(calls) == 1 and not cached.exists()
    monkeypatch.setattr(device, "_UNCACHED", [])        # the next process, on an idle machine
    monkeypatch.setattr(device, "busy", lambda: False)
    monkeypatch.setattr(device, "measure_cpu", lambda: idle)
    assert device.cpu_profile() == idle and cached.exists()
    monkeypatch.setattr(device, "measure_cpu", lambda: 1 / 0)
    assert device.cpu_profile() == idle


def test_busy_reads_the_load_on_the_cores_this_process_may_use(monkeypatch):
    import os

    import backends.device as device

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert not device.busy()            # this process and a little more
    monkeypatch.setattr(os, "getloadavg", lambda: (2.1, 1.0, 1.0))
    assert device.busy()                # another core's worth of work besides this process


def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    from backends.device import profile_for
    from engine.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device; to plan for one without it, name its profile: a100, "):
        profile_for("cuda")

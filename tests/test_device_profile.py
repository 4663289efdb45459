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
    weight's bytes read again. (The other inputs a slice reads whole, a scalar here, move at the
    memory's rate.)"""
    from dataclasses import replace

    from backends.onnx.importer import import_model
    from engine.apply import plan
    from engine.budget.cost import chunk_seconds, pass_traffic, whole_inputs
    from engine.strategies.chunk import ChunkRegion
    from training_graphs import build_ort_loss_head

    model, _ = build_ort_loss_head(4096, 64, 8192)
    graph = import_model(model)
    planning = plan(graph, RULES)
    [region] = [o for p in planning.plans for o in p.occurrences if isinstance(o, ChunkRegion)]
    weight = next(v for v in whole_inputs(region, RULES) if v.shape == (64, 8192))
    assert all(region.meta_of(v).dim is None for v in whole_inputs(region, RULES))
    cpu = preset("cpu-default")
    fast, slow = replace(cpu, operand_bytes_per_s=1e12), replace(cpu, operand_bytes_per_s=1e9)

    def dearer(profile, k):
        return chunk_seconds(region, k, RULES, graph.dim_examples, profile) - \
            chunk_seconds(region, 2, RULES, graph.dim_examples, profile)

    reread = sum(t.packed for t in pass_traffic(region, RULES, graph.dim_examples)) * 14
    assert reread >= 14 * weight.nbytes
    assert abs((dearer(slow, 16) - dearer(fast, 16)) - (reread / 1e9 - reread / 1e12)) < 1e-9
    assert cpu.seconds(0, 0, 0, reread=1e9) == cpu.seconds(0, 1e9, 0)      # unmeasured: the bandwidth


@pytest.mark.parametrize("missing", ["operand_bytes_per_s", "cache_bytes_per_s"])
def test_a_cpu_profile_cached_before_remat_measured_all_it_does_is_measured_again(tmp_path, monkeypatch, missing):
    import json

    import backends.device as device
    from engine.budget.device import DeviceProfile

    old = DeviceProfile("cpu", 1e11, 4e10, 1e-5, operand_bytes_per_s=7e9, cache_bytes=2 ** 24,
                        cache_bytes_per_s=1e11).to_json()
    del old[missing]
    cached = tmp_path / "cpu.json"
    cached.write_text(json.dumps(old))
    monkeypatch.setattr(device, "cache_file", lambda: cached)
    monkeypatch.setattr(device, "busy", lambda: False)
    monkeypatch.setattr(device, "_UNCACHED", [])     # no profile this process measured on a busy machine
    measured = DeviceProfile("cpu", 2e11, 4e10, 1e-5, operand_bytes_per_s=8e9, cache_bytes=2 ** 24,
                             cache_bytes_per_s=1.1e11)
    monkeypatch.setattr(device, "measure_cpu", lambda: measured)
    assert device.cpu_profile() == measured
    assert json.loads(cached.read_text())[missing] == getattr(measured, missing)
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


def test_the_cache_serves_a_working_set_it_holds_and_a_share_of_a_larger_one():
    from dataclasses import replace

    cpu = replace(preset("cpu-default"), bytes_per_s=40e9, cache_bytes=16 * 2 ** 20, cache_bytes_per_s=115e9)
    assert cpu.cached_share(8 * 2 ** 20) == cpu.cached_share(16 * 2 ** 20) == 1.0
    assert cpu.cached_share(64 * 2 ** 20) == 0.25
    assert cpu.moving_seconds(2 ** 30, 1.0) == pytest.approx(2 ** 30 / 115e9)
    assert cpu.moving_seconds(2 ** 30, 0.25) == pytest.approx(0.75 * 2 ** 30 / 40e9 + 0.25 * 2 ** 30 / 115e9)
    for profile in (preset("cpu-default"), preset("h100")):     # not modelled: all at the bandwidth
        assert profile.cached_share(2 ** 20) == 0.0
        assert profile.moving_seconds(2 ** 30, 1.0) == 2 ** 30 / profile.bytes_per_s


def _loss_head_region():
    from backends.onnx.importer import import_model
    from engine.apply import plan
    from engine.strategies.chunk import ChunkRegion
    from training_graphs import build_ort_loss_head

    model, _ = build_ort_loss_head(4096, 64, 8192)      # logits of 128 MiB
    graph = import_model(model)
    [region] = [o for p in plan(graph, RULES).plans for o in p.occurrences if isinstance(o, ChunkRegion)]
    return graph, region


def test_a_chunk_whose_slices_fit_the_cache_gains_what_its_inner_traffic_saves_there():
    """The loss head's logits and what is computed from them, 128 MiB each whole, written by one
    kernel and read by the next: in slices that fit the cache they move at its rate. The gain
    grows with the slices until they fit and no further; a profile with no cache, or a backend
    that keeps every one of those values in its kernels' registers, gains nothing."""
    from dataclasses import replace

    from engine.budget.cost import (cache_fitting_slices, chunk_seconds, pass_traffic, region_traffic,
                                    unchunked_traffic)

    graph, region = _loss_head_region()
    cpu = replace(preset("cpu-default"), bytes_per_s=40e9, cache_bytes=16 * 2 ** 20, cache_bytes_per_s=115e9)
    examples = graph.dim_examples
    [one] = pass_traffic(region, RULES, examples)        # one phase: the same values as whole
    assert one.moved == unchunked_traffic(region, RULES, examples).moved >= 2 * 128 * 2 ** 20
    assert one.sliced > one.moved / 4 and one.again == 0
    # the weight's gradient, a partial sum whole in every slice (and the loss's scalar sums), and
    # the weight the matmuls read whole, as it is and transposed
    assert one.summed >= 64 * 8192 * 4 and one.packed == 2 * 64 * 8192 * 4
    assert 0 <= one.whole - (one.summed + one.packed + one.reread) < 1024
    fits = cache_fitting_slices(region, region_traffic(region, RULES, examples), cpu)
    assert fits is not None and one.working(1 / fits) <= cpu.cache_bytes < one.working(2 / fits)
    no_cache = replace(cpu, cache_bytes=None)
    gains = [chunk_seconds(region, k, RULES, examples, no_cache) - chunk_seconds(region, k, RULES, examples, cpu)
             for k in (2, fits // 2, fits, 2 * fits)]
    assert 0 < gains[0] < gains[1] < gains[2]
    # In the cache, the inner traffic gains what it moves at the memory's rate less the cache's,
    # beyond what the whole kept there; the sums and rereads of every further slice gain too.
    whole_share = cpu.cached_share(unchunked_traffic(region, RULES, examples).working(1.0))
    inner = one.moved * (1 - whole_share) * (1 / 40e9 - 1 / 115e9)
    for k, gain in zip((fits, 2 * fits), gains[2:]):
        sums = (2 * one.summed + one.reread) * (k - 1) * (1 / 40e9 - 1 / 115e9)
        assert gain == pytest.approx(inner + sums)
    assert chunk_seconds(region, fits, RULES, examples, preset("cpu-default")) == \
        chunk_seconds(region, fits, RULES, examples, replace(preset("cpu-default"), cache_bytes=2 ** 40))
    assert cache_fitting_slices(region, region_traffic(region, RULES, examples), preset("cpu-default")) is None
    for v in graph.values():      # every value fused into the kernel that reads it: no inner traffic
        v.materialized = False
    assert pass_traffic(region, RULES, examples)[0].moved == unchunked_traffic(region, RULES, examples).moved == 0


def test_an_option_that_saves_time_is_taken_under_any_budget():
    from engine.budget.solve import Option, solve

    live = [100, 300, 100]
    faster = Option(("chunk", 8), "chunk", -0.01, [(1, 1, -50)])
    slower = Option(("chunk", 2), "chunk", 0.002, [(1, 1, -20)])
    dearer = Option(("recompute", None), "recompute", 0.001, [(1, 1, -100)])
    assert solve(live, [slower, dearer], 1000) == []             # nothing to buy
    assert solve(live, [faster, slower, dearer], 1000) == [faster]
    assert solve(live, [faster, slower, dearer], 200) == [faster, dearer]


def test_the_cpu_is_measured_on_real_tensors_inside_a_fake_tensor_mode(monkeypatch):
    """The torch backend plans, and first measures the CPU, inside AOTAutograd, where a fake
    tensor mode is on: measured there, each small op was a Python dispatch (a launch of 224 us,
    cached) and each matmul computed nothing (an operand rate 5-8x this machine's)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    import backends.device as device

    seen = []

    def operand_rate(torch_module):
        seen.append(torch_module.ones(4))
        return 7e9

    monkeypatch.setattr(device, "_operand_rate", operand_rate)
    with FakeTensorMode():
        assert isinstance(torch.ones(4), FakeTensor)
        profile = device.measure_cpu()
    assert seen and not isinstance(seen[0], FakeTensor)
    assert profile.operand_bytes_per_s == 7e9
    assert profile.launch_s < 50e-6, profile.launch_s

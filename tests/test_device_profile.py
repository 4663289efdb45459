"""Device profiles: float32 work is costed at the float32 rate, 16-bit work at the tensor cores'."""
from __future__ import annotations

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

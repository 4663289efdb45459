"""Extra time of a plan: what it recomputes, and the launches and partial sums of its slices.

Per-op FLOPs and bytes moved come from the rule files' `cost` declarations where the rules
have them (engine.op_cost), else from a default: a matmul's 2*M*N*K, one FLOP per output
element for anything else, and the bytes of what the op reads and writes. A device profile
turns them into seconds.
"""
from __future__ import annotations

from ..ir import Node, Value
from ..patterns import RuleSet
from ..shapes import evaluate
from ..strategies.chunk import ChunkRegion
from ..strategies.recompute import Region
from .device import DeviceProfile

MATMULS = {"MatMul", "Gemm", "FusedMatMul"}


def _size(expr, examples: dict[str, int]) -> float:
    if expr is None:
        return 0.0
    value = evaluate(expr, examples)
    return float(value) if value is not None else 0.0


def node_work(node: Node, rules: RuleSet, examples: dict[str, int]) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one run of `node` at the example sizes."""
    declared = _declared(node, rules)
    if declared is not None:
        flops, moved = declared
        return _size(flops, examples), _size(moved, examples)
    if node.op in rules.views or (node.native_op is not None and node.native_op in rules.views):
        return 0.0, 0.0
    outs = [o for o in node.outputs if o.numel is not None]
    flops = sum(_size(o.numel, examples) for o in outs)
    if node.op_type in MATMULS and node.inputs and node.inputs[0] is not None and node.inputs[0].shape:
        flops *= 2 * _size(node.inputs[0].shape[-1], examples)
    moved = sum(_size(v.nbytes, examples) for v in [*node.present_inputs(), *node.outputs])
    return flops, moved


def _declared(node: Node, rules: RuleSet):
    try:
        from ..op_cost import node_cost
    except ImportError:          # rule files without cost facts
        return None
    cost = node_cost(node, rules)
    if cost is None or cost.flops is None:
        return None
    return cost.flops, cost.bytes


def recompute_seconds(region: Region, rules: RuleSet, examples: dict[str, int], device: DeviceProfile) -> float:
    flops = moved = 0.0
    for node in region.nodes:
        f, m = node_work(node, rules, examples)
        flops, moved = flops + f, moved + m
    return device.seconds(flops, moved, len(region.nodes))


def chunk_seconds(region: ChunkRegion, slices: int, rules: RuleSet, examples: dict[str, int],
                  device: DeviceProfile) -> float:
    """The launches of `slices - 1` more passes over the region's nodes, the partial sums
    added up slice by slice, and a two-phase region's forward nodes run again."""
    per_pass = sum(len(phase.nodes) for phase in region.phases) or len(region.nodes)
    sums = [o for o in region.outputs if region.meta_of(o).need_sum]
    accumulate = sum(2 * _size(o.nbytes, examples) for o in sums) * (slices - 1)
    flops = moved = 0.0
    for phase in region.phases:
        for node in phase.recomputed:
            f, m = node_work(node, rules, examples)
            flops, moved = flops + f, moved + m
    return device.seconds(flops, moved + accumulate, per_pass * (slices - 1))


def value_bytes(v: Value, examples: dict[str, int]) -> int:
    return int(_size(v.nbytes, examples))

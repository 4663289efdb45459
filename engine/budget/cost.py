"""Extra time of a plan: what it recomputes, and the launches and partial sums of its slices.

Per-op FLOPs and bytes moved come from the rule files' `cost` declarations (engine.op_cost;
std.ops has them for the common ops), else from a default: one FLOP per output element and
the bytes of what the op reads and writes. A device profile turns them into seconds.
"""
from __future__ import annotations

from ..dtypes import DType
from ..ir import Node, Value
from ..op_cost import default_cost, node_cost
from ..patterns import RuleSet
from ..shapes import evaluate
from ..strategies.chunk import ChunkRegion
from ..strategies.recompute import Region
from .device import DeviceProfile

def _size(expr, examples: dict[str, int]) -> float:
    if expr is None:
        return 0.0
    value = evaluate(expr, examples)
    return float(value) if value is not None else 0.0


def node_work(node: Node, rules: RuleSet, examples: dict[str, int]) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one run of `node` at the example sizes: by the rules' cost
    formula for its op, else one FLOP per output element and the bytes it reads and writes."""
    cost, fallback = node_cost(node, rules, examples), default_cost(node)
    flops = cost.flops if cost is not None and cost.flops is not None else fallback.flops
    moved = cost.bytes if cost is not None and cost.bytes is not None else fallback.bytes
    return _size(flops, examples), _size(moved, examples)


HALF = (DType.BFLOAT16, DType.FLOAT16)


def work(nodes: list[Node], rules: RuleSet, examples: dict[str, int]) -> tuple[float, float, float]:
    """(float32 FLOPs, 16-bit FLOPs, bytes moved) of one run of `nodes`: a node's FLOPs count
    at the 16-bit rate when its first output is bfloat16 or float16."""
    flops = half = moved = 0.0
    for node in nodes:
        f, m = node_work(node, rules, examples)
        if node.outputs and node.outputs[0].dtype in HALF:
            half += f
        else:
            flops += f
        moved += m
    return flops, half, moved


def recompute_seconds(region: Region, rules: RuleSet, examples: dict[str, int], device: DeviceProfile) -> float:
    flops, half, moved = work(region.nodes, rules, examples)
    return device.seconds(flops, moved, len(region.nodes), half)


def chunk_seconds(region: ChunkRegion, slices: int, rules: RuleSet, examples: dict[str, int],
                  device: DeviceProfile) -> float:
    """The launches of `slices - 1` more passes over the region's nodes, the partial sums
    added up slice by slice, the inputs every slice reads whole (the weight of the loss's
    matmuls) read again, and a two-phase region's forward nodes run again."""
    per_pass = sum(len(phase.nodes) for phase in region.phases) or len(region.nodes)
    sums = [o for o in region.outputs if region.meta_of(o).need_sum]
    accumulate = sum(2 * _size(o.nbytes, examples) for o in sums) * (slices - 1)
    reread = sum(_size(v.nbytes, examples) for v in whole_inputs(region)) * (slices - 1)
    flops, half, moved = work([n for phase in region.phases for n in phase.recomputed], rules, examples)
    return device.seconds(flops, moved + accumulate, per_pass * (slices - 1), half, reread)


def whole_inputs(region: ChunkRegion) -> list[Value]:
    """What each pass over a slice reads whole from outside it, once per phase that reads it:
    not sliced, not a running sum. On a CPU a matmul packs such an operand at every call
    (measured, linear + cross-entropy at vocab 32768: 16 slices of its matmuls took 146 ms more
    than 2, 28 more calls on a 32 MiB weight: 6-7 GB/s, where the memory bandwidth is 44)."""
    reads = [v for phase in region.phases for v in phase.inputs] or region.inputs
    return [v for v in reads if (meta := region.meta_of(v)).dim is None and not meta.need_sum]


def graph_seconds(nodes: list[Node], rules: RuleSet, examples: dict[str, int], device: DeviceProfile) -> float:
    """The estimated time of running `nodes` once (a whole step, for a scale of what extra time is worth)."""
    flops, half, moved = work(nodes, rules, examples)
    return device.seconds(flops, moved, len(nodes), half)


def value_bytes(v: Value, examples: dict[str, int]) -> int:
    return int(_size(v.nbytes, examples))

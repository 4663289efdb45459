"""Extra time of a plan: what it recomputes, and the launches and partial sums of its slices.

Per-op FLOPs and bytes moved come from the rule files' `cost` declarations (engine.op_cost;
std.ops has them for the common ops), else from a default: one FLOP per output element and
the bytes of what the op reads and writes. A device profile turns them into seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType
from ..ir import Node, Value
from ..op_cost import default_cost, node_cost
from ..patterns import RuleSet
from ..shapes import evaluate
from ..strategies.chunk import INDEXED, TYPE_ONLY, ChunkRegion
from ..strategies.chunk.grow import kind_of
from ..strategies.recompute import Region
from .device import DeviceProfile
from .effects import is_view

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
                  device: DeviceProfile, traffic: RegionTraffic | None = None) -> float:
    """What a region costs in `slices` slices more than whole, pass by pass: the launches of
    `slices - 1` more runs of its nodes; the partial sums added up slice by slice; the inputs
    every slice reads whole read again (a matmul's operand at the rate it takes one in, the
    weight of the loss's matmuls); and a two-phase region's forward nodes run again.

    Where the profile models a cache, bytes move in it for the share of a pass's working set it
    holds (DeviceProfile.cached_share), at the memory bandwidth for the rest, and what the
    region's own values take to move in slices is weighed against what they take whole
    (`traffic_seconds`): where a slice stays in the cache and the whole did not, the total may be
    negative, a chunk that makes the step faster (measured on a mixture-of-experts step through
    ONNX Runtime on this 2-core CPU, the experts' gathered weights, 1 GiB, chunked: 8 MiB slices
    ran it at 0.63x the unchunked graph's time, 64 MiB at 0.93x, 256 MiB at 1.00x). Where it
    does not, the nodes run again move the bytes their cost formulas say, at the bandwidth.
    `traffic`: `region_traffic(region, rules, examples)`, where the caller costs several counts."""
    if traffic is None:
        traffic = region_traffic(region, rules, examples)
    fraction, more = _fraction(region, slices), slices - 1
    flops, half, moved = work([n for phase in region.phases for n in phase.recomputed], rules, examples)
    total = device.seconds(flops, 0.0 if device.caches else moved, 0, half)
    for t in traffic.passes:
        share = device.cached_share(t.working(fraction))
        total += (device.seconds(0.0, 0.0, t.nodes * more, reread=t.packed * more)
                  + device.moving_seconds((2 * t.summed + t.reread) * more, share))
    return total + (traffic_seconds(traffic, fraction, device) if device.caches else 0.0)


def traffic_seconds(traffic: RegionTraffic, fraction: float, device: DeviceProfile) -> float:
    """Seconds a region's own values take to move in slices of `fraction` of the whole (and what
    the nodes run again read again), less what they take in the unchunked region."""
    chunked = sum(device.moving_seconds(t.moved, device.cached_share(t.working(fraction)))
                  + device.moving_seconds(t.again, 0.0) for t in traffic.passes)
    whole = traffic.whole
    return chunked - device.moving_seconds(whole.moved, device.cached_share(whole.working(1.0)))


@dataclass(frozen=True)
class Traffic:
    """What one run of a pass over the slices (or of the unchunked region) moves, counted whole.

    `moved`: its own values, each written by one of its kernels once and read by each reader in
    it (what the backend materializes, `Value.materialized`; not views, not what leaves the
    region or is kept from one pass for the next). The working set: `sliced`, the bytes that are
    sliced (those values and the sliced inputs, whole), and `whole`, those that are not (partial
    sums, inputs read whole). Per slice: `summed`, the partial sums it adds into the running
    ones; `packed`, the inputs a matmul reads whole (taken in at the operand rate), `reread`,
    the others read whole. `again`: the sliced inputs that nodes of an earlier pass, run again
    here, read again. `nodes`: its kernels."""

    moved: float
    sliced: float
    whole: float = 0.0
    summed: float = 0.0
    packed: float = 0.0
    reread: float = 0.0
    again: float = 0.0
    nodes: int = 0

    def working(self, fraction: float) -> float:
        return self.whole + self.sliced * fraction


@dataclass(frozen=True)
class RegionTraffic:
    """A region's Traffic, whatever its slice count: each pass's, and the unchunked region's."""

    passes: list[Traffic]
    whole: Traffic


def region_traffic(region: ChunkRegion, rules: RuleSet, examples: dict[str, int]) -> RegionTraffic:
    return RegionTraffic(pass_traffic(region, rules, examples), unchunked_traffic(region, rules, examples))


def cache_fitting_slices(region: ChunkRegion, traffic: RegionTraffic, device: DeviceProfile) -> int | None:
    """The fewest slices, of powers of two and the most the region allows, at which every pass's
    working set fits the cache and the whole did not (a count the planner is offered beside its
    menu); None where no count does, or the cache is not modelled."""
    if not device.caches:
        return None
    passes = [t for t in traffic.passes if t.moved]
    if not passes or all(t.working(1.0) <= device.cache_bytes for t in passes):
        return None
    most = region.most_slices
    counts = [k for k in (2 ** i for i in range(1, most.bit_length())) if k < most] + [most]
    for k in counts:
        fraction = _fraction(region, k)
        if all(t.working(fraction) <= device.cache_bytes for t in passes):
            return k
    return None


def _fraction(region: ChunkRegion, slices: int) -> float:
    sizes = region.sizes_for(slices)
    return max(sizes) / sum(sizes)


@dataclass(frozen=True)
class _Pass:
    """One pass over the slices: a phase's nodes, inputs, outputs and the nodes it runs again."""

    nodes: list[Node]
    inputs: list[Value]
    outputs: list[Value]
    recomputed: list[Node]


def _passes(region: ChunkRegion) -> list[_Pass]:
    """Each pass over the slices: its phases, or the region as one."""
    if region.phases:
        return [_Pass(p.nodes, p.inputs, p.outputs, p.recomputed) for p in region.phases]
    return [_Pass(region.nodes, region.inputs, region.outputs, [])]


def pass_traffic(region: ChunkRegion, rules: RuleSet, examples: dict[str, int]) -> list[Traffic]:
    """Each pass's Traffic: its phases', or the region's as one pass."""
    kept = _kept(region)
    out = []
    for p in _passes(region):
        recomputed = {id(n) for n in p.recomputed}
        leaving = {id(v) for v in p.outputs} | region.built_whole | kept
        own = _traffic(region, p.nodes, p.inputs, leaving, rules.views, examples)
        packed = reread = again = 0.0
        for v in p.inputs:
            if region.meta_of(v).dim is not None and any(id(n) in recomputed for n in v.users):
                again += _size(v.nbytes, examples)
        for v, by_matmul in _read_whole(region, p, rules):
            if by_matmul:
                packed += _size(v.nbytes, examples)
            else:
                reread += _size(v.nbytes, examples)
        summed = sum(_size(o.nbytes, examples) for o in p.outputs if region.meta_of(o).need_sum)
        out.append(Traffic(own.moved, own.sliced, own.whole + packed + reread, summed, packed, reread, again,
                           len(p.nodes)))
    return out


def unchunked_traffic(region: ChunkRegion, rules: RuleSet, examples: dict[str, int]) -> Traffic:
    """The Traffic of the region's own values run whole, each node once."""
    leaving = {id(v) for v in region.outputs} | region.built_whole | _kept(region)
    return _traffic(region, region.nodes, region.inputs, leaving, rules.views, examples)


def _kept(region: ChunkRegion) -> set[int]:
    """Values a pass reads from an earlier one (a dropout's mask): whole, in both."""
    made = {id(o) for n in region.nodes for o in n.outputs if o is not None}
    return {id(v) for phase in region.phases for v in phase.inputs if id(v) in made}


def _traffic(region: ChunkRegion, nodes: list[Node], inputs: list[Value], leaving: set[int],
             views: frozenset[str], examples: dict[str, int]) -> Traffic:
    ran = {id(n) for n in nodes}
    moved = sliced = whole = 0.0
    for v in inputs:
        if region.meta_of(v).dim is not None:
            sliced += _size(v.nbytes, examples)
    for node in nodes:
        if is_view(node, views):
            continue
        for v in node.outputs:
            if v is None or not v.materialized:
                continue
            size = _size(v.nbytes, examples)
            if region.meta_of(v).dim is None:
                whole += size
                continue
            sliced += size
            if id(v) not in leaving:
                moved += size * (1 + _readers(v, ran, views))
    return Traffic(moved, sliced, whole)


def _readers(v: Value, ran: set[int], views: frozenset[str]) -> int:
    """Nodes of a pass (`ran`) that read `v`, through views of it."""
    count = 0
    for user in v.users:
        if id(user) not in ran:
            continue
        if is_view(user, views):
            count += sum(_readers(o, ran, views) for o in user.outputs if o is not None)
        else:
            count += 1
    return count


def whole_inputs(region: ChunkRegion, rules: RuleSet) -> list[Value]:
    """What each pass over a slice reads whole from outside it, once per pass that reads it."""
    return [v for p in _passes(region) for v, _ in _read_whole(region, p, rules)]


def _read_whole(region: ChunkRegion, p: _Pass, rules: RuleSet) -> list[tuple[Value, bool]]:
    """The inputs of a pass that each slice reads whole, and whether a matmul reads it: not
    sliced, not a running sum, and read for its values, not for its shape alone (TYPE_ONLY) or
    only where a sliced index points (a gather's table, INDEXED: the experts' weights a slice of
    token slots gathers). On a CPU a matmul packs such an operand at every call (measured, linear
    + cross-entropy at vocab 32768: 16 slices of its matmuls took 146 ms more than 2, 28 more
    calls on a 32 MiB weight: 6-7 GB/s, where the memory bandwidth is 44)."""
    ran = {id(n) for n in p.nodes}
    out = []
    for v in p.inputs:
        meta = region.meta_of(v)
        if meta.dim is not None or meta.need_sum:
            continue
        readers = {id(n): n for n in v.users if id(n) in ran}.values()
        kinds = [kind_of(rules, n) for n in readers for i, x in enumerate(n.inputs) if x is v and _reads_whole(n, i, rules)]
        if kinds:
            out.append((v, "matmul" in kinds))
    return out


def _reads_whole(node: Node, position: int, rules: RuleSet) -> bool:
    kind = kind_of(rules, node)
    return position not in TYPE_ONLY.get(kind, ()) and position not in INDEXED.get(kind, ())


def graph_seconds(nodes: list[Node], rules: RuleSet, examples: dict[str, int], device: DeviceProfile) -> float:
    """The estimated time of running `nodes` once (a whole step, for a scale of what extra time is worth)."""
    flops, half, moved = work(nodes, rules, examples)
    return device.seconds(flops, moved, len(nodes), half)


def value_bytes(v: Value, examples: dict[str, int]) -> int:
    return int(_size(v.nbytes, examples))

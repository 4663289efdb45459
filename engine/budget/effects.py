"""What each plan does to the memory curve of the schedule.

The curve is the live activation bytes after each step of the graph's schedule (inputs and
weights excluded, views aliased to their base). A plan's effect is a few intervals of the
schedule with a byte delta each, so the planner can add effects up:

- recompute: a target stops being kept from its last forward use to its first backward use
  (its clone exists from there on, as the original did); a compromise's new stash is kept
  over the same gap;
- chunk into k slices: every value inside the region exists one slice at a time, a fraction
  `largest slice / whole` of it; a value the unchunked graph keeps from forward to backward
  (attention probabilities) is not kept at all between the phases.

Effects are planned on one graph (the one chunk rules see, op by op); values of a plan found
on another view of the same graph (recompute plans on the folded fx graph) are found by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import Analysis, liveness
from ..ir import Graph, Value
from ..shapes import evaluate
from ..strategies.chunk import ChunkRegion
from ..strategies.recompute import Region


@dataclass
class Curve:
    """Live bytes after each step, and where each value lives."""

    graph: Graph
    live: list[int]
    birth: dict[int, int]
    death: dict[int, int]
    position: dict[int, int]
    by_name: dict[str, Value] = field(repr=False, default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.live, default=0)


def is_view(node, views: frozenset[str]) -> bool:
    """The rules declare the op a view, by its IR name or its backend's (`aten::permute` is a view
    in torch, where ONNX's Transpose copies)."""
    return node.op in views or (node.native_op is not None and node.native_op in views)


def memory_curve(graph: Graph, views: frozenset[str]) -> Curve:
    live = liveness(graph)
    for node in reversed(graph.nodes):  # a view keeps its base alive as long as itself
        if is_view(node, views) and node.inputs and node.inputs[0] is not None and node.inputs[0].producer:
            base = node.inputs[0]
            live.death[id(base)] = max(live.death[id(base)], *(live.death[id(o)] for o in node.outputs))
    steps = len(graph.nodes)
    delta = [0] * (steps + 2)
    for node in graph.nodes:
        if is_view(node, views):
            continue
        for out in node.outputs:
            size = _bytes(out, graph.dim_examples)
            b, d = live.birth[id(out)], live.death[id(out)]
            delta[max(b, 0)] += size
            delta[min(d, steps - 1) + 1] -= size
    running, curve = 0, []
    for i in range(steps):
        running += delta[i]
        curve.append(running)
    by_name = {v.name: v for v in graph.values()}
    return Curve(graph, curve, live.birth, live.death, graph.node_index(), by_name)


def _bytes(v: Value, examples: dict[str, int]) -> int:
    if v.nbytes is None or not v.materialized:
        return 0
    size = evaluate(v.nbytes, examples)
    return int(size) if size is not None else 0


Interval = tuple[int, int, int]     # first step, last step (inclusive), byte delta


def _uses(value: Value, curve: Curve, analysis: Analysis, views: frozenset[str]) -> tuple[list[int], list[int]]:
    """Positions of the forward and backward readers of `value` and of its views. A view reads
    nothing: its readers are the uses (AOTAutograd's joint graph aliases a value the backward
    saves right where it is made, and that alias is no backward read)."""
    forward, backward, stack, seen = [], [], [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        for user in v.users:
            if id(user) not in curve.position:
                continue
            if is_view(user, views) and user.inputs and user.inputs[0] is v and any(o.users for o in user.outputs):
                stack.extend(user.outputs)
                continue
            (forward if analysis.is_forward(user) else backward).append(curve.position[id(user)])
    return forward, backward


def _gap(value: Value, curve: Curve, analysis: Analysis, views: frozenset[str]) -> tuple[int, int] | None:
    """Steps strictly between the last forward and the first backward use, if any."""
    forward, backward = _uses(value, curve, analysis, views)
    if not backward:
        return None
    last_forward = max(forward, default=curve.birth.get(id(value), -1))
    first_backward = min(backward)
    return (last_forward + 1, first_backward - 1) if first_backward - last_forward > 1 else None


def _base(value: Value, views: frozenset[str]) -> Value:
    """The value whose buffer `value` views (itself, if it is no view)."""
    while value.producer is not None and is_view(value.producer, views) and value.producer.inputs \
            and value.producer.inputs[0] is not None:
        value = value.producer.inputs[0]
    return value


def _local(value: Value, curve: Curve) -> Value | None:
    """The value of the same name in the curve's graph."""
    return curve.by_name.get(value.name)


def recompute_effect(region: Region, curve: Curve, analysis: Analysis, views: frozenset[str]) -> list[Interval]:
    examples = curve.graph.dim_examples
    out: list[Interval] = []
    gaps = []
    targets = [v for v in (_local(t, curve) for t in region.targets) if v is not None]
    through_targets = {p for v in targets for p in _uses(v, curve, analysis, views)[1]}
    freed: dict[int, Value] = {}
    for v in targets:
        # A view holds no bytes of its own: recomputing it frees its base, where every backward
        # reader of the base reads it through the recomputed values (fx graphs stash views).
        base = _base(v, views)
        if base is not v and not set(_uses(base, curve, analysis, views)[1]) <= through_targets:
            continue
        freed[id(base)] = base
    for v in freed.values():
        gap = _gap(v, curve, analysis, views)
        if gap is not None:
            out.append((gap[0], gap[1], -_bytes(v, examples)))
            gaps.append(gap)
    if gaps:
        until = min(g[1] for g in gaps)
        for kept in region.new_stash:
            v = _local(kept, curve)
            if v is None:
                continue
            forward, backward = _uses(v, curve, analysis, views)
            start = max(forward, default=curve.birth.get(id(v), -1)) + 1
            if start <= until and not backward:
                out.append((start, until, _bytes(v, examples)))
    return out


def chunk_effect(region: ChunkRegion, slices: int, curve: Curve, analysis: Analysis,
                 views: frozenset[str]) -> list[Interval]:
    examples = curve.graph.dim_examples
    sizes = region.sizes_for(slices)
    whole = sum(sizes)
    built_whole = region.built_whole      # what leaves the region saves nothing
    out: list[Interval] = []
    for node in region.nodes:
        if is_view(node, views):
            continue
        for o in node.outputs:
            v = _local(o, curve)
            if v is None or id(o) in built_whole:
                continue
            size = _bytes(v, examples)
            saved = size - size * max(sizes) // whole
            b, d = max(curve.birth.get(id(v), 0), 0), curve.death.get(id(v), 0)
            gap = _gap(v, curve, analysis, views) if len(region.phases) > 1 else None
            if gap is None:
                out.append((b, d, -saved))
            else:
                out += [(b, gap[0] - 1, -saved), (gap[0], gap[1], -size), (gap[1] + 1, d, -saved)]
    return [iv for iv in out if iv[0] <= iv[1] and iv[2]]


def chunk_value_names(region: ChunkRegion) -> set[str]:
    """The values a chunk region computes: a recompute plan of one of them conflicts with it."""
    return {o.name for n in region.nodes for o in n.outputs}

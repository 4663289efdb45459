"""A model's layers, for `--ratio`: ColossalAI's gradient-checkpointing ratio (seed 004) and ONNX
Runtime's layer-wise levels as what they are, budgets.

A ratio R asks for R of the layers' activations to go: the target peak is the original's less R
times the bytes the layers stash for the backward, and the same solver as `--budget` chooses the
cheapest plans that reach it (they need not be whole layers; where the cheapest memory is).

Layers are found two ways:
- from module paths (`Node.scope`: torch's `nn_module_stack`, torch.onnx's name scopes): a path
  `P.<i>` where `P` holds two or more numbered children (`blocks.0`, `blocks.1`, ...) is a layer;
- where no path names them (an ONNX training graph exported from an AOT graph has none), from the
  graph's repetition: the forward's weight-reading nodes, in schedule order, each written as its op
  and weight shape, contain one run repeated k >= 2 times; each repetition is a layer, from its
  first weight reader to the next one's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..analysis import Analysis
from ..errors import ConfigError
from ..ir import Graph, Node, Value
from ..shapes import evaluate

_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass
class Layer:
    name: str
    nodes: list[Node] = field(default_factory=list)


def find_layers(graph: Graph, analysis: Analysis) -> tuple[list[Layer], str]:
    """The forward's layers, and how they were found (`module paths` or `repeated subgraphs`)."""
    forward = [n for n in graph.nodes if analysis.is_forward(n)]
    by_path = _layers_by_path(forward)
    if len(by_path) >= 2:
        return by_path, "module paths"
    return _layers_by_repetition(forward, graph), "repeated subgraphs"


def layer_places(graph: Graph, analysis: Analysis) -> dict[str, int]:
    """Node name -> its place in its layer (the same for the same node of every repeat of a
    layer), for the forward's nodes inside the layers `find_layers` finds (none where it finds
    fewer than two, or layers of different lengths, which are not repeats). By name, and by the
    backend's node names too, so a node of another import of the same graph (decomposed ops
    folded or not) finds its place."""
    layers, _ = find_layers(graph, analysis)
    if len(layers) < 2 or len({len(layer.nodes) for layer in layers}) != 1:
        return {}
    return {name: k for layer in layers for k, n in enumerate(layer.nodes)
            for name in (n.name, *n.backend_nodes)}


def place_of(node: Node, places: dict[str, int]) -> int | None:
    """`node`'s place in its layer (layer_places), by its name or its first backend node's."""
    for name in (node.name, *node.backend_nodes):
        if name in places:
            return places[name]
    return None


def stashed_bytes_by_layer(graph: Graph, analysis: Analysis, layers: list[Layer]) -> dict[str, int]:
    """Bytes each layer keeps for the backward (its stashed values, at the example dims)."""
    producer_layer = {id(n): layer.name for layer in layers for n in layer.nodes}
    out = {layer.name: 0 for layer in layers}
    for v in analysis.stashed:
        name = producer_layer.get(id(v.producer)) if v.producer is not None else None
        if name is not None:
            out[name] += _nbytes(v, graph)
    return out


def ratio_target(ratio: float, original_peak: int, graph: Graph, analysis: Analysis,
                 reachable: int | None = None) -> tuple[int, str]:
    """The peak a ratio asks for: the original's, less R times what recomputing the layers can
    save (their stash, or what the rules reach where that is less: recomputing every layer still
    keeps each layer's input, as checkpointing does), and a line saying how it was read."""
    if not 0 < ratio <= 1:
        raise ConfigError(f"ratio {ratio}: the fraction of the layers' activations to recompute is in (0, 1]")
    layers, how = find_layers(graph, analysis)
    if len(layers) < 2:
        raise ConfigError("--ratio needs the model's layers, and none were found: no module paths name "
                          "numbered layers (blocks.0, blocks.1, ...) and no block of the forward repeats; "
                          "give a budget instead (--budget 400MiB or --budget 0.6)")
    stashed = stashed_bytes_by_layer(graph, analysis, layers)
    total = sum(stashed.values())
    saving = total if reachable is None else max(0, min(total, reachable))
    target = max(1, original_peak - int(ratio * saving))
    return target, (f"ratio {ratio:g}: {len(layers)} layers found from {how} stash {total / 2**20:.1f} MiB, "
                    f"the rules can take {saving / 2**20:.1f} MiB off the peak; target {target / 2**20:.1f} MiB")


def _layers_by_path(forward: list[Node]) -> list[Layer]:
    """Paths `P.<i>` where `P` has at least two numbered children; the outermost such P wins."""
    children: dict[str, set[str]] = {}
    for node in forward:
        if node.scope:
            for prefix, index in _numbered_prefixes(node.scope):
                children.setdefault(prefix, set()).add(index)
    repeated = {p for p, indices in children.items() if len(indices) >= 2}
    layers: dict[str, Layer] = {}
    for node in forward:
        if not node.scope:
            continue
        for prefix, index in _numbered_prefixes(node.scope):
            if prefix in repeated:
                name = f"{prefix}.{index}"
                layers.setdefault(name, Layer(name)).nodes.append(node)
                break
    return list(layers.values())


def _numbered_prefixes(scope: str) -> list[tuple[str, str]]:
    """`blocks.3.attn.0` -> [("blocks", "3"), ("blocks.3.attn", "0")], outermost first."""
    parts = scope.split(".")
    return [(".".join(parts[:i]), parts[i]) for i in range(1, len(parts)) if parts[i].isdigit()]


def _layers_by_repetition(forward: list[Node], graph: Graph) -> list[Layer]:
    position = {id(n): i for i, n in enumerate(forward)}
    anchors = [(n, sig) for n in forward if (sig := _weight_signature(n, graph)) is not None]
    signatures = [sig for _, sig in anchors]
    start, period, count = _longest_repetition(signatures)
    if count < 2:
        return []
    bounds = [position[id(anchors[start + k * period][0])] for k in range(count)]
    end = position[id(anchors[start + count * period][0])] if start + count * period < len(anchors) else len(forward)
    bounds.append(end)
    return [Layer(f"layer {k}", forward[bounds[k]:bounds[k + 1]]) for k in range(count)]


def _weight_signature(node: Node, graph: Graph) -> tuple | None:
    """The node's op and the shapes of the weights it reads (inputs or initializers of rank 2 or
    more, looked through the views and transposes that only reshape a weight), or None."""
    shapes = []
    for v in node.present_inputs():
        w = _weight_behind(v)
        if w is not None:
            shapes.append(tuple(str(d) for d in w.shape))
    return (node.op, tuple(shapes)) if shapes and node.op not in _RESHAPING else None


_RESHAPING = {"Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Expand"}


def _weight_behind(v: Value) -> Value | None:
    """A weight: a graph input or initializer of rank 2 or more with every dim a number (a
    batch of data has symbolic dims, where the exporter kept them)."""
    for _ in range(4):
        if (v.is_input or v.is_initializer) and not v.tangent and v.shape is not None and len(v.shape) >= 2 \
                and all(isinstance(d, int) for d in v.shape):
            return v
        p = v.producer
        if p is None or p.op not in _RESHAPING or not p.inputs or p.inputs[0] is None:
            return None
        v = p.inputs[0]
    return None


def _longest_repetition(seq: list) -> tuple[int, int, int]:
    """(start, period, count) of the run `seq[start:start + period]` repeated `count` times back
    to back that covers the most of `seq`; ties go to the shorter period. For each period, a
    stretch where `seq[i] == seq[i + period]` holds for L positions in a row is a run of
    (L + period) // period repetitions."""
    best, best_cover = (0, 0, 0), 0
    n = len(seq)
    for period in range(1, n // 2 + 1):
        length = 0
        for i in range(n - period + 1):
            if i < n - period and seq[i] == seq[i + period]:
                length += 1
                continue
            count = (length + period) // period
            if count >= 2 and count * period > best_cover:
                best, best_cover = (i - length, period, count), count * period
            length = 0
    return best


def _nbytes(v: Value, graph: Graph) -> int:
    n = evaluate(v.nbytes, graph.dim_examples) if v.nbytes is not None else None
    return int(n) if n is not None else 0

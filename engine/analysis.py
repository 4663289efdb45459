"""Forward/backward split, stashed activations, liveness and estimated peak memory."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .errors import GraphError
from .ir import Graph, Node, Value
from .shapes import Dim, evaluate, simplify


@dataclass
class Analysis:
    """What one training graph keeps alive between its forward and backward parts."""

    graph: Graph
    forward_outputs: list[Value]
    forward: set[int]                     # ids of forward nodes
    stashed: list[Value]                  # forward values read by backward nodes, schedule order
    position: dict[int, int] = field(repr=False, default_factory=dict)  # node id -> index
    first_backward: int = 0               # index of the first backward node
    constant: set[int] = field(repr=False, default_factory=set)  # ids of values computed from constants only

    def is_forward(self, node: Node) -> bool:
        return id(node) in self.forward

    def is_constant(self, value: Value) -> bool:
        """Computed from constants alone (shape arithmetic and the like): free to read anywhere."""
        return id(value) in self.constant

    def is_stashed(self, value: Value) -> bool:
        return id(value) in self._stashed_ids

    def __post_init__(self) -> None:
        self._stashed_ids = {id(v) for v in self.stashed}

    def stashed_bytes(self) -> Dim:
        return simplify(sum((v.nbytes or 0) for v in self.stashed))


def resolve_forward_outputs(graph: Graph, names: Sequence[str] | None) -> list[Value]:
    if not graph.outputs:
        raise GraphError("the graph has no outputs, so it has no forward part")
    if not names:
        return [graph.outputs[0]]
    by_name = {v.name: v for v in graph.values()}
    missing = [n for n in names if n not in by_name]
    if missing:
        outs = ", ".join(v.name for v in graph.outputs[:10])
        raise GraphError(f"forward output(s) {', '.join(missing)} not found in the graph; "
                         f"its outputs are: {outs}{'...' if len(graph.outputs) > 10 else ''}")
    return [by_name[n] for n in names]


def analyze(graph: Graph, forward_outputs: Sequence[str] | None = None) -> Analysis:
    """Forward = the ancestors of the forward outputs (by default the first output, the loss)."""
    fwd_outs = resolve_forward_outputs(graph, forward_outputs)
    forward: set[int] = set()
    stack = [v.producer for v in fwd_outs if v.producer is not None]
    while stack:
        node = stack.pop()
        if id(node) in forward:
            continue
        forward.add(id(node))
        stack.extend(v.producer for v in node.reads() if v.producer is not None)
    position = graph.node_index()
    stashed = []
    constant = constant_values(graph)
    outputs = {id(v) for v in graph.outputs}  # kept to the end anyway: not a cost of backward
    for node in graph.nodes:
        if id(node) not in forward:
            continue
        for out in node.outputs:
            if (id(out) not in constant and id(out) not in outputs
                    and any(id(u) not in forward for u in out.users)):
                stashed.append(out)
    backward_positions = [position[id(n)] for n in graph.nodes if id(n) not in forward]
    return Analysis(graph, fwd_outs, forward, stashed, position,
                    min(backward_positions, default=len(graph.nodes)), constant)


# Ops whose result depends on their input's shape, never its data.
SHAPE_OPS = frozenset({"Shape", "Size", "aten::sym_size", "aten::sym_numel"})


def constant_values(graph: Graph) -> set[int]:
    """Ids of values that do not depend on tensor data: Constant nodes, shapes (SHAPE_OPS), and
    what is computed from those alone. They are tiny and readable anywhere, so a recompute
    region reads them instead of recomputing them."""
    constant: set[int] = set()
    for node in graph.nodes:
        if node.subgraphs:
            continue
        if node.op in SHAPE_OPS or all(id(v) in constant for v in node.present_inputs()):
            constant.update(id(o) for o in node.outputs)
    return constant


@dataclass
class Liveness:
    birth: dict[int, int]   # value id -> node index producing it (-1: input or weight)
    death: dict[int, int]   # value id -> last node index reading it (len(nodes): graph output)


def liveness(graph: Graph) -> Liveness:
    birth: dict[int, int] = {}
    death: dict[int, int] = {}
    end = len(graph.nodes)
    for v in list(graph.inputs) + list(graph.initializers):
        birth[id(v)] = -1
    for i, node in enumerate(graph.nodes):
        for out in node.outputs:
            birth[id(out)] = i
            death.setdefault(id(out), i)
        for v in node.reads():
            death[id(v)] = i
    for v in graph.outputs:
        death[id(v)] = end
    return Liveness(birth, death)


@dataclass
class PeakEstimate:
    peak_bytes: int | None        # at the example dims; None if a dim has no example value
    peak_index: int               # node at which the peak is reached
    live_at_peak: list[Value]


def estimate_peak(graph: Graph, alias_ops: Collection[str] = ()) -> PeakEstimate:
    """Peak of the activations live across the schedule (inputs and weights excluded).

    Outputs of ops in `alias_ops` (views) are counted as free: the backends keep
    them as aliases of their input.
    """
    live = liveness(graph)
    for node in reversed(graph.nodes):  # a view keeps its base alive as long as itself
        if node.op in alias_ops and node.inputs and node.inputs[0] is not None:
            base = node.inputs[0]
            if base.producer is not None:
                live.death[id(base)] = max(live.death[id(base)],
                                           max(live.death[id(o)] for o in node.outputs))
    delta = [0] * (len(graph.nodes) + 2)
    by_id: dict[int, Value] = {}
    unknown = False
    for node in graph.nodes:
        if node.op in alias_ops:
            continue
        for out in node.outputs:
            size = evaluate(out.nbytes, graph.dim_examples) if out.nbytes is not None else 0
            if size is None:
                unknown = True
                continue
            b, d = live.birth[id(out)], live.death[id(out)]
            delta[b] += size
            delta[d + 1] -= size
            by_id[id(out)] = out
    running, peak, peak_at = 0, 0, 0
    for i in range(len(graph.nodes)):
        running += delta[i]
        if running > peak:
            peak, peak_at = running, i
    at_peak = [v for vid, v in by_id.items() if live.birth[vid] <= peak_at <= live.death[vid]]
    return PeakEstimate(None if unknown else peak, peak_at, at_peak)

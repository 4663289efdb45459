"""The shared graph IR: Graph, Node, Value.

Kept small on purpose, like torch.fx: a Graph is an ordered list of Nodes
(the order is a valid schedule) over SSA Values. Every backend imports into
this and exports out of it; rules match on it.

Op names are ONNX operator names for the default domain (`Gelu`), and
`domain::name` otherwise (`com.microsoft::BiasGelu`, `aten::gelu`).

What importers and strategies tell the engine about a node or a value are typed fields,
documented where they are declared; `meta` holds only a backend's own notes, which the
engine never reads.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

import sympy

from .dtypes import DType
from .errors import GraphError
from .shapes import Dim, format_shape, free_dims, numel, simplify, substitute, united_sizes


@dataclass(eq=False, slots=True)
class Value:
    """An SSA value. `data` holds a constant's payload (opaque to the engine)."""

    name: str
    dtype: DType = DType.UNKNOWN
    shape: tuple[Dim, ...] | None = None
    producer: "Node | None" = field(default=None, repr=False)
    users: list["Node"] = field(default_factory=list, repr=False)
    is_input: bool = False
    is_initializer: bool = False
    data: Any = field(default=None, repr=False)
    meta: dict[str, Any] = field(default_factory=dict, repr=False)
    # An incoming gradient of a joint graph (fx: the `tangents_*` placeholders).
    tangent: bool = field(default=False, repr=False)
    # A constant operand a backend writes inline in its op (a Python scalar argument of an
    # ATen op, `x / 8.0`). Importers make such scalars constant values, so an op's operands
    # sit at the same positions whichever exporter made the graph (ONNX's Div reads its
    # divisor as a tensor); a literal has no node of its own in the backend's graph.
    literal: bool = field(default=False, repr=False)
    # The value of a small integer constant (axes, a shape), for ops that read it as a parameter.
    ints: list[int] | None = field(default=None, repr=False)
    # False where the backend's compiler computes the value inside the kernel that reads it
    # (Inductor's fusion of pointwise chains): it never takes memory, so the budget planner's
    # memory curve gives it no bytes.
    materialized: bool = field(default=True, repr=False)
    # Every element of the value is this number, whatever its shape (a fill: ONNX's
    # ConstantOfShape, a one-element Constant, ATen's full and zeros_like, a number an op reads
    # as an operand); importers set it, so the engine knows the zeros a gradient is scattered or
    # padded into without reading a backend's attributes.
    filled: float | None = field(default=None, repr=False)

    @property
    def numel(self) -> Dim | None:
        return None if self.shape is None else numel(self.shape)

    @property
    def nbytes(self) -> Dim | None:
        n = self.numel
        if n is None or self.dtype is DType.UNKNOWN:
            return None
        return simplify(n * self.dtype.itemsize)

    @property
    def has_static_shape(self) -> bool:
        """Every dim a number (none symbolic, none unknown)."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def type_str(self) -> str:
        return f"{self.dtype}{format_shape(self.shape)}"

    def __repr__(self) -> str:
        return f"Value({self.name}: {self.type_str})"


@dataclass(eq=False, slots=True)
class Node:
    op: str
    inputs: list[Value | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    subgraphs: dict[str, "Graph"] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # The backend's own spelling of the op where the IR op is an ONNX name (`aten::gelu` for a
    # Gelu from torch): rules may name either.
    native_op: str | None = None
    # The IR op a backend decomposed into this node and its neighbours, where the node does not
    # stand for it whole (an unfolded `log_softmax` became `amax`, `sub`, ...).
    decomposed_from: str | None = None
    # Schema defaults of the attributes the node does not write (ONNX), for attribute matching.
    attr_defaults: dict[str, Any] = field(default_factory=dict, repr=False)
    # The backend nodes this IR node stands for (fx: the nodes of one decomposed op, folded).
    backend_nodes: list[str] = field(default_factory=list, repr=False)
    # Written by a chunk builder for one slice of a region: not chunked again.
    chunk_slice: bool = False
    # Written by the recompute rewriter on a clone: the node it recomputes, and the region.
    recompute_of: str | None = None
    recompute_region: int | None = None
    # The module path the exporter recorded for the node (`blocks.3.attn`), where it recorded one:
    # how `--ratio` finds a model's layers (engine.budget.layers).
    scope: str | None = None
    # The key of the plan whose rewrite made the node (a recompute clone; a chunk region's Loop and
    # what joins its slices), for pictures of where each plan runs (`remat measure --timeline`).
    plan: str | None = None

    @property
    def domain(self) -> str:
        return self.op.rpartition("::")[0]

    @property
    def op_type(self) -> str:
        """The op without its domain: `BiasGelu` for `com.microsoft::BiasGelu`."""
        return self.op.rpartition("::")[2]

    def present_inputs(self) -> Iterator[Value]:
        return (v for v in self.inputs if v is not None)

    def reads(self) -> Iterator[Value]:
        """Every value the node needs: its inputs, and what its subgraphs read from outside
        (an ONNX Loop body reads outer values by name, not through the Loop's inputs)."""
        yield from self.present_inputs()
        for sub in self.subgraphs.values():
            yield from captured_values(sub)

    def replace_input(self, old: Value, new: Value) -> None:
        """Read `new` where the node, or a node of its subgraphs, reads `old`."""
        self.inputs = [new if v is old else v for v in self.inputs]
        for sub in self.subgraphs.values():
            for node in sub.nodes:
                node.replace_input(old, new)
            sub.outputs = [new if v is old else v for v in sub.outputs]

    def __repr__(self) -> str:
        return f"Node({self.name or '?'}: {self.op})"


class SliceSizes(Enum):
    """How a backend builds the slices of a chunk region whose chunked dim has a dynamic size."""

    STATIC = "static"            # slices of static sizes only: such a region is refused
    # A count fixed at the example sizes, the slices' sizes formulas of the dynamic size: every
    # slice but the last floor(size / count) rows, the last the rest, never negative (fx:
    # one `invoke_subgraph` call per slice, bodies compiled for symbolic shapes).
    FIXED_COUNT = "fixed count"
    # The count and the sizes computed in the graph from the dynamic dims (ONNX: from `Shape`,
    # slices of ceil(size / count) rows run by a Loop).
    COMPUTED = "computed"


@dataclass(eq=False)
class Graph:
    """Nodes in schedule order over values; `dim_examples` turns symbolic sizes into bytes."""

    nodes: list[Node] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    initializers: list[Value] = field(default_factory=list)
    name: str = "graph"
    dim_examples: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    # The forward part's outputs (by default the first graph output, the loss).
    forward_outputs: list[str] | None = None
    # How the backend that owns the graph slices a chunk region over a dynamic size (SliceSizes).
    slicing: SliceSizes = SliceSizes.STATIC
    # The backend reshapes a chunk region's input, or its concatenated output, to a shape of
    # dynamic sizes (fx: from the graph's own SymInts); otherwise only static ones are planned.
    dynamic_reshapes: bool = False
    # The backend promised the eager framework's random numbers (Inductor's `fallback_random`): a
    # chunk region's slices may not draw random numbers of their own, which would be others.
    eager_random: bool = False
    # The dims whose example is the size the graph was traced at, with no largest size given: the
    # graph will also run longer inputs (fx: a dynamic dim without a `mark_dynamic` max). A chunk
    # rule whose size guard fails at the example but holds at longer sizes is refused so
    # (`Reason.longer_inputs`), and the backend says how to plan for the longest.
    open_dims: frozenset[str] = frozenset()
    # The dims whose range the user declared as a constraint that every guard the backend adds
    # must follow from (fx: `mark_dynamic(t, dim, min=, max=)`, which Dynamo checks after the
    # backend returned, raising ConstraintViolationError). A chunk's slices of such a size
    # guard their own sizes (at least two rows each, the last slice's rows), which no declared
    # range proves: a region sliced along it is refused (`Reason.constrained_dims`).
    constrained_dims: frozenset[str] = frozenset()
    # The sizes the graph was traced at, where the examples are others (fx: a dynamic dim planned
    # at its largest). A fixed count of slices of floor(size / count) rows (SliceSizes.FIXED_COUNT)
    # is at most the rows at these sizes: a size the graph's guards let in then gives every slice
    # a row (a shorter one compiles again and is planned at its own size), where slices of no
    # rows fail Inductor's lowering.
    dim_traced: dict[str, int] = field(default_factory=dict)
    _names: set[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.link()

    def link(self) -> None:
        """Recompute producers and users after the node list changed."""
        for v in self.values():
            v.producer = None
            v.users = []
        for node in self.nodes:
            for out in node.outputs:
                out.producer = node
            for v in node.present_inputs():
                v.users.append(node)
            for sub in node.subgraphs.values():
                for v in captured_values(sub):
                    v.users.append(node)

    def relink(self, values: Iterable[Value | None], added: Iterable[Node] = ()) -> None:
        """`link()` for `values` alone: their producers and users recomputed, in node order and
        once per read as `link()` has them, after an edit that changed only which nodes read or
        write these: the reads and writes of every node added or removed, and what an input
        replaced read and reads now. `added`: the nodes the edit put in the graph; every other
        node that reads or writes one of `values` now must have read or written one of them
        before, as the values' producers and users said (linked before the edit: a subgraph's
        own link() takes the outer values it reads as its own). The ORT view's fusions edit
        graphs of thousands of nodes hundreds of times, where `link()` walks every value each
        time. A value no node reads or writes any more is left with neither (`link()` leaves it
        as it was)."""
        affected = {id(v): v for v in values if v is not None}
        candidates = {id(n): n for n in added}
        for v in affected.values():
            if v.producer is not None:
                candidates[id(v.producer)] = v.producer
            candidates.update((id(u), u) for u in v.users)
        position = {id(n): i for i, n in enumerate(self.nodes)}
        for v in affected.values():
            v.producer = None
            v.users = []
        for node in sorted((n for n in candidates.values() if id(n) in position), key=lambda n: position[id(n)]):
            for out in node.outputs:
                if id(out) in affected:
                    out.producer = node
            for v in node.inputs:
                if v is not None and id(v) in affected:
                    v.users.append(node)
            for sub in node.subgraphs.values():
                for v in captured_values(sub):
                    if id(v) in affected:
                        v.users.append(node)

    def checkpoint(self) -> Callable[[], None]:
        """A way back to the graph as it is now: the function returned restores the lists of
        nodes, inputs, outputs and initializers, each node's inputs (in subgraphs too, and their
        outputs), and links again. For an edit that must leave the graph as it was when it fails
        part way (a chunk region's build, which the driver then runs whole)."""
        lists = (list(self.nodes), list(self.inputs), list(self.outputs), list(self.initializers))
        reads = [(n, list(n.inputs)) for n in self.walk()]
        subs = [(sub, list(sub.outputs)) for n in self.walk() for sub in n.subgraphs.values()]

        def restore() -> None:
            self.nodes, self.inputs, self.outputs, self.initializers = (list(x) for x in lists)
            for node, inputs in reads:
                node.inputs = inputs
            for sub, outputs in reversed(subs):      # the innermost first: a link() clears what
                sub.outputs = outputs                   # a graph reads from the one around it
                sub.link()
            self.link()

        return restore

    def state_key(self) -> tuple:
        """A key that differs whenever the graph does: its lists, and every field of its nodes
        and values (nodes and values by identity, fields by their items down to scalars and
        sizes, anything else by identity: a constant's payload, a proto), in its subgraphs too.
        For keeping an analysis of a graph that may be edited between two asks for it
        (ort_schedule's leaf placements, estimated when the planner simulates the rewritten graph
        and again when it is written)."""
        ids = lambda vs: tuple(id(v) if v is not None else None for v in vs)   # noqa: E731
        values = tuple((id(v), *(_frozen(getattr(v, f)) for f in _VALUE_STATE)) for v in self.values())
        nodes = tuple((id(n), ids(n.inputs), ids(n.outputs), *(_frozen(getattr(n, f)) for f in _NODE_STATE),
                       tuple((k, sub.state_key()) for k, sub in n.subgraphs.items()))
                      for n in self.nodes)
        return (ids(self.inputs), ids(self.outputs), ids(self.initializers), values, nodes,
                *(_frozen(getattr(self, f)) for f in _GRAPH_STATE))

    def walk(self) -> Iterator[Node]:
        """Every node, those of the subgraphs (a Loop's body) after the node that holds them."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs.values():
                yield from sub.walk()

    def values(self) -> Iterator[Value]:
        seen: set[int] = set()
        for v in _chain(self.inputs, self.initializers,
                        (v for n in self.nodes for v in _chain(n.present_inputs(), n.outputs)),
                        self.outputs):
            if id(v) not in seen:
                seen.add(id(v))
                yield v

    def unite_sizes(self, facts: list[tuple[Dim, Dim]], lower_bounds: dict[str, int] | None = None) -> dict:
        """Write each value's sizes without the symbols `facts` (pairs of formulas equal at every
        run: fx, the shape environment's guards) prove equal to formulas of others
        (shapes.united_sizes), in this graph and its subgraphs: one size, one formula. Returns
        what was substituted."""
        if not facts:
            return {}
        uses: dict[str, int] = {}
        for v in self.values():
            for d in v.shape or ():
                for name in free_dims(d):
                    uses[name] = uses.get(name, 0) + 1
        united = united_sizes(facts, lower_bounds, uses)
        self._substitute(united)
        return united

    def _substitute(self, united: dict) -> None:
        if not united:
            return
        for v in self.values():
            if v.shape is not None:
                v.shape = tuple(substitute(d, united) for d in v.shape)
        for node in self.nodes:
            for sub in node.subgraphs.values():
                sub._substitute(united)

    def node_index(self) -> dict[int, int]:
        """Position of each node (keyed by id) in the schedule."""
        return {id(n): i for i, n in enumerate(self.nodes)}

    def fresh_name(self, base: str) -> str:
        """A value or node name no other value or node of the graph (or its subgraphs) has, and
        that no later call returns: the graph owns its namespace, like torch.fx's Graph."""
        if self._names is None:
            self._names = set()
            self._collect_names(self)
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def _collect_names(self, graph: "Graph") -> None:
        self._names.update(v.name for v in graph.values())
        for node in graph.nodes:
            self._names.add(node.name)
            for sub in node.subgraphs.values():
                self._collect_names(sub)

    def copy(self) -> "Graph":
        """A copy of the nodes and values; constant payloads (`data`) are shared, not copied."""
        mapping: dict[int, Value] = {}

        def val(v: Value | None) -> Value | None:
            if v is None:
                return None
            if id(v) not in mapping:
                mapping[id(v)] = replace(v, producer=None, users=[], meta=dict(v.meta))
            return mapping[id(v)]

        return self._copy_with(val)

    def _copy_with(self, val) -> "Graph":
        inputs = [val(v) for v in self.inputs]
        inits = [val(v) for v in self.initializers]
        nodes = [replace(n, inputs=[val(v) for v in n.inputs], outputs=[val(v) for v in n.outputs],
                         attrs=dict(n.attrs), subgraphs={k: g._copy_with(val) for k, g in n.subgraphs.items()},
                         meta=dict(n.meta), backend_nodes=list(n.backend_nodes))
                 for n in self.nodes]
        return Graph(nodes, inputs, [val(v) for v in self.outputs], inits, self.name,
                     dict(self.dim_examples), dict(self.meta), self.forward_outputs, self.slicing,
                     self.dynamic_reshapes, self.eager_random, self.open_dims, self.constrained_dims,
                     dict(self.dim_traced))

    def verify(self) -> None:
        """Raise GraphError naming the node when the graph is not a valid SSA schedule."""
        _verify(self, outer=set())

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)


_VALUE_STATE = tuple(f.name for f in fields(Value) if f.name not in ("producer", "users"))
_NODE_STATE = tuple(f.name for f in fields(Node) if f.name not in ("inputs", "outputs", "subgraphs"))
_GRAPH_STATE = tuple(f.name for f in fields(Graph)
                     if f.name not in ("nodes", "inputs", "outputs", "initializers", "_names"))


def _frozen(x: Any) -> Any:
    """`x` as a hashable key (Graph.state_key): scalars, enums and sizes as they are, lists,
    tuples and dicts by their items, anything else (an array, a proto, a node) by identity."""
    if x is None or isinstance(x, (bool, int, float, str, Enum)):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(e) for e in x)
    if isinstance(x, dict):
        return tuple((k, _frozen(v)) for k, v in x.items())
    if isinstance(x, sympy.Basic):
        return x
    return ("id", id(x))


def _chain(*iterables: Iterable[Value]) -> Iterator[Value]:
    for it in iterables:
        yield from it


def captured_values(sub: Graph) -> Iterator[Value]:
    """Values a subgraph reads from the enclosing scope."""
    defined = {id(v) for v in _chain(sub.inputs, sub.initializers)}
    for node in sub.nodes:
        for v in node.present_inputs():
            if id(v) not in defined:
                yield v
        for inner in node.subgraphs.values():
            for v in captured_values(inner):
                if id(v) not in defined:
                    yield v
        defined.update(id(o) for o in node.outputs)


def _verify(graph: Graph, outer: set[int]) -> None:
    from .printer import node_context

    defined: set[int] = set(outer)
    names: dict[str, Value] = {}

    def define(v: Value, where: str, node_at: int | None = None) -> None:
        other = names.get(v.name)
        if other is not None and other is not v:
            at = f"\n{node_context(graph, node_at)}" if node_at is not None else ""
            raise GraphError(f"value name {v.name!r} is defined twice ({where}){at}")
        if id(v) in defined and node_at is not None:
            raise GraphError(f"value {v.name!r} is produced twice ({where})\n{node_context(graph, node_at)}")
        names[v.name] = v
        defined.add(id(v))

    for v in graph.inputs:
        define(v, "graph input")
    for v in graph.initializers:
        define(v, "initializer")
    for i, node in enumerate(graph.nodes):
        if not node.op:
            raise GraphError(f"node #{i} has no op\n{node_context(graph, i)}")
        for k, v in enumerate(node.inputs):
            if v is not None and id(v) not in defined:
                raise GraphError(
                    f"node {node.name or '#' + str(i)} ({node.op}) reads {v.name!r} (input {k}) "
                    f"before it is defined\n{node_context(graph, i)}")
        for sub in node.subgraphs.values():
            _verify(sub, defined)
        for out in node.outputs:
            if out.producer is not node:
                raise GraphError(
                    f"node {node.name or '#' + str(i)} ({node.op}) output {out.name!r} does not "
                    f"name it as producer (call graph.link() after editing)\n{node_context(graph, i)}")
            define(out, f"output of {node.name or node.op}", i)
    for v in graph.outputs:
        if id(v) not in defined:
            raise GraphError(f"graph output {v.name!r} is never defined")

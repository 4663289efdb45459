"""Building IR graphs by hand, and the training graphs engine.testing generates.

`GraphBuilder` writes a graph node by node: `op` with the types given (or the first input's),
`emit` with the types inferred (engine.testing.ops), `const` for constants, `param` for the
inputs a training step differentiates. `TrainingGraph` is one generated training step: the IR
graph (forward, then the backward engine.testing.autodiff wrote), the inputs to run it with,
and what each backend needs to run it again.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..dtypes import DType
from ..ir import Graph, Node, Value
from ..shapes import Dim, as_dim, evaluate
from .ops import FLOATS, NUMPY, OPS, In, infer


class GraphBuilder:
    """Nodes appended in schedule order over values it names (`base` + a counter)."""

    def __init__(self, examples: dict[str, int] | None = None):
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.weights: list[Value] = []
        self.params: list[Value] = []          # inputs the training step differentiates
        self.examples = examples or {}
        self.count = 0

    def _name(self, base: str) -> str:
        self.count += 1
        return f"{base}{self.count}"

    def input(self, name: str, dtype: str | DType = "float32", shape=(1024, 1024), weight: bool = False) -> Value:
        """A graph input, or with `weight` an initializer (a weight the graph holds)."""
        dt = dtype if isinstance(dtype, DType) else DType.from_name(dtype)
        v = Value(name, dt, tuple(as_dim(d) for d in shape), is_input=not weight, is_initializer=weight)
        (self.weights if weight else self.inputs).append(v)
        return v

    def param(self, name: str, dtype: str | DType = "float32", shape=(1024, 1024)) -> Value:
        """An input the training step computes the gradient of (a weight, as torch's export of a
        training step passes it)."""
        v = self.input(name, dtype, shape)
        self.params.append(v)
        return v

    def const(self, value: Any, dtype: Any = np.float32, base: str = "c") -> Value:
        """A constant (an initializer holding a numpy array; small integer ones also as `ints`,
        and one whose elements are all one number as `filled`)."""
        array = np.asarray(value, dtype=dtype)
        dt = next(d for d, t in NUMPY.items() if np.dtype(t) == array.dtype)
        v = Value(self._name(base), dt, tuple(array.shape), is_initializer=True, data=array)
        if array.dtype.kind == "i" and array.size <= 16:
            v.ints = [int(x) for x in array.reshape(-1)]
        if array.size and array.dtype.kind in "fiub" and (array.size == 1 or (array == array.flat[0]).all()):
            v.filled = float(array.flat[0])
        self.weights.append(v)
        return v

    def op(self, op: str, inputs, dtype: str | None = None, shape=None, outputs: int = 1,
           name: str | None = None, **attrs) -> Value | list[Value]:
        """A node whose outputs have the dtype and shape given (by default its first input's)."""
        self.count += 1
        first = next((v for v in inputs if v is not None), None)
        dt = DType.from_name(dtype) if dtype else (first.dtype if first else DType.FLOAT32)
        sh = tuple(as_dim(d) for d in shape) if shape is not None else (first.shape if first else ())
        base = name or f"{op.lower()}{self.count}"
        outs = [Value(base if k == 0 else f"{base}_{k}", dt, sh) for k in range(outputs)]
        self.nodes.append(Node(op, list(inputs), outs, attrs, f"n_{base}"))
        return outs[0] if outputs == 1 else outs

    def emit(self, op: str, inputs: list[Value | None], base: str | None = None, outputs: int | None = None,
             output_shapes: list | None = None, **attrs) -> Value | list[Value]:
        """A node whose output types engine.testing.ops infers; returns its outputs (one, or a
        list when the op has several). ValueError when the inputs do not fit the op."""
        ins = [In(v.dtype, v.shape, v.ints, _shape_of(v)) for v in inputs if v is not None]
        rule_attrs = dict(attrs, output_shapes=output_shapes) if output_shapes is not None else attrs
        types = infer(op, ins, rule_attrs)
        if outputs is not None and len(types) != outputs:
            raise ValueError(f"{op} gives {len(types)} outputs, not {outputs}")
        name = self._name(base or op.lower())
        outs = [Value(name if k == 0 else f"{name}_{k}", dt, tuple(shape)) for k, (dt, shape) in enumerate(types)]
        node = Node(op, list(inputs), outs, attrs, f"n_{name}")
        node.attr_defaults = dict(OPS[op].defaults) if op in OPS else {}
        for out in outs:
            out.producer = node          # Graph.link() sets it too; type inference reads it before
        self.nodes.append(node)
        return outs[0] if len(outs) == 1 and outputs is None else outs

    def graph(self, outputs: list[Value], forward_outputs: list[str] | None = None) -> Graph:
        g = Graph(self.nodes, self.inputs, outputs, self.weights, dim_examples=dict(self.examples))
        if forward_outputs:
            g.forward_outputs = forward_outputs
        g.verify()
        return g


def _shape_of(v: Value) -> tuple | None:
    """The shape a `Shape(x)` value holds (x's), for Reshape and Expand to read."""
    node = v.producer
    if node is None or node.op != "Shape" or node.inputs[0] is None or node.inputs[0].shape is None:
        return None
    shape = node.inputs[0].shape
    return tuple(shape[node.attrs.get("start", 0):node.attrs.get("end", len(shape))])


class IrEmitter:
    """engine.testing.ops.Emitter over a GraphBuilder: what gradient formulas write IR with."""

    def __init__(self, builder: GraphBuilder):
        self.builder = builder

    def op(self, op: str, inputs: list, base: str | None = None, **attrs):
        return self.builder.emit(op, inputs, base, **attrs)

    def const(self, value: Any, dtype: Any = np.float32, base: str = "c"):
        return self.builder.const(value, dtype, base)


@dataclass
class TrainingGraph:
    """One training step engine.testing built: `graph` is the forward part (its first output the
    loss) and then the backward part, whose outputs are the gradients of `params` (named
    `grad.<param>`); `forward_nodes` of its nodes are the forward part. `feeds` runs it.
    `domains` says which inputs must stay positive (`Log`'s) or are booleans. Shown as text, the
    forward part alone, which is what a failing example prints."""

    graph: Graph
    params: list[str]
    forward_nodes: int
    feeds: dict[str, np.ndarray]
    rule: str | None = None
    dynamic: frozenset[str] = frozenset()        # dims kept symbolic (graph.dim_examples sizes them)
    sizes: dict[str, int] = field(default_factory=dict, repr=False)   # every dim's size, as grown
    note: str = ""

    @property
    def loss(self) -> Value:
        return self.graph.outputs[0]

    def forward_text(self) -> str:
        from ..printer import format_node

        lines = [", ".join(f"%{v.name}: {v.type_str}{' (param)' if v.name in self.params else ''}"
                           for v in self.graph.inputs)]
        forward = self.graph.nodes[:self.forward_nodes]
        read = {id(v) for n in forward for v in n.present_inputs()}
        consts = [v for v in self.graph.initializers if id(v) in read and v.data is not None and v.data.size <= 8]
        if consts:
            lines.append("  " + ", ".join(f"%{v.name} = {v.data.tolist()}" for v in consts))
        lines += [f"  {format_node(n)}" for n in forward]
        lines.append(f"  loss %{self.loss.name}")
        if self.graph.dim_examples:
            lines.append("  sizes " + ", ".join(f"{k}={v}" for k, v in sorted(self.graph.dim_examples.items())))
        return "\n".join(lines)

    def __repr__(self) -> str:
        about = f" for rule {self.rule}" if self.rule else ""
        return f"TrainingGraph{about} ({self.note or 'generated'}):\n{self.forward_text()}"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """How Hypothesis prints a falsifying example: the text above, not every field."""
        printer.text(repr(self))


def random_feeds(graph: Graph, seed: int, domains: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Inputs for every graph input at the example sizes: normal floats (0.5 scale), positive ones
    in [0.5, 1.5] where `domains` says `positive`, booleans, small integers."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        shape = tuple(evaluate(d, graph.dim_examples) for d in v.shape)
        domain = (domains or {}).get(v.name, "real")
        if v.dtype is DType.BOOL:
            feeds[v.name] = rng.random(shape) < 0.5
        elif v.dtype in (DType.INT64, DType.INT32):
            feeds[v.name] = rng.integers(0, 4, shape).astype(NUMPY[v.dtype])
        else:
            data = rng.uniform(0.5, 1.5, shape) if domain == "positive" else rng.standard_normal(shape) * 0.5
            feeds[v.name] = data.astype(NUMPY.get(v.dtype, np.float32))
    return feeds


def static_sizes(graph: Graph, sizes: dict[str, int], keep: frozenset[str] = frozenset()) -> Graph:
    """A copy of `graph` with every dim symbol but those in `keep` replaced by its size; the kept
    ones stay symbolic, sized by `dim_examples`."""
    import sympy

    from ..shapes import simplify, symbol

    copy = graph.copy()
    subs = {symbol(name): sympy.Integer(size) for name, size in sizes.items() if name not in keep}

    def fix(d: Dim) -> Dim:
        return simplify(d.xreplace(subs)) if isinstance(d, sympy.Expr) else d

    for v in copy.values():
        if v.shape is not None:
            v.shape = tuple(fix(d) for d in v.shape)
    copy.dim_examples = {name: size for name, size in sizes.items() if name in keep}
    return copy


def widened(tg: TrainingGraph) -> TrainingGraph:
    """The same step with every float in float64 (values, casts, constants, feeds): what the
    step computes, all but free of rounding, for judging how far rounding alone moved the
    original's outputs (engine.testing.check's second opinion)."""
    graph = tg.graph.copy()
    for v in graph.values():
        if v.dtype in FLOATS:
            v.dtype = DType.FLOAT64
            if isinstance(v.data, np.ndarray):
                v.data = v.data.astype(np.float64)
    for node in graph.nodes:
        if node.op == "Cast" and node.attrs.get("to") in FLOATS:
            node.attrs["to"] = DType.FLOAT64
    feeds = {name: x.astype(np.float64) if x.dtype.kind == "f" else x for name, x in tg.feeds.items()}
    return replace(tg, graph=graph, feeds=feeds)


def nudged(tg: TrainingGraph, seed: int = 0) -> TrainingGraph:
    """The same step with every float feed one unit in its last place away, up or down at
    random: how far the step's outputs move for rounding of their inputs' size (engine.testing.
    check's second opinion)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, x in tg.feeds.items():
        if x.dtype.kind == "f":
            x = np.where(rng.random(x.shape) < 0.5, np.nextafter(x, np.inf), np.nextafter(x, -np.inf)).astype(x.dtype)
        feeds[name] = x
    return replace(tg, feeds=feeds)

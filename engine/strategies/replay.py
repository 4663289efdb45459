"""Replays: a nondeterministic op recomputed with the random values one of its outputs keeps.

Recomputing Dropout would draw a new mask, so a recompute region through a nondeterministic op is
refused, unless the rule files say how the op runs again from what it drew:

    replay y, mask = Dropout(x, ratio, _) as Mul(Mul(CastLike(mask, x), x), CastLike(Reciprocal(Sub(1, ratio)), x))

A region that reaches `y` then keeps `mask` (its saved outputs: a new stash, a compromise, where
it was not kept anyway; a byte per element where `y` took four) and computes `y` again with the
template's ops from `mask` and the op's inputs, which the region grows through as usual. The
backward reads the forward's random values, never new ones.

A template is elementwise ops (TEMPLATE_OPS) over the op's inputs and outputs and number literals;
each value's type follows the ops' broadcasting, a literal takes the type of the operand beside
it, and the last op writes the replayed output, with its name's type and shape.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..dtypes import DType
from ..ir import Node, Value
from ..patterns import Replay, TemplateCall

# Ops a template may apply, by how the output's type follows from the operands: `first` the first
# operand's (after broadcasting), `bool` a comparison or logic, `cast` its `to`, `cast_like` the
# second operand's, `where` the branches'.
TEMPLATE_OPS = {
    **{op: "first" for op in ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Reciprocal", "Sqrt", "Exp", "Log",
                              "Pow", "Max", "Min", "Identity", "Floor", "Ceil", "Sign")},
    **{op: "bool" for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
                             "Xor")},
    "Cast": "cast", "CastLike": "cast_like", "Where": "where",
}


@dataclass
class BoundReplay:
    """A replay declaration bound to one node: its captures' values."""

    replay: Replay
    node: Node
    values: dict[str, Value]

    @property
    def replayed(self) -> Value:
        return self.node.outputs[self.replay.replayed]

    @property
    def saved(self) -> list[Value]:
        return [self.node.outputs[k] for k in self.replay.saved]

    @property
    def inputs(self) -> list[Value]:
        """The node's inputs the template reads."""
        read = captures(self.replay.template)
        return [v for name, v in self.values.items() if name in read and v not in self.node.outputs]


def replay_for(rules, node: Node) -> Replay | None:
    """The replay declared for the backend's own op (`native_op`: `aten::native_dropout`), else
    for the IR's (`Dropout`): two runtimes' kernels of one op may round differently."""
    return rules.replays.get(node.native_op or "") or rules.replays.get(node.op)


def bound_replay(rules, node: Node) -> BoundReplay | str:
    """The rules' replay of the nondeterministic `node`, bound to it, or why there is none (no
    declaration for its op, or one naming an input or output the node lacks)."""
    declared = replay_for(rules, node)
    if declared is None:
        return (f"{node.name} ({node.op}) is nondeterministic, and no `replay` declaration for {node.op} "
                f"says how to run it again from what it drew")
    return bind(declared, node)


def bind(replay: Replay, node: Node) -> BoundReplay | str:
    """The declaration's captures on `node`, or why they do not bind (an input or an output the
    declaration names is absent)."""
    values: dict[str, Value] = {}
    for what, names, have in (("output", replay.outputs, node.outputs), ("input", replay.inputs, node.inputs)):
        for k, name in enumerate(names):
            if name is None:
                continue
            if k >= len(have) or have[k] is None:
                return f"{node.name} ({node.op}) has no {what} {k} ({name}), which its replay reads"
            values[name] = have[k]
    return BoundReplay(replay, node, values)


def captures(call: TemplateCall) -> set[str]:
    out, stack = set(), [call]
    while stack:
        c = stack.pop()
        for a in c.args:
            if isinstance(a, str):
                out.add(a)
            elif isinstance(a, TemplateCall):
                stack.append(a)
    return out


def _broadcast(shapes: list[tuple | None]) -> tuple | None:
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0]
        out.append(next((d for d in dims if not (isinstance(d, int) and d == 1)), 1))
    return tuple(out)


def instantiate(bound: BoundReplay, read: Callable[[Value], Value], fresh: Callable[[str], str],
                out: Value) -> list[Node]:
    """The template's nodes, in order, computing `out` (a clone of the replayed output) from
    `read(v)` for each value of the node it reads (the region's clone of it, or the value)."""
    nodes: list[Node] = []
    base = bound.node.name

    def emit(op: str, inputs: list[Value], attrs: dict, result: Value | None) -> Value:
        kind = TEMPLATE_OPS[op]
        if result is None:
            if kind == "bool":
                dtype = DType.BOOL
            elif kind == "cast":
                dtype = attrs["to"]
            elif kind in ("cast_like", "where"):
                dtype = inputs[1].dtype
            else:
                dtype = inputs[0].dtype
            shape = inputs[0].shape if kind in ("cast", "cast_like") else _broadcast([v.shape for v in inputs])
            result = Value(fresh(f"{base}_replay"), dtype, shape)
        nodes.append(Node(op, inputs, [result], attrs, fresh(f"{base}_replay_{op.lower()}")))
        return result

    def literal(number: int | float, like: Value | None) -> Value:
        integer = like is not None and like.dtype.type_name.startswith(("int", "uint"))
        dtype = DType.INT64 if integer else DType.FLOAT32
        attrs = {"value_int": int(number)} if integer else {"value_float": float(number)}
        const = Value(fresh(f"{base}_replay_const"), dtype, ())
        nodes.append(Node("Constant", [], [const], attrs, fresh(f"{base}_replay_constant")))
        if like is not None and like.dtype is not dtype:
            return emit("CastLike", [const, like], {}, None)
        return const

    def call(c: TemplateCall, result: Value | None) -> Value:
        operands: list[Value | int | float] = []
        for a in c.args:
            if isinstance(a, TemplateCall):
                operands.append(call(a, None))
            elif isinstance(a, str):
                operands.append(read(bound.values[a]))
            else:
                operands.append(a)
        like = next((v for v in operands if isinstance(v, Value) and v.dtype is not DType.BOOL), None)
        inputs = [v if isinstance(v, Value) else literal(v, like) for v in operands]
        return emit(c.op, inputs, dict(c.attrs), result)

    call(bound.replay.template, out)
    return nodes

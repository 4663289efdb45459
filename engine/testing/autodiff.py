"""The backward part of a generated training step, written as IR ops.

Reverse mode over the forward nodes (engine.testing.ops has each op's vector-Jacobian
product), from a constant 1 as the loss's gradient, summing the gradients of values read
twice. Only values between the `params` and the loss get gradients; the graph's outputs are
the loss, then the gradient of each param that has one (`grad.<name>`). The result is what a
training-step exporter writes: forward values the backward reads are the stashed activations
the rules work on.
"""
from __future__ import annotations

from ..ir import Value
from .graphs import GraphBuilder, IrEmitter
from ..dtypes import DType
from .ops import FLOATS, Call, gradient, scalar


def add_backward(builder: GraphBuilder, loss: Value) -> list[tuple[Value, Value]]:
    """Append the backward of the builder's nodes so far to it; returns (param, gradient) pairs,
    in the order of `builder.params`. A node with no gradient formula stops gradients there."""
    forward = list(builder.nodes)
    needs = {id(p) for p in builder.params}
    for node in forward:
        if any(id(v) in needs for v in node.present_inputs()):
            needs.update(id(o) for o in node.outputs)
    if id(loss) not in needs:
        return []
    e = IrEmitter(builder)
    grads: dict[int, Value] = {id(loss): scalar(e, 1.0, loss.dtype, "seed")}
    for node in reversed(forward):
        outs = [grads.get(id(o)) for o in node.outputs]
        if all(g is None for g in outs) or not any(id(v) in needs for v in node.present_inputs()):
            continue
        vjp = gradient(node.op)
        if vjp is None:
            continue
        call = Call(list(node.inputs), list(node.outputs), dict(node.attrs),
                    [v.shape if v is not None else None for v in node.inputs],
                    [o.shape for o in node.outputs], _data_dtype(node),
                    [v.ints if v is not None else None for v in node.inputs])
        if len(node.outputs) == 1:
            ins = vjp(e, call, outs[0])
        else:
            ins = vjp(e, call, *outs)
        for v, g in zip(node.inputs, ins):
            if v is None or g is None or id(v) not in needs:
                continue
            g = _cast_to(e, g, v)
            grads[id(v)] = g if id(v) not in grads else e.op("Add", [grads[id(v)], g], "acc")
    return [(p, grads[id(p)]) for p in builder.params if id(p) in grads]


def _data_dtype(node) -> DType:
    """The dtype a formula's constants take: its first float input's (Where's data, not its mask)."""
    return next((v.dtype for v in node.present_inputs() if v.dtype in FLOATS), node.inputs[0].dtype)


def _cast_to(e: IrEmitter, g: Value, like: Value) -> Value:
    """A gradient has its value's dtype (a formula over constants of another may widen it)."""
    return g if g.dtype is like.dtype else e.op("Cast", [g], "gcast", to=like.dtype)

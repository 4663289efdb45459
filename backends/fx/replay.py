"""A replay (engine.strategies.replay) built in the ATen joint graph.

A recompute region through a dropout keeps the dropout's mask and computes its output again
from it with the template std.ops declares for it (`x * mask * (1 / (1 - p))`). The fx
backend does not lower the engine's rewritten IR: it tags the region's fx nodes
MUST_RECOMPUTE and the min-cut partitioner recomputes them in backward (backends/fx/compile.py).
A random op cannot be tagged so (the partitioner would draw new random numbers, or save and
restore the generator's whole state), so its replayed output is computed by the template's
ops instead, as ATen nodes placed after the op, and every reader of the output reads those:
the forward computes the output from the mask once (the op's own product is left unread), and
the partitioner, seeing the template's nodes tagged like the rest of the region, computes them
again in backward from the kept mask and the op's inputs. The template is the engine's
(`engine.strategies.replay.instantiate`); this module only spells its ops in ATen.
"""
from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable

import torch
from torch import fx

from engine.errors import GraphError
from engine.ir import Node, Value
from engine.strategies.replay import BoundReplay, instantiate

from .importer import TORCH_DTYPES

aten = torch.ops.aten
prims = torch.ops.prims


# Template ops on tensors (a Python number as the second operand where ATen's overload takes one).
_TENSOR_OPS = {
    "Add": aten.add.Tensor, "Sub": aten.sub.Tensor, "Mul": aten.mul.Tensor, "Div": aten.div.Tensor,
    "Pow": aten.pow.Tensor_Tensor, "Max": aten.maximum.default, "Min": aten.minimum.default,
    "Equal": aten.eq.Tensor, "Less": aten.lt.Tensor, "LessOrEqual": aten.le.Tensor, "Greater": aten.gt.Tensor,
    "GreaterOrEqual": aten.ge.Tensor, "And": aten.logical_and.default, "Or": aten.logical_or.default,
    "Xor": aten.logical_xor.default, "Neg": aten.neg.default, "Abs": aten.abs.default,
    "Reciprocal": aten.reciprocal.default, "Sqrt": aten.sqrt.default, "Exp": aten.exp.default,
    "Log": aten.log.default, "Floor": aten.floor.default, "Ceil": aten.ceil.default, "Sign": aten.sign.default,
    "Not": aten.logical_not.default, "Where": aten.where.self,
}
# The same ops with a Python number as the second operand.
_SCALAR_OPS = {
    "Add": aten.add.Tensor, "Sub": aten.sub.Tensor, "Mul": aten.mul.Tensor, "Div": aten.div.Tensor,
    "Pow": aten.pow.Tensor_Scalar, "Max": aten.clamp_min.default, "Min": aten.clamp_max.default,
    "Equal": aten.eq.Scalar, "Less": aten.lt.Scalar, "LessOrEqual": aten.le.Scalar, "Greater": aten.gt.Scalar,
    "GreaterOrEqual": aten.ge.Scalar,
}
# Commutative ops, whose number operand may come first.
_COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Equal"}

# Template ops on numbers alone, computed here in Python (double precision, as ATen computes a
# dropout's scale); ATen casts the result to the tensor's type where a tensor op reads it.
_NUMBER_OPS: dict[str, Callable] = {
    "Add": operator.add, "Sub": operator.sub, "Mul": operator.mul, "Div": operator.truediv,
    "Pow": operator.pow, "Max": max, "Min": min, "Neg": operator.neg, "Abs": abs,
    "Reciprocal": lambda a: 1.0 / a, "Sqrt": math.sqrt, "Exp": math.exp, "Log": math.log,
    "Floor": math.floor, "Ceil": math.ceil, "Identity": lambda a: a,
    "Sign": lambda a: float((a > 0) - (a < 0)),
    "Equal": operator.eq, "Less": operator.lt, "LessOrEqual": operator.le, "Greater": operator.gt,
    "GreaterOrEqual": operator.ge, "Not": operator.not_, "And": lambda a, b: bool(a and b),
    "Or": lambda a, b: bool(a or b), "Xor": lambda a, b: bool(a) != bool(b),
    "Where": lambda c, a, b: a if c else b,
}

Operand = fx.Node | int | float | bool


def build_replay(graph: fx.Graph, bound: BoundReplay, by_name: dict[str, fx.Node]) -> list[fx.Node]:
    """Compute `bound`'s replayed output in `graph` with the template's ops, placed after the op's
    outputs and the inputs the template reads, and make every reader of the output read it.
    Returns the nodes made, the last writing the output. A GraphError, with nothing changed,
    where a value the template reads has no fx node or an op has no ATen spelling here."""
    replayed = _node(bound.replayed, by_name)
    read: dict[int, Operand] = {}
    for v in (*bound.inputs, *bound.saved):
        read[id(v)] = _number(v) if v.literal else _node(v, by_name)
    counter = itertools.count()
    out = Value(f"{replayed.name}_replay", bound.replayed.dtype, bound.replayed.shape)
    template = instantiate(bound, lambda v: v, lambda base: f"{base}_{next(counter)}", out)
    env: dict[int, Operand] = dict(read)
    plan: list[tuple[Node, Callable | None, tuple]] = []
    for node in template:         # spelled and checked before the graph is touched
        operands = [env[id(v)] if id(v) in env else _missing(v, node) for v in node.inputs]
        values = operands[:1] if node.op == "CastLike" else operands    # the second gives the type only
        if not any(isinstance(a, (fx.Node, Value)) for a in values):
            env[id(node.outputs[0])] = _fold(node, operands)
            continue
        target, args = _spell(node, operands)
        env[id(node.outputs[0])] = node.outputs[0]       # a placeholder: the fx node is made below
        plan.append((node, target, args))
    if not plan:
        raise GraphError(f"{bound.node.name}: its replay computes a number, not a tensor")
    position = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max((a for a in read.values() if isinstance(a, fx.Node)), key=position.__getitem__)
    anchor = max(anchor, replayed, key=position.__getitem__)
    made: list[fx.Node] = []
    made_for: dict[int, fx.Node] = {}
    for node, target, args in plan:
        args = tuple(made_for.get(id(a), a) if isinstance(a, Value) else a for a in args)
        with graph.inserting_after(made[-1] if made else anchor):
            made.append(graph.call_function(target, args))
        made_for[id(node.outputs[0])] = made[-1]
        for key in ("nn_module_stack", "stack_trace", "partitioner_tag"):
            if key in replayed.meta:
                made[-1].meta[key] = replayed.meta[key]
    replayed.replace_all_uses_with(made[-1], delete_user_cb=lambda user: user not in made)
    return made


def _node(v: Value, by_name: dict[str, fx.Node]) -> fx.Node:
    try:
        return by_name[v.name]
    except KeyError:
        raise GraphError(f"a replay reads %{v.name}, which the fx graph does not have") from None


def _number(v: Value) -> int | float | bool:
    return v.data.item() if hasattr(v.data, "item") else v.data


def _missing(v: Value, node: Node):
    raise GraphError(f"{node.name} ({node.op}) reads %{v.name}, which the replay does not make")


def _cast_to(node: Node):
    """The type a Cast (its `to`) or a CastLike (its second input's) casts to."""
    return node.attrs.get("to") if node.op == "Cast" else node.inputs[1].dtype


def _fold(node: Node, operands: list) -> int | float | bool:
    """A template op whose operands are all numbers (`Sub(1, ratio)`), computed here."""
    if node.op == "Constant":
        return node.attrs.get("value_float", node.attrs.get("value_int"))
    if node.op in ("CastLike", "Cast"):
        # A number cast to a tensor's type is rounded to it (ATen's dropout rounds its scale so).
        dtype = _cast_to(node)
        if dtype in TORCH_DTYPES and TORCH_DTYPES[dtype].is_floating_point:
            return torch.tensor(operands[0], dtype=TORCH_DTYPES[dtype]).item()
        return operands[0]
    if node.op not in _NUMBER_OPS:
        raise GraphError(f"{node.name}: a replay's {node.op} of numbers has no Python spelling")
    return _NUMBER_OPS[node.op](*operands)


def _spell(node: Node, operands: list) -> tuple[Callable | None, tuple]:
    """The ATen op and arguments of a template op with a tensor operand. Operands are fx nodes,
    numbers, or Values of earlier template ops (replaced by their fx nodes when placed)."""
    op = node.op
    tensors = [isinstance(a, (fx.Node, Value)) for a in operands]
    if op == "Identity":
        return aten.alias.default, (operands[0],)
    if op in ("Cast", "CastLike"):
        dtype = _cast_to(node)
        if dtype not in TORCH_DTYPES or not tensors[0]:
            raise GraphError(f"{node.name}: a replay's {op} to {dtype} has no ATen spelling")
        return prims.convert_element_type.default, (operands[0], TORCH_DTYPES[dtype])
    if all(tensors):
        if op in _TENSOR_OPS:
            return _TENSOR_OPS[op], tuple(operands)
    elif len(operands) == 2 and op in _SCALAR_OPS:
        if tensors[0]:
            return _SCALAR_OPS[op], tuple(operands)
        if op in _COMMUTATIVE:
            return _SCALAR_OPS[op], (operands[1], operands[0])
        if op == "Sub":
            return aten.rsub.Scalar, (operands[1], operands[0])
    raise GraphError(f"{node.name}: a replay's {op} of {['tensor' if t else 'number' for t in tensors]} "
                     f"has no ATen spelling")

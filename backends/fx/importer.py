"""A torch.fx graph of ATen ops (a joint forward + backward graph) -> the shared IR.

Inductor decomposes ops like gelu and layer_norm into chains of pointwise nodes before
the joint graph exists; each of those nodes keeps `meta["original_aten"]` and the
autograd `seq_nr` of the op it came from. Nodes of one decomposed op instance become
one IR node named after the original op, so `y = Gelu(x)` matches on both backends;
`Node.backend_nodes` lists the fx nodes an IR node stands for.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import fx
import torch._inductor.config as inductor_config

from engine.dtypes import DType
from engine.errors import GraphError
from engine.ir import Graph, Node, SliceSizes, Value
from engine.shapes import free_dims, parse_dim

from .aten_ops import ATEN_TO_ONNX, ATTRIBUTE_ARGS, FILLS, OPERAND_ORDER, SCALAR_OPERANDS, canonical_attributes

# An fx node's meta key for the plan whose rewrite made or tagged it (backends/fx/compile.py): the
# IR node's `plan`.
PLAN = "remat_plan"

_DTYPES = {
    torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
    torch.float64: DType.FLOAT64, torch.int8: DType.INT8, torch.int16: DType.INT16,
    torch.int32: DType.INT32, torch.int64: DType.INT64, torch.uint8: DType.UINT8, torch.bool: DType.BOOL,
    torch.complex64: DType.COMPLEX64, torch.complex128: DType.COMPLEX128,
}
# The torch dtype of each DType, for what the backend writes back into a graph.
TORCH_DTYPES = {ours: theirs for theirs, ours in _DTYPES.items()}


def _dim(d: Any):
    """An int, or a SymInt's expression (`s0*s1`) as a formula."""
    return d if isinstance(d, int) else parse_dim(str(d))


def _value(name: str, example: Any) -> Value:
    if isinstance(example, torch.Tensor):
        return Value(name, _DTYPES.get(example.dtype, DType.UNKNOWN), tuple(_dim(d) for d in example.shape))
    return Value(name)


def _base_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def _group_key(node: fx.Node) -> tuple | None:
    """Nodes that one decomposed op instance became share this key; None for an undecomposed node."""
    original = node.meta.get("original_aten")
    if original is None or original == node.target or node.meta.get("seq_nr") is None:
        return None
    if _base_name(original) not in ATEN_TO_ONNX:
        return None
    # By name: the joint graph's nodes may hold distinct, unequal copies of the same OpOverload.
    return str(original), node.meta["seq_nr"], node.meta.get("partitioner_tag")


def _numel(v: Value) -> int:
    try:
        n = 1
        for d in v.shape or ():
            n *= int(d)
        return n
    except TypeError:
        return 0


def import_fx(source: fx.GraphModule | fx.Graph, forward_outputs: int | None = None,
              fold: bool = True) -> Graph:
    """Placeholders become inputs and the output tuple the outputs. The forward outputs are the
    first `forward_outputs` outputs, or, when None, those a forward-tagged node produces (the
    partitioner's tags in a joint graph), else the first (the loss). With `fold`, the nodes a
    decomposition made of one ATen op become one node again; without it every fx node is one
    IR node (what chunking needs: it slices the decomposed loss op by op). Placeholders named
    `tangents_*` (the incoming gradients of a joint graph) are `Value.tangent`."""
    graph = source.graph if isinstance(source, fx.GraphModule) else source
    values: dict[fx.Node, Any] = {}
    inputs: list[Value] = []
    attributes: list[Value] = []        # get_attr values and literal operands
    nodes: list[Node] = []
    emitted: set[tuple] = set()
    group_members: dict[tuple, list[fx.Node]] = {}
    for fx_node in graph.nodes:
        if fold and fx_node.op == "call_function" and fx_node.target is not operator.getitem:
            key = _group_key(fx_node)
            if key is not None:
                group_members.setdefault(key, []).append(fx_node)
    member_of = {n: key for key, members in group_members.items() for n in members}
    for fx_node in graph.nodes:  # unpacking a member's tuple belongs to the member's group
        if fx_node.op == "call_function" and fx_node.target is operator.getitem and fx_node.args[0] in member_of:
            key = member_of[fx_node.args[0]]
            group_members[key].append(fx_node)
            member_of[fx_node] = key
    # One op instance's nodes are connected: members that share a key but not an edge (the two
    # reshapes of cross_entropy's decomposition, of the logits and of the labels, carry one
    # autograd seq_nr) are separate groups, else they would be folded into one node that reads
    # both and makes a value of neither.
    for key, members in list(group_members.items()):
        parts = _connected(members)
        if len(parts) > 1:
            del group_members[key]
            for k, part in enumerate(parts):
                group_members[(*key, k)] = part
                for m in part:
                    member_of[m] = (*key, k)
    # A group becomes one node at its first member's place, so it must be contiguous in effect:
    # what it reads is produced before it, and what reads it comes after it. Otherwise its
    # nodes are imported one by one.
    position = {n: i for i, n in enumerate(graph.nodes)}
    for key, members in list(group_members.items()):
        member_set = set(members)
        first, last = min(position[m] for m in members), max(position[m] for m in members)
        reads_later = any(position[a] > first for m in members for a in _flat_nodes((m.args, m.kwargs))
                          if a not in member_set)
        read_early = any(position[u] < last for m in members for u in m.users if u not in member_set)
        if reads_later or read_early or (_base_name(members[0].meta["original_aten"]) == "native_dropout"
                                         and _dropout_ratio(members) is None):
            del group_members[key]
            for m in members:
                member_of.pop(m, None)
    # Values produced inside a group and read outside it (or returned) are the group's outputs.
    returned = {a for n in graph.nodes if n.op == "output" for a in _flat_nodes(n.args)}

    for fx_node in graph.nodes:
        example = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            v = _value(fx_node.name, example)
            v.is_input = True
            if fx_node.name.startswith("tangents"):
                v.tangent = True
            values[fx_node] = v
            inputs.append(v)
        elif fx_node.op == "get_attr":      # a module attribute: a chunk's subgraph, a constant
            v = _value(fx_node.name, example)
            v.is_initializer = True
            values[fx_node] = v
            attributes.append(v)
        elif fx_node.op == "call_function" and fx_node.target is operator.getitem and fx_node not in member_of:
            source_node, index = fx_node.args
            outs = values.get(source_node)
            if not isinstance(outs, list) or index >= len(outs):
                raise GraphError(f"{fx_node.name}: getitem {index} of {source_node.name}, which has no such output")
            outs[index].name = fx_node.name
            values[fx_node] = outs[index]
        elif fx_node.op == "call_function" and fx_node in member_of:
            key = member_of[fx_node]
            if key in emitted:
                continue
            members = group_members[key]
            member_set = set(members)
            outside_inputs: list[Value] = []
            for m in members:
                for arg in _flat_nodes((m.args, m.kwargs)):
                    # A symbolic size (a dynamic graph's `rand([4, 4, s0, s0])` in a decomposed
                    # dropout) is the group's shape arithmetic, not an operand of the op it folds
                    # into: taken as one, it stood first, where the dropout's input belongs.
                    if arg not in member_set and values[arg] not in outside_inputs and not _is_size(arg):
                        outside_inputs.append(values[arg])
            produced = [m for m in members if m in returned or any(u not in member_set for u in m.users)]
            outs = [_value(m.name, m.meta.get("val")) for m in produced]
            order = sorted(range(len(outs)), key=lambda i: -_numel(outs[i]))
            outs = [outs[i] for i in order]
            produced = [produced[i] for i in order]
            base = _base_name(members[0].meta["original_aten"])
            if base == "native_dropout":
                outside_inputs, outs, produced = _folded_dropout(members, outside_inputs, outs, produced,
                                                                 attributes)
            node = Node(ATEN_TO_ONNX[base], outside_inputs, outs, _folded_attributes(base, members),
                        produced[0].name if produced else members[0].name,
                        native_op=f"aten::{base}", backend_nodes=[m.name for m in members],
                        scope=_scope(members[0]), plan=next((m.meta[PLAN] for m in members if PLAN in m.meta), None))
            for m, v in zip(produced, outs):
                values[m] = v
            emitted.add(key)
            nodes.append(node)
        elif fx_node.op == "call_function":
            nodes.append(_plain_node(fx_node, values, attributes))
            nodes[-1].plan = fx_node.meta.get(PLAN)
        elif fx_node.op == "output":
            outputs = [values[a] for a in _flat_nodes(fx_node.args)]
            # backends.fx.chunk runs a fixed count of slices whose sizes are SymInts, and writes the
            # shapes it reshapes to from the graph's own sizes (backends.fx.sizes)
            result = Graph(nodes, inputs, outputs, attributes, name="joint", slicing=SliceSizes.FIXED_COUNT,
                           dynamic_reshapes=True, eager_random=bool(inductor_config.fallback_random))
            bounds = dim_bounds(graph)
            result.dim_examples = _planned_sizes(bounds)
            result.dim_traced = {name: traced for name, (traced, _) in bounds.items()}
            result.open_dims = frozenset(name for name, (_, largest) in bounds.items() if largest is None)
            result.constrained_dims = constrained_dims()
            result.unite_sizes(size_facts(graph), smallest_sizes(graph))
            result.forward_outputs = _forward_outputs(fx_node, values, forward_outputs)
            result.verify()
            return result
    raise GraphError("the fx graph has no output node")


def _dim_examples(graph: fx.Graph) -> dict[str, int]:
    """The size each symbol of a dynamic graph (`torch.compile(dynamic=True)`, `mark_dynamic`,
    Dynamo's automatic dynamic shapes) is planned at: the largest the shape environment allows
    where it bounds the symbol (`mark_dynamic(t, dim, min=2, max=2048)`, or a bound Dynamo
    proved), since a plan must fit the longest batch the graph will run; else the size it was
    traced at (`dim_bounds` tells them apart). The rules' guards (`bytes(y) >= 256 KiB`), the
    slice counts and the budget are decided at these sizes, and the plan table shows its
    savings as formulas over the symbols, evaluated there."""
    return _planned_sizes(dim_bounds(graph))


def _planned_sizes(bounds: dict[str, tuple[int, int | None]]) -> dict[str, int]:
    """_dim_examples from `dim_bounds`: each symbol's largest, else its traced size."""
    return {name: largest if largest is not None else traced for name, (traced, largest) in bounds.items()}


def dim_bounds(graph: fx.Graph) -> dict[str, tuple[int, int | None]]:
    """Each symbol of the placeholders' sizes: the size it was traced at, and the largest its
    shape environment allows (None: unbounded)."""
    import sympy

    bounds: dict[str, tuple[int, int | None]] = {}
    for symbol, env in _placeholder_symbols(graph):
        # torch 2.13 / 2.11 (an empty dict where every symbol is unbacked: 2.13 warns on var_to_val)
        hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
        hint = hints.get(symbol)
        upper = getattr(env.var_to_range.get(symbol), "upper", None)
        if hint is None:
            # unbacked (`mark_unbacked`): no traced size; planned at the largest it declares, if any
            if isinstance(upper, sympy.Integer):
                bounds[str(symbol)] = (int(upper), int(upper))
            continue
        largest = int(upper) if isinstance(upper, sympy.Integer) and int(upper) >= int(hint) else None
        bounds[str(symbol)] = (int(hint), largest)
    return bounds


def constrained_dims() -> frozenset[str]:
    """The symbols whose range is a constraint Dynamo checks every guard against when it builds
    the frame's guards, after the backend returned: `mark_dynamic(t, dim, min=, max=)` (and
    export's `Dim`s) make a StrictMinMaxConstraint. Read from the frame Dynamo is compiling now
    (its tracked fakes, each with the constraints of its dims); none outside Dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch.fx.experimental.symbolic_shapes import StrictMinMaxConstraint

        tracked = InstructionTranslator.current_tx().output.tracked_fakes
    except Exception:       # not under Dynamo (make_fx, a test), or a torch that keeps them elsewhere
        return frozenset()
    names: set[str] = set()
    for fake in tracked:
        constraints = getattr(fake.symbolic_context, "constraint_sizes", None) or ()
        for dim, constraint in enumerate(constraints):
            if isinstance(constraint, StrictMinMaxConstraint) and isinstance(fake.fake, torch.Tensor):
                size = fake.fake.size(dim)
                if isinstance(size, torch.SymInt):
                    names |= {str(s) for s in size.node.expr.free_symbols}
    return frozenset(names)


def _placeholder_symbols(graph: fx.Graph) -> Iterator[tuple[Any, Any]]:
    """The symbols of the placeholders' sizes, each with its shape environment."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        for d in val.shape:
            if isinstance(d, torch.SymInt):
                for symbol in d.node.expr.free_symbols:
                    yield symbol, d.node.shape_env


def smallest_sizes(graph: fx.Graph) -> dict[str, int]:
    """Each symbol of the placeholders' sizes and the least its shape environment allows (2 for
    Dynamo's dynamic dims, which specializes 0 and 1)."""
    import sympy

    smallest: dict[str, int] = {}
    for symbol, env in _placeholder_symbols(graph):
        lower = getattr(env.var_to_range.get(symbol), "lower", None)
        if isinstance(lower, sympy.Integer) and int(lower) >= 1:
            smallest[str(symbol)] = int(lower)
    return smallest


def size_facts(graph: fx.Graph) -> list[tuple[Any, Any]]:
    """The equalities among the placeholders' size symbols that Dynamo checks before the graph
    runs (its shape environment's guards: `F.cross_entropy` guards `Eq(s27*s77, s24*s27)` where
    a graph break made Dynamo name the batch of the logits and of the targets apart), as pairs
    of formulas. Torch keeps an equality it cannot turn into a replacement as a guard; the
    importer unites the symbols such facts prove equal (engine.shapes.united_sizes), so the
    engine sees one formula for one size."""
    import sympy

    symbols = list(_placeholder_symbols(graph))
    envs = {id(env): env for _, env in symbols}
    names = {str(symbol) for symbol, _ in symbols}
    facts: list[tuple[Any, Any]] = []
    for env in envs.values():
        for guard in getattr(env, "guards", ()):
            expr = getattr(guard, "expr", None)
            if not isinstance(expr, sympy.Eq) or not expr.free_symbols:
                continue
            sides = (parse_dim(str(expr.lhs)), parse_dim(str(expr.rhs)))
            # sums and products of the inputs' sizes (not FloorDiv or Mod, which parse_dim makes
            # opaque symbols)
            if all(free_dims(side) <= names for side in sides):
                facts.append(sides)
    return facts


def size_sources(graph: fx.Graph) -> dict[str, str]:
    """Each symbol of the placeholders' sizes and the user's name for it where the shape
    environment knows where it came from (Dynamo's source `L['targets'].size()[1]`, written
    `targets.size(1)`), for messages that tell the user what to write."""
    sources: dict[str, str] = {}
    for symbol, env in _placeholder_symbols(graph):
        for source in getattr(env, "var_to_sources", {}).get(symbol, ())[:1]:
            name = source.name() if callable(source.name) else source.name
            sources[str(symbol)] = re.sub(r"^L(?:\['kwargs'\])?\['(\w+)'\]\.size\(\)\[(\d+)\]$", r"\1.size(\2)",
                                          name)       # (a keyword argument: L['kwargs']['input_ids'])
    return sources


def _flat_nodes(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, lambda n: out.append(n))
    return out


def _folded_attributes(base: str, members: list[fx.Node]) -> dict:
    """The attributes of a decomposed op, read back from its parts where they say them: a
    softmax's axis is the dim its max is taken over (Inductor decomposes `_softmax` before the
    joint graph exists, and `Softmax(x, axis=-1)` must still match)."""
    if base == "native_dropout":
        return {"training_mode": True}      # only a training-mode dropout is folded (_dropout_ratio)
    if base in ("_softmax", "_log_softmax"):
        for m in members:
            if _base_name(m.target) == "amax" and len(m.args) > 1:
                dims = m.args[1] if isinstance(m.args[1], (list, tuple)) else [m.args[1]]
                if len(dims) == 1:
                    return {"axis": int(dims[0])}
    return {}


def _is_size(node: fx.Node) -> bool:
    """Whether an fx node's value is a size (an int or SymInt), not a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)


def _dropout_ratio(members: list[fx.Node]) -> float | None:
    """The drop probability of Inductor's decomposition of a training-mode native_dropout,
    `mask = rand(shape) > p; y = mask * x * (1 / (1 - p))`: the number its comparison reads. None
    for anything else (p = 0 or 1, or eval mode, decompose without a comparison of random numbers)."""
    for m in members:
        if (_base_name(m.target) == "gt" and len(m.args) == 2 and isinstance(m.args[1], (int, float))
                and isinstance(m.args[0], fx.Node) and m.args[0] in members
                and _base_name(m.args[0].target) in ("rand", "rand_like")):
            return float(m.args[1])
    return None


def _folded_dropout(members: list[fx.Node], inputs: list[Value], outs: list[Value], produced: list[fx.Node],
                    literals: list[Value]) -> tuple[list[Value], list[Value], list[fx.Node]]:
    """A folded native_dropout as ONNX's Dropout(x, ratio) -> (y, mask), as the undecomposed op
    imports: the ratio the number the comparison reads (a literal), the outputs ordered by what
    they are (the mask is the boolean), not by size."""
    ratio = _literal(f"{members[0].name}_ratio", _dropout_ratio(members), None,
                     tuple(a for m in members for a in m.args))
    literals.append(ratio)
    order = sorted(range(len(outs)), key=lambda i: outs[i].dtype is DType.BOOL)
    return [*inputs, ratio], [outs[i] for i in order], [produced[i] for i in order]


def _connected(members: list[fx.Node]) -> list[list[fx.Node]]:
    """`members` split into the parts their own edges connect, each in graph order."""
    index = {m: i for i, m in enumerate(members)}
    parent = list(range(len(members)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for m in members:
        for a in _flat_nodes((m.args, m.kwargs)):
            if a in index:
                parent[root(index[a])] = root(index[m])
    parts: dict[int, list[fx.Node]] = {}
    for m in members:
        parts.setdefault(root(index[m]), []).append(m)
    return list(parts.values())


def _plain_node(fx_node: fx.Node, values: dict, literals: list[Value]) -> Node:
    example = fx_node.meta.get("val")
    base = _base_name(fx_node.target)
    op = ATEN_TO_ONNX.get(base, f"aten::{base}")
    if base == "native_dropout" and len(fx_node.args) > 2 and fx_node.args[2] is False:
        op = "aten::native_dropout"     # eval mode: no random values, no ONNX Dropout's scaling
    tensor_args, attrs = [], {}
    renames = ATTRIBUTE_ARGS.get(base, {})
    operands = SCALAR_OPERANDS.get(base, ())
    for i, arg in enumerate(fx_node.args):
        if isinstance(arg, fx.Node):
            tensor_args.append(values[arg])
        elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, fx.Node) for a in arg):
            tensor_args.extend(values[a] for a in arg)
        elif i in operands and isinstance(arg, (bool, int, float)):
            literal = _literal(f"{fx_node.name}_arg{i}", arg, example, fx_node.args)
            literals.append(literal)
            tensor_args.append(literal)
        else:
            attrs[renames.get(i, f"arg{i}")] = arg
    for key, arg in fx_node.kwargs.items():
        if isinstance(arg, fx.Node):
            tensor_args.append(values[arg])
        elif key == "dtype" and arg in _DTYPES:
            attrs["to"] = _DTYPES[arg]
        else:
            attrs[key] = arg
    order = OPERAND_ORDER.get(base)
    if order is not None and len(tensor_args) == len(order):
        tensor_args = [tensor_args[i] for i in order]
    first = next((a.meta.get("val") for a in _flat_nodes(fx_node.args)), None)
    attrs = canonical_attributes(base, attrs, first.dim() if isinstance(first, torch.Tensor) else None)
    if isinstance(example, (list, tuple)):
        outs = [_value(f"{fx_node.name}_{k}", e) for k, e in enumerate(example)]
        values[fx_node] = outs
    else:
        outs = [_value(fx_node.name, example)]
        values[fx_node] = outs[0]
        outs[0].filled = _fill(base, attrs)
    original = fx_node.meta.get("original_aten")
    decomposed = original is not None and original != fx_node.target and _base_name(original) in ATEN_TO_ONNX
    return Node(op, tensor_args, outs, attrs, fx_node.name, native_op=f"aten::{base}",
                decomposed_from=ATEN_TO_ONNX[_base_name(original)] if decomposed else None,
                backend_nodes=[fx_node.name], scope=_scope(fx_node))


def _scope(fx_node: fx.Node) -> str | None:
    """The innermost module that made the node (dynamo's `nn_module_stack`), as a dotted path."""
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path[len("L['self']."):] if path.startswith("L['self'].") else path


def _fill(base: str, attrs: dict) -> float | None:
    """The number every element of a fill holds (FILLS), where the op is one and it is a number."""
    fill = FILLS.get(base)
    number = attrs.get(fill) if isinstance(fill, str) else fill
    return float(number) if isinstance(number, (bool, int, float)) else None


def _literal(name: str, number: bool | int | float, example: Any, args: tuple) -> Value:
    """A Python number an ATen op reads as an operand, as a constant 0-d value of the type the
    op computes in (that of its output, or for a comparison, of its tensor operand)."""
    like = example if isinstance(example, torch.Tensor) and example.dtype is not torch.bool else next(
        (a.meta.get("val") for a in args if isinstance(a, fx.Node)), None)
    dtype = _DTYPES.get(like.dtype, DType.UNKNOWN) if isinstance(like, torch.Tensor) else DType.UNKNOWN
    return Value(name, dtype, (), is_initializer=True, data=np.asarray(number), literal=True, filled=float(number))


def _forward_outputs(output: fx.Node, values: dict, count: int | None) -> list[str]:
    args = _flat_nodes(output.args)
    if count is not None:
        return [values[a].name for a in args[:count]]
    tagged = [values[a].name for a in args if a.meta.get("partitioner_tag") == "is_forward"]
    return tagged or [values[a].name for a in args[:1]]     # none for a graph with no output

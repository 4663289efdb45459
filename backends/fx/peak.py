"""The torch path's peak: what the partitioner saves and Inductor gives a buffer, in run order.

The joint graph that remat rewrites is not what runs. Inductor's own joint passes rewrite it
further (its pattern matcher changes the loss's backward), AOTAutograd's min-cut partitioner
splits it into a forward and a backward graph and chooses what the forward saves (recomputing
cheap pointwise ops in the backward on its own), and Inductor fuses pointwise chains so that most
of their values never get a buffer. A liveness walk of the joint graph missed all of that
(the GPT-like step of docs/design.md: 585 MiB estimated, 461 MiB measured). So the estimate runs those
passes and the partitioner itself, on a copy, the way Inductor calls them, joins the forward and
the backward into one step (the backward's saved inputs are the forward's values), and walks it
with `engine.analysis.simulate_peak` under Inductor's rules:

- a view aliases its base; a pointwise op (`torch.Tag.pointwise`, and the ops Inductor lowers as
  pointwise loads) is inlined into the kernel that reads it, unless a reader is neither pointwise
  nor a reduction (a matmul, a fallback kernel, a chunk's subgraph) or the value leaves its
  graph (the loss, what the forward saves, a gradient); everything else is a buffer;
- a freed buffer is handed to the next buffer of the same dtype and size in the same graph, and
  stays allocated until then, but only where holding it keeps the walk under its own peak
  (Inductor's wrapper, `AllocateLine.should_reuse_buffer`);
- a chunk's `invoke_subgraph` call counts its body's peak for one slice.

Checked against the tensors a compiled step holds (`tests/test_torch_peak.py`, the profiler's
allocation events) and the process's measured peak (`bench/torch_step.py`, estimate column).
Where it is off: Inductor judges a reuse by its own estimate, made kernel by kernel after fusion,
which runs higher than this walk, so it holds freed buffers longer than modelled where the
backward recomputes much (`activation_memory_budget=0.1`: 0.76 of the measured peak).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from engine.analysis import MemoryModel, PeakEstimate, simulate_peak
from engine.ir import Node, Value

from .importer import import_fx

_ATEN = torch.ops.aten
# Not tagged pointwise, but Inductor lowers each as one (an indexed or constant load, a copy):
# a pointwise value read only by them is computed inside their kernel.
_INLINED = {_ATEN.embedding.default, _ATEN.full.default, _ATEN.scalar_tensor.default,
            _ATEN.clone.default, _ATEN._to_copy.default, _ATEN.zeros_like.default,
            _ATEN.ones_like.default, _ATEN.full_like.default, torch.ops.prims.iota.default,
            _ATEN.arange.start_step, _ATEN.arange.default, _ATEN.gather.default, _ATEN.index.Tensor,
            _ATEN.constant_pad_nd.default}
_VIEWS = {_ATEN._unsafe_view.default, _ATEN.reshape.default}


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target is operator.getitem and _tuple_of_views(node)
                                           or getattr(target, "is_view", False) or target in _VIEWS)


def _tuple_of_views(node: fx.Node) -> bool:
    source = node.args[0]
    return isinstance(source, fx.Node) and getattr(source.target, "is_view", False)   # split


def _is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _INLINED or torch.Tag.pointwise in getattr(target, "tags", ()))


def _is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.reduction in getattr(node.target, "tags", ())


def fused_away(graph: fx.Graph) -> set[fx.Node]:
    """The pointwise values Inductor inlines into their readers: no buffer of their own."""
    returned = set()
    for node in graph.nodes:
        if node.op == "output":
            fx.node.map_arg(node.args, returned.add)

    def read_by_a_kernel(node: fx.Node) -> bool:
        for user in node.users:
            if user.op == "output" or (_is_view(user) and (user in returned or read_by_a_kernel(user))):
                return True
            if not (_is_view(user) or _is_pointwise(user) or _is_reduction(user)):
                return True
        return False

    return {n for n in graph.nodes if _is_pointwise(n) and n not in returned and not read_by_a_kernel(n)}


@dataclass
class Step:
    """A graph to walk for its peak: a training step (the forward's nodes, then the backward's,
    which read the forward's saved values) or a chunk's body, with what Inductor does to it."""

    module: fx.GraphModule | None
    fused: set[str] = field(default_factory=set)      # values inlined into their readers
    backward: set[str] = field(default_factory=set)   # nodes of the backward graph


def partition(joint: fx.Graph, owner: torch.nn.Module | None) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """The forward and backward graphs the min-cut partitioner makes of `joint` (a copy), the way
    Inductor calls it, and the number of the forward's own outputs: the joint graph's outputs are
    the forward's, then one gradient per `primals_*` input."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    copy_graph = fx.Graph()
    copy_graph.output(copy_graph.graph_copy(joint, {}))
    module = fx.GraphModule(owner if owner is not None else {}, copy_graph)
    primals = sum(1 for n in joint.nodes if n.op == "placeholder" and n.name.startswith("primals"))
    own = len(next(n for n in joint.nodes if n.op == "output").args[0]) - primals
    module = _inductor_joint_passes(module)
    forward, backward = min_cut_rematerialization_partition(module, None, compiler="inductor", num_fwd_outputs=own)
    return forward, backward, own


def _inductor_joint_passes(module: fx.GraphModule) -> fx.GraphModule:
    """Inductor's own joint-graph passes, which run after remat's and before the partitioner
    (its pattern matcher rewrites the loss's backward, among others: measured 585 against 462
    MiB on the GPT-like step without them). remat's pass is off for the call."""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    with inductor_config.patch(joint_custom_pre_pass=None):
        result = joint_graph_passes(module)
    return result if isinstance(result, fx.GraphModule) else module


def step_graph(forward: fx.GraphModule, backward: fx.GraphModule, own_outputs: int) -> Step:
    """One graph that runs `forward`, then `backward` reading the forward's saved values (the
    forward's outputs after its first `own_outputs`); its outputs are the forward's own and the
    gradients."""
    graph = fx.Graph()
    owner = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    step = Step(None)
    saved: dict[str, fx.Node] = {}
    outputs: list[fx.Node] = []
    for part, module in (("fw", forward), ("bw", backward)):
        away = fused_away(module.graph)
        for node in module.graph.nodes:
            if node.op == "placeholder":
                env[node] = saved.get(node.name) or graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
            elif node.op == "output":
                results = [r for r in node.args[0] if isinstance(r, fx.Node)] if part == "bw" else \
                    [r for r in node.args[0][:own_outputs] if isinstance(r, fx.Node)]
                outputs += [env[r] for r in results]
                if part == "fw":
                    saved = {r.name: env[r] for r in node.args[0] if isinstance(r, fx.Node)}
            elif node.op == "get_attr":
                name = f"{part}_{node.target}"
                setattr(owner, name, getattr(module, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
                if node in away:
                    step.fused.add(env[node].name)
                if part == "bw":
                    step.backward.add(env[node].name)
    graph.output(tuple(outputs))
    step.module = fx.GraphModule(owner, graph)
    return step


def step_peak(step: Step) -> int:
    """Bytes alive at the step's highest point above what was allocated before it (weights and
    inputs), with each chunk call counted at its body's peak for one slice."""
    return step_estimate(step).peak_bytes or 0


def step_estimate(step: Step) -> PeakEstimate:
    """step_peak's walk: the bytes at every node of the step, in the order it runs (the curve a
    timeline draws)."""
    module, fused = step.module, step.fused
    view_nodes = {n.name for n in module.graph.nodes if _is_view(n)}
    calls = {n.name: n for n in module.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)}
    graph = import_fx(module, forward_outputs=0, fold=False)

    bodies: dict[str, int] = {}     # by subgraph: every slice calls the same body, and both walks ask

    def body_peak(node: Node) -> int:
        call = calls.get(node.name)
        if call is None:
            return 0
        target = call.args[0].target
        if target not in bodies:
            body = getattr(module, target)
            bodies[target] = step_peak(Step(body, {n.name for n in fused_away(body.graph)}))
        return bodies[target]

    def storage(v: Value) -> tuple | None:
        """Inductor hands a freed buffer to the next one of the same dtype and storage size in
        the same graph (codegen/wrapper.py, buffer_reuse_key), most recently freed first; the
        freed buffer stays allocated until then."""
        if v.name in fused or not v.nbytes:
            return None
        return (v.name in step.backward, v.dtype, v.nbytes)

    model = MemoryModel(
        alias_ops=frozenset(n.op for n in graph.nodes if n.name in view_nodes),
        size_of=lambda v: 0 if v.name in fused else None,
        reuse_key=storage,
        reuse_keeps_peak=True,
        transient=lambda node, size: max(0, body_peak(node) - sum(size(o) for o in node.outputs if o is not None)),
    )
    return simulate_peak(graph, model=model)


def estimated_step_peak(joint: fx.Graph, owner: torch.nn.Module | None = None) -> int:
    """The peak of one training step of `joint` as torch.compile with Inductor runs it."""
    return estimated_step(joint, owner).peak_bytes or 0


def estimated_step(joint: fx.Graph, owner: torch.nn.Module | None = None) -> PeakEstimate:
    """estimated_step_peak's walk, with the bytes at every node of the step."""
    return step_estimate(step_graph(*partition(joint, owner if owner is not None else joint.owning_module)))

"""The torch path's peak: what the partitioner saves and Inductor gives a buffer, in run order.

The joint graph that remat rewrites is not what runs. Inductor's own joint passes rewrite it
further (its pattern matcher changes the loss's backward), AOTAutograd's min-cut partitioner
splits it into a forward and a backward graph and chooses what the forward saves (recomputing
cheap pointwise ops in the backward on its own), and Inductor fuses pointwise chains so that most
of their values never get a buffer. A liveness walk of the joint graph missed all of that
(the GPT-like step of docs/design.md: 585 MiB estimated, 461 MiB measured). So the estimate runs
the partitioner itself, on a copy, the way Inductor calls it (of Inductor's joint passes it runs
`remove_noop_ops` and the early patterns, the pointless views and the view and permute pairs
that undo each other (Falcon's scores: 28.0 MiB estimated without them, 37.9 run), and models one pattern,
`_scatter_upon_constant`: running them all was half of each simulation's time, and gave the same
estimate on every other rewrite measured), joins the forward and
the backward into one step (the backward's saved inputs are the forward's values), makes of it
the program Inductor runs (`program`: kernels and buffers) and walks that with
`engine.analysis.simulate_peak` under Inductor's memory planning (`inductor_memory`):

- buffers: a view aliases its base; a pointwise value is computed inside each kernel that reads
  it, and what it reads lives until then, unless Inductor's lowering gives it a buffer
  (`fused_away`: a reader that is neither pointwise, a reduction nor a scatter, the value
  leaving its graph, or a chain too costly to compute again in each of several readers); an
  add of a matmul's product is the matmul's own output (Inductor's addmm pattern);
- order: Inductor's scheduler fuses kernels over the same loop that touch the same elements of
  a buffer, unless they are far apart or fusing would keep two same-size buffers alive that each
  alone would free (on CPU, a sum over leading dims, a bias gradient, fuses with no pointwise
  kernel), and runs each fused kernel after what it reads (`_schedule`), which moves a
  later kernel up to an earlier one; a cat writes each input into its slice as it comes;
- memory: a generated kernel writes over a buffer it reads last, of its size, at its own index
  (`Scheduler.decide_inplace_update`), in the backward over a saved value only where AOTAutograd
  donated it (`Step.donated`); a freed buffer goes to the next of the same dtype and size in
  the same graph, held until then only where that keeps the graph's estimated peak
  (`AllocateLine.should_reuse_buffer`), an estimate that counts a chunk call by its outputs; a
  chunk's `invoke_subgraph` call counts its body's peak for one slice, on top of what is held.

Found by comparing, allocation by allocation, Inductor's generated code (its `empty_strided`,
`del` and `# reuse` lines give the live set exactly; they match the profiler's allocation
events to the byte) with this walk, on the GPT-like steps of `bench/torch_step.py`. Checked
against the tensors a compiled step holds (`tests/test_torch_peak.py`, the profiler's
allocation events) and the process's measured peak (`bench/torch_step.py`, estimate column).
The order is an approximation of Inductor's scheduler (its fusion rules are the backend's, its
peak-memory reordering is not modelled), so the reuse decisions it drives can differ.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for

from engine.analysis import MemoryModel, PeakEstimate, simulate_peak
from engine.dtypes import DType
from engine.ir import Graph, Node, Value
from engine.shapes import Dim, evaluate, numel

from .aten_ops import slice_arguments
from .importer import _DTYPES, PLAN, _dim, _dim_examples
from .modules import working_module
from .normalize import inductor_early_patterns

_ATEN = torch.ops.aten
# Not tagged pointwise, but Inductor lowers each as one (an indexed or constant load, a copy):
# a pointwise value read only by them is computed inside their kernel.
_INLINED = {_ATEN.embedding.default, _ATEN.full.default, _ATEN.scalar_tensor.default,
            _ATEN.clone.default, _ATEN._to_copy.default, _ATEN.zeros_like.default,
            _ATEN.ones_like.default, _ATEN.full_like.default, torch.ops.prims.iota.default,
            _ATEN.arange.start_step, _ATEN.arange.default, _ATEN.gather.default, _ATEN.index.Tensor,
            _ATEN.constant_pad_nd.default, _ATEN.slice_scatter.default}
_VIEWS = {_ATEN._unsafe_view.default, _ATEN.reshape.default}
# Inductor's lowering gives a pointwise value a buffer, rather than computing it again in each of
# several readers, where its inlined chain holds one of these ops on CPU, more than
# `_OPS_ON_REUSE` ops or reads more than `_READS_ON_REUSE` buffers (StorageBox.should_realize_on_reuse,
# config.realize_reads_threshold), and in any case where it reads more than `_READS_REALIZED`
# (config.realize_acc_reads_threshold).
_HEAVY = {_ATEN.exp.default, _ATEN.log.default, _ATEN.log10.default, _ATEN.log1p.default, _ATEN.log2.default,
          _ATEN.sigmoid.default, _ATEN.tanh.default}
_OPS_ON_REUSE = 30
_READS_ON_REUSE = 4
_READS_REALIZED = 8
# Inductor does not fuse kernels further apart than this in its original order
# (Scheduler.are_long_distant_nodes): fusing them would stretch what lives between.
_FUSION_DISTANCE = 64
_COPIES = {_ATEN.clone.default, _ATEN._to_copy.default}
_GATHERS = {_ATEN.embedding.default, _ATEN.gather.default, _ATEN.index.Tensor}
# Generated kernels that write elements at computed positions (Inductor's Scatter): like a
# reduction, they compute the pointwise values they read inside themselves.
_SCATTERS = {_ATEN.index_put.default, _ATEN.index_put_.default, _ATEN._unsafe_index_put.default,
             _ATEN._unsafe_masked_index_put_accumulate.default, _ATEN.scatter.src, _ATEN.scatter.value,
             _ATEN.scatter_add.default, _ATEN.index_add.default}


# What a size computation gives (`sym_size`, arithmetic on sizes): no buffer.
_SIZES = (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target is operator.getitem and _tuple_of_views(node)
                                           or getattr(target, "is_view", False) or target in _VIEWS)


def _tuple_of_views(node: fx.Node) -> bool:
    source = node.args[0]
    return isinstance(source, fx.Node) and getattr(source.target, "is_view", False)   # split


def _is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target in _INLINED or torch.Tag.pointwise in getattr(target, "tags", ())
                                           or _scatter_upon_constant(node))


def _scatter_upon_constant(node: fx.Node) -> bool:
    """A scalar scattered onto a `full` at one index per row (a one-hot): Inductor's joint-graph
    pattern `scatter_upon_const_tensor` makes it a pointwise `where(iota == index, value, fill)`,
    so it is computed inside its readers (the cross-entropy backward's one-hot). The peak model
    does not run Inductor's pattern passes (`_remove_noop_ops`), so it models this one."""
    if node.target is not _ATEN.scatter.value:
        return False
    import torch._inductor.config as inductor_config

    if not inductor_config.optimize_scatter_upon_const_tensor:
        return False
    full, dim, selector = node.args[0], node.args[1], node.args[2]
    if not (isinstance(full, fx.Node) and full.target is _ATEN.full.default and len(full.users) == 1
            and isinstance(selector, fx.Node) and isinstance(dim, int)):
        return False
    shape, index = full.meta.get("val"), selector.meta.get("val")
    if not (isinstance(shape, torch.Tensor) and isinstance(index, torch.Tensor) and index.dim() == shape.dim()):
        return False
    dim = dim + shape.dim() if dim < 0 else dim
    return index.shape[dim] == 1 and all(i >= f for d, (i, f) in enumerate(zip(index.shape, shape.shape)) if d != dim)


def _is_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.reduction in getattr(node.target, "tags", ())


def _reduces_inner_dims(node: fx.Node) -> bool:
    """Whether a reduction's reduced dims are its input's last ones (a row's sum, not a
    column's), size-1 dims aside: Inductor's loop for it is then the rows outside and the
    reduction inside, the loop a pointwise kernel over the input runs too."""
    source = node.args[0] if node.args else None
    example = source.meta.get("val") if isinstance(source, fx.Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(example, torch.Tensor) or dims is None or example.dim() == 0:
        return True
    rank = example.dim()
    dims = {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
    sizes = [d for d in range(rank) if example.shape[d] != 1]
    reduced = [d in dims for d in sizes]
    return reduced == sorted(reduced)          # every kept dim before every reduced one


def fused_away(graph: fx.Graph) -> set[fx.Node]:
    """The pointwise values Inductor inlines into their readers: no buffer of their own.

    A pointwise value gets a buffer where a reader is neither pointwise nor a reduction (a
    matmul, a fallback kernel, a chunk's subgraph) or it leaves the graph, and, as Inductor's
    lowering decides (GraphLowering.run_node), where the chain inlined into it reads too many
    buffers (`_READS_REALIZED`), or it has several readers and the chain would be computed again
    in each: a chain with a costly op on CPU (`_HEAVY`), many ops, or more than
    `_READS_ON_REUSE` buffers read."""
    returned = set()
    for node in graph.nodes:
        if node.op == "output":
            fx.node.map_arg(node.args, returned.add)

    def read_by_a_kernel(node: fx.Node) -> bool:
        for user in node.users:
            if user.op == "output" or (_is_view(user) and (user in returned or read_by_a_kernel(user))):
                return True
            if not (_is_view(user) or _is_pointwise(user) or _is_reduction(user) or user.target in _SCATTERS):
                return True
        return False

    def readers(node: fx.Node) -> int:
        """Its users, or a view's, whichever is most (Inductor marks a reused view's base)."""
        return max([len(node.users)] + [readers(u) for u in node.users if _is_view(u)])

    folded = _addmm_folds(graph)
    fused: set[fx.Node] = set()
    chain: dict[fx.Node, tuple[frozenset, int, bool]] = {}   # buffers read, ops, a costly op
    for n in graph.nodes:
        if _is_view(n):
            chain[n] = chain.get(n.args[0], (frozenset([n]), 0, False)) if n.args and isinstance(
                n.args[0], fx.Node) else (frozenset([n]), 0, False)
            continue
        if not _is_pointwise(n) or n in returned or n in folded or read_by_a_kernel(n):
            chain[n] = (frozenset([n]), 0, False)
            continue
        reads, ops, heavy = frozenset(), 1, n.target in _HEAVY and _on_cpu(n)
        for a in n.all_input_nodes:
            r, o, h = chain.get(a, (frozenset([a]), 0, False))
            reads, ops, heavy = reads | r, ops + o, heavy or h
        if len(reads) > _READS_REALIZED or readers(n) > 1 and (heavy or ops > _OPS_ON_REUSE
                                                                 or len(reads) > _READS_ON_REUSE):
            chain[n] = (frozenset([n]), 0, False)
            continue
        chain[n] = (reads, ops, heavy)
        fused.add(n)
    return fused


def _addmm_folds(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """The adds Inductor's post-grad pass folds into the matmul that feeds them, as addmm
    (fx_passes/post_grad.py, `addmm`): add(mm(a, b), c) with the mm read by nothing else, same
    dtypes, c broadcastable to the product; on a GPU only where a reader of the sum is not
    pointwise. By the add, its mm."""
    folds = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _ATEN.add.Tensor or len(n.args) != 2 or n.kwargs:
            continue
        for mm, other in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            if not (isinstance(mm, fx.Node) and mm.target is _ATEN.mm.default and len(mm.users) == 1
                    and isinstance(other, fx.Node)):
                continue
            out, c = mm.meta.get("val"), other.meta.get("val")
            if not (isinstance(out, torch.Tensor) and isinstance(c, torch.Tensor) and c.dtype == out.dtype
                    and all(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == out.dtype
                            for a in mm.all_input_nodes)):
                continue
            try:
                if tuple(torch.broadcast_shapes(c.shape, out.shape)) != tuple(out.shape):
                    continue
            except RuntimeError:
                continue
            if not _on_cpu(n) and all(_is_pointwise(u) for u in n.users):
                continue
            folds[n] = mm
            break
    return folds


def _on_cpu(node: fx.Node) -> bool:
    example = node.meta.get("val")
    return isinstance(example, torch.Tensor) and example.device.type == "cpu"


@dataclass
class Step:
    """A graph to walk for its peak: a training step (the forward's nodes, then the backward's,
    which read the forward's saved values) or a chunk's body, with what Inductor does to it."""

    module: fx.GraphModule | None
    fused: set[str] = field(default_factory=set)      # values inlined into their readers
    backward: set[str] = field(default_factory=set)   # nodes of the backward graph
    # Views the forward saves for the backward: there an input of its own shape, which a backward
    # kernel writes over only where it has as many elements as the kernel's output (Inductor
    # reuses an input buffer of the same size; at a dynamic length the partitioner saves the
    # label shift's `logits[:, :-1]`, a row short of the gradient written from it)
    saved_views: set[str] = field(default_factory=set)
    # Whether AOTAutograd donates the saved values to the backward (functorch's `donated_buffer`),
    # so that a backward kernel may write over one it reads last. remat turns donation off for a
    # graph with a two-phase chunk region (backends/fx/compile.py); then Inductor's backward
    # writes only over its own buffers (Scheduler's in-place update reads donated inputs alone),
    # and a gradient as large as a saved value is allocated beside it: the GPT-like step's loss
    # gradient, 64 MiB beside the saved log-probabilities, at the backward's first kernel.
    donated: bool = True


def partition(joint: fx.Graph, owner: torch.nn.Module | None) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """The forward and backward graphs the min-cut partitioner makes of `joint` (a copy), the way
    Inductor calls it, and the number of the forward's own outputs: the joint graph's outputs are
    the forward's, then one gradient per `primals_*` input."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    copy_graph = fx.Graph()
    copy_graph.output(copy_graph.graph_copy(joint, {}))
    module = working_module(owner if owner is not None else {}, copy_graph)
    primals = sum(1 for n in joint.nodes if n.op == "placeholder" and n.name.startswith("primals"))
    own = len(next(n for n in joint.nodes if n.op == "output").args[0]) - primals
    _joint_passes_on_bodies(module)
    _remove_noop_ops(module)
    inductor_early_patterns(module.graph)
    module.graph.eliminate_dead_code()
    forward, backward = min_cut_rematerialization_partition(module, None, compiler="inductor", num_fwd_outputs=own)
    return forward, backward, own


def _joint_passes_on_bodies(module: fx.GraphModule) -> None:
    """Run Inductor's joint-graph passes on copies of the subgraphs `module` calls (remat's chunk
    bodies), as Inductor does after the joint passes that made them and before it partitions
    (`_recursive_joint_graph_passes`: new subgraphs get a round of their own). Their rewrites
    change what a body holds: on the GPT-like step (vocab 4096) a choice simulated at 169.6 MiB
    without them and at 191.7 with them, and the compile ran at 191.0. A body several calls
    share is rewritten once; remat's own pass is not run on it (it leaves bodies alone)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    names = sorted({n.target for n in module.graph.nodes
                    if n.op == "get_attr" and isinstance(getattr(module, n.target, None), fx.GraphModule)})
    if not names:
        return
    rewritten: dict[int, fx.GraphModule] = {}
    with inductor_config.patch(joint_custom_pre_pass=None, joint_custom_post_pass=None):
        for name in names:
            body = getattr(module, name)
            if id(body) not in rewritten:
                rewritten[id(body)] = _joint_passes(body, joint_graph_passes)
            setattr(module, name, rewritten[id(body)])


def _joint_passes(body: fx.GraphModule, joint_graph_passes) -> fx.GraphModule:
    """A copy of `body` after Inductor's joint passes, run in the fake mode of its inputs (as
    inside a compile: a pattern's replacement is traced on them); `body` itself where they fail
    (the estimate then is the body as remat built it)."""
    import contextlib
    import copy

    from torch._guards import detect_fake_mode

    values = [node.meta.get("val") for node in body.graph.find_nodes(op="placeholder")]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    try:
        copied = copy.deepcopy(body)
        with mode if mode is not None else contextlib.nullcontext():
            return joint_graph_passes(copied, device)
    except Exception:       # the peak model's fidelity, never the step: the body as built
        return body


def _remove_noop_ops(module: fx.GraphModule) -> None:
    """The one joint pass of Inductor's the walk needs run rather than modelled: it drops ops
    that copy or alias their input unchanged (a clone, a same-dtype convert, a view to the same
    shape), which would otherwise be buffers of their own (the GPT-like step: 522 MiB without it,
    462 with it and with every joint pass). The others (pattern rewrites, constant folding) cost
    half of each simulation and change nothing the walk counts but `_scatter_upon_constant`."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    remove_noop_ops(module.graph)
    module.graph.eliminate_dead_code()


def step_graph(forward: fx.GraphModule, backward: fx.GraphModule, own_outputs: int,
               donated: bool | None = None) -> Step:
    """One graph that runs `forward`, then `backward` reading the forward's saved values (the
    forward's outputs after its first `own_outputs`); its outputs are the forward's own and the
    gradients. `donated`: whether the saved values are donated to the backward (Step.donated);
    by default as torch is set now (right after the partitioner, the setting it compiles with)."""
    import torch._functorch.config as functorch_config

    graph = fx.Graph()
    owner = torch.nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    step = Step(None, donated=bool(functorch_config.donated_buffer) if donated is None else donated)
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
                    step.saved_views = {env[r].name for r in node.args[0][own_outputs:]
                                        if isinstance(r, fx.Node) and _is_view(env[r])}
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
    step.module = working_module(owner, graph)
    return step


def program(step: Step, examples: dict[str, int]) -> tuple[Graph, dict[str, fx.Node]]:
    """The step as Inductor runs it: one node per kernel, in the order Inductor's scheduler runs
    them (`_schedule`), reading and writing buffers. A view stands for its base's buffer and a
    fused value for the buffers its chain reads (Inductor computes it inside each kernel that
    reads it, so what it reads lives until then). A cat is one kernel per input, each writing its
    slice of the output, which the first to run allocates (ConcatKernel). A kernel that writes
    element by element where it reads (`_writes_in_place`) lists in `meta["overwrites"]` the
    buffers it reads at its output's index, which it may write over where it reads them last.
    Sizes are weighed at `examples` (a dynamic graph's traced or declared sizes). Returns the
    program and, by kernel name, the fx node each runs."""
    module, fused = step.module, step.fused
    folds = _addmm_folds(module.graph)
    folded = {mm: add for add, mm in folds.items()}
    reads: dict[fx.Node, list[Value]] = {}          # the buffers an fx value stands for
    # ... and how it reads them: (buffer, the views between that move elements), so that two
    # kernels reading different slices of a buffer do not count as sharing it.
    access: dict[fx.Node, frozenset] = {}
    outputs_of: dict[fx.Node, list[Value | None]] = {}
    kernels: list[_Kernel] = []
    inputs: list[Value] = []
    returned: list[Value] = []
    runs: dict[str, fx.Node] = {}

    def same_index(arg: fx.Node, numel: int, backward: bool) -> list[Value]:
        """The buffers `arg` reads at the same element index as a result of `numel` elements
        (a kernel of the `backward` graph's, where a saved view is an input of its own size)."""
        if _moves_elements(arg):
            return []             # a permute, an expand, a slice: another index
        if backward and arg.name in step.saved_views and _example_numel(arg.meta.get("val")) != numel:
            return []
        if _is_view(arg) or arg.name in fused:
            return _union(same_index(a, numel, backward) for a in arg.all_input_nodes)
        return [v for v in reads.get(arg, []) if _numel(v) == numel]

    for n in module.graph.nodes:
        if n.op == "placeholder":
            v = _buffer(n.name, n.meta.get("val"))
            v.is_input = True
            inputs.append(v)
            reads[n] = [v]
            access[n] = frozenset([(id(v), ())])
        elif n.op == "get_attr" or isinstance(n.meta.get("val"), _SIZES):
            # a size read (`sym_size(logits, 0)` at a dynamic length) reads no buffer: Inductor
            # computes it from the shapes it knows, and it keeps no tensor alive
            reads[n] = []
            access[n] = frozenset()
        elif n.op == "output":
            returned = _union(reads[a] for a in _flat_nodes(n.args))
        elif n.target is operator.getitem and n.args[0] in outputs_of:
            out = outputs_of[n.args[0]][n.args[1]]
            reads[n] = [out] if out is not None else []
            access[n] = frozenset((id(o), ()) for o in reads[n])
        elif n in folded:              # computed by the addmm its add becomes
            reads[n] = _union(reads[a] for a in n.all_input_nodes)
            access[n] = frozenset().union(*(access[a] for a in n.all_input_nodes))
        elif _is_view(n) or n.name in fused:
            reads[n] = _union(reads[a] for a in n.all_input_nodes)
            access[n] = frozenset().union(*(access[a] for a in n.all_input_nodes))
            if _moves_elements(n):
                moved = (str(n.target), repr([a for a in n.args[1:] if not isinstance(a, fx.Node)]))
                access[n] = frozenset((buffer, path + (moved,)) for buffer, path in access[n])
            elif n.target in _GATHERS and isinstance(n.args[0], fx.Node):   # elements its index picks
                source = n.args[0]
                access[n] = frozenset((buffer, path + (n.name,)) for buffer, path in access[source]).union(
                    *(access[a] for a in n.all_input_nodes if a is not source))
        else:
            example = n.meta.get("val")
            if example is None and any(u.target is operator.getitem for u in n.users):
                # a tuple without its own meta (a fresh multi-output node): its items' vals
                items = {u.args[1]: u.meta.get("val") for u in n.users if u.target is operator.getitem}
                example = [items.get(k) for k in range(max(items) + 1)]
            many = isinstance(example, (list, tuple))
            outs = [_buffer(f"{n.name}_{k}" if many else n.name, e) if isinstance(e, torch.Tensor) else None
                    for k, e in enumerate(example if many else [example])]
            outputs_of[n] = outs
            reads[n] = [o for o in outs if o is not None]
            access[n] = frozenset((id(o), ()) for o in reads[n])
            touched = frozenset().union(*(access[a] for a in n.all_input_nodes)) | access[n]
            backward = n.name in step.backward
            runs[n.name] = n
            if n.target is _ATEN.cat.default and isinstance(n.args[0], (list, tuple)) and len(reads[n]) == 1:
                for k, piece in enumerate(n.args[0]):
                    name = n.name if k == 0 else f"{n.name}_slice{k}"
                    kernels.append(_Kernel(name, n, list(reads.get(piece, [])), [], backward, "copy",
                                           _numel(reads[n][0]), access.get(piece, frozenset()), cat=reads[n][0]))
                    runs[name] = n
                continue
            kind = "extern" if n in folds else _kind(n)
            inputs_read = _union(reads[a] for a in n.all_input_nodes)
            size = (max((_numel(v) for v in inputs_read), key=lambda d: _count(d, examples), default=0)
                    if kind == "reduction" else _numel(reads[n][0]) if reads[n] else None)
            kernel = _Kernel(n.name, n, inputs_read, reads[n], backward, kind, size, touched,
                             apart=kind == "reduction" and _on_cpu(n) and not _reduces_inner_dims(n))
            if kind != "extern" and _writes_in_place(n) and len(reads[n]) == 1:
                by_index = _read_at_index(n, fused, reads, step.saved_views if backward else set())
                if by_index is not None:
                    kernel.overwrites = [v for v, same in by_index.values() if same and _numel(v) == _numel(reads[n][0])]
                else:
                    elsewhere = {buffer for buffer, path in touched if path}    # read at another index too
                    kernel.overwrites = [v for v in _union(same_index(a, _numel(reads[n][0]), backward)
                                                           for a in n.all_input_nodes) if id(v) not in elsewhere]
            kernels.append(kernel)
    if not step.donated:
        # The backward writes over none of the forward's buffers (Step.donated).
        forward_made = {id(v) for k in kernels if not k.backward for v in [*k.outputs, k.cat] if v is not None}
        for kernel in kernels:
            if kernel.backward:
                kernel.overwrites = [v for v in kernel.overwrites if id(v) not in forward_made]
    nodes = []
    allocated: set[int] = set()
    for group in _schedule(kernels, examples):
        # Pointwise kernels fused into one (the ReLU and its backward): Inductor's own estimate of
        # the peak, which decides what its wrapper reuses, counts their buffers at once.
        fused_kernel = group[0].name if len(group) > 1 and all(k.kind == "pointwise" for k in group) else None
        for kernel in group:
            node = Node(str(kernel.fx.target), list(kernel.inputs), list(kernel.outputs), name=kernel.name,
                        plan=kernel.fx.meta.get(PLAN))
            if kernel.cat is not None:     # the first slice to run allocates the cat's output
                (node.inputs if id(kernel.cat) in allocated else node.outputs).append(kernel.cat)
                allocated.add(id(kernel.cat))
            node.meta["backward"] = kernel.backward
            node.meta["overwrites"] = kernel.overwrites
            node.meta["kernel"] = fused_kernel
            nodes.append(node)
    return Graph(nodes, inputs, returned, name="inductor"), runs


@dataclass
class _Kernel:
    """One kernel of the program, for `_schedule`: what it reads and writes, and the loop it runs
    (`size`: the elements it iterates over, for a reduction its input's)."""

    name: str
    fx: fx.Node
    inputs: list[Value]
    outputs: list[Value]
    backward: bool
    kind: str                   # "pointwise", "reduction", "scatter", "copy" (a cat's slice), "extern"
    size: int | None
    access: frozenset           # (buffer, views between) it reads or writes
    cat: Value | None = None    # the cat output a slice writes into
    overwrites: list[Value] = field(default_factory=list)
    # A reduction over its input's leading dims (a column's sum, a bias gradient) on CPU: Inductor's
    # C++ backend fuses it with no pointwise kernel (CppScheduling._why_fuse_nodes: the pointwise
    # loop's vars are not the reduction's vars and reduced dims in that order).
    apart: bool = False


def _kind(node: fx.Node) -> str:
    if _is_pointwise(node):
        return "pointwise"
    if _is_reduction(node):
        return "reduction"
    return "scatter" if node.target in _SCATTERS else "extern"


def _schedule(kernels: list[_Kernel], examples: dict[str, int]) -> list[list[_Kernel]]:
    """The order Inductor's scheduler runs `kernels` in (given in the graph's order). It fuses
    kernels over the same loop that share a buffer (Scheduler.fuse_nodes): a kernel with one that
    reads what it writes, or two that read the same buffer at most `_FUSION_DISTANCE` apart; the
    pairs sharing the most elements first; never two that a kernel outside them runs between.
    It sorts the fused kernels by their first member and runs each after the kernels it reads,
    visiting those by buffer name (Scheduler.topological_sort_schedule). Sizes are compared as
    formulas, as Inductor compares them; they are weighed at `examples`, the traced sizes."""
    count = len(kernels)
    made_by: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for o in k.outputs:
            made_by[id(o)] = i
    slices: dict[int, list[int]] = {}
    for i, k in enumerate(kernels):
        if k.cat is not None:
            slices.setdefault(id(k.cat), []).append(i)
    deps: list[set[int]] = []
    for i, k in enumerate(kernels):
        needs = {made_by[id(v)] for v in k.inputs if id(v) in made_by}
        for v in k.inputs:               # a cat's readers wait for every slice
            needs.update(slices.get(id(v), ()))
        needs.discard(i)
        deps.append(needs)
    ancestors = [0] * count
    for i in range(count):
        for j in deps[i]:
            ancestors[i] |= ancestors[j] | (1 << j)
    descendants = [0] * count
    for i in reversed(range(count)):
        for j in deps[i]:
            descendants[j] |= descendants[i] | (1 << i)

    def reduced(k: _Kernel) -> int | None:
        return (_numel(k.outputs[0]) if k.outputs else None) if k.kind == "reduction" else None

    def fusable(a: _Kernel, b: _Kernel) -> bool:
        """Same loop: the elements iterated, and for reductions the elements kept."""
        ra, rb = reduced(a), reduced(b)
        return (a.backward == b.backward and a.size is not None and a.size == b.size
                and a.kind in ("pointwise", "reduction") and b.kind in ("pointwise", "reduction")
                and (ra is None or rb is None or ra == rb)
                and not ((a.apart or b.apart) and "pointwise" in (a.kind, b.kind)))

    users: dict[tuple, list[int]] = {}
    sizes: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for key in k.access:
            users.setdefault(key, []).append(i)
        for v in list(k.inputs) + list(k.outputs):
            sizes[id(v)] = _count(v.numel, examples)
    shared: dict[tuple[int, int], int] = {}
    for key, who in users.items():
        for x in range(len(who)):
            for y in range(x + 1, len(who)):
                a, b = who[x], who[y]
                if fusable(kernels[a], kernels[b]):
                    shared[(a, b)] = shared.get((a, b), 0) + sizes.get(key[0], 0)
    pairs = sorted(shared, key=lambda ab: (-shared[ab], ab[1] - ab[0], ab))
    group = list(range(count))                       # kernel -> its group's first member
    members = {i: [i] for i in range(count)}
    mask = {i: 1 << i for i in range(count)}
    kept = {i: {reduced(k)} - {None} for i, k in enumerate(kernels)}    # a reduction group's kept elements
    below = {i: descendants[i] for i in range(count)}
    above = {i: ancestors[i] for i in range(count)}
    readers: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for v in set(map(id, k.inputs)):
            readers[v] = readers.get(v, 0) | 1 << i
    values = {id(v): v for k in kernels for v in list(k.inputs) + list(k.outputs)}

    def grows_peak(ga: int, gb: int) -> bool:
        """Scheduler.can_fusion_increase_peak_memory: each fused kernel alone would free a buffer
        only it reads, which one of the other's size could take; fused, both live at once."""
        def freed(g: int) -> set:
            made = {id(o) for m in members[g] for o in kernels[m].outputs}
            return {(values[v].dtype, _numel(values[v])) for m in members[g] for v in map(id, kernels[m].inputs)
                    if not readers.get(v, 0) & ~mask[g] and v not in made and values[v].nbytes}
        overhead = sum(_count(numel, examples) for _, numel in freed(ga) & freed(gb))
        if not overhead:
            return False
        common = set().union(*(kernels[m].access for m in members[ga])) & set().union(
            *(kernels[m].access for m in members[gb]))
        saving = sum(_count(values[v].nbytes, examples) for v, _ in common if v in values)
        return overhead > 32 * saving

    for _ in range(10):
        changed = False
        for a, b in pairs:
            ga, gb = sorted((group[a], group[b]))
            if ga == gb or len(kept[ga] | kept[gb]) > 1:
                continue
            vertical = bool(above[gb] & mask[ga]) or bool(above[ga] & mask[gb])
            if not vertical and max(members[gb]) - min(members[ga]) > _FUSION_DISTANCE:
                continue
            outside = ~(mask[ga] | mask[gb])
            if below[ga] & above[gb] & outside or below[gb] & above[ga] & outside:
                continue             # a kernel between them would have to run inside the fused one
            if grows_peak(ga, gb):
                continue
            kept[ga] |= kept.pop(gb)
            members[ga] = sorted(members[ga] + members.pop(gb))
            for m in members[ga]:
                group[m] = ga
            mask[ga] |= mask.pop(gb)
            below[ga] |= below.pop(gb)
            above[ga] |= above.pop(gb)
            changed = True
        if not changed:
            break
    needs = {g: sorted({group[d] for m in ms for d in deps[m]} - {g}, key=lambda d: f"buf{d}")
             for g, ms in members.items()}
    seen: set[int] = set()
    order: list[int] = []
    for start in sorted(members):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(needs[start]))]
        while stack:
            current, pending = stack[-1]
            for d in pending:
                if d not in seen:
                    seen.add(d)
                    stack.append((d, iter(needs[d])))
                    break
            else:
                stack.pop()
                order.append(current)
    return [[kernels[m] for m in members[g]] for g in order]


def _flat_nodes(args) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out


def _buffer(name: str, example) -> Value:
    if isinstance(example, torch.Tensor):
        return Value(name, _DTYPES.get(example.dtype, DType.UNKNOWN), tuple(_dim(d) for d in example.shape))
    return Value(name)


def _example_numel(example) -> Dim | None:
    """The elements of a node's example value (a formula at dynamic sizes); None for a non-tensor."""
    return numel(tuple(_dim(d) for d in example.shape)) if isinstance(example, torch.Tensor) else None


def _numel(v: Value) -> Dim | None:
    """A buffer's elements, at dynamic sizes a formula over the graph's symbols: Inductor decides
    fusion, reuse and in-place writes on sizes it knows equal for every size (sizevars), so two
    buffers of `s0*512` elements match and one of `512*s1` does not, whatever the traced sizes."""
    return v.numel


def _count(size: Dim | None, examples: dict[str, int]) -> int:
    """`size` at the traced sizes, for weighing (0 unknown)."""
    return (evaluate(size, examples) or 0) if size is not None else 0


def _union(groups) -> list[Value]:
    seen: dict[int, Value] = {}
    for group in groups:
        for v in group:
            seen.setdefault(id(v), v)
    return list(seen.values())


class _Symbolic(Exception):
    """A size or stride on the way is a formula: _read_at_index leaves the kernel to the rule by
    views (program's same_index)."""


def _static_tensor(val) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in (*val.shape, *val.stride(),
                                                                              val.storage_offset()))


def _read_at_index(node: fx.Node, fused: set[str], reads: dict,
                   saved_views: set[str] = frozenset()) -> dict[int, tuple[Value, bool]] | None:
    """Each buffer the kernel computing `node` (one contiguous output, element by element) reads,
    and whether it reads it only at the element it writes, so it may write over it: followed
    through views by their strides and through the pointwise values the kernel computes inside
    as permutations of its own dims, or as contiguous reshapes read at its own element. A permute
    there and its inverse further on read the same element (the (N, C, L) loss: the logits
    permuted to (batch, vocab, seq) for the log-softmax, its gradient permuted back before the
    head's matmul, which Inductor writes over the logits).
    A slice_scatter at its own index (_scatters_at_its_index) reads its source at the elements it
    writes first. `saved_views`: views the kernel reads as inputs of their own size (Step). None
    at symbolic sizes."""
    val = node.meta.get("val")
    if not _static_tensor(val) or not val.is_contiguous():
        return None
    out_strides = make_contiguous_strides_for(tuple(val.shape))
    found: dict[int, tuple[Value, bool]] = {}

    def note(buffers, same: bool) -> None:
        for v in buffers:
            before = found.get(id(v))
            found[id(v)] = (v, same and (before is None or before[1]))

    def walk(x: fx.Node, dims: tuple, space: tuple, wanted: tuple) -> None:
        """`x` read at the kernel's element of coordinates `space` (its dims the kernel's `dims`,
        None for a dim of size 1); `wanted`: the strides over the kernel's dims of size > 1 at
        which a buffer is read at the element the kernel writes."""
        x_val = x.meta.get("val")
        if not _static_tensor(x_val):
            raise _Symbolic
        big = [k for k, d in enumerate(space) if d > 1]

        def over_kernel(v) -> tuple:
            strides = [0] * len(space)
            for j, k in enumerate(dims):
                if k is not None:
                    strides[k] += v.stride()[j]
            return tuple(strides[k] for k in big)

        if x.name in saved_views and x_val.numel() != val.numel():
            note(reads.get(x, []), False)
            return
        if _is_view(x):
            root = x
            while _is_view(root) and isinstance(root.args[0], fx.Node):
                root = root.args[0]
            root_val = root.meta.get("val")
            if not _static_tensor(root_val):
                raise _Symbolic
            strides, offset = over_kernel(x_val), x_val.storage_offset() - root_val.storage_offset()
            if root.name not in fused or _is_view(root):
                note(reads.get(root, []), strides == wanted and offset == 0)
                return
            if (strides == wanted and not offset and x_val.is_contiguous() and root_val.is_contiguous()
                    and x_val.numel() == root_val.numel()):
                # a reshape read at the kernel's own element (Cohere's scaled logits, viewed from
                # rows to (batch, seq) rows): the computed value's element at that linear index
                shape = tuple(root_val.shape)
                walk(root, tuple(range(len(shape))), shape,
                     tuple(st for st, d in zip(make_contiguous_strides_for(shape), shape) if d > 1))
                return
            # a value the kernel computes: its element at its own contiguous index
            own = [(st, j) for j, (st, d) in enumerate(zip(make_contiguous_strides_for(tuple(root_val.shape)),
                                                            root_val.shape)) if d > 1]
            by_stride = dict(zip(strides, big))
            if offset or sorted(strides) != sorted(st for st, _ in own) or len(by_stride) != len(big):
                note(reads.get(root, []), False)
                return
            root_dims = [None] * len(root_val.shape)
            for st, j in own:
                root_dims[j] = by_stride[st]
            walk(root, tuple(root_dims), space, wanted)
        elif x.name in fused:
            for y in x.all_input_nodes:
                y_val = y.meta.get("val")
                if isinstance(y_val, torch.Tensor) and tuple(y_val.shape) == tuple(x_val.shape):
                    walk(y, dims, space, wanted)
                else:
                    note(reads.get(y, []), False)
        else:
            note(reads.get(x, []), over_kernel(x_val) == wanted and x_val.storage_offset() == 0)

    sources = {node.args[1]} if _scatters_at_its_index(node) else set()
    try:
        for arg in node.all_input_nodes:
            arg_val = arg.meta.get("val")
            at_index = isinstance(arg_val, torch.Tensor) and (tuple(arg_val.shape) == tuple(val.shape)
                                                              or arg in sources)
            if not at_index:
                note(reads.get(arg, []), False)
                continue
            space = tuple(arg_val.shape)
            wanted = tuple(st for st, d in zip(out_strides, space) if d > 1)
            walk(arg, tuple(range(len(space))), space, wanted)
    except _Symbolic:
        return None
    return found


def _writes_in_place(node: fx.Node) -> bool:
    """A kernel Inductor generates that writes each element where it reads its inputs (a
    pointwise op or a copy; a slice_scatter whose slice starts at its output's first element,
    as the gradient of `logits[:, :-1]` for one sequence): it may write over an input it reads
    last."""
    return node.op == "call_function" and (torch.Tag.pointwise in getattr(node.target, "tags", ())
                                           or node.target in _COPIES or _scatters_at_its_index(node))


def _keeps_index(node: fx.Node) -> bool:
    """A slice from its base's first element, step 1, as contiguous as its base: its element i
    is the base's element i (the rows `[:-1]` of one sequence), which Inductor reads at the
    index it writes."""
    if node.target is not _ATEN.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return False
    _, start, _, step = slice_arguments("slice", node.args, node.kwargs)
    val, base = node.meta.get("val"), node.args[0].meta.get("val")
    return (start == 0 and step == 1 and isinstance(val, torch.Tensor) and isinstance(base, torch.Tensor)
            and val.is_contiguous() and base.is_contiguous())


def _scatters_at_its_index(node: fx.Node) -> bool:
    """A slice_scatter that writes its source at the source's own element index: its slice
    starts at 0 and every dim before the sliced one has size 1."""
    if node.target is not _ATEN.slice_scatter.default:
        return False
    dim, start, _, step = slice_arguments("slice_scatter", node.args, node.kwargs)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or start != 0 or step != 1:
        return False
    dim = dim % val.dim()
    return all(d == 1 for d in val.shape[:dim])


def _moves_elements(node: fx.Node) -> bool:
    """A view that reads its base at another index (a permute, an expand, most slices)."""
    return (_is_view(node) and node.target not in _VIEWS and node.target is not _ATEN.view.default
            and not _keeps_index(node))


def step_peak(step: Step) -> int:
    """Bytes alive at the step's highest point above what was allocated before it (weights and
    inputs), with each chunk call counted at its body's peak for one slice."""
    return step_estimate(step).peak_bytes or 0


def step_estimate(step: Step) -> PeakEstimate:
    """`simulate_peak` of the step's kernel program (`program`) under Inductor's memory planning."""
    # A dynamic graph's sizes are formulas: in bytes at the sizes it is planned at.
    examples = _dim_examples(step.module.graph)
    graph, kernels = program(step, examples)
    return simulate_peak(graph, model=inductor_memory(step, kernels), dim_examples=examples)


def inductor_memory(step: Step, kernels: dict[str, fx.Node]) -> MemoryModel:
    """How Inductor places a step's buffers (codegen/wrapper.py's memory planning): a freed buffer
    goes to the next buffer of the same dtype and storage size in the same graph, most recently
    freed first, where holding it until then keeps the graph's estimated peak
    (`AllocateLine.should_reuse_buffer`); a generated kernel writes over an input it reads last
    (`Scheduler.decide_inplace_update`); a chunk call holds its body's peak for one slice.
    Inductor knows a dynamic graph's sizes as formulas (sizevars), so a symbolic shape is a known
    one: it writes `4*s0` rows over `4*s0` rows as it does 2048 over 2048."""
    bodies: dict[str, int] = {}     # by subgraph: every slice calls the same body, and both walks ask

    def body_peak(node: Node) -> int:
        call = kernels[node.name]
        if "invoke_subgraph" not in str(call.target):
            return 0
        target = call.args[0].target
        if target not in bodies:
            body = getattr(step.module, target)
            bodies[target] = step_peak(Step(body, {n.name for n in fused_away(body.graph)}))
        return bodies[target]

    def storage(v: Value) -> tuple | None:
        if not v.nbytes or v.producer is None:
            return None
        return (v.producer.meta["backward"], v.dtype, v.nbytes)

    return MemoryModel(
        reuse_key=storage,
        reuse_keeps_peak=True,
        known_shape=lambda v: v.shape is not None,
        scope=lambda node: node.meta["backward"],
        kernel=lambda node: node.meta["kernel"],
        overwrites=lambda node: node.meta["overwrites"],
        transient=lambda node, size: max(0, body_peak(node) - sum(size(o) for o in node.outputs if o is not None)),
    )


def estimated_step_peak(joint: fx.Graph, owner: torch.nn.Module | None = None) -> int:
    """The peak of one training step of `joint` as torch.compile with Inductor runs it."""
    return estimated_step(joint, owner).peak_bytes or 0


def estimated_step(joint: fx.Graph, owner: torch.nn.Module | None = None, donated: bool | None = None
                   ) -> PeakEstimate:
    """estimated_step_peak's walk, with the bytes at every node of the step (`donated`: see
    step_graph). The modules made on the way (the partitioner's too) are lazy: their code is
    never run, and generating it was a fifth of a 16-layer simulation."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return step_estimate(step_graph(*partition(joint, owner if owner is not None else joint.owning_module),
                                        donated=donated))

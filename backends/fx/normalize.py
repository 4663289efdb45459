"""Rewrites of a joint graph into the forms the importer and the chunk kinds know, run on
the working copy before a rewrite is planned (FxBuilder.start); each leaves the values the
same.
"""
from __future__ import annotations

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import statically_known_true

from engine.errors import GraphError

aten = torch.ops.aten


def strided_copies_as_clones(graph: fx.Graph) -> int:
    """`copy(dst, src)` into a contiguous `dst` of `src`'s shape and type, as `clone(src)`; the
    number rewritten. AOTAutograd writes the backward of an op done in place on a view of
    attention scores (`scores.div_(8)`, `scores.masked_fill_(mask, -inf)`, `scores += mask`)
    as `copy(new_empty_strided(g, size, stride), g)` and `copy(view, masked_fill(clone(view)))`:
    its values are `src`'s in `dst`'s layout, which a contiguous clone has too. No chunk kind
    knows `copy` or `new_empty_strided` (whose size and strides are arguments), and the
    scores' chunk stopped there; a clone is an Identity, through which it grows."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        dst_val, src_val = (getattr(a, "meta", {}).get("val") for a in (dst, src))
        if not (isinstance(dst_val, torch.Tensor) and isinstance(src_val, torch.Tensor)):
            continue
        if dst_val.dtype != src_val.dtype or dst_val.device != src_val.device or dst_val.dim() != src_val.dim():
            continue
        if not all(statically_known_true(a == b) for a, b in zip(dst_val.shape, src_val.shape)):
            continue
        contiguous = make_contiguous_strides_for(dst_val.shape)
        if not all(statically_known_true(a == b) or statically_known_true(dst_val.shape[k] == 1)
                   for k, (a, b) in enumerate(zip(dst_val.stride(), contiguous))):
            continue
        with graph.inserting_before(node):
            clone = graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
        clone.meta = dict(node.meta)
        node.replace_all_uses_with(clone)
        graph.erase_node(node)
        _erase_if_unused(graph, dst)
        rewritten += 1
    return rewritten


def sizes_read_from_inputs(graph: fx.Graph) -> int:
    """`sym_size(v, d)` of a value the graph computes, as the same size computed from the
    graph's inputs' sizes (backends.fx.sizes); the number rewritten. AOTAutograd reads a size of
    an intermediate where a shape needs it: a label shift's `logits[:, :-1].reshape(-1, V)` at a
    dynamic length reads `sym_size(slice, 1)`, `s - 1`, for the reshape and for its backward. A
    chunk region that computes the slice took the size in with it, and its whole value, read
    outside, has no place in the slices ("leaves the region neither sliced nor summed"): the
    loss ran whole. A size of no input (a data-dependent one) stays as it is."""
    from .sizes import SizeNodes

    sizes = SizeNodes(graph)
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.sym_size.int or not node.args:
            continue
        val = node.meta.get("val")
        source = node.args[0]
        if not isinstance(val, torch.SymInt) or not isinstance(source, fx.Node) or source.op == "placeholder":
            continue
        prev = node.prev
        try:
            with graph.inserting_before(node):
                size = sizes.size(val)
        except GraphError:
            continue
        made = prev.next
        while made is not node:     # the arithmetic's values, as the importer reads them
            if "val" not in made.meta:
                made.meta["val"] = made.target(*(a.meta["val"] if isinstance(a, fx.Node) else a
                                                 for a in made.args))
            made = made.next
        node.replace_all_uses_with(size)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def inductor_early_patterns(graph: fx.Graph) -> int:
    """Inductor's early joint-graph patterns, which it runs after remat's pass and before it
    partitions: a view to the same shape, and a pair of views or of permutes that undo each
    other, read their input instead (torch/_inductor/fx_passes/joint_graph.py); the number of
    nodes removed. The peak model runs them on its copy before it partitions
    (backends.fx.peak.partition), as Inductor will: without them, Falcon's choice at a budget of
    0.7x simulated at 28.0 MiB and ran at 37.9 (the permute pairs of its attention, `k.transpose`
    and its backward's transpose back, removed, the partitioner placed the recomputed scores in
    the backward beside the logits). They run on the copy only: the graph remat plans keeps them,
    so its plans are named as on the ONNX path (a weight's transpose read by the backward too is
    no part of a recompute region)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes.joint_graph import early_patterns

    if not inductor_config.pattern_matcher:
        return 0
    # Once, as Inductor runs them (`apply` counts the matches its handlers saw, also those they
    # left alone: the nodes it removed are the rewrites).
    before = len(graph.nodes)
    early_patterns.apply(graph)
    return before - len(graph.nodes)


def _erase_if_unused(graph: fx.Graph, node) -> None:
    """Erase `node` and then its inputs where nothing else reads them and they are a fresh
    buffer or its size arithmetic (new_empty_strided, sym_stride, sym_size)."""
    erasable = (aten.new_empty_strided.default, aten.sym_stride.int, aten.sym_size.int)
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in erasable and not node.users:
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for n in inputs:
            _erase_if_unused(graph, n)

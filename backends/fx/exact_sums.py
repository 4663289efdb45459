"""Sums of a broadcast value, counted instead of added up, in chunk bodies.

Label smoothing's gradient of the log-probabilities is a per-row constant broadcast over the
vocabulary plus the one-hot term: `add(expand(c), onehot * k)`, and the log-softmax backward sums
it over the vocabulary. Plain Inductor fuses that sum into the kernel that reads the
log-probabilities, vectorised along the vocabulary; in a chunk body (backends/fx/chunk.py) it is
a kernel of its own that reads nothing along the vocabulary, so Inductor vectorises it across rows
and adds the vocabulary's copies of `c` one after another. The rounding of 8192 such additions
(3.9e-5 of the sum) is the same in every row, so it does not cancel where the rows' gradients are
summed (a bias's, a norm weight's): on a linear head with `label_smoothing=0.1`, `dynamic=True`,
the hidden state's gradient summed over tokens was 1.5e-5 off float64 where eager and Inductor are
8.6e-7 off, and the zoo's GPT with it 1.04e-4 off on its final norm's weight (session 29's fuzz).

`sum(add(expand(x), y), dims)`, x of size 1 along every summed dim, is `x * n + sum(y, dims)`
(n the summed elements), exactly so in real numbers, and closer in float: n copies of x counted
once, y summed alone (the one-hot term: one nonzero a row). The rewrite is applied to chunk bodies
only, where the kernel split above happens.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def count_broadcast_sums(graph: fx.Graph) -> int:
    """Rewrite each `sum(add(expand(x), y), dims)` of `graph` whose `x` is 1 along every summed
    dim (one dtype, no `alpha`) as `add(sum(y, dims), mul(x, n))`, n an int or, over symbolic
    sizes, computed from `y`'s sizes; returns how many. Reads each node's `meta["val"]`; the new
    nodes get none (the caller propagates)."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not aten.sum.dim_IntList or node.kwargs.get("dtype") is not None:
            continue
        src, dims = node.args[0], node.args[1]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not isinstance(src, fx.Node) or src.target is not aten.add.Tensor or src.kwargs or len(src.args) != 2:
            continue
        out = src.meta.get("val")
        if not isinstance(out, torch.Tensor) or not dims:
            continue
        rank = out.dim()
        summed = sorted({d % rank for d in dims})
        for broadcast, other in (src.args, src.args[::-1]):
            base = _broadcast_base(broadcast, summed, out)
            if base is None or not _same_shape(other, out):
                continue            # y broadcast too would be summed n times over: left as it is
            with graph.inserting_before(node):
                rest = graph.call_function(aten.sum.dim_IntList, (other, list(dims), keepdim))
                if not keepdim:
                    base = graph.call_function(aten.squeeze.dims, (base, summed))
                counted = graph.call_function(aten.mul.Tensor, (base, _count(graph, other, summed, out)))
                total = graph.call_function(aten.add.Tensor, (rest, counted))
            node.replace_all_uses_with(total)
            graph.erase_node(node)
            rewritten += 1
            break
    return rewritten


def _count(graph: fx.Graph, like: fx.Node, summed: list[int], out: torch.Tensor):
    """The number of elements summed: an int, or (a dynamic graph's symbolic sizes) a node that
    multiplies `like`'s sizes along the summed dims."""
    count = math.prod(out.shape[d] for d in summed if isinstance(out.shape[d], int))
    for d in summed:
        if not isinstance(out.shape[d], int):
            size = graph.call_function(aten.sym_size.int, (like, d))
            count = size if count == 1 else graph.call_function(operator.mul, (count, size))
    return count


def _same_shape(v, out: torch.Tensor) -> bool:
    """Whether `v` is a node of `out`'s dtype and shape (each dim provably equal)."""
    val = v.meta.get("val") if isinstance(v, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != out.dtype or val.dim() != out.dim():
        return False
    return all(statically_known_true(a == b) for a, b in zip(val.shape, out.shape))


def _broadcast_base(v, summed: list[int], out: torch.Tensor) -> fx.Node | None:
    """The `x` of `v = expand(x, ...)` when x has `out`'s rank and dtype and size 1 along every
    summed dim; else None."""
    if not isinstance(v, fx.Node) or v.target is not aten.expand.default:
        return None
    base = v.args[0]
    val = base.meta.get("val") if isinstance(base, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != out.dim() or val.dtype != out.dtype:
        return None
    return base if all(statically_known_true(val.shape[d] == 1) for d in summed) else None

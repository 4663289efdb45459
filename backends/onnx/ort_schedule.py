"""Write a graph so that ONNX Runtime runs it in the order the engine scheduled.

A default ONNX Runtime session (ExecutionOrder.DEFAULT) does not run nodes in
file order. It walks depth-first from the leaf nodes (nodes whose outputs
nobody reads: the gradients), taking the leaf with the highest index first and,
at each node, the input with the highest index first, and runs nodes in
post-order. Two things follow for a training graph, both measured on the
GPT-like model of docs/design.md (vocab 4096, batch 8):

* The walk starts at the highest-indexed leaf. If that is the last gradient of
  the backward pass, one walk runs the whole backward chain and every other
  weight gradient waits until the end, keeping its inputs alive.
  Writing the leaves last, in reverse schedule order, makes the walk start at
  the first gradient and run each weight gradient right after its layer.
* ONNX Runtime's fusions renumber what they fuse. The torch exporter writes a
  weight gradient as Transpose(Transpose(MatMul(Transpose(x), g))); ORT cancels
  the transposes and fuses the rest into a new FusedMatMul whose index undoes
  the leaf order above. Written as Gemm(x, g, transA=1), the same product,
  there is nothing left to fuse and the index stays.

* A node whose results nobody reads is a leaf too; it is dropped (see drop_dead_nodes).

* Leaves last is not always best (a mixture-of-experts step, see schedule_for_onnxruntime):
  the exporter estimates both placements with ONNX Runtime's peak model and writes the lower.

* ORT's allocation planner hands a freed buffer to the next output of the same shape where its
  shape inference knows both shapes, and its memory pattern holds that buffer from its first value
  to the last read of its last value. In a static export, where it knows every shape, forward
  buffers are chained into the backward's recomputes and layout copies and held across the gaps
  between them; the arena grows by what the chains hold (HF GPT-2, 2 layers, 3 x 640 tokens,
  `remat apply --tier expensive`: 136.6 MiB measured, 102.9 with the session's `enable_mem_reuse`
  off; a dynamic export, whose shapes ORT mostly does not know, 103). The exporter also estimates
  each placement with the shapes hidden from ORT (hide_static_shapes) and writes the lowest.

With the first two, the recomputed GPT graph peaked at 457 MiB instead of 581 MiB; the
original graph's peak is unchanged (769 MiB either way), and outputs are
bitwise equal.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from onnx import numpy_helper

from engine.analysis import PeakEstimate
from engine.dtypes import DType
from engine.failures import resolve_strict
from engine.ir import Graph, Node, Value

from .canonical import read_through_copies


def _single_use(value: Value, graph_outputs: set[int]) -> bool:
    return len(value.users) == 1 and id(value) not in graph_outputs


def _is_2d_swap(node: Node | None) -> bool:
    return (node is not None and node.op == "Transpose" and list(node.attrs.get("perm", [])) == [1, 0]
            and node.inputs[0] is not None and node.inputs[0].shape is not None
            and len(node.inputs[0].shape) == 2)


def _gemm_bias(c: Value | None, m: int, n: int) -> bool:
    """`c` is a Gemm C for an [m, n] product: it broadcasts to it one way ([n], [1, n], [m, 1], [m, n])."""
    return c is not None and c.shape is not None and tuple(c.shape) in ((n,), (1, n), (m, 1), (m, n))


def fold_output_transposes(graph: Graph) -> int:
    """Rewrite graph-output producers `T(T(MatMul(T(a), b)))` and `MatMul(T(a), b)` (2-D) as Gemm,
    and `Add(product, c)` of such a product as Gemm with C = c: a tied weight's gradient is the
    projection's gradient plus the embedding's, which ORT's MatMulAddFusion would fuse into a new
    Gemm with the highest index, the first leaf its walk takes (BERT: the whole backward in one
    walk, every other weight gradient held to the end, 411 MiB where the order written gives 322)."""
    outputs = {id(v) for v in graph.outputs}
    removed: set[int] = set()
    replaced = 0
    for index, node in enumerate(graph.nodes):
        if not node.outputs or id(node.outputs[0]) not in outputs or id(node) in removed:
            continue
        bias, top, drop = None, node, []
        if node.op == "Add" and len(node.inputs) == 2:
            for slot in (0, 1):
                product, c = node.inputs[slot], node.inputs[1 - slot]
                if (product is not None and product.producer is not None and _single_use(product, outputs)
                        and product.shape is not None and len(product.shape) == 2
                        and _gemm_bias(c, *product.shape) and c is not product):
                    bias, top, drop = c, product.producer, [product.producer]
                    break
            if bias is None:
                continue
        chain = []
        while (_is_2d_swap(top) and top.inputs[0].producer is not None and _is_2d_swap(top.inputs[0].producer)
               and _single_use(top.inputs[0], outputs)):
            inner = top.inputs[0].producer
            if not _single_use(inner.inputs[0], outputs) or inner.inputs[0].producer is None:
                break
            chain += [top, inner]
            top = inner.inputs[0].producer
        matmul = top
        if matmul.op != "MatMul" or (matmul is not node and not _single_use(matmul.outputs[0], outputs)):
            continue
        a, b = matmul.inputs
        if a is None or b is None or a.shape is None or b.shape is None or len(a.shape) != 2 \
                or len(b.shape) != 2:
            continue
        attrs = {}
        drop = drop + list(chain) + ([matmul] if matmul is not node else [])
        if _is_2d_swap(a.producer) and len(a.users) == 1:
            drop.append(a.producer)
            a, attrs["transA"] = a.producer.inputs[0], 1
        if _is_2d_swap(b.producer) and len(b.users) == 1:
            drop.append(b.producer)
            b, attrs["transB"] = b.producer.inputs[0], 1
        if not attrs and bias is None:
            continue
        gemm = Node("Gemm", [a, b] + ([bias] if bias is not None else []), [node.outputs[0]], attrs,
                    f"{node.name}_gemm")
        graph.nodes[index] = gemm
        removed.update(id(n) for n in drop if n is not node)
        replaced += 1
    if replaced:
        graph.nodes = [n for n in graph.nodes if id(n) not in removed]
        graph.link()
    return replaced


def drop_dead_nodes(graph: Graph) -> int:
    """Remove nodes whose results nobody reads and that produce no graph output.

    Besides wasting work, a dead node is a leaf of ONNX Runtime's walk: the
    gradient of an input nobody asked for (measured on an MLP training graph)
    was fused, renumbered first, and its walk ran the whole backward chain
    before any weight gradient.
    """
    outputs = {id(v) for v in graph.outputs}
    removed = 0
    changed = True
    while changed:
        changed = False
        keep = []
        for node in reversed(graph.nodes):
            dead = not node.subgraphs and all(not o.users and id(o) not in outputs for o in node.outputs)
            if dead:
                for v in node.present_inputs():
                    v.users = [u for u in v.users if u is not node]
                removed += 1
                changed = True
            else:
                keep.append(node)
        graph.nodes = keep[::-1]
    return removed


def leaves_last(graph: Graph) -> None:
    """Move nodes nobody reads to the end, the one scheduled first placed last."""
    leaves = [n for n in graph.nodes if not n.subgraphs and not any(o.users for o in n.outputs)]
    ids = {id(n) for n in leaves}
    graph.nodes = [n for n in graph.nodes if id(n) not in ids] + leaves[::-1]


class LeafLayout(str, Enum):
    """Where the exporter writes the leaves (nodes nobody reads: the weight gradients)."""

    LAST = "leaves last"             # at the end, in reverse schedule order
    AS_SCHEDULED = "as scheduled"    # where the schedule put them

    def __str__(self) -> str:
        return self.value


@dataclass
class OrtSchedule:
    """The graph as the exporter writes it for ONNX Runtime: `graph` (a copy, nodes in file
    order), which leaf placement it uses, and, unless estimating failed, the file read back
    (`written`) with its estimated peak (`estimate`, ort_order's model); `estimates` holds both
    placements' peaks when both are known."""

    graph: Graph
    layout: LeafLayout
    written: Graph | None = None
    estimate: PeakEstimate | None = None
    estimates: dict[LeafLayout, int] = field(default_factory=dict)   # estimated peak bytes
    hidden_shapes: bool = False     # the shapes hidden from ORT's planner (hide_static_shapes)
    hidden_estimates: dict[LeafLayout, int] = field(default_factory=dict)   # each placement, hidden


def leaf_layouts(graph: Graph) -> Iterator[tuple[LeafLayout, Graph]]:
    """The two ways the exporter can place the leaves, each built when asked for: last, in
    reverse schedule order (the walk runs each weight gradient right after its layer), and where
    the schedule put them (ORT's walk then reaches a leaf only after every leaf written later)."""
    work = graph.copy()
    drop_dead_nodes(work)
    fold_output_transposes(work)
    last = work.copy()
    leaves_last(last)
    for name, g in ((LeafLayout.LAST, last), (LeafLayout.AS_SCHEDULED, work)):
        g.link()
        g.verify()
        yield name, g


# The last estimated schedule of each graph, with the graph's state it was made for: the budget
# planner simulates the rewritten graph (estimated_ort_peak) and `remat apply` then writes that
# same graph (export_model); both read the schedule of 2 to 4 estimates (2.5 of `remat apply`'s
# 7.1 s on the GPT step). A graph edited in between has another state_key and is scheduled anew.
_SCHEDULED: weakref.WeakKeyDictionary[Graph, tuple[tuple, OrtSchedule]] = weakref.WeakKeyDictionary()


def schedule_for_onnxruntime(graph: Graph, strict: bool | None = None, estimate: bool = True) -> OrtSchedule:
    """A copy of `graph`, same values and results, ordered for ONNX Runtime's depth-first walk:
    of the two leaf placements (`leaf_layouts`), the one whose estimated peak
    (ort_order.estimated_written_peak) is lower; leaves last on a tie or where a placement
    cannot be estimated (a dim with no example value). Without `estimate`, leaves last, nothing
    estimated: for a run that checks numbers only (every order computes the same values), where
    the two estimates cost more than the run (engine.testing's property tests).

    Each placement is also estimated with its shapes hidden from ORT's buffer reuse
    (hide_static_shapes), for a graph whose inputs all have static shapes (a dynamic export's
    are mostly unknown to ORT already); the lowest of the (up to) four is written, the shapes
    shown on a tie. Where hiding cannot be estimated, the placements as written stand.

    Leaves last is what most training graphs want (the recomputed GPT-like step: 313 MiB
    measured, 438 with the leaves where the schedule put them). Not all: a mixture-of-experts
    step exported with batched experts computes each expert's weight gradient as a per-token
    outer product, [tokens, 256, 128] from [tokens, 256] and [tokens, 128], bigger than its
    inputs. Run right after its layer, it lives beside the earlier layers' gathered expert
    weights (Qwen3-MoE, 2 layers: 1369 MiB); run at the end, after them (892 MiB, the original
    export's 890). A failure to estimate is remat's bug: raised when strict (REMAT_STRICT),
    else warned once and the leaves written last.

    Kept for the graph as it is (`_SCHEDULED`): asked again while the graph is not edited, the
    same OrtSchedule (whose `graph` and `written` are not to be edited either)."""
    if not estimate:
        return _schedule_for_onnxruntime(graph, strict, estimate)
    key = (graph.state_key(), resolve_strict(strict))
    kept = _SCHEDULED.get(graph)
    if kept is not None and kept[0] == key:
        return kept[1]
    schedule = _schedule_for_onnxruntime(graph, strict, estimate)
    _SCHEDULED[graph] = (key, schedule)
    return schedule


def _schedule_for_onnxruntime(graph: Graph, strict: bool | None = None, estimate: bool = True) -> OrtSchedule:
    """`schedule_for_onnxruntime`, made anew."""
    from .exporter import ExportBug
    from .ort_order import estimated_written_peak     # ort_order reads graphs through the exporter

    layouts = leaf_layouts(graph)
    if not estimate:
        name, g = next(layouts)         # leaves last; the other placement is never built
        return OrtSchedule(g, name)

    def estimated(g: Graph, name: LeafLayout, hidden: bool) -> OrtSchedule:
        written, peak = estimated_written_peak(g)
        return OrtSchedule(g, name, written, peak, hidden_shapes=hidden)

    scheduled: list[OrtSchedule] = []
    graphs = list(layouts)
    for name, g in graphs:
        try:
            s = estimated(g, name, False)
        except ExportBug:
            raise
        except Exception as exc:
            if resolve_strict(strict):
                raise
            warnings.warn(f"remat: ONNX Runtime's peak could not be estimated for the leaves placed "
                          f"{name} ({type(exc).__name__}: {exc}); the leaves are written last", stacklevel=2)
            return scheduled[0] if scheduled else OrtSchedule(g, name)
        scheduled.append(s)
        if s.estimate.peak_bytes is None:
            return scheduled[0]         # leaves last (the first placement), its estimate unknown
    plain = list(scheduled)
    static = all(x.has_static_shape for x in graph.inputs if not x.is_initializer)
    for name, g in graphs if static else ():
        h = g.copy()
        if not hide_static_shapes(h):
            break                       # nothing to hide: the same graph
        h.verify()
        try:
            s = estimated(h, name, True)
        except ExportBug:
            raise
        except Exception:
            if resolve_strict(strict):
                raise
            break                       # the placements as written stand
        if s.estimate.peak_bytes is not None:
            scheduled.append(s)
    best = min(scheduled, key=lambda s: s.estimate.peak_bytes)     # the first on a tie
    best.estimates = {s.layout: s.estimate.peak_bytes for s in plain}
    best.hidden_estimates = {s.layout: s.estimate.peak_bytes for s in scheduled if s.hidden_shapes}
    return best


# The operand of each op that gives its output's dims (ONNX shape inference reads it as data).
_SHAPE_OPERANDS = {"Reshape": (1,), "ConstantOfShape": (0,), "Tile": (1,)}


def hide_static_shapes(graph: Graph) -> int:
    """Hide the activations' dims from ONNX Runtime's shape inference, in place, so that its
    allocation planner reuses no buffer by shape (the module docstring): each shape operand of a
    Reshape, ConstantOfShape or Tile is read through `CastLike(shape, int64)`, which ORT neither
    folds nor reads as data (ORT turns it into a Cast of its own, after folding), and each graph
    input of static shape through `Reshape(x, CastLike(its shape))`, a view. Then a Reshape's
    result has dims ORT does not know, and so has what is computed from it (ort_unknown_shapes
    models which). An Expand to its input's own shape, which ORT removes only where it knows both
    shapes, is removed here. Returns how many nodes it added (0: nothing hidden; the graph may
    still have lost such Expands); nothing before opset 15 (no CastLike).

    Checked on HF GPT-2 (static, expensive tier): ORT's own inferred shapes (runtime.inferred_shapes)
    know no activation's dims but the graph outputs', and the measured peak is 106.9 MiB against
    136.6 as written before, 105.0 estimated; outputs bitwise equal. An Expand's shape operand is
    not hidden: its output's dims are the target's, known anyway, and hiding kept ORT's copy."""
    base = graph.meta.get("onnx_model")
    opset = (next((o.version for o in base.opset_import if o.domain in ("", "ai.onnx")), 0)
             if base is not None else 20)       # export_model's default opset
    if opset < 15:
        return 0                        # no CastLike before opset 15
    like_name = graph.fresh_name("remat_int64_like")
    like = Value(like_name, DType.INT64, (1,), is_initializer=True,
                 data=numpy_helper.from_array(np.zeros(1, np.int64), like_name))
    like.ints = [0]
    hidden: dict = {}       # a shape operand (by id, a constant by its value) -> its CastLike

    def hide(v: Value, out: list[Node]) -> Value:
        # One CastLike per constant value: ORT's common-subexpression elimination would merge two.
        constant = v.ints is not None and (v.producer is None or v.producer.op == "Constant")
        key = ("ints", tuple(v.ints)) if constant else id(v)
        h = hidden.get(key)
        if h is None:
            h = Value(graph.fresh_name(f"{v.name}_hidden"), DType.INT64, v.shape)
            node = Node("CastLike", [v, like], [h], {}, graph.fresh_name(f"{v.name}_hidden_node"))
            out.append(node)
            hidden[key] = h
        return h

    # An Expand to its input's own shape is an identity ORT removes, when it knows both shapes: it
    # would no longer know them; it is read through here.
    read_through_copies(graph, constant_targets=True)
    nodes: list[Node] = []
    for x in graph.inputs:
        if x.is_initializer or not x.users or not x.has_static_shape:
            continue
        name = graph.fresh_name(f"{x.name}_shape")
        dims = Value(name, DType.INT64, (len(x.shape),), is_initializer=True,
                     data=numpy_helper.from_array(np.array(x.shape, np.int64), name))
        dims.ints = list(x.shape)
        graph.initializers.append(dims)
        view = Value(graph.fresh_name(f"{x.name}_hidden_view"), x.dtype, x.shape)
        for user in list(x.users):
            user.replace_input(x, view)
        nodes.append(Node("Reshape", [x, hide(dims, nodes)], [view], {}, graph.fresh_name(f"{x.name}_view_node")))
    for node in graph.nodes:
        for k in _SHAPE_OPERANDS.get(node.op, ()):
            v = node.inputs[k] if k < len(node.inputs) else None
            if v is not None and v.dtype is DType.INT64:
                node.inputs[k] = hide(v, nodes)
        nodes.append(node)
    added = len(nodes) - len(graph.nodes)
    if hidden:
        graph.initializers.append(like)
    graph.nodes = nodes
    graph.link()
    return added

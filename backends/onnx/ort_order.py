"""ONNX Runtime's execution order and memory, modelled on the IR: `estimated_ort_peak`.

`estimated_ort_peak(model_or_graph)` is the peak memory of one run of a training graph in a
default ONNX Runtime session on the CPU, as `backends.onnx.runtime.measure` measures it (VmHWM
above the resting RSS, CPU arena off). Three parts, each checked against ONNX Runtime 1.32:

Order (`ort_order`). A default session (ExecutionOrder.DEFAULT) runs the nodes in the post-order
of a depth-first walk (graph_viewer.cc, Graph::ReverseDFSFrom): from the leaves (nodes whose
outputs no node reads; a graph output is not an edge), the one with the highest node index
first, and at each node to the producers of its inputs (a Loop's captured values included),
the one with the highest index first. A node's index is its position in the file, `Constant`s
not counted; a node ORT's optimizer makes gets the next free index. This is the walk
backends/onnx/ort_schedule.py writes the graph for (leaves last, in reverse schedule order).
`ort_view(...).order` is the order ORT's profiler reports, node for node, on the MLP training
graphs of tests/test_peak_model.py; on the GPT-like step 94% of the nodes sit where ORT runs
them, the rest being the embedding gradient's index arithmetic (ORT's transpose optimizer moves
a Transpose there) and which of two merged duplicates keeps its name.

Graph (`ort_view`). Before it runs, ORT rewrites the graph (graph_optimization_level ALL); the
rewrites that change which tensors exist or how the walk goes are applied to a copy:
constant folding (nodes whose inputs are all constants, `Shape` of a static shape; their
results become initializers, which the measured peak does not count; not `CastLike`, which ORT
cannot fold), identity eliminations (`Identity`, `Expand` to the same shape, `Cast` to the same
type, `Transpose(Transpose(x))` composed, gone when the identity; a graph output is then written
by the producer), common-subexpression elimination, and the fusions that make new nodes in
the order ORT makes them: a 2-D `Transpose` into the `Gemm` reading it, `Add(MatMul(a, w), bias)`
into a Gemm (MatMulAddFusion), `CastLike` into `Cast`, a `Transpose` of the last two dims into
the `MatMul` reading it (FusedMatMul), a `Mul` or `Div` by a scalar constant on a float matmul's
input or output into its `alpha` (MatMulScaleFusion), a tanh GELU written out (nanoGPT's
`new_gelu`) into one FastGelu where each inner value has one reader, as remat's recompute of the
activation leaves it (FastGeluFusion), and `x * sigmoid(x)` (SiLU) into one QuickGelu where the
sigmoid has one reader (QuickGeluFusion). The erf Gelu, Attention or LayerNorm fusions find nothing
in the graphs torch.onnx and remat write (their ops are fused already) and are not modelled.

Memory (`ort_memory_model`), from ORT's source (allocation_planner.cc, mem_pattern_planner.h,
execution_frame.cc, loop.cc, where_op.cc) and measured op by op (strace of the run's mmaps with
MALLOC_MMAP_THRESHOLD_=65536, as `measure` runs it):

* `Reshape`, `Identity`, `Squeeze`, `Unsqueeze`, `Flatten` return views (kernel Alias). The
  activations that may run in place (Relu, Sigmoid, Tanh, Clip, Softmax, LogSoftmax,
  ScatterElements, ...) write over their input at its last read; Exp, Gelu, Erf, Neg, Add, Mul,
  Sub, Div, LayerNormalization, ScatterND do not (ORT_INPLACE_OPS).
* The allocation planner hands a freed buffer to the next output of exactly the same shape and
  element size, most recently freed first, when ORT's shape inference knows both shapes; the
  buffer is then held from its first value to the last read of its last value. ORT does not know
  the shapes of a Loop's outputs (ONNX's Loop inference does not read the trip count), nor of a
  `Slice` at a computed offset (a Loop body's), nor what follows from those by ONNX's inference
  rules (`ort_unknown_shapes`).
* From the second run on (measure's measured run) the buffers that are not graph outputs lie in
  one block allocated at the start of the run, at the offsets the memory pattern planner chose
  in the first run: best fit among the gaps between placed blocks, else after the highest one,
  sizes rounded to 64 bytes. Its pages stay resident once touched: it counts with its
  high-water mark.
* Graph outputs are allocated apart and held to the end; so are a `SplitToSequence`'s pieces
  (until the sequence is freed) and the two selections `Where` makes before merging them,
  broadcast(cond, X) and broadcast(cond, Y), during the node (`ort_transient`).
* A Loop runs its body with a block of its own per iteration; the body's outputs are allocated
  apart; each iteration's scan outputs are kept until they are concatenated into the Loop's
  output, and the carried values are handed to the next iteration (engine.analysis.loop_bytes).

* What ORT's inference knows (`ort_unknown_shapes`): the shapes the file states (value_info,
  which torch.onnx writes for every value; `declared_shapes`), numbers and the graph inputs'
  dim names (`batch`), not a dim the importer's inference invented (`unk__N`) nor an expression
  of names; a dynamic model's Loop trip count, computed from `Shape`, is what its scan outputs
  say (engine.analysis.loop_bytes). `bench/peak_model.py --dynamic`: within 0.5%.
* Constant folding turns `Shape(x)` into a constant only where ORT's inference knows x's dims
  (`_fold_constants`): in a Loop body the loss chunk's `Shape` of its sliced log-probabilities
  runs, the `Expand` to it after them, of a shape ORT does not know.

With ORT's own optimized graph and order the simulation reproduces the block's size to the byte
and the measured peaks of the GPT-like graphs to 0.1%; from the IR, bench/peak_model.py finds
the GPT-like step's estimates (original, default tier, expensive tier) within 0.2% of the
measured peak at vocab 4096 and 32768 (the rewrites at vocab 32768 were 5.6% and 6.7% low, 16
MiB, until `Shape` folding followed ORT's shape knowledge). Not yet followed: a Loop body of
values of unknown shape only (a synthetic loss chunk whose matmul reads no known-shape value)
measures as if its buffers were allocated one by one (live bytes, 32 MiB), where the model packs
them in the body's block and finds 48: an overestimate, the safe side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from engine.analysis import MemoryModel, PeakEstimate, simulate_peak
from engine.dtypes import DType
from engine.errors import RematError
from engine.ir import Graph, Node, Value, captured_values

if TYPE_CHECKING:
    from .ort_schedule import OrtSchedule

ORT_ALIAS_OPS = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})
# CPU kernels that write their output over input 0 when it is that input's last use and the sizes
# match (KernelDef MayInplace); measured one by one: Exp, Mul, Add, Sub, Div, Gelu, Erf, Neg,
# LayerNormalization, ScatterND, Gemm's C do not.
ORT_INPLACE_OPS = frozenset({"Relu", "Sigmoid", "Tanh", "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign",
                             "HardSigmoid", "ThresholdedRelu", "Clip", "Softmax", "LogSoftmax",
                             "ScatterElements", "Scatter"})
ORT_ALIGNMENT = 64          # kAllocAlignment: the memory pattern planner's sizes are rounded to it

# Folded when its input's shape is static (ORT's constant folding).
_SHAPE_ONLY = frozenset({"Shape"})     # not Size: ORT folds Shape only
# Never folded: their result is not a function of their inputs.
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                               "Multinomial", "Bernoulli", "Dropout"})


# No CPU kernel: ORT cannot fold these (it turns CastLike into Cast later, see _castlike_to_cast).
_NOT_FOLDED = frozenset({"CastLike"})


def ort_indices(graph: Graph) -> dict[int, int]:
    """ORT's node index of each node of `graph` (keyed by id): its position in the file,
    `Constant` nodes not counted."""
    index, k = {}, 0
    for node in graph.nodes:
        if node.op == "Constant":
            continue
        index[id(node)] = k
        k += 1
    return index


def ort_order(graph: Graph, index: dict[int, int] | None = None,
              skip: set[int] | frozenset[int] = frozenset()) -> list[Node]:
    """The nodes of `graph` in the order a default ONNX Runtime session runs them: the
    post-order of a depth-first walk from the leaves, highest index first (see the module
    docstring). `index` defaults to `ort_indices` (the graph as written, before ORT's own
    rewrites; `ort_view` gives the graph after them); nodes in `skip` (ids) and `Constant`s
    are not run."""
    index = ort_indices(graph) if index is None else index
    nodes = [n for n in graph.nodes if id(n) in index and id(n) not in skip and n.op != "Constant"]
    members = {id(n) for n in nodes}
    producer = {id(o): n for n in nodes for o in n.outputs}
    inputs_of: dict[int, list[Node]] = {}
    has_consumer: set[int] = set()
    for n in nodes:
        ins = []
        for v in n.reads():
            p = producer.get(id(v))
            if p is not None and id(p) in members:
                ins.append(p)
                has_consumer.add(id(p))
        inputs_of[id(n)] = sorted(ins, key=lambda p: index[id(p)])
    leaves = sorted((n for n in nodes if id(n) not in has_consumer), key=lambda n: index[id(n)])
    stack: list[tuple[Node, bool]] = [(n, False) for n in leaves]
    visited: set[int] = set()
    order: list[Node] = []
    while stack:
        node, leave = stack.pop()
        if leave:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        for p in inputs_of[id(node)]:
            if id(p) not in visited:
                stack.append((p, False))
    return order


@dataclass
class OrtView:
    """A graph as ONNX Runtime runs it: a rewritten copy, ORT's node indices, the order its walk
    runs the nodes in, and the values whose shape ORT's planner does not know."""

    graph: Graph
    index: dict[int, int]
    order: list[Node]
    unknown_shape: set[int] = field(default_factory=set)
    orders: dict[int, list[Node]] = field(default_factory=dict)   # id(subgraph) -> its order
    # The symbolic dims of the graph's inputs, which ORT reads from the feeds at run time: a dim
    # of any other symbol (the importer's `unk__N`) is one ORT's inference does not know.
    symbols: frozenset = frozenset()
    # The values whose shape the model file states (value_info, outputs), which ORT starts from.
    declared: frozenset = frozenset()


def ort_view(graph: Graph, declared: frozenset = frozenset()) -> OrtView:
    """ORT's rewrites of `graph` (a copy; `graph` is the graph as written, nodes in file order),
    its node indices and execution order, in every subgraph too. `declared`: the names of the
    values whose shapes the file states (`declared_shapes`)."""
    work = graph.copy()
    view = OrtView(work, {}, [], set(), symbols=input_symbols(work), declared=declared)
    _rewrite(work, view, set())
    return view


def ort_constants(graph: Graph, outer_constant: set[int] | frozenset[int] = frozenset(),
                  unknown: dict[int, Dims] | None = None) -> tuple[set[int], set[int]]:
    """What ORT's constant folding makes constant in `graph` (ids): the values (initializers,
    `Constant`s, results of nodes whose inputs all are, `Shape` of a static shape; the
    enclosing graphs' constants in `outer_constant`) and the nodes it folds away. `unknown`
    (ort_unknown_shapes): the values whose dims ORT's inference does not know, whose `Shape` it
    does not fold whatever the IR knows (by default the IR's shapes are ORT's)."""
    unknown = unknown or {}
    constant = set(outer_constant) | {id(v) for v in graph.initializers}
    folded: set[int] = set()
    for node in graph.nodes:
        if node.op == "Constant":
            constant.update(id(o) for o in node.outputs)
            folded.add(id(node))
        elif (not node.subgraphs and node.op_type not in _NONDETERMINISTIC and node.op_type not in _NOT_FOLDED
              and (all(id(v) in constant for v in node.present_inputs())
                   or (node.op_type in _SHAPE_ONLY and node.inputs and node.inputs[0] is not None
                       and node.inputs[0].has_static_shape and id(node.inputs[0]) not in unknown))):
            constant.update(id(o) for o in node.outputs)
            folded.add(id(node))
    return constant, folded


def _fold_constants(graph: Graph, outer_constant: set[int], outer_unknown: dict | None,
                    symbols: frozenset, declared: frozenset) -> tuple[set[int], dict[int, Dims]]:
    """ORT's constant folding of `graph`, in place, to its fixed point: the folded nodes dropped,
    their outputs made initializers; returns the constant values (ids). A `Shape` folds only where
    ORT's inference knows its input's dims (a Loop body's `Shape` of a slice at a computed offset
    runs: ORT writes its `Expand` there after the value whose shape it takes, and knows no shape
    of the result), and a fold can let inference know dims it did not (a `Reshape` to a folded
    shape), so folding and inference alternate, as ORT's graph transformers and its graph
    resolve do, until nothing more folds. Returns the constant values (ids) and the dims ORT's
    inference does not know (ort_unknown_shapes) of the folded graph."""
    constant = set(outer_constant)
    while True:
        unknown = ort_unknown_shapes(graph, graph.nodes, outer_unknown, symbols, declared)
        constant, folded = ort_constants(graph, constant, unknown)
        for v in graph.values():
            if id(v) in constant and not v.is_input:
                v.is_initializer = True
        if not folded:
            return constant, unknown
        for node in graph.nodes:
            if node.op == "Constant" and id(node) in folded:
                for o in node.outputs:       # what a fusion reads of a constant (`_number`)
                    o.data = o.data if o.data is not None else _constant_payload(node)
        graph.nodes = [n for n in graph.nodes if id(n) not in folded]
        graph.link()


def _rewrite(graph: Graph, view: OrtView, outer_constant: set[int], outer_unknown: dict | None = None) -> None:
    # The values this graph reads from an enclosing one list the enclosing graph's readers until
    # a link here: the passes' relinks start from each value's readers in this graph.
    graph.link()
    index = ort_indices(graph)
    next_index = len(index)
    constant, unknown = _fold_constants(graph, outer_constant, outer_unknown, view.symbols, view.declared)

    _eliminate(graph, unknown)
    _merge_common(graph)
    # Fusions that make new nodes (the next free indices), in the order ORT's transformers run
    # (level 1: Gemm transposes, MatMul+Add, CastLike; level 2: MatMul transposes, tanh GELUs, SiLUs,
    # scales), each visiting
    # the nodes in the order of the walk.
    next_index = _fuse_transposes(graph, index, next_index, ("Gemm",))
    next_index = _fuse_matmul_add(graph, index, next_index, unknown)
    next_index = _castlike_to_cast(graph, index, next_index)
    next_index = _fuse_transposes(graph, index, next_index, ("MatMul", "com.microsoft::FusedMatMul"))
    next_index = _fuse_fast_gelu(graph, index, next_index, constant)
    next_index = _fuse_quick_gelu(graph, index, next_index, constant)
    next_index = _fuse_matmul_scale(graph, index, next_index, constant)

    order = ort_order(graph, index)
    unknown = ort_unknown_shapes(graph, order, outer_unknown, view.symbols, view.declared)
    view.unknown_shape |= set(unknown)
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            _rewrite(sub, view, constant, unknown)
    graph.link()        # a subgraph's link() cleared the users of the outer values it reads
    view.index.update(index)
    view.orders[id(graph)] = order
    if graph is view.graph:
        view.order = order


def _drop(graph: Graph, node: Node, keep: Value, gone: Value) -> None:
    """Remove `node`, whose output `gone` equals its input `keep`: readers read `keep`. A graph
    output cannot be renamed, so then `keep`'s producer writes `gone` instead, if `keep` has
    no other reader and is neither an input nor an output (ORT's identity elimination)."""
    outputs = {id(v) for v in graph.outputs}
    touched = [*_touched(node), keep, gone]
    if id(gone) in outputs:
        p = keep.producer
        if p is None or len(keep.users) != 1 or id(keep) in outputs or keep.is_input:
            return
        p.outputs = [gone if o is keep else o for o in p.outputs]
        graph.nodes = [n for n in graph.nodes if n is not node]
        graph.relink(touched)
        return
    graph.nodes = [n for n in graph.nodes if n is not node]
    for user in list(gone.users):
        user.replace_input(gone, keep)
    graph.relink(touched)


def _touched(*nodes: Node) -> list[Value]:
    """What `nodes` read and write: the values whose producers and users change when they are
    added to a graph or taken out of it (`Graph.relink`)."""
    return [v for n in nodes for v in (*n.reads(), *n.outputs)]


def _ort_static(v: Value, unknown: dict[int, Dims]) -> bool:
    """Whether ORT's inference knows all of `v`'s dims: the IR's shape is static and
    ort_unknown_shapes did not find a dim ORT lacks (the IR may know more than ORT: a shape read
    back from remat's metadata, `written_graph`)."""
    return v.has_static_shape and id(v) not in unknown


def _eliminate(graph: Graph, unknown: dict[int, Dims]) -> None:
    """ORT's eliminations: `Identity`, `Expand` to the same shape (a constant one, after folding:
    expand_elimination.cc reads it from an initializer), `Cast` to the same type, a
    `Transpose` of a `Transpose` (composed into one; gone when that is the identity). A lone
    `Transpose` with the identity permutation stays: ORT's transpose optimizer only looks at a
    Transpose that reads another, and the kernel copies (measured: the ONNX export of a
    mixture-of-experts' `index_put` writes such transposes of [tokens, 256, 128])."""
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node not in graph.nodes:
                continue
            out = node.outputs[0] if node.outputs else None
            src = node.inputs[0] if node.inputs else None
            if out is None or src is None:
                continue
            if node.op == "Transpose" and src.producer is not None and src.producer.op == "Transpose" \
                    and _perm(node) and _perm(src.producer):
                inner = src.producer
                p1, p2 = _perm(inner), _perm(node)
                node.inputs = [inner.inputs[0]]
                node.attrs["perm"] = [p1[p] for p in p2]
                if len(src.users) == 1 and all(v is not src for v in graph.outputs):
                    graph.nodes = [n for n in graph.nodes if n is not inner]
                graph.relink(_touched(inner))      # src, inner's output, read now from inner's input
                if node.attrs["perm"] == list(range(len(p2))):
                    _drop(graph, node, node.inputs[0], out)
                changed = True
                continue
            same = (node.op == "Identity"
                    or (node.op == "Expand" and len(node.inputs) > 1 and node.inputs[1] is not None
                        and node.inputs[1].is_initializer and _ort_static(src, unknown) and _ort_static(out, unknown)
                        and tuple(src.shape) == tuple(out.shape))
                    or (node.op == "Cast" and src.dtype is not DType.UNKNOWN and node.attrs.get("to") == src.dtype))
            if same:
                before = len(graph.nodes)
                _drop(graph, node, src, out)
                changed = changed or len(graph.nodes) != before


def _merge_common(graph: Graph) -> None:
    """ORT's common-subexpression elimination: a node with the op, attributes and inputs (the same
    values) of an earlier one is dropped and its readers read the earlier one's outputs. (remat's
    recompute clones read their inputs through `Reshape(x, Shape(x))` views to stay apart.)"""
    outputs = {id(v) for v in graph.outputs}
    seen: dict[tuple, Node] = {}
    keep = []
    for node in graph.nodes:
        key = None
        if not node.subgraphs and node.op_type not in _NONDETERMINISTIC and node.outputs \
                and not any(id(o) in outputs for o in node.outputs):
            try:
                key = (node.op, tuple(id(v) if v is not None else None for v in node.inputs),
                       repr(sorted(node.attrs.items())), len(node.outputs))
            except Exception:
                key = None
        first = seen.get(key) if key is not None else None
        if first is None:
            if key is not None:
                seen[key] = node
            keep.append(node)
            continue
        for mine, theirs in zip(node.outputs, first.outputs):
            for user in list(mine.users):
                user.replace_input(mine, theirs)
    if len(keep) != len(graph.nodes):
        graph.nodes = keep
        graph.link()


def _fuse_matmul_add(graph: Graph, index: dict[int, int], next_index: int, unknown: dict[int, Dims]) -> int:
    """ORT's MatMulAddFusion: `Add(MatMul(a, w), bias)`, w 2-D, the product read by the Add alone,
    becomes a Gemm (a of rank > 2 flattened to 2-D before it and the result reshaped after it:
    views). Three new nodes, new indices; the product is no longer a tensor. The bias is what
    Gemm's C broadcasts from (matmul_add_fusion.cc): [N]; with a 2-D, also [1, N], [M, 1] and
    [M, N] (a tied weight's gradient, the product plus the embedding's gradient, is fused so)."""
    outputs = {id(v) for v in graph.outputs}
    for node in ort_order(graph, index):
        if node.op != "Add" or node not in graph.nodes:
            continue
        for slot in (0, 1):
            mm_out, bias = node.inputs[slot], node.inputs[1 - slot]
            mm = mm_out.producer if mm_out is not None else None
            if (mm is None or mm.op != "MatMul" or len(mm_out.users) != 1 or id(mm_out) in outputs
                    or bias is None or bias.shape is None):
                continue
            a, w = mm.inputs
            if a is None or w is None or not _ort_static(a, unknown) or not _ort_static(w, unknown) \
                    or len(w.shape) != 2 or len(a.shape) < 2 or not _ort_static(node.outputs[0], unknown):
                continue
            m, n = a.shape[0], w.shape[1]
            if tuple(bias.shape) != (n,) and (len(a.shape) != 2 or tuple(bias.shape) not in ((1, n), (m, 1), (m, n))):
                continue
            rows = 1
            for d in a.shape[:-1]:
                rows *= d
            out = node.outputs[0]
            if len(a.shape) == 2:
                fused = [Node("Gemm", [a, w, bias], [out], {}, f"{mm.name}/MatMulAddFusion")]
            else:
                flat = Value(f"{a.name}_gemm_input", a.dtype, (rows, a.shape[-1]))
                product = Value(f"{out.name}_gemm_output", out.dtype, (rows, n))
                fused = [Node("Reshape", [a, _shape_const(graph, flat)], [flat], {}, "gemm_input_reshape"),
                         Node("Gemm", [flat, w, bias], [product], {}, f"{mm.name}/MatMulAddFusion"),
                         Node("Reshape", [product, _shape_const(graph, out)], [out], {}, "gemm_output_reshape")]
            at = graph.nodes.index(node)
            graph.nodes[at:at + 1] = fused
            graph.nodes = [n_ for n_ in graph.nodes if n_ is not mm]
            for f in fused:
                index[id(f)] = next_index
                next_index += 1
            graph.relink(_touched(node, mm, *fused), added=fused)
            break
    return next_index


def _shape_const(graph: Graph, like: Value) -> Value:
    v = Value(f"{like.name}_shape", DType.INT64, (len(like.shape),), is_initializer=True)
    v.ints = [int(d) for d in like.shape]
    graph.initializers.append(v)
    return v


def _castlike_to_cast(graph: Graph, index: dict[int, int], next_index: int) -> int:
    """`CastLike(x, like)` becomes `Cast(x, to=like's type)`, a new node (new index) that no longer
    waits for `like`; made after constant folding, it is not folded even when x is a constant."""
    for node in ort_order(graph, index):
        if node.op != "CastLike" or len(node.inputs) < 2 or node.inputs[1] is None \
                or node.inputs[1].dtype is DType.UNKNOWN:
            continue
        cast = Node("Cast", [node.inputs[0]], node.outputs, {"to": node.inputs[1].dtype}, "")
        graph.nodes = [cast if n is node else n for n in graph.nodes]
        index[id(cast)] = next_index
        next_index += 1
        graph.relink(_touched(node), added=[cast])
    return next_index


def _fuse_transposes(graph: Graph, index: dict[int, int], next_index: int, ops: tuple[str, ...]) -> int:
    """A `Transpose` swapping the last two dims (2-D for Gemm; for MatMul also one with the
    identity permutation) folded into the matmul reading it: a new Gemm or FusedMatMul with
    transA/transB, and a new index. The Transpose may have other readers; it goes when the last
    of them is fused (matmul_transpose_fusion.cc counts consumers), and stays for any other.
    A Transpose that writes a graph output is not folded."""
    outputs = {id(v) for v in graph.outputs}
    order = ort_order(graph, index)
    for node in order:
        if node.op not in ops:
            continue
        attrs = dict(node.attrs)
        inputs = list(node.inputs)
        folded = []
        for slot, flag in ((0, "transA"), (1, "transB")):
            v = inputs[slot] if slot < len(inputs) else None
            t = v.producer if v is not None else None
            if t is None or t.op != "Transpose" or id(v) in outputs or not _perm(t):
                continue
            swap = _swaps_last_two(t) and (node.op != "Gemm" or len(_perm(t)) == 2)
            identity = node.op != "Gemm" and _perm(t) == list(range(len(_perm(t))))
            if not (swap or identity):
                continue
            inputs[slot] = t.inputs[0]
            if swap:
                attrs[flag] = 1 - int(attrs.get(flag, 0))
            folded.append(t)
        if not folded:
            continue
        op = "Gemm" if node.op == "Gemm" else "com.microsoft::FusedMatMul"
        suffix = "GemmTransposeFusion" if op == "Gemm" else "MatmulTransposeFusion"
        fused = Node(op, inputs, node.outputs, attrs, f"{node.name}/{suffix}/")
        next_index = _put_fused(graph, index, next_index, node, fused, folded)
    return next_index


def _put_fused(graph: Graph, index: dict[int, int], next_index: int, node: Node, fused: Node,
               folded: list[Node], gone: tuple[Node, ...] = ()) -> int:
    """`fused` in `node`'s place with the next free index; the nodes in `gone` removed, and those
    of `folded` that nothing reads any more (an output of the graph is read). Returns the next
    free index."""
    outputs = {id(v) for v in graph.outputs}
    dropped = {id(n) for n in gone}
    graph.nodes = [fused if n is node else n for n in graph.nodes if id(n) not in dropped]
    graph.relink(_touched(node, fused, *gone), added=[fused])
    unread = [t for t in folded if not any(o.users or id(o) in outputs for o in t.outputs)]
    if unread:
        graph.nodes = [n for n in graph.nodes if all(n is not t for t in unread)]
        graph.relink(_touched(*unread))
    index[id(fused)] = next_index
    return next_index + 1


def _reads(node: Node, v: Value) -> int:
    """How many edges ORT's graph has from `v` to `node` (an input slot each; a subgraph's reads
    of it one implicit input)."""
    return sum(1 for w in node.inputs if w is v) + any(w is v for sub in node.subgraphs.values()
                                                       for w in captured_values(sub))


def _edges(v: Value) -> int:
    return sum(_reads(user, v) for user in v.users)


def _scale_operand(node: Node, constant: set[int]) -> int | None:
    """The position of the scalar constant a `Mul` or `Div` scales by (a divisor only: Div's
    input 1), where it has one: a constant of one element whose rank is at most the other
    operand's, so that it broadcasts nothing (matmul_scale_fusion.cc, GetScaleFromNode)."""
    if node.op not in ("Mul", "Div") or len(node.inputs) != 2 or None in node.inputs:
        return None
    for slot in ((1,) if node.op == "Div" else (0, 1)):
        scale, other = node.inputs[slot], node.inputs[1 - slot]
        if id(scale) not in constant or scale.shape is None or not all(d == 1 for d in scale.shape):
            continue
        if other.shape is not None and len(scale.shape) > len(other.shape):
            continue
        return slot
    return None


def _fuse_matmul_scale(graph: Graph, index: dict[int, int], next_index: int, constant: set[int]) -> int:
    """ORT's MatMulScaleFusion (level 2, after the transposes'): a `Mul` or `Div` by a scalar
    constant on a matmul's input (its other operand of known rank above 0) or on its output (read
    by that node alone, not a graph output) becomes FusedMatMul's `alpha`: a new node, a new
    index, and the scaled product (or input) is no longer a tensor. An input's scale node goes
    when the matmul was its only reader. On the CPU only float and double matmuls fuse. Measured:
    a softcapped loss's `logits / cap` in a chunk Loop's body (one slice buffer fewer)."""
    outputs = {id(v) for v in graph.outputs}
    for node in ort_order(graph, index):
        if node.op not in ("MatMul", "com.microsoft::FusedMatMul") or node not in graph.nodes \
                or len(node.inputs) < 2 or None in node.inputs[:2] \
                or node.inputs[0].dtype not in (DType.FLOAT32, DType.FLOAT64):
            continue
        inputs = list(node.inputs)
        merged_inputs = []
        for slot in (0, 1):
            scaler = inputs[slot].producer
            at = _scale_operand(scaler, constant) if scaler is not None else None
            if at is None:
                continue
            unscaled = scaler.inputs[1 - at]
            if unscaled.shape is None or not unscaled.shape:
                continue
            inputs[slot] = unscaled
            merged_inputs.append(scaler)
        product = node.outputs[0]
        scaled_by = None
        if id(product) not in outputs and _edges(product) == 1:
            user = product.users[0]
            at = _scale_operand(user, constant)
            if at is not None and user.inputs[1 - at] is product:
                scaled_by = user
        if not merged_inputs and scaled_by is None:
            continue
        result = scaled_by.outputs[0] if scaled_by is not None else product
        fused = Node("com.microsoft::FusedMatMul", inputs, [result], dict(node.attrs),
                     f"{node.name}/MatMulScaleFusion/")
        next_index = _put_fused(graph, index, next_index, node, fused, merged_inputs,
                                (scaled_by,) if scaled_by is not None else ())
    return next_index


def _constant_payload(node: Node):
    """A `Constant` node's value: its TensorProto, or the number it states."""
    for key in ("value", "value_float", "value_int"):
        if key in node.attrs:
            return node.attrs[key]
    return None


def _number(v: Value | None, constant: set[int]) -> float | None:
    """The number a constant of one element holds (rank 0 or [1], as ORT's IsScalar), else None."""
    if v is None or id(v) not in constant or v.shape is None or len(v.shape) > 1 \
            or any(d != 1 for d in v.shape):
        return None
    data = v.data
    if isinstance(data, onnx.TensorProto):
        from onnx import numpy_helper

        data = numpy_helper.to_array(data)
    try:
        return float(np.asarray(data, dtype=np.float64).reshape(-1)[0]) if data is not None else None
    except (TypeError, ValueError, IndexError):
        return None


def _holds(v: Value | None, expected: float, constant: set[int]) -> bool:
    """ORT's IsInitializerWithExpectedValue: within FLT_EPSILON of `expected`."""
    got = _number(v, constant)
    return got is not None and math.isfinite(got) and abs(got - expected) <= FLT_EPSILON


FLT_EPSILON = 1.1920928955078125e-07


def _sole_reader(v: Value, op: str, outputs: set[int]) -> Node | None:
    """The one node that reads `v` (one edge), if it is an `op` in float32 whose outputs are not
    graph outputs (fast_gelu_fusion.cc's CheckNode on the next node of the chain)."""
    if id(v) in outputs or _edges(v) != 1:
        return None
    node = v.users[0]
    ok = node.op == op and not node.subgraphs and all(id(o) not in outputs for o in node.outputs) \
        and all(w.dtype is DType.FLOAT32 for w in node.present_inputs() if w.dtype is not DType.UNKNOWN)
    return node if ok else None


def _other(node: Node, v: Value) -> Value | None:
    """A binary node's input that is not `v`."""
    ins = list(node.inputs)
    return ins[1] if len(ins) == 2 and ins[0] is v else ins[0] if len(ins) == 2 and ins[1] is v else None


def _gelu_core(start: Node, constant: set[int], outputs: set[int]) -> tuple[Value, Node, list[Node]] | None:
    """The part of a tanh GELU from `start` to the Tanh's input (fast_gelu_fusion.cc's two
    formulas): x, the node whose output the Tanh reads, and the nodes so far. First formula:
    Mul(x, 0.044715) -> Mul(x) -> Add(1) -> Mul(Mul(x, sqrt(2/pi))); second (nanoGPT's
    `x + 0.044715 * pow(x, 3)`): Pow(x, 3) -> Mul(0.044715) -> Add(x) -> Mul(sqrt(2/pi))."""
    if start.op == "Mul" and len(start.inputs) == 2:
        for k in (0, 1):
            if not _holds(start.inputs[k], 0.044715, constant):
                continue
            x = start.inputs[1 - k]
            mul2 = _sole_reader(start.outputs[0], "Mul", outputs)
            if mul2 is None or _other(mul2, start.outputs[0]) is not x:
                return None
            add1 = _sole_reader(mul2.outputs[0], "Add", outputs)
            if add1 is None or not _holds(_other(add1, mul2.outputs[0]), 1.0, constant):
                return None
            mul3 = _sole_reader(add1.outputs[0], "Mul", outputs)
            mul4 = _other(mul3, add1.outputs[0]).producer if mul3 is not None else None
            if mul4 is None or mul4.op != "Mul" or _edges(mul4.outputs[0]) != 1 or id(mul4.outputs[0]) in outputs:
                return None
            if not any(_holds(mul4.inputs[j], SQRT_2_OVER_PI, constant) and mul4.inputs[1 - j] is x
                       for j in (0, 1)):
                return None
            return x, mul3, [start, mul2, add1, mul3, mul4]
        return None
    if start.op == "Pow" and len(start.inputs) == 2 and _holds(start.inputs[1], 3.0, constant):
        x = start.inputs[0]
        if x.producer is not None and x.producer.op == "Cast":
            return None     # ORT's Cast variant (ORTModule's fp16 exports) is not modelled: not fused
        mul1 = _sole_reader(start.outputs[0], "Mul", outputs)
        if mul1 is None or not _holds(_other(mul1, start.outputs[0]), 0.044715, constant):
            return None
        add1 = _sole_reader(mul1.outputs[0], "Add", outputs)
        if add1 is None or _other(add1, mul1.outputs[0]) is not x:
            return None
        mul2 = _sole_reader(add1.outputs[0], "Mul", outputs)
        if mul2 is None or not _holds(_other(mul2, add1.outputs[0]), SQRT_2_OVER_PI, constant):
            return None
        return x, mul2, [start, mul1, add1, mul2]
    return None


SQRT_2_OVER_PI = 0.7978845834732056


def _fuse_fast_gelu(graph: Graph, index: dict[int, int], next_index: int, constant: set[int]) -> int:
    """ORT's FastGeluFusion (level 2, on the CPU in float32): a tanh GELU written out,
    `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` (`_gelu_core`'s two spellings),
    becomes one FastGelu node, a new index, writing the last Mul's output; none of the chain's
    values exists. Each inner value must have this one reader, which a training step's forward
    gives only where the backward reads a recomputed copy (remat's recompute of the MLP's
    activation: measured on a hand-written GELU, 5 MiB of a 80 MiB step). The `0.5 * x` Mul is
    fused too; where something else reads it, the chain is left as it is here."""
    outputs = {id(v) for v in graph.outputs}
    for start in ort_order(graph, index):
        if start not in graph.nodes or start.op not in ("Mul", "Pow") or _edges(start.outputs[0]) != 1 \
                or not start.inputs or start.inputs[0] is None or start.inputs[0].dtype is not DType.FLOAT32:
            continue
        core = _gelu_core(start, constant, outputs)
        if core is None:
            continue
        x, tanh_input, chain = core
        tanh = _sole_reader(tanh_input.outputs[0], "Tanh", outputs)
        add2 = _sole_reader(tanh.outputs[0], "Add", outputs) if tanh is not None else None
        if add2 is None or not _holds(_other(add2, tanh.outputs[0]), 1.0, constant) or _edges(add2.outputs[0]) != 1:
            continue
        mul5 = add2.outputs[0].users[0]
        half = _other(mul5, add2.outputs[0]) if mul5.op == "Mul" else None
        mul6 = half.producer if half is not None else None
        if mul6 is None or mul6.op != "Mul" or id(mul5.outputs[0]) in outputs or _edges(half) != 1 \
                or not any(_holds(mul6.inputs[j], 0.5, constant) and mul6.inputs[1 - j] is x for j in (0, 1)):
            continue
        fused = Node("com.microsoft::FastGelu", [x], [mul5.outputs[0]], {}, "GPT2Gelu")
        next_index = _put_fused(graph, index, next_index, mul5, fused, [], (*chain, tanh, add2, mul6))
    return next_index


def _fuse_quick_gelu(graph: Graph, index: dict[int, int], next_index: int, constant: set[int]) -> int:
    """ORT's QuickGeluFusion (level 2): `x * sigmoid(x)` (SiLU, as an export writes LLaMA's
    SwiGLU) or `x * sigmoid(alpha * x)`, alpha a scalar constant, becomes one QuickGelu node
    named after the last Mul, a new index; the sigmoid (and the scaled x) is no longer a
    tensor. The sigmoid, and the scaling Mul, must have one reader and write no graph output,
    which a training step's forward gives where remat recomputes the activation for the
    backward. Measured: a SwiGLU step whose loss chunk's peak sat 5 MiB higher in ORT's block
    than the model placed it (the sigmoid's buffer opened a gap the model put a weight's
    transpose in). Float32 only here."""
    outputs = {id(v) for v in graph.outputs}
    for sigmoid in ort_order(graph, index):
        if sigmoid not in graph.nodes or sigmoid.op != "Sigmoid" or not sigmoid.inputs or sigmoid.inputs[0] is None:
            continue
        y = sigmoid.outputs[0]
        if y.dtype is not DType.FLOAT32 or id(y) in outputs or _edges(y) != 1 or y.users[0].op != "Mul":
            continue
        mul, x, scaled = y.users[0], sigmoid.inputs[0], []
        scaler = x.producer
        if scaler is not None and scaler.op == "Mul" and _edges(x) == 1 and id(x) not in outputs:
            for k in (0, 1):
                if _number(scaler.inputs[k], constant) is not None:
                    x, scaled = scaler.inputs[1 - k], [scaler]
                    break
        if _other(mul, y) is not x:
            continue
        fused = Node("com.microsoft::QuickGelu", [x], list(mul.outputs), {}, f"{mul.name}/QuickGeluFusion/")
        next_index = _put_fused(graph, index, next_index, mul, fused, [], (sigmoid, *scaled))
    return next_index


def _loop_shapes(node: Node, examples: dict[str, int]) -> None:
    """A Loop's output shapes, which ONNX inference leaves symbolic (it does not read the trip
    count): a carried value has its body output's shape, a scan output the trip count on top."""
    body = node.subgraphs.get("body")
    if node.op_type != "Loop" or body is None or not node.inputs or node.inputs[0] is None:
        return
    trip = node.inputs[0].ints
    carried = max(0, len(node.inputs) - 2)
    for k, out in enumerate(node.outputs):
        inner = body.outputs[1 + k] if 1 + k < len(body.outputs) else None
        dims = _dims(inner, examples)
        if dims is None or _evaluable(out, examples):
            continue
        if k < carried:
            out.shape = dims
        elif trip:
            out.shape = (int(trip[0]), *dims)


def _perm(node: Node) -> list[int] | None:
    perm = node.attrs.get("perm")
    if perm is None:
        src = node.inputs[0] if node.inputs else None
        if src is None or src.shape is None:
            return None
        return list(range(len(src.shape)))[::-1]
    return [int(p) for p in perm]


def _swaps_last_two(node: Node) -> bool:
    perm = _perm(node)
    if not perm or len(perm) < 2:
        return False
    n = len(perm)
    return perm[:n - 2] == list(range(n - 2)) and perm[n - 2:] == [n - 1, n - 2]


# Inputs (by position) that ONNX shape inference reads as data: when one is not a constant, the
# output's dims are unknown (a Loop body slices at `iteration * size`).
_SHAPE_DATA_INPUTS = {"Slice": (1, 2, 3, 4), "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Range": (0, 1, 2),
                      "ConstantOfShape": (0,), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "TopK": (1,), "OneHot": (1,),
                      "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
                      "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,), "CenterCropPad": (1,)}
# Ops whose output rank ONNX's inference knows when a data input has no shape at all (a Reshape's
# from its shape input's length). Every other op's inference gives no shape then: a broadcast
# (Mul of a known [2048, 128] and a `SequenceAt` element, which ORT knows no shape of) knows
# nothing, where the dims of the known input would be guessed (measured: ORT's shape of each
# value of the DeepSeek-V3 step, read back as graph outputs).
_RANK_WITHOUT_INPUT_SHAPES = frozenset({"Shape", "Size", "ConstantOfShape", "Reshape"})
_SAME_DIMS = frozenset({"Relu", "Sigmoid", "Tanh", "Gelu", "Erf", "Exp", "Log", "Neg", "Sqrt", "Reciprocal", "Abs",
                        "Not", "Cast", "CastLike", "Identity", "Softmax", "LogSoftmax", "Clip", "LeakyRelu",
                        "Elu", "Selu", "Softplus", "Softsign", "HardSigmoid", "Floor", "Ceil", "Round", "Sign"})
# Ops whose output has the shape of one input (by position), whatever the others' shapes.
_SHAPE_OF_INPUT = {**{op: 0 for op in _SAME_DIMS}, "ScatterElements": 0, "ScatterND": 0, "Scatter": 0,
                   "LayerNormalization": 0, "GatherElements": 1, "InstanceNormalization": 0,
                   "GroupNormalization": 0, "BatchNormalization": 0, "MeanVarianceNormalization": 0,
                   "LpNormalization": 0}
_BROADCASTS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                         "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Mod", "PRelu"})

Dims = tuple  # of int | None (unknown) per axis; None for an unknown rank


def input_symbols(graph: Graph) -> frozenset:
    """The symbols in the dims of `graph`'s inputs (`batch`, `seq`)."""
    return frozenset(sym for v in graph.inputs if v.shape is not None for d in v.shape
                     for sym in getattr(d, "free_symbols", ()))


def _ort_dims(shape, symbols: frozenset) -> Dims:
    """The IR's dims as ORT's inference can know them: a number, or a graph input's symbol (a
    `dim_param`). Unknown (None): a symbol no graph input has (the importer's `unk__N`, a dim it
    could not relate to the inputs) and an expression of symbols (`batch*seq`: ONNX's inference
    does no arithmetic on dim_params)."""
    return tuple(d if _is_number(d) or (d.is_Symbol and d in symbols) else None for d in shape)


def ort_unknown_shapes(graph: Graph, order: list[Node], outer: dict[int, Dims] | None = None,
                       symbols: frozenset | None = None, declared: frozenset = frozenset()) -> dict[int, Dims]:
    """The dims ORT's shape inference gives each value (None where a dim is unknown), for the
    values whose shape it does not fully know; its allocation planner never reuses a buffer for
    them nor writes one in place (it compares shapes, not sizes). Unknown: a Loop's outputs
    (ONNX's Loop inference does not read the trip count), sequences, an op's output whose dims
    come from a computed input (a Loop body's `Slice` at `iteration * size`); and what ONNX's
    inference rules carry them into: an elementwise op knows an axis when an input has a size
    above 1 there, a matmul takes M from A and N from B, a `Reshape` to a constant shape of
    positive dims knows it all, and none of them knows anything when an input has no shape at all
    (None: a `SequenceAt` element). A dim of a symbol that is no graph input's (`symbols`, by
    default `graph`'s inputs': `batch`, `seq`) is unknown: the importer's inference named a dim it
    could not relate to the inputs (`unk__N`), and ORT's knows no more. A value whose shape the
    file states (`declared`, by name: the exporter's value_info) is known whatever inference
    says: ORT starts from it and keeps the dims its inference cannot give. A value whose shape
    remat filled in for the estimate (FILLED_SHAPELESS: a written graph read back, whose shapes ONNX
    inference could not follow) and of which inference gave no shape at all has none here either
    where none of its dims is known (rank unknown, not only its dims). `outer`: the enclosing
    graphs' unknown values."""
    known: dict[int, Dims] = dict(outer or {})
    symbols = input_symbols(graph) if symbols is None else symbols

    def shapeless(v: Value) -> bool:
        """ONNX inference gave `v` no shape at all (remat filled one in for the sizes) and none of
        its dims is known here: ORT's inference knows not even its rank, and a broadcast with it
        knows nothing either (a known [512, 8] times it has no shape in ORT)."""
        if not v.meta.get(FILLED_SHAPELESS, False) or v.name in declared or id(v) not in known:
            return False
        dims = known[id(v)]
        return dims is None or all(d is None for d in dims)

    def dims(v: Value | None) -> Dims:
        if v is None:
            return ()
        if shapeless(v):
            return None
        if id(v) in known:
            return known[id(v)]
        if v.shape is not None and v.name in declared:
            return tuple(v.shape)
        return None if v.shape is None else _ort_dims(v.shape, symbols)

    def constant(v: Value) -> bool:
        return v.is_initializer or (v.ints is not None and v.producer is None)

    for node in order:
        op = node.op_type
        outs = list(node.outputs)
        if not outs or all(o.shape is not None and o.name in declared for o in outs):
            continue            # no output, or the file states their shapes: ORT knows them
        ir = outs[0].shape
        rank_unknown = None if ir is None else (None,) * len(ir)
        if op == "Loop" or op in ("SplitToSequence", "SequenceConstruct", "SequenceEmpty"):
            for o in outs:
                known[id(o)] = None if o.shape is None else (None,) * len(o.shape)
            continue
        ins = [dims(v) for v in node.inputs]
        read = [(v, d) for v, d in zip(node.inputs, ins) if v is not None and not v.is_initializer]
        shaped_by = _SHAPE_OF_INPUT.get(op)
        if shaped_by is not None:
            source = node.inputs[shaped_by] if shaped_by < len(node.inputs) else None
            read = [(source, ins[shaped_by])] if source is not None else []
        if op not in _RANK_WITHOUT_INPUT_SHAPES and any(d is None for _, d in read):
            for o in outs:              # ONNX's inference gives no shape at all when an input has none
                known[id(o)] = None
            continue
        data_inputs = _SHAPE_DATA_INPUTS.get(op, ())
        if any(k < len(node.inputs) and node.inputs[k] is not None and not constant(node.inputs[k])
               for k in data_inputs):
            for o in outs:
                known[id(o)] = None if o.shape is None else (None,) * len(o.shape)
            continue
        result: Dims | bool = True        # True: as the IR says, if every input is fully known
        if shaped_by is not None:
            result = ins[shaped_by] if shaped_by < len(ins) else True
        elif op == "Shape" and ins and ins[0] is not None and "start" not in node.attrs and "end" not in node.attrs:
            result = (len(ins[0]),)
        elif op in _BROADCASTS and all(d is not None for d in ins):
            result = _broadcast_known(ins)
        elif op in ("MatMul", "FusedMatMul") and len(ins) >= 2 and ins[0] is not None and ins[1] is not None \
                and len(ins[0]) >= 2 and len(ins[1]) >= 2:
            a, b = list(ins[0]), list(ins[1])
            if node.attrs.get("transA"):
                a[-2:] = a[-2:][::-1]
            if node.attrs.get("transB"):
                b[-2:] = b[-2:][::-1]
            batch = _broadcast_known([tuple(a[:-2]), tuple(b[:-2])])
            result = (*batch, a[-2], b[-1])
        elif op == "Gemm" and len(ins) >= 2 and ins[0] is not None and ins[1] is not None:
            m = ins[0][1] if node.attrs.get("transA") else ins[0][0]
            n = ins[1][0] if node.attrs.get("transB") else ins[1][1]
            result = (m, n)
        elif op == "Transpose" and ins and ins[0] is not None:
            perm = node.attrs.get("perm") or list(range(len(ins[0])))[::-1]
            result = tuple(ins[0][p] for p in perm)
        elif op in ("Reshape", "Expand", "ConstantOfShape"):
            shape = node.inputs[0] if op == "ConstantOfShape" else node.inputs[1]
            target = shape.ints if shape is not None else None
            if target is not None and op == "Reshape" and ins[0] is not None:
                result = _reshape_known(ins[0], list(target))
            elif target is not None and all(d > 0 for d in target):
                result = tuple(target) if op != "Expand" else _broadcast_known([ins[0], tuple(target)])
        if result is True:
            if any(d is None or any(x is None for x in d) for _, d in read):
                for o in outs:
                    known[id(o)] = None if o.shape is None else (None,) * len(o.shape)
            else:
                for o in outs:
                    if o.shape is not None and any(x is None for x in _ort_dims(o.shape, symbols)):
                        known[id(o)] = _ort_dims(o.shape, symbols)
        elif result is None or any(x is None for x in result):
            known[id(outs[0])] = result if result is not None else rank_unknown
            for o in outs[1:]:
                known[id(o)] = None if o.shape is None else (None,) * len(o.shape)
    for v in graph.values():
        if shapeless(v):
            known[id(v)] = None
    return {k: v for k, v in known.items() if v is None or any(x is None for x in v)}


def _reshape_known(src: Dims, target: list[int]) -> Dims:
    """ONNX's Reshape inference: 0 copies the input's dim, -1 is inferred when the input's dims
    are all known."""
    out = [src[k] if d == 0 and k < len(src) else d for k, d in enumerate(target)]
    if -1 in out:
        rest = [d for d in out if d != -1]
        if all(isinstance(d, int) for d in src) and all(d is not None for d in rest):
            total = 1
            for d in src:
                total *= d
            part = 1
            for d in rest:
                part *= d
            out[out.index(-1)] = total // max(part, 1)
        else:
            out[out.index(-1)] = None
    return tuple(out)


def _broadcast_known(shapes: list[Dims]) -> Dims:
    """ONNX's broadcast inference (multidirectionalBroadcastShapeInference) over dims that may be
    symbols or unknown (None): a number other than 1 wins; else one symbol, where every dim that
    is not 1 is that same symbol (or every one is unknown); else unknown."""
    n = max(len(s) for s in shapes)
    padded = [(1,) * (n - len(s)) + tuple(s) for s in shapes]
    out = []
    for col in zip(*padded):
        numbers = [d for d in col if d is not None and _is_number(d) and d != 1]
        others = {d for d in col if d is None or not _is_number(d)}
        if numbers:
            out.append(numbers[0])
        elif not others:
            out.append(1)
        else:
            out.append(others.pop() if len(others) == 1 else None)
    return tuple(out)


def _is_number(d) -> bool:
    return isinstance(d, int) or bool(getattr(d, "is_Integer", False))


def ort_transient(node: Node, examples: dict[str, int]) -> int:
    """Bytes an ONNX Runtime CPU kernel allocates for itself during its step: `Where` makes the
    selections broadcast(cond, X) and broadcast(cond, Y) before it merges them (where_op.cc)."""
    if node.op != "Where" or len(node.inputs) != 3 or any(v is None for v in node.inputs):
        return 0
    cond, x, y = (_dims(v, examples) for v in node.inputs)
    item = node.inputs[1].dtype.itemsize
    total = 0
    for side in (x, y):
        if cond is not None and side is not None:
            n = 1
            for d in _broadcast_dims(cond, side):
                n *= d
            total += n * item
    return total


def ort_memory_model(view: OrtView) -> MemoryModel:
    """ONNX Runtime's placement of tensors (see the module docstring), for `simulate_peak` on
    `view.graph` in `view.order`."""
    examples = view.graph.dim_examples

    def sequence(v: Value) -> bool:
        return v.dtype is DType.UNKNOWN and v.producer is not None and v.producer.op_type == "SplitToSequence"

    def size_of(v: Value) -> int | None:
        """A sequence holds its pieces: the bytes of the tensor it was split from."""
        if sequence(v) and v.producer.inputs and v.producer.inputs[0] is not None:
            dims = _dims(v.producer.inputs[0], examples)
            if dims is not None:
                n = 1
                for d in dims:
                    n *= d
                return n * v.producer.inputs[0].dtype.itemsize
        return None

    return MemoryModel(alias_ops=ORT_ALIAS_OPS, inplace_ops=ORT_INPLACE_OPS, reuse_same_shape=True, arena=True,
                       alignment=ORT_ALIGNMENT, outputs_in_arena=False,
                       transient=lambda node, size: ort_transient(node, examples), size_of=size_of,
                       apart=sequence,
                       known_shape=lambda v: id(v) not in view.unknown_shape and v.shape is not None,
                       order_of=lambda sub: view.orders.get(id(sub), sub.nodes))


def written_graph(model_or_graph: Graph | onnx.ModelProto | str | Path) -> Graph:
    """The IR of the file ONNX Runtime would load: a model or path as it is, an IR graph as
    `export_model` writes it (scheduled for ORT, recompute barriers), read back. ONNX shape
    inference cannot follow everything remat writes (a Loop body's `Slice` at a computed
    offset, `Reshape(x, Shape(x))`): an IR graph's own shapes are kept by name, and what is
    still unknown is inferred here for the ops these graphs use (`fill_shapes`)."""
    from .importer import import_model
    from .ort_schedule import schedule_for_onnxruntime

    if isinstance(model_or_graph, Graph):
        return _written(schedule_for_onnxruntime(model_or_graph))
    graph = import_model(model_or_graph, read_through=False)     # the file as ORT reads it
    stored = _example_shapes(graph.meta["onnx_model"])

    def stored_shape(v: Value) -> tuple[int, ...] | None:
        dims = _by_name(stored, v.name)
        return tuple(dims) if dims is not None else None

    _adopt_shapes(graph, stored_shape)
    fill_shapes(graph, graph.dim_examples)
    return graph


def _example_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """The shapes remat wrote into the model's metadata (importer.EXAMPLE_SHAPES_KEY), where it
    wrote them and they are well formed; else none."""
    import json

    from .importer import EXAMPLE_SHAPES_KEY

    text = next((p.value for p in model.metadata_props if p.key == EXAMPLE_SHAPES_KEY), None)
    try:
        data = json.loads(text) if text is not None else {}
    except (json.JSONDecodeError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)}


def _by_name(known: dict, name: str):
    """`known[name]`, or for a recompute barrier's view (`x_rc_view`, written by the exporter)
    its value's entry."""
    if name not in known and name.endswith("_rc_view"):
        name = name[:-len("_rc_view")]
    return known.get(name)


# Value.meta key, True on a value of a written graph read back to which ONNX inference gave no
# shape at all and remat gave its shape at the example sizes (`_fill_shape`): the sizes are the
# estimate's; ORT's inference knows not even its rank (ort_unknown_shapes). A value inference gave
# a rank is left to ort_unknown_shapes' structural model (ORT, folding first, can know more).
FILLED_SHAPELESS = "remat.filled_shapeless"


def _fill_shape(v: Value, shape: tuple) -> None:
    """Give `v` the shape remat knows for it, noting where inference gave it none (FILLED_SHAPELESS)."""
    if v.shape is None:
        v.meta[FILLED_SHAPELESS] = True
    v.shape = shape


def _adopt_shapes(graph: Graph, shape_of) -> None:
    """Give each value whose shape is not known at the example sizes the shape `shape_of` has
    for it (None: none)."""
    for v in _all_values(graph):
        if _evaluable(v, graph.dim_examples):
            continue
        shape = shape_of(v)
        if shape is not None:
            _fill_shape(v, shape)


def _written(schedule: OrtSchedule) -> Graph:
    """The file the exporter writes for `schedule`, read back: the one it estimated, if it did."""
    return schedule.written if schedule.written is not None else _read_back(schedule.graph)


def _read_back(scheduled: Graph) -> Graph:
    """`scheduled` (already ordered for ORT) written as the exporter writes it and read back,
    with its own shapes kept by name where ONNX inference loses them."""
    from .exporter import ExportBug, export_model
    from .importer import import_model

    try:
        graph = import_model(export_model(scheduled, for_onnxruntime=False), read_through=False)
    except RematError as exc:       # remat wrote it: what the import's check refuses is remat's bug
        raise ExportBug(f"remat bug: the rewritten model is not valid ONNX: {exc}; nothing was written") from None
    known = {v.name: v for v in _all_values(scheduled)}

    def twin_shape(v: Value):
        twin = _by_name(known, v.name)
        return tuple(twin.shape) if twin is not None and twin.shape is not None and twin.dtype is v.dtype else None

    _adopt_shapes(graph, twin_shape)
    fill_shapes(graph, graph.dim_examples)
    return graph


def estimated_written_peak(scheduled: Graph) -> tuple[Graph, PeakEstimate]:
    """`scheduled` (already ordered for ORT, ort_schedule) read back as written, and its
    estimated peak: how the exporter compares leaf placements."""
    graph = _read_back(scheduled)
    return graph, _simulate(graph)


def declared_shapes(model: onnx.ModelProto | str | Path) -> frozenset:
    """The names of the values whose whole shape `model` states (value_info and outputs, in
    every subgraph), each dim a number or a name: ORT's graph resolve starts from them."""
    from .importer import graph_protos, load_model

    names = set()
    for graph in graph_protos(load_model(model).graph):
        for info in list(graph.value_info) + list(graph.output):
            t = info.type.tensor_type
            if t.HasField("shape") and all(d.HasField("dim_value") or d.dim_param for d in t.shape.dim):
                names.add(info.name)
    return frozenset(names)


def _simulate(written: Graph, declared: frozenset = frozenset()) -> PeakEstimate:
    view = ort_view(written, declared)
    return simulate_peak(view.graph, view.order, (), ort_memory_model(view))


def _all_values(graph: Graph):
    yield from graph.values()
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            yield from _all_values(sub)


def _evaluable(v: Value, examples: dict[str, int]) -> bool:
    from engine.shapes import evaluate

    return v.shape is not None and all(evaluate(d, examples) is not None for d in v.shape)


def _dims(v: Value | None, examples: dict[str, int]) -> tuple[int, ...] | None:
    from engine.shapes import evaluate

    if v is None or v.shape is None:
        return None
    dims = [evaluate(d, examples) for d in v.shape]
    return None if any(d is None for d in dims) else tuple(int(d) for d in dims)


def _broadcast_dims(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(s) for s in shapes)
    padded = [(1,) * (n - len(s)) + tuple(s) for s in shapes]
    return tuple(max(col) for col in zip(*padded))


def fill_shapes(graph: Graph, examples: dict[str, int]) -> int:
    """Static shapes, where the IR has none or dims without a value, for the outputs of the ops
    remat's graphs use (Slice between offsets `s` and `s + size`, `Reshape` to `Shape(x)` or to
    a constant, matmuls, broadcasts, transposes, sequences, Loops); in subgraphs too. Returns
    how many values it filled."""
    filled = 0
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            filled += fill_shapes(sub, examples)
        _loop_shapes(node, examples)
        src = node.inputs[0] if node.inputs else None
        if node.op in ORT_ALIAS_OPS and src is not None and src.ints is not None and node.outputs[0].ints is None:
            node.outputs[0].ints = list(src.ints)        # a constant seen through a view (CSE barriers)
        if all(_evaluable(o, examples) for o in node.outputs):
            continue
        shape = _infer(node, examples)
        if shape is None:
            continue
        out = node.outputs[0]
        if not _evaluable(out, examples):
            _fill_shape(out, shape)
            filled += 1
    return filled


def _shape_of(target: Value | None, examples: dict[str, int]) -> tuple[int, ...] | None:
    """The dims a shape operand holds, at the example dims (`_int_values`)."""
    values = _int_values(target, examples)
    return None if values is None else tuple(values)


# Integer ops a shape computation is made of (a dynamic export's `Reshape` targets, the sizes
# of a `ConstantOfShape`), evaluated on small lists; Div is ONNX's integer division.
_INT_BINARY = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
               "Div": lambda a, b: a // b if b else None, "Max": max, "Min": min}
_INT_SMALL = 16         # a shape operand has a handful of values


def _shape_range(node: Node, rank: int) -> slice:
    """The dims a `Shape` node takes (its start and end attributes) of an input of `rank`."""
    return slice(node.attrs.get("start", 0), node.attrs.get("end", rank))


def _int_values(v: Value | None, examples: dict[str, int], depth: int = 0) -> list[int] | None:
    """The values of a small integer tensor computed from shapes (`Shape`, `Gather`, `Concat`,
    `Unsqueeze`, `Squeeze`, `Reshape`, `Cast`, `Slice`, arithmetic), at the example dims: a
    constant's ints, or evaluated through its producers. None where any part is not known."""
    if v is None or depth > 32:
        return None
    if v.ints is not None:
        return [int(d) for d in v.ints]
    node = v.producer
    if node is None or not node.inputs:
        return None
    op = node.op_type
    first = lambda: _int_values(node.inputs[0], examples, depth + 1)     # noqa: E731
    if op == "Shape":
        dims = _dims(node.inputs[0], examples)
        return None if dims is None else list(dims[_shape_range(node, len(dims))])
    if op in ("Unsqueeze", "Squeeze", "Reshape", "Identity", "Cast", "Flatten"):
        return first()
    if op == "Concat":
        parts = [_int_values(x, examples, depth + 1) for x in node.inputs]
        return None if any(x is None for x in parts) else [d for x in parts for d in x]
    if op == "Gather" and node.attrs.get("axis", 0) == 0 and len(node.inputs) > 1:
        data, index = first(), _int_values(node.inputs[1], examples, depth + 1)
        if data is None or index is None or any(not -len(data) <= k < len(data) for k in index):
            return None
        return [data[k] for k in index]
    if op == "Slice" and len(node.inputs) >= 3:
        data = first()
        starts, ends = (_int_values(node.inputs[k], examples, depth + 1) for k in (1, 2))
        if data is None or not starts or not ends or len(node.inputs) > 4:
            return None
        return data[starts[0]:ends[0]]
    if op in _INT_BINARY and len(node.inputs) == 2:
        a, b = first(), _int_values(node.inputs[1], examples, depth + 1)
        if a is None or b is None or len(a) > _INT_SMALL or len(b) > _INT_SMALL or \
                (len(a) != len(b) and 1 not in (len(a), len(b))):
            return None
        n = max(len(a), len(b))
        out = [_INT_BINARY[op](a[k % len(a)], b[k % len(b)]) for k in range(n)]
        return None if any(x is None for x in out) else out
    return None


def _infer(node: Node, examples: dict[str, int]) -> tuple[int, ...] | None:
    ins = [_dims(v, examples) for v in node.inputs]
    op = node.op_type
    if op in _SHAPE_OF_INPUT:
        k = _SHAPE_OF_INPUT[op]
        return ins[k] if k < len(ins) else None
    if op in _BROADCASTS and ins and all(s is not None for s in ins):
        return _broadcast_dims(*ins)
    if op == "Transpose" and ins[0] is not None:
        perm = node.attrs.get("perm") or list(range(len(ins[0])))[::-1]
        return tuple(ins[0][p] for p in perm)
    if op in ("MatMul", "FusedMatMul") and len(ins) >= 2 and ins[0] is not None and ins[1] is not None:
        a, b = list(ins[0]), list(ins[1])
        if node.attrs.get("transA"):
            a[-2:] = a[-2:][::-1]
        if node.attrs.get("transB"):
            b[-2:] = b[-2:][::-1]
        if len(a) == 1 or len(b) == 1:
            return None
        batch = _broadcast_dims(tuple(a[:-2]), tuple(b[:-2])) if len(a) > 2 or len(b) > 2 else ()
        return (*batch, a[-2], b[-1])
    if op == "Gemm" and ins[0] is not None and ins[1] is not None:
        m = ins[0][1] if node.attrs.get("transA") else ins[0][0]
        n = ins[1][0] if node.attrs.get("transB") else ins[1][1]
        return (m, n)
    if op == "Expand" and ins[0] is not None and len(node.inputs) > 1:
        target = _shape_of(node.inputs[1], examples)
        return None if target is None else _broadcast_dims(ins[0], target)
    if op == "Reshape" and ins[0] is not None and len(node.inputs) > 1:
        target = _int_values(node.inputs[1], examples)      # constant, Shape(y), or computed from shapes
        if target is None:
            return None
        dims = _reshape_known(ins[0], target)
        return None if any(d is None or d < 0 for d in dims) else dims
    if op == "Slice" and ins[0] is not None and len(node.inputs) >= 3:
        starts, ends = node.inputs[1], node.inputs[2]
        axes = node.inputs[3].ints if len(node.inputs) > 3 and node.inputs[3] is not None else None
        width = None
        if ends is not None and ends.producer is not None and ends.producer.op == "Add":
            for a, b in (ends.producer.inputs, ends.producer.inputs[::-1]):
                if a is starts and b is not None and b.ints and len(b.ints) == 1:
                    width = b.ints[0]
        if width is not None and axes and len(axes) == 1:
            dims = list(ins[0])
            dims[axes[0] % len(dims)] = width
            return tuple(dims)
    if op == "SequenceAt" and node.inputs[0] is not None and node.inputs[0].producer is not None:
        split = node.inputs[0].producer
        src = _dims(split.inputs[0], examples) if split.op_type == "SplitToSequence" else None
        pos = node.inputs[1].ints if node.inputs[1] is not None else None
        sizes = split.inputs[1].ints if len(split.inputs) > 1 and split.inputs[1] is not None else None
        if src is not None and pos and sizes and len(sizes) > 1:
            axis = split.attrs.get("axis", 0) % len(src)
            dims = list(src)
            dims[axis] = sizes[pos[0]]
            return tuple(dims)
    if op in ("ReduceSum", "ReduceMean", "ReduceMax") and ins[0] is not None:
        axes = node.inputs[1].ints if len(node.inputs) > 1 and node.inputs[1] is not None else node.attrs.get("axes")
        if axes is None:
            return None
        keep = node.attrs.get("keepdims", 1)
        axes = {a % len(ins[0]) for a in axes}
        return tuple(1 if k in axes else d for k, d in enumerate(ins[0]) if keep or k not in axes)
    if op == "LayerNormalization" and ins[0] is not None:
        return ins[0]
    if op == "Shape" and node.inputs[0] is not None and node.inputs[0].shape is not None:
        rank = len(node.inputs[0].shape)
        return (len(range(rank)[_shape_range(node, rank)]),)
    if op == "ConstantOfShape":
        return _shape_of(node.inputs[0], examples)
    return None


def estimated_ort_peak(model_or_graph: Graph | onnx.ModelProto | str | Path) -> PeakEstimate:
    """Peak memory of one training step in a default ONNX Runtime session on the CPU, above the
    process's resting memory, as `backends.onnx.runtime.measure` measures it: the graph as
    written (`written_graph`), rewritten and ordered as ORT does (`ort_view`), simulated with
    ORT's allocation planner and memory pattern (`ort_memory_model`). The estimate's `order`
    holds the nodes of the rewritten copy, `curve` the bytes at each of them."""
    if isinstance(model_or_graph, Graph):
        from .ort_schedule import schedule_for_onnxruntime

        schedule = schedule_for_onnxruntime(model_or_graph)
        if schedule.estimate is not None:       # the exporter estimated it when it chose the placement
            return schedule.estimate
        return _simulate(_written(schedule))
    return _simulate(written_graph(model_or_graph), declared_shapes(model_or_graph))

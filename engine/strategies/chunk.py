"""Chunking: run a memory-amplifying region of a joint graph slice by slice.

A chunk rule names the values to slice (`chunk over h along 0 into N`) at a match whose
root amplifies them (the logits of `MatMul(h, w)`). The region grows from the root:

- forward, to every node that reads a large region value (or makes a large value from a
  region value), so the logits, their log-softmax and, on a joint graph, their gradient
  all stay inside;
- backward, to the producer of every large value a region node needs sliced (the zeros
  `nll_loss_backward` scatters into), so no large value is built whole outside.

How an op carries the chunk dim from its inputs to its output is not hard-coded per
pattern: the rule files declare each op's kind (`chunkable pointwise Add, Mul`), and
`dim_map` knows what each kind does with dims. Each region value gets a ChunkMeta:
sliced along `dim` (the chunks are concatenated), a partial sum (`need_sum`: the chunks
are added, as for a weight gradient), and `scaled` when it was computed with the incoming
gradient replaced by one, so the gradient is applied once, after the chunks (the
`scale_by` trick of Inductor's auto-chunker): that is what lets each chunk's backward run
right after its forward, before the incoming gradient exists.

A region whose backward reads a gradient computed from its own forward output (attention:
the gradient of `softmax(QK^T) V` arrives after the rest of the network has run on it) cannot
run forward and backward in one pass over the slices. It runs in two phases: the forward
slices, then, once that gradient exists, the backward slices, which recompute the forward
values they read (the scores and their softmax), as flash attention does. Neither phase
keeps a large value whole, and nothing large is saved between them.

Values the region reads but does not slice (weights, the global count of a mean over
non-ignored labels) are computed outside it, whole, so a mean is divided by the global
count, never by a chunk's. A region through an op with no declared kind, a dim an op
cannot carry, or a gradient an op is not linear in, is refused with a reason naming the op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..guards import Unproven, evaluate_expr
from ..ir import DECOMPOSED_FROM, Graph, Node, Value
from ..matcher import Match, MatchContext, Reason
from ..patterns import Chunk
from ..shapes import evaluate

CHUNK_KINDS = {
    "pointwise": "broadcasting elementwise: each output dim is the same dim of every input",
    "matmul": "batch dims and rows from the first input, columns from the second; the "
              "contracted dim is summed",
    "transpose": "output dim i is input dim perm[i]",
    "reshape": "a dim is kept where it has the same size after the same number of elements",
    "sum": "a sum over axes: slicing a summed axis gives partial sums",
    "reduce": "a reduction (max, mean) over axes: a reduced axis cannot be sliced",
    "axis": "an op along one axis (softmax): every other dim can be sliced",
    "unsqueeze": "inserts a dim of size 1",
    "squeeze": "removes dims of size 1",
    "gather_elements": "output dims follow the index; the data's other dims follow too",
    "scatter_elements": "output dims follow the data; index and updates follow except the axis",
    "fill": "a new tensor from a shape: sliced by writing the chunk's size into the shape",
    "like": "a new tensor shaped like its input (ones_like): dims follow, values do not depend on it",
    "shape": "the shape of its input (ONNX Shape, Size): a slice's shape, computed per slice",
    "cast_like": "its first input, cast to the type of its second (ONNX CastLike), read for its type only",
    "expand": "broadcasts its input to a shape: sliced like pointwise, with the shape rewritten",
}

# Inputs an op of a kind reads only for their shape or type, not their values: nothing the
# region computes flows through them, and a slice read there needs no dim in the output.
TYPE_ONLY = {"like": {0}, "shape": {0}, "cast_like": {1}}

# The operands each kind reads by position: a node with fewer is refused, not indexed past.
MIN_INPUTS = {"matmul": 2, "cast_like": 2, "gather_elements": 2, "scatter_elements": 2, "fill": 0, "shape": 1}

# Set by a backend on the nodes it writes out for one slice: a slice is not chunked again.
CHUNK_SLICE = "chunk_slice"

LARGE_FRACTION = 2      # a value is large when at least half the root's output
MAX_TANGENT_CHAIN = 16  # nodes between the incoming gradient and the region, redone with it as one


@dataclass(frozen=True)
class ChunkMeta:
    dim: int | None = None       # sliced along this dim: the chunks are concatenated
    need_sum: bool = False       # a partial sum: the chunks are added
    scaled: bool = False         # computed with the incoming gradient as one: multiply once at the end


@dataclass
class DimMap:
    """How one node's output dims relate to its inputs' dims."""

    maps: list[dict[int, int]]                  # per input position: output dim -> input dim
    summed: list[list[tuple[int, int]]] = field(default_factory=list)   # (input, dim) summed together
    blocked: set[tuple[int, int]] = field(default_factory=set)          # (input, dim) never sliced


@dataclass
class ChunkPhase:
    """One pass over the slices: its nodes run once per slice."""

    nodes: list[Node]                           # in schedule order
    inputs: list[Value]                         # read from outside the phase
    outputs: list[Value]                        # read outside the region
    recomputed: list[Node] = field(default_factory=list)   # an earlier phase's nodes, run again here


@dataclass
class ChunkRegion:
    match: Match
    nodes: list[Node]                           # in schedule order
    meta: dict[int, ChunkMeta]                  # value id -> meta, for region values and inputs
    inputs: list[Value]                         # read by the region from outside it
    chunks: list[int]                           # the size of each slice along the chunk dim
    tangent: Value | None = None                # the incoming gradient the scaled outputs get
    tangent_chain: list[Node] = field(default_factory=list)   # outside nodes to redo with it as one
    elided: list[Node] = field(default_factory=list)          # reshapes the slices skip
    phases: list[ChunkPhase] = field(default_factory=list)    # one, or forward then backward
    normalizer: str = ""                        # the first op of kind `axis` in the region (or
                                                # that a backend decomposed into region nodes)

    @property
    def key(self) -> str:
        """The matched ops, then the first op of kind `axis` the region runs (the softmax or
        log-softmax the amplified value feeds, decomposed or not), so the loss and the
        attention, both matched at a MatMul, are two plans a config can turn on one at a time:
        `MatMul+LogSoftmax+`, `MatMul+Softmax+`."""
        return "".join(n.op_type + "+" for n in self.match.nodes) + (f"{self.normalizer}+" if self.normalizer else "")

    @property
    def outputs(self) -> list[Value]:
        """The values read outside the region, phase by phase."""
        return [o for phase in self.phases for o in phase.outputs]

    @property
    def plan_type(self) -> int:
        return 3

    @property
    def targets(self) -> list[Value]:
        """The amplified value that is no longer built whole."""
        return [self.match.root.outputs[0]]

    @property
    def saved(self) -> Any:
        """Bytes of the amplified value that no longer exist at once: all but one slice."""
        whole = self.targets[0].nbytes or 0
        return whole - whole * max(self.chunks) // sum(self.chunks)

    added = 0

    @property
    def net(self) -> Any:
        return self.saved

    def meta_of(self, value: Value) -> ChunkMeta:
        return self.meta.get(id(value), ChunkMeta())


class Refused(Exception):
    pass


class _TwoPhases(Exception):
    """The region's backward reads the gradient of its own output: grow it again in two phases."""


def _int_list(x: Any) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, int):
        return [x]
    try:
        return [int(d) for d in x]
    except (TypeError, ValueError):
        return None


def _param(node: Node, name: str) -> Any:
    """An attribute by its ONNX name (importers spell every backend's arguments that way)."""
    return node.attrs.get(name)


def _axes(node: Node, inputs: list[Value]) -> list[int] | None:
    """The `axes` attribute, or, from ONNX opset 13, the constant second input."""
    axes = _int_list(_param(node, "axes"))
    if axes is None and len(inputs) > 1:
        axes = inputs[1].meta.get("ints")
        if axes is None:
            raise Refused(f"{node.op} {node.name}: its axes are computed, not constant")
    return axes


def _rank(v: Value) -> int:
    if v.shape is None:
        raise Refused(f"%{v.name} has no known shape")
    return len(v.shape)


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except TypeError:
        return False


def _shape(v: Value) -> tuple:
    _rank(v)
    return v.shape


def reshape_map(src: tuple, out: tuple) -> dict[int, int]:
    """Output dim -> input dim, for the dims a reshape keeps: same size, same number of
    elements before them."""
    mapping, before_in = {}, 1
    prefix_out = [1]
    for d in out:
        prefix_out.append(prefix_out[-1] * d)
    for i, d in enumerate(src):
        for o, d_out in enumerate(out):
            if _same(prefix_out[o], before_in) and _same(d_out, d):
                mapping[o] = i
                break
        before_in = before_in * d
    return mapping


def _broadcast(v: Value, out: Value, dims: int) -> dict[int, int]:
    """Output dim -> dim of `v` for the first `dims` output dims, numpy-aligned from the right,
    where `v` has the output's size (a broadcast dim of size 1 is not carried)."""
    shift = _rank(out) - _rank(v)
    return {o: o - shift for o in range(dims) if o - shift >= 0 and _same(v.shape[o - shift], out.shape[o])}


def dim_map(node: Node, kind: str, inputs: list[Value] | None = None) -> DimMap:
    """The DimMap of `node` under its declared kind; Refused when its parameters are unknown.
    `inputs` stands for the node's inputs where the grower reads through skipped reshapes.
    Inputs a kind does not map (a shape, the axes of an ONNX reduction) carry no dim."""
    inputs = list(node.present_inputs()) if inputs is None else inputs
    if not node.outputs:
        raise Refused(f"{node.op} {node.name} has no output")
    need = MIN_INPUTS.get(kind, 1)
    if len(inputs) < need:
        raise Refused(f"{node.op} {node.name} has {len(inputs)} operand(s); a `{kind}` op reads {need}")
    try:
        dm = _kind_map(node, kind, inputs)
    except (TypeError, ValueError) as exc:     # an attribute that is not what its kind reads
        raise Refused(f"{node.op} {node.name}: an attribute `{kind}` reads is malformed ({exc})") from None
    dm.maps += [{} for _ in inputs[len(dm.maps):]]
    return dm


def _kind_map(node: Node, kind: str, inputs: list[Value]) -> DimMap:
    out = node.outputs[0]
    rank = _rank(out)
    if kind in ("pointwise", "expand", "like", "cast_like"):
        return DimMap([_broadcast(v, out, rank) for v in (inputs if kind == "pointwise" else inputs[:1])])
    if kind in ("fill", "shape"):
        return DimMap([{} for _ in inputs])
    if kind == "matmul":
        a, b = inputs[0], inputs[1]
        ra, rb = _rank(a), _rank(b)
        if ra < 2 or rb < 2:
            raise Refused(f"{node.op} {node.name}: a 1-D operand")
        ma, mb = _broadcast(a, out, rank - 2), _broadcast(b, out, rank - 2)
        ma[rank - 2] = ra - 2
        mb[rank - 1] = rb - 1
        return DimMap([ma, mb], summed=[[(0, ra - 1), (1, rb - 2)]])
    if kind == "transpose":
        perm = _int_list(_param(node, "perm"))
        if perm is None:
            if rank != 2:
                raise Refused(f"{node.op} {node.name}: no permutation")
            perm = [1, 0]
        return DimMap([{o: _norm(p, rank) for o, p in enumerate(perm)}])
    if kind == "reshape":
        return DimMap([reshape_map(_shape(inputs[0]), out.shape)])
    if kind in ("sum", "reduce", "axis"):
        src = inputs[0]
        r = _rank(src)
        if kind == "axis":
            axis = _param(node, "axis")
            axes = [_norm(-1 if axis is None else int(axis), r)]
            keep = True
        else:
            axes = _axes(node, inputs)
            axes = list(range(r)) if not axes else [_norm(a, r) for a in axes]
            keepdims = _param(node, "keepdims")
            keep = rank == r if keepdims is None else bool(keepdims)
        kept = [i for i in range(r) if keep or i not in axes]
        mapping = {o: i for o, i in enumerate(kept) if keep is False or i not in axes}
        if kind == "sum":
            return DimMap([mapping], summed=[[(0, a)] for a in axes])
        return DimMap([mapping], blocked={(0, a) for a in axes})
    if kind == "unsqueeze":
        axes = [_norm(a, rank) for a in _axes(node, inputs) or []]
        kept = [o for o in range(rank) if o not in axes]
        return DimMap([{o: i for i, o in enumerate(kept)}])
    if kind == "squeeze":
        src = inputs[0]
        r = _rank(src)
        axes = _axes(node, inputs)
        axes = [i for i in range(r) if _same(src.shape[i], 1)] if axes is None else [_norm(a, r) for a in axes]
        kept = [i for i in range(r) if i not in axes]
        return DimMap([{o: i for o, i in enumerate(kept)}])
    if kind in ("gather_elements", "scatter_elements"):
        axis = _norm(int(_param(node, "axis") or 0), rank)
        every = {o: o for o in range(rank)}
        others = {o: o for o in range(rank) if o != axis}
        if kind == "gather_elements":       # (data, index)
            return DimMap([others, every], blocked={(0, axis)})
        return DimMap([every] + [others for _ in inputs[1:]], blocked={(i, axis) for i in range(1, len(inputs))})
    raise Refused(f"unknown chunk kind {kind!r}")


def _zero(v: Value) -> bool:
    """A scalar zero made from nothing (the untaken branch of a masked gradient)."""
    p = v.producer
    if p is None:
        return v.data is not None and getattr(v.data, "size", 0) == 1 and float(v.data.reshape(-1)[0]) == 0
    if any(True for _ in p.present_inputs()):
        return False
    fill = p.attrs.get("value")
    try:
        return float(fill) == 0
    except (TypeError, ValueError):
        return False


class _Grower:
    def __init__(self, match: Match, action: Chunk, ctx: MatchContext, two_phase: bool = False):
        self.match = match
        self.two_phase = two_phase
        self.ctx = ctx
        self.rules = ctx.rules
        self.graph: Graph = ctx.graph
        self.position = {id(n): i for i, n in enumerate(self.graph.nodes)}
        self.examples = self.graph.dim_examples
        self.meta: dict[int, ChunkMeta] = {}
        self.region: dict[int, Node] = {}
        self.elided: set[int] = set()          # reshapes skipped inside the slices
        self.inputs: dict[int, Value] = {}
        self.nonlinear: Refused | None = None  # why the incoming gradient cannot be applied once
        root_out = match.root.outputs[0]
        self.threshold = self._bytes(root_out) / LARGE_FRACTION
        self.tangent_ids = self.downstream({id(v) for v in self.graph.inputs if v.meta.get("tangent")})
        for name in action.captures:
            v = match.value(name)
            if not isinstance(v, Value):
                raise Refused(f"`chunk over {name}`: {name} is a variadic capture, not one value")
            rank = _rank(v)
            if not -rank <= action.dim < rank:
                raise Refused(f"chunk dim {action.dim} is out of range for %{v.name} ({name}), of rank {rank}")
            self.meta[id(v)] = ChunkMeta(_norm(action.dim, rank))
            self.inputs[id(v)] = v

    def _bytes(self, v: Value) -> float:
        size = evaluate(v.nbytes, self.examples) if v.nbytes is not None else None
        if size is None:
            raise Refused(f"%{v.name} has no known size")
        return size

    def large(self, v: Value) -> bool:
        return v.nbytes is not None and self._bytes(v) >= self.threshold

    def downstream(self, seeds: set[int]) -> set[int]:
        """Ids of the values computed from the values `seeds` names (seeds included). Nothing
        passes through an input read for its shape or type only (TYPE_ONLY)."""
        out = set(seeds)
        for n in self.graph.nodes:
            skip = TYPE_ONLY.get(self.kind_or_none(n), ())
            if any(id(v) in out for i, v in enumerate(n.reads()) if i not in skip):
                out.update(id(o) for o in n.outputs)
        return out

    def kind(self, node: Node) -> str:
        kind = self.rules.chunkable.get(node.op) or self.rules.chunkable.get(node.meta.get("native_op", ""))
        if kind is None:
            raise Refused(f"{node.op} {node.name} is not declared chunkable (add it to a "
                          f"`chunkable KIND` line)")
        return kind

    def in_region(self, v: Value) -> bool:
        return v.producer is not None and id(v.producer) in self.region

    # ------------------------------------------------------------------------------------
    def include(self, node: Node, required: ChunkMeta | None = None) -> None:
        """Add `node`: derive its output meta from its sliced inputs (or take `required`),
        then slice, pull in, or pass whole each input it reads from outside."""
        kind = self.kind(node)
        if len(node.outputs) != 1:
            raise Refused(f"{node.op} {node.name} has {len(node.outputs)} outputs")
        inputs = [self.source(v) if kind == "reshape" else v for v in node.present_inputs()]
        if any(id(v.producer) in self.elided for v in inputs if v.producer is not None):
            raise Refused(f"{node.op} {node.name} reads a reshape remat cannot slice")
        dm = dim_map(node, kind, inputs)
        if kind == "reshape":
            m = self.meta.get(id(inputs[0]))
            if (m is not None and m.dim is not None and m.dim not in dm.maps[0].values()
                    and node.outputs[0].users
                    and all(self.kind_or_none(u) == "reshape" for u in node.outputs[0].users)):
                # (tokens, vocab) -> (batch, seq, vocab) -> (tokens, vocab): the slice has no
                # place in the middle shape, but the round trip keeps it; skip the middle.
                self.region[id(node)] = node
                self.elided.add(id(node))
                self.meta[id(node.outputs[0])] = m
                return
        out_dim, need_sum, shape_only = None, False, False
        type_only = TYPE_ONLY.get(kind, ())
        for i, v in enumerate(inputs):
            m = self.meta.get(id(v))
            if m is None or not (self.in_region(v) or id(v) in self.inputs):
                continue
            if i in type_only and not dm.maps[i]:
                shape_only = True       # the slice's shape or type, computed anew in each slice
                continue
            if m.need_sum:
                raise Refused(f"{node.op} {node.name} reads %{v.name}, a partial sum over chunks")
            if m.dim is None:
                continue
            o = next((o for o, d in dm.maps[i].items() if d == m.dim), None)
            if o is not None:
                got_dim, got_sum = o, False
            elif any((i, m.dim) in group for group in dm.summed):
                got_dim, got_sum = None, True
            elif (i, m.dim) in dm.blocked:
                raise Refused(f"{node.op} {node.name} works along dim {m.dim} of %{v.name}, the chunk dim")
            else:
                raise Refused(f"{node.op} {node.name} does not carry dim {m.dim} of %{v.name} "
                              f"to its output")
            if (out_dim, need_sum) not in ((None, False), (got_dim, got_sum)):
                raise Refused(f"{node.op} {node.name}: its inputs are sliced along different dims")
            out_dim, need_sum = got_dim, got_sum
        if out_dim is None and not need_sum:
            if required is None and not shape_only:
                raise Refused(f"{node.op} {node.name} reads no sliced value")
            out_dim = None if required is None else required.dim
        elif required is not None and required.dim != out_dim:
            raise Refused(f"{node.op} {node.name} is needed sliced along dim {required.dim}, "
                          f"but its inputs give dim {out_dim}")
        self.region[id(node)] = node
        want: dict[int, int | None] = {}
        for i, v in enumerate(inputs):
            if out_dim is not None:
                want[i] = dm.maps[i].get(out_dim)
            else:
                group = next((g for g in dm.summed if any(
                    (j, (self.meta.get(id(inputs[j])) or ChunkMeta()).dim) in g for j in range(len(inputs)))), [])
                want[i] = next((d for j, d in group if j == i), None)
        for i, v in enumerate(inputs):
            if self.in_region(v) or id(v) in self.inputs:
                continue
            r = want[i]
            if r is not None and self.should_pull(v):
                self.include(v.producer, ChunkMeta(r))
                continue
            if r is not None and (v.shape is None or r >= len(v.shape)):
                raise Refused(f"{node.op} {node.name} needs %{v.name} sliced along dim {r}, which it does not have")
            if r is not None and not _same(v.shape[r], self.size):
                raise Refused(f"{node.op} {node.name} needs %{v.name} sliced along dim {r}, whose size "
                              f"{v.shape[r]} is not the chunked size {self.size}")
            self.meta[id(v)] = ChunkMeta(r)
            self.inputs[id(v)] = v
        scaled = self.scaled(node, inputs)
        for o in node.outputs:
            self.meta[id(o)] = ChunkMeta(out_dim, need_sum, scaled)

    def source(self, v: Value) -> Value:
        """`v`, or what it reshapes when its reshape is skipped inside the slices."""
        while v.producer is not None and id(v.producer) in self.elided:
            v = v.producer.inputs[0]
        return v

    def should_pull(self, v: Value) -> bool:
        """Compute `v` inside the region when it is large, or made from a large value."""
        p = v.producer
        return (p is not None and self.kind_or_none(p) is not None
                and (self.large(v) or any(self.large(x) for x in p.present_inputs())))

    def kind_or_none(self, node: Node) -> str | None:
        try:
            return self.kind(node)
        except Refused:
            return None

    def is_scaled(self, v: Value) -> bool:
        if self.two_phase:
            return False        # the backward phase reads the real gradient
        if self.in_region(v):
            return self.meta[id(v)].scaled
        return id(v) in self.tangent_ids

    def scaled(self, node: Node, inputs: list[Value]) -> bool:
        """Whether the output is linear in the incoming gradient, which the chunks take as one."""
        flags = [self.is_scaled(v) for v in inputs]
        if not any(flags):
            return False
        try:
            self.check_linear(node, inputs, flags)
        except Refused as e:
            # Raised once the region is known to run in one phase: in two, nothing is scaled.
            self.nonlinear = self.nonlinear or e
        return True

    def check_linear(self, node: Node, inputs: list[Value], flags: list[bool]) -> None:
        op = node.op
        if op in self.rules.additive_in_gradient:
            if not all(flags):
                raise Refused(f"{op} {node.name} adds the incoming gradient to a value that does not carry it")
            return
        if op not in self.rules.linear_in_gradient:
            raise Refused(f"{op} {node.name} is not declared linear_in_gradient, and it reads the "
                          f"incoming gradient")
        if sum(flags) > 1:
            raise Refused(f"{op} {node.name} multiplies the incoming gradient by itself")
        if node.op_type == "Div" and (len(flags) < 2 or flags[1]):
            raise Refused(f"{op} {node.name} divides by the incoming gradient" if len(flags) > 1 else
                          f"{op} {node.name} has no divisor operand")
        if node.op_type == "Where" and len(flags) < 3:
            raise Refused(f"{op} {node.name} has {len(flags)} operand(s), not a condition and two branches")
        if node.op_type == "Where":
            if flags[0] or not all(flags[i] or _zero(inputs[i]) for i in (1, 2)):
                raise Refused(f"{op} {node.name} selects between the incoming gradient and a nonzero value")

    # ------------------------------------------------------------------------------------
    def grow(self, action: Chunk) -> ChunkRegion:
        root = self.match.root
        over = [self.match.value(n) for n in action.captures]
        first = over[0]
        self.size = first.shape[_norm(action.dim, _rank(first))]
        self.include(root)
        start = self.position[id(root)]
        for node in self.graph.nodes[start + 1:]:
            if id(node) in self.region:
                continue
            reads = [v for v in node.present_inputs() if self.in_region(v) and self.meta[id(v)].dim is not None]
            if not reads:
                continue
            if any(self.large(v) for v in reads) or any(self.large(o) for o in node.outputs):
                self.include(node)
        late = self.close_cycles()
        if self.nonlinear is not None:
            raise self.nonlinear
        nodes = sorted(self.region.values(), key=lambda n: self.position[id(n)])
        phases = self.phases(nodes, late)
        for v in (o for ph in phases for o in ph.outputs):
            if id(v.producer) in self.elided:
                raise Refused(f"%{v.name} ({v.producer.op} {v.producer.name}) is read outside the region "
                              f"in a shape the slices do not have")
            m = self.meta[id(v)]
            if m.dim is None and not m.need_sum:
                raise Refused(f"%{v.name} leaves the region neither sliced nor summed")
            if m.dim is not None and self.large(v):
                raise Refused(f"%{v.name} ({v.producer.op} {v.producer.name}) is large and read outside "
                              f"the region, so it would be built whole anyway")
        inputs = sorted(self.inputs.values(), key=lambda v: self.position.get(id(v.producer), -1))
        tangent, chain = (None, []) if self.two_phase else self.tangent_chain(inputs)
        count = self.count(action)
        normalizer = next((op.rpartition("::")[2] for op in (n.meta.get(DECOMPOSED_FROM, n.op) for n in nodes)
                           if self.rules.chunkable.get(op) == "axis"), "")
        return ChunkRegion(self.match, nodes, self.meta, inputs, slice_sizes(self.size, count), tangent, chain,
                           [n for n in nodes if id(n) in self.elided], phases, normalizer)

    def close_cycles(self) -> list[Value]:
        """Pull in every input computed from the region's own values (a small value between
        two region nodes, like the log of the softmax's sum), so the region is one step.
        An input computed from them in the backward part is the gradient of the region's
        output: the region runs in two phases, and those inputs are returned."""
        while True:
            below = self.downstream({id(o) for n in self.region.values() for o in n.outputs})
            cyclic, late = [], []
            for v in self.inputs.values():
                if id(v) in below:
                    (cyclic if self.ctx.analysis.is_forward(v.producer) else late).append(v)
            if late and not self.two_phase:
                raise _TwoPhases()
            if not cyclic:
                return late
            for v in cyclic:
                del self.inputs[id(v)]
                self.include(v.producer, ChunkMeta(self.meta[id(v)].dim))

    def phases(self, nodes: list[Node], late: list[Value]) -> list[ChunkPhase]:
        """One phase, or, with `late` inputs, the forward phase (the nodes that do not read
        them) and the backward phase (the rest, and the forward nodes they read, again)."""
        region_ids = {id(n) for n in nodes}
        graph_outputs = {id(v) for v in self.graph.outputs}

        def outputs(members: list[Node]) -> list[Value]:
            return [o for n in members for o in n.outputs
                    if id(o) in graph_outputs or any(id(u) not in region_ids for u in o.users)]

        def phase(members: list[Node], recomputed: list[Node] = ()) -> ChunkPhase:
            ids = {id(n) for n in members}
            reads = {id(v): v for n in members for v in n.present_inputs()
                     if id(v) in self.inputs and (v.producer is None or id(v.producer) not in ids)}
            ins = sorted(reads.values(), key=lambda v: self.position.get(id(v.producer), -1))
            return ChunkPhase(members, ins, outputs([n for n in members if n not in recomputed]),
                              list(recomputed))

        if not late:
            return [phase(nodes)]
        after = self.downstream({id(v) for v in late})
        backward = [n for n in nodes if any(id(o) in after for o in n.outputs)]
        forward = [n for n in nodes if not any(id(o) in after for o in n.outputs)]
        backward_ids = {id(n) for n in backward}
        needed: dict[int, Node] = {}
        stack = [v for n in backward for v in n.present_inputs()]
        while stack:
            v = stack.pop()
            p = v.producer
            if p is None or id(p) in backward_ids or id(p) in needed or id(p) not in region_ids:
                continue
            needed[id(p)] = p
            stack.extend(p.present_inputs())
        recomputed = [n for n in forward if id(n) in needed]
        return [phase(forward), phase(sorted(recomputed + backward, key=lambda n: self.position[id(n)]),
                                      recomputed)]

    def tangent_chain(self, inputs: list[Value]) -> tuple[Value | None, list[Node]]:
        scaled_inputs = [v for v in inputs if id(v) in self.tangent_ids]
        if not scaled_inputs:
            return None, []
        chain: dict[int, Node] = {}
        tangents: set[int] = set()
        stack = list(scaled_inputs)
        while stack:
            v = stack.pop()
            if v.producer is None:
                tangents.add(id(v))
                continue
            if id(v.producer) in chain:
                continue
            node = v.producer
            chain[id(node)] = node
            ins = list(node.present_inputs())
            self.check_linear(node, ins, [id(x) in self.tangent_ids for x in ins])
            stack.extend(x for x in ins if id(x) in self.tangent_ids)
        if len(tangents) != 1:
            raise Refused("the region reads more than one incoming gradient")
        if len(chain) > MAX_TANGENT_CHAIN:
            raise Refused(f"the region's backward reads a gradient computed by {len(chain)} nodes from the "
                          f"incoming one; only a region whose backward follows right after its forward "
                          f"(a loss) runs as chunks")
        tangent = next(v for v in self.graph.inputs if id(v) in tangents)
        return tangent, sorted(chain.values(), key=lambda n: self.position[id(n)])

    def count(self, action: Chunk) -> int:
        what = f"`{action.count.text}`"
        try:
            value = evaluate_expr(action.count, self.match.bindings, self.ctx)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                value = evaluate(value, self.examples)
        except Unproven as e:
            raise Refused(str(e)) from None
        except ZeroDivisionError:
            raise Refused(f"{what} divides by zero") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise Refused(f"{what} is not a number of chunks: {exc}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Refused(f"{what} gives {value!r}, not a number of chunks")
        if value < 2:
            raise Refused(f"{what} gives {value} chunk(s): nothing to run slice by slice")
        return int(value)


def slice_sizes(size: Any, count: int) -> list[int]:
    try:
        n = int(size)
    except TypeError:
        raise Refused(f"the chunked dim has the symbolic size {size}") from None
    step = math.ceil(n / min(count, n))
    return [min(step, n - start) for start in range(0, n, step)]


def grow_chunk(match: Match, ctx: MatchContext) -> ChunkRegion | Reason:
    action = next(a for a in match.rule.actions if isinstance(a, Chunk))
    if match.root.meta.get(CHUNK_SLICE):
        return Reason(action.location, f"{match.root.op} {match.root.name} already runs one slice of a "
                                       f"chunk region")
    try:
        try:
            return _Grower(match, action, ctx).grow(action)
        except _TwoPhases:
            return _Grower(match, action, ctx, two_phase=True).grow(action)
    except Refused as e:
        return Reason(action.location, str(e))

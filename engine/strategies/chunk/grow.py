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

A reshape that has no place for the slice ((tokens, vocab) -> (batch, seq, vocab) when the
tokens are sliced) is skipped when what reads it reshapes back or is elementwise: the slices keep
the shape from before it, and elementwise ops on the middle shape (Gemma 2's logit cap, a cast
to float32 before the loss) run on the slices in that shape, as long as their other operands
broadcast alike in both (scalars; a bias over the trailing dims the shapes share).

A slice along the chunk dim itself (the label shift of one sequence: `logits[:-1]` against
`labels[1:]`, where the tokens are the sequence) keeps some of the chunked rows (Rows.lead,
Rows.tail): each slice of the chunk holds the ones that fall in it, the first or last fewer,
so the backends run those in bodies of their own (ChunkRegion.slice_class), and the slice's
gradient (a pad, a slice_scatter into zeros) puts the zeros back. At a dynamic size a value
may end short (the label shift again), never start in: the slice that holds the last rows is
never empty. On a backend that runs a fixed count of slices (fx) it is the rest of the rows, at
least one, so a value may end a row short there; on one that computes the slices in the graph
(ONNX), what is left after the full slices of the rows before the tail, at least the tail.

Values the region reads but does not slice (weights, the global count of a mean over
non-ignored labels) are computed outside it, whole, so a mean is divided by the global
count, never by a chunk's. A region through an op with no declared kind, a dim an op
cannot carry, or a gradient an op is not linear in, is refused with a reason naming the op.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from fractions import Fraction
from typing import Any

import sympy

from ...guards import Unproven, evaluate_expr
from ...ir import Graph, Node, SliceSizes, Value
from ...matcher import Match, MatchContext, Reason
from ...patterns import Chunk
from ...shapes import evaluate, free_dims, is_static, simplify
from ..replay import BoundReplay, bound_replay
from .kinds import (DTYPE_ONLY, TYPE_ONLY, Refused, RefusedConstrained, RefusedDynamic, RefusedReturned,
                    RefusedUnproven, attr_text, dim_map, grouped_dim, norm_dim, rank_of, same_size)
from .region import (ChunkMeta, ChunkPhase, ChunkRegion, Rows, as_unit, even_slices, phase_outputs, row_edges,
                     slice_sizes, unit_denominator, unit_formula)

LARGE_FRACTION = 2      # a value is large when at least half the root's output
MAX_TANGENT_CHAIN = 16  # nodes between the incoming gradient and the region, redone with it as one
ROW_STATISTIC = 16      # a forward value this many times smaller than the root's output is kept between phases


class _TwoPhases(Exception):
    """The region cannot run forward and backward in one pass over the slices: its backward reads
    the gradient of its own output, or the incoming gradient is not one it can apply once after
    the slices (another output's gradient added to the loss's: nanoGPT's `(logits, loss)`). Grow
    it again in two phases, where the backward slices read the real gradients. `why`: the
    one-phase refusal, reported if two phases are refused as well."""

    def __init__(self, why: Refused | None = None):
        super().__init__(str(why or ""))
        self.why = why


# Ops whose output is zeros wherever their first input is (a zero fill broadcast, cast, laid out
# anew: transformers' `torch.zeros` of an expert weight's gradient, exported as Expand then Transpose).
_ZERO_KEEPING = {"Identity", "Cast", "Transpose", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Flatten"}


def _zero(v: Value) -> bool:
    """Zeros made from nothing (the untaken branch of a masked gradient, the zeros a gradient is
    scattered into): a value the importer marked a fill of zeros (`Value.filled`: a zero
    constant, ONNX's ConstantOfShape, ATen's full), or one through ops that keep zeros."""
    p = v.producer
    while p is not None and p.op_type in _ZERO_KEEPING and p.inputs and p.inputs[0] is not None:
        v = p.inputs[0]
        p = v.producer
    return v.filled == 0


def _broadcasts_alike(operand: Value, value: Value, like: Value, dim: int | None) -> bool:
    """Whether `operand` broadcasts against `value` as against the same numbers in `like`'s
    shape, unsliced: its dims other than 1 lie in the trailing dims the two shapes share (a
    scalar; a bias over the vocabulary of (batch, seq, vocab) and (tokens, vocab)) and off the
    chunk dim `dim` of `like`."""
    if operand.shape is None or value.shape is None or like.shape is None or len(operand.shape) > len(like.shape):
        return False
    shared = 0
    for a, b in zip(reversed(value.shape), reversed(like.shape)):
        if not same_size(a, b):
            break
        shared += 1
    for j, d in enumerate(reversed(operand.shape), start=1):
        if same_size(d, 1):
            continue
        if j > shared or (dim is not None and len(like.shape) - j == dim):
            return False
    return True


def _same_shape(a: Value, b: Value) -> bool:
    return (a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape)
            and all(same_size(x, y) for x, y in zip(a.shape, b.shape)))


def _static_reshape(graph: Graph, node: Node, v: Value, like: Value) -> None:
    """Refuse a reshape between `v` and `like`'s shape at a dynamic size where the backend builds
    static ones only (Graph.dynamic_reshapes)."""
    if graph.dynamic_reshapes:
        return
    if v.shape is None or like.shape is None or not all(is_static(d) for d in (*v.shape, *like.shape)):
        raise RefusedDynamic(f"{node.op} {node.name}: %{v.name} would be reshaped between {v.shape} and the "
                             f"shape {like.shape} of %{like.name} outside the slices, which is built at "
                             f"static sizes only")


def _read_text(meta: ChunkMeta) -> str:
    if meta.dim is None:
        return "whole"
    return f"sliced along dim {meta.dim}" + (f" ({_rows_text(meta.rows)})" if meta.rows != Rows() else "")


def _rows_text(rows: Rows) -> str:
    """Rows of the chunked value as a Python slice (`[1:]`, `[:-1]`), or rows per its row."""
    if rows.shifted:
        return f"rows [{rows.lead or ''}:{-rows.tail if rows.tail else ''}] of the chunked value"
    return f"{rows.unit} row(s) per row of the chunked value"


def kind_of(rules, node: Node) -> str | None:
    """The chunk kind the rules declare for `node`'s op (under its IR or its native name)."""
    return rules.chunkable.get(node.op) or rules.chunkable.get(node.native_op or "")


class GraphIndex:
    """What every chunk match on one graph asks of the whole graph, computed once per plan
    (`MatchContext.chunk_index`) rather than once per match: each node's position, each
    value's readers (subgraph captures included), and the values computed from the incoming
    gradients. Walks follow readers from their seeds instead of scanning every node, so a
    match costs what its region reaches, not the graph's size (16 layers: 17 matches per plan,
    each once scanning the graph five times)."""

    def __init__(self, graph: Graph, rules):
        self.rules = rules
        self.position = {id(n): i for i, n in enumerate(graph.nodes)}
        self.readers: dict[int, list[tuple[Node, int]]] = {}
        for n in graph.nodes:
            for i, v in enumerate(n.reads()):
                self.readers.setdefault(id(v), []).append((n, i))
        self.tangent_ids = self.downstream([v for v in graph.inputs if v.tangent])
        self.returned = {id(v) for v in graph.outputs}     # what the step returns

    def downstream(self, seeds, until: int | None = None) -> set[int]:
        """Ids of the values computed from the values `seeds` (seeds included), through nodes
        at positions up to `until`. Nothing passes through an input read for its shape or type
        only (TYPE_ONLY)."""
        out = {id(v) for v in seeds}
        stack = list(seeds)
        while stack:
            v = stack.pop()
            for n, i in self.readers.get(id(v), ()):
                if (until is not None and self.position[id(n)] > until) or i in TYPE_ONLY.get(kind_of(self.rules, n), ()):
                    continue
                for o in n.outputs:
                    if id(o) not in out:
                        out.add(id(o))
                        stack.append(o)
        return out

    @classmethod
    def of(cls, ctx: MatchContext) -> "GraphIndex":
        if ctx.chunk_index is None:
            ctx.chunk_index = cls(ctx.graph, ctx.rules)
        return ctx.chunk_index


class _Grower:
    def __init__(self, match: Match, action: Chunk, ctx: MatchContext, two_phase: bool = False,
                 elide: bool = True, groups: Any = 1):
        self.match = match
        # > 1: the captured rows are `groups` groups (batch rows) of the chunked rows (a sequence),
        # sliced inside every group (Rows.outer; grow_chunk)
        self.groups = groups
        self.requested = 0          # the slice count the rule asks for (grow)
        self.two_phase = two_phase
        self.elide = elide          # skip a reshape the slices have no place in (include)
        self.ctx = ctx
        self.rules = ctx.rules
        self.graph: Graph = ctx.graph
        self.index = GraphIndex.of(ctx)
        self.position = self.index.position
        self.examples = self.graph.dim_examples
        self.meta: dict[int, ChunkMeta] = {}
        self.region: dict[int, Node] = {}
        self.elided: set[int] = set()          # reshapes skipped inside the slices
        # value id -> the value whose shape it has inside the slices: the output of a skipped
        # reshape, and of the elementwise ops after it, keep the shape from before the reshape
        self.reshaped: dict[int, Value] = {}
        self.inputs: dict[int, Value] = {}
        self.dtype_reads: set[int] = set()     # inputs read so far only for their type (read_outside)
        self.nonlinear: Refused | None = None  # why the incoming gradient cannot be applied once
        self.means: list[Node] = []            # averaging nodes whose slices sum (DimMap.mean)
        # ids of values the forward phase keeps because they hold what a dropout drew (its mask):
        # the step keeps them whole without the region too, so they may be large (phases)
        self.drawn: set[int] = set()
        root_out = match.root.outputs[0]
        self.threshold = self._bytes(root_out) / LARGE_FRACTION
        self.tangent_ids = self.index.tangent_ids
        for name in action.captures:
            v = match.value(name)
            if not isinstance(v, Value):
                raise Refused(f"`chunk over {name}`: {name} is a variadic capture, not one value")
            rank = rank_of(v)
            if not -rank <= action.dim < rank:
                raise Refused(f"chunk dim {action.dim} is out of range for %{v.name} ({name}), of rank {rank}")
            self.meta[id(v)] = ChunkMeta(norm_dim(action.dim, rank), rows=Rows(outer=groups))
            self.inputs[id(v)] = v

    def _bytes(self, v: Value) -> float:
        size = evaluate(v.nbytes, self.examples) if v.nbytes is not None else None
        if size is None:
            raise Refused(f"%{v.name} has no known size")
        return size

    def large(self, v: Value) -> bool:
        return v.nbytes is not None and self._bytes(v) >= self.threshold

    def kind(self, node: Node) -> str:
        kind = kind_of(self.rules, node)
        if kind is None:
            raise Refused(f"{node.op} {node.name} is not declared chunkable (add it to a "
                          f"`chunkable KIND` line)")
        if kind == "random" and self.graph.eager_random:
            raise Refused(f"{node.op} {node.name} draws random numbers, and the backend promised eager's "
                          f"(Inductor's fallback_random): slices drawing their own would draw others. "
                          f"Without fallback_random, Inductor draws a dropout's mask from its shape alone, "
                          f"before the region, and the region chunks")
        return kind

    def in_region(self, v: Value) -> bool:
        return v.producer is not None and id(v.producer) in self.region

    # ------------------------------------------------------------------------------------
    def include(self, node: Node, required: ChunkMeta | None = None) -> None:
        """Add `node`: derive its output meta from its sliced inputs (or take `required`),
        then slice, pull in, or pass whole each input it reads from outside."""
        kind = self.kind(node)
        inputs = list(node.present_inputs())
        if kind != "reshape" and any(id(v) in self.reshaped for v in inputs):
            self.include_reshaped(node, kind, inputs)
            return
        # a reshape reads a skipped reshape's value in the shape it has in the slices
        dm = dim_map(node, kind, [self.reshaped.get(id(v), v) for v in inputs])
        if len(node.outputs) != 1 + len(dm.extra_outputs) or any(o is None for o in node.outputs):
            raise Refused(f"{node.op} {node.name} has {len(node.outputs)} outputs; its kind `{kind}` carries "
                          f"dims to {1 + len(dm.extra_outputs)}")
        if kind == "reshape":
            m = self.meta.get(id(inputs[0]))
            if (self.elide and m is not None and m.dim is not None and m.dim not in dm.maps[0].values()
                    and self.grouped(self.reshaped.get(id(inputs[0]), inputs[0]), node.outputs[0], m) is None
                    and node.outputs[0].users
                    and all(self.kind_or_none(u) in ("reshape", "pointwise") for u in node.outputs[0].users)):
                # (tokens, vocab) -> (batch, seq, vocab) -> (tokens, vocab): the slice has no
                # place in the middle shape, but the round trip keeps it; skip the middle. Scalar
                # elementwise ops on the middle shape (Gemma 2's logit softcap, tanh(x / c) * c,
                # and its gradient) run on the slice in the shape from before the reshape.
                self.region[id(node)] = node
                self.elided.add(id(node))
                self.meta[id(node.outputs[0])] = m
                self.reshaped[id(node.outputs[0])] = self.reshaped.get(id(inputs[0]), inputs[0])
                return
        out_dim, need_sum, shape_only, out_rows = None, False, False, None
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
            got_rows = m.rows
            moved = self.grouped(self.reshaped.get(id(v), v), node.outputs[0], m) if kind == "reshape" else None
            if moved is not None:
                (got_dim, got_rows), got_sum = moved, False
            elif o is not None:
                got_dim, got_sum = o, False
            elif (i, m.dim) in dm.regrouped:
                got_dim, factor = dm.regrouped[(i, m.dim)]
                got_sum, got_rows = False, self.regroup(node, m.rows, factor)
            elif (i, m.dim) in dm.shifted:
                got_dim, lead, tail = dm.shifted[(i, m.dim)]
                got_sum, got_rows = False, self.shift(node, m.rows, lead, tail)
            elif any((i, m.dim) in group for group in dm.summed):
                if dm.zero_base is not None and not _zero(inputs[dm.zero_base]):
                    raise Refused(f"{node.op} {node.name} adds %{v.name}'s slices into %{inputs[dm.zero_base].name}, "
                                  f"which is not zeros: their partial sums would add it once per slice")
                got_dim, got_sum = None, True
            elif (i, m.dim) in dm.blocked:
                raise Refused(f"{node.op} {node.name} works along dim {m.dim} of %{v.name}, the chunk dim")
            else:
                raise Refused(f"{node.op} {node.name} does not carry dim {m.dim} of %{v.name} "
                              f"to its output")
            if (out_dim, need_sum) not in ((None, False), (got_dim, got_sum)):
                raise Refused(f"{node.op} {node.name}: its inputs are sliced along different dims")
            if out_rows not in (None, got_rows):
                raise Refused(f"{node.op} {node.name}: its inputs are sliced in different rows "
                              f"({_rows_text(out_rows)} against {_rows_text(got_rows)})")
            out_dim, need_sum, out_rows = got_dim, got_sum, got_rows
        if out_dim is None and not need_sum:
            if required is None and not shape_only:
                raise Refused(f"{node.op} {node.name} reads no sliced value")
            out_dim = None if required is None else required.dim
            out_rows = None if required is None else required.rows
        elif required is not None and (required.dim, required.rows) != (out_dim, out_rows):
            raise Refused(f"{node.op} {node.name} is needed sliced along dim {required.dim}, "
                          f"but its inputs give dim {out_dim}" + (
                              f" in other rows ({_rows_text(out_rows)} against {_rows_text(required.rows)})"
                              if required.dim == out_dim else ""))
        out_rows = Rows() if out_rows is None else out_rows
        self.region[id(node)] = node
        for i, v in enumerate(inputs):
            if self.in_region(v):
                continue
            r, rows = self.wanted(node, dm, i, inputs, out_dim, out_rows)
            if r is not None and id(v) not in self.inputs and self.should_pull(v):
                self.include(v.producer, ChunkMeta(r, rows=rows))
                continue
            if r is not None and (v.shape is None or r >= len(v.shape)):
                raise Refused(f"{node.op} {node.name} needs %{v.name} sliced along dim {r}, which it does not have")
            meta = ChunkMeta(r, rows=rows if r is not None else Rows())
            if r is not None and not same_size(v.shape[r], meta.rows.total(self.size)):
                total = meta.rows.total(self.size)
                # Two symbols for one size (Dynamo names the sizes of each graph piece anew):
                # equal at the example sizes, where a static graph would have one number.
                example = evaluate(total, self.examples)
                alike = example is not None and evaluate(v.shape[r], self.examples) == example
                message = (f"{node.op} {node.name} needs %{v.name} sliced along dim {r}, whose size "
                           f"{v.shape[r]} is not the chunked size {total}")
                if alike:
                    raise RefusedUnproven(message + " (equal at the example sizes, not provably)",
                                          (v.shape[r], total))
                raise Refused(message)
            if id(v) in self.reshaped:
                raise Refused(f"{node.op} {node.name} reads %{v.name} in its own shape, where another node of "
                              f"the region reads it in the shape of %{self.reshaped[id(v)].name}")
            self.read_outside(node, v, meta, i in DTYPE_ONLY.get(kind, ()))
        if need_sum and dm.mean:
            self.means.append(node)
        scaled = self.scaled(node, inputs)
        self.meta[id(node.outputs[0])] = ChunkMeta(out_dim, need_sum, scaled, Rows() if need_sum else out_rows)
        # outputs after the first (a norm's statistics, a loss's log_prob) follow input 0's dim
        first_meta = self.meta.get(id(inputs[0]), ChunkMeta()) if dm.extra_outputs else ChunkMeta()
        first = first_meta.dim
        for k, (o, mapping) in enumerate(zip(node.outputs[1:], dm.extra_outputs), start=1):
            dim = None if first is None else next((d for d, i in mapping.items() if i == first), -1)
            if dim == -1:
                raise Refused(f"{node.op} {node.name} does not carry dim {first} of %{inputs[0].name} to "
                              f"its output {k}")
            self.meta[id(o)] = ChunkMeta(dim, False, scaled, first_meta.rows)

    def read_outside(self, node: Node, v: Value, meta: ChunkMeta, dtype_only: bool) -> None:
        """Record that `node` reads `v`, computed outside the region, as `meta` says (sliced, or
        whole). The backends slice each input once for every region node that reads it, so two
        readers must want it alike; a read for its type only (CastLike's second input) is served
        by either."""
        have = self.meta.get(id(v)) if id(v) in self.inputs else None
        if have is None:
            self.meta[id(v)] = meta
            self.inputs[id(v)] = v
            if dtype_only:
                self.dtype_reads.add(id(v))
            return
        if dtype_only or (have.dim, have.rows) == (meta.dim, meta.rows):
            return
        if id(v) in self.dtype_reads:       # so far read only for its type: a slice has that type too
            self.dtype_reads.discard(id(v))
            self.meta[id(v)] = meta
            return
        raise Refused(f"{node.op} {node.name} reads %{v.name} {_read_text(meta)}, where another node of the "
                      f"region reads it {_read_text(have)}")

    def wanted(self, node: Node, dm, i: int, inputs: list[Value], out_dim: int | None,
               out_rows: Rows) -> tuple[int | None, Rows]:
        """The dim (and its rows) along which `node` needs its input `i` sliced, given its
        output's: the dim that maps to the output's, the leading dim of a group a reshape
        splits or merges, the dim a slice or pad shifts; or, for a sum, the dim summed with
        the sliced inputs' (None: read whole)."""
        if out_dim is None:
            group = next((g for g in dm.summed if any(
                (j, (self.meta.get(id(inputs[j])) or ChunkMeta()).dim) in g for j in range(len(inputs)))), [])
            return next((d for j, d in group if j == i), None), out_rows
        if self.kind(node) == "reshape" and i == 0:
            moved = self.grouped(node.outputs[0], inputs[0], ChunkMeta(out_dim, rows=out_rows))
            if moved is not None:
                return moved
        if dm.maps[i].get(out_dim) is not None:
            return dm.maps[i][out_dim], out_rows
        for (j, d), (o, factor) in dm.regrouped.items():    # needed in whole rows of the group
            if j == i and o == out_dim:
                return d, self.regroup(node, out_rows, 1 / factor)
        for (j, d), (o, lead, tail) in dm.shifted.items():
            if j == i and o == out_dim:
                return d, self.shift(node, out_rows, -lead, -tail)
        return None, out_rows

    def grouped(self, src: Value, out: Value, meta: ChunkMeta) -> tuple[int, Rows] | None:
        """Where a reshape from `src` (sliced as `meta` says) to `out` (or back) keeps the
        chunked rows as the lowest part of a dim (kinds.grouped_dim), that dim and its rows:
        (tokens, vocab) -> (batch, seq, vocab) where the region slices the sequence (Rows.outer),
        and back (a dynamic length: `2*s0` tokens, 2 groups of `s0`). None otherwise."""
        rows = meta.rows
        if rows.unit != 1 or src.shape is None or out.shape is None:
            return None
        per = simplify(self.size - rows.lead - rows.tail)
        found = grouped_dim(tuple(src.shape), tuple(out.shape), meta.dim, per)
        if found is None:
            return None
        dim, outer = found
        return dim, replace(rows, outer=outer)

    def regroup(self, node: Node, rows: Rows, factor: Any) -> Rows:
        """The rows after a reshape that groups the chunked dim with others (DimMap.regrouped).
        At symbolic sizes the unit is a formula (a row of (batch, s0, vocab) is s0 rows of
        (tokens, vocab)), which a backend running a fixed count of slices builds in whole groups
        (`finish` counts the slices in groups)."""
        symbolic = not is_static(self.size) or not isinstance(factor, Fraction)
        if symbolic and self.graph.slicing is SliceSizes.STATIC:
            raise RefusedDynamic(f"{node.op} {node.name} groups the chunked dim, of the symbolic size "
                                 f"{self.size}, with others: slices of whole groups are built at static "
                                 f"sizes only on this backend")
        if rows.shifted or rows.outer != 1:
            raise Refused(f"{node.op} {node.name} groups the chunked dim with others after a slice "
                          f"along it, or as groups of its rows: the slices cannot be whole groups")
        return replace(rows, unit=as_unit(unit_formula(rows.unit) * unit_formula(factor)))

    def shift(self, node: Node, rows: Rows, lead: int, tail: int) -> Rows:
        """The rows after an op that drops `lead` and `tail` rows of the chunk dim (a slice;
        negative: a pad adds them) (DimMap.shifted)."""
        if not lead and not tail:
            return rows         # every row (`x[:, :-1]` slices dim 0 whole at dynamic sizes)
        if not is_static(self.size) and self.graph.slicing is SliceSizes.STATIC:
            raise RefusedDynamic(f"{node.op} {node.name} slices the chunked dim, of the symbolic size "
                                 f"{self.size}: slices that start or end inside it are built at static sizes only "
                                 f"on this backend")
        if rows.unit != 1 or rows.outer != 1:
            raise Refused(f"{node.op} {node.name} slices the chunked dim, which a reshape before it "
                          f"groups with others")
        shifted = Rows(lead=rows.lead + lead, tail=rows.tail + tail)
        if shifted.lead < 0 or shifted.tail < 0:
            raise Refused(f"{node.op} {node.name} has rows of the chunk dim beyond the chunked value's "
                          f"(from {-min(shifted.lead, 0)} before its first to {-min(shifted.tail, 0)} after "
                          f"its last)")
        if shifted.total(self._at_examples(self.size)) < 1:
            raise Refused(f"{node.op} {node.name} leaves no rows of the chunk dim")
        most = 1 if self.graph.slicing is SliceSizes.FIXED_COUNT else None
        if not is_static(self.size) and (shifted.lead or (most is not None and shifted.tail > most)):
            # At a dynamic size the slices that hold a value's last rows are the last ones: a
            # fixed count of slices of floor(size / count) rows (fx) has a last slice that is
            # never empty, so a value one row short (the label shift of one sequence,
            # `logits[:-1]`) has rows in it at any size; slices computed in the graph (ONNX)
            # run every slice whole but a last one that holds what is left, at least the rows
            # any value ends short (SliceSizes.COMPUTED). A first slice of a dynamic size may be
            # shorter than any row dropped at the start.
            short = "only end a row short" if most else "only end short"
            raise RefusedDynamic(f"{node.op} {node.name} slices the chunked dim, of the symbolic size "
                                 f"{self.size}, {shifted.lead} rows in from its start and {shifted.tail} "
                                 f"short of its end: slices of a dynamic size hold such rows at static sizes "
                                 f"only (at dynamic ones, a value may {short})")
        return shifted

    def include_reshaped(self, node: Node, kind: str, inputs: list[Value]) -> None:
        """Add `node`, which reads values computed in the shape from before a skipped reshape:
        an elementwise op whose other operands are scalars computes the same numbers in that
        shape, so it runs there too; any other op would see the wrong dims."""
        shaped = [v for v in inputs if id(v) in self.reshaped]
        like = self.reshaped[id(shaped[0])]
        where = (f"{node.op} {node.name} reads %{shaped[0].name} in the shape of %{like.name}, before "
                 f"a reshape that does not carry the chunk dim")
        if kind != "pointwise":
            raise Refused(f"{where}; only elementwise ops with scalar operands run in that shape")
        if len(node.outputs) != 1 or node.outputs[0] is None or node.outputs[0].shape != shaped[0].shape:
            raise Refused(f"{where}; its output does not have that value's shape")
        dims = {self.meta[id(v)].dim for v in shaped}
        for v in shaped:
            if self.reshaped[id(v)].shape != like.shape:
                raise Refused(f"{where} and %{v.name} in the shape of %{self.reshaped[id(v)].name}")
        if len(dims) != 1:
            raise Refused(f"{where}; its operands are sliced along different dims")
        dim = next(iter(dims))
        for v in inputs:
            if id(v) in self.reshaped:
                continue
            if not self.in_region(v) and _same_shape(v, shaped[0]):
                # As large as the value it meets (the gradient of returned logits added to the
                # loss's): read through the same reshape, in that value's rows of the slice.
                self.read_reshaped(node, v, like, ChunkMeta(dim, rows=self.meta[id(shaped[0])].rows))
                continue
            if not _broadcasts_alike(v, shaped[0], like, dim):
                raise Refused(f"{where}; its operand %{v.name} (shape {v.shape}) would broadcast differently "
                              f"in that shape")
            if not self.in_region(v):
                self.read_outside(node, v, ChunkMeta(), False)
        self.region[id(node)] = node
        out = node.outputs[0]
        self.meta[id(out)] = ChunkMeta(dim, False, self.scaled(node, inputs), self.meta[id(shaped[0])].rows)
        self.reshaped[id(out)] = like

    def read_reshaped(self, node: Node, v: Value, like: Value, meta: ChunkMeta) -> None:
        """Record that `node` reads `v`, from outside the region, reshaped to `like`'s shape and
        sliced as `meta` says (ChunkRegion.reshaped): the backends reshape it, whole, first."""
        if id(v) in self.inputs and self.reshaped.get(id(v)) is not like:
            raise Refused(f"{node.op} {node.name} reads %{v.name} in the shape of %{like.name}, where another "
                          f"node of the region reads it in its own shape")
        _static_reshape(self.graph, node, v, like)
        self.reshaped[id(v)] = like
        self.read_outside(node, v, meta, False)

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
        kind = self.kind_or_none(node)
        if kind == "slice_scatter" and (flags[0] or not _zero(inputs[0])):
            raise Refused(f"{op} {node.name} writes the incoming gradient into a value other than zeros")
        if kind == "pad" and (node.attrs.get("mode", "constant") not in ("constant", b"constant") or any(
                flags[2:]) or (len(inputs) > 2 and not _zero(inputs[2]))):
            raise Refused(f"{op} {node.name} pads the incoming gradient with something other than zeros")
        if kind in ("scatter_elements", "scatter_nd") and (
                flags[1] or not all(flags[i] or _zero(inputs[i]) for i in (0, 2) if i < len(inputs))
                or attr_text(node.attrs.get("reduction", "none")) not in ("none", "add")):
            raise Refused(f"{op} {node.name} scatters the incoming gradient into, or with, a value other than zeros")
        if node.op_type == "Where":
            if flags[0] or not all(flags[i] or _zero(inputs[i]) for i in (1, 2)):
                raise Refused(f"{op} {node.name} selects between the incoming gradient and a nonzero value")

    # ------------------------------------------------------------------------------------
    def grow(self, action: Chunk) -> ChunkRegion:
        root = self.match.root
        over = [self.match.value(n) for n in action.captures]
        first = over[0]
        self.size = first.shape[norm_dim(action.dim, rank_of(first))]
        if self.groups != 1:
            per = _whole_quotient(self.size, self.groups)
            if per is None:
                raise Refused(f"the {self.size} rows of %{first.name} are not {self.groups} groups of rows")
            if not is_static(per) and self.graph.slicing is SliceSizes.STATIC:
                raise RefusedDynamic(f"the rows of %{first.name} would be sliced inside each of {self.groups} "
                                     f"groups of the symbolic size {per}: built at static sizes only on this backend")
            self.size = int(per) if is_static(per) else per
        self.include(root)
        if self.meta[id(root.outputs[0])].need_sum:
            raise Refused(f"slicing %{first.name} along dim {action.dim} slices the dim {root.op} {root.name} "
                          f"contracts (a transposed operand): each slice is a partial sum of all of "
                          f"%{root.outputs[0].name}, not a slice of it")
        for node in self.readers_after(self.position[id(root)]):
            if id(node) in self.region:
                continue
            reads = [v for v in node.present_inputs() if self.in_region(v) and self.meta[id(v)].dim is not None]
            if not reads:
                continue
            if any(self.large(v) for v in reads) or any(self.large(o) for o in node.outputs):
                self.include(node)
        late = self.close_cycles()
        if self.nonlinear is not None:
            raise _TwoPhases(self.nonlinear)
        nodes = sorted(self.region.values(), key=lambda n: self.position[id(n)])
        phases = self.phases(nodes, late)
        if any(not ph.outputs for ph in phases):
            raise Refused("nothing outside the region reads its values (dead code): there is nothing to "
                          "run slice by slice")
        for v in phase_outputs(phases):
            if id(v) in self.reshaped:
                # computed in the slices in the shape from before a skipped reshape: the backends
                # reshape the concatenated slices (nanoGPT's returned (batch, seq, vocab) logits)
                _static_reshape(self.graph, v.producer, v, self.reshaped[id(v)])
            m = self.meta[id(v)]
            if m.dim is None and not m.need_sum:
                raise Refused(f"%{v.name} leaves the region neither sliced nor summed")
            if m.dim is not None and self.large(v) and id(v) not in self.index.returned and id(v) not in self.drawn:
                raise Refused(f"%{v.name} ({v.producer.op} {v.producer.name}) is large and read outside "
                              f"the region, so it would be built whole anyway")
        # A large value the step returns (nanoGPT's logits beside the loss) is built whole in any
        # plan: it leaves the region concatenated, and the region is worth running while a large
        # value it computes (the log-softmax, the logits' gradient) is not returned.
        leaving = self.built_whole(phases)
        large = [o for n in nodes if self.kind_or_none(n) != "reshape"     # views of the others
                 for o in n.outputs if o is not None and self.large(o)]
        if not any(id(o) not in leaving for o in large):
            raise RefusedReturned("every large value of the region is returned by the step, so it is built "
                                  "whole anyway", tuple(o.name for o in large))
        inputs = sorted(self.inputs.values(), key=lambda v: self.position.get(id(v.producer), -1))
        tangent, chain = (None, []) if self.two_phase else self.tangent_chain(inputs)
        count, formula = self.count(action)
        self.requested = count
        denominators = [unit_denominator(m.unit) for m in self.meta.values() if m.dim is not None]
        granule = math.lcm(*denominators) if all(isinstance(d, int) for d in denominators) else \
            simplify(functools.reduce(sympy.lcm, map(sympy.sympify, denominators)))
        groups = self._at_examples(self.size) // self._at_examples(granule)
        if granule != 1 and groups < 2:
            coarse = next(n for n in nodes if unit_denominator(self.meta[id(n.outputs[0])].unit) != 1)
            raise Refused(f"{coarse.op} {coarse.name} splits the chunked dim into "
                          f"groups of {granule} rows, and the {self.size} rows of %{first.name} are "
                          f"{groups} such group(s): nothing to run slice by slice")
        size, in_groups = self.size, granule != 1 and not (is_static(self.size) and is_static(granule))
        if in_groups:
            # A group's rows are a formula (a sequence of s0 tokens): the region is sliced in whole
            # groups, a fixed count of them (regroup refuses other backends). Its rows are counted
            # in groups from here on: each value's unit is its rows per group.
            size = _whole_quotient(self.size, granule)
            if size is None:
                raise Refused(f"the chunked dim's {self.size} rows are not whole groups of {granule} rows")
            self.meta = {k: replace(m, rows=replace(m.rows, unit=as_unit(unit_formula(m.unit) * granule)))
                         if m.dim is not None else m for k, m in self.meta.items()}
            count, granule = min(count, groups), 1
        extent, count_formula, slicing = None, None, SliceSizes.STATIC
        fixed = self.graph.slicing is SliceSizes.FIXED_COUNT
        if in_groups or not is_static(size) or (not is_static(formula) and not fixed):
            if self.graph.slicing is SliceSizes.STATIC:
                raise RefusedDynamic(f"the chunked dim has the symbolic size {self.size} (or the slice count "
                                     f"`{action.count.text}` depends on a dynamic dim); this backend builds "
                                     f"slices of static sizes only")
            # what the slices' sizes are made of: the rows (or whole groups) split, and a count not fixed
            if fixed and self.graph.dim_traced and not in_groups:
                # (a region of whole groups over a dynamic batch is first grown to see whether it
                # can be sliced inside the groups instead: grow_chunk)
                count = self.traced_count(size, count)
            sliced = free_dims(sympy.sympify(size)) | (set() if fixed else free_dims(sympy.sympify(formula)))
            constrained = sorted(sliced & self.graph.constrained_dims)
            if constrained:
                count = self.exact_count(size, count, fixed, constrained)
            if not fixed and any(m.rows.lead for m in self.meta.values() if m.dim is not None):
                raise RefusedDynamic(f"the slice count `{action.count.text}` depends on a dynamic dim, and "
                                     f"a value that starts inside the chunk dim needs slices built at static sizes")
            # A fixed count is the count at the example sizes: every size runs that many slices.
            extent, count_formula, slicing = size, count if fixed else formula, self.graph.slicing
        normalizer = next((op.rpartition("::")[2] for op in (n.decomposed_from or n.op for n in nodes)
                           if self.rules.chunkable.get(op) == "axis"), "")
        sizes = (even_slices(self._at_examples(size), count) if slicing is SliceSizes.FIXED_COUNT else
                 slice_sizes(self._at_examples(size), count, granule, *row_edges(self.meta.values())))
        return ChunkRegion(self.match, nodes, self.meta, inputs, sizes,
                           tangent, chain, [n for n in nodes if id(n) in self.elided], phases, normalizer,
                           self.means, extent, count_formula, dict(self.reshaped), granule, leaving, slicing)

    def traced_count(self, size: Any, count: int) -> int:
        """A fixed count of slices of at least two of the chunked rows at the sizes the graph was
        traced at (Graph.dim_traced): Dynamo specializes a size of 0 or 1, so each slice of
        floor(size / count) rows guards at least two, and a size below that compiles again,
        planned at its own size; slices of no rows there failed Inductor's lowering, of one the
        remat pass. Refused where those rows give fewer than two such slices."""
        rows = evaluate(size, {**self.examples, **self.graph.dim_traced})
        if rows is None or rows >= 2 * count:
            return count
        if rows < 4:
            raise Refused(f"the chunked dim has the symbolic size {size}, {rows} row(s) at the sizes this graph "
                          f"was traced at: fewer than two slices of two rows")
        return int(rows) // 2

    def exact_count(self, size: Any, count: int, fixed: bool, constrained: list[str]) -> int:
        """The slice count for rows whose size is over dims with a declared range every guard must
        follow from (Graph.constrained_dims). Slices of `floor(size / count)` rows guard their own
        sizes (at least two rows, the last slice's rest), which such a range cannot prove; slices
        that divide the size exactly (`4*s` tokens in 4 slices of `s`) are of sizes the range
        bounds itself. So the most slices, up to `count`, into which the size's constant factor
        divides, else RefusedConstrained."""
        factor = sympy.sympify(size).as_content_primitive()[0] if fixed else 1
        exact = next((k for k in range(count, 1, -1) if factor % k == 0), None) \
            if isinstance(factor, sympy.Integer) else None
        if exact is None:
            raise RefusedConstrained(f"the chunked dim has the symbolic size {size}, which no count of slices "
                                     f"divides, and {', '.join(constrained)} has a declared range that every "
                                     f"guard must follow from, which slices of uneven sizes do not",
                                     tuple(constrained))
        return exact

    def built_whole(self, phases: list[ChunkPhase]) -> set[int]:
        """Ids of what leaves the region, and of the region values it reshapes (views): those
        exist whole anyway, so the region saves nothing of them."""
        whole: set[int] = set()
        for v in phase_outputs(phases):
            while v is not None and id(v) not in whole:
                whole.add(id(v))
                p = v.producer
                v = p.inputs[0] if p is not None and id(p) in self.region and self.kind_or_none(p) == "reshape" \
                    else None
        return whole

    def _at_examples(self, size: Any) -> int:
        value = evaluate(size, self.examples)
        if value is None:
            raise Refused(f"the chunked dim's size {size} has no example value (give it with --dim)")
        return value

    def readers_after(self, start: int):
        """In schedule order, the nodes after position `start` that read a region value, the
        region growing as the caller includes them: what a scan of every node after `start`
        would find reading one (a node before the scan's place is never visited again)."""
        import heapq

        heap: list[tuple[int, int]] = []
        nodes: dict[int, Node] = {}
        queued: set[int] = set()
        done = 0
        at = start
        while True:
            members = list(self.region.values())
            for n in members[done:]:
                for o in n.outputs:
                    for reader, _ in self.index.readers.get(id(o), ()):
                        pos = self.position[id(reader)]
                        if pos > at and id(reader) not in queued:
                            queued.add(id(reader))
                            nodes[pos] = reader
                            heapq.heappush(heap, (pos, id(reader)))
            done = len(members)
            if not heap:
                return
            at, _ = heapq.heappop(heap)
            yield nodes.pop(at)

    def close_cycles(self) -> list[Value]:
        """Pull in every input computed from the region's own values (a small value between
        two region nodes, like the log of the softmax's sum), so the region is one step.
        An input computed from them in the backward part is the gradient of the region's
        output: the region runs in two phases, and those inputs are returned. Unless it is
        computed from the backward phase's own values too (what the late inputs and the incoming
        gradient reach in the region, as `phases` splits it): that input is between two nodes of
        the backward phase, and is pulled in (a hand-written softmax's `amax`: its gradient,
        summed in the region, is divided outside by the count of each row's maxima and read back)."""
        is_forward = self.ctx.analysis.is_forward
        while True:
            produced = [v.producer for v in self.inputs.values() if v.producer is not None]
            until = max((self.position[id(p)] for p in produced), default=-1)
            below = self.index.downstream([o for n in self.region.values() for o in n.outputs], until=until)
            cyclic = [v for v in self.inputs.values() if id(v) in below and is_forward(v.producer)]
            late = [v for v in self.inputs.values() if id(v) in below and not is_forward(v.producer)]
            if late:
                tangent_inputs = [v for v in self.inputs.values() if id(v) in self.tangent_ids]
                reached = self.index.downstream([*late, *tangent_inputs],
                                                until=max(self.position[id(n)] for n in self.region.values()))
                below_backward = self.index.downstream(
                    [o for n in self.region.values() if any(id(o) in reached for o in n.outputs)
                     for o in n.outputs], until=until)
                cyclic += [v for v in late if id(v) in below_backward]
                late = [v for v in late if id(v) not in below_backward]
            if late and not self.two_phase:
                raise _TwoPhases()
            if not cyclic:
                return late
            for v in cyclic:
                del self.inputs[id(v)]
                m = self.meta[id(v)]
                self.include(v.producer, ChunkMeta(m.dim, rows=m.rows))

    def phases(self, nodes: list[Node], late: list[Value]) -> list[ChunkPhase]:
        """One phase, or, with `late` inputs, the forward phase (the nodes that do not read
        them) and the backward phase (the rest, and the forward nodes they read, again)."""
        region_ids = {id(n) for n in nodes}
        graph_outputs = self.index.returned

        def outputs(members: list[Node], also: dict[int, Value]) -> list[Value]:
            return [o for n in members for o in n.outputs if id(o) in graph_outputs or id(o) in also
                    or any(id(u) not in region_ids for u in o.users)]

        def phase(members: list[Node], recomputed: list[Node] = (), also: dict[int, Value] | None = None,
                  replayed: dict[int, BoundReplay] | None = None) -> ChunkPhase:
            replayed = replayed or {}
            ids = {id(n) for n in members}
            # what the region reads from outside, and what an earlier phase returned (below): a
            # replayed node's kept outputs too, though the node is a member
            kept_here = {id(v) for b in replayed.values() for v in b.saved}
            reads = {id(v): v for n in members for v in n.present_inputs()
                     if (id(v) in self.inputs or self.in_region(v))
                     and (v.producer is None or id(v.producer) not in ids or id(v) in kept_here)}
            ins = sorted(reads.values(), key=lambda v: self.position.get(id(v.producer), -1))
            return ChunkPhase(members, ins, outputs([n for n in members if n not in recomputed], also or {}),
                              list(recomputed), replayed)

        # The backward phase: what reads the late inputs, and what reads the incoming gradient any
        # other way (a loss beside the region's own output: z-loss reads logsumexp(logits) and
        # cross-entropy's gradient reads the tangent directly; the gradient of returned logits
        # added to the loss's). Left in the forward phase, such a node would make the forward
        # outputs wait for the gradient.
        tangent_inputs = [v for v in self.inputs.values() if id(v) in self.tangent_ids]
        if not late and not (self.two_phase and tangent_inputs):
            return [phase(nodes)]
        after = self.index.downstream([*late, *tangent_inputs], until=max(self.position[id(n)] for n in nodes))
        # A node that reads a backward value only for its type (CastLike(0, grad), the masked
        # fill of a gradient) runs in the backward phase too: the value must exist first.
        for n in nodes:
            if not any(id(o) in after for o in n.outputs) and any(id(v) in after for v in n.present_inputs()):
                after.update(id(o) for o in n.outputs)
        backward = [n for n in nodes if any(id(o) in after for o in n.outputs)]
        forward = [n for n in nodes if not any(id(o) in after for o in n.outputs)]
        if not late and not forward:
            return [phase(nodes)]       # all of it reads the incoming gradient: it runs in backward
        backward_ids = {id(n) for n in backward}
        needed: dict[int, Node] = {}
        kept: dict[int, Value] = {}
        replayed: dict[int, BoundReplay] = {}
        stack = [v for n in backward for v in n.present_inputs()]
        while stack:
            v = stack.pop()
            p = v.producer
            if p is None or id(p) in backward_ids or id(p) not in region_ids:
                continue
            if self.rules.is_random(p):
                # A dropout: the backward slices must see the forward's random values, so the
                # forward phase keeps the outputs that hold them (the mask, a byte a score) and
                # the backward slices compute the rest again from those (its `replay`).
                bound = self.replay(p, v)
                kept.update((id(s), s) for s in bound.saved)
                self.drawn.update(id(s) for s in bound.saved)
                if v is bound.replayed and id(p) not in needed:
                    needed[id(p)] = p
                    replayed[id(p)] = bound
                    stack.extend(bound.inputs)
                continue
            if id(p) in needed:
                continue
            if self.from_random_numbers(p, v):
                # Inductor's dropout, `rand(shape) > p`, its random numbers drawn whole before the
                # region: the mask the forward slices made from them is kept (a byte a score),
                # not made again from the numbers (four bytes a score, kept for it).
                kept[id(v)] = v
                self.drawn.add(id(v))
                continue
            if id(v) in graph_outputs:
                # The step returns it (nanoGPT's logits): it exists whole once the forward phase
                # has run, and the backward slices read it rather than compute it again.
                continue
            if self.row_statistic(v):
                # A softmax's row maximum and sum, a log-softmax's log-sum-exp: the forward phase
                # sends them out, the backward slices read them and redo only the elementwise
                # steps, as flash attention keeps its log-sum-exp.
                kept[id(v)] = v
                continue
            needed[id(p)] = p
            stack.extend(p.present_inputs())
        recomputed = [n for n in forward if id(n) in needed]
        return [phase(self.feeding(forward, outputs(forward, kept)), also=kept),
                phase(sorted(recomputed + backward, key=lambda n: self.position[id(n)]), recomputed,
                      replayed=replayed)]

    @staticmethod
    def feeding(members: list[Node], outs: list[Value]) -> list[Node]:
        """The nodes of `members` that `outs` are computed from. A forward node whose value only
        the backward reads (the transpose of gathered expert weights for the input's gradient) is
        left to the backward slices, which compute it again anyway: in the forward slices it is
        work for nothing."""
        ids = {id(n): n for n in members}
        kept: set[int] = set()
        stack = [o.producer for o in outs]
        while stack:
            n = stack.pop()
            if n is None or id(n) not in ids or id(n) in kept:
                continue
            kept.add(id(n))
            stack.extend(v.producer for v in n.present_inputs())
        return [n for n in members if id(n) in kept]

    def from_random_numbers(self, node: Node, v: Value) -> bool:
        """Whether the region node `node` makes `v` from random numbers drawn outside the region
        that are at least as large as `v`: keeping `v` between the phases costs less than
        keeping those numbers to make it again."""
        drawn = [x for x in node.present_inputs() if id(x) in self.inputs and x.producer is not None
                 and self.rules.is_random(x.producer)]
        return v.nbytes is not None and any(x.nbytes is not None and self._bytes(x) >= self._bytes(v) for x in drawn)

    def replay(self, node: Node, read: Value) -> BoundReplay:
        """How the backward slices compute `read`, an output of the random `node` the forward
        slices ran: from the outputs its replay keeps. Refused where the rules declare none."""
        bound = bound_replay(self.rules, node)
        if isinstance(bound, str):
            raise Refused(f"the forward slices draw random numbers the backward slices read (%{read.name}): "
                          f"{bound}")
        if read is not bound.replayed and all(read is not s for s in bound.saved):
            raise Refused(f"{node.op} {node.name}: the backward slices read %{read.name}, which its replay "
                          f"neither keeps nor computes again")
        return bound

    def row_statistic(self, v: Value) -> bool:
        """Whether `v` is small next to the amplified value (at most 1/ROW_STATISTIC of it) and
        sliced plainly along the chunk dim: kept between the phases rather than computed again."""
        m = self.meta.get(id(v))
        return (m is not None and m.dim is not None and not m.need_sum and not m.scaled and m.rows == Rows()
                and id(v) not in self.reshaped and v.nbytes is not None
                and self._bytes(v) * ROW_STATISTIC <= self.threshold * LARGE_FRACTION)

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
            raise _TwoPhases(Refused("the region reads more than one incoming gradient"))
        if len(chain) > MAX_TANGENT_CHAIN:
            raise Refused(f"the region's backward reads a gradient computed by {len(chain)} nodes from the "
                          f"incoming one; only a region whose backward follows right after its forward "
                          f"(a loss) runs as chunks")
        tangent = next(v for v in self.graph.inputs if id(v) in tangents)
        return tangent, sorted(chain.values(), key=lambda n: self.position[id(n)])

    def count(self, action: Chunk) -> tuple[int, Any]:
        """The number of slices at the example sizes, and as the rule's formula (a number when
        it depends on no dynamic dim)."""
        what = f"`{action.count.text}`"
        try:
            value = formula = evaluate_expr(action.count, self.match.bindings, self.ctx)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                value = evaluate(value, self.examples)
        except Unproven as e:
            raise Refused(str(e)) from None
        except ZeroDivisionError:
            raise Refused(f"{what} divides by zero") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise Refused(f"{what} is not a number of chunks: {exc}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise Refused(f"{what} gives {value!r}, not a number of chunks")
        if value < 2:
            raise Refused(f"{what} gives {value} chunk(s): nothing to run slice by slice")
        return int(value), formula


def grow_chunk(match: Match, ctx: MatchContext) -> ChunkRegion | Reason:
    action = next(a for a in match.rule.actions if isinstance(a, Chunk))
    if match.root.chunk_slice:
        return Reason(action.location, f"{match.root.op} {match.root.name} already runs one slice of a "
                                       f"chunk region")
    try:
        region, requested = _grow(match, action, ctx)
    except Refused as refused:
        return Reason(action.location, str(refused), **refused.reason_fields())
    groups = _whole_groups(region, match.value(action.captures[0]))
    dynamic = groups is not None and not is_static(groups)
    if groups is not None and (dynamic or len(region.chunks) < requested):
        # Whole groups (batch rows) are fewer than the slices the rule asks for (the (N, C, L)
        # loss, a label shift, at batch 2), or a dynamic count of them (an export with dynamic
        # batch and sequence, which runs at batch 1 as often as at the traced batch): the rows
        # are sliced inside every group instead, where the region allows it (Rows.outer), as
        # many slices at every batch.
        try:
            inside, _ = _grow(match, action, ctx, groups=groups)
        except Refused:
            return region
        if dynamic or len(inside.chunks) > len(region.chunks):
            return inside
    return region


def _whole_quotient(size: Any, by: Any) -> Any:
    """`size / by`, a formula, where it is whole for every size (`2*s0 / 2`, `4*s0 / s0`), else None."""
    quotient = simplify(sympy.cancel(sympy.sympify(size) / by))
    return quotient if simplify(sympy.fraction(quotient)[1]) == 1 else None


def _whole_groups(region: ChunkRegion, chunked: Value) -> Any:
    """How many groups (batch rows) a region sliced in whole groups has: at static sizes its
    rows over the granule; over dynamic sizes (the region counted in groups: the `chunked`
    value's rows per group, its unit, other than one) its extent, a number for a static batch,
    else a formula. None for a region of single rows."""
    if region.extent is None:
        return sum(region.chunks) // region.granule if region.granule != 1 else None
    if region.meta_of(chunked).unit == 1:
        return None
    return int(region.extent) if is_static(region.extent) else region.extent


def _grow(match: Match, action: Chunk, ctx: MatchContext, groups: Any = 1) -> tuple[ChunkRegion, int]:
    """The region, and the slice count the rule asked for; Refused with the first reason."""
    refused = None
    # A reshape the slices have no place in is skipped first (slices as fine as the chunked dim
    # allows); where what runs in the skipped shape is more than the slices can compute there
    # (a z-loss's logsumexp over (batch, seq, vocab)), the region grows again without skipping,
    # in whole rows of the reshape's groups (ChunkRegion.granule).
    for elide in (True, False):
        grower = None
        try:
            grower = _Grower(match, action, ctx, elide=elide, groups=groups)
            try:
                region = grower.grow(action)
            except _TwoPhases as once:
                one_phase = once.why
                grower = _Grower(match, action, ctx, two_phase=True, elide=elide, groups=groups)
                try:
                    region = grower.grow(action)
                except (RefusedDynamic, RefusedConstrained):
                    raise       # in two phases it chunks at other sizes: what the user can change
                except Refused as e:
                    raise (one_phase or e) from None
            if isinstance(refused, RefusedConstrained) and not is_static(region.extent or 1):
                # Rows over a declared range refused, the groups are a dynamic count (the batch):
                # slices of a few groups each guard that count (1 row left, `b // 3`), and every
                # batch size would compile again, up to Dynamo's recompile limit. The user hears
                # of the range instead, whose way out slices the rows.
                break
            return region, grower.requested
        except Refused as e:
            refused = refused or e
            if grower is None or not grower.elided:
                break           # nothing was skipped: growing again would refuse alike
    raise refused

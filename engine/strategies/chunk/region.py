"""Chunk regions: what the grower found, and what a backend builds."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import sympy

from ...ir import Node, SliceSizes, Value
from ...matcher import Match
from ...plan_type import PlanType
from ...shapes import simplify
from ..replay import BoundReplay
from .kinds import Refused


def slice_sizes(size: Any, count: int, granule: int = 1, lead: int = 0, tail: int = 0) -> list[int]:
    """`size` rows in `count` slices of whole multiples of `granule` rows: equal ones and a
    smaller last one (fewer slices when there are fewer granules). The first slice is longer
    than `lead` rows and the last longer than `tail` (a region value that starts `lead` rows in
    or ends `tail` rows short, Rows, has rows in every slice): one that is not is merged into
    its neighbour until it is."""
    try:
        n = int(size)
    except TypeError:
        raise Refused(f"the chunked dim has the symbolic size {size}") from None
    units = n // granule
    step = math.ceil(units / min(count, units)) * granule
    sizes = [min(step, n - start) for start in range(0, n, step)]
    while len(sizes) > 1 and sizes[-1] <= tail:
        sizes[-2:] = [sizes[-2] + sizes[-1]]
    while len(sizes) > 1 and sizes[0] <= lead:
        sizes[:2] = [sizes[0] + sizes[1]]
    return sizes


def even_slices(size: int, count: int) -> list[int]:
    """`size` rows in `count` slices as a fixed count of slices of a dynamic size lays them out
    (SliceSizes.FIXED_COUNT): floor(size / count) rows each, the last one the rest, so no
    slice is ever of a negative size, whatever the size."""
    if count < 1:
        raise RuntimeError(f"remat bug: {count} slices")
    step = size // count
    return [step] * (count - 1) + [size - step * (count - 1)]


@dataclass(frozen=True)
class Rows:
    """Where a value's rows along its chunk dim lie on the chunked value's rows.

    `unit`: its rows per row of the chunked value: rows [a, b) of the chunked value are rows
    [a * unit, b * unit) of this one (a reshape from (tokens, vocab) to (batch, seq, vocab)
    gives 1 / seq; the region's slices are then whole multiples of seq rows, ChunkRegion.granule).
    `lead`, `tail`: a slice along the chunk dim itself (the label shift of one sequence,
    `logits[:-1]`) keeps the chunked rows [lead, size - tail), row for row: its row r is row
    r + lead of the chunked value, and a slice of the chunked value holds the part of the
    value that falls in it (the first slice `lead` rows fewer, the last `tail` fewer). Either
    the unit or the lead and tail, never both: the grower refuses the mix. At a dynamic size no
    lead, and on a backend that runs a fixed count of slices (SliceSizes.FIXED_COUNT) a tail of
    at most one row.
    `outer`: the dim holds `outer` groups of those rows one after another, as the flat
    (tokens, vocab) logits hold the sequence of each batch row where the region slices the
    sequence inside every row (the (N, C, L) loss at batch 2): rows [a, b) of the chunked value
    are rows [g * n + a, g * n + b) of each group g of n rows. Not strided rows of a memory
    layout: the backends slice and join such a value in the shape that splits its dim into
    (outer, n), `grouped`. A number of groups, or a formula where it is dynamic (the batch of
    an export with dynamic batch and sequence), with a unit of one, at static or dynamic
    lengths."""

    unit: Fraction | sympy.Expr = Fraction(1)    # a formula where a reshape groups by a symbolic size
    lead: int = 0
    tail: int = 0
    outer: int | sympy.Expr = 1

    @property
    def shifted(self) -> bool:
        return bool(self.lead or self.tail)

    def window(self, start: Any, end: Any, size: Any) -> tuple[Any, Any]:
        """The chunked value's rows of [start, end) that this value has (unit 1)."""
        if not self.shifted:
            return start, end
        return max(start, self.lead), min(end, size - self.tail)

    def span(self, start: Any, end: Any, size: Any) -> tuple[Any, Any]:
        """This value's own rows for rows [start, end) of the chunked value, whose size is
        `size` (formulas when dynamic: then the unit is 1 and nothing is shifted); in each group
        where it holds `outer` of them."""
        if self.shifted:
            lo, hi = self.window(start, end, size)
            return lo - self.lead, hi - self.lead
        if self.outer != 1:
            return start, end
        return self.scale(start), self.scale(end)

    def total(self, size: Any) -> Any:
        """This value's rows when the chunked value has `size`."""
        lo, hi = self.span(0, size, size)
        return (hi - lo) * self.outer

    def scale(self, rows: Any) -> Any:
        if self.outer != 1:
            return rows * self.outer
        if self.unit == 1:
            return rows
        if not isinstance(self.unit, Fraction) or isinstance(rows, sympy.Expr):
            return simplify(sympy.cancel(rows * unit_formula(self.unit)))
        scaled = Fraction(int(rows)) * self.unit
        if scaled.denominator != 1:
            raise RuntimeError(f"remat bug: {rows} rows are not whole rows of a value with unit {self.unit}")
        return int(scaled)


def unit_formula(unit: Fraction | sympy.Expr) -> sympy.Expr:
    """A unit (a Fraction, or a formula) as a formula."""
    return sympy.Rational(unit.numerator, unit.denominator) if isinstance(unit, Fraction) else unit


def as_unit(expr: Any) -> Fraction | sympy.Expr:
    """A formula as a unit: a Fraction where it is a number."""
    expr = sympy.cancel(sympy.sympify(expr))
    return Fraction(int(expr.p), int(expr.q)) if expr.is_Rational else expr


def unit_denominator(unit: Fraction | sympy.Expr) -> Any:
    """The rows of the chunked value a row of a value with `unit` spans, at least: an int, or a
    formula (a row of (batch, s0, vocab) is s0 rows of (tokens, vocab))."""
    if isinstance(unit, Fraction):
        return unit.denominator
    return simplify(sympy.fraction(sympy.cancel(unit))[1])


def shifted_edges(outer: "Rows", inner: "Rows", start: int, end: int, size: int,
                  last: bool | None = None) -> tuple[int, int] | None:
    """How many of the rows `outer` has in a slice [start, end) of the chunked value lie before
    the rows `inner` has there, and how many after: a slice op's bounds in its input's slice
    (outer the input, inner the output), a slice_scatter's in its output's, a pad's in its
    output's (what lies around them is padding). None where neither is shifted: the op keeps
    every row, and its own bounds hold in any slice. `last`, for a slice of a region over a
    dynamic size (start, end and size unused): whether it holds the chunked value's last rows.
    Such a region keeps its values' rows from the start (the grower refuses a Rows.lead there),
    so only that slice drops rows, those inner lacks at the end."""
    if not (outer.shifted or inner.shifted):
        return None
    if last is not None:
        return 0, inner.tail - outer.tail if last else 0
    o_lo, o_hi = outer.window(start, end, size)
    i_lo, i_hi = inner.window(start, end, size)
    return i_lo - o_lo, o_hi - i_hi


def row_edges(metas) -> tuple[int, int]:
    """The most rows a sliced value starts in from the chunked value's first row, and ends
    short of its last (Rows.lead, Rows.tail): the first and last slices must be longer."""
    rows = [m.rows for m in metas if m.dim is not None]
    return max((r.lead for r in rows), default=0), max((r.tail for r in rows), default=0)


@dataclass(frozen=True)
class ChunkMeta:
    dim: int | None = None       # sliced along this dim: the chunks are concatenated
    need_sum: bool = False       # a partial sum: the chunks are added
    scaled: bool = False         # computed with the incoming gradient as one: multiply once at the end
    rows: Rows = Rows()          # where its rows along `dim` lie on the chunked value's

    @property
    def unit(self) -> Fraction:
        return self.rows.unit

    def span(self, start: Any, end: Any, size: Any) -> tuple[Any, Any]:
        """Its own rows for rows [start, end) of the chunked value (Rows.span)."""
        return self.rows.span(start, end, size)

    def length(self, start: Any, end: Any, size: Any) -> Any:
        """How many of its rows a slice [start, end) of the chunked value holds."""
        lo, hi = self.span(start, end, size)
        return (hi - lo) * self.rows.outer


def grouped(meta: ChunkMeta, shape: tuple) -> tuple[tuple, ChunkMeta]:
    """A value of `shape` whose chunk dim holds groups of the chunked rows (Rows.outer), in the
    shape that splits that dim into (groups, rows per group), and its meta there, the rows
    sliced along the second: the backends slice such an input, and join such an output's
    slices, in that shape."""
    dim, outer = meta.dim % len(shape), meta.rows.outer
    per = sympy.sympify(simplify(sympy.cancel(sympy.sympify(shape[dim]) / outer)))
    per = int(per) if per.is_Integer else per
    split = (*shape[:dim], outer, per, *shape[dim + 1:])
    return split, inside_groups(meta, len(shape))


def inside_groups(meta: ChunkMeta, rank: int) -> ChunkMeta:
    """The meta of a value of groups of the chunked rows (Rows.outer) of rank `rank` in the
    shape `grouped` splits it into: its rows sliced along the dim after the groups'."""
    return replace(meta, dim=meta.dim % rank + 1, rows=replace(meta.rows, outer=1))


@dataclass
class ChunkPhase:
    """One pass over the slices: its nodes run once per slice."""

    nodes: list[Node]                           # in schedule order
    inputs: list[Value]                         # read from outside the phase
    outputs: list[Value]                        # read outside the region
    recomputed: list[Node] = field(default_factory=list)   # an earlier phase's nodes, run again here
    # Of those, the random ones (a Dropout), by node id: an earlier phase kept the outputs that hold
    # their random values (the mask), and the builder writes each one's replay template
    # (engine.strategies.replay.instantiate) in its place, so the slices never draw again. Those kept
    # outputs are among `inputs`, though the node is in `nodes`.
    replayed: dict[int, BoundReplay] = field(default_factory=dict)


def phase_outputs(phases: list[ChunkPhase]) -> list[Value]:
    """The values read outside a region, phase by phase."""
    return [o for phase in phases for o in phase.outputs]


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
    means: list[Node] = field(default_factory=list)   # averaging nodes whose slices sum (DimMap.mean):
                                                # the builder divides by the whole total weight
    # A region over a dynamic size: the sliced dim's size and the number of slices as formulas
    # over the dynamic dims, for a backend that computes its slices in the graph (`chunks` are
    # then the slices at the example sizes). None when the slices are static.
    extent: Any = None
    count: Any = None
    # value id -> the value whose shape it has inside the slices: after a skipped reshape (elided),
    # the region computes in the shape from before it (grow.py, _Grower.include_reshaped)
    reshaped: dict[int, Value] = field(default_factory=dict)
    # the slices are whole multiples of this many rows (the least common multiple of the
    # denominators of the region values' units): a slice ends on a whole batch row
    granule: int = 1
    # ids of the region values that exist whole anyway: what leaves the region (concatenated or
    # summed), and what a leaving value reshapes (the returned logits' (tokens, vocab) form)
    built_whole: set[int] = field(default_factory=set)
    # How the slices of a dynamic extent are laid out (the graph's SliceSizes); STATIC when the
    # slices are static
    slicing: SliceSizes = SliceSizes.STATIC

    @property
    def slice_size(self) -> Any:
        """The largest slice's size, a formula when the region is dynamic: ceil(extent / count)
        where the graph computes them (every slice but the last), the last one's where the
        count is fixed (even_slices)."""
        if self.extent is None:
            return max(self.chunks)
        if self.slicing is SliceSizes.FIXED_COUNT:
            return simplify(self.extent - (self.count - 1) * sympy.floor(self.extent / self.count))
        return simplify(sympy.ceiling(self.extent / sympy.Max(self.count, 1)))

    @property
    def edges(self) -> tuple[int, int]:
        return row_edges(self.meta.values())

    def sizes_for(self, count: int) -> list[int]:
        """The slices' sizes in `count` slices (at the example sizes)."""
        if self.slicing is SliceSizes.FIXED_COUNT:
            return even_slices(sum(self.chunks), count)
        return slice_sizes(sum(self.chunks), count, self.granule, *self.edges)

    @property
    def most_slices(self) -> int:
        return len(self.sizes_for(sum(self.chunks)))

    def slices(self) -> list[tuple[int, int]]:
        """Each slice's rows [start, end) of the chunked value."""
        bounds, start = [], 0
        for size in self.chunks:
            bounds.append((start, start + size))
            start += size
        return bounds

    def slice_class(self, start: int, end: int) -> tuple[int, bool, bool]:
        """What a slice's body depends on: its size, and whether it is the first or last slice
        where a region value starts in or ends short there (Rows.lead, Rows.tail): slices of
        one class run the same body on the same shapes."""
        lead, tail = self.edges
        # A fixed count's last slice has a size formula of its own, whatever its size here.
        last = bool(tail) or self.slicing is SliceSizes.FIXED_COUNT
        return end - start, bool(lead) and start == 0, last and end == sum(self.chunks)

    def reslice(self, count: int) -> None:
        """Run the region in `count` slices instead (the budget planner's choice)."""
        self.chunks = self.sizes_for(count)
        if self.extent is not None:
            self.count = count

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
        return phase_outputs(self.phases)

    @property
    def plan_type(self) -> PlanType:
        return PlanType.CHUNK

    @property
    def targets(self) -> list[Value]:
        """The amplified value that is no longer built whole: the root's output, or, where the step
        returns that (nanoGPT's logits), the first value of its size the region computes from it
        (the logits less their maximum, on the way to the log-softmax)."""
        root = self.match.root.outputs[0]
        whole = self.built_whole
        if id(root) not in whole:
            return [root]
        elided = {id(n) for n in self.elided}
        return next(([o] for n in self.nodes if id(n) not in elided for o in n.outputs
                     if o is not None and id(o) not in whole and o.numel is not None and root.numel is not None
                     and simplify(o.numel - root.numel) == 0), [root])

    @property
    def saved(self) -> Any:
        """Bytes of the amplified value that no longer exist at once: all but one slice."""
        whole = self.targets[0].nbytes or 0
        if self.extent is not None:
            return simplify(whole - whole * self.slice_size / self.extent)
        return whole - whole * max(self.chunks) // sum(self.chunks)

    added = 0

    @property
    def net(self) -> Any:
        return self.saved

    def meta_of(self, value: Value) -> ChunkMeta:
        return self.meta.get(id(value), ChunkMeta())

    def reshaped_to(self, value: Value) -> tuple | None:
        """The shape a region input is reshaped to before it is sliced, or a region output has
        when its slices are concatenated, where that is not its own: the shape from before a
        skipped reshape (formulas at dynamic sizes, where the graph's backend builds such
        reshapes, Graph.dynamic_reshapes). None otherwise."""
        like = self.reshaped.get(id(value))
        return None if like is None else tuple(like.shape)

    def shaped_like(self, value: Value) -> Value:
        """The value whose shape `value` has inside the slices: itself, or what a skipped
        reshape before it reshaped (its chunk meta's dim is a dim of that shape)."""
        return self.reshaped.get(id(value), value)



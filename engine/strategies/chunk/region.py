"""Chunk regions: what the grower found, and what a backend builds."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import sympy

from ...ir import Node, Value
from ...matcher import Match
from ...plan_type import PlanType
from ...shapes import simplify
from .kinds import Refused


def slice_sizes(size: Any, count: int, granule: int = 1) -> list[int]:
    """`size` rows in `count` slices of whole multiples of `granule` rows: equal ones and a
    smaller last one (fewer slices when there are fewer granules)."""
    try:
        n = int(size)
    except TypeError:
        raise Refused(f"the chunked dim has the symbolic size {size}") from None
    units = n // granule
    step = math.ceil(units / min(count, units)) * granule
    return [min(step, n - start) for start in range(0, n, step)]


@dataclass(frozen=True)
class ChunkMeta:
    dim: int | None = None       # sliced along this dim: the chunks are concatenated
    need_sum: bool = False       # a partial sum: the chunks are added
    scaled: bool = False         # computed with the incoming gradient as one: multiply once at the end
    # rows of `dim` per row of the chunked value: rows [a, b) of the chunked value are rows
    # [a * unit, b * unit) of this one (a reshape from (tokens, vocab) to (batch, seq, vocab)
    # gives 1 / seq; the region's slices are then whole multiples of seq rows, ChunkRegion.granule)
    unit: Fraction = Fraction(1)

    def rows(self, size: Any) -> Any:
        """This value's rows for `size` rows of the chunked value (a formula when dynamic: then
        the unit is 1)."""
        if self.unit == 1:
            return size
        rows = Fraction(int(size)) * self.unit
        if rows.denominator != 1:
            raise RuntimeError(f"remat bug: {size} rows are not whole rows of a value with unit {self.unit}")
        return int(rows)


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

    @property
    def slice_size(self) -> Any:
        """The size of every slice but the last, a formula when the region is dynamic."""
        if self.extent is None:
            return max(self.chunks)
        return simplify(sympy.ceiling(self.extent / sympy.Max(self.count, 1)))

    def sizes_for(self, count: int) -> list[int]:
        """The slices' sizes in `count` slices (at the example sizes)."""
        return slice_sizes(sum(self.chunks), count, self.granule)

    @property
    def most_slices(self) -> int:
        return sum(self.chunks) // self.granule

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
        return [o for phase in self.phases for o in phase.outputs]

    @property
    def plan_type(self) -> PlanType:
        return PlanType.CHUNK

    @property
    def targets(self) -> list[Value]:
        """The amplified value that is no longer built whole."""
        return [self.match.root.outputs[0]]

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

    def shaped_like(self, value: Value) -> Value:
        """The value whose shape `value` has inside the slices: itself, or what a skipped
        reshape before it reshaped (its chunk meta's dim is a dim of that shape)."""
        return self.reshaped.get(id(value), value)



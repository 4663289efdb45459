"""Rules on an ONNX training graph: engine.rewrite with chunk regions built as Loops."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.apply import Result
from engine.driver import ChunkCalls, Rewrite, rewrite
from engine.failures import PlanFailure, resolve_strict
from engine.ir import Graph
from engine.patterns import RuleSet
from engine.plans import ConfigEntry
from engine.strategies.chunk import ChunkRegion

from .chunk import apply_chunk


class OnnxBuilder:
    """The IR is the ONNX graph: `engine.apply` rewrites a copy, and a chunk region is built
    into that copy as Loops (`unrolled`: the slices written out one by one, kept to measure
    the choice)."""

    built_as = "ONNX Loops"

    def __init__(self, graph: Graph, unrolled: bool = False):
        self.original = graph
        self.unrolled = unrolled
        self.work = graph
        self.calls = ChunkCalls()       # the Loops of each chunk region

    def start(self) -> None:
        self.work = self.original
        self.calls.clear()

    def current(self, fold: bool) -> Graph:
        return self.work

    def build(self, result: Result, region: ChunkRegion, index: int) -> None:
        before = {id(n) for n in result.graph.nodes}
        apply_chunk(result.graph, region, self.unrolled)
        self.work = result.graph
        self.calls.record((n.name for n in result.graph.nodes if id(n) not in before and n.op == "Loop"), region)

    def finish(self, result: Result) -> None:
        pass

    def simulate(self, graph: Graph) -> int:
        """ONNX Runtime's peak above rest on the CPU: its order, rewrites and allocator."""
        from .ort_order import estimated_ort_peak

        estimate = estimated_ort_peak(graph)
        self.calls.observe(estimate)
        return estimate.peak_bytes or 0


def apply_rules(graph: Graph, rules: RuleSet, config: str | list[ConfigEntry] | None = None,
                tiers: Iterable[str] = (), forward_outputs: list[str] | None = None,
                unrolled: bool = False, strict: bool | None = None,
                on_failure: Callable[[PlanFailure], None] | None = None,
                budget=None, device=None) -> Rewrite:
    """`engine.apply` for ONNX graphs, with the chunk plans built. An internal error refuses the
    plan it happened in and the others are applied (the report lists it); strict mode
    (`REMAT_STRICT=1`) raises it. `graph` itself is never changed. With a `budget` (bytes with a
    unit, or a fraction of the estimated peak) the planner chooses the plans for `device`. With
    neither a config nor a budget, a plan with which ONNX Runtime's simulated peak rises above the
    original graph's is left out (the report says which)."""
    strict = resolve_strict(strict)
    return rewrite(OnnxBuilder(graph, unrolled), rules, config, tiers, forward_outputs, strict, on_failure,
                   budget, device, never_above_original=True)

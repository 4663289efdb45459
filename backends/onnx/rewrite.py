"""Rules on an ONNX training graph: chunk regions built as Loops, then recompute.

The same order as the torch backend (backends.fx.compile): chunk regions first, one at a
time, re-planning on the rewritten graph after each (a built region's nodes are gone, so
it is not offered again), then recompute and compromise on the chunked graph, so no
recompute region reaches into a value that chunking already removed.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.apply import Result, apply, plan
from engine.errors import GraphError
from engine.ir import Graph
from engine.patterns import RuleSet
from engine.plans import ConfigEntry, parse_config, select

from .chunk import apply_chunk

MAX_CHUNK_SITES = 64


@dataclass
class Rewrite:
    result: Result                      # recompute and compromise, on the chunked graph
    chunk_result: Result | None         # the chunk plans, as first planned
    chunked: int = 0                    # chunk regions built
    failures: list[str] = field(default_factory=list)   # chunk regions planned but not buildable

    @property
    def graph(self) -> Graph:
        return self.result.graph

    def report(self) -> str:
        parts = []
        if self.chunk_result is not None and self.chunk_result.plans:
            parts.append(self.chunk_result.report())
            parts.append(f"Built {self.chunked} chunk region(s) as ONNX Loops.")
            parts.extend(f"not built: {f}" for f in self.failures)
        parts.append(self.result.report())
        return "\n\n".join(parts)


def apply_rules(graph: Graph, rules: RuleSet, config: str | list[ConfigEntry] | None = None,
                tiers: Iterable[str] = (), forward_outputs: list[str] | None = None,
                unrolled: bool = False) -> Rewrite:
    """`engine.apply` for ONNX graphs, with the chunk plans built (as Loops; `unrolled`: the
    slices written out one by one, kept to measure the choice)."""
    entries = parse_config(config) if isinstance(config, str) else config
    tiers = tuple(tiers)
    if entries is not None:
        # Checked once against the whole graph: the re-plans below run on a graph whose chunk
        # regions are built, and skip the plans those regions consumed.
        select(plan(graph, rules, tiers, forward_outputs).plans, entries)
    chunk_entries = None if entries is None else [e for e in entries if e.type == 3]
    other_entries = None if entries is None else [e for e in entries if e.type != 3]
    chunk_rules = rules.of_types({3})
    work, first, chunked, failures = graph, None, 0, []
    unbuildable: set[tuple[str, str]] = set()
    while chunk_rules.rules and chunked < MAX_CHUNK_SITES:
        result = apply(work, chunk_rules, chunk_entries, tiers, forward_outputs, lenient=True)
        first = first or result
        pending = [r for r in result.chunks if (r.match.rule.name, r.match.root.name) not in unbuildable]
        if not pending:
            break
        region = pending[0]
        try:
            apply_chunk(result.graph, region, unrolled)
        except GraphError as err:
            # The copy it was built on is dropped: the graph runs this region whole.
            unbuildable.add((region.match.rule.name, region.match.root.name))
            failures.append(f"{region.match.rule.name} at {region.match.root.name}: {err}")
            continue
        work = result.graph
        chunked += 1
        for p in first.plans:
            if p.key == region.key and p.type == 3:
                p.applied += 1
    result = apply(work, rules.of_types({1, 2}), other_entries, tiers, forward_outputs, lenient=True)
    return Rewrite(result, first, chunked, failures)

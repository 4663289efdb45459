"""`engine.apply(graph, rules, config=None)`: plan, select, rewrite, verify."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .analysis import Analysis, analyze, estimate_peak
from .errors import RuleError
from .failures import PlanFailure, Site, at_site, resolve_strict
from .ir import Graph
from .matcher import Match, MatchContext, Reason, match
from .patterns import RuleSet
from .plan_type import PlanType
from .plans import ConfigEntry, Plan, parse_config, select
from .strategies.chunk import ChunkRegion, grow_chunk
from .strategies.recompute import Region, Rewriter, StashState, grow


@dataclass
class Refusal:
    match: Match
    reason: Reason


@dataclass
class Planning:
    """Every plan the rules offer on a graph, and the matches that could not become one."""

    graph: Graph
    rules: RuleSet
    analysis: Analysis
    plans: list[Plan]
    refusals: list[Refusal] = field(default_factory=list)
    tiers: tuple[str, ...] = ()
    failures: list[PlanFailure] = field(default_factory=list)   # internal errors; those sites skipped

    def standing_refusals(self) -> list[Refusal]:
        """The refusals at nodes no plan took: a chunk rule refused where one tried after it
        chunks the same root is not what the user needs to hear about."""
        taken = {id(r.match.root) for p in self.plans for r in p.occurrences}
        return [r for r in self.refusals if id(r.match.root) not in taken]


def _priority(match: Match, analysis: Analysis) -> tuple[int, int, int]:
    """Higher priority first, then file order, then schedule order: who claims a value first."""
    return -match.rule.priority, match.rule.order, analysis.position[id(match.root)]


def plan(graph: Graph, rules: RuleSet, tiers: Iterable[str] = (),
         forward_outputs: list[str] | None = None, strict: bool | None = None,
         excluded: frozenset[Site] = frozenset()) -> Planning:
    """Every plan the enabled rules offer on `graph`. An internal error at one match is raised
    when `strict` (default: the REMAT_STRICT environment variable), else that match is
    skipped and recorded in `Planning.failures`. `excluded` sites are not matched at all."""
    tiers = tuple(tiers)
    strict = resolve_strict(strict)
    unknown = set(tiers) - rules.tiers()
    if unknown:
        raise RuleError(f"unknown tier(s) {', '.join(sorted(unknown))}; the rules define: "
                        f"{', '.join(sorted(rules.tiers()))}")
    enabled = rules.enabled(tiers)
    analysis = analyze(graph, forward_outputs or graph.forward_outputs)
    ctx = MatchContext(graph, enabled, analysis, excluded=excluded, strict=strict)
    state = StashState.of(analysis)
    plans: dict[tuple[str, int], Plan] = {}
    refusals = []
    # A node one chunk plan slices, by the rule: chunk rules at one root are alternatives, tried
    # in priority order until one builds a region (the attention's queries, else its heads).
    chunked_roots: dict[int, str] = {}
    for m in sorted(match(graph, enabled, context=ctx), key=lambda m: _priority(m, analysis)):
        if m.rule.plan_type == PlanType.CHUNK and id(m.root) in chunked_roots:
            refusals.append(Refusal(m, Reason(m.rule.location, f"{m.root.op} {m.root.name} is chunked by "
                                              f"{chunked_roots[id(m.root)]}, a rule tried before this one")))
            continue
        try:
            with at_site(m.site, "grow"):
                region = grow_chunk(m, ctx) if m.rule.plan_type == PlanType.CHUNK else grow(m, ctx, state)
        except PlanFailure as failure:
            if strict:
                raise
            ctx.failures.append(failure)
            refusals.append(Refusal(m, Reason(m.rule.location, str(failure))))
            continue
        if isinstance(region, Reason):
            refusals.append(Refusal(m, region))
            continue
        if isinstance(region, Region):
            state.claimed.update(id(t) for t in region.targets)
        else:
            chunked_roots[id(m.root)] = m.rule.name
        key = (region.key, region.plan_type)
        plans.setdefault(key, Plan(region.key, region.plan_type)).occurrences.append(region)
    for p in plans.values():
        p.occurrences.sort(key=lambda r: analysis.position[id(r.match.root)])
    refusals += [Refusal(m, reason) for m, reason in ctx.longer]
    ordered = sorted(plans.values(), key=lambda p: (p.type, p.key))
    return Planning(graph, enabled, analysis, ordered, refusals, tiers, ctx.failures)


@dataclass
class Result:
    graph: Graph
    planning: Planning
    applied: list[Region]
    peak_before: int | None
    peak_after: int | None
    chunks: list[ChunkRegion] = field(default_factory=list)   # selected chunk plans: a backend builds them

    @property
    def plans(self) -> list[Plan]:
        return self.planning.plans

    def report(self, as_json: bool = False):
        from .report import plan_json, plan_table

        return plan_json(self) if as_json else plan_table(self.planning, self)


def _configured(plans: list[Plan], entries: list[ConfigEntry] | None, lenient: bool) -> list[tuple[Plan, Any]]:
    select(plans, entries, lenient)
    chosen = []
    for p in plans:
        if p.requested:
            regions = p.occurrences if p.requested < 0 else p.occurrences[:p.requested]
            chosen.extend((p, r) for r in regions)
    return chosen


def _selected(plans: list[Plan], selection: dict[Site, int | None]) -> list[tuple[Plan, Any]]:
    chosen = []
    for p in plans:
        picked = [r for r in p.occurrences if r.match.site in selection]
        p.requested = len(picked)
        for r in picked:
            count = selection[r.match.site]
            if isinstance(r, ChunkRegion) and count is not None:
                r.reslice(count)
            chosen.append((p, r))
    return chosen


def apply(graph: Graph, rules: RuleSet, config: str | list[ConfigEntry] | None = None,
          tiers: Iterable[str] = (), forward_outputs: list[str] | None = None,
          lenient: bool = False, strict: bool | None = None,
          excluded: frozenset[Site] = frozenset(),
          selection: dict[Site, int | None] | None = None, estimate_peaks: bool = True) -> Result:
    """Rewrite a copy of `graph` with `rules`. With no config every type-1 plan is applied, and
    every chunk plan (type 3) is selected. Chunk plans are built by the backend that owns the
    graph (backends.fx.chunk, backends.onnx.chunk): they are returned in `Result.chunks`, not
    rewritten here. `lenient`: config entries naming no plan are skipped (see plans.select).
    An internal error while rewriting one region raises a PlanFailure naming its site (the copy
    is half edited): `engine.failures.with_fallback` runs the rewrite again without it.
    `selection` (the budget planner's choice) names the occurrences to apply instead of a
    config, with each chosen chunk region's slice count. `estimate_peaks`: the schedule-order
    peak before and after, for the report (the budget search, which simulates the backend
    instead, skips them: two walks of the graph per rewrite it builds)."""
    if not isinstance(rules, RuleSet):
        raise TypeError("rules must be a RuleSet: compile .rule files with dsl.load_rules(paths)")
    entries = parse_config(config) if isinstance(config, str) else config
    peak_before = estimate_peak(graph, rules.views).peak_bytes if estimate_peaks else None
    work = graph.copy()
    planning = plan(work, rules, tiers, forward_outputs, strict, excluded)
    chosen = _selected(planning.plans, selection) if selection is not None else _configured(
        planning.plans, entries, lenient)
    analysis = planning.analysis
    ctx = MatchContext(work, planning.rules, analysis)
    state = StashState.of(analysis)
    rewriter = Rewriter(work, state)
    applied = []
    # In schedule order, whatever their plans: a backend builds them one at a time, first first.
    # (Measured on the GPT-like ONNX graph, vocab 32768: building the loss's region before the
    # attention's left ONNX Runtime's peak 16 MiB higher; the cause was not pinned down.)
    chunks = sorted((r for p, r in chosen if p.type == PlanType.CHUNK), key=lambda r: analysis.position[id(r.match.root)])
    chosen = [(p, r) for p, r in chosen if p.type != PlanType.CHUNK]
    for p, region in sorted(chosen, key=lambda pr: _priority(pr[1].match, analysis)):
        with at_site(region.match.site, "rewrite", p.key):
            fresh = grow(region.match, ctx, state)
            if isinstance(fresh, Reason):
                planning.refusals.append(Refusal(region.match, fresh))
                continue
            rewriter.apply(fresh)
        applied.append(fresh)
        p.applied += 1
    result_graph = rewriter.finish()
    result_graph.verify()
    peak_after = estimate_peak(result_graph, rules.views).peak_bytes if estimate_peaks else None
    return Result(result_graph, planning, applied, peak_before, peak_after, chunks)

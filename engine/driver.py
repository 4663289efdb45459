"""`engine.rewrite(builder, rules, ...)`: the one loop that applies rules to a backend's graph.

Both backends apply rules the same way, so the loop lives here and a backend supplies only
a `Builder`: its graph as IR, and how to build a chunk region in it.

1. A config is checked once against the plans of the graph as given (chunk plans on the
   graph op by op, the others on the graph with decomposed ops folded), which is what
   `remat analyze` prints.
2. Chunk regions are built one at a time, re-planning on the rewritten graph after each
   (a built region's nodes are gone, so it is not offered again); a region the backend
   cannot build is skipped and reported, and the next is tried.
3. Recompute and compromise plans are applied to the chunked graph, so no recompute region
   reaches into a value that chunking already removed.

An internal error at one site (engine.failures) drops that site and runs the loop again
from the graph as given (`with_fallback`); strict mode raises it instead.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .apply import Planning, Result, apply, plan
from .errors import ConfigError, GraphError, RuleError
from .failures import PlanFailure, Site, at_site, resolve_strict, with_fallback
from .ir import Graph
from .patterns import RuleSet
from .plan_type import RECOMPUTE_TYPES, PlanType
from .plans import ConfigEntry, parse_config, select
from .strategies.chunk import ChunkRegion

if TYPE_CHECKING:
    from .budget import Budget, Choice, DeviceProfile

MAX_CHUNK_SITES = 64


class Builder(Protocol):
    """What a backend supplies to `rewrite`."""

    built_as: str      # how a chunk region is built, for the report ("ONNX Loops")

    def start(self) -> None:
        """Begin an attempt from the graph as given (an earlier attempt's edits dropped)."""

    def current(self, fold: bool) -> Graph:
        """The working graph as IR; `fold`: decomposed ops as one node (for recompute rules)."""

    def build(self, result: Result, region: ChunkRegion, index: int) -> None:
        """Rewrite the working graph so `region` (planned on `result.graph`) runs slice by
        slice. Raise GraphError, having changed nothing, when it cannot be built."""

    def finish(self, result: Result) -> None:
        """Carry the applied recompute and compromise plans into the backend's graph."""

    def simulate(self, graph: Graph) -> int:
        """The peak the backend will reach running `graph` (its order, its allocator), in
        bytes: what a budget is checked against."""


@dataclass
class Rewrite:
    result: Result                          # recompute and compromise, on the chunked graph
    chunk_result: Result | None             # the chunk plans, as first planned
    built_as: str = "chunk regions"
    chunked: int = 0                        # chunk regions built
    not_built: list[str] = field(default_factory=list)          # planned but not buildable
    failures: list[PlanFailure] = field(default_factory=list)   # internal errors: sites skipped
    choice: "Choice | None" = None          # the budget planner's, when a budget was given
    simulated_peak: int | None = None       # of the rewritten graph, when a budget was given

    @property
    def graph(self) -> Graph:
        return self.result.graph

    def report(self) -> str:
        parts = []
        if self.chunk_result is not None and self.chunk_result.plans:
            parts.append(self.chunk_result.report())
            parts.append(f"Built {self.chunked} chunk region(s) as {self.built_as}.")
            parts.extend(f"not built: {f}" for f in self.not_built)
        parts.append(self.result.report())
        if self.choice is not None:
            parts.append(self.choice.describe() + (f"; the rewritten graph simulates at "
                                                   f"{self.simulated_peak / 2**20:.1f} MiB"
                                                   if self.simulated_peak is not None else ""))
        if self.failures:
            parts.append("Skipped after an internal error (the rest was applied):\n"
                         + "\n".join(f"  {f}" for f in self.failures))
        return "\n\n".join(parts)


def plan_all(current: Callable[[bool], Graph], rules: RuleSet, tiers: tuple[str, ...] = (),
             forward_outputs: list[str] | None = None, strict: bool | None = None,
             excluded: frozenset[Site] = frozenset()) -> Planning:
    """The plan table of a backend's graph as `rewrite` sees it: chunk plans on the graph op
    by op (`current(False)`), the others with decomposed ops folded (`current(True)`)."""
    check_tiers(rules, tiers)
    chunk_rules, other_rules = rules.of_types({PlanType.CHUNK}), rules.of_types(RECOMPUTE_TYPES)
    planning = plan(current(True), other_rules, _known(other_rules, tiers), forward_outputs, strict, excluded)
    if chunk_rules.rules:
        chunking = plan(current(False), chunk_rules, _known(chunk_rules, tiers), forward_outputs, strict, excluded)
        planning.plans += chunking.plans
        planning.refusals += chunking.refusals
        planning.failures += chunking.failures
    return planning


def check_tiers(rules: RuleSet, tiers: Iterable[str]) -> None:
    unknown = set(tiers) - rules.tiers()
    if unknown:
        raise RuleError(f"unknown tier(s) {', '.join(sorted(unknown))}; the rules define: "
                        f"{', '.join(sorted(rules.tiers()))}")


def _known(rules: RuleSet, tiers: tuple[str, ...]) -> tuple[str, ...]:
    """The tiers a subset of the rules (chunk rules only, say) defines: the others were
    checked against the whole set."""
    return tuple(t for t in tiers if t in rules.tiers())


def rewrite(builder: Builder, rules: RuleSet, config: str | list[ConfigEntry] | None = None,
            tiers: Iterable[str] = (), forward_outputs: list[str] | None = None,
            strict: bool | None = None,
            on_failure: Callable[[PlanFailure], None] | None = None,
            budget: "Budget | str | float | int | None" = None,
            device: "DeviceProfile | None" = None) -> Rewrite:
    """Apply `rules` to the builder's graph (see the module docstring). `on_failure` hears of
    each internal error that made a site be skipped; strict mode raises the first instead.
    With a `budget` the planner chooses the plans (engine.budget), not a config; the result
    is simulated again and the program tightened while it is over the budget."""
    entries = parse_config(config) if isinstance(config, str) else config
    if budget is not None and entries is not None:
        raise ConfigError("give a config (the plans by hand) or a budget (the planner chooses), not both")
    tiers = tuple(tiers)
    check_tiers(rules, tiers)
    strict = resolve_strict(strict)
    failures: list[PlanFailure] = []

    def failed(failure: PlanFailure) -> None:
        failures.append(failure)
        if on_failure is not None:
            on_failure(failure)

    def attempt(excluded: frozenset[Site]) -> Rewrite:
        if budget is None:
            builder.start()
            return _attempt(builder, rules, entries, tiers, forward_outputs, strict, excluded)
        return _within_budget(builder, rules, budget, device, tiers, forward_outputs, strict, excluded)

    done = with_fallback(attempt, strict, failed)
    for failure in (f for r in (done.chunk_result, done.result) if r is not None for f in r.planning.failures):
        failed(failure)
    done.failures = failures
    return done


MAX_PROBES = 6         # rewrites built and simulated while searching the planner's budget
GAIN_FLOOR = 20e-6     # seconds: a probe whose choice saves less than this (or 2%) is not built


def _within_budget(builder: Builder, rules: RuleSet, budget, device, tiers: tuple[str, ...],
                   forward_outputs: list[str] | None, strict: bool, excluded: frozenset[Site]) -> Rewrite:
    """The planner's additive model chooses; the backend's simulation (its order, its allocator)
    judges. The search is over the budget given to the model: the user's budget first, then a
    secant step by what the simulation said (down by the overshoot, at least doubling; up by
    the slack), bisecting where the step leaves the bracket. Each probe builds and simulates a
    whole rewrite (seconds on a large model), so it is built only when it could pay: a model
    budget whose choice is a selection already built, or saves too little extra time over the
    best fitting rewrite, is judged without building. The search ends when the best rewrite nearly fills the budget, the
    bracket closes, or MAX_PROBES rewrites were built."""
    from .analysis import analyze
    from .budget import Budget, BudgetError, Choice, annotate_costs, choose, parse_budget, ratio_target, reach

    builder.start()
    budget = parse_budget(budget)
    given = builder.current(True)
    original_peak = builder.simulate(given)
    # Planned once: a probe selects sites by (rule, node) name, which every fresh start keeps.
    planning = plan_all(builder.current, rules, tiers, forward_outputs, strict, excluded)
    planned_on = builder.current(False)
    original, lowest = reach(planning, planned_on, device)
    target = note = None
    built: dict[frozenset, Rewrite] = {}
    holding: Rewrite | None = None          # the rewrite the builder's graph is now

    def build(choice: Choice) -> Rewrite:
        nonlocal holding
        builder.start()
        choice.budget, choice.note = target, note
        done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded, choice.selection)
        done.choice, done.simulated_peak = choice, builder.simulate(done.result.graph)
        holding = done
        return done

    def everything() -> Rewrite:
        """Every plan the rules offer (what `remat apply` does without a budget): the lowest peak."""
        nonlocal holding
        builder.start()
        done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded)
        done.simulated_peak = builder.simulate(done.result.graph)
        results = [r for r in (done.chunk_result, done.result) if r is not None]
        plans = [p for r in results for p in r.planning.plans if p.requested]
        annotate_costs(Planning(done.result.graph, rules, done.result.planning.analysis, plans), device)
        selection = {Site(o.match.rule.name, o.match.root.name): None for p in plans for o in p.occurrences}
        done.choice = Choice(target, original_peak, done.simulated_peak,
                             sum(p.extra_seconds or 0.0 for p in plans), selection, note=note)
        holding = done
        return done

    floor = None
    if budget.ratio is not None:
        # A ratio is of what recomputing the layers takes off the peak as the backend runs it:
        # the layers' stash, or less where the rules' lowest simulated peak says so.
        floor = everything()
        target, note = ratio_target(budget.ratio, original_peak, given, analyze(given, forward_outputs),
                                    original_peak - floor.simulated_peak)
        floor.choice.budget, floor.choice.note = target, note
        if target <= floor.simulated_peak:
            return floor
    else:
        target, note = budget.limit(original_peak), ""   # a fraction: of the peak the backend simulates
    target = max(1, target)
    # Model budgets, both bounds exclusive: at lo and below nothing cheaper fits, hi overshoots.
    lo, hi = lowest - 1, max(original, lowest) + 1
    best: Rewrite | None = None
    model = min(max(target, lowest), hi - 1)
    probes = down = 0
    while probes < MAX_PROBES and lo < model < hi:
        choice = choose(planning, planned_on, Budget(bytes=max(1, model)), device)
        key = frozenset(choice.selection.items())
        gain = best.choice.extra_seconds - choice.extra_seconds if best is not None else None
        if key in built:
            done = built[key]
        elif gain is not None and gain <= max(GAIN_FLOOR, 0.02 * best.choice.extra_seconds):
            done = None
        else:
            done = built[key] = build(choice)
            probes += 1
        if done is None:            # no cheaper than the best that fits: as good as fitting
            lo, step = model, None
        elif done.simulated_peak <= target:
            if best is None or done.choice.extra_seconds < best.choice.extra_seconds:
                best = done
            lo, slack = model, target - done.simulated_peak
            if slack <= target // 50:
                break               # the budget is nearly full: a larger model budget would overshoot
            step = model + slack
        else:
            # Down by the overshoot, but by at least an eighth of the way to the floor and twice
            # the last step down: the allocator rounds small changes away (a probe 4 MiB lower can
            # simulate exactly as high), so steps of the overshoot alone can crawl.
            down = max(done.simulated_peak - target, 2 * down, (model - lo) // 8)
            hi, step = model, model - down
        model = step if step is not None and lo < step < hi else (lo + hi) // 2
        if hi - lo <= max(target // 100, 1):
            break
    if best is None:
        best = floor or everything()
        if best.simulated_peak > target:
            raise BudgetError(target, best.simulated_peak, original_peak, tiers)
    if holding is not best:         # the builder holds another probe's graph: rebuild the best one
        best = everything() if best is floor else build(best.choice)
    return best


def build_selection(builder: Builder, rules: RuleSet, selection: dict[Site, int | None],
                    tiers: Iterable[str] = (), strict: bool | None = None) -> Rewrite:
    """Exactly the plan sites of `selection` (a chunk region at its slice count, None for a
    recompute) applied to the builder's graph as given: what a budget's choice builds."""
    builder.start()
    return _attempt(builder, rules, None, tuple(tiers), None, resolve_strict(strict), frozenset(), selection)


def _attempt(builder: Builder, rules: RuleSet, entries: list[ConfigEntry] | None, tiers: tuple[str, ...],
             forward_outputs: list[str] | None, strict: bool, excluded: frozenset[Site],
             selection: dict[Site, int | None] | None = None) -> Rewrite:
    if entries is not None:
        # Checked once against the graph as given; the re-plans below skip the plans consumed.
        select(plan_all(builder.current, rules, tiers, forward_outputs, strict).plans, entries)
    chunk_entries = None if entries is None else [e for e in entries if e.type == PlanType.CHUNK]
    other_entries = None if entries is None else [e for e in entries if e.type != PlanType.CHUNK]
    chunk_rules, other_rules = rules.of_types({PlanType.CHUNK}), rules.of_types(RECOMPUTE_TYPES)
    first: Result | None = None
    chunked, not_built = 0, []
    unbuildable: set[Site] = set()
    while chunk_rules.rules and chunked < MAX_CHUNK_SITES:
        result = apply(builder.current(fold=False), chunk_rules, chunk_entries, _known(chunk_rules, tiers),
                       forward_outputs, lenient=True, strict=strict, excluded=excluded, selection=selection)
        first = first or result
        pending = [r for r in result.chunks if _site(r) not in unbuildable]
        if not pending:
            break
        region = pending[0]
        try:
            with at_site(_site(region), "build", region.key):
                builder.build(result, region, chunked)
        except PlanFailure as failure:
            if not isinstance(failure.cause, GraphError):
                raise
            # Refused by the backend before it changed anything: the graph runs this region whole.
            unbuildable.add(_site(region))
            not_built.append(f"{region.match.rule.name} at {region.match.root.name}: {failure.cause}")
            continue
        chunked += 1
        for p in first.plans:
            if p.key == region.key and p.type == PlanType.CHUNK:
                p.applied += 1
    result = apply(builder.current(fold=True), other_rules, other_entries, _known(other_rules, tiers),
                   forward_outputs, lenient=True, strict=strict, excluded=excluded, selection=selection)
    builder.finish(result)
    return Rewrite(result, first, builder.built_as, chunked, not_built)


def _site(region: ChunkRegion) -> Site:
    return Site(region.match.rule.name, region.match.root.name)

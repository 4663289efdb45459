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

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from .analysis import PeakEstimate
from .apply import Planning, Result, apply, plan
from .errors import ConfigError, GraphError, RuleError
from .failures import PlanFailure, Site, at_site, resolve_strict, with_fallback
from .ir import Graph
from .patterns import RuleSet
from .plan_type import RECOMPUTE_TYPES, PlanType
from .plans import ConfigEntry, parse_config, select
from .shapes import format_bytes
from .strategies.chunk import ChunkRegion

if TYPE_CHECKING:
    from .budget import Budget, Choice, DeviceProfile, Program

MAX_CHUNK_SITES = 64
log = logging.getLogger("remat.budget")


class Builder(Protocol):
    """What a backend supplies to `rewrite`."""

    built_as: str      # how a chunk region is built, for the report ("ONNX Loops")
    calls: ChunkCalls  # the nodes that run each chunk region's slices; `simulate` has it observe
                       # each simulation, so `calls.peak` says where the last one peaked

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
        """The peak the backend will reach running its working graph, of which `graph` is the
        IR (`current()`'s), in bytes (its order, its allocator): what a budget is checked
        against. A backend may simulate its own graph rather than the IR (fx does), and has
        `calls` observe the simulation."""


@dataclass(frozen=True)
class SlicePeak:
    """A simulated peak on a chunk region's slice call: the region, and the highest bytes the
    simulation reached at any step that is not one of its calls."""

    site: Site
    elsewhere: int


@dataclass
class ChunkCalls:
    """The nodes a builder made to run each chunk region's slices (fx's `invoke_subgraph`
    calls, ONNX's Loops), by name, so that the node a simulation peaked at can be traced to
    the region. The budget search reads it: a peak on a region's call means the region's
    slice is the step's highest point, and more slices, not more plans elsewhere, lower it."""

    sites: dict[str, Site] = field(default_factory=dict)
    peak: SlicePeak | None = None       # of the last simulation

    def record(self, names: Iterable[str], region: ChunkRegion) -> None:
        site = region.match.site
        self.sites.update((name, site) for name in names)

    def clear(self) -> None:
        self.sites.clear()
        self.peak = None

    def observe(self, estimate: PeakEstimate) -> None:
        """Read a simulation of the graph holding these calls."""
        node = estimate.peak_node
        site = self.sites.get(node.name) if node is not None else None
        self.peak = None if site is None else SlicePeak(site, max(
            (b for n, b in zip(estimate.order, estimate.curve) if self.sites.get(n.name) != site), default=0))


@dataclass
class Rewrite:
    result: Result                          # recompute and compromise, on the chunked graph
    chunk_result: Result | None             # the chunk plans, as first planned
    built_as: str = "chunk regions"
    chunked: int = 0                        # chunk regions built
    not_built: list[str] = field(default_factory=list)          # planned but not buildable
    failures: list[PlanFailure] = field(default_factory=list)   # internal errors: sites skipped
    choice: "Choice | None" = None          # the budget planner's, when a budget was given
    simulated_peak: int | None = None       # of the rewritten graph, when a budget was given or none
    original_peak: int | None = None        # of the graph as given, simulated, when no budget was given
    withheld: list[str] = field(default_factory=list)   # plans left out: with them the peak rose
    unmet: "BudgetError | None" = None      # the budget no plans meet, where the lowest peak was settled for

    @property
    def graph(self) -> Graph:
        return self.result.graph

    def budget_line(self) -> str:
        """The planner's choice, and the peak the backend simulates for the rewrite it made."""
        return self.choice.describe() + (f"; the rewritten graph simulates at {self.simulated_peak / 2**20:.1f} MiB"
                                         if self.simulated_peak is not None else "")

    def report(self) -> str:
        parts = []
        if self.chunk_result is not None and self.chunk_result.plans:
            parts.append(self.chunk_result.report())
            parts.append(f"Built {self.chunked} chunk region(s) as {self.built_as}.")
            parts.extend(f"not built: {f}" for f in self.not_built)
        parts.append(self.result.report())
        if self.withheld:
            parts.append(f"Not applied: {', '.join(self.withheld)}; with them the backend's simulation put the "
                         f"step's peak above the original's {self.original_peak / 2**20:.1f} MiB (without them "
                         f"{self.simulated_peak / 2**20:.1f} MiB).")
        if self.choice is not None:
            parts.append(self.budget_line())
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
            device: "DeviceProfile | None" = None, never_above_original: bool = False,
            settle: bool = False) -> Rewrite:
    """Apply `rules` to the builder's graph (see the module docstring). `on_failure` hears of
    each internal error that made a site be skipped; strict mode raises the first instead.
    With a `budget` the planner chooses the plans (engine.budget), not a config; the result
    is simulated again and the program tightened while it is over the budget. With neither,
    every plan is applied; `never_above_original`: but for the plans with which the backend's
    simulation puts the peak above the graph as given (`_never_above_original`). A budget no
    plans meet raises BudgetError, which names the lowest peak built; with `settle`, that
    rewrite is the result instead, with the error as its `unmet`."""
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
        if budget is None and entries is None and never_above_original:
            return _never_above_original(builder, rules, tiers, forward_outputs, strict, excluded)
        if budget is None:
            builder.start()
            return _attempt(builder, rules, entries, tiers, forward_outputs, strict, excluded)
        return _within_budget(builder, rules, budget, device, tiers, forward_outputs, strict, excluded, settle)

    done = with_fallback(attempt, strict, failed)
    for failure in (f for r in (done.chunk_result, done.result) if r is not None for f in r.planning.failures):
        failed(failure)
    done.failures = failures
    return done


# A budget in bytes this many times the planner's estimate of the graph as given is met without
# a plan or a simulation: the backends' simulations have measured at most 1.7x that estimate
# (ONNX Runtime's arena against the schedule's live bytes; on torch they are below it).
CLEARLY_FITS = 3.0
MAX_PROBES = 6         # rewrites built and simulated while searching the planner's budget
GAIN_FLOOR = 20e-6     # seconds: a probe whose choice saves less than this (or 2%) is not built


def _within_budget(builder: Builder, rules: RuleSet, budget, device, tiers: tuple[str, ...],
                   forward_outputs: list[str] | None, strict: bool, excluded: frozenset[Site],
                   settle: bool = False) -> Rewrite:
    """The planner's additive model chooses; the backend's simulation (its order, its allocator)
    judges. The search is over the budget given to the model: the user's budget first, then a
    secant step by what the simulation said (down by the overshoot, then by the secant of two
    overshooting probes, or at least doubling where the simulation did not move; up by the
    slack), bisecting where the step leaves the bracket. Each probe builds and simulates
    a whole rewrite (seconds on a large model), so it is built only when it could pay: a model
    budget whose choice is a selection already built, or saves too little extra time over the
    best fitting rewrite, is judged without building. The search ends when the best rewrite
    nearly fills the budget, when no model budget in the bracket can save enough extra time to
    be worth a build (the choice that overshot bounds what any can save), when the bracket
    closes, or after MAX_PROBES rewrites. The original graph is simulated only when the budget
    needs it (a fraction, a ratio) or the error names it."""
    from .analysis import analyze
    from .budget import Budget, BudgetError, Choice, Program, annotate_costs, choose, parse_budget, ratio_target

    builder.start()
    budget = parse_budget(budget)
    given = builder.current(True)
    simulated_original: list[int] = []

    def original_peak() -> int:
        """The graph as given, simulated: for a fraction or a ratio, and for the error message
        (a budget in bytes needs no simulation of it, which costs as much as a probe). It
        starts the builder afresh: call it before building, not between a build and its use."""
        nonlocal holding
        if not simulated_original:
            builder.start()
            holding = None
            simulated_original.append(builder.simulate(builder.current(True)))
        return simulated_original[0]

    # Planned once: a probe selects sites by (rule, node) name, which every fresh start keeps.
    planning = plan_all(builder.current, rules, tiers, forward_outputs, strict, excluded)
    planned_on = builder.current(False)
    program = Program.of(planning, planned_on, device)
    original, lowest = program.curve.peak, program.lowest()
    target = note = None
    built: dict[frozenset, Rewrite] = {}
    holding: Rewrite | None = None          # the rewrite the builder's graph is now

    def build(choice: Choice, simulated: int | None = None) -> Rewrite:
        """The rewrite `choice` selects, simulated (unless its peak is known from an earlier build)."""
        nonlocal holding
        builder.start()
        choice.budget, choice.note = target, note
        done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded, choice.selection,
                        estimate_peaks=False)
        done.choice = choice
        done.simulated_peak = simulated if simulated is not None else builder.simulate(done.result.graph)
        holding = done
        return done

    def everything() -> Rewrite:
        """Every plan the rules offer (what `remat apply` does without a budget): the lowest peak."""
        nonlocal holding
        original = original_peak()
        builder.start()
        done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded, estimate_peaks=False)
        done.simulated_peak = builder.simulate(done.result.graph)
        results = [r for r in (done.chunk_result, done.result) if r is not None]
        plans = [p for r in results for p in r.planning.plans if p.requested]
        annotate_costs(Planning(done.result.graph, rules, done.result.planning.analysis, plans), device)
        selection = {o.match.site: None for p in plans for o in p.occurrences}
        done.choice = Choice(target, original, done.simulated_peak,
                             sum(p.extra_seconds or 0.0 for p in plans), selection, note=note)
        holding = done
        return done

    floor = None
    if budget.ratio is not None:
        # A ratio is of what recomputing the layers takes off the peak as the backend runs it:
        # the layers' stash, or less where the rules' lowest simulated peak says so.
        floor = everything()
        target, note = ratio_target(budget.ratio, original_peak(), given, analyze(given, forward_outputs),
                                    original_peak() - floor.simulated_peak)
        target, note = budget.planned_for(target), note + _cut_note(budget)
        floor.choice.budget, floor.choice.note = target, note
        if target <= floor.simulated_peak:
            return floor
    else:
        # A fraction is of the peak the backend simulates; bytes need no simulation of the original.
        target = budget.planned_for(budget.bytes if budget.bytes is not None else budget.limit(original_peak()))
        note = _cut_note(budget).removeprefix("; ")
    target = max(1, target)
    if budget.bytes is not None and target >= CLEARLY_FITS * original:
        # The graph as given fits with room to spare (a free budget on a large device, most
        # often): no plan is worth its time, and no simulation its seconds.
        builder.start()
        done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded, {}, estimate_peaks=False)
        done.choice = Choice(target, original, original, 0.0, {}, note=(
            f"over {CLEARLY_FITS:g}x the graph's estimated peak: no plan, not simulated"))
        return done
    # Model budgets, both bounds exclusive: at lo and below nothing cheaper fits, hi overshoots.
    lo, hi = lowest - 1, max(original, lowest) + 1
    best: Rewrite | None = None
    model = min(max(target, lowest), hi - 1)
    probes = down = 0
    over: tuple[int, int] | None = None     # the last overshooting probe: (model budget, simulated)
    cheapest_over: float | None = None      # the extra time of the choice at hi, which overshot

    def margined(overshoot: int) -> int:
        """A first step down: the overshoot and a margin (the overshoot alone tends to land just over)."""
        return overshoot + max(overshoot // 8, target // 100)

    def small(gain: float) -> bool:
        """Too little extra time saved over the best fitting rewrite to build another for."""
        return gain <= max(GAIN_FLOOR, 0.02 * best.choice.extra_seconds)

    while probes < MAX_PROBES and lo < model < hi:
        choice = choose(planning, planned_on, Budget(bytes=max(1, model)), device, program=program)
        key = frozenset(choice.selection.items())
        fresh = False
        if key in built:
            done = built[key]
        elif best is not None and small(best.choice.extra_seconds - choice.extra_seconds):
            done = None
        else:
            done = built[key] = build(choice)
            probes, fresh = probes + 1, True
        log.debug("budget search: model budget %.1f MiB -> %s", model / 2**20,
                  "not built (no cheaper than the best that fits)" if done is None else
                  f"simulated {done.simulated_peak / 2**20:.1f} MiB for {target / 2**20:.1f}, "
                  f"extra {done.choice.extra_seconds * 1e3:.1f} ms")
        if done is None:            # no cheaper than the best that fits: as good as fitting
            lo, step = model, None
        elif done.simulated_peak <= target:
            if best is None or done.choice.extra_seconds < best.choice.extra_seconds:
                best = done
            lo, slack = model, target - done.simulated_peak
            if slack <= target // 50:
                break               # the budget is nearly full: a larger model budget would overshoot
            step = model + slack
        elif fresh and (at := builder.calls.peak) is not None \
                and (finer := _finer_slices(program, at.site, done.choice)) is not None:
            # The simulation peaked on a chunk region's slice call: its slice is the step's highest
            # point. The additive model underrates a slice there (a body holds a slice's values
            # and their gradients together, where the whole step wrote a gradient over its values
            # in place), so more plans elsewhere, which a lower model budget buys, miss that peak:
            # the region's counts up to the one built are withdrawn, and the model budget steps
            # down only by what the simulation put over the budget elsewhere.
            program, overshoot = finer, at.elsewhere - target
            step = model if overshoot <= 0 else model - margined(overshoot)
            log.debug("budget search: the peak is a slice of %s (elsewhere %.1f MiB); finer slices there",
                      at.site, at.elsewhere / 2**20)
        else:
            # Down by the overshoot and a margin (the secant, taking the simulation to move with
            # the model).
            # A second step down follows the secant of the two overshooting probes, with a
            # margin, where the simulation moved with the model between them; where it did not
            # (the allocator rounds small changes away: a probe 4 MiB lower can simulate exactly
            # as high), it is at least an eighth of the way to the floor and twice the last, so
            # steps of the overshoot alone cannot crawl.
            overshoot = done.simulated_peak - target
            slope = 0.0 if over is None else (over[1] - done.simulated_peak) / max(1, over[0] - model)
            if not down:
                down = margined(overshoot)
            elif slope >= 0.5:
                down = int(overshoot / min(slope, 1.0) * 1.5) + target // 200
            else:
                down = max(overshoot, 2 * down, (model - lo) // 8)
            over = (model, done.simulated_peak)
            hi, step, cheapest_over = model, model - down, done.choice.extra_seconds
        model = step if step is not None and lo < step < hi else (lo + hi) // 2
        if hi - lo <= max(target // 100, 1):
            break
        if best is not None and cheapest_over is not None and small(best.choice.extra_seconds - cheapest_over):
            break                   # no model budget below hi saves more than that: none is worth a build
    unmet = None
    if best is None:
        best = floor or everything()
        # Every plan at once is not always the lowest peak: recomputed values the backward holds
        # together can put it higher than a probe's fewer plans (an MLP's GELUs and GEMMs on
        # torch: 81.3 MiB with all of them, 65.3 with the one the search tried first).
        lowest_probe = min(built.values(), key=lambda d: d.simulated_peak, default=None)
        if lowest_probe is not None and lowest_probe.simulated_peak < best.simulated_peak:
            best = lowest_probe
        if best.simulated_peak > target:
            unmet = BudgetError(target, best.simulated_peak, original_peak(), tiers)
            if not settle:
                raise unmet
    if holding is not best:         # the builder holds another probe's graph: rebuild the best one
        best = everything() if best is floor else build(best.choice, best.simulated_peak)
    best.unmet = unmet
    return best


def _cut_note(budget) -> str:
    """For the report: the bytes the plan keeps below the budget, and why."""
    if not budget.cut:
        return ""
    return (f"; the budget less {format_bytes(budget.cut)}: what the code compiled for this graph "
            f"before held over its simulation")


def _finer_slices(program: Program, site: Site, choice: Choice) -> Program | None:
    """`program` without the options that slice the chunk region at `site` as few ways as
    `choice` does or fewer; None where the choice did not slice it or no finer count remains."""
    k = choice.selection.get(site)
    if k is None or not any(o.group == site and o.key[1] > k for o in program.options):
        return None
    return replace(program, options=[o for o in program.options if not (o.group == site and o.key[1] <= k)])


def _never_above_original(builder: Builder, rules: RuleSet, tiers: tuple[str, ...],
                          forward_outputs: list[str] | None, strict: bool, excluded: frozenset[Site]) -> Rewrite:
    """Every plan the rules offer (no budget, no config), less the plans with which the backend's
    simulation puts the step's peak above the graph as given: a plan saves its stash on its own,
    but where the backend runs the rewritten graph in another order, or keeps a recomputed value
    alive with others, the peak can rise. While the rewrite simulates above the original, the plan
    (every occurrence of one plan key) whose leaving out lowers the simulated peak most is left
    out; where none lowers it, none is applied. Two simulations where nothing rises (ONNX, BERT:
    about a second each); a rewrite and a simulation per plan tried where something does."""
    builder.start()
    original = builder.simulate(builder.current(True))
    builder.start()
    done = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded)
    done.simulated_peak, done.original_peak = builder.simulate(done.result.graph), original
    if not original or done.simulated_peak <= original:
        return done
    sites: dict[str, list[Site]] = {}
    for result in (done.chunk_result, done.result):
        for p in (result.planning.plans if result is not None else []):
            if p.requested:
                sites.setdefault(p.key, []).extend(o.match.site for o in p.occurrences)
    keys, withheld = list(sites), []
    best, best_selection = done, None

    def build(selection: dict[Site, int | None]) -> Rewrite:
        builder.start()
        trial = _attempt(builder, rules, None, tiers, forward_outputs, strict, excluded, selection)
        trial.simulated_peak, trial.original_peak = builder.simulate(trial.result.graph), original
        return trial

    def without(*left_out: str) -> dict[Site, int | None]:
        return {site: None for k in keys if k not in left_out for site in sites[k]}

    while best.simulated_peak > original and keys:
        trials = [(build(without(key)), key) for key in keys]
        trial, key = min(trials, key=lambda t: t[0].simulated_peak)
        if trial.simulated_peak >= best.simulated_peak:
            break
        keys.remove(key)
        withheld.append(key)
        best, best_selection = trial, without()
        log.info("remat: %s left out: the simulated peak %.1f MiB without it", key, trial.simulated_peak / 2**20)
    if best.simulated_peak > original:
        withheld += keys
        keys, best_selection = [], {}
    best = build(best_selection)      # the builder holds the last trial built: build the chosen one again
    best.withheld = withheld
    return best


def build_selection(builder: Builder, rules: RuleSet, selection: dict[Site, int | None],
                    tiers: Iterable[str] = (), strict: bool | None = None) -> Rewrite:
    """Exactly the plan sites of `selection` (a chunk region at its slice count, None for a
    recompute) applied to the builder's graph as given: what a budget's choice builds."""
    builder.start()
    return _attempt(builder, rules, None, tuple(tiers), None, resolve_strict(strict), frozenset(), selection)


def _attempt(builder: Builder, rules: RuleSet, entries: list[ConfigEntry] | None, tiers: tuple[str, ...],
             forward_outputs: list[str] | None, strict: bool, excluded: frozenset[Site],
             selection: dict[Site, int | None] | None = None, estimate_peaks: bool = True) -> Rewrite:
    if entries is not None:
        # Checked once against the graph as given; the re-plans below skip the plans consumed.
        select(plan_all(builder.current, rules, tiers, forward_outputs, strict).plans, entries)
    chunk_entries = None if entries is None else [e for e in entries if e.type == PlanType.CHUNK]
    other_entries = None if entries is None else [e for e in entries if e.type != PlanType.CHUNK]
    chunk_rules, other_rules = rules.of_types({PlanType.CHUNK}), rules.of_types(RECOMPUTE_TYPES)
    first: Result | None = None
    chunked, not_built = 0, []
    unbuildable: set[Site] = set()
    pending: list[ChunkRegion] = []
    result: Result | None = None
    consumed = _Consumed()
    while chunk_rules.rules and chunked < MAX_CHUNK_SITES:
        if result is None or (pending and consumed.touches(pending[0])):
            # Planned once on the graph as given; planned again only when a region reaches into
            # one already built (its nodes or values are gone), as if after each region.
            result = apply(builder.current(fold=False), chunk_rules, chunk_entries, _known(chunk_rules, tiers),
                           forward_outputs, lenient=True, strict=strict, excluded=excluded, selection=selection,
                           estimate_peaks=estimate_peaks)
            first = first or result
            pending = [r for r in result.chunks if r.match.site not in unbuildable]
            consumed = _Consumed()
        if not pending:
            break
        region = pending.pop(0)
        try:
            with at_site(region.match.site, "build", region.key):
                builder.build(result, region, chunked)
        except PlanFailure as failure:
            if not isinstance(failure.cause, GraphError):
                raise
            # Refused by the backend before it changed anything: the graph runs this region whole.
            unbuildable.add(region.match.site)
            not_built.append(f"{region.match.rule.name} at {region.match.root.name}: {failure.cause}")
            continue
        consumed.add(region)
        chunked += 1
        for p in first.plans:
            if p.key == region.key and p.type == PlanType.CHUNK:
                p.applied += 1
    result = apply(builder.current(fold=True), other_rules, other_entries, _known(other_rules, tiers),
                   forward_outputs, lenient=True, strict=strict, excluded=excluded, selection=selection,
                   estimate_peaks=estimate_peaks)
    builder.finish(result)
    return Rewrite(result, first, builder.built_as, chunked, not_built)


class _Consumed:
    """The names a built region took out of the graph (its nodes, the values they made): a
    region planned beside it that names one of them must be planned again on the graph as it
    now is. Regions apart from each other (one per layer's attention, the loss) are built from
    one plan: planning again after each, as the loop once did, cost O(regions x nodes) per
    region (16 layers: 20 plans at 2.8 s each)."""

    def __init__(self) -> None:
        self.nodes: set[str] = set()
        self.values: set[str] = set()

    def add(self, region: ChunkRegion) -> None:
        self.nodes.update(n.name for n in region.nodes)
        self.values.update(o.name for n in region.nodes for o in n.outputs if o is not None)

    def touches(self, region: ChunkRegion) -> bool:
        nodes = [*region.nodes, *region.tangent_chain]
        values = [*region.inputs, *(o for n in nodes for o in n.outputs if o is not None)]
        if region.tangent is not None:
            values.append(region.tangent)
        return any(n.name in self.nodes for n in nodes) or any(v.name in self.values for v in values)

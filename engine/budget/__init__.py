"""The budget planner: of every plan the rules offer, the set with the least estimated extra
time whose estimated peak fits a memory budget.

- `effects`: the memory curve of the schedule and what each plan does to it;
- `cost`: each plan's extra time, from per-op FLOPs and bytes and a device profile;
- `solve`: the mixed-integer program (HiGHS);
- `device`, `spec`: device profiles and budgets as users write them.

`choose` returns a `Choice`: which sites to apply (a chunk region with its slice count).
`engine.rewrite(..., budget=...)` applies it and re-simulates the result, tightening the
program when the additive model was optimistic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import analyze
from ..apply import Planning
from ..errors import RematError
from ..failures import Site
from ..ir import Graph
from ..plan_type import PlanType
from ..strategies.chunk import ChunkRegion
from .cost import cache_fitting_slices, chunk_seconds, graph_seconds, recompute_seconds, region_traffic
from .device import PRESETS, DeviceProfile, preset
from .effects import Curve, chunk_effect, chunk_value_names, memory_curve, recompute_effect
from .solve import Option, applied, lowest_peak, solve
from .layers import find_layers, layer_places, place_of, ratio_target
from .spec import Budget, parse_budget, parse_ratio

__all__ = ["Budget", "BudgetError", "Choice", "DeviceProfile", "PRESETS", "ParetoPoint", "annotate_costs",
           "Program", "choose", "find_layers", "memory_curve", "pareto", "parse_budget", "parse_ratio", "preset",
           "ratio_target", "reach"]

SLICE_MENU = (2, 4, 8, 16, 32, 64)


class BudgetError(RematError):
    """The budget cannot be met by any set of plans; names the lowest peak they reach."""

    def __init__(self, budget: int, lowest: int, original: int, tiers: tuple[str, ...] = (), why: str = ""):
        """`why`: what the peak asked for is, where it is not the budget as given."""
        self.budget, self.lowest, self.original, self.tiers = budget, lowest, original, tuple(tiers)
        tier = "" if "expensive" in tiers else "enable a tier (--tier expensive), "
        why = f" ({why})" if why else ""
        super().__init__(f"a peak of {budget / 2**20:.1f} MiB{why} cannot be reached: the lowest estimated peak "
                         f"the rules reach is {lowest / 2**20:.1f} MiB ({lowest / max(original, 1):.2f}x the "
                         f"original's {original / 2**20:.1f} MiB); raise the budget, {tier}or add rules")


@dataclass
class Choice:
    """The planner's answer: the sites to apply and, for chunk regions, their slice counts."""

    budget: int                          # bytes
    original_peak: int                   # estimated, bytes
    estimated_peak: int                  # of the chosen set, by the additive model
    extra_seconds: float
    selection: dict[Site, int | None] = field(default_factory=dict)
    options: list[Option] = field(default_factory=list)
    note: str = ""                       # how the budget was read (a --ratio's layers), for the report

    def mark(self, plans) -> None:
        """Set each plan's requested count to the occurrences chosen, for the plan table."""
        for plan in plans:
            plan.requested = sum(1 for r in plan.occurrences if r.match.site in self.selection)

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget, "original_peak_bytes": self.original_peak,
                "estimated_peak_bytes": self.estimated_peak, "extra_seconds": self.extra_seconds,
                "chosen": [{"rule": s.rule, "node": s.node, "slices": k} for s, k in self.selection.items()]}

    def describe(self) -> str:
        return (f"Budget {self.budget / 2**20:.1f} MiB: estimated peak {self.original_peak / 2**20:.1f} -> "
                f"{self.estimated_peak / 2**20:.1f} MiB, estimated extra time {self.extra_seconds * 1e3:.2f} ms, "
                f"{len(self.selection)} plan occurrence(s) chosen" + (f" ({self.note})" if self.note else ""))


def menu(region: ChunkRegion, fitting: int | None = None) -> list[int]:
    """Slice counts to choose from: the rule's own, powers of two up to the sliced size, and
    `fitting`, the fewest at which the slices' working set fits the device's cache."""
    most = region.most_slices
    counts = {len(region.chunks), *(k for k in SLICE_MENU if k <= most), *([fitting] if fitting else [])}
    return sorted(k for k in counts if 2 <= k <= most)


def options_for(planning: Planning, curve: Curve, device: DeviceProfile) -> tuple[list[Option], list]:
    """Every plan occurrence as an option (chunk regions once per slice count), and the pairs
    of sites that cannot both apply (a recompute of a value a chunk region computes)."""
    rules = planning.rules
    examples = curve.graph.dim_examples
    analysis = analyze(curve.graph, curve.graph.forward_outputs)
    views = rules.views
    options: list[Option] = []
    chunk_values: dict[Site, set[str]] = {}
    place = layer_places(curve.graph, analysis)

    def family(region, k) -> tuple | None:
        at = place_of(region.match.root, place)
        return None if at is None else (region.match.rule.name, region.key, k, at)

    for plan in planning.plans:
        for region in plan.occurrences:
            site = region.match.site
            if plan.type == PlanType.CHUNK:
                chunk_values[site] = chunk_value_names(region)
                traffic = region_traffic(region, rules, examples)
                for k in menu(region, cache_fitting_slices(region, traffic, device)):
                    effect = chunk_effect(region, k, curve, analysis, views)
                    if effect:
                        options.append(Option((site, k), site, chunk_seconds(region, k, rules, examples, device,
                                                                             traffic),
                                              effect, family(region, k)))
            else:
                effect = recompute_effect(region, curve, analysis, views)
                if effect:
                    options.append(Option((site, None), site, recompute_seconds(region, rules, examples, device),
                                          effect, family(region, None)))
    conflicts = []
    for plan in planning.plans:
        if plan.type == PlanType.CHUNK:
            continue
        for region in plan.occurrences:
            names = {t.name for t in region.targets}
            conflicts += [(region.match.site, chunk) for chunk, values in chunk_values.items() if names & values]
    return options, conflicts


# What a layer that runs other plans than its repeats costs the planner, as a share of the step's
# estimated time: its kernels are compiled anew (seconds each on a CPU), so an uneven choice must
# buy more than this to be taken (engine.budget.solve, `partial_cost`).
LAYER_VARIANT_SHARE = 0.01


@dataclass
class Program:
    """What the planner solves over for one plan table: the memory curve of the graph the plans
    were found on, every option, the pairs of sites that conflict, and what an uneven choice
    across identical layers costs. Built once and solved for as many budgets as a search tries
    (building it walks the graph and costs every option)."""

    curve: Curve
    options: list[Option]
    conflicts: list
    tiers: tuple[str, ...] = ()
    partial_cost: float = 0.0

    @classmethod
    def of(cls, planning: Planning, graph: Graph, device: DeviceProfile | None = None) -> "Program":
        device = device or PRESETS["cpu-default"]
        curve = memory_curve(graph, planning.rules.views)
        options, conflicts = options_for(planning, curve, device)
        step = graph_seconds(graph.nodes, planning.rules, graph.dim_examples, device)
        return cls(curve, options, conflicts, planning.tiers, LAYER_VARIANT_SHARE * step)

    def lowest(self) -> int:
        """The lowest peak the options reach, by the additive model."""
        return lowest_peak(self.curve.live, self.options, self.conflicts)


def reach(planning: Planning, graph: Graph, device: DeviceProfile | None = None) -> tuple[int, int]:
    """(the original's peak, the lowest peak the plans reach), by the planner's additive model."""
    program = Program.of(planning, graph, device)
    return program.curve.peak, program.lowest()


def choose(planning: Planning, graph: Graph, budget: Budget | str | float | int,
           device: DeviceProfile | None = None, margin: int = 0, program: Program | None = None) -> Choice:
    """The cheapest set of `planning`'s plans whose estimated peak on `graph` (the graph the
    chunk plans were found on) is within `budget` less `margin` bytes. BudgetError when none is.
    `program`: the one `Program.of(planning, graph, device)` gives, when the caller has it."""
    budget = parse_budget(budget)
    program = program or Program.of(planning, graph, device)
    curve = program.curve
    if budget.ratio is None:
        limit, note = budget.limit(curve.peak), ""
    else:
        limit, note = ratio_target(budget.ratio, curve.peak, graph, analyze(graph, graph.forward_outputs),
                                   curve.peak - program.lowest())
    chosen = solve(curve.live, program.options, limit - margin, program.conflicts, program.partial_cost)
    if chosen is None:
        raise BudgetError(limit, program.lowest(), curve.peak, planning.tiers)
    live = applied(curve.live, chosen)
    return Choice(limit, curve.peak, max(live, default=0), sum(o.seconds for o in chosen),
                  {o.key[0]: o.key[1] for o in chosen}, chosen, note)


def annotate_costs(planning: Planning, device: DeviceProfile | None = None) -> None:
    """Each plan's estimated extra time, all occurrences applied (chunk regions at the rule's
    slice count), for the plan table."""
    device = device or PRESETS["cpu-default"]
    rules, examples = planning.rules, planning.graph.dim_examples
    for plan in planning.plans:
        plan.extra_seconds = sum(
            chunk_seconds(r, len(r.chunks), rules, examples, device) if isinstance(r, ChunkRegion)
            else recompute_seconds(r, rules, examples, device) for r in plan.occurrences)


@dataclass(frozen=True)
class ParetoPoint:
    budget: int
    estimated_peak: int
    extra_seconds: float
    original_peak: int

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget, "estimated_peak_bytes": self.estimated_peak,
                "extra_seconds": self.extra_seconds, "original_peak_bytes": self.original_peak}


def pareto(planning: Planning, graph: Graph, device: DeviceProfile, steps: int = 12) -> list[ParetoPoint]:
    """The planner's choice over budgets from the original peak down to the lowest reachable one."""
    program = Program.of(planning, graph, device)
    curve, low = program.curve, program.lowest()
    points = []
    for k in range(steps):
        limit = int(curve.peak - (curve.peak - low) * k / (steps - 1))
        chosen = solve(curve.live, program.options, limit, program.conflicts, program.partial_cost)
        if chosen is None:
            continue
        live = applied(curve.live, chosen)
        points.append(ParetoPoint(limit, max(live, default=0), sum(o.seconds for o in chosen), curve.peak))
    return points

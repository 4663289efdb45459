"""The planner's mixed-integer program, solved by HiGHS (scipy.optimize.milp).

One binary per option (a recompute region on or off; a chunk region at one slice count of a
small menu, at most one count per region). Minimize the summed extra seconds subject to the
curve at every step that can exceed the budget: live(s) + sum of the chosen options' deltas
at s <= budget. Effects are assumed additive; the caller re-simulates the chosen set. An option may cost less
than nothing (a chunk region whose slices stay in the cache, engine.budget.cost.traffic_seconds): it
is taken whatever the budget, as the fastest step that fits.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .effects import Interval


# The solver stops within 1% of the cheapest set's extra time: at 48 layers (724 plan sites) the
# default gap, 0.01%, took 21 s of proving for nothing a step would notice.
MIP_GAP = 0.01


@dataclass
class Option:
    key: object                 # what the caller selects with it
    group: object               # options of one group are exclusive (one chunk region's counts)
    seconds: float
    effect: list[Interval]
    # Options that do the same thing in each layer (one rule, plan and slice count at the same
    # place of every repeated layer): a family taken in some layers but not all costs
    # `solve`'s `partial_cost`, since those layers then compile kernels of their own.
    family: object = None


def applied(live: list[int], options: list[Option]) -> list[int]:
    """The curve with the options' effects added, by the additive model."""
    curve = list(live)
    for option in options:
        for first, last, delta in option.effect:
            for s in range(first, last + 1):
                curve[s] += delta
    return curve


def _matrix(options: list[Option], rows: list[int]) -> np.ndarray:
    a = np.zeros((len(rows), len(options)))
    for j, option in enumerate(options):
        for first, last, delta in option.effect:
            lo, hi = bisect.bisect_left(rows, first), bisect.bisect_right(rows, last)
            a[lo:hi, j] += delta
    return a


def _constraints(options: list[Option], live: list[int], candidates: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The program's memory rows, `a @ x + live <= ...`, for the candidate steps, with the
    redundant ones dropped: between two interval boundaries every step sees the same options,
    so only its highest step binds; and of rows with equal coefficients, only the highest live.
    (48 layers: 18,253 steps become a few thousand rows.)"""
    bounds = sorted({b for o in options for first, last, _ in o.effect for b in (first, last + 1)})
    best: dict[int, int] = {}           # segment -> its candidate step with the most live bytes
    for step in candidates:
        segment = bisect.bisect_right(bounds, step)
        if segment not in best or live[step] > live[best[segment]]:
            best[segment] = step
    rows = sorted(best.values())
    a = _matrix(options, rows)
    heights = np.array([live[s] for s in rows], dtype=float)
    if len(rows) > 1:
        unique, inverse = np.unique(a, axis=0, return_inverse=True)
        top = np.full(len(unique), -np.inf)
        np.maximum.at(top, inverse.reshape(-1), heights)
        a, heights = unique, top
    return a, heights


def _groups(options: list[Option], conflicts: list[tuple[object, object]]) -> list[np.ndarray]:
    """Rows of `sum <= 1`: the options of one group, and each pair of conflicting groups."""
    by_group: dict[object, list[int]] = {}
    for j, o in enumerate(options):
        by_group.setdefault(o.group, []).append(j)
    rows = []
    for members in by_group.values():
        if len(members) > 1:
            rows.append(members)
    for a, b in conflicts:
        if a in by_group and b in by_group:
            rows.append(by_group[a] + by_group[b])
    out = []
    for members in rows:
        row = np.zeros(len(options))
        row[members] = 1
        out.append(row)
    return out


def _families(options: list[Option]) -> list[list[int]]:
    by_family: dict[object, list[int]] = {}
    for j, o in enumerate(options):
        if o.family is not None:
            by_family.setdefault(o.family, []).append(j)
    return [members for members in by_family.values() if len(members) > 1]


def solve(live: list[int], options: list[Option], budget: int,
          conflicts: list[tuple[object, object]] = (), partial_cost: float = 0.0) -> list[Option] | None:
    """The cheapest options that keep every step within `budget`; None when none can.
    `partial_cost` (seconds) is added for each family of options taken in some of its layers
    but not all: identical layers that run identical plans share their compiled kernels
    (Inductor keys a kernel by its code), so uneven layers cost compile time (16 layers, 0.7x
    the peak: 53 kernels compiled against torch.compile's 34, and 35 with every plan on)."""
    from scipy.optimize import Bounds, LinearConstraint, milp    # 33 MiB resident: only when planning
    positive = np.zeros(len(live))
    for o in options:
        for first, last, delta in o.effect:
            if delta > 0:
                positive[first:last + 1] += delta
    rows = [s for s, v in enumerate(live) if v + positive[s] > budget]
    # An option that saves time (a chunk whose slices stay in the cache) is taken under any budget.
    if not rows and all(o.seconds >= 0 for o in options):
        return []
    if not options:
        return None
    n = len(options)
    families = _families(options) if partial_cost > 0 else []
    # Variables: the options, then per family `all` (every member on), `any` (one or more on) and
    # `partial` (>= any - all), which is what costs.
    width = n + 3 * len(families)
    blocks = []
    if rows:
        a, heights = _constraints(options, live, rows)
        blocks.append((np.hstack([a, np.zeros((len(a), width - n))]), -np.inf, budget - heights))
    exclusive = _groups(options, list(conflicts))
    if exclusive:
        blocks.append((np.hstack([np.array(exclusive), np.zeros((len(exclusive), width - n))]), -np.inf, 1))
    family_rows = []
    for f, members in enumerate(families):
        every, some, partial = n + 3 * f, n + 3 * f + 1, n + 3 * f + 2
        for j in members:
            family_rows.append({every: 1, j: -1})       # all <= x_j
            family_rows.append({j: 1, some: -1})        # x_j <= any
        family_rows.append({some: 1, every: -1, partial: -1})   # any - all <= partial
    if family_rows:
        matrix = np.zeros((len(family_rows), width))
        for r, row in enumerate(family_rows):
            for col, coef in row.items():
                matrix[r, col] = coef
        blocks.append((matrix, -np.inf, 0))
    constraints = [LinearConstraint(m, lo, hi) for m, lo, hi in blocks]
    # A tie-break toward fewer options: a plan that costs nothing is still not applied for nothing.
    cost = np.concatenate([np.array([o.seconds for o in options]) + 1e-9,
                           np.tile([0.0, 0.0, partial_cost], len(families))])
    result = milp(cost, constraints=constraints, integrality=np.ones(width), bounds=Bounds(0, 1),
                  options={"mip_rel_gap": MIP_GAP})
    if result.status != 0 or result.x is None:
        return None
    return [o for o, x in zip(options, result.x[:n]) if x > 0.5]


def lowest_peak(live: list[int], options: list[Option], conflicts: list[tuple[object, object]] = ()) -> int:
    """The lowest peak the options can reach (the same program, minimizing the peak)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    if not live:
        return 0
    saving, positive = np.zeros(len(live)), np.zeros(len(live))
    for o in options:
        for first, last, delta in o.effect:
            (saving if delta < 0 else positive)[first:last + 1] += delta
    floor = max(v + s for v, s in zip(live, saving))      # no choice does better at its step
    rows = [s for s, v in enumerate(live) if v + positive[s] >= floor]
    a, heights = _constraints(options, live, rows)
    n = len(options)
    # Variables: the options, then the peak P. live(s) + A x <= P.
    matrix = np.hstack([a, -np.ones((len(a), 1))])
    constraints = [LinearConstraint(matrix, -np.inf, -heights)]
    exclusive = _groups(options, list(conflicts))
    if exclusive:
        constraints.append(LinearConstraint(np.hstack([np.array(exclusive), np.zeros((len(exclusive), 1))]),
                                            -np.inf, 1))
    cost = np.zeros(n + 1)
    cost[-1] = 1
    integrality = np.concatenate([np.ones(n), [0]])
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]]))
    result = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds)
    if result.status != 0 or result.x is None:
        return max(live)
    return int(round(result.x[-1]))

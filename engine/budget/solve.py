"""The planner's mixed-integer program, solved by HiGHS (scipy.optimize.milp).

One binary per option (a recompute region on or off; a chunk region at one slice count of a
small menu, at most one count per region). Minimize the summed extra seconds subject to the
curve at every step that can exceed the budget: live(s) + sum of the chosen options' deltas
at s <= budget. Effects are assumed additive; the caller re-simulates the chosen set.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .effects import Interval


@dataclass
class Option:
    key: object                 # what the caller selects with it
    group: object               # options of one group are exclusive (one chunk region's counts)
    seconds: float
    effect: list[Interval]


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


def solve(live: list[int], options: list[Option], budget: int,
          conflicts: list[tuple[object, object]] = ()) -> list[Option] | None:
    """The cheapest options that keep every step within `budget`; None when none can."""
    positive = np.zeros(len(live))
    for o in options:
        for first, last, delta in o.effect:
            if delta > 0:
                positive[first:last + 1] += delta
    rows = [s for s, v in enumerate(live) if v + positive[s] > budget]
    if not rows:
        return []
    if not options:
        return None
    a = _matrix(options, rows)
    constraints = [LinearConstraint(a, -np.inf, budget - np.array([live[s] for s in rows], dtype=float))]
    exclusive = _groups(options, list(conflicts))
    if exclusive:
        constraints.append(LinearConstraint(np.array(exclusive), -np.inf, 1))
    # A tie-break toward fewer options: a plan that costs nothing is still not applied for nothing.
    cost = np.array([o.seconds for o in options]) + 1e-9
    result = milp(cost, constraints=constraints, integrality=np.ones(len(options)), bounds=Bounds(0, 1))
    if result.status != 0 or result.x is None:
        return None
    return [o for o, x in zip(options, result.x) if x > 0.5]


def lowest_peak(live: list[int], options: list[Option], conflicts: list[tuple[object, object]] = ()) -> int:
    """The lowest peak the options can reach (the same program, minimizing the peak)."""
    if not live:
        return 0
    saving, positive = np.zeros(len(live)), np.zeros(len(live))
    for o in options:
        for first, last, delta in o.effect:
            (saving if delta < 0 else positive)[first:last + 1] += delta
    floor = max(v + s for v, s in zip(live, saving))      # no choice does better at its step
    rows = [s for s, v in enumerate(live) if v + positive[s] >= floor]
    a = _matrix(options, rows)
    n = len(options)
    # Variables: the options, then the peak P. live(s) + A x <= P.
    matrix = np.hstack([a, -np.ones((len(rows), 1))])
    constraints = [LinearConstraint(matrix, -np.inf, -np.array([live[s] for s in rows], dtype=float))]
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

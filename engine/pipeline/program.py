"""The partition and each layer's option, solved together: a mixed-integer program (HiGHS, via
scipy.optimize.milp).

One binary x[l, c, o] per layer l, virtual stage c and option o: layer l runs in c with o. Each
layer takes exactly one; the virtual stage index k(l) = sum c * x[l, c, o] starts at 0, ends at
the last, and rises by 0 or 1 from a layer to the next, so the stages are contiguous and none is
empty. For every device and each of its peak moments (engine.pipeline.schedule), its weights and
optimizer state, plus each of its virtual stages' held bytes times the micro-batches in flight
there, plus its largest workspace, stay within its limit. The slowest device's time per
micro-batch T is minimized; a second solve, T held, takes the least total extra time (no layer
recomputes where its stage is not the bottleneck).

The seed's program (ColossalAI #5509) counted layers and checkpointed layers per stage; with one
binary per layer the layers may differ and each may have any number of options.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError, RematError
from .plan import TOLERANCE, Assignment, PipelinePlan, evaluate
from .schedule import in_flight
from .spec import GB, Layer, PipelineSpec

# HiGHS proves the optimum to this relative gap: the slowest stage is a sum of a few dozen
# layer times, so a looser gap would hand back a visibly slower partition than the best.
MIP_GAP = 1e-7


class InfeasibleError(RematError):
    """No partition fits the limits; names the smallest memory that would."""

    def __init__(self, spec: PipelineSpec, scale: float):
        self.spec, self.scale = spec, scale
        self.smallest = tuple(limit * scale for limit in spec.memory)
        if len(set(spec.memory)) == 1:
            need = f"the smallest memory per stage that works is {_gb(self.smallest[0])}"
            given = _gb(spec.memory[0])
        else:
            need = (f"the limits would have to be {scale:.3f}x as large: "
                    + ", ".join(_gb(m) for m in self.smallest))
            given = ", ".join(_gb(m) for m in spec.memory)
        super().__init__(f"{spec.source}: memory_per_stage: no partition fits {given} "
                         f"({spec.schedule}, {spec.microbatches} micro-batches); {need}")


def _gb(value: float) -> str:
    return f"{value / GB:.4g} GB"


class _Program:
    """The program's columns and rows for one spec. Columns: x[l, c, o] (binary), then per device
    its largest workspace w_d (where a layer has one), then e[l, c] (layer l ends virtual stage c,
    where a layer has an output to hold), then the objective's z. Memory rows are in GB."""

    def __init__(self, spec: PipelineSpec):
        if not spec.layers:
            raise ConfigError(f"{spec.source}: the layers' figures are not known yet (measure the model first)")
        self.spec = spec
        n, k = len(spec.layers), spec.chunks
        self.index: list[tuple[int, int, int]] = []      # (layer, virtual stage, option) per x column
        for l, layer in enumerate(spec.layers):
            for c in self.places(l):
                for o in range(len(layer.options)):
                    self.index.append((l, c, o))
        self.columns = len(self.index)
        self.moments = in_flight(spec)
        self.workspaces = sorted({(l, o) for l, _, o in self.index if spec.layers[l].options[o].workspace > 0})
        self.spaced = spec.stages if self.workspaces else 0
        self.ends = [(l, c) for l in range(n) if spec.layers[l].output > 0 for c in self.places(l)]
        self.end_column = {key: self.columns + self.spaced + i for i, key in enumerate(self.ends)}
        self.width = self.columns + self.spaced + len(self.ends) + 1

    def places(self, l: int) -> range:
        """The virtual stages layer l can run in, every stage keeping at least one layer."""
        n, k = len(self.spec.layers), self.spec.chunks
        return range(max(0, l - (n - k)), min(l, k - 1) + 1)

    def integral(self) -> np.ndarray:
        return np.concatenate([np.ones(self.columns), np.zeros(self.width - self.columns)])

    def _rows(self, count: int) -> np.ndarray:
        return np.zeros((count, self.width))

    def layer_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each layer in one place, and the stages contiguous. With z(l, c) = 1 where layer l runs
        in virtual stage c or an earlier one: z(l + 1, c) <= z(l, c) (no layer goes back) and
        z(l + 1, c + 1) >= z(l, c) (none skips a stage). Written on the cumulative z the rows are
        those of a network, whose relaxation is far tighter than one row per neighbouring pair on
        the stage index (2.6 s -> 1.2 s on seed 004's spec with two options)."""
        n, k = len(self.spec.layers), self.spec.chunks
        one = self._rows(n)
        back = self._rows((n - 1) * k)
        skip = self._rows((n - 1) * (k - 1))
        for j, (l, c, _) in enumerate(self.index):
            one[l, j] = 1
            for up in range(c, k):              # x[l, c, o] counts in z(l, up) for up >= c
                if l + 1 < n:
                    back[l * k + up, j] -= 1                  # z(l+1, up) - z(l, up) <= 0
                    if up < k - 1:
                        skip[l * (k - 1) + up, j] -= 1        # z(l+1, up+1) - z(l, up) >= 0
                if l > 0:
                    back[(l - 1) * k + up, j] += 1
                    if up >= 1:
                        skip[(l - 1) * (k - 1) + up - 1, j] += 1
        # Symmetry: two neighbouring layers with the same figures in one stage can swap options, so
        # their option indices are made non-increasing there (o(l) - o(l + 1) >= -(options - 1)
        # * (k(l + 1) - k(l)), k the stage index; a stage boundary between them lifts it).
        same = [l for l in range(n - 1) if self.spec.layers[l] == self.spec.layers[l + 1]]
        order = self._rows(len(same))
        for i, l in enumerate(same):
            spread = len(self.spec.layers[l].options) - 1
            for j, (jl, c, o) in enumerate(self.index):
                if jl == l:
                    order[i, j] += o - spread * c
                elif jl == l + 1:
                    order[i, j] += -o + spread * c
        # e(l, c) >= y(l, c) - y(l + 1, c): layer l is the last of c (its output is held per
        # micro-batch in flight there). Memory rows only ever want e small, so >= is enough.
        ends = self._rows(len(self.ends))
        for i, (l, c) in enumerate(self.ends):
            ends[i, self.end_column[l, c]] = 1
            for j, (jl, jc, _) in enumerate(self.index):
                if jc == c and jl == l:
                    ends[i, j] -= 1
                elif jc == c and jl == l + 1:
                    ends[i, j] += 1
        rows = np.vstack([one, back, skip, order, ends])
        lower = np.concatenate([np.ones(n), np.full(len(back), -np.inf), np.zeros(len(skip)), np.zeros(len(same)),
                                np.zeros(len(ends))])
        upper = np.concatenate([np.ones(n), np.zeros(len(back)), np.full(len(skip), np.inf),
                                np.full(len(same), np.inf), np.full(len(ends), np.inf)])
        return rows, lower, upper

    def memory_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Per device and peak moment, its bytes (in GB), and its limit."""
        spec = self.spec
        rows, limits = [], []
        for device in range(spec.stages):
            for moment in self.moments[device]:
                row = np.zeros(self.width)
                for j, (l, c, o) in enumerate(self.index):
                    if c % spec.stages == device:
                        layer = spec.layers[l]
                        row[j] = moment[c // spec.stages] * layer.options[o].activation + layer.static
                for (l, c), column in self.end_column.items():
                    if c % spec.stages == device:
                        row[column] = moment[c // spec.stages] * spec.layers[l].output
                if self.spaced:
                    row[self.columns + device] = GB           # w_d is in GB already
                rows.append(row / GB)
                limits.append(spec.memory[device] / GB)
        return np.array(rows), np.array(limits)

    def workspace_rows(self) -> np.ndarray:
        """w_d >= workspace(l, o) * (l runs with o on d), for the layers that have one."""
        spec = self.spec
        rows = []
        for device in range(self.spaced):
            for l, o in self.workspaces:
                row = np.zeros(self.width)
                for j, (jl, c, jo) in enumerate(self.index):
                    if jl == l and jo == o and c % spec.stages == device:
                        row[j] = spec.layers[l].options[o].workspace / GB
                row[self.columns + device] = -1
                rows.append(row)
        return np.array(rows).reshape(-1, self.width)

    def time_rows(self) -> np.ndarray:
        """Each device's time less z."""
        spec = self.spec
        rows = self._rows(spec.stages)
        for j, (l, c, o) in enumerate(self.index):
            rows[c % spec.stages, j] = spec.layers[l].time(o)
        rows[:, -1] = -1
        return rows

    def assignment(self, x: np.ndarray) -> Assignment:
        out: Assignment = [(0, 0)] * len(self.spec.layers)
        for j, (l, c, o) in enumerate(self.index):
            if x[j] > 0.5:
                out[l] = (c, o)
        return out

    def program(self, scaled: bool) -> tuple[list, list, list]:
        """Rows and their bounds: z is the slowest device's time, each device's time at most z and
        its memory within its limit; or (`scaled`) z is a factor, each device's memory within z
        times its limit."""
        layer, layer_lo, layer_hi = self.layer_rows()
        memory, limits = self.memory_rows()
        if scaled:
            memory[:, -1] = -limits
            rows, lower, upper = [layer, memory], [layer_lo, np.full(len(memory), -np.inf)], \
                [layer_hi, np.zeros(len(memory))]
        else:
            rows = [layer, memory, self.time_rows()]
            lower = [layer_lo, np.full(len(memory), -np.inf), np.full(self.spec.stages, -np.inf)]
            upper = [layer_hi, limits * (1 + TOLERANCE / 10), np.zeros(self.spec.stages)]
        space = self.workspace_rows()
        rows.append(space)
        lower.append(np.full(len(space), -np.inf))
        upper.append(np.zeros(len(space)))
        return rows, lower, upper

    def minimize(self, cost: np.ndarray, rows: list, lower: list, upper: list) -> np.ndarray | None:
        return _milp(cost, np.vstack(rows), np.concatenate(lower), np.concatenate(upper), self.integral())


def _milp(cost, matrix, lower, upper, integral: np.ndarray) -> np.ndarray | None:
    """Minimize cost @ v over v in [0, 1] where integral (binary), else >= 0, subject to the rows."""
    from scipy.optimize import Bounds, LinearConstraint, milp    # imported when planning

    bounds = Bounds(np.zeros(len(cost)), np.where(integral > 0, 1.0, np.inf))
    result = milp(cost, constraints=[LinearConstraint(matrix, lower, upper)], integrality=integral, bounds=bounds,
                  options={"mip_rel_gap": MIP_GAP})
    return result.x if result.status == 0 and result.x is not None else None


def solve(spec: PipelineSpec) -> PipelinePlan:
    """The partition and options with the fastest slowest device that fit every limit;
    InfeasibleError (with the smallest memory that fits) when none does."""
    p = _Program(spec)
    rows, lower, upper = p.program(scaled=False)
    cost = np.zeros(p.width)
    cost[-1] = 1
    x = p.minimize(cost, rows, lower, upper)
    if x is None:
        raise InfeasibleError(spec, smallest_scale(p))
    slowest = x[-1]
    # Second solve: the slowest device held, the least extra time in total.
    cost = np.zeros(p.width)
    for j, (l, _, o) in enumerate(p.index):
        cost[j] = spec.layers[l].options[o].extra
    held = np.zeros((1, p.width))
    held[0, -1] = 1
    second = p.minimize(cost, rows + [held], lower + [np.array([-np.inf])],
                        upper + [np.array([slowest + 1e-7 * max(1.0, abs(slowest))])])
    return evaluate(spec, p.assignment(second if second is not None else x))


def smallest_scale(p: _Program) -> float:
    """The least factor s for which every device's memory fits s times its limit."""
    cost = np.zeros(p.width)
    cost[-1] = 1
    x = p.minimize(cost, *p.program(scaled=True))
    if x is None:           # cannot happen with every layer placeable; say so rather than guess
        raise RematError(f"{p.spec.source}: the solver found no partition at any memory")
    return float(x[-1])


def cheapest_saving(layers: list[Layer], ratio: float) -> list[int]:
    """Each layer's option, for the least extra time that takes at least `ratio` of what the
    layers' options can save off their held bytes (a uniform baseline's stage)."""
    if ratio <= 0 or not layers:
        return [0] * len(layers)
    index = [(l, o) for l, layer in enumerate(layers) for o in range(len(layer.options))]
    most = sum(layer.options[0].activation - min(o.activation for o in layer.options) for layer in layers)
    if most <= 0:
        return [0] * len(layers)
    one = np.zeros((len(layers), len(index)))
    saving = np.zeros((1, len(index)))
    cost = np.zeros(len(index))
    for j, (l, o) in enumerate(index):
        option = layers[l].options[o]
        one[l, j] = 1
        saving[0, j] = (layers[l].options[0].activation - option.activation) / most
        cost[j] = option.extra + 1e-9 * o          # ties go to the earlier option
    x = _milp(cost, np.vstack([one, saving]), np.concatenate([np.ones(len(layers)), [ratio - 1e-9]]),
              np.concatenate([np.ones(len(layers)), [np.inf]]), np.ones(len(index)))
    chosen = [0] * len(layers)
    for j, (l, o) in enumerate(index):
        if x is not None and x[j] > 0.5:
            chosen[l] = o
    return chosen

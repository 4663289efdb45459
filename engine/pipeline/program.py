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
    """The program's variables and rows for one spec."""

    def __init__(self, spec: PipelineSpec):
        if not spec.layers:
            raise ConfigError(f"{spec.source}: the layers' figures are not known yet (measure the model first)")
        self.spec = spec
        n, k = len(spec.layers), spec.chunks
        self.index: list[tuple[int, int, int]] = []      # (layer, virtual stage, option) per column
        for l, layer in enumerate(spec.layers):
            for c in range(max(0, l - (n - k)), min(l, k - 1) + 1):
                for o in range(len(layer.options)):
                    self.index.append((l, c, o))
        self.columns = len(self.index)
        self.moments = in_flight(spec)
        self.workspaces = sorted({(l, o) for l, _, o in self.index if spec.layers[l].options[o].workspace > 0})
        self.spaced = bool(self.workspaces)

    def layer_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each layer in one place, and the stages contiguous. With z(l, c) = 1 where layer l runs
        in virtual stage c or an earlier one: z(l + 1, c) <= z(l, c) (no layer goes back) and
        z(l + 1, c + 1) >= z(l, c) (none skips a stage). Written on the cumulative z the rows are
        those of a network, whose relaxation is far tighter than one row per neighbouring pair on
        the stage index (2.6 s -> 1.2 s on seed 004's spec with two options)."""
        n, k = len(self.spec.layers), self.spec.chunks
        one = np.zeros((n, self.columns))
        back = np.zeros(((n - 1) * k, self.columns))
        skip = np.zeros(((n - 1) * (k - 1), self.columns))
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
        order = np.zeros((len(same), self.columns))
        for i, l in enumerate(same):
            spread = len(self.spec.layers[l].options) - 1
            for j, (jl, c, o) in enumerate(self.index):
                if jl == l:
                    order[i, j] += o - spread * c
                elif jl == l + 1:
                    order[i, j] += -o + spread * c
        rows = np.vstack([one, back, skip, order])
        lower = np.concatenate([np.ones(n), np.full(len(back), -np.inf), np.zeros(len(skip)), np.zeros(len(same))])
        upper = np.concatenate([np.ones(n), np.zeros(len(back)), np.full(len(skip), np.inf),
                                np.full(len(same), np.inf)])
        return rows, lower, upper

    def memory_rows(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Per device and moment: bytes on the x columns, 1 on the device's workspace column (if
        any), and the device of each row."""
        spec = self.spec
        rows, devices = [], []
        for device in range(spec.stages):
            for moment in self.moments[device]:
                row = np.zeros(self.columns + (spec.stages if self.spaced else 0))
                for j, (l, c, o) in enumerate(self.index):
                    if c % spec.stages == device:
                        layer = spec.layers[l]
                        row[j] = moment[c // spec.stages] * layer.options[o].activation + layer.static
                if self.spaced:
                    row[self.columns + device] = GB           # w_d is in GB, as the rows
                rows.append(row)
                devices.append(device)
        matrix = np.array(rows) / GB                      # GB keeps the coefficients near 1
        return matrix, np.array([spec.memory[d] / GB for d in devices]), devices

    def workspace_rows(self) -> np.ndarray:
        """w_d >= workspace(l, o) * (l runs with o on d), for the layers that have one."""
        spec = self.spec
        rows = []
        for device in range(spec.stages):
            for l, o in self.workspaces:
                row = np.zeros(self.columns + spec.stages)
                for j, (jl, c, jo) in enumerate(self.index):
                    if jl == l and jo == o and c % spec.stages == device:
                        row[j] = spec.layers[l].options[o].workspace / GB
                row[self.columns + device] = -1
                rows.append(row)
        return np.array(rows)

    def time_rows(self) -> np.ndarray:
        spec = self.spec
        rows = np.zeros((spec.stages, self.columns))
        for j, (l, c, o) in enumerate(self.index):
            rows[c % spec.stages, j] = spec.layers[l].time(o)
        return rows

    def assignment(self, x: np.ndarray) -> Assignment:
        out: Assignment = [(0, 0)] * len(self.spec.layers)
        for j, (l, c, o) in enumerate(self.index):
            if x[j] > 0.5:
                out[l] = (c, o)
        return out


def _milp(cost, rows, lower, upper, integral: int, extra: int):
    """Minimize cost @ v over v = (x binary, `extra` continuous >= 0) subject to the rows."""
    from scipy.optimize import Bounds, LinearConstraint, milp    # imported when planning

    total = integral + extra
    matrix = np.vstack([np.pad(r, ((0, 0), (0, total - r.shape[1]))) for r in rows])
    integrality = np.concatenate([np.ones(integral), np.zeros(extra)])
    bounds = Bounds(np.zeros(total), np.concatenate([np.ones(integral), np.full(extra, np.inf)]))
    result = milp(cost, constraints=[LinearConstraint(matrix, np.concatenate(lower), np.concatenate(upper))],
                  integrality=integrality, bounds=bounds, options={"mip_rel_gap": MIP_GAP})
    return result.x if result.status == 0 and result.x is not None else None


def _program(p: _Program, scaled: bool) -> tuple[list, list, list, int]:
    """Rows, their bounds and the width over columns (x, the workspaces w_d if any, z), z last:
    the slowest device's time T, each device's time at most T and its memory within its limit;
    or (`scaled`) the factor s, each device's memory within s times its limit."""
    spec = p.spec
    spaced = spec.stages if p.spaced else 0
    width = p.columns + spaced + 1
    layer, layer_lo, layer_hi = p.layer_rows()
    memory, limits, _ = p.memory_rows()
    if scaled:
        memory = np.hstack([memory, np.zeros((len(memory), width - memory.shape[1] - 1)), -limits[:, None]])
        rows, lower, upper = [layer, memory], [layer_lo, np.full(len(memory), -np.inf)], \
            [layer_hi, np.zeros(len(memory))]
    else:
        times = np.hstack([p.time_rows(), np.zeros((spec.stages, spaced)), -np.ones((spec.stages, 1))])
        rows = [layer, memory, times]
        lower = [layer_lo, np.full(len(memory), -np.inf), np.full(spec.stages, -np.inf)]
        upper = [layer_hi, limits * (1 + TOLERANCE / 10), np.zeros(spec.stages)]
    if spaced:
        space = p.workspace_rows()
        rows.append(space)
        lower.append(np.full(len(space), -np.inf))
        upper.append(np.zeros(len(space)))
    return rows, lower, upper, width


def solve(spec: PipelineSpec) -> PipelinePlan:
    """The partition and options with the fastest slowest device that fit every limit;
    InfeasibleError (with the smallest memory that fits) when none does."""
    p = _Program(spec)
    rows, lower, upper, width = _program(p, scaled=False)
    cost = np.zeros(width)
    cost[-1] = 1
    x = _milp(cost, rows, lower, upper, p.columns, width - p.columns)
    if x is None:
        raise InfeasibleError(spec, smallest_scale(p))
    slowest = x[-1]
    # Second solve: the slowest device held, the least extra time in total.
    cost = np.zeros(width)
    for j, (l, _, o) in enumerate(p.index):
        cost[j] = spec.layers[l].options[o].extra
    held = np.zeros((1, width))
    held[0, -1] = 1
    second = _milp(cost, rows + [held], lower + [np.array([-np.inf])],
                   upper + [np.array([slowest + 1e-7 * max(1.0, abs(slowest))])], p.columns, width - p.columns)
    return evaluate(spec, p.assignment(second if second is not None else x))


def smallest_scale(p: _Program) -> float:
    """The least factor s for which every device's memory fits s times its limit."""
    rows, lower, upper, width = _program(p, scaled=True)
    cost = np.zeros(width)
    cost[-1] = 1
    x = _milp(cost, rows, lower, upper, p.columns, width - p.columns)
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
    x = _milp(cost, [one, saving], [np.ones(len(layers)), np.array([ratio - 1e-9])],
              [np.ones(len(layers)), np.array([np.inf])], len(index), 0)
    chosen = [0] * len(layers)
    for j, (l, o) in enumerate(index):
        if x is not None and x[j] > 0.5:
            chosen[l] = o
    return chosen

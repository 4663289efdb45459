"""A pipeline plan: which layers each stage runs, with which option, and what that costs.

`evaluate` turns an assignment (each layer's virtual stage and option) into per-device memory
and time by the spec's figures; the solver (engine.pipeline.program) and the uniform baselines
(`uniform`) both go through it, so a plan's figures never depend on how it was found.

A device's memory at one of its peak moments is its layers' weights and optimizer state, plus,
for each of its virtual stages, the micro-batches in flight times the bytes its layers hold per
micro-batch (and the output of its last layer, which the stage keeps for the backward), plus the
largest workspace of one of its layers (one runs at a time). Its time per
micro-batch is its layers' forward, backward and extra time. The slowest device sets the pace.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .schedule import Moment, in_flight
from .spec import GB, PipelineSpec

TOLERANCE = 1e-9     # relative, for memory against a limit


@dataclass(frozen=True)
class StagePlan:
    device: int
    chunks: tuple[tuple[int, ...], ...]      # layer indices of each of its virtual stages
    options: dict[int, str]                  # layer index -> option name
    in_flight: Moment                        # micro-batches held per virtual stage, at its peak
    static: float                            # bytes: weights and optimizer state
    activation: float                        # bytes at its peak moment, workspace included
    limit: float
    time: float

    @property
    def layers(self) -> list[int]:
        return [layer for chunk in self.chunks for layer in chunk]

    @property
    def memory(self) -> float:
        return self.static + self.activation

    @property
    def fits(self) -> bool:
        return self.memory <= self.limit * (1 + TOLERANCE)

    def option_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[self.options[layer]] = counts.get(self.options[layer], 0) + 1
        return counts


@dataclass(frozen=True)
class PipelinePlan:
    spec: PipelineSpec
    stages: tuple[StagePlan, ...]
    unchecked_time: float              # the slowest stage of the evenly split, unchecked partition
    label: str = "planned"

    @property
    def time(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def slowdown(self) -> float:
        return self.time / self.unchecked_time if self.unchecked_time > 0 else 1.0

    @property
    def step_time(self) -> float:
        """The schedule's whole step, bubbles included, at the slowest device's pace: M + P - 1
        slots (GPipe, 1F1B), M + (P - 1) / v with interleaving (Megatron-LM's bubble)."""
        spec = self.spec
        return self.time * (spec.microbatches + (spec.stages - 1) / spec.virtual_stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def assignment(self) -> "Assignment":
        """Each layer's virtual stage and option index, as `evaluate` takes them."""
        out: Assignment = [(0, 0)] * len(self.spec.layers)
        for s in self.stages:
            for local, chunk in enumerate(s.chunks):
                for layer in chunk:
                    names = [o.name for o in self.spec.layers[layer].options]
                    out[layer] = (s.device + local * self.spec.stages, names.index(s.options[layer]))
        return out

    def unchecked(self) -> "PipelinePlan":
        """The same partition with every layer run as is."""
        return evaluate(self.spec, [(c, 0) for c, _ in self.assignment()], self.unchecked_time, "unchecked")

    def boundaries(self) -> list[int]:
        """The first layer of each virtual stage, in model order."""
        chunks = sorted((chunk for s in self.stages for chunk in s.chunks), key=lambda c: c[0])
        return [c[0] for c in chunks]

    def to_json(self) -> dict:
        return {"label": self.label, "schedule": self.spec.schedule, "microbatches": self.spec.microbatches,
                "virtual_stages": self.spec.virtual_stages, "slowdown": self.slowdown, "time": self.time,
                "unchecked_time": self.unchecked_time, "step_time": self.step_time, "fits": self.fits,
                "time_unit": self.spec.time_unit, "memory_unit": "GB",
                "stages": [{"stage": s.device, "layers": s.layers, "chunks": [list(c) for c in s.chunks],
                            "options": [s.options[layer] for layer in s.layers],
                            "option_counts": s.option_counts(), "in_flight": list(s.in_flight),
                            "memory": s.memory / GB, "static": s.static / GB, "activation": s.activation / GB,
                            "limit": s.limit / GB, "time": s.time}
                           for s in self.stages]}


Assignment = list[tuple[int, int]]      # per layer: (virtual stage, option index)


def evaluate(spec: PipelineSpec, assignment: Assignment, unchecked_time: float | None = None,
             label: str = "planned") -> PipelinePlan:
    """The plan `assignment` makes; its slowdown against `unchecked_time` (by default the evenly
    split, unchecked partition's slowest stage)."""
    if unchecked_time is None:
        unchecked_time = max(s.time for s in _stages(spec, even_split(spec)))
    return PipelinePlan(spec, _stages(spec, assignment), unchecked_time, label)


def _stages(spec: PipelineSpec, assignment: Assignment) -> tuple[StagePlan, ...]:
    moments = in_flight(spec)
    stages = []
    for device in range(spec.stages):
        local = range(device, spec.chunks, spec.stages)          # its virtual stages
        chunks = tuple(tuple(l for l, (c, _) in enumerate(assignment) if c == chunk) for chunk in local)
        mine = [(l, o) for l, (c, o) in enumerate(assignment) if c % spec.stages == device]
        # Per micro-batch in flight: its layers' held bytes, and the output of its last layer.
        held = [sum(spec.layers[l].options[assignment[l][1]].activation for l in chunk)
                + spec.layers[chunk[-1]].output for chunk in chunks]
        peak, moment = max((sum(n * h for n, h in zip(m, held)), m) for m in moments[device])
        workspace = max((spec.layers[l].options[o].workspace for l, o in mine), default=0.0)
        stages.append(StagePlan(device, chunks, {l: spec.layers[l].options[o].name for l, o in mine}, moment,
                                sum(spec.layers[l].static for l, _ in mine), peak + workspace,
                                spec.memory[device], sum(spec.layers[l].time(o) for l, o in mine)))
    return tuple(stages)


def even_split(spec: PipelineSpec, options: list[int] | None = None) -> Assignment:
    """Layers split into the virtual stages by count, as evenly as possible (the later ones take
    the one extra layer: they hold fewer micro-batches), each with option `options[l]` (0)."""
    n, k = len(spec.layers), spec.chunks
    base, extra = divmod(n, k)
    sizes = [base + (1 if c >= k - extra else 0) for c in range(k)]
    out: Assignment = []
    for chunk, size in enumerate(sizes):
        out += [(chunk, 0)] * size
    if options is not None:
        out = [(c, o) for (c, _), o in zip(out, options)]
    return out


def uniform(spec: PipelineSpec, ratio: float) -> PipelinePlan:
    """ColossalAI's gradient-checkpointing ratio applied per stage, on the even split (seed 004's
    baseline): each virtual stage takes `ratio` of what its layers' options can save off their
    held bytes, the cheapest way (ratio 1: every layer at its lowest; 0: none)."""
    from .program import cheapest_saving

    if not 0 <= ratio <= 1:
        raise ConfigError(f"ratio {ratio}: the fraction of the layers' activations to recompute is in [0, 1]")
    split = even_split(spec)
    options = [0] * len(spec.layers)
    for chunk in range(spec.chunks):
        members = [l for l, (c, _) in enumerate(split) if c == chunk]
        for l, o in zip(members, cheapest_saving([spec.layers[l] for l in members], ratio)):
            options[l] = o
    return evaluate(spec, even_split(spec, options), label=f"uniform ratio {ratio:g}")

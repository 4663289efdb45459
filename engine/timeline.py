"""Memory over one training step, as curves a picture draws (backends/plots.py).

A curve is live bytes at each step of a run order: from a simulation (`engine.analysis
.simulate_peak` walks a backend's order and gives `PeakEstimate.curve`; `MemoryCurve.from_estimate`
keeps its nodes' names and the plan each was made for) or from a measurement (a backend samples
its process while the step runs and places the samples on the nodes it ran). A panel is the
curves of one graph; a timeline compares panels (the original and the rewritten graph).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .analysis import PeakEstimate


@dataclass
class MemoryCurve:
    """Bytes in use at each step of a run, the step's node and the plan that made the node."""

    label: str
    steps: list[str]
    live: list[int]
    plans: list[str | None]
    measured: bool = False

    @property
    def peak(self) -> int:
        return max(self.live, default=0)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.live)), key=self.live.__getitem__) if self.live else 0

    @classmethod
    def from_estimate(cls, estimate: PeakEstimate, label: str) -> "MemoryCurve":
        return cls(label, [n.name for n in estimate.order], list(estimate.curve), [n.plan for n in estimate.order])

    def coloured(self, plan_of: Mapping[str, str]) -> "MemoryCurve":
        """The same curve, each step's plan read from `plan_of` (by node name) where it has none."""
        return MemoryCurve(self.label, self.steps, self.live,
                           [p or plan_of.get(s) for s, p in zip(self.steps, self.plans)],
                           self.measured)


@dataclass
class Panel:
    """The curves of one graph; `measured_peak`: the peak the measurement read (VmHWM), which a
    sampled curve may fall short of between samples."""

    title: str
    curves: list[MemoryCurve] = field(default_factory=list)
    measured_peak: int | None = None

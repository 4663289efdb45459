"""Plan types, numbered as ONNX Runtime's memory optimizer numbers them in plan strings."""
from __future__ import annotations

from enum import IntEnum


class PlanType(IntEnum):
    RECOMPUTE = 1                     # drop a stashed value, recompute it in backward
    RECOMPUTE_WITH_COMPROMISE = 2     # ... from a new, smaller stash
    CHUNK = 3                         # run a memory-amplifying region slice by slice

    @property
    def label(self) -> str:
        """The name the plan table prints: `Recompute`, `RecomputeWithCompromise`, `Chunk`."""
        return {1: "Recompute", 2: "RecomputeWithCompromise", 3: "Chunk"}[self.value]


RECOMPUTE_TYPES = frozenset({PlanType.RECOMPUTE, PlanType.RECOMPUTE_WITH_COMPROMISE})
ON_BY_DEFAULT = frozenset({PlanType.RECOMPUTE, PlanType.CHUNK})   # applied when no config is given

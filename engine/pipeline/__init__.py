"""Pipeline parallelism (seed 004): each stage's layers and each layer's option, solved together.

In a 1F1B pipeline the first stage holds as many micro-batches in flight as there are stages and
the last holds one, so one checkpointing setting for every stage either runs out of memory on the
first or wastes the last. Given a spec (engine.pipeline.spec: stages, micro-batches, schedule,
memory per device, each layer's figures and options), `plan` finds the contiguous partition and
the option per layer that fit every device and make the slowest stage fastest (a MILP, HiGHS);
`uniform` is the baseline it is compared with, a checkpointing ratio applied per stage.

- `spec`: the JSON spec, parsed and checked;
- `schedule`: micro-batches in flight per device, from the schedule;
- `plan`: a plan's figures per stage (`evaluate`), the even split, the uniform baselines;
- `program`: the program, and the smallest memory that works when none fits;
- `report`: the table.
"""
from __future__ import annotations

from pathlib import Path

from .plan import PipelinePlan, StagePlan, evaluate, even_split, uniform
from .report import describe, table
from .schedule import in_flight
from .program import InfeasibleError, solve
from .spec import GB, SCHEDULES, Layer, ModelSource, Option, PipelineSpec, load_spec, parse_spec

__all__ = ["GB", "InfeasibleError", "Layer", "ModelSource", "Option", "PipelinePlan", "PipelineSpec", "SCHEDULES",
           "StagePlan", "describe", "evaluate", "even_split", "in_flight", "load_spec", "parse_spec", "plan",
           "table", "uniform"]


def plan(spec: PipelineSpec | dict | str | Path) -> PipelinePlan:
    """The planned partition of `spec` (a PipelineSpec, a parsed JSON object or a JSON file's
    path) whose layers' figures are given. A spec naming a model is measured first by
    backends.pipeline.plan_pipeline."""
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif isinstance(spec, dict):
        spec = parse_spec(spec)
    return solve(spec)

"""Pipeline parallelism on torch (seed 004): the planner's partition and per-stage plans, run.

- `measure`: a spec's layer figures measured from the model it names (the GPT-like model);
- `stages`: the GPT-like model cut at the planned boundaries;
- `run`: one step on torch.distributed.pipelining, each stage compiled with `backend="remat"`
  and its own budget, each rank's peak measured beside the plan's estimate.

    from backends.pipeline import plan_pipeline, pipeline_run
    plan = plan_pipeline("spec.json")          # figures given, or measured from "model"
    run = pipeline_run(plan)                   # what each rank runs: boundaries, budgets
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from engine.pipeline import PipelinePlan, PipelineSpec, load_spec, parse_spec, solve


def plan_pipeline(spec: PipelineSpec | dict | str | Path) -> PipelinePlan:
    """engine.pipeline.plan, with a spec's `model` measured first."""
    from .measure import measured_spec

    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif isinstance(spec, dict):
        spec = parse_spec(spec)
    return solve(measured_spec(spec))


def pipeline_run(plan: PipelinePlan, mode: str = "remat", **overrides):
    """The PipelineRun that runs `plan` on one rank per stage: its boundaries; with remat, each
    stage's own plan, its layers' options as one config (the plans they apply, counted over the
    stage: its layers are alike, and the options of a stage come first-layer-first, as a config's
    first N occurrences do); the plan's estimates and limits to print beside the peaks."""
    from .measure import gpt_config
    from .run import PipelineRun

    spec = plan.spec
    if spec.model is None:
        raise ValueError("a run needs the spec's model (figures alone name nothing to run)")
    if spec.virtual_stages != 1:
        raise ValueError("runs take one stage per rank (gpipe or 1f1b), not interleaved-1f1b")
    limits = set(spec.memory)
    fields = dict(model=asdict(gpt_config(spec.model, spec.source)), microbatches=spec.microbatches,
                  boundaries=tuple(plan.boundaries()), schedule=spec.schedule, mode=mode, tiers=spec.model.tiers,
                  configs=_configs(plan) if mode == "remat" else (),
                  estimates=tuple(s.activation for s in plan.stages), statics=tuple(s.static for s in plan.stages),
                  limit=limits.pop() if len(limits) == 1 else None)
    fields.update(overrides)
    return PipelineRun(**fields)


def _configs(plan: PipelinePlan) -> tuple[str, ...]:
    """Each stage's plans as a config string (`KEY:TYPE:COUNT,...`); empty for none."""
    out = []
    for stage in plan.stages:
        counts: dict[tuple[str, int], int] = {}
        for layer in stage.layers:
            option = next(o for o in plan.spec.layers[layer].options if o.name == stage.options[layer])
            for key, kind, n in option.plans:
                counts[key, kind] = counts.get((key, kind), 0) + n
        out.append(",".join(f"{key}:{kind}:{n}" for (key, kind), n in sorted(counts.items())))
    return tuple(out)

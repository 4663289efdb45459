"""A pipeline plan as a table, one row per stage (device)."""
from __future__ import annotations

from .plan import PipelinePlan
from .spec import GB


def _layers(chunks: tuple[tuple[int, ...], ...]) -> str:
    return " + ".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else f"{c[0]}" for c in chunks)


def _memory(value: float, scale: float) -> str:
    return f"{value / scale:.2f}" if scale == GB else f"{value / scale:.1f}"


def table(plan: PipelinePlan) -> str:
    spec = plan.spec
    scale, unit = (GB, "GB") if max(spec.memory) >= GB else (2**20, "MiB")
    header = (f"{'stage':>5}  {'layers':<14} {'count':>5}  {'options':<28} {'in flight':>9}  "
              f"{'memory ' + unit:>12} {'limit':>8}  {'time':>9}")
    rows = [header]
    for s in plan.stages:
        counts = ", ".join(f"{name} {n}" for name, n in sorted(s.option_counts().items(),
                                                                key=lambda kv: (kv[0] != "none", kv[0])))
        flight = "+".join(str(n) for n in s.in_flight)
        mark = "" if s.fits else "  over"
        rows.append(f"{s.device:>5}  {_layers(s.chunks):<14} {len(s.layers):>5}  {counts:<28} {flight:>9}  "
                    f"{_memory(s.memory, scale):>12} {_memory(s.limit, scale):>8}  {_time(s.time, spec):>9}{mark}")
    return "\n".join(rows)


def _time(value: float, spec) -> str:
    return f"{value * 1e3:.2f} ms" if spec.time_unit == "s" else f"{value:g}"


def describe(plan: PipelinePlan) -> str:
    """The plan's one-line summary: its slowest stage against the even, unchecked split's."""
    spec = plan.spec
    fits = "every stage within its limit" if plan.fits else \
        "over the limit on stage " + ", ".join(str(s.device) for s in plan.stages if not s.fits)
    return (f"{plan.label}: slowest stage {_time(plan.time, spec)} per micro-batch, {plan.slowdown:.3f}x the "
            f"evenly split, unchecked partition's {_time(plan.unchecked_time, spec)}; {fits} "
            f"({spec.schedule}, {spec.stages} stages, {spec.microbatches} micro-batches)")

"""`remat measure MODEL --compare REWRITTEN --timeline out.png`: memory over the step, before and after.

For each model, two curves over the nodes in the order they ran: simulated (ONNX Runtime's
order, rewrites and allocator as backends/onnx/ort_order.py models them, the curve of
`estimated_ort_peak`) and measured (runtime.measure_timeline: resident memory sampled in the
measuring process, placed on the nodes by ONNX Runtime's profile). The rewritten model's nodes
carry the plan that made them (the exporter writes it as node metadata), so the picture shades
where each plan runs, and, in the original, the nodes it recomputes or runs slice by slice.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from engine.timeline import MemoryCurve, Panel

from .importer import PLAN_KEY, RECOMPUTE_OF_KEY, REPLACES_KEY

SIMULATED = "simulated: ONNX Runtime's order and allocator, as remat models them"


def replaced_by_plan(model: str | Path | onnx.ModelProto) -> dict[str, str]:
    """Original node name -> the plan of the rewritten model that recomputes it (a clone's
    `remat.recompute_of`) or runs it slice by slice (a chunk Loop's `remat.replaces`)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    out: dict[str, str] = {}
    for node in proto.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        plan = props.get(PLAN_KEY)
        if plan is None:
            continue
        if RECOMPUTE_OF_KEY in props:
            out.setdefault(props[RECOMPUTE_OF_KEY], plan)
        for name in props.get(REPLACES_KEY, "").split(","):
            if name:
                out.setdefault(name, plan)
    return out


def panel(model: str | Path, feeds: dict[str, np.ndarray], threads: int = 1, measured: bool = True,
          replaced: dict[str, str] | None = None) -> Panel:
    """The simulated and (with `measured`) the measured curve of one model; `replaced` shades the
    nodes another model's plans replaced (see replaced_by_plan)."""
    from .ort_order import estimated_ort_peak
    from .runtime import measure_timeline

    curves = [MemoryCurve.from_estimate(estimated_ort_peak(model), SIMULATED)]
    peak = None
    if measured:
        curve, peak = measure_timeline(model, feeds, threads)
        curves.append(curve)
    if replaced:
        curves = [c.coloured(replaced) for c in curves]
    return Panel(str(model), curves, peak)


def timeline(model: str | Path, feeds: dict[str, np.ndarray], compare: str | Path | None = None,
             threads: int = 1) -> list[Panel]:
    """The original's panel (shaded where the compared model's plans replaced nodes) and, with
    `compare`, the rewritten model's."""
    replaced = replaced_by_plan(compare) if compare is not None else None
    panels = [panel(model, feeds, threads, replaced=replaced)]
    if compare is not None:
        panels.append(panel(compare, feeds, threads))
    return panels

"""engine.testing's ONNX runner: a generated training graph and its rewrite, in ONNX Runtime.

The rules are applied as `remat apply` applies them (backends.onnx.rewrite.apply_rules: chunk
regions built as Loops, then the recompute plans), and both graphs run in a default session
with one thread, so a recomputed value is bit-identical to the original and any difference is
the rewrite's. They are written with the leaves last, their peaks not estimated: only the numbers
are compared.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import numpy_helper

from engine.driver import plan_all
from engine.ir import Graph
from engine.patterns import RuleSet
from engine.testing.check import AppliedPlan, Run, Unrunnable
from engine.testing.graphs import TrainingGraph

from .exporter import export_model
from .rewrite import apply_rules
from .runtime import run as run_model


def _with_tensor_payloads(graph: Graph) -> Graph:
    """A copy whose constants hold ONNX tensors (engine.testing writes numpy arrays)."""
    copy = graph.copy()
    for sub in [copy] + [s for n in copy.nodes for s in n.subgraphs.values()]:
        for v in sub.initializers:
            if isinstance(v.data, np.ndarray):
                v.data = numpy_helper.from_array(v.data, v.name)
    return copy


def reference(tg: TrainingGraph) -> dict[str, np.ndarray]:
    """The step's outputs as given, no rules (engine.testing's second opinion runs the step
    widened to float64 here); raises where ONNX Runtime cannot run it."""
    return run_model(export_model(_with_tensor_payloads(tg.graph), estimate=False), tg.feeds)


def run(tg: TrainingGraph, rules: RuleSet, tiers: Sequence[str] = (), config: str | None = None) -> Run:
    """The original's outputs and those of its rewrite with `config` (by default every plan the
    rules offer, compromises included). Unrunnable when ONNX Runtime cannot run the original."""
    try:
        original = reference(tg)
    except Exception as exc:      # noqa: BLE001 - ONNX Runtime lacks a kernel: not the rules' fault
        raise Unrunnable(f"onnx: the original graph does not run: {exc}") from None
    if config is None:       # every plan the rules offer, compromises (type 2) included
        planning = plan_all(lambda fold: tg.graph, rules, tuple(tiers), strict=True)
        config = ",".join(p.config_string() for p in planning.plans) or None
    done = apply_rules(tg.graph, rules, config, tiers, strict=True)
    rewritten = run_model(export_model(_with_tensor_payloads(done.graph), estimate=False), tg.feeds)
    applied = []
    for result in (done.chunk_result, done.result):
        if result is None:
            continue
        for plan in result.plans:
            if plan.applied:
                regions = plan.occurrences[:plan.applied]
                applied.append(AppliedPlan(plan.config_string(), sorted({r.match.rule.name for r in regions}),
                                           [r.match.root.name for r in regions]))
    return Run("onnx", original, rewritten, applied, done.report())

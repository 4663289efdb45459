"""The torch backend: ATen joint graphs (forward + backward) in the shared IR.

`analyze(model, example_inputs)` traces one training step of `model` (which returns the
loss) and prints the same plan table as `remat analyze` prints for ONNX graphs; `choose(model,
example_inputs, budget, device=...)` prints what the planner would choose at a budget, for a
device that need not be this one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path


def backend(rules=None, config: str | None = None, tiers: Iterable[str] = (), report=None,
            strict: bool | None = None, budget=None, device=None, ratio: float | None = None,
            mode: str | None = None):
    """A configured torch.compile backend (see backends.fx.compile.backend). `strict` (default:
    the REMAT_STRICT environment variable): raise remat's internal errors instead of falling
    back. `budget`: the planner picks the fastest plans whose estimated peak fits it; `ratio`:
    a budget by layers. `mode`: torch.compile's Inductor mode (`max-autotune`, ...)."""
    from .compile import backend as make_backend

    return make_backend(rules, config, tiers, report, strict, budget, device, ratio, mode)


def joint_graphs(model, example_inputs: Sequence) -> list:
    """The joint graphs (forward + backward, one per graph break) that
    `torch.compile(model, backend="remat")` hands remat for one training step of
    `model(*example_inputs) -> loss`: AOTAutograd's, with Inductor's decompositions, as copies.
    What `analyze` plans on, so its plan table and config strings are the backend's."""
    from torch import fx

    from .timeline import on_joint_graphs

    def copy(joint):
        graph = fx.Graph()
        graph.output(graph.graph_copy(joint.graph, {}))
        return fx.GraphModule(joint, graph)

    return on_joint_graphs(model, tuple(example_inputs), copy)


def joint_graph(model, example_inputs: Sequence):
    """The one joint graph of `model`'s training step (see joint_graphs); an error for a model
    whose step torch.compile breaks into several graphs."""
    from engine.errors import RematError

    graphs = joint_graphs(model, example_inputs)
    if len(graphs) != 1:
        raise RematError(f"the training step compiles to {len(graphs)} graphs (graph breaks), not one; "
                         f"use joint_graphs()")
    return graphs[0]


def analyze(model, example_inputs: Sequence, rules: str | Path | Iterable | None = None,
            tiers: Iterable[str] = (), show: bool = True, timeline: str | Path | None = None,
            measure: bool = False):
    """The plans the rules offer on `model`'s training step; prints the table unless show=False.
    The step's joint graph is the one torch.compile hands the remat backend (joint_graph), so the
    table's config strings are the backend's. Chunk plans are found on the joint graph op by op
    (decompositions unfolded), the others on the folded graph, as the backend applies them. `timeline` (a .png, .svg or
    .pdf): draw memory over the step before and after remat's rewrite, as the peak model simulates
    it (backends/fx/timeline.py); with `measure`, also as torch's profiler measures the step
    compiled by Inductor (two compiles: slow on a large model)."""
    from dsl.loader import load_rules
    from engine.plans import select
    from engine.report import plan_table

    from .compile import plan_as_the_pass

    ruleset = load_rules(rules)
    path = None
    if timeline is not None:
        from backends.plots import pyplot

        path = Path(timeline)
        pyplot(path, f"timeline={str(timeline)!r}")
    joint = joint_graph(model, example_inputs)
    planning = plan_as_the_pass(joint.graph, ruleset, tiers)
    select(planning.plans, None)
    if show:
        print(plan_table(planning))
    if path is not None:
        from backends.plots import NODES_RUN, timeline_plot

        from .timeline import fx_timeline

        panels = fx_timeline(model, example_inputs, ruleset, tiers, measure=measure)
        label = NODES_RUN + ("; the profiler's line: its allocations and frees" if measure else "")
        timeline_plot(panels, path, "remat: memory over one training step (torch)", label)
    return planning


def choose(model, example_inputs: Sequence, budget, device=None, rules: str | Path | Iterable | None = None,
           tiers: Iterable[str] = (), show: bool = True) -> list:
    """What `backend(budget=budget, device=device)` would choose for one training step of `model`,
    without compiling it: the planner's choice for each joint graph (one per graph break), as the
    backend's report prints it, each a `engine.driver.Rewrite` (`.choice`: the plans and slice
    counts, estimated peak and extra time; `.simulated_peak`). `device` is a profile's name
    (`h100`, `h200`, `a100`, `cpu`; default: where the inputs are), so a step can be planned for a
    GPU on a machine without one; the step itself runs once eagerly here, on the inputs' device.
    A `free` budget is read from the device at each compile, and is refused here."""
    from dsl.loader import load_rules
    from engine.budget import parse_budget
    from engine.errors import ConfigError

    from backends.device import profile_for

    from .compile import FxBuilder, RematPass
    from .timeline import on_joint_graphs

    ruleset = load_rules(rules)
    if parse_budget(budget).free:
        raise ConfigError(f"budget {budget!r}: a free budget is what the device has free when the graph "
                          f"compiles; choose() compiles nothing: give bytes (6GiB) or a fraction (0.7)")
    # The backend's own planning (RematPass.plan), the device's profile resolved once.
    remat_pass = RematPass(ruleset, tiers=tiers, strict=True, budget=budget,
                           device=None if device is None else profile_for(device))
    done = on_joint_graphs(model, tuple(example_inputs),
                           lambda joint: remat_pass.plan(FxBuilder(joint.graph, ruleset.views, strict=True)))
    if show:
        for rewritten in done:
            print(rewritten.report())
    return done

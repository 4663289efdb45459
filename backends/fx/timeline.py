"""`backends.fx.analyze(model, inputs, timeline="out.png")`: memory over a torch step, before and after.

The joint graph is captured as torch.compile hands it to its backend (AOTAutograd with
Inductor's decompositions). Simulated: the torch path's peak model (backends/fx/peak.py: the min-cut
partitioner on a copy, the forward then the backward walked with
Inductor's fusion and buffer reuse) on the joint graph as given and on remat's rewrite of it, the
nodes each plan made or tagged shaded. Measured (`measure=True`): one step of `torch.compile(model)`
and of `torch.compile(model, backend=remat)`, compiled by Inductor, under torch's profiler; its
tensor allocations and frees give the bytes alive after each, in time order (it cannot place them
on the graph's nodes, which Inductor fused into kernels).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import fx

from engine.patterns import RuleSet
from engine.timeline import MemoryCurve, Panel

SIMULATED = "simulated: the partitioner's forward and backward, with Inductor's fusion and buffer reuse"
MEASURED = "measured: torch profiler's tensor bytes, after each allocation or free"


def on_joint_graphs(model: torch.nn.Module, example_inputs: Sequence, fn, fullgraph: bool = False) -> list:
    """`fn(joint)` on each joint graph torch.compile gives its backend for one training step of
    `model` (one per graph break; `fullgraph`: one, or torch's error), before partitioning and
    inside the compile (Inductor's passes that the peak model runs need its fake tensors); the
    step itself runs eagerly, the output's gradient ones. Returns what `fn` returned, graph by
    graph. A RematError `fn` raises comes out as itself, not wrapped in torch's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from engine.errors import RematError

    captured: list = []

    def partition(joint, joint_inputs, **kwargs):
        captured.append(fn(joint))
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)

    def eager(gm, _inputs):
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    try:
        out = torch.compile(model, backend=backend, fullgraph=fullgraph)(*example_inputs)
        out.backward(torch.ones_like(out))
    except Exception as err:
        inner = getattr(err, "inner_exception", None) or err.__cause__
        if isinstance(inner, RematError):      # a clear error of remat's, raised inside the compile
            raise inner from None
        raise
    finally:
        torch._dynamo.reset()
        for p in model.parameters():
            p.grad = None
    return captured


def simulated_panels(joint: fx.GraphModule, rules: RuleSet, tiers: Iterable[str] = (),
                     config: str | None = None) -> list[Panel]:
    """The peak model's curve of `joint` as torch.compile runs it, and of remat's rewrite of it."""
    from engine.driver import rewrite

    from .compile import FxBuilder
    from .peak import estimated_step

    before = MemoryCurve.from_estimate(estimated_step(joint.graph, joint), SIMULATED)
    builder = FxBuilder(joint.graph, rules.views, strict=True)
    rewrite(builder, rules, config, tuple(tiers), strict=True)
    after = MemoryCurve.from_estimate(builder.estimated(), SIMULATED)
    return [Panel("torch.compile(model)", [before.coloured(builder.replaced)]),
            Panel("torch.compile(model, backend=remat)", [after])]


def measured_curve(model: torch.nn.Module, example_inputs: Sequence, backend) -> MemoryCurve:
    """One step of `torch.compile(model, backend=backend)` under the profiler, after one to compile."""
    from .saved import tensor_bytes_over_time

    compiled = torch.compile(model, backend=backend) if backend is not None else torch.compile(model)

    def step():
        compiled(*example_inputs).backward()
        for p in model.parameters():
            p.grad = None

    torch._dynamo.reset()
    step()
    curve = tensor_bytes_over_time(step)
    torch._dynamo.reset()
    return MemoryCurve(MEASURED, [f"event {k}" for k in range(len(curve))], curve, [None] * len(curve), measured=True)


def fx_timeline(model: torch.nn.Module, example_inputs: Sequence, rules: RuleSet, tiers: Iterable[str] = (),
                config: str | None = None, measure: bool = False) -> list[Panel]:
    """Simulated panels (before, after) of the step's largest joint graph; with `measure`, each
    with the profiler's curve of the step compiled by Inductor, without and with remat."""
    every = on_joint_graphs(model, example_inputs,
                            lambda joint: (len(joint.graph.nodes), simulated_panels(joint, rules, tiers, config)))
    if not every:
        from engine.errors import RematError

        raise RematError("torch.compile made no training graph of the model (does it return the loss?)")
    panels = max(every, key=lambda sized: sized[0])[1]
    if measure:
        from . import backend as remat_backend

        panels[0].curves.append(measured_curve(model, example_inputs, None))
        panels[1].curves.append(measured_curve(model, example_inputs,
                                               remat_backend(rules, config, tiers, strict=True)))
    if len(every) > 1:
        for p in panels:
            p.title += f" (the largest of {len(every)} graphs)"
    return panels

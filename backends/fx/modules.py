"""GraphModules that remat builds only to hold a graph while it works on it."""
from __future__ import annotations

import torch
from torch import fx


def working_module(owner: torch.nn.Module | dict, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over `graph` whose Python code is generated only if it is ever called.
    remat copies the joint graph into a module to rewrite it (and again to simulate it), and
    never calls those modules: a plain GraphModule generates the code of a 16-layer joint graph
    (20,000 nodes) on every construction, about a second each. torch's lazy module (Dynamo and
    Inductor use it the same way) defers that; where a torch lacks it, a plain GraphModule."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:      # pragma: no cover - every torch remat supports (2.11+) has it
        return fx.GraphModule(owner, graph)
    return _LazyGraphModule(owner, graph)

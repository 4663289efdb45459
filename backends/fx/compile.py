"""`torch.compile(model, backend="remat")`: the rules decide, Inductor compiles.

The engine runs on the AOTAutograd joint graph through Inductor's
`joint_custom_pre_pass` hook: the graph is imported into the IR, the rules are applied,
and every fx node of every applied recompute region is tagged
`CheckpointPolicy.MUST_RECOMPUTE`, which the min-cut partitioner honours (it is the
machinery selective activation checkpointing uses). The pass's `uuid` hashes the rules'
content, the config and the tiers, so Inductor's caches never serve a graph compiled
with other rules.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from dsl.loader import load_rules
from engine.apply import Result, apply
from engine.patterns import RuleSet

from .importer import import_fx


class RematPass(CustomGraphPass):
    def __init__(self, rules: RuleSet, config: str | None = None, tiers: Iterable[str] = (),
                 report: Callable[[str], None] | None = None):
        self.rules = rules
        self.config = config
        self.tiers = tuple(tiers)
        self.report = report
        self.results: list[Result] = []

    def __call__(self, graph: fx.Graph) -> None:
        result = apply(import_fx(graph), self.rules, self.config, self.tiers)
        by_name = {n.name: n for n in graph.nodes}
        for region in result.applied:
            for node in region.nodes:
                for name in node.meta.get("fx_nodes", [node.name]):
                    by_name[name].meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        self.results.append(result)
        if self.report is not None:
            self.report(result.report())

    def uuid(self) -> str:
        key = f"remat-pass-1|{self.rules.digest}|{self.config}|{','.join(self.tiers)}"
        return hashlib.sha256(key.encode()).hexdigest()


def backend(rules: str | Path | Iterable | None = None, config: str | None = None,
            tiers: Iterable[str] = (), report: Callable[[str], None] | None = None):
    """A torch.compile backend: Inductor with the rules applied to the joint graph."""
    remat_pass = RematPass(load_rules(rules), config, tiers, report)

    def compile_with_remat(gm: fx.GraphModule, example_inputs):
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        with inductor_config.patch(joint_custom_pre_pass=remat_pass):
            return compile_fx(gm, example_inputs)

    compile_with_remat.remat_pass = remat_pass
    return compile_with_remat


def remat_backend(gm: fx.GraphModule, example_inputs):
    """The registered `remat` backend: the shipped rules, default tier."""
    return backend()(gm, example_inputs)

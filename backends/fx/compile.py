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

import functools
import hashlib
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from dsl.loader import load_rules
from engine.apply import Result, apply, plan
from engine.errors import GraphError
from engine.patterns import RuleSet
from engine.plans import parse_config, select

from .chunk import apply_chunk

from .importer import import_fx


MAX_CHUNK_SITES = 16


@functools.cache
def _code_digest() -> str:
    """A hash of remat's own source (engine, dsl, fx backend): a cached graph compiled by an
    older remat must not be served to a newer one."""
    root = Path(__file__).resolve().parent.parent.parent
    digest = hashlib.sha256()
    for package in ("engine", "dsl", "backends/fx"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".lark"):
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class RematPass(CustomGraphPass):
    def __init__(self, rules: RuleSet, config: str | None = None, tiers: Iterable[str] = (),
                 report: Callable[[str], None] | None = None):
        self.rules = rules
        self.config = config
        self.tiers = tuple(tiers)
        self.report = report
        self.results: list[Result] = []          # recompute and compromise, per joint graph
        self.chunk_results: list[Result] = []    # the chunk plans, per joint graph
        self.chunked = 0                         # chunk regions built
        self.chunk_failures: list[str] = []      # chunk regions planned but not buildable

    def __call__(self, graph: fx.Graph) -> None:
        owner = graph.owning_module
        if owner is not None and owner.meta.get("produced_by_chunker"):
            return      # a chunk's body: Inductor runs the joint passes on it too
        entries = parse_config(self.config) if self.config is not None else None
        chunk_entries = None if entries is None else [e for e in entries if e.type == 3]
        recompute_entries = None if entries is None else [e for e in entries if e.type != 3]
        chunk_rules = self.rules.of_types({3})
        checked = bool(recompute_entries) and bool(chunk_rules.rules)
        if checked:
            # Checked against the graph before chunking; the plans chunking consumes are then skipped.
            select(plan(import_fx(graph), self.rules.of_types({1, 2}), self.tiers).plans, recompute_entries)
        if chunk_rules.rules:
            self._chunk(graph, chunk_rules, chunk_entries)
        result = apply(import_fx(graph), self.rules.of_types({1, 2}), recompute_entries, self.tiers,
                       lenient=checked)
        by_name = {n.name: n for n in graph.nodes}
        for region in result.applied:
            for node in region.nodes:
                for name in node.meta.get("fx_nodes", [node.name]):
                    by_name[name].meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        self.results.append(result)
        if self.report is not None:
            self.report(result.report())

    def _chunk(self, graph: fx.Graph, rules: RuleSet, entries) -> None:
        """Build chunk regions one at a time, re-planning on the rewritten graph after each
        (a built region's nodes are gone, so it is not offered again)."""
        for k in range(MAX_CHUNK_SITES):
            result = apply(import_fx(graph, fold=False), rules, entries, self.tiers, lenient=k > 0)
            if k == 0:
                self.chunk_results.append(result)
                if self.report is not None:
                    self.report(result.report())
            if not result.chunks:
                return
            region = result.chunks[0]
            try:
                apply_chunk(graph, region, f"remat_chunk_{k}")
            except GraphError as err:
                # Nothing was rewired yet: the graph runs unchunked, and the user is told why.
                message = f"{region.match.rule.name} at {region.match.root.name} was not built: {err}"
                self.chunk_failures.append(message)
                warnings.warn(message, stacklevel=2)
                return
            self.chunked += 1
            if len(region.phases) > 1:
                # See compile_with_remat: read when AOTAutograd finishes partitioning this graph.
                import torch._functorch.config as functorch_config

                functorch_config.donated_buffer = False

    def uuid(self) -> str:
        key = f"remat-pass|{_code_digest()}|{self.rules.digest}|{self.config}|{','.join(self.tiers)}"
        return hashlib.sha256(key.encode()).hexdigest()


def backend(rules: str | Path | Iterable | None = None, config: str | None = None,
            tiers: Iterable[str] = (), report: Callable[[str], None] | None = None):
    """A torch.compile backend: Inductor with the rules applied to the joint graph."""
    remat_pass = RematPass(load_rules(rules), config, tiers, report)

    def compile_with_remat(gm: fx.GraphModule, example_inputs):
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # Donated buffers let the backward write into saved activations it has read for the
        # last time. A backward chunk phase reads slices of saved values (the queries) through
        # one invoke_subgraph call per slice, and Inductor (2.13) reuses the saved buffer after
        # the first call: the later slices then read garbage (measured: the QKV gradients off
        # by 100% on one attention head). So the pass turns them off for a graph where it
        # builds a two-phase region (AOTAutograd reads the flag after partitioning); the patch
        # puts the user's setting back afterwards. A one-phase region (the loss) keeps them: its
        # backward only scales the weight gradient, in place when the buffer is donated (measured:
        # 0.3-0.5 MiB off linear + cross-entropy's peak at 32 slices).
        with inductor_config.patch(joint_custom_pre_pass=remat_pass), \
                functorch_config.patch(donated_buffer=functorch_config.donated_buffer):
            return compile_fx(gm, example_inputs)

    compile_with_remat.remat_pass = remat_pass
    return compile_with_remat


def remat_backend(gm: fx.GraphModule, example_inputs):
    """The registered `remat` backend: the shipped rules, default tier."""
    return backend()(gm, example_inputs)

"""`torch.compile(model, backend="remat")`: the rules decide, Inductor compiles.

The engine runs on the AOTAutograd joint graph through Inductor's
`joint_custom_pre_pass` hook: `engine.rewrite` plans on the graph imported into the IR,
chunk regions are built as `invoke_subgraph` calls (backends.fx.chunk), and every fx node
of every applied recompute region is tagged `CheckpointPolicy.MUST_RECOMPUTE`, which the
min-cut partitioner honours (it is the machinery selective activation checkpointing uses).
Tagging fx nodes, rather than lowering the engine's rewritten IR, keeps the partitioner
in charge of where a recompute runs and what the backward saves: it sees the tags and the
whole joint graph, and the IR's clones would be merged back by its own CSE anyway. The
pass's `uuid` hashes the rules' content, the config and the tiers, so Inductor's caches
never serve a graph compiled with other rules.

With a budget, each compile is checked against Inductor's own account of the code it
generated (backends.fx.inductor_account): a graph whose code holds more than the budget is
planned again for less, up to twice (backends.fx.replan), so the budget is kept where remat's
simulation of Inductor is low.

Nothing remat does may kill the user's training step. The pass works on a copy of the
joint graph and writes it back only when the whole rewrite succeeded; an internal error at
one site drops that site (engine.failures) and a failure it cannot place compiles the graph
without remat, each with one warning. `strict=True` or `REMAT_STRICT=1` raises instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from dsl.loader import load_rules
from engine.analysis import analyze
from engine.apply import Result
from engine.collector import collector_paused
from engine.driver import ChunkCalls, Rewrite, rewrite
from engine.failures import PlanFailure, at_site, resolve_strict
from engine.ir import Graph
from engine.matcher import Reason, longer_examples
from engine.patterns import RuleSet
from engine.budget import BudgetError, Choice, DeviceProfile, parse_budget, parse_ratio
from engine.budget.spec import FREE_HEADROOM
from engine.errors import ConfigError
from engine.plans import parse_config
from engine.shapes import evaluate, format_bytes
from engine.strategies.chunk import ChunkRegion

from backends.device import profile_for

from .chunk import _propagate_fake, apply_chunk
from .free_memory import FreeMemoryUnknown, free_bytes, input_device, optimizer_reserve, trainable_bytes
from .importer import PLAN, _flat_nodes, dim_bounds, import_fx, size_sources
from .inductor_account import InductorAccount, inductor_account
from .modules import working_module
from .normalize import sizes_read_from_inputs, strided_copies_as_clones
from .replan import MAX_REPLANS, BudgetCuts, Planned, joint_digest
from .replay import build_replay


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


class FxBuilder:
    """engine.rewrite's view of a joint graph: each attempt works on a fresh copy in its own
    GraphModule, so a failed attempt leaves the user's graph as it was."""

    built_as = "invoke_subgraph calls"

    def __init__(self, graph: fx.Graph, views: frozenset[str] = frozenset(), strict: bool = False):
        self.graph = graph
        self.views = views
        self.strict = strict
        self.owner = graph.owning_module
        self.work: fx.GraphModule | None = None
        self.two_phase = False
        self.replaced: dict[str, str] = {}      # fx node name -> the plan that recomputes or slices it
        self.rebuilt = False
        self.normalized = 0                     # nodes `start` rewrote in the working copy
        self.calls = ChunkCalls()               # the invoke_subgraph calls of each chunk region


    def start(self) -> None:
        copy = fx.Graph()
        copy.output(copy.graph_copy(self.graph, {}))
        self.work = working_module(self.owner if self.owner is not None else {}, copy)
        # Rewritten nodes: the working copy is then no longer the user's graph with tags added.
        self.normalized = strided_copies_as_clones(self.work.graph) + sizes_read_from_inputs(self.work.graph)
        self.two_phase = False
        self.rebuilt = False        # nodes added other than chunk calls (a replay's)
        self.replaced = {}
        self.calls.clear()

    def current(self, fold: bool) -> Graph:
        from .peak import fused_away

        graph = import_fx(self.work.graph, fold=fold)
        fused = {n.name for n in fused_away(self.work.graph)}
        for value in graph.values():
            value.materialized = value.name not in fused
        return graph

    def build(self, result: Result, region: ChunkRegion, index: int) -> None:
        before = set(self.work.graph.nodes)
        apply_chunk(self.work.graph, region, f"remat_chunk_{index}")
        self.two_phase = self.two_phase or len(region.phases) > 1
        made = [node for node in self.work.graph.nodes if node not in before]
        for node in made:
            node.meta[PLAN] = region.key
        self.calls.record((n.name for n in made if n.target is torch.ops.higher_order.invoke_subgraph), region)
        self.replaced.update((name, region.key) for n in region.nodes for name in n.backend_nodes or [n.name])

    def finish(self, result: Result) -> None:
        """Tag every fx node of each applied region MUST_RECOMPUTE, except a random op's, which
        runs again as its replay: the template's ATen nodes, built once per op and tagged in
        its place (backends/fx/replay.py)."""
        by_name = {n.name: n for n in self.work.graph.nodes}
        built: set[str] = set()
        made: list[fx.Node] = []
        for region in result.applied:
            with at_site(region.match.site, "build", region.key):
                tagged = []
                for node in region.nodes:
                    if id(node) in region.replays:
                        if node.name not in built:
                            replay = build_replay(self.work.graph, region.replays[id(node)], by_name)
                            built.add(node.name)
                            made.extend(replay)
                            tagged.extend(replay)
                        continue
                    tagged.extend(by_name[name] for name in node.backend_nodes or [node.name])
                for fx_node in tagged:
                    fx_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    fx_node.meta[PLAN] = region.key
                    self.replaced[fx_node.name] = region.key
        if made:
            self.rebuilt = True
            _propagate_fake(self.work, set(made))

    def simulate(self, graph: Graph) -> int:
        """The step's peak as torch runs it: the partitioner's forward and backward, with
        Inductor's fusion and buffer reuse (backends.fx.peak). Where the partitioner cannot be
        run on the working copy, the joint graph's own walk in schedule order, views aliased."""
        from engine.analysis import simulate_peak

        try:
            estimate = self.estimated()
        except Exception:
            if self.strict:
                raise
            estimate = simulate_peak(graph, alias_ops=self.views)
        self.calls.observe(estimate)
        return estimate.peak_bytes or 0

    @property
    def donated(self) -> bool | None:
        """Whether the working graph's saved values go to its backward donated: False where a
        two-phase region was built (compile_with_remat says why the pass turns donation off
        then), else as torch is set (None)."""
        return False if self.two_phase else None

    def estimated(self):
        """backends.fx.peak's walk of the working graph's step (a PeakEstimate)."""
        from .peak import estimated_step

        return estimated_step(self.work.graph, self.work, donated=self.donated)

    def commit(self) -> None:
        """Write the working copy back into the user's graph (placeholders kept): the graph that
        was planned and simulated is the graph that compiles. Where only tags were added, they are
        copied onto the same-named nodes. Where `start` rewrote nodes (a strided copy as a clone),
        the tags alone would miss them: a region's clone tagged in the copy would leave its `copy`
        untagged in the user's graph, and the partitioner keep what the plan recomputes."""
        if not self.rebuilt and not self.normalized and not any(
                n.op == "get_attr" and n.target.startswith("remat_chunk_") for n in self.work.graph.nodes):
            # Only tags changed: copy them onto the same-named nodes, leaving the graph's nodes alone.
            tags = {n.name: n.meta["recompute"] for n in self.work.graph.nodes if "recompute" in n.meta}
            for node in self.graph.nodes:
                if node.name in tags:
                    node.meta["recompute"] = tags[node.name]
            return
        for node in self.work.graph.nodes:
            if node.op == "get_attr" and not hasattr(self.owner, node.target):
                setattr(self.owner, node.target, getattr(self.work, node.target))
        _replace_body(self.graph, self.work.graph)


def plan_as_the_pass(graph: fx.Graph, rules: RuleSet, tiers: Iterable[str] = (), strict: bool | None = None):
    """Every plan `rules` offer on the joint graph `graph`, found on the working copy the pass
    plans on (FxBuilder.start's: strided copies as clones, sizes read from the inputs), so that
    their config strings name the pass's plans. `graph` is left as it is."""
    from engine.driver import plan_all

    builder = FxBuilder(graph, rules.views, strict=True)
    builder.start()
    return plan_all(builder.current, rules, tuple(tiers), strict=strict)


def _replace_body(graph: fx.Graph, source: fx.Graph) -> None:
    """Make `graph` compute what `source` computes: its placeholders stay (AOTAutograd knows
    them), every other node is replaced by a copy of `source`'s."""
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    old_output = next(n for n in graph.nodes if n.op == "output")
    for node in reversed(list(graph.nodes)):
        if node.op != "placeholder":
            graph.erase_node(node)
    env = {n: placeholders[n.name] for n in source.nodes if n.op == "placeholder"}
    for node in source.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            out = graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
            out.meta = dict(old_output.meta)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])


# Dynamo makes a dim dynamic on its own when a second size reaches a compiled frame (its
# automatic dynamic shapes): a chunk region whose slices need static sizes (a slice that
# drops rows at the start of the chunked dim, or more than one at its end) is lost from the second batch on,
# which the user should hear of once, with the way out.
DYNAMIC_CHUNKS = ("remat: {rules} not applied: this graph's sizes are dynamic (dynamic=True, "
                  "mark_dynamic, or Dynamo's automatic dynamic shapes once a second input size "
                  "arrives), and {why}; the recompute plans still apply. To keep the chunk, compile "
                  "with dynamic=False and pad the inputs to a few lengths (a multiple of 256, say): each "
                  "length compiles once, up to torch._dynamo.config.recompile_limit lengths")

# Two sizes equal at every input the user gives, which Dynamo named apart (two inputs' dims it
# made dynamic one after the other, or the inputs of a graph after a break): torch._check in the
# forward makes them one symbol.
UNPROVEN_SIZES = ("remat: {rule} not applied: its slices need {a} and {b} equal, as they are at the "
                  "sizes it is planned at, but torch cannot prove it ({names}). Where they are always equal, say so in "
                  "the forward beside the loss (after any graph break), {check}, and the chunk is built")


def _unproven_notice(rule: str, sizes: tuple, sources: dict[str, str]) -> str:
    """UNPROVEN_SIZES for two size formulas, naming the symbols that tell them apart."""
    a, b = (sympy.sympify(size) for size in sizes)
    only_a = sorted(map(str, a.free_symbols - b.free_symbols))
    only_b = sorted(map(str, b.free_symbols - a.free_symbols))
    names = "; ".join(f"{sym} is {sources[sym]}" for sym in only_a + only_b if sym in sources) or \
        "Dynamo gave them symbols of their own"
    if len(only_a) == len(only_b) == 1 and only_a[0] in sources and only_b[0] in sources:
        check = f"torch._check({sources[only_a[0]]} == {sources[only_b[0]]})"
    else:
        check = "torch._check(one_size == the_other)"
    return UNPROVEN_SIZES.format(rule=rule, a=a, b=b, names=names, check=check)


# How the user gives the largest size: `torch._check` in the forward bounds the symbol's range,
# which the importer reads. `mark_dynamic(t, dim, min=, max=)` bounds it too, but as a constraint
# Dynamo checks every guard against after the backend returned: slices of `floor(size / count)`
# rows guard their own sizes, which the range cannot prove (ConstraintViolationError, GPT-2 at
# batch 2), so over such a size remat slices only where a count divides it (Graph.constrained_dims).
LARGEST = ("Give the largest size, and remat plans for it: torch._check({size} <= N) in the forward "
           "(mark_dynamic with min and max declares it as a constraint, which keeps a chunk over that size "
           "only where a count of slices divides it)")


def _size_name(dims, sources: dict[str, str]) -> str:
    """How the forward names the first of `dims` whose input Dynamo knows (LARGEST's `{size}`)."""
    return next((sources[d] for d in sorted(dims) if d in sources), "x.size(1)")


# A size given a range by mark_dynamic(min=, max=): Dynamo checks every guard against it after the
# backend returned, and a chunk's slices of it guard their own sizes, so the region is refused
# (Reason.constrained_dims) rather than the step raising ConstraintViolationError.
CONSTRAINED_SIZES = ("remat: {rules} not applied: {size} has a range declared as a constraint (mark_dynamic "
                     "with min or max), which Dynamo checks every guard against, and the chunk's slices of it "
                     "guard their own sizes. To keep the chunk, mark it dynamic without min and max, and give "
                     "the largest size with torch._check({size} <= N) in the forward: remat plans for it")


# A chunk rule whose every large value the graph returns: the loss is computed by the graph's
# caller (a compiled model whose loss is eager code after it, or a graph break before the loss),
# so the logits exist whole whatever remat does.
RETURNED_WHOLE = ("remat: {rules} not applied: the compiled graph returns {what} to its caller, which keeps it "
                  "whole: the loss is computed outside this graph (in code after the compiled module, or after "
                  "a graph break). Compute the loss inside what torch.compile compiles (a module or function "
                  "that returns the loss; TORCH_LOGS=graph_breaks names a break), and remat chunks it")


def _returned_notice(returned: dict[str, tuple[str, ...]], graph: Graph) -> str | None:
    """RETURNED_WHOLE for the rules refused over values the graph returns, the largest named by
    its type and size at the planned sizes; None where none of them is a forward output (the
    large value is a gradient the step returns, a parameter's: whole in any step, and nothing the
    user could move into the compiled code)."""
    analysis = analyze(graph, graph.forward_outputs)
    names = {name for found in returned.values() for name in found}
    values = [v for v in graph.values() if v.name in names and v.producer is not None
              and analysis.is_forward(v.producer)]
    if not values:
        return None
    largest = max(values, key=lambda v: evaluate(v.nbytes, graph.dim_examples) or 0)
    what = f"a {largest.type_str} tensor of {format_bytes(evaluate(largest.nbytes, graph.dim_examples))}"
    return RETURNED_WHOLE.format(rules=", ".join(sorted(returned)), what=what)


# A budget in bytes is about the device: the longest batch must fit. A dynamic graph is planned at
# the largest size its shape environment allows (backends.fx.importer._dim_examples), which only
# the user can give where Dynamo made the size dynamic by itself.
UNBOUNDED_BUDGET = ("remat: the budget of {budget} is planned at the sizes this dynamic graph was traced at "
                    "({sizes}); a longer batch needs more memory than planned. " + LARGEST)


# Without a budget every plan the rules match is applied, chunk regions at the rules' own slice
# sizes, which were sized on a CPU: on an H100 that ran 1.6-3.4x torch.compile's step, and a model
# of real size (512 MiB of scores a layer) made 2,048 slice calls, whose compile had not finished
# after 110 s. A budget lets the planner size the slices for the device.
UNBUDGETED_GPU = ("remat: {regions} chunk region(s) built as {calls} slice calls on {device}, at the rules' "
                  "own slice sizes: with no budget every plan the rules match is applied, and small slices "
                  "cost a GPU launches and compile time. Give a budget and remat chooses the fastest plans "
                  "that fit, slices sized for this device: torch.compile(model, backend=\"remat\", "
                  "options={{\"budget\": \"free\"}}) (what the device has free), or a fraction of the "
                  "peak (0.7), or bytes (\"20GiB\")")


# A chunk rule's size guard is decided at the sizes the graph was traced at where Dynamo knows no
# largest size: a dynamic graph traced short runs every longer input unchunked.
LONGER_INPUTS = ("remat: {rules} not applied: this dynamic graph is planned at the sizes it was traced "
                 "at ({sizes}), where {why}; it would apply from about {factor}x those sizes ({longer}), and "
                 "this graph runs them unchanged. " + LARGEST)


def _longer_notice(longer: dict[str, Reason], graph: Graph, sources: dict[str, str]) -> str:
    """LONGER_INPUTS for the rules refused at the traced sizes (Reason.longer_from), the open dims
    named by the inputs they size where Dynamo knows it."""
    first = min(longer.values(), key=lambda r: r.longer_from)

    def sizes(examples: dict[str, int]) -> str:
        return ", ".join(f"{sources.get(d, d)} = {n}" for d, n in sorted(examples.items()) if d in graph.open_dims)

    return LONGER_INPUTS.format(rules=", ".join(sorted(longer)), sizes=sizes(graph.dim_examples), why=first.message,
                                factor=f"{first.longer_from:g}", size=_size_name(graph.open_dims, sources),
                                longer=sizes(longer_examples(graph.dim_examples, graph.open_dims, first.longer_from)))


def _reporter(report) -> Callable[[str], None] | None:
    """`report` as given to backend(): a callable that takes each plan table, or True to print
    the tables (what `options={"report": True}` asks for), or None/False for none."""
    if report is None or report is False:
        return None
    if report is True:
        return print
    if not callable(report):
        raise ConfigError(f"report must be True (print each plan table) or a callable that takes it, "
                          f"not {report!r}")
    return report


class SamePlan(Exception):
    """A graph planned again (its code over the budget) came to the plans compiled already, those
    of the lowest peak: its compile is stopped, and the code compiled before is kept."""


class RematPass(CustomGraphPass):
    def __init__(self, rules: RuleSet, config: str | None = None, tiers: Iterable[str] = (),
                 report: Callable[[str], None] | bool | None = None, strict: bool | None = None,
                 budget=None, device=None):
        self.rules = rules
        self.config = config
        self.budget = None if budget is None else parse_budget(budget)
        # `free`: resolved into bytes at each compile (on_device), from what the device has free then
        self.free_budget = self.budget if self.budget is not None and self.budget.free else None
        self.free_resolved: list[str] = []       # each compile's resolution of the free budget, as reported
        # The trainable parameters every compile so far has taken (by identity): a model split by
        # graph breaks compiles its graphs one by one, and the optimizer's state is for them all.
        self.parameters: dict[int, int] = {}
        self.unreported: str | None = None      # the resolution of the graph compiling now, until it plans
        self.device = device                      # a DeviceProfile, or a name resolved per graph
        self.tiers = tuple(tiers)
        self.report = _reporter(report)
        self.strict = resolve_strict(strict)
        self.results: list[Result] = []          # recompute and compromise, per joint graph
        self.chunk_results: list[Result] = []    # the chunk plans, per joint graph
        self.choices: list[Choice] = []          # the planner's, per joint graph planned for a budget
        self.planned: list[Planned] = []         # the same, as the compile's account checks them
        self.cuts = BudgetCuts(self._config_key(self.budget))
        self.replans: list[str] = []             # each graph planned again, as reported
        self.chunked = 0                         # chunk regions built
        self.chunk_failures: list[str] = []      # chunk regions planned but not buildable
        self.failures: list[str] = []            # internal errors, each warned once
        self.notices: list[str] = []             # what the user can act on (DYNAMIC_CHUNKS), each warned once
        if config is not None:
            parse_config(config)                 # a malformed config is the caller's error, now
        if config is not None and budget is not None:
            raise ConfigError("give a config (the plans by hand) or a budget (the planner chooses), not both")

    def warn(self, message: str) -> None:
        if message not in self.failures:
            self.failures.append(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _notice(self, message: str) -> None:
        if message not in self.notices:
            self.notices.append(message)
            warnings.warn(message, UserWarning, stacklevel=3)

    def on_device(self, example_inputs) -> None:
        """Resolve a `free` budget for the graph about to compile, from what its inputs' device
        has free now, less the reserve (the one written, else the optimizer state to come). A
        device whose free memory cannot be read is the caller's error in strict mode; otherwise
        the graph is planned without a budget (every plan the rules match), with a warning."""
        try:
            device = input_device(example_inputs)
            free = free_bytes(device)
            self.parameters.update(trainable_bytes(example_inputs))
            reserve = optimizer_reserve(self.parameters)
        except Exception as err:        # reading the device failed: the step still compiles
            unknown = isinstance(err, FreeMemoryUnknown)
            if self.strict and unknown:
                raise ConfigError(f"budget {self.free_budget}: {err}; give bytes (400MiB) or a fraction "
                                  f"(0.6)") from None
            if self.strict:
                raise
            why = str(err) if unknown else \
                f"reading the device's free memory failed ({type(err).__name__}: {err})"
            self.warn(f"remat: budget {self.free_budget}: {why}; planning without a budget")
            self.budget = None
            return
        self.budget = self.free_budget.on_device(free, reserve)
        kept = (f"{format_bytes(reserve)} kept back (twice the trainable parameters compiled so far: an Adam "
                f"optimizer's state, made after the compile; free-SIZE keeps SIZE instead)" if self.free_budget.reserve is None
                else f"{format_bytes(self.free_budget.reserve)} kept back")
        line = (f"remat: budget {self.free_budget} on {device}: {format_bytes(free)} free, {kept}, "
                f"{FREE_HEADROOM:.0%} left to the allocator: {format_bytes(self.budget.bytes)}")
        self.free_resolved.append(line)
        self.unreported = line          # reported with the graph's plans (__call__), not for an empty one

    def _skipped(self, failure: PlanFailure) -> None:
        self.warn(f"remat: {failure}; compiling without that plan")

    def __call__(self, graph: fx.Graph) -> None:
        with collector_paused():
            self._rewrite(graph)

    def _rewrite(self, graph: fx.Graph) -> None:
        owner = graph.owning_module
        if owner is not None and owner.meta.get("produced_by_chunker"):
            return      # a chunk's body: Inductor runs the joint passes on it too
        output = next((n for n in graph.nodes if n.op == "output"), None)
        if output is None or not _flat_nodes(output.args):
            return      # nothing to rewrite (dynamo hands a graph break's empty fragment over too)
        if self.unreported is not None and self.report is not None:
            self.report(self.unreported)
        self.unreported = None
        builder = FxBuilder(graph, self.rules.views, self.strict)
        if self.budget is not None and self.budget.bytes is not None:
            unbounded = {name: traced for name, (traced, largest) in dim_bounds(graph).items() if largest is None}
            if unbounded:
                self._notice(UNBOUNDED_BUDGET.format(budget=format_bytes(self.budget.bytes), sizes=", ".join(
                    f"{name}={size}" for name, size in sorted(unbounded.items())),
                    size=_size_name(unbounded, size_sources(graph))))
        try:
            done = self.plan(builder, self._graph_key(graph))
            builder.commit()
        except SamePlan:
            raise       # to compile_with_remat, which keeps the code it compiled for this plan
        except Exception as err:
            if self.strict:
                raise
            self.warn(f"remat: internal error, this graph is compiled without remat: "
                      f"{type(err).__name__}: {err}")
            return
        self._record(done, builder)

    def plan(self, builder: FxBuilder, key: str | None = None) -> Rewrite:
        """The rewrite of the builder's graph, on a working copy the builder commits or drops: the
        rules, the config or the budget (planned for `device`, else where the graph's inputs are),
        less the cut an earlier compile of the graph (`key`) found its simulation low by."""
        device = None if self.budget is None else uncached(profile_for(self.device or _device_of(builder.graph)))
        cut = self.cuts.get(key) if key is not None else 0
        budget = self.budget if not cut else replace(self.budget, cut=cut)
        # Not strict, a budget no plans meet still compiles: with the plans that reach the lowest peak.
        try:
            done = rewrite(builder, self.rules, self.config, self.tiers, strict=self.strict,
                           on_failure=self._skipped, budget=budget, device=device, settle=not self.strict)
        except BudgetError as err:
            raise self._cut_error(err, cut) from None
        if done.unmet is not None:
            resolved = f" ({self.free_resolved[-1].removeprefix('remat: ')})" if self.free_budget else ""
            self.warn(f"remat: {self._cut_error(done.unmet, cut)}{resolved}; compiling with the plans that reach "
                      f"that lowest peak")
        if key is not None and done.choice is not None and done.simulated_peak is not None:
            selection = frozenset(done.choice.selection.items())
            before = next((p for p in reversed(self.planned) if p.key == key), None)
            if cut and done.unmet is not None and before is not None and before.selection == selection:
                # Planned again after its code held over the budget, to the plans compiled already.
                raise SamePlan(key)
            self.planned.append(Planned(key, done.choice.budget + cut, cut, done.simulated_peak,
                                        lowest=done.unmet is not None, selection=selection))
        return done

    @staticmethod
    def _cut_error(err: BudgetError, cut: int) -> BudgetError:
        """The planner's error, saying what the peak it asked for is where a cut lowered it."""
        if not cut:
            return err
        return BudgetError(err.budget, err.lowest, err.original, err.tiers, why=(
            f"the {format_bytes(err.budget + cut)} budget less {format_bytes(cut)}, what the code Inductor "
            f"generated for this graph held over remat's simulation of it"))

    def _graph_key(self, graph: fx.Graph) -> str | None:
        """The joint graph's identity across runs, where a budget is planned for: the key of its cut."""
        if self.budget is None or self.budget.free:
            return None
        try:
            return joint_digest(graph)
        except Exception as err:    # noqa: BLE001 - no key: planned, not checked
            self.warn(f"remat: this graph cannot be keyed ({type(err).__name__}: {err}); its compiled code "
                      f"is not checked against the budget")
            return None

    def check(self, planned_before: int, account: InductorAccount, last: bool) -> bool:
        """After a compile: whether the graph it planned (if it planned one for a budget) must be
        planned again, by Inductor's account of the code it generated (a lower bound of what the
        step holds). Records the cut to plan with and tells the user; where no lower plan can
        help, or this was the last try, says the code is over its budget."""
        held = account.peak_bytes
        if len(self.planned) <= planned_before or held is None:
            return False
        planned = self.planned[-1]
        if not planned.over(held) or (planned.lowest and not planned.cut):
            return False    # within it, or over it where the planner's warning (`unmet`) said so
        over = (f"Inductor's code for this graph holds at least {format_bytes(held)} by its own account, over "
                f"the {format_bytes(planned.budget)} budget, where remat's model simulated "
                f"{format_bytes(planned.simulated)}")
        if planned.lowest or last:
            why = ("the plans that reach the lowest peak are compiled" if planned.lowest
                   else f"planned again {MAX_REPLANS} times")
            self._replanned(f"remat: {over}; {why}, and the step runs over its budget")
            return False
        cut = planned.next_cut(held)
        self.cuts.record(planned.key, cut)
        self._replanned(f"remat: {over}; planning it again for {format_bytes(planned.budget - cut)} "
                        f"(the budget less {format_bytes(cut)})")
        return True

    def same_plan(self) -> None:
        """Say that the graph planned again is compiled with the plans it had: those of the lowest peak."""
        planned = self.planned[-1]
        self._replanned(f"remat: planned again for the budget less {format_bytes(self.cuts.get(planned.key))}, "
                        f"this graph comes to the plans it was compiled with, those of the lowest peak the rules "
                        f"reach: Inductor's code for them is kept, and the step runs over its budget")

    def _replanned(self, message: str) -> None:
        self.replans.append(message)
        self._notice(message)
        if self.report is not None:
            self.report(message)

    def _record(self, done: Rewrite, builder: FxBuilder) -> None:
        if done.chunk_result is not None:
            self.chunk_results.append(done.chunk_result)
            self._chunk_notices(done.chunk_result.planning.standing_refusals(), done.chunk_result.planning.graph,
                                size_sources(builder.graph))
        self.results.append(done.result)
        if done.choice is not None:
            self.choices.append(done.choice)
        self.chunked += done.chunked
        if self.budget is None and self.config is None and builder.calls.sites \
                and (device := _device_of(builder.graph)).startswith("cuda"):
            self._notice(UNBUDGETED_GPU.format(regions=done.chunked, calls=len(builder.calls.sites), device=device))
        for message in done.not_built:
            self.chunk_failures.append(message)
            warnings.warn(f"{message.replace(': ', ' was not built: ', 1)}", stacklevel=2)
        if builder.donated is False:
            # See compile_with_remat: read when AOTAutograd finishes partitioning this graph.
            import torch._functorch.config as functorch_config

            functorch_config.donated_buffer = False
        if self.report is not None:
            self.report(done.report())

    def _chunk_notices(self, refusals: list, graph: Graph, sources: dict[str, str]) -> None:
        """Tell the user, once each, of the chunk regions refused for what they can change: sizes
        dynamic or named apart, a declared range, a loss outside the graph, longer inputs."""
        def refused(field: Callable[[Reason], Any]) -> dict:
            return {r.match.rule.name: field(r.reason) for r in refusals if field(r.reason)}

        dynamic = [r for r in refusals if r.reason.dynamic_sizes]
        unproven = {r.match.rule.name: r.reason.unproven_sizes for r in dynamic if r.reason.unproven_sizes}
        for rule, sizes in sorted(unproven.items()):
            self._notice(_unproven_notice(rule, sizes, sources))
        static = {r.match.rule.name: r.reason.message for r in dynamic if r.match.rule.name not in unproven}
        if static:
            self._notice(DYNAMIC_CHUNKS.format(rules=", ".join(sorted(static)), why=next(iter(static.values()))))
        constrained = refused(lambda reason: reason.constrained_dims)
        if constrained:
            dims = {d for found in constrained.values() for d in found}
            self._notice(CONSTRAINED_SIZES.format(rules=", ".join(sorted(constrained)), size=_size_name(dims, sources)))
        returned = refused(lambda reason: reason.returned_values)
        notice = _returned_notice(returned, graph) if returned else None
        if notice:
            self._notice(notice)
        longer = refused(lambda reason: reason if reason.longer_inputs else None)
        if longer:
            self._notice(_longer_notice(longer, graph, sources))

    def _config_key(self, budget) -> str:
        return (f"remat-pass|{_code_digest()}|{self.rules.digest}|{self.config}|{','.join(self.tiers)}|"
                f"{budget}|{self.device}")

    def uuid(self) -> str:
        """The pass's part of the cache key: remat's code, the rules and options, and the budget
        cuts found for this configuration (a graph planned again is not served as first compiled)."""
        key = self._config_key(self.budget) + (f"|cuts {self.cuts.digest()}" if self.budget is not None else "")
        return hashlib.sha256(key.encode()).hexdigest()


def uncached(profile: DeviceProfile) -> DeviceProfile:
    """The profile with no cache modelled, as the planner weighs chunks for Inductor's code. The
    cache term (engine.budget.cost.chunk_seconds) was measured on ONNX Runtime, which runs a
    chunk's nodes as kernels of their own; Inductor fuses them, and its gain there is unmeasured.
    Session 47 left it out because the plans it led to on the GPT-like sweep (`bench/budget.py
    --torch`) ran over their budgets; that was the peak model's (backends/fx/peak.py: a buffer
    Inductor holds across a chunk's slices, a saved value the backward cannot write over), fixed
    in session 48, after which the term's sweep kept every budget (at most 0.994 of it); its step
    times were planned with a CPU profile measured on fake tensors (backends/device.py,
    measure_cpu), so the term's speed on Inductor is still unmeasured."""
    return replace(profile, cache_bytes=None, cache_bytes_per_s=None)


def _device_of(graph: fx.Graph) -> str:
    """`cuda:N` when the joint graph's inputs live on a GPU, else `cpu`."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and getattr(val, "device", None) is not None:
            return str(val.device) if val.device.type == "cuda" else "cpu"
    return "cpu"


def skip_transformers_warnings() -> None:
    """Have Dynamo skip transformers' `logger.warning_once` in compiled code
    (`ignore_logging_functions`), where each call is a graph break (Dynamo does not trace its
    lru_cache). GPT2LMHeadModel's `loss_function`, its `loss_type` unset as users build it, warns
    between the LM head and the loss: two graphs, neither holding the linear + cross-entropy to
    chunk. Done when a remat backend is made or looked up (`torch.compile(backend="remat")`
    imports this module), once transformers is loaded; the warnings still print in eager runs."""
    import logging
    import sys

    warn_once = getattr(logging.Logger, "warning_once", None)
    if warn_once is None or "transformers" not in sys.modules:
        return
    import torch._dynamo.config as dynamo_config

    skipped = getattr(dynamo_config, "ignore_logging_functions", None)     # torch 2.13
    if skipped is None:
        skipped = getattr(dynamo_config, "ignore_logger_methods", None)     # torch 2.11
    if skipped is not None:
        skipped.add(warn_once)


def backend(rules: RuleSet | str | Path | Iterable | None = None, config: str | None = None,
            tiers: Iterable[str] = (), report: Callable[[str], None] | bool | None = None,
            strict: bool | None = None, budget=None, device=None, ratio: float | None = None,
            mode: str | None = None):
    """A torch.compile backend: Inductor with the rules (a RuleSet, or rule files and folders;
    the shipped library by default) applied to the joint graph. `strict`
    (default: the REMAT_STRICT environment variable) raises remat's internal errors instead
    of compiling without the plan, or the graph without remat. `budget` (`"400MiB"`, a
    fraction of the estimated peak, `0.6`, or `"free"`: what the device has free when the graph
    compiles, less the optimizer state to come or the SIZE of `"free-SIZE"`, less a tenth for
    the allocator): the planner chooses the fastest plans that fit,
    for `device` (a name: `cpu`, `h100`, ...; by default where the graph's inputs are). `ratio`
    (0.5): a budget by layers, the fraction of the layers' stashed activations to recompute.
    `mode`: torch.compile's Inductor mode (`max-autotune`, `reduce-overhead`, ...), whose
    Inductor settings the compile runs under, as `torch.compile(mode=...)` gives them Inductor.
    `report` receives each rewritten graph's plan table, on every compile (True: printed). A
    graph AOTAutograd serves from its cache (keyed with RematPass.uuid: the same graph, rules, config, tiers and
    budget compiled before) runs no joint pass and would report nothing, though its code is the
    rewritten graph's; so with `report` remat's compiles skip AOTAutograd's cache (Inductor's FX
    graph cache, looked up after the joint pass, still serves them)."""
    skip_transformers_warnings()
    inductor_options = _mode_options(mode)
    if ratio is not None:
        if budget is not None:
            raise ConfigError("give a budget or a ratio, not both")
        budget = parse_ratio(ratio)
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    remat_pass = RematPass(ruleset, config, tiers, report, strict, budget, device)

    def compile_with_remat(gm: fx.GraphModule, example_inputs):
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._dynamo.exc import RestartAnalysis
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
        functorch_options = {} if remat_pass.report is None else {"enable_autograd_cache": False}
        if remat_pass.budget is not None and hasattr(functorch_config, "force_non_lazy_backward_lowering"):
            # The backward compiled now, not at its first run: its code is what Inductor's
            # account of the step checks against the budget (RematPass.check).
            functorch_options["force_non_lazy_backward_lowering"] = True
        if remat_pass.free_budget is not None:
            remat_pass.on_device(example_inputs)
        try:
            for attempt in range(MAX_REPLANS + 1):
                planned_before = len(remat_pass.planned)
                try:
                    with inductor_config.patch(inductor_options), \
                            inductor_config.patch(joint_custom_pre_pass=remat_pass), \
                            functorch_config.patch(donated_buffer=functorch_config.donated_buffer,
                                                   **functorch_options), \
                            inductor_account() as account:
                        compiled = compile_fx(gm, example_inputs)
                except SamePlan:
                    remat_pass.same_plan()
                    return compiled
                # Inductor's account of its code over the budget: planned again, less what it held over.
                if not remat_pass.check(planned_before, account, last=attempt == MAX_REPLANS):
                    return compiled
            return compiled
        except RestartAnalysis:
            # Dynamo's signal to trace the frame again (a float it will now specialize,
            # TensorifyScalarRestartAnalysis): not a failure. Caught as one, the fallback below
            # compiled the graph without remat on every dynamic-size graph with a float size.
            raise
        except Exception as err:
            if remat_pass.strict:
                raise
            # Inductor could not compile what remat made of the graph: compile it as it is.
            # (An error of the user's own model is raised again from here, as without remat.)
            remat_pass.warn(f"remat: compiling this graph failed after remat's rewrite, compiling "
                            f"it without remat: {type(err).__name__}: {err}")
            with inductor_config.patch(inductor_options):
                return compile_fx(gm, example_inputs)

    compile_with_remat.remat_pass = remat_pass
    compile_with_remat.inductor_options = inductor_options
    return compile_with_remat


def _mode_options(mode: str | None) -> dict:
    """The Inductor settings of a torch.compile mode (`reduce-overhead`: CUDA graphs;
    `max-autotune`: autotuned kernels and CUDA graphs), as torch gives them to Inductor."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    try:
        return list_mode_options(mode)
    except RuntimeError as err:
        raise ConfigError(f"unknown torch.compile mode {mode!r}: {err}") from None


OPTIONS = ("rules", "config", "tiers", "strict", "budget", "ratio", "device", "report")
# Options for launchers that pass a backend's name and mode but no options (transformers' Trainer:
# `torch_compile_backend="remat"`), read where `options` does not give them or what excludes them.
BUDGET_ENV, TIERS_ENV = "REMAT_BUDGET", "REMAT_TIERS"


def _environment_options(options: dict) -> dict:
    """REMAT_BUDGET (`free`, `0.6`, `400MiB`) unless the options give a budget, a ratio or a
    config; REMAT_TIERS (`expensive`, comma-separated) unless they give tiers."""
    options = dict(options)
    budget = os.environ.get(BUDGET_ENV, "").strip()
    if budget and not {"budget", "ratio", "config"} & set(options):
        try:
            options["budget"] = parse_budget(budget)
        except ConfigError as err:
            raise ConfigError(f"{BUDGET_ENV}: {err}") from None
    tiers = os.environ.get(TIERS_ENV, "").strip()
    if tiers and "tiers" not in options:
        options["tiers"] = [t.strip() for t in tiers.split(",") if t.strip()]
    return options


skip_transformers_warnings()        # torch.compile(backend="remat") imports this module to look it up


def remat_backend(gm: fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """The registered `remat` backend: the shipped rules, default tier. torch.compile passes its
    `mode` and `options` to a registered backend, so `torch.compile(model, backend="remat",
    mode="max-autotune", options={"budget": "400MiB"})` works; the option keys are backend()'s
    arguments, and the mode's Inductor settings apply as they would to Inductor. Launchers that
    give no options set REMAT_BUDGET and REMAT_TIERS (`_environment_options`)."""
    options = dict(options or {})
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ConfigError(f"unknown remat option(s) {', '.join(sorted(unknown))}; options: {', '.join(OPTIONS)}")
    options = _environment_options(options)
    rules = options.pop("rules", None)
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    # Keyed by the rules' content: a rule file edited between two compiles gets a backend of its own.
    key = (mode, ruleset.digest, tuple(sorted((name, _option_key(value)) for name, value in options.items())))
    compiler = _CONFIGURED.get(key)
    if compiler is None:
        compiler = _CONFIGURED[key] = backend(rules=ruleset, **options, mode=mode)
    return compiler(gm, example_inputs)


# The registered backend is called once per graph. Graphs compiled with the same mode and options
# share one configured backend, as they would share a `backend(...)` object passed by hand: a
# `free` budget then keeps back the optimizer state of every graph compiled so far (a model
# split by graph breaks, a launcher that compiles by name), and each notice is given once.
# `torch._dynamo.reset()` clears it (torch calls a backend's `reset`).
_CONFIGURED: dict[tuple, Callable] = {}
remat_backend.reset = _CONFIGURED.clear


def _option_key(value):
    """An option's value as a key: by value where it hashes (strings, numbers, a parsed budget, a
    list of them), else by identity, kept alive by the configured backend that holds it."""
    if isinstance(value, (list, tuple)):
        value = tuple(_option_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value

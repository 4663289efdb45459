"""Recompute and recompute-with-compromise.

A region is grown upward from the stashed values a match targets (the value
and its stashed views), through ops the rules declare recomputable, and stops
at values that are available in backward anyway: graph inputs, weights, values
that stay stashed, and the `from` values a compromise rule allows as a new,
smaller stash. The region's nodes are cloned and the backward readers of the
targets read the clones, which are scheduled just before the first of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..analysis import Analysis
from ..errors import GraphError
from ..ir import Graph, Node, Value
from ..matcher import Match, MatchContext, Reason
from ..order import order_near, producers
from ..patterns import Recompute, Save
from ..plan_type import PlanType
from ..shapes import Dim, simplify
from .replay import BoundReplay, bound_replay, instantiate

MAX_REGION_NODES = 64


@dataclass
class Region:
    match: Match
    targets: list[Value]          # stashed values this region stops keeping
    nodes: list[Node]             # forward nodes to clone, in schedule order
    leaves: list[Value]           # what the clones read from the stash, inputs and weights
    reused: dict[int, Value]      # value id -> clone made by an earlier region, read instead
    new_stash: list[Value]        # compromise: values kept that were not kept before
    saved: Dim                    # bytes no longer kept, as a formula
    added: Dim                    # bytes of the new stash
    # nondeterministic nodes of `nodes` that run again as their replay (node id -> it)
    replays: dict[int, BoundReplay] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return "".join(n.op_type + "+" for n in self.nodes)

    @property
    def plan_type(self) -> PlanType:
        return PlanType.RECOMPUTE_WITH_COMPROMISE if self.new_stash else PlanType.RECOMPUTE

    @property
    def net(self) -> Dim:
        return simplify(self.saved - self.added)


@dataclass
class StashState:
    """Which values are kept for backward, updated as regions are applied."""

    analysis: Analysis
    stashed: set[int] = field(default_factory=set)
    claimed: set[int] = field(default_factory=set)     # targets taken by an applied/planned region
    clone_of: dict[int, Value] = field(default_factory=dict)   # value id -> its recomputed clone

    @classmethod
    def of(cls, analysis: Analysis) -> "StashState":
        return cls(analysis, {id(v) for v in analysis.stashed})


def storage_bytes(values: list[Value], views: frozenset[str]) -> Dim:
    """Bytes held by `values`, counting a view of another value in the list once, and a view of
    a graph input or weight (which the step holds anyway) not at all: torch's expand of a frozen
    weight over a batch, which its bmm's backward keeps, is that weight's storage."""
    ids = {id(v) for v in values}
    total: Dim = 0
    for v in values:
        base = view_base(v, views, stop=ids)
        if base is v or (id(base) not in ids and base.producer is not None):
            total = total + (v.nbytes or 0)
    return simplify(total)


def view_base(v: Value, views: frozenset[str], stop: set[int] = frozenset()) -> Value:
    """The value `v` is a view of (through ops the rules declare views, by either spelling),
    stopping early at a value in `stop`."""
    base = v
    while (base.producer is not None and (base.producer.op in views or base.producer.native_op in views)
           and base.producer.inputs and base.producer.inputs[0] is not None):
        base = base.producer.inputs[0]
        if id(base) in stop:
            break
    return base


def grow(match: Match, ctx: MatchContext, state: StashState,
         recomputable: dict[str, str] | None = None) -> Region | Reason:
    """The region that makes the match's target recomputable, or why there is none."""
    rules = ctx.rules
    recomputable = rules.recomputable if recomputable is None else recomputable
    action = next((a for a in match.rule.actions if isinstance(a, Recompute)), None)
    if action is None:
        return Reason(match.rule.location, "the rule has no recompute action")
    target_value = match.bindings[action.target]
    if isinstance(target_value, list):
        return Reason(action.location, f"cannot recompute the variadic capture {action.target!r}")
    sources = [match.bindings[s] for s in action.sources]
    for save in (a for a in match.rule.actions if isinstance(a, Save)):
        sources.extend(match.bindings[s] for s in save.captures)
    sources = [v for s in sources for v in (s if isinstance(s, list) else [s])]
    source_ids = {id(v) for v in sources}
    analysis = state.analysis
    targets = [v for v in ctx.view_closure(target_value)
               if id(v) in state.stashed and id(v) not in state.claimed]
    if not targets:
        return Reason(action.location, f"%{target_value.name} and its views are not stashed "
                                       "(or another rule already recomputes them)")
    target_ids = {id(v) for v in targets}
    matched_ids = {id(n) for n in match.nodes}
    region: dict[int, Node] = {}
    leaves: dict[int, Value] = {}
    new_stash: dict[int, Value] = {}
    reused: dict[int, Value] = {}
    replays: dict[int, BoundReplay] = {}

    def need(value: Value) -> Reason | None:
        if id(value) in target_ids:
            return recompute(value)
        if id(value) in state.clone_of:
            reused[id(value)] = state.clone_of[id(value)]
            return None
        if (value.is_input or value.is_initializer or value.producer is None
                or analysis.is_constant(value)):
            leaves[id(value)] = value
            return None
        if id(value) in state.stashed:
            leaves[id(value)] = value
            return None
        if id(value) in source_ids:
            leaves[id(value)] = value
            new_stash[id(value)] = value
            return None
        return recompute(value)

    def recompute(value: Value) -> Reason | None:
        node = value.producer
        if id(node) in region:
            return None
        if not analysis.is_forward(node):
            return Reason(action.location, f"%{value.name} is produced in backward by {node.name}")
        if rules.is_random(node):
            return replay(node, value)
        if id(node) not in matched_ids and node.op not in recomputable and node.inputs:
            tier = rules.recomputable.get(node.op)
            why = (f"in tier {tier!r}, which is not enabled" if tier else "not declared recomputable")
            return Reason(action.location,
                          f"%{value.name} is not stashed and its producer {node.name} ({node.op}) is {why}")
        if node.subgraphs:
            return Reason(action.location, f"{node.name} ({node.op}) owns a subgraph; it is not cloned")
        region[id(node)] = node
        if len(region) > MAX_REGION_NODES:
            return Reason(action.location, f"recomputing %{target_value.name} needs more than "
                                           f"{MAX_REGION_NODES} nodes")
        for inp in node.present_inputs():
            why = need(inp)
            if why is not None:
                return why
        return None

    def replay(node: Node, value: Value) -> Reason | None:
        """A nondeterministic node runs again as its replay: the outputs that keep its random
        values are kept (a new stash where they were not), the inputs its template reads grown."""
        bound = bound_replay(rules, node)
        if isinstance(bound, str):
            return Reason(action.location, f"{bound}, so %{value.name} cannot be recomputed")
        if value is not bound.replayed:
            return Reason(action.location, f"%{value.name} holds the random values of {node.name} ({node.op}); "
                                           f"it is kept, not recomputed")
        region[id(node)] = node
        replays[id(node)] = bound
        for kept in bound.saved:
            leaves[id(kept)] = kept
            if id(kept) not in state.stashed and id(kept) not in state.clone_of:
                new_stash[id(kept)] = kept
        for inp in bound.inputs:
            why = need(inp)
            if why is not None:
                return why
        return None

    for target in targets:
        why = recompute(target)
        if why is not None:
            return why
    position = analysis.position
    nodes = sorted(region.values(), key=lambda n: position[id(n)])
    views = rules.views
    saved = storage_bytes(targets, views)
    base = view_base(target_value, views)
    if saved == 0 and base is not target_value and base.producer is None:
        return Reason(action.location, f"%{target_value.name} is a view of %{base.name}, which the step holds "
                                       "anyway: recomputing it saves nothing")
    added = storage_bytes(list(new_stash.values()), views)
    return Region(match, targets, nodes, list(leaves.values()), reused, list(new_stash.values()),
                  saved, added, replays)


class Rewriter:
    """Applies regions to a graph one after another, then fixes the schedule once.

    Each clone is placed before a position of the original schedule: the first
    backward reader of what its region recomputes. A region that reads an
    earlier region's clone pulls that region forward to its own position, and
    clones placed at the same position are ordered by their data dependencies.
    """

    def __init__(self, graph: Graph, state: StashState):
        self.graph = graph
        self.state = state
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.applied = 0
        self.clones: list[Node] = []
        self.place: dict[int, int] = {}      # clone node id -> original position it precedes

    def _position(self, node: Node) -> int:
        return self.place[id(node)] if id(node) in self.place else self.index[id(node)]

    def _hoist(self, node: Node, position: int) -> None:
        stack = [node]
        while stack:
            clone = stack.pop()
            if id(clone) not in self.place or self.place[id(clone)] <= position:
                continue
            self.place[id(clone)] = position
            stack.extend(v.producer for v in clone.present_inputs() if v.producer is not None)

    def apply(self, region: Region) -> None:
        self.applied += 1
        mapping: dict[int, Value] = dict(region.reused)
        clones = []
        for node in region.nodes:
            if id(node) in region.replays:
                clones.extend(self._replay(region.replays[id(node)], mapping))
                continue
            outputs = []
            for out in node.outputs:
                clone_out = replace(out, name=self.graph.fresh_name(f"{out.name}_rc"), producer=None,
                                    users=[], meta=dict(out.meta))
                mapping[id(out)] = clone_out
                outputs.append(clone_out)
            inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
            clone = replace(node, inputs=inputs, outputs=outputs, attrs=dict(node.attrs),
                            name=self.graph.fresh_name(f"{node.name}_rc"), meta=dict(node.meta),
                            recompute_of=node.name, recompute_region=self.applied, plan=region.key)
            for out in outputs:
                out.producer = clone
            for v in clone.present_inputs():
                v.users.append(clone)
            clones.append(clone)
        clone_ids = {id(c) for c in clones}
        first_use = None
        for target in region.targets:
            replacement = mapping[id(target)]
            for user in list(target.users):
                if id(user) in clone_ids or self.state.analysis.is_forward(user):
                    continue
                user.replace_input(target, replacement)
                target.users = [u for u in target.users if u is not user]
                replacement.users.append(user)
                pos = self._position(user)
                first_use = pos if first_use is None else min(first_use, pos)
            self.state.stashed.discard(id(target))
            self.state.claimed.add(id(target))
        for v in region.new_stash:
            self.state.stashed.add(id(v))
        if first_use is None:
            return
        for clone in clones:
            self.place[id(clone)] = first_use
        for node in region.nodes:
            for out in node.outputs:
                if id(out) in mapping and mapping[id(out)] is not out:
                    self.state.clone_of[id(out)] = mapping[id(out)]
        for reused in region.reused.values():
            self._hoist(reused.producer, first_use)
        self.clones.extend(clones)

    def _replay(self, bound: BoundReplay, mapping: dict[int, Value]) -> list[Node]:
        """The replay of a nondeterministic node: its template's nodes, writing a clone of the
        replayed output; its kept outputs are read as they are."""
        target = bound.replayed
        out = replace(target, name=self.graph.fresh_name(f"{target.name}_rc"), producer=None, users=[],
                      meta=dict(target.meta))
        nodes = instantiate(bound, lambda v: mapping.get(id(v), v), self.graph.fresh_name, out)
        mapping[id(target)] = out
        for n in nodes:
            n.recompute_of, n.recompute_region = bound.node.name, self.applied
            for o in n.outputs:
                o.producer = n
            for v in n.present_inputs():
                v.users.append(n)
        return nodes

    def finish(self) -> Graph:
        groups: dict[int, list[Node]] = {}
        for clone in self.clones:
            groups.setdefault(self.place[id(clone)], []).append(clone)
        nodes: list[Node] = []
        for i, node in enumerate(self.graph.nodes):
            nodes.extend(groups.get(i, []))
            nodes.append(node)
        # Clones at one place follow the clones they read; a clone placed before an input the
        # exporter computes late (a reshape's target shape built from sizes right before the
        # original reshape) waits for it; every other node keeps its place.
        ordered = order_near(nodes, producers)
        if ordered is None:
            raise GraphError("remat bug: recompute left a cycle in the graph")
        self.graph.nodes = ordered
        self.graph.link()
        return self.graph


"""Inductor's own account of the code it generated: the peak bytes a compiled graph holds.

remat's peak model (backends.fx.peak) simulates the partitioner's graphs with Inductor's
fusion and buffer reuse as remat understands them, ahead of the compile, for every plan the
budget search tries. Where Inductor does something the model does not know, the model is low
and the budget is broken: Falcon-H1's Mamba 2 backward at a 0.7x budget simulated at 1414.9
MiB and held 1753.6, because Inductor keeps a transposed copy of two 128 MiB products for
the batched matmuls that read them (a kernel that writes three new buffers at once), where
the model wrote one of them over its input.

After Inductor has generated a graph's code, its scheduler knows every buffer it allocates
and when each is freed: `torch._inductor.memory` walks them (Inductor's own peak-memory
reordering uses that walk) from each node's outputs and last uses, the graph's freeable
inputs included. It counts two things the generated code does not hold, both known only
once the code is generated, so the walk runs after `Scheduler.codegen`, not where Inductor
runs it:
- buffers a fused kernel keeps to itself (`V.graph.removed_buffers`): never allocated;
- a buffer written in place over an input it read for the last time (the wrapper's
  `reuses`, `buf13 = buf12; del buf12  # reuse`): the input's storage, not a new one.
With those taken out, the walk is a lower bound of what the code holds, never above it on
the models measured (CPU, torch 2.13: Llama 30.5 MiB against 32.8 held, GPT-J 22.6 against
25.4, Cohere's plain compile 45.3 against 47.3, Falcon-H1 at 0.7x 1748.9 against 1753.6): it
leaves out what an extern kernel allocates inside (cumsum's fallback) and a chunk region's
slice body, compiled as a graph of its own. A lower bound is what a check needs: a graph
whose account is over the budget is over it for certain, and remat plans it again
(backends.fx.compile). The walk is Inductor's internals: where this torch lacks them, there
is no account and no check, never an error in the user's compile.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class GraphAccount:
    """One compiled graph (a forward, a backward): the most bytes its code holds at once, by
    Inductor's account, and the scheduler node it holds them at."""

    peak_bytes: int
    at: str


@dataclass(eq=False)        # open blocks are told apart by identity
class InductorAccount:
    """The graphs compiled while `inductor_account()` was open (chunk slice bodies left out:
    each is a graph of its own, run inside one node of its caller)."""

    graphs: list[GraphAccount] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int | None:
        """The highest graph's account: a lower bound of the step's peak (the forward's saved
        values are the backward's inputs, which its account counts until their last use)."""
        return max((g.peak_bytes for g in self.graphs), default=None)


_OPEN: list[InductorAccount] = []


@contextlib.contextmanager
def inductor_account():
    """Record Inductor's account of each graph it generates code for in this block. Nested
    blocks each see the graphs compiled inside them."""
    account = InductorAccount()
    _OPEN.append(account)
    restore = _patch_codegen()
    try:
        yield account
    finally:
        _OPEN.remove(account)
        if restore is not None and not _OPEN:
            restore()


_PATCHED: list = []     # the scheduler's own codegen while it is wrapped


def _patch_codegen():
    """Wrap `Scheduler.codegen` to account each graph after its code is generated; returns the
    undo, or None where it is wrapped already (an outer block) or cannot be."""
    if _PATCHED:
        return None
    try:
        from torch._inductor.scheduler import Scheduler
    except Exception:       # noqa: BLE001 - no scheduler, no account
        return None
    original = Scheduler.codegen

    def codegen(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _OPEN:
            _account(self)
        return result

    Scheduler.codegen = codegen
    _PATCHED.append(original)

    def restore() -> None:
        Scheduler.codegen = _PATCHED.pop()

    return restore


def _account(scheduler) -> None:
    try:
        from torch._inductor.virtualized import V

        graph = V.graph
        if getattr(graph, "name", None):
            return          # a subgraph (a chunk's slice body): run inside one node of its caller
        account = graph_account(scheduler, graph)
    except Exception as err:    # noqa: BLE001 - internals of another torch: no account
        log.debug("no Inductor account of this graph: %s: %s", type(err).__name__, err)
        for open_account in _OPEN:
            open_account.failures.append(f"{type(err).__name__}: {err}")
        return
    for open_account in _OPEN:
        open_account.graphs.append(account)


def graph_account(scheduler, graph) -> GraphAccount:
    """Inductor's memory walk over the scheduler's final order, less the buffers its generated
    code never allocates (see the module docstring)."""
    from torch._inductor import memory
    from torch.utils._ordered_set import OrderedSet

    nodes = scheduler.nodes
    outputs = OrderedSet(graph.get_output_names())
    _, freeable = memory.prepare_planning_info(nodes, scheduler.name_to_buf, scheduler.name_to_fused_node,
                                               OrderedSet(graph.graph_inputs.keys()), outputs)
    infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
    removed = set(graph.removed_buffers) | set(getattr(graph, "inplaced_to_remove", ()))
    reuses = dict(getattr(graph.wrapper_code, "reuses", {}) or {})     # written buffer -> the input it overwrites
    overwritten = set(reuses.values())
    for info in infos:
        name = info.buffer.get_name() if hasattr(info.buffer, "get_name") else info.buffer.name
        if name in removed:
            info.size_alloc = info.size_free = 0
        if name in reuses:
            info.size_alloc = 0         # the input's storage: freed when this buffer is
        if name in overwritten:
            info.size_free = 0
    peak, step = _peak(infos, len(nodes))
    at = nodes[step].get_name() if step < len(nodes) else "the graph's end"
    return GraphAccount(peak, at)


def _peak(infos, steps: int) -> tuple[int, int]:
    """The most bytes held at once over the buffers' spans, and the step it is held at. Each is
    allocated at its start step and freed after its end step; a graph output (end -1) is kept.
    (As `memory.peak_memory_from_buf_info_list` of newer torch does; older ones lack it.)"""
    delta = [0] * (steps + 1)
    for info in infos:
        delta[info.start_step] += info.size_alloc
        if info.end_step != -1:
            delta[info.end_step + 1] -= info.size_free
    held = peak = at = 0
    for step, change in enumerate(delta):
        held += change
        if held > peak:
            peak, at = held, step
    return int(peak), at

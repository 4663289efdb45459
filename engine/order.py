"""One way to put a rewritten schedule back in order: every node as near its intended place as
its inputs allow.

A rewrite says where it wants each node (a clone before the first backward reader of what it
recomputes; a chunk Loop where its region began), but the place can come before one of the
node's inputs: an exporter emits a shape computation lazily, right before its reader, so a clone
of that reader placed earlier than the original one would read the shape before it is computed.
Kahn's algorithm taking the ready node of least key first keeps every node where it was asked
for when that is valid, and otherwise moves it just after its last input: no global re-sort that
drifts a weight gradient to the end (the backends schedule the backward from this order, and a
drifted node keeps what it reads alive until then). Used by the recompute rewriter and by both
backends' chunk builders, on the engine's nodes and on torch.fx's.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from .ir import Node

N = TypeVar("N")


def producers(node: Node) -> Iterator[Node]:
    """The engine nodes whose outputs `node` reads (its subgraphs' captures too)."""
    return (v.producer for v in node.reads() if v.producer is not None)


def order_near(nodes: Sequence[N], predecessors: Callable[[N], Iterable[N]],
               key: Callable[[N], Any] | None = None) -> list[N] | None:
    """`nodes` topologically ordered, the ready node of least `key` first (ties, and without a
    `key` every choice, in list order). `predecessors(n)`: the nodes of `nodes` that n reads
    (others are ignored; `producers` for the engine's nodes). None where the nodes form a cycle."""
    seq = {id(n): k for k, n in enumerate(nodes)}
    if key is None:
        key = lambda n: seq[id(n)]      # noqa: E731
    users: dict[int, list[N]] = {id(n): [] for n in nodes}
    waiting: dict[int, int] = {}
    for n in nodes:
        deps = {id(p) for p in predecessors(n) if id(p) in seq}
        waiting[id(n)] = len(deps)
        for d in deps:
            users[d].append(n)
    ready = [(key(n), seq[id(n)], n) for n in nodes if not waiting[id(n)]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[id(n)]:
            waiting[id(u)] -= 1
            if not waiting[id(u)]:
                heapq.heappush(ready, (key(u), seq[id(u)], u))
    return order if len(order) == len(nodes) else None

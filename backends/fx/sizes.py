"""A dynamic graph's sizes written into it as fx nodes.

A rewrite that builds a shape of its own (a chunk region's input reshaped to the shape the
slices compute in, the concatenated slices reshaped back, a buffer of zeros for a partial sum)
cannot put a SymInt in a node's arguments: it needs a node that computes it. Every symbol of a
graph Dynamo traced is the size of one of its inputs (or an input itself, a SymInt
placeholder); a size is its formula over those, lowered into the graph with torch's own
sympy interpreter (the one runtime asserts are lowered with), the arithmetic as `operator`
nodes on SymInts, which Inductor and the partitioner handle as the graph's own.
"""
from __future__ import annotations

import sympy
import torch
from torch import fx

from engine.errors import GraphError
from engine.shapes import is_quotient

aten = torch.ops.aten


class SizeNodes:
    """Sizes as nodes of `graph`, a symbol's source found once and read where it is needed."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._sources: dict[sympy.Symbol, tuple[fx.Node, int | None]] | None = None
        self._nodes: dict[sympy.Symbol, fx.Node] = {}
        self._made: list[fx.Node] = []

    def shape(self, shape) -> list:
        """`shape` (ints and SymInts) as a node's shape argument: ints, and nodes for the SymInts."""
        return [self.size(d) for d in shape]

    def size(self, d):
        if not isinstance(d, torch.SymInt):
            return int(d)
        known = d.node.maybe_as_int()
        if known is not None:
            return known
        return _lowered(d.node.expr, lambda s: fx.Proxy(self.symbol(s, d)))

    def formula(self, expr) -> "fx.Node | int":
        """An engine formula over the graph's symbols (by name: `s0*s1`) as a node of its value."""
        return _lowered(expr, lambda s: fx.Proxy(self.symbol(self._named(s.name), expr)))

    def value(self, expr) -> "torch.SymInt | int":
        """An engine formula over the graph's symbols as the SymInt it stands for (fake tensors' sizes)."""
        return _lowered(expr, lambda s: self.symbol(self._named(s.name), expr).meta["val"])

    def _named(self, name: str) -> sympy.Symbol:
        if self._sources is None:
            self._sources = self._find_sources()
        found = next((s for s in self._sources if s.name == name), None)
        if found is None:
            raise GraphError(f"the size {name} is the size of no input of the graph")
        return found

    def symbol(self, symbol: sympy.Symbol, size=None) -> fx.Node:
        """The node of a symbol's value (its `meta["val"]` the SymInt), read after the inputs."""
        if symbol not in self._nodes:
            if self._sources is None:
                self._sources = self._find_sources()
            if symbol not in self._sources:
                raise GraphError(f"the size {size if size is not None else symbol} has the symbol {symbol}, "
                                 f"which no input of the graph has as its size")
            node, dim = self._sources[symbol]
            if dim is None:
                self._nodes[symbol] = node
            else:
                first = next(n for n in self.graph.nodes if n.op != "placeholder")
                with self.graph.inserting_before(first):
                    self._nodes[symbol] = self.graph.call_function(aten.sym_size.int, (node, dim))
                self._nodes[symbol].meta["val"] = node.meta["val"].shape[dim]
                self._made.append(self._nodes[symbol])
        return self._nodes[symbol]

    def discard(self) -> None:
        """Erase the size nodes this made that nothing reads (a rewrite that gave up)."""
        for node in reversed(self._made):
            if not node.users:
                self.graph.erase_node(node)
        self._made.clear()
        self._nodes.clear()

    def _find_sources(self) -> dict[sympy.Symbol, tuple[fx.Node, int | None]]:
        """Where each symbol is read: a SymInt input that is it, else the first input with a dim of
        exactly that size. Only where the symbol is its own: a size Dynamo found equal to another
        (HF's attention mask's length to the ids') is that other symbol by replacement, and
        Inductor binds an input SymInt by its own symbol (`_get_placeholder_expr`), so a body
        given it would not know the size it stands for."""
        sources: dict[sympy.Symbol, tuple[fx.Node, int | None]] = {}
        for node in self.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if _plain_symbol(val):
                sources[val.node.expr] = (node, None)
            elif isinstance(val, torch.Tensor):
                for k, d in enumerate(val.shape):
                    if _plain_symbol(d):
                        sources.setdefault(d.node.expr, (node, k))
        return sources


def lower_formula(expr, symbols: dict[str, fx.Node]) -> "fx.Node | int":
    """A formula written into the graph of `symbols` (each symbol's node, by name): a KeyError
    names a symbol it lacks."""
    return _lowered(expr, lambda s: fx.Proxy(symbols[s.name]))


def _lowered(expr, leaf):
    """`expr` (an int, or a formula) computed from `leaf(symbol)` for each of its symbols, with
    torch's sympy interpreter: an fx node where the leaves are proxies, a SymInt where SymInts."""
    if not isinstance(expr, sympy.Expr) or expr.is_Integer:
        return int(expr)
    from torch.utils._sympy.functions import FloorDiv
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    if is_quotient(expr):
        # a quotient of sizes (engine.shapes.united_sizes), exact: an integer division
        expr = FloorDiv(*sympy.fraction(sympy.cancel(expr)))

    result = sympy_interp(PythonReferenceAnalysis, {s: leaf(s) for s in expr.free_symbols}, expr)
    return result.node if isinstance(result, fx.Proxy) else result


def _plain_symbol(d) -> bool:
    """A SymInt that is a symbol, its own and not another's by replacement."""
    return (isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol)
            and getattr(d.node, "_expr", d.node.expr) == d.node.expr)


def free_symbols(values) -> list[sympy.Symbol]:
    """The symbols in the sizes and strides of `values` (fake tensors and SymInts), by name."""
    found: set[sympy.Symbol] = set()
    for val in values:
        dims = [val] if isinstance(val, torch.SymInt) else \
            [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else []
        for d in dims:
            if isinstance(d, torch.SymInt):
                found |= d.node.expr.free_symbols
    return sorted(found, key=str)

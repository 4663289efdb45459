"""A readable text form of the IR, and the few lines around a node for errors."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ir import Graph, Node


def format_node(node: "Node") -> str:
    outs = ", ".join(f"%{o.name}: {o.type_str}" for o in node.outputs)
    ins = ", ".join("_" if v is None else f"%{v.name}" for v in node.inputs)
    attrs = ", ".join(f"{k}={_short(v)}" for k, v in sorted(node.attrs.items()))
    text = f"{outs} = {node.op}({ins})"
    if attrs:
        text += f" {{{attrs}}}"
    if node.name:
        text += f"  # {node.name}"
    return text


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def format_graph(graph: "Graph", indent: str = "") -> str:
    lines = [f"{indent}graph {graph.name}("
             + ", ".join(f"%{v.name}: {v.type_str}" for v in graph.inputs) + ")"]
    if graph.initializers:
        lines.append(f"{indent}  weights: " + ", ".join(
            f"%{v.name}: {v.type_str}" for v in graph.initializers))
    for node in graph.nodes:
        lines.append(f"{indent}  {format_node(node)}")
        for key, sub in node.subgraphs.items():
            lines.append(f"{indent}    [{key}]")
            lines.append(format_graph(sub, indent + "    "))
    lines.append(f"{indent}  return " + ", ".join(f"%{v.name}" for v in graph.outputs))
    return "\n".join(lines)


def node_context(graph: "Graph", index: int, radius: int = 2) -> str:
    """The node at `index` with `radius` nodes either side, the offending one marked."""
    lo, hi = max(0, index - radius), min(len(graph.nodes), index + radius + 1)
    return "\n".join(
        f"{'>>' if i == index else '  '} #{i:<5} {format_node(graph.nodes[i])}" for i in range(lo, hi))

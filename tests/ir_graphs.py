"""IR graphs for engine tests (no ONNX, no torch), built with engine.testing's GraphBuilder."""
from __future__ import annotations

from engine.ir import Graph
from engine.testing.graphs import GraphBuilder

__all__ = ["CHUNK_HEAD_RULE", "GraphBuilder", "gelu_training_graph"]

# A chunk rule for the tests' small heads: the rows of `h` in `count` slices (`.format(count=4)`),
# its chunk action at chunk_head.rule:9:5.
CHUNK_HEAD_RULE = """use std.ops

rule chunk_head {{
  match {{
    logits = MatMul(h, w)
    require bytes(logits) >= 4 * bytes(h)
  }}
  rewrite {{
    chunk over h along 0 into {count}
  }}
}}
"""


def gelu_training_graph(shape=("batch", 1024), examples=None, with_view: bool = True) -> Graph:
    """x -> MatMul -> Gelu -> [Reshape] -> MatMul -> loss, with the backward reading the
    GELU output through the view (its weight gradient) and the GELU input (its own gradient)."""
    b = GraphBuilder(examples if examples is not None else {"batch": 512})
    x = b.input("x", shape=shape)
    w1 = b.input("w1", shape=(1024, 1024), weight=True)
    w2 = b.input("w2", shape=(1024, 1024), weight=True)
    h = b.op("MatMul", [x, w1], name="h")
    a = b.op("Gelu", [h], name="a")
    av = b.op("Reshape", [a, None], name="av") if with_view else a
    y = b.op("MatMul", [av, w2], name="y")
    loss = b.op("ReduceSum", [y], shape=(), name="loss")
    g = b.op("Expand", [loss], shape=shape, name="g")                 # backward starts here
    dw2 = b.op("MatMul", [b.op("Transpose", [av], name="avt"), g], shape=(1024, 1024), name="dw2")
    ga = b.op("MatMul", [g, w2], name="ga")
    dh = b.op("Mul", [ga, b.op("Erf", [h], name="dgelu")], name="dh")
    dw1 = b.op("MatMul", [b.op("Transpose", [x], name="xt"), dh], shape=(1024, 1024), name="dw1")
    return b.graph([loss, dw1, dw2])

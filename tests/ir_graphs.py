"""Build IR graphs by hand for engine tests (no ONNX, no torch)."""
from __future__ import annotations

from engine.dtypes import DType
from engine.ir import Graph, Node, Value
from engine.shapes import as_dim


class GraphBuilder:
    def __init__(self, examples: dict[str, int] | None = None):
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.weights: list[Value] = []
        self.examples = examples or {}
        self.count = 0

    def input(self, name: str, dtype: str = "float32", shape=(1024, 1024), weight: bool = False) -> Value:
        v = Value(name, DType.from_name(dtype), tuple(as_dim(d) for d in shape),
                  is_input=not weight, is_initializer=weight)
        (self.weights if weight else self.inputs).append(v)
        return v

    def op(self, op: str, inputs, dtype: str | None = None, shape=None, outputs: int = 1,
           name: str | None = None, **attrs) -> Value | list[Value]:
        self.count += 1
        first = next((v for v in inputs if v is not None), None)
        dt = DType.from_name(dtype) if dtype else (first.dtype if first else DType.FLOAT32)
        sh = tuple(as_dim(d) for d in shape) if shape is not None else (first.shape if first else ())
        base = name or f"{op.lower()}{self.count}"
        outs = [Value(base if k == 0 else f"{base}_{k}", dt, sh) for k in range(outputs)]
        self.nodes.append(Node(op, list(inputs), outs, attrs, f"n_{base}"))
        return outs[0] if outputs == 1 else outs

    def graph(self, outputs: list[Value], forward_outputs: list[str] | None = None) -> Graph:
        g = Graph(self.nodes, self.inputs, outputs, self.weights, dim_examples=dict(self.examples))
        if forward_outputs:
            g.forward_outputs = forward_outputs
        g.verify()
        return g


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

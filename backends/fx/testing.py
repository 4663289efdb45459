"""engine.testing's torch runner: a generated training graph as a torch module, compiled without
the rules against compiled with them.

The forward part of the IR graph becomes a module (each op as the torch function it stands
for; the backward is autograd's, not the IR's). Both runs go the way `backend="remat"` goes,
without Inductor's code generation: AOTAutograd traces the joint graph with Inductor's
decompositions, the min-cut partitioner splits it as Inductor calls it, and the forward and
backward graphs run eagerly; in the rewritten run remat's pass rewrites the joint graph first
(chunk regions as invoke_subgraph calls, recompute tags the partitioner honours). So what is
compared is what the rules did, in a fraction of a second per graph, not what Inductor's kernels
or its decompositions round differently from eager torch. (Against eager, a graph whose gradient
is zero in exact arithmetic, `sum(softmax(x))`'s, differs by all of its rounding noise, and a
float16 layer norm's weight gradient, summed in float32 by the decomposition and in float16 by
eager's kernel, by 3%: neither is the rules' doing, and the rewrite matched the rule-free
compile to the bit on every such graph a random Hypothesis profile drew.) The eager step still
runs first: where torch cannot run the graph at all, it is Unrunnable, not the rules' fault.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.ir import Node
from engine.patterns import RuleSet
from engine.testing.check import AppliedPlan, Run, Unrunnable
from engine.testing.graphs import TrainingGraph
from engine.testing.ops import INT64_MAX

from .importer import TORCH_DTYPES


def _hard_sigmoid(x, alpha: float, beta: float):
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def _cumsum(x, axis: int, exclusive: int, reverse: int):
    if reverse:
        x = x.flip(axis)
    y = torch.cumsum(x, axis)
    if exclusive:
        y = y - x
    return y.flip(axis) if reverse else y


def _reshape(x, target):
    dims = [x.shape[k] if d == 0 else d for k, d in enumerate(target)]
    return x.reshape(dims)


def _slice(x, start: int, end: int, axis: int):
    index = [slice(None)] * x.dim()
    index[axis] = slice(start, None if end == INT64_MAX else end)
    return x[tuple(index)]


def _reduce(fn: Callable):
    def reduce(x, axes, keepdims):
        dims = list(range(x.dim())) if axes is None else [a % max(x.dim(), 1) for a in axes]
        return fn(x, dims, keepdims)

    return reduce


def _unsqueeze(x, axes):
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


def _flatten(x, axis: int):
    axis = axis % (x.dim() + 1) if x.dim() else 0
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _gemm(a, b, c, trans_a, trans_b):
    y = (a.t() if trans_a else a) @ (b.t() if trans_b else b)
    return y if c is None else y + c


def _op(node: Node, args: list, ints: list) -> object:
    """What torch computes for one IR node: `args` are its inputs' tensors (or, for a Shape's
    value, the sizes), `ints` the integer constants among them."""
    a, op = node.attrs, node.op
    x = args[0] if args else None
    unary = {
        "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Softplus": F.softplus,
        "Softsign": F.softsign, "Mish": F.mish, "Erf": torch.erf, "Exp": torch.exp, "Log": torch.log,
        "Neg": torch.neg, "Abs": torch.abs, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal,
        "Sign": torch.sign, "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round,
        "Not": torch.logical_not, "HardSwish": F.hardswish, "Selu": F.selu, "Identity": lambda t: t,
    }
    binary = {
        "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
        "Max": torch.maximum, "Min": torch.minimum, "Equal": torch.eq, "Less": torch.lt,
        "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge, "And": torch.logical_and,
        "Or": torch.logical_or, "Xor": torch.logical_xor, "MatMul": torch.matmul,
    }
    if op in unary:
        return unary[op](x)
    if op in binary:
        return binary[op](args[0], args[1])
    if op == "Gelu":
        return F.gelu(x, approximate=a.get("approximate", "none"))
    if op == "LeakyRelu":
        return F.leaky_relu(x, a.get("alpha", 0.01))
    if op == "Elu":
        return F.elu(x, a.get("alpha", 1.0))
    if op == "Celu":
        return F.celu(x, a.get("alpha", 1.0))
    if op == "HardSigmoid":
        return _hard_sigmoid(x, a.get("alpha", 0.2), a.get("beta", 0.5))
    if op == "Where":
        return torch.where(args[0], args[1], args[2])
    if op == "Clip":
        return torch.clamp(x, args[1], args[2])
    if op == "Cast":
        return x.to(TORCH_DTYPES[a["to"]])
    if op == "CastLike":
        return x.to(args[1].dtype)
    if op == "Softmax":
        return torch.softmax(x, a.get("axis", -1))
    if op == "LogSoftmax":
        return torch.log_softmax(x, a.get("axis", -1))
    if op == "LayerNormalization":
        return F.layer_norm(x, x.shape[-1:], args[1], args[2] if len(args) > 2 else None, a.get("epsilon", 1e-5))
    if op == "Gemm":
        return _gemm(args[0], args[1], args[2] if len(args) > 2 else None, a.get("transA", 0), a.get("transB", 0))
    if op == "Transpose":
        return x.permute(a.get("perm") or list(range(x.dim()))[::-1])
    if op == "Reshape":
        return _reshape(x, args[1] if isinstance(args[1], tuple) else ints[1])
    if op == "Flatten":
        return _flatten(x, a.get("axis", 1))
    if op == "Unsqueeze":
        return _unsqueeze(x, ints[1])
    if op == "Squeeze":
        return x.squeeze(tuple(ints[1]))
    if op == "Expand":
        target = args[1] if isinstance(args[1], tuple) else tuple(ints[1])
        return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, target))
    if op == "Shape":
        return tuple(x.shape[a.get("start", 0):a.get("end", x.dim())])
    if op == "Split":
        return torch.split(x, x.shape[a.get("axis", 0)] // a["num_outputs"], a.get("axis", 0))
    if op == "Concat":
        return torch.cat(args, a["axis"])
    if op == "Slice":
        return _slice(x, ints[1][0], ints[2][0], ints[3][0])
    if op == "GatherND":        # batch_dims 0: the index's last dim holds tuples into the data's first dims
        return x[tuple(args[1].unbind(-1))]
    if op == "ScatterND":       # reduction add or none, as the gradient of GatherND writes it
        return x.index_put(tuple(args[1].unbind(-1)), args[2], accumulate=a.get("reduction", "none") == "add")
    if op == "CumSum":
        return _cumsum(x, ints[1][0], a.get("exclusive", 0), a.get("reverse", 0))
    reductions = {"ReduceSum": lambda t, d, k: torch.sum(t, d, keepdim=bool(k)),
                  "ReduceMean": lambda t, d, k: torch.mean(t, d, keepdim=bool(k)),
                  "ReduceMax": lambda t, d, k: torch.amax(t, d, keepdim=bool(k)),
                  "ReduceMin": lambda t, d, k: torch.amin(t, d, keepdim=bool(k))}
    if op in reductions:
        return _reduce(reductions[op])(x, ints[1] if len(args) > 1 else None, a.get("keepdims", 1))
    raise Unrunnable(f"fx: engine.testing cannot run {op} in torch")


class GraphModule(torch.nn.Module):
    """The forward part of a TrainingGraph: `params` are parameters, the other inputs arguments,
    constants buffers; returns the loss."""

    def __init__(self, tg: TrainingGraph):
        super().__init__()
        graph = tg.graph
        self.nodes = graph.nodes[:tg.forward_nodes]
        self.loss_name = tg.loss.name
        self.param_names = [n for n in tg.params]
        self.input_names = [v.name for v in graph.inputs if v.name not in tg.params]
        self.weights = torch.nn.ParameterDict(
            {_key(n): torch.nn.Parameter(torch.from_numpy(np.array(tg.feeds[n]))) for n in self.param_names})
        self.constants: dict[str, torch.Tensor] = {}
        for v in graph.initializers:
            self.register_buffer(_key(v.name), torch.from_numpy(np.array(v.data)), persistent=False)
            self.constants[v.name] = v
        self.ints = {v.name: v.ints for v in graph.initializers if v.ints is not None}

    def forward(self, *inputs):
        env: dict[str, object] = dict(zip(self.input_names, inputs))
        env.update({n: self.weights[_key(n)] for n in self.param_names})
        env.update({n: getattr(self, _key(n)) for n in self.constants})
        for node in self.nodes:
            args = [env[v.name] if v is not None else None for v in node.inputs]
            ints = [v.ints if v is not None else None for v in node.inputs]
            out = _op(node, args, ints)
            outs = list(out) if isinstance(out, (list, tuple)) and node.op != "Shape" else [out]
            for value, result in zip(node.outputs, outs):
                env[value.name] = result
        return env[self.loss_name]


def _key(name: str) -> str:
    return "v_" + "".join(c if c.isalnum() else "_" for c in name)


def _step(module: GraphModule, fn, inputs: list[torch.Tensor]) -> dict[str, np.ndarray]:
    for p in module.parameters():
        p.grad = None
    loss = fn(*inputs)
    loss.backward()
    out = {"loss": _array(loss)}
    for name in module.param_names:
        grad = module.weights[_key(name)].grad
        if grad is not None:
            out[f"grad.{name}"] = _array(grad)
    return out


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return (t.float() if t.dtype is torch.bfloat16 else t).numpy().copy()


def remat_eager_backend(rules: RuleSet | None, tiers: Sequence[str] = (), config: str | None = None):
    """A torch.compile backend that rewrites as `backend="remat"` does (with `config`, or every
    plan the rules offer on the joint graph, compromises included) and runs the partitioned
    graphs eagerly: AOTAutograd with Inductor's decompositions, remat's pass on the joint graph,
    the min-cut partitioner as Inductor calls it. `.remat_pass` holds what the pass did. With
    `rules` None, the same path without remat's pass (`.remat_pass` None): the original."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from .compile import RematPass

    remat_pass = None
    if rules is not None:
        reports: list[str] = []
        remat_pass = RematPass(rules, config, tiers, reports.append, strict=True)
        remat_pass.reports = reports

    def partition(joint, joint_inputs, **kwargs):
        if remat_pass is None:
            return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        if config is None:   # every plan the rules offer on this joint graph, compromises included
            from .compile import plan_as_the_pass

            # Planned on the graph as the pass sees it (FxBuilder.start's copy, whose sizes are
            # read from the inputs): a size read of a value the backward takes from the imported
            # graph as given kept it saved, a plan the pass then could not find.
            planning = plan_as_the_pass(joint.graph, rules, tiers, strict=True)
            remat_pass.config = ",".join(p.config_string() for p in planning.plans) or None
        remat_pass(joint.graph)
        joint.recompile()
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)

    def eager(gm, example_inputs):
        return make_boxed_func(gm.forward)

    compiled = aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition,
                            decompositions=select_decomp_table())
    compiled.remat_pass = remat_pass
    return compiled


def reference(tg: TrainingGraph) -> dict[str, np.ndarray]:
    """The step's outputs compiled without the rules, as `run`'s original (engine.testing's second
    opinion runs the step widened to float64 here, and on nudged inputs: measured the way the
    original is, so the distance is rounding's, not eager's from the decomposition's)."""
    module = GraphModule(tg)
    inputs = [torch.from_numpy(np.array(tg.feeds[n])) for n in module.input_names]
    _mark_dynamic(tg, module, inputs)
    return _compiled_step(module, inputs, remat_eager_backend(None), tg)


def run(tg: TrainingGraph, rules: RuleSet, tiers: Sequence[str] = (), config: str | None = None) -> Run:
    """The outputs of the graph compiled without the rules (the original) and with them (with
    `config`, or every plan they offer). Unrunnable where torch cannot run or compile the graph."""
    module = GraphModule(tg)
    inputs = [torch.from_numpy(np.array(tg.feeds[n])) for n in module.input_names]
    try:
        _step(module, module, inputs)
        original = reference(tg)
    except Unrunnable:
        raise
    except Exception as exc:      # noqa: BLE001 - torch lacks a kernel (a dtype on the CPU): not the rules' fault
        raise Unrunnable(f"fx: the original graph does not run in torch: {type(exc).__name__}: {exc}") from None
    _mark_dynamic(tg, module, inputs)
    backend = remat_eager_backend(rules, tiers, config)
    rewritten = _compiled_step(module, inputs, backend, tg)
    remat_pass = backend.remat_pass
    applied = []
    for result in [*remat_pass.chunk_results, *remat_pass.results]:
        for plan in result.plans:
            if plan.applied:
                regions = plan.occurrences[:plan.applied]
                applied.append(AppliedPlan(plan.config_string(), sorted({r.match.rule.name for r in regions}),
                                           [r.match.root.name for r in regions]))
    return Run("fx", original, rewritten, applied, "\n\n".join(remat_pass.reports))


def _compiled_step(module: GraphModule, inputs: list[torch.Tensor], backend, tg: TrainingGraph) -> dict[str, np.ndarray]:
    torch._dynamo.reset()
    try:
        return _step(module, torch.compile(module, backend=backend, dynamic=bool(tg.dynamic) or None), inputs)
    finally:
        torch._dynamo.reset()


def _mark_dynamic(tg: TrainingGraph, module: GraphModule, inputs: list[torch.Tensor]) -> None:
    """The dims the graph keeps symbolic stay dynamic for dynamo, where it can keep them."""
    if not tg.dynamic:
        return
    by_name = {v.name: v for v in tg.graph.inputs}
    for name, tensor in zip(module.input_names, inputs):
        for axis, dim in enumerate(by_name[name].shape):
            if getattr(dim, "free_symbols", None) and {s.name for s in dim.free_symbols} & tg.dynamic:
                torch._dynamo.maybe_mark_dynamic(tensor, axis)

"""Export a torch module's training step (forward + backward) as one ONNX graph.

The step is traced with make_fx through torch.autograd.grad and with the core
ATen decompositions, then handed to torch.onnx's exporter. Decomposing first
matters: exporting `nll_loss_backward` as is gave weight gradients 128x too
large (docs/design.md, measured facts). `check_gradients` compares the exported graph with torch.

Graph inputs are the module's inputs then its parameters (named after them);
outputs are the loss then one gradient per parameter (`grad.<param>`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch._decomp import core_aten_decompositions
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from engine.errors import RematError

from .importer import DIM_EXAMPLES_KEY, FORWARD_OUTPUTS_KEY


@dataclass
class ExportedStep:
    model: onnx.ModelProto
    input_names: list[str]
    feeds: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]     # torch's loss and gradients for `feeds`


def _step_fn(module: torch.nn.Module, names: list[str], n_inputs: int):
    def step(*args):
        inputs, params = args[:n_inputs], args[n_inputs:]
        params = [p.requires_grad_(True) for p in params]
        loss = functional_call(module, dict(zip(names, params)), tuple(inputs))
        grads = torch.autograd.grad(loss, params)
        return (loss, *grads)

    return step


@dataclass
class TracedStep:
    """One training step traced to an ATen fx graph: inputs, then parameters, in; (loss, *grads) out."""

    graph: torch.fx.GraphModule
    step: Callable
    names: list[str]
    params: list[torch.Tensor]


def trace_training_step(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                        symbolic: bool = False) -> TracedStep:
    """Forward + backward of `module(*inputs) -> loss` through autograd.grad, with the core ATen
    decompositions (so no `nll_loss_backward` reaches the ONNX exporter; docs/design.md)."""
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone() for _, p in module.named_parameters()]
    step = _step_fn(module, names, len(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = make_fx(step, decomposition_table=core_aten_decompositions(),
                        tracing_mode="symbolic" if symbolic else "real")(*inputs, *params)
    return TracedStep(graph, step, names, params)


def _clean(name: str) -> str:
    return name.replace(".", "_")


def export_training_step(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                         input_names: list[str] | None = None,
                         dynamic_dims: dict[int, str] | None = None,
                         max_dims: dict[str, int] | None = None) -> ExportedStep:
    """Trace forward + backward of `module(*inputs)` (which returns the loss) into ONNX.

    `dynamic_dims` names input dims that stay symbolic (`{0: "batch", 1: "seq"}`, applied
    to every input of at least that rank); the example inputs' sizes become the model's
    example dim values, so savings print both as formulas and as bytes.
    """
    traced = trace_training_step(module, inputs, symbolic=bool(dynamic_dims))
    names, params, step = traced.names, traced.params, traced.step
    input_names = input_names or [f"input{i}" for i in range(len(inputs))]
    dim_examples: dict[str, int] = {}
    dynamic_shapes = None
    if dynamic_dims:
        limits = max_dims or {}
        dims = {name: torch.export.Dim(name, max=limits[name]) if name in limits else torch.export.Dim(name)
                for name in set(dynamic_dims.values())}
        specs = []
        for t in inputs:
            spec = {axis: dims[name] for axis, name in dynamic_dims.items() if axis < t.dim()}
            dim_examples.update({name: int(t.shape[axis]) for axis, name in dynamic_dims.items()
                                 if axis < t.dim()})
            specs.append(spec or None)
        dynamic_shapes = tuple(specs) + tuple(None for _ in params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            traced.graph, (*inputs, *params), dynamo=True, optimize=False, verbose=False,
            dynamic_shapes=dynamic_shapes,
            input_names=[*input_names, *(_clean(n) for n in names)],
            output_names=["loss", *(f"grad.{_clean(n)}" for n in names)])
    model = program.model_proto
    onnx.helper.set_model_props(model, {
        FORWARD_OUTPUTS_KEY: json.dumps(["loss"]),
        **({DIM_EXAMPLES_KEY: json.dumps(dim_examples)} if dim_examples else {}),
    })
    feeds = {n: t.detach().numpy() for n, t in zip([*input_names, *(_clean(n) for n in names)],
                                                   [*inputs, *params])}
    reference_out = step(*inputs, *[p.clone() for p in params])
    reference = {n: t.detach().numpy() for n, t in zip(
        ["loss", *(f"grad.{_clean(n)}" for n in names)], reference_out)}
    return ExportedStep(model, input_names, feeds, reference)


def save(exported: ExportedStep, path: str | Path) -> Path:
    path = Path(path)
    onnx.save(exported.model, str(path))
    np.savez(path.with_suffix(".inputs.npz"), **exported.feeds)
    return path


def check_gradients(exported: ExportedStep, outputs: dict[str, np.ndarray], rtol: float = 1e-4) -> float:
    """Largest error relative to each output's largest magnitude; raises if over `rtol`."""
    worst = 0.0
    for name, ref in exported.reference.items():
        got = outputs[name]
        err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-12))
        worst = max(worst, err)
        if err > rtol:
            raise RematError(f"exported training graph disagrees with torch on {name}: "
                             f"relative error {err:.3g} > {rtol}")
    return worst


def export_gpt(cfg, output: str | Path, dynamic: bool = False) -> tuple[Path, float]:
    """Export the GPT-like training step of docs/design.md, check its gradients against torch, save it."""
    from backends.models import gpt

    from .runtime import run

    model = gpt(cfg)
    exported = export_training_step(
        model, model.example_inputs(), ["idx", "targets"],
        dynamic_dims={0: "batch", 1: "seq"} if dynamic else None,
        max_dims={"seq": cfg.seq} if dynamic else None)
    error = check_gradients(exported, run(exported.model, exported.feeds))
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(exported, path), error

"""`remat export package.module:factory`: a user's module and example inputs as an ONNX training step.

The contract: `factory()` takes no arguments and returns `(module, example_inputs)`, a
`torch.nn.Module` and a tuple of tensors, such that `module(*example_inputs)` returns the loss, a
scalar floating-point tensor that depends on the module's parameters (alone, last in a tuple as
nanoGPT's `(logits, loss)`, or a mapping's `loss` as a transformers ModelOutput). The step is
exported by backends.onnx.torch_export (forward and backward in one graph: inputs, then parameters,
in; the loss, the tensors returned beside it, then one gradient per parameter, out) and checked
against torch before it is written.

Each way the contract can be broken is one clear error (RematError), never a traceback.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import RematError

from .exporters import one_line

if TYPE_CHECKING:
    from .torch_export import Verification


@dataclass
class UserStep:
    entry: str
    module: object          # torch.nn.Module
    inputs: tuple


def load_factory(entry: str) -> UserStep:
    """Import `package.module:factory`, call it, and check what it returns."""
    import torch

    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")) \
            or not all(p.isidentifier() for p in attr.split(".")):
        raise RematError(f"{entry!r} is not an entry point: write package.module:factory")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())          # as `python -m` finds a module beside you
    try:
        target = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise RematError(f"{entry}: cannot import {module_name} ({one_line(exc)})") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RematError(f"{entry}: {module_name} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise RematError(f"{entry}: {attr} is not callable; it must be a function that returns "
                         f"(module, example_inputs)")
    try:
        made = target()
    except Exception as exc:  # noqa: BLE001
        raise RematError(f"{entry}: the factory failed ({one_line(exc)})") from None
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise RematError(f"{entry}: the factory returned {type(made).__name__}, not (module, example_inputs)")
    module, inputs = made
    if not isinstance(module, torch.nn.Module):
        raise RematError(f"{entry}: the factory's module is a {type(module).__name__}, not a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise RematError(f"{entry}: the example inputs must be a tuple of tensors")
    return UserStep(entry, module, tuple(inputs))


def check_loss(step: UserStep) -> None:
    """`module(*inputs)` must give a loss (torch_export.loss_and_returned: a scalar floating-point
    tensor, alone, last in a tuple, or a mapping's `loss`) that depends on a parameter."""
    from .torch_export import loss_and_returned

    params = [p for p in step.module.parameters() if p.requires_grad]
    if not params:
        raise RematError(f"{step.entry}: the module has no parameters that require a gradient")
    try:
        out = step.module(*step.inputs)
    except Exception as exc:  # noqa: BLE001
        raise RematError(f"{step.entry}: module(*example_inputs) failed ({one_line(exc)})") from None
    loss, _ = loss_and_returned(out, f"{step.entry}: module(*example_inputs)")
    if not loss.requires_grad:
        raise RematError(f"{step.entry}: the loss does not depend on the module's parameters")


def parse_dynamic(items: list[str] | None) -> dict[int, str]:
    """`--dynamic AXIS=NAME` options: the input dims that stay symbolic."""
    dims: dict[int, str] = {}
    for item in items or []:
        axis, sep, name = (part.strip() for part in item.partition("="))
        if not sep or not axis.isdigit() or not name.isidentifier():
            raise RematError(f"--dynamic {item!r}: expected AXIS=NAME, like 0=batch")
        if dims.get(int(axis), name) != name:
            raise RematError(f"--dynamic: axis {axis} is named twice, {dims[int(axis)]} and {name}")
        dims[int(axis)] = name
    return dims


def export_entry(entry: str, output: str | Path, input_names: list[str] | None = None,
                 dynamic_dims: dict[int, str] | None = None, exporter: str = "make-fx") -> tuple[Path, Verification]:
    """Export the step of `package.module:factory` to `output` (and its inputs beside it, as
    OUTPUT.inputs.npz), its gradients checked against torch: the path and the check (torch_export.Verification)."""
    from .torch_export import export_checked

    step = load_factory(entry)
    check_loss(step)
    if input_names is not None and len(input_names) != len(step.inputs):
        raise RematError(f"--input-names gives {len(input_names)} name(s) for {len(step.inputs)} input(s)")
    return export_checked(step.module, step.inputs, output, input_names, dynamic_dims, exporter=exporter)



"""What a training step keeps for backward, seen through autograd's saved-tensor hooks.

Every tensor a compiled forward saves for its backward passes the pack hook, so this is
a direct check of what the partitioner decided to save, not an estimate.
"""
from __future__ import annotations

import torch


def training_step(model: torch.nn.Module, compiled, inputs=None) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Run `compiled(*inputs)` (by default `model.example_inputs()`) forward and backward:
    loss, gradients, bytes saved."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(*(model.example_inputs() if inputs is None else inputs))
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads, sum(saved)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want|: how the tests and benchmarks compare."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def tensor_peak(step) -> int:
    """Bytes of tensors alive at the highest point of `step()` above those alive when it starts,
    from the profiler's allocation events (CPU or CUDA): what a peak model of the step predicts,
    without the allocator's own overhead."""
    return max(tensor_bytes_over_time(step), default=0)


def tensor_bytes_over_time(step) -> list[int]:
    """Bytes of tensors alive after each allocation or free while `step()` runs, above those alive
    when it starts (the profiler's memory events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current, curve = 0, []
    for event in events:
        current += event.nbytes()
        curve.append(current)
    return curve

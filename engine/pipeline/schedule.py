"""Micro-batches in flight per device, from the schedule (not from the user).

A device holds each micro-batch's activations from its forward to its backward. The counts at
the moments they peak (right after a forward) are what its memory must hold:

- GPipe runs every forward, then every backward: each device holds all M micro-batches.
- 1F1B (torch.distributed.pipelining's Schedule1F1B, Megatron-LM's PipeDream-flush): stage i of
  P runs min(M, P - i) forwards before its first backward, then one backward and one forward in
  turn, so it holds min(M, P - i); the first stage P, the last one.
- Interleaved 1F1B with v virtual stages per device (Megatron-LM's interleaving paper, section
  2.2; torch's ScheduleInterleaved1F1B): device i runs (v - 1) * R + 2 * (P - 1 - i) warm-up
  forwards (R micro-batches per round: M // max(1, M // P)), cycling through its virtual stages
  R micro-batches at a time, then a forward and a backward in turn (backwards from its last
  virtual stage back). The op order is replayed here as torch builds it, and the count of each
  virtual stage's micro-batches in flight is taken after every forward; the first device holds
  the most (P + (P - 1) / v micro-batches' worth for even chunks, against P without interleaving).

A moment is one count per virtual stage on the device; the memory rows of the program are the
moments none of whose counts another moment's all reach.
"""
from __future__ import annotations

from .spec import PipelineSpec

Moment = tuple[int, ...]


def in_flight(spec: PipelineSpec) -> list[list[Moment]]:
    """For each device, its peak moments: micro-batches held per virtual stage (local index)."""
    return [moments(spec.schedule, spec.stages, spec.microbatches, spec.virtual_stages, d)
            for d in range(spec.stages)]


def moments(schedule: str, stages: int, microbatches: int, virtual: int, device: int) -> list[Moment]:
    if schedule == "gpipe":
        return [(microbatches,)]
    if schedule == "1f1b":
        return [(min(microbatches, stages - device),)]
    if schedule == "interleaved-1f1b":
        return _undominated(_interleaved_counts(stages, microbatches, virtual, device))
    raise ValueError(f"unknown schedule {schedule!r}")


def interleaved_order(stages: int, microbatches: int, virtual: int, device: int) -> list[tuple[str, int]]:
    """Device `device`'s compute ops in order, as (`F` or `B`, local virtual stage): torch's
    ScheduleInterleaved1F1B (schedules._get_warmup_ops, _get_1f1b_rank_ops), without its idle slots."""
    rounds = max(1, microbatches // stages)
    per_round = microbatches // rounds
    total = virtual * microbatches
    warmup = min((virtual - 1) * per_round + 2 * (stages - 1 - device), total)

    def forward_stage(step: int) -> int:
        return (step // per_round) % virtual

    def backward_stage(step: int) -> int:
        return virtual - 1 - ((step - warmup) // per_round) % virtual

    order = [("F", forward_stage(step)) for step in range(warmup)]
    for step in range(warmup, total):
        order += [("F", forward_stage(step)), ("B", backward_stage(step))]
    order += [("B", backward_stage(step)) for step in range(total, total + warmup)]
    return order


def _interleaved_counts(stages: int, microbatches: int, virtual: int, device: int) -> list[Moment]:
    held = [0] * virtual
    seen = []
    for kind, local in interleaved_order(stages, microbatches, virtual, device):
        held[local] += 1 if kind == "F" else -1
        if kind == "F":
            seen.append(tuple(held))
    return seen


def _undominated(counts: list[Moment]) -> list[Moment]:
    unique = sorted(set(counts), reverse=True)
    return [m for m in unique
            if not any(o != m and all(a >= b for a, b in zip(o, m)) for o in unique)]

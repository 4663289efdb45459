"""The GPT-like model (backends.models) cut into pipeline stages at given layer boundaries.

Stage s runs blocks [boundaries[s], boundaries[s + 1]); the first also embeds the tokens, the
last also applies the final layer norm and the head and returns the logits (the loss is the
schedule's `loss_fn`, as torch.distributed.pipelining computes it on the last stage). The stage
modules share the model's own parameters, so a stage's gradients are the model's, by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.models import GPT


class GPTStage(nn.Module):
    def __init__(self, model: GPT, first: int, end: int, is_first: bool, is_last: bool):
        super().__init__()
        self.first, self.end = first, end
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[first:end])
        if is_last:
            self.ln, self.head = model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) if self.is_last else x

    def model_names(self) -> dict[str, str]:
        """This stage's parameter names -> the whole model's."""
        out = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, index, rest = name.split(".", 2)
                out[name] = f"blocks.{self.first + int(index)}.{rest}"
            else:
                out[name] = name
        return out


def split(model: GPT, boundaries: list[int] | tuple[int, ...]) -> list[GPTStage]:
    """The stages that start at each of `boundaries` (the first is 0)."""
    layers = len(model.blocks)
    if not boundaries or boundaries[0] != 0 or list(boundaries) != sorted(set(boundaries)) \
            or boundaries[-1] >= layers:
        raise ValueError(f"stage boundaries {list(boundaries)}: expected increasing first layers from 0, "
                         f"each below {layers}")
    ends = [*boundaries[1:], layers]
    last = len(boundaries) - 1
    return [GPTStage(model, a, b, s == 0, s == last) for s, (a, b) in enumerate(zip(boundaries, ends))]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last stage's output, one micro-batch at a time."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

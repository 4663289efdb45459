"""Small torch models for the demo, the benchmarks and the tests.

`GPT` is the GPT-like model of docs/design.md: token and position embeddings, pre-norm
blocks with causal self-attention (written out, so the softmax is an op the
rules can see) and a GELU MLP, a final layer norm, and a linear head into
cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 512
    batch: int = 8
    # "explicit" writes attention out (softmax visible to the rules); "sdpa" calls
    # F.scaled_dot_product_attention, as GPU models do (flash / memory-efficient kernels).
    attention: str = "explicit"
    # Dropout on the attention probabilities and on each block's two residual branches (nanoGPT's
    # places), in training mode; 0 leaves no dropout in the graph.
    dropout: float = 0.0
    # The label shift of transformers before 4.46 and of many training scripts: the loss reads
    # logits[:, :-1] against targets[:, 1:] (the sequence sliced between the head and the loss).
    label_shift: bool = False
    # Cross-entropy on `logits.transpose(1, 2)`, the (N, C, L) form some training scripts write:
    # the tokens are two dims apart there, the batch first and the sequence last.
    ncl_loss: bool = False
    # nanoGPT's and transformers' return: the logits beside the loss, `(logits, loss)`. The logits
    # are then a graph output, and their gradient an incoming one added to the loss's.
    return_logits: bool = False


DEMO_CONFIG = GPTConfig(vocab=2048, d_model=128, layers=2, heads=4, seq=256, batch=8)
DESIGN_CONFIG = GPTConfig()


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attention: str = "explicit", dropout: float = 0.0):
        super().__init__()
        if attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention must be 'explicit' or 'sdpa', not {attention!r}")
        self.heads = heads
        self.attention = attention
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / (d // h) ** 0.5)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(-1)) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, cfg.attention, cfg.dropout)
                                    for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        returned = logits
        if self.cfg.label_shift:
            logits, targets = logits[:, :-1].contiguous(), targets[:, 1:].contiguous()
        if self.cfg.ncl_loss:
            loss = F.cross_entropy(logits.transpose(1, 2), targets)
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return (returned, loss) if self.cfg.return_logits else loss

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (self.cfg.batch, self.cfg.seq)
        return (torch.randint(0, self.cfg.vocab, shape, generator=g),
                torch.randint(0, self.cfg.vocab, shape, generator=g))


class MLP(nn.Module):
    """A stack of linear layers with a chosen activation, ending in a mean-squared loss."""

    ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
                   "silu": F.silu}

    def __init__(self, widths: list[int], activation: str = "gelu"):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.activation = self.ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return F.mse_loss(x, target)


def gpt(cfg: GPTConfig = DEMO_CONFIG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)

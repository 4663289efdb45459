"""The torch side under test: every shipped rule fires on an ATen joint graph, and generated
modules compiled with backend="remat" give eager's loss and gradients."""
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from dsl.loader import load_rules  # noqa: E402

SMALL_RULES = Path(__file__).parent / "rules" / "small.rule"


class EveryRule(nn.Module):
    """Each branch leaves one kind of stashed value behind for one shipped rule."""

    def __init__(self, d: int = 128):
        super().__init__()
        self.norm = nn.LayerNorm(d)                          # recompute_norm
        self.qkv = nn.Linear(d, 3 * d)                      # recompute_layout (q, k, v views)
        self.fc = nn.Linear(d, 4 * d)                       # recompute_matmul (the GELU input)
        self.out = nn.Linear(4 * d, d)                      # recompute_activation (the GELU output)
        self.gate = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.mix = nn.Linear(d, d)                          # recompute_elementwise (sigmoid(u) * v)
        self.wide = nn.Linear(d, d)                         # compromise_widening_cast
        self.scale = nn.Parameter(torch.ones(d))            # recompute_cast (a gradient through fp16)
        self.attn = nn.Linear(d, 3 * d)                     # recompute_fused_attention (SDPA's kernel)
        self.dropped = nn.Linear(d, d)                      # recompute_dropout (its input, dropped out)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).split(d, dim=-1)
        att = (q @ k.transpose(-2, -1) / d ** 0.5).softmax(-1)   # recompute_softmax
        y = h + att @ v
        y = y + self.out(F.gelu(self.fc(y)))
        y = y + self.mix(torch.sigmoid(self.gate(y)) * self.value(y))
        y = y + self.wide(y.half().float())
        q2, k2, v2 = (z.view(b, t, 4, d // 4).transpose(1, 2) for z in self.attn(y).split(d, dim=-1))
        y = y + F.scaled_dot_product_attention(q2, k2, v2).transpose(1, 2).reshape(b, t, d)
        y = y + self.dropped(F.dropout(y, 0.1))
        narrow = (x * self.scale).half()                     # recompute_cast (kept for n * n's gradient)
        extra = (narrow * narrow).float().mean()
        return F.mse_loss(y, target) + extra

    def example_inputs(self):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(8, 256, 128, generator=g), torch.randn(8, 256, 128, generator=g))


def test_every_shipped_rule_fires_on_the_fx_side():
    model = EveryRule()
    planning = fx_backend.analyze(model, model.example_inputs(), tiers=["expensive"], show=False)
    fired = {rule for p in planning.plans for rule in p.rules}
    assert fired == {r.name for r in load_rules().rules if r.plan_type != 3}, sorted(fired)


@pytest.fixture
def no_compile_caches():
    """The pass must run (no cached graphs), and Inductor must round fp16 casts as eager does:
    without emulate_precision_casts plain torch.compile differs from eager by 6e-4 here. Random
    numbers are eager's (fallback_random), so a dropout drops what it drops in eager."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, emulate_precision_casts=True, fallback_random=True), \
            functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def _close(got, want, rtol=1e-4):
    return relative_error(got, want) <= rtol


def test_every_rule_compiled_matches_eager(no_compile_caches):
    model = EveryRule()
    torch.manual_seed(0)
    eager_loss, eager_grads, _ = training_step(model, model)
    planning = fx_backend.analyze(model, model.example_inputs(), tiers=["expensive"], show=False)
    every = ",".join(p.config_string() for p in planning.plans)
    remat = fx_backend.backend(tiers=["expensive"], config=every)
    torch.manual_seed(0)
    loss, grads, _ = training_step(model, torch.compile(model, backend=remat))
    errors = [relative_error(got, want) for got, want in zip([loss, *grads], [eager_loss, *eager_grads])]
    if max(errors) > 1e-4:
        # torch 2.11's Inductor rounds the fp16 round trip (`y.half().float()`) otherwise than eager
        # even under emulate_precision_casts: plain torch.compile is 4.5e-4 off eager here (torch
        # 2.13: 2.3e-5). Then remat is judged against plain Inductor, as the zoo judges its
        # low-precision variants: within 2x of its error on every tensor.
        torch._dynamo.reset()
        torch.manual_seed(0)
        base_loss, base_grads, _ = training_step(model, torch.compile(model))
        baseline = [relative_error(got, want) for got, want in zip([base_loss, *base_grads],
                                                                    [eager_loss, *eager_grads])]
        assert all(e <= max(1e-4, 2 * b) for e, b in zip(errors, baseline)), list(zip(errors, baseline))
    applied = {r for result in remat.remat_pass.results for p in result.plans if p.applied for r in p.rules}
    assert {"recompute_activation", "recompute_softmax", "recompute_norm", "recompute_dropout"} <= applied


class Generated(nn.Module):
    def __init__(self, width: int, depth: int, activation: str, attention: bool, d: int = 32):
        super().__init__()
        self.inp = nn.Linear(d, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, d)
        self.activation = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[activation]
        self.attention = attention

    def forward(self, x, target):
        h = self.inp(x)
        if self.attention:
            h = h + (h @ h.transpose(-2, -1) / h.shape[-1] ** 0.5).softmax(-1) @ h
        for layer in self.hidden:
            h = self.activation(layer(h))
        return F.mse_loss(self.head(h), target)


@settings(max_examples=3, deadline=None)
@given(width=st.sampled_from([64, 96]), depth=st.integers(1, 2),
       activation=st.sampled_from(["gelu", "relu", "tanh", "sigmoid"]), attention=st.booleans(),
       seq=st.sampled_from([64, 128]))
def test_generated_modules_compiled_with_remat_match_eager(width, depth, activation, attention, seq):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = Generated(width, depth, activation, attention)
    x, target = torch.randn(4, seq, 32), torch.randn(4, seq, 32)
    model.example_inputs = lambda: (x, target)
    eager_loss, eager_grads, _ = training_step(model, model)
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        remat = fx_backend.backend(SMALL_RULES, tiers=["expensive"])
        loss, grads, _ = training_step(model, torch.compile(model, backend=remat))
    assert _close(loss, eager_loss)
    assert all(_close(g, e) for g, e in zip(grads, eager_grads))
    assert sum(p.applied for r in remat.remat_pass.results for p in r.plans) > 0, "nothing was recomputed"

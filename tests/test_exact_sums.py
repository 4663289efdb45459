"""Chunk bodies count the sum of a broadcast value (backends/fx/exact_sums.py): label smoothing's
gradient summed over the vocabulary, which Inductor added up copy by copy in a chunk body."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.exact_sums import count_broadcast_sums  # noqa: E402

aten = torch.ops.aten


def _smoothing_gradient_sum(c, y, keepdim):
    # label smoothing's log-probability gradient: a per-row constant broadcast, plus the one-hot term
    return (c.expand(y.shape) + y).sum(1, keepdim=keepdim)


@pytest.mark.parametrize("tracing", ["real", "symbolic"])
@pytest.mark.parametrize("keepdim", [True, False])
def test_a_sum_of_a_broadcast_is_counted_and_equals_the_sum(tracing, keepdim):
    rows, vocab = 6, 8192
    c = torch.full((rows, 1), -0.1 / vocab / 3)
    y = torch.zeros(rows, vocab)
    y[torch.arange(rows), torch.arange(rows) * 7] = -0.9 / 3
    gm = make_fx(lambda c, y: _smoothing_gradient_sum(c, y, keepdim), tracing_mode=tracing)(c, y)
    assert count_broadcast_sums(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 1 and sums[0].args[0].target is not aten.add.Tensor    # y summed alone
    want = _smoothing_gradient_sum(c.double(), y.double(), keepdim)
    got = gm(c, y)
    assert got.shape == want.shape
    assert float(((got.double() - want).abs() / want.abs()).max()) < 1e-7


@pytest.mark.parametrize("case", ["varies", "both_broadcast"])
def test_a_sum_the_rewrite_would_change_is_left_alone(case):
    """Over a dim the broadcast value varies along; or with the other operand broadcast too
    (summing it alone would count it once, not n times)."""
    if case == "varies":
        c, y = torch.randn(6, 1), torch.randn(6, 32)
        fn = lambda c, y: (c.expand(6, 32) + y).sum(0)      # noqa: E731
    else:
        c, y = torch.randn(6, 1), torch.randn(6, 1)
        fn = lambda c, y: (c.expand(6, 32) + y).sum(1)      # noqa: E731
    gm = make_fx(fn)(c, y)
    assert count_broadcast_sums(gm.graph) == 0
    gm.recompile()
    torch.testing.assert_close(gm(c, y), fn(c, y))


def test_label_smoothing_in_the_loss_chunk_sums_rows_as_closely_as_eager(fresh_compiles):
    """Session 29's fuzz: a GPT with `label_smoothing=0.1` compiled `dynamic=True` had its final
    norm's weight gradient 1.04e-4 off eager (tolerance 1e-4; plain Inductor 1.5e-6): the chunk
    body summed the smoothing term's 8192 copies one by one, the same rounding in every row, which
    a gradient summed over the tokens adds up. Here the hidden state's gradient summed over the
    tokens was 1.7e-5 off float64, where eager's float32 is 1.2e-6."""
    torch.manual_seed(0)
    n, d, vocab = 512, 64, 8192      # logits of 16 MiB: the shipped loss chunk fires
    h0, w0, t = torch.randn(n, d), torch.randn(vocab, d) * 0.02, torch.randint(0, vocab, (n,))

    def loss(h, w):
        return F.cross_entropy(h @ w.T, t, label_smoothing=0.1)

    def hidden_gradient(fn, dtype):
        h = h0.to(dtype).clone().requires_grad_()
        fn(h, w0.to(dtype)).backward()
        return h.grad.double().sum(0)

    exact = hidden_gradient(loss, torch.float64)
    backend = fx_backend.backend(strict=True)
    remat = hidden_gradient(torch.compile(loss, backend=backend, dynamic=True), torch.float32)
    eager = hidden_gradient(loss, torch.float32)
    chunked = {r.match.rule.name for res in backend.remat_pass.chunk_results for r in res.chunks}
    assert chunked == {"chunk_linear_cross_entropy"}

    def error(g):
        return float((g - exact).abs().max() / exact.abs().max())

    assert error(remat) < 3 * error(eager)

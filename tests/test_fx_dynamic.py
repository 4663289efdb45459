"""Dynamic shapes on the fx backend (issue 15): `torch.compile(backend="remat", dynamic=True)` and
`mark_dynamic` compile the GPT-like model once for every sequence length, the recompute plans
(the dropout's replay among them) apply with their savings formulas over the symbols, and the
chunk plans, which the fx backend builds with static slice sizes only, are refused, not crashed,
and the user is told once; Dynamo's own switch to dynamic sizes at a second length is met the same way."""
import pytest

torch = pytest.importorskip("torch")

import sympy  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import GPTConfig, gpt  # noqa: E402

# Logits of 16 MiB at the first length, which chunk.rule's loss rule asks for.
CFG = GPTConfig(vocab=16384, d_model=64, layers=1, heads=4, seq=128, batch=4, dropout=0.1)
LENGTHS = (64, 96, 128)


def inputs_of(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    shape = (CFG.batch, length)
    return torch.randint(0, CFG.vocab, shape, generator=g), torch.randint(0, CFG.vocab, shape, generator=g)


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
def test_one_compile_serves_three_sequence_lengths(fresh_compiles, recwarn, how):
    model = gpt(CFG)
    remat = fx_backend.backend()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return remat(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=True if how == "dynamic" else None)
    counters.clear()
    compiles = []
    with inductor_config.patch(fallback_random=True):
        for length in LENGTHS:
            inputs = inputs_of(length)
            if how == "mark_dynamic":
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 1)
            torch.manual_seed(1)
            want_loss, want_grads, _ = training_step(model, model, inputs)
            torch.manual_seed(1)
            loss, grads, _ = training_step(model, compiled, inputs)
            assert relative_error(loss, want_loss) < 1e-4, length
            assert max(relative_error(g, w) for g, w in zip(grads, want_grads)) < 1e-4, length
            compiles.append(len(graphs))
    # Dynamo may hand the backend a frame twice while it first traces it; no length after the
    # first compiles again, and the remat pass ran on one joint graph.
    assert compiles[0] == compiles[-1] and counters["stats"]["unique_graphs"] == 1
    assert not remat.remat_pass.failures
    [result] = remat.remat_pass.results
    applied = [p for p in result.plans if p.applied]
    [dropout] = [p for p in applied if "Dropout+" in p.key]
    assert isinstance(dropout.saving(), sympy.Expr) and dropout.saving().free_symbols      # batch x seq²
    [chunking] = remat.remat_pass.chunk_results
    assert not chunking.chunks and remat.remat_pass.chunked == 0
    refused = [r.reason.message for r in chunking.planning.refusals
               if r.match.rule.name == "chunk_linear_cross_entropy"]
    assert refused and all("static sizes only" in m for m in refused)
    dynamic = [str(w.message) for w in recwarn if "sizes are dynamic" in str(w.message)]
    assert len(dynamic) == 1 and "chunk_linear_cross_entropy" in dynamic[0] and "dynamic=False" in dynamic[0]


def test_a_second_length_makes_dynamo_go_dynamic_and_the_user_is_told(fresh_compiles):
    """What training on batches padded to their longest sequence does: the first length compiles
    statically, chunked; at the second Dynamo recompiles with the length dynamic on its own
    (automatic dynamic shapes), where the chunk plans cannot be built: one warning says so and how
    to keep them."""
    import warnings

    model = gpt(CFG)
    remat = fx_backend.backend()
    compiled = torch.compile(model, backend=remat)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in LENGTHS[:2]:
            loss, grads, _ = training_step(model, compiled, inputs_of(length))
            want_loss, want_grads, _ = training_step(model, model, inputs_of(length))
    assert remat.remat_pass.chunked >= 1 and len(remat.remat_pass.results) == 2
    told = [str(w.message) for w in caught if "sizes are dynamic" in str(w.message)]
    assert len(told) == 1 and told[0].startswith("remat: chunk_linear_cross_entropy")


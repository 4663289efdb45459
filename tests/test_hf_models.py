"""A Hugging Face model (transformers' GPT-2, random weights, no download) through
`torch.compile(backend="remat")`: the loss and every gradient as eager's, with remat's plans applied.
bench/hf_models.py runs GPT-2, Llama, BERT and T5 through both paths and measures their peaks."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import hf_models  # noqa: E402

from backends.onnx.torch_export import relative_errors  # noqa: E402


def training_step(fn, module, inputs) -> dict[str, np.ndarray]:
    loss = fn(*inputs)
    loss.backward()
    out = {"loss": loss.detach().numpy(), **{n: p.grad.numpy().copy() for n, p in module.named_parameters()}}
    module.zero_grad(set_to_none=True)
    return out


@pytest.mark.vectorized_kernels      # transformers' GPT-2 as users compile it
def test_gpt2_through_backend_remat_matches_eager(fresh_compiles):
    # 2 layers, d 64; batch 4 x seq 128 tokens, so that the MLP's activations (512 KiB) pass the
    # shipped rules' size thresholds and remat rewrites the graph it compiles.
    module, inputs = hf_models.gpt2(vocab=1024, d=64, layers=2, heads=4, batch=4, seq=128)
    want = training_step(module, module, inputs)
    reports: list[str] = []
    compiled = torch.compile(module, backend="remat", options={"report": reports.append, "strict": True})
    got = training_step(compiled, module, inputs)
    assert reports, "remat's pass never ran"
    assert any("Applied 0 " not in r for r in reports), reports     # remat rewrote a graph
    errors = relative_errors(got, want)
    assert set(errors) == set(want)
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda kv: kv[1])


def backward_and_collect(model, out) -> dict:
    """A transformers ModelOutput's loss backpropagated, as the user's step does: its loss, its
    logits and the parameters' gradients, the gradients then cleared."""
    out.loss.backward()
    got = {"loss": out.loss.detach().numpy(), "logits": out.logits.detach().numpy(),
           **{n: p.grad.numpy().copy() for n, p in model.named_parameters()}}
    model.zero_grad(set_to_none=True)
    return got


def test_gpt2_on_batches_padded_to_their_longest_keeps_the_loss_chunk_once_the_length_goes_dynamic(
        fresh_compiles):
    """Fine-tuning as transformers' collators feed it: each batch padded to its longest sequence,
    the padding masked and its labels -100. At the second length Dynamo recompiles with the
    length dynamic (automatic dynamic shapes); the loss chunk is built there too, its slices of
    symbolic sizes (the mask's length is the ids' by Dynamo's replacement, the symbol the body
    must be given), and every length's loss, logits and gradients are eager's. The model itself is
    compiled and called by keyword, as users call it, its ModelOutput's loss backpropagated: the
    logits are a graph output beside the loss, and the loss chunk runs in two phases at the first
    length too, the logits leaving it whole. Its `loss_type` unset, as users build it:
    transformers' warning about it was a graph break between the LM head and the loss, and the
    loss chunk was lost (backends.fx.compile.skip_transformers_warnings)."""
    import sympy

    import backends.fx as fx_backend

    wrapped, (ids, labels) = hf_models.gpt2(vocab=16384, d=64, layers=1, heads=4, batch=2, seq=256)
    model = wrapped.model
    model.loss_type = None

    def step(fn, length):
        i, target = ids[:, :length], labels[:, :length].clone()
        mask = torch.ones_like(i)
        mask[1, length - 20:] = 0
        target[1, length - 20:] = -100
        return backward_and_collect(model, fn(input_ids=i, labels=target, attention_mask=mask))

    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat)
    for length in (256, 200, 181):
        errors = relative_errors(step(compiled, length), step(model, length))
        assert max(errors.values()) < 1e-4, (length, max(errors.items(), key=lambda kv: kv[1]))
    static, dynamic = remat.remat_pass.chunk_results
    [region] = dynamic.chunks
    [first] = static.chunks
    assert remat.remat_pass.chunked == 2 and first.extent is None and len(first.phases) == 2
    assert first.match.rule.name == region.match.rule.name == "chunk_linear_cross_entropy"
    assert isinstance(region.extent, sympy.Expr) and region.extent.free_symbols and len(region.phases) == 2

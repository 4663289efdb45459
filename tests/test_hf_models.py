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

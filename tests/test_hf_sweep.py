"""bench/hf_sweep.py's models: each architecture it sweeps builds from transformers' config (the
installed version's field names and defaults) with dropout off, runs a step, and has a float64
reference (Mixtral's experts too); and its one-line failures."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import hf_sweep  # noqa: E402


@pytest.mark.parametrize("name", list(hf_sweep.ARCHITECTURES))
def test_architecture_builds_with_dropout_off_and_steps(name):
    module, inputs = hf_sweep.build(name, 1, "eager")      # raises where a dropout is left on
    loss = module(*inputs)
    loss.backward()
    assert torch.isfinite(loss)
    assert module.model.config.vocab_size == hf_sweep.SIZE["vocab_size"]
    embedding = module.model.get_input_embeddings().weight
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0


def test_float64_reference_runs_mixture_of_experts():
    # transformers' default experts (torch._grouped_mm) have no float64 kernel; the reference's do.
    module, inputs = hf_sweep.build("mixtral", 1, "eager", reference=True)
    module = module.double()
    module(*inputs).backward()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)


def test_dropout_probabilities_set_to_zero_in_sub_configs():
    from transformers import AutoConfig

    # (transformers types MPT's attn_pdrop as an int)
    cfg = AutoConfig.for_model("mpt", attn_config={"attn_pdrop": 1}, resid_pdrop=0.2)
    hf_sweep._no_dropout(cfg)
    assert cfg.resid_pdrop == 0.0 and cfg.attn_config.attn_pdrop == 0


def test_cpp_compile_error_reads_as_the_compilers_first_error():
    text = ("C++ compile error\nCommand: g++ /tmp/x/ab.main.cpp -O3 -shared\nOutput:\n"
            "/tmp/x/ab.main.cpp: In function 'void kernel()':\n"
            "/tmp/x/ab.main.cpp:59:26: error: conflicting declaration 'auto v'\n"
            "/tmp/x/ab.main.cpp:60:1: error: later\n")
    assert hf_sweep._message(RuntimeError(text)) == "ab.main.cpp:59:26: error: conflicting declaration 'auto v'"
    assert hf_sweep._message(ValueError("one\n  line")) == "one line"

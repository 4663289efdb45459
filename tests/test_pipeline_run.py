"""The pipeline on torch: layer figures measured from the GPT-like model, and a step on two gloo
ranks (torch.distributed.pipelining, each stage compiled with backend="remat" and its own plan)
whose loss and gradients equal the single-process step."""
from __future__ import annotations

import socket
from dataclasses import asdict

import pytest

torch = pytest.importorskip("torch")

from backends.pipeline import pipeline_run  # noqa: E402
from backends.pipeline.measure import measured_spec  # noqa: E402
from backends.pipeline.run import PipelineRun, spawn  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.pipeline import evaluate, parse_spec  # noqa: E402

# Big enough that the rules fire (they skip values under 256 KiB), small enough to compile fast.
TINY = {"vocab": 64, "d_model": 32, "heads": 2, "seq": 256, "batch": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_match_the_single_process_step(tmp_path, monkeypatch):
    """Each rank compiles its stage with remat and a plan of its own: rank 0 recomputes its GELU
    and its attention probabilities, rank 1 its GELU only. The run is short: 2 layers, one
    warm-up step."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    configs = ("Gelu+Reshape+:1:1,MatMul+Reshape+Mul+Where+Softmax+:1:1", "Gelu+Reshape+:1:1")
    run = PipelineRun(model=dict(TINY, layers=2), microbatches=2, boundaries=(0, 1), schedule="1f1b",
                      mode="remat", configs=configs, tiers=("expensive",), warmup=1, steps=1)
    results = spawn(run, 2, tmp_path, port=_free_port())
    assert [r.layers for r in results] == [[0], [1]]
    assert all(r.grad_error <= 1e-4 for r in results), [r.grad_error for r in results]
    assert results[1].loss_error is not None and results[1].loss_error <= 1e-4
    # The plans are in effect: rank 0's forward keeps no attention probabilities, rank 1's does.
    probabilities = [[TINY["batch"], TINY["heads"], TINY["seq"], TINY["seq"]], "float32"]
    assert probabilities not in results[0].saved and probabilities in results[1].saved
    assert all(r.peak >= 0 and r.rest > 0 for r in results)


def test_layer_figures_are_measured_from_the_model():
    spec = parse_spec({"stages": 2, "microbatches": 2, "schedule": "1f1b", "memory_per_stage": "1GiB",
                       "model": {"name": "gpt", "layers": 3, **TINY, "tiers": ["expensive"], "optimizer": "adam"}})
    measured = measured_spec(spec)
    assert len(measured.layers) == 3
    middle = measured.layers[1]
    # A block holds its attention probabilities (batch x heads x seq x seq float32) and more.
    probabilities = TINY["batch"] * TINY["heads"] * TINY["seq"] ** 2 * 4
    assert middle.options[0].activation > probabilities
    assert middle.forward > 0 and middle.backward > 0
    # Options are Pareto points: each holds less and costs more than the one before.
    held = [o.activation for o in middle.options]
    extra = [o.extra for o in middle.options]
    assert len(held) >= 3 and held == sorted(held, reverse=True) and extra == sorted(extra)
    assert any("softmax" in o.name for o in middle.options)
    assert all(o.plans for o in middle.options[1:])
    # Adam keeps two copies of the weights besides the parameters and their gradients.
    assert middle.optimizer == pytest.approx(middle.weights)
    # The last layer ends the last stage: it holds the logits.
    assert measured.layers[-1].output == TINY["batch"] * TINY["seq"] * TINY["vocab"] * 4
    plan = evaluate(measured, [(0, 1), (1, 0), (1, 0)])
    run = pipeline_run(plan)
    assert run.boundaries == (0, 1) and run.configs[1] == ""
    assert run.configs[0] == ",".join(f"{k}:{t}:{n}" for k, t, n in measured.layers[0].options[1].plans)
    assert asdict(run)["estimates"][0] == pytest.approx(plan.stages[0].activation)


@pytest.mark.parametrize("model, needle", [
    ({"name": "resnet"}, "model.name: 'resnet' is not a model remat can measure"),
    ({"name": "gpt", "width": 3}, "model.width: not a size of the GPT-like model"),
    ({"name": "gpt", "d_model": 30, "heads": 4}, "model.d_model: 30 is not a multiple of model.heads 4"),
])
def test_a_model_spec_that_names_nothing_measurable(model, needle):
    spec = parse_spec({"stages": 2, "microbatches": 2, "memory_per_stage": 1, "model": model})
    with pytest.raises(ConfigError, match=None) as info:
        measured_spec(spec)
    assert needle in str(info.value)

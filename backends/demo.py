"""`remat demo` (what `make demo` runs): a small GPT-like training step, end to end.

Export the step to ONNX and check its gradients against torch, print the plan
table, rewrite with the shipped rules (expensive tier on; chunk regions as Loops), and measure both
graphs in ONNX Runtime, each in its own process, on the same inputs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx


def run_demo(workdir: str | Path) -> int:
    from backends.models import DEMO_CONFIG
    from backends.onnx.exporter import export_model
    from backends.onnx.importer import import_model
    from backends.onnx.runtime import max_relative_error, measure, run
    from backends.onnx.torch_export import export_gpt
    from backends.onnx.rewrite import apply_rules
    from dsl.loader import load_rules

    workdir = Path(workdir)
    cfg = DEMO_CONFIG
    print(f"== GPT-like model: vocab {cfg.vocab}, d {cfg.d_model}, {cfg.layers} layers, "
          f"{cfg.heads} heads, seq {cfg.seq}, batch {cfg.batch}")
    path, check = export_gpt(cfg, workdir / "gpt_step.onnx")
    print(f"exported the training step to {path}; {check.describe()}")
    graph = import_model(path)
    rules = load_rules()
    rewrite = apply_rules(graph, rules, tiers=["expensive"])
    print("\n== Plans (shipped rules, --tier expensive)\n")
    print(rewrite.report())
    out = workdir / "gpt_step.remat.onnx"
    onnx.save(export_model(rewrite.graph), str(out))
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    before, after = measure(path, feeds), measure(out, feeds)
    err, where = max_relative_error(run(out, feeds), run(path, feeds))
    print(f"\n== ONNX Runtime ({before.provider}, default session, arena off to measure)")
    print(f"{'graph':<24}{'peak above rest':>18}{'step':>12}")
    print(f"{'original':<24}{before.peak_mib:>14.1f} MiB{before.seconds * 1000:>9.1f} ms")
    print(f"{'remat':<24}{after.peak_mib:>14.1f} MiB{after.seconds * 1000:>9.1f} ms")
    print(f"peak ratio {after.peak_above_rest / before.peak_above_rest:.3f}; outputs (loss and every "
          f"gradient) equal within {err:.1e} relative (largest at {where or 'none'})")
    torch_err = torch_demo(cfg)
    return 0 if err <= 1e-4 and torch_err <= 1e-4 else 1


def torch_demo(cfg) -> float:
    """The same model through torch.compile: Inductor alone, and with the rules on the joint graph."""
    import torch

    import backends.fx as fx_backend
    from backends.fx.saved import relative_error, training_step
    from backends.models import gpt

    print("\n== torch.compile (Inductor on CPU), same model, same rules (--tier expensive)")

    model = gpt(cfg)
    _, eager, eager_saved = training_step(model, model)
    _, _, inductor_saved = training_step(model, torch.compile(model))
    torch._dynamo.reset()
    remat = fx_backend.backend(tiers=["expensive"])
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # Without caches, so the pass runs and its plans can be counted here (a cached graph is correct too).
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, grads, remat_saved = training_step(model, torch.compile(model, backend=remat))
    err = max(relative_error(g, e) for g, e in zip(grads, eager))
    applied = sum(p.applied for r in remat.remat_pass.results for p in r.plans)
    chunked = remat.remat_pass.chunked
    print(f"{'':30}{'saved for backward':>20}")
    print(f"{'eager':30}{eager_saved / 2**20:>16.1f} MiB")
    print(f"{'torch.compile':30}{inductor_saved / 2**20:>16.1f} MiB")
    print(f"{'torch.compile(backend=remat)':30}{remat_saved / 2**20:>16.1f} MiB   ({applied} regions recomputed, "
          f"{chunked} chunked)")
    print(f"gradients equal to eager within {err:.1e} relative")
    return err

"""The GPT-like training step of docs/design.md as an ONNX graph, in ONNX Runtime, before and after remat.

Exports the step (vocab 4096, batch 8, 4 layers, d 256, seq 512 by default), checks its gradients
against torch, and measures in one run, each graph in its own process (default session, arena off
to measure, one thread):

  * the original graph;
  * the original written back by remat with no rule applied (the ONNX Runtime scheduling pass alone);
  * the shipped rules, default tier, as `remat apply` runs them (chunk regions built as Loops,
    then recompute);
  * the shipped rules with `--tier expensive`;
  * the same with one rule's plans left out, for each rule that fired: what that family contributes
    (the loss's chunk plan is `MatMul+LogSoftmax+`, the attention's `MatMul+Softmax+`).

Prints a table, then the remat/original peak ratio last.

    python bench/onnx_gpt.py [--vocab 4096 --batch 8 --layers 4 --d-model 256 --seq 512] [--label-shift] [--ncl-loss]
        [--dynamic batch-seq|seq]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

# Benchmarks run remat strict: an internal error is raised, never hidden by a fallback.
os.environ.setdefault("REMAT_STRICT", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.models import GPTConfig  # noqa: E402
from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.runtime import max_relative_error, measure, run  # noqa: E402
from backends.onnx.torch_export import export_gpt  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from backends.onnx.rewrite import apply_rules  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("vocab", 4096), ("batch", 8), ("layers", 4), ("d-model", 256), ("heads", 4),
                          ("seq", 512)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--label-shift", action="store_true",
                    help="the loss reads logits[:, :-1] against targets[:, 1:] (transformers before 4.46)")
    ap.add_argument("--ncl-loss", action="store_true",
                    help="cross-entropy on logits.transpose(1, 2), the (N, C, L) form")
    ap.add_argument("--dynamic", choices=["batch-seq", "seq"],
                    help="export with symbolic batch and sequence dims, or the sequence alone")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads,
                    seq=args.seq, batch=args.batch, label_shift=args.label_shift, ncl_loss=args.ncl_loss)
    tmp = Path(tempfile.mkdtemp(prefix="remat-bench-"))
    path, grad_error = export_gpt(cfg, tmp / "gpt.onnx", {None: False, "batch-seq": True, "seq": "seq"}[args.dynamic])
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    reference = run(path, feeds)
    graph = import_model(path)
    rules = load_rules()
    print(f"GPT-like step: {cfg}; exported gradients vs torch: {grad_error.error:.1e} relative")

    rows = []

    def row(label: str, model, note: str = "") -> float:
        m = measure(model, feeds, repeats=args.repeats)
        err = max_relative_error(run(model, feeds), reference)[0] if model is not path else 0.0
        rows.append((label, m, err, note))
        return m.peak_above_rest

    base = row("original", path)
    row("remat writer, no rules", export_model(graph))
    def regions(rewrite) -> str:
        return f"{sum(p.applied for p in rewrite.result.plans)} recomputed, {rewrite.chunked} chunked"

    default = apply_rules(graph, rules)
    row("remat, default tier", export_model(default.graph), regions(default))
    full = apply_rules(graph, rules, tiers=["expensive"])
    full_peak = row("remat --tier expensive", export_model(full.graph), regions(full))
    plans = [p for p in full.result.plans if p.applied]
    plans += [p for p in (full.chunk_result.plans if full.chunk_result else []) if p.applied]
    fired = sorted({rule for p in plans for rule in p.rules})
    for rule in fired:
        keep = [p.config_string() for p in plans if rule not in p.rules]
        ablated = apply_rules(graph, rules, config=",".join(keep), tiers=["expensive"])
        peak = row(f"  without {rule}", export_model(ablated.graph))
        rows[-1] = (*rows[-1][:3], f"{rule} saves {(peak - full_peak) / 2**20:+.1f} MiB")
    print(f"\n{'configuration':36}{'peak MiB':>10}{'vs original':>13}{'step s':>9}{'max rel err':>13}  note")
    for label, m, err, note in rows:
        print(f"{label:36}{m.peak_mib:>10.1f}{m.peak_above_rest / base:>13.3f}{m.seconds:>9.3f}{err:>13.1e}  {note}")
    out = tmp / "gpt.remat.onnx"
    onnx.save(export_model(full.graph), str(out))
    print(f"\nmodels in {tmp}; the same from the command line:\n"
          f"  remat export-gpt -o gpt.onnx && remat apply gpt.onnx -o gpt.remat.onnx --tier expensive\n"
          f"  remat measure gpt.onnx --compare gpt.remat.onnx")
    print("remat --tier expensive / original peak:")
    print(f"{full_peak / base:.3f}")


if __name__ == "__main__":
    main()

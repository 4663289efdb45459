"""The peak-memory model against ONNX Runtime's measured peak, on the GPT-like training step.

For the GPT-like model at vocab 4096 (batch 8) and vocab 32768 (batch 4), three graphs each:
the exported original, `remat apply` (default tier) and `remat apply --tier expensive`. For each:

  * `schedule est`: `engine.analysis.estimate_peak`, the liveness of the graph in its schedule
    order with views aliased (what the plan table prints as `Estimated peak`);
  * `ORT est`: `backends.onnx.ort_order.estimated_ort_peak`, the graph as ONNX Runtime runs it
    (its rewrites, its depth-first order, its allocation planner and memory pattern);
  * `measured`: `backends.onnx.runtime.measure`, each graph in its own process (default session,
    CPU arena off, one thread; VmHWM above the resting RSS);

and the ratios estimate / measured. The last line is the worst `ORT est` ratio (furthest from 1).

    python bench/peak_model.py [--configs 4096:8 32768:4] [--out DIR] [--dynamic]

`--dynamic` exports the batch and sequence dims symbolic (`batch`, `seq`), with torch.onnx's
value_info for every value, as users' exports often are.

`--out DIR` keeps the exported models there and reuses them on the next run (export takes a
minute at vocab 32768).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Benchmarks run remat strict: an internal error is raised, never hidden by a fallback.
os.environ.setdefault("REMAT_STRICT", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.models import GPTConfig  # noqa: E402
from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.ort_order import estimated_ort_peak  # noqa: E402
from backends.onnx.rewrite import apply_rules  # noqa: E402
from backends.onnx.runtime import measure  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.analysis import estimate_peak  # noqa: E402

MIB = 2**20


def exported(vocab: int, batch: int, out: Path, dynamic: bool = False) -> Path:
    path = out / f"gpt_{'dyn_' if dynamic else ''}v{vocab}_b{batch}.onnx"
    if path.exists() and path.with_suffix(".inputs.npz").exists():
        return path
    from backends.onnx.torch_export import export_gpt

    export_gpt(GPTConfig(vocab=vocab, batch=batch), path, dynamic=dynamic)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["4096:8", "32768:4"], help="VOCAB:BATCH")
    ap.add_argument("--out", type=Path, default=None, help="keep (and reuse) the exported models here")
    ap.add_argument("--dynamic", action="store_true",
                    help="export with the batch and sequence dims symbolic (torch.onnx dynamic_shapes), "
                         "as users often export")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="remat-peak-"))
    out.mkdir(parents=True, exist_ok=True)
    rules = load_rules()
    rows = []
    for config in args.configs:
        vocab, batch = (int(x) for x in config.split(":"))
        path = exported(vocab, batch, out, args.dynamic)
        feeds = dict(np.load(path.with_suffix(".inputs.npz")))
        graph = import_model(path)
        cases = [("original", graph, path)]
        for label, tiers in (("remat apply", ()), ("remat apply --tier expensive", ("expensive",))):
            rewrite = apply_rules(graph, rules, tiers=tiers)
            cases.append((label, rewrite.graph, export_model(rewrite.graph)))
        for label, ir, model in cases:
            started = time.perf_counter()
            ort = estimated_ort_peak(model if label == "original" else ir)
            seconds = time.perf_counter() - started
            schedule = estimate_peak(ir, rules.views)
            measured = measure(model, feeds, repeats=1)
            rows.append((f"vocab {vocab}, batch {batch}{' dyn' if args.dynamic else ''}", label, schedule.peak_bytes, ort.peak_bytes,
                         measured.peak_above_rest, seconds, ort))
            print(f"  {rows[-1][0]}, {label}: ORT est {ort.peak_bytes / MIB:.1f} MiB, measured "
                  f"{measured.peak_above_rest / MIB:.1f} MiB", flush=True)
    print(f"\n{'model':26}{'graph':30}{'schedule est':>14}{'ORT est':>10}{'measured':>10}"
          f"{'sched/meas':>12}{'ORT/meas':>10}{'est s':>7}  peak at (ORT est)")
    worst = 1.0
    for model, label, schedule, ort_bytes, measured, seconds, ort in rows:
        ratio = ort_bytes / measured
        worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
        node = ort.peak_node
        where = f"{node.op} {node.name}" if node is not None else "-"
        print(f"{model:26}{label:30}{schedule / MIB:>14.1f}{ort_bytes / MIB:>10.1f}{measured / MIB:>10.1f}"
              f"{schedule / measured:>12.3f}{ratio:>10.3f}{seconds:>7.2f}  {where}")
    print(f"\nmodels in {out}; MiB above the resting RSS; estimates at the models' example dims")
    print("worst ORT est / measured peak ratio:")
    print(f"{worst:.3f}")


if __name__ == "__main__":
    main()

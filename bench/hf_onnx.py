"""transformers' causal LM architectures (bench/hf_sweep.py's 36) through remat's ONNX path.

Each architecture is built as bench/hf_sweep.py builds it (from its config, random weights, small:
vocab 4096, hidden 128, 2 layers, seq 256, batch 4, so that the logits are the loss chunk's 16 MiB;
eager attention, dropout off) and its training step goes through what `remat export`, `remat
apply` and `remat measure --compare` run (bench/hf_models.py's `onnx_rows`): exported to ONNX
(`--exporter`, make-fx by default), checked against torch, rewritten with the shipped rules
(`--tiers`, default tier by default), and both graphs run in ONNX Runtime. Mixture-of-experts
layers run transformers' `experts_implementation="batched_mm"`, the one that exports. Each architecture runs
in its own process with a time limit: one that fails to export, rewrite or run is one line, and
the others still run.

Columns: the loss's and the largest gradient's relative error of the rewritten graph against
torch (a row over 1e-4 judged again in float64, as hf_models.py does), ONNX Runtime's measured peak
above rest of the original and of the rewrite (VmHWM), their ratio, the rewrite's step time over the
original's (the median of five steps after a warm-up, in a process of its own), and the plans
applied. The last line: the failures by stage, the largest error, the ratios' ranges, and the
architectures where the rewrite saved less than a tenth of the original's peak.

    python bench/hf_onnx.py [--models gpt_neox mistral ...] [--exporter make-fx] [--tiers expensive]
                            [--budget 0.3] [--timeout 900]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import hf_models  # noqa: E402
from hf_models import MARK, child_env, fired_text, process_arguments, run_one  # noqa: E402
from hf_sweep import ARCHITECTURES, BATCH, build  # noqa: E402

SMALL_SAVING = 0.9      # a rewrite at more than this of the original's peak saved little
# Mixture-of-experts layers as transformers can export them: its default experts
# (torch._grouped_mm) have a fake kernel that demands bfloat16 on the CPU, and its eager loop
# routes by `nonzero`, which no static graph holds.
EXPERTS = "batched_mm"


def child(args) -> None:
    from backends.onnx.user_module import UserStep

    name, exporter = args.child.split(":")
    try:
        args.stage = "build"
        module, inputs = build(name, BATCH["fp32"], "eager", experts=EXPERTS)
        rows = hf_models.onnx_rows(name, UserStep(f"hf_sweep:{name}", module, inputs), exporter, args)
    except Exception as exc:  # noqa: BLE001 - the row's failure, in one line
        stage = f"{args.stage}: " if getattr(args, "stage", None) else ""
        print(MARK + json.dumps({"error": f"{stage}{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}))
        return
    print(MARK + json.dumps({"rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(ARCHITECTURES), default=list(ARCHITECTURES))
    ap.add_argument("--exporter", choices=hf_models.EXPORTERS, default="make-fx")
    ap.add_argument("--tiers", nargs="*", default=[], help="remat's tiers (default: the default tier)")
    ap.add_argument("--budget", help="plan for this budget (0.3: of the original's estimated peak; 400MiB), "
                                     "as `remat apply --budget` does, for this CPU")
    process_arguments(ap, 900, "architecture's process")
    args = ap.parse_args()
    env = child_env(args, "remat-hf-onnx-")
    if args.child:
        child(args)
        return
    print(f"Hugging Face causal LMs through ONNX Runtime (bench/hf_sweep.py's size, batch {BATCH['fp32']} fp32, "
          f"eager attention; exporter {args.exporter}; tiers {' '.join(args.tiers) or 'default'}"
          f"{f'; budget {args.budget}' if args.budget else ''}); errors "
          f"against torch; peak: MiB above rest (VmHWM); {args.threads} threads", flush=True)
    head = (f"{'model':13}{'loss err':>10}{'grad err':>10}{'f64 err':>10}{'original':>10}{'remat':>8}{'ratio':>7}"
            f"{'time':>7}  plans applied")
    print(head)
    print("-" * len(head), flush=True)
    failed: dict[str, list[str]] = {}
    ratios: dict[str, float] = {}
    times: dict[str, float] = {}
    worst = 0.0
    for name in args.models:
        rows = run_one(f"{name}:{args.exporter}", args, env, __file__)
        if isinstance(rows, str):
            stage = rows.split(":")[0] if ":" in rows else "run"
            failed.setdefault(stage, []).append(name)
            print(f"{name:13}FAILED: {rows}", flush=True)
            continue
        original, remat = (next(r for r in rows if r["path"].endswith(f"/{label}")) for label in ("original", "remat"))
        ratio = remat["peak"] / original["peak"] if original["peak"] > 0 else None
        if ratio is not None:
            ratios[name] = ratio
        if original["seconds"] > 0:
            times[name] = remat["seconds"] / original["seconds"]
        f64 = remat.get("f64_err")
        worst = max(worst, f64 if f64 is not None else max(remat["loss_err"], remat["grad_err"]))
        errs = "".join(f"{e:>10.1e}" if e is not None else f"{'-':>10}" for e in (remat["loss_err"], remat["grad_err"], f64))
        print(f"{name:13}{errs}{original['peak']:>10.1f}{remat['peak']:>8.1f}"
              f"{(f'{ratio:.3f}' if ratio is not None else '-'):>7}"
              f"{(f'{times[name]:.2f}' if name in times else '-'):>7}  {fired_text(remat['fired'])}", flush=True)
    little = [n for n, r in ratios.items() if r > SMALL_SAVING]
    failures = "; ".join(f"{stage}: {', '.join(names)}" for stage, names in failed.items())
    spread = f"{min(ratios.values()):.3f}-{max(ratios.values()):.3f}" if ratios else "-"
    slower = f"{min(times.values()):.2f}-{max(times.values()):.2f}" if times else "-"
    print(f"architectures {len(args.models)}; failed: {failures or 'none'}; "
          f"largest error {worst:.1e}; remat / original {spread} (peak), {slower} (step time); "
          f"under {1 - SMALL_SAVING:.0%} saved: {', '.join(little) or 'none'}")


if __name__ == "__main__":
    main()

"""The zoo's models (tests/zoo.py) through remat's ONNX path, exported as users often export them:
batch and sequence dims symbolic.

    python bench/zoo_onnx.py                        # the FIXED variants the exporters take
    python bench/zoo_onnx.py --random 8 --seed 2525 # and 8 random mixes
    python bench/zoo_onnx.py --static               # example sizes only
    python bench/zoo_onnx.py --only issue_gpt_scores_div_float_z_loss --random 0

Each variant runs in its own process with a time limit: exported (make-fx, `--dynamic` dims:
batch and seq for the token models, at 3 x 448 tokens, shorter than their masks, batch for the
others), `remat apply` at the default tier
and at `--tier expensive`, each graph run in ONNX Runtime (the rewrites' outputs against the
original's, relative error of the worst output) and its peak estimated (backends.onnx.ort_order)
and measured (backends.onnx.runtime.measure). The exporters take fp32 steps without dropout,
graph breaks or checkpointing that return the loss; other variants are left out. Columns:
variant, graph, chunk regions built, worst error, estimated and measured MiB above rest, their
ratio. Failures follow the table with their last frames. Last line: the worst ratio.
`--budget F`: also the planner's rewrite (expensive tier) at F x the original's measured peak,
and the largest measured peak / budget over the variants.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("REMAT_STRICT", "1")

MARK = "ZOO-ONNX "
MIB = 2**20
SHORTER = 448       # the example sequence of a dynamic export of the token models


def exportable(variant) -> bool:
    return (variant.precision == "fp32" and not variant.dropout and not variant.graph_break
            and not variant.checkpoint and variant.returns == "loss" and not variant.dynamic)


def child(spec: dict, static: bool, budget: float | None = None) -> dict:
    import torch

    import zoo
    from backends.onnx.exporter import export_model
    from backends.onnx.importer import import_model
    from backends.onnx.ort_order import estimated_ort_peak
    from backends.onnx.rewrite import apply_rules
    from backends.onnx.runtime import max_relative_error, measure, run
    from backends.onnx.torch_export import export_training_step
    from dsl.loader import load_rules

    spec["tiers"] = tuple(spec["tiers"])
    variant = zoo.Variant(**spec)
    model, inputs = zoo.build(variant)
    tokens = variant.model in ("gpt", "torch_transformer")
    if tokens and not static:
        # Examples shorter than the zoo's masks and rotary tables (SEQ long): at exactly their
        # length torch.export makes the sequence static, and the export is refused. Three
        # sequences keep the scores over the attention rule's 16 MiB.
        pairs = zip(zoo.make_inputs(variant, 0, seq=SHORTER), zoo.make_inputs(variant, 1, seq=SHORTER))
        inputs = tuple(torch.cat([a, b])[:3] for a, b in pairs)
    names = ["idx", "targets"] if tokens else ["x", "y"]
    dynamic = None if static else ({0: "batch", 1: "seq"} if tokens else {0: "batch"})
    exported = export_training_step(model, inputs, names, dynamic_dims=dynamic,
                                    max_dims={"seq": zoo.SEQ} if dynamic and tokens else None)
    feeds = exported.feeds
    original = run(exported.model, feeds)
    graph = import_model(exported.model)
    rows = [{"graph": "original", "chunked": "-", "error": 0.0,
             "estimate": estimated_ort_peak(exported.model).peak_bytes,
             "measured": measure(exported.model, feeds, repeats=1).peak_above_rest}]
    rules = load_rules()

    def rewritten(label: str, rewrite, **extra) -> dict:
        """A rewrite's row: run against the original, its peak estimated and measured."""
        written = export_model(rewrite.graph)
        return {"graph": label, "chunked": rewrite.chunked,
                "error": max_relative_error(run(written, feeds), original)[0],
                "estimate": estimated_ort_peak(rewrite.graph).peak_bytes,
                "measured": measure(written, feeds, repeats=1).peak_above_rest, **extra}

    for label, tiers in (("default", ()), ("expensive", ("expensive",))):
        rows.append(rewritten(label, apply_rules(graph, rules, tiers=tiers)))
    if budget is not None:
        # The planner at `budget` x the original's measured peak, over the expensive tier.
        from backends.device import profile_for
        from engine.budget import BudgetError

        limit = int(budget * rows[0]["measured"])
        try:
            rewrite = apply_rules(graph, rules, tiers=("expensive",), budget=limit, device=profile_for("cpu"))
        except BudgetError as err:
            rows.append({"graph": f"{budget:g}x", "chunked": "-", "error": 0.0, "estimate": None,
                         "measured": 0, "budget": limit, "unreachable": err.lowest})
        else:
            rows.append(rewritten(f"{budget:g}x", rewrite, budget=limit))
    return {"name": variant.name, "rows": rows}


def run_one(variant, static: bool, timeout: float, budget: float | None = None) -> dict:
    spec = dataclasses.asdict(variant)
    command = [sys.executable, __file__, "--child"] + (["--static"] if static else []) \
        + ([f"--budget={budget}"] if budget is not None else [])
    try:
        proc = subprocess.run(command, input=json.dumps(spec), text=True, capture_output=True,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": variant.name, "failure": f"stopped after its time limit, {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        return {"name": variant.name, "failure": "\n".join(proc.stderr.strip().splitlines()[-8:])}
    return json.loads(lines[-1][len(MARK):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", type=int, default=0, metavar="N", help="also N random switch mixes")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random mixes")
    ap.add_argument("--static", action="store_true", help="export at the example sizes")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    ap.add_argument("--only", nargs="*", help="run only these FIXED variants")
    ap.add_argument("--budget", type=float, default=None, metavar="F",
                    help="also the planner's rewrite at F x the original's measured peak (expensive tier)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            print(MARK + json.dumps(child(json.loads(sys.stdin.read()), args.static, args.budget)), flush=True)
        except Exception as err:        # the parent prints it after the table
            traceback.print_exc()
            raise SystemExit(1) from err
        return
    import zoo

    variants = [v for v in zoo.FIXED if exportable(v) and (args.only is None or v.name in args.only)]
    rng = random.Random(args.seed)
    drawn = 0
    while drawn < args.random:
        variant = zoo.random_variant(rng, name=f"random_{args.seed}_{drawn}")
        if exportable(variant):
            variants.append(variant)
            drawn += 1
    results = []
    for variant in variants:
        results.append(run_one(variant, args.static, args.timeout, args.budget))
        print(f"# {variant.name}: {'failed' if 'failure' in results[-1] else 'done'}", flush=True)
    width = max([46] + [len(r["name"]) + 2 for r in results])
    print(f"\n{'variant':{width}}{'graph':11}{'chunks':>7}{'error':>10}{'est MiB':>10}{'meas MiB':>10}{'est/meas':>10}")
    worst, over = 1.0, 0.0
    for result in results:
        for row in result.get("rows", ()):
            if "unreachable" in row:
                print(f"{result['name']:{width}}{row['graph']:11}  budget {row['budget'] / MIB:.1f} MiB unreachable: "
                      f"lowest estimated {row['unreachable'] / MIB:.1f} MiB")
                continue
            if "budget" in row:
                over = max(over, row["measured"] / row["budget"])
            ratio = row["estimate"] / row["measured"] if row["estimate"] and row["measured"] else None
            if ratio is not None and abs(ratio - 1) > abs(worst - 1):
                worst = ratio
            estimate = f"{row['estimate'] / MIB:.1f}" if row["estimate"] else "-"
            ratio_text = "-" if ratio is None else f"{ratio:.3f}"
            print(f"{result['name']:{width}}{row['graph']:11}{row['chunked']!s:>7}{row['error']:>10.1e}"
                  f"{estimate:>10}{row['measured'] / MIB:>10.1f}{ratio_text:>10}")
    failed = [r for r in results if "failure" in r]
    for result in failed:
        print(f"\n{result['name']} failed:\n{result['failure']}")
    if args.budget is not None:
        print(f"\nlargest measured peak / budget at {args.budget:g}x: {over:.3f}")
    print(f"\n{len(results)} variants, {len(failed)} failed; worst estimate / measured ratio:")
    print(f"{worst:.3f}")


if __name__ == "__main__":
    main()

"""The budget planner against measured peaks, on both backends.

ONNX Runtime (GPT-like, vocab 4096, batch 8 by default): the original's peak is measured, then
`remat apply --budget` at 0.9x ... 0.4x of it; each rewritten graph's peak is measured in its
own process and printed beside its budget and the planner's estimate.

torch (`--torch`): bench/torch_step.py measures torch.compile and `activation_memory_budget=0.1`,
then runs remat with a budget equal to the latter's measured peak above rest, and with 0.9x ...
0.4x of torch.compile's, each in its own processes, the step times interleaved (`--rounds`);
each measured peak is printed beside its budget and the peak model's estimate.

    python bench/budget.py                 # ONNX sweep
    python bench/budget.py --torch         # and the torch path
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Benchmarks run remat strict: an internal error is raised, never hidden by a fallback.
os.environ.setdefault("REMAT_STRICT", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.device import profile_for  # noqa: E402
from backends.models import GPTConfig  # noqa: E402
from backends.onnx.exporter import export_model  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.ort_order import estimated_ort_peak  # noqa: E402
from backends.onnx.rewrite import apply_rules  # noqa: E402
from backends.onnx.runtime import max_relative_error, measure, run  # noqa: E402
from backends.onnx.torch_export import export_gpt  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.budget import BudgetError  # noqa: E402

FRACTIONS = (0.9, 0.75, 0.6, 0.5, 0.4)
MIB = 2 ** 20


def onnx_sweep(args) -> None:
    cfg = GPTConfig(vocab=args.vocab, batch=args.batch, layers=args.layers, d_model=args.d_model,
                    heads=args.heads, seq=args.seq)
    tmp = Path(tempfile.mkdtemp(prefix="remat-budget-"))
    path, _ = export_gpt(cfg, tmp / "gpt.onnx")
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    reference = run(path, feeds)
    graph = import_model(path)
    rules = load_rules()
    device = profile_for("cpu")
    original = measure(path, feeds, repeats=args.repeats)
    estimated = estimated_ort_peak(path).peak_bytes     # from the file, as ORT reads its shapes (bench/peak_model.py)
    print(f"ONNX Runtime, GPT-like {cfg}")
    print(f"original: measured {original.peak_mib:.1f} MiB above rest, estimated {estimated / MIB:.1f} MiB, "
          f"step {original.seconds:.3f} s")
    print(f"{'budget':>8} {'x meas.':>8} {'estimated':>10} {'measured':>9} {'meas/budget':>12} {'est/meas':>9} "
          f"{'step s':>7} {'/orig':>6} {'rel err':>8}  plans")
    last = None
    worst, monotone = 0.0, True
    for fraction in args.fractions:
        budget = int(fraction * original.peak_above_rest)
        try:
            rewrite = apply_rules(graph, rules, tiers=["expensive"], budget=budget, device=device)
        except BudgetError as err:
            print(f"{budget / MIB:>8.1f} {fraction:>8.2f}  unreachable: lowest estimated {err.lowest / MIB:.1f} MiB")
            continue
        model = export_model(rewrite.graph)
        m = measure(model, feeds, repeats=args.repeats)
        err = max_relative_error(run(model, feeds), reference)[0]
        sim = rewrite.simulated_peak
        ratio = m.peak_above_rest / budget
        worst = max(worst, ratio)
        if last is not None and m.peak_above_rest > last * 1.005:
            monotone = False
        last = m.peak_above_rest
        print(f"{budget / MIB:>8.1f} {fraction:>8.2f} {sim / MIB:>10.1f} {m.peak_mib:>9.1f} {ratio:>12.3f} "
              f"{sim / max(m.peak_above_rest, 1):>9.3f} {m.seconds:>7.3f} {m.seconds / original.seconds:>6.2f} "
              f"{err:>8.1e}  {len(rewrite.choice.selection)} chosen, {rewrite.chunked} chunked")
    print(f"measured peaks non-increasing as the budget falls: {monotone}")
    print("largest measured peak / budget:")
    print(f"{worst:.3f}")


def torch_sweep(args) -> None:
    common = [f"--vocab={args.vocab}", f"--batch={args.batch}", f"--layers={args.layers}",
              f"--d-model={args.d_model}", f"--heads={args.heads}", f"--seq={args.seq}",
              f"--repeats={args.repeats}", f"--device={args.device}", "--json"]
    step = [sys.executable, str(ROOT / "bench" / "torch_step.py"), *common]
    probe = subprocess.run(step + ["--configs", "compile", "budget-0.1"], capture_output=True, text=True,
                           cwd=ROOT, timeout=args.timeout)
    print(probe.stdout)
    rows = _step_rows(probe.stdout)
    if "compile" not in rows or "budget-0.1" not in rows:
        print(f"the probe failed:\n{probe.stderr[-2000:]}")
        return
    original, anchor = rows["compile"]["above"], rows["budget-0.1"]["above"]
    print(f"torch.compile peaks {original:.1f} MiB above rest; activation_memory_budget=0.1 {anchor:.1f} MiB: "
          f"remat gets that as its budget, then {', '.join(f'{f:g}' for f in args.fractions)}x compile's")
    budgets = {f"remat-budget-{anchor:.0f}MiB": anchor}
    budgets.update({f"remat-budget-{f * original:.0f}MiB": f * original for f in args.fractions})
    configs = ["eager", "compile", "budget-0.1", *budgets]
    # Streamed, line by line: a run stopped by a time limit still shows the rows it measured.
    sweep = subprocess.Popen(step + ["--rounds", str(args.rounds), "--configs", *configs], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
    lines = []
    for line in sweep.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    if sweep.wait():
        print(f"bench/torch_step.py exited with {sweep.returncode}")
    rows = _step_rows("".join(lines))
    # The planner's estimated extra time beside the measured one (the step's time less compile's):
    # whether its cost model ranks plans as the device runs them.
    print(f"{'budget':>8} {'x compile':>10} {'measured':>9} {'meas/budget':>12} {'estimated':>10} {'est/meas':>9} "
          f"{'step s':>7} {'/budget-0.1':>12} {'rel err':>8} {'extra ms est.':>14} {'meas.':>7}")
    worst, monotone, last = 0.0, True, None
    for name, budget in budgets.items():
        row = rows.get(name)
        if row is None:
            print(f"{budget:>8.1f}  failed")
            continue
        ratio = row["above"] / budget
        est = row["estimate"]
        print(f"{budget:>8.1f} {budget / original:>10.2f} {row['above']:>9.1f} {ratio:>12.3f} "
              f"{est if est is not None else float('nan'):>10.1f} "
              f"{(est or 0) / max(row['above'], 1e-9):>9.3f} {row['seconds']:>7.3f} "
              f"{row['seconds'] / rows['budget-0.1']['seconds'] if 'budget-0.1' in rows else float('nan'):>12.3f} "
              f"{row['error'] if row['error'] is not None else float('nan'):>8.1e} "
              f"{(row.get('extra_estimate') or 0) * 1e3:>14.1f} "
              f"{(row['seconds'] - rows['compile']['seconds']) * 1e3 if 'compile' in rows else float('nan'):>7.1f}")
        if name != next(iter(budgets)):       # the sweep proper, from 0.9x down
            worst = max(worst, ratio)
            monotone = monotone and (last is None or row["above"] <= last * 1.005)
            last = row["above"]
    print(f"measured peaks non-increasing as the budget falls: {monotone}")
    print("largest measured peak / budget (sweep):")
    print(f"{worst:.3f}")


def _step_rows(text: str) -> dict[str, dict]:
    """bench/torch_step.py's rows, from the JSON line `--json` prints last."""
    lines = [line for line in text.splitlines() if line.startswith('{"rows"')]
    return {row["name"]: row for row in json.loads(lines[-1])["rows"]} if lines else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("vocab", 4096), ("batch", 8), ("layers", 4), ("d-model", 256), ("heads", 4),
                          ("seq", 512), ("repeats", 2), ("rounds", 3), ("timeout", 1800)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--torch", action="store_true", help="also the torch path (slow: many compiles)")
    ap.add_argument("--skip-onnx", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the torch path runs (cuda: peaks are max_memory_allocated)")
    ap.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS,
                    help="the budgets of the sweep, as fractions of the original's measured peak")
    args = ap.parse_args()
    if not args.skip_onnx:
        onnx_sweep(args)
    if args.torch:
        torch_sweep(args)


if __name__ == "__main__":
    main()

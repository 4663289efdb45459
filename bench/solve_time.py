"""How long the budget planner takes to choose, by model depth (each depth in its own process).

For each depth, the GPT-like model is exported to ONNX (vocab 4096 by default), planned once,
and `engine.budget.choose` (the memory curve, every plan's effect, and the HiGHS solve) is timed
at budgets of 0.9x, 0.6x and 0.4x of the model's original peak; the slowest is reported, with
the HiGHS call alone beside it. Target: under 2 s at 4 layers, under 20 s at 48.

    python bench/solve_time.py [--layers 4 48]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("REMAT_STRICT", "1")
ROOT = Path(__file__).resolve().parent.parent


def child(layers: int, args) -> dict:
    sys.path.insert(0, str(ROOT))
    import engine.budget as budget_module
    from backends.models import GPTConfig
    from backends.onnx.importer import import_model
    from backends.onnx.torch_export import export_gpt
    from dsl.loader import load_rules
    from engine.budget import Budget, BudgetError, choose, memory_curve, preset
    from engine.budget.solve import solve as real_solve
    from engine.driver import plan_all

    cfg = GPTConfig(vocab=args.vocab, batch=args.batch, layers=layers, seq=args.seq)
    path, _ = export_gpt(cfg, Path(tempfile.mkdtemp(prefix="remat-solve-")) / "gpt.onnx")
    graph = import_model(path)
    rules = load_rules()
    begin = time.perf_counter()
    planning = plan_all(lambda fold: graph, rules, ("expensive",))
    plan_seconds = time.perf_counter() - begin
    original = memory_curve(graph, rules.views).peak
    solver_seconds: list[float] = []

    def timed_solve(*a, **k):
        start = time.perf_counter()
        try:
            return real_solve(*a, **k)
        finally:
            solver_seconds.append(time.perf_counter() - start)

    budget_module.solve = timed_solve
    worst, chosen = 0.0, []
    for fraction in (0.9, 0.6, 0.4):
        start = time.perf_counter()
        try:
            choice = choose(planning, graph, Budget(bytes=int(fraction * original)), preset("cpu-default"))
            chosen.append(len(choice.selection))
        except BudgetError:
            chosen.append(None)
        worst = max(worst, time.perf_counter() - start)
    return {"layers": layers, "nodes": len(graph.nodes), "plans": sum(len(p.occurrences) for p in planning.plans),
            "plan_s": plan_seconds, "choose_s": worst, "highs_s": max(solver_seconds, default=0.0), "chosen": chosen}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 48])
    for flag, default in (("vocab", 4096), ("batch", 8), ("seq", 512), ("timeout", 1800)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--child", type=int)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    print(f"{'layers':>6} {'nodes':>6} {'plan sites':>10} {'planning s':>11} {'choose s (worst)':>17} "
          f"{'HiGHS s':>8}  chosen at 0.9/0.6/0.4x")
    for layers in args.layers:
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", str(layers)],
                              capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        if proc.returncode:
            print(f"{layers:>6}  failed:\n{proc.stderr[-1500:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{r['layers']:>6} {r['nodes']:>6} {r['plans']:>10} {r['plan_s']:>11.2f} {r['choose_s']:>17.2f} "
              f"{r['highs_s']:>8.2f}  {r['chosen']}")


if __name__ == "__main__":
    main()

"""Compile time, step time and peak as the model grows, each configuration in its own processes.

For every (layers, seq) point, bench/torch_step.py runs torch.compile, the partitioner's
`activation_memory_budget` and remat at a budget (a fraction of torch.compile's measured peak
above rest), each with a time limit, so one slow configuration never hides the others' rows.
Prints each point's figures as ratios to torch.compile's.

    python bench/scale.py                               # d256, 16 heads, vocab 32768, batch 2
    python bench/scale.py --layers 4 8 16 --seq 1024    # issue 14's CPU check
    python bench/scale.py --device cuda --layers 4 8 16 32 --seq 512 1024 2048
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_point(args, layers: int, seq: int) -> dict[str, dict]:
    common = [f"--vocab={args.vocab}", f"--batch={args.batch}", f"--layers={layers}", f"--d-model={args.d_model}",
              f"--heads={args.heads}", f"--seq={seq}", f"--repeats={args.repeats}", f"--device={args.device}",
              f"--attention={args.attention}", "--json"]
    step = [sys.executable, str(ROOT / "bench" / "torch_step.py"), *common]
    rows: dict[str, dict] = {}
    for config in ("compile", f"budget-{args.torch_budget}"):
        rows.update(_run(step + ["--configs", config], args.timeout))
    if "compile" in rows:
        budget = args.fraction * rows["compile"]["above"]
        rows.update(_run(step + ["--configs", f"remat-budget-{budget:.0f}MiB"], args.timeout))
    return rows


def _run(command: list[str], timeout: int) -> dict[str, dict]:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {command[-1]: {"failed": f"over {timeout} s"}}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {command[-1]: {"failed": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}}
    return {row["name"]: row for row in json.loads(lines[-1])["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024])
    for flag, default in (("vocab", 32768), ("batch", 2), ("d-model", 256), ("heads", 16), ("repeats", 3),
                          ("timeout", 1800)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    ap.add_argument("--fraction", type=float, default=0.7, help="remat's budget, of torch.compile's peak")
    ap.add_argument("--torch-budget", type=float, default=0.5, help="activation_memory_budget to compare with")
    args = ap.parse_args()
    print(f"GPT-like, d {args.d_model}, {args.heads} heads, {args.attention} attention, vocab {args.vocab}, "
          f"batch {args.batch}, {args.device}; "
          f"remat at {args.fraction:g}x torch.compile's peak; peak above rest in MiB, times in s")
    print(f"{'layers':>6} {'seq':>5} {'configuration':>22} {'compile s':>10} {'/compile':>9} {'step s':>8} "
          f"{'/compile':>9} {'peak':>8} {'/compile':>9}")
    for seq in args.seq:
        for layers in args.layers:
            rows = run_point(args, layers, seq)
            base = rows.get("compile")
            for name, row in rows.items():
                if "failed" in row:
                    print(f"{layers:>6} {seq:>5} {name:>22}  failed: {row['failed']}")
                    continue
                ratio = (lambda key: f"{row[key] / base[key]:>9.3f}") if base and "failed" not in base else \
                    (lambda key: f"{'':>9}")
                print(f"{layers:>6} {seq:>5} {name:>22} {row['compile_seconds']:>10.1f} {ratio('compile_seconds')} "
                      f"{row['seconds']:>8.3f} {ratio('seconds')} {row['above']:>8.1f} {ratio('above')}", flush=True)


if __name__ == "__main__":
    main()

"""Compile time, step time and peak as the model grows, each configuration in its own processes.

For every (layers, seq) point, bench/torch_step.py runs torch.compile, the partitioner's
`activation_memory_budget` and remat at a budget (a fraction of torch.compile's measured peak
above rest), each with a time limit, so one slow configuration never hides the others' rows.
Prints each point's figures as ratios to torch.compile's.

    python bench/scale.py                               # d256, 16 heads, vocab 32768, batch 2
    python bench/scale.py --layers 4 8 16 --seq 1024    # issue 14's CPU check
    python bench/scale.py --layers 4 16 --rounds 3      # each figure the median of 3 rounds
    python bench/scale.py --device cuda --layers 4 8 16 32 --seq 512 1024 2048
    python bench/scale.py --eager ...                   # each row's error against eager (else compile's)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_point(args, layers: int, seq: int) -> dict[str, dict]:
    """One (layers, seq) point: each configuration in its own processes, `--rounds` times with the
    configurations interleaved (a slow spell of the machine then falls on all of them alike),
    each figure the median of its rounds. remat's budget is fixed by the first round's compile.
    Each row's `error`: its loss and gradients against eager's (`--eager`), else compile's."""
    out = Path(tempfile.mkdtemp(prefix="remat-scale-"))     # each configuration's loss and gradients
    common = [f"--vocab={args.vocab}", f"--batch={args.batch}", f"--layers={layers}", f"--d-model={args.d_model}",
              f"--heads={args.heads}", f"--seq={seq}", f"--repeats={args.repeats}", f"--device={args.device}",
              f"--attention={args.attention}", f"--out={out}", "--json"]
    step = [sys.executable, str(ROOT / "bench" / "torch_step.py"), *common]
    rounds: dict[str, list[dict]] = {}
    configs = (["eager"] if args.eager else []) + ["compile", f"budget-{args.torch_budget}"]
    remat_added = False
    for _ in range(args.rounds):
        for config in configs:
            for name, row in _run(step + ["--configs", config], args.timeout).items():
                rounds.setdefault(name, []).append(row)
            if config == "compile" and not remat_added:
                # The first round's compile fixes remat's budget; the configuration joins this
                # round (the loop reads the list as it grows) and every later one.
                remat_added = True
                first = rounds.get("compile", [{}])[0]
                if "failed" not in first and "above" in first:
                    configs.append(f"remat-budget-{args.fraction * first['above']:.0f}MiB")
    merged = {name: _median(rows) for name, rows in rounds.items()}
    _errors(merged, out, "eager" if args.eager else "compile")
    return merged


def _errors(rows: dict[str, dict], out: Path, reference: str) -> None:
    """Each row's largest relative error of the loss and every gradient against `reference`'s
    (the tensors torch_step.py saved for its last round)."""
    import torch

    from torch_step import saved_error

    want = out / f"{reference}.pt"
    if not want.is_file():
        return
    ref = torch.load(want)
    for name, row in rows.items():
        got = out / f"{name}.pt"
        if "failed" in row or name == reference or not got.is_file():
            continue
        row["error"] = saved_error(got, ref)
        row["reference"] = reference


def _median(rows: list[dict]) -> dict:
    """The rounds' median of each figure (a configuration that failed in any round: its failure)."""
    failed = [r for r in rows if "failed" in r]
    if failed:
        return failed[0]
    merged = dict(rows[0])
    for key in ("compile_seconds", "seconds", "above"):
        merged[key] = statistics.median(r[key] for r in rows)
    merged["compile_spread"] = (min(r["compile_seconds"] for r in rows), max(r["compile_seconds"] for r in rows))
    merged["rounds"] = len(rows)
    return merged


def _run(command: list[str], timeout: int) -> dict[str, dict]:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {command[-1]: {"failed": f"over {timeout} s"}}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = json.loads(lines[-1])["rows"] if lines else []
    if proc.returncode or not rows:
        # torch_step.py leaves out a configuration that raised (a budget no plan reaches): its error.
        # (it prints the configuration's own stderr on its stdout).
        output = (proc.stdout + "\n" + proc.stderr).splitlines()
        errors = [line for line in output if "Error" in line] or [line for line in output if line.strip()]
        return {command[-1]: {"failed": (errors or ["no output"])[-1][:200]}}
    return {row["name"]: row for row in rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024])
    for flag, default in (("vocab", 32768), ("batch", 2), ("d-model", 256), ("heads", 16), ("repeats", 3),
                          ("timeout", 1800), ("rounds", 1)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    ap.add_argument("--fraction", type=float, default=0.7, help="remat's budget, of torch.compile's peak")
    ap.add_argument("--torch-budget", type=float, default=0.5, help="activation_memory_budget to compare with")
    ap.add_argument("--eager", action="store_true",
                    help="also run eager, and give each row's error against it (else against torch.compile's)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"GPT-like, d {args.d_model}, {args.heads} heads, {args.attention} attention, vocab {args.vocab}, "
          f"batch {args.batch}, {args.device}; "
          f"remat at {args.fraction:g}x torch.compile's peak; peak above rest in MiB, times in s; "
          f"errors against {'eager' if args.eager else 'torch.compile'}")
    print(f"{'layers':>6} {'seq':>5} {'configuration':>22} {'compile s':>10} {'/compile':>9} {'step s':>8} "
          f"{'/compile':>9} {'peak':>8} {'/compile':>9} {'rel err':>8}")
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
                spread = row["compile_spread"]
                error = f"{row['error']:>8.1e}" if row.get("error") is not None else f"{'-':>8}"
                print(f"{layers:>6} {seq:>5} {name:>22} {row['compile_seconds']:>10.1f} {ratio('compile_seconds')} "
                      f"{row['seconds']:>8.3f} {ratio('seconds')} {row['above']:>8.1f} {ratio('above')} {error}"
                      + (f"   compile {spread[0]:.1f}-{spread[1]:.1f} s over {row['rounds']} rounds"
                         if row["rounds"] > 1 else ""), flush=True)


if __name__ == "__main__":
    main()

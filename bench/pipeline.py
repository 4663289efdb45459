"""Pipeline parallelism (seed 004) on torch.distributed.pipelining: the planner's partition and
per-stage plans against the uniform partitions, 4 gloo ranks on CPU.

The GPT-like model (8 layers) runs 1F1B with 4 micro-batches. Its layers' figures are measured
from the model (backends.pipeline.measure) and the planner solves for a memory limit per rank that
the even, unchecked split exceeds on rank 0. Configurations, each a `torchrun` of 4 processes:

- planned: the planner's boundaries, each stage compiled with backend="remat" and its own budget;
- uniform, no recompute: the even split, torch.compile (the planner's unchecked partition);
- uniform, full checkpoint: the even split, every block under torch.utils.checkpoint, torch.compile;
- uniform, ratio R (--ratio): the even split with the checkpointing ratio R per stage, as remat
  budgets (seed 004's first feature, the planner's baseline).

Each configuration runs twice (each with a time limit): once timed with the default allocator
(the median of --steps steps; with --rounds R, the median over R such processes, interleaved),
once for the peaks with MALLOC_MMAP_THRESHOLD_=65536 (the README's VmHWM method: a process's peak
above its resting VmRSS during one step after two warm-up steps), as bench/torch_step.py does. Loss
and gradients are checked against the single-process step on every rank. Prints a table per
configuration, then the checks last.

    python bench/pipeline.py [--limit 90MiB] [--ratio 0.5] [--rounds 1] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("REMAT_STRICT", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.pipeline import pipeline_run  # noqa: E402
from backends.pipeline.measure import measured_spec  # noqa: E402
from backends.pipeline.run import PipelineRun, read_results, table  # noqa: E402
from engine.pipeline import describe, parse_spec, solve, uniform  # noqa: E402
from engine.pipeline import table as plan_table  # noqa: E402

MIB = 2**20
RANKS = 4


def spec_for(args) -> dict:
    return {"stages": RANKS, "microbatches": args.microbatches, "schedule": "1f1b", "memory_per_stage": args.limit,
            "model": {"name": "gpt", "vocab": args.vocab, "d_model": args.d_model, "layers": 8, "heads": args.heads,
                      "seq": args.seq, "batch": args.batch, "tiers": ["expensive"]}}


def launch(run: PipelineRun, name: str, args, peaks: bool) -> list | None:
    """One torchrun of RANKS processes; each rank's result, or None (said why) if it failed."""
    folder = Path(tempfile.mkdtemp(prefix=f"remat-pipeline-{name}-"))
    (folder / "run.json").write_text(json.dumps(asdict(run)))
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
    if peaks:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
               "--master-port", str(args.port), "-m", "backends.pipeline.run", str(folder / "run.json"),
               "--out", str(folder)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"# {name}: stopped after its time limit, {args.timeout} s", flush=True)
        return None
    if proc.returncode != 0:
        print(f"# {name}: failed\n{proc.stderr[-2500:]}", flush=True)
        return None
    return read_results(folder, RANKS)


def measure(run: PipelineRun, name: str, args) -> list | None:
    """Times from a process with the default allocator, peaks from one with the mmap threshold."""
    timed = launch(run, name, args, peaks=False)
    if timed is None:
        return None
    peaked = launch(run, name, args, peaks=True)
    if peaked is None:
        return None
    for t, p in zip(timed, peaked):
        p.seconds, p.compile_seconds = t.seconds, t.compile_seconds
    print(f"# {name}: step {peaked[0].seconds:.3f} s, compile {peaked[0].compile_seconds:.1f} s", flush=True)
    return peaked


def retime(results: dict, runs: dict, args) -> None:
    """--rounds R: R - 1 more timed processes per configuration, interleaved (this machine's speed
    drifts between processes); each rank's step time becomes the median over the rounds."""
    times = {name: [[r.seconds] for r in rows] for name, rows in results.items()}
    for _ in range(args.rounds - 1):
        for name in results:
            again = launch(runs[name], name.replace(", ", "-").replace(" ", "-"), args, peaks=False)
            if again is not None:
                for kept, row in zip(times[name], again):
                    kept.append(row.seconds)
    for name, rows in results.items():
        for row, kept in zip(rows, times[name]):
            row.seconds = sorted(kept)[len(kept) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("vocab", 256), ("d-model", 384), ("heads", 4), ("seq", 128), ("batch", 4),
                          ("microbatches", 4), ("timeout", 600), ("port", 29531), ("steps", 5), ("rounds", 1)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--limit", default="90MiB", help="memory per rank (parameters, gradients, activations)")
    ap.add_argument("--ratio", type=float, default=0.5, help="the uniform ratio baseline's R")
    args = ap.parse_args()

    spec = measured_spec(parse_spec(spec_for(args), "bench"))
    planned = solve(spec)
    baselines = {"uniform, no recompute": uniform(spec, 0.0), f"uniform, ratio {args.ratio:g}": uniform(spec, args.ratio)}
    print(f"GPT-like: vocab {args.vocab}, d {args.d_model}, 8 layers, {args.heads} heads, seq {args.seq}, micro-batch "
          f"{args.batch}; 1F1B, {RANKS} gloo ranks, {args.microbatches} micro-batches, {args.limit} per rank")
    for plan in (planned, *baselines.values()):
        print(plan_table(plan))
        print(describe(plan))
    runs = {
        "planned": pipeline_run(planned),
        "uniform, no recompute": pipeline_run(baselines["uniform, no recompute"], mode="compile"),
        "uniform, full checkpoint": replace(pipeline_run(baselines["uniform, no recompute"], mode="checkpoint"),
                                            estimates=()),
        f"uniform, ratio {args.ratio:g}": pipeline_run(baselines[f"uniform, ratio {args.ratio:g}"]),
    }
    runs = {name: replace(run, steps=args.steps) for name, run in runs.items()}
    results = {}
    for name, run in runs.items():
        measured = measure(run, name.replace(", ", "-").replace(" ", "-"), args)
        if measured is not None:
            results[name] = measured
    retime(results, runs, args)
    for name, measured in results.items():
        print(f"\n{name} (boundaries {list(runs[name].boundaries)}):")
        print(table(runs[name], measured))
    limit = runs["planned"].limit
    print()
    checks = []
    if "planned" in results:
        plan_rows = results["planned"]
        fits = all(r.peak + r.static <= limit for r in plan_rows)
        worst = max(abs(r.peak / r.estimate - 1) for r in plan_rows)
        errors = max(max(r.grad_error, r.loss_error or 0) for r in plan_rows)
        checks.append(f"planned fits every rank (measured peak + parameters and gradients <= "
                      f"{limit / MIB:.1f} MiB): {'yes' if fits else 'NO'}")
        checks.append(f"planned peaks against the plan's estimates: worst {worst:.1%} off "
                      f"({'within' if worst <= 0.15 else 'NOT within'} 15%)")
        checks.append(f"planned loss and gradients against the single-process step: largest relative error "
                      f"{errors:.1e}")
        for name in ("uniform, full checkpoint", f"uniform, ratio {args.ratio:g}"):
            if name in results:
                ratio = plan_rows[0].seconds / results[name][0].seconds
                checks.append(f"planned step time / {name}'s: {ratio:.3f} "
                              f"({'below' if ratio < 1 else 'NOT below'})")
    if "uniform, no recompute" in results:
        first = results["uniform, no recompute"][0]
        over = first.peak + first.static > limit
        checks.append(f"uniform, no recompute on rank 0: {(first.peak + first.static) / MIB:.1f} MiB "
                      f"({'exceeds' if over else 'does NOT exceed'} {limit / MIB:.1f} MiB)")
    print("\n".join(checks))


if __name__ == "__main__":
    main()

"""Chunking, measured against the anchors, in three parts (each configuration in its own process).

(a) Linear + cross-entropy alone: remat's chunk rule against Inductor's auto-chunker. 4096
    tokens, 128 hidden, vocab 16384 (256 MiB of logits), one training step (the input's
    gradient too, as inside a model): two warm-up steps, then the peak above the resting RSS
    during one step (MALLOC_MMAP_THRESHOLD_=65536, clear_refs, VmHWM, as docs/design.md measures)
    and the median step time. remat slices with a rule whose count is fixed (`chunk over h
    along 0 into N`); the auto-chunker with `auto_chunker.num_chunk = N`.
(b) The GPT-like model of docs/design.md with vocab 32768, batch 4, in torch: bench/torch_step.py
    with torch.compile default, the auto-chunker, the hand-chunked loss and backend="remat".
(c) The same model's training graph in ONNX Runtime: the exported graph, then `remat apply`
    (chunk regions as Loops, then recompute), the same with the slices unrolled instead of
    looped (why the builder uses Loops), and with `--tier expensive`.

Prints the tables, then the GPT remat/compile peak ratio last.

    python bench/chunk.py [--parts a b c] [--counts 4 8 32]
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

# Benchmarks run remat strict: an internal error is raised, never hidden by a fallback.
os.environ.setdefault("REMAT_STRICT", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from backends.process_peak import peak_bytes, reset_peak  # noqa: E402
RULE = """use std.ops

rule chunk_head {{
  match {{
    logits = MatMul(h, w)
    require bytes(logits) >= 8 * bytes(h)
  }}
  rewrite {{
    chunk over h along 0 into {count}
  }}
}}
"""


def child(name: str, args) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    x = torch.randn(args.tokens, args.hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def loss_fn(x, labels):
        return F.cross_entropy(head(x), labels)

    fn = loss_fn
    kind, _, count = name.partition("-")
    if kind == "compile":
        fn = torch.compile(loss_fn)
    elif kind == "auto":
        import torch._inductor.config as inductor_config

        inductor_config.auto_chunker.enable = True
        inductor_config.auto_chunker.num_chunk = int(count)
        fn = torch.compile(loss_fn)
    elif kind == "remat":
        import backends.fx as fx_backend

        rule = Path(tempfile.mkdtemp()) / "chunk_head.rule"
        rule.write_text(RULE.format(count=count))
        fn = torch.compile(loss_fn, backend=fx_backend.backend(rules=[rule]))

    def step():
        loss = fn(x, labels)
        loss.backward()
        x.grad = None
        head.weight.grad = None
        return loss

    step()
    step()
    rest = reset_peak(cuda=False)
    times = []
    for _ in range(args.repeats):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    peak = peak_bytes(cuda=False)
    return {"name": name, "above_rest": (peak - rest) / 2**20, "seconds": sorted(times)[len(times) // 2]}


def part_a(args) -> None:
    names = ["eager", "compile"] + [f"{k}-{n}" for n in args.counts for k in ("auto", "remat")]
    rows = {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for name in names:
        command = [sys.executable, __file__, *sys.argv[1:], "--parts", "a", "--child", name]
        subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)   # fills the caches
        proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-1500:]}")
            continue
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    logits = args.tokens * args.vocab * 4 / 2**20
    print(f"linear + cross-entropy: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab} "
          f"({logits:.0f} MiB of logits); {args.threads} threads; peak above the resting RSS")
    print(f"{'configuration':16}{'peak MiB':>10}{'step s':>9}")
    for name, r in rows.items():
        print(f"{name:16}{r['above_rest']:>10.1f}{r['seconds']:>9.3f}")
    print(f"{'chunks':>8}{'remat/auto peak':>18}{'remat/auto time':>18}")
    last = None
    for n in args.counts:
        a, r = rows.get(f"auto-{n}"), rows.get(f"remat-{n}")
        if a and r:
            last = r["above_rest"] / a["above_rest"]
            print(f"{n:>8}{last:>18.3f}{r['seconds'] / a['seconds']:>18.3f}")
    if last is not None:
        print(f"remat / auto-chunker peak at {args.counts[-1]} chunks: {last:.3f}")


GPT = {"vocab": 32768, "batch": 4, "layers": 4, "d_model": 256, "heads": 4, "seq": 512}


def part_b(args) -> float | None:
    """bench/torch_step.py on the vocab-32768 model; returns its remat/compile peak ratio."""
    command = [sys.executable, str(ROOT / "bench" / "torch_step.py"), "--vocab", str(GPT["vocab"]),
               "--batch", str(GPT["batch"]), "--threads", str(args.threads), "--repeats", "3",
               "--configs", "eager", "compile", "auto-chunker", "hand-chunked", "remat", "remat-expensive"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    print(proc.stdout.rstrip())
    if proc.returncode != 0:
        print(f"torch_step failed\n{proc.stderr[-1500:]}")
        return None
    try:
        return float(proc.stdout.strip().splitlines()[-1])
    except ValueError:
        return None


def part_c(args) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from backends.models import GPTConfig
    from backends.onnx.exporter import export_model
    from backends.onnx.importer import import_model
    from backends.onnx.rewrite import apply_rules
    from backends.onnx.runtime import max_relative_error, measure, run
    from backends.onnx.torch_export import export_gpt
    from dsl.loader import load_rules

    cfg = GPTConfig(**GPT)
    path, grad_error = export_gpt(cfg, Path(tempfile.mkdtemp(prefix="remat-chunk-")) / "gpt.onnx")
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    reference = run(path, feeds)
    graph = import_model(path)
    rules = load_rules()
    print(f"\nONNX Runtime, GPT-like training graph (vocab {cfg.vocab}, batch {cfg.batch}); exported "
          f"gradients vs torch {grad_error.error:.1e}; CPU, one thread, peak above the resting RSS")
    print(f"{'graph':34}{'peak MiB':>10}{'/original':>11}{'step s':>9}{'/original':>11}{'max rel err':>13}")
    base = measure(path, feeds, repeats=args.repeats)
    print(f"{'original':34}{base.peak_mib:>10.1f}{1:>11.3f}{base.seconds:>9.3f}{1:>11.3f}{0:>13.1e}")
    last = None
    for label, tiers, unrolled in (("remat apply", (), False), ("remat apply, slices unrolled", (), True),
                                   ("remat apply --tier expensive", ("expensive",), False)):
        rewrite = apply_rules(graph, rules, tiers=tiers, unrolled=unrolled)
        model = export_model(rewrite.graph)
        m = measure(model, feeds, repeats=args.repeats)
        err = max_relative_error(run(model, feeds), reference)[0]
        ratio = m.peak_above_rest / base.peak_above_rest
        last = ratio if label == "remat apply" else last
        print(f"{label:34}{m.peak_mib:>10.1f}{ratio:>11.3f}{m.seconds:>9.3f}{m.seconds / base.seconds:>11.3f}"
              f"{err:>13.1e}  {rewrite.chunked} chunk regions")
    print(f"ONNX remat apply / original peak: {last:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("tokens", 4096), ("hidden", 128), ("vocab", 16384), ("threads", 2), ("repeats", 5)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    gpt_ratio = None
    if "a" in args.parts:
        part_a(args)
    if "c" in args.parts:
        part_c(args)
    if "b" in args.parts:
        print()
        gpt_ratio = part_b(args)
    if gpt_ratio is not None:
        print("GPT-like (vocab 32768, batch 4) remat / torch.compile peak:")
        print(f"{gpt_ratio:.3f}")


if __name__ == "__main__":
    main()

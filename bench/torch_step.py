"""One training step of the GPT-like model (docs/design.md) under torch, each configuration in its own process.

Configurations: eager, per-block torch.utils.checkpoint, torch.compile (Inductor), the
partitioner's activation_memory_budget at 0.5 and 0.1, and torch.compile(backend="remat")
with the shipped rules (default tier, and --tier expensive); `remat-budget-B` gives the planner
the budget B (`0.6`, `400MiB`, or `free`: what the device has free; `free-0`: keeping nothing
back for an optimizer, which this step has none of). Peak is the whole process's
VmHWM during one step after two warm-up steps (MALLOC_MMAP_THRESHOLD_=65536, clear_refs),
as docs/design.md measures it; on a GPU, torch.cuda.max_memory_allocated. Step time is the median
of --repeats steps in another process, with the default allocator (see main()); with --rounds R,
the median over R such processes, the configurations interleaved. Loss and gradients are
compared with eager. The estimate column is backends.fx.peak's model of the peak above rest,
computed on the graphs the partitioner returned in the timed process (a fresh Inductor cache per
run makes it compile there, and the first step's time less a step's is the compile time). Prints
the table, then the remat/compile peak ratio last (with --json, then the rows as JSON).
`--dropout P`: dropout in training mode (the GPT-like model's, on the attention probabilities
and after each block; nanoGPT's config's). Compiled configurations then draw Inductor's random
numbers, seed for seed alike, and eager ATen's: the errors are against `compile` (eager and
checkpoint, which draw others, get none).

    python bench/torch_step.py [--vocab 4096 --batch 8] [--device cuda]
    python bench/torch_step.py --nanogpt ~/nanoGPT/model.py --vocab 50304 --configs eager compile remat
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
CONFIGS = ["eager", "checkpoint", "compile", "budget-0.5", "budget-0.1", "auto-chunker", "hand-chunked",
           "remat", "remat-expensive"]


def hand_chunked_loss(chunks: int):
    """Linear + cross-entropy written by hand, slice by slice (8 slices, as docs/design.md's anchor):
    each slice's logits give its loss and, right away, its gradients; backward only scales them."""
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, weight, labels):
            count = (labels != -100).sum().clamp_min(1)
            loss = h.new_zeros(())
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros_like(weight)
            for rows in torch.arange(h.shape[0], device=h.device).chunk(chunks):
                hc, lc = h[rows], labels[rows]
                logits = hc @ weight.t()
                logp = torch.log_softmax(logits, dim=-1)
                keep = lc != -100
                safe = lc.clamp_min(0)
                loss = loss - (logp.gather(1, safe[:, None]).squeeze(1) * keep).sum()
                grad = logp.exp_()
                grad[torch.arange(len(rows), device=h.device), safe] -= 1
                grad *= keep[:, None] / count
                grad_h[rows] = grad @ weight
                grad_w += grad.t() @ hc
            ctx.save_for_backward(grad_h, grad_w)
            return loss / count

        @staticmethod
        def backward(ctx, grad_out):
            grad_h, grad_w = ctx.saved_tensors
            return grad_h * grad_out, grad_w * grad_out, None

    return ChunkedLinearCrossEntropy.apply


def nanogpt(args):
    """nanoGPT's own GPT (its model.py, given by --nanogpt) at this run's sizes: SDPA attention,
    tied head, forward returns (logits, loss) with ignore_index=-1, dropout --dropout."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", args.nanogpt)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(module.GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                                       n_head=args.heads, n_embd=args.d_model, dropout=args.dropout, bias=True))


def child(name: str, args) -> dict:
    import torch
    import torch.utils.checkpoint

    sys.path.insert(0, str(ROOT))
    import backends.fx as fx_backend
    from backends.models import GPTConfig, gpt
    from backends.process_peak import peak_bytes, reset_peak

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.device_memory:
        # A smaller device: the caching allocator refuses what would take it past this, as a GPU
        # of that size would (remat's `free` budget reads the cap, backends/fx/free_memory.py).
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_memory * 2**20 / total), device)
    estimates = estimate_partitions()
    cfg = GPTConfig(vocab=args.vocab, batch=args.batch, layers=args.layers, d_model=args.d_model,
                    heads=args.heads, seq=args.seq, attention=args.attention, label_shift=args.label_shift,
                    ncl_loss=args.ncl_loss, return_logits=args.return_logits, dropout=args.dropout)
    model = (nanogpt(args) if args.nanogpt else gpt(cfg)).to(device)
    inputs = [t.to(device) for t in gpt(cfg).example_inputs()]
    planned = None      # a remat-budget row's backend: the planner's estimated extra time
    if name == "checkpoint":
        for block in model.blocks:
            block.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(
                block.forward)
    fn = model
    if name == "hand-chunked":
        loss_fn = hand_chunked_loss(8)

        def forward(idx, targets):
            x = model.tok(idx) + model.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in model.blocks:
                x = block(x)
            h = model.ln(x)
            logits = model.head(h) if args.return_logits else None   # whole, as the user asked
            if args.label_shift:
                h, targets = h[:, :-1], targets[:, 1:]
            loss = loss_fn(h.reshape(-1, h.shape[-1]), model.head.weight, targets.reshape(-1))
            return (logits, loss) if args.return_logits else loss

        model.forward = forward
    # torch.compile's mode for every compiled row; a configured remat backend takes it itself
    mode = {"mode": args.mode} if args.mode else {}
    if name in ("compile", "hand-chunked"):
        fn = torch.compile(model, **mode)
    elif name == "auto-chunker":
        import torch._inductor.config as inductor_config

        inductor_config.auto_chunker.enable = True
        fn = torch.compile(model, **mode)
    elif name.startswith("budget-"):
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(name.split("-")[1])
        fn = torch.compile(model, **mode)
    elif name == "remat":
        fn = torch.compile(model, backend="remat", **mode)
    elif name == "remat-expensive":
        fn = torch.compile(model, backend=fx_backend.backend(tiers=["expensive"], config=args.remat_config,
                                                             mode=args.mode))
    elif name.startswith("remat-budget-"):
        # remat-budget-0.6 (of the estimated peak) or remat-budget-400MiB: the planner chooses.
        budget = name[len("remat-budget-"):]
        planned = fx_backend.backend(tiers=["expensive"], budget=budget,
                                     device="cpu" if device.type == "cpu" else str(device), mode=args.mode)
        fn = torch.compile(model, backend=planned)

    def step(inputs=inputs) -> torch.Tensor:
        if args.mode in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()      # CUDA graphs: a new step's buffers
        loss = fn(*inputs)
        if args.return_logits:      # nanoGPT's loop: `logits, loss = model(x, y)`, then the loss's backward
            logits, loss = loss
        loss.backward()
        return loss.detach().clone()     # (a CUDA graph's output is overwritten by its next replay)

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    warmup = []
    # --vary-length: the first step's batch is a quarter shorter, as batches padded to their
    # longest are; at the second length Dynamo recompiles with the length dynamic (automatic
    # dynamic shapes), and the measured steps run that dynamic graph. --vary-batch: its number
    # of sequences differs too (one fewer, or one more from 2: a size of 1 stays static), so
    # the batch is dynamic as well.
    varying = args.vary_length or args.vary_batch or args.length_range
    short = [t[:, :args.seq - args.seq // 4] for t in inputs]
    if args.vary_batch:
        short = [t[:-1] if args.batch > 2 else torch.cat([t, t[:1]]) for t in short]
    if args.length_range:
        # As users declare a length that varies: one graph for every length from 2 to --seq, every
        # guard checked against that range (the steps are measured at --seq).
        for t in [*inputs, *short]:
            torch._dynamo.mark_dynamic(t, 1, min=2, max=args.seq)
    for k in range(2):
        begin = time.perf_counter()
        if k == 1 and varying:
            estimates.clear()       # the peak model's estimate: of the graph the measured steps run
        step(short if varying and k == 0 else inputs)
        clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
        warmup.append(time.perf_counter() - begin)
    start = reset_peak(device.type == "cuda")
    begin = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    # The peak is read before the gradients are copied out for the comparison with eager.
    peak, rest = peak_bytes(device.type == "cuda") / 2**20, start / 2**20
    grads = [p.grad.detach().clone() for p in model.parameters()]
    clear()
    times = [seconds]
    for _ in range(args.repeats - 1):
        begin = time.perf_counter()
        step()
        clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    torch.save({"loss": loss.cpu(), "grads": [g.cpu() for g in grads]}, args.out / f"{name}.pt")
    seconds = sorted(times)[len(times) // 2]
    # The first step compiles (in the timed process, whose Inductor cache starts empty): its time
    # less a step's is the compile time (with --vary-length both warm-up steps compile).
    compiling = warmup if varying else warmup[:1]
    return {"name": name, "peak": peak, "rest": rest, "seconds": seconds,
            "compile_seconds": max(0.0, sum(compiling) - len(compiling) * seconds),
            "estimate": sum(estimates.values()) / 2**20 if estimates else None,
            "extra_estimate": sum(c.extra_seconds for c in planned.remat_pass.choices) if planned else None}


def saved_error(path: Path, ref: dict) -> float:
    """The largest relative error of the loss and every gradient a configuration saved at `path`
    (its child process's last step) against `ref`, another's, as torch.load gives it."""
    import torch

    from backends.fx.saved import relative_error

    got = torch.load(path)
    pairs = [(got["loss"], ref["loss"])] + list(zip(got["grads"], ref["grads"]))
    return max(relative_error(a, b) for a, b in pairs)


def estimate_partitions() -> dict[tuple, int]:
    """The peak model's estimate (backends.fx.peak) of each graph Inductor partitions in this
    process, taken on the forward and backward graphs the partitioner returns, by the joint
    graph's inputs: a graph compiled again (remat's backend plans a graph again where Inductor's
    account of its code is over the budget) replaces its earlier estimate, which the step never
    runs (summed, a replanned graph's two estimates read 2x the measured peak)."""
    import torch._inductor.compile_fx as compile_fx

    from backends.fx.peak import step_graph, step_peak

    estimates: dict[tuple, int] = {}
    partition = compile_fx.min_cut_rematerialization_partition

    def partition_and_estimate(joint, joint_inputs, **kwargs):
        forward, backward = partition(joint, joint_inputs, **kwargs)
        inputs = tuple((n.name, tuple(getattr(n.meta.get("val"), "shape", ()))) for n in joint.graph.nodes
                       if n.op == "placeholder")
        estimates[inputs] = step_peak(step_graph(forward, backward, kwargs["num_fwd_outputs"]))
        return forward, backward

    compile_fx.min_cut_rematerialization_partition = partition_and_estimate
    return estimates


def run_child(command: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """One configuration's process, stopped after `timeout` seconds (then it failed, saying so)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"stopped after its time limit, {timeout} s")


def progress(name: str, row: dict) -> None:
    """One line per configuration as it finishes, so a run stopped by a time limit still says
    what it measured."""
    print(f"# {name}: peak {row['peak'] - row['rest']:.1f} MiB above rest, step {row['seconds']:.4f} s, "
          f"compile {row['compile_seconds']:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("vocab", 4096), ("batch", 8), ("layers", 4), ("d-model", 256), ("heads", 4),
                          ("seq", 512), ("threads", 2), ("repeats", 3), ("timeout", 1200)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--device-memory", type=float, metavar="MiB",
                    help="on CUDA, cap the process's allocator at MiB (a smaller GPU): a configuration "
                         "that needs more fails out of memory; remat-budget-free fits what the cap leaves")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout probability (training mode)")
    ap.add_argument("--attention", choices=("explicit", "sdpa"), default="explicit")
    ap.add_argument("--label-shift", action="store_true",
                    help="the loss reads logits[:, :-1] against targets[:, 1:] (transformers before 4.46)")
    ap.add_argument("--ncl-loss", action="store_true",
                    help="cross-entropy on logits.transpose(1, 2), the (N, C, L) form (hand-chunked: the "
                         "same loss on the flat logits)")
    ap.add_argument("--return-logits", action="store_true",
                    help="the model returns (logits, loss), as nanoGPT and transformers do; the step "
                         "backpropagates the loss")
    ap.add_argument("--nanogpt", type=Path, metavar="MODEL_PY",
                    help="run nanoGPT's own model (the model.py of a nanoGPT checkout) at these sizes; it "
                         "returns (logits, loss)")
    ap.add_argument("--vary-length", action="store_true",
                    help="the first warm-up step runs a shorter sequence, so Dynamo recompiles with the "
                         "length dynamic (automatic dynamic shapes) and every configuration is measured "
                         "on its dynamic graph")
    ap.add_argument("--vary-batch", action="store_true",
                    help="as --vary-length, the first warm-up step's number of sequences differing too: "
                         "batch and length dynamic")
    ap.add_argument("--length-range", action="store_true",
                    help="the length marked dynamic with a declared range (mark_dynamic(t, 1, min=2, "
                         "max=--seq)), the first warm-up step a quarter shorter: one graph for both")
    ap.add_argument("--mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                    help="torch.compile's mode for every compiled configuration (remat's rows as torch hands "
                         "a backend its mode: Inductor's settings of that mode)")
    ap.add_argument("--remat-config", help="plan string for remat-expensive (default: every type-1 plan)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--rounds", type=int, default=1, help="timed processes per configuration, interleaved")
    ap.add_argument("--child")
    ap.add_argument("--out", type=Path, default=Path("/tmp/remat-torch-step"))
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line, last")
    args = ap.parse_args()
    if args.device_memory is not None and not args.device.startswith("cuda"):
        ap.error("--device-memory caps CUDA's caching allocator: give --device cuda")
    if args.nanogpt:
        if not args.nanogpt.is_file():
            ap.error(f"--nanogpt {args.nanogpt}: no such file (give the model.py of a nanoGPT checkout)")
        unfit = [c for c in args.configs if c in ("checkpoint", "hand-chunked")]
        if unfit:
            ap.error(f"--nanogpt: {', '.join(unfit)} reach into this repository's GPT; leave them out (--configs)")
        if args.attention != "explicit" or args.label_shift or args.ncl_loss:
            ap.error("--nanogpt runs nanoGPT's model as written: no --attention, --label-shift or --ncl-loss")
        args.return_logits = True
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    import torch

    sys.path.insert(0, str(ROOT))

    # A fresh Inductor cache for this run: the timed process compiles (and the peak model sees the
    # partitioner's graphs there), the peak process loads what it compiled.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="remat-inductor-"))
    rows = {}
    estimates: dict[str, float | None] = {}
    timings: dict[str, list[float]] = {name: [] for name in args.configs}
    for round_ in range(args.rounds):
        for name in args.configs:
            if round_ and name not in rows:
                continue
            # Two processes. The first fills Inductor's caches and is timed, with the default
            # allocator: the mmap threshold that makes VmHWM trustworthy turns every large
            # allocation into a fresh mapping whose pages fault in, a cost no real run pays, and
            # one that grows with the number of buffers (chunked runs have more).
            # The second measures the peak: a process that compiles from scratch keeps tens of
            # MiB more (compile-time garbage) than one that loads from the cache, so every
            # configuration's peak is taken from the same, cached, state.
            # With --rounds R the timed processes run R times, the configurations interleaved,
            # and each row gets the median: this machine's speed drifts between processes.
            timed = run_child([sys.executable, __file__, *sys.argv[1:], "--child", name], args.timeout)
            if timed.returncode != 0:
                print(f"{name}: failed\n{timed.stderr[-1500:]}")
                continue
            timed_row = json.loads(timed.stdout.strip().splitlines()[-1])
            timings[name].append(timed_row["seconds"])
            if round_ == 0:
                estimates[name] = timed_row["estimate"], timed_row["compile_seconds"], timed_row["extra_estimate"]
            if round_:
                continue
            if args.device.startswith("cuda"):
                # max_memory_allocated counts tensors alone: the timed process's own reading holds.
                rows[name] = timed_row
                progress(name, timed_row)
                continue
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            proc = run_child([sys.executable, __file__, *sys.argv[1:], "--child", name, "--repeats", "1"],
                             args.timeout, env)
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-1500:]}")
                continue
            rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            progress(name, dict(rows[name], seconds=timed_row["seconds"], compile_seconds=timed_row["compile_seconds"]))
    for name, row in rows.items():
        row["seconds"] = sorted(timings[name])[len(timings[name]) // 2]
        row["estimate"], row["compile_seconds"], row["extra_estimate"] = estimates.get(name, (None, None, None))
    # With dropout, eager draws ATen's random numbers and the compiled steps Inductor's: compare
    # those with compile's, which draws the same numbers from the same seed.
    reference = "compile" if args.dropout else "eager"
    ref = torch.load(args.out / f"{reference}.pt") if reference in rows else None
    base = rows.get("compile")
    unit = "MiB (max_memory_allocated)" if args.device.startswith("cuda") else "MiB (process VmHWM)"
    model_name = "nanoGPT" if args.nanogpt else "GPT-like"
    print(f"{model_name}: vocab {args.vocab}, batch {args.batch}, {args.layers} layers, d {args.d_model}, "
          f"seq {args.seq}, {'SDPA' if args.nanogpt else args.attention} attention"
          f"{', label shift' if args.label_shift else ''}{', (N, C, L) loss' if args.ncl_loss else ''}"
          f"{', returns (logits, loss)' if args.return_logits else ''}"
          f"{', length dynamic (a shorter first batch)' if args.vary_length and not args.vary_batch else ''}"
          f"{', batch and length dynamic (a first batch of other sizes)' if args.vary_batch else ''}"
          f"{f', length declared in 2..{args.seq}' if args.length_range else ''}"
          f"{f', dropout {args.dropout}' if args.dropout else ''}"
          f"{f', mode {args.mode}' if args.mode else ''}; "
          f"{args.device}, {args.threads} threads; peak in {unit}")
    print(f"{'configuration':22}{'rest':>8}{'peak':>10}{'/compile':>10}{'step s':>9}{'/compile':>10}"
          f"{'max rel err vs ' + reference:>22}{'est.':>9}{'est/meas':>10}")
    for name, r in rows.items():
        err = ""
        if ref is not None and not (args.dropout and name in ("eager", "checkpoint")):
            r["error"] = saved_error(args.out / f"{name}.pt", ref)
            err = f"{r['error']:.1e}"
        ratio = f"{r['peak'] / base['peak']:.3f}" if base else ""
        tratio = f"{r['seconds'] / base['seconds']:.3f}" if base else ""
        above = r["peak"] - r["rest"]
        est = f"{'-':>9}{'-':>10}"     # no compiled graph (eager), or none the partitioner saw
        if r.get("estimate"):
            est = f"{r['estimate']:>9.1f}{r['estimate'] / max(above, 1e-9):>10.3f}"
        print(f"{name:22}{r['rest']:>8.1f}{r['peak']:>10.1f}{ratio:>10}{r['seconds']:>9.3f}{tratio:>10}{err:>22}{est}")
    best = "remat-expensive" if "remat-expensive" in rows else "remat"
    if base and best in rows:
        print(f"{best} / compile peak:")
        print(f"{rows[best]['peak'] / base['peak']:.3f}")
    if args.json:
        print(json.dumps({"rows": [{"name": n, "above": r["peak"] - r["rest"], "seconds": r["seconds"],
                                    "compile_seconds": r["compile_seconds"], "estimate": r["estimate"],
                                    "extra_estimate": r["extra_estimate"], "error": r.get("error")}
                                   for n, r in rows.items()]}))


if __name__ == "__main__":
    main()

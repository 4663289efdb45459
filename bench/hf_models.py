"""Hugging Face models (transformers: GPT-2, Llama, BERT with dropout, T5, Gemma 2) through both of remat's paths.

Each model is built from its config object with random weights (no download; HF_HUB_OFFLINE=1)
and wrapped so that `module(*inputs)` is its training loss (causal LM, masked LM, seq2seq). The
factories below are `remat export` entry points too (`remat export hf_models:gpt2 -o gpt2.onnx`,
run from bench/).

Rows, each configuration in its own process with a time limit (a failure is one line and the
other rows still run):

- torch: `eager`, `compile` (plain Inductor, the anchor) and `remat` (torch.compile with remat's
  backend, the shipped rules at the default tier: what `backend="remat"` runs). Loss and
  gradients of one step against eager's with the same seed (dropout drawn the same way:
  torch._inductor.config.fallback_random). Peak: the process's VmHWM during that step, above
  its resident memory before it, after two warm-up steps (backends.process_peak,
  MALLOC_MMAP_THRESHOLD_=65536, as README "Benchmarks" says), against compile's.
- onnx/EXPORTER (make-fx, aot-joint): the step exported as `remat export` exports it
  (backends.onnx.user_module, torch_export; checked against torch), `remat apply`'s rewrite with
  the shipped rules, ONNX Runtime's measured peak above rest of the rewritten graph against the
  original's (backends.onnx.runtime.measure, what `remat measure --compare` runs). Loss and
  gradients of the rewritten graph against torch's (with dropout: torch drawing the masks ONNX
  Runtime drew, torch_export.verify's method).

Columns: model, path, loss err, grad err (max |got - want| / max |want|), f64 err (a row over the
tolerance in float32, judged again in float64: ONNX, the step exported from a float64 copy of the
model and rewritten the same way, against torch in float64; torch, eager and the configuration on
a float64 copy of the model; torch_export.verify says why: T5's ReLU has an input within float32
rounding of zero at this size, which ONNX Runtime's MatMul, and Inductor's with sdpa attention,
round to the other side of zero from eager), peak above rest in MiB, that peak against the
anchor (compile's for torch; the original graph's for ONNX), the plans applied (regions per
rule). The last line: the largest error (a row judged in float64 counts with its float64 error)
and the rows that failed.

    python bench/hf_models.py [--models gpt2 llama bert t5 gemma2] [--paths torch onnx] [--timeout 900]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent

MARK = "HF-ROW "
MODELS = ("gpt2", "llama", "bert", "t5", "gemma2")
TORCH_CONFIGS = ("eager", "compile", "remat")
EXPORTERS = ("make-fx", "aot-joint")
SEED = 0            # the weights and the inputs
STEP_SEED = 1       # the dropout masks of the measured step
TOLERANCE = 1e-4    # relative, on the loss and each gradient (--tolerance)

# The bench's sizes (about the GPT-like model of docs/design.md, at sequence 256) and attention
# (`eager`: Hugging Face's matmul + softmax + dropout, which both exporters write; `sdpa`:
# F.scaled_dot_product_attention, transformers' default). The parent passes its options to the
# children (and `remat export hf_models:...` to the factories) in REMAT_HF_BENCH.
SIZE = dict(vocab=4096, d=256, layers=4, heads=4, batch=8, seq=256, attention="eager")
SIZE.update(json.loads(os.environ.get("REMAT_HF_BENCH", "{}")))


def _wrap(model, keys: tuple[str, ...]):
    """A module whose forward(*inputs) passes the inputs to `model` by keyword and returns its loss."""
    import torch

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return self.model(**dict(zip(keys, inputs))).loss

    Loss.__name__ = f"{type(model).__name__}Loss"
    return Loss().train()


def _tokens(shape, vocab):
    import torch

    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(SEED))


def gpt2(vocab=SIZE["vocab"], d=SIZE["d"], layers=SIZE["layers"], heads=SIZE["heads"], batch=SIZE["batch"],
         seq=SIZE["seq"], attention=SIZE["attention"]):
    """GPT-2 (GPT2LMHeadModel), causal LM loss, no dropout."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation=attention)
    ids = _tokens((batch, seq), vocab)
    model = GPT2LMHeadModel(cfg)
    # The loss transformers picks for a model whose class name is not `...ForCausalLM`, named: left
    # unnamed, its `loss_function` logs a warning, a graph break for torch.compile that puts the
    # loss in a graph of its own, apart from the LM head (so no linear + cross-entropy to chunk).
    model.loss_type = "ForCausalLM"
    return _wrap(model, ("input_ids", "labels")), (ids, ids.clone())


def llama(vocab=SIZE["vocab"], d=SIZE["d"], layers=SIZE["layers"], heads=SIZE["heads"], batch=SIZE["batch"],
          seq=SIZE["seq"], attention=SIZE["attention"]):
    """Llama (LlamaForCausalLM: RMSNorm, rotary positions, SwiGLU, grouped KV heads), causal LM loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=d * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                      attn_implementation=attention)
    ids = _tokens((batch, seq), vocab)
    return _wrap(LlamaForCausalLM(cfg), ("input_ids", "labels")), (ids, ids.clone())


def bert(vocab=SIZE["vocab"], d=SIZE["d"], layers=SIZE["layers"], heads=SIZE["heads"], batch=SIZE["batch"],
         seq=SIZE["seq"], attention=SIZE["attention"]):
    """BERT (BertForMaskedLM) with dropout on (0.1 on hidden states and attention probabilities),
    masked LM loss over 15% of the positions (the others -100)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(SEED)
    cfg = BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * d, max_position_embeddings=seq, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, pad_token_id=0, attn_implementation=attention)
    ids = _tokens((batch, seq), vocab)
    masked = torch.rand((batch, seq), generator=torch.Generator().manual_seed(SEED + 1)) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return _wrap(BertForMaskedLM(cfg), ("input_ids", "labels")), (ids, labels)


def t5(vocab=SIZE["vocab"], d=SIZE["d"], layers=SIZE["layers"], heads=SIZE["heads"], batch=SIZE["batch"],
       seq=SIZE["seq"], attention=SIZE["attention"]):
    """T5 (T5ForConditionalGeneration: encoder-decoder, relative position buckets), seq2seq loss
    on targets half the source's length, no dropout. `layers` in all: half in the encoder, half in the decoder."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = T5Config(vocab_size=vocab, d_model=d, d_kv=d // heads, d_ff=4 * d, num_layers=layers // 2 or 1,
                   num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, attn_implementation=attention)
    ids = _tokens((batch, seq), vocab)
    labels = _tokens((batch, seq // 2), vocab)
    return _wrap(T5ForConditionalGeneration(cfg), ("input_ids", "labels")), (ids, labels)


def gemma2(vocab=SIZE["vocab"], d=SIZE["d"], layers=SIZE["layers"], heads=SIZE["heads"], batch=SIZE["batch"],
           seq=SIZE["seq"], attention=SIZE["attention"]):
    """Gemma 2 (Gemma2ForCausalLM: soft caps on the attention scores, tanh(x / 50) * 50, and on the
    final logits, tanh(x / 30) * 30, between the head and the loss; sliding-window layers; norms
    before and after each block), causal LM loss."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(SEED)
    cfg = Gemma2Config(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=d // heads,
                       max_position_embeddings=seq, sliding_window=seq // 2, bos_token_id=0, eos_token_id=0,
                       pad_token_id=None, attn_implementation=attention)
    ids = _tokens((batch, seq), vocab)
    return _wrap(Gemma2ForCausalLM(cfg), ("input_ids", "labels")), (ids, ids.clone())


FACTORIES = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "gemma2": gemma2}


def _fired(results, chunk_results) -> dict[str, int]:
    """Regions per rule, as the zoo counts them (tests/zoo.py)."""
    from zoo import count_firings

    return count_firings(SimpleNamespace(results=results, chunk_results=chunk_results))[0]


def measured_step(module, inputs, config: str, args, tiers=(), forward=contextlib.nullcontext):
    """`module` under `config` (eager; compile, plain Inductor; remat, what backend="remat"
    registers at `tiers`, or the planner at `args.budget` where given, over the expensive tier
    too): two warm-up steps, then one measured. Returns its loss, its peak above
    rest in MiB (VmHWM) and remat's backend (None otherwise), kept to count its plans. Each step
    draws its random numbers from STEP_SEED; `forward()` wraps each forward (autocast); the
    parameters keep the measured step's gradients; `args.stage` says where a failure happened."""
    import torch

    import backends.fx as fx_backend
    from backends.process_peak import peak_bytes, reset_peak

    backend = None
    if config == "eager":
        fn = module
    elif config == "compile":
        fn = torch.compile(module)
    else:
        budget = getattr(args, "budget", None)
        backend = fx_backend.backend(tiers=["expensive"] if budget is not None else tiers, budget=budget)
        fn = torch.compile(module, backend=backend)

    def step() -> torch.Tensor:
        torch.manual_seed(STEP_SEED)
        with forward():
            loss = fn(*inputs)
        loss.backward()
        return loss.detach()

    args.stage = "first step (compile)"
    for _ in range(2):
        step()
        for p in module.parameters():
            p.grad = None
        args.stage = "second step"
    args.stage = "measured step"
    rest = reset_peak(False)
    loss = step()
    peak = peak_bytes(False)
    return loss, (peak - rest) / 2**20, backend


def process_arguments(ap: argparse.ArgumentParser, timeout: int, per: str = "configuration's process") -> None:
    """The options every Hugging Face bench shares: threads, each child process's time limit, the
    folder of its outputs, and the hidden `--child` by which the parent runs one row's process."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=timeout, help=f"seconds per {per}")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)


def child_env(args, prefix: str, **extra: str) -> dict:
    """The parent's setup shared by the Hugging Face benches: remat strict and transformers offline
    and quiet (in this process and its children), `args.out` made (a fresh folder named `prefix`
    by default), and the children's environment: each child's peak as README "Benchmarks" measures
    it, and a fresh Inductor cache for the run (a graph AOTAutograd serves from its cache runs no
    remat pass, so would report no plans)."""
    os.environ.setdefault("REMAT_STRICT", "1")   # an internal error is raised, never hidden by a fallback
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.child:
        return {}
    args.out = args.out or Path(tempfile.mkdtemp(prefix=prefix))
    args.out.mkdir(parents=True, exist_ok=True)
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", **extra,
                TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                       tempfile.mkdtemp(prefix="remat-inductor-")))


def torch_child(model: str, config: str, args, float64: bool = False) -> list[dict]:
    """One training step of `model` under `config` (eager, compile, remat) after two warm-ups: its
    peak above rest (VmHWM), and its loss and gradients saved for the comparison with eager.
    `float64`: the model in float64 (a row over the tolerance in float32, judged again)."""
    import numpy as np
    import torch
    import torch._inductor.config as inductor_config

    torch.set_num_threads(args.threads)
    inductor_config.fallback_random = True          # dropout draws eager's random numbers
    module, inputs = FACTORIES[model]()
    if float64:
        module = module.double()
    loss, peak, backend = measured_step(module, inputs, config, args, args.tiers)
    outputs = {"loss": loss.numpy(), **{f"grad.{n}": p.grad.numpy() for n, p in module.named_parameters()}}
    np.savez(_saved(args.out, model, config, float64), **outputs)
    fired = None if backend is None else _fired(backend.remat_pass.results, backend.remat_pass.chunk_results)
    return [{"model": model, "path": f"torch/{config}", "peak": peak, "fired": fired}]


def _errors(errors: dict[str, float]) -> tuple[float, float]:
    """The loss's relative error and the largest gradient's (torch_export.relative_errors)."""
    errors = dict(errors)
    return errors.pop("loss"), max(errors.values(), default=0.0)


def onnx_child(model: str, exporter: str, args) -> list[dict]:
    """`remat export hf_models:MODEL --exporter EXPORTER`, `remat apply`, `remat measure --compare`,
    through the Python API those commands run: the original's row and the rewrite's."""
    from backends.onnx.user_module import load_factory

    args.stage = "export"
    return onnx_rows(model, load_factory(f"hf_models:{model}"), exporter, args)


def onnx_rows(model: str, step, exporter: str, args) -> list[dict]:
    """onnx_child's rows for a `backends.onnx.user_module.UserStep` (bench/hf_onnx.py's too)."""
    from backends.onnx.exporter import check_exported, export_model
    from backends.onnx.importer import import_model
    from backends.onnx.rewrite import apply_rules
    from backends.onnx.runtime import measure
    from backends.onnx.torch_export import (errors_against_torch, export_failure, export_training_step, float64_error,
                                            verify)
    from backends.onnx.user_module import check_loss
    from dsl.loader import load_rules
    from engine.errors import RematError

    args.stage = "export"
    check_loss(step)
    try:
        exported = export_training_step(step.module, step.inputs, ["input_ids", "labels"], exporter=exporter)
    except Exception as exc:  # noqa: BLE001 - said as `remat export` says it
        raise RematError(export_failure(exporter, exc)) from None
    args.stage = "the export's check"
    verify(exported)                # as `remat export` does: the export itself within 1e-4 of torch
    args.stage = "remat apply"
    rules = load_rules()

    budget = getattr(args, "budget", None)
    device = None
    if budget:
        from backends.device import profile_for

        device = profile_for("cpu")

    def remat_apply(model):
        rewrite = apply_rules(import_model(model), rules, tiers=args.tiers, budget=budget, device=device)
        rewritten = export_model(rewrite.graph)
        check_exported(rewritten)
        return rewrite, rewritten

    rewrite, rewritten = remat_apply(exported.model)
    rows = []
    for label, onnx_model, fired in (("original", exported.model, None),
                                     ("remat", rewritten, _fired([rewrite.result], [rewrite.chunk_result]
                                                                 if rewrite.chunk_result else []))):
        args.stage = f"the {'rewritten' if label == 'remat' else 'original'} graph in ONNX Runtime"
        loss_err, grad_err = _errors(errors_against_torch(exported, onnx_model))
        # Over the tolerance in float32: the same step (and rewrite) in float64, where rounding
        # cannot send an input across a jump of a derivative (torch_export.verify).
        f64_err = None if max(loss_err, grad_err) <= TOLERANCE else float64_error(
            exported, None if label == "original" else (lambda m: remat_apply(m)[1]))
        # the peak of one step; the time the median of five after a warm-up (one step's is noisy:
        # Mixtral's original took 20x its rewrite's time in one, about 2x in the median of five)
        measured = measure(onnx_model, exported.feeds, repeats=5, threads=args.threads)
        rows.append({"model": model, "path": f"onnx/{exporter}/{label}", "peak": measured.peak_mib,
                     "seconds": measured.seconds, "fired": fired,
                     "loss_err": loss_err, "grad_err": grad_err, "f64_err": f64_err})
    return rows


def _saved(out: Path, model: str, config: str, float64: bool) -> Path:
    return out / f"{model}-{config}{'-f64' if float64 else ''}.npz"


def child(args) -> None:
    model, path = args.child.split(":")
    path, _, precision = path.partition("@")
    try:
        if path in TORCH_CONFIGS:
            rows = torch_child(model, path, args, float64=precision == "f64")
        else:
            rows = onnx_child(model, path, args)
    except Exception as exc:  # noqa: BLE001 - the row's failure, in one line
        stage = f"{args.stage}: " if getattr(args, "stage", None) else ""
        print(MARK + json.dumps({"error": f"{stage}{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}))
        return
    print(MARK + json.dumps({"rows": rows}))


def run_one(spec: str, args, env: dict, script: str = __file__) -> list[dict] | str:
    """One child process of `script` (this file, or another bench that prints its rows so): its
    rows, or its failure in one line."""
    from torch_step import run_child

    proc = run_child([sys.executable, script, *sys.argv[1:], "--out", str(args.out), "--child", spec],
                     args.timeout, env)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            out = json.loads(line[len(MARK):])
            return out.get("rows") or out["error"]
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return f"exit {proc.returncode}: {lines[-1][:400] if lines else 'no output'}"


def _torch_errors(out: Path, model: str, config: str, float64: bool) -> tuple[float, float] | tuple[()]:
    """`config`'s loss and gradient errors against eager's (its saved outputs), or () where either
    run left none."""
    import numpy as np

    from backends.onnx.torch_export import relative_errors

    got, want = _saved(out, model, config, float64), _saved(out, model, "eager", float64)
    if not (got.exists() and want.exists()):
        return ()
    return _errors(relative_errors(dict(np.load(got)), dict(np.load(want))))


def fired_text(fired: dict | None) -> str:
    return "-" if fired is None else (" ".join(f"{k}={n}" for k, n in fired.items()) or "none")


def main() -> None:
    global TOLERANCE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--paths", nargs="+", choices=("torch", "onnx"), default=["torch", "onnx"])
    ap.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    ap.add_argument("--tiers", nargs="*", default=[], help="remat's tiers (default: the default tier)")
    for flag in ("vocab", "d", "layers", "heads", "batch", "seq"):
        ap.add_argument(f"--{flag}", type=int, default=SIZE[flag])
    ap.add_argument("--attention", choices=("eager", "sdpa"), default=SIZE["attention"])
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="relative error over which a row is judged again in float64")
    process_arguments(ap, 1200)
    args = ap.parse_args()
    TOLERANCE = args.tolerance
    options = {k: getattr(args, k) for k in ("vocab", "d", "layers", "heads", "batch", "seq", "attention")}
    env = child_env(args, "remat-hf-", REMAT_HF_BENCH=json.dumps(options))
    if args.child:
        child(args)
        return
    print(f"Hugging Face models ({', '.join(f'{k} {v}' for k, v in options.items())}); "
          f"{args.threads} threads; peak: MiB above rest (VmHWM)", flush=True)
    head = (f"{'model':8}{'path':26}{'loss err':>10}{'grad err':>10}{'f64 err':>10}{'peak MiB':>10}{'vs anchor':>11}"
            "  plans applied")
    print(head)
    print("-" * len(head), flush=True)
    failed, worst, rounding = [], 0.0, []
    for model in args.models:
        specs = ([f"{model}:{c}" for c in TORCH_CONFIGS] if "torch" in args.paths else []) + \
                ([f"{model}:{e}" for e in args.exporters] if "onnx" in args.paths else [])
        anchors: dict[str, float] = {}
        for spec in specs:
            rows = run_one(spec, args, env)
            path = spec.split(":")[1]
            if isinstance(rows, str):
                failed.append(f"{model} {path}")
                print(f"{model:8}{('onnx/' if path in EXPORTERS else 'torch/') + path:26}FAILED: {rows}", flush=True)
                continue
            for row in rows:
                errors = _torch_errors(args.out, model, path, False) if row["path"].startswith("torch/") else ()
                if errors and path != "eager":
                    row["loss_err"], row["grad_err"] = errors
                    if max(errors) > TOLERANCE:
                        # Judged again in float64, eager and this configuration, as the ONNX rows are.
                        for config in ("eager", path):
                            if not _saved(args.out, model, config, True).exists():
                                run_one(f"{model}:{config}@f64", args, env)
                        row["f64_err"] = max(_torch_errors(args.out, model, path, True), default=None)
                anchor_key = "torch/compile" if row["path"].startswith("torch/") else row["path"].rsplit("/", 1)[0]
                if row["path"] in ("torch/compile",) or row["path"].endswith("/original"):
                    anchors[anchor_key] = row["peak"]
                anchor = anchors.get(anchor_key)
                ratio = f"{row['peak'] / anchor:.3f}" if anchor else "-"   # (0 MiB: below what VmHWM resolves)
                errs = [row.get("loss_err"), row.get("grad_err")]
                f64 = row.get("f64_err")
                if f64 is not None and f64 <= TOLERANCE:
                    rounding.append(f"{model} {row['path']}")   # float32 rounding: judged in float64
                    f64_errs = [f64]
                else:
                    f64_errs = [] if f64 is None else [f64]
                    worst = max([worst, *(e for e in errs if e is not None)])
                worst = max([worst, *f64_errs])
                err_text = "".join(f"{e:>10.1e}" if e is not None else f"{'-':>10}" for e in [*errs, f64])
                print(f"{model:8}{row['path']:26}{err_text}{row['peak']:>10.1f}{ratio:>11}  {fired_text(row['fired'])}",
                      flush=True)
    print(f"largest loss or gradient error {worst:.1e}"
          + (f" (in float64 for {', '.join(rounding)}: over {TOLERANCE:g} in float32 only)" if rounding else "")
          + "; " + (f"failed: {', '.join(failed)}" if failed else "no row failed"))


if __name__ == "__main__":
    # tests/ first: its zoo.py (count_firings) shares a name with bench/zoo.py.
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
    main()

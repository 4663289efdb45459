"""Hugging Face causal LM architectures (36: ARCHITECTURES) through `backend="remat"` in float32, bfloat16 and autocast.

Each architecture is built with `AutoModelForCausalLM.from_config(AutoConfig.for_model(name, ...))`
with random weights (no download), small (vocab 4096, hidden 128, 2 layers, 4 heads, 2 key/value
heads where the architecture groups them, seq 256), dropout off, `attn_implementation="eager"`
(`--attention sdpa` for transformers' default), and wrapped so that `module(*inputs)` is its causal
LM loss (bench/hf_models.py's helpers). Precisions:

- fp32: the model as built;
- bf16: the model `.to(torch.bfloat16)` (transformers' loss widens the logits, `.float()`);
- autocast: float32 weights, `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward
  and the loss (the backward outside it), as users write it.

The loss chunk (rules/chunk.rule) fires on logits of 16 MiB or more counted in float32 (the loss
computes in float32 whatever the logits' type): batch 4 in every precision (`--batch` sets another).
Until the rule counted so, bfloat16 logits (bf16, autocast) needed batch 8.

Each (architecture, precision) runs four processes, each with a time limit (a failure is one line
and the other rows still run): the float64 reference (eager, on a float64 copy of the model: of its
bf16-rounded weights for bf16, no autocast; transformers keeps its float32 upcasts there, the loss's
`logits.float()`, RMSNorm's and the attention softmax's `dtype=torch.float32`, so the reference is
as exact as float32 at those points: about 1e-7, far below bfloat16's 1e-2), `eager`, `compile` (plain Inductor, the anchor) and
`remat` (torch.compile with remat's backend, the shipped rules at the default tier, REMAT_STRICT=1:
remat's internal errors raised, never hidden by a fallback). Each runs two warm-up steps and a
measured one. Columns: the loss's and the largest gradient's relative error against the float64
reference (max |got - want| / max |want|, torch_export.relative_errors) for eager, compile and
remat; remat's largest error over compile's (remat is judged against what Inductor itself does:
fine within 2x, or under a floor where both are at rounding level); peak above rest (VmHWM,
backends.process_peak, MALLOC_MMAP_THRESHOLD_=65536, as README "Benchmarks" measures it) of
compile and remat, and their ratio; the plans applied (regions per rule). Where the loss chunk
(chunk_linear_cross_entropy) does not fire, the line below the row says why: its refusals in
engine.driver.plan_all over the step's joint graphs (backends.fx.joint_graphs, imported op by op
by backends.fx.importer.import_fx, as backends.fx.analyze plans), or, with no refusal, why the
rule does not match the largest forward matmul (engine.why_not). The last line: the failures
(crashes, remat's numerics worse than compile's, the loss chunk refused where it fires in fp32).

`--budget B` (0.6, 400MiB): remat's rows give the planner that budget over the expensive tier too,
`backends.fx.backend(tiers=["expensive"], budget=B)`; the line below each row gives the planner's
estimated extra time, and a loss chunk the planner left out is its choice, not a refusal.

    python bench/hf_sweep.py [--models gpt_neox mistral ...] [--precisions fp32 bf16 autocast]
                             [--attention eager] [--batch N] [--budget 0.6] [--timeout 900]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tests/ first: its zoo.py (count_firings, for hf_models._fired) shares a name with bench/zoo.py.
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from hf_models import (MARK, SEED, STEP_SEED, _fired, _tokens, _wrap, child_env, fired_text,  # noqa: E402
                       measured_step, process_arguments, run_one)

LOSS_CHUNK = "chunk_linear_cross_entropy"
CONFIGS = ("eager", "compile", "remat")
PRECISIONS = ("fp32", "bf16", "autocast")
# transformers' model type and its config's overrides beyond SIZE's (head sizes that must divide,
# rotary dims within a head, sliding windows within the sequence).
ARCHITECTURES = {
    "gpt_neox": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "phi": {}, "phi3": {},
    "falcon": {}, "opt": {}, "gptj": {"rotary_dim": 16}, "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "sliding_window": 128}, "gpt_bigcode": {}, "stablelm": {}, "olmo": {},
    "bloom": {}, "mpt": {}, "mixtral": {}, "gpt2": {}, "llama": {},
    # Session 21: newer architectures (transformers 5.24), experts cut to 8 (4 for Llama 4) of 128 hidden.
    "gemma3_text": {"head_dim": 32, "sliding_window": 128},
    "qwen3_moe": {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    "deepseek_v3": {"num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 64, "kv_lora_rank": 32,
                    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32},
    "gpt_oss": {"head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 128},
    "olmo2": {}, "cohere": {}, "granite": {}, "starcoder2": {}, "smollm3": {}, "glm4": {}, "nemotron": {},
    "exaone4": {}, "minicpm3": {"num_key_value_heads": 4}, "lfm2": {}, "falcon_h1": {},
    "llama4_text": {"head_dim": 32, "num_local_experts": 4, "intermediate_size_mlp": 512},
    "qwen3_next": {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                   "shared_expert_intermediate_size": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                   "layer_types": ["linear_attention", "full_attention"]},
}
SIZE = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, bos_token_id=0, eos_token_id=0, pad_token_id=None)
SEQ = 256
BATCH = {"fp32": 4, "bf16": 4, "autocast": 4}     # logits of 16 MiB in float32: the loss chunk's threshold
# Under these (the largest of loss and gradient errors) remat and compile are both at rounding
# level, and a ratio between them says nothing.
ERROR_FLOOR = {"fp32": 1e-5, "bf16": 1e-3, "autocast": 1e-3}
WORSE = 2.0     # remat's error over compile's above which remat's numerics count as worse


def _no_dropout(cfg) -> None:
    """Every dropout probability of the config (and its sub-configs, MPT's attn_config) at 0: the
    float64 reference cannot draw the masks float32 and bfloat16 draw."""
    for holder in (cfg, *(v for v in vars(cfg).values() if hasattr(v, "to_dict"))):
        for key, value in list(vars(holder).items()):
            if ("dropout" in key or "pdrop" in key) and type(value) in (int, float) and value:
                setattr(holder, key, type(value)(0))    # (MPT's attn_pdrop is typed int)


def build(name: str, batch: int, attention: str, reference: bool = False, experts: str | None = None):
    """`name`'s causal LM from its config, random weights (seed SEED), wrapped to return its loss,
    and its inputs (token ids, labels the same ids). `reference`: for the float64 copy, mixture of
    experts run by transformers' eager loop over the experts (its default, torch._grouped_mm, has
    no float64 kernel); the same weights, the same routing. `experts`: another of transformers'
    `experts_implementation`s (bench/hf_onnx.py exports with "batched_mm")."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(name, **{**SIZE, **ARCHITECTURES[name]})     # (the override wins)
    _no_dropout(cfg)
    torch.manual_seed(SEED)
    experts = "eager" if reference else experts
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention,
                                             **({"experts_implementation": experts} if experts else {}))
    left = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if left:
        raise RuntimeError(f"{name}: dropout left on at {left[0]} (the float64 reference could not match it)")
    # Named, as bench/hf_models.py's gpt2 does: left unnamed (GPT2LMHeadModel), transformers logs
    # a warning, a graph break that puts the loss in a graph apart from the LM head.
    model.loss_type = "ForCausalLM"
    ids = _tokens((batch, SEQ), SIZE["vocab_size"])
    return _wrap(model, ("input_ids", "labels")), (ids, ids.clone())


def batch(precision: str, args) -> int:
    return args.batch or BATCH[precision]


def supports(name: str, attention: str) -> bool:
    """Whether transformers has `attention` for `name` (GPT-J, Gemma 2, BLOOM and MPT have no
    sdpa in 5.23): a row it would refuse at build is skipped, said in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(name))]
    return attention == "eager" or bool(getattr(model_class, f"_supports_{attention}", False))


def autocast(precision: str):
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()


def _saved(out: Path, name: str, precision: str, config: str) -> Path:
    return out / f"{name}-{precision}-{config}.npz"


def reference_child(name: str, precision: str, args) -> dict:
    """One eager step of a float64 copy of the model (of its bf16 weights for bf16), saved."""
    import numpy as np
    import torch

    module, inputs = build(name, batch(precision, args), args.attention, reference=True)
    if precision == "bf16":
        module = module.to(torch.bfloat16)
    module = module.double()
    torch.manual_seed(STEP_SEED)
    loss = module(*inputs)
    loss.backward()
    np.savez(_saved(args.out, name, precision, "f64"), loss=loss.detach().numpy(),
             **{f"grad.{n}": p.grad.numpy() for n, p in module.named_parameters()})
    return {"saved": True}


def torch_child(name: str, precision: str, config: str, args) -> dict:
    """One training step of the model under `config` after two warm-ups: its peak above rest, its
    loss and gradients saved (as float32), remat's plans and, where the loss chunk did not fire,
    why."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    args.stage = "build"
    module, inputs = build(name, batch(precision, args), args.attention)
    if precision == "bf16":
        module = module.to(torch.bfloat16)
    loss, peak, backend = measured_step(module, inputs, config, args, forward=lambda: autocast(precision))
    np.savez(_saved(args.out, name, precision, config), loss=loss.float().numpy(),
             **{f"grad.{n}": p.grad.float().numpy() for n, p in module.named_parameters()})
    row = {"peak": peak}
    if backend is not None:
        row["fired"] = _fired(backend.remat_pass.results, backend.remat_pass.chunk_results)
        choices = backend.remat_pass.choices
        if choices:     # --budget: what the planner estimated, over the step's graphs
            row["estimated_extra_ms"] = sum(c.extra_seconds for c in choices) * 1e3
            row["replans"] = list(backend.remat_pass.replans)      # Inductor's code over the budget
        if LOSS_CHUNK not in row["fired"] and args.budget is None:  # with a budget, the planner's choice
            args.stage = "the loss chunk's refusal"
            for p in module.parameters():
                p.grad = None
            # Planned but not built (FxBuilder refused the region) comes first; else how analyze plans it.
            built = [" ".join(m.split()) for m in backend.remat_pass.chunk_failures if LOSS_CHUNK in m]
            row["refusal"] = " | ".join(built)[:600] or loss_chunk_refusal(module, inputs, precision)
    return row


def loss_chunk_refusal(module, inputs, precision: str) -> str:
    """Why the loss chunk does not fire on the step's joint graphs: its refusals as
    backends.fx.analyze plans them, or, where it matches nowhere, why not at the largest forward
    matmul (the LM head)."""
    from dsl.loader import load_rules
    from engine.analysis import analyze
    from engine.driver import plan_all
    from engine.why_not import why_not

    from backends.fx import joint_graphs
    from backends.fx.importer import import_fx

    rules = load_rules()
    with autocast(precision):
        joints = joint_graphs(module, inputs)
    reasons, unmatched = [], []
    for joint in joints:
        planning = plan_all(lambda fold, joint=joint: import_fx(joint, fold=fold), rules)
        reasons += [f"{r.match.root.name}: {r.reason}" for r in planning.refusals
                    if r.match.rule.name == LOSS_CHUNK]
        graph = import_fx(joint, fold=False)
        forward = analyze(graph, graph.forward_outputs).forward
        matmuls = [n for n in graph.nodes if n.op_type in ("MatMul", "Gemm") and id(n) in forward
                   and isinstance(n.outputs[0].nbytes, int)]
        if matmuls:
            head = max(matmuls, key=lambda n: n.outputs[0].nbytes)
            unmatched += why_not(graph, rules, LOSS_CHUNK, node_name=head.name)
    lines = reasons or [line if "fires at" in line else f"matches nowhere: {line}" for line in unmatched] \
        or ["no matmul in any forward"]
    return " | ".join(dict.fromkeys(" ".join(line.split()) for line in lines))[:600]


def child(args) -> None:
    name, precision, config = args.child.split(":")
    try:
        row = reference_child(name, precision, args) if config == "f64" else torch_child(name, precision, config, args)
    except Exception as exc:  # noqa: BLE001 - the row's failure, in one line
        stage = f"{args.stage}: " if getattr(args, "stage", None) else ""
        print(MARK + json.dumps({"error": f"{stage}{type(exc).__name__}: {_message(exc)[:500]}"}))
        return
    print(MARK + json.dumps({"rows": [row]}))       # as hf_models.run_one reads a child's output


def _message(exc: Exception) -> str:
    """The exception's message on one line; of Inductor's C++ compile errors (the g++ command
    line first), the compiler's first error."""
    text = str(exc)
    compiler = [line for line in text.splitlines() if ": error: " in line]
    return " ".join((compiler[0].split("/")[-1] if compiler else text).split())


def _one(rows: list[dict] | str) -> dict | str:
    """A child's one row (hf_models.run_one's list of rows), or its failure."""
    return rows if isinstance(rows, str) else rows[0]


def errors(out: Path, name: str, precision: str, config: str) -> tuple[float, float] | None:
    """`config`'s loss error and largest gradient error against the float64 reference, or None
    where either run saved nothing."""
    import numpy as np

    from backends.onnx.torch_export import relative_errors

    got, want = _saved(out, name, precision, config), _saved(out, name, precision, "f64")
    if not (got.exists() and want.exists()):
        return None
    errs = relative_errors(dict(np.load(got)), dict(np.load(want)))
    return errs.pop("loss"), max(errs.values(), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(ARCHITECTURES), default=list(ARCHITECTURES))
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--attention", choices=("eager", "sdpa"), default="eager")
    ap.add_argument("--batch", type=int, default=None,
                    help="one batch size for every precision (default: 4)")
    ap.add_argument("--budget", default=None,
                    help="remat's rows plan for this budget (0.6: of the estimated peak; 400MiB) over the "
                         "expensive tier too, as backends.fx.backend(budget=...) does")
    process_arguments(ap, 900, "process")
    args = ap.parse_args()
    env = child_env(args, "remat-hf-sweep-")
    if args.child:
        child(args)
        return
    print(f"Hugging Face causal LMs (vocab {SIZE['vocab_size']}, hidden {SIZE['hidden_size']}, "
          f"{SIZE['num_hidden_layers']} layers, {SIZE['num_attention_heads']} heads, seq {SEQ}, batch "
          f"{'/'.join(f'{batch(p, args)} {p}' for p in args.precisions)}, {args.attention} attention); errors "
          f"against float64 eager; peak: MiB above rest (VmHWM); {args.threads} threads", flush=True)
    head = (f"{'model':12}{'prec':9}{'eager':>9}{'compile loss':>13}{'grad':>9}{'remat loss':>11}{'grad':>9}"
            f"{'/compile':>9}{'peak compile':>13}{'remat':>8}{'ratio':>7}  plans applied")
    print(head)
    print("-" * len(head), flush=True)
    failed: dict[str, list[str]] = {}
    worse, refused, fired_fp32, skipped = [], [], set(), []
    for name in args.models:
        if not supports(name, args.attention):
            print(f"{name:12}skipped: transformers has no {args.attention} attention for it", flush=True)
            skipped.append(name)
            continue
        for precision in args.precisions:
            results = {config: _one(run_one(f"{name}:{precision}:{config}", args, env, __file__))
                       for config in ("f64", *CONFIGS)}
            problems = [f"{config}: {r}" for config, r in results.items() if isinstance(r, str)]
            errs = {config: errors(args.out, name, precision, config) for config in CONFIGS}
            compile_row, remat_row = results["compile"], results["remat"]

            def text(e, i):
                return f"{e[i]:.1e}" if e else "-"

            def largest(e):
                return max(e) if e else None

            ratio_err = "-"
            if errs["compile"] and errs["remat"]:
                floor = ERROR_FLOOR[precision]
                ratio_err = f"{largest(errs['remat']) / max(largest(errs['compile']), 1e-12):.2f}"
                if largest(errs["remat"]) > WORSE * max(largest(errs["compile"]), floor):
                    worse.append(f"{name} {precision}")
            peaks = [r["peak"] if isinstance(r, dict) else None for r in (compile_row, remat_row)]
            peak_text = "".join(f"{p:>{w}.1f}" if p is not None else f"{'-':>{w}}" for p, w in zip(peaks, (13, 8)))
            ratio = f"{peaks[1] / peaks[0]:.3f}" if None not in peaks and peaks[0] > 0 else "-"
            fired = remat_row.get("fired") if isinstance(remat_row, dict) else None
            eager_err = f"{largest(errs['eager']):.1e}" if errs["eager"] else "-"
            print(f"{name:12}{precision:9}{eager_err:>9}{text(errs['compile'], 0):>13}{text(errs['compile'], 1):>9}"
                  f"{text(errs['remat'], 0):>11}{text(errs['remat'], 1):>9}{ratio_err:>9}{peak_text}{ratio:>7}  "
                  f"{fired_text(fired)}", flush=True)
            for problem in problems:
                print(f"    FAILED {problem}", flush=True)
            if problems:
                # remat's own failures apart from those plain compile (Inductor) shares
                kind = "remat" if isinstance(compile_row, dict) else "compile"
                failed.setdefault(kind, []).append(f"{name} {precision} ({', '.join(p.split(':')[0] for p in problems)})")
            if fired is not None and LOSS_CHUNK in fired and precision == "fp32":
                fired_fp32.add(name)
            if isinstance(remat_row, dict) and "estimated_extra_ms" in remat_row:
                print(f"    budget {args.budget}: estimated extra time {remat_row['estimated_extra_ms']:.2f} ms",
                      flush=True)
                for replan in remat_row.get("replans", []):
                    print(f"    {replan}", flush=True)
            if isinstance(remat_row, dict) and "refusal" in remat_row:
                print(f"    loss chunk not applied: {remat_row['refusal']}", flush=True)
                refused.append((name, precision))
    rows = (len(args.models) - len(skipped)) * len(args.precisions)
    regressed = [f"{n} {p}" for n, p in refused if n in fired_fp32 and p != "fp32"]
    other = [f"{n} {p}" for n, p in refused if f"{n} {p}" not in regressed]
    skipped_text = f" ({', '.join(skipped)} skipped)" if skipped else ""
    print(f"rows {rows}{skipped_text}; failed where compile ran: "
          f"{', '.join(failed.get('remat', [])) or 'none'}; failed with compile: "
          f"{', '.join(failed.get('compile', [])) or 'none'}; "
          f"remat's error over {WORSE:g}x compile's: {', '.join(worse) or 'none'}; loss chunk refused where "
          f"it fires in fp32: {', '.join(regressed) or 'none'}; loss chunk not applied otherwise: "
          f"{', '.join(other) or 'none'}")


if __name__ == "__main__":
    main()

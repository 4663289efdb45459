"""The `remat` command line: check, analyze, apply, explain, measure, export, export-gpt, pipeline-plan, demo."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dsl.errors import RuleCompileError
from engine.errors import RematError
from engine.failures import PlanFailure

from backends.progress import progress


def _dims(items: list[str] | None) -> dict[str, int]:
    """`--dim NAME=N` options: positive sizes, each dim given one size."""
    dims: dict[str, int] = {}
    for item in items or []:
        name, sep, value = (part.strip() for part in item.partition("="))
        try:
            size = int(value) if sep and name else None
        except ValueError:
            size = None
        if size is None:
            raise RematError(f"--dim {item!r}: expected NAME=INTEGER, like batch=8")
        if size <= 0:
            raise RematError(f"--dim {item!r}: dims are positive, not {size}")
        if dims.get(name, size) != size:
            raise RematError(f"--dim {name} is given twice, as {dims[name]} and {size}")
        dims[name] = size
    return dims


def _writable_file(path: str, option: str) -> Path:
    """Check that `path` can be written, before any work: not a folder, in a folder that exists,
    writable. Nothing is left behind (an existing file is opened to append, not truncated)."""
    target = Path(path)
    if not path.strip():
        raise RematError(f"{option}: an empty file name")
    if target.is_dir():
        raise RematError(f"{option} {path}: is a directory; give a file name")
    folder = target.parent
    if not folder.exists():
        raise RematError(f"{option} {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise RematError(f"{option} {path}: {folder} is not a folder")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise RematError(f"{option} {path}: cannot write it ({exc.strerror or exc})") from None
    if not existed:
        target.unlink(missing_ok=True)
    return target


def _write(path: Path, data: bytes, option: str) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise RematError(f"{option} {path}: writing it failed ({exc.strerror or exc})") from None


def _rules(paths: list[str] | None):
    from dsl.loader import load_rules

    return load_rules(paths or None)


def _load(args):
    from backends.onnx.importer import import_model

    return import_model(args.model, _dims(args.dim))


def _forward(args) -> list[str] | None:
    return args.forward_output or None


def cmd_check(args) -> int:
    rules = _rules(args.rules)
    tiers = ", ".join(sorted(rules.tiers()))
    print(f"ok: {len(rules.rules)} rule(s) in {len(rules.sources)} file(s); tiers: {tiers}")
    for rule in rules.rules:
        print(f"  {rule.name:32s} tier {rule.tier:10s} priority {rule.priority:4d}  {rule.location}")
    return 0


def cmd_analyze(args) -> int:
    from backends.device import profile_for
    from backends.onnx.rewrite import apply_rules
    from engine.budget import annotate_costs, pareto
    from engine.driver import plan_all
    from engine.plans import select
    from engine.report import plan_json, plan_table

    budget = _budget(args)
    with progress(f"planning {args.model}"):
        graph = _load(args)
        budget, base = _of_the_file(args, budget)
        rules = _rules(args.rules)
        planning = plan_all(lambda fold: graph, rules, tuple(args.tier), _forward(args))
        device = profile_for(args.device)
        annotate_costs(planning, device)
        planned = None
        if budget is not None:
            # The choice `remat apply` makes: the planner's, checked against ONNX Runtime's simulated
            # peak and searched again where it is over (engine.driver), not the additive model's alone.
            planned = apply_rules(graph, rules, None, args.tier, _forward(args), budget=budget, device=device)
            planned.choice.mark(planning.plans)
        else:
            select(planning.plans, None)
    points = None
    if args.pareto is not None:
        from backends.plots import pareto_plot

        points = pareto(planning, graph, device)
        pareto_plot(points, _writable_file(args.pareto, "--pareto"), graph.name)
    if args.format == "json":
        data = plan_json(planning)
        if planned is not None:
            data["budget"] = dict(planned.choice.to_json(), simulated_peak_bytes=planned.simulated_peak,
                                  **({"of_the_file": base} if base else {}))
        if points is not None:
            data["pareto"] = [p.to_json() for p in points]
        print(json.dumps(data, indent=2, default=str))
    else:
        print(plan_table(planning, markdown=args.format == "markdown"))
        if planned is not None:
            print(f"\n{base}" if base else "")
            print(planned.budget_line())
        if points is not None:
            print(f"\nwrote {args.pareto}: {len(points)} budgets from {points[0].budget / 2**20:.1f} "
                  f"to {points[-1].budget / 2**20:.1f} MiB")
    return 0


def cmd_apply(args) -> int:
    from backends.onnx.exporter import check_exported, export_model
    from backends.onnx.rewrite import apply_rules
    from engine.plans import parse_config

    config = None if args.config is None else parse_config(args.config, "--config")
    output = _writable_file(args.output, "-o")
    inputs = Path(args.model).with_suffix(".inputs.npz")
    inputs_target = output.with_suffix(".inputs.npz")
    copy_inputs = inputs.is_file() and inputs_target.resolve() != inputs.resolve()
    if copy_inputs:
        _writable_file(str(inputs_target), "-o (its inputs file)")
    budget = _budget(args)
    with progress(f"rewriting {args.model}"):
        graph = _load(args)
        budget, base = _of_the_file(args, budget)
        device = None
        if budget is not None:
            from backends.device import profile_for

            device = profile_for(args.device)
        rewrite = apply_rules(graph, _rules(args.rules), config, args.tier, _forward(args), budget=budget,
                              device=device)
        model = export_model(rewrite.graph)
        check_exported(model)
    _write(output, model.SerializeToString(), "-o")
    if copy_inputs:
        _write(inputs_target, inputs.read_bytes(), "-o (its inputs file)")
    if base:
        print(base)
    print(rewrite.report())
    print(f"\nwrote {args.output}")
    return 0


def _budget(args):
    """--budget or --ratio, as the planner's Budget (None for neither)."""
    from engine.budget import parse_budget, parse_ratio

    if getattr(args, "ratio", None) is not None:
        return parse_ratio(args.ratio)
    budget = None if args.budget is None else parse_budget(args.budget)
    if budget is not None and budget.free:
        budget.limit(0)         # the free budget's ConfigError: an ONNX graph meets its device later
    return budget


def _of_the_file(args, budget):
    """A fraction of the peak (`--budget 0.6`) as bytes of the peak ONNX Runtime reaches on the
    file as given, the peak `remat measure` shows the user. The planner's own base is its
    simulation of the imported graph as remat writes graphs, without the file's value_info, and
    ORT reuses buffers by the shapes a file declares: torch.onnx's export of the GPT-like step
    simulates at 697 MiB imported and 769 MiB as its file (768.8 measured), so `--budget 0.6` took
    0.54x of the measured peak. With `--dim` the file's own sizes are not the ones planned at: the
    planner's base stays."""
    if budget is None or budget.fraction is None or args.dim:
        return budget, None
    from backends.onnx.ort_order import estimated_ort_peak
    from engine.budget import Budget
    from engine.shapes import format_bytes

    peak = estimated_ort_peak(args.model).peak_bytes
    if not peak:
        return budget, None
    limit = Budget(bytes=max(1, int(budget.fraction * peak)))
    return limit, (f"--budget {budget.fraction:g}: {format_bytes(limit.bytes)}, {budget.fraction:g}x the "
                   f"{format_bytes(peak)} ONNX Runtime is estimated to reach on {args.model} as written")


def cmd_explain(args) -> int:
    from engine.why_not import why_not

    for line in why_not(_load(args), _rules(args.rules), args.rule, args.tier, args.node, _forward(args)):
        print(line)
    return 0


def cmd_measure(args) -> int:
    from backends.onnx.feeds import check_feeds, feeds_for, feeds_source
    from backends.onnx.importer import import_model
    from backends.onnx.runtime import max_relative_error, measure, run

    for option, value in (("--repeats", args.repeats), ("--threads", args.threads)):
        if value < 1:
            raise RematError(f"{option} must be at least 1, not {value}")
    dims = _dims(args.dim)
    graph = import_model(args.model, dims)
    feeds = feeds_for(args.model, args.inputs, dims, graph=graph)
    timeline_path = _writable_file(args.timeline, "--timeline") if args.timeline else None
    if timeline_path is not None:
        from backends.plots import pyplot

        pyplot(timeline_path, f"--timeline {args.timeline}")
    draws = False
    if args.compare:
        other_graph = import_model(args.compare)
        check_feeds(other_graph, feeds, feeds_source(args.model, args.inputs), args.compare, dims)
        # ONNX Runtime draws random numbers anew at every run (a Dropout's mask, drop-path's
        # RandomUniformLike): two runs differ by them
        rules = _rules([])
        draws = any(rules.is_random(n) for g in (graph, other_graph) for n in g.walk())
        with progress("comparing the two models' outputs"):
            err, where = max_relative_error(run(args.compare, feeds), run(args.model, feeds),
                                            args.compare, args.model)
    with progress(f"measuring {args.model}"):
        base = measure(args.model, feeds, repeats=args.repeats, threads=args.threads)
    print(f"{args.model}: peak {base.peak_mib:.1f} MiB above rest ({base.rest / 2**20:.1f} MiB), "
          f"step {base.seconds * 1000:.1f} ms on {base.provider}")
    if args.compare:
        with progress(f"measuring {args.compare}"):
            other = measure(args.compare, feeds, repeats=args.repeats, threads=args.threads)
        print(f"{args.compare}: peak {other.peak_mib:.1f} MiB above rest, step {other.seconds * 1000:.1f} ms")
        print(f"peak ratio {_ratio(other.peak_above_rest, base.peak_above_rest)}, "
              f"time ratio {_ratio(other.seconds, base.seconds)}, "
              f"largest relative output difference {err:.2e} ({where})"
              + (": the graphs draw random numbers (dropout masks), which differ from run to run" if draws else ""))
    if timeline_path is not None:
        from backends.onnx.timeline import timeline
        from backends.plots import timeline_plot

        with progress("measuring memory over the step for the timeline"):
            panels = timeline(args.model, feeds, args.compare, threads=args.threads)
            timeline_plot(panels, timeline_path, "remat: memory over one training step (ONNX Runtime, CPU)")
        for p in panels:
            peaks = ", ".join(f"{c.label.split(':')[0]} {c.peak / 2**20:.1f} MiB" for c in p.curves)
            print(f"{p.title}: {peaks}" + (f", VmHWM {p.measured_peak / 2**20:.1f} MiB" if p.measured_peak else ""))
        print(f"wrote {args.timeline}")
    return 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "n/a (the first measured 0)"


def _check_gpt_sizes(args) -> None:
    sizes = {"--vocab": args.vocab, "--d-model": args.d_model, "--layers": args.layers,
             "--heads": args.heads, "--seq": args.seq, "--batch": args.batch}
    for option, value in sizes.items():
        if value < 1:
            raise RematError(f"{option} must be at least 1, not {value}")
    if args.d_model % args.heads:
        raise RematError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    from backends.onnx.feeds import available_memory
    from engine.shapes import format_bytes

    d, tokens = args.d_model, args.batch * args.seq
    params = 2 * args.vocab * d + args.seq * d + args.layers * 12 * d * d
    activations = tokens * args.vocab * 3 + args.layers * (
        args.batch * args.heads * args.seq ** 2 * 3 + tokens * d * 16)
    # float32 bytes: the weights, their gradients and the exporters' copies (4x); the
    # activations, their gradients (2x). A rough bound, to refuse sizes far beyond this machine.
    need = 4 * (4 * params + 2 * activations)
    available = available_memory()
    if available is not None and need > available:
        raise RematError(f"a GPT step of these sizes needs about {format_bytes(need)} to export and "
                         f"check, more than the {format_bytes(available)} of memory available")


def cmd_export_gpt(args) -> int:
    _check_gpt_sizes(args)
    _writable_file(args.output, "-o")
    _writable_file(str(Path(args.output).with_suffix(".inputs.npz")), "-o (its inputs file)")
    from backends.models import GPTConfig
    from backends.onnx.torch_export import export_gpt

    if not 0 <= args.dropout < 1:
        raise RematError(f"--dropout must be in [0, 1), not {args.dropout}")
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads,
                    seq=args.seq, batch=args.batch, dropout=args.dropout)
    with progress("exporting the GPT-like training step and checking its gradients"):
        path, check = export_gpt(cfg, args.output, dynamic=args.dynamic, exporter=args.exporter)
    print(f"wrote {path} and {path.with_suffix('.inputs.npz')}; {check.describe()}")
    return 0


def cmd_export(args) -> int:
    from backends.onnx.user_module import parse_dynamic

    dynamic = parse_dynamic(args.dynamic)
    names = None
    if args.input_names is not None:
        names = [n.strip() for n in args.input_names.split(",")]
        if not all(n.isidentifier() for n in names):
            raise RematError(f"--input-names {args.input_names!r}: give names like idx,targets")
    _writable_file(args.output, "-o")
    _writable_file(str(Path(args.output).with_suffix(".inputs.npz")), "-o (its inputs file)")
    try:
        from backends.onnx.user_module import export_entry
    except ImportError as exc:
        raise RematError(f"export needs torch and onnxscript ({exc})") from None
    with progress(f"exporting {args.entry}'s training step and checking its gradients"):
        path, check = export_entry(args.entry, args.output, names, dynamic or None, args.exporter)
    print(f"wrote {path} and {path.with_suffix('.inputs.npz')}; {check.describe()}")
    return 0


def cmd_demo(args) -> int:
    from backends.demo import run_demo

    workdir = Path(args.workdir)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RematError(f"--workdir {workdir}: cannot create it ({exc.strerror or exc})") from None
    _writable_file(str(workdir / "gpt_step.onnx"), "--workdir")
    return run_demo(workdir)


def cmd_pipeline_plan(args) -> int:
    from engine.budget import parse_ratio
    from engine.pipeline import describe, load_spec, solve, table, uniform

    ratio = None if args.ratio is None else parse_ratio(args.ratio).ratio
    spec = load_spec(args.spec)
    if spec.model is not None:
        try:
            from backends.pipeline.measure import measured_spec
        except ImportError as exc:
            raise RematError(f"{args.spec}: model: measuring a model needs torch ({exc})") from None
        spec = measured_spec(spec)
    plan = solve(spec)
    baseline = None if ratio is None else uniform(spec, ratio)
    if args.json:
        data = plan.to_json()
        if baseline is not None:
            data["baseline"] = baseline.to_json()
        print(json.dumps(data, indent=2))
        return 0
    print(table(plan))
    print(describe(plan))
    if baseline is not None:
        print()
        print(table(baseline))
        print(describe(baseline))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an ONNX training graph (forward + backward)")
    p.add_argument("--dim", action="append", metavar="NAME=N",
                   help="example value of a dynamic dim (repeatable)")
    p.add_argument("--forward-output", action="append", metavar="NAME",
                   help="a forward output (default: the first graph output, the loss)")
    p.add_argument("--rules", nargs="+", metavar="PATH", help="rule files or folders (default: the shipped library)")
    p.add_argument("--tier", action="append", default=[], metavar="TIER",
                   help="enable an opt-in tier of rules, e.g. expensive (softmax, layer norm, matmul)")


def _planner(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--budget", metavar="SIZE|FRACTION",
                       help="the planner chooses the fastest plans whose estimated peak fits: 400MiB, 1.5GiB, "
                            "or a fraction (0.6) of the peak ONNX Runtime is estimated to reach on the file "
                            "as given (what `remat measure` shows)")
    group.add_argument("--ratio", metavar="R",
                       help="a budget by layers: recompute the fraction R in (0, 1] of the layers' stashed "
                            "activations (layers from module paths, or the forward's repeated blocks)")
    p.add_argument("--device", default="cpu", metavar="NAME",
                   help="device profile for the cost model: cpu (measured once, cached), h100, h200, a100")


def _exporter(p: argparse.ArgumentParser) -> None:
    from backends.onnx.exporters import EXPORTERS

    p.add_argument("--exporter", choices=tuple(EXPORTERS), default="make-fx",
                   help="how the step is traced before torch.onnx.export(dynamo=True): "
                        + "; ".join(f"{k}: {v}" for k, v in EXPORTERS.items()))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("remat")
    except PackageNotFoundError:      # run from a checkout that was never installed
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, `remat: error: ...`, exit status 1, like every other bad input."""

    def error(self, message: str):
        self.exit(1, f"remat: error: {self.prog}: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="remat", description="Declarative activation-memory rewrites.")
    ap.add_argument("--version", action="version", version=f"remat {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("check", help="compile rule files and report every error")
    p.add_argument("rules", nargs="*", help="rule files or folders (default: the shipped library)")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("analyze", help="the plan table of a training graph")
    _common(p)
    _planner(p)
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                   help="the plan table as aligned text, a Markdown table (for a PR comment), or JSON")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="the same as --format json")
    p.add_argument("--pareto", metavar="OUT.png|OUT.svg",
                   help="plot estimated peak against estimated extra time over a sweep of budgets")
    p.set_defaults(fn=cmd_analyze)
    p = sub.add_parser("apply", help="rewrite a training graph")
    _common(p)
    _planner(p)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--config", help="plan string KEY:TYPE:COUNT[,...], a JSON list, or a .json file")
    p.set_defaults(fn=cmd_apply)
    p = sub.add_parser("explain", help="why a rule fires or does not, node by node")
    _common(p)
    p.add_argument("--rule", required=True)
    p.add_argument("--node", help="only this node (or the node producing this value)")
    p.set_defaults(fn=cmd_explain)
    p = sub.add_parser("measure", help="peak memory and step time in ONNX Runtime (separate process)")
    p.add_argument("model")
    p.add_argument("--inputs", help="an .npz of inputs (default: MODEL.inputs.npz, else generated)")
    p.add_argument("--dim", action="append", metavar="NAME=N")
    p.add_argument("--compare", metavar="OTHER.onnx", help="measure another model on the same inputs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeline", metavar="OUT.png|OUT.svg",
                   help="draw memory over the step, simulated and measured, for each model (shaded by plan)")
    p.set_defaults(fn=cmd_measure)
    p = sub.add_parser(
        "export", help="export your module's training step to ONNX",
        description="Export the training step (forward and backward in one graph) of your own module to "
                    "ONNX, check its loss and gradients against torch, and write it with its example inputs "
                    "beside it (OUT.inputs.npz). ENTRY is package.module:factory, found as `python -m` finds "
                    "modules (the current folder first): factory() takes no arguments and returns (module, "
                    "example_inputs), a torch.nn.Module and a tuple of tensors, such that "
                    "module(*example_inputs) returns the loss, a floating-point scalar. The graph's inputs "
                    "are the example inputs then the parameters; its outputs the loss, then one gradient per "
                    "parameter (grad.NAME). See docs/exporters.md.")
    p.add_argument("entry", metavar="ENTRY", help="package.module:factory")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--dynamic", action="append", metavar="AXIS=NAME",
                   help="keep this dim of every input that has it symbolic, named NAME (repeatable: "
                        "--dynamic 0=batch --dynamic 1=seq); the example inputs' sizes are the example dims")
    p.add_argument("--input-names", metavar="A,B,...", help="names of the graph's inputs (default input0, ...)")
    _exporter(p)
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("export-gpt", help="export the GPT-like training step (docs/design.md) to ONNX")
    p.add_argument("-o", "--output", required=True)
    for name, default in (("vocab", 4096), ("d-model", 256), ("layers", 4), ("heads", 4),
                          ("seq", 512), ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dynamic", action="store_true", help="keep batch and seq symbolic (dim_param)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on the attention probabilities and the residual branches (gradients are "
                        "checked with it off)")
    _exporter(p)
    p.set_defaults(fn=cmd_export_gpt)
    p = sub.add_parser("pipeline-plan", help="pipeline stages' layers and each layer's recompute option, "
                                             "solved together (seed 004)")
    p.add_argument("spec", metavar="SPEC.json", help="stages, micro-batches, schedule, memory per device, and "
                                                     "each layer's figures or a model to measure (docs/pipeline.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--ratio", metavar="R", help="also show the uniform baseline: the even split with the "
                                                "checkpointing ratio R in (0, 1] applied per stage")
    p.set_defaults(fn=cmd_pipeline_plan)
    p = sub.add_parser("demo", help="export a small GPT step, plan, rewrite, measure, compare")
    p.add_argument("--workdir", default="out/demo")
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    try:
        return args.fn(args)
    except RuleCompileError as err:
        print(err, file=sys.stderr)
        return 1
    except PlanFailure as err:  # a bug in remat at one site, raised in strict mode (REMAT_STRICT=1)
        if os.environ.get("REMAT_DEBUG"):
            raise
        print(f"remat: {err} (set REMAT_DEBUG=1 for a traceback)", file=sys.stderr)
        return 3
    except RematError as err:
        print(f"remat: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except MemoryError:
        print(f"remat: error: {args.command}: ran out of memory; try smaller sizes (--dim)", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`remat analyze ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # an internal error: say so, in one line, unless debugging
        if os.environ.get("REMAT_DEBUG"):
            raise
        print(f"remat: internal error: {type(err).__name__}: {err} (set REMAT_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())

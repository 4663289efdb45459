"""A pipeline spec's layer figures, measured from the model it names (`"model": {...}`).

The model is traced as a pipeline stage holding every layer (backends.pipeline.stages: tokens in,
logits out, the loss outside, as the last stage runs it), the way torch.compile sees it: Dynamo,
then AOTAutograd's joint graph with Inductor's decompositions. Inside that compile (Inductor's
passes need its context) the joint graph is read three ways:

- what each layer holds per micro-batch: the min-cut partitioner's saved tensors, run as Inductor
  runs it (backends.fx.peak.partition), each counted once per buffer and given to the layer whose
  module made it (module paths, engine.budget.layers.find_layers; the embedding goes to the first
  layer, the final norm and head to the last);
- the workspace: the peak model's single-micro-batch peak (backends.fx.peak) less what is held
  (for an option, at least what it recomputes: that exists again in the layer's backward);
- each layer's options: the budget planner's own (engine.budget.options_for: every recompute and
  chunk plan the rules offer, with its extra time by the cost model), grouped by the layer of the
  plan's node, each saving what its effect takes off the memory curve where the forward ends. The
  layer's candidates are the Pareto points of the same solver over those savings: the cheapest
  plans that save each of a sweep of amounts (so one can be "recompute the softmax only"). What a
  candidate then holds is measured: the k-th candidate of every layer is built into the graph at
  once, as a budget's choice is, and partitioned again; a candidate that holds no less than a
  cheaper one is dropped.

Forward and backward times are the cost model's (engine.budget.cost.work, a device profile) over
the layer's forward nodes and the backward nodes that autograd made from them (`seq_nr`).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import fields, replace

from engine.errors import ConfigError, RematError
from engine.pipeline.spec import OPTIMIZERS, Layer, ModelSource, Option, PipelineSpec, check_layer_count

PARETO_STEPS = 6          # amounts swept per layer (the options besides `none`)


def measured_spec(spec: PipelineSpec) -> PipelineSpec:
    """`spec` with its layers' figures measured from its model."""
    if spec.model is None:
        return spec
    source = spec.model
    if source.name != "gpt":
        raise ConfigError(f"{spec.source}: model.name: {source.name!r} is not a model remat can measure; "
                          f"known: gpt (backends.models.GPT)")
    layers = measure_gpt(gpt_config(source, spec.source), source)
    measured = replace(spec, layers=tuple(layers))
    check_layer_count(measured)
    return measured


def gpt_config(source: ModelSource, where: str = "spec"):
    from backends.models import GPTConfig

    known = {f.name for f in fields(GPTConfig)} - {"attention"}
    for key in source.sizes:
        if key not in known:
            raise ConfigError(f"{where}: model.{key}: not a size of the GPT-like model; sizes: "
                              f"{', '.join(sorted(known))} (batch is one micro-batch)")
    cfg = GPTConfig(**source.sizes)
    if cfg.d_model % cfg.heads:
        raise ConfigError(f"{where}: model.d_model: {cfg.d_model} is not a multiple of model.heads {cfg.heads}")
    return cfg


def measure_gpt(cfg, source: ModelSource) -> list[Layer]:
    from backends.models import gpt

    from .stages import GPTStage

    model = gpt(cfg)
    whole = GPTStage(model, 0, cfg.layers, is_first=True, is_last=True)
    idx, _ = model.example_inputs()
    figures = joint_figures(whole, (idx,), source)
    copies = 2 + OPTIMIZERS[source.optimizer]          # the parameter, its gradient, the optimizer's
    weights = [0.0] * cfg.layers
    for name, p in whole.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else \
            0 if name.split(".")[0] in ("tok", "pos") else cfg.layers - 1
        weights[layer] += p.numel() * p.element_size()
    element = model.head.weight.element_size()          # the activations' dtype is the weights'
    block_output = cfg.batch * cfg.seq * cfg.d_model * element
    logits = cfg.batch * cfg.seq * cfg.vocab * element
    layers = []
    for i, f in enumerate(figures):
        last = i == cfg.layers - 1
        # The last stage keeps the logits for the loss's backward and the loss (eager, outside the
        # compiled stage) keeps its log-probabilities: one more logits-sized tensor.
        output = logits if last else block_output
        held_loss = logits if last else 0.0
        options = tuple(replace(o, activation=o.activation + held_loss) for o in f.options)
        layers.append(Layer(f.forward, f.backward, options, weights[i] * 2, weights[i] * (copies - 2),
                            f"blocks.{i}", output))
    return layers


def joint_figures(module, example_inputs: tuple, source: ModelSource) -> list[Layer]:
    """Each layer's figures (held bytes, options, times; no weights), read from the joint graph
    torch.compile makes of one forward and backward of `module` (its output's gradient given)."""
    from backends.fx.timeline import on_joint_graphs

    found = on_joint_graphs(module, example_inputs, lambda joint: read_joint(joint, source), fullgraph=True)
    if not found:
        raise ConfigError("the model's training step gave no joint graph to measure")
    return found[0]


def read_joint(joint, source: ModelSource) -> list[Layer]:
    from backends.device import profile_for
    from backends.fx.compile import FxBuilder
    from dsl.loader import load_rules
    from engine.analysis import analyze
    from engine.budget import find_layers, options_for
    from engine.budget.effects import memory_curve
    from engine.driver import build_selection, plan_all

    rules = load_rules()
    device = profile_for(source.device)
    builder = FxBuilder(joint.graph, rules.views, strict=True)
    builder.start()
    planning = plan_all(builder.current, rules, source.tiers)
    graph = builder.current(False)
    analysis = analyze(graph, graph.forward_outputs)
    found, how = find_layers(graph, analysis)
    if how != "module paths" or len(found) < 2:
        raise ConfigError("the model's layers were not found from its module paths (blocks.0, blocks.1, ...)")
    owner = _layer_of_nodes(graph, analysis, found)
    count = len(found)

    # Held bytes: the partitioner's saved tensors, one per buffer.
    held, workspace = _held(joint.graph, joint, owner, count)

    # Times, by the cost model.
    from engine.budget.cost import work

    times = [[0.0, 0.0] for _ in range(count)]
    seq_layer = {n.meta.get("seq_nr"): owner[n.name] for n in joint.graph.nodes
                 if n.name in owner and n.meta.get("seq_nr") is not None}
    by_fx = {n.name: n for n in joint.graph.nodes}
    for node in graph.nodes:
        fx_node = by_fx.get(node.name)
        if analysis.is_forward(node):
            layer, part = owner.get(node.name), 0
        else:
            layer, part = seq_layer.get(fx_node.meta.get("seq_nr")) if fx_node is not None else None, 1
        if layer is None:
            continue
        flops, half, moved = work([node], rules, graph.dim_examples)
        times[layer][part] += device.seconds(flops, moved, 1, half)

    # Options: the planner's, grouped by layer, as Pareto points of held bytes against time.
    curve = memory_curve(graph, rules.views)
    options, conflicts = options_for(planning, curve, device)
    # A stage applies its layers' options as a config (plan key, type, first N occurrences), which
    # names no slice count: a chunk region is an option at the rule's own count only.
    plan_of = {(r.match.rule.name, r.match.root.name): (p.key, int(p.type), len(r.chunks) if hasattr(r, "chunks")
                                                       else None)
               for p in planning.plans for r in p.occurrences}
    options = [o for o in options if plan_of[o.key[0].rule, o.key[0].node][2] == o.key[1]]
    # Where the forward ends (backward nodes that read no activation may come earlier).
    end = 1 + max(i for i, n in enumerate(graph.nodes) if analysis.is_forward(n))
    by_layer: dict[int, list] = {}
    for option in options:
        layer = owner.get(option.key[0].node)
        saving = -sum(delta for first, last, delta in option.effect if first <= end <= last)
        if layer is not None and saving > 0:
            by_layer.setdefault(layer, []).append((option, saving))
    points = [_pareto(by_layer.get(i, []), conflicts) for i in range(count)]
    # What an option holds is measured, not added up: the k-th point of every layer is applied
    # to the graph at once (engine.driver.build_selection, as a budget's choice is built) and
    # partitioned as Inductor will, and each layer's saved tensors are what it holds with its
    # k-th option. (The planner's effect model alone credited some options with more than the
    # layer held.) What an option stops holding is made again in the layer's backward, while the
    # layer's own backward workspace comes and goes: the option's workspace is the larger of the
    # two. (bench/pipeline.py at d 384: adding them put rank 1's estimate 15% over its measured
    # peak; at d 128 leaving the recomputed bytes out put rank 0's 5% under.)
    measured = []
    for k in range(max((len(p) for p in points), default=0)):
        selection = {site: slices for p in points if k < len(p) for site, slices in p[k][0]}
        build_selection(builder, rules, selection, source.tiers, strict=True)
        measured.append(_held(builder.work.graph, builder.work, owner, count)[0])
    layers = []
    for i in range(count):
        unchecked = Option("none", held[i], 0.0, workspace)
        candidates = [(keys, measured[k][i], seconds, max(workspace, held[i] - measured[k][i]))
                      for k, (keys, _, seconds) in enumerate(points[i])]
        kept, lowest = [], held[i]
        for keys, holds, seconds, space in sorted(candidates, key=lambda c: c[2]):
            if holds < lowest:          # cheaper first: keep what holds less than every cheaper one
                kept.append((keys, holds, seconds, space))
                lowest = holds
        names = _named([(keys, holds, seconds) for keys, holds, seconds, _ in kept])
        layers.append(Layer(times[i][0], times[i][1], (unchecked, *(
            Option(name, holds, seconds, space, _plans(keys, plan_of))
            for (name, _, _), (keys, holds, seconds, space) in zip(names, kept)))))
    return layers


def _held(graph, module, owner: dict[str, int], count: int) -> tuple[list[float], float]:
    """Each layer's saved bytes once the partitioner has split `graph` as Inductor does, and the
    workspace: the step's peak by the peak model, less those and the forward's output."""
    from backends.fx.peak import partition, step_graph, step_peak

    forward, backward, own = partition(graph, module)
    held = [0.0] * count
    for base, size in _saved_buffers(forward, own).items():
        held[_owner(base, owner, count)] += size
    output = next(n for n in forward.graph.nodes if n.op == "output").args[0][0]
    return held, max(0.0, step_peak(step_graph(forward, backward, own)) - sum(held) - _nbytes(output))


def _layer_of_nodes(graph, analysis, found) -> dict[str, int]:
    """fx node name -> layer index, for the forward: the layer's own nodes, and what runs before
    the first layer (the embedding) or after one (the head) goes with the layer before it."""
    owner: dict[str, int] = {}
    member = {id(n): i for i, layer in enumerate(found) for n in layer.nodes}
    current = 0
    for node in graph.nodes:
        if not analysis.is_forward(node):
            continue
        current = member.get(id(node), current)
        for name in (node.name, *(node.backend_nodes or ())):
            owner[name] = current
    return owner


def _owner(node, owner: dict[str, int], count: int) -> int:
    """The layer of a saved value's producer: by name, else by its module path, else by the
    latest layer among its inputs (a node Inductor's passes made)."""
    seen = set()
    stack = [node]
    best = None
    while stack:
        n = stack.pop()
        if n.name in owner:
            return owner[n.name]
        scope = _scope_layer(n, count)
        if scope is not None:
            return scope
        if id(n) in seen:
            continue
        seen.add(id(n))
        for arg in n.all_input_nodes:
            if arg.name in owner:
                best = max(best if best is not None else 0, owner[arg.name])
            else:
                stack.append(arg)
    return best if best is not None else 0


def _scope_layer(node, count: int) -> int | None:
    from backends.fx.importer import _scope

    scope = _scope(node) or ""
    parts = scope.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return min(int(parts[1]), count - 1)
    return None


def _saved_buffers(forward, own: int) -> dict:
    """The forward's saved values (its outputs after its own), each as the buffer it lives in
    (a view counts as its base), with that buffer's bytes; values of the graph's inputs (the
    weights, the input) hold nothing new."""
    from backends.fx.peak import _is_view

    output = next(n for n in forward.graph.nodes if n.op == "output")
    bases = {}
    for value in output.args[0][own:]:
        if not hasattr(value, "op"):
            continue
        base = value
        while _is_view(base) and base.args and hasattr(base.args[0], "op"):
            base = base.args[0]
        if base.op == "placeholder":
            continue
        bases[base] = _nbytes(base)
    return bases


def _nbytes(node) -> float:
    import torch

    value = node.meta.get("val")
    return float(value.numel() * value.element_size()) if isinstance(value, torch.Tensor) else 0.0


def _pareto(candidates: list, conflicts: list) -> list[tuple[tuple, float, float]]:
    """((site, slices) chosen, bytes saved, extra seconds) of the cheapest plans that save each of a sweep
    of amounts, up to the most the layer's plans can save; dominated points dropped."""
    from engine.budget.solve import Option as SolverOption
    from engine.budget.solve import lowest_peak, solve

    if not candidates:
        return []
    top = sum(saving for _, saving in candidates)
    options = [SolverOption(o.key, o.group, o.seconds, [(0, 0, -int(saving))]) for o, saving in candidates]
    groups = {o.group for o in options}
    mine = [(a, b) for a, b in conflicts if a in groups and b in groups]
    live = [int(top)]
    most = top - lowest_peak(live, options, mine)
    points: dict[frozenset, tuple[tuple[str, ...], float, float]] = {}
    for k in range(1, PARETO_STEPS + 1):
        chosen = solve(live, options, int(top - most * k / PARETO_STEPS), mine)
        if not chosen:
            continue
        keys = tuple(sorted((o.key for o in chosen), key=lambda key: (key[0].rule, key[0].node)))
        points[frozenset(keys)] = (keys, float(-sum(o.effect[0][2] for o in chosen)), sum(o.seconds for o in chosen))
    ordered = sorted(points.values(), key=lambda p: (p[2], -p[1]))
    kept, best = [], -math.inf
    for point in ordered:                  # cheaper first: keep those that save more than all cheaper ones
        if point[1] > best:
            kept.append(point)
            best = point[1]
    return kept


def _plans(keys: tuple, plan_of: dict) -> tuple[tuple[str, int, int], ...]:
    """(plan key, type, occurrences) of the plans the chosen (site, slices) belong to."""
    counts = Counter(plan_of[site.rule, site.node][:2] for site, _ in keys)
    return tuple((key, kind, n) for (key, kind), n in sorted(counts.items()))


def _named(points: list) -> list[tuple[str, float, float]]:
    """Option names from the rules they apply (`softmax`, `activation x2+norm`), unique."""
    out, used = [], Counter()
    for keys, activation, extra in points:
        counts = Counter(site.rule.removeprefix("recompute_").removeprefix("chunk_") for site, _ in keys)
        name = "+".join(f"{r}" + (f" x{n}" if n > 1 else "") for r, n in sorted(counts.items()))
        used[name] += 1
        out.append((name if used[name] == 1 else f"{name} #{used[name]}", activation, extra))
    return out

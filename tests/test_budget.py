"""The budget planner: the cheapest plans whose estimated peak fits, solved by HiGHS."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from backends.onnx.exporter import export_model
from backends.onnx.importer import import_model
from backends.onnx.rewrite import apply_rules
from backends.onnx.runtime import max_relative_error, run
from dsl.loader import load_rules
from engine.budget import Budget, BudgetError, choose, parse_budget, preset
from engine.budget.solve import MIP_GAP, Option, applied, lowest_peak, solve
from engine.driver import plan_all
from engine.errors import ConfigError
from engine.shapes import format_bytes
from training_graphs import ACTIVATIONS, Layer, build_mlp

RULES = load_rules()
DEVICE = preset("cpu-default")


@pytest.mark.parametrize("text, want", [
    ("400MiB", 400 * 2**20), ("1.5 GiB", int(1.5 * 2**30)), ("2GB", 2 * 10**9), ("123456789", 123456789),
])
def test_budgets_in_bytes(text, want):
    assert parse_budget(text).bytes == want


def test_budgets_as_fractions_and_bad_budgets():
    assert parse_budget("0.6").fraction == 0.6 and parse_budget(0.25).fraction == 0.25
    for bad in ("", "0", "-1", "1.5", "abc", "12 parsecs", "nanMiB", "1e40GiB", True):
        with pytest.raises(ConfigError, match="budget"):
            parse_budget(bad)


def test_a_free_budget_is_the_free_memory_less_a_reserve_and_a_tenth():
    assert parse_budget("free") == Budget(free=True)
    assert parse_budget("FREE - 2GiB") == Budget(free=True, reserve=2 * 2**30)
    assert parse_budget("free-0").reserve == 0 and str(parse_budget("free-512MiB")) == "free-512.00MiB"
    # 10 GiB free, 1 GiB kept back: 0.9 x 9 GiB = 8.1 GiB, rounded down to 1/64 of 8 GiB
    resolved = parse_budget("free").on_device(10 * 2**30, 2**30)
    assert resolved.bytes == 8 * 2**30 and not resolved.free
    assert parse_budget("free-3GiB").on_device(10 * 2**30, 2**30).bytes == int(0.9 * 7 * 2**30) // 2**27 * 2**27
    assert parse_budget("free").on_device(2**30, 2 * 2**30).bytes == 1   # nothing left: the planner's error
    for bad in ("free-", "free-2X", "free-1.5", "free+1GiB", "freely"):
        with pytest.raises(ConfigError, match="budget"):
            parse_budget(bad)
    # Unresolved (no device measured it: an ONNX graph, the engine's planner), it is refused, saying why
    with pytest.raises(ConfigError, match="free on the device the step runs on"):
        parse_budget("free").limit(2**20)
    _, _, graph = _mlp([256, 256], ["Gelu", "Relu"], 0)
    with pytest.raises(ConfigError, match="give bytes"):
        apply_rules(graph, RULES, budget="free", device=DEVICE)


def _random_options(draw_ints, n_steps: int, n_options: int) -> tuple[list[int], list[Option]]:
    live = draw_ints[:n_steps]
    options = []
    rest = draw_ints[n_steps:]
    for j in range(n_options):
        a, b, size, secs = rest[4 * j: 4 * j + 4]
        first, last = sorted((a % n_steps, b % n_steps))
        options.append(Option(j, j // 2 if j % 3 == 0 else f"solo{j}", secs % 7 + 1,
                              [(first, last, -(size % 50))]))
    return live, options


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=40, max_size=40), st.integers(20, 220))
def test_the_solver_finds_the_brute_force_optimum(ints, budget):
    live, options = _random_options(ints, 8, 6)
    best = None
    for picks in itertools.product([0, 1], repeat=len(options)):
        chosen = [o for o, p in zip(options, picks) if p]
        groups = [o.group for o in chosen]
        if len(groups) != len(set(groups)):
            continue
        curve = applied(live, chosen)
        if max(curve) <= budget:
            cost = sum(o.seconds for o in chosen)
            best = cost if best is None else min(best, cost)
    got = solve(live, options, budget)
    if best is None:
        assert got is None
        assert lowest_peak(live, options) > budget
    else:
        # HiGHS stops within MIP_GAP of the optimum (engine/budget/solve.py).
        assert got is not None
        assert best - 1e-9 <= sum(o.seconds for o in got) <= best * (1 + MIP_GAP) + 1e-6


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=40, max_size=40), st.integers(20, 220), st.integers(0, 6))
def test_with_layer_families_the_solver_finds_the_brute_force_optimum(ints, budget, partial_cost):
    """Options that do the same thing in several layers form a family; a family taken in some of
    its layers but not all costs `partial_cost` (those layers compile kernels of their own)."""
    live, options = _random_options(ints, 8, 6)
    for j, o in enumerate(options):
        o.family = ("fam", j % 2) if j < 4 else None
    best = None
    for picks in itertools.product([0, 1], repeat=len(options)):
        chosen = [o for o, p in zip(options, picks) if p]
        groups = [o.group for o in chosen]
        if len(groups) != len(set(groups)) or max(applied(live, chosen)) > budget:
            continue
        partial = sum(1 for f in {o.family for o in options if o.family}
                      if 0 < sum(o.family == f for o in chosen) < sum(o.family == f for o in options))
        cost = sum(o.seconds for o in chosen) + partial_cost * partial
        best = cost if best is None else min(best, cost)
    got = solve(live, options, budget, partial_cost=partial_cost)
    if best is None:
        assert got is None
    else:
        assert got is not None and max(applied(live, got)) <= budget
        partial = sum(1 for f in {o.family for o in options if o.family}
                      if 0 < sum(o.family == f for o in got) < sum(o.family == f for o in options))
        assert best - 1e-9 <= sum(o.seconds for o in got) + partial_cost * partial <= best * (1 + MIP_GAP) + 1e-6


def test_identical_layers_get_identical_plans_unless_an_uneven_choice_pays():
    """Three layers each offer the same two recomputes: saving 20 takes two of family A (2 s) or
    all three of A (3 s). With a layer variant priced at 5 s, the whole family wins."""
    live = [100]
    a = [Option(("a", k), ("a", k), 1.0, [(0, 0, -10)], family="A") for k in range(3)]
    b = [Option(("b", k), ("b", k), 2.5, [(0, 0, -15)], family="B") for k in range(3)]
    assert len(solve(live, a + b, 80)) == 2
    chosen = solve(live, a + b, 80, partial_cost=5.0)
    assert sorted(o.key for o in chosen) == [("a", 0), ("a", 1), ("a", 2)]


def _mlp(widths, activations, seed):
    layers = [Layer(w, a) for w, a in zip(widths, activations)]
    model, feeds = build_mlp(64, layers, examples={"batch": 8, "seq": 64}, seed=seed)
    return model, feeds, import_model(model)


@settings(max_examples=8, deadline=None)
@given(widths=st.lists(st.sampled_from([128, 256, 512]), min_size=2, max_size=4),
       activations=st.lists(st.sampled_from([a for a in ACTIVATIONS if a != "Softmax"]), min_size=4, max_size=4),
       fraction=st.floats(0.3, 1.0), seed=st.integers(0, 3))
def test_the_chosen_plans_fit_the_budget_and_keep_the_numbers(widths, activations, fraction, seed):
    """The budget is judged by the backend's simulation (ONNX Runtime's order and allocator)."""
    from backends.onnx.ort_order import estimated_ort_peak

    model, feeds, graph = _mlp(widths, activations, seed)
    original = estimated_ort_peak(graph).peak_bytes
    try:
        rewrite = apply_rules(graph, RULES, tiers=["expensive"], budget=fraction, device=DEVICE)
    except BudgetError as err:
        assert err.lowest > err.budget and err.original == original
        assert err.budget == int(fraction * original)
        return
    assert rewrite.choice.budget == int(fraction * original)
    assert rewrite.simulated_peak <= rewrite.choice.budget
    assert estimated_ort_peak(rewrite.graph).peak_bytes == rewrite.simulated_peak
    got = run(export_model(rewrite.graph), feeds)
    assert max_relative_error(got, run(model, feeds))[0] <= 1e-5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=56, max_size=56))
def test_a_lower_budget_never_gives_a_higher_estimated_peak_than_a_cheaper_choice(ints):
    """At a lower budget the cheapest set is feasible for the higher one too, so the higher
    budget's choice is at most as costly; its peak is higher unless the two cost the same."""
    live, options = _random_options(ints, 8, 12)
    last = None
    for budget in range(max(live), -1, -15):
        chosen = solve(live, options, budget)
        if chosen is None:
            break
        curve = applied(live, chosen)
        peak, cost = max(curve), sum(o.seconds for o in chosen)
        assert peak <= budget
        if last is not None:
            assert cost >= last[1] - 1e-6
            assert peak <= last[0] or cost == pytest.approx(last[1])
        last = (peak, cost)


def test_a_sweep_of_budgets_on_a_graph():
    _, _, graph = _mlp([512, 512, 512, 512], ["Gelu", "Tanh", "Sigmoid", "Gelu"], 0)
    planning = plan_all(lambda fold: graph, RULES, ("expensive",))
    peaks, times = [], []
    for fraction in (1.0, 0.97, 0.94, 0.91, 0.89):
        try:
            choice = choose(planning, graph, fraction, DEVICE)
        except BudgetError:
            break
        peaks.append(choice.estimated_peak)
        times.append(choice.extra_seconds)
    assert len(peaks) >= 3
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks
    assert all(b >= a for a, b in zip(times, times[1:])), times


def test_an_unreachable_budget_names_the_lowest_peak():
    _, _, graph = _mlp([256, 256], ["Gelu", "Relu"], 0)
    with pytest.raises(BudgetError, match=r"cannot be reached: the lowest estimated peak the rules reach is "
                                          r"[0-9.]+ MiB"):
        apply_rules(graph, RULES, budget="1KiB", device=DEVICE)


def test_a_budget_no_plans_meet_names_the_lowest_peak_built_not_every_plan_at_once(fresh_compiles):
    """On torch, an MLP's GELU and GEMM recomputes all at once simulate at the original's peak
    (the backward holds what they recompute together), where two of them reach 0.79x of it. The
    error names the lowest rewrite the search built, and `settle` compiles with that one (until
    session 45: every plan at once, at 1.00x, named as the lowest peak)."""
    torch = pytest.importorskip("torch")
    from backends.fx import joint_graphs
    from backends.fx.compile import FxBuilder
    from backends.models import MLP
    from engine.driver import rewrite

    torch.manual_seed(0)
    model = MLP([256, 1024, 1024, 64], "gelu")
    [joint] = joint_graphs(model, (torch.randn(4096, 256), torch.randn(4096, 64)))
    with pytest.raises(BudgetError) as raised:
        rewrite(FxBuilder(joint.graph), RULES, tiers=["expensive"], budget=0.7, device=DEVICE, strict=True)
    err = raised.value
    assert err.lowest <= 0.85 * err.original
    done = rewrite(FxBuilder(joint.graph), RULES, tiers=["expensive"], budget=0.7, device=DEVICE, strict=True,
                   settle=True)
    assert done.unmet is not None and done.unmet.lowest == err.lowest == done.simulated_peak
    assert done.choice.selection


def test_a_budget_and_a_config_together_are_refused():
    _, _, graph = _mlp([256, 256], ["Gelu", "Relu"], 0)
    with pytest.raises(ConfigError, match="not both"):
        apply_rules(graph, RULES, config="Gelu+:1:-1", budget=0.5, device=DEVICE)


def test_the_cli_plans_to_a_budget_and_shows_costs(tmp_path, capsys):
    from backends.cli import main

    import onnx

    model, feeds, _ = _mlp([512, 512, 512, 512], ["Gelu", "Tanh", "Sigmoid", "Gelu"], 0)
    path = tmp_path / "m.onnx"

    onnx.save(model, str(path))
    np.savez(path.with_suffix(".inputs.npz"), **feeds)
    assert main(["analyze", str(path), "--budget", "0.92", "--device", "cpu-default"]) == 0
    out = capsys.readouterr().out
    assert "Extra time (est.)" in out and "Budget " in out and " ms" in out
    analyzed = next(line for line in out.splitlines() if line.startswith("Budget "))
    assert main(["apply", str(path), "-o", str(tmp_path / "r.onnx"), "--budget", "0.92",
                 "--device", "cpu-default"]) == 0
    out = capsys.readouterr().out
    assert "the rewritten graph simulates at" in out
    assert analyzed in out.splitlines()         # analyze shows the choice apply makes
    # A fraction is of the peak ONNX Runtime reaches on the file as written (what `remat measure`
    # shows), not of the planner's simulation of the graph as remat would write it.
    from backends.onnx.ort_order import estimated_ort_peak

    limit = int(0.92 * estimated_ort_peak(path).peak_bytes)
    assert f"--budget 0.92: {format_bytes(limit)}, 0.92x the " in out, out
    assert f"Budget {limit / 2**20:.1f} MiB" in out, out
    assert main(["apply", str(path), "-o", str(tmp_path / "r.onnx"), "--budget", "1KiB",
                 "--device", "cpu-default"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lowest estimated peak" in err
    assert main(["analyze", str(path), "--budget", "free"]) == 1     # before importing the model
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no device yet" in err


def test_pareto_writes_a_picture_and_json(tmp_path, capsys):
    import json

    import onnx

    from backends.cli import main

    model, _, _ = _mlp([512, 512, 512, 512], ["Gelu", "Tanh", "Sigmoid", "Gelu"], 0)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    picture = tmp_path / "pareto.png"
    assert main(["analyze", str(path), "--pareto", str(picture), "--json", "--device", "cpu-default"]) == 0
    data = json.loads(capsys.readouterr().out)
    points = data["pareto"]
    assert len(points) >= 2 and picture.stat().st_size > 1000
    assert points[0]["estimated_peak_bytes"] >= points[-1]["estimated_peak_bytes"]


def test_torch_compile_options_reach_the_planner(fresh_compiles):
    torch = pytest.importorskip("torch")
    import warnings

    from backends.fx.saved import relative_error, training_step
    from backends.models import MLP

    torch.manual_seed(0)
    model = MLP([256, 1024, 1024, 64], "gelu")
    inputs = (torch.randn(256, 256), torch.randn(256, 64))
    want_loss, want_grads, _ = training_step(model, model, inputs)
    reports = []
    compiled = torch.compile(model, backend="remat", options={"budget": "1KiB", "device": "cpu-default",
                                                              "report": reports.append, "strict": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, _ = training_step(model, compiled, inputs)
    # 1 KiB cannot be met: the step runs with the plans that reach the lowest peak, and says so.
    [message] = [str(w.message) for w in caught if str(w.message).startswith("remat:")]
    assert "cannot be reached" in message and "lowest peak" in message
    assert any("Budget " in r and "the rewritten graph simulates at" in r for r in reports), reports
    assert relative_error(loss, want_loss) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-5
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot be reached"):      # strict: the budget error is raised
        training_step(model, torch.compile(model, backend="remat", options={"budget": "1KiB", "strict": True,
                                                                            "device": "cpu-default"}), inputs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown remat option"):
        training_step(model, torch.compile(model, backend="remat", options={"budjet": 0.9}), inputs)


@settings(max_examples=3, deadline=None)
@given(widths=st.lists(st.sampled_from([256, 512, 1024]), min_size=2, max_size=3),
       activation=st.sampled_from(["gelu", "tanh", "relu"]), fraction=st.floats(0.5, 0.95))
def test_on_torch_the_chosen_plans_fit_the_budget_and_keep_the_numbers(widths, activation, fraction):
    """The torch path's judge is the partitioned step's simulation (backends.fx.peak)."""
    torch = pytest.importorskip("torch")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _torch_budget_case(torch, widths, activation, fraction)


def _torch_budget_case(torch, widths, activation, fraction):
    from backends.fx.saved import relative_error, training_step
    from backends.models import MLP

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP([256, *widths, 64], activation)
    inputs = (torch.randn(512, 256), torch.randn(512, 64))
    want_loss, want_grads, _ = training_step(model, model, inputs)
    reports = []
    compiled = torch.compile(model, backend="remat", options={
        "budget": fraction, "tiers": ["expensive"], "device": "cpu-default", "report": reports.append,
        "strict": True})
    try:
        loss, grads, _ = training_step(model, compiled, inputs)
    except Exception as err:        # strict: an unreachable budget is raised, naming the lowest peak
        assert "cannot be reached" in str(err)
        return
    [report] = reports
    budget = float(report.split("Budget ")[1].split(" MiB")[0])
    simulated = float(report.split("simulates at ")[1].split(" MiB")[0])
    assert simulated <= budget + 0.05
    assert relative_error(loss, want_loss) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-4


@pytest.mark.parametrize("fraction", [0.98, 0.95, 0.7])
def test_the_budget_search_builds_a_few_rewrites(monkeypatch, fraction):
    """Each probe builds and simulates a whole rewrite (seconds on a large model): the search
    simulates at most MAX_PROBES of them (plus the original, the floor and a rebuild), and what
    it returns fits and costs no more than the plans that reach the lowest peak."""
    from backends.onnx.rewrite import OnnxBuilder
    from engine.budget import reach
    from engine.driver import MAX_PROBES

    simulated = []
    original_simulate = OnnxBuilder.simulate
    monkeypatch.setattr(OnnxBuilder, "simulate", lambda self, g: simulated.append(1) or original_simulate(self, g))
    _, _, graph = _mlp([512, 512, 256, 512], ["Gelu", "Tanh", "Sigmoid", "Gelu"], 1)
    try:
        rewrite = apply_rules(graph, RULES, tiers=["expensive"], budget=fraction, device=DEVICE)
    except BudgetError as err:      # every probe overshot and so did the floor: still a bounded search
        assert err.lowest > err.budget
        assert 2 <= len(simulated) <= MAX_PROBES + 3
        return
    assert 2 <= len(simulated) <= MAX_PROBES + 3
    assert rewrite.simulated_peak <= rewrite.choice.budget
    planning = plan_all(lambda fold: graph, RULES, ("expensive",))
    floor = choose(planning, graph, reach(planning, graph, DEVICE)[1], DEVICE)
    assert rewrite.choice.extra_seconds <= floor.extra_seconds + 1e-12


def test_a_peak_on_a_chunk_slice_buys_finer_slices_not_other_plans(monkeypatch):
    """Where the backend's simulation peaks on a chunk region's slice call, the budget search
    withdraws that region's coarser slice counts and solves the same model budget again, rather
    than lowering the model budget, which buys plans elsewhere that miss the peak. The backend
    here says a slice of 2 holds more than the additive model counts (Inductor's loss body at 2
    slices holds a logits slice and its gradient together, measured), so much more that no set
    with 2 slices fits."""
    from backends.onnx.rewrite import OnnxBuilder
    from engine.budget import Program
    from engine.driver import SlicePeak
    from engine.failures import Site
    from training_graphs import build_ort_loss_head

    model, _ = build_ort_loss_head(4096, 64, 8192)
    graph = import_model(model)
    built, simulate, build = [], OnnxBuilder.simulate, OnnxBuilder.build

    def build_counting(self, result, region, index):
        built.append(len(region.chunks))
        build(self, result, region, index)

    def simulate_coarse_slices_higher(self, g):
        peak = simulate(self, g)
        loops = [n.name for n in g.nodes if n.op == "Loop"]
        if loops and built and built[-1] <= 2:
            # the real peak stays the highest point elsewhere
            self.calls.peak = SlicePeak(self.calls.sites[loops[0]], peak)
            return peak + budget      # over any budget
        return peak

    monkeypatch.setattr(OnnxBuilder, "build", build_counting)
    monkeypatch.setattr(OnnxBuilder, "simulate", simulate_coarse_slices_higher)
    planning = plan_all(lambda fold: graph, RULES, ("expensive",))
    program = Program.of(planning, graph, DEVICE)
    budget = program.curve.peak * 3 // 4
    assert choose(planning, graph, Budget(bytes=budget), DEVICE, program=program).selection, "no plan needed"
    rewrite = apply_rules(graph, RULES, tiers=["expensive"], budget=Budget(bytes=budget), device=DEVICE,
                          strict=True)
    site, count = next((s, k) for s, k in rewrite.choice.selection.items() if k is not None)
    # Two builds: the first at 2 slices, which peaked on its slice, then 4 (stepping the model
    # budget down instead built five, 2, 8, 4, 2, 4, to end at the same choice).
    assert built == [2, count] and count > 2, built
    assert rewrite.simulated_peak <= budget
    # What it chose is what the planner chooses at the budget itself once 2 slices are withdrawn.
    finer = [o for o in program.options if not (o.group == site and o.key[1] <= 2)]
    program.options = finer
    want = choose(planning, graph, Budget(bytes=budget), DEVICE, program=program)
    assert rewrite.choice.selection == want.selection
    assert isinstance(site, Site)


def test_on_torch_the_simulated_peak_is_traced_to_the_chunk_region_it_falls_in():
    """The fx builder names the chunk region whose invoke_subgraph call the simulated peak fell
    on, which the budget search reads (a head's loss in 4 slices: a slice's body, its logits and
    their gradient, is the step's highest point)."""
    import torch
    from torch import nn

    from backends.fx import joint_graph
    from backends.fx.compile import FxBuilder
    from engine.driver import rewrite
    from engine.plan_type import PlanType

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 8192, bias=False)

        def forward(self, x, labels):
            return nn.functional.cross_entropy(self.proj(x), labels)

    torch.manual_seed(0)
    inputs = (torch.randn(1024, 64, requires_grad=True), torch.randint(0, 8192, (1024,)))
    builder = FxBuilder(joint_graph(Head(), inputs).graph, RULES.views, strict=True)
    done = rewrite(builder, RULES, strict=True)
    assert done.chunked == 1, done.report()
    calls = [n.name for n in builder.work.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    region = next(r for plan in done.chunk_result.planning.plans for r in plan.occurrences
                  if plan.type == PlanType.CHUNK)
    site = region.match.site
    assert len(calls) == 4 and {builder.calls.sites[name] for name in calls} == {site}
    peak = builder.simulate(done.result.graph)
    at = builder.calls.peak
    assert at is not None and at.site == site and 0 < at.elsewhere < peak
    builder.start()
    assert builder.calls.peak is None and not builder.calls.sites


def test_on_onnx_the_simulated_peak_is_traced_to_the_loop_it_falls_in():
    """ONNX Runtime's simulation of a head whose loss runs in a Loop peaks in the Loop's body:
    the builder names the region, and the highest point elsewhere lies below that peak."""
    from backends.onnx.rewrite import OnnxBuilder
    from engine.driver import rewrite
    from engine.failures import Site
    from training_graphs import build_ort_loss_head

    model, _ = build_ort_loss_head(4096, 64, 8192)
    builder = OnnxBuilder(import_model(model))
    done = rewrite(builder, RULES, strict=True)
    assert done.chunked == 1
    loops = [n.name for n in done.result.graph.nodes if n.op == "Loop"]
    site = Site("chunk_linear_cross_entropy", "n_logits_4")
    assert loops and {builder.calls.sites[name] for name in loops} == {site}
    peak = builder.simulate(done.result.graph)
    at = builder.calls.peak
    assert at is not None and at.site == site and 0 < at.elsewhere < peak

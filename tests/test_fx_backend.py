"""The torch side: the ATen joint graph in the IR, and the same rules giving the same plans."""
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import backends.fx as fx_backend  # noqa: E402
from backends.fx.importer import import_fx  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import GPTConfig, gpt  # noqa: E402
from backends.onnx.importer import import_model  # noqa: E402
from backends.onnx.torch_export import export_training_step  # noqa: E402
from dsl.loader import compile_text, load_rules  # noqa: E402
from engine.analysis import analyze  # noqa: E402
from engine.apply import plan  # noqa: E402
from engine.plan_type import PlanType  # noqa: E402

CFG = GPTConfig(vocab=1024, d_model=128, layers=2, heads=4, seq=256, batch=8)

# Each difference between the backends' plan keys, with its reason.
KNOWN_DIFFERENCES = {
    # torch.onnx exports aten.split_with_sizes (one node, several outputs) as SplitToSequence + SequenceAt.
    "SplitToSequence+SequenceAt+": "Split+",
}
# Plans only the ONNX export has, with their reason.
ONNX_ONLY = {
    # A weight transposed for the backward (`permute_7 = Transpose(blocks_0_fc_weight)`): ONNX
    # Runtime copies it; in torch it is a view of the weight, which recomputing saves nothing of.
    "Transpose+": "a view of a weight in torch",
}


@pytest.fixture(scope="module")
def model():
    return gpt(CFG)


@pytest.fixture(scope="module")
def joint(model):
    """The model's joint graph, traced once for the tests that import it (import_fx only reads it)."""
    return fx_backend.joint_graph(model, model.example_inputs())


def test_joint_graph_imports_with_onnx_names_and_native_ops(joint):
    graph = import_fx(joint)
    graph.verify()
    ops = {n.op for n in graph.nodes}
    assert {"Gelu", "Softmax", "LayerNormalization", "MatMul", "Gemm", "Reshape"} <= ops
    gelu = next(n for n in graph.nodes if n.op == "Gelu")
    assert gelu.native_op == "aten::gelu"
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    assert softmax.attrs["axis"] == -1
    a = analyze(graph, graph.forward_outputs)
    assert graph.forward_outputs == [graph.outputs[0].name] and a.stashed


@pytest.fixture(scope="module")
def exported(model):
    return import_model(export_training_step(model, model.example_inputs(), ["idx", "targets"]).model)


def test_same_rules_same_plans_on_both_backends(model, exported):
    fx_plans = fx_backend.analyze(model, model.example_inputs(), tiers=["expensive"], show=False).plans
    onnx_plans = plan(exported, load_rules(), ["expensive"]).plans

    def normalized(plans):
        out = {}
        for p in plans:
            key = p.key
            for onnx_spelling, torch_spelling in KNOWN_DIFFERENCES.items():
                key = key.replace(onnx_spelling, torch_spelling)
            out[(key, p.type)] = p.frequency
        return out

    fx_keys, onnx_keys = normalized(fx_plans), normalized(onnx_plans)
    assert len(fx_keys) >= 8
    assert fx_keys == {k: n for k, n in onnx_keys.items() if k[0] not in ONNX_ONLY}
    assert ("Transpose+", PlanType.RECOMPUTE) in onnx_keys


def test_attention_chunk_plans_are_found_on_both_backends(joint, exported):
    """The shipped attention rule, with its sizes lowered to this small model's scores
    (8 MiB a layer, in 2 MiB slices): one type-3 plan per layer on the joint graph and on its ONNX
    export, both growing two-phase regions (ONNX reductions read their axes from an input)."""
    text = (Path(__file__).resolve().parent.parent / "rules" / "chunk.rule").read_text()
    text = text.replace("bytes(scores) >= 16 MiB", "bytes(scores) >= 4 MiB").replace("bytes(scores) / 4 MiB",
                                                                                  "bytes(scores) / 2 MiB")
    rules = compile_text(text, "chunk.rule")
    rules = rules.of_types({3})
    fx_planning = plan(import_fx(joint, fold=False), rules)
    onnx_planning = plan(exported, rules)
    for planning in (fx_planning, onnx_planning):
        [chunk] = [p for p in planning.plans if p.rules == ["chunk_attention_scores"]]
        assert chunk.config_string() == "MatMul+Softmax+:3:-1" and chunk.frequency == CFG.layers
        assert all(len(region.phases) == 2 for region in chunk.occurrences)
        assert chunk.occurrences[0].saved > 0


SMALL = GPTConfig(vocab=256, d_model=64, layers=2, heads=4, seq=128, batch=4)


def test_compiled_with_remat_matches_eager_and_saves_less(fresh_compiles):
    model = gpt(SMALL)
    eager_loss, eager_grads, _ = training_step(model, model)
    _, _, inductor_saved = training_step(model, torch.compile(model))
    torch._dynamo.reset()
    remat = fx_backend.backend(tiers=["expensive"])
    loss, grads, saved = training_step(model, torch.compile(model, backend=remat))
    assert relative_error(loss, eager_loss) <= 1e-4
    for g, e in zip(grads, eager_grads):
        assert relative_error(g, e) <= 1e-4
    [result] = remat.remat_pass.results
    applied = {p.key for p in result.plans if p.applied}
    assert {"Gelu+Reshape+", "MatMul+Reshape+Mul+Where+Softmax+"} <= applied
    assert saved < 0.8 * inductor_saved, (saved, inductor_saved)


def test_registered_backend_and_cache_key(fresh_compiles):
    from backends.fx.compile import RematPass

    model = gpt(GPTConfig(vocab=64, d_model=32, layers=1, heads=2, seq=16, batch=2))
    loss = torch.compile(model, backend="remat")(*model.example_inputs())
    assert torch.isfinite(loss)
    rules = load_rules()
    keys = {RematPass(rules).uuid(), RematPass(rules, "Gelu+:1:-1").uuid(),
            RematPass(rules, tiers=["expensive"]).uuid()}
    assert len(keys) == 3 and RematPass(rules).uuid() == RematPass(load_rules()).uuid()



def test_a_compile_that_asks_for_the_report_reports_though_aotautograd_cached_the_graph(tmp_path, monkeypatch):
    """With the compile caches on (a user's default), a block compiled before is served from
    AOTAutograd's cache, which skips the joint pass: a compile that asks for the report skips that
    cache instead, so the pass runs and reports (without that, it reported nothing)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    block = gpt(GPTConfig(vocab=64, d_model=32, layers=1, heads=2, seq=16, batch=2)).blocks[0]
    x = torch.randn(2, 16, 32, requires_grad=True)
    counters.clear()
    reports: list[str] = []
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        for options in ({}, {}, {"report": reports.append}):
            torch._dynamo.reset()
            torch.compile(block, backend="remat", options=options)(x).sum().backward()
    torch._dynamo.reset()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])  # the second
    assert len(reports) == 1 and "Stashed activations" in reports[0], reports


def test_report_true_prints_the_plan_table_and_a_report_that_cannot_be_called_is_refused(capsys):
    """`options={"report": True}` is how users ask for the table; it used to reach the pass as a
    bool, be called, and make the compile fall back to Inductor without remat."""
    import warnings

    from engine.errors import ConfigError

    block = gpt(GPTConfig(vocab=64, d_model=32, layers=1, heads=2, seq=16, batch=2)).blocks[0]
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # remat's fallback warning fails the test
        torch.compile(block, backend="remat", options={"report": True, "strict": False})(x).sum().backward()
    torch._dynamo.reset()
    assert "Stashed activations" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="report must be True"):
        fx_backend.backend(report="plans.txt")


def _decomposed(with_outside_read_inside: bool):
    """gelu decomposed into exp and mul (same original_aten and seq_nr); optionally the mul also
    reads a value produced between the two members."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4)
    group = {"original_aten": torch.ops.aten.gelu.default, "seq_nr": 7, "partitioner_tag": "is_forward"}
    a = g.call_function(torch.ops.aten.exp.default, (x,))
    a.meta.update(val=torch.randn(4), **group)
    other = g.call_function(torch.ops.aten.neg.default, (x,))
    other.meta["val"] = torch.randn(4)
    c = g.call_function(torch.ops.aten.mul.Tensor, (a, other if with_outside_read_inside else x))
    c.meta.update(val=torch.randn(4), **group)
    out = g.call_function(torch.ops.aten.add.Tensor, (c, other))
    out.meta["val"] = torch.randn(4)
    g.output((out,))
    return g


def test_decomposed_op_folds_into_one_node_only_when_contiguous():
    folded = import_fx(_decomposed(False))
    assert [n.op for n in folded.nodes] == ["Gelu", "Neg", "Add"]
    assert folded.nodes[0].backend_nodes == ["exp_default", "mul_tensor"]
    kept = import_fx(_decomposed(True))
    assert [n.op for n in kept.nodes] == ["Exp", "Neg", "Mul", "Add"]


def test_fills_import_with_the_number_every_element_holds():
    """`Value.filled` from ATen's fills (full, full_like, zeros_like, scalar_tensor) and from a
    number an op reads as an operand (`where(mask, g, 0)`'s zero), so the engine finds a
    gradient's zeros without ATen's argument positions; nothing else is a fill."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4)
    made = {}
    for name, target, args in (("full", torch.ops.aten.full.default, ([4], 0.0)),
                               ("full_like", torch.ops.aten.full_like.default, (x, 2.5)),
                               ("zeros_like", torch.ops.aten.zeros_like.default, (x,)),
                               ("scalar", torch.ops.aten.scalar_tensor.default, (1.0,))):
        made[name] = g.call_function(target, args)
        made[name].meta["val"] = torch.zeros(4) if name != "scalar" else torch.tensor(1.0)
    mask = g.call_function(torch.ops.aten.gt.Scalar, (x, 0.0))
    mask.meta["val"] = torch.ones(4, dtype=torch.bool)
    picked = g.call_function(torch.ops.aten.where.ScalarOther, (mask, made["full_like"], 0.0))
    picked.meta["val"] = torch.randn(4)
    total = g.call_function(torch.ops.aten.add.Tensor, (picked, made["full"]))
    total.meta["val"] = torch.randn(4)
    g.output((total, made["zeros_like"], made["scalar"]))
    graph = import_fx(g)
    filled = {n.backend_nodes[0]: n.outputs[0].filled for n in graph.nodes}
    assert filled == {"full_default": 0.0, "full_like_default": 2.5, "zeros_like_default": 0.0,
                      "scalar_tensor_default": 1.0, "gt_scalar": None,
                      "where_scalar_other": None, "add_tensor": None}
    where = next(n for n in graph.nodes if n.backend_nodes == ["where_scalar_other"])
    assert [v.filled for v in where.inputs][1:] == [2.5, 0.0]       # the literal zero is a fill


def test_a_torch_compile_mode_reaches_inductor_through_the_registered_backend(fresh_compiles, monkeypatch):
    """torch.compile(mode=...) gives a registered backend its mode: remat compiles under the
    mode's Inductor settings (reduce-overhead: CUDA graphs, which Inductor skips on a CPU), and
    an unknown mode is the caller's error."""
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    from engine.errors import ConfigError

    seen = []
    real = compile_fx_module.compile_fx

    def spy(*args, **kwargs):
        seen.append(inductor_config.triton.cudagraphs)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    model = gpt(GPTConfig(vocab=64, d_model=32, layers=1, heads=2, seq=16, batch=2))
    eager_loss, _, _ = training_step(model, model)
    loss, _, _ = training_step(model, torch.compile(model, backend="remat", mode="reduce-overhead"))
    assert seen and all(seen), seen
    assert relative_error(loss, eager_loss) <= 1e-4
    with pytest.raises(ConfigError, match="unknown torch.compile mode"):
        fx_backend.backend(mode="fastest")


def test_in_place_ops_on_scores_leave_clones_that_compute_the_same_joint_graph():
    """`scores.div_(8)` and `scores.masked_fill_(mask, -inf)` on attention scores: AOTAutograd's
    backward writes them as `copy(new_empty_strided(...), g)` and `copy(view, masked_fill(...))`,
    which no chunk kind knows; backends.fx.normalize writes each as a clone, and the joint
    graph computes the same numbers."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    from backends.fx.normalize import strided_copies_as_clones

    joints = []

    def partition(joint, inputs, **kwargs):
        joints.append(copy.deepcopy(joint))
        return default_partition(joint, inputs, **kwargs)

    def scores(q, k, mask):
        s = q @ k.transpose(-1, -2)
        s.div_(8.0)
        s.masked_fill_(mask, float("-inf"))
        return s.softmax(-1).sum()

    torch._dynamo.reset()
    q, k = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(2))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition)
    torch.compile(scores, backend=backend)(q, k, mask).backward()
    [joint] = joints
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    g = torch.Generator().manual_seed(0)
    real = [torch.randn(n.meta["val"].shape, generator=g) if n.meta["val"].is_floating_point()
            else torch.ones(n.meta["val"].shape, dtype=n.meta["val"].dtype).triu(1) for n in placeholders]
    primals, tangents = real[:-1], real[-1:]
    want = joint(primals, tangents)
    assert strided_copies_as_clones(joint.graph) >= 2       # 4 on torch 2.13: two per in-place op
    joint.recompile()
    targets = {n.target for n in joint.graph.nodes}
    assert torch.ops.aten.copy.default not in targets and torch.ops.aten.new_empty_strided.default not in targets
    got = joint(primals, tangents)
    assert all(torch.equal(a, b) for a, b in zip(want, got) if isinstance(a, torch.Tensor))


def test_a_tag_on_a_node_the_builder_rewrote_reaches_the_graph_that_compiles():
    """FxBuilder.start writes a strided copy as a clone in its working copy. Where a plan tags that
    clone, copying the tags alone onto the user's graph by name would leave its `copy` untagged,
    and the partitioner would keep what the plan recomputes: such a working copy is committed
    whole."""
    import copy

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from backends.fx.compile import FxBuilder

    joints = []

    def partition(joint, inputs, **kwargs):
        joints.append(copy.deepcopy(joint))
        return default_partition(joint, inputs, **kwargs)

    def scores(q, k):
        s = q @ k.transpose(-1, -2)
        s.div_(8.0)
        return s.softmax(-1).sum()

    torch._dynamo.reset()
    q, k = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(2))
    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition)
    torch.compile(scores, backend=backend)(q, k).backward()
    [joint] = joints
    builder = FxBuilder(joint.graph)
    builder.start()
    assert builder.normalized > 0
    clone = next(n for n in builder.work.graph.nodes if n.target is torch.ops.aten.clone.default
                 and n.name not in {m.name for m in joint.graph.nodes})
    clone.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    builder.commit()
    tagged = [n for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert [n.target for n in tagged] == [torch.ops.aten.clone.default]
    assert torch.ops.aten.copy.default not in {n.target for n in joint.graph.nodes}


def test_a_loss_computed_after_the_compiled_module_is_named_as_what_keeps_the_logits_whole(fresh_compiles):
    """The model compiled, the loss in eager code after it (a common training loop): the logits
    are the graph's output, whole whatever remat does, and the user hears where to put the loss."""
    head = torch.nn.Sequential(torch.nn.Embedding(1024, 64), torch.nn.Linear(64, 16384, bias=False))
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(head, backend=remat)
    ids = torch.randint(0, 1024, (4, 128))
    logits = compiled(ids)
    torch.nn.functional.cross_entropy(logits.view(-1, 16384), ids.view(-1)).backward()
    [notice] = remat.remat_pass.notices
    assert notice.startswith("remat: chunk_linear_cross_entropy not applied: the compiled graph returns a "
                             "float32[512, 16384] tensor of 32.00 MiB to its caller") \
        and "Compute the loss inside what torch.compile compiles" in notice, notice
    assert remat.remat_pass.chunked == 0


def test_a_large_gradient_the_step_returns_is_not_taken_for_a_loss_outside_the_graph(recwarn):
    """`h @ w` over a parameter `h` (a learned table: learned queries, prompt tokens), the
    product scaled by a parameter and summed: the loss rule would slice the rows of `h`, whose
    gradient, the region's one large value, the step returns whole in any plan. The region is
    refused for that, and the user was told to compute the loss inside the compiled code, which
    already does (engine.testing's generated graphs drew it)."""
    from backends.fx.testing import run
    from engine.testing.generate import rule_alone, training_graph
    from engine.testing.graphs import GraphBuilder

    b = GraphBuilder()
    h, w, tail = b.param("h", shape=(2048, 2048)), b.param("w", shape=(2048, 2)), b.param("tail", shape=(2048, 2))
    rows = b.emit("ReduceSum", [b.emit("Mul", [b.emit("MatMul", [h, w]), tail]), b.const([-1], "int64")], keepdims=0)
    tg = training_graph(b, b.emit("ReduceSum", [rows], keepdims=0))
    rules = load_rules()
    done = run(tg, rule_alone(rules, rules.rule("chunk_linear_cross_entropy")))
    assert not done.applied
    assert not [w for w in recwarn if "to its caller" in str(w.message)]

"""Dropout on the fx backend (issue 15): a recompute region through a dropout keeps its mask and
replays it (std.ops's `replay Dropout`, built in ATen by backends/fx/replay.py), so the step's
loss and gradients are eager's under the same random numbers."""
import pytest

torch = pytest.importorskip("torch")

import torch._inductor.config as inductor_config  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.importer import import_fx  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import GPTConfig, gpt  # noqa: E402
from engine.dtypes import DType  # noqa: E402
from engine.plan_type import RECOMPUTE_TYPES  # noqa: E402

# The attention probabilities (batch x heads x seq x seq floats) are 256 KiB, dropout.rule's floor.
CFG = GPTConfig(vocab=256, d_model=64, layers=1, heads=4, seq=64, batch=4, dropout=0.1)
PROBS = (CFG.batch, CFG.heads, CFG.seq, CFG.seq)


def saved_shapes(compiled, inputs) -> list[tuple[torch.dtype, tuple]]:
    """(dtype, shape) of each tensor the step keeps for backward."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(*inputs)
    return saved


def scores_like(saved: list[tuple[torch.dtype, tuple]]) -> list[tuple]:
    """The kept float tensors of attention probabilities' shape (heads folded into the batch or not)."""
    folded = (CFG.batch * CFG.heads, CFG.seq, CFG.seq)
    return [shape for dtype, shape in saved if dtype == torch.float32 and shape in (PROBS, folded)]


@pytest.mark.parametrize("fallback_random", [True, False], ids=["aten-op", "inductor-decomposed"])
def test_the_joint_graph_imports_each_dropout_as_onnx_dropout(fallback_random):
    """Inductor decomposes native_dropout (rand > p, then two muls) unless fallback_random keeps the
    ATen op; either way the IR has Dropout(x, ratio) -> (y, mask), the ratio a literal, as ONNX's."""
    model = gpt(CFG)
    with inductor_config.patch(fallback_random=fallback_random):
        graph = import_fx(fx_backend.joint_graph(model, model.example_inputs()))
    dropouts = [n for n in graph.nodes if n.op == "Dropout"]
    assert len(dropouts) == 3 * CFG.layers
    for node in dropouts:
        y, mask = node.outputs
        assert node.native_op == "aten::native_dropout" and node.attrs["training_mode"] is True
        assert (y.dtype, mask.dtype) == (DType.FLOAT32, DType.BOOL) and y.shape == mask.shape
        assert node.inputs[1].literal and abs(float(node.inputs[1].data) - CFG.dropout) < 1e-12


def test_dropout_regions_are_recomputed_from_the_mask_and_match_eager(fresh_compiles):
    model = gpt(CFG)
    inputs = model.example_inputs()
    planning = fx_backend.analyze(model, inputs, show=False)
    through = [p for p in planning.plans if "Dropout+" in p.key]
    assert through and all(p.type in RECOMPUTE_TYPES for p in through)
    assert not [r for r in planning.refusals if "nondeterministic" in r.reason.message]

    remat = fx_backend.backend()
    compiled = torch.compile(model, backend=remat)
    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(1)
        want_loss, want_grads, _ = training_step(model, model, inputs)
        torch.manual_seed(1)
        loss, grads, _ = training_step(model, compiled, inputs)
        torch.manual_seed(1)
        saved = saved_shapes(compiled, inputs)
    assert relative_error(loss, want_loss) < 1e-4
    assert max(relative_error(g, w) for g, w in zip(grads, want_grads)) < 1e-4
    [result] = remat.remat_pass.results
    assert [p for p in result.plans if "Dropout+" in p.key and p.applied]
    # Kept: the mask and the softmax's output (its gradient reads it, and so does the replay); the
    # dropout's output, which the values' matmul gradient reads, is replayed, not kept.
    assert (torch.bool, PROBS) in saved and len(scores_like(saved)) == 1


def test_the_replay_reads_the_mask_inductor_drew(fresh_compiles):
    """Without fallback_random Inductor draws its own random numbers (not eager's): the step with
    remat's replay equals torch.compile's without it, seed for seed, so the backward read the
    forward's mask."""
    model = gpt(CFG)
    inputs = model.example_inputs()
    inductor = torch.compile(model)
    torch.manual_seed(1)
    want_loss, want_grads, want_saved = training_step(model, inductor, inputs)
    want_kept = saved_shapes(inductor, inputs)
    torch._dynamo.reset()
    remat = fx_backend.backend()
    compiled = torch.compile(model, backend=remat)
    torch.manual_seed(1)
    loss, grads, saved = training_step(model, compiled, inputs)
    assert relative_error(loss, want_loss) < 1e-5
    assert max(relative_error(g, w) for g, w in zip(grads, want_grads)) < 1e-4
    assert [p for p in remat.remat_pass.results[0].plans if "Dropout+" in p.key and p.applied]
    assert saved < want_saved
    assert len(scores_like(want_kept)) == 2 and len(scores_like(saved_shapes(compiled, inputs))) == 1



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_replay_computes_atens_dropout_to_the_bit(dtype):
    """std.ops's replay of aten::native_dropout, built in ATen (backends/fx/replay.py), gives the
    op's own output from its mask: x * mask times 1 / (1 - p) rounded to x's type (1.109375 in
    bfloat16 for p = 0.1). ONNX Runtime's template, x * mask / (1 - p), differed in a quarter of
    the elements in bfloat16, and a ReLU after it turned that into gradients 10% off eager's
    (the zoo's random_4242_7)."""
    import operator

    from torch import fx

    from backends.fx.replay import build_replay
    from dsl.loader import load_rules
    from engine.ir import Node, Value
    from engine.strategies.replay import bound_replay

    graph = fx.Graph()
    x = graph.placeholder("x")
    drop = graph.call_function(torch.ops.aten.native_dropout.default, (x, 0.1, True))
    y, mask = (graph.call_function(operator.getitem, (drop, k)) for k in (0, 1))
    graph.output((y, mask))
    ours = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}[dtype]
    shape = (64, 512)
    node = Node("Dropout", [Value("x", ours, shape), Value("ratio", DType.FLOAT32, (), literal=True, data=0.1)],
                [Value(y.name, ours, shape), Value(mask.name, DType.BOOL, shape)],
                {"training_mode": True}, "drop", native_op="aten::native_dropout")
    bound = bound_replay(load_rules(), node)
    build_replay(graph, bound, {"x": x, y.name: y, mask.name: mask})
    assert "div" not in str(graph)
    inputs = torch.randn(shape).to(dtype)
    torch.manual_seed(0)
    got, got_mask = fx.GraphModule({}, graph)(inputs)
    torch.manual_seed(0)
    want, want_mask = torch.ops.aten.native_dropout(inputs, 0.1, True)
    assert torch.equal(got_mask, want_mask) and torch.equal(got, want)

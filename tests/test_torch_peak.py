"""The torch path's peak model (backends.fx.peak) against the tensors a compiled step really
holds (the profiler's allocation events), on graphs the partitioner and Inductor reshape."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backends.fx.peak import step_graph, step_peak  # noqa: E402
from backends.fx.saved import tensor_peak  # noqa: E402


def _estimate_and_measure(model, compiled, inputs, accounts: list | None = None) -> tuple[int, int]:
    """remat's estimate of the compiled step and the tensors it holds; `accounts` receives
    Inductor's own account of the code it generated (backends.fx.inductor_account)."""
    import torch._inductor.compile_fx as compile_fx

    from backends.fx.inductor_account import inductor_account

    estimates = []
    partition = compile_fx.min_cut_rematerialization_partition

    def partition_and_estimate(joint, joint_inputs, **kwargs):
        forward, backward = partition(joint, joint_inputs, **kwargs)
        estimates.append(step_peak(step_graph(forward, backward, kwargs["num_fwd_outputs"])))
        return forward, backward

    def step():
        compiled(*inputs).backward()
        for p in model.parameters():
            p.grad = None

    compile_fx.min_cut_rematerialization_partition = partition_and_estimate
    try:
        with inductor_account() as account:
            step()
        step()
        if accounts is not None:
            accounts.append(account)
    finally:
        compile_fx.min_cut_rematerialization_partition = partition
    [estimate] = estimates
    return estimate, tensor_peak(step)


@pytest.mark.parametrize("backend, budget", [
    ("inductor", None), ("remat", None), ("remat-expensive", None), ("inductor", 0.1),
])
def test_the_estimate_is_within_ten_percent_of_the_tensors_a_gpt_step_holds(fresh_compiles, backend, budget):
    import torch._functorch.config as functorch_config

    from backends.fx import backend as remat_backend
    from backends.models import GPTConfig, gpt

    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=1024, batch=4, layers=2, d_model=128, heads=4, seq=256))
    if backend == "remat-expensive":
        backend = remat_backend(tiers=["expensive"])
    accounts = []
    with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
        estimate, measured = _estimate_and_measure(model, torch.compile(model, backend=backend),
                                                   model.example_inputs(), accounts)
    assert measured > 2**20
    assert 0.9 <= estimate / measured <= 1.1, (estimate, measured)
    # Inductor's account of its forward and backward: a lower bound of what the step holds (it
    # leaves out a chunk's slice body), which the budget check relies on (backends.fx.replan).
    [account] = accounts
    assert len(account.graphs) == 2 and not account.failures
    assert 0.75 * measured <= account.peak_bytes <= measured, (account.peak_bytes, measured)


def test_the_estimate_holds_at_dynamic_sizes(fresh_compiles):
    """A dynamic graph's sizes are formulas Inductor knows (sizevars): it writes the loss's
    gradient over the logits of `4*s0` rows as it does at 1024 rows. The model said they could
    not be shown the same size and kept both (1.46x the measured peak on the benchmark's GPT).
    Checked on remat's graph, which holds the same loss and its chunk's slices at symbolic sizes."""
    from backends.models import GPTConfig, gpt

    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=4096, batch=4, layers=2, d_model=128, heads=4, seq=256))
    estimate, measured = _estimate_and_measure(model, torch.compile(model, backend="remat", dynamic=True),
                                               model.example_inputs())
    assert measured > 2**20
    assert 0.9 <= estimate / measured <= 1.1, (estimate, measured)


@pytest.mark.parametrize("budget", [None, 0.1])
def test_a_label_shift_of_one_sequence_at_a_dynamic_length_is_estimated_as_inductor_runs_it(
        fresh_compiles, budget):
    """The label shift of one sequence at a dynamic length. Saved: the partitioner saves
    `logits[:, :-1]`, a view a row short of the logits, and the backward's first kernel writes
    the logits' gradient from it. The model followed the view to the logits' buffer, of the
    gradient's size, and had the kernel write over it; Inductor sees an input of its own, smaller
    size and allocates the gradient beside it (157.5 MiB estimated, 277.5 measured on a 32768
    vocabulary, seq 1024). Recomputed (budget 0.1): the backward's logits are written over, but
    the model took a `sym_size` of them, read after that kernel, for a read of the buffer, and
    kept both (260.0 estimated, 140.0 measured)."""
    import torch._functorch.config as functorch_config

    from backends.models import GPTConfig, gpt

    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=8192, batch=1, layers=1, d_model=64, heads=4, seq=512, dropout=0.0,
                          label_shift=True))
    inputs = model.example_inputs()
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 1)
    with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
        estimate, measured = _estimate_and_measure(model, torch.compile(model), inputs)
    logits = 512 * 8192 * 4
    assert measured > (2 if budget is None else 1) * logits
    assert 0.95 <= estimate / measured <= 1.05, (estimate, measured)


def test_a_kernel_writes_over_what_it_reads_through_a_permute_and_its_inverse(fresh_compiles):
    """Cross-entropy on `logits.transpose(1, 2)`: the log-softmax runs on the logits permuted to
    (batch, vocab, seq), and its gradient is permuted back before the head's matmul, in one
    kernel that reads the saved logits at the element it writes, which Inductor writes over. The
    model took any permute for a read elsewhere and kept both (32 MiB estimated, 18.1 measured;
    613 of 389 MiB on bench/torch_step.py's GPT with --ncl-loss)."""
    import torch.nn.functional as F

    class NCLHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(64, 8192, bias=False)

        def forward(self, x, y):
            return F.cross_entropy(self.head(x).transpose(1, 2), y)

    torch.manual_seed(0)
    model = NCLHead()
    inputs = (torch.randn(2, 256, 64, requires_grad=True), torch.randint(0, 8192, (2, 256)))
    estimate, measured = _estimate_and_measure(model, torch.compile(model), inputs)
    logits = 2 * 256 * 8192 * 4
    assert logits < measured < 1.25 * logits
    assert 0.95 <= estimate / measured <= 1.05, (estimate, measured)


def test_a_pointwise_kernel_writes_over_the_buffer_it_reads_last(fresh_compiles):
    """Inductor's in-place kernels: B = relu(A) * 2 takes A's buffer, so D, A and B never
    coexist (without it the model said 3 buffers)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from backends.fx.peak import Step, fused_away, step_estimate

    def f(x, w):
        d = torch.mm(x, w)              # read by A and by the last matmul
        a = torch.mm(d, x)
        b = torch.relu(a) * 2           # read by a matmul, so a buffer; A is read last here
        return torch.mm(b, d[:, :1]).sum()

    n = 256
    args = (torch.randn(n, n), torch.randn(n, n))
    module = make_fx(f, tracing_mode="fake")(*args)
    estimate = step_estimate(Step(module, {node.name for node in fused_away(module.graph)})).peak_bytes
    compiled = torch.compile(f)
    compiled(*args)
    measured = tensor_peak(lambda: compiled(*args))
    buffer = n * n * 4
    assert 2 * buffer <= measured < 2.1 * buffer
    assert estimate == measured


@pytest.mark.parametrize("batch", [1, 8])
def test_the_estimate_holds_through_the_label_shift(fresh_compiles, batch):
    """`logits[:, :-1]`: the gradient's slice_scatter into zeros is one pointwise kernel (its
    zeros inlined), and with one sequence it writes over the logits' buffer, which it reads at
    its own index through the slice (Inductor's in-place update): the model said 2.9x the
    tensors held at batch 1, 1.5x at 8."""
    from test_chunk import ShiftHead, _softcap_inputs

    torch.manual_seed(0)
    model = ShiftHead(64, 4096, "last")
    inputs = _softcap_inputs(batch, 2048 // batch, 64, 4096)
    estimate, measured = _estimate_and_measure(model, torch.compile(model), inputs)
    logits = 2048 * 4096 * 4
    assert measured >= logits
    assert 0.98 <= estimate / measured <= 1.02, (estimate, measured)


def test_the_budget_search_simulates_a_chunked_loss_as_inductor_then_partitions_it(fresh_compiles):
    """Inductor runs its joint-graph passes on the subgraphs a joint pass made before it partitions:
    on the loss chunk's body its pattern rewrites turn the one-hot scatter into a pointwise
    compare. The budget search's simulation runs them too; without, it put a choice 11% under
    the peak the compile then ran (169.6 MiB against 191.7 on the GPT-like step), over the budget."""
    from backends.fx import backend as remat_backend
    from backends.fx import joint_graph
    from backends.fx.compile import FxBuilder
    from backends.models import GPTConfig, gpt
    from dsl.loader import load_rules
    from engine.driver import rewrite

    config, rules = "MatMul+LogSoftmax+:3:-1", load_rules()
    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=8192, batch=2, layers=1, d_model=128, heads=4, seq=512))
    inputs = model.example_inputs()
    builder = FxBuilder(joint_graph(model, inputs).graph, rules.views, True)
    done = rewrite(builder, rules, config=config, strict=True)
    assert done.chunked == 1
    simulated = builder.simulate(done.result.graph)
    torch._dynamo.reset()
    estimate, _ = _estimate_and_measure(model, torch.compile(model, backend=remat_backend(config=config, strict=True)),
                                        inputs)
    assert simulated == estimate, (simulated / 2**20, estimate / 2**20)


def test_the_peak_model_partitions_the_graph_inductors_early_patterns_leave(monkeypatch):
    # Inductor removes a permute pair that undoes itself (the scores' `k.transpose` and its
    # backward's transpose back) after remat's pass and before it partitions. Simulated without
    # that, Falcon's choice at a budget of 0.7x was put at 28.0 MiB and ran at 37.9: the
    # partitioner placed the recomputed scores in the backward beside the logits.
    import torch._functorch.partitioners as partitioners

    import backends.fx as fx_backend
    from backends.fx.peak import partition

    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1).sum()

    permute = torch.ops.aten.permute.default

    def pairs(graph):
        return [n for n in graph.nodes if n.target is permute and getattr(n.args[0], "target", None) is permute]

    seen = []
    real = partitioners.min_cut_rematerialization_partition

    def capture(module, *args, **kwargs):
        seen.append(len(pairs(module.graph)))
        return real(module, *args, **kwargs)

    joint = fx_backend.joint_graphs(Scores(), [torch.randn(2, 8, 16)])[0]
    assert pairs(joint.graph)
    monkeypatch.setattr(partitioners, "min_cut_rematerialization_partition", capture)
    partition(joint.graph, joint)
    assert seen == [0]
    assert pairs(joint.graph)       # the graph remat plans is left as it was


def test_a_column_sum_stays_out_of_the_pointwise_kernel_it_reads_on_cpu(fresh_compiles):
    """A biased head's loss chunk (GPT-J's): the bias gradient sums the logits' gradient over its
    rows. Inductor's C++ backend fuses that column sum with no pointwise kernel, so the rows'
    log-softmax, its backward and the gradient they write are one kernel beside the logits,
    where the model had fused the gradient with the column sum and written it over the
    log-softmax: 10.1 MiB estimated against 17.1 held (GPT-J at a budget of 0.7x: 27.6 against 33.3)."""
    import torch.nn.functional as F

    from backends.fx import backend as remat_backend

    class BiasHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 4096)

        def forward(self, h, targets):
            return F.cross_entropy(self.proj(h), targets)

    torch.manual_seed(0)
    model = BiasHead()
    inputs = (torch.randn(2048, 64), torch.randint(0, 4096, (2048,)))
    estimate, measured = _estimate_and_measure(model, torch.compile(model, backend=remat_backend(strict=True)), inputs)
    assert measured >= 2**24           # a quarter of the logits (8 MiB) and its gradient, at once
    assert 0.95 <= estimate / measured <= 1.05, (estimate / 2**20, measured / 2**20)


def test_a_kernel_writes_over_what_it_reads_through_a_reshape_of_a_value_it_computes(fresh_compiles):
    """Cohere's scaled logits: `(h @ W.T) * scale` in (batch, seq) rows, viewed back to rows for
    the loss. The loss's backward writes the logits' gradient over the saved logits, which it
    reads through that view of the scaled value it computes inside: the model followed views of
    computed values only where they permute dims, not where they split rows, and kept both
    (64.0 MiB estimated against 33.0 held; Cohere's step 59.0 against 47.3)."""
    import torch.nn.functional as F

    class ScaledHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 4096, bias=False)

        def forward(self, h, targets):
            logits = self.proj(h) * 0.0625
            return F.cross_entropy(logits.view(-1, 4096), targets.view(-1))

    torch.manual_seed(0)
    model = ScaledHead()
    inputs = (torch.randn(4, 512, 64), torch.randint(0, 4096, (4, 512)))
    estimate, measured = _estimate_and_measure(model, torch.compile(model), inputs)
    logits = 4 * 512 * 4096 * 4
    assert logits <= measured < 2 * logits
    assert 0.95 <= estimate / measured <= 1.05, (estimate / 2**20, measured / 2**20)


def test_a_two_phase_chunk_keeps_the_backward_off_the_saved_values(fresh_compiles):
    """A two-phase chunk region turns AOTAutograd's donated buffers off for its graph
    (backends/fx/compile.py), and Inductor's backward then writes over none of the saved values:
    the loss's gradient is allocated beside the saved log-probabilities it was written over
    before. The model wrote it over them, and the GPT-like step at a 230 MiB budget with the
    attention chunked and the loss whole simulated 220.2 MiB and held 265.9."""
    import backends.fx as fx_backend
    from backends.models import GPTConfig, gpt

    torch.manual_seed(0)
    model = gpt(GPTConfig(vocab=8192, batch=4, layers=2, d_model=128, heads=4, seq=512))
    inputs = model.example_inputs()
    planning = fx_backend.analyze(model, inputs, tiers=["expensive"], show=False)
    attention = [p.config_string() for p in planning.plans if p.rules == ["chunk_attention_scores"]]
    assert attention, [p.rules for p in planning.plans]
    remat = fx_backend.backend(config=",".join(attention), tiers=["expensive"], strict=True)
    estimate, measured = _estimate_and_measure(model, torch.compile(model, backend=remat), inputs)
    assert remat.remat_pass.chunked >= 1
    logits = 4 * 512 * 8192 * 4
    assert measured > 2 * logits        # the saved log-probabilities and the gradient, both whole
    assert 0.9 <= estimate / measured <= 1.1, (estimate, measured)

"""Dynamic shapes on the fx backend (issue 15): `torch.compile(backend="remat", dynamic=True)` and
`mark_dynamic` compile the GPT-like model once for every sequence length, the recompute plans
(the dropout's replay among them) apply with their savings formulas over the symbols, and the
loss chunk runs a fixed count of slices whose sizes are SymInts (SliceSizes.FIXED_COUNT), so one
graph chunks every length; Dynamo's own switch to dynamic sizes at a second length keeps it too."""
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

import sympy  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import backends.fx as fx_backend  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import GPTConfig, gpt  # noqa: E402

# Logits of 16 MiB at the first length, which chunk.rule's loss rule asks for.
CFG = GPTConfig(vocab=16384, d_model=64, layers=1, heads=4, seq=128, batch=4, dropout=0.1)
LENGTHS = (64, 96, 128)


def inputs_of(length: int, batch: int = CFG.batch) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    shape = (batch, length)
    return torch.randint(0, CFG.vocab, shape, generator=g), torch.randint(0, CFG.vocab, shape, generator=g)


def _matches_eager(model, compiled, inputs, where=None) -> None:
    """One training step of `compiled` on `inputs`: its loss and gradients within 1e-4 of eager's."""
    loss, grads, _ = training_step(model, compiled, inputs)
    want_loss, want_grads, _ = training_step(model, model, inputs)
    assert relative_error(loss, want_loss) < 1e-4, where
    assert max(relative_error(g, w) for g, w in zip(grads, want_grads)) < 1e-4, where


def _compiled_matches_eager_at(model, lengths, largest=None, dynamic=None, batch=CFG.batch):
    """`model` compiled with remat (strict), stepped at each length (the length marked dynamic,
    up to `largest`; with `dynamic=True` unmarked), each step's loss and gradients eager's.
    Returns the remat pass."""
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=dynamic)
    for length in lengths:
        inputs = inputs_of(length, batch) if dynamic else _mark_lengths(inputs_of(length, batch), largest)
        _matches_eager(model, compiled, inputs, length)
    return remat.remat_pass


def test_one_compile_serves_three_sequence_lengths(fresh_compiles, recwarn):
    """`dynamic=True`. (`mark_dynamic`, the other way to one compile: the tests of a declared
    largest size below; automatic dynamic shapes, where a second length recompiles:
    tests/test_hf_models.py, GPT-2 on padded batches.)"""
    model = gpt(CFG)
    remat = fx_backend.backend()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return remat(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=True)
    counters.clear()
    compiles = []
    with inductor_config.patch(fallback_random=True):
        for length in LENGTHS:
            inputs = inputs_of(length)
            torch.manual_seed(1)
            want_loss, want_grads, _ = training_step(model, model, inputs)
            torch.manual_seed(1)
            loss, grads, _ = training_step(model, compiled, inputs)
            assert relative_error(loss, want_loss) < 1e-4, length
            assert max(relative_error(g, w) for g, w in zip(grads, want_grads)) < 1e-4, length
            compiles.append(len(graphs))
    # Dynamo may hand the backend a frame twice while it first traces it; no length after the
    # first compiles again, and the remat pass ran on one joint graph.
    assert compiles[0] == compiles[-1] and counters["stats"]["unique_graphs"] == 1
    assert not remat.remat_pass.failures
    [result] = remat.remat_pass.results
    applied = [p for p in result.plans if p.applied]
    [dropout] = [p for p in applied if "Dropout+" in p.key]
    assert isinstance(dropout.saving(), sympy.Expr) and dropout.saving().free_symbols      # batch x seq²
    # The loss chunk, built once for every length: its extent is the symbolic token count, its
    # slices a fixed count whose sizes the graph computes from it.
    [chunking] = remat.remat_pass.chunk_results
    [region] = chunking.chunks
    assert remat.remat_pass.chunked == 1 and region.match.rule.name == "chunk_linear_cross_entropy"
    assert isinstance(region.extent, sympy.Expr) and region.extent.free_symbols and len(region.chunks) == 2
    assert region.saved.free_symbols
    assert not [w for w in recwarn if "sizes are dynamic" in str(w.message)]


def test_returned_logits_at_dynamic_lengths_leave_the_loss_chunk_whole_and_reshaped(fresh_compiles):
    """nanoGPT's `return logits, loss` with every size dynamic: the two-phase loss chunk reads the
    logits' gradient, (batch, seq, vocab), through the reshape to (tokens, vocab) and reshapes the
    concatenated logits back, the shapes written from the graph's own sizes (backends.fx.sizes).
    The logits get a gradient of their own, so a region that dropped it would show.

    With every size dynamic from the start and no dropout, the loss's mean divides by a float of
    the symbolic token count, and AOTAutograd asks Dynamo to trace the frame again with it
    specialized (TensorifyScalarRestartAnalysis, raised through the backend, once here). remat,
    strict, lets it through rather than taking it for a failure of its own."""
    model = gpt(replace(CFG, dropout=0.0, return_logits=True))

    def step(fn, length):
        logits, loss = fn(*inputs_of(length))
        (loss + 1e-3 * logits.square().mean()).backward()
        got = [loss.detach(), logits.detach()] + [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return got

    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=True)
    for length in (LENGTHS[1], LENGTHS[0] - 3):
        got, want = step(compiled, length), step(model, length)
        assert max(relative_error(a, b) for a, b in zip(got, want)) < 1e-4, length
    [chunking] = remat.remat_pass.chunk_results
    [region] = chunking.chunks
    assert len(region.phases) == 2 and region.extent.free_symbols and region.reshaped
    assert not remat.remat_pass.failures and remat.remat_pass.chunked == 1
    assert not [n for n in remat.remat_pass.notices if "to its caller" in n]   # the loss is in the graph


def test_attention_chunks_at_dynamic_lengths(fresh_compiles):
    """The attention's scores (batch x heads x seq x seq, 16 MiB at the first length) chunked along
    the queries at symbolic sizes. The region reads the sequence length itself (a SymInt input of
    the graph, for the causal mask) as an input, which the body was also given as one of its
    sizes: a duplicate argument, and the plan dropped, until the sizes left out the inputs."""
    model = gpt(GPTConfig(vocab=4096, d_model=64, layers=1, heads=4, seq=512, batch=4, dropout=0.0))
    remat = fx_backend.backend(strict=True, tiers=["expensive"])
    compiled = torch.compile(model, backend=remat, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for length in (512, 401):
        inputs = [torch.randint(0, 4096, (4, length), generator=g) for _ in range(2)]
        _matches_eager(model, compiled, inputs, length)
    keys = [r.key for result in remat.remat_pass.chunk_results for r in result.chunks]
    assert "MatMul+Softmax+" in keys and not remat.remat_pass.failures


def test_attention_under_a_declared_range_chunks_along_its_heads(fresh_compiles, recwarn):
    """`mark_dynamic(t, 1, min=2, max=512)`: the queries' slices, `floor(s / 4)` rows, guard sizes
    the declared range cannot prove, so chunk_attention_scores is refused (RefusedConstrained);
    chunk_attention_heads, tried after it at the same root, slices the static heads instead, one
    graph for both lengths. Before, the scores stayed whole, with a notice. The refusal of the
    rule a later one replaced is not the user's to hear."""
    model = gpt(GPTConfig(vocab=256, d_model=32, layers=1, heads=4, seq=512, batch=4, dropout=0.0))
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat)
    g = torch.Generator().manual_seed(0)
    for length in (512, 401):
        inputs = [torch.randint(0, 256, (4, length), generator=g) for _ in range(2)]
        _matches_eager(model, compiled, _mark_lengths(inputs, 512), length)
    [chunking] = remat.remat_pass.chunk_results
    [region] = chunking.chunks
    assert region.match.rule.name == "chunk_attention_heads" and len(region.chunks) == 4
    assert region.extent is None and not remat.remat_pass.failures     # static slices: the heads
    assert [r.match.rule.name for r in chunking.planning.refusals] == ["chunk_attention_scores"]
    assert not remat.remat_pass.notices, remat.remat_pass.notices


def _mark_lengths(inputs, largest):
    for t in inputs:
        if largest is None:
            torch._dynamo.mark_dynamic(t, 1)
        else:
            torch._dynamo.mark_dynamic(t, 1, min=2, max=largest)
    return inputs


@pytest.mark.parametrize("largest", [None, 128])
def test_a_dynamic_graph_is_planned_for_the_largest_size_the_user_declares(fresh_compiles, largest):
    """Traced at 32 tokens a sequence the logits are 8 MiB, under the loss rule's 16 MiB; a batch of
    128 tokens has 32 MiB of them. Declared with `mark_dynamic(..., max=128)`, the graph is planned
    at 128 (the rules' guards, the slice count, the budget), so the loss chunk is built; with no
    bound it is planned at the traced size, and the user hears that longer inputs would chunk."""
    model = gpt(replace(CFG, dropout=0.0))
    remat_pass = _compiled_matches_eager_at(model, (32, 100), largest)
    [result] = remat_pass.results
    assert list(result.graph.dim_examples.values()) == [largest or 32]
    longer = [n for n in remat_pass.notices if "it would apply from about" in n]
    if largest is None:
        assert remat_pass.chunked == 0
        [notice] = longer       # 8 MiB of logits at 32 tokens a sequence, 16 MiB at 64
        assert notice.startswith("remat: chunk_linear_cross_entropy not applied") and "2x those sizes" in notice \
            and ".size(1) = 32" in notice and ".size(1) = 64" in notice \
            and "torch._check(" in notice and ".size(1) <= N) in the forward" in notice, notice
    else:
        assert not longer
        [chunking] = remat_pass.chunk_results
        [region] = chunking.chunks
        assert remat_pass.chunked == 1 and region.extent.free_symbols


@pytest.mark.parametrize("batch, largest, slices", [(2, 128, 2), (1, 256, None)])
def test_a_declared_range_keeps_the_chunks_whose_slices_it_proves(fresh_compiles, batch, largest, slices):
    """`mark_dynamic(t, 1, min=2, max=N)` makes the length a constraint Dynamo checks every guard
    against after the backend returned. The loss's 4 slices of `floor(batch * s / 4)` tokens guard
    their sizes, and the step raised ConstraintViolationError. Now 2 sequences take 2 slices of one
    sequence each (sizes the range proves), and one sequence is left whole, with a notice giving
    the way to keep the chunk."""
    model = gpt(replace(CFG, dropout=0.0, batch=batch, seq=largest))
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat)
    g = torch.Generator().manual_seed(batch)
    for length in (largest, largest - 28):
        inputs = [torch.randint(0, CFG.vocab, (batch, length), generator=g) for _ in range(2)]
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 1, min=2, max=largest)
        _matches_eager(model, compiled, inputs, length)
    constrained = [n for n in remat.remat_pass.notices if "declared as a constraint" in n]
    if slices is None:
        [notice] = constrained
        assert remat.remat_pass.chunked == 0 and "chunk_linear_cross_entropy not applied" in notice \
            and "torch._check(" in notice and ".size(1) <= N)" in notice, notice
    else:
        [chunking] = remat.remat_pass.chunk_results
        [region] = chunking.chunks
        assert remat.remat_pass.chunked == 1 and region.count == slices and not constrained


def test_a_declared_range_with_a_dynamic_batch_is_one_graph_for_every_batch(fresh_compiles):
    """A dynamic batch and a length with min and max: the tokens cannot be sliced (no count divides
    `b*s`), and slices of whole sequences would be a fixed count of a dynamic batch whose guards
    (`b // 3`, one row left) fail at the next batch size, compiling again up to Dynamo's limit.
    The region is refused with the notice instead, and one graph serves every batch."""
    model = gpt(replace(CFG, dropout=0.0))
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=True)
    for batch in (3, 2):
        inputs = [t[:1].expand(batch, -1).clone() for t in inputs_of(128)]
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 1, min=2, max=128)
        _matches_eager(model, compiled, inputs, batch)
    [notice] = [n for n in remat.remat_pass.notices if "declared as a constraint" in n]
    assert len(remat.remat_pass.results) == 1 and remat.remat_pass.chunked == 0, notice


class _ShiftedHead(torch.nn.Module):
    """A label shift as many training scripts write it: sliced, then reshaped, no `.contiguous()`."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(CFG.vocab, 64), torch.nn.Linear(64, CFG.vocab, bias=False)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab), targets[:, 1:].reshape(-1))


def test_a_label_shift_reshaped_without_a_copy_chunks_at_dynamic_lengths(fresh_compiles):
    """At a dynamic length the reshape of the shifted logits reads `sym_size(slice, 1)`, the
    slice's length: the region took that size in with the slice, and the size, read outside,
    left it neither sliced nor summed, so the loss ran whole with no word. The sizes an
    intermediate's shape gives are read from the inputs' sizes (normalize.sizes_read_from_inputs)."""
    model = _ShiftedHead()
    remat_pass = _compiled_matches_eager_at(model, (128, 100))
    [chunking] = remat_pass.chunk_results
    [region] = chunking.chunks      # in whole sequences: a slice of the tokens would start inside one
    assert remat_pass.chunked == 1 and len(region.chunks) == CFG.batch


def test_the_label_shift_of_one_sequence_chunks_at_dynamic_lengths(fresh_compiles, recwarn):
    """Batch 1 (fine-tuning on long sequences, where the logits are largest): the tokens are the
    sequence the shift slices, so the shifted logits and targets are one row short of the
    chunked rows (Rows.tail). A fixed count of slices of floor(s / count) rows, the last the
    rest: they end short in the last slice only, whose body slices them with an end of -1
    (odd lengths leave it longer). Refused before (slices that end inside the chunked dim were
    built at static sizes only): the loss ran whole from the second length on."""
    remat_pass = _compiled_matches_eager_at(_ShiftedHead(), (512, 301, 384), batch=1)
    [chunking] = remat_pass.chunk_results
    [region] = chunking.chunks
    assert remat_pass.chunked == 1 and region.extent.free_symbols and len(region.chunks) > 2
    assert {m.rows.tail for m in region.meta.values() if m.dim is not None} == {0, 1}
    assert not [w for w in recwarn if "sizes are dynamic" in str(w.message)]


class _LengthsChecked(torch.nn.Module):
    """The model, its ids' and targets' lengths said equal (`torch._check`), as remat's notice asks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        torch._check(idx.size(1) == targets.size(1))
        return self.model(idx, targets)


def _unbacked_takes_a_range() -> bool:
    import inspect

    import torch._dynamo.decorators as decorators

    return "max" in inspect.signature(decorators.mark_unbacked).parameters


@pytest.mark.skipif(not _unbacked_takes_a_range(), reason="mark_unbacked takes no min/max before torch 2.13")
@pytest.mark.parametrize("checked", [False, True])
def test_unbacked_lengths_are_planned_at_their_declared_largest(fresh_compiles, recwarn, checked):
    """`mark_unbacked(t, 1, min=2, max=128)` leaves the shape environment no hint of the length:
    the importer read the hints from the deprecated `var_to_val` when torch 2.13's
    `backed_var_to_val` was empty, and the user got torch's FutureWarning from remat; then, with
    no size to plan at, the chunk was left out with no word. The graph is planned at the largest
    length declared. Unbacked, the ids' and the targets' lengths are two symbols no guard unites:
    a notice asks for the check that does, and with it the loss chunk is built, one graph for
    every length."""
    import torch._dynamo.decorators as decorators

    model = gpt(replace(CFG, dropout=0.0, batch=2))
    model = _LengthsChecked(model) if checked else model
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat)
    for length in (128, 37) if checked else (128,):
        inputs = tuple(t[:2].clone() for t in inputs_of(length))
        for t in inputs:
            decorators.mark_unbacked(t, 1, min=2, max=128)
        _matches_eager(model, compiled, inputs, length)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning) and "var_to_val" in str(w.message)]
    assert len(remat.remat_pass.results) == 1 and remat.remat_pass.chunked == int(checked)
    asked = [n for n in remat.remat_pass.notices if "torch._check(one_size == the_other)" in n]
    assert bool(asked) != checked, remat.remat_pass.notices


@pytest.mark.parametrize("largest", [None, 128])
def test_a_byte_budget_on_sizes_with_no_declared_largest_says_it_is_planned_at_the_traced_ones(
        fresh_compiles, recwarn, largest):
    model = gpt(replace(CFG, dropout=0.0))
    remat = fx_backend.backend(budget="1GiB")
    training_step(model, torch.compile(model, backend=remat), _mark_lengths(inputs_of(32), largest))
    unbounded = [w for w in recwarn if "planned at the sizes this dynamic graph was traced at" in str(w.message)]
    assert not remat.remat_pass.failures and len(remat.remat_pass.results) == 1
    if largest is None:
        [warning] = unbounded
        text = str(warning.message)
        assert "(s" in text and "=32)" in text and "<= N) in the forward" in text
    else:
        assert not unbounded


@pytest.mark.parametrize("loss", ["shift", "ncl"])
def test_the_label_shift_chunks_at_dynamic_lengths_in_whole_sequences(fresh_compiles, recwarn, loss):
    """`logits[:, :-1]` against `targets[:, 1:]` (transformers before 4.46, many training scripts):
    the tokens' rows are grouped into (batch, seq) and back into batch x (seq - 1), so the slices
    must be whole sequences, whose rows are a formula (the reshape's unit, 1/s0). The region is
    counted in sequences: a fixed count of slices of whole sequences, each value's rows per
    sequence a formula (s0, s0 - 1). A dynamic length keeps the batch static (4 sequences:
    the length marked dynamic here, the graph automatic dynamic shapes make at a second length).
    Before, it was refused (the reshape "does not carry dim 0"), and the loss ran whole from the
    second length on. The (N, C, L) loss, whose (batch, vocab, seq) logits are sliced along the
    static batch, crashed AOTAutograd's partitioner (a sym_size node of the batch's int)."""
    model = gpt(replace(CFG, dropout=0.0, label_shift=loss == "shift", ncl_loss=loss == "ncl"))
    remat_pass = _compiled_matches_eager_at(model, (LENGTHS[2], LENGTHS[1], LENGTHS[1] + 15))
    regions = [r for result in remat_pass.chunk_results for r in result.chunks]
    dynamic_regions = [r for r in regions if r.extent is not None]
    assert len(dynamic_regions) == 1 and remat_pass.chunked == len(regions)
    [region] = dynamic_regions
    units = {m.unit for m in region.meta.values() if m.dim is not None}
    assert any(isinstance(u, sympy.Expr) and u.free_symbols for u in units)   # rows per sequence
    assert region.extent == CFG.batch
    assert not [w for w in recwarn if "sizes are dynamic" in str(w.message)]


@pytest.mark.parametrize("dims,loss", [("both", "shift"), ("batch", "ncl")])
def test_a_dynamic_batch_is_sliced_inside_each_sequence(fresh_compiles, recwarn, dims, loss):
    """`dynamic=True` with the label shift: the batch is a symbol too, so slices of whole
    sequences would be one slice at batch 1 (a fixed count of floor(batch / count) sequences,
    the last the rest). The region slices the length inside each of a symbolic number of
    sequences instead (Rows.outer a formula, the batch's symbol): the rule's count of slices at
    every batch, one graph for every batch and length. Before, whole sequences. (Batch 1 Dynamo
    compiles again, a size of 1 specialized: the static batch's own slices inside the sequence.)
    The batch alone marked dynamic, the length static (the (N, C, L) loss): slices of a static
    size inside each sequence, their rows a formula of the batch in the bodies. Before, whole
    sequences, whose count guards (`b // 4`) compiled every batch again."""
    model = gpt(replace(CFG, dropout=0.0, label_shift=loss == "shift", ncl_loss=loss == "ncl"))
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=True if dims == "both" else None)
    counters.clear()
    for batch, length in ((CFG.batch, LENGTHS[2]), (2, LENGTHS[1]), (3, LENGTHS[1] + 15)):
        inputs = inputs_of(length if dims == "both" else LENGTHS[2], batch)
        if dims == "batch":
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
        _matches_eager(model, compiled, inputs, (batch, length))
    assert counters["stats"]["unique_graphs"] == 1
    [region] = [r for result in remat.remat_pass.chunk_results for r in result.chunks]
    assert remat.remat_pass.chunked == 1 and not remat.remat_pass.failures
    groups = {m.rows.outer for m in region.meta.values() if m.dim is not None} - {1}
    assert len(groups) == 1 and all(isinstance(g, sympy.Symbol) for g in groups), groups
    assert len(region.chunks) == 4 and (region.extent is None) == (dims == "batch")
    assert not [w for w in recwarn if "sizes are dynamic" in str(w.message)]


@pytest.mark.parametrize("loss", ["shift", "ncl"])
def test_two_sequences_at_a_dynamic_length_are_sliced_inside_each_sequence(fresh_compiles, recwarn, loss):
    """Batch 2 at a dynamic length: whole sequences give 2 slices where the rule asks for more, so
    the region slices the length inside each sequence (Rows.outer, 2 groups of s0 rows), a fixed
    count of slices of floor(s0 / count) rows of both. Before, 2 slices of whole sequences."""
    model = gpt(replace(CFG, dropout=0.0, batch=2, seq=256, label_shift=loss == "shift", ncl_loss=loss == "ncl"))
    remat_pass = _compiled_matches_eager_at(model, (256, 199), batch=2)      # 32 MiB of logits first
    [region] = [r for result in remat_pass.chunk_results for r in result.chunks]
    assert remat_pass.chunked == 1 and region.extent.free_symbols and len(region.chunks) > 2
    assert {m.rows.outer for m in region.meta.values() if m.dim is not None} == {1, 2}
    assert not [w for w in recwarn if "sizes are dynamic" in str(w.message)]


class _HeadAfterACausalMask(torch.nn.Module):
    """A vocabulary head after a causal mask sliced from a buffer as long as the first batch:
    Dynamo specializes the first length on that slice and, when a second length arrives, makes
    the dims dynamic one input at a time."""

    def __init__(self, d: int = 32, vocab: int = 32768, longest: int = 256):
        super().__init__()
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(longest, longest)))

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return x + self.causal[:t, :t].mean(-1)[:, None]


class HandWrittenLoss(_HeadAfterACausalMask):
    """A cross-entropy written by hand (`gather`, which asks only that the targets be no longer
    than the logits) after the mask: Dynamo names the tokens' and the targets' lengths apart
    (s27, s13) though they are always equal."""

    def __init__(self, check: bool):
        super().__init__()
        self.check = check

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.check:
            torch._check(targets.size(1) == x.size(1))
        x = self.masked(x)
        logits = self.head(x).view(-1, self.head.out_features)
        return -logits.log_softmax(-1).gather(-1, targets.view(-1)[:, None]).mean()


class NCLAfterACausalMask(_HeadAfterACausalMask):
    """The (N, C, L) loss after the mask, whose 256 rows bound the length Dynamo plans for."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.masked(x)).transpose(1, 2), targets)


def test_a_length_shorter_than_two_rows_a_slice_compiles_again_with_fewer_slices(fresh_compiles):
    """Planned at the mask's 256 (64 MiB of logits at batch 2), the loss is sliced inside each
    sequence in 4 slices of floor(s / 4) rows. Length 5 gives them one row; the graph's guards
    (at least two) compile it again, still planned at 256 but traced at 5: at most 5 // 2 slices,
    two rows each there (Graph.dim_traced). Before, 4 slices of one row here; a nanoGPT with its
    label shift, its mask 1024 rows, failed there: slices of one row (5 at length 5) the pass
    (`Unknown metadata type <class 'int'>`, a size Inductor made a number), of none (16 at length
    9) Inductor's lowering (`ValueRangeError: Invalid ranges [2:1]`)."""
    torch.manual_seed(0)
    model = NCLAfterACausalMask()
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=True)
    for length in (256, 5):
        g = torch.Generator().manual_seed(length)
        inputs = (torch.randn(2, length, 32, generator=g), torch.randint(0, 32768, (2, length), generator=g))
        _matches_eager(model, compiled, inputs, length)
    long, short = [r for result in remat.remat_pass.chunk_results for r in result.chunks]
    assert len(long.chunks) == 4 and len(short.chunks) == 2 and not remat.remat_pass.failures
    assert {m.rows.outer for m in short.meta.values() if m.dim is not None} - {1}


def _two_lengths_match_eager(model: torch.nn.Module):
    """Train `model` compiled with remat at every size dynamic, two lengths of a (2, length, 32)
    input and (2, length) targets of a 32768 vocabulary; each step within 1e-4 of eager. The
    backend, for what it built."""
    torch.manual_seed(0)
    remat = fx_backend.backend(strict=True)
    compiled = torch.compile(model, backend=remat, dynamic=True)
    for length in (256, 192):
        g = torch.Generator().manual_seed(length)
        inputs = (torch.randn(2, length, 32, generator=g), torch.randint(0, 32768, (2, length), generator=g))
        loss, grads, _ = training_step(model, compiled, inputs)
        want_loss, want_grads, _ = training_step(model, model, inputs)
        assert relative_error(loss, want_loss) < 1e-4 and relative_error(grads[0], want_grads[0]) < 1e-4
    return remat


@pytest.mark.parametrize("check", [False, True])
def test_sizes_named_apart_are_named_in_a_notice_with_the_check_that_unites_them(fresh_compiles, recwarn, check):
    """The loss chunk slices the logits and the targets alike, so it needs their lengths equal;
    where torch cannot prove it (two symbols, equal at every input given) the chunk is refused,
    and the user is told which dims and what to write: `torch._check(targets.size(1) ==
    x.size(1))`, with which the same model chunks at every length."""
    remat = _two_lengths_match_eager(HandWrittenLoss(check))
    notices = [str(w.message) for w in recwarn if "torch cannot prove it" in str(w.message)]
    built = [len(result.chunks) for result in remat.remat_pass.chunk_results]
    if check:
        assert not notices and built == [1, 1]      # the static first length, then every length
    else:
        [notice] = notices
        assert built == [1, 0] and "torch._check(targets.size(1) == x.size(1))" in notice
        assert "is targets.size(1)" in notice and "is x.size(1)" in notice


class LossAfterABreak(_HeadAfterACausalMask):
    """HandWrittenLoss's causal mask, then a graph break and `F.cross_entropy` (`shift`: of the
    logits of every token but the last, against the targets of every token but the first, as
    Hugging Face's models shift the labels). The second graph's inputs get symbols of their
    own, the hidden states' batch apart from the targets'; cross-entropy guards the row counts
    equal (`Eq(s27*s77, s24*s27)`), which proves the two batches one size."""

    def __init__(self, shift: bool):
        super().__init__()
        self.shift = shift

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.masked(x)
        torch._dynamo.graph_break()
        logits = self.head(x)
        if self.shift:
            logits, targets = logits[:, :-1].contiguous(), targets[:, 1:]
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("shift", [False, True])
def test_sizes_a_guard_proves_equal_are_one_size_and_the_loss_after_a_graph_break_chunks(
        fresh_compiles, recwarn, shift):
    remat = _two_lengths_match_eager(LossAfterABreak(shift))
    [region] = [r for result in remat.remat_pass.chunk_results for r in result.chunks]
    assert region.match.rule.name == "chunk_linear_cross_entropy" and region.extent.free_symbols
    # whole sequences where the shift slices the length, else tokens of one batch symbol
    assert len(region.extent.free_symbols) == (1 if shift else 2)
    assert not [w for w in recwarn if "torch cannot prove it" in str(w.message)]


def test_a_static_region_over_a_dynamic_dim_merged_into_its_rows_slices_it_as_a_size_of_the_graph():
    """Scores `q @ k` of (256, 128, d) by (256, d, 128), d dynamic, sliced along the static 256
    (the heads rule's dim, engine.testing's graphs found it): the joint graph views k's gradient
    with d merged into those rows, so a slice's rows there are a formula, 64 * d; the builder
    handed it to `aten.slice` as a sympy expression and the plan failed. Now a formula bound is
    the graph's own size (a SymInt in the bodies' fake tensors, a node in the graph)."""
    import numpy as np

    from backends.fx.testing import run
    from dsl.loader import load_rules
    from engine.testing.check import differences
    from engine.testing.generate import rule_alone, training_graph
    from engine.testing.graphs import GraphBuilder

    b = GraphBuilder({"d": 2})
    scores = b.emit("MatMul", [b.input("q", shape=(256, 128, "d")), b.param("k", shape=(256, "d", 128))])
    tail = b.emit("MatMul", [scores, b.param("tail", shape=(128, 2))])
    loss = b.emit("ReduceSum", [b.emit("ReduceSum", [tail, b.const([-1], np.int64)], keepdims=0)], keepdims=0)
    tg = training_graph(b, loss, dynamic=frozenset({"d"}))
    rules = load_rules()
    done = run(tg, rule_alone(rules, rules.rule("chunk_attention_heads")))
    assert [p.rules for p in done.applied] == [["chunk_attention_heads"]] and not differences(tg, done, 1e-4)

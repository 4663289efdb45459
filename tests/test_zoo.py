"""The zoo (tests/zoo.py): training models written the many ways people write them, compiled
with backend=remat in strict mode. Each must compile, match eager within its tolerance (1e-4
in fp32) and fire the rules it is built for; together they fire every shipped rule. Random
mixes of the switches: tests/test_zoo_random.py (a file of its own, so that `make test`'s
workers, a file each, run the two at once).

About 5 minutes of CPU with no Inductor cache (one compile per variant, two where the steps
draw Inductor's random numbers; a C++ compile of each new kernel, vectorized for the
low-precision variants only: tests/conftest.py _scalar_kernels)."""
import pytest

torch = pytest.importorskip("torch")

import zoo  # noqa: E402

_RESULTS: dict = {}


def result_of(variant: "zoo.Variant") -> "zoo.ZooResult":
    """Each variant is compiled once per session (the coverage test reads the results again)."""
    if variant not in _RESULTS:
        _RESULTS[variant] = zoo.run_variant(variant)
    return _RESULTS[variant]


def check(variant: "zoo.Variant", result: "zoo.ZooResult", expect) -> None:
    assert result.compiled, f"torch.compile(backend=remat, strict) failed: {result.summary()}\n{variant!r}"
    assert result.within, (f"loss err {result.loss_err:.2e}, grad err {result.grad_err:.2e} "
                           f"({result.worst_grad}) over tolerance {result.tolerance:.0e}: {result.summary()}")
    missing = result.expected_missing(expect)
    assert not missing, f"{variant.name}: expected {missing} to fire; fired {result.fired}"


@pytest.mark.parametrize("variant", zoo.FIXED, ids=lambda v: v.name)
def test_fixed_variant_compiles_strict_matches_eager_and_fires_its_rules(variant):
    result = result_of(variant)
    if result.torch_error:
        pytest.skip(f"plain Inductor fails on this model too (torch's bug, not remat's): {result.torch_error}")
    check(variant, result, variant.expect)


def test_fixed_variants_use_every_switch_value():
    for switch, values in zoo.SWITCHES.items():
        used = {getattr(v, switch) for v in zoo.FIXED}
        assert used >= set(values), f"{switch}: {sorted(map(str, set(values) - used))} never used in FIXED"
    assert any(v.tiers for v in zoo.FIXED) and any(not v.tiers for v in zoo.FIXED)
    assert sum("div_float" in v.name for v in zoo.FIXED) >= 1     # the model


# Shipped rules that fire where the zoo's models do not go, and the test that fires them: the
# attention's heads are chunked only where its queries cannot be, a length with a declared range,
# under which the zoo's GPT specializes its length (plain Inductor: ConstraintViolationError).
FIRED_ELSEWHERE = {
    "chunk_attention_heads": "tests/test_fx_dynamic.py::test_attention_under_a_declared_range_chunks_along_its_heads",
    # ONNX only: torch's graph gathers expert weights with aten.index, which has no chunk kind,
    # and Inductor's decompositions write a batch of outer products as a broadcast multiply
    "chunk_gathered_experts": "tests/test_ort_leaf_layout.py::"
                              "test_a_mixture_of_experts_rewrite_gathers_the_expert_weights_in_slices_of_tokens",
    "chunk_batched_outer_products": "tests/test_ort_leaf_layout.py::"
                                    "test_a_mixture_of_experts_rewrite_gathers_the_expert_weights_in_slices_of_tokens",
}


def test_every_shipped_rule_fires_somewhere_in_the_zoo():
    fired = set()
    for variant in zoo.FIXED:
        fired |= {rule for rule, n in result_of(variant).fired.items() if n}
    assert not fired & set(FIRED_ELSEWHERE), "the zoo fires it now: drop it from FIRED_ELSEWHERE"
    missing = zoo.shipped_rule_names() - fired - set(FIRED_ELSEWHERE)
    assert not missing, f"never fired over FIXED: {sorted(missing)}"

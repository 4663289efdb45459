"""The zoo (tests/zoo.py): training models written the many ways people write them, compiled
with backend=remat in strict mode. Each must compile, match eager within its tolerance (1e-4
in fp32) and fire the rules it is built for; together they fire every shipped rule; and
random mixes of the switches must compile and match too.

About 3-4 minutes on 2 CPU cores (one Inductor compile per variant, 15 fixed + 2 random)."""
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings, strategies as st

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


def test_every_shipped_rule_fires_somewhere_in_the_zoo():
    fired = set()
    for variant in zoo.FIXED:
        fired |= {rule for rule, n in result_of(variant).fired.items() if n}
    missing = zoo.shipped_rule_names() - fired
    assert not missing, f"never fired over FIXED: {sorted(missing)}"


variants = st.builds(
    zoo.Variant,
    name=st.just("hypothesis"),
    model=st.just("gpt"),
    layers=st.sampled_from([1, 2]),
    scale=st.sampled_from(zoo.SCALES),
    mask=st.sampled_from(zoo.MASKS),
    norm=st.sampled_from(zoo.NORMS),
    mlp=st.sampled_from(zoo.MLPS),
    heads=st.sampled_from(zoo.HEADS),
    tied=st.booleans(),
    precision=st.sampled_from(zoo.PRECISIONS),
    loss=st.sampled_from(zoo.LOSSES),
    logits=st.sampled_from(zoo.LOGITS),
    rope=st.booleans(),
    bias=st.booleans(),
    dropout=st.booleans(),
    inplace=st.booleans(),
    returns=st.sampled_from(zoo.RETURNS),
    graph_break=st.booleans(),
    checkpoint=st.booleans(),
    dynamic=st.booleans(),
    tiers=st.sampled_from([(), ("expensive",)]),
)


# Two compiles (10-20 s each), after replaying examples that failed before (Hypothesis's
# database); no shrinking, which would compile again and again: the failing Variant is
# printed whole, and `python bench/zoo.py` reruns FIXED in subprocesses.
@settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(variants)
def test_random_variant_compiles_strict_and_matches_eager(variant):
    result = result_of(variant)
    if result.torch_error:
        # Not remat's to fix (seen: layers=2 + checkpoint + dynamic=True, an AssertionError in
        # dynamo's lift_tracked_freevar_to_input with aot_eager too).
        note(f"plain Inductor fails too: {result.torch_error}")
        return
    check(variant, result, zoo.implied_rules(variant))

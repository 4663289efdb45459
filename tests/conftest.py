import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs remat strict: an internal error is raised, never hidden by a fallback
# (tests of the fallback itself pass strict=False).
os.environ.setdefault("REMAT_STRICT", "1")

settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# The files that take longest on 2 CPU cores (Inductor compiles, exports), longest first. `make test`
# hands whole files to its workers (--dist loadfile) in collection order (--no-loadscope-reorder:
# xdist would otherwise order them by their number of tests, which puts the few-test, long files,
# the zoo's, last, where one handed out late can leave the other worker idle at the end).
# Longest first, the last files handed out are the short ones. Measured: 13:17 before, 13:09
# after, within this machine's noise; the workers were already close to balanced, and the
# suite's time is its work. Re-measured on a quiet machine (`make test`'s own two workers the only
# load: 7:56 in all): the zoo 131 s, test_fx_dynamic 122, test_onnx_chunk 80, test_chunk 60,
# test_torch_export 58 (unlisted before, so handed out near the end), test_torch_peak 46, then 35 s
# and less. Other load on the machine stretches every file alike (13-16 min at a load of 3-4.5).
# A file not listed keeps its place after these. Cold (no Inductor cache, CI's case, session 32):
# the zoo 401 s, test_fx_dynamic 365, test_chunk 260, test_torch_peak 147, test_onnx_chunk 121,
# test_torch_export 108, test_hf_models 85, test_fx_backend 75, test_data_parallel 57 (two processes).
LONGEST_FIRST = ("test_zoo.py", "test_fx_dynamic.py", "test_onnx_chunk.py", "test_chunk.py",
                 "test_torch_export.py", "test_torch_peak.py", "test_fx_backend.py", "test_ort_leaf_layout.py",
                 "test_exporters.py", "test_hf_models.py", "test_zoo_random.py", "test_data_parallel.py",
                 "test_hf_sweep.py", "test_pipeline_run.py", "test_cli.py", "test_fx_properties.py",
                 "test_fx_dropout.py", "test_fuzz_rules.py", "test_pytest_plugin.py")


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """`--remat-profile NAME` (remat's plugin; `make test` passes `ci`) picks the suite's own
    Hypothesis profile too, as the CI variable does: `make test` draws the same examples every run
    (12 where a test sets no count), as in CI. Outside a CI environment it drew new sizes each run,
    whose Inductor kernels then compiled cold (test_chunk.py: 87 s against 60), and a new zoo mix
    (test_zoo_random.py, 10-100 s). Runs before the test modules are imported, so their own
    @settings inherit the profile."""
    config.addinivalue_line("markers", "vectorized_kernels: Inductor compiles the test's C++ kernels vectorized "
                                       "(conftest _scalar_kernels)")
    name = config.getoption("remat_profile", default=None)
    if name:
        settings.load_profile(name)


# Inductor's C++ kernels are compiled scalar (`cpp.simdlen` 1, which matches no vector width:
# Inductor's own switch for scalar kernels, read per compile) but where a test asks for them as
# users run them, vectorized (AVX-512 here): the tests marked `vectorized_kernels` (transformers'
# GPT-2) and the zoo's low-precision variants (tests/zoo.py run_variant, which patches it back:
# bfloat16 kernels are where Inductor's vector code has failed, "conflicting declaration
# at_BFloat16_tmp_acc0_vec"). remat hands Inductor a graph; whether each kernel is then written
# with vector instructions is Inductor's choice below that graph, and the tests of remat's plans,
# chunks, estimates and numbers hold either way. A vectorized kernel is dearer to compile: g++
# instantiates the header's AVX-512 templates in every one (0.38 s of CPU in a trivial kernel
# that takes 0.5 s, against 0.17 s scalar). test_fx_backend.py with test_fx_dropout.py, no
# Inductor cache: 142.2 s of CPU vectorized, 89.3 and 94.2 s scalar; two zoo variants (session
# 38): 101 s against 81. test_data_parallel.py's ranks patch it themselves; test_pipeline_run.py's
# compile vectorized.


@pytest.fixture(autouse=True)
def _scalar_kernels(request):
    if request.node.get_closest_marker("vectorized_kernels") or "torch" not in sys.modules:
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.simdlen": 1}):
        yield


@pytest.fixture
def fresh_compiles():
    """Inductor's caches off, so a torch.compile in the test runs remat's joint-graph pass
    whatever an earlier run left cached."""
    torch = pytest.importorskip("torch")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()

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

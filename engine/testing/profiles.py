"""Hypothesis profiles for testing rule files: `remat-ci` (derandomized, so a CI run is the same
run every time, and small) and `remat-dev` (random, more examples, the failure database on)."""
from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

SLOW_DRAWS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
CI_EXAMPLES = 3
# No explain phase: its "lines run only by failing cases" are remat's, not the user's rule's.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
DEV_EXAMPLES = 20


def register_profiles() -> None:
    settings.register_profile("remat-ci", derandomize=True, max_examples=CI_EXAMPLES, deadline=None,
                              database=None, print_blob=False, suppress_health_check=SLOW_DRAWS, phases=PHASES)
    settings.register_profile("remat-dev", max_examples=DEV_EXAMPLES, deadline=None,
                              suppress_health_check=SLOW_DRAWS, phases=PHASES)


register_profiles()

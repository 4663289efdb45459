"""engine.testing: property tests for rule files, with the machinery remat tests itself with.

    from hypothesis import given
    from engine.testing import training_graphs, assert_rules_preserve_numerics

    assert_rules_preserve_numerics("my.rule", training_graphs("my.rule"))   # both backends

* `training_graphs(rules, rule=None)`: a Hypothesis strategy of `TrainingGraph`s the rules match,
  built from each rule's own pattern, with drawn dtypes, shapes, sizes grown until the rule fires,
  and some dims left dynamic (engine.testing.generate).
* `assert_rules_preserve_numerics(rules, graph_or_strategy, backends=("onnx", "fx"), rtol=1e-4)`:
  the rewritten graph's loss and gradients equal the original's on each installed backend; on a
  difference, the smallest failing graph and the plan that broke it (engine.testing.check).
* `assert_rule_fires(rule, graph)` / `assert_rule_refuses(rule, graph, because=...)`: with the
  "why not" of `remat explain` in the failure message.
* `GraphBuilder`: IR graphs by hand; `TrainingGraph.graph` is an engine IR graph.
* `pytest --remat-rules PATH...` runs all of it over every rule of rule files, with no test code
  (engine.testing.plugin); profiles `remat-ci` (derandomized) and `remat-dev`.

Needs Hypothesis (`pip install 'remat[testing]'`); onnxruntime runs the onnx backend and torch
the fx backend, each only when installed. Importing this package imports neither torch nor onnx.
"""
from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "training_graphs": "generate", "unsupported": "generate",
    "assert_rules_preserve_numerics": "check", "assert_rule_fires": "check", "assert_rule_refuses": "check",
    "available_backends": "check", "Checked": "check", "BackendsMissing": "check",
    "GraphBuilder": "graphs", "TrainingGraph": "graphs", "add_backward": "autodiff",
    "register_profiles": "profiles",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Exports load on first use, so that `engine.testing.compare` (numpy only) and the pytest
    plugin's registration import no Hypothesis."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.testing' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value

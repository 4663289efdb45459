"""The pytest plugin: `pytest --remat-rules PATH...` property-tests every rule, no test code written.

Registered as a `pytest11` entry point (pyproject.toml), so installing remat is enough. For
each rule of each rule file given (a file, or a folder of them) and each backend, one test item
(`my.rule::recompute_silu[onnx]`) draws training graphs the rule fires on
(engine.testing.training_graphs), applies the rule with the op facts of its files, and asserts
that the loss and gradients keep the original's values (engine.testing.assert_rules_preserve_numerics).
A failure prints the shrunk graph and the plan that broke it. An item is skipped, with the
reason, when its backend is not installed, when engine.testing builds no graph for the rule's
ops, or when the rule never fired on that backend's graphs.

Options: `--remat-backends onnx,fx`, `--remat-profile ci|dev` (default `ci` where the `CI`
environment variable is set: derandomized, the same run every time), `--remat-examples N`.
This module imports neither Hypothesis nor a backend until a rule item runs.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

PROFILES = ("ci", "dev")
RETRY_SEED = 1      # the second round's graphs: other than the first's, the same every run


def pytest_addoption(parser) -> None:
    group = parser.getgroup("remat", "remat rule files")
    group.addoption("--remat-rules", action="append", nargs="+", default=[], metavar="PATH",
                    help="property-test every rule of these rule files or folders on each backend")
    group.addoption("--remat-backends", default="onnx,fx", metavar="NAMES",
                    help="backends to run the rules on (default onnx,fx; one not installed is skipped)")
    group.addoption("--remat-profile", choices=PROFILES, default=None,
                    help="Hypothesis profile: ci (derandomized, few examples) or dev; default ci "
                         "where the CI environment variable is set, else dev")
    group.addoption("--remat-examples", type=int, default=None, metavar="N",
                    help="graphs per rule and backend (default: the profile's)")


def _rule_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.rule"))
        elif path.is_file():
            files.append(path)
        else:
            raise pytest.UsageError(f"--remat-rules {raw}: no such file or folder")
    return files


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Add the rule items before keyword selection (`-k`) and deselection run."""
    paths = [p for group in config.getoption("remat_rules") for p in group]
    if not paths:
        return
    for path in _rule_files(paths):
        collector = RuleFile.from_parent(session, path=path.resolve())
        collected = session.genitems(collector)
        items.extend(collected)


class RuleFile(pytest.File):
    """One rule file: an item per rule and backend."""

    def collect(self):
        from dsl.errors import RuleCompileError
        from dsl.loader import load_rules

        try:
            self.ruleset = load_rules([self.path])
        except RuleCompileError as err:
            raise pytest.Collector.CollectError(str(err)) from None
        backends = [b.strip() for b in self.config.getoption("remat_backends").split(",") if b.strip()]
        own = [r for r in self.ruleset.rules if Path(r.location.file).resolve() == self.path]
        for rule in own:
            for backend in backends:
                yield RuleItem.from_parent(self, name=f"{rule.name}[{backend}]", rule_name=rule.name,
                                           backend=backend, line=rule.location.line - 1)


class RuleItem(pytest.Item):
    def __init__(self, *, rule_name: str, backend: str, line: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.rule_name = rule_name
        self.backend = backend
        self.line = line                     # of the rule in its file, 0-based as pytest counts
        self.user_properties.append(("remat_rule", rule_name))

    def runtest(self) -> None:
        from hypothesis.errors import Unsatisfiable

        from .check import assert_rules_preserve_numerics, available_backends
        from .generate import rule_alone, training_graphs, unsupported

        ready, skipped = available_backends([self.backend])
        if not ready:
            _skip(f"the {self.backend} backend: {skipped[self.backend]}")
        ruleset = self.parent.ruleset
        rule = ruleset.rule(self.rule_name)
        missing = unsupported(rule)
        if missing:
            _skip(f"engine.testing builds no graph with the ops of {', '.join(missing)}")
        settings = _settings(self.config)
        graphs = fired = 0
        # A backend may refuse what the IR allows (torch's graph spells an op otherwise, keeps a dim
        # dynamic, upcasts a float16 softmax): where the rule fired on none of the graphs, one more
        # round with other graphs.
        for seed in (None, RETRY_SEED):
            try:
                checked = assert_rules_preserve_numerics(rule_alone(ruleset, rule),
                                                         training_graphs(ruleset, rule.name),
                                                         [self.backend], settings=settings, seed=seed)
            except Unsatisfiable:
                _skip(f"no graph engine.testing drew made {rule.name} fire (its guards, or a backend "
                      f"that cannot run the graphs); `remat explain` on a graph of yours says why")
            graphs += checked.graphs.get(self.backend, 0)
            fired += checked.fired.get(rule.name, {}).get(self.backend, 0)
            if fired:
                break
        self.user_properties.append(("remat_graphs", graphs))
        self.user_properties.append(("remat_fired", fired))
        if not fired:
            _skip(f"{rule.name} never fired on {self.backend} in {graphs} graph(s) it fires on in the "
                  f"IR: the {self.backend} backend's graph spells, decomposes or sizes its ops otherwise")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AssertionError):
            notes = "\n".join(getattr(excinfo.value, "__notes__", ()))
            return f"{excinfo.value}" + (f"\n{notes}" if notes else "")
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, self.line, f"{self.parent.name}::{self.name}"


def _skip(reason: str):
    """Skip, reported at the rule's item rather than at this line of the plugin."""
    raise pytest.skip.Exception(reason, _use_item_location=True)


def _settings(config):
    from hypothesis import settings

    from . import profiles  # noqa: F401 - registers remat-ci and remat-dev

    name = config.getoption("remat_profile") or ("ci" if os.environ.get("CI") else "dev")
    chosen = settings.get_profile(f"remat-{name}")
    examples = config.getoption("remat_examples")
    return settings(chosen, max_examples=examples) if examples else chosen

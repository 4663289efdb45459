"""Planning a graph again when Inductor's code for it holds more than its budget.

The budget search (engine.driver) judges each plan by the backend's simulation. After the
compile, Inductor's account of its own code (backends.fx.inductor_account) is a lower bound of
what the step holds; where it is over the budget, the simulation was low on this graph by at
least the difference, and the graph is planned again with the budget less that much (a `cut`,
engine.budget.Budget) and compiled again, up to MAX_REPLANS times.

The cut is remembered per joint graph and remat configuration, in memory and beside Inductor's
caches (`<cache dir>/remat/budget_cuts.json`), and is part of the pass's cache key: a later
run of the same model plans with it at once. Without it, that run's AOTAutograd cache would
serve the first compile, over its budget, and no code would be generated to account.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_REPLANS = 2
# Over the budget by at most this (or 1 MiB) is within it: the account is Inductor's estimate of
# its sizes, and a whole compile again is not worth a percent.
REPLAN_TOLERANCE = 0.01


@dataclass(frozen=True)
class Planned:
    """A joint graph the pass planned for a budget, as the compile's account is checked against it."""

    key: str            # the joint graph as given (joint_digest)
    budget: int         # bytes, the budget resolved for this graph, before any cut
    cut: int            # bytes the planner kept below it
    simulated: int      # the chosen rewrite's simulated peak
    lowest: bool        # the budget could not be met: the plans that reach the lowest peak
    selection: frozenset = frozenset()     # the plans chosen: (site, slices) pairs

    def over(self, held: int) -> bool:
        return held > self.budget + max(int(self.budget * REPLAN_TOLERANCE), 2**20)

    def next_cut(self, held: int) -> int:
        """The cut to plan with next, given the bytes the code held over the budget: at least what
        the simulation missed, and at least what the last cut left over."""
        return max(held - self.simulated, self.cut + held - self.budget)


def joint_digest(graph) -> str:
    """A joint graph's identity across runs: its code and its inputs' shapes and types."""
    digest = hashlib.sha256(graph.python_code(root_module="self").src.encode())
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            digest.update(f"{node.name}:{tuple(getattr(val, 'shape', ()))}:{getattr(val, 'dtype', None)}".encode())
    return digest.hexdigest()[:32]


class BudgetCuts:
    """The cuts found for one remat configuration (`config_key`), by joint graph."""

    def __init__(self, config_key: str):
        self.config = hashlib.sha256(config_key.encode()).hexdigest()[:32]
        self.cuts: dict[str, int] = {}
        self.loaded = False

    def _path(self) -> Path | None:
        """The file beside Inductor's caches; None where caches are off (force_disable_caches)."""
        try:
            import torch._inductor.config as inductor_config
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            if getattr(inductor_config, "force_disable_caches", False):
                return None
            return Path(cache_dir()) / "remat" / "budget_cuts.json"
        except Exception:   # noqa: BLE001 - no cache dir: remembered in this process only
            return None

    def _read(self) -> dict:
        path = self._path()
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError) as err:
            log.debug("budget cuts at %s unreadable: %s", path, err)
            return {}

    def _load(self) -> None:
        if not self.loaded:
            self.loaded = True
            stored = self._read().get(self.config, {})
            self.cuts.update({k: int(v) for k, v in stored.items() if isinstance(v, int) and k not in self.cuts})

    def get(self, key: str) -> int:
        self._load()
        return self.cuts.get(key, 0)

    def record(self, key: str, cut: int) -> None:
        self._load()
        self.cuts[key] = cut
        path = self._path()
        if path is None:
            return
        try:
            data = self._read()
            data.setdefault(self.config, {})[key] = cut
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
                json.dump(data, out)
            os.replace(out.name, path)
        except OSError as err:      # a read-only cache: remembered in this process only
            log.debug("budget cuts not written to %s: %s", path, err)

    def digest(self) -> str:
        """This configuration's cuts, for the pass's cache key."""
        self._load()
        return hashlib.sha256(json.dumps(sorted(self.cuts.items())).encode()).hexdigest()[:16]

"""remat's own failures, contained: a bug in remat must never kill a user's training step.

Every step that works on one match (matching a rule at a node, growing its region,
rewriting it, a backend building it) runs at a `Site`: the rule and the node its pattern
is rooted at. An exception there that is not a refusal is a bug in remat (or in a rule's
op facts), and it is raised as a `PlanFailure` that names the site, the stage and the
exception. What happens next depends on the mode:

- strict (`REMAT_STRICT=1`, or `strict=True` in the APIs): it is raised, with the original
  exception as its cause. The test suite and the benchmarks run strict, so a fallback never
  hides a bug there.
- otherwise: the site is dropped and the rest goes on. Matching and growing only read the
  graph, so a failure there becomes a refusal on the spot (`Planning.failures`). A failure
  while rewriting or building leaves a half-edited copy behind, so `with_fallback` runs the
  whole rewrite again without that site; a backend that cannot get a result at all
  compiles the graph without remat. The user is warned once per failure.

`inject_failure` is a hook for tests: it makes remat fail at a chosen stage of a chosen
rule, so the fallback itself can be tested.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .errors import RematError

STRICT_ENV = "REMAT_STRICT"
INJECT_ENV = "REMAT_INJECT_FAILURE"      # RULE[:STAGE[:NODE]][,...], for tests that run a subprocess
STAGES = ("match", "grow", "rewrite", "build")
MAX_FALLBACKS = 8                        # sites dropped before a rewrite gives up altogether

T = TypeVar("T")


def strict_default() -> bool:
    """Whether `REMAT_STRICT` asks for internal failures to be raised."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_strict(strict: bool | None) -> bool:
    return strict_default() if strict is None else bool(strict)


@dataclass(frozen=True)
class Site:
    """One match: a rule at the node its pattern is rooted at."""

    rule: str
    node: str

    def __str__(self) -> str:
        return f"rule {self.rule} at node {self.node}"


class PlanFailure(RematError):
    """An internal error at one site; `cause` is the exception that was raised there."""

    def __init__(self, site: Site, stage: str, cause: BaseException, plan: str = ""):
        self.site = site
        self.stage = stage
        self.cause = cause
        self.plan = plan
        where = f"{site}, {stage}" + (f" of plan {plan}" if plan else "")
        super().__init__(f"internal error ({where}): {type(cause).__name__}: {cause}")


@contextlib.contextmanager
def at_site(site: Site, stage: str, plan: str = "") -> Iterator[None]:
    """Run a step of one site: any exception becomes a PlanFailure naming it."""
    try:
        check_injected(stage, site.rule, site.node)
        yield
    except PlanFailure:
        raise
    except Exception as exc:
        raise PlanFailure(site, stage, exc, plan) from exc


def with_fallback(attempt: Callable[[frozenset[Site]], T], strict: bool,
                  on_failure: Callable[[PlanFailure], None]) -> T:
    """`attempt(excluded)` until it succeeds, each time without the sites that failed before.
    Strict: the first failure is raised. Raises the last failure once MAX_FALLBACKS sites are
    dropped, or when a site fails again although it was excluded (the caller then goes on
    without remat)."""
    excluded: set[Site] = set()
    while True:
        try:
            return attempt(frozenset(excluded))
        except PlanFailure as failure:
            if strict or failure.site in excluded or len(excluded) >= MAX_FALLBACKS:
                raise
            on_failure(failure)
            excluded.add(failure.site)


class InjectedFailure(RuntimeError):
    """Raised by `inject_failure`: a stand-in for a bug in remat."""


_injected: set[tuple[str, str, str | None]] = set()


@contextlib.contextmanager
def inject_failure(rule: str, stage: str = "rewrite", node: str | None = None) -> Iterator[None]:
    """Test-only: while active, remat raises InjectedFailure at `stage` of every site of `rule`
    (or only at `node`)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}")
    key = (rule, stage, node)
    _injected.add(key)
    try:
        yield
    finally:
        _injected.discard(key)


def _from_env() -> set[tuple[str, str, str | None]]:
    """`REMAT_INJECT_FAILURE=RULE[:STAGE[:NODE]][,...]`."""
    out = set()
    for item in os.environ.get(INJECT_ENV, "").split(","):
        rule, stage, node = (item.strip().split(":") + ["", ""])[:3]
        if rule:
            out.add((rule, stage or "rewrite", node or None))
    return out


def injection_active() -> bool:
    return bool(_injected) or INJECT_ENV in os.environ


def check_injected(stage: str, rule: str, node: str | None = None) -> None:
    if not injection_active():
        return
    wanted = _injected | _from_env()
    if (rule, stage, None) in wanted or (node is not None and (rule, stage, node) in wanted):
        raise InjectedFailure(f"failure injected at {stage} of {rule}" + (f" at {node}" if node else "")
                              + " (test hook)")

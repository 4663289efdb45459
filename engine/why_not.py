"""Why a rule fires or does not, node by node: what `remat explain` prints and what
engine.testing's assertions say when a rule did not do what a test expected."""
from __future__ import annotations

from collections.abc import Iterable

from .apply import plan
from .ir import Graph
from .matcher import MatchContext, explain
from .patterns import RuleSet


def why_not(graph: Graph, rules: RuleSet, rule_name: str, tiers: Iterable[str] = (),
            node_name: str | None = None, forward_outputs: list[str] | None = None) -> list[str]:
    """One entry per node the rule's root op accepts (or the named node): where it fires (with
    its plan string), where it matches but its region is refused (with the reason), where its
    pattern or a guard fails (with the rule's `file:line:col`). A rule of a tier that is not
    enabled is one entry saying so."""
    rules_of_tiers = plan(graph, rules, tiers, forward_outputs)
    if rules.rule(rule_name) is not None and rules_of_tiers.rules.rule(rule_name) is None:
        tier = rules.rule(rule_name).tier
        return [f"{rule_name} is in tier {tier!r}, which is not enabled; add --tier {tier}"]
    planning = rules_of_tiers
    ctx = MatchContext(graph, planning.rules, planning.analysis)
    refused = {id(r.match.root): r for r in planning.refusals if r.match.rule.name == rule_name}
    planned = {id(region.match.root): p for p in planning.plans for region in p.occurrences
               if region.match.rule.name == rule_name}
    lines = []
    for item in explain(graph, planning.rules, rule_name, node_name, ctx):
        if item.matched and item.node is not None and id(item.node) in refused:
            reason = refused[id(item.node)].reason
            lines.append(f"{rule_name} matches at {item.node.name} ({item.node.op}) but does not fire:\n    {reason}")
        elif item.matched and item.node is not None and id(item.node) in planned:
            p = planned[id(item.node)]
            lines.append(f"{rule_name} fires at {item.node.name} ({item.node.op}): plan {p.config_string()}")
        else:
            lines.append(str(item))
    return lines

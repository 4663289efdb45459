"""The plan table (in the spirit of ONNX Runtime's memory-optimizer summary) and its JSON form."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .plan_type import PlanType
from .plans import Plan
from .shapes import evaluate, format_bytes, format_dim, free_dims, simplify

if TYPE_CHECKING:
    from .apply import Planning, Result
    from .ir import Graph


def _status(plan: Plan, applied_known: bool) -> str:
    if not plan.requested:
        return "off"
    wanted = "all" if plan.requested < 0 else str(plan.requested)
    return f"on ({wanted}, applied {plan.applied})" if applied_known else f"on ({wanted})"


def _row(plan: Plan, examples: dict[str, int], applied_known: bool) -> dict[str, Any]:
    saving = plan.saving()
    row = {
        "plan": plan.key,
        "type": int(plan.type),
        "type_name": plan.type.label,
        "status": _status(plan, applied_known),
        "config": plan.config_string(),
        "frequency": plan.frequency,
        "bytes_saved": evaluate(saving, examples),
        "saving_formula": format_dim(saving),
        "rules": plan.rules,
        "shapes": [{"shape": s, "frequency": n} for s, n in plan.shapes()],
        "extra_seconds": plan.extra_seconds,
    }
    if plan.type == PlanType.RECOMPUTE_WITH_COMPROMISE:
        kept = plan.kept_fraction()
        row["fraction_saved"] = None if kept is None else round(1.0 - kept, 4)
    return row


def plan_rows(planning: "Planning", applied_known: bool = False) -> list[dict[str, Any]]:
    return [_row(p, planning.graph.dim_examples, applied_known) for p in planning.plans]


def _table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    """Columns padded to their widest cell; with `markdown`, a GitHub table (pipes escaped)."""
    if markdown:
        def cells(row: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
        return "\n".join([cells(header), "|" + "|".join("---" for _ in header) + "|", *map(cells, rows)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def symbolic_dims(graph: "Graph", inputs_only: bool = False) -> set[str]:
    """The names of the dynamic dims in the shapes of `graph`'s values (subgraphs included), or
    of its inputs only: the dims a user gives example sizes for (shape inference names the
    sizes it cannot know `unk__N`; those show up inside a graph, never in its inputs)."""
    names: set[str] = set()
    for v in (graph.inputs if inputs_only else graph.values()):
        for d in v.shape or ():
            names |= free_dims(d)
    if not inputs_only:
        for node in graph.nodes:
            for sub in node.subgraphs.values():
                names |= symbolic_dims(sub)
    return names


_LISTED = 8


def dims_without_example(planning: "Planning") -> list[str]:
    """The dynamic dims of the graph's inputs and of the sizes in the plan table that have no
    example size (the sizes that depend on them show as `?`)."""
    used = symbolic_dims(planning.graph, inputs_only=True) | free_dims(planning.analysis.stashed_bytes())
    for p in planning.plans:
        used |= free_dims(p.saving())
    return sorted(used - set(planning.graph.dim_examples))


def dims_line(planning: "Planning") -> str:
    """`Dims: batch=8, seq=512`, then the dims with no example size; `all static` only when
    the graph has no dynamic dim that matters."""
    examples = planning.graph.dim_examples
    missing = dims_without_example(planning)
    parts = [", ".join(f"{k}={v}" for k, v in sorted(examples.items()))] if examples else []
    if missing:
        shown = ", ".join(missing[:_LISTED]) + (f" and {len(missing) - _LISTED} more"
                                                if len(missing) > _LISTED else "")
        parts.append(f"{shown} symbolic with no example size (bytes that depend on "
                     f"{'it' if len(missing) == 1 else 'them'} show as ?; give one with --dim "
                     f"{missing[0]}=N)")
    return "Dims: " + ("; ".join(parts) or "all static")


def plan_table(planning: "Planning", result: "Result | None" = None, markdown: bool = False) -> str:
    examples = planning.graph.dim_examples
    rows = plan_rows(planning, applied_known=result is not None)
    timed = any(r["extra_seconds"] is not None for r in rows)
    header = ["Plan", "Type", "Status", "Config", "Freq", "Saved", "Saving (formula)"]
    if timed:
        header.insert(6, "Extra time (est.)")
    body = []
    for r in rows:
        saved = format_bytes(r["bytes_saved"])
        if r["type"] == 2 and r.get("fraction_saved") is not None:
            saved += f" ({r['fraction_saved']:.0%} of it)"
        row = [r["plan"], str(r["type"]), r["status"], r["config"], str(r["frequency"]), saved, r["saving_formula"]]
        if timed:
            row.insert(6, "?" if r["extra_seconds"] is None else f"{r['extra_seconds'] * 1e3:.2f} ms")
        body.append(row)
    stash = planning.analysis.stashed_bytes()
    lines = [
        f"Stashed activations: {len(planning.analysis.stashed)} values, "
        f"{format_bytes(evaluate(stash, examples))}"
        + (f" = {format_dim(stash)}" if not isinstance(stash, int) else ""),
        dims_line(planning),
        "Tiers: default" + "".join(f", {t}" for t in planning.tiers),
        "",
        _table(header, body, markdown)
        if body else "No plans: no rule found a stashed activation it can recompute.",
    ]
    if result is not None and result.chunks and not result.applied:
        # The chunk plans: the backend builds their regions after this; a peak "after" here
        # would be the graph's before (the report of what follows is of the built graph).
        lines += ["", f"Selected {len(result.chunks)} chunk region(s), for the backend to build."]
        if result.peak_before is not None:
            lines.append(f"Estimated peak (in schedule order, views aliased): {format_bytes(result.peak_before)} "
                         f"before they are built")
    elif result is not None:
        total = simplify(sum((r.net for r in result.applied), 0))
        lines += ["", f"Applied {len(result.applied)} recompute region(s), saving "
                      f"{format_bytes(evaluate(total, examples))} of stash"
                      + (f" = {format_dim(total)}" if not isinstance(total, int) else "")]
        if result.peak_before is not None and result.peak_after is not None:
            lines.append(f"Estimated peak (in schedule order, views aliased): "
                         f"{format_bytes(result.peak_before)} -> {format_bytes(result.peak_after)}")
    standing = planning.standing_refusals()     # not those whose root another rule chunks
    if standing:
        lines += ["", f"{len(standing)} match(es) refused (see `remat explain`)."]
    if planning.failures:
        lines += ["", "Skipped after an internal error (the other plans are unaffected):"]
        lines += [f"  {f}" for f in planning.failures]
    on = [r["config"] for r in rows if r["type"] in (1, 3)]
    if on:
        lines += ["", "The plans on by default (types 1 and 3), as a config: " + ",".join(on)]
    return "\n".join(lines)


def plan_json(result: "Result | Planning") -> dict[str, Any]:
    from .apply import Result

    planning = result.planning if isinstance(result, Result) else result
    examples = planning.graph.dim_examples
    out: dict[str, Any] = {
        "dims": examples,
        "dims_without_example": dims_without_example(planning),
        "tiers": ["default", *planning.tiers],
        "stashed_values": len(planning.analysis.stashed),
        "stashed_bytes": evaluate(planning.analysis.stashed_bytes(), examples),
        "stashed_formula": format_dim(planning.analysis.stashed_bytes()),
        "plans": plan_rows(planning, applied_known=isinstance(result, Result)),
        "refused": [{"rule": r.match.rule.name, "node": r.match.root.name, "reason": str(r.reason)}
                    for r in planning.refusals],
    }
    if isinstance(result, Result):
        out["estimated_peak_before"] = result.peak_before
        out["estimated_peak_after"] = result.peak_after
    return out

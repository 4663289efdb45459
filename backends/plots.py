"""Pictures: the planner's trade-off, and memory over a step (matplotlib, an optional dependency:
`pip install remat[plots]`)."""
from __future__ import annotations

from pathlib import Path

from engine.budget import ParetoPoint
from engine.timeline import Panel
from engine.errors import RematError


SUFFIXES = (".png", ".svg", ".pdf")


def pyplot(path: Path, asked: str):
    """matplotlib's pyplot (no display needed), or a RematError, starting with `asked` (how the
    user asked for the picture: `--timeline out.gif`), saying that `path` is not a kind of picture
    it writes or how to install matplotlib. Call it before the work the picture needs."""
    if path.suffix.lower() not in SUFFIXES:
        raise RematError(f"{asked}: write a .png, .svg or .pdf")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RematError(f"{asked}: drawing needs matplotlib, which is not installed: pip install 'remat[plots]'") \
            from None
    return plt


def pareto_plot(points: list[ParetoPoint], path: Path, title: str = "") -> None:
    """Estimated peak against estimated extra time, one point per budget; the original marked."""
    plt = pyplot(path, f"--pareto {path}")
    fig, ax = plt.subplots(figsize=(6, 4))
    mib = 2 ** 20
    ax.plot([p.extra_seconds * 1e3 for p in points], [p.estimated_peak / mib for p in points], "o-",
            label="planner's choice at a budget")
    if points:
        ax.axhline(points[0].original_peak / mib, color="grey", linestyle="--", label="original peak")
    ax.set_xlabel("estimated extra time per step (ms)")
    ax.set_ylabel("estimated peak (MiB)")
    ax.set_title(f"remat: peak against time{f' ({title})' if title else ''}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _runs(plans: list[str | None]) -> list[tuple[int, int, str]]:
    """(first, last, plan) of each run of consecutive steps made for one plan."""
    out: list[tuple[int, int, str]] = []
    for k, plan in enumerate(plans):
        if plan is None:
            continue
        if out and out[-1][2] == plan and out[-1][1] == k - 1:
            out[-1] = (out[-1][0], k, plan)
        else:
            out.append((k, k, plan))
    return out


def _short(key: str, width: int = 48) -> str:
    return key if len(key) <= width else key[:width - 3] + "..."


NODES_RUN = "fraction of the step's nodes run, each curve in the order its own run took"


def timeline_plot(panels: list[Panel], path: Path, title: str = "", x_label: str = NODES_RUN) -> None:
    """Memory over the step, one panel per graph (the original above the rewritten), every curve
    against the fraction of its run's nodes done: simulated lines solid, measured lines thin, each
    peak marked, the measured peak (VmHWM) dashed, and the steps each plan made shaded by plan."""
    plt = pyplot(path, f"timeline {path}")
    mib = 2 ** 20
    keys = list(dict.fromkeys(p for panel in panels for curve in panel.curves for p in curve.plans if p is not None))
    palette = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    colour = {k: palette(i % palette.N) for i, k in enumerate(keys)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.4 * len(panels) + 1.2 + 0.22 * len(keys)),
                             sharex=True, sharey=True, squeeze=False)
    line_styles = {False: dict(linewidth=1.6), True: dict(linewidth=0.9, alpha=0.85)}
    for ax, panel in zip(axes[:, 0], panels):
        shaded = next((c for c in panel.curves if not c.measured), panel.curves[0] if panel.curves else None)
        if shaded is not None and len(shaded.steps) > 1:
            n = len(shaded.steps) - 1
            for first, last, plan in _runs(shaded.plans):
                ax.axvspan(max(0.0, (first - 0.5) / n), min(1.0, (last + 0.5) / n), color=colour[plan],
                           alpha=0.22, linewidth=0)
        for curve in panel.curves:
            if not curve.live:
                continue
            n = max(len(curve.live) - 1, 1)
            xs = [k / n for k in range(len(curve.live))]
            line, = ax.plot(xs, [b / mib for b in curve.live], label=curve.label, **line_styles[curve.measured])
            at = curve.peak_index
            ax.plot([xs[at]], [curve.peak / mib], "o", color=line.get_color(), markersize=6)
            ax.annotate(f"peak {curve.peak / mib:.1f} MiB", (xs[at], curve.peak / mib), textcoords="offset points",
                        xytext=(6, 4 if not curve.measured else -12), fontsize=8, color=line.get_color())
        if panel.measured_peak is not None:
            ax.axhline(panel.measured_peak / mib, color="grey", linestyle="--", linewidth=0.8,
                       label=f"measured peak (VmHWM) {panel.measured_peak / mib:.1f} MiB")
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel("MiB above rest")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel(x_label)
    if keys:
        from matplotlib.patches import Patch

        fig.legend(handles=[Patch(color=colour[k], alpha=0.5, label=_short(k)) for k in keys],
                   loc="lower center", ncol=2, fontsize=8, title="steps made by (original: steps replaced by) plan",
                   title_fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.03 + 0.012 * len(keys), 1, 1))
    fig.savefig(path)
    plt.close(fig)

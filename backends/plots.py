"""Pictures of the planner's trade-off (matplotlib, an optional dependency: `pip install remat[plots]`)."""
from __future__ import annotations

from pathlib import Path

from engine.budget import ParetoPoint
from engine.errors import RematError


def pareto_plot(points: list[ParetoPoint], path: Path, title: str = "") -> None:
    """Estimated peak against estimated extra time, one point per budget; the original marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RematError("--pareto draws with matplotlib, which is not installed: pip install 'remat[plots]'") \
            from None
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise RematError(f"--pareto {path}: write a .png, .svg or .pdf")
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

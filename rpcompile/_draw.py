"""PNG timeline of a Schedule (matplotlib, imported only when a PNG is asked for).

A leaf: it imports nothing of rpcompile at run time (the caller passes the stream order), so
``ir`` can draw its schedules without an import running back into it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rpcompile.ir import Action, Schedule

__all__ = ["draw_timeline"]

_COLORS = {
    "F": "#4e79a7", "T": "#f28e2b", "B": "#59a14f", "EVICT": "#bab0ac", "UP": "#edc948",
    "H2D": "#76b7b2", "D2H": "#b07aa1", "ACC": "#9c755f", "OPT": "#e15759", "SHADOW": "#ff9da7",
    "REDUCE": "#8cd17d", "CHECK": "#d37295",
}  # one per rpcompile.ir.ActionKind (tests/ir/test_registry.py)


def draw_timeline(sched: Schedule, path: str,
                  timeline: Mapping[Action, tuple[float, float]] | None,
                  streams: Sequence[str]) -> None:
    """One lane per (worker, stream) in use, in ``streams`` order, one bar per action, coloured
    by kind. Times are ``timeline`` (ms) when given, else dry-run steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    unit = "ms"
    if timeline is None:
        timeline = {a: (float(t), t + 1.0) for a, t in sched.dry_run().steps.items()}
        unit = "dry-run step"
    lanes: list[tuple[int | None, str]] = []
    for w in [*range(sched.workers), None]:
        for stream in streams:
            if any(a.worker == w and a.stream == stream for a in timeline):
                lanes.append((w, stream))
    row = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(14, 0.35 * len(lanes) + 1.5))
    for a, (start, end) in timeline.items():
        y = row[(a.worker, a.stream)]
        ax.barh(y, end - start, left=start, height=0.8, color=_COLORS[a.kind], edgecolor="white",
                linewidth=0.3)
        if a.is_compute and end - start > 0:
            ax.text((start + end) / 2, y, f"{sched.stage_names[a.stage]}.{a.microbatch}",
                    ha="center", va="center", fontsize=5, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{'host' if w is None else f'w{w}'} {s}" for w, s in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(str(sched), fontsize=8)
    kinds = sorted({a.kind for a in timeline}, key=list(_COLORS).index)
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], fontsize=7,
              loc="upper right", ncol=len(kinds))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

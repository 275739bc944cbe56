"""Pictures of simulated runs: a PNG timeline of a SimResult and grouped bar charts for the
benchmarks. matplotlib is imported only when a picture is drawn (``pip install rpcompile[plot]``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rpcompile.sim.result import SimResult

__all__ = ["bar_chart", "timeline_png"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("drawing needs matplotlib: pip install 'rpcompile[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(result: SimResult, path: str | os.PathLike) -> None:
    """Workers x time: one lane per (worker, stream) in use plus the host, one bar per action
    coloured by kind, at the simulated times (the same drawing as ``Schedule.dump('.png')``)."""
    from rpcompile._draw import draw_timeline
    from rpcompile.ir import STREAMS

    draw_timeline(result.schedule, os.fspath(path), result.timeline, STREAMS)


def bar_chart(groups: Mapping[str, Mapping[str, float | None]], path: str | os.PathLike,
              ylabel: str, title: str | None = None, log: bool = False) -> None:
    """Grouped bars: one group per outer key (e.g. model), one bar per inner key (e.g.
    schedule), in the order given. ``None`` values (a configuration that does not fit) are
    left out and marked with an ``x`` on the axis."""
    plt = _pyplot()
    names = list(groups)
    series: list[str] = []
    for inner in groups.values():
        for key in inner:
            if key not in series:
                series.append(key)
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(names) * max(len(series), 1) / 3), 4.2))
    for j, key in enumerate(series):
        xs, ys, missing = [], [], []
        for i, name in enumerate(names):
            x = i - 0.4 + width * (j + 0.5)
            value = groups[name].get(key)
            (missing if value is None else xs).append(x)
            if value is not None:
                ys.append(value)
        bars = ax.bar(xs, ys, width=width, label=key)
        ax.bar_label(bars, fmt="{:,.4g}", fontsize=6, rotation=90, padding=2)
        if missing:  # drawn in axes coordinates so that it also shows on a log scale
            ax.plot(missing, [0.02] * len(missing), "x", color=f"C{j}",
                    transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.margins(y=0.15)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)

"""What a long compile shows while it works: a progress bar for the partition search and a
line for each plan made, on standard error.

Shown when ``PlanOptions.progress`` is True, or when it is None and standard error is a
terminal; never under ``progress=False`` (``rpcompile ... --quiet``). Nothing here changes a
result: the search reports to :class:`SearchProgress`, which only draws.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["SearchProgress", "enabled", "notice"]


def enabled(progress: bool | None) -> bool:
    """Whether to show progress: as asked, or (None) when standard error is a terminal."""
    if progress is not None:
        return progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def notice(message: str, progress: bool | None) -> None:
    """Print one line about what was done (a plan made, a cached plan used)."""
    if enabled(progress):
        print(message, file=sys.stderr, flush=True)


class SearchProgress:
    """A tqdm bar over the partition search's replays: how many of its budget ran, the best
    simulated step so far and the proven lower bound. ``update`` is called by the search
    after each replay; a disabled one costs a function call."""

    def __init__(self, what: str, budget: int, progress: bool | None) -> None:
        self._bar: Any = None
        if enabled(progress):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=budget, desc=what, unit="replay", leave=False,
                             file=sys.stderr, dynamic_ncols=True, delay=1.0)

    def update(self, replays: int, best_ms: float, bound_ms: float) -> None:
        if self._bar is None:
            return
        self._bar.n = min(replays, self._bar.total or replays)
        self._bar.set_postfix_str(f"best {best_ms:,.1f} ms, bound {bound_ms:,.1f} ms",
                                  refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> SearchProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

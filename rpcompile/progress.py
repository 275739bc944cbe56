"""What a long compile shows while it works: a line for each phase (the capture, each search,
each plan made), on standard error.

Shown when ``PlanOptions.progress`` is True, or when it is None and standard error is a
terminal; never under ``progress=False`` (``rpcompile plan --quiet``). Nothing here changes
a result.
"""

from __future__ import annotations

import sys

__all__ = ["enabled", "notice"]


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

"""What a long compile shows while it works, on standard error: a line for each phase (the
capture, each search, each plan made), and during a partition search a status line (tqdm) of
the candidates replayed with the best figure so far and the next candidate's lower bound.

Shown when ``PlanOptions.progress`` is True, or when it is None and standard error is a
terminal; never under ``progress=False`` (``rpcompile plan --quiet``). The status line is
rewritten in place, so it shows only on a terminal. Nothing here changes a result.
"""

from __future__ import annotations

import sys

__all__ = ["StatusLine", "enabled", "notice"]


def enabled(progress: bool | None) -> bool:
    """Whether to show progress: as asked, or (None) when standard error is a terminal."""
    if progress is not None:
        return progress
    return _terminal()


def notice(message: str, progress: bool | None) -> None:
    """Print one line about what was done (a plan made, a cached plan used)."""
    if enabled(progress):
        print(message, file=sys.stderr, flush=True)


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class StatusLine:
    """A counter with a status text, redrawn in place at most a few times a second and
    cleared when closed; silent unless ``progress`` allows it and standard error is a
    terminal. tqdm is imported only when the line shows."""

    def __init__(self, label: str, progress: bool | None, unit: str = "it") -> None:
        self._bar = None
        if enabled(progress) and _terminal():
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=label, unit=unit, leave=False, file=sys.stderr,
                             mininterval=0.25, dynamic_ncols=True)

    def update(self, status: str, count: int = 1) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(count)
            if self._bar.n == count:  # the first status shows at once, the rest as tqdm paces
                self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

"""What the partition modules share: the error raised when no plan fits, and the record of
what one search did beyond its plan (read where a finding is made)."""

from __future__ import annotations

from contextvars import ContextVar

from rpcompile.errors import RPCompileError
from rpcompile.progress import StatusLine

__all__ = [
    "PartitionError",
]


class PartitionError(RPCompileError, ValueError):
    """No plan fits the hardware; the message names the unit and the memory it needs."""


class _SearchLog:
    """What one partition search did, beyond its plan: whether the tail's working set (the
    LM head and loss: what a smaller loss chunk shrinks) ruled out or slowed a candidate, and
    a status line of its replays (rpcompile.progress)."""

    def __init__(self, status: StatusLine | None = None) -> None:
        self.tail_memory = False
        self.status = status
        self.replays = 0

    def replayed(self, best: float, bound: float) -> None:
        self.replays += 1
        if self.status is not None:
            shown = f"best {best:,.1f} ms, " if best < float("inf") else ""
            self.status.update(f"{self.replays} candidates replayed, {shown}"
                               f"next bound {bound:,.1f} ms")


# The search under way in this thread (its _SearchLog), read where a finding is made.
_SEARCH_LOG: ContextVar[_SearchLog | None] = ContextVar("rpcompile_search_log", default=None)


class _NoPlanFits(Exception):
    def __init__(self, overshoot: int, peak) -> None:
        super().__init__(overshoot)
        self.overshoot, self.peak = overshoot, peak

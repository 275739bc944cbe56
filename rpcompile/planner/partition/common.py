"""What the partition modules share: the error raised when no plan fits, and the record of
what one search did beyond its plan (read where a finding is made)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from rpcompile.errors import RPCompileError
from rpcompile.progress import StatusLine

__all__ = [
    "PartitionError",
    "SearchConfig",
]


class PartitionError(RPCompileError, ValueError):
    """No plan fits the hardware; the message names the unit and the memory it needs."""


@dataclass(frozen=True)
class SearchConfig:
    """What one partition search is asked for, fixed for its whole run: the units and the
    hardware, the run's shape (workers, microbatches per round and their size, sequence
    length, rounds), the optimizer mode, the search's tuning (tail layers, shortlist, replay
    cap, async refinement and class balancing, local-search budget) and how every candidate
    is lowered (``lowering``: the update order and the step check's passes). The recompute
    choice and the memory limits vary within a search and are passed beside it."""

    units: tuple[Any, ...]
    hw: Any
    workers: int
    microbatches: int
    microbatch_size: int
    seq_len: int
    rounds: int
    max_tail_layers: int
    shortlist: int | None
    max_simulations: Any
    optimizer: str
    refine: int
    balance: int
    target_bubble: float
    search: int
    lowering: dict[str, Any]


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

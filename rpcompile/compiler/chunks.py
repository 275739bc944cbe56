"""The loss-chunk variants a compile plans (whole logits or the LM head + loss in chunks), the
choice of the fastest that fits, and the searched variant finished on demand."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from rpcompile.capture.batch import largest_microbatch
from rpcompile.capture.core import Captured
from rpcompile.ir import Plan, UnitProfile
from rpcompile.planner.partition import (
    tail_memory_bound,
)

if TYPE_CHECKING:
    from rpcompile.compiler.compiled import Compiled

__all__ = [
    "AGAIN",
    "AUTO_CHUNK_ABOVE_BYTES",
    "AUTO_CHUNK_TOKENS",
]


AUTO_CHUNK_TOKENS = (4096, 1024)  # the chunk sizes "auto" considers besides the whole logits
AUTO_CHUNK_ABOVE_BYTES = 1 << 30
AGAIN = object()  # in _loss_chunks: the chunked variants follow only when they may be needed


def _loss_chunks(captured: Captured, option: int | str | None, parts: int,
                 shape: tuple[int, int]) -> list:
    """The loss-chunk variants to plan, in order of preference: the option itself (checked
    by :class:`CaptureOptions`), or for ``"auto"`` the whole logits, then (when the
    microbatch's fp32 logits exceed 1 GiB or the whole-logits plan does not fit) those of
    :data:`AUTO_CHUNK_TOKENS` shorter than a microbatch."""
    if option is None or captured.loss_reduction != "sum":
        return [None]
    if option == "auto":  # a chunk as long as the microbatch saves nothing
        tokens = _microbatch_tokens(parts, shape)
        return [None, AGAIN, *(c for c in AUTO_CHUNK_TOKENS if c < tokens)]
    return [option]


def _microbatch_tokens(parts: int, shape: tuple[int, int]) -> int:
    sequences, seq = shape
    return largest_microbatch(sequences, parts) * seq


def _large_logits(captured: Captured, parts: int, shape: tuple[int, int]) -> bool:
    from rpcompile.passes.chunked_loss import logits_bytes

    return logits_bytes(captured, _microbatch_tokens(parts, shape)) > AUTO_CHUNK_ABOVE_BYTES


def _fits(compiled: Compiled, capacity_bytes: int | None) -> bool:
    limit = compiled.hardware.usable_memory_bytes
    if capacity_bytes is not None:
        limit = min(limit, int(capacity_bytes))
    return max(p.peak_bytes for p in compiled.memory) <= limit


def _choose_loss_chunk(tried: list, capacity_bytes: int | None,
                       skipped: Sequence[tuple[int, Plan]] = ()) -> Compiled:
    """The planned variant with the shortest predicted step among those whose schedule fits
    (ties: the earlier, so the whole logits before chunks and larger chunks before smaller);
    when none fits, the first planned (compile() then refuses it, naming the worker), else
    the first variant's PartitionError. ``skipped``: smaller chunks not searched, each with
    the plan of the variant whose search it would repeat.

    A variant is split and its runtime schedule lowered and proven only when it may win:
    best first by its searched figure, which finishing can only keep or slow (one gradient
    slot), so the variants never finished could not have won."""
    planned = [(chunk, c) for chunk, c in tried if isinstance(c, _Searched)]
    if not planned:
        raise tried[0][1]

    def figure(c: _Searched) -> float:
        return round((c.compiled.plan if c.compiled is not None else c.plan).predicted_step_ms, 6)

    while True:
        open_ = [(k, c) for k, c in planned
                 if c.compiled is None or _fits(c.compiled, capacity_bytes)]
        if not open_:  # none fits: the first, which compile() refuses naming the worker
            chunk, best = planned[0][0], planned[0][1].finished()
            break
        chunk, lead = min(open_, key=lambda t: figure(t[1]))
        if lead.compiled is not None:
            best = lead.compiled
            break
        lead.finished()
    if len(tried) + len(skipped) > 1:
        def label(k):
            return "whole logits" if k is None else f"{k:,}-token chunks"

        def said(c) -> str:
            if not isinstance(c, _Searched):
                return "no plan fits"
            if c.compiled is None:
                return f"{c.plan.predicted_step_ms:.1f} ms"
            return f"{c.compiled.plan.predicted_step_ms:.1f} ms" + (
                "" if _fits(c.compiled, capacity_bytes) else " (does not fit)")
        considered = ", ".join(f"{label(k)}: {said(c)}" for k, c in tried)
        considered += "".join(
            f", {label(k)}: not searched (only the tail's working set is smaller, and no "
            f"tail memory limited the {plan.predicted_step_ms:.1f} ms plan's search)"
            for k, plan in skipped)
        best.plan = replace(best.plan, notes=(
            *best.plan.notes, f"LM head + loss: {label(chunk)}, the fastest plan that fits "
            f"({considered})"))
    return best


class _Searched:
    """A loss-chunk variant searched (its unit profiles and plan), finished on demand:
    split into stage programs, its runtime schedule lowered and proven (``finished()``)."""

    def __init__(self, profiles: list[UnitProfile], plan: Plan,
                 finish: Callable[[], Compiled]) -> None:
        self.profiles, self.plan, self._finish = profiles, plan, finish
        self.compiled: Compiled | None = None

    def finished(self) -> Compiled:
        if self.compiled is None:
            self.compiled = self._finish()
        return self.compiled


class _SameSearch(Exception):
    """A loss-chunk variant whose search would only repeat ``plan``'s (_plan_and_split)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.plan = plan


def _memory_limited(plan: Plan) -> bool:
    """Whether memory may have limited ``plan`` in a way a smaller tail working set would
    lift: its search says so (:func:`~rpcompile.planner.partition.tail_memory_bound`), or the
    compile moved it to one gradient slot for the runtime's schedule."""
    return tail_memory_bound(plan) or any(n.startswith(_ONE_SLOT_NOTE) for n in plan.notes)


_ONE_SLOT_NOTE = "memory: one gradient slot per worker"


def _only_tail_smaller(profiles: Sequence[UnitProfile], other: Sequence[UnitProfile]) -> bool:
    """Whether ``profiles`` equal ``other`` in everything but the tail's (the last unit's)
    working set, which is no larger: the partitioner's inputs then differ only where memory
    is checked."""
    if len(profiles) != len(other) or tuple(profiles[:-1]) != tuple(other[:-1]):
        return False
    tail, theirs = profiles[-1], other[-1]
    return (tail.working_bytes <= theirs.working_bytes
            and replace(tail, working_bytes=theirs.working_bytes) == theirs)

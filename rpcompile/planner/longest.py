"""The longest sequence that fits: search the sequence length at which a plan still fits.

:func:`longest_sequence` doubles the sequence length from ``start`` while the partitioner finds
a plan whose whole lowered schedule fits the GPUs (rpcompile.passes.memory), then bisects
between the last length that fits and the first that does not, to a multiple of ``step``
tokens. The first length that does not fit gives the limiting resource: the partitioner's
error names the unit whose working set alone is too large, or the worker, action and memory
parts at the peak of the best plan. ``rpcompile plan --longest`` and
``benchmarks/longest_sequence.py`` print it.

The caller gives the unit profiles at a sequence length (``units_at``): a compiled model's
cost model (rpcompile.compiler.unit_profiles), or the paper models' shapes
(rpcompile.workloads.paper.PaperModel.units). Memory grows with the sequence length, so the lengths that
fit form a prefix and the search finds its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.planner.partition import PartitionError, StageCosting, partition

__all__ = ["QUICK_PARTITION", "LongestSequence", "longest_sequence"]

# A quick partition: at each trial length a plan only has to exist; its speed is not searched.
QUICK_PARTITION = dict(shortlist=20, simulate_top=1, search=0, refine=0)


@dataclass(frozen=True)
class LongestSequence:
    """``seq_len``: the longest length found to fit (0: not even ``start``), ``plan`` the plan
    at that length (None when nothing fits), ``next_len`` the shortest length found not to
    fit (None: everything up to ``limit`` fits) and ``why``: the partitioner's reason there."""

    seq_len: int
    plan: Plan | None
    next_len: int | None
    why: str

    def describe(self) -> str:
        if self.next_len is None:
            return f"{self.seq_len:,} tokens (the search limit; {self.why})"
        return f"{self.seq_len:,} tokens; at {self.next_len:,} tokens: {self.why}"


def longest_sequence(
    units_at: Callable[[int], Sequence[UnitProfile]],
    hardware: Hardware | str,
    workers: int,
    microbatches: int,
    microbatch_size: int = 1,
    rounds: int = 1,
    *,
    costing: StageCosting | None = None,
    optimizer: str = "async",
    start: int = 2048,
    step: int = 1024,
    limit: int = 1 << 20,
    partition_options: dict | None = None,
    recompute: str = "auto",
) -> LongestSequence:
    """The longest sequence (a multiple of ``step``, between ``start`` and ``limit``) at which
    :func:`~rpcompile.planner.partition.partition` finds a plan for ``workers`` GPUs,
    ``microbatches`` microbatches of ``microbatch_size`` sequences and ``rounds`` rounds whose
    whole schedule fits. ``partition_options`` default to :data:`QUICK_PARTITION`.
    ``recompute``: the partitioner's recompute granularity (``"auto"``: by stage where that
    fits, else layer by layer; ``"stage"`` or ``"layer"``: only that)."""
    hw = get_hardware(hardware)
    options = dict(QUICK_PARTITION if partition_options is None else partition_options)
    if not 1 <= step <= start <= limit:
        raise ValueError(f"need 1 <= step ({step}) <= start ({start}) <= limit ({limit})")

    def attempt(seq: int) -> tuple[Plan | None, str]:
        try:
            return partition(units_at(seq), hw, workers, microbatches, microbatch_size, seq,
                             rounds, costing, optimizer=optimizer, recompute=recompute,
                             **options), ""
        except PartitionError as exc:
            return None, str(exc)

    plan, why = attempt(start)
    if plan is None:
        return LongestSequence(0, None, start, why)
    lo, best, hi, why_hi = start, plan, None, ""
    while hi is None and lo < limit:
        trial = min(2 * lo, limit)
        plan, why = attempt(trial)
        if plan is None:
            hi, why_hi = trial, why
        else:
            lo, best = trial, plan
    if hi is None:
        return LongestSequence(lo, best, None, f"fits up to {limit:,} tokens")
    while hi - lo > step:
        mid = max(lo + step, (lo + hi) // 2 // step * step)
        if mid >= hi:
            break
        plan, why = attempt(mid)
        if plan is None:
            hi, why_hi = mid, why
        else:
            lo, best = mid, plan
    return LongestSequence(lo, best, hi, why_hi)

"""Cutting one side of the model: the contiguous min-max partition of the units' costs into
k stages (an exact dynamic programme) under a per-stage memory limit."""

from __future__ import annotations

from functools import cache

from rpcompile.planner.partition.stages import _stage_memory

_EPS = 1e-9  # ms: sums of block costs differ from their layer's cost in the last bits


def _all_cuts(units, cost, kind, costing, limit, span, starts=None):
    """For ``span`` stage counts k from the smallest that fits, and for the largest (every
    grid piece its own stage), the contiguous cut of ``cost`` into k parts with the smallest
    maximum part, each part fitting in memory: {k: (max_part, start_indices)}. ``starts``
    (ascending, beginning with 0) restricts where stages may begin; by default anywhere.

    The finest cut is always among them: it holds the least device memory per stage, so it
    is what a search on this grid alone ends at when its coarser cuts do not fit over the
    whole schedule (:func:`_fitting_plan` cuts again under lower stage limits until the
    fewest stages that fit are every piece); without it a search over a finer grid, whose
    coarser candidates fit, would never see the whole-layer plan a whole-layer search
    returns (Qwen3-235B-A22B: one layer per stage, 1.4 % faster than the block plan)."""
    pos = list(starts) if starts is not None else list(range(len(cost)))
    pos.append(len(cost))
    fine_prefix = [0.0]
    for c in cost:
        fine_prefix.append(fine_prefix[-1] + c)
    n = len(pos) - 1  # cut points are indices into pos
    prefix = [fine_prefix[p] for p in pos]
    fits = {}

    def ok(a: int, b: int) -> bool:  # grid pieces a..b-1 as one stage
        key = (a, b)
        if key not in fits:
            stage = tuple(range(pos[a], pos[b]))
            fits[key] = _stage_memory(units, stage, kind, costing) <= limit
        return fits[key]

    @cache
    def best(i: int, k: int) -> tuple[float, tuple[int, ...]]:
        """Cut units i..n-1 into k stages."""
        if k == 1:
            return ((prefix[n] - prefix[i]), (i,)) if ok(i, n) else (float("inf"), ())
        result = (float("inf"), ())
        for j in range(i + 1, n - k + 2):
            head = prefix[j] - prefix[i]
            if head >= result[0] - _EPS:
                break
            if not ok(i, j):
                break
            rest, starts = best(j, k - 1)
            value = max(head, rest)
            if value < result[0] - _EPS:  # ties keep the first cut, whatever the rounding
                result = (value, (i, *starts))
        return result

    # The fewest stages that fit: pack greedily (optimal for feasibility of contiguous cuts).
    fewest, a = 0, 0
    while a < n:
        b = a + 1
        if not ok(a, b):
            return {}
        while b < n and ok(a, b + 1):
            b += 1
        fewest, a = fewest + 1, b
    out = {}
    for k in range(fewest, min(n, fewest + span - 1) + 1):
        value, cut = best(0, k)
        if value != float("inf"):
            out[k] = (value, tuple(pos[i] for i in cut))
    best.cache_clear()
    # Every piece its own stage: each fits alone (checked by the packing above).
    out.setdefault(n, (max(prefix[i + 1] - prefix[i] for i in range(n)), tuple(pos[:-1])))
    return out

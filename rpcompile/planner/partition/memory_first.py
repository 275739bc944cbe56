"""Plans that fit: the search cut again under lower stage limits until its plan fits over
its whole schedule, and the memory-first plan (every unit its own stage) when none of the
searched candidates does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rpcompile.hardware import Hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.passes.lower import TIGHTEST_WAITS
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.partition.common import PartitionError, SearchConfig, _NoPlanFits
from rpcompile.planner.partition.proofs import (
    _runtime_peaks,
    _simulated_ms,
    _sync_period_proof,
)
from rpcompile.planner.partition.search import _partition
from rpcompile.planner.partition.stages import (
    StageCosting,
    _check_units_fit,
    _planning_inputs,
    build_plan,
)

__all__ = [
    "MEMORY_FIRST_NOTE",
    "memory_first_note",
    "memory_first_plan",
]


MEMORY_FIRST_NOTE = "memory-first fallback"  # how a fallback plan's note starts


def memory_first_note(plan: Plan) -> str | None:
    """The note saying ``plan`` is the memory-first fallback (one unit per stage), which the
    partitioner returns when none of its searched candidates fits; None for any other plan."""
    return next((n for n in plan.notes if n.startswith(MEMORY_FIRST_NOTE)), None)


def _proven_at(plan: Plan, hw: Hardware, rounds: int, optimizer: str,
               capacity: int) -> Plan | None:
    """``plan`` with the memory waits that fit ``capacity`` (the first of
    :data:`WAIT_SETS`), timed and proven with them over the runtime's steps; None when no set
    of waits fits."""
    (ms, bubble, peaks), ran = _simulated_ms(plan, hw, rounds, optimizer, capacity)
    if optimizer == "sync":
        (ms, bubble, peaks), ran = _sync_period_proof(ms, bubble, ran, hw, rounds, capacity)
    if max(p.peak_bytes for p in peaks) > capacity:
        return None
    return replace(ran, predicted_step_ms=ms,
                   worker_peak_bytes=tuple(p.peak_bytes for p in peaks))


def _fitting_plan(cfg: SearchConfig, costing: StageCosting, capacity: int) -> Plan:
    """The fastest plan of the search ``cfg`` under ``costing`` whose whole schedule fits
    ``capacity``."""
    units, hw, workers, microbatches = cfg.units, cfg.hw, cfg.workers, cfg.microbatches
    microbatch_size, seq_len, rounds = cfg.microbatch_size, cfg.seq_len, cfg.rounds
    optimizer, lowering = cfg.optimizer, cfg.lowering
    _check_units_fit(units, costing, capacity)
    # The stage check below is necessary, not sufficient: a worker also holds the next job's
    # weights while they upload, inputs uploaded ahead, values kept for a later stage. The
    # simulated candidates are checked over their whole lowered schedule
    # (rpcompile.passes.memory); when none fits, the stages are cut again under a stage
    # limit lowered by the overshoot, and when that limit leaves no cut at all, under limits
    # bisected between the two (finer stages usually fit, but not always the finest).
    limit, loose, tight, best = capacity, None, None, None
    for _attempt in range(8):
        try:
            return _partition(cfg, costing, limit, capacity)
        except _NoPlanFits as exc:
            best, loose = exc, limit
            limit -= exc.overshoot
        except PartitionError:
            if loose is None:
                raise
            tight = limit
        if tight is not None and limit <= tight:
            if loose - tight < capacity // 100:  # bisected to within 1% of the capacity
                break
            limit = (loose + tight) // 2
    # None of the searched candidates fits. The memory-first plan (every unit its own stage
    # on both sides, every memory wait: what `plan --longest` proves lengths with,
    # rpcompile.planner.longest) holds least, and may fit where no searched cut does.
    first = replace(memory_first_plan(units, hw, workers, microbatches, microbatch_size,
                                      seq_len, rounds, costing), **lowering)
    fallback = None
    if all(st.peak_bytes <= capacity for st in first.stages):
        fallback = _proven_at(first, hw, rounds, optimizer, capacity)
    if fallback is not None:
        return replace(fallback, notes=(
            *first.notes,
            f"{MEMORY_FIRST_NOTE}: none of the searched candidates fits "
            f"{format_bytes(capacity)} per GPU over its whole schedule (the closest peaks at "
            f"{best.peak.describe()}); this plan, one unit per stage, fits "
            f"(peak {format_bytes(max(fallback.worker_peak_bytes))}) but is slow: a shorter "
            "sequence or a smaller microbatch gives the search room"))
    raise PartitionError(
        f"no plan fits {format_bytes(capacity)} per GPU over its whole schedule: the best "
        f"candidate peaks at {best.peak.describe()}, and the memory-first plan (every unit its "
        f"own stage) does not fit either ({_first_misfit(first, hw, rounds, optimizer, capacity)}); "
        "use a smaller microbatch (more microbatches for the same "
        "batch), a shorter sequence, finer units, LoRA, or a GPU with more memory")


def _first_misfit(plan: Plan, hw: Hardware, rounds: int, optimizer: str, capacity: int) -> str:
    """What of the memory-first ``plan`` does not fit ``capacity``: a stage alone, or its
    schedule's peak."""
    worst = max(plan.stages, key=lambda st: st.peak_bytes)
    if worst.peak_bytes > capacity:
        return (f"its stage {plan.stage_name(worst.index)} alone needs "
                f"{format_bytes(worst.peak_bytes)}")
    peaks = _runtime_peaks(plan, hw, rounds, optimizer, capacity)
    top = max(peaks, key=lambda p: p.peak_bytes)
    return f"its schedule peaks at {top.describe(plan.stage_name)}"


def memory_first_plan(units: Sequence[UnitProfile], hardware: Hardware | str, workers: int,
                      microbatches: int, microbatch_size: int = 1, seq_len: int = 1,
                      rounds: int = 1, costing: StageCosting | None = None) -> Plan:
    """The plan that holds least device memory per worker: every unit before the tail its
    own forward stage and its own backward stage, the tail (the last unit) alone, the
    lowering's tightest memory-bounding waits (:data:`~rpcompile.passes.lower.TIGHTEST_WAITS`:
    one gradient slot per worker)."""
    units, hardware, costing = _planning_inputs(units, hardware, costing)
    n = len(units)
    cuts = list(range(n - 1))
    plan = build_plan(units, cuts, cuts, n - 1, hardware, workers, microbatches, microbatch_size,
                      seq_len, rounds, costing,
                      notes=("memory first: every unit its own stage on both sides "
                             "(rpcompile.planner.partition.memory_first_plan)",),
                      optimizer="sync")
    return replace(plan, memory_waits=TIGHTEST_WAITS)

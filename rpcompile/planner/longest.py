"""The longest sequence that fits: the longest length at which some plan's whole schedule fits.

Whether a length fits is a memory question, so the search asks only that, with one proof per
trial length and no timing replay. At each length it builds the plan that holds least device
memory, :func:`memory_first_plan`: every unit its own forward stage and its own backward stage,
the fused tail the last unit alone, every memory-bounding wait of the lowering in place. A
job's weights (twice, for the prefetch), its fp32 gradients and one microbatch's working set
are then the smallest any cut gives: a backward stage of one unit recomputes no more than
layer-by-layer recompute would, and more waits only shorten what the schedule holds
(rpcompile.passes.memory). Only the values a worker holds (boundary activations and their
gradients) grow with the number of cuts, so a coarser plan may fit a little longer where
values make up the peak. The proof
(:func:`rpcompile.passes.memory.worker_peaks`) runs over the schedule's lowered steps; with the
step barrier in place (a step's actions all end before the next step's start) each step is
proven from empty workers, and the proof of one dispatch period of steps (every alignment of
jobs to workers) equals the proof over the simulator's longer steady-state run, which the
partitioner checks, and the proof of the runtime's schedule (``Compiled.memory``).

So a length reported as fitting has a plan, returned with its proven peaks, whose whole
lowered schedule fits the GPUs. Searching: doubling from ``start`` while the length fits, then
bisecting between the last length that fits and the first that does not until they are
``step`` tokens apart (the lengths tried are ``start`` doubled and midpoints, so a multiple of
``step`` only when ``start`` is). The limit named at the first length that does not fit is a unit whose stage
alone is too large (no schedule can help), or the worker, action and memory parts at the peak
of the memory-first plan's proof. The search is not exhaustive over plans: the length it
reports is proven for the plan it returns, and the limit named is that plan's.

The memory-first plan is slow (many short jobs, one activation hop per layer); run the
partitioner at the length found for the fastest plan that fits (``rpcompile plan --seq``).
``rpcompile plan --longest`` and ``benchmarks/longest_sequence.py`` print the search.

The caller gives the unit profiles at a sequence length (``units_at``): a compiled model's
cost model (rpcompile.compiler.unit_profiles), or the paper models' shapes
(rpcompile.workloads.paper.PaperModel.units). Memory grows with the sequence length, so the
lengths that fit form a prefix and the search finds its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.options import MODES, check_choice
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.partition import (
    StageCosting,
    memory_first_plan,
    proof_steps,
    proven_peaks,
)

__all__ = ["LongestSequence", "longest_sequence", "memory_first_plan", "proof_steps",
           "proven_peaks"]


@dataclass(frozen=True)
class LongestSequence:
    """``seq_len``: the longest length found to fit (0: not even ``start``), ``plan`` the
    memory-first plan at that length with its proven ``worker_peak_bytes`` (None when nothing
    fits), ``next_len`` the shortest length found not to fit (None: everything up to
    ``limit`` fits), ``why``: what does not fit there, and ``proofs``: how many schedules
    were lowered and proven."""

    seq_len: int
    plan: Plan | None
    next_len: int | None
    why: str
    proofs: int = 0

    def describe(self) -> str:
        if self.next_len is None:
            return f"{self.seq_len:,} tokens (the search limit; {self.why})"
        return f"{self.seq_len:,} tokens; at {self.next_len:,} tokens: {self.why}"


def _alone(plan: Plan, capacity: int) -> str:
    """Why a stage of the memory-first plan cannot fit even alone ('' when each does)."""
    worst = max(plan.stages, key=lambda s: s.peak_bytes)
    if worst.peak_bytes <= capacity:
        return ""
    names = ", ".join(repr(plan.units[u].name) for u in worst.units)
    return (f"unit {names} alone needs {format_bytes(worst.peak_bytes)} of device memory as "
            f"a {worst.kind} stage (weights twice for prefetch, its fp32 gradients and one "
            f"microbatch's working set) but the GPU has {format_bytes(capacity)} usable")


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
    capacity_bytes: int | None = None,
) -> LongestSequence:
    """The longest sequence (between ``start`` and ``limit``, found to within ``step`` tokens) at which
    the memory-first plan (:func:`memory_first_plan`) for ``workers`` GPUs, ``microbatches``
    microbatches of ``microbatch_size`` sequences and ``rounds`` rounds has a whole lowered
    schedule whose proven peak fits ``capacity_bytes`` (default: the hardware's usable
    memory). ``optimizer``: the update mode the schedule is lowered for."""
    hw = get_hardware(hardware)
    check_choice("optimizer", optimizer, MODES)
    if not 1 <= step <= start <= limit:
        raise ValueError(f"need 1 <= step ({step}) <= start ({start}) <= limit ({limit})")
    capacity = hw.usable_memory_bytes if capacity_bytes is None else int(capacity_bytes)
    proofs = 0

    def attempt(seq: int) -> tuple[Plan | None, str]:
        nonlocal proofs
        plan = memory_first_plan(units_at(seq), hw, workers, microbatches, microbatch_size,
                                 seq, rounds, costing)
        if why := _alone(plan, capacity):
            return None, why
        peaks = proven_peaks(plan, rounds, optimizer)
        proofs += 1
        top = max(peaks, key=lambda p: p.peak_bytes)
        if top.peak_bytes > capacity:
            return None, (f"the memory-first plan's whole schedule peaks at "
                          f"{top.describe(plan.stage_name)}, over the {format_bytes(capacity)} "
                          "usable")
        return replace(plan, worker_peak_bytes=tuple(p.peak_bytes for p in peaks)), ""

    plan, why = attempt(start)
    if plan is None:
        return LongestSequence(0, None, start, why, proofs)
    lo, best, hi, why_hi = start, plan, None, ""
    while hi is None and lo < limit:
        trial = min(2 * lo, limit)
        plan, why = attempt(trial)
        if plan is None:
            hi, why_hi = trial, why
        else:
            lo, best = trial, plan
    if hi is None:
        return LongestSequence(lo, best, None, f"fits up to {limit:,} tokens", proofs)
    while hi - lo > step:
        mid = max(lo + step, (lo + hi) // 2 // step * step)
        if mid >= hi:
            break
        plan, why = attempt(mid)
        if plan is None:
            hi, why_hi = mid, why
        else:
            lo, best = mid, plan
    return LongestSequence(lo, best, hi, why_hi, proofs)

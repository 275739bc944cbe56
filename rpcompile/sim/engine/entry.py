"""The simulator's entry points: compute_times() (milliseconds per compute action, from stage
costs or per-unit times), simulate() (replay, then measure), replay_timeline() (the
replay alone), with_staging() (a schedule's host staging slots, from its replay), and
paused_gc() (the collector off while a replay's objects are alive)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import (
    Action,
    Plan,
    Schedule,
    Stage,
    UnitProfile,
)
from rpcompile.sim.engine.measures import _host_memory, _measure
from rpcompile.sim.engine.replay import _Replay
from rpcompile.sim.result import SimResult
from rpcompile.sim.sharding import shadow_gather_bytes, shadow_journal_bytes

__all__ = [
    "compute_times",
    "paused_gc",
    "replay_timeline",
    "simulate",
    "with_staging",
]


def compute_times(
    schedule: Schedule,
    plan: Plan | Sequence[Stage],
    units: Sequence[UnitProfile] | None = None,
    recompute: bool = True,
) -> dict[tuple[str, int], float]:
    """Milliseconds of one microbatch of each (compute kind, stage) in ``schedule``.

    RoundPipe schedules use the plan's ``Stage.compute_ms`` (forward | fused tail | recompute +
    backward) unless ``units`` is given, in which case stage times are re-derived from those
    per-unit times (a table of measured times). Baseline schedules (weights bound to workers)
    split each stage into F = the sum of its units' forwards and B = the sum of their
    backwards plus, with ``recompute``, their forwards again, except for the model's last unit
    (LM head and loss: its activations are kept, as in RoundPipe's fused tail). Baselines need
    per-unit times: a :class:`Plan`'s own units, or ``units``.
    """
    stages = _stage_tuple(plan)
    if units is None and isinstance(plan, Plan):
        units = plan.units if schedule.stage_workers is not None else None
    out: dict[tuple[str, int], float] = {}
    if schedule.stage_workers is None and units is None:
        for s in stages:
            kind = {"forward": "F", "tail": "T", "backward": "B"}[s.kind]
            out[(kind, s.index)] = s.compute_ms
        return out
    if units is None:
        raise InvalidInput(
            f"a {schedule.kind} schedule needs per-unit forward and backward times to split "
            "each stage into F and B: pass units= (e.g. plan.units or rpcompile.workloads.paper units)"
        )
    last = len(units) - 1
    for i, s in enumerate(stages):
        fwd = sum(units[u].forward_ms for u in s.units)
        bwd = sum(units[u].backward_ms for u in s.units)
        again = sum(units[u].forward_ms for u in s.units if u != last) if recompute else 0.0
        if schedule.stage_workers is not None:
            out[("F", i)] = fwd
            out[("B", i)] = bwd + again
        elif s.kind == "forward":
            out[("F", i)] = fwd
        else:  # tail (no recompute: forward + loss + backward) or recompute + backward
            out[("T" if s.kind == "tail" else "B", i)] = fwd + bwd
    return out


def _stage_tuple(plan: Plan | Sequence[Stage]) -> tuple[Stage, ...]:
    return tuple(plan.stages if isinstance(plan, Plan) else plan)


def simulate(
    schedule: Schedule,
    plan: Plan | Sequence[Stage],
    hardware: Hardware | str,
    *,
    units: Sequence[UnitProfile] | None = None,
    unit_ms: Mapping[str, tuple[float, float]] | None = None,
    recompute: bool = True,
    tokens_per_microbatch: int | None = None,
) -> SimResult:
    """Replay ``schedule`` (lowered, or compute only) on ``hardware`` and measure it.

    ``plan`` gives stage costs and sizes (a :class:`Plan`, or the stage list a baseline was
    built from). ``units`` overrides the per-unit profiles (default: the plan's); ``unit_ms``
    maps unit names to measured (forward_ms, backward_ms) and replaces those times, so a
    schedule can be replayed with measured per-unit times. ``tokens_per_microbatch`` defaults
    to the plan's ``microbatch_size * seq_len``. Transfer sizes are the actions' own bytes.
    """
    hw = get_hardware(hardware)
    stages = _stage_tuple(plan)
    if len(stages) != len(schedule.stage_names):
        raise InvalidInput(f"the schedule has {len(schedule.stage_names)} stages, the plan "
                         f"{len(stages)}: simulate a schedule with the plan it was built from")
    base_units = tuple(units) if units is not None else (
        plan.units if isinstance(plan, Plan) else None)
    if unit_ms is not None:
        if base_units is None:
            raise InvalidInput("unit_ms needs unit profiles to apply to: pass a Plan or units=")
        unknown = set(unit_ms) - {u.name for u in base_units}
        if unknown:
            raise InvalidInput(f"unit_ms names units the plan does not have: {sorted(unknown)}")
        base_units = tuple(
            replace(u, forward_ms=unit_ms[u.name][0], backward_ms=unit_ms[u.name][1])
            if u.name in unit_ms else u for u in base_units)
    explicit = units is not None or unit_ms is not None
    times = compute_times(schedule, plan, base_units if explicit else None, recompute)
    if tokens_per_microbatch is None:
        tokens_per_microbatch = plan.microbatch_size * plan.seq_len if isinstance(plan, Plan) else 0
    with paused_gc():
        timeline = _run(schedule, plan, hw, times)
        return _measure(schedule, stages, base_units, hw, timeline, times, tokens_per_microbatch)


def replay_timeline(schedule: Schedule, plan: Plan | Sequence[Stage],
                    hardware: Hardware | str) -> dict[Action, tuple[float, float]]:
    """The (start, end) of every action of ``schedule`` replayed as :func:`simulate` replays
    it with the plan's own stage times, without the measures (bubble split, exposed time,
    memory): for callers that read only the timeline, such as the partitioner's search."""
    hw = get_hardware(hardware)
    if len(_stage_tuple(plan)) != len(schedule.stage_names):
        raise InvalidInput(f"the schedule has {len(schedule.stage_names)} stages, the plan "
                         f"{len(_stage_tuple(plan))}: simulate a schedule with the plan it "
                         "was built from")
    with paused_gc():
        return _run(schedule, plan, hw, compute_times(schedule, plan))


def with_staging(schedule: Schedule, plan: Plan | Sequence[Stage],
                 hardware: Hardware | str) -> Schedule:
    """``schedule`` with its host staging slots and their ``reuse`` waits
    (rpcompile.passes.staging.staging_slots), lent as a replay of it on ``hardware`` lends
    its downloads' buffers, so that replay and its step time are unchanged and the
    simulator's host figure (:func:`peak_host_bytes`) is the slots' sum. A data-parallel
    schedule on a profile without an inter-server link cannot be timed: lent in the order of
    its dry run (unit steps). Returned as it is when it has slots already or is a baseline's
    (``stage_workers`` set: no pool)."""
    from rpcompile.passes.staging import staging_slots

    if schedule.staging_bytes or schedule.stage_workers is not None:
        return schedule
    hw = get_hardware(hardware)
    if schedule.ranks > 1 and hw.link is None:
        timeline = {a: (float(t), float(t + 1)) for a, t in schedule.dry_run().steps.items()}
    else:
        timeline = replay_timeline(schedule, plan, hw)
    with paused_gc():  # the timeline and the schedule alive: many objects for a collection
        return staging_slots(schedule, timeline)


def peak_host_bytes(schedule: Schedule, plan: Plan | Sequence[Stage],
                    hardware: Hardware | str) -> int:
    """The host peak :func:`simulate` reports for ``schedule`` (``SimResult.peak_host_bytes``,
    the plan's own stage times and unit profiles), from the same replay without the other
    measures (bubble split, exposed transfers, device memory): for callers that read only
    the host figure, such as compile()'s host memory check."""
    hw = get_hardware(hardware)
    stages = _stage_tuple(plan)
    if len(stages) != len(schedule.stage_names):
        raise InvalidInput(f"the schedule has {len(schedule.stage_names)} stages, the plan "
                         f"{len(stages)}: simulate a schedule with the plan it was built from")
    units = plan.units if isinstance(plan, Plan) else None
    with paused_gc():
        timeline = _run(schedule, plan, hw, compute_times(schedule, plan))
        return _host_memory(schedule, stages, units, timeline, hw.undo_journal)


def _run(schedule: Schedule, plan: Plan | Sequence[Stage], hw: Hardware,
         times: Mapping[tuple[str, int], float]) -> dict[Action, tuple[float, float]]:
    replay = _Replay(schedule, times, hw)
    if schedule.sharded:  # what each SHADOW's all-gather of updated shadows moves
        replay.gathered = shadow_gather_bytes(schedule, plan)
    # What each SHADOW's undo journal saves (a parameter two stages read, once a step); bare
    # stages say nothing of which parameters they share, so each saves its own bytes. A run
    # without the journal saves nothing, nor does an async SHADOW (it writes the copy of the
    # shadow no committed step reads).
    if not hw.undo_journal or schedule.optimizer == "async":
        replay.journaled = {a: 0 for a in schedule.host if a.kind == "SHADOW"}
    elif isinstance(plan, Plan):
        replay.journaled = shadow_journal_bytes(schedule, plan)
    else:
        replay.journaled = {a: a.bytes for a in schedule.host if a.kind == "SHADOW"}
    return replay.run()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was before after it.

    A replay (and the lowering before it) allocates hundreds of thousands of small objects
    while a schedule's actions are alive, and every collection walks them all: a third of an
    async replay's time. Nothing here makes reference cycles, so nothing waits for a
    collection. The collector's on/off state is the process's: blocks in any number of
    threads count themselves under one lock, the first turns the collector off and the last
    one out restores what the first found."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


_gc_lock = threading.Lock()
_gc_depth = 0  # paused_gc blocks running now, in every thread
_gc_was_enabled = True  # what the first of them found

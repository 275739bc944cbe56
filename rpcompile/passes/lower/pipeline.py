"""The lowering as one call: lower() runs the passes in order under the pass manager, and
the runtime's schedule (runtime_schedule) and its proven per-worker peaks (runtime_peaks) are
built with it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace

from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.ir import BOUNDED_WAITS, Plan, Schedule, ScheduleError, Stage
from rpcompile.options import DEFAULT_CHUNK_BYTES, PlanOptions
from rpcompile.passes.invariants import check_dispatch
from rpcompile.passes.lower.common import MEMORY_WAITS
from rpcompile.passes.lower.optimizer import add_optimizer
from rpcompile.passes.lower.ordering import add_commit, add_events, add_step_barrier
from rpcompile.passes.lower.reduce import add_reductions
from rpcompile.passes.lower.transfers import (
    add_activation_transfers,
    add_gradient_downloads,
    add_weight_uploads,
    grad_slots,
)
from rpcompile.passes.manager import PassManager, PassRecord, debug_checks, run_pass
from rpcompile.passes.memory import ScheduleOrder, WorkerPeak, schedule_order, worker_peaks
from rpcompile.passes.schedule import build_schedule, runtime_cycle
from rpcompile.passes.validate import validate as check

__all__ = [
    "DATA_PARALLEL_PASSES",
    "LOWERING_PASSES",
    "keep_runtime_schedules",
    "kept_lowering",
    "lower",
    "memory_free",
    "runtime_peaks",
    "runtime_schedule",
]


LOWERING_PASSES = ("upload", "transfers", "grads", "optimizer", "commit", "events")
# Data parallel over more than one rank adds the cross-rank reduction (pass 4b).
DATA_PARALLEL_PASSES = ("upload", "transfers", "grads", "optimizer", "reduce", "commit",
                        "barrier", "events")
_BASELINE_PASSES = ("transfers", "events")  # weights and optimizer stay on the bound workers


# --------------------------------------------------------------------------------------------
# lower
# --------------------------------------------------------------------------------------------


def lower(schedule: Schedule, plan: Plan | Sequence[Stage], *,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES, passes: Sequence[str] | None = None,
          validate: bool = True, updates: str | None = None, ranks: int = 1,
          ) -> tuple[Schedule, tuple[PassRecord[Schedule], ...]]:
    """Run the lowering passes (default: all of :data:`LOWERING_PASSES` for RoundPipe, or of
    :data:`DATA_PARALLEL_PASSES` when ``ranks`` > 1; only ``transfers`` and ``events`` for the
    weight-bound baselines) through a :class:`~rpcompile.passes.manager.PassManager`, the
    compile's one pass mechanism. With ``validate`` (whatever ``RPCOMPILE_DEBUG`` says) the
    last schedule is validated, and under ``RPCOMPILE_DEBUG=1`` the input (as pass
    ``dispatch``) and each pass's output too; a broken schedule raises
    :class:`~rpcompile.passes.manager.ScheduleInvariantError` naming the first pass whose
    schedule fails. ``updates`` is the sync update order
    (:func:`add_optimizer`; ``None``: ``deferred`` for data parallel, else the plan's own,
    ``Plan.updates``; a bare stage list, ``overlap``).
    ``ranks``: processes training data parallel (:func:`add_reductions`). The memory-bounding
    waits added are ``plan.memory_waits`` (:data:`BOUNDED_WAITS` for a bare stage list).
    Returns the lowered schedule and one record per pass."""
    if ranks > 1 and schedule.stage_workers is not None:
        raise InvalidInput(f"data parallel (ranks={ranks}) lowers RoundPipe schedules; the "
                         f"{schedule.kind} baseline keeps its gradients on the bound workers")
    if updates is None:  # the plan's own order (Plan.updates); data parallel sync defers
        updates = "overlap" if schedule.optimizer != "sync" else (
            "deferred" if ranks > 1 else plan.updates if isinstance(plan, Plan) else "overlap")
    if passes is None:
        passes = (LOWERING_PASSES if ranks == 1 else DATA_PARALLEL_PASSES) \
            if schedule.stage_workers is None else _BASELINE_PASSES
    waits = plan.memory_waits if isinstance(plan, Plan) else BOUNDED_WAITS
    unknown = [w for w in waits if w not in MEMORY_WAITS]
    if unknown:
        raise InvalidInput(f"unknown memory waits {unknown}; known: {list(MEMORY_WAITS)}")
    table = {
        "upload": lambda s: add_weight_uploads(s, plan, chunk_bytes),
        "transfers": lambda s: add_activation_transfers(s, waits),
        "grads": lambda s: add_gradient_downloads(s, plan, chunk_bytes, grad_slots(waits)),
        "optimizer": lambda s: add_optimizer(s, plan, updates),
        "reduce": lambda s: add_reductions(s, plan, ranks),
        "commit": add_commit,
        "barrier": add_step_barrier,
        "events": add_events,
    }
    unknown = [p for p in passes if p not in table]
    if unknown:
        raise InvalidInput(f"unknown lowering passes {unknown}; known: {list(table)}")
    every = validate and debug_checks()
    if every:
        check(schedule, "dispatch")
    # The compile's one pass mechanism (run_pass): each lowering pass recorded like the
    # compile's, a broken schedule raising ScheduleInvariantError (a PassInvariantError and
    # a ScheduleError) naming the pass. Under RPCOMPILE_DEBUG=1 every pass's schedule is
    # validated as it is made; otherwise the last one, the schedule that runs, is validated
    # (_validate_last), and the others only to name the pass when it fails.
    manager = PassManager([(p, table[p]) for p in passes],
                          check=check if every else None, always=True)
    lowered, records = manager.run(schedule)
    if validate and not every:
        records = _validate_last(schedule, records)
    return lowered, records


def _validate_last(schedule: Schedule, records: tuple[PassRecord[Schedule], ...],
                   ) -> tuple[PassRecord[Schedule], ...]:
    """Validate the last schedule of ``records`` (``schedule``, the dispatch, when there is
    none) and return the records with that check's time on the last. When it fails, the
    dispatch and then each pass's schedule are validated in order, so the error names the
    first pass whose schedule breaks an invariant, as checking after every pass would."""
    last = records[-1] if records else None
    t0 = time.perf_counter()
    try:
        check(schedule if last is None else last.artifact,
              "dispatch" if last is None else last.name)
    except ScheduleError:
        check(schedule, "dispatch")
        for r in records:
            run_pass([], r.name, lambda r=r: r.artifact, lambda a, r=r: check(a, r.name),
                     always=True)
        raise
    if last is None:
        return records
    return (*records[:-1], replace(last, check_ms=(time.perf_counter() - t0) * 1e3))


def runtime_schedule(plan: Plan, options: PlanOptions, *, trail: list | None = None,
                     validate: bool | None = None) -> Schedule:
    """The lowered schedule the runtime runs, for the plan options ``options``
    (:class:`~rpcompile.options.PlanOptions`: ``gpus`` workers, ``microbatches_per_round``,
    ``rounds``, ``mode``, ``chunk_bytes``, ``schedule_steps``, ``updates``, ``ranks``,
    ``shard_optimizer``), as :func:`rpcompile.compile` resolved them
    (``Compiled.options.plan``, the update order the run needs in ``updates``; ``None``:
    :func:`lower`'s default, the plan's own): the steps of
    :func:`~rpcompile.passes.schedule.runtime_cycle` (``schedule_steps``, or the fewest: as
    many steps as an edge reaches back, then one dispatch period, which a run repeats
    (``Schedule.step_of``), then one more, the context of the last), marked ``sharded`` for
    sharded data parallel.

    The one builder of it: :func:`rpcompile.compile` keeps it as ``Compiled.schedule``
    (passing ``trail``, a list the dispatch's and each lowering pass's records are appended
    to, and ``validate=True``); a Trainer given other options (mode, ``schedule_steps``,
    ``chunk_bytes``) builds its own with this. ``validate`` (default: ``RPCOMPILE_DEBUG=1``)
    checks the dispatch and every lowering pass's schedule. Inside
    :func:`keep_runtime_schedules` a schedule already lowered there for the same inputs is
    returned again (with its records, validated when asked) instead of lowered anew."""
    if not isinstance(options, PlanOptions):
        raise InvalidType(f"runtime_schedule's options must be an rpcompile.PlanOptions, got "
                          f"{type(options).__name__}")
    validate = debug_checks() if validate is None else validate
    records: list = [] if trail is None else trail
    kept = _KEPT.get()
    # Under RPCOMPILE_DEBUG=1 a validated schedule is lowered anew, each pass checked as made.
    if kept is None or (validate and debug_checks()):
        lowered, made = _lowered_cycle(plan, options, validate)
        records.extend(made)
        return lowered
    hit = _kept(kept, plan, options)
    made = hit.records
    if validate:  # as lower() validates: the last schedule, the earlier ones to name a break
        made = (made[0], *_validate_last(made[0].artifact, made[1:]))
    records.extend(made)
    return hit.lowered


def _lowered_cycle(plan: Plan, options: PlanOptions, validate: bool
                   ) -> tuple[Schedule, list[PassRecord]]:
    """runtime_schedule's lowering: the schedule and the dispatch's and passes' records."""
    workers, rounds = options.gpus, options.rounds
    ranks = options.ranks or 1
    steps, repeat_from, repeat_until = runtime_cycle(plan.stages, workers, rounds,
                                                     options.schedule_steps)
    records: list[PassRecord] = []
    # The cycle is the dispatch's: every pass carries it, so each record's artifact is the
    # schedule as the run reads it.
    compute = run_pass(records, "dispatch", lambda: build_schedule(
        plan, workers=workers, microbatches=options.microbatches_per_round, rounds=rounds,
        steps=steps, kind="roundpipe", optimizer=options.mode,
    ).replace(repeat_from=repeat_from, repeat_until=repeat_until),
        check_dispatch if validate else None)
    lowered, lowering = lower(compute, plan, chunk_bytes=options.chunk_bytes,
                              validate=validate, updates=options.updates, ranks=ranks)
    records.extend(lowering)
    if options.shard_optimizer and ranks > 1:  # what its REDUCE and SHADOW actions move
        lowered = lowered.replace(sharded=True)
    return lowered, records


def _kept(kept: _KeptSchedules, plan: Plan, options: PlanOptions) -> _Kept:
    """The remembered runtime schedule of ``plan`` and ``options``, lowered now if not yet."""
    key = _cycle_key(plan, options)
    with kept.lock:
        hit = kept.get(key)
    if hit is None:
        lowered, made = _lowered_cycle(plan, options, False)
        hit = _Kept(lowered, tuple(made))
        with kept.lock:
            kept.put(key, hit)
    return hit


def _cycle_key(plan: Plan, options: PlanOptions) -> tuple:
    """Everything the runtime's schedule depends on, each as runtime_schedule resolves it:
    the plan without what no pass reads (:func:`memory_free`); the cycle of steps, the
    update order :func:`lower` applies, and the other options it reads. Loss-chunk variants
    of one plan (rpcompile.compiler) differ only in the tail's working set: one schedule."""
    ranks = options.ranks or 1
    updates = options.updates
    if updates is None:
        updates = "overlap" if options.mode != "sync" else (
            "deferred" if ranks > 1 else plan.updates)
    return (memory_free(plan), options.gpus, options.microbatches_per_round, options.rounds,
            options.mode,
            runtime_cycle(plan.stages, options.gpus, options.rounds, options.schedule_steps),
            options.chunk_bytes, updates, ranks, options.shard_optimizer and ranks > 1)


def memory_free(plan: Plan) -> Plan:
    """``plan`` without what the dispatch and the lowering never read: its figures
    (predicted step, proven peaks, notes: what the search writes into a plan after lowering
    it) and its device-memory figures (each stage's ``peak_bytes``, each unit's
    ``working_bytes``), which only the memory proof reads. Two plans equal here lower to
    equal schedules."""
    return replace(plan, predicted_step_ms=0.0, worker_peak_bytes=(), notes=(),
                   stages=tuple(replace(st, peak_bytes=0) for st in plan.stages),
                   units=tuple(replace(u, working_bytes=0) for u in plan.units))


class _Kept:
    """One remembered lowered schedule: the schedule, its records (unvalidated), its
    happens-before order (``schedule_order``, what every proof of it reads whatever the
    memory figures) and its proven peaks, by the stages' ``peak_bytes`` (what the proof
    reads besides the schedule), each once asked for."""

    def __init__(self, lowered: Schedule, records: tuple[PassRecord, ...] = ()) -> None:
        self.lowered, self.records = lowered, records
        self.peaks: dict[tuple[int, ...], tuple[WorkerPeak, ...]] = {}
        self._order: ScheduleOrder | None = None

    def order(self) -> ScheduleOrder:
        if self._order is None:
            self._order = schedule_order(self.lowered)
        return self._order


class _KeptSchedules:
    """The lowered schedules of one :func:`keep_runtime_schedules` scope: the runtime's
    (a large model's with its records is hundreds of megabytes) and the other lowerings
    (:func:`kept_lowering`), each the least recently used dropped past its cap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._kinds: dict[str, tuple[OrderedDict[tuple, _Kept], int]] = {
            "runtime": (OrderedDict(), _SCHEDULES_KEPT),
            "lowering": (OrderedDict(), _LOWERINGS_KEPT)}

    def get(self, key: tuple, kind: str = "runtime") -> _Kept | None:
        items = self._kinds[kind][0]
        hit = items.get(key)
        if hit is not None:
            items.move_to_end(key)
        return hit

    def put(self, key: tuple, kept: _Kept, kind: str = "runtime") -> None:
        items, cap = self._kinds[kind]
        items[key] = kept
        while len(items) > cap:
            items.popitem(last=False)


_SCHEDULES_KEPT = 4
# Other lowerings kept (kept_lowering): the partitioner's one-step screens of candidates,
# a few megabytes each for the largest model; a search's screens (and their shared
# first passes) all fit.
_LOWERINGS_KEPT = 48
_KEPT: ContextVar[_KeptSchedules | None] = ContextVar("rpcompile_runtime_schedules",
                                                      default=None)


@contextmanager
def keep_runtime_schedules() -> Iterator[None]:
    """Within it, :func:`runtime_schedule`, :func:`runtime_peaks` and :func:`kept_lowering`
    remember what they lowered and proved (the last few, by everything they depend on), so a
    later call with the same inputs reuses it: the partition search proves its candidates
    over the runtime's schedule (rpcompile.planner.partition.proofs), and
    :func:`rpcompile.compile` keeps the winner's schedule and proof without lowering it
    again. Both are pure functions of those
    inputs, so what is reused equals what would be made; outside the scope nothing is kept.
    Nested scopes share the outer one's."""
    token = _KEPT.set(_KeptSchedules()) if _KEPT.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _KEPT.reset(token)


def kept_lowering(plan: Plan, how: tuple, lowering: Callable[[], Schedule]) -> _Kept:
    """``lowering()``, the schedule lowered for ``plan`` in the way ``how`` names (everything
    else it depends on), with its order (``.lowered``, ``.order()``). Within
    :func:`keep_runtime_schedules` one is kept per :func:`memory_free` plan and ``how``, so
    a plan that differs only in memory figures (a loss-chunk variant's candidate) reuses the
    schedule and order made for another: ``lowering`` must read nothing that
    :func:`memory_free` drops."""
    kept = _KEPT.get()
    if kept is None:
        return _Kept(lowering())
    key = (memory_free(plan), how)
    with kept.lock:
        hit = kept.get(key, "lowering")
    if hit is None:
        hit = _Kept(lowering())
        with kept.lock:
            kept.put(key, hit, "lowering")
    return hit


def runtime_peaks(plan: Plan, options: PlanOptions) -> tuple[WorkerPeak, ...]:
    """The proven peak of every worker over the runtime's schedule,
    ``runtime_schedule(plan, options)``: over the steps a run executes
    (``Schedule.run_steps``), the period lowered after them their context
    (``worker_peaks(steps=)``), so the last repeated steps are proven as a long run, which
    repeats them, runs them: before the steps after them."""
    kept = _KEPT.get()
    if kept is None:
        sched = runtime_schedule(plan, options, validate=False)
        return worker_peaks(sched, plan, steps=sched.run_steps)
    hit = _kept(kept, plan, options)
    figures = tuple(st.peak_bytes for st in plan.stages)
    peaks = hit.peaks.get(figures)
    if peaks is None:
        peaks = hit.peaks[figures] = worker_peaks(hit.lowered, plan,
                                                  steps=hit.lowered.run_steps,
                                                  order=hit.order())
    return peaks

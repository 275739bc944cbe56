"""Waits and proofs: the memory-bounding waits that make a plan's schedule fit, its replay in
the simulator (kept in a cache of replays), and the proven peak of each worker over the steps
the runtime runs."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, Schedule
from rpcompile.passes.lower import BOUNDED_WAITS, TIGHTEST_WAITS
from rpcompile.passes.memory import WorkerPeak, worker_peaks
from rpcompile.passes.schedule import dispatch_period, runtime_cycle
from rpcompile.planner.partition.common import _SEARCH_LOG, _SearchLog

__all__ = [
    "WAIT_SETS",
    "fit_memory_waits",
    "proof_schedule",
    "proof_steps",
    "proven_peaks",
    "retimed",
]


def _tail_at_peak(peaks: Sequence[WorkerPeak], capacity: int) -> bool:
    """Whether a worker over ``capacity`` peaks during a tail compute (the fused tail's
    working set is then part of the peak, and a smaller loss chunk lowers it)."""
    return any(p.peak_bytes > capacity and p.action is not None and p.action.kind == "T"
               for p in peaks)


# The sets of memory-bounding waits fit_memory_waits tries, in order: two gradient slots per
# worker, then one (which can hold a gradient job's first compute behind the previous job's
# whole download: 0.2 to 1.7 % of a paper workload's sync step). Every set bounds every hold,
# so the proven peak is what a run reaches (within 1.3 % per worker on the paper workloads,
# against a third to two thirds of it without the waits), and there the first set costs no
# time: within 0.1 % of a lowering without any wait (benchmarks/memory_waits.py).
WAIT_SETS = (BOUNDED_WAITS, TIGHTEST_WAITS)


def fit_memory_waits(plan: Plan, hardware: Hardware | str, rounds: int = 1,
                     optimizer: str = "async", capacity: int | None = None,
                     steps: int | None = None):
    """``(plan, lowered schedule, proven peaks)``: ``plan`` with the first set of the
    lowering's memory-bounding waits (``Plan.memory_waits``) in :data:`WAIT_SETS` (two
    gradient slots per worker, then one) whose schedule's proven peak fits ``capacity``
    (default: the hardware's usable memory); the last when none fits. The schedule is ``steps`` steps
    (default: sync, the steps the runtime cycles through, :func:`proof_steps`, every
    alignment of jobs to workers; async, the steady-state run of
    :func:`~rpcompile.sim.steady_steps`, which holds whole dispatch periods), dispatched and
    lowered as the simulator runs it. The peaks are of the steps overlapping
    (``worker_peaks``): two steps' jobs on one worker at once, as the runtime runs them
    (``Compiled.memory``)."""
    from rpcompile.sim import steady_steps

    hw = get_hardware(hardware)
    capacity = hw.usable_memory_bytes if capacity is None else capacity
    if steps is None:
        steps = (proof_steps(plan, rounds) if optimizer == "sync"
                 else steady_steps(plan, rounds=rounds))
    period = dispatch_period(len(plan.stages) * rounds, plan.workers)
    log = _SEARCH_LOG.get()
    for waits in WAIT_SETS:
        plan = replace(plan, memory_waits=waits)
        made = _proof_lowering(plan, rounds, optimizer, steps)
        lowered = made.lowered
        if steps == 1:  # a screen: the one step (the search proves a plan it keeps again)
            peaks = worker_peaks(lowered, plan, order=made.order())
        elif steps - period >= proof_steps(plan, rounds):
            # Its first steps hold every alignment after the steps before them, and its
            # last period is their context (worker_peaks(steps=)).
            peaks = worker_peaks(lowered, plan, steps=steps - period, order=made.order())
        else:
            peaks = proven_peaks(plan, rounds, optimizer)
        if max(p.peak_bytes for p in peaks) <= capacity:
            break
        if log is not None and _tail_at_peak(peaks, capacity):
            log.tail_memory = True
    return plan, lowered, peaks


def _simulated_ms(plan: Plan, hw: Hardware, rounds: int, optimizer: str, capacity: int):
    """((step time, bubble, proven peak of each worker), the plan as it runs) in the
    simulator: the steady state of an async run (:func:`~rpcompile.sim.steady_steps`
    overlapping steps), or one isolated sync step, with the memory waits :func:`fit_memory_waits`
    gives (they cost pipeline time). The peaks bound the simulated run's memory
    (rpcompile.passes.memory): async, of every step of the run (every alignment of jobs to
    workers); sync, of the one step replayed, which only screens candidates:
    :func:`_runtime_peaks` proves a plan over the runtime's steps before it is kept. A plan
    replayed before (:data:`_REPLAYS`) is not replayed again."""
    from rpcompile.sim.engine import paused_gc
    from rpcompile.sim.runs import search_figures

    key = (replace(plan, notes=(), memory_waits=()), hw, rounds, optimizer, capacity)
    with _REPLAYS_LOCK:
        hit = _REPLAYS.get(key)
        if hit is not None:
            _REPLAYS.move_to_end(key)
    log = _SEARCH_LOG.get()
    if hit is None:
        token = _SEARCH_LOG.set(_SearchLog())  # this replay's own finding, kept with it
        try:
            with paused_gc():  # the lowering allocates as much as the replay (sim.engine)
                # sync: one step, timed, and its proof (the search's check; _runtime_peaks)
                ran, lowered, peaks = fit_memory_waits(plan, hw, rounds, optimizer, capacity,
                                                       steps=1 if optimizer == "sync" else None)
                # sync: one step's makespan; async: the steady-state step (and their
                # bubbles). A plan that does not fit is ruled out whatever its figure.
                ms, bubble = (search_figures(lowered, ran, hw)
                              if max(p.peak_bytes for p in peaks) <= capacity
                              else (float("inf"), 1.0))
            tail_memory = _SEARCH_LOG.get().tail_memory
        finally:
            _SEARCH_LOG.reset(token)
        hit = ((ms, bubble, peaks), ran.memory_waits, tail_memory)
        with _REPLAYS_LOCK:
            _REPLAYS[key] = hit
            while len(_REPLAYS) > _REPLAYS_KEPT:
                _REPLAYS.popitem(last=False)
    figures, waits, tail_memory = hit
    if log is not None and tail_memory:
        log.tail_memory = True
    return figures, replace(plan, memory_waits=waits)


def _sync_period_proof(ms: float, bubble: float, ran: Plan, hw: Hardware, rounds: int,
                       capacity: int):
    """((step time, bubble, proven peak of each worker over the dispatch period), the plan as
    it runs) of a sync candidate timed and screened on one step (``ms``, ``bubble``, the
    waits ``ran`` carries). When its period does not fit with those waits, the next set of
    :data:`WAIT_SETS` (one gradient slot) is timed on one step and proven over the period in
    turn, so a plan that fits only so is kept at its own, slower, figure, not dropped."""
    peaks = _runtime_peaks(ran, hw, rounds, "sync", capacity)
    later = WAIT_SETS[WAIT_SETS.index(ran.memory_waits) + 1:] \
        if ran.memory_waits in WAIT_SETS else ()
    log = _SEARCH_LOG.get()
    for waits in later:
        if max(p.peak_bytes for p in peaks) <= capacity:
            break
        if log is not None and _tail_at_peak(peaks, capacity):
            log.tail_memory = True
        ran = replace(ran, memory_waits=waits)
        ms, bubble = _replayed(ran, hw, rounds, "sync")
        peaks = _runtime_peaks(ran, hw, rounds, "sync", capacity)
    if log is not None and _tail_at_peak(peaks, capacity):
        log.tail_memory = True
    return (ms, bubble, peaks), ran


def retimed(plan: Plan, hw: Hardware | str, rounds: int = 1, optimizer: str = "async") -> Plan:
    """``plan`` with ``predicted_step_ms`` replayed as it is lowered now (its own memory
    waits): one isolated sync step's makespan, or the async steady-state step, the figures the
    partitioner ranks by (rpcompile.sim.runs.search_figures). For a plan whose waits were
    changed after the search (rpcompile.compile switches to one gradient slot when the
    runtime's schedule needs it), so that its prediction is of the schedule that runs."""
    ms, _bubble = _replayed(plan, get_hardware(hw), rounds, optimizer)
    return replace(plan, predicted_step_ms=ms)


def _replayed(plan: Plan, hw: Hardware, rounds: int, optimizer: str) -> tuple[float, float]:
    """(the figure the search ranks by, its bubble) of ``plan`` lowered with its own memory
    waits: one isolated sync step, or the async steady-state run
    (rpcompile.sim.runs.search_figures)."""
    from rpcompile.sim import steady_steps
    from rpcompile.sim.engine import paused_gc
    from rpcompile.sim.runs import search_figures

    steps = 1 if optimizer == "sync" else steady_steps(plan, rounds=rounds)
    with paused_gc():  # the lowering allocates as much as the replay (rpcompile.sim.engine)
        return search_figures(proof_schedule(plan, rounds, optimizer, steps), plan, hw)


def _runtime_peaks(plan: Plan, hw: Hardware, rounds: int, optimizer: str, capacity: int):
    """The proven peak of each worker of ``plan`` (with the memory waits it was timed with)
    over the steps the runtime runs (:func:`proven_peaks`: the steps it cycles through,
    every alignment of jobs to workers, overlapping). A sync candidate is timed
    and screened on one step, whose jobs sit on other workers than in later steps when the
    job count is not a multiple of the workers; the search keeps a sync plan only once this
    proof fits (and ``Plan.worker_peak_bytes`` is this proof, per worker). Kept in
    :data:`_REPLAYS`."""
    key = ("runtime", replace(plan, notes=()), hw, rounds, optimizer, proof_steps(plan, rounds))
    with _REPLAYS_LOCK:
        hit = _REPLAYS.get(key)
    if hit is None:
        hit = proven_peaks(plan, rounds, optimizer)
        with _REPLAYS_LOCK:
            _REPLAYS[key] = hit
            while len(_REPLAYS) > _REPLAYS_KEPT:
                _REPLAYS.popitem(last=False)
    return hit


def proof_steps(plan: Plan, rounds: int = 1, optimizer: str = "async") -> int:
    """Steps whose points the proof counts, in either mode: the steps the runtime executes
    (``Compiled.schedule.run_steps``, rpcompile.passes.schedule.runtime_cycle): as many as an
    edge reaches back, then one dispatch period (every alignment of jobs to workers), which a
    longer run repeats; each proven after the steps before it and, one period more being
    lowered, before the steps after it (:func:`proven_peaks`)."""
    del optimizer  # both modes: the same dealing, the same cycle
    return runtime_cycle(plan.stages, plan.workers, rounds)[2]


def proof_schedule(plan: Plan, rounds: int = 1, optimizer: str = "async",
                   steps: int | None = None) -> Schedule:
    """``plan``'s lowered schedule of ``steps`` steps (default :func:`proof_steps`),
    dispatched and lowered as the simulator runs it: what the memory proof reads."""
    steps = proof_steps(plan, rounds, optimizer) if steps is None else steps
    return _proof_lowering(plan, rounds, optimizer, steps).lowered


def _proof_lowering(plan: Plan, rounds: int, optimizer: str, steps: int):
    """:func:`proof_schedule` with its order (``.lowered``, ``.order()``), each made once
    per plan but its memory figures within
    :func:`~rpcompile.passes.lower.keep_runtime_schedules`
    (:func:`~rpcompile.passes.lower.kept_lowering`: the dispatch and the lowering read no
    ``peak_bytes`` nor ``working_bytes``), so the loss-chunk variants' searches, whose
    candidates differ only in the tail's working set, lower each candidate once. The passes
    up to the activation transfers read no gradient-slot wait: a candidate screened with
    each set of :data:`WAIT_SETS` is lowered that far once."""
    from rpcompile.passes.lower import LOWERING_PASSES, kept_lowering, lower
    from rpcompile.passes.schedule import build_schedule
    from rpcompile.sim.engine import paused_gc

    shared = LOWERING_PASSES.index("transfers") + 1
    # What those passes read of the waits (add_activation_transfers).
    head_waits = tuple(w for w in plan.memory_waits if w in ("window", "sent"))

    def head() -> Schedule:
        with paused_gc():  # the lowering allocates many small objects (rpcompile.sim.engine)
            compute = build_schedule(plan, plan.workers, plan.microbatches, rounds=rounds,
                                     steps=steps, kind="roundpipe", optimizer=optimizer)
            return lower(compute, plan, passes=LOWERING_PASSES[:shared], validate=False)[0]

    def lowering() -> Schedule:
        start = kept_lowering(replace(plan, memory_waits=head_waits),
                              ("proof head", rounds, optimizer, steps), head).lowered
        with paused_gc():
            return lower(start, plan, passes=LOWERING_PASSES[shared:], validate=False)[0]

    return kept_lowering(plan, ("proof", rounds, optimizer, steps), lowering)


def proven_peaks(plan: Plan, rounds: int = 1, optimizer: str = "async",
                 steps: int | None = None) -> tuple[WorkerPeak, ...]:
    """The proven peak of every worker over the first ``steps`` steps (default
    :func:`proof_steps`, the runtime's) of ``plan``'s :func:`proof_schedule` one dispatch
    period longer, its steps overlapping and its last steps proven before the steps after
    them, as a long run runs them (``worker_peaks(steps=)``, as the partitioner and
    ``compile()`` prove them: rpcompile.passes.lower.runtime_peaks).

    The default is the runtime's own proof: :func:`~rpcompile.passes.lower.runtime_peaks`
    of the schedule the runtime runs for ``plan`` (its workers and microbatches, the update
    order the plan carries, the default transfer pieces), the same steps dispatched and
    lowered as :func:`proof_schedule` lowers them, so that inside
    :func:`~rpcompile.passes.lower.keep_runtime_schedules` the compile keeps the schedule
    and proof of the plan the search chose instead of making them again."""
    from rpcompile.options import PlanOptions
    from rpcompile.passes.lower import runtime_peaks
    from rpcompile.sim.engine import paused_gc

    if steps is None:
        with paused_gc():  # the lowering allocates many small objects (rpcompile.sim.engine)
            return runtime_peaks(plan, PlanOptions(
                gpus=plan.workers, microbatches=plan.microbatches, rounds=rounds,
                mode=optimizer))
    period = dispatch_period(len(plan.stages) * rounds, plan.workers)
    made = _proof_lowering(plan, rounds, optimizer, steps + period)
    return worker_peaks(made.lowered, plan, steps=steps, order=made.order())


# Replays already run, by everything a replay depends on (the plan but its notes and memory
# waits, which fit_memory_waits chooses; the hardware, rounds, mode and capacity): a pure
# function of its key, kept because the planner meets the same candidates again, under
# lower stage limits, for each recompute granularity and loss-chunk variant, and in every
# compile of the same model. The least recently used go first.
_REPLAYS: OrderedDict[tuple, tuple] = OrderedDict()
_REPLAYS_KEPT = 8192
_REPLAYS_LOCK = threading.Lock()

"""Partition pass: cut a model's units into RoundPipe forward stages, a fused tail and
backward stages, minimising the simulated step time.

Sections, in reading order:
  1. partition(): enumerate tail sizes and stage counts, cut each side optimally, and keep the
     simulator's fastest candidate, found best first under a proven lower bound
     (rpcompile.planner.bound)
  2. Cutting: contiguous min-max partition (exact dynamic programme) under a memory limit
  3. Stage figures: compute time, transfer bytes and device memory of a stage

One timing model: a candidate is timed by the simulator's proven lower bound
(rpcompile.planner.bound.simulated_lower_bound, built from the simulator's own costs) until
it is replayed, and by the simulator's replay after; the bound scores the local search and
orders the replays, the replay decides which candidate wins. An async candidate is replayed
in the overlapping steady state the runtime runs (step k+1's jobs start while step k's
drain), so the plan chosen is the fastest there, not the fastest isolated step.

Why not greedy packing: a greedy pack that fills stages up to a budget leaves the last stage
short, and RoundPipe's round-robin dispatch runs at the pace of its longest job. Here each
side is cut by an exact min-max dynamic programme for every stage count.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from functools import cache

from rpcompile.errors import InvalidInput, InvalidType, RPCompileError
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, Schedule, Stage, UnitProfile
from rpcompile.options import PlanOptions, update_order
from rpcompile.passes.cost import recompute_ms, recompute_working_bytes
from rpcompile.passes.lower import BOUNDED_WAITS, TIGHTEST_WAITS
from rpcompile.passes.memory import WorkerPeak, format_bytes, worker_peaks
from rpcompile.passes.schedule import dispatch_period, runtime_cycle
from rpcompile.planner.bound import simulated_lower_bound, steady_estimate
from rpcompile.progress import StatusLine

__all__ = [
    "MEMORY_FIRST_NOTE",
    "SEARCH_BUDGETS",
    "TAIL_MEMORY_NOTE",
    "PartitionError",
    "SearchBudget",
    "StageCosting",
    "build_plan",
    "fit_memory_waits",
    "memory_first_note",
    "memory_first_plan",
    "partition",
    "proof_schedule",
    "proof_steps",
    "proven_peaks",
    "retimed",
    "tail_memory_bound",
]


@dataclass(frozen=True)
class SearchBudget:
    """What one partition search may spend per grid: simulator replays in each mode (None:
    no cap, the search runs until its plan is proven), and beyond them more replays while
    the computes replayed (a candidate's jobs x microbatches x steps replayed) stay under
    ``replay_computes``, so a small model, whose replays are cheap, is searched further; and
    plans the local search scores."""

    replays: dict[str, int | None]
    replay_computes: int
    local_search: int


# What each search effort spends (PlanOptions.search_effort). A sync replay is one step; an
# async replay a dozen overlapping steps, 10-20 times a sync one. The replays go in the order
# of their lower bounds, and on the paper workloads the bound sits a near-constant 1-5 %
# below the replay, so the fastest candidate comes among the first few: "normal" stops there
# (within 1 % of an exhaustive search's plan on them, benchmarks/compile_time.py),
# and the plan's notes give the proven gap to any candidate left. A tiny model's bound is
# looser, but its replays cost next to nothing: the compute budget lets its search go on,
# usually to its proof. "exhaustive" runs until every candidate left is proven no faster.
SEARCH_BUDGETS: dict[str, SearchBudget] = {
    "normal": SearchBudget({"sync": 8, "async": 8}, 12_000, 400),
    "high": SearchBudget({"sync": 1024, "async": 32}, 0, 2000),
    "exhaustive": SearchBudget({"sync": None, "async": None}, 0, 2000),
}


@dataclass(frozen=True)
class _ReplayCap:
    """A search's replays per grid: at least ``replays``, then more while fewer than
    ``computes`` computes were replayed; ``said``: how the plan's notes name the cap."""

    replays: int
    computes: int = 0
    said: str = ""

    def reached(self, replays: int, computes: int) -> bool:
        return replays >= self.replays and computes >= self.computes

    def __str__(self) -> str:
        return self.said or f"max_simulations={self.replays}"


class PartitionError(RPCompileError, ValueError):
    """No plan fits the hardware; the message names the unit and the memory it needs."""


@dataclass(frozen=True)
class StageCosting:
    """How stage figures are derived from unit profiles."""

    weight_dtype_bytes: int = 2  # the low-precision shadow that gets uploaded
    grad_dtype_bytes: int = 4  # fp32 gradient accumulator and download
    act_dtype_bytes: int = 2  # activations cross boundaries in the compute dtype
    activation_scale: float = 1.0  # rescales UnitProfile byte figures (already in act dtype)
    # How backward stages of more than one unit recompute (rpcompile.passes.cost.RECOMPUTE).
    recompute: str = "stage"


# ---------------------------------------------------------------------------------------------
# 1. partition()
# ---------------------------------------------------------------------------------------------


def partition(
    units: Sequence[UnitProfile],
    hardware: Hardware | str,
    options: PlanOptions,
    *,
    microbatch_size: int = 1,
    seq_len: int = 1,
    costing: StageCosting | None = None,
    grad_check_passes: int = 0,
    max_tail_layers: int = 3,
    shortlist: int | None = None,
    refine: int = 16,
    target_bubble: float = 0.01,
    search: int | None = None,
) -> Plan:
    """The plan with the shortest predicted step for ``workers`` GPUs and ``microbatches``.

    **Options.** ``options``: the :class:`~rpcompile.options.PlanOptions` the plan is made
    for (what :func:`rpcompile.compile` passes): ``gpus`` are the workers,
    ``microbatches_per_round``, ``rounds``, ``mode`` the optimizer, ``recompute``,
    ``updates``, ``ranks``, ``capacity_bytes``, ``max_simulations``, ``search_effort``,
    ``progress``; ``hardware`` is not read from it: the ``hardware`` argument is the profile
    the plan is timed on, for ``compile`` its planning hardware. ``grad_check_passes`` (from
    the training options), ``costing``, ``microbatch_size``, ``seq_len`` and the search's
    tuning (``max_tail_layers``, ``shortlist``, ``refine``, ``target_bubble``, ``search``)
    are keywords.

    The last unit is the tail (final norm, LM head, loss); the fused tail stage may also take
    up to ``max_tail_layers`` layers (units, or blocks of one layer) before it. Candidates are
    cut exactly (min-max per stage count; all of them, or per grid the ``shortlist`` first by a
    cheap pre-order), joined by a local search scored by the simulator's lower bound
    (:func:`~rpcompile.planner.bound.simulated_lower_bound`, ``search`` plans per grid,
    default the effort's :data:`SEARCH_BUDGETS`), and
    replayed in the simulator best first: each candidate has a
    proven lower bound on its simulated figure (rpcompile.planner.bound), and the search stops
    once every candidate not replayed has a bound at least the best simulated figure, so the
    plan is the simulator's fastest of all candidates. At most ``max_simulations`` replays
    per grid (default: the ``search_effort``'s, :data:`SEARCH_BUDGETS`); a search stopped
    there says so in the plan's notes, with the proven gap. While it runs, a status line
    (rpcompile.progress, on a terminal unless ``progress=False``) counts the replays and shows
    the best figure and the next bound. With ``optimizer="async"`` the plan
    minimises the steady-state time per step; with ``"sync"`` it minimises one step's
    makespan (fill and drain included). When units are blocks of layers (``UnitProfile.group``)
    candidates are cut both between any units and between whole layers only. In async mode
    the winner's boundaries are then refined in the simulator (at most ``refine`` runs, until
    the steady-state bubble is below ``target_bubble``; ``refine=0`` turns it off). Raises
    :class:`PartitionError` when some unit cannot fit the GPU even alone.

    ``recompute``: how backward stages recompute their forward (rpcompile.passes.cost):
    ``"stage"`` or ``"layer"`` for every backward stage of more than one unit, or ``"auto"``:
    the stage-recompute plan when its schedule fits ``capacity_bytes`` (default, and at most:
    the hardware's usable memory), else the plan cut for layer-by-layer recompute under that
    capacity (the plan's notes say which, and why). ``capacity_bytes`` is only the target of
    that choice; a forced granularity, and the stage-recompute plan, are cut for the hardware.

    ``updates`` (the sync update order, rpcompile.passes.lower.add_optimizer) and
    ``grad_check_passes`` (the passes over the fp32 gradients of each step's CHECK:
    :func:`rpcompile.options.grad_check_passes` of the run's clipping and loss scaling) say how
    the run applies and checks each step; every candidate is lowered and replayed that way,
    and the plan carries both (``Plan.updates``, ``Plan.grad_check_passes``), so its predicted
    step is of the schedule that runs. :func:`rpcompile.compile` passes the order and the
    passes its training options need; ``updates=None`` is decided by the options' one rule
    (:func:`~rpcompile.options.update_order`) from what this function can tell: several
    ranks or a step check with passes (clipping, loss scaling) need ``"deferred"`` in sync
    mode.
    """
    if not isinstance(options, PlanOptions):
        raise InvalidType(f"partition()'s options must be an rpcompile.PlanOptions, got "
                          f"{type(options).__name__}")
    po = options
    if isinstance(grad_check_passes, bool) or not isinstance(grad_check_passes, int) \
            or grad_check_passes < 0:
        raise InvalidInput(f"grad_check_passes must be a whole number >= 0, got "
                         f"{grad_check_passes!r}")
    # The search below reads the group's values, checked when the group was built.
    workers, microbatches, rounds = po.gpus, po.microbatches_per_round, po.rounds
    optimizer, recompute, capacity_bytes = po.mode, po.recompute, po.capacity_bytes
    updates = update_order(optimizer, po.updates, [why for why, on in (
        ("the step's gradient check (clipping, loss scaling)", grad_check_passes > 0),
        ("data parallel (ranks > 1)", (po.ranks or 1) > 1)) if on])
    budget = SEARCH_BUDGETS[po.search_effort]
    if po.max_simulations is not None:
        max_simulations = _ReplayCap(po.max_simulations)
    else:
        max_simulations = _ReplayCap(
            budget.replays[optimizer] or _NO_CAP, budget.replay_computes,
            f"search_effort={po.search_effort!r}: {budget.replays[optimizer]} replays"
            + (f", then more up to {budget.replay_computes:,} computes replayed"
               if budget.replay_computes else ""))
    search = budget.local_search if search is None else search
    # Every candidate is lowered, replayed and proven as the run will be.
    lowering = {"updates": updates, "grad_check_passes": grad_check_passes}
    hw = get_hardware(hardware)
    costing = costing or StageCosting()
    units = tuple(units)
    n = len(units)
    if n < 2:
        raise InvalidInput("a plan needs at least two units (something before the tail, and the tail)")
    capacity = hw.usable_memory_bytes
    fit = capacity if capacity_bytes is None else min(capacity, int(capacity_bytes))
    args = (units, hw, workers, microbatches, microbatch_size, seq_len, rounds, max_tail_layers,
            shortlist, max_simulations, optimizer, refine, target_bubble, search, lowering)
    log = _SearchLog(StatusLine("rpcompile: search", po.progress, unit=" replays"))
    token = _SEARCH_LOG.set(log)
    try:
        plan = _recompute_choice(args, costing, recompute, capacity, fit)
    finally:
        _SEARCH_LOG.reset(token)
        log.status.close()
    if log.tail_memory:
        plan = replace(plan, notes=(*plan.notes, TAIL_MEMORY_NOTE))
    return plan


# The note of a plan whose search had a candidate ruled out or slowed by the fused tail's
# working set (the LM head and loss, what a smaller loss chunk shrinks); without it, a
# variant of the units that differs only by a smaller tail working set has the same plan.
TAIL_MEMORY_NOTE = ("memory: the tail's working set ruled out or slowed candidates (a "
                    "smaller loss chunk may give a faster plan)")


def tail_memory_bound(plan: Plan) -> bool:
    """Whether ``plan``'s search was limited by the fused tail's working set anywhere
    (:data:`TAIL_MEMORY_NOTE`), or by memory in a way it does not track per unit (a
    memory-first fallback, a recompute granularity chosen for memory): then a smaller tail
    working set may give a faster plan."""
    return any(n == TAIL_MEMORY_NOTE or n.startswith((MEMORY_FIRST_NOTE, "recompute:"))
               for n in plan.notes)


def _recompute_choice(args, costing: StageCosting, recompute: str, capacity: int,
                      fit: int) -> Plan:
    """The plan of the recompute granularity asked for, or (``"auto"``) the stage-recompute
    plan when it fits ``fit``, else the faster of the plans cut again by stage and by layer
    under ``fit``."""
    hw, rounds, optimizer = args[1], args[6], args[10]
    if recompute != "auto":
        return _fitting_plan(*args, replace(costing, recompute=recompute), capacity)
    try:
        plan, refused = _fitting_plan(*args, replace(costing, recompute="stage"), capacity), None
    except PartitionError as exc:
        plan, refused = None, exc
    # A memory-first fallback (no searched stage-recompute candidate fits) is compared with
    # the layer-recompute search below, not returned before it.
    fallback = plan is not None and memory_first_note(plan) is not None
    if plan is not None and not fallback:
        if fit >= capacity:
            return plan
        if at_fit := _proven_at(plan, hw, rounds, optimizer, fit):
            return at_fit
    # The stage-recompute plan does not fit: each granularity is cut again under ``fit`` (by
    # stage only when a plan was cut for the larger hardware figure; none fits less) and the
    # faster that fits wins.
    tried: dict[str, Plan | PartitionError] = {"stage": refused}
    modes: tuple[str, ...] = ("stage", "layer") if plan is not None else ("layer",)
    if fallback and fit >= capacity:  # the fallback was already cut for ``fit``
        tried["stage"], modes = plan, ("layer",)
    for mode in modes:
        try:  # a plan the partitioner returns fits ``fit`` over its whole schedule
            tried[mode] = _fitting_plan(*args, replace(costing, recompute=mode), fit)
        except PartitionError as exc:
            tried[mode] = exc
    fitting = {m: p for m, p in tried.items() if isinstance(p, Plan)}
    if not fitting:
        if plan is not None:
            return plan  # the compiler refuses it against capacity_bytes, naming the worker
        raise PartitionError(f"{refused} (layer-by-layer recompute: {tried['layer']})")
    mode = min(fitting, key=lambda m: (round(fitting[m].predicted_step_ms, 6), m != "stage"))
    best = fitting[mode]

    def said(m: str) -> str:
        p = tried[m]
        return f"{m} {p.predicted_step_ms:.1f} ms" if isinstance(p, Plan) else f"{m}: no plan fits"
    layered = ", ".join(best.stage_name(s.index) for s in best.stages if s.recompute == "layer")
    how = f"layer by layer in {layered}" if layered else "by stage"
    return replace(best, notes=(*best.notes, (
        f"recompute: {how}, the fastest plan that fits {format_bytes(fit)} "
        f"({', '.join(said(m) for m in ('stage', 'layer'))})")))


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


def _fitting_plan(units, hw, workers, microbatches, microbatch_size, seq_len, rounds,
                  max_tail_layers, shortlist, max_simulations, optimizer, refine, target_bubble,
                  search, lowering, costing, capacity) -> Plan:
    """The fastest plan under ``costing`` whose whole schedule fits ``capacity``."""
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
            return _partition(units, hw, workers, microbatches, microbatch_size, seq_len, rounds,
                              costing, max_tail_layers, shortlist, max_simulations, optimizer,
                              refine, target_bubble, search, limit, capacity, lowering)
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


_NO_CAP = 1 << 62  # replays per grid of an uncapped search


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


def _tail_at_peak(peaks: Sequence[WorkerPeak], capacity: int) -> bool:
    """Whether a worker over ``capacity`` peaks during a tail compute (the fused tail's
    working set is then part of the peak, and a smaller loss chunk lowers it)."""
    return any(p.peak_bytes > capacity and p.action is not None and p.action.kind == "T"
               for p in peaks)


class _NoPlanFits(Exception):
    def __init__(self, overshoot: int, peak) -> None:
        super().__init__(overshoot)
        self.overshoot, self.peak = overshoot, peak


def _partition(units, hw, workers, microbatches, microbatch_size, seq_len, rounds, costing,
               max_tail_layers, shortlist, max_simulations, optimizer, refine, target_bubble,
               search, limit, capacity, lowering) -> Plan:
    n = len(units)

    # Cut anywhere between units; and, when units are blocks of layers, also only between
    # whole layers (a finer grid is not always searched as well by the min-max cuts).
    grids = [None] if all(not u.group for u in units) else [None, _layer_starts(units)]
    # Per grid: (pre-order key, forward starts, backward starts, tail start).
    candidates: list[list[tuple[float, tuple[int, ...], tuple[int, ...], int]]] = [
        [] for _ in grids
    ]
    # Per grid: (forward starts, backward starts, tail start) of every grid piece its own
    # stage on both sides, one per tail start (replayed whatever the cap, _best_simulated).
    finest: list[list[tuple[tuple[int, ...], tuple[int, ...], int]]] = [[] for _ in grids]
    for (g, grid), t in itertools.product(enumerate(grids), _tail_starts(units, max_tail_layers)):
        # units 0..t-1 are cut into forward and backward stages, t..n-1 are the tail
        if grid is not None and t not in grid:
            continue
        starts = None if grid is None else [i for i in grid if i < t]
        tail_mem = _stage_memory(units, tuple(range(t, n)), "tail", costing)
        if tail_mem > limit:
            if (log := _SEARCH_LOG.get()) is not None:
                log.tail_memory = True
            continue
        fwd_cost = [u.forward_ms for u in units[:t]]
        # By layer, every unit but a stage's last runs forward once more (the cut's cost here
        # charges all of them; Stage.compute_ms is exact).
        again = 2 if costing.recompute == "layer" else 1
        bwd_cost = [again * u.forward_ms + u.backward_ms for u in units[:t]]
        tail_ms = sum(u.forward_ms + u.backward_ms for u in units[t:])
        fwd_cuts = _all_cuts(units, fwd_cost, "forward", costing, limit, 4 * workers, starts)
        bwd_cuts = _all_cuts(units, bwd_cost, "backward", costing, limit, 4 * workers, starts)
        if not fwd_cuts or not bwd_cuts:
            continue
        finest[g].append((fwd_cuts[max(fwd_cuts)][1], bwd_cuts[max(bwd_cuts)][1], t))
        for p, (f_max, f_bounds) in fwd_cuts.items():
            for q, (b_max, b_bounds) in bwd_cuts.items():
                jobs = p + q + 1
                work = microbatches * (sum(fwd_cost) + sum(bwd_cost) + tail_ms)
                longest = max(f_max, b_max, tail_ms)
                # A cheap pre-order, used only when a ``shortlist`` is asked for (it is not a
                # bound on the simulator's figure): work spread over the workers, the longest
                # job times the round-robin share of one worker, the one-microbatch chain.
                share = -(-jobs * rounds // workers)
                presort = max(
                    work * rounds / workers,
                    microbatches * longest * share,
                    sum(fwd_cost) + sum(bwd_cost) + tail_ms + (microbatches - 1) * longest,
                )
                # Rounded so that sums of block costs rank exactly like their layer's cost.
                candidates[g].append((round(presort, 6), f_bounds, b_bounds, t))
    if not any(candidates):
        raise PartitionError(
            "no partition fits: the tail (final norm, LM head, loss) needs "
            f"{format_bytes(_stage_memory(units, (n - 1,), 'tail', costing))} and every stage "
            f"must fit in {format_bytes(limit)}; lower the microbatch size or sequence length"
        )

    figures = _StageFigures(units, costing)

    def make(f_bounds, b_bounds, t, notes=()) -> Plan:  # timed by the bound of ``optimizer``
        return replace(figures.plan(f_bounds, b_bounds, t, hw, workers, microbatches,
                                    microbatch_size, seq_len, rounds, notes, optimizer),
                       **lowering)

    def predicted(plan: Plan) -> float:
        return round(plan.predicted_step_ms, 6)

    # Every candidate (per grid: all of them, or the ``shortlist`` first by the pre-order);
    # the lowest bounds seed the local search.
    pools: list[list[Plan]] = []
    seeds: list[list[Plan]] = []
    for grid_candidates in candidates:
        chosen = sorted(grid_candidates)[:shortlist] if shortlist is not None else grid_candidates
        built = [make(f_bounds, b_bounds, t) for _key, f_bounds, b_bounds, t in chosen]
        pools.append(built)
        seeds.append(sorted(built, key=predicted)[:4])
    if search > 0:
        # Min-max cuts balance stage times; round-robin dispatch also cares how consecutive
        # jobs compare. A local search on the bound starts from the best plans: on
        # the finest grid from the best of every grid, on a coarser grid from its own (so
        # this also finds what a partition of whole layers alone would). It only proposes
        # candidates: the simulator ranks them with the rest.
        for g, grid in enumerate(grids):
            start = sorted(itertools.chain(*seeds), key=predicted)[:4] if grid is None else seeds[g]
            if start:
                pools[g] += _search(start, make, limit, search, random.Random(0),
                                    grid=grid or range(n))
    # Each grid's finest plan of lowest bound is replayed whatever the cap: it is where a
    # search on that grid alone ends when its coarser cuts do not fit, so a capped search on
    # a finer grid must not miss it.
    firsts = []
    for g, pool in enumerate(pools):
        keys = {(tuple(f), tuple(b), t) for f, b, t in finest[g]}
        mine = [p for p in pool if _bounds(p) in keys]
        firsts.append(sorted(mine, key=predicted)[:1])
    best, search_note, bubble = _best_simulated(pools, hw, rounds, optimizer, capacity,
                                                max_simulations, firsts)
    best = replace(best, notes=(*best.notes, search_note))
    if optimizer == "async" and refine > 0:
        best = _refine(best, bubble, make, hw, rounds, limit, capacity, refine, target_bubble)
    return best


def _best_simulated(pools: Sequence[Sequence[Plan]], hw: Hardware, rounds: int,
                    optimizer: str, capacity: int, max_simulations: int | _ReplayCap,
                    firsts: Sequence[Sequence[Plan]] = (),
                    ) -> tuple[Plan, str, float]:
    """(the plan with the shortest simulated figure among the candidates of ``pools`` whose
    whole schedule fits ``capacity``, a note saying how it was found, its simulated bubble).

    Best-first with a proven bound: each candidate has a lower bound on its simulated figure,
    :func:`~rpcompile.planner.bound.simulated_lower_bound` (asked for here, a lookup in the
    bound's cache, so a plan built for another mode or rounds is not pruned by a figure that
    bounds another run). Each pool (a grid's candidates) is walked in increasing order of that
    bound (async: of :func:`~rpcompile.planner.bound.steady_estimate`, which ranks
    overlapping steady states far better than their bound does); a candidate already
    simulated, or whose bound is at least the best figure so far (of any pool), is skipped.
    When every candidate left has such a bound, the plan is the simulator's argmin over all
    candidates. A pool stops after ``max_simulations`` replays of its own (or once a
    :class:`_ReplayCap` is reached) (so a coarser
    grid's candidates are replayed as far as they would be alone), and the note then gives
    the proven gap: no candidate left can be faster than the smallest bound among them.
    ``predicted_step_ms`` of the plan returned is its simulated figure. Raises
    :class:`_NoPlanFits` when no simulated candidate fits.

    A sync candidate is timed and screened on one step; its proof over the runtime's steps
    (:func:`_sync_period_proof`), which may only slow it (one gradient slot) or rule it out,
    is the costly part, so it waits until the candidate is the best of all screened ones.
    The walk meanwhile prunes by the best screened figure; when a proof slows or rules out
    that candidate, the walk goes again from the next best, so no candidate is lost.

    ``firsts`` (per pool, candidates of that pool) are replayed before the pool's walk and
    outside its cap, unless a bound already rules them out: the partitioner gives each
    grid's finest plan (every grid piece its own stage), which a capped walk in bound order
    may not reach although a search on that grid alone would end at it.
    """
    plans: list[Plan] = []
    index: dict[tuple, int] = {}
    members: list[list[int]] = []  # per pool, its candidates' indices into plans
    for pool in pools:
        mine: dict[int, None] = {}
        for plan in pool:
            i = index.setdefault(_bounds(plan), len(plans))
            if i == len(plans):
                plans.append(plan)
            mine[i] = None
        members.append(list(mine))
    bounds = [simulated_lower_bound(p, hw, rounds, optimizer) for p in plans]
    # The order of the replays: the bound (sync), or the relaxed replay's estimate of the
    # overlapping steady state (async), whose bound (one step's compute over the workers)
    # does not see how stages pace each other.
    keys = bounds if optimizer == "sync" else [steady_estimate(p, hw, rounds) for p in plans]

    def first(i: int) -> tuple:
        return round(keys[i], 6), i

    log = _SEARCH_LOG.get()
    best: tuple[float, float, tuple, Plan] | None = None  # proven: (ms, bubble, peaks, plan)
    screened: list[tuple[float, int, tuple]] = []  # sync, not yet proven: a heap by figure
    misfit: tuple[int, object] | None = None  # (overshoot, worst peak) of the closest misfit
    simulated: set[int] = set()
    stopped: set[int] = set()  # candidates a pool's cap stopped before
    orders, forced, spent, work = [], [], [0] * len(members), [0] * len(members)
    cap = max_simulations if isinstance(max_simulations, _ReplayCap) else \
        _ReplayCap(max_simulations)

    def computes(plan: Plan) -> int:  # what a replay of ``plan`` runs
        from rpcompile.sim import steady_steps

        steps = 1 if optimizer == "sync" else steady_steps(plan, rounds=rounds)
        return len(plan.stages) * rounds * plan.microbatches * steps
    for g, mine in enumerate(members):
        forced.append([index[_bounds(p)] for p in (firsts[g] if g < len(firsts) else ())])
        orders.append(forced[g] + sorted(mine, key=first))

    def floor() -> float:  # the figure a candidate must beat to be worth a replay
        ms = best[0] if best is not None else float("inf")
        return min(ms, screened[0][0]) if screened else ms

    def closest(top) -> None:
        nonlocal misfit
        if misfit is None or top.peak_bytes - capacity < misfit[0]:
            misfit = (top.peak_bytes - capacity, top)

    while True:
        for g, order in enumerate(orders):
            for n, i in enumerate(order):
                if i in simulated or bounds[i] >= floor():
                    continue  # replayed already, or proven no faster than the best so far
                if n >= len(forced[g]) and cap.reached(spent[g], work[g]):
                    stopped.add(i)
                    continue
                (ms, bubble, peaks), ran = _simulated_ms(plans[i], hw, rounds, optimizer,
                                                         capacity)
                simulated.add(i)
                if n >= len(forced[g]):
                    spent[g] += 1
                    work[g] += computes(plans[i])
                top = max(peaks, key=lambda p: p.peak_bytes)
                if top.peak_bytes > capacity:
                    closest(top)
                elif optimizer == "sync":
                    heapq.heappush(screened, (round(ms, 6), len(simulated),
                                              ((ms, bubble, peaks), ran)))
                elif best is None or round(ms, 6) < round(best[0], 6):
                    best = (ms, bubble, peaks, ran)
                if log is not None:
                    log.replayed(floor(), min(bounds[j] for j in order[n:]))
        if not screened or (best is not None and screened[0][0] >= round(best[0], 6)):
            break
        # The best screened sync candidate: prove it over the runtime's steps (one step was
        # screened), then walk again, in case the proof slowed it or ruled it out.
        _key, i, ((ms, bubble, _peaks), ran) = heapq.heappop(screened)
        (ms, bubble, peaks), ran = _sync_period_proof(ms, bubble, ran, hw, rounds, capacity)
        top = max(peaks, key=lambda p: p.peak_bytes)
        if top.peak_bytes > capacity:
            closest(top)
        elif best is None or round(ms, 6) < round(best[0], 6):
            best = (ms, bubble, peaks, ran)
    if best is None:
        if misfit is None:  # cannot happen: at least one candidate is simulated
            raise PartitionError("no candidate plan to simulate")
        raise _NoPlanFits(*misfit)
    ms, bubble, peaks, plan = best
    left = [bounds[i] for i in stopped if i not in simulated and bounds[i] < ms]
    figure = "steady-state step" if optimizer == "async" else "step"
    if not left:
        note = (f"search: the simulator's fastest {figure} of all {len(plans)} candidates: "
                f"{len(simulated)} simulated, the other {len(plans) - len(simulated)} proven no "
                "faster by their lower bounds")
    else:
        floor_ms = min(left)
        note = (f"search: NOT proven the fastest of {len(plans)} candidates: it stopped at "
                f"{cap} (per grid) after {len(simulated)} "
                f"simulations, with {len(left)} candidates left whose lower bounds are below "
                f"this plan's {ms:.1f} ms; none of them can be faster than {floor_ms:.1f} ms (a "
                f"gap of at most {(ms - floor_ms) / ms:.2%})")
    plan = replace(plan, predicted_step_ms=ms, worker_peak_bytes=tuple(p.peak_bytes for p in peaks))
    return plan, note, bubble


def _bounds(plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(forward starts, backward starts in model order, tail start) of a plan."""
    fwd = tuple(s.units[0] for s in plan.stages if s.kind == "forward")
    bwd = tuple(sorted(s.units[0] for s in plan.stages if s.kind == "backward"))
    tail = next(s.units[0] for s in plan.stages if s.kind == "tail")
    return fwd, bwd, tail


def _distinct(plans: Sequence[Plan]) -> list[Plan]:
    seen, out = set(), []
    for plan in plans:
        if (key := _bounds(plan)) not in seen:
            seen.add(key)
            out.append(plan)
    return out


def _search(seeds: Sequence[Plan], make, limit: int, budget: int, rng: random.Random,
            grid: Sequence[int], keep: int = 4) -> list[Plan]:
    """Iterated local search over stage boundaries, scored by ``Plan.predicted_step_ms`` of
    the plans ``make`` builds (in the partitioner: what :func:`build_plan` writes, the figure
    the replays are ordered by).

    Boundaries stay on ``grid`` (the unit indices a stage may start at). A move puts one
    boundary at any grid position between its neighbours, or shifts a whole stage by one
    grid position; a climb takes the first move (in shuffled order) that shortens the
    predicted step, until none does. After climbing each seed, the search repeatedly kicks
    one of the best plans found (two to four boundaries moved by up to three grid positions)
    and climbs again. Tail start and stage counts stay as in the seeds. At most ``budget``
    plans are built and scored (each once; plans over ``limit`` bytes are skipped); ``rng``
    makes the search repeatable. Returns the ``keep`` best plans found.
    """
    scored: dict[tuple, float] = {}
    built: dict[tuple, Plan] = {}
    pos = sorted(grid)
    rank = {u: k for k, u in enumerate(pos)}

    def score(fwd, bwd, tail) -> float:  # bounds as grid positions
        key = (fwd, bwd, tail)
        if key not in scored:
            if len(scored) >= budget:
                return float("inf")
            notes = () if key in seed_keys else ("found by the local search",)
            plan = make([pos[k] for k in fwd], [pos[k] for k in bwd], pos[tail], notes)
            fits = all(st.peak_bytes <= limit for st in plan.stages)
            scored[key] = round(plan.predicted_step_ms, 6) if fits else float("inf")
            built[key] = plan
        return scored[key]

    def valid(bounds, tail) -> bool:
        return bounds[0] == 0 and all(a < b for a, b in itertools.pairwise((*bounds, tail)))

    def neighbours(fwd, bwd, tail):
        out = []
        for side, bounds in ((0, fwd), (1, bwd)):
            for i in range(1, len(bounds)):
                hi = bounds[i + 1] if i + 1 < len(bounds) else tail
                out += [(side, (*bounds[:i], x, *bounds[i + 1:]))
                        for x in range(bounds[i - 1] + 1, hi) if x != bounds[i]]
                for d in (-1, 1):  # the stage starting at bounds[i], both ends moved
                    moved = (*bounds[:i], *(b + d for b in bounds[i:i + 2]), *bounds[i + 2:])
                    if i + 1 < len(bounds) and valid(moved, tail):
                        out.append((side, moved))
        rng.shuffle(out)
        return [((b, bwd) if side == 0 else (fwd, b)) for side, b in out]

    def climb(fwd, bwd, tail):
        best = score(fwd, bwd, tail)
        improved = True
        while improved and len(scored) < budget:
            improved = False
            for f2, b2 in neighbours(fwd, bwd, tail):
                if (v := score(f2, b2, tail)) < best:
                    fwd, bwd, best, improved = f2, b2, v, True
                    break
        return best, fwd, bwd, tail

    def on_grid(plan):
        fwd, bwd, tail = _bounds(plan)
        return tuple(rank[u] for u in fwd), tuple(rank[u] for u in bwd), rank[tail]

    seed_keys = list(dict.fromkeys(on_grid(plan) for plan in seeds))  # in order, once each
    pool = sorted([climb(*key) for key in seed_keys])
    kicks = 0
    while len(scored) < budget and kicks < 4 * budget:  # kicks may all be repeats
        kicks += 1
        if all(len(f) < 2 and len(b) < 2 for _v, f, b, _t in pool):
            break  # one stage a side: no boundary to move
        _v, fwd, bwd, tail = pool[rng.randrange(min(3, len(pool)))]
        sides = [list(fwd), list(bwd)]
        for _ in range(rng.choice((2, 3, 4))):
            bounds = sides[rng.randrange(2)]
            if len(bounds) > 1:
                bounds[rng.randrange(1, len(bounds))] += rng.choice((-3, -2, -1, 1, 2, 3))
        if not all(valid(b, tail) for b in sides):
            continue
        result = climb(tuple(sides[0]), tuple(sides[1]), tail)
        if result not in pool:
            pool = sorted([*pool, result])[:2 * keep]
    found = [built[(f, b, t)] for v, f, b, t in pool if v < float("inf")]
    return _distinct(found)[:keep]


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
        lowered = proof_schedule(plan, rounds, optimizer, steps)
        if steps == 1:  # a screen: the one step (the search proves a plan it keeps again)
            peaks = worker_peaks(lowered, plan)
        elif steps - period >= proof_steps(plan, rounds):
            # Its first steps hold every alignment after the steps before them, and its
            # last period is their context (worker_peaks(steps=)).
            peaks = worker_peaks(lowered, plan, steps=steps - period)
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
    from rpcompile.passes.lower import lower
    from rpcompile.passes.schedule import build_schedule
    from rpcompile.sim.engine import paused_gc

    steps = proof_steps(plan, rounds, optimizer) if steps is None else steps
    with paused_gc():  # the lowering allocates many small objects (rpcompile.sim.engine)
        compute = build_schedule(plan, plan.workers, plan.microbatches, rounds=rounds,
                                 steps=steps, kind="roundpipe", optimizer=optimizer)
        return lower(compute, plan, validate=False)[0]


def proven_peaks(plan: Plan, rounds: int = 1, optimizer: str = "async",
                 steps: int | None = None) -> tuple[WorkerPeak, ...]:
    """The proven peak of every worker over the first ``steps`` steps (default
    :func:`proof_steps`, the runtime's) of ``plan``'s :func:`proof_schedule` one dispatch
    period longer, its steps overlapping and its last steps proven before the steps after
    them, as a long run runs them (``worker_peaks(steps=)``, as the partitioner and
    ``compile()`` prove them: rpcompile.passes.lower.runtime_peaks)."""
    steps = proof_steps(plan, rounds, optimizer) if steps is None else steps
    period = dispatch_period(len(plan.stages) * rounds, plan.workers)
    return worker_peaks(proof_schedule(plan, rounds, optimizer, steps + period), plan,
                        steps=steps)


# Replays already run, by everything a replay depends on (the plan but its notes and memory
# waits, which fit_memory_waits chooses; the hardware, rounds, mode and capacity): a pure
# function of its key, kept because the planner meets the same candidates again, under
# lower stage limits, for each recompute granularity and loss-chunk variant, and in every
# compile of the same model. The least recently used go first.
_REPLAYS: OrderedDict[tuple, tuple] = OrderedDict()
_REPLAYS_KEPT = 8192
_REPLAYS_LOCK = threading.Lock()


def _refine(plan: Plan, bubble: float, make, hw, rounds, limit, capacity, budget,
            target_bubble) -> Plan:
    """Move single stage boundaries by 1 or 2 units while the simulated steady state improves.

    Round-robin dispatch is sensitive to small differences between consecutive jobs (a job
    faster than its predecessor waits for each of its microbatches), which min-max cuts do
    not see. ``plan.predicted_step_ms`` and ``bubble`` are its simulated figures. First
    improvement, forward boundaries then backward ones, at most ``budget`` simulations in
    all (the one that scored ``plan`` included); stops early once the steady-state bubble is
    below ``target_bubble``. ``make(forward, backward, tail, notes)`` builds a plan.
    """
    fwd, bwd, tail = _bounds(plan)
    sides = [fwd, bwd]
    best, best_ms, spent, tried = plan, plan.predicted_step_ms, 1, set()

    def moves():  # (side, its bounds with one moved) that keep the stages non-empty
        for side, bounds in enumerate(sides):
            ends = [*bounds[1:], tail]
            for i, d in itertools.product(range(1, len(bounds)), (-1, 1, -2, 2)):
                if bounds[i - 1] < bounds[i] + d < ends[i]:
                    yield side, [*bounds[:i], bounds[i] + d, *bounds[i + 1:]]

    improved = True
    while improved and bubble > target_bubble and spent < budget:
        improved = False
        for side, moved in moves():
            trial = list(sides)
            trial[side] = moved
            if (key := tuple(map(tuple, trial))) in tried:
                continue
            tried.add(key)
            candidate = make(trial[0], trial[1], tail, plan.notes)
            if any(st.peak_bytes > limit for st in candidate.stages):
                continue
            (ms, trial_bubble, peaks), candidate = _simulated_ms(candidate, hw, rounds,
                                                                 "async", capacity)
            spent += 1
            if ms < best_ms - 1e-6 and max(p.peak_bytes for p in peaks) <= capacity:
                best, best_ms, bubble, sides, improved = candidate, ms, trial_bubble, trial, True
                best = replace(best, worker_peak_bytes=tuple(p.peak_bytes for p in peaks))
                break
            if spent >= budget:
                break
    if best is plan:
        return plan
    return replace(best, predicted_step_ms=best_ms,
                   notes=(*plan.notes, f"boundaries refined in the simulator ({spent} runs)"))


def _tail_starts(units, max_layers: int) -> list[int]:
    """Where the fused tail may begin: the last unit alone, or with up to ``max_layers`` layers
    (whole layers or blocks of them) before it; unit 0 always stays out."""
    n = len(units)
    out, layers = [n - 1], set()
    for t in range(n - 2, 0, -1):
        layers.add(units[t].group or t)
        if len(layers) > max_layers:
            break
        out.append(t)
    return out


def _layer_starts(units) -> list[int]:
    """Unit indices that begin a layer (a unit with no group begins its own)."""
    return [i for i, u in enumerate(units)
            if i == 0 or not u.group or u.group != units[i - 1].group]


def memory_first_plan(units: Sequence[UnitProfile], hardware: Hardware | str, workers: int,
                      microbatches: int, microbatch_size: int = 1, seq_len: int = 1,
                      rounds: int = 1, costing: StageCosting | None = None) -> Plan:
    """The plan that holds least device memory per worker: every unit before the tail its
    own forward stage and its own backward stage, the tail (the last unit) alone, the
    lowering's tightest memory-bounding waits (:data:`~rpcompile.passes.lower.TIGHTEST_WAITS`:
    one gradient slot per worker)."""
    n = len(units)
    if n < 2:
        raise InvalidInput("a plan needs at least two units (something before the tail, and the tail)")
    cuts = list(range(n - 1))
    plan = build_plan(units, cuts, cuts, n - 1, hardware, workers, microbatches, microbatch_size,
                      seq_len, rounds, costing,
                      notes=("memory first: every unit its own stage on both sides "
                             "(rpcompile.planner.partition.memory_first_plan)",),
                      optimizer="sync")
    return replace(plan, memory_waits=TIGHTEST_WAITS)


def build_plan(
    units: Sequence[UnitProfile],
    forward_bounds: Sequence[int],
    backward_bounds: Sequence[int],
    tail_start: int,
    hardware: Hardware | str,
    workers: int,
    microbatches: int,
    microbatch_size: int = 1,
    seq_len: int = 1,
    rounds: int = 1,
    costing: StageCosting | None = None,
    notes: tuple[str, ...] = (),
    optimizer: str = "async",
) -> Plan:
    """A Plan from explicit cuts: ``*_bounds`` are the start units of each stage in model order
    (both start with 0); units ``tail_start..`` form the fused tail. ``predicted_step_ms`` is,
    for ``"sync"``, the simulator's proven lower bound on one step's makespan
    (:func:`~rpcompile.planner.bound.simulated_lower_bound`); for ``"async"``, the relaxed
    replay's estimate of the overlapping steady-state step
    (:func:`~rpcompile.planner.bound.steady_estimate`, at least that mode's bound): not yet a
    replay either way: the partitioner writes in the simulated figure of the plan it
    returns."""
    hw = get_hardware(hardware)
    return _StageFigures(units, costing or StageCosting()).plan(
        forward_bounds, backward_bounds, tail_start, hw, workers, microbatches,
        microbatch_size, seq_len, rounds, notes, optimizer)


class _StageFigures:
    """Stage figures of one model's units under one costing, each worked out once: the
    search builds thousands of plans from a few hundred distinct stages. A stage is the same
    whatever plan holds it, but for its index and, for a forward stage, the backward
    boundaries inside it (the recompute inputs it saves)."""

    def __init__(self, units: Sequence[UnitProfile], costing: StageCosting) -> None:
        self.units, self.costing = tuple(units), costing
        self._stages: dict[tuple, Stage] = {}

    def stage(self, index: int, kind: str, r: tuple[int, ...], tail_start: int,
              bwd_ranges: Sequence[tuple[int, ...]]) -> Stage:
        saved = tuple(b[0] for b in bwd_ranges if r[0] < b[0] <= r[-1]) \
            if kind == "forward" else ()
        key = (kind, r[0], r[-1], saved)
        made = self._stages.get(key)
        if made is None:
            made = _make_stage(0, kind, r, self.units, self.costing, tail_start, (),
                               [(b,) for b in saved])
            self._stages[key] = made
        return made if index == 0 else replace(made, index=index)

    def plan(self, forward_bounds, backward_bounds, tail_start, hw, workers, microbatches,
             microbatch_size, seq_len, rounds, notes, optimizer) -> Plan:
        units = self.units
        n = len(units)
        fwd_ranges = _ranges(forward_bounds, tail_start)
        bwd_ranges = list(reversed(_ranges(backward_bounds, tail_start)))
        specs = [("forward", r) for r in fwd_ranges] + [("tail", tuple(range(tail_start, n)))]
        specs += [("backward", r) for r in bwd_ranges]
        stages = tuple(self.stage(i, kind, r, tail_start, bwd_ranges)
                       for i, (kind, r) in enumerate(specs))
        return _timed_plan(units, stages, hw, workers, microbatches, microbatch_size,
                           seq_len, rounds, notes, optimizer)


def _timed_plan(units, stages, hw, workers, microbatches, microbatch_size, seq_len, rounds,
                notes, optimizer) -> Plan:
    plan = Plan(
        units=units, stages=stages, workers=workers, microbatches=microbatches,
        microbatch_size=microbatch_size, seq_len=seq_len, hardware=hw.name,
        predicted_step_ms=0.0, memory_limit_bytes=hw.usable_memory_bytes, notes=notes,
    )
    plan.validate()
    figure = steady_estimate(plan, hw, rounds) if optimizer == "async" else \
        simulated_lower_bound(plan, hw, rounds, optimizer)
    return replace(plan, predicted_step_ms=figure)


def _ranges(bounds: Sequence[int], end: int) -> list[tuple[int, ...]]:
    bounds = list(bounds)
    if not bounds or bounds[0] != 0 or sorted(set(bounds)) != bounds or bounds[-1] >= end:
        raise InvalidInput(f"stage starts {bounds} must begin at 0 and increase below {end}")
    edges = [*bounds, end]
    return [tuple(range(a, b)) for a, b in itertools.pairwise(edges)]


def _check_units_fit(units, costing, limit) -> None:
    for i, u in enumerate(units):
        kind = "tail" if i == len(units) - 1 else "backward"
        need = _stage_memory(units, (i,), kind, costing)
        if need > limit:
            raise PartitionError(
                f"unit {u.name!r} alone needs {format_bytes(need)} of device memory (weights "
                f"twice for prefetch, its fp32 gradients and one microbatch's working set) but "
                f"the GPU has {format_bytes(limit)} usable; use a smaller microbatch or sequence "
                "length, freeze it (LoRA), or a GPU with more memory"
            )


# ---------------------------------------------------------------------------------------------
# 2. Cutting
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 3. Stage figures
# ---------------------------------------------------------------------------------------------


def _stage_params(units, r: tuple[int, ...]) -> tuple[int, int]:
    """(all, trainable) parameter elements a stage holds: its units' own, plus parameters
    its units borrow from a unit outside the stage (tied weights), each counted once."""
    params = sum(units[u].params for u in r)
    trainable = sum(units[u].trainable_params for u in r)
    seen = set()
    for u in r:
        for owner, numel, is_trainable in units[u].borrowed:
            if owner in r or (owner, numel) in seen:
                continue
            seen.add((owner, numel))
            params += numel
            trainable += numel if is_trainable else 0
    return params, trainable


def _stage_weight_bytes(units, r: tuple[int, ...], costing: StageCosting) -> tuple[int, int]:
    """(uploaded, dequantized) weight bytes of a stage: every weight in the compute dtype but
    the frozen quantized ones, which travel packed (UnitProfile.packed_bytes); those are
    dequantized on the device, in the compute dtype, for the job's computes."""
    params, _ = _stage_params(units, r)
    packed = sum(units[u].packed_params for u in r)
    dequantized = packed * costing.weight_dtype_bytes
    return (params - packed) * costing.weight_dtype_bytes + sum(
        units[u].packed_bytes for u in r), dequantized


def _stage_reads(units, r: tuple[int, ...]) -> tuple[int, tuple[tuple[str, int], ...] | None]:
    """A stage's buffer bytes and batch inputs: the union over its units of what they read
    (UnitProfile.buffers, batch_inputs), each counted once. Batch inputs are None when no
    unit of the plan says what it reads (profiles built by hand: the first unit reads no ids
    and the last no labels)."""
    buffers: dict[str, int] = {}
    batch: dict[str, int] = {}
    for u in r:
        buffers.update(units[u].buffers)
        batch.update(units[u].batch_inputs)
    known = bool(units[0].batch_inputs or units[-1].batch_inputs)  # the ids, the labels
    return sum(buffers.values()), (tuple(batch.items()) if known else None)


def _stage_memory(units, r: tuple[int, ...], kind: str, costing: StageCosting) -> int:
    """Device memory of one job: weights and buffers twice (the next job's prefetch shares
    the device), the fp32 gradient accumulator (not for forward stages), one microbatch's
    working set, and the dequantized copies of the stage's packed weights (held while a
    compute runs)."""
    _, trainable = _stage_params(units, r)
    uploaded, dequantized = _stage_weight_bytes(units, r, costing)
    weights = 2 * (uploaded + _stage_reads(units, r)[0])
    grads = 0 if kind == "forward" else trainable * costing.grad_dtype_bytes
    if kind == "forward":
        # No autograd: only the largest transient plus the values being sent out.
        working = max((units[u].output_bytes + units[u].shared_bytes for u in r), default=0)
        working += max((units[u].working_bytes for u in r), default=0) // 4
    else:
        working = recompute_working_bytes(units, r, _recompute(kind, r, units, costing))
    # A quantized stage's dequantized weights are part of each compute's working set.
    return int(weights + grads + working * costing.activation_scale + dequantized)


def _recompute(kind: str, r: tuple[int, ...], units, costing: StageCosting) -> str:
    """A stage's recompute granularity: the costing's for a backward stage of several units
    where layer recompute holds less (a stage of one large layer and a small prefix holds
    more by layer: the boundaries and a gradient for next to nothing saved)."""
    if kind != "backward" or costing.recompute == "stage" or len(r) < 2:
        return "stage"
    return ("layer" if recompute_working_bytes(units, r, "layer")
            < recompute_working_bytes(units, r, "stage") else "stage")


def _make_stage(index, kind, r, units, costing, tail_start, fwd_ranges, bwd_ranges) -> Stage:
    if kind == "forward":
        ms = sum(units[u].forward_ms for u in r)
    else:
        ms = recompute_ms(units, r, _recompute(kind, r, units, costing))
    _, trainable = _stage_params(units, r)
    buffer_bytes, batch_inputs = _stage_reads(units, r)
    first = r[0]
    incoming = units[first - 1].output_bytes if first > 0 else 0
    # Shared values (rotary tables, masks, long skips) travel with every boundary after the
    # unit that makes them (UnitProfile.shared_bytes): all of them, not the largest.
    shared = sum(units[u].shared_bytes for u in range(first))
    if kind == "forward":
        last = r[-1]
        # The activation for the next stage, plus each backward boundary inside this stage:
        # those inputs are saved for the backward stage's recompute.
        saved = sum(
            units[b[0] - 1].output_bytes for b in bwd_ranges if first < b[0] <= last
        )
        out_bytes = (units[last].output_bytes + saved
                     + sum(units[u].shared_bytes for u in range(last + 1)))
        in_bytes = incoming + shared
    else:
        # Backward stages read their saved input and the output gradient; they send the
        # input gradient on (nothing for the stage that starts at unit 0). A gradient covers
        # the hidden state and every shared value that carries one (a long skip connection).
        out_grad = (units[r[-1]].output_bytes
                    + sum(units[u].shared_grad_bytes for u in range(r[-1] + 1))
                    if kind == "backward" else 0)
        in_bytes = incoming + shared + out_grad
        out_bytes = incoming + sum(units[u].shared_grad_bytes for u in range(first))
    return Stage(
        index=index,
        kind=kind,
        units=tuple(r),
        compute_ms=ms,
        weight_bytes=_stage_weight_bytes(units, r, costing)[0],
        grad_bytes=0 if kind == "forward" else trainable * costing.grad_dtype_bytes,
        input_bytes=int(in_bytes * costing.activation_scale),
        output_bytes=int(out_bytes * costing.activation_scale),
        peak_bytes=_stage_memory(units, tuple(r), kind, costing),
        recompute=_recompute(kind, tuple(r), units, costing),
        shadow_bytes=trainable * costing.weight_dtype_bytes,
        buffer_bytes=buffer_bytes,
        batch_inputs=batch_inputs,
    )

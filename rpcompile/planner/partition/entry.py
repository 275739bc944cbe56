"""partition(): the plan with the shortest predicted step, its options read once into the
search's arguments, the search budgets of each effort, and the choice of recompute
granularity (stage, or layer by layer when only that fits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.hardware import Hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.options import PlanOptions, update_order
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.partition.common import _SEARCH_LOG, PartitionError, SearchConfig, _SearchLog
from rpcompile.planner.partition.memory_first import (
    MEMORY_FIRST_NOTE,
    _fitting_plan,
    _proven_at,
    memory_first_note,
)
from rpcompile.planner.partition.search import _NO_CAP, _ReplayCap
from rpcompile.planner.partition.stages import StageCosting, _planning_inputs
from rpcompile.progress import StatusLine

__all__ = [
    "SEARCH_BUDGETS",
    "TAIL_MEMORY_NOTE",
    "SearchBudget",
    "partition",
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
    balance: int = 4,
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
    tuning (``max_tail_layers``, ``shortlist``, ``refine``, ``balance``, ``target_bubble``,
    ``search``) are keywords.

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
    the steady-state bubble is below ``target_bubble``; ``refine=0`` turns it off). When the
    bubble is still above ``target_bubble`` after that, the worker classes of round-robin
    dispatch are balanced: runs of consecutive boundaries shifted together and the forward
    side cut with one stage fewer or more, pre-scored by arithmetic and the steady-state
    estimate, at most ``balance`` more runs (``balance=0`` turns that off). Raises
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
    units, hw, costing = _planning_inputs(units, hardware, costing)
    capacity = hw.usable_memory_bytes
    fit = capacity if capacity_bytes is None else min(capacity, int(capacity_bytes))
    args = SearchConfig(units, hw, workers, microbatches, microbatch_size, seq_len, rounds,
                        max_tail_layers, shortlist, max_simulations, optimizer, refine,
                        balance, target_bubble, search, lowering)
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


def _recompute_choice(args: SearchConfig, costing: StageCosting, recompute: str,
                      capacity: int, fit: int) -> Plan:
    """The plan of the recompute granularity asked for, or (``"auto"``) the stage-recompute
    plan when it fits ``fit``, else the faster of the plans cut again by stage and by layer
    under ``fit``."""
    hw, rounds, optimizer = args.hw, args.rounds, args.optimizer
    if recompute != "auto":
        return _fitting_plan(args, replace(costing, recompute=recompute), capacity)
    try:
        plan, refused = _fitting_plan(args, replace(costing, recompute="stage"), capacity), None
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
            tried[mode] = _fitting_plan(args, replace(costing, recompute=mode), fit)
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

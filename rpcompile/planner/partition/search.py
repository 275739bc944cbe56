"""The best-first search of one stage limit: every tail size and stage count cut exactly, the
local search's proposals and RoundPipe's greedy partition added, and the candidates replayed in
the simulator in order of their proven lower bounds, until every candidate left is proven no
faster (or a replay cap is reached)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rpcompile.hardware import Hardware
from rpcompile.ir import Plan
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.bound import simulated_lower_bound, steady_estimate
from rpcompile.planner.partition.common import (
    _SEARCH_LOG,
    PartitionError,
    SearchConfig,
    _NoPlanFits,
)
from rpcompile.planner.partition.cuts import _all_cuts
from rpcompile.planner.partition.local import _balance, _bounds, _refine, _search
from rpcompile.planner.partition.proofs import _simulated_ms, _sync_period_proof
from rpcompile.planner.partition.stages import StageCosting, _stage_memory, _StageFigures


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


_NO_CAP = 1 << 62  # replays per grid of an uncapped search


def _partition(cfg: SearchConfig, costing: StageCosting, limit: int, capacity: int) -> Plan:
    """The simulator's fastest candidate of the search ``cfg`` under ``costing`` whose stages
    fit ``limit`` (and whose whole schedule fits ``capacity``: else :class:`_NoPlanFits`)."""
    units, hw, workers, microbatches = cfg.units, cfg.hw, cfg.workers, cfg.microbatches
    microbatch_size, seq_len, rounds = cfg.microbatch_size, cfg.seq_len, cfg.rounds
    max_tail_layers, shortlist = cfg.max_tail_layers, cfg.shortlist
    max_simulations = cfg.max_simulations
    optimizer, refine, target_bubble = cfg.optimizer, cfg.refine, cfg.target_bubble
    balance = cfg.balance
    search, lowering = cfg.search, cfg.lowering
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
    # Per tail start: the forward side's min-max cuts anywhere, by stage count (the class
    # balancing below re-cuts the plan's forward side with one stage fewer or more).
    forward_cuts: dict[int, dict[int, tuple[float, tuple[int, ...]]]] = {}
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
        if grid is None:
            forward_cuts[t] = fwd_cuts
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
    # RoundPipe's greedy partition, cut where its library cuts (between whole layers), is
    # replayed whatever the cap too: the plan returned is never slower in the simulator than
    # the rule it is measured against, whatever the bound and estimate rank first.
    g = len(grids) - 1
    if (greedy := _greedy_candidate(units, hw, workers, costing, limit, grids[g], make)):
        pools[g].append(greedy)
        firsts[g].append(greedy)
    best, search_note, bubble = _best_simulated(pools, hw, rounds, optimizer, capacity,
                                                max_simulations, firsts)
    best = replace(best, notes=(*best.notes, search_note))
    if optimizer == "async" and refine > 0:
        best, bubble = _refine(best, bubble, make, hw, rounds, limit, capacity, refine,
                               target_bubble)
        if bubble > target_bubble and balance > 0:
            def recut(count: int, t: int) -> tuple[int, ...] | None:
                cut = forward_cuts.get(t, {}).get(count)
                return None if cut is None else cut[1]

            best = _balance(best, bubble, make, figures.job_ms, recut, hw, rounds, limit,
                            capacity, balance, target_bubble)
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


def _greedy_candidate(units, hw: Hardware, workers: int, costing: StageCosting, limit: int,
                      grid: Sequence[int] | None, make) -> Plan | None:
    """RoundPipe's greedy partition (rpcompile.planner.partition_baseline) of ``units``, cut
    only at ``grid`` (None: anywhere) and built by ``make``; None when its rule cannot place
    a unit or a stage of it is over ``limit``."""
    # Imported here: the baseline builds its plans with this package's stage figures.
    from rpcompile.planner.partition_baseline import greedy_cuts

    try:
        cuts = greedy_cuts(units, hw, workers, costing, grid)
    except PartitionError:
        return None
    plan = make(list(cuts.forward_starts), list(cuts.backward_starts), cuts.tail_start,
                (cuts.note,))
    return plan if all(st.peak_bytes <= limit for st in plan.stages) else None


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

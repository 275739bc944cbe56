"""Local search over stage boundaries: an iterated climb scored by the lower bound, which
proposes candidates to the replays; the refinement of the winner's boundaries in the
simulator (async); and, where the refined plan's bubble is still above the target, the
balancing of round-robin dispatch's worker classes."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import replace

from rpcompile.ir import Plan
from rpcompile.planner.partition.proofs import _simulated_ms


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


def _refine(plan: Plan, bubble: float, make, hw, rounds, limit, capacity, budget,
            target_bubble) -> tuple[Plan, float]:
    """Move single stage boundaries by 1 or 2 units while the simulated steady state improves.

    Round-robin dispatch is sensitive to small differences between consecutive jobs (a job
    faster than its predecessor waits for each of its microbatches), which min-max cuts do
    not see. ``plan.predicted_step_ms`` and ``bubble`` are its simulated figures. First
    improvement, forward boundaries then backward ones, at most ``budget`` simulations in
    all (the one that scored ``plan`` included); stops early once the steady-state bubble is
    below ``target_bubble``. ``make(forward, backward, tail, notes)`` builds a plan.
    Returns the plan and its simulated steady-state bubble.
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
        return plan, bubble
    return replace(best, predicted_step_ms=best_ms,
                   notes=(*plan.notes, f"boundaries refined in the simulator ({spent} runs)")
                   ), bubble


def class_bound(job_ms: Sequence[float], workers: int, microbatches: int,
                rounds: int = 1) -> float:
    """The busiest class of workers' compute per step, spread over the class: the steps of
    a long run of round-robin dispatch average no less.

    ``job_ms``: each stage's compute per microbatch, in dispatch order. The counter deals
    J = stages x rounds jobs a step and never restarts (rpcompile.passes.schedule.deal), so
    job j of every step goes to a worker w = j + k J (mod ``workers``): with
    g = gcd(J, workers) > 1 the workers fall into g classes, and class c (workers/g of them)
    only ever runs the jobs j = c (mod g). Its jobs' time, ``microbatches`` times over
    (each job runs every microbatch of its round), shared by its workers, is what a step
    takes at least; the other classes idle for the rest.
    With g = 1 every worker runs every job in turn and this is a step's compute over all the
    workers."""
    jobs = len(job_ms) * rounds
    g = math.gcd(jobs, workers)
    sums = [0.0] * g
    for j in range(jobs):
        sums[j % g] += job_ms[j % len(job_ms)]
    return microbatches * max(sums) * g / workers


# The class-balancing step's estimates of the steady state at most: its candidates are the
# pairs of a forward and a backward side (below), at most a few thousand pre-scored by
# arithmetic; the estimate (steady_estimate) is ~10 ms a plan on a 50-unit model.
BALANCE_ESTIMATES = 1024


def _balance(plan: Plan, bubble: float, make, job_ms, recut, hw, rounds, limit, capacity,
             budget, target_bubble) -> Plan:
    """Balance the worker classes of round-robin dispatch (:func:`class_bound`), in the
    simulator.

    When the job count shares a factor g with the workers, class c only runs jobs
    j = c (mod g), and the class with the most work paces every step. Moving one boundary
    moves a unit between two neighbouring stages, which are in different classes, but makes
    one of them longer than the rest; shifting a run of consecutive boundaries together
    moves the unit between the stages at the run's two ends and leaves the stages inside it
    as long as they were. A stage count that makes g larger (or 1) changes the classes
    themselves.

    Candidates: each forward side among the plan's and the min-max cuts with one forward
    stage fewer or more (``recut(count, tail)``, None where none fits), each with a run of
    1 to 4 consecutive boundaries shifted by one unit (or none), paired with the plan's
    backward side shifted the same ways (or not). Where the job count gives more than one
    class, only the backward sides with the lowest :func:`class_bound` are kept (cheap:
    ``job_ms(forward, backward, tail)`` gives the stage times); where it gives one, the
    backward side is the plan's. The :data:`BALANCE_ESTIMATES` first by that bound (fixed
    order on ties) are timed by the steady-state estimate (``make``), and those the estimate
    ranks below the plan's own estimate are replayed, lowest first: at most ``budget``
    simulations, stopping once the steady-state bubble is below ``target_bubble``. A replay
    that gives a shorter steady-state step and fits ``capacity`` becomes the plan; the
    notes say how many candidates were estimated and replayed."""
    fwd, bwd, tail = _bounds(plan)
    workers, microbatches = plan.workers, plan.microbatches

    def shifted(bounds: tuple[int, ...]) -> list[tuple[int, ...]]:
        out = [bounds]
        for k, i, d in itertools.product(range(1, 5), range(1, len(bounds)), (-1, 1)):
            if i + k <= len(bounds):
                moved = (*bounds[:i], *(b + d for b in bounds[i:i + k]), *bounds[i + k:])
                if all(a < b for a, b in itertools.pairwise((*moved, tail))):
                    out.append(moved)
        return out

    heads = [fwd, *(c for p in (len(fwd) - 1, len(fwd) + 1) if (c := recut(p, tail)))]
    fronts = list(dict.fromkeys(m for head in heads for m in shifted(tuple(head))))
    backs = shifted(bwd)
    ranked: list[tuple[float, int, tuple[int, ...], tuple[int, ...]]] = []
    for front in fronts:
        if math.gcd((len(front) + 1 + len(bwd)) * rounds, workers) == 1:
            pairs = [(class_bound(job_ms(front, bwd, tail), workers, microbatches, rounds),
                      bwd)]
        else:
            pairs = [(class_bound(job_ms(front, back, tail), workers, microbatches, rounds),
                      back) for back in backs]
            least = min(v for v, _back in pairs)
            pairs = [(v, back) for v, back in pairs if v <= least * (1 + 1e-9)]
        ranked += [(round(v, 6), len(ranked) + n, front, back)
                   for n, (v, back) in enumerate(pairs) if (front, back) != (fwd, bwd)]
    ranked = sorted(ranked)[:BALANCE_ESTIMATES]
    own = round(make(fwd, bwd, tail, plan.notes).predicted_step_ms, 6)
    timed = []
    for _v, order, front, back in ranked:
        candidate = make(front, back, tail, plan.notes)
        if all(st.peak_bytes <= limit for st in candidate.stages) \
                and (estimate := round(candidate.predicted_step_ms, 6)) < own:
            timed.append((estimate, order, candidate))
    best, best_ms, spent = plan, plan.predicted_step_ms, 0
    for _estimate, _order, candidate in sorted(timed, key=lambda e: e[:2]):
        if spent >= budget or bubble <= target_bubble:
            break
        (ms, trial_bubble, peaks), ran = _simulated_ms(candidate, hw, rounds, "async",
                                                       capacity)
        spent += 1
        if ms < best_ms - 1e-6 and max(p.peak_bytes for p in peaks) <= capacity:
            best, best_ms, bubble = ran, ms, trial_bubble
            best = replace(best, worker_peak_bytes=tuple(p.peak_bytes for p in peaks))
    runs = f"{len(ranked)} candidates estimated, {spent} run{'s' * (spent != 1)}"
    said = (f"worker classes balanced in the simulator ({runs})" if best is not plan
            else f"worker classes: no faster plan ({runs})")
    return replace(best, predicted_step_ms=best_ms, notes=(*plan.notes, said))

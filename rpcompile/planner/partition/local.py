"""Local search over stage boundaries: an iterated climb scored by the lower bound, which
proposes candidates to the replays, and the refinement of the winner's boundaries in the
simulator (async)."""

from __future__ import annotations

import itertools
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

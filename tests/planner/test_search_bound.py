"""The planner's best-first search: its lower bound never exceeds the simulator's figure, and the
plan it returns is the simulator's argmin over every candidate.

The simulated figures here come from the public simulator entry points (dispatch, lowering and
replay), not from the bound or the partitioner: one sync step's makespan, or the async
steady-state step of :func:`~rpcompile.sim.steady_steps` overlapping steps.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from rpcompile.hardware import get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import BOUNDED_WAITS, TIGHTEST_WAITS
from rpcompile.planner.bound import simulated_lower_bound
from rpcompile.planner.partition import build_plan, partition
from rpcompile.planner.partition import proofs as proofs_module
from rpcompile.planner.partition import search as search_module
from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.paper import get_model

MIB = 1 << 20


def _figure(plan, hw, rounds: int, mode: str) -> float:
    """The simulator's figure for ``plan`` as lowered with its own memory waits (a plan's
    default is all three; the planner lowers a plan with none when that schedule fits)."""
    if mode == "sync":
        return simulate_roundpipe(plan, hw, steps=1, optimizer="sync", rounds=rounds).makespan_ms
    run = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=rounds),
                             optimizer="async", rounds=rounds)
    return steady_step_ms(run)


def _tiny_units(rng: random.Random, layers: int, tied: bool = False) -> list[UnitProfile]:
    """A prefix, ``layers`` uneven layers (some frozen, some with no compute) and a tail."""
    units = [UnitProfile("prefix", 0.0, 0.0, trainable_params=rng.randrange(1, 40) * MIB,
                         output_bytes=rng.randrange(1, 8) * MIB)]
    for i in range(layers):
        fwd = rng.choice((0.0, rng.uniform(0.5, 12.0)))
        trainable = 0 if rng.random() < 0.2 else rng.randrange(1, 60) * MIB
        units.append(UnitProfile(
            f"layers.{i}", fwd, fwd * rng.uniform(1.5, 3.0), trainable_params=trainable,
            frozen_params=rng.randrange(0, 20) * MIB, output_bytes=rng.randrange(1, 16) * MIB,
            working_bytes=rng.randrange(1, 64) * MIB))
    borrowed = ((0, units[0].trainable_params, True),) if tied else ()
    units.append(UnitProfile("tail", rng.uniform(1.0, 30.0), rng.uniform(1.0, 40.0),
                             trainable_params=rng.randrange(1, 40) * MIB,
                             output_bytes=rng.randrange(1, 8) * MIB,
                             working_bytes=rng.randrange(1, 64) * MIB, borrowed=borrowed))
    return units


def _cuts(n: int):
    """(forward starts, backward starts, tail start) of every plan of ``n`` units (the last
    always in the tail, unit 0 never)."""
    every = []
    for tail in range(1, n):
        inner = range(1, tail)
        sides = [(0, *c) for k in range(len(inner) + 1) for c in itertools.combinations(inner, k)]
        every += [(f, b, tail) for f in sides for b in sides]
    return every


def _random_cuts(n: int, rng: random.Random, count: int):
    """``count`` plans of ``n`` units: a tail of the last 1-4 units, 1-12 stages a side."""
    out = []
    for _ in range(count):
        tail = rng.randrange(max(1, n - 4), n)
        sides = [(0, *sorted(rng.sample(range(1, tail), rng.randrange(0, min(tail - 1, 11) + 1))))
                 for _side in range(2)]
        out.append((*sides, tail))
    return out


def _check_bounds(cases, make_units, rng: random.Random, cuts: int, rounds: int,
                  mode: str) -> int:
    """For each (hardware, workers, microbatches, units) case, ``cuts`` random plans, each
    with either set of memory waits the partitioner lowers with: the bound is positive and
    never above the simulator's figure. Returns how many plans were checked."""
    checked = 0
    for hw_name, workers, micro, *unit_args in cases:
        hw = get_hardware(hw_name)
        units = make_units(rng, *unit_args)
        for fwd, bwd, tail in _random_cuts(len(units), rng, cuts):
            plan = build_plan(units, fwd, bwd, tail, hw, workers, micro, rounds=rounds)
            for waits in (BOUNDED_WAITS, TIGHTEST_WAITS):
                plan = replace(plan, memory_waits=waits)
                bound = simulated_lower_bound(plan, hw, rounds, mode)
                figure = _figure(plan, hw, rounds, mode)
                assert 0.0 < bound <= figure, (hw_name, fwd, bwd, tail, waits, bound, figure)
                checked += 1
    return checked


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_bound_never_exceeds_the_simulated_figure_tiny(mode: str, rounds: int) -> None:
    cases = (("rtx4090x8", 3, 4, 5, False), ("rtx4090x8", 4, 2, 6, True),
             ("cpu", 2, 3, 4, True), ("a800x8", 5, 5, 7, False), ("rtx5090x8", 8, 9, 6, False),
             ("h200x1", 1, 3, 4, False))
    rng = random.Random(17 + rounds + (mode == "async"))
    assert _check_bounds(cases, _tiny_units, rng, 6, rounds, mode) == 6 * 6 * 2


def _upload_bound_units(rng: random.Random, layers: int) -> list[UnitProfile]:
    """A prefix, ``layers`` layers of large frozen weights and almost no compute, and a tail:
    plans whose time is their weight uploads, where the bound's release and first-upload
    arguments decide whether it stays below the figure."""
    units = [UnitProfile("prefix", 0.0, 0.0, trainable_params=rng.randrange(1, 8) * MIB,
                         output_bytes=MIB)]
    for i in range(layers):
        fwd = rng.uniform(0.01, 0.5)
        units.append(UnitProfile(
            f"layers.{i}", fwd, 2 * fwd, trainable_params=rng.randrange(0, 4) * MIB,
            frozen_params=rng.randrange(100, 600) * MIB, output_bytes=MIB,
            working_bytes=2 * MIB))
    units.append(UnitProfile("tail", 0.2, 0.4, trainable_params=rng.randrange(1, 8) * MIB,
                             output_bytes=MIB, working_bytes=2 * MIB))
    return units


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_bound_never_exceeds_the_simulated_figure_upload_bound(mode: str, rounds: int) -> None:
    """Upload-dominated tiny plans on 1-3 workers: every figure is mostly weight uploads, so
    a bound that counted an upload the replay can start early would exceed it."""
    cases = (("rtx4090x8", 1, 2, 3), ("rtx4090x8", 2, 3, 4), ("cpu", 3, 2, 5),
             ("rtx4090x8", 3, 4, 6))
    rng = random.Random(41 + rounds + (mode == "async"))
    assert _check_bounds(cases, _upload_bound_units, rng, 5, rounds, mode) == 4 * 5 * 2


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_bound_never_exceeds_the_simulated_figure_paper(mode: str, rounds: int) -> None:
    """Random cuts of two paper models at the planner's sizes: the bound never exceeds the
    figure, and for sync it is tight (within 5 %), or the search could not stop early. The
    async bound (one step's compute over the workers: steps overlap, so no one step's path
    bounds the spacing of step starts) is tight only for plans that overlap well; a random
    cut idles workers far more (the async search orders its replays by steady_estimate)."""
    rng = random.Random(3 * rounds + (mode == "async"))
    hw = get_hardware("rtx4090x8")
    for name in ("qwen3-1.7b", "llama3.1-8b"):
        units = get_model(name).units(4, 2048)
        for fwd, bwd, tail in _random_cuts(len(units), rng, 2 if mode == "async" else 3):
            plan = build_plan(units, fwd, bwd, tail, hw, 8, 9, 4, 2048, rounds=rounds)
            bound = simulated_lower_bound(plan, hw, rounds, mode)
            figure = _figure(plan, hw, rounds, mode)
            assert bound <= figure, (name, fwd, bwd, tail, bound, figure)
            if mode == "sync":
                assert figure <= 1.05 * bound, (name, fwd, bwd, tail, bound, figure)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_best_first_returns_the_exhaustive_argmin(mode: str) -> None:
    """Over every plan of a 5-unit model (all cuts, not only the planner's), the best-first
    search returns the plan the simulator puts first; sync, having simulated fewer than
    half."""
    hw = get_hardware("rtx4090x8")
    units = _tiny_units(random.Random(5), 3, tied=True)
    plans = [build_plan(units, f, b, t, hw, 3, 4, optimizer=mode)
             for f, b, t in _cuts(len(units))]
    figures = [_figure(replace(p, memory_waits=BOUNDED_WAITS), hw, 1, mode) for p in plans]
    sims = []
    real = search_module._simulated_ms

    def counting(*args):
        sims.append(args[0])
        return real(*args)

    search_module._simulated_ms = counting
    try:
        chosen, note, _bubble = search_module._best_simulated(
            [plans], hw, 1, mode, hw.usable_memory_bytes, max_simulations=len(plans))
    finally:
        search_module._simulated_ms = real
    assert chosen.memory_waits == BOUNDED_WAITS  # so its figure is the one computed above
    assert chosen.predicted_step_ms == pytest.approx(min(figures), rel=0, abs=1e-6)
    assert note.startswith("search: the simulator's fastest") and "proven no faster" in note
    if mode == "sync":  # the async bound (compute over workers) prunes little on a tiny model
        assert len(sims) < len(plans) / 2, (len(sims), len(plans))


def test_capped_search_states_its_gap() -> None:
    hw = get_hardware("rtx4090x8")
    units = _tiny_units(random.Random(5), 3)
    plans = [build_plan(units, f, b, t, hw, 3, 4, optimizer="async") for f, b, t in _cuts(len(units))]
    chosen, note, _bubble = search_module._best_simulated(
        [plans], hw, 1, "async", hw.usable_memory_bytes, max_simulations=2)
    assert note.startswith("search: NOT proven the fastest") and "max_simulations=2" in note
    floor = min(simulated_lower_bound(p, hw, 1, "async") for p in plans)
    assert floor <= chosen.predicted_step_ms


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_partition_picks_the_simulators_argmin_of_its_candidates(mode: str) -> None:
    """The public planner on a small model: every candidate it considered is simulated here,
    and none is faster than the plan it returned."""
    hw = get_hardware("rtx4090x8")
    units = _tiny_units(random.Random(11), 5)
    seen = []
    real = search_module._best_simulated

    def recording(pools, *args):
        seen.extend(plan for pool in pools for plan in pool)
        return real(pools, *args)

    search_module._best_simulated = recording
    try:
        plan = partition(units, hw, PlanOptions(gpus=3, microbatches=4, mode=mode,
                                                max_simulations=10_000), refine=0, search=50)
    finally:
        search_module._best_simulated = real
    assert plan.memory_waits == BOUNDED_WAITS
    assert any("proven no faster" in note for note in plan.notes)
    best = min(_figure(replace(p, memory_waits=BOUNDED_WAITS), hw, 1, mode) for p in seen)
    assert plan.predicted_step_ms == pytest.approx(best, rel=0, abs=1e-6)
    assert len(seen) > 10


def test_a_replay_is_kept_by_what_it_depends_on(monkeypatch) -> None:
    """The planner replays a plan met again (other notes, other memory waits asked for) once,
    and again for another capacity, rounds or mode; the figures are those of a fresh replay."""
    hw = get_hardware("rtx4090x8")
    units = _tiny_units(random.Random(23), 4)
    plan = build_plan(units, (0, 2), (0, 3), 4, hw, 3, 4)
    monkeypatch.setattr(proofs_module, "_REPLAYS", proofs_module.OrderedDict())
    lowerings = []
    real = proofs_module.fit_memory_waits

    def counting(*args, **kwargs):
        lowerings.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(proofs_module, "fit_memory_waits", counting)
    capacity = hw.usable_memory_bytes
    first, ran = proofs_module._simulated_ms(plan, hw, 1, "sync", capacity)
    again, ran_again = proofs_module._simulated_ms(
        replace(plan, notes=("found by the local search",), memory_waits=("sent",)),
        hw, 1, "sync", capacity)
    assert len(lowerings) == 1 and again == first
    assert ran_again.memory_waits == ran.memory_waits
    assert ran_again.notes == ("found by the local search",)
    assert first[0] == _figure(replace(plan, memory_waits=ran.memory_waits), hw, 1, "sync")
    for args in ((1, "sync", capacity - 1), (2, "sync", capacity), (1, "async", capacity)):
        proofs_module._simulated_ms(plan, hw, *args)
    assert len(lowerings) == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cached_bound_is_not_reused_for_a_plan_that_shares_a_parameter(mode: str) -> None:
    """A tied plan and its untied twin have the same stage figures; only their units say
    that the tail's matrix is the embedding's, updated once (passes.lower.opt_bytes). The
    bound of one must not be served for the other from the cache: the untied twin's, which
    charges the matrix's update twice, exceeds the tied plan's own replay."""
    hw = replace(get_hardware("rtx4090x8").with_gpus(4), optimizer_params_per_s=2e8)
    units = _tiny_units(random.Random(7), 4, tied=True)
    assert any(u.borrowed for u in units)
    tied = build_plan(units, (0, 1, 3), (0, 2, 4), len(units) - 1, hw, 4, 4, 1, 256)
    untied = replace(tied, units=tuple(replace(u, borrowed=()) for u in tied.units))
    assert untied.stages == tied.stages
    twin = simulated_lower_bound(untied, hw, 1, mode)
    bound = simulated_lower_bound(tied, hw, 1, mode)
    figure = _figure(tied, hw, 1, mode)
    assert bound <= figure, (bound, figure)
    if mode == "sync":
        assert twin > bound  # the twin's bound is another figure, so a reuse would be seen
    else:  # the async bound is compute only: the updates' cost does not enter it
        assert twin == bound

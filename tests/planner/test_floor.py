"""The async floor (rpcompile.planner.partition.async_step_floor): worked out by hand from
the units' own times, and never above the steady step any plan replays to."""

from __future__ import annotations

import dataclasses
import random

import pytest

from rpcompile.errors import InvalidInput
from rpcompile.hardware import get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.options import PlanOptions
from rpcompile.planner.partition import PartitionError, async_step_floor, build_plan, partition
from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps


def _units(n: int, seed: int) -> list[UnitProfile]:
    rng = random.Random(seed)
    units = [UnitProfile("prefix", 0.0, 0.0, 1000, output_bytes=10**6)]
    units += [UnitProfile(f"layers.{i}", rng.uniform(2, 8), rng.uniform(6, 20), 10**6,
                          output_bytes=10**6) for i in range(n)]
    return [*units, UnitProfile("tail", rng.uniform(4, 30), rng.uniform(8, 60), 10**6)]


def _one_tail(units, tail, workers, microbatches, rounds):
    """The floor of the plans whose tail starts at unit ``tail``, from the units' forward and
    backward times alone: before the tail a unit runs forward, then forward again and
    backward; a tail unit forward and backward once."""
    head, rest = units[:tail], units[tail:]
    step = (sum(2 * u.forward_ms + u.backward_ms for u in head)
            + sum(u.forward_ms + u.backward_ms for u in rest))
    longest = max([u.forward_ms + u.backward_ms for u in head]
                  + [sum(u.forward_ms + u.backward_ms for u in rest)])
    return max(rounds * microbatches * step / workers, (step + (microbatches - 1) * longest) / 2)


def _by_hand(units, workers, microbatches, rounds, tails=None):
    """(the least of :func:`_one_tail` over ``tails`` (default: every tail start), the tail
    length that gives it)."""
    tails = range(1, len(units)) if tails is None else tails
    return min((_one_tail(units, t, workers, microbatches, rounds), len(units) - t)
               for t in tails)


@pytest.mark.parametrize(("seed", "workers", "microbatches", "rounds"),
                         [(0, 4, 5, 1), (1, 8, 9, 1), (2, 3, 4, 2), (3, 8, 3, 1)])
def test_the_floor_is_the_units_own_arithmetic(seed, workers, microbatches, rounds):
    units = _units(7, seed)
    floor = async_step_floor(units, "rtx4090x8", workers, microbatches, rounds=rounds)
    ms, tail = _by_hand(units, workers, microbatches, rounds)
    assert floor.step_ms == pytest.approx(ms, rel=1e-12)
    assert floor.tail_units == tail
    assert floor.step_ms == max(floor.work_ms, floor.chain_ms)


@pytest.mark.parametrize(("seed", "workers", "microbatches", "rounds", "within"),
                         [(1, 3, 4, 2, 4 / 3), (2, 8, 3, 1, 1.01)])
def test_no_plan_replays_below_the_floor(seed, workers, microbatches, rounds, within):
    """Random cuts and the partitioner's own async plan, each replayed in the overlapping
    steady state on the fast-link profile and on one with links 100x faster: none is
    faster than the floor, and the partitioner's plan comes within ``within`` of it (on 8
    workers with 3 microbatches the chain sets the floor, and the plan meets it: a floor too
    high by more than 1 % fails)."""
    hw = get_hardware("rtx4090x8")
    fast = dataclasses.replace(hw, h2d_gbps=100 * hw.h2d_gbps, d2h_gbps=100 * hw.d2h_gbps,
                               host_mem_gbps=100 * hw.host_mem_gbps)
    units = _units(7, seed)
    n = len(units)
    floor = async_step_floor(units, hw, workers, microbatches, rounds=rounds)
    rng = random.Random(seed)
    plans = []
    for _ in range(6):
        tail = rng.randrange(n - 3, n)
        fwd = [0, *sorted(rng.sample(range(1, tail), rng.randrange(0, min(3, tail - 1) + 1)))]
        bwd = [0, *sorted(rng.sample(range(1, tail), rng.randrange(0, min(4, tail - 1) + 1)))]
        plans.append(build_plan(units, fwd, bwd, tail, hw, workers, microbatches,
                                rounds=rounds))
    ours = partition(units, hw, PlanOptions(gpus=workers, microbatches=microbatches,
                                            rounds=rounds, mode="async"))
    plans.append(ours)
    for profile in (hw, fast):
        steps = [steady_step_ms(simulate_roundpipe(p, profile, optimizer="async",
                                                   rounds=rounds,
                                                   steps=steady_steps(p, rounds=rounds)))
                 for p in plans]
        assert min(steps) >= floor.step_ms * (1 - 1e-9), (steps, floor)
    assert steps[-1] <= floor.step_ms * within, (steps[-1], floor)



def test_tails_that_do_not_fit_are_left_out():
    """Only tails whose working set fits the capacity count: with less memory the floor is
    the least over the tails that still fit, and with none no plan exists."""
    units = [*_units(7, 4)[:-1], UnitProfile("tail", 1.0, 2.0, 10**6, output_bytes=10**6,
                                             working_bytes=10**9)]
    hw = get_hardware("rtx4090x8")
    n = len(units)
    tail_bytes = {t: next(st for st in build_plan(units, list(range(t)), list(range(t)), t,
                                                  hw, 4, 5).stages
                          if st.kind == "tail").peak_bytes for t in range(1, n)}
    assert len(set(tail_bytes.values())) > 2  # the tails hold different amounts
    for capacity in sorted(set(tail_bytes.values())):
        fitting = [t for t, b in tail_bytes.items() if b <= capacity]
        floor = async_step_floor(units, hw, 4, 5, capacity=capacity)
        assert tail_bytes[n - floor.tail_units] <= capacity
        ms, tail = _by_hand(units, 4, 5, 1, fitting)
        assert floor.step_ms == pytest.approx(ms, rel=1e-12)
        assert floor.tail_units == tail
    with pytest.raises(PartitionError, match="no fused tail"):
        async_step_floor(units, hw, 4, 5, capacity=min(tail_bytes.values()) - 1)


def test_a_model_of_one_unit_has_no_plan():
    with pytest.raises(InvalidInput, match="at least 2 units"):
        async_step_floor(_units(3, 0)[:1], "rtx4090x8", 4, 5)

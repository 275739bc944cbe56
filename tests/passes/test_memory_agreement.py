"""Device memory proven over the whole lowered schedule (rpcompile.passes.memory): on tiny
models the prediction, the simulator and the virtual workers' accounting agree per worker, with
two gradient slots, with one, and without the memory-bounding waits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rpcompile.compiler import runtime_schedule
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import BOUNDED_WAITS, MEMORY_WAITS, TIGHTEST_WAITS
from rpcompile.passes.memory import worker_peaks
from tests.passes.memory_runs import (
    assert_agree,
    compiled_for,
    simulated_and_measured,
    tightest_peaks,
)

CASES = [("qwen3", 1, 3), ("qwen3", 2, 3), ("qwen3", 3, 4), ("qwen3", 4, 8), ("llama", 3, 6)]


@pytest.mark.parametrize("arch,gpus,microbatches", CASES)
def test_predicted_simulated_and_measured_peaks_agree(arch, gpus, microbatches):
    # Every plan is lowered with the memory-bounding waits (two gradient slots per worker),
    # and what a download sends home is given back at a compute the schedule names, so the
    # proven peak is what a run reaches, per worker, whatever the timing.
    compiled = compiled_for(arch, gpus, microbatches)
    assert compiled.plan.memory_waits == BOUNDED_WAITS
    assert_agree(compiled.memory, *simulated_and_measured(compiled, gpus, microbatches))


@pytest.mark.parametrize("arch,gpus,microbatches", [("qwen3", 1, 3), ("llama", 1, 4)])
def test_a_plan_that_fits_only_with_one_gradient_slot_gets_it_and_agrees_too(
        arch, gpus, microbatches):
    # A capacity at the peak proven with one gradient slot per worker: the plan that runs
    # there has the tightest waits, and its proof is as tight. (One worker runs every
    # gradient job back to back; with more, the tiny models' peak is in a forward job.)
    free = compiled_for(arch, gpus, microbatches)
    bound = max(p.peak_bytes for p in tightest_peaks(free))
    assert bound < max(p.peak_bytes for p in free.memory)
    compiled = compiled_for(arch, gpus, microbatches, capacity_bytes=bound)
    assert compiled.plan.memory_waits == TIGHTEST_WAITS
    assert max(p.peak_bytes for p in compiled.memory) <= bound
    assert_agree(compiled.memory, *simulated_and_measured(compiled, gpus, microbatches))


def without_waits(compiled):
    """``compiled`` with its plan lowered without any memory-bounding wait."""
    compiled.plan = replace(compiled.plan, memory_waits=())
    compiled.schedule = runtime_schedule(compiled.plan,
                                         PlanOptions(gpus=compiled.workers,
                                                     microbatches=compiled.microbatches,
                                                     rounds=compiled.rounds, mode="sync"))
    compiled.memory = worker_peaks(compiled.schedule, compiled.plan)
    return compiled


@pytest.mark.parametrize("arch,gpus,microbatches", [("qwen3", 3, 4), ("llama", 3, 6)])
def test_without_the_waits_the_proof_still_bounds_the_run(arch, gpus, microbatches):
    # Without the memory-bounding waits transfers may start earlier and values stay longer:
    # the proof follows the schedule's remaining order and still bounds what the simulator
    # and the virtual workers reach over a stream of overlapping steps (with chaos delays on
    # the workers, too), but no longer within 5 %.
    compiled = without_waits(compiled_for(arch, gpus, microbatches))
    assert not any(e.kind in MEMORY_WAITS for e in compiled.schedule.edges)
    simulated, measured, _really = simulated_and_measured(compiled, gpus, microbatches, chaos=3)
    for got, bound in zip(simulated, compiled.memory):
        assert got <= bound.peak_bytes
    for got, bound in zip(measured, compiled.memory):
        assert got <= bound.held_bytes

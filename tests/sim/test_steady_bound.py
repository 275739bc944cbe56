"""The async steady-state bound (rpcompile.sim.steady_bound): hand-computed on a plan held by
the staleness chain, equal to the simulator's long-run replay where transfers and host work
are instant, and on RoundPipe's greedy Qwen3-1.7B partition the dispatch cycle that idles it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import UnitProfile
from rpcompile.planner.partition import build_plan
from rpcompile.sim import simulate_roundpipe, steady_bound, steady_step_ms, steady_steps

# Links, host memory and the optimizer fast enough that only the computes take time.
INSTANT = Hardware(name="instant", gpu="test", gpus=8, matmul_tflops=100.0, memory_gib=24.0,
                   h2d_gbps=1e6, d2h_gbps=1e6, host_mem_gbps=1e6,
                   optimizer_params_per_s=1e15, transfer_latency_us=0.0,
                   memory_reserve_gib=0.0)


def _unit(name: str, forward_ms: float, backward_ms: float) -> UnitProfile:
    return UnitProfile(name, forward_ms, backward_ms, 10**6, output_bytes=10**6)


def test_a_step_waits_for_the_gradients_of_the_step_two_before():
    # Three jobs per step (F 1 ms, T 2 ms, B 1 + 2 ms per microbatch), 2 microbatches, on 8
    # workers: the workers are never the limit. Step k uploads the shadow written from step
    # k-2's update, so two steps start per longest path of one step: every job's first
    # microbatch plus one more of the longest job, (1 + 2 + 3 + 3) / 2 = 4.5 ms per step.
    units = [_unit("prefix", 0.0, 0.0), _unit("layers.0", 1.0, 2.0), _unit("tail", 1.0, 1.0)]
    plan = build_plan(units, [0], [0], 2, INSTANT, 8, 2, 1, 2048)
    assert [s.compute_ms for s in plan.stages] == [1.0, 2.0, 3.0]
    b = steady_bound(plan)
    assert b.step_ms == pytest.approx(4.5, rel=1e-9)
    assert b.bubble == pytest.approx(1 - 2 * 6.0 / (8 * 4.5), rel=1e-9)
    assert b.stale and b.cycle_steps == 2
    assert b.cycle == ((0, 0, 2), (2, 0, 0), (2, 0, 1))  # B, then two steps later F, T, B
    r = simulate_roundpipe(plan, INSTANT, steps=steady_steps(plan), optimizer="async")
    assert steady_step_ms(r) == pytest.approx(4.5, rel=1e-4)


@pytest.mark.parametrize("workers,microbatches,rounds", [(3, 5, 1), (3, 4, 2), (2, 3, 3)])
def test_bound_is_the_long_run_step_of_a_replay(workers, microbatches, rounds):
    # Uneven stages on fewer workers than jobs: jobs wait for the worker's previous job and
    # for the wavefront of the job before them. The replay of the lowered schedule, with
    # every transfer and host action instant, settles on the bound.
    units = [_unit("prefix", 0.0, 0.0)]
    units += [_unit(f"layers.{i}", 1.0 + 0.3 * i, 2.0 + 0.5 * (i % 3)) for i in range(6)]
    units.append(_unit("tail", 2.0, 3.0))
    hw = replace(INSTANT, gpus=workers)
    plan = build_plan(units, [0, 2, 5], [0, 3, 5], 7, hw, workers, microbatches, 1, 2048,
                      rounds=rounds)
    b = steady_bound(plan, rounds=rounds)
    work = microbatches * rounds * sum(s.compute_ms for s in plan.stages) / workers
    assert b.step_ms > work * 1.02  # the waits, not the workers' share, set the pace
    assert "data" in b.edges
    r = simulate_roundpipe(plan, hw, steps=40, optimizer="async", rounds=rounds)
    assert steady_step_ms(r) == pytest.approx(b.step_ms, rel=1e-4)


def test_greedy_qwen3_partition_idles_where_its_short_jobs_free_a_worker_early():
    # RoundPipe's greedy partition of Qwen3-1.7B (docs/simulator.md): 15 jobs, two of them
    # short (stage 0: the prefix and one layer; stage 5: the last layer's backward alone).
    # The worker that runs a short job runs, eight jobs later, one that waits for the
    # wavefront of the job before it, so the critical cycle runs through neither short job
    # and the plan cannot reach its share of the workers, whatever the transfers.
    from rpcompile.planner.partition_baseline import partition_roundpipe
    from rpcompile.workloads.paper import MODELS, hop_hardware

    model = MODELS["qwen3-1.7b"]
    hw = hop_hardware(model)
    plan = partition_roundpipe(model.units(4, 2048), hw, 8, 16, 4, 2048)
    b = steady_bound(plan)
    work = 16 * sum(s.compute_ms for s in plan.stages) / 8
    assert b.step_ms == pytest.approx(2036.19, abs=0.01)
    assert b.step_ms > 1.09 * work
    assert not b.stale and b.cycle_steps == 6
    assert {s for _, _, s in b.cycle} == set(range(15)) - {0, 5}
    # The replay at the paper's hop, over the benchmarks' window, is at most 0.5 % above.
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
    assert b.step_ms <= steady_step_ms(r) <= 1.005 * b.step_ms


def test_counts_must_be_positive():
    units = [_unit("prefix", 0.0, 0.0), _unit("layers.0", 1.0, 2.0), _unit("tail", 1.0, 1.0)]
    plan = build_plan(units, [0], [0], 2, INSTANT, 8, 2, 1, 2048)
    with pytest.raises(InvalidInput, match="must be >= 1"):
        steady_bound(plan, rounds=0)
    with pytest.raises(InvalidInput, match="must be >= 1"):
        steady_bound(plan, workers=0)

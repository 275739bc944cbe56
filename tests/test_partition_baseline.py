"""RoundPipe's greedy partitioner (the baseline): hand-checked small cases."""

from __future__ import annotations

import pytest

from rpcompile.hardware import Hardware
from rpcompile.ir import UnitProfile
from rpcompile.planner.partition import PartitionError
from rpcompile.planner.partition_baseline import (
    WEIGHT_MEMORY_FRACTION,
    candidate_budgets,
    greedy_pack,
    partition_roundpipe,
)
from rpcompile.workloads.paper import MODELS

GIB = 2**30


def _hw(memory_gib: float = 24.0) -> Hardware:
    return Hardware(name="test", gpu="test", gpus=2, matmul_tflops=100.0, memory_gib=memory_gib,
                    h2d_gbps=25.0, d2h_gbps=25.0, host_mem_gbps=100.0,
                    optimizer_params_per_s=1e9)


def _unit(name: str, f: float, b: float, params: int = 1000) -> UnitProfile:
    return UnitProfile(name, forward_ms=f, backward_ms=b, trainable_params=params,
                       output_bytes=1024, working_bytes=4096)


def test_candidate_budgets_are_runs_within_ten_percent_of_the_costliest_unit():
    # W = 4; runs: 2 + 2.2 = 4.2 is inside [4, 4.4]; 2.2 + 4 and 2 + 2.2 + 4 are not.
    assert candidate_budgets([2.0, 2.2, 4.0]) == [4.0, 4.2]
    # 3 + 1 = 4 equals W (one candidate, not two); 1 + 2.5 = 3.5 is below W.
    assert candidate_budgets([3.0, 1.0, 2.5, 4.0]) == [4.0]
    # An explicit W (the forward side uses the whole model's costliest forward).
    assert candidate_budgets([1.0, 1.0, 1.0], costliest=2.0) == [2.0]
    with pytest.raises(ValueError):
        candidate_budgets([])


def test_greedy_pack_fills_from_the_last_unit():
    costs = [1.0, 0.05, 1.0, 0.05, 1.0, 0.05]
    big = 10**12
    # Budget 1.05: (u4, u5), (u2, u3), (u0, u1).
    assert greedy_pack(costs, [0] * 6, 1.05, big) == [0, 2, 4]
    # Budget 1: every pair overflows, one unit per stage.
    assert greedy_pack(costs, [0] * 6, 1.0, big) == [0, 1, 2, 3, 4, 5]
    # The weight limit cuts too: units of 6 bytes under a 10-byte limit go one per stage.
    assert greedy_pack([1.0] * 3, [6] * 3, 100.0, 10) == [0, 1, 2]
    # From the back, the short stage lands at the front: 5 units of cost 1 under budget 2.
    assert greedy_pack([1.0] * 5, [0] * 5, 2.0, big) == [0, 1, 3]


def test_objective_weighs_stage_count_against_workers():
    # Units alternate 1.0 and 0.05 before a tail of cost 1 (forward 0.4 + backward 0.6).
    # Backward side costs (f + b): [1, .05, 1, .05, 1, .05, 1]; W = 1, candidates 1 and 1.05.
    #  * T = 1: no pair fits, 7 stages. T = 1.05, from the back: (u5, tail), (u3, u4),
    #    (u1, u2), (u0): 4 stages.
    #  * 2 workers: max(7, 2) * 1 = 7 against max(4, 2) * 1.05 = 4.2 -> T = 1.05.
    #  * 8 workers: max(7, 8) * 1 = 8 beats max(4, 8) * 1.05 = 8.4 -> T = 1.
    costs = [1.0, 0.05, 1.0, 0.05, 1.0, 0.05]
    units = [_unit(f"u{i}", c / 2, c / 2) for i, c in enumerate(costs)]
    units.append(_unit("tail", 0.4, 0.6))
    plan2 = partition_roundpipe(units, _hw(), workers=2, microbatches=3)
    assert plan2.tail.units == (5, 6)
    assert [s.units for s in plan2.backward_stages[1:]] == [(3, 4), (1, 2), (0,)]
    plan8 = partition_roundpipe(units, _hw(), workers=8, microbatches=3)
    assert plan8.tail.units == (6,)
    assert [s.units for s in plan8.backward_stages[1:]] == [(5,), (4,), (3,), (2,), (1,), (0,)]


def test_hand_plan_forward_and_backward_sides():
    # Four layers (f=1, b=2) and a tail (f=2, b=4), 2 workers.
    # Backward side: costs [3,3,3,3,6], W = 6, only T = 6: tail (u4), then (u2,u3), (u0,u1).
    # Forward side over u0..u3: costs [1,1,1,1], W = max(1, tail forward 2) = 2, T = 2:
    # (u2,u3), (u0,u1).
    units = [_unit(f"layers.{i}", 1.0, 2.0) for i in range(4)] + [_unit("tail", 2.0, 4.0)]
    plan = partition_roundpipe(units, _hw(), workers=2, microbatches=4)
    plan.validate()
    assert [(s.kind, s.units) for s in plan.stages] == [
        ("forward", (0, 1)), ("forward", (2, 3)), ("tail", (4,)),
        ("backward", (2, 3)), ("backward", (0, 1)),
    ]
    # Stage times: forward = sum of forwards; tail and backward = forward + backward.
    assert [s.compute_ms for s in plan.stages] == [2.0, 2.0, 6.0, 6.0, 6.0]
    assert plan.notes and "roundpipe greedy" in plan.notes[0]


def test_weights_within_half_of_sixty_percent_of_gpu_memory():
    # 1 GiB GPU: the limit is 0.3 GiB of bf16 weights = 161_061_273 params at 2 bytes.
    limit_params = int(WEIGHT_MEMORY_FRACTION * GIB / 2)
    p = limit_params // 2 + 1  # two such units together exceed the limit
    units = [_unit(f"layers.{i}", 0.1, 0.1, params=p) for i in range(4)]
    units.append(_unit("tail", 1.0, 1.0, params=10))
    plan = partition_roundpipe(units, _hw(memory_gib=1.0), workers=2, microbatches=2)
    for s in plan.stages:
        assert s.weight_bytes <= WEIGHT_MEMORY_FRACTION * GIB
    # Without the memory rule the cheap layers (0.1 ms forward each against a 1 ms budget)
    # would share stages; with it no stage holds two of them. (The tail takes layers.3: 2.2 ms
    # is within 1.1 x the tail's 2 ms and saves a stage.)
    assert all(sum(u < 4 for u in s.units) == 1 for s in plan.stages)
    assert plan.tail.units == (3, 4)
    huge = [_unit("layers.0", 1.0, 1.0, params=limit_params + 1), _unit("tail", 1.0, 1.0)]
    with pytest.raises(PartitionError, match="half of 60%"):
        partition_roundpipe(huge, _hw(memory_gib=1.0), workers=2, microbatches=2)


def test_paper_model_plans_are_valid_and_cover_the_model():
    m = MODELS["llama3.1-8b"]
    plan = partition_roundpipe(m.units(4, 2048), "rtx4090x8", workers=8, microbatches=10)
    plan.validate()
    assert plan.tail.units[-1] == len(plan.units) - 1
    # The tail's cost (head + layers fused into it) is within 1.1x of the costliest unit's.
    w = max(u.forward_ms + u.backward_ms for u in plan.units)
    assert plan.tail.compute_ms <= 1.1 * w + 1e-9

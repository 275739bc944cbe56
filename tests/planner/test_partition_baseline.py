"""RoundPipe's greedy partitioner (the baseline): hand-checked small cases."""

from __future__ import annotations

import pytest

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.planner.partition import PartitionError, StageCosting
from rpcompile.planner.partition.search import _layer_starts
from rpcompile.planner.partition_baseline import (
    WEIGHT_MEMORY_FRACTION,
    candidate_budgets,
    greedy_cuts,
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


def _sides(plan) -> tuple[list[tuple[int, ...]], tuple[int, ...], list[tuple[int, ...]]]:
    """(forward stages, tail, backward stages after the tail) as unit tuples, in plan order."""
    fwd = [s.units for s in plan.stages if s.kind == "forward"]
    back = [s.units for s in plan.stages if s.kind == "backward"]
    return fwd, plan.tail.units, back


def test_candidate_budgets_are_runs_of_either_side_within_ten_percent_of_the_costliest():
    # W = 4; runs: 2 + 2.2 = 4.2 is inside [4, 4.4]; 2.2 + 4 and 2 + 2.2 + 4 are not.
    assert candidate_budgets([2.0, 2.2, 4.0]) == [4.0, 4.2]
    # 3 + 1 = 4 equals W (one candidate, not two); 1 + 2.5 = 3.5 is below W.
    assert candidate_budgets([3.0, 1.0, 2.5, 4.0]) == [4.0]
    # Two sides: W = 6 is the costliest of both; forward 2 + 2.2 + 2.1 = 6.3, backward
    # 3.25 + 3.2 = 6.45 and 3.2 + 3.3 = 6.5. A run never crosses from one side into the other
    # (3.0 + 3.25 = 6.25 would).
    budgets = candidate_budgets([2.0, 2.2, 2.1, 3.0], [3.25, 3.2, 3.3, 6.0])
    assert budgets == pytest.approx([6.0, 6.3, 6.45, 6.5])
    with pytest.raises(ValueError):
        candidate_budgets([])


def test_greedy_pack_fills_from_either_end():
    costs = [1.0, 0.05, 1.0, 0.05, 1.0, 0.05]
    big = 10**12
    # Budget 1.05: (u4, u5), (u2, u3), (u0, u1).
    assert greedy_pack(costs, [0] * 6, 1.05, big) == [0, 2, 4]
    # Budget 1: every pair overflows, one unit per stage.
    assert greedy_pack(costs, [0] * 6, 1.0, big) == [0, 1, 2, 3, 4, 5]
    # The size limit cuts too: units of 6 bytes under a 10-byte limit go one per stage.
    assert greedy_pack([1.0] * 3, [6] * 3, 100.0, 10) == [0, 1, 2]
    # 5 units of cost 1 under budget 2: from the back the short stage lands at the front,
    # from the front it lands at the back.
    assert greedy_pack([1.0] * 5, [0] * 5, 2.0, big) == [0, 1, 3]
    assert greedy_pack([1.0] * 5, [0] * 5, 2.0, big, from_last=False) == [0, 2, 4]


def _alternating_model() -> list[UnitProfile]:
    # Layers alternate heavy (forward 10, backward 10) and light (0.5, 0.5); the tail has
    # forward 8, backward 12. Backward costs (f + b): [20, 1, 20, 1, 20, 1, 20]; W = 20.
    units = [_unit(f"u{i}", *((10.0, 10.0) if i % 2 == 0 else (0.5, 0.5))) for i in range(6)]
    return [*units, _unit("tail", 8.0, 12.0)]


def test_one_budget_for_both_sides_and_the_objective_counts_all_jobs():
    # Candidates: 20 (W), backward runs 21 (20 + 1) and 22 (1 + 20 + 1), forward run 20.5
    # (10 + 0.5 + 10). Per budget: fused tail / forward stages (from the last unit) /
    # backward stages (from the first unit):
    #  * T = 20:   tail (u6) / (u3-u5), (u1, u2), (u0) / six single units: 10 jobs;
    #  * T = 20.5: tail (u6) / (u3-u5), (u0-u2) / six single units: 9 jobs;
    #  * T = 21:   tail (u5, u6) / (u1-u4), (u0) / (u0, u1), (u2, u3), (u4): 6 jobs;
    #  * T = 22:   as T = 21, 6 jobs.
    # 2 workers: 6 x 21 = 126 is the least.
    plan2 = partition_roundpipe(_alternating_model(), _hw(), workers=2, microbatches=3)
    plan2.validate()
    assert _sides(plan2) == ([(0,), (1, 2, 3, 4)], (5, 6), [(4,), (2, 3), (0, 1)])
    assert "budget 21.00 ms" in plan2.notes[0]
    # 9 workers: max(10, 9) x 20 = 200, 9 x 20.5 = 184.5, 9 x 21 = 189, 9 x 22 = 198. The
    # forward jobs count: without them T = 20 would win (max(7, 9) x 20 = 180).
    plan9 = partition_roundpipe(_alternating_model(), _hw(), workers=9, microbatches=3)
    assert _sides(plan9) == ([(0, 1, 2), (3, 4, 5)], (6,), [(5,), (4,), (3,), (2,), (1,), (0,)])
    assert "budget 20.50 ms" in plan9.notes[0]
    # 12 workers: max(jobs, 12) is 12 for every budget, so the smallest budget wins.
    plan12 = partition_roundpipe(_alternating_model(), _hw(), workers=12, microbatches=3)
    assert _sides(plan12) == ([(0,), (1, 2), (3, 4, 5)], (6,),
                              [(5,), (4,), (3,), (2,), (1,), (0,)])
    assert "budget 20.00 ms" in plan12.notes[0]


def test_forward_stages_hold_about_three_times_the_layers_of_backward_stages():
    # Four layers (f=1, b=2) and a tail (f=2, b=4), 2 workers. Forward costs [1,1,1,1,2],
    # backward [3,3,3,3,6]; W = 6 and the only budget. The tail stays alone (6 + 3 > 6), the
    # four forwards fit one stage (4 <= 6), the backward side takes two layers a stage.
    units = [_unit(f"layers.{i}", 1.0, 2.0) for i in range(4)] + [_unit("tail", 2.0, 4.0)]
    plan = partition_roundpipe(units, _hw(), workers=2, microbatches=4)
    plan.validate()
    assert [(s.kind, s.units) for s in plan.stages] == [
        ("forward", (0, 1, 2, 3)), ("tail", (4,)), ("backward", (2, 3)), ("backward", (0, 1)),
    ]
    # Stage times: forward = sum of forwards; tail and backward = forward + backward.
    assert [s.compute_ms for s in plan.stages] == [4.0, 6.0, 6.0, 6.0]
    assert plan.notes and "roundpipe greedy" in plan.notes[0]


def test_backward_stages_count_weights_and_gradients_within_half_of_sixty_percent():
    # 1 GiB GPU: a stage may hold 0.3 GiB. Each layer's bf16 weights take a bit over a third
    # of it, weights and gradients a bit over two thirds: forward stages fit two layers, not
    # three; backward stages one, not two.
    limit = WEIGHT_MEMORY_FRACTION * GIB
    p = int(limit / 6) + 1
    units = [_unit(f"layers.{i}", 0.125, 0.125, params=p) for i in range(4)]
    units.append(_unit("tail", 1.0, 1.5, params=10))
    plan = partition_roundpipe(units, _hw(memory_gib=1.0), workers=2, microbatches=2)
    plan.validate()
    # Costs alone would put every layer in one stage per side. Budgets 2.5 (the tail) and
    # 2.75 (tail + one layer); 2.75 gives 6 jobs against 7 and wins.
    assert _sides(plan) == ([(0,), (1, 2)], (3, 4), [(2,), (1,), (0,)])
    for s in plan.stages:
        assert s.weight_bytes <= limit
    # A layer whose weights fit but whose weights and gradients do not is refused; the same
    # layer frozen (no gradient) is placed.
    big = int(limit / 4) + 1
    huge = [_unit("layers.0", 1.0, 1.0, params=big), _unit("tail", 1.0, 1.0)]
    with pytest.raises(PartitionError, match="weights and gradients"):
        partition_roundpipe(huge, _hw(memory_gib=1.0), workers=2, microbatches=2)
    frozen = UnitProfile("layers.0", forward_ms=1.0, backward_ms=1.0, trainable_params=0,
                         frozen_params=big, output_bytes=1024, working_bytes=4096)
    plan = partition_roundpipe([frozen, _unit("tail", 1.0, 1.0)], _hw(memory_gib=1.0),
                               workers=2, microbatches=2)
    assert _sides(plan)[1] == (1,)


def test_qwen3_1_7b_gets_roundpipe_s_stage_counts():
    # The paper's layer times on 8x RTX 4090, microbatches of 4 x 2048 (units: prefix, 28
    # layers, tail). RoundPipe's own partition has 4 forward stages of 7 layers and 11
    # backward stages (the LM head alone, 8 x 3 layers, 2, 2). The rule gives the same
    # counts, but with the table's 7.43 ms forward a 69.78 ms budget (3 backward layers)
    # fits 9 forward layers, so the remainder gathers in one short stage on each side:
    # forward prefix + 1 layer, then 9, 9, 9; backward the LM head, 1 layer, then 9 x 3
    # with the prefix in the last.
    plan = partition_roundpipe(MODELS["qwen3-1.7b"].units(4, 2048), "rtx4090x8", workers=8,
                               microbatches=16)
    plan.validate()
    fwd, tail, back = _sides(plan)
    assert [s[0] for s in fwd] == [0, 2, 11, 20]
    assert tail == (29,)
    assert [s[0] for s in back] == [28, 25, 22, 19, 16, 13, 10, 7, 4, 0]
    assert "budget 69.78 ms" in plan.notes[0]


def test_paper_model_plans_are_valid_and_cover_the_model():
    m = MODELS["llama3.1-8b"]
    plan = partition_roundpipe(m.units(4, 2048), "rtx4090x8", workers=8, microbatches=10)
    plan.validate()
    assert plan.tail.units[-1] == len(plan.units) - 1
    # The tail's cost (head + layers fused into it) is within 1.1x of the costliest unit's.
    w = max(u.forward_ms + u.backward_ms for u in plan.units)
    assert plan.tail.compute_ms <= 1.1 * w + 1e-9


def test_greedy_cuts_on_a_grid_pack_its_pieces_as_units():
    # Qwen3-1.7B as attention and MLP blocks, cut only where a layer starts: the rule packs
    # each layer as one unit of its blocks' summed costs, so the cut is the whole-layer cut.
    model = MODELS["qwen3-1.7b"]
    hw, costing = get_hardware("rtx4090x8"), StageCosting()
    layers, blocks = model.units(4, 2048), model.units(4, 2048, split_layers=True)
    starts = _layer_starts(blocks)
    whole = greedy_cuts(layers, hw, 8, costing)
    cut = greedy_cuts(blocks, hw, 8, costing, starts)

    def on_blocks(units):
        return tuple(starts[u] for u in units)

    assert cut.forward_starts == on_blocks(whole.forward_starts)
    assert cut.backward_starts == on_blocks(whole.backward_starts)
    assert cut.tail_start == starts[whole.tail_start]
    assert cut.budget_ms == pytest.approx(whole.budget_ms)
    # Anywhere (no grid) the same rule may split a layer, and does here.
    anywhere = greedy_cuts(blocks, hw, 8, costing)
    assert not set(anywhere.forward_starts) | set(anywhere.backward_starts) <= set(starts)
    with pytest.raises(ValueError, match="stage starts"):
        greedy_cuts(blocks, hw, 8, costing, starts[1:])

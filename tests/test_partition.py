"""Our partitioner: exact cuts against brute force, block units, simulator refinement."""

from __future__ import annotations

import itertools
import random

import pytest

from rpcompile.ir import UnitProfile
from rpcompile.paper import MODELS
from rpcompile.passes.partition import (
    StageCosting,
    _all_cuts,
    _layer_starts,
    _tail_starts,
    partition,
)
from rpcompile.sim import simulate_roundpipe, steady_step_ms


def _brute_force(cost, k, starts):
    """min over all cuts of ``cost`` into k contiguous parts beginning at ``starts`` of the
    largest part."""
    best = float("inf")
    for inner in itertools.combinations([s for s in starts if s > 0], k - 1):
        edges = [0, *inner, len(cost)]
        best = min(best, max(sum(cost[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_min_max_cuts_match_brute_force_on_any_grid(seed):
    rng = random.Random(seed)
    cost = [rng.uniform(1, 10) for _ in range(9)]
    units = [UnitProfile(f"u{i}", forward_ms=c, backward_ms=0.0, trainable_params=1)
             for i, c in enumerate(cost)]
    for starts in (None, [0, 2, 3, 5, 8]):
        grid = starts or list(range(len(cost)))
        cuts = _all_cuts(units, cost, "backward", StageCosting(), limit=2**40, span=10,
                         starts=starts)
        assert set(cuts) == set(range(1, len(grid) + 1))
        for k, (value, bounds) in cuts.items():
            assert value == pytest.approx(_brute_force(cost, k, grid))
            assert bounds[0] == 0 and set(bounds) <= set(grid) and len(bounds) == k
            edges = [*bounds, len(cost)]
            assert max(sum(cost[a:b]) for a, b in itertools.pairwise(edges)) == pytest.approx(value)


def test_block_units_keep_the_layer_totals():
    for model in MODELS.values():
        layers = model.units(4, 2048)
        blocks = model.units(4, 2048, split_layers=True)
        assert len(blocks) == len(layers) + model.layers
        for field in ("params", "trainable_params", "working_bytes"):
            assert sum(getattr(u, field) for u in blocks) == sum(getattr(u, field) for u in layers)
        for field in ("forward_ms", "backward_ms"):
            assert sum(getattr(u, field) for u in blocks) == pytest.approx(
                sum(getattr(u, field) for u in layers))
        assert [u.group for u in blocks[1:3]] == ["layers.0", "layers.0"]
        assert _layer_starts(blocks) == [0, *range(1, len(blocks) - 1, 2), len(blocks) - 1]


def test_attention_share_by_hand_for_qwen3_1_7b():
    # Per token: q, o 2048x2048, k, v 2048x1024 -> 2 x 12,582,912 FLOPs; scores and values
    # 2 x 2 x 2048 (q width) x 2048 / 2 (causal) = 8,388,608; MLP 3 x 2048 x 6144 x 2.
    attn = 2 * (2 * 2048 * 2048 + 2 * 2048 * 1024) + 2 * 2048 * 2048
    mlp = 2 * 3 * 2048 * 6144
    assert MODELS["qwen3-1.7b"].attention_share(2048) == pytest.approx(attn / (attn + mlp))


def test_tail_may_take_up_to_three_layers_of_blocks():
    blocks = MODELS["qwen3-1.7b"].units(1, 512, split_layers=True)
    n = len(blocks)
    assert _tail_starts(blocks, 3) == list(range(n - 1, n - 8, -1))  # tail + 6 blocks
    layers = MODELS["qwen3-1.7b"].units(1, 512)
    assert _tail_starts(layers, 3) == [len(layers) - k for k in range(1, 5)]


def test_block_plan_is_no_slower_than_the_layer_plan_and_refinement_only_helps():
    model = MODELS["qwen3-1.7b"]
    args = ("rtx4090x8", 4, 8, 1, 2048)
    layers = partition(model.units(1, 2048), *args, shortlist=100, refine=0)
    blocks = partition(model.units(1, 2048, split_layers=True), *args, shortlist=100, refine=0)
    refined = partition(model.units(1, 2048, split_layers=True), *args, shortlist=100,
                        refine=8, target_bubble=0.0)
    assert blocks.predicted_step_ms <= layers.predicted_step_ms * (1 + 1e-9)
    assert refined.predicted_step_ms <= blocks.predicted_step_ms * (1 + 1e-9)
    # The plan's figure is the simulator's steady state, re-simulated here independently.
    result = simulate_roundpipe(refined, "rtx4090x8", steps=4, optimizer="async")
    assert steady_step_ms(result) == pytest.approx(refined.predicted_step_ms)
    if refined.stages != blocks.stages:
        assert any("refined in the simulator" in note for note in refined.notes)

"""Our partitioner: exact cuts against brute force, block units, the local search on the
simulator's lower bound, simulator refinement, and the steady-state measure they are judged
by."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from rpcompile.hardware import get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import async_update_order
from rpcompile.passes.schedule import dispatch_period, roundpipe_jobs, steady_window
from rpcompile.planner.bound import simulated_lower_bound, steady_estimate
from rpcompile.planner.partition import (
    StageCosting,
    build_plan,
    fit_memory_waits,
    partition,
)
from rpcompile.planner.partition import search as search_module
from rpcompile.planner.partition.cuts import _all_cuts
from rpcompile.planner.partition.local import _balance, _bounds, _refine, _search, class_bound
from rpcompile.planner.partition.search import _layer_starts, _tail_starts
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps, steady_utilization
from rpcompile.workloads.paper import MODELS, hop_hardware


def _brute_force(cost, k, starts):
    """min over all cuts of ``cost`` into k contiguous parts beginning at ``starts`` of the
    largest part."""
    best = float("inf")
    for inner in itertools.combinations([s for s in starts if s > 0], k - 1):
        edges = [0, *inner, len(cost)]
        best = min(best, max(sum(cost[a:b]) for a, b in itertools.pairwise(edges)))
    return best


def _cuts_on_each_grid(cost, span):
    """(grid, _all_cuts) of units costing ``cost`` on the unit grid and on a coarser one."""
    units = [UnitProfile(f"u{i}", forward_ms=c, backward_ms=0.0, trainable_params=1)
             for i, c in enumerate(cost)]
    for starts in (None, [0, 2, 3, 5, 8]):
        yield starts or list(range(len(cost))), _all_cuts(
            units, cost, "backward", StageCosting(), limit=2**40, span=span, starts=starts)


@pytest.mark.parametrize("seed", range(4))
def test_min_max_cuts_match_brute_force_on_any_grid(seed):
    rng = random.Random(seed)
    cost = [rng.uniform(1, 10) for _ in range(9)]
    for grid, cuts in _cuts_on_each_grid(cost, span=10):
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
    args = ("rtx4090x8", PlanOptions(gpus=4, microbatches=8, mode="async"))
    size = dict(microbatch_size=1, seq_len=2048)
    layers = partition(model.units(1, 2048), *args, **size, shortlist=100, refine=0)
    blocks = partition(model.units(1, 2048, split_layers=True), *args, **size, shortlist=100,
                       refine=0)
    refined = partition(model.units(1, 2048, split_layers=True), *args, **size, shortlist=100,
                        refine=8, target_bubble=0.0)
    assert blocks.predicted_step_ms <= layers.predicted_step_ms * (1 + 1e-9)
    assert refined.predicted_step_ms <= blocks.predicted_step_ms * (1 + 1e-9)
    # The plan's figure is the simulator's steady state, re-simulated here independently.
    result = simulate_roundpipe(refined, "rtx4090x8", steps=steady_steps(refined),
                                optimizer="async")
    assert steady_step_ms(result) == pytest.approx(refined.predicted_step_ms)
    if refined.stages != blocks.stages:
        assert any(("refined in the simulator" in note or "balanced in the simulator" in note)
                   for note in refined.notes)


def test_cuts_always_include_every_grid_piece_its_own_stage():
    # A span of stage counts that stops short of the finest cut still returns it: the cut a
    # search on that grid alone ends at when its coarser cuts do not fit.
    cost = [float(c) for c in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)]
    for grid, cuts in _cuts_on_each_grid(cost, span=2):
        assert set(cuts) == {1, 2, len(grid)}
        value, bounds = cuts[len(grid)]
        assert bounds == tuple(grid)
        edges = [*grid, len(cost)]
        assert value == pytest.approx(max(sum(cost[a:b]) for a, b in itertools.pairwise(edges)))


def test_block_search_is_no_slower_than_the_whole_layer_search():
    # Qwen3-235B-A22B cut to 48 layers, 4 GPUs, 8 microbatches, sync, capped at 4
    # replays per grid. The whole-layer search's coarse candidates do not fit over the whole
    # schedule, so it cuts again under lower stage limits and returns one layer per stage;
    # the block search's fine candidates fit, and its whole-layer grid never reached that
    # stage count (4 x workers counts from the fewest). Its candidates replayed must cover
    # the whole-layer plans, so its plan is no slower (by the simulator) than the other's.
    model = replace(MODELS["qwen3-235b-a22b"], layers=48)
    hw = hop_hardware(model, 4 * 2048)
    args = (hw, PlanOptions(gpus=4, microbatches=8, mode="sync", max_simulations=4))
    caps = {"microbatch_size": 4, "seq_len": 2048, "refine": 0}
    layers = partition(model.units(4, 2048), *args, **caps)
    blocks = partition(model.units(4, 2048, split_layers=True), *args, **caps)
    assert blocks.predicted_step_ms <= layers.predicted_step_ms * (1 + 1e-9)


@pytest.mark.parametrize(("jobs", "workers"), [(31, 8), (30, 8), (28, 8), (32, 8), (6, 4), (7, 3)])
def test_dispatch_period_matches_the_job_list(jobs, workers):
    period = dispatch_period(jobs, workers)
    assert period == {(31, 8): 8, (30, 8): 4, (28, 8): 2, (32, 8): 1, (6, 4): 2, (7, 3): 3}[
        (jobs, workers)]
    # Independent check on the dealt jobs: step k and step k + period put every stage on the
    # same worker, and no shorter shift does.
    dealt = {(s, k): w for w, s, _r, k in roundpipe_jobs(jobs, workers, 1, 2 * period + 1)}
    same = [all(dealt[s, 0] == dealt[s, d] for s in range(jobs)) for d in range(1, period + 1)]
    assert same == [False] * (period - 1) + [True]
    # A steady-state window is whole periods and at least 8 steps.
    assert steady_window(jobs, workers) == {3: 9}.get(period, 8)


def _toy_units(n: int, seed: int) -> list[UnitProfile]:
    rng = random.Random(seed)
    units = [UnitProfile("prefix", 0.0, 0.0, 1000, output_bytes=10**6)]
    units += [UnitProfile(f"layers.{i}", rng.uniform(2, 8), rng.uniform(6, 20), 10**6,
                          output_bytes=10**6) for i in range(n)]
    return [*units, UnitProfile("tail", 6.0, 12.0, 10**6)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_built_plan_is_timed_by_its_modes_bound_on_the_simulator(mode):
    """Until it is replayed, a plan's predicted step is the planner's figure for its
    optimizer mode: sync, a lower bound on one step's makespan, within 5 %; async, the
    relaxed replay of overlapping steps (steady_estimate: each worker's compute order,
    each value's least hop, and each step's jobs after the host queue's rewrite of the
    shadow they upload, from the gradients of two steps before), within 10 % of the steady-state step over
    steady_steps overlapping steps and at least the mode's bound. The other mode's figure
    is not that close (here a sync step's fill, drain and updates cost far more than an
    async steady step)."""
    hw = get_hardware("rtx4090x8")
    units = MODELS["qwen3-1.7b"].units(4, 2048)
    other = {"sync": "async", "async": "sync"}[mode]
    # 9 jobs on 8 workers (period 8), 10 (period 4), and 8: each worker runs one stage,
    # the forward workers' short jobs wait for the shadow, not for each other (an estimate
    # blind to that wait runs them ahead and misses the steady step by a third).
    for fwd, bwd in (([0, 10, 20], [0, 6, 12, 18, 24]), ([0, 10, 20], [0, 5, 10, 15, 20, 24]),
                     ([0, 10, 20], [0, 7, 14, 21])):
        plan = replace(build_plan(units, fwd, bwd, 29, hw, 8, 9, 4, 2048, optimizer=mode),
                       memory_waits=())
        steps = 1 if mode == "sync" else steady_steps(plan)
        run = simulate_roundpipe(plan, hw, steps=steps, optimizer=mode)
        figure = run.makespan_ms if mode == "sync" else steady_step_ms(run)
        if mode == "sync":
            assert plan.predicted_step_ms <= figure <= 1.05 * plan.predicted_step_ms
        else:
            assert simulated_lower_bound(plan, hw, 1, mode) <= plan.predicted_step_ms
            assert abs(figure - plan.predicted_step_ms) <= 0.10 * figure, (
                plan.predicted_step_ms, figure)
        other_ms = build_plan(units, fwd, bwd, 29, hw, 8, 9, 4, 2048,
                              optimizer=other).predicted_step_ms
        assert not other_ms <= figure <= 1.05 * other_ms, (mode, other_ms, figure)
        work = 9 * sum(st.compute_ms for st in plan.stages) / 8
        assert plan.predicted_step_ms >= work * (1 - 1e-9)


@pytest.mark.parametrize("rate", [1e9, 3e8])
def test_the_async_estimate_follows_a_host_queue_that_paces_the_steps(rate):
    """With a CPU optimizer of ``rate`` parameters/s, Qwen3-1.7B's updates take longer than
    a step's compute spread over the workers, so the host queue paces the overlapping steps
    (its replay idles the workers 56 % or 84 % of the window). steady_estimate runs the host
    queue in the lowering's order (async_update_order, checked here against the lowered
    schedule, the tied embedding's update included): within 5 % of the replay; from the
    compute streams alone it would be 1.4 to 5x short."""
    hw = replace(get_hardware("rtx4090x8"), optimizer_params_per_s=rate)
    units = MODELS["qwen3-1.7b"].units(4, 2048)
    for fwd, bwd in (([0, 10, 20], [0, 6, 12, 18, 24]), ([0, 10, 20], [0, 7, 14, 21])):
        plan = replace(build_plan(units, fwd, bwd, 29, hw, 8, 9, 4, 2048, optimizer="async"),
                       memory_waits=())
        run = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
        figure = steady_step_ms(run)
        assert 1 - steady_utilization(run) > 0.5  # the host queue paces the steps
        assert abs(figure - plan.predicted_step_ms) <= 0.05 * figure, (
            plan.predicted_step_ms, figure)
        lowered = [(a.kind, a.stage) for a in run.schedule.host
                   if a.step == 1 and a.kind in ("OPT", "SHADOW")]
        assert lowered == [(kind, s) for opt, shadows in async_update_order(plan)
                           for kind, s in (("OPT", opt), *(("SHADOW", x) for x in shadows))]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_search_finds_the_bounds_optimum_of_a_small_model(mode):
    """The local search, scored by the plans' predicted step (the bound, as the partitioner
    builds them), reaches the best of all 224 plans of its stage counts within a quarter of
    them."""
    units = _toy_units(8, 1)
    tail = len(units) - 1

    def make(fwd, bwd, t, notes=()):
        return build_plan(units, fwd, bwd, t, "rtx4090x8", 4, 6, 1, 2048, notes=notes,
                          optimizer=mode)

    # Brute force over every plan with 2 forward and 3 backward stages (224 of them).
    every = [make((0, a), (0, b, c), tail)
             for a in range(1, tail) for b, c in itertools.combinations(range(1, tail), 2)]
    best = min(round(p.predicted_step_ms, 6) for p in every)
    seed = make((0, 1), (0, 1, 2), tail)
    assert seed.predicted_step_ms > best
    found = _search([seed], make, limit=2**40, budget=len(every) // 4, rng=random.Random(0),
                    grid=range(len(units)))
    assert found[0].predicted_step_ms == pytest.approx(best)
    assert [len(_bounds(p)[0]) for p in found] == [2] * len(found)  # stage counts kept


def test_search_keeps_its_budget_and_the_memory_limit():
    units = _toy_units(8, 2)
    tail = len(units) - 1
    built = []

    def make(fwd, bwd, t, notes=()):
        built.append((fwd, bwd))
        return build_plan(units, fwd, bwd, t, "rtx4090x8", 4, 6, 1, 2048, notes=notes)

    seed = make((0, 4), (0, 3, 6), tail)
    limit = max(st.peak_bytes for st in seed.stages)  # no stage may grow past the seed's
    found = _search([seed], make, limit=limit, budget=30, rng=random.Random(0),
                    grid=range(len(units)))
    assert len(built) <= 1 + 30
    assert found and all(st.peak_bytes <= limit for p in found for st in p.stages)
    again = _search([seed], make, limit=limit, budget=30, rng=random.Random(0),
                    grid=range(len(units)))
    assert [_bounds(p) for p in again] == [_bounds(p) for p in found]  # repeatable
    even = [u for u in range(len(units)) if u % 2 == 0 or u == tail]
    on_grid = make((0, 4), (0, 2, 6), tail)
    on_even = _search([on_grid], make, limit=2**40, budget=30, rng=random.Random(0), grid=even)
    assert all(set(f) | set(b) <= set(even) for f, b, _t in map(_bounds, on_even))


def test_steady_window_skips_the_warm_up_steps():
    units = _toy_units(10, 3)
    plan = build_plan(units, [0, 4, 8], [0, 4, 8], 11, "rtx4090x8", 4, 6, 1, 2048)
    steps = steady_steps(plan)
    assert steps == 8 + 3
    r = simulate_roundpipe(plan, "rtx4090x8", steps=steps, optimizer="async")
    # By hand from the timeline: busy time between the first compute of step 2 and the
    # first compute of the last step.
    computes = [a for lst in r.schedule.actions for a in lst if a.is_compute]
    lo = min(r.timeline[a][0] for a in computes if a.step == 2)
    hi = min(r.timeline[a][0] for a in computes if a.step == steps - 1)
    busy = sum(max(0.0, min(r.timeline[a][1], hi) - max(r.timeline[a][0], lo))
               for a in computes)
    assert steady_utilization(r) == pytest.approx(busy / ((hi - lo) * 4))
    assert steady_utilization(r) > sum(r.busy_ms) / (r.makespan_ms * 4)  # fill, drain left out
    with pytest.raises(ValueError, match="warmup_steps"):
        steady_utilization(r, warmup_steps=steps - 1)
    one = simulate_roundpipe(plan, "rtx4090x8", steps=2, optimizer="async")
    for measure in (steady_utilization, steady_step_ms):
        with pytest.raises(ValueError, match="no steady-state window"):
            measure(one, warmup_steps=1)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_search_scores_by_the_bound_of_the_run_it_plans(monkeypatch, mode):
    """Every plan the partitioner's local search scores carries, as its predicted step, the
    planner's figure for the planned run (its mode and rounds; sync: the simulator's lower
    bound, async: steady_estimate): the figure the replays are then ordered by, so the
    search and the replay order rank candidates alike."""
    hw = get_hardware("rtx4090x8")
    units = _toy_units(6, 4)
    scored = []
    real = search_module._search

    def recording(seeds, make, *args, **kwargs):
        def making(*a):
            plan = make(*a)
            scored.append(plan)
            return plan
        return real(seeds, making, *args, **kwargs)

    monkeypatch.setattr(search_module, "_search", recording)
    partition(units, hw, PlanOptions(gpus=3, microbatches=4, rounds=2, mode=mode), refine=0,
              search=30)
    assert len(scored) > 5
    # Sync: the bound; async: the relaxed replay of overlapping steps (steady_estimate).
    def figure(plan, rounds):
        return steady_estimate(plan, hw, rounds) if mode == "async" else \
            simulated_lower_bound(plan, hw, rounds, mode)

    for plan in scored:
        assert plan.predicted_step_ms == figure(plan, 2)
    assert any(figure(p, 1) != p.predicted_step_ms for p in scored)


def test_async_search_is_no_slower_than_roundpipes_greedy_partition():
    """RoundPipe's greedy partition is a candidate the search always replays, so its async
    plan is never slower in the simulator than the rule it is measured against. Here the
    first unit's backward sets the greedy budget, every layer fits under it in the fused
    tail (no recompute for them), and that cut, outside the search's own candidates (a tail
    of at most three layers), is the fastest."""
    hw = get_hardware("rtx4090x8")

    def unit(name, forward_ms, backward_ms):
        return UnitProfile(name, forward_ms, backward_ms, 1000, output_bytes=2**20,
                           working_bytes=2**20)

    units = [unit("embed", 30.0, 100.0), *(unit(f"layers.{i}", 6.0, 12.0) for i in range(6)),
             unit("head", 6.0, 6.0)]
    greedy = fit_memory_waits(partition_roundpipe(units, hw, 3, 3), hw)[0]
    assert greedy.tail.units == tuple(range(1, 8))
    greedy_ms = steady_step_ms(simulate_roundpipe(greedy, hw, steps=steady_steps(greedy),
                                                  optimizer="async"))
    plan = partition(units, hw, PlanOptions(gpus=3, microbatches=3, mode="async"))
    assert plan.predicted_step_ms <= greedy_ms * (1 + 1e-9)
    assert plan.tail.units == greedy.tail.units


def _halves(layers: int) -> list[UnitProfile]:
    """A model of attention and MLP blocks (1 : 3 in time), its tail as long as one layer:
    stage times come in few sizes, so the worker classes of round-robin dispatch are easy
    to unbalance and hard to balance with one boundary moved at a time."""
    units = [UnitProfile("prefix", 0.0, 0.0, 1000, output_bytes=10**6)]
    for i in range(layers):
        units += [UnitProfile(f"layers.{i}.{kind}", fwd, bwd, 10**6, output_bytes=10**6,
                              group=f"layers.{i}")
                  for kind, fwd, bwd in (("attn", 10.0, 30.0), ("mlp", 30.0, 90.0))]
    return [*units, UnitProfile("tail", 40.0, 80.0, 10**6)]


# (forward starts, backward starts) of plans the refinement cannot improve, and how the
# class-balancing step improves them: re-cut with one forward stage more (10 jobs a step on
# 4 workers, two classes of which one runs the longer jobs, become 11: one class), or with
# runs of boundaries shifted together on both sides (14 jobs, stage counts kept).
_UNBALANCED = {
    "forward count": (((0,), (0, 3, 5, 8, 9, 11, 13, 15)), 0.25),
    "runs": (((0, 6, 10, 13), (0, 2, 3, 5, 7, 9, 11, 13, 15)), 0.75),
}


@pytest.mark.parametrize("case", sorted(_UNBALANCED))
def test_class_balancing_reaches_what_single_boundary_moves_cannot(case):
    """From each plan no single boundary moved by 1 or 2 units shortens the simulated steady
    state (the refinement returns it unchanged, and it keeps stage counts); the
    class-balancing step finds a plan whose steady-state bubble, simulated here on its own,
    is at most ``ratio`` of the plan's, and whose busiest worker class has no more compute
    (less, where the stage count changes the classes). No steady step is shorter than that
    class's compute (class_bound). Repeatable, and within its cap of runs."""
    (fwd, bwd), ratio = _UNBALANCED[case]
    hw = get_hardware("rtx4090x8")
    units = _halves(8)
    tail, workers, microbatches = len(units) - 1, 4, 8
    figures = search_module._StageFigures(units, StageCosting())
    cap = limit = hw.usable_memory_bytes

    def make(fwd, bwd, t, notes=()):
        return figures.plan(fwd, bwd, t, hw, workers, microbatches, 1, 2048, 1, notes, "async")

    def recut(count, t):  # the forward side's min-max cut into ``count`` stages
        cost = [u.forward_ms for u in units[:t]]
        cut = _all_cuts(units, cost, "forward", StageCosting(), limit, 8).get(count)
        return None if cut is None else cut[1]

    def simulated(plan):  # (steady step, bubble) of the simulator alone
        result = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
        return steady_step_ms(result), 1 - steady_utilization(result)

    def busiest(plan):
        return class_bound([s.compute_ms for s in plan.stages], workers, microbatches)

    (ms, bubble, _peaks), plan = search_module._simulated_ms(make(fwd, bwd, tail), hw, 1,
                                                            "async", cap)
    plan = replace(plan, predicted_step_ms=ms)
    assert _refine(plan, bubble, make, hw, 1, limit, cap, 16, 0.0) == (plan, bubble)
    balanced = _balance(plan, bubble, make, figures.job_ms, recut, hw, 1, limit, cap, 4, 0.0)
    assert _balance(plan, bubble, make, figures.job_ms, recut, hw, 1, limit, cap, 4,
                    0.0) == balanced
    base_step, base_bubble = simulated(plan)
    step, steady_bubble = simulated(balanced)
    assert base_bubble == pytest.approx(bubble)
    assert step == pytest.approx(balanced.predicted_step_ms) and step < base_step
    assert steady_bubble < ratio * base_bubble
    fwd2, bwd2, _t = _bounds(balanced)
    if case == "forward count":
        assert (len(fwd2), bwd2) == (len(fwd) + 1, bwd)
        assert busiest(balanced) < busiest(plan)
    else:
        assert (len(fwd2), len(bwd2)) == (len(fwd), len(bwd))
        assert sum(a != b for a, b in zip(bwd, bwd2, strict=True)) >= 2  # a run moved
        assert busiest(balanced) <= busiest(plan)
    for p, ms in ((plan, base_step), (balanced, step)):
        assert busiest(p) <= ms
    note = balanced.notes[-1]
    assert note.startswith("worker classes balanced in the simulator")
    assert 1 <= int(note.split(", ")[1].split(" run")[0]) <= 4


@pytest.mark.parametrize("target", [0.0, 1.0])
def test_class_balancing_runs_only_above_the_target_bubble(monkeypatch, target):
    """The step runs after the refinement, and only while the plan's steady-state bubble is
    above ``target_bubble``: a plan already below it (every paper workload's but
    GPT-OSS-20B's) is the plan the refinement left."""
    calls = []
    real = search_module._balance

    def recording(plan, bubble, *args):
        calls.append(bubble)
        return real(plan, bubble, *args)

    monkeypatch.setattr(search_module, "_balance", recording)
    units = _halves(3)
    options = PlanOptions(gpus=4, microbatches=4, mode="async", progress=False)
    args = dict(microbatch_size=1, seq_len=2048, shortlist=4, search=0, refine=1,
                target_bubble=target)
    plan = partition(units, "rtx4090x8", options, **args)
    if target == 1.0:
        assert calls == []
        assert plan == partition(units, "rtx4090x8", options, **args, balance=0)
        assert not any(n.startswith("worker classes") for n in plan.notes)
    else:
        assert len(calls) == 1 and calls[0] > target
        assert any(n.startswith("worker classes") for n in plan.notes)

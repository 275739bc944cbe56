"""Simulator: tiny hand-made schedules with hand-computed times, contention, determinism,
bubble split, and the baseline figures of the RoundPipe paper (shared/REFERENCE.md)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import STEPS_IN_FLIGHT, Action, Edge, Schedule, Stage, UnitProfile
from rpcompile.passes.lower import lower
from rpcompile.passes.schedule import build_schedule
from rpcompile.planner.partition import build_plan
from rpcompile.sim import (
    SimulationError,
    compute_times,
    pipeline_stages,
    simulate,
    simulate_roundpipe,
    steady_step_ms,
    steady_utilization,
)
from rpcompile.workloads.paper import MODELS

MB25 = 25_000_000  # bytes one 25 GB/s link moves in 1 ms


def _hw(host_gbps: float = 1e6, **kw) -> Hardware:
    fields = dict(name="test", gpu="test", gpus=2, matmul_tflops=100.0, memory_gib=24.0,
                  h2d_gbps=25.0, d2h_gbps=25.0, host_mem_gbps=host_gbps,
                  optimizer_params_per_s=1e9, transfer_latency_us=0.0, memory_reserve_gib=0.0)
    fields.update(kw)
    return Hardware(**fields)


def _stage(i: int, kind: str, ms: float, weight: int = 0, grad: int = 0) -> Stage:
    return Stage(index=i, kind=kind, units=(i,), compute_ms=ms, weight_bytes=weight,
                 grad_bytes=grad, input_bytes=0, output_bytes=0, peak_bytes=2 * weight + grad)


def _sched(actions, edges=(), host=(), workers=2, stages=2) -> Schedule:
    return Schedule(kind="roundpipe", workers=workers, microbatches=1, rounds=1, steps=1,
                    optimizer="async", stage_names=tuple(f"S{i}" for i in range(stages)),
                    stage_units=tuple((i, i) for i in range(stages)), flows=(),
                    actions=tuple(tuple(a) for a in actions), host=tuple(host),
                    edges=tuple(edges))


def test_activation_hop_through_the_host_hand_computed():
    # w0: F (10 ms) -> D2H 25 MB (1 ms); w1: H2D 25 MB (1 ms) -> T (5 ms). Makespan 17.
    f = Action(0, "F", 0, 0, 0)
    down = Action(0, "D2H", 0, 0, 0, what="act", value="x0", bytes=MB25)
    up = Action(1, "H2D", 1, 0, 0, what="act", value="x0", bytes=MB25)
    t = Action(1, "T", 1, 0, 0)
    sched = _sched([[f, down], [up, t]], [Edge(f, down, "produced"), Edge(down, up, "on_host"),
                                          Edge(up, t, "arrived")])
    stages = [_stage(0, "forward", 10.0), _stage(1, "tail", 5.0)]
    r = simulate(sched, stages, _hw())
    assert r.timeline[f] == (0.0, 10.0)
    assert r.timeline[down] == pytest.approx((10.0, 11.0))
    assert r.timeline[up] == pytest.approx((11.0, 12.0))
    assert r.timeline[t] == pytest.approx((12.0, 17.0))
    assert r.makespan_ms == pytest.approx(17.0)
    # idle: w0 7 ms after its F (drain), w1 12 ms before its T (fill); of 2 x 17.
    assert r.bubble == pytest.approx(19 / 34)
    assert r.bubble_fill == pytest.approx(12 / 34)
    assert r.bubble_drain == pytest.approx(7 / 34)
    assert r.bubble_steady == pytest.approx(0.0)
    # T could have started at 10 with instant transfers: 2 ms exposed on w1.
    assert r.exposed_transfer_ms == pytest.approx((0.0, 2.0))
    # w1 idled 12 ms for an input from another worker.
    assert r.idle_by_wait_ms == pytest.approx({"arrived": 12.0})
    # with a 10 us DMA latency per transfer, 0.02 ms more
    r2 = simulate(sched, stages, _hw(transfer_latency_us=10.0))
    assert r2.makespan_ms == pytest.approx(17.02)


def test_critical_transfer_goes_between_chunks_of_a_bulk_upload():
    # w1's H2D link: UP of 100 MB in 4 chunks (1 ms each) from t=0; an activation (25 MB)
    # becomes ready at t=1 (F 0.5 ms + D2H 0.5 ms on w0). It goes after the first chunk:
    # UP chunk 0-1, H2D 1-2, UP chunks 2-5. T waits for both: 5-10.
    f = Action(0, "F", 0, 0, 0)
    down = Action(0, "D2H", 0, 0, 0, what="act", value="x0", bytes=MB25 // 2)
    weights = Action(1, "UP", 1, None, 0, bytes=4 * MB25, chunks=4)
    act = Action(1, "H2D", 1, 0, 0, what="act", value="x0", bytes=MB25)
    t = Action(1, "T", 1, 0, 0)
    sched = _sched([[f, down], [weights, act, t]], [
        Edge(f, down, "produced"), Edge(down, act, "on_host"), Edge(act, t, "arrived"),
        Edge(weights, t, "weights")])
    r = simulate(sched, [_stage(0, "forward", 0.5), _stage(1, "tail", 5.0)], _hw())
    assert r.timeline[act] == pytest.approx((1.0, 2.0))
    assert r.timeline[weights] == pytest.approx((0.0, 5.0))
    assert r.timeline[t] == pytest.approx((5.0, 10.0))
    assert r.idle_by_wait_ms == pytest.approx({"weights": 5.0})  # the upload ended last
    # Without chunks the upload holds the link: the activation waits until 4.
    one = replace(weights, chunks=1)
    sched1 = _sched([[f, down], [one, act, t]], [
        Edge(f, down, "produced"), Edge(down, act, "on_host"), Edge(act, t, "arrived"),
        Edge(one, t, "weights")])
    r1 = simulate(sched1, [_stage(0, "forward", 0.5), _stage(1, "tail", 5.0)], _hw())
    assert r1.timeline[act] == pytest.approx((4.0, 5.0))


def test_a_transfer_stream_runs_its_transfers_in_list_order():
    # The runtime's stream threads run each stream's items in submission order (list order):
    # worker 1's activation_upload lists a (waits for w0's 10 ms F and its 1 ms D2H) before b
    # (waits for nothing). b may not start before a ends: a 11-12, b 12-13 (b's reader, a
    # 1 ms compute, 13-14). A weight upload (another stream on the same link) is not held.
    f = Action(0, "F", 0, 0, 0)
    down = Action(0, "D2H", 0, 0, 0, what="act", value="x0", bytes=MB25)
    a = Action(1, "H2D", 1, 0, 0, what="act", value="x0", bytes=MB25)
    b = Action(1, "H2D", 1, 1, 0, what="act", value="ids", bytes=MB25)
    up = Action(1, "UP", 1, None, 0, what="weights", bytes=MB25)
    t0, t1 = Action(1, "T", 1, 0, 0), Action(1, "T", 1, 1, 0)
    sched = _sched([[f, down], [a, b, up, t1, t0]], [
        Edge(f, down, "produced"), Edge(down, a, "on_host"), Edge(a, t0, "arrived"),
        Edge(b, t1, "arrived")])
    r = simulate(sched, [_stage(0, "forward", 10.0), _stage(1, "tail", 1.0)], _hw())
    assert r.timeline[a] == pytest.approx((11.0, 12.0))
    assert r.timeline[b] == pytest.approx((12.0, 13.0))
    assert r.timeline[up] == pytest.approx((0.0, 1.0))
    assert r.timeline[t1] == pytest.approx((13.0, 14.0))


def test_the_lowered_transfer_streams_run_in_list_order():
    # Every worker's transfer stream of a compiled plan, in the simulator: each transfer
    # starts after the one before it on its stream ended, as on the runtime's streams.
    from rpcompile.hardware import get_hardware
    from rpcompile.ir import ACTION_SPECS, ActionKind
    from rpcompile.sim import simulate_roundpipe
    from rpcompile.workloads.paper import get_model

    hw = get_hardware("rtx4090x8")
    units = get_model("qwen3-1.7b").units(4, 2048)[:10]
    plan = build_plan(units, (0, 3, 6), (0, 2, 4, 6, 8), 9, hw, 4, 6, 4, 2048)
    for mode in ("sync", "async"):
        run = simulate_roundpipe(plan, hw, steps=2, optimizer=mode)
        checked = 0
        for lst in run.schedule.actions:
            streams: dict[str, list] = {}
            for x in lst:
                stream = ACTION_SPECS[ActionKind(x.kind)].stream
                if stream != "compute":
                    streams.setdefault(stream, []).append(x)
            for mine in streams.values():
                for before, after in itertools.pairwise(mine):
                    assert run.timeline[after][0] >= run.timeline[before][1] - 1e-9, (
                        mode, before, after)
                    checked += 1
        assert checked > 100


def test_links_are_full_duplex_and_host_bandwidth_is_shared():
    # One worker's H2D and D2H at once: separate links, both 0-1 ms.
    a = Action(0, "H2D", 0, 0, 0, what="act", value="ids", bytes=MB25)
    b = Action(0, "D2H", 0, 0, 0, what="act", value="x0", bytes=MB25)
    r = simulate(_sched([[a, b], []]), [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)],
                 _hw())
    assert r.timeline[a] == pytest.approx((0.0, 1.0))
    assert r.timeline[b] == pytest.approx((0.0, 1.0))
    # Two workers' H2D at once on a host with 25 GB/s in all: each gets half, both end at 2.
    c = Action(1, "H2D", 1, 0, 0, what="act", value="ids", bytes=MB25)
    r2 = simulate(_sched([[a], [c]]), [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)],
                  _hw(host_gbps=25.0))
    assert r2.timeline[a] == pytest.approx((0.0, 2.0))
    assert r2.timeline[c] == pytest.approx((0.0, 2.0))
    # One link alone is limited by the link, not the host.
    r3 = simulate(_sched([[a], []]), [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)],
                  _hw(host_gbps=25.0))
    assert r3.timeline[a] == pytest.approx((0.0, 1.0))


def test_optimizer_contends_with_links_for_host_memory():
    # OPT over 1M parameters (4 MB of fp32 grads) at 1e9 params/s: the undo journal's copy of
    # the masters and AdamW state (24 MB of traffic at the host's 50 MB/ms: 0.48 ms), then the
    # update (28 MB, 1 ms): 52 MB in 1.48 ms alone. An H2D of 25 MB: 1 ms alone. Together they
    # want 25 + 52/1.48 MB/ms from a host that gives 50: both run at s = 50 / (25 + 52/1.48);
    # the H2D ends at 1/s, and the OPT, which had 1.48 - 1 ms of work left then, 0.48 ms later.
    opt = Action(None, "OPT", 0, None, None, bytes=4_000_000)
    h2d = Action(0, "H2D", 0, 0, 0, what="act", value="ids", bytes=MB25)
    stages = [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)]
    alone = simulate(_sched([[], []], host=[opt]), stages, _hw(host_gbps=50.0))
    assert alone.timeline[opt] == pytest.approx((0.0, 1.48))
    both = simulate(_sched([[h2d], []], host=[opt]), stages, _hw(host_gbps=50.0))
    s = 50.0 / (25.0 + 52.0 / 1.48)
    assert both.timeline[h2d] == pytest.approx((0.0, 1.0 / s))
    assert both.timeline[opt] == pytest.approx((0.0, 1.0 / s + 0.48))
    # ACC: read accumulator + staged grads, write accumulator = 3 x bytes at host speed.
    acc = Action(None, "ACC", 0, None, 0, bytes=10_000_000)
    r = simulate(_sched([[], []], host=[acc]), stages, _hw(host_gbps=30.0))
    assert r.timeline[acc] == pytest.approx((0.0, 1.0))


def test_host_queue_and_compute_stream_run_in_list_order():
    # Two computes on one worker with no edge still run one after the other; so do host ops.
    a, b = Action(0, "F", 0, 0, 0), Action(0, "F", 0, 1, 0)
    acc1 = Action(None, "ACC", 1, None, 0, bytes=10_000_000)
    acc2 = Action(None, "ACC", 1, None, 1, bytes=10_000_000)
    r = simulate(_sched([[a, b], []], host=[acc1, acc2]),
                 [_stage(0, "forward", 2.0), _stage(1, "tail", 1.0)], _hw(host_gbps=30.0))
    assert r.timeline[b] == pytest.approx((2.0, 4.0))
    assert r.timeline[acc2] == pytest.approx((1.0, 2.0))


def test_workers_sharing_cores_slow_down_as_more_compute_at_once():
    # Three workers, one compute each (2, 4 and 6 ms alone), on a profile whose workers share
    # two cores. 0-3 ms: three run, each at 2/3: the 2 ms one ends at 3. 3-4 ms: two run at
    # full speed; the 4 ms one had 2 ms left at 3 and ends at 5, the 6 ms one has 4 left at 3
    # and ends at 7. With a core each (or shared_cores 0, a GPU each) they end at 2, 4 and 6.
    computes = [Action(w, "F", w, 0, 0) for w in range(3)]
    stages = [_stage(i, "forward", 2.0 * (i + 1)) for i in range(3)]
    sched = _sched([[a] for a in computes], workers=3, stages=3)
    ends = {cores: [simulate(sched, stages, _hw(shared_cores=cores)).timeline[a][1]
                    for a in computes] for cores in (0, 1, 2, 3)}
    assert ends[0] == pytest.approx([2.0, 4.0, 6.0])
    assert ends[3] == pytest.approx([2.0, 4.0, 6.0])
    assert ends[2] == pytest.approx([3.0, 5.0, 7.0])
    # One core: 3 at a third (the 2 ms one ends at 6), then 2 at a half, then one alone.
    assert ends[1] == pytest.approx([6.0, 10.0, 12.0])


def test_host_lane_shares_the_cores_with_the_computes():
    # An ACC of 1 ms alone beside a 1 ms compute on one shared core: both at half speed.
    acc = Action(None, "ACC", 0, None, 0, bytes=10_000_000)
    f = Action(0, "F", 0, 0, 0)
    stages = [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)]
    r = simulate(_sched([[f], []], host=[acc]), stages, _hw(host_gbps=30.0, shared_cores=1))
    assert r.timeline[f] == pytest.approx((0.0, 2.0))
    assert r.timeline[acc] == pytest.approx((0.0, 2.0))


def test_transfers_share_the_cores_with_the_computes():
    # A 1 ms compute on worker 0 and a 25 MB upload on worker 1 (1 ms alone at 25 GB/s), on
    # one shared core: a virtual worker's copy is a memcpy on the CPU, so both run at half
    # speed and end at 2 ms. Without shared cores (a GPU's DMA engine) both end at 1 ms.
    f = Action(0, "F", 0, 0, 0)
    up = Action(1, "UP", 1, None, 0, what="weights", bytes=MB25)
    stages = [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)]
    sched = _sched([[f], [up]])
    shared = simulate(sched, stages, _hw(shared_cores=1)).timeline
    assert shared[f] == pytest.approx((0.0, 2.0))
    assert shared[up] == pytest.approx((0.0, 2.0))
    free = simulate(sched, stages, _hw()).timeline
    assert free[f] == pytest.approx((0.0, 1.0))
    assert free[up] == pytest.approx((0.0, 1.0))


def test_action_overhead_is_added_to_compute_and_host_actions():
    # 500 us of runtime CPU per compute and host action: a 1 ms compute takes 1.5 ms, an
    # EVICT 0.5 ms, a 1 ms ACC (10 MB x 3 at 30 GB/s) 1.5 ms; a transfer's is in its copy
    # rate, so a 1 ms upload stays 1 ms.
    f = Action(0, "F", 0, 0, 0)
    evict = Action(0, "EVICT", 0, None, 0)
    acc = Action(None, "ACC", 0, None, 0, bytes=10_000_000)
    stages = [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)]
    r = simulate(_sched([[f, evict], []], host=[acc]), stages,
                 _hw(host_gbps=30.0, action_overhead_us=500.0))
    assert r.timeline[f] == pytest.approx((0.0, 1.5))
    assert r.timeline[evict] == pytest.approx((1.5, 2.0))
    assert r.timeline[acc] == pytest.approx((0.0, 1.5))
    up = Action(1, "UP", 1, None, 0, what="weights", bytes=MB25)
    r = simulate(_sched([[], [up]]), stages, _hw(action_overhead_us=500.0))
    assert r.timeline[up] == pytest.approx((0.0, 1.0))


def test_roundpipe_step_grows_once_more_workers_compute_than_cores():
    # A lowered RoundPipe run on 4 workers: with a core for each worker's compute and two
    # links and for each host lane it replays as if unshared; with fewer, the step grows,
    # and never beats the compute work over the cores.
    plan, sched = _roundpipe_run(steps=2, optimizer="sync")
    hw = _hw(gpus=4)
    free = simulate(sched, plan, hw).makespan_ms
    assert simulate(sched, plan, replace(hw, shared_cores=14)).makespan_ms == free
    work = sum(e - s for a, (s, e) in simulate(sched, plan, hw).timeline.items() if a.is_compute)
    spans = [simulate(sched, plan, replace(hw, shared_cores=c)).makespan_ms for c in (3, 2, 1)]
    assert free < spans[0] < spans[1] < spans[2]
    assert spans[1] >= work / 2 - 1e-6 and spans[2] >= work - 1e-6


def test_deadlock_is_reported():
    a, b = Action(0, "F", 0, 0, 0), Action(1, "T", 1, 0, 0)
    sched = _sched([[a], [b]], [Edge(b, a, "data"), Edge(a, b, "data")])
    with pytest.raises(SimulationError, match="deadlock"):
        simulate(sched, [_stage(0, "forward", 1.0), _stage(1, "tail", 1.0)], _hw())


def test_device_memory_counts_two_weight_slots():
    # Two jobs on one worker: the second job's UP is prefetched while the first runs, so both
    # weight sets are resident at once: 1000 + 2000 bytes.
    up0 = Action(0, "UP", 0, None, 0, bytes=1000)
    f0 = Action(0, "F", 0, 0, 0)
    ev0 = Action(0, "EVICT", 0, None, 0)
    up1 = Action(0, "UP", 1, None, 0, bytes=2000)
    t1 = Action(0, "T", 1, 0, 0)
    ev1 = Action(0, "EVICT", 1, None, 0)
    sched = _sched([[up0, f0, up1, ev0, t1, ev1]],
                   [Edge(up0, f0, "weights"), Edge(up1, t1, "weights")], workers=1)
    stages = [_stage(0, "forward", 1.0, weight=1000), _stage(1, "tail", 1.0, weight=2000)]
    r = simulate(sched, stages, _hw())
    assert r.peak_device_bytes == (3000,)
    # A tail with fp32 gradients and a working set: grads (500) held over its compute,
    # working set = peak - 2 x weights - grads = 7000.
    stages2 = [stages[0], replace(stages[1], grad_bytes=500, peak_bytes=4000 + 500 + 7000)]
    r2 = simulate(sched, stages2, _hw())
    assert r2.peak_device_bytes == (2000 + 500 + 7000,)


def _layers(n: int, f: float, b: float, head_f: float = 0.0, head_b: float = 0.0):
    units = [UnitProfile("prefix", 0.0, 0.0, 0)]
    units += [UnitProfile(f"layers.{i}", f, b, 10) for i in range(n)]
    units.append(UnitProfile("tail", head_f, head_b, 10))
    return units


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_uniform_pipeline_matches_the_closed_form(kind):
    # S = 4 equal stages, F = 1, B = backward 1 + recompute 1 = 2, no transfer time:
    # makespan (M + S - 1)(F + B) = 11 x 3 = 33 for M = 8; bubble (S - 1) / (M + S - 1).
    units = _layers(4, 1.0, 1.0)
    stages = pipeline_stages(units, 4)
    assert [s.units for s in stages] == [(0, 1), (2,), (3,), (4, 5)]
    lowered, _ = lower(build_schedule(stages, 4, 8, kind=kind), stages)
    r = simulate(lowered, stages, _hw(), units=units)
    assert r.makespan_ms == pytest.approx(33.0)
    assert r.bubble == pytest.approx(3 / 11)
    assert r.bubble_fill + r.bubble_drain + r.bubble_steady == pytest.approx(r.bubble)


def test_compute_times_split_baseline_stages_and_need_units():
    units = _layers(2, 1.0, 3.0, head_f=5.0, head_b=7.0)
    stages = pipeline_stages(units, 2, head_layers=0)
    sched = build_schedule(stages, 2, 2, kind="gpipe")
    times = compute_times(sched, stages, units)
    # Stage 1 = layers.1 + tail: F = 1 + 5; B = 3 + 7 + recompute of layers.1 only (1).
    assert times[("F", 1)] == 6.0
    assert times[("B", 1)] == 11.0
    assert compute_times(sched, stages, units, recompute=False)[("B", 1)] == 10.0
    with pytest.raises(ValueError, match="units="):
        compute_times(sched, stages)


def _roundpipe_run(steps: int = 2, optimizer: str = "async"):
    model = MODELS["qwen3-1.7b"]
    units = model.units(1, 2048)
    plan = build_plan(units, [0, 10, 20], [0, 8, 15, 22], 26, "rtx4090x8", 4, 5, 1, 2048, 2)
    lowered, _ = lower(build_schedule(plan, 4, 5, rounds=2, steps=steps, optimizer=optimizer),
                       plan)
    return plan, lowered


def test_roundpipe_replay_is_deterministic_and_consistent():
    plan, lowered = _roundpipe_run()
    r1 = simulate(lowered, plan, "rtx4090x8")
    r2 = simulate(lowered, plan, "rtx4090x8")
    assert r1 == r2
    assert r1.bubble_fill + r1.bubble_drain + r1.bubble_steady == pytest.approx(r1.bubble)
    assert 0.0 <= r1.bubble < 1.0
    # Every action ran, none before what it waits on, each stream's ordered actions in order.
    assert set(r1.timeline) == set(lowered.all_actions())
    for e in lowered.edges:
        assert r1.timeline[e.src][1] <= r1.timeline[e.dst][0] + 1e-9
    for (_, stream), q in lowered.queues().items():
        if stream in ("compute", "host"):
            for x, y in itertools.pairwise(q):
                assert r1.timeline[x][1] <= r1.timeline[y][0] + 1e-9
    # Busy time is exactly the compute the plan predicts.
    work = sum(s.compute_ms for s in plan.stages) * 5 * 2 * 2
    assert sum(r1.busy_ms) == pytest.approx(work)
    assert r1.tokens == 2048 * 5 * 2 * 2
    assert r1.tokens_per_s == pytest.approx(r1.tokens / r1.makespan_ms * 1e3)
    assert all(0 < p < 24 * 2**30 for p in r1.peak_device_bytes)
    # Measured per-unit times replace the profile's: doubling every time doubles busy time.
    doubled = {u.name: (2 * u.forward_ms, 2 * u.backward_ms) for u in plan.units}
    r3 = simulate(lowered, plan, "rtx4090x8", unit_ms=doubled)
    assert sum(r3.busy_ms) == pytest.approx(2 * work)


@pytest.mark.parametrize(("optimizer", "journal"), [("sync", True), ("sync", False),
                                                     ("async", True)])
def test_the_host_peak_alone_is_the_one_simulate_reports(optimizer, journal):
    # compile()'s host check reads only the host peak: the same replay, the other measures
    # left out; with and without the undo journal, for a plan (unit profiles) and bare stages.
    from rpcompile.sim.engine import peak_host_bytes

    plan, lowered = _roundpipe_run(steps=3, optimizer=optimizer)
    hw = get_hardware("rtx4090x8").with_undo_journal(journal)
    for given in (plan, plan.stages):
        assert peak_host_bytes(lowered, given, hw) == simulate(lowered, given, hw).peak_host_bytes


def _free(plan, *, steps: int, optimizer: str) -> Schedule:
    """``plan``'s RoundPipe schedule lowered without the ``optimizer`` and ``commit``
    passes: nothing orders one step after another but the dispatch itself and the memory
    waits, so steps overlap as far as round-robin dealing allows (the most any overlap of
    steps can reach, with no update between them)."""
    sched = build_schedule(plan, plan.workers, plan.microbatches, steps=steps,
                           kind="roundpipe", optimizer=optimizer)
    low, _ = lower(sched, plan, passes=("upload", "transfers", "grads", "events"))
    return low


def test_a_step_starts_only_once_the_step_it_waits_for_has_committed():
    # The runtime submits step k+STEPS_IN_FLIGHT once step k has committed (its last host
    # action): the replay of an async schedule starts none of that step's actions earlier.
    # With host memory at 100 GB/s the host's gradient work ends each step late enough
    # that, without the in_flight edges, step k+2's first input upload (which waits only
    # for its worker's compute two places before) would start before step k commits.
    hw = replace(get_hardware("rtx4090x8"), host_mem_gbps=100.0)
    units = MODELS["qwen3-1.7b"].units(1, 2048)
    plan = build_plan(units, [0, 10, 20], [0, 8, 15, 22], 26, hw, 4, 5, 1, 2048, 2)
    lowered, _ = lower(build_schedule(plan, 4, 5, rounds=2, steps=4, optimizer="async"), plan)
    assert STEPS_IN_FLIGHT == 2
    r = simulate(lowered, plan, hw)
    commit = {a.step: a for a in lowered.host}  # each step's last host action
    for k in range(lowered.steps - STEPS_IN_FLIGHT):
        later = [a for a in lowered.all_actions() if a.step == k + STEPS_IN_FLIGHT]
        assert min(r.timeline[a][0] for a in later) >= r.timeline[commit[k]][1] - 1e-9
    # Data parallel keeps one step in flight: its barrier orders every step after the one
    # before, and no in_flight edge is written.
    dp, _ = lower(build_schedule(plan, 4, 5, rounds=2, steps=4, optimizer="async"), plan,
                  ranks=2)
    kinds = {e.kind for e in dp.edges}
    assert "barrier" in kinds and "in_flight" not in kinds


def test_async_optimizer_is_not_slower_than_sync():
    plan, sync = _roundpipe_run(steps=3, optimizer="sync")
    _, asyn = _roundpipe_run(steps=3, optimizer="async")
    r_sync = simulate(sync, plan, "rtx4090x8")
    r_async = simulate(asyn, plan, "rtx4090x8")
    assert r_async.makespan_ms <= r_sync.makespan_ms + 1e-6


def test_reproduces_the_paper_gpipe_and_1f1b_bubbles():
    # shared/REFERENCE.md: Qwen3-1.7B, 8 GPUs, 16 microbatches: GPipe 36.13 %, 1F1B 35.19 %.
    model = MODELS["qwen3-1.7b"]
    units = model.units(4, 2048)
    stages = pipeline_stages(units, 8)
    link = 2 * model.activation_bytes(8192) / model.hop_ms / 1e6  # D2H + H2D = one hop
    hw = _hw(h2d_gbps=link, d2h_gbps=link)
    got = {}
    for kind in ("gpipe", "1f1b"):
        lowered, _ = lower(build_schedule(stages, 8, 16, kind=kind), stages)
        got[kind] = 100 * simulate(lowered, stages, hw, units=units).bubble
    assert got["gpipe"] == pytest.approx(36.13, abs=0.2)
    assert got["1f1b"] == pytest.approx(35.19, abs=0.2)


def test_balanced_roundpipe_plan_has_no_steady_state_bubble():
    # Every job takes 30 ms per microbatch (forward stages of 3 layers at 10 ms, backward
    # stages of one layer at 10 + 20 ms, a tail of 30 ms; the prefix costs nothing). With more
    # microbatches than workers and the async optimizer, a worker never waits once the
    # pipeline is full: the step period equals the compute per worker.
    layers = 12
    units = [UnitProfile("prefix", 0.0, 0.0, 1000, output_bytes=10**6)]
    units += [UnitProfile(f"layers.{i}", 10.0, 20.0, 10**6, output_bytes=10**6)
              for i in range(layers)]
    units.append(UnitProfile("tail", 10.0, 20.0, 10**6))
    hw = _hw(host_gbps=1e6, gpus=4, memory_gib=24.0, optimizer_params_per_s=1e10)
    # (The prefix rides with layers.0 in its backward stage: a job of its own would compute
    # nothing yet hold a worker while it waits for its inputs.)
    plan = build_plan(units, [0, 4, 7, 10], [0, *range(2, layers + 1)], layers + 1, hw, 4, 8,
                      1, 2048)
    # The lowered schedule (updates, their shadows and each step's commit point included)
    # lets steps overlap: a worker never waits once the pipeline is full, as with nothing
    # at all between steps.
    r = simulate_roundpipe(plan, hw, steps=4, optimizer="async")
    assert steady_utilization(r) == pytest.approx(1.0, abs=2e-3)
    assert steady_step_ms(r) == pytest.approx(17 * 8 * 30.0 / 4, rel=2e-3)
    free = simulate(_free(plan, steps=4, optimizer="async"), plan, hw)
    assert steady_step_ms(r) == pytest.approx(steady_step_ms(free), rel=2e-3)
    # One isolated step still has its fill and drain, which the overlap hides.
    single = simulate_roundpipe(plan, hw, steps=1, optimizer="async")
    assert single.bubble > 0.05


def test_timeline_png_and_bar_chart(tmp_path):
    pytest.importorskip("matplotlib")
    from rpcompile.viz import bar_chart, timeline_png

    plan, lowered = _roundpipe_run(steps=1)
    r = simulate(lowered, plan, "rtx4090x8")
    timeline_png(r, tmp_path / "t.png")
    bar_chart({"a": {"x": 1.0, "y": None}, "b": {"x": 2.0, "y": 3.0}}, tmp_path / "b.png",
              ylabel="v", log=True)
    for name in ("t.png", "b.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The Chrome trace carries the simulated times.
    r.dump(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    ends = [e["ts"] + e["dur"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert max(ends) / 1000.0 == pytest.approx(r.makespan_ms)


def _compute_only(result):
    """(bubble, fill, drain) of a run measured to its last compute, not its last host work."""
    spans = [(a.worker, t) for a, t in result.timeline.items() if a.is_compute]
    end = max(t[1] for _, t in spans)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for w, (s, e) in spans:
        first[w] = min(first.get(w, s), s)
        last[w] = max(last.get(w, e), e)
    busy = sum(e - s for _, (s, e) in spans)
    total = end * result.workers
    return (1 - busy / total, sum(first.values()) / total,
            sum(end - v for v in last.values()) / total)


def test_roundpipe_own_plan_against_the_artifact():
    # RoundPipe's own Qwen3-1.7B partition, 8 GPUs, 16 microbatches, the paper's layer times
    # (docs/simulator.md, "RoundPipe's own plan"). The artifact: a 19.07 % isolated sync step
    # (fill 7.51, drain 7.51, steady 4.05) and a 4.05 % async steady state.
    from rpcompile.sim import steady_steps
    from rpcompile.workloads.paper import ROUNDPIPE_QWEN3_1_7B_BUBBLES as ref
    from rpcompile.workloads.paper import hop_hardware, roundpipe_qwen3_1_7b_plan

    hw = hop_hardware(MODELS["qwen3-1.7b"])
    plan = roundpipe_qwen3_1_7b_plan(hw)
    assert [len(s.units) for s in plan.stages] == [8, 7, 7, 7, 1, *[3] * 8, 2, 3]
    sync = simulate_roundpipe(plan, hw, steps=1, optimizer="sync")
    # A real sync step ends with the last stage's gradients downloaded, accumulated and
    # applied; the artifact's step ends at the last compute.
    assert 100 * sync.bubble == pytest.approx(30.3, abs=0.5)
    assert 100 * _compute_only(sync)[0] == pytest.approx(26.4, abs=0.5)
    # With transfers and host work instant, what is left is the dispatch itself: the fill is
    # the artifact's, the drain is not. Round-robin deals the 15 jobs to 8 GPUs: GPU 7 gets one
    # job, the step ends with the wavefront of the last backward jobs on GPUs 0-6.
    instant = replace(hw, h2d_gbps=1e6, d2h_gbps=1e6, optimizer_params_per_s=1e15)
    bubble, fill, drain = _compute_only(simulate_roundpipe(plan, instant, steps=1,
                                                           optimizer="sync"))
    assert 100 * fill == pytest.approx(ref["fill"], abs=0.5)
    assert 100 * (bubble - fill - drain) == pytest.approx(ref["steady"], abs=1.0)
    assert 100 * drain > ref["drain"] + 5
    # Overlapping steps hide most of the pacing waits the artifact counts: the lowered
    # schedule (updates, shadows and commit points included) is as free as steps with
    # nothing between them, below the artifact's async figure, which equals its sync
    # steady part (one wavefront, not overlapping steps).
    steps = steady_steps(plan)
    lowered = simulate_roundpipe(plan, hw, steps=steps, optimizer="async")
    free = simulate(_free(plan, steps=steps, optimizer="async"), plan, hw)
    assert 100 * (1 - steady_utilization(lowered)) == pytest.approx(1.35, abs=0.3)
    assert 100 * (1 - steady_utilization(free)) == pytest.approx(1.35, abs=0.3)
    assert 100 * (1 - steady_utilization(lowered)) < ref["async"]
    one = simulate_roundpipe(plan, hw, steps=1, optimizer="async")
    assert 100 * one.bubble > 25


def test_paused_gc_from_many_threads_leaves_the_collector_as_it_found_it():
    """The simulator pauses Python's cyclic GC during a replay; blocks entered and left from
    several threads at once must not leave it off for the process (a block that restored only
    what it alone had seen, having seen another's pause, would never turn the collector back
    on)."""
    import gc
    import sys
    import threading

    from rpcompile.sim.engine import paused_gc

    def loop():
        for _ in range(5000):
            with paused_gc():
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            threads = [threading.Thread(target=loop) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert gc.isenabled()
    finally:
        sys.setswitchinterval(interval)
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


@pytest.mark.parametrize("mode,rounds", [("sync", 1), ("sync", 2), ("async", 1)])
def test_search_figures_equal_the_full_replays_figures(mode, rounds):
    """The partitioner's replay without measures reports the figures simulate() reports for
    the same lowered schedule, bit for bit, and its timeline is simulate()'s."""
    from rpcompile.sim.engine import replay_timeline
    from rpcompile.sim.runs import search_figures, steady_steps

    units = MODELS["qwen3-1.7b"].units(4, 2048)
    plan = build_plan(units, [0, 10, 20], [0, 6, 12, 18, 24], len(units) - 1, "rtx4090x8", 8, 9,
                      4, 2048, rounds=rounds)
    steps = 1 if mode == "sync" else steady_steps(plan, rounds=rounds)
    sched = build_schedule(plan, 8, 9, rounds=rounds, steps=steps, kind="roundpipe",
                           optimizer=mode)
    lowered, _ = lower(sched, plan, validate=False)
    full = simulate(lowered, plan, "rtx4090x8")
    assert replay_timeline(lowered, plan, "rtx4090x8") == full.timeline
    want = (full.makespan_ms, full.bubble) if mode == "sync" else (
        steady_step_ms(full), 1.0 - steady_utilization(full))
    assert search_figures(lowered, plan, "rtx4090x8") == want

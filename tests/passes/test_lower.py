"""Lowering passes, the validator and the pass manager; golden schedules.

Golden files live in tests/golden/. Regenerate them with ``RPCOMPILE_REGEN_GOLDEN=1 pytest
tests/passes/test_lower.py`` only after checking the new schedule by hand against the reasoning in the
test's docstring.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter, deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcompile.ir import Action, Edge, Plan, Schedule, ScheduleError, Stage, UnitProfile
from rpcompile.passes.lower import (
    LOWERING_PASSES,
    add_activation_transfers,
    add_events,
    add_gradient_downloads,
    add_optimizer,
    add_weight_uploads,
    lower,
)
from rpcompile.passes.manager import PassManager
from rpcompile.passes.schedule import build_schedule
from rpcompile.passes.validate import validate
from rpcompile.sim import simulate
from tests.ir.test_ir_schedule import make_plan, pipeline_stages

GOLDEN = Path(__file__).parents[1] / "golden"
MiB = 2**20


def check_golden(sched: Schedule, name: str) -> None:
    path = GOLDEN / name
    if os.environ.get("RPCOMPILE_REGEN_GOLDEN"):
        path.write_text(sched.to_csv())
    assert sched.to_csv() == path.read_text(), f"{name} changed; see the test's docstring"
    assert Schedule.load(path) == sched


def happens_before(sched: Schedule) -> dict[Action, set[Action]]:
    """Full transitive closure of stream order plus edges (independent of the validator's
    one-hop rule); small schedules only."""
    succ: dict[Action, list[Action]] = {a: [] for a in sched.all_actions()}
    for q in sched.queues().values():
        for x, y in itertools.pairwise(q):
            succ[x].append(y)
    for e in sched.edges:
        succ[e.src].append(e.dst)
    out = {}
    for a in succ:
        seen: set[Action] = set()
        todo = deque(succ[a])
        while todo:
            b = todo.popleft()
            if b not in seen:
                seen.add(b)
                todo.extend(succ[b])
        out[a] = seen
    return out


# --------------------------------------------------------------------------------------------
# golden schedules
# --------------------------------------------------------------------------------------------


def test_golden_roundpipe_compute() -> None:
    """4 workers, 6 stages (F1 F2 F3 B1 B2 B3 = s0..s5), 5 microbatches, 2 rounds.

    Why it is right: a round's jobs are s0..s5; the counter deals job n to worker n % 4 and
    does not restart, so round 0 goes w0 w1 w2 w3 w0 w1 and round 1 continues at job 6:
    w2 w3 w0 w1 w2 w3. Hence w0 runs F s0 r0, B s4 r0, F s2 r1 (5 microbatches each, m0..m4);
    w1: F s1 r0, B s5 r0, T s3 r1; w2: F s2 r0, F s0 r1, B s4 r1; w3: T s3 r0, F s1 r1, B s5 r1.
    Data edges: each compute waits for the same microbatch of its producer - F s(i-1) for
    forwards, F s2 for the tail, the previous backward stage for B's input gradient and, for
    B s4 (units 3..6), F s0 (x2, its recompute input). B s5 recomputes from the ids (host).
    """
    sched = build_schedule(make_plan(), 4, 5, rounds=2)
    jobs = {w: [] for w in range(4)}
    for w, lst in enumerate(sched.actions):
        for a in lst:
            if (a.kind, a.stage, a.round) not in jobs[w]:
                jobs[w].append((a.kind, a.stage, a.round))
    assert jobs == {0: [("F", 0, 0), ("B", 4, 0), ("F", 2, 1)],
                    1: [("F", 1, 0), ("B", 5, 0), ("T", 3, 1)],
                    2: [("F", 2, 0), ("F", 0, 1), ("B", 4, 1)],
                    3: [("T", 3, 0), ("F", 1, 1), ("B", 5, 1)]}
    check_golden(sched, "roundpipe_w4_s6_m5_r2.csv")


def test_golden_roundpipe_lowered_sync() -> None:
    """The same plan, 2 microbatches, 1 round, 2 steps, sync optimizer, fully lowered.

    Why it is right (rows of tests/golden/roundpipe_w4_s6_m2_k2_sync_lowered.csv):
    * jobs: step 1 starts at job 6, so w0 runs F s0 k0, B s4 k0, F s2 k1; w1 F s1, B s5, T s3
      k1; w2 F s2, F s0 k1, B s4 k1; w3 T s3, F s1 k1, B s5 k1.
    * upload: each worker's first UP leads its list; the next job's UP follows the current
      job's first compute (prefetch); from a worker's third job on, the UP waits ``buffer`` on
      the EVICT two jobs back (w0 ``UP s2 r0 k1`` waits ``EVICT s0 r0``); bytes = weight_bytes
      (F1: 10 MiB); bulk cut into 64 MiB chunks (grads of ~104 MiB: x2).
    * transfers: F s0 downloads @x2 once (consumers: F s1 on w1, remote; B s4 on w0, the same
      worker: no transfer, B s4 reads it on the device); w1 ``H2D act s1 @x2`` waits
      ``on_host`` for it. The tail reads @x6 and @labels (2x16 int64 = 256 B); F s0 reads @ids
      (its input_bytes is 0, so the ids size too) and B s5 reads @ids as its saved input.
      Sizes: act = the consumer's input_bytes (x2: 4 MiB), igrad = the producer's
      output_bytes (g6 from the tail: 7 MiB, g2 from B s4: 3 MiB). A compute waits
      (``arrived``) for each of its H2Ds: transfer lanes give no order.
    * grads: one ``D2H grad`` per T/B job (grad_ready on its last compute), issued after that
      compute's input-gradient download and the EVICT; one host ACC per job (grad_home), in
      dispatch order s3, s4, s5.
    * optimizer (sync): OPT right after each stage's ACC; SHADOW of a stage once every OPT over
      its units is done: after OPT s3 (tail, unit 7) -> SHADOW s3; after OPT s4 (units 3..6)
      -> SHADOW s1 (3..4), s2 (5..6), s4; after OPT s5 (0..2) -> SHADOW s0, s5. Each step-1 UP
      waits ``shadow`` on its stage's step-0 SHADOW; each SHADOW waits ``shadow_read`` on the
      UP of the same step that read the buffer it overwrites.
    * commit: step 0's last host action (SHADOW s5), its commit point, waits for the last
      compute-stream action of each worker in step 0 (its EVICT); nothing else orders step 1
      after step 0: step 1's uploads wait (shadow) for the SHADOWs of step 0 they read, and a
      worker's last EVICT of step 0 waits (landed) for its first UP of step 1 unless that UP
      waits for the commit point.
    * events: edges within the compute or host queue are gone (OPT follows ACC by queue
      order), as are edges implied by another edge from the same transfer, or into the same
      transfer from later on an ordered stream.
    """
    plan = make_plan()
    sched, history = lower(build_schedule(plan, 4, 2, steps=2, optimizer="sync"), plan)
    passes = ("upload", "transfers", "grads", "optimizer", "commit", "events")
    assert tuple(h.name for h in history) == sched.passes == passes
    check_golden(sched, "roundpipe_w4_s6_m2_k2_sync_lowered.csv")


def test_golden_1f1b() -> None:
    """1F1B, 4 workers, 5 microbatches. Worker w warms up with 3 - w forwards, then alternates
    F and B, then drains: w0 = F0 F1 F2 F3 B0 F4 B1 B2 B3 B4, w3 = F0 B0 F1 B1 ... F4 B4."""
    sched = build_schedule(pipeline_stages(4), 4, 5, kind="1f1b")
    check_golden(sched, "1f1b_w4_m5.csv")


# --------------------------------------------------------------------------------------------
# passes one by one
# --------------------------------------------------------------------------------------------


def test_upload_pass_double_buffers() -> None:
    plan = make_plan()
    sched = add_weight_uploads(build_schedule(plan, 2, 3, rounds=2), plan, chunk_bytes=4 * MiB)
    validate(sched, "upload")
    dry = sched.dry_run()
    for lst in sched.actions:
        ups = [a for a in lst if a.kind == "UP"]
        evicts = [a for a in lst if a.kind == "EVICT"]
        jobs = []
        for a in lst:
            if a.is_compute and (a.stage, a.round) not in jobs:
                jobs.append((a.stage, a.round))
        assert [(u.stage, u.round) for u in ups] == jobs == [(e.stage, e.round) for e in evicts]
        for u in ups:
            assert u.bytes == plan.stages[u.stage].weight_bytes
            assert u.chunks == -(-u.bytes // (4 * MiB))
        # replay: weight sets resident (UP started, EVICT not yet done) never exceed two
        events = sorted([(dry.steps[u], 1) for u in ups] + [(dry.steps[e] + 1, -1) for e in evicts],
                        key=lambda t: (t[0], t[1]))
        resident = peak = 0
        for _, d in events:
            resident += d
            peak = max(peak, resident)
        assert peak == 2
        # each job's computes run after its UP finished and before its EVICT
        for u, e in zip(ups, evicts):
            cs = [a for a in lst if a.is_compute and (a.stage, a.round) == (u.stage, u.round)]
            assert all(dry.steps[u] < dry.steps[c] < dry.steps[e] for c in cs)


def test_transfers_skip_same_worker_and_send_each_value_once() -> None:
    plan = make_plan()
    # 3 workers: F1 w0, F2 w1, F3 w2, T w0, B2 w1, B3 w2. x2 (F1's output) is read by F2 as
    # its input and by B2 as its recompute input, both on w1: one D2H, two H2Ds.
    sched = add_activation_transfers(build_schedule(plan, 3, 2))
    validate(sched, "transfers")
    d2h = [a for a in sched.actions[0] if a.kind == "D2H" and a.value == "x2"]
    assert [(a.what, a.microbatch) for a in d2h] == [("act", 0), ("act", 1)]
    h2d = [a for a in sched.actions[1] if a.kind == "H2D" and a.value == "x2"]
    assert sorted((a.what, a.stage, a.microbatch) for a in h2d) == [
        ("act", 1, 0), ("act", 1, 1), ("save", 4, 0), ("save", 4, 1)]
    # 4 workers: B2 lands on F1's worker (job 4 % 4 == job 0), so its x2 stays on the device
    four = add_activation_transfers(build_schedule(plan, 4, 2))
    assert not any(a.kind == "H2D" and a.what == "save" and a.stage == 4
                   for a in four.all_actions())
    assert any(e.kind == "data" and e.dst.stage == 4 and e.src.stage == 0 for e in four.edges)
    # 1 worker: every value stays on the device; only the host's ids/labels move
    one = add_activation_transfers(build_schedule(plan, 1, 2))
    moved = {a.value for a in one.all_actions() if a.kind in ("H2D", "D2H")}
    assert moved == {"ids", "labels"}
    assert all(a.priority == "critical" for a in four.all_actions() if a.kind in ("H2D", "D2H"))


def test_grads_pass() -> None:
    plan = make_plan()
    sched = build_schedule(plan, 4, 2, rounds=2, steps=2)
    sched = add_gradient_downloads(add_activation_transfers(add_weight_uploads(sched, plan)),
                                   plan)
    validate(sched, "grads")
    downs = [a for a in sched.all_actions() if a.kind == "D2H" and a.what == "grad"]
    backward = {s.index for s in plan.stages if s.kind != "forward"}
    assert sorted((a.stage, a.round, a.step) for a in downs) == sorted(
        (s, r, k) for s in backward for r in range(2) for k in range(2))
    assert all(a.bytes == plan.stages[a.stage].grad_bytes and a.priority == "bulk"
               for a in downs)
    assert [(a.step, a.round, a.stage) for a in sched.host] == sorted(
        (k, r, s) for s in backward for r in range(2) for k in range(2))


def _lowered(optimizer: str, steps: int = 3) -> Schedule:
    plan = make_plan()
    sched = build_schedule(plan, 4, 3, rounds=2, steps=steps, optimizer=optimizer)
    for p in (lambda s: add_weight_uploads(s, plan), add_activation_transfers,
              lambda s: add_gradient_downloads(s, plan), lambda s: add_optimizer(s, plan)):
        sched = p(sched)
    validate(sched, "optimizer")
    return sched


def test_optimizer_sync_waits_only_for_own_stage() -> None:
    sched = _lowered("sync")
    hb = happens_before(sched)
    opt = {(a.stage, a.step): a for a in sched.host if a.kind == "OPT"}
    shadow = {(a.stage, a.step): a for a in sched.host if a.kind == "SHADOW"}
    assert sorted(opt) == [(s, k) for s in (3, 4, 5) for k in range(3)]
    assert sorted(shadow) == [(s, k) for s in range(6) for k in range(3)]
    for a in sched.all_actions():
        if a.kind == "UP" and a.step >= 1:
            assert a in hb[shadow[(a.stage, a.step - 1)]]
    # F3 (s2, units 5..6) of step 1 needs only B2's update (units 3..6), not B3's (units 0..2):
    # its upload (round 0) may run before B3's update (its compute still waits for F2's data)
    up_f3 = next(a for a in sched.all_actions()
                 if a.kind == "UP" and (a.stage, a.round, a.step) == (2, 0, 1))
    assert up_f3 in hb[opt[(4, 0)]]
    assert up_f3 not in hb[opt[(5, 0)]]


def test_optimizer_async_is_one_step_stale() -> None:
    """Async: step k's OPTs apply step k-1's gradients at the start of step k's host queue,
    and step k+1 reads the shadow step k's SHADOWs wrote from those masters, in the second of
    two copies: the one step k-1's uploads read, so step k's uploads never wait for it."""
    sched = _lowered("async")
    hb = happens_before(sched)
    shadow = {(a.stage, a.step): a for a in sched.host if a.kind == "SHADOW"}
    opt = {(a.stage, a.step): a for a in sched.host if a.kind == "OPT"}
    accs = [a for a in sched.host if a.kind == "ACC"]
    assert sorted(shadow) == [(s, k) for s in range(6) for k in range(3)]
    ups = [a for a in sched.all_actions() if a.kind == "UP"]
    for up in ups:
        if up.step >= 1:  # step k reads what step k-1's SHADOW copied
            assert up in hb[shadow[(up.stage, up.step - 1)]]
        for (x, k), sh in shadow.items():  # a copy is rewritten after every read of it
            if k == up.step + 1 and x in _overlapping(sched, up.stage):
                assert sh in hb[up]
    for (x, k), sh in shadow.items():  # ... from the masters after the updates over them
        assert all(sh in hb[o] for (y, ko), o in opt.items()
                   if ko == k and y in _overlapping(sched, x))
    for (s, k), o in opt.items():
        # update k-1: after every gradient of step k-1, before any of step k arrives
        assert all(o in hb[a] for a in accs if (a.stage, a.step) == (s, k - 1))
        assert all(a in hb[o] for a in accs if (a.stage, a.step) == (s, k))
    # so step 1's update runs while step 1's first forward computes
    f1 = next(a for a in sched.all_actions() if a.kind == "F" and (a.stage, a.microbatch,
                                                                    a.round, a.step) == (0, 0, 0, 1))
    assert all(f1 not in hb[o] and o not in hb[f1] for (_, k), o in opt.items() if k == 1)
    sync_dry, async_dry = _lowered("sync").dry_run(), sched.dry_run()
    assert max(async_dry.steps.values()) < max(sync_dry.steps.values())


def _overlapping(sched: Schedule, stage: int) -> set[int]:
    u0, u1 = sched.stage_units[stage]
    return {x for x, (a, b) in enumerate(sched.stage_units) if a <= u1 and u0 <= b}


def test_events_pass_keeps_the_order_and_drops_redundant_edges() -> None:
    plan = make_plan()
    before = build_schedule(plan, 3, 2, steps=2, optimizer="sync")
    for p in (lambda s: add_weight_uploads(s, plan), add_activation_transfers,
              lambda s: add_gradient_downloads(s, plan), lambda s: add_optimizer(s, plan)):
        before = p(before)
    after = add_events(before)
    validate(after, "events")
    assert len(after.edges) < len(before.edges)
    assert set(after.edges) <= set(before.edges)
    pos = {a: (q, i) for q, lst in after.queues().items() for i, a in enumerate(lst)}
    assert all(pos[e.src][0] != pos[e.dst][0] for e in after.edges)
    assert happens_before(after) == happens_before(before)


def test_baselines_reject_roundpipe_only_passes() -> None:
    stages = pipeline_stages(4)
    sched = build_schedule(stages, 4, 4, kind="gpipe")
    with pytest.raises(ValueError, match="bound workers"):
        add_weight_uploads(sched, stages)
    low, _ = lower(sched, stages)
    # activations cross workers through the host: one D2H + one H2D per boundary and direction
    assert sum(1 for a in low.all_actions() if a.kind == "D2H") == 3 * 4 * 2
    assert sum(1 for a in low.all_actions() if a.kind == "H2D") == 3 * 4 * 2 + 4 * 2


# --------------------------------------------------------------------------------------------
# validator and pass manager
# --------------------------------------------------------------------------------------------


def _drop_edge(sched: Schedule, edge: Edge) -> Schedule:
    return sched.replace(edges=tuple(e for e in sched.edges if e != edge))


def test_validator_rejects_a_missing_wait_with_marked_grid() -> None:
    plan = make_plan()
    sched, _ = lower(build_schedule(plan, 4, 2, steps=2, optimizer="sync"), plan)
    edge = next(e for e in sched.edges if e.kind == "on_host" and e.dst.worker == 1
                and e.dst.value == "x2" and e.dst.microbatch == 1)
    with pytest.raises(ScheduleError) as info:
        validate(_drop_edge(sched, edge), "transfers")
    msg = str(info.value)
    assert "after pass 'transfers'" in msg
    assert "reads x2 on the host written by w0 D2H act s0 m1 r0 @x2" in msg
    assert f"!!{edge.dst.short()}!!" in msg
    marked = [line for line in msg.splitlines() if "!!" in line]
    assert len(marked) == 1 and marked[0].endswith("<-- here")


@pytest.mark.parametrize("kind", ["weights", "buffer", "shadow", "grad_home", "arrived"])
def test_validator_rejects_each_missing_edge_kind(kind: str) -> None:
    plan = make_plan()
    sched, _ = lower(build_schedule(plan, 4, 2, steps=2, optimizer="sync"), plan)
    edge = next(e for e in sched.edges if e.kind == kind)
    with pytest.raises(ScheduleError, match="!!"):
        validate(_drop_edge(sched, edge), "x")


def test_validator_rejects_wait_without_record_and_deadlock() -> None:
    plan = make_plan()
    sched, _ = lower(build_schedule(plan, 4, 2), plan)
    ghost = Action(3, "D2H", 0, 0, 0, what="act", value="x9")
    first = sched.actions[1][2]
    bad = sched.replace(edges=(*sched.edges, Edge(ghost, first, "on_host")))
    with pytest.raises(ScheduleError, match="without a matching record"):
        validate(bad, "events")
    # swap the two microbatches of w0's first compute: m1 before m0, and w1 waits for m0 first
    compute = build_schedule(plan, 4, 2)
    lst = list(compute.actions[0])
    lst[0], lst[1] = lst[1], lst[0]
    swapped = compute.replace(actions=(tuple(lst), *compute.actions[1:]))
    validate(swapped, "dispatch")  # still fine: nothing orders m0 and m1 of F1
    # but a wait from m1 to m0 on the same stream, behind it, deadlocks
    loop = swapped.replace(edges=(*swapped.edges, Edge(lst[1], lst[0], "data")))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(loop, "dispatch")
    assert "blocked" in str(info.value) and "!!F s0 m1 r0!!" in str(info.value)


def test_validator_rejects_missing_compute() -> None:
    compute = build_schedule(make_plan(), 4, 2)
    short = compute.replace(actions=(compute.actions[0][:-1], *compute.actions[1:]))
    present = set(short.all_actions())
    short = short.replace(edges=tuple(e for e in short.edges
                                      if e.src in present and e.dst in present))
    with pytest.raises(ScheduleError, match="never runs"):
        validate(short, "dispatch")


def test_pass_manager_history_and_failing_pass_named() -> None:
    plan = make_plan()
    sched = build_schedule(plan, 4, 2)
    low, history = lower(sched, plan)
    assert [h.artifact.passes[-1] for h in history] == [h.name for h in history]
    assert history[-1].artifact == low
    assert all(h.elapsed_ms >= 0 and h.check_ms >= 0 for h in history)

    def lose_weights(s: Schedule) -> Schedule:
        return s.replace(edges=tuple(e for e in s.edges if e.kind != "weights"))

    manager = PassManager([("upload", lambda s: add_weight_uploads(s, plan)),
                           ("lose_weights", lose_weights)],
                          check=lambda s, name: validate(s, name))
    with pytest.raises(ScheduleError, match="after pass 'lose_weights'"):
        manager.run(sched)


def test_passes_refuse_to_run_twice() -> None:
    plan = make_plan()
    low, _ = lower(build_schedule(plan, 4, 2), plan)
    for p in (lambda s: add_weight_uploads(s, plan), add_activation_transfers,
              lambda s: add_gradient_downloads(s, plan), lambda s: add_optimizer(s, plan),
              add_events):
        with pytest.raises(ValueError, match="already ran"):
            p(low)


def test_transfer_lanes_give_no_order() -> None:
    """The tail reads @x6 and @labels, two H2Ds on the same lane. A runtime may finish the small
    labels copy first, so the wait for @x6 cannot be left to lane order."""
    plan = make_plan()
    sched, _ = lower(build_schedule(plan, 4, 2), plan)
    edge = next(e for e in sched.edges if e.kind == "arrived" and e.dst.kind == "T"
                and e.src.value == "x6")
    assert any(e.kind == "arrived" and e.dst == edge.dst and e.src.value == "labels"
               for e in sched.edges)
    with pytest.raises(ScheduleError, match="reads x6 brought in by H2D"):
        validate(_drop_edge(sched, edge), "events")


@st.composite
def random_plans(draw: st.DrawFn) -> Plan:
    """Any valid plan shape: t units before the tail cut into forward stages, the same units cut
    independently into backward stages, a tail of 1..2 units."""
    t = draw(st.integers(1, 7))
    tail = draw(st.integers(1, 2))
    units = tuple(UnitProfile(f"u{i}", 1.0, 2.0, 1000, output_bytes=MiB) for i in range(t + tail))

    def cuts() -> list[tuple[int, ...]]:
        inner = sorted(draw(st.sets(st.integers(1, t - 1), max_size=t - 1))) if t > 1 else []
        bounds = [0, *inner, t]
        return [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]

    fwd, bwd = cuts(), cuts()
    stages = [Stage(i, "forward", u, 1.0, MiB, 0, MiB, MiB, 0) for i, u in enumerate(fwd)]
    stages.append(Stage(len(stages), "tail", tuple(range(t, t + tail)), 1.0, MiB,
                        draw(st.sampled_from([0, MiB])), MiB, MiB, 0))
    for u in reversed(bwd):
        stages.append(Stage(len(stages), "backward", u, 1.0, MiB,
                            draw(st.sampled_from([0, MiB])), 2 * MiB, MiB, 0))
    plan = Plan(units, tuple(stages), 1, 1, 1, 4, "test", 0.0, 0)
    plan.validate()
    return plan


@settings(max_examples=30, deadline=None)
@given(random_plans(), st.integers(1, 5), st.integers(1, 4), st.integers(1, 2),
       st.integers(1, 3), st.sampled_from(["sync", "async"]))
def test_any_plan_lowers_to_a_valid_schedule(plan, workers, microbatches, rounds, steps,
                                             optimizer) -> None:
    sched = build_schedule(plan, workers, microbatches, rounds, steps, optimizer=optimizer)
    low, history = lower(sched, plan)  # validates the input and after every pass
    assert tuple(h.name for h in history) == LOWERING_PASSES
    # the commit point: in the simulator every action of a step has ended when the step's
    # last host action starts (steps may overlap: nothing else orders them)
    timeline = simulate(low, plan, "rtx4090x8").timeline
    hub = {a.step: a for a in low.host}
    for a, (_, end) in timeline.items():
        if a.step in hub and a != hub[a.step]:
            assert end <= timeline[hub[a.step]][0], (a, hub[a.step])
    computes = [a for a in low.all_actions() if a.is_compute]
    assert len(computes) == len(plan.stages) * microbatches * rounds * steps
    # a flow's value is brought in (H2D) exactly when it comes from the host or from another
    # worker, and leaves its producer (D2H) once if any consumer is elsewhere
    worker = {(a.kind, a.stage, a.microbatch, a.round, a.step): a.worker for a in computes}
    h2d = Counter((a.stage, a.what, a.value, a.microbatch, a.round, a.step)
                  for a in low.all_actions() if a.kind == "H2D")
    d2h = Counter((a.stage, a.value, a.microbatch, a.round, a.step)
                  for a in low.all_actions() if a.kind == "D2H" and a.what != "grad")
    remote_values = set()
    for f in low.flows:
        for key in itertools.product(range(microbatches), range(rounds), range(steps)):
            dst = worker[(f.dst_kind, f.dst_stage, *key)]
            remote = f.from_host or worker[(f.src_kind, f.src_stage, *key)] != dst
            assert h2d[(f.dst_stage, f.what, f.value, *key)] == int(remote)
            if remote and not f.from_host:
                remote_values.add((f.src_stage, f.value, *key))
    assert set(d2h) == remote_values and set(d2h.values()) <= {1}
    # a stage's shadow is rewritten once per step exactly when some OPT covers its units
    trained = {s.index for s in plan.stages if s.kind != "forward" and s.grad_bytes}
    for s in plan.stages:
        covered = any(plan.stages[y].units[0] <= s.units[-1] and s.units[0] <=
                      plan.stages[y].units[-1] for y in trained)
        n = sum(1 for a in low.host if a.kind == "SHADOW" and a.stage == s.index)
        assert n == (steps if covered else 0)
    assert Schedule.from_csv(low.to_csv()) == low



def _lowered_without_landed(sched: Schedule, plan) -> Schedule:
    """``sched`` lowered as :func:`lower` does, but with no ``landed`` edge."""
    import rpcompile.passes.lower.pipeline as lowering

    plain = lowering.add_weight_uploads

    def without(s, p, chunk_bytes):
        up = plain(s, p, chunk_bytes)
        return up.replace(edges=tuple(e for e in up.edges if e.kind != "landed"))

    try:
        lowering.add_weight_uploads = without
        return lower(sched, plan)[0]
    finally:
        lowering.add_weight_uploads = plain


@settings(max_examples=25, deadline=None)
@given(random_plans(), st.integers(1, 5), st.integers(1, 4), st.integers(1, 2),
       st.integers(1, 3), st.sampled_from(["sync", "async"]))
def test_an_evict_waiting_for_the_next_upload_costs_no_time_and_keeps_the_peak(
        plan, workers, microbatches, rounds, steps, optimizer) -> None:
    # A job's EVICT waits (landed) for the next job's UP of its step on that worker. The
    # compute after the EVICT is that job's first, which waits for the same UP, so no compute
    # of the simulated run moves, and the proof's peaks stay (the overlap of the two weight
    # sets, which a run without the wait may or may not reach, is certain with it).
    from rpcompile.passes.memory import worker_peaks

    sched = build_schedule(plan, workers, microbatches, rounds, steps, optimizer=optimizer)
    low = lower(sched, plan)[0]
    base = _lowered_without_landed(sched, plan)
    timed, free = simulate(low, plan, "rtx4090x8"), simulate(base, plan, "rtx4090x8")
    for lst in low.actions:
        ups = [a for a in lst if a.kind == "UP"]
        evicts = [a for a in lst if a.kind == "EVICT"]
        for up, evict in zip(ups[1:], evicts):
            if up.step == evict.step:  # across steps the barrier orders them the other way
                assert timed.timeline[evict][0] >= timed.timeline[up][1]
    assert timed.makespan_ms == pytest.approx(free.makespan_ms, rel=1e-12)
    for a, span in free.timeline.items():
        if a.is_compute:
            assert timed.timeline[a] == pytest.approx(span, rel=1e-12, abs=1e-9)
    for got, was in zip(worker_peaks(low, plan),
                        worker_peaks(base, plan)):
        assert (got.held_bytes, got.peak_bytes) == (was.held_bytes, was.peak_bytes)

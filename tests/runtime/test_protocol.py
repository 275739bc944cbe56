"""The lowered schedule is the runtime's only protocol.

A step on virtual workers is logged action by action by wrapping every kind's runtime
implementation (with the test's own clock, not the executor's timeline), and the log is held
against the schedule: every action of the step ran exactly once, none that the schedule lacks,
each started after every action its edges name had finished, and the actions of each stream
(every worker's four, the host queue) ran in list order, each ending before the next one
started. A wait hidden inside an action (``_do_OPT`` waiting for something the schedule does
not make it wait for) breaks none of these on its own: it makes the action end later, which
its queue absorbs. So the measured timeline is also held against the simulator's replay of the
same schedule, with the test's slowed backward stage as slow in both: every pair of actions
that the replay orders (one's end against the other's start) with more than half a slowed job
between them is measured in the same order, where a whole step without the slowed jobs (what
the replay does not model: the runtime's own costs) takes less than that. A wait for an action
the schedule does not name shows there as an action ending after one the replay puts far after
it started; a plain sleep (slow work, which the schedule allows) only when it is that long. In
sync mode the pairs include each OPT's end against the later backward jobs' starts (the
updates overlap them by default, come after the step's last gradient when the schedule defers
them). Masters change only inside OPT, shadows only inside SHADOW, which leaves them equal to
the masters cast; in async mode the step's OPTs (the previous step's gradients) run first,
before their stages' ACCs, and the SHADOWs after them. A stream of steps holds every edge
between steps, and in async mode overlaps them, in the simulator and at run time.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.ir import ActionKind
from rpcompile.options import PlanOptions, TrainOptions
from rpcompile.passes.lower import updates_deferred
from rpcompile.runtime.executor import Executor
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from tests.runtime.test_executor import ADAMW, batches, qwen3  # noqa: F401  (fixture)
from tests.tiny_models import hf_model

# Added to each compute of the last backward stage, at run time and in the simulator's replay:
# the later backward jobs are long. Over twice a whole unslowed step of the tiny model on
# virtual workers (measured 42 to 157 ms on a loaded 2-core machine), which bounds the
# runtime's own costs that the replay does not model.
SLOW_S = 0.4


def _logged_step(trainer, batch, monkeypatch, slow_stage):
    """Run one step with every action logged; also which masters each OPT changed and which
    shadows each SHADOW changed (the update happens in the action, not elsewhere)."""
    log: list[tuple[object, float, float]] = []
    changed: dict[object, set[str]] = {}
    stale: dict[object, set[str]] = {}
    lock = threading.Lock()
    store = trainer.store
    names = [s.name for s in store.trainable_slots]
    slots_of = {s: {store.slots[i].name for i in st.layout.slots if store.slots[i].trainable}
                for s, st in enumerate(store.stages)}

    def written(run):
        """The shadow copy a SHADOW of ``run`` writes: async, the one the next step reads."""
        return (run.k + 1) % 2 if store.shadow_pair is not None else None

    def values(run, a):
        if a.kind == "OPT":
            return {n: store.master_of(n).clone() for n in names}
        return {n: store.shadow_of(n, written(run)).clone() for n in names}

    for kind in ActionKind:
        name = f"_do_{kind.value}"
        original = getattr(Executor, name)

        def wrapped(self, run, a, original=original):
            before = values(run, a) if a.kind in ("OPT", "SHADOW") else None
            begin = time.perf_counter()
            if a.kind == "B" and a.stage == slow_stage:
                time.sleep(SLOW_S)
            original(self, run, a)
            end = time.perf_counter()
            if before is not None:
                after = values(run, a)
                changed[a] = {n for n in names if not torch.equal(before[n], after[n])}
            if a.kind == "SHADOW":  # the stage's shadow now holds its masters, cast
                stale[a] = {n for n in slots_of[a.stage] if not torch.equal(
                    store.shadow_of(n, written(run)),
                    store.master_of(n).to(store.compute_dtype))}
            with lock:
                log.append((a, begin, end))

        monkeypatch.setattr(Executor, name, wrapped)
    step = trainer.schedule.step_of(trainer.executor.steps_run)
    masters = {n: store.master_of(n).clone() for n in names}
    trainer.step(batch)
    monkeypatch.undo()
    moved = {n for n in names if not torch.equal(masters[n], store.master_of(n))}
    # What the next step computes with: sync, this step's update; async, the masters as they
    # were before it (one step stale).
    stale_by_one = {n for n in names if not torch.equal(
        store.shadow_of(n), masters[n].to(store.compute_dtype))}
    return step, log, changed, stale, moved, stale_by_one


def _order_of_opts(timeline, opts, backward):
    """Per OPT: does it start before the step's last backward compute ends (it overlaps the
    later backward jobs) or after (it waits for the whole backward)?"""
    last = max(timeline[c][1] for c in backward)
    return {o: timeline[o][0] < last for o in opts}


def _isolated(sched, step):
    """Schedule step ``step`` alone, as ``step()`` runs it: every step before it committed
    (its edges from them are met), none after it (its waits for them are met when the run
    of steps ends)."""
    keep = [[a for a in lst if a.step == step] for lst in sched.actions]
    return sched.replace(
        actions=tuple(tuple(lst) for lst in keep),
        host=tuple(a for a in sched.host if a.step == step),
        network=tuple(a for a in sched.network if a.step == step),
        edges=tuple(e for e in sched.edges if e.src.step == e.dst.step == step),
        repeat_from=0, repeat_until=0)


def _slowed_replay(compiled, sched, slow_stage, slow_s):
    """The simulator's timeline of ``sched`` with each compute of ``slow_stage`` longer by
    ``slow_s``, as the test makes it at run time (one of the stage's units' backward time, which
    only that stage counts, is lengthened)."""
    plan = compiled.plan
    stage = plan.stages[slow_stage]
    unit = plan.units[stage.units[0]]
    assert stage.kind == "backward" and not any(
        stage.units[0] in s.units for s in plan.stages if s.kind != "forward" and s is not stage)
    slow_ms = slow_s * 1e3
    timeline = simulate(sched, plan, compiled.hardware, unit_ms={
        unit.name: (unit.forward_ms, unit.backward_ms + slow_ms)}).timeline
    for a, (begin, end) in timeline.items():  # slowed: that stage's computes, and only they
        if a.kind in ("F", "T", "B"):
            assert (end - begin >= slow_ms) == (a.stage == slow_stage), a
    return timeline


def _misordered(measured, simulated, margin_ms, firsts=None, seconds=None):
    """Pairs (a, b) whose order the replay and the run disagree on: a's end against b's start,
    wherever the replay puts more than ``margin_ms`` between them (closer pairs are the
    runtime's own unmodeled costs, not the schedule's)."""
    out = []  # (how far the run is from the replay's order, what it did)
    for a in firsts or measured:
        for b in seconds or measured:
            gap = simulated[b][0] - simulated[a][1]
            if a == b or abs(gap) <= margin_ms:
                continue
            run = measured[b][0] - measured[a][1]
            if (gap > 0) != (run >= 0):
                said = (f"{a} ended {abs(run):.1f} ms {'before' if run >= 0 else 'after'} {b} "
                        f"started; the replay has it end {abs(gap):.1f} ms "
                        f"{'before' if gap > 0 else 'after'}")
                out.append((abs(run) + abs(gap), said))
    return [what for _, what in sorted(out, key=lambda o: -o[0])]


@pytest.mark.parametrize("mode,updates", [("sync", "overlap"), ("sync", "deferred"),
                                          ("async", "overlap"), ("async", "clip")])
def test_a_step_runs_its_schedule_exactly(qwen3, monkeypatch, mode, updates):  # noqa: F811
    # Clipping defers sync updates; async has one order (the previous step's gradients,
    # clipped at that step's end, applied at the start of this one).
    options = {} if updates == "overlap" else {"max_grad_norm": 1e9}
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      timeout_s=60, **options),
                 plan=replace(qwen3.options.plan, mode=mode)) as trainer:
        sched = trainer.schedule
        assert sched.optimizer == mode
        assert updates_deferred(sched) == (updates == "deferred")
        slow_stage = len(sched.stage_names) - 1
        trainer.step(batches(1, 6)[0])  # step 0: warm-up (its own schedule step)
        # What the replay does not model (the runtime's own costs) is at most a whole step:
        # the quickest of three, the machine's load aside (a hidden wait is in each of them).
        seconds = []
        for batch in batches(3, 6):
            trainer.step(batch)
            seconds.append(trainer.last.seconds)
        unslowed_ms = 1e3 * min(seconds)
        step, log, changed, stale, moved, behind = _logged_step(trainer, batches(2, 6)[1],
                                                                monkeypatch, slow_stage)

    ran = [a for a, _, _ in log]
    expected = [a for a in sched.all_actions() if a.step == step]
    assert len(ran) == len(set(ran)), "an action ran twice"
    assert set(ran) == set(expected), (
        f"missing {[str(a) for a in set(expected) - set(ran)][:5]}, "
        f"not in the schedule {[str(a) for a in set(ran) - set(expected)][:5]}")
    t0 = min(b for _, b, _ in log)
    measured = {a: ((b - t0) * 1e3, (e - t0) * 1e3) for a, b, e in log}  # ms, as the replay's
    for e in sched.edges:
        if e.src in measured and e.dst in measured:
            assert measured[e.src][1] <= measured[e.dst][0], f"{e.kind} edge broken: {e}"
    for (_, stream), queue in sched.queues().items():
        mine = [a for a in queue if a.step == step]
        for before, after in itertools.pairwise(mine):  # list order, one at a time
            assert measured[before][1] <= measured[after][0], (
                f"{stream} queue: {after} started before {before} ended")
    # Held against the replay of the same schedule: no wait the schedule does not show.
    # Pairs the replay puts closer than half a slowed job are left to the machine's timing.
    margin_ms = SLOW_S * 1e3 / 2
    assert unslowed_ms < margin_ms, (
        f"a step without the slowed jobs took {unslowed_ms:.0f} ms: either an action waits "
        "for something (or sleeps), or the machine is too loaded to tell")
    simulated = _slowed_replay(qwen3, _isolated(sched, step), slow_stage, SLOW_S)
    misordered = _misordered(measured, simulated, margin_ms)
    assert not misordered, "the run's order is not the replay's: " + "; ".join(misordered[:5])

    # The update and the refresh happen in the OPT and SHADOW actions themselves: each master
    # that the step moved moved inside an OPT, its shadow inside a SHADOW, and after each
    # SHADOW its stage's shadow is its masters cast to the compute dtype.
    # (A slot's shadow is shared by the stages holding it: the first SHADOW rewrites it.)
    by_opt = set().union(*(changed[a] for a in ran if a.kind == "OPT"))
    by_shadow = set().union(*(changed[a] for a in ran if a.kind == "SHADOW"))
    assert moved and by_opt == moved and by_shadow == moved
    assert not any(stale.values()), f"a SHADOW left stale shadows: {stale}"
    # The next step computes with this step's OPTs' masters (sync: this step's gradients;
    # async: the previous step's, one step stale).
    assert behind == moved, "the next step does not compute with this step's update"
    if mode == "async":
        # The host queue (ordered) starts with the OPTs: each applied the pending gradients
        # of its stage before the stage's first ACC of this step arrived, and the SHADOWs
        # come among them (each after the OPTs over its parameters, host queue order),
        # before any ACC.
        for o in (a for a in ran if a.kind == "OPT"):
            first_acc = min(measured[a][0] for a in ran if a.kind == "ACC" and
                            a.stage == o.stage)
            assert measured[o][1] <= first_acc
        first_acc = min(measured[a][0] for a in ran if a.kind == "ACC")
        first_opt = min(measured[a][1] for a in ran if a.kind == "OPT")
        for sh in (a for a in ran if a.kind == "SHADOW"):
            assert first_opt <= measured[sh][0] and measured[sh][1] <= first_acc
        return

    opts = [a for a in expected if a.kind == "OPT"]
    backward = [a for a in expected if a.kind in ("T", "B")]
    # Each OPT's end against the later backward jobs' starts, as the replay has it; every
    # OPT is compared with some slowed job (the replay puts one far from it).
    late = [c for c in backward if c.stage == slow_stage]
    for o in opts:
        assert any(abs(simulated[c][0] - simulated[o][1]) > margin_ms for c in late), (
            f"the replay puts {o} near every slowed job: the order says nothing")
    misordered = _misordered(measured, simulated, margin_ms, opts, backward)
    assert not misordered, "an update's end is not where the replay has it: " + "; ".join(
        misordered)
    run_order = _order_of_opts(measured, opts, late)
    # The OPT order against later backward jobs: measured == simulated.
    assert run_order == _order_of_opts(simulated, opts, late)
    first = min(opts, key=lambda o: measured[o][0])
    if updates == "overlap":
        assert run_order[first], "the first update waited for the whole backward"
        # ... and it ended before the slowed jobs after it started: the update is done while
        # they still run, not held until they end.
        assert any(measured[first][1] < measured[c][0] for c in late)
    else:
        assert not any(run_order.values()), "an update ran before the step's last gradient"


def test_an_overlapping_order_is_refused_by_one_rule_wherever_options_meet(qwen3, monkeypatch):  # noqa: F811
    # Clipping, loss scaling, skipping a non-finite step and data parallel need the whole
    # step's gradients before any update. The options groups refuse the overlap order before
    # any capture, the Trainer refuses such groups, and an Executor refuses a schedule lowered
    # with it: one rule (rpcompile.options.update_order), one message.
    def no_capture(*a, **k):
        raise AssertionError("captured before the options were checked")

    with monkeypatch.context() as patch:
        patch.setattr("rpcompile.compiler.entry.capture_graph", no_capture)
        with pytest.raises(ValueError, match=r"^max_grad_norm must see every gradient.*"
                                             r"use updates='deferred'"):
            rpcompile.compile(hf_model("qwen3", layers=1), max_grad_norm=1.0,
                              plan=PlanOptions(updates="overlap"))
    with pytest.raises(ValueError, match=r"^skip_nonfinite must see every gradient"):
        Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                     skip_nonfinite=True), plan=replace(qwen3.options.plan,
                                                                        updates="overlap"))
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, updates="overlap")) as trainer:
        assert not updates_deferred(trainer.schedule)
        with pytest.raises(ValueError, match=r"max_grad_norm, skip_nonfinite.*updates='deferred'"):
            Executor(qwen3, trainer.workers, trainer.schedule, trainer.store, trainer.driver,
                     options=TrainOptions(max_grad_norm=1.0, skip_nonfinite=True))


def _steps_overlap(timeline) -> list[int]:
    """Steps k >= 1 that start an action before every action of step k-1 has ended."""
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for a, (begin, end) in timeline.items():
        ends[a.step] = max(ends.get(a.step, begin), end)
        starts[a.step] = min(starts.get(a.step, begin), begin)
    return [k for k in sorted(starts) if k - 1 in ends and starts[k] < ends[k - 1]]


def _logged_stream(trainer, data, monkeypatch, slow_stage):
    """Run ``data`` as one stream of steps (``Trainer.fit``) with every action logged
    ((action, start, end), the test's own clock); each compute of ``slow_stage``'s backward
    takes :data:`SLOW_S` longer."""
    log: list[tuple[object, float, float]] = []
    lock = threading.Lock()
    for kind in ActionKind:
        name = f"_do_{kind.value}"
        original = getattr(Executor, name)

        def wrapped(self, run, a, original=original):
            begin = time.perf_counter()
            if a.kind == "B" and a.stage == slow_stage:
                time.sleep(SLOW_S)
            original(self, run, a)
            with lock:
                log.append((a, begin, time.perf_counter()))

        monkeypatch.setattr(Executor, name, wrapped)
    try:
        results = list(trainer.fit(data))
    finally:
        monkeypatch.undo()
    assert [r.step for r in results] == list(range(len(data)))
    return log


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_steps_overlap_in_both_interpreters_as_far_as_the_edges_allow(qwen3, monkeypatch,  # noqa: F811
                                                                      mode):
    """Nothing but what a job reads, the memory bounds and the runtime's limit of steps in
    flight (``in_flight``: step k+2 after step k's commit point) orders one step after
    another (the lowering's ``commit`` edges close each step at its last host action). The
    simulator's replay of the runtime's schedule starts step k+1 before step k has ended
    (async: step k+1's forward jobs read the shadow of step k-1's update, so they run while
    step k's backward drains); a stream of steps on the virtual workers, the last backward
    stage slowed, holds every edge, those between steps included, and in async mode
    overlaps its steps too."""
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                               timeout_s=60),
                 plan=replace(qwen3.options.plan, mode=mode)) as trainer:
        sched = trainer.schedule
        assert "commit" in sched.passes and "barrier" not in sched.passes
        simulated = _steps_overlap(simulate(sched, qwen3.plan, qwen3.hardware).timeline)
        assert simulated or mode == "sync"
        n = min(3, sched.run_steps)  # run steps that are their own schedule steps
        log = _logged_stream(trainer, batches(n, 6), monkeypatch,
                             slow_stage=len(sched.stage_names) - 1)
    measured = {a: (b, e) for a, b, e in log}
    expected = [a for a in sched.all_actions() if a.step < n]
    assert len(log) == len(measured) == len(expected) and set(measured) == set(expected)
    crossing = []
    for e in sched.edges:
        if e.src in measured and e.dst in measured:
            assert measured[e.src][1] <= measured[e.dst][0], f"{e.kind} edge broken: {e}"
            if e.src.step != e.dst.step:
                crossing.append(e)
    assert {e.kind for e in crossing} >= {"shadow", "in_flight"}
    if mode == "async":
        assert _steps_overlap(measured), "step k+1 waited for step k to drain"


def test_async_updates_run_in_the_next_step_and_a_flush_changes_nothing(qwen3):  # noqa: F811
    """Async: a run's first step has nothing pending (its OPTs do nothing, and say so), each
    later step's OPTs apply the step before's gradients, and the last step's wait for a
    flush. Flushing after every step (reading the masters, with the learning rate already
    changed for the next step) gives the same losses and masters, bit for bit, as flushing
    only at the end: a flush writes masters and optimizer state with the pending step's
    hyperparameters, and the next step computes with the shadow written before it."""
    data = batches(4, 6)

    def run(flush_each_step):
        with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                          timeout_s=60), plan=replace(qwen3.options.plan,
                                                                      mode="async")) as trainer:
            losses, idle = [], []
            for k, batch in enumerate(data):
                trainer.optimizer.param_groups[0]["lr"] = 1e-2 / (k + 1)
                losses.append(trainer.step(batch))
                idle.append(trainer.last.idle_updates)
                assert trainer.driver.pending_step == k
                if flush_each_step:
                    trainer.optimizer.param_groups[0]["lr"] = 123.0  # the next step's, not k's
                    assert trainer.flush() and trainer.driver.pending_step is None
                    assert not trainer.flush()
            masters = {n: v.clone() for n, v in trainer.masters().items()}
            assert trainer.driver.pending_step is None
            opts = [a for a in trainer.schedule.host if a.kind == "OPT" and a.step == 0]
        return losses, idle, masters, opts

    losses, idle, masters, opts = run(flush_each_step=False)
    assert set(idle[0]) == set(opts) and opts  # nothing pending in the first step
    assert all(not i for i in idle[1:])
    flushed_losses, flushed_idle, flushed, _ = run(flush_each_step=True)
    # After a flush each step's OPTs find nothing pending (schedule step k mod steps).
    assert all(len(i) == len(opts) for i in flushed_idle)
    assert [float(x) for x in flushed_losses] == [float(x) for x in losses]
    for name, value in masters.items():
        assert torch.equal(flushed[name], value), name


def test_a_flush_and_a_step_from_two_threads_never_apply_the_gradients_twice(qwen3):  # noqa: F811
    """Async: a flush (reading the masters) and another thread's step both apply the pending
    gradients; whichever comes second while the first runs is refused at once, and the run
    ends with the masters of a run without the attempt (a step opened while a flush is
    applying the groups must not apply them a second time)."""
    import threading

    data = batches(3, 6)

    def run(order):
        with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                          timeout_s=60), plan=replace(qwen3.options.plan,
                                                                      mode="async")) as trainer:
            trainer.step(data[0])  # leaves step 0's gradients pending
            refused, calls = [], []

            def attempt(fn, *args):
                try:
                    fn(*args)
                except RuntimeError as exc:
                    refused.append(str(exc))

            def hold(optimizer, args, kwargs):  # the first update applying step 0's gradients
                calls.append(1)
                if len(calls) > 1 or order is None:
                    return
                other = (threading.Thread(target=attempt, args=(trainer.masters,))
                         if order == "step first" else
                         threading.Thread(target=attempt, args=(trainer.step, data[1])))
                other.start()
                other.join(60)
                assert not other.is_alive()

            handle = trainer.optimizer.register_step_pre_hook(hold)
            if order == "flush first":
                trainer.masters()
            trainer.step(data[1])
            handle.remove()
            trainer.step(data[2])
            return refused, {n: v.clone() for n, v in trainer.masters().items()}

    _, expected = run(None)
    for order in ("step first", "flush first"):
        refused, masters = run(order)
        assert len(refused) == 1, (order, refused)
        for name, value in expected.items():
            assert torch.equal(masters[name], value), (order, name)

"""The lowered schedule is the runtime's only protocol.

A step on virtual workers is logged action by action by wrapping every kind's runtime
implementation (with the test's own clock, not the executor's timeline), and the log is held
against the schedule: every action of the step ran exactly once, none that the schedule lacks,
each started after every action its edges name had finished, ordered streams in list order;
and in both modes the order of OPT against the step's later backward jobs is the one the
simulator's replay of the same schedule has (overlapping them by default, after the step's
last gradient when the schedule defers updates). Masters change only inside OPT, shadows only
inside SHADOW, which leaves them equal to the masters cast; in async mode every SHADOW of a
step runs before its first OPT, so the next step computes with the masters from before the
update (one step stale).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rpcompile
from rpcompile.ir import ORDERED_STREAMS, ActionKind
from rpcompile.passes.lower import updates_deferred
from rpcompile.runtime.executor import Executor
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from tests.test_executor import ADAMW, batches, qwen3  # noqa: F401  (fixture)
from tests.tiny_models import hf_model

SLOW_S = 0.05  # added to each compute of the last backward stage: later jobs are long


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

    def values(a):
        read = store.master_of if a.kind == "OPT" else store.shadow_of
        return {n: read(n).clone() for n in names}

    for kind in ActionKind:
        name = f"_do_{kind.value}"
        original = getattr(Executor, name)

        def wrapped(self, run, a, original=original):
            before = values(a) if a.kind in ("OPT", "SHADOW") else None
            begin = time.perf_counter()
            if a.kind == "B" and a.stage == slow_stage:
                time.sleep(SLOW_S)
            original(self, run, a)
            end = time.perf_counter()
            if before is not None:
                after = values(a)
                changed[a] = {n for n in names if not torch.equal(before[n], after[n])}
            if a.kind == "SHADOW":  # the stage's shadow now holds its masters, cast
                stale[a] = {n for n in slots_of[a.stage] if not torch.equal(
                    store.shadow_of(n), store.master_of(n).to(store.compute_dtype))}
            with lock:
                log.append((a, begin, end))

        monkeypatch.setattr(Executor, name, wrapped)
    step = trainer.executor.steps_run % trainer.schedule.steps
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


@pytest.mark.parametrize("mode,updates", [("sync", "overlap"), ("sync", "deferred"),
                                          ("async", "overlap"), ("async", "deferred")])
def test_a_step_runs_its_schedule_exactly(qwen3, monkeypatch, mode, updates):  # noqa: F811
    options = {} if updates == "overlap" else {"max_grad_norm": 1e9}  # clipping defers
    with Trainer(qwen3, ADAMW, device="virtual", timeout_s=60, mode=mode,
                 **options) as trainer:
        sched = trainer.schedule
        assert sched.optimizer == mode
        assert updates_deferred(sched) == (updates == "deferred")
        slow_stage = len(sched.stage_names) - 1
        trainer.step(batches(1, 6)[0])  # step 0: warm-up (its own schedule step)
        step, log, changed, stale, moved, behind = _logged_step(trainer, batches(2, 6)[1],
                                                                monkeypatch, slow_stage)

    ran = [a for a, _, _ in log]
    expected = [a for a in sched.all_actions() if a.step == step]
    assert len(ran) == len(set(ran)), "an action ran twice"
    assert set(ran) == set(expected), (
        f"missing {[str(a) for a in set(expected) - set(ran)][:5]}, "
        f"not in the schedule {[str(a) for a in set(ran) - set(expected)][:5]}")
    measured = {a: (b, e) for a, b, e in log}
    for e in sched.edges:
        if e.src in measured and e.dst in measured:
            assert measured[e.src][1] <= measured[e.dst][0], f"{e.kind} edge broken: {e}"
    for (_, stream), queue in sched.queues().items():
        if stream in ORDERED_STREAMS:
            mine = [a for a in queue if a.step == step]
            starts = [measured[a][0] for a in mine]
            assert starts == sorted(starts), f"{stream} queue out of its list order"

    # The update and the refresh happen in the OPT and SHADOW actions themselves: each master
    # that the step moved moved inside an OPT, its shadow inside a SHADOW, and after each
    # SHADOW its stage's shadow is its masters cast to the compute dtype.
    # (A slot's shadow is shared by the stages holding it: the first SHADOW rewrites it.)
    by_opt = set().union(*(changed[a] for a in ran if a.kind == "OPT"))
    by_shadow = set().union(*(changed[a] for a in ran if a.kind == "SHADOW"))
    assert moved and by_opt == moved and by_shadow == moved
    assert not any(stale.values()), f"a SHADOW left stale shadows: {stale}"
    if mode == "async":
        # Every SHADOW ran before any OPT: the next step computes with the masters from
        # before this step's update, exactly (each parameter moved, so none is left equal).
        assert max(measured[a][1] for a in ran if a.kind == "SHADOW") <= min(
            measured[a][0] for a in ran if a.kind == "OPT")
        assert not behind, f"shadows are not the pre-update masters: {sorted(behind)[:3]}"
    else:
        assert behind == moved, "the next step does not compute with this step's update"

    opts = [a for a in expected if a.kind == "OPT"]
    backward = [a for a in expected if a.kind in ("T", "B")]
    # Make the simulated later backward jobs long too, as the test made them at run time,
    # by comparing against the slow stage's computes only.
    late = [c for c in backward if c.stage == slow_stage]
    run_order = _order_of_opts(measured, opts, late)
    if mode == "sync":
        # The OPT order against later backward jobs: measured == simulated. (In async mode
        # the first OPT waits for the step's last UP, through the SHADOWs: where it falls
        # against the slowed computes depends on durations the simulator does not share.)
        simulated = simulate(sched, qwen3.plan, qwen3.hardware).timeline
        assert run_order == _order_of_opts(simulated, opts, late)
    first = min(opts, key=lambda o: measured[o][0])
    if updates == "overlap":
        assert run_order[first], "the first update waited for the whole backward"
    else:
        assert not any(run_order.values()), "an update ran before the step's last gradient"


def test_an_overlapping_order_is_refused_by_one_rule_wherever_options_meet(qwen3, monkeypatch):  # noqa: F811
    # Clipping, loss scaling, skipping a non-finite step and data parallel need the whole
    # step's gradients before any update. The options groups refuse the overlap order before
    # any capture, the Trainer refuses overrides, and an Executor refuses a schedule lowered
    # with it: one rule (rpcompile.options.check_update_order), one message.
    def no_capture(*a, **k):
        raise AssertionError("captured before the options were checked")

    with monkeypatch.context() as patch:
        patch.setattr("rpcompile.compiler.capture", no_capture)
        with pytest.raises(ValueError, match=r"^max_grad_norm must see every gradient.*"
                                             r"use updates='deferred'"):
            rpcompile.compile(hf_model("qwen3", layers=1), updates="overlap", max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"^skip_nonfinite must see every gradient"):
        Trainer(qwen3, ADAMW, device="virtual", updates="overlap", skip_nonfinite=True)
    with Trainer(qwen3, ADAMW, device="virtual", updates="overlap") as trainer:
        assert not updates_deferred(trainer.schedule)
        with pytest.raises(ValueError, match=r"^max_grad_norm, skip_nonfinite must see every "
                                             r"gradient.*lowered with updates='deferred'"):
            Executor(qwen3, trainer.workers, trainer.schedule, trainer.store, trainer.driver,
                     max_grad_norm=1.0, skip_nonfinite=True)

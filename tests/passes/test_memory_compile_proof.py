"""The schedule and proof compile() keeps: those its search made, equal to ones made afresh,
retimed when the runtime's schedule needs one gradient slot, and shared by plans (and screens)
that differ only in their memory figures."""

from __future__ import annotations

from dataclasses import replace

from rpcompile.compiler import runtime_schedule
from rpcompile.hardware import get_hardware
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import TIGHTEST_WAITS
from rpcompile.sim.engine import with_staging
from tests.passes.memory_runs import (
    compiled_for,
    tightest_peaks,
)


def test_compile_retimes_a_plan_it_moves_to_one_gradient_slot(monkeypatch):
    # compile() proves the runtime's own schedule; when that needs one gradient slot where
    # the partitioner's plan had two, the plan's peaks and its predicted step are replayed
    # with one, and a note says so (a partitioner that ignores capacity_bytes stands in for
    # a screening that missed it).
    import rpcompile.compiler.search as search_module
    from rpcompile.planner.partition import retimed

    free = compiled_for("qwen3", 1, 3)
    tight = max(p.peak_bytes for p in tightest_peaks(free))
    assert tight < max(p.peak_bytes for p in free.memory)
    real = search_module.partition

    def roomy(units, hw, options, **kwargs):
        return real(units, hw, replace(options, capacity_bytes=None), **kwargs)

    monkeypatch.setattr(search_module, "partition", roomy)
    compiled = compiled_for("qwen3", 1, 3, capacity_bytes=tight)
    plan = compiled.plan
    assert plan.memory_waits == TIGHTEST_WAITS
    assert any(n.startswith("memory: one gradient slot") for n in plan.notes)
    assert plan.predicted_step_ms == retimed(plan, compiled.hardware, 1, "sync")\
        .predicted_step_ms
    assert max(plan.worker_peak_bytes) <= tight


def test_compile_keeps_the_schedule_and_proof_its_search_made(monkeypatch):
    # The search proves its plan over the runtime's own schedule; compile keeps that schedule
    # and proof (lowered once for the plan kept, not again), and both equal a lowering and a
    # proof made afresh outside the compile. (Under RPCOMPILE_DEBUG=1 compile lowers its
    # schedule anew, each pass checked as it is made.)
    from collections import OrderedDict

    import rpcompile.passes.lower as lower_package
    import rpcompile.passes.lower.pipeline as pipeline
    import rpcompile.planner.partition.proofs as proofs
    from rpcompile.passes.lower import runtime_peaks

    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    monkeypatch.setattr(proofs, "_REPLAYS", OrderedDict())  # this search proves its own plans
    lowered = []
    real = pipeline.lower

    def counted(sched, plan, **kwargs):
        lowered.append((sched.stage_units, sched.steps, plan.memory_waits))
        return real(sched, plan, **kwargs)

    monkeypatch.setattr(pipeline, "lower", counted)
    monkeypatch.setattr(lower_package, "lower", counted)
    c = compiled_for("qwen3", 2, 3)
    monkeypatch.undo()
    kept = (c.schedule.stage_units, c.schedule.steps, c.plan.memory_waits)
    assert lowered.count(kept) == 1
    assert with_staging(runtime_schedule(c.plan, c.options.plan), c.plan,
                        c.hardware) == c.schedule
    assert runtime_peaks(c.plan, c.options.plan) == c.memory
    # The staging pass gives the compiled schedule; the events pass's was validated.
    assert c.history[-1].artifact is c.schedule and c.history[-2].check_ms > 0


def test_plans_that_differ_only_in_memory_figures_share_a_schedule_not_a_proof(monkeypatch):
    # No lowering pass reads a stage's peak or a unit's working set (loss-chunk variants of
    # one plan differ only there): their schedules are equal, and within one compile's scope
    # one is lowered for both; each proof is of its own figures.
    from rpcompile.passes.lower import keep_runtime_schedules, runtime_peaks

    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")  # (with it, a schedule is lowered anew)
    from tests.ir.test_ir_schedule import make_plan

    plan = make_plan(workers=3, microbatches=3)
    grown = replace(plan, stages=tuple(replace(st, peak_bytes=st.peak_bytes + (1 << 30) * i)
                                       for i, st in enumerate(plan.stages)),
                    units=tuple(replace(u, working_bytes=2 * u.working_bytes + 7)
                                for u in plan.units))
    options = PlanOptions(gpus=3, microbatches=3, mode="sync")
    assert runtime_schedule(plan, options) == runtime_schedule(grown, options)
    fresh = [runtime_peaks(p, options) for p in (plan, grown)]
    assert fresh[0] != fresh[1]
    with keep_runtime_schedules():
        first = runtime_schedule(plan, options)
        assert runtime_schedule(grown, options) is first
        assert [runtime_peaks(p, options) for p in (plan, grown)] == fresh


def test_screens_that_differ_only_in_memory_figures_share_their_lowering(monkeypatch):
    # A candidate's one-step screen (fit_memory_waits) reads its memory figures only in its
    # proof: within a compile's scope its lowering and order are made once for every plan
    # that differs only there (loss-chunk variants), and the screens with either set of
    # waits share the passes up to the activation transfers. Each screen is still of its
    # own figures and waits: equal to one made afresh outside the scope.
    import rpcompile.passes.lower as lower_package
    from rpcompile.passes.lower import keep_runtime_schedules
    from rpcompile.planner.bound import simulated_lower_bound
    from rpcompile.planner.partition import fit_memory_waits
    from tests.ir.test_ir_schedule import make_plan

    plan = make_plan(workers=3, microbatches=3)
    grown = replace(plan, stages=tuple(replace(st, peak_bytes=st.peak_bytes + (1 << 30) * i)
                                       for i, st in enumerate(plan.stages)),
                    units=tuple(replace(u, working_bytes=2 * u.working_bytes + 7)
                                for u in plan.units))
    hw = get_hardware("rtx4090x8").with_gpus(3)

    def screens(p):  # capacity 0: neither set of waits fits, both are screened
        return fit_memory_waits(p, hw, 1, "sync", capacity=0, steps=1)

    fresh = [screens(p) for p in (plan, grown)]
    assert fresh[0][2] != fresh[1][2] and fresh[0][0].memory_waits == TIGHTEST_WAITS
    passes = []
    real = lower_package.lower

    def counted(sched, p, **kwargs):
        passes.append(kwargs.get("passes"))
        return real(sched, p, **kwargs)

    monkeypatch.setattr(lower_package, "lower", counted)
    with keep_runtime_schedules():
        kept = [screens(p) for p in (plan, grown)]
    assert kept[1][1] is kept[0][1]
    assert [(r.memory_waits, s, peaks) for r, s, peaks in kept] == \
        [(r.memory_waits, s, peaks) for r, s, peaks in fresh]
    # One lowering up to the activation transfers, then the rest once per set of waits.
    assert [p[0] for p in passes] == ["upload", "grads", "grads"]
    assert simulated_lower_bound(plan, hw, 1, "sync") == \
        simulated_lower_bound(grown, hw, 1, "sync")

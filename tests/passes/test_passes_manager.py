"""One pass mechanism: the compile's passes and the lowering's run through run_pass (the
PassManager is a sequence of them), into one history; checks under RPCOMPILE_DEBUG=1, and the
lowered schedule's validation always."""

from __future__ import annotations

import pytest

import rpcompile
from rpcompile.ir import Schedule, ScheduleError
from rpcompile.passes.lower import LOWERING_PASSES
from rpcompile.passes.manager import (
    PassInvariantError,
    PassManager,
    ScheduleInvariantError,
    run_pass,
)
from tests.option_groups import grouped
from tests.schedules import without_staging
from tests.tiny_models import hf_model, token_batch

FRONT = ["capture", "token-hits", "cost", "partition", "split", "dispatch"]


def _compile(**options):
    return rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                             example_inputs=token_batch(4), device="virtual", **grouped(**options))


def test_the_history_lists_every_pass_in_order_with_time_and_artifact(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    c = _compile()
    names = [r.name for r in c.history]
    assert names == FRONT + list(LOWERING_PASSES) + ["staging"]
    assert all(r.elapsed_ms >= 0 for r in c.history)
    lowering = c.history[len(FRONT):-1]
    # Each lowering record holds the schedule that pass produced; the staging pass's record
    # holds the compiled one: the last lowering's with its host slots and reuse waits.
    assert all(isinstance(r.artifact, Schedule) and r.artifact.passes[-1] == r.name
               for r in lowering)
    assert c.history[-1].artifact is c.schedule
    assert lowering[-1].artifact == without_staging(c.schedule)
    # Without debug the compile's own checks do not run; the validation of the schedule that
    # runs, the last lowering pass's, always does.
    assert all(r.check_ms == 0.0 for r in c.history[:len(FRONT)])
    assert all(r.check_ms == 0.0 for r in lowering[:-1]) and lowering[-1].check_ms > 0
    assert "events" in c.timings() and "capture" in c.timings()


def test_a_replan_keeps_the_front_passes_and_records_its_own(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    c = _compile(loss_chunk_tokens=8)
    assert [r.name for r in c.history][:4] == ["capture", "chunk-loss", "token-hits", "cost"]
    again = c.replan(gpus=3)
    # capture, chunk-loss, token-hits and cost are kept (not re-run); the planning passes are
    # new.
    assert [r.name for r in again.history] == ["capture", "chunk-loss", *FRONT[1:],
                                               *LOWERING_PASSES, "staging"]
    assert again.history[3] is c.history[3]
    assert again.history[-1].artifact == again.schedule


@pytest.mark.parametrize(("debug", "broken", "function", "edge"), [
    ("1", "events", "add_events", "weights"), ("0", "events", "add_events", "weights"),
    ("0", "transfers", "add_activation_transfers", "arrived")])
def test_a_broken_lowering_pass_is_named(monkeypatch, debug, broken, function, edge):
    # A lowering pass that loses some of its edges: the schedule's validation, always on,
    # names the pass, as a PassInvariantError and a ScheduleError (the grid); without debug
    # only the last schedule is validated first, and an earlier pass's break is still named.
    monkeypatch.setenv("RPCOMPILE_DEBUG", debug)
    import rpcompile.passes.lower.pipeline as lower_mod

    real = getattr(lower_mod, function)

    def lose_edges(s, *args):
        out = real(s, *args)
        return out.replace(edges=tuple(e for e in out.edges if e.kind != edge))

    monkeypatch.setattr(lower_mod, function, lose_edges)
    with pytest.raises(ScheduleInvariantError, match=f"pass '{broken}' produced an artifact") as e:
        _compile()
    assert isinstance(e.value, PassInvariantError) and isinstance(e.value, ScheduleError)


def test_a_broken_dispatch_is_named_under_debug(monkeypatch):
    monkeypatch.setenv("RPCOMPILE_DEBUG", "1")
    # The runtime schedule's one builder (rpcompile.passes.lower.runtime_schedule, which
    # compile() calls) dispatches with the build_schedule it imported.
    import rpcompile.passes.lower.pipeline as lower_mod

    real = lower_mod.build_schedule

    def drop_a_job(*a, **k):
        s = real(*a, **k)
        first = next(w for w, lst in enumerate(s.actions) if lst)
        actions = list(s.actions)
        actions[first] = actions[first][1:]
        return s.replace(actions=tuple(actions))

    monkeypatch.setattr(lower_mod, "build_schedule", drop_a_job)
    with pytest.raises(PassInvariantError, match="pass 'dispatch'"):
        _compile()


def test_the_manager_runs_through_run_pass(monkeypatch):
    seen = []

    def check(x, name):
        seen.append(name)
        if x > 2:
            raise AssertionError(f"{x} is too large")

    manager = PassManager([("one", lambda x: x + 1), ("two", lambda x: x * 2)], check=check)
    history = [object()]
    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    assert manager.run(1, history)[0] == 4 and seen == []  # not checked without debug
    assert [r.name for r in history[1:]] == ["one", "two"]
    assert [r.artifact for r in history[1:]] == [2, 4]
    monkeypatch.setenv("RPCOMPILE_DEBUG", "1")
    with pytest.raises(PassInvariantError, match=r"pass 'two'.*4 is too large"):
        manager.run(1)
    assert seen == ["one", "two"]
    monkeypatch.setenv("RPCOMPILE_DEBUG", "0")
    with pytest.raises(PassInvariantError, match="pass 'two'"):
        PassManager(manager.passes, check, always=True).run(1)
    records = []
    assert run_pass(records, "p", lambda: 5) == 5 and records[0].check_ms == 0.0

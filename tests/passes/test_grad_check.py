"""The step's gradient check (loss, non-finite jobs, unscaling, clipping) is the schedule's
CHECK action: the runtime runs it there, the simulator times it, and the partitioner ranks
plans lowered in the order the run uses (a clipped sync run defers its updates)."""

from __future__ import annotations

import pytest
import torch

import rpcompile
import rpcompile.runtime.actions.handlers as actions_mod
import rpcompile.runtime.executor as executor_mod
from rpcompile.hardware import get_hardware
from rpcompile.sim import simulate
from tests.option_groups import grouped
from tests.tiny_models import hf_model, token_batch


def _compile(model, **kw):
    return rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6, 16),
                             mode="sync", device="virtual", **grouped(**kw))


def _step_ms(compiled) -> float:
    """One isolated step of the schedule the run uses (its update order and check), as the
    partitioner ranks sync plans."""
    from rpcompile.passes.lower import lower, updates_deferred
    from rpcompile.passes.schedule import build_schedule

    sched = compiled.schedule
    one = build_schedule(compiled.plan, sched.workers, sched.microbatches, rounds=sched.rounds,
                         steps=1, optimizer=sched.optimizer)
    one, _ = lower(one, compiled.plan,
                   updates="deferred" if updates_deferred(sched) else "overlap")
    return simulate(one, compiled.plan, get_hardware(compiled.plan.hardware)).makespan_ms


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_predicted_step_is_of_the_schedule_that_runs(clip):
    # Clipping needs every gradient before any update, so the run defers its updates and
    # passes over the gradients in CHECK: the plan's predicted step must be that schedule's,
    # not the overlapping one's (the partitioner replays each candidate in the run's order).
    compiled = _compile(hf_model("qwen3"), max_grad_norm=clip)
    try:
        assert compiled.plan.updates == ("overlap" if clip is None else "deferred")
        assert _step_ms(compiled) == pytest.approx(compiled.plan.predicted_step_ms, rel=1e-9)
    finally:
        compiled.close()


def test_a_clipped_run_is_predicted_slower_than_an_unclipped_one():
    plain, clipped = _compile(hf_model("qwen3")), _compile(hf_model("qwen3"), max_grad_norm=1.0)
    try:
        assert clipped.plan.predicted_step_ms > plain.plan.predicted_step_ms
    finally:
        plain.close()
        clipped.close()


def test_check_bytes_are_the_clip_passes_over_every_trainable_parameter():
    model = hf_model("qwen3")
    # Each trainable parameter once (a tied embedding and LM head are one), as the model has
    # them: clipping reads every fp32 gradient for the norm and rewrites it, 3 passes.
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    compiled = _compile(model, max_grad_norm=1.0)
    try:
        checks = [a for a in compiled.schedule.host if a.kind == "CHECK"]
        assert [a.step for a in checks] == list(range(compiled.schedule.steps))
        assert {a.bytes for a in checks} == {3 * 4 * params}
        hw = get_hardware(compiled.plan.hardware)
        run = simulate(compiled.schedule, compiled.plan, hw)
        for a in checks:
            start, end = run.timeline[a]
            assert end - start == pytest.approx(3 * 4 * params / hw.host_mem_gbps / 1e6, rel=1e-6)
        host = list(compiled.schedule.host)
        for k in range(compiled.schedule.steps):
            mine = [i for i, a in enumerate(host) if a.step == k]
            check = next(i for i in mine if host[i].kind == "CHECK")
            assert all(host[i].kind == "ACC" for i in mine if i < check)  # after every ACC
            assert all(host[i].kind != "ACC" for i in mine if i > check)  # before every OPT
    finally:
        compiled.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_runtime_clips_inside_the_check_action(mode, monkeypatch):
    inside: list[object] = []  # the CHECK actions running now
    calls: list[bool] = []  # per clip: whether a CHECK was running
    clip, check = actions_mod.clip_grad_norm, executor_mod.Executor._do_CHECK

    def check_spy(self, run, a):
        inside.append(a)
        try:
            return check(self, run, a)
        finally:
            inside.pop()

    def clip_spy(*args, **kw):
        calls.append(bool(inside))
        return clip(*args, **kw)

    monkeypatch.setattr(executor_mod.Executor, "_do_CHECK", check_spy)
    monkeypatch.setattr(actions_mod, "clip_grad_norm", clip_spy)
    compiled = rpcompile.compile(hf_model("qwen3"), gpus=2, microbatches=3,
                                 example_inputs=token_batch(6, 16), mode=mode,
                                 device="virtual", max_grad_norm=1.0,
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        trainer = compiled.trainer()
        for seed in (1, 2):
            calls.clear()
            trainer.step({"input_ids": token_batch(6, 16, seed=seed)})
            assert calls == [True]  # once per step, inside the step's CHECK
            timeline = trainer.last.timeline
            (start, end), = [t for a, t in timeline.items() if a.kind == "CHECK"]
            assert max(e for a, (_, e) in timeline.items() if a.kind == "ACC") <= start
            if mode == "sync":  # deferred: every update after the check
                assert min(s for a, (s, _) in timeline.items() if a.kind == "OPT") >= end
    finally:
        compiled.close()


def test_an_executor_refuses_a_schedule_without_its_check():
    compiled = _compile(hf_model("qwen3"))
    try:
        sched = compiled.schedule
        bare = sched.replace(host=tuple(a for a in sched.host if a.kind != "CHECK"))
        with pytest.raises(ValueError, match="one CHECK action per step"):
            rpcompile.runtime.executor.Executor(compiled, [], bare, None, _Driver())
    finally:
        compiled.close()


class _Driver:
    def use_pending(self):
        pass

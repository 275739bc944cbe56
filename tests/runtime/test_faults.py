"""Faults anywhere in a step leave a usable trainer: the optimizer's own step() failing at any
update group (sync and async), a raising error listener, a stream thread's loop killed, a
compute that never returns (the watchdog, at its stated time), close() from another thread,
KeyboardInterrupt during dispatch and during the drain, concurrent step() calls, an empty
batch. Each: the named error within its bound, masters / optimizer state / step counter
bit-identical to before, and the next two steps bit-identical to a run that skipped the failed
one (the reference below is eager-style training of the same stage programs)."""

from __future__ import annotations

import _thread
import ctypes
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch

from rpcompile.runtime.executor import Executor, StepAborted, StepFailed, StepTimeout
from rpcompile.runtime.loss_scale import DynamicLossScaler, LossScaleConfig
from rpcompile.runtime.trainer import Trainer
from rpcompile.runtime.workers import STREAMS, Worker
from tests.runtime.test_executor import (
    ADAMW,
    SGD,
    _assert_same_optimizer_state,
    _raise_on_call,
    _snapshot,
    batches,
    qwen3,  # noqa: F401  (fixture)
    reference_training,
)
from tests.tiny_models import token_batch


def _assert_state_is(trainer, masters, opt_state, steps):
    after, opt_after = _snapshot(trainer)
    assert set(after) == set(masters)
    for name, value in masters.items():
        assert torch.equal(after[name], value), f"{name} changed by a failed step"
    _assert_same_optimizer_state(opt_state, opt_after)
    assert trainer.steps_done == steps
    assert all(w.memory_in_use == 0 for w in trainer.workers)


def _assert_continues_like(trainer, compiled, data, make_optimizer, mode, upto):
    """Run data[upto:] and compare loss and masters with the reference over all of data."""
    for batch in data[upto:]:
        trainer.step(batch)
    losses, params = reference_training(compiled, data, make_optimizer, mode)
    assert torch.equal(trainer.last.loss, losses[-1])
    masters = trainer.masters()
    for name, value in params.items():
        assert torch.equal(masters[name], value), name


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_optimizer_step_failing_at_each_group_is_undone(qwen3, monkeypatch, mode):  # noqa: F811
    data = batches(3, 6)
    original = torch.optim.AdamW.step
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                               timeout_s=60),
                 plan=replace(qwen3.options.plan, mode=mode)) as trainer:
        groups = len(trainer.driver.groups)
        assert groups >= 2  # several update groups: a failure part-way leaves some applied
        trainer.step(data[0])
        for fail_at in range(groups):
            masters, opt_state = _snapshot(trainer)
            calls = []

            def broken(self, *args, fail_at=fail_at, calls=calls, **kwargs):
                calls.append(1)
                out = original(self, *args, **kwargs)  # the group is updated, then it raises
                if len(calls) == fail_at + 1:
                    raise FloatingPointError("injected optimizer fault")
                return out

            with monkeypatch.context() as patch:
                patch.setattr(torch.optim.AdamW, "step", broken)
                # The update is the step's own OPT actions (both modes), so the step fails.
                start = time.monotonic()
                with pytest.raises(StepFailed) as info:
                    trainer.step(data[1])
                assert time.monotonic() - start < 10
            err = info.value
            assert err.step == 1 and err.stream == "the optimizer update"
            assert "injected optimizer fault" in str(err) and "undone" in str(err)
            assert isinstance(err.cause.__cause__, FloatingPointError)
            _assert_state_is(trainer, masters, opt_state, steps=1)
        _assert_continues_like(trainer, qwen3, data, ADAMW, mode, upto=1)
    # close() and a later close never raise
    trainer.close()


def test_async_optimizer_failure_fails_its_own_step_then_close(qwen3, monkeypatch):  # noqa: F811
    data = batches(2, 6)
    # Async updates are their step's OPT actions too: the failing update fails the step that
    # owes it, with the shadow the next step computes with put back (one step stale).
    trainer = Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                           timeout_s=60), plan=replace(qwen3.options.plan,
                                                                       mode="async"))
    trainer.step(data[0])
    masters, opt_state = _snapshot(trainer)
    shadow = trainer.store.shadow.clone()

    def broken(self, *args, **kwargs):
        raise RuntimeError("optimizer exploded")

    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.SGD, "step", broken)
        with pytest.raises(StepFailed, match="optimizer exploded") as info:
            trainer.step(data[1])
    assert info.value.step == 1 and "undone" in str(info.value)
    assert torch.equal(trainer.store.shadow, shadow)
    _assert_state_is(trainer, masters, opt_state, steps=1)  # state_dict works too
    trainer.close()
    trainer.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_starts_no_thread_but_its_workers_streams(qwen3, mode):  # noqa: F811
    """Every update is a schedule action on the host queue, run by the thread that calls
    step() (the optimizer driver has no thread): the only threads a trainer starts are its
    workers' stream threads, so no thread runs work the schedule does not show."""
    before = set(threading.enumerate())
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=SGD, device="virtual", timeout_s=60),
                 plan=replace(qwen3.options.plan, mode=mode)) as trainer:
        for batch in batches(2, 6):
            trainer.step(batch)
        trainer.state_dict()
        streams = {f"rpcompile-{w.name}-{s}" for w in trainer.workers for s in STREAMS}
        started = {t.name for t in threading.enumerate() if t not in before}
    assert started and started <= streams, sorted(started - streams)


def test_raising_error_listener_does_not_kill_the_streams(qwen3, monkeypatch):  # noqa: F811
    data = batches(3, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      chaos=3, timeout_s=60)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        program = next(p for p in qwen3.stages if p.kind == "tail")

        def bad_listener(error):
            raise ValueError("listener bug")

        for w in trainer.workers:
            w.add_error_listener(bad_listener)
        with monkeypatch.context() as patch:
            _raise_on_call(patch, program, 0, KeyError("stage fault"))
            start = time.monotonic()
            with pytest.raises(StepFailed) as info:
                trainer.step(data[1])
            assert time.monotonic() - start < 10
        assert info.value.stage == program.name and isinstance(info.value.cause, KeyError)
        assert all(not w.dead_streams() for w in trainer.workers)
        _assert_state_is(trainer, masters, opt_state, steps=1)
        _assert_continues_like(trainer, qwen3, data, ADAMW, "sync", upto=1)


class ThreadKilled(BaseException):
    pass


def test_a_stream_loop_killed_fails_the_step_at_once(qwen3):  # noqa: F811
    data = batches(3, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      timeout_s=60)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        worker = trainer.workers[0]
        thread = next(t for t in worker._threads if t.name.endswith("-compute"))
        # Raised in the stream thread at its next bytecode: outside an item, it escapes the
        # item loop (inside one, it fails the item); either way the step must fail at once.
        hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                         ctypes.py_object(ThreadKilled))
        assert hit == 1
        start = time.monotonic()
        with pytest.raises(StepFailed) as info:
            trainer.step(data[1])
        assert time.monotonic() - start < 5
        assert "ThreadKilled" in str(info.value) and worker.name in str(info.value)
        assert thread.is_alive()  # the stream serves its queue again
        _assert_state_is(trainer, masters, opt_state, steps=1)
        _assert_continues_like(trainer, qwen3, data, ADAMW, "sync", upto=1)


def _stall(monkeypatch, program, release: threading.Event, seconds: float | None = None):
    """Make ``program``'s forward block until ``release`` is set (or for ``seconds``)."""
    module = program.graph_module
    original = type(module).forward

    def slow(*args):
        if seconds is None:
            release.wait(120)
        else:
            time.sleep(seconds)
        return original(module, *args)

    monkeypatch.setattr(module, "forward", slow)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_watchdog_fires_at_its_time_and_the_trainer_goes_on(qwen3, monkeypatch, mode):  # noqa: F811
    data = batches(3, 6)
    timeout = 2.0
    release = threading.Event()
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      timeout_s=timeout), plan=replace(qwen3.options.plan,
                                                                       mode=mode)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        program = [p for p in qwen3.stages if p.kind == "forward"][-1]
        try:
            with monkeypatch.context() as patch:
                _stall(patch, program, release)
                start = time.monotonic()
                with pytest.raises(StepTimeout, match=r"did not finish within timeout_s=2\.0"):
                    trainer.step(data[1])
                elapsed = time.monotonic() - start
            # The watchdog fires at the deadline; the slack is for a loaded machine (CI).
            assert timeout <= elapsed <= 1.1 * timeout + 1.0, elapsed
            assert trainer.executor.abandoned  # the stuck worker was replaced
            _assert_state_is(trainer, masters, opt_state, steps=1)
            _assert_continues_like(trainer, qwen3, data, ADAMW, mode, upto=1)
        finally:
            release.set()


def test_close_from_another_thread_aborts_the_step(qwen3, monkeypatch):  # noqa: F811
    trainer = Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                           timeout_s=60))
    trainer.step(token_batch(6))
    masters, opt_state = _snapshot(trainer)
    program = next(p for p in qwen3.stages if p.kind == "forward")
    with monkeypatch.context() as patch:
        _stall(patch, program, threading.Event(), seconds=0.3)
        closer = threading.Timer(0.2, trainer.close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(StepFailed) as info:
            trainer.step(token_batch(6, seed=3))
        elapsed = time.monotonic() - start
        closer.join()
    assert elapsed < 3
    assert isinstance(info.value.cause, StepAborted) and "closed" in str(info.value)
    with pytest.raises(RuntimeError, match="closed"):
        trainer.step(token_batch(6))
    after, opt_after = _snapshot(trainer)
    assert all(torch.equal(after[n], v) for n, v in masters.items())
    _assert_same_optimizer_state(opt_state, opt_after)
    assert trainer.steps_done == 1


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in the main thread for the test's duration.
    ``_thread.interrupt_main()`` does nothing while SIGINT is ignored, and a process inherits
    an ignored SIGINT when a shell without job control starts it in the background (as a
    suite run with ``&`` does), so the tests that send a Ctrl-C set Python's default."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_keyboard_interrupt_in_dispatch_reraises_itself(qwen3, monkeypatch, ctrl_c_raises):  # noqa: F811
    data = batches(3, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      chaos=5, timeout_s=60)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        original = Executor._do_ACC

        def interrupted(self, run, a):
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(Executor, "_do_ACC", interrupted)
            with pytest.raises(KeyboardInterrupt):
                trainer.step(data[1])
        assert Executor._do_ACC is original
        _assert_state_is(trainer, masters, opt_state, steps=1)
        # A real Ctrl-C (SIGINT's KeyboardInterrupt in the main thread) while the host waits.
        program = next(p for p in qwen3.stages if p.kind == "forward")
        # The forward stays stalled until the Ctrl-C has been sent: the step cannot end
        # before it arrives, however late the timer thread runs on a loaded machine.
        release = threading.Event()

        def ctrl_c() -> None:
            _thread.interrupt_main()
            release.set()

        with monkeypatch.context() as patch:
            _stall(patch, program, release)
            timer = threading.Timer(0.1, ctrl_c)
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                trainer.step(data[1])
            timer.join()
        _assert_state_is(trainer, masters, opt_state, steps=1)
        _assert_continues_like(trainer, qwen3, data, ADAMW, "sync", upto=1)


def test_keyboard_interrupt_during_the_drain_reraises_itself(qwen3, monkeypatch,  # noqa: F811
                                                            ctrl_c_raises):
    # A fault aborts the steps in flight; a Ctrl-C while they are taken apart (the workers'
    # streams draining) re-raises itself once they are, the state the last committed step's.
    data = batches(3, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      timeout_s=60)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        original = Worker.synchronize
        fired = []

        def synchronize(self, timeout=None):
            if not fired:
                fired.append(1)
                _thread.interrupt_main()  # delivered to this (main) thread right here
                time.sleep(0.05)
            return original(self, timeout)

        program = next(p for p in qwen3.stages if p.kind == "tail")
        with monkeypatch.context() as patch:
            patch.setattr(Worker, "synchronize", synchronize)
            _raise_on_call(patch, program, 0, KeyError("stage fault"))
            with pytest.raises(KeyboardInterrupt):
                trainer.step(data[1])
        assert fired
        _assert_state_is(trainer, masters, opt_state, steps=1)
        _assert_continues_like(trainer, qwen3, data, ADAMW, "sync", upto=1)


def test_concurrent_step_calls_name_the_rule(qwen3, monkeypatch):  # noqa: F811
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                      timeout_s=60)) as trainer:
        trainer.step(token_batch(6))
        program = next(p for p in qwen3.stages if p.kind == "forward")
        errors = []
        with monkeypatch.context() as patch:
            _stall(patch, program, threading.Event(), seconds=0.3)
            first = threading.Thread(target=lambda: trainer.step(token_batch(6, seed=2)))
            first.start()
            time.sleep(0.1)
            try:
                trainer.step(token_batch(6, seed=3))
            except RuntimeError as exc:
                errors.append(exc)
            first.join()
        assert errors and "one step at a time" in str(errors[0])
        assert "finish_step" not in str(errors[0])
        assert trainer.steps_done == 2


def test_empty_batch_is_refused_with_the_fix(qwen3):  # noqa: F811
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                      timeout_s=60)) as trainer:
        with pytest.raises(ValueError, match="batch is empty"):
            trainer.step(torch.zeros(0, 12, dtype=torch.long))
        assert trainer.steps_done == 0
        trainer.step(token_batch(6))


def test_default_watchdog_from_the_plan(qwen3):  # noqa: F811
    from rpcompile.runtime.trainer import TIMEOUT_FLOOR_S, default_timeout_s

    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=SGD, device="virtual")) as trainer:
        assert trainer.timeout_s == default_timeout_s(qwen3) >= TIMEOUT_FLOOR_S
        assert trainer.executor.timeout_s == trainer.timeout_s
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                      timeout_s=float("inf"))) as trainer:
        assert trainer.executor.timeout_s is None


@pytest.mark.parametrize("where", ["update", "unscale"])
def test_a_failed_step_leaves_the_loss_scaler_as_before(qwen3, monkeypatch, where):  # noqa: F811
    """A failed update (inside its step: sync OPT actions) or a failure while the step closes (unscaling
    its gradients) leaves the dynamic loss scaler exactly as before the step, like the masters;
    the run then goes on bit for bit like one that never saw the failed step, scaler included.
    The second clean step grows the scale, so a scaler left advanced shows."""
    data = batches(4, 6)
    config = LossScaleConfig(init_scale=2.0**8, growth_interval=2)

    def make_trainer():
        return Trainer(qwen3,
                       train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                     timeout_s=60, loss_scale=config))

    with make_trainer() as skip:  # the run that skipped the failed step
        want_losses = [skip.step(b) for b in (data[0], data[2], data[3])][1:]
        want_masters, want_opt = _snapshot(skip)
        want_scaler = skip.loss_scaler.state_dict()
    assert want_scaler["scale"] == 2.0**9  # grown once, at the second clean step

    def broken(self, *args, **kwargs):
        raise FloatingPointError("injected fault")

    with make_trainer() as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        scaler = trainer.loss_scaler.state_dict()
        with monkeypatch.context() as patch:
            if where == "update":
                patch.setattr(torch.optim.AdamW, "step", broken)
                # Sync updates are the schedule's OPT actions (deferred order with loss
                # scaling): the update fails inside its own step.
                with pytest.raises(StepFailed, match="undone"):
                    trainer.step(data[1])
            else:
                patch.setattr(DynamicLossScaler, "unscale_", broken)
                # Unscaling is part of the step's one gradient check, at its first (deferred)
                # OPT: the step fails at that action.
                with pytest.raises(StepFailed, match="injected fault") as info:
                    trainer.step(data[1])
                assert isinstance(info.value.cause, FloatingPointError)
        assert trainer.loss_scaler.state_dict() == scaler
        _assert_state_is(trainer, masters, opt_state, steps=1)
        losses = [trainer.step(b) for b in (data[2], data[3])]
        assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
        assert trainer.loss_scaler.state_dict() == want_scaler
        _assert_state_is(trainer, want_masters, want_opt, steps=3)

"""A stream of steps (``Trainer.fit``) with two steps in flight: a failure anywhere (each
thread the runtime runs actions on: a worker's compute, weight upload, activation upload and
download streams, the host queue, the optimizer's own update, the watchdog, an interrupt)
discards every step not yet committed, leaves the state of the last committed step bit for
bit, and the same stream then runs the discarded batches again, bit for bit as a run without
the fault; a checkpoint taken inside a stream is of a committed step, and a run resumed from
it trains on as the stream would have."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from rpcompile.runtime.executor import Executor, StepFailed, StepTimeout
from rpcompile.runtime.trainer import Trainer
from tests.runtime.test_executor import (
    ADAMW,
    _assert_same_optimizer_state,
    _snapshot,
    batches,
    qwen3,  # noqa: F401  (fixture)
)

FAIL_AT = 2  # the run step the fault hits; step 3 is in flight with it


def _straight(compiled, data, mode):
    """The run without a fault, one step() at a time: the state after each step (masters,
    pending gradients, optimizer state; index k: after k steps), the losses and the masters
    at the end."""
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(compiled.options.plan, mode=mode)) as trainer:
        states, losses = [_snapshot(trainer)], []
        for batch in data:
            losses.append(trainer.step(batch))
            states.append(_snapshot(trainer))
        return states, losses, trainer.masters()


def _assert_at_step(trainer, states, k):
    """The masters, pending gradients and optimizer state are those after ``k`` steps of the
    straight run, bit for bit."""
    masters_now, opt_now = _snapshot(trainer)
    for name, value in states[k][0].items():
        assert torch.equal(masters_now[name], value), name
    _assert_same_optimizer_state(states[k][1], opt_now)


def _assert_runs_on_exactly(trainer, stream, got, losses, masters):
    """The rest of ``stream`` (the discarded batches again, then the others) gives, after the
    results ``got`` so far, every step's loss and the final masters of the straight run."""
    got = got + list(stream)
    assert [r.step for r in got] == list(range(len(losses)))
    for k, (r, want) in enumerate(zip(got, losses)):
        assert torch.equal(r.loss, want), f"step {k}"
    for name, value in trainer.masters().items():
        assert torch.equal(value, masters[name]), name


def _plant(patch, where, trainer, release):
    """Make the first action of ``where`` in run step FAIL_AT fail (or stall); returns the
    steps it fired in."""
    fired: list[int] = []

    def once(run):
        if run.k == FAIL_AT and not fired:
            fired.append(run.k)
            return True
        return False

    kind = {"compute": "B", "weight_upload": "UP", "activation_upload": "H2D",
            "download": "D2H", "host": "ACC", "optimizer": "OPT", "watchdog": "B",
            "interrupt": "ACC"}[where]
    original = getattr(Executor, f"_do_{kind}")
    armed = [False]

    def hook(optimizer, args, kwargs):
        if armed[0]:
            raise RuntimeError("planted: the optimizer's step")

    trainer.optimizer.register_step_pre_hook(hook)

    def planted(self, run, a):
        if not once(run):
            return original(self, run, a)
        if where == "optimizer":
            armed[0] = True
            try:
                return original(self, run, a)
            finally:
                armed[0] = False
        if where == "watchdog":
            release.wait(60)  # a worker stuck past the deadline
            return original(self, run, a)
        if where == "interrupt":
            raise KeyboardInterrupt
        raise RuntimeError(f"planted: {a}")

    patch.setattr(Executor, f"_do_{kind}", planted)
    return fired


@pytest.mark.parametrize("where", ["compute", "weight_upload", "activation_upload",
                                   "download", "host", "optimizer", "watchdog", "interrupt"])
def test_a_fault_with_two_steps_in_flight_discards_both_and_the_retry_is_exact(
        qwen3, monkeypatch, where):  # noqa: F811
    mode = "async"
    data = batches(5, 6)
    states, losses, masters = _straight(qwen3, data, mode)
    release = threading.Event()
    timeout = 6.0 if where == "watchdog" else 60.0  # a loaded machine: steps take ~1 s
    expected = {"watchdog": StepTimeout, "interrupt": KeyboardInterrupt}.get(where, StepFailed)
    try:
        with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                          chaos=3, timeout_s=timeout),
                     plan=replace(qwen3.options.plan, mode=mode)) as trainer:
            got = []
            with monkeypatch.context() as patch:
                fired = _plant(patch, where, trainer, release)
                stream = trainer.fit(data)
                with pytest.raises(expected) as info:
                    while True:  # the fault surfaces at the oldest step in flight
                        got.append(next(stream))
            release.set()
            assert fired == [FAIL_AT]
            committed = len(got)
            assert committed in (FAIL_AT - 1, FAIL_AT)
            if isinstance(info.value, StepFailed):  # the steps in flight are discarded: both,
                # or the later one alone when the earlier's commit had begun as the fault came
                assert info.value.discarded in ((committed, committed + 1), (committed,))
            # The state is the last committed step's, bit for bit.
            _assert_at_step(trainer, states, committed)
            assert trainer.steps_done == stream.committed == committed
            assert all(w.memory_in_use == 0 for w in trainer.workers)
            # The same stream runs the discarded batches again, then the rest.
            _assert_runs_on_exactly(trainer, stream, got, losses, masters)
    finally:
        release.set()


def test_a_checkpoint_in_a_stream_is_of_a_committed_step_and_resumes_exactly(
        qwen3, tmp_path):  # noqa: F811
    # Async: saving lets the steps in flight commit first (their results still come, in
    # order); the checkpoint holds as many steps as the stream has taken batches, and a
    # trainer loaded from it trains on the rest as the stream itself goes on.
    data = batches(5, 6)
    path = tmp_path / "ckpt"
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual", chaos=2),
                 plan=replace(qwen3.options.plan, mode="async")) as trainer:
        stream = trainer.fit(data)
        first = next(stream)
        trainer.save_checkpoint(path)
        taken = trainer.steps_done
        assert taken == stream.committed + stream.in_flight >= 1  # every batch taken
        rest = [first, *stream]
        assert [r.step for r in rest] == list(range(len(data)))
        masters = trainer.masters()
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, mode="async")) as resumed:
        resumed.load_checkpoint(path)
        assert resumed.steps_done == taken
        again = list(resumed.fit(data[taken:]))
        for r, want in zip(again, rest[taken:]):
            assert torch.equal(r.loss, want.loss)
        for name, value in resumed.masters().items():
            assert torch.equal(value, masters[name]), name


def test_compiled_fit_streams_the_compiled_trainers_steps(qwen3):  # noqa: F811
    compiled = qwen3.replan(2, microbatches=3)
    try:
        data = batches(3, 6)
        results = list(compiled.fit(data, steps=2))
        assert [r.step for r in results] == [0, 1]
        assert compiled.trainer().steps_done == 2
        assert compiled.trainer().last is results[-1]
    finally:
        compiled.close()


def test_a_slow_loop_gets_every_steps_result_in_order(qwen3):  # noqa: F811
    # The caller's own work between results (logging, evaluation) outlasts a step: the steps
    # in flight commit meanwhile, and each result still comes, in order, with the losses of
    # steps run one at a time.
    data = batches(4, 6)
    _states, losses, _masters = _straight(qwen3, data, "async")
    got = []
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, mode="async")) as trainer:
        for result in trainer.fit(data):
            got.append(result)
            time.sleep(0.5)
    assert [r.step for r in got] == list(range(len(data)))
    for r, want in zip(got, losses):
        assert torch.equal(r.loss, want)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_scheduler_given_to_fit_steps_as_in_a_step_loop(qwen3, mode):  # noqa: F811
    # fit(scheduler=) steps the scheduler as each step commits, before the next one opens:
    # losses and masters are those of a step() loop stepping it after each step, bit for
    # bit, though the next step is already in flight when a result comes back.
    data = batches(4, 6)

    def run(stream):
        with Trainer(qwen3,
                     train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                   chaos=5),
                     plan=replace(qwen3.options.plan, mode=mode)) as trainer:
            scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer,
                                                          lambda k: 1.0 / (k + 1))
            if stream:
                losses = [r.loss for r in trainer.fit(data, scheduler=scheduler)]
            else:
                losses = []
                for batch in data:
                    losses.append(trainer.step(batch))
                    scheduler.step()
            return losses, trainer.masters(), scheduler.last_epoch

    losses, masters, epochs = run(stream=False)
    got, got_masters, got_epochs = run(stream=True)
    assert got_epochs == epochs == len(data)
    for a, b in zip(got, losses):
        assert torch.equal(a, b)
    for name, value in masters.items():
        assert torch.equal(got_masters[name], value), name


def test_an_interrupt_as_the_oldest_step_commits_stands_it_and_stops_the_next(
        qwen3, monkeypatch):  # noqa: F811
    # Ctrl-C reaches the loop while it waits for step 0, just as step 0 commits: step 0
    # stands and its result comes back; step 1, in flight, is discarded and the next next()
    # raises the KeyboardInterrupt itself (not a failure without a cause). The same stream
    # then runs step 1's batch again and goes on, bit for bit.
    from rpcompile.runtime.step_state import StepState

    data = batches(3, 6)
    _states, losses, masters = _straight(qwen3, data, "async")
    real_init = StepState.__init__

    class InterruptedAsItCommits(threading.Event):
        def wait(self, timeout=None):
            done = super().wait(timeout)
            if done:
                self.wait = super().wait  # once
                raise KeyboardInterrupt
            return done

    def init(self, k, *args, **kwargs):
        real_init(self, k, *args, **kwargs)
        if k == 0:
            self.committed = InterruptedAsItCommits()

    monkeypatch.setattr(StepState, "__init__", init)
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual", chaos=3),
                 plan=replace(qwen3.options.plan, mode="async")) as trainer:
        stream = trainer.fit(data)
        first = next(stream)
        assert first.step == 0 and torch.equal(first.loss, losses[0])
        with pytest.raises(KeyboardInterrupt):
            next(stream)
        assert trainer.steps_done == stream.committed == 1
        rest = list(stream)
        assert [r.step for r in rest] == [1, 2]
        for r, want in zip(rest, losses[1:]):
            assert torch.equal(r.loss, want)
        for name, value in trainer.masters().items():
            assert torch.equal(value, masters[name]), name


def test_ending_a_stream_commits_the_steps_in_flight_and_takes_no_more(qwen3):  # noqa: F811
    data = batches(5, 6)
    taken = []

    def source():
        for batch in data:
            taken.append(batch)
            yield batch

    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, mode="async")) as trainer:
        stream = trainer.fit(source())
        results = [next(stream)]
        stream.end()
        results += list(stream)
        assert len(taken) == len(results) == trainer.steps_done < len(data)
        assert [r.step for r in results] == list(range(len(results)))


def test_a_step_whose_commit_began_as_the_next_step_failed_stands(qwen3, monkeypatch):  # noqa: F811
    # Step FAIL_AT - 1 commits on the host queue; step FAIL_AT's backward fails just as that
    # commit begins. The commit runs to its end, so the step stands: its result comes back,
    # the failure after it names only the later steps, and only those run again.
    data = batches(5, 6)
    states, losses, masters = _straight(qwen3, data, "async")
    commit, backward = Executor._commit, Executor._do_B
    began = threading.Event()

    def slow_commit(self, state):
        if state.k == FAIL_AT - 1:
            began.set()
            time.sleep(0.5)  # the failure lands here
        return commit(self, state)

    def failing_backward(self, run, a):
        if run.k == FAIL_AT:
            began.wait(30)
            raise RuntimeError("planted: a backward job")
        return backward(self, run, a)

    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, mode="async")) as trainer:
        got = []
        with monkeypatch.context() as patch:
            patch.setattr(Executor, "_commit", slow_commit)
            patch.setattr(Executor, "_do_B", failing_backward)
            stream = trainer.fit(data)
            with pytest.raises(StepFailed) as info:
                while True:
                    got.append(next(stream))
        assert [r.step for r in got] == list(range(FAIL_AT))
        assert info.value.discarded in ((FAIL_AT,), (FAIL_AT, FAIL_AT + 1))  # in flight then
        assert trainer.steps_done == stream.committed == FAIL_AT
        _assert_at_step(trainer, states, FAIL_AT)
        _assert_runs_on_exactly(trainer, stream, got, losses, masters)

"""The host side of the transfers (rpcompile.runtime.memory.HostStaging): one buffer per
staging slot of the schedule (rpcompile.passes.staging), of exactly the slot's bytes, lent
to the downloads the schedule gives that slot, one at a time.

What a run holds there is the figure the plan states for its transfer staging (the sum of
the slots), whatever the threads' timing, even with the host queue behind; no download
stages more than the schedule gives it; the buffers are reused from step to step and across
shorter batches (training still equals eager Hugging Face with them reused, chaos delays
on); a failed step gives back everything it took, and a replaced worker's buffers are never
lent again."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.errors import InvalidInput
from rpcompile.passes.memory import host_memory
from rpcompile.runtime.actions import Actions
from rpcompile.runtime.errors import StagingError
from rpcompile.runtime.executor import Executor, StepFailed
from rpcompile.runtime.memory import HostStaging
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from tests.runtime.test_trainer import eager_training
from tests.tiny_models import hf_model, token_batch


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_slot_lends_one_buffer_of_its_size_one_download_at_a_time():
    pool = HostStaging([1000, 24])
    a = pool.take(1000, slot=0)
    c = pool.take(24, slot=1)
    assert a.numel() == 1000 and c.numel() == 24
    assert pool.held_bytes == pool.lent_bytes == pool.peak_lent_bytes == 1024
    with pytest.raises(StagingError, match="slot 0 is still lent"):
        pool.take(1000, slot=0)
    with pytest.raises(StagingError, match="does not fit its host staging slot 1"):
        pool.take(25, slot=1)
    pool.give(a)
    assert pool.lent_bytes == 24 and pool.held_bytes == 1024
    short = pool.take(500, slot=0)  # a shorter batch: the first bytes of the slot's buffer
    assert short.numel() == 500 and short.data_ptr() == a.data_ptr() and pool.registered == 2
    with pytest.raises(InvalidInput):
        pool.give(a.clone())
    pool.give(short)
    with pytest.raises(InvalidInput):
        pool.give(short)
    with pytest.raises(StagingError, match="has no host staging slot"):
        pool.take(77)
    assert pool.reclaim([c, a]) == 1 and pool.lent_bytes == 0  # a is back already
    pool.release()
    assert pool.held_bytes == 0
    assert pool.take(24, slot=1).data_ptr() != c.data_ptr() and pool.registered == 3
    assert pool.take(0).numel() == 0 and pool.lent_bytes == 24  # nothing to hold
    bare = HostStaging()  # no slots (no downloads): a buffer of its own, dropped when back
    own = bare.take(77)
    assert own.numel() == 77 and bare.held_bytes == 77
    bare.give(own)
    assert bare.held_bytes == 0


def test_a_quarantined_buffer_is_held_and_never_lent_again():
    pool = HostStaging([64])
    stuck = pool.take(64, slot=0)
    assert pool.quarantine([stuck]) == 1
    assert pool.lent_bytes == 0 and pool.held_bytes == 64
    pool.give(stuck)  # a late give from the abandoned thread: it stays aside
    assert pool.reclaim([stuck]) == 0
    fresh = pool.take(64, slot=0)  # the slot makes a new buffer
    assert fresh.data_ptr() != stuck.data_ptr() and pool.held_bytes == 128


def test_a_values_tensors_share_one_buffer_of_exactly_their_bytes():
    pool = HostStaging()
    tensors = [torch.ones(3, dtype=torch.bfloat16), torch.arange(5, dtype=torch.int64),
               torch.zeros(2, 3, dtype=torch.float32), torch.ones(7, dtype=torch.bool),
               torch.empty(0, dtype=torch.float64)]
    buf, views = pool.carve(tensors)
    assert buf.numel() == sum(t.numel() * t.element_size() for t in tensors) == 6 + 40 + 24 + 7
    for t, v in zip(tensors, views):
        assert (v.shape, v.dtype) == (t.shape, t.dtype) and v.is_contiguous()
        assert v.data_ptr() % t.element_size() == 0  # widest first: aligned, no padding
        v.copy_(t)
    for t, v in zip(tensors, views):  # no view overlaps another
        assert torch.equal(v, t)


@pytest.mark.parametrize("arch,gpus,microbatches", [("qwen3", 2, 2), ("qwen3", 3, 4),
                                                    ("llama", 4, 3)])
def test_what_the_run_stages_is_the_plans_staging_figure(arch, gpus, microbatches):
    size = 2 * microbatches
    compiled = rpcompile.compile(hf_model(arch, layers=4), gpus=gpus,
                                 microbatches=microbatches, example_inputs=token_batch(size))
    run = simulate(compiled.schedule, compiled.plan, compiled.hardware)
    planned = host_memory(compiled.plan, "sync", run.peak_host_bytes).transfers
    assert compiled.host.transfers == planned == sum(compiled.schedule.staging_bytes) > 0
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                         chaos=3)) as trainer:
        pool = trainer.executor.staging
        held = []
        for k in range(4):
            trainer.step(token_batch(size, seed=k))
            assert pool.lent_bytes == 0  # every buffer given back by the step's end
            held.append(pool.held_bytes)
        made = pool.registered
        trainer.step(token_batch(size, seed=9))
    # Within the figure whatever the threads' timing: a buffer per slot, made once.
    assert max(held) <= planned, (held, planned)
    assert pool.registered == made  # reused from step to step, not made anew


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_with_the_host_queue_behind_the_pool_stays_within_its_figure(mode, monkeypatch):
    # One worker, three microbatches, steps overlapping, chaos delays on every stream, and
    # the host queue behind: the ACC of each step's first gradient job waits (up to 0.3 s)
    # until two more gradient downloads have started (async: the next step's of the same
    # stage; sync: the step's next ones). A download whose slot that ACC frees waits for it
    # (its reuse edge), so the wait runs out, and the pool holds its slots and no more.
    # Without that edge the download comes home while the ACC still waits, in a buffer of
    # its own: 1.73 (async) and 2.64 (sync) times the figure one replayed timing gives.
    compiled = rpcompile.compile(hf_model("qwen3", layers=4), gpus=1, microbatches=3,
                                 mode=mode, example_inputs=token_batch(6))
    grads = [a for a in compiled.schedule.actions[0] if a.kind == "D2H" and a.what == "grad"]
    first = min(a.stage for a in grads)
    real_acc, real_d2h = Actions._do_ACC, Executor._do_D2H
    started: list[int] = []  # the stages of the gradient downloads started, in order
    moved = threading.Condition()

    def d2h(self, run, a):
        if a.what == "grad":
            with moved:
                started.append(a.stage)
                moved.notify_all()
        return real_d2h(self, run, a)

    def late_acc(self, run, a):
        if a.stage == first:
            with moved:
                mine = len(started)
                moved.wait_for(lambda: len(started) > mine + 1, timeout=0.3)
        return real_acc(self, run, a)

    monkeypatch.setattr(Executor, "_do_D2H", d2h)
    monkeypatch.setattr(Actions, "_do_ACC", late_acc)
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                         chaos=5)) as trainer:
        pool = trainer.executor.staging
        for _ in trainer.fit(token_batch(6, seed=k) for k in range(4)):
            pass
        held = pool.held_bytes
    assert held <= compiled.host.transfers == sum(compiled.schedule.staging_bytes), (
        held, compiled.host.transfers)


def test_training_with_reused_staging_equals_eager():
    model = hf_model("qwen3", layers=3)
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=token_batch(6))
    data = [token_batch(6, seed=20 + k) for k in range(4)]
    eager_losses, eager_model = eager_training(model, data, 3, SGD)
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                         chaos=7)) as trainer:
        # Every buffer given back is NaN until a download fills it again: a reader it was
        # given back too early for reads NaN whatever the threads' timing.
        trainer.executor.staging.poison = True
        losses = [trainer.step(b) for b in data]
        masters = trainer.masters()
        reused = trainer.executor.staging.registered
    # Four steps ran on the buffers the first made (a reuse that came too early would
    # have overwritten an activation or a gradient still to be read).
    assert reused < 2 * sum(a.kind == "D2H" for lst in compiled.schedule.actions for a in lst)
    for got, want in zip(losses, eager_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p in eager_model.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_failed_step_gives_back_what_it_staged(monkeypatch):
    compiled = rpcompile.compile(hf_model("qwen3", layers=3), gpus=3, microbatches=3,
                                 example_inputs=token_batch(6))
    real = Executor._do_H2D
    calls = []

    def broken(self, run, a):
        if self.staging.lent_bytes > 0:  # a value on the host, waiting for this reader
            calls.append(a)
            raise RuntimeError("injected upload fault")
        return real(self, run, a)

    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=SGD,
                               device="virtual")) as trainer:
        pool = trainer.executor.staging
        monkeypatch.setattr(Executor, "_do_H2D", broken)
        with pytest.raises(StepFailed, match="injected upload fault"):
            trainer.step(token_batch(6))
        assert calls and pool.lent_bytes == 0 and pool.held_bytes > 0
        monkeypatch.setattr(Executor, "_do_H2D", real)
        trainer.step(token_batch(6))
        assert pool.lent_bytes == 0


def test_buffers_of_a_replaced_worker_are_never_lent_again(monkeypatch):
    # A download stuck past the step's deadline: its worker is replaced, and its thread,
    # abandoned, may still write into the buffer it took. That buffer must stay aside, held
    # but never lent to a later download, after the failed step and after the next ones.
    compiled = rpcompile.compile(hf_model("qwen3", layers=3), gpus=3, microbatches=3,
                                 example_inputs=token_batch(6))
    real = HostStaging.carve
    stuck: list[torch.Tensor] = []
    lent_later: list[int] = []
    resumed = threading.Event()

    def carve(self, tensors, record=None, slot=None):
        buf, views = real(self, tensors, record, slot)
        if not stuck:
            stuck.append(buf)
            time.sleep(3.0)  # past the 1 s deadline; then it goes on writing into buf
            resumed.set()
        else:
            lent_later.append(buf.data_ptr())
        return buf, views

    monkeypatch.setattr(HostStaging, "carve", carve)
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual",
                                         timeout_s=1.0)) as trainer:
        pool = trainer.executor.staging
        with pytest.raises(StepFailed):
            trainer.step(token_batch(6))
        assert trainer.executor.abandoned  # the stuck worker was replaced
        assert pool.lent_bytes == 0 and pool.held_bytes >= stuck[0].numel()
        lent_later.clear()
        assert resumed.wait(10)
        time.sleep(0.5)  # the abandoned thread finishes its item, writing into the buffer
        for k in range(2):
            trainer.step(token_batch(6, seed=k))
            assert pool.lent_bytes == 0
    assert lent_later and stuck[0].data_ptr() not in lent_later


def test_shorter_batches_stage_in_the_buffers_of_the_planned_length():
    # Bucketed lengths (finetune's padding): a shorter batch takes the start of its slot's
    # buffer. A pool that reused buffers by exact size only would hold the staging of every
    # length: 3.6 times the figure here.
    compiled = rpcompile.compile(hf_model("qwen3", layers=3), gpus=3, microbatches=3,
                                 example_inputs=token_batch(6, seq=32))
    lengths = [32, 24, 31, 16, 28, 20]
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=SGD,
                               device="virtual")) as trainer:
        pool = trainer.executor.staging
        pool.poison = True  # a shorter download reads only its own bytes of a longer buffer
        for k, seq in enumerate(lengths):
            loss = trainer.step(token_batch(6, seq=seq, seed=k))
            assert pool.lent_bytes == 0 and torch.isfinite(loss)
        for k, seq in enumerate(lengths):
            trainer.step(token_batch(6, seq=seq, seed=10 + k))
        held = pool.held_bytes
        assert all(torch.isfinite(p).all() for p in trainer.masters().values())
    assert held <= compiled.host.transfers, (held, compiled.host.transfers)
    assert pool.held_bytes == pool.lent_bytes == 0  # closing the trainer let the pool go


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "qwen3_moe", "qwen3_tied"])
def test_no_download_stages_more_than_the_schedule_gives_it(arch, monkeypatch):
    # The staging figure replays the schedule's download sizes; a download that carved
    # more than its action's bytes would hold more than the figure says.
    compiled = rpcompile.compile(hf_model(arch, layers=3), gpus=3, microbatches=3,
                                 example_inputs=token_batch(6))
    real_carve = HostStaging.carve
    real_d2h = Executor._do_D2H
    seen: list[tuple[int, int]] = []
    local = threading.local()

    def carve(self, tensors, record=None, slot=None):
        buf, views = real_carve(self, tensors, record, slot)
        seen.append((buf.numel(), local.action.bytes))
        return buf, views

    def d2h(self, run, a):
        local.action = a
        return real_d2h(self, run, a)

    monkeypatch.setattr(HostStaging, "carve", carve)
    monkeypatch.setattr(Executor, "_do_D2H", d2h)
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=SGD,
                               device="virtual")) as trainer:
        trainer.step(token_batch(6))
    downloads = sum(a.kind == "D2H" for lst in compiled.schedule.actions for a in lst
                    if a.step == 0)
    assert len(seen) == downloads > 0
    over = [(got, planned) for got, planned in seen if got > planned]
    assert not over, over

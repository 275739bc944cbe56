"""The host side of the transfers (rpcompile.runtime.memory.HostStaging): one buffer per
download, of exactly the bytes it holds, given back once read and lent again to a later
download it fits (within twice its size).

What a run holds there is the figure the plan states for its transfer staging (the
simulator's replay of the same rule over the schedule), no download stages more than the
schedule gives it, the buffers are reused from step to step and across shorter batches
(training still equals eager Hugging Face with them reused, chaos delays on), a failed step
gives back everything it took, and a replaced worker's buffers are never lent again."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.passes.memory import host_memory
from rpcompile.runtime.executor import Executor, StepFailed
from rpcompile.runtime.memory import HostStaging
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from rpcompile.sim.engine.measures import _staging_pool
from tests.runtime.test_trainer import eager_training
from tests.tiny_models import hf_model, token_batch


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


def test_a_buffer_is_exactly_the_bytes_asked_for_and_the_smallest_free_one_is_lent():
    pool = HostStaging()
    a = pool.take(1000)
    b = pool.take(1000)
    c = pool.take(24)
    assert (a.numel(), b.numel(), c.numel()) == (1000, 1000, 24)
    assert a.dtype == torch.uint8 and not a.is_pinned()
    assert pool.held_bytes == pool.lent_bytes == pool.peak_lent_bytes == 2024
    pool.give(a)
    assert pool.lent_bytes == 1024 and pool.held_bytes == 2024
    again = pool.take(1000)
    assert again.data_ptr() == a.data_ptr() and pool.registered == 3  # lent again, not made
    other = pool.take(999)  # nothing free: a buffer of its own, of exactly its size
    assert other.numel() == 999 and pool.registered == 4 and pool.held_bytes == 3023
    with pytest.raises(ValueError, match="given back twice"):
        pool.give(a.clone())
    pool.give(again)
    with pytest.raises(ValueError, match="given back twice"):
        pool.give(again)
    pool.give(other)
    # Best fit: a shorter download takes the start of the smallest free buffer that holds it.
    short = pool.take(500)
    assert short.numel() == 500 and short.data_ptr() == other.data_ptr()
    assert pool.registered == 4 and pool.lent_bytes == 1000 + 24 + 999
    pool.give(short)
    assert pool.take(1001).numel() == 1001 and pool.registered == 5  # none holds it
    assert pool.reclaim([b, c, a]) == 2 and pool.lent_bytes == 1001  # a is back already
    pool.release()
    assert pool.held_bytes == 1001  # the lent one stays
    assert pool.take(0).numel() == 0 and pool.lent_bytes == 1001  # nothing to hold


def test_a_quarantined_buffer_is_held_and_never_lent_again():
    pool = HostStaging()
    stuck = pool.take(64)
    assert pool.quarantine([stuck]) == 1
    assert pool.lent_bytes == 0 and pool.held_bytes == 64
    pool.give(stuck)  # a late give from the abandoned thread: it stays aside
    assert pool.reclaim([stuck]) == 0
    fresh = pool.take(64)
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


def test_the_simulated_pool_replays_the_runtimes_rule():
    # (start, end, bytes) on the host. Two 100-byte downloads at once make two buffers; two
    # 60-byte ones later take them (the smallest free that holds them, within twice their
    # size); a third 60 at once makes its own, and a 7-byte one does not tie up a 100-byte
    # buffer: 267 bytes, though never more than 200 are on the host at once.
    stays = [(0, 2, 100), (1, 3, 100), (4, 6, 60), (4, 6, 60), (5, 6, 60), (7, 8, 7)]
    assert _staging_pool(stays) == 267
    # A buffer given back when another download starts is lent to it.
    assert _staging_pool([(0, 1, 50), (1, 2, 50), (2, 3, 40)]) == 50
    # A larger download than any free buffer makes its own.
    assert _staging_pool([(0, 1, 50), (2, 3, 60)]) == 110
    # A download that stays no time takes a buffer and gives it back at that instant.
    assert _staging_pool([(0, 0, 10), (0, 1, 10)]) == 20
    assert _staging_pool([(0, 0, 10), (1, 2, 10)]) == 10


@pytest.mark.parametrize("arch,gpus,microbatches", [("qwen3", 2, 2), ("qwen3", 3, 4),
                                                    ("llama", 4, 3)])
def test_what_the_run_stages_is_the_plans_staging_figure(arch, gpus, microbatches):
    size = 2 * microbatches
    compiled = rpcompile.compile(hf_model(arch, layers=4), gpus=gpus,
                                 microbatches=microbatches, example_inputs=token_batch(size))
    run = simulate(compiled.schedule, compiled.plan, compiled.hardware)
    planned = host_memory(compiled.plan, "sync", run.peak_host_bytes).transfers
    assert compiled.host.transfers == planned > 0
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
    # The pool within 5 % of the figure: the threads' timing may keep one more buffer of a
    # size on the host than the simulated order does, or fewer.
    assert max(held) <= 1.05 * planned, (held, planned)
    assert pool.registered <= made + 2  # reused from step to step, not made anew


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

    def carve(self, tensors, record=None):
        buf, views = real(self, tensors, record)
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
    # Bucketed lengths (finetune's padding): a batch down to half the planned length takes
    # the start of a buffer the planned length made. A pool that reused buffers by exact
    # size only holds the staging of every length: 3.6 times the figure here. This one
    # holds 1.16 times it, up to 2 times on a loaded CPU (the threads' timing keeps more
    # downloads of a length on the host at once than the simulated order of the planned one).
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
    assert held <= 2.5 * compiled.host.transfers, (held, compiled.host.transfers)
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

    def carve(self, tensors, record=None):
        buf, views = real_carve(self, tensors, record)
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

"""Transfer engine on virtual workers: bytes, priorities, chunking, dependencies, failures."""

from __future__ import annotations

import time

import pytest
import torch

from rpcompile.runtime.errors import UpstreamFailed, WorkerAborted, WorkerError
from rpcompile.runtime.transfers import Priority, TransferEngine
from rpcompile.runtime.workers import Event, VirtualWorker


@pytest.fixture
def worker():
    w = VirtualWorker(0, capacity_bytes=1 << 30)
    yield w
    w.shutdown(timeout=2)


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.0005)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_copies_every_byte(worker, dtype):
    engine = TransferEngine(worker, chunk_bytes=1000)  # does not divide the sizes below
    host = (torch.randn(3, 1237) * 100).to(dtype)
    up = engine.h2d(host, label="weights s0", tag="s0 weights")
    assert worker.memory_in_use == host.numel() * host.element_size()
    up.done.wait(timeout=10)
    assert up.dst.data_ptr() != host.data_ptr() and torch.equal(up.dst, host)
    assert up.chunks == -(-host.numel() * host.element_size() // 1000)
    down = engine.d2h(up.dst, after=[up.done], label="grads s0")
    down.done.wait(timeout=10)
    assert torch.equal(down.dst, host) and down.dst.data_ptr() != up.dst.data_ptr()
    assert [r.label for r in engine.history] == ["weights s0", "grads s0"]
    critical = engine.h2d(host[0], priority=Priority.CRITICAL, label="act")
    critical.done.wait(timeout=10)
    assert critical.chunks == 1 and torch.equal(critical.dst, host[0])
    # As a lowered schedule gives it: priority by name, chunk count per transfer.
    scheduled = engine.h2d(host, priority="bulk", chunks=7, label="UP s0 x7")
    scheduled.done.wait(timeout=10)
    assert scheduled.chunks == 7 and torch.equal(scheduled.dst, host)
    ten = torch.arange(10, dtype=torch.uint8)
    odd = engine.h2d(ten, chunks=6, label="10 bytes in 6")
    odd.done.wait(timeout=10)
    assert odd.chunks == 6 and torch.equal(odd.dst, ten)
    engine.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_critical_transfer_overtakes_a_bulk_one_within_one_chunk(worker, direction):
    chunk = 64 << 10
    engine = TransferEngine(worker, chunk_bytes=chunk)
    big = torch.randn((8 << 20) // 4)  # 8 MiB: 128 chunks
    small = torch.randn(1024)
    submit = engine.h2d if direction == "h2d" else engine.d2h
    finished: list[str] = []
    bulk = submit(big, label="bulk")
    bulk.done.add_callback(lambda e: finished.append("bulk"))
    _wait_until(lambda: bulk.chunks_done >= 2)
    critical = submit(small, priority=Priority.CRITICAL, label="critical")
    critical.done.add_callback(lambda e: finished.append("critical"))
    bulk.done.wait(timeout=30)
    critical.done.wait(timeout=30)
    assert finished == ["critical", "bulk"]
    # Nothing was picked between its submission and its copy: it waited only for the chunk
    # that was in flight.
    assert critical.waited_chunks == 0
    trace = engine.trace(direction)
    assert 2 <= trace.index(("critical", 0)) < len(trace) - 1
    assert sum(1 for label, _ in trace if label == "bulk") == bulk.chunks == 128
    assert torch.equal(bulk.dst, big) and torch.equal(critical.dst, small)
    engine.close()


def test_bulk_transfers_keep_submission_order_and_wait_for_their_inputs(worker):
    engine = TransferEngine(worker, chunk_bytes=4096)
    gate = Event("shadow refreshed")
    a = engine.h2d(torch.ones(5000), after=[gate], label="s1 weights")
    b = engine.h2d(torch.full((5000,), 2.0), label="s2 weights")
    b.done.wait(timeout=10)
    assert not a.done.is_set() and a.chunks_done == 0  # a's input is not ready; b went ahead
    gate.set()
    a.done.wait(timeout=10)
    assert torch.equal(a.dst, torch.ones(5000))
    c = engine.h2d(torch.zeros(20000), label="c")
    d = engine.h2d(torch.zeros(20000), label="d")
    d.done.wait(timeout=10)
    c.done.wait(timeout=10)
    labels = [label for label, _ in engine.trace("h2d") if label in ("c", "d")]
    assert labels == ["c"] * c.chunks + ["d"] * d.chunks
    engine.close()


def test_failed_input_fails_the_transfer_without_blocking_the_stream(worker):
    engine = TransferEngine(worker, chunk_bytes=1024)
    broken = Event("activation")
    t = engine.d2h(torch.zeros(4096), after=[broken], label="act m3")
    broken.fail(RuntimeError("compute failed"))
    with pytest.raises(UpstreamFailed, match="compute failed"):
        t.done.wait(timeout=5)
    # Its surplus pumps return at once: a later transfer on the same stream still runs.
    later = engine.d2h(torch.ones(10), label="later")
    later.done.wait(timeout=5)
    assert torch.equal(later.dst, torch.ones(10))
    engine.close()


def test_copy_error_surfaces_on_the_worker_with_the_transfer_name(worker):
    engine = TransferEngine(worker, chunk_bytes=1024)

    def broken_copy(dst, src):
        raise OSError("DMA fault")

    worker.copy_ = broken_copy
    t = engine.h2d(torch.zeros(1000), label="F2 weights")
    waiting = engine.h2d(torch.zeros(10), label="queued behind")
    with pytest.raises(UpstreamFailed):
        t.done.wait(timeout=5)
    with pytest.raises(WorkerError) as info:
        worker.synchronize(timeout=5)
    assert "F2 weights" in str(info.value) and "DMA fault" in str(info.value)
    assert info.value.stream == "weight_upload"
    with pytest.raises((UpstreamFailed, WorkerAborted)):
        waiting.done.wait(timeout=5)
    engine.close()


def test_chaos_mode_keeps_bytes_right():
    for seed in range(3):
        w = VirtualWorker(0, chaos=seed, chaos_max_delay_s=0.001)
        engine = TransferEngine(w, chunk_bytes=2048)
        sources = [torch.randn(700 * (i + 1)) for i in range(6)]
        uploads = [
            engine.h2d(s, priority=Priority.CRITICAL if i % 2 else Priority.BULK, label=f"u{i}")
            for i, s in enumerate(sources)
        ]
        downloads = [engine.d2h(u.dst, after=[u.done], label=f"d{i}") for i, u in enumerate(uploads)]
        for d, s in zip(downloads, sources):
            d.done.wait(timeout=10)
            assert torch.equal(d.dst, s)
        engine.close()
        w.shutdown(timeout=2)


def test_close_fails_what_has_not_run_and_validates_inputs(worker):
    engine = TransferEngine(worker)
    never = Event("never")
    t = engine.h2d(torch.zeros(10), after=[never], label="stuck")
    engine.close()
    with pytest.raises(UpstreamFailed, match="closed"):
        t.done.wait(timeout=5)
    with pytest.raises(WorkerAborted):
        engine.h2d(torch.zeros(1))
    other = TransferEngine(worker)
    with pytest.raises(ValueError, match="differ"):
        other.h2d(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="contiguous"):
        other.d2h(torch.zeros(4, 4).t())
    other.close()


def test_components_run_training_steps_together_under_chaos():
    """Host store -> segment uploads -> compute on device views -> gradient download ->
    optimizer driver, over two chaotic virtual workers, equals eager training bit for bit."""
    from torch import nn
    from torch.func import functional_call

    from rpcompile.runtime.memory import HostStore
    from rpcompile.runtime.optim import OptimizerDriver

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(30, 8)
            self.pre = nn.Linear(8, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 30, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            logits = self.head(torch.tanh(self.mid(torch.tanh(self.pre(self.emb(ids))))))
            return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    reference, model = Tied(), Tied()
    ref_opt = torch.optim.AdamW(list(reference.parameters()), lr=1e-2, fused=True)
    p = dict(model.named_parameters(remove_duplicate=False))
    stage_names = [["emb.weight", "pre.weight", "pre.bias"],
                   ["mid.weight", "mid.bias", "head.weight"]]
    store = HostStore.build([[(n, p[n]) for n in names] for names in stage_names])
    assert len(store.stages[1].layout.shadow_segments) == 2  # the tied head lives in stage 0
    driver = OptimizerDriver(store, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    workers = [VirtualWorker(i, capacity_bytes=1 << 20, chaos=i + 3) for i in range(2)]
    engines = [TransferEngine(w, chunk_bytes=256) for w in workers]
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            ids = torch.randint(0, 30, (2, 6), generator=g)
            ref_opt.zero_grad()
            reference(ids).backward()
            ref_opt.step()

            driver.begin_step()
            downloads = []
            for s, (w, engine) in enumerate(zip(workers, engines)):
                stage = store.stages[s]
                weights = w.alloc(shape=(stage.layout.shadow_numel,), dtype=store.compute_dtype,
                                  tag=f"s{s} weights")
                uploads = [
                    engine.h2d(src, weights[seg.device_offset : seg.device_offset + seg.numel],
                               after=[driver.shadow_event(s)], label=f"UP s{s} seg{j}")
                    for j, (src, seg) in enumerate(zip(stage.shadow, stage.layout.shadow_segments))
                ]
                grads = w.alloc(shape=(stage.layout.grad_numel,), dtype=torch.float32,
                                tag=f"s{s} grads")
                w.wait("compute", *[u.done for u in uploads])

                def job(stage=stage, weights=weights, grads=grads, ids=ids):
                    mine = {n: v.clone().requires_grad_(True)
                            for n, v in stage.device_views(weights).items()}
                    # Other stages' weights are only read (in a pipeline they would arrive as
                    # activations); each job differentiates its own uses.
                    values = {n: store.shadow_of(n).clone() for n in p}
                    values.update(mine)
                    loss = functional_call(model, values, (ids,), tie_weights=False)
                    got = torch.autograd.grad(loss, list(mine.values()))
                    views = stage.grad_views(grads)
                    for n, gr in zip(mine, got):
                        views[n].copy_(gr)

                w.submit("compute", job, label=f"job s{s}")
                produced = w.record("compute", f"s{s} grads ready")
                downloads.append(engine.d2h(grads, after=[produced], label=f"D2H grad s{s}"))
            # Each job here reads every stage's shadow (a real backward job would not), so no
            # stage may be reported done (and updated, in sync mode) before all jobs are over.
            for download in downloads:
                download.done.wait(timeout=30)
            for s in (1, 0):
                driver.accumulate_grad(s, downloads[s].dst, timeout=30)
                driver.stage_done(s)
            driver.finish_step().wait(timeout=30)
            for w in workers:
                w.synchronize(timeout=30)
                assert 0 < w.peak_bytes <= 1 << 20
                w.free_all()
        for n, param in reference.named_parameters():
            assert torch.equal(store.master_of(n), param), n
    finally:
        driver.close()
        for engine, w in zip(engines, workers):
            engine.close()
            w.shutdown(timeout=5)

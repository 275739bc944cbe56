"""Virtual workers: stream ordering, events, chaos, memory capacity, errors and shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rpcompile.runtime.errors import (
    EventTimeout,
    UpstreamFailed,
    WorkerAborted,
    WorkerError,
    WorkerOutOfMemory,
)
from rpcompile.runtime.workers import STREAMS, CudaWorker, Event, VirtualWorker, make_workers


@pytest.fixture
def workers():
    made: list[VirtualWorker] = []

    def make(*args, **kwargs) -> VirtualWorker:
        w = VirtualWorker(*args, **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown(timeout=2.0)


def test_items_on_one_stream_run_in_order(workers):
    w = workers(0)
    seen: list[int] = []
    for i in range(50):
        w.submit("compute", lambda i=i: seen.append(i), label=f"item {i}")
    w.synchronize(timeout=5)
    assert seen == list(range(50))


def test_event_orders_work_across_streams_and_workers(workers):
    a, b = workers(0), workers(1)
    x = torch.arange(1000, dtype=torch.float32)
    produced = torch.zeros(1000)
    consumed = torch.zeros(1000)
    moved = torch.zeros(1000)

    def slow_produce() -> None:
        time.sleep(0.05)  # without the wait below, the consumer would read zeros
        produced.copy_(x * 2)

    a.submit("compute", slow_produce, label="F1 m0")
    ready = a.record("compute", "F1 m0 out")
    a.wait("download", ready)
    a.submit("download", lambda: consumed.copy_(produced), label="D2H F1 m0")
    downloaded = a.record("download", "D2H F1 m0")
    b.wait("compute", downloaded)
    b.submit("compute", lambda: moved.copy_(consumed + 1), label="F2 m0")
    b_done = b.record("compute", "F2 m0")
    b_done.wait(timeout=5)
    assert torch.equal(consumed, x * 2)
    assert torch.equal(moved, x * 2 + 1)


def test_host_event_wait_timeout_and_all_of():
    e1, e2 = Event("e1"), Event("e2")
    both = Event.all_of([e1, e2], "both")
    with pytest.raises(EventTimeout, match="e1"):
        e1.wait(timeout=0.05)
    e1.set()
    assert not both.is_set()
    e2.set()
    both.wait(timeout=1)
    failed = Event("f")
    combined = Event.all_of([Event("never"), failed])
    failed.fail(ValueError("x"))
    with pytest.raises(UpstreamFailed, match="x"):
        combined.wait(timeout=1)


def _pipeline(worker: VirtualWorker, with_wait: bool) -> torch.Tensor:
    """compute writes buf in two items, download copies it out; returns what download read."""
    buf = torch.zeros(4096)
    out = torch.full((4096,), -1.0)
    worker.submit("compute", lambda: buf.fill_(1.0), label="fill")
    worker.submit("compute", lambda: buf.mul_(3.0), label="scale")
    if with_wait:
        worker.wait("download", worker.record("compute", "buf ready"))
    worker.submit("download", lambda: out.copy_(buf), label="read")
    worker.synchronize(timeout=5)
    return out


def test_chaos_keeps_correct_protocols_correct_and_exposes_a_missing_wait(workers):
    expected = torch.full((4096,), 3.0)
    wrong_without_wait = 0
    seeds = range(12)
    for seed in seeds:
        w = workers(0, chaos=seed, chaos_max_delay_s=0.004)
        assert torch.equal(_pipeline(w, with_wait=True), expected), f"seed {seed}"
        if not torch.equal(_pipeline(w, with_wait=False), expected):
            wrong_without_wait += 1
        w.shutdown(timeout=2)
    # The reader sleeps one random delay, the writer two: the read comes first in most seeds
    # (5/6 each for uniform delays), so 12 seeds all passing by luck is ~1e-9.
    assert wrong_without_wait >= 1


def test_out_of_memory_names_worker_tag_and_bytes(workers):
    w = workers(3, capacity_bytes=10_000)
    weights = w.alloc(6_000, tag="F3 weights")
    act = w.alloc(shape=(250,), dtype=torch.float32, tag="F3 act m2")  # 1000 bytes
    assert act.dtype == torch.float32 and act.shape == (250,)
    assert w.memory_in_use == 7_000
    with pytest.raises(WorkerOutOfMemory) as info:
        w.alloc(shape=(1000,), dtype=torch.float32, tag="F3 act m3")
    err = info.value
    assert (err.worker, err.tag, err.requested, err.in_use, err.capacity) == (
        "v3", "F3 act m3", 4000, 7000, 10_000
    )
    msg = str(err)
    for piece in ("v3", "'F3 act m3'", "4000 bytes", "7000 bytes", "10000 bytes", "F3 weights"):
        assert piece in msg
    assert w.memory_in_use == 7_000  # a failed allocation leaves the accounting unchanged
    w.free(weights)
    with pytest.raises(ValueError, match="did not allocate"):
        w.free(weights)
    with w.reserve(2_500, tag="F3 working"):
        assert w.memory_in_use == 3_500
        with pytest.raises(WorkerOutOfMemory, match="F3 working"):
            w.alloc(7_000, tag="too much")
    assert w.memory_in_use == 1_000
    assert w.peak_bytes == 7_000
    w.reset_peak()
    assert w.peak_bytes == 1_000
    assert w.free_all() == 1_000 and w.memory_in_use == 0


def test_device_tensors_are_distinct_from_host_tensors(workers):
    w = workers(0)
    host = torch.arange(10, dtype=torch.float32)
    dev = w.alloc(shape=host.shape, dtype=host.dtype, tag="x")
    w.submit("activation_upload", lambda: w.copy_(dev, host))
    w.synchronize(timeout=5)
    host.zero_()
    assert torch.equal(dev, torch.arange(10, dtype=torch.float32))


def test_stream_error_surfaces_with_context_and_shutdown_joins_quickly():
    w = VirtualWorker(2)
    never = Event("never set")

    def boom() -> None:
        raise ValueError("bad shapes in stage 3")

    w.wait("weight_upload", never, label="wait for shadow")  # blocks its thread for good
    w.submit("compute", boom, label="F3 m1")
    after = w.record("compute", "F3 m1 out")
    w.wait("download", after, label="wait F3 m1 out")
    with pytest.raises(UpstreamFailed):
        after.wait(timeout=5)
    with pytest.raises(WorkerError) as info:
        w.synchronize(timeout=5)
    err = info.value
    assert (err.worker, err.stream, err.label) == ("v2", "compute", "F3 m1")
    assert isinstance(err.__cause__, ValueError) and not err.secondary
    assert "F3 m1" in str(err) and "bad shapes in stage 3" in str(err)
    assert "boom" in err.traceback_text
    # Items after the failure are dropped, not run.
    ran = []
    w.submit("compute", lambda: ran.append(1))
    later = w.record("compute", "later")
    with pytest.raises(UpstreamFailed):
        later.wait(timeout=5)
    assert ran == []
    start = time.monotonic()
    alive = w.shutdown(timeout=5)
    assert alive == [] and time.monotonic() - start < 2.0
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("rpcompile-v2-"))
    with pytest.raises(WorkerAborted):
        w.submit("compute", lambda: None)


def test_a_stream_that_cannot_start_fails_the_worker_instead_of_hanging():
    class BadDevice(VirtualWorker):
        def _stream_context(self, stream):
            if stream == "compute":
                raise RuntimeError("device lost")
            return super()._stream_context(stream)

    w = BadDevice(5)
    try:
        done = w.record("compute", "F1")
        with pytest.raises(UpstreamFailed, match="device lost"):
            done.wait(timeout=5)
        with pytest.raises(WorkerError, match="stream setup") as info:
            w.check()
        assert info.value.stream == "compute"
    finally:
        assert w.shutdown(timeout=5) == []


def test_shutdown_unblocks_a_wait_on_another_workers_event():
    a, b = VirtualWorker(0), VirtualWorker(1)
    gate = Event("gate")
    a.wait("compute", gate)
    a_done = a.record("compute", "a")
    b.wait("compute", a_done, label="b waits a")
    b_done = b.record("compute", "b")
    time.sleep(0.05)
    start = time.monotonic()
    assert a.shutdown(timeout=5) == [] and b.shutdown(timeout=5) == []
    assert time.monotonic() - start < 2.0
    with pytest.raises((UpstreamFailed, WorkerAborted)):
        b_done.wait(timeout=1)


def test_error_listener_and_recover(workers):
    w = workers(0)
    heard: list[WorkerError] = []
    w.add_error_listener(heard.append)
    w.alloc(100, tag="job")
    w.submit("download", lambda: 1 / 0, label="D2H grad s4")
    with pytest.raises(WorkerError, match="D2H grad s4"):
        w.synchronize(timeout=5)
    assert [e.label for e in heard] == ["D2H grad s4"]
    w.recover()
    assert w.memory_in_use == 0 and w.errors == []
    out = []
    w.submit("compute", lambda: out.append("ok"))
    w.synchronize(timeout=5)
    assert out == ["ok"]


def test_make_workers_virtual_and_auto_fallback():
    ws = make_workers(3, device="virtual", capacity_bytes=1 << 20, chaos=1)
    try:
        assert [w.name for w in ws] == ["v0", "v1", "v2"]
        assert all(w.capacity_bytes == 1 << 20 and w.chaos == 1 for w in ws)
    finally:
        for w in ws:
            w.shutdown()
    if torch.cuda.is_available():
        pytest.skip("auto picks CUDA here")
    with pytest.warns(RuntimeWarning, match="no CUDA device.*virtual"):
        ws = make_workers(2, device="auto")
    try:
        assert all(isinstance(w, VirtualWorker) for w in ws)
    finally:
        for w in ws:
            w.shutdown()
    with pytest.raises(ValueError, match="device must be"):
        make_workers(1, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_worker_without_cuda_says_what_to_do():
    with pytest.raises(RuntimeError, match="device='virtual'"):
        CudaWorker(0)


def test_streams_are_the_four_named_ones(workers):
    w = workers(0)
    assert STREAMS == ("weight_upload", "activation_upload", "compute", "download")
    names = {t.name for t in threading.enumerate() if t.name.startswith("rpcompile-v0-")}
    assert names >= {f"rpcompile-v0-{s}" for s in STREAMS}
    with pytest.raises(ValueError, match="unknown stream"):
        w.submit("h2d", lambda: None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_orders_streams_with_cuda_events_and_accounts_memory():
    a, b = CudaWorker(0, capacity_bytes=1 << 30), CudaWorker(1, device_index=0)
    try:
        # Transfers as the executor makes them: a copy inside an item on the transfer stream.
        host = torch.randn(1 << 20)
        up = a.alloc(shape=host.shape, dtype=host.dtype, tag="s0 weights")
        a.submit("weight_upload", lambda: (a.copy_(up, host), a.complete_copies()), label="UP")
        uploaded = a.record("weight_upload", "UP done")
        assert up.device.type == "cuda" and a.memory_in_use == host.numel() * 4
        a.wait("compute", uploaded)
        out = a.alloc(shape=host.shape, dtype=host.dtype, tag="out")
        a.submit("compute", lambda: torch.mul(up, 2, out=out), label="F1")
        ready = a.record("compute", "F1 out")
        down = a.host_empty(host.shape, host.dtype)
        a.wait("download", ready)
        a.submit("download", lambda: (a.copy_(down, out), a.complete_copies()), label="D2H")
        a.synchronize(timeout=30)
        assert down.is_pinned() and torch.equal(down, host * 2)
        # Cross-worker: b's compute waits on a's CUDA event on the device.
        result = b.alloc(shape=host.shape, dtype=host.dtype, tag="b out")
        b.wait("compute", ready)
        b.submit("compute", lambda: result.copy_(out, non_blocking=True).add_(1), label="F2")
        b.synchronize(timeout=30)
        assert torch.equal(result.cpu(), host * 2 + 1)
        with pytest.raises(WorkerOutOfMemory, match="cuda0"):
            a.alloc(1 << 30, tag="too big")
    finally:
        a.shutdown()
        b.shutdown()

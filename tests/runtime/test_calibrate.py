"""Calibrating a virtual-worker profile from a run (rpcompile.runtime.calibrate): each stream
thread's own CPU clock, and the figures a run of steps gives the simulator."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest

from rpcompile.errors import InvalidInput
from rpcompile.hardware import get_hardware
from rpcompile.runtime.calibrate import calibrate_virtual
from rpcompile.runtime.trainer import Trainer
from rpcompile.runtime.workers import VirtualWorker
from tests.runtime.test_executor import (
    ADAMW,
    batches,
    qwen3,  # noqa: F401  (fixture)
)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_stream_clock_counts_its_own_thread_only():
    # 60 ms of CPU on the compute stream, while the calling thread sleeps: the compute
    # stream's clock moves by that, the other streams' hardly at all.
    worker = VirtualWorker(0)
    try:
        before = worker.stream_cpu_s()
        worker.submit("compute", lambda: _spin(0.06), "spin")
        worker.synchronize(10.0)
        after = worker.stream_cpu_s()
    finally:
        worker.shutdown()
    moved = {s: after[s] - before[s] for s in before}
    assert moved["compute"] >= 0.06
    assert all(moved[s] < 0.02 for s in moved if s != "compute")


def test_calibration_counts_the_run_and_sets_the_profile(qwen3):  # noqa: F811
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW,
                                      device="virtual")) as trainer:
        with pytest.raises(InvalidInput, match="at least one batch"):
            calibrate_virtual(trainer, [])
        cal = calibrate_virtual(trainer, batches(2, 6))
        schedule = trainer.schedule
    per_step = Counter(a.kind for a in schedule.all_actions() if a.step == 0)
    assert cal.steps == 2
    assert cal.actions == pytest.approx({k: float(n) for k, n in per_step.items()})
    assert set(cal.cpu_ms) == {"weight_upload", "activation_upload", "compute", "download",
                               "main"}
    assert cal.cpu_ms["compute"] > 0 and cal.h2d_gbps > 0 and cal.d2h_gbps > 0
    assert cal.action_overhead_us > 0  # the main thread's submitting, at least
    hw = cal.apply(get_hardware("cpu"))
    assert (hw.h2d_gbps, hw.d2h_gbps, hw.action_overhead_us) == \
        (cal.h2d_gbps, cal.d2h_gbps, cal.action_overhead_us)
    assert (hw.pageable_h2d_gbps, hw.pageable_d2h_gbps) == (cal.h2d_gbps, cal.d2h_gbps)

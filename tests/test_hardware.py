"""Hardware profiles are data; probe() measures this machine."""

from __future__ import annotations

import pytest

from rpcompile.hardware import Hardware, get_hardware, list_hardware, probe


def test_profiles_cover_the_paper_machines():
    assert {"rtx4090x8", "rtx5090x8", "a800x8", "h200x1", "cpu"} <= set(list_hardware())
    hw = get_hardware("rtx4090x8")
    assert (hw.gpus, hw.memory_gib, hw.matmul_tflops) == (8, 24.0, 330.0)
    # 1 TFLOP at 330 TFLOP/s and the efficiency calibrated on the paper's layer times.
    assert hw.compute_ms(1e12) == pytest.approx(1e3 / (330 * 0.63))
    assert hw.h2d_ms(25e9) == pytest.approx(1e3)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"known: .*rtx4090x8"):
        get_hardware("tpu-v9")


def test_probe_measures_this_machine():
    hw = probe("cpu", size=256, repeats=1)
    assert isinstance(hw, Hardware) and hw.name == "probed"
    for figure in (hw.matmul_tflops, hw.h2d_gbps, hw.d2h_gbps, hw.host_mem_gbps,
                   hw.optimizer_params_per_s):
        assert figure > 0


def test_probe_of_the_cpu_counts_the_cores_the_workers_share():
    # Workers computing with one intra-op thread each: as many at full speed as cores; with
    # two threads each, half as many (at least one).
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert probe("cpu", size=128, repeats=1, min_seconds=0.001, fresh=True).shared_cores == cores
        torch.set_num_threads(2)
        assert probe("cpu", size=128, repeats=1, min_seconds=0.001,
                     fresh=True).shared_cores == max(1, cores // 2)
    finally:
        torch.set_num_threads(threads)
    assert get_hardware("rtx4090x8").shared_cores == 0  # a GPU each: nothing shared


def test_probe_is_measured_once_per_process():
    first = probe("cpu", size=128, repeats=1, min_seconds=0.001)
    assert probe("cpu", size=128, repeats=1, min_seconds=0.001) is first
    assert probe("cpu", size=128, repeats=1, min_seconds=0.001, fresh=True) is not first


def test_timing_windows_hold_enough_work_that_the_sync_does_not_count(monkeypatch):
    # One call is 0.2 ms of work; the synchronize that closes a window costs 5 ms (on a fast
    # GPU a synchronize costs about as much as a 2048^3 matmul). Timing one call between two
    # synchronizes would report 5.2 ms. A simulated clock keeps the test exact on a busy CPU.
    import types

    from rpcompile import hardware

    clock, calls = [0.0], [0]
    monkeypatch.setattr(hardware, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def work():
        calls[0] += 1
        clock[0] += 2e-4

    def sync():
        clock[0] += 5e-3

    per_call = hardware.seconds_per_call(work, sync, repeats=2, min_seconds=0.1)
    assert 2e-4 < per_call < 1.05 * 2e-4, per_call
    assert calls[0] >= 2 * 0.1 / 2e-4  # each window held enough calls to last 0.1 s

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

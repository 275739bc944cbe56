"""A plan that does not fit a worker's memory is refused at compile time, naming the peak, its
stages and the fix, in sensible units; where a loss chunk makes a plan fit, the planner picks
the fastest one that fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

import rpcompile
from rpcompile.compiler import MemoryPlanError
from rpcompile.hardware import get_hardware
from rpcompile.options import CaptureOptions
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.partition import PartitionError
from tests.passes.memory_runs import (
    compiled_for,
    tightest_peaks,
)
from tests.tiny_models import hf_model, token_batch


@pytest.mark.parametrize("arch,gpus,microbatches", [("qwen3", 2, 3), ("llama", 3, 6)])
def test_capacity_just_above_the_peak_runs_and_just_below_is_refused(arch, gpus, microbatches):
    # The peak with the tightest memory waits is the least this plan can be lowered to.
    peak = max(p.peak_bytes for p in tightest_peaks(compiled_for(arch, gpus, microbatches)))
    compiled = compiled_for(arch, gpus, microbatches, capacity_bytes=int(1.05 * peak))
    for k in range(2):
        compiled.step(token_batch(2 * microbatches, seed=k))
    compiled.close()
    # recompute="stage": this plan is refused; "auto" (the default) would cut another plan
    # under capacity_bytes, by stage or layer by layer (tests/passes/test_recompute.py).
    with pytest.raises(MemoryPlanError) as info:
        compiled_for(arch, gpus, microbatches, capacity_bytes=int(0.95 * peak),
                     recompute="stage")
    text = str(info.value)
    assert format_bytes(peak) in text and "capacity_bytes" in text
    assert "KiB" in text and "0.00" not in text
    assert "more microbatches" in text and "shorter sequence" in text
    # The stage(s) holding memory at the peak are named.
    assert any(name in text for name in ("F1", "F2", "B1", "B2", "B3", "B4"))


def test_a_too_small_profile_names_sensible_units():
    hw = replace(get_hardware("cpu"), memory_gib=64 / 2**20, memory_reserve_gib=0.0)  # 64 KiB
    model = hf_model("qwen3", layers=2)
    with pytest.raises(PartitionError) as info:
        rpcompile.compile(model, gpus=2, microbatches=2, hardware=hw, device="virtual",
                          example_inputs=token_batch(4))
    text = str(info.value)
    assert "0.00" not in text and "64.0 KiB" in text and "KiB" in text


def test_format_bytes():
    assert format_bytes(3 * 2**30 + 2**29) == "3.50 GiB"
    assert format_bytes(812 * 2**20) == "812.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize("gib,chunk", [(0.6, 1024), (3.0, None)])
def test_the_planner_chooses_the_loss_chunk_that_fits_fastest(gib, chunk):
    # 4,096 tokens per microbatch over a 32,768 vocabulary: the whole fp32 logits (512 MiB)
    # and their gradient do not fit 0.6 GiB GPUs, 1,024-token chunks do; with 3 GiB the
    # whole logits fit and are faster (chunks cost one more head matmul), so they stay.
    from tests.passes.test_chunked_loss import sft_batch

    hw = replace(get_hardware("cpu"), memory_gib=gib, memory_reserve_gib=0.0)
    compiled = rpcompile.compile(hf_model("qwen3", layers=2, vocab_size=32768), gpus=2,
                                 microbatches=2, example_inputs=sft_batch(8, 1024, vocab=32768),
                                 hardware=hw, device="virtual")
    assert compiled.capture.loss_chunk_tokens == chunk
    assert max(p.peak_bytes for p in compiled.memory) <= hw.usable_memory_bytes
    if chunk is not None:
        assert any("linear_cross_entropy" in s.code for s in compiled.stages)
        note = compiled.plan.notes[-1]
        assert "1,024-token chunks, the fastest plan that fits" in note
        assert "whole logits: no plan fits" in note
        with pytest.raises(PartitionError):  # the whole logits alone: refused
            rpcompile.compile(hf_model("qwen3", layers=2, vocab_size=32768), gpus=2,
                              microbatches=2, example_inputs=sft_batch(8, 1024, vocab=32768),
                              hardware=hw, device="virtual",
                              capture=CaptureOptions(loss_chunk_tokens=None))

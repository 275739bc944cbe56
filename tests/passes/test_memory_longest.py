"""The longest sequence that fits (rpcompile.planner.longest): the last length whose whole
schedule's proof fits, what does not fit one step further, and a plan at that length that
runs under its proof."""

from __future__ import annotations

from dataclasses import replace

import pytest

import rpcompile
from rpcompile.hardware import get_hardware
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import format_bytes, worker_peaks
from rpcompile.planner.partition import PartitionError
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate_roundpipe
from tests.passes.memory_runs import (
    SGD,
)
from tests.tiny_models import hf_model, token_batch


def test_longest_sequence_is_the_last_length_that_fits():
    # Qwen3-1.7B with a whole-microbatch tail on 4 GPUs of 8 GiB: the search stops one step
    # before the first length that does not fit, names what does not fit there (the tail
    # alone), and the plan it returns runs in the simulator under its proof, which equals the
    # proof over the simulator's whole steady-state run (the partitioner's check).
    from rpcompile.planner.longest import longest_sequence
    from rpcompile.planner.partition import partition
    from rpcompile.sim import steady_steps
    from rpcompile.workloads.paper import MODELS

    model = MODELS["qwen3-1.7b"]
    hw = replace(get_hardware("rtx4090x8"), memory_gib=8.0).with_gpus(4)

    def units(s):
        return model.units(1, s, loss_chunk_tokens=None)

    found = longest_sequence(units, hw, PlanOptions(gpus=4, microbatches=5, mode="async"),
                             microbatch_size=1, start=1024, step=512)
    assert found.seq_len >= 1024 and found.seq_len % 512 == 0
    assert found.next_len == found.seq_len + 512
    plan = found.plan
    assert plan is not None and plan.seq_len == found.seq_len
    assert max(plan.worker_peak_bytes) <= hw.usable_memory_bytes
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
    assert tuple(p.peak_bytes for p in worker_peaks(r.schedule, plan)) == plan.worker_peak_bytes
    assert max(r.peak_device_bytes) <= max(plan.worker_peak_bytes)
    assert "'tail'" in found.why and "alone" in found.why
    assert f"at {found.next_len:,} tokens" in found.describe()
    with pytest.raises(PartitionError, match="'tail'"):  # nor does the partitioner fit it
        partition(units(found.next_len), hw,
                  PlanOptions(gpus=4, microbatches=5, max_simulations=1, mode="async"),
                  microbatch_size=1, seq_len=found.next_len, search=0, refine=0, shortlist=4)


def test_longest_sequence_names_the_peak_of_the_schedule_that_does_not_fit():
    # With 4,096-token loss chunks no stage alone is the limit: the first length that does not
    # fit is over by the proof of its whole schedule, the last one that fits is under it.
    from rpcompile.planner.longest import longest_sequence, memory_first_plan, proven_peaks
    from rpcompile.workloads.paper import MODELS

    model = MODELS["qwen3-1.7b"]
    # 9.5 GiB: at 9 the chunked tail alone (its head's 1.16 GiB fp32 gradient accumulator
    # and its 0.58 GiB bf16 gradient) does not fit even at 4,096 tokens.
    hw = replace(get_hardware("rtx4090x8"), memory_gib=9.5).with_gpus(4)

    def units(s):
        return model.units(1, s, loss_chunk_tokens=4096)

    found = longest_sequence(units, hw, PlanOptions(gpus=4, microbatches=5, mode="async"),
                             microbatch_size=1, start=4096, step=4096)
    assert found.seq_len >= 8192 and found.next_len == found.seq_len + 4096
    assert "whole schedule peaks at worker" in found.why
    over = memory_first_plan(units(found.next_len), hw, 4, 5, 1, found.next_len)
    assert all(s.peak_bytes <= hw.usable_memory_bytes for s in over.stages)
    assert max(p.peak_bytes for p in proven_peaks(over)) > hw.usable_memory_bytes
    assert max(found.plan.worker_peak_bytes) <= hw.usable_memory_bytes


def test_plan_at_the_longest_length_fits():
    # `plan --longest` proves lengths with the memory-first plan (every unit its own stage).
    # A 12-layer tiny Qwen3 on 2 workers of 4,000 KiB: at the longest length it reports, the
    # partitioner must return a plan that fits: a searched one (its candidates include every
    # unit its own stage, rpcompile.planner.partition._all_cuts) or, where none it replays
    # fits, the memory-first fallback, which says so; proven under the capacity, and run on
    # virtual workers with its predicted peak + 5 %.
    from rpcompile.compiler import unit_profiles
    from rpcompile.planner.longest import longest_sequence
    from rpcompile.planner.partition import StageCosting, memory_first_note, partition

    gpus, micro = 2, 3
    hw = replace(get_hardware("cpu"), memory_gib=4000 / 2**20, memory_reserve_gib=0.0)
    probe = rpcompile.compile(hf_model("qwen3", layers=12), gpus=gpus, microbatches=micro,
                              device="virtual", example_inputs=token_batch(micro, 64),
                              mode="sync")
    found = longest_sequence(lambda s: unit_profiles(probe.capture, probe.unit_costs, 1, s, hw, 4),
                             hw, PlanOptions(gpus=gpus, microbatches=micro, mode="sync"),
                             costing=StageCosting(4, 4, 4), start=64, step=16, limit=1 << 14)
    length = found.seq_len
    assert length >= 64 and found.next_len is not None
    compiled = rpcompile.compile(hf_model("qwen3", layers=12), gpus=gpus, microbatches=micro,
                                 device="virtual", hardware=hw, mode="sync",
                                 example_inputs=token_batch(micro, length))
    plan = compiled.plan
    note = memory_first_note(plan)
    if note is not None:  # every unit its own stage, the tail alone
        assert f"none of the searched candidates fits {format_bytes(hw.usable_memory_bytes)}" in note
        assert len(plan.stages) == 2 * (len(plan.units) - 1) + 1
    peak = max(plan.worker_peak_bytes)
    assert list(plan.worker_peak_bytes) == [p.peak_bytes for p in compiled.memory]
    assert peak <= hw.usable_memory_bytes
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=SGD, device="virtual"),
                 plan=replace(compiled.options.plan, capacity_bytes=int(1.05 * peak))) as trainer:
        for k in range(2):
            trainer.step(token_batch(micro, length, seed=k))
        assert max(trainer.peak_bytes()) <= peak
    # One length further the memory-first plan does not fit either: refused, naming both.
    longer = found.next_len
    with pytest.raises(PartitionError, match=r"the memory-first plan .* does not fit either"):
        partition(unit_profiles(probe.capture, probe.unit_costs, 1, longer, hw, 4), hw,
                  PlanOptions(gpus=gpus, microbatches=micro, mode="sync", recompute="stage"),
                  microbatch_size=1, seq_len=longer, costing=StageCosting(4, 4, 4), shortlist=8,
                  search=0)

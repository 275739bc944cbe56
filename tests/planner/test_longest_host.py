"""The longest-sequence search checks host RAM too: a length reported as fitting fits the
GPUs and the host, and when the RAM binds the GPUs' own answer stays visible."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rpcompile.hardware import get_hardware
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import runtime_schedule
from rpcompile.passes.memory import host_memory
from rpcompile.planner.longest import host_need, longest_sequence, memory_first_plan
from rpcompile.sim import simulate
from rpcompile.workloads.paper import MODELS

MODEL = MODELS["qwen3-1.7b"]
# 4 GPUs of 9.5 GiB, 5 microbatches of one sequence, 4,096-token loss chunks: the GPUs allow
# tens of thousands of tokens, at which the host holds tens of GiB of staged activations.
HW = replace(get_hardware("rtx4090x8"), memory_gib=9.5).with_gpus(4)
# 4 workers, 5 microbatches of 1 sequence, async: the plan every search here is for.
FOUR_FIVE = PlanOptions(gpus=4, microbatches=5, mode="async")
ARGS = dict(start=4096, step=4096)


def _units(seq: int):
    return MODEL.units(1, seq, loss_chunk_tokens=4096)


def _host_at(seq: int, microbatches: int = 5) -> int:
    """The host bytes compile() would check for the memory-first plan at ``seq``: its
    runtime schedule replayed once (independent of the search's own lowering)."""
    plan = memory_first_plan(_units(seq), HW, 4, microbatches, 1, seq)
    sched = runtime_schedule(plan, PlanOptions(gpus=4, microbatches=microbatches, rounds=1,
                                               mode="async"))
    return host_memory(plan, "async", simulate(sched, plan, HW).peak_host_bytes).total


@pytest.fixture(scope="module")
def gpu_only():
    return longest_sequence(_units, HW, FOUR_FIVE, **ARGS)


def test_without_a_ram_figure_the_host_memory_is_reported_not_checked(gpu_only):
    found = gpu_only
    assert found.seq_len >= 8192 and found.limit == "GPU memory" and found.gpu is None
    assert found.host is not None and found.host.total == _host_at(found.seq_len)
    assert found.host.transfers > 0
    assert "host RAM unknown: not checked" in found.host_line()


def test_a_length_reported_as_fitting_fits_the_host_ram(gpu_only):
    # RAM for the static buffers and three quarters of the staging at the GPUs' length.
    static = host_memory(gpu_only.plan, "async", None).total
    ram = static + 3 * (gpu_only.host.total - static) // 4
    found = longest_sequence(_units, HW, FOUR_FIVE, host_ram_bytes=ram,
                             host_ram_source="a test's", **ARGS)
    assert 4096 <= found.seq_len < gpu_only.seq_len
    assert found.next_len == found.seq_len + 4096 and found.limit == "host RAM"
    # What is reported fits, checked independently; the next length does not.
    assert found.host.total == _host_at(found.seq_len) <= ram < _host_at(found.next_len)
    assert max(found.plan.worker_peak_bytes) <= HW.usable_memory_bytes
    assert found.why.startswith("host RAM: need ") and "(a test's)" in found.why
    assert "transfer staging" in found.why
    # The GPUs' own answer is kept, with the host memory it would need.
    assert found.gpu.seq_len == gpu_only.seq_len and found.gpu.host.total > ram
    text = found.describe()
    assert f"the GPUs alone: {gpu_only.seq_len:,} tokens" in text
    assert f"of host memory at {gpu_only.seq_len:,} tokens" in text


def test_static_host_memory_over_the_ram_fits_no_length_and_says_so(gpu_only):
    static = host_memory(gpu_only.plan, "async", None).total
    found = longest_sequence(_units, HW, FOUR_FIVE, host_ram_bytes=static - 1, **ARGS)
    assert found.seq_len == 0 and found.plan is None and found.limit == "host RAM"
    assert "static host memory alone" in found.why and "no length fits" in found.why
    assert found.gpu is not None and found.gpu.seq_len == gpu_only.seq_len
    # The undo journal is most of a full fine-tune's static part: without it this RAM holds
    # it, and the answer says so.
    assert "without the undo journal it is" in found.why
    lean = longest_sequence(_units, HW.with_undo_journal(False), FOUR_FIVE,
                            host_ram_bytes=static - 1, **ARGS)
    assert lean.seq_len > 0 and lean.host.journal == 0


def test_host_need_follows_the_undo_journal(gpu_only):
    plan = gpu_only.plan
    on = host_need(plan, HW)
    off = host_need(plan, HW.with_undo_journal(False))
    assert on.journal > 0 and off.journal == 0
    assert on.total - off.total == on.journal


def test_a_start_over_the_ram_does_not_rule_out_longer_lengths():
    """The staging is not monotone in the length: on 4 GPUs and 4 microbatches the
    memory-first plan stages more at 4,096 tokens than at 6,144. With the RAM between the
    two, the search must not report that no length fits: it reports one that fits both
    (the host checked by an independent replay) and says the host RAM limits the next."""
    seqs = (6144, 7168)
    need = {s: _host_at(s, 4) for s in seqs}
    assert need[6144] > need[7168]  # the premise: longer, and less host memory
    ram = (need[6144] + need[7168]) // 2
    found = longest_sequence(_units, HW, PlanOptions(gpus=4, microbatches=4, mode="async"),
                             start=6144, step=1024, host_ram_bytes=ram)
    assert found.seq_len > 6144 and found.limit == "host RAM"
    assert _host_at(found.seq_len, 4) <= ram

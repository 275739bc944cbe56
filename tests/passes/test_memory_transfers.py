"""Every byte a virtual worker uploads or receives is a byte the lowered schedule moves (the
proof and the simulator size transfers by the schedule), and a plan whose counts disagree with
its split programs is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.runtime.trainer import Trainer
from tests.passes.memory_runs import (
    SGD,
    compiled_for,
)
from tests.tiny_models import hf_model, token_batch


def _dropout_qwen3():
    import transformers as tf

    torch.manual_seed(0)
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(
        head_dim=16, attention_dropout=0.1, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=128))


def accounted_step(compiled, batch, monkeypatch):
    """(every (tag, bytes) the virtual workers accounted during one step, the schedule)."""
    from rpcompile.runtime.workers import Worker

    accounted: list[tuple[str, int]] = []
    account = Worker._account

    def record(self, nbytes, tag):
        accounted.append((tag, nbytes))
        account(self, nbytes, tag)

    monkeypatch.setattr(Worker, "_account", record)
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=SGD,
                               device="virtual")) as trainer:
        trainer.step(batch)
        return accounted, trainer.schedule


@pytest.mark.parametrize("case", ["padded", "dropout"])
def test_every_byte_a_worker_uploads_is_a_byte_the_schedule_moves(case, monkeypatch):
    # The proof, the simulator and the bound size each transfer by the schedule's bytes. What
    # the virtual workers account is the runtime's own tensors: each UP's weights and the
    # buffers that travel with them (rotary inv_freq), each host upload's batch inputs
    # (input_ids, an attention mask, labels, num_items_in_batch, dropout seeds). Per stage
    # and per step they must be the same bytes, or a run could pass the proven peak.
    from tests.tiny_models import sft_batch

    model = _dropout_qwen3() if case == "dropout" else hf_model("qwen3", layers=4)
    batch = sft_batch(6)
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, device="virtual",
                                 example_inputs=batch)
    if case == "dropout":
        assert any(k != "labels" and k not in batch for s in compiled.plan.stages
                   for k, _ in s.batch_inputs)  # the seeds travel too
    accounted, sched = accounted_step(compiled, batch, monkeypatch)
    step0 = [a for lst in sched.actions for a in lst if a.step == 0]
    for s in compiled.plan.stages:
        name = compiled.plan.stage_name(s.index)
        up = sum(a.bytes for a in step0 if a.kind == "UP" and a.stage == s.index)
        got = sum(n for tag, n in accounted
                  if tag == f"{name} weights" or tag.startswith(f"{name} buffer "))
        assert got == up > 0, (name, got, up)
        for value in ("ids", "labels"):
            moved = sum(a.bytes for a in step0 if a.kind == "H2D" and a.stage == s.index
                        and a.value == value)
            got = sum(n for tag, n in accounted if tag == f"{name} input {value}")
            assert got == moved, (name, value, got, moved)
    assert any(a.kind == "H2D" and a.value == "labels" for a in step0)


@pytest.mark.parametrize("case", ["skips", "qwen3"])
def test_every_value_a_worker_receives_is_the_size_the_schedule_gives_it(case, monkeypatch):
    # Each H2D of an activation, a recompute input or an input gradient is sized by the
    # schedule's flows (the stages' input/output bytes). A model whose units send values past
    # the next unit (SkipNet: the embedding feeds the head, block 1 feeds block 5, and their
    # gradients come back the same way) carries all of them across a boundary: the flows
    # counted only the largest such value, and no gradient of one, so the proof bounded
    # another run (found when values were first held to the schedule's release points).
    import torch.nn.functional as F

    from tests.runtime.test_executor import SkipNet, skipnet_batch

    if case == "skips":
        batch = skipnet_batch(6)
        compiled = rpcompile.compile(SkipNet(), gpus=3, microbatches=3, example_inputs=batch,
                                     loss_fn=F.cross_entropy, device="virtual")
        assert sum(u.shared_grad_bytes for u in compiled.profiles) > 0
    else:
        batch = token_batch(6)
        compiled = compiled_for("qwen3", 3, 3)
        assert sum(u.shared_bytes for u in compiled.profiles) > 0
        assert sum(u.shared_grad_bytes for u in compiled.profiles) == 0  # rotary, masks
    accounted, sched = accounted_step(compiled, batch, monkeypatch)
    step0 = [a for lst in sched.actions for a in lst if a.step == 0 and a.kind == "H2D"]
    checked = 0
    for a in {(a.stage, a.value) for a in step0 if a.value not in ("ids", "labels")}:
        name = compiled.plan.stage_name(a[0])
        moved = sum(h.bytes for h in step0 if (h.stage, h.value) == a)
        got = sum(n for tag, n in accounted if tag == f"{name} input {a[1]}")
        assert got == moved > 0, (name, a[1], got, moved)
        checked += 1
    assert checked >= 2


def test_a_plan_that_miscounts_what_a_stage_reads_is_refused():
    # The split checks each program against the plan's counts (Stage.buffer_bytes,
    # Stage.batch_inputs): a disagreement would make the proof bound another run.
    from rpcompile.passes.split import split

    compiled = compiled_for("qwen3", 2, 3)
    plan = compiled.plan
    first = plan.stages[0]
    wrong = replace(plan, stages=(replace(first, buffer_bytes=first.buffer_bytes + 4),
                                  *plan.stages[1:]))
    with pytest.raises(AssertionError, match="F1: its program reads buffers"):
        split(compiled.capture, wrong)
    wrong = replace(plan, stages=(replace(first, batch_inputs=first.batch_inputs[:1]),
                                  *plan.stages[1:]))
    with pytest.raises(AssertionError, match="the split disagree"):
        split(compiled.capture, wrong)

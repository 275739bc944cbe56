"""The step's loss is reduced in one place: the runtime and the reference hand their microbatch
losses, in (round, microbatch) order, to ``reference.step_loss``, which sums them on the host.
A GPU's own summation order therefore cannot make the two differ in the last bit."""

from __future__ import annotations

from dataclasses import replace

import torch

import rpcompile
from rpcompile.runtime import reference
from rpcompile.runtime.actions import handlers as actions
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model, token_batch


def test_runtime_and_reference_reduce_the_step_loss_in_one_place(monkeypatch):
    calls: list[tuple[list[torch.Tensor], int]] = []
    reduce = reference.step_loss

    def recorder(losses, divisor):
        calls.append(([loss.detach().clone() for loss in losses], divisor))
        return reduce(losses, divisor)

    monkeypatch.setattr(reference, "step_loss", recorder)
    monkeypatch.setattr(actions, "step_loss", recorder)
    model = hf_model("qwen3", layers=2)
    batch = token_batch(8, seq=8, seed=5)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, rounds=2, example_inputs=batch)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                                         device="virtual")) as trainer:
        runtime_loss = trainer.step(batch)
    reference_loss, _ = compiled.reference_step(batch)

    assert len(calls) == 2  # one reduction each, the same function
    (ours, our_divisor), (theirs, their_divisor) = calls
    assert len(ours) == len(theirs) == 4 and our_divisor == their_divisor
    for mine, want in zip(ours, theirs):  # the same losses, in the same order, on the host
        assert mine.device.type == want.device.type == "cpu" and torch.equal(mine, want)
    assert torch.equal(runtime_loss, reference_loss)
    # Both are Hugging Face's token mean over the whole global batch.
    with torch.no_grad():
        eager = model(input_ids=batch, labels=batch).loss
    torch.testing.assert_close(runtime_loss, eager, rtol=1e-6, atol=1e-6)


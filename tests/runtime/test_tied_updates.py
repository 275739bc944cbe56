"""A tied embedding and LM head is one parameter: one update, charged to one OPT.

The schedule's OPT bytes are what the simulator times an update by (its optimizer work and
the undo journal's copy). Held here against what the runtime's optimizer driver really
updates at each OPT of a step, and against the model's own parameter count, which counts a
tied matrix once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.passes.lower import GRAD_BYTES, gradient_groups
from rpcompile.runtime.optim import OptimizerDriver
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model, token_batch


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_opt_is_charged_what_the_driver_updates_there(mode, monkeypatch):
    model = hf_model("qwen3_tied", layers=2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied: once
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual", mode=mode)
    sched = compiled.schedule
    # The tied matrix's gradient comes from two backward stages (the LM head's and the
    # embedding's): otherwise this case would not test sharing.
    assert any(u.borrowed for u in compiled.plan.units), "the tail should borrow the matrix"
    assert any(len(g) > 1 for g in gradient_groups(compiled.plan)), \
        "the plan should put the LM head and the embedding in different gradient stages"
    opts = [a for a in sched.host if a.kind == "OPT" and a.step == 1]
    assert sum(a.bytes for a in opts) == GRAD_BYTES * trainable

    seen: dict[int, int] = {}  # stage -> elements the driver updated at its OPT
    current: list[int] = []
    update, apply = OptimizerDriver.update, OptimizerDriver._apply

    def spy_update(self, stage):
        current[:] = [stage]
        seen.setdefault(stage, 0)
        return update(self, stage)

    def spy_apply(self, group, *args, **kwargs):
        seen[current[0]] += sum(self.store.slots[i].numel for i in group.slots)
        return apply(self, group, *args, **kwargs)

    monkeypatch.setattr(OptimizerDriver, "update", spy_update)
    monkeypatch.setattr(OptimizerDriver, "_apply", spy_apply)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                                         device="virtual"), plan=replace(compiled.options.plan,
                                                                         mode=mode)) as trainer:
        assert trainer.driver.per_parameter  # groups by gradient stages, not one group
        for seed in range(2):  # async: step 0's OPTs have nothing pending yet
            seen.clear()
            trainer.step(token_batch(4, seed=seed))
        step1 = dict(seen)  # before the close, whose flush applies what is pending
    assert sum(step1.values()) == trainable
    assert {a.stage: a.bytes for a in opts} == {s: GRAD_BYTES * n for s, n in step1.items()}

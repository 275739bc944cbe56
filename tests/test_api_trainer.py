"""A Trainer built by hand from a compiled model keeps the training options given to compile():
its keywords override them, one by one, instead of starting again from the defaults."""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace

import pytest
import torch

import rpcompile
from rpcompile import TrainOptions
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model, sft_batch, token_batch


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _eager_clipped_step(model, batch, max_norm):
    """One eager HF step: backward of the batch's loss, clip_grad_norm_, SGD step; returns
    the pre-clip norm."""
    opt = _sgd(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    model(**batch, use_cache=False).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    opt.step()
    return norm


def test_a_hand_built_trainer_clips_as_the_compile_asked():
    # compile(..., max_grad_norm=...) then Trainer(compiled, device=...): the step is the
    # eager clipped step, not an unclipped one (a keyword that replaced every training
    # option with its default would drop the clipping silently).
    batch = sft_batch(4, 12, seed=3)
    model = hf_model("qwen3", layers=2)
    eager = copy.deepcopy(model)
    unclipped = copy.deepcopy(model)
    free_norm = _eager_clipped_step(unclipped, batch, math.inf)
    max_norm = free_norm / 4  # clipping changes this step a lot
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=batch,
                                 optimizer=_sgd, max_grad_norm=max_norm, device="auto")
    with Trainer(compiled, device="virtual", timeout_s=60) as trainer:
        assert trainer.options == replace(compiled.options.train, device="virtual",
                                          timeout_s=60)
        trainer.step(batch)
        norm = trainer.last.grad_norm
        masters = trainer.masters()
    expected = _eager_clipped_step(eager, batch, max_norm)
    assert norm == pytest.approx(expected, rel=1e-5)
    moved = 0.0
    for name, p in eager.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=0, atol=1e-6, msg=name)
        moved = max(moved, float((p.detach() - unclipped.get_parameter(name).detach()).abs().max()))
    assert moved > 1e-4  # the unclipped step is another one: the comparison can tell


def test_the_trainer_keywords_override_the_compiled_options_one_by_one():
    options = dict(device="virtual", chaos=7, capacity_bytes=1 << 40, kernels="torch",
                   skip_nonfinite=True, loss_scale=True, max_grad_norm=2.0, timeout_s=90.0,
                   host_ram_bytes=1 << 50, undo_journal=True, optimizer=_sgd,
                   host_memory="pageable")
    # Every training option but the process group is set away from its default here, so a
    # keyword that resets the others would show.
    assert set(options) == {f.name for f in fields(TrainOptions)} - {"process_group"}
    assert all(getattr(TrainOptions(), k) != v for k, v in options.items()
               if k != "undo_journal")
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), **options)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    with Trainer(compiled, adamw, kernels="auto") as trainer:
        assert trainer.options == replace(compiled.options.train, optimizer=adamw,
                                          kernels="auto")
        assert trainer.loss_scaler is not None and trainer.timeout_s == 90.0
        assert trainer.executor.max_grad_norm == 2.0
    with Trainer(compiled) as trainer:  # no keyword: the compile's options, as they are
        assert trainer.options == compiled.options.train
    # A keyword can still turn an option back to its default (None is a value here).
    with Trainer(compiled, max_grad_norm=None, loss_scale=None, skip_nonfinite=False) as t:
        assert t.options.max_grad_norm is None and t.loss_scaler is None
    # The merged options are checked like any other.
    with pytest.raises(ValueError, match="kernels must be one of"):
        Trainer(compiled, kernels="cuda")


@pytest.mark.parametrize("compiled_journal", [True, False])
def test_the_undo_journal_keyword_is_applied_to_all_the_trainer_reads(compiled_journal):
    # undo_journal is a host-side choice: the schedule's actions do not depend on it (only
    # the simulated OPT time and the host figure do), so a Trainer keyword that differs from
    # the compile's is applied to everything the Trainer reads: its driver's rollback and
    # its host figure; the compile's setting holds when the keyword is not given.
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual",
                                 undo_journal=compiled_journal)
    assert compiled.hardware.undo_journal is compiled_journal
    for keyword in ({}, {"undo_journal": not compiled_journal}):
        journal = keyword.get("undo_journal", compiled_journal)
        with Trainer(compiled, _sgd, **keyword) as trainer:
            assert trainer.options.undo_journal is journal
            assert trainer.driver.rollback is journal
            assert (trainer.host_memory.journal > 0) is journal
            assert trainer.schedule == compiled.schedule  # the same actions either way
            trainer.step(token_batch(4))

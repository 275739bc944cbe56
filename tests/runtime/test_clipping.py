"""Gradient clipping by the global norm, against eager ``clip_grad_norm_`` training."""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

import rpcompile
from rpcompile.options import TrainOptions
from tests.tiny_models import hf_model, sft_batch


def _sgd(params):
    # SGD with momentum: no per-element normalisation (unlike Adam), so weights can be held to
    # 1e-6 of eager over several steps.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches():
    return [sft_batch(6, 12, left=k % 2 == 1, seed=30 + k) for k in range(5)]


def _eager_norms(model, batches, max_norm, stale=False):
    """Eager training with clip_grad_norm_; returns the pre-clip norms. ``stale``: the async
    rule, update k applies step k's gradient computed at the weights before update k-1."""
    opt = _sgd(list(model.parameters()))
    behind = copy.deepcopy(model)  # the weights step k's gradient is computed at (async)
    norms = []
    for b in batches:
        at = behind if stale else model
        at.zero_grad(set_to_none=True)
        at(**b, use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(at.parameters(), max_norm)))
        if stale:
            behind.load_state_dict(model.state_dict())
            for p, q in zip(model.parameters(), at.parameters()):
                p.grad = q.grad
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _pick_max_norm(batches, stale=False):
    norms = _eager_norms(hf_model("qwen3"), batches, float("inf"), stale)
    return statistics.median(norms)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_clipping_equals_eager_clip_grad_norm(mode):
    batches = _batches()
    stale = mode == "async"
    max_norm = _pick_max_norm(batches, stale)
    model = hf_model("qwen3")
    eager = copy.deepcopy(model)
    compiled = rpcompile.compile(model, gpus=3, microbatches=2, example_inputs=batches[0],
                                 optimizer=_sgd, device="virtual", mode=mode,
                                 max_grad_norm=max_norm, train=TrainOptions(chaos=3))
    try:
        norms = []
        for b in batches:
            compiled.step(b)
            norms.append(compiled.trainer().last.grad_norm)
        masters = compiled.trainer().masters()
        expected = _eager_norms(eager, batches, max_norm, stale)
        # Clipping must have triggered in some steps and not in others.
        assert any(n > max_norm for n in expected) and any(n <= max_norm for n in expected)
        assert norms == pytest.approx(expected, rel=1e-5)
        for name, p in eager.named_parameters():
            torch.testing.assert_close(masters[name], p.detach(), rtol=0, atol=1e-6, msg=name)
    finally:
        compiled.close()


def test_no_clipping_reports_no_norm_and_bad_values_are_refused():
    model = hf_model("qwen3", layers=2)
    batch = sft_batch(4, 12)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=batch,
                                 device="virtual")
    try:
        compiled.step(batch)
        assert compiled.trainer().last.grad_norm is None
    finally:
        compiled.close()
    for bad in (0, -1.0, "1.0"):
        with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
            rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=batch,
                              max_grad_norm=bad)

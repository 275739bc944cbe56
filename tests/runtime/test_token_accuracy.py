"""Token accuracy: each step counts the labelled tokens whose argmax logit is their label, in
the tail where the loss is computed (over the whole logits, or chunk by chunk inside the
chunked loss), and the count equals eager Hugging Face's on the same batch, as an integer,
with padding and with packing, in sync and async mode, with chaos on."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.options import CaptureOptions
from rpcompile.passes.chunked_loss import linear_cross_entropy
from rpcompile.runtime.trainer import Trainer
from tests.data.test_packing import _packed_steps
from tests.tiny_models import hf_model, sft_batch

LR = 0.05


def _hits(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Eager HF's count: the argmax of each position's logits against the next label."""
    target = labels[:, 1:]
    return int(((logits[:, :-1].argmax(-1) == target) & (target != -100)).sum())


def _rigged(model, batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``batch`` with about half of its labelled tokens set to what ``model`` predicts there
    (so the count is neither 0 nor all); unlabelled tokens stay -100."""
    with torch.no_grad():
        top = model(**batch).logits[:, :-1].argmax(-1)
    coin = torch.rand(top.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    labels = batch["labels"].clone()
    target = labels[:, 1:]
    target[:] = torch.where((target != -100) & coin, top, target)
    return dict(batch, labels=labels)


def _eager(model, data, mode: str) -> tuple[list[int], list[float]]:
    """Counts and losses of eager HF training with SGD; async: stale by one (step k's
    update applies step k-1's gradients)."""
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    counts, losses, pending = [], [], None
    for batch in data:
        optimizer.zero_grad()
        out = model(**batch)
        counts.append(_hits(out.logits, batch["labels"]))
        losses.append(float(out.loss.detach()))
        out.loss.backward()
        if mode == "sync":
            optimizer.step()
            continue
        grads = [p.grad.clone() for p in params]
        if pending is not None:
            for p, g in zip(params, pending):
                p.grad = g
            optimizer.step()
        pending = grads
    return counts, losses


@pytest.mark.parametrize("data_kind, mode, chunk", [
    ("padded", "sync", None), ("padded", "async", 5), ("packed", "sync", None)])
def test_each_step_counts_the_tokens_eager_hf_predicts_right(data_kind, mode, chunk):
    model = hf_model("qwen3", layers=2)
    if data_kind == "padded":
        data = [sft_batch(batch=6, seq=12, seed=s) for s in range(3)]
    else:
        data = [packed for packed, _ in _packed_steps(3)]
    data = [_rigged(model, b, seed) for seed, b in enumerate(data)]
    want, losses = _eager(copy.deepcopy(model), data, mode)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, rounds=2, example_inputs=data[0],
                                 capture=CaptureOptions(loss_chunk_tokens=chunk))
    assert compiled.capture.loss_chunk_tokens == chunk
    labelled = [int((b["labels"][:, 1:] != -100).sum()) for b in data]
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                                         device="virtual", chaos=5),
                 plan=replace(compiled.options.plan, mode=mode)) as trainer:
        results = list(trainer.fit(data))
    got = [r.correct_tokens for r in results]
    assert got == want, (got, want, labelled)
    assert all(0 < c < n for c, n in zip(got, labelled))
    for r, loss in zip(results, losses):
        assert float(r.loss) == pytest.approx(loss, rel=1e-5, abs=1e-6)


def test_the_chunked_loss_counts_hits_and_keeps_its_loss_and_gradients_bit_for_bit():
    """linear_cross_entropy(count_hits=True): the count of the whole logits' argmax hits on
    the targets that are not ignored, by chunks of 4 tokens; the loss and both gradients are
    the same bits as without the count."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 8, generator=gen, requires_grad=True)
    w = torch.randn(20, 8, generator=gen, requires_grad=True)
    top = (x @ w.t()).argmax(1).detach()
    target = torch.where(torch.rand(11, generator=gen) < 0.5, top,
                         torch.randint(0, 20, (11,), generator=gen))
    target[[0, 5]] = -100
    want = int(((top == target) & (target != -100)).sum())
    loss, hits = linear_cross_entropy(x, w, target, -100, 4, 2, count_hits=True)
    assert hits.dtype == torch.int64 and int(hits) == want and 0 < want < 9
    gx, gw = torch.autograd.grad(loss, (x, w))
    plain = linear_cross_entropy(x, w, target, -100, 4, 2)
    px, pw = torch.autograd.grad(plain, (x, w))
    assert torch.equal(loss, plain) and torch.equal(gx, px) and torch.equal(gw, pw)


def test_a_loss_fn_model_has_no_token_count():
    from tests.tiny_models import SkipNet, skipnet_batch

    compiled = rpcompile.compile(SkipNet(), gpus=2, microbatches=3, example_inputs=skipnet_batch(),
                                 loss_fn=torch.nn.functional.cross_entropy)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                                         device="virtual")) as trainer:
        trainer.step(skipnet_batch())
        assert trainer.last.correct_tokens is None

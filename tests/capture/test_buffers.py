"""Buffers a forward updates (BatchNorm's running statistics and its counter in training mode)
are refused at compile time, naming the buffers, the modules and the fix; the same model with
those modules in eval mode trains exactly as eager PyTorch does and leaves the buffers as they
were. Models whose forward updates no buffer (Hugging Face LLMs in training mode, dropout on)
are not affected: tests/capture/test_dropout.py compiles and trains them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rpcompile
from rpcompile.capture import RefusedModel


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x))


class _Net(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=gen), torch.randint(0, 3, (12,), generator=gen)


def _compile(model, batch):
    return rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=batch,
                             loss_fn=nn.functional.cross_entropy, device="virtual",
                             hardware="cpu", optimizer=lambda p: torch.optim.SGD(p, lr=0.5))


def test_a_forward_that_updates_buffers_is_refused_naming_them_and_the_fix():
    torch.manual_seed(0)
    model = _Net().train()
    with pytest.raises(RefusedModel) as info:
        _compile(model, _batch())
    text = str(info.value)
    for name in ("layers.0.norm.running_mean", "layers.0.norm.running_var",
                 "layers.0.norm.num_batches_tracked", "BatchNorm1d",
                 "layers.0.norm, layers.1.norm, layers.2.norm"):
        assert name in text, (name, text)
    assert "a microbatch's statistics instead of the batch's" in text
    assert "model.get_submodule('layers.0.norm').eval()" in text


def test_batchnorm_in_eval_mode_trains_like_eager_and_keeps_its_statistics():
    torch.manual_seed(0)
    model = _Net().train()
    for layer in model.layers:
        layer.norm.running_mean.uniform_(-1, 1)
        layer.norm.running_var.uniform_(0.5, 2)
        layer.norm.eval()
    eager = copy.deepcopy(model)
    statistics = {n: b.clone() for n, b in model.named_buffers()}
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.5)
    batches = [_batch(), tuple(t.flip(0) for t in _batch())]
    compiled = _compile(model, batches[0])
    try:
        for x, y in batches:
            loss = compiled.step((x, y))
            optimizer.zero_grad()
            want = nn.functional.cross_entropy(eager(x), y)  # equal microbatches: the mean
            want.backward()
            optimizer.step()
            torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
        compiled.sync_to_model()
    finally:
        compiled.close()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p, rtol=1e-5, atol=1e-6,
                                   msg=name)
    for name, b in model.named_buffers():
        assert torch.equal(b, statistics[name]), name

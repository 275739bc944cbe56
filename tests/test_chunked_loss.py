"""The chunked LM head + loss equals the whole-logits one, and holds less memory."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rpcompile
from tests.tiny_models import eager_batch_grads, hf_model, sft_batch


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_tied", "gpt_oss"])
def test_chunked_loss_equals_the_whole_logits_loss_and_eager(arch):
    model = hf_model(arch)
    batch = sft_batch(6, 12, left=arch == "qwen3_tied", seed=7)
    whole = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                              loss_chunk_tokens=None)
    chunked = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                                loss_chunk_tokens=5)  # 24 tokens per microbatch: 5 chunks
    assert chunked.capture.loss_chunk_tokens == 5 and whole.capture.loss_chunk_tokens is None
    assert "linear_cross_entropy" in chunked.stages[-1].code or any(
        "linear_cross_entropy" in s.code for s in chunked.stages)
    loss_w, grads_w = whole.reference_step(batch)
    loss_c, grads_c = chunked.reference_step(batch)
    loss_e, grads_e = eager_batch_grads(model, batch)
    torch.testing.assert_close(loss_c, loss_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=1e-6)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], grads_w[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_loss_trains_on_workers_like_eager():
    model = hf_model("llama")
    eager = copy.deepcopy(model)
    batches = [sft_batch(6, 12, seed=k) for k in range(2)]

    def opt(p):
        return torch.optim.SGD(p, lr=0.1)

    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=batches[0],
                                 loss_chunk_tokens=7, optimizer=opt, device="virtual", chaos=1)
    try:
        losses = [float(compiled.step(b)) for b in batches]
        masters = compiled.trainer().masters()
    finally:
        compiled.close()
    o = opt(eager.parameters())
    for b, loss in zip(batches, losses):
        o.zero_grad()
        ref = eager(**b, use_cache=False).loss
        ref.backward()
        o.step()
        assert loss == pytest.approx(float(ref), abs=1e-6)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=0, atol=1e-6, msg=name)


class _PeakBytes(TorchDispatchMode):
    """Measures the peak bytes of live tensor storages created inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def _tail_peak(chunk):
    model = hf_model("qwen3", layers=2, vocab_size=4096)
    batch = sft_batch(4, 64, seed=3, vocab=4096)
    compiled = rpcompile.compile(model, gpus=1, microbatches=1, example_inputs=batch,
                                 loss_chunk_tokens=chunk)
    with _PeakBytes() as meter:
        compiled.reference_step(batch)
    return meter.peak


def test_the_tails_measured_peak_falls_with_the_chunk_size():
    # 256 tokens x 4,096 vocabulary: the whole fp32 logits are 4 MiB, with their gradient more.
    peaks = [_tail_peak(c) for c in (None, 64, 16)]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert peaks[0] - peaks[2] > 4 * 2**20  # at least the whole logits are gone


def test_auto_chunks_only_when_the_logits_are_large():
    small = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                              example_inputs=sft_batch(4, 12))
    assert small.capture.loss_chunk_tokens is None
    with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive number"):
        rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                          example_inputs=sft_batch(4, 12), loss_chunk_tokens=0)

"""The chunked LM head + loss equals the whole-logits one, and holds less memory."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import rpcompile
from rpcompile.options import CaptureOptions, TrainOptions
from rpcompile.passes.chunked_loss import chunk_element_bytes, linear_cross_entropy
from rpcompile.passes.cost import linear_ce_scratch_bytes
from tests.tiny_models import eager_batch_grads, hf_model, sft_batch


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_tied", "gpt_oss"])
def test_chunked_loss_equals_the_whole_logits_loss_of_eager(arch):
    # Eager Hugging Face computes the whole logits: the chunked program's loss and every
    # gradient must equal it.
    model = hf_model(arch)
    batch = sft_batch(6, 12, left=arch == "qwen3_tied", seed=7)
    chunked = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batch,
                                capture=CaptureOptions(loss_chunk_tokens=5))  # 24 tokens per microbatch: 5 chunks
    assert chunked.capture.loss_chunk_tokens == 5
    assert "linear_cross_entropy" in chunked.stages[-1].code or any(
        "linear_cross_entropy" in s.code for s in chunked.stages)
    loss_c, grads_c = chunked.reference_step(batch)
    loss_e, grads_e = eager_batch_grads(model, batch)
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=1e-6)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_loss_trains_on_workers_like_eager():
    model = hf_model("llama")
    eager = copy.deepcopy(model)
    batches = [sft_batch(6, 12, seed=k) for k in range(2)]

    def opt(p):
        return torch.optim.SGD(p, lr=0.1)

    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=batches[0],
                                 optimizer=opt, device="virtual",
                                 capture=CaptureOptions(loss_chunk_tokens=7),
                                 train=TrainOptions(chaos=1))
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
    """Measures the peak bytes of live tensor storages created inside the block (a view or an
    in-place result of a tensor made before the block is not new memory, and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen and key not in inputs:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,chunk", [(2048, 256), (4096, 128), (8192, 32)])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_the_kernels_measured_peak_is_what_the_cost_model_charges(dtype, vocab, chunk,
                                                                  weight_grad):
    # The planner's charge (cost.linear_ce_scratch_bytes; paper.py uses the same per-element
    # figure) against the kernel's live tensor bytes, forward and backward measured apart. Both
    # must agree within a slack for the per-token vectors (log-sum-exp, targets, masks, the
    # token hits' argmax and comparisons: 32 bytes a token) and one chunk's [chunk, hidden]
    # products: an under-charge is a memory proof that
    # does not hold, an over-charge a sequence length the planner gives away.
    tokens, hidden = 512, 64
    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator().manual_seed(vocab + chunk)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) / 8).to(dtype).requires_grad_(weight_grad)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[::7] = -100
    slack = 32 * tokens + 8 * chunk * hidden
    assert linear_ce_scratch_bytes(1, 1, 0, elem, False) == chunk_element_bytes(elem)

    with _PeakBytes() as fwd:  # counting its token hits, as a causal LM's compiled tail does
        loss, _hits = linear_cross_entropy(x, w, target, -100, chunk, 1, count_hits=True)
    charged = linear_ce_scratch_bytes(chunk, vocab, hidden, elem, False)  # no weight gradient yet
    assert abs(fwd.peak - charged) <= slack, (fwd.peak / (chunk * vocab), charged)

    with _PeakBytes() as bwd:
        loss.backward()
    returned = sum(p.grad.untyped_storage().nbytes() for p in (x, w) if p.grad is not None)
    held = bwd.peak - returned  # the gradients it returns are charged as gradients
    charged = linear_ce_scratch_bytes(chunk, vocab, hidden, elem, weight_grad)
    assert held <= charged + slack, (held / (chunk * vocab), charged / (chunk * vocab))
    if not weight_grad:  # a frozen head (LoRA): the chunk's buffers alone, charged exactly
        assert charged - held <= slack, (held / (chunk * vocab), charged / (chunk * vocab))


def _tail_peak(chunk):
    model = hf_model("qwen3", layers=2, vocab_size=4096)
    batch = sft_batch(4, 128, seed=3, vocab=4096)
    compiled = rpcompile.compile(model, gpus=1, microbatches=1, example_inputs=batch,
                                 capture=CaptureOptions(loss_chunk_tokens=chunk))
    with _PeakBytes() as meter:
        compiled.reference_step(batch)
    return meter.peak


def test_the_tails_measured_peak_falls_with_the_chunk_size():
    # 512 tokens x 4,096 vocabulary: the whole fp32 logits are 8 MiB, with their gradient more.
    # (Below 64-token chunks the step's peak is no longer the loss's: the weights' gradients.)
    peaks = [_tail_peak(c) for c in (None, 256, 64)]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert peaks[0] - peaks[2] > 8 * 2**20  # at least the whole logits are gone


def test_auto_chunks_only_when_the_logits_are_large():
    small = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                              example_inputs=sft_batch(4, 12))
    assert small.capture.loss_chunk_tokens is None
    with pytest.raises(ValueError, match="loss_chunk_tokens must be a positive number"):
        rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                          example_inputs=sft_batch(4, 12),
                          capture=CaptureOptions(loss_chunk_tokens=0))

"""The training API on Compiled (step, state_dict, sync_to_model, memory_report) against eager
training: LoRA adapters only, a bf16 run, checkpoints, the host memory budget."""

from __future__ import annotations

import copy

import pytest
import torch

import rpcompile
from tests.tiny_models import hf_model, token_batch


def _adamw(lr=1e-2):
    return lambda params: torch.optim.AdamW(params, lr=lr, fused=True)


def _eager_train(model, batches, parts, lr=1e-2, dtype=None):
    """Ordinary training: fp32 masters, optional low-precision compute copy, AdamW."""
    masters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(masters, lr=lr, fused=True)
    work = copy.deepcopy(model).to(dtype) if dtype is not None else model
    losses = []
    for ids in batches:
        if dtype is not None:
            with torch.no_grad():
                for w, m in zip(work.parameters(), model.parameters()):
                    w.copy_(m)
        total = 0.0
        for chunk in ids.chunk(parts):
            loss = work(input_ids=chunk, labels=chunk).loss
            (loss / parts).backward()
            total += float(loss.detach())
        if dtype is not None:
            for w, m in zip(work.parameters(), model.parameters()):
                if m.requires_grad:
                    m.grad = w.grad.float()
                w.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / parts)
    return losses


def test_lora_trains_only_the_adapters():
    peft = pytest.importorskip("peft")
    model = hf_model("qwen3")
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero, so every adapter gets a gradient from step 1
            torch.nn.init.normal_(p, std=0.02)
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [token_batch(6, seed=s) for s in range(3)]
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=batches[0],
                                 device="virtual", optimizer=_adamw())
    try:
        losses = [float(compiled.step(b)) for b in batches]
        compiled.sync_to_model()
        report = compiled.memory_report()
    finally:
        compiled.close()
    eager = _eager_train(reference, batches, 3)
    assert losses == pytest.approx(eager, rel=1e-5)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), name
            torch.testing.assert_close(p, reference.get_parameter(name), rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(p, before[name]), name  # base weights bit-identical
    # Frozen bases get a shadow for upload but no master, gradient or optimizer state.
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report.trainable_params == trainable


def test_bf16_run_matches_eager_bf16():
    model = hf_model("qwen3", layers=2).to(torch.bfloat16)
    master = copy.deepcopy(model).float()  # fp32 masters start from the same values
    batches = [token_batch(4, seq=8, seed=s) for s in range(3)]
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=batches[0],
                                 device="virtual", optimizer=_adamw(1e-3))
    assert compiled.compute_dtype == torch.bfloat16
    try:
        losses = [float(compiled.step(b)) for b in batches]
        masters = compiled.trainer().masters()
    finally:
        compiled.close()
    eager = _eager_train(master, batches, 2, lr=1e-3, dtype=torch.bfloat16)
    assert losses == pytest.approx(eager, rel=2e-2)
    for name, p in master.named_parameters():
        torch.testing.assert_close(masters[name].float(), p, rtol=0, atol=2e-3, msg=name)


def test_state_dict_resumes_bit_identically():
    batches = [token_batch(6, seed=s) for s in range(4)]
    first = rpcompile.compile(hf_model("llama", layers=2), gpus=2, microbatches=3,
                              example_inputs=batches[0], device="virtual", optimizer=_adamw())
    second = rpcompile.compile(hf_model("llama", layers=2, seed=5), gpus=2, microbatches=3,
                               example_inputs=batches[0], device="virtual", optimizer=_adamw())
    try:
        for b in batches[:2]:
            first.step(b)
        second.load_state_dict(first.state_dict())
        a = [float(first.step(b)) for b in batches[2:]]
        b_ = [float(second.step(b)) for b in batches[2:]]
        assert a == b_
        ma, mb = first.trainer().masters(), second.trainer().masters()
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
    finally:
        first.close()
        second.close()


def test_memory_report_is_the_sum_of_what_is_kept():
    model = hf_model("qwen3_tied", layers=2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="convert the model first"):
        rpcompile.compile(hf_model("qwen3", layers=1), gpus=2, compute_dtype=torch.bfloat16)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual", optimizer=_adamw())
    try:
        compiled.step(token_batch(4))
        report = compiled.memory_report()
    finally:
        compiled.close()
    params = sum(p.numel() for p in compiled.model.parameters())  # tied weight counted once
    assert report.trainable_params == params
    # 4 master + 2 shadow + 4 gradient + 8 AdamW state bytes per parameter, within 5%.
    assert report.bytes_per_trainable_param == pytest.approx(18.0, rel=0.05)


def test_close_keeps_the_trained_state_and_refuses_more_steps():
    model = hf_model("qwen3", layers=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual", optimizer=_adamw())
    compiled.step(token_batch(4))
    state = compiled.state_dict()
    compiled.close()
    with pytest.raises(RuntimeError, match="was closed"):
        compiled.step(token_batch(4))
    compiled.sync_to_model()  # the trained weights, not the initial ones
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert compiled.state_dict()["step"] == state["step"]

"""The training API: a Trainer over a compiled model trains like eager PyTorch (same torch
optimizer, same gradient accumulation), checkpoints and restores exactly, writes its weights
back into the user's module, and handles frozen parameters and a bf16 model."""

from __future__ import annotations

import copy

import pytest
import torch

import rpcompile
from rpcompile.runtime.trainer import Trainer, plan_summary
from tests.test_executor import ADAMW, SGD, assert_trains_like_reference, batches
from tests.tiny_models import eager_grads, hf_model, token_batch


@pytest.fixture(scope="module")
def qwen3():
    model = hf_model("qwen3", layers=2)
    return rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=token_batch(6))


def eager_training(model, data, parts, make_optimizer):
    """Plain eager training of a copy of ``model``: per step, gradient accumulation over
    ``parts`` microbatches, then the optimizer."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in data:
        loss, grads = eager_grads(model, batch, parts)
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        optimizer.step()
        losses.append(loss)
    return losses, model


@pytest.mark.parametrize("arch,gpus,rounds", [("qwen3", 3, 1), ("llama", 2, 2)])
def test_training_matches_eager(arch, gpus, rounds):
    model = hf_model(arch, layers=2)
    size = 3 * rounds * 2
    compiled = rpcompile.compile(model, gpus=gpus, microbatches=3, rounds=rounds,
                                 example_inputs=token_batch(size))
    data = batches(3, size)
    eager_losses, eager_model = eager_training(model, data, 3 * rounds, ADAMW)
    with Trainer(compiled, ADAMW, device="virtual", chaos=1) as trainer:
        losses = [trainer.step(b) for b in data]
        masters = trainer.masters()
    for got, want in zip(losses, eager_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, p in eager_model.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_sync_to_model_writes_the_trained_weights(qwen3):
    model = qwen3.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with Trainer(qwen3, SGD, device="virtual") as trainer:
            trainer.step(token_batch(6))
            # Training leaves the user's module alone until asked.
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
            trainer.sync_to_model()
            masters = trainer.masters()
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), masters[name])
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(before[name])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_round_trip_continues_exactly(qwen3, mode):
    data = batches(4, 6)
    with Trainer(qwen3, ADAMW, device="virtual", mode=mode) as first:
        for b in data[:2]:
            first.step(b)
        state = first.state_dict()
        assert state["step"] == 2 and state["mode"] == mode
        assert state["plan"] == plan_summary(qwen3)
        continued = [first.step(b) for b in data[2:]]
        masters = {n: t.clone() for n, t in first.masters().items()}
    with Trainer(qwen3, ADAMW, device="virtual", mode=mode, chaos=3) as second:
        second.load_state_dict(state)
        assert second.steps_done == 2
        resumed = [second.step(b) for b in data[2:]]
        for got, want in zip(resumed, continued):
            assert torch.equal(got, want)
        for name, value in second.masters().items():
            assert torch.equal(value, masters[name]), name


def test_frozen_parameters_stay_and_the_rest_trains_bit_identically():
    model = hf_model("qwen3", layers=2)
    for name, p in model.named_parameters():
        if name.startswith("model.layers.0.") or "embed_tokens" in name:
            p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=token_batch(6))
    with assert_trains_like_reference(compiled, batches(2, 6), ADAMW, chaos=4) as trainer:
        assert set(trainer.masters()).isdisjoint(frozen)  # no master, no optimizer state
        trainer.sync_to_model()
        for name, value in frozen.items():
            assert torch.equal(model.get_parameter(name), value)


def test_bf16_model_trains_like_eager_mixed_precision():
    # The runtime keeps fp32 masters and computes in bf16; the eager counterpart does the
    # same by hand: bf16 copies of fp32 masters for the forward/backward, SGD on the masters.
    model = hf_model("qwen3", layers=2).to(torch.bfloat16)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6))
    eager = copy.deepcopy(model)
    masters = {n: p.detach().float().clone() for n, p in eager.named_parameters()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=0.1)
    data = batches(2, 6)
    with Trainer(compiled, lambda p: torch.optim.SGD(p, lr=0.1), device="virtual") as trainer:
        for batch in data:
            loss = trainer.step(batch)
            with torch.no_grad():
                for n, p in eager.named_parameters():
                    p.copy_(masters[n])
            eager_loss, grads = eager_grads(eager, batch, 3)
            for n, m in masters.items():
                m.grad = grads[n].float()
            optimizer.step()
            torch.testing.assert_close(loss, eager_loss.float(), rtol=1.6e-2, atol=1e-2)
        got = trainer.masters()
    for name, value in masters.items():
        torch.testing.assert_close(got[name], value, rtol=1.6e-2, atol=2e-3, msg=name)


def test_device_choice(qwen3):
    with pytest.raises(ValueError, match="mode"):
        Trainer(qwen3, SGD, device="virtual", mode="lazy")
    if not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="virtual"):
            trainer = Trainer(qwen3, SGD, device="auto")
        with trainer:
            assert all(w.kind == "virtual" for w in trainer.workers)
        with pytest.raises(RuntimeError, match="virtual"):
            Trainer(qwen3, SGD, device="cuda")


def test_peft_lora_trains_only_the_adapters():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(hf_model("qwen3", layers=2), lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=token_batch(6))
    with assert_trains_like_reference(compiled, batches(2, 6), ADAMW, chaos=2) as trainer:
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        assert set(trainer.masters()) == adapters and all("lora_" in n for n in adapters)
        opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert len(opt_params) == len(adapters)
        trainer.sync_to_model()
    for name, p in model.named_parameters():
        if name in adapters:
            assert not torch.equal(p, before[name]), f"adapter {name} did not train"
        else:
            assert torch.equal(p, before[name]), f"base weight {name} changed"


def test_loss_falls_on_a_repeated_batch(qwen3):
    batch = token_batch(6, seed=5)
    with Trainer(qwen3, lambda p: torch.optim.AdamW(p, lr=3e-3), device="virtual") as trainer:
        losses = [trainer.step(batch).item() for _ in range(6)]
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lr_scheduler_on_the_trainers_optimizer(qwen3, mode):
    # Update k uses the learning rate set when step k began, even while an async update runs.
    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.5 ** k)

    data = batches(3, 6)
    params = {n: p.detach().clone() for n, p in qwen3.model.named_parameters()}
    optimizer = ADAMW(list(params.values()))
    scheduler = schedule(optimizer)
    stale = {n: p.clone() for n, p in params.items()}
    for batch in data:
        _, grads = qwen3.reference_step(batch, params=params if mode == "sync" else stale)
        stale = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n]
        optimizer.step()
        scheduler.step()
    with Trainer(qwen3, ADAMW, device="virtual", mode=mode, chaos=5) as trainer:
        trainer_scheduler = schedule(trainer.optimizer)
        for batch in data:
            trainer.step(batch)
            trainer_scheduler.step()
        masters = trainer.masters()
    for name, value in params.items():
        assert torch.equal(masters[name], value), name


def test_a_step_with_adapters_merged_into_the_shared_base_is_refused():
    # The trainer shares a LoRA model's frozen base weights with the host store's shadows (one
    # copy on the host). PEFT's merge_adapter() writes W + BA into them in place, so a step
    # then would train on the merged base with the adapters applied again: refused, naming
    # the fix; after unmerge_adapter() the steps go on.
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf_model("qwen3", layers=2), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual")
    with Trainer(compiled, torch.optim.SGD, device="virtual") as trainer:
        trainer.step(token_batch(4, seed=1))
        trainer.sync_to_model()
        model.merge_adapter()
        with pytest.raises(ValueError, match=r"merged into its base weights.*unmerge_adapter"):
            trainer.step(token_batch(4, seed=2))
        model.unmerge_adapter()
        trainer.step(token_batch(4, seed=2))

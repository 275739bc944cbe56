"""The training API against eager PyTorch: a Trainer over a compiled model, and the same
through ``Compiled`` (step, state_dict, sync_to_model, memory_report), trains like eager
training (same torch optimizer, same gradient accumulation), checkpoints and restores exactly,
writes its weights back into the user's module, handles frozen parameters, LoRA and a bf16
model; a Trainer built by hand keeps the compile's training options, its keywords overriding
them one by one."""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace

import pytest
import torch

import rpcompile
from rpcompile import TrainOptions
from rpcompile.options import CaptureOptions, PlanOptions
from rpcompile.runtime.trainer import Trainer, plan_summary
from tests.runtime.test_executor import ADAMW, SGD, assert_trains_like_reference, batches
from tests.tiny_models import eager_grads, hf_model, sft_batch, token_batch


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
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=ADAMW, device="virtual",
                               chaos=1)) as trainer:
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
        with Trainer(qwen3,
                     train=replace(qwen3.options.train, optimizer=SGD,
                                   device="virtual")) as trainer:
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
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual"),
                 plan=replace(qwen3.options.plan, mode=mode)) as first:
        for b in data[:2]:
            first.step(b)
        state = first.state_dict()
        assert state["step"] == 2 and state["mode"] == mode
        assert state["plan"] == plan_summary(qwen3)
        continued = [first.step(b) for b in data[2:]]
        masters = {n: t.clone() for n, t in first.masters().items()}
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual", chaos=3),
                 plan=replace(qwen3.options.plan, mode=mode)) as second:
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
    assert compiled.compute_dtype == torch.bfloat16
    eager = copy.deepcopy(model)
    masters = {n: p.detach().float().clone() for n, p in eager.named_parameters()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=0.1)
    data = batches(2, 6)
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                         device="virtual")) as trainer:
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
        Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual"),
                plan=replace(qwen3.options.plan, mode="lazy"))
    if not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="virtual"):
            trainer = Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD,
                                                   device="auto"))
        with trainer:
            assert all(w.kind == "virtual" for w in trainer.workers)
        with pytest.raises(RuntimeError, match="virtual"):
            Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="cuda"))


def test_loss_falls_on_a_repeated_batch(qwen3):
    batch = token_batch(6, seed=5)
    with Trainer(qwen3, train=replace(qwen3.options.train,
                                      optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                                      device="virtual")) as trainer:
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
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual", chaos=5),
                 plan=replace(qwen3.options.plan, mode=mode)) as trainer:
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
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=torch.optim.SGD,
                                         device="virtual")) as trainer:
        trainer.step(token_batch(4, seed=1))
        trainer.sync_to_model()
        model.merge_adapter()
        with pytest.raises(ValueError, match=r"merged into its base weights.*unmerge_adapter"):
            trainer.step(token_batch(4, seed=2))
        model.unmerge_adapter()
        trainer.step(token_batch(4, seed=2))


# Compiled's training API


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
        trainer = compiled.trainer()
        assert set(trainer.masters()) == {n for n, p in model.named_parameters() if p.requires_grad}
        assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(
            trainer.masters())
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
        rpcompile.compile(hf_model("qwen3", layers=1), gpus=2,
                          capture=CaptureOptions(compute_dtype=torch.bfloat16))
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


# A Trainer built by hand from a compiled model


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
    with Trainer(compiled,
                 train=replace(compiled.options.train, device="virtual", timeout_s=60)) as trainer:
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


def test_the_trainer_runs_the_compiles_groups_unless_given_its_own():
    train = TrainOptions(device="virtual", chaos=7, kernels="torch", skip_nonfinite=True,
                         loss_scale=True, max_grad_norm=2.0, timeout_s=90.0,
                         host_ram_bytes=1 << 50, optimizer=_sgd)
    # Every training option but the process group is set away from its default here, so a
    # Trainer that read the defaults instead of the compile's group would show.
    default = TrainOptions()
    assert {f.name for f in fields(TrainOptions) if getattr(train, f.name) !=
            getattr(default, f.name)} == {f.name for f in fields(TrainOptions)} - {"process_group"}
    plan = PlanOptions(gpus=2, microbatches=2, capacity_bytes=1 << 40, host_memory="pageable")
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), token_batch(4), plan=plan,
                                 train=train)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    own = replace(compiled.options.train, optimizer=adamw, kernels="auto")
    with Trainer(compiled, train=own) as trainer:
        assert trainer.options == own and trainer.plan_options == compiled.options.plan
        assert trainer.loss_scaler is not None and trainer.timeout_s == 90.0
        assert trainer.executor.max_grad_norm == 2.0
    with Trainer(compiled) as trainer:  # no group: the compile's, as they are
        assert trainer.options == compiled.options.train
        assert trainer.plan_options == compiled.options.plan
        assert trainer.workers[0].capacity_bytes == 1 << 40
    # A group given turns an option back to its default (None is a value here).
    with Trainer(compiled, train=replace(compiled.options.train, max_grad_norm=None,
                                         loss_scale=None, skip_nonfinite=False)) as t:
        assert t.options.max_grad_norm is None and t.loss_scaler is None
    with pytest.raises(ValueError, match="kernels must be one of"):
        Trainer(compiled, train=replace(compiled.options.train, kernels="cuda"))


@pytest.mark.parametrize("compiled_journal", [True, False])
def test_the_undo_journal_option_is_applied_to_all_the_trainer_reads(compiled_journal):
    # undo_journal is a host-side choice: the schedule's actions do not depend on it (only
    # the simulated OPT time and the host figure do), so a Trainer plan group whose setting
    # differs from the compile's is applied to everything the Trainer reads: its driver's
    # rollback and its host figure; the compile's setting holds when no group is given.
    compiled = rpcompile.compile(hf_model("qwen3", layers=2), gpus=2, microbatches=2,
                                 example_inputs=token_batch(4), device="virtual",
                                 plan=PlanOptions(undo_journal=compiled_journal))
    assert compiled.hardware.undo_journal is compiled_journal
    for keyword in ({}, {"undo_journal": not compiled_journal}):
        journal = keyword.get("undo_journal", compiled_journal)
        with Trainer(compiled, train=replace(compiled.options.train, optimizer=_sgd),
                     plan=replace(compiled.options.plan, **keyword)) as trainer:
            assert trainer.plan_options.undo_journal is journal
            assert trainer.driver.rollback is journal
            assert (trainer.host_memory.journal > 0) is journal
            assert trainer.schedule == compiled.schedule  # the same actions either way
            trainer.step(token_batch(4))

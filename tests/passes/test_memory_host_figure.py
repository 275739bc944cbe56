"""The plan's host memory figure (rpcompile.passes.memory.host_memory), part by part, equals what
the runtime's host store, optimizer and undo journal hold, and each SHADOW's bytes are those
the runtime rewrites."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import hf_model, token_batch


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_host_memory_model_equals_what_the_host_store_of_a_lora_model_holds(mode):
    # A frozen-base LoRA Qwen3 trained two steps with AdamW: the plan's host figure, part by
    # part, equals the bytes of the buffers the runtime allocated (measured on the tensors):
    # one low-precision copy of every parameter (the frozen base has nothing else), fp32
    # masters, Adam moments and the gradient buffers (two in async mode) of the adapters only.
    peft = pytest.importorskip("peft")
    from rpcompile.passes.memory import host_memory

    base = hf_model("qwen3", layers=2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules="all-linear"))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual")
    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                                         device="virtual"), plan=replace(compiled.options.plan,
                                                                         mode=mode)) as trainer:
        for seed in range(2):
            trainer.step(token_batch(4, seed=seed))
        store = trainer.store
        moments = steps = 0
        for state in trainer.optimizer.state.values():
            for key, value in state.items():
                if key == "step":
                    steps += value.nbytes
                else:
                    moments += value.nbytes
        pending = 0 if store.pending is None else store.pending.nbytes
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert 0 < adapters < frozen / 10
        predicted = host_memory(compiled.plan, mode)
        # Async steps overlap: a second copy of the trainable parameters' shadow, which the
        # next step reads while this one's uploads read the first.
        pair = 0 if store.shadow_pair is None else store.shadow_pair.nbytes
        assert (pair > 0) == (mode == "async")
        assert predicted.shadows == store.shadow.nbytes + pair
        assert pair in (0, store.shadow.element_size() * adapters)
        assert store.shadow.numel() == frozen + adapters  # every parameter once
        assert predicted.masters == store.master.nbytes == 4 * adapters
        assert predicted.gradients == store.grad.nbytes + pending
        assert (pending > 0) == (mode == "async")
        assert predicted.optimizer == moments
        assert steps <= 8 * len(trainer.optimizer.state)  # one scalar per parameter tensor
        # The module's own bytes: storages of its tensors outside the store's buffers,
        # each once. Its frozen base is a view of the shadows (no second copy), unchanged;
        # what it still holds (the adapters, in the compute dtype) is the plan's ``model``.
        buffers = [(b.untyped_storage().data_ptr(), b.untyped_storage().nbytes())
                   for b in (store.shadow, store.master, store.grad)]

        def own(tensors) -> int:
            held = {}
            for t in tensors:
                ptr = t.untyped_storage().data_ptr()
                if not any(lo <= ptr < lo + n for lo, n in buffers):
                    held[ptr] = t.untyped_storage().nbytes()
            return sum(held.values())

        frozen_params = [p for p in model.parameters() if not p.requires_grad]
        assert own(frozen_params) == 0
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, before[name]), name
        assert predicted.model == own(model.parameters()) == 4 * adapters
        # Buffers (rotary frequencies) are not in the plan's figure: a few bytes.
        assert own(model.buffers()) < 1e-3 * predicted.total


@pytest.mark.parametrize("arch,lora", [("qwen3", True), ("qwen3_tied", False)])
def test_each_shadow_action_moves_the_bytes_the_runtime_rewrites(arch, lora):
    # A SHADOW rewrites, from the masters, the shadow of its stage's trainable parameters
    # only (a LoRA base has no masters; a tied embedding once per stage that holds it). The
    # lowered schedule's SHADOW bytes, from the planner's unit counts, must equal the
    # elements the runtime's refresh of that stage copies (the host store's runs, laid out
    # from the real parameters) times the shadow's element size; the simulator times SHADOW
    # by those bytes.
    model = hf_model(arch, layers=2)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                           target_modules="all-linear"))
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual")
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=torch.optim.SGD,
                                         device="virtual")) as trainer:
        store = trainer.store
        size = store.shadow.element_size()
        shadows = [a for a in trainer.schedule.host if a.kind == "SHADOW"]
        assert shadows
        for a in shadows:
            rewritten = sum(m1 - m0 for m0, m1, _ in store._stage_runs[a.stage])
            assert a.bytes == rewritten * size, a
        if lora:  # the frozen base is most of every stage's weights, and none of its SHADOW
            assert all(a.bytes < compiled.plan.stages[a.stage].weight_bytes / 4
                       for a in shadows)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_undo_journal_is_what_the_host_figure_and_the_simulator_charge(mode):
    # The optimizer driver's undo journal (rollback, the Trainer's setting) holds, until the
    # step commits, a copy of the masters and optimizer state each OPT changes and of the
    # shadows each SHADOW overwrites (each parameter once a step). Measured on the journal's
    # tensors in a full fine-tune: the plan's host figure is its peak, the lowered OPTs'
    # journal traffic (the simulator's per-parameter charge) is twice the masters and state
    # copied (each copy read and written), and each SHADOW's journal bytes in the simulator
    # are what that SHADOW's refresh added to the journal.
    from rpcompile.passes.memory import host_memory
    from rpcompile.runtime import optim
    from rpcompile.sim.engine import JOURNAL_BYTES_PER_PARAM
    from rpcompile.sim.sharding import shadow_journal_bytes

    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4),
                                 device="virtual", mode=mode)
    held: list[tuple[int, int, int]] = []  # per commit: masters, optimizer state, shadows
    refreshed: dict[int, list[int]] = {}  # step -> the shadow bytes each refresh saved
    commit, refresh = optim.OptimizerDriver.commit_step, optim.OptimizerDriver.refresh

    def shadow_bytes(driver):
        journal = driver._open.journal
        return 0 if journal is None else sum(t.nbytes for t in journal.shadows.values())

    def measuring_refresh(driver, stage, version=None):
        before = shadow_bytes(driver)
        refresh(driver, stage, version)
        refreshed.setdefault(driver.step, []).append(shadow_bytes(driver) - before)

    def measuring_commit(driver, skipped=False):
        journal = driver._open.journal
        if journal is not None:
            state = sum(v.nbytes for _p, saved in journal.state if saved is not None
                        for k, v in saved.items() if k != "step")
            held.append((sum(t.nbytes for t in journal.masters.values()), state,
                         shadow_bytes(driver)))
        return commit(driver, skipped)

    with Trainer(compiled, train=replace(compiled.options.train,
                                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                                         device="virtual"), plan=replace(compiled.options.plan,
                                                                         mode=mode)) as trainer:
        trainer.driver.commit_step = measuring_commit.__get__(trainer.driver)
        trainer.driver.refresh = measuring_refresh.__get__(trainer.driver)
        for seed in range(3):
            trainer.step(token_batch(4, seed=seed))
        schedule = trainer.schedule
    masters, state, shadows = max(held, key=sum)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert masters == 4 * trainable and state == 8 * trainable  # every trainable parameter
    assert host_memory(compiled.plan, mode).journal == masters + state + shadows
    steps = sorted({a.step for a in schedule.host if a.kind == "OPT"})
    opt_traffic = sum(a.bytes / 4 * JOURNAL_BYTES_PER_PARAM for a in schedule.host
                      if a.kind == "OPT") / len(steps)
    assert opt_traffic == 2 * (masters + state)
    charged = shadow_journal_bytes(schedule, compiled.plan)
    shadows_of = [[charged[a] for a in schedule.host if a.kind == "SHADOW" and a.step == k]
                  for k in steps]
    # The runtime's steps run the schedule's period over and over: step k is its step
    # k mod len(steps).
    for k, saved in refreshed.items():
        assert saved == shadows_of[k % len(steps)], k
    assert sum(shadows_of[0]) == shadows
    assert any(a.bytes > charged[a] for a in charged)  # some shadows are read by two stages

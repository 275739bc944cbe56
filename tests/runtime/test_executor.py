"""The executor runs the lowered schedule on virtual workers and reproduces the reference
executor bit for bit (loss and every master after several optimizer steps), under any worker
count and random delays (chaos); a failure anywhere surfaces in the caller with its context,
quickly, and leaves the masters at their pre-step values."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.runtime.errors import WorkerOutOfMemory
from rpcompile.runtime.executor import Executor, StepFailed
from rpcompile.runtime.trainer import Trainer
from tests.tiny_models import SkipNet, hf_model, skipnet_batch, token_batch


def SGD(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def ADAMW(params):
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


@pytest.fixture(scope="module")
def qwen3():
    model = hf_model("qwen3", layers=2)
    return rpcompile.compile(model, gpus=3, microbatches=3, example_inputs=token_batch(6))


def batches(n: int, size: int) -> list[torch.Tensor]:
    return [token_batch(batch=size, seed=10 + k) for k in range(n)]


def reference_training(compiled, data, make_optimizer, mode="sync"):
    """Losses and parameters after applying ``make_optimizer``'s torch optimizer to the
    gradients of ``compiled.reference_step`` (async: computed at the weights of the step
    before, one step stale)."""
    params = {n: p.detach().clone() for n, p in compiled.model.named_parameters()}
    trainable = {n: p for n, p in params.items() if compiled.model.get_parameter(n).requires_grad}
    optimizer = make_optimizer(list(trainable.values()))
    stale = {n: p.clone() for n, p in params.items()}
    losses = []
    for batch in data:
        loss, grads = compiled.reference_step(batch, params=params if mode == "sync" else stale)
        stale = {n: p.detach().clone() for n, p in params.items()}
        for n, p in trainable.items():
            p.grad = grads.get(n)
        optimizer.step()
        losses.append(loss)
    return losses, trainable


def assert_trains_like_reference(compiled, data, make_optimizer, mode="sync", chaos=None,
                                 stream=True, **plan_options):
    """Train on ``data`` and hold losses and masters bit for bit against
    :func:`reference_training`. ``stream``: as one stream of steps (``Trainer.fit``: step k+1
    runs while step k drains, two steps' jobs in flight); else one ``step()`` at a time.
    ``plan_options``: PlanOptions fields the trainer runs with instead of the compile's."""
    ref_losses, ref_params = reference_training(compiled, data, make_optimizer, mode)
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=make_optimizer,
                                         device="virtual", chaos=chaos),
                 plan=replace(compiled.options.plan, mode=mode, **plan_options)) as trainer:
        if stream:
            results = list(trainer.fit(data))
            assert [r.step for r in results] == list(range(len(data)))
            losses = [r.loss for r in results]
        else:
            losses = [trainer.step(batch) for batch in data]
        # Every weight slot, gradient buffer and value was freed by the schedule's actions.
        assert set(trainer.last.left_over_bytes) == {0}, trainer.last.left_over_bytes
        masters = trainer.masters()
        for k, (got, want) in enumerate(zip(losses, ref_losses)):
            assert torch.equal(got, want), f"step {k}: loss {got.item()} != {want.item()}"
        assert set(masters) == set(ref_params)
        for name, want in ref_params.items():
            assert torch.equal(masters[name], want), f"master {name} differs from the reference"
        assert all(p <= q for p, q in zip(trainer.peak_bytes(), trainer.predicted_peak_bytes()))
        return trainer


@pytest.mark.parametrize("gpus,chaos,stream", [
    (1, None, True), (2, 11, True), (3, None, False), (3, 12, True), (4, 13, True),
    (8, None, False), (8, 14, True),
])
def test_qwen3_bit_identical_to_reference_sgd(qwen3, gpus, chaos, stream):
    compiled = qwen3 if gpus == 3 else qwen3.replan(gpus, microbatches=3)
    assert_trains_like_reference(compiled, batches(3, 6), SGD, chaos=chaos, stream=stream)


@pytest.mark.parametrize("gpus,chaos", [(1, None), (3, 5), (4, 6)])
def test_qwen3_bit_identical_to_reference_adamw(qwen3, gpus, chaos):
    compiled = qwen3 if gpus == 3 else qwen3.replan(gpus, microbatches=3)
    assert_trains_like_reference(compiled, batches(3, 6), ADAMW, chaos=chaos)


@pytest.mark.parametrize("arch,gpus,chaos", [
    ("llama", 2, 3), ("qwen3_moe", 3, 4), ("qwen3_tied", 3, 7), ("qwen2", 3, 8),
    ("mistral", 2, None), ("gpt_oss", 3, 9),
])
def test_other_architectures_bit_identical(arch, gpus, chaos):
    model = hf_model(arch, layers=2)
    compiled = rpcompile.compile(model, gpus=gpus, microbatches=3, example_inputs=token_batch(6))
    assert_trains_like_reference(compiled, batches(3, 6), ADAMW, chaos=chaos)


@pytest.mark.parametrize("arch,gpus,chaos", [
    ("qwen3_moe", 4, 21), ("qwen3_moe", 3, 22), ("gpt_oss", 4, 23), ("gpt_oss", 3, 24),
])
def test_opaque_blocks_run_concurrently_bit_identical(arch, gpus, chaos):
    # No lock serialises MoE computes any more: several workers run opaque blocks at once,
    # each on its thread's skeleton copy of the module, and still match the reference.
    model = hf_model(arch, layers=3)
    compiled = rpcompile.compile(model, gpus=gpus, microbatches=4, example_inputs=token_batch(8))
    assert_trains_like_reference(compiled, batches(3, 8), ADAMW, chaos=chaos)


def test_opaque_call_is_thread_safe():
    # Threads running one opaque block with different weights at the same time each get the
    # result of their own weights (functional_call on a shared module would mix them).
    import sys
    import threading

    from rpcompile.capture.opaque import _run_opaque

    model = hf_model("qwen3_moe", layers=1)
    compiled = rpcompile.compile(model, gpus=1, microbatches=1, example_inputs=token_batch(2))
    entry = next(e for e in compiled.capture.opaque_entries
                 if e.module is model.model.layers[0].mlp)
    x = torch.randn(4, 64, 64)
    weights = [[torch.randn_like(entry.module.get_parameter(n)) for n in entry.param_names]
               for _ in range(4)]
    want = [_run_opaque(entry, [x], w)[0] for w in weights]
    errors = []
    barrier = threading.Barrier(4)

    def work(k):
        barrier.wait()
        for _ in range(30):
            got = _run_opaque(entry, [x], weights[k])[0]
            if not torch.equal(got, want[k]):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside functional_call's swaps too
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    # The shared module keeps its own parameters, and no weight memory was copied per thread.
    assert all(entry.module.get_parameter(n).numel() > 0 for n in entry.param_names)


@pytest.mark.parametrize("gpus", [1, 3, 8])
def test_long_skip_connection_travels_along_the_chain(gpus):
    # SkipNet: block 1's output feeds block 5 and the embedding feeds the head, so values
    # (forward) and their gradients (backward) must pass through stages that do not use them.
    model = SkipNet()
    compiled = rpcompile.compile(model, gpus=gpus, microbatches=3,
                                 example_inputs=skipnet_batch(6),
                                 loss_fn=torch.nn.functional.cross_entropy)
    data = [skipnet_batch(6, seed=k) for k in range(3)]
    assert_trains_like_reference(compiled, data, SGD, chaos=gpus)


def test_bulk_transfers_in_chunks(qwen3):
    trainer = assert_trains_like_reference(qwen3, batches(2, 6), SGD, chaos=3, chunk_bytes=4096)
    bulk = [a for lst in trainer.schedule.actions for a in lst if a.priority == "bulk"]
    assert {a.kind for a in bulk if a.chunks > 10} == {"UP", "D2H"}


def test_measured_timeline_covers_every_action_and_dumps(qwen3, tmp_path):
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=SGD, device="virtual")) as trainer:
        trainer.step(token_batch(6))
        timeline = trainer.last.timeline
        step0 = [a for a in trainer.schedule.all_actions() if a.step == 0]
        assert set(timeline) == set(step0)
        # Every edge is honoured in measured time: a waiting action starts after its source.
        for e in trainer.schedule.edges:
            if e.src in timeline and e.dst in timeline:
                assert timeline[e.dst][0] >= timeline[e.src][1], e
        trainer.schedule.dump(tmp_path / "run.json", timeline=timeline)
        assert (tmp_path / "run.json").stat().st_size > 0


def test_rounds_accumulate_on_the_host_bit_identically():
    model = hf_model("llama", layers=2)
    compiled = rpcompile.compile(model, gpus=3, microbatches=2, rounds=2,
                                 example_inputs=token_batch(8))
    assert_trains_like_reference(compiled, batches(3, 8), ADAMW, chaos=2)


@pytest.mark.parametrize("gpus,chaos,stream", [(1, 3, True), (2, None, False), (3, 9, True),
                                               (8, 10, True)])
def test_async_mode_is_one_step_stale_reference(qwen3, gpus, chaos, stream):
    # Eager stale-by-one training (each step's gradients at the weights before the previous
    # update), steps overlapping under chaos on 1, 3 and 8 virtual workers.
    compiled = qwen3 if gpus == 3 else qwen3.replan(gpus, microbatches=3)
    assert_trains_like_reference(compiled, batches(4, 6), ADAMW, mode="async", chaos=chaos,
                                 stream=stream)


def test_schedule_period_continues_round_robin_across_steps(qwen3):
    # With J jobs per step on G workers dealing repeats after G / gcd(J, G) steps: the
    # schedule spans as many steps as an edge reaches back, then that period, which a run
    # repeats (step k of a longer run runs schedule step Schedule.step_of(k)).
    from rpcompile.passes.schedule import runtime_cycle

    for gpus in (4, 5, 3, 8, 2):
        compiled = qwen3.replan(gpus, microbatches=3)
        period = gpus // math.gcd(len(compiled.stages), gpus)
        if period > 1:
            break
    else:
        pytest.skip("every worker count divides the stage count of this plan")
    steps, repeat_from, repeat_until = runtime_cycle(compiled.plan.stages, gpus)
    assert repeat_until - repeat_from == period == steps - repeat_until
    trainer = assert_trains_like_reference(compiled, batches(repeat_until + 1, 6), SGD)
    sched = trainer.schedule
    assert (sched.steps, sched.repeat_from, sched.run_steps) == (steps, repeat_from,
                                                                repeat_until)
    assert trainer.last.schedule_step == repeat_from  # the last step wraps around


@pytest.mark.parametrize("kind,edge", [("UP", "weights"), ("H2D", "arrived"),
                                       ("D2H", "on_host")])
def test_edges_alone_order_the_work(qwen3, monkeypatch, kind, edge):
    """Slow one action kind down: with the schedule's edges the step is still exact; without
    the edges of one kind, the reader runs before its writer and the step fails."""
    original = getattr(Executor, "_do_" + kind)

    def slow(self, run, a):
        time.sleep(0.05)
        return original(self, run, a)

    monkeypatch.setattr(Executor, "_do_" + kind, slow)
    data = batches(1, 6)
    ref_losses, _ = reference_training(qwen3, data, SGD)
    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=SGD, device="virtual")) as trainer:
        assert torch.equal(trainer.step(data[0]), ref_losses[0])
        schedule = trainer.schedule
        dropped = schedule.replace(edges=tuple(e for e in schedule.edges if e.kind != edge))
        executor = Executor(qwen3, trainer.workers, dropped, trainer.store, trainer.driver)
        with pytest.raises(StepFailed) as info:
            executor.run_step(qwen3.capture.example_batch)
        # The reader found nothing where its writer had not yet put it.
        assert isinstance(info.value.cause, KeyError), info.value


# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------


def _raise_on_call(monkeypatch, program, call: int, error: Exception) -> None:
    """Make ``program``'s graph module raise ``error`` on its ``call``-th call (0-based)."""
    module = program.graph_module
    original = type(module).forward
    calls = [0]

    def forward(*args):
        calls[0] += 1
        if calls[0] == call + 1:
            raise error
        return original(module, *args)

    monkeypatch.setattr(module, "forward", forward)


def _snapshot(trainer):
    """Copies of the masters and optimizer state as they are, without a flush (async: the
    pending gradients, and the step they are of, go in as two more entries), so a failed
    step is held to changing nothing at all, its predecessor's pending gradients included."""
    store = trainer.store
    masters = {s.name: store.master_of(s.name).clone() for s in store.trainable_slots}
    if store.pending is not None:
        masters["<pending gradients>"] = store.pending.clone()
        masters["<pending step>"] = torch.tensor(-1 if trainer.driver.pending_step is None
                                                 else trainer.driver.pending_step)
    return masters, copy.deepcopy(trainer.optimizer.state_dict())


def _assert_same_optimizer_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, value in a["state"][k].items():
            other = b["state"][k][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


@pytest.mark.parametrize("stage_kind", ["forward", "tail", "backward"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failure_in_a_stage_surfaces_with_context_and_keeps_masters(
        qwen3, monkeypatch, stage_kind, mode):
    data = batches(3, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=ADAMW, device="virtual",
                                      chaos=1, timeout_s=60), plan=replace(qwen3.options.plan,
                                                                           mode=mode)) as trainer:
        trainer.step(data[0])
        masters, opt_state = _snapshot(trainer)
        # The last stage of the kind: a forward stage that reads an activation, the tail,
        # or the backward stage that holds unit 0.
        program = [p for p in qwen3.stages if p.kind == stage_kind][-1]
        stage_name = program.name
        with monkeypatch.context() as patch:
            # Microbatch 1 of the job: its forward is the program's 2nd call in the step.
            _raise_on_call(patch, program, 1, ValueError("injected fault"))
            start = time.monotonic()
            with pytest.raises(StepFailed) as info:
                trainer.step(data[1])
            elapsed = time.monotonic() - start
        err = info.value
        assert elapsed < 10
        assert err.stage == stage_name and err.microbatch == 1 and err.round == 0
        assert err.worker == trainer.workers[err.action.worker].name
        assert err.action.stage == program.index and err.action.kind in ("F", "T", "B")
        assert isinstance(err.cause, ValueError) and isinstance(err.__cause__, ValueError)
        assert stage_name in str(err) and "microbatch 1" in str(err) and str(err.action) in str(err)
        after, opt_after = _snapshot(trainer)
        for name, value in masters.items():
            assert torch.equal(after[name], value), f"{name} changed by a failed step"
        _assert_same_optimizer_state(opt_state, opt_after)
        assert all(w.memory_in_use == 0 for w in trainer.workers)
        # The trainer recovers: the next steps continue as if the failed step never happened.
        trainer.step(data[1])
        trainer.step(data[2])
        losses_ref, params_ref = reference_training(qwen3, data, ADAMW, mode)
        assert torch.equal(trainer.last.loss, losses_ref[2])
        masters = trainer.masters()
        for name, value in params_ref.items():
            assert torch.equal(masters[name], value), name


def test_failure_in_a_transfer_and_on_the_host(qwen3, monkeypatch):
    data = batches(2, 6)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                      chaos=2, timeout_s=60)) as trainer:
        trainer.step(data[0])
        masters, _ = _snapshot(trainer)
        original = Executor._do_D2H

        def broken_d2h(self, run, a):
            if a.what == "act" and a.microbatch == 2:
                raise OSError("link down")
            return original(self, run, a)

        with monkeypatch.context() as patch:
            patch.setattr(Executor, "_do_D2H", broken_d2h)
            with pytest.raises(StepFailed) as info:
                trainer.step(data[1])
        assert info.value.action.kind == "D2H" and info.value.microbatch == 2
        assert info.value.stream == "download"

        with monkeypatch.context() as patch:
            def broken_acc(stage, flat, timeout=None):
                raise RuntimeError("host out of memory")
            patch.setattr(trainer.driver, "accumulate_grad", broken_acc)
            with pytest.raises(StepFailed) as info:
                trainer.step(data[1])
        assert info.value.worker is None and info.value.action.kind == "ACC"
        assert "host" in str(info.value)
        after, _ = _snapshot(trainer)
        assert all(torch.equal(after[n], v) for n, v in masters.items())
        trainer.step(data[1])  # and it still trains


def test_device_memory_capacity_is_enforced_with_the_stage_named(qwen3):
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual"),
                 plan=replace(qwen3.options.plan, capacity_bytes=64 * 1024)) as trainer:
        with pytest.raises(StepFailed) as info:
            trainer.step(token_batch(6))
    cause = info.value.cause
    assert isinstance(cause, WorkerOutOfMemory)
    assert "weights" in cause.tag and str(cause.requested) in str(info.value)


def test_peak_memory_within_the_planners_prediction_with_many_microbatches():
    # One worker holds every microbatch's saved inputs until the backward jobs: the case
    # where held activations are largest relative to one job's predicted working set.
    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=1, microbatches=8, example_inputs=token_batch(8))
    trainer = assert_trains_like_reference(compiled, batches(2, 8), SGD)
    measured, proven = trainer.peak_bytes(), trainer.predicted_peak_bytes()
    assert proven == tuple(p.peak_bytes for p in compiled.memory)
    assert all(m <= p for m, p in zip(measured, proven, strict=True)), (measured, proven)
    # ... and the measurement saw the held activations, not one stage's weights alone.
    assert measured[0] > max(s.weight_bytes for s in compiled.plan.stages)


def test_executor_refuses_a_schedule_it_cannot_run(qwen3):
    from rpcompile.passes.lower import lower
    from rpcompile.passes.schedule import build_schedule

    with Trainer(qwen3,
                 train=replace(qwen3.options.train, optimizer=SGD, device="virtual")) as trainer:
        compute = build_schedule(qwen3.plan, workers=2, microbatches=3, optimizer="sync")
        with pytest.raises(ValueError, match="2 workers, 3 given"):
            Executor(qwen3, trainer.workers, lower(compute, qwen3.plan)[0], trainer.store,
                     trainer.driver)
        compute = build_schedule(qwen3.plan, workers=3, microbatches=3, optimizer="sync")
        with pytest.raises(ValueError, match="passes"):
            Executor(qwen3, trainer.workers, compute, trainer.store, trainer.driver)


def test_workers_on_another_device_run_retargeted_graphs(qwen3):
    # A worker whose device differs from the capture device runs StageProgram.on_device()
    # copies of the graphs (one per stage and device), bit-identically. Without a second
    # device here, the capture device is pretended to be another one.
    data = batches(2, 6)
    ref_losses, ref_params = reference_training(qwen3, data, SGD)
    with Trainer(qwen3, train=replace(qwen3.options.train, optimizer=SGD, device="virtual",
                                      chaos=4)) as trainer:
        trainer.executor._capture_device = torch.device("meta")
        losses = [trainer.step(b) for b in data]
        retargeted = set(trainer.executor._graphs)
        masters = trainer.masters()
        assert retargeted == {(p.index, torch.device("cpu")) for p in qwen3.stages}
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        assert all(torch.equal(masters[n], p) for n, p in ref_params.items())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_missing_edge_between_steps_breaks_exactness(qwen3, monkeypatch, mode):
    """The edges between steps are what keeps overlapping steps exact. With each SHADOW of a
    step after the first held back (the host is slow), a stream of steps still trains as
    eager training does; with the ``shadow`` edges from one step into the next taken out of
    the schedule (a forward upload no longer waits for the shadow it reads), the next step
    uploads the weights before they are rewritten and leaves eager training."""
    original = Executor._do_SHADOW

    def slow_shadow(self, run, a):
        if run.k >= 1:
            time.sleep(0.3)
        original(self, run, a)

    monkeypatch.setattr(Executor, "_do_SHADOW", slow_shadow)
    data = batches(3, 6)
    assert_trains_like_reference(qwen3, data, SGD, mode=mode, chaos=4)

    lowered = Trainer._lowered_schedule

    def without_shadow_edges(self, compiled, run, check_passes=0):
        sched = lowered(self, compiled, run, check_passes)
        dropped = [e for e in sched.edges if e.kind == "shadow" and e.src.step != e.dst.step]
        assert dropped
        return sched.replace(edges=tuple(e for e in sched.edges if e not in dropped))

    monkeypatch.setattr(Trainer, "_lowered_schedule", without_shadow_edges)
    with pytest.raises(AssertionError, match=r"differs from the reference|loss"):
        assert_trains_like_reference(qwen3, data, SGD, mode=mode, chaos=4)

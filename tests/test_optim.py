"""Optimizer driver: sync stage-by-stage equals one plain step, async is exactly one step stale."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call

from rpcompile.runtime.errors import OptimizerError, UpstreamFailed
from rpcompile.runtime.memory import HostStore
from rpcompile.runtime.optim import OptimizerDriver


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
        nn.Linear(12, 3),
    )


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, weights: dict[str, torch.Tensor], batch, scale: float = 1.0):
    x, y = batch
    return nn.functional.mse_loss(functional_call(model, weights, (x,)), y) * scale


def _grads(model: nn.Module, weights: dict[str, torch.Tensor], batch, scale: float = 1.0):
    leaves = {n: w.detach().clone().requires_grad_(True) for n, w in weights.items()}
    grads = torch.autograd.grad(_loss(model, leaves, batch, scale), list(leaves.values()))
    return dict(zip(leaves, grads))


def _roundpipe_store(model: nn.Module) -> HostStore:
    """One forward stage over everything; backward stages [6, 4] then [2, 0] (tail first)."""
    p = dict(model.named_parameters())
    layer = lambda i: [(f"{i}.weight", p[f"{i}.weight"]), (f"{i}.bias", p[f"{i}.bias"])]  # noqa: E731
    forward = [kv for i in (0, 2, 4, 6) for kv in layer(i)]
    return HostStore.build([forward, layer(4) + layer(6), layer(0) + layer(2)], grad_stages=[1, 2])


def _driver_step(driver: OptimizerDriver, model: nn.Module, microbatches) -> None:
    """One step the way the executor drives it: compute on the shadow, send each backward
    stage's gradient home per round, report the stage done after its last round."""
    store = driver.store
    driver.begin_step()
    driver.wait_shadow(timeout=10)
    weights = store.stages[0].shadow_views()
    per_round = [_grads(model, weights, mb, 1.0 / len(microbatches)) for mb in microbatches]
    for stage in (1, 2):
        for grads in per_round:
            flat = torch.zeros(store.stages[stage].layout.grad_numel)
            for name, view in store.stages[stage].grad_views(flat).items():
                view.copy_(grads[name])
            driver.accumulate_grad(stage, flat, timeout=10)
        driver.stage_done(stage)
    driver.finish_step()


OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sync_stage_by_stage_is_bit_identical_to_one_plain_step(name):
    make = OPTIMIZERS[name]
    reference = _model()
    ref_opt = make(list(reference.parameters()))
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, make, mode="sync")
    assert len(driver.groups) == 2  # one per backward stage
    batches = _batches(8)
    for k in range(4):
        rounds = batches[2 * k : 2 * k + 2]  # gradient accumulation over two rounds
        ref_opt.zero_grad()
        for mb in rounds:
            _loss(reference, dict(reference.named_parameters()), mb, 0.5).backward()
        ref_opt.step()
        _driver_step(driver, model, rounds)
    driver.wait(timeout=10)
    for n, p in reference.named_parameters():
        assert torch.equal(store.master_of(n), p), n
        assert torch.equal(store.shadow_of(n), p), n  # shadow refreshed after each update
    ref_state = ref_opt.state_dict()["state"]
    our_state = driver.optimizer.state_dict()["state"]
    order = {id(p): i for i, p in enumerate(reference.parameters())}
    names = [n for n, _ in reference.named_parameters()]
    for i, (n, _) in enumerate(store.named_masters()):
        j = order[id(reference.get_parameter(n))]
        assert names[j] == n
        for key, value in ref_state[j].items():
            assert torch.equal(torch.as_tensor(our_state[i][key]), torch.as_tensor(value)), (n, key)
    assert store.grad.abs().sum() == 0  # consumed gradients are zeroed
    driver.close()


def test_sync_updates_a_stage_as_soon_as_its_gradients_are_home():
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, OPTIMIZERS["sgd_nesterov"], mode="sync")
    before = store.master_of("6.weight").clone()
    driver.begin_step()
    grads = _grads(model, store.stages[0].shadow_views(), _batches(1)[0])
    flat = torch.zeros(store.stages[1].layout.grad_numel)
    for n, view in store.stages[1].grad_views(flat).items():
        view.copy_(grads[n])
    driver.accumulate_grad(1, flat)
    driver.stage_done(1)
    # The tail's group updates now, while stage 2's gradients are still missing.
    driver.shadow_event(1, step=1).wait(timeout=10)
    assert not driver.shadow_event(2, step=1).is_set()
    assert not torch.equal(store.master_of("6.weight"), before)
    assert torch.equal(store.shadow_of("6.weight"), store.master_of("6.weight"))
    with pytest.raises(RuntimeError, match=r"stages \[2\] never called stage_done"):
        driver.finish_step()
    with pytest.raises(ValueError, match="not a gradient stage"):
        driver.accumulate_grad(0, torch.zeros(store.stages[0].layout.grad_numel))
    driver.accumulate_grad(2, torch.zeros(store.stages[2].layout.grad_numel))
    driver.stage_done(2)
    driver.finish_step().wait(timeout=10)
    assert driver.shadow_event(2).is_set()
    driver.close()


def test_async_is_exactly_one_step_stale_with_hyperparameters_of_its_step():
    lrs = [1e-2, 5e-3, 2e-2, 1e-3, 4e-3]
    batches = _batches(len(lrs))
    # Hand-written stale loop: w_{k+1} = AdamW(w_k, grad of loss_k at w_{k-1}), w_{-1} = w_0.
    reference = _model()
    ref_opt = torch.optim.AdamW(list(reference.parameters()), lr=lrs[0], fused=True)
    stale = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for k, batch in enumerate(batches):
        grads = _grads(reference, stale, batch)
        stale = {n: p.detach().clone() for n, p in reference.named_parameters()}  # w_k
        for n, p in reference.named_parameters():
            p.grad = grads[n]
        ref_opt.param_groups[0]["lr"] = lrs[k]
        ref_opt.step()

    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(
        store, lambda p: torch.optim.AdamW(p, lr=lrs[0], fused=True), mode="async"
    )
    # An LR scheduler steps between steps: update k must use lrs[k] even though it runs
    # while step k+1 is already under way (and the scheduler has moved on).
    scheduler = torch.optim.lr_scheduler.LambdaLR(driver.optimizer, lambda k: lrs[k] / lrs[0])
    for batch in batches:
        _driver_step(driver, model, [batch])
        if driver.step < len(lrs):
            scheduler.step()
    driver.wait(timeout=10)
    for n, p in reference.named_parameters():
        assert torch.equal(store.master_of(n), p), n
        assert torch.equal(store.shadow_of(n), stale[n]), n  # the next step would use w_k

    # The same run in sync mode ends elsewhere: the staleness is real.
    sync_store = _roundpipe_store(_model())
    sync = OptimizerDriver(sync_store, lambda p: torch.optim.AdamW(p, lr=lrs[0], fused=True))
    for k, batch in enumerate(batches):
        sync.optimizer.param_groups[0]["lr"] = lrs[k]
        _driver_step(sync, model, [batch])
    sync.wait(timeout=10)
    assert not torch.equal(sync_store.master, store.master)
    driver.close()
    sync.close()


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mid(self.emb(ids))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_tied_weight_is_updated_once_after_both_uses_report():
    reference = _TiedLM()
    ref_opt = torch.optim.AdamW(list(reference.parameters()), lr=1e-2, fused=True)
    model = _TiedLM()
    p = dict(model.named_parameters(remove_duplicate=False))
    stages = [[("emb.weight", p["emb.weight"])],
              [("mid.weight", p["mid.weight"]), ("mid.bias", p["mid.bias"]),
               ("head.weight", p["head.weight"])]]
    store = HostStore.build(stages)
    driver = OptimizerDriver(store, lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    assert sorted(sorted(g.stages) for g in driver.groups) == [[0, 1], [1]]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 20, (2, 5), generator=g)
        ref_opt.zero_grad()
        reference(ids).backward()
        ref_opt.step()
        driver.begin_step()
        driver.wait_shadow(timeout=10)
        # Each stage differentiates its own use of the tied weight.
        leaves = {(s, n): store.shadow_of(n).clone().requires_grad_(True)
                  for s, st in enumerate(stages) for n, _ in st}
        weights = {n: leaves[(s, n)] for (s, n) in leaves}
        loss = functional_call(model, weights, (ids,), tie_weights=False)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        for s in (1, 0):  # the tail's job finishes first
            flat = torch.zeros(store.stages[s].layout.grad_numel)
            for n, view in store.stages[s].grad_views(flat).items():
                view.copy_(grads[(s, n)])
            driver.accumulate_grad(s, flat)
            driver.stage_done(s)
        driver.finish_step()
    driver.wait(timeout=10)
    for n, param in reference.named_parameters():
        assert torch.equal(store.master_of(n), param), n
    driver.close()


class _SignSGD(torch.optim.Optimizer):
    """A user optimizer the driver does not know."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad.sign())


def test_coupled_optimizers_are_refused_and_unknown_ones_step_whole():
    model = _model()
    with pytest.raises(ValueError, match="LBFGS couples"):
        OptimizerDriver(_roundpipe_store(model), lambda p: torch.optim.LBFGS(p))
    with pytest.warns(RuntimeWarning, match="not known to update each parameter"):
        driver = OptimizerDriver(_roundpipe_store(model), lambda p: _SignSGD(p))
    assert len(driver.groups) == 1 and driver.groups[0].stages == {1, 2}
    reference = _model()
    ref_opt = _SignSGD(list(reference.parameters()))
    batch = _batches(1)[0]
    _loss(reference, dict(reference.named_parameters()), batch).backward()
    ref_opt.step()
    _driver_step(driver, model, [batch])
    driver.wait(timeout=10)
    for n, p in reference.named_parameters():
        assert torch.equal(driver.store.master_of(n), p), n
    driver.close()
    with pytest.raises(ValueError, match="not the store's masters"):
        OptimizerDriver(_roundpipe_store(model), torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_thread_error_surfaces_with_context():
    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise FloatingPointError("NaN in update")

    model = _model()
    driver = OptimizerDriver(_roundpipe_store(model), lambda p: Broken(p, lr=0.1))
    driver.begin_step()
    for stage in (1, 2):
        driver.accumulate_grad(stage, torch.ones(driver.store.stages[stage].layout.grad_numel))
        driver.stage_done(stage)
    done = driver.finish_step()
    with pytest.raises(UpstreamFailed, match="NaN in update"):
        done.wait(timeout=10)
    with pytest.raises(OptimizerError, match=r"update 0, group stages \[1\]") as info:
        driver.check()
    assert isinstance(info.value.__cause__, FloatingPointError)
    with pytest.raises(OptimizerError):
        driver.begin_step()
    driver.close()


class _ThreadKilled(BaseException):
    pass


def test_an_exception_escaping_the_optimizer_threads_loop_fails_only_that_update(monkeypatch):
    """The thread protocol's optimizer thread survives an exception raised outside the
    update itself (here: in announcing the finished update, after the masters changed): the
    update is undone and raised once; the thread serves on. (A Trainer never starts this
    thread: its updates are the schedule's OPT actions, tests/test_faults.py.)"""
    from rpcompile.runtime.workers import Event

    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, lambda p: torch.optim.AdamW(p, lr=1e-2), mode="async")
    batches = _batches(3)
    _driver_step(driver, model, [batches[0]])
    driver.wait(timeout=10)
    masters, shadow = store.master.clone(), store.shadow.clone()
    state = copy.deepcopy(driver.optimizer.state_dict())
    thread = driver._thread
    original = Event.set
    fired = []

    def set_(self):
        if threading.current_thread() is thread and self.name.startswith("update") \
                and not fired:
            fired.append(1)
            raise _ThreadKilled  # a BaseException, in the thread's loop (not in the update)
        return original(self)

    with monkeypatch.context() as patch:
        patch.setattr(Event, "set", set_)
        _driver_step(driver, model, [batches[1]])
        with pytest.raises(OptimizerError, match="_ThreadKilled") as info:
            driver.wait(timeout=10)
    assert fired and thread.is_alive()
    assert info.value.step == 1 and info.value.rolled_back
    assert driver.step == 1
    assert torch.equal(store.master, masters) and torch.equal(store.shadow, shadow)
    assert str(driver.optimizer.state_dict()) == str(state)
    _driver_step(driver, model, [batches[1]])  # the thread serves on
    driver.wait(timeout=10)
    assert driver.step == 2 and not torch.equal(store.master, masters)
    driver.close()


def test_discard_step_keeps_masters_unless_an_update_was_not_saved():
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, OPTIMIZERS["adamw_fused"], eager_updates=False)
    before = store.master.clone()
    driver.begin_step()
    driver.accumulate_grad(1, torch.ones(store.stages[1].layout.grad_numel))
    driver.stage_done(1)
    driver.discard_step()  # e.g. a worker failed while stage 2 was running
    assert torch.equal(store.master, before) and store.grad.abs().sum() == 0
    _driver_step(driver, model, _batches(1))
    driver.wait(timeout=10)
    assert not torch.equal(store.master, before)
    driver.close()
    eager = OptimizerDriver(_roundpipe_store(model), OPTIMIZERS["adamw_fused"])
    eager.begin_step()
    eager.accumulate_grad(1, torch.ones(eager.store.stages[1].layout.grad_numel))
    eager.stage_done(1)
    eager.wait(timeout=10)
    assert not torch.equal(eager.store.master, before)  # group 1 was updated eagerly ...
    eager.discard_step()
    assert torch.equal(eager.store.master, before)  # ... and put back from the journal
    eager.close()
    unsaved = OptimizerDriver(_roundpipe_store(model), OPTIMIZERS["adamw_fused"],
                              rollback=False)
    unsaved.begin_step()
    unsaved.accumulate_grad(1, torch.ones(unsaved.store.stages[1].layout.grad_numel))
    unsaved.stage_done(1)
    unsaved.wait(timeout=10)
    with pytest.raises(RuntimeError, match="already been updated"):
        unsaved.discard_step()
    unsaved.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_resumes_bit_identically(mode):
    make = OPTIMIZERS["adamw_fused"]
    batches = _batches(4)
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, make, mode=mode)
    for batch in batches[:2]:
        _driver_step(driver, model, [batch])
    saved = copy.deepcopy(driver.state_dict())
    for batch in batches[2:]:
        _driver_step(driver, model, [batch])
    driver.wait(timeout=10)

    fresh = _model(seed=9)
    fresh_store = _roundpipe_store(fresh)
    resumed = OptimizerDriver(fresh_store, make, mode=mode)
    resumed.load_state_dict(saved)
    assert resumed.step == 2
    for batch in batches[2:]:
        _driver_step(resumed, model, [batch])
    resumed.wait(timeout=10)
    assert torch.equal(fresh_store.master, store.master)
    assert torch.equal(fresh_store.shadow, store.shadow)
    report = resumed.memory_report()
    assert report.optimizer_state_bytes >= 8 * report.trainable_params
    driver.close()
    resumed.close()


def test_frozen_stages_are_no_ops_and_only_adapters_change():
    torch.manual_seed(4)
    base0, base1 = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4).requires_grad_(False)
    adapter = nn.Parameter(torch.zeros(4, 4))
    stages = [[("base0.weight", base0.weight), ("base0.bias", base0.bias)],
              [("base1.weight", base1.weight), ("adapter", adapter)]]
    store = HostStore.build(stages, compute_dtype=torch.bfloat16)
    driver = OptimizerDriver(store, lambda p: torch.optim.SGD(p, lr=0.5))
    frozen_before = store.shadow.clone()
    driver.begin_step()
    driver.accumulate_grad(0, torch.zeros(0))  # the frozen stage's job sends nothing home
    driver.stage_done(0)
    driver.accumulate_grad(1, torch.ones(16))
    driver.stage_done(1)
    driver.finish_step().wait(timeout=10)
    assert torch.equal(store.master_of("adapter"), torch.full((4, 4), -0.5))
    assert torch.equal(store.shadow_of("adapter"), torch.full((4, 4), -0.5, dtype=torch.bfloat16))
    assert torch.equal(store.shadow[:36], frozen_before[:36])  # base0 then base1: untouched
    assert torch.equal(store.shadow_of("base1.weight"), base1.weight.bfloat16())
    driver.close()


def test_an_async_update_without_pending_gradients_is_refused_not_run_as_sync():
    """``update()`` of an async driver applies the previous step's gradients, kept pending by
    ``use_pending()``; without it the update would silently apply the step's own gradients
    (sync semantics), so it is refused, naming the fix. The schedule's path (use_pending,
    as the executor calls it) still updates."""
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, OPTIMIZERS["sgd_nesterov"], mode="async")
    driver.begin_step()
    masters = store.master.clone()
    with pytest.raises(RuntimeError, match=r"needs driver.use_pending\(\)"):
        driver.update(1)
    assert torch.equal(store.master, masters)
    driver.discard_step()
    driver.use_pending()
    driver.begin_step()
    assert driver.update(1) is False  # nothing pending yet: the first step's OPT is idle
    driver.discard_step()
    driver.close()

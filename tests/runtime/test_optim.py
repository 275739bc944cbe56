"""Optimizer driver, driven by the schedule's host actions as the executor drives it: sync
stage-by-stage equals one plain step, async is exactly one step stale, a failed step is
discarded without a trace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from rpcompile.runtime.errors import OptimizerError
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


def _flat(store: HostStore, stage: int, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """A job's gradient of ``stage`` in the layout its D2H brings home."""
    flat = torch.zeros(store.stages[stage].layout.grad_numel)
    for name, view in store.stages[stage].grad_views(flat).items():
        view.copy_(grads[name])
    return flat


# The host queue of a lowered schedule over _roundpipe_store, per mode (what
# rpcompile.passes.lower emits for it: tail first; async, the step's OPTs first and applying
# the previous step's gradients, then the SHADOWs, then the ACCs).
_SYNC_QUEUE = [("ACC", 1), ("OPT", 1), ("SHADOW", 1), ("ACC", 2), ("OPT", 2), ("SHADOW", 0),
               ("SHADOW", 2)]
_ASYNC_QUEUE = [("OPT", 1), ("OPT", 2), ("SHADOW", 1), ("SHADOW", 0), ("SHADOW", 2),
                ("ACC", 1), ("ACC", 2)]


def _driver_step(driver: OptimizerDriver, model: nn.Module, microbatches, fail_at=None,
                 on_begin=None) -> None:
    """One step the way the executor runs a lowered schedule's host queue: the jobs compute
    on the shadow, each ACC adds one round's gradient of its stage, each OPT updates, each
    SHADOW refreshes, and the step commits (or, when ``fail_at`` names an action, or "end"
    for after the last one, fails there and is discarded, as the executor does with any
    failure). ``on_begin`` runs once the step is open."""
    store = driver.store
    if driver.mode == "async" and not driver.shifted:
        driver.use_pending()
    driver.begin_step()
    if on_begin is not None:
        on_begin()
    weights = store.stages[0].shadow_views()
    per_round = [_grads(model, weights, mb, 1.0 / len(microbatches)) for mb in microbatches]
    try:
        for kind, stage in _ASYNC_QUEUE if driver.shifted else _SYNC_QUEUE:
            if (kind, stage) == fail_at:
                raise RuntimeError(f"{kind} s{stage} failed")
            if kind == "ACC":
                for grads in per_round:
                    driver.accumulate_grad(stage, _flat(store, stage, grads))
            elif kind == "OPT":
                driver.update(stage)
            else:
                driver.refresh(stage)
        if fail_at == "end":
            raise RuntimeError("the step failed after its last host action")
    except BaseException:
        driver.discard_step()
        raise
    driver.commit_step()


def _finish(driver: OptimizerDriver) -> None:
    """The Trainer's end of a run: the last async step's gradients into the masters."""
    driver.flush()


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
    assert driver.step == 4
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


def test_sync_updates_a_stage_at_its_own_opt():
    """Each OPT updates the groups whose gradient stages are then all done, at once: the
    tail's while stage 2's gradients are still missing; its shadow changes only at the
    stage's SHADOW. A step cannot commit without an OPT of every gradient stage, and a
    gradient that comes after its stage's OPT is refused (the update has consumed them)."""
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, OPTIMIZERS["sgd_nesterov"], mode="sync")
    tail, head = store.master_of("6.weight").clone(), store.master_of("0.weight").clone()
    driver.begin_step()
    grads = _grads(model, store.stages[0].shadow_views(), _batches(1)[0])
    driver.accumulate_grad(1, _flat(store, 1, grads))
    assert torch.equal(store.master_of("6.weight"), tail)  # an ACC updates nothing
    assert driver.update(1)
    assert not torch.equal(store.master_of("6.weight"), tail)
    assert torch.equal(store.master_of("0.weight"), head)  # stage 2's group waits for its OPT
    assert torch.equal(store.shadow_of("6.weight"), tail)  # ... and the shadow for its SHADOW
    driver.refresh(1)
    assert torch.equal(store.shadow_of("6.weight"), store.master_of("6.weight"))
    with pytest.raises(RuntimeError, match=r"ran no OPT of gradient stages \[2\]"):
        driver.commit_step()
    with pytest.raises(RuntimeError, match="arrived after its OPT"):
        driver.accumulate_grad(1, _flat(store, 1, grads))
    with pytest.raises(ValueError, match="not a gradient stage"):
        driver.accumulate_grad(0, torch.zeros(store.stages[0].layout.grad_numel))
    driver.accumulate_grad(2, _flat(store, 2, grads))
    driver.update(2)
    assert not torch.equal(store.master_of("0.weight"), head)
    driver.refresh(2)
    driver.commit_step()
    assert driver.step == 1 and torch.equal(store.shadow_of("0.weight"),
                                            store.master_of("0.weight"))


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
    # An LR scheduler steps between steps: update k must use lrs[k] even though it runs in
    # step k+1's OPTs (or the last flush), when the scheduler has moved on.
    scheduler = torch.optim.lr_scheduler.LambdaLR(driver.optimizer, lambda k: lrs[k] / lrs[0])
    for k, batch in enumerate(batches):
        _driver_step(driver, model, [batch])
        assert driver.pending_step == k  # its gradients wait for the next step's OPTs
        if driver.step < len(lrs):
            scheduler.step()
    assert driver.optimizer.param_groups[0]["lr"] == lrs[-1]
    _finish(driver)
    assert driver.pending_step is None
    for n, p in reference.named_parameters():
        assert torch.equal(store.master_of(n), p), n
        assert torch.equal(store.shadow_of(n), stale[n]), n  # the next step would use w_k

    # The same run in sync mode ends elsewhere: the staleness is real.
    sync_store = _roundpipe_store(_model())
    sync = OptimizerDriver(sync_store, lambda p: torch.optim.AdamW(p, lr=lrs[0], fused=True))
    for k, batch in enumerate(batches):
        sync.optimizer.param_groups[0]["lr"] = lrs[k]
        _driver_step(sync, model, [batch])
    assert not torch.equal(sync_store.master, store.master)


def test_an_update_uses_the_hyperparameters_of_its_own_step():
    """Sync: hyperparameters changed while a step is open (after begin_step, before its
    OPTs) take effect from the next step on, as they would for an optimizer step at the
    step's end; the snapshot is what update k reads."""
    batches = _batches(2)
    runs = []
    for change_midstep in (False, True):
        model = _model()
        store = _roundpipe_store(model)
        driver = OptimizerDriver(store, OPTIMIZERS["adamw_fused"])
        groups = driver.optimizer.param_groups
        for k, batch in enumerate(batches):
            groups[0]["lr"] = 1e-2 * (k + 1)  # step k's
            # Changed once step k is open: the next step's, not k's.
            change = ((lambda k=k, groups=groups: groups[0].update(lr=1e-2 * (k + 2)))
                      if change_midstep else None)
            _driver_step(driver, model, [batch], on_begin=change)
        runs.append(store.master.clone())
    assert torch.equal(runs[0], runs[1])


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
        # Each stage differentiates its own use of the tied weight.
        leaves = {(s, n): store.shadow_of(n).clone().requires_grad_(True)
                  for s, st in enumerate(stages) for n, _ in st}
        weights = {n: leaves[(s, n)] for (s, n) in leaves}
        loss = functional_call(model, weights, (ids,), tie_weights=False)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        for s in (1, 0):  # the tail's job finishes first
            tied = store.master_of("emb.weight").clone()
            driver.accumulate_grad(s, _flat(store, s, {n: grads[(s, n)] for n, _ in stages[s]}))
            driver.update(s)
            # The tied weight waits for its second use's OPT, then moves once.
            assert torch.equal(store.master_of("emb.weight"), tied) == (s == 1)
        driver.refresh(1)
        driver.refresh(0)
        driver.commit_step()
    for n, param in reference.named_parameters():
        assert torch.equal(store.master_of(n), param), n


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
    before = driver.store.master.clone()
    stepped = []
    driver.optimizer.register_step_post_hook(lambda *a: stepped.append(driver.store.master.clone()))
    _driver_step(driver, model, [batch])
    assert len(stepped) == 1  # one step over everything, at the last OPT
    assert not torch.equal(stepped[0], before)
    for n, p in reference.named_parameters():
        assert torch.equal(driver.store.master_of(n), p), n
    with pytest.raises(ValueError, match="not the store's masters"):
        OptimizerDriver(_roundpipe_store(model), torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_update_failure_raises_at_its_opt_once_and_the_discard_undoes_it():
    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise FloatingPointError("NaN in update")

    model = _model()
    driver = OptimizerDriver(_roundpipe_store(model), lambda p: Broken(p, lr=0.1))
    masters = driver.store.master.clone()
    driver.begin_step()
    for stage in (1, 2):
        driver.accumulate_grad(stage, torch.ones(driver.store.stages[stage].layout.grad_numel))
    with pytest.raises(OptimizerError, match=r"update 0, group stages \[1\]") as info:
        driver.update(1)
    assert isinstance(info.value.__cause__, FloatingPointError)
    assert info.value.step == 0 and info.value.rolled_back
    driver.discard_step()
    assert torch.equal(driver.store.master, masters) and driver.store.grad.abs().sum() == 0
    assert driver.step == 0
    assert driver.begin_step() == 0  # raised once, where it happened: the next step opens
    driver.discard_step()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fail", ["second update", "after the refreshes"])
def test_a_failed_step_is_discarded_without_a_trace(mode, fail):
    """A step that fails part-way (the user's step() at its second group, after the first
    group was applied; or a later action, after every update and shadow refresh of the step
    ran) is discarded: masters, optimizer state, shadows, step counter and (async) the pending
    gradients are as before it, and the run then continues bit-identically to one in which
    the step never failed."""
    batches = _batches(4)

    def run(failing):
        model = _model()
        store = _roundpipe_store(model)
        driver = OptimizerDriver(store, OPTIMIZERS["adamw_fused"], mode=mode)
        _driver_step(driver, model, [batches[0]])
        _driver_step(driver, model, [batches[1]])
        if failing:
            before = (store.master.clone(), store.shadow.clone(),
                      copy.deepcopy(driver.optimizer.state_dict()), driver.step,
                      driver.pending_step)
            calls = []
            original = type(driver.optimizer).step

            def broken(self, *args, **kwargs):
                calls.append(1)
                out = original(self, *args, **kwargs)  # the group is updated, then it raises
                if fail == "second update" and len(calls) == 2:
                    raise FloatingPointError("injected")
                return out

            type(driver.optimizer).step = broken
            try:
                with pytest.raises((OptimizerError, RuntimeError)) as info:
                    _driver_step(driver, model, [batches[2]],
                                 fail_at="end" if fail == "after the refreshes" else None)
            finally:
                type(driver.optimizer).step = original
            if fail == "second update":
                assert isinstance(info.value, OptimizerError) and info.value.rolled_back
                assert isinstance(info.value.__cause__, FloatingPointError)
            assert len(calls) == 2  # both groups were updated (the second one, then it raised)
            after = (store.master, store.shadow, driver.optimizer.state_dict(), driver.step,
                     driver.pending_step)
            assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
            assert str(after[2]) == str(before[2]) and after[3:] == before[3:]
            assert store.grad.abs().sum() == 0
        for batch in batches[2:]:
            _driver_step(driver, model, [batch])
        _finish(driver)
        return store.master.clone(), store.shadow.clone()

    clean, failed = run(False), run(True)
    assert torch.equal(clean[0], failed[0]) and torch.equal(clean[1], failed[1])


def test_discard_step_keeps_masters_unless_an_update_was_not_saved():
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, OPTIMIZERS["adamw_fused"])
    before = store.master.clone()
    driver.begin_step()
    driver.accumulate_grad(1, torch.ones(store.stages[1].layout.grad_numel))
    driver.update(1)
    assert not torch.equal(store.master, before)  # group 1 was updated at its OPT ...
    driver.refresh(1)
    driver.discard_step()  # e.g. a worker failed while stage 2 was running
    assert torch.equal(store.master, before)  # ... and put back from the journal
    assert store.grad.abs().sum() == 0 and driver.step == 0
    _driver_step(driver, model, _batches(1))
    assert not torch.equal(store.master, before)
    unsaved = OptimizerDriver(_roundpipe_store(model), OPTIMIZERS["adamw_fused"],
                              rollback=False)
    unsaved.begin_step()
    unsaved.accumulate_grad(1, torch.ones(unsaved.store.stages[1].layout.grad_numel))
    unsaved.update(1)
    assert unsaved._open.journal is None  # rollback=False: nothing saved
    with pytest.raises(RuntimeError, match="already been updated without a journal"):
        unsaved.discard_step()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_resumes_bit_identically(mode):
    make = OPTIMIZERS["adamw_fused"]
    batches = _batches(4)
    model = _model()
    store = _roundpipe_store(model)
    driver = OptimizerDriver(store, make, mode=mode)
    for batch in batches[:2]:
        _driver_step(driver, model, [batch])
    if mode == "async":
        with pytest.raises(RuntimeError, match="flush"):
            driver.state_dict()
        _finish(driver)  # as Trainer.state_dict does: it changes no trajectory
    saved = copy.deepcopy(driver.state_dict())
    for batch in batches[2:]:
        _driver_step(driver, model, [batch])
    _finish(driver)

    fresh = _model(seed=9)
    fresh_store = _roundpipe_store(fresh)
    resumed = OptimizerDriver(fresh_store, make, mode=mode)
    resumed.load_state_dict(saved)
    assert resumed.step == 2
    for batch in batches[2:]:
        _driver_step(resumed, model, [batch])
    _finish(resumed)
    assert torch.equal(fresh_store.master, store.master)
    assert torch.equal(fresh_store.shadow, store.shadow)
    report = resumed.memory_report()
    assert report.optimizer_state_bytes >= 8 * report.trainable_params


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
    assert driver.update(0) is False  # ... and its OPT has nothing to update
    driver.accumulate_grad(1, torch.ones(16))
    driver.update(1)
    driver.refresh(1)
    driver.commit_step()
    assert torch.equal(store.master_of("adapter"), torch.full((4, 4), -0.5))
    assert torch.equal(store.shadow_of("adapter"), torch.full((4, 4), -0.5, dtype=torch.bfloat16))
    assert torch.equal(store.shadow[:36], frozen_before[:36])  # base0 then base1: untouched
    assert torch.equal(store.shadow_of("base1.weight"), base1.weight.bfloat16())


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

"""Host memory: flat buffers, per-stage segments, tied and frozen parameters, memory report."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from rpcompile.runtime.memory import HostStore


class TiedLM(nn.Module):
    """Embedding -> two linears -> logits through the (tied) embedding matrix."""

    def __init__(self, vocab: int = 50, hidden: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.l0 = nn.Linear(hidden, hidden)
        self.l1 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(self.emb(ids)))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _stages(model: TiedLM) -> list[list[tuple[str, torch.Tensor]]]:
    p = dict(model.named_parameters(remove_duplicate=False))
    return [
        [(n, p[n]) for n in ("emb.weight", "l0.weight", "l0.bias")],
        [(n, p[n]) for n in ("l1.weight", "l1.bias", "head.weight")],
    ]


def _stage_grads(model: TiedLM, store: HostStore, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's flat gradient, computed with a separate leaf for every use of a tied weight
    (what two stages running on different workers would each produce)."""
    leaves = {}
    for stage in store.stages:
        for name in stage.layout.names:
            leaves[(stage.layout.stage, name)] = (
                model.get_parameter(name).detach().clone().requires_grad_(True)
            )
    weights = {name: leaves[(s, name)] for (s, name) in leaves}
    loss = functional_call(model, weights, (ids,), tie_weights=False)
    grads = torch.autograd.grad(loss, list(weights.values()))
    by_name = dict(zip(weights, grads))
    flats = []
    for stage in store.stages:
        flat = torch.zeros(stage.layout.grad_numel)
        for name, view in stage.grad_views(flat).items():
            view.copy_(by_name[name])
        flats.append(flat)
    return flats


def test_tied_parameter_is_stored_once_and_its_gradients_sum():
    torch.manual_seed(0)
    model = TiedLM()
    store = HostStore.build(_stages(model))
    unique = {id(p): p.numel() for p in model.parameters()}
    assert len(store.slots) == len(unique) == 5
    assert store.master.numel() == sum(unique.values()) == store.grad.numel()
    assert store.slot("head.weight") is store.slot("emb.weight")
    assert store.slot("emb.weight").stages == (0, 1)
    # Stage 1 uploads its own contiguous range plus the embedding owned by stage 0.
    assert len(store.stages[0].layout.shadow_segments) == 1
    assert len(store.stages[1].layout.shadow_segments) == 2
    ids = torch.randint(0, 50, (3, 7))
    for stage, flat in enumerate(_stage_grads(model, store, ids)):
        store.accumulate_grad(stage, flat)
    model(ids).backward()
    for name, p in model.named_parameters():
        assert torch.equal(store.grad_of(name), p.grad), name


def test_stage_views_match_parameters_and_upload_as_one_copy_per_segment():
    torch.manual_seed(1)
    model = TiedLM(tied=False)
    store = HostStore.build(_stages(model))
    for stage in store.stages:
        assert len(stage.layout.shadow_segments) == 1
        device = stage.shadow[0].clone()  # "upload": one copy of the stage's flat shadow
        for name, view in stage.device_views(device).items():
            assert torch.equal(view, model.get_parameter(name)), name
    upload = store.memory_report().upload_bytes
    assert upload == tuple(
        4 * sum(t.numel() for _, t in params) for params in _stages(model)
    )


def test_overlapping_forward_and_backward_stages():
    torch.manual_seed(2)
    model = TiedLM(tied=False)
    p = dict(model.named_parameters())
    names = list(p)
    forward = [(n, p[n]) for n in names]  # one forward stage over everything
    tail = [(n, p[n]) for n in ("l1.weight", "l1.bias", "head.weight")]
    back = [(n, p[n]) for n in ("emb.weight", "l0.weight", "l0.bias")]
    store = HostStore.build([forward, tail, back], grad_stages=[1, 2])
    assert store.master.numel() == sum(t.numel() for t in model.parameters())
    assert store.stages[0].layout.grad_numel == store.master.numel()  # layout exists, unused
    assert store.slot("l1.weight").grad_stages == (1,)
    assert store.slot("emb.weight").grad_stages == (2,)
    for stage in store.stages:
        assert len(stage.layout.shadow_segments) == 1
    ids = torch.randint(0, 50, (2, 5))
    model(ids).backward()
    for stage in (1, 2):
        flat = torch.zeros(store.stages[stage].layout.grad_numel)
        for name, view in store.stages[stage].grad_views(flat).items():
            view.copy_(p[name].grad)
        store.accumulate_grad(stage, flat)
    for name in names:
        assert torch.equal(store.grad_of(name), p[name].grad)
    with pytest.raises(ValueError, match="none of which produces gradients"):
        HostStore.build([forward, tail], grad_stages=[1])


def test_frozen_parameters_get_shadow_only():
    torch.manual_seed(3)
    base = nn.Linear(8, 8)
    base.requires_grad_(False)
    lora_a = nn.Parameter(torch.randn(2, 8))
    lora_b = nn.Parameter(torch.randn(8, 2))
    stages = [[("base.weight", base.weight), ("lora_A", lora_a), ("base.bias", base.bias),
               ("lora_B", lora_b)]]
    store = HostStore.build(stages, compute_dtype=torch.bfloat16)
    assert store.master.numel() == 32 and store.grad.numel() == 32
    assert store.shadow.numel() == 64 + 8 + 32
    assert store.shadow_of("base.weight").dtype == torch.bfloat16
    assert torch.equal(store.shadow_of("base.weight"), base.weight.to(torch.bfloat16))
    with pytest.raises(KeyError, match="frozen"):
        store.master_of("base.weight")
    before = store.shadow_of("base.weight").clone()
    with torch.no_grad():
        store.master.add_(1.0)
    store.refresh_shadow(0)
    assert torch.equal(store.shadow_of("base.weight"), before)
    assert torch.equal(store.shadow_of("lora_A"), (lora_a + 1).to(torch.bfloat16))
    assert torch.equal(store.shadow_of("lora_B"), (lora_b + 1).to(torch.bfloat16))
    # Frozen parameters have no master, so the adapters' masters adjoin: one gradient segment.
    assert len(store.stages[0].layout.grad_segments) == 1
    assert len(store.stages[0].layout.shadow_segments) == 1
    report = store.memory_report()
    assert (report.trainable_params, report.frozen_params) == (32, 72)
    assert report.shadow_frozen_bytes == 72 * 2


@pytest.mark.parametrize(
    ("dtype", "shadow_bytes"), [(torch.bfloat16, 2), (torch.float32, 4)]
)
def test_memory_report_within_five_percent_of_what_is_kept(dtype, shadow_bytes):
    torch.manual_seed(4)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # ~0.5M parameters
    params = list(model.named_parameters())
    stages = [params[i : i + 4] for i in range(0, len(params), 4)]
    store = HostStore.build(stages, compute_dtype=dtype)
    masters = store.masters()
    opt = torch.optim.AdamW(masters, lr=1e-3, fused=True)
    store.grad.normal_()
    opt.step()
    report = store.memory_report(opt)
    n = sum(p.numel() for p in model.parameters())
    assert report.trainable_params == n
    # Independent count: 4 master + shadow + 4 grad + AdamW's exp_avg and exp_avg_sq (fp32).
    expected = 4 + shadow_bytes + 4 + 8
    assert abs(report.bytes_per_trainable_param - expected) / expected < 0.05
    # Exact sizes: nothing rounded up.
    assert store.master.untyped_storage().nbytes() == 4 * n
    assert store.grad.untyped_storage().nbytes() == 4 * n
    assert store.shadow.untyped_storage().nbytes() == shadow_bytes * n
    assert report.breakdown()["master"] == 4.0
    assert "bytes per trainable parameter" in str(report)


def test_masters_share_memory_and_optimizer_updates_the_flat_buffer():
    torch.manual_seed(5)
    model = TiedLM()
    store = HostStore.build(_stages(model))
    masters = store.masters()
    assert store.masters() is masters and len(masters) == 5
    for (name, p), slot in zip(store.named_masters(), store.trainable_slots):
        assert name == slot.name
        assert p.data_ptr() == store.master_of(name).data_ptr()
        assert p.grad.data_ptr() == store.grad_of(name).data_ptr()
    store.grad.fill_(1.0)
    torch.optim.SGD(masters, lr=0.5).step()
    assert torch.equal(store.master_of("l0.bias"), model.l0.bias.detach() - 0.5)
    store.zero_grads([store.slot("l0.bias").index])
    assert store.grad_of("l0.bias").abs().sum() == 0 and store.grad_of("l0.weight").min() == 1
    store.zero_grads()
    assert store.grad.abs().sum() == 0
    store.attach_grads([store.slot("l1.bias").index])
    assert [p.grad is not None for p in masters] == [
        s.name == "l1.bias" for s in store.trainable_slots
    ]


def test_refresh_rounds_like_torch_and_load_into_module():
    torch.manual_seed(6)
    model = TiedLM()
    store = HostStore.build(_stages(model), compute_dtype=torch.bfloat16)
    with torch.no_grad():
        store.master.mul_(1.0001).add_(1e-3)
    store.refresh_shadow(1)  # stage 1 holds the tied weight: its shadow is refreshed too
    assert torch.equal(store.shadow_of("head.weight"), store.master_of("emb.weight").bfloat16())
    assert torch.equal(store.shadow_of("l1.weight"), store.master_of("l1.weight").bfloat16())
    assert not torch.equal(store.shadow_of("l0.weight"), store.master_of("l0.weight").bfloat16())
    store.refresh_shadow()
    assert torch.equal(store.shadow_of("l0.weight"), store.master_of("l0.weight").bfloat16())
    target = copy.deepcopy(model)
    store.load_into_module(target)
    for name, p in target.named_parameters():
        assert torch.equal(p, store.master_of(name))
    assert target.head.weight is target.emb.weight
    state = store.state_dict()
    with torch.no_grad():
        store.master.zero_()
    store.load_state_dict(state)
    assert torch.equal(store.master_of("l1.bias"), target.l1.bias)
    assert torch.equal(store.shadow_of("l1.bias"), target.l1.bias.bfloat16())


def test_build_errors_say_what_is_wrong():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="two different tensors"):
        HostStore.build([[("x", a)], [("x", b)]])
    with pytest.raises(ValueError, match="meta"):
        HostStore.build([[("m", nn.Parameter(torch.empty(2, device="meta")))]])
    store = HostStore.build([[("x", a)]])
    with pytest.raises(ValueError, match="elements"):
        store.accumulate_grad(0, torch.zeros(3))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin=True needs CUDA"):
            HostStore.build([[("x", a)]], pin=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_buffers_are_registered_at_exact_size():
    model = TiedLM()
    store = HostStore.build(_stages(model), compute_dtype=torch.bfloat16, pin=True)
    assert store.pin == "registered"
    assert store.shadow.is_pinned() and store.master.is_pinned() and store.grad.is_pinned()
    n = store.master.numel()
    assert store.master.untyped_storage().nbytes() == 4 * n
    assert store.shadow.untyped_storage().nbytes() == 2 * n


# --------------------------------------------------------------------------------------------
# Registration with the CUDA driver, and its fallback (simulated here; on a GPU below)
# --------------------------------------------------------------------------------------------


class _FakeRuntime:
    """The CUDA runtime as torch binds it: a failed cudaHostRegister returns its error and also
    leaves it as the calling thread's last error, which the next kernel launch raises."""

    def __init__(self) -> None:
        import threading

        self.local = threading.local()

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.local.error = 712  # cudaErrorHostMemoryAlreadyRegistered
        return 712

    def cudaHostUnregister(self, pointer):
        return 0

    def launch(self) -> None:
        error, self.local.error = getattr(self.local, "error", 0), 0
        if error:
            raise RuntimeError(f"CUDA error {error} (a stale error from an earlier call)")


class _FakeDriver:
    def __init__(self, failure: str | None) -> None:
        self.failure = failure
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, pointer, nbytes):
        if self.failure is None:
            self.registered.append(pointer)
        return self.failure

    def unregister(self, pointer):
        self.unregistered.append(pointer)


def _simulated_cuda(monkeypatch, driver):
    """CUDA as far as the host memory code sees it, with no GPU: the caching allocator's
    buffers are plain ones, recorded."""
    import rpcompile.runtime.memory.pinned as memory

    runtime, cached = _FakeRuntime(), []

    def caching_pinned(numel, dtype):
        cached.append(numel)
        return torch.empty(numel, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(memory, "_driver", driver if callable(driver) else lambda: driver,
                        raising=False)
    monkeypatch.setattr(memory, "_caching_pinned", caching_pinned, raising=False)
    return runtime, cached


def test_a_failed_registration_falls_back_and_leaves_no_cuda_error_behind(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from rpcompile.runtime.memory import HostStaging

    driver = _FakeDriver("cuMemHostRegister_v2 returned CUDA_ERROR_NOT_SUPPORTED (801)")
    runtime, cached = _simulated_cuda(monkeypatch, driver)

    def download_thread():
        # A worker's download stream takes a staging buffer, then launches on the device.
        with pytest.warns(RuntimeWarning) as warned:
            buf = HostStaging(pin=True).take(1000)
        runtime.launch()  # raises if the failed registration left an error on this thread
        return buf, str(warned[0].message)

    with ThreadPoolExecutor(1) as pool:
        buf, message = pool.submit(download_thread).result()
    assert buf.numel() == 1000
    assert "CUDA_ERROR_NOT_SUPPORTED" in message and "caching pinned allocator" in message
    assert cached == [1000] and driver.registered == []
    with pytest.warns(RuntimeWarning, match="caching pinned allocator"):
        store = HostStore.build(_stages(TiedLM()), pin=True)
    assert store.pin == "caching allocator (may round up)"
    runtime.launch()


def test_an_unloadable_driver_library_falls_back_with_the_reason(monkeypatch):
    def no_library():
        raise OSError("libcuda.so.1: cannot open shared object file")

    runtime, cached = _simulated_cuda(monkeypatch, no_library)
    from rpcompile.runtime.memory import HostStaging

    with pytest.warns(RuntimeWarning, match="driver library could not be loaded.*libcuda"):
        HostStaging(pin=True).take(64)
    assert cached == [64]
    runtime.launch()


def test_registered_buffers_are_unregistered_when_freed(monkeypatch):
    import gc

    from rpcompile.runtime.memory import HostStaging

    driver = _FakeDriver(None)
    _, cached = _simulated_cuda(monkeypatch, driver)
    staging = HostStaging(pin=True)
    buf = staging.take(4096)
    address = buf.data_ptr()
    assert driver.registered == [address] and cached == []
    staging.give(buf)
    del buf
    staging.release()
    gc.collect()
    assert driver.unregistered == [address]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_driver_registration_on_a_gpu_fails_cleanly_on_any_thread():
    from concurrent.futures import ThreadPoolExecutor

    from rpcompile.runtime.memory import pinned as memory

    def fresh_thread():
        # A new thread has no current CUDA context: the driver calls bring their own.
        flat, kind = memory._host_flat(1 << 20, torch.float32, pin=True)
        assert kind == "registered" and flat.is_pinned()
        again = memory._register(flat.data_ptr(), flat.nbytes)  # registered twice: refused
        assert again is not None and "ALREADY_REGISTERED" in again, again
        # No error was left behind: a launch on this thread runs.
        device = torch.ones(1 << 20, device="cuda")
        device.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        return float(device.sum())

    with ThreadPoolExecutor(1) as pool:
        pool.submit(fresh_thread).result()

"""The runtime's transfer-path kernels: each job's gradients go into its flat fp32 buffer in
one ``accumulate_grads`` launch per microbatch, the host's shadow refresh is one ``cast_pack``,
and the Triton backend (here in Triton's interpreter, on virtual workers) trains to exactly the
masters of the torch backend and of the reference executor. The fused non-finite check of the
accumulation is surfaced in the step's result."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import rpcompile
from rpcompile.runtime.kernels import transfer as kernels_module
from rpcompile.runtime.trainer import Trainer
from rpcompile.runtime.workers import VirtualWorker
from tests.runtime.test_executor import reference_training
from tests.tiny_models import hf_model, token_batch


def ADAMW(params):
    return torch.optim.AdamW(params, lr=1e-2)


@pytest.fixture(scope="module")
def tiny():
    model = hf_model("qwen3", layers=1)
    return rpcompile.compile(model, gpus=2, microbatches=2, example_inputs=token_batch(4, seq=8))


def batches(n: int) -> list[torch.Tensor]:
    return [token_batch(4, seq=8, seed=30 + k) for k in range(n)]


def train(compiled, kernels: str, data, chaos=None):
    with Trainer(compiled,
                 train=replace(compiled.options.train, optimizer=ADAMW, device="virtual",
                               kernels=kernels, chaos=chaos)) as trainer:
        losses = [trainer.step(b) for b in data]
        results = trainer.last
        masters = {n: t.clone() for n, t in trainer.masters().items()}
    return losses, masters, results


def test_triton_kernels_train_bit_identically_to_torch_and_reference(tiny, monkeypatch):
    launches = {"accumulate": 0, "cast": 0}
    real_launch = kernels_module._launch

    def spy(kind, *args, **kwargs):
        launches[kind] += 1
        return real_launch(kind, *args, **kwargs)

    monkeypatch.setattr(kernels_module, "_launch", spy)
    data = batches(3)
    losses_t, masters_t, last = train(tiny, "triton", data, chaos=3)
    # One accumulation launch per microbatch of every job with trainable parameters.
    jobs = sum(1 for p in tiny.stages if p.kind != "forward" and p.params)
    assert launches["accumulate"] == len(data) * jobs * tiny.microbatches * tiny.rounds
    assert launches["cast"] >= len(data)  # the shadow refresh ran as cast_pack kernels
    assert not last.found_nonfinite

    seen = dict(launches)
    losses_r, masters_r, _ = train(tiny, "torch", data)
    assert launches == seen  # the torch backend launches no Triton kernel
    ref_losses, ref_params = reference_training(tiny, data, ADAMW)
    for got, torch_loss, want in zip(losses_t, losses_r, ref_losses):
        assert torch.equal(got, torch_loss) and torch.equal(got, want)
    assert set(masters_t) == set(masters_r) == set(ref_params)
    for name, want in ref_params.items():
        assert torch.equal(masters_t[name], masters_r[name]), name
        assert torch.equal(masters_t[name], want), name


class _CudaKindWorker(VirtualWorker):
    """A virtual worker that reports the CUDA kind: the host side of a CUDA run as the Trainer
    sets it up, without a GPU (with pageable host memory nothing asks for pinning)."""

    kind = "cuda"


def test_host_side_of_a_cuda_run_never_runs_the_interpreter(tiny, monkeypatch):
    # kernels="triton" means the compiled kernels on the GPU; the host's shadow refresh works
    # on CPU tensors, where Triton could only run its interpreter (~1 ms per program).
    from rpcompile.runtime.memory import store as memory
    from rpcompile.runtime.trainer import core as trainer_module

    backends = []
    real_cast_pack = memory.cast_pack

    def spy(*args, backend, **kwargs):
        backends.append(backend)
        return real_cast_pack(*args, backend=backend, **kwargs)

    monkeypatch.setattr(memory, "cast_pack", spy)
    monkeypatch.setattr(trainer_module, "make_workers",
                        lambda n, *args, **kwargs: [_CudaKindWorker(i) for i in range(n)])
    with Trainer(tiny,
                 train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                               kernels="triton"),
                 plan=replace(tiny.options.plan, host_memory="pageable")) as trainer:
        assert trainer.workers[0].kind == "cuda"
        trainer.step(batches(1)[0])
    assert backends and set(backends) == {"torch"}


def test_host_backend_rule():
    host_backend = kernels_module.host_backend
    for kernels in ("auto", "torch", "triton"):
        assert host_backend(kernels, "cuda") == "torch"
        assert host_backend(kernels, "virtual") == kernels  # "triton": the interpreter
    with pytest.raises(ValueError, match="kernels must be one of"):
        host_backend("cuda", "cuda")
    with pytest.raises(ValueError, match="unknown worker kind"):
        host_backend("auto", "tpu")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_nonfinite_gradients_are_reported(tiny, kernels):
    with Trainer(tiny, train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                                     kernels=kernels)) as trainer:
        trainer.step(batches(1)[0])
        assert trainer.last.found_nonfinite is False and trainer.last.nonfinite_jobs == ()
        # An inf weight in the last norm makes every gradient behind it non-finite.
        name = next(n for n in trainer.masters() if n.endswith("model.norm.weight"))
        trainer.store.master_of(name).fill_(math.inf)
        trainer.store.refresh_shadow()
        trainer.step(batches(1)[0])
        assert trainer.last.found_nonfinite is True
        graded = {p.name for p in tiny.stages if p.kind != "forward" and p.params}
        assert {stage for stage, _ in trainer.last.nonfinite_jobs} == graded


def test_unknown_kernel_backend_is_refused(tiny):
    with pytest.raises(ValueError, match="kernels must be one of"):
        Trainer(tiny, train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                                    kernels="cuda"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nonfinite_step_is_skipped_when_asked(tiny, mode):
    data = batches(3)
    with Trainer(tiny, train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                                     skip_nonfinite=True), plan=replace(tiny.options.plan,
                                                                        mode=mode)) as trainer:
        trainer.step(data[0])
        before = {n: t.clone() for n, t in trainer.masters().items()}
        name = next(n for n in before if n.endswith("model.norm.weight"))
        # An inf in the shadow only: the step computes with it, the master stays finite.
        trainer.store.shadow_of(name).fill_(math.inf)
        trainer.step(data[1])
        assert trainer.last.found_nonfinite and trainer.last.skipped
        assert trainer.steps_done == 1
        after = trainer.masters()
        if mode == "sync":
            # Nothing of the skipped step was applied.
            assert all(torch.equal(after[n], before[n]) for n in before)
        trainer.store.refresh_shadow()
        trainer.step(data[2])
        assert not trainer.last.skipped and trainer.steps_done == 2
        assert all(torch.isfinite(t).all() for t in trainer.masters().values())


def test_gpu_check_script_runs_on_virtual_workers(tmp_path, capsys, monkeypatch):
    import importlib.util
    import json
    from pathlib import Path

    import rpcompile.cli

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    # The fine-tuning section's `rpcompile train` runs 8 steps with an eval every 4 instead of
    # 40 and 20: on virtual workers its eval loss falls as well (5.6 -> 3.0), at 12 instead of
    # 28 CPU seconds.
    train = rpcompile.cli.main

    def shortened(argv):
        argv = list(argv)
        for flag, value in (("--steps", "8"), ("--eval-every", "4")):
            argv[argv.index(flag) + 1] = value
        return train(argv)

    monkeypatch.setattr(rpcompile.cli, "main", shortened)
    if not torch.cuda.is_available():
        assert gpu_check.main(["--json", str(tmp_path / "none.json")]) == 0
        assert "nothing was checked" in capsys.readouterr().out
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--virtual", "--workers", "3", "--archs", "qwen3_moe",
                           "--skip-bench", "--json", str(out)])
    results = json.loads(out.read_text())
    rows = results["exact"]
    assert code == 0 and rows[0]["bit_identical"] and rows[0]["close_to_eager"], rows
    assert results["finetune"]["ok"] and results["finetune"]["steps"] == 8, results["finetune"]


def test_loss_scaling_trains_like_reference_and_backs_off(tiny):
    from rpcompile.runtime.loss_scale import LossScaleConfig

    data = batches(3)
    ref_losses, ref_params = reference_training(tiny, data[:2], ADAMW)
    config = LossScaleConfig(init_scale=2.0**10, growth_interval=2)
    with Trainer(tiny, train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                                     loss_scale=config, chaos=5)) as trainer:
        losses = [trainer.step(b) for b in data[:2]]
        # A power-of-two scale, divided out again, changes no bit of the fp32 gradients.
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        masters = {n: t.clone() for n, t in trainer.masters().items()}
        assert all(torch.equal(masters[n], p) for n, p in ref_params.items())
        assert trainer.loss_scaler.scale == 2.0**11  # two clean steps: grown once
        name = next(n for n in masters if n.endswith("model.norm.weight"))
        trainer.store.shadow_of(name).fill_(math.inf)
        trainer.step(data[2])
        assert trainer.last.skipped and trainer.loss_scaler.scale == 2.0**10
        assert all(torch.equal(trainer.masters()[n], masters[n]) for n in masters)
        assert trainer.steps_done == 2


def test_async_loss_scaling_trains_like_the_stale_reference_and_skips(tiny):
    """Async: step k's gradients are unscaled (and checked) at step k's end and applied in
    step k+1; an overflowing step drops its own gradients (the update they feed does not
    happen) and keeps its OPTs, which applied its predecessor's checked gradients: the next
    step already computes with the shadow they wrote (steps overlap)."""
    from rpcompile.runtime.loss_scale import LossScaleConfig

    data = batches(4)
    ref_losses, ref_params = reference_training(tiny, data[:2], ADAMW, mode="async")
    config = LossScaleConfig(init_scale=2.0**10, growth_interval=2)
    with Trainer(tiny,
                 train=replace(tiny.options.train, optimizer=ADAMW, device="virtual",
                               loss_scale=config, chaos=5),
                 plan=replace(tiny.options.plan, mode="async")) as trainer:
        losses = [trainer.step(b) for b in data[:2]]
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        assert trainer.loss_scaler.scale == 2.0**11  # two clean steps: grown once
        name = next(s.name for s in trainer.store.trainable_slots
                    if s.name.endswith("model.norm.weight"))
        trainer.store.shadow_of(name).fill_(math.inf)  # the copy step 2 computes with
        trainer.step(data[2])
        assert trainer.last.skipped and trainer.loss_scaler.scale == 2.0**10
        assert trainer.steps_done == 2 and trainer.driver.pending_step is None
        # Step 2's OPTs applied step 1's gradients: the masters are the reference's after
        # two steps (its flush applies step 1's), with nothing pending.
        assert all(torch.equal(trainer.store.master_of(n), p) for n, p in ref_params.items())
        trainer.step(data[3])  # computes with the shadow step 2's SHADOWs wrote: finite
        assert not trainer.last.skipped

"""The chaos soak shared by tests/runtime/test_soak.py (a bounded one) and benchmarks/soak.py (a longer
one): random architectures, worker counts 1-8, seeds, sync and async modes and chaos delays,
with a fault injected into random steps (a compute, an upload, a download, the host's gradient
accumulation, or the optimizer's own step()). After every run the masters must equal the
reference training over exactly the batches whose updates were applied (a failed step, and a
step whose update failed, change nothing)."""

from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

import rpcompile
from rpcompile.runtime.executor import StepFailed
from rpcompile.runtime.trainer import Trainer
from tests.runtime.test_executor import reference_training
from tests.tiny_models import hf_model, token_batch

ARCHS = ("qwen3", "llama", "qwen3_tied")
FAULTS = ("F", "T", "B", "UP", "D2H", "ACC", "optimizer")


class InjectedFault(RuntimeError):
    pass


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose step() raises on its ``fail_at``-th call from now (None: never)."""

    fail_at: int | None = None
    fired = 0

    def step(self, closure=None):  # type: ignore[override]
        out = super().step(closure)
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at < 0:
                self.fail_at = None
                raise InjectedFault("injected optimizer fault")
        return out


def _optimizer(params):
    return FlakyAdamW(params, lr=1e-2)


@dataclass
class SoakResult:
    runs: int = 0
    steps: int = 0
    faults_injected: int = 0  # faults armed
    faults_fired: int = 0  # armed faults that raised (an action may run fewer times)
    faults_survived: int = 0  # StepFailed raised and training went on
    divergences: list[str] = field(default_factory=list)
    seconds: float = 0.0


def one_run(rng: random.Random, steps: int, result: SoakResult, fault_rate: float) -> None:
    arch = rng.choice(ARCHS)
    workers = rng.randint(1, 8)
    mode = rng.choice(("sync", "async"))
    chaos = rng.randint(0, 10**6)
    microbatches = rng.randint(1, 3)
    label = f"{arch} workers={workers} mode={mode} chaos={chaos} microbatches={microbatches}"
    warnings.simplefilter("ignore")
    model = hf_model(arch, layers=2)
    compiled = rpcompile.compile(model, gpus=workers, microbatches=microbatches,
                                 example_inputs=token_batch(microbatches, seq=8))
    data = [token_batch(microbatches, seq=8, seed=rng.randint(0, 10**6)) for _ in range(steps)]
    applied: list[torch.Tensor] = []
    fired = [0]
    optimizer_fired = FlakyAdamW.fired
    with Trainer(compiled, train=replace(compiled.options.train, optimizer=_optimizer,
                                         device="virtual", chaos=chaos, timeout_s=120),
                 plan=replace(compiled.options.plan, mode=mode)) as trainer:
        ex = trainer.executor
        for batch in data:
            fault = rng.choice(FAULTS) if rng.random() < fault_rate else None
            if fault == "optimizer":
                trainer.optimizer.fail_at = rng.randint(0, len(trainer.driver.groups) - 1)
            elif fault is not None:
                original = getattr(type(ex), "_do_" + fault)
                left = [rng.randint(0, 3)]

                def broken(run, a, original=original, left=left):
                    left[0] -= 1
                    if left[0] == -1:
                        fired[0] += 1
                    if left[0] < 0:
                        raise InjectedFault(f"injected fault in {a}")
                    return original(ex, run, a)

                setattr(ex, "_do_" + fault, broken)
            try:
                trainer.step(batch)
                applied.append(batch)
            except StepFailed:
                result.faults_survived += 1
                del applied[trainer.steps_done:]
            finally:
                if fault is not None and fault != "optimizer":
                    delattr(ex, "_do_" + fault)
            result.faults_injected += fault is not None
            result.steps += 1
        try:
            masters = trainer.masters()
        except StepFailed:  # an optimizer fault in the last update
            result.faults_survived += 1
            del applied[trainer.steps_done:]
            masters = trainer.masters()
        trainer.optimizer.fail_at = None
        result.faults_fired += fired[0] + FlakyAdamW.fired - optimizer_fired
        assert len(applied) == trainer.steps_done, label
        _, want = reference_training(compiled, applied, lambda p: torch.optim.AdamW(p, lr=1e-2),
                                     mode)
        bad = [n for n, v in want.items() if not torch.equal(masters[n], v)]
        if bad:
            result.divergences.append(f"{label}: {len(bad)} masters differ, e.g. {bad[0]}")
    compiled.close()
    result.runs += 1


def soak(runs: int, steps: int = 4, seed: int = 0, fault_rate: float = 0.4) -> SoakResult:
    rng = random.Random(seed)
    result = SoakResult()
    start = time.perf_counter()
    for _ in range(runs):
        one_run(rng, steps, result, fault_rate)
    result.seconds = time.perf_counter() - start
    return result

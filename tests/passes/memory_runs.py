"""Helpers of the device-memory tests (tests/passes/test_memory_*.py): the tiny models they
compile, the tightest lowering of a plan, and a run on virtual workers that meters what each
worker holds, with the check that the proof, the simulator and the run agree."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import torch

import rpcompile
from rpcompile.compiler import runtime_schedule
from rpcompile.options import PlanOptions
from rpcompile.passes.lower import TIGHTEST_WAITS
from rpcompile.passes.memory import worker_peaks
from rpcompile.runtime.executor import Executor
from rpcompile.runtime.trainer import Trainer
from rpcompile.sim import simulate
from tests.option_groups import grouped
from tests.tiny_models import hf_model, token_batch


def SGD(params):
    return torch.optim.SGD(params, lr=0.1)


def compiled_for(arch: str, gpus: int, microbatches: int, **options):
    model = hf_model(arch, layers=4)
    return rpcompile.compile(model, gpus=gpus, microbatches=microbatches, device="virtual",
                             example_inputs=token_batch(2 * microbatches), **grouped(**options))


def tightest_peaks(compiled):
    """The runtime schedule's proven peaks of ``compiled``'s plan with the tightest memory
    waits (one gradient slot per worker): the least this plan can be lowered to."""
    plan = replace(compiled.plan, memory_waits=TIGHTEST_WAITS)
    sched = runtime_schedule(plan, PlanOptions(gpus=compiled.workers,
                                               microbatches=compiled.microbatches,
                                               rounds=compiled.rounds, mode="sync"))
    return worker_peaks(sched, plan)


@contextlib.contextmanager
def metered_computes(workers: int):
    """Per worker, the most device memory it really held during a compute: what it accounts
    as the compute starts plus the peak of the tensors the compute itself creates (its
    activations, saved tensors, temporaries, outputs), metered op by op (the virtual workers
    account buffers, not a compute's transients). A list, filled as the computes run."""
    from tests.passes.test_chunked_loss import _PeakBytes

    most = [0] * workers
    lock = threading.Lock()
    originals = {name: getattr(Executor, name) for name in ("_do_F", "_do_T", "_do_B")}

    def metered(original):
        def run(self, step, a):
            self._take_back(step, a)  # what the compute gives back as it starts (idempotent)
            held = self.workers[a.worker].memory_in_use
            with _PeakBytes() as meter:
                original(self, step, a)
            with lock:
                most[a.worker] = max(most[a.worker], held + meter.peak)
        return run

    try:
        for name, original in originals.items():
            setattr(Executor, name, metered(original))
        yield most
    finally:
        for name, original in originals.items():
            setattr(Executor, name, original)


def simulated_and_measured(compiled, gpus, microbatches, chaos=None):
    """Per worker: the simulated peak of the runtime's schedule replayed whole (its steps
    overlapping), the virtual workers' measured peak over a stream of those steps and one
    more (the schedule's repeated part runs again), run with the predicted peak + 5 % as
    their capacity, and the most they really held during a compute
    (:func:`metered_computes`)."""
    sched = runtime_schedule(compiled.plan, PlanOptions(gpus=gpus, microbatches=microbatches,
                                                        rounds=1, mode="sync"))
    simulated = list(simulate(sched, compiled.plan, compiled.hardware).peak_device_bytes)
    capacity = int(1.05 * max(p.peak_bytes for p in compiled.memory))
    with metered_computes(gpus) as really, Trainer(compiled,
                                                   train=replace(compiled.options.train,
                                                                 optimizer=SGD, device="virtual",
                                                                 chaos=chaos),
                                                   plan=replace(compiled.options.plan,
                                                                capacity_bytes=capacity)) as trainer:
        data = [token_batch(2 * microbatches, seed=k) for k in range(sched.steps + 1)]
        for _ in trainer.fit(data):
            pass
        measured = trainer.peak_bytes()
        assert trainer.predicted_peak_bytes() == tuple(p.peak_bytes for p in compiled.memory)
    return simulated, measured, list(really)


def assert_agree(predicted, simulated, measured, really=None, tight=0.95, metered=0.75):
    """Per worker: the simulator (with the cost model's times) reaches the proven peak within
    5 % and never passes it; the virtual workers, which account weights, gradient buffers
    and held values but not a compute's transients, reach the proven peak without working
    sets (``held_bytes``) within 5 % and never pass it; and what a worker really held during
    a compute (its accounting plus the compute's own tensors, metered) never passes the
    proven peak and reaches at least ``metered`` of it. The proof's working sets come from the cost
    model, each unit's counted whole (its largest transient included) while it still holds
    what it saved, beside a gradient job's parameters' gradients produced so far
    (tests/planner/test_job_memory.py holds one job's figure to its measured peak)."""
    assert len(predicted) == len(simulated) == len(measured)
    for w, (bound, got) in enumerate(zip(predicted, simulated)):
        assert tight * bound.peak_bytes <= got <= bound.peak_bytes, ("simulated", w, got, bound)
    for w, (bound, got) in enumerate(zip(predicted, measured)):
        assert tight * bound.held_bytes <= got <= bound.held_bytes, ("measured", w, got, bound)
    for w, (bound, got) in enumerate(zip(predicted, really or ())):
        assert metered * bound.peak_bytes <= got <= bound.peak_bytes, ("metered", w, got, bound)

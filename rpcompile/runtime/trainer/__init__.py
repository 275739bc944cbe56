"""Training API: a :class:`Trainer` runs a compiled model's RoundPipe steps on workers.

    compiled = rpcompile.compile(model, batch, gpus=4, microbatches=5)
    trainer = Trainer(compiled, train=TrainOptions(
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)))
    loss = trainer.step(batch)          # forward, backward, optimizer over the whole batch
    trainer.sync_to_model()             # trained weights back into the original module

It wires the runtime together: the workers (``device="auto"|"virtual"|"cuda"``), the host store
of fp32 masters / low-precision shadows / fp32 gradients built over the stage programs'
parameters, the optimizer driver (``mode="sync"``: ordinary training; ``"async"``: one step
stale, like the RoundPipe paper), the lowered schedule and the :class:`Executor`.

The schedule is built for as many steps as it takes the round-robin job counter to come back
to worker 0 (``workers / gcd(jobs per step, workers)``), so dealing continues across steps as
in a long run, and step ``k`` runs schedule step ``k mod steps``.

One module a concept: ``core`` (the Trainer: construction, stepping, inspection, closing),
``state`` (its state dicts and checkpoints, a base of Trainer), ``ranks`` (data parallel
ranks and the run's defaults) and ``plan_shape`` (the plan's summary and the batch shapes it
holds for).
"""

from rpcompile.runtime.executor import StepFailed
from rpcompile.runtime.trainer.core import Trainer
from rpcompile.runtime.trainer.plan_shape import check_plan_shape, plan_summary
from rpcompile.runtime.trainer.ranks import (
    TIMEOUT_FLOOR_S,
    check_ranks,
    default_timeout_s,
    group_world,
    planned_ranks,
)
from rpcompile.runtime.trainer.state import TrainerState

__all__ = ["TIMEOUT_FLOOR_S", "StepFailed", "Trainer", "TrainerState", "check_plan_shape",
           "check_ranks", "default_timeout_s", "group_world", "plan_summary", "planned_ranks"]

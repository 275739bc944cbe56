"""What a step gives back: :class:`StepResult` when it commits, :class:`StepFailed` when it
(or a step in flight with it) fails.

Steps overlap (docs/runtime.md): when one fails, every step not yet committed is discarded with
it, so a :class:`StepFailed` names the action that failed first and the steps it took along
(``discarded``); the trainer's state is that of the last committed step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rpcompile.ir import Action
from rpcompile.runtime.errors import RuntimeFault

__all__ = ["StepAborted", "StepFailed", "StepResult", "StepTimeout"]


class StepFailed(RuntimeFault):
    """A step stopped because an action failed. ``action`` is the failing schedule action,
    ``worker``/``stream`` where it ran (None/"host" for the host queue), ``stage`` its stage
    name (``F2``, ``B1``), ``microbatch``/``round`` as in the action; ``cause`` the original
    exception (also ``__cause__``). ``others`` lists secondary failures (waits that gave up).
    ``discarded``: the run steps thrown away with it, every step in flight not yet committed
    (their batches run again, bit for bit, on a retry).

    A failure outside any action (the optimizer's update, the watchdog, a stream thread, a
    ``close()`` from another thread) has ``action`` None and ``where`` saying what failed;
    ``step`` is the optimizer step that was undone (the update's step for an optimizer
    failure: its masters, optimizer state and step counter were restored)."""

    def __init__(self, action: Action | None, stage_name: str | None, worker_name: str | None,
                 cause: BaseException, others: Sequence[str] = (), *, where: str = "",
                 step: int | None = None, message: str = "",
                 discarded: Sequence[int] = ()) -> None:
        self.action = action
        self.worker = worker_name
        self.stream = action.stream if action is not None else (where or "host")
        self.stage = stage_name
        self.microbatch = None if action is None else action.microbatch
        self.round = None if action is None else action.round
        self.cause = cause
        self.others = tuple(others)
        self.step = step
        self.discarded = tuple(discarded)
        if action is None:
            text = f"step failed in {where}: {type(cause).__name__}: {cause}. " + (
                message or "The step's gradients were discarded and the masters kept; fix the "
                "cause and call step() again.")
        else:
            at = "host" if worker_name is None else f"worker {worker_name}"
            mb = "" if action.microbatch is None else f", microbatch {action.microbatch}"
            rnd = "" if action.round is None else f", round {action.round}"
            text = (
                f"step failed at {at}, stream {action.stream}, stage {stage_name}{mb}{rnd}, "
                f"action '{action}': {type(cause).__name__}: {cause}. The step's gradients "
                "were discarded and the workers recovered; fix the cause and call step() again."
            )
        if len(self.discarded) > 1:
            text += (f" Steps {list(self.discarded)} were in flight and are all discarded: a "
                     "retry runs their batches again.")
        if others:
            text += f" Also failed: {', '.join(others)}."
        super().__init__(text)
        self.__cause__ = cause

    @classmethod
    def from_update(cls, error: BaseException, discarded: Sequence[int] = ()) -> StepFailed:
        """The failure of an optimizer update (an :class:`OptimizerError` from the driver)."""
        step = getattr(error, "step", None)
        undone = getattr(error, "rolled_back", False)
        message = (
            f"Update {step} was undone: masters, optimizer state and shadows are as they were "
            f"before step {step}, and the step counter is back at {step} (its update never "
            "happened); fix the cause and call step() again."
            if undone else
            "The update could not be undone (rollback=False or the undo failed): masters may "
            "hold a partial update; load a checkpoint.")
        return cls(None, None, None, error, where="the optimizer update", step=step,
                   message=message, discarded=discarded)


class StepTimeout(StepFailed, TimeoutError):
    """The watchdog fired: a step outlived ``timeout_s`` (see :meth:`Executor.run_step`)."""


class StepAborted(RuntimeFault):
    """The steps in flight were abandoned from outside them (``close()`` from another
    thread)."""


@dataclass(frozen=True)
class StepResult:
    """What one step measured: its loss (a causal LM's token mean over the whole global batch;
    a ``loss_fn`` model's mean over microbatches), the run step and the schedule step it ran,
    wall time, and each worker's device-memory peak since the step before committed.

    ``seconds``: from the later of the step's start and the step before's commit to its own
    commit: with steps overlapping, the wall time the run spends per step."""

    loss: torch.Tensor
    schedule_step: int
    seconds: float
    peak_bytes: tuple[int, ...]
    # Device bytes each worker still held once the steps in flight had all committed and
    # their streams drained (the last step before a drain; empty for the others): 0 when
    # every action freed what the schedule says it frees.
    left_over_bytes: tuple[int, ...] = ()
    # Measured (start ms, end ms) of each action's work after its waits, from the start of
    # the run of steps it was part of (the first step submitted after the workers were last
    # idle): ``schedule.dump("run.json", timeline=result.timeline)`` draws what ran, to set
    # beside the simulator's prediction of the same actions.
    timeline: Mapping[Action, tuple[float, float]] = field(default_factory=dict)
    # Whether any job's fp32 gradient sums held an inf or NaN (the accumulation kernel's
    # fused check), and the (stage name, round) of each such job. ``skipped``: the step's
    # update was not applied because of them (``skip_nonfinite=True``; sync: masters,
    # optimizer state and step count unchanged, like torch.amp.GradScaler's skipped step;
    # async: the step's gradients are dropped, so the update they feed, in the next step,
    # does not happen).
    found_nonfinite: bool = False
    nonfinite_jobs: tuple[tuple[str, int], ...] = ()
    skipped: bool = False
    # The global L2 norm of the step's gradients over every trainable parameter, before
    # clipping (computed when the executor clips, ``max_grad_norm``; else None).
    grad_norm: float | None = None
    # Async: this step's OPTs that had no pending gradients to apply (the run's first step,
    # or the first after a flush) and so changed nothing.
    idle_updates: tuple[Action, ...] = ()
    # The run step (the executor's count of steps, which the round-robin dealing follows).
    step: int = 0
    # A causal LM: how many labelled tokens of the global batch (label != -100 after the
    # one-token shift, the tokens the loss averages over) have their label as the argmax of
    # their logits, counted in the tail where the loss is computed (data parallel: over every
    # rank's batch). None for a model whose graph does not count them (a loss_fn model).
    correct_tokens: int | None = None

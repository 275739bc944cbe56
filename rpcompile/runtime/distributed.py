"""Data parallel across processes on ``torch.distributed``: one RoundPipe pipeline per rank.

Every rank (one process per server, launched by ``torchrun``, or several on one machine for
tests) compiles the same model with the same plan and trains on its own share of the global
batch over its own workers. What makes the ranks one training run is here, and only here:

  1. ``resolve_group()``   - the process group: the one given, or the default one once
                             ``torch.distributed.init_process_group`` ran; None on one process
  2. ``DataParallel``      - the cross-rank steps of a training step, in the order they run:
       ``broadcast_store``   rank 0's masters and shadows to every rank (once, at the start)
       ``begin_step``        the ranks enter the step together; the step's labelled tokens
                             summed over ranks (the loss divisor)
       ``stage_done``        a gradient stage's last job is home: every parameter whose
                             gradient stages are now all done is all-reduced (SUM) at once,
                             asynchronously, on the host fp32 gradient buffer, while the
                             remaining backward jobs still run (called by the schedule's
                             REDUCE action, which then ``wait_reductions``)
       ``finish``            wait for those reductions (bounded by the step's deadline), then
                             agree on the loss and the non-finite flag in one small all-reduce
  3. ``RankFailed``        - the named error when another rank died, raised or stalled

**Exactness.** A causal LM's loss is Hugging Face's token mean over the whole *global* batch:
each microbatch's loss is its token-loss sum divided by the global count, so the per-rank
gradient sums add up, across ranks, to the gradient of the global loss. A ``loss_fn`` model's
loss is the mean over every microbatch of every rank: its summed gradients are divided by the
world size. Gloo's all-reduce gives every rank the same bits, so every rank's optimizer starts
from identical gradients and masters and ends each step with identical masters. Clipping runs
after ``finish`` on the reduced gradients: its norm is the global norm.

**Order.** Collectives match across ranks by their order. Every rank runs the same lowered
schedule, whose network lane (where ``REDUCE`` calls ``stage_done``) runs in list order on one
thread, so every rank launches the same reductions in the same order.

**Failure.** A rank that dies closes its connections: the others' next wait raises at once. A
rank that raises (or stalls) and stays alive leaves the others waiting until the step's
deadline (``compile(timeout_s=)``). Either way the waiting rank discards its step (masters and
optimizer state untouched) and raises :class:`RankFailed`. After any failed step the ranks'
collectives are out of step (one rank launched reductions another never will), so this
object refuses further steps: restart every rank (``torchrun`` does) and resume from the last
checkpoint.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

from rpcompile.runtime.executor import StepFailed
from rpcompile.runtime.memory import HostStore, _runs

__all__ = ["DataParallel", "RankFailed", "resolve_group"]


def resolve_group(process_group: Any = None) -> Any:
    """The group to train over: ``process_group`` when given; else the default group when
    ``torch.distributed`` is initialized with more than one rank; else None (one process)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class RankFailed(StepFailed):
    """A data-parallel step could not complete across ranks: another rank died, raised or did
    not reach the same collective within the step's deadline. This rank's step was discarded
    (masters and optimizer state as before it)."""

    def __init__(self, rank: int, world: int, what: str, cause: BaseException) -> None:
        super().__init__(
            None, None, None, cause, where=f"rank {rank} of {world}: {what}",
            message=(
                "Another rank died, raised or stalled (see its log). This rank's step was "
                "discarded and its masters kept, but the ranks' collectives are now out of "
                "step: restart every rank (torchrun restarts them) and resume from the last "
                "checkpoint."
            ),
        )
        self.rank = rank
        self.world = world


class DataParallel:
    """The cross-rank side of one trainer (see the module doc). ``mean_loss``: the model's
    loss is a mean over microbatches (a ``loss_fn`` model), not a token sum over a global
    count, so reduced gradients and losses are divided by the world size."""

    def __init__(self, group: Any, store: HostStore, *, mean_loss: bool) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise ValueError(
                f"data parallel reduces the host's fp32 gradients, which needs a group with "
                f"the gloo backend; this one is {backend!r}: "
                "torch.distributed.init_process_group('gloo') (or new_group(backend='gloo'))"
            )
        self.store = store
        self.mean_loss = mean_loss
        self._slots = [s for s in store.trainable_slots]
        self._pending: list[Any] = []
        self._works: list[tuple[str, Any]] = []
        self._done: set[int] = set()
        self._broken = ""
        self.reductions = 0  # all-reduces launched in the last step (for tests and reports)

    # -- start --------------------------------------------------------------------------------
    def broadcast_store(self) -> None:
        """Make every rank start from rank 0's weights: its fp32 masters and its shadows (the
        compute-dtype copies, frozen parameters included), broadcast as raw bytes. Ranks
        reach this after compiling, at their own pace: the wait is the process group's
        timeout (``init_process_group(timeout=)``), not a step's."""
        store = self.store
        for what, tensor in (("masters", store.master), ("shadows", store.shadow)):
            if tensor.numel():
                flat = tensor.reshape(-1).view(torch.uint8)
                self._wait(f"broadcast of rank 0's {what}",
                           dist.broadcast(flat, src=dist.get_global_rank(self.group, 0),
                                          group=self.group, async_op=True),
                           None)

    # -- one step -----------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse a step once an earlier one failed (the collectives are out of step)."""
        if self._broken:
            raise RuntimeError(
                f"rank {self.rank}: no more data-parallel steps after a failed one "
                f"({self._broken}): the ranks' collectives are out of step. Restart every "
                "rank and resume from the last checkpoint."
            )

    def begin_step(self, count: torch.Tensor | None = None) -> torch.Tensor | None:
        """Enter a step together: one all-reduce that returns the labelled-token count of the
        whole global step (``count``, this rank's; None for a ``loss_fn`` model). Between
        steps a rank may do work of its own (rank 0 evaluates and writes checkpoints), so
        this wait is the process group's timeout; the step's own waits, from here on, end at
        the step's deadline."""
        self.check()
        self._pending = list(self._slots)
        self._works = []
        self._done = set()
        self.reductions = 0
        local = torch.zeros(1, dtype=torch.int64) if count is None else \
            count.detach().to(torch.int64).reshape(1).clone()
        self._wait("the start of the step (the global labelled-token count)",
                   dist.all_reduce(local, group=self.group, async_op=True), None)
        return None if count is None else local.reshape(()).to(count.dtype)

    def stage_done(self, stage: int) -> None:
        """``stage``'s gradients of this step are all home: launch the all-reduce of every
        parameter whose gradient stages are now all done (one per contiguous run)."""
        self._done.add(stage)
        ready = [s for s in self._pending if set(s.grad_stages) <= self._done]
        if not ready:
            return
        self._pending = [s for s in self._pending if s not in ready]
        for m0, m1, _ in _runs(ready):
            work = dist.all_reduce(self.store.grad[m0:m1], group=self.group, async_op=True)
            self._works.append((f"the gradient all-reduce after stage {stage}", work))
            self.reductions += 1

    def wait_reductions(self, timeout_s: float | None) -> None:
        """Wait for the reductions launched so far (the schedule's REDUCE action waits here,
        on the host's network lane, so what reads the reduced gradients waits for that
        action's edge); :meth:`finish` then finds them done."""
        works, self._works = self._works, []
        for what, work in works:
            self._wait(what, work, timeout_s)

    def finish(self, loss: torch.Tensor, nonfinite: bool,
               timeout_s: float | None) -> tuple[torch.Tensor, bool]:
        """Wait for the step's gradient reductions, then agree on the step's loss (summed, or
        averaged for a mean loss) and whether any rank found a non-finite gradient."""
        if self._pending:
            names = [s.name for s in self._pending[:3]]
            raise RuntimeError(f"rank {self.rank}: gradients of {names} were never reduced "
                               "(their stages never reported done)")
        for what, work in self._works:
            self._wait(what, work, timeout_s)
        self._works = []
        if self.mean_loss:
            self.store.grad.mul_(1.0 / self.world)
        both = torch.stack([loss.detach().double().reshape(()),
                            torch.tensor(float(nonfinite), dtype=torch.float64)])
        self._wait("the step's loss and non-finite flag", dist.all_reduce(
            both, group=self.group, async_op=True), timeout_s)
        total = both[0] / self.world if self.mean_loss else both[0]
        return total.to(loss.dtype), bool(both[1] > 0)

    def abandon(self, reason: str) -> None:
        """A step failed on this rank: its collectives no longer match the other ranks'."""
        self._broken = self._broken or reason
        self._works = []
        self._pending = []

    # -- waits --------------------------------------------------------------------------------
    def _wait(self, what: str, work: Any, timeout_s: float | None) -> None:
        try:
            if timeout_s is None or math.isinf(timeout_s):
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
        except Exception as exc:
            self.abandon(what)
            raise RankFailed(self.rank, self.world, what, exc) from exc

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

**Sharded host state** (``shard_optimizer=True``, ZeRO-1 style). The trainable parameters are
cut into N contiguous ranges of whole parameters of the master index space
(:func:`~rpcompile.runtime.memory.shard_bounds`); rank ``r`` keeps the fp32 masters of range
``r`` only (:meth:`HostStore.shard_masters`), and its optimizer is built over those alone, so
its state is 1/N too. Shadows (what the workers upload) and the gradient buffer (where every
job's gradients land) stay whole on every rank. The step changes in three places:

  ``stage_done``   instead of an all-reduce, each ready run is cut at the shard bounds and
                   every piece is *reduced* (``dist.reduce``, SUM) to the rank that owns it: a
                   reduce-scatter in semantics and traffic. Gloo's own ``reduce_scatter`` is
                   an all-reduce followed by keeping a chunk, so it is not used.
  ``finish``       after the reductions, the gradient elements this rank does not own (its
                   local, unreduced sums) are zeroed; the loss / non-finite agreement is the same.
  clipping         the global norm: each rank computes the norms of the parameters it owns,
                   one all-reduce of that per-parameter vector (each entry non-zero on one rank
                   only), then torch's norm of the norms, as ``clip_grad_norm_`` computes it.
  ``gather_shadows`` at a stage's ``SHADOW`` (after this rank updated and refreshed its own
                   part), each owner broadcasts its part of the stage's trainable shadows, so
                   every rank's workers upload the same weights: an all-gather (gloo's
                   ``all_gather`` needs equal pieces, the shards are not). A parameter shared by
                   several stages is gathered once per step, at the first ``SHADOW`` after
                   its update (all its gradient stages done).

Masters are then no longer replicated: :meth:`gather_masters` (a collective) brings them all
to every rank, :meth:`gather_state` this rank's optimizer state to rank 0 for a checkpoint,
and :meth:`shard_state` cuts a whole checkpoint's state down to this rank's shard.

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
rank whose step (or any collective operation) fails while it stays alive, or is interrupted
(``KeyboardInterrupt``, any ``BaseException``), *announces* it on the process group's store
(the key-value store ``init_process_group`` rendezvoused on, outside the collectives' order):
every wait here polls that store every ``POLL_S`` (0.25 s) while its collective is not done,
so the other ranks stop at their next poll, not at the step's deadline or the group's timeout.
In a step they raise :class:`RankFailed` naming the rank and what it announced; in a
checkpoint's agreement (:meth:`DataParallel.settle`) :class:`CheckpointFailed`. A rank that
only stalls (alive, silent) is still found by the step's deadline (``compile(timeout_s=)``),
or, between steps and in checkpoints, the process group's timeout. The waiting rank discards
its step (masters and optimizer state untouched). After any failed step the ranks'
collectives are out of step (one rank launched reductions another never will), so this
object refuses further collectives (and announces that it does): restart every rank
(``torchrun`` does) and resume from the last checkpoint.
"""

from __future__ import annotations

import datetime
import io
import math
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from rpcompile.errors import InvalidInput, StateError
from rpcompile.runtime.checkpoint import merge_shards
from rpcompile.runtime.errors import EventTimeout
from rpcompile.runtime.executor import StepFailed, clip_grad_norm
from rpcompile.runtime.memory import HostStore, shard_bounds
from rpcompile.runtime.memory.layout import _runs

__all__ = ["POLL_S", "DataParallel", "RankFailed", "merge_shards", "resolve_group"]

# Bytes of each rank's note in a checkpoint agreement (its error message, or a digest).
_NOTE_BYTES = 480
# How often a wait whose collective is not done looks for another rank's announced failure.
POLL_S = 0.25
# Bytes of the random id that names one trainer's keys on the store (drawn by rank 0).
_KEY_BYTES = 16


class _PeerFailed(RuntimeError):
    """Another rank announced that it failed or was interrupted (``failures``: rank -> why)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        super().__init__("; ".join(f"rank {r} announced: {why}"
                                   for r, why in sorted(failures.items())))


def _group_store(group: Any) -> Any:
    """The key-value store ``group`` rendezvoused on (None if torch does not expose it: then
    a failed rank is found by the deadlines alone)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_process_group_store(group)
    except Exception:
        return None


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

    def __init__(self, group: Any, store: HostStore, *, mean_loss: bool,
                 shard: bool = False) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        if backend != "gloo":
            raise InvalidInput(
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
        self.reductions = 0  # reductions launched in the last step (for tests and reports)
        self.shard = shard
        # Shard r: the master index range [start, stop) rank r owns (sharded), else None.
        self.bounds = shard_bounds(store.trainable_slots, self.world) if shard else None
        if self.bounds is not None and any(b0 == b1 for b0, b1 in self.bounds):
            raise InvalidInput(
                f"shard_optimizer=True on {self.world} ranks leaves a rank no parameter to "
                f"own: the model has {len(store.trainable_slots)} trainable parameters (shards "
                "hold whole parameters); use fewer ranks or shard_optimizer=False")
        self._gathered: set[int] = set()  # slots whose shadows were gathered this step
        self._deadline: float | None = None
        # The trainer's keys on the store: a random id drawn by rank 0 and broadcast (the
        # construction is a collective), so that every rank of this group uses the same keys
        # whatever trainers it built before on other groups, and no trainer reads a failure
        # announced by an earlier one. The broadcast is not polled (no keys yet): its wait
        # is the process group's timeout.
        self._store = None
        self._key = ""
        ident = torch.zeros(_KEY_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            ident.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
        self._wait("the broadcast of the trainer's store key", dist.broadcast(
            ident, src=dist.get_global_rank(group, 0), group=group, async_op=True), None)
        self._key = f"rpcompile/dp/{bytes(ident.tolist()).hex()}"
        self._store = _group_store(group)

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

    def shard_store(self) -> None:
        """Keep only this rank's shard of the masters (after :meth:`broadcast_store`)."""
        start, stop = self.bounds[self.rank]
        self.store.shard_masters(start, stop, self.rank, self.world)

    def _src(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _pieces(self, m0: int, m1: int) -> list[tuple[int, int, int]]:
        """(owner, start, stop) of the master range [m0, m1) cut at the shard bounds."""
        out = []
        for r, (b0, b1) in enumerate(self.bounds):
            lo, hi = max(m0, b0), min(m1, b1)
            if lo < hi:
                out.append((r, lo, hi))
        return out

    # -- one step -----------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse a collective (a step, a checkpoint) once an earlier one failed here (the
        collectives are out of step). The failure was announced when it happened, so the
        other ranks, waiting for this one, stop at their next poll."""
        if self._broken:
            raise StateError(
                f"rank {self.rank}: no more data-parallel steps or checkpoints after a failed "
                f"collective ({self._broken}): the ranks' collectives are out of step. Restart "
                "every rank and resume from the last checkpoint."
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
        self._gathered = set()
        self._deadline = None
        self.reductions = 0
        local = torch.zeros(1, dtype=torch.int64) if count is None else \
            count.detach().to(torch.int64).reshape(1).clone()
        self._wait("the start of the step (the global labelled-token count)",
                   dist.all_reduce(local, group=self.group, async_op=True), None)
        return None if count is None else local.reshape(()).to(count.dtype)

    def stage_done(self, stage: int) -> None:
        """``stage``'s gradients of this step are all home: launch the all-reduce of every
        parameter whose gradient stages are now all done (one per contiguous run); sharded,
        the reduction of each run's piece to the rank that owns it."""
        self._done.add(stage)
        ready = [s for s in self._pending if set(s.grad_stages) <= self._done]
        if not ready:
            return
        self._pending = [s for s in self._pending if s not in ready]
        for m0, m1, _ in _runs(ready):
            if not self.shard:
                work = dist.all_reduce(self.store.grad[m0:m1], group=self.group, async_op=True)
                self._works.append((f"the gradient all-reduce after stage {stage}", work))
                self.reductions += 1
                continue
            for owner, lo, hi in self._pieces(m0, m1):
                work = dist.reduce(self.store.grad[lo:hi], dst=self._src(owner),
                                   group=self.group, async_op=True)
                self._works.append((f"the gradient reduction to rank {owner} after stage "
                                    f"{stage}", work))
                self.reductions += 1

    def wait_reductions(self, timeout_s: float | None) -> None:
        """Wait for the reductions launched so far (the schedule's REDUCE action waits here,
        on the host's network lane, so what reads the reduced gradients waits for that
        action's edge); :meth:`finish` then finds them done."""
        works, self._works = self._works, []
        for what, work in works:
            self._wait(what, work, timeout_s)

    def finish(self, loss: torch.Tensor, nonfinite: bool, timeout_s: float | None,
               correct: int | None = None) -> tuple[torch.Tensor, bool, int | None]:
        """Wait for the step's gradient reductions, then agree on the step's loss (summed, or
        averaged for a mean loss), whether any rank found a non-finite gradient, and the sum
        of the ranks' counts of labelled tokens predicted right (``correct``; None stays
        None)."""
        if self._pending:
            names = [s.name for s in self._pending[:3]]
            raise StateError(f"rank {self.rank}: gradients of {names} were never reduced "
                               "(their stages never reported done)")
        if timeout_s is not None and not math.isinf(timeout_s):
            self._deadline = time.monotonic() + timeout_s
        for what, work in self._works:  # together within the step's deadline
            self._wait(what, work, self._left())
        self._works = []
        if self.shard:
            # What this rank holds outside its shard are its own unreduced sums: unused, and
            # zeroed so that nothing (a scaler, a check) can mistake them for gradients.
            start, stop = self.bounds[self.rank]
            with torch.no_grad():
                self.store.grad[:start].zero_()
                self.store.grad[stop:].zero_()
        if self.mean_loss:
            self.store.grad.mul_(1.0 / self.world)
        # One reduction; float64 holds a token count exactly (below 2**53).
        both = torch.stack([loss.detach().double().reshape(()),
                            torch.tensor(float(nonfinite), dtype=torch.float64),
                            torch.tensor(float(correct or 0), dtype=torch.float64)])
        self._wait("the step's loss and non-finite flag", dist.all_reduce(
            both, group=self.group, async_op=True), self._left())
        total = both[0] / self.world if self.mean_loss else both[0]
        return (total.to(loss.dtype), bool(both[1] > 0),
                None if correct is None else int(both[2]))

    def clip_grad_norm(self, store: HostStore, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the reduced gradients by their global norm; returns the norm before clipping.
        Replicated gradients: :func:`rpcompile.runtime.executor.clip_grad_norm` on each rank.
        Sharded: each rank's owned parameters' norms, summed into one vector over ranks (each
        entry comes from its owner alone, so the sum is exact), the norm of that vector, and
        each rank clips the gradients it owns."""
        if not self.shard:
            return clip_grad_norm(store, model, max_norm)
        trainable = {s.name for s in store.trainable_slots}
        owned = {s.name for s in store.owned_slots}
        names = [n for n, _ in model.named_parameters() if n in trainable]
        norms = torch.zeros(len(names), dtype=torch.float32)
        for i, n in enumerate(names):
            if n in owned:
                norms[i] = torch.linalg.vector_norm(store.grad_of(n), 2.0)
        self._wait("the gradient norms' all-reduce (clipping)",
                   dist.all_reduce(norms, group=self.group, async_op=True), self._left())
        total = torch.linalg.vector_norm(norms, 2.0)
        mine = [_Grad(store.grad_of(n)) for n in names if n in owned]
        torch.nn.utils.clip_grads_with_norm_(mine, max_norm, total)
        return float(total)

    def gather_shadows(self, stage: int | None, done: set[int] | None = None, *,
                       in_step: bool = True) -> None:
        """Bring every rank the updated shadows of ``stage``'s trainable parameters (all, when
        None) from their owners: the all-gather of the sharded update. Called by the driver's
        ``SHADOW`` after this rank rewrote its own part, with ``done`` the stages whose
        ``OPT`` ran this step (its waits end at the step's deadline): a parameter is gathered
        once per step, at the first ``SHADOW`` after its update, that is once all its
        gradient stages are in ``done`` (a tied parameter read by an earlier stage's
        ``SHADOW`` is not updated yet then; every rank runs the same host queue, so all agree).
        After a checkpoint is loaded (``in_step=False``: the process group's timeout) every
        parameter is gathered, whatever an earlier step gathered."""
        store = self.store
        indices = (range(len(store.slots)) if stage is None
                   else store.stages[stage].layout.slots)
        skip = self._gathered if in_step else set()
        slots = [store.slots[i] for i in indices
                 if store.slots[i].trainable and i not in skip
                 and (done is None or set(store.slots[i].grad_stages) <= done)]
        if not slots:
            return
        works = []
        for m0, m1, s0 in _runs(slots):
            for owner, lo, hi in self._pieces(m0, m1):
                piece = store.shadow[s0 + lo - m0 : s0 + hi - m0].view(torch.uint8)
                works.append(dist.broadcast(piece, src=self._src(owner), group=self.group,
                                            async_op=True))
        where = "all" if stage is None else f"stage {stage}'s"
        for work in works:
            self._wait(f"the all-gather of {where} updated shadows", work,
                       self._left() if in_step else None)
        if in_step:
            self._gathered.update(s.index for s in slots)

    def gather_masters(self) -> dict[str, torch.Tensor]:
        """Every rank gets every fp32 master (a collective: call it on every rank), by name:
        each owner broadcasts its shard. Replicated masters: this rank's, cloned."""
        store = self.store
        if not self.shard:
            return {s.name: store.master_of(s.name).clone() for s in store.trainable_slots}
        self.check()
        full = torch.empty(self.bounds[-1][1], dtype=torch.float32)
        start, stop = self.bounds[self.rank]
        full[start:stop].copy_(store.master)
        for r, (b0, b1) in enumerate(self.bounds):
            if b1 > b0:
                self._wait(f"the gather of rank {r}'s masters", dist.broadcast(
                    full[b0:b1], src=self._src(r), group=self.group, async_op=True), None)
        return {s.name: full[s.master_offset : s.master_offset + s.numel].view(s.shape)
                for s in store.trainable_slots}

    def gather_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer
                     ) -> dict[str, Any] | None:
        """A sharded checkpoint's state, gathered: every rank passes its driver's
        ``state_dict()``; rank 0 gets the whole state as one process would hold it (optimizer
        state indexed over all trainable parameters, :func:`merge_shards`), the others None.
        A collective: call it on every rank."""
        names = dict(self._optimizer_names_of(optimizer))
        mine = {"rank": self.rank, "world": self.world, "bounds": self.bounds,
                "state": state, "names": names}
        parts = self.gather_to_first(mine, "the gather of the checkpoint's shards")
        if self.rank != 0:
            return None
        return merge_shards(self.store, parts)

    def gather_to_first(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` (picklable) on rank 0, in rank order (the others get None):
        a collective; its wait is the process group's timeout (polled, like every wait here,
        for another rank's announced failure). Serialized with ``torch.save`` and sent as
        bytes padded to the largest rank's, as ``gather_object`` does, but with async
        collectives (``gather_object`` blocks, so its wait could not be polled)."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        sizes = torch.zeros(self.world, dtype=torch.int64)
        sizes[self.rank] = data.numel()
        self._wait(f"{what} (the sizes)",
                   dist.all_reduce(sizes, group=self.group, async_op=True), None)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[:data.numel()] = data
        del data, buffer
        slots = ([torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0
                 else None)
        self._wait(what, dist.gather(padded, slots, dst=self._src(0), group=self.group,
                                     async_op=True), None)
        if self.rank != 0:
            return None
        # Written by this run's own ranks a moment ago (not a file): trusted as gather_object's.
        return [torch.load(io.BytesIO(slot[:int(n)].numpy().tobytes()), weights_only=False)
                for slot, n in zip(slots, sizes.tolist())]

    def shard_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer, *,
                    strict: bool = True, partial: bool = False) -> dict[str, Any]:
        """Cut a whole state (a checkpoint written by one process, by replicated data parallel,
        or gathered from any number of shards) down to this rank's shard, indexed as this
        rank's ``optimizer`` indexes its parameters, by parameter name
        (:func:`~rpcompile.runtime.checkpoint.match_optimizer_state`). Raises
        ``CheckpointError`` when the state does not name its parameters, does not cover every
        trainable parameter (``partial``: every parameter this rank owns), or its optimizer
        groups differ from these."""
        from rpcompile.runtime.checkpoint import match_optimizer_state

        return match_optimizer_state(self.store, state, optimizer, strict=strict,
                                     require_names=True, partial=partial)

    def _optimizer_names_of(self, optimizer: torch.optim.Optimizer) -> list[tuple[int, str]]:
        from rpcompile.runtime.checkpoint import optimizer_param_names

        return list(enumerate(optimizer_param_names(self.store, optimizer)))

    # -- agreement (checkpoints) ----------------------------------------------------------
    def settle(self, error: BaseException | None, what: str, note: str = "") -> dict[int, str]:
        """End a local phase of a collective operation (a checkpoint's save or load) with the
        same outcome on every rank: every rank calls this, whether its own phase raised
        (``error``) or not, so the collectives stay in the same order on every rank. One
        all-reduce of a fixed-size row per rank carries each rank's outcome and a short
        ``note`` (a load's file digest). When any rank failed, every rank raises
        :class:`~rpcompile.runtime.checkpoint.CheckpointFailed` naming the ranks and what
        they raised (a failed rank's own error is its cause); else it returns every rank's
        note. Ranks reach this at their own pace (rank 0 may be writing): the wait is the
        process group's timeout; a rank that died makes it raise :class:`RankFailed` at once."""
        from rpcompile.runtime.checkpoint import CheckpointFailed

        text = note if error is None else f"{type(error).__name__}: {error}"
        data = text.encode("utf-8", "replace")[:_NOTE_BYTES]
        rows = torch.zeros(self.world, 2 + _NOTE_BYTES, dtype=torch.int32)
        rows[self.rank, 0] = 0 if error is None else 1
        rows[self.rank, 1] = len(data)
        if data:
            rows[self.rank, 2:2 + len(data)] = torch.tensor(list(data), dtype=torch.int32)
        self._wait(f"the agreement on {what}",
                   dist.all_reduce(rows, group=self.group, async_op=True), None,
                   agreement=what)
        texts = {r: bytes(rows[r, 2:2 + int(rows[r, 1])].tolist()).decode("utf-8", "replace")
                 for r in range(self.world)}
        failed = {r: texts[r] for r in range(self.world) if int(rows[r, 0])}
        if failed:
            raise CheckpointFailed(what, failed, self.world) from error
        return texts

    def interrupted(self, exc: BaseException, what: str) -> None:
        """A checkpoint's local phase on this rank was interrupted (``KeyboardInterrupt``,
        ``SystemExit``: not an error to agree on, the caller wants to stop now): announce it
        (the others, in the agreement, raise :class:`CheckpointFailed` at their next poll)
        and mark this rank's collectives out of step; the caller re-raises ``exc``."""
        self.abandon(f"{type(exc).__name__} on rank {self.rank} in {what}")

    def _left(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - time.monotonic(), 0.001)

    def abandon(self, reason: str) -> None:
        """A step (or another collective) failed on this rank: its collectives no longer match
        the other ranks'. The first reason is announced on the store, so that ranks waiting
        for this one stop at their next poll (:meth:`_wait`)."""
        first = not self._broken
        self._broken = self._broken or reason
        self._works = []
        self._pending = []
        if first:
            self._announce(reason)

    # -- the store: announced failures --------------------------------------------------------
    def _announce(self, reason: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"{self._key}/failed/{self.rank}",
                            reason.encode("utf-8", "replace")[:_NOTE_BYTES])
            self._store.add(f"{self._key}/failed", 1)
        except Exception:  # the store went with its rank: the others' waits fail on their own
            pass

    def failed_peers(self) -> dict[int, str]:
        """The other ranks that announced a failure, and what they announced (one store
        round trip while none has)."""
        if self._store is None:
            return {}
        try:
            if self._store.add(f"{self._key}/failed", 0) == 0:
                return {}
            out = {}
            for r in range(self.world):
                key = f"{self._key}/failed/{r}"
                if r != self.rank and self._store.check([key]):
                    out[r] = self._store.get(key).decode("utf-8", "replace")
            return out
        except Exception:
            return {}

    # -- waits --------------------------------------------------------------------------------
    def _wait(self, what: str, work: Any, timeout_s: float | None, *,
              agreement: str | None = None) -> None:
        """Wait for ``work`` until ``timeout_s`` (None: the process group's own timeout ends
        it), polling the store every ``POLL_S`` for another rank's announced failure. Any
        failure here leaves this rank's collectives out of step (:meth:`abandon`): a failed
        collective or a passed deadline raises :class:`RankFailed`; an announced failure
        :class:`RankFailed` too, or, in a checkpoint's agreement (``agreement`` names it),
        :class:`~rpcompile.runtime.checkpoint.CheckpointFailed`; an interrupt is re-raised."""
        from rpcompile.runtime.checkpoint import CheckpointFailed

        end = None if timeout_s is None or math.isinf(timeout_s) else \
            time.monotonic() + max(timeout_s, 0.001)
        try:
            while True:
                left = POLL_S if end is None else min(POLL_S, end - time.monotonic())
                if left <= 0:
                    raise EventTimeout(f"not done within the step's deadline ({timeout_s:.1f} "
                                       "s from this wait)")
                try:
                    work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
                    return
                except RuntimeError:
                    if work.is_completed():
                        # Done between the timed wait and this check (a success, then the
                        # untimed wait returns) or failed (a rank died, the group timed out:
                        # it raises the collective's own error, not the poll's timeout).
                        work.wait()
                        return
                peers = self.failed_peers()
                if peers:
                    raise _PeerFailed(peers)
        except _PeerFailed as exc:
            self.abandon(f"{what}: {exc}")
            if agreement is not None:
                raise CheckpointFailed(agreement, exc.failures, self.world,
                                       restart=True) from exc
            raise RankFailed(self.rank, self.world, what, exc) from exc
        except Exception as exc:
            self.abandon(what)
            raise RankFailed(self.rank, self.world, what, exc) from exc
        except BaseException as exc:  # an interrupt: the others must not wait for this rank
            self.abandon(f"{type(exc).__name__} on rank {self.rank} in {what}")
            raise


class _Grad:
    """A parameter-like holder of a host gradient view, for torch's clipping helpers."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

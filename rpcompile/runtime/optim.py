"""The host optimizer driver: any ``torch.optim`` optimizer over the fp32 masters, in ``sync``
or ``async`` mode, stepped by the schedule's host actions (or, for callers without a schedule,
by one background thread).

**Groups.** Trainable parameters are grouped by the set of stages that produce their gradients
(``ParamSlot.grad_stages``; a tied embedding/LM-head weight has two). A group's gradients are
complete once all those stages have called :meth:`OptimizerDriver.stage_done`. An update steps
one group: the user's optimizer is called with ``.grad`` set on that group's masters and None on
all others, which every per-parameter torch optimizer (SGD, Adam, AdamW, ... : each parameter's
update reads only its own gradient and state) skips. So stepping group by group gives results
bit-identical to one ``optimizer.step()`` over all parameters. Optimizers that couple
parameters cannot be split: LBFGS is refused; an optimizer class not known to be per-parameter
gets a warning and is stepped once over everything when all gradients are home (pass
``per_parameter=True`` to assert that it is per-parameter).

**Modes.** With ``w_k`` the masters before update ``k`` and ``g_k(w)`` step ``k``'s gradient
computed at weights ``w``:

- ``sync``: ``w_{k+1} = U(w_k, g_k(w_k))``, ordinary training. A group is updated (and its
  shadow rewritten) as soon as its gradients are complete, while later backward stages still
  run; step ``k+1`` uses a stage once that stage's groups are updated (:meth:`shadow_event`).
- ``async``: ``w_{k+1} = U(w_k, g_k(w_{k-1}))`` with ``w_{-1} = w_0``: one step stale, like
  RoundPipe. Step ``k+1`` computes with ``w_k``; one shadow buffer holds it.

**The schedule's actions (both modes, what the executor runs).** ``begin_step()``; per job
``accumulate_grad(stage, flat)`` (``ACC``); ``update(stage)`` (``OPT``: every group whose
gradient stages' OPTs of the step have all run is stepped now, on the caller's thread);
``refresh(stage)`` (``SHADOW``); ``commit_step()`` when the step completed, ``discard_step()``
when it failed (both put back or drop the journal below). In async mode (``use_pending()``)
step k's OPTs apply step k-1's gradients, which ``commit_step`` of step k-1 left in the
store's pending buffer (the two gradient buffers trade places), with step k-1's
hyperparameters; ``discard_step`` leaves them pending; ``flush()`` applies them between steps
(the Trainer's, before the masters are read). The lowering decides where these run; the
driver adds no wait and no order of its own, and its thread is never started.

**The thread contract** (callers without a schedule; the thread starts with its first task):

1. ``begin_step()``; then for each job, wait ``shadow_event(stage)`` before uploading the
   stage's shadow.
2. ``accumulate_grad(stage, flat_fp32)`` once per job (per stage per round): it waits until the
   previous update has consumed these gradients, then adds in fp32. Gradients must already be
   those of the loss averaged over the whole step: scale each microbatch's loss by
   ``1 / (microbatches per round x rounds)`` before its backward; the driver never divides.
3. ``stage_done(stage)`` once per gradient stage when its last round is home.
4. ``finish_step()`` when the step's last job is done (no upload of it still reads the
   shadow). It returns an event set when this step's update is complete.

Hyperparameters (``param_groups`` entries: lr, betas, ...) are snapshotted at ``begin_step``:
update ``k`` uses what was set when step ``k`` began, even if an LR scheduler changes them
while an async update is still running.

**Failure atomicity.** Before a group is stepped the driver saves what the update will change
(the group's masters, their optimizer state, their shadow; in async mode the shadow before the
refresh), so an exception anywhere in update ``k`` (the user's ``step()`` at any group, the
refresh, the zeroing) is undone: every group of update ``k`` already applied is restored, the
step's gradients are zeroed, and the next call that meets the failure (``begin_step``,
``wait``, ``take_failure``) raises it once as an :class:`OptimizerError` and puts the step
counter back to ``k``; then it calls each of ``undo_hooks`` with ``k`` (state kept outside
the driver, the executor's loss scaler, goes back too). The driver is then usable again:
update ``k`` never happened. The saved
copy lives only while update ``k`` runs (at most the trainable masters, their optimizer state
and shadow: the largest transient, 14 bytes per trainable parameter for AdamW with a bf16
shadow); ``rollback=False`` does without it and leaves a failed update half-applied.
"""

from __future__ import annotations

import copy
import queue
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.capture.tracing import outside_tracing
from rpcompile.runtime.errors import EventTimeout, OptimizerError, UpstreamFailed
from rpcompile.runtime.memory import HostStore, MemoryReport
from rpcompile.runtime.workers import Event

__all__ = ["OptimizerDriver", "UpdateGroup"]


# Optimizers whose update of a parameter reads only that parameter's gradient and state.
_PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam",
                 "RAdam", "RMSprop", "Rprop", "Adafactor")
    if hasattr(torch.optim, name)
)


@dataclass(frozen=True)
class UpdateGroup:
    """Parameters updated together: their gradients complete when ``stages`` are all done."""

    index: int
    slots: tuple[int, ...]
    stages: frozenset[int]
    label: str


class _Journal:
    """What update ``k`` is about to change, saved before it changes it (see the module doc):
    master copies and shadow copies by slot, optimizer state by parameter (None: the
    parameter had no state yet)."""

    def __init__(self) -> None:
        self.masters: dict[int, torch.Tensor] = {}
        self.shadows: dict[int, torch.Tensor] = {}
        self.state: list[tuple[torch.Tensor, dict[str, Any] | None]] = []


class _StepState:
    def __init__(self, step: int, groups: int, hyperparams: list[dict[str, Any]]) -> None:
        self.step = step
        self.done_stages: set[int] = set()
        self.opt_stages: set[int] = set()  # stages whose OPT ran in this step
        self.scheduled = [False] * groups
        self.group_done = [Event(f"update {step} group {g}") for g in range(groups)]
        self.refreshed = Event(f"shadow after update {step - 1}")  # async only
        self.hyperparams = hyperparams
        self.journal: _Journal | None = None
        self.applied = 0  # groups whose update completed
        self.failed = False  # the update failed: its queued tasks are dropped


@dataclass(frozen=True)
class _Pending:
    """Gradients of a completed async step not applied yet (the store's pending buffer), and
    the hyperparameters of that step, which their update uses."""

    step: int
    hyperparams: list[dict[str, Any]]


class OptimizerDriver:
    """Runs the user's optimizer over a :class:`HostStore`'s masters (see the module doc).

    ``optimizer`` is a factory ``params -> torch.optim.Optimizer`` called with
    ``store.masters()`` (e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)``), or an
    optimizer already built over those same tensors. ``eager_updates=False`` (sync mode) holds
    every update until :meth:`finish_step`, so a step that fails part-way leaves the masters
    untouched (:meth:`discard_step`), at the cost of the overlap. ``rollback`` (default True)
    undoes a failed update (see the module doc).
    """

    def __init__(
        self,
        store: HostStore,
        optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
        | torch.optim.Optimizer,
        mode: str = "sync",
        per_parameter: bool | None = None,
        eager_updates: bool = True,
        rollback: bool = True,
    ) -> None:
        self.store = store
        self.mode = mode
        self.eager_updates = eager_updates
        self.rollback = rollback
        masters = store.masters()
        built = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(masters)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch optimizer")
        self.optimizer = built
        self._check_params(masters)
        self.per_parameter = self._check_kind(per_parameter)
        self.groups = self._make_groups()
        self._stage_groups: dict[int, tuple[int, ...]] = {}
        for s, stage in enumerate(store.stages):
            slots = set(stage.layout.slots)
            self._stage_groups[s] = tuple(
                g.index for g in self.groups if slots.intersection(g.slots)
            )
        # Every stage that produces gradients, whether or not this driver's groups hold its
        # parameters (sharded masters: a rank updates only the groups it owns).
        self._grad_stages = frozenset().union(
            *(frozenset(s.grad_stages) for s in store.trainable_slots))
        self.step = 0  # the next step to begin, or the open one
        # Async updates shifted into the next step (use_pending): step k's OPTs apply the
        # gradients of step k-1, kept in the store's pending buffer until then.
        self.shifted = False
        self._pending: _Pending | None = None
        self._open: _StepState | None = None
        self._steps: dict[int, _StepState] = {}
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: OptimizerError | None = None
        # Called with k when update k's failure is taken (take_failure): state kept outside
        # the driver (the loss scaler) goes back to before step k too.
        self.undo_hooks: list[Callable[[int], None]] = []
        # Sharded masters (rpcompile.runtime.distributed): called by refresh(stage) once this
        # rank's own shadows of the stage are rewritten, to bring the other ranks' shadows of it.
        self.shadow_gather: Callable[[int, set[int]], None] | None = None
        # Started by the first task (the thread protocol); the schedule's OPT and SHADOW
        # actions run on the executor's host queue and never start it.
        self._thread = threading.Thread(target=self._main, name="rpcompile-optimizer", daemon=True)
        self._start_lock = threading.Lock()

    # -- construction checks -------------------------------------------------------------
    def _check_params(self, masters: list[torch.nn.Parameter]) -> None:
        known = {id(p) for p in masters}
        used = [p for g in self.optimizer.param_groups for p in g["params"]]
        foreign = [p for p in used if id(p) not in known]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} tensors that are not the store's masters; "
                "build it over store.masters() (pass a factory: lambda params: ...)"
            )
        missing = len(known) - len({id(p) for p in used})
        if missing:
            warnings.warn(
                f"{missing} trainable masters are not in the optimizer and will never change; "
                "freeze them (requires_grad=False) if that is intended",
                RuntimeWarning,
                stacklevel=3,
            )

    def _check_kind(self, per_parameter: bool | None) -> bool:
        if isinstance(self.optimizer, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS couples all parameters (one line search over all of them) and needs a "
                "closure that re-runs the model; rpcompile cannot drive it. Use a per-parameter "
                "optimizer such as AdamW or SGD."
            )
        if per_parameter is not None:
            return per_parameter
        if isinstance(self.optimizer, _PER_PARAMETER):
            return True
        warnings.warn(
            f"{type(self.optimizer).__name__} is not known to update each parameter from its own "
            "gradient alone; it will be stepped once over all parameters after every gradient "
            "is home (no overlap). Pass per_parameter=True if it is per-parameter.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def _make_groups(self) -> tuple[UpdateGroup, ...]:
        trainable = self.store.owned_slots
        if not self.per_parameter:
            stages = frozenset().union(*(frozenset(s.grad_stages) for s in trainable))
            return (UpdateGroup(0, tuple(s.index for s in trainable), stages, "all parameters"),)
        by_stages: dict[frozenset[int], list[int]] = {}
        for slot in trainable:
            by_stages.setdefault(frozenset(slot.grad_stages), []).append(slot.index)
        groups = []
        for i, (stages, slots) in enumerate(by_stages.items()):
            first = self.store.slots[slots[0]].name
            label = f"stages {sorted(stages)}: {len(slots)} parameters from {first!r}"
            groups.append(UpdateGroup(i, tuple(slots), stages, label))
        return tuple(groups)

    # -- the step protocol ---------------------------------------------------------------
    def begin_step(self) -> int:
        """Open the next step; returns its index. Raises an earlier update's error (once; the
        step counter is then back at the failed update's step)."""
        error = self.take_failure()
        if error is not None:
            raise error
        with self._lock:
            if self._open is not None:
                raise RuntimeError(f"step {self._open.step} is still open; call finish_step()")
            state = _StepState(self.step, len(self.groups), self._snapshot_hyperparams())
            self._steps[self.step] = state
            for old in [k for k in self._steps if k < self.step - 1]:
                del self._steps[old]
            self._open = state
            return self.step

    def shadow_event(self, stage: int, step: int | None = None) -> Event:
        """Set when ``stage``'s shadow holds the weights step ``step`` (default: the open step,
        or the next one) computes with; wait for it before uploading that stage."""
        k = self.step if step is None else step
        if k == 0:
            ready = Event("initial shadow")
            ready.set()
            return ready
        previous = self._steps.get(k - 1)
        if previous is None:
            raise ValueError(
                f"no update {k - 1} is known (steps {sorted(self._steps)}); shadow events are "
                "kept for the open step and the one before it"
            )
        if self.mode == "async":
            return previous.refreshed
        return Event.all_of(
            [previous.group_done[g] for g in self._stage_groups[stage]],
            f"stage {stage} shadow for step {k}",
        )

    def wait_shadow(self, timeout: float | None = None) -> None:
        """Block until every stage's shadow is ready for the open (or next) step."""
        for stage in range(len(self.store.stages)):
            self.shadow_event(stage).wait(timeout, abort=self._failed)
        error = self.take_failure()
        if error is not None:
            raise error

    def accumulate_grad(
        self, stage: int, flat_grad: torch.Tensor, timeout: float | None = None
    ) -> None:
        """Add one job's gradient (the stage's ``grad_segments`` layout, fp32) into the
        masters' gradients, once the previous update has consumed them."""
        state = self._require_open()
        if not self._is_grad_stage(stage):
            return
        if stage in state.done_stages:
            raise RuntimeError(f"stage {stage} already reported done in step {state.step}")
        previous = self._steps.get(state.step - 1)
        if previous is not None:
            for g in self._stage_groups[stage]:
                previous.group_done[g].wait(timeout, abort=self._failed)
        self.store.accumulate_grad(stage, flat_grad)

    def stage_done(self, stage: int) -> None:
        """All of this step's gradients from ``stage`` are home."""
        state = self._require_open()
        if not self._is_grad_stage(stage):
            return
        with self._lock:
            state.done_stages.add(stage)
            if self.mode == "sync" and self.eager_updates:
                self._schedule_ready(state)

    def finish_step(self) -> Event:
        """Close the open step and queue what is left of its update; returns an event set when
        the update is complete (masters written, gradients zeroed)."""
        state = self._require_open()
        missing = self._grad_stages - state.done_stages
        if missing:
            raise RuntimeError(
                f"step {state.step}: gradient stages {sorted(missing)} never called stage_done()"
            )
        with self._lock:
            if self.mode == "async":
                # Before update k changes the masters (w_k -> w_{k+1}), write them into the
                # shadow: step k+1 computes with w_k. Update k-1 is done by then (one thread).
                self._put((lambda: self._refresh_before_update(state),
                                 f"shadow refresh before update {state.step}",
                                 [state.refreshed], state))
            self._schedule_ready(state)
            self._open = None
            self.step += 1
        # The step is taken, even if its update still runs: tell an LR scheduler so (the flag
        # its step() wrapper would set), or it warns that it stepped before the optimizer.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return Event.all_of(state.group_done, f"update {state.step}")

    # -- the schedule's host actions (both modes) ------------------------------------------
    def use_pending(self) -> None:
        """Async mode, as the lowered schedule runs it: step k's OPTs apply step k-1's
        gradients, held in a second gradient buffer (``HostStore.add_pending``, 4 bytes per
        trainable parameter) from step k-1's commit until they are applied (a later step's
        OPTs, or :meth:`flush`). A failed or skipped step leaves them pending."""
        if self.mode != "async":
            raise ValueError("pending gradients are async mode's (sync updates apply the "
                             "step's own gradients)")
        self.store.add_pending()
        self.shifted = True

    @property
    def pending_step(self) -> int | None:
        """The step whose gradients are pending (applied by the next step's OPTs), if any."""
        return None if self._pending is None else self._pending.step

    def flush(self) -> bool:
        """Apply the pending gradients now (async), with the hyperparameters of the step
        that computed them, as the next step's OPTs would; the shadow is left as it is (the
        next step computes with the shadow its predecessor wrote, so the trajectory is the
        same whether or not a flush came between: the next step's OPTs then find nothing
        pending). Returns whether there was anything to apply. A failure is undone (the
        gradients stay pending) and raised as :class:`OptimizerError`."""
        pending = self._pending
        if pending is None:
            return False
        if self._open is not None:
            raise RuntimeError(f"flush() inside the open step {self._open.step}")
        state = _StepState(pending.step, len(self.groups), pending.hyperparams)
        try:
            for group in self.groups:
                self._apply(group, state, refresh=False, hyperparams=pending.hyperparams,
                            pending=True)
        except BaseException as exc:
            if self.rollback:
                self._undo(state)
            raise OptimizerError(
                f"applying the pending gradients of step {pending.step} failed: "
                f"{type(exc).__name__}: {exc}; " + (
                    "undone, they stay pending" if self.rollback else
                    "rollback=False: the masters are half-updated")) from exc
        self._pending = None
        return True

    def update(self, stage: int) -> bool:
        """``OPT``: all of this step's gradients from ``stage`` are home; update, now and on the
        calling thread, every group whose gradient stages are all done (async mode: the
        gradients were computed at the shadow's weights, one step stale). What the update
        changes (masters, optimizer state) is saved first and kept until :meth:`commit_step`
        (or put back by :meth:`discard_step`), so an update the schedule runs while later
        backward jobs still compute leaves the masters as they were if the step fails.

        Async (:meth:`use_pending`): the gradients applied are step k-1's, pending, with
        that step's hyperparameters; a group is applied at the OPT of its last gradient
        stage in this step's OPT order. Returns False when nothing was pending (the run's
        first step, or after a :meth:`flush`): the OPT then changes nothing. An async driver
        must have called :meth:`use_pending` first: without it this would apply the step's
        own gradients (sync semantics), so it is refused."""
        if self.mode == "async" and not self.shifted:
            raise RuntimeError(
                "OptimizerDriver.update() in async mode applies the previous step's gradients, "
                "which needs driver.use_pending() once before the first step (the executor "
                "calls it for an async schedule); without it the update would apply this "
                "step's own gradients, which is sync mode: call use_pending(), or build the "
                "driver with mode='sync'")
        state = self._require_open()
        if not self._is_grad_stage(stage):
            return False
        with self._lock:
            state.opt_stages.add(stage)
            if not self.shifted:
                state.done_stages.add(stage)
            ready = [g for g in self.groups
                     if not state.scheduled[g.index] and g.stages <= state.opt_stages]
            for g in ready:
                state.scheduled[g.index] = True
        pending = self._pending
        if self.shifted and pending is None:
            return False
        hyperparams = pending.hyperparams if self.shifted else state.hyperparams
        for group in ready:
            try:
                self._apply(group, state, refresh=False, hyperparams=hyperparams,
                            pending=self.shifted)
            except BaseException as exc:
                state.failed = True
                error = OptimizerError(f"update {state.step}, group {group.label} failed: "
                                       f"{type(exc).__name__}: {exc}")
                error.step = state.step  # type: ignore[attr-defined]
                error.label = group.label  # type: ignore[attr-defined]
                error.rolled_back = self.rollback  # type: ignore[attr-defined]
                raise error from exc
        return True

    def refresh(self, stage: int) -> None:
        """``SHADOW``: rewrite ``stage``'s shadow (what its UP reads) from the masters, saving
        the old values first (undone by :meth:`discard_step`, like the updates). In async mode
        the schedule runs it before the step's first update, so it copies ``w_k``."""
        state = self._require_open()
        if self.rollback:
            journal = state.journal = state.journal or _Journal()
            for index in self.store.stages[stage].layout.slots:
                slot = self.store.slots[index]
                if slot.trainable and index not in journal.shadows:
                    journal.shadows[index] = self.store.shadow_of(slot.name).clone()
        self.store.refresh_shadow(stage)
        if self.shadow_gather is not None:
            self.shadow_gather(stage, set(state.opt_stages))

    def commit_step(self) -> Event:
        """End a step whose OPT and SHADOW actions all ran: the saved copies are dropped
        (the update is kept) and the step counter advances; async (:meth:`use_pending`): the
        step's gradients become the pending ones (the store's two gradient buffers trade
        places). Returns the (set) update event."""
        state = self._require_open()
        missing = self._grad_stages - state.opt_stages
        if missing:
            raise RuntimeError(f"step {state.step}: the schedule ran no OPT of gradient stages "
                               f"{sorted(missing)}")
        with _interrupts_held(), self._lock:  # no Ctrl-C between the swap and its record
            if self.shifted:
                self.store.swap_pending()
                self._pending = _Pending(state.step, state.hyperparams)
            state.journal = None
            self._open = None
            self.step += 1
            for event in [*state.group_done, state.refreshed]:
                event.set()
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return Event.all_of(state.group_done, f"update {state.step}")

    def discard_step(self) -> None:
        """Abandon the open step after a failure: zero its gradients, keep the masters.

        Raises if some group was already updated in this step (sync with eager updates); use
        ``eager_updates=False`` where a failed step must leave the masters untouched."""
        state = self._require_open()
        updated = [self.groups[g].label for g, s in enumerate(state.scheduled) if s]
        self._drain()  # an earlier update's failure stays pending for take_failure()
        undone = state.journal is not None  # this step's updates and refreshes, saved
        if undone:
            self._undo(state)
        self.store.zero_grads()
        with self._lock:
            self._open = None
            del self._steps[state.step]
        if updated and state.applied and not undone:
            raise RuntimeError(
                f"step {state.step} was discarded, but groups {updated} had already been "
                "updated (eager updates); the masters are not at their pre-step values"
            )

    def _is_grad_stage(self, stage: int) -> bool:
        """True for a stage whose gradients count; False for one without trainable parameters
        (a backward stage of frozen layers: its calls are no-ops); raises for any other."""
        if not 0 <= stage < len(self.store.stages):
            raise IndexError(f"stage {stage} out of range: the store has {len(self.store.stages)}")
        if stage in self._grad_stages:
            return True
        if self.store.stages[stage].layout.grad_numel == 0:
            return False
        raise ValueError(
            f"stage {stage} has trainable parameters but is not a gradient stage of the store; "
            "build the store with grad_stages including it"
        )

    def _require_open(self) -> _StepState:
        state = self._open
        if state is None:
            raise RuntimeError("no step is open; call begin_step() first")
        return state

    def _schedule_ready(self, state: _StepState) -> None:
        """Queue the update of every group whose gradient stages are all done (lock held)."""
        for group in self.groups:
            if not state.scheduled[group.index] and group.stages <= state.done_stages:
                state.scheduled[group.index] = True
                self._put((
                    lambda group=group: self._update(group, state),
                    f"update {state.step}, group {group.label}",
                    [state.group_done[group.index]],
                    state,
                ))

    # -- the optimizer thread ------------------------------------------------------------
    def _update(self, group: UpdateGroup, state: _StepState) -> None:
        self._apply(group, state, refresh=self.mode == "sync")

    def _apply(self, group: UpdateGroup, state: _StepState, refresh: bool,
               hyperparams: list[dict[str, Any]] | None = None, pending: bool = False) -> None:
        """Step ``group`` with ``hyperparams`` (default: the state's) from the gradient
        buffer, or the pending one (which stays as it is until the step commits: a failed
        step leaves it for the retry)."""
        if self.rollback:
            self._save(state, group.slots, shadows=refresh)
        self.store.attach_grads(group.slots, pending=pending)
        optimizer = self.optimizer
        hyperparams = state.hyperparams if hyperparams is None else hyperparams
        if hyperparams:
            # A shallow twin whose groups carry the step's hyperparameters, sharing params and
            # state: the user's param_groups may be changing under an LR scheduler meanwhile.
            optimizer = object.__new__(type(self.optimizer))
            optimizer.__dict__.update(self.optimizer.__dict__)
            optimizer.param_groups = [
                {**g, **hp} for g, hp in zip(self.optimizer.param_groups, hyperparams)
            ]
        # Call the class's step on the twin: an LR scheduler replaces the *instance's* step
        # with a wrapper bound to the original optimizer, which would bypass the twin. Never
        # while a capture traces: torch.optim reads torch's process-global tracing flags.
        with outside_tracing():
            type(self.optimizer).step(optimizer)
        if not pending:
            self.store.zero_grads(group.slots)
        state.applied += 1
        if not refresh:
            return  # the schedule's SHADOW actions refresh; commit_step drops the journal
        # (On the optimizer thread, _run_task drops the journal once the update is announced.)
        self.store.refresh_slots(group.slots)

    def _refresh_before_update(self, state: _StepState) -> None:
        if self.rollback:
            journal = state.journal = state.journal or _Journal()
            for slot in self.store.trainable_slots:
                journal.shadows[slot.index] = self.store.shadow_of(slot.name).clone()
        self.store.refresh_shadow()

    def _save(self, state: _StepState, slots: tuple[int, ...], shadows: bool) -> None:
        """Save what updating ``slots`` changes, before it changes (the optimizer thread)."""
        journal = state.journal = state.journal or _Journal()
        params = self.store.masters()
        position = {s.index: i for i, s in enumerate(self.store.owned_slots)}
        for index in slots:
            name = self.store.slots[index].name
            journal.masters[index] = self.store.master_of(name).clone()
            if shadows:
                journal.shadows[index] = self.store.shadow_of(name).clone()
            param = params[position[index]]
            saved = self.optimizer.state.get(param)
            journal.state.append((param, None if saved is None else {
                k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in saved.items()}))

    def _undo(self, state: _StepState) -> None:
        """Put back what update ``state.step`` changed (the optimizer thread, after it failed)."""
        journal, state.journal = state.journal, None
        with torch.no_grad():
            if journal is not None:
                for index, value in journal.masters.items():
                    self.store.master_of(self.store.slots[index].name).copy_(value)
                for param, saved in reversed(journal.state):
                    if saved is None:
                        self.optimizer.state.pop(param, None)
                    else:
                        self.optimizer.state[param] = saved
                for index, value in journal.shadows.items():
                    self.store.shadow_of(self.store.slots[index].name).copy_(value)
            self.store.zero_grads()

    def _snapshot_hyperparams(self) -> list[dict[str, Any]]:
        return [
            {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v))
             for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]

    def _put(self, task: Any) -> None:
        """Queue a task for the optimizer thread, starting the thread with the first one."""
        self._tasks.put(task)
        with self._start_lock:  # (callers may hold self._lock)
            if self._thread.ident is None:
                self._thread.start()

    def _main(self) -> None:
        while True:
            task = None
            try:
                task = self._tasks.get()
                if task is None:
                    return
                self._run_task(task)
            except BaseException as exc:
                # Escaped the task's own handling (an exception raised into this thread between
                # bytecodes, say): the thread lives on and the task fails like an update would.
                if task is not None:
                    self._task_failed(task, exc)

    def _run_task(self, task: Any) -> None:
        fn, label, produces, owner = task
        pending = self._error
        if pending is not None or (owner is not None and owner.failed):
            reason = pending or OptimizerError(f"{label} dropped: update {owner.step} failed")
            for event in produces:
                event.fail(reason)
            return
        try:
            fn()
        except BaseException as exc:
            self._task_failed(task, exc)
            return
        for event in produces:
            event.set()
        if owner is not None and owner.applied == len(self.groups):
            owner.journal = None  # update complete and announced: nothing left to undo

    def _task_failed(self, task: Any, exc: BaseException) -> None:
        _, label, produces, owner = task
        error = OptimizerError(f"optimizer thread: {label} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        error.traceback_text = "".join(traceback.format_exception(exc))  # type: ignore[attr-defined]
        error.step = None if owner is None else owner.step  # type: ignore[attr-defined]
        error.label = label  # type: ignore[attr-defined]
        error.rolled_back = False  # type: ignore[attr-defined]
        if owner is not None:
            owner.failed = True
            if self.rollback:
                try:
                    self._undo(owner)
                    error.rolled_back = True  # type: ignore[attr-defined]
                except BaseException as undo_exc:  # reported with the error itself
                    error.add_note(f"undoing the update failed too: {undo_exc!r}")
        self._error = error
        for event in produces:
            event.fail(error)

    def _failed(self) -> bool:
        return self._error is not None

    def check(self) -> None:
        """Raise the optimizer thread's pending error, if it had one (without taking it)."""
        if self._error is not None:
            raise self._error

    @property
    def failure(self) -> OptimizerError | None:
        """The failed update not yet taken by :meth:`take_failure`, if any."""
        return self._error

    def take_failure(self, timeout: float | None = None) -> OptimizerError | None:
        """Return (once) the error of a failed update, after settling its aftermath: the
        thread has finished dropping the failed update's tasks, the open step (if any) is
        discarded, and the step counter is back at the failed update's step (whose masters,
        optimizer state and shadow the thread restored). None when nothing failed."""
        if self._error is None:
            return None
        self._drain(timeout)
        with self._lock:
            error, self._error = self._error, None
            if error is None:
                return None
            failed = getattr(error, "step", None)
            self._open = None
            if failed is not None:
                self.step = failed
                for k in [k for k in self._steps if k >= failed]:
                    del self._steps[k]
                if failed > 0 and failed - 1 not in self._steps:
                    self._steps[failed - 1] = _completed_state(failed - 1, len(self.groups))
        self.store.zero_grads()
        if failed is not None:
            for hook in self.undo_hooks:
                hook(failed)
        return error

    def _drain(self, timeout: float | None = None) -> bool:
        """Wait until the thread has handled every queued task; never raises. False when it
        is still busy after ``timeout`` (a user ``step()`` that never returns)."""
        if not self._thread.is_alive():
            return True
        marker = Event("optimizer idle")
        self._put((lambda: None, "idle marker", [marker], None))
        try:
            marker.wait(timeout)
        except EventTimeout:
            return False
        except UpstreamFailed:
            pass
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued update and refresh has run; raise a failed update's
        error (once, see :meth:`take_failure`) or :class:`EventTimeout`."""
        if not self._drain(timeout):
            raise EventTimeout(f"the optimizer thread is still busy after {timeout} s "
                               "(a user optimizer step() that does not return?)")
        error = self.take_failure()
        if error is not None:
            raise error

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued work and stop the optimizer thread; never raises."""
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join(timeout)

    # -- checkpoints and accounting ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Masters (by name), optimizer state, step counter and mode, taken once the queued
        updates have finished. In async mode also the trainable shadows: the next step
        computes with them (``w_k``), not with the masters (``w_{k+1}``)."""
        if self._open is not None:
            raise RuntimeError("state_dict() inside an open step; call it between steps")
        if self._pending is not None:
            raise RuntimeError(f"the gradients of step {self._pending.step} are pending; "
                               "flush() them first (Trainer.state_dict does)")
        self.wait()
        state: dict[str, Any] = {
            "masters": self.store.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "mode": self.mode,
        }
        if self.mode == "async":
            state["shadow"] = {
                s.name: self.store.shadow_of(s.name).clone() for s in self.store.trainable_slots
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: masters (and their shadows), optimizer state, step."""
        if state["mode"] != self.mode:
            raise ValueError(f"state was saved in {state['mode']} mode, this driver is {self.mode}")
        if self._open is not None:
            raise RuntimeError("load_state_dict() inside an open step")
        self.wait()
        # The optimizer first: torch checks its groups before it changes anything, so a bad
        # state fails before the masters are touched.
        self.optimizer.load_state_dict(state["optimizer"])
        self.store.load_state_dict(state["masters"])
        self.store.zero_grads()
        self._pending = None  # a state is saved flushed (state_dict)
        self.step = int(state["step"])
        self._steps.clear()
        if self.step > 0:
            # Updates before the checkpoint are complete, and its shadow is in place.
            self._steps[self.step - 1] = _completed_state(self.step - 1, len(self.groups))
        if self.mode == "async":
            with torch.no_grad():
                for name, value in state["shadow"].items():
                    self.store.shadow_of(name).copy_(value)

    def memory_report(self) -> MemoryReport:
        return self.store.memory_report(self.optimizer)


def _completed_state(step: int, groups: int) -> _StepState:
    """A step whose update is complete and whose shadow is in place (events all set)."""
    done = _StepState(step, groups, [])
    for event in [*done.group_done, done.refreshed]:
        event.set()
    return done


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs (the main thread, POSIX), delivered
    as soon as it ends: a ``KeyboardInterrupt`` between the gradient buffers' swap and the
    record of which step they hold would leave the pending gradients named for the wrong
    step. Elsewhere (another thread, Windows) signals never interrupt the block's thread
    anyway, or cannot be held, and the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "pthread_sigmask")):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)

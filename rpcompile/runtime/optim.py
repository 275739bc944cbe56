"""The host optimizer driver: the implementation of the lowered schedule's host actions.

The schedule is the protocol (docs/runtime.md, section 5); this module only carries out its
``ACC``, ``OPT`` and ``SHADOW`` actions, and closes each step (commit or discard), for any
``torch.optim`` optimizer over a :class:`HostStore`'s fp32 masters, in ``sync`` or ``async``
mode. It has no thread, no queue, no event and no order of its own: every call does its work
at once, on the caller's thread (the executor's host queue), where the schedule put it.

**The actions.** ``begin_step()``; per job ``accumulate_grad(stage, flat)`` (``ACC``: adds the
job's fp32 gradient; gradients must already be those of the loss averaged over the whole step,
each microbatch's loss scaled by ``1 / (microbatches per round x rounds)`` before its
backward: the driver never divides); ``update(stage)`` (``OPT``); ``refresh(stage)``
(``SHADOW``: rewrites the stage's shadow from the masters); ``commit_step()`` when the step
completed, ``discard_step()`` when it failed. Async: ``use_pending()`` once, and ``flush()``
between steps (the Trainer's, before the masters are read).

**Groups.** Trainable parameters are grouped by the set of stages that produce their gradients
(``ParamSlot.grad_stages``; a tied embedding/LM-head weight has two). ``update(stage)`` steps
every group whose gradient stages' OPTs of the step have all run: the user's optimizer is
called with ``.grad`` set on that group's masters and None on all others, which every
per-parameter torch optimizer (SGD, Adam, AdamW, ... : each parameter's update reads only its
own gradient and state) skips. So stepping group by group gives results bit-identical to one
``optimizer.step()`` over all parameters. Optimizers that couple parameters cannot be split:
LBFGS is refused; an optimizer class not known to be per-parameter gets a warning and is
stepped once over everything at the step's last OPT (pass ``per_parameter=True`` to assert
that it is per-parameter).

**Modes.** With ``w_k`` the masters before update ``k`` and ``g_k(w)`` step ``k``'s gradient
computed at weights ``w``:

- ``sync``: ``w_{k+1} = U(w_k, g_k(w_k))``, ordinary training. Step ``k``'s OPTs apply its own
  gradients, where the lowering put them (overlapping the later backward jobs, or after the
  step's last gradient); its SHADOWs then copy ``w_{k+1}`` for step ``k+1``.
- ``async``: ``w_{k+1} = U(w_k, g_k(w_{k-1}))`` with ``w_{-1} = w_0``: one step stale, like
  RoundPipe. Step ``k``'s OPTs apply step ``k-1``'s gradients, which ``commit_step`` of step
  ``k-1`` left in the store's pending buffer (the two gradient buffers trade places), with step
  ``k-1``'s hyperparameters; ``discard_step`` leaves them pending, ``flush()`` applies them
  between steps. Its SHADOWs write the second copy of the shadow (``HostStore
  .add_shadow_pair``), which step ``k+1`` reads while step ``k``'s own uploads still read the
  first: the steps overlap. A skipped step (``commit_step(skipped=True)``) drops its own
  gradients and keeps the rest.

Hyperparameters (``param_groups`` entries: lr, betas, ...) are snapshotted at ``begin_step``:
update ``k`` uses what was set when step ``k`` began, even if an LR scheduler changes them
before it runs (async: in the next step, or a flush).

**Failure atomicity.** Before an OPT changes a group the driver saves what the update will
change (the group's masters and their optimizer state), and before a sync SHADOW the shadow it
overwrites (an async one writes the copy no committed step reads): the step's journal, kept
until ``commit_step`` drops it. An exception in an update
(the user's ``step()`` at any group) raises from ``update`` as an :class:`OptimizerError`
(``.step``, ``.label``, ``.rolled_back``), once, where the OPT ran; ``discard_step`` then puts
every saved value back and zeroes the step's gradients, so the step never happened: masters,
optimizer state, shadows and the step counter are as before it (async: the pending gradients
stay pending for the retry). The journal holds at most the trainable masters, their optimizer
state and shadow (16 bytes per trainable parameter for AdamW with an fp32 shadow, 14 with a
bf16 one) until the step ends; ``rollback=False`` does without it, and a failed step then
leaves the masters half-updated (``discard_step`` says so).
"""

from __future__ import annotations

import copy
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.capture.tracing import outside_tracing
from rpcompile.errors import InvalidInput, InvalidType, StateError
from rpcompile.runtime.errors import OptimizerError
from rpcompile.runtime.memory import HostStore, MemoryReport

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
    """Parameters updated together: at the OPT that completes ``stages`` in a step."""

    index: int
    slots: tuple[int, ...]
    stages: frozenset[int]
    label: str


class _Journal:
    """What the open step's OPTs and SHADOWs are about to change, saved before they change it
    (see the module doc): master copies and shadow copies by slot, optimizer state by
    parameter (None: the parameter had no state yet)."""

    def __init__(self) -> None:
        self.masters: dict[int, torch.Tensor] = {}
        self.shadows: dict[int, torch.Tensor] = {}
        self.state: list[tuple[torch.Tensor, dict[str, Any] | None]] = []


class _StepState:
    """The open step: its index, the hyperparameters its updates use, the stages whose OPT
    ran, the groups whose update came due, how many were applied, and the journal."""

    def __init__(self, step: int, groups: int, hyperparams: list[dict[str, Any]]) -> None:
        self.step = step
        self.hyperparams = hyperparams
        self.opt_stages: set[int] = set()
        self.due = [False] * groups
        self.applied = 0
        self.journal: _Journal | None = None


@dataclass(frozen=True)
class _Pending:
    """Gradients of a completed async step not applied yet (the store's pending buffer), and
    the hyperparameters of that step, which their update uses."""

    step: int
    hyperparams: list[dict[str, Any]]


class OptimizerDriver:
    """Carries out a schedule's host actions over a :class:`HostStore`'s masters (see the
    module doc).

    ``optimizer`` is a factory ``params -> torch.optim.Optimizer`` called with
    ``store.masters()`` (e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)``), or an
    optimizer already built over those same tensors. ``rollback`` (default True) keeps the
    journal that lets a failed step be discarded without a trace.
    """

    def __init__(
        self,
        store: HostStore,
        optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
        | torch.optim.Optimizer,
        mode: str = "sync",
        per_parameter: bool | None = None,
        rollback: bool = True,
    ) -> None:
        self.store = store
        self.mode = mode
        self.rollback = rollback
        masters = store.masters()
        built = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(masters)
        if not isinstance(built, torch.optim.Optimizer):
            raise InvalidType(f"the optimizer factory returned {type(built).__name__}, not a torch optimizer")
        self.optimizer = built
        self._check_params(masters)
        self.per_parameter = self._check_kind(per_parameter)
        self.groups = self._make_groups()
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
        # Sharded masters (rpcompile.runtime.distributed): called by refresh(stage) once this
        # rank's own shadows of the stage are rewritten, to bring the other ranks' shadows of it.
        self.shadow_gather: Callable[[int, set[int]], None] | None = None

    # -- construction checks -------------------------------------------------------------
    def _check_params(self, masters: list[torch.nn.Parameter]) -> None:
        known = {id(p) for p in masters}
        used = [p for g in self.optimizer.param_groups for p in g["params"]]
        foreign = [p for p in used if id(p) not in known]
        if foreign:
            raise InvalidInput(
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
            raise InvalidInput(
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
            "gradient alone; it will be stepped once over all parameters at the step's last "
            "OPT, once every gradient is home (no overlap). Pass per_parameter=True if it is "
            "per-parameter.",
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

    # -- the schedule's actions --------------------------------------------------------------
    def begin_step(self) -> int:
        """Open the next step (its hyperparameters snapshotted); returns its index."""
        if self._open is not None:
            raise StateError(f"step {self._open.step} is still open; close it with "
                               "commit_step() or discard_step()")
        self._open = _StepState(self.step, len(self.groups), self._snapshot_hyperparams())
        return self.step

    def use_pending(self) -> None:
        """Async mode, as the lowered schedule runs it: step k's OPTs apply step k-1's
        gradients, held in a second gradient buffer (``HostStore.add_pending``, 4 bytes per
        trainable parameter) from step k-1's commit until they are applied (a later step's
        OPTs, or :meth:`flush`). A failed or skipped step leaves them pending."""
        if self.mode != "async":
            raise InvalidInput("pending gradients are async mode's (sync updates apply the "
                             "step's own gradients)")
        self.store.add_pending()
        self.shifted = True

    @property
    def pending_step(self) -> int | None:
        """The step whose gradients are pending (applied by the next step's OPTs), if any."""
        return None if self._pending is None else self._pending.step

    def accumulate_grad(self, stage: int, flat_grad: torch.Tensor) -> None:
        """``ACC``: add one job's gradient (the stage's ``grad_segments`` layout, fp32) into the
        masters' gradients (async: the buffer that becomes pending at the commit)."""
        state = self._require_open()
        if not self._is_grad_stage(stage):
            return
        if not self.shifted and stage in state.opt_stages:
            raise StateError(
                f"step {state.step}: a gradient of stage {stage} arrived after its OPT, whose "
                "update has already consumed the stage's gradients (an ACC after its OPT: the "
                "schedule orders every ACC of a stage before its OPT)")
        self.store.accumulate_grad(stage, flat_grad)

    def update(self, stage: int) -> bool:
        """``OPT``: all of this step's gradients from ``stage`` are home; update, now and on the
        calling thread, every group whose gradient stages' OPTs have all run in this step.
        What the update changes (masters, optimizer state) is saved first and kept until
        :meth:`commit_step` (or put back by :meth:`discard_step`), so an update the schedule
        runs while later backward jobs still compute leaves the masters as they were if the
        step fails. A failing update raises :class:`OptimizerError`.

        Async (:meth:`use_pending`): the gradients applied are step k-1's, pending, with
        that step's hyperparameters; a group is applied at the OPT of its last gradient
        stage in this step's OPT order. Returns False when nothing was pending (the run's
        first step, or after a :meth:`flush`): the OPT then changes nothing. An async driver
        must have called :meth:`use_pending` first: without it this would apply the step's
        own gradients (sync semantics), so it is refused."""
        if self.mode == "async" and not self.shifted:
            raise StateError(
                "OptimizerDriver.update() in async mode applies the previous step's gradients, "
                "which needs driver.use_pending() once before the first step (the executor "
                "calls it for an async schedule); without it the update would apply this "
                "step's own gradients, which is sync mode: call use_pending(), or build the "
                "driver with mode='sync'")
        state = self._require_open()
        if not self._is_grad_stage(stage):
            return False
        state.opt_stages.add(stage)
        ready = [g for g in self.groups if not state.due[g.index] and g.stages <= state.opt_stages]
        for g in ready:
            state.due[g.index] = True
        pending = self._pending
        if self.shifted and pending is None:
            return False
        hyperparams = pending.hyperparams if self.shifted else state.hyperparams
        for group in ready:
            try:
                self._apply(group, state, hyperparams, pending=self.shifted)
            except BaseException as exc:
                error = OptimizerError(f"update {state.step}, group {group.label} failed: "
                                       f"{type(exc).__name__}: {exc}")
                error.step = state.step  # type: ignore[attr-defined]
                error.label = group.label  # type: ignore[attr-defined]
                error.rolled_back = self.rollback  # type: ignore[attr-defined]
                raise error from exc
        return True

    def refresh(self, stage: int, version: int | None = None) -> None:
        """``SHADOW``: rewrite ``stage``'s shadow (what its UP reads) from the masters. The
        schedule runs it after the OPTs over the stage's parameters: sync, it copies
        ``w_{k+1}`` over the one shadow, saving the old values first (undone by
        :meth:`discard_step`, like the updates); async, whose step-k OPTs applied update k-1,
        ``w_k`` into copy ``version`` of the shadow pair (``HostStore.add_shadow_pair``), the
        copy step k+1 reads and no committed step does: nothing to save (a failed step's
        retry writes it again). In both, what step k+1 computes with."""
        state = self._require_open()
        paired = version is not None and self.store.shadow_pair is not None
        if self.rollback and not paired:
            journal = state.journal = state.journal or _Journal()
            for index in self.store.stages[stage].layout.slots:
                slot = self.store.slots[index]
                if slot.trainable and index not in journal.shadows:
                    journal.shadows[index] = self.store.shadow_of(slot.name).clone()
        self.store.refresh_shadow(stage, version)
        if self.shadow_gather is not None:
            self.shadow_gather(stage, set(state.opt_stages))

    def commit_step(self, skipped: bool = False) -> None:
        """End a step whose OPT and SHADOW actions all ran: the journal is dropped (the update
        is kept) and the step counter advances; async (:meth:`use_pending`): the step's
        gradients become the pending ones (the store's two gradient buffers trade places).

        ``skipped`` (async: the step's CHECK found its gradients non-finite): its gradients
        are dropped instead, so the update they would feed (the next step's OPTs) does not
        happen; its own OPTs, which applied the step before's checked gradients, and its
        SHADOWs, which the next step already reads, are kept; the step counter stays, as for
        a skipped sync step (:meth:`discard_step`)."""
        state = self._require_open()
        missing = self._grad_stages - state.opt_stages
        if missing:
            raise StateError(f"step {state.step}: the schedule ran no OPT of gradient stages "
                               f"{sorted(missing)}")
        if skipped and not self.shifted:
            raise InvalidInput("commit_step(skipped=True) is async mode's; a skipped sync step "
                             "is discarded (discard_step)")
        with _interrupts_held():  # no Ctrl-C between the swap and its record
            if skipped:
                self.store.zero_grads()
                self._pending = None
            elif self.shifted:
                self.store.swap_pending()
                self._pending = _Pending(state.step, state.hyperparams)
            state.journal = None
            self._open = None
            if not skipped:
                self.step += 1
        # The step is taken: tell an LR scheduler so (the flag its step() wrapper would set),
        # or it warns that it stepped before the optimizer.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def discard_step(self) -> None:
        """Abandon the open step after a failure: put back what its OPTs and SHADOWs changed
        (the journal), zero its gradients, keep the step counter. Raises when an update was
        applied without a journal (``rollback=False``): the masters are not at their pre-step
        values then."""
        state = self._require_open()
        undone = state.journal is not None
        if undone:
            self._undo(state)
        self.store.zero_grads()
        self._open = None
        if state.applied and not undone:
            updated = [g.label for g in self.groups if state.due[g.index]]
            raise StateError(
                f"step {state.step} was discarded, but groups {updated} had already been "
                "updated without a journal (rollback=False); the masters are not at their "
                "pre-step values")

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
            raise StateError(f"flush() inside the open step {self._open.step}")
        state = _StepState(pending.step, len(self.groups), pending.hyperparams)
        try:
            for group in self.groups:
                self._apply(group, state, pending.hyperparams, pending=True)
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

    # -- helpers -------------------------------------------------------------------------------
    def _is_grad_stage(self, stage: int) -> bool:
        """True for a stage whose gradients count; False for one without trainable parameters
        (a backward stage of frozen layers: its calls are no-ops); raises for any other."""
        if not 0 <= stage < len(self.store.stages):
            raise InvalidInput(f"stage {stage} out of range: the store has {len(self.store.stages)}")
        if stage in self._grad_stages:
            return True
        if self.store.stages[stage].layout.grad_numel == 0:
            return False
        raise InvalidInput(
            f"stage {stage} has trainable parameters but is not a gradient stage of the store; "
            "build the store with grad_stages including it"
        )

    def _require_open(self) -> _StepState:
        state = self._open
        if state is None:
            raise StateError("no step is open; call begin_step() first")
        return state

    def _apply(self, group: UpdateGroup, state: _StepState, hyperparams: list[dict[str, Any]],
               pending: bool = False) -> None:
        """Step ``group`` with ``hyperparams`` from the gradient buffer, or the pending one
        (which stays as it is until the step commits: a failed step leaves it for the
        retry), saving what it changes first (``rollback``)."""
        if self.rollback:
            self._save(state, group.slots)
        self.store.attach_grads(group.slots, pending=pending)
        optimizer = self.optimizer
        if hyperparams:
            # A shallow twin whose groups carry the step's hyperparameters, sharing params and
            # state: the user's param_groups may have changed under an LR scheduler since.
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

    def _save(self, state: _StepState, slots: tuple[int, ...]) -> None:
        """Save what updating ``slots`` changes (masters, optimizer state), before it changes."""
        journal = state.journal = state.journal or _Journal()
        params = self.store.masters()
        position = {s.index: i for i, s in enumerate(self.store.owned_slots)}
        for index in slots:
            journal.masters[index] = self.store.master_of(self.store.slots[index].name).clone()
            param = params[position[index]]
            saved = self.optimizer.state.get(param)
            journal.state.append((param, None if saved is None else {
                k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in saved.items()}))

    def _undo(self, state: _StepState) -> None:
        """Put back what the step's updates and refreshes changed, and zero the gradients."""
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

    # -- checkpoints and accounting ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Masters (by name), optimizer state, step counter and mode, between steps. In async
        mode also the trainable shadows: the next step computes with them (``w_k``), not with
        the masters (``w_{k+1}``)."""
        if self._open is not None:
            raise StateError("state_dict() inside an open step; call it between steps")
        if self._pending is not None:
            raise StateError(f"the gradients of step {self._pending.step} are pending; "
                               "flush() them first (Trainer.state_dict does)")
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
            raise InvalidInput(f"state was saved in {state['mode']} mode, this driver is {self.mode}")
        if self._open is not None:
            raise StateError("load_state_dict() inside an open step")
        # The optimizer first: torch checks its groups before it changes anything, so a bad
        # state fails before the masters are touched.
        self.optimizer.load_state_dict(state["optimizer"])
        self.store.load_state_dict(state["masters"])
        self.store.zero_grads()
        self._pending = None  # a state is saved flushed (state_dict)
        self.step = int(state["step"])
        if self.mode == "async":
            with torch.no_grad():
                for name, value in state["shadow"].items():
                    self.store.shadow_of(name).copy_(value)

    def memory_report(self) -> MemoryReport:
        return self.store.memory_report(self.optimizer)


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

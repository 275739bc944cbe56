"""The executor: runs one step of a lowered RoundPipe :class:`~rpcompile.ir.Schedule` on workers.

Every action of the schedule becomes one item on its worker's stream (compute, weight_upload,
activation_upload, download), on the host queue, which the calling thread runs itself, or on
the host's network lane (data parallel's REDUCE actions), which one thread of its own runs. An
item first waits for the actions its edges name (one event per action that is an edge's
source), then does its work, then sets its own event. Nothing else orders work: that is the
schedule's protocol, and chaos mode on the workers shakes out any wait it lacks.

Sections, in reading order:
  1. StepFailed                      - the error a failed step raises in the caller
  2. value bundles                   - which tensors a schedule value (``x8``, ``g8``) carries
  3. _StepPlan                       - per schedule step: queues, waits, readers (built once)
  4. Executor                        - run_step(): submit, run the host queue, drain, clean up
  5. actions                         - UP, EVICT, H2D, D2H, F, T, B, ACC, OPT, SHADOW, REDUCE, CHECK
  6. device memory holds             - activations accounted against the worker's capacity

**Values.** A schedule value names the boundary after a unit, but the stage programs exchange
many named tensors (the hidden state, rotary tables, masks, sizes, a long skip connection).
``x<b>`` carries every tensor produced at units ``<= b`` that a stage starting after ``b``
reads (so shared values travel along the forward chain, as docs/schedule.md says); when it
feeds the tail or a backward stage only, just that stage's inputs. ``g<b>`` carries every value
gradient accumulated so far whose value was produced at or before ``b``, in the same dict the
reference executor threads through the backward stages, so the sums happen in the same order.

**Numerics.** Forward stages run ``graph_module`` under ``no_grad`` like the reference; tail
and backward stages call :func:`rpcompile.runtime.reference.run_backward_microbatch` with the job's
parameter gradients pre-bound to views of one fp32 flat buffer on the worker (zero-filled when
the job starts), so each job's sum is the reference's sum bit for bit. The host adds each job's
buffer into the master gradients (``ACC``) in the schedule's (round, stage) order, which is the
reference's order too.

**Steps and failure.** ``run_step`` runs the actions of one schedule step (``step % steps``;
the trainer builds a schedule whose step count makes the round-robin counter continue across
steps) and returns when every stream has drained: steps run one at a time, which is what the
schedule's ``barrier`` edges say (``rpcompile.passes.lower.add_step_barrier``: step k+1's
first actions wait for step k's last host action, which waits for every other stream's last
action of step k), so the simulator times the same wait, and edges from an earlier step are
satisfied when a step starts. ``ACC``, ``OPT`` and ``SHADOW`` are the optimizer driver's
``accumulate_grad``, ``update`` and ``refresh`` in both modes, run where the schedule puts them
(``add_optimizer(updates=)``: overlapping the step's later backward jobs, or after its last
gradient when clipping, loss scaling, skipping non-finite steps or data parallel must see them
all first; in async mode the step's ``OPT``s come first and apply the previous step's
gradients, pending since its end). The step's gradient check (its loss, the non-finite jobs,
the decision to skip, unscaling and clipping in place) is the schedule's ``CHECK`` action,
right after the step's last ``ACC`` (and, data parallel, every ``REDUCE``), so its wait and its
cost are in the schedule the simulator times. The driver
saves what each update and refresh changes, so
when any item fails, a run-level abort flag makes every other wait give up, every stream
drains, the workers are recovered and device memory freed, the driver puts the step's updates
back and discards its gradients (async: the pending ones stay, for the retry), and
:class:`StepFailed` is raised naming the worker, stream,
stage, microbatch, round and action: masters, optimizer state and shadows are as before the
step, in either mode (an optimizer failure in an ``OPT`` raises as
:meth:`StepFailed.from_update`). One deadline (``timeout_s``, the watchdog) covers a step's host
waits and its drain; past it the step raises :class:`StepTimeout` the same way, and a worker
whose stream is stuck in an item (user code cannot be interrupted) or whose thread died is
replaced by a fresh one, so the next step runs. ``KeyboardInterrupt``/``SystemExit`` abort the
step the same way and re-raise as themselves once it is taken apart; ``abort()`` (the
trainer's ``close()`` from another thread) ends a running step with :class:`StepAborted`.

**Transfers** are copies made by the action itself on its stream (one per contiguous segment
for UP, one per tensor of a value for H2D/D2H; bulk ones, UP and D2H grad, in the action's
``chunks`` pieces, each completed before the next), in the stream's list order;
uploads of weights and of activations run on different stream threads, so a weight upload
never delays an activation on a virtual worker. This is the only transfer path, and the
chunk size is set once, by the lowering (``rpcompile.passes.lower.DEFAULT_CHUNK_BYTES``).

**Device memory** accounted on each worker: the weight slots, the buffers uploaded with them
and each job's fp32 gradient buffer (``Worker.alloc``), plus every activation or value gradient
held between actions, once per storage (``Worker.reserve``). What a D2H sends home is given
back as the compute its ``sent`` or gradient-slot edge names starts
(``Schedule.releases``), else once downloaded: what a worker holds follows the schedule. Transients inside one compute
(autograd's saved tensors) are not accounted; they are freed when the compute returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from rpcompile.capture.batch import split_batch
from rpcompile.ir import Action, ActionKind, Schedule, check_registry
from rpcompile.options import TrainOptions, check_update_order, deferred_reasons
from rpcompile.passes.lower import DATA_PARALLEL_PASSES, LOWERING_PASSES, updates_deferred
from rpcompile.passes.split import StageProgram
from rpcompile.runtime import kernels as _kernels
from rpcompile.runtime.errors import (
    EventTimeout,
    OptimizerError,
    RuntimeFault,
    UpstreamFailed,
    WorkerAborted,
    WorkerError,
)
from rpcompile.runtime.loss_scale import DynamicLossScaler
from rpcompile.runtime.memory import HostStaging, HostStore
from rpcompile.runtime.optim import OptimizerDriver
from rpcompile.runtime.reference import (
    loss_divisor,
    run_backward_microbatch,
    stage_arguments,
    step_loss,
)
from rpcompile.runtime.workers import Event, Worker

__all__ = ["RUNTIME_ACTIONS", "Executor", "StepAborted", "StepFailed", "StepResult",
           "StepTimeout"]

_HOST_VALUES = ("ids", "labels")  # schedule values that live on the host from the start


# ============================================================================================
# 1. StepFailed
# ============================================================================================


class StepFailed(RuntimeFault):
    """A step stopped because an action failed. ``action`` is the failing schedule action,
    ``worker``/``stream`` where it ran (None/"host" for the host queue), ``stage`` its stage
    name (``F2``, ``B1``), ``microbatch``/``round`` as in the action; ``cause`` the original
    exception (also ``__cause__``). ``others`` lists secondary failures (waits that gave up).

    A failure outside any action (the optimizer's update, the watchdog, a stream thread, a
    ``close()`` from another thread) has ``action`` None and ``where`` saying what failed;
    ``step`` is the optimizer step that was undone (the update's step for an optimizer
    failure: its masters, optimizer state and step counter were restored)."""

    def __init__(self, action: Action | None, stage_name: str | None, worker_name: str | None,
                 cause: BaseException, others: Sequence[str] = (), *, where: str = "",
                 step: int | None = None, message: str = "") -> None:
        self.action = action
        self.worker = worker_name
        self.stream = action.stream if action is not None else (where or "host")
        self.stage = stage_name
        self.microbatch = None if action is None else action.microbatch
        self.round = None if action is None else action.round
        self.cause = cause
        self.others = tuple(others)
        self.step = step
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
        if others:
            text += f" Also failed: {', '.join(others)}."
        super().__init__(text)
        self.__cause__ = cause

    @classmethod
    def from_update(cls, error: BaseException) -> StepFailed:
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
                   message=message)




@dataclass(frozen=True)
class StepResult:
    """What one step measured: its loss (a causal LM's token mean over the whole global batch;
    a ``loss_fn`` model's mean over microbatches), the schedule step it ran, wall time, and each
    worker's device-memory peak during the step."""

    loss: torch.Tensor
    schedule_step: int
    seconds: float
    peak_bytes: tuple[int, ...]
    # Device bytes each worker still held once its streams drained, before the executor's
    # clean-up frees them: 0 when every action freed what the schedule says it frees.
    left_over_bytes: tuple[int, ...] = ()
    # Measured (start ms, end ms) of each action's work after its waits, from the step's
    # start: ``schedule.dump("run.json", timeline=result.timeline)`` draws what ran, to set
    # beside the simulator's prediction of the same actions.
    timeline: Mapping[Action, tuple[float, float]] = field(default_factory=dict)
    # Whether any job's fp32 gradient sums held an inf or NaN (the accumulation kernel's
    # fused check), and the (stage name, round) of each such job. ``skipped``: the step's
    # update was not applied because of them (``skip_nonfinite=True``; masters, optimizer
    # state and step count unchanged, like torch.amp.GradScaler's skipped step).
    found_nonfinite: bool = False
    nonfinite_jobs: tuple[tuple[str, int], ...] = ()
    skipped: bool = False
    # The global L2 norm of the step's gradients over every trainable parameter, before
    # clipping (computed when the executor clips, ``max_grad_norm``; else None).
    grad_norm: float | None = None
    # Async: this step's OPTs that had no pending gradients to apply (the run's first step,
    # or the first after a flush) and so changed nothing.
    idle_updates: tuple[Action, ...] = ()


# ============================================================================================
# 2. value bundles
# ============================================================================================


def _bundle_names(programs: Sequence[StageProgram], unit_of: Mapping[str, int],
                  schedule: Schedule) -> dict[tuple[int, str], set[str] | None]:
    """(producer stage, value) -> the tensor names that value carries (None: every value
    gradient, for ``g`` values). Raises when a forward stage could not provide a name."""
    first = {p.index: p.units[0] for p in programs}
    by_index = {p.index: p for p in programs}

    def live_after(b: int) -> set[str]:
        return {v for p in programs if p.units[0] > b for v in p.value_inputs
                if unit_of[v] <= b}

    out: dict[tuple[int, str], set[str] | None] = {}
    for f in schedule.flows:
        if f.from_host:
            continue
        key = (f.src_stage, f.value)
        if f.what == "igrad":
            out[key] = None
            continue
        dst = by_index[f.dst_stage]
        need = live_after(first[dst.index] - 1) if dst.kind == "forward" else set(dst.value_inputs)
        out.setdefault(key, set()).update(need)  # type: ignore[union-attr]
    for (src, value), names in out.items():
        if names is None:
            continue
        prog = by_index[src]
        received = live_after(prog.units[0] - 1)
        missing = names - received - set(prog.outputs)
        if missing:
            raise ValueError(
                f"stage {prog.name} sends value {value!r} but cannot provide {sorted(missing)}: "
                "they are neither its inputs nor its outputs; the split and the schedule's flows "
                "disagree (re-run compile(); report this if it persists)"
            )
    return out


def _copy_to(obj: Any, make: Any) -> Any:
    """Copy every tensor inside ``obj`` (a tensor, tuple/list of them, or a plain value such as
    an int size) with ``make(tensor) -> tensor``; plain values pass through."""
    if isinstance(obj, torch.Tensor):
        return make(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copy_to(o, make) for o in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


# ============================================================================================
# 3. _StepPlan
# ============================================================================================


class _StepPlan:
    """What the executor precomputes for one schedule step (read-only while it runs)."""

    def __init__(self, schedule: Schedule, step: int) -> None:
        self.step = step
        self.queues: dict[tuple[int | None, str], list[Action]] = {}
        for q, actions in schedule.queues().items():
            mine = [a for a in actions if a.step == step]
            if mine:
                self.queues[q] = mine
        here = {a for lst in self.queues.values() for a in lst}
        # Edges whose source ran in an earlier step are satisfied when this step starts: the
        # schedule's barrier edges put every action of step k+1 after every action of step k,
        # and running one step at a time is how the runtime carries them out (a step's last
        # host action, their hub, waits on its in-step barrier edges like any other).
        self.waits: dict[Action, list[Action]] = {}
        for e in schedule.edges:
            if e.dst in here and e.src in here:
                self.waits.setdefault(e.dst, []).append(e.src)
        self.sources = {s for srcs in self.waits.values() for s in srcs}
        self.compute_of = {(a.kind, a.stage, a.microbatch, a.round): a
                           for a in here if a.is_compute}
        # Readers of each value kept on its producer's worker: same-worker consumer computes
        # plus the value's D2H. Readers of each value staged on the host: the remote H2Ds.
        self.device_readers: dict[tuple[int, str, int, int], int] = {}
        self.host_readers: dict[tuple[str, int, int], int] = {}
        self.local_inputs: dict[Action, list[tuple[Any, tuple[int, str, int, int]]]] = {}
        for c in self.compute_of.values():
            for f in schedule.flows:
                if f.from_host or (f.dst_kind, f.dst_stage) != (c.kind, c.stage):
                    continue
                p = self.compute_of[(f.src_kind, f.src_stage, c.microbatch, c.round)]
                if p.worker == c.worker:
                    key = (p.worker, f.value, c.microbatch, c.round)
                    self.device_readers[key] = self.device_readers.get(key, 0) + 1
                    self.local_inputs.setdefault(c, []).append((f, key))
        self.grad_jobs: set[tuple[int, int, int]] = set()  # (worker, stage, round) with D2H grad
        for a in here:
            if a.kind == "D2H" and a.what == "grad":
                self.grad_jobs.add((a.worker, a.stage, a.round))
            elif a.kind == "D2H":
                key = (a.worker, a.value, a.microbatch, a.round)
                self.device_readers[key] = self.device_readers.get(key, 0) + 1
            elif a.kind == "H2D" and a.value not in _HOST_VALUES:
                key = (a.value, a.microbatch, a.round)
                self.host_readers[key] = self.host_readers.get(key, 0) + 1
        # D2H -> the compute before which the device memory it sent home is given back (a
        # gradient slot, a value's "sent" wait; rpcompile.ir.Schedule.releases)
        self.releases = {d: c for d, c in schedule.releases().items()
                         if d in here and c in here}
        self.job_first: set[Action] = set()  # first compute of each job
        for (_, stream), lst in self.queues.items():
            if stream != "compute":
                continue
            previous = None
            for a in lst:
                if not a.is_compute:
                    continue
                if previous is None or (previous.stage, previous.round) != (a.stage, a.round):
                    self.job_first.add(a)
                previous = a


# ============================================================================================
# 4. Executor
# ============================================================================================


class _Run:
    """Mutable state of one running step, shared by the stream threads and the host."""

    def __init__(self, plan: _StepPlan, parts: list[dict[str, torch.Tensor]],
                 workers: int) -> None:
        self.plan = plan
        self.parts = parts
        self.events = {a: Event(str(a)) for a in plan.sources}
        self.lock = threading.Lock()
        self.aborted = False
        self.failures: list[tuple[Action, BaseException]] = []
        self.device_readers = dict(plan.device_readers)
        self.host_readers = dict(plan.host_readers)
        # (worker, stage, round) -> (flat weights, parameter views, buffers)
        self.weights: dict[tuple[int, int, int], tuple[torch.Tensor, dict, dict]] = {}
        # (worker, stage, round) -> the job's flat fp32 gradients and where they go
        self.grads: dict[tuple[int, int, int], _JobGrads] = {}
        # compute -> what is home already and given back as that compute starts: gradient
        # buffers, and the keys of values whose D2H counted as one of their readers
        self.given_back: dict[Action, list[torch.Tensor | tuple[int, str, int, int]]] = {}
        # (stage, round) -> the job's non-finite flag, downloaded with its gradients
        self.nonfinite: dict[tuple[int, int], torch.Tensor] = {}
        # (worker, value, microbatch, round) -> tensors a compute produced, kept on the device
        self.device_values: dict[tuple[int, str, int, int], dict[str, Any]] = {}
        # (worker, stage, microbatch, round) -> tensors H2Ds brought in for that compute
        self.delivered: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.host_values: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.host_grads: dict[tuple[int, int], torch.Tensor] = {}
        # host_values' and host_grads' keys -> the staging buffer their tensors live in
        # (Executor.staging), given back once read
        self.host_bufs: dict[tuple, torch.Tensor] = {}
        # every staging buffer this step took (HostStaging.take appends under its lock)
        self.taken: list[torch.Tensor] = []
        self.losses: dict[tuple[int, int], torch.Tensor] = {}
        self.holds = [_Holds() for _ in range(workers)]
        self.start = time.perf_counter()
        self.timeline: dict[Action, tuple[float, float]] = {}
        self.loss_scale = 1.0  # the tail's backward starts from loss * loss_scale
        # The step's gradient checks, made by its CHECK action once every gradient is home
        # (right after the step's last ACC): non-finite jobs, skipped, the norm.
        self.checked = False
        self.bad: tuple[tuple[str, int], ...] = ()
        self.skipped = False
        self.grad_norm: float | None = None
        self.idle_updates: list[Action] = []  # async OPTs with nothing pending (see StepResult)
        self.loss: torch.Tensor | None = None  # the step's loss (data parallel: every rank's)
        self.found = False  # a non-finite gradient on this rank (data parallel: on any rank)
        self.deadline: float | None = None  # time.monotonic() the watchdog fires at
        self.workers: Sequence[Worker] = ()
        self.network: threading.Thread | None = None  # the host's network lane, if any
        self.root: tuple[str, BaseException] | None = None  # a failure outside any action
        self.stuck: dict[int, dict[str, str]] = {}
        self.stuck_checked: set[int] = set()
        self.replaced: set[int] = set()
        self.worker_errors: list[tuple[str, WorkerError]] = []
        self._next_health = 0.0

    def timed(self, executor: Executor, a: Action) -> None:
        begin = time.perf_counter()
        _RUNTIME[a.kind](executor, self, a)
        self.timeline[a] = ((begin - self.start) * 1e3, (time.perf_counter() - self.start) * 1e3)

    def abort_requested(self) -> bool:
        """Polled by every blocked wait: the step failed, or a stream thread died (checked
        at most every 20 ms), or the watchdog's deadline passed."""
        if self.aborted:
            return True
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + 0.02
            for worker in self.workers:
                dead = worker.dead_streams()
                if dead:
                    self.abort_with(f"worker {worker.name}: the thread of stream(s) {dead} died",
                                    where=f"worker {worker.name}")
                    return True
            if self.deadline is not None and now >= self.deadline:
                self.aborted = True
                return True
        return False

    def left(self) -> float | None:
        """Seconds to the step's deadline (None: no watchdog)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def abort_with(self, reason: str, where: str = "the trainer") -> None:
        with self.lock:
            if self.root is None:
                self.root = (where, StepAborted(reason))
            self.aborted = True

    def fail(self, action: Action, exc: BaseException) -> None:
        with self.lock:
            self.failures.append((action, exc))
            self.aborted = True


@dataclass
class _JobGrads:
    """A job's fp32 gradient buffer on its worker: per-parameter views, each parameter's
    element offset in ``flat`` (what the accumulation kernel writes at), and the fused
    non-finite flag every microbatch of the job raises."""

    flat: torch.Tensor
    views: dict[str, torch.Tensor]
    offsets: dict[str, int]
    flag: torch.Tensor


class _Buffers:
    """A job's device copies of its non-parameter inputs (buffers, lifted constants), read by
    :func:`stage_arguments` through ``value_of`` as it would read the captured model's."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def value_of(self, name: str) -> torch.Tensor:
        return self.values[name]


_SECONDARY = (WorkerAborted, UpstreamFailed)
_INTERRUPTS = (KeyboardInterrupt, SystemExit)


class StepTimeout(StepFailed, TimeoutError):
    """The watchdog fired: the step outlived ``timeout_s`` (see :meth:`Executor.run_step`)."""


class StepAborted(RuntimeFault):
    """The step was abandoned from outside it (``close()`` from another thread)."""


def _grace(timeout_s: float | None) -> float:
    """How long streams get to drain after the watchdog fired (their waits abort within a
    poll; a stream still busy after that is stuck)."""
    return min(2.0, max(0.05, 0.05 * (timeout_s or 0.0)))


def _uninterrupted(fn: Any, interrupts: list[BaseException], run: _Run) -> Any:
    """Run ``fn`` (idempotent clean-up) to the end: a KeyboardInterrupt or SystemExit arriving
    meanwhile is kept in ``interrupts`` (re-raised by the caller afterwards) and ``fn`` runs
    again."""
    while True:
        try:
            return fn()
        except _INTERRUPTS as exc:
            interrupts.append(exc)
            run.aborted = True

class Executor:
    """Runs steps of a fully lowered RoundPipe schedule on ``workers`` (see the module doc).

    ``compiled`` gives the stage programs and the captured graph; ``store`` holds the masters,
    shadows and gradients, built over the programs' parameters stage by stage (parameter names
    = ``StageInput.source``); ``driver`` runs the optimizer over the store. ``timeout_s`` bounds
    the host's waits and the final drain (None: unbounded; failures never rely on it).
    ``kernels``: backend of the gradient accumulation on the workers (``"auto"``: Triton on
    CUDA, the torch reference elsewhere; ``"torch"``; ``"triton"``, run by Triton's
    interpreter on CPU workers), see :mod:`rpcompile.runtime.kernels`. ``skip_nonfinite``:
    a step whose gradients hold an inf or NaN is not applied (the driver discards it).
    ``loss_scaler`` (either mode): each step's backward starts from the loss times
    ``loss_scaler.scale``; after the step the scaler sees the non-finite flags: a clean step's
    gradients are divided by that scale and applied, a non-finite one is skipped (and the
    scale backs off), as with torch.amp.GradScaler.

    ``options``: the run's :class:`~rpcompile.options.TrainOptions` (what the Trainer
    passes), whose ``kernels``, ``skip_nonfinite`` and ``max_grad_norm`` the executor reads;
    or those three as keywords, checked as a TrainOptions like any others. ``timeout_s``,
    ``loss_scaler`` and ``reducer`` are what the Trainer made of its options (the resolved
    watchdog, the scaler, the data-parallel reducer).
    """

    def __init__(self, compiled: Any, workers: Sequence[Worker], schedule: Schedule,
                 store: HostStore, driver: OptimizerDriver, *,
                 options: TrainOptions | None = None,
                 timeout_s: float | None = None, kernels: str | None = None,
                 skip_nonfinite: bool | None = None,
                 loss_scaler: DynamicLossScaler | None = None,
                 max_grad_norm: float | None = None, reducer: Any = None) -> None:
        loose = {k: v for k, v in dict(kernels=kernels, skip_nonfinite=skip_nonfinite,
                                       max_grad_norm=max_grad_norm).items() if v is not None}
        if options is None:
            options = TrainOptions(**loose)
        elif loose:
            raise TypeError(f"Executor takes options=TrainOptions(...) or the keywords "
                            f"{', '.join(sorted(loose))}, not both: set them in the options")
        self.options = options
        kernels, skip_nonfinite = options.kernels, options.skip_nonfinite
        max_grad_norm = options.max_grad_norm
        # (Loss scaling works in both modes: async updates apply gradients unscaled at the
        # end of the step that computed them.)
        # Updates (both modes) are the schedule's OPT actions: where they sit in the host
        # queue is when they run. Clipping, loss scaling and skipping a non-finite step look
        # at all of the step's gradients before any update, so they need the deferred order.
        self.deferred = updates_deferred(schedule)
        if schedule.optimizer == "async":
            # Step k's OPTs apply step k-1's gradients, which the commit of step k-1 made
            # pending (rpcompile.passes.lower._add_async_optimizer).
            driver.use_pending()
        check_update_order(
            schedule.optimizer, "deferred" if self.deferred else "overlap",
            deferred_reasons(max_grad_norm=max_grad_norm, loss_scale=loss_scaler is not None,
                             skip_nonfinite=skip_nonfinite, data_parallel=reducer is not None),
            fix="a schedule lowered with updates='deferred' (rpcompile.passes.lower.lower)")
        checks = [a.step for a in schedule.host if a.kind == "CHECK"]
        if sorted(checks) != list(range(schedule.steps)):
            raise ValueError(
                "the schedule needs one CHECK action per step (the step's gradient check, "
                f"placed by the lowering's optimizer pass); it has them for steps {checks} of "
                f"{schedule.steps}: lower it with rpcompile.passes.lower.lower")
        self.kernels = kernels
        self.skip_nonfinite = skip_nonfinite
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        # Data parallel across ranks (rpcompile.runtime.distributed.DataParallel): the
        # schedule's REDUCE actions launch and wait for its reductions.
        self.reducer = reducer
        self.compiled = compiled
        self.workers = list(workers)
        self.schedule = schedule
        self.store = store
        self.driver = driver
        self.timeout_s = timeout_s
        self.programs = list(compiled.stages)
        self._check(schedule)
        captured = compiled.capture
        unit_of = {n.name: n.meta["rp_unit"] for n in captured.graph_module.graph.nodes
                   if n.op == "call_function" and "rp_unit" in n.meta}
        self.bundles = _bundle_names(self.programs, unit_of, schedule)
        # Flow read by each H2D, and values each compute kind of each stage produces.
        self._flow_of = {(f.dst_stage, f.value, f.what): f for f in schedule.flows}
        self._host_upload = {f.dst_stage for f in schedule.flows if f.from_host}
        self._produces: dict[tuple[str, int], list[str]] = {}
        for f in schedule.flows:
            if not f.from_host:
                values = self._produces.setdefault((f.src_kind, f.src_stage), [])
                if f.value not in values:
                    values.append(f.value)
        self._extras = [
            {i.name: captured.value_of(i.name) for i in p.inputs
             if i.kind in ("buffer", "constant")}
            for p in self.programs
        ]
        # Each stage's graph per worker device: export recorded the capture device in factory
        # ops and checks, so a worker on another device runs a retargeted copy.
        params = list(compiled.model.parameters())
        self._capture_device = params[0].device if params else torch.device("cpu")
        self._graphs: dict[tuple[int, torch.device], fx.GraphModule] = {}
        self._graphs_lock = threading.Lock()
        self._plans: dict[int, _StepPlan] = {}
        self._run: _Run | None = None
        self._step_lock = threading.Lock()
        self._closed = ""  # why steps are refused (set by abort())
        self.abandoned: list[Worker] = []  # replaced workers whose threads were stuck
        # The host side of every download: exact-size buffers, pinned on a pinned CUDA run,
        # lent again to later downloads they fit (rpcompile.runtime.memory.HostStaging).
        self.staging = HostStaging(pin=any(w.pinned for w in self.workers))
        self.steps_run = 0
        # The loss scaler's state before the open step (by the driver's step index): a step
        # that fails while it is being closed puts it back, like the masters.
        self._scaler_before: dict[int, dict[str, Any]] = {}
        for worker in self.workers:
            worker.add_error_listener(self._on_worker_error)

    def _check(self, sched: Schedule) -> None:
        problems = []
        if sched.kind != "roundpipe":
            problems.append(f"schedule kind is {sched.kind!r}, the executor runs 'roundpipe'")
        expected = LOWERING_PASSES if sched.ranks == 1 else DATA_PARALLEL_PASSES
        if tuple(sched.passes) != expected:
            problems.append(f"schedule passes are {sched.passes}, expected {expected} "
                            "(lower it with rpcompile.passes.lower.lower)")
        world = 1 if self.reducer is None else self.reducer.world
        if sched.ranks != world:
            problems.append(
                f"schedule was lowered for {sched.ranks} data-parallel rank(s), the run has "
                f"{world} ({'a process group of ' + str(world) if world > 1 else 'no process group'}"
                "): lower it with ranks equal to the process group's world size")
        if sched.workers != len(self.workers):
            problems.append(f"schedule is for {sched.workers} workers, {len(self.workers)} given")
        if len(sched.stage_names) != len(self.programs):
            problems.append(f"schedule has {len(sched.stage_names)} stages, the compiled model "
                            f"{len(self.programs)}")
        if (sched.microbatches, sched.rounds) != (self.compiled.microbatches,
                                                   self.compiled.rounds):
            problems.append(f"schedule runs {sched.microbatches} microbatches x {sched.rounds} "
                            f"rounds, the compiled model {self.compiled.microbatches} x "
                            f"{self.compiled.rounds}")
        if sched.optimizer != self.driver.mode:
            problems.append(f"schedule was lowered for the {sched.optimizer} optimizer, the "
                            f"driver runs {self.driver.mode}")
        if len(self.store.stages) != len(self.programs):
            problems.append("the host store was not built stage by stage from these programs")
        if problems:
            raise ValueError("cannot execute this schedule: " + "; ".join(problems))

    def plan_for(self, step: int) -> _StepPlan:
        """The precomputed plan of the schedule step that optimizer step ``step`` runs."""
        j = step % self.schedule.steps
        if j not in self._plans:
            self._plans[j] = _StepPlan(self.schedule, j)
        return self._plans[j]

    def _on_worker_error(self, error: WorkerError) -> None:
        run = self._run
        if run is not None:
            run.aborted = True

    # -- lifetime ------------------------------------------------------------------------------
    def abort(self, reason: str, wait_s: float = 30.0) -> bool:
        """Refuse further steps and abort the running one, if any (``close()`` from another
        thread): its waits give up within a poll, it drains and raises :class:`StepFailed`.
        Returns False when the running step did not return within ``wait_s``."""
        self._closed = reason
        run = self._run
        if run is not None:
            run.abort_with(reason)
        if self._step_lock.acquire(timeout=wait_s):
            self._step_lock.release()
            return True
        return False

    @contextmanager
    def between_steps(self, what: str) -> Iterator[None]:
        """Hold off steps while ``what`` runs (a flush of the pending gradients, which a step
        starting meanwhile would apply a second time); refused at once while a step runs in
        another thread, as a second ``step()`` is."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(
                f"{what} was called while a step() is running in another thread: it reads or "
                "applies the updates the step is changing. Call it between steps, from the "
                "thread that runs them, or serialize the calls with a lock."
            )
        try:
            yield
        finally:
            self._step_lock.release()

    # -- one step --------------------------------------------------------------------------
    def run_step(self, batch: Mapping[str, torch.Tensor]) -> StepResult:
        """Run one optimizer step over ``batch`` (a normalized batch dict, dim 0 = sequences)
        and return its loss; raises :class:`StepFailed` (masters kept, see the module doc).
        ``KeyboardInterrupt`` and ``SystemExit`` during the step abort it the same way and
        re-raise as themselves. One step at a time: a call while another thread's step runs
        raises at once."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(
                "step() was called while another step() (or a flush of the pending "
                "gradients) is still running from another thread: a trainer runs one step at "
                "a time, in order. Call step() from one thread, or serialize the calls with a "
                "lock."
            )
        try:
            if self._closed:
                raise RuntimeError(f"cannot run a step: {self._closed}")
            return self._run_step(batch)
        finally:
            self._step_lock.release()

    def _run_step(self, batch: Mapping[str, torch.Tensor]) -> StepResult:
        start = time.perf_counter()
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        total = self.compiled.microbatches * self.compiled.rounds
        parts = split_batch(batch, total)
        plan = self.plan_for(self.steps_run)
        for w in self.workers:
            w.check()
            w.reset_peak()
        k = self.driver.begin_step()
        if self.loss_scaler is not None:
            self._scaler_before = {k: self.loss_scaler.state_dict()}
        # Updates and shadow refreshes are the schedule's own OPT and SHADOW actions, in both
        # modes, ordered by its edges alone: no upload waits on anything else.
        run = _Run(plan, parts, len(self.workers))
        run.deadline = deadline
        run.workers = self.workers
        run.loss_scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)
        self._run = run
        host_error: BaseException | None = None
        try:
            for (w, stream), actions in plan.queues.items():
                if w is not None:
                    for a in actions:
                        self.workers[w].submit(stream, lambda a=a: self._item(run, a), str(a))
            if (None, "network") in plan.queues:
                run.network = threading.Thread(target=self._run_network, args=(run,),
                                               name="rpcompile-network", daemon=True)
                run.network.start()
            self._run_host(run)
        except BaseException as exc:  # every failure ends the step alike
            host_error = exc
            run.aborted = True
        interrupts: list[BaseException] = []
        if isinstance(host_error, _INTERRUPTS):
            interrupts.append(host_error)
        # From here on the step is taken apart whatever arrives: an interrupt delivered while
        # it drains is kept and re-raised once every stream has stopped and the masters are
        # known to be intact.
        stuck = _uninterrupted(lambda: self._drain(run), interrupts, run)
        peaks = tuple(w.peak_bytes for w in self.workers)
        left_over = tuple(w.memory_in_use for w in self.workers)
        run.worker_errors = [(w.name, e) for w in self.workers for e in w.errors]
        failed = (host_error is not None or bool(run.failures) or run.root is not None
                  or bool(stuck) or bool(run.worker_errors) or bool(interrupts))
        try:
            _uninterrupted(lambda: self._cleanup(run, stuck), interrupts, run)
        except BaseException:
            # No copy's state is known after a failed clean-up: what the step took is set
            # aside, never lent again.
            self.staging.quarantine(run.taken)
            raise
        self._run = None
        if failed:
            _uninterrupted(lambda: self._settle_staging(run), interrupts, run)
            if self.reducer is not None:
                self.reducer.abandon(f"step {self.steps_run} failed on this rank")
            _uninterrupted(self._discard_open, interrupts, run)
            if interrupts:
                raise interrupts[0]
            # (An optimizer failure is an OPT's own: _step_error names it from_update.)
            error = self._timeout_error(run, stuck) if stuck else self._step_error(run, host_error)
            raise error from error.__cause__
        try:
            if not run.checked:  # the step's CHECK action ran, or the step failed above
                raise RuntimeError("the step ended without running its CHECK action: the "
                                   "schedule lacks one (lower it with the optimizer pass)")
            if self.loss_scaler is not None:
                self.loss_scaler.update(run.found)
            if run.skipped:
                self.driver.discard_step()
            else:
                self.driver.commit_step()
        except BaseException as exc:
            if self.driver._open is None:  # handed to the driver (or skipped) before it came
                self.steps_run += 1
                raise
            # Agreeing with the other ranks, unscaling, clipping or closing the step failed (or
            # an interrupt came): the step is discarded (its journal undoes any update) and the
            # scaler put back, as for any failure.
            if self.reducer is not None:
                self.reducer.abandon(f"step {self.steps_run} failed on this rank")
            interrupts = [exc] if isinstance(exc, _INTERRUPTS) else []
            if self.loss_scaler is not None and k in self._scaler_before:
                self.loss_scaler.load_state_dict(self._scaler_before.pop(k))
            _uninterrupted(self._discard_open, interrupts, run)
            if interrupts:
                raise interrupts[0] from None
            if isinstance(exc, StepFailed):  # already named (another rank failed)
                raise
            raise StepFailed(None, None, None, exc, where="the host, closing the step",
                             step=self.driver.step) from exc
        # The schedule step ran to the end either way: the round-robin dealing continues.
        self.steps_run += 1
        return StepResult(run.loss, plan.step, time.perf_counter() - start, peaks, left_over,
                          run.timeline, found_nonfinite=run.found, nonfinite_jobs=run.bad,
                          skipped=run.skipped, grad_norm=run.grad_norm,
                          idle_updates=tuple(run.idle_updates))

    def _check_grads(self, run: _Run) -> None:
        """Once per step, when every gradient is home and before any update reads one: find
        the non-finite jobs, the step's loss (data parallel: agreed with the other ranks once
        the gradient all-reduces are done), decide whether the step is skipped, unscale (loss
        scaling) and clip in place, as clip_grad_norm_ after a full backward."""
        if run.checked:
            return
        run.checked = True
        run.bad = tuple(sorted((self.programs[s].name, r)
                               for (s, r), flag in run.nonfinite.items() if int(flag.item())))
        total = self.compiled.microbatches * self.compiled.rounds
        losses = [run.losses[(r, m)] for r in range(self.compiled.rounds)
                  for m in range(self.compiled.microbatches)]
        run.loss = step_loss(losses, loss_divisor(self.compiled.capture, total))
        run.found = bool(run.bad)
        if self.reducer is not None:
            run.loss, run.found = self.reducer.finish(run.loss, run.found, run.left())
        run.skipped = run.found and (self.skip_nonfinite or self.loss_scaler is not None)
        if run.skipped:
            return
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_([self.store.grad], scale=run.loss_scale)
        if self.max_grad_norm is not None:
            # Data parallel clips by the norm over every rank's gradients (sharded: each rank
            # holds the reduced gradients of its own shard only).
            clip = clip_grad_norm if self.reducer is None else self.reducer.clip_grad_norm
            run.grad_norm = clip(self.store, self.compiled.model, self.max_grad_norm)

    def _discard_open(self) -> None:
        if self.driver._open is not None:
            self.driver.discard_step()

    def _act(self, run: _Run, a: Action, *, timed: bool, raise_timeouts: bool = False) -> None:
        """One action of any lane: wait for its edges, act, set its event. ``timed``: the
        waits end at the step's deadline (the host's lanes, on the host's threads); otherwise
        they end when the event is recorded or the step aborts (the stream threads, whose
        items the watchdog finds stuck in _drain). A failure is recorded for the step (not a
        secondary one, which another failure caused), fails the action's event so that what
        waits on it gives up, and is re-raised; with ``raise_timeouts`` a wait past the
        deadline is re-raised alone, for the watchdog to report with the stuck streams."""
        event = run.events.get(a)
        try:
            for src in run.plan.waits.get(a, ()):
                if timed:
                    run.events[src].wait(run.left(), abort=run.abort_requested)
                else:
                    run.events[src].wait_recorded(abort=run.abort_requested)
            if run.aborted:
                raise WorkerAborted(f"step aborted before '{a}' ran")
            run.timed(self, a)
        except BaseException as exc:
            if raise_timeouts and isinstance(exc, EventTimeout):
                raise
            if not isinstance(exc, _SECONDARY):
                run.fail(a, exc)
            if event is not None:
                event.fail(exc)
            raise
        if event is not None:
            event.set()

    def _item(self, run: _Run, a: Action) -> None:
        """One action on a stream thread."""
        self._act(run, a, timed=False)

    def _run_host(self, run: _Run) -> None:
        """The host queue, in order, on the calling thread; a failure is raised to
        _run_step, which ends the step."""
        for a in run.plan.queues.get((None, "host"), ()):
            self._act(run, a, timed=True, raise_timeouts=True)

    def _run_network(self, run: _Run) -> None:
        """The host's network lane (REDUCE actions), in order, on its own thread. Its failure
        is recorded for the step (by _act; a secondary one aborts it) instead of raised, and
        the lane stops."""
        for a in run.plan.queues.get((None, "network"), ()):
            try:
                self._act(run, a, timed=True)
            except BaseException as exc:
                if isinstance(exc, _SECONDARY):
                    run.aborted = True
                return

    def _drain(self, run: _Run) -> dict[int, dict[str, str]]:
        """Return once every stream has run or dropped everything submitted this step, or has
        outlived the step's deadline: then the worker index -> its stuck streams and items."""
        lane = run.network
        if lane is not None:
            left = run.left()
            lane.join(None if left is None else max(left, 0.0) + _grace(self.timeout_s))
            if lane.is_alive():  # a wait past the deadline: abandoned (a daemon thread)
                run.abort_with("the host's network lane did not finish its reductions by the "
                               "step's deadline", where="the network lane")
            run.network = None
        stuck: dict[int, dict[str, str]] = {}
        for i, worker in enumerate(self.workers):
            if i in run.stuck_checked:
                continue
            left = run.left()
            if left is not None and left <= 0:
                # Past the deadline the others had their abort: give them a short grace.
                left = _grace(self.timeout_s)
            if worker.dead_streams():
                continue  # its queue has no consumer: replaced below
            try:
                worker.synchronize(left)
            except EventTimeout:
                run.aborted = True
                stuck[i] = worker.busy_streams() or {"?": "unknown item"}
            except _INTERRUPTS:
                raise  # kept by the caller, which drains again
            except BaseException:  # a failed worker: recover() drains it below
                run.aborted = True
                busy = worker.busy_streams()
                past = run.left()
                if busy and past is not None and past <= 0:
                    stuck[i] = busy  # still inside an item past the deadline: replace it
            run.stuck_checked.add(i)
        for i, worker in enumerate(self.workers):
            if i not in stuck and worker.dead_streams():
                stuck[i] = {s: "dead thread" for s in worker.dead_streams()}
        run.stuck.update(stuck)
        return dict(run.stuck)

    def _cleanup(self, run: _Run, stuck: Mapping[int, Any]) -> None:
        """Free the step's device memory; a failed worker first drains every stream. A worker
        with a stream stuck in an item (or a dead stream thread) is replaced by a fresh one:
        an item that never returns cannot be interrupted, but it need not hold up the run."""
        for i, worker in enumerate(self.workers):
            if i in stuck and i not in run.replaced:
                self._replace(run, i, worker)
                continue
            if worker.errors:
                try:
                    worker.recover(timeout=self.timeout_s or 60.0)
                except EventTimeout:
                    # A stream that never drains is stuck in an item: replace the worker.
                    self._replace(run, i, worker)
                    continue
            run.holds[i].release_all()
            worker.free_all()

    def _settle_staging(self, run: _Run) -> None:
        """After a failed step (its streams drained): the staging buffers this step took and
        did not give back go back to the pool once no copy can touch them, every GPU idle.
        If a worker was replaced, or a GPU cannot be waited on, a copy may still write into
        them: they are set aside for good (held, never lent again), not risked."""
        safe = not run.replaced
        if safe:
            try:
                for worker in self.workers:
                    if worker.kind == "cuda":
                        torch.cuda.synchronize(worker.device)
            except Exception:  # a failed device: its copies' state is unknown
                safe = False
        if safe:
            self.staging.reclaim(run.taken)
        else:
            self.staging.quarantine(run.taken)

    def _replace(self, run: _Run, i: int, worker: Worker) -> None:
        fresh = worker.respawn()
        fresh.add_error_listener(self._on_worker_error)
        self.workers[i] = fresh
        run.replaced.add(i)
        worker.shutdown(timeout=0.0, warn=False)  # its daemon threads are abandoned
        self.abandoned.append(worker)

    def _roots(self, run: _Run) -> list[tuple[Action, BaseException]]:
        return [(a, e) for a, e in run.failures if not isinstance(e, _SECONDARY)]

    def _timeout_error(self, run: _Run, stuck: Mapping[int, Mapping[str, str]]) -> StepTimeout:
        where = "; ".join(
            f"worker {self.workers[i].name}: " + ", ".join(f"{s} running {lbl!r}"
                                                         for s, lbl in streams.items())
            for i, streams in stuck.items())
        cause = EventTimeout(
            f"step {self.steps_run} did not finish within timeout_s={self.timeout_s} "
            f"({where})")
        return StepTimeout(
            None, None, None, cause, where="the watchdog", step=self.driver.step,
            message="The step's gradients were discarded and the masters kept; the stuck "
            "workers were replaced by fresh ones (their threads are abandoned), so step() can "
            "be called again. Raise timeout_s if the step is only slow.")

    def _step_error(self, run: _Run, host_error: BaseException | None) -> BaseException:
        roots = self._roots(run)
        if run.root is not None:
            where, cause = run.root
            others = [f"'{a}': {type(e).__name__}" for a, e in roots][:8]
            return StepFailed(None, None, None, cause, others, where=where,
                              step=self.driver.step)
        if not roots:
            # Nothing of ours failed first: a wait gave up because a worker failed outside
            # any action (a stream loop, an error listener); re-raise that root.
            ordered = sorted(run.worker_errors, key=lambda we: we[1].secondary)
            for name, err in ordered:
                return StepFailed(None, None, name, err,
                                  where=f"worker {name}, stream {err.stream}, {err.label!r}",
                                  step=self.driver.step)
            cause = host_error or RuntimeFault("step failed without a recorded cause")
            return StepFailed(None, None, None, cause, where="the host", step=self.driver.step)
        action, cause = roots[0]
        if isinstance(cause, StepFailed):  # already named (data parallel: another rank failed)
            return cause
        if isinstance(cause, OptimizerError):  # an OPT's update: the discard undid it
            return StepFailed.from_update(cause)
        others = [f"'{a}': {type(e).__name__}" for a, e in run.failures if a is not action][:8]
        worker = None if action.worker is None else self.workers[action.worker].name
        return StepFailed(action, self.programs[action.stage].name, worker, cause, others)

    # ========================================================================================
    # 5. actions
    # ========================================================================================

    # -- weights -----------------------------------------------------------------------------
    def _do_UP(self, run: _Run, a: Action) -> None:
        worker = self.workers[a.worker]
        stage = self.store.stages[a.stage]
        name = self.programs[a.stage].name
        flat = worker.alloc(shape=(stage.layout.shadow_numel,), dtype=self.store.compute_dtype,
                            tag=f"{name} weights")
        # One copy per contiguous host segment (one for a stage of contiguous units), cut
        # into the action's chunks.
        pieces = [(flat[seg.device_offset:seg.device_offset + seg.numel], host)
                  for seg, host in zip(stage.layout.shadow_segments, stage.shadow)]
        _chunked_copy(worker, pieces, a.chunks)
        extras = {}
        for key, value in self._extras[a.stage].items():
            extras[key] = worker.alloc(shape=value.shape, dtype=value.dtype,
                                       tag=f"{name} buffer {key}")
            worker.copy_(extras[key], value)
        worker.complete_copies()
        run.weights[(a.worker, a.stage, a.round)] = (flat, stage.device_views(flat), extras)

    def _do_EVICT(self, run: _Run, a: Action) -> None:
        worker = self.workers[a.worker]
        flat, _, extras = run.weights.pop((a.worker, a.stage, a.round))
        worker.free(flat)
        for t in extras.values():
            worker.free(t)

    # -- activations -------------------------------------------------------------------------
    def _names_for(self, f: Any) -> set[str] | None:
        """The tensor names the consumer of flow ``f`` reads from its value (None: all)."""
        if f.what == "igrad":
            return None
        if self.programs[f.dst_stage].kind == "forward":
            return self.bundles[(f.src_stage, f.value)]
        return set(self.programs[f.dst_stage].value_inputs)

    def _do_H2D(self, run: _Run, a: Action) -> None:
        worker = self.workers[a.worker]
        key = (a.worker, a.stage, a.microbatch, a.round)

        def upload(t: torch.Tensor) -> torch.Tensor:
            dev = torch.empty(t.shape, dtype=t.dtype, device=worker.device)
            worker.copy_(dev, t)
            return dev

        copies: dict[str, Any] = {}
        if a.value in _HOST_VALUES:
            # The batch lives on the host: bring in every batch input the consumer reads.
            mb = run.parts[a.round * self.compiled.microbatches + a.microbatch]
            for inp in self.programs[a.stage].inputs:
                if inp.kind == "batch":
                    copies["batch:" + inp.source] = upload(mb[inp.source])
        else:
            hkey = (a.value, a.microbatch, a.round)
            staged = run.host_values[hkey]
            need = self._names_for(self._flow_of[(a.stage, a.value, a.what)])
            prefix = "grad:" if a.what == "igrad" else ""
            for name, value in staged.items():
                if need is None or name in need:
                    copies[prefix + name] = _copy_to(value, upload)
        worker.complete_copies()
        if a.value not in _HOST_VALUES:
            # Its last reader's copies are done: the staging buffer goes back to the pool.
            with run.lock:
                run.host_readers[hkey] -= 1
                done = run.host_readers[hkey] == 0
                if done:
                    del run.host_values[hkey]
                    buf = run.host_bufs.pop(hkey)
            if done:
                self.staging.give(buf)
        run.holds[a.worker].hold(worker, ("in", key, a.value), _tensors(copies),
                                 f"{self.programs[a.stage].name} input {a.value}")
        with run.lock:
            run.delivered.setdefault(key, {}).update(copies)

    def _do_D2H(self, run: _Run, a: Action) -> None:
        worker = self.workers[a.worker]
        if a.what == "grad":
            job = run.grads.pop((a.worker, a.stage, a.round))
            buf, (host,) = self.staging.carve([job.flat], run.taken)
            _chunked_copy(worker, [(host, job.flat)], a.chunks)
            flag = worker.host_empty(job.flag.shape, job.flag.dtype)
            worker.copy_(flag, job.flag)
            worker.complete_copies()
            self._give_back(run, a, job.flat)
            with run.lock:
                run.host_grads[(a.stage, a.round)] = host
                run.host_bufs[(a.stage, a.round)] = buf
                run.nonfinite[(a.stage, a.round)] = flag
            return
        key = (a.worker, a.value, a.microbatch, a.round)
        # The value's tensors go home together, into one exact-size staging buffer.
        device = run.device_values[key]
        tensors: list[torch.Tensor] = []
        for v in device.values():
            _copy_to(v, lambda t: tensors.append(t) or t)
        buf, views = self.staging.carve(tensors, run.taken)
        slots = iter(views)

        def download(t: torch.Tensor) -> torch.Tensor:
            host = next(slots)
            worker.copy_(host, t)
            return host

        staged = {name: _copy_to(v, download) for name, v in device.items()}
        worker.complete_copies()
        hkey = (a.value, a.microbatch, a.round)
        with run.lock:
            run.host_values[hkey] = staged
            run.host_bufs[hkey] = buf
        self._give_back(run, a, key)

    def _give_back(self, run: _Run, a: Action, what: torch.Tensor | tuple) -> None:
        """After D2H ``a``: give back the device memory it sent home (a gradient buffer, or
        the value ``key`` as one of its readers) now, or, where the schedule names a compute
        for it (``Schedule.releases``), as that compute starts (:meth:`_take_back`), so
        that a worker's memory follows the schedule, not the download's speed."""
        at = run.plan.releases.get(a)
        if at is not None:
            with run.lock:
                run.given_back.setdefault(at, []).append(what)
        elif isinstance(what, tuple):
            self._release_value(run, what)
        else:
            self.workers[a.worker].free(what)

    def _take_back(self, run: _Run, a: Action) -> None:
        """Before compute ``a`` starts: what :meth:`_give_back` held for it (its D2H is done:
        the schedule's edge to ``a`` waited for it)."""
        with run.lock:
            held = run.given_back.pop(a, ())
        for what in held:
            if isinstance(what, tuple):
                self._release_value(run, what)
            else:
                self.workers[a.worker].free(what)

    def _release_value(self, run: _Run, key: tuple[int, str, int, int]) -> None:
        with run.lock:
            run.device_readers[key] -= 1
            last = run.device_readers[key] == 0
            if last:
                del run.device_values[key]
        if last:
            run.holds[key[0]].release(("value", *key))

    # -- compute -----------------------------------------------------------------------------
    def _inputs(self, run: _Run, a: Action) -> tuple[dict[str, Any], dict[str, Any],
                                                     dict[str, Any]]:
        """(forward values, value gradients, batch inputs) of a compute, on its worker."""
        with run.lock:
            delivered = run.delivered.get((a.worker, a.stage, a.microbatch, a.round), {})
        values: dict[str, Any] = {}
        grads: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        for name, v in delivered.items():
            if name.startswith("batch:"):
                batch[name[6:]] = v
            elif name.startswith("grad:"):
                grads[name[5:]] = v
            else:
                values[name] = v
        for f, vkey in run.plan.local_inputs.get(a, ()):
            bundle = run.device_values[vkey]
            need = self._names_for(f)
            into = grads if f.what == "igrad" else values
            into.update(bundle if need is None else {n: v for n, v in bundle.items() if n in need})
        # Every batch input arrives by the schedule's own host upload (roundpipe_flows gives
        # each stage that reads one an ``ids`` or ``labels`` upload): a copy made here would
        # be a transfer the schedule, its timing and its memory proof do not have.
        missing = [i.source for i in self.programs[a.stage].inputs
                   if i.kind == "batch" and i.source not in batch]
        if missing and a.stage in self._host_upload:
            # The upload is in the schedule but has not landed: an ordering edge is missing,
            # as for any other value read before its writer put it there.
            raise KeyError(f"{a}: batch inputs {missing} read before their host upload landed")
        if missing:
            raise RuntimeError(
                f"{a}: the schedule brings no upload of the batch inputs {missing} that "
                f"{self.programs[a.stage].name} reads; its plan's stages do not say what they "
                "read (Stage.batch_inputs is None: a stage built by hand), so build the plan "
                "with rpcompile.planner.partition.build_plan from the captured units")
        return values, grads, batch

    def _finish_compute(self, run: _Run, a: Action, available: Mapping[str, Any],
                        grads: Mapping[str, Any]) -> None:
        """Keep what this compute sends on on the device, then drop what it read."""
        worker = self.workers[a.worker]
        prog = self.programs[a.stage]
        worker.complete_copies()
        for value in self._produces.get((a.kind, a.stage), ()):
            key = (a.worker, value, a.microbatch, a.round)
            if not run.device_readers.get(key):
                continue
            names = self.bundles[(a.stage, value)]
            if names is None:
                bundle = {n: g for n, g in grads.items() if n not in prog.outputs}
            else:
                bundle = {n: available[n] for n in names}
            run.holds[a.worker].hold(worker, ("value", *key), _tensors(bundle),
                                     f"{prog.name} value {value}")
            with run.lock:
                run.device_values[key] = bundle
        ckey = (a.worker, a.stage, a.microbatch, a.round)
        with run.lock:
            delivered = run.delivered.pop(ckey, {})
        del delivered
        run.holds[a.worker].release_prefix(("in", ckey))
        for _, vkey in run.plan.local_inputs.get(a, ()):
            self._release_value(run, vkey)

    def _job(self, run: _Run, a: Action) -> tuple[dict[str, torch.Tensor], _Buffers]:
        _, views, extras = run.weights[(a.worker, a.stage, a.round)]
        return views, _Buffers(extras)

    def _graph(self, a: Action) -> fx.GraphModule:
        """The stage's graph for the action's worker device (the captured one when equal)."""
        prog = self.programs[a.stage]
        device = torch.device(self.workers[a.worker].device)
        if _same_device(device, self._capture_device):
            return prog.graph_module
        key = (a.stage, device)
        with self._graphs_lock:
            if key not in self._graphs:
                self._graphs[key] = prog.on_device(device)
            return self._graphs[key]

    def _do_F(self, run: _Run, a: Action) -> None:
        self._take_back(run, a)
        prog = self.programs[a.stage]
        params, extras = self._job(run, a)
        values, _, batch = self._inputs(run, a)
        with torch.no_grad():
            outs = self._graph(a)(*stage_arguments(prog, extras, params, batch, values))
        available = dict(values)
        available.update(zip(prog.outputs, outs))
        self._finish_compute(run, a, available, {})

    def _do_T(self, run: _Run, a: Action) -> None:
        self._backward(run, a)

    def _do_B(self, run: _Run, a: Action) -> None:
        self._backward(run, a)

    def _backward(self, run: _Run, a: Action) -> None:
        self._take_back(run, a)
        worker = self.workers[a.worker]
        prog = self.programs[a.stage]
        params, extras = self._job(run, a)
        values, value_grads, batch = self._inputs(run, a)
        job = (a.worker, a.stage, a.round)
        stage = self.store.stages[a.stage]
        if a in run.plan.job_first and stage.layout.grad_numel:
            if job not in run.plan.grad_jobs:
                raise RuntimeError(f"stage {prog.name} has trainable parameters but the "
                                   "schedule never downloads its gradients (no D2H grad)")
            flat = worker.alloc(shape=(stage.layout.grad_numel,), dtype=torch.float32,
                                tag=f"{prog.name} gradients")
            flat.zero_()
            views = stage.grad_views(flat)
            offsets = {n: v.storage_offset() - flat.storage_offset() for n, v in views.items()}
            run.grads[job] = _JobGrads(flat, views, offsets,
                                       _kernels.nonfinite_flag(worker.device))
        grads = run.grads.get(job)

        def accumulate(pairs: list[tuple[str, torch.Tensor]]) -> None:
            # The job's fp32 sums live in the flat buffer: the reference's "first microbatch
            # starts from zero, later ones add" is 0 + g, then += g, bit for bit; the kernel
            # adds every parameter of the microbatch in one launch (acc += g.float()).
            stray = sorted(n for n, _ in pairs if grads is None or n not in grads.offsets)
            if stray:
                raise RuntimeError(f"stage {prog.name}: gradients for {stray} have no place in "
                                   "the stage's gradient buffer (parameters the host store "
                                   "holds as frozen?)")
            _accumulate(grads, pairs, self.kernels)

        total = self.compiled.microbatches * self.compiled.rounds
        loss = run_backward_microbatch(prog, extras, params, batch, values, value_grads,
                                       {}, scale=loss_divisor(self.compiled.capture, total),
                                       accumulate=accumulate,
                                       graph_module=self._graph(a), loss_scale=run.loss_scale)
        if loss is not None:
            host = worker.host_empty(loss.shape, loss.dtype)
            worker.copy_(host, loss)
            run.losses[(a.round, a.microbatch)] = host
        self._finish_compute(run, a, values, value_grads)

    # -- host --------------------------------------------------------------------------------
    def _do_ACC(self, run: _Run, a: Action) -> None:
        self.driver.accumulate_grad(a.stage, run.host_grads.pop((a.stage, a.round)))
        with run.lock:
            buf = run.host_bufs.pop((a.stage, a.round))
        self.staging.give(buf)  # added into the masters' gradients: free for the next job

    def _do_REDUCE(self, run: _Run, a: Action) -> None:
        # Data parallel: the stage's gradients of the step are home (the edge from its last
        # ACC). Launch the cross-rank reduction of every parameter whose gradient stages are
        # now all home, and wait for it here, on the network lane: what reads the reduced
        # gradients waits for this action (its edge), while the backward jobs go on.
        self.reducer.stage_done(a.stage)
        self.reducer.wait_reductions(run.left())

    def _do_CHECK(self, run: _Run, a: Action) -> None:
        # The step's last ACC ran (host queue order) and, data parallel, every REDUCE
        # (``reduced`` edges): every gradient of the step is home.
        self._check_grads(run)

    def _do_OPT(self, run: _Run, a: Action) -> None:
        # Now, on this thread; undone if the step fails. (Async: the pending gradients of
        # the step before, checked at its end; none in a run's first step.)
        if not run.skipped and not self.driver.update(a.stage):
            run.idle_updates.append(a)

    def _do_SHADOW(self, run: _Run, a: Action) -> None:
        if not run.skipped:
            self.driver.refresh(a.stage)


# The runtime half of each action kind's record (rpcompile.ir.ACTION_SPECS is the other):
# one implementation per ActionKind, checked complete at import. The entries call the method
# by name when they run, so a test (or a fault injector) patching Executor._do_X reaches it.
RUNTIME_ACTIONS: Mapping[ActionKind, Callable[[Executor, _Run, Action], None]] = {
    ActionKind.F: lambda ex, run, a: ex._do_F(run, a),
    ActionKind.T: lambda ex, run, a: ex._do_T(run, a),
    ActionKind.B: lambda ex, run, a: ex._do_B(run, a),
    ActionKind.EVICT: lambda ex, run, a: ex._do_EVICT(run, a),
    ActionKind.UP: lambda ex, run, a: ex._do_UP(run, a),
    ActionKind.H2D: lambda ex, run, a: ex._do_H2D(run, a),
    ActionKind.D2H: lambda ex, run, a: ex._do_D2H(run, a),
    ActionKind.ACC: lambda ex, run, a: ex._do_ACC(run, a),
    ActionKind.OPT: lambda ex, run, a: ex._do_OPT(run, a),
    ActionKind.SHADOW: lambda ex, run, a: ex._do_SHADOW(run, a),
    ActionKind.REDUCE: lambda ex, run, a: ex._do_REDUCE(run, a),
    ActionKind.CHECK: lambda ex, run, a: ex._do_CHECK(run, a),
}
check_registry(RUNTIME_ACTIONS, "the runtime executor")
_RUNTIME = {k.value: fn for k, fn in RUNTIME_ACTIONS.items()}  # keyed by Action.kind's string


def clip_grad_norm(store: HostStore, model: torch.nn.Module, max_norm: float) -> float:
    """Clip the host's fp32 gradients by their global L2 norm, with torch's own
    ``get_total_norm`` / ``clip_grads_with_norm_`` over the trainable parameters in
    ``model.parameters()`` order (what ``clip_grad_norm_(model.parameters(), max_norm)`` sees
    after a full backward); return the norm before clipping."""
    trainable = {s.name for s in store.trainable_slots}
    names = [n for n, p in model.named_parameters() if n in trainable]
    grads = [store.grad_of(n) for n in names]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_([_Grad(g) for g in grads], max_norm, total)
    return float(total)


class _Grad:
    """A parameter-like holder of a host gradient view, for torch's clipping helpers."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _accumulate(job: _JobGrads, pairs: Sequence[tuple[str, torch.Tensor]],
                kernels: str) -> None:
    """Add one microbatch's parameter gradients into the job's flat buffer: one launch, or
    one more per repeat when two names share a slot (a tied parameter under two names: its
    contributions are then added one after the other, in the reference's order)."""
    batch: list[torch.Tensor] = []
    offsets: list[int] = []
    for name, grad in pairs:
        offset = job.offsets[name]
        if offset in offsets:
            _kernels.accumulate_grads(batch, job.flat, offsets, found_nonfinite=job.flag,
                                      backend=kernels)
            batch, offsets = [], []
        batch.append(grad.contiguous())
        offsets.append(offset)
    _kernels.accumulate_grads(batch, job.flat, offsets, found_nonfinite=job.flag,
                              backend=kernels)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same (``cuda`` and ``cuda:0`` are, as the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _chunked_copy(worker: Worker, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  chunks: int) -> None:
    """Copy ``(dst, src)`` flat pairs in about ``chunks`` equal pieces, completing each before
    the next: on a GPU another stream's copy (a critical activation) can use the copy engine
    between two pieces of a bulk transfer instead of waiting for all of it."""
    total = sum(src.numel() for _, src in pieces)
    step = max(1, -(-total // max(1, chunks)))
    for dst, src in pieces:
        for start in range(0, src.numel(), step):
            worker.copy_(dst[start:start + step], src[start:start + step])
            worker.complete_copies()
    worker.complete_copies()


# ============================================================================================
# 6. device memory holds
# ============================================================================================


class _Holds:
    """Activations held on a worker between actions, accounted against its capacity once per
    storage (a tensor passed on from one value to the next is counted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple, list[int]] = {}
        self._storages: dict[int, list] = {}  # data_ptr -> [refcount, reservation, storage]

    def hold(self, worker: Worker, key: tuple, tensors: Sequence[torch.Tensor], tag: str) -> None:
        ptrs = []
        for t in tensors:
            if t.numel() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            with self._lock:
                entry = self._storages.get(ptr)
                if entry is not None:
                    entry[0] += 1
                    ptrs.append(ptr)
                    continue
            reservation = worker.reserve(storage.nbytes(), tag)
            reservation.__enter__()  # raises WorkerOutOfMemory naming the tag and the bytes
            with self._lock:
                self._storages[ptr] = [1, reservation, storage]
            ptrs.append(ptr)
        with self._lock:
            self._keys.setdefault(key, []).extend(ptrs)

    def release(self, key: tuple) -> None:
        self._release([key])

    def release_prefix(self, prefix: tuple) -> None:
        with self._lock:
            keys = [k for k in self._keys if k[:len(prefix)] == prefix]
        self._release(keys)

    def _release(self, keys: list[tuple]) -> None:
        done = []
        with self._lock:
            for k in keys:
                for ptr in self._keys.pop(k, ()):
                    entry = self._storages[ptr]
                    entry[0] -= 1
                    if entry[0] == 0:
                        done.append(self._storages.pop(ptr)[1])
        for reservation in done:
            reservation.__exit__(None, None, None)

    def release_all(self) -> None:
        with self._lock:
            done = [entry[1] for entry in self._storages.values()]
            self._storages.clear()
            self._keys.clear()
        for reservation in done:
            reservation.__exit__(None, None, None)

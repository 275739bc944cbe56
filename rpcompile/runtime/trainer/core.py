"""The :class:`Trainer`: construction (workers, host store, optimizer driver, schedule,
executor), stepping, the masters, inspection and closing; its state and checkpoints are
:class:`~rpcompile.runtime.trainer.state.TrainerState`'s."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.errors import InvalidInput, InvalidType, StateError
from rpcompile.ir import Schedule
from rpcompile.options import (
    Options,
    PlanOptions,
    TrainOptions,
    grad_check_passes,
    update_order,
)
from rpcompile.passes.lower import (
    DEFAULT_CHUNK_BYTES,
    runtime_schedule,
    updates_deferred,
)
from rpcompile.passes.memory import (
    HostMemory,
    HostMemoryError,
    check_staging,
    host_memory,
    host_ram_problem,
)
from rpcompile.runtime.errors import OptimizerError
from rpcompile.runtime.executor import Executor, StepFailed, StepResult
from rpcompile.runtime.kernels import host_backend
from rpcompile.runtime.loss_scale import DynamicLossScaler, LossScaleConfig
from rpcompile.runtime.memory import HostStore, MemoryReport, pin_host_memory
from rpcompile.runtime.optim import OptimizerDriver
from rpcompile.runtime.workers import make_workers
from rpcompile.sim.engine import paused_gc, with_staging

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled
    from rpcompile.runtime.stream import StepStream
from rpcompile.runtime.trainer.plan_shape import check_plan_shape
from rpcompile.runtime.trainer.ranks import (
    _default_optimizer,
    _deferred_reasons,
    check_ranks,
    default_timeout_s,
    group_world,
)
from rpcompile.runtime.trainer.state import TrainerState

__all__ = [
    "Trainer",
]


class Trainer(TrainerState):
    """Trains ``compiled.model`` with RoundPipe on stateless workers (see the module doc).

    ``train``: the :class:`~rpcompile.options.TrainOptions` to run with, and ``plan``: the
    :class:`~rpcompile.options.PlanOptions` the run's schedule is lowered for; each ``None``
    takes the compile's (``compiled.options``). A group given is used as it is: build it
    from the compile's to change one option, ``replace(compiled.options.train,
    max_grad_norm=1.0)``. Of ``plan`` the run reads ``mode``, ``schedule_steps``,
    ``chunk_bytes``, ``updates``, ``shard_optimizer``, ``capacity_bytes`` (each virtual
    worker's memory), ``host_memory`` and ``undo_journal``; the plan's shape (workers,
    microbatches, rounds) is the compiled model's.

    Kernel backends give the same bits. A step whose gradients hold an inf or NaN (the
    accumulation kernel's fused check) sets ``trainer.last.found_nonfinite``; with
    ``skip_nonfinite`` it is not applied (masters, optimizer state and ``steps_done`` stay,
    ``trainer.last.skipped``). With ``loss_scale`` the loss is scaled before backward, a
    non-finite step is skipped and the scale backs off, clean steps are unscaled and applied
    (``trainer.loss_scaler`` holds its state). ``trainer.last.grad_norm`` is the norm before
    clipping. The watchdog covers a step's host waits and its drain together: a step that
    outlives ``timeout_s`` raises :class:`StepFailed` at that time, masters kept, and workers
    stuck in an item are replaced.
    ``process_group``: train data parallel across the ranks of a gloo group: each rank steps
    on its own share of the global batch; losses, clipping and updates are those of the global
    batch (:mod:`rpcompile.runtime.distributed`). ``shard_optimizer`` (a plan option): each
    rank keeps the masters and optimizer state of its 1/N shard only; :meth:`masters` then
    refuses (use
    :meth:`owned_masters` or the collective :meth:`gather_masters`), and
    :meth:`sync_to_model`, :meth:`state_dict`, :meth:`save_checkpoint` and
    :meth:`load_checkpoint` are collectives: call them on every rank.

    ``updates`` (sync mode): ``"overlap"`` runs each stage's update as soon as its gradients
    are home, while later backward jobs compute; ``"deferred"`` runs them after the step's
    last gradient (default: ``"deferred"`` when clipping, loss scaling or ``skip_nonfinite``
    need the whole step's gradients first, else ``"overlap"``). Async mode has one order:
    step k's updates apply step k-1's gradients at its start (``"deferred"`` is refused),
    and :meth:`flush` applies the last step's. Either way a failed step changes nothing
    (docs/runtime.md, "the protocol"), thanks to the optimizer driver's undo journal.

    ``undo_journal=False`` (a plan option; the Trainer applies it to everything it reads:
    its driver's rollback and its host
    figure; the schedule's actions do not depend on it, only the plan's predicted OPT time
    does, which the watchdog's generous default absorbs) runs without that journal: no copy
    of the masters, optimizer state and trainable shadows (14 bytes per trainable parameter of
    host memory, and the copy's time on every update), but a step that fails may leave
    them half-updated, which nothing can undo. The trainer then refuses every further
    :meth:`step` and every read of the masters (``masters``, ``state_dict``,
    ``save_checkpoint``, ``sync_to_model``) with an error saying so, until
    :meth:`load_checkpoint` or :meth:`load_state_dict` restores a saved state.

    ``host_memory="pageable"`` (a plan option): on CUDA the
    host store's buffers and the workers' staging are left pageable
    (:func:`~rpcompile.runtime.memory.pin_host_memory` decides, ``trainer.pin_host`` says);
    the schedule is the same, only its predicted transfer times differ (compile() times
    them for the option it was given).

    Host memory: before it builds the host store the trainer checks the plan's host bytes
    (``host_memory``, :class:`~rpcompile.passes.memory.HostMemory`) against the RAM
    (``host_ram_bytes``, else this machine's) and refuses with
    :class:`~rpcompile.passes.memory.HostMemoryError`, naming the bytes, the RAM, where that
    figure came from and what would fit, rather than meet the OOM killer or swap mid-run.
    """

    def __init__(self, compiled: Compiled, *, plan: PlanOptions | None = None,
                 train: TrainOptions | None = None) -> None:
        base = getattr(compiled, "options", None) or Options()
        options = base.train if train is None else train
        plan_options = base.plan if plan is None else plan
        for name, group, cls in (("train", options, TrainOptions),
                                 ("plan", plan_options, PlanOptions)):
            if not isinstance(group, cls):
                raise InvalidType(f"Trainer's {name} must be an rpcompile.{cls.__name__}, got "
                                  f"{type(group).__name__}")
        Options(plan=plan_options, train=options)  # the checks across groups
        self.options = options
        self.plan_options = plan_options
        self.compiled = compiled
        mode = self.mode = plan_options.mode
        optimizer, device, kernels = options.optimizer, options.device, options.kernels
        timeout_s, loss_scale = options.timeout_s, options.loss_scale
        self.loss_scaler: DynamicLossScaler | None = None
        if loss_scale:
            config = LossScaleConfig() if loss_scale is True else loss_scale
            self.loss_scaler = DynamicLossScaler(config)
        if timeout_s is None:
            timeout_s = default_timeout_s(compiled)
        self.timeout_s: float | None = None if math.isinf(timeout_s) else float(timeout_s)
        self._closed = False
        updates = update_order(mode, plan_options.updates, _deferred_reasons(options))
        world = group_world(options.process_group)
        check_ranks(plan_options.ranks, world)
        # The plan options this run's schedule is lowered for: the compile's, with this
        # trainer's overrides, its process group's ranks and the update order it needs.
        self.schedule = self._lowered_schedule(
            compiled, replace(plan_options, ranks=world, updates=updates),
            grad_check_passes(max_grad_norm=options.max_grad_norm,
                              loss_scale=options.loss_scale))
        # Why steps (and reads of the masters) are refused: a step failed with the undo
        # journal off, so an update may be half-applied (cleared by loading a state); or the
        # trainer was retired, its state moved to a new plan's trainer.
        self._refused = ""
        self._stepping = threading.Lock()
        self.host_memory = self._host_figure(compiled, mode, world,
                                             plan_options.shard_optimizer)
        self._check_host_ram()
        self.workers = make_workers(compiled.workers, device, plan_options.capacity_bytes,
                                    options.chaos, host_memory=plan_options.host_memory)
        try:
            # Pinned on CUDA unless the run's host memory is pageable (one decision, the
            # one the CUDA workers' staging reads too).
            self.pin_host = pin_host_memory(plan_options.host_memory, self.workers[0].kind)
            self.store = self._build_store(compiled, pin=self.pin_host)
            self.store.kernels = host_backend(kernels, self.workers[0].kind)
            # PEFT layers that can merge their adapters into the base weights in place: the
            # frozen base is shared with the store's shadows, which the workers upload.
            self._mergeable = tuple(m for m in compiled.model.modules()
                                    if hasattr(m, "merged") and callable(getattr(m, "unmerge", None)))
            self.dp = self._data_parallel(compiled, options.process_group,
                                          plan_options.shard_optimizer)
            # Updates are the schedule's OPT actions in both modes, run by the executor and
            # undone if the step fails (the driver implements them and adds nothing).
            # Sharded, the optimizer is built over this rank's masters only.
            # The undo journal (rollback) is what lets a failed step change nothing; without
            # it (undo_journal=False) a failure stops the trainer (_refuse).
            driver = OptimizerDriver(self.store, optimizer or _default_optimizer, mode=mode,
                                     rollback=plan_options.undo_journal)
            self.driver = driver
            if self.sharded:
                driver.shadow_gather = self.dp.gather_shadows
            self.executor = Executor(compiled, self.workers, self.schedule, self.store,
                                     self.driver, options=options, timeout_s=self.timeout_s,
                                     loss_scaler=self.loss_scaler, reducer=self.dp)
        except BaseException:
            for w in self.workers:
                w.shutdown()
            raise
        self.workers = self.executor.workers  # one list: the executor replaces stuck workers
        self.last: StepResult | None = None
        self._peaks = [0] * len(self.workers)

    # -- construction ------------------------------------------------------------------------
    def _lowered_schedule(self, compiled: Compiled, run: PlanOptions,
                          check_passes: int = 0) -> Schedule:
        """``compiled.schedule`` when it is the one the plan options ``run`` lower (one
        schedule per compile), else one built from them
        (:func:`rpcompile.passes.lower.runtime_schedule`), its CHECK actions charged for the
        run's clipping and loss scaling (``check_passes``). ``self._lowered_by``: the plan
        and options it was built from (None: the compile's)."""
        self._lowered_by: tuple[Any, PlanOptions] | None = None
        ranks = run.ranks or 1
        plan = compiled.plan
        if getattr(plan, "grad_check_passes", check_passes) != check_passes:
            plan = replace(plan, grad_check_passes=check_passes)
        kept = getattr(compiled, "schedule", None)
        built = getattr(getattr(compiled, "options", None), "plan", None)
        kept_chunk = built.chunk_bytes if built is not None else DEFAULT_CHUNK_BYTES
        if (kept is not None and kept.optimizer == run.mode
                and run.schedule_steps in (None, kept.steps)
                and run.chunk_bytes == kept_chunk and kept.ranks == ranks
                and kept.sharded == (run.shard_optimizer and ranks > 1)
                and updates_deferred(kept) == (run.updates == "deferred")
                and plan is compiled.plan):
            return kept
        # The compiled model's own figures (the same as its plan options' for a compile).
        run = replace(run, gpus=compiled.workers, microbatches=compiled.microbatches,
                      rounds=compiled.rounds)
        self._lowered_by = (plan, run)
        # Its host staging slots as compile() gives its own (rpcompile.passes.staging).
        staged = with_staging(runtime_schedule(plan, run), plan, compiled.hardware)
        with paused_gc():
            check_staging(staged)
        return staged

    def _host_figure(self, compiled: Compiled, mode: str, world: int, shard: bool) -> HostMemory:
        """The host bytes this trainer's run keeps: the plan's static buffers in this mode,
        with or without the undo journal, the transfer staging (the sum of this run's
        schedule's host staging slots: ``Schedule.staging_bytes``), at one rank's share when
        sharded."""
        host = host_memory(compiled.plan, mode, journal=self.plan_options.undo_journal,
                           pageable=self.plan_options.host_memory == "pageable")
        host = replace(host, transfers=sum(self.schedule.staging_bytes))
        return host.sharded(world) if shard and world > 1 else host

    def _check_host_ram(self) -> None:
        """Refuse a run whose host bytes exceed the RAM (``host_ram_bytes``, else this
        machine's, where the store is allocated): building the store would go on until the
        OOM killer or swap met it, mid-run."""
        from rpcompile.hardware import host_ram

        ram, source = host_ram(self.options.host_ram_bytes)
        problem = host_ram_problem(self.host_memory, ram, source)
        if problem is not None:
            raise HostMemoryError(f"the trainer refuses to build its host store: {problem}")

    @staticmethod
    def _build_store(compiled: Compiled, pin: bool) -> HostStore:
        model = compiled.model
        stage_params = [
            [(i.source, model.get_parameter(i.source)) for i in p.inputs if i.kind == "param"]
            for p in compiled.stages
        ]
        grad_stages = [p.index for p in compiled.stages if p.kind != "forward"]
        # Frozen quantized weights stay packed on the host; the workers rebuild them.
        return HostStore.build(stage_params, compute_dtype=compiled.compute_dtype, pin=pin,
                               grad_stages=grad_stages, packed=compiled.capture.quantized)

    def _data_parallel(self, compiled: Compiled, process_group: Any, shard: bool) -> Any:
        from rpcompile.runtime.distributed import DataParallel, resolve_group

        group = resolve_group(process_group)
        if group is None or group_world(group) == 1:
            return None  # one rank alone has nothing to reduce
        dp = DataParallel(group, self.store, mean_loss=compiled.capture.loss_reduction != "sum",
                          shard=shard)
        dp.broadcast_store()
        if shard:
            dp.shard_store()
        return dp

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only its shard of the masters and optimizer state."""
        return self.dp is not None and self.dp.shard

    # -- training ----------------------------------------------------------------------------
    def _refuse_merged_adapters(self) -> None:
        """The model's frozen weights are views of the host store's shadows (what the workers
        upload: ``HostStore.build(share_frozen=True)``), so adapters merged into them in place
        (PEFT ``merge_adapter()``, e.g. for generation) would be trained on as base weights
        with the adapters applied again."""
        merged = [m for m in self._mergeable if m.merged]
        if merged:
            raise InvalidInput(
                f"{len(merged)} adapter layer(s) of the model are merged into its base weights "
                f"(PEFT merge_adapter()); the trainer shares the frozen base weights with what "
                f"the workers upload, so this step would train on the merged weights with the "
                f"adapters applied again: call model.unmerge_adapter() before the next step")

    def step(self, batch: Any) -> torch.Tensor:
        """One optimizer step over ``batch`` (token ids ``[batch, seq]`` or a dict with
        ``input_ids``, ``labels``, ``attention_mask`` for a causal LM; a tuple of tensors
        otherwise): split into ``microbatches x rounds`` microbatches (as evenly as possible),
        forward, backward, update, committed before it returns (nothing in flight after it;
        :meth:`fit` keeps the next step running while this one drains). Returns the loss (a
        causal LM's token mean over the whole batch; else the mean over microbatches). Raises
        :class:`StepFailed` if any action fails, ``ValueError`` before anything runs if the
        batch is malformed or larger than the plan's shape. Data parallel: the other ranks are
        (or will be) waiting for this rank at the step's start, so a refused batch (or an
        interrupt before the step) is announced to them (they raise ``RankFailed`` at once
        instead of waiting for the process group's timeout) and this trainer refuses further
        steps, as after any failed step: restart every rank."""
        if self._refused:
            raise StateError(self._refused)
        # One step at a time (the executor refuses a second one too; here it is refused
        # before it could count as a failed step of the first, _refuse).
        if not self._stepping.acquire(blocking=False):
            raise StateError(
                "step() was called while another step() is still running from another "
                "thread: a trainer runs one step at a time, in order. Call step() from one "
                "thread, or serialize the calls with a lock.")
        try:
            bound = self._bind(batch, self.executor.steps_run)
            try:
                self._committed(self.executor.run_step(bound))
            except BaseException as exc:
                self._failed(exc)
                raise
            return self.last.loss
        finally:
            self._stepping.release()

    def fit(self, batches: Iterable[Any], steps: int | None = None, *,
            scheduler: Any = None) -> StepStream:
        """Train on ``batches`` as a stream of steps: an iterator of :class:`StepResult`, one
        per committed step, in order (``trainer.last`` is the latest). Step k+1 starts while
        step k drains (its forward jobs run as soon as what they read is ready), and each
        batch is taken from ``batches`` and bound while the steps before it run, so neither
        the data loading nor the loop's own work (logging, evaluation) stalls the workers.
        ``steps``: at most that many steps (None: until ``batches`` ends). ``scheduler``: a
        learning-rate scheduler (anything with ``step()``) stepped right after each step
        commits, before the next one opens: each step runs with the hyperparameters a
        ``step()`` loop calling ``scheduler.step()`` after each step gives it (a loop that
        steps it itself, after each result, is a step or two late: the next steps have
        already opened). A step discarded by a failure has not stepped it.
        A batch larger than the plan's shape is refused: a trainer runs one plan
        (``Compiled.fit`` makes a new plan for it and goes on with that plan's trainer).

        A failure raises :class:`StepFailed` from ``next()``: every step not yet committed is
        discarded (the state is the last committed step's), and the stream stays usable: the
        next ``next()`` runs the discarded steps' batches again first, bit for bit as they
        would have run, then goes on with ``batches``. ``flush()``, the checkpoints and
        ``close()`` let the steps in flight commit first, so a checkpoint is always of a
        committed step, and the steps committed then equal the batches taken from
        ``batches`` (``stream.committed``)::

            for result in trainer.fit(loader, steps=1000):
                log(result.loss)
                if trainer.steps_done % 100 == 0:
                    trainer.save_checkpoint(path)   # lets the steps in flight commit first

        ``trainer.step(batch)`` is the same step, run alone."""
        from rpcompile.runtime.stream import StepStream

        return StepStream(self, batches, steps, scheduler)

    def _bind(self, batch: Any, step: int, check_shape: bool = True) -> dict[str, torch.Tensor]:
        """``batch`` as the executor runs it at run step ``step`` (its dropout seeds are the
        step's), checked against the plan's shape (unless ``check_shape`` is False: a stream
        that re-plans for a larger batch checks it itself); data parallel, with the whole
        global batch's token count agreed with the other ranks (the step's start)."""
        from rpcompile.capture.batch import NUM_ITEMS, bind_batch

        if self._refused:
            raise StateError(self._refused)
        try:
            self._refuse_merged_adapters()
            bound = bind_batch(self.compiled.capture, batch, step=step)
            if check_shape:
                check_plan_shape(self.compiled, bound)
        except BaseException as exc:
            if self.dp is not None:
                self.dp.abandon(f"step {step} refused its batch on rank "
                                f"{self.dp.rank}: {type(exc).__name__}: {exc}")
            raise
        if self.dp is not None:
            # The loss is the token mean over the global batch of every rank.
            if NUM_ITEMS in bound:
                bound[NUM_ITEMS] = self.dp.begin_step(bound[NUM_ITEMS])
            else:
                self.dp.begin_step()
        return bound

    def _failed(self, exc: BaseException) -> None:
        """A step (or the steps in flight) failed: data parallel, this rank's collectives are
        now behind; without the undo journal, the trainer stops (:meth:`_refuse`)."""
        if self.dp is not None:
            self.dp.abandon(f"step {self.executor.steps_run} failed on rank {self.dp.rank}")
        self._refuse(exc, f"step {self.driver.step}")

    def _committed(self, result: StepResult) -> None:
        self.last = result
        self._peaks = [max(a, b) for a, b in zip(self._peaks, result.peak_bytes)]

    @property
    def steps_done(self) -> int:
        return self.driver.step

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.driver.optimizer

    def _refuse(self, exc: BaseException, where: str) -> None:
        """Without the undo journal, a failure that may have left an update half-applied
        stops the trainer: every later step and read of the masters raises, naming it, until
        a saved state is loaded (a no-op with the journal on: the failure was undone)."""
        if self.plan_options.undo_journal:
            return
        first = (str(exc).splitlines() or [""])[0]
        if len(first) > 300:
            first = first[:300] + "..."
        self._refused = (
            f"this trainer refuses to go on: {where} failed ({type(exc).__name__}: {first}) "
            "with the undo journal off (undo_journal=False), so the masters, optimizer state "
            "and shadows may hold a half-applied update that nothing can undo, and training "
            "on would train on those weights. Restore the last checkpoint "
            "(trainer.load_checkpoint(path), or load_state_dict(state)), which lets training "
            "go on, or train with undo_journal=True (the default), which undoes a failed step")
        try:
            exc.add_note(self._refused)
        except Exception:  # an exception that takes no notes still stops the trainer
            pass

    def _settle(self) -> None:
        """In async mode, apply the last step's pending gradients (:meth:`flush`); a failed
        update raises (once) as :class:`StepFailed`.
        Refused after a failure without the undo journal (the masters may be half-updated)."""
        if self._refused:
            raise StateError(self._refused)
        self.flush()

    def flush(self) -> bool:
        """Async mode: apply the last step's gradients now (the next step's first actions
        would), so the masters are those of every step so far. Called before anything reads
        the masters or the optimizer state (``masters``, ``evaluate``, ``state_dict`` and
        checkpoints, ``sync_to_model``, ``memory_report``) and by ``close``. It cannot change
        the trajectory: the next step computes with the shadow written at the end of the step
        before (not from the masters now), and its own updates then find nothing pending
        (docs/runtime.md section 5). Returns whether anything was pending; a failed update
        is undone, leaves the gradients pending and raises :class:`StepFailed`."""
        if self._refused:
            raise StateError(self._refused)
        try:
            with self.executor.between_steps("a flush of the pending gradients (masters(), "
                                             "evaluate, state_dict, checkpoints)"):
                return self.driver.flush()
        except OptimizerError as exc:
            self._refuse(exc, "the flush of the pending gradients")
            raise StepFailed(None, None, None, exc, where="the optimizer update (a flush of "
                             "the pending gradients)", step=self.driver.pending_step,
                             message="Undone: the gradients stay pending for the next step "
                             "or flush.") from exc

    def masters(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (live views; see ``state_dict`` for
        copies), once every queued update has run. Sharded: refused, since this rank holds
        only its shard (:meth:`owned_masters`, :meth:`gather_masters`)."""
        if self.sharded:
            raise StateError(
                f"shard_optimizer=True: rank {self.dp.rank} of {self.dp.world} holds the "
                "masters of its shard only; trainer.owned_masters() gives those, "
                "trainer.gather_masters() all of them (a collective: call it on every rank)")
        self._settle()
        return {s.name: self.store.master_of(s.name) for s in self.store.trainable_slots}

    def owned_masters(self) -> dict[str, torch.Tensor]:
        """The fp32 masters this rank holds (all of them unless sharded), live views."""
        self._settle()
        return {s.name: self.store.master_of(s.name) for s in self.store.owned_slots}

    def gather_masters(self) -> dict[str, torch.Tensor]:
        """Every fp32 master by name, copies. Sharded: gathered from every rank's shard (a
        collective: call it on every rank, which then holds a full fp32 copy)."""
        self._settle()
        if self.sharded:
            return self.dp.gather_masters()
        return {s.name: self.store.master_of(s.name).clone() for s in self.store.trainable_slots}

    def sync_to_model(self) -> None:
        """Write the trained masters into the original module's parameters (cast to their
        dtype), so ``model.save_pretrained`` and plain inference see the trained weights.
        Sharded: a collective (call it on every rank); every rank's module gets all of them."""
        self._settle()
        if not self.sharded:
            self.store.load_into_module(self.compiled.model)
            return
        with torch.no_grad():
            for name, value in self.dp.gather_masters().items():
                for alias in self.store.slot(name).names:
                    self.compiled.model.get_parameter(alias).copy_(value)

    # -- inspection ----------------------------------------------------------------------------
    def peak_bytes(self) -> tuple[int, ...]:
        """Each worker's device-memory peak over every step so far, in accounted bytes: the
        weight slots, the job's fp32 gradient buffer, the buffers uploaded with the weights,
        and every activation or gradient value held between actions. Transients inside one
        compute (autograd's saved tensors) are not accounted on virtual workers."""
        return tuple(self._peaks)

    def predicted_peak_bytes(self, held: bool = False) -> tuple[int, ...]:
        """The compiler's proven peak per worker over this trainer's schedule, its steps
        overlapping as a long run runs them (:func:`rpcompile.passes.lower.runtime_peaks`;
        the compile's own ``Compiled.memory`` when the trainer runs the compile's schedule).
        ``held``: without compute working sets, which virtual workers do not account."""
        from rpcompile.passes.lower import runtime_peaks

        if self._lowered_by is None:
            peaks = self.compiled.memory
        else:
            plan, run = self._lowered_by
            peaks = runtime_peaks(plan, run)
        return tuple(p.held_bytes if held else p.peak_bytes for p in peaks)

    def memory_report(self) -> MemoryReport:
        """Host bytes kept per trainable parameter, once every queued update has run (the
        optimizer's state exists only after its first update), measured from the buffers and
        optimizer state this rank holds. Sharded: masters and optimizer state are this rank's
        1/N shard (the per-parameter figures are over all trainable parameters, so they fall
        as 1/N); the shadow and the gradient buffer stay whole."""
        if not self._refused:  # (refused: the buffers are there to count, not to flush)
            self._settle()
        return self.driver.memory_report()

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Let the steps in flight commit (a stream's), apply pending async gradients and
        stop every worker's streams. From another thread it aborts the running steps instead
        (which raise :class:`StepFailed` there). Never raises: a failure not yet reported
        becomes a warning. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.executor.in_flight and not self._refused and self.executor.drives():
                with self.executor.between_steps("close()"):
                    pass  # the steps in flight commit
        except BaseException as exc:  # close() must not raise for a step that failed
            warnings.warn(f"close(): {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        try:
            finished = self.executor.abort("the trainer was closed", wait_s=self.timeout_s or 60.0)
            if not finished:
                warnings.warn("close(): the running step did not stop in time; shutting down "
                              "anyway", RuntimeWarning, stacklevel=2)
            if finished and not self._refused:
                self.driver.flush()  # async: the last step's gradients into the masters
        except BaseException as exc:  # close() must not raise for an earlier failure
            warnings.warn(f"close(): {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        finally:
            for w in self.workers:
                w.shutdown()
            self.executor.staging.release()  # the free staging buffers (lent ones stay)

    def retire(self, why: str) -> None:
        """Close this trainer for good once its state has moved to another trainer (a new
        plan's): every later step and every read of its masters or state raises
        :class:`StateError` with ``why``, since what it still holds is no longer the run's."""
        self.close()
        self._refused = why

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The executor: runs a lowered RoundPipe :class:`~rpcompile.ir.Schedule` as a stream of steps.

Steps flow (docs/runtime.md). :meth:`Executor.start` submits the next step: every action of
the schedule step it runs becomes one item on its lane (rpcompile.runtime.lanes), waiting for
the actions its edges name, in its own step or in the steps before it, so step k+1's forward
jobs run while step k's backward jobs drain, exactly as far as the schedule's edges allow; the
round-robin counter goes on across steps. :meth:`Executor.finish` waits for the oldest step in
flight to commit and returns its :class:`StepResult`. :meth:`Executor.run_step` is one step,
submitted and committed, nothing in flight after it.

**Commit.** A step commits at its last host action (the lowering's commit point: every action
of the step has ended there), on the host queue's thread: the optimizer driver closes the step
(its journal dropped; async, its gradients made pending), the step counter advances. The host
queue holds one step open at a time: the next step's host actions come after that point.

**Failure.** Any failure in any step in flight (an action, the optimizer, the watchdog, a
stream thread, an interrupt, ``close()`` from another thread) aborts every step not yet
committed: every wait gives up within a poll, every lane drains, workers stuck past the
deadline are replaced, device memory is freed, the driver puts the open step's updates back,
the loss scaler is put back, and :class:`StepFailed` is raised naming the failing action and
the steps discarded with it. A step whose commit had begun on the host queue when the failure
came stands (the host runs the commit to its end): its result is handed back first, and the
failure at the next finish(). Masters, optimizer state, pending gradients, shadows, the loss
scaler and the step counter are then those of the last committed step, and a retry of the
same batches runs bit for bit as they would have. ``KeyboardInterrupt``/``SystemExit`` abort
the same way and re-raise as themselves.

**Runs longer than the schedule** cycle through it (``Schedule.step_of``): the runtime's
schedule (rpcompile.passes.schedule.runtime_cycle) repeats its last steps, which hold every
edge a long run has. A schedule without them (one lowered for a few steps by hand) runs its
steps overlapping only where its own edges say how; where it would wrap, the executor lets
the steps in flight commit first.

Sections, in reading order:
  1. Executor: construction and checks
  2. the stream of steps: start, finish, commit, drain
  3. failure: taking the steps in flight apart, naming the error
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import fx

from rpcompile.capture.batch import split_batch
from rpcompile.errors import InvalidInput, StateError
from rpcompile.ir import STEPS_IN_FLIGHT, Action, Schedule
from rpcompile.options import TrainOptions, deferred_reasons, update_order
from rpcompile.passes.lower import DATA_PARALLEL_PASSES, LOWERING_PASSES, updates_deferred
from rpcompile.passes.memory import check_staging
from rpcompile.passes.schedule import dispatch_period
from rpcompile.passes.staging import step_key
from rpcompile.runtime.actions import ACTION_OF, RUNTIME_ACTIONS, Actions, clip_grad_norm
from rpcompile.runtime.errors import EventTimeout, OptimizerError, RuntimeFault, WorkerError
from rpcompile.runtime.lanes import INTERRUPTS, InFlight, uninterrupted
from rpcompile.runtime.loss_scale import DynamicLossScaler
from rpcompile.runtime.memory import HostStaging, HostStore
from rpcompile.runtime.optim import OptimizerDriver
from rpcompile.runtime.results import StepAborted, StepFailed, StepResult, StepTimeout
from rpcompile.runtime.step_state import StepPlan, StepState
from rpcompile.runtime.values import bundle_names
from rpcompile.runtime.workers import Worker
from rpcompile.sim.engine import paused_gc, with_staging

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled
    from rpcompile.runtime.distributed import DataParallel

__all__ = ["RUNTIME_ACTIONS", "Executor", "StepAborted", "StepFailed", "StepResult",
           "StepTimeout", "clip_grad_norm"]

# ============================================================================================
# 1. Executor: construction and checks
# ============================================================================================


class Executor(Actions):
    """Runs a fully lowered RoundPipe schedule on ``workers`` as a stream of steps (see the
    module doc).

    ``compiled`` gives the stage programs and the captured graph; ``store`` holds the masters,
    shadows and gradients, built over the programs' parameters stage by stage (parameter names
    = ``StageInput.source``); ``driver`` runs the optimizer over the store. ``timeout_s`` bounds
    each step from the moment it is the oldest in flight (None: unbounded; failures never rely
    on it). ``options``: the run's :class:`~rpcompile.options.TrainOptions` (what the Trainer
    passes; ``None``: the defaults), whose ``kernels``, ``skip_nonfinite`` and
    ``max_grad_norm`` the executor reads. ``kernels``: backend
    of the gradient accumulation on the workers (``"auto"``: Triton on CUDA, the torch
    reference elsewhere; ``"torch"``; ``"triton"``, run by Triton's interpreter on CPU
    workers), see :mod:`rpcompile.runtime.kernels`. ``skip_nonfinite``: a step whose gradients
    hold an inf or NaN is not applied. ``loss_scaler`` (either mode): each step's backward
    starts from the loss times a scale of the scaler (:meth:`Actions._loss_scale`); its check
    unscales a clean step's gradients and skips a non-finite one (the scale backs off), as with
    torch.amp.GradScaler. ``reducer``: data parallel (rpcompile.runtime.distributed
    .DataParallel), whose steps run one at a time (its collectives are per step).
    """

    def __init__(self, compiled: Compiled, workers: Sequence[Worker], schedule: Schedule,
                 store: HostStore, driver: OptimizerDriver, *,
                 options: TrainOptions | None = None,
                 timeout_s: float | None = None,
                 loss_scaler: DynamicLossScaler | None = None,
                 reducer: DataParallel | None = None) -> None:
        options = TrainOptions() if options is None else options
        self.options = options
        if not schedule.staging_bytes:
            # A schedule lowered by hand: its host staging slots as compile() gives them.
            schedule = with_staging(schedule, compiled.plan, compiled.hardware)
            with paused_gc():
                check_staging(schedule)
        kernels, skip_nonfinite = options.kernels, options.skip_nonfinite
        max_grad_norm = options.max_grad_norm
        # Updates (both modes) are the schedule's OPT actions: where they sit in the host
        # queue is when they run. Clipping, loss scaling and skipping a non-finite step look
        # at all of the step's gradients before any update, so they need the deferred order.
        self.deferred = updates_deferred(schedule)
        if schedule.optimizer == "async":
            # Step k's OPTs apply step k-1's gradients, which the commit of step k-1 made
            # pending, and its SHADOWs write the copy of the shadow step k+1 reads
            # (rpcompile.passes.lower.optimizer._add_async_optimizer).
            driver.use_pending()
            store.add_shadow_pair()
        update_order(
            schedule.optimizer, "deferred" if self.deferred else "overlap",
            deferred_reasons(max_grad_norm=max_grad_norm, loss_scale=loss_scaler is not None,
                             skip_nonfinite=skip_nonfinite, data_parallel=reducer is not None),
            fix="a schedule lowered with updates='deferred' (rpcompile.passes.lower.lower)")
        checks = [a.step for a in schedule.host if a.kind == "CHECK"]
        if sorted(checks) != list(range(schedule.steps)):
            raise InvalidInput(
                "the schedule needs one CHECK action per step (the step's gradient check, "
                f"placed by the lowering's optimizer pass); it has them for steps {checks} of "
                f"{schedule.steps}: lower it with rpcompile.passes.lower.lower")
        self.kernels = kernels
        self.skip_nonfinite = skip_nonfinite
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        # Data parallel across ranks: the schedule's REDUCE actions launch and wait for its
        # reductions; its per-step collectives (the step's start, its check) run one step at
        # a time.
        self.reducer = reducer
        # Steps in flight at once (the schedule's in_flight edges say the same): the oldest
        # draining while the next fills the workers.
        self.in_flight_limit = 1 if reducer is not None else STEPS_IN_FLIGHT
        self.compiled = compiled
        self.workers = list(workers)
        self.schedule = schedule
        self.store = store
        self.driver = driver
        # Async: two copies of the trainable shadow, step k reading copy k % 2.
        self.paired = schedule.optimizer == "async"
        self.timeout_s = timeout_s
        self.programs = list(compiled.stages)
        self._check(schedule)
        # How far back an edge reaches: a step run again after the schedule's end waits for
        # the steps before it as its edges say only where the schedule repeats a step that has
        # all of them (Schedule.repeat_from, rpcompile.passes.schedule.runtime_cycle).
        self._reach = max((e.dst.step - e.src.step for e in schedule.edges), default=0)
        captured = compiled.capture
        unit_of = {n.name: n.meta["rp_unit"] for n in captured.graph_module.graph.nodes
                   if n.op == "call_function" and "rp_unit" in n.meta}
        self.bundles = bundle_names(self.programs, unit_of, schedule)
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
        self._plans: dict[int, StepPlan] = {}
        self._flight: InFlight | None = None
        self._driver_thread: int | None = None  # the thread whose steps are in flight
        # Results of steps committed during a drain, not yet handed back by finish().
        self._finished: collections.deque[StepResult] = collections.deque()
        # Every step submitted whose result finish() has not handed back yet, oldest first:
        # a step may commit long before the caller asks for it (its loop is slow), and its
        # result waits here.
        self._unreported: collections.deque[StepState] = collections.deque()
        # The failure of the steps in flight, raised once the results of the steps that
        # committed as it came (their commit had begun) are handed back (_fail).
        self._failed_after: BaseException | None = None
        self._last_commit = 0.0
        self._step_lock = threading.Lock()
        self._closed = ""  # why steps are refused (set by abort())
        self.abandoned: list[Worker] = []  # replaced workers whose threads were stuck
        # The host side of every download: one buffer per staging slot of the schedule,
        # pinned on a pinned CUDA run (rpcompile.runtime.memory.HostStaging).
        self.staging = HostStaging(schedule.staging_bytes,
                                   pin=any(w.pinned for w in self.workers))
        self._slot_of = {step_key(a): slot for a, slot in schedule.staging}
        self.steps_run = 0  # the run steps committed (the round-robin counter's position)
        # The loss scaler's scale after each step's check, by run step, which later steps'
        # backward starts from (Actions._loss_scale); before the first: the floor.
        self._scales: dict[int, float] = {}
        self._floor_scale: float | None = None
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
        period = dispatch_period(len(sched.stage_names) * sched.rounds, sched.workers)
        if sched.repeat_until and (sched.run_steps - sched.repeat_from) % period:
            problems.append(f"the schedule repeats steps {sched.repeat_from}.."
                            f"{sched.run_steps - 1}, not whole dispatch periods of {period} "
                            "steps (build it with rpcompile.passes.lower.runtime_schedule)")
        if problems:
            raise InvalidInput("cannot execute this schedule: " + "; ".join(problems))

    def plan_for(self, step: int) -> StepPlan:
        """The precomputed plan of the schedule step that run step ``step`` executes."""
        j = self.schedule.step_of(step)
        if j not in self._plans:
            self._plans[j] = StepPlan(self.schedule, j)
        return self._plans[j]

    def _on_worker_error(self, error: WorkerError) -> None:
        flight = self._flight
        if flight is not None:
            flight.aborted = True

    # -- lifetime ------------------------------------------------------------------------------
    def abort(self, reason: str, wait_s: float = 30.0) -> bool:
        """Refuse further steps and abort the steps in flight, if any (``close()`` from another
        thread): their waits give up within a poll, they are taken apart, and the thread
        running them gets :class:`StepFailed`. Returns False when they were not taken apart
        within ``wait_s``."""
        self._closed = reason
        flight = self._flight
        if flight is not None:
            flight.abort_with(reason)
        if not self._step_lock.acquire(timeout=wait_s):
            return False
        try:
            flight = self._flight
            if flight is not None:  # steps in flight that no thread is waiting for
                try:
                    self._fail(flight)
                except (StepFailed, *INTERRUPTS):
                    pass
            self._finished.clear()
            self._unreported.clear()
            self._failed_after = None
        finally:
            self._step_lock.release()
        return True

    @contextmanager
    def between_steps(self, what: str) -> Iterator[None]:
        """Hold off steps while ``what`` runs (a flush of the pending gradients, which a step
        starting meanwhile would apply a second time, a checkpoint): the steps in flight
        commit first (their results wait for :meth:`finish`). Refused at once while another
        thread runs steps, as a second ``step()`` is."""
        with self._driving(what):
            self._drain()
            yield

    @contextmanager
    def _driving(self, what: str) -> Iterator[None]:
        """One thread at a time runs steps, the one whose steps are in flight."""
        if not self._step_lock.acquire(blocking=False):
            raise StateError(
                f"{what} was called while a step is running from another thread: a trainer "
                "runs one step at a time, in order, from one thread. Call step() (and what "
                "reads the masters) from one thread, or serialize the calls with a lock.")
        try:
            if self._driver_thread not in (None, threading.get_ident()):
                raise StateError(
                    f"{what} was called while another thread's steps are in flight: a "
                    "trainer runs one step at a time, in order, from one thread; finish that "
                    "thread's steps (or flush them from it) first.")
            yield
        finally:
            self._step_lock.release()

    # ========================================================================================
    # 2. the stream of steps
    # ========================================================================================

    def drives(self) -> bool:
        """Whether this thread may run steps now (no other thread's are running or in
        flight)."""
        return not self._step_lock.locked() and \
            self._driver_thread in (None, threading.get_ident())

    @property
    def in_flight(self) -> int:
        """Steps submitted and not yet committed."""
        flight = self._flight
        return 0 if flight is None else len(flight.steps)

    @property
    def next_step(self) -> int:
        """The run step the next :meth:`start` submits."""
        return self.steps_run + self.in_flight

    def run_step(self, batch: Mapping[str, torch.Tensor]) -> StepResult:
        """Run one optimizer step over ``batch`` (a normalized batch dict, dim 0 = sequences),
        start to commit, and return what it measured; raises :class:`StepFailed` (the state is
        the last committed step's). ``KeyboardInterrupt`` and ``SystemExit`` during the step
        abort it the same way and re-raise as themselves. One step at a time: a call while
        another thread's step runs raises at once."""
        with self._driving("step()"):
            if self._closed:
                raise StateError(f"cannot run a step: {self._closed}")
            self._raise_failed_after()
            if self.in_flight or self._finished or self._unreported:
                raise StateError(
                    "step() was called with steps of a stream still in flight (or their "
                    "results not yet taken): finish the stream (Trainer.fit) or flush() it "
                    "first")
            self._start(batch)
            self._flight.end_steps()
            result = self._finish()
            self._raise_failed_after()  # it committed as a failure came: the step stands
            return result

    def start(self, batch: Mapping[str, torch.Tensor],
              after_commit: Callable[[], object] | None = None) -> int:
        """Submit the next step on ``batch`` (a normalized batch dict) while the steps before
        it may still run; returns its run step. At most ``in_flight_limit`` steps are in
        flight: :meth:`finish` the oldest first. ``after_commit``: called on the host queue
        once the step has committed, before the next step opens (it reads the
        hyperparameters as they are then); if it raises, the steps after it fail."""
        with self._driving("a step"):
            if self._closed:
                raise StateError(f"cannot run a step: {self._closed}")
            if self.failure_held:
                raise StateError("the steps after the last committed one failed: finish() "
                                 "raises that failure; take it before starting another step")
            if self.in_flight >= self.in_flight_limit:
                raise StateError(f"{self.in_flight} steps are in flight, the most at once: "
                                   "finish() the oldest before starting another")
            return self._start(batch, after_commit)

    def finish(self) -> StepResult:
        """Wait for the oldest step in flight to commit and return its result (raises
        :class:`StepFailed` if it, or any step in flight with it, failed: they are all
        discarded). When it was the last step in flight, the workers are idle after it."""
        with self._driving("a step"):
            return self._finish()

    def end_steps(self) -> None:
        """No more steps join the ones in flight (the caller's batches ended): a step's wait
        for the next step's upload on its worker is met (``InFlight.end_steps``)."""
        with self._driving("a step"):
            if self._flight is not None:
                self._flight.end_steps()

    def _start(self, batch: Mapping[str, torch.Tensor],
               after_commit: Callable[[], object] | None = None) -> int:
        k = self.next_step
        if self._flight is not None and (not self._overlaps(k)
                                         or self._flight.last_step is not None):
            # The schedule has no waits from this step into the ones before, or the run of
            # steps in flight was ended: they commit first.
            self._drain()
        flight = self._flight
        if flight is None:
            for w in self.workers:
                w.check()
                w.reset_peak()
            flight = self._flight = InFlight(self.workers, self.steps_run, self.timeout_s,
                                             network=bool(self.schedule.network))
            self._driver_thread = threading.get_ident()
            self._last_commit = flight.start
        parts = split_batch(batch, self.compiled.microbatches * self.compiled.rounds)
        state = StepState(k, self.plan_for(k), parts, flight)
        state.after_commit = after_commit
        flight.add_step(state)
        self._unreported.append(state)
        if len(flight.steps) == 1:
            self._start_clock(flight, state)
        step_of = self.schedule.step_of
        host = state.plan.queues.get((None, "host"), ())
        for (w, stream), actions in state.plan.queues.items():
            for a in actions:
                waits = flight.sources(state, a, step_of)
                if w is not None:
                    self.workers[w].submit(stream, lambda a=a, waits=waits: flight.act(
                        self._action, state, a, waits, timed=False), str(a))
                    continue
                lane = flight.host if stream == "host" else flight.network
                if host and a is host[0]:
                    lane.put(lambda: self._open(state))
                lane.put(lambda a=a, waits=waits: flight.act(self._action, state, a, waits,
                                                             timed=True))
                if a is state.plan.last_host:
                    lane.put(lambda: self._commit(state))
        return k

    def _overlaps(self, k: int) -> bool:
        """Whether step ``k`` may start while the steps before it run: its schedule step
        holds every wait on them (a repeated step of the runtime's schedule does, or one the
        schedule runs after the steps it follows)."""
        sched = self.schedule
        return k < sched.run_steps or bool(sched.repeat_until
                                           and sched.repeat_from >= self._reach)

    def _start_clock(self, flight: InFlight, state: StepState) -> None:
        """``state`` is now the oldest step in flight: the watchdog's clock starts."""
        state.started = time.perf_counter()
        state.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        flight.deadline = state.deadline

    def _action(self, state: StepState, a: Action) -> None:
        ACTION_OF[a.kind](self, state, a)

    def _open(self, state: StepState) -> None:
        """On the host queue, before the step's first host action: the driver opens it (the
        step before has committed: its host actions all come first)."""
        try:
            self.driver.begin_step()
            state.opened = True
        except BaseException as exc:
            state.flight.fail_outside("the host, opening the step", exc)
            raise

    def _commit(self, state: StepState) -> None:
        """On the host queue, right after the step's last host action, its commit point
        (every action of the step has ended): the driver closes the step, the counter
        advances, the result is ready."""
        flight = state.flight
        try:
            if not state.checked:
                raise StateError("the step ended without running its CHECK action: the "
                                   "schedule lacks one (lower it with the optimizer pass)")
            if state.skipped and not self.paired:
                self.driver.discard_step()
            else:
                self.driver.commit_step(skipped=state.skipped)
            state.opened = False
        except BaseException as exc:
            flight.fail_outside(f"the host, committing step {state.k}", exc)
            raise
        if self.paired:  # the next step reads the copy this step's SHADOWs wrote
            self.store.shadow_version = (state.k + 1) % 2
        now = time.perf_counter()
        peaks = tuple(w.peak_bytes for w in self.workers)
        for w in self.workers:
            w.reset_peak()
        state.result = StepResult(
            state.loss, state.plan.step, now - max(state.submitted, self._last_commit), peaks,
            timeline=dict(state.timeline), found_nonfinite=state.found,
            nonfinite_jobs=state.bad, skipped=state.skipped, grad_norm=state.grad_norm,
            idle_updates=tuple(state.idle_updates), step=state.k,
            correct_tokens=state.correct)
        self._last_commit = now
        self.steps_run = state.k + 1
        flight.committed(state.k)
        after = flight.steps.get(state.k + 1)
        if after is not None:
            self._start_clock(flight, after)
        else:
            flight.deadline = None
        state.committed.set()
        if state.after_commit is not None:
            try:
                state.after_commit()
            except BaseException as exc:  # the step stands; the ones after it fail
                flight.fail_outside(f"the host, after step {state.k} committed", exc)
                raise

    def _finish(self) -> StepResult:
        if self._finished:
            return self._finished.popleft()
        self._raise_failed_after()
        first, *late = self._await_oldest()
        self._finished.extend(late)
        return first

    @property
    def failure_held(self) -> bool:
        """Whether a failure waits for :meth:`finish` (it came as the steps before it
        committed, and their results were handed back first)."""
        return self._failed_after is not None

    def _raise_failed_after(self, *, results_first: bool = True) -> None:
        """Raise the failure that came as the steps before it committed: once their results
        are handed back, or (``results_first=False``) now, their results waiting for
        :meth:`finish`."""
        if self._failed_after is not None and not (results_first and self._finished):
            error, self._failed_after = self._failed_after, None
            raise error

    def _await_oldest(self) -> list[StepResult]:
        """Wait for the oldest step not yet handed back to commit (it may have already) and
        return its result (and, when a failure came as it committed, those of the steps after
        it that committed too: :meth:`_fail`); the run of steps ends after the last one (the
        workers idle)."""
        if not self._unreported:
            raise StateError("no step in flight to finish: start() one first")
        state = self._unreported[0]
        flight = state.flight
        interrupts: list[BaseException] = []
        try:
            while not state.committed.wait(0.02):
                if flight.abort_requested():
                    break
        except INTERRUPTS as exc:  # a Ctrl-C while waiting: every step in flight aborts
            interrupts.append(exc)
            flight.aborted = True
        if not state.committed.is_set():
            # Raises, unless this step committed as the failure came: then its result and
            # those of any after it that did too, and the failure after them (_failed_after).
            return self._fail(flight, interrupts)
        self._unreported.popleft()
        result = state.result
        if not flight.steps and not self._unreported:  # the workers are idle: the run ends
            result = _with_left_over(result, self._close(flight))
            if interrupts:  # the step committed as the interrupt came: it stands
                raise interrupts[0]
        elif interrupts:  # the steps after it abort, and the next finish() raises it
            with flight.lock:
                if flight.root is None:
                    flight.root = ("the caller", interrupts[0])
        return [result]

    def _drain(self) -> None:
        """Let every step in flight commit (their results wait for :meth:`finish`); the
        workers are idle after it. Raises :class:`StepFailed` if one fails."""
        if self._flight is not None:
            self._flight.end_steps()
        while self._unreported:
            self._finished.extend(self._await_oldest())
        self._raise_failed_after(results_first=False)

    def _close(self, flight: InFlight) -> tuple[int, ...]:
        """End a run of steps that all committed: stop the host's lanes, give back what the
        schedule gives back at a compute of a step that did not come, and free what the
        workers still hold; returns each worker's bytes held before that last freeing (0 when
        every action freed what the schedule says it frees)."""
        for lane in (flight.host, flight.network):
            if lane is not None:
                lane.stop()
                lane.join(None)
        for (_k, compute), held in flight.given_back.items():
            for owner, what in held:
                self._release(owner, compute.worker, what)
        flight.given_back.clear()
        left_over = tuple(w.memory_in_use for w in self.workers)
        for i, worker in enumerate(self.workers):
            flight.holds[i].release_all()
            worker.free_all()
        self._flight = None
        self._driver_thread = None
        return left_over

    def reset_scales(self) -> None:
        """Forget the loss scales of the steps run so far (a state was loaded): the next
        steps' backward starts from the scaler's scale as loaded."""
        self._scales.clear()
        self._floor_scale = None

    # ========================================================================================
    # 3. failure
    # ========================================================================================

    def _fail(self, flight: InFlight,
              interrupts: list[BaseException] | None = None) -> list[StepResult]:
        """Take every step in flight apart (see the module doc) and raise: the interrupt that
        came, else :class:`StepFailed` (:class:`StepTimeout` for the watchdog).

        A step whose commit had begun on the host queue when the failure came runs it to the
        end (the lanes drain): it stands, like every step before it. Steps commit in order,
        so those are the oldest not handed back: this returns their results, and the failure
        waits in ``_failed_after`` until finish() has handed them back. The steps discarded
        are those still uncommitted once the lanes drained."""
        interrupts = [] if interrupts is None else interrupts
        flight.aborted = True
        stuck = uninterrupted(flight.drain, interrupts, flight)
        late = []
        while self._unreported and self._unreported[0].committed.is_set():
            late.append(self._unreported.popleft().result)
        self._unreported.clear()
        discarded = sorted(flight.steps)
        try:
            uninterrupted(lambda: flight.take_apart(self._replace, self.timeout_s or 60.0),
                          interrupts, flight)
        except BaseException:
            # No copy's state is known after a failed clean-up: what the steps took is set
            # aside, never lent again.
            self.staging.quarantine(flight.taken)
            raise
        uninterrupted(lambda: self._settle_staging(flight), interrupts, flight)
        if self.reducer is not None:
            self.reducer.abandon(f"step {discarded[0] if discarded else self.steps_run} "
                                 "failed on this rank")
        try:
            uninterrupted(lambda: self._discard(flight), interrupts, flight)
        finally:  # the steps are gone even when the driver refuses to discard (no journal)
            self._flight = None
            self._driver_thread = None
        interrupt = interrupts[0] if interrupts else flight.interrupt()
        if interrupt is None:
            interrupt = self._timeout_error(flight, stuck, discarded) \
                if stuck or (flight.timed_out and not flight.roots() and flight.root is None) \
                else self._step_error(flight, discarded)
        if late:
            self._failed_after = interrupt
            return late
        if isinstance(interrupt, INTERRUPTS):
            raise interrupt
        raise interrupt from interrupt.__cause__

    def _discard(self, flight: InFlight) -> None:
        """The host's side of the steps in flight goes back to the last committed step: the
        driver's open step is discarded (its journal undoes its updates; async, the pending
        gradients stay), the loss scaler is put back as before the first discarded step's
        check, and their scales are forgotten."""
        if self.driver._open is not None:
            self.driver.discard_step()
        states = [flight.steps[k] for k in sorted(flight.steps)]
        for state in states:
            if state.scaler_before is not None:
                self.loss_scaler.load_state_dict(state.scaler_before)
                break
        for state in states:
            self._scales.pop(state.k, None)

    def _settle_staging(self, flight: InFlight) -> None:
        """After a failure (the lanes drained): the staging buffers the steps took and did
        not give back go back to the pool once no copy can touch them, every GPU idle. If a
        worker was replaced, or a GPU cannot be waited on, a copy may still write into them:
        they are set aside for good (held, never lent again), not risked."""
        safe = not flight.replaced
        if safe:
            try:
                for worker in self.workers:
                    if worker.kind == "cuda":
                        torch.cuda.synchronize(worker.device)
            except Exception:  # a failed device: its copies' state is unknown
                safe = False
        if safe:
            self.staging.reclaim(flight.taken)
        else:
            self.staging.quarantine(flight.taken)

    def _replace(self, i: int, worker: Worker) -> None:
        fresh = worker.respawn()
        fresh.add_error_listener(self._on_worker_error)
        self.workers[i] = fresh
        worker.shutdown(timeout=0.0, warn=False)  # its daemon threads are abandoned
        self.abandoned.append(worker)

    def _timeout_error(self, flight: InFlight, stuck: Mapping[int, Mapping[str, str]],
                       discarded: Sequence[int]) -> StepTimeout:
        where = "; ".join(
            f"worker {self.workers[i].name}: " + ", ".join(f"{s} running {lbl!r}"
                                                         for s, lbl in streams.items())
            for i, streams in stuck.items()) or "waiting on the host"
        step = discarded[0] if discarded else self.steps_run
        cause = EventTimeout(
            f"step {step} did not finish within timeout_s={self.timeout_s} ({where})")
        return StepTimeout(
            None, None, None, cause, where="the watchdog", step=self.driver.step,
            message="The step's gradients were discarded and the masters kept; the stuck "
            "workers were replaced by fresh ones (their threads are abandoned), so step() can "
            "be called again. Raise timeout_s if the step is only slow.", discarded=discarded)

    def _step_error(self, flight: InFlight, discarded: Sequence[int]) -> StepFailed:
        roots = flight.roots()
        if flight.root is not None:
            where, cause = flight.root
            others = [f"'{a}': {type(e).__name__}" for _k, a, e in roots][:8]
            if isinstance(cause, OptimizerError):
                return StepFailed.from_update(cause, discarded)
            return StepFailed(None, None, None, cause, others, where=where,
                              step=self.driver.step, discarded=discarded)
        if not roots:
            # Nothing of ours failed first: a wait gave up because a worker failed outside
            # any action (a stream loop, an error listener); re-raise that root.
            ordered = sorted(flight.worker_errors, key=lambda we: we[1].secondary)
            for name, err in ordered:
                return StepFailed(None, None, name, err,
                                  where=f"worker {name}, stream {err.stream}, {err.label!r}",
                                  step=self.driver.step, discarded=discarded)
            return StepFailed(None, None, None,
                              RuntimeFault("the steps failed without a recorded cause"),
                              where="the host", step=self.driver.step, discarded=discarded)
        _k, action, cause = roots[0]
        if isinstance(cause, StepFailed):  # already named (data parallel: another rank failed)
            return cause
        if isinstance(cause, OptimizerError):  # an OPT's update: the discard undid it
            return StepFailed.from_update(cause, discarded)
        others = [f"'{a}': {type(e).__name__}" for _k, a, e in flight.failures
                  if a is not action][:8]
        worker = None if action.worker is None else self.workers[action.worker].name
        return StepFailed(action, self.programs[action.stage].name, worker, cause, others,
                          discarded=discarded)


def _with_left_over(result: StepResult, left_over: tuple[int, ...]) -> StepResult:
    return dataclasses.replace(result, left_over_bytes=left_over)

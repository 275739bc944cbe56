"""The lane runner: the steps in flight, each action on its lane, waits, failure and drain.

Every action of a step becomes one item on its lane: its worker's stream (compute,
weight_upload, activation_upload, download: ``Worker.submit``), the host queue or the host's
network lane, each of which one thread of its own runs in order (:class:`Lane`). An item first
waits for the actions its edges name, in its own step or in a step before it (one event per
action and run step), then does its work, then sets its event. Nothing else orders work: that
is the schedule's protocol, and chaos mode on the workers shakes out any wait it lacks.

:class:`InFlight` is what the steps in flight share between two idle points of the workers:
the events, the memory one step's download gives back before another step's compute
(``Schedule.releases`` across steps), the workers' value holds, the staging buffers taken, the
abort flag and the failures. Any failure aborts every step in flight: every wait gives up
within a poll, and :meth:`InFlight.drain` then stops every lane, finds the streams stuck in an
item past the watchdog's deadline, and :meth:`InFlight.take_apart` frees the workers (replacing
a stuck one) for the executor to discard what the steps changed on the host.

Sections, in reading order:
  1. Lane      - a host thread running its items in order
  2. InFlight  - events, aborts, the action wrapper, the drain and the clean-up
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rpcompile.errors import StateError
from rpcompile.ir import Action
from rpcompile.runtime.errors import EventTimeout, UpstreamFailed, WorkerAborted, WorkerError
from rpcompile.runtime.results import StepAborted
from rpcompile.runtime.step_state import StepState
from rpcompile.runtime.values import Holds
from rpcompile.runtime.workers import Event, Worker

__all__ = ["INTERRUPTS", "SECONDARY", "InFlight", "Lane", "grace", "uninterrupted"]

SECONDARY = (WorkerAborted, UpstreamFailed)
INTERRUPTS = (KeyboardInterrupt, SystemExit)


def grace(timeout_s: float | None) -> float:
    """How long lanes get to drain after the watchdog fired (their waits abort within a
    poll; a lane still busy after that is stuck)."""
    return min(2.0, max(0.05, 0.05 * (timeout_s or 0.0)))


def uninterrupted(fn: Callable[[], Any], interrupts: list[BaseException],
                  flight: InFlight) -> Any:
    """Run ``fn`` (idempotent clean-up) to the end: a KeyboardInterrupt or SystemExit arriving
    meanwhile is kept in ``interrupts`` (re-raised by the caller afterwards) and ``fn`` runs
    again."""
    while True:
        try:
            return fn()
        except INTERRUPTS as exc:
            interrupts.append(exc)
            flight.aborted = True


# ============================================================================================
# 1. Lane
# ============================================================================================


class Lane:
    """One host thread running callables in the order they were put, for as long as the
    steps in flight last: the host queue (ACC, OPT, SHADOW, CHECK and each step's opening and
    commit) and the network lane (REDUCE). An item's failure is recorded by the item itself
    (:meth:`InFlight.act`); after it, and after any abort, the lane drops what is left."""

    _STOP = object()

    def __init__(self, name: str, flight: InFlight) -> None:
        self.name = name
        self._flight = flight
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=f"rpcompile-{name}",
                                        daemon=True)
        self._thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        self._items.put(fn)

    def stop(self) -> None:
        """No more items: the thread ends once it has run (or dropped) those put before."""
        self._items.put(self._STOP)

    def join(self, timeout: float | None) -> bool:
        """Whether the thread ended within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        while True:
            fn = self._items.get()
            if fn is self._STOP:
                return
            if self._flight.aborted:
                continue  # dropped: a step in flight failed
            try:
                fn()
            except BaseException:  # recorded by the item; the lane drops the rest
                self._flight.aborted = True


# ============================================================================================
# 2. InFlight
# ============================================================================================


class InFlight:
    """The steps in flight between two idle points of the workers (see the module doc).
    ``first``: the run step the first of them is; steps before it are all committed and done,
    so a wait on one of their actions is met."""

    def __init__(self, workers: Sequence[Worker], first: int, timeout_s: float | None,
                 network: bool) -> None:
        self.workers = workers  # the executor's list: it replaces stuck workers in place
        self.timeout_s = timeout_s
        self.start = time.perf_counter()
        self.lock = threading.Lock()
        self.events: dict[tuple[int, Action], Event] = {}
        self.steps: dict[int, StepState] = {}  # submitted, not yet committed
        self.last_step: int | None = None  # set by end_steps: no later step joins
        self.done_below = first  # every run step below this is committed
        self.aborted = False
        self.deadline: float | None = None  # the oldest step's: the watchdog fires at it
        self.failures: list[tuple[int, Action, BaseException]] = []
        self.root: tuple[str, BaseException] | None = None  # a failure outside any action
        self.timed_out = False
        self.holds = [Holds() for _ in workers]
        # (run step, compute) -> what downloads sent home, given back as that compute starts
        self.given_back: dict[tuple[int, Action], list[tuple[StepState, Any]]] = {}
        self.taken: list = []  # every staging buffer the steps took (HostStaging.take)
        self.stuck: dict[int, dict[str, str]] = {}
        self.replaced: set[int] = set()
        self.worker_errors: list[tuple[str, WorkerError]] = []
        self._next_health = 0.0
        self.host = Lane("host", self)
        self.network = Lane("network", self) if network else None

    # -- events --------------------------------------------------------------------------
    def add_step(self, state: StepState) -> None:
        """Register a submitted step: one event per action, which what waits on it holds
        (an action of it that an earlier step's wait already named keeps that event)."""
        if self.last_step is not None:
            raise StateError("this run of steps was ended (end_steps): start a new one")
        with self.lock:
            self.steps[state.k] = state
            for a in state.plan.actions:
                self.events.setdefault((state.k, a), Event(f"{a} (step {state.k})"))

    def sources(self, state: StepState, a: Action, step_of: Callable[[int], int]
                ) -> list[Event]:
        """The events ``a`` of ``state``'s step waits for: each edge's source in its run step
        (``d`` steps back; a worker's next upload, one step ahead), as the schedule step that
        run step executes holds it; a source in a committed step is done already and needs
        no wait. A source in a step not submitted yet gets its event now."""
        out = []
        with self.lock:
            for d, src in state.plan.waits.get(a, ()):
                k = state.k - d
                if k < self.done_below:
                    continue
                if d:
                    src = dataclasses.replace(src, step=step_of(k))
                out.append(self.events.setdefault((k, src), Event(f"{src} (step {k})")))
        return out

    def end_steps(self) -> None:
        """No step after those submitted joins this run of steps: the waits on actions of a
        later step (an EVICT waiting for the next step's upload on its worker, ``landed``)
        are met, as that upload does not happen in this run."""
        with self.lock:
            self.last_step = self.done_below + len(self.steps) - 1
            for (k, _a), event in self.events.items():
                if k > self.last_step:
                    event.set()

    def committed(self, k: int) -> None:
        """Step ``k`` committed: its actions all ended, so what waits on them is met."""
        with self.lock:
            self.steps.pop(k, None)
            self.done_below = k + 1
            for key in [key for key in self.events if key[0] <= k]:
                del self.events[key]

    # -- aborts --------------------------------------------------------------------------
    def abort_requested(self) -> bool:
        """Polled by every blocked wait: a step failed, or a stream thread died (checked at
        most every 20 ms), or the watchdog's deadline passed."""
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
                self.timed_out = self.aborted = True
                return True
        return False

    def abort_with(self, reason: str, where: str = "the trainer") -> None:
        with self.lock:
            if self.root is None:
                self.root = (where, StepAborted(reason))
            self.aborted = True

    def fail(self, k: int, action: Action, exc: BaseException) -> None:
        with self.lock:
            self.failures.append((k, action, exc))
            self.aborted = True

    def fail_outside(self, where: str, exc: BaseException) -> None:
        """A failure outside any action (opening or committing a step on the host queue)."""
        with self.lock:
            if self.root is None:
                self.root = (where, exc)
            self.aborted = True

    # -- one action ----------------------------------------------------------------------
    def act(self, run: Callable[[StepState, Action], None], state: StepState, a: Action,
            waits: Sequence[Event], *, timed: bool) -> None:
        """One action of any lane: wait for ``waits``, run it, set its event. ``timed``: the
        waits end at the step's deadline (the host's lanes); otherwise they end when the
        event is recorded or the steps in flight abort (the stream threads, whose items
        :meth:`drain` finds stuck). A failure is recorded (not a secondary one, which
        another failure caused), fails the action's event so that what waits on it gives
        up, and is re-raised; a host wait past the deadline is the watchdog's (it names the
        stuck streams)."""
        event = self.events[(state.k, a)]
        try:
            for source in waits:
                if timed:
                    source.wait(state.left(), abort=self.abort_requested)
                else:
                    source.wait_recorded(abort=self.abort_requested)
            if self.aborted:
                raise WorkerAborted(f"steps aborted before '{a}' ran")
            begin = time.perf_counter()
            run(state, a)
            state.record(a, begin, time.perf_counter())
        except BaseException as exc:
            if timed and isinstance(exc, EventTimeout):
                self.timed_out = self.aborted = True
            elif not isinstance(exc, SECONDARY):
                self.fail(state.k, a, exc)
            event.fail(exc)
            raise
        event.set()

    # -- drain and clean-up --------------------------------------------------------------
    def drain(self) -> dict[int, dict[str, str]]:
        """After an abort: every lane has run or dropped everything put on it, or has outlived
        the deadline (plus a grace): then the worker index -> its stuck streams and items. A
        lane thread still waiting is abandoned (a daemon thread)."""
        for lane in (self.host, self.network):
            if lane is None:
                continue
            lane.stop()
            left = None if self.deadline is None else max(0.0, self.deadline -
                                                          time.monotonic())
            if not lane.join(None if left is None else left + grace(self.timeout_s)):
                self.abort_with(f"the host's {lane.name} lane did not finish by the step's "
                                "deadline", where=f"the {lane.name} lane")
        stuck: dict[int, dict[str, str]] = {}
        for i, worker in enumerate(self.workers):
            if i in self.stuck:
                continue
            left = None if self.deadline is None else self.deadline - time.monotonic()
            if left is not None and left <= 0:
                left = grace(self.timeout_s)  # past the deadline: a short grace
            if worker.dead_streams():
                continue  # its queue has no consumer: replaced below
            try:
                worker.synchronize(left)
            except EventTimeout:
                stuck[i] = worker.busy_streams() or {"?": "unknown item"}
            except INTERRUPTS:
                raise  # kept by the caller, which drains again
            except BaseException:  # a failed worker: take_apart recovers it
                busy = worker.busy_streams()
                if busy and self.deadline is not None and time.monotonic() >= self.deadline:
                    stuck[i] = busy  # still inside an item past the deadline: replace it
        for i, worker in enumerate(self.workers):
            if i not in stuck and worker.dead_streams():
                stuck[i] = {s: "dead thread" for s in worker.dead_streams()}
        self.stuck.update(stuck)
        self.worker_errors = [(w.name, e) for w in self.workers for e in w.errors]
        return dict(self.stuck)

    def take_apart(self, replace: Callable[[int, Worker], None],
                   recover_timeout: float) -> None:
        """Free the device memory the steps held; a failed worker first drains every
        stream. A worker with a stream stuck in an item (or a dead stream thread) is
        replaced by a fresh one (``replace``): an item that never returns cannot be
        interrupted, but it need not hold up the run."""
        for i, worker in enumerate(self.workers):
            if i in self.stuck and i not in self.replaced:
                replace(i, worker)
                self.replaced.add(i)
                continue
            if worker.errors:
                try:
                    worker.recover(timeout=recover_timeout)
                except EventTimeout:
                    # A stream that never drains is stuck in an item: replace the worker.
                    replace(i, worker)
                    self.replaced.add(i)
                    continue
            self.holds[i].release_all()
            worker.free_all()

    def roots(self) -> list[tuple[int, Action, BaseException]]:
        return [(k, a, e) for k, a, e in self.failures if not isinstance(e, SECONDARY)]

    def interrupt(self) -> BaseException | None:
        """A KeyboardInterrupt or SystemExit an action raised (on its lane's thread), which
        the caller re-raises as itself once the steps are taken apart."""
        for _k, _a, exc in self.failures:
            if isinstance(exc, INTERRUPTS):
                return exc
        if self.root is not None and isinstance(self.root[1], INTERRUPTS):
            return self.root[1]
        return None

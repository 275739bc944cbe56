"""One step of a run: what the executor works out once per schedule step (:class:`StepPlan`,
read-only while steps run) and what one running step holds (:class:`StepState`).

A run's step ``k`` executes schedule step ``j = schedule.step_of(k)``. An edge into an action
of step ``j`` from an action of step ``j - d`` means the action of the run's step ``k - d``:
steps overlap, so a job of step k+1 may wait for a job of step k on its worker (a weight slot,
a gradient slot, an input's window) or for step k's shadow. :class:`StepPlan` keeps each wait
as ``(d, source)``; the lanes resolve it against the steps in flight
(rpcompile.runtime.lanes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.ir import Action, Flow, Schedule
from rpcompile.runtime.values import HOST_VALUES, JobGrads

if TYPE_CHECKING:
    from rpcompile.runtime.lanes import InFlight
    from rpcompile.runtime.results import StepResult

__all__ = ["StepPlan", "StepState"]

# (worker, value, microbatch, round): a value a compute produced, kept on its worker
DeviceKey = tuple[int, str, int, int]


class StepPlan:
    """What the executor precomputes for one schedule step ``j`` (read-only while it runs):
    its actions per lane, each action's waits as ``(steps back, source)``, the readers of each
    value, and where what a download sends home is given back."""

    def __init__(self, schedule: Schedule, step: int) -> None:
        self.step = step
        self.queues: dict[tuple[int | None, str], list[Action]] = {}
        for q, actions in schedule.queues().items():
            mine = [a for a in actions if a.step == step]
            if mine:
                self.queues[q] = mine
        here = {a for lst in self.queues.values() for a in lst}
        self.actions = tuple(here)
        # Every edge into this step: the source ran ``d`` steps before (0: in this step).
        self.waits: dict[Action, list[tuple[int, Action]]] = {}
        for e in schedule.edges:
            if e.dst in here:
                self.waits.setdefault(e.dst, []).append((step - e.src.step, e.src))
        self.compute_of = {(a.kind, a.stage, a.microbatch, a.round): a
                           for a in here if a.is_compute}
        # Readers of each value kept on its producer's worker: same-worker consumer computes
        # plus the value's D2H. Readers of each value staged on the host: the remote H2Ds.
        self.device_readers: dict[DeviceKey, int] = {}
        self.host_readers: dict[tuple[str, int, int], int] = {}
        self.local_inputs: dict[Action, list[tuple[Flow, DeviceKey]]] = {}
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
            elif a.kind == "H2D" and a.value not in HOST_VALUES:
                key = (a.value, a.microbatch, a.round)
                self.host_readers[key] = self.host_readers.get(key, 0) + 1
        # D2H -> (steps ahead, the compute) before which the device memory it sent home is
        # given back (a gradient slot, a value's "sent" wait; Schedule.releases), in this step
        # or a later one. A D2H of the schedule's last step whose compute would be in the
        # step after it has none: its memory is given back when the download ends.
        self.releases = {d: (c.step - step, c) for d, c in schedule.releases().items()
                         if d in here}
        self.job_first: set[Action] = set()  # first compute of each job
        self.job_last: set[Action] = set()  # last compute of each job
        for (_, stream), lst in self.queues.items():
            if stream != "compute":
                continue
            previous = None
            for a in lst:
                if not a.is_compute:
                    continue
                if previous is None or (previous.stage, previous.round) != (a.stage, a.round):
                    self.job_first.add(a)
                    if previous is not None:
                        self.job_last.add(previous)
                previous = a
            if previous is not None:
                self.job_last.add(previous)
        self.last_host = self.queues[(None, "host")][-1] if (None, "host") in self.queues \
            else None


class StepState:
    """What one running step (run step ``k``) holds: its batch, its values on the workers and
    on the host, its gradient buffers, its losses and gradient check, its clock. The lanes
    and the action implementations share it under ``lock``; ``flight`` is what the steps in
    flight share (events, memory given back across steps)."""

    def __init__(self, k: int, plan: StepPlan, parts: list[dict[str, torch.Tensor]],
                 flight: InFlight) -> None:
        self.k = k
        self.plan = plan
        self.parts = parts
        self.flight = flight
        self.lock = threading.Lock()
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when it became the oldest step in flight
        # Run on the host queue once the step has committed, before the next step opens (a
        # stream's LR scheduler: the next step's hyperparameters are then the stepped ones).
        self.after_commit: Callable[[], object] | None = None
        self.deadline: float | None = None  # time.monotonic() the watchdog fires at
        self.device_readers = dict(plan.device_readers)
        self.host_readers = dict(plan.host_readers)
        # (worker, stage, round) -> the job's weights (rpcompile.runtime.actions.JobWeights)
        self.weights: dict[tuple[int, int, int], Any] = {}
        # (worker, stage, round) -> the job's flat fp32 gradients and where they go
        self.grads: dict[tuple[int, int, int], JobGrads] = {}
        # (stage, round) -> the job's non-finite flag, downloaded with its gradients
        self.nonfinite: dict[tuple[int, int], torch.Tensor] = {}
        # tensors a compute produced, kept on the device
        self.device_values: dict[DeviceKey, dict[str, Any]] = {}
        # (worker, stage, microbatch, round) -> tensors H2Ds brought in for that compute
        self.delivered: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.host_values: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.host_grads: dict[tuple[int, int], torch.Tensor] = {}
        # host_values' and host_grads' keys -> the staging buffer their tensors live in
        # (the executor's HostStaging), given back once read
        self.host_bufs: dict[tuple, torch.Tensor] = {}
        self.losses: dict[tuple[int, int], torch.Tensor] = {}
        # (round, microbatch) -> the tail's count of labelled tokens predicted right, on the host
        self.hits: dict[tuple[int, int], torch.Tensor] = {}
        self.timeline: dict[Action, tuple[float, float]] = {}
        self.loss_scale: float | None = None  # the tail's backward starts from loss * this
        # The step's gradient check, made by its CHECK action once every gradient is home
        # (right after the step's last ACC): non-finite jobs, skipped, the norm.
        self.checked = False
        self.bad: tuple[tuple[str, int], ...] = ()
        self.skipped = False
        self.grad_norm: float | None = None
        self.idle_updates: list[Action] = []  # async OPTs with nothing pending (StepResult)
        self.loss: torch.Tensor | None = None  # the step's loss (data parallel: every rank's)
        self.correct: int | None = None  # its labelled tokens predicted right (every rank's)
        self.found = False  # a non-finite gradient on this rank (data parallel: on any rank)
        self.opened = False  # the optimizer driver opened this step (its first host action)
        self.scaler_before: dict[str, Any] | None = None  # the loss scaler before its check
        self.committed = threading.Event()
        self.result: StepResult | None = None

    def left(self) -> float | None:
        """Seconds to the step's deadline (None: no watchdog, or the step's clock has not
        started: a step behind the oldest one in flight)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def record(self, a: Action, begin: float, end: float) -> None:
        """``a``'s measured span, in ms from the start of the run of steps it is part of."""
        origin = self.flight.start
        self.timeline[a] = ((begin - origin) * 1e3, (end - origin) * 1e3)


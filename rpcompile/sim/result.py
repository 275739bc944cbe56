"""What a simulation reports: :class:`SimResult`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from rpcompile.errors import InvalidInput
from rpcompile.ir import Action, Schedule

__all__ = ["SimResult", "StepFigures", "busy_split"]


@dataclass(frozen=True)
class StepFigures:
    """One step of a simulated run (:meth:`SimResult.step`). Times in ms.

    A step's span runs from the start of its first action (``start_ms``: 0 for the first
    step) to the end of its last one (``end_ms``). Steps overlap (step k+1's forward jobs run
    while step k's backward jobs drain), so spans overlap too, and a worker's time inside
    step k's span that it spends on another step's computes counts as idle for step k. The
    bubble figures are fractions of ``makespan_ms x workers`` as in :class:`SimResult`,
    counted inside the span, of the step's own computes: step 0's fill is an isolated step's,
    its drain shares the workers with step 1's fill.
    """

    step: int
    start_ms: float
    end_ms: float
    tokens: int
    busy_ms: tuple[float, ...]  # the step's compute time per worker
    bubble: float
    bubble_fill: float
    bubble_drain: float
    bubble_steady: float

    @property
    def makespan_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.makespan_ms / 1e3) if self.makespan_ms > 0 else 0.0


@dataclass(frozen=True)
class SimResult:
    """One simulated run of a schedule on a hardware profile. Times in ms, sizes in bytes.

    Bubble figures are fractions of ``makespan_ms x workers``: a worker's idle time is the
    makespan minus its compute time; ``bubble_fill`` is the idle time before its first compute,
    ``bubble_drain`` the idle time after its last one (including waits for the host's final
    gradient and optimizer work), ``bubble_steady`` the gaps in between. The three add up to
    ``bubble``. ``exposed_transfer_ms`` (per worker) is compute time lost to transfers: how much
    later each compute started than it could have if every transfer took no time.
    ``timeline`` maps every action to its (start, end).
    """

    schedule: Schedule
    hardware: str
    makespan_ms: float
    tokens: int
    busy_ms: tuple[float, ...]  # compute time per worker
    bubble: float
    bubble_fill: float
    bubble_drain: float
    bubble_steady: float
    exposed_transfer_ms: tuple[float, ...]
    peak_device_bytes: tuple[int, ...]
    peak_host_bytes: int
    step_end_ms: tuple[float, ...]  # when each optimizer step's last compute ended
    timeline: Mapping[Action, tuple[float, float]]
    # Compute-stream gaps (all workers) by the kind of the edge that ended last before the
    # compute could start: 'weights' (upload), 'arrived' (an input from another worker: the
    # transfer or the producer's pace), 'data' (a producer on the same worker).
    idle_by_wait_ms: Mapping[str, float] = field(default_factory=dict)

    @property
    def workers(self) -> int:
        return self.schedule.workers

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.makespan_ms / 1e3) if self.makespan_ms > 0 else 0.0

    @property
    def step_spans_ms(self) -> tuple[tuple[float, float], ...]:
        """Per step, (the start of its first action, the end of its last action), of any
        kind. Steps overlap, so the spans do; the last one to end ends at ``makespan_ms``."""
        starts = [float("inf")] * self.schedule.steps
        ends = [0.0] * self.schedule.steps
        for a, (start, end) in self.timeline.items():
            starts[a.step] = min(starts[a.step], start)
            ends[a.step] = max(ends[a.step], end)
        return tuple((0.0 if s == float("inf") else s, e) for s, e in zip(starts, ends))

    def step(self, k: int) -> StepFigures:
        """The figures of step ``k`` inside its span (:class:`StepFigures`): its own
        computes' busy time, and the idle time of every worker between them."""
        if not 0 <= k < self.schedule.steps:
            raise InvalidInput(f"step must be in 0..{self.schedule.steps - 1}, got {k}")
        start, end = self.step_spans_ms[k]
        makespan = end - start
        busy, fill, drain, steady = busy_split(self.schedule, self.timeline, makespan,
                                               start=start, step=k)
        denom = makespan * self.schedule.workers if makespan > 0 else 1.0
        return StepFigures(
            step=k, start_ms=start, end_ms=end, tokens=self.tokens // self.schedule.steps,
            busy_ms=tuple(busy), bubble=(fill + drain + steady) / denom,
            bubble_fill=fill / denom, bubble_drain=drain / denom, bubble_steady=steady / denom)

    @property
    def compute_end_ms(self) -> float:
        """When the last compute of the run ended (the makespan less any trailing host work)."""
        return max(self.step_end_ms, default=0.0)

    def dump(self, path: str | os.PathLike) -> None:
        """The schedule with this run's times: ``.json`` (Chrome trace), ``.png``, ``.csv``,
        ``.txt`` (as :meth:`Schedule.dump`)."""
        self.schedule.dump(path, timeline=self.timeline)

    def summary(self) -> str:
        gib = 2**30
        peak = max(self.peak_device_bytes, default=0)
        return (
            f"{self.schedule.kind} on {self.hardware}: makespan {self.makespan_ms:.1f} ms, "
            f"{self.tokens_per_s:,.0f} tokens/s, bubble {100 * self.bubble:.2f}% (fill "
            f"{100 * self.bubble_fill:.2f}, steady {100 * self.bubble_steady:.2f}, drain "
            f"{100 * self.bubble_drain:.2f}), exposed transfers "
            f"{sum(self.exposed_transfer_ms):.1f} ms, peak device {peak / gib:.2f} GiB, "
            f"host {self.peak_host_bytes / gib:.1f} GiB"
            + ("; idle waiting for " + ", ".join(f"{k} {v:.0f} ms" for k, v in
                                                  self.idle_by_wait_ms.items())
               if self.idle_by_wait_ms else "")
        )

    def __str__(self) -> str:
        return self.summary()


def busy_split(sched: Schedule, timeline: Mapping[Action, tuple[float, float]],
               makespan: float, *, start: float = 0.0, step: int | None = None,
               ) -> tuple[list[float], float, float, float]:
    """(compute time per worker, and the idle time of all workers before their first compute,
    after their last, and between, over the window ``start`` .. ``start + makespan``): the
    bubble's parts before dividing by makespan x workers. ``step``: count only that step's
    computes (:meth:`SimResult.step`); None: every compute."""
    end = start + makespan
    busy, fill, drain, steady = [], 0.0, 0.0, 0.0
    for lst in sched.actions:
        spans = [timeline[a] for a in lst if a.is_compute and (step is None or a.step == step)]
        b = sum(e - s for s, e in spans)
        busy.append(b)
        if not spans:
            fill += makespan
            continue
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        fill += first - start
        drain += end - last
        steady += (last - first) - b
    return busy, fill, drain, steady

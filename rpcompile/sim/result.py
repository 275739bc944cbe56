"""What a simulation reports: :class:`SimResult`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from rpcompile.ir import Action, Schedule

__all__ = ["SimResult"]


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

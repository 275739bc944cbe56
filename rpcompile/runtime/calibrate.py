"""Calibrating a virtual-worker profile on this machine, from runs of the runtime.

``hardware.probe("cpu")`` times a matmul, a copy between warm buffers and the fused AdamW, each
alone. Virtual workers spend CPU time on more than their computes, on the same cores: a copy
goes into freshly allocated memory (its pages are faulted in), and every action passes through
the runtime (the main thread submits it; its thread takes it, waits on its events, records its
times and sets its own; a compute also binds its inputs, zeroes its gradient buffer and gives
back what it held). The simulator counts both when the profile says how much
(``Hardware.h2d_gbps`` / ``d2h_gbps`` as copy rates that take a core while they run, and
``Hardware.action_overhead_us``). The figures here are CPU time, the work itself, whether or
not other processes share the cores:

- :func:`threaded_compute`: the plan's stage programs (``Compiled.reference_step``) run in as
  many threads at once as there are workers, as the workers run them: their CPU time per step,
  and the cores they kept busy (CPU time over wall time);
- :func:`calibrate_virtual`: a stream of steps on a trainer's virtual workers, each worker
  stream thread's CPU clock and the main thread's read before and after. The upload and
  download streams' CPU time per byte they move gives the copy rates (their per-action work
  included); the compute streams' CPU time beyond the same programs run directly, plus the
  main thread's, per compute and host action, gives the CPU per action.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import COMPUTE_KINDS, HOST_KINDS

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled
    from rpcompile.runtime.trainer import Trainer

__all__ = [
    "ComputeCalibration",
    "VirtualCalibration",
    "calibrate_virtual",
    "threaded_compute",
]

_UPLOAD_STREAMS = ("weight_upload", "activation_upload")


@dataclass(frozen=True)
class ComputeCalibration:
    """The plan's stage programs for one step, run by ``threads`` threads at once."""

    threads: int
    cpu_ms: float  # CPU time per step (the median window's, over its threads)
    wall_ms: float  # that window's wall time, per step
    cores_busy: float  # CPU time over wall time in that window


def threaded_compute(compiled: Compiled, batch: Any, threads: int,
                     repeats: int = 3) -> ComputeCalibration:
    """Every forward, tail and backward compute of one step (``compiled.reference_step``),
    run by ``threads`` threads at once, one step each; the window of median CPU time of
    ``repeats``, after one step alone to warm up."""
    compiled.reference_step(batch)
    windows = []
    for _ in range(repeats):
        runs = [threading.Thread(target=compiled.reference_step, args=(batch,))
                for _ in range(threads)]
        t0, c0 = time.perf_counter(), time.process_time()
        for run in runs:
            run.start()
        for run in runs:
            run.join()
        windows.append((time.process_time() - c0, time.perf_counter() - t0))
    cpu, wall = sorted(windows)[len(windows) // 2]
    return ComputeCalibration(threads, 1e3 * cpu / threads, 1e3 * wall / threads, cpu / wall)


@dataclass(frozen=True)
class VirtualCalibration:
    """What a run of the runtime on virtual workers spent, per step, and the profile figures
    it gives (:meth:`apply`)."""

    steps: int  # steps timed
    actions: dict[str, float]  # actions per step, by kind
    cpu_ms: dict[str, float]  # CPU per step: each worker stream (all workers), the main thread
    compute_programs_ms: float  # the same computes run directly (threaded_compute), per step
    # The compute streams' CPU beyond that, per step; below 0 when the two measurements'
    # noise exceeds it, and then counted as 0 in action_overhead_us.
    compute_beyond_ms: float
    action_overhead_us: float  # CPU per compute and host action beyond its work
    h2d_gbps: float  # bytes the upload streams move per CPU second
    d2h_gbps: float  # bytes the download streams move per CPU second

    def apply(self, hw: Hardware) -> Hardware:
        """``hw`` with this run's copy rates (pinned and pageable alike: virtual workers copy
        the same either way) and CPU per action."""
        return replace(hw, h2d_gbps=self.h2d_gbps, d2h_gbps=self.d2h_gbps,
                       pageable_h2d_gbps=self.h2d_gbps, pageable_d2h_gbps=self.d2h_gbps,
                       action_overhead_us=self.action_overhead_us)


def calibrate_virtual(trainer: Trainer, batches: Sequence[Any],
                      compute: ComputeCalibration | None = None) -> VirtualCalibration:
    """Train ``trainer`` (on virtual workers) on ``batches`` as one stream of steps, after one
    step alone to warm up, and measure what its threads spend (see the module doc).
    ``compute``: :func:`threaded_compute` of the trainer's compiled model at as many threads
    as workers (measured here when not given). Raises :class:`InvalidInput` for CUDA workers
    (their copies and computes are not the CPU's), where the OS gives no thread clocks, and
    for a run whose transfers moved nothing."""
    workers = trainer.workers
    if any(w.kind != "virtual" for w in workers):
        raise InvalidInput("calibrate_virtual times virtual workers (their copies and "
                           "computes run on this CPU): build the Trainer with "
                           "device='virtual'")
    if not hasattr(time, "pthread_getcpuclockid"):
        raise InvalidInput("calibrate_virtual reads each stream thread's CPU clock "
                           "(time.pthread_getcpuclockid), which this platform lacks")
    if not batches:
        raise InvalidInput("calibrate_virtual needs at least one batch to time")
    trainer.step(batches[0])
    if compute is None:
        compute = threaded_compute(trainer.compiled, batches[0], threads=len(workers))
    before = [w.stream_cpu_s() for w in workers]
    main0 = time.thread_time()
    results = list(trainer.fit(batches))
    main_s = time.thread_time() - main0
    after = [w.stream_cpu_s() for w in workers]
    steps = len(results)
    cpu_s: Counter[str] = Counter()
    for b, a in zip(before, after):
        for stream, t in a.items():
            cpu_s[stream] += t - b[stream]
    kinds: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for result in results:
        for action in result.timeline:
            kinds[action.kind] += 1
            nbytes[action.stream] += action.bytes

    def rate(streams: Sequence[str]) -> float:
        moved, spent = sum(nbytes[s] for s in streams), sum(cpu_s[s] for s in streams)
        if moved <= 0 or spent <= 0:
            raise InvalidInput(f"the run's {' and '.join(streams)} streams moved {moved} bytes "
                               f"in {spent:.4f} CPU seconds: calibrate on a run whose "
                               "transfers move data")
        return moved / spent / 1e9

    timed = sum(n for k, n in kinds.items() if k in COMPUTE_KINDS or k in HOST_KINDS)
    beyond_s = cpu_s["compute"] - 1e-3 * compute.cpu_ms * steps
    return VirtualCalibration(
        steps=steps,
        actions={k: n / steps for k, n in sorted(kinds.items())},
        cpu_ms={**{s: 1e3 * v / steps for s, v in sorted(cpu_s.items())},
                "main": 1e3 * main_s / steps},
        compute_programs_ms=compute.cpu_ms,
        compute_beyond_ms=1e3 * beyond_s / steps,
        action_overhead_us=1e6 * (max(0.0, beyond_s) + main_s) / timed,
        h2d_gbps=rate(_UPLOAD_STREAMS),
        d2h_gbps=rate(("download",)),
    )

"""The compile-time refusals: a plan whose proven per-worker peak exceeds a worker's memory, and
host memory the run would not have."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from rpcompile.errors import RPCompileError
from rpcompile.passes.memory import (
    HostMemory,
    HostMemoryWarning,
    format_bytes,
    host_memory,
    host_ram_problem,
)

if TYPE_CHECKING:
    from rpcompile.compiler.compiled import Compiled

__all__ = [
    "MemoryPlanError",
    "check_host_memory",
    "check_memory",
]


class MemoryPlanError(RPCompileError, ValueError):
    """A plan's proven per-worker peak exceeds what a worker has (refused at compile time)."""


def check_memory(compiled: Compiled) -> None:
    """Refuse a plan whose proven peak (``compiled.memory``) exceeds a worker's capacity: the
    virtual workers' ``capacity_bytes``, the hardware profile's usable memory (memory less
    its reserve), and on CUDA each device's free memory now."""
    if not compiled.memory:
        return
    hw = compiled.hardware
    device = compiled.options.train.device
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    limits: list[tuple[int, str]] = [
        (hw.usable_memory_bytes, f"the {hw.name!r} profile's usable memory "
         f"({hw.memory_gib:g} GiB less a {hw.memory_reserve_gib:g} GiB reserve)")]
    capacity = compiled.options.plan.capacity_bytes
    if capacity is not None:
        limits.append((int(capacity), "capacity_bytes"))
    for peak in compiled.memory:
        here = list(limits)
        if cuda and peak.worker < torch.cuda.device_count():
            free, _total = torch.cuda.mem_get_info(peak.worker)
            here.append((free, f"the free memory of cuda:{peak.worker}"))
        limit, source = min(here)
        if peak.peak_bytes > limit:
            names = ", ".join(compiled.plan.stage_name(s) for s in peak.stages)
            raise MemoryPlanError(
                f"the plan does not fit worker {peak.worker}: its schedule needs "
                f"{format_bytes(peak.peak_bytes)} there at {peak.action} ({names}: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in peak.parts.items() if v)
                + f"), over the {format_bytes(limit)} of {source}. To fit: more microbatches "
                "(a smaller microbatch for the same batch), a shorter sequence, finer units "
                "(units=[...] at attention/MLP blocks), LoRA or frozen layers, a plan for "
                "more GPUs, or more capacity")


def check_host_memory(compiled: Compiled, stacklevel: int = 3) -> HostMemory:
    """Set ``compiled.host`` (the host bytes of its runtime schedule, with the transfer
    staging its staging slots hold) and ``compiled.host_ram`` (``host_ram_bytes``, else
    the profile's ``host_ram_gib``, else this machine's RAM), and warn
    (:class:`~rpcompile.passes.memory.HostMemoryWarning`) when the first exceeds the second:
    a warning, because compile allocates nothing and a plan (``device="virtual"``, a
    profile of another server) may be for elsewhere; the Trainer, which allocates the host
    store, refuses (rpcompile.runtime.trainer)."""
    from rpcompile.hardware import host_ram

    host = _host_figure(compiled)
    ram = host_ram(compiled.options.train.host_ram_bytes, compiled.hardware)
    compiled.host, compiled.host_ram = host, ram
    problem = host_ram_problem(host, *ram)
    if problem is not None:
        warnings.warn(f"rpcompile.compile: {problem}; a Trainer would refuse to build its "
                      f"host store", HostMemoryWarning, stacklevel=stacklevel)
    return host


def _host_figure(compiled: Compiled) -> HostMemory:
    """The host bytes of ``compiled``'s runtime schedule: the static buffers of its plan and
    mode (rpcompile.passes.memory.host_memory; the journal as ``Hardware.undo_journal``
    says) plus the transfer staging, the sum of the schedule's host staging slots (proven:
    rpcompile.passes.staging), ``sharded`` at one rank's share."""
    sched, plan, hw = compiled.schedule, compiled.plan, compiled.hardware
    host = host_memory(plan, compiled.options.plan.mode, journal=hw.undo_journal,
                       pageable=hw.host_memory == "pageable")
    if sched is not None:
        host = replace(host, transfers=sum(sched.staging_bytes))
    if sched is not None and sched.sharded:
        host = host.sharded(sched.ranks)
    return host

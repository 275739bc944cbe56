"""The simulator half of each action kind's record: what an action costs, by the resource it
holds (a compute stream's milliseconds, a link's bytes, the host queue's memory traffic and
its rate), and the cost model's figures of host memory traffic."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rpcompile.errors import InvalidInput
from rpcompile.ir import (
    ACTION_SPECS,
    Action,
    ActionKind,
    check_registry,
)

if TYPE_CHECKING:
    from rpcompile.sim.engine.replay import _Replay

__all__ = [
    "GLOO_BROADCAST_HOST_BYTES_PER_BYTE",
    "GLOO_HOST_BYTES_PER_BYTE",
    "GLOO_REDUCE_HOST_BYTES_PER_BYTE",
    "JOURNAL_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
    "SHADOW_JOURNAL_BYTES_PER_BYTE",
    "SIM_COSTS",
]


# Fused AdamW over fp32 tensors reads param, grad, exp_avg, exp_avg_sq and writes three of them:
# 28 bytes of host memory traffic per parameter.
OPTIMIZER_BYTES_PER_PARAM = 28
# The undo journal (rpcompile.runtime.optim, ``rollback=True``): before an OPT changes a group,
# the driver copies its fp32 masters (4 bytes) and AdamW's two fp32 moments (8), each read
# and written: 24 bytes of host traffic per parameter, a plain copy at the host's memory
# bandwidth; before a SHADOW, it copies the shadows it overwrites that no SHADOW of the step
# saved yet (read and written: 2 bytes per such byte, on top of the pass's 3). Neither is
# charged when the run keeps no journal (``Hardware.undo_journal``, from
# ``PlanOptions.undo_journal``).
JOURNAL_BYTES_PER_PARAM = 24
SHADOW_JOURNAL_BYTES_PER_BYTE = 2
# Host memory traffic of gloo's ring all-reduce, per byte of the reduced fp32 buffer and per
# (N-1)/N (in each of its two phases a rank sends and receives (N-1)/N of the buffer, chunk
# by chunk): a chunk sent is read from the buffer, a chunk received is written into it (or
# into gloo's scratch), and in the reduce-scatter phase the received chunk is added into the
# gradients (read 2, write 1): 5 bytes per byte there, 2 in the all-gather, 7 in all. The
# kernel's socket-buffer copies and the NIC's DMA are not counted (with DDIO they mostly stay
# in the CPU's cache; counted, the figure would be 15). A model, not a measurement.
GLOO_HOST_BYTES_PER_BYTE = 7
# Sharded (``Schedule.sharded``): gloo's reduce to one rank is the same ring reduce-scatter
# (5 bytes per byte and per (N-1)/N) and then a gather of the other chunks to the root (one
# write of each received byte, one read of each sent one, counted as 1): 6. Its broadcast
# (the shadows' all-gather) reads what it sends and writes what it receives: 2 per byte.
GLOO_REDUCE_HOST_BYTES_PER_BYTE = 6
GLOO_BROADCAST_HOST_BYTES_PER_BYTE = 2
@dataclass(frozen=True)
class _Link:
    """The cost of a transfer kind: it runs on its worker's D2H link or its H2D link."""

    d2h: bool


def _compute_ms(replay: _Replay, a: Action) -> float:
    if (a.kind, a.stage) not in replay.times:
        raise InvalidInput(f"no compute time for {a} (kind {a.kind}, stage {a.stage}); the plan "
                         "does not match the schedule")
    return replay.times[(a.kind, a.stage)] + replay.hw.action_overhead_us * 1e-3


def _evict_ms(replay: _Replay, a: Action) -> float:
    """EVICT frees memory: no work but the runtime's own per action."""
    return replay.hw.action_overhead_us * 1e-3


def _with_overhead(cost: Callable[[_Replay, Action], tuple[float, float]]
                   ) -> Callable[[_Replay, Action], tuple[float, float]]:
    """A host action's (work, rate) with the runtime's per-action CPU time
    (``Hardware.action_overhead_us``) added to its work, at its full-speed rate."""
    def with_overhead(replay: _Replay, a: Action) -> tuple[float, float]:
        work, rate = cost(replay, a)
        return work + replay.hw.action_overhead_us * 1e-3 * rate, rate
    with_overhead.__doc__ = cost.__doc__
    return with_overhead


def _optimizer_work(replay: _Replay, a: Action) -> tuple[float, float]:
    """(bytes of host memory traffic, full-speed rate in bytes per ms) of an update: the undo
    journal's copy of the masters and optimizer state it changes, at the host's memory
    bandwidth (none when the run keeps no journal, ``Hardware.undo_journal``), then fused
    AdamW's traffic per parameter at the profile's optimizer throughput. Alone it takes the
    sum of the two times."""
    params = a.bytes / 4  # fp32 gradients of the stage
    update = params * OPTIMIZER_BYTES_PER_PARAM
    journal = params * JOURNAL_BYTES_PER_PARAM if replay.hw.undo_journal else 0.0
    ms = params / (replay.hw.optimizer_params_per_s * 1e-3) + journal / replay.host_rate
    if ms <= 0.0:
        return 0.0, 1.0
    return update + journal, (update + journal) / ms


def _reduction_work(replay: _Replay, a: Action) -> tuple[float, float]:
    """(bytes of host memory traffic, full-speed rate in bytes per ms) of a cross-rank ring
    all-reduce of ``a.bytes`` over ``schedule.ranks`` servers on the profile's inter-server
    link (docs/distributed.md). Alone it takes the ring time :meth:`Link.allreduce_ms`,
    ``2 (N-1)/N x bytes / bandwidth + 2 (N-1) x latency``; it moves
    :data:`GLOO_HOST_BYTES_PER_BYTE` x (N-1)/N x bytes through host memory, at the rate that
    takes the ring time, so a host memory bus busy with transfers, ACC and the optimizer
    slows it down, and it slows them."""
    link, ranks = replay.hw.link, replay.sched.ranks
    if link is None:
        raise InvalidInput(
            f"the schedule reduces gradients across {ranks} ranks, but hardware profile "
            f"{replay.hw.name!r} has no inter-server link: simulate on "
            "hardware.with_link('eth25' | 'eth100') (or PlanOptions(link=...))")
    if replay.sched.sharded:  # reduced to the gradients' owners: Link.reduce_ms
        ms = link.reduce_ms(a.bytes, ranks)
        traffic = GLOO_REDUCE_HOST_BYTES_PER_BYTE * (ranks - 1) / ranks * a.bytes
    else:
        ms = link.allreduce_ms(a.bytes, ranks)
        traffic = GLOO_HOST_BYTES_PER_BYTE * (ranks - 1) / ranks * a.bytes
    if ms <= 0.0 or traffic <= 0.0:
        return 0.0, 1.0
    return traffic, traffic / ms


def _memory_pass_work(replay: _Replay, a: Action) -> tuple[float, float]:
    """ACC reads the accumulator and the staged gradients and writes the accumulator; SHADOW
    reads the fp32 masters (2x the low-precision bytes) and writes the shadow: 3x bytes."""
    return 3.0 * a.bytes, replay.host_rate


def _shadow_work(replay: _Replay, a: Action) -> tuple[float, float]:
    """SHADOW's memory pass; sharded, then the broadcast of the updated shadows it gathers
    from their owners (:mod:`rpcompile.sim.sharding`), :meth:`Link.broadcast_ms` on the link:
    the time alone is the pass's plus the broadcast's, its traffic both. The pass includes
    the undo journal's copy of the shadow it overwrites (:data:`SHADOW_JOURNAL_BYTES_PER_BYTE`)."""
    work, rate = _memory_pass_work(replay, a)
    work += SHADOW_JOURNAL_BYTES_PER_BYTE * replay.journaled[a]
    # ``replay.gathered`` is set by simulate() before the replay runs; no default, so a cost
    # taken before it exists fails instead of timing a sharded SHADOW without its broadcast.
    gathered = replay.gathered.get(a, 0) if replay.sched.sharded else 0
    ms = replay.hw.link.broadcast_ms(gathered, replay.sched.ranks) if gathered else 0.0
    if ms <= 0.0:
        return work, rate
    traffic = work + GLOO_BROADCAST_HOST_BYTES_PER_BYTE * gathered
    return traffic, traffic / (work / rate + ms)


def _check_work(replay: _Replay, a: Action) -> tuple[float, float]:
    """CHECK's passes over the fp32 gradients (clipping's norm and rescale, unscaling), at
    the host's memory bandwidth: ``a.bytes`` is that traffic (rpcompile.passes.lower); a
    sharded rank passes over the gradients it owns only (``1/ranks`` of them). Gathering
    the loss and the jobs' non-finite flags is not timed (a few scalars)."""
    sharded = replay.sched.sharded and replay.sched.ranks > 1
    return (a.bytes / replay.sched.ranks if sharded else float(a.bytes)), replay.host_rate


# The simulator half of each action kind's record (rpcompile.ir.ACTION_SPECS is the other):
# what an action costs, by the resource it holds: a compute stream (ms), a link (bytes, by
# the action), the host queue (host memory traffic and its rate). Checked complete at import.
SIM_COSTS: Mapping[ActionKind, Callable[[_Replay, Action], object]] = {
    ActionKind.F: _compute_ms,
    ActionKind.T: _compute_ms,
    ActionKind.B: _compute_ms,
    ActionKind.EVICT: _evict_ms,
    ActionKind.UP: lambda replay, a: _Link(d2h=False),
    ActionKind.H2D: lambda replay, a: _Link(d2h=False),
    ActionKind.D2H: lambda replay, a: _Link(d2h=True),
    ActionKind.ACC: _with_overhead(_memory_pass_work),
    ActionKind.OPT: _with_overhead(_optimizer_work),
    ActionKind.SHADOW: _with_overhead(_shadow_work),
    ActionKind.REDUCE: _with_overhead(_reduction_work),
    ActionKind.CHECK: _with_overhead(_check_work),
}
check_registry(SIM_COSTS, "the simulator")
# Kinds whose own end an action waiting on them sees in _waits (the rest: transfers and the
# network lane, counted as instant there), and the kinds on a worker's compute stream.
_TIMED_KINDS = frozenset(k.value for k, spec in ACTION_SPECS.items()
                         if spec.stream in ("compute", "host"))
_COMPUTE_STREAM_KINDS = frozenset(k.value for k, spec in ACTION_SPECS.items()
                                  if spec.stream == "compute")
_COST = {k.value: fn for k, fn in SIM_COSTS.items()}  # keyed by Action.kind's string

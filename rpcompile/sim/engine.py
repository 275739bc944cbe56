"""Discrete-event replay of a schedule on a hardware profile.

Sections, in reading order:
  1. compute_times()  - milliseconds per compute action, from stage costs or per-unit times
  2. simulate()       - the public entry: replay, then measure
  3. the replay       - streams, links, the host queue and shared host memory bandwidth
  4. measures         - bubble split, exposed transfers, device and host memory

Resource model (docs/simulator.md):
  * each worker's compute stream runs its actions in list order, one at a time;
  * each worker's three transfer streams (weight_upload: UP; activation_upload: H2D;
    download: D2H) run their transfers in list order, one at a time, as the runtime's stream
    threads do (``Worker.submit``: an item runs after everything submitted before it): a
    transfer starts once its waits are done and the one before it on its stream has ended;
  * each worker has an H2D link (its UP and H2D streams share it) and a D2H link, full
    duplex. A link serves one transfer at a time among its streams' current ones: critical
    transfers (one microbatch's tensor) first, bulk ones (weights, gradients) chunk by chunk,
    so a critical transfer on another stream waits at most one chunk;
  * the host queue (ACC, OPT, SHADOW, CHECK) runs in list order, and so does the host's network lane
    (REDUCE, data parallel: a ring all-reduce on the profile's inter-server link; sharded, a
    reduce to the owners, and each SHADOW then broadcasts the updated shadows);
  * host memory bandwidth is shared: every running transfer and host operation (a reduction's
    gloo copies included) draws from it
    at its own full rate, and when the sum exceeds the host's bandwidth all are slowed in
    proportion (a fluid model, re-solved at every start and finish);
  * an action starts once every edge it waits on is done (and, on an ordered stream, the
    action before it has finished).
Ties are broken by fixed orders (worker, stream, list position), so a replay is deterministic.
"""

from __future__ import annotations

import bisect
import gc
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from rpcompile.errors import InvalidInput, RPCompileError
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import (
    ACTION_SPECS,
    STAGING_FIT,
    Action,
    ActionKind,
    Plan,
    Schedule,
    Stage,
    UnitProfile,
    check_registry,
)
from rpcompile.passes.memory import working_bytes
from rpcompile.sim.result import SimResult, busy_split
from rpcompile.sim.sharding import shadow_gather_bytes, shadow_journal_bytes

__all__ = ["GLOO_BROADCAST_HOST_BYTES_PER_BYTE", "GLOO_HOST_BYTES_PER_BYTE",
           "GLOO_REDUCE_HOST_BYTES_PER_BYTE", "JOURNAL_BYTES_PER_PARAM", "OPTIMIZER_BYTES_PER_PARAM",
           "SHADOW_JOURNAL_BYTES_PER_BYTE", "SIM_COSTS",
           "SimulationError", "busy_split", "compute_times", "makespan_of", "paused_gc",
           "replay_timeline", "simulate"]

# Fused AdamW over fp32 tensors reads param, grad, exp_avg, exp_avg_sq and writes three of them:
# 28 bytes of host memory traffic per parameter.
OPTIMIZER_BYTES_PER_PARAM = 28
# The undo journal (rpcompile.runtime.optim, ``rollback=True``): before an OPT changes a group,
# the driver copies its fp32 masters (4 bytes) and AdamW's two fp32 moments (8), each read
# and written: 24 bytes of host traffic per parameter, a plain copy at the host's memory
# bandwidth; before a SHADOW, it copies the shadows it overwrites that no SHADOW of the step
# saved yet (read and written: 2 bytes per such byte, on top of the pass's 3). Neither is
# charged when the run keeps no journal (``Hardware.undo_journal``, from
# ``TrainOptions.undo_journal``).
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
_TIME_EPS = 1e-9  # ms; two events closer than this happen together


class SimulationError(RPCompileError, RuntimeError):
    """The replay cannot go on (a deadlock): the message lists the blocked stream heads."""


# --------------------------------------------------------------------------------------------
# 1. compute_times()
# --------------------------------------------------------------------------------------------


def compute_times(
    schedule: Schedule,
    plan: Plan | Sequence[Stage],
    units: Sequence[UnitProfile] | None = None,
    recompute: bool = True,
) -> dict[tuple[str, int], float]:
    """Milliseconds of one microbatch of each (compute kind, stage) in ``schedule``.

    RoundPipe schedules use the plan's ``Stage.compute_ms`` (forward | fused tail | recompute +
    backward) unless ``units`` is given, in which case stage times are re-derived from those
    per-unit times (a table of measured times). Baseline schedules (weights bound to workers)
    split each stage into F = the sum of its units' forwards and B = the sum of their
    backwards plus, with ``recompute``, their forwards again, except for the model's last unit
    (LM head and loss: its activations are kept, as in RoundPipe's fused tail). Baselines need
    per-unit times: a :class:`Plan`'s own units, or ``units``.
    """
    stages = _stage_tuple(plan)
    if units is None and isinstance(plan, Plan):
        units = plan.units if schedule.stage_workers is not None else None
    out: dict[tuple[str, int], float] = {}
    if schedule.stage_workers is None and units is None:
        for s in stages:
            kind = {"forward": "F", "tail": "T", "backward": "B"}[s.kind]
            out[(kind, s.index)] = s.compute_ms
        return out
    if units is None:
        raise InvalidInput(
            f"a {schedule.kind} schedule needs per-unit forward and backward times to split "
            "each stage into F and B: pass units= (e.g. plan.units or rpcompile.workloads.paper units)"
        )
    last = len(units) - 1
    for i, s in enumerate(stages):
        fwd = sum(units[u].forward_ms for u in s.units)
        bwd = sum(units[u].backward_ms for u in s.units)
        again = sum(units[u].forward_ms for u in s.units if u != last) if recompute else 0.0
        if schedule.stage_workers is not None:
            out[("F", i)] = fwd
            out[("B", i)] = bwd + again
        elif s.kind == "forward":
            out[("F", i)] = fwd
        else:  # tail (no recompute: forward + loss + backward) or recompute + backward
            out[("T" if s.kind == "tail" else "B", i)] = fwd + bwd
    return out


def _stage_tuple(plan: Plan | Sequence[Stage]) -> tuple[Stage, ...]:
    return tuple(plan.stages if isinstance(plan, Plan) else plan)


# --------------------------------------------------------------------------------------------
# 2. simulate()
# --------------------------------------------------------------------------------------------


def simulate(
    schedule: Schedule,
    plan: Plan | Sequence[Stage],
    hardware: Hardware | str,
    *,
    units: Sequence[UnitProfile] | None = None,
    unit_ms: Mapping[str, tuple[float, float]] | None = None,
    recompute: bool = True,
    tokens_per_microbatch: int | None = None,
) -> SimResult:
    """Replay ``schedule`` (lowered, or compute only) on ``hardware`` and measure it.

    ``plan`` gives stage costs and sizes (a :class:`Plan`, or the stage list a baseline was
    built from). ``units`` overrides the per-unit profiles (default: the plan's); ``unit_ms``
    maps unit names to measured (forward_ms, backward_ms) and replaces those times, so a
    schedule can be replayed with measured per-unit times. ``tokens_per_microbatch`` defaults
    to the plan's ``microbatch_size * seq_len``. Transfer sizes are the actions' own bytes.
    """
    hw = get_hardware(hardware)
    stages = _stage_tuple(plan)
    if len(stages) != len(schedule.stage_names):
        raise InvalidInput(f"the schedule has {len(schedule.stage_names)} stages, the plan "
                         f"{len(stages)}: simulate a schedule with the plan it was built from")
    base_units = tuple(units) if units is not None else (
        plan.units if isinstance(plan, Plan) else None)
    if unit_ms is not None:
        if base_units is None:
            raise InvalidInput("unit_ms needs unit profiles to apply to: pass a Plan or units=")
        unknown = set(unit_ms) - {u.name for u in base_units}
        if unknown:
            raise InvalidInput(f"unit_ms names units the plan does not have: {sorted(unknown)}")
        base_units = tuple(
            replace(u, forward_ms=unit_ms[u.name][0], backward_ms=unit_ms[u.name][1])
            if u.name in unit_ms else u for u in base_units)
    explicit = units is not None or unit_ms is not None
    times = compute_times(schedule, plan, base_units if explicit else None, recompute)
    if tokens_per_microbatch is None:
        tokens_per_microbatch = plan.microbatch_size * plan.seq_len if isinstance(plan, Plan) else 0
    with paused_gc():
        timeline = _run(schedule, plan, hw, times)
        return _measure(schedule, stages, base_units, hw, timeline, times, tokens_per_microbatch)


def replay_timeline(schedule: Schedule, plan: Plan | Sequence[Stage],
                    hardware: Hardware | str) -> dict[Action, tuple[float, float]]:
    """The (start, end) of every action of ``schedule`` replayed as :func:`simulate` replays
    it with the plan's own stage times, without the measures (bubble split, exposed time,
    memory): for callers that read only the timeline, such as the partitioner's search."""
    hw = get_hardware(hardware)
    if len(_stage_tuple(plan)) != len(schedule.stage_names):
        raise InvalidInput(f"the schedule has {len(schedule.stage_names)} stages, the plan "
                         f"{len(_stage_tuple(plan))}: simulate a schedule with the plan it "
                         "was built from")
    with paused_gc():
        return _run(schedule, plan, hw, compute_times(schedule, plan))


def _run(schedule: Schedule, plan: Plan | Sequence[Stage], hw: Hardware,
         times: Mapping[tuple[str, int], float]) -> dict[Action, tuple[float, float]]:
    replay = _Replay(schedule, times, hw)
    if schedule.sharded:  # what each SHADOW's all-gather of updated shadows moves
        replay.gathered = shadow_gather_bytes(schedule, plan)
    # What each SHADOW's undo journal saves (a parameter two stages read, once a step); bare
    # stages say nothing of which parameters they share, so each saves its own bytes. A run
    # without the journal saves nothing, nor does an async SHADOW (it writes the copy of the
    # shadow no committed step reads).
    if not hw.undo_journal or schedule.optimizer == "async":
        replay.journaled = {a: 0 for a in schedule.host if a.kind == "SHADOW"}
    elif isinstance(plan, Plan):
        replay.journaled = shadow_journal_bytes(schedule, plan)
    else:
        replay.journaled = {a: a.bytes for a in schedule.host if a.kind == "SHADOW"}
    return replay.run()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was before after it.

    A replay (and the lowering before it) allocates hundreds of thousands of small objects
    while a schedule's actions are alive, and every collection walks them all: a third of an
    async replay's time. Nothing here makes reference cycles, so nothing waits for a
    collection. The collector's on/off state is the process's: blocks in any number of
    threads count themselves under one lock, the first turns the collector off and the last
    one out restores what the first found."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


_gc_lock = threading.Lock()
_gc_depth = 0  # paused_gc blocks running now, in every thread
_gc_was_enabled = True  # what the first of them found


# --------------------------------------------------------------------------------------------
# 3. the replay
# --------------------------------------------------------------------------------------------


@dataclass
class _Transfer:
    index: int  # the action's id in the replay
    bulk: bool
    order: int  # issue position on its worker (the tie-break)
    link: int  # 2 * worker (+1 for the D2H link)
    rate: float  # bytes per ms of its link
    ready: float = 0.0
    chunks_left: int = 1
    chunk_work: float = 0.0  # bytes per chunk
    latency_work: float = 0.0  # the DMA latency, as bytes at the link's rate (first chunk)
    started: bool = False


@dataclass
class _Fluid:
    """Work progressing at a rate shared through host memory bandwidth."""

    index: int  # the action's id in the replay
    remaining: float  # bytes of host memory traffic (or link bytes) left
    max_rate: float  # bytes per ms when nothing else competes
    link: int  # the transfer's link, or -1 - n for work on the host's lane n
    rate: float = 0.0


class _Replay:
    """Actions are numbered once (hashing a frozen Action is the expensive part of a replay);
    the event loop works on those numbers."""

    def __init__(self, sched: Schedule, times: Mapping[tuple[str, int], float],
                 hw: Hardware) -> None:
        self.sched, self.hw = sched, hw
        self.host_rate = hw.host_mem_gbps * 1e6  # bytes per ms
        self.acts = list(sched.all_actions())
        ids = {a: i for i, a in enumerate(self.acts)}
        n = len(self.acts)
        self.preds_left = [0] * n
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for e in sched.edges:
            self.preds_left[ids[e.dst]] += 1
            self.succs[ids[e.src]].append(ids[e.dst])
        self.duration = [0.0] * n
        self.compute_q: list[list[int]] = []
        self.transfers: dict[int, _Transfer] = {}
        self.times = times
        for lst in sched.actions:
            q = []
            for order, a in enumerate(lst):
                i = ids[a]
                cost = _COST[a.kind](self, a)
                if isinstance(cost, _Link):  # a transfer lane: the action's bytes on a link
                    self.transfers[i] = self._transfer(a, i, order, cost)
                else:  # the compute stream: a duration
                    q.append(i)
                    self.duration[i] = float(cost)
            self.compute_q.append(q)
        # The host's ordered lanes: the host queue, and the network lane (REDUCE, data
        # parallel); each runs one action at a time, in list order.
        self.lanes = [[ids[a] for a in sched.host], [ids[a] for a in sched.network]]
        self.pools: list[list[_Transfer]] = [[] for _ in range(2 * sched.workers)]
        # Each worker's transfer streams, in list order (the runtime's FIFO stream threads):
        # a transfer enters its link's pool once its waits are done and it heads its stream.
        self.next_on_stream: dict[int, int] = {}  # transfer -> the one after it, if any
        self.heads: set[int] = set()  # the transfer each stream runs next
        for lst in sched.actions:
            last: dict[str, int] = {}
            for a in lst:
                i = ids[a]
                if i in self.transfers:
                    stream = ACTION_SPECS[ActionKind(a.kind)].stream
                    if stream in last:
                        self.next_on_stream[last[stream]] = i
                    else:
                        self.heads.add(i)
                    last[stream] = i
        self.start = [0.0] * n
        self.end = [-1.0] * n

    def _transfer(self, a: Action, index: int, order: int, link: _Link) -> _Transfer:
        d2h = link.d2h
        # Pinned or pageable bandwidth, as the run's host memory (Hardware.host_memory).
        rate = (self.hw.link_d2h_gbps if d2h else self.hw.link_h2d_gbps) * 1e6
        bulk = a.priority == "bulk"
        chunks = a.chunks if bulk else 1
        return _Transfer(index, bulk, order, 2 * a.worker + d2h, rate, chunks_left=chunks,
                         chunk_work=a.bytes / chunks,
                         latency_work=self.hw.transfer_latency_us * 1e-3 * rate if a.bytes else 0.0)

    def run(self) -> dict[Action, tuple[float, float]]:
        g = self.sched.workers
        total = len(self.acts)
        preds_left, succs, duration = self.preds_left, self.succs, self.duration
        start, end, pools, transfers = self.start, self.end, self.pools, self.transfers
        head = [0] * g
        lane_head = [0] * len(self.lanes)
        running: list[tuple[int, float] | None] = [None] * g
        link_busy: list[_Fluid | None] = [None] * (2 * g)
        lane_busy: list[_Fluid | None] = [None] * len(self.lanes)
        heads, next_on_stream = self.heads, self.next_on_stream
        for tr in transfers.values():
            if preds_left[tr.index] == 0 and tr.index in heads:
                pools[tr.link].append(tr)
        compute_q = self.compute_q
        now = 0.0
        done = 0

        def finish(i: int) -> None:
            nonlocal done
            end[i] = now
            done += 1
            for s in succs[i]:
                preds_left[s] -= 1
                if preds_left[s] == 0 and s in transfers:
                    tr = transfers[s]
                    tr.ready = now
                    if s in heads:
                        pools[tr.link].append(tr)
            if i in next_on_stream:  # the next transfer of its stream may go
                s = next_on_stream[i]
                heads.add(s)
                if preds_left[s] == 0:
                    tr = transfers[s]
                    tr.ready = now
                    pools[tr.link].append(tr)

        while done < total:
            # Start everything that can start now; zero-length work finishes at once, which
            # may free more, so repeat until a pass finishes nothing (a start alone changes
            # only its own stream, lane or link, which is then busy: a pass after it would
            # start nothing).
            while True:
                finished = done
                for w in range(g):
                    q = compute_q[w]
                    if running[w] is None and head[w] < len(q) and preds_left[q[head[w]]] == 0:
                        i = q[head[w]]
                        head[w] += 1
                        start[i] = now
                        if duration[i] <= 0.0:
                            finish(i)
                        else:
                            running[w] = (i, now + duration[i])
                for n, lane in enumerate(self.lanes):
                    if lane_busy[n] is None and lane_head[n] < len(lane) and \
                            preds_left[lane[lane_head[n]]] == 0:
                        i = lane[lane_head[n]]
                        lane_head[n] += 1
                        start[i] = now
                        work, rate = _COST[self.acts[i].kind](self, self.acts[i])
                        if work <= 0.0:
                            finish(i)
                        else:
                            lane_busy[n] = _Fluid(i, work, rate, -1 - n)
                for link, pool in enumerate(pools):
                    if link_busy[link] is not None or not pool:
                        continue
                    # Critical before bulk; a started bulk transfer goes on before a new one.
                    tr = min(pool, key=lambda t: (t.bulk, not t.started, t.ready, t.order))
                    pool.remove(tr)
                    work = tr.chunk_work
                    if not tr.started:
                        start[tr.index] = now
                        tr.started = True
                        work += tr.latency_work
                    tr.chunks_left -= 1
                    if work <= 0.0 and tr.chunks_left == 0:
                        finish(tr.index)
                    else:
                        link_busy[link] = _Fluid(tr.index, work, tr.rate, link)
                if done == finished:
                    break

            fluids = [f for f in (*link_busy, *lane_busy) if f is not None]
            demand = sum(f.max_rate for f in fluids)
            scale = min(1.0, self.host_rate / demand) if demand > 0 else 1.0
            nxt = float("inf")
            for f in fluids:
                f.rate = f.max_rate * scale
                nxt = min(nxt, now + f.remaining / f.rate)
            for r in running:
                if r is not None and r[1] < nxt:
                    nxt = r[1]
            if nxt == float("inf"):
                if done < total:
                    raise SimulationError(self._deadlock(head, lane_head))
                break
            dt = nxt - now
            now = nxt
            for w in range(g):
                r = running[w]
                if r is not None and r[1] <= now + _TIME_EPS:
                    running[w] = None
                    finish(r[0])
            for f in fluids:
                if f.remaining <= f.rate * (dt + _TIME_EPS):
                    if f.link < 0:
                        lane_busy[-1 - f.link] = None
                        finish(f.index)
                    else:
                        link_busy[f.link] = None
                        tr = transfers[f.index]
                        if tr.chunks_left == 0:
                            finish(f.index)
                        else:
                            pools[f.link].append(tr)
                else:
                    f.remaining -= f.rate * dt
        return {a: (start[i], end[i]) for i, a in enumerate(self.acts)}

    def _deadlock(self, head: list[int], lane_head: list[int]) -> str:
        blocked = [str(self.acts[q[h]]) for q, h in zip(self.compute_q, head) if h < len(q)]
        blocked += [str(self.acts[q[h]]) for q, h in zip(self.lanes, lane_head) if h < len(q)]
        waiting = [str(self.acts[t.index]) for t in self.transfers.values() if self.end[t.index] < 0
                   and not t.started]
        return ("the replay cannot progress (deadlock): blocked stream heads "
                f"{blocked[:8]}, transfers never ready {waiting[:8]}; validate the schedule "
                "with rpcompile.passes.validate.validate")


@dataclass(frozen=True)
class _Link:
    """The cost of a transfer kind: it runs on its worker's D2H link or its H2D link."""

    d2h: bool


def _compute_ms(replay: _Replay, a: Action) -> float:
    if (a.kind, a.stage) not in replay.times:
        raise InvalidInput(f"no compute time for {a} (kind {a.kind}, stage {a.stage}); the plan "
                         "does not match the schedule")
    return replay.times[(a.kind, a.stage)]


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
    ActionKind.EVICT: lambda replay, a: 0.0,  # frees memory; takes no time
    ActionKind.UP: lambda replay, a: _Link(d2h=False),
    ActionKind.H2D: lambda replay, a: _Link(d2h=False),
    ActionKind.D2H: lambda replay, a: _Link(d2h=True),
    ActionKind.ACC: _memory_pass_work,
    ActionKind.OPT: _optimizer_work,
    ActionKind.SHADOW: _shadow_work,
    ActionKind.REDUCE: _reduction_work,
    ActionKind.CHECK: _check_work,
}
check_registry(SIM_COSTS, "the simulator")
# Kinds whose own end an action waiting on them sees in _waits (the rest: transfers and the
# network lane, counted as instant there), and the kinds on a worker's compute stream.
_TIMED_KINDS = frozenset(k.value for k, spec in ACTION_SPECS.items()
                         if spec.stream in ("compute", "host"))
_COMPUTE_STREAM_KINDS = frozenset(k.value for k, spec in ACTION_SPECS.items()
                                  if spec.stream == "compute")
_COST = {k.value: fn for k, fn in SIM_COSTS.items()}  # keyed by Action.kind's string


# --------------------------------------------------------------------------------------------
# 4. measures
# --------------------------------------------------------------------------------------------


def _measure(sched: Schedule, stages: tuple[Stage, ...], units: tuple[UnitProfile, ...] | None,
             hw: Hardware, timeline: dict[Action, tuple[float, float]],
             times: Mapping[tuple[str, int], float], tokens_per_microbatch: int) -> SimResult:
    makespan = makespan_of(timeline)
    g = sched.workers
    busy, fill, drain, steady = busy_split(sched, timeline, makespan)
    denom = makespan * g if makespan > 0 else 1.0
    step_end = [0.0] * sched.steps
    for lst in sched.actions:
        for a in lst:
            if a.is_compute:
                step_end[a.step] = max(step_end[a.step], timeline[a][1])
    tokens = tokens_per_microbatch * sched.microbatches * sched.rounds * sched.steps
    exposed, idle = _waits(sched, timeline)
    return SimResult(
        schedule=sched, hardware=hw.name, makespan_ms=makespan, tokens=tokens,
        busy_ms=tuple(busy), bubble=(fill + drain + steady) / denom, bubble_fill=fill / denom,
        bubble_drain=drain / denom, bubble_steady=steady / denom,
        exposed_transfer_ms=exposed, idle_by_wait_ms=idle,
        peak_device_bytes=_device_memory(sched, stages, units, timeline),
        peak_host_bytes=_host_memory(sched, stages, units, timeline, hw.undo_journal),
        step_end_ms=tuple(step_end), timeline=timeline,
    )


def makespan_of(timeline: Mapping[Action, tuple[float, float]]) -> float:
    """The end of a replay's last action (0 for an empty one)."""
    return max((e for _, e in timeline.values()), default=0.0)


def _waits(sched: Schedule, timeline: Mapping[Action, tuple[float, float]],
           ) -> tuple[tuple[float, ...], dict[str, float]]:
    """(exposed transfer time per worker, compute-stream idle time by binding edge kind).

    Exposed: the sum over computes of (start - when it could have started had every transfer
    taken no time); a transfer's zero-time readiness is that of what it waits on. Idle by
    kind: each gap before a compute, charged to the kind of the edge that finished last
    (``weights``: the upload; ``arrived``: an input from another worker, be it the transfer or
    the producer's pace; ``data``: a producer on the same worker)."""
    # Each action's waits in edge order: (source, edge kind, whether the source's own end
    # counts: compute and host actions; transfers and the network lane count as instant).
    preds: dict[Action, list[tuple[Action, str, bool]]] = {}
    for e in sched.edges:
        waits = preds.get(e.dst)
        if waits is None:
            preds[e.dst] = waits = []
        waits.append((e.src, e.kind, e.src.kind in _TIMED_KINDS))
    origin: dict[Action, float] = {}

    def free_ready(a: Action) -> float:
        """When a transfer would be done if transfers were instant (iterative, memoised)."""
        stack = [a]
        while stack:
            x = stack[-1]
            if x in origin:
                stack.pop()
                continue
            waits = preds.get(x, ())
            pending = [p for p, _kind, timed in waits if not timed and p not in origin]
            if pending:
                stack.extend(pending)
                continue
            origin[x] = max((timeline[p][1] if timed else origin[p] for p, _kind, timed in waits),
                            default=0.0)
            stack.pop()
        return origin[a]

    out = []
    idle: dict[str, float] = {}
    for lst in sched.actions:
        prev_end = 0.0
        lost = 0.0
        for a in lst:
            if a.kind not in _COMPUTE_STREAM_KINDS:
                continue
            start, end = timeline[a]
            could = prev_end
            waits = preds.get(a)
            if waits is not None:
                for p, _kind, timed in waits:
                    could = max(could, timeline[p][1] if timed else free_ready(p))
            lost += max(0.0, start - could)
            if start > prev_end and waits is not None:
                binding = max(waits, key=lambda pk: timeline[pk[0]][1])[1]
                idle[binding] = idle.get(binding, 0.0) + (start - prev_end)
            prev_end = end
        out.append(lost)
    return tuple(out), dict(sorted(idle.items()))


def _peak(deltas: list[tuple[float, int, int]]) -> int:
    """Peak of a running sum; at equal times frees (order 0) go before allocations."""
    level = peak = 0
    for _, _, d in sorted(deltas):
        level += d
        peak = max(peak, level)
    return peak


def _working_bytes(sched: Schedule, stage: Stage, units: tuple[UnitProfile, ...] | None) -> int:
    """Device memory a compute of ``stage`` needs beyond weights, gradients and the values
    listed in the schedule (one microbatch's activations and transients)."""
    if sched.stage_workers is None:  # RoundPipe: the planner's figure (passes.memory)
        return working_bytes(stage)
    if units is None:
        return 0
    return sum(units[u].working_bytes for u in stage.units)


def _device_memory(sched: Schedule, stages: tuple[Stage, ...],
                   units: tuple[UnitProfile, ...] | None,
                   timeline: Mapping[Action, tuple[float, float]]) -> tuple[int, ...]:
    """Peak device bytes per worker: weight slots (UP start .. EVICT end; a schedule not yet
    lowered: over each job; baselines: their bound stages' weights and gradients all along), the fp32 gradient accumulator of a
    backward job (first compute start .. the start of the compute that takes its slot,
    ``Schedule.releases``, else its D2H grad end), each compute's working set,
    values a compute produces (until their local readers are done and they are given back
    after their D2H: as the compute ``Schedule.releases`` names starts, else at its end), values an
    H2D brings (until the compute reading them ends), and a baseline's stash (F end .. B end,
    the stage's input kept for recompute)."""
    deltas: list[list[tuple[float, int, int]]] = [[] for _ in range(sched.workers)]

    def hold(w: int, start: float, end: float, nbytes: int) -> None:
        if nbytes > 0:
            deltas[w].append((start, 1, nbytes))
            deltas[w].append((end, 0, -nbytes))

    computes: dict[tuple, Action] = {}
    d2h: dict[tuple, Action] = {}
    evict: dict[tuple, Action] = {}
    grad_down: dict[tuple, Action] = {}
    releases = sched.releases()
    for lst in sched.actions:
        for a in lst:
            key = (a.stage, a.microbatch, a.round, a.step)
            if a.is_compute:
                computes[(a.kind, *key)] = a
            elif a.kind == "D2H" and a.what == "grad":
                grad_down[(a.worker, a.stage, a.round, a.step)] = a
            elif a.kind == "D2H":
                d2h[(a.worker, a.value, *key)] = a
            elif a.kind == "EVICT":
                evict[(a.worker, a.stage, a.round, a.step)] = a
    if sched.stage_workers is not None:
        for s, w in enumerate(sched.stage_workers):
            hold(w, 0.0, float("inf"), stages[s].weight_bytes + stages[s].grad_bytes)

    flows_from: dict[tuple[str, int], list] = {}
    readers: dict[tuple[int, str], str] = {}
    for f in sched.flows:
        if f.src_kind is not None:
            flows_from.setdefault((f.src_kind, f.src_stage), []).append(f)
        readers[(f.dst_stage, f.value)] = f.dst_kind

    job_first: dict[tuple, float] = {}
    job_last: dict[tuple, float] = {}
    for lst in sched.actions:
        for a in lst:
            start, end = timeline[a]
            w = a.worker
            if a.kind == "UP":
                ev = evict.get((w, a.stage, a.round, a.step))
                hold(w, start, timeline[ev][1] if ev else end, a.bytes)
            elif a.kind == "H2D":
                dst = computes.get((readers.get((a.stage, a.value)), a.stage, a.microbatch,
                                    a.round, a.step))
                hold(w, start, timeline[dst][1] if dst else end, a.bytes)
            if not a.is_compute:
                continue
            hold(w, start, end, _working_bytes(sched, stages[a.stage], units))
            job = (w, a.stage, a.round, a.step)
            job_first.setdefault(job, start)
            job_last[job] = end
            produced: dict[str, tuple[int, float]] = {}  # value -> (bytes, freed at)
            for f in flows_from.get((a.kind, a.stage), ()):
                nbytes = f.bytes
                if f.what == "save" and f.value.startswith("stash"):
                    nbytes = stages[a.stage].input_bytes  # baseline: the input kept for B
                reader = computes.get((f.dst_kind, f.dst_stage, a.microbatch, a.round, a.step))
                free = end
                if reader is not None and reader.worker == w:
                    free = max(free, timeline[reader][1])
                down = d2h.get((w, f.value, a.stage, a.microbatch, a.round, a.step))
                if down is not None:
                    free = max(free, timeline[down][1])
                    if down in releases:  # given back as that compute starts
                        free = max(free, timeline[releases[down]][0])
                # One tensor however many readers it has (the runtime holds it once).
                held = produced.get(f.value, (0, end))
                produced[f.value] = (max(held[0], nbytes), max(held[1], free))
            for nbytes, free in produced.values():
                hold(w, end, free, nbytes)
    if sched.stage_workers is None:
        for job, first in job_first.items():
            w, s, _, _ = job
            if job not in evict:  # not lowered: weights resident over the job
                hold(w, first, job_last[job], stages[s].upload_bytes)
            if stages[s].kind == "forward" or not stages[s].grad_bytes:
                continue
            down = grad_down.get(job)
            free = timeline[down][1] if down else job_last[job]
            if down in releases:  # its slot is given back as that compute starts
                free = max(free, timeline[releases[down]][0])
            hold(w, first, free, stages[s].grad_bytes)
    return tuple(_peak(d) for d in deltas)


def _host_memory(sched: Schedule, stages: tuple[Stage, ...],
                 units: tuple[UnitProfile, ...] | None,
                 timeline: Mapping[Action, tuple[float, float]], journal: bool = True) -> int:
    """Peak host bytes. Static: fp32 masters and Adam moments of the trainable parameters
    (12 bytes each, when unit profiles are known); RoundPipe adds one low-precision shadow
    and one fp32 gradient accumulator per parameter, shared by the stages that read it, in
    async mode a second one, the pending gradients, and the undo journal unless ``journal``
    is off (rpcompile.passes.memory.HostMemory; without
    unit profiles: each stage's shadow and accumulator); a baseline adds the bf16
    weights of frozen parameters. Dynamic: activations between
    their D2H start and the end of the last H2D reading them, and a job's gradients between
    their D2H start and the end of their ACC; for RoundPipe counted as the runtime's staging
    pool holds them (:func:`_staging_pool`: buffers kept and lent again, best fit), for a
    baseline as the peak of their sum."""
    if sched.stage_workers is None and units is not None:
        # Masters, Adam moments, gradients and shadows, every parameter once (the runtime's
        # host store): rpcompile.passes.memory.HostMemory.
        from rpcompile.passes.memory import host_static_bytes

        static = host_static_bytes(stages, units, sched.optimizer, journal=journal)
    elif sched.stage_workers is None:
        static = sum(s.weight_bytes + s.grad_bytes for s in stages)
        if sched.optimizer == "async":
            static += sum(s.grad_bytes for s in stages)
    else:
        static = 0 if units is None else sum(12 * u.trainable_params + 2 * u.frozen_params
                                             for u in units)
    stays: list[tuple[float, float, int]] = []  # each download on the host: start, end, bytes
    last_read: dict[tuple, float] = {}
    acc_end: dict[tuple, float] = {}
    for lst in sched.actions:
        for a in lst:
            if a.kind == "H2D":
                key = (a.value, a.microbatch, a.round, a.step)
                last_read[key] = max(last_read.get(key, 0.0), timeline[a][1])
    for a in sched.host:
        if a.kind == "ACC":
            acc_end[(a.stage, a.round, a.step)] = timeline[a][1]
    for lst in sched.actions:
        for a in lst:
            if a.kind != "D2H":
                continue
            start, end = timeline[a]
            if a.what == "grad":
                free = acc_end.get((a.stage, a.round, a.step), end)
            else:
                free = max(end, last_read.get((a.value, a.microbatch, a.round, a.step), end))
            stays.append((start, free, a.bytes))
    if sched.stage_workers is None:
        # The runtime stages each download in a buffer it keeps and lends again (the
        # smallest free one that holds it, within STAGING_FIT; HostStaging): what it holds
        # is this rule replayed over the step.
        return static + _staging_pool(stays)
    return static + _peak([e for start, end, n in stays for e in ((start, 1, n), (end, 0, -n))])


def _staging_pool(stays: list[tuple[float, float, int]]) -> int:
    """The bytes a pool holds that lends each download (start, end, bytes) the smallest free
    buffer at least its size and at most ``STAGING_FIT`` times it, or makes one of exactly
    its size, and keeps every buffer
    (rpcompile.runtime.memory.HostStaging); at equal times, buffers come back first."""
    # (time, order, download): at equal times buffers come back (0) before they are taken
    # (1), except a download's own return when it stays no time at all (2: after its take).
    events = sorted([(start, 1, i) for i, (start, _, _) in enumerate(stays)]
                    + [(end, 0 if end > start else 2, i) for i, (start, end, _)
                       in enumerate(stays)])
    free: list[int] = []  # sizes of the free buffers, sorted
    lent: dict[int, int] = {}  # download -> the size of the buffer it holds
    made = 0
    for _, order, i in events:
        nbytes = stays[i][2]
        if nbytes <= 0:
            continue
        if order != 1:
            bisect.insort(free, lent.pop(i))
            continue
        j = bisect.bisect_left(free, nbytes)
        if j < len(free) and free[j] <= STAGING_FIT * nbytes:
            lent[i] = free.pop(j)
        else:
            lent[i] = nbytes
            made += nbytes
    return made

"""The replay: an event loop over a schedule's numbered actions.

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
  * on a profile whose workers share CPU cores (``Hardware.shared_cores`` > 0: virtual
    workers), the running computes, transfers (a virtual worker's copy is a stream thread's
    memcpy) and host-lane actions share those cores: with n of them running, each
    progresses at min(1, shared_cores / n) of its full rate (processor sharing, re-solved at
    every start and finish); 0 leaves every worker its own device;
  * an action starts once every edge it waits on is done (and, on an ordered stream, the
    action before it has finished).
Ties are broken by fixed orders (worker, stream, list position), so a replay is deterministic."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rpcompile.errors import RPCompileError
from rpcompile.hardware import Hardware
from rpcompile.ir import (
    ACTION_SPECS,
    Action,
    ActionKind,
    Schedule,
)
from rpcompile.sim.engine.costs import _COST, _Link

__all__ = [
    "SimulationError",
]


_TIME_EPS = 1e-9  # ms; two events closer than this happen together


class SimulationError(RPCompileError, RuntimeError):
    """The replay cannot go on (a deadlock): the message lists the blocked stream heads."""


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
        cores = self.hw.shared_cores
        inf = float("inf")
        # The share of a core each running compute, transfer and host-lane action gets
        # (always 1 on a profile without shared cores); a compute's end in ``running`` is at
        # this share.
        cpu_share = 1.0

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
                            running[w] = (i, now + duration[i] / cpu_share)
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
                    tr = pool[0] if len(pool) == 1 else \
                        min(pool, key=lambda t: (t.bulk, not t.started, t.ready, t.order))
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

            if cores:
                cpu_share = self._share_cores(running, link_busy, lane_busy, cpu_share, now)
            # The fluids in link order, then the lanes' (the order their rates are summed in).
            fluids = [f for f in link_busy if f is not None]
            fluids += [f for f in lane_busy if f is not None]
            demand = sum([f.max_rate for f in fluids])
            scale = min(1.0, self.host_rate / demand) if demand > 0 else 1.0
            share = min(scale, cpu_share)
            nxt = inf
            for f in fluids:
                # A transfer's and a host action's rate: the lower of its share of the host's
                # memory bandwidth and its share of the cores (1 without shared cores).
                rate = f.rate = f.max_rate * share
                t = now + f.remaining / rate
                if t < nxt:
                    nxt = t
            for r in running:
                if r is not None and r[1] < nxt:
                    nxt = r[1]
            if nxt == inf:
                if done < total:
                    raise SimulationError(self._deadlock(head, lane_head))
                break
            dt = nxt - now
            now = nxt
            due = now + _TIME_EPS
            for w in range(g):
                r = running[w]
                if r is not None and r[1] <= due:
                    running[w] = None
                    finish(r[0])
            span = dt + _TIME_EPS
            for f in fluids:
                if f.remaining <= f.rate * span:
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

    def _share_cores(self, running: list[tuple[int, float] | None],
                     link_busy: list[_Fluid | None], lane_busy: list[_Fluid | None],
                     share: float, now: float) -> float:
        """The core share of each running compute, transfer and host-lane action once the
        starts at ``now`` are in: min(1, shared_cores / how many run). Each running compute's
        end, reckoned at the old ``share``, moves to what its work left takes at the new
        one."""
        n = sum(r is not None for r in running) + sum(f is not None for f in link_busy) + \
            sum(f is not None for f in lane_busy)
        new = min(1.0, self.hw.shared_cores / n) if n else 1.0
        if new != share:
            for w, r in enumerate(running):
                if r is not None:
                    running[w] = (r[0], now + (r[1] - now) * share / new)
        return new

    def _deadlock(self, head: list[int], lane_head: list[int]) -> str:
        blocked = [str(self.acts[q[h]]) for q, h in zip(self.compute_q, head) if h < len(q)]
        blocked += [str(self.acts[q[h]]) for q, h in zip(self.lanes, lane_head) if h < len(q)]
        waiting = [str(self.acts[t.index]) for t in self.transfers.values() if self.end[t.index] < 0
                   and not t.started]
        return ("the replay cannot progress (deadlock): blocked stream heads "
                f"{blocked[:8]}, transfers never ready {waiting[:8]}; validate the schedule "
                "with rpcompile.passes.validate.validate")

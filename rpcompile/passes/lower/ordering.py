"""Lowering passes 4c, 4d and 5: the commit edges that close each step and bound the steps in
flight, the data-parallel barrier between steps, and the pruning of edges that stream order or
another edge already implies (what remains is the set of events a runtime records and waits
on)."""

from __future__ import annotations

import itertools

from rpcompile.ir import ORDERED_STREAMS, STEPS_IN_FLIGHT, Action, Edge, Schedule
from rpcompile.passes.lower.common import _once, _require_roundpipe

__all__ = [
    "add_commit",
    "add_events",
    "add_step_barrier",
]


# --------------------------------------------------------------------------------------------
# 4c. commit
# --------------------------------------------------------------------------------------------


def add_commit(sched: Schedule) -> Schedule:
    """Edges (kind ``commit``) from step k's last action of each ordered queue (each worker's
    compute stream, the network lane) to step k's last host action, its *commit point*: when
    it has run, every action of step k has ended, and the runtime commits the step there
    (docs/runtime.md). Every action of step k precedes one of those last actions (a transfer
    always has a successor in its step: the compute that reads it, the ACC of its
    gradients), so the commit point follows all of them.

    Step k+1's jobs wait only for what they read (the shadow of their stage, sync mode's
    from step k's update) and for the memory bounds of their worker (``buffer``,
    ``grad_pair``, ``window``, ``sent``, which run across steps), so step k+1's forward jobs
    run while step k's backward jobs drain. Step k+1's host actions follow step k's commit
    point in the host queue: the host has at most one step open, and a step commits before
    the next one's first update.

    The runtime keeps at most :data:`~rpcompile.ir.STEPS_IN_FLIGHT` steps uncommitted: it
    submits step k+STEPS_IN_FLIGHT once step k has committed. Edges (kind ``in_flight``)
    from step k's commit point to each first action of step k+STEPS_IN_FLIGHT
    (:func:`_step_starts`) say so, so the simulator never starts a step earlier than the
    runtime can. Data parallel (``Schedule.ranks`` > 1) keeps one step in flight: the
    ``barrier`` pass writes that wait instead."""
    _require_roundpipe(sched, "commit")
    by_step: dict[int, dict[tuple[int | None, str], Action]] = {}
    for q, lst in sched.queues().items():
        if q[1] in ORDERED_STREAMS:
            for a in lst:
                by_step.setdefault(a.step, {})[q] = a  # the queue's last action of the step
    edges = list(sched.edges)
    hubs: set[Action] = set()
    for _step, last in sorted(by_step.items()):
        hub = last.get((None, "host"))
        if hub is None:  # nothing trainable: no host action, nothing to commit
            continue
        hubs.add(hub)
        edges += [Edge(a, hub, "commit") for q, a in last.items() if q != (None, "host")]
    if sched.ranks == 1:
        commits = {a.step: a for a in sched.host}  # each step's last host action
        starts = _step_starts(sched)
        for k, hub in sorted(commits.items()):
            edges += [Edge(hub, b, "in_flight") for b in starts.get(k + STEPS_IN_FLIGHT, ())]
    # A worker's last job of step k and its first of step k+1: as within a step (pass
    # upload), the EVICT waits (landed) for the next UP, which costs no time (the next
    # compute waits for that UP) and makes the overlap of the two weight sets certain, as
    # the memory proof counts it; unless that UP waits for step k's commit point, which
    # waits for the EVICT: then the two sets never overlap, and the order says so already.
    # (A run that stops after step k has no such UP: the runtime meets the wait then.)
    after = {e.dst for e in sched.edges if e.src in hubs}
    for lst in sched.actions:
        evicts = [a for a in lst if a.kind == "EVICT"]
        ups = {(a.stage, a.round, a.step): a for a in lst if a.kind == "UP"}
        for ev, nxt in itertools.pairwise(evicts):
            up = ups[(nxt.stage, nxt.round, nxt.step)]
            if nxt.step == ev.step + 1 and up not in after:
                edges.append(Edge(up, ev, "landed"))
    return sched.replace(edges=tuple(edges), passes=(*sched.passes, "commit"))


# --------------------------------------------------------------------------------------------
# 4d. barrier (data parallel)
# --------------------------------------------------------------------------------------------


def add_step_barrier(sched: Schedule) -> Schedule:
    """Data parallel: edges (kind ``barrier``) from step k's commit point (its last host
    action, pass 4c) to each first action of step k+1: the first of each ordered queue, and
    each transfer with no predecessor edge in its step. Every action of step k+1 follows one
    of them, so step k+1 starts once step k has committed. A rank's collectives (the step's
    start, its gradient check) are per step and must come in the same order on every rank,
    so a data-parallel run keeps one step in flight (rpcompile.runtime.executor), and with
    these edges the simulator waits where it waits."""
    _require_roundpipe(sched, "barrier")
    hubs = {}
    for a in sched.host:
        hubs[a.step] = a  # the step's last host action
    starts = _step_starts(sched)
    # A worker's last EVICT of step k waits (landed) for its first UP of step k+1, which now
    # waits for the commit point, which waits for that EVICT: the two weight sets never
    # overlap across the barrier, so the edge goes.
    edges = [e for e in sched.edges if not (e.kind == "landed" and e.src.step != e.dst.step)]
    for k, hub in sorted(hubs.items()):
        edges += [Edge(hub, b, "barrier") for b in starts.get(k + 1, ())]
    return sched.replace(edges=tuple(edges), passes=(*sched.passes, "barrier"))


def _step_starts(sched: Schedule) -> dict[int, list[Action]]:
    """Each step's first actions outside the host queue: the first of each ordered queue,
    and each transfer with no predecessor edge in its step. Every action of a step follows
    one of them or a host action of the step (which follows the step before's commit point
    in the host queue), so an edge from a commit point to each of them orders the whole
    step after that point."""
    has_pred = {e.dst for e in sched.edges if e.src.step == e.dst.step}
    starts: dict[int, list[Action]] = {}
    for (_w, stream), lst in sched.queues().items():
        if stream == "host":
            continue  # the host queue is ordered: its steps follow the commit points
        seen: set[int] = set()
        for a in lst:
            if stream in ORDERED_STREAMS:
                if a.step not in seen:
                    seen.add(a.step)
                    starts.setdefault(a.step, []).append(a)
            elif a not in has_pred:
                starts.setdefault(a.step, []).append(a)
    return starts


# --------------------------------------------------------------------------------------------
# 5. events
# --------------------------------------------------------------------------------------------


def add_events(sched: Schedule) -> Schedule:
    """Keep only the edges a runtime must turn into events.

    An edge is dropped when both ends are on the same ordered stream (compute, host: the
    stream's order already holds) or when another edge between the same two streams starts no
    earlier and ends no later, where "no earlier" and "no later" may use list order only on
    ordered streams (transfer lanes may finish their transfers in any order). Ordering is
    unchanged: for any two actions, one waits for the other after this pass exactly when it
    did before, under either reading of the transfer lanes.
    """
    _once(sched, "events")
    pos: dict[Action, tuple[tuple[int | None, str], int]] = {}
    for q, lst in sched.queues().items():
        for i, a in enumerate(lst):
            pos[a] = (q, i)
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    kept: list[int] = []  # places in sched.edges, which keeps its order
    edges = sched.edges
    for n, e in enumerate(edges):
        if e.kind == "landed" and e.src.step != e.dst.step:
            # Kept, and no reason to drop another edge: a run whose last step it points
            # from has no such wait (nothing comes after it in the schedule), so what it
            # implies must stand on its own edges.
            kept.append(n)
            continue
        (qs, i), (qd, j) = pos[e.src], pos[e.dst]
        if qs == qd and i < j and qs[1] in ORDERED_STREAMS:
            continue
        # On a lane an edge stands for its own action only: key the group by that action.
        src_key = qs if qs[1] in ORDERED_STREAMS else e.src
        dst_key = qd if qd[1] in ORDERED_STREAMS else e.dst
        groups.setdefault((src_key, dst_key), []).append((j, -i, n))
    for items in groups.values():
        items.sort()  # by end, then latest start; ties in edge order (n grows)
        best = -1  # latest source index among edges ending no later than this one
        for _, neg_i, n in items:
            if -neg_i > best:
                kept.append(n)
                best = -neg_i
    kept.sort()
    return sched.replace(edges=tuple(edges[n] for n in kept), passes=(*sched.passes, "events"))

"""Lowering passes 1-3 (in the order :mod:`rpcompile.passes.lower` lists): a job's weight
uploads and evictions, activations through host memory between the workers, and each job's
gradient download with the host's ACC."""

from __future__ import annotations

from collections.abc import Sequence

from rpcompile.errors import InvalidInput
from rpcompile.ir import BOUNDED_WAITS, Action, Edge, Plan, Schedule, Stage
from rpcompile.options import DEFAULT_CHUNK_BYTES
from rpcompile.passes.lower.common import (
    _chunks,
    _jobs,
    _once,
    _require_roundpipe,
    _splice,
    _stages,
)

__all__ = [
    "add_activation_transfers",
    "add_gradient_downloads",
    "add_weight_uploads",
    "grad_slots",
]


# --------------------------------------------------------------------------------------------
# 1. upload
# --------------------------------------------------------------------------------------------


def add_weight_uploads(sched: Schedule, plan: Plan | Sequence[Stage],
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Schedule:
    """UP before each job and EVICT after it, two weight slots per worker.

    The next job's UP is issued right after the current job's first compute, so it runs while
    the current job computes; it waits (``buffer``) for the EVICT of the job two back on the
    same worker, which bounds a worker to two resident weight sets. The first compute of a job
    waits (``weights``) for its UP. A job's EVICT waits (``landed``) for the next job's UP of
    the same step on that worker: that costs no time (the compute after the EVICT is the next
    job's first, which waits for the same UP), and it makes the overlap of the two weight sets
    certain, not a matter of timing: a run holds both there, as the memory proof counts.
    """
    _require_roundpipe(sched, "upload")
    stages = _stages(plan)
    before: dict[Action, list[Action]] = {}
    after: dict[Action, list[Action]] = {}
    front: dict[int, list[Action]] = {}
    edges = list(sched.edges)
    for w in range(sched.workers):
        jobs = _jobs(sched, w)
        ups = [Action(w, "UP", j.stage, None, j.round, j.step,
                      bytes=stages[j.stage].upload_bytes,
                      chunks=_chunks(stages[j.stage].upload_bytes, chunk_bytes)) for j in jobs]
        evicts = [Action(w, "EVICT", j.stage, None, j.round, j.step) for j in jobs]
        for n, j in enumerate(jobs):
            if n == 0:
                front.setdefault(w, []).append(ups[0])
            if n + 1 < len(jobs):
                after.setdefault(j.computes[0], []).append(ups[n + 1])
            after.setdefault(j.computes[-1], []).append(evicts[n])
            edges.append(Edge(ups[n], j.computes[0], "weights"))
            if n >= 2:
                edges.append(Edge(evicts[n - 2], ups[n], "buffer"))
            # Across steps the next UP may wait (shadow) for the step's commit point, which
            # waits for this EVICT: the commit pass adds the edge where it does not.
            if n + 1 < len(jobs) and jobs[n + 1].step == j.step:
                edges.append(Edge(ups[n + 1], evicts[n], "landed"))
    return sched.replace(actions=_splice(sched, before, after, front), edges=tuple(edges),
                         passes=(*sched.passes, "upload"))


# --------------------------------------------------------------------------------------------
# 2. transfers
# --------------------------------------------------------------------------------------------


def add_activation_transfers(sched: Schedule,
                             memory_waits: Sequence[str] = BOUNDED_WAITS) -> Schedule:
    """D2H/H2D for every flow whose producer and consumer run on different workers.

    A value leaves its producer once (one D2H, issued right after the producing compute), however
    many remote consumers read it; each consumer's worker brings it in with one H2D issued just
    before the reading compute. Host-resident values (ids, labels) only need the H2D. Flows
    between computes on the same worker keep their ``data`` edge and move nothing.
    ``memory_waits``: which of the ``window`` and ``sent`` waits below to add.
    """
    _once(sched, "transfers")
    where: dict[tuple, Action] = {}
    for lst in sched.actions:
        for a in lst:
            if a.is_compute:
                where[(a.kind, a.stage, a.microbatch, a.round, a.step)] = a
    flows_into: dict[tuple[str, int], list] = {}
    for f in sched.flows:
        flows_into.setdefault((f.dst_kind, f.dst_stage), []).append(f)
    # What a value's single D2H carries: 'act' if any remote consumer reads it as an activation.
    payload: dict[tuple[str | None, int | None, str], str] = {}
    size: dict[tuple[str | None, int | None, str], int] = {}
    for f in sched.flows:
        key = (f.src_kind, f.src_stage, f.value)
        if payload.get(key) != "act":
            payload[key] = f.what
        size[key] = max(size.get(key, 0), f.bytes)

    # RoundPipe bounds how long a transfer's tensor may sit on a device, so that a worker's
    # peak is a property of the schedule (rpcompile.passes.memory), not of the timing: an
    # upload starts no earlier than the end of the compute two places before its reader
    # ("window"), and a download ends before the compute two places after its producer
    # ("sent"). Two places leave one whole compute to hide the transfer behind.
    roundpipe = sched.stage_workers is None
    computes = [[a for a in lst if a.is_compute] for lst in sched.actions]
    place = {a: i for lst in computes for i, a in enumerate(lst)}

    def nearby(c: Action, offset: int, wait: str) -> Action | None:
        i = place[c] + offset
        bounded = roundpipe and wait in memory_waits
        return computes[c.worker][i] if bounded and 0 <= i < len(computes[c.worker]) else None

    before: dict[Action, list[Action]] = {}
    after: dict[Action, list[Action]] = {}
    d2h: dict[tuple[Action, str], Action] = {}
    removed: set[tuple[Action, Action]] = set()
    edges: list[Edge] = []
    for lst in sched.actions:
        for c in lst:
            if not c.is_compute:
                continue
            for f in flows_into.get((c.kind, c.stage), ()):
                m, r, k = c.microbatch, c.round, c.step
                h2d = Action(c.worker, "H2D", c.stage, m, r, k, what=f.what, value=f.value,
                             bytes=f.bytes)
                if f.from_host:
                    before.setdefault(c, []).append(h2d)
                    edges.append(Edge(h2d, c, "arrived"))
                    if (early := nearby(c, -2, "window")) is not None:
                        edges.append(Edge(early, h2d, "window"))
                    continue
                p = where[(f.src_kind, f.src_stage, m, r, k)]
                if p.worker == c.worker:
                    continue
                key = (f.src_kind, f.src_stage, f.value)
                down = d2h.get((p, f.value))
                if down is None:
                    down = Action(p.worker, "D2H", p.stage, m, r, k, what=payload[key],
                                  value=f.value, bytes=size[key])
                    d2h[(p, f.value)] = down
                    after.setdefault(p, []).append(down)
                    edges.append(Edge(p, down, "produced"))
                    if (late := nearby(p, 2, "sent")) is not None:
                        edges.append(Edge(down, late, "sent"))
                if (early := nearby(c, -2, "window")) is not None:
                    edges.append(Edge(early, h2d, "window"))
                before.setdefault(c, []).append(h2d)
                edges.append(Edge(down, h2d, "on_host"))
                edges.append(Edge(h2d, c, "arrived"))
                removed.add((p, c))
    kept = [e for e in sched.edges if not (e.kind == "data" and (e.src, e.dst) in removed)]
    return sched.replace(actions=_splice(sched, before, after), edges=(*kept, *edges),
                         passes=(*sched.passes, "transfers"))


def grad_slots(memory_waits: Sequence[str]) -> int:
    """The gradient buffers per worker that ``memory_waits`` allow: 1 with ``grad_slot``, 2
    with ``grad_pair``, else 0 (no bound)."""
    return 1 if "grad_slot" in memory_waits else 2 if "grad_pair" in memory_waits else 0


# --------------------------------------------------------------------------------------------
# 3. grads
# --------------------------------------------------------------------------------------------


def add_gradient_downloads(sched: Schedule, plan: Plan | Sequence[Stage],
                           chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                           grad_slots: int = 2) -> Schedule:
    """One D2H grad per backward job, and a host ACC per (stage, round, step).

    A T or B compute accumulates its microbatch's parameter gradients into the job's fp32
    gradient buffer on the worker (the job's first microbatch zero-fills it), so the job sends
    its gradients home once, after its last compute (``grad_ready``). The host adds them into
    the stage's fp32 accumulator (ACC after ``grad_home``), in dispatch order. Stages without
    trainable parameters (grad_bytes == 0) send nothing.

    ``grad_slots``: how many gradient buffers a worker holds at once (0: no bound). With
    ``n`` slots, the first compute of a worker's gradient job waits for the download of its
    gradient job ``n`` places back, in this step or an earlier one (steps overlap: a job of
    step k+1 may take the slot of one of step k), (edge ``grad_pair`` for 2, ``grad_slot``
    for 1), and that
    buffer is given back right before that compute starts, not when its download ends
    (:meth:`~rpcompile.ir.Schedule.releases`): what a worker holds is then fixed by
    the schedule, whatever the downloads' speed.
    """
    if grad_slots not in (0, 1, 2):
        raise InvalidInput(f"grad_slots must be 0, 1 or 2, got {grad_slots!r}")
    _require_roundpipe(sched, "grads")
    stages = _stages(plan)
    after: dict[Action, list[Action]] = {}
    edges = list(sched.edges)
    acc: list[tuple[tuple, Action]] = []
    for w in range(sched.workers):
        lst = sched.actions[w]
        place = {a: i for i, a in enumerate(lst)}
        previous: list[Action] = []  # the worker's gradient downloads so far, every step
        for j in _jobs(sched, w):
            nbytes = stages[j.stage].grad_bytes
            if j.computes[0].kind == "F" or nbytes == 0:
                continue
            down = Action(w, "D2H", j.stage, None, j.round, j.step, what="grad", bytes=nbytes,
                          chunks=_chunks(nbytes, chunk_bytes))
            if grad_slots and len(previous) >= grad_slots:
                # At most ``grad_slots`` gradient buffers per worker: a job's buffer takes
                # the slot of the one ``grad_slots`` jobs back, once that one is home.
                edges.append(Edge(previous[-grad_slots], j.computes[0],
                                  "grad_slot" if grad_slots == 1 else "grad_pair"))
            previous.append(down)
            host = Action(None, "ACC", j.stage, None, j.round, j.step, bytes=nbytes)
            # Issue it after what the last compute already sends on and the job's EVICT, so the
            # last microbatch's input gradient is not issued behind the bulk download.
            anchor = place[j.computes[-1]]
            while anchor + 1 < len(lst) and not lst[anchor + 1].is_compute and \
                    lst[anchor + 1].kind in ("D2H", "EVICT") and \
                    (lst[anchor + 1].stage, lst[anchor + 1].round,
                     lst[anchor + 1].step) == (j.stage, j.round, j.step):
                anchor += 1
            after.setdefault(lst[anchor], []).append(down)
            edges += [Edge(j.computes[-1], down, "grad_ready"), Edge(down, host, "grad_home")]
            acc.append(((j.step, j.round, j.stage), host))
    acc.sort(key=lambda t: t[0])  # dispatch order: step, round, stage
    return sched.replace(actions=_splice(sched, {}, after),
                         host=(*sched.host, *(a for _, a in acc)), edges=tuple(edges),
                         passes=(*sched.passes, "grads"))

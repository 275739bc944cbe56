"""Device memory of a lowered RoundPipe schedule, proven from its order alone.

The partitioner's per-stage figure (``Stage.peak_bytes``: weights twice, the fp32 gradients,
one microbatch's working set) misses what the lowered schedule holds at once: the next job's
weights while they upload, the previous job's gradients while they download, values a forward
stage keeps for a backward stage on the same worker, inputs uploaded ahead of their reader.
:func:`worker_peaks` bounds each worker's memory at every point of its compute stream, whatever
the timing. It reads the schedule's happens-before order (its edges, plus list order on the
ordered streams: each worker's compute stream and the host queue): a transfer that allocates
device memory cannot start before every compute that precedes it in that order has ended, and
one that frees memory has ended before every compute that follows it starts. So:

  * a job's weights (UP) live from the end of the last compute of their worker that precedes
    the UP (at least the EVICT two jobs back: ``buffer``) until the job's EVICT;
  * a job's fp32 gradient buffer is allocated by its first compute and given back right
    before the compute its gradient-slot edge names (``grad_pair``, ``grad_slot``:
    ``Schedule.releases``), which the runtime and the simulator honour whatever the
    download's speed; without one (a step's last gradient jobs), when its D2H ends, before
    the first compute of the worker that follows that D2H;
  * an input (H2D) lives from the end of the last compute of its worker that precedes it until
    its reader ends;
  * a value a compute produces lives from that compute's end until its last local reader ends
    and it is given back after its D2H: right before the compute its ``sent`` edge names
    (``Schedule.releases``), or, without one, when the D2H ends (before the first compute of
    the worker that follows the D2H);
  * each compute's working set (one microbatch's activations and transients:
    ``Stage.peak_bytes`` less twice the weights and the gradients) lives while it runs.

The lowering's memory-bounding waits (``Plan.memory_waits``, rpcompile.passes.lower) tighten
that order so the peak is what the planner assumes: an input uploads no earlier than the end
of the compute two places before its reader (``window``), a value's D2H ends before the
compute two places after its producer (``sent``), a worker holds two gradient buffers
(``grad_pair``, every plan's default) or one (``grad_slot``, for a plan that fits only so).
Without them the proof still holds, over the longer holds the rest of the order allows (a
value may wait for a chain of jobs round the other workers), and is far from what a run
reaches (half of it on the paper workloads); with them it is within a few percent.

Points of a worker's compute stream: the gap before action ``p`` is point ``2p``, action ``p``
itself is ``2p + 1``, the gap after the last action is ``2L``. Every hold above is an interval
of points; the peak is the largest sum over one point. Any replay that honours the schedule's
edges (the simulator, the runtime) stays at or below it; with every wait in place the simulator
reaches it when transfers are slow enough, the virtual workers when they are fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rpcompile.errors import InvalidInput, RPCompileError
from rpcompile.ir import Action, Plan, Schedule, ScheduleError, Stage

__all__ = ["HostMemory", "HostMemoryError", "HostMemoryWarning", "WorkerPeak", "check_staging",
           "format_bytes", "host_memory", "host_ram_problem", "host_static_bytes",
           "schedule_order", "staging_problem", "worker_peaks", "working_bytes"]

PARTS = ("weights", "grads", "values", "working")


@dataclass(frozen=True)
class WorkerPeak:
    """One worker's proven peak: ``peak_bytes`` = the sum of ``parts`` at ``action`` (the
    compute-stream action at, or just after, the peak), and ``held_bytes``: the peak of the
    same holds without compute working sets (what a virtual worker accounts).

    A run of the schedule reaches ``held_bytes`` within a few percent whatever its timing:
    what a worker gives back after a download is given back at a compute the schedule names
    (``Schedule.releases``), not when the download happens to end. (A tensor that several
    boundary values share, such as rotary tables, is counted once per value here and once
    on the worker.)"""

    worker: int
    peak_bytes: int
    held_bytes: int
    action: Action | None
    parts: dict[str, int] = field(default_factory=dict)
    stages: tuple[int, ...] = ()  # stages whose weights, gradients or values are held then

    def describe(self, stage_name=lambda s: f"stage {s}") -> str:
        what = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        at = "" if self.action is None else f" during {self.action}"
        names = ", ".join(stage_name(s) for s in self.stages)
        return (f"worker {self.worker}: {format_bytes(self.peak_bytes)}{at} "
                f"({what}; stages {names})")


def format_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps at least one whole digit: '21.43 GiB', '812.0 MiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def working_bytes(stage: Stage) -> int:
    """One compute's working set: the stage figure less twice its upload (weights and
    buffers) and its gradients."""
    return max(0, stage.peak_bytes - 2 * stage.upload_bytes - stage.grad_bytes)


def worker_peaks(sched: Schedule, plan: Plan | Sequence[Stage], *,
                 steps: int | None = None, order: ScheduleOrder | None = None,
                 ) -> tuple[WorkerPeak, ...]:
    """The peak device memory of every worker over the whole lowered RoundPipe ``sched``,
    its steps overlapping as the order lets them (the next step's jobs upload and run while
    this step's last jobs drain, both steps' weights, gradient buffers and values held on
    one worker at once).

    ``steps``: the peak over the points of the first ``steps`` steps only, the rest of the
    schedule their context: a schedule's last steps lack the waits into the steps after them
    that a longer run has (a download's memory given back at a compute of the next step), so
    their own points are proven looser than any run reaches. The runtime's schedule, which a
    long run cycles through (``Schedule.step_of``), is proven over a lowering one dispatch
    period longer, at its own steps (rpcompile.passes.lower.runtime_peaks): every step of its
    repeated part after the steps before it and before the steps after it, as in a long run;
    where the first steps lack a wait (nothing before step 0), looser, never tighter.

    ``order``: ``schedule_order(sched)``, for a caller that proves one schedule under several
    memory figures (the stages' ``peak_bytes``, the units' ``working_bytes``: the loss-chunk
    variants of one plan): the order is the costly part and reads none of them.

    Raises ``ValueError`` for a schedule that is not lowered (no UP/EVICT) or is a
    weight-bound baseline: their memory is not bounded by the schedule's order.
    """
    if sched.stage_workers is not None:
        raise InvalidInput("worker_peaks applies to RoundPipe schedules (a baseline's weights "
                         "stay on their workers all along)")
    if "upload" not in sched.passes:
        raise InvalidInput("worker_peaks needs a lowered schedule (rpcompile.passes.lower)")
    stages = tuple(plan.stages if isinstance(plan, Plan) else plan)
    flows_from: dict[tuple[str, int], dict[str, int]] = {}
    readers: dict[tuple[int, str], str] = {}
    for f in sched.flows:
        if f.src_kind is not None:
            out = flows_from.setdefault((f.src_kind, f.src_stage), {})
            out[f.value] = max(out.get(f.value, 0), f.bytes)
        readers[(f.dst_stage, f.value)] = f.dst_kind
    consumers: dict[tuple[str, int, str], list[str]] = {}
    for f in sched.flows:
        if f.src_kind is not None:
            consumers.setdefault((f.src_kind, f.src_stage, f.value), []).append(
                (f.dst_kind, f.dst_stage))
    releases = sched.releases()
    ids, latest, earliest = schedule_order(sched) if order is None else order
    return tuple(_worker_peak(lst, w, stages, ids, latest, earliest, flows_from, readers,
                              consumers, releases, steps) for w, lst in enumerate(sched.actions))


_NONE = 1 << 62  # no compute of that worker follows

# (number of each action, then per number and per worker: the latest and the earliest
# compute-stream positions), as schedule_order gives them.
ScheduleOrder = tuple[dict[Action, int], list[list[int]], list[list[int]]]


def schedule_order(sched: Schedule) -> ScheduleOrder:
    """The happens-before order :func:`worker_peaks` reads, per action and per worker: the
    last compute-stream position that ends before the action starts, and the first that
    starts after it ends. A function of the schedule's lists and edges alone."""
    return _order(sched.actions, sched.host, sched.edges)


def _order(lists, host, edges) -> ScheduleOrder:
    """Each action's number, and per number, per worker: ``latest``, the last
    compute-stream position of that worker that ends before the action starts (-1: none),
    and ``earliest``, the first one that starts after the action ends (``_NONE``: none), in
    the happens-before order of ``edges`` and the ordered streams' list order (transfer
    lanes may run in any order). Actions are numbered first, so the order is worked out on
    lists of ints."""
    workers = len(lists)
    actions: list[Action] = [a for lst in lists for a in lst]
    actions += host
    ids = dict(zip(actions, range(len(actions))))
    n = len(actions)
    succ: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    where: list[tuple[int, int] | None] = [None] * n  # compute stream: (worker, position)
    for w, lst in enumerate(lists):
        stream = [ids[a] for a in lst if a.stream == "compute"]
        for p, i in enumerate(stream):
            where[i] = (w, p)
        for x, y in itertools.pairwise(stream):
            succ[x].append(y)
            indegree[y] += 1
    for x, y in itertools.pairwise(ids[a] for a in host):
        succ[x].append(y)
        indegree[y] += 1

    def number(a: Action) -> int:  # an action no list holds: an edge orders it all the same
        if a not in ids:
            ids[a] = len(actions)
            actions.append(a)
            succ.append([])
            indegree.append(0)
            where.append(None)
        return ids[a]

    get = ids.get
    for e in edges:
        x, y = get(e.src), get(e.dst)
        if x is None or y is None:
            x, y = number(e.src), number(e.dst)
        succ[x].append(y)
        indegree[y] += 1
    n = len(actions)
    ready = [i for i in range(n) if indegree[i] == 0]
    topo: list[int] = []
    while ready:
        i = ready.pop()
        topo.append(i)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(topo) != n:
        raise InvalidInput("the schedule's order has a cycle (it would deadlock)")
    # A vector is never changed once made, so an action with one predecessor (successor)
    # shares that one's instead of copying it: most of a lowered schedule's actions.
    never = [-1] * workers
    latest: list[list[int]] = [never] * n
    for i in topo:
        done = latest[i]
        if where[i] is not None:
            w, p = where[i]
            if p > done[w]:
                done = done.copy()
                done[w] = p
        for j in succ[i]:
            mine = latest[j]
            latest[j] = done if mine is never or mine is done else list(map(max, mine, done))
    # ``after[i]``: ``earliest[i]`` with action i's own compute-stream position in it (what
    # a predecessor of i sees through it).
    none = [_NONE] * workers
    earliest: list[list[int]] = [none] * n
    after: list[list[int]] = [none] * n
    for i in reversed(topo):
        mine = none
        for j in succ[i]:
            theirs = after[j]
            mine = theirs if mine is none or mine is theirs else list(map(min, mine, theirs))
        earliest[i] = mine
        if where[i] is not None:
            w, p = where[i]
            if p < mine[w]:
                mine = mine.copy()
                mine[w] = p
        after[i] = mine
    return ids, latest, earliest


def _worker_peak(lst, w, stages, ids, latest, earliest, flows_from, readers, consumers,
                 releases, steps=None):
    stream = [a for a in lst if a.stream == "compute"]
    pos = {a: p for p, a in enumerate(stream)}
    end = 2 * len(stream)
    # The last point counted: the gap before the worker's first action of step ``steps``.
    upto = next((2 * p for p, a in enumerate(stream) if steps is not None and a.step >= steps),
                end)
    compute_at = {(a.kind, a.stage, a.microbatch, a.round, a.step): a
                  for a in stream if a.is_compute}
    evict = {(a.stage, a.round, a.step): a for a in stream if a.kind == "EVICT"}
    first_of_job: dict[tuple[int, int | None, int], Action] = {}  # a job's first compute
    for a in stream:
        if a.is_compute:
            first_of_job.setdefault((a.stage, a.round, a.step), a)
    d2h = {(a.stage, a.microbatch, a.round, a.step, a.value): a
           for a in lst if a.kind == "D2H" and a.what != "grad"}
    holds: list[tuple[int, int, str, int, int]] = []  # (first, last point, part, bytes, stage)
    outputs: dict[int, int] = {}  # compute point -> bytes of the values it leaves held

    def hold(first: int, last: int, part: str, nbytes: int, stage: int) -> None:
        if nbytes > 0:
            holds.append((first, max(first, last), part, nbytes, stage))

    def starts(a: Action) -> int:  # the gap after the last compute ending before a starts
        return 2 * latest[ids[a]][w] + 2

    def freed(a: Action) -> int:  # the gap before the first compute starting after a ends
        p = earliest[ids[a]][w]
        return end if p == _NONE else 2 * p

    def released(down: Action) -> int:
        """Where what D2H ``down`` sent home is given back: right before the compute the
        schedule names for it (``Schedule.releases``), else when the download ends."""
        at = releases.get(down)
        return 2 * pos[at] if at in pos else freed(down)

    for a in lst:
        if a.kind == "UP":
            ev = evict.get((a.stage, a.round, a.step))
            hold(starts(a), end if ev is None else 2 * pos[ev], "weights", a.bytes, a.stage)
        elif a.kind == "H2D":
            reader = compute_at.get((readers.get((a.stage, a.value)), a.stage, a.microbatch,
                                     a.round, a.step))
            hold(starts(a), end if reader is None else 2 * pos[reader] + 1, "values", a.bytes,
                 a.stage)
        elif a.kind == "D2H" and a.what == "grad":
            first = first_of_job[(a.stage, a.round, a.step)]
            hold(2 * pos[first] + 1, released(a), "grads", a.bytes, a.stage)
        if not a.is_compute:
            continue
        p = pos[a]
        stage = stages[a.stage]
        hold(2 * p + 1, 2 * p + 1, "working", working_bytes(stage), a.stage)
        for value, nbytes in flows_from.get((a.kind, a.stage), {}).items():
            last = 2 * p + 2
            kept = False
            for dst_kind, dst_stage in consumers[(a.kind, a.stage, value)]:
                r = compute_at.get((dst_kind, dst_stage, a.microbatch, a.round, a.step))
                if r is not None:
                    last, kept = max(last, 2 * pos[r] + 1), True
            down = d2h.get((a.stage, a.microbatch, a.round, a.step, value))
            if down is not None:
                last, kept = max(last, released(down)), True
            if kept:
                hold(2 * p + 2, last, "values", nbytes, a.stage)
                # The compute registers its outputs before it lets go of its inputs: a
                # worker's accounting holds both as it ends (the working set covers this in
                # the peak).
                outputs[2 * p + 1] = outputs.get(2 * p + 1, 0) + nbytes
    return _sweep(w, stream, end, holds, outputs, upto)


def _sweep(w, stream, end, holds, outputs, upto) -> WorkerPeak:
    delta = [[0] * (end + 2) for _ in PARTS]
    index = {part: i for i, part in enumerate(PARTS)}
    for first, last, part, nbytes, _stage in holds:
        delta[index[part]][first] += nbytes
        delta[index[part]][last + 1] -= nbytes
    level = [0] * len(PARTS)
    best = held = 0
    best_point = 0
    for point in range(upto + 1):
        for i in range(len(PARTS)):
            level[i] += delta[i][point]
        total = sum(level)
        held = max(held, total - level[index["working"]] + outputs.get(point, 0))
        if total > best:
            best, best_point = total, point
    parts = {part: 0 for part in PARTS}
    live = set()
    for first, last, part, nbytes, stage in holds:
        if first <= best_point <= last:
            parts[part] += nbytes
            live.add(stage)
    action = stream[min(best_point // 2, len(stream) - 1)] if stream else None
    return WorkerPeak(w, best, held, action, parts, tuple(sorted(live)))


# ---------------------------------------------------------------------------------------------
# Host staging
# ---------------------------------------------------------------------------------------------


def staging_problem(sched: Schedule) -> str | None:
    """What breaks the host staging proof of ``sched`` (None: nothing): the transfer staging
    a run holds is the sum of ``Schedule.staging_bytes``, whatever its timing, when every
    download has a slot it fits (:func:`~rpcompile.passes.staging.staging_slot`) and every two downloads of one slot are
    ordered by the schedule's happens-before order (edges, and list order on the ordered
    streams): the actions that free the earlier one
    (:func:`~rpcompile.passes.staging.download_frees`) before the later one starts. Checked
    for consecutive holders, which orders every pair; a slot's holders are taken in step
    order, within a step in the order their ``reuse`` edges link them, and a pair no direct
    edge orders is searched for a path. A run repeats its cycle's steps
    (``Schedule.step_of``), so the ``reuse`` edges into a repeated step must be those into
    its copy one cycle on. Reads the schedule alone, not how its slots were chosen. A
    baseline (``stage_workers`` set) stages nothing: None."""
    from rpcompile.passes.staging import download_frees, staging_slot, step_key

    if sched.stage_workers is not None:
        return None
    frees = {a: by for a, by in download_frees(sched).items() if a.bytes > 0}
    if not frees:
        return None
    if not sched.staging:
        return "the schedule has no host staging slots (rpcompile.passes.staging.staging_slots)"
    slot_of = {step_key(a): slot for a, slot in sched.staging}
    sizes = sched.staging_bytes
    chains: dict[int, list[Action]] = {}
    for a in frees:
        slot = staging_slot(sched, slot_of, a, a.step)
        if slot is None or not 0 <= slot < len(sizes):
            return f"the download {a} has no host staging slot"
        if a.bytes > sizes[slot]:
            return (f"the download {a} ({format_bytes(a.bytes)}) does not fit its staging "
                    f"slot {slot} ({format_bytes(sizes[slot])})")
        chains.setdefault(slot, []).append(a)
    reuse = {(e.src, e.dst) for e in sched.edges if e.kind == "reuse"}
    freed_by: dict[Action, list[Action]] = {}
    for a, by in frees.items():
        for f in by:
            freed_by.setdefault(f, []).append(a)
    links: dict[Action, set[Action]] = {}  # holder -> the holders its frees' reuse edges reach
    for f, y in reuse:
        for x in freed_by.get(f, ()):
            links.setdefault(x, set()).add(y)
    path = _PathSearch(sched)
    for slot, chain in chains.items():
        for x, y in itertools.pairwise(_holder_order(chain, links)):
            for f in frees[x]:
                if f != y and (f, y) not in reuse and not path(f, y):
                    return (f"the downloads {x} and {y} share host staging slot {slot}, but "
                            f"nothing orders {f} (which frees the first) before the second")
    return _reuse_not_periodic(sched, reuse)


def check_staging(sched: Schedule) -> None:
    """Raise :class:`~rpcompile.ir.ScheduleError` naming what breaks the host staging proof
    of ``sched`` (:func:`staging_problem`)."""
    problem = staging_problem(sched)
    if problem is not None:
        raise ScheduleError(f"the host staging is not proven: {problem}")


def _holder_order(chain: list[Action], links: dict[Action, set[Action]]) -> list[Action]:
    """A slot's holders by step, and within a step following the reuse links (a holder
    no other of its step links to first): the order whose consecutive pairs the proof
    checks. Any order is sound (the check then orders them all); this one is the order the
    links were made in."""
    out: list[Action] = []
    for _, group in itertools.groupby(sorted(chain, key=lambda a: a.step), lambda a: a.step):
        group = list(group)
        members = set(group)
        linked = {y for x in group for y in links.get(x, ()) if y in members and y != x}
        todo = [a for a in group if a not in linked] or group[:1]
        seen: set[Action] = set()
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            out.append(x)
            todo.extend(y for y in links.get(x, ()) if y in members and y not in seen)
        out.extend(a for a in group if a not in seen)
    return out


class _PathSearch:
    """``search(a, b)``: a path of edges and ordered-stream successions leads from ``a`` to
    ``b``. The graph is built on the first search (the proof rarely needs one: a slot's
    consecutive holders are mostly ordered by a direct reuse edge); a search goes through
    the actions the dry run placed before ``b`` only (a linear extension of the order)."""

    def __init__(self, sched: Schedule) -> None:
        self.sched = sched
        self.succ: dict[Action, list[Action]] | None = None
        self.place: dict[Action, int] = {}

    def __call__(self, a: Action, b: Action) -> bool:
        if self.succ is None:
            self.succ = {}
            for e in self.sched.edges:
                self.succ.setdefault(e.src, []).append(e.dst)
            lists = [[x for x in lst if x.stream == "compute"] for lst in self.sched.actions]
            for lst in (*lists, self.sched.host, self.sched.network):
                for x, y in itertools.pairwise(lst):
                    self.succ.setdefault(x, []).append(y)
            self.place = self.sched.dry_run().steps
        limit = self.place.get(b)
        if limit is None:
            return False
        seen, todo = {a}, [a]
        while todo:
            for n in self.succ.get(todo.pop(), ()):
                if n == b:
                    return True
                if n not in seen and self.place.get(n, limit) < limit:
                    seen.add(n)
                    todo.append(n)
        return False


def _reuse_not_periodic(sched: Schedule, reuse: set[tuple[Action, Action]]) -> str | None:
    """Where the ``reuse`` edges into a repeated step differ from those into its copy one
    cycle on (None: nowhere)."""
    from rpcompile.passes.staging import step_key

    if not sched.repeat_until:
        return None
    period = sched.run_steps - sched.repeat_from
    keys = {(step_key(f), step_key(y)) for f, y in reuse}
    for f, y in reuse:
        if sched.repeat_from <= y.step < sched.run_steps and y.step + period < sched.steps:
            d = period
        elif y.step >= sched.run_steps:
            d = -period
        else:
            continue
        if (step_key(f, f.step + d), step_key(y, y.step + d)) not in keys:
            return (f"the reuse edge {f} -> {y} has no copy one cycle "
                    f"{'on' if d > 0 else 'back'} (steps {f.step + d} -> {y.step + d}): a "
                    f"run repeats steps {sched.repeat_from}..{sched.run_steps - 1}")
    return None


# ---------------------------------------------------------------------------------------------
# Host memory
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostMemory:
    """Host bytes a RoundPipe plan keeps (the same accounting as the simulator's host peak),
    laid out as the runtime's host store lays them (rpcompile.runtime.memory.HostStore: every
    parameter once, however many stages read it): fp32 ``masters`` of trainable parameters,
    ``optimizer`` state (AdamW: two fp32 moments), one fp32 ``gradients`` accumulator per
    trainable parameter (async: two, the accumulator and the previous step's pending
    gradients, ``HostStore.add_pending``), the low-precision ``shadows`` the uploads read (one
    copy of every parameter, frozen or trainable, that the forward and the backward stage
    holding it share; async, a second copy of the trainable ones, which the next step reads
    while this step's uploads read the first, ``HostStore.add_shadow_pair``), ``transfers``:
    the host staging of activations, recompute inputs and downloaded gradients, the sum of
    the schedule's staging slots (``Schedule.staging_bytes``, :func:`staging_problem`; 0 when
    not given), ``model``: what the user's module still holds of its
    own, its trainable parameters in the compute dtype (its frozen ones are views of their
    shadows, ``HostStore.build(share_frozen=True)``; ``sync_to_model`` writes the trained
    masters into the trainable ones), and the step's undo ``journal``
    (rpcompile.runtime.optim, ``rollback=True``; ``PlanOptions.undo_journal``, on by
    default): before an ``OPT`` the driver copies the masters and optimizer state it
    changes, and (sync) before a ``SHADOW`` the trainable shadows it overwrites, and keeps
    every copy until the step commits, so at a step's end it holds one more copy of them for
    every trainable parameter (0 with the journal off). An async SHADOW writes the copy no
    committed step reads, which a failed step's retry writes again: nothing to save.

    Pinned (:attr:`pinned`), as a CUDA run allocates it: the host store's flat buffers
    (shadows, masters, gradients and the pending gradients) and the transfer staging (the
    executor's pool, rpcompile.runtime.memory.HostStaging: one buffer per staging slot), all
    of exact size and registered with the driver (never rounded up, as
    torch's caching pinned allocator would). Not pinned: the
    optimizer's state (torch's own tensors), the module and the journal. ``pageable`` (``PlanOptions.host_memory="pageable"``): the run pins nothing,
    neither the store nor the staging (rpcompile.runtime.memory.pin_host_memory), so
    :attr:`pinned` is 0; every other figure is the same, since the registered buffers are
    exact size either way. The transfers are timed at the bandwidth of the memory assumed
    (``Hardware.link_h2d_gbps`` / ``link_d2h_gbps``)."""

    masters: int
    optimizer: int
    gradients: int
    shadows: int
    transfers: int = 0
    model: int = 0
    journal: int = 0
    pageable: bool = False

    @property
    def total(self) -> int:
        return (self.masters + self.optimizer + self.gradients + self.shadows + self.transfers
                + self.model + self.journal)

    @property
    def pinned(self) -> int:
        """The page-locked part: the host store's buffers and the transfer staging (0 from
        pageable host memory, which pins nothing)."""
        if self.pageable:
            return 0
        return self.shadows + self.masters + self.gradients + self.transfers

    def sharded(self, ranks: int) -> HostMemory:
        """The figure of one rank of ``ranks`` sharding masters and optimizer state
        (``shard_optimizer``, rpcompile.runtime.distributed): masters, optimizer state and
        the journal's copies of them at 1/N (rounded up; the shards split at parameter
        boundaries, so a rank's share is about that), gradients, shadows, the module and
        the journal's copy of the shadows whole."""
        if ranks <= 1:
            return self

        def part(n: int) -> int:
            return -(-n // ranks)

        shadows_saved = self.journal - self.masters - self.optimizer if self.journal else 0
        masters, state = part(self.masters), part(self.optimizer)
        return replace(self, masters=masters, optimizer=state,
                       journal=masters + state + shadows_saved if self.journal else 0)

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} (masters {format_bytes(self.masters)}, optimizer "
                f"{format_bytes(self.optimizer)}, gradients {format_bytes(self.gradients)}, "
                f"shadows {format_bytes(self.shadows)}, model {format_bytes(self.model)}, "
                f"undo journal {format_bytes(self.journal)}, transfer staging "
                f"{format_bytes(self.transfers)}; "
                + ("pageable, nothing pinned)" if self.pageable else
                   f"pinned {format_bytes(self.pinned)})"))


def host_memory(plan: Plan, optimizer: str = "async", peak_host_bytes: int | None = None,
                optimizer_bytes_per_param: int = 8, journal: bool = True,
                pageable: bool = False) -> HostMemory:
    """The host memory of ``plan`` (``optimizer``: ``"sync"``, or ``"async"``, which keeps a
    second fp32 gradient buffer). ``peak_host_bytes``: a simulated run's
    ``SimResult.peak_host_bytes``, whose part above the static buffers is the transfer
    staging (simulated with the same ``journal`` setting: ``Hardware.undo_journal``).
    ``journal``: whether the optimizer driver keeps its undo journal
    (``PlanOptions.undo_journal``); without it the figure is less by exactly
    :attr:`HostMemory.journal`. ``pageable``: the run's host memory is pageable
    (``Hardware.host_memory``), so nothing of it is pinned (:attr:`HostMemory.pinned`)."""
    out = _static_host(plan.stages, plan.units, optimizer, optimizer_bytes_per_param, journal)
    out = replace(out, pageable=bool(pageable))
    if peak_host_bytes is not None:
        out = replace(out, transfers=max(0, peak_host_bytes - out.total))
    return out


def host_static_bytes(stages: Sequence[Stage], units: Sequence, optimizer: str,
                      optimizer_bytes_per_param: int = 8, journal: bool = True) -> int:
    """The host bytes of a RoundPipe run that do not change during a step (the simulator's
    base for its host peak): :class:`HostMemory` without ``transfers`` (the user's module's
    own ``model`` part included; the undo journal's unless ``journal`` is off)."""
    return _static_host(stages, units, optimizer, optimizer_bytes_per_param, journal).total


class HostMemoryError(RPCompileError, ValueError):
    """A run's host state exceeds the host's RAM (refused before the host store is built)."""


class HostMemoryWarning(RuntimeWarning):
    """A plan's host state exceeds the RAM stated or found for its target (compile() warns:
    it allocates nothing, and the plan may be for another server)."""


def host_ram_problem(host: HostMemory, ram: int, source: str, *,
                     ram_option: str = "host_ram_bytes",
                     journal_option: str = "undo_journal=False", parts: bool = True
                     ) -> str | None:
    """The one check of host memory against RAM (``compile()``, the Trainer, ``rpcompile
    plan``): ``None`` when ``host.total`` fits ``ram`` (or ``ram`` is 0, unknown), else what
    is over, by how much, where the RAM figure came from (``source``; ``ram_option`` when it
    was stated) and what would fit: LoRA or fewer trainable parameters, the undo journal off
    (``journal_option``, when the figure holds one), a server with more RAM, or stating the
    target's RAM with ``ram_option`` when the figure was not stated. ``parts``: the figure's
    parts too (:meth:`HostMemory.describe`)."""
    if ram <= 0 or host.total <= ram:
        return None
    per_param = host.masters + host.optimizer + host.gradients + host.journal
    fixes = [f"LoRA or fewer trainable parameters (masters, optimizer state, gradients and "
             f"the undo journal are per trainable parameter: {format_bytes(per_param)} here)"]
    if host.journal:
        fixes.append(f"the undo journal off ({journal_option}: {format_bytes(host.journal)} "
                     f"less, but a failed optimizer step then means restoring the last "
                     f"checkpoint)")
    fixes.append("a server with more RAM")
    if source != ram_option:
        fixes.append(f"if the target server's RAM differs from this figure ({source}), state "
                     f"it with {ram_option}")
    what = f": {host.describe()}" if parts else ""
    return (f"the plan needs {format_bytes(host.total)} of host memory, more than the "
            f"{format_bytes(ram)} of RAM ({source}){what}. To fit: " + "; ".join(fixes))


def _static_host(stages, units, optimizer, optimizer_bytes_per_param,
                 journal: bool = True) -> HostMemory:
    trainable = sum(u.trainable_params for u in units)
    shadows = trainable_shadows = packed = 0
    # The forward stages and the tail hold every unit once; a parameter a stage borrows
    # (tied weights) lives in its owner's stage. Frozen quantized weights are held packed
    # (UnitProfile.packed_bytes); the rest of a stage's weight bytes are in the compute dtype.
    for s in stages:
        if s.kind == "backward":
            continue
        stage_packed = sum(units[u].packed_bytes for u in s.units)
        packed += stage_packed
        own = sum(units[u].params - units[u].packed_params for u in s.units)
        outside = {(o, n) for u in s.units for o, n, _t in units[u].borrowed if o not in s.units}
        held = own + sum(n for _o, n in outside)
        if held:
            dense = s.weight_bytes - stage_packed
            shadows += dense * own // held
            trainable_shadows += dense * sum(
                units[u].trainable_params for u in s.units) // held
    buffers = 2 if optimizer == "async" else 1  # async: the pending gradients too
    # The module keeps its trainable parameters in the compute dtype, the shadows' (every
    # parameter once).
    params = sum(u.params - u.packed_params for u in units)
    model = trainable * shadows // params if params else 0
    shadows += packed
    masters, state = 4 * trainable, optimizer_bytes_per_param * trainable
    paired = optimizer == "async"  # async: two copies of the trainable shadows, no journal
    return HostMemory(masters=masters, optimizer=state, gradients=4 * buffers * trainable,
                      shadows=shadows + (trainable_shadows if paired else 0), model=model,
                      journal=masters + state + (0 if paired else trainable_shadows)
                      if journal else 0)

"""Lowering: from the compute-only schedule to one every interpreter can run as is.

Each pass takes a Schedule and returns a new one, adds one concern, stamps its name into
``Schedule.passes`` and touches no device. In the order :func:`lower` runs them:

  1. upload     - UP of a job's weights (prefetched while the previous job runs, two weight
                  slots per worker) and EVICT after the job's last compute
  2. transfers  - activations through host memory: D2H by the producer, H2D by the consumer;
                  nothing when both run on the same worker (the value stays on the device)
  3. grads      - per job, one D2H of the fp32 gradients accumulated on the worker over the
                  job's microbatches; host ACC across rounds
  4. optimizer  - host OPT per backward stage once its last round is accumulated, SHADOW
                  rewrites of every stage sharing those parameters, and the waits that make
                  uploads read the right weights (sync: this step's; async: one step stale)
  4b. reduce    - data parallel over more than one rank only: a REDUCE on the host's network
                  lane after each stage's last ACC of the step, and the step's updates after
                  all of them
  4c. commit    - edges from each step's last actions to its last host action, where the
                  step commits; nothing else orders one step after another, so step k+1's
                  jobs start as soon as what they read is ready (steps overlap)
  4d. barrier   - data parallel over more than one rank only: step k+1's first actions wait
                  for step k's commit point (a rank's collectives are per step, so it runs
                  one step at a time)
  5. events     - drop edges already implied by stream order or by another edge, so that what
                  remains is the set of events a runtime records and waits on

docs/schedule.md describes the action kinds and edges each pass adds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.ir import (  # the default and the tightest memory waits are the plan's data
    BOUNDED_WAITS,
    ORDERED_STREAMS,
    TIGHTEST_WAITS,
    Action,
    Edge,
    Plan,
    Schedule,
    Stage,
)
from rpcompile.options import (  # the one chunk size; the sync update orders and their rules
    DEFAULT_CHUNK_BYTES,
    UPDATE_ORDERS,
    PlanOptions,
    check_option,
    check_update_order,
)
from rpcompile.passes.invariants import check_dispatch
from rpcompile.passes.manager import PassManager, PassRecord, debug_checks, run_pass
from rpcompile.passes.memory import WorkerPeak, worker_peaks
from rpcompile.passes.schedule import build_schedule, runtime_cycle
from rpcompile.passes.validate import validate as check

__all__ = [
    "BOUNDED_WAITS",
    "DATA_PARALLEL_PASSES",
    "DEFAULT_CHUNK_BYTES",
    "LOWERING_PASSES",
    "MEMORY_WAITS",
    "TIGHTEST_WAITS",
    "UPDATE_ORDERS",
    "add_activation_transfers",
    "add_commit",
    "add_events",
    "add_gradient_downloads",
    "add_optimizer",
    "add_reductions",
    "add_step_barrier",
    "add_weight_uploads",
    "grad_slots",
    "gradient_groups",
    "lower",
    "opt_bytes",
    "runtime_peaks",
    "runtime_schedule",
    "trainable_parameters",
    "updates_deferred",
]

LOWERING_PASSES = ("upload", "transfers", "grads", "optimizer", "commit", "events")
# Data parallel over more than one rank adds the cross-rank reduction (pass 4b).
DATA_PARALLEL_PASSES = ("upload", "transfers", "grads", "optimizer", "reduce", "commit",
                        "barrier", "events")
GRAD_BYTES = 4  # the host's gradients are fp32 (what ACC sums and REDUCE moves)
# The waits that bound what a worker holds in flight (rpcompile.passes.memory): "window" and
# "sent" (pass 2), and a gradient-slot wait (pass 3): "grad_pair" (two gradient buffers per
# worker: a job's download has the whole next job to hide behind) or "grad_slot" (one: less
# memory, but a job's first compute waits for the previous job's download). A plan lists the
# ones its lowering adds (Plan.memory_waits); a bare stage list gets BOUNDED_WAITS.
MEMORY_WAITS = ("window", "sent", "grad_pair", "grad_slot")

_BASELINE_PASSES = ("transfers", "events")  # weights and optimizer stay on the bound workers


@dataclass(frozen=True)
class _Job:
    worker: int
    stage: int
    round: int | None
    step: int
    computes: tuple[Action, ...]


def _jobs(sched: Schedule, worker: int) -> list[_Job]:
    """The worker's jobs in order: maximal runs of compute actions of one (stage, round, step)."""
    jobs: list[_Job] = []
    current: list[Action] = []
    for a in sched.actions[worker]:
        if not a.is_compute:
            continue
        if current and (a.stage, a.round, a.step) != (current[0].stage, current[0].round,
                                                       current[0].step):
            jobs.append(_Job(worker, current[0].stage, current[0].round, current[0].step,
                             tuple(current)))
            current = []
        current.append(a)
    if current:
        jobs.append(_Job(worker, current[0].stage, current[0].round, current[0].step,
                         tuple(current)))
    return jobs


def _splice(sched: Schedule, before: dict[Action, list[Action]],
            after: dict[Action, list[Action]], front: dict[int, list[Action]] | None = None,
            ) -> tuple[tuple[Action, ...], ...]:
    """Worker lists with new actions inserted before / after existing ones."""
    out = []
    for w, lst in enumerate(sched.actions):
        new = list((front or {}).get(w, ()))
        for a in lst:
            new.extend(before.get(a, ()))
            new.append(a)
            new.extend(after.get(a, ()))
        out.append(tuple(new))
    return tuple(out)


def _chunks(nbytes: int, chunk_bytes: int) -> int:
    return max(1, math.ceil(nbytes / chunk_bytes))


def _stages(plan: Plan | Sequence[Stage]) -> tuple[Stage, ...]:
    return tuple(plan.stages if isinstance(plan, Plan) else plan)


def _once(sched: Schedule, name: str) -> None:
    if name in sched.passes:
        raise InvalidInput(f"pass {name!r} already ran on this schedule (passes: {sched.passes})")


def _require_roundpipe(sched: Schedule, name: str) -> None:
    _once(sched, name)
    if sched.stage_workers is not None:
        raise InvalidInput(f"pass {name!r} applies to RoundPipe schedules; in the {sched.kind} "
                         "baseline weights, gradients and optimizer stay on the bound workers")


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


# --------------------------------------------------------------------------------------------
# 4. optimizer
# --------------------------------------------------------------------------------------------


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]




def add_optimizer(sched: Schedule, plan: Plan | Sequence[Stage],
                  updates: str = "overlap") -> Schedule:
    """OPT per stage with gradients, SHADOW per stage whose parameters change, and their edges.

    SHADOW(x, k) rewrites stage x's part of the host's low-precision shadow (what UP reads)
    from the masters; a forward stage shares parameters with the backward stages overlapping
    its units. The shadow holds every parameter once (stages sharing a parameter, a tied
    weight included, read the same copy); async mode keeps two copies of the trainable ones
    (below). UP(x, k) waits (``shadow``) for SHADOW(x, k-1). OPT(s, k) runs the update of
    every parameter whose gradient stages' OPTs of step k have then all run. The two modes:

    - ``sync``: OPT(s, k) applies step k's gradients and follows the last round's ACC of s
      (``accumulated``); SHADOW(x, k) once every OPT over parameters x holds is done
      (``updated``): step k+1 computes with the masters step k's update wrote. SHADOW(x, k)
      waits for step k's uploads of x (``shadow_read``). ``updates`` is when a step's updates
      run: ``overlap`` (default) puts OPT(s, k) right after the last round's ACC of s, so it
      runs while later backward jobs compute (the runtime saves what each update changes and
      puts it back if the step fails); ``deferred`` puts every OPT and SHADOW of step k after
      step k's last ACC, so no update reads a gradient before the whole step's gradients are
      home (needed by clipping, loss scaling, skipping non-finite steps and data parallel).
    - ``async`` (:func:`_add_async_optimizer`): OPT(s, k) applies step k-1's gradients,
      which the host holds pending since step k-1 committed, at the start of step k's host
      queue, and SHADOW(x, k) writes the second copy of the shadow, which step k+1 reads
      while step k's own uploads read the first; step k's gradients are applied in step k+1.
      ``updates`` must be ``overlap`` (the default): the pending gradients are complete
      before the step starts, so there is no order to choose.
    """
    _require_roundpipe(sched, "optimizer")
    check_option("updates", updates)
    stages = _stages(plan)
    grad_stages = sorted({a.stage for a in sched.host if a.kind == "ACC"})
    covering = {x: [y for y in grad_stages if _overlaps(sched.stage_units[x],
                                                        sched.stage_units[y])]
                for x in range(len(sched.stage_units))}
    if sched.optimizer == "async":
        check_update_order("async", updates, ())  # async has one order: overlap
        return _add_async_optimizer(sched, plan, stages, covering)
    host: list[Action] = []
    edges = list(sched.edges)
    accs: dict[tuple[int, int], list[Action]] = {}
    for a in sched.host:
        if a.kind == "ACC":
            accs.setdefault((a.stage, a.step), []).append(a)
    opts: dict[tuple[int, int], Action] = {}  # (stage, step) -> its OPT, once placed
    shadows: dict[tuple[int, int], Action] = {}
    order: dict[int, list[int]] = {}  # step -> its OPTs' stages, in queue order
    for a in sched.host:
        if a.kind == "ACC" and a.round == sched.rounds - 1:
            order.setdefault(a.step, []).append(a.stage)
    updated = {k: opt_bytes(plan, stages_k) for k, stages_k in order.items()}
    for a in sched.host:
        host.append(a)
        if a.kind != "ACC" or a.round != sched.rounds - 1:
            continue
        s, k = a.stage, a.step
        opt = Action(None, "OPT", s, None, None, k, bytes=updated[k][s])
        host.append(opt)
        opts[(s, k)] = opt
        edges += [Edge(acc, opt, "accumulated") for acc in accs[(s, k)]]
        for x, ys in covering.items():
            if s in ys and all((y, k) in opts for y in ys):
                sh = Action(None, "SHADOW", x, None, None, k, bytes=stages[x].trainable_weight_bytes)
                host.append(sh)
                shadows[(x, k)] = sh
                edges += [Edge(opts[(y, k)], sh, "updated") for y in ys]
    if updates == "deferred":
        host = _deferred(host)
    host = _with_checks(host, plan, grad_stages)
    # A tied parameter (an LM head borrowing the embedding) is one slot of the shadow, which
    # the SHADOW of each stage holding it rewrites, the first of them possibly before the
    # update that reads the other stage's gradients: an upload of the next step waits for
    # every SHADOW of the step before that writes what it reads, not only its own stage's.
    sharing = _sharing(sched, plan)
    tied = {x: sorted(z for z in sharing[x] if z != x and not _overlaps(
        sched.stage_units[x], sched.stage_units[z])) for x in sharing}
    for lst in sched.actions:
        for up in lst:
            if up.kind != "UP":
                continue
            for z in (up.stage, *tied[up.stage]):
                src = shadows.get((z, up.step - 1))
                if src is not None:
                    edges.append(Edge(src, up, "shadow"))
            war = shadows.get((up.stage, up.step))
            if war is not None:
                edges.append(Edge(up, war, "shadow_read"))
    return sched.replace(host=tuple(host), edges=tuple(edges),
                         passes=(*sched.passes, "optimizer"))


def opt_bytes(plan: Plan | Sequence[Stage], order: Sequence[int]) -> dict[int, int]:
    """The fp32 gradient bytes of the parameters each OPT of a step updates, the step's OPTs
    in ``order`` (gradient stages, queue order): a parameter is updated at the OPT of the
    last of its gradient stages (:func:`gradient_groups`), as the runtime's driver applies a
    group (rpcompile.runtime.optim), so a parameter two stages share (a tied embedding and
    LM head) is one update, charged to one OPT. What the simulator times an OPT by (its
    update and the undo journal's copy): each stage's gradient bytes, less those of the
    parameters it shares with a gradient stage whose OPT comes later. A bare stage list (no
    units to say what stages share): each stage's own gradient bytes."""
    stages = _stages(plan)
    out = {s: stages[s].grad_bytes for s in order}
    if not isinstance(plan, Plan):
        return out
    for group, nbytes in gradient_groups(plan).items():
        members = [s for s in order if s in group]
        for s in members[:-1]:  # updated at the last one's OPT
            out[s] -= nbytes
            if out[s] < 0:
                raise InvalidInput(
                    f"stage {s}: its gradient bytes ({stages[s].grad_bytes}) are fewer than "
                    f"those of the parameters it shares with stages {sorted(group)}; the "
                    "plan's stage figures and its units disagree")
    return out


def _sharing(sched: Schedule, plan: Plan | Sequence[Stage]) -> dict[int, set[int]]:
    """Stage -> the stages whose uploads read some of its parameters' shadow (itself
    included): overlapping units, and with a Plan also a unit that borrows another's
    parameter (a tied embedding and LM head)."""
    units = [set(range(u0, u1 + 1)) for u0, u1 in sched.stage_units]
    if isinstance(plan, Plan):
        for held in units:
            held |= {o for v in list(held) for o, _, _ in plan.units[v].borrowed}
    return {x: {z for z, other in enumerate(units) if held & other}
            for x, held in enumerate(units)}


def _add_async_optimizer(sched: Schedule, plan: Plan | Sequence[Stage],
                         stages: tuple[Stage, ...],
                         covering: dict[int, list[int]]) -> Schedule:
    """Async updates, shifted into the next step: ``w_{k+1} = U(w_k, g_k(w_{k-1}))``.

    Step k's host queue starts with OPT(s, k) of every gradient stage s, each applying step
    k-1's gradients of s, pending on the host since step k-1 committed (complete, checked,
    clipped, unscaled and reduced by then; nothing in step 0), then the step's ACCs and its
    CHECK. Each SHADOW(x, k) follows the last OPT it waits for (``updated``: the OPTs over
    x's parameters, a borrowed, tied one included), and the OPTs come in the order the next
    step uploads the stages whose shadows they complete (F1 first): the shadow a job of step
    k+1 waits for (``shadow``) is written as early as the host can.

    The host keeps two copies of each trainable parameter's shadow (rpcompile.runtime.memory
    .HostStore.add_shadow_pair): step k's uploads read copy ``k % 2``, SHADOW(x, k) writes
    copy ``(k + 1) % 2``, which step k-1's uploads read (``shadow_read``: every UP of step k-1
    of a stage sharing a parameter with x). So step k+1's forward jobs upload while step k's
    backward jobs still read the copy they need: the steps overlap, one step stale, and no
    SHADOW waits for an upload of its own step."""
    sharing = _sharing(sched, plan)
    grad_stages = sorted({a.stage for a in sched.host if a.kind == "ACC"})
    last = sched.rounds - 1
    edges = list(sched.edges)
    by_step: dict[int, list[Action]] = {}
    for a in sched.host:
        by_step.setdefault(a.step, []).append(a)
    ups: dict[tuple[int, int], list[Action]] = {}
    for lst in sched.actions:
        for up in lst:
            if up.kind == "UP":
                ups.setdefault((up.stage, up.step), []).append(up)
    # The OPTs a stage's SHADOW waits for: those over its own units, and over the units of
    # every stage it shares a parameter with (a tied embedding is in F1's and the tail's).
    rewriters = {x: sorted({y for z in sharing[x] for y in covering[z]} | set(ys))
                 for x, ys in covering.items() if ys}
    host: list[Action] = []
    shadows: dict[tuple[int, int], Action] = {}
    for k in sorted(by_step):
        accs = by_step[k]
        homes = [a.stage for a in accs if a.round == last]
        order: list[int] = []
        for x in sorted(rewriters):  # stages in upload order: F1, F2, ..., B1, B2, ...
            order += [y for y in rewriters[x] if y in homes and y not in order]
        order += [y for y in homes if y not in order]
        updated = opt_bytes(plan, order)
        done: set[int] = set()
        placed: set[int] = set()
        for s in order:
            host.append(Action(None, "OPT", s, None, None, k, bytes=updated[s]))
            done.add(s)
            for x, ys in rewriters.items():
                if x in placed or not set(ys) & set(homes) <= done:
                    continue
                placed.add(x)
                sh = Action(None, "SHADOW", x, None, None, k,
                            bytes=stages[x].trainable_weight_bytes)
                host.append(sh)
                shadows[(x, k)] = sh
                edges += [Edge(Action(None, "OPT", y, None, None, k, bytes=updated[y]), sh,
                               "updated") for y in ys if y in homes]
                edges += [Edge(up, sh, "shadow_read")
                          for z in sorted(sharing[x]) for up in ups.get((z, k - 1), ())]
        first_acc: dict[int, Action] = {}
        for a in accs:
            first_acc.setdefault(a.stage, a)
        edges += [Edge(Action(None, "OPT", s, None, None, k, bytes=updated[s]), first_acc[s],
                       "pending") for s in order]
        host += accs
    host = _with_checks(host, plan, grad_stages)
    for lst in sched.actions:
        for up in lst:
            if up.kind == "UP":
                src = shadows.get((up.stage, up.step - 1))
                if src is not None:
                    edges.append(Edge(src, up, "shadow"))
    return sched.replace(host=tuple(host), edges=tuple(edges),
                         passes=(*sched.passes, "optimizer"))


def _with_checks(host: Sequence[Action], plan: Plan | Sequence[Stage],
                 grad_stages: Sequence[int]) -> list[Action]:
    """The host queue with each step's CHECK right after that step's last ACC: once every
    gradient of the step is home, and before the first update that reads them (sync
    ``deferred``; async, step k+1's OPTs, which follow it in the host queue). What the runtime's CHECK
    does (rpcompile.runtime.executor): the step's loss, its non-finite jobs and the decision
    to skip it, then unscaling and clipping in place over the fp32 gradients; its ``bytes``
    are that traffic, ``Plan.grad_check_passes`` passes over every trainable parameter's
    gradient (each once, :func:`opt_bytes`), which the simulator times at the host's memory
    bandwidth. A bare stage list (no options): no passes. The action's stage is the step's
    last gradient stage (the ACC it follows)."""
    passes = plan.grad_check_passes if isinstance(plan, Plan) else 0
    nbytes = passes * sum(opt_bytes(plan, grad_stages).values()) if passes else 0
    last = {a.step: i for i, a in enumerate(host) if a.kind == "ACC"}
    out: list[Action] = []
    for i, a in enumerate(host):
        out.append(a)
        if last.get(a.step) == i:
            out.append(Action(None, "CHECK", a.stage, None, None, a.step, bytes=nbytes))
    return out


def _deferred(host: Sequence[Action]) -> list[Action]:
    """The host queue with each step's OPT and SHADOW after that step's last ACC."""
    by_step: dict[int, tuple[list[Action], list[Action]]] = {}
    for a in host:
        by_step.setdefault(a.step, ([], []))[a.kind != "ACC"].append(a)
    return [a for k in sorted(by_step) for part in by_step[k] for a in part]


def updates_deferred(sched: Schedule) -> bool:
    """Whether every OPT of each step comes after that step's last ACC in the host queue
    (``add_optimizer(updates="deferred")``): then no update reads a gradient before all of
    the step's gradients are home."""
    last_acc: dict[int, int] = {}
    first_opt: dict[int, int] = {}
    for i, a in enumerate(sched.host):
        if a.kind == "ACC":
            last_acc[a.step] = i
        elif a.kind == "OPT":
            first_opt.setdefault(a.step, i)
    return all(first_opt[k] > last_acc.get(k, -1) for k in first_opt)


# --------------------------------------------------------------------------------------------
# 4b. reduce
# --------------------------------------------------------------------------------------------


def trainable_parameters(plan: Plan) -> dict[tuple, tuple[int, frozenset[int]]]:
    """Each trainable parameter of the plan once, by key: ``("lent", unit, elements)`` for
    trainable elements other units borrow from ``unit`` (a tied embedding), ``("own", unit)``
    for the rest of a unit's trainable elements; each with its element count and the set of
    backward stages whose gradients sum into it (the stage holding the unit, plus every
    stage of a borrowing unit). Lent keys first, in the order they are borrowed, then own
    keys in unit order."""
    owner: dict[int, int] = {}  # unit -> the gradient stage holding it
    for st in plan.stages:
        if st.kind != "forward":
            for u in st.units:
                owner[u] = st.index
    lent: dict[tuple, set[int]] = {}
    shared: dict[int, int] = {}  # unit -> its trainable elements lent to other units
    for v, unit in enumerate(plan.units):
        for o, numel, trainable in unit.borrowed:
            if trainable:
                key = ("lent", o, numel)
                if key not in lent:
                    shared[o] = shared.get(o, 0) + numel
                lent.setdefault(key, {owner[o]}).add(owner[v])
    params = {key: (key[2], frozenset(stages)) for key, stages in lent.items()}
    for u, unit in enumerate(plan.units):
        own = unit.trainable_params - shared.get(u, 0)
        if own < 0:
            raise InvalidInput(f"unit {unit.name} lends more trainable elements than it has")
        if own:
            params[("own", u)] = (own, frozenset({owner[u]}))
    return params


def gradient_groups(plan: Plan) -> dict[frozenset[int], int]:
    """The plan's fp32 gradient bytes by the set of backward stages whose gradients they sum:
    each parameter once (:func:`trainable_parameters`), in the group of every gradient stage
    that holds it (a tied embedding and LM head: the tail and the first backward stage). A
    parameter is reduced across ranks once all of its group's stages are home, as the
    runtime's ``DataParallel.stage_done`` does."""
    groups: dict[frozenset[int], int] = {}
    for numel, stages in trainable_parameters(plan).values():
        groups[stages] = groups.get(stages, 0) + GRAD_BYTES * numel
    return groups


def add_reductions(sched: Schedule, plan: Plan, ranks: int) -> Schedule:
    """Data parallel over ``ranks`` processes: each rank runs this schedule on its share of
    the batch, and the ranks' host gradients are summed before any update reads them.

    One REDUCE per gradient stage and step on the host's network lane, right after (edge
    ``reduce_ready``) the ACC that brings the stage's gradients of the step home for the last
    time (its last round), in that ACC's order, so every rank issues the same collectives in
    the same order. Its bytes are the fp32 gradients it reduces: those of every parameter
    whose gradient stages (:func:`gradient_groups`) are now all home. The step's updates
    then follow every REDUCE: in sync mode the step's first OPT (where the gradient check
    reads every gradient) waits for each (edge ``reduced``), and the schedule must already be
    deferred; in async mode step k's OPTs apply step k-1's gradients, reduced before step k
    starts (step k-1's CHECK waits for every REDUCE of step k-1, and step k's OPTs follow
    that CHECK in the host queue).
    In both modes the step's CHECK (the gradient check, which agrees the loss across ranks
    and clips by the global norm) waits for every REDUCE of its step (``reduced``)."""
    _require_roundpipe(sched, "reduce")
    if "optimizer" not in sched.passes:
        raise InvalidInput("pass 'reduce' needs the optimizer pass first (its OPT actions read "
                         "the reduced gradients)")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise InvalidInput(f"pass 'reduce' is for data parallel over 2 or more ranks, got "
                         f"ranks={ranks!r}")
    if not isinstance(plan, Plan):
        raise InvalidInput("pass 'reduce' needs the Plan (its units say which parameters "
                         "stages share), not a bare stage list")
    if sched.optimizer == "sync" and not updates_deferred(sched):
        raise InvalidInput("data parallel needs the sync updates deferred (an update reads the "
                         "gradients summed over every rank): lower with updates='deferred'")
    groups = gradient_groups(plan)
    host = list(sched.host)
    first_opt: dict[int, Action] = {}
    if sched.optimizer == "sync":  # async: step k's OPTs read step k-1's reduced gradients
        for a in host:
            if a.kind == "OPT":
                first_opt.setdefault(a.step, a)
    checks = {a.step: a for a in host if a.kind == "CHECK"}
    edges = list(sched.edges)
    network: list[Action] = []
    done: dict[int, set[int]] = {}
    pending: dict[int, dict[frozenset[int], int]] = {}
    for a in host:
        if a.kind != "ACC" or a.round != sched.rounds - 1:
            continue
        k = a.step
        mine = done.setdefault(k, set())
        left = pending.setdefault(k, dict(groups))
        mine.add(a.stage)
        ready = [g for g in left if g <= mine]
        red = Action(None, "REDUCE", a.stage, None, None, k,
                     bytes=sum(left.pop(g) for g in ready))
        network.append(red)
        edges.append(Edge(a, red, "reduce_ready"))
        if k in first_opt:
            edges.append(Edge(red, first_opt[k], "reduced"))
        if k in checks:  # the check agrees the loss and clips over the reduced gradients
            edges.append(Edge(red, checks[k], "reduced"))
    for k, left in pending.items():
        if left:
            raise InvalidInput(f"step {k}: the gradients of stages {sorted(map(sorted, left))} "
                             "are never all home, so they would never be reduced")
    return sched.replace(host=tuple(host), network=tuple(network), edges=tuple(edges),
                         ranks=ranks, passes=(*sched.passes, "reduce"))


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

    Nothing else orders one step after another: step k+1's jobs wait only for what they read
    (the shadow of their stage, sync mode's from step k's update) and for the memory bounds
    of their worker (``buffer``, ``grad_pair``, ``window``, ``sent``, which run across steps),
    so step k+1's forward jobs run while step k's backward jobs drain. Step k+1's host
    actions follow step k's commit point in the host queue: the host has at most one step
    open, and a step commits before the next one's first update."""
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
    has_pred = {e.dst for e in sched.edges if e.src.step == e.dst.step}
    starts: dict[int, list[Action]] = {}
    for (_w, stream), lst in sched.queues().items():
        if stream == "host":
            continue  # the host queue is ordered: step k+1's follow the commit point
        seen: set[int] = set()
        for a in lst:
            if stream in ORDERED_STREAMS:
                if a.step not in seen:
                    seen.add(a.step)
                    starts.setdefault(a.step, []).append(a)
            elif a not in has_pred:
                starts.setdefault(a.step, []).append(a)
    # A worker's last EVICT of step k waits (landed) for its first UP of step k+1, which now
    # waits for the commit point, which waits for that EVICT: the two weight sets never
    # overlap across the barrier, so the edge goes.
    edges = [e for e in sched.edges if not (e.kind == "landed" and e.src.step != e.dst.step)]
    for k, hub in sorted(hubs.items()):
        edges += [Edge(hub, b, "barrier") for b in starts.get(k + 1, ())]
    return sched.replace(edges=tuple(edges), passes=(*sched.passes, "barrier"))


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
    groups: dict[tuple, list[tuple[int, int, Edge]]] = {}
    kept: list[Edge] = []
    for e in sched.edges:
        if e.kind == "landed" and e.src.step != e.dst.step:
            # Kept, and no reason to drop another edge: a run whose last step it points
            # from has no such wait (nothing comes after it in the schedule), so what it
            # implies must stand on its own edges.
            kept.append(e)
            continue
        (qs, i), (qd, j) = pos[e.src], pos[e.dst]
        if qs == qd and i < j and qs[1] in ORDERED_STREAMS:
            continue
        # On a lane an edge stands for its own action only: key the group by that action.
        src_key = qs if qs[1] in ORDERED_STREAMS else e.src
        dst_key = qd if qd[1] in ORDERED_STREAMS else e.dst
        groups.setdefault((src_key, dst_key), []).append((j, -i, e))
    for items in groups.values():
        items.sort(key=lambda t: (t[0], t[1]))
        best = -1  # latest source index among edges ending no later than this one
        for _, neg_i, e in items:
            if -neg_i > best:
                kept.append(e)
                best = -neg_i
    order = {e: n for n, e in enumerate(sched.edges)}
    kept.sort(key=order.__getitem__)
    return sched.replace(edges=tuple(kept), passes=(*sched.passes, "events"))


# --------------------------------------------------------------------------------------------
# lower
# --------------------------------------------------------------------------------------------


def lower(schedule: Schedule, plan: Plan | Sequence[Stage], *,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES, passes: Sequence[str] | None = None,
          validate: bool = True, updates: str | None = None, ranks: int = 1,
          ) -> tuple[Schedule, tuple[PassRecord[Schedule], ...]]:
    """Run the lowering passes (default: all of :data:`LOWERING_PASSES` for RoundPipe, or of
    :data:`DATA_PARALLEL_PASSES` when ``ranks`` > 1; only ``transfers`` and ``events`` for the
    weight-bound baselines) through a :class:`~rpcompile.passes.manager.PassManager`, the
    compile's one pass mechanism, that validates the input (as pass ``dispatch``) and the
    output of each pass when ``validate`` (whatever ``RPCOMPILE_DEBUG`` says; a broken
    schedule raises :class:`~rpcompile.passes.manager.ScheduleInvariantError` naming the pass). ``updates`` is the sync update order
    (:func:`add_optimizer`; ``None``: ``deferred`` for data parallel, else the plan's own,
    ``Plan.updates``; a bare stage list, ``overlap``).
    ``ranks``: processes training data parallel (:func:`add_reductions`). The memory-bounding
    waits added are ``plan.memory_waits`` (:data:`BOUNDED_WAITS` for a bare stage list).
    Returns the lowered schedule and one record per pass."""
    if ranks > 1 and schedule.stage_workers is not None:
        raise InvalidInput(f"data parallel (ranks={ranks}) lowers RoundPipe schedules; the "
                         f"{schedule.kind} baseline keeps its gradients on the bound workers")
    if updates is None:  # the plan's own order (Plan.updates); data parallel sync defers
        updates = "overlap" if schedule.optimizer != "sync" else (
            "deferred" if ranks > 1 else plan.updates if isinstance(plan, Plan) else "overlap")
    if passes is None:
        passes = (LOWERING_PASSES if ranks == 1 else DATA_PARALLEL_PASSES) \
            if schedule.stage_workers is None else _BASELINE_PASSES
    waits = plan.memory_waits if isinstance(plan, Plan) else BOUNDED_WAITS
    unknown = [w for w in waits if w not in MEMORY_WAITS]
    if unknown:
        raise InvalidInput(f"unknown memory waits {unknown}; known: {list(MEMORY_WAITS)}")
    table = {
        "upload": lambda s: add_weight_uploads(s, plan, chunk_bytes),
        "transfers": lambda s: add_activation_transfers(s, waits),
        "grads": lambda s: add_gradient_downloads(s, plan, chunk_bytes, grad_slots(waits)),
        "optimizer": lambda s: add_optimizer(s, plan, updates),
        "reduce": lambda s: add_reductions(s, plan, ranks),
        "commit": add_commit,
        "barrier": add_step_barrier,
        "events": add_events,
    }
    unknown = [p for p in passes if p not in table]
    if unknown:
        raise InvalidInput(f"unknown lowering passes {unknown}; known: {list(table)}")
    if validate:
        check(schedule, "dispatch")
    # The compile's one pass mechanism (run_pass): each lowering pass recorded like the
    # compile's, its schedule validated always when ``validate`` (it guards the runtime),
    # a broken one raising ScheduleInvariantError (a PassInvariantError and a ScheduleError)
    # naming the pass.
    manager = PassManager([(p, table[p]) for p in passes],
                          check=check if validate else None, always=True)
    return manager.run(schedule)


def runtime_schedule(plan: Plan, options: PlanOptions | int, microbatches: int | None = None,
                     rounds: int | None = None, mode: str | None = None,
                     chunk_bytes: int | None = None, *, steps: int | None = None,
                     updates: str | None = None, ranks: int | None = None,
                     trail: list | None = None, validate: bool | None = None) -> Schedule:
    """The lowered schedule the runtime runs, for the plan options ``options``
    (:class:`~rpcompile.options.PlanOptions`: ``gpus`` workers, ``microbatches_per_round``,
    ``rounds``, ``mode``, ``chunk_bytes``, ``schedule_steps``, ``ranks``, ``shard_optimizer``)
    as :func:`rpcompile.compile` resolved them (``Compiled.options.plan``): the steps of
    :func:`~rpcompile.passes.schedule.runtime_cycle` (``schedule_steps``, or the fewest: as
    many steps as an edge reaches back, then one dispatch period, which a run repeats
    (``Schedule.step_of``), then one more, the context of the last), marked ``sharded`` for
    sharded data parallel.
    ``updates``: the sync update order the run needs, when the options leave it to the
    training options (``PlanOptions.updates`` ``None``: the compile and the Trainer pass
    the order their training options need; else :func:`lower`'s default, the plan's own).

    The one builder of it: :func:`rpcompile.compile` keeps it as ``Compiled.schedule``
    (passing ``trail``, a list the dispatch's and each lowering pass's records are appended
    to, and ``validate=True``); a Trainer given other options (mode, ``schedule_steps``,
    ``chunk_bytes``) builds its own with this. ``validate`` (default: ``RPCOMPILE_DEBUG=1``)
    checks the dispatch and every lowering pass's schedule.

    The loose form ``runtime_schedule(plan, workers, microbatches, rounds, mode,
    chunk_bytes=None, steps=..., updates=..., ranks=...)`` (scripts, tests, benchmarks)
    builds those options from its arguments, checked by PlanOptions like any others."""
    if isinstance(options, PlanOptions):
        loose = {k: v for k, v in dict(microbatches=microbatches, rounds=rounds, mode=mode,
                                       chunk_bytes=chunk_bytes, steps=steps,
                                       ranks=ranks).items() if v is not None}
        if loose:
            raise InvalidType(f"runtime_schedule takes PlanOptions or loose arguments, not both: "
                            f"{', '.join(sorted(loose))} given beside the options; set them in "
                            f"the PlanOptions (steps is schedule_steps)")
    else:
        if microbatches is None or rounds is None or mode is None:
            raise InvalidType("runtime_schedule(plan, workers, microbatches, rounds, mode) needs "
                            "all four, or runtime_schedule(plan, PlanOptions(...))")
        options = PlanOptions(gpus=options, microbatches=microbatches, rounds=rounds,
                              mode=mode, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES,
                              schedule_steps=steps, ranks=ranks)
    workers, rounds = options.gpus, options.rounds
    ranks = options.ranks or 1
    steps, repeat_from, repeat_until = runtime_cycle(plan.stages, workers, rounds,
                                                     options.schedule_steps)
    updates = updates or options.updates
    validate = debug_checks() if validate is None else validate
    records: list = [] if trail is None else trail
    # The cycle is the dispatch's: every pass carries it, so each record's artifact is the
    # schedule as the run reads it.
    compute = run_pass(records, "dispatch", lambda: build_schedule(
        plan, workers=workers, microbatches=options.microbatches_per_round, rounds=rounds,
        steps=steps, kind="roundpipe", optimizer=options.mode,
    ).replace(repeat_from=repeat_from, repeat_until=repeat_until),
        check_dispatch if validate else None)
    lowered, lowering = lower(compute, plan, chunk_bytes=options.chunk_bytes,
                              validate=validate, updates=updates, ranks=ranks)
    records.extend(lowering)
    if options.shard_optimizer and ranks > 1:  # what its REDUCE and SHADOW actions move
        lowered = lowered.replace(sharded=True)
    return lowered


def runtime_peaks(plan: Plan, options: PlanOptions, *, updates: str | None = None,
                  ) -> tuple[WorkerPeak, ...]:
    """The proven peak of every worker over the runtime's schedule,
    ``runtime_schedule(plan, options, updates=updates)``: over the steps a run executes
    (``Schedule.run_steps``), the period lowered after them their context
    (``worker_peaks(steps=)``), so the last repeated steps are proven as a long run, which
    repeats them, runs them: before the steps after them."""
    sched = runtime_schedule(plan, options, updates=updates, validate=False)
    return worker_peaks(sched, plan, steps=sched.run_steps)

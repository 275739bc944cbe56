"""Lowering pass 4: the host's OPT per backward stage, the SHADOW rewrites of every stage
sharing its parameters, and the waits that make uploads read the right weights, in the sync
update orders (overlap, deferred) and async; each step's gradient check (CHECK) after its
last ACC."""

from __future__ import annotations

from collections.abc import Sequence

from rpcompile.errors import InvalidInput
from rpcompile.ir import Action, Edge, Plan, Schedule, Stage
from rpcompile.options import check_option, update_order
from rpcompile.passes.lower.common import _require_roundpipe, _stages, gradient_groups

__all__ = [
    "add_optimizer",
    "async_update_order",
    "opt_bytes",
    "updates_deferred",
]


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
        update_order("async", updates, ())  # async has one order: overlap
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
    return _unit_sharing(sched.stage_units, plan)


def _unit_sharing(stage_units: Sequence[tuple[int, int]], plan: Plan | Sequence[Stage],
                  ) -> dict[int, set[int]]:
    """:func:`_sharing` of stages spanning ``stage_units`` (first, last unit)."""
    units = [set(range(u0, u1 + 1)) for u0, u1 in stage_units]
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
    rewriters = _rewriters(sharing, covering)
    host: list[Action] = []
    shadows: dict[tuple[int, int], Action] = {}
    for k in sorted(by_step):
        accs = by_step[k]
        homes = [a.stage for a in accs if a.round == last]
        order = _async_order(rewriters, homes)
        updated = opt_bytes(plan, [s for s, _xs in order])
        for s, xs in order:
            host.append(Action(None, "OPT", s, None, None, k, bytes=updated[s]))
            for x in xs:
                sh = Action(None, "SHADOW", x, None, None, k,
                            bytes=stages[x].trainable_weight_bytes)
                host.append(sh)
                shadows[(x, k)] = sh
                edges += [Edge(Action(None, "OPT", y, None, None, k, bytes=updated[y]), sh,
                               "updated") for y in rewriters[x] if y in homes]
                edges += [Edge(up, sh, "shadow_read")
                          for z in sorted(sharing[x]) for up in ups.get((z, k - 1), ())]
        first_acc: dict[int, Action] = {}
        for a in accs:
            first_acc.setdefault(a.stage, a)
        edges += [Edge(Action(None, "OPT", s, None, None, k, bytes=updated[s]), first_acc[s],
                       "pending") for s, _xs in order]
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


def async_update_order(plan: Plan | Sequence[Stage]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """An async step's updates in its host queue (:func:`_add_async_optimizer`): (gradient
    stage whose OPT runs, the stages whose SHADOW comes right after that OPT), in queue
    order. The gradient stages are those that send gradients home (every stage but the
    forward ones with trainable parameters: rpcompile.passes.lower.add_gradient_downloads)."""
    stages = _stages(plan)
    units = [(st.units[0], st.units[-1]) for st in stages]
    grad_stages = [st.index for st in stages if st.kind != "forward" and st.grad_bytes]
    covering = {x: [y for y in grad_stages if _overlaps(units[x], units[y])]
                for x in range(len(stages))}
    order = _async_order(_rewriters(_unit_sharing(units, plan), covering), grad_stages)
    return tuple((s, tuple(xs)) for s, xs in order)


def _rewriters(sharing: dict[int, set[int]], covering: dict[int, list[int]],
               ) -> dict[int, list[int]]:
    """Stage -> the OPTs its SHADOW waits for: those over its own units (``covering``), and
    over the units of every stage it shares a parameter with (``sharing``: a tied embedding
    is in F1's and the tail's). Stages no gradient stage covers have no SHADOW."""
    return {x: sorted({y for z in sharing[x] for y in covering[z]} | set(ys))
            for x, ys in covering.items() if ys}


def _async_order(rewriters: dict[int, list[int]], homes: Sequence[int],
                 ) -> list[tuple[int, list[int]]]:
    """(OPT stage, the SHADOWs right after it) of one async step whose gradient stages with
    pending gradients are ``homes``: the OPTs in the order the next step uploads the stages
    whose shadows they complete (F1 first), each SHADOW right after the last OPT it waits
    for, so the shadow a job of the next step waits for is written as early as the host
    can."""
    pending = set(homes)
    place: dict[int, int] = {}  # OPT stage -> its place in the queue
    for x in sorted(rewriters):  # stages in upload order: F1, F2, ..., B1, B2, ...
        for y in rewriters[x]:
            if y in pending:
                place.setdefault(y, len(place))
    for y in homes:
        place.setdefault(y, len(place))
    if not place:
        return []
    order = sorted(place, key=place.__getitem__)
    out: list[tuple[int, list[int]]] = [(s, []) for s in order]
    for x, ys in rewriters.items():  # after the last of its OPTs (the first, if none)
        out[max((place[y] for y in ys if y in pending), default=0)][1].append(x)
    return out


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

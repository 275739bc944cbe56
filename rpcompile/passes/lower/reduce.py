"""Lowering pass 4b, data parallel over more than one rank: the cross-rank reduction of each
stage's gradients on the host's network lane, before the step's updates read them."""

from __future__ import annotations

from rpcompile.errors import InvalidInput
from rpcompile.ir import Action, Edge, Plan, Schedule
from rpcompile.passes.lower.common import _require_roundpipe, gradient_groups
from rpcompile.passes.lower.optimizer import updates_deferred

__all__ = [
    "add_reductions",
]


# --------------------------------------------------------------------------------------------
# 4b. reduce
# --------------------------------------------------------------------------------------------


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

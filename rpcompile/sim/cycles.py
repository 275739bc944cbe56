"""The least long-run time per async step of a RoundPipe plan: the maximum cycle ratio of the
waits that every replay of its lowered schedule keeps.

Steps overlap in async mode, so no one step's path bounds how far apart steps start. What
does bound it is a *cycle* of waits that runs over several steps. The graph has one node per
compute (a job's microbatch) of a step, the same for every step, and these edges, each
weighted by the time of the compute it leaves and marked with how many steps later its head
is:

  * ``microbatch``: a job's microbatches in order, on one compute stream (0 steps);
  * ``data``: a compute after the same microbatch of every stage it reads, in the same round
    (:func:`~rpcompile.passes.schedule.roundpipe_flows`; 0 steps);
  * ``worker``: a job's first compute after the last compute of its worker's job before it,
    as :func:`~rpcompile.passes.schedule.deal` deals them (as many steps as lie between);
  * ``stale``: a job of a stage with trainable weights after every compute of the step two
    before (2 steps). Its upload reads the shadow that the previous step's update wrote, and
    that update applies the gradients of the step before, once that step has committed.

A cycle of weight W over S steps holds every node on it to at least W later every S steps,
so the long-run time per step is at least W / S, and the greatest such ratio (the bound) is
what a replay that kept only these waits would reach. Transfers, uploads, host work and
memory bounds add waits, never remove one. The ``worker`` cycles together carry a step's
compute over the workers, so the bound is at least that share.

The cycle that sets it says why a plan idles: a ``data`` edge in it means a job waited for
the wavefront of the job before it (a job faster than the one it follows, or a worker freed
early by a short job whose next job is not ready); a ``stale`` edge, that steps wait for the
gradients of the step two before.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from rpcompile.errors import InvalidInput
from rpcompile.ir import Plan
from rpcompile.passes.schedule import deal, roundpipe_flows

__all__ = ["SteadyBound", "steady_bound"]


@dataclass(frozen=True)
class SteadyBound:
    """:func:`steady_bound`'s answer. ``step_ms``: no async run of the plan averages less
    per step in the long run. ``bubble``: the idle share at that pace (1 - one step's compute
    over ``workers x step_ms``). ``cycle``: the jobs the critical cycle passes through, in
    order, each as (step, round, stage) counted from the cycle's first step; ``cycle_steps``
    steps later it closes. ``edges``: the kinds of edge it takes from one job to the next
    (``worker``, ``data``, ``stale``)."""

    step_ms: float
    bubble: float
    cycle: tuple[tuple[int, int, int], ...]
    cycle_steps: int
    edges: tuple[str, ...]

    @property
    def stale(self) -> bool:
        """The cycle runs through the wait for the gradients of the step two before."""
        return "stale" in self.edges


# One edge: (from node, to node, weight ms, steps later, kind).
_Edge = tuple[int, int, float, int, str]


def steady_bound(plan: Plan, workers: int | None = None, microbatches: int | None = None,
                 rounds: int = 1) -> SteadyBound:
    """The least long-run time per step of ``plan`` run async on ``workers`` workers (default
    the plan's) with ``microbatches`` per round (default the plan's) and ``rounds`` rounds per
    step, each compute taking ``Stage.compute_ms``: see the module docstring."""
    workers = plan.workers if workers is None else workers
    microbatches = plan.microbatches if microbatches is None else microbatches
    if workers < 1 or microbatches < 1 or rounds < 1:
        raise InvalidInput(f"workers, microbatches and rounds must be >= 1, got {workers}, "
                           f"{microbatches}, {rounds}")
    n = len(plan.stages)
    jobs = n * rounds
    ms = [plan.stages[j % n].compute_ms for j in range(jobs)]
    work = microbatches * sum(ms)
    if work <= 0:
        raise InvalidInput("the plan's stages compute nothing (every Stage.compute_ms is 0): "
                           "no step time to bound")
    nodes, edges = _graph(plan, workers, microbatches, rounds)
    lam = work / workers * (1 - 1e-9)  # a worker cycle is at least this: a cycle exists
    best: tuple[float, list[_Edge]] | None = None
    while True:
        cycle = _positive_cycle(nodes, edges, lam)
        if cycle is None:
            break
        weight = sum(e[2] for e in cycle)
        steps = sum(e[3] for e in cycle)
        ratio = weight / steps
        if best is None or ratio > best[0]:
            best = (ratio, cycle)
        lam = max(lam, ratio) * (1 + 1e-12)  # each round strictly raises lam: it ends
    assert best is not None
    ratio, cycle = best
    return SteadyBound(step_ms=ratio, bubble=1.0 - work / (workers * ratio),
                       cycle=_jobs_on(cycle, n, microbatches, nodes - 1),
                       cycle_steps=sum(e[3] for e in cycle),
                       edges=tuple(e[4] for e in cycle if e[4] not in ("microbatch", "step_end")))


def _graph(plan: Plan, workers: int, microbatches: int, rounds: int,
           ) -> tuple[int, list[_Edge]]:
    """(node count, edges). Node ``j * microbatches + i`` is microbatch i of the step's job j
    (job j = round ``j // stages``, stage ``j % stages``, in dealing order); one more node
    stands for "every compute of the step has ended" (the ``stale`` edges leave from it)."""
    n = len(plan.stages)
    jobs = n * rounds
    ms = [plan.stages[j % n].compute_ms for j in range(jobs)]
    m = microbatches

    def node(j: int, i: int) -> int:
        return j * m + i

    done = jobs * m
    edges: list[_Edge] = []
    for j in range(jobs):
        edges += [(node(j, i - 1), node(j, i), ms[j], 0, "microbatch") for i in range(1, m)]
        edges.append((node(j, m - 1), done, ms[j], 0, "step_end"))
    for f in roundpipe_flows(plan):
        if f.src_stage is None:
            continue
        for r in range(rounds):
            src, dst = r * n + f.src_stage, r * n + f.dst_stage
            edges += [(node(src, i), node(dst, i), ms[src], 0, "data") for i in range(m)]
    # A worker's job before the counter's job g is job g - workers, whatever the step: one
    # step far enough from the start gives every job its predecessor.
    first = -(-workers // jobs) + 1
    dealt = itertools.islice(deal(n, workers, rounds), (first + 1) * jobs)
    last_of: dict[int, tuple[int, int]] = {}
    for w, s, r, k in dealt:
        j = r * n + s
        if k == first and w in last_of:
            pj, pk = last_of[w]
            edges.append((node(pj, m - 1), node(j, 0), ms[pj], k - pk, "worker"))
        last_of[w] = (j, k)
    for j in range(jobs):
        if plan.stages[j % n].trainable_weight_bytes > 0:
            edges.append((done, node(j, 0), 0.0, 2, "stale"))
    return done + 1, edges


def _positive_cycle(nodes: int, edges: list[_Edge], lam: float) -> list[_Edge] | None:
    """A cycle whose weight exceeds ``lam`` per step (edge weight less ``lam`` times its
    steps, summed, above zero), or None: Bellman-Ford for the longest paths from every node
    at once; an edge still relaxing after ``nodes`` passes lies on or behind such a cycle."""
    dist = [0.0] * nodes
    pred: list[_Edge | None] = [None] * nodes
    tol = 1e-9 * max(1.0, lam)
    last = None
    for _ in range(nodes + 1):
        last = None
        for e in edges:
            u, v, w, k, _kind = e
            d = dist[u] + w - lam * k
            if d > dist[v] + tol:
                dist[v] = d
                pred[v] = e
                last = v
        if last is None:
            return None
    v = last
    for _ in range(nodes):  # walk back into the cycle
        v = pred[v][0]  # type: ignore[index]
    cycle: list[_Edge] = []
    x = v
    while True:
        e = pred[x]
        assert e is not None
        cycle.append(e)
        x = e[0]
        if x == v:
            break
    cycle.reverse()
    return cycle


def _jobs_on(cycle: list[_Edge], stages: int, microbatches: int, done: int,
             ) -> tuple[tuple[int, int, int], ...]:
    """The jobs a cycle passes through, as (step, round, stage) from its first step."""
    out: list[tuple[int, int, int]] = []
    step = 0
    for u, _v, _w, k, _kind in cycle:
        if u != done:
            job = u // microbatches
            entry = (step, job // stages, job % stages)
            if not out or out[-1] != entry:
                out.append(entry)
        step += k
    if len(out) > 1 and out[-1] == (step, *out[0][1:]):
        out.pop()  # the cycle closes in the job it started in, ``step`` steps later
    return tuple(out)

"""A proven lower bound on the simulator's figure for a plan, cheap enough for every candidate.

The partitioner (rpcompile.planner.partition) simulates candidates in increasing order of this
bound and stops once the next bound is at least the best simulated figure, so the plan it
returns is the simulator's argmin over all its candidates. The bound must therefore never
exceed what ``_simulated_ms`` reports for the same plan; it is built only from what any replay
must serialize or wait for:

  * each worker's compute stream runs its actions one at a time, in the dispatch pass's order
    (jobs as :func:`~rpcompile.passes.schedule.deal` deals them, a job's microbatches in
    order), for exactly ``Stage.compute_ms`` each;
  * a compute waits for the values it reads (``roundpipe_flows``): from another worker, a D2H
    and then an H2D of at least the flow's bytes, each taking at least latency + bytes / rate;
  * a job's first compute waits for its weights' upload (from time 0);
  * the host queue runs one action at a time in its list order, none faster than alone at
    full rate: in the lowering's order (:func:`_host_queue`), each action after the one
    before it and after its release (an ACC after its gradients' download).

Which figure is bounded:

  * ``optimizer="sync"``: the makespan of one step. The compute streams and edges above form a
    DAG whose longest path (durations at their minimum) no replay can beat, and the host
    queue's chain (ACCs, OPTs and SHADOWs, forward stages' included) ends no earlier than
    :func:`_host_queue` says.
  * ``optimizer="async"``: the steady-state time per step (rpcompile.sim.steady_step_ms): one
    step's compute over the workers at the window's utilisation, which is at most 1, so at
    least one step's compute spread over the workers. Steps overlap (nothing but what a job
    reads and its worker's memory bounds orders step k+1 after step k), so no one step's
    path bounds the spacing of step starts; a plan's steady state comes within a few
    percent of this bound where it overlaps well.

Both are scaled by ``1 - 1e-9`` against rounding in the two summation orders.

The host chain is the ``overlap`` order's, and leaves out each step's CHECK: a plan lowered
with ``updates="deferred"`` or with ``grad_check_passes`` (``Plan.updates``, a clipped run)
only adds host work after the step's last ACC, so its replay is no faster and the bound
still holds (looser).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from operator import attrgetter

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import STEPS_IN_FLIGHT, Plan, Stage
from rpcompile.options import MODES, check_choice
from rpcompile.passes.lower import async_update_order, opt_bytes
from rpcompile.passes.schedule import deal, roundpipe_flows
from rpcompile.sim.engine import JOURNAL_BYTES_PER_PARAM

__all__ = ["simulated_lower_bound", "steady_estimate"]

_MARGIN = 1e-9  # relative; the bound and the replay sum the same terms in other orders


def simulated_lower_bound(plan: Plan, hardware: Hardware | str, rounds: int = 1,
                          optimizer: str = "sync") -> float:
    """A figure no replay of ``plan`` can beat: one sync step's makespan, or the async
    steady-state time per step (milliseconds; see the module docstring for the argument).
    A public entry point (benchmarks and the search-quality tests call it on their own
    plans), so it checks ``optimizer`` (:func:`~rpcompile.options.check_choice`, a tuple
    lookup, negligible beside the bound even in the partitioner's search loop)."""
    check_choice("optimizer", optimizer, MODES)
    hw = get_hardware(hardware)
    # Everything the bound reads (roundpipe_flows reads the stages and the tokens per
    # microbatch; of the units, only what they borrow: opt_bytes charges a shared
    # parameter's update once; nothing reads the notes, memory waits or memory figures).
    key = (_timed_stages(plan), tuple(u.borrowed for u in plan.units), plan.workers,
           plan.microbatches, plan.microbatch_size * plan.seq_len, hw, rounds, optimizer)
    with _BOUNDS_LOCK:
        hit = _BOUNDS.get(key)
        if hit is not None:
            _BOUNDS.move_to_end(key)
            return hit
    if optimizer == "async":
        work = plan.microbatches * rounds * sum(s.compute_ms for s in plan.stages)
        bound = work / plan.workers * (1.0 - _MARGIN)
    else:
        bound = _sync_makespan_bound(plan, hw, rounds, _Costs(plan, hw, rounds)) * (
            1.0 - _MARGIN)
    with _BOUNDS_LOCK:
        _BOUNDS[key] = bound
        while len(_BOUNDS) > _BOUNDS_KEPT:
            _BOUNDS.popitem(last=False)
    return bound


def steady_estimate(plan: Plan, hardware: Hardware | str, rounds: int = 1) -> float:
    """The async steady-state step (rpcompile.sim.steady_step_ms, over
    :func:`~rpcompile.sim.steady_steps` overlapping steps) of a replay that keeps only each
    worker's compute order, the jobs as :func:`~rpcompile.passes.schedule.deal` deals them,
    each value's least hop between workers (a D2H and an H2D), the host queue and the waits
    between steps; no link sharing or memory waits.

    The host queue runs in the lowering's order (:func:`_AsyncHost`), each action alone at
    full rate: step k's updates and shadow rewrites, then its ACCs (each after its
    gradients' least download), then its CHECK, the step's commit point. Step k's job of a
    stage with a shadow starts once SHADOW(stage, k-1) has run and its weights' least
    upload after it; every job of step k after step k-2's commit point (the runtime keeps
    two steps in flight). A plan whose host queue is busy most of the step is paced by it,
    which compute alone cannot show.

    Not a bound (the figure is a ratio, which a relaxed replay may not lower), but it sees
    what an overlapping run's bubble is made of where steps overlap (a job faster than the
    one before it waits for each microbatch; workers freed unevenly start the next step's
    chain late; a host queue that writes the next step's shadows late), which
    :func:`simulated_lower_bound` cannot; so the partitioner climbs and orders its async
    replays by it. At least the bound."""
    hw = get_hardware(hardware)
    key = ("steady", _timed_stages(plan), tuple(u.borrowed for u in plan.units),
           plan.grad_check_passes, plan.workers, plan.microbatches,
           plan.microbatch_size * plan.seq_len, hw, rounds)
    with _BOUNDS_LOCK:
        hit = _BOUNDS.get(key)
        if hit is not None:
            _BOUNDS.move_to_end(key)
            return hit
    from rpcompile.sim.runs import steady_steps

    costs = _Costs(plan, hw, rounds)
    host = _AsyncHost(plan, hw)
    steps = steady_steps(plan, rounds=rounds)
    warm = 1 if steps <= 4 else 2  # steady_utilization's default window
    free = [0.0] * plan.workers
    ends: dict[tuple[int, int, int], list[float]] = {}
    where: dict[tuple[int, int, int], int] = {}
    spans: list[tuple[float, float]] = []
    first: dict[int, float] = {}
    queue = 0.0  # when the host queue is free
    shadowed: dict[int, float] = {}  # stage -> when the shadow of the step before is written
    commits: list[float] = []  # each step's commit point
    micro = range(plan.microbatches)
    for k in range(steps):
        # The host queue's head of step k: its updates and shadow rewrites.
        written: dict[int, float] = {}
        for opt_ms, rewrites in host.updates:
            queue += opt_ms
            for x, shadow_ms in rewrites:
                queue += shadow_ms
                written[x] = queue
        homes: list[tuple[int, int, float]] = []
        for w, s, r, _k in costs.dealt(k):
            where[(s, r, k)] = w
            t = free[w]
            if k >= STEPS_IN_FLIGHT:
                t = max(t, commits[k - STEPS_IN_FLIGHT])
            if s in shadowed:
                t = max(t, shadowed[s] + costs.upload[s])
            remote = [(ends[(src, r, k)], 0.0 if where[(src, r, k)] == w else hop)
                      for src, hop in costs.remote[s]]
            c = costs.compute[s]
            done = []
            for m in micro:
                for src_ends, extra in remote:
                    t = max(t, src_ends[m] + extra)
                if k not in first or t < first[k]:
                    first[k] = t
                spans.append((t, t + c))
                t += c
                done.append(t)
            ends[(s, r, k)] = done
            free[w] = t
            if costs.home[s] is not None:
                homes.append((r, s, t + costs.home[s]))
        for _r, s, home in sorted(homes):  # the ACCs in dispatch order: round, stage
            queue = max(queue, home) + host.acc[s]
        queue += host.check
        commits.append(queue)
        shadowed = written
    lo, hi = first[warm], first[steps - 1]
    busy = sum(max(0.0, min(e, hi) - max(b, lo)) for b, e in spans)
    work = plan.microbatches * rounds * sum(costs.compute)
    estimate = work * (hi - lo) / busy if busy > 0 else float("inf")
    with _BOUNDS_LOCK:
        _BOUNDS[key] = estimate
        while len(_BOUNDS) > _BOUNDS_KEPT:
            _BOUNDS.popitem(last=False)
    return estimate


class _AsyncHost:
    """The least time of each action of an async step's host queue (rpcompile.sim.engine:
    each alone at full rate, with the runtime's overhead per action), in the lowering's
    order (:func:`~rpcompile.passes.lower.async_update_order`): ``updates``, per OPT its
    time and the SHADOWs right after it (stage, time); ``acc``, each gradient stage's ACC;
    ``check``, the step's CHECK."""

    def __init__(self, plan: Plan, hw: Hardware) -> None:
        # An async SHADOW writes the copy no committed step reads, so it journals nothing.
        times = _HostTimes(hw, overhead=True)
        order = async_update_order(plan)
        own = opt_bytes(plan, [s for s, _xs in order])
        stages = plan.stages
        self.updates = [(times.opt(own[s]), [(x, times.sweep(stages[x].trainable_weight_bytes))
                                             for x in xs]) for s, xs in order]
        self.acc = {s: times.sweep(stages[s].grad_bytes) for s, _xs in order}
        checked = plan.grad_check_passes * sum(own.values())
        self.check = checked / times.host_rate + times.overhead


class _HostTimes:
    """The least time of one host action alone at full rate, as rpcompile.sim.engine charges
    it; ``overhead``: with the runtime's fixed cost per action (``Hardware.action_overhead_us``),
    which an estimate counts and a lower bound leaves out."""

    def __init__(self, hw: Hardware, *, overhead: bool) -> None:
        self.host_rate = hw.host_mem_gbps * 1e6  # bytes per ms
        self.opt_rate = hw.optimizer_params_per_s * 1e-3  # parameters per ms
        # Before each update, the undo journal's copy: none when the run keeps no journal.
        self.journal = JOURNAL_BYTES_PER_PARAM if hw.undo_journal else 0
        self.overhead = hw.action_overhead_us * 1e-3 if overhead else 0.0

    def opt(self, nbytes: int) -> float:
        """An OPT over ``nbytes`` of fp32 masters: the journal's copy, then the update."""
        params = nbytes / 4
        return params / self.opt_rate + self.journal * params / self.host_rate + self.overhead

    def sweep(self, nbytes: int) -> float:
        """An ACC or SHADOW over ``nbytes``: read two, write one."""
        return 3.0 * nbytes / self.host_rate + self.overhead


# Bounds already worked out, by everything they read: the partitioner meets a candidate in
# build_plan (its predicted_step_ms), in the local search, in the replay order, and again
# under lower stage limits and for each recompute granularity. The least recently used go
# first.
_BOUNDS: OrderedDict[tuple, float] = OrderedDict()
_BOUNDS_KEPT = 65536
_BOUNDS_LOCK = threading.Lock()


def _transfer_ms(nbytes: int, gbps: float, latency_ms: float) -> float:
    """The least time a transfer of ``nbytes`` takes alone on a link of ``gbps``."""
    return nbytes / (gbps * 1e6) + latency_ms if nbytes else 0.0


# Every field of a stage but its device memory figure, which neither figure here reads: the
# loss-chunk variants of one cut (whose tail stages differ only there) share their figures.
_STAGE_TIMING = attrgetter(*(f.name for f in dataclasses.fields(Stage) if f.name != "peak_bytes"))


def _timed_stages(plan: Plan) -> tuple:
    return tuple(map(_STAGE_TIMING, plan.stages))


class _Costs:
    """What :func:`_step_paths` reads of a plan with ``rounds`` rounds, worked out once for
    all the steps it bounds (the same floats it would compute at every job): per stage its
    compute, its weights' least upload, the least upload of each value it reads from the
    host, the values it reads from other stages with their least hop through the host (a
    D2H, then an H2D), and its gradients' least download (None for a stage with none to send
    home); and the jobs as :func:`~rpcompile.passes.schedule.deal` deals them."""

    def __init__(self, plan: Plan, hw: Hardware, rounds: int) -> None:
        latency = hw.transfer_latency_us * 1e-3

        def h2d(nbytes: int) -> float:
            return _transfer_ms(nbytes, hw.link_h2d_gbps, latency)

        def d2h(nbytes: int) -> float:
            return _transfer_ms(nbytes, hw.link_d2h_gbps, latency)

        stages = plan.stages
        self.compute = [st.compute_ms for st in stages]
        self.upload = [h2d(st.upload_bytes) for st in stages]
        self.host_reads: list[list[float]] = [[] for _ in stages]
        self.remote: list[list[tuple[int, float]]] = [[] for _ in stages]
        for f in roundpipe_flows(plan):
            if f.src_stage is None:
                self.host_reads[f.dst_stage].append(h2d(f.bytes))
            else:
                self.remote[f.dst_stage].append((f.src_stage, d2h(f.bytes) + h2d(f.bytes)))
        self.home = [d2h(st.grad_bytes) if st.kind != "forward" and st.grad_bytes else None
                     for st in stages]
        self.jobs = len(stages) * rounds
        self._deal = deal(len(stages), plan.workers, rounds)
        self._dealt: list[tuple[int, int, int, int]] = []

    def dealt(self, step: int) -> list[tuple[int, int, int, int]]:
        """(worker, stage, round, step) of step ``step``'s jobs, in dispatch order."""
        while len(self._dealt) < (step + 1) * self.jobs:
            self._dealt.append(next(self._deal))
        return self._dealt[step * self.jobs:(step + 1) * self.jobs]


def _sync_makespan_bound(plan: Plan, hw: Hardware, rounds: int, costs: _Costs) -> float:
    compute_end, home = _step_paths(plan, hw, costs)
    return max(compute_end, _host_queue(plan, hw, rounds, home))


def _step_paths(plan: Plan, hw: Hardware, costs: _Costs,
                ) -> tuple[float, dict[tuple[int, int], float]]:
    """(when a run's first step's computes end at the earliest, (stage, round) -> when its
    gradients are home at the earliest), from the run's start. ``costs`` holds the plan's
    figures (:class:`_Costs`)."""
    free = [0.0] * plan.workers  # when each compute stream is free
    ends: dict[tuple[int, int], list[float]] = {}  # (stage, round) -> each microbatch's end
    where: dict[tuple[int, int], int] = {}
    home: dict[tuple[int, int], float] = {}
    dealt = costs.dealt(0)
    uploaded = _first_uploads(plan, hw, dealt)
    micro = range(plan.microbatches)
    for n, (w, s, r, _step) in enumerate(dealt):
        where[(s, r)] = w
        # the weights and the host's inputs upload after the start
        t = max(free[w], costs.upload[s], uploaded.get(n, 0.0), *costs.host_reads[s])
        remote = [(ends[(src, r)], 0.0 if where[(src, r)] == w else hop)
                  for src, hop in costs.remote[s]]
        c = costs.compute[s]
        done = []
        if len(remote) == 1:  # most stages: one value from another stage
            src_ends, extra = remote[0]
            for m in micro:
                ready = src_ends[m] + extra
                if ready > t:
                    t = ready
                t += c
                done.append(t)
        else:
            for m in micro:
                for src_ends, extra in remote:
                    t = max(t, src_ends[m] + extra)
                t += c
                done.append(t)
        ends[(s, r)] = done
        free[w] = t
        if costs.home[s] is not None:
            home[(s, r)] = t + costs.home[s]
    return max(free), home


def _first_uploads(plan: Plan, hw: Hardware, dealt: list[tuple[int, int, int, int]],
                   ) -> dict[int, float]:
    """Job (its place in ``dealt``, a run's first step's jobs) -> the earliest its weights are
    in, for the first two jobs of each worker, counted from the run's start.

    Those two uploads wait for nothing (a worker's first two uploads have no ``buffer`` wait,
    the first step no ``shadow`` wait), so at the start every worker's H2D link has them
    ready, and it serves
    them back to back, the first first (list order breaks the tie). The links have one
    rate, and the simulator slows every transfer in proportion when host memory is
    oversubscribed, so while two links are busy they move the same work at every instant.
    When worker w's upload completes, its link has moved ``own`` bytes (that job's weights,
    plus the first job's for the second), every other link at least ``min(own, its two
    uploads)``, and all that went through host memory: at least the sum over links
    over ``host_mem_gbps``; and at least ``own`` over the link's rate."""
    host_rate = hw.host_mem_gbps * 1e6  # bytes per ms
    link_rate = hw.link_h2d_gbps * 1e6  # pinned or pageable (Hardware.host_memory)
    firsts: dict[int, list[int]] = {}  # worker -> its first two jobs (places in dealt)
    for n, (w, _s, _r, _k) in enumerate(dealt):
        if len(firsts.setdefault(w, [])) < 2:
            firsts[w].append(n)
    weights = [plan.stages[s].upload_bytes for _w, s, _r, _k in dealt]
    ready = [sum(weights[n] for n in mine) for mine in firsts.values()]
    out: dict[int, float] = {}
    for mine in firsts.values():
        own = 0
        for n in mine:
            own += weights[n]
            out[n] = max(own / link_rate, sum(min(own, q) for q in ready) / host_rate)
    return out


def _host_queue(plan: Plan, hw: Hardware, rounds: int,
                home: dict[tuple[int, int], float]) -> float:
    """The earliest end of one sync step's host queue (ACC, OPT, SHADOW), from the time
    ``home`` counts from. The queue is ordered: each action starts after the one before it
    and after its release (an ACC: its gradients home), and takes at least its time alone at
    full rate (rpcompile.sim.engine). The order is the lowering's
    (rpcompile.passes.lower.add_optimizer, ``updates="overlap"``), ACCs in dispatch order
    (round, then stage); after the last round's ACC of stage s, OPT(s), then SHADOW(x) of
    every stage x (forward stages included) whose parameters' gradient stages (those whose
    units overlap x's) have all had their OPT.

    Leaving actions out of an ordered queue keeps the rest in order: still a lower bound."""
    stages = plan.stages
    # Each action alone at full rate, the undo journal's copy as the simulator charges it
    # (none when the run keeps no journal), so the bound stays below its replay.
    times = _HostTimes(hw, overhead=False)
    span = [(s.units[0], s.units[-1]) for s in stages]
    grad_stages = sorted({s for s, _r in home})
    covering = [[y for y in grad_stages if span[x][0] <= span[y][1] and span[y][0] <= span[x][1]]
                for x in range(len(stages))]

    # What each OPT updates (rpcompile.passes.lower.opt_bytes): a parameter shared by two
    # gradient stages (a tied embedding and LM head) is updated once, at the OPT of the last
    # of them in the queue, which is this queue's order (last-round ACCs by stage).
    own = opt_bytes(plan, grad_stages)

    # Every gradient stage has a job in every round, so the last round's OPTs go by stage,
    # and SHADOW(x) comes right after the OPT of the last of its gradient stages, the largest
    # (after that OPT: the stages it completes, by x).
    completes: dict[int, list[int]] = {}
    for x, ys in enumerate(covering):
        if ys:
            completes.setdefault(ys[-1], []).append(x)
    t = 0.0
    for (s, r) in sorted(home, key=lambda sr: (sr[1], sr[0])):
        t = max(t, home[(s, r)]) + times.sweep(stages[s].grad_bytes)  # ACC
        if r != rounds - 1:
            continue
        t += times.opt(own[s])  # OPT
        for x in completes.get(s, ()):
            # SHADOW (the journal's copy, once a step per parameter, not counted)
            t += times.sweep(stages[x].trainable_weight_bytes)
    return t

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
  * the host queue runs one action at a time, none faster than alone at full rate: ACC of a
    job's gradients after their download, OPT of a stage after its ACCs, SHADOW after OPT.

Which figure is bounded:

  * ``optimizer="sync"``: the makespan of one step. The compute streams and edges above form a
    DAG whose longest path (durations at their minimum) no replay can beat; the host queue adds
    a one-machine bound with release times (the preemptive relaxation: for every release time
    t, t plus the work released at or after t).
  * ``optimizer="async"``: the steady-state time per step, ``work / (workers x utilization)``
    (rpcompile.sim.steady_step_ms). Utilization is at most 1 on every worker in any window,
    so the figure is at least one step's compute spread over the workers. No critical path is
    valid there: overlapping steps hide it, and a finite window may be busier than the steady
    state. This holds for any execution that serializes each compute stream, steps
    overlapped or separated by a barrier.

Both are scaled by ``1 - 1e-9`` against rounding in the two summation orders.
"""

from __future__ import annotations

import itertools

from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan
from rpcompile.passes.schedule import deal, roundpipe_flows

__all__ = ["simulated_lower_bound"]

_MARGIN = 1e-9  # relative; the bound and the replay sum the same terms in other orders


def simulated_lower_bound(plan: Plan, hardware: Hardware | str, rounds: int = 1,
                          optimizer: str = "sync") -> float:
    """A figure no replay of ``plan`` can beat: one sync step's makespan, or the async
    steady-state time per step (milliseconds; see the module docstring for the argument)."""
    if optimizer not in ("sync", "async"):
        raise ValueError(f"optimizer must be 'async' or 'sync', got {optimizer!r}")
    hw = get_hardware(hardware)
    if optimizer == "async":
        work = plan.microbatches * rounds * sum(s.compute_ms for s in plan.stages)
        return work / plan.workers * (1.0 - _MARGIN)
    return _sync_makespan_bound(plan, hw, rounds) * (1.0 - _MARGIN)


def _transfer_ms(nbytes: int, gbps: float, latency_ms: float) -> float:
    """The least time a transfer of ``nbytes`` takes alone on a link of ``gbps``."""
    return nbytes / (gbps * 1e6) + latency_ms if nbytes else 0.0


def _sync_makespan_bound(plan: Plan, hw: Hardware, rounds: int) -> float:
    stages, workers, micro = plan.stages, plan.workers, plan.microbatches
    latency = hw.transfer_latency_us * 1e-3
    host_rate = hw.host_mem_gbps * 1e6  # bytes per ms

    def h2d(nbytes: int) -> float:
        return _transfer_ms(nbytes, hw.h2d_gbps, latency)

    def d2h(nbytes: int) -> float:
        return _transfer_ms(nbytes, hw.d2h_gbps, latency)

    # What each stage's computes read: (source stage or None for the host, bytes).
    reads: dict[int, list[tuple[int | None, int]]] = {s.index: [] for s in stages}
    for f in roundpipe_flows(plan):
        reads[f.dst_stage].append((f.src_stage, f.bytes))
    free = [0.0] * workers  # when each compute stream is free
    ends: dict[tuple[int, int], list[float]] = {}  # (stage, round) -> each microbatch's end
    where: dict[tuple[int, int], int] = {}
    host: list[tuple[float, float]] = []  # (release, least duration) of each host action
    acc_done: dict[int, float] = {}  # stage -> when its last ACC could end at the earliest
    for w, s, r, _step in itertools.islice(deal(len(stages), workers, rounds),
                                           len(stages) * rounds):
        st = stages[s]
        where[(s, r)] = w
        t = max(free[w], h2d(st.weight_bytes))
        remote = []
        for src, nbytes in reads[s]:
            if src is None:
                t = max(t, h2d(nbytes))
            else:
                hop = 0.0 if where[(src, r)] == w else d2h(nbytes) + h2d(nbytes)
                remote.append((ends[(src, r)], hop))
        done = []
        for m in range(micro):
            for src_ends, hop in remote:
                t = max(t, src_ends[m] + hop)
            t += st.compute_ms
            done.append(t)
        ends[(s, r)] = done
        free[w] = t
        if st.kind != "forward" and st.grad_bytes:
            release = t + d2h(st.grad_bytes)
            acc = 3.0 * st.grad_bytes / host_rate
            host.append((release, acc))
            acc_done[s] = max(acc_done.get(s, 0.0), release + acc)
    opt_rate = hw.optimizer_params_per_s * 1e-3  # parameters per ms
    for s, ready in acc_done.items():
        opt = stages[s].grad_bytes / 4 / opt_rate
        host.append((ready, opt))
        host.append((ready + opt, 3.0 * stages[s].weight_bytes / host_rate))
    bound = max(free)
    later = 0.0
    for release, work in sorted(host, reverse=True):
        later += work
        bound = max(bound, release + later)
    return bound

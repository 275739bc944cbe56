"""What a replay measures: makespan, bubble split, exposed transfer time, idle time by
binding edge, peak device memory per worker and peak host memory (the staging pool
included)."""

from __future__ import annotations

from collections.abc import Mapping

from rpcompile.hardware import Hardware
from rpcompile.ir import (
    Action,
    Schedule,
    Stage,
    UnitProfile,
)
from rpcompile.passes.memory import working_bytes
from rpcompile.passes.staging import lend
from rpcompile.sim.engine.costs import _COMPUTE_STREAM_KINDS, _TIMED_KINDS
from rpcompile.sim.result import SimResult, busy_split

__all__ = [
    "makespan_of",
]


def _measure(sched: Schedule, stages: tuple[Stage, ...], units: tuple[UnitProfile, ...] | None,
             hw: Hardware, timeline: dict[Action, tuple[float, float]],
             times: Mapping[tuple[str, int], float], tokens_per_microbatch: int) -> SimResult:
    makespan = makespan_of(timeline)
    g = sched.workers
    busy, fill, drain, steady = busy_split(sched, timeline, makespan)
    denom = makespan * g if makespan > 0 else 1.0
    step_end = [0.0] * sched.steps
    for lst in sched.actions:
        for a in lst:
            if a.is_compute:
                step_end[a.step] = max(step_end[a.step], timeline[a][1])
    tokens = tokens_per_microbatch * sched.microbatches * sched.rounds * sched.steps
    exposed, idle = _waits(sched, timeline)
    return SimResult(
        schedule=sched, hardware=hw.name, makespan_ms=makespan, tokens=tokens,
        busy_ms=tuple(busy), bubble=(fill + drain + steady) / denom, bubble_fill=fill / denom,
        bubble_drain=drain / denom, bubble_steady=steady / denom,
        exposed_transfer_ms=exposed, idle_by_wait_ms=idle,
        peak_device_bytes=_device_memory(sched, stages, units, timeline),
        peak_host_bytes=_host_memory(sched, stages, units, timeline, hw.undo_journal),
        step_end_ms=tuple(step_end), timeline=timeline,
    )


def makespan_of(timeline: Mapping[Action, tuple[float, float]]) -> float:
    """The end of a replay's last action (0 for an empty one)."""
    return max((e for _, e in timeline.values()), default=0.0)


def _waits(sched: Schedule, timeline: Mapping[Action, tuple[float, float]],
           ) -> tuple[tuple[float, ...], dict[str, float]]:
    """(exposed transfer time per worker, compute-stream idle time by binding edge kind).

    Exposed: the sum over computes of (start - when it could have started had every transfer
    taken no time); a transfer's zero-time readiness is that of what it waits on. Idle by
    kind: each gap before a compute, charged to the kind of the edge that finished last
    (``weights``: the upload; ``arrived``: an input from another worker, be it the transfer or
    the producer's pace; ``data``: a producer on the same worker)."""
    # Each action's waits in edge order: (source, edge kind, whether the source's own end
    # counts: compute and host actions; transfers and the network lane count as instant).
    preds: dict[Action, list[tuple[Action, str, bool]]] = {}
    for e in sched.edges:
        waits = preds.get(e.dst)
        if waits is None:
            preds[e.dst] = waits = []
        waits.append((e.src, e.kind, e.src.kind in _TIMED_KINDS))
    origin: dict[Action, float] = {}

    def free_ready(a: Action) -> float:
        """When a transfer would be done if transfers were instant (iterative, memoised)."""
        stack = [a]
        while stack:
            x = stack[-1]
            if x in origin:
                stack.pop()
                continue
            waits = preds.get(x, ())
            pending = [p for p, _kind, timed in waits if not timed and p not in origin]
            if pending:
                stack.extend(pending)
                continue
            origin[x] = max((timeline[p][1] if timed else origin[p] for p, _kind, timed in waits),
                            default=0.0)
            stack.pop()
        return origin[a]

    out = []
    idle: dict[str, float] = {}
    for lst in sched.actions:
        prev_end = 0.0
        lost = 0.0
        for a in lst:
            if a.kind not in _COMPUTE_STREAM_KINDS:
                continue
            start, end = timeline[a]
            could = prev_end
            waits = preds.get(a)
            if waits is not None:
                for p, _kind, timed in waits:
                    could = max(could, timeline[p][1] if timed else free_ready(p))
            lost += max(0.0, start - could)
            if start > prev_end and waits is not None:
                binding = max(waits, key=lambda pk: timeline[pk[0]][1])[1]
                idle[binding] = idle.get(binding, 0.0) + (start - prev_end)
            prev_end = end
        out.append(lost)
    return tuple(out), dict(sorted(idle.items()))


def _peak(deltas: list[tuple[float, int, int]]) -> int:
    """Peak of a running sum; at equal times frees (order 0) go before allocations."""
    level = peak = 0
    for _, _, d in sorted(deltas):
        level += d
        peak = max(peak, level)
    return peak


def _working_bytes(sched: Schedule, stage: Stage, units: tuple[UnitProfile, ...] | None) -> int:
    """Device memory a compute of ``stage`` needs beyond weights, gradients and the values
    listed in the schedule (one microbatch's activations and transients)."""
    if sched.stage_workers is None:  # RoundPipe: the planner's figure (passes.memory)
        return working_bytes(stage)
    if units is None:
        return 0
    return sum(units[u].working_bytes for u in stage.units)


def _device_memory(sched: Schedule, stages: tuple[Stage, ...],
                   units: tuple[UnitProfile, ...] | None,
                   timeline: Mapping[Action, tuple[float, float]]) -> tuple[int, ...]:
    """Peak device bytes per worker: weight slots (UP start .. EVICT end; a schedule not yet
    lowered: over each job; baselines: their bound stages' weights and gradients all along), the fp32 gradient accumulator of a
    backward job (first compute start .. the start of the compute that takes its slot,
    ``Schedule.releases``, else its D2H grad end), each compute's working set,
    values a compute produces (until their local readers are done and they are given back
    after their D2H: as the compute ``Schedule.releases`` names starts, else at its end), values an
    H2D brings (until the compute reading them ends), and a baseline's stash (F end .. B end,
    the stage's input kept for recompute)."""
    deltas: list[list[tuple[float, int, int]]] = [[] for _ in range(sched.workers)]

    def hold(w: int, start: float, end: float, nbytes: int) -> None:
        if nbytes > 0:
            deltas[w].append((start, 1, nbytes))
            deltas[w].append((end, 0, -nbytes))

    computes: dict[tuple, Action] = {}
    d2h: dict[tuple, Action] = {}
    evict: dict[tuple, Action] = {}
    grad_down: dict[tuple, Action] = {}
    releases = sched.releases()
    for lst in sched.actions:
        for a in lst:
            key = (a.stage, a.microbatch, a.round, a.step)
            if a.is_compute:
                computes[(a.kind, *key)] = a
            elif a.kind == "D2H" and a.what == "grad":
                grad_down[(a.worker, a.stage, a.round, a.step)] = a
            elif a.kind == "D2H":
                d2h[(a.worker, a.value, *key)] = a
            elif a.kind == "EVICT":
                evict[(a.worker, a.stage, a.round, a.step)] = a
    if sched.stage_workers is not None:
        for s, w in enumerate(sched.stage_workers):
            hold(w, 0.0, float("inf"), stages[s].weight_bytes + stages[s].grad_bytes)

    flows_from: dict[tuple[str, int], list] = {}
    readers: dict[tuple[int, str], str] = {}
    for f in sched.flows:
        if f.src_kind is not None:
            flows_from.setdefault((f.src_kind, f.src_stage), []).append(f)
        readers[(f.dst_stage, f.value)] = f.dst_kind

    job_first: dict[tuple, float] = {}
    job_last: dict[tuple, float] = {}
    for lst in sched.actions:
        for a in lst:
            start, end = timeline[a]
            w = a.worker
            if a.kind == "UP":
                ev = evict.get((w, a.stage, a.round, a.step))
                hold(w, start, timeline[ev][1] if ev else end, a.bytes)
            elif a.kind == "H2D":
                dst = computes.get((readers.get((a.stage, a.value)), a.stage, a.microbatch,
                                    a.round, a.step))
                hold(w, start, timeline[dst][1] if dst else end, a.bytes)
            if not a.is_compute:
                continue
            hold(w, start, end, _working_bytes(sched, stages[a.stage], units))
            job = (w, a.stage, a.round, a.step)
            job_first.setdefault(job, start)
            job_last[job] = end
            produced: dict[str, tuple[int, float]] = {}  # value -> (bytes, freed at)
            for f in flows_from.get((a.kind, a.stage), ()):
                nbytes = f.bytes
                if f.what == "save" and f.value.startswith("stash"):
                    nbytes = stages[a.stage].input_bytes  # baseline: the input kept for B
                reader = computes.get((f.dst_kind, f.dst_stage, a.microbatch, a.round, a.step))
                free = end
                if reader is not None and reader.worker == w:
                    free = max(free, timeline[reader][1])
                down = d2h.get((w, f.value, a.stage, a.microbatch, a.round, a.step))
                if down is not None:
                    free = max(free, timeline[down][1])
                    if down in releases:  # given back as that compute starts
                        free = max(free, timeline[releases[down]][0])
                # One tensor however many readers it has (the runtime holds it once).
                held = produced.get(f.value, (0, end))
                produced[f.value] = (max(held[0], nbytes), max(held[1], free))
            for nbytes, free in produced.values():
                hold(w, end, free, nbytes)
    if sched.stage_workers is None:
        for job, first in job_first.items():
            w, s, _, _ = job
            if job not in evict:  # not lowered: weights resident over the job
                hold(w, first, job_last[job], stages[s].upload_bytes)
            if stages[s].kind == "forward" or not stages[s].grad_bytes:
                continue
            down = grad_down.get(job)
            free = timeline[down][1] if down else job_last[job]
            if down in releases:  # its slot is given back as that compute starts
                free = max(free, timeline[releases[down]][0])
            hold(w, first, free, stages[s].grad_bytes)
    return tuple(_peak(d) for d in deltas)


def _host_memory(sched: Schedule, stages: tuple[Stage, ...],
                 units: tuple[UnitProfile, ...] | None,
                 timeline: Mapping[Action, tuple[float, float]], journal: bool = True) -> int:
    """Peak host bytes. Static: fp32 masters and Adam moments of the trainable parameters
    (12 bytes each, when unit profiles are known); RoundPipe adds one low-precision shadow
    and one fp32 gradient accumulator per parameter, shared by the stages that read it, in
    async mode a second one, the pending gradients, and the undo journal unless ``journal``
    is off (rpcompile.passes.memory.HostMemory; without
    unit profiles: each stage's shadow and accumulator); a baseline adds the bf16
    weights of frozen parameters. Dynamic: activations between
    their D2H start and the end of the last H2D reading them, and a job's gradients between
    their D2H start and the end of their ACC; for RoundPipe the sum of the host staging slots
    the runtime lends them (``Schedule.staging_bytes``, rpcompile.passes.staging: proven to
    hold whatever the timing; a schedule without slots, those this replay gives), for a
    baseline the peak of their sum."""
    if sched.stage_workers is None and units is not None:
        # Masters, Adam moments, gradients and shadows, every parameter once (the runtime's
        # host store): rpcompile.passes.memory.HostMemory.
        from rpcompile.passes.memory import host_static_bytes

        static = host_static_bytes(stages, units, sched.optimizer, journal=journal)
    elif sched.stage_workers is None:
        static = sum(s.weight_bytes + s.grad_bytes for s in stages)
        if sched.optimizer == "async":
            static += sum(s.grad_bytes for s in stages)
    else:
        static = 0 if units is None else sum(12 * u.trainable_params + 2 * u.frozen_params
                                             for u in units)
    if sched.stage_workers is None:
        # The runtime lends each download the host staging slot the schedule gives it (a
        # buffer of the slot's size: HostStaging); a schedule without slots is counted with
        # the slots this replay would give it (rpcompile.passes.staging.lend).
        sizes = sched.staging_bytes or lend(sched, timeline)[1]
        return static + sum(sizes)
    stays: list[tuple[float, float, int]] = []  # each download on the host: start, end, bytes
    last_read: dict[tuple, float] = {}
    acc_end: dict[tuple, float] = {}
    for lst in sched.actions:
        for a in lst:
            if a.kind == "H2D":
                key = (a.value, a.microbatch, a.round, a.step)
                last_read[key] = max(last_read.get(key, 0.0), timeline[a][1])
    for a in sched.host:
        if a.kind == "ACC":
            acc_end[(a.stage, a.round, a.step)] = timeline[a][1]
    for lst in sched.actions:
        for a in lst:
            if a.kind != "D2H":
                continue
            start, end = timeline[a]
            if a.what == "grad":
                free = acc_end.get((a.stage, a.round, a.step), end)
            else:
                free = max(end, last_read.get((a.value, a.microbatch, a.round, a.step), end))
            stays.append((start, free, a.bytes))
    return static + _peak([e for start, end, n in stays for e in ((start, 1, n), (end, 0, -n))])

"""Dispatch: the compute-only schedule of a plan (RoundPipe, and baselines for comparison).

Sections, in reading order:
  1. build_schedule   - the public entry
  2. RoundPipe        - jobs dealt round-robin to stateless workers from a global counter
  3. baselines        - GPipe, 1F1B, interleaved 1F1B, looped BFS, weights bound to workers
  4. dataflow         - which tensor each stage's compute reads, and from where (Flows)

The result holds compute actions (F, T, B) and ``data`` edges between them (same microbatch,
producer -> consumer). :mod:`rpcompile.passes.lower` adds transfers, optimizer work and events.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.ir import STEPS_IN_FLIGHT, Action, Edge, Flow, Plan, Schedule, Stage
from rpcompile.options import MODES, check_choice

__all__ = [
    "SCHEDULE_KINDS", "build_schedule", "cross_step_reach", "deal", "dispatch_period",
    "roundpipe_jobs", "runtime_cycle", "steady_window",
]

SCHEDULE_KINDS = ("roundpipe", "gpipe", "1f1b", "interleaved", "looped-bfs")


# --------------------------------------------------------------------------------------------
# 1. build_schedule
# --------------------------------------------------------------------------------------------


def build_schedule(
    plan: Plan | Sequence[Stage],
    workers: int,
    microbatches: int,
    rounds: int = 1,
    steps: int = 1,
    kind: str = "roundpipe",
    optimizer: str = "async",
) -> Schedule:
    """The compute-only schedule of ``plan`` on ``workers`` workers.

    ``microbatches`` per round, ``rounds`` per optimizer step (gradient accumulation), ``steps``
    optimizer steps. ``kind="roundpipe"`` needs a :class:`Plan` (forward stages, tail, backward
    stages). The baselines take any stage list (a Plan's stages are used in order, whatever their
    kind): each stage runs a forward F and a backward B, stage ``s`` bound to worker
    ``s % workers``; ``gpipe`` and ``1f1b`` need as many stages as workers, ``interleaved`` and
    ``looped-bfs`` a multiple of it (``stages // workers`` chunks per worker).
    ``optimizer`` (async|sync) is recorded for the lowering passes. A public entry point
    (``rpcompile.build_schedule``), so it checks ``optimizer`` itself
    (:func:`~rpcompile.options.check_choice`); the lowering passes read it unchecked.
    """
    if kind not in SCHEDULE_KINDS:
        raise InvalidInput(f"unknown schedule kind {kind!r}; expected one of {SCHEDULE_KINDS}")
    check_choice("optimizer", optimizer, MODES)
    for name, v in (("workers", workers), ("microbatches", microbatches), ("rounds", rounds),
                    ("steps", steps)):
        if v < 1:
            raise InvalidInput(f"{name} must be >= 1, got {v}")
    if kind == "roundpipe":
        if not isinstance(plan, Plan):
            raise InvalidType("a roundpipe schedule needs a Plan (forward stages, tail, backward)")
        plan.validate()
        return _roundpipe(plan, workers, microbatches, rounds, steps, optimizer)
    stages = tuple(plan.stages if isinstance(plan, Plan) else plan)
    seq = plan.microbatch_size * plan.seq_len if isinstance(plan, Plan) else 0
    return _baseline(kind, stages, workers, microbatches, rounds, steps, optimizer, seq)


# --------------------------------------------------------------------------------------------
# 2. RoundPipe
# --------------------------------------------------------------------------------------------


def deal(num_stages: int, workers: int, rounds: int) -> Iterator[tuple[int, int, int, int]]:
    """(worker, stage, round, step) of every job in dispatch order, step after step without
    end: THE round-robin counter (the dispatch pass and the simulator's lower bound that ranks
    the partitioner's candidates, rpcompile.planner.bound, both deal from here).

    A round's jobs are the stages in index order (F1..Fp, B1 the fused tail, B2..Bq). The
    global counter runs over (step, round, stage) and never restarts, so a round that does not
    divide evenly among the workers continues where the previous one stopped.
    """
    counter = 0
    for k in itertools.count():
        for r in range(rounds):
            for s in range(num_stages):
                yield counter % workers, s, r, k
                counter += 1


def roundpipe_jobs(num_stages: int, workers: int, rounds: int, steps: int,
                   ) -> list[tuple[int, int, int, int]]:
    """The first ``steps`` steps of :func:`deal`."""
    return list(itertools.islice(deal(num_stages, workers, rounds),
                                 num_stages * rounds * steps))


def dispatch_period(jobs_per_step: int, workers: int) -> int:
    """Steps after which round-robin dispatch gives every job of a step the same worker again.

    The counter advances ``jobs_per_step`` (stages x rounds) per step, so worker
    assignments repeat every ``workers / gcd(jobs_per_step, workers)`` steps (8 GPUs: 1 step
    when a step has a multiple of 8 jobs, 8 steps when it has an odd number). A steady state
    is periodic over this many steps, not necessarily over one.
    """
    if jobs_per_step < 1 or workers < 1:
        raise InvalidInput("jobs_per_step and workers must be >= 1")
    return workers // math.gcd(jobs_per_step, workers)


STEADY_MIN_STEPS = 8  # shortest steady-state window, in steps


def steady_window(jobs_per_step: int, workers: int) -> int:
    """Steps in a steady-state window: whole dispatch periods, at least ``STEADY_MIN_STEPS``.

    A run's timing need not repeat with the dispatch period itself: step ends can alternate
    over 2 steps while the assignment repeats every step, or cycle over 3 or 24 steps. A
    window of one period can land on a short or a long stretch. Eight steps average exactly
    over cycles that divide 8, and within about 1 % over the others measured (a 7-job
    Qwen3-1.7B plan whose timing repeats every 24 steps: -0.98 %).
    """
    period = dispatch_period(jobs_per_step, workers)
    return period * -(-STEADY_MIN_STEPS // period)


def cross_step_reach(stages: Sequence[Stage], workers: int, rounds: int = 1) -> int:
    """How many steps back an edge of a RoundPipe schedule of ``stages`` may reach: the
    lowering's waits between a worker's jobs (rpcompile.passes.lower: a weight slot two jobs
    back, ``buffer``; an input two computes back, ``window`` and ``sent``; a gradient slot
    one or two gradient jobs back, ``grad_slot`` and ``grad_pair``) run across steps, a
    shadow is read one step after it is written, and a step waits for the commit of the one
    :data:`~rpcompile.ir.STEPS_IN_FLIGHT` steps before it (``in_flight``). Worked out from
    the dealing, so it holds for any microbatch count (a job of one microbatch puts
    ``window`` two jobs back)."""
    grads = {s.index for s in stages if s.kind != "forward" and s.grad_bytes}
    period = dispatch_period(len(stages) * rounds, workers)
    jobs: list[list[int]] = [[] for _ in range(workers)]
    graded: list[list[int]] = [[] for _ in range(workers)]
    # A SHADOW of step k-1 -> the UPs of step k (async, UPs of k-1 -> SHADOW of k): one step;
    # step k's commit point -> step k+STEPS_IN_FLIGHT's first actions (in_flight): more.
    reach = max(1, STEPS_IN_FLIGHT)
    for w, s, _r, k in itertools.islice(deal(len(stages), workers, rounds),
                                        len(stages) * rounds * (4 * period + 4)):
        for mine in (jobs[w], *((graded[w],) if s in grads else ())):
            if len(mine) >= 2:
                reach = max(reach, k - mine[-2])
            mine.append(k)
    return reach


def runtime_cycle(stages: Sequence[Stage], workers: int, rounds: int = 1,
                  steps: int | None = None) -> tuple[int, int, int]:
    """``(steps, repeat_from, repeat_until)`` of the schedule a run cycles through: run step
    ``k`` runs schedule step ``k`` while ``k < repeat_until``, then steps ``repeat_from ..
    repeat_until-1`` over and over (:meth:`rpcompile.ir.Schedule.step_of`). ``repeat_from``
    is the :func:`cross_step_reach`: from there on every edge into a step reaches back only
    as far as the schedule holds, so a step run again waits for the same actions of the steps
    before it as in a longer schedule. The repeated steps are whole dispatch periods, so the
    round-robin counter goes on as in a long run. One more period is lowered after them and
    never run as such: it gives the last repeated step the waits into the step after it (a
    download's memory given back at the next step's compute, a worker's next upload landing
    before its last job's weights go) that a long run has, and the memory proof its context.
    ``steps`` (``PlanOptions.schedule_steps``): the steps lowered; from ``repeat_from`` plus
    two periods on, the repeated part is the most whole periods that leave ``repeat_from``
    steps before it and one period after it. Fewer steps give ``(steps, 0, 0)``: a run goes
    through the whole schedule again and again (run step ``k`` runs step ``k mod steps``),
    and the steps of one pass commit before the next pass starts (no edge of the schedule
    says how a step waits for the ones before it across the wrap)."""
    reach = cross_step_reach(stages, workers, rounds)
    period = dispatch_period(len(stages) * rounds, workers)
    if steps is None:
        return reach + 2 * period, reach, reach + period
    if steps < reach + 2 * period:
        return steps, 0, 0
    until = steps - period
    return steps, until - period * ((until - reach) // period), until


def _compute_kind(stage: Stage) -> str:
    return {"forward": "F", "tail": "T", "backward": "B"}[stage.kind]


def _roundpipe(plan: Plan, workers: int, microbatches: int, rounds: int, steps: int,
               optimizer: str) -> Schedule:
    per_worker: list[list[Action]] = [[] for _ in range(workers)]
    for w, s, r, k in roundpipe_jobs(len(plan.stages), workers, rounds, steps):
        ck = _compute_kind(plan.stages[s])
        per_worker[w].extend(Action(w, ck, s, m, r, k) for m in range(microbatches))
    flows = roundpipe_flows(plan)
    sched = Schedule(
        kind="roundpipe", workers=workers, microbatches=microbatches, rounds=rounds,
        steps=steps, optimizer=optimizer,
        stage_names=tuple(plan.stage_name(s.index) for s in plan.stages),
        stage_units=tuple((s.units[0], s.units[-1]) for s in plan.stages),
        flows=flows, actions=tuple(tuple(lst) for lst in per_worker),
    )
    return sched.replace(edges=tuple(data_edges(sched)))


# --------------------------------------------------------------------------------------------
# 3. baselines (weights bound to workers)
# --------------------------------------------------------------------------------------------


def _baseline(kind: str, stages: tuple[Stage, ...], workers: int, microbatches: int,
              rounds: int, steps: int, optimizer: str, tokens_per_microbatch: int) -> Schedule:
    n = len(stages)
    if kind in ("gpipe", "1f1b") and n != workers:
        raise InvalidInput(f"{kind} needs one stage per worker: got {n} stages for {workers} workers")
    if n % workers or n == 0:
        raise InvalidInput(f"{kind} needs a multiple of {workers} stages (one chunk per worker "
                         f"and loop), got {n}")
    chunks = n // workers
    if kind == "interleaved" and microbatches % workers:
        raise InvalidInput(f"interleaved 1F1B needs microbatches divisible by workers "
                         f"({microbatches} % {workers} != 0); choose M = a multiple of {workers}")
    order_fn = {"gpipe": _gpipe_order, "1f1b": _1f1b_order, "interleaved": _interleaved_order,
                "looped-bfs": _looped_bfs_order}[kind]
    per_worker: list[list[Action]] = [[] for _ in range(workers)]
    for k in range(steps):
        for r in range(rounds):
            for w in range(workers):
                for ck, s, m in order_fn(w, workers, chunks, microbatches):
                    per_worker[w].append(Action(w, ck, s, m, r, k))
    sched = Schedule(
        kind=kind, workers=workers, microbatches=microbatches, rounds=rounds, steps=steps,
        optimizer=optimizer, stage_names=tuple(f"S{s + 1}" for s in range(n)),
        stage_units=tuple((st.units[0], st.units[-1]) for st in stages),
        flows=baseline_flows(stages, tokens_per_microbatch),
        actions=tuple(tuple(lst) for lst in per_worker),
        stage_workers=tuple(s % workers for s in range(n)),
    )
    return sched.replace(edges=tuple(data_edges(sched)))


def _gpipe_order(w: int, g: int, chunks: int, m: int) -> list[tuple[str, int, int]]:
    """All forwards, then all backwards, microbatches in order."""
    return [("F", w, i) for i in range(m)] + [("B", w, i) for i in range(m)]


def _1f1b_order(w: int, g: int, chunks: int, m: int) -> list[tuple[str, int, int]]:
    """Warm up with (g - w - 1) forwards, then alternate one forward and one backward, then
    drain the remaining backwards (PipeDream-flush)."""
    warm = min(g - w - 1, m)
    out = [("F", w, i) for i in range(warm)]
    for j in range(m - warm):
        out += [("F", w, warm + j), ("B", w, j)]
    out += [("B", w, i) for i in range(m - warm, m)]
    return out


def _interleaved_order(w: int, g: int, chunks: int, m: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Megatron-LM): a worker holds ``chunks`` stages w, w+g, ...; microbatches
    go through the chunks in groups of g. Virtual forward i runs chunk (i // g) % chunks on
    microbatch (i // (g*chunks))*g + i % g; backwards visit the chunks in reverse."""
    total = m * chunks

    def fwd(i: int) -> tuple[str, int, int]:
        c = (i // g) % chunks
        return ("F", c * g + w, (i // (g * chunks)) * g + i % g)

    def bwd(i: int) -> tuple[str, int, int]:
        c = chunks - 1 - (i // g) % chunks
        return ("B", c * g + w, (i // (g * chunks)) * g + i % g)

    warm = min((g - w - 1) * 2 + (chunks - 1) * g, total)
    out = [fwd(i) for i in range(warm)]
    for j in range(total - warm):
        out += [fwd(warm + j), bwd(j)]
    out += [bwd(i) for i in range(total - warm, total)]
    return out


def _looped_bfs_order(w: int, g: int, chunks: int, m: int) -> list[tuple[str, int, int]]:
    """Breadth-first: each chunk runs all microbatches forward, chunks in order; then each
    chunk all microbatches backward, chunks in reverse."""
    out = [("F", c * g + w, i) for c in range(chunks) for i in range(m)]
    out += [("B", c * g + w, i) for c in reversed(range(chunks)) for i in range(m)]
    return out


# --------------------------------------------------------------------------------------------
# 4. dataflow
# --------------------------------------------------------------------------------------------


def _ids_bytes(tokens: int) -> int:
    return tokens * 8  # int64 token ids


def roundpipe_flows(plan: Plan) -> tuple[Flow, ...]:
    """What each stage's compute reads per microbatch.

    Forward stage i reads the activation after its predecessor's last unit (F1: the ids). The
    tail reads the last forward activation and the labels. A backward stage covering units
    a..b reads the gradient after unit b from the previous backward stage and, to recompute,
    its saved input: the activation after unit a-1, produced by the forward stage holding
    unit a-1 (the ids if a == 0).

    Sizes come from the Stage fields: an activation into a forward stage or the tail is the
    consumer's ``input_bytes``; an input gradient is its producer's ``output_bytes`` (what a
    backward stage or the tail sends on); a saved input is the rest of the backward consumer's
    ``input_bytes``. The batch lives on the host: a stage's one host upload (``ids``; the
    tail's is ``labels`` unless it starts at unit 0) carries every batch input its program
    reads (``Stage.batch_inputs``: input_ids, an attention mask, labels, num_items_in_batch,
    dropout seeds), and a stage after the first that reads one gets an ``ids`` upload too. For
    a stage that does not say (a profile built by hand), ids and labels are int64 tokens.
    """
    tokens = _ids_bytes(plan.microbatch_size * plan.seq_len)
    fwd = plan.forward_stages
    owner = {u: s.index for s in fwd for u in s.units}
    flows: list[Flow] = []
    for s in plan.stages:
        ck = _compute_kind(s)
        first, last = s.units[0], s.units[-1]
        batch = None if s.batch_inputs is None else sum(n for _, n in s.batch_inputs)
        if s.kind in ("forward", "tail"):
            if first == 0 or (s.kind == "forward" and batch):
                flows.append(Flow("ids", "act", None, None, ck, s.index,
                                  (s.input_bytes or tokens) if batch is None else batch))
            if first > 0:
                flows.append(Flow(f"x{first - 1}", "act", "F", owner[first - 1], ck, s.index,
                                  s.input_bytes))
            if s.kind == "tail" and (first > 0 or batch is None):
                flows.append(Flow("labels", "act", None, None, ck, s.index,
                                  tokens if batch is None else batch))
            continue
        prev = plan.stages[s.index - 1]
        flows.append(Flow(f"g{last}", "igrad", _compute_kind(prev), prev.index, ck, s.index,
                          prev.output_bytes))
        if first == 0 or batch:
            flows.append(Flow("ids", "save", None, None, ck, s.index,
                              tokens if batch is None else batch))
        if first > 0:
            flows.append(Flow(f"x{first - 1}", "save", "F", owner[first - 1], ck, s.index,
                              max(s.input_bytes - prev.output_bytes, 0)))
    return tuple(flows)


def baseline_flows(stages: Sequence[Stage], tokens_per_microbatch: int) -> tuple[Flow, ...]:
    """Pipeline stage s: F reads the previous stage's activation (stage 0: ids; the last stage
    also the labels for its loss); B reads the next stage's input gradient and the activations
    its own F stashed on the same worker (``stash<s>``, never transferred)."""
    tokens = _ids_bytes(tokens_per_microbatch)
    n = len(stages)
    flows: list[Flow] = []
    for s, st in enumerate(stages):
        if s == 0:
            flows.append(Flow("ids", "act", None, None, "F", s, st.input_bytes or tokens))
        else:
            flows.append(Flow(f"x{stages[s - 1].units[-1]}", "act", "F", s - 1, "F", s,
                              st.input_bytes))
        if s == n - 1:
            flows.append(Flow("labels", "act", None, None, "F", s, tokens))
        else:
            flows.append(Flow(f"g{st.units[-1]}", "igrad", "B", s + 1, "B", s,
                              stages[s + 1].input_bytes))
        flows.append(Flow(f"stash{s}", "save", "F", s, "B", s, 0))
    return tuple(flows)


def data_edges(sched: Schedule) -> list[Edge]:
    """A ``data`` edge from each producing compute to each consuming compute of the same
    microbatch, round and step (host-resident inputs need none)."""
    where: dict[tuple[str, int, int | None, int | None, int], Action] = {}
    for lst in sched.actions:
        for a in lst:
            if a.is_compute:
                where[(a.kind, a.stage, a.microbatch, a.round, a.step)] = a
    by_dst: dict[tuple[str, int], list[Flow]] = {}
    for f in sched.flows:
        if not f.from_host:
            by_dst.setdefault((f.dst_kind, f.dst_stage), []).append(f)
    edges = []
    for lst in sched.actions:
        for a in lst:
            for f in by_dst.get((a.kind, a.stage), ()) if a.is_compute else ():
                src = where[(f.src_kind, f.src_stage, a.microbatch, a.round, a.step)]
                edges.append(Edge(src, a, "data"))
    return edges

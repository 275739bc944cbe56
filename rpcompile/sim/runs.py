"""One-call simulations: plan or units in, SimResult out (dispatch, lowering and replay).

These are what the benchmarks and the CLI use to predict a configuration:

  * :func:`simulate_roundpipe` - a RoundPipe plan, ``steps`` optimizer steps;
  * :func:`simulate_pipeline`  - a weight-bound baseline (GPipe, 1F1B, interleaved, looped
    BFS) over per-unit profiles, stages cut by :func:`~rpcompile.sim.baselines.pipeline_stages`;
  * :func:`steady_steps`, :func:`steady_utilization`, :func:`steady_step_ms` - a multi-step
    run in steady state: how long to run it, and its figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, Schedule, UnitProfile
from rpcompile.passes.lower import lower
from rpcompile.passes.schedule import build_schedule, steady_window
from rpcompile.sim.baselines import pipeline_stages
from rpcompile.sim.engine import busy_split, makespan_of, replay_timeline, simulate
from rpcompile.sim.result import SimResult

__all__ = [
    "search_figures", "simulate_pipeline", "simulate_roundpipe", "steady_step_ms",
    "steady_steps", "steady_utilization",
]


def simulate_roundpipe(plan: Plan, hardware: Hardware | str, *, steps: int = 1,
                       optimizer: str = "async", rounds: int = 1,
                       workers: int | None = None, microbatches: int | None = None,
                       validate: bool = False, ranks: int = 1,
                       sharded: bool = False) -> SimResult:
    """Dispatch ``plan`` round-robin (``workers`` and ``microbatches`` default to the plan's),
    lower it with every pass and replay it. ``validate`` runs the validator after each pass
    (slower; the lowering is tested elsewhere). ``ranks`` > 1: one of that many servers
    training data parallel, its gradients reduced by REDUCE actions on ``hardware.link``
    (:func:`~rpcompile.passes.lower.add_reductions`; sync updates deferred); ``sharded``:
    their host state sharded (``shard_optimizer``, sync mode): each REDUCE a reduce to the
    gradients' owners, each SHADOW also broadcasting the updated shadows."""
    if sharded and optimizer != "sync":
        raise InvalidInput("a sharded run (shard_optimizer) updates in sync mode: pass "
                         "optimizer='sync'")
    hw = get_hardware(hardware)
    sched = build_schedule(plan, workers or plan.workers, microbatches or plan.microbatches,
                           rounds=rounds, steps=steps, kind="roundpipe", optimizer=optimizer)
    lowered, _ = lower(sched, plan, validate=validate, ranks=ranks)
    if sharded and ranks > 1:
        lowered = lowered.replace(sharded=True)
    return simulate(lowered, plan, hw)


def simulate_pipeline(units: Sequence[UnitProfile], hardware: Hardware | str, kind: str, *,
                      workers: int, microbatches: int, chunks: int = 1, rounds: int = 1,
                      tokens_per_microbatch: int = 0, recompute: bool = True,
                      validate: bool = False) -> SimResult:
    """A weight-bound baseline: ``workers * chunks`` stages (``chunks`` > 1 for interleaved
    and looped BFS), activations between workers through host memory, no optimizer work (the
    weights and gradients stay on the GPUs)."""
    stages = pipeline_stages(units, workers * chunks)
    sched = build_schedule(stages, workers, microbatches, rounds=rounds, kind=kind)
    lowered, _ = lower(sched, stages, validate=validate)
    return simulate(lowered, stages, hardware, units=units, recompute=recompute,
                    tokens_per_microbatch=tokens_per_microbatch)


def steady_steps(plan: Plan, workers: int | None = None, rounds: int = 1) -> int:
    """How many async steps to simulate for a steady-state figure of ``plan``: two warm-up
    steps, one :func:`~rpcompile.passes.schedule.steady_window` (whole dispatch periods, at
    least 8 steps), and the step whose start closes the window: 11 steps on 8 GPUs."""
    return steady_window(len(plan.stages) * rounds, workers or plan.workers) + 3


def _no_window(steps: int, warmup_steps: int | None) -> None:
    """A run of fewer than 3 steps has no steady-state window to skip a warm-up in."""
    if warmup_steps is not None:
        raise InvalidInput(f"a {steps}-step run has no steady-state window; "
                         "simulate 3 steps or more (see steady_steps)")


def steady_utilization(result: SimResult, warmup_steps: int | None = None) -> float:
    """Fraction of GPU time spent computing once the run is in steady state: compute time
    inside the window from the start of step ``warmup_steps`` (counting from 0: the steps
    before it are skipped) to the start of the last step, over the window times the
    workers; a step starts with its first compute, so both ends sit at the same point of
    the dispatch cycle. ``warmup_steps`` defaults to 2, or 1 for runs of 3 or 4 steps. Runs
    of fewer than 3 steps give the whole run's utilization (and take no ``warmup_steps``)."""
    return _utilization(result.schedule, result.timeline, result.makespan_ms, warmup_steps)


def _utilization(sched, tl, makespan: float, warmup_steps: int | None) -> float:
    computes = [a for lst in sched.actions for a in lst if a.is_compute]
    if sched.steps < 3:
        _no_window(sched.steps, warmup_steps)
        lo, hi = 0.0, makespan
    else:
        if warmup_steps is None:
            warmup_steps = 1 if sched.steps <= 4 else 2
        if not 1 <= warmup_steps <= sched.steps - 2:
            raise InvalidInput(f"warmup_steps must be in 1..{sched.steps - 2} for a "
                             f"{sched.steps}-step run, got {warmup_steps}")
        first = {}
        for a in computes:
            first[a.step] = min(first.get(a.step, float("inf")), tl[a][0])
        lo, hi = first[warmup_steps], first[sched.steps - 1]
    if hi <= lo:
        raise InvalidInput("no steady-state window: the last step started before the warm-up "
                         "ended; simulate more steps")
    busy = sum(max(0.0, min(tl[a][1], hi) - max(tl[a][0], lo)) for a in computes)
    return busy / ((hi - lo) * sched.workers)


def steady_step_ms(result: SimResult, warmup_steps: int | None = None) -> float:
    """Time per optimizer step in steady state: one step's compute spread over the workers at
    the :func:`steady_utilization` rate. (Spacings of step ends are noisy when a step's jobs do
    not divide evenly among the workers.) With fewer than 3 steps, the makespan per step."""
    return _step_ms(result.schedule, result.timeline, result.busy_ms, result.makespan_ms,
                    warmup_steps)


def _step_ms(sched, tl, busy: Sequence[float], makespan: float,
             warmup_steps: int | None) -> float:
    if sched.steps < 3:
        _no_window(sched.steps, warmup_steps)
        return makespan / sched.steps
    work = sum(busy) / sched.steps
    return work / (sched.workers * _utilization(sched, tl, makespan, warmup_steps))


def search_figures(schedule: Schedule, plan: Plan, hardware: Hardware | str,
                   ) -> tuple[float, float]:
    """(the figure the partitioner minimises, its bubble) for a lowered RoundPipe schedule,
    from a replay without the measures it does not read (rpcompile.sim.engine
    .replay_timeline): a sync schedule's makespan and :attr:`SimResult.bubble`; an async
    run's :func:`steady_step_ms` and ``1 -`` :func:`steady_utilization`. Equal to those of
    :func:`~rpcompile.sim.simulate`'s result bit for bit (the same sums, in the same order)."""
    tl = replay_timeline(schedule, plan, hardware)
    makespan = makespan_of(tl)
    busy, fill, drain, steady = busy_split(schedule, tl, makespan)
    if schedule.optimizer == "sync":
        denom = makespan * schedule.workers if makespan > 0 else 1.0
        return makespan, (fill + drain + steady) / denom
    return (_step_ms(schedule, tl, busy, makespan, None),
            1.0 - _utilization(schedule, tl, makespan, None))

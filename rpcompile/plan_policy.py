"""What ``rpcompile plan`` plans for when the user leaves it open: the default batch (the
sequences per microbatch double while the simulated tokens/s rises), the longest sequence a
compiled model's plan options fit, and the shares of idle time past which a plan is called
too small for its workers or paced by one stage. Python users get the same choices as the
command line."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["DEFAULT_BATCH_GAIN", "DEFAULT_BATCH_LARGEST", "FILL_DRAIN_LIMIT", "IDLE_LIMIT",
           "TRIAL_SIMULATIONS", "BatchChoice", "SlowestStage", "WorkerUse", "default_batch",
           "longest_sequence", "worker_use"]


# The default batch (``plan`` without ``--batch``): the sequences per microbatch double from
# 1 while a doubling raises the simulated tokens/s by more than DEFAULT_BATCH_GAIN, up to
# DEFAULT_BATCH_LARGEST, and only while the plan fits the GPUs and adds no host memory beyond
# the RAM. Each trial is a partition search capped at TRIAL_SIMULATIONS replays, without the
# async boundary refinement (about the same replay time in both modes: an async replay is a
# dozen steps); the batch picked is then planned with the full search, which is at least as
# fast as its trial.
DEFAULT_BATCH_GAIN = 0.05
DEFAULT_BATCH_LARGEST = 64
TRIAL_SIMULATIONS = {"sync": 16, "async": 4}
# A step whose fill and drain idle more than this share of the workers' time: the batch is
# too small for the workers.
FILL_DRAIN_LIMIT = 0.30
# A step whose workers idle more than this share of their time (fill, drain and the steady
# part together) says so, and what paces it.
IDLE_LIMIT = 0.30


@dataclass
class BatchChoice:
    """How ``plan`` chose the batch: per trial (sequences per microbatch, simulated tokens/s
    or None, why the doubling stopped there or ''), and the size picked."""

    size: int
    trials: list = field(default_factory=list)
    cap: int = 0

    def describe(self) -> str:
        parts, last = [], None
        for b, tps, why in self.trials:
            fig = "no plan" if tps is None else f"{tps:,.0f} tokens/s"
            if tps is not None and last is not None:
                fig += f" ({tps / last - 1:+.1%})"
            parts.append(f"{b}: {fig}" + (f", {why}" if why else ""))
            last = tps if tps is not None else last
        return (f"picked by doubling the sequences per microbatch while the simulated tokens/s "
                f"rises more than {DEFAULT_BATCH_GAIN:.0%} (searches capped at {self.cap} "
                f"replays): " + "; ".join(parts))

    def to_dict(self) -> dict:
        return {"microbatch_size": self.size, "gain": DEFAULT_BATCH_GAIN,
                "trial_max_simulations": self.cap,
                "trials": [{"microbatch_size": b, "tokens_per_s": tps, "stopped": why}
                           for b, tps, why in self.trials]}


def default_batch(compiled, hw, ram_bytes: int, compile_at) -> BatchChoice:
    """The default batch's sequences per microbatch (the rule above), from ``compiled`` (the
    smallest batch, one sequence per microbatch, compiled with the trials' replay cap). Trials
    plan the captured model at each size (rpcompile.planner.partition) with the compile's own
    plan options (``compiled.options.plan``: workers, microbatches, rounds, mode, recompute,
    the cap); when the whole logits no longer fit, ``compile_at(size)`` compiles that size
    (which chunks the loss) and later trials reuse its capture."""
    from rpcompile.compiler import unit_profiles
    from rpcompile.passes.memory import host_memory
    from rpcompile.planner.partition import PartitionError, StageCosting, partition
    from rpcompile.sim import simulate_roundpipe

    po = compiled.options.plan
    micro, rounds, optimizer = po.microbatches_per_round, po.rounds, po.mode
    dtype_bytes = compiled.compute_dtype.itemsize
    costing = StageCosting(weight_dtype_bytes=dtype_bytes, act_dtype_bytes=dtype_bytes)
    seq = compiled.plan.seq_len
    source = compiled

    def trial(b: int):
        profiles = unit_profiles(source.capture, source.unit_costs, b, seq, hw, dtype_bytes)
        plan = partition(profiles, hw, microbatch_size=b, seq_len=seq, costing=costing,
                         options=po, refine=0)
        run = simulate_roundpipe(plan, hw, steps=1, rounds=rounds, optimizer=optimizer)
        host = host_memory(plan, optimizer, run.peak_host_bytes, journal=hw.undo_journal,
                           pageable=hw.host_memory == "pageable").total
        return b * micro * rounds * seq * 1e3 / plan.predicted_step_ms, host

    choice = BatchChoice(size=1, cap=po.max_simulations)
    tps, host_limit = trial(1)
    host_limit = max(host_limit, ram_bytes)  # the smallest batch's need is printed anyway
    choice.trials.append((1, tps, ""))
    b = 2
    while b <= DEFAULT_BATCH_LARGEST:
        try:
            got, host = trial(b)
        except PartitionError:
            if source.capture.loss_chunk_tokens is not None:
                choice.trials.append((b, None, "no plan fits the GPUs"))
                break
            try:  # the whole logits are too large at this size: let compile chunk the loss
                source = compile_at(b)
                got, host = trial(b)
            except ValueError:  # PartitionError, MemoryPlanError: nothing fits
                choice.trials.append((b, None, "no plan fits the GPUs"))
                break
        if host > host_limit:
            choice.trials.append((b, got, "its host memory exceeds the RAM"))
            break
        if got <= tps * (1 + DEFAULT_BATCH_GAIN):
            choice.trials.append((b, got, f"not over {DEFAULT_BATCH_GAIN:.0%}"))
            break
        choice.trials.append((b, got, ""))
        choice.size, tps = b, got
        b *= 2
    else:
        choice.trials[-1] = (*choice.trials[-1][:2], f"the cap of {DEFAULT_BATCH_LARGEST}")
    return choice


def longest_sequence(compiled, hw, microbatch_size: int | None = None,
                     ram: tuple[int, str] = (0, "")):
    """The longest sequence for which some plan fits (rpcompile.planner.longest) with the
    compile's plan options (``compiled.options.plan``: workers, microbatches, rounds, mode),
    at ``microbatch_size`` sequences per microbatch (default: the plan's), searched from the
    plan's length up to the model's ``max_position_embeddings`` to a multiple of 64 tokens;
    ``ram``: (bytes, source) of the host RAM its host memory must fit (0: not checked)."""
    from rpcompile.compiler import unit_profiles
    from rpcompile.planner import longest
    from rpcompile.planner.partition import StageCosting

    b = microbatch_size or compiled.plan.microbatch_size
    dtype_bytes = compiled.compute_dtype.itemsize
    costing = StageCosting(weight_dtype_bytes=dtype_bytes, act_dtype_bytes=dtype_bytes)
    limit = getattr(getattr(compiled.model, "config", None), "max_position_embeddings", None)
    limit = int(limit or 1 << 20)
    start = min(compiled.plan.seq_len, limit)
    return longest.longest_sequence(
        lambda s: unit_profiles(compiled.capture, compiled.unit_costs, b, s, hw, dtype_bytes),
        hw, microbatch_size=b, costing=costing, options=compiled.options.plan, start=start,
        step=min(64, start), limit=limit, host_ram_bytes=ram[0], host_ram_source=ram[1])


@dataclass(frozen=True)
class SlowestStage:
    """The stage that paces a step whose workers idle more than :data:`IDLE_LIMIT` of it
    though fill and drain do not dominate: a round's microbatches pass it one after another on
    its worker while the stages after it wait on its pace. ``bound_ms`` is a critical path of
    the plan's stage times alone (no transfer, no wait): the first microbatch through every
    stage before it (``before_ms``), all of them through it, the last through every stage
    after it (``after_ms``)."""

    name: str
    units: str  # its one unit's name, or "N units"
    one_unit: bool
    ms_per_microbatch: float
    median_ms_per_microbatch: float
    before_ms: float
    after_ms: float
    bound_ms: float


@dataclass(frozen=True)
class WorkerUse:
    """How a plan's step uses the workers: ``jobs`` a step for ``gpus`` workers (round robin
    gives an idle worker a job every ``dispatch_period`` steps), the idle time (``bubble``) and
    fill and drain as shares of the step, and what the figures call for. ``too_small``: fill and drain are over
    :data:`FILL_DRAIN_LIMIT`; ``microbatches_to_fill``: a round's microbatches that would bring
    the working workers' share under it (None where the idle workers are the bubble, which
    more microbatches do not give a job). ``slowest``: the stage that paces a step that is not
    too small but idles over :data:`IDLE_LIMIT`."""

    jobs: int
    gpus: int
    dispatch_period: int
    bubble: float
    fill_drain: float
    too_small: bool
    microbatches_to_fill: int | None
    slowest: SlowestStage | None


def worker_use(plan, gpus: int, micro: int, rounds: int, bubble: float,
               fill_drain: float) -> WorkerUse:
    """:class:`WorkerUse` of ``plan`` on ``gpus`` workers at ``micro`` microbatches a round and
    ``rounds`` rounds, from its simulated step's ``bubble`` and ``fill_drain`` (shares of the
    workers' time)."""
    from rpcompile.passes.schedule import dispatch_period

    jobs = len(plan.stages) * rounds
    period = dispatch_period(jobs, gpus)
    if fill_drain <= FILL_DRAIN_LIMIT:
        slowest = _slowest_stage(plan, micro) if bubble > IDLE_LIMIT else None
        return WorkerUse(jobs, gpus, period, bubble, fill_drain, False, None, slowest)
    # An estimate from this plan's stage times: fill and drain stay as they are while the
    # steady part grows with the microbatches a round, so k times the microbatches bring the
    # working workers' share under the limit (an idle worker's step is all fill; more
    # microbatches do not give it a job).
    busy = min(jobs, gpus)
    active = max(0.0, fill_drain * gpus - (gpus - busy)) / busy
    if active <= FILL_DRAIN_LIMIT:  # the idle workers are the bubble
        return WorkerUse(jobs, gpus, period, bubble, fill_drain, True, None, None)
    k = active * (1 - FILL_DRAIN_LIMIT) / (FILL_DRAIN_LIMIT * (1 - active))
    fills = max(micro + 1, math.ceil(micro * k))
    return WorkerUse(jobs, gpus, period, bubble, fill_drain, True, fills, None)


def _slowest_stage(plan, micro: int) -> SlowestStage | None:
    """The :class:`SlowestStage` of ``plan`` (None when no stage has a time to name a pace
    by)."""
    times = [s.compute_ms for s in plan.stages]
    if not any(t > 0 for t in times):
        return None
    k = max(range(len(times)), key=times.__getitem__)
    slow = plan.stages[k]
    before, after = sum(times[:k]), sum(times[k + 1:])
    units = plan.units[slow.units[0]].name if len(slow.units) == 1 else \
        f"{len(slow.units)} units"
    return SlowestStage(name=plan.stage_name(k), units=units, one_unit=len(slow.units) == 1,
                        ms_per_microbatch=times[k],
                        median_ms_per_microbatch=statistics.median(t for t in times if t > 0),
                        before_ms=before, after_ms=after,
                        bound_ms=before + micro * times[k] + after)

"""What ``rpcompile plan`` plans for when the user leaves it open: the default batch (the
sequences per microbatch double while the simulated tokens/s rises), the longest sequence a
compiled model's plan options fit, and the shares of idle time past which a plan is called
too small for its workers or paced by one stage. Python users get the same choices as the
command line."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_BATCH_GAIN", "DEFAULT_BATCH_LARGEST", "FILL_DRAIN_LIMIT", "IDLE_LIMIT",
           "TRIAL_SIMULATIONS", "BatchChoice", "default_batch", "longest_sequence"]


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


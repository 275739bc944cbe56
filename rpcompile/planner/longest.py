"""The longest sequence that fits: the longest length at which some plan's whole schedule fits
the GPUs and the host RAM.

Whether a length fits is a memory question, so the search asks only that: first the GPUs',
with one proof per trial length and no timing replay, then the host's (below). At each length
it builds the plan that holds least device
memory, :func:`memory_first_plan`: every unit its own forward stage and its own backward stage,
the fused tail the last unit alone, every memory-bounding wait of the lowering in place. A
job's weights (twice, for the prefetch), its fp32 gradients and one microbatch's working set
are then the smallest any cut gives: a backward stage of one unit recomputes no more than
layer-by-layer recompute would, and more waits only shorten what the schedule holds
(rpcompile.passes.memory). Only the values a worker holds (boundary activations and their
gradients) grow with the number of cuts, so a coarser plan may fit a little longer where
values make up the peak. The proof
(:func:`rpcompile.passes.memory.worker_peaks`) runs over the steps the runtime cycles through
(every alignment of jobs to workers, each step overlapping the one before, as a run overlaps
them), the proof of the runtime's schedule (``Compiled.memory``).

So a length reported as fitting has a plan, returned with its proven peaks, whose whole
lowered schedule fits the GPUs. Searching: doubling from ``start`` while the length fits, then
bisecting between the last length that fits and the first that does not until they are
``step`` tokens apart (the lengths tried are ``start`` doubled and midpoints, so a multiple of
``step`` only when ``start`` is). The limit named at the first length that does not fit is a unit whose stage
alone is too large (no schedule can help), or the worker, action and memory parts at the peak
of the memory-first plan's proof. The search is not exhaustive over plans: the length it
reports is proven for the plan it returns, and the limit named is that plan's.

Host RAM grows with the length too: every boundary activation of every microbatch is staged
on the host (pinned) from its forward until its backward reads it. When a RAM figure is given
(``host_ram_bytes``: ``rpcompile plan --host-ram``, else the profile's ``host_ram_gib``), the
schedule at the GPUs' longest length is replayed once for its host memory
(:func:`host_need`: the static buffers plus the simulated transfer staging, the figure
``compile()`` checks as ``Compiled.host``). If that exceeds the RAM, the static part (the same
at every length) is compared first: over the RAM, no length fits, and the answer says so with
its parts. Otherwise the lengths below are bisected with both checks, one proof and one
replay per trial, and the limit reads ``host RAM: need X of Y RAM (source)`` with the parts.
The host memory is not monotone in the length (the transfer staging is what a replay holds at
once, and the overlaps move with the stage times): a length reported fits both, but a longer
one between it and the GPUs' length may fit too, and when ``start`` itself is over the RAM
the next lengths (``step`` apart, up to 32) are tried before no length is reported;
the GPUs' own answer is kept (``LongestSequence.gpu``, with the host memory it would need) for
a user with more RAM. The memory-first plan stages the most activations on the host (one per
unit): a host-limited length is that plan's, and a coarser plan that fits the GPUs stages
fewer, so it may fit a longer one within the same RAM. Without a RAM figure the host memory
at the length found is still computed and reported, not checked.

The memory-first plan is slow (many short jobs, one activation hop per layer); run the
partitioner at the length found for the fastest plan that fits (``rpcompile plan --seq``).
``rpcompile plan --longest`` and ``benchmarks/longest_sequence.py`` print the search.

The caller gives the unit profiles at a sequence length (``units_at``): a compiled model's
cost model (rpcompile.compiler.unit_profiles), or the paper models' shapes
(rpcompile.workloads.paper.PaperModel.units). Memory grows with the sequence length, so the
lengths that fit form a prefix and the search finds its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rpcompile.errors import InvalidInput, InvalidType
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import HostMemory, format_bytes, host_memory, worker_peaks
from rpcompile.passes.schedule import dispatch_period
from rpcompile.planner.partition import (
    StageCosting,
    memory_first_plan,
    proof_schedule,
    proof_steps,
    proven_peaks,
)

__all__ = ["LongestSequence", "host_need", "longest_sequence", "memory_first_plan",
           "proof_steps", "proven_peaks"]


@dataclass(frozen=True)
class LongestSequence:
    """``seq_len``: the longest length found to fit (0: not even ``start``), ``plan`` the
    memory-first plan at that length with its proven ``worker_peak_bytes`` (None when nothing
    fits), ``next_len`` the shortest length found not to fit (None: everything up to
    ``limit`` fits), ``why``: what does not fit there, and ``proofs``: how many schedules
    were lowered and proven, ``replays`` how many were replayed for their host memory.

    Host RAM: ``host`` is the host memory of ``plan``'s schedule at ``seq_len``
    (rpcompile.passes.memory.HostMemory, its transfer staging from a replay; None when
    nothing fits), checked against ``host_ram`` bytes (0: not known, not checked; from
    ``host_ram_source``). When the RAM is what binds, ``gpu`` is the search's answer for the
    GPUs alone (its ``host`` the host memory that length needs), so a user with more RAM
    sees what the GPUs allow; None when the GPUs bind (or no RAM was given)."""

    seq_len: int
    plan: Plan | None
    next_len: int | None
    why: str
    proofs: int = 0
    replays: int = 0
    host: HostMemory | None = None
    host_ram: int = 0
    host_ram_source: str = ""
    gpu: LongestSequence | None = None

    @property
    def limit(self) -> str:
        """What limits the length: ``"host RAM"`` or ``"GPU memory"`` ('' when nothing up
        to the search limit was refused)."""
        if self.next_len is None:
            return ""
        return "host RAM" if self.why.startswith("host RAM") else "GPU memory"

    def describe(self) -> str:
        if self.next_len is None:
            out = f"{self.seq_len:,} tokens (the search limit; {self.why})"
        else:
            out = f"{self.seq_len:,} tokens; at {self.next_len:,} tokens: {self.why}"
        if self.gpu is not None:
            out += f"; the GPUs alone: {self.gpu.describe()}"
            if self.gpu.host is not None:
                out += (f", which needs {format_bytes(self.gpu.host.total)} of host memory "
                        f"at {self.gpu.seq_len:,} tokens")
        return out

    def host_line(self) -> str:
        """The host memory at ``seq_len`` against the RAM, one line."""
        if self.host is None:
            return "host memory: no length fits, none computed"
        ram = (f"of {format_bytes(self.host_ram)} RAM ({self.host_ram_source})"
               if self.host_ram else "(host RAM unknown: not checked)")
        return f"host memory at {self.seq_len:,} tokens: {self.host.describe()} {ram}"


def _alone(plan: Plan, capacity: int) -> str:
    """Why a stage of the memory-first plan cannot fit even alone ('' when each does)."""
    worst = max(plan.stages, key=lambda s: s.peak_bytes)
    if worst.peak_bytes <= capacity:
        return ""
    names = ", ".join(repr(plan.units[u].name) for u in worst.units)
    return (f"unit {names} alone needs {format_bytes(worst.peak_bytes)} of device memory as "
            f"a {worst.kind} stage (weights twice for prefetch, its gradients in fp32 and in "
            f"the compute dtype, and one microbatch's working set) but the GPU has "
            f"{format_bytes(capacity)} usable")


def host_need(plan: Plan, hardware: Hardware | str, rounds: int = 1,
              optimizer: str = "async", sched=None) -> HostMemory:
    """The host memory of ``plan``'s schedule (``sched``, default the runtime's,
    :func:`~rpcompile.passes.lower.runtime_schedule`, whose repeated steps its staging slots
    follow): its static buffers and the transfer staging, the slots one simulated run of it
    gives, with the undo journal as ``hardware.undo_journal`` says; the figure ``compile()``
    checks (``Compiled.host``)."""
    from rpcompile.passes.lower import runtime_schedule
    from rpcompile.sim import simulate

    hw = get_hardware(hardware)
    if sched is None:
        sched = runtime_schedule(plan, PlanOptions(gpus=plan.workers,
                                                   microbatches=plan.microbatches,
                                                   rounds=rounds, mode=optimizer))
    return host_memory(plan, optimizer, simulate(sched, plan, hw).peak_host_bytes,
                       journal=hw.undo_journal, pageable=hw.host_memory == "pageable")


def longest_sequence(
    units_at: Callable[[int], Sequence[UnitProfile]],
    hardware: Hardware | str,
    options: PlanOptions,
    *,
    microbatch_size: int = 1,
    costing: StageCosting | None = None,
    start: int = 2048,
    step: int = 1024,
    limit: int = 1 << 20,
    host_ram_bytes: int = 0,
    host_ram_source: str = "host_ram_bytes",
) -> LongestSequence:
    """The longest sequence (between ``start`` and ``limit``, found to within ``step`` tokens) at which
    the memory-first plan (:func:`memory_first_plan`) for the options' workers and
    microbatches (of ``microbatch_size`` sequences) and rounds has a whole lowered schedule,
    in the options' mode, whose proven peak fits ``capacity_bytes`` (default: the
    hardware's usable memory) and whose host memory (:func:`host_need`) fits
    ``host_ram_bytes`` (0: not checked; ``host_ram_source`` says where the figure came
    from).

    The GPUs are searched first, one proof per trial length. At the longest length they
    allow, the schedule is replayed once for its host memory; when that exceeds the RAM, the
    static part alone (masters, optimizer state, gradients, shadows, the module's copy, the
    journal: the same at every length) is compared first (over it: no length fits, and the
    answer says so), then the lengths below are bisected with both checks. The result keeps
    the GPUs' own answer (``gpu``) when the RAM binds.

    ``options``: the :class:`~rpcompile.options.PlanOptions` it plans for (``gpus``,
    ``microbatches_per_round``, ``rounds``, ``mode``, ``capacity_bytes``; what ``rpcompile
    plan`` passes: its compile's)."""
    if not isinstance(options, PlanOptions):
        raise InvalidType(f"longest_sequence()'s options must be an rpcompile.PlanOptions, "
                          f"got {type(options).__name__}")
    po = options
    capacity_bytes = po.capacity_bytes
    workers, microbatches = po.gpus, po.microbatches_per_round
    rounds, optimizer = po.rounds, po.mode
    hw = get_hardware(hardware)
    if not 1 <= step <= start <= limit:
        raise InvalidInput(f"need 1 <= step ({step}) <= start ({start}) <= limit ({limit})")
    capacity = hw.usable_memory_bytes if capacity_bytes is None else int(capacity_bytes)
    ram = max(0, int(host_ram_bytes or 0))
    proofs = replays = 0
    hosts: dict[int, HostMemory] = {}
    # Each length is proven once (the host search meets lengths the GPU search proved).
    attempts: dict[int, tuple[Plan | None, str]] = {}

    def gpu_attempt(seq: int) -> tuple[Plan | None, str]:
        if seq not in attempts:
            attempts[seq] = prove(seq)
        return attempts[seq]

    def prove(seq: int) -> tuple[Plan | None, str]:
        nonlocal proofs
        plan = memory_first_plan(units_at(seq), hw, workers, microbatches, microbatch_size,
                                 seq, rounds, costing)
        if why := _alone(plan, capacity):
            return None, why
        steps = proof_steps(plan, rounds, optimizer)
        period = dispatch_period(len(plan.stages) * rounds, plan.workers)
        sched = proof_schedule(plan, rounds, optimizer, steps + period)
        peaks = worker_peaks(sched, plan, steps=steps)  # as proven_peaks
        proofs += 1
        top = max(peaks, key=lambda p: p.peak_bytes)
        if top.peak_bytes > capacity:
            return None, (f"the memory-first plan's whole schedule peaks at "
                          f"{top.describe(plan.stage_name)}, over the {format_bytes(capacity)} "
                          "usable")
        return replace(plan, worker_peak_bytes=tuple(p.peak_bytes for p in peaks)), ""

    def host_of(plan: Plan) -> HostMemory:
        nonlocal replays
        if plan.seq_len not in hosts:
            replays += 1
            hosts[plan.seq_len] = host_need(plan, hw, rounds, optimizer)
        return hosts[plan.seq_len]

    def host_why(host: HostMemory) -> str:
        return (f"host RAM: need {host.describe()} of the {format_bytes(ram)} RAM "
                f"({host_ram_source})")

    def both_attempt(seq: int) -> tuple[Plan | None, str]:
        plan, why = gpu_attempt(seq)
        if plan is None:
            return None, why
        host = host_of(plan)
        return (plan, "") if host.total <= ram else (None, host_why(host))

    seq, best, hi, why_hi = _search(gpu_attempt, start, step, limit)
    if best is None:
        return LongestSequence(0, None, hi, why_hi, proofs, replays, None, ram, host_ram_source)
    host = host_of(best)
    gpu = LongestSequence(seq, best, hi, why_hi, proofs, replays, host, ram, host_ram_source)
    if not ram or host.total <= ram:
        return gpu
    static = host_memory(best, optimizer, None, journal=hw.undo_journal,
                         pageable=hw.host_memory == "pageable")
    if static.total > ram:
        lean = static.total - static.journal
        hint = (f" (without the undo journal it is {format_bytes(lean)}, which fits)"
                if static.journal and lean <= ram else "")
        return LongestSequence(
            0, None, start,
            f"host RAM: the static host memory alone (masters, optimizer state, gradients, "
            f"shadows, the module's copy, the undo journal: the same at every length) needs "
            f"{static.describe()}, over the {format_bytes(ram)} RAM ({host_ram_source}), so "
            f"no length fits{hint}", proofs, replays, None, ram, host_ram_source, gpu)
    lo, low, hi2, why2 = _search(both_attempt, start, step, seq, top=(seq, host_why(host)))
    if low is None:
        # The staging is not monotone in the length (what a replay overlaps changes with the
        # stage times), so a failing start does not rule out the lengths above it: try them
        # in steps, up to _HOST_SCAN of them, and bisect again from the first that fits.
        for trial in range(start + step, seq, step)[:_HOST_SCAN]:
            plan, _why = both_attempt(trial)
            if plan is not None:
                lo, low, hi2, why2 = _search(both_attempt, trial, step, seq,
                                             top=(seq, host_why(host)))
                break
    return LongestSequence(lo, low, hi2, why2, proofs, replays,
                           None if low is None else host_of(low), ram, host_ram_source, gpu)


# Lengths above a start whose host memory is over the RAM that the host search still tries.
_HOST_SCAN = 32


def _search(attempt, start: int, step: int, limit: int, top: tuple[int, str] | None = None):
    """(longest length that fits, its plan, first length that does not or None, why) over
    ``start..limit``: doubling from ``start``, then bisecting to ``step`` tokens. ``top``:
    a length known not to fit and why (the doubling is skipped: it bisects below it)."""
    plan, why = attempt(start)
    if plan is None:
        return 0, None, start, why
    lo, best = start, plan
    hi, why_hi = top if top is not None else (None, "")
    while hi is None and lo < limit:
        trial = min(2 * lo, limit)
        plan, why = attempt(trial)
        if plan is None:
            hi, why_hi = trial, why
        else:
            lo, best = trial, plan
    if hi is None:
        return lo, best, None, f"fits up to {limit:,} tokens"
    while hi - lo > step:
        mid = max(lo + step, (lo + hi) // 2 // step * step)
        if mid >= hi:
            break
        plan, why = attempt(mid)
        if plan is None:
            hi, why_hi = mid, why
        else:
            lo, best = mid, plan
    return lo, best, hi, why_hi

"""Stage figures: the compute time, transfer bytes and device memory of a stage cut from a
model's units (StageCosting says how), and a Plan built from explicit cuts (build_plan)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, Stage, UnitProfile
from rpcompile.passes.cost import gradient_job_bytes, recompute_ms
from rpcompile.passes.memory import format_bytes
from rpcompile.planner.bound import simulated_lower_bound, steady_estimate
from rpcompile.planner.partition.common import PartitionError

__all__ = [
    "StageCosting",
    "build_plan",
]


@dataclass(frozen=True)
class StageCosting:
    """How stage figures are derived from unit profiles."""

    weight_dtype_bytes: int = 2  # the low-precision shadow that gets uploaded
    grad_dtype_bytes: int = 4  # fp32 gradient accumulator and download
    act_dtype_bytes: int = 2  # activations cross boundaries in the compute dtype
    activation_scale: float = 1.0  # rescales UnitProfile byte figures (already in act dtype)
    # How backward stages of more than one unit recompute (rpcompile.passes.cost.RECOMPUTE).
    recompute: str = "stage"


def _planning_inputs(units: Sequence[UnitProfile], hardware: Hardware | str,
                     costing: StageCosting | None
                     ) -> tuple[tuple[UnitProfile, ...], Hardware, StageCosting]:
    """What every partitioner starts from: the units as a tuple, the hardware profile and the
    costing (default :class:`StageCosting`); refuses fewer than two units."""
    units = tuple(units)
    if len(units) < 2:
        raise InvalidInput("a plan needs at least two units (something before the tail, and the tail)")
    return units, get_hardware(hardware), costing or StageCosting()


def build_plan(
    units: Sequence[UnitProfile],
    forward_bounds: Sequence[int],
    backward_bounds: Sequence[int],
    tail_start: int,
    hardware: Hardware | str,
    workers: int,
    microbatches: int,
    microbatch_size: int = 1,
    seq_len: int = 1,
    rounds: int = 1,
    costing: StageCosting | None = None,
    notes: tuple[str, ...] = (),
    optimizer: str = "async",
) -> Plan:
    """A Plan from explicit cuts: ``*_bounds`` are the start units of each stage in model order
    (both start with 0); units ``tail_start..`` form the fused tail. ``predicted_step_ms`` is,
    for ``"sync"``, the simulator's proven lower bound on one step's makespan
    (:func:`~rpcompile.planner.bound.simulated_lower_bound`); for ``"async"``, the relaxed
    replay's estimate of the overlapping steady-state step
    (:func:`~rpcompile.planner.bound.steady_estimate`, at least that mode's bound): not yet a
    replay either way: the partitioner writes in the simulated figure of the plan it
    returns."""
    hw = get_hardware(hardware)
    return _StageFigures(units, costing or StageCosting()).plan(
        forward_bounds, backward_bounds, tail_start, hw, workers, microbatches,
        microbatch_size, seq_len, rounds, notes, optimizer)


class _StageFigures:
    """Stage figures of one model's units under one costing, each worked out once: the
    search builds thousands of plans from a few hundred distinct stages. A stage is the same
    whatever plan holds it, but for its index and, for a forward stage, the backward
    boundaries inside it (the recompute inputs it saves)."""

    def __init__(self, units: Sequence[UnitProfile], costing: StageCosting) -> None:
        self.units, self.costing = tuple(units), costing
        self._stages: dict[tuple, Stage] = {}  # by (kind, first, last unit, saved starts)
        self._placed: dict[tuple, Stage] = {}  # the same and the index
        self._ms: dict[tuple, float] = {}  # compute ms by (kind, first, last unit)

    def stage(self, index: int, kind: str, r: tuple[int, ...], tail_start: int,
              saved: tuple[int, ...]) -> Stage:
        """Stage ``index`` of ``kind`` over units ``r``; ``saved``: for a forward stage, the
        backward stages' starts inside it."""
        key = (kind, r[0], r[-1], saved)
        placed = self._placed.get((key, index))
        if placed is not None:
            return placed
        made = self._stages.get(key)
        if made is None:
            made = _make_stage(0, kind, r, self.units, self.costing, tail_start, (),
                               [(b,) for b in saved])
            self._stages[key] = made
        placed = self._placed[(key, index)] = made if index == 0 else replace(made, index=index)
        return placed

    def job_ms(self, forward_bounds, backward_bounds, tail_start) -> list[float]:
        """``Stage.compute_ms`` of each stage of the plan these cuts build, in dispatch order
        (F1..Fp, the tail, B2..Bq), without building or timing the plan."""
        n = len(self.units)
        ranges = [("forward", r) for r in _ranges(forward_bounds, tail_start)]
        ranges.append(("tail", tuple(range(tail_start, n))))
        ranges += [("backward", r) for r in reversed(_ranges(backward_bounds, tail_start))]
        out = []
        for kind, r in ranges:
            key = (kind, r[0], r[-1])
            ms = self._ms.get(key)
            if ms is None:
                ms = self._ms[key] = _stage_ms(kind, r, self.units, self.costing)
            out.append(ms)
        return out

    def plan(self, forward_bounds, backward_bounds, tail_start, hw, workers, microbatches,
             microbatch_size, seq_len, rounds, notes, optimizer) -> Plan:
        units = self.units
        n = len(units)
        fwd_ranges = _ranges(forward_bounds, tail_start)
        bwd_ranges = list(reversed(_ranges(backward_bounds, tail_start)))
        starts = [b[0] for b in bwd_ranges]
        stages = [self.stage(i, "forward", r, tail_start,
                             tuple(b for b in starts if r[0] < b <= r[-1]))
                  for i, r in enumerate(fwd_ranges)]
        stages.append(self.stage(len(stages), "tail", tuple(range(tail_start, n)), tail_start,
                                 ()))
        stages += [self.stage(len(stages) + i, "backward", r, tail_start, ())
                   for i, r in enumerate(bwd_ranges)]
        return _timed_plan(units, tuple(stages), hw, workers, microbatches, microbatch_size,
                           seq_len, rounds, notes, optimizer)


def _timed_plan(units, stages, hw, workers, microbatches, microbatch_size, seq_len, rounds,
                notes, optimizer) -> Plan:
    plan = Plan(
        units=units, stages=stages, workers=workers, microbatches=microbatches,
        microbatch_size=microbatch_size, seq_len=seq_len, hardware=hw.name,
        predicted_step_ms=0.0, memory_limit_bytes=hw.usable_memory_bytes, notes=notes,
    )
    plan.validate()
    figure = steady_estimate(plan, hw, rounds) if optimizer == "async" else \
        simulated_lower_bound(plan, hw, rounds, optimizer)
    return replace(plan, predicted_step_ms=figure)


def _ranges(bounds: Sequence[int], end: int) -> list[tuple[int, ...]]:
    bounds = list(bounds)
    if not bounds or bounds[0] != 0 or sorted(set(bounds)) != bounds or bounds[-1] >= end:
        raise InvalidInput(f"stage starts {bounds} must begin at 0 and increase below {end}")
    edges = [*bounds, end]
    return [tuple(range(a, b)) for a, b in itertools.pairwise(edges)]


def _check_units_fit(units, costing, limit) -> None:
    for i, u in enumerate(units):
        kind = "tail" if i == len(units) - 1 else "backward"
        need = _stage_memory(units, (i,), kind, costing)
        if need > limit:
            raise PartitionError(
                f"unit {u.name!r} alone needs {format_bytes(need)} of device memory (weights "
                f"twice for prefetch, its gradients in fp32 and in the compute dtype, and one "
                f"microbatch's working set) but the GPU has {format_bytes(limit)} usable; use a "
                "smaller microbatch or sequence length, freeze it (LoRA), or a GPU with more "
                "memory"
            )


def _stage_params(units, r: tuple[int, ...]) -> tuple[int, int]:
    """(all, trainable) parameter elements a stage holds: its units' own, plus parameters
    its units borrow from a unit outside the stage (tied weights), each counted once."""
    params = sum(units[u].params for u in r)
    trainable = sum(units[u].trainable_params for u in r)
    seen = set()
    for u in r:
        for owner, numel, is_trainable in units[u].borrowed:
            if owner in r or (owner, numel) in seen:
                continue
            seen.add((owner, numel))
            params += numel
            trainable += numel if is_trainable else 0
    return params, trainable


def _stage_weight_bytes(units, r: tuple[int, ...], costing: StageCosting) -> tuple[int, int]:
    """(uploaded, dequantized) weight bytes of a stage: every weight in the compute dtype but
    the frozen quantized ones, which travel packed (UnitProfile.packed_bytes); those are
    dequantized on the device, in the compute dtype, for the job's computes."""
    params, _ = _stage_params(units, r)
    packed = sum(units[u].packed_params for u in r)
    dequantized = packed * costing.weight_dtype_bytes
    return (params - packed) * costing.weight_dtype_bytes + sum(
        units[u].packed_bytes for u in r), dequantized


def _stage_reads(units, r: tuple[int, ...]) -> tuple[int, tuple[tuple[str, int], ...] | None]:
    """A stage's buffer bytes and batch inputs: the union over its units of what they read
    (UnitProfile.buffers, batch_inputs), each counted once. Batch inputs are None when no
    unit of the plan says what it reads (profiles built by hand: the first unit reads no ids
    and the last no labels)."""
    buffers: dict[str, int] = {}
    batch: dict[str, int] = {}
    for u in r:
        buffers.update(units[u].buffers)
        batch.update(units[u].batch_inputs)
    known = bool(units[0].batch_inputs or units[-1].batch_inputs)  # the ids, the labels
    return sum(buffers.values()), (tuple(batch.items()) if known else None)


def _stage_memory(units, r: tuple[int, ...], kind: str, costing: StageCosting,
                  saved: int = 0) -> int:
    """Device memory of one job: weights and buffers twice (the next job's prefetch shares
    the device), the fp32 gradient accumulator (not for forward stages), one microbatch's
    working set, and the dequantized copies of the stage's packed weights (held while a
    compute runs).

    A forward compute keeps every value it sends out until it ends (the memory proof counts
    them from its end): the values shared with later units that its units make, and
    ``saved``, the recompute inputs it saves at the backward boundaries inside it (a plan's
    figure; without it, what any plan's forward stage over ``r`` needs at least).

    A backward or tail job's working set is its peak over the backward's progress
    (:func:`~rpcompile.passes.cost.gradient_job_bytes`): autograd leaves every trainable
    parameter's gradient, in the weights' dtype, on its leaf until the microbatch's backward
    ends (only then are they added into the fp32 accumulator, ``run_backward_microbatch``),
    and it produces a unit's gradients after the activations the later units saved are
    freed."""
    _, trainable = _stage_params(units, r)
    uploaded, dequantized = _stage_weight_bytes(units, r, costing)
    weights = 2 * (uploaded + _stage_reads(units, r)[0])
    if kind == "forward":
        # No autograd: only the largest transient plus the values being sent out.
        working = max((units[u].output_bytes + units[u].shared_bytes for u in r), default=0)
        working += max((units[u].working_bytes for u in r), default=0) // 4
        working += saved + sum(units[u].shared_bytes for u in r)
        return int(weights + working * costing.activation_scale + dequantized)
    grads = trainable * costing.grad_dtype_bytes
    working = _gradient_working(units, r, _recompute(kind, r, units, costing), costing)
    # A quantized stage's dequantized weights are part of each compute's working set.
    return int(weights + grads + working + dequantized)


def _gradient_working(units, r: tuple[int, ...], recompute: str, costing: StageCosting) -> int:
    """A gradient job's working set with its parameters' gradients in the weights' dtype,
    at its peak over the backward's progress."""
    grads = [n * costing.weight_dtype_bytes for n in _unit_trainable(units, r)]
    return gradient_job_bytes(units, r, recompute, grads, costing.activation_scale)


def _unit_trainable(units, r: tuple[int, ...]) -> list[int]:
    """Per unit of a stage, the trainable parameter elements whose gradients its backward
    produces: its own, and those it borrows (tied weights). A borrowed weight's gradient
    first appears at the last unit of the stage that reads it (the backward runs the units
    last first), so it is counted there and not at its owner; the sum is the stage's
    trainable elements (:func:`_stage_params`)."""
    out = [units[u].trainable_params for u in r]
    seen = set()
    for k in range(len(r) - 1, -1, -1):
        for owner, numel, is_trainable in units[r[k]].borrowed:
            if not is_trainable or (owner, numel) in seen:
                continue
            seen.add((owner, numel))
            out[k] += numel
            if owner in r:
                out[r.index(owner)] -= numel
    return out


def _recompute(kind: str, r: tuple[int, ...], units, costing: StageCosting) -> str:
    """A stage's recompute granularity: the costing's for a backward stage of several units
    where layer recompute holds less, gradients included (a stage of one large layer and a
    small prefix holds more by layer: the boundaries and a gradient for next to nothing
    saved)."""
    if kind != "backward" or costing.recompute == "stage" or len(r) < 2:
        return "stage"
    return ("layer" if _gradient_working(units, r, "layer", costing)
            < _gradient_working(units, r, "stage", costing) else "stage")


def _stage_ms(kind: str, r: tuple[int, ...], units, costing: StageCosting) -> float:
    """One microbatch's compute time of a stage of ``kind`` over units ``r``."""
    if kind == "forward":
        return sum(units[u].forward_ms for u in r)
    return recompute_ms(units, r, _recompute(kind, r, units, costing))


def _make_stage(index, kind, r, units, costing, tail_start, fwd_ranges, bwd_ranges) -> Stage:
    ms = _stage_ms(kind, r, units, costing)
    _, trainable = _stage_params(units, r)
    buffer_bytes, batch_inputs = _stage_reads(units, r)
    first = r[0]
    incoming = units[first - 1].output_bytes if first > 0 else 0
    # Shared values (rotary tables, masks, long skips) travel with every boundary after the
    # unit that makes them (UnitProfile.shared_bytes): all of them, not the largest.
    shared = sum(units[u].shared_bytes for u in range(first))
    if kind == "forward":
        last = r[-1]
        # The activation for the next stage, plus each backward boundary inside this stage:
        # those inputs are saved for the backward stage's recompute.
        saved = sum(
            units[b[0] - 1].output_bytes for b in bwd_ranges if first < b[0] <= last
        )
        out_bytes = (units[last].output_bytes + saved
                     + sum(units[u].shared_bytes for u in range(last + 1)))
        in_bytes = incoming + shared
    else:
        # Backward stages read their saved input and the output gradient; they send the
        # input gradient on (nothing for the stage that starts at unit 0). A gradient covers
        # the hidden state and every shared value that carries one (a long skip connection).
        out_grad = (units[r[-1]].output_bytes
                    + sum(units[u].shared_grad_bytes for u in range(r[-1] + 1))
                    if kind == "backward" else 0)
        in_bytes = incoming + shared + out_grad
        out_bytes = incoming + sum(units[u].shared_grad_bytes for u in range(first))
    return Stage(
        index=index,
        kind=kind,
        units=tuple(r),
        compute_ms=ms,
        weight_bytes=_stage_weight_bytes(units, r, costing)[0],
        grad_bytes=0 if kind == "forward" else trainable * costing.grad_dtype_bytes,
        input_bytes=int(in_bytes * costing.activation_scale),
        output_bytes=int(out_bytes * costing.activation_scale),
        peak_bytes=_stage_memory(units, tuple(r), kind, costing,
                                 saved if kind == "forward" else 0),
        recompute=_recompute(kind, tuple(r), units, costing),
        shadow_bytes=trainable * costing.weight_dtype_bytes,
        buffer_bytes=buffer_bytes,
        batch_inputs=batch_inputs,
    )

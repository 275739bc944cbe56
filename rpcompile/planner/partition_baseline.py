"""RoundPipe's own partitioner, kept as the baseline our partitioner is measured against.

The rule (from the RoundPipe paper and library, re-implemented from its description):

  * a side's unit costs are forward time (forward stages) or forward + backward time (the tail
    and the backward stages: recompute + backward, or the tail's forward + loss + backward);
  * W is the costliest single unit of the model on that side's cost (for the forward side
    this includes the tail's forward, though the tail itself is cut on the backward side);
    the candidate budgets T are W and every contiguous run's total cost in [W, 1.1 W];
  * for a budget T, units are packed greedily from the last toward the first: a stage takes
    units while its cost stays within T and its weights within half of 60% of GPU memory;
  * the budget with the smallest max(number of stages, G) x T wins (G = workers): with fewer
    stages than workers a round still takes G job slots, with more it takes one per stage.

The backward side is cut first over all units; its first group (the model's last units) is the
fused tail, and the forward side is cut over the units before it. Ties go to fewer stages, then
to the smaller budget. Unlike :mod:`rpcompile.planner.partition`, nothing here sees transfer
time or activation memory, which is the point of keeping it: it is the plan RoundPipe would
make. The stage figures (bytes, memory, predicted step) come from the same ``build_plan`` as
ours, so the two plans are compared like for like.
"""

from __future__ import annotations

from collections.abc import Sequence

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.planner.partition import PartitionError, StageCosting, build_plan

__all__ = ["WEIGHT_MEMORY_FRACTION", "candidate_budgets", "greedy_pack", "partition_roundpipe"]

# A stage's weights may take half of 60% of the GPU's memory: two weight sets (the running job
# and the prefetched next one) then fit in 60%, the rest is left to activations.
WEIGHT_MEMORY_FRACTION = 0.6 / 2
_SLACK = 1.1  # budgets are tried up to 10% above the costliest unit


def candidate_budgets(costs: Sequence[float], costliest: float | None = None) -> list[float]:
    """W and every contiguous run's total cost in [W, 1.1 W], sorted. W is ``costliest``, by
    default the costliest unit of ``costs``."""
    if not costs:
        raise InvalidInput("no units to partition")
    w = max(costs) if costliest is None else costliest
    out = {w}
    for i in range(len(costs)):
        total = 0.0
        for c in costs[i:]:
            total += c
            if total > _SLACK * w:
                break
            if total >= w:
                out.add(total)
    return sorted(out)


def greedy_pack(costs: Sequence[float], weights: Sequence[int], budget: float,
                weight_limit: float) -> list[int]:
    """Start unit of each stage, in model order, packing from the last unit toward the first:
    a stage grows while its cost stays <= ``budget`` and its weight bytes <= ``weight_limit``.
    A unit over either limit on its own gets a stage to itself (callers reject that case)."""
    starts: list[int] = []
    cost, wsum = 0.0, 0
    end = len(costs)
    for u in range(len(costs) - 1, -1, -1):
        if u < end - 1 and (cost + costs[u] > budget * (1 + 1e-12)
                            or wsum + weights[u] > weight_limit):
            starts.append(u + 1)
            end, cost, wsum = u + 1, 0.0, 0
        cost += costs[u]
        wsum += weights[u]
    starts.append(0)
    return sorted(starts)


def _best_pack(costs: Sequence[float], weights: Sequence[int], workers: int,
               weight_limit: float, costliest: float) -> tuple[float, float, list[int]]:
    """(objective, budget, stage starts) minimising max(stages, workers) x budget."""
    best: tuple[float, int, float, list[int]] | None = None
    for t in candidate_budgets(costs, costliest):
        starts = greedy_pack(costs, weights, t, weight_limit)
        key = (max(len(starts), workers) * t, len(starts), t, starts)
        if best is None or key[:3] < best[:3]:
            best = key
    assert best is not None
    return best[0], best[2], best[3]


def partition_roundpipe(
    units: Sequence[UnitProfile],
    hardware: Hardware | str,
    workers: int,
    microbatches: int,
    microbatch_size: int = 1,
    seq_len: int = 1,
    rounds: int = 1,
    costing: StageCosting | None = None,
) -> Plan:
    """The plan RoundPipe's greedy partitioner makes, as a :class:`Plan` (same type as ours).

    Raises :class:`~rpcompile.planner.partition.PartitionError` when one unit's weights alone
    exceed half of 60% of the GPU's memory.
    """
    hw = get_hardware(hardware)
    costing = costing or StageCosting()
    units = tuple(units)
    n = len(units)
    if n < 2:
        raise InvalidInput("a plan needs at least two units (something before the tail, and the tail)")
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    limit = WEIGHT_MEMORY_FRACTION * hw.memory_bytes
    weights = [u.params * costing.weight_dtype_bytes for u in units]
    for u, wb in zip(units, weights):
        if wb > limit:
            raise PartitionError(
                f"unit {u.name!r} has {wb / 2**30:.2f} GiB of weights, over half of 60% of "
                f"the GPU's {hw.memory_gib:g} GiB ({limit / 2**30:.2f} GiB): RoundPipe's rule "
                "cannot place it; use a GPU with more memory or a lower-precision shadow"
            )

    back_cost = [u.forward_ms + u.backward_ms for u in units]
    back_obj, back_t, back_starts = _best_pack(back_cost, weights, workers, limit,
                                               max(back_cost))
    # The first group packed from the end is the fused tail. Keep at least one unit for the
    # forward side (a tail that swallowed the whole model would leave no forward stage).
    tail_start = max(back_starts[-1], 1)
    back_starts = [s for s in back_starts[:-1] if s < tail_start] or [0]

    fwd_cost = [u.forward_ms for u in units[:tail_start]]
    # W stays the costliest unit of the whole model (the LM head, usually): a forward stage
    # is cut to about the time of the forward of the unit that cannot be split.
    fwd_obj, fwd_t, fwd_starts = _best_pack(fwd_cost, weights[:tail_start], workers, limit,
                                            max(max(fwd_cost), max(u.forward_ms for u in units)))
    notes = (
        f"roundpipe greedy: forward budget {fwd_t:.2f} ms, {len(fwd_starts)} stages "
        f"(objective {fwd_obj:.1f}); backward budget {back_t:.2f} ms, "
        f"{len(back_starts) + 1} stages incl. tail (objective {back_obj:.1f})",
    )
    return build_plan(units, fwd_starts, back_starts, tail_start, hw, workers, microbatches,
                      microbatch_size, seq_len, rounds, costing, notes=notes)

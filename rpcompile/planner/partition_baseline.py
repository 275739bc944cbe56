"""RoundPipe's own partitioner, kept as the baseline our partitioner is measured against.

The rule (RoundPipe's ``ModelExecutePlan.auto`` for a fused forward-backward step, re-implemented
from its description and behaviour):

  * each unit has a forward cost (its forward time) and a backward cost (forward + backward
    time: recompute + backward for a layer, forward + loss + backward for the tail);
  * one budget T serves both sides. W is the costliest single figure among all units' forward
    and backward costs; the candidate budgets are W and every contiguous run of forward costs,
    or of backward costs, whose total lies in [W, 1.1 W];
  * for a budget T, the fused tail takes units from the last toward the first while its
    backward cost stays within T and its bytes within the stage limit (below); the forward
    side packs the units before the tail from the last toward the first, the backward side
    packs them from the first toward the last, a stage growing while its cost stays within T
    and its bytes within half of 60% of the GPU's memory (forward stages count their weights,
    backward stages and the tail their weights and gradients);
  * the budget with the smallest max(jobs, G) x T wins, jobs being the forward stages plus
    the backward stages with the tail (G = workers; the smaller budget on a tie): with fewer
    jobs than workers a round still takes G job slots, with more it takes one per job.

A forward job and a backward job thus last about the same: forward stages hold about three
times the layers of backward stages. Packing the backward side from the first unit puts its
short remainder stage next to the tail. Where RoundPipe raises its memory limit with a warning
for a unit that alone exceeds it, this refuses the plan. Unlike
:mod:`rpcompile.planner.partition`, nothing here sees transfer time or activation memory,
which is the point of keeping it: it is the plan RoundPipe would make. The stage figures
(bytes, memory, predicted step) come from the same ``build_plan`` as ours, so the two plans
are compared like for like; our search replays this plan's cut as one of its candidates
(:func:`greedy_cuts`, between whole layers when units are blocks of layers), so its plan is
never the slower of the two in the simulator.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.planner.partition.common import PartitionError
from rpcompile.planner.partition.stages import StageCosting, _planning_inputs, build_plan

__all__ = [
    "WEIGHT_MEMORY_FRACTION",
    "GreedyCuts",
    "candidate_budgets",
    "greedy_cuts",
    "greedy_pack",
    "partition_roundpipe",
]

# A stage's bytes may take half of 60% of the GPU's memory: two stages (the running job and
# the prefetched next one) then fit in 60%, the rest is left to activations.
WEIGHT_MEMORY_FRACTION = 0.6 / 2
_SLACK = 1.1  # budgets are tried up to 10% above the costliest unit


def candidate_budgets(*sides: Sequence[float]) -> list[float]:
    """W and every contiguous run's total cost in [W, 1.1 W], sorted, over one or more cost
    lists (the forward and the backward costs of the same units). W is the costliest single
    cost of all lists; a run never mixes lists."""
    if not sides or not all(sides):
        raise InvalidInput("no units to partition")
    w = max(max(costs) for costs in sides)
    out = {w}
    for costs in sides:
        for i in range(len(costs)):
            total = 0.0
            for c in costs[i:]:
                total += c
                if total > _SLACK * w:
                    break
                if total >= w:
                    out.add(total)
    return sorted(out)


def greedy_pack(costs: Sequence[float], sizes: Sequence[int], budget: float,
                size_limit: float, from_last: bool = True) -> list[int]:
    """Start unit of each stage, in model order. Units are taken from the last toward the
    first (``from_last``) or from the first toward the last; a stage grows while its cost
    stays <= ``budget`` and its bytes <= ``size_limit``. A unit over either limit on its own
    gets a stage to itself (callers reject that case)."""
    n = len(costs)
    order = range(n - 1, -1, -1) if from_last else range(n)
    groups: list[list[int]] = []
    cost, size = 0.0, 0
    for u in order:
        if not groups or (cost + costs[u] > budget * (1 + 1e-12)
                          or size + sizes[u] > size_limit):
            groups.append([])
            cost, size = 0.0, 0
        groups[-1].append(u)
        cost += costs[u]
        size += sizes[u]
    return sorted(min(g) for g in groups)


def _tail_start(back_cost: Sequence[float], back_size: Sequence[int], budget: float,
                size_limit: float) -> int:
    """First unit of the fused tail: the last unit, joined by the units before it while the
    tail's backward cost stays within ``budget`` and its bytes within ``size_limit``. Unit 0
    stays out, so the forward side keeps at least one unit."""
    start = len(back_cost) - 1
    cost, size = back_cost[start], back_size[start]
    for u in range(start - 1, 0, -1):
        if cost + back_cost[u] > budget * (1 + 1e-12) or size + back_size[u] > size_limit:
            break
        cost += back_cost[u]
        size += back_size[u]
        start = u
    return start


@dataclass(frozen=True)
class GreedyCuts:
    """What RoundPipe's rule chose: the start unit of each forward and backward stage (model
    order), the fused tail's first unit, the budget and its objective."""

    forward_starts: tuple[int, ...]
    backward_starts: tuple[int, ...]
    tail_start: int
    budget_ms: float
    objective: float

    @property
    def note(self) -> str:
        return (f"roundpipe greedy: budget {self.budget_ms:.2f} ms, "
                f"{len(self.forward_starts)} forward stages, {len(self.backward_starts) + 1} "
                f"backward stages incl. tail (objective {self.objective:.1f})")


def greedy_cuts(units: Sequence[UnitProfile], hw: Hardware, workers: int,
                costing: StageCosting, starts: Sequence[int] | None = None) -> GreedyCuts:
    """RoundPipe's rule on ``units``, cutting only where a stage may start: at every unit, or
    at ``starts`` only (unit indices, 0 first: the layers' first units when units are blocks
    of layers, where RoundPipe cuts). The pieces between two starts are packed as one unit of
    their summed costs and bytes. Raises :class:`PartitionError` when a piece's weights and
    gradients alone exceed half of 60% of the GPU's memory."""
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    n = len(units)
    edges = [*(range(n) if starts is None else sorted(set(starts))), n]
    if edges[0] != 0 or edges[-2] >= n:
        raise InvalidInput(f"stage starts must begin at unit 0 and lie below {n}, got {starts}")
    pieces = [range(a, b) for a, b in itertools.pairwise(edges)]
    limit = WEIGHT_MEMORY_FRACTION * hw.memory_bytes
    # Gradients are kept in the shadow's precision on the worker, as RoundPipe keeps them.
    fwd_size = [sum(units[u].params for u in r) * costing.weight_dtype_bytes for r in pieces]
    back_size = [sum(units[u].params + units[u].trainable_params for u in r)
                 * costing.weight_dtype_bytes for r in pieces]
    for r, size in zip(pieces, back_size):
        if size > limit:
            name = units[r[0]].name if len(r) == 1 else f"{units[r[0]].name}..{units[r[-1]].name}"
            raise PartitionError(
                f"unit {name!r} has {size / 2**30:.2f} GiB of weights and gradients, over "
                f"half of 60% of the GPU's {hw.memory_gib:g} GiB ({limit / 2**30:.2f} GiB): "
                "RoundPipe's rule cannot place it; use a GPU with more memory or a "
                "lower-precision shadow"
            )

    fwd_cost = [sum(units[u].forward_ms for u in r) for r in pieces]
    back_cost = [sum(units[u].forward_ms + units[u].backward_ms for u in r) for r in pieces]
    best: GreedyCuts | None = None
    for t in candidate_budgets(fwd_cost, back_cost):
        tail = _tail_start(back_cost, back_size, t, limit)
        fwd_starts = greedy_pack(fwd_cost[:tail], fwd_size[:tail], t, limit, from_last=True)
        back_starts = greedy_pack(back_cost[:tail], back_size[:tail], t, limit, from_last=False)
        objective = max(len(fwd_starts) + len(back_starts) + 1, workers) * t
        if best is None or objective < best.objective:
            best = GreedyCuts(tuple(edges[i] for i in fwd_starts),
                              tuple(edges[i] for i in back_starts), edges[tail], t, objective)
    assert best is not None
    return best


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

    Raises :class:`~rpcompile.planner.partition.PartitionError` when one unit's weights and
    gradients alone exceed half of 60% of the GPU's memory.
    """
    units, hw, costing = _planning_inputs(units, hardware, costing)
    cuts = greedy_cuts(units, hw, workers, costing)
    return build_plan(units, list(cuts.forward_starts), list(cuts.backward_starts),
                      cuts.tail_start, hw, workers, microbatches, microbatch_size, seq_len,
                      rounds, costing, notes=(cuts.note,))

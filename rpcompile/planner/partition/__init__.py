"""Partition pass: cut a model's units into RoundPipe forward stages, a fused tail and
backward stages, minimising the simulated step time.

Modules, in reading order:
  entry         partition(): enumerate tail sizes and stage counts, cut each side optimally,
                and keep the simulator's fastest candidate, found best first under a proven
                lower bound (rpcompile.planner.bound); the search budgets; the recompute choice
  memory_first  cut again under lower stage limits until the plan fits its whole schedule;
                the memory-first plan when no searched candidate does
  search        the best-first replay of one stage limit's candidates
  local         the local search on the bound, and the async refinement in the simulator
  proofs        the memory-bounding waits, replays, and proven peaks over the runtime's steps
  floor         a lower bound on every plan's async step, whatever its cuts
  cuts          contiguous min-max partition (exact dynamic programme) under a memory limit
  stages        stage figures: compute time, transfer bytes and device memory of a stage
  common        the error raised when no plan fits, and the record of one search

One timing model: a candidate is timed by the simulator's proven lower bound
(rpcompile.planner.bound.simulated_lower_bound, built from the simulator's own costs) until
it is replayed, and by the simulator's replay after; the bound scores the local search and
orders the replays, the replay decides which candidate wins. An async candidate is replayed
in the overlapping steady state the runtime runs (step k+1's jobs start while step k's
drain), so the plan chosen is the fastest there, not the fastest isolated step.

Why not greedy packing: a greedy pack that fills stages up to a budget leaves the last stage
short, and RoundPipe's round-robin dispatch runs at the pace of its longest job. Here each
side is cut by an exact min-max dynamic programme for every stage count.
"""

from rpcompile.planner.partition.common import PartitionError
from rpcompile.planner.partition.entry import (
    SEARCH_BUDGETS,
    TAIL_MEMORY_NOTE,
    SearchBudget,
    partition,
    tail_memory_bound,
)
from rpcompile.planner.partition.floor import AsyncFloor, async_step_floor
from rpcompile.planner.partition.memory_first import (
    MEMORY_FIRST_NOTE,
    memory_first_note,
    memory_first_plan,
)
from rpcompile.planner.partition.proofs import (
    WAIT_SETS,
    fit_memory_waits,
    proof_schedule,
    proof_steps,
    proven_peaks,
    retimed,
)
from rpcompile.planner.partition.stages import StageCosting, build_plan

__all__ = [
    "MEMORY_FIRST_NOTE",
    "SEARCH_BUDGETS",
    "TAIL_MEMORY_NOTE",
    "WAIT_SETS",
    "AsyncFloor",
    "PartitionError",
    "SearchBudget",
    "StageCosting",
    "async_step_floor",
    "build_plan",
    "fit_memory_waits",
    "memory_first_note",
    "memory_first_plan",
    "partition",
    "proof_schedule",
    "proof_steps",
    "proven_peaks",
    "retimed",
    "tail_memory_bound",
]

"""The floor: a lower bound on the long-run time per async step of every RoundPipe plan of a
model's units, whatever its cuts. It says how far any partition could beat a given one. It
is a bound, not a plan: round-robin dispatch may pace a plan well above it.

For each tail start, two limits hold whatever the other cuts:

- **The workers.** One step's compute spread over the workers. A stage's time per
  microbatch is the sum of its units' (``rpcompile.passes.cost.recompute_ms``; layer
  recompute only adds), so a step's least compute depends on the tail start alone: units
  before the tail run forward, then recompute and backward; the tail's run once forward and
  backward.
- **The staleness chain.** The runtime keeps at most two steps in flight
  (``rpcompile.ir.STEPS_IN_FLIGHT``): the schedule's ``in_flight`` edges start no action of
  step k before step k-2's commit point, which follows its last compute. Within a round each
  job's microbatch waits for the same microbatch of the job before it and for its own
  previous microbatch, so a step's computes span at least every stage's one-microbatch
  compute plus ``microbatches - 1`` of its longest stage, which is at least the longest stage
  of the finest cut (every unit its own stage). Two steps start per span.

Tail starts whose tail does not fit the device are left out: the fused tail is one stage
whatever the other cuts, and its working set for one microbatch (``Stage.peak_bytes``, the
figure the partitioner rules tails out by) must fit the device's usable memory.

Hops, uploads, host work and memory waits are left out: they only add, so over a long run
the simulated steady step (``rpcompile.sim.steady_step_ms``) of every plan whose tail fits is
at least the floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rpcompile.errors import InvalidInput
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import UnitProfile
from rpcompile.planner.partition.common import PartitionError
from rpcompile.planner.partition.stages import StageCosting, build_plan

__all__ = ["AsyncFloor", "async_step_floor"]


@dataclass(frozen=True)
class AsyncFloor:
    """A lower bound on every plan's async step (:func:`async_step_floor`)."""

    step_ms: float     # no plan's long-run time per async step is below this
    tail_units: int    # the tail length that gives it
    work_ms: float     # at that tail: one step's compute over the workers
    chain_ms: float    # at that tail: half the least span of one step's computes

    @property
    def limit(self) -> str:
        """Which limit sets the floor: ``"workers"`` or ``"chain"``."""
        return "workers" if self.work_ms >= self.chain_ms else "chain"


def async_step_floor(units: Sequence[UnitProfile], hardware: Hardware | str, workers: int,
                     microbatches: int, *, rounds: int = 1, microbatch_size: int = 1,
                     seq_len: int = 1, costing: StageCosting | None = None,
                     capacity: int | None = None) -> AsyncFloor:
    """A lower bound on the long-run time per async step (ms) of every RoundPipe plan of
    ``units`` on ``workers`` workers, ``microbatches`` per round and ``rounds`` rounds per
    step whose fused tail fits ``capacity`` bytes (default: the hardware's usable memory; the
    module doc says why it holds). Every tail start from one unit to all but the first is
    tried. Raises ``PartitionError`` when no tail fits."""
    hw = get_hardware(hardware)
    n = len(units)
    if n < 2:
        raise InvalidInput(f"a RoundPipe plan needs at least 2 units (a stage and a tail), got {n}")
    if capacity is None:
        capacity = hw.usable_memory_bytes
    best: AsyncFloor | None = None
    for tail in range(n - 1, 0, -1):
        finest = build_plan(units, list(range(tail)), list(range(tail)), tail, hw, workers,
                            microbatches, microbatch_size, seq_len, rounds, costing)
        if next(st for st in finest.stages if st.kind == "tail").peak_bytes > capacity:
            continue
        per_microbatch = [st.compute_ms for st in finest.stages]
        work = rounds * microbatches * sum(per_microbatch) / workers
        chain = (sum(per_microbatch) + (microbatches - 1) * max(per_microbatch)) / 2
        if best is None or max(work, chain) < best.step_ms:
            best = AsyncFloor(max(work, chain), n - tail, work, chain)
    if best is None:
        raise PartitionError(f"no fused tail of these {n} units fits {capacity / 2**30:.2f} GiB "
                             "of device memory, so no RoundPipe plan of them does")
    return best

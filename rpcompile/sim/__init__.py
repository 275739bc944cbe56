"""rpcompile.sim: replay a (lowered) schedule on a hardware profile.

The simulator reads the same :class:`~rpcompile.ir.Schedule` the runtime executes and predicts
its time line, bubbles, exposed transfers and memory (docs/simulator.md).
"""

from rpcompile.sim.baselines import head_layer_equivalents, pipeline_stages
from rpcompile.sim.cycles import SteadyBound, steady_bound
from rpcompile.sim.engine import OPTIMIZER_BYTES_PER_PARAM, SimulationError, compute_times, simulate
from rpcompile.sim.result import SimResult
from rpcompile.sim.runs import (
    simulate_pipeline,
    simulate_roundpipe,
    steady_step_ms,
    steady_steps,
    steady_utilization,
)

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "SimResult",
    "SimulationError",
    "SteadyBound",
    "compute_times",
    "head_layer_equivalents",
    "pipeline_stages",
    "simulate",
    "simulate_pipeline",
    "simulate_roundpipe",
    "steady_bound",
    "steady_step_ms",
    "steady_steps",
    "steady_utilization",
]

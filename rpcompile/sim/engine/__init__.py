"""Discrete-event replay of a schedule on a hardware profile.

Modules, in reading order:
  entry     - compute_times() (milliseconds per compute action, from stage costs or per-unit
              times), simulate() (the public entry: replay, then measure), replay_timeline(),
              peak_host_bytes() (the replay's host peak alone), with_staging() (a
              schedule's host staging slots, from its replay)
  replay    - streams, links, the host queue and shared host memory bandwidth (the resource
              model, docs/simulator.md)
  costs     - what each action kind costs, by the resource it holds (SIM_COSTS)
  measures  - bubble split, exposed transfers, device and host memory
"""

from rpcompile.sim.engine.costs import (
    GLOO_BROADCAST_HOST_BYTES_PER_BYTE,
    GLOO_HOST_BYTES_PER_BYTE,
    GLOO_REDUCE_HOST_BYTES_PER_BYTE,
    JOURNAL_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    SHADOW_JOURNAL_BYTES_PER_BYTE,
    SIM_COSTS,
)
from rpcompile.sim.engine.entry import (
    compute_times,
    paused_gc,
    peak_host_bytes,
    replay_timeline,
    simulate,
    with_staging,
)
from rpcompile.sim.engine.measures import makespan_of
from rpcompile.sim.engine.replay import SimulationError
from rpcompile.sim.result import busy_split

__all__ = ["GLOO_BROADCAST_HOST_BYTES_PER_BYTE", "GLOO_HOST_BYTES_PER_BYTE",
           "GLOO_REDUCE_HOST_BYTES_PER_BYTE", "JOURNAL_BYTES_PER_PARAM", "OPTIMIZER_BYTES_PER_PARAM",
           "SHADOW_JOURNAL_BYTES_PER_BYTE", "SIM_COSTS",
           "SimulationError", "busy_split", "compute_times", "makespan_of", "paused_gc",
           "peak_host_bytes", "replay_timeline", "simulate", "with_staging"]

"""Lowering: from the compute-only schedule to one every interpreter can run as is.

Each pass takes a Schedule and returns a new one, adds one concern, stamps its name into
``Schedule.passes`` and touches no device. In the order :func:`lower` runs them:

  1. upload     - UP of a job's weights (prefetched while the previous job runs, two weight
                  slots per worker) and EVICT after the job's last compute
  2. transfers  - activations through host memory: D2H by the producer, H2D by the consumer;
                  nothing when both run on the same worker (the value stays on the device)
  3. grads      - per job, one D2H of the fp32 gradients accumulated on the worker over the
                  job's microbatches; host ACC across rounds
  4. optimizer  - host OPT per backward stage once its last round is accumulated, SHADOW
                  rewrites of every stage sharing those parameters, and the waits that make
                  uploads read the right weights (sync: this step's; async: one step stale)
  4b. reduce    - data parallel over more than one rank only: a REDUCE on the host's network
                  lane after each stage's last ACC of the step, and the step's updates after
                  all of them
  4c. commit    - edges from each step's last actions to its last host action, where the
                  step commits, and from there to the first actions of the step
                  STEPS_IN_FLIGHT later (the runtime's limit on uncommitted steps); step
                  k+1's jobs start as soon as what they read is ready (steps overlap)
  4d. barrier   - data parallel over more than one rank only: step k+1's first actions wait
                  for step k's commit point (a rank's collectives are per step, so it runs
                  one step at a time)
  5. events     - drop edges already implied by stream order or by another edge, so that what
                  remains is the set of events a runtime records and waits on

docs/schedule.md describes the action kinds and edges each pass adds.

Modules: ``transfers`` (passes 1-3), ``optimizer`` (4), ``reduce`` (4b), ``ordering`` (4c, 4d,
5), ``common`` (what they share), ``pipeline`` (:func:`lower`, the runtime's schedule and its
proven peaks).
"""

# The default and the tightest memory waits are the plan's data; the one chunk size and the
# sync update orders are options. The passes read them; they are named here as well.
from rpcompile.ir import BOUNDED_WAITS, TIGHTEST_WAITS
from rpcompile.options import DEFAULT_CHUNK_BYTES, UPDATE_ORDERS
from rpcompile.passes.lower.common import (
    GRAD_BYTES,
    MEMORY_WAITS,
    gradient_groups,
    trainable_parameters,
)
from rpcompile.passes.lower.optimizer import (
    add_optimizer,
    async_update_order,
    opt_bytes,
    updates_deferred,
)
from rpcompile.passes.lower.ordering import add_commit, add_events, add_step_barrier
from rpcompile.passes.lower.pipeline import (
    DATA_PARALLEL_PASSES,
    LOWERING_PASSES,
    keep_runtime_schedules,
    kept_lowering,
    lower,
    memory_free,
    runtime_peaks,
    runtime_schedule,
)
from rpcompile.passes.lower.reduce import add_reductions
from rpcompile.passes.lower.transfers import (
    add_activation_transfers,
    add_gradient_downloads,
    add_weight_uploads,
    grad_slots,
)

__all__ = [
    "BOUNDED_WAITS",
    "DATA_PARALLEL_PASSES",
    "DEFAULT_CHUNK_BYTES",
    "GRAD_BYTES",
    "LOWERING_PASSES",
    "MEMORY_WAITS",
    "TIGHTEST_WAITS",
    "UPDATE_ORDERS",
    "add_activation_transfers",
    "add_commit",
    "add_events",
    "add_gradient_downloads",
    "add_optimizer",
    "add_reductions",
    "add_step_barrier",
    "add_weight_uploads",
    "async_update_order",
    "grad_slots",
    "gradient_groups",
    "keep_runtime_schedules",
    "kept_lowering",
    "lower",
    "memory_free",
    "opt_bytes",
    "runtime_peaks",
    "runtime_schedule",
    "trainable_parameters",
    "updates_deferred",
]

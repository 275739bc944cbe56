"""The runtime half of each action kind: what UP, EVICT, H2D, D2H, F, T, B, ACC, OPT, SHADOW,
REDUCE and CHECK do on a worker or on the host, and the step's gradient check.

:class:`Actions` is the executor's base: one method ``_do_<KIND>(run, a)`` per
:class:`~rpcompile.ir.ActionKind`, registered once in :data:`RUNTIME_ACTIONS` (checked complete
at import, as the simulator's table is), each given the running step's state (``run``:
rpcompile.runtime.step_state.StepState) and the action. The entries call the method by name
when they run, so a test (or a fault injector) patching ``Executor._do_X`` reaches it.

Modules: ``handlers`` (Actions, JobWeights: what each kind does, and the numerics,
transfers, quantized weights and device memory it keeps to), ``registry`` (RUNTIME_ACTIONS,
ACTION_OF), ``grads`` (a job's gradient accumulation, the host's clipping), ``copies``
(chunked copies, the same-device check).
"""

from rpcompile.runtime.actions.grads import clip_grad_norm
from rpcompile.runtime.actions.handlers import Actions, JobWeights
from rpcompile.runtime.actions.registry import ACTION_OF, RUNTIME_ACTIONS

__all__ = ["ACTION_OF", "RUNTIME_ACTIONS", "Actions", "JobWeights", "clip_grad_norm"]

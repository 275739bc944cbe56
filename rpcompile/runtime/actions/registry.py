"""The runtime half of each action kind's record: one entry per ActionKind (RUNTIME_ACTIONS),
checked complete at import as the simulator's table is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rpcompile.ir import Action, ActionKind, check_registry
from rpcompile.runtime.step_state import StepState

if TYPE_CHECKING:
    from rpcompile.runtime.executor import Executor

__all__ = [
    "ACTION_OF",
    "RUNTIME_ACTIONS",
]


# The runtime half of each action kind's record (rpcompile.ir.ACTION_SPECS is the other):
# one implementation per ActionKind, checked complete at import. The entries call the method
# by name when they run, so a test (or a fault injector) patching Executor._do_X reaches it.
RUNTIME_ACTIONS: Mapping[ActionKind, Callable[[Executor, StepState, Action], None]] = {
    ActionKind.F: lambda ex, run, a: ex._do_F(run, a),
    ActionKind.T: lambda ex, run, a: ex._do_T(run, a),
    ActionKind.B: lambda ex, run, a: ex._do_B(run, a),
    ActionKind.EVICT: lambda ex, run, a: ex._do_EVICT(run, a),
    ActionKind.UP: lambda ex, run, a: ex._do_UP(run, a),
    ActionKind.H2D: lambda ex, run, a: ex._do_H2D(run, a),
    ActionKind.D2H: lambda ex, run, a: ex._do_D2H(run, a),
    ActionKind.ACC: lambda ex, run, a: ex._do_ACC(run, a),
    ActionKind.OPT: lambda ex, run, a: ex._do_OPT(run, a),
    ActionKind.SHADOW: lambda ex, run, a: ex._do_SHADOW(run, a),
    ActionKind.REDUCE: lambda ex, run, a: ex._do_REDUCE(run, a),
    ActionKind.CHECK: lambda ex, run, a: ex._do_CHECK(run, a),
}
check_registry(RUNTIME_ACTIONS, "the runtime executor")
ACTION_OF = {k.value: fn for k, fn in RUNTIME_ACTIONS.items()}  # keyed by Action.kind's string

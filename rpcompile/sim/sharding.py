"""What the shadows' all-gather of a sharded schedule moves, per SHADOW action.

With ``shard_optimizer`` (``Schedule.sharded``) each rank updates only the parameters it owns,
and the runtime brings every rank the others' updated shadows inside the ``SHADOW`` actions
(``DataParallel.gather_shadows``): at a stage's ``SHADOW``, every trainable parameter the stage
reads (its units' own, and those it borrows: a tied embedding) whose gradient stages have all
had their ``OPT`` in this step, and that no earlier ``SHADOW`` of the step gathered, is
broadcast from its owner. :func:`shadow_gather_bytes` follows the same rule over the plan's
units and the schedule's host queue, so the simulator times the bytes the runtime moves.

:func:`shadow_journal_bytes` follows the undo journal's rule the same way (any schedule,
sharded or not): a ``SHADOW`` first saves the old shadow of every trainable parameter its stage
reads that no earlier ``SHADOW`` of the step saved (rpcompile.runtime.optim
``OptimizerDriver.refresh``); a parameter that two stages read is rewritten by both, saved once.
"""

from __future__ import annotations

from rpcompile.errors import InvalidInput
from rpcompile.ir import Action, Plan, Schedule
from rpcompile.passes.lower import trainable_parameters

__all__ = ["shadow_gather_bytes", "shadow_journal_bytes"]

# A parameter of the plan: ("own", unit) for a unit's trainable elements that no other unit
# borrows, ("lent", unit, elements) for the trainable elements other units borrow from it.
_Key = tuple


def _parameters(plan: Plan) -> tuple[dict[_Key, int], dict[_Key, frozenset[int]],
                                     dict[int, list[_Key]]]:
    """(elements, gradient stages) of each trainable parameter key, and the keys each stage
    reads."""
    params = trainable_parameters(plan)
    elements: dict[_Key, int] = {key: numel for key, (numel, _) in params.items()}
    stages_of: dict[_Key, frozenset[int]] = {key: stages for key, (_, stages) in params.items()}
    lent = [key for key in params if key[0] == "lent"]
    reads: dict[int, list[_Key]] = {}
    for st in plan.stages:
        keys: list[_Key] = []
        for u in st.units:
            if ("own", u) in elements:
                keys.append(("own", u))
            keys.extend(k for k in lent if k[1] == u)
            keys.extend(("lent", o, numel) for o, numel, trainable in plan.units[u].borrowed
                        if trainable)
        reads[st.index] = list(dict.fromkeys(keys))
    return elements, stages_of, reads


def _element_bytes(plan: Plan) -> int:
    """Bytes per shadow element: a stage's uploaded weight bytes over its parameters."""
    for st in plan.stages:
        params = sum(plan.units[u].params for u in st.units)
        seen = set()
        for u in st.units:
            for o, numel, _ in plan.units[u].borrowed:
                if o not in st.units and (o, numel) not in seen:
                    seen.add((o, numel))
                    params += numel
        if params:
            return max(1, round(st.weight_bytes / params))
    return 2


def shadow_gather_bytes(schedule: Schedule, plan: Plan) -> dict[Action, int]:
    """Bytes of updated shadows broadcast at each ``SHADOW`` of the sharded ``schedule`` (see
    the module doc); every trainable parameter is gathered once per step."""
    if not isinstance(plan, Plan):
        raise InvalidInput("a sharded schedule's shadow gather needs the Plan (its units say "
                         "which parameters each stage reads)")
    elements, stages_of, reads = _parameters(plan)
    size = _element_bytes(plan)
    done: dict[int, set[int]] = {}
    gathered: dict[int, set[_Key]] = {}
    out: dict[Action, int] = {}
    for a in schedule.host:
        mine = done.setdefault(a.step, set())
        if a.kind == "OPT":
            mine.add(a.stage)
        elif a.kind == "SHADOW":
            seen = gathered.setdefault(a.step, set())
            now = [k for k in reads.get(a.stage, ()) if k not in seen and stages_of[k] <= mine]
            seen.update(now)
            out[a] = size * sum(elements[k] for k in now)
    return out


def shadow_journal_bytes(schedule: Schedule, plan: Plan) -> dict[Action, int]:
    """Bytes of old shadows the undo journal saves at each ``SHADOW`` of ``schedule`` (see the
    module doc): every trainable parameter's shadow once per step, at the first ``SHADOW`` of
    the step whose stage reads it. Async, none: a SHADOW writes the second copy of the
    shadow, which no committed step reads (rpcompile.runtime.optim)."""
    if schedule.optimizer == "async":
        return {a: 0 for a in schedule.host if a.kind == "SHADOW"}
    elements, _stages_of, reads = _parameters(plan)
    size = _element_bytes(plan)
    saved: dict[int, set[_Key]] = {}
    out: dict[Action, int] = {}
    for a in schedule.host:
        if a.kind == "SHADOW":
            seen = saved.setdefault(a.step, set())
            now = [k for k in reads.get(a.stage, ()) if k not in seen]
            seen.update(now)
            out[a] = size * sum(elements[k] for k in now)
    return out

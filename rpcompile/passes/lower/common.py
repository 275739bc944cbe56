"""What the lowering passes share: a worker's list seen as jobs, new actions spliced into
the lists, chunk counts, the checks that a pass runs once, the memory-bounding waits and the
size of the host's gradient elements, and the plan's trainable parameters grouped by the
gradient stages that sum them (what each OPT updates and each REDUCE moves)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rpcompile.errors import InvalidInput
from rpcompile.ir import Action, Plan, Schedule, Stage

__all__ = [
    "GRAD_BYTES",
    "MEMORY_WAITS",
    "gradient_groups",
    "trainable_parameters",
]


GRAD_BYTES = 4  # the host's gradients are fp32 (what ACC sums and REDUCE moves)
# The waits that bound what a worker holds in flight (rpcompile.passes.memory): "window" and
# "sent" (pass 2), and a gradient-slot wait (pass 3): "grad_pair" (two gradient buffers per
# worker: a job's download has the whole next job to hide behind) or "grad_slot" (one: less
# memory, but a job's first compute waits for the previous job's download). A plan lists the
# ones its lowering adds (Plan.memory_waits); a bare stage list gets BOUNDED_WAITS.
MEMORY_WAITS = ("window", "sent", "grad_pair", "grad_slot")


@dataclass(frozen=True)
class _Job:
    worker: int
    stage: int
    round: int | None
    step: int
    computes: tuple[Action, ...]


def _jobs(sched: Schedule, worker: int) -> list[_Job]:
    """The worker's jobs in order: maximal runs of compute actions of one (stage, round, step)."""
    jobs: list[_Job] = []
    current: list[Action] = []
    for a in sched.actions[worker]:
        if not a.is_compute:
            continue
        if current and (a.stage, a.round, a.step) != (current[0].stage, current[0].round,
                                                       current[0].step):
            jobs.append(_Job(worker, current[0].stage, current[0].round, current[0].step,
                             tuple(current)))
            current = []
        current.append(a)
    if current:
        jobs.append(_Job(worker, current[0].stage, current[0].round, current[0].step,
                         tuple(current)))
    return jobs


def _splice(sched: Schedule, before: dict[Action, list[Action]],
            after: dict[Action, list[Action]], front: dict[int, list[Action]] | None = None,
            ) -> tuple[tuple[Action, ...], ...]:
    """Worker lists with new actions inserted before / after existing ones."""
    out = []
    for w, lst in enumerate(sched.actions):
        new = list((front or {}).get(w, ()))
        for a in lst:
            new.extend(before.get(a, ()))
            new.append(a)
            new.extend(after.get(a, ()))
        out.append(tuple(new))
    return tuple(out)


def _chunks(nbytes: int, chunk_bytes: int) -> int:
    return max(1, math.ceil(nbytes / chunk_bytes))


def _stages(plan: Plan | Sequence[Stage]) -> tuple[Stage, ...]:
    return tuple(plan.stages if isinstance(plan, Plan) else plan)


def _once(sched: Schedule, name: str) -> None:
    if name in sched.passes:
        raise InvalidInput(f"pass {name!r} already ran on this schedule (passes: {sched.passes})")


def _require_roundpipe(sched: Schedule, name: str) -> None:
    _once(sched, name)
    if sched.stage_workers is not None:
        raise InvalidInput(f"pass {name!r} applies to RoundPipe schedules; in the {sched.kind} "
                         "baseline weights, gradients and optimizer stay on the bound workers")

def trainable_parameters(plan: Plan) -> dict[tuple, tuple[int, frozenset[int]]]:
    """Each trainable parameter of the plan once, by key: ``("lent", unit, elements)`` for
    trainable elements other units borrow from ``unit`` (a tied embedding), ``("own", unit)``
    for the rest of a unit's trainable elements; each with its element count and the set of
    backward stages whose gradients sum into it (the stage holding the unit, plus every
    stage of a borrowing unit). Lent keys first, in the order they are borrowed, then own
    keys in unit order."""
    owner: dict[int, int] = {}  # unit -> the gradient stage holding it
    for st in plan.stages:
        if st.kind != "forward":
            for u in st.units:
                owner[u] = st.index
    lent: dict[tuple, set[int]] = {}
    shared: dict[int, int] = {}  # unit -> its trainable elements lent to other units
    for v, unit in enumerate(plan.units):
        for o, numel, trainable in unit.borrowed:
            if trainable:
                key = ("lent", o, numel)
                if key not in lent:
                    shared[o] = shared.get(o, 0) + numel
                lent.setdefault(key, {owner[o]}).add(owner[v])
    params = {key: (key[2], frozenset(stages)) for key, stages in lent.items()}
    for u, unit in enumerate(plan.units):
        own = unit.trainable_params - shared.get(u, 0)
        if own < 0:
            raise InvalidInput(f"unit {unit.name} lends more trainable elements than it has")
        if own:
            params[("own", u)] = (own, frozenset({owner[u]}))
    return params


def gradient_groups(plan: Plan) -> dict[frozenset[int], int]:
    """The plan's fp32 gradient bytes by the set of backward stages whose gradients they sum:
    each parameter once (:func:`trainable_parameters`), in the group of every gradient stage
    that holds it (a tied embedding and LM head: the tail and the first backward stage). A
    parameter is reduced across ranks once all of its group's stages are home, as the
    runtime's ``DataParallel.stage_done`` does."""
    groups: dict[frozenset[int], int] = {}
    for numel, stages in trainable_parameters(plan).values():
        groups[stages] = groups.get(stages, 0) + GRAD_BYTES * numel
    return groups

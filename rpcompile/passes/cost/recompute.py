"""Recompute granularity: a backward stage's working set and time when it recomputes its
forward by stage or by layer (the figures the planner's recompute choice reads)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rpcompile.choices import RECOMPUTE_GRANULARITIES, check_choice
from rpcompile.errors import InvalidInput

__all__ = [
    "RECOMPUTE",
    "gradient_job_bytes",
    "recompute_ms",
    "recompute_working_bytes",
]


# A backward stage (not the fused tail) recomputes its forward from its saved input, then runs
# backward. By "stage", one forward with autograd keeps every unit's saved activations until
# the one backward: the working set is the sum of the units'. By "layer", a forward without
# autograd keeps only the values that cross from one unit to a later one (the boundaries);
# then, last unit first, each unit's forward is recomputed with autograd and its backward run:
# the working set is the boundaries, one boundary gradient and the largest unit's own working
# set, at the cost of one more forward of every unit but the last. A one-unit stage gains
# nothing by "layer" and keeps "stage".

RECOMPUTE = RECOMPUTE_GRANULARITIES  # "stage", "layer": the option's choices but "auto"


def recompute_working_bytes(units: Sequence[Any], r: Sequence[int], recompute: str) -> int:
    """One microbatch's working set of a backward stage over units ``r`` (``UnitProfile``s),
    weights, gradient buffer and the stage's own inputs excluded. ``recompute``: the
    stage's resolved granularity, checked by the options' one rule (``rpcompile.choices``):
    this function is public, and a value the partitioner did not resolve ("auto", a typo)
    would otherwise be costed as layer recompute."""
    check_choice("recompute", recompute, RECOMPUTE)
    if recompute == "stage" or len(r) < 2:
        return sum(units[u].working_bytes for u in r)
    inner = r[:-1]  # units whose outputs are boundaries kept for a later unit of the stage
    boundaries = sum(units[u].output_bytes + units[u].shared_bytes for u in inner)
    gradient = max(units[u].output_bytes for u in inner)
    return boundaries + gradient + max(units[u].working_bytes for u in r)


def gradient_job_bytes(units: Sequence[Any], r: Sequence[int], recompute: str,
                       grads: Sequence[int], activation_scale: float = 1.0) -> int:
    """One microbatch's peak of a tail or backward stage over units ``r``: its working set
    (:func:`recompute_working_bytes`, times ``activation_scale``) together with the parameter
    gradients autograd leaves on their leaves, in the weights' dtype, until the microbatch's
    backward ends. ``grads``: per unit of ``r``, in its order, the bytes of the gradients that
    unit's backward produces (a tied weight's at the first unit of the stage to read it, in
    backward order).

    The backward runs the units last first, so when unit ``r[k]`` runs, the gradients of
    ``r[k:]`` exist and the activations the units after it saved are freed. By "stage", the
    units up to ``r[k]`` still hold what they saved (each counted at its whole working set, its
    largest transient included); by "layer", the boundaries and one boundary gradient are held
    throughout (counted whole) beside unit ``r[k]``'s own working set. The peak is the largest
    of these sums over ``k``: never below any point of the backward, and below the sum of the
    whole working set and every gradient wherever the two do not peak together."""
    check_choice("recompute", recompute, RECOMPUTE)
    if len(grads) != len(r):
        raise InvalidInput(f"grads has {len(grads)} entries for a stage of {len(r)} units")
    after = list(itertools.accumulate(reversed(grads)))[::-1]  # gradients of r[k:]
    if recompute == "stage" or len(r) < 2:
        held = itertools.accumulate(units[u].working_bytes for u in r)  # saved by r[:k + 1]
    else:
        kept = recompute_working_bytes(units, r, "layer") - max(units[u].working_bytes for u in r)
        held = (kept + units[u].working_bytes for u in r)
    return int(max(h * activation_scale + g for h, g in zip(held, after, strict=True)))


def recompute_ms(units: Sequence[Any], r: Sequence[int], recompute: str) -> float:
    """One microbatch's compute time of a backward stage over units ``r``: recompute plus
    backward, and by "layer" the boundary forward of every unit but the last before it.
    ``recompute`` is checked as in :func:`recompute_working_bytes` (else an unresolved
    "auto" would be timed as stage recompute)."""
    check_choice("recompute", recompute, RECOMPUTE)
    ms = sum(units[u].forward_ms + units[u].backward_ms for u in r)
    if recompute == "layer" and len(r) > 1:
        ms += sum(units[u].forward_ms for u in r[:-1])
    return ms

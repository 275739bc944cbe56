"""The plan a trainer runs, as its state records it, and the batch shapes its memory proof
holds for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rpcompile.errors import InvalidInput

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled

__all__ = [
    "check_plan_shape",
    "plan_summary",
]


def plan_summary(compiled: Compiled) -> dict[str, Any]:
    """What a checkpoint records about the plan, and what must match to load it."""
    plan = compiled.plan
    return {
        "workers": compiled.workers,
        "microbatches": compiled.microbatches,
        "rounds": compiled.rounds,
        "microbatch_size": plan.microbatch_size,
        "seq_len": plan.seq_len,
        "stages": [(p.name, p.kind, list(p.unit_names)) for p in compiled.stages],
    }


def check_plan_shape(compiled: Compiled, batch: dict[str, torch.Tensor]) -> None:
    """Refuse a batch whose microbatches would be larger than the plan's: its memory proof
    holds for the example batch's shape and anything smaller (fewer sequences per microbatch,
    shorter sequences), not for more."""
    plan = compiled.plan
    first = next(iter(batch.values()))
    parts = compiled.microbatches * compiled.rounds
    from rpcompile.capture.batch import largest_microbatch

    per_mb = largest_microbatch(first.shape[0], parts)
    seq = first.shape[1] if compiled.capture.loss_reduction == "sum" else None
    too_long = seq is not None and seq > plan.seq_len
    if per_mb > plan.microbatch_size or too_long:
        got = f"{first.shape[0]} sequences" + (f" of {seq} tokens" if seq is not None else "")
        raise InvalidInput(
            f"this batch ({got}: microbatches of up to {per_mb} sequences) is larger than the "
            f"plan's shape ({plan.microbatch_size} sequences per microbatch"
            + (f", {plan.seq_len} tokens" if seq is not None else "") + "), for which its "
            "memory was proven: compile with an example batch of the largest shape you will "
            "train on (pad or bucket shorter batches up to it), or split this batch"
        )


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(map(list, v)) if k == "stages" else v) for k, v in summary.items()}

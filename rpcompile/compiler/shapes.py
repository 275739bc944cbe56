"""Batch shapes: the (sequences, tokens per sequence) a plan is made for, agreed across data
parallel ranks, and the notices planning prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rpcompile.options import (
    PlanOptions,
)

if TYPE_CHECKING:
    from rpcompile.compiler.compiled import Compiled


def _batch_shape(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(sequences, tokens per sequence) of a normalized batch; a batch without ``input_ids``
    (a model with its own ``loss_fn``) has no token axis the plan follows: 1."""
    first = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()))
    return first.shape[0], (first.shape[1] if "input_ids" in batch else 1)


def _shape_text(shape: tuple[int, int]) -> str:
    return f"{shape[0]} x {shape[1]} tokens"


def _data_parallel(process_group: Any) -> bool:
    from rpcompile.runtime.distributed import resolve_group

    return resolve_group(process_group) is not None


def _agreed_shape(shape: tuple[int, int], process_group: Any) -> tuple[int, int]:
    """``shape`` as every data-parallel rank will plan for it: the largest over the ranks in
    each dimension (a collective: every rank calls it at the same step, before the step's
    own collectives; bounded by the process group's timeout, as the step's first all-reduce
    is), so all ranks keep the same plan; ``shape`` itself on one process."""
    from rpcompile.runtime.distributed import resolve_group

    group = resolve_group(process_group)
    if group is None:
        return shape
    import torch.distributed as dist

    both = torch.tensor(shape, dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]), int(both[1])


def _notice(po: PlanOptions, message: str) -> None:
    """One line about what planning did, on standard error, unless progress is off."""
    from rpcompile.progress import notice

    notice(message, po.progress)


def _shape_of(compiled: Compiled) -> tuple[int, int]:
    """The per-microbatch shape a compiled plan was proven for."""
    return compiled.plan.microbatch_size, compiled.plan.seq_len

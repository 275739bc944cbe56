"""Gradients on their way home: one microbatch's parameter gradients added into the job's flat
buffer on the worker (one kernel launch), and the host's clipping by the global norm."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rpcompile.runtime import kernels as _kernels
from rpcompile.runtime.memory import HostStore
from rpcompile.runtime.values import JobGrads

__all__ = [
    "clip_grad_norm",
]


def clip_grad_norm(store: HostStore, model: torch.nn.Module, max_norm: float) -> float:
    """Clip the host's fp32 gradients by their global L2 norm, with torch's own
    ``get_total_norm`` / ``clip_grads_with_norm_`` over the trainable parameters in
    ``model.parameters()`` order (what ``clip_grad_norm_(model.parameters(), max_norm)`` sees
    after a full backward); return the norm before clipping."""
    trainable = {s.name for s in store.trainable_slots}
    names = [n for n, p in model.named_parameters() if n in trainable]
    grads = [store.grad_of(n) for n in names]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_([_Grad(g) for g in grads], max_norm, total)
    return float(total)


class _Grad:
    """A parameter-like holder of a host gradient view, for torch's clipping helpers."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _accumulate(job: JobGrads, pairs: Sequence[tuple[str, torch.Tensor]],
                kernels: str) -> None:
    """Add one microbatch's parameter gradients into the job's flat buffer: one launch, or
    one more per repeat when two names share a slot (a tied parameter under two names: its
    contributions are then added one after the other, in the reference's order)."""
    batch: list[torch.Tensor] = []
    offsets: list[int] = []
    for name, grad in pairs:
        offset = job.offsets[name]
        if offset in offsets:
            _kernels.accumulate_grads(batch, job.flat, offsets, found_nonfinite=job.flag,
                                      backend=kernels)
            batch, offsets = [], []
        batch.append(grad.contiguous())
        offsets.append(offset)
    _kernels.accumulate_grads(batch, job.flat, offsets, found_nonfinite=job.flag,
                              backend=kernels)

"""The copies an action makes between host and device: in pieces that leave the copy engine
to other streams between them, and the device comparison that decides whether a value has
to move at all."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rpcompile.runtime.workers import Worker


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same (``cuda`` and ``cuda:0`` are, as the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _chunked_copy(worker: Worker, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  chunks: int) -> None:
    """Copy ``(dst, src)`` flat pairs in about ``chunks`` equal pieces, completing each before
    the next: on a GPU another stream's copy (a critical activation) can use the copy engine
    between two pieces of a bulk transfer instead of waiting for all of it."""
    total = sum(src.numel() for _, src in pieces)
    step = max(1, -(-total // max(1, chunks)))
    for dst, src in pieces:
        for start in range(0, src.numel(), step):
            worker.copy_(dst[start:start + step], src[start:start + step])
            worker.complete_copies()
    worker.complete_copies()

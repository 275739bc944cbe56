"""Setup of ``async_updates.py``: its batches and optimizer (the model is
``benchmarks/_models.py``'s, shared by the CPU benchmarks). Not a benchmark itself."""

from __future__ import annotations

import torch


def token_batches(count: int, batch: int, seq: int) -> list[torch.Tensor]:
    """``count`` seeded batches of random token ids, ``[batch, seq]`` each."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (batch, seq), generator=gen) for _ in range(count)]


def adamw(params):
    """The benchmarks' optimizer: fused AdamW at lr 1e-4."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True)

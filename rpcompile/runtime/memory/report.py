"""What the host keeps, in bytes (MemoryReport), measured from the buffers' storages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpcompile.runtime.errors import format_bytes

__all__ = [
    "MemoryReport",
]


@dataclass(frozen=True)
class MemoryReport:
    """What the host keeps, in bytes, measured from the buffers' storages.

    ``bytes_per_trainable_param`` counts what exists because a parameter is trainable (master,
    its shadow, gradient, optimizer state) over the trainable parameter count; frozen
    parameters' shadows are reported apart (a LoRA base would otherwise swamp the figure).
    """

    compute_dtype: str
    pin: str  # "no" | "registered" | "caching allocator (may round up)"
    trainable_params: int
    frozen_params: int
    master_bytes: int
    shadow_trainable_bytes: int
    shadow_frozen_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    upload_bytes: tuple[int, ...]  # per stage: bytes its job uploads
    # Sharded masters: this rank's share of the trainable parameters (masters and optimizer
    # state are held for ``owned_params`` of them; shadows and gradients for all).
    owned_params: int | None = None
    rank: int = 0
    ranks: int = 1

    @property
    def trainable_bytes(self) -> int:
        return (
            self.master_bytes + self.shadow_trainable_bytes + self.grad_bytes
            + self.optimizer_state_bytes
        )

    @property
    def total_bytes(self) -> int:
        return self.trainable_bytes + self.shadow_frozen_bytes

    @property
    def bytes_per_trainable_param(self) -> float:
        return self.trainable_bytes / max(1, self.trainable_params)

    def breakdown(self) -> dict[str, float]:
        """Bytes per trainable parameter of each kind (frozen shadow per frozen parameter)."""
        n = max(1, self.trainable_params)
        return {
            "master": self.master_bytes / n,
            "shadow": self.shadow_trainable_bytes / n,
            "grad": self.grad_bytes / n,
            "optimizer": self.optimizer_state_bytes / n,
            "frozen shadow (per frozen param)": self.shadow_frozen_bytes / max(1, self.frozen_params),
        }

    def __str__(self) -> str:
        lines = [
            f"host memory: {self.trainable_params:,} trainable + {self.frozen_params:,} frozen "
            f"parameters, compute dtype {self.compute_dtype}, pinned: {self.pin}",
            f"  master     {format_bytes(self.master_bytes)}",
            f"  shadow     {format_bytes(self.shadow_trainable_bytes)} trainable, "
            f"{format_bytes(self.shadow_frozen_bytes)} frozen",
            f"  grad       {format_bytes(self.grad_bytes)}",
            f"  optimizer  {format_bytes(self.optimizer_state_bytes)}",
            f"  total      {format_bytes(self.total_bytes)}; "
            f"{self.bytes_per_trainable_param:.2f} bytes per trainable parameter ("
            + " + ".join(f"{v:.2f} {k}" for k, v in list(self.breakdown().items())[:4])
            + ")",
        ]
        if self.ranks > 1:
            lines.append(
                f"  sharded    rank {self.rank} of {self.ranks} holds masters and optimizer "
                f"state for {self.owned_params:,} of the {self.trainable_params:,} trainable "
                "parameters (per-parameter figures are over all of them); shadow and grad "
                "are whole on every rank")
        return "\n".join(lines)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state, each storage counted once."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())

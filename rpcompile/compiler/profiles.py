"""The partitioner's numbers: each unit's costs at a shape on a hardware profile, with the
parameters it borrows from another unit; the machine at hand and the model's floating dtype."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from rpcompile.capture.core import Captured
from rpcompile.hardware import Hardware
from rpcompile.ir import UnitProfile
from rpcompile.passes.cost import UnitCost

__all__ = [
    "unit_profiles",
]


def unit_profiles(
    captured: Captured, unit_costs: Sequence[UnitCost], b: int, s: int, hardware: Hardware,
    dtype_bytes: int,
) -> list[UnitProfile]:
    """The partitioner's numbers: each unit's costs at ``b`` x ``s`` on ``hardware``, with the
    parameters it borrows from another unit (tied weights)."""
    borrowed = _borrowed_params(captured)
    return [
        replace(u.evaluate(b, s, hardware, dtype_bytes=dtype_bytes), borrowed=borrowed[i])
        for i, u in enumerate(unit_costs)
    ]


def _borrowed_params(captured: Captured) -> list[tuple[tuple[int, int, bool], ...]]:
    """Per unit, the parameters it reads that an earlier unit owns (the cost pass counts a
    parameter once, in the first unit that reads it): (owner, elements, trainable)."""
    out: list[list[tuple[int, int, bool]]] = [[] for _ in captured.units]
    for node in captured.graph_module.graph.find_nodes(op="placeholder"):
        name = captured.params.get(node.name)
        if name is None:
            continue
        readers = sorted({u.meta["rp_unit"] for u in node.users if "rp_unit" in u.meta})
        if len(readers) < 2:
            continue
        p = captured.parameter(name)
        for unit in readers[1:]:
            out[unit].append((readers[0], p.numel(), p.requires_grad))
    return [tuple(b) for b in out]


def _default_hardware() -> Hardware | str:
    """The machine at hand: a probe of its GPU when there is one, else the virtual profile."""
    if torch.cuda.is_available():
        from rpcompile.hardware import probe

        return probe("cuda")
    return "cpu"


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32

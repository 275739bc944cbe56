"""The run around a trainer: the ranks of a data parallel group and those a plan was made for,
the default optimizer and the watchdog's default timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rpcompile.errors import InvalidInput
from rpcompile.options import (
    TrainOptions,
    deferred_reasons,
)

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled

__all__ = [
    "TIMEOUT_FLOOR_S",
    "TIMEOUT_PREDICTION_FACTOR",
    "OptimizerFactory",
    "check_ranks",
    "default_timeout_s",
    "group_world",
    "planned_ranks",
]


OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# The watchdog's default: generous, because the plan's prediction is for the hardware
# profile, and a first step also compiles kernels and warms allocators.
TIMEOUT_FLOOR_S = 300.0
TIMEOUT_PREDICTION_FACTOR = 20.0


def _deferred_reasons(train: TrainOptions) -> list[str]:
    return deferred_reasons(max_grad_norm=train.max_grad_norm, loss_scale=train.loss_scale,
                            skip_nonfinite=train.skip_nonfinite,
                            data_parallel=_data_parallel(train))


def _data_parallel(train: TrainOptions) -> bool:
    """Whether the run reduces gradients across ranks (rpcompile.runtime.distributed)."""
    from rpcompile.runtime.distributed import resolve_group

    return resolve_group(train.process_group) is not None


def group_world(process_group: Any) -> int:
    """The ranks training together: the world size of the group the run uses
    (:func:`~rpcompile.runtime.distributed.resolve_group`), 1 without one."""
    from rpcompile.runtime.distributed import resolve_group

    group = resolve_group(process_group)
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def check_ranks(planned: int | None, world: int) -> None:
    """Refuse a schedule lowered for another number of data-parallel ranks than the run has:
    its REDUCE actions would not match the ranks' collectives."""
    if planned is not None and planned != world:
        have = (f"the process group has {world} ranks" if world > 1 else
                "this process trains alone (no torch.distributed process group)")
        raise InvalidInput(
            f"the plan was lowered for {planned} data-parallel ranks (PlanOptions.ranks) but "
            f"{have}: compile with ranks={world} or leave ranks unset (it follows the "
            "process group); for a plan of more ranks than run here, use the plan only to "
            "simulate (rpcompile plan --nodes)")


def planned_ranks(ranks: int | None, process_group: Any) -> int | None:
    """The ranks a compile lowers its schedule for: the process group's world size (a
    ``ranks`` that differs from it is refused), else ``ranks`` as given (planning only)."""
    world = group_world(process_group)
    if world == 1:
        return ranks
    check_ranks(ranks, world)
    return world


def default_timeout_s(compiled: Compiled) -> float:
    """The step watchdog's default: ``max(300 s, 20 x the plan's predicted step time)``."""
    predicted = float(getattr(compiled.plan, "predicted_step_ms", 0.0) or 0.0) / 1e3
    return max(TIMEOUT_FLOOR_S, TIMEOUT_PREDICTION_FACTOR * predicted)

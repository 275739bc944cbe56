"""The partition search's plan for a compile (from the plan cache when it holds the search), and
the one hardware profile a compile plans on."""

from __future__ import annotations

from functools import partial
from typing import Any

from rpcompile.compiler.profiles import _default_hardware
from rpcompile.compiler.shapes import _notice
from rpcompile.hardware import Hardware, get_hardware
from rpcompile.ir import Plan, UnitProfile
from rpcompile.options import (
    Options,
    PlanOptions,
    grad_check_passes,
)
from rpcompile.planner.partition import (
    PartitionError,
    StageCosting,
    partition,
)

__all__ = [
    "planning_hardware",
]


def _head_text(chunk: int | None) -> str:
    return "whole logits" if chunk is None else f"the LM head + loss in {chunk:,}-token chunks"


def _searched_plan(profiles: list[UnitProfile], hw: Hardware, mb_size: int, seq: int,
                   costing: StageCosting, run: PlanOptions, options: Options,
                   head: str = "") -> Plan:
    """The partition search's plan, from the plan cache when it holds this search
    (:mod:`rpcompile.planner.cache`). Data parallel, rank 0 alone searches (or reads the
    cache) and sends the plan to the others, so every rank runs the same plan."""
    from rpcompile.planner.cache import cache_folder, cached_plan, plan_key
    from rpcompile.runtime.distributed import resolve_group

    train = options.train
    checks = grad_check_passes(max_grad_norm=train.max_grad_norm, loss_scale=train.loss_scale)

    def search() -> Plan:
        import time

        _notice(run, f"rpcompile: searching stage cuts of {len(profiles)} units for "
                     f"{run.gpus} workers, microbatches of {mb_size} x {seq} tokens"
                     f"{', ' + head if head else ''} ...")
        t0 = time.perf_counter()
        try:
            plan = partition(profiles, hw, microbatch_size=mb_size, seq_len=seq,
                             costing=costing, options=run, grad_check_passes=checks)
        except PartitionError:
            _notice(run, f"rpcompile: searched in {time.perf_counter() - t0:.1f} s: "
                         f"no plan fits")
            raise
        _notice(run, f"rpcompile: searched in {time.perf_counter() - t0:.1f} s: "
                     f"predicted step {plan.predicted_step_ms:,.1f} ms")
        return plan

    def local() -> Plan:
        key, inputs = plan_key(profiles, hw, mb_size, seq, costing, run, run.capacity_bytes,
                               checks)
        plan, _ = cached_plan(search, key, inputs, profiles, cache_folder(run.plan_cache),
                              partial(_notice, run))
        return plan

    group = resolve_group(train.process_group)
    if group is None:
        return local()
    import torch.distributed as dist

    from rpcompile.planner.cache import plan_from_dict, plan_to_dict

    # Rank 0's search (or its failure, re-raised on every rank) reaches every rank.
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("plan", plan_to_dict(local()))
        except Exception as exc:
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    kind, payload = box[0]
    if kind == "error":
        raise payload
    return plan_from_dict(payload)


def planning_hardware(options: Options) -> Hardware:
    """The one place that decides the profile a compile plans on: the plan option's
    ``hardware`` (else :func:`_default_hardware`) with the plan's workers and link, and as
    this run uses the host: with or without the undo journal's copies, from pinned or
    pageable host memory (``PlanOptions.host_memory``: every transfer of every replay and
    bound of the search is timed at that bandwidth). Raises ``ValueError`` for pageable host
    memory on a profile without pageable figures (:meth:`Hardware.with_host_memory`)."""
    po = options.plan
    hw = get_hardware(po.hardware or _default_hardware()).with_gpus(po.gpus)
    hw = hw.with_undo_journal(po.undo_journal).with_host_memory(po.host_memory)
    if po.link is not None:
        hw = hw.with_link(po.link)
    return hw

"""The options of a compile, in three frozen groups that every layer reads.

- :class:`CaptureOptions`: how the model becomes a graph (loss, units, opaque blocks, the
  chunked LM head).
- :class:`PlanOptions`: everything the plan and its lowered schedule depend on (workers,
  microbatches, rounds, machine, optimizer mode, transfer pieces, device and host memory,
  the undo journal).
- :class:`TrainOptions`: how the runtime runs it (optimizer, workers' backend, watchdog,
  kernels, non-finite steps, loss scaling, clipping, data parallel, the host's RAM).

Each option is checked once, here, when its group is built; a bad value fails with the option's
name and what to pass instead. The options that take one of a few names have their choices
and their one check in :mod:`rpcompile.choices` (re-exported here). There is one form per
option: ``rpcompile.compile`` takes the groups (``capture=``, ``plan=``, ``train=``) and a
few everyday shortcuts, and every layer below it takes the groups only: the Trainer, its
Executor, the lowering entry ``rpcompile.passes.lower.runtime_schedule`` and the planner's
entries ``partition`` and ``longest_sequence``. The update order is decided by one rule,
:func:`update_order`, which every layer that meets it calls.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from rpcompile.choices import (
    CHOICES,
    DEVICES,
    HOST_MEMORY,
    KERNELS,
    MODES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_MODES,
    UPDATE_ORDERS,
    check_choice,
    check_option,
)
from rpcompile.errors import InvalidInput

__all__ = [
    "CHOICES",
    "DEFAULT_CHUNK_BYTES",
    "DEVICES",
    "HOST_MEMORY",
    "KERNELS",
    "MODES",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_MODES",
    "UPDATE_ORDERS",
    "CaptureOptions",
    "LossScaleConfig",
    "Options",
    "PlanOptions",
    "TrainOptions",
    "check_choice",
    "check_option",
    "deferred_reasons",
    "update_order",
]

# The options that take one of a few names (mode, updates, recompute, device, kernels,
# host_memory): their choices and their one check live in rpcompile.choices (which
# rpcompile.hardware reads too), re-exported here.
# Bulk transfers (weights, gradients) move in 64 MiB pieces, so a critical transfer queued
# behind one waits at most one piece: the one place the size is set.
DEFAULT_CHUNK_BYTES = 64 << 20


def _positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (``TrainOptions.loss_scale``): how the scale moves. Powers of two keep scaling and unscaling exact in binary floats."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    dynamic: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            problems.append(f"init_scale must be finite and > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            problems.append(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            problems.append(f"growth_interval must be >= 1, got {self.growth_interval}")
        if not 0 < self.min_scale <= self.init_scale <= self.max_scale < math.inf:
            problems.append(
                "need 0 < min_scale <= init_scale <= max_scale < inf, got "
                f"{self.min_scale}, {self.init_scale}, {self.max_scale}"
            )
        if problems:
            raise InvalidInput("invalid loss scale config: " + "; ".join(problems))


@dataclass(frozen=True)
class CaptureOptions:
    """How the model becomes a graph.

    - ``loss_fn``: ``loss_fn(outputs, *inputs) -> scalar``, for a model that returns no loss.
    - ``units``: module names that are the partition's units (``None``: found in the model).
    - ``opaque``: module names each kept whole as one opaque block.
    - ``compute_dtype``: a check that the model's parameters are in this dtype.
    - ``loss_chunk_tokens``: LM head + loss per this many tokens (``"auto"``; ``None``: never).
    """

    loss_fn: Callable | None = None
    units: Sequence[str] | None = None
    opaque: Sequence[str] | None = None
    compute_dtype: torch.dtype | None = None
    loss_chunk_tokens: int | str | None = "auto"

    def __post_init__(self) -> None:
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise InvalidInput(f"loss_fn must be callable, got {self.loss_fn!r}")
        for name in ("units", "opaque"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, str) or not all(isinstance(x, str) for x in v):
                    raise InvalidInput(f"{name} must be a list of module names, got {v!r}")
                object.__setattr__(self, name, tuple(v))
        if self.compute_dtype is not None and not isinstance(self.compute_dtype, torch.dtype):
            raise InvalidInput(f"compute_dtype must be a torch.dtype, got {self.compute_dtype!r}")
        c = self.loss_chunk_tokens
        if c is not None and c != "auto" and (isinstance(c, bool) or not isinstance(c, int)
                                              or c < 1):
            raise InvalidInput(f"loss_chunk_tokens must be a positive number of tokens, 'auto' "
                             f"or None, got {c!r}")


@dataclass(frozen=True)
class PlanOptions:
    """What the plan and its lowered schedule are made for (docs/compiler.md says how each acts).

    - ``gpus``: workers to plan for.
    - ``microbatches``: microbatches per round (``None``: ``gpus + 1``).
    - ``rounds``: rounds per step (gradient accumulation).
    - ``hardware``: a profile name or ``Hardware`` (``None``: the GPU here, else ``"cpu"``).
    - ``mode``: ``"sync"`` (exact) or ``"async"`` (step k's update overlaps step k+1).
    - ``chunk_bytes``: the piece size of bulk transfers in the lowered schedule.
    - ``schedule_steps``: steps of the lowered schedule the runtime cycles (``None``: fewest).
    - ``updates``: sync order ``"overlap"`` or ``"deferred"`` (``None``: :func:`update_order`).
    - ``recompute``: backward recompute by ``"stage"``, ``"layer"`` or ``"auto"`` (what fits).
    - ``ranks``: data-parallel processes (``None``: the process group's world size, else 1).
    - ``link``: the network between ranks, a preset name or ``Link`` (``None``: the profile's).
    - ``shard_optimizer``: data parallel, sync: each rank keeps 1/N of masters and state.
    - ``max_simulations``: a cap on simulator replays per search (``None``: the effort's).
    - ``search_effort``: ``"normal"``, ``"high"`` or ``"exhaustive"`` (until proven fastest).
    - ``dynamic``: plan anew for a batch larger than the proven shape (``False``: refuse it).
    - ``plan_cache``: searched plans on disk (``True``: the user's cache, a folder, ``False``).
    - ``progress``: show what planning does (``None``: when standard error is a terminal).
    - ``capacity_bytes``: device memory per worker the plan must fit (``None``: the profile's).
    - ``host_memory``: ``"pinned"`` or ``"pageable"`` host buffers, timed at their bandwidth.
    - ``undo_journal``: keep the optimizer's undo copies, so a failed step changes nothing.
    """

    gpus: int = 8
    microbatches: int | None = None
    rounds: int = 1
    hardware: Any = None
    mode: str = "sync"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    schedule_steps: int | None = None
    updates: str | None = None
    recompute: str = "auto"
    ranks: int | None = None
    link: Any = None
    shard_optimizer: bool = False
    max_simulations: int | None = None
    search_effort: str = "normal"
    dynamic: bool = True
    plan_cache: Any = True
    progress: bool | None = None
    capacity_bytes: int | None = None
    host_memory: str = "pinned"
    undo_journal: bool = True

    def __post_init__(self) -> None:
        _positive_int("gpus", self.gpus)
        for name in ("dynamic",):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInput(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise InvalidInput(f"progress must be True, False or None (on a terminal), got "
                             f"{self.progress!r}")
        if not isinstance(self.plan_cache, (bool, str, os.PathLike)):
            raise InvalidInput(f"plan_cache must be True (the user's cache folder), False (off) "
                             f"or a folder, got {self.plan_cache!r}")
        _positive_int("microbatches", self.microbatches, optional=True)
        _positive_int("rounds", self.rounds)
        check_option("mode", self.mode)
        _positive_int("chunk_bytes", self.chunk_bytes)
        _positive_int("max_simulations", self.max_simulations, optional=True)
        check_option("search_effort", self.search_effort)
        _positive_int("schedule_steps", self.schedule_steps, optional=True)
        if self.updates is not None:
            check_option("updates", self.updates)
        check_option("recompute", self.recompute)
        _positive_int("ranks", self.ranks, optional=True)
        _positive_int("capacity_bytes", self.capacity_bytes, optional=True)
        check_option("host_memory", self.host_memory)
        if not isinstance(self.undo_journal, bool):
            raise InvalidInput(f"undo_journal must be True or False, got {self.undo_journal!r}")
        if not isinstance(self.shard_optimizer, bool):
            raise InvalidInput(f"shard_optimizer must be True or False, got "
                             f"{self.shard_optimizer!r}")
        if self.shard_optimizer and self.mode != "sync":
            raise InvalidInput("shard_optimizer needs mode='sync': the sharded update and its "
                             "shadow gathering are built and tested for the sync schedule only "
                             "(an async step applies the previous step's gradients, which the "
                             "owner-reduce does not follow); use mode='sync', or "
                             "shard_optimizer=False to keep async updates")
        if self.link is not None:
            from rpcompile.hardware import get_link

            get_link(self.link)  # an unknown name fails here, with the known ones
        if self.hardware is not None and not isinstance(self.hardware, str):
            from rpcompile.hardware import Hardware

            if not isinstance(self.hardware, Hardware):
                raise InvalidInput(f"hardware must be a profile name or a Hardware, got "
                                 f"{self.hardware!r} (see `rpcompile hardware`)")

    @property
    def microbatches_per_round(self) -> int:
        return self.microbatches or self.gpus + 1


@dataclass(frozen=True)
class TrainOptions:
    """How the runtime runs the plan (docs/runtime.md says how each acts).

    - ``optimizer``: ``params -> torch.optim.Optimizer`` over the fp32 masters (``None``: AdamW).
    - ``device``: ``"auto"`` (CUDA when present, else virtual workers), ``"cuda"``, ``"virtual"``.
    - ``chaos``: a seed for the virtual workers' random delays (``None``: none).
    - ``kernels``: ``"auto"``, ``"torch"`` or ``"triton"`` (the interpreter on virtual workers).
    - ``skip_nonfinite``: drop a step whose gradients hold inf/NaN.
    - ``loss_scale``: ``True`` or a :class:`LossScaleConfig`: dynamic loss scaling (fp16, sync).
    - ``max_grad_norm``: clip by the global gradient norm before each update (``None``: off).
    - ``timeout_s``: the step watchdog (``None``: 20 x the predicted step, 300 s at least).
    - ``process_group``: a gloo group to train data parallel over (``None``: the default one).
    - ``host_ram_bytes``: the RAM the host state must fit (``None``: the profile's, else here).
    """

    optimizer: Callable | None = None
    device: str = "auto"
    chaos: int | None = None
    kernels: str = "auto"
    skip_nonfinite: bool = False
    loss_scale: Any = None
    max_grad_norm: float | None = None
    timeout_s: float | None = None
    process_group: Any = None
    host_ram_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer is not None and not (callable(self.optimizer) or isinstance(
                self.optimizer, torch.optim.Optimizer)):
            raise InvalidInput(f"optimizer must be a factory params -> torch.optim.Optimizer, "
                             f"got {self.optimizer!r}")
        check_option("device", self.device)
        check_option("kernels", self.kernels)
        if self.chaos is not None and (isinstance(self.chaos, bool)
                                       or not isinstance(self.chaos, int)):
            raise InvalidInput(f"chaos must be an integer seed (or None), got {self.chaos!r}")
        _positive_int("host_ram_bytes", self.host_ram_bytes, optional=True)
        if not isinstance(self.skip_nonfinite, bool):
            raise InvalidInput(f"skip_nonfinite must be True or False, got {self.skip_nonfinite!r}")
        g = self.max_grad_norm
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float))
                              or not g > 0 or math.isinf(g)):
            raise InvalidInput(f"max_grad_norm must be a positive number (or None: no "
                             f"clipping), got {g!r}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not t > 0):
            raise InvalidInput(f"timeout_s must be positive (math.inf: no watchdog), got {t!r}")
        if self.loss_scale is not None and self.loss_scale is not False and \
                self.loss_scale is not True:
            if not isinstance(self.loss_scale, LossScaleConfig):
                raise InvalidInput(f"loss_scale must be True, a LossScaleConfig or None, got "
                                 f"{self.loss_scale!r}")


@dataclass(frozen=True)
class Options:
    """The three groups of one compile, as ``Compiled.options`` keeps them."""

    capture: CaptureOptions = CaptureOptions()
    plan: PlanOptions = PlanOptions()
    train: TrainOptions = TrainOptions()

    def __post_init__(self) -> None:
        t = self.train
        # The default process group is known only once the Trainer starts; it decides again.
        update_order(self.plan.mode, self.plan.updates, deferred_reasons(
            max_grad_norm=t.max_grad_norm, loss_scale=t.loss_scale,
            skip_nonfinite=t.skip_nonfinite,
            data_parallel=t.process_group is not None or (self.plan.ranks or 1) > 1))


def deferred_reasons(*, max_grad_norm: float | None = None, loss_scale: Any = None,
                     skip_nonfinite: bool = False, data_parallel: bool = False) -> list[str]:
    """What in a run (either mode) must see every gradient of the step before any update, and so
    needs the ``deferred`` update order: clipping (the global norm), loss scaling (the
    unscale and the overflow check), skipping a non-finite step, and data parallel (an update
    reads the gradients summed over every rank)."""
    return [name for name, on in (
        ("max_grad_norm", max_grad_norm is not None),
        ("loss_scale", bool(loss_scale)),
        ("skip_nonfinite", bool(skip_nonfinite)),
        ("data parallel (a process group or ranks > 1: an update reads the gradients summed "
         "over every rank)", data_parallel)) if on]


# Passes over the host's fp32 gradients in a step's CHECK (rpcompile.passes.lower, timed by the
# simulator at the host's memory bandwidth): clipping reads every gradient for the global norm,
# then rescales it in place (torch's clip_grads_with_norm_: read and write); unscaling (loss
# scaling) rescales it in place.
CLIP_GRAD_PASSES = 3
UNSCALE_GRAD_PASSES = 2


def grad_check_passes(*, max_grad_norm: float | None = None, loss_scale: Any = None) -> int:
    """The passes over the fp32 gradients a run's step check makes (``Plan.grad_check_passes``):
    :data:`CLIP_GRAD_PASSES` with clipping, plus :data:`UNSCALE_GRAD_PASSES` with loss
    scaling; 0 when the check only gathers the loss and the non-finite flags."""
    return ((CLIP_GRAD_PASSES if max_grad_norm is not None else 0)
            + (UNSCALE_GRAD_PASSES if loss_scale else 0))


def update_order(mode: str, updates: str | None, reasons: Sequence[str],
                 fix: str = "updates='deferred' (or None, which picks it)") -> str:
    """The one rule of the update order (rpcompile.passes.lower.add_optimizer): the order a
    run of ``mode`` with the asked ``updates`` lowers and runs, or a refusal. Every layer
    that meets the order calls it: the option groups, the compile, the partitioner, the
    Trainer, an Executor given a schedule, the lowering.

    Sync mode: ``reasons`` (:func:`deferred_reasons`) need the whole step's gradients before
    any update, so they make ``None`` pick ``"deferred"`` and refuse ``"overlap"`` (which runs
    each stage's update while later backward jobs compute); without them ``None`` is
    ``"overlap"``. ``fix`` says what to pass instead. Async mode has one order, ``"overlap"``:
    step k's updates apply step k-1's gradients, checked, unscaled, clipped and reduced at
    step k-1's end, so ``"deferred"`` is refused there."""
    if mode == "async":
        if updates == "deferred":
            raise InvalidInput(
                "updates='deferred' is a sync-mode order: async updates apply the previous "
                "step's gradients, complete before the step starts; leave updates=None")
        return "overlap"
    if updates == "overlap" and reasons:
        raise InvalidInput(
            f"{', '.join(reasons)} must see every gradient of the step before any update, "
            f"but the 'overlap' update order ({mode} mode) runs each stage's update while later "
            f"backward jobs compute: use {fix}")
    return updates or ("deferred" if reasons else "overlap")


# The group each option belongs to, by name (no two groups share a field name): how a flat
# configuration (``rpcompile train --config``, TRL's ``rpcompile={...}``) is read into groups.
FLAT: dict[str, str] = {f.name: group for group, cls in (
    ("capture", CaptureOptions), ("plan", PlanOptions), ("train", TrainOptions))
    for f in fields(cls)}

"""The options of a compile, in three frozen groups that every layer reads.

- :class:`CaptureOptions`: how the model becomes a graph (loss, units, opaque blocks, the
  chunked LM head).
- :class:`PlanOptions`: what the plan and its lowered schedule are made for (workers,
  microbatches, rounds, machine, optimizer mode, transfer pieces).
- :class:`TrainOptions`: how the runtime runs it (optimizer, workers' backend, watchdog,
  kernels, non-finite steps, loss scaling, clipping, the host's RAM, the undo journal,
  pinned or pageable host memory).

Each option is checked once, here, when its group is built; a bad value fails with the option's
name and what to pass instead. The options that take one of a few names have their choices
and their one check in :mod:`rpcompile.choices` (re-exported here): a lower layer that is
public and takes such a value as a plain string calls that check, and the layers below
``compile`` read the groups it resolved (``Compiled.options``): the Trainer, its Executor
(``options=``), the lowering entry ``rpcompile.passes.lower.runtime_schedule`` and the
planner's entries ``partition`` and ``longest_sequence`` (``options=``; their loose keywords
build the group, :func:`entry_plan_options`). ``rpcompile.compile`` takes the groups
(``capture_options=``, ``plan_options=``, ``train_options=``) and, for scripts written
against the flat form, every option as a plain keyword too; the two are merged by
:func:`resolve`, which refuses an option given both ways.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
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
from rpcompile.errors import InvalidInput, InvalidType

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
    "entry_plan_options",
    "resolve",
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
    """``loss_fn``: ``loss_fn(outputs, *inputs) -> scalar`` for a model that returns no loss
    (a Hugging Face causal LM needs none). ``units``/``opaque``: module names that are the
    partition's units / are kept whole as one opaque block. ``compute_dtype``: a check that
    the model's parameters are in this dtype. ``loss_chunk_tokens``: compute a causal LM's head
    and loss this many tokens at a time (``"auto"``: 4,096 when a microbatch's fp32 logits
    would pass 1 GiB; ``None``: never chunk)."""

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
    """``gpus``: workers to plan for. ``microbatches``: per round (``None``: ``gpus + 1``).
    ``rounds``: rounds per step (gradient accumulation). ``hardware``: a profile name or
    :class:`~rpcompile.hardware.Hardware` (``None``: a probe of the GPU here, else ``"cpu"``,
    the virtual workers' profile). ``mode``: ``"sync"`` (exact) or ``"async"`` (the update of
    step k overlaps step k+1, one step stale): the optimizer's place in the schedule.
    ``chunk_bytes``: the piece size of bulk transfers in the lowered schedule.
    ``schedule_steps``: steps of the lowered schedule the runtime cycles through (``None``:
    as many as an edge reaches back, then two dealing periods, the first repeated by a long
    run, rpcompile.passes.schedule.runtime_cycle; fewer: the run goes through them whole
    again and again, each pass after the one before committed).
    ``updates``: the sync update order in the schedule (async has one: ``"deferred"`` is
    refused there), ``"overlap"`` (each stage's update as
    soon as its gradients are home, while later backward jobs compute) or ``"deferred"``
    (after the step's last gradient); ``None``: deferred when clipping, loss scaling,
    ``skip_nonfinite`` or data parallel need the whole step's gradients, else overlap.
    ``recompute``: how a backward stage recomputes its forward: ``"stage"`` (one forward with
    autograd, keeping every layer's activations for one backward), ``"layer"`` (a forward
    keeping only the layer boundaries, then each layer recomputed and backpropagated alone:
    one more forward, one layer's activations at a time) or ``"auto"``: stage recompute
    unless its plan does not fit the GPUs' usable memory (and ``capacity_bytes``), then the
    faster plan that fits, cut again by stage or layer by layer (the plan's notes say
    which). ``ranks``: processes training data parallel, one pipeline each (docs/distributed.md):
    above 1 the lowered schedule reduces each stage's gradients across ranks (REDUCE
    actions on the host's network lane); ``None``: the process group's world size (1
    without one); a value that differs from a group's world size is refused. ``link``: the
    network between ranks the simulator times REDUCE on, a preset name (``"eth25"``,
    ``"eth100"``, see ``rpcompile hardware``) or a :class:`~rpcompile.hardware.Link`;
    ``None``: the hardware profile's own link, if it has one. ``shard_optimizer`` (data
    parallel, sync mode): each rank keeps the fp32 masters and optimizer state of 1/N of the
    trainable parameters (ZeRO-1 style: gradients reduced to their owners, updated shadows
    broadcast back by them); the lowered schedule says so (``Schedule.sharded``), so the
    simulator times those collectives; on one process it changes nothing (the one shard is
    everything). ``search_effort``: what the partition search spends
    (rpcompile.planner.partition.SEARCH_BUDGETS): ``"normal"`` (a few simulator replays and
    a short local search), ``"high"`` (many) or ``"exhaustive"`` (no cap on replays:
    the search ends only once its plan is proven the simulator's fastest of its candidates).
    ``max_simulations``: a cap on simulator replays per search instead of the effort's; a
    search stopped at its cap says so in the plan's notes, with the proven gap.

    ``dynamic``: the plan follows the data. A batch larger than the proven shape (more
    sequences per microbatch, or longer) is planned for anew (for the larger of the two shapes
    in each dimension, so every earlier batch still fits), with a one-line notice; ``False``
    refuses it instead. ``plan_cache``: where searched plans are kept on disk, keyed by
    everything a plan depends on (``True``: ``$RPCOMPILE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/rpcompile/plans``, else ``~/.cache/rpcompile/plans``; a path: that
    folder; ``False``: no cache). ``progress``: show what planning is doing (a progress bar
    during the search, a line per plan made); ``None``: when standard error is a terminal."""

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


def entry_plan_options(options: PlanOptions | None, entry: str, *,
                       names: Mapping[str, str] | None = None,
                       defaults: Mapping[str, Any] | None = None,
                       **loose: Any) -> PlanOptions:
    """The plan options of a public planner entry (``partition``, ``longest_sequence``) that
    takes the group (``options=``) or, as scripts written before it do, the plan options as
    loose keywords.

    ``loose``: the loose keywords by :class:`PlanOptions` field name, ``None`` where not given;
    ``names``: field -> the entry's own keyword where they differ (``partition``'s ``workers``
    is ``gpus``, its ``optimizer`` is ``mode``); ``defaults``: the loose form's own defaults
    where they are not the group's (``partition``'s ``optimizer`` is ``"async"``). With the
    group, a loose keyword given too is refused, as ``runtime_schedule`` refuses it (which
    one was meant cannot be known); without it they build the group, so each is checked by
    the group's one rule, and a bad value is refused with the group's message under the
    entry's own name for it."""
    names = names or {}
    given = {k: v for k, v in loose.items() if v is not None}
    if options is not None:
        if not isinstance(options, PlanOptions):
            raise InvalidType(f"{entry}'s options must be an rpcompile.PlanOptions, got "
                            f"{type(options).__name__}")
        if given:
            renamed = ", ".join(sorted(f"{names[k]} is {k}" for k in given if k in names))
            raise InvalidType(f"{entry} takes PlanOptions or loose keywords, not both: "
                            f"{', '.join(sorted(names.get(k, k) for k in given))} given beside "
                            f"options=; set them in the PlanOptions"
                            + (f" ({renamed})" if renamed else ""))
        return options
    try:
        return PlanOptions(**{**(defaults or {}), **given})
    except ValueError as err:  # each field's message starts with the field's name
        head, space, rest = str(err).partition(" ")
        raise InvalidInput(names.get(head, head) + space + rest) from None


@dataclass(frozen=True)
class TrainOptions:
    """``optimizer``: a factory ``params -> torch.optim.Optimizer`` over the fp32 masters
    (``None``: AdamW, lr 1e-4). ``device``: ``"auto"`` (CUDA when present, else virtual CPU
    workers with a warning), ``"cuda"`` or ``"virtual"``. ``chaos``: a seed for the virtual
    workers' random delays. ``capacity_bytes``: device memory per virtual worker (``None``:
    unlimited, accounted). ``kernels``: ``"auto"`` (Triton on CUDA, the torch reference
    elsewhere), ``"torch"`` or ``"triton"`` (Triton's interpreter on virtual workers).
    ``skip_nonfinite``: drop a step whose gradients hold inf/NaN. ``loss_scale``: ``True`` or a
    :class:`~rpcompile.runtime.loss_scale.LossScaleConfig`: dynamic loss scaling for fp16
    (sync mode). ``max_grad_norm``: clip by the global gradient norm before each update.
    ``timeout_s``: the step watchdog (``None``: ``max(300 s, 20 x the predicted step)``;
    ``math.inf``: off). ``process_group``: a gloo ``torch.distributed`` group to train data
    parallel over (``None``: the default group once ``init_process_group`` ran with more
    than one rank, else one process; docs/distributed.md; ``shard_optimizer`` is a
    :class:`PlanOptions` field). ``host_ram_bytes``: the host RAM the plan's host state
    (rpcompile.passes.memory.HostMemory) must fit, beside ``capacity_bytes`` for the
    devices; ``None``: for ``compile()`` the hardware profile's ``host_ram_gib`` when it has
    one, else this machine's RAM; for the Trainer, which allocates here, this machine's.
    ``compile()`` warns when the plan needs more (it allocates nothing, and a plan may be
    for another server); the Trainer refuses to build its host store.
    ``undo_journal``: before each update the optimizer driver copies what it changes (fp32
    masters, optimizer state, the shadows it rewrites; 14 bytes per trainable parameter
    for AdamW and bf16, held until the step commits) so that a failed step is undone and
    training goes on. ``False`` saves that host memory and the copy's time on every OPT,
    but a failed step then leaves the masters half-updated: the Trainer refuses every
    further step (and reading the masters) until a checkpoint is loaded
    (docs/runtime.md, "the undo journal").
    ``host_memory``: ``"pinned"`` (the default: on CUDA the host store's flat buffers are
    registered with the driver at their exact size and the transfer staging is
    ``pin_memory=True``) or ``"pageable"`` (nothing pinned, as RoundPipe's
    ``pin_model="off"``): the simulator and the partitioner then time every host<->GPU
    transfer at the profile's ``pageable_h2d_gbps`` / ``pageable_d2h_gbps`` (a profile
    without them is refused at compile time), and ``HostMemory.pinned`` is 0. The static
    host bytes are the same either way (exact-size buffers); virtual workers compute the
    same either way."""

    optimizer: Callable | None = None
    device: str = "auto"
    chaos: int | None = None
    capacity_bytes: int | None = None
    kernels: str = "auto"
    skip_nonfinite: bool = False
    loss_scale: Any = None
    max_grad_norm: float | None = None
    timeout_s: float | None = None
    process_group: Any = None
    host_ram_bytes: int | None = None
    undo_journal: bool = True
    host_memory: str = "pinned"

    def __post_init__(self) -> None:
        if self.optimizer is not None and not (callable(self.optimizer) or isinstance(
                self.optimizer, torch.optim.Optimizer)):
            raise InvalidInput(f"optimizer must be a factory params -> torch.optim.Optimizer, "
                             f"got {self.optimizer!r}")
        check_option("device", self.device)
        check_option("kernels", self.kernels)
        check_option("host_memory", self.host_memory)
        if self.chaos is not None and (isinstance(self.chaos, bool)
                                       or not isinstance(self.chaos, int)):
            raise InvalidInput(f"chaos must be an integer seed (or None), got {self.chaos!r}")
        _positive_int("capacity_bytes", self.capacity_bytes, optional=True)
        _positive_int("host_ram_bytes", self.host_ram_bytes, optional=True)
        if not isinstance(self.undo_journal, bool):
            raise InvalidInput(f"undo_journal must be True or False, got {self.undo_journal!r}")
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
        # The default process group is known only once the Trainer starts; it checks again.
        check_update_order(self.plan.mode, self.plan.updates, deferred_reasons(
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


def check_update_order(mode: str, updates: str | None, reasons: Sequence[str],
                       fix: str = "updates='deferred' (or None, which picks it)") -> None:
    """The one rule of the update order, checked wherever options meet (the options groups,
    the Trainer, an Executor given a schedule): a sync ``overlap`` order runs each stage's
    update while later backward jobs compute, so it is refused when ``reasons``
    (:func:`deferred_reasons`) need the whole step's gradients first; ``fix`` says what to
    pass instead. Async mode has one order and needs none of this: step k's updates apply
    step k-1's gradients, checked, unscaled, clipped and reduced at step k-1's end (the
    lowering refuses ``deferred`` there)."""
    if mode == "async":
        if updates == "deferred":
            raise InvalidInput(
                "updates='deferred' is a sync-mode order: async updates apply the previous "
                "step's gradients, complete before the step starts; leave updates=None")
        return
    if updates == "overlap" and reasons:
        raise InvalidInput(
            f"{', '.join(reasons)} must see every gradient of the step before any update, "
            f"but the 'overlap' update order ({mode} mode) runs each stage's update while later "
            f"backward jobs compute: use {fix}")


_GROUPS: dict[str, type] = {"capture": CaptureOptions, "plan": PlanOptions,
                            "train": TrainOptions}
# Which group each flat keyword of ``compile`` belongs to.
FLAT: dict[str, str] = {f.name: g for g, cls in _GROUPS.items() for f in fields(cls)}


def resolve(groups: Mapping[str, Any], flat: Mapping[str, Any]) -> Options:
    """One :class:`Options` from the groups given (``None``: defaults) and flat keywords.

    An option given both in its group (set to something other than the group's default) and
    as a keyword is refused: which one was meant cannot be known."""
    built: dict[str, Any] = {}
    for g, cls in _GROUPS.items():
        given = groups.get(g)
        if given is not None and not isinstance(given, cls):
            raise InvalidInput(f"{g}_options must be an rpcompile.{cls.__name__}, got "
                             f"{type(given).__name__}")
        base = given if given is not None else cls()
        mine = {k: v for k, v in flat.items() if FLAT.get(k) == g}
        if given is not None:
            default = cls()
            twice = sorted(k for k in mine if getattr(given, k) != getattr(default, k))
            if twice:
                raise InvalidInput(f"{', '.join(twice)} given both as a keyword and in "
                                 f"{g}_options: pass each option once")
        built[g] = replace(base, **mine) if mine else base
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise InvalidType(f"unknown option(s) {', '.join(unknown)}")
    return Options(**built)

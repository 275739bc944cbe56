"""Host memory: flat master, shadow and gradient buffers, and the views the runtime needs.

The host keeps, for every parameter, exactly one of each of:

- **master** (fp32, trainable parameters only): what the optimizer updates;
- **shadow** (compute dtype: bf16/fp16, or fp32 when training in fp32; every parameter the
  stages use, trainable or frozen): the copy that gets uploaded;
- **grad** (fp32, trainable only): where gradients from every round and every use sum up;
  with async updates shifted into the next step a second one, **pending**, holds the last
  completed step's gradients until the next step applies them (:meth:`HostStore.add_pending`).

Async runs also keep a second copy of the trainable parameters' shadow
(:meth:`HostStore.add_shadow_pair`): step k uploads copy ``k % 2`` while step k+1, running at
the same time, uploads the other, which step k's SHADOW actions wrote.

Each kind is ONE flat buffer, allocated at its exact size (no rounding), pinned on CUDA by
registering the allocation with the driver (the caching pinned allocator would round each
buffer up to a power of two), unless the run asked for pageable host memory
(``TrainOptions.host_memory="pageable"``, :func:`pin_host_memory`): then the same exact-size
buffers are left pageable, so the host bytes are the same either way. Parameters are laid out in the order they first appear when
walking the stages in order, so a stage made of contiguous units is one contiguous range of the
flat buffers and uploads as ONE copy; a stage whose parameters are not contiguous (a tied weight
owned by an earlier stage, e.g. the LM head tied to the embedding) uploads one copy per
contiguous *segment*. Stages may overlap (RoundPipe's forward and backward stages cover the same
units cut differently): a parameter is stored once whichever stages use it, and the gradients
of all its uses are summed into its one master gradient.

A frozen quantized weight (a QLoRA base, :class:`rpcompile.capture.quantized.PackedWeight`)
has no shadow: the host keeps it **packed**, its codes and quantization state as one record of
a flat byte buffer (pinned or pageable like the others), laid out in stage order too; a job
uploads its stage's packed records (:attr:`StageBuffers.packed`) and the worker rebuilds the
weights in the compute dtype (:meth:`StageBuffers.packed_views`,
:func:`rpcompile.runtime.kernels.dequantize_packed`).

Sections, in reading order:
  1. Layout values: ParamSlot, Segment, StageLayout, PackedLayout, StageBuffers, MemoryReport
  2. HostStore: build, shadow refresh, gradient accumulation, masters for the optimizer
  3. HostStaging: the transfers' host buffers, exact size, kept for reuse
  4. Helpers: exact-size (optionally pinned) flat buffers, contiguous runs, shard bounds

**Sharded masters** (data parallel with ``shard_optimizer``, :meth:`HostStore.shard_masters`):
the master buffer then holds only the element range ``[master_start, master_stop)`` of the
master index space (whole parameters, :func:`shard_bounds`); every offset stays the global
one and is translated here. The shadow and gradient buffers stay whole: every stage uploads
its whole shadow, and every job's gradients land in the whole gradient buffer before they are
reduced to their owner.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from rpcompile.errors import InvalidInput, InvalidType, MissingKey, StateError
from rpcompile.ir import STAGING_FIT
from rpcompile.options import check_option
from rpcompile.runtime.errors import format_bytes
from rpcompile.runtime.kernels import cast_pack

__all__ = [
    "HostStaging",
    "HostStore",
    "MemoryReport",
    "ParamSlot",
    "Segment",
    "StageBuffers",
    "StageLayout",
    "pin_host_memory",
    "shard_bounds",
]


# ============================================================================================
# 1. Layout values
# ============================================================================================


@dataclass(frozen=True)
class ParamSlot:
    """One unique parameter (tied names share a slot).

    ``shadow_offset`` is its element offset in the shadow flat buffer; ``master_offset`` its
    element offset in the master and gradient flat buffers (-1 when frozen). ``stages`` are the
    stages that use it; ``grad_stages`` those of them that produce a gradient for it; ``owner``
    is the first stage that uses it.
    """

    index: int
    names: tuple[str, ...]
    shape: tuple[int, ...]
    numel: int
    trainable: bool
    shadow_offset: int
    master_offset: int
    stages: tuple[int, ...]
    grad_stages: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def owner(self) -> int:
        return self.stages[0]


@dataclass(frozen=True)
class Segment:
    """A contiguous element range ``[start, stop)`` of a host flat buffer, placed at
    ``device_offset`` in the stage's device flat buffer: one transfer."""

    start: int
    stop: int
    device_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StageLayout:
    """Where a stage's parameters live on the host and in its device flat buffers.

    The device weight buffer of the stage is the concatenation of ``shadow_segments`` (in
    order, ``shadow_numel`` elements of the compute dtype); its device gradient buffer is the
    concatenation of ``grad_segments`` (``grad_numel`` fp32 elements, trainable parameters
    only). ``weight_offsets[name]`` / ``grad_offsets[name]`` give each name's element offset in
    those device buffers; tied names point at the same offset.
    """

    stage: int
    names: tuple[str, ...]
    slots: tuple[int, ...]
    shadow_segments: tuple[Segment, ...]
    grad_segments: tuple[Segment, ...]
    weight_offsets: dict[str, int] = field(compare=False)
    grad_offsets: dict[str, int] = field(compare=False)
    shapes: dict[str, tuple[int, ...]] = field(compare=False)

    @property
    def shadow_numel(self) -> int:
        return sum(s.numel for s in self.shadow_segments)

    @property
    def grad_numel(self) -> int:
        return sum(s.numel for s in self.grad_segments)


@dataclass(frozen=True)
class PackedLayout:
    """Where a stage's frozen quantized weights live in the host's packed byte buffer.

    The stage's device packed buffer is the concatenation of ``segments`` (byte ranges of the
    host buffer, ``nbytes`` in all); ``parts[name]`` gives each tensor of a weight's record
    (its name in :attr:`PackedWeight.state`, or ``"packed"``) as (byte offset in that device
    buffer, dtype, shape).
    """

    stage: int
    names: tuple[str, ...]
    segments: tuple[Segment, ...]
    parts: dict[str, tuple[tuple[str, int, torch.dtype, tuple[int, ...]], ...]] = field(
        compare=False)

    @property
    def nbytes(self) -> int:
        return sum(s.numel for s in self.segments)


@dataclass(frozen=True)
class StageBuffers:
    """A stage's host buffers: one flat view per segment (what the transfers copy)."""

    layout: StageLayout
    shadow: tuple[torch.Tensor, ...]  # compute dtype, one per shadow segment: upload these
    master: tuple[torch.Tensor, ...]  # fp32, one per grad segment
    grad: tuple[torch.Tensor, ...]  # fp32, one per grad segment
    # uint8, one per packed segment (frozen quantized weights): upload these too
    packed: tuple[torch.Tensor, ...] = ()
    packed_layout: PackedLayout | None = None
    formats: dict[str, object] = field(default_factory=dict, compare=False)  # name -> PackedWeight

    def packed_views(self, data: torch.Tensor) -> dict[str, object]:
        """The stage's quantized weights as PackedWeights whose tensors are views into
        ``data``, the stage's packed bytes as uploaded (uint8, ``packed_layout.nbytes``, the
        segments end to end): what the worker dequantizes."""
        layout = self.packed_layout
        if layout is None or data.dtype != torch.uint8 or data.numel() != layout.nbytes:
            need = 0 if layout is None else layout.nbytes
            raise InvalidInput(f"stage {self.layout.stage}: packed buffer of {data.numel()} "
                             f"{data.dtype} elements, the layout needs {need} uint8")
        out = {}
        for name in layout.names:
            views = {part: _byte_view(data, offset, dtype, shape)
                     for part, offset, dtype, shape in layout.parts[name]}
            weight = self.formats[name]
            out[name] = replace(weight, packed=views["packed"],
                                state=tuple((k, views[k]) for k, _ in weight.state))
        return out

    def device_views(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of every parameter of the stage into its uploaded device weight buffer."""
        if weights.numel() != self.layout.shadow_numel:
            raise InvalidInput(
                f"stage {self.layout.stage}: weight buffer has {weights.numel()} elements, "
                f"the layout needs {self.layout.shadow_numel}"
            )
        return _views(weights, self.layout.weight_offsets, self.layout.shapes)

    def grad_views(self, grads: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of every trainable parameter into a flat gradient buffer of this stage."""
        if grads.numel() != self.layout.grad_numel:
            raise InvalidInput(
                f"stage {self.layout.stage}: gradient buffer has {grads.numel()} elements, "
                f"the layout needs {self.layout.grad_numel}"
            )
        return _views(grads, self.layout.grad_offsets, self.layout.shapes)

    def shadow_views(self) -> dict[str, torch.Tensor]:
        """Host views of every parameter's shadow (for checks and for a CPU reference)."""
        flat = torch.cat(list(self.shadow)) if len(self.shadow) != 1 else self.shadow[0]
        return _views(flat, self.layout.weight_offsets, self.layout.shapes)


def _views(
    flat: torch.Tensor, offsets: dict[str, int], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    out = {}
    for name, offset in offsets.items():
        shape = shapes[name]
        numel = 1
        for d in shape:
            numel *= d
        out[name] = flat[offset : offset + numel].view(shape)
    return out


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


# ============================================================================================
# 2. HostStore
# ============================================================================================


class HostStore:
    """The host's copy of the model: flat master / shadow / gradient buffers and their views.

    Build it with :meth:`build`. Thread safety: :meth:`accumulate_grad` may be called from
    several threads at once (a lock serialises the adds, which also makes the summation order
    of a tied parameter's contributions the call order); the other methods are meant to be
    called by one thread at a time per parameter (the optimizer driver sequences them).
    """

    def __init__(
        self,
        slots: tuple[ParamSlot, ...],
        layouts: tuple[StageLayout, ...],
        shadow: torch.Tensor,
        master: torch.Tensor,
        grad: torch.Tensor,
        pin: str,
        packed: torch.Tensor | None = None,
        packed_layouts: tuple[PackedLayout, ...] = (),
        packed_weights: dict | None = None,
    ) -> None:
        self.slots = slots
        # Frozen quantized weights: one flat uint8 buffer of packed records, and each weight
        # as a PackedWeight whose tensors are views into it.
        self.packed = torch.empty(0, dtype=torch.uint8) if packed is None else packed
        self.packed_weights = dict(packed_weights or {})
        self._packed_layouts = packed_layouts or tuple(
            PackedLayout(layout.stage, (), (), {}) for layout in layouts)
        self.shadow = shadow
        self.master = master
        self.grad = grad
        self.compute_dtype = shadow.dtype
        self.pin = pin
        # Backend of the shadow refresh on these CPU tensors (rpcompile.runtime.kernels):
        # "auto" is torch; "triton" runs Triton's interpreter, which only a run on virtual
        # workers asks for (the Trainer sets it by kernels.host_backend).
        self.kernels = "auto"
        self._by_name = {name: slot for slot in slots for name in slot.names}
        self._lock = threading.Lock()
        self.stages = tuple(self._stage_buffers(layout, packed_layout)
                            for layout, packed_layout in zip(layouts, self._packed_layouts))
        self._masters: list[torch.nn.Parameter] | None = None
        # The master index range this store holds (all of it unless shard_masters ran).
        self.master_start = 0
        self.master_stop = master.numel()
        self.rank, self.ranks = 0, 1
        self._owned = tuple(s for s in slots if s.trainable)
        self._stage_runs = [_runs([slots[i] for i in lay.slots]) for lay in layouts]
        # Async updates shifted into the next step (:meth:`add_pending`): a second fp32
        # gradient buffer holding the last completed step's gradients until the next step's
        # OPTs (or a flush) apply them, while ``grad`` accumulates the running step's.
        self.pending: torch.Tensor | None = None
        # Async steps overlapping (:meth:`add_shadow_pair`): copy 1 of the trainable
        # parameters' shadow, laid out as the masters (copy 0 is ``shadow``; a frozen
        # parameter has one copy, read by both), and the copy the next step to run reads.
        self.shadow_pair: torch.Tensor | None = None
        self.shadow_version = 0

    # -- construction --------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        stage_params: Sequence[Sequence[tuple[str, torch.Tensor]]],
        compute_dtype: torch.dtype = torch.float32,
        pin: bool = False,
        grad_stages: Iterable[int] | None = None,
        share_frozen: bool = True,
        packed: dict | None = None,
    ) -> HostStore:
        """Lay out and fill the host buffers from each stage's ``(fqn, tensor)`` list.

        ``share_frozen``: a frozen tensor (``requires_grad=False``) on the CPU, already in the
        compute dtype, is then made a view of its shadow (``tensor.data`` rebound), so the module
        and the store hold one copy of it, not two (a frozen LoRA base: its whole size).
        Trainable tensors keep their own storage; :meth:`load_into_module` (the trainer's
        ``sync_to_model``) writes the trained masters into them.

        A tensor appearing under several names or in several stages (tied or shared) is
        stored once: identity is the tensor object, or the same storage, offset, shape and
        stride. A tensor is trainable when ``requires_grad`` is True. ``grad_stages`` are the
        stages that produce gradients (default: all); every trainable parameter must be in one.
        ``pin=True`` needs CUDA.

        ``packed``: the frozen quantized weights by parameter name
        (``Captured.quantized``, PackedWeights). Each is kept packed in :attr:`packed`, not in
        the shadow; with ``share_frozen`` its tensors (the module's packed parameter and its
        quantization state) become views of that record. Any other non-floating parameter is
        refused: casting packed codes to the compute dtype would lose what they mean.
        """
        packed = dict(packed or {})
        stage_packed = [[(n, t) for n, t in params if n in packed] for params in stage_params]
        stage_params = [[(n, t) for n, t in params if n not in packed]
                        for params in stage_params]
        for params in stage_params:
            for name, tensor in params:
                if not tensor.is_floating_point():
                    raise InvalidInput(
                        f"parameter {name!r} has dtype {tensor.dtype}: a quantized weight is kept "
                        "packed only when given in packed= (its PackedWeight, Captured.quantized)")
        if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidInput(f"compute_dtype must be float32, bfloat16 or float16, not {compute_dtype}")
        grad_set = set(range(len(stage_params)) if grad_stages is None else grad_stages)
        keys: dict[object, int] = {}
        tensors: list[torch.Tensor] = []
        objects: list[list[torch.Tensor]] = []  # every tensor object of each slot
        names: list[list[str]] = []
        uses: list[list[int]] = []
        seen_names: dict[str, int] = {}
        for stage, params in enumerate(stage_params):
            for name, tensor in params:
                if tensor.device.type == "meta":
                    raise InvalidInput(f"parameter {name!r} is on the meta device; materialize it first")
                key = _identity(tensor)
                index = keys.get(key)
                if index is None:
                    index = keys[key] = len(tensors)
                    tensors.append(tensor)
                    objects.append([])
                    names.append([])
                    uses.append([])
                if not any(t is tensor for t in objects[index]):
                    objects[index].append(tensor)
                if name in seen_names and seen_names[name] != index:
                    raise InvalidInput(f"name {name!r} is given for two different tensors")
                seen_names[name] = index
                if name not in names[index]:
                    names[index].append(name)
                if stage not in uses[index]:
                    uses[index].append(stage)

        slots = []
        shadow_at = master_at = 0
        for i, tensor in enumerate(tensors):
            trainable = bool(tensor.requires_grad)
            numel = tensor.numel()
            contributing = tuple(s for s in uses[i] if s in grad_set)
            if trainable and not contributing:
                raise InvalidInput(
                    f"trainable parameter {names[i][0]!r} is used only by stages {uses[i]}, "
                    f"none of which produces gradients ({sorted(grad_set)}); freeze it "
                    "(requires_grad=False) or include a backward stage that uses it"
                )
            slots.append(ParamSlot(
                index=i, names=tuple(names[i]), shape=tuple(tensor.shape), numel=numel,
                trainable=trainable, shadow_offset=shadow_at,
                master_offset=master_at if trainable else -1, stages=tuple(uses[i]),
                grad_stages=contributing if trainable else (),
            ))
            shadow_at += numel
            if trainable:
                master_at += numel

        buffers, pin_kinds = [], []
        for numel, dtype in ((shadow_at, compute_dtype), (master_at, torch.float32),
                             (master_at, torch.float32)):
            flat, kind = _host_flat(numel, dtype, pin)
            buffers.append(flat)
            pin_kinds.append(kind)
        # A buffer whose registration fell back is the one the report names.
        pin_kind = next((k for k in pin_kinds if k not in ("no", "registered")), pin_kinds[0])
        shadow, master, grad = buffers
        grad.zero_()
        with torch.no_grad():
            for slot, tensor in zip(slots, tensors):
                source = tensor.detach().reshape(-1)
                shadow_view = shadow[slot.shadow_offset : slot.shadow_offset + slot.numel]
                if not slot.trainable:
                    shadow_view.copy_(source)
                    if (share_frozen and tensor.dtype == compute_dtype
                            and tensor.device.type == "cpu"):
                        # The module's frozen parameter becomes a view of its shadow: one
                        # copy on the host, not two. A frozen shadow is never rewritten
                        # (SHADOW refreshes trainable parameters only), so the module reads
                        # what the workers upload.
                        for obj in objects[slot.index]:
                            obj.data = shadow_view.view(slot.shape)
                else:
                    # The master is the parameter's own value in fp32; the shadow of a trainable
                    # parameter is then the master cast down, as after every update.
                    m = master[slot.master_offset : slot.master_offset + slot.numel]
                    m.copy_(source)
                    shadow_view.copy_(m)

        layouts = []
        for stage, params in enumerate(stage_params):
            stage_slots: list[int] = []
            for name, _ in params:
                index = seen_names[name]
                if index not in stage_slots:
                    stage_slots.append(index)
            layouts.append(_layout(stage, [n for n, _ in params], stage_slots, slots, seen_names))
        flat, packed_layouts, weights = _pack(stage_packed, packed, pin, share_frozen)
        return cls(tuple(slots), tuple(layouts), shadow, master, grad, pin_kind, flat,
                   packed_layouts, weights)

    def _stage_buffers(self, layout: StageLayout,
                       packed_layout: PackedLayout | None = None) -> StageBuffers:
        packed_layout = packed_layout or PackedLayout(layout.stage, (), (), {})
        return StageBuffers(
            layout=layout,
            shadow=tuple(self.shadow[s.start : s.stop] for s in layout.shadow_segments),
            master=tuple(self.master[s.start : s.stop] for s in layout.grad_segments),
            grad=tuple(self.grad[s.start : s.stop] for s in layout.grad_segments),
            packed=tuple(self.packed[s.start : s.stop] for s in packed_layout.segments),
            packed_layout=packed_layout,
            formats={n: self.packed_weights[n] for n in packed_layout.names},
        )

    def shard_masters(self, start: int, stop: int, rank: int, ranks: int) -> None:
        """Keep only the masters of the element range ``[start, stop)`` of the master index
        space (it must fall on parameter boundaries: :func:`shard_bounds`); the full master
        buffer is released. Call once, before any optimizer is built over :meth:`masters`."""
        if self._masters is not None:
            raise StateError("shard_masters() after masters() was taken: build the optimizer "
                               "after sharding")
        if self.master_start != 0 or self.master_stop != self.master.numel():
            raise StateError("the masters are already sharded")
        total = self.master.numel()
        owned = tuple(s for s in self.trainable_slots
                      if (start <= s.master_offset < stop and s.master_offset + s.numel <= stop)
                      or (s.master_offset == stop == total and rank == ranks - 1))
        cut = [s.name for s in self.trainable_slots
               if s not in owned and s.master_offset < stop
               and s.master_offset + s.numel > start and s.numel]
        if cut:
            raise InvalidInput(f"shard [{start}, {stop}) cuts parameters {cut[:3]}; shards hold "
                             "whole parameters (rpcompile.runtime.memory.shard_bounds)")
        kept, _ = _host_flat(stop - start, torch.float32, self.pin != "no")
        kept.copy_(self.master[start:stop])
        self.master = kept
        self.master_start, self.master_stop = start, stop
        self.rank, self.ranks = rank, ranks
        self._owned = owned
        self.stages = tuple(replace(st, master=()) for st in self.stages)

    def _m(self, start: int, stop: int) -> torch.Tensor:
        """The master elements ``[start, stop)`` (global offsets) this store holds."""
        if start < self.master_start or stop > self.master_stop:
            raise MissingKey(f"masters [{start}, {stop}) are not held by rank {self.rank} of "
                           f"{self.ranks} (it holds [{self.master_start}, {self.master_stop}))")
        return self.master[start - self.master_start : stop - self.master_start]

    @property
    def sharded(self) -> bool:
        return self.ranks > 1

    # -- lookups -------------------------------------------------------------------------
    def slot(self, name: str) -> ParamSlot:
        try:
            return self._by_name[name]
        except KeyError:
            raise MissingKey(f"no parameter named {name!r} in the host store") from None

    def master_of(self, name: str) -> torch.Tensor:
        s = self.slot(name)
        if not s.trainable:
            raise MissingKey(f"{name!r} is frozen: it has no master (see shadow_of)")
        return self._m(s.master_offset, s.master_offset + s.numel).view(s.shape)

    def grad_of(self, name: str) -> torch.Tensor:
        s = self.slot(name)
        if not s.trainable:
            raise MissingKey(f"{name!r} is frozen: it has no gradient")
        return self.grad[s.master_offset : s.master_offset + s.numel].view(s.shape)

    def shadow_of(self, name: str, version: int | None = None) -> torch.Tensor:
        """The parameter's shadow in copy ``version`` (default: :attr:`shadow_version`, the
        copy the next step reads); a frozen parameter has one copy."""
        s = self.slot(name)
        if self._paired(version) and s.trainable:
            return self.shadow_pair[s.master_offset : s.master_offset + s.numel].view(s.shape)
        return self.shadow[s.shadow_offset : s.shadow_offset + s.numel].view(s.shape)

    def _paired(self, version: int | None) -> bool:
        """Whether ``version`` (None: the current one) is copy 1, the pair."""
        version = self.shadow_version if version is None else version
        if version not in (0, 1) or (version == 1 and self.shadow_pair is None):
            raise InvalidInput(f"shadow copy {version} does not exist (copies: "
                             f"{[0, 1] if self.shadow_pair is not None else [0]})")
        return version == 1

    def add_shadow_pair(self) -> None:
        """Allocate copy 1 of the trainable parameters' shadow (idempotent), equal to copy 0:
        2 more bytes (the compute dtype's) per trainable parameter, pinned like the others."""
        if self.shadow_pair is None:
            pair, _ = _host_flat(self.master.numel(), self.compute_dtype,
                                 self.pin == "registered")
            for m0, m1, s0 in _runs(self.trainable_slots):
                pair[m0:m1].copy_(self.shadow[s0:s0 + m1 - m0])
            self.shadow_pair = pair

    def upload_pieces(self, stage: int, version: int = 0,
                      ) -> list[tuple[int, torch.Tensor]]:
        """``(device offset, host view)`` of each contiguous piece of ``stage``'s shadow in
        copy ``version``: what one UP copies into the stage's device weight buffer. Copy 0 is
        the stage's segments; copy 1 takes the trainable parameters from the pair and the
        frozen ones from copy 0."""
        layout = self.stages[stage].layout
        if not self._paired(version):
            return [(seg.device_offset, view) for seg, view in
                    zip(layout.shadow_segments, self.stages[stage].shadow)]
        pieces: list[list] = []  # [device offset, source, host start, numel]
        for index in sorted(layout.slots, key=lambda i: self.slots[i].shadow_offset):
            slot = self.slots[index]
            if not slot.numel:
                continue
            device = _device_offset(layout.shadow_segments, slot.shadow_offset)
            source, start = (1, slot.master_offset) if slot.trainable else (0, slot.shadow_offset)
            last = pieces[-1] if pieces else None
            if last is not None and last[1] == source and last[0] + last[3] == device and \
                    last[2] + last[3] == start:
                last[3] += slot.numel
            else:
                pieces.append([device, source, start, slot.numel])
        return [(device, (self.shadow_pair if source else self.shadow)[start:start + numel])
                for device, source, start, numel in pieces]

    @property
    def trainable_slots(self) -> tuple[ParamSlot, ...]:
        return tuple(s for s in self.slots if s.trainable)

    @property
    def owned_slots(self) -> tuple[ParamSlot, ...]:
        """The trainable slots whose masters this store holds (all unless sharded)."""
        return self._owned

    # -- shadow and gradients ------------------------------------------------------------
    def refresh_shadow(self, stage: int | None = None, version: int | None = None) -> None:
        """Rewrite the shadow of a stage's trainable parameters (all, when ``stage`` is None)
        in copy ``version`` (default: the current one, :attr:`shadow_version`) from their
        masters, cast to the compute dtype (round to nearest even)."""
        if self.sharded:  # only the held masters; the others' shadows come from their owners
            owned = set(self._owned)
            slots = self.trainable_slots if stage is None else \
                [self.slots[i] for i in self.stages[stage].layout.slots]
            self._copy_runs(_runs([s for s in slots if s in owned]))
            return
        runs = _runs(self.trainable_slots) if stage is None else self._stage_runs[stage]
        if self._paired(version):  # the pair is laid out as the masters
            if runs:
                cast_pack([self._m(m0, m1) for m0, m1, _ in runs], self.shadow_pair,
                          [m0 for m0, _, _ in runs], backend=self.kernels)
            return
        self._copy_runs(runs)

    def refresh_slots(self, slot_indices: Iterable[int]) -> None:
        """Rewrite the shadow of the given (trainable, held) slots from their masters."""
        self._copy_runs(_runs([self.slots[i] for i in slot_indices]))

    def _copy_runs(self, runs: list[tuple[int, int, int]]) -> None:
        # One cast_pack over every run (one launch with the Triton backend); it rounds like
        # Tensor.to, so the shadow is the same whichever backend ``kernels`` names.
        if not runs:
            return
        cast_pack([self._m(m0, m1) for m0, m1, _ in runs], self.shadow,
                  [s0 for _, _, s0 in runs], backend=self.kernels)

    def accumulate_grad(self, stage: int, flat_grad: torch.Tensor) -> None:
        """Add a stage's gradient buffer (laid out as its ``grad_segments``) into the masters'
        gradients. Called once per job (per stage per round); sums in fp32."""
        layout = self.stages[stage].layout
        flat_grad = flat_grad.reshape(-1)
        if flat_grad.numel() != layout.grad_numel:
            raise InvalidInput(
                f"stage {stage}: gradient has {flat_grad.numel()} elements, its layout "
                f"needs {layout.grad_numel}"
            )
        if not flat_grad.is_floating_point():
            raise InvalidType(f"stage {stage}: gradient dtype {flat_grad.dtype} is not floating")
        with self._lock, torch.no_grad():
            for seg in layout.grad_segments:
                self.grad[seg.start : seg.stop].add_(
                    flat_grad[seg.device_offset : seg.device_offset + seg.numel]
                )

    def add_pending(self) -> None:
        """Allocate the pending gradient buffer (zeroed; idempotent): 4 more bytes of host
        memory per trainable parameter, pinned like the others."""
        if self.pending is None:
            self.pending, _ = _host_flat(self.grad.numel(), torch.float32,
                                         self.pin != "no")
            self.pending.zero_()

    def swap_pending(self) -> None:
        """A step completed: its gradients become the pending ones (no copy: the two buffers
        trade places) and the buffer they leave, whose gradients were applied, is zeroed for
        the next step to accumulate into."""
        if self.pending is None:
            raise StateError("swap_pending() without a pending buffer (add_pending first)")
        with self._lock, torch.no_grad():
            self.grad, self.pending = self.pending, self.grad
            self.grad.zero_()
            self.stages = tuple(replace(st, grad=tuple(
                self.grad[g.start : g.stop] for g in st.layout.grad_segments))
                for st in self.stages)

    def zero_grads(self, slot_indices: Iterable[int] | None = None) -> None:
        """Zero every gradient, or those of the given slots."""
        with self._lock, torch.no_grad():
            if slot_indices is None:
                self.grad.zero_()
                return
            for m0, m1, _ in _runs([self.slots[i] for i in slot_indices]):
                self.grad[m0:m1].zero_()

    # -- optimizer view ------------------------------------------------------------------
    def masters(self) -> list[torch.nn.Parameter]:
        """One fp32 ``nn.Parameter`` per unique trainable parameter this store holds (all, unless
        sharded: :attr:`owned_slots`), in slot order, sharing memory with the master flat
        buffer; its ``.grad`` is the view into the flat gradient. Build the optimizer over
        these. The list is made once and returned again."""
        if self._masters is None:
            params = []
            for slot in self._owned:
                a, b = slot.master_offset, slot.master_offset + slot.numel
                p = torch.nn.Parameter(self._m(a, b).view(slot.shape))
                p.grad = self.grad[a:b].view(slot.shape)
                params.append(p)
            self._masters = params
        return self._masters

    def named_masters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(s.name, p) for s, p in zip(self._owned, self.masters())]

    def attach_grads(self, slot_indices: Iterable[int] | None = None, *,
                     pending: bool = False) -> None:
        """Point ``.grad`` of the masters at the flat gradient views (``pending``: of the
        pending buffer): of the given slots, with every other master's ``.grad`` set to None
        (how one optimizer steps a subset), or of all masters when ``slot_indices`` is None."""
        wanted = None if slot_indices is None else set(slot_indices)
        source = self.grad if not pending else self.pending
        if source is None:
            raise StateError("attach_grads(pending=True) without a pending buffer")
        for slot, p in zip(self._owned, self.masters()):
            if wanted is None or slot.index in wanted:
                a = slot.master_offset
                p.grad = source[a : a + slot.numel].view(slot.shape)
            else:
                p.grad = None

    def load_into_module(self, module: torch.nn.Module) -> None:
        """Copy the masters into ``module``'s parameters of the same names (frozen ones are
        left as they are: they never change). Sharded: only the masters this store holds."""
        with torch.no_grad():
            for slot in self._owned:
                value = self._m(slot.master_offset, slot.master_offset + slot.numel)
                for name in slot.names:
                    try:
                        target = module.get_parameter(name)
                    except AttributeError:
                        raise MissingKey(
                            f"module has no parameter {name!r}; was the store built from it?"
                        ) from None
                    target.copy_(value.view(slot.shape))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 masters this store holds, by (first) name, cloned."""
        return {s.name: self.master_of(s.name).clone() for s in self._owned}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load masters saved by :meth:`state_dict` and refresh their shadows from them.
        Sharded: the masters this store holds (the other ranks' shadows come from theirs)."""
        missing = [s.name for s in self._owned if s.name not in state]
        if missing:
            raise MissingKey(f"state dict lacks masters for {missing[:5]} ({len(missing)} in all)")
        with torch.no_grad():
            for s in self._owned:
                self.master_of(s.name).copy_(state[s.name])
        self.refresh_shadow()

    # -- accounting ----------------------------------------------------------------------
    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        trainable = sum(s.numel for s in self.trainable_slots)
        frozen = sum(s.numel for s in self.slots if not s.trainable) + sum(
            w.numel for w in self.packed_weights.values())
        itemsize = self.compute_dtype.itemsize
        # Frozen quantized weights count with the frozen shadows, at their packed bytes.
        shadow_bytes = self.shadow.untyped_storage().nbytes() + self.packed.nbytes
        pair = 0 if self.shadow_pair is None else self.shadow_pair.untyped_storage().nbytes()
        return MemoryReport(
            compute_dtype=str(self.compute_dtype).removeprefix("torch."),
            pin=self.pin,
            trainable_params=trainable,
            frozen_params=frozen,
            master_bytes=self.master.untyped_storage().nbytes(),
            shadow_trainable_bytes=trainable * itemsize + pair,
            shadow_frozen_bytes=shadow_bytes - trainable * itemsize,
            grad_bytes=self.grad.untyped_storage().nbytes() + (
                0 if self.pending is None else self.pending.untyped_storage().nbytes()),
            optimizer_state_bytes=0 if optimizer is None else _state_bytes(optimizer),
            upload_bytes=tuple(st.layout.shadow_numel * itemsize + st.packed_layout.nbytes
                               for st in self.stages),
            owned_params=sum(s.numel for s in self._owned),
            rank=self.rank,
            ranks=self.ranks,
        )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state, each storage counted once."""
    seen: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


# ============================================================================================
# 3. HostStaging
# ============================================================================================


class HostStaging:
    """The host side of the workers' transfers: one buffer per download (a value's tensors
    together, or a job's gradients), of exactly the bytes asked for, given back once the
    last upload reading it (or the ``ACC`` adding it) is done, and kept for later downloads.

    Why not ``torch.empty(..., pin_memory=True)``: torch's caching pinned allocator rounds
    each block up to a power of two (``CachingHostAllocator``: ``PowerOf2Ceil``), 39 % more
    host memory for a 184 MiB activation, unseen by any figure. Here a pinned buffer is
    registered with the driver at its exact size (:func:`_host_flat`), once, on its first
    use. A later download takes the smallest free buffer that holds it, if that one is at
    most ``STAGING_FIT`` (2) times its size (rpcompile.ir; the same size when the step has
    the plan's shapes; a batch down to half the planned length fits the buffers of the
    planned one, so bucketed lengths make few new buffers; an activation never ties up a
    gradient's far larger buffer), and is given the first bytes of it; else a new one. What
    the pool holds is the simulator's replay of this rule over the step
    (``rpcompile.sim.engine._staging_pool``, ``SimResult.peak_host_bytes``).

    Thread-safe: downloads take buffers on the workers' stream threads, uploads and the host
    give them back on theirs. A buffer is given back only once every copy that touches it has
    completed (the executor waits for its copies first). After a failed step the executor
    gives back what that step still held (:meth:`reclaim`) once no copy can touch it, or, if
    one still might (a worker was replaced), sets it aside for good (:meth:`quarantine`).
    """

    def __init__(self, pin: bool = False, poison: bool = False) -> None:
        self.pin = bool(pin)
        # A check for tests: every buffer given back is filled with 0xFF bytes (NaN in every
        # float dtype) before it can be lent again, so a reader that a buffer was given back
        # too early for reads NaN every time, not only when another download got there first.
        self.poison = bool(poison)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int, torch.Tensor]] = []  # (bytes, serial, buffer), sorted
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self._quarantined: dict[int, torch.Tensor] = {}
        self._serial = 0
        self.held_bytes = 0  # every buffer the pool owns: lent, free or set aside
        self.lent_bytes = 0  # the whole buffers lent now
        self.peak_lent_bytes = 0  # the most lent at once (a lower bound of the pool)
        self.registered = 0  # buffers made so far

    def take(self, nbytes: int, record: list[torch.Tensor] | None = None) -> torch.Tensor:
        """A flat ``uint8`` host tensor of exactly ``nbytes`` bytes (pinned when the pool
        is): the start of the smallest free buffer that holds it and is at most
        ``STAGING_FIT`` times its size, else a new buffer.
        ``record``: a list the buffer is appended to as it is lent (a step's takes, so that
        a failed step finds even a buffer whose taker never returned)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidInput(f"a staging buffer of {nbytes} bytes")
        if nbytes == 0:  # nothing to hold (and no address to know it by)
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            i = bisect.bisect_left(self._free, (nbytes, -1))
            fits = i < len(self._free) and self._free[i][0] <= STAGING_FIT * nbytes
            buf = self._free.pop(i)[2] if fits else None
        if buf is None:
            buf, _ = _host_flat(nbytes, torch.uint8, self.pin)
            with self._lock:
                self.held_bytes += nbytes
                self.registered += 1
        with self._lock:
            self._lent[buf.data_ptr()] = buf
            self.lent_bytes += buf.numel()
            self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)
            if record is not None:
                record.append(buf)
        return buf[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        """Give back what :meth:`take` lent (every copy touching it complete). A buffer set
        aside by :meth:`quarantine` stays aside."""
        if buf.numel() == 0:
            return
        with self._lock:
            if buf.data_ptr() in self._quarantined:
                return
            if not self._give_locked(buf):
                raise InvalidInput("give(): this buffer is not one the staging pool lent "
                                 "(given back twice?)")

    def _give_locked(self, buf: torch.Tensor) -> bool:
        """Move ``buf`` from lent to free (the lock held; poisoned first when the pool
        poisons); False if it is not lent."""
        whole = self._lent.get(buf.data_ptr())
        if whole is None:
            return False
        if self.poison:
            whole.fill_(0xFF)
        self._serial += 1
        bisect.insort(self._free, (whole.numel(), self._serial, whole))
        del self._lent[buf.data_ptr()]  # last: an interrupt above leaves it lent, not lost
        self.lent_bytes -= whole.numel()
        return True

    def reclaim(self, bufs: Iterable[torch.Tensor]) -> int:
        """Give back those of ``bufs`` still lent (a failed step's, once no copy can touch
        them); ones already given back are skipped. Returns how many went back."""
        back = 0
        for buf in bufs:
            if not buf.numel():
                continue
            with self._lock:  # checked and given back at once
                back += self._give_locked(buf)
        return back

    def quarantine(self, bufs: Iterable[torch.Tensor]) -> int:
        """Set ``bufs`` aside for good: still held, never lent again (a copy of a worker
        that was replaced may still write into them). Returns how many."""
        aside = 0
        with self._lock:
            for buf in bufs:
                whole = self._lent.get(buf.data_ptr()) if buf.numel() else None
                if whole is not None:
                    self._quarantined[buf.data_ptr()] = whole  # first: never out of the pool
                    del self._lent[buf.data_ptr()]
                    self.lent_bytes -= whole.numel()
                    aside += 1
        return aside

    def release(self) -> None:
        """Drop every free buffer (their memory goes back to the host once nothing else
        refers to them); lent and quarantined ones stay."""
        with self._lock:
            dropped = sum(size for size, _, _ in self._free)
            self._free.clear()
            self.held_bytes -= dropped

    def carve(self, tensors: Sequence[torch.Tensor], record: list[torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One buffer for ``tensors`` together (:meth:`take`, ``record`` as there), and a
        host tensor for each (its shape and dtype, contiguous) inside it. The widest dtypes
        come first, so every view is aligned to its element size without padding: the
        buffer is exactly the sum of the tensors' bytes."""
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        buf = self.take(sum(t.numel() * t.element_size() for t in tensors), record)
        views: list[torch.Tensor] = [buf] * len(tensors)
        offset = 0
        for i in order:
            t = tensors[i]
            n = t.numel() * t.element_size()
            views[i] = buf[offset:offset + n].view(t.dtype).view(t.shape)
            offset += n
        return buf, views


# ============================================================================================
# 4. Helpers
# ============================================================================================


def _identity(tensor: torch.Tensor) -> object:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    ) if tensor.numel() else ("empty", id(tensor))


def _pack(stage_packed, weights: dict, pin: bool, share: bool):
    """The packed byte buffer: each quantized weight once, in the order the stages first use
    it, as one record (fp32 state first, then the codes and 8-bit state; the record in whole
    PACKED_ALIGN words); each stage's byte segments and part offsets; the weights re-pointed
    at their records."""
    from rpcompile.capture.quantized import PACKED_ALIGN

    records: dict[str, tuple[int, int, list]] = {}  # name -> (start, stop, parts)
    at = 0
    for params in stage_packed:
        for name, tensor in params:
            if name in records:
                continue
            weight = weights[name]
            if weight.packed is not tensor:
                raise InvalidInput(f"packed[{name!r}] holds another tensor than the stage's "
                                 "parameter of that name")
            tensors = [("packed", weight.packed), *weight.state]
            tensors.sort(key=lambda kv: kv[1].element_size() != 4)
            parts, start = [], at
            for part, t in tensors:
                parts.append((part, at - start, t))
                at += t.nbytes
            at = -(-at // PACKED_ALIGN) * PACKED_ALIGN
            records[name] = (start, at, parts)
    flat, _ = _host_flat(at, torch.uint8, pin)
    moved = {}
    with torch.no_grad():
        for name, (start, _, parts) in records.items():
            views = {}
            for part, offset, t in parts:
                view = _byte_view(flat, start + offset, t.dtype, tuple(t.shape))
                view.copy_(t)
                views[part] = view
                if share and t.device.type == "cpu":
                    t.data = view  # the module's tensor and the record are one copy
            weight = weights[name]
            moved[name] = replace(weight, packed=views["packed"],
                                  state=tuple((k, views[k]) for k, _ in weight.state))
    layouts = []
    for stage, params in enumerate(stage_packed):
        # In host order, so the device buffer is the segments end to end.
        names = tuple(sorted(dict.fromkeys(n for n, _ in params), key=lambda n: records[n][0]))
        spans, parts, device_at = [], {}, 0
        for name in names:
            start, stop, record = records[name]
            parts[name] = tuple((part, device_at + offset, t.dtype, tuple(t.shape))
                                for part, offset, t in record)
            spans.append((start, stop - start))
            device_at += stop - start
        layouts.append(PackedLayout(stage, names, tuple(_segments(spans)), parts))
    return flat, tuple(layouts), moved


def _byte_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """``shape`` elements of ``dtype`` at byte ``offset`` of the uint8 buffer ``flat``."""
    size = torch.empty((), dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    return flat[offset : offset + count * size].view(dtype).view(shape)


def _layout(
    stage: int,
    names: list[str],
    stage_slots: list[int],
    slots: list[ParamSlot],
    index_of: dict[str, int],
) -> StageLayout:
    shadow_segments = _segments([(slots[i].shadow_offset, slots[i].numel) for i in stage_slots])
    trainable = [i for i in stage_slots if slots[i].trainable]
    grad_segments = _segments([(slots[i].master_offset, slots[i].numel) for i in trainable])
    weight_offsets, grad_offsets, shapes = {}, {}, {}
    for name in names:
        slot = slots[index_of[name]]
        shapes[name] = slot.shape
        weight_offsets[name] = _device_offset(shadow_segments, slot.shadow_offset)
        if slot.trainable:
            grad_offsets[name] = _device_offset(grad_segments, slot.master_offset)
    return StageLayout(
        stage=stage, names=tuple(dict.fromkeys(names)), slots=tuple(stage_slots),
        shadow_segments=shadow_segments, grad_segments=grad_segments,
        weight_offsets=weight_offsets, grad_offsets=grad_offsets, shapes=shapes,
    )


def _segments(ranges: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """Coalesce element ranges (offset, numel) into sorted contiguous segments."""
    merged: list[list[int]] = []
    for start, numel in sorted(ranges):
        if numel == 0:
            continue  # nothing to copy; its views are empty
        if merged and merged[-1][1] == start:
            merged[-1][1] += numel
        else:
            merged.append([start, start + numel])
    out, at = [], 0
    for start, stop in merged:
        out.append(Segment(start, stop, at))
        at += stop - start
    return tuple(out)


def _device_offset(segments: tuple[Segment, ...], offset: int) -> int:
    for seg in segments:
        if seg.start <= offset < seg.stop:
            return seg.device_offset + offset - seg.start
    return 0  # a zero-element parameter: an empty view anywhere is right


def _runs(slots: Iterable[ParamSlot]) -> list[tuple[int, int, int]]:
    """(master start, master stop, shadow start) runs contiguous in both buffers."""
    runs: list[list[int]] = []
    for slot in sorted((s for s in slots if s.trainable), key=lambda s: s.master_offset):
        m0, s0 = slot.master_offset, slot.shadow_offset
        if runs and runs[-1][1] == m0 and runs[-1][2] + (runs[-1][1] - runs[-1][0]) == s0:
            runs[-1][1] += slot.numel
        else:
            runs.append([m0, m0 + slot.numel, s0])
    return [(a, b, c) for a, b, c in runs]


def shard_bounds(slots: Sequence[ParamSlot], ranks: int) -> list[tuple[int, int]]:
    """Cut the master index space of the trainable ``slots`` into ``ranks`` contiguous ranges
    of whole parameters: rank ``r``'s range ends at the parameter boundary nearest to
    ``(r + 1) / ranks`` of the total, each range keeping at least one parameter while there
    are enough of them, so a rank holds its 1/N share give or take the largest parameter. A
    range is empty only when there are fewer trainable parameters than ranks."""
    trainable = sorted((s for s in slots if s.trainable), key=lambda s: s.master_offset)
    total = sum(s.numel for s in trainable)
    edges = [0]
    at = 0
    for s in trainable:
        at += s.numel
        edges.append(at)
    cuts = [0]
    for r in range(1, ranks):
        target = r * total / ranks
        # Past the previous cut, and leaving one parameter for each rank after this one.
        lo = edges.index(cuts[-1]) + 1
        hi = len(edges) - (ranks - r)
        allowed = edges[lo:hi + 1] if lo <= hi else [cuts[-1]]
        best = min(allowed, key=lambda e: (abs(e - target), e))
        cuts.append(max(best, cuts[-1]))
    cuts.append(total)
    return [(cuts[r], cuts[r + 1]) for r in range(ranks)]


def pin_host_memory(host_memory: str, device_kind: str) -> bool:
    """Whether a run pins its host memory (the host store's flat buffers and the workers'
    transfer staging): on CUDA workers with ``host_memory="pinned"`` (the default), never
    with ``"pageable"`` (RoundPipe's ``pin_model="off"``: every copy then goes through the
    driver's own staging) and never on virtual workers, whose copies are CPU copies either
    way. The one decision the Trainer and the CudaWorker read."""
    check_option("host_memory", host_memory)  # a public helper: the option's one check
    return device_kind == "cuda" and host_memory == "pinned"


def _host_flat(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, str]:
    """An exact-size flat host buffer, pinned by registering it with the CUDA driver; where
    the registration fails, a warning that says why and a buffer of torch's caching pinned
    allocator instead (pinned all the same, its size maybe rounded up)."""
    flat = torch.empty(numel, dtype=dtype)
    if not pin:
        return flat, "no"
    if not torch.cuda.is_available():
        raise InvalidInput("pin=True needs CUDA (torch.cuda.is_available() is False); use pin=False")
    if numel == 0:
        return flat, "registered"
    failure = _register(flat.data_ptr(), flat.nbytes)
    if failure is not None:
        warnings.warn(
            f"registering {format_bytes(flat.nbytes)} of host memory with the CUDA driver "
            f"failed ({failure}); using torch's caching pinned allocator instead, which may "
            "round the buffer up to a power of two",
            RuntimeWarning,
            stacklevel=3,
        )
        return _caching_pinned(numel, dtype), "caching allocator (may round up)"
    # Unregister before the memory goes back to the CPU allocator.
    weakref.finalize(flat, _unregister, flat.data_ptr())
    return flat, "registered"


def _caching_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


# [Note: registration through the driver API]
# torch's binding of cudaHostRegister (torch.cuda.cudart()) returns the error of a failed call
# but leaves it as the CUDA runtime's last error of the calling thread, and torch offers no
# cudaGetLastError to clear it. The next kernel launch on that thread (a worker's stream thread,
# for the staging buffers) then raises it at an unrelated op, failing the step instead of
# falling back. The driver API keeps no such state: a call returns its error and that is all.
# Driver calls act on the thread's current context, which a fresh stream thread may not have
# yet, so each call runs inside the device's primary context (the one torch's runtime uses).


def _register(pointer: int, nbytes: int) -> str | None:
    """Register ``nbytes`` at ``pointer`` as pinned memory every GPU can read; None when it is
    done, else what failed."""
    try:
        driver = _driver()
    except OSError as exc:
        return f"the CUDA driver library could not be loaded: {exc}"
    return driver.register(pointer, nbytes)


def _unregister(pointer: int) -> None:
    # A finalizer: it may run at exit, with CUDA shut down, where a failure changes nothing.
    with contextlib.suppress(OSError, RuntimeError):
        _driver().unregister(pointer)


@functools.cache
def _driver() -> _Driver:
    return _Driver(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"))


class _Driver:
    """The few CUDA driver API calls that host registration needs, through ctypes."""

    _SIGNATURES: ClassVar[dict[str, list]] = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
        "cuCtxPushCurrent_v2": [ctypes.c_void_p],
        "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
        "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostUnregister": [ctypes.c_void_p],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    _PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: every context sees the memory as pinned

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for name, arguments in self._SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, ctypes.c_int
            self._functions[name] = function

    def register(self, pointer: int, nbytes: int) -> str | None:
        return self._in_primary_context(
            lambda: self._call("cuMemHostRegister_v2", pointer, nbytes, self._PORTABLE))

    def unregister(self, pointer: int) -> str | None:
        return self._in_primary_context(lambda: self._call("cuMemHostUnregister", pointer))

    def _call(self, name: str, *arguments: object) -> str | None:
        result = self._functions[name](*arguments)
        if result == 0:  # CUDA_SUCCESS
            return None
        text = ctypes.c_char_p()
        self._functions["cuGetErrorName"](result, ctypes.byref(text))
        return f"{name} returned {(text.value or b'').decode() or 'CUresult'} ({result})"

    def _in_primary_context(self, call: Callable[[], str | None]) -> str | None:
        # The device of torch's current device (portable memory: any device would do).
        ordinal = torch.cuda.current_device()
        device, context = ctypes.c_int(), ctypes.c_void_p()
        failure = (self._call("cuInit", 0)
                   or self._call("cuDeviceGet", ctypes.byref(device), ordinal)
                   or self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device))
        if failure:
            return failure
        try:
            failure = self._call("cuCtxPushCurrent_v2", context)
            if failure:
                return failure
            try:
                return call()
            finally:
                self._call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
        finally:
            self._call("cuDevicePrimaryCtxRelease_v2", device)

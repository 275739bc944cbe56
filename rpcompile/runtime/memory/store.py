"""HostStore: the host's copy of the model, one flat buffer per kind (master, shadow,
gradient; pending gradients and a second shadow when asked; the packed records of quantized
weights), with the views the runtime and the optimizer need (rpcompile.runtime.memory
describes the layout)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from rpcompile.errors import InvalidInput, InvalidType, MissingKey, StateError
from rpcompile.runtime.kernels import cast_pack
from rpcompile.runtime.memory.layout import (
    PackedLayout,
    ParamSlot,
    StageBuffers,
    StageLayout,
    _byte_view,
    _device_offset,
    _layout,
    _runs,
    _segments,
)
from rpcompile.runtime.memory.pinned import _host_flat
from rpcompile.runtime.memory.report import MemoryReport, _state_bytes

__all__ = [
    "HostStore",
]


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

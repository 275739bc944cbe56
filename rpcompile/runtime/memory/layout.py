"""Where each parameter lives in the host's flat buffers: the layout values (ParamSlot,
Segment, StageLayout, PackedLayout, StageBuffers), each stage's segments and device offsets,
contiguous runs, and the shard bounds of sharded masters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from rpcompile.errors import InvalidInput

__all__ = [
    "PackedLayout",
    "ParamSlot",
    "Segment",
    "StageBuffers",
    "StageLayout",
    "shard_bounds",
]


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

"""The values actions hand each other on a worker: which tensors a schedule value carries, how
they are copied, and what they hold of the worker's memory.

**Values.** A schedule value names the boundary after a unit, but the stage programs exchange
many named tensors (the hidden state, rotary tables, masks, sizes, a long skip connection).
``x<b>`` carries every tensor produced at units ``<= b`` that a stage starting after ``b``
reads (so shared values travel along the forward chain, as docs/schedule.md says); when it
feeds the tail or a backward stage only, just that stage's inputs. ``g<b>`` carries every value
gradient accumulated so far whose value was produced at or before ``b``, in the same dict the
reference executor threads through the backward stages, so the sums happen in the same order.

**Holds.** Every activation or value gradient held between actions is accounted against its
worker's capacity once per storage (:class:`Holds`); weights and gradient buffers are the
worker's own allocations (``Worker.alloc``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.errors import InvalidInput
from rpcompile.ir import Schedule
from rpcompile.passes.split import StageProgram
from rpcompile.runtime.workers import Worker

__all__ = ["HOST_VALUES", "Buffers", "Holds", "JobGrads", "bundle_names", "copy_to", "tensors"]

HOST_VALUES = ("ids", "labels")  # schedule values that live on the host from the start


def bundle_names(programs: Sequence[StageProgram], unit_of: Mapping[str, int],
                  schedule: Schedule) -> dict[tuple[int, str], set[str] | None]:
    """(producer stage, value) -> the tensor names that value carries (None: every value
    gradient, for ``g`` values). Raises when a forward stage could not provide a name."""
    first = {p.index: p.units[0] for p in programs}
    by_index = {p.index: p for p in programs}

    def live_after(b: int) -> set[str]:
        return {v for p in programs if p.units[0] > b for v in p.value_inputs
                if unit_of[v] <= b}

    out: dict[tuple[int, str], set[str] | None] = {}
    for f in schedule.flows:
        if f.from_host:
            continue
        key = (f.src_stage, f.value)
        if f.what == "igrad":
            out[key] = None
            continue
        dst = by_index[f.dst_stage]
        need = live_after(first[dst.index] - 1) if dst.kind == "forward" else set(dst.value_inputs)
        out.setdefault(key, set()).update(need)  # type: ignore[union-attr]
    for (src, value), names in out.items():
        if names is None:
            continue
        prog = by_index[src]
        received = live_after(prog.units[0] - 1)
        missing = names - received - set(prog.outputs)
        if missing:
            raise InvalidInput(
                f"stage {prog.name} sends value {value!r} but cannot provide {sorted(missing)}: "
                "they are neither its inputs nor its outputs; the split and the schedule's flows "
                "disagree (re-run compile(); report this if it persists)"
            )
    return out


def copy_to(obj: Any, make: Any) -> Any:
    """Copy every tensor inside ``obj`` (a tensor, tuple/list of them, or a plain value such as
    an int size) with ``make(tensor) -> tensor``; plain values pass through."""
    if isinstance(obj, torch.Tensor):
        return make(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(copy_to(o, make) for o in obj)
    return obj


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in tensors(o)]
    return []


@dataclass
class JobGrads:
    """A job's fp32 gradient buffer on its worker: per-parameter views, each parameter's
    element offset in ``flat`` (what the accumulation kernel writes at), and the fused
    non-finite flag every microbatch of the job raises."""

    flat: torch.Tensor
    views: dict[str, torch.Tensor]
    offsets: dict[str, int]
    flag: torch.Tensor


class Buffers:
    """A job's device copies of its non-parameter inputs (buffers, lifted constants), read by
    :func:`stage_arguments` through ``value_of`` as it would read the captured model's."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def value_of(self, name: str) -> torch.Tensor:
        return self.values[name]


class Holds:
    """Activations held on a worker between actions, accounted against its capacity once per
    storage (a tensor passed on from one value to the next is counted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple, list[int]] = {}
        self._storages: dict[int, list] = {}  # data_ptr -> [refcount, reservation, storage]

    def hold(self, worker: Worker, key: tuple, tensors: Sequence[torch.Tensor], tag: str) -> None:
        ptrs = []
        for t in tensors:
            if t.numel() == 0:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            with self._lock:
                entry = self._storages.get(ptr)
                if entry is not None:
                    entry[0] += 1
                    ptrs.append(ptr)
                    continue
            reservation = worker.reserve(storage.nbytes(), tag)
            reservation.__enter__()  # raises WorkerOutOfMemory naming the tag and the bytes
            with self._lock:
                self._storages[ptr] = [1, reservation, storage]
            ptrs.append(ptr)
        with self._lock:
            self._keys.setdefault(key, []).extend(ptrs)

    def release(self, key: tuple) -> None:
        self._release([key])

    def release_prefix(self, prefix: tuple) -> None:
        with self._lock:
            keys = [k for k in self._keys if k[:len(prefix)] == prefix]
        self._release(keys)

    def _release(self, keys: list[tuple]) -> None:
        done = []
        with self._lock:
            for k in keys:
                for ptr in self._keys.pop(k, ()):
                    entry = self._storages[ptr]
                    entry[0] -= 1
                    if entry[0] == 0:
                        done.append(self._storages.pop(ptr)[1])
        for reservation in done:
            reservation.__exit__(None, None, None)

    def release_all(self) -> None:
        with self._lock:
            done = [entry[1] for entry in self._storages.values()]
            self._storages.clear()
            self._keys.clear()
        for reservation in done:
            reservation.__exit__(None, None, None)

"""HostStaging: the host buffers of the workers' downloads, one per staging slot of the
schedule, of the slot's exact size, made on first use and lent again."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from rpcompile.errors import InvalidInput
from rpcompile.runtime.errors import StagingError, format_bytes
from rpcompile.runtime.memory.pinned import _host_flat

__all__ = [
    "HostStaging",
]


class HostStaging:
    """The host side of the workers' downloads: one buffer per staging slot of the schedule
    (``slots``: each slot's bytes, ``Schedule.staging_bytes``; rpcompile.passes.staging), of
    exactly the slot's size, made when the slot is first used and kept. A download (a
    value's tensors together, or a job's gradients) takes its slot's buffer, or the first
    bytes of it for a shorter batch, and gives it back once the last upload reading it (or
    the ``ACC`` adding it) is done. The schedule's ``reuse`` edges order two downloads of one
    slot, so a slot is free whenever a download takes it: what the pool holds is the sum of
    the slot sizes, the host figure, whatever the threads' timing. A download larger than
    its slot, or a slot still lent, raises :class:`StagingError` (never a buffer more).
    A pool of no slots (a schedule without downloads) lends a take a buffer of its own,
    dropped when given back.

    Why not ``torch.empty(..., pin_memory=True)``: torch's caching pinned allocator rounds
    each block up to a power of two (``CachingHostAllocator``: ``PowerOf2Ceil``), 39 % more
    host memory for a 184 MiB activation, unseen by any figure. Here a pinned buffer is
    registered with the driver at its exact size (:func:`_host_flat`), once, on its first
    use.

    Thread-safe: downloads take buffers on the workers' stream threads, uploads and the host
    give them back on theirs. A buffer is given back only once every copy that touches it has
    completed (the executor waits for its copies first). After a failed step the executor
    gives back what that step still held (:meth:`reclaim`) once no copy can touch it, or, if
    one still might (a worker was replaced), sets it aside for good (:meth:`quarantine`): its
    slot makes a new buffer on its next use.
    """

    def __init__(self, slots: Sequence[int] = (), pin: bool = False,
                 poison: bool = False) -> None:
        self.slots = tuple(int(n) for n in slots)
        self.pin = bool(pin)
        # A check for tests: every buffer given back is filled with 0xFF bytes (NaN in every
        # float dtype) before it can be lent again, so a reader that a buffer was given back
        # too early for reads NaN every time, not only when another download got there first.
        self.poison = bool(poison)
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor | None] = [None] * len(self.slots)
        self._lent: dict[int, tuple[int | None, torch.Tensor]] = {}  # data_ptr -> (slot, buf)
        self._busy: set[int] = set()  # the slots lent now
        self._quarantined: dict[int, torch.Tensor] = {}
        self.held_bytes = 0  # every buffer the pool owns: lent, free or set aside
        self.lent_bytes = 0  # the whole buffers lent now
        self.peak_lent_bytes = 0  # the most lent at once
        self.registered = 0  # buffers made so far

    def take(self, nbytes: int, record: list[torch.Tensor] | None = None,
             slot: int | None = None) -> torch.Tensor:
        """A flat ``uint8`` host tensor of exactly ``nbytes`` bytes (pinned when the pool
        is): the start of slot ``slot``'s buffer (made on its first use), or, without a
        slot, a buffer of its own. ``record``: a list the buffer is appended to as it is lent
        (a step's takes, so that a failed step finds even a buffer whose taker never
        returned)."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidInput(f"a staging buffer of {nbytes} bytes")
        if nbytes == 0:  # nothing to hold (and no address to know it by)
            return torch.empty(0, dtype=torch.uint8)
        buf = None
        if slot is None and self.slots:
            raise StagingError(f"a download of {format_bytes(nbytes)} has no host staging "
                               "slot: the schedule gives every download of bytes one")
        if slot is not None:
            if not 0 <= slot < len(self.slots):
                raise StagingError(f"host staging slot {slot} does not exist: the pool has "
                                   f"{len(self.slots)} (the schedule's staging_bytes)")
            if nbytes > self.slots[slot]:
                raise StagingError(
                    f"a download of {format_bytes(nbytes)} does not fit its host staging slot "
                    f"{slot} of {format_bytes(self.slots[slot])}: the batch is larger than the "
                    "one the schedule was planned for; plan for the largest batch (compile "
                    "with it, or Compiled.replan)")
            with self._lock:
                if slot in self._busy:
                    raise StagingError(
                        f"host staging slot {slot} is still lent when another download "
                        "takes it: nothing in the schedule orders the two (its reuse "
                        "edges, rpcompile.passes.staging)")
                self._busy.add(slot)
                buf = self._buffers[slot]
        if buf is None:
            size = nbytes if slot is None else self.slots[slot]
            try:
                buf, _ = _host_flat(size, torch.uint8, self.pin)
            except BaseException:
                with self._lock:
                    self._busy.discard(slot)
                raise
            with self._lock:
                self.held_bytes += size
                self.registered += 1
                if slot is not None:
                    self._buffers[slot] = buf
        with self._lock:
            self._lent[buf.data_ptr()] = (slot, buf)
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
        got = self._lent.get(buf.data_ptr())
        if got is None:
            return False
        slot, whole = got
        if self.poison:
            whole.fill_(0xFF)
        del self._lent[buf.data_ptr()]  # an interrupt above leaves it lent, not lost
        self.lent_bytes -= whole.numel()
        if slot is None:  # a buffer of its own: dropped
            self.held_bytes -= whole.numel()
        else:
            self._busy.discard(slot)
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
        that was replaced may still write into them); a slot whose buffer is set aside
        makes a new one on its next use. Returns how many."""
        aside = 0
        with self._lock:
            for buf in bufs:
                got = self._lent.get(buf.data_ptr()) if buf.numel() else None
                if got is None:
                    continue
                slot, whole = got
                self._quarantined[buf.data_ptr()] = whole  # first: never out of the pool
                del self._lent[buf.data_ptr()]
                self.lent_bytes -= whole.numel()
                if slot is not None:
                    self._buffers[slot] = None
                    self._busy.discard(slot)
                aside += 1
        return aside

    def release(self) -> None:
        """Drop every free buffer (their memory goes back to the host once nothing else
        refers to them; a slot makes a new one on its next use); lent and quarantined ones
        stay."""
        with self._lock:
            for slot, buf in enumerate(self._buffers):
                if buf is not None and slot not in self._busy:
                    self._buffers[slot] = None
                    self.held_bytes -= buf.numel()

    def carve(self, tensors: Sequence[torch.Tensor], record: list[torch.Tensor] | None = None,
              slot: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One buffer for ``tensors`` together (:meth:`take`, ``record`` and ``slot`` as
        there), and a host tensor for each (its shape and dtype, contiguous) inside it. The
        widest dtypes come first, so every view is aligned to its element size without
        padding: the buffer is exactly the sum of the tensors' bytes."""
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        buf = self.take(sum(t.numel() * t.element_size() for t in tensors), record, slot)
        views: list[torch.Tensor] = [buf] * len(tensors)
        offset = 0
        for i in order:
            t = tensors[i]
            n = t.numel() * t.element_size()
            views[i] = buf[offset:offset + n].view(t.dtype).view(t.shape)
            offset += n
        return buf, views

"""HostStaging: the host buffers of the workers' transfers, exact size, kept for reuse."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence

import torch

from rpcompile.errors import InvalidInput
from rpcompile.ir import STAGING_FIT
from rpcompile.runtime.memory.pinned import _host_flat

__all__ = [
    "HostStaging",
]


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
    (``rpcompile.sim.engine.measures._staging_pool``, ``SimResult.peak_host_bytes``).

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

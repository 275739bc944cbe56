"""Worker: four stream threads consuming ordered queues, error capture, shutdown and
device-memory accounting, shared by the virtual and the CUDA worker."""

from __future__ import annotations

import abc
import contextlib
import queue
import random
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rpcompile.errors import InvalidInput
from rpcompile.runtime.errors import (
    EventTimeout,
    UpstreamFailed,
    WorkerAborted,
    WorkerError,
    WorkerOutOfMemory,
)
from rpcompile.runtime.workers.events import Event

__all__ = [
    "STREAMS",
    "Worker",
]


STREAMS = ("weight_upload", "activation_upload", "compute", "download")

class _Item:
    __slots__ = ("always", "fn", "label", "produces")

    def __init__(
        self, fn: Callable[[], Any], label: str, produces: Event | None, always: bool = False
    ) -> None:
        self.fn = fn
        self.label = label
        self.produces = produces  # the event this item sets; failed if the item is dropped
        self.always = always  # runs even on a failed worker (recover() markers)


class Worker(abc.ABC):
    """One device: four ordered streams, events, and accounted device memory.

    Public interface (the executor uses only this):

    - ``submit(stream, fn, label)``: run ``fn()`` on ``stream`` after the stream's earlier items.
    - ``record(stream, label) -> Event``: an event set when the stream's earlier items are done.
    - ``wait(stream, *events)``: the stream's later items run after ``events``.
    - ``synchronize(timeout)``, ``check()``, ``recover()``, ``shutdown(timeout)``,
      ``stream_cpu_s()`` (each stream thread's CPU time).
    - ``alloc(nbytes | shape=, dtype=, tag=)``, ``free(tensor)``, ``free_all()``,
      ``reserve(nbytes, tag)``; ``memory_in_use``, ``peak_bytes``, ``reset_peak()``.
    - ``host_empty(shape, dtype)``: a small host buffer (pinned on CUDA unless the run's
      host memory is pageable), for a job's non-finite flag and a microbatch's loss; the
      downloads of values and gradients stage in the executor's exact-size pool
      (rpcompile.runtime.memory.HostStaging, pinned when ``pinned`` is);
      ``copy_(dst, src)``, ``complete_copies()``, ``device_wait(event)``: a copy issued on the
      current stream, waiting for it, ordering it after an event (call them inside an item).
    """

    kind: str = ""
    # Whether host_empty() and the executor's staging give pinned memory (CUDA workers of a
    # pinned run only).
    pinned: bool = False

    def __init__(
        self,
        index: int,
        device: torch.device,
        name: str,
        capacity_bytes: int | None,
        chaos: int | None,
        chaos_max_delay_s: float,
    ) -> None:
        self.index = index
        self.device = device
        self.name = name
        # None means no limit: accounting (and the peak) still happen.
        self.capacity_bytes = sys.maxsize if capacity_bytes is None else int(capacity_bytes)
        self.chaos = chaos
        self.chaos_max_delay_s = chaos_max_delay_s
        self._queues: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._current: dict[str, str | None] = dict.fromkeys(STREAMS)
        self._holding: dict[str, _Item] = {}  # the item each stream took from its queue
        self._lock = threading.Lock()
        self._errors: list[WorkerError] = []
        self._error_listeners: list[Callable[[WorkerError], None]] = []
        self._failed = False
        self._stopping = False
        # Device memory accounting: data_ptr -> (bytes, tag, tensor). Holding the tensor keeps
        # the memory alive until free(), as device memory would be.
        self._allocs: dict[int, tuple[int, str, torch.Tensor]] = {}
        self._reservations: dict[int, tuple[int, str]] = {}
        self._in_use = 0
        self._peak = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, device={self.device})"

    def _start_threads(self) -> None:
        for stream in STREAMS:
            self._queues[stream] = queue.SimpleQueue()
            # Per-stream RNG from the seed, so a chaos run is reproducible up to OS scheduling.
            rng = None if self.chaos is None else random.Random(f"{self.chaos}:{self.index}:{stream}")
            thread = threading.Thread(
                target=self._stream_main,
                args=(stream, rng),
                name=f"rpcompile-{self.name}-{stream}",
                daemon=True,  # a stuck user callable must never keep the process alive
            )
            self._threads.append(thread)
            thread.start()

    # -- backend hooks -------------------------------------------------------------------
    @abc.abstractmethod
    def _stream_context(self, stream: str) -> contextlib.AbstractContextManager[Any]:
        """Entered once by the stream's thread around its whole loop."""

    @abc.abstractmethod
    def _new_event(self, name: str) -> Event: ...

    @abc.abstractmethod
    def _record_current(self, event: Event) -> None:
        """Runs inside a stream item: mark ``event`` as recorded after the stream's work."""

    @abc.abstractmethod
    def device_wait(self, event: Event) -> None:
        """Inside a stream item, after ``event`` is recorded: make the current device stream wait
        for it (CUDA ``wait_event``; nothing on a virtual worker, where recorded means done)."""

    @abc.abstractmethod
    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    @abc.abstractmethod
    def _release(self, tensor: torch.Tensor) -> None:
        """Called when a tensor is freed (CUDA: keep its block until the streams used it)."""

    @abc.abstractmethod
    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for staging transfers (pinned on CUDA unless pageable)."""

    @abc.abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy on the current stream; call it from inside a stream item."""

    @abc.abstractmethod
    def complete_copies(self) -> None:
        """Block the calling stream thread until its stream's copies are done."""

    # -- streams -------------------------------------------------------------------------
    def _stream_main(self, stream: str, rng: random.Random | None) -> None:
        q = self._queues[stream]
        try:
            context = self._stream_context(stream)
            context.__enter__()
        except BaseException as exc:
            # Nothing can run on this stream (e.g. the CUDA device is unusable): fail the worker
            # and keep draining the queue so every waiter gets an error instead of a hang.
            self.report_error(WorkerError(
                self.name, stream, "stream setup", exc, traceback_text=traceback.format_exc()
            ))
            while (item := q.get()) is not None:
                self._drop(item)
            return
        try:
            while True:
                try:
                    self._run_items(stream, q, rng)
                    return
                except BaseException as exc:
                    # Something escaped the item loop itself (not an item: those are caught
                    # in _run_items). The stream must not die silently with items queued:
                    # report it, so every wait gives up at once, fail the item it held, and
                    # serve the queue again.
                    self._current[stream] = None
                    self.report_error(WorkerError(
                        self.name, stream, "stream loop", exc,
                        traceback_text=traceback.format_exc(),
                    ))
                    held = self._holding.pop(stream, None)
                    if held is not None:
                        self._drop(held)
        finally:
            context.__exit__(None, None, None)

    def _run_items(self, stream: str, q: Any, rng: random.Random | None) -> None:
        holding = self._holding
        while True:
            holding.pop(stream, None)
            item = q.get()
            if item is None:
                return
            holding[stream] = item
            if (self._failed and not item.always) or self._stopping:
                self._drop(item)
                continue
            if rng is not None:
                time.sleep(rng.uniform(0.0, self.chaos_max_delay_s))
            self._current[stream] = item.label
            try:
                item.fn()
            except BaseException as exc:
                self._on_item_error(stream, item, exc)
            finally:
                self._current[stream] = None

    def _drop(self, item: _Item) -> None:
        if item.produces is not None:
            root = self._root_error()
            reason: BaseException = root if root is not None else WorkerAborted(
                f"worker {self.name} shut down before {item.label!r} ran"
            )
            item.produces.fail(reason)

    def _on_item_error(self, stream: str, item: _Item, exc: BaseException) -> None:
        if isinstance(exc, WorkerAborted) and self._stopping:
            self._drop(item)
            return
        error = WorkerError(
            self.name,
            stream,
            item.label,
            exc,
            secondary=isinstance(exc, (UpstreamFailed, WorkerAborted)),
            traceback_text=traceback.format_exc(),
        )
        self.report_error(error)
        if item.produces is not None:
            item.produces.fail(error)

    def report_error(self, error: WorkerError) -> None:
        """Record a failure on this worker (also used by the executor's actions); it stops the
        worker's streams from running anything more until :meth:`recover`."""
        with self._lock:
            self._errors.append(error)
            self._failed = True
            listeners = list(self._error_listeners)
        for listener in listeners:
            try:
                listener(error)
            except BaseException as exc:
                # A listener that raises must not kill the stream thread calling it: record
                # its error with the one it was told about (both end the step).
                with self._lock:
                    self._errors.append(WorkerError(
                        self.name, error.stream, f"error listener {listener!r}", exc,
                        secondary=True, traceback_text=traceback.format_exc(),
                    ))

    def add_error_listener(self, listener: Callable[[WorkerError], None]) -> None:
        """Call ``listener(error)`` (from the failing thread) on every captured error. An
        exception from the listener is recorded on the worker (secondary), never raised."""
        with self._lock:
            self._error_listeners.append(listener)

    def dead_streams(self) -> list[str]:
        """Streams whose thread is no longer alive although the worker is not stopping."""
        if self._stopping:
            return []
        return [s for s, t in zip(STREAMS, self._threads) if not t.is_alive()]

    def stream_cpu_s(self) -> dict[str, float]:
        """The CPU seconds each stream's thread has run so far (its own clock: other threads
        and processes do not count), for calibrating a profile on a run
        (rpcompile.runtime.calibrate). A stream whose thread has ended reads 0."""
        out = {}
        for stream, thread in zip(STREAMS, self._threads):
            try:
                out[stream] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, TypeError):  # ended (or never started): no clock to read
                out[stream] = 0.0
        return out

    def busy_streams(self) -> dict[str, str]:
        """The label of the item each busy stream is running now."""
        return {s: label for s, label in self._current.items() if label is not None}

    def respawn(self) -> Worker:
        """A fresh worker of the same kind, index, capacity and chaos, with new stream threads:
        what replaces this one when one of its streams is stuck in an item that never returns
        (this worker is then abandoned; its daemon threads drop everything once they return)."""
        return self._respawn()

    @abc.abstractmethod
    def _respawn(self) -> Worker: ...

    def should_abort(self) -> bool:
        """True once the worker failed or is shutting down: blocked waits give up."""
        return self._failed or self._stopping

    def _put(self, stream: str, item: _Item) -> None:
        if stream not in STREAMS:
            raise InvalidInput(f"unknown stream {stream!r}; streams are {STREAMS}")
        if self._stopping:
            raise WorkerAborted(f"worker {self.name} is shut down; cannot run {item.label!r}")
        self._queues[stream].put(item)

    def submit(self, stream: str, fn: Callable[[], Any], label: str = "") -> None:
        """Run ``fn()`` on ``stream`` after everything submitted to it before."""
        self._put(stream, _Item(fn, label or getattr(fn, "__name__", "item"), None))

    def record(self, stream: str, label: str = "") -> Event:
        """An event that is set when everything submitted to ``stream`` so far is done."""
        event = self._new_event(f"{self.name}.{stream}:{label}")
        self._put(stream, _Item(lambda: self._record_current(event), f"record {label}", event))
        return event

    def wait(self, stream: str, *events: Event, label: str = "") -> None:
        """Items submitted to ``stream`` after this call run only after ``events``."""

        def wait_all() -> None:
            for event in events:
                event.wait_recorded(abort=self.should_abort)
                self.device_wait(event)

        names = ", ".join(e.name for e in events)
        self._put(stream, _Item(wait_all, label or f"wait {names}", None))

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every stream has run everything submitted so far; raise its error."""
        markers = {s: self.record(s, "synchronize") for s in STREAMS}
        deadline = None if timeout is None else time.monotonic() + timeout
        for stream, marker in markers.items():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                marker.wait(remaining)
            except EventTimeout:
                raise EventTimeout(
                    f"worker {self.name}: stream {stream} did not drain within {timeout} s "
                    f"(running {self._current[stream]!r}, "
                    f"{self._queues[stream].qsize()} items queued)"
                ) from None
            except (UpstreamFailed, WorkerAborted):
                self.check()
                raise
        self.check()

    def _root_error(self) -> WorkerError | None:
        with self._lock:
            if not self._errors:
                return None
            return next((e for e in self._errors if not e.secondary), self._errors[0])

    @property
    def errors(self) -> list[WorkerError]:
        with self._lock:
            return list(self._errors)

    def check(self) -> None:
        """Raise the first root error captured on this worker, if any."""
        root = self._root_error()
        if root is not None:
            raise root

    def recover(self, timeout: float = 10.0) -> None:
        """After a failure: let the streams drop what was queued, then clear the errors and free
        all device memory so the worker can run the next step."""
        markers = []
        for stream in STREAMS:
            marker = self._new_event(f"{self.name}.{stream}:recover")
            self._put(stream, _Item(lambda m=marker: self._record_current(m), "recover", marker, True))
            markers.append(marker)
        for marker in markers:
            marker.wait(timeout)
        with self._lock:
            self._errors.clear()
            self._failed = False
        self.free_all()

    def shutdown(self, timeout: float = 5.0, warn: bool = True) -> list[str]:
        """Stop every stream thread and join it; blocked waits wake within ``_POLL_S``.

        Returns the names of threads still alive after ``timeout`` (a user callable that never
        returns cannot be interrupted; those threads are daemons and do not block exit).
        """
        with self._lock:
            already = self._stopping
            self._stopping = True
        if not already:
            for q in self._queues.values():
                q.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive and warn:
            warnings.warn(
                f"worker {self.name}: {alive} still running {timeout} s after shutdown "
                f"(items {self._current}); they are daemon threads",
                RuntimeWarning,
                stacklevel=2,
            )
        self.free_all()
        return alive

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- device memory -------------------------------------------------------------------
    def _account(self, nbytes: int, tag: str) -> None:
        with self._lock:
            if self._in_use + nbytes > self.capacity_bytes:
                raise WorkerOutOfMemory(
                    self.name, tag, nbytes, self._in_use, self.capacity_bytes, self._peak,
                    self._live_locked(),
                )
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use)

    def _live_locked(self) -> list[tuple[str, int]]:
        live = [(tag, n) for n, tag, _ in self._allocs.values()]
        live += [(tag, n) for n, tag in self._reservations.values()]
        return sorted(live, key=lambda x: -x[1])

    def alloc(
        self,
        nbytes: int | None = None,
        *,
        shape: tuple[int, ...] | torch.Size | None = None,
        dtype: torch.dtype | None = None,
        tag: str = "",
    ) -> torch.Tensor:
        """Allocate device memory, accounted against the capacity at its exact size.

        ``alloc(nbytes)`` gives a flat ``uint8`` buffer; ``alloc(shape=..., dtype=...)`` a
        typed tensor. ``tag`` names the use (e.g. ``"F3 weights"``) in out-of-memory errors.
        Raises :class:`WorkerOutOfMemory` when the capacity would be exceeded.
        """
        if (nbytes is None) == (shape is None):
            raise InvalidInput("alloc() takes either nbytes or shape= (with dtype=)")
        if nbytes is not None:
            shape, dtype = (int(nbytes),), torch.uint8
        shape = tuple(int(d) for d in shape)  # type: ignore[union-attr]
        dtype = dtype or torch.float32
        numel = 1
        for d in shape:
            numel *= d
        size = numel * dtype.itemsize
        self._account(size, tag)
        try:
            tensor = self._empty(shape, dtype)
        except torch.OutOfMemoryError as exc:
            with self._lock:
                self._in_use -= size
                live = self._live_locked()
            raise WorkerOutOfMemory(
                self.name, tag, size, self._in_use, self.capacity_bytes, self._peak, live
            ) from exc
        if size:
            with self._lock:
                self._allocs[tensor.data_ptr()] = (size, tag, tensor)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Give back a tensor from :meth:`alloc` (a view at offset 0 of it also works)."""
        if tensor.numel() == 0:
            return
        with self._lock:
            entry = self._allocs.pop(tensor.data_ptr(), None)
            if entry is None:
                raise InvalidInput(
                    f"worker {self.name}: free() of a tensor it did not allocate (or freed twice)"
                )
            self._in_use -= entry[0]
        self._release(entry[2])

    def free_all(self) -> int:
        """Free every allocation (end of a job or of a failed step); returns the bytes freed."""
        with self._lock:
            entries = list(self._allocs.values())
            self._allocs.clear()
            freed = sum(e[0] for e in entries)
            self._in_use -= freed
        for _, _, tensor in entries:
            self._release(tensor)
        return freed

    @contextlib.contextmanager
    def reserve(self, nbytes: int, tag: str = "") -> Iterator[None]:
        """Account ``nbytes`` of working memory (e.g. a compute's transients) for the block."""
        self._account(int(nbytes), tag)
        key = object()
        with self._lock:
            self._reservations[id(key)] = (int(nbytes), tag)
        try:
            yield
        finally:
            with self._lock:
                self._reservations.pop(id(key))
                self._in_use -= int(nbytes)

    @property
    def memory_in_use(self) -> int:
        return self._in_use

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._in_use

    def live_allocations(self) -> list[tuple[str, int]]:
        """(tag, bytes) of everything allocated or reserved now, largest first."""
        with self._lock:
            return self._live_locked()

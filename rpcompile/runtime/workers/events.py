"""Events: one-shot, fail-able, waitable from the host or from a stream (Event), and the CUDA
event a stream records (CudaEvent)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from rpcompile.errors import InvalidType
from rpcompile.runtime.errors import (
    EventTimeout,
    UpstreamFailed,
    WorkerAborted,
)

__all__ = [
    "CudaEvent",
    "Event",
]


# How often a blocked wait re-checks its abort flag. A set event wakes the waiter at once; this
# only bounds how long shutdown (or a failure elsewhere) takes to unblock a wait.
_POLL_S = 0.02


class Event:
    """A one-shot event: it is set once (the work before it is done) or failed once.

    ``is_set()`` is True once the event happened or failed. ``wait()`` blocks the calling host
    thread until then and raises :class:`UpstreamFailed` if it failed. Host code (the executor)
    creates plain events and sets them itself; workers create them with
    :meth:`Worker.record`. Callbacks run once, in the thread that sets or fails the event.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._flag = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Event], None]] = []

    def __repr__(self) -> str:
        state = "failed" if self._error else ("set" if self._flag.is_set() else "pending")
        return f"{type(self).__name__}({self.name!r}, {state})"

    # -- producing -----------------------------------------------------------------------
    def set(self) -> None:
        self._finish(None)

    def fail(self, error: BaseException) -> None:
        """Mark the event as never going to happen; waiters raise ``UpstreamFailed(error)``."""
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._flag.is_set():
                return
            self._error = error
            self._flag.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    # -- observing -----------------------------------------------------------------------
    def is_set(self) -> bool:
        return self._flag.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_callback(self, callback: Callable[[Event], None]) -> None:
        """Call ``callback(event)`` when the event is set or failed (now, if it already is)."""
        with self._lock:
            if not self._flag.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def wait_recorded(
        self, timeout: float | None = None, abort: Callable[[], bool] | None = None
    ) -> None:
        """Block until the event is set on the host (for a CUDA event: recorded on its stream).

        Raises :class:`UpstreamFailed` if it failed, :class:`WorkerAborted` as soon as
        ``abort()`` returns True, :class:`EventTimeout` after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            if self._flag.wait(step):
                break
            if abort is not None and abort():
                raise WorkerAborted(f"wait for event {self.name!r} abandoned")
            if deadline is not None and time.monotonic() >= deadline:
                raise EventTimeout(f"event {self.name!r} not set within {timeout} s")
        if self._error is not None:
            raise UpstreamFailed(self.name, self._error)

    def wait(self, timeout: float | None = None, abort: Callable[[], bool] | None = None) -> None:
        """Block the host until the work before the event is complete."""
        start = time.monotonic()
        self.wait_recorded(timeout, abort)
        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        self._wait_device(remaining)

    def _wait_device(self, timeout: float | None) -> None:
        """A plain event is complete when set; a CUDA event also waits for the device."""

    @staticmethod
    def all_of(events: Iterable[Event], name: str = "all_of") -> Event:
        """A host event set when every one of ``events`` is set, failed when one fails.

        Only for host events: a CUDA event being *recorded* does not mean its work is done, so
        pass CUDA events to :meth:`Worker.wait` one by one instead.
        """
        events = list(events)
        if any(isinstance(e, CudaEvent) for e in events):
            raise InvalidType("Event.all_of takes host events only; wait on CUDA events one by one")
        combined = Event(name)
        remaining = [len(events)]
        lock = threading.Lock()

        def on_done(event: Event) -> None:
            if event.error is not None:
                combined.fail(event.error)
                return
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                combined.set()

        if not events:
            combined.set()
        for event in events:
            event.add_callback(on_done)
        return combined


class CudaEvent(Event):
    """An event recorded on a CUDA stream: set on the host when recorded, complete on the device
    when the work before it has run. A stream waits on it on the device (``wait_event``)."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.cuda_event = torch.cuda.Event()

    def _wait_device(self, timeout: float | None) -> None:
        # Poll rather than synchronize() so a host wait keeps its timeout.
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not self.cuda_event.query():
            if deadline is not None and time.monotonic() >= deadline:
                raise EventTimeout(f"CUDA event {self.name!r} not complete within {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

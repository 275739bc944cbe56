"""Exceptions raised by the runtime, each carrying the context needed to act on it.

A runtime error names where it happened (worker, stream, item label, stage, bytes) so that the
executor can re-raise it in the caller without losing that context.
"""

from __future__ import annotations

from rpcompile.errors import RPCompileError

__all__ = [
    "EventTimeout",
    "OptimizerError",
    "RuntimeFault",
    "StagingError",
    "UpstreamFailed",
    "WorkerAborted",
    "WorkerError",
    "WorkerOutOfMemory",
    "format_bytes",
]


class RuntimeFault(RPCompileError, RuntimeError):
    """Base class of every error the rpcompile runtime raises on purpose."""


def format_bytes(n: int) -> str:
    """``12.0 MiB (12582912 bytes)``: the readable size and the exact count."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


class WorkerOutOfMemory(RuntimeFault, MemoryError):
    """An allocation on a worker would exceed its device-memory capacity."""

    def __init__(
        self,
        worker: str,
        tag: str,
        requested: int,
        in_use: int,
        capacity: int,
        peak: int,
        live: list[tuple[str, int]] | None = None,
    ) -> None:
        self.worker = worker
        self.tag = tag
        self.requested = requested
        self.in_use = in_use
        self.capacity = capacity
        self.peak = peak
        self.live = list(live or [])
        largest = ", ".join(f"{t!r} {format_bytes(b)}" for t, b in self.live[:5]) or "none"
        super().__init__(
            f"worker {worker}: out of device memory allocating {format_bytes(requested)} for "
            f"{tag!r}: {format_bytes(in_use)} already in use of a {format_bytes(capacity)} "
            f"capacity (peak so far {format_bytes(peak)}; largest live allocations: {largest}). "
            "Give the workers more memory (capacity_bytes=...), or plan with a lower memory "
            "limit, fewer layers per stage or smaller microbatches."
        )


class WorkerError(RuntimeFault):
    """An exception raised by an item running on one of a worker's streams.

    ``cause`` is the original exception (also chained as ``__cause__``); ``secondary`` is True
    when the item only failed because something it waited on failed first (the root error is
    then recorded elsewhere, usually on another stream or worker).
    """

    def __init__(
        self,
        worker: str,
        stream: str,
        label: str,
        cause: BaseException,
        secondary: bool = False,
        traceback_text: str = "",
    ) -> None:
        self.worker = worker
        self.stream = stream
        self.label = label
        self.cause = cause
        self.secondary = secondary
        self.traceback_text = traceback_text
        super().__init__(
            f"worker {worker}, stream {stream}, item {label!r} failed: "
            f"{type(cause).__name__}: {cause}"
        )
        self.__cause__ = cause


class WorkerAborted(RuntimeFault):
    """A wait on a worker stream was abandoned because the worker failed or is shutting down."""


class UpstreamFailed(RuntimeFault):
    """An event that was waited on will never complete, because the work producing it failed."""

    def __init__(self, event: str, cause: BaseException) -> None:
        self.event = event
        self.cause = cause
        super().__init__(f"event {event!r} failed upstream: {type(cause).__name__}: {cause}")
        self.__cause__ = cause


class StagingError(RuntimeFault):
    """A download does not fit its host staging slot (a batch larger than the plan's: plan
    for it), or its slot is still lent (a schedule whose slots nothing orders)."""


class EventTimeout(RuntimeFault, TimeoutError):
    """A host wait on an event ran past its timeout."""


class OptimizerError(RuntimeFault):
    """The host optimizer failed while updating a group of parameters (an OPT, or a flush)."""

"""The two kinds of worker and how a run gets them: VirtualWorker (CPU tensors, chaos mode),
CudaWorker (CUDA streams and events, pinned or pageable staging; nothing CUDA at import), and
make_workers (``device="auto" | "cuda" | "virtual"``)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from rpcompile.errors import InvalidInput, InvalidType, StateError
from rpcompile.options import check_option
from rpcompile.runtime.workers.events import CudaEvent, Event
from rpcompile.runtime.workers.worker import STREAMS, Worker

__all__ = [
    "CudaWorker",
    "VirtualWorker",
    "make_workers",
]


class VirtualWorker(Worker):
    """A CPU stand-in for one GPU: four stream threads, threading events, accounted memory.

    Device tensors are ordinary CPU tensors, distinct from host tensors (uploads and downloads
    still copy), so a missing transfer or wait shows up as wrong data. ``chaos=seed`` sleeps a
    random ``[0, chaos_max_delay_s)`` before each item, drawn from an RNG per stream seeded from
    ``seed``, to shake out orderings that only hold by luck.
    """

    kind = "virtual"

    def __init__(
        self,
        index: int = 0,
        capacity_bytes: int | None = None,
        chaos: int | None = None,
        chaos_max_delay_s: float = 0.002,
        name: str | None = None,
    ) -> None:
        super().__init__(
            index, torch.device("cpu"), name or f"v{index}", capacity_bytes, chaos,
            chaos_max_delay_s,
        )
        self._given_capacity = capacity_bytes
        self._start_threads()

    def _respawn(self) -> Worker:
        return VirtualWorker(self.index, self._given_capacity, self.chaos, self.chaos_max_delay_s,
                             self.name)

    def _stream_context(self, stream: str) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def _new_event(self, name: str) -> Event:
        return Event(name)

    def _record_current(self, event: Event) -> None:
        event.set()  # items run synchronously: the stream's earlier work is done

    def device_wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            raise InvalidType(f"virtual worker {self.name} cannot wait on CUDA event {event.name!r}")

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def _release(self, tensor: torch.Tensor) -> None:
        pass

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def complete_copies(self) -> None:
        pass  # CPU copies are synchronous


class CudaWorker(Worker):
    """One GPU: the four streams are CUDA streams, each fed by its own host thread.

    A stream thread runs its items under ``torch.cuda.stream(...)``, so they only enqueue device
    work; events are CUDA events recorded on those streams; a stream waits on another stream's
    event on the device. Several workers may share one GPU (``device_index``). Capacity defaults
    to the device's total memory; accounting covers :meth:`alloc` and :meth:`reserve` only.

    ``host_memory``: ``"pinned"`` (the default) stages downloads in pinned buffers (the
    executor's exact-size pool, registered with the driver), whose
    ``non_blocking`` copies are DMA the stream completes later (:meth:`complete_copies`
    waits for them); ``"pageable"`` stages them in ordinary memory
    (rpcompile.runtime.memory.pin_host_memory). A ``non_blocking`` copy to or from pageable
    memory is synchronous with the host thread that issues it (CUDA stages it through the
    driver's own pinned buffer: an upload returns once its source is read, a download once
    its data is in the destination), so each stream thread blocks in its copies a little
    longer; the order of the work, the events and the waits are the same, and every reader
    of a staged buffer still waits for the copy's event or :meth:`complete_copies`.
    """

    kind = "cuda"

    def __init__(
        self,
        index: int = 0,
        device_index: int | None = None,
        capacity_bytes: int | None = None,
        chaos: int | None = None,
        chaos_max_delay_s: float = 0.002,
        name: str | None = None,
        host_memory: str = "pinned",
    ) -> None:
        from rpcompile.runtime.memory import pin_host_memory

        self.host_memory = host_memory
        self.pinned = pin_host_memory(host_memory, "cuda")  # checks the choice first
        if not torch.cuda.is_available():
            raise StateError(
                "CudaWorker needs a CUDA device, and torch.cuda.is_available() is False; "
                "use make_workers(n, device='virtual') to run on the CPU"
            )
        ordinal = index % torch.cuda.device_count() if device_index is None else device_index
        device = torch.device("cuda", ordinal)
        if capacity_bytes is None:
            capacity_bytes = torch.cuda.get_device_properties(ordinal).total_memory
        super().__init__(
            index, device, name or f"cuda{index}", capacity_bytes, chaos, chaos_max_delay_s
        )
        self._torch_streams = {s: torch.cuda.Stream(device=device) for s in STREAMS}
        self._start_threads()

    def _respawn(self) -> Worker:
        return CudaWorker(self.index, self.device.index, self.capacity_bytes, self.chaos,
                          self.chaos_max_delay_s, self.name, self.host_memory)

    def torch_stream(self, stream: str) -> torch.cuda.Stream:
        return self._torch_streams[stream]

    def _stream_context(self, stream: str) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        # Current device and current stream are per thread in torch.
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self._torch_streams[stream]))
        return stack

    def _new_event(self, name: str) -> Event:
        return CudaEvent(name)

    def _record_current(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            event.cuda_event.record(torch.cuda.current_stream(self.device))
        event.set()

    def device_wait(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            # A stream may wait on an event of another device in the same process.
            torch.cuda.current_stream(self.device).wait_event(event.cuda_event)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _release(self, tensor: torch.Tensor) -> None:
        # The caching allocator ties a block to the stream it was allocated on; tell it every
        # stream of this worker may still use the tensor so the block is not reused too early.
        for stream in self._torch_streams.values():
            tensor.record_stream(stream)

    def host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.pinned)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def complete_copies(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


def make_workers(
    n: int,
    device: str = "auto",
    capacity_bytes: int | None = None,
    chaos: int | None = None,
    host_memory: str = "pinned",
) -> list[Worker]:
    """``n`` workers. ``device="cuda"`` makes one per GPU (round-robin when ``n`` exceeds the
    GPU count, so several workers may share one GPU); ``"virtual"`` makes CPU workers;
    ``"auto"`` picks CUDA when available and otherwise warns and falls back to virtual.
    ``host_memory``: whether CUDA workers stage their transfers in pinned or pageable host
    memory (``PlanOptions.host_memory``; virtual workers copy the same either way)."""
    from rpcompile.runtime.memory import pin_host_memory

    pin_host_memory(host_memory, "virtual")  # a bad choice fails here, whatever the device
    check_option("device", device)  # the device option's one check (rpcompile.choices)
    if n < 1:
        raise InvalidInput(f"make_workers needs n >= 1, got {n}")
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        else:
            warnings.warn(
                f"device='auto': no CUDA device (torch.cuda.is_available() is False: torch "
                f"{torch.__version__} {'has no CUDA build' if torch.version.cuda is None else 'found no GPU'}); "
                f"running on {n} virtual CPU workers instead",
                RuntimeWarning,
                stacklevel=2,
            )
            device = "virtual"
    if device == "cuda":
        return [CudaWorker(i, capacity_bytes=capacity_bytes, chaos=chaos,
                           host_memory=host_memory) for i in range(n)]
    if device == "virtual":
        return [VirtualWorker(i, capacity_bytes=capacity_bytes, chaos=chaos) for i in range(n)]
    raise StateError(device)  # unreachable: check_option refused it above

"""Stateless workers: one CUDA device, or one virtual CPU device backed by threads.

A worker has four streams, ``weight_upload``, ``activation_upload``, ``compute`` and
``download``. Each stream is one host thread consuming an ordered queue of callables, so work
on one stream runs in submission order and work on different streams runs concurrently; the
only thing that orders work across streams (and across workers) is an :class:`Event`. On a
:class:`CudaWorker` each thread issues its callables under its own CUDA stream, so the device
work is asynchronous and events are CUDA events; on a :class:`VirtualWorker` the callables run
on the CPU and events are threading primitives. The executor drives both through the same
interface.

Modules: ``events`` (Event, CudaEvent: one-shot, fail-able, waitable from the host or from a
stream), ``worker`` (Worker: streams, error capture, shutdown, device-memory accounting),
``devices`` (VirtualWorker: CPU tensors, chaos mode; CudaWorker: CUDA streams and events,
pinned or pageable staging, nothing CUDA at import; make_workers: ``device="auto" | "cuda" |
"virtual"``).

Failure model: an exception in a stream item is captured as a :class:`WorkerError` naming the
worker, stream and item label; the worker then drops every later item (on all its streams) and
fails the events those items would have recorded, so a wait on such an event anywhere raises
:class:`UpstreamFailed` instead of hanging. ``check()`` and ``synchronize()`` re-raise the root
error. ``shutdown()`` wakes every blocked wait (they poll an abort flag) and joins all threads.
"""

from rpcompile.runtime.workers.devices import CudaWorker, VirtualWorker, make_workers
from rpcompile.runtime.workers.events import CudaEvent, Event
from rpcompile.runtime.workers.worker import STREAMS, Worker

__all__ = [
    "STREAMS",
    "CudaEvent",
    "CudaWorker",
    "Event",
    "VirtualWorker",
    "Worker",
    "make_workers",
]

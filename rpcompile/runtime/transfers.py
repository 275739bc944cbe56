"""Priority-aware transfers between the host and one worker.

Per worker and direction (``h2d``, ``d2h``) there is one *lane*: a set of pending transfers
and at most one chunk in flight. Latency-critical transfers (a microbatch's activation or
output gradient; :attr:`Priority.CRITICAL`) are copied whole and go before bulk ones (the next
job's weights, a finished job's gradients; :attr:`Priority.BULK`), which are cut into chunks of
``chunk_bytes``. Whenever the lane is free, the best *ready* chunk is copied next (critical
before bulk, then submission order), so a critical transfer waits for at most one bulk chunk.

The copies run on the worker's own stream threads: each chunk submitted adds one "pump" item to
the worker's stream (critical h2d on ``activation_upload``, bulk h2d on ``weight_upload``, d2h on
``download``); a pump picks whatever chunk is best at the moment it runs, not necessarily the one
it was submitted for. So the engine needs no thread of its own, chaos mode delays its copies,
and a failed copy is captured by the worker with its context. On CUDA each chunk is synchronised
before the next is picked, which is what keeps a critical copy from queuing behind a whole bulk
transfer in the copy engine.

A transfer starts once all its ``after`` events are set; its ``done`` event is set when the
whole transfer is complete (the destination may be read).
"""

from __future__ import annotations

import collections
import enum
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rpcompile.runtime.errors import TransferError, UpstreamFailed, WorkerAborted, WorkerError
from rpcompile.runtime.workers import Event, Worker

__all__ = ["Priority", "Transfer", "TransferEngine", "TransferRecord"]

DEFAULT_CHUNK_BYTES = 8 << 20


class Priority(enum.IntEnum):
    CRITICAL = 0  # activations, output gradients: copied whole, first
    BULK = 1  # weights, gradients: chunked, yield to critical transfers between chunks


@dataclass(frozen=True)
class TransferRecord:
    """A finished transfer, for measured-vs-predicted comparisons (times: perf_counter s)."""

    label: str
    direction: str
    priority: Priority
    nbytes: int
    chunks: int
    submitted_s: float
    started_s: float
    finished_s: float


class Transfer:
    """A submitted transfer: ``dst`` is valid once ``done`` is set."""

    def __init__(
        self,
        label: str,
        direction: str,
        priority: Priority,
        src: torch.Tensor,
        dst: torch.Tensor,
        chunk_bytes: int,
        after: tuple[Event, ...],
        seq: int,
        chunks: int | None = None,
    ) -> None:
        self.label = label
        self.direction = direction
        self.priority = priority
        self.src = src
        self.dst = dst
        self.nbytes = src.numel() * src.element_size()
        if chunks is None:
            per_chunk = chunk_bytes if priority == Priority.BULK else max(1, self.nbytes)
            chunks = max(1, math.ceil(self.nbytes / per_chunk))
        self.chunks = chunks  # chunk i is bytes [i*n//chunks, (i+1)*n//chunks): near-equal
        self.after = after
        self.seq = seq
        self.done = Event(f"{direction}:{label}")
        self.next_chunk = 0  # next chunk to pick (under the lane lock)
        self.chunks_done = 0
        # Chunks of other transfers the lane picked between this one's submission and its first
        # chunk: 0 for a ready critical transfer (it only waits for the chunk in flight).
        self.picks_at_submit = 0
        self.waited_chunks = 0
        self.submitted_s = time.perf_counter()
        self.started_s = 0.0

    def __repr__(self) -> str:
        return (
            f"Transfer({self.label!r}, {self.direction}, {self.priority.name}, "
            f"{self.chunks_done}/{self.chunks} chunks)"
        )


class _Lane:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.pending: list[Transfer] = []  # transfers with chunks still to pick
        self.busy = False  # a chunk is being copied
        # One pump is queued per chunk; when a transfer fails, its unpicked chunks vanish and
        # as many pumps become surplus. A surplus pump returns at once instead of blocking its
        # stream until some unrelated transfer becomes ready.
        self.pumps = 0
        self.chunks_left = 0
        self.picks = 0  # chunks picked so far
        self.trace: collections.deque[tuple[str, int]] = collections.deque(maxlen=100_000)


class TransferEngine:
    """Host<->device transfers of one worker, prioritised and chunked (see the module doc).

    ``h2d(src)`` allocates the device destination through the worker (accounted, tagged);
    ``d2h(src)`` allocates a host staging buffer (pinned on CUDA). Call :meth:`close` when done:
    it fails every transfer that has not finished, so nobody waits on one forever.
    """

    def __init__(self, worker: Worker, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.worker = worker
        self.chunk_bytes = int(chunk_bytes)
        self._lanes = {"h2d": _Lane(), "d2h": _Lane()}
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._history: collections.deque[TransferRecord] = collections.deque(maxlen=100_000)
        self._closed = False
        worker.add_error_listener(self._on_worker_error)

    # -- submitting ----------------------------------------------------------------------
    def h2d(
        self,
        src: torch.Tensor,
        dst: torch.Tensor | None = None,
        *,
        priority: Priority | str = Priority.BULK,
        after: Sequence[Event] = (),
        label: str = "",
        tag: str = "",
        chunks: int | None = None,
    ) -> Transfer:
        """Copy a host tensor to the worker (into ``dst``, or a new accounted allocation).

        ``priority`` is a :class:`Priority` or its name (``"critical"``, ``"bulk"``, as in
        ``Action.priority``); ``chunks`` overrides the engine's chunking for this transfer (the
        lowered schedule's ``x16``)."""
        if dst is None:
            dst = self.worker.alloc(shape=src.shape, dtype=src.dtype, tag=tag or label)
        return self._submit("h2d", src, dst, priority, after, label, chunks)

    def d2h(
        self,
        src: torch.Tensor,
        dst: torch.Tensor | None = None,
        *,
        priority: Priority | str = Priority.BULK,
        after: Sequence[Event] = (),
        label: str = "",
        chunks: int | None = None,
    ) -> Transfer:
        """Copy a device tensor home (into ``dst``, or a new host staging buffer)."""
        if dst is None:
            dst = self.worker.host_empty(src.shape, src.dtype)
        return self._submit("d2h", src, dst, priority, after, label, chunks)

    def _submit(
        self,
        direction: str,
        src: torch.Tensor,
        dst: torch.Tensor,
        priority: Priority | str,
        after: Sequence[Event],
        label: str,
        chunks: int | None,
    ) -> Transfer:
        if isinstance(priority, str):
            priority = Priority[priority.upper()]
        if chunks is not None and chunks < 1:
            raise ValueError(f"transfer {label!r}: chunks must be >= 1, got {chunks}")
        if self._closed:
            raise WorkerAborted(f"transfer engine of {self.worker.name} is closed")
        if src.dtype != dst.dtype or src.numel() != dst.numel():
            raise ValueError(
                f"transfer {label!r}: source {src.dtype}[{src.numel()}] and destination "
                f"{dst.dtype}[{dst.numel()}] differ (the engine copies bytes; cast before)"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError(f"transfer {label!r}: source and destination must be contiguous")
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
        transfer = Transfer(
            label or f"{direction} #{seq}", direction, Priority(priority), src, dst,
            self.chunk_bytes, tuple(after), seq, chunks,
        )
        lane = self._lanes[direction]
        with lane.cv:
            transfer.picks_at_submit = lane.picks
            lane.pending.append(transfer)
            lane.pumps += transfer.chunks
            lane.chunks_left += transfer.chunks
        if self.worker.should_abort():
            # The worker failed (or is stopping) before or while this was queued: its pumps
            # will be dropped, so fail the transfer here (the failure listener may already
            # have run and missed it).
            self._fail_pending(WorkerAborted(f"worker {self.worker.name} failed or stopped"))
            return transfer
        for event in transfer.after:
            event.add_callback(lambda _e, lane=lane: self._notify(lane))
        if direction == "d2h":
            stream = "download"
        else:
            stream = "activation_upload" if priority == Priority.CRITICAL else "weight_upload"
        pump = self._pump_fn(lane)
        kind = "critical" if priority == Priority.CRITICAL else "bulk"
        for _ in range(transfer.chunks):
            self.worker.submit(stream, pump, label=f"{direction} {kind} chunk")
        return transfer

    # -- running -------------------------------------------------------------------------
    @staticmethod
    def _notify(lane: _Lane) -> None:
        with lane.cv:
            lane.cv.notify_all()

    def _pick(self, lane: _Lane) -> tuple[Transfer, int] | None:
        """The best ready chunk (under the lane lock); fails transfers whose inputs failed."""
        best = None
        for transfer in list(lane.pending):
            failed = next((e for e in transfer.after if e.error is not None), None)
            if failed is not None:
                self._drop_locked(lane, transfer)
                transfer.done.fail(UpstreamFailed(failed.name, failed.error))  # type: ignore[arg-type]
                continue
            if all(e.is_set() for e in transfer.after) and (
                best is None or (transfer.priority, transfer.seq) < (best.priority, best.seq)
            ):
                best = transfer
        if best is None:
            return None
        index = best.next_chunk
        if index == 0:
            best.waited_chunks = lane.picks - best.picks_at_submit
        lane.picks += 1
        best.next_chunk += 1
        lane.chunks_left -= 1
        lane.pumps -= 1
        if best.next_chunk == best.chunks:
            lane.pending.remove(best)
        lane.trace.append((best.label, index))
        return best, index

    @staticmethod
    def _drop_locked(lane: _Lane, transfer: Transfer) -> None:
        lane.pending.remove(transfer)
        lane.chunks_left -= transfer.chunks - transfer.next_chunk

    def _pump_fn(self, lane: _Lane) -> Callable[[], None]:
        def pump() -> None:
            with lane.cv:
                while True:
                    if self.worker.should_abort():
                        raise WorkerAborted(f"transfers of {self.worker.name} abandoned")
                    if lane.pumps > lane.chunks_left:
                        lane.pumps -= 1
                        return  # surplus: a transfer failed, nothing is left for this pump
                    if not lane.busy:
                        picked = self._pick(lane)
                        if picked is not None:
                            break
                    lane.cv.wait(0.02)
                lane.busy = True
            transfer, index = picked
            try:
                self._copy_chunk(transfer, index)
            except BaseException as exc:
                error = TransferError(
                    f"{transfer.direction} transfer {transfer.label!r} ({transfer.nbytes} bytes) "
                    f"failed at chunk {index + 1}/{transfer.chunks} on worker "
                    f"{self.worker.name}: {type(exc).__name__}: {exc}"
                )
                with lane.cv:
                    if transfer in lane.pending:
                        self._drop_locked(lane, transfer)
                transfer.done.fail(error)
                raise error from exc
            finally:
                with lane.cv:
                    lane.busy = False
                    lane.cv.notify_all()

        return pump

    def _copy_chunk(self, transfer: Transfer, index: int) -> None:
        if index == 0:
            transfer.started_s = time.perf_counter()
        # Device-side ordering after the inputs (a no-op on virtual workers, where a set event
        # means complete). Done for every chunk: chunks may run on either upload stream.
        for event in transfer.after:
            self.worker.device_wait(event)
        start = index * transfer.nbytes // transfer.chunks
        stop = (index + 1) * transfer.nbytes // transfer.chunks
        if stop > start:
            src = transfer.src.reshape(-1).view(torch.uint8)[start:stop]
            dst = transfer.dst.reshape(-1).view(torch.uint8)[start:stop]
            self.worker.copy_(dst, src)
            self.worker.complete_copies()
        transfer.chunks_done += 1
        if transfer.chunks_done == transfer.chunks:
            finished = time.perf_counter()
            self._history.append(TransferRecord(
                transfer.label, transfer.direction, transfer.priority, transfer.nbytes,
                transfer.chunks, transfer.submitted_s, transfer.started_s, finished,
            ))
            transfer.done.set()

    # -- observing and stopping ----------------------------------------------------------
    @property
    def history(self) -> list[TransferRecord]:
        """Finished transfers in completion order."""
        return list(self._history)

    def trace(self, direction: str) -> list[tuple[str, int]]:
        """(transfer label, chunk index) in the order the lane picked the chunks."""
        lane = self._lanes[direction]
        with lane.cv:
            return list(lane.trace)

    def _on_worker_error(self, error: WorkerError) -> None:
        self._fail_pending(error)

    def _fail_pending(self, error: BaseException) -> None:
        for lane in self._lanes.values():
            with lane.cv:
                pending = list(lane.pending)
                for transfer in pending:
                    self._drop_locked(lane, transfer)
                lane.cv.notify_all()
            for transfer in pending:
                transfer.done.fail(error)

    def close(self) -> None:
        """Fail every unfinished transfer (its waiters raise instead of hanging)."""
        self._closed = True
        self._fail_pending(WorkerAborted(f"transfer engine of {self.worker.name} closed"))

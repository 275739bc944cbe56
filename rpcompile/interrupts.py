"""SIGINT (Ctrl-C) and SIGTERM during ``rpcompile train``: stop at a step boundary, never in
the middle of the job's own bookkeeping.

Before the first step a signal stops the job at once (nothing is trained yet). In the step
loop the first signal lets the step in flight finish and the loop stops after it; a second one
stops at once: the trainer discards the step in flight (``KeyboardInterrupt`` aborts a step
and leaves the state of the last committed one). The job's bookkeeping of a committed step
(the learning-rate scheduler, the log) runs under :meth:`Interrupts.deferred`, where a signal
waits for its end. The job then writes a checkpoint of the last committed step and exits with
128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process the
signal ended.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Interrupts"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """The signals a job received; :meth:`installed` handles them while the job runs."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.graceful = False  # in the step loop: a first signal waits for the step's end
        self._deferring = False
        self._pending = False

    @contextlib.contextmanager
    def installed(self, enabled: bool = True) -> Iterator[Interrupts]:
        """Handle SIGINT and SIGTERM inside the block (the main thread only, where Python
        runs signal handlers), and restore the handlers before it after."""
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        try:
            yield self
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "an interrupt"

    @property
    def status(self) -> int:
        """The exit status: 128 + the first signal's number (130 for Ctrl-C)."""
        return 128 + (self.signum or signal.SIGINT)

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if first and self.graceful:
            print(f"\ntrain: {self.name}: stopping after the step in flight, then saving a "
                  "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)
            return
        if self._deferring:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block no signal cuts in half: one that arrives inside it stops the job at its
        end."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

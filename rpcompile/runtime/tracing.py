"""Keep torch's process-global tracing flags away from the optimizer's updates.

``torch.export.export`` (and ``torch.compile``) set ``torch.compiler._is_compiling_flag`` and
``_is_exporting_flag`` for as long as they trace. Those flags are process-global, not
per-thread, and ``torch.optim`` reads them: under them AdamW's ``_get_value`` keeps the step
count a tensor, so its bias corrections are computed in fp32 tensor math instead of Python
floats, and the update differs from an eager one in the last bits. A trainer's updates run on
its own optimizer thread, so without a guard a ``compile()`` in the main thread (of another
model, while the last update of this one is still running) silently changed the masters.

The guard is a readers-writer lock: rpcompile's capture traces inside :func:`tracing`
(exclusive: it waits until no update is inside the user's ``optimizer.step()``, and updates
queued meanwhile wait until the capture is done); each update's call of the user's optimizer
runs inside :func:`outside_tracing` (shared: the updates of several trainers run at once). A
waiting capture goes first, so a stream of updates (async mode) cannot starve it. Neither side
waits for anything else while it holds the lock, so the two cannot deadlock; an update waits at
most one capture. Tracing started by user code (its own ``torch.export`` or ``torch.compile``
in another thread while a trainer updates) is outside this guard: don't overlap the two.

The workers' compute items need no guard: they run the captured graphs (ATen calls, which read
no tracing flag). Checked: a step with the flag set gives the same losses and masters for the
tiny qwen3, qwen3_moe and gpt_oss models of the tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["outside_tracing", "tracer_waiting", "tracing"]

_cond = threading.Condition()
_updates = 0  # threads inside outside_tracing()
_tracer: int | None = None  # the thread inside tracing(), by ident
_depth = 0  # its nesting depth (tracing() is reentrant)
_waiting_tracers = 0


@contextmanager
def tracing() -> Iterator[None]:
    """Trace (torch.export) with no optimizer update running meanwhile (see the module doc)."""
    global _tracer, _depth, _waiting_tracers
    me = threading.get_ident()
    with _cond:
        if _tracer == me:
            _depth += 1
        else:
            _waiting_tracers += 1
            try:
                while _tracer is not None or _updates:
                    _cond.wait()
            finally:
                _waiting_tracers -= 1
            _tracer, _depth = me, 1
    try:
        yield
    finally:
        with _cond:
            _depth -= 1
            if _depth == 0:
                _tracer = None
                _cond.notify_all()


@contextmanager
def outside_tracing() -> Iterator[None]:
    """Run an optimizer update while no capture traces (see the module doc)."""
    global _updates
    me = threading.get_ident()
    with _cond:
        # (The tracing thread never waits for itself.)
        while _tracer != me and (_tracer is not None or _waiting_tracers):
            _cond.wait()
        _updates += 1
    try:
        yield
    finally:
        with _cond:
            _updates -= 1
            if _updates == 0:
                _cond.notify_all()


def tracer_waiting() -> bool:
    """True while a capture waits for the running updates to leave (for tests)."""
    with _cond:
        return bool(_waiting_tracers)

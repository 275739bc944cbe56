"""Keep torch's process-global tracing flags away from the optimizer's updates.

``torch.export.export`` (and ``torch.compile``) set ``torch.compiler._is_compiling_flag`` and
``_is_exporting_flag`` for as long as they trace. Those flags are process-global, not
per-thread, and ``torch.optim`` reads them: under them AdamW's ``_get_value`` keeps the step
count a tensor, so its bias corrections are computed in fp32 tensor math instead of Python
floats, and the update differs from an eager one in the last bits. A trainer's updates run on
the thread that runs its step (the schedule's OPT actions; or the driver's own thread, for
callers without a schedule), so without a guard a ``compile()`` in another thread (of another
model, while an update of this one is running) silently changed the masters.

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
from typing import Any

__all__ = [
    "fx_source_mark",
    "outside_tracing",
    "release_fx_sources",
    "release_shape_env_caches",
    "tracer_waiting",
    "tracing",
]

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


# --------------------------------------------------------------------------------------------
# What a capture leaves in torch's process-global state, released at Compiled.close()
# --------------------------------------------------------------------------------------------
#
# Measured with benchmarks/compile_cycles.py (see docs/runtime.md 5e): without this, every
# compile/close cycle kept ~1.1 MB. Two torch objects hold it:
#   - the capture's ShapeEnv (torch.fx.experimental.symbolic_shapes), with its per-env
#     ``fake_tensor_cache`` (~500 dispatch entries of symbolic keys per capture of the tiny
#     qwen3). The ShapeEnv itself stays alive after the Compiled is gone: two of its SymNodes
#     are referenced from C++ (no Python object refers to them), so the cache goes only when
#     it is cleared.
#   - torch.fx's ``graph_module._loader.eval_cache`` and ``linecache``: the generated source
#     of every GraphModule recompiled (the capture's own and torch.export's intermediate ones),
#     kept forever for tracebacks.


def fx_source_mark() -> int:
    """The id the next generated fx source will get (bracket a compile with two marks)."""
    from torch.fx.graph_module import _loader

    return int(_loader.next_id)


def release_fx_sources(start: int, stop: int) -> int:
    """Drop the generated fx sources with ids in ``[start, stop)`` from torch.fx's cache and
    linecache (tracebacks through those graphs then show no source line); returns how many."""
    import linecache

    from torch.fx.graph_module import _loader

    dropped = 0
    for key in list(_loader.eval_cache):
        head = key.split(" ", 1)[0]
        prefix, _, number = head.rpartition(".")
        if prefix == "<eval_with_key>" and number.isdigit() and start <= int(number) < stop:
            _loader.eval_cache.pop(key, None)
            linecache.cache.pop(key, None)
            dropped += 1
    return dropped


def release_shape_env_caches(graphs: Any) -> int:
    """Clear the fake-tensor dispatch cache of every ShapeEnv the fake values in ``graphs``'
    node meta belong to (a cache: nothing is lost but speed); returns how many entries."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    envs: dict[int, Any] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            values = node.meta.get("val")
            for value in values if isinstance(values, (list, tuple)) else (values,):
                env = None
                if isinstance(value, FakeTensor):
                    env = value.fake_mode.shape_env
                elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    env = value.node.shape_env
                if env is not None:
                    envs[id(env)] = env
    cleared = 0
    for env in envs.values():
        cache = getattr(env, "fake_tensor_cache", None)
        if cache:
            cleared += len(cache)
            cache.clear()
    return cleared

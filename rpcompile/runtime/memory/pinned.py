"""Exact-size flat host buffers, pinned by registering them with the CUDA driver (or left
pageable when the run asks for it): the one pinning decision (pin_host_memory) and the few
driver calls it takes."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import ClassVar

import torch

from rpcompile.errors import InvalidInput
from rpcompile.options import check_option
from rpcompile.runtime.errors import format_bytes

__all__ = [
    "pin_host_memory",
]


def pin_host_memory(host_memory: str, device_kind: str) -> bool:
    """Whether a run pins its host memory (the host store's flat buffers and the workers'
    transfer staging): on CUDA workers with ``host_memory="pinned"`` (the default), never
    with ``"pageable"`` (RoundPipe's ``pin_model="off"``: every copy then goes through the
    driver's own staging) and never on virtual workers, whose copies are CPU copies either
    way. The one decision the Trainer and the CudaWorker read."""
    check_option("host_memory", host_memory)  # a public helper: the option's one check
    return device_kind == "cuda" and host_memory == "pinned"


def _host_flat(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, str]:
    """An exact-size flat host buffer, pinned by registering it with the CUDA driver; where
    the registration fails, a warning that says why and a buffer of torch's caching pinned
    allocator instead (pinned all the same, its size maybe rounded up)."""
    flat = torch.empty(numel, dtype=dtype)
    if not pin:
        return flat, "no"
    if not torch.cuda.is_available():
        raise InvalidInput("pin=True needs CUDA (torch.cuda.is_available() is False); use pin=False")
    if numel == 0:
        return flat, "registered"
    failure = _register(flat.data_ptr(), flat.nbytes)
    if failure is not None:
        warnings.warn(
            f"registering {format_bytes(flat.nbytes)} of host memory with the CUDA driver "
            f"failed ({failure}); using torch's caching pinned allocator instead, which may "
            "round the buffer up to a power of two",
            RuntimeWarning,
            stacklevel=3,
        )
        return _caching_pinned(numel, dtype), "caching allocator (may round up)"
    # Unregister before the memory goes back to the CPU allocator.
    weakref.finalize(flat, _unregister, flat.data_ptr())
    return flat, "registered"


def _caching_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


# [Note: registration through the driver API]
# torch's binding of cudaHostRegister (torch.cuda.cudart()) returns the error of a failed call
# but leaves it as the CUDA runtime's last error of the calling thread, and torch offers no
# cudaGetLastError to clear it. The next kernel launch on that thread (a worker's stream thread,
# for the staging buffers) then raises it at an unrelated op, failing the step instead of
# falling back. The driver API keeps no such state: a call returns its error and that is all.
# Driver calls act on the thread's current context, which a fresh stream thread may not have
# yet, so each call runs inside the device's primary context (the one torch's runtime uses).


def _register(pointer: int, nbytes: int) -> str | None:
    """Register ``nbytes`` at ``pointer`` as pinned memory every GPU can read; None when it is
    done, else what failed."""
    try:
        driver = _driver()
    except OSError as exc:
        return f"the CUDA driver library could not be loaded: {exc}"
    return driver.register(pointer, nbytes)


def _unregister(pointer: int) -> None:
    # A finalizer: it may run at exit, with CUDA shut down, where a failure changes nothing.
    with contextlib.suppress(OSError, RuntimeError):
        _driver().unregister(pointer)


@functools.cache
def _driver() -> _Driver:
    return _Driver(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"))


class _Driver:
    """The few CUDA driver API calls that host registration needs, through ctypes."""

    _SIGNATURES: ClassVar[dict[str, list]] = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
        "cuCtxPushCurrent_v2": [ctypes.c_void_p],
        "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
        "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostUnregister": [ctypes.c_void_p],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    _PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: every context sees the memory as pinned

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for name, arguments in self._SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, ctypes.c_int
            self._functions[name] = function

    def register(self, pointer: int, nbytes: int) -> str | None:
        return self._in_primary_context(
            lambda: self._call("cuMemHostRegister_v2", pointer, nbytes, self._PORTABLE))

    def unregister(self, pointer: int) -> str | None:
        return self._in_primary_context(lambda: self._call("cuMemHostUnregister", pointer))

    def _call(self, name: str, *arguments: object) -> str | None:
        result = self._functions[name](*arguments)
        if result == 0:  # CUDA_SUCCESS
            return None
        text = ctypes.c_char_p()
        self._functions["cuGetErrorName"](result, ctypes.byref(text))
        return f"{name} returned {(text.value or b'').decode() or 'CUresult'} ({result})"

    def _in_primary_context(self, call: Callable[[], str | None]) -> str | None:
        # The device of torch's current device (portable memory: any device would do).
        ordinal = torch.cuda.current_device()
        device, context = ctypes.c_int(), ctypes.c_void_p()
        failure = (self._call("cuInit", 0)
                   or self._call("cuDeviceGet", ctypes.byref(device), ordinal)
                   or self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device))
        if failure:
            return failure
        try:
            failure = self._call("cuCtxPushCurrent_v2", context)
            if failure:
                return failure
            try:
                return call()
            finally:
                self._call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
        finally:
            self._call("cuDevicePrimaryCtxRelease_v2", device)

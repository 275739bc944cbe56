"""The transfer kernels' public API (cast_pack, cast_flat, accumulate_grads), which backend
runs them, their validation and the torch reference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from rpcompile.errors import InvalidInput
from rpcompile.options import KERNELS, check_option
from rpcompile.runtime.kernels.tables import _KIND, _launch

__all__ = [
    "BACKENDS",
    "accumulate_grads",
    "cast_flat",
    "cast_pack",
    "host_backend",
    "nonfinite_flag",
    "packed_offsets",
    "resolve_backend",
]


BACKENDS = KERNELS  # the kernels option's choices (rpcompile.options)

def resolve_backend(backend: str, device: torch.device) -> str:
    """Return the concrete backend (``"torch"`` or ``"triton"``) for ``backend`` on ``device``."""
    check_option("kernels", backend, name="backend")  # the kernels option's one check
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def host_backend(kernels: str, worker_kind: str) -> str:
    """The backend of the host's own kernel calls (the shadow refresh, on CPU tensors) in a run
    whose workers are of ``worker_kind`` and whose ``kernels`` option is ``kernels``.

    Beside CUDA workers it is ``"torch"`` whatever ``kernels`` says: the compiled kernels need
    CUDA tensors, and Triton's interpreter on the host would cost ~1 ms per program (seconds a
    step for a large model), hold the GIL against the stream threads and patch
    ``triton.language`` while a stream thread may be compiling. Beside virtual workers it is
    ``kernels`` itself, so ``kernels="triton"`` runs the interpreter on the host too and the
    CPU tests cover the kernel on both sides of the transfer.
    """
    check_option("kernels", kernels)
    if worker_kind == "cuda":
        return "torch"
    if worker_kind == "virtual":
        return kernels
    raise InvalidInput(f"unknown worker kind {worker_kind!r}; expected 'cuda' or 'virtual'")


def packed_offsets(tensors: Sequence[torch.Tensor], align: int = 1) -> list[int]:
    """Offsets that lay ``tensors`` end to end from 0, each rounded up to a multiple of ``align``.

    ``align=1`` (the default layout of the kernels) packs tightly. ``align=8`` keeps every
    tensor 16-byte aligned in a bf16/fp16 buffer (32 in fp32), which lets the Triton kernels
    use vectorised 16-byte accesses on a GPU (they fall back to narrower ones otherwise).
    The buffer then needs ``offsets[-1] + tensors[-1].numel()`` elements.
    """
    if align < 1:
        raise InvalidInput(f"align must be >= 1, got {align}")
    offsets, at = [], 0
    for tensor in tensors:
        at = -(-at // align) * align
        offsets.append(at)
        at += tensor.numel()
    return offsets


def nonfinite_flag(device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh found-non-finite flag for :func:`accumulate_grads`: one int32 zero on ``device``.

    The kernels only ever raise it to 1, so one flag can collect a whole step (every microbatch,
    every stage on that device); reset it with ``flag.zero_()``.
    """
    return torch.zeros(1, dtype=torch.int32, device=device)


def cast_pack(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    out: torch.Tensor,
    offsets: Sequence[int] | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Write fp32 ``sources`` into the flat buffer ``out`` at ``offsets``, casting to ``out.dtype``.

    ``out`` is a contiguous 1-D bf16, fp16 or fp32 tensor; its dtype is the target dtype. The
    cast rounds to nearest even exactly like ``source.to(out.dtype)``. ``offsets`` defaults to
    :func:`packed_offsets` (end to end from 0); ranges must lie inside ``out`` and not overlap.
    ``sources`` may be one tensor (e.g. a flat fp32 buffer). Returns ``out``.
    """
    sources = [sources] if isinstance(sources, torch.Tensor) else list(sources)
    offsets = packed_offsets(sources) if offsets is None else list(offsets)
    _check_flat(out, "out", (torch.bfloat16, torch.float16, torch.float32))
    _check_sources(sources, offsets, out, (torch.float32,), "sources")
    if resolve_backend(backend, out.device) == "torch":
        with torch.no_grad():
            for source, offset in zip(sources, offsets):
                # copy_ converts with the same rounding as Tensor.to.
                out[offset : offset + source.numel()].copy_(source.reshape(-1))
        return out
    _launch("cast", sources, offsets, out, flag=None)
    return out


def cast_flat(
    source: torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Cast a flat fp32 buffer (a gradient accumulator) to bf16/fp16 for a low-precision download.

    Give either ``out`` (a contiguous 1-D buffer of at least ``source.numel()`` elements, written
    from 0) or ``dtype`` (a new buffer is allocated on ``source.device``). Returns the buffer.
    """
    if out is None:
        if dtype is None:
            raise InvalidInput("cast_flat needs `out` or `dtype` (torch.bfloat16 or torch.float16)")
        out = torch.empty(source.numel(), dtype=dtype, device=source.device)
    elif dtype is not None and dtype != out.dtype:
        raise InvalidInput(f"cast_flat: dtype={dtype} disagrees with out.dtype={out.dtype}")
    return cast_pack([source], out, [0], backend=backend)


def accumulate_grads(
    grads: Sequence[torch.Tensor],
    accumulator: torch.Tensor,
    offsets: Sequence[int] | None = None,
    *,
    found_nonfinite: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Add each gradient into the flat fp32 ``accumulator`` at its offset, all in one launch.

    Equivalent to ``accumulator[off:off + g.numel()] += g.float()`` for every ``g`` (bf16, fp16
    or fp32, contiguous, on the accumulator's device), bit for bit. ``offsets`` defaults to
    :func:`packed_offsets`; ranges must not overlap (one launch adds them concurrently).

    ``found_nonfinite`` (from :func:`nonfinite_flag`) is set to 1 when any updated accumulator
    element is inf or NaN (a non-finite gradient, or a finite sum that overflowed). It is
    raised on the device and never lowered, so reading it is the caller's only host sync.
    Returns ``accumulator``.
    """
    grads = list(grads)
    offsets = packed_offsets(grads) if offsets is None else list(offsets)
    _check_flat(accumulator, "accumulator", (torch.float32,))
    _check_sources(grads, offsets, accumulator, tuple(_KIND), "grads")
    if found_nonfinite is not None:
        _check_flag(found_nonfinite, accumulator.device)
    if resolve_backend(backend, accumulator.device) == "torch":
        with torch.no_grad():
            for grad, offset in zip(grads, offsets):
                region = accumulator[offset : offset + grad.numel()]
                # One fp32 add, rounded once: exactly `region + grad.float()` (and on CPU
                # ~15x faster than letting add_ promote a bf16 operand element by element).
                region.add_(grad.reshape(-1).float())
                if found_nonfinite is not None and region.numel():
                    # amax propagates NaN, so this is the isfinite test at a tenth of the cost.
                    bad = (~torch.isfinite(region.abs().amax())).to(torch.int32)
                    torch.maximum(found_nonfinite, bad, out=found_nonfinite)
        return accumulator
    _launch("accumulate", grads, offsets, accumulator, flag=found_nonfinite)
    return accumulator


def _check_flat(buffer: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if buffer.dtype not in dtypes or buffer.dim() != 1 or not buffer.is_contiguous():
        raise InvalidInput(
            f"{name} must be a contiguous 1-D tensor of dtype {' or '.join(map(str, dtypes))}; "
            f"got dtype={buffer.dtype}, shape={tuple(buffer.shape)}, "
            f"contiguous={buffer.is_contiguous()}"
        )


def _check_sources(
    sources: list[torch.Tensor],
    offsets: list[int],
    flat: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    name: str,
) -> None:
    if len(offsets) != len(sources):
        raise InvalidInput(f"{len(sources)} {name} but {len(offsets)} offsets")
    spans = []
    for index, (tensor, offset) in enumerate(zip(sources, offsets)):
        where = f"{name}[{index}]"
        if tensor.dtype not in dtypes:
            raise InvalidInput(f"{where} has dtype {tensor.dtype}; expected one of {dtypes}")
        if tensor.device != flat.device:
            raise InvalidInput(f"{where} is on {tensor.device} but the flat buffer on {flat.device}")
        if not tensor.is_contiguous():
            raise InvalidInput(f"{where} is not contiguous; pass tensor.contiguous()")
        if offset < 0 or offset + tensor.numel() > flat.numel():
            raise InvalidInput(
                f"{where} ({tensor.numel()} elements at offset {offset}) does not fit in the "
                f"flat buffer of {flat.numel()} elements"
            )
        if tensor.numel():
            spans.append((offset, offset + tensor.numel(), index))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise InvalidInput(f"{name}[{first}] and {name}[{second}] overlap in the flat buffer")


def _check_flag(flag: torch.Tensor, device: torch.device) -> None:
    if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != device:
        raise InvalidInput(
            f"found_nonfinite must be nonfinite_flag({str(device)!r}) (one int32 on {device}); "
            f"got dtype={flag.dtype}, numel={flag.numel()}, device={flag.device}"
        )

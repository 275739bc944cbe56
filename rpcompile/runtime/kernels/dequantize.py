"""Dequantization of packed weights (NF4/FP4 and int8) in the compute dtype, bit-identical to
bitsandbytes; the torch reference is rpcompile.capture.quantized's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
import torch

from rpcompile.errors import InvalidInput
from rpcompile.runtime.kernels.programs import _INTERPRETER_LOCK, _triton_kernels
from rpcompile.runtime.kernels.tables import (
    _CUDA_BLOCK,
    _INTERPRETER_BLOCK_RANGE,
    _KIND,
    _first_launch_alone,
)
from rpcompile.runtime.kernels.transfer import resolve_backend

__all__ = [
    "dequantize_4bit",
    "dequantize_int8",
    "dequantize_packed",
]


# A frozen quantized weight (rpcompile.capture.quantized.PackedWeight) travels packed; the worker
# rebuilds it in the compute dtype. One program writes BLOCK consecutive weight elements, so a
# weight is one launch whatever its size. The torch backend is the graph op's own
# implementation (rpcompile.capture.quantized), which tests/capture/test_quantized.py holds bit-identical
# to bitsandbytes.


def dequantize_4bit(
    packed: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    *,
    shape: Sequence[int],
    blocksize: int,
    dtype: torch.dtype,
    absmax_code: torch.Tensor | None = None,
    absmax_scale: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
    absmax_blocksize: int = 0,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Rebuild a packed 4-bit weight of logical ``shape`` in ``dtype`` (bf16, fp16 or fp32).

    ``packed``: uint8, two codes a byte (the first in the high nibble); ``code``: the 16 fp32
    values of the format (NF4 or FP4); ``absmax``: one scale per ``blocksize`` weights, fp32,
    or uint8 when double-quantized, then decoded as ``absmax_code[a] * absmax_scale[i //
    absmax_blocksize] + absmax_offset``. ``out`` (optional) is a contiguous tensor of
    ``prod(shape)`` elements of ``dtype`` on the same device (a view into a stage's weight
    buffer); it is returned, viewed as ``shape``.
    """
    n = _check_dequantize(packed, (torch.uint8,), shape, dtype, out, "packed")
    if packed.numel() * 2 < n:
        raise InvalidInput(f"packed holds {packed.numel() * 2} 4-bit codes, the shape {tuple(shape)} "
                         f"needs {n}")
    nested = absmax_code is not None
    if nested != (absmax_scale is not None) or nested != (absmax_offset is not None):
        raise InvalidInput("a double-quantized absmax needs absmax_code, absmax_scale and "
                         "absmax_offset together")
    if blocksize < 1 or (nested and absmax_blocksize < 1):
        raise InvalidInput(f"blocksize ({blocksize}) and, when double-quantized, absmax_blocksize "
                         f"({absmax_blocksize}) must be positive")
    if absmax.dtype != (torch.uint8 if nested else torch.float32):
        raise InvalidInput(f"absmax has dtype {absmax.dtype}; expected "
                         f"{'uint8 (double-quantized)' if nested else 'float32'}")
    if out is None:
        out = torch.empty(n, dtype=dtype, device=packed.device)
    if resolve_backend(backend, packed.device) == "torch":
        from rpcompile.capture.quantized import dequantize_4bit_reference

        with torch.no_grad():
            out.view(-1).copy_(dequantize_4bit_reference(
                packed, code, absmax, absmax_code, absmax_scale, absmax_offset, blocksize,
                absmax_blocksize, list(shape), dtype).reshape(-1))
        return out.view(*shape)
    if n:
        block = _dequantize_block(n, packed.device)
        kernels = _triton_kernels(interpret=not packed.is_cuda)
        args = (packed, code, absmax, absmax_code if nested else code,
                absmax_scale if nested else code, absmax_offset if nested else code, out, n,
                blocksize, max(absmax_blocksize, 1))
        meta = dict(BLOCK=block, NESTED=nested, OUT_DTYPE=kernels.dtypes[dtype],
                    OUT_IS_BF16=dtype == torch.bfloat16)
        _dequantize_launch(kernels.dequantize_4bit, (_cdiv(n, block),), args, meta,
                           ("dequantize_4bit", packed.device, dtype, block, nested))
    return out.view(*shape)


def dequantize_packed(weight: Any, dtype: torch.dtype, *, out: torch.Tensor | None = None,
                      backend: str = "auto") -> torch.Tensor:
    """Rebuild a :class:`rpcompile.capture.quantized.PackedWeight` (its tensors on one device,
    e.g. uploaded) in ``dtype``: :func:`dequantize_4bit` or :func:`dequantize_int8`."""
    state = dict(weight.state)
    if weight.format == "int8":
        return dequantize_int8(weight.packed, state["row_absmax"], dtype=dtype, out=out,
                               backend=backend)
    return dequantize_4bit(
        weight.packed, state["code"], state["absmax"], shape=weight.shape,
        blocksize=weight.blocksize, dtype=dtype, absmax_code=state.get("absmax_code"),
        absmax_scale=state.get("absmax_scale"), absmax_offset=state.get("absmax_offset"),
        absmax_blocksize=weight.absmax_blocksize, out=out, backend=backend)


def dequantize_int8(
    weight: torch.Tensor,
    row_absmax: torch.Tensor,
    *,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Rebuild an int8 weight ``[rows, cols]`` in ``dtype``: ``weight * (row_absmax / 127)``,
    per row, rounded once (bitsandbytes' int8 training matmul). ``out`` as for
    :func:`dequantize_4bit`."""
    if weight.dim() != 2:
        raise InvalidInput(f"weight must be 2-D [rows, cols], got shape {tuple(weight.shape)}")
    n = _check_dequantize(weight, (torch.int8,), weight.shape, dtype, out, "weight")
    if row_absmax.dtype != torch.float32 or row_absmax.numel() != weight.shape[0]:
        raise InvalidInput(f"row_absmax must hold {weight.shape[0]} float32 values, one per row; "
                         f"got {row_absmax.numel()} of {row_absmax.dtype}")
    if out is None:
        out = torch.empty(n, dtype=dtype, device=weight.device)
    if resolve_backend(backend, weight.device) == "torch":
        from rpcompile.capture.quantized import dequantize_int8_reference

        with torch.no_grad():
            out.view(-1).copy_(dequantize_int8_reference(weight, row_absmax, dtype).reshape(-1))
        return out.view(weight.shape)
    if n:
        block = _dequantize_block(n, weight.device)
        kernels = _triton_kernels(interpret=not weight.is_cuda)
        meta = dict(BLOCK=block, OUT_DTYPE=kernels.dtypes[dtype],
                    OUT_IS_BF16=dtype == torch.bfloat16)
        _dequantize_launch(kernels.dequantize_int8, (_cdiv(n, block),),
                           (weight, row_absmax, out, n, weight.shape[1]), meta,
                           ("dequantize_int8", weight.device, dtype, block))
    return out.view(weight.shape)


def _check_dequantize(source, dtypes, shape, dtype, out, name) -> int:
    if source.dtype not in dtypes or not source.is_contiguous():
        raise InvalidInput(f"{name} must be a contiguous {dtypes[0]} tensor; got {source.dtype}, "
                         f"contiguous={source.is_contiguous()}")
    if dtype not in _KIND:
        raise InvalidInput(f"dtype must be bfloat16, float16 or float32, not {dtype}")
    n = 1
    for d in shape:
        n *= int(d)
    if out is not None and (out.dtype != dtype or out.numel() != n or not out.is_contiguous()
                            or out.device != source.device):
        raise InvalidInput(
            f"out must be a contiguous {dtype} tensor of {n} elements on {source.device}; got "
            f"{out.dtype}, {out.numel()} elements, contiguous={out.is_contiguous()}, on "
            f"{out.device}")
    return n


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dequantize_block(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        return _CUDA_BLOCK
    low, high = _INTERPRETER_BLOCK_RANGE
    return min(high, max(low, 1 << (n - 1).bit_length()))


# No fused multiply-add: bitsandbytes decodes a double-quantized absmax with a multiply,
# rounded, then a separate add; one fma would round once and differ.
_DEQUANTIZE_OPTIONS = {"enable_fp_fusion": False}


def _dequantize_launch(kernel, grid, args, meta, key) -> None:
    if args[0].is_cuda:
        _first_launch_alone(key, lambda: kernel[grid](*args, **meta, **_DEQUANTIZE_OPTIONS))
    else:
        with _INTERPRETER_LOCK, numpy.errstate(over="ignore", invalid="ignore"):
            kernel[grid](*args, **meta)

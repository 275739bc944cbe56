"""The Triton programs of the transfer path and of dequantization, and how they are wrapped:
compiled on CUDA tensors, run by Triton's interpreter on CPU tensors (no triton import until
the first launch)."""

# Annotations stay strings, so the kernels' `tl.constexpr` annotations are not evaluated before
# triton is imported; Triton reads the string form the same way.
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile.errors import StateError

# Plain functions here; _triton_kernels() wraps them. On CPU tensors they run in Triton's
# interpreter, chosen explicitly per call, so TRITON_INTERPRET need not be set for them. The
# interpreter executes the source against this module's globals, so `tl` must be a module
# global: _triton_kernels() binds it on first use.

tl: Any = None
_INTERPRETER_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Kernels:
    cast: Any
    accumulate: Any
    dequantize_4bit: Any
    dequantize_int8: Any
    dtypes: dict[torch.dtype, Any]


@functools.cache
def _triton_kernels(interpret: bool) -> _Kernels:
    global tl
    try:
        import triton
        import triton.language as language
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as error:  # pragma: no cover - triton is a declared dependency
        raise StateError(
            "backend='triton' needs the triton package; use backend='torch'"
        ) from error
    if not interpret and triton.knobs.runtime.interpret:
        # TRITON_INTERPRET=1 makes triton.jit interpret, which would dereference the raw CUDA
        # addresses in our block tables on the host.
        raise StateError(
            "TRITON_INTERPRET=1 is set but the tensors are on CUDA; unset it to run the "
            "compiled kernels, or move the tensors to the CPU to use the interpreter"
        )
    tl = language
    wrap = InterpretedFunction if interpret else triton.jit
    return _Kernels(
        cast=wrap(_cast_pack_kernel),
        accumulate=wrap(_accumulate_kernel),
        dequantize_4bit=wrap(_dequantize_4bit_kernel),
        dequantize_int8=wrap(_dequantize_int8_kernel),
        dtypes={
            torch.bfloat16: language.bfloat16,
            torch.float16: language.float16,
            torch.float32: language.float32,
        },
    )


def _cast_pack_kernel(
    rows,
    out_ptr,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    OUT_IS_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    row = rows + tl.program_id(0) * 4
    source = tl.load(row).to(tl.pointer_type(tl.float32))
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    # Alignment hints (no-ops in the interpreter) let the compiler use 16-byte accesses.
    if ALIGNED:
        source = tl.multiple_of(source, 16)
        start = tl.multiple_of(start, 8)
    lanes = tl.arange(0, BLOCK)
    # Full blocks go unmasked: a mask built from a loaded count hides the contiguity that
    # vectorised 16-byte accesses need.
    if count == BLOCK:
        x = tl.load(source + lanes)
    else:
        x = tl.load(source + lanes, mask=lanes < count, other=0.0)
    if OUT_IS_BF16:
        # Round to nearest even by hand: the interpreter's float->bf16 cast truncates. Adding
        # 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
        # half is above one half, or equal to it with an odd kept half; a carry out of the
        # mantissa bumps the exponent (max finite rounds to inf) as the IEEE rule requires.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        # NaNs would round into inf or flip sign through the carry: keep a quiet NaN instead.
        rounded = tl.where(x != x, 0x7FC0, rounded)
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        # fp16 (round to nearest even on GPUs and in the interpreter's numpy cast) or fp32.
        y = x.to(OUT_DTYPE)
    if count == BLOCK:
        tl.store(out_ptr + start + lanes, y)
    else:
        tl.store(out_ptr + start + lanes, y, mask=lanes < count)


def _accumulate_kernel(
    rows,
    acc_ptr,
    flag_ptr,
    BLOCK: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    MIXED: tl.constexpr,
    CHECK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    row = rows + tl.program_id(0) * 4
    address = tl.load(row)
    start = tl.load(row + 1)
    count = tl.load(row + 2)
    if ALIGNED:
        start = tl.multiple_of(start, 8)
    lanes = tl.arange(0, BLOCK)
    inside = lanes < count
    if MIXED:
        # One launch for sources of several dtypes: read through all three pointer types, with
        # the loads of the wrong types masked off, and keep the right one.
        kind = tl.load(row + 3)
        as_bf16 = address.to(tl.pointer_type(tl.bfloat16))
        as_fp16 = address.to(tl.pointer_type(tl.float16))
        as_fp32 = address.to(tl.pointer_type(tl.float32))
        x_bf16 = tl.load(as_bf16 + lanes, mask=inside & (kind == 0), other=0.0).to(tl.float32)
        x_fp16 = tl.load(as_fp16 + lanes, mask=inside & (kind == 1), other=0.0).to(tl.float32)
        x_fp32 = tl.load(as_fp32 + lanes, mask=inside & (kind == 2), other=0.0)
        x = tl.where(kind == 0, x_bf16, tl.where(kind == 1, x_fp16, x_fp32))
        total = tl.load(acc_ptr + start + lanes, mask=inside, other=0.0) + x
        tl.store(acc_ptr + start + lanes, total, mask=inside)
    else:
        source = address.to(tl.pointer_type(SRC_DTYPE))
        if ALIGNED:
            source = tl.multiple_of(source, 16)
        if count == BLOCK:
            x = tl.load(source + lanes).to(tl.float32)
            total = tl.load(acc_ptr + start + lanes) + x
            tl.store(acc_ptr + start + lanes, total)
        else:
            x = tl.load(source + lanes, mask=inside, other=0.0).to(tl.float32)
            total = tl.load(acc_ptr + start + lanes, mask=inside, other=0.0) + x
            tl.store(acc_ptr + start + lanes, total, mask=inside)
    if CHECK:
        # Only lanes holding inf or NaN write, and all write 1, so the race is benign and a
        # finite block costs no memory traffic. (Masked lanes hold 0 + 0: finite.) tl.max
        # would be simpler but is a @triton.jit library function, which the interpreter can
        # only run when TRITON_INTERPRET was set before triton was first imported.
        bad = (total != total) | (tl.abs(total) == float("inf"))
        tl.store(flag_ptr + lanes * 0, tl.full([BLOCK], 1, tl.int32), mask=bad)


def _dequantize_4bit_kernel(
    packed_ptr,
    code_ptr,
    absmax_ptr,
    absmax_code_ptr,
    absmax_scale_ptr,
    absmax_offset_ptr,
    out_ptr,
    n,
    blocksize,
    absmax_blocksize,
    BLOCK: tl.constexpr,
    NESTED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    OUT_IS_BF16: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    byte = tl.load(packed_ptr + index // 2, mask=inside, other=0)
    nibble = tl.where(index % 2 == 0, byte >> 4, byte & 0xF).to(tl.int32)
    value = tl.load(code_ptr + nibble, mask=inside, other=0.0)
    block = index // blocksize
    if NESTED:
        coded = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
        scale = tl.load(absmax_code_ptr + coded, mask=inside, other=0.0)
        scale = scale * tl.load(absmax_scale_ptr + block // absmax_blocksize, mask=inside,
                                other=0.0)
        scale = scale + tl.load(absmax_offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)
    x = value * scale
    if OUT_IS_BF16:
        # Round to nearest even by hand (see _cast_pack_kernel); a finite product cannot be NaN.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(OUT_DTYPE)
    tl.store(out_ptr + index, y, mask=inside)


def _dequantize_int8_kernel(
    weight_ptr,
    row_absmax_ptr,
    out_ptr,
    n,
    cols,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    OUT_IS_BF16: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    w = tl.load(weight_ptr + index, mask=inside, other=0).to(tl.float32)
    scale = tl.load(row_absmax_ptr + index // cols, mask=inside, other=0.0)
    x = w * (scale * (1.0 / 127.0))
    if OUT_IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(OUT_DTYPE)
    tl.store(out_ptr + index, y, mask=inside)

"""Fused kernels on the weight and gradient transfer path, in Triton with a torch reference.

Every job uploads its stage's weights as one flat low-precision buffer and sends its gradients
home from one flat fp32 accumulator. These kernels do the per-stage work in one launch each
instead of one copy and one cast per parameter tensor:

  cast_pack            fp32 tensors -> one flat bf16/fp16/fp32 buffer (round to nearest even)
  cast_flat            the reverse cast of a flat fp32 accumulator, for a low-precision download
  accumulate_grads     bf16/fp16/fp32 gradient tensors added into the flat fp32 accumulator,
                       with an optional fused inf/NaN check that sets a flag on the device
  dequantize_4bit      a packed NF4/FP4 weight (absmax plain or double-quantized) -> the
                       compute dtype, bit-identical to bitsandbytes' dequantize_4bit
  dequantize_int8      an int8 weight and its row absmax -> the compute dtype, as bitsandbytes'
                       int8 training matmul dequantizes it
  dequantize_packed    either of the two for a captured PackedWeight

Each takes ``backend``: ``"torch"`` (the reference, plain torch ops), ``"triton"`` (the Triton
kernel: compiled on CUDA tensors, run by Triton's interpreter on CPU tensors) or ``"auto"``
(Triton on CUDA, torch elsewhere). :func:`host_backend` is the rule for the host's own calls
(the shadow refresh on CPU tensors): the interpreter runs there only beside virtual workers.
Both backends are bit-exact with torch for every finite and infinite value; a NaN stays a NaN,
but its bits may differ (torch itself does not fix them: its vectorised CPU cast to bf16
writes 0xFFFF for every NaN, its scalar cast 0x7FC0).

Sections, in reading order:
  1. Public API: the transfer kernels, their validation and the torch reference
  2. Block tables: how many tensors become one launch
  3. Triton kernels (plain functions, wrapped lazily so importing this module imports no triton)
  4. Dequantization of packed weights (their torch reference is rpcompile.capture.quantized's)

See docs/kernels.md for the design, the bf16 rounding trick and the interpreter notes.
"""

# Annotations stay strings, so the kernels' `tl.constexpr` annotations are not evaluated before
# triton is imported; Triton reads the string form the same way.
from __future__ import annotations

import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from rpcompile.errors import InvalidInput, StateError
from rpcompile.options import KERNELS, check_option

__all__ = [
    "BACKENDS",
    "accumulate_grads",
    "cast_flat",
    "cast_pack",
    "dequantize_4bit",
    "dequantize_int8",
    "dequantize_packed",
    "host_backend",
    "nonfinite_flag",
    "packed_offsets",
    "resolve_backend",
]

BACKENDS = KERNELS  # the kernels option's choices (rpcompile.options)

# Dtype codes shared by the host-side tables and the kernels.
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


# ============================================================================================
# 1. Public API
# ============================================================================================


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


# ============================================================================================
# 2. Block tables
# ============================================================================================
# One program handles one block of at most BLOCK elements of one source tensor. A table row per
# block, int64 [source address of the block, destination element offset, element count, dtype
# code], tells it where: any number of tensors of any sizes, on any allocation, is one launch.
# Rows are built with vectorised torch ops and cached by their full content, so a stale entry
# can never be wrong (same addresses, sizes, offsets and dtypes give the same table).

_ROW = 4
# On a GPU, 4096 elements per program keeps enough bytes in flight per SM for a copy-bound
# kernel. The interpreter pays ~1 ms per program plus numpy work over the whole block (masked
# lanes included), so there the block follows the tensor sizes between these bounds.
_CUDA_BLOCK = 4096
_INTERPRETER_BLOCK_RANGE = (256, 65536)


@dataclass(frozen=True)
class _Table:
    rows: torch.Tensor  # int64 (blocks, _ROW) on the kernel's device
    block: int
    aligned: bool  # every block's source address divisible by 16 bytes and offset by 8 elements
    mixed: bool  # sources of more than one dtype (the kernel then reads the dtype per block)
    source_dtype: torch.dtype


def _block_size(sizes: list[int], device: torch.device) -> int:
    if device.type == "cuda":
        return _CUDA_BLOCK
    low, high = _INTERPRETER_BLOCK_RANGE
    largest = max(sizes)
    return min(high, max(low, 1 << (largest - 1).bit_length()))


def _table(sources: list[torch.Tensor], offsets: list[int], out: torch.Tensor) -> _Table | None:
    live = [(t, o) for t, o in zip(sources, offsets) if t.numel()]
    if not live:
        return None
    sizes = [t.numel() for t, _ in live]
    block = _block_size(sizes, out.device)
    # The CUDA stream is part of the key: a table's upload is queued on the stream current at
    # build time, so a table is only ever read on the stream that uploaded it (and, once
    # evicted, its memory is reused in that stream's order).
    stream = torch.cuda.current_stream(out.device).cuda_stream if out.is_cuda else 0
    key = (
        str(out.device),
        stream,
        block,
        tuple(t.data_ptr() for t, _ in live),
        tuple(sizes),
        tuple(o for _, o in live),
        tuple(_KIND[t.dtype] for t, _ in live),
    )
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = _build_table(*key)
    with _TABLES_LOCK:
        _TABLES[key] = table
        # Least recently used first out, by bytes: a stage of 1e9 parameters has ~8 MB of rows
        # on the GPU, and stateless workers see new gradient addresses every job.
        while sum(t.rows.nbytes for t in _TABLES.values()) > _TABLE_CACHE_BYTES:
            _TABLES.popitem(last=False)
    return table


_TABLE_CACHE_BYTES = 32 * 2**20
_TABLES: OrderedDict[tuple, _Table] = OrderedDict()
_TABLES_LOCK = threading.Lock()


def _build_table(
    device: str,
    stream: int,
    block: int,
    addresses: tuple[int, ...],
    sizes: tuple[int, ...],
    offsets: tuple[int, ...],
    kinds: tuple[int, ...],
) -> _Table:
    del stream  # part of the key only
    itemsize = {0: 2, 1: 2, 2: 4}
    address = torch.tensor(addresses, dtype=torch.int64)
    size = torch.tensor(sizes, dtype=torch.int64)
    offset = torch.tensor(offsets, dtype=torch.int64)
    kind = torch.tensor(kinds, dtype=torch.int64)
    element = torch.tensor([itemsize[k] for k in kinds], dtype=torch.int64)
    blocks = (size + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(sizes)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(int(blocks.sum())) - first[owner]) * block
    rows = torch.stack(
        [
            address[owner] + start * element[owner],
            offset[owner] + start,
            torch.clamp(size[owner] - start, max=block),
            kind[owner],
        ],
        dim=1,
    ).contiguous()
    # Blocks start at multiples of `block` (a power of two >= 256) elements, so a block is
    # aligned when its tensor's base address and destination offset are.
    aligned = bool((address % 16 == 0).all() and (offset % 8 == 0).all())
    target = torch.device(device)
    if target.type == "cuda":
        rows = rows.pin_memory().to(target, non_blocking=True)
    return _Table(
        rows=rows,
        block=block,
        aligned=aligned,
        mixed=len(set(kinds)) > 1,
        source_dtype=next(d for d, k in _KIND.items() if k == kinds[0]),
    )


def _launch(
    op: str,
    sources: list[torch.Tensor],
    offsets: list[int],
    out: torch.Tensor,
    flag: torch.Tensor | None,
) -> None:
    table = _table(sources, offsets, out)
    if table is None:
        return  # nothing to move: no launch, and the flag stays as it was
    kernels = _triton_kernels(interpret=not out.is_cuda)
    if out.is_cuda:
        # What Triton specialises a launch on: the constexprs, the pointer dtypes and each
        # pointer's 16-byte alignment (the table and the flag are fresh allocations, aligned).
        key = (op, out.device, out.dtype, out.data_ptr() % 16 == 0, table.block,
               table.aligned, table.mixed, table.source_dtype, flag is not None)
        _first_launch_alone(key, lambda: _run(kernels, op, table, out, flag))
    else:
        # The interpreter patches triton.language module-wide for the length of a launch, so
        # launches from several threads (virtual workers) must take turns. It also emulates the
        # kernel with numpy, which warns where IEEE arithmetic overflows to inf or makes a NaN;
        # on a GPU (and in torch) that is silent and intended.
        with _INTERPRETER_LOCK, numpy.errstate(over="ignore", invalid="ignore"):
            _run(kernels, op, table, out, flag)


def _first_launch_alone(key: tuple, launch: Any) -> None:
    """Run ``launch``; the first launch of each specialization ``key`` runs alone.

    The first launch compiles. Compute threads of several workers reach the same kernel at
    about the same time, and without this each would compile it (seconds each, in the first
    step) and race on Triton's cache. Later launches take no lock.
    """
    if key not in _LAUNCHED:
        with _COMPILE_LOCK:
            if key not in _LAUNCHED:
                launch()
                _LAUNCHED.add(key)
                return
    launch()


_COMPILE_LOCK = threading.Lock()
_LAUNCHED: set[tuple] = set()


def _run(
    kernels: _Kernels, op: str, table: _Table, out: torch.Tensor, flag: torch.Tensor | None
) -> None:
    tl_dtype = kernels.dtypes
    grid = (table.rows.shape[0],)
    if op == "cast":
        kernels.cast[grid](
            table.rows,
            out,
            BLOCK=table.block,
            OUT_DTYPE=tl_dtype[out.dtype],
            OUT_IS_BF16=out.dtype == torch.bfloat16,
            ALIGNED=table.aligned,
        )
    else:
        kernels.accumulate[grid](
            table.rows,
            out,
            out if flag is None else flag,  # an unused pointer when the check is off
            BLOCK=table.block,
            SRC_DTYPE=tl_dtype[table.source_dtype],
            MIXED=table.mixed,
            CHECK=flag is not None,
            ALIGNED=table.aligned,
        )


# ============================================================================================
# 3. Triton kernels
# ============================================================================================
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


# ============================================================================================
# 4. Dequantization of packed weights
# ============================================================================================
# A frozen quantized weight (rpcompile.capture.quantized.PackedWeight) travels packed; the worker
# rebuilds it in the compute dtype. One program writes BLOCK consecutive weight elements, so a
# weight is one launch whatever its size. The torch backend is the graph op's own
# implementation (rpcompile.capture.quantized), which tests/test_quantized.py holds bit-identical
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

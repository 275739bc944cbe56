"""Block tables: how many tensors become one launch, and the launch of the transfer kernels
(the first launch of each specialization alone, the interpreter's launches one at a time)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from rpcompile.runtime.kernels.programs import _INTERPRETER_LOCK, _Kernels, _triton_kernels

# Dtype codes shared by the host-side tables and the kernels.
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


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

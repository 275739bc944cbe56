"""Effective bandwidth of the transfer-path kernels against a plain device copy.

Each kernel moves a known number of bytes (cast_pack fp32 -> bf16 reads 4 and writes 2 bytes
per element; accumulate_grads bf16 -> fp32 reads 2 + 4 and writes 4). Effective bandwidth is
those bytes over the kernel's time; the yardstick is ``torch.Tensor.copy_`` of a buffer of the
same total traffic on the same device. On CUDA the target is >= 80% of the copy.

Without CUDA the Triton kernels can only run in Triton's interpreter (numpy, one Python call per
program), so the script falls back to small sizes and says so: those figures measure the
interpreter, not the kernels, and must not be compared with GPU numbers.

    python benchmarks/transfer_kernels.py                     # CUDA if present, else the interpreter
    python benchmarks/transfer_kernels.py --elements 50000000 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from _results import RESULTS, write_result  # beside this script

from rpcompile.runtime import kernels

TARGET_FRACTION = 0.8
DEFAULT_JSON = RESULTS / "transfer_kernels.json"


@dataclass(frozen=True)
class Measurement:
    kernel: str
    backend: str
    elements: int
    tensors: int
    bytes_moved: int
    median_ms: float
    gbps: float
    fraction_of_copy: float


def stage_shapes(elements: int) -> list[int]:
    """Tensor sizes of a decoder-like stage: large matrices plus small norm vectors and biases,
    with odd sizes so that tails and unaligned offsets occur."""
    hidden = 1024 if elements >= 4 * 1024 * 1024 else 128
    sizes, total = [], 0
    pattern = [4 * hidden * hidden, hidden * hidden + 3, hidden, 3 * hidden * hidden, hidden + 1]
    while total < elements:
        for size in pattern:
            size = min(size, elements - total)
            if size <= 0:
                break
            sizes.append(size)
            total += size
    return sizes


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], list[float]]:
    def cuda_times(fn: Callable[[], object], repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def cpu_times(fn: Callable[[], object], repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        return times

    return cuda_times if device.type == "cuda" else cpu_times


def measure(
    device: torch.device, elements: int, repeats: int, backends: list[str]
) -> tuple[float, list[Measurement]]:
    times_of = _timer(device)
    sizes = stage_shapes(elements)
    total = sum(sizes)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def median_ms(fn: Callable[[], object]) -> float:
        # Warm-up: compiles the kernel, builds the block table, faults the pages in.
        fn()
        fn()
        return statistics.median(times_of(fn, repeats))

    # The yardstick: one copy whose read + write traffic equals the smallest kernel traffic
    # below (cast to bf16: 4 + 2 bytes per element).
    copy_bytes = 6 * total
    source = torch.ones(copy_bytes // 2, dtype=torch.uint8, device=device)
    copy_gbps = copy_bytes / (
        median_ms(partial(torch.Tensor.copy_, torch.empty_like(source), source)) * 1e6
    )
    del source

    masters = [torch.randn(n, generator=gen).to(device) for n in sizes]
    offsets = kernels.packed_offsets(masters)
    cases: list[tuple[str, int, Callable[..., object], tuple, dict]] = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        packed = torch.zeros(total, dtype=dtype, device=device)
        grads = [m.to(dtype) for m in masters]
        accumulator = torch.zeros(total, device=device)
        flag = kernels.nonfinite_flag(device)
        flat = torch.randn(total, generator=gen).to(device)
        cases += [
            (
                f"cast_pack fp32->{name}",
                6 * total,
                kernels.cast_pack,
                (masters, packed, offsets),
                {},
            ),
            (
                f"accumulate {name}->fp32 +check",
                10 * total,
                kernels.accumulate_grads,
                (grads, accumulator, offsets),
                {"found_nonfinite": flag},
            ),
            (f"cast_flat fp32->{name}", 6 * total, kernels.cast_flat, (flat, packed), {}),
        ]
    results = []
    for backend in backends:
        for kernel, moved, fn, fn_args, fn_kwargs in cases:
            ms = median_ms(partial(fn, *fn_args, **fn_kwargs, backend=backend))
            gbps = moved / (ms * 1e6)
            results.append(
                Measurement(kernel, backend, total, len(sizes), moved, ms, gbps, gbps / copy_gbps)
            )
    return copy_gbps, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Effective bandwidth of rpcompile's transfer-path kernels (cast_pack, "
        "accumulate_grads, cast_flat) against a plain device copy of the same traffic. On "
        "CUDA the target is >= 80%% of the copy; on CPU the Triton kernels run in the "
        "interpreter at small sizes and the figures only show that they run."
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--elements",
        type=int,
        default=None,
        help="parameters in the benchmarked stage (default: 64M on CUDA, 256K on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per kernel")
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"where to write results ({DEFAULT_JSON})"
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    elements = args.elements or (64 * 2**20 if on_cuda else 256 * 2**10)
    repeats = args.repeats or (20 if on_cuda else 5)
    backends = ["triton", "torch"]
    if on_cuda:
        name = torch.cuda.get_device_name(device)
    else:
        name = "CPU (1 thread)"
        # One thread: on a small shared machine torch's parallel copies wait on busy cores for
        # whole scheduler slices, which makes the yardstick meaningless.
        torch.set_num_threads(1)
        print(
            "!" * 78 + "\n"
            "!! NO CUDA DEVICE: the Triton kernels run in Triton's INTERPRETER (numpy).\n"
            f"!! Small size ({elements:,} elements). These figures measure the interpreter,\n"
            "!! not the kernels; the >= 80%-of-copy target applies to CUDA runs only.\n" + "!" * 78,
            file=sys.stderr,
        )

    copy_gbps, results = measure(device, elements, repeats, backends)

    print(f"device: {name}   plain copy: {copy_gbps:.1f} GB/s   elements: {elements:,}")
    print(f"{'kernel':32} {'backend':8} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    for m in results:
        print(
            f"{m.kernel:32} {m.backend:8} {m.median_ms:9.3f} {m.gbps:8.3g} "
            f"{m.fraction_of_copy:8.2%}"
        )
    triton_results = [m for m in results if m.backend == "triton"]
    worst = min(triton_results, key=lambda m: m.fraction_of_copy)
    mode = "cuda" if on_cuda else "cpu-interpreter"
    verdict = (
        ("meets" if worst.fraction_of_copy >= TARGET_FRACTION else "MISSES")
        + f" the {TARGET_FRACTION:.0%} target"
        if on_cuda
        else "interpreter run, target not applicable"
    )
    print(
        f"summary [{mode}] {name}: triton kernels at {worst.fraction_of_copy:.2%} "
        f"(worst: {worst.kernel}) to "
        f"{max(m.fraction_of_copy for m in triton_results):.2%} of copy "
        f"({copy_gbps:.1f} GB/s); {verdict}"
    )

    report = {
        "mode": mode,
        "device": name,
        "elements": elements,
        "repeats": repeats,
        "copy_gbps": copy_gbps,
        "target_fraction": TARGET_FRACTION,
        "torch": torch.__version__,
        "results": [asdict(m) for m in results],
    }
    write_result(args.json, report)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

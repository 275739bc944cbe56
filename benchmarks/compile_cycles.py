"""Memory and threads across compile / step / close cycles: nothing may accumulate.

Each cycle builds a tiny Qwen3 model, compiles it for 2 virtual workers, runs one step and
closes it. After ``--warmup`` cycles (first-use caches: torch.export, dispatcher tables) it
records the process's live thread count and resident set size (RSS, /proc/self/statm) after
each cycle and a ``gc.collect()``, and prints the thread count at the start and end and the
RSS growth per cycle (least-squares slope over the measured cycles, in MB per cycle; target:
threads back to their start, growth under 0.1 MB per cycle).

    python benchmarks/compile_cycles.py [--cycles 50] [--warmup 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import RESULTS, write_result  # beside this script


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_cycle() -> None:
    import torch

    import rpcompile
    from tests.tiny_models import hf_model, token_batch

    model = hf_model("qwen3", layers=2)
    compiled = rpcompile.compile(model, gpus=2, microbatches=3, example_inputs=token_batch(6),
                                 device="virtual", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compiled.step(token_batch(6))
    compiled.close()


def slope(values: list[float]) -> float:
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n)) or 1.0
    return num / den


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=50, help="measured cycles (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="cycles before measuring (default 5)")
    ap.add_argument("--json", type=Path, default=RESULTS / "compile_cycles.json",
                    help="where to write the figures")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    threads_start = threading.active_count()
    for _ in range(args.warmup):
        one_cycle()
    gc.collect()
    threads_warm = threading.active_count()
    rss, threads = [rss_mb()], [threads_warm]
    start = time.perf_counter()
    for i in range(args.cycles):
        one_cycle()
        gc.collect()
        rss.append(rss_mb())
        threads.append(threading.active_count())
        print(f"cycle {i + 1:3d}: threads {threads[-1]:3d}  RSS {rss[-1]:8.2f} MB  "
              f"({rss[-1] - rss[-2]:+.2f})", flush=True)
    per_cycle = slope(rss)
    result = {
        "cycles": args.cycles,
        "warmup": args.warmup,
        "threads_at_start": threads_start,
        "threads_after_warmup": threads_warm,
        "threads_at_end": threads[-1],
        "threads_max": max(threads),
        "rss_start_mb": rss[0],
        "rss_end_mb": rss[-1],
        "rss_growth_mb_per_cycle": per_cycle,
        "rss_growth_mb_per_cycle_first_to_last": (rss[-1] - rss[0]) / args.cycles,
        "seconds": time.perf_counter() - start,
    }
    out = write_result(args.json, result)
    print(f"{args.cycles} compile/step/close cycles: threads {threads_start} at start, "
          f"{threads[-1]} at end (max {max(threads)}); RSS {rss[0]:.1f} -> {rss[-1]:.1f} MB, "
          f"growth {per_cycle:.3f} MB/cycle (slope), "
          f"{result['rss_growth_mb_per_cycle_first_to_last']:.3f} MB/cycle (end-start); "
          f"wrote {out}")


if __name__ == "__main__":
    main()

"""Compile-time benchmark: build the paper's largest models from their configs on the ``meta``
device (no weight memory) and compile them for 8x RTX 4090; print seconds per pass and the plan.

Target: each model compiles in under 60 s on a 2-core CPU.

    python benchmarks/compile_time.py [--models qwen3-32b llama3.1-8b qwen3-235b-a22b]
                                      [--seq 2048] [--batch 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

import rpcompile
from rpcompile.workloads.models import build_model, list_models

DEFAULT = ["qwen3-32b", "llama3.1-8b", "qwen3-235b-a22b"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT, choices=list_models())
    ap.add_argument("--hardware", default="rtx4090x8")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences) of one round")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/compile_time.json"))
    args = ap.parse_args()

    results = {}
    for name in args.models:
        t0 = time.perf_counter()
        model = build_model(name, device="meta")
        built = time.perf_counter() - t0
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
        compiled = rpcompile.compile(
            model, gpus=8, microbatches=args.microbatches, hardware=args.hardware,
            example_inputs=ids,
        )
        total = time.perf_counter() - t0
        real = sum(p.numel() for p in model.parameters() if not p.is_meta)
        passes = {r.name: round(r.elapsed_ms / 1e3, 3) for r in compiled.history}
        results[name] = {
            "build_s": round(built, 3), "passes_s": passes, "total_s": round(total, 3),
            "nodes": compiled.capture.report.node_count, "units": len(compiled.plan.units),
            "stages": len(compiled.plan.stages),
            "predicted_step_ms": round(compiled.plan.predicted_step_ms, 1),
            "real_parameter_elements": real,
        }
        print(f"== {name}: built in {built:.1f}s, compiled in {total - built:.1f}s "
              f"({', '.join(f'{k} {v:.2f}s' for k, v in passes.items())}); "
              f"{real} parameter elements allocated")
        print(compiled.plan)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"models": results, "max_rss_gib": round(rss_gib, 2)}, indent=2))
    worst = max(results.values(), key=lambda r: r["total_s"])
    print(f"compile_time: {len(results)} models, slowest {worst['total_s']:.1f}s "
          f"(target < 60 s each), peak RSS {rss_gib:.2f} GiB -> {args.json}")


if __name__ == "__main__":
    main()

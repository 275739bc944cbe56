"""How the partitioner's search finds the simulator's fastest plan, on the paper's models.

The partitioner builds every candidate plan (tail size x forward count x backward count, cut
min-max, plus its local search on the bound), bounds each candidate's simulated figure from
below (``rpcompile.planner.bound.simulated_lower_bound``), and replays candidates in the
simulator, best first, until every candidate left has a bound at least the best simulated
figure (optimality proven) or ``max_simulations`` replays are spent (the plan's notes give the
gap). This script partitions each model and reports: the candidates, the simulations run,
whether optimality was proven (and the gap when not), the chosen figure, the planning time,
and how far the bound sits below the simulated figure of the candidates that were simulated
(simulated / bound, min-max).

    python benchmarks/ranking_model.py [--models qwen3-1.7b llama3.1-8b] [--modes sync async]
                                       [--json PATH]

Run against another tree (``PYTHONPATH=<tree>``) it reports what that tree's partitioner
did: one without ``rpcompile.planner.bound`` has no candidate count or proof (``null``).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from _results import RESULTS, write_result  # beside this script

from rpcompile.hardware import get_hardware
from rpcompile.options import PlanOptions
from rpcompile.planner import partition as partition_module
from rpcompile.workloads.paper import get_model

# The replays and the candidates are patched where the best-first search looks them up: its
# own module where partition is a package, the module itself where it is one file.
search_module = getattr(partition_module, "search", partition_module)

MODELS = ["qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b"]


def compare(name: str, mode: str, hardware: str = "rtx4090x8") -> dict:
    """Partition ``name`` for ``mode`` (8 GPUs, 16 microbatches of 4 x 2,048 tokens, no
    boundary refinement) and record the search."""
    hw = get_hardware(hardware)
    try:
        from rpcompile.planner.bound import simulated_lower_bound
    except ImportError:  # a tree without the best-first search
        simulated_lower_bound = None
    runs: list[tuple[float, float | None]] = []  # (simulated, bound)
    candidates: list[int] = []
    simulated_ms = search_module._simulated_ms
    best_simulated = getattr(search_module, "_best_simulated", None)

    def recording(plan, hw_, rounds, optimizer, capacity):
        out = simulated_ms(plan, hw_, rounds, optimizer, capacity)
        bound = (simulated_lower_bound(plan, hw_, rounds, optimizer)
                 if simulated_lower_bound is not None else None)
        runs.append((out[0][0], bound))
        return out

    def counting(pools, *args):  # a candidate may be in several grids' pools: counted once
        candidates.append(len({search_module._bounds(p) for pool in pools for p in pool}))
        return best_simulated(pools, *args)

    search_module._simulated_ms = recording
    if best_simulated is not None:
        search_module._best_simulated = counting
    try:
        t0 = time.perf_counter()
        plan = partition_module.partition(get_model(name).units(4, 2048), hw,
                                          PlanOptions(gpus=8, microbatches=16, mode=mode),
                                          refine=0)
        seconds = time.perf_counter() - t0
    finally:
        search_module._simulated_ms = simulated_ms
        if best_simulated is not None:
            search_module._best_simulated = best_simulated
    notes = " ".join(plan.notes)
    gap = re.search(r"a gap of at most ([0-9.]+)%", notes)
    with_bound = [(sim, b) for sim, b in runs if b is not None]
    return {
        "model": name, "mode": mode,
        "candidates": sum(candidates) if candidates else None,
        "simulations": len(runs),
        "proven_optimal": ("proven no faster" in notes) if candidates else None,
        "gap_at_most_pct": float(gap.group(1)) if gap else None,
        "chosen_ms": plan.predicted_step_ms,
        "partition_s": seconds,
        "simulated_over_bound": ([min(s / b for s, b in with_bound),
                                  max(s / b for s, b in with_bound)] if with_bound else None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--json", type=Path, default=RESULTS / "ranking_model.json")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        for mode in args.modes:
            row = compare(name, mode)
            rows.append(row)
            proof = {None: "no proof (shortlist)", True: "optimal proven",
                     False: f"NOT proven (gap <= {row['gap_at_most_pct']}%)"}[row["proven_optimal"]]
            bound = row["simulated_over_bound"]
            print(f"{name:14s} {mode:5s} candidates {row['candidates']}, "
                  f"{row['simulations']} simulated, {proof}, chosen {row['chosen_ms']:.1f} ms, "
                  f"{row['partition_s']:.1f} s; simulated/bound "
                  f"{'-' if bound is None else f'{bound[0]:.3f}-{bound[1]:.3f}'}", flush=True)
    write_result(args.json, rows)
    print(f"ranking_model: {len(rows)} runs, optimality proven in "
          f"{sum(bool(r['proven_optimal']) for r in rows)} -> {args.json}")


if __name__ == "__main__":
    main()

"""Compile time of the paper workloads: each model built from its config on the ``meta`` device
(no weight memory) and compiled for 8x RTX 4090 at its paper shape (rpcompile.workloads.paper:
global batch, microbatches, rounds, 2,048-token sequences), once cold (a fresh plan cache) and
once more from the plan cache; per model the seconds (wall and CPU), the partition search's
replays and proven gap, and the plan's predicted tokens/s against the plan of an exhaustive
search (``search_effort="exhaustive"``: no cap on replays, the plan proven the simulator's
fastest of its candidates).

The exhaustive reference takes minutes per model; it runs with ``--reference`` and its figures
(with the commit that made them) are kept in the results file, so a later run without the flag
compares with them.

    python benchmarks/compile_time.py [--models qwen3-1.7b ...] [--effort normal]
                                      [--reference] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import RESULTS, stamp, write_result

import rpcompile
from rpcompile.choices import SEARCH_EFFORTS
from rpcompile.options import PlanOptions
from rpcompile.workloads.models import build_model
from rpcompile.workloads.paper import WORKLOADS

PAPER = ("qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")


def search_figures(plan) -> dict:
    """The replays of the plan's search and its proven gap (None: proven), from its note."""
    note = next((n for n in plan.notes if n.startswith("search:")), "")
    replays = re.search(r"(\d+) simulated|after (\d+) simulations", note)
    gap = re.search(r"a gap of at most ([\d.]+)%", note)
    return {"replays": int(next(g for g in replays.groups() if g)) if replays else None,
            "gap_pct": float(gap.group(1)) if gap else None, "search_note": note}


def compile_once(name: str, model, effort: str, cache) -> dict:
    w = WORKLOADS[name]
    ids = torch.zeros(w.global_batch, w.seq_len, dtype=torch.long, device="meta")
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = rpcompile.compile(model, gpus=8, microbatches=w.microbatches, rounds=w.rounds,
                                 hardware="rtx4090x8", example_inputs=ids, device="virtual",
                                 search_effort=effort, plan=PlanOptions(plan_cache=cache,
                                                                        progress=False))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    plan = compiled.plan
    return {"seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "passes_s": {r.name: round(r.elapsed_ms / 1e3, 3) for r in compiled.history},
            "stages": len(plan.stages), "predicted_step_ms": round(plan.predicted_step_ms, 1),
            "tokens_per_s": round(w.tokens_per_step / (plan.predicted_step_ms / 1e3), 1),
            **search_figures(plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER), choices=list(PAPER))
    ap.add_argument("--effort", default="normal", choices=SEARCH_EFFORTS,
                    help="the search effort measured")
    ap.add_argument("--reference", action="store_true",
                    help="also run the exhaustive search (minutes per model) and keep its figures")
    ap.add_argument("--json", type=Path, default=RESULTS / "compile_time.json")
    args = ap.parse_args()

    # The other workloads' rows, and the reference figures of an earlier --reference run,
    # stay: each row is written as soon as it is measured.
    results = {}
    if args.json.exists():
        results = json.loads(args.json.read_text()).get("figures", {}).get("models", {})
    kept = {m: f["reference"] for m, f in results.items() if f.get("reference")}
    for name in args.models:
        t0 = time.perf_counter()
        model = build_model(name, device="meta")
        built = time.perf_counter() - t0
        try:
            with tempfile.TemporaryDirectory() as cache:
                cold = compile_once(name, model, args.effort, cache)
                cached = compile_once(name, model, args.effort, cache)
        except ValueError as err:  # no plan fits (PartitionError): said, not measured
            results[name] = {"shape": vars(WORKLOADS[name]), "effort": args.effort,
                             "refused": str(err)}
            print(f"{name}: refused: {err}", flush=True)
            write_result(args.json, {"models": results, "max_rss_gib": _rss_gib()})
            continue
        row = {"shape": vars(WORKLOADS[name]), "build_s": round(built, 2), "effort": args.effort,
               "cold": cold, "cached": {k: cached[k] for k in ("seconds", "cpu_seconds")}}
        if args.reference:  # kept by later runs: it names the code that searched
            row["reference"] = {k: v for k, v in compile_once(
                name, model, "exhaustive", False).items() if k != "passes_s"}
            row["reference"]["commit"] = stamp()["commit"]
        elif name in kept:
            row["reference"] = kept[name]
        ref = row.get("reference")
        if ref:
            row["of_reference"] = round(cold["tokens_per_s"] / ref["tokens_per_s"], 4)
        results[name] = row
        gap = "proven" if cold["gap_pct"] is None else f"gap <= {cold['gap_pct']:.2f}%"
        versus = (f", {100 * row['of_reference']:.2f}% of the exhaustive search's "
                  f"{ref['tokens_per_s']:,.0f} tokens/s ({ref['replays']} replays, "
                  f"{ref['seconds']:.0f} s)" if ref else "")
        print(f"{name}: cold {cold['seconds']:.1f} s (CPU {cold['cpu_seconds']:.1f} s), cached "
              f"{cached['seconds']:.1f} s; {cold['replays']} replays, {gap}; "
              f"{cold['tokens_per_s']:,.0f} tokens/s{versus}", flush=True)
        del model
        write_result(args.json, {"models": results, "max_rss_gib": _rss_gib()})
    print(f"compile_time: {len(args.models)} workloads, peak RSS {_rss_gib():.2f} GiB -> "
          f"{args.json}", file=sys.stderr)


def _rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


if __name__ == "__main__":
    main()

"""What the memory-bounding waits cost and buy on the paper workloads, by the simulator.

For each of the five paper workloads (rpcompile.workloads.paper.WORKLOADS, 8x RTX 4090),
RoundPipe's own greedy partition (``partition_roundpipe``: no search, so every set of waits is
timed on the same plan) is lowered four ways and one sync step of each is replayed:

  none                 no memory-bounding wait (``Plan.memory_waits=()``)
  window+sent          the activation waits only
  window+sent+grad_pair  every plan's lowering (``BOUNDED_WAITS``: two gradient slots)
  window+sent+grad_slot  the tightest (``TIGHTEST_WAITS``: one gradient slot)

and prints the step time, the proven peak of the schedule (rpcompile.passes.memory
.worker_peaks, max over workers) and the simulated one, with the simulated / proven ratio's
range over the workers: how tight the proof is, and what each set costs in time.

    python benchmarks/memory_waits.py [--models ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from _results import RESULTS, write_result  # beside this script

from rpcompile.hardware import get_hardware
from rpcompile.passes.lower import BOUNDED_WAITS, TIGHTEST_WAITS
from rpcompile.passes.memory import worker_peaks
from rpcompile.planner.partition import proof_schedule
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

SETS = ((), ("window", "sent"), BOUNDED_WAITS, TIGHTEST_WAITS)
GIB = 2**30


def measure(name: str, hardware: str = "rtx4090x8") -> dict:
    hw = get_hardware(hardware)
    w = WORKLOADS[name]
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partition_roundpipe(units, hw, hw.gpus, w.microbatches,
                               max(1, round(w.microbatch_size)), w.seq_len, w.rounds)
    out = {"model": name, "stages": len(plan.stages), "sets": []}
    for waits in SETS:
        p = replace(plan, memory_waits=waits)
        sched = proof_schedule(p, w.rounds, "sync", 1)
        proof = [x.peak_bytes for x in worker_peaks(sched, p)]
        sim = simulate(sched, p, hw)
        ratios = [s / q for s, q in zip(sim.peak_device_bytes, proof)]
        out["sets"].append({
            "waits": "+".join(waits) or "none", "step_ms": sim.makespan_ms,
            "proven_gib": max(proof) / GIB, "simulated_gib": max(sim.peak_device_bytes) / GIB,
            "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--json", type=Path, default=RESULTS / "memory_waits.json")
    args = ap.parse_args()
    rows, start = [], time.time()
    for name in args.models:
        row = measure(name)
        rows.append(row)
        free = row["sets"][0]["step_ms"]
        print(f"{name} ({row['stages']} stages), one sync step:")
        for s in row["sets"]:
            print(f"  {s['waits']:24s} {s['step_ms']:10.1f} ms ({s['step_ms'] / free - 1:+.2%})"
                  f"  proven {s['proven_gib']:6.2f} GiB  simulated {s['simulated_gib']:6.2f} GiB"
                  f"  simulated/proven per worker {s['ratio_min']:.3f}-{s['ratio_max']:.3f}",
                  flush=True)
    write_result(args.json, rows)
    bounded = [s for r in rows for s in r["sets"] if s["waits"] == "+".join(BOUNDED_WAITS)]
    cost = max(s["step_ms"] / r["sets"][0]["step_ms"] - 1 for r in rows for s in r["sets"]
               if s["waits"] == "+".join(BOUNDED_WAITS))
    print(f"memory_waits: {len(rows)} workloads, default waits: simulated/proven "
          f"{min(s['ratio_min'] for s in bounded):.3f}-{max(s['ratio_max'] for s in bounded):.3f}"
          f" per worker, at most {cost:+.2%} step time against no wait; "
          f"{time.time() - start:.0f} s; {args.json}")


if __name__ == "__main__":
    main()

"""Simulated steady state of two paper models on 8x RTX 4090, steps overlapping as the
lowered schedule lets them (async updates in the next step, each step closed at its commit
point): a small subset of ``paper_bubbles.py`` that runs in seconds instead of an hour.

For Qwen3-1.7B and Llama-3.1-8B (the RoundPipe paper's layer times, microbatches of 4 x 2048
tokens, 16 per round, links set to the paper's activation hop: ``paper_bubbles.py``), each on
fixed plans: RoundPipe's greedy partition (``partition_roundpipe``), and for Qwen3-1.7B
RoundPipe's own published partition (``rpcompile.workloads.paper.ROUNDPIPE_QWEN3_1_7B``), both
with the memory waits only where their schedule needs them; ``--ours`` adds our partitioner's
async plan (slow: minutes per model). Prints and writes to JSON, per plan:

  async step ms        steady-state time per step (``steady_step_ms`` over ``steady_steps``)
  async bubble %       steady-state idle share (1 - ``steady_utilization``)
  bound                the least long-run async step of this plan, and its bubble
                       (``rpcompile.sim.steady_bound``: the heaviest cycle of the waits every
                       replay keeps, transfers and host work left out); under it, the cycle's
                       span in steps and the stages it runs through, and whether it takes the
                       wait for the step two before (``stale``). A bubble at its bound is the
                       plan's own, not the schedule's (docs/simulator.md, "Why a plan idles
                       when steps overlap")
  sync step ms         one isolated sync step's makespan, and its bubble %
  sync gaps %          the isolated sync step's idle between each worker's first and last
                       compute (its bubble less fill and drain). RoundPipe's artifact reports
                       this figure of one step as its async bubble (4.05 % on its own
                       Qwen3-1.7B partition)
  sync steady ms       sync steps in a stream (each job waits only for the updated shadow of
                       its own stage): steady-state time per step, and its bubble %
  async / sync         one isolated sync step's time over the async steady step's

and, per model, the ceiling: the least long-run time per async step that any RoundPipe plan
of the model's attention and MLP blocks can have
(``rpcompile.planner.partition.async_step_floor``: the larger of one step's compute over the
workers and half the least span of one step's computes, at the best tail start), the tail
length that gives it, and the greedy partition's async step over it: how far any
partitioner could beat the greedy partition on this workload.

Run it from the tree to measure (``PYTHONPATH=<tree> python3 benchmarks/async_barrier.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _results import write_result
from paper_bubbles import MICROBATCH_SIZE, MICROBATCHES, SEQ, WORKERS, paper_hardware

from rpcompile.options import PlanOptions
from rpcompile.planner.partition import async_step_floor, fit_memory_waits, partition
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import (
    simulate_roundpipe,
    steady_bound,
    steady_step_ms,
    steady_steps,
    steady_utilization,
)
from rpcompile.workloads.paper import (
    MODELS,
    ROUNDPIPE_QWEN3_1_7B_BUBBLES,
    roundpipe_qwen3_1_7b_plan,
)

RESULTS = Path(__file__).resolve().parent / "results"


def figures(plan, hw) -> dict[str, float]:
    steady = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
    bound = steady_bound(plan)
    one = simulate_roundpipe(plan, hw, steps=1, optimizer="sync")
    stream = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="sync")
    return {"async_step_ms": steady_step_ms(steady),
            "async_bubble_pct": 100 * (1 - steady_utilization(steady)),
            "bound_step_ms": bound.step_ms, "bound_bubble_pct": 100 * bound.bubble,
            "bound_cycle_steps": bound.cycle_steps, "bound_stale": bound.stale,
            "bound_cycle_stages": [s for _, _, s in bound.cycle],
            "sync_step_ms": one.makespan_ms, "sync_bubble_pct": 100 * one.bubble,
            "sync_gaps_pct": 100 * one.bubble_steady,
            "sync_steady_step_ms": steady_step_ms(stream),
            "sync_steady_bubble_pct": 100 * (1 - steady_utilization(stream)),
            "async_over_sync": one.makespan_ms / steady_step_ms(steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama3.1-8b"],
                    choices=list(MODELS))
    ap.add_argument("--ours", action="store_true",
                    help="also our partitioner's async plan (minutes per model)")
    ap.add_argument("--json", type=Path, default=RESULTS / "async_barrier.json")
    args = ap.parse_args()
    out: dict[str, dict[str, dict[str, float]]] = {}
    ceilings: dict[str, dict[str, float]] = {}
    for name in args.models:
        model = MODELS[name]
        hw = paper_hardware(model)
        units = model.units(MICROBATCH_SIZE, SEQ)
        blocks = model.units(MICROBATCH_SIZE, SEQ, split_layers=True)
        plans = {"roundpipe-greedy": fit_memory_waits(partition_roundpipe(
            units, hw, WORKERS, MICROBATCHES, MICROBATCH_SIZE, SEQ), hw)[0]}
        if name == "qwen3-1.7b":
            plans["roundpipe-own"] = fit_memory_waits(
                roundpipe_qwen3_1_7b_plan(hw, WORKERS, MICROBATCHES), hw)[0]
        if args.ours:
            run = PlanOptions(gpus=WORKERS, microbatches=MICROBATCHES, mode="async")
            plans["ours-async"] = partition(blocks, hw, run, microbatch_size=MICROBATCH_SIZE,
                                            seq_len=SEQ)
        for label, plan in plans.items():
            t0 = time.perf_counter()
            row = figures(plan, hw)
            out.setdefault(name, {})[label] = row
            print(f"{name:14s} {label:18s} async step {row['async_step_ms']:9.1f} ms  "
                  f"async bubble {row['async_bubble_pct']:6.2f} % (bound: "
                  f"{row['bound_bubble_pct']:5.2f} % for this partition, "
                  f"{row['bound_step_ms']:9.1f} ms)  sync step "
                  f"{row['sync_step_ms']:9.1f} ms  sync bubble {row['sync_bubble_pct']:6.2f} %"
                  f" (gaps {row['sync_gaps_pct']:5.2f} %)"
                  f"  sync steady {row['sync_steady_step_ms']:9.1f} ms "
                  f"{row['sync_steady_bubble_pct']:6.2f} %  async / sync "
                  f"{row['async_over_sync']:.3f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            print(f"{'':33s} bound's cycle: {row['bound_cycle_steps']} steps through stages "
                  f"{' '.join(map(str, row['bound_cycle_stages']))}"
                  f"{', stale' if row['bound_stale'] else ''}", flush=True)
        floor = async_step_floor(blocks, hw, WORKERS, MICROBATCHES,
                                 microbatch_size=MICROBATCH_SIZE, seq_len=SEQ)
        greedy = out[name]["roundpipe-greedy"]["async_step_ms"]
        ceilings[name] = {"step_ms": floor.step_ms, "tail_units": floor.tail_units,
                          "greedy_over_ceiling": greedy / floor.step_ms}
        print(f"{name:14s} ceiling: no plan's async step below {floor.step_ms:9.1f} ms (a tail "
              f"of {floor.tail_units} units, set by the {floor.limit}), greedy / ceiling "
              f"{greedy / floor.step_ms:.3f}", flush=True)
    if "qwen3-1.7b" in out:
        print(f"RoundPipe's artifact on its own Qwen3-1.7B partition: sync bubble "
              f"{ROUNDPIPE_QWEN3_1_7B_BUBBLES['sync']:.2f} % (gaps "
              f"{ROUNDPIPE_QWEN3_1_7B_BUBBLES['steady']:.2f} %), reported as async "
              f"{ROUNDPIPE_QWEN3_1_7B_BUBBLES['async']:.2f} %")
    write_result(args.json, {**out, "ceiling": ceilings})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

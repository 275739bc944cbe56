"""What the optimizer's undo journal costs on a paper workload, by the simulator.

The undo journal (``undo_journal=True``, the default) saves what each update changes
(masters, optimizer state, shadows) until the step commits, so that a failed step changes
nothing. This replays one fixed plan of a paper workload (RoundPipe's own greedy partition,
``partition_roundpipe``, at the workload's batch: ``rpcompile.workloads.paper.WORKLOADS``) on
the hardware profile with the journal on and off (``Hardware.undo_journal``) and prints, for
each: one isolated sync step and the async steady-state step (ms and tokens/s), the OPTs'
busy time of that step, and the host memory of the run (``host_memory``: masters, optimizer
state, gradients, shadows, the module's copy, the journal, transfer staging; pinned).

    python benchmarks/undo_journal.py [--model qwen3-1.7b] [--hardware rtx4090x8] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from _results import RESULTS, write_result  # beside this script

from rpcompile.hardware import get_hardware
from rpcompile.passes.memory import host_memory
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.paper import MODELS, WORKLOADS

GIB = 2**30


def opt_busy_ms(run, step: int) -> float:
    return sum(end - start for a, (start, end) in run.timeline.items()
               if a.kind == "OPT" and a.step == step)


def measure(name: str, hardware: str) -> dict:
    w = WORKLOADS[name]
    base = get_hardware(hardware)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partition_roundpipe(units, base, base.gpus, w.microbatches,
                               max(1, round(w.microbatch_size)), w.seq_len, w.rounds)
    out = {"model": name, "hardware": hardware, "stages": len(plan.stages),
           "trainable_params": sum(u.trainable_params for u in units)}
    for journal in (True, False):
        hw = replace(base, undo_journal=journal)
        sync = simulate_roundpipe(plan, hw, steps=1, optimizer="sync", rounds=w.rounds)
        steps = steady_steps(plan, rounds=w.rounds)
        run = simulate_roundpipe(plan, hw, steps=steps, optimizer="async", rounds=w.rounds)
        steady = steady_step_ms(run)
        host_sync = host_memory(plan, "sync", sync.peak_host_bytes, journal=journal)
        host_async = host_memory(plan, "async", run.peak_host_bytes, journal=journal)
        out["on" if journal else "off"] = {
            "sync_step_ms": sync.makespan_ms,
            "sync_tokens_per_s": w.tokens_per_step / sync.makespan_ms * 1e3,
            "sync_opt_busy_ms": opt_busy_ms(sync, 0),
            "async_step_ms": steady,
            "async_tokens_per_s": w.tokens_per_step / steady * 1e3,
            "async_opt_busy_ms": opt_busy_ms(run, steps - 1),
            "host_sync_gib": host_sync.total / GIB,
            "host_async_gib": host_async.total / GIB,
            "journal_gib": host_async.journal / GIB,
            "pinned_gib": host_async.pinned / GIB,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b", choices=sorted(WORKLOADS))
    ap.add_argument("--hardware", default="rtx4090x8")
    ap.add_argument("--json", type=Path, default=RESULTS / "undo_journal.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    r = measure(args.model, args.hardware)
    for key in ("on", "off"):
        f = r[key]
        print(f"journal {key:3}: sync step {f['sync_step_ms']:,.1f} ms "
              f"({f['sync_tokens_per_s']:,.0f} tokens/s), OPT busy {f['sync_opt_busy_ms']:.1f} ms;"
              f" async steady {f['async_step_ms']:,.1f} ms ({f['async_tokens_per_s']:,.0f} "
              f"tokens/s), OPT busy {f['async_opt_busy_ms']:.1f} ms; host {f['host_sync_gib']:.1f}"
              f" GiB sync, {f['host_async_gib']:.1f} GiB async (journal {f['journal_gib']:.1f},"
              f" pinned {f['pinned_gib']:.1f})")
    write_result(args.json, r)
    on, off = r["on"], r["off"]
    print(f"undo_journal: {args.model} on {args.hardware}, off/on sync step "
          f"{off['sync_step_ms'] / on['sync_step_ms']:.4f}, async "
          f"{off['async_step_ms'] / on['async_step_ms']:.4f}, host "
          f"{on['host_async_gib']:.1f} -> {off['host_async_gib']:.1f} GiB "
          f"({time.perf_counter() - t0:.0f} s) -> {args.json}")


if __name__ == "__main__":
    main()

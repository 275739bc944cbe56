"""Device memory, per worker: the planner's proven peak, the simulator's, and what the virtual
workers account, on the tiny models of tests/passes/test_memory_agreement.py.

The planner proves two figures per worker over the runtime's lowered schedule
(rpcompile.passes.memory.worker_peaks): ``peak`` (weights, gradient buffers, held values and
each compute's working set) and ``held`` (the same without working sets, which is what a
virtual worker accounts: it allocates buffers, not a compute's transients). Every plan is
lowered with the memory-bounding waits, and what a download sends home is given back at a
compute the schedule names (Schedule.releases), so a run reaches the proof whatever the
timing of its threads; this prints how close, over several runs
(tests/passes/test_memory_agreement.py holds them to 5 %).

Cases as the test's: each plan as compile() makes it (two gradient slots per worker), and
once more with a capacity at its peak with one slot where that is lower (one slot then);
the workers given the proven peak + 5 %; ``--runs`` trainers, each one stream of steps
(``Trainer.fit``: two steps' jobs in flight on a worker) of ``--steps`` steps, at least the
steps of the runtime's schedule and one more (its repeated steps run again), half of them
with chaos delays on every stream. The simulator replays the runtime's schedule whole, its
steps overlapping.

    python benchmarks/memory_agreement.py [--runs 4] [--steps 3] [--json PATH]

Prints one line per worker and a summary: measured / held and simulated / peak, min and max
over all runs. Host memory too: what the run's transfer staging pool holds after each trainer
(rpcompile.runtime.memory.HostStaging) against the plan's staging figure
(``compiled.host.transfers``, the sum of the schedule's staging slots, proven for every
timing: rpcompile.passes.staging), and the most it lent at once.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests/
from _results import write_result

from rpcompile.options import PlanOptions
from tests.option_groups import grouped
from tests.tiny_models import hf_model, token_batch  # the models the CPU tests use

CASES = [("qwen3", 1, 3), ("qwen3", 2, 3), ("qwen3", 3, 4), ("qwen3", 4, 8), ("llama", 3, 6)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="trainers per case (half with chaos)")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps per trainer (at least the schedule's dispatch period)")
    ap.add_argument("--json", type=Path,
                    default=Path("benchmarks/results/memory_agreement.json"))
    args = ap.parse_args()

    import rpcompile
    from rpcompile.compiler import runtime_schedule
    from rpcompile.passes.lower import TIGHTEST_WAITS
    from rpcompile.passes.memory import worker_peaks
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    def compiled_for(arch, gpus, micro, **options):
        return rpcompile.compile(hf_model(arch, layers=4), gpus=gpus, microbatches=micro,
                                 device="virtual", example_inputs=token_batch(2 * micro),
                                 **grouped(**options))

    def tightest(compiled):
        plan = replace(compiled.plan, memory_waits=TIGHTEST_WAITS)
        return max(p.peak_bytes for p in worker_peaks(runtime_schedule(plan,
                                                                       PlanOptions(gpus=compiled.workers,
                                                                                   microbatches=compiled.microbatches,
                                                                                   rounds=1,
                                                                                   mode="sync")), plan))

    rows = []
    hosts: list[dict] = []
    cases = []
    for arch, gpus, micro in CASES:
        free = compiled_for(arch, gpus, micro)
        cases.append((arch, gpus, micro, free))
        bound = tightest(free)
        if bound < max(p.peak_bytes for p in free.memory):
            cases.append((arch, gpus, micro, compiled_for(arch, gpus, micro,
                                                          capacity_bytes=bound)))
    for arch, gpus, micro, compiled in cases:
        sched = compiled.schedule
        simulated = list(simulate(sched, compiled.plan, compiled.hardware).peak_device_bytes)
        capacity = int(1.05 * max(p.peak_bytes for p in compiled.memory))
        measured: list[list[int]] = [[] for _ in range(gpus)]
        staged: list[int] = []
        lent: list[int] = []
        for run in range(args.runs):
            chaos = run if run % 2 else None
            with Trainer(compiled, train=replace(compiled.options.train, optimizer=sgd,
                                                 device="virtual", chaos=chaos),
                         plan=replace(compiled.options.plan, capacity_bytes=capacity)) as trainer:
                # Every step of the cycle, steps overlapping: later steps put other jobs on a
                # worker, and the repeated steps run again.
                steps = max(args.steps, sched.steps + 1)
                for _ in trainer.fit(token_batch(2 * micro, seed=k) for k in range(steps)):
                    pass
                for w, got in enumerate(trainer.peak_bytes()):
                    measured[w].append(got)
                staged.append(trainer.executor.staging.held_bytes)
                lent.append(trainer.executor.staging.peak_lent_bytes)
        figure = compiled.host.transfers
        hosts.append({"arch": arch, "gpus": gpus, "microbatches": micro,
                      "staging_figure": figure, "staging_held": staged, "staging_lent": lent})
        print(f"{arch} {gpus} GPUs {micro} mb: host staging figure {figure:,} B, the pool "
              f"held {min(staged) / figure:.3f}-{max(staged) / figure:.3f} of it, lent at most "
              f"{max(lent) / figure:.3f} of it at once", flush=True)
        for w, proof in enumerate(compiled.memory):
            row = {"arch": arch, "gpus": gpus, "microbatches": micro, "worker": w,
                   "memory_waits": list(compiled.plan.memory_waits),
                   "peak": proof.peak_bytes, "simulated": simulated[w],
                   "held": proof.held_bytes,
                   "measured_min": min(measured[w]), "measured_max": max(measured[w])}
            rows.append(row)
            print(f"{arch} {gpus} GPUs {micro} mb {'+'.join(compiled.plan.memory_waits)}, "
                  f"worker {w}: peak {proof.peak_bytes:,} B, "
                  f"simulated {simulated[w] / proof.peak_bytes:.3f} of it; held "
                  f"{proof.held_bytes:,} B, measured {min(measured[w]) / proof.held_bytes:.3f}-"
                  f"{max(measured[w]) / proof.held_bytes:.3f} of it", flush=True)
    lo = min(r["measured_min"] / r["held"] for r in rows)
    hi = max(r["measured_max"] / r["held"] for r in rows)
    sim_lo = min(r["simulated"] / r["peak"] for r in rows)
    within = sum(r["measured_min"] >= 0.95 * r["held"] for r in rows)
    write_result(args.json, {"runs": args.runs, "steps": args.steps, "rows": rows, "host": hosts})
    host_lo = min(min(h["staging_held"]) / h["staging_figure"] for h in hosts)
    host_hi = max(max(h["staging_held"]) / h["staging_figure"] for h in hosts)
    print(f"memory_agreement: {len(rows)} workers x {args.runs} runs: measured {lo:.3f}-"
          f"{hi:.3f} of the proven held peak ({within}/{len(rows)} workers within 5 % in "
          f"every run), simulated >= {sim_lo:.3f} of the proven peak; host staging pool "
          f"{host_lo:.3f}-{host_hi:.3f} of its figure; {args.json}")


if __name__ == "__main__":
    main()

"""Async-mode step time on virtual workers, with a sync (``overlap``) trainer of the same
compile beside it for scale, timed in one process, interleaved, and the simulator's steady-state
step of the same two lowered schedules.

A step is timed from ``trainer.step`` called to ``trainer.step`` returned, median over
``--steps`` steps after two warm-up steps; the last column adds the time the trainer still
needs after the last step (``trainer.masters()``: every queued update done), spread over the
timed steps, so that work left running after ``step`` returned is not missed. The simulated
figure is the mean step of the lowered schedule each trainer runs (``Trainer.schedule``: the
sync trainer runs ``compiled.schedule``, the async one the same plan lowered for async
updates; one dealing period of steps meeting at the step barrier, which is a long run's
steady state) on the compile's hardware profile; its ratio, not its milliseconds, compares
with this CPU. Also prints each mode's
host bytes per trainable parameter (``Trainer.memory_report``, measured from the buffers and
optimizer state held), where async mode's second gradient buffer shows.

    python benchmarks/async_updates.py [--hidden 256] [--layers 4] [--seq 128] [--batch 12]
                                       [--gpus 3] [--microbatches 3] [--steps 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _models import qwen3  # benchmarks/_models.py, beside this script
from _setup import adamw, token_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--gpus", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/async_updates.json"))
    args = ap.parse_args()

    import rpcompile
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate

    batches = token_batches(args.steps + 2, args.batch, args.seq)
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers), gpus=args.gpus,
                                 microbatches=args.microbatches, example_inputs=batches[0])
    modes = ("sync", "async")
    trainers = {m: Trainer(compiled, adamw, device="virtual", mode=m, timeout_s=600)
                for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i, ids in enumerate(batches):
        for mode, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.step(ids)
            if i >= 2:  # warm-up
                times[mode].append(time.perf_counter() - t0)
    settle: dict[str, float] = {}
    host: dict[str, dict[str, float]] = {}  # host bytes per trainable parameter, by kind
    for mode, trainer in trainers.items():
        t0 = time.perf_counter()
        trainer.masters()
        settle[mode] = time.perf_counter() - t0
        report = trainer.memory_report()
        host[mode] = {"total": report.bytes_per_trainable_param,
                      **{k: v for k, v in report.breakdown().items() if "frozen" not in k}}
        trainer.close()

    # What each trainer ran: the compile's schedule (sync, the compile's mode) or the one it
    # lowered for the other mode; step k of a run is schedule step k mod its steps.
    assert trainers["sync"].schedule is compiled.schedule, "the sync trainer lowered its own"
    sim = {}
    for mode, trainer in trainers.items():
        run = simulate(trainer.schedule, compiled.plan, compiled.hardware)
        sim[mode] = run.makespan_ms / trainer.schedule.steps
    step_ms = {m: 1e3 * statistics.median(times[m]) for m in modes}
    with_settle = {m: 1e3 * (sum(times[m]) + settle[m]) / len(times[m]) for m in modes}
    result = {
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}",
        "workers": args.gpus, "microbatches": args.microbatches, "steps_timed": args.steps,
        "stages": len(compiled.plan.stages),
        "step_ms_median": step_ms,
        "step_ms_mean_with_settle": with_settle,
        "ratio_async_over_sync": step_ms["async"] / step_ms["sync"],
        "simulated_steady_step_ms": sim, "simulated_hardware": compiled.hardware.name,
        "simulated_ratio": sim["async"] / sim["sync"],
        "host_bytes_per_trainable_param": host,
    }
    for m in modes:
        print(f"{m:6s} step {step_ms[m]:8.1f} ms (median)   {with_settle[m]:8.1f} ms (mean, "
              f"settled)   simulated steady {sim[m]:8.2f} ms ({compiled.hardware.name})")
    for m in modes:
        print(f"{m:6s} host bytes per trainable parameter: {host[m]['total']:.2f} ("
              + ", ".join(f"{k} {v:.2f}" for k, v in host[m].items() if k != "total") + ")")
    print(f"async / sync: measured {result['ratio_async_over_sync']:.3f}, "
          f"simulated {result['simulated_ratio']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

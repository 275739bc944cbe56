"""Sync and async training on virtual workers as streams of steps (``Trainer.fit``: step k+1
runs while step k drains), measured beside the simulator's steady state of the same lowered
schedules.

Each mode's trainer (one compile) trains ``--steps`` steps as one stream; its steady step is
the median spacing of the committed steps' results after the first two (the fill) and before
the last (the drain). The simulated figure is ``steady_step_ms`` of the schedule the trainer
runs (``Trainer.schedule``: the runtime's cycle of steps, replayed whole).

The workers compute with ``--threads`` intra-op threads each (``torch.set_num_threads``, set
first). The plan is the ``cpu`` profile's, the same on every machine. The simulations time it
on this machine:

- ``predicted``: ``hardware.probe("cpu")`` (its cores shared by the workers,
  ``Hardware.shared_cores``; its host bandwidth and optimizer rate) with each compute's time
  calibrated on the machine: the plan's stage programs run once per step
  (``Compiled.reference_step``) in as many threads at once as there are workers, as the
  workers run them, and every unit's time scaled by their CPU time per step over the plan's
  own serial compute time. CPU time, not wall time: it is the work whether or not other
  processes share the cores. One figure from the compute alone, none from the pipelined
  steps. The same programs run serially, on one thread, are printed beside it;
- ``probed``: the same profile with the unit times at the probe's matmul rate and ``mfu``;
- ``unshared``: the calibrated times on the probe with ``shared_cores=0`` (a device per
  worker), the model without the shared cores;
- ``cpu profile``: the table's ``cpu`` profile, as ``compile()`` uses by default.

Also printed: the CPU time the process spends per steady step and the cores that makes
(CPU time over wall time: fewer than the shared cores when other processes use them), the
compute of one steady step summed over its actions (measured from the runtime's timeline and
in the prediction), one isolated ``step()`` per mode (fill and drain
included) and each mode's host bytes per trainable parameter (``Trainer.memory_report``:
async mode's second gradient buffer and second shadow copy show).

    python benchmarks/async_updates.py [--hidden 256] [--layers 4] [--seq 128] [--batch 12]
                                       [--gpus 6] [--microbatches 6] [--steps 12]
                                       [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

from _models import qwen3  # benchmarks/_models.py, beside this script
from _results import write_result
from _setup import adamw, token_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--gpus", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads each worker computes with (torch.set_num_threads)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/async_updates.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    import rpcompile
    from rpcompile.hardware import get_hardware, probe
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate, steady_step_ms

    batches = token_batches(args.steps, args.batch, args.seq)
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers), gpus=args.gpus,
                                 microbatches=args.microbatches, example_inputs=batches[0],
                                 hardware="cpu")
    plan = compiled.plan
    probed = probe("cpu").with_gpus(args.gpus)
    serial_ms, serial_cpu_ms = _compute_ms(compiled, batches[0], threads=1)
    _, threaded_cpu_ms = _compute_ms(compiled, batches[0], threads=args.gpus)
    planned_ms = sum(s.compute_ms for s in plan.stages) * compiled.microbatches * compiled.rounds
    table = get_hardware("cpu")
    scales = {  # unit times on the plan's profile -> on this machine
        "predicted": threaded_cpu_ms / planned_ms,
        "probed": (table.matmul_tflops * table.mfu) / (probed.matmul_tflops * probed.mfu),
    }

    def units_at(scale: float) -> list:
        return [replace(u, forward_ms=u.forward_ms * scale, backward_ms=u.backward_ms * scale)
                for u in plan.units]

    modes = ("sync", "async")
    step_ms: dict[str, float] = {}
    alone_ms: dict[str, float] = {}
    compute_ms: dict[str, dict[str, float]] = {}  # one steady step's compute, summed
    cpu_ms: dict[str, float] = {}  # the process's CPU time per steady step
    cores_used: dict[str, float] = {}  # that over the wall time
    sim: dict[str, dict[str, float]] = {k: {} for k in ("predicted", "probed", "unshared",
                                                         "cpu profile")}
    host: dict[str, dict[str, float]] = {}  # host bytes per trainable parameter, by kind
    for mode in modes:
        with Trainer(compiled, train=replace(compiled.options.train, optimizer=adamw,
                                             device="virtual", timeout_s=600),
                     plan=replace(compiled.options.plan, mode=mode)) as trainer:
            t0 = time.perf_counter()
            trainer.step(batches[0])  # one step alone: its fill and drain
            alone_ms[mode] = 1e3 * (time.perf_counter() - t0)
            stamps, cpu_stamps, results = [], [], []
            for result in trainer.fit(batches):
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
                results.append(result)
            gaps = [b - a for a, b in itertools.pairwise(stamps[2:-1])]
            step_ms[mode] = 1e3 * statistics.median(gaps)
            cpu_ms[mode] = 1e3 * (cpu_stamps[-2] - cpu_stamps[2]) / (len(stamps) - 4)
            cores_used[mode] = (cpu_stamps[-2] - cpu_stamps[2]) / (stamps[-2] - stamps[2])
            report = trainer.memory_report()
            host[mode] = {"total": report.bytes_per_trainable_param,
                          **{k: v for k, v in report.breakdown().items() if "frozen" not in k}}
            schedule = trainer.schedule
        predicted = simulate(schedule, plan, probed, units=units_at(scales["predicted"]))
        sim["predicted"][mode] = steady_step_ms(predicted)
        sim["probed"][mode] = steady_step_ms(
            simulate(schedule, plan, probed, units=units_at(scales["probed"])))
        sim["unshared"][mode] = steady_step_ms(
            simulate(schedule, plan, replace(probed, shared_cores=0),
                     units=units_at(scales["predicted"])))
        sim["cpu profile"][mode] = steady_step_ms(simulate(schedule, plan, compiled.hardware))
        compute_ms[mode] = {
            "measured": statistics.median(_compute_per_step(r.timeline) for r in results[2:-1]),
            "predicted": statistics.median(_compute_per_step(predicted.timeline, step=k)
                                           for k in range(2, schedule.steps)),
        }
    result = {
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}",
        "workers": args.gpus, "microbatches": args.microbatches, "steps_timed": args.steps,
        "stages": len(plan.stages), "intra_op_threads": args.threads,
        "shared_cores": probed.shared_cores,
        "serial_compute_ms": {"measured": serial_ms, "measured_cpu": serial_cpu_ms,
                              "threaded_cpu": threaded_cpu_ms,
                              "plan_on_cpu_profile": planned_ms},
        "steady_step_ms": step_ms, "alone_step_ms": alone_ms,
        "ratio_async_over_sync": step_ms["async"] / step_ms["sync"],
        "simulated_steady_step_ms": sim,
        "predicted_over_measured": {m: sim["predicted"][m] / step_ms[m] for m in modes},
        "simulated_ratio": {k: v["async"] / v["sync"] for k, v in sim.items()},
        "step_compute_ms": compute_ms,
        "step_cpu_ms": cpu_ms,
        "cores_used": cores_used,
        "host_bytes_per_trainable_param": host,
    }
    print(f"{args.gpus} workers, {args.threads} intra-op thread(s) each, on "
          f"{probed.shared_cores} shared core(s); the plan's serial compute "
          f"{planned_ms:.1f} ms on the cpu profile, measured {serial_ms:.1f} ms "
          f"({serial_cpu_ms:.1f} ms CPU); CPU per step with {args.gpus} threads computing at "
          f"once {threaded_cpu_ms:.1f} ms")
    for m in modes:
        print(f"{m:6s} steady step {step_ms[m]:8.1f} ms measured (stream median), "
              f"{sim['predicted'][m]:8.1f} ms predicted (x{result['predicted_over_measured'][m]:.3f})"
              f"   probed {sim['probed'][m]:.1f}, unshared {sim['unshared'][m]:.1f}, "
              f"cpu profile {sim['cpu profile'][m]:.1f}   one step alone {alone_ms[m]:.1f} ms")
    for m in modes:
        print(f"{m:6s} CPU time per steady step {cpu_ms[m]:.1f} ms: {cores_used[m]:.2f} cores "
              f"busy on average")
    for m in modes:
        print(f"{m:6s} compute in one steady step, summed: measured "
              f"{compute_ms[m]['measured']:.1f} ms, predicted {compute_ms[m]['predicted']:.1f} ms")
    for m in modes:
        print(f"{m:6s} host bytes per trainable parameter: {host[m]['total']:.2f} ("
              + ", ".join(f"{k} {v:.2f}" for k, v in host[m].items() if k != "total") + ")")
    print(f"async / sync: measured {result['ratio_async_over_sync']:.3f}, "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["simulated_ratio"].items()))
    write_result(args.json, result)
    print(f"wrote {args.json}")


def _compute_ms(compiled, batch, threads: int, repeats: int = 3) -> tuple[float, float]:
    """(wall, CPU) milliseconds per step of the plan's stage programs, every forward, tail and
    backward compute of one step (``Compiled.reference_step``), run by ``threads`` threads at
    once, one step each; each figure the median of ``repeats`` after one warm-up."""
    compiled.reference_step(batch)
    wall, cpu = [], []
    for _ in range(repeats):
        runs = [threading.Thread(target=compiled.reference_step, args=(batch,))
                for _ in range(threads)]
        t0, c0 = time.perf_counter(), time.process_time()
        for run in runs:
            run.start()
        for run in runs:
            run.join()
        wall.append(1e3 * (time.perf_counter() - t0) / threads)
        cpu.append(1e3 * (time.process_time() - c0) / threads)
    return statistics.median(wall), statistics.median(cpu)


def _compute_per_step(timeline, step: int | None = None) -> float:
    """The summed durations of the compute actions of a timeline (of step ``step`` only)."""
    return sum(e - s for a, (s, e) in timeline.items()
               if a.is_compute and (step is None or a.step == step))


if __name__ == "__main__":
    main()

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

- ``predicted``: ``hardware.probe("cpu")`` (its host bandwidth and optimizer rate) calibrated
  by three measurements (``rpcompile.runtime.calibrate``), none of them of the timed steps:
  each compute's time from the plan's stage programs run once per step
  (``Compiled.reference_step``) in as many threads at once as there are workers, as the
  workers run them, just before each mode's steps, every unit's time scaled by their CPU
  time per step over the plan's own serial compute time (CPU time, not wall time: the work,
  whether or not other processes share the cores); the shared cores, the CPU time over the
  wall time of that same run (the cores the computes kept busy: fewer than the machine's
  when the interpreter lock or other processes hold them back); the virtual workers' copy rates and the runtime's CPU per
  action from ``calibrate_virtual`` on a different, smaller run (``--calibrate-hidden``,
  ``--calibrate-layers``, the same workers and microbatches, ``--calibrate-steps`` steps of
  a sync stream): copies then take a core as they run, and every action its CPU. The same
  programs run serially, on one thread, are printed beside it;
- ``probe cores``: ``predicted`` on the probe's cores instead of the cores the computes
  kept busy;
- ``compute only``: the calibrated compute times on the probe's own cores, copy rates and no
  CPU per action (what the simulator predicts without the copies' and dispatch's CPU);
- ``probed``: the same profile with the unit times at the probe's matmul rate and ``mfu``;
- ``unshared``: the calibrated times on the probe with ``shared_cores=0`` (a device per
  worker), the model without the shared cores;
- ``cpu profile``: the table's ``cpu`` profile, as ``compile()`` uses by default.

Also printed: the calibration's figures (CPU per step of each stream and of the main thread,
the copy rates, the CPU per action), the CPU time the process spends per steady step and the
cores that makes (CPU time over wall time: fewer than the shared cores when other processes
use them) beside the core time the prediction keeps busy per steady step (min(running
actions, shared cores), integrated: the work the model accounts for), the cores other
processes (and the hypervisor's steal) kept busy meanwhile (``/proc/stat``), the compute of one steady step summed over its actions (measured from the
runtime's timeline and in the prediction), one isolated ``step()`` per mode (fill and drain
included) and each mode's host bytes per trainable parameter (``Trainer.memory_report``:
async mode's second gradient buffer and second shadow copy show).

    python benchmarks/async_updates.py [--hidden 256] [--layers 4] [--seq 128] [--batch 12]
                                       [--gpus 6] [--microbatches 6] [--steps 12]
                                       [--threads 1] [--calibrate-hidden 256]
                                       [--calibrate-layers 2] [--calibrate-steps 6]
                                       [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
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
    ap.add_argument("--calibrate-hidden", type=int, default=256,
                    help="width of the model the copy rates and CPU per action are measured "
                         "on (a copy's CPU per byte depends on its size: the allocator)")
    ap.add_argument("--calibrate-layers", type=int, default=2)
    ap.add_argument("--calibrate-steps", type=int, default=6)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/async_updates.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    import rpcompile
    from rpcompile.hardware import get_hardware, probe
    from rpcompile.runtime.calibrate import calibrate_virtual, threaded_compute
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate, steady_step_ms

    def trainer_for(compiled, mode: str) -> Trainer:
        return Trainer(compiled, train=replace(compiled.options.train, optimizer=adamw,
                                               device="virtual", timeout_s=600),
                       plan=replace(compiled.options.plan, mode=mode))

    # The calibration run: another model, smaller, on as many workers.
    small_batches = token_batches(args.calibrate_steps, args.batch, args.seq)
    small = rpcompile.compile(qwen3(args.calibrate_hidden, args.calibrate_layers),
                              gpus=args.gpus, microbatches=args.microbatches,
                              example_inputs=small_batches[0], hardware="cpu")
    with trainer_for(small, "sync") as trainer:
        calibration = calibrate_virtual(trainer, small_batches)

    batches = token_batches(args.steps, args.batch, args.seq)
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers), gpus=args.gpus,
                                 microbatches=args.microbatches, example_inputs=batches[0],
                                 hardware="cpu")
    plan = compiled.plan
    probed = probe("cpu").with_gpus(args.gpus)
    serial = threaded_compute(compiled, batches[0], threads=1)
    planned_ms = sum(s.compute_ms for s in plan.stages) * compiled.microbatches * compiled.rounds
    table = get_hardware("cpu")
    probed_scale = (table.matmul_tflops * table.mfu) / (probed.matmul_tflops * probed.mfu)

    def units_at(scale: float) -> list:
        return [replace(u, forward_ms=u.forward_ms * scale, backward_ms=u.backward_ms * scale)
                for u in plan.units]

    modes = ("sync", "async")
    step_ms: dict[str, float] = {}
    alone_ms: dict[str, float] = {}
    compute_ms: dict[str, dict[str, float]] = {}  # one steady step's compute, summed
    cpu_ms: dict[str, float] = {}  # the process's CPU time per steady step
    cores_used: dict[str, float] = {}  # that over the wall time
    others: dict[str, float] = {}  # the cores other processes kept busy meanwhile
    model_cpu_ms: dict[str, float] = {}  # the cores' time the prediction keeps busy, per step
    sim: dict[str, dict[str, float]] = {k: {} for k in (
        "predicted", "probe cores", "compute only", "probed", "unshared", "cpu profile")}
    host: dict[str, dict[str, float]] = {}  # host bytes per trainable parameter, by kind
    threaded = {}  # the compute calibration, just before each mode's steps
    for mode in modes:
        threaded[mode] = calib = threaded_compute(compiled, batches[0], threads=args.gpus)
        calibrated = replace(calibration.apply(probed),
                             shared_cores=min(probed.shared_cores, calib.cores_busy))
        units = units_at(calib.cpu_ms / planned_ms)  # unit times: cpu profile -> this machine
        with trainer_for(compiled, mode) as trainer:
            t0 = time.perf_counter()
            trainer.step(batches[0])  # one step alone: its fill and drain
            alone_ms[mode] = 1e3 * (time.perf_counter() - t0)
            stamps, cpu_stamps, busy_stamps, results = [], [], [], []
            for result in trainer.fit(batches):
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
                busy_stamps.append(_machine_busy_s())
                results.append(result)
            gaps = [b - a for a, b in itertools.pairwise(stamps[2:-1])]
            step_ms[mode] = 1e3 * statistics.median(gaps)
            cpu_ms[mode] = 1e3 * (cpu_stamps[-2] - cpu_stamps[2]) / (len(stamps) - 4)
            wall = stamps[-2] - stamps[2]
            cores_used[mode] = (cpu_stamps[-2] - cpu_stamps[2]) / wall
            others[mode] = (busy_stamps[-2] - busy_stamps[2]) / wall - cores_used[mode]
            report = trainer.memory_report()
            host[mode] = {"total": report.bytes_per_trainable_param,
                          **{k: v for k, v in report.breakdown().items() if "frozen" not in k}}
            schedule = trainer.schedule
        predicted = simulate(schedule, plan, calibrated, units=units)
        sim["predicted"][mode] = steady_step_ms(predicted)
        sim["probe cores"][mode] = steady_step_ms(simulate(
            schedule, plan, replace(calibrated, shared_cores=probed.shared_cores), units=units))
        sim["compute only"][mode] = steady_step_ms(simulate(schedule, plan, probed, units=units))
        sim["probed"][mode] = steady_step_ms(
            simulate(schedule, plan, probed, units=units_at(probed_scale)))
        sim["unshared"][mode] = steady_step_ms(
            simulate(schedule, plan, replace(probed, shared_cores=0), units=units))
        sim["cpu profile"][mode] = steady_step_ms(simulate(schedule, plan, compiled.hardware))
        compute_ms[mode] = {
            "measured": statistics.median(_compute_per_step(r.timeline) for r in results[2:-1]),
            "predicted": statistics.median(_compute_per_step(predicted.timeline, step=k)
                                           for k in range(2, schedule.steps)),
        }
        model_cpu_ms[mode] = _core_ms_per_step(predicted.timeline, calibrated.shared_cores)
    result = {
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}",
        "workers": args.gpus, "microbatches": args.microbatches, "steps_timed": args.steps,
        "stages": len(plan.stages), "intra_op_threads": args.threads,
        "shared_cores": probed.shared_cores,
        "serial_compute_ms": {"measured": serial.wall_ms, "measured_cpu": serial.cpu_ms,
                              "threaded_cpu": {m: threaded[m].cpu_ms for m in modes},
                              "threaded_wall": {m: threaded[m].wall_ms for m in modes},
                              "plan_on_cpu_profile": planned_ms},
        "calibration": {
            "model": f"qwen3 hidden {args.calibrate_hidden}, {args.calibrate_layers} layers, "
                     f"batch {args.batch}x{args.seq}",
            "steps": calibration.steps, "actions_per_step": calibration.actions,
            "cpu_ms_per_step": calibration.cpu_ms,
            "compute_programs_ms": calibration.compute_programs_ms,
            "compute_beyond_ms": calibration.compute_beyond_ms,
            "action_overhead_us": calibration.action_overhead_us,
            "h2d_gbps": calibration.h2d_gbps, "d2h_gbps": calibration.d2h_gbps,
            "probe_h2d_gbps": probed.h2d_gbps, "probe_d2h_gbps": probed.d2h_gbps,
            "cores_busy": {m: threaded[m].cores_busy for m in modes},
        },
        "steady_step_ms": step_ms, "alone_step_ms": alone_ms,
        "ratio_async_over_sync": step_ms["async"] / step_ms["sync"],
        "simulated_steady_step_ms": sim,
        "predicted_over_measured": {m: sim["predicted"][m] / step_ms[m] for m in modes},
        "simulated_ratio": {k: v["async"] / v["sync"] for k, v in sim.items()},
        "step_compute_ms": compute_ms,
        "step_cpu_ms": cpu_ms,
        "model_cpu_ms": model_cpu_ms,
        "cores_used": cores_used,
        "cores_used_by_other_processes": others,
        "host_bytes_per_trainable_param": host,
    }
    print(f"{args.gpus} workers, {args.threads} intra-op thread(s) each, on "
          f"{probed.shared_cores} shared core(s); the plan's serial compute "
          f"{planned_ms:.1f} ms on the cpu profile, measured {serial.wall_ms:.1f} ms "
          f"({serial.cpu_ms:.1f} ms CPU); with {args.gpus} threads computing at once, "
          "just before each mode's steps: " + ", ".join(
              f"{m} {threaded[m].cpu_ms:.1f} ms of CPU per step in {threaded[m].wall_ms:.1f} ms, "
              f"{threaded[m].cores_busy:.2f} cores busy" for m in modes))
    c = calibration
    print(f"calibration ({result['calibration']['model']}, {c.steps} sync steps): CPU per "
          "step " + ", ".join(f"{k} {v:.1f} ms" for k, v in c.cpu_ms.items())
          + f", the computes run directly {c.compute_programs_ms:.1f} ms (the compute "
          f"streams' beyond them {c.compute_beyond_ms:.1f} ms); CPU per compute "
          f"and host action {c.action_overhead_us:.0f} us; copies {c.h2d_gbps:.2f} GB/s up, "
          f"{c.d2h_gbps:.2f} "
          f"GB/s down per CPU second (the probe's warm copies {probed.h2d_gbps:.2f} / "
          f"{probed.d2h_gbps:.2f})")
    for m in modes:
        print(f"{m:6s} steady step {step_ms[m]:8.1f} ms measured (stream median), "
              f"{sim['predicted'][m]:8.1f} ms predicted (x{result['predicted_over_measured'][m]:.3f})"
              f"   probe cores {sim['probe cores'][m]:.1f}, compute only "
              f"{sim['compute only'][m]:.1f}, probed {sim['probed'][m]:.1f}, "
              f"unshared {sim['unshared'][m]:.1f}, "
              f"cpu profile {sim['cpu profile'][m]:.1f}   one step alone {alone_ms[m]:.1f} ms")
    for m in modes:
        print(f"{m:6s} CPU time per steady step {cpu_ms[m]:.1f} ms (the prediction keeps "
              f"its cores busy {model_cpu_ms[m]:.1f} ms): {cores_used[m]:.2f} cores busy on "
              f"average; other processes {others[m]:.2f} cores meanwhile")
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


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has run or lost (every process, user and system, and
    the hypervisor's steal; Linux's /proc/stat): less the process's own, the cores that
    others kept busy."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _core_ms_per_step(timeline, cores: float) -> float:
    """The core time a shared-core replay keeps busy per steady step: min(actions running,
    ``cores``) integrated from the first compute of step 2 to the first compute of the last
    step (every action running holds a share of the cores: computes, copies, host work)."""
    firsts: dict[int, float] = {}
    for a, (s, _e) in timeline.items():
        if a.is_compute:
            firsts[a.step] = min(s, firsts.get(a.step, s))
    last = max(firsts)
    t0, t1 = firsts[2], firsts[last]
    events = sorted(x for s, e in timeline.values() if e > s
                    for x in ((max(s, t0), 1), (min(e, t1), -1)) if min(e, t1) > max(s, t0))
    busy, running, before = 0.0, 0, t0
    for t, delta in events:
        busy += min(running, cores) * (t - before)
        running, before = running + delta, t
    return busy / (last - 2)


def _compute_per_step(timeline, step: int | None = None) -> float:
    """The summed durations of the compute actions of a timeline (of step ``step`` only)."""
    return sum(e - s for a, (s, e) in timeline.items()
               if a.is_compute and (step is None or a.step == step))


if __name__ == "__main__":
    main()

"""Sync and async training on virtual workers as streams of steps (``Trainer.fit``: step k+1
runs while step k drains), measured beside the simulator's steady state of the same lowered
schedules.

Each mode's trainer (one compile) trains ``--steps`` steps as one stream; its steady step is
the median spacing of the committed steps' results after the first two (the fill) and before
the last (the drain). The simulated figure is ``steady_step_ms`` of the schedule the trainer
runs (``Trainer.schedule``: the runtime's cycle of steps, replayed whole) on the compile's
hardware profile. Also printed: one isolated ``step()`` per mode (fill and drain included),
and each mode's host bytes per trainable parameter (``Trainer.memory_report``: async mode's
second gradient buffer and second shadow copy show).

    python benchmarks/async_updates.py [--hidden 256] [--layers 4] [--seq 128] [--batch 12]
                                       [--gpus 6] [--microbatches 6] [--steps 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
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
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/async_updates.json"))
    args = ap.parse_args()

    import rpcompile
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate, steady_step_ms

    batches = token_batches(args.steps, args.batch, args.seq)
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers), gpus=args.gpus,
                                 microbatches=args.microbatches, example_inputs=batches[0])
    modes = ("sync", "async")
    step_ms: dict[str, float] = {}
    alone_ms: dict[str, float] = {}
    sim: dict[str, float] = {}
    host: dict[str, dict[str, float]] = {}  # host bytes per trainable parameter, by kind
    for mode in modes:
        with Trainer(compiled, train=replace(compiled.options.train, optimizer=adamw,
                                             device="virtual", timeout_s=600),
                     plan=replace(compiled.options.plan, mode=mode)) as trainer:
            t0 = time.perf_counter()
            trainer.step(batches[0])  # one step alone: its fill and drain
            alone_ms[mode] = 1e3 * (time.perf_counter() - t0)
            stamps = [time.perf_counter() for _ in trainer.fit(batches)]
            gaps = [b - a for a, b in itertools.pairwise(stamps[2:-1])]
            step_ms[mode] = 1e3 * statistics.median(gaps)
            report = trainer.memory_report()
            host[mode] = {"total": report.bytes_per_trainable_param,
                          **{k: v for k, v in report.breakdown().items() if "frozen" not in k}}
            sim[mode] = steady_step_ms(simulate(trainer.schedule, compiled.plan,
                                                compiled.hardware))
    result = {
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}",
        "workers": args.gpus, "microbatches": args.microbatches, "steps_timed": args.steps,
        "stages": len(compiled.plan.stages),
        "steady_step_ms": step_ms, "alone_step_ms": alone_ms,
        "ratio_async_over_sync": step_ms["async"] / step_ms["sync"],
        "simulated_steady_step_ms": sim, "simulated_hardware": compiled.hardware.name,
        "simulated_ratio": sim["async"] / sim["sync"],
        "host_bytes_per_trainable_param": host,
    }
    for m in modes:
        print(f"{m:6s} steady step {step_ms[m]:8.1f} ms (median, stream)   one step alone "
              f"{alone_ms[m]:8.1f} ms   simulated steady {sim[m]:8.2f} ms "
              f"({compiled.hardware.name})")
    for m in modes:
        print(f"{m:6s} host bytes per trainable parameter: {host[m]['total']:.2f} ("
              + ", ".join(f"{k} {v:.2f}" for k, v in host[m].items() if k != "total") + ")")
    print(f"async / sync: measured {result['ratio_async_over_sync']:.3f}, "
          f"simulated {result['simulated_ratio']:.3f}")
    write_result(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

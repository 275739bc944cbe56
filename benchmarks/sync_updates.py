"""Sync-mode update order on virtual workers: ``overlap`` (each stage's update runs as soon as
its gradients are home, while later backward jobs compute) against ``deferred`` (every
update after the step's last gradient, the order clipping and loss scaling need), timed in
one process, interleaved, with the simulator's prediction of the same two schedules beside it.

For each order: the median wall time of a step (``trainer.step`` returns once the step's
updates and shadow refreshes are done: they are actions of the step), the host memory the
update journal holds at the end of a step (what a failed step would be put back from: masters,
optimizer state and shadows of every trainable parameter), and the time spent saving it. The
simulated figure is the mean step of the lowered schedule each trainer runs
(``Trainer.schedule``: ``compiled.schedule`` for the compile's order, ``overlap``; the same
plan lowered with deferred updates for the other; one dealing period of steps meeting at the
step barrier) on the compile's hardware profile; its ratio, not its milliseconds, is what
compares with this CPU.

    python benchmarks/sync_updates.py [--hidden 256] [--layers 4] [--seq 128] [--batch 12]
                                      [--gpus 3] [--microbatches 3] [--steps 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from _models import qwen3  # benchmarks/_models.py, beside this script
from _results import RESULTS, write_result


def _journal_bytes(journal) -> int:
    if journal is None:
        return 0
    total = sum(t.nbytes for t in journal.masters.values())
    total += sum(t.nbytes for t in journal.shadows.values())
    for _, saved in journal.state:
        total += sum(v.nbytes for v in (saved or {}).values() if isinstance(v, torch.Tensor))
    return total


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
    ap.add_argument("--json", type=Path, default=RESULTS / "sync_updates.json")
    args = ap.parse_args()

    import rpcompile
    from rpcompile.runtime.trainer import Trainer
    from rpcompile.sim import simulate

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (args.batch, args.seq), generator=gen)
               for _ in range(args.steps + 2)]
    compiled = rpcompile.compile(qwen3(args.hidden, args.layers), gpus=args.gpus,
                                 microbatches=args.microbatches, example_inputs=batches[0])

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    orders = ("deferred", "overlap")
    trainers = {o: Trainer(compiled, train=replace(compiled.options.train, optimizer=adamw,
                                                   device="virtual", timeout_s=600),
                           plan=replace(compiled.options.plan, updates=o))
                for o in orders}
    times: dict[str, list[float]] = {o: [] for o in orders}
    journal: dict[str, list[int]] = {o: [] for o in orders}
    saving: dict[str, list[float]] = {o: [] for o in orders}
    for order, trainer in trainers.items():
        driver = trainer.driver
        commit, save, refresh = driver.commit_step, driver._save, driver.refresh

        def timed_commit(order=order, driver=driver, commit=commit):
            journal[order].append(_journal_bytes(driver._open.journal))
            return commit()

        def timed_save(*a, order=order, save=save, **k):
            t0 = time.perf_counter()
            save(*a, **k)
            saving[order][-1] += time.perf_counter() - t0

        def timed_refresh(stage, order=order, driver=driver, refresh=refresh):
            # Only the saving half of a refresh is the journal's cost: time the clone.
            t0 = time.perf_counter()
            for index in driver.store.stages[stage].layout.slots:
                slot = driver.store.slots[index]
                if slot.trainable:
                    driver.store.shadow_of(slot.name).clone()
            saving[order][-1] += time.perf_counter() - t0
            refresh(stage)

        driver.commit_step, driver._save, driver.refresh = timed_commit, timed_save, timed_refresh
    for i, ids in enumerate(batches):
        for order, trainer in trainers.items():
            saving[order].append(0.0)
            t0 = time.perf_counter()
            trainer.step(ids)
            if i >= 2:  # warm-up
                times[order].append(time.perf_counter() - t0)
    for trainer in trainers.values():
        trainer.close()

    # What each trainer ran: the compile's schedule (its order) or the one it lowered for the
    # other order; step k of a run is schedule step k mod its steps.
    assert trainers["overlap"].schedule is compiled.schedule, "overlap lowered its own"
    sim = {}
    for order, trainer in trainers.items():
        run = simulate(trainer.schedule, compiled.plan, compiled.hardware)
        sim[order] = run.makespan_ms / trainer.schedule.steps
    result = {
        "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}",
        "workers": args.gpus, "microbatches": args.microbatches, "steps_timed": args.steps,
        "stages": len(compiled.plan.stages),
        "step_ms": {o: 1e3 * statistics.median(times[o]) for o in orders},
        "ratio_overlap_over_deferred": statistics.median(times["overlap"])
        / statistics.median(times["deferred"]),
        "journal_bytes_at_commit": {o: max(journal[o]) for o in orders},
        "journal_save_ms": {o: 1e3 * statistics.median(saving[o][2:]) for o in orders},
        "trainable_params": sum(p.numel() for p in compiled.model.parameters()
                                if p.requires_grad),
        "simulated_step_ms": sim, "simulated_hardware": compiled.hardware.name,
        "simulated_ratio": sim["overlap"] / sim["deferred"],
    }
    for o in orders:
        print(f"{o:9s} step {result['step_ms'][o]:8.1f} ms   journal "
              f"{result['journal_bytes_at_commit'][o] / 2**20:7.2f} MiB, saved in "
              f"{result['journal_save_ms'][o]:6.2f} ms   simulated {sim[o]:8.2f} ms "
              f"({compiled.hardware.name})")
    print(f"overlap / deferred: measured {result['ratio_overlap_over_deferred']:.3f}, "
          f"simulated {result['simulated_ratio']:.3f}")
    write_result(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

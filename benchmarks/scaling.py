"""Predicted data-parallel scaling of the paper's five workloads on 1, 2 and 4 rtx4090x8
servers joined by 25 or 100 Gbit/s Ethernet.

Each server keeps the paper's workload (rpcompile.paper.WORKLOADS: its batch, microbatches and
rounds), so N servers train an N times larger global batch. One server's RoundPipe plan is
lowered and replayed for a steady state (11 steps, async optimizer, as paper_throughput.py);
rpcompile.sim.scaling.simulate_nodes then lowers the same plan for N ranks (a REDUCE action
per gradient stage and step on the host's network lane, after the stage's last ACC; the
step's updates wait for them) and replays that schedule on the profile joined by the link:
each REDUCE is a ring all-reduce on the link, 2 (N-1)/N x bytes / bandwidth + 2 (N-1) x
latency, whose gloo copies also draw on host memory (docs/distributed.md). Efficiency = one
server's steady step time over the N-server one (1.0: N times the tokens/s).

``--variants`` picks the runs beside each other (one partition per model serves them all):
``async`` (the default: replicated data parallel, async optimizer), ``sync`` (replicated,
sync optimizer) and ``sharded`` (``shard_optimizer``, which needs the sync optimizer: each
REDUCE timed as gloo's reduce to the gradients' owners, each SHADOW also broadcasting the
updated shadows; compare it with ``sync``).

    python benchmarks/scaling.py [--models ...] [--nodes 1 2 4] [--links eth25 eth100]
                                 [--variants async sync sharded] [--max-simulations N]
                                 [--refine N] [--json PATH]

``--max-simulations N`` and ``--refine N`` cap the partitioner's search (benchmarks/_search.py);
each model's line prints its plan's ``search:`` note (proven, or the gap of a capped search).

The JSON is {model: {variant: {link: {nodes: figures}}}}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _results import RESULTS, write_result  # beside this script
from _search import add_search_caps, capped_partition, search_note

from rpcompile.hardware import get_hardware
from rpcompile.sim import simulate_roundpipe, steady_steps
from rpcompile.sim.scaling import simulate_nodes
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
# variant -> (optimizer, sharded)
VARIANTS = {"async": ("async", False), "sync": ("sync", False), "sharded": ("sync", True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--links", nargs="+", default=["eth25", "eth100"])
    ap.add_argument("--variants", nargs="+", default=["async"], choices=list(VARIANTS))
    add_search_caps(ap)
    ap.add_argument("--json", type=Path, default=RESULTS / "scaling.json",
                    help="where to write {model: {variant: {link: {nodes: figures}}}}")
    args = ap.parse_args()

    t0 = time.perf_counter()
    hw = get_hardware(HARDWARE)
    result: dict[str, dict] = {}
    worst: tuple[float, str] = (2.0, "")
    for name in args.models:
        w = WORKLOADS[name]
        units = MODELS[name].units(w.microbatch_size, w.seq_len)
        plan = capped_partition(args)(units, hw, hw.gpus, w.microbatches,
                                      max(1, round(w.microbatch_size)), w.seq_len, w.rounds)
        steps = steady_steps(plan, rounds=w.rounds)
        print(f"{name}: {w.tokens_per_step:,} tokens per server per step; "
              f"{search_note(plan) or 'search: no note'}", flush=True)
        result[name] = {}
        one_server = {}
        for variant in args.variants:
            optimizer, sharded = VARIANTS[variant]
            if optimizer not in one_server:
                one_server[optimizer] = simulate_roundpipe(plan, hw, steps=steps,
                                                           optimizer=optimizer, rounds=w.rounds)
            row: dict[str, dict] = {}
            for link in args.links:
                row[link] = {}
                for n in args.nodes:
                    s = simulate_nodes(plan, hw, n, link, tokens_per_step=w.tokens_per_step,
                                       optimizer=optimizer, rounds=w.rounds, steps=steps,
                                       one_server=one_server[optimizer], sharded=sharded)
                    row[link][str(n)] = s.to_dict()
                    print(f"  {variant:<7} {link:<7} {n} server{'s' if n > 1 else ' '}: "
                          f"{s.tokens_per_s:>10,.0f} tokens/s, efficiency "
                          f"{100 * s.efficiency:5.1f}%, step {s.step_ms / 1e3:6.2f} s "
                          f"({s.gradient_bytes / 2**30:.1f} GiB reduced in {s.reductions} "
                          f"REDUCE, {s.shadow_bytes / 2**30:.1f} GiB of shadows broadcast, "
                          f"reductions on the link {s.link_busy_ms / 1e3:.2f} s, added "
                          f"{s.added_ms / 1e3:+.2f} s; {time.perf_counter() - t0:.0f} s)",
                          flush=True)
                    if n > 1:
                        worst = min(worst, (s.efficiency, f"{name} {variant} on {n} x {link}"))
            result[name][variant] = row
    write_result(args.json, result)
    best = {link: min(result[m][v][link][str(max(args.nodes))]["efficiency"]
                      for m in args.models for v in args.variants)
            for link in args.links}
    print(f"scaling: {len(args.models)} models on {'/'.join(map(str, args.nodes))} {HARDWARE} "
          f"servers; lowest efficiency at {max(args.nodes)} servers: "
          + ", ".join(f"{link} {100 * v:.1f}%" for link, v in best.items())
          + (f"; worst {worst[1]} {100 * worst[0]:.1f}%" if worst[1] else "")
          + f"; {time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

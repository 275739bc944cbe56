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

    python benchmarks/scaling.py [--models ...] [--nodes 1 2 4] [--links eth25 eth100]
                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rpcompile.hardware import get_hardware
from rpcompile.planner.partition import partition
from rpcompile.sim import simulate_roundpipe, steady_steps
from rpcompile.sim.scaling import simulate_nodes
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--nodes", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--links", nargs="+", default=["eth25", "eth100"])
    ap.add_argument("--json", type=Path, default=RESULTS / "scaling.json",
                    help="where to write {model: {link: {nodes: figures}}}")
    args = ap.parse_args()

    t0 = time.perf_counter()
    hw = get_hardware(HARDWARE)
    result: dict[str, dict] = {}
    worst: tuple[float, str] = (2.0, "")
    for name in args.models:
        w = WORKLOADS[name]
        units = MODELS[name].units(w.microbatch_size, w.seq_len)
        plan = partition(units, hw, hw.gpus, w.microbatches, max(1, round(w.microbatch_size)),
                         w.seq_len, w.rounds)
        steps = steady_steps(plan, rounds=w.rounds)
        run = simulate_roundpipe(plan, hw, steps=steps, optimizer="async", rounds=w.rounds)
        row: dict[str, dict] = {}
        print(f"{name}: {w.tokens_per_step:,} tokens per server per step", flush=True)
        for link in args.links:
            row[link] = {}
            for n in args.nodes:
                s = simulate_nodes(plan, hw, n, link, tokens_per_step=w.tokens_per_step,
                                   optimizer="async", rounds=w.rounds, steps=steps,
                                   one_server=run)
                row[link][str(n)] = s.to_dict()
                print(f"  {link:<7} {n} server{'s' if n > 1 else ' '}: {s.tokens_per_s:>10,.0f} "
                      f"tokens/s, efficiency {100 * s.efficiency:5.1f}%, step "
                      f"{s.step_ms / 1e3:6.2f} s ({s.gradient_bytes / 2**30:.1f} GiB reduced "
                      f"in {s.reductions} REDUCE, link busy {s.link_busy_ms / 1e3:.2f} s, "
                      f"added {s.added_ms / 1e3:+.2f} s; {time.perf_counter() - t0:.0f} s)",
                      flush=True)
                if n > 1:
                    worst = min(worst, (s.efficiency, f"{name} on {n} x {link}"))
        result[name] = row
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    best = {link: min(result[m][link][str(max(args.nodes))]["efficiency"] for m in args.models)
            for link in args.links}
    print(f"scaling: {len(args.models)} models on {'/'.join(map(str, args.nodes))} {HARDWARE} "
          f"servers; lowest efficiency at {max(args.nodes)} servers: "
          + ", ".join(f"{link} {100 * v:.1f}%" for link, v in best.items())
          + (f"; worst {worst[1]} {100 * worst[0]:.1f}%" if worst[1] else "")
          + f"; {time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

"""Predicted training throughput (tokens/s) of the paper's five workloads on 8x RTX 4090.

Workloads (the RoundPipe paper, arXiv 2604.27085, and its artifact, rpcompile.workloads.paper.WORKLOADS): global batches of 512/256/128/128/64
sequences of 2048 tokens, 10 microbatches per round (16 for GPT-OSS), 4/2/1/2/1 rounds; per-layer
times from the paper's table, scaled to the microbatch's tokens. Configurations:

  rpcompile            our partitioner (rpcompile.planner.partition) + RoundPipe dispatch
  roundpipe-partition  RoundPipe's greedy partitioner (planner.partition_baseline), same dispatch
  1f1b, gpipe          8 stages bound to the 8 GPUs, all of a step's microbatches in one flush

RoundPipe runs are lowered in full (weight uploads, activation hops through the host, gradient
downloads, host accumulation, async CPU optimizer) and replayed on the rtx4090x8 profile for
11 steps: two warm-up steps, an 8-step window, one closing step (rpcompile.sim.steady_steps); throughput = tokens per
step / steady-state step time. The weight-bound baselines are
optimistic: no optimizer time at all (weights, gradients and optimizer would live on the GPUs);
a baseline whose weights, bf16 gradients and activations do not fit 24 GB is written as null.
Each RoundPipe line prints the simulated peak and the peak proven over the whole lowered
schedule (rpcompile.passes.memory), against the usable 22.5 GiB (24 GiB less a 1.5 GiB reserve
for the CUDA context and the allocator); a plan over it is marked "over the GPU!".

Also prints the calibration point: RoundPipe on ONE RTX 4090 training Qwen3-1.7B (paper: about
8,900 tokens/s).

``--max-simulations N`` and ``--refine N`` cap the partitioner's search (benchmarks/_search.py);
a capped search that stops before its proof says so, printed with the line.

    python benchmarks/paper_throughput.py [--models ...] [--max-simulations N] [--refine N]
                                          [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from _search import add_search_caps, capped_partition  # benchmarks/_search.py, beside this

from rpcompile.hardware import get_hardware
from rpcompile.passes.memory import host_memory, worker_peaks
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate_pipeline, simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
CONFIGS = ("rpcompile", "roundpipe-partition", "1f1b", "gpipe")
RESULTS = Path(__file__).resolve().parent / "results"
CALIBRATION_TOKENS_PER_S = 8900.0


def roundpipe_tokens_per_s(name: str, partitioner, gpus: int = 8) -> tuple[float, str]:
    """(tokens/s, note) of one workload with a RoundPipe plan from ``partitioner``."""
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE).with_gpus(gpus)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partitioner(units, hw, gpus, w.microbatches, max(1, round(w.microbatch_size)),
                       w.seq_len, w.rounds)
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=w.rounds),
                           optimizer="async", rounds=w.rounds)
    peak = max(r.peak_device_bytes) / 2**30
    proven = max(p.peak_bytes for p in worker_peaks(r.schedule, plan))
    host = host_memory(plan, "async", r.peak_host_bytes)
    search = next((n for n in plan.notes if n.startswith("search: NOT proven")), "")
    note = (f"{plan.num_forward}F+{len(plan.stages) - plan.num_forward}B stages, bubble "
            f"{100 * r.bubble:.1f}%, peak {peak:.1f} GiB simulated, {proven / 2**30:.1f} GiB "
            f"proven (usable {hw.usable_memory_bytes / 2**30:.1f})"
            + (" (over the GPU!)" if proven > hw.usable_memory_bytes else "")
            + f", host {host.total / 2**30:.1f} GiB" + (f"; {search}" if search else ""))
    return w.tokens_per_step / (steady_step_ms(r) / 1e3), note


def pipeline_tokens_per_s(name: str, kind: str) -> tuple[float | None, str]:
    """(tokens/s or None if it does not fit, note) of a weight-bound baseline."""
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    tokens = math.ceil(w.microbatch_size * w.seq_len)
    r = simulate_pipeline(units, hw, kind, workers=hw.gpus,
                          microbatches=w.microbatches * w.rounds, tokens_per_microbatch=tokens)
    peak = max(r.peak_device_bytes) / 2**30
    tps = w.tokens_per_step / (r.makespan_ms / 1e3)
    if max(r.peak_device_bytes) > hw.usable_memory_bytes:
        return None, f"does not fit: {peak:.1f} GiB per GPU (would be {tps:,.0f} tokens/s)"
    return tps, f"bubble {100 * r.bubble:.1f}%, peak {peak:.1f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    add_search_caps(ap)
    ap.add_argument("--json", type=Path, default=RESULTS / "paper_throughput.json",
                    help="where to write {model: {config: tokens_per_s or null}}")
    ap.add_argument("--png", type=str, default=RESULTS / "paper_throughput.png",
                    help="grouped bar chart ('' to skip)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    result: dict[str, dict[str, float | None]] = {}
    for name in args.models:
        row: dict[str, float | None] = {}
        notes = {}
        ours = capped_partition(args)
        row["rpcompile"], notes["rpcompile"] = roundpipe_tokens_per_s(name, ours)
        row["roundpipe-partition"], notes["roundpipe-partition"] = roundpipe_tokens_per_s(
            name, partition_roundpipe)
        for kind in ("1f1b", "gpipe"):
            row[kind], notes[kind] = pipeline_tokens_per_s(name, kind)
        result[name] = {k: None if v is None else round(v, 1) for k, v in row.items()}
        print(name)
        for k in CONFIGS:
            v = row[k]
            print(f"  {k:<20} {'-' if v is None else f'{v:>10,.0f}':>10} tokens/s   {notes[k]}")

    calib, _ = roundpipe_tokens_per_s("qwen3-1.7b", partition_roundpipe, gpus=1)
    print(f"calibration: RoundPipe partition on 1 RTX 4090, Qwen3-1.7B: {calib:,.0f} tokens/s "
          f"(paper: about {CALIBRATION_TOKENS_PER_S:,.0f})")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.png:  # "" skips the chart (Path("") would be ".")
        from rpcompile.viz import bar_chart

        bar_chart(result, Path(args.png), ylabel="tokens/s (predicted)", log=True,
                  title=f"paper workloads on {HARDWARE} (simulated)")
    gains = [result[m]["rpcompile"] / result[m]["roundpipe-partition"] for m in args.models]
    print(f"paper_throughput: rpcompile / roundpipe-partition = "
          f"{min(gains):.3f}..{max(gains):.3f}x over {len(args.models)} models; 1-GPU calibration "
          f"{calib:,.0f} tokens/s vs {CALIBRATION_TOKENS_PER_S:,.0f}; "
          f"{time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

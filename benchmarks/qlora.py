"""QLoRA on 8x RTX 4090: a bf16 frozen base against an NF4 one, for the paper's LoRA shapes.

For Qwen3-235B-A22B (the paper's LoRA workload: r=32 on every decoder linear, its global batch,
microbatches and rounds) and Qwen3-32B with the same adapters (its paper workload's batch and
shapes), each with the frozen base in bf16 and in NF4 (bitsandbytes' format with
double-quantized absmax: rpcompile.workloads.paper.PaperModel, ``base="nf4"``), on the
rtx4090x8 profile, this prints:

  host GiB       the host memory of the searched plan's run (rpcompile.passes.memory.host_memory:
                 masters, optimizer state, gradients, shadows, packed base, module, undo journal,
                 transfer staging of a replay), against the profile's 512 GB server
  tokens/s       the steady async step of the partitioner's plan, replayed by the simulator
  proven GiB     the largest per-GPU peak the memory proof gives for that plan's schedule
  longest        the longest sequence (one sequence per microbatch) whose memory-first plan fits
                 both the GPUs (proven) and the 512 GB server (rpcompile.planner.longest, as
                 ``rpcompile plan --longest``), and what limits it

What the NF4 figures assume: every decoder linear but the router is NF4 (for the MoE model
this quantizes each expert's matrices, which transformers' bitsandbytes loader leaves in bf16
when the experts are fused 3-D parameters); uploads move the packed bytes; each compute holds
the dequantized bf16 weights of its stage. The per-layer times are the bf16 measurements of
the paper's table: the time to dequantize on the GPU is not modelled (a memory-bound pass of
~2.6 bytes per weight per compute). Qwen3-32B's table was measured for full fine-tuning,
whose backward also computes weight gradients, so its LoRA times are pessimistic.

The partition search runs with the caps ``--max-simulations`` / ``--refine`` give (default
here 24 and 4, as a quick run; the plan's search note says when the search stopped before its
proof).

    python benchmarks/qlora.py [--models qwen3-235b-a22b qwen3-32b] [--max-simulations N]
                               [--refine N] [--no-longest] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from _results import RESULTS, write_result  # beside this script
from _search import capped_partition, search_note  # benchmarks/_search.py, beside this

from rpcompile.hardware import get_hardware, host_ram
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import host_memory, worker_peaks
from rpcompile.planner.longest import longest_sequence
from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.paper import MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
LORA_RANK = 32
CHOICES = ("qwen3-235b-a22b", "qwen3-32b")


def variant(name: str, base: str):
    return replace(MODELS[name], lora_rank=LORA_RANK, base=base)


def throughput(name: str, base: str, partitioner, ram: int) -> dict:
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    units = variant(name, base).units(w.microbatch_size, w.seq_len)
    t0 = time.perf_counter()
    plan = partitioner(units, hw, hw.gpus, w.microbatches, max(1, round(w.microbatch_size)),
                       w.seq_len, w.rounds)
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=w.rounds),
                           optimizer="async", rounds=w.rounds)
    proven = max(p.peak_bytes for p in worker_peaks(r.schedule, plan))
    host = host_memory(plan, "async", r.peak_host_bytes)
    return {
        "host_gib": round(host.total / 2**30, 1),
        "host_fits": host.total <= ram,
        "host": host.describe(),
        "tokens_per_s": round(w.tokens_per_step / (steady_step_ms(r) / 1e3)),
        "proven_gib": round(proven / 2**30, 2),
        "usable_gib": round(hw.usable_memory_bytes / 2**30, 2),
        "upload_gib_per_step": round(sum(
            st.upload_bytes for st in plan.stages) * w.rounds / 2**30, 1),
        "stages": f"{plan.num_forward}F+{len(plan.stages) - plan.num_forward}B",
        "search": search_note(plan),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def longest(name: str, base: str, ram: int) -> dict:
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    model = variant(name, base)
    t0 = time.perf_counter()
    found = longest_sequence(lambda s: model.units(1, s), hw, microbatch_size=1,
                             start=2048, step=1024, limit=1 << 18, host_ram_bytes=ram,
                             host_ram_source="the rtx4090x8 profile's 512 GB",
                             options=PlanOptions(gpus=hw.gpus, microbatches=w.microbatches))
    why = found.why if found.next_len is None else f"at {found.next_len:,} tokens: {found.why}"
    return {"longest": found.seq_len, "limit": why,
            "host_gib": None if found.host is None else round(found.host.total / 2**30, 1),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(CHOICES), choices=CHOICES)
    ap.add_argument("--max-simulations", type=int, default=24, metavar="N",
                    help="cap the partitioner's simulator replays per search (default 24)")
    ap.add_argument("--refine", type=int, default=4, metavar="N",
                    help="cap the async boundary refinement's replays (default 4)")
    ap.add_argument("--no-longest", action="store_true",
                    help="skip the longest-sequence searches")
    ap.add_argument("--json", type=Path, default=RESULTS / "qlora.json")
    args = ap.parse_args()
    ram, source = host_ram(None, get_hardware(HARDWARE), option="--host-ram")
    partitioner = capped_partition(args)
    print(f"{HARDWARE}, LoRA r={LORA_RANK}, host RAM {ram / 2**30:.1f} GiB ({source}); search "
          f"caps: {args.max_simulations} replays, refine {args.refine}")
    results: dict = {"hardware": HARDWARE, "host_ram_gib": round(ram / 2**30, 2),
                     "lora_rank": LORA_RANK, "max_simulations": args.max_simulations,
                     "refine": args.refine, "models": {}}
    for name in args.models:
        w = WORKLOADS[name]
        print(f"\n{name}: global batch {w.global_batch} x {w.seq_len} tokens, "
              f"{w.microbatches} microbatches x {w.rounds} rounds")
        for base in ("bf16", "nf4"):
            row = throughput(name, base, partitioner, ram)
            if not args.no_longest:
                row["longest"] = longest(name, base, ram)
            results["models"].setdefault(name, {})[base] = row
            fits = "fits" if row["host_fits"] else "OVER the server's RAM"
            print(f"  {base:5s} host {row['host_gib']:7.1f} GiB ({fits}); "
                  f"{row['tokens_per_s']:>8,} tokens/s; proven peak {row['proven_gib']:.2f} of "
                  f"{row['usable_gib']:.2f} GiB; uploads {row['upload_gib_per_step']:,.1f} "
                  f"GiB/step; {row['stages']} stages ({row['seconds']} s)")
            print(f"        host: {row['host']}")
            if row["search"]:
                print(f"        {row['search']}")
            if "longest" in row:
                found = row["longest"]
                length = "no length" if not found["longest"] else f"{found['longest']:,} tokens"
                print(f"        longest sequence in 512 GB: {length} (host "
                      f"{found['host_gib']} GiB); limit {found['limit']} "
                      f"({found['seconds']} s)")
        bf16, nf4 = (results["models"][name][b] for b in ("bf16", "nf4"))
        print(f"  nf4/bf16: host x{nf4['host_gib'] / bf16['host_gib']:.2f}, tokens/s "
              f"x{nf4['tokens_per_s'] / max(1, bf16['tokens_per_s']):.2f}")
    write_result(args.json, results)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

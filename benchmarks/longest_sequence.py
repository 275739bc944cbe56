"""The longest sequence the memory model proves for each paper model on 8x RTX 4090, and why.

For each of the paper's five workloads (rpcompile.workloads.paper; Qwen3-235B-A22B with LoRA), with
microbatches of ONE sequence and the workload's microbatch count, the sequence length is
searched (doubling from 2,048 tokens, then bisecting to 1,024 tokens) for the longest at which
the partitioner finds a plan whose whole lowered schedule fits the GPUs' usable memory (24 GiB
less the 1.5 GiB reserve; rpcompile.passes.memory). The first length that does not fit gives
the limiting resource: the unit whose working set alone is too large, or the worker, action
and parts at the peak of the best plan. The search is rpcompile.planner.longest, the one
``rpcompile plan --longest`` runs.

Two tails are searched (the paper models' memory model, rpcompile.workloads.paper.PaperModel.units):

  unchunked   the LM head and loss over the whole microbatch at once ([tokens, vocab] logits
              and their gradient), as a model whose head the chunk-loss rewrite does not match
              keeps it (or compile(loss_chunk_tokens=None))
  chunked     logits 4,096 tokens at a time, as RoundPipe computes them and as rpcompile's
              chunk-loss rewrite does for a plain LM head (docs/compiler.md); the cost of the
              rewrite's captured tail is not re-measured here, the paper models' figure is used

Recompute is stage by stage (a backward stage keeps one microbatch's working set of all its
layers); layer-by-layer recompute is not modelled. Host memory (masters, optimizer state,
gradients, shadows, transfer staging: rpcompile.passes.memory.host_memory) is printed for the
workload's own setup (its microbatches of 2,048-token sequences), where the host RAM a server
needs is decided.

    python benchmarks/longest_sequence.py [--models ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rpcompile.hardware import get_hardware
from rpcompile.passes.memory import host_memory
from rpcompile.planner.longest import QUICK_PARTITION, longest_sequence
from rpcompile.planner.partition import partition
from rpcompile.sim import simulate_roundpipe
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
RESULTS = Path(__file__).resolve().parent / "results"
START, STEP, LIMIT = 2048, 1024, 1 << 20


def longest(name: str, chunk: int | None) -> tuple[int, str]:
    """(longest sequence that fits, why the next length does not), microbatches of one
    sequence (rpcompile.planner.longest, as ``rpcompile plan --longest``)."""
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    found = longest_sequence(lambda s: MODELS[name].units(1, s, loss_chunk_tokens=chunk), hw,
                             hw.gpus, w.microbatches, 1, start=START, step=STEP, limit=LIMIT)
    return found.seq_len, (found.why if found.next_len is None else
                           f"at {found.next_len:,} tokens: {found.why}")


def workload_host(name: str) -> str:
    """Host memory of the workload's own setup (its plan, simulated for the staging peak)."""
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partition(units, hw, hw.gpus, w.microbatches, max(1, round(w.microbatch_size)),
                     w.seq_len, w.rounds, **QUICK_PARTITION)
    r = simulate_roundpipe(plan, hw, steps=2, rounds=w.rounds, optimizer="async")
    return host_memory(plan, "async", r.peak_host_bytes).describe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--json", type=Path, default=RESULTS / "longest_sequence.json",
                    help="where to write {model: {tail: {longest, limit}, host: text}}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result: dict[str, dict] = {}
    for name in args.models:
        row: dict = {}
        print(name)
        for tail, chunk in (("unchunked", None), ("chunked", 4096)):
            seq, why = longest(name, chunk)
            row[tail] = {"longest": seq, "limit": why}
            label = "unchunked tail" if chunk is None else "4,096-token chunks"
            print(f"  {label:<20} {seq:>8,} tokens   limit {why}")
        row["host"] = workload_host(name)
        print(f"  host memory of the workload: {row['host']}")
        result[name] = row
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    summary = ", ".join(f"{m} {result[m]['unchunked']['longest']:,}/"
                        f"{result[m]['chunked']['longest']:,}" for m in args.models)
    print(f"longest_sequence: unchunked/chunked tokens on {HARDWARE}: {summary}; "
          f"{time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

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

Each tail is searched twice more, by recompute granularity (rpcompile.passes.cost):

  stage       every backward stage recomputes its whole forward with autograd and keeps one
              microbatch's working set of all its layers (recompute="stage")
  layer       the planner's choice (recompute="auto"): stage recompute where its plan fits,
              else layer by layer (the forward once keeping only the layer boundaries, then
              each layer recomputed and backpropagated alone, at one more forward)

Host memory (masters, optimizer state,
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
from rpcompile.planner.partition import PartitionError, partition
from rpcompile.sim import simulate_roundpipe
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
RESULTS = Path(__file__).resolve().parent / "results"
START, STEP, LIMIT = 2048, 1024, 1 << 20


def longest(name: str, chunk: int | None, recompute: str,
            start: int = START) -> tuple[int, str, list[str]]:
    """(longest sequence that fits, why the next length does not, the backward stages that
    recompute layer by layer there), microbatches of one sequence (rpcompile.planner.longest,
    as ``rpcompile plan --longest``), searched from ``start`` (a length known to fit)."""
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    found = longest_sequence(lambda s: MODELS[name].units(1, s, loss_chunk_tokens=chunk), hw,
                             hw.gpus, w.microbatches, 1, start=start, step=STEP, limit=LIMIT,
                             recompute=recompute)
    layered = [] if found.plan is None else [
        found.plan.stage_name(s.index) for s in found.plan.stages if s.recompute == "layer"]
    return found.seq_len, (found.why if found.next_len is None else
                           f"at {found.next_len:,} tokens: {found.why}"), layered


def longer(name: str, chunk: int | None, stage: dict) -> tuple[int, str, list[str]]:
    """:func:`longest` with ``recompute="auto"``, given the stage-recompute result: the auto
    plan fits at every length the stage plan does, so only the next length is tried, and the
    search goes on from there only when it fits."""
    if not stage["longest"] or stage["longest"] >= LIMIT:
        return longest(name, chunk, "auto")
    w = WORKLOADS[name]
    hw = get_hardware(HARDWARE)
    trial = stage["longest"] + STEP
    try:
        partition(MODELS[name].units(1, trial, loss_chunk_tokens=chunk), hw, hw.gpus,
                  w.microbatches, 1, trial, recompute="auto", **QUICK_PARTITION)
    except PartitionError as exc:
        return stage["longest"], f"at {trial:,} tokens: {exc}", stage["layer_stages"]
    return longest(name, chunk, "auto", start=trial)


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
                    help="where to write {model: {tail: {recompute: {longest, limit, "
                         "layer_stages}}, host: text}}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result: dict[str, dict] = {}
    for name in args.models:
        row: dict = {}
        print(name)
        for tail, chunk in (("unchunked", None), ("chunked", 4096)):
            row[tail] = {}
            for mode, recompute in (("stage", "stage"), ("layer", "auto")):
                if mode == "stage":
                    seq, why, layered = longest(name, chunk, recompute)
                else:  # "auto" fits wherever stage recompute does: search on from there
                    seq, why, layered = longer(name, chunk, row[tail]["stage"])
                row[tail][mode] = {"longest": seq, "limit": why, "layer_stages": layered}
                label = "unchunked tail" if chunk is None else "4,096-token chunks"
                by = ("stage recompute" if mode == "stage" else
                      f"layer where needed ({len(layered)} stages)")
                print(f"  {label:<20} {by:<32} {seq:>8,} tokens   limit {why}", flush=True)
        row["host"] = workload_host(name)
        print(f"  host memory of the workload: {row['host']}")
        result[name] = row
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    summary = ", ".join(
        f"{m} " + "/".join(f"{result[m][t][r]['longest']:,}" for t in ("unchunked", "chunked")
                           for r in ("stage", "layer")) for m in args.models)
    print(f"longest_sequence: tokens (unchunked stage/layer, chunked stage/layer) on "
          f"{HARDWARE}: {summary}; "
          f"{time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

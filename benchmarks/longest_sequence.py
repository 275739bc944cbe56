"""The longest sequence the memory model proves for each paper model on 8x RTX 4090, and why.

For each of the paper's five workloads (rpcompile.workloads.paper; Qwen3-235B-A22B with LoRA), with
microbatches of ONE sequence and the workload's microbatch count per round (``--microbatches N``
sets another: 9 is RoundPipe's default for 8 GPUs, GPUs + 1; 8, one per GPU, the fewest that
give every GPU a microbatch of each job; every microbatch stages its boundary activations on
the host until its backward, so fewer microbatches leave more RAM to the length, at the cost of
a larger bubble: docs/compiler.md), one round, the sequence length
is searched (doubling from 2,048 tokens, then bisecting to 1,024 tokens) for the longest at which
the memory-first plan (every unit its own forward and backward stage, the tail alone, every
memory-bounding wait) has a whole lowered schedule whose proven peak fits the GPUs' usable
memory (24 GiB less the 1.5 GiB reserve; rpcompile.passes.memory). One proof per trial length,
no timing replay: rpcompile.planner.longest, the search ``rpcompile plan --longest`` runs. The
first length that does not fit gives the limiting resource: the unit whose stage alone is too
large, or the worker, action and parts at the peak of the proof. A length must fit the host
RAM too (``--host-ram``, default the profile's ``host_ram_gib``: rtx4090x8 is assumed to be a
512 GB server, 476.84 GiB): the host memory of the memory-first plan's schedule at that length
(static buffers plus the transfer staging of one replay, the figure compile() checks) is
printed, and where it exceeds the RAM the length is bisected down to what fits both, the limit
reads "host RAM: need ...", and the GPUs' own length (with the host memory it would need) is
printed beside it. Where the static host memory alone (masters, optimizer state, gradients,
shadows, the module's copy, the undo journal) exceeds the RAM, no length fits and the line
says so. The memory-first plan stages the most boundary activations on the host (one per
unit); a coarser plan that fits the GPUs stages fewer. Backward stages of one unit
recompute no more than layer-by-layer recompute would, so the recompute granularity does not
change these lengths.

Two tails are searched (the paper models' memory model, rpcompile.workloads.paper.PaperModel.units):

  unchunked   the LM head and loss over the whole microbatch at once ([tokens, vocab] logits
              and their gradient), as a model whose head the chunk-loss rewrite does not match
              keeps it (or compile(loss_chunk_tokens=None))
  chunked     logits 4,096 tokens at a time, as RoundPipe computes them and as rpcompile's
              chunk-loss rewrite does for a plain LM head (docs/compiler.md); the cost of the
              rewrite's captured tail is not re-measured here, the paper models' figure is used

Host memory (masters, optimizer state, gradients, shadows, the user's module's own copy of
its trainable parameters, transfer staging: rpcompile.passes.memory.host_memory) is printed for the workload's own setup (its
microbatches of 2,048-token sequences, its rounds), where the host RAM a server needs is
decided: the static part is the same for every plan; the transfer staging is the peak of a
2-step replay (async unless ``--optimizer sync``) of RoundPipe's greedy partition (rpcompile.planner.partition_baseline),
which needs no search. With ``--microbatches N`` the workload keeps its global batch and rounds,
cut into N microbatches per round (so more sequences per microbatch when N is smaller).

``--optimizer sync`` lowers the schedules for sync updates and counts one fp32 gradient
buffer on the host (async keeps two); ``--no-undo-journal`` counts a run without the
optimizer's undo journal (``PlanOptions.undo_journal=False``): the host memory a user with
a fixed RAM can give back to the length (the GPU lengths do not change).

``--host-memory pageable``: the run's host memory is pageable (PlanOptions.host_memory): the
lengths are memory proofs and do not change; the host bytes' static part does not either, its
pinned part is 0 (printed "pageable, nothing pinned", JSON pinned_gib 0, "host_memory"), and the
transfer staging is that of replays at the profile's pageable bandwidth.

    python benchmarks/longest_sequence.py [--models ...] [--microbatches N] [--host-ram GIB]
                                          [--host-memory pinned|pageable]
                                          [--optimizer async|sync] [--no-undo-journal]
                                          [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from _results import RESULTS, write_result  # beside this script

from rpcompile.hardware import get_hardware
from rpcompile.options import PlanOptions
from rpcompile.passes.memory import host_memory
from rpcompile.planner.longest import longest_sequence
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate_roundpipe
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS, Workload

HARDWARE = "rtx4090x8"
START, STEP, LIMIT = 2048, 1024, 1 << 20
TAILS = (("unchunked", None), ("chunked", 4096))


def _gib(host) -> float | None:
    return None if host is None else round(host.total / 2**30, 2)


def longest(name: str, chunk: int | None, ram: int, memory: str = "pinned",
            optimizer: str = "async", journal: bool = True,
            microbatches: int | None = None) -> dict:
    """{longest, limit, limited_by, peak_gib, host_gib, gpu_longest, gpu_limit, gpu_host_gib,
    microbatches, proofs, replays, seconds} for one model and tail, ``microbatches``
    microbatches (default: the workload's) of one sequence in one round
    (rpcompile.planner.longest, as ``rpcompile plan --longest``), the host memory checked
    against ``ram`` bytes (0: not checked). ``gpu_*``: the GPUs alone (the same as the
    answer unless the RAM binds). ``memory``: the run's host memory, pinned or pageable;
    ``optimizer``: the update mode; ``journal``: whether the run keeps its undo journal."""
    n = workload(name, microbatches).microbatches
    hw = get_hardware(HARDWARE).with_host_memory(memory).with_undo_journal(journal)
    t0 = time.perf_counter()
    found = longest_sequence(lambda s: MODELS[name].units(1, s, loss_chunk_tokens=chunk), hw,
                             microbatch_size=1, start=START, step=STEP, limit=LIMIT,
                             host_ram_bytes=ram, host_ram_source="--host-ram or the profile",
                             options=PlanOptions(gpus=hw.gpus, microbatches=n, mode=optimizer))
    gpu = found.gpu or found

    def limit(f) -> str:
        return f.why if f.next_len is None else f"at {f.next_len:,} tokens: {f.why}"

    return {"longest": found.seq_len, "limit": limit(found), "limited_by": found.limit,
            "peak_gib": None if found.plan is None else
            round(max(found.plan.worker_peak_bytes) / 2**30, 2),
            "host_gib": _gib(found.host),
            "gpu_longest": gpu.seq_len, "gpu_limit": limit(gpu), "gpu_host_gib": _gib(gpu.host),
            "microbatches": n, "proofs": found.proofs, "replays": found.replays,
            "seconds": round(time.perf_counter() - t0, 1)}


def workload(name: str, microbatches: int | None = None) -> Workload:
    """The paper workload of ``name``, cut into ``microbatches`` microbatches per round
    (default: its own count; the global batch and rounds are kept)."""
    w = WORKLOADS[name]
    if microbatches is None or microbatches == w.microbatches:
        return w
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    return replace(w, microbatches=microbatches)


def workload_host(name: str, memory: str = "pinned", optimizer: str = "async",
                  journal: bool = True, microbatches: int | None = None) -> dict:
    """Host memory of the workload's own setup: {total_gib, pinned_gib, microbatches, text},
    from ``memory`` host memory (pinned or pageable), ``optimizer`` updates, with or without
    the undo ``journal``, its global batch cut into ``microbatches`` per round (default: its
    own count)."""
    w = workload(name, microbatches)
    hw = get_hardware(HARDWARE).with_host_memory(memory).with_undo_journal(journal)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partition_roundpipe(units, hw, hw.gpus, w.microbatches, max(1, round(w.microbatch_size)),
                               w.seq_len, w.rounds)
    r = simulate_roundpipe(plan, hw, steps=2, rounds=w.rounds, optimizer=optimizer)
    host = host_memory(plan, optimizer, r.peak_host_bytes, journal=journal,
                       pageable=memory == "pageable")
    return {"total_gib": round(host.total / 2**30, 2), "pinned_gib": round(host.pinned / 2**30, 2),
            "microbatches": w.microbatches, "text": host.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--microbatches", type=int, default=None, metavar="N",
                    help="microbatches per round, of the search (one sequence each) and of "
                         "the workload's host figure (its global batch kept) (default: each "
                         "workload's own, 10 for all but GPT-OSS-20B's 16; RoundPipe's "
                         "default for 8 GPUs is 9)")
    ap.add_argument("--host-ram", type=float, default=None, metavar="GIB",
                    help=f"host RAM the lengths must fit, GiB (default: the {HARDWARE} "
                         "profile's host_ram_gib, an assumed 512 GB server; 0: not checked)")
    ap.add_argument("--host-memory", default="pinned", choices=["pinned", "pageable"],
                    help="the run's host memory: pinned, or pageable (nothing pinned; "
                         "default: pinned)")
    ap.add_argument("--optimizer", default="async", choices=["async", "sync"],
                    help="the update mode the schedules are lowered and the host memory "
                         "counted for (sync keeps one fp32 gradient buffer, async two; "
                         "default: async)")
    ap.add_argument("--no-undo-journal", action="store_true",
                    help="count the host memory of a run without the optimizer's undo "
                         "journal (PlanOptions.undo_journal=False)")
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write {model: {unchunked|chunked: {longest, limit, "
                         "limited_by, peak_gib, host_gib, gpu_longest, gpu_limit, "
                         "gpu_host_gib, microbatches, proofs, replays, seconds}, host: "
                         "{total_gib, pinned_gib, microbatches, text}}, host_ram_gib, "
                         "host_memory, optimizer, undo_journal, microbatches} (default: "
                         "results/longest_sequence.json, with _pageable, _sync, _nojournal, "
                         "_mbN appended for --host-memory pageable, --optimizer sync, "
                         "--no-undo-journal, --microbatches N)")
    args = ap.parse_args()
    if args.microbatches is not None and args.microbatches < 1:
        ap.error(f"--microbatches must be at least 1, got {args.microbatches}")
    if args.json is None:
        args.json = RESULTS / ("longest_sequence"
                               + ("_pageable" if args.host_memory == "pageable" else "")
                               + ("_sync" if args.optimizer == "sync" else "")
                               + ("_nojournal" if args.no_undo_journal else "")
                               + ("" if args.microbatches is None else f"_mb{args.microbatches}")
                               + ".json")
    hw = get_hardware(HARDWARE)
    ram_gib = hw.host_ram_gib if args.host_ram is None else args.host_ram
    ram = int(ram_gib * 2**30)
    print(f"host RAM: {ram_gib:g} GiB" + (" (not checked)" if not ram else
          " (the profile's, an assumed 512 GB server)" if args.host_ram is None else
          " (--host-ram)"), flush=True)
    print(f"transfers: {hw.with_host_memory(args.host_memory).describe_host_memory()}",
          flush=True)
    print("microbatches per round: " + ("each workload's own" if args.microbatches is None
                                        else f"{args.microbatches} (--microbatches)"),
          flush=True)
    t0 = time.perf_counter()
    result: dict = {"host_ram_gib": ram_gib, "host_memory": args.host_memory,
                    "optimizer": args.optimizer, "undo_journal": not args.no_undo_journal,
                    "microbatches": args.microbatches}
    for name in args.models:
        row: dict = {}
        print(f"{name} ({workload(name, args.microbatches).microbatches} microbatches)",
              flush=True)
        for tail, chunk in TAILS:
            row[tail] = got = longest(name, chunk, ram, args.host_memory, args.optimizer,
                                      not args.no_undo_journal, args.microbatches)
            label = "unchunked tail" if chunk is None else "4,096-token chunks"
            peak = "" if got["peak_gib"] is None else f", proven peak {got['peak_gib']:.2f} GiB"
            host = "" if got["host_gib"] is None else f", host {got['host_gib']:,.1f} GiB"
            print(f"  {label:<20} {got['longest']:>9,} tokens{peak}{host} ({got['proofs']} "
                  f"proofs, {got['replays']} host replays, {got['seconds']:.0f} s)   limit "
                  f"({got['limited_by'] or 'none'}) {got['limit']}", flush=True)
            if got["limited_by"] == "host RAM":
                print(f"  {'':<20} the GPUs alone: {got['gpu_longest']:>9,} tokens, host "
                      f"{got['gpu_host_gib']:,.1f} GiB there   limit {got['gpu_limit']}",
                      flush=True)
        row["host"] = workload_host(name, args.host_memory, args.optimizer,
                                    not args.no_undo_journal, args.microbatches)
        print(f"  host memory of the workload: {row['host']['text']}", flush=True)
        result[name] = row
    write_result(args.json, result)

    def fig(m: str, t: str) -> str:
        got = result[m][t]
        gpu = "" if got["gpu_longest"] == got["longest"] else f" (GPUs {got['gpu_longest']:,})"
        return f"{got['longest']:,}{gpu}"

    summary = ", ".join(f"{m} " + "/".join(fig(m, t) for t, _ in TAILS) for m in args.models)
    print(f"longest_sequence: tokens (unchunked/chunked) on {HARDWARE} with {ram_gib:g} GiB "
          f"host RAM: {summary}; {time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

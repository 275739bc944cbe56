"""Bubble ratios of the paper's five models on 8 GPUs with 16 microbatches, per schedule.

Inputs are the per-layer times of the RoundPipe paper, arXiv 2604.27085, and its artifact (one RTX 4090, microbatches of 4 x 2048
tokens). Every schedule runs through the same simulator, lowered the same way:

  gpipe, 1f1b            8 stages bound to 8 GPUs (layers cut by rpcompile.sim.pipeline_stages,
                         the rule that reproduces the paper's simulator), backward with recompute
  interleaved,           v stages (chunks) per GPU, v = ceil(layers / 8) as the paper's
  looped-bfs             artifact interleaves (Megatron interleaved 1F1B; breadth-first loop):
                         4, 4, 3, 8, 12. Its ideal bubble (p - 1) / (v m + p - 1) is printed
                         beside ours. The chunks are dealt by the rule of gpipe/1f1b (the LM
                         head counts as h layers, larger chunks last; the tail alone in the
                         last chunk when its h slots outweigh a chunk). Where v x 8 chunks are
                         more than the layers (Qwen3-1.7B: 32 chunks, 28 layers; 235B: 96, 94)
                         a chunk cannot hold whole layers only, so the layers are cut into
                         their attention and MLP blocks (times shared by FLOPs, as for
                         roundpipe-*) and the blocks are dealt: chunks of one or two blocks,
                         none empty (an empty chunk would idle its worker on a bare hop; the
                         artifact's ideal assumes v x 8 equal chunks, which whole layers
                         cannot give, and blocks come closest). Models with enough layers
                         (8B, GPT-OSS, 32B) are cut between whole layers, as before.
  roundpipe-sync         our partitioner's plan over attention/MLP blocks (each layer's measured
                         times shared by FLOPs, rpcompile.workloads.paper.PaperModel.attention_share),
                         round-robin dispatch, weights uploaded per job,
                         sync optimizer on the host: ONE isolated step (fill, drain and the
                         last optimizer update included)
  roundpipe-async        our partitioner's async plan over the same blocks, async optimizer,
                         steady state: idle share of GPU time between the first compute of
                         step 2 (counting from 0) and that of the last step, an 8-step window
                         of whole dispatch periods (rpcompile.sim.steady_steps: 11 steps,
                         steady_utilization); below it, the host's ordered queue's busy
                         share of the same window (``host_busy``: optimizer updates that the
                         next step's uploads wait for)
  rp-async-layers        (printed only) our partitioner limited to whole layers, async steady state
  rp-partition-*         (printed only) RoundPipe's own greedy partitioner (whole layers)

Also prints RoundPipe's own Qwen3-1.7B partition (rpcompile.workloads.paper.ROUNDPIPE_QWEN3_1_7B) in
our simulator beside the artifact's figures for it (docs/simulator.md).

Hardware: RTX 4090 x 8, except that each model's PCIe links are set so that a D2H plus an H2D
of one activation takes the table's "activation hop" (about 42 GB/s per direction: the paper's
simulator charges 1.6-4 ms per hop) and host memory bandwidth is not a limit (the reference
figures model none). Bubble = idle / (makespan x GPUs).

    python benchmarks/paper_bubbles.py [--models ...] [--schedules ...] [--json PATH] [--png PATH]

The whole table takes about an hour on one core (the partitioner's async search over 188
blocks for Qwen3-235B-A22B is most of it); ``--schedules roundpipe-async`` runs one row.
``--max-simulations N`` and ``--refine N`` cap the partitioner's searches (benchmarks/_search.py);
each of our plans prints its search note (proven, or the gap a capped search left).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from _results import RESULTS, write_result  # beside this script
from _search import add_search_caps, capped_partition, search_note  # beside this script

from rpcompile.hardware import Hardware
from rpcompile.passes.lower import grad_slots
from rpcompile.planner.partition import fit_memory_waits, partition
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import (
    simulate_pipeline,
    simulate_roundpipe,
    steady_steps,
    steady_utilization,
)
from rpcompile.workloads.paper import (
    MODELS,
    PAPER_MODELS,
    ROUNDPIPE_QWEN3_1_7B_BUBBLES,
    PaperModel,
    hop_hardware,
    roundpipe_qwen3_1_7b_plan,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "roundpipe-sync", "roundpipe-async")
EXTRA = ("rp-async-layers", "rp-partition-sync", "rp-partition-async")  # printed only
# the RoundPipe paper, arXiv 2604.27085, and its artifact, the RoundPipe paper's simulator, in PAPER_MODELS order.
REFERENCE = {
    "gpipe": (36.13, 42.08, 41.73, 34.88, 31.18),
    "1f1b": (35.19, 42.08, 41.73, 34.88, 31.21),
}
WORKERS, MICROBATCHES, MICROBATCH_SIZE, SEQ = 8, 16, 4, 2048


def paper_hardware(model: PaperModel) -> Hardware:
    """RTX 4090 x 8 with links that move one activation D2H + H2D in the table's hop time."""
    return hop_hardware(model, MICROBATCH_SIZE * SEQ)


def virtual_stages(model: PaperModel) -> int:
    """Stages (chunks) per GPU of the interleaved baselines: the artifact's ceil(layers / 8)."""
    return math.ceil(model.layers / WORKERS)


def interleaved_units(model: PaperModel):
    """The units the interleaved baselines' chunks are dealt from: whole layers where there
    are at least as many as chunks, else the layers' attention and MLP blocks."""
    blocks = virtual_stages(model) * WORKERS > model.layers
    return model.units(MICROBATCH_SIZE, SEQ, split_layers=blocks), blocks


def ideal_interleaved(model: PaperModel) -> float:
    """The artifact's ideal interleaved bubble (p - 1) / (v m + p - 1) at our v and m, percent."""
    v = virtual_stages(model)
    return 100 * (WORKERS - 1) / (v * MICROBATCHES + WORKERS - 1)


def roundpipe_own_plan() -> dict[str, float]:
    """RoundPipe's own Qwen3-1.7B partition in our simulator: an isolated sync step (bubble,
    fill, drain, steady) and the async steady state, percent."""
    hw = paper_hardware(MODELS["qwen3-1.7b"])
    # Like our plans: two gradient slots per worker, one if only that fits.
    plan = roundpipe_qwen3_1_7b_plan(hw, WORKERS, MICROBATCHES)
    plan = fit_memory_waits(plan, hw)[0]  # proven over the async steady state, step by step
    r = simulate_roundpipe(plan, hw, steps=1, optimizer="sync")
    a = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
    return {"sync": 100 * r.bubble, "fill": 100 * r.bubble_fill, "drain": 100 * r.bubble_drain,
            "steady": 100 * r.bubble_steady, "async": 100 * (1 - steady_utilization(a))}


def _roundpipe(plan, hw) -> tuple[float, float, float]:
    """(sync bubble of one isolated step, async steady-state bubble, the host queue's busy
    share of the async steady state), percent."""
    sync = 100 * simulate_roundpipe(plan, hw, steps=1, optimizer="sync").bubble
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan), optimizer="async")
    return sync, 100 * (1 - steady_utilization(r)), 100 * host_busy(r)


def host_busy(r) -> float:
    """The share of the async steady-state window (the one ``steady_utilization`` reads:
    from the first compute of step 2 to that of the last step) in which the host's ordered
    queue runs (optimizer updates, shadow rewrites, gradient sums): a step's uploads wait
    for the shadows the queue writes after the step two before it commits, so a queue busy
    most of the step holds the next step's forward jobs back."""
    sched, tl = r.schedule, r.timeline
    first: dict[int, float] = {}
    for lst in sched.actions:
        for a in lst:
            if a.is_compute:
                first[a.step] = min(first.get(a.step, math.inf), tl[a][0])
    lo, hi = first[2], first[sched.steps - 1]
    busy = sum(max(0.0, min(tl[a][1], hi) - max(tl[a][0], lo)) for a in sched.host if a in tl)
    return busy / (hi - lo)


def bubbles(name: str, schedules=(*SCHEDULES, *EXTRA), search=partition) -> dict[str, float]:
    """Bubble percent of each of ``schedules`` for one model (``rp-partition-*``: RoundPipe
    dispatch of RoundPipe's own greedy plan, printed for comparison but not in the JSON).
    ``search`` is the partitioner, with any search caps bound."""
    model = MODELS[name]
    units = model.units(MICROBATCH_SIZE, SEQ)
    hw = paper_hardware(model)
    out: dict[str, float] = {}
    v = virtual_stages(model)
    chunked, _ = interleaved_units(model)
    for kind, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", v), ("looped-bfs", v)):
        if kind in schedules:
            r = simulate_pipeline(units if chunks == 1 else chunked, hw, kind, workers=WORKERS,
                                  microbatches=MICROBATCHES, chunks=chunks)
            out[kind] = 100 * r.bubble
    # Each optimizer mode runs the plan made for it (sync: one step's makespan; async: the
    # steady state). A graph compiler may cut between a layer's attention and MLP blocks.
    blocks = model.units(MICROBATCH_SIZE, SEQ, split_layers=True)
    for mode in ("sync", "async"):
        if f"roundpipe-{mode}" in schedules:
            plan = search(blocks, hw, WORKERS, MICROBATCHES, MICROBATCH_SIZE, SEQ,
                          optimizer=mode)
            print(f"{name} roundpipe-{mode}: {search_note(plan) or 'search: no note'}",
                  flush=True)
            figures = _roundpipe(plan, hw)
            out[f"roundpipe-{mode}"] = figures[0 if mode == "sync" else 1]
            out[f"roundpipe-{mode}-waits"] = plan.memory_waits
            if mode == "async":
                out["roundpipe-async-host-busy"] = figures[2]
    if "rp-async-layers" in schedules:
        layers_only = search(units, hw, WORKERS, MICROBATCHES, MICROBATCH_SIZE, SEQ)
        print(f"{name} rp-async-layers: {search_note(layers_only) or 'search: no note'}",
              flush=True)
        out["rp-async-layers"] = _roundpipe(layers_only, hw)[1]
    if "rp-partition-sync" in schedules or "rp-partition-async" in schedules:
        greedy = partition_roundpipe(units, hw, WORKERS, MICROBATCHES, MICROBATCH_SIZE, SEQ)
        greedy = fit_memory_waits(greedy, hw)[0]  # as our plans: waits only where needed
        out["rp-partition-sync"], out["rp-partition-async"], _ = _roundpipe(greedy, hw)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(PAPER_MODELS), choices=PAPER_MODELS)
    ap.add_argument("--schedules", nargs="+", default=[*SCHEDULES, *EXTRA],
                    choices=[*SCHEDULES, *EXTRA], help="rows to run (default: all)")
    ap.add_argument("--json", type=Path, default=RESULTS / "paper_bubbles.json",
                    help="where to write {schedule: {model: bubble_percent}}, plus "
                         "roundpipe-own-plan-qwen3-1.7b: {quantity: percent}")
    ap.add_argument("--png", type=str, default=RESULTS / "paper_bubbles.png",
                    help="grouped bar chart ('' to skip)")
    add_search_caps(ap)
    args = ap.parse_args()

    t0 = time.perf_counter()
    search = capped_partition(args)
    table = {name: bubbles(name, args.schedules, search) for name in args.models}
    rows = [s for s in (*SCHEDULES, *EXTRA) if s in args.schedules]
    result = {s: {m: round(table[m][s], 2) for m in args.models} for s in SCHEDULES
              if s in args.schedules}
    for mode in ("sync", "async"):  # which memory-bounding waits the plan runs with
        if f"roundpipe-{mode}" in args.schedules:
            result[f"roundpipe-{mode}-memory-waits"] = {
                m: list(table[m][f"roundpipe-{mode}-waits"]) for m in args.models}
    if "roundpipe-async" in args.schedules:
        result["roundpipe-async-host-busy"] = {
            m: round(table[m]["roundpipe-async-host-busy"], 1) for m in args.models}

    if "interleaved" in args.schedules or "looped-bfs" in args.schedules:
        result["virtual-stages-per-gpu"] = {m: virtual_stages(MODELS[m]) for m in args.models}
        result["artifact-ideal-interleaved"] = {m: round(ideal_interleaved(MODELS[m]), 2)
                                                for m in args.models}
    last_chunked = next((s for s in reversed(rows) if s in ("interleaved", "looped-bfs")), None)
    width = max(len(m) for m in args.models)
    print(f"{'schedule':<18}" + "".join(f"{m:>{width + 2}}" for m in args.models))
    for s in rows:
        row = [table[m][s] for m in args.models]
        print(f"{s:<18}" + "".join(f"{v:>{width + 1}.2f}%" for v in row))
        if s in ("roundpipe-sync", "roundpipe-async"):
            # The plans' memory waits, by their gradient slots per worker (the activation
            # waits come with either): the column fits the table.
            print(f"{'  gradient slots':<18}" + "".join(
                f"{grad_slots(table[m][s + '-waits']) or 'no wait':>{width + 2}}"
                for m in args.models))
        if s == "roundpipe-async":
            print(f"{'  host busy':<18}" + "".join(
                f"{table[m]['roundpipe-async-host-busy']:>{width + 1}.1f}%"
                for m in args.models))
        if s in REFERENCE:
            ref = [REFERENCE[s][PAPER_MODELS.index(m)] for m in args.models]
            print(f"{'  paper':<18}" + "".join(f"{v:>{width + 1}.2f}%" for v in ref))
        if s in ("interleaved", "looped-bfs") and s == last_chunked:
            print(f"{'  v per GPU':<18}" + "".join(
                f"{virtual_stages(MODELS[m]):>{width + 2}}" for m in args.models))
            print(f"{'  chunks of':<18}" + "".join(
                f"{'blocks' if interleaved_units(MODELS[m])[1] else 'layers':>{width + 2}}"
                for m in args.models))
            print(f"{'  artifact ideal':<18}" + "".join(
                f"{ideal_interleaved(MODELS[m]):>{width + 1}.2f}%" for m in args.models))
    own = roundpipe_own_plan()
    print("RoundPipe's own Qwen3-1.7B partition (8 GPUs, 16 microbatches), bubble %:")
    print("  " + "".join(f"{k:>10}" for k in own))
    print("  " + "".join(f"{v:>10.2f}" for v in own.values()) + "   ours")
    print("  " + "".join(f"{ROUNDPIPE_QWEN3_1_7B_BUBBLES[k]:>10.2f}" for k in own)
          + "   the artifact")
    worst = max((abs(result[s][m] - REFERENCE[s][PAPER_MODELS.index(m)])
                 for s in REFERENCE if s in result for m in args.models), default=0.0)

    result["roundpipe-own-plan-qwen3-1.7b"] = {k: round(v, 2) for k, v in own.items()}
    write_result(args.json, result)
    if args.png and all(s in result for s in SCHEDULES):  # "": no chart; only for all rows
        from rpcompile.viz import bar_chart

        bar_chart({m: {s: result[s][m] for s in SCHEDULES} for m in args.models}, Path(args.png),
                  ylabel="bubble (% of GPU time)",
                  title=f"{WORKERS} GPUs, {MICROBATCHES} microbatches of "
                        f"{MICROBATCH_SIZE}x{SEQ}")
    parts = []
    if any(s in result for s in REFERENCE):
        parts.append(f"gpipe/1f1b within {worst:.2f} points of the paper")
    if "roundpipe-async" in result:
        parts.append(f"roundpipe-async max {max(result['roundpipe-async'].values()):.2f}%")
    if "roundpipe-sync" in result and "looped-bfs" in result:
        sync_vs_bfs = max(result["roundpipe-sync"][m] - result["looped-bfs"][m]
                          for m in args.models)
        parts.append(f"roundpipe-sync minus looped-bfs at most {sync_vs_bfs:+.2f} points")
    print(f"paper_bubbles: {'; '.join(parts)}; {time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

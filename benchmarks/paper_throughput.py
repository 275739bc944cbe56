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

Each RoundPipe line also prints the plan's host memory (rpcompile.passes.memory.host_memory,
async: masters, optimizer state, gradient buffers, shadows, the undo journal and the replay's
transfer staging) against the server's RAM: ``--host-ram-gib``, else the profile's
``host_ram_gib`` (rtx4090x8: an assumed 512 GB server, 476.8 GiB; the output says which).
A plan that needs more is marked "over the host RAM!" (rpcompile.passes.memory.host_ram_problem,
the check compile() and ``rpcompile plan`` make), and the JSON lists it under "over-host-ram".
The weight-bound baselines keep their weights on the GPUs and have no host figure.

Each RoundPipe line also gives three async / sync throughput ratios of the same plan (the
async plan the line runs), beside the ratio RoundPipe measured on real 4090s (1.16 / 1.29 /
1.44 / 1.32 / 1.14):

  async/sync stream    over its sync mode as rpcompile runs it: steps in a stream, each job
                       waiting for the updated shadow of its stage
  async/sync isolated  over one isolated sync step in rpcompile's update order (each stage
                       updated as its gradients are home, while later backward jobs
                       compute; as ``async_barrier.py``'s ``sync_step_ms``)
  async/sync deferred  over one isolated sync step whose updates all follow the step's last
                       gradient (``Plan.updates="deferred"``). That is RoundPipe's sync mode:
                       its ``step(is_async=False)`` runs the optimizer over every parameter
                       once the last gradient is home, and returns when the updated weights
                       are copied back. The like-for-like figure to its measured ratio, but
                       for its sync runs' retuned accumulation counts, which the paper does
                       not give

and each workload's rpcompile / roundpipe-partition ratio (both async, the same overlapping
schedule), and the floor: a lower bound on the long-run async step of every plan of the
workload's units (``rpcompile.planner.partition.async_step_floor``), with the greedy
partition's step over it, the most any partition could gain over the greedy one.

Also prints the calibration point: RoundPipe on ONE RTX 4090 training Qwen3-1.7B (paper: about
8,900 tokens/s).

``--max-simulations N`` and ``--refine N`` cap the partitioner's search, and
``--max-tail-layers N`` widens its fused tails (benchmarks/_search.py); a capped search that
stops before its proof says so, printed with the line.

``--host-memory pageable`` plans and replays every configuration as a run from pageable host
memory (PlanOptions.host_memory="pageable", RoundPipe's pin_model="off"): every host<->GPU
transfer at the profile's pageable bandwidth (rtx4090x8: an assumed 12.5 GB/s per direction,
half the pinned 25), the partitioner searching on the same figures. The output and the JSON
("host-memory", "link-gbps") say which it assumed; the host bytes are the same either way.

    python benchmarks/paper_throughput.py [--models ...] [--max-simulations N] [--refine N]
                                          [--max-tail-layers N] [--host-ram-gib G]
                                          [--host-memory pinned|pageable]
                                          [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

from _results import RESULTS, write_result  # beside this script
from _search import add_search_caps, capped_partition  # benchmarks/_search.py, beside this

from rpcompile.hardware import get_hardware, host_ram
from rpcompile.passes.memory import host_memory, host_ram_problem, worker_peaks
from rpcompile.planner.partition import async_step_floor
from rpcompile.planner.partition_baseline import partition_roundpipe
from rpcompile.sim import simulate_pipeline, simulate_roundpipe, steady_step_ms, steady_steps
from rpcompile.workloads.paper import MODELS, PAPER_MODELS, WORKLOADS

HARDWARE = "rtx4090x8"
CONFIGS = ("rpcompile", "roundpipe-partition", "1f1b", "gpipe")
CALIBRATION_TOKENS_PER_S = 8900.0
# RoundPipe's measured async / sync throughput on 8x RTX 4090 (the paper), per workload.
ROUNDPIPE_ASYNC_OVER_SYNC = dict(zip(PAPER_MODELS, (1.16, 1.29, 1.44, 1.32, 1.14)))


def server_ram(gib: float | None) -> tuple[int, str]:
    """(bytes, source) of the server's RAM: ``gib`` (--host-ram-gib), else the profile's
    host_ram_gib (rpcompile.hardware.host_ram), never this machine's RAM (the figures are
    for a remote server)."""
    hw = get_hardware(HARDWARE)
    if gib is None and not hw.host_ram_gib:
        raise SystemExit(f"the {HARDWARE} profile states no host_ram_gib: give --host-ram-gib")
    return host_ram(None if gib is None else int(gib * 2**30), hw, option="--host-ram-gib")


def profile(memory: str = "pinned"):
    """The rtx4090x8 profile as a run from ``memory`` host memory (pinned or pageable) times
    it."""
    return get_hardware(HARDWARE).with_host_memory(memory)


def roundpipe_tokens_per_s(name: str, partitioner, gpus: int = 8,
                           ram: tuple[int, str] = (0, ""), memory: str = "pinned",
                           ) -> tuple[float, str, object, dict[str, float]]:
    """(tokens/s, note, host memory, the same plan's sync tokens/s: {"stream": its steps in a
    stream, "isolated": one isolated step, "deferred": one isolated step with every update
    after the last gradient}) of one workload with a RoundPipe plan from
    ``partitioner``; ``ram``: the server's (bytes, source), 0 for no check; ``memory``: the
    run's host memory (the partitioner and the replay time transfers at its bandwidth)."""
    w = WORKLOADS[name]
    hw = profile(memory).with_gpus(gpus)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    plan = partitioner(units, hw, gpus, w.microbatches, max(1, round(w.microbatch_size)),
                       w.seq_len, w.rounds)
    r = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=w.rounds),
                           optimizer="async", rounds=w.rounds)
    peak = max(r.peak_device_bytes) / 2**30
    proven = max(p.peak_bytes for p in worker_peaks(r.schedule, plan))
    host = host_memory(plan, "async", r.peak_host_bytes,
                       pageable=hw.host_memory == "pageable")
    search = next((n for n in plan.notes if n.startswith("search: NOT proven")), "")
    over_host = host_ram_problem(host, *ram, ram_option="--host-ram-gib") is not None
    note = (f"{plan.num_forward}F+{len(plan.stages) - plan.num_forward}B stages, bubble "
            f"{100 * r.bubble:.1f}%, peak {peak:.1f} GiB simulated, {proven / 2**30:.1f} GiB "
            f"proven (usable {hw.usable_memory_bytes / 2**30:.1f})"
            + (" (over the GPU!)" if proven > hw.usable_memory_bytes else "")
            + f", host {host.total / 2**30:.1f} GiB"
            + (f" (over the host RAM, {ram[0] / 2**30:.1f} GiB!)" if over_host else "")
            + (f"; {search}" if search else ""))
    stream = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=w.rounds),
                                optimizer="sync", rounds=w.rounds)
    isolated = simulate_roundpipe(plan, hw, steps=1, optimizer="sync", rounds=w.rounds)
    deferred = simulate_roundpipe(dataclasses.replace(plan, updates="deferred"), hw, steps=1,
                                  optimizer="sync", rounds=w.rounds)
    sync = {"stream": w.tokens_per_step / (steady_step_ms(stream) / 1e3),
            "isolated": w.tokens_per_step / (isolated.makespan_ms / 1e3),
            "deferred": w.tokens_per_step / (deferred.makespan_ms / 1e3)}
    return w.tokens_per_step / (steady_step_ms(r) / 1e3), note, host, sync


def floor_of(name: str, memory: str = "pinned") -> tuple[float, object]:
    """(tokens/s at the floor, the floor) of one workload: no RoundPipe plan of its units
    runs faster in the async steady state."""
    w = WORKLOADS[name]
    hw = profile(memory)
    units = MODELS[name].units(w.microbatch_size, w.seq_len)
    floor = async_step_floor(units, hw, hw.gpus, w.microbatches, rounds=w.rounds,
                             microbatch_size=max(1, round(w.microbatch_size)),
                             seq_len=w.seq_len)
    return w.tokens_per_step / (floor.step_ms / 1e3), floor


def pipeline_tokens_per_s(name: str, kind: str,
                          memory: str = "pinned") -> tuple[float | None, str]:
    """(tokens/s or None if it does not fit, note) of a weight-bound baseline (its
    activations hop through host memory of the kind ``memory`` says)."""
    w = WORKLOADS[name]
    hw = profile(memory)
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
    ap.add_argument("--host-ram-gib", type=float, default=None,
                    help="the server's RAM, GiB (default: the profile's host_ram_gib, an "
                         "assumed 512 GB = 476.8 GiB)")
    ap.add_argument("--host-memory", default="pinned", choices=["pinned", "pageable"],
                    help="the runs' host memory: pinned, or pageable (every transfer at the "
                         "profile's pageable bandwidth; default: pinned)")
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write {model: {config: tokens_per_s or null}}, plus "
                         "ratios, floor: {model: {step_ms, tail_units, limit, config: "
                         "step over the floor's}}, host-gib: {model: {config: GiB}}, "
                         "host-ram-gib, host-ram-source and over-host-ram: {model: "
                         "[config, ...]}, host-memory, link-gbps (default: "
                         "results/paper_throughput.json, with --host-memory pageable "
                         "results/paper_throughput_pageable.json)")
    ap.add_argument("--png", type=str, default=None,
                    help="grouped bar chart ('' to skip; default: beside the JSON, .png)")
    args = ap.parse_args()
    stem = "paper_throughput" + ("_pageable" if args.host_memory == "pageable" else "")
    if args.json is None:
        args.json = RESULTS / f"{stem}.json"
    if args.png is None:
        args.png = RESULTS / f"{stem}.png"

    t0 = time.perf_counter()
    ram = server_ram(args.host_ram_gib)
    print(f"host RAM of the server: {ram[0] / 2**30:.1f} GiB ({ram[1]})")
    hw = profile(args.host_memory)
    print(f"transfers: {hw.describe_host_memory('--host-memory pageable')}")
    result: dict[str, dict[str, float | None]] = {}
    host_gib: dict[str, dict[str, float]] = {}
    over: dict[str, list[str]] = {}
    ratios: dict[str, dict[str, float]] = {}
    floors: dict[str, dict[str, float | int | str]] = {}
    for name in args.models:
        row: dict[str, float | None] = {}
        notes = {}
        hosts = {}
        sync = {}
        ours = capped_partition(args)
        for k, partitioner in (("rpcompile", ours), ("roundpipe-partition", partition_roundpipe)):
            row[k], notes[k], hosts[k], sync[k] = roundpipe_tokens_per_s(
                name, partitioner, ram=ram, memory=args.host_memory)
        for kind in ("1f1b", "gpipe"):
            row[kind], notes[kind] = pipeline_tokens_per_s(name, kind, args.host_memory)
        result[name] = {k: None if v is None else round(v, 1) for k, v in row.items()}
        host_gib[name] = {k: round(h.total / 2**30, 1) for k, h in hosts.items()}
        problems = {k: host_ram_problem(h, *ram, ram_option="--host-ram-gib", parts=False)
                    for k, h in hosts.items()}
        over[name] = [k for k, p in problems.items() if p is not None]
        print(name)
        for k in CONFIGS:
            v = row[k]
            print(f"  {k:<20} {'-' if v is None else f'{v:>10,.0f}':>10} tokens/s   {notes[k]}")
        for k in over[name]:
            print(f"  {k}: {problems[k]}")
        ratios[name] = {f"{k} async/sync {how}": round(row[k] / sync[k][how], 3)
                        for k in sync for how in ("stream", "isolated", "deferred")}
        ratios[name]["rpcompile/roundpipe-partition"] = round(
            row["rpcompile"] / row["roundpipe-partition"], 3)
        for k in sync:
            print(f"  {k}: async/sync stream {ratios[name][f'{k} async/sync stream']:.3f}, "
                  f"isolated {ratios[name][f'{k} async/sync isolated']:.3f}, deferred "
                  f"{ratios[name][f'{k} async/sync deferred']:.3f} (RoundPipe measured "
                  f"{ROUNDPIPE_ASYNC_OVER_SYNC[name]:.2f}: compare with deferred, its sync mode)")
        at_floor, floor = floor_of(name, args.host_memory)
        floors[name] = {"step_ms": round(floor.step_ms, 1), "tail_units": floor.tail_units,
                        "limit": floor.limit,
                        "roundpipe-partition": round(at_floor / row["roundpipe-partition"], 3),
                        "rpcompile": round(at_floor / row["rpcompile"], 3)}
        print(f"  rpcompile/roundpipe-partition "
              f"{ratios[name]['rpcompile/roundpipe-partition']:.3f}; floor "
              f"{floor.step_ms:,.1f} ms per step (a tail of {floor.tail_units} units, set by "
              f"the {floor.limit}): no partition beats roundpipe-partition by more than "
              f"{floors[name]['roundpipe-partition']:.3f}x (rpcompile at "
              f"{floors[name]['rpcompile']:.3f}x the floor's step)", flush=True)

    calib = roundpipe_tokens_per_s("qwen3-1.7b", partition_roundpipe, gpus=1,
                                   memory=args.host_memory)[0]
    print(f"calibration: RoundPipe partition on 1 RTX 4090, Qwen3-1.7B: {calib:,.0f} tokens/s "
          f"(paper: about {CALIBRATION_TOKENS_PER_S:,.0f})")

    write_result(args.json, {
        **result, "ratios": ratios, "floor": floors,
        "roundpipe-measured-async-over-sync": {m: ROUNDPIPE_ASYNC_OVER_SYNC[m]
                                               for m in args.models},
        "host-gib": host_gib, "host-ram-gib": round(ram[0] / 2**30, 1),
        "host-ram-source": ram[1], "over-host-ram": over, "host-memory": hw.host_memory,
        "link-gbps": {"h2d": hw.link_h2d_gbps, "d2h": hw.link_d2h_gbps}})
    if args.png:  # "" skips the chart (Path("") would be ".")
        from rpcompile.viz import bar_chart

        bar_chart(result, Path(args.png), ylabel="tokens/s (predicted)", log=True,
                  title=f"paper workloads on {HARDWARE}"
                        + (", pageable host memory" if hw.host_memory == "pageable" else "")
                        + " (simulated)")
    gains = [result[m]["rpcompile"] / result[m]["roundpipe-partition"] for m in args.models]
    print(f"paper_throughput: rpcompile / roundpipe-partition = "
          f"{min(gains):.3f}..{max(gains):.3f}x over {len(args.models)} models; 1-GPU calibration "
          f"{calib:,.0f} tokens/s vs {CALIBRATION_TOKENS_PER_S:,.0f}; {hw.host_memory} host "
          f"memory; over the host RAM: "
          f"{', '.join(f'{m} {k}' for m, ks in over.items() for k in ks) or 'none'}; "
          f"{time.perf_counter() - t0:.1f}s -> {args.json}")


if __name__ == "__main__":
    main()

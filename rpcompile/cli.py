"""Command line: ``rpcompile plan | train | models | hardware``.

``rpcompile train`` fine-tunes a checkpoint folder on a data file: see rpcompile.finetune.

``rpcompile plan`` builds a shipped model from its config on the ``meta`` device (no weights are
allocated), compiles it for a hardware profile, replays the compile's own lowered schedule
(``Compiled.schedule``, the one the runtime runs, its steps overlapping), prints the stage
table, predicted tokens/s and the bubble split of one isolated step (the plan lowered for one
step) and the steady state of overlapping steps, peak device memory
(simulated and proven over the schedule, and whether the schedule needs the memory-bounding
waits), how the partition search ended (the simulator's fastest of all candidates, proven
by lower bounds, or the most a candidate it did not replay could be faster), the LM head's
loss chunk, host memory by part against the server's RAM
(``--host-ram``), how backward stages recompute (``--recompute``: ``auto``, the default,
recomputes whole stages unless that plan does not fit, then takes the faster plan that fits,
cut again by stage or layer by layer) and the longest sequence that fits, and writes the
schedule as CSV,
Chrome-trace JSON and PNG. ``--longest`` searches the longest sequence that fits with one
sequence per microbatch (or the microbatch ``--batch`` gives), one memory proof per trial
length of the memory-first plan (every unit its own stage; rpcompile.planner.longest), then
a replay for its host memory against the RAM (``--host-ram``, else the profile's, else this
machine's), prints it with what limits the next length (the unit or the worker, action and
memory parts at the peak, or the host RAM needed), the host memory at that length, the
GPUs' own length where the RAM binds, and that plan with its proven peak. Without ``--batch`` it picks the batch by the rule
of :func:`default_batch` (the sequences per microbatch double while the simulated tokens/s
rises more than 5%) and prints the trials; a plan that leaves workers idle, or whose fill and
drain dominate the step, says so, and one whose workers idle more than 30% of the step in its
steady part names the slowest stage that paces it and the bound it puts on a round. ``--host-memory pageable`` plans a run from pageable host memory (nothing pinned, every
transfer timed at the profile's pageable bandwidth) and the summary says which it assumes.
``--optimizer`` defaults to sync, as ``train`` and
``compile()`` do; ``--max-simulations`` caps the partitioner's search. For
RoundPipe with the async optimizer, or a schedule of several steps, it also prints the
steady state of a long run: the mean step of the schedule's steps (step k of a run runs
schedule step k mod its steps, one at a time), its tokens/s and bubble (summary.json, in
either mode: schedule_steps, steady_step_ms, steady_tokens_per_s, steady_bubble_pct; peaks
and exposed_transfer_ms are over the whole schedule, the latter a mean per step).
``--nodes N`` (with ``--link eth25|eth100``) also
predicts N such servers training data parallel: the schedule lowered for N ranks (a REDUCE
action per gradient stage on the host's network lane, timed as a ring all-reduce on the link,
with gloo's host-memory traffic) replayed over the same steps, its steady step time, tokens/s
of all N and the scaling efficiency against one server (summary.json: nodes;
docs/distributed.md). ``--shard-optimizer`` (``--optimizer sync``) simulates sharded host
state: each REDUCE gloo's reduce to the gradients' owners, each SHADOW also broadcasting the
updated shadows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rpcompile.errors import InvalidInput
from rpcompile.options import PlanOptions, TrainOptions

__all__ = ["main"]


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that gives each option's default: its value, or (None) what its text says."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default in (None, False, argparse.SUPPRESS) \
                or "(default" in text:
            return text
        return text + " (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    from rpcompile.choices import HOST_MEMORY, MODES, RECOMPUTE_MODES, SEARCH_EFFORTS, flag_type

    ap = argparse.ArgumentParser(
        prog="rpcompile",
        description="Compile PyTorch / Hugging Face models into RoundPipe training programs.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan",
        help="plan, schedule and simulate a shipped model on a hardware profile",
        description="Build a shipped model from its config on the meta device (no weights), "
                    "compile it for a hardware profile and simulate the schedule the "
                    "runtime runs: the stage table, predicted tokens/s and bubble of one "
                    "step (and the steady state), device and host memory, how "
                    "the partition search ended and the longest sequence that fits. With no "
                    "--batch it doubles the sequences per microbatch while the simulated "
                    "tokens/s rises more than 5% and the plan fits, and says so. --out writes "
                    "the schedule (CSV, Perfetto JSON, PNG), plan.txt and summary.json.",
        formatter_class=_DefaultsFormatter,
    )
    plan.add_argument("--model", required=True, help="a shipped model (see `rpcompile models`)")
    plan.add_argument("--hardware", default="rtx4090x8", help="profile (see `rpcompile hardware`)")
    plan.add_argument("--gpus", type=int, default=None,
                      help="workers (default: the profile's GPU count)")
    plan.add_argument("--seq", type=int, default=2048, help="sequence length (tokens)")
    plan.add_argument("--batch", type=int, default=None,
                      help="global batch in sequences per optimizer step (default: double the "
                           "sequences per microbatch from 1 while the simulated tokens/s rises "
                           "more than 5%%, up to 64, while the plan fits the GPUs and host "
                           "RAM); a batch that does not divide is split as evenly as possible "
                           "and every microbatch is timed at the largest one's size")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="microbatches per round (default: gpus + 1)")
    plan.add_argument("--rounds", type=int, default=1, help="rounds per step (accumulation)")
    plan.add_argument("--schedule", default="roundpipe",
                      choices=["roundpipe", "gpipe", "1f1b", "interleaved", "looped-bfs"],
                      help="RoundPipe, or a weight-bound baseline on the same simulator")
    plan.add_argument("--optimizer", default="sync", type=flag_type("mode"), choices=MODES,
                      help="exact updates (sync, as `rpcompile train` and compile() default "
                           "to) or one step stale, overlapping the next step (async; also "
                           "simulates a steady state of several steps)")
    plan.add_argument("--lora", type=int, default=None, metavar="R",
                      help="LoRA adapters of rank R on every linear layer but the LM head, "
                           "the base frozen (default: the model config's: qwen3-235b-a22b "
                           "has r=32; 0: full fine-tuning)")
    plan.add_argument("--quantize", default="none", choices=("none", "nf4"),
                      help="with LoRA: the frozen base's decoder linears in bitsandbytes NF4 "
                           "(double-quantized absmax), kept and uploaded packed. A model "
                           "built on the meta device has no quantized weights to capture, "
                           "so nf4 plans the paper model's unit profiles "
                           "(rpcompile.workloads.paper, base nf4: the paper's per-layer "
                           "times, packed bytes as bitsandbytes stores them) at the paper "
                           "workload's batch, microbatches and rounds unless --batch / "
                           "--microbatches are given, and prints host memory, tokens/s, the "
                           "proven device peak and the longest sequence that fits (searches "
                           "capped at --max-simulations, default 24 replays)")
    plan.add_argument("--layers", type=int, default=None,
                      help="override the model depth (quick experiments; default: the config's)")
    plan.add_argument("--out", type=Path, default=None,
                      help="folder for schedule.csv, schedule.json (Perfetto), schedule.png, "
                           "plan.txt and summary.json (default: print only)")
    plan.add_argument("--recompute", default="auto", type=flag_type("recompute"),
                      choices=RECOMPUTE_MODES,
                      help="how backward stages recompute their forward: stage (all layers' "
                           "activations for one backward), layer (one layer at a time, one "
                           "more forward) or auto (stage unless that plan does not fit, "
                           "then the faster plan that fits, cut again by stage or by layer)")
    plan.add_argument("--search-effort", default="normal", type=flag_type("search_effort"),
                      choices=SEARCH_EFFORTS,
                      help="what the partition search spends: normal (a few simulator "
                           "replays), high (up to 1024 sync, 32 async) or exhaustive "
                           "(until its plan is proven the fastest of its candidates)")
    plan.add_argument("--max-simulations", type=int, default=None, metavar="N",
                      help="cap the partitioner's simulator replays per search instead of "
                           "the effort's; a search stopped before its proof says so, with "
                           "the most a plan it did not replay could be faster")
    plan.add_argument("--plan-cache", default=None, metavar="DIR|off",
                      help="where searched plans are kept and found again (default: "
                           "$RPCOMPILE_CACHE_DIR, else ~/.cache/rpcompile/plans); off: search "
                           "every time")
    plan.add_argument("--quiet", action="store_true",
                      help="no progress lines from the compile (capture, searches, cache)")
    plan.add_argument("--no-fit-search", action="store_true",
                      help="skip the search for the longest sequence that fits")
    plan.add_argument("--longest", action="store_true",
                      help="search the longest sequence that fits (one sequence per "
                           "microbatch unless --batch is given) and print it, what limits "
                           "the next length, and the memory-first plan (every unit its own "
                           "stage) proven to fit at that length")
    plan.add_argument("--host-ram", type=float, default=None, metavar="GIB",
                      help="host RAM of the target server in GiB (default: the profile's, "
                           "else this machine's); the plan's host memory is checked against it")
    plan.add_argument("--no-undo-journal", action="store_true",
                      help="plan a run without the optimizer's undo journal (undo_journal="
                           "False): 14 bytes per trainable parameter less host memory and no "
                           "journal copy in each update's time, but a failed step then ends "
                           "the run (restore the last checkpoint)")
    plan.add_argument("--host-memory", default="pinned", type=flag_type("host_memory"),
                      choices=HOST_MEMORY,
                      help="host memory the run copies from and to: pinned (page-locked "
                           "host store and staging) or pageable (nothing pinned, as "
                           "RoundPipe's pin_model=\"off\"; every transfer timed at the "
                           "profile's pageable bandwidth, which the profile must have; the "
                           "same static host bytes)")
    plan.add_argument("--nodes", type=int, default=1,
                      help="servers training data parallel (one pipeline each, on its share "
                           "of a --nodes times larger global batch); N > 1 also simulates "
                           "the schedule lowered for N ranks (REDUCE actions on the link) "
                           "and prints the tokens/s of N servers and the scaling efficiency "
                           "against one")
    plan.add_argument("--shard-optimizer", action="store_true",
                      help="with --nodes N: the servers shard their masters and optimizer "
                           "state (ZeRO-1 style, --optimizer sync): each REDUCE is timed as "
                           "gloo's reduce to the gradients' owners and each SHADOW also "
                           "broadcasts the updated shadows")
    plan.add_argument("--link", default="eth100",
                      help="the network between servers for --nodes: eth25 or eth100 (25 / "
                           "100 Gbit/s Ethernet)")

    train = sub.add_parser(
        "train",
        help="fine-tune a checkpoint folder on a data file with the RoundPipe runtime",
        description="Fine-tune a Hugging Face checkpoint folder on a data file (JSONL, JSON, "
                    "CSV, Parquet or text) over RoundPipe workers, and write final/ "
                    "(from_pretrained), checkpoints, metrics.jsonl, TensorBoard events and "
                    "loss.png. With no arguments: build the tiny shipped Qwen3 (byte-level), "
                    "write it as a checkpoint folder and fine-tune it on the shipped text. "
                    "Options come from the defaults, then --config run.yaml, then the flags. "
                    "--out holds one run (another run's folder is refused: --overwrite, "
                    "--resume). Ctrl-C or SIGTERM stops after the step in flight (twice: at "
                    "once), saves a checkpoint of the last finished step and exits 130 / 143; "
                    "--resume goes on from it.",
    )
    from rpcompile.finetune import add_train_arguments

    add_train_arguments(train)

    sub.add_parser("models", help="list the shipped model configs")
    sub.add_parser("hardware", help="list the hardware profiles and the inter-server links")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "models":
            from rpcompile.workloads.models import list_models

            print("\n".join(list_models()))
            return 0
        if args.command == "hardware":
            from rpcompile.hardware import get_hardware, get_link, list_hardware, list_links

            for name in list_hardware():
                hw = get_hardware(name)
                ram = (f"host RAM {hw.host_ram_gib:g} GiB (assumed; --host-ram)"
                       if hw.host_ram_gib else "host RAM unknown (this machine's is used)")
                pageable = (f"{hw.pageable_h2d_gbps:g}/{hw.pageable_d2h_gbps:g} GB/s "
                            "pageable"
                            if hw.pageable_h2d_gbps and hw.pageable_d2h_gbps else
                            "pageable unknown")
                print(f"{name:<11} {hw.gpus} x {hw.gpu}, {hw.memory_gib:g} GiB, "
                      f"{hw.matmul_tflops:g} TFLOP/s, H2D/D2H {hw.h2d_gbps:g}/"
                      f"{hw.d2h_gbps:g} GB/s pinned, {pageable}, {ram}")
            for name in list_links():
                link = get_link(name)
                print(f"{name:<11} link between servers (plan --nodes): {link.name}, "
                      f"{100 * link.efficiency:g}% achieved, {link.latency_us:g} us per message")
            return 0
        if args.command == "train":
            return _train(args)
        return _plan(args)
    except ValueError as err:  # user errors: say what to change, no traceback
        print(f"rpcompile: error: {err}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    import torch

    import rpcompile
    from rpcompile.finetune import plan_cache_option
    from rpcompile.hardware import get_hardware
    from rpcompile.passes.lower import LOWERING_PASSES
    from rpcompile.planner.partition import memory_first_note
    from rpcompile.sim import simulate, simulate_pipeline
    from rpcompile.workloads.models import build_model, model_config

    # The profile as the run uses the host (with or without the undo journal): every replay,
    # bound and host figure below follows it.
    hw = get_hardware(args.hardware).with_undo_journal(not args.no_undo_journal)
    hw = hw.with_host_memory(args.host_memory)  # pageable without its figures: refused here
    if args.nodes < 1:
        raise InvalidInput(f"--nodes must be at least 1, got {args.nodes}")
    if args.shard_optimizer and args.nodes == 1:
        raise InvalidInput("--shard-optimizer shards the host state across servers, so it "
                         "changes nothing on one: add --nodes N (N > 1) to simulate N "
                         "servers, or leave --shard-optimizer out")
    if args.nodes > 1 and args.schedule != "roundpipe":
        raise InvalidInput("--nodes simulates RoundPipe pipelines; drop --schedule")
    from rpcompile.hardware import get_link

    get_link(args.link)  # an unknown name fails here, with the known ones
    gpus = args.gpus or hw.gpus
    micro = args.microbatches or gpus + 1
    if args.schedule == "interleaved" and micro % gpus:
        raise InvalidInput(
            f"interleaved 1F1B needs microbatches divisible by the GPUs ({gpus}); pass "
            f"--microbatches {gpus * max(1, micro // gpus)} (or another multiple of {gpus})"
        )
    batch = args.batch or micro * args.rounds
    if batch < micro * args.rounds:
        raise InvalidInput(
            f"--batch {batch} is smaller than microbatches x rounds = {micro * args.rounds}: "
            "every microbatch needs a sequence"
        )
    model_config(args.model)  # unknown names fail here with the list of known ones
    if args.lora is not None and args.lora < 0:
        raise InvalidInput(f"--lora must be a rank >= 1, or 0 for full fine-tuning, got {args.lora}")
    if args.quantize != "none":
        return _plan_quantized(args, hw)
    print(f"building {args.model} on the meta device ...", file=sys.stderr)
    model = build_model(args.model, device="meta", layers=args.layers, lora=args.lora)

    def compile_for(batch: int, max_simulations: int | None):
        import warnings

        from rpcompile.passes.memory import HostMemoryWarning

        ids = torch.zeros(batch, args.seq, dtype=torch.long, device="meta")
        # device="virtual": the plan is for the profile's machine, not for a GPU here. Its
        # host check is printed below, from the same function (host_ram_problem).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HostMemoryWarning)
            return rpcompile.compile(
                model, ids, gpus=gpus, microbatches=micro, hardware=hw, rounds=args.rounds,
                mode=args.optimizer, device="virtual", search_effort=args.search_effort,
                plan=PlanOptions(recompute=args.recompute, shard_optimizer=args.shard_optimizer,
                                 max_simulations=max_simulations, undo_journal=hw.undo_journal,
                                 host_memory=hw.host_memory,
                                 progress=False if args.quiet else None,
                                 plan_cache=plan_cache_option(args.plan_cache)),
                train=TrainOptions(host_ram_bytes=None if args.host_ram is None
                                   else host_ram(args.host_ram, hw)[0]))

    choice = None
    if args.batch is None and args.schedule == "roundpipe":
        # The smallest batch is planned with a capped search; the rule's trials reuse its
        # capture, and the batch it picks is planned with the full search.
        trial_cap = min(TRIAL_SIMULATIONS[args.optimizer], args.max_simulations or 1 << 30)
        ram, _ = host_ram(args.host_ram, hw)
        print(f"--batch not given: planning 1, 2, 4, ... sequences per microbatch (searches "
              f"capped at {trial_cap} replays) to pick the batch", file=sys.stderr)
        choice = default_batch(compile_for(batch, trial_cap), hw, ram,
                               lambda b: compile_for(b * micro * args.rounds, trial_cap))
        batch = choice.size * micro * args.rounds
    while True:
        try:
            compiled = compile_for(batch, args.max_simulations)
            break
        except ValueError as err:  # the pick's runtime schedule does not fit: one size down
            if choice is None or choice.size == 1:
                raise
            choice.trials.append((choice.size, None, f"the full compile refused it ({err})"))
            choice.size //= 2
            batch = choice.size * micro * args.rounds
    plan = compiled.plan
    whole = None  # the replay of the runtime's schedule (RoundPipe)
    if args.schedule == "roundpipe":
        # The compile's own lowered schedule, the one the runtime runs (its steps overlapping
        # as far as their edges let them), replayed once for the steady state; the same plan
        # lowered for one step alone gives the isolated step.
        from dataclasses import replace

        from rpcompile.passes.lower import runtime_schedule

        lowered = compiled.schedule
        history = tuple(r for r in compiled.history if r.name in LOWERING_PASSES)
        whole = simulate(lowered, plan, hw)
        sim = simulate(runtime_schedule(plan, replace(compiled.options.plan, schedule_steps=1,
                                                      updates=plan.updates)), plan, hw)
    else:
        # Weight-bound baselines: one stage per GPU (two per GPU for the interleaved and
        # looped schedules), cut from the same unit costs.
        chunks = 2 if args.schedule in ("interleaved", "looped-bfs") else 1
        sim = simulate_pipeline(
            plan.units, hw, args.schedule, workers=gpus, microbatches=micro, chunks=chunks,
            rounds=args.rounds, tokens_per_microbatch=plan.microbatch_size * args.seq,
        )
        lowered, history = sim.schedule, ()
    result = _summary(sim, whole or sim)

    print(plan)
    print()
    print(f"capture: {compiled.capture.report}")
    # compiled.history holds the compile's passes, then the dispatch and lowering of its schedule.
    passes = [r for r in compiled.history if r.name != "dispatch" and r not in history]
    print("passes: " + ", ".join(f"{r.name} {r.elapsed_ms:.0f} ms" for r in passes)
          + "; lowering: " + ", ".join(f"{r.name} {r.elapsed_ms:.0f} ms" for r in history))
    tokens = batch * args.seq
    summary = {"model": args.model, "hardware": hw.name, "gpus": gpus, "schedule": args.schedule,
               "optimizer": args.optimizer, "seq": args.seq, "batch": batch,
               "microbatches": micro, "rounds": args.rounds, "tokens_per_step": tokens,
               "stages": len(plan.stages), "actions": sum(1 for _ in lowered.all_actions())}
    summary.update(result)
    fallback = memory_first_note(plan)
    summary["memory_first_fallback"] = fallback is not None
    if fallback is not None:
        print(f"plan: the memory-first fallback (one unit per stage): {fallback}")
    print(f"predicted, one isolated step: {summary['makespan_ms']:.1f} ms, "
          f"{summary['tokens_per_s']:,.0f} tokens/s; bubble {summary['bubble_pct']:.2f}% "
          f"(fill {summary['bubble_fill_pct']:.2f}%, steady {summary['bubble_steady_pct']:.2f}%, "
          f"drain {summary['bubble_drain_pct']:.2f}%)")
    if whole is not None:
        # A training run of many steps, overlapping as the runtime runs them: the steady
        # state of the runtime's schedule (its repeated dealing period).
        from rpcompile.sim import steady_step_ms, steady_utilization

        steps = lowered.steps
        summary["schedule_steps"] = steps
        summary["steady_step_ms"] = steady_step_ms(whole)
        summary["steady_tokens_per_s"] = tokens / (summary["steady_step_ms"] / 1e3)
        summary["steady_bubble_pct"] = 100 * (1 - steady_utilization(whole))
        print(f"predicted, steady state ({args.optimizer}; the runtime's schedule, "
              f"{steps} steps overlapping as their edges let them): "
              f"{summary['steady_step_ms']:.1f} ms per step, "
              f"{summary['steady_tokens_per_s']:,.0f} tokens/s; bubble "
              f"{summary['steady_bubble_pct']:.2f}%")
    if whole is not None and args.nodes > 1:
        from rpcompile.sim.scaling import simulate_nodes

        # N servers: the schedule lowered again for N ranks (REDUCE actions), replayed over
        # a steady-state run beside one server's (rpcompile.sim.scaling).
        scaling = simulate_nodes(plan, hw, args.nodes, args.link, tokens_per_step=tokens,
                                 optimizer=args.optimizer, rounds=args.rounds,
                                 sharded=compiled.options.plan.shard_optimizer)
        summary["nodes"] = scaling.to_dict()
        print(f"predicted, {scaling.summary()}")
    if choice is not None:
        summary["batch_choice"] = choice.to_dict()
        print(f"batch: {batch} sequences ({choice.size} per microbatch), {choice.describe()}")
    if args.schedule == "roundpipe":
        _workers_note(summary, plan, gpus, micro, args.rounds, choice)
    print(f"peak device memory: {max(summary['peak_device_gib']):.2f} GiB simulated of "
          f"{hw.memory_gib:g} GiB ({hw.usable_memory_bytes / 2**30:.2f} GiB usable, "
          f"{hw.memory_reserve_gib:g} GiB reserved for the CUDA context and allocator)")
    if args.schedule == "roundpipe":
        from rpcompile.passes.lower import grad_slots
        from rpcompile.passes.memory import format_bytes, host_memory, host_ram_problem

        peak = max(compiled.memory, key=lambda p: p.peak_bytes)
        summary["proven_peak_device_gib"] = peak.peak_bytes / 2**30
        print(f"proven peak over the schedule: {peak.describe(plan.stage_name)}")
        summary["memory_waits"] = list(plan.memory_waits)
        slots = grad_slots(plan.memory_waits)
        print("memory-bounding waits: " + ", ".join(plan.memory_waits) + (
            f" ({slots} gradient buffer{'s' if slots > 1 else ''} per worker"
            + ("; the schedule fits only with one" if slots == 1 else "") + ")"))
        search = next((n for n in plan.notes if n.startswith("search:")), None)
        if search is not None:  # proven the simulator's fastest candidate, or the gap left
            print(search)
        chunk = compiled.capture.loss_chunk_tokens
        summary["loss_chunk_tokens"] = chunk
        choice = next((n for n in plan.notes if n.startswith("LM head + loss:")), None)
        print(choice or ("LM head + loss: whole logits" if chunk is None else
                         f"LM head + loss: {chunk:,}-token chunks"))
        layered = [plan.stage_name(s.index) for s in plan.stages if s.recompute == "layer"]
        summary["recompute"] = {"option": args.recompute, "layer_stages": layered}
        choice = next((n for n in plan.notes if n.startswith("recompute:")), None)
        if choice is None and not layered and args.recompute == "layer":
            # Layer recompute applies to backward stages of more than one unit; a plan of
            # one-unit backward stages has none, which is not the by-stage choice.
            choice = ("recompute: layer by layer (--recompute layer), though every backward "
                      "stage of this plan is one unit, so each recomputes that unit at once")
        print(choice or ("recompute: layer by layer in " + ", ".join(layered) if layered else
                         "recompute: by stage (every backward stage recomputes its forward "
                         "with autograd at once)"))
        host = host_memory(plan, args.optimizer, round(summary["host_gib"] * 2**30),
                           journal=hw.undo_journal, pageable=hw.host_memory == "pageable")
        summary["host"] = {k: getattr(host, k) for k in
                           ("masters", "optimizer", "gradients", "shadows", "model", "journal",
                            "transfers")}
        summary["undo_journal"] = hw.undo_journal
        summary["host_memory"] = hw.host_memory
        summary["link_gbps"] = {"h2d": hw.link_h2d_gbps, "d2h": hw.link_d2h_gbps}
        summary["host_pinned_gib"] = host.pinned / 2**30
        ram, source = host_ram(args.host_ram, hw)
        summary["host_ram_gib"] = ram / 2**30
        print(f"host memory: {host.describe()}; {format_bytes(ram)} RAM ({source})")
        problem = host_ram_problem(host, ram, source, ram_option="--host-ram",
                                   journal_option="--no-undo-journal", parts=False)
        if problem is not None:  # the check compile() and the Trainer make (one function)
            print(f"warning: {problem}")
        # Which host memory the plan assumes (--host-memory): every transfer above was timed
        # at its bandwidth (docs/compiler.md, "Pinned and pageable transfers").
        print(f"transfers: {hw.describe_host_memory('--host-memory pageable')}")
    else:
        print(f"host memory {summary['host_gib']:.1f} GiB")
    if args.longest and args.schedule == "roundpipe":
        b = 1 if args.batch is None else plan.microbatch_size
        found = longest_sequence(compiled, hw, microbatch_size=b,
                                 ram=host_ram(args.host_ram, hw))
        summary["longest"] = _longest_summary(found, b)
        print(f"\nlongest sequence that fits the GPUs and the host RAM ({micro} microbatches "
              f"of {b} sequence{'s' if b > 1 else ''}, {gpus} GPUs): {found.seq_len:,} tokens"
              + (f" (limit: {found.limit})" if found.limit else ""))
        print(f"  {found.describe()}")
        print(f"  {found.host_line()}")
        if found.plan is not None:
            print(found.plan)
            print(f"proven peak at {found.seq_len:,} tokens: "
                  f"{max(found.plan.worker_peak_bytes) / 2**30:.2f} GiB of "
                  f"{hw.usable_memory_bytes / 2**30:.2f} GiB usable")
    elif not args.no_fit_search and args.schedule == "roundpipe":
        found = longest_sequence(compiled, hw, ram=host_ram(args.host_ram, hw))
        summary["longest_seq"] = found.seq_len
        summary["longest_detail"] = _longest_summary(found, plan.microbatch_size)
        print(f"longest sequence that fits the GPUs and the host RAM (microbatch of "
              f"{plan.microbatch_size}): {found.describe()}; {found.host_line()}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        timeline = result.pop("_timeline", None)
        for ext in ("csv", "json", "png"):
            lowered.dump(args.out / f"schedule.{ext}", timeline=timeline)
        (args.out / "plan.txt").write_text(str(plan) + "\n")
        (args.out / "summary.json").write_text(json.dumps(
            {k: v for k, v in summary.items() if not k.startswith("_")}, indent=2))
        print(f"wrote {args.out}/schedule.csv, schedule.json (open in ui.perfetto.dev), "
              "schedule.png, plan.txt, summary.json")
    return 0


def _plan_quantized(args: argparse.Namespace, hw) -> int:
    """``rpcompile plan --quantize nf4``: the paper model's unit profiles with its frozen base
    in NF4 (rpcompile.workloads.paper.PaperModel, ``base="nf4"``), planned, replayed by the
    simulator and proven; what ``benchmarks/qlora.py`` measures for one model and base."""
    from dataclasses import replace

    from rpcompile.options import PlanOptions
    from rpcompile.passes.memory import host_memory, host_ram_problem, worker_peaks
    from rpcompile.planner import longest
    from rpcompile.planner.partition import partition
    from rpcompile.sim import simulate_roundpipe, steady_step_ms, steady_steps
    from rpcompile.workloads.paper import MODELS, WORKLOADS

    if args.model not in MODELS:
        raise InvalidInput(f"--quantize {args.quantize} plans the paper models' unit profiles: "
                         f"{', '.join(MODELS)}; {args.model} is not one")
    ignored = [flag for flag, given in (
        ("--schedule", args.schedule != "roundpipe"), ("--nodes", args.nodes > 1),
        ("--shard-optimizer", args.shard_optimizer), ("--layers", args.layers is not None),
        ("--out", args.out is not None), ("--longest", args.longest)) if given]
    if ignored:
        raise InvalidInput(f"--quantize {args.quantize} plans RoundPipe on one server from the "
                         f"paper model's unit profiles; {', '.join(ignored)} is not supported "
                         "with it")
    paper = MODELS[args.model]
    rank = paper.lora_rank if args.lora is None else args.lora
    if not rank:
        raise InvalidInput(f"--quantize {args.quantize} quantizes the frozen base under LoRA "
                         f"adapters; {args.model} has none: pass --lora R")
    model = replace(paper, lora_rank=rank, base=args.quantize)
    work = WORKLOADS[args.model]
    gpus = args.gpus or hw.gpus
    micro = args.microbatches or work.microbatches
    rounds = args.rounds if args.batch else work.rounds
    batch = args.batch or work.global_batch
    size = batch / (micro * rounds)
    if size < 1:
        raise InvalidInput(f"--batch {batch} is smaller than microbatches x rounds = "
                         f"{micro * rounds}: every microbatch needs a sequence")
    cap = args.max_simulations or 24
    options = PlanOptions(gpus=gpus, microbatches=micro, rounds=rounds, mode=args.optimizer,
                          recompute=args.recompute, max_simulations=cap)
    print(f"planning {args.model} (paper unit profiles), LoRA r={rank}, {args.quantize} base: "
          f"{batch} x {args.seq} tokens a step, {micro} microbatches x {rounds} rounds, "
          f"{gpus} GPUs (search capped at {cap} replays) ...", file=sys.stderr)
    plan = partition(model.units(size, args.seq), hw, microbatch_size=max(1, round(size)),
                     seq_len=args.seq, options=options)
    run = simulate_roundpipe(plan, hw, steps=steady_steps(plan, rounds=rounds),
                             optimizer=args.optimizer, rounds=rounds)
    print(plan)
    print()
    tokens = batch * args.seq
    print(f"predicted, steady state ({args.optimizer}): {steady_step_ms(run):.1f} ms per step, "
          f"{tokens / (steady_step_ms(run) / 1e3):,.0f} tokens/s")
    peak = max(worker_peaks(run.schedule, plan), key=lambda p: p.peak_bytes)
    print(f"proven peak over the schedule: {peak.describe(plan.stage_name)}; "
          f"{hw.usable_memory_bytes / 2**30:.2f} GiB usable")
    host = host_memory(plan, args.optimizer, run.peak_host_bytes, journal=hw.undo_journal,
                       pageable=hw.host_memory == "pageable")
    ram, source = host_ram(args.host_ram, hw)
    print(f"host memory: {host.describe()}; {ram / 2**30:.2f} GiB RAM ({source})")
    problem = host_ram_problem(host, ram, source, ram_option="--host-ram",
                               journal_option="--no-undo-journal", parts=False)
    if problem is not None:
        print(f"warning: {problem}")
    if not args.no_fit_search:
        found = longest.longest_sequence(
            lambda s: model.units(1, s), hw, microbatch_size=1, start=args.seq, step=1024,
            limit=1 << 18, host_ram_bytes=ram, host_ram_source=source,
            options=replace(options, rounds=1))
        print(f"longest sequence that fits the GPUs and the host RAM (microbatch of 1 "
              f"sequence, {micro} microbatches): {found.describe()}; {found.host_line()}")
    return 0


def _workers_note(summary: dict, plan, gpus: int, micro: int, rounds: int,
                  choice: BatchChoice | None) -> None:
    """Say when the plan leaves workers idle (fewer jobs a step than workers) or its fill and
    drain dominate the step (the batch is too small for the workers)."""
    from rpcompile.passes.schedule import dispatch_period

    jobs = len(plan.stages) * rounds
    if jobs < gpus:
        summary["idle_workers"] = gpus - jobs
        print(f"idle workers: a step has {jobs} jobs for {gpus} workers, so {gpus - jobs} "
              f"worker{'s get' if gpus - jobs > 1 else ' gets'} no job in each step (round robin gives each a job every "
              f"{dispatch_period(jobs, gpus)} steps)")
    fill = (summary["bubble_fill_pct"] + summary["bubble_drain_pct"]) / 100
    if fill <= FILL_DRAIN_LIMIT:
        _slowest_stage_note(summary, plan, micro)
        return
    # An estimate from this plan's stage times: fill and drain stay as they are while the
    # steady part grows with the microbatches a round, so k times the microbatches bring the
    # working workers' share under the limit (an idle worker's step is all fill; more
    # microbatches do not give it a job).
    busy = min(jobs, gpus)
    active = max(0.0, fill * gpus - (gpus - busy)) / busy
    head = (f"batch too small for the workers: fill and drain are {100 * fill:.1f}% of the "
            f"step (over {FILL_DRAIN_LIMIT:.0%})")
    if active <= FILL_DRAIN_LIMIT:  # the idle workers are the bubble
        summary["batch_too_small"] = {"fill_drain_pct": 100 * fill}
        print(f"{head}, most of it the {gpus - busy} idle workers: more microbatches do not "
              f"give them a job; fewer --gpus would")
        return
    k = active * (1 - FILL_DRAIN_LIMIT) / (FILL_DRAIN_LIMIT * (1 - active))
    fills = max(micro + 1, math.ceil(micro * k))
    summary["batch_too_small"] = {"fill_drain_pct": 100 * fill, "microbatches_to_fill": fills}
    how = ("the default rule stopped at this batch (see batch:)" if choice is not None
           else "leave out --batch to let plan double it while tokens/s rises")
    print(f"{head}; with this plan's stage times about {fills} microbatches a round (--batch "
          f"{fills * rounds * plan.microbatch_size} --microbatches {fills}) would bring them "
          f"under {FILL_DRAIN_LIMIT:.0%}; or {how}")


def _slowest_stage_note(summary: dict, plan, micro: int) -> None:
    """Say when the workers idle more than IDLE_LIMIT of the step though fill and drain do
    not dominate: the steady part, where a round's microbatches pass the slowest stage one
    after another on its worker while the stages after it wait on its pace. The bound it
    prints is a critical path of the plan's stage times alone (no transfer, no wait): the
    first microbatch through every stage before the slowest, all of them through it, the
    last through every stage after it."""
    bubble = summary["bubble_pct"] / 100
    if bubble <= IDLE_LIMIT:
        return
    times = [s.compute_ms for s in plan.stages]
    if not any(t > 0 for t in times):  # no stage times to name a pace by
        return
    k = max(range(len(times)), key=times.__getitem__)
    slow = plan.stages[k]
    before, after = sum(times[:k]), sum(times[k + 1:])
    bound = before + micro * times[k] + after
    median = statistics.median(t for t in times if t > 0)
    name = plan.stage_name(k)
    units = plan.units[slow.units[0]].name if len(slow.units) == 1 else \
        f"{len(slow.units)} units"
    summary["idle"] = {"bubble_pct": 100 * bubble, "slowest_stage": name,
                       "slowest_ms_per_microbatch": times[k], "median_ms_per_microbatch": median,
                       "round_bound_ms": bound}
    why = (f"; {name} is one unit, which no cut divides" if len(slow.units) == 1 else
           f"; cutting {name} finer, where memory allows, lowers that bound")
    print(f"workers idle {100 * bubble:.1f}% of the step, {summary['bubble_steady_pct']:.1f}% "
          f"of it in the steady part: a round's microbatches pass the slowest stage, {name} "
          f"({units}: {times[k]:.2f} ms a microbatch, the median stage {median:.2f}), one after "
          f"another on one worker, and the stages after it go at its pace, so a round takes at "
          f"least {before:,.0f} + {micro} x {times[k]:.2f} + {after:,.0f} = {bound:,.0f} ms of "
          f"the step's {summary['makespan_ms']:,.1f} (stage times alone){why}")


def _train(args: argparse.Namespace) -> int:
    from rpcompile.finetune import run

    return run(args)


def _summary(step, run) -> dict:
    """The figures of one step (``step``: a :class:`~rpcompile.sim.result.StepFigures`, or a
    one-step run) and those of the whole replayed ``run`` (exposed transfers as a mean per
    step, memory peaks over every step, the timeline the dump draws)."""
    return {
        "makespan_ms": step.makespan_ms,
        "tokens_per_s": step.tokens_per_s,
        "bubble_pct": 100 * step.bubble,
        "bubble_fill_pct": 100 * step.bubble_fill,
        "bubble_steady_pct": 100 * step.bubble_steady,
        "bubble_drain_pct": 100 * step.bubble_drain,
        "exposed_transfer_ms": sum(run.exposed_transfer_ms) / run.schedule.steps,
        "peak_device_gib": [b / 2**30 for b in run.peak_device_bytes],
        "host_gib": run.peak_host_bytes / 2**30,
        "_timeline": run.timeline,
    }


def host_ram(gib: float | None, hw) -> tuple[int, str]:
    """(bytes, where the figure comes from) of the target server's host RAM: ``--host-ram``,
    else the profile's, else this machine's (rpcompile.hardware.host_ram, as compile()
    takes it)."""
    from rpcompile.hardware import host_ram as ram_of

    return ram_of(None if gib is None else int(gib * 2**30), hw, "--host-ram")


# The default batch (``plan`` without ``--batch``): the sequences per microbatch double from
# 1 while a doubling raises the simulated tokens/s by more than DEFAULT_BATCH_GAIN, up to
# DEFAULT_BATCH_LARGEST, and only while the plan fits the GPUs and adds no host memory beyond
# the RAM. Each trial is a partition search capped at TRIAL_SIMULATIONS replays, without the
# async boundary refinement (about the same replay time in both modes: an async replay is a
# dozen steps); the batch picked is then planned with the full search, which is at least as
# fast as its trial.
DEFAULT_BATCH_GAIN = 0.05
DEFAULT_BATCH_LARGEST = 64
TRIAL_SIMULATIONS = {"sync": 16, "async": 4}
# A step whose fill and drain idle more than this share of the workers' time: the batch is
# too small for the workers.
FILL_DRAIN_LIMIT = 0.30
# A step whose workers idle more than this share of their time (fill, drain and the steady
# part together) says so, and what paces it.
IDLE_LIMIT = 0.30


@dataclass
class BatchChoice:
    """How ``plan`` chose the batch: per trial (sequences per microbatch, simulated tokens/s
    or None, why the doubling stopped there or ''), and the size picked."""

    size: int
    trials: list = field(default_factory=list)
    cap: int = 0

    def describe(self) -> str:
        parts, last = [], None
        for b, tps, why in self.trials:
            fig = "no plan" if tps is None else f"{tps:,.0f} tokens/s"
            if tps is not None and last is not None:
                fig += f" ({tps / last - 1:+.1%})"
            parts.append(f"{b}: {fig}" + (f", {why}" if why else ""))
            last = tps if tps is not None else last
        return (f"picked by doubling the sequences per microbatch while the simulated tokens/s "
                f"rises more than {DEFAULT_BATCH_GAIN:.0%} (searches capped at {self.cap} "
                f"replays): " + "; ".join(parts))

    def to_dict(self) -> dict:
        return {"microbatch_size": self.size, "gain": DEFAULT_BATCH_GAIN,
                "trial_max_simulations": self.cap,
                "trials": [{"microbatch_size": b, "tokens_per_s": tps, "stopped": why}
                           for b, tps, why in self.trials]}


def default_batch(compiled, hw, ram_bytes: int, compile_at) -> BatchChoice:
    """The default batch's sequences per microbatch (the rule above), from ``compiled`` (the
    smallest batch, one sequence per microbatch, compiled with the trials' replay cap). Trials
    plan the captured model at each size (rpcompile.planner.partition) with the compile's own
    plan options (``compiled.options.plan``: workers, microbatches, rounds, mode, recompute,
    the cap); when the whole logits no longer fit, ``compile_at(size)`` compiles that size
    (which chunks the loss) and later trials reuse its capture."""
    from rpcompile.compiler import unit_profiles
    from rpcompile.passes.memory import host_memory
    from rpcompile.planner.partition import PartitionError, StageCosting, partition
    from rpcompile.sim import simulate_roundpipe

    po = compiled.options.plan
    micro, rounds, optimizer = po.microbatches_per_round, po.rounds, po.mode
    dtype_bytes = compiled.compute_dtype.itemsize
    costing = StageCosting(weight_dtype_bytes=dtype_bytes, act_dtype_bytes=dtype_bytes)
    seq = compiled.plan.seq_len
    source = compiled

    def trial(b: int):
        profiles = unit_profiles(source.capture, source.unit_costs, b, seq, hw, dtype_bytes)
        plan = partition(profiles, hw, microbatch_size=b, seq_len=seq, costing=costing,
                         options=po, refine=0)
        run = simulate_roundpipe(plan, hw, steps=1, rounds=rounds, optimizer=optimizer)
        host = host_memory(plan, optimizer, run.peak_host_bytes, journal=hw.undo_journal,
                           pageable=hw.host_memory == "pageable").total
        return b * micro * rounds * seq * 1e3 / plan.predicted_step_ms, host

    choice = BatchChoice(size=1, cap=po.max_simulations)
    tps, host_limit = trial(1)
    host_limit = max(host_limit, ram_bytes)  # the smallest batch's need is printed anyway
    choice.trials.append((1, tps, ""))
    b = 2
    while b <= DEFAULT_BATCH_LARGEST:
        try:
            got, host = trial(b)
        except PartitionError:
            if source.capture.loss_chunk_tokens is not None:
                choice.trials.append((b, None, "no plan fits the GPUs"))
                break
            try:  # the whole logits are too large at this size: let compile chunk the loss
                source = compile_at(b)
                got, host = trial(b)
            except ValueError:  # PartitionError, MemoryPlanError: nothing fits
                choice.trials.append((b, None, "no plan fits the GPUs"))
                break
        if host > host_limit:
            choice.trials.append((b, got, "its host memory exceeds the RAM"))
            break
        if got <= tps * (1 + DEFAULT_BATCH_GAIN):
            choice.trials.append((b, got, f"not over {DEFAULT_BATCH_GAIN:.0%}"))
            break
        choice.trials.append((b, got, ""))
        choice.size, tps = b, got
        b *= 2
    else:
        choice.trials[-1] = (*choice.trials[-1][:2], f"the cap of {DEFAULT_BATCH_LARGEST}")
    return choice


def _longest_summary(found, microbatch_size: int) -> dict:
    """summary.json's figures of a longest-sequence search (rpcompile.planner.longest)."""
    gpu = found.gpu or found
    return {"microbatch_size": microbatch_size, "seq_len": found.seq_len,
            "next_len": found.next_len, "limit": found.why, "limited_by": found.limit,
            "host_gib": None if found.host is None else found.host.total / 2**30,
            "host_ram_gib": found.host_ram / 2**30 or None,
            "gpu_seq_len": gpu.seq_len, "gpu_next_len": gpu.next_len, "gpu_limit": gpu.why,
            "gpu_host_gib": None if gpu.host is None else gpu.host.total / 2**30}


def longest_sequence(compiled, hw, microbatch_size: int | None = None,
                     ram: tuple[int, str] = (0, "")):
    """The longest sequence for which some plan fits (rpcompile.planner.longest) with the
    compile's plan options (``compiled.options.plan``: workers, microbatches, rounds, mode),
    at ``microbatch_size`` sequences per microbatch (default: the plan's), searched from the
    plan's length up to the model's ``max_position_embeddings`` to a multiple of 64 tokens;
    ``ram``: (bytes, source) of the host RAM its host memory must fit (0: not checked)."""
    from rpcompile.compiler import unit_profiles
    from rpcompile.planner import longest
    from rpcompile.planner.partition import StageCosting

    b = microbatch_size or compiled.plan.microbatch_size
    dtype_bytes = compiled.compute_dtype.itemsize
    costing = StageCosting(weight_dtype_bytes=dtype_bytes, act_dtype_bytes=dtype_bytes)
    limit = getattr(getattr(compiled.model, "config", None), "max_position_embeddings", None)
    limit = int(limit or 1 << 20)
    start = min(compiled.plan.seq_len, limit)
    return longest.longest_sequence(
        lambda s: unit_profiles(compiled.capture, compiled.unit_costs, b, s, hw, dtype_bytes),
        hw, microbatch_size=b, costing=costing, options=compiled.options.plan, start=start,
        step=min(64, start), limit=limit, host_ram_bytes=ram[0], host_ram_source=ram[1])


if __name__ == "__main__":
    raise SystemExit(main())

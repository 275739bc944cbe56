"""``rpcompile plan`` builds a shipped model from its config on the ``meta`` device (no weights are
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
of :func:`rpcompile.plan_policy.default_batch` (the sequences per microbatch double while the simulated tokens/s
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
import sys

from rpcompile.cli.reports import PlanReport, QuantizedPlanReport
from rpcompile.errors import InvalidInput
from rpcompile.options import PlanOptions, TrainOptions
from rpcompile.plan_policy import (
    TRIAL_SIMULATIONS,
    BatchChoice,
    default_batch,
    longest_sequence,
    worker_use,
)


def _plan(args: argparse.Namespace) -> PlanReport | QuantizedPlanReport:
    """``rpcompile plan``: the arguments checked, the model compiled (at the default batch
    when none is given), its schedule simulated, the report built and --out written."""
    hw, gpus, micro, batch = _plan_inputs(args)
    if args.quantize != "none":
        return _plan_quantized(args, hw)
    compiled, choice, batch = _compile_plan(args, hw, gpus, micro, batch)
    sim, whole, lowered, history = _simulate_plan(args, compiled, hw, gpus, micro)
    report = _plan_report(args, hw, compiled, choice, batch, gpus, micro, sim, whole, lowered,
                          history)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        timeline = report.summary.pop("_timeline", None)
        for ext in ("csv", "json", "png"):
            lowered.dump(args.out / f"schedule.{ext}", timeline=timeline)
        (args.out / "plan.txt").write_text(str(compiled.plan) + "\n")
        (args.out / "summary.json").write_text(json.dumps(report.to_dict(), indent=2))
        report.written = args.out
    return report


def _plan_inputs(args: argparse.Namespace) -> tuple:
    """(hardware profile as the run uses the host, GPUs, microbatches, batch) of ``plan``'s
    arguments; a combination that cannot be planned is refused here, before anything is
    built."""
    from rpcompile.hardware import get_hardware, get_link
    from rpcompile.workloads.models import model_config

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
    return hw, gpus, micro, batch


def _compile_plan(args: argparse.Namespace, hw, gpus: int, micro: int, batch: int) -> tuple:
    """(compiled, how the batch was chosen or None, batch): the shipped model built on the
    meta device and compiled at ``batch``, or without ``--batch`` (RoundPipe) at the batch
    rpcompile.plan_policy.default_batch picks, one size down while the full compile refuses
    it."""
    import torch

    import rpcompile
    from rpcompile.finetune import plan_cache_option
    from rpcompile.workloads.models import build_model

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
    return compiled, choice, batch


def _simulate_plan(args: argparse.Namespace, compiled, hw, gpus: int, micro: int) -> tuple:
    """(one isolated step, the whole run or None, the lowered schedule, its lowering passes).
    RoundPipe: the compile's own lowered schedule, the one the runtime runs (its steps
    overlapping as far as their edges let them), replayed once for the steady state; the same
    plan lowered for one step alone gives the isolated step. A weight-bound baseline: one
    stage per GPU (two per GPU for the interleaved and looped schedules), cut from the same
    unit costs."""
    from rpcompile.passes.lower import LOWERING_PASSES
    from rpcompile.sim import simulate, simulate_pipeline

    plan = compiled.plan
    if args.schedule == "roundpipe":
        from dataclasses import replace

        from rpcompile.passes.lower import runtime_schedule

        lowered = compiled.schedule
        history = tuple(r for r in compiled.history if r.name in LOWERING_PASSES)
        whole = simulate(lowered, plan, hw)
        sim = simulate(runtime_schedule(plan, replace(compiled.options.plan, schedule_steps=1,
                                                      updates=plan.updates)), plan, hw)
        return sim, whole, lowered, history
    chunks = 2 if args.schedule in ("interleaved", "looped-bfs") else 1
    sim = simulate_pipeline(
        plan.units, hw, args.schedule, workers=gpus, microbatches=micro, chunks=chunks,
        rounds=args.rounds, tokens_per_microbatch=plan.microbatch_size * args.seq,
    )
    return sim, None, sim.schedule, ()


def _plan_report(args: argparse.Namespace, hw, compiled, choice: BatchChoice | None,
                 batch: int, gpus: int, micro: int, sim, whole, lowered,
                 history) -> PlanReport:
    """The figures of a compiled and simulated ``plan``, and the texts beside them."""
    from rpcompile.planner.partition import memory_first_note

    plan = compiled.plan
    # compiled.history holds the compile's passes, then the dispatch and lowering of its schedule.
    passes = [r for r in compiled.history if r.name != "dispatch" and r not in history]
    tokens = batch * args.seq
    summary = {"model": args.model, "hardware": hw.name, "gpus": gpus, "schedule": args.schedule,
               "optimizer": args.optimizer, "seq": args.seq, "batch": batch,
               "microbatches": micro, "rounds": args.rounds, "tokens_per_step": tokens,
               "stages": len(plan.stages), "actions": sum(1 for _ in lowered.all_actions())}
    summary.update(_summary(sim, whole or sim))
    fallback = memory_first_note(plan)
    summary["memory_first_fallback"] = fallback is not None
    report = PlanReport(
        summary=summary, plan=str(plan), capture=str(compiled.capture.report),
        passes=[(r.name, r.elapsed_ms) for r in passes],
        lowering=[(r.name, r.elapsed_ms) for r in history],
        microbatch_size=plan.microbatch_size, memory_first=fallback,
        usable_gib=hw.usable_memory_bytes / 2**30, reserve_gib=hw.memory_reserve_gib,
        memory_gib=hw.memory_gib)
    if whole is not None:
        # A training run of many steps, overlapping as the runtime runs them: the steady
        # state of the runtime's schedule (its repeated dealing period).
        from rpcompile.sim import steady_step_ms, steady_utilization

        summary["schedule_steps"] = lowered.steps
        summary["steady_step_ms"] = steady_step_ms(whole)
        summary["steady_tokens_per_s"] = tokens / (summary["steady_step_ms"] / 1e3)
        summary["steady_bubble_pct"] = 100 * (1 - steady_utilization(whole))
    if whole is not None and args.nodes > 1:
        from rpcompile.sim.scaling import simulate_nodes

        # N servers: the schedule lowered again for N ranks (REDUCE actions), replayed over
        # a steady-state run beside one server's (rpcompile.sim.scaling).
        scaling = simulate_nodes(plan, hw, args.nodes, args.link, tokens_per_step=tokens,
                                 optimizer=args.optimizer, rounds=args.rounds,
                                 sharded=compiled.options.plan.shard_optimizer)
        summary["nodes"] = scaling.to_dict()
        report.scaling = scaling.summary()
    if choice is not None:
        summary["batch_choice"] = choice.to_dict()
        report.batch_choice = choice.describe()
    if args.schedule != "roundpipe":
        return report
    use = worker_use(plan, gpus, micro, args.rounds, summary["bubble_pct"] / 100,
                     (summary["bubble_fill_pct"] + summary["bubble_drain_pct"]) / 100)
    report.workers = use
    if use.jobs < use.gpus:
        summary["idle_workers"] = use.gpus - use.jobs
    if use.too_small:
        summary["batch_too_small"] = {"fill_drain_pct": 100 * use.fill_drain}
        if use.microbatches_to_fill is not None:
            summary["batch_too_small"]["microbatches_to_fill"] = use.microbatches_to_fill
    if use.slowest is not None:
        slow = use.slowest
        summary["idle"] = {"bubble_pct": 100 * use.bubble, "slowest_stage": slow.name,
                           "slowest_ms_per_microbatch": slow.ms_per_microbatch,
                           "median_ms_per_microbatch": slow.median_ms_per_microbatch,
                           "round_bound_ms": slow.bound_ms}
    _memory_figures(report, args, hw, compiled)
    _longest_figures(report, args, hw, compiled)
    return report


def _memory_figures(report: PlanReport, args: argparse.Namespace, hw, compiled) -> None:
    """RoundPipe's proven device peak, memory-bounding waits, search end, loss chunking,
    recompute and host memory against the RAM, into ``report``."""
    from rpcompile.passes.lower import grad_slots
    from rpcompile.passes.memory import format_bytes, host_memory, host_ram_problem

    plan, summary = compiled.plan, report.summary
    peak = max(compiled.memory, key=lambda p: p.peak_bytes)
    summary["proven_peak_device_gib"] = peak.peak_bytes / 2**30
    report.proven_peak = peak.describe(plan.stage_name)
    summary["memory_waits"] = list(plan.memory_waits)
    slots = grad_slots(plan.memory_waits)
    report.memory_waits = ", ".join(plan.memory_waits) + (
        f" ({slots} gradient buffer{'s' if slots > 1 else ''} per worker"
        + ("; the schedule fits only with one" if slots == 1 else "") + ")")
    # proven the simulator's fastest candidate, or the gap left
    report.search = next((n for n in plan.notes if n.startswith("search:")), None)
    chunk = compiled.capture.loss_chunk_tokens
    summary["loss_chunk_tokens"] = chunk
    choice = next((n for n in plan.notes if n.startswith("LM head + loss:")), None)
    report.loss_head = choice or ("LM head + loss: whole logits" if chunk is None else
                                  f"LM head + loss: {chunk:,}-token chunks")
    layered = [plan.stage_name(s.index) for s in plan.stages if s.recompute == "layer"]
    summary["recompute"] = {"option": args.recompute, "layer_stages": layered}
    choice = next((n for n in plan.notes if n.startswith("recompute:")), None)
    if choice is None and not layered and args.recompute == "layer":
        # Layer recompute applies to backward stages of more than one unit; a plan of
        # one-unit backward stages has none, which is not the by-stage choice.
        choice = ("recompute: layer by layer (--recompute layer), though every backward "
                  "stage of this plan is one unit, so each recomputes that unit at once")
    report.recompute = choice or (
        "recompute: layer by layer in " + ", ".join(layered) if layered else
        "recompute: by stage (every backward stage recomputes its forward with autograd at "
        "once)")
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
    report.host = f"{host.describe()}; {format_bytes(ram)} RAM ({source})"
    # the check compile() and the Trainer make (one function)
    report.host_warning = host_ram_problem(host, ram, source, ram_option="--host-ram",
                                           journal_option="--no-undo-journal", parts=False)
    # Which host memory the plan assumes (--host-memory): every transfer above was timed
    # at its bandwidth (docs/compiler.md, "Pinned and pageable transfers").
    report.transfers = hw.describe_host_memory("--host-memory pageable")


def _longest_figures(report: PlanReport, args: argparse.Namespace, hw, compiled) -> None:
    """The longest sequence that fits (``--longest``, or the fit search unless
    ``--no-fit-search``), into ``report``."""
    plan, summary = compiled.plan, report.summary
    if args.longest:
        b = 1 if args.batch is None else plan.microbatch_size
        found = longest_sequence(compiled, hw, microbatch_size=b,
                                 ram=host_ram(args.host_ram, hw))
        summary["longest"] = _longest_summary(found, b)
        if found.plan is not None:
            report.longest_plan = str(found.plan)
            report.longest_peak_gib = max(found.plan.worker_peak_bytes) / 2**30
    elif not args.no_fit_search:
        found = longest_sequence(compiled, hw, ram=host_ram(args.host_ram, hw))
        summary["longest_seq"] = found.seq_len
        summary["longest_detail"] = _longest_summary(found, plan.microbatch_size)
    else:
        return
    report.longest_describe = found.describe()
    report.longest_host = found.host_line()


def _plan_quantized(args: argparse.Namespace, hw) -> QuantizedPlanReport:
    """``rpcompile plan --quantize nf4``: the paper model's unit profiles with its frozen base
    in NF4 (rpcompile.workloads.paper.PaperModel, ``base="nf4"``), planned, replayed by the
    simulator and proven; what ``benchmarks/qlora.py`` measures for one model and base."""
    from dataclasses import replace

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
    tokens = batch * args.seq
    peak = max(worker_peaks(run.schedule, plan), key=lambda p: p.peak_bytes)
    host = host_memory(plan, args.optimizer, run.peak_host_bytes, journal=hw.undo_journal,
                       pageable=hw.host_memory == "pageable")
    ram, source = host_ram(args.host_ram, hw)
    summary = {"model": args.model, "hardware": hw.name, "quantize": args.quantize,
               "lora": rank, "gpus": gpus, "optimizer": args.optimizer, "seq": args.seq,
               "batch": batch, "microbatches": micro, "rounds": rounds,
               "tokens_per_step": tokens, "stages": len(plan.stages),
               "steady_step_ms": steady_step_ms(run),
               "steady_tokens_per_s": tokens / (steady_step_ms(run) / 1e3),
               "proven_peak_device_gib": peak.peak_bytes / 2**30,
               "usable_gib": hw.usable_memory_bytes / 2**30, "host_gib": host.total / 2**30,
               "host_ram_gib": ram / 2**30, "host_ram_source": source}
    report = QuantizedPlanReport(
        summary=summary, plan=str(plan), proven_peak=peak.describe(plan.stage_name),
        host=host.describe(),
        host_warning=host_ram_problem(host, ram, source, ram_option="--host-ram",
                                      journal_option="--no-undo-journal", parts=False))
    if not args.no_fit_search:
        found = longest.longest_sequence(
            lambda s: model.units(1, s), hw, microbatch_size=1, start=args.seq, step=1024,
            limit=1 << 18, host_ram_bytes=ram, host_ram_source=source,
            options=replace(options, rounds=1))
        summary["longest_seq"] = found.seq_len
        report.longest = f"{found.describe()}; {found.host_line()}"
    return report


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


def _longest_summary(found, microbatch_size: int) -> dict:
    """summary.json's figures of a longest-sequence search (rpcompile.planner.longest)."""
    gpu = found.gpu or found
    return {"microbatch_size": microbatch_size, "seq_len": found.seq_len,
            "next_len": found.next_len, "limit": found.why, "limited_by": found.limit,
            "host_gib": None if found.host is None else found.host.total / 2**30,
            "host_ram_gib": found.host_ram / 2**30 or None,
            "gpu_seq_len": gpu.seq_len, "gpu_next_len": gpu.next_len, "gpu_limit": gpu.why,
            "gpu_host_gib": None if gpu.host is None else gpu.host.total / 2**30}

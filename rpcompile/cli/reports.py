"""What each command shows, as data: ``plan``, ``models`` and ``hardware`` each build a report
object (the figures it shows, and the texts the library's objects give beside them), and
:func:`_print_report` is the one place one is shown, as text or (``--json``) as the JSON object
its ``to_dict()`` gives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rpcompile.plan_policy import FILL_DRAIN_LIMIT, WorkerUse


@dataclass
class ModelsReport:
    """``rpcompile models``: the shipped model configs."""

    models: list[str]

    def lines(self) -> list[str]:
        return list(self.models)

    def to_dict(self) -> dict:
        return {"models": self.models}


@dataclass
class HardwareReport:
    """``rpcompile hardware``: per profile (name, GPUs, GPU, GiB, matmul TFLOP/s, pinned and
    pageable H2D/D2H GB/s (None: unknown), host RAM GiB (None: unknown)) and per link between
    servers (name, what it is, achieved share of its rate, latency per message)."""

    profiles: list[dict]
    links: list[dict]

    def lines(self) -> list[str]:
        out = []
        for p in self.profiles:
            ram = (f"host RAM {p['host_ram_gib']:g} GiB (assumed; --host-ram)"
                   if p["host_ram_gib"] else "host RAM unknown (this machine's is used)")
            pageable = (f"{p['pageable_h2d_gbps']:g}/{p['pageable_d2h_gbps']:g} GB/s "
                        "pageable"
                        if p["pageable_h2d_gbps"] and p["pageable_d2h_gbps"] else
                        "pageable unknown")
            out.append(f"{p['name']:<11} {p['gpus']} x {p['gpu']}, {p['memory_gib']:g} GiB, "
                       f"{p['matmul_tflops']:g} TFLOP/s, H2D/D2H {p['h2d_gbps']:g}/"
                       f"{p['d2h_gbps']:g} GB/s pinned, {pageable}, {ram}")
        for link in self.links:
            out.append(f"{link['name']:<11} link between servers (plan --nodes): "
                       f"{link['link']}, {100 * link['efficiency']:g}% achieved, "
                       f"{link['latency_us']:g} us per message")
        return out

    def to_dict(self) -> dict:
        return {"profiles": self.profiles, "links": self.links}


@dataclass
class PlanReport:
    """``rpcompile plan`` (RoundPipe or a weight-bound baseline). ``summary`` holds the
    figures: what ``--json`` prints and ``--out``'s summary.json holds (keys starting with
    ``_`` left out). The other fields are the texts the library's objects give beside them
    (the plan table, the capture, the planner's notes, memory breakdowns), None where the run
    has none, in the order they print."""

    summary: dict
    plan: str
    capture: str
    passes: list[tuple[str, float]]
    lowering: list[tuple[str, float]]
    microbatch_size: int
    memory_first: str | None = None
    scaling: str | None = None
    batch_choice: str | None = None
    workers: WorkerUse | None = None
    usable_gib: float = 0.0
    reserve_gib: float = 0.0
    memory_gib: float = 0.0
    proven_peak: str | None = None
    memory_waits: str | None = None
    search: str | None = None
    loss_head: str | None = None
    recompute: str | None = None
    host: str | None = None
    host_warning: str | None = None
    transfers: str | None = None
    longest_describe: str | None = None
    longest_host: str | None = None
    longest_plan: str | None = None
    longest_peak_gib: float | None = None
    written: Path | None = None

    def lines(self) -> list[str]:
        s = self.summary
        out = [self.plan, "", f"capture: {self.capture}",
               "passes: " + ", ".join(f"{n} {ms:.0f} ms" for n, ms in self.passes)
               + "; lowering: " + ", ".join(f"{n} {ms:.0f} ms" for n, ms in self.lowering)]
        if self.memory_first is not None:
            out.append(f"plan: the memory-first fallback (one unit per stage): "
                       f"{self.memory_first}")
        out.append(f"predicted, one isolated step: {s['makespan_ms']:.1f} ms, "
                   f"{s['tokens_per_s']:,.0f} tokens/s; bubble {s['bubble_pct']:.2f}% "
                   f"(fill {s['bubble_fill_pct']:.2f}%, steady {s['bubble_steady_pct']:.2f}%, "
                   f"drain {s['bubble_drain_pct']:.2f}%)")
        if "steady_step_ms" in s:
            out.append(f"predicted, steady state ({s['optimizer']}; the runtime's schedule, "
                       f"{s['schedule_steps']} steps overlapping as their edges let them): "
                       f"{s['steady_step_ms']:.1f} ms per step, "
                       f"{s['steady_tokens_per_s']:,.0f} tokens/s; bubble "
                       f"{s['steady_bubble_pct']:.2f}%")
        if self.scaling is not None:
            out.append(f"predicted, {self.scaling}")
        if self.batch_choice is not None:
            out.append(f"batch: {s['batch']} sequences ({s['batch_choice']['microbatch_size']} "
                       f"per microbatch), {self.batch_choice}")
        if self.workers is not None:
            out += self._worker_lines(self.workers)
        out.append(f"peak device memory: {max(s['peak_device_gib']):.2f} GiB simulated of "
                   f"{self.memory_gib:g} GiB ({self.usable_gib:.2f} GiB usable, "
                   f"{self.reserve_gib:g} GiB reserved for the CUDA context and allocator)")
        if self.proven_peak is None:  # a weight-bound baseline
            out.append(f"host memory {s['host_gib']:.1f} GiB")
        else:
            out.append(f"proven peak over the schedule: {self.proven_peak}")
            out.append(f"memory-bounding waits: {self.memory_waits}")
            out += [line for line in (self.search, self.loss_head, self.recompute)
                    if line is not None]
            out.append(f"host memory: {self.host}")
            if self.host_warning is not None:
                out.append(f"warning: {self.host_warning}")
            out.append(f"transfers: {self.transfers}")
        out += self._longest_lines()
        if self.written is not None:
            out.append(f"wrote {self.written}/schedule.csv, schedule.json (open in "
                       "ui.perfetto.dev), schedule.png, plan.txt, summary.json")
        return out

    def _longest_lines(self) -> list[str]:
        """The longest sequence that fits: ``--longest``'s search (with the memory-first plan
        proven at that length), or the fit search at the plan's microbatch."""
        s = self.summary
        if self.longest_describe is None:
            return []
        if "longest" not in s:
            return [f"longest sequence that fits the GPUs and the host RAM (microbatch of "
                    f"{self.microbatch_size}): {self.longest_describe}; {self.longest_host}"]
        found, b = s["longest"], s["longest"]["microbatch_size"]
        out = ["", f"longest sequence that fits the GPUs and the host RAM ({s['microbatches']} "
                   f"microbatches of {b} sequence{'s' if b > 1 else ''}, {s['gpus']} GPUs): "
                   f"{found['seq_len']:,} tokens"
                   + (f" (limit: {found['limited_by']})" if found["limited_by"] else ""),
               f"  {self.longest_describe}", f"  {self.longest_host}"]
        if self.longest_plan is not None:
            out += [self.longest_plan,
                    f"proven peak at {found['seq_len']:,} tokens: {self.longest_peak_gib:.2f} "
                    f"GiB of {self.usable_gib:.2f} GiB usable"]
        return out

    def _worker_lines(self, use: WorkerUse) -> list[str]:
        """The notes on idle workers, a batch too small for them, or the stage that paces the
        step (rpcompile.plan_policy.worker_use)."""
        s, out = self.summary, []
        gpus, jobs = use.gpus, use.jobs
        if jobs < gpus:
            out.append(f"idle workers: a step has {jobs} jobs for {gpus} workers, so "
                       f"{gpus - jobs} worker{'s get' if gpus - jobs > 1 else ' gets'} no job "
                       f"in each step (round robin gives each a job every "
                       f"{use.dispatch_period} steps)")
        if use.too_small:
            head = (f"batch too small for the workers: fill and drain are "
                    f"{100 * use.fill_drain:.1f}% of the step (over {FILL_DRAIN_LIMIT:.0%})")
            fills = use.microbatches_to_fill
            if fills is None:
                out.append(f"{head}, most of it the {gpus - min(jobs, gpus)} idle workers: "
                           "more microbatches do not give them a job; fewer --gpus would")
            else:
                how = ("the default rule stopped at this batch (see batch:)"
                       if self.batch_choice is not None
                       else "leave out --batch to let plan double it while tokens/s rises")
                out.append(f"{head}; with this plan's stage times about {fills} microbatches "
                           f"a round (--batch {fills * s['rounds'] * self.microbatch_size} "
                           f"--microbatches {fills}) would bring them under "
                           f"{FILL_DRAIN_LIMIT:.0%}; or {how}")
        slow = use.slowest
        if slow is not None:
            why = (f"; {slow.name} is one unit, which no cut divides" if slow.one_unit else
                   f"; cutting {slow.name} finer, where memory allows, lowers that bound")
            out.append(
                f"workers idle {100 * use.bubble:.1f}% of the step, "
                f"{s['bubble_steady_pct']:.1f}% of it in the steady part: a round's "
                f"microbatches pass the slowest stage, {slow.name} ({slow.units}: "
                f"{slow.ms_per_microbatch:.2f} ms a microbatch, the median stage "
                f"{slow.median_ms_per_microbatch:.2f}), one after another on one worker, and "
                f"the stages after it go at its pace, so a round takes at least "
                f"{slow.before_ms:,.0f} + {s['microbatches']} x {slow.ms_per_microbatch:.2f} "
                f"+ {slow.after_ms:,.0f} = {slow.bound_ms:,.0f} ms of the step's "
                f"{s['makespan_ms']:,.1f} (stage times alone){why}")
        return out

    def to_dict(self) -> dict:
        return {k: v for k, v in self.summary.items() if not k.startswith("_")}


@dataclass
class QuantizedPlanReport:
    """``rpcompile plan --quantize``: the paper model's unit profiles with a quantized base,
    planned, replayed and proven. ``summary`` holds the figures (``--json``); the texts beside
    them are the plan table, the proven peak, the host memory and the longest sequence's, as
    the library's objects give them."""

    summary: dict
    plan: str
    proven_peak: str
    host: str
    host_warning: str | None = None
    longest: str | None = None

    def lines(self) -> list[str]:
        s = self.summary
        out = [self.plan, "",
               f"predicted, steady state ({s['optimizer']}): {s['steady_step_ms']:.1f} ms per "
               f"step, {s['steady_tokens_per_s']:,.0f} tokens/s",
               f"proven peak over the schedule: {self.proven_peak}; "
               f"{s['usable_gib']:.2f} GiB usable",
               f"host memory: {self.host}; {s['host_ram_gib']:.2f} GiB RAM "
               f"({s['host_ram_source']})"]
        if self.host_warning is not None:
            out.append(f"warning: {self.host_warning}")
        if self.longest is not None:
            out.append(f"longest sequence that fits the GPUs and the host RAM (microbatch of 1 "
                       f"sequence, {s['microbatches']} microbatches): {self.longest}")
        return out

    def to_dict(self) -> dict:
        return dict(self.summary)


def _print_report(report, as_json: bool = False) -> None:
    """The one place a command's report is shown: its text, or (``--json``) its object."""
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print("\n".join(report.lines()))

"""What ``rpcompile train`` measures and writes: the eval loss, metrics.jsonl and the
``--report-to`` reporters, the simulator's predicted step time, and at the end summary.json,
loss.png and the schedule files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rpcompile.compiler import Compiled


class _Log:
    """metrics.jsonl (one JSON object per line) and the ``--report-to`` reporters, from
    ``start`` on: lines of a resumed run's later steps (written before it was stopped) are
    dropped first."""

    def __init__(self, out: Path, start: int, report_to: str, config: dict[str, Any]) -> None:
        from rpcompile.loggers import open_reporters, parse_report_to

        self.path = out / "metrics.jsonl"
        kept = []
        if start and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.records = [json.loads(line) for line in kept]
        self.reporters = open_reporters(parse_report_to(report_to), out, config, start)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        metrics = {k: v for k, v in record.items() if k != "step" and v is not None}
        for reporter in self.reporters:
            reporter.log(metrics, record["step"])

    def summary(self, metrics: dict[str, Any]) -> None:
        for reporter in self.reporters:
            reporter.summary({k: v for k, v in metrics.items() if v is not None})

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()
        self.reporters = []


def _evaluate(compiled: Compiled, batches: list[dict[str, Any]],
              masters: dict[str, Any] | None = None) -> float | None:
    """Token-weighted mean loss over the eval batches (each batch's loss is its token mean);
    ``masters``: the weights to evaluate (sharded: gathered from every rank)."""
    from rpcompile.data import IGNORE_INDEX

    total = count = 0.0
    for batch in batches:
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        if n:
            total += float(compiled.evaluate(batch, masters=masters)) * n
            count += n
    return total / count if count else None


def _predicted_step_seconds(compiled: Compiled) -> float | None:
    """The simulator's time per step of the schedule the workers run, on the compile's
    hardware profile (None when a multi-rank schedule has no link to time its reductions)."""
    from rpcompile.sim import simulate

    sched = compiled.trainer().schedule
    if sched.ranks > 1 and compiled.hardware.link is None:
        return None
    return simulate(sched, compiled.plan, compiled.hardware).makespan_ms / sched.steps / 1e3


def _write_report(out: Path, records: list[dict[str, Any]], opts: dict[str, Any],
                  elapsed: float, tokens_per_s: float, compiled: Compiled, sched: Any,
                  mfu: dict[str, float | None]) -> dict[str, Any]:
    """Write summary.json, loss.png and the schedule files; returns the summary."""
    from rpcompile.loggers import parse_report_to
    from rpcompile.sim import simulate

    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    values = [v for _, v in losses]
    # The first and last n steps, n up to 10 and never overlapping (one step: its loss).
    n = max(1, min(10, len(values) // 2))
    first = sum(values[:n]) / max(1, len(values[:n]))
    last = sum(values[-n:]) / max(1, len(values[-n:]))
    summary = {"model": opts["model"], "data": opts["data"], "steps": len(values),
               "seconds": elapsed, "tokens_per_s": tokens_per_s,
               "loss_first": first, "loss_last": last, "loss_steps_averaged": n,
               "eval_loss_first": evals[0][1] if evals else None,
               "eval_loss_last": evals[-1][1] if evals else None,
               "hardware": compiled.hardware.name, **mfu}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_loss(losses, evals, out / "loss.png")
    sched.dump(out / "schedule.csv")
    wrote = "schedule.csv/.json/.png"
    if sched.ranks > 1 and compiled.hardware.link is None:
        # Its REDUCE actions have no link to be timed on: the timeline is left out, not
        # simulated on a made-up network.
        wrote = "schedule.csv"
        print(f"train: schedule.json/.png not written: the schedule reduces across "
              f"{sched.ranks} ranks and the hardware profile {compiled.hardware.name!r} has no "
              "inter-server link to time them on (give the profile a link, e.g. "
              "Hardware.with_link('eth100'), to simulate it)")
    else:
        sim = simulate(sched, compiled.plan, compiled.hardware)
        for ext in ("json", "png"):
            sim.dump(out / f"schedule.{ext}")
    eval_text = (f", eval loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f}" if evals else "")
    print(f"train: {len(values)} steps in {elapsed:.1f}s with eval and saving "
          f"({tokens_per_s:,.0f} tokens/s in the steps), loss {first:.3f} -> {last:.3f} "
          + ("(one step)" if len(values) < 2 else "(first/last step)" if n == 1
             else f"(mean of first/last {n} steps)")
          + f"{eval_text}; wrote {out}/final/ (from_pretrained), metrics.jsonl, loss.png, "
          f"summary.json, config.yaml, {wrote}"
          + "".join(f", {name}" for name in parse_report_to(opts["report_to"])))
    return summary


def plot_loss(losses: list[tuple[int, float]], evals: list[tuple[int, float]], path: Path) -> None:
    """Training loss per step, and the eval loss where it was measured."""
    from rpcompile.viz import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if losses:
        ax.plot(*zip(*losses), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("rpcompile train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

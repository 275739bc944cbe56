"""Render ``benchmarks/results/*.json`` into ``docs/results.md`` and README.md's figures table.

Every figure in those two places comes from a result file a benchmark wrote
(``benchmarks/_results.py``: ``{"stamp", "figures"}``; a script that writes its figures bare
is rendered too, marked as unstamped). One section per benchmark script, one table per result
file, and the script's chart beside it (``<name>.png``) where it draws one; a file whose script
has no renderer here gets its top-level values listed. README.md's
table lives between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` and is rewritten
in place.

    python benchmarks/report.py            # rewrite docs/results.md and README.md's table
    python benchmarks/report.py --check    # exit 1 if either differs from what it would write

Reading the figures needs nothing heavy: no torch, no rpcompile import (the paper's reference
figures are read from the files that hold them, as literals).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"


# ---------------------------------------------------------------- reading


@dataclass
class Result:
    path: Path
    script: str  # the script's stem, e.g. "longest_sequence"
    stamp: dict[str, Any] | None
    figures: Any

    @property
    def command(self) -> str | None:
        """The command line that made the figures, less where it wrote them (``--json`` and
        ``--png`` paths: the figures are in this file); None when it carries no stamp."""
        if not self.stamp:
            return None
        words, shown = self.stamp["command"].split(), []
        for i, word in enumerate(words):
            if word in ("--json", "--png") or (i and words[i - 1] in ("--json", "--png")):
                continue
            shown.append(word)
        return " ".join(shown)


def _literal(path: Path, name: str) -> Any:
    """The value of the module-level assignment ``name = <literal>`` in ``path``."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise KeyError(f"{path}: no literal {name}")


def load(results: Path = RESULTS) -> list[Result]:
    """Every result file, its script found from its stamp, else from its name."""
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and set(data) == {"stamp", "figures"}:
            stamp, figures = data["stamp"], data["figures"]
            script = Path(stamp["script"]).stem
        else:
            stamp, figures = None, data
            script = _script_of(path.stem)
        out.append(Result(path, script, stamp, figures))
    return out


def _script_of(stem: str) -> str:
    """The script that writes ``<stem>.json`` when the file carries no stamp: the longest
    script name the stem starts with (``paper_throughput_pageable`` -> ``paper_throughput``)."""
    aliases = {"kernels": "transfer_kernels"}
    if stem in aliases:
        return aliases[stem]
    known = sorted((p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_")),
                   key=len, reverse=True)
    return next((s for s in known if stem == s or stem.startswith(s + "_")), stem)


# ---------------------------------------------------------------- formatting


def num(value: Any, digits: int = 1, *, pct: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" + (" %" if pct else "")
    return str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine(stamp: dict[str, Any]) -> str:
    m = stamp["machine"]
    gpus = ", ".join(m["gpus"]) if m["gpus"] else "no GPU"
    return (f"{m['cpu']}, {m['cores']} cores, {num(m['memory_gib'])} GiB, {gpus}; "
            f"torch {m['torch']}")


def provenance(r: Result) -> str:
    """Where the figures come from: the command, the commit and the machine of the stamp."""
    if r.stamp is None:
        return (f"Unstamped: made by `benchmarks/{r.script}.py`, which writes its figures "
                "without a stamp, so its options, the commit and the machine are not "
                "recorded.")
    s = r.stamp
    code = (" with uncommitted code changes" if s.get("code_changed")
            else "" if s.get("code_changed") is False else " (code state unknown)")
    commit = f"`{s['commit'][:12]}`{code}" if s.get("commit") else "an unknown commit"
    return f"`{r.command}`\n\nCommit {commit}; {machine(s)}; {num(s['seconds'], 0)} s."


# ---------------------------------------------------------------- renderers


@dataclass
class Section:
    title: str
    what: str
    render: Callable[[Result], str]
    notes: list[str] = field(default_factory=list)


def _compile_time(r: Result) -> str:
    f = r.figures
    rows = []
    refused = []
    for name, m in f["models"].items():
        if "refused" in m:
            refused.append(f"{name} at its paper shape: {m['refused']}")
            continue
        cold, shape = m["cold"], m["shape"]
        p = cold["passes_s"]
        ref = m.get("reference") or {}
        gap = "proven" if cold["gap_pct"] is None else f"<= {num(cold['gap_pct'], 2)} %"
        rows.append([name, f"{shape['global_batch']} x {shape['seq_len']}",
                     num(p.get("capture")), num(p.get("cost")), num(p.get("partition")),
                     f"{num(cold['seconds'])} ({num(cold['cpu_seconds'])})",
                     num(m["cached"]["seconds"]), num(cold["replays"]), gap,
                     num(cold["tokens_per_s"], 0), num(ref.get("tokens_per_s"), 0),
                     num(100 * m["of_reference"], 2) if m.get("of_reference") else "-",
                     f"{num(ref.get('replays'))}, {num(ref.get('seconds'), 0)} s" if ref else "-"])
    effort = next(iter(f["models"].values()))["effort"]
    made = sorted({m["reference"]["commit"][:12] for m in f["models"].values()
                   if (m.get("reference") or {}).get("commit")})
    return (table(["model", "step (sequences x tokens)", "capture s", "cost s", "partition s",
                   "cold s (CPU s)", "cached s", "replays", "proven gap", "tokens/s",
                   "exhaustive search's tokens/s", "% of it", "its replays, seconds"], rows)
            + f"\n\nSearch effort `{effort}`; the exhaustive search runs until its plan is "
            "proven the simulator's fastest of its candidates. Cold: a fresh plan cache; "
            "cached: the same compile again, the search skipped. Peak resident memory of the "
            f"run: {num(f['max_rss_gib'], 2)} GiB."
            + (f" The exhaustive searches ran at commit {', '.join(f'`{c}`' for c in made)}."
               if made else "")
            + "".join(f"\n\nNot compiled: {r}" for r in refused))


PAPER_ORDER = ("qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b")
BUBBLE_ROWS = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B, v per GPU below",
    "looped-bfs": "looped BFS, same v", "roundpipe-sync": "RoundPipe, ours, one sync step",
    "roundpipe-async": "RoundPipe, ours, async steady state",
    "roundpipe-async-host-busy": "its host update queue busy, % of the window",
}


def _paper_reference() -> dict[str, tuple[float, ...]]:
    return _literal(HERE / "paper_bubbles.py", "REFERENCE")


def _paper_bubbles(r: Result) -> str:
    f = r.figures
    models = [m for m in PAPER_ORDER if any(m in v for v in f.values() if isinstance(v, dict))]
    ref = _paper_reference()
    rows = []
    for key, label in BUBBLE_ROWS.items():
        if key not in f:
            continue
        rows.append([label, *[num(f[key].get(m), 2) for m in models]])
        if key in ref:
            rows.append([f"{label}, the paper's simulator",
                         *[num(ref[key][PAPER_ORDER.index(m)], 2) for m in models]])
    if "virtual-stages-per-gpu" in f:
        rows.append(["v (stages per GPU) of the interleaved rows",
                     *[num(f["virtual-stages-per-gpu"].get(m)) for m in models]])
        rows.append(["the artifact's ideal (p - 1) / (v m + p - 1)",
                     *[num(f["artifact-ideal-interleaved"].get(m), 2) for m in models]])
    out = table(["bubble %", *models], rows)
    own = f.get("roundpipe-own-plan-qwen3-1.7b")
    if own:
        artifact = _literal(ROOT / "rpcompile" / "workloads" / "paper.py",
                            "ROUNDPIPE_QWEN3_1_7B_BUBBLES")
        keys = list(own)
        out += ("\n\nRoundPipe's own Qwen3-1.7B partition, bubble % (sync: one isolated step "
                "and its fill, drain and steady parts; async: the steady state):\n\n"
                + table(["", *keys], [["ours", *[num(own[k], 2) for k in keys]],
                                       ["the artifact's simulator",
                                        *[num(artifact.get(k), 2) for k in keys]]]))
    return out


def _paper_throughput(r: Result) -> str:
    f = r.figures
    models = [m for m in PAPER_ORDER if m in f]
    configs = ["rpcompile", "roundpipe-partition", "1f1b", "gpipe"]
    rows = []
    for m in models:
        row = f[m]
        gain = (row["rpcompile"] / row["roundpipe-partition"]
                if row.get("rpcompile") and row.get("roundpipe-partition") else None)
        host = f.get("host-gib", {}).get(m, {})
        over = set(f.get("over-host-ram", {}).get(m, ()))
        rows.append([m, *[num(row.get(c), 0) for c in configs], num(gain, 3) + "x",
                     *[num(host.get(c)) + (" (over)" if c in over else "")
                       for c in ("rpcompile", "roundpipe-partition")]])
    link = f.get("link-gbps", {})
    ratios, measured = f.get("ratios", {}), f.get("roundpipe-measured-async-over-sync", {})
    keys = [f"{c} async/sync {how}" for c in ("rpcompile", "roundpipe-partition")
            for how in ("deferred", "isolated", "stream")]
    ratio_rows = [[m, *[num(ratios[m].get(k), 3) for k in keys], num(measured.get(m), 2)]
                  for m in models if all(k in ratios.get(m, {}) for k in keys)]
    ratio_table = "" if not ratio_rows else (
        "\n\nAsync / sync throughput of the same async plan, over one isolated sync step with "
        "every update after the step's last gradient (deferred: RoundPipe's sync mode, like "
        "for like with its measured ratio but for its sync runs' retuned accumulation "
        "counts), over one isolated sync step in rpcompile's update order (isolated), and over "
        "sync steps in a stream (stream: rpcompile's sync mode):\n\n"
        + table(["model", "ours, deferred", "ours, isolated", "ours, stream",
                 "RoundPipe's partition, deferred", "RoundPipe's partition, isolated",
                 "RoundPipe's partition, stream", "RoundPipe measured (4090s)"], ratio_rows))
    floors = f.get("floor", {})
    floor_rows = [[m, num(floors[m]["step_ms"]), floors[m]["tail_units"], floors[m]["limit"],
                   num(floors[m]["roundpipe-partition"], 3) + "x",
                   num(floors[m]["rpcompile"], 3) + "x"] for m in models if m in floors]
    if floor_rows:
        ratio_table += (
            "\n\nFloor: a lower bound on the long-run async step of every plan of the "
            "workload's units (`rpcompile.planner.partition.async_step_floor`), set by the "
            "workers (one "
            "step's compute over them) or the chain (a step waits for the update two steps "
            "before). A plan's step over the floor's is the most any partition could gain "
            "over it:\n\n"
            + table(["model", "floor ms", "tail units", "set by",
                     "RoundPipe's partition / floor", "ours / floor"], floor_rows))
    return (table(["model", "ours tokens/s", "RoundPipe's partition", "1F1B", "GPipe",
                   "ours / RoundPipe's", "host GiB, ours", "host GiB, RoundPipe's"], rows)
            + f"\n\nHost memory: {f.get('host-memory', 'pinned')}, links "
            f"{num(link.get('h2d'))} / {num(link.get('d2h'))} GB/s (H2D / D2H); host RAM "
            f"{num(f.get('host-ram-gib'))} GiB ({f.get('host-ram-source', '?')}); "
            "\"over\": the plan needs more host memory than that. A weight-bound baseline "
            "whose weights, gradients and activations do not fit the GPUs shows \"-\"."
            + ratio_table)


def _longest_sequence(r: Result) -> str:
    f = r.figures
    models = [m for m in PAPER_ORDER if m in f]
    rows = []
    for m in models:
        row = f[m]
        for tail in ("unchunked", "chunked"):
            g = row[tail]
            gpu = "" if g["gpu_longest"] == g["longest"] else num(g["gpu_longest"])
            rows.append([m, "whole logits" if tail == "unchunked" else "4,096-token chunks",
                         num(g["longest"]) if g["longest"] else "none",
                         g["limited_by"] or "-", num(g["peak_gib"], 2),
                         num(g["host_gib"]), gpu or "same", num(g["gpu_host_gib"]),
                         num(g["seconds"])])
    hosts = [[m, num(f[m]["host"]["total_gib"]), num(f[m]["host"]["pinned_gib"]),
              num(f[m]["host"]["microbatches"])] for m in models]
    settings = (f"Host RAM {num(f['host_ram_gib'], 2)} GiB, {f['host_memory']} host memory, "
                f"{f['optimizer']} updates, undo journal "
                f"{'on' if f['undo_journal'] else 'off'}, microbatches per round: "
                f"{'each workload' + chr(39) + 's own' if f['microbatches'] is None else f['microbatches']}.")
    return (settings + "\n\n"
            + table(["model", "LM head + loss", "longest tokens", "limit", "proven peak GiB",
                     "host GiB there", "GPUs alone", "host GiB at the GPUs' length", "s"], rows)
            + "\n\nHost memory of each workload's own setup (2,048-token sequences, its "
            "batch; RoundPipe's greedy plan):\n\n"
            + table(["model", "host GiB", "of it pinned", "microbatches"], hosts))


def _scaling(r: Result) -> str:
    f = r.figures
    rows = []
    for m in PAPER_ORDER:
        for variant, links in f.get(m, {}).items():
            one = next(iter(next(iter(links.values())).values()))
            cells = [m, variant, num(one["one_server_tokens_per_s"], 0)]
            heads = []
            for link, by_n in links.items():
                for n, s in by_n.items():
                    if n == "1":
                        continue
                    heads.append(f"{n} x {link}")
                    cells.append(f"{num(s['tokens_per_s'], 0)} ({num(100 * s['efficiency'])} %)")
            rows.append(cells)
    return table(["model", "optimizer", "1 server tokens/s", *heads], rows)


def _ranking_model(r: Result) -> str:
    rows = [[x["model"], x["mode"], num(x["candidates"]), num(x["simulations"]),
             "yes" if x["proven_optimal"] else f"no, gap <= {num(x['gap_at_most_pct'], 2)} %",
             num(x["chosen_ms"]), num(x["partition_s"]),
             "-" if not x["simulated_over_bound"]
             else "-".join(f"{v:.3f}" for v in x["simulated_over_bound"])]
            for x in r.figures]
    return table(["model", "mode", "candidates", "replayed", "proven fastest", "chosen ms",
                  "search s", "simulated / bound"], rows)


def _memory_waits(r: Result) -> str:
    rows = []
    for m in r.figures:
        free = m["sets"][0]["step_ms"]
        for s in m["sets"]:
            rows.append([m["model"], s["waits"], num(s["step_ms"]),
                         f"{100 * (s['step_ms'] / free - 1):+.2f} %", num(s["proven_gib"], 2),
                         num(s["simulated_gib"], 2),
                         f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}"])
    return table(["model", "waits", "sync step ms", "vs no wait", "proven peak GiB",
                  "simulated peak GiB", "simulated / proven per worker"], rows)


def _memory_agreement(r: Result) -> str:
    f = r.figures
    rows = [[x["arch"], x["gpus"], x["microbatches"], x["worker"],
             "+".join(x["memory_waits"]) or "none", num(x["peak"]),
             f"{x['simulated'] / x['peak']:.3f}", num(x["held"]),
             f"{x['measured_min'] / x['held']:.3f}-{x['measured_max'] / x['held']:.3f}"]
            for x in f["rows"]]
    out = (f"{f['runs']} runs per case (half with chaos delays), {f['steps']} steps each.\n\n"
           + table(["model", "workers", "microbatches", "worker", "waits", "proven peak B",
                    "simulated / proven", "proven held B", "measured / held"], rows))
    if f.get("host"):
        hosts = [[h["arch"], h["gpus"], h["microbatches"], num(h["staging_figure"]),
                  f"{min(h['staging_held']) / h['staging_figure']:.3f}-"
                  f"{max(h['staging_held']) / h['staging_figure']:.3f}",
                  f"{max(h['staging_lent']) / h['staging_figure']:.3f}"
                  if h.get("staging_lent") else "-"] for h in f["host"]]
        out += ("\n\nHost transfer staging, the pool's bytes against the plan's figure (the sum "
                "of the schedule's staging slots, proven for every timing):\n\n"
                + table(["model", "workers", "microbatches", "figure B", "held / figure",
                         "most lent at once / figure"], hosts))
    return out


def _undo_journal(r: Result) -> str:
    f = r.figures
    keys = [("sync_step_ms", "sync step ms", 1), ("sync_tokens_per_s", "sync tokens/s", 0),
            ("sync_opt_busy_ms", "OPT busy ms, sync step", 1),
            ("async_step_ms", "async steady step ms", 1),
            ("async_tokens_per_s", "async tokens/s", 0),
            ("async_opt_busy_ms", "OPT busy ms, async step", 1),
            ("host_sync_gib", "host GiB, sync", 1), ("host_async_gib", "host GiB, async", 1),
            ("journal_gib", "of it the journal", 1)]
    rows = [[label, num(f["on"][k], d), num(f["off"][k], d)] for k, label, d in keys]
    return (f"{f['model']} on {f['hardware']}, RoundPipe's greedy plan ({f['stages']} stages), "
            f"{num(f['trainable_params'])} trainable parameters.\n\n"
            + table(["", "journal on", "journal off"], rows))


def _runtime_overhead(r: Result) -> str:
    f = r.figures
    c = f["config"]
    rows = [[k, num(v)] for k, v in f["median_step_ms"].items()]
    return (f"Qwen3, hidden {c['hidden']}, {c['layers']} layers, batch {c['batch']} x "
            f"{c['seq']}, {c['microbatches']} microbatches, {c['steps']} timed steps, "
            f"{f['torch_threads']} torch threads.\n\n"
            + table(["median step", "ms"], rows)
            + f"\n\nruntime / eager with recompute: {f['ratio_runtime_over_eager_ckpt']:.3f}; "
            f"reference / eager: {f['ratio_reference_over_eager_ckpt']:.3f}; executor "
            f"{num(f['executor_us_per_action'], 0)} us per action over "
            f"{f['actions_per_step']} actions a step.")


def _sync_updates(r: Result) -> str:
    f = r.figures
    rows = [[o, num(f["step_ms"][o]), num(f["journal_bytes_at_commit"][o] / 2**20, 2),
             num(f["journal_save_ms"][o], 2), num(f["simulated_step_ms"][o], 2)]
            for o in f["step_ms"]]
    return (f"{f['model']}, {f['workers']} virtual workers, {f['microbatches']} microbatches, "
            f"{f['stages']} stages, {f['steps_timed']} timed steps.\n\n"
            + table(["order", "step ms (median)", "journal MiB", "journal save ms",
                     f"simulated ms ({f['simulated_hardware']})"], rows)
            + f"\n\noverlap / deferred: measured {f['ratio_overlap_over_deferred']:.3f}, "
            f"simulated {f['simulated_ratio']:.3f}.")


def _async_updates(r: Result) -> str:
    f = r.figures
    sim = f["simulated_steady_step_ms"]
    modes = list(f["steady_step_ms"])
    rows = [[m, num(f["steady_step_ms"][m]), num(sim["predicted"][m]),
             num(f["predicted_over_measured"][m], 3), num(sim["probe cores"][m]),
             num(sim["compute only"][m]), num(sim["probed"][m]), num(sim["unshared"][m]),
             num(sim["cpu profile"][m]), num(f["step_cpu_ms"][m]), num(f["model_cpu_ms"][m]),
             num(f["cores_used"][m], 2),
             num(f["cores_used_by_other_processes"][m], 2), num(f["alone_step_ms"][m]),
             num(f["host_bytes_per_trainable_param"][m]["total"], 2)]
            for m in modes]
    serial = f["serial_compute_ms"]
    cal = f["calibration"]
    ratios = f["simulated_ratio"]
    return (f"{f['model']}, {f['workers']} virtual workers ({f['intra_op_threads']} intra-op "
            f"thread each) on {f['shared_cores']} shared cores, {f['microbatches']} "
            f"microbatches, {f['stages']} stages, {f['steps_timed']} steps in one stream.\n\n"
            "Predicted: the probed profile calibrated on this machine. Compute times from the "
            f"plan's stage programs run by {f['workers']} threads at once just before each "
            "mode's steps: " + ", ".join(
                f"{m} {num(serial['threaded_cpu'][m])} ms of CPU per step in "
                f"{num(serial['threaded_wall'][m])} ms, {num(cal['cores_busy'][m], 2)} cores "
                "busy" for m in modes)
            + " (the prediction's shared cores; "
            f"{num(serial['measured_cpu'])} ms of CPU run serially, "
            f"{num(serial['plan_on_cpu_profile'])} ms on the `cpu` profile). Copy rates and "
            f"CPU per action from a run of {cal['steps']} sync steps of {cal['model']}: "
            f"{num(cal['h2d_gbps'], 2)} GB/s up and {num(cal['d2h_gbps'], 2)} GB/s down per "
            f"CPU second (the probe's warm copies {num(cal['probe_h2d_gbps'], 2)} / "
            f"{num(cal['probe_d2h_gbps'], 2)}), {num(cal['action_overhead_us'])} us per compute "
            "and host action. Probe cores: the same on the probe's cores. Compute only: the "
            "calibrated compute times on the probe alone. Probed: compute at the probe's "
            "matmul rate. Unshared: the calibrated times with a device per worker. CPU ms: the "
            "process's CPU time per steady step; predicted core ms: the core time the "
            "prediction keeps busy per steady step (the work it accounts for); cores busy: "
            "the process's CPU time over the wall time; others: the cores other processes kept "
            "busy meanwhile.\n\n"
            + table(["mode", "steady step ms (stream median)", "predicted ms",
                     "predicted / measured", "probe cores ms", "compute only ms", "probed ms",
                     "unshared ms", "`cpu` profile ms", "CPU ms / step",
                     "predicted core ms / step", "cores busy",
                     "others", "one step alone ms", "host bytes / parameter"], rows)
            + f"\n\nasync / sync: measured {f['ratio_async_over_sync']:.3f}, predicted "
            f"{ratios['predicted']:.3f} (probe cores {ratios['probe cores']:.3f}, compute only "
            f"{ratios['compute only']:.3f}, probed {ratios['probed']:.3f}, unshared "
            f"{ratios['unshared']:.3f}, `cpu` profile {ratios['cpu profile']:.3f}).")


def _async_barrier(r: Result) -> str:
    ceilings = r.figures.get("ceiling", {})
    rows = [[m, label, num(x["async_step_ms"]), num(x["async_bubble_pct"], 2),
             num(x["bound_bubble_pct"], 2) if "bound_bubble_pct" in x else "",
             num(x["sync_step_ms"]), num(x["sync_bubble_pct"], 2),
             num(x["sync_gaps_pct"], 2) if "sync_gaps_pct" in x else "",
             num(x["sync_step_ms"] / x["async_step_ms"], 3)]
            for m, plans in r.figures.items() if m != "ceiling" for label, x in plans.items()]
    out = table(["model", "plan", "async steady step ms", "async bubble %",
                 "bound for the plan %", "sync step ms", "sync bubble %", "sync gaps %",
                 "async / sync"], rows)
    if ceilings:
        out += ("\n\nCeiling: a lower bound on the async step of every plan of the model's "
                "blocks whose tail fits the GPU (`rpcompile.planner.partition.async_step_floor`: a "
                "step's compute over the workers, and two steps per chain of one step's jobs, "
                "since a step uploads the shadow of the update two steps before).\n\n"
                + table(["model", "ceiling ms", "tail units", "greedy / ceiling"],
                        [[m, num(c["step_ms"]), c["tail_units"],
                          num(c["greedy_over_ceiling"], 3)] for m, c in ceilings.items()]))
    return out


def _soak(r: Result) -> str:
    f = r.figures
    return table(["runs", "steps", "faults armed", "fired", "survived", "divergences", "s"],
                 [[f["runs"], f["steps"], f["faults_injected"], f["faults_fired"],
                   f["faults_survived"], len(f["divergences"]), num(f["seconds"], 0)]])


def _compile_cycles(r: Result) -> str:
    f = r.figures
    return table(["cycles", "threads at start", "threads at end", "RSS start MB", "RSS end MB",
                  "RSS growth MB per cycle (slope)"],
                 [[f["cycles"], f["threads_at_start"], f["threads_at_end"],
                   num(f["rss_start_mb"]), num(f["rss_end_mb"]),
                   num(f["rss_growth_mb_per_cycle"], 3)]])


def _sharded_memory(r: Result) -> str:
    rows = [[x["ranks"], "sharded" if x["sharded"] else "replicated", x["rank"],
             f"{x['owned_params'] / x['trainable_params']:.3f}", num(x["master"], 2),
             num(x["optimizer"], 2), num(x["shadow"], 2), num(x["grad"], 2),
             num(x["master"] + x["optimizer"] + x["shadow"] + x["grad"], 2),
             num(x["report_total"], 2)] for x in r.figures["rows"]]
    return ("Bytes per trainable parameter held by each rank, measured from its tensors; "
            f"{num(r.figures['rows'][0]['trainable_params'])} trainable parameters.\n\n"
            + table(["ranks", "state", "rank", "owned share", "master", "optimizer", "shadow",
                     "grad", "total", "memory report"], rows))


def _dp_checkpoint_bytes(r: Result) -> str:
    f = r.figures
    rows = [[x["rank"], num(x["save_peak_bytes"]), num(x["bytes_per_param"], 2)]
            for x in f["ranks"]]
    return (f"Qwen3, hidden {f['hidden']}, {f['layers']} layers, "
            f"{num(f['ranks'][0]['trainable_params'])} trainable parameters, 2 ranks.\n\n"
            + table(["rank", "peak bytes during the save", "per trainable parameter"], rows))


def _transfer_kernels(r: Result) -> str:
    f = r.figures
    rows = [[m["kernel"], m["backend"], num(m["median_ms"], 3), f"{m['gbps']:.3g}",
             f"{100 * m['fraction_of_copy']:.2f} %"] for m in f["results"]]
    note = ("" if f["mode"] == "cuda" else
            "On the CPU the Triton kernels run in Triton's interpreter: these figures show "
            "that they run, not how fast they are on a GPU.\n\n")
    return (note + f"{f['device']}, {num(f['elements'])} elements, plain copy "
            f"{num(f['copy_gbps'])} GB/s.\n\n"
            + table(["kernel", "backend", "ms", "GB/s", "of a copy"], rows))


def _qlora_limit(found: dict[str, Any] | None) -> str:
    """What stops the longest-sequence search, in a few words (the JSON has the whole reason)."""
    if found is None:
        return "-"
    why = found["limit"]
    what = ("host RAM" if "host RAM" in why else "device memory" if "usable" in why
            else why.split(":")[1].strip() if ":" in why else why)
    return what if found["longest"] else f"{what}, at any length"


def _qlora_search(note: str) -> str:
    """The partition search's end: proven fastest, or the most a candidate left could gain."""
    if not note or "NOT proven" not in note:
        return "fastest, proven"
    gap = re.search(r"at most ([\d.]+ ?%)", note)
    return f"capped, within {gap.group(1)}" if gap else "capped"


def _qlora(r: Result) -> str:
    f = r.figures
    rows = []
    for name, bases in f["models"].items():
        for base, x in bases.items():
            found = x.get("longest")
            rows.append([
                name, base,
                f"{num(x['host_gib'])}" + ("" if x["host_fits"] else " (over the RAM)"),
                num(x["tokens_per_s"]), f"{num(x['proven_gib'], 2)} of {num(x['usable_gib'], 2)}",
                num(x["upload_gib_per_step"]), x["stages"], _qlora_search(x["search"]),
                "-" if found is None else num(found["longest"]) if found["longest"] else "none",
                _qlora_limit(found)])
    return (f"{f['hardware']}, LoRA r={f['lora_rank']}, host RAM {num(f['host_ram_gib'])} GiB; "
            f"partition search capped at {f['max_simulations']} replays, refine "
            f"{f['refine']}. The JSON holds each plan's host memory by part and the whole "
            "reason each longest-sequence search stopped.\n\n"
            + table(["model", "base", "host GiB", "tokens/s", "proven GiB per GPU",
                     "uploads GiB/step", "stages", "search", "longest sequence", "limited by"],
                    rows))


def _generic(r: Result) -> str:
    f = r.figures
    if isinstance(f, dict):
        rows = [[k, num(v, 3) if isinstance(v, (int, float)) else f"`{json.dumps(v)[:80]}`"]
                for k, v in f.items()]
        return table(["key", "value"], rows)
    return f"`{json.dumps(f)[:200]}`"


SECTIONS: dict[str, Section] = {
    "compile_time": Section(
        "Compile time", "The paper workloads built on the `meta` device and compiled for 8x "
        "RTX 4090 at their shapes: seconds (wall, and CPU), the partition search's replays and "
        "proven gap, and the plan's predicted tokens/s against an exhaustive search's.",
        _compile_time),
    "paper_bubbles": Section(
        "Bubbles of the paper's schedules", "Bubble (idle / (makespan x GPUs)) of each "
        "schedule for the paper's five models on 8 GPUs, 16 microbatches of 4 x 2,048 tokens, "
        "the paper's per-layer times.", _paper_bubbles),
    "paper_throughput": Section(
        "Throughput of the paper workloads", "Predicted tokens/s of the five paper workloads "
        "on the rtx4090x8 profile (async steady state), our partition against RoundPipe's "
        "greedy one and the weight-bound baselines, with each RoundPipe plan's host memory.",
        _paper_throughput),
    "longest_sequence": Section(
        "Longest sequence that fits", "Per paper model on 8x RTX 4090, one sequence per "
        "microbatch: the longest sequence whose whole schedule is proven to fit the GPUs and "
        "whose host memory fits the RAM, and what limits it.", _longest_sequence),
    "scaling": Section(
        "Data-parallel scaling", "Predicted tokens/s of N rtx4090x8 servers joined by "
        "Ethernet (scaling efficiency in brackets), simulating the schedule lowered for N "
        "ranks.", _scaling),
    "ranking_model": Section(
        "Partition search", "How the partitioner's best-first search ends on the paper "
        "models (16 microbatches of 4 x 2,048 tokens, 8 GPUs, no refinement).",
        _ranking_model),
    "memory_waits": Section(
        "Memory-bounding waits", "RoundPipe's greedy plans of the paper workloads lowered "
        "with each set of memory-bounding waits: one sync step's time and how close the "
        "simulated device peak comes to the proven one.", _memory_waits),
    "memory_agreement": Section(
        "Proven, simulated and measured device memory", "Per worker on tiny models over "
        "virtual workers: the proven peak against the simulated one and the held bytes "
        "against what the workers accounted.", _memory_agreement),
    "undo_journal": Section(
        "Undo journal", "What the optimizer's undo journal costs on a paper workload, by the "
        "simulator.", _undo_journal),
    "runtime_overhead": Section(
        "Runtime overhead", "A step of the runtime on one virtual worker against eager "
        "training with the same recompute and against the reference executor.",
        _runtime_overhead),
    "sync_updates": Section(
        "Sync update order", "Sync steps with updates overlapping the backward against "
        "updates after it, measured on virtual workers and simulated.", _sync_updates),
    "async_updates": Section(
        "Async against sync", "Async and sync steps on virtual workers, measured and "
        "simulated, with host bytes per trainable parameter.", _async_updates),
    "async_barrier": Section(
        "Async steps on fixed plans", "Simulated async steady step and one isolated sync "
        "step on fixed plans of Qwen3-1.7B and Llama-3.1-8B. Bound: the least long-run "
        "async bubble of the plan itself (its heaviest cycle of waits). Sync gaps: the "
        "isolated step's idle between each worker's first and last compute, the figure "
        "RoundPipe's artifact reports as its async bubble.", _async_barrier),
    "soak": Section(
        "Chaos soak", "Random architectures, worker counts and modes with chaos delays and "
        "injected faults; masters compared with the reference after every run.", _soak),
    "compile_cycles": Section(
        "Compile / step / close cycles", "Threads and resident memory across repeated "
        "compile, step and close of a tiny model.", _compile_cycles),
    "sharded_memory": Section(
        "Sharded host state", "Host bytes per trainable parameter per rank, replicated "
        "against `shard_optimizer`, on 1 to 3 processes.", _sharded_memory),
    "dp_checkpoint_bytes": Section(
        "Data-parallel checkpoint bytes", "Peak host bytes each rank adds while a replicated "
        "data-parallel checkpoint is saved.", _dp_checkpoint_bytes),
    "transfer_kernels": Section(
        "Transfer kernels", "Effective bandwidth of the transfer-path kernels against a plain "
        "copy of the same traffic.", _transfer_kernels),
    "qlora": Section(
        "QLoRA bases", "The paper's LoRA workloads on 8x RTX 4090 with the frozen base in "
        "bf16 and in NF4 (double-quantized absmax), by the simulator and the memory proof: "
        "host memory, tokens/s, the device peak and the longest sequence that fits.", _qlora),
}


# ---------------------------------------------------------------- the page and the README


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


def render_doc(results: list[Result]) -> str:
    by_script: dict[str, list[Result]] = {}
    for r in results:
        by_script.setdefault(r.script, []).append(r)
    order = [s for s in SECTIONS if s in by_script] + sorted(
        s for s in by_script if s not in SECTIONS)
    parts = ["# Results",
             "",
             "Every figure the benchmarks measured, one section per script. This page is "
             "written by `python benchmarks/report.py` from `benchmarks/results/*.json`: "
             "rerun a benchmark, then the report, and commit both; never edit it by hand. "
             "Each result names the command that made it, the commit and the machine. "
             "Figures for GPUs are simulated on hardware profiles (`rpcompile hardware`); "
             "only the CPU figures are measured.",
             ""]
    parts += ["Sections: " + ", ".join(
        f"[{(SECTIONS[s].title if s in SECTIONS else s)}](#{anchor(SECTIONS[s].title if s in SECTIONS else s)})"
        for s in order) + ".", ""]
    for s in order:
        section = SECTIONS.get(s)
        title = section.title if section else s
        parts += [f"## {title}", ""]
        if section:
            parts += [section.what, ""]
        for r in by_script[s]:
            if len(by_script[s]) > 1:
                parts += [f"### `{r.path.name}`", ""]
            parts += [provenance(r), ""]
            render = section.render if section else _generic
            parts += [render(r), ""]
            picture = r.path.with_suffix(".png")
            if picture.exists():  # the script's own chart of the same figures
                parts += [f"![{title}](../benchmarks/results/{picture.name})", ""]
    return "\n".join(parts).rstrip() + "\n"


def _get(results: list[Result], name: str) -> Result | None:
    return next((r for r in results if r.path.stem == name), None)


def headline_rows(results: list[Result]) -> list[list[str]]:
    """README's figures: (what, figure, command link), each only where its result exists."""
    rows = []

    def add(name: str, what: str, figure: Callable[[Any], str], command: str = "") -> None:
        """One row; ``command`` is the command that makes the figure when the result file
        does not record its own (an unstamped file)."""
        r = _get(results, name)
        if r is None:
            return
        section = SECTIONS[r.script].title
        command = r.command or command or f"python benchmarks/{r.script}.py"
        rows.append([what, figure(r.figures),
                     f"[`{command}`](docs/results.md#{anchor(section)})"])

    def compile_seconds(f):
        rows = [f["models"][m] for m in ("qwen3-1.7b", "qwen3-32b", "qwen3-235b-a22b")
                if "cold" in f["models"].get(m, {})]
        return " / ".join(f"{r['cold']['cpu_seconds']:.0f} s" for r in rows) or "-"

    add("compile_time", "compile Qwen3-1.7B / Qwen3-32B / Qwen3-235B-A22B LoRA at their paper "
        "shapes on `meta` for 8x4090, cold, CPU seconds", compile_seconds)

    def paper_gap(f):
        ref = _paper_reference()
        gaps = [abs(f[s][m] - ref[s][PAPER_ORDER.index(m)])
                for s in ref if s in f for m in f[s]]
        return f"within {max(gaps):.2f} points" if gaps else "-"

    add("paper_bubbles", "GPipe and 1F1B bubbles against the RoundPipe paper's simulator "
        "(5 models)", paper_gap, "python benchmarks/paper_bubbles.py --schedules gpipe 1f1b")

    def span(g: list[float]) -> str:
        return f"{min(g):.2f}-{max(g):.2f}x" if g else "-"

    def gain(f):
        return span([f[m]["rpcompile"] / f[m]["roundpipe-partition"] for m in PAPER_ORDER
                     if m in f])

    add("paper_throughput", "predicted tokens/s on 8x RTX 4090, our partition over "
        "RoundPipe's (5 paper workloads)", gain,
        "python benchmarks/paper_throughput.py --max-simulations 4 --refine 0")

    def over_roundpipe_sync(f):
        return span([f["ratios"][m]["rpcompile async/sync deferred"] for m in PAPER_ORDER
                     if "rpcompile async/sync deferred" in f.get("ratios", {}).get(m, {})])

    add("paper_throughput", "simulated async steps over RoundPipe's sync mode (its whole "
        "optimizer after each step's last gradient), 5 paper workloads; RoundPipe measured "
        "1.14-1.44x on 4090s, its sync runs with accumulation counts of their own",
        over_roundpipe_sync,
        "python benchmarks/paper_throughput.py --max-simulations 4 --refine 0")

    def longest(f):
        return " / ".join(f"{f[m]['chunked']['longest']:,}" for m in PAPER_ORDER[:2] if m in f)

    add("longest_sequence", "longest sequence proven to fit 8x4090 and a 512 GB host, "
        "Qwen3-1.7B / Llama-3.1-8B", longest)
    add("memory_waits", "simulated / proven device peak per worker, paper workloads",
        lambda f: "{:.3f}-{:.3f}".format(
            min(s["ratio_min"] for m in f for s in m["sets"] if "grad_pair" in s["waits"]),
            max(s["ratio_max"] for m in f for s in m["sets"] if "grad_pair" in s["waits"])))
    add("runtime_overhead", "runtime on 1 virtual worker / eager with the same recompute",
        lambda f: f"{f['ratio_runtime_over_eager_ckpt']:.2f}x")
    add("soak", "chaos soak: injected faults survived, divergences",
        lambda f: f"{f['faults_survived']} / {f['faults_fired']}, {len(f['divergences'])}")

    def scaling(f):
        effs = [s["efficiency"] for m in f.values() for v in m.values()
                for n, s in v.get("eth100", {}).items() if n == "4"]
        return f"{100 * min(effs):.1f}-{100 * max(effs):.1f} %" if effs else "-"

    add("scaling", "data-parallel scaling efficiency, 4 servers on 100 Gbit/s (simulated)",
        scaling)

    def qlora(f):
        m = f["models"].get("qwen3-235b-a22b", {})
        return (f"{m['bf16']['host_gib']:,.1f} / {m['nf4']['host_gib']:,.1f} GiB"
                if "bf16" in m and "nf4" in m else "-")

    add("qlora", "host memory of Qwen3-235B-A22B LoRA on 8x4090, bf16 / NF4 base "
        "(simulated plan; a 512 GB server holds 476.8 GiB)", qlora)
    return rows


def render_readme(readme: str, results: list[Result]) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = table(["what", "figure", "command (details in docs/results.md)"],
                  headline_rows(results))
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only check that docs/results.md and README.md's table are current")
    args = ap.parse_args(argv)
    results = load()
    doc = render_doc(results)
    readme = render_readme(README.read_text(), results)
    stale = [p for p, text in ((DOC, doc), (README, readme))
             if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{_shown(p)} is not what benchmarks/report.py writes: run "
                  "`python benchmarks/report.py` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    DOC.write_text(doc)
    README.write_text(readme)
    print(f"wrote {_shown(DOC)} ({len(results)} result files) and {_shown(README)}'s "
          "figures table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

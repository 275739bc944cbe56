"""The command line: plan (meta-device build, simulate, dump) and train (runtime end to end)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from rpcompile.cli import main
from rpcompile.options import PlanOptions


def test_plan_writes_schedule_and_summary(tmp_path, capsys):
    out = tmp_path / "plan"
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "512",
               "--batch", "18", "--microbatches", "9", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Plan:" in text and "tokens/s" in text and "bubble" in text
    assert "longest sequence that fits" in text
    for name in ("schedule.csv", "schedule.json", "schedule.png", "plan.txt", "summary.json"):
        assert (out / name).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_step"] == 18 * 512
    assert summary["longest_seq"] >= 512
    assert 0 <= summary["bubble_pct"] <= 100
    trace = json.loads((out / "schedule.json").read_text())
    assert trace["traceEvents"]
    assert "recompute: by stage" in text  # it fits: auto keeps stage recompute
    assert summary["recompute"] == {"option": "auto", "layer_stages": []}


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_recompute_flag_forces_layer_recompute(capsys, tmp_path):
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "8", "--seq", "4096",
               "--batch", "9", "--microbatches", "9", "--gpus", "2", "--recompute", "layer",
               "--no-fit-search", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    line = next(t for t in text.splitlines() if t.startswith("recompute:"))
    assert line.startswith("recompute: layer by layer")
    # Whatever plan the search picks: every backward stage of more than one unit recomputes
    # layer by layer, and the table marks them (a plan of one-unit stages has none).
    summary = json.loads((tmp_path / "summary.json").read_text())
    layered = summary["recompute"]["layer_stages"]
    assert summary["recompute"]["option"] == "layer"
    assert ("backward (layer)" in text) == bool(layered)
    assert line.startswith("recompute: layer by layer in B") == bool(layered)


@pytest.mark.usefixtures("no_timeline_png")
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_plan_baselines(tmp_path, capsys, schedule):
    rc = main(["plan", "--model", "llama3.1-8b", "--layers", "8", "--seq", "256", "--gpus", "4",
               "--microbatches", "8", "--batch", "8", "--schedule", schedule,
               "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["schedule"] == schedule and summary["tokens_per_s"] > 0


def test_plan_reports_user_errors(capsys):
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    # An uneven split is planned; a batch that cannot fill the microbatches is not.
    assert main(["plan", "--model", "qwen3-1.7b", "--batch", "2", "--microbatches", "3"]) == 2
    assert "every microbatch needs a sequence" in capsys.readouterr().err


def test_train_loss_falls(tmp_path, capsys):
    # The no-argument demo, shortened: the shipped tiny Qwen3 on the shipped text.
    rc = main(["train", "--steps", "12", "--workers", "2", "--seq", "32", "--batch", "6",
               "--lr", "1e-2", "--out", str(tmp_path)])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5  # byte-level: starts near ln 256
    assert (tmp_path / "base" / "model.safetensors").is_file()  # the demo's starting checkpoint
    for name in ("loss.png", "schedule.csv", "schedule.json", "schedule.png",
                 "final/model.safetensors", "final/tokenizer.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_listings(capsys):
    assert main(["models"]) == 0
    assert "qwen3-235b-a22b" in capsys.readouterr().out
    assert main(["hardware"]) == 0
    lines = {t.split()[0]: t for t in capsys.readouterr().out.splitlines()}
    # Only rtx4090x8 states a host RAM (an assumed 512 GB server); the others do not say.
    assert "host RAM 476.84 GiB (assumed; --host-ram)" in lines["rtx4090x8"]
    assert "host RAM unknown" in lines["a800x8"]


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_reports_idle_workers_and_host_memory(tmp_path, capsys):
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "256", "--batch", "9",
               "--host-ram", "1", "--no-fit-search", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    jobs = summary["stages"]
    assert jobs < 8 and summary["idle_workers"] == 8 - jobs
    idle = next(t for t in text.splitlines() if t.startswith("idle workers: "))
    assert f"{jobs} jobs for 8 workers, so {8 - jobs} worker" in idle
    assert f"a job every {8 // math.gcd(jobs, 8)} steps" in idle
    host = summary["host"]
    assert host["masters"] > 0 and host["optimizer"] == 2 * host["masters"]
    # The module's own copy of its trainable parameters (a full fine-tune: all of them, in
    # the shadows' dtype) is a part of the figure.
    assert host["model"] == host["shadows"] > 0
    assert summary["host_ram_gib"] == 1.0
    assert "more than the 1.00 GiB of RAM" in text and "pinned host memory" in text
    assert "proven peak over the schedule" in text


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_says_which_stage_paces_a_step_whose_workers_idle(tmp_path, capsys):
    # Four layers of Qwen3-1.7B, 16 x 2048 tokens a microbatch: the LM head and loss (one
    # unit, 151,936-word vocabulary) take about twice as long as the next slowest stage, and
    # the stages after it go at its pace. Fill and drain are small: the steady part idles.
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "2048", "--batch",
               "160", "--gpus", "4", "--microbatches", "10", "--no-fit-search",
               "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bubble_fill_pct"] + summary["bubble_drain_pct"] <= 30
    assert summary["bubble_pct"] > 30
    assert "batch too small" not in text
    # The stage named is the slowest of the printed table, and the bound from the table's
    # stage times is a lower bound of the simulated step that accounts for most of it.
    rows = [r.split() for r in (tmp_path / "plan.txt").read_text().splitlines()
            if r[:1] in "FB" and len(r.split()) > 5 and r.split()[0][1:].isdigit()]
    ms = [float(r[-6]) for r in rows]
    k = max(range(len(ms)), key=ms.__getitem__)
    idle = summary["idle"]
    assert idle["slowest_stage"] == rows[k][0] == "B1" and rows[k][1] == "tail"
    bound = sum(ms[:k]) + 10 * ms[k] + sum(ms[k + 1:])
    assert idle["round_bound_ms"] == pytest.approx(bound, rel=1e-3)
    assert 0.8 * summary["makespan_ms"] < bound <= summary["makespan_ms"]
    line = next(t for t in text.splitlines() if t.startswith("workers idle "))
    assert f"slowest stage, B1 (tail: {ms[k]:.2f} ms a microbatch" in line
    assert f"10 x {ms[k]:.2f}" in line and "B1 is one unit, which no cut divides" in line


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_default_batch_beats_the_smallest_and_says_how(tmp_path, capsys):
    # The tiny Qwen3 on 4 workers: one sequence per microbatch leaves the workers mostly idle.
    common = ["plan", "--model", "qwen3-tiny", "--seq", "256", "--gpus", "4", "--no-fit-search"]
    assert main([*common, "--batch", "5", "--out", str(tmp_path / "small")]) == 0
    text = capsys.readouterr().out
    small = json.loads((tmp_path / "small" / "summary.json").read_text())
    assert small["batch"] == 5 and small["bubble_fill_pct"] + small["bubble_drain_pct"] > 30
    assert "batch too small for the workers" in text and "leave out --batch" in text
    assert "workers idle " not in text and "idle" not in small  # fill and drain say it
    jobs = small["stages"]  # the idle workers, and every how many steps each gets a job
    assert jobs < 4 and f"{4 - jobs} worker" in text
    assert f"a job every {4 // math.gcd(jobs, 4)} steps" in text

    assert main([*common, "--out", str(tmp_path / "picked")]) == 0
    text = capsys.readouterr().out
    picked = json.loads((tmp_path / "picked" / "summary.json").read_text())
    assert picked["batch"] > 5 and picked["batch"] % 5 == 0
    assert picked["tokens_per_s"] > 1.05 * small["tokens_per_s"]  # the full searches' figures
    line = next(t for t in text.splitlines() if t.startswith("batch: "))
    assert "picked by doubling the sequences per microbatch" in line
    trials = picked["batch_choice"]["trials"]
    assert [t["microbatch_size"] for t in trials][:2] == [1, 2]
    assert f"{trials[0]['tokens_per_s']:,.0f} tokens/s" in line
    # The smallest trial is the --batch 5 plan, searched with a cap: no faster than the full one.
    assert trials[0]["tokens_per_s"] <= small["tokens_per_s"] * (1 + 1e-9)
    assert picked["batch"] // 5 == picked["batch_choice"]["microbatch_size"]


def test_plan_max_simulations_reaches_the_partitioner(monkeypatch, capsys):
    import rpcompile.compiler.search

    seen = []
    real = rpcompile.compiler.search.partition

    def spy(*args, **kwargs):
        seen.append(kwargs["options"].max_simulations)  # compile passes the plan group
        return real(*args, **kwargs)

    monkeypatch.setattr(rpcompile.compiler.search, "partition", spy)
    assert main(["plan", "--model", "qwen3-tiny", "--seq", "128", "--gpus", "2", "--batch", "3",
                 "--optimizer", "async", "--max-simulations", "1", "--no-fit-search"]) == 0
    text = capsys.readouterr().out
    assert seen and set(seen) == {1}
    assert "max_simulations=1" in text or "1 simulated" in text
    # The steady state is of steps meeting at the barrier; each pass is listed once.
    assert "steps overlapping as their edges let them" in text
    passes = next(t for t in text.splitlines() if t.startswith("passes: "))
    assert passes.count(" upload ") == 1 and passes.count(" events ") == 1


def test_plan_help_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 2048)" in text and "(default: sync)" in text
    assert "--max-simulations N" in text and "``" not in text


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_longest_reports_the_limit(tmp_path, capsys):
    rc = main(["plan", "--model", "llama3.1-8b", "--layers", "4", "--seq", "2048", "--gpus", "4",
               "--hardware", "rtx4090x8", "--longest", "--batch", "5", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    found = json.loads((tmp_path / "summary.json").read_text())["longest"]
    assert found["microbatch_size"] == 1 and found["seq_len"] >= 2048
    assert f"longest sequence that fits the GPUs and the host RAM (5 microbatches of 1 " \
           f"sequence, 4 GPUs): {found['seq_len']:,} tokens" in text
    # The host memory at that length, against the profile's RAM (a 512 GB server).
    assert found["host_ram_gib"] == pytest.approx(476.84)
    assert 0 < found["host_gib"] <= found["host_ram_gib"]
    assert f"host memory at {found['seq_len']:,} tokens: " in text
    assert "of 476.84 GiB RAM (the rtx4090x8 profile)" in text
    if found["next_len"] is not None:  # the reason names the unit or the worker at the peak
        assert found["limit"] and found["limit"] in text
        assert "unit" in found["limit"] or "worker" in found["limit"]
    assert f"proven peak at {found['seq_len']:,} tokens" in text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_runtimes_schedule_overlaps_its_steps_and_gives_the_steady_state(mode):
    """What ``plan`` reads off the runtime's schedule: its steady state (steady_step_ms over
    the repeated dealing period) is the simulator's steady state of a long run of the same
    plan; async steps overlap (a step's first action starts before the one before it has
    ended), and no async steady step is slower than an isolated one."""
    from rpcompile.passes.lower import runtime_schedule
    from rpcompile.planner.partition import build_plan
    from rpcompile.sim import simulate, simulate_roundpipe, steady_step_ms, steady_steps
    from rpcompile.workloads.paper import get_model

    units = get_model("qwen3-1.7b").units(4, 2048)
    plan = build_plan(units, [0, 10, 20], [0, 6, 12, 18, 24], 29, "rtx4090x8", 8, 9, 4, 2048,
                      optimizer=mode)  # 9 jobs on 8 workers: a period of 8 steps
    whole = simulate(runtime_schedule(plan, PlanOptions(gpus=8, microbatches=9, rounds=1,
                                                        mode=mode)), plan, "rtx4090x8")
    one = simulate(runtime_schedule(plan, PlanOptions(gpus=8, microbatches=9, rounds=1, mode=mode,
                                                      schedule_steps=1)), plan, "rtx4090x8")
    assert whole.schedule.steps > 8  # the steps an edge reaches back, then the period
    spans = whole.step_spans_ms
    overlapping = sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])
    if mode == "async":
        assert overlapping > 0
        assert steady_step_ms(whole) <= one.makespan_ms
    run = simulate_roundpipe(plan, "rtx4090x8", steps=steady_steps(plan), optimizer=mode)
    assert steady_step_ms(whole) == pytest.approx(steady_step_ms(run), rel=0.02)


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_reads_the_compiles_own_schedule(monkeypatch, tmp_path, capsys):
    """``plan`` replays ``Compiled.schedule`` (a fixed cut of 3 jobs on 4 workers) for the
    steady state of overlapping steps, and the same plan lowered for one step alone for the
    isolated step; no other schedule."""
    import rpcompile
    import rpcompile.compiler.search
    import rpcompile.sim
    from rpcompile.planner.partition import build_plan

    def one_stage_a_side(units, hw, *, microbatch_size, seq_len, costing, options, **kwargs):
        return build_plan(units, [0], [0], len(units) - 1, hw, options.gpus,
                          options.microbatches_per_round, microbatch_size, seq_len,
                          options.rounds, costing, optimizer=options.mode)

    monkeypatch.setattr(rpcompile.compiler.search, "partition", one_stage_a_side)

    compiled, replayed = [], []
    real_compile, real_simulate = rpcompile.compile, rpcompile.sim.simulate

    def compiling(*args, **kwargs):
        compiled.append(real_compile(*args, **kwargs))
        return compiled[-1]

    def simulating(schedule, *args, **kwargs):
        replayed.append(real_simulate(schedule, *args, **kwargs))
        return replayed[-1]

    monkeypatch.setattr(rpcompile, "compile", compiling)
    monkeypatch.setattr(rpcompile.sim, "simulate", simulating)
    assert main(["plan", "--model", "qwen3-tiny", "--seq", "128", "--gpus", "4", "--batch", "5",
                 "--no-fit-search", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    (c,) = compiled
    # compile() replays its own schedule too, for its host-memory figure (transfer staging);
    # the CLI replays it, then the plan lowered for one step.
    *runs, whole, one = replayed
    assert whole.schedule == c.schedule and all(r.schedule == c.schedule for r in runs)
    assert one.schedule.steps == 1 and one.schedule.stage_names == c.schedule.stage_names
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["schedule_steps"] == c.schedule.steps
    assert summary["makespan_ms"] == one.makespan_ms
    assert summary["bubble_fill_pct"] == 100 * one.bubble_fill
    assert summary["steady_step_ms"] == rpcompile.sim.steady_step_ms(whole)
    assert "predicted, one isolated step: " in text
    assert f"{c.schedule.steps} steps overlapping as their edges let them" in text


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_cache_flag_and_quiet(tmp_path, capsys, monkeypatch):
    # A second plan of the same job reads the searched plan from --plan-cache DIR and says so;
    # --quiet silences the compile's lines; --plan-cache off searches again, writing nothing.
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # progress shows on a terminal
    common = ["plan", "--model", "qwen3-tiny", "--seq", "128", "--gpus", "2", "--batch", "3",
              "--no-fit-search", "--plan-cache", str(tmp_path / "plans")]
    assert main(common) == 0
    first = capsys.readouterr()
    assert "rpcompile: searching stage cuts" in first.err
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    assert main(common) == 0
    second = capsys.readouterr()
    assert "plan from the cache" in second.err and "searching stage cuts" not in second.err
    assert main([*common, "--quiet"]) == 0
    assert "rpcompile:" not in capsys.readouterr().err
    off = [*common[:-1], "off"]
    assert main([*off, "--out", str(tmp_path / "off")]) == 0
    assert "searching stage cuts" in capsys.readouterr().err
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1


def test_listings_print_their_report_as_json(capsys):
    assert main(["models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert main(["models"]) == 0
    assert capsys.readouterr().out.split() == models
    assert main(["hardware", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["hardware"]) == 0
    lines = {t.split()[0]: t for t in capsys.readouterr().out.splitlines()}
    # Each profile's figures are those its text line shows; the links likewise.
    for p in report["profiles"]:
        assert lines[p["name"]].startswith(f"{p['name']:<11} {p['gpus']} x {p['gpu']}, "
                                           f"{p['memory_gib']:g} GiB")
    assert {p["name"] for p in report["profiles"]} | {k["name"] for k in report["links"]} \
        == set(lines)
    rtx = next(p for p in report["profiles"] if p["name"] == "rtx4090x8")
    assert rtx["host_ram_gib"] == pytest.approx(476.84, abs=0.01)


@pytest.mark.usefixtures("no_timeline_png")
def test_plan_json_prints_the_figures_summary_json_holds(tmp_path, capsys):
    args = ["plan", "--model", "qwen3-tiny", "--seq", "256", "--gpus", "4", "--batch", "5",
            "--no-fit-search", "--plan-cache", str(tmp_path / "plans"), "--quiet",
            "--out", str(tmp_path / "out")]
    assert main([*args, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)  # stdout holds the JSON object alone
    assert printed == json.loads((tmp_path / "out" / "summary.json").read_text())
    assert printed["batch"] == 5 and printed["tokens_per_s"] > 0
    assert main(args) == 0  # the text of the same plan (found again in the plan cache)
    text = capsys.readouterr().out
    assert f"{printed['tokens_per_s']:,.0f} tokens/s" in text

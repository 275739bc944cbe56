"""The command line: plan (meta-device build, simulate, dump) and train (runtime end to end)."""

from __future__ import annotations

import json

import pytest

from rpcompile.cli import main


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


def test_plan_recompute_flag_forces_layer_recompute(capsys):
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "8", "--seq", "4096",
               "--batch", "9", "--microbatches", "9", "--gpus", "2", "--recompute", "layer",
               "--no-fit-search"])
    assert rc == 0
    text = capsys.readouterr().out
    line = next(t for t in text.splitlines() if t.startswith("recompute:"))
    assert line.startswith("recompute: layer by layer in B")
    assert "backward (layer)" in text  # the stage table marks those stages


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
    # An uneven split is planned (issue 10); a batch that cannot fill the microbatches is not.
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
    assert "rtx4090x8" in capsys.readouterr().out


def test_plan_reports_idle_workers_and_host_memory(tmp_path, capsys):
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "256", "--batch", "9",
               "--host-ram", "1", "--no-fit-search", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    jobs = summary["stages"]
    assert jobs < 8 and summary["idle_workers"] == 8 - jobs
    assert f"{8 - jobs} workers get no job" in text and "too small" in text
    host = summary["host"]
    assert host["masters"] > 0 and host["optimizer"] == 2 * host["masters"]
    # The module's own copy of its trainable parameters (a full fine-tune: all of them, in
    # the shadows' dtype) is a part of the figure.
    assert host["model"] == host["shadows"] > 0
    assert summary["host_ram_gib"] == 1.0
    assert "more than the 1.00 GiB of RAM" in text and "pinned host memory" in text
    assert "proven peak over the schedule" in text


def test_plan_default_batch_fills_the_workers(tmp_path, capsys):
    rc = main(["plan", "--model", "qwen3-1.7b", "--layers", "4", "--seq", "256",
               "--no-fit-search", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    if "idle_workers" in summary:  # no microbatch of up to 64 sequences fills 8 workers
        assert "no microbatch up to 64 sequences fills them" in text
    else:
        assert summary["stages"] >= 8
        assert summary["batch"] % 9 == 0


def test_plan_longest_reports_the_limit(tmp_path, capsys):
    rc = main(["plan", "--model", "llama3.1-8b", "--layers", "4", "--seq", "2048", "--gpus", "4",
               "--hardware", "rtx4090x8", "--longest", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    found = json.loads((tmp_path / "summary.json").read_text())["longest"]
    assert found["microbatch_size"] == 1 and found["seq_len"] >= 2048
    assert f"longest sequence that fits (5 microbatches of 1 sequence, 4 GPUs): " \
           f"{found['seq_len']:,} tokens" in text
    if found["next_len"] is not None:  # the reason names the unit or the worker at the peak
        assert found["limit"] and found["limit"] in text
        assert "unit" in found["limit"] or "worker" in found["limit"]
    assert f"proven peak at {found['seq_len']:,} tokens" in text

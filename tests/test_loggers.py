"""`rpcompile train --report-to`: each logger, in its offline / local mode, holds what the run
logged, read back through that library's own reader; a missing library is refused before the
run trains, naming the extra that installs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpcompile.cli import main
from tests.finetune.test_finetune import WORDS, _records, _tiny_checkpoint

STEP_KEYS = ("loss", "lr", "grad_norm", "token_accuracy", "tokens_per_s", "step_seconds",
             "predicted_step_seconds")


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loggers")
    text = root / "text.jsonl"
    with text.open("w") as f:
        for i in range(80):
            f.write(json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)]
                                                 for j in range(1 + i % 5))}) + "\n")
    return {"ckpt": _tiny_checkpoint(root / "ckpt"), "text": text}


def _train(run_files, out: Path, report_to: str) -> list[dict]:
    assert main(["train", "--model", str(run_files["ckpt"]), "--data", str(run_files["text"]),
                 "--out", str(out), "--steps", "3", "--workers", "2", "--batch", "6",
                 "--eval-every", "0", "--eval-split", "0", "--save-every", "0",
                 "--report-to", report_to]) == 0
    steps = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    return steps


def _check(steps: list[dict], logged: dict[str, dict[int, float]]) -> None:
    """``logged[key][step]`` holds the metrics.jsonl value of every step metric."""
    for key in STEP_KEYS:
        assert set(logged[key]) == {1, 2, 3}, key
        for r in steps:
            assert logged[key][r["step"]] == pytest.approx(r[key], rel=1e-6), key


def test_tensorboard(run_files, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    steps = _train(run_files, out, "tensorboard")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    _check(steps, {k: {e.step: e.value for e in events.Scalars(f"train/{k}")}
                   for k in STEP_KEYS})
    summary = json.loads((out / "summary.json").read_text())
    assert events.Scalars("summary/mfu")[0].value == pytest.approx(summary["mfu"], rel=1e-6)
    assert 0 < summary["mfu"] and summary["flops_per_step"] > 0


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file. wandb 0.31 reads these files in its Go core
    only, so the reader is here: a 7-byte header (``:W&B``, magic, version), then LevelDB log
    records (crc32c, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks whose tails shorter than a record header are padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, at, pending = 32768, 7, b""
    while at + 7 <= len(data):
        if block - at % block < 7:  # the block's padding
            at += block - at % block
            continue
        length = int.from_bytes(data[at + 4:at + 6], "little")
        kind = data[at + 6]
        if length == 0 and kind == 0:
            break
        pending += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline(run_files, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'rpcompile[wandb]'")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    steps = _train(run_files, out, "wandb")
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged: dict[str, dict[int, float]] = {k: {} for k in STEP_KEYS}
    summary = {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            for key in STEP_KEYS:
                if key in items:
                    logged[key][items["_step"]] = items[key]
        elif kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.summary.update})
    _check(steps, logged)
    assert summary["mfu"] == pytest.approx(
        json.loads((out / "summary.json").read_text())["mfu"], rel=1e-6)


def test_mlflow_local_store(run_files, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'rpcompile[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    steps = _train(run_files, out, "mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpcompile")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["report_to"] == "mlflow"
    _check(steps, {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
                   for k in STEP_KEYS})
    assert float(run.data.tags["summary.mfu"]) == pytest.approx(
        json.loads((out / "summary.json").read_text())["mfu"], rel=1e-6)


def test_trackio_local_db(run_files, tmp_path, monkeypatch):
    pytest.importorskip("trackio", reason="trackio is not installed: "
                                          "pip install 'rpcompile[trackio]'")
    from trackio import sqlite_storage, utils

    # Trackio reads TRACKIO_DIR once, at import: point its module constants at this test.
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setattr(utils, "TRACKIO_DIR", tmp_path / "trackio")
    out = tmp_path / "run"
    steps = _train(run_files, out, "trackio")
    logs = sqlite_storage.SQLiteStorage.get_logs("rpcompile", "run")
    _check(steps, {k: {r["step"]: r[k] for r in logs if k in r} for k in STEP_KEYS})
    mfu = [r["summary/mfu"] for r in logs if "summary/mfu" in r]
    assert mfu == [pytest.approx(json.loads((out / "summary.json").read_text())["mfu"])]


def test_a_missing_logger_library_is_refused_naming_its_extra(run_files, tmp_path, monkeypatch,
                                                              capsys):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find(name, *a))
    common = ["train", "--model", str(run_files["ckpt"]), "--data", str(run_files["text"]),
              "--out", str(tmp_path / "run")]
    assert main([*common, "--report-to", "tensorboard,wandb"]) == 2
    assert "pip install 'rpcompile[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
    assert main([*common, "--report-to", "comet"]) == 2
    assert "unknown ['comet']" in capsys.readouterr().err

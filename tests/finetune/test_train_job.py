"""`rpcompile train` as a job, through the command line: a run folder holds one run, a resume
goes on in the folder it is given and only with the run's model, data and trajectory options,
final/ is written whole, the model trains in the mode its config says, SIGINT / SIGTERM stop
with a checkpoint that resumes bit for bit, a refused checkpoint write stops the run cleanly,
and every bad input is refused with a message that names the file, record or option and the
fix. Most tests copy one finished run (30 steps, checkpoints at 20 and 30) instead of training
their own."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rpcompile.cli import main
from rpcompile.data import byte_tokenizer
from rpcompile.runtime.checkpoint import read_manifest

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron"]

# Every run writes schedule.png; no test here looks at it (tests/cli/test_cli.py checks that
# `train --out` writes one, tests/ir/test_ir_schedule.py the drawing).
pytestmark = pytest.mark.usefixtures("no_timeline_png")


def _tiny_checkpoint(folder: Path, **config) -> Path:
    import transformers as tf

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(tf.Qwen3Config(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _pairs(path: Path, n: int = 40, offset: int = 0) -> Path:
    with path.open("w") as f:
        for i in range(n):
            w, k = WORDS[(i + offset) % len(WORDS)], 1 + i % 3
            f.write(json.dumps({"prompt": f"{w} x{k}:", "completion": f" {w}" * k}) + "\n")
    return path


def _train(*args: str) -> tuple[int, str]:
    """``rpcompile train ARGS`` in this process: (exit status, stdout + stderr)."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        status = main(["train", *map(str, args)])
    return status, text.getvalue()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    return {"ckpt": _tiny_checkpoint(root / "ckpt"), "pairs": _pairs(root / "pairs.jsonl"),
            "other": _pairs(root / "other.jsonl", offset=3), "root": root}


def _common(files) -> list[str]:
    return ["--model", files["ckpt"], "--workers", "2", "--batch", "6", "--lr", "1e-2",
            "--report-to", "none"]


# The run the copying tests start from, and the interrupted runs are compared with.
_FINISHED = ["--steps", "30", "--eval-every", "10", "--save-every", "10"]


@pytest.fixture(scope="module")
def finished(files):
    """A finished run: 30 steps on pairs.jsonl, eval every 10, checkpoints at 20 and 30."""
    out = files["root"] / "finished"
    status, text = _train(*_common(files), "--data", files["pairs"], *_FINISHED, "--out", out)
    assert status == 0, text
    return out, text


def _copy(finished, tmp_path: Path, name: str = "run") -> Path:
    out = tmp_path / name
    shutil.copytree(finished[0], out)
    return out


# -- 1. a run folder holds one run ---------------------------------------------------------


def test_a_folder_holds_one_run_and_overwrite_clears_it(files, finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = _files(out)
    status, text = _train(*_common(files), "--data", files["other"], "--steps", "4",
                          "--save-every", "2", "--out", out)
    assert status == 2
    for words in (f"--out {out} already holds a run", "a new --out", f"--resume {out}",
                  "--overwrite"):
        assert words in text, (words, text)
    assert _files(out) == before  # refused before anything was written
    status, text = _train(*_common(files), "--data", files["other"], "--steps", "4",
                          "--save-every", "2", "--keep-last", "2", "--overwrite", "--out", out)
    assert status == 0, text
    # The other run's step-20 and step-30 are gone, not kept over this run's (nor resumed).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004"]
    losses = [r["loss"] for r in _records(out) if "loss" in r]
    assert len(losses) == 4
    assert json.loads((out / "run.json").read_text())["data"]["path"] == str(files["other"])
    # A checkpoint with later ones beside it would branch the run in the same folder.
    status, refused = _train("--resume", out / "checkpoints" / "step-00000002")
    assert status == 2 and "later checkpoints (step-00000004)" in refused
    assert "rm -r" in refused
    # The summary says what it averaged (4 steps: the first and last 2), and the compile says
    # what it compiles, for how many workers, before it starts.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_steps_averaged"] == 2
    assert summary["loss_first"] == pytest.approx(sum(losses[:2]) / 2)
    assert summary["loss_last"] == pytest.approx(sum(losses[2:]) / 2)
    assert f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} (mean of " \
           "first/last 2 steps)" in text
    assert "train: compiling Qwen3ForCausalLM (" in text and "for 2 virtual workers" in text
    assert text.index("train: compiling") < text.index("train: compiled in")


def test_final_is_written_whole_never_beside_files_of_an_earlier_write(finished, tmp_path):
    """final/ of a finished run holds an adapter left by an earlier write; a resume writes
    final/ again (full weights): into a fresh folder moved into place, so no adapter stays
    beside the weights for from_pretrained to apply."""
    out = _copy(finished, tmp_path)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (out / "final" / name).write_text("{}")
    status, text = _train("--resume", out)
    assert status == 0, text
    final = set(os.listdir(out / "final"))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= final
    assert not {"adapter_model.safetensors", "adapter_config.json"} & final, final
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_copied_run_folder_resumes_in_itself_and_leaves_the_original_alone(finished,
                                                                            tmp_path):
    """Resuming a copy goes on in the copy; the original's files stay byte for byte. The
    copy is extended from 30 to 32 steps: the 30-step cosine schedule ended at learning rate
    0, and the extension goes on with the schedule of a 32-step run (docs/finetune.md)."""
    original = _copy(finished, tmp_path, "original")
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(original, moved)
    before = _files(original)
    status, text = _train("--resume", moved, "--steps", "32")
    assert status == 0, text
    assert _files(original) == before
    records = {r["step"]: r for r in _records(moved) if "loss" in r}
    assert sorted(records) == list(range(1, 33))
    assert (moved / "checkpoints" / "step-00000032").is_dir()
    assert _files(moved)["final/model.safetensors"] != before["final/model.safetensors"]
    warmup = 1  # 3% of 32 steps, rounded
    for step in (31, 32):
        k = step - 1
        want = 1e-2 * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (32 - warmup)))
        assert records[step]["lr"] == pytest.approx(want, rel=1e-12), step
    assert records[31]["lr"] > records[32]["lr"] > 0
    # --out with --resume branches the run into a new folder: never into another run's.
    status, text = _train("--resume", moved, "--out", original)
    assert status == 2 and f"--out {original} already holds a run" in text
    assert _files(original) == before


def test_resume_from_an_earlier_checkpoint_with_out_branches_into_a_new_folder(finished,
                                                                              tmp_path):
    """--resume RUN/checkpoints/step-20 --out NEW: the later step-30 beside it does not stop
    a branch; NEW logs steps 21-30 bit for bit as the run did, and RUN is left as it was."""
    run = _copy(finished, tmp_path)
    before = _files(run)
    new = tmp_path / "branch"
    status, text = _train("--resume", run / "checkpoints" / "step-00000020", "--out", new)
    assert status == 0, text[-2000:]
    assert _files(run) == before
    want = [r for r in _records(run) if r["step"] > 20]
    _same_records(_records(new), want)
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == ["step-00000030"]
    assert (new / "final" / "model.safetensors").is_file()


# -- 2. the model trains as the model says -------------------------------------------------


def test_the_job_trains_with_the_dropout_of_the_checkpoints_config(files, tmp_path, monkeypatch):
    """A checkpoint with attention_dropout 0.5: the job's losses, token accuracies and weights
    are those of eager Hugging Face training in train mode with the masks the runtime drew
    (AdamW, clipping at 1.0, the logged learning rates), and differ from training without
    dropout."""
    from transformers import AutoModelForCausalLM

    import rpcompile
    from rpcompile.capture.dropout import record_masks
    from rpcompile.compiler import Compiled
    from tests.capture.test_dropout import _eager_dropout_uses, _full_masks

    ckpt = _tiny_checkpoint(tmp_path / "dropout", attention_dropout=0.5)
    compiled, fed = [], []
    real_compile, real_fit = rpcompile.compile, Compiled.fit

    def compiling(*args, **kwargs):
        compiled.append(real_compile(*args, **kwargs))
        return compiled[-1]

    def fitting(self, batches, steps=None, **kwargs):  # the batches in the order drawn
        def seen():
            for batch in batches:
                fed.append({k: v.clone() for k, v in batch.items()})
                yield batch
        return real_fit(self, seen(), steps, **kwargs)

    monkeypatch.setattr(rpcompile, "compile", compiling)
    monkeypatch.setattr(Compiled, "fit", fitting)
    out = tmp_path / "run"
    with record_masks() as drawn:
        status, text = _train("--model", ckpt, "--data", files["pairs"], "--workers", "2",
                              "--batch", "6", "--steps", "2", "--lr", "1e-2", "--eval-split",
                              "0", "--schedule", "constant", "--warmup-steps", "0",
                              "--report-to", "none", "--out", out)
    assert status == 0, text
    (job,) = compiled
    assert job.capture.random_ops  # dropout is in the graph: the model was in train mode
    records = [r for r in _records(out) if "loss" in r]
    eager = AutoModelForCausalLM.from_pretrained(ckpt).train()
    optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.0)
    for step, (batch, record) in enumerate(zip(fed, records)):
        masks, _ = _full_masks(job, batch, drawn, step=step)
        with _eager_dropout_uses(masks):
            output = eager(**batch)
        loss, target = output.loss, batch["labels"][:, 1:]
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), step
        # Token accuracy: eager HF's argmax hits on the labelled tokens, counted exactly.
        hits = int(((output.logits[:, :-1].argmax(-1) == target) & (target != -100)).sum())
        assert record["token_accuracy"] == hits / record["target_tokens"], step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        optimizer.param_groups[0]["lr"] = record["lr"]
        optimizer.step()
        optimizer.zero_grad()
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, p in eager.named_parameters():
        torch.testing.assert_close(final.get_parameter(name), p, rtol=1e-4, atol=1e-5,
                                   msg=name)
    # The same two steps without dropout end elsewhere (the model in eval mode).
    plain = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    for batch in fed:
        plain(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    apart = max(float((final.get_parameter(n) - p).abs().max())
                for n, p in plain.named_parameters())
    assert apart > 1e-3, apart


# -- 3. interrupts and I/O -------------------------------------------------------------------


def _uninterrupted(finished) -> list[dict]:
    return _records(finished[0])


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            record = json.loads(line)
            steps += [record["step"]] if "loss" in record else []
    return steps


def _same_records(got: list[dict], want: list[dict]) -> None:
    assert [(r["step"], "loss" in r) for r in got] == [(r["step"], "loss" in r) for r in want]
    for a, b in zip(got, want):
        for key in ("loss", "lr", "eval_loss"):
            assert a.get(key) == b.get(key), (key, a, b)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_job_runs_a_stream_of_steps_and_trains_as_one_step_at_a_time(files, tmp_path,
                                                                          monkeypatch, mode):
    """`rpcompile train` runs its steps as a stream (Compiled.fit): a step is submitted while
    the one before it is still in flight, and the logged losses, learning rates, gradient
    norms and eval losses and the final weights are bit for bit those of the same job run one
    ``step()`` at a time (the scheduler stepped after each), evaluating at step 3 of 6."""
    from rpcompile.compiler import Compiled
    from rpcompile.finetune import lr_lambda
    from rpcompile.runtime.executor import Executor

    in_flight: list[int] = []
    real_start = Executor.start

    def start(self, batch, after_commit=None):
        k = real_start(self, batch, after_commit)
        in_flight.append(self.in_flight)
        return k

    monkeypatch.setattr(Executor, "start", start)
    args = [*_common(files), "--data", files["pairs"], "--steps", "6", "--eval-every", "3",
            "--save-every", "0", "--mode", mode, "--warmup-steps", "2"]
    status, text = _train(*args, "--out", tmp_path / "stream")
    assert status == 0, text
    assert len(in_flight) == 6 and max(in_flight) >= 2, in_flight

    def one_at_a_time(self, batches, steps=None, *, scheduler=None):
        batches = iter(batches)
        for _ in range(steps):
            self.step(next(batches))
            yield self.trainer().last  # booked before the scheduler steps
            scheduler.step()

    monkeypatch.setattr(Compiled, "fit", one_at_a_time)
    status, text = _train(*args, "--out", tmp_path / "steps")
    assert status == 0, text
    assert len(in_flight) == 6  # step() runs alone, never through start()
    got, want = _records(tmp_path / "stream"), _records(tmp_path / "steps")
    assert [(r["step"], "loss" in r) for r in got] == [(r["step"], "loss" in r) for r in want]
    assert sum("eval_loss" in r for r in got) == 3  # steps 0, 3 and 6
    for a, b in zip(got, want):
        for key in ("loss", "lr", "grad_norm", "eval_loss", "tokens", "target_tokens", "epoch"):
            assert a.get(key) == b.get(key), (key, a, b)
    factor = lr_lambda("cosine", 2, 6)  # warmup over 2 steps, then decay
    assert [r["lr"] for r in got if "lr" in r] == [1e-2 * factor(k) for k in range(6)]
    assert _files(tmp_path / "stream" / "final") == _files(tmp_path / "steps" / "final")


def test_ctrl_c_saves_the_last_committed_step_and_resume_is_bit_exact(files, finished,
                                                                       tmp_path):
    """SIGINT to a `rpcompile train` process: the step in flight finishes, the job writes a
    checkpoint of it (with --save-every 0), says how to go on and exits 130 without a
    traceback; the resumed run logs every loss, learning rate and eval loss of the
    uninterrupted one bit for bit."""
    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [*_common(files), "--data", files["pairs"], *_FINISHED, "--save-every", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rpcompile.cli", "train", *map(str, args), "--out", str(cut)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_logged_steps(cut)) >= 3:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    steps = _logged_steps(cut)
    (saved,) = (cut / "checkpoints").iterdir()
    assert 3 <= steps[-1] < 30 and saved.name == f"step-{steps[-1]:08d}"
    assert f"SIGINT: stopped after step {steps[-1]} of 30, saved {saved}" in text
    assert f"go on with: rpcompile train --resume {cut}" in text
    assert not (cut / "final").exists()
    status, text = _train("--resume", cut)
    assert status == 0, text
    _same_records(_records(cut), _uninterrupted(finished))


def test_sigterm_twice_stops_at_once_and_resume_is_bit_exact(files, finished, tmp_path):
    """SIGTERM twice (the job's own process, from a thread that waits for step 3): the second
    one discards the step in flight; the checkpoint is of the last committed step, the exit
    status 143, and the resumed run is bit for bit the uninterrupted one."""
    import threading

    cut = tmp_path / "cut"
    args = [*_common(files), "--data", files["pairs"], *_FINISHED, "--save-every", "0"]
    done = threading.Event()

    def terminate():
        while not done.is_set() and len(_logged_steps(cut)) < 3:
            time.sleep(0.005)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    # A signal that came after the run ended must not end the test process.
    before = signal.signal(signal.SIGTERM, lambda *_: None)
    sender = threading.Thread(target=terminate)
    sender.start()
    try:
        status, text = _train(*args, "--out", cut)
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGTERM, before)
    assert status == 143, text[-3000:]
    steps = _logged_steps(cut)
    (saved,) = (cut / "checkpoints").iterdir()
    assert 3 <= steps[-1] < 30 and saved.name == f"step-{steps[-1]:08d}"
    assert f"SIGTERM: stopped after step {steps[-1]} of 30" in text
    status, text = _train("--resume", cut)
    assert status == 0, text
    _same_records(_records(cut), _uninterrupted(finished))


def test_a_refused_checkpoint_write_stops_the_run_cleanly_and_it_resumes(files, tmp_path,
                                                                         monkeypatch):
    """The disk fills while step 4's checkpoint is written: the run stops with a message that
    names the folder, the bytes it needs and the checkpoint to go on from (step 2, intact:
    tests/runtime/test_checkpoint.py loads such a checkpoint after a refused write)."""
    import errno

    import safetensors.torch

    write = safetensors.torch.save_file
    calls = []

    def filling(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return write(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", filling)
    out = tmp_path / "run"
    status, text = _train(*_common(files), "--data", files["pairs"], "--steps", "6",
                          "--save-every", "2", "--eval-split", "0", "--out", out)
    monkeypatch.undo()
    assert status == 2
    for words in (f"could not write the checkpoint {out}/checkpoints/step-00000004",
                  "No space left on device", "bytes on the file system of",
                  "The run stopped after step 4",
                  f"the latest checkpoint is {out}/checkpoints/step-00000002",
                  f"rpcompile train --resume {out}"):
        assert words in text, (words, text[-2000:])
    assert "Traceback" not in text
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    assert read_manifest(out / "checkpoints" / "step-00000002")["step"] == 2
    assert not (out / "final").exists()


def test_a_refused_write_of_final_stops_cleanly_and_a_resume_writes_it(files, tmp_path,
                                                                        monkeypatch):
    """The disk fills while final/ is written (safetensors raises its own error, naming no
    file): the run stops naming final/, the cause and the checkpoint of its last step, leaves
    no final/ written in part, and a resume from that checkpoint writes final/."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "run"
    status, text = _train(*_common(files), "--data", files["pairs"], "--steps", "2",
                          "--save-every", "2", "--eval-split", "0", "--out", out)
    monkeypatch.undo()
    assert status == 2, text[-2000:]
    for words in (f"cannot write {out}/final", "No space left on device",
                  "The run stopped after step 2",
                  f"the latest checkpoint is {out}/checkpoints/step-00000002",
                  f"rpcompile train --resume {out}"):
        assert words in text, (words, text[-2000:])
    assert "Traceback" not in text
    assert not (out / "final").exists() and not (out / ".final.partial").exists()
    status, text = _train("--resume", out)
    assert status == 0, text[-2000:]
    assert (out / "final" / "model.safetensors").is_file()


def test_a_checkpoint_skipped_as_unreadable_is_named_with_the_reason(finished, tmp_path):
    out = _copy(finished, tmp_path)
    manifest = out / "checkpoints" / "step-00000030" / "manifest.json"
    manifest.write_text(manifest.read_text()[:50])
    status, text = _train("--resume", out)
    assert status == 0, text
    assert f"skipped {out}/checkpoints/step-00000030: " in text
    assert "manifest.json is unreadable or truncated" in text
    assert f"resumed from {out}/checkpoints/step-00000020 at step 20" in text


# -- 5. small truths ---------------------------------------------------------------------------


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n')
    deep = tmp_path / "new" / "deeper" / "run"
    # The demo model is built into OUT/base before the data is read: removed with the rest.
    status, text = _train("--data", bad, "--out", deep, "--workers", "2")
    assert status == 2 and f"{bad}: records with columns ['prompt']" in text
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    status, _ = _train(*_common(files), "--data", bad, "--out", empty)
    assert status == 2 and empty.is_dir() and not list(empty.iterdir())


# -- 4. bad inputs -----------------------------------------------------------------------------


def _data(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


_PAIR = json.dumps({"prompt": "q", "completion": "a"}) + "\n"
# (case, files to write {name: text}, args ({name} is a written file's path, {ckpt}, {run}: a
# copy of the finished run, {data}: its data file), words the message must hold)
_BAD = [
    ("no completion", {"d.jsonl": _PAIR * 2 + '{"prompt": "q"}\n'},
     ["--data", "{d.jsonl}"], ["{d.jsonl} line 3", "no 'completion' field",
                              "needs 'prompt' and 'completion'"]),
    ("misspelt field", {"d.jsonl": _PAIR + '{"prompt": "q", "completoin": "a"}\n'},
     ["--data", "{d.jsonl}"], ["{d.jsonl} line 2", "it has prompt, completoin"]),
    ("sharegpt roles", {"d.jsonl": json.dumps({"messages": [
        {"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]}) + "\n"},
     ["--data", "{d.jsonl}"], ["{d.jsonl} line 1", "rename 'gpt' to 'assistant'"]),
    ("malformed line", {"d.jsonl": _PAIR + '{"prompt": "q" "completion": "a"}\n'},
     ["--data", "{d.jsonl}"], ["{d.jsonl} line 2: not valid JSON"]),
    ("empty file", {"d.jsonl": ""}, ["--data", "{d.jsonl}"], ["{d.jsonl} is empty"]),
    ("missing file", {}, ["--data", "{ckpt}/nothing.jsonl"], ["nothing.jsonl does not exist"]),
    ("yaml int", {"c.yaml": "steps: three\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml}: steps: 'three' is not an integer", "optimizer steps"]),
    ("yaml bool for int", {"c.yaml": "lora: yes\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml}: lora: True is not an integer", "reads yes, no", "LoRA rank"]),
    ("yaml number", {"c.yaml": "lr: fast\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml}: lr: 'fast' is not a number", "peak learning rate"]),
    ("yaml choice", {"c.yaml": "schedule: warm\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml}: --schedule must be one of 'cosine', 'linear', 'constant', got 'warm'"]),
    ("yaml bool", {"c.yaml": "merge: sometimes\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml}: merge: 'sometimes' is not true or false"]),
    ("yaml unparsable", {"c.yaml": "steps: [1,\nlr: 2\n"}, ["--config", "{c.yaml}"],
     ["{c.yaml} is not valid YAML at line", "option: value"]),
    ("yaml range", {"c.yaml": "eval_split: 1.5\n"}, ["--config", "{c.yaml}"],
     ["--eval-split must be a fraction in [0, 1), got 1.5", "(from {c.yaml} (--config))"]),
    ("seq too short", {"d.jsonl": json.dumps({"prompt": "a long prompt",
                                              "completion": "b"}) + "\n" * 1},
     ["--data", "{d.jsonl}", "--seq", "8", "--eval-split", "0"],
     ["keep no token to predict once truncated to --seq 8", "use a larger --seq"]),
    ("eval split", {}, ["--data", "{data}", "--eval-split", "0.99"],
     ["--eval-split 0.99 holds out 40 of the 40 examples", "leaving 0 to train on",
      "smaller --eval-split"]),
    ("resume batch", {}, ["--resume", "{run}", "--batch", "4"],
     ["--batch is 4, but the run in {run} trained with 6", "Leave it out"]),
    ("resume lora", {}, ["--resume", "{run}", "--lora", "4"],
     ["--lora is 4, but the run in {run} trained with 0", "start a new run"]),
    ("resume data", {"d.jsonl": _PAIR * 20}, ["--resume", "{run}", "--data", "{d.jsonl}"],
     ["--data: the run in {run} trained on {data} (sha256", "the same data"]),
    ("resume data from yaml", {"c.yaml": "data: {d.jsonl}\n", "d.jsonl": _PAIR * 20},
     ["--resume", "{run}", "--config", "{c.yaml}"],
     ["data (from {c.yaml} (--config)): the run in {run} trained on"]),
    ("resume gone", {}, ["--resume", "{ckpt}"], ["--resume {ckpt}: give a run's output folder"]),
    ("resume overwrite", {}, ["--resume", "{run}", "--overwrite"],
     ["--overwrite starts a new run", "give one of them"]),
    ("foreign folder", {"x.txt": "mine"}, ["--data", "{data}", "--out", "{ckpt}"],
     ["holds files that are not an rpcompile run's", "config.json"]),
    ("unwritable out", {"x.txt": "mine"}, ["--data", "{data}", "--out", "{x.txt}/run"],
     ["cannot write to --out {x.txt}/run", "give a folder this process can write"]),
]


@pytest.mark.parametrize(("case", "written", "args", "words"), _BAD, ids=[b[0] for b in _BAD])
def test_a_bad_input_is_refused_naming_where_it_is_and_the_fix(files, finished, tmp_path, case,
                                                                written, args, words):
    paths = {"ckpt": str(files["ckpt"]), "run": str(_copy(finished, tmp_path)),
             "data": str(files["pairs"])}
    for name in written:
        paths[name] = str(tmp_path / name)

    def fill(text: str) -> str:
        for key, value in paths.items():
            text = text.replace("{" + key + "}", value)
        return text

    for name, text in written.items():
        (tmp_path / name).write_text(fill(text))
    given = [fill(a) for a in args]
    if "--resume" not in given and "--config" not in given:
        given = ["--model", paths["ckpt"], "--workers", "2", "--batch", "6", *given]
    if "--out" not in given and "--resume" not in given:
        given += ["--out", str(tmp_path / "out")]
    status, text = _train(*given)
    assert status == 2, text[-2000:]
    for word in map(fill, words):
        assert word in text, (word, text[-2000:])
    assert "Traceback" not in text

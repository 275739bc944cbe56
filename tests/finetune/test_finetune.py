"""`rpcompile train` end to end on a tiny checkpoint folder, and the Python API it runs on
(Compiled.evaluate, save_pretrained, an LR scheduler on compiled.optimizer). Losses of the saved
checkpoints are measured with plain Hugging Face / PEFT code, not with rpcompile's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rpcompile
from rpcompile.cli import main
from rpcompile.data import IGNORE_INDEX, byte_tokenizer, prepare

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper"]

# Every run writes schedule.png; no test here looks at it (tests/cli/test_cli.py checks that
# `train --out` writes one, tests/ir/test_ir_schedule.py the drawing).
pytestmark = pytest.mark.usefixtures("no_timeline_png")


def _tiny_checkpoint(folder: Path) -> Path:
    import transformers as tf

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = tf.Qwen3Config(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    tf.Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    ckpt = _tiny_checkpoint(root / "ckpt")
    pairs = root / "pairs.jsonl"
    chat = root / "chat.jsonl"
    with pairs.open("w") as f:
        for i in range(60):
            w, k = WORDS[i % len(WORDS)], 1 + (i // len(WORDS)) % 4
            f.write(json.dumps({"prompt": f"{w} x{k}:", "completion": f" {w}" * k}) + "\n")
    with chat.open("w") as f:
        for i in range(60):
            w, k = WORDS[(3 * i) % len(WORDS)], 1 + (i // len(WORDS)) % 4
            f.write(json.dumps({"messages": [{"role": "user", "content": f"say {w} x{k}"},
                                             {"role": "assistant", "content": " ".join([w] * k)}]})
                    + "\n")
    return {"ckpt": ckpt, "pairs": pairs, "chat": chat}


def _hf_eval_loss(model, data: Path, ckpt: Path) -> float:
    """Token-mean loss of the run's eval split (eval_split 0.1, seed 0), with the eager model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    held = prepare(data, tokenizer, eval_split=0.1, seed=0).eval
    total = count = 0.0
    with torch.no_grad():
        for ex in held:
            ids = torch.tensor([ex.input_ids])
            labels = torch.tensor([ex.labels])
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            count += n
    return total / count


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


COMMON = ["--steps", "30", "--workers", "2", "--batch", "6", "--lr", "3e-3",
          "--eval-every", "10", "--save-every", "0"]


@pytest.mark.parametrize("kind", ["pairs", "chat"])
def test_train_a_checkpoint_folder_on_a_data_file(tmp_path, files, kind):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main(["train", "--model", str(files["ckpt"]), "--data", str(files[kind]),
                 "--out", str(out), *COMMON]) == 0
    records = _records(out)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 4  # steps 0, 10, 20, 30
    assert evals[-1] < evals[0] - 1.0, evals
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 30
    assert all(r["grad_norm"] > 0 for r in steps)  # clipped at the default 1.0, norm logged
    assert len({r["tokens"] for r in steps}) > 1  # padded to length buckets, not all to --seq
    for name in ("loss.png", "config.yaml", "final/model.safetensors", "final/tokenizer.json"):
        assert (out / name).stat().st_size > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    base = AutoModelForCausalLM.from_pretrained(files["ckpt"])
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    before = _hf_eval_loss(base, files[kind], files["ckpt"])
    after = _hf_eval_loss(final, files[kind], out / "final")
    assert after < before - 1.0, (before, after)
    # The logged eval losses are those of the starting and the saved weights.
    assert evals[0] == pytest.approx(before, rel=1e-4)
    assert evals[-1] == pytest.approx(after, rel=1e-4)


def test_lora_writes_an_adapter_peft_loads(tmp_path, files):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    assert main(["train", "--model", str(files["ckpt"]), "--data", str(files["pairs"]),
                 "--lora", "8", "--out", str(out), *COMMON]) == 0
    assert (out / "final" / "adapter_config.json").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert not (out / "final" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(files["ckpt"])
    before = _hf_eval_loss(base, files["pairs"], files["ckpt"])
    tuned = PeftModel.from_pretrained(base, out / "final")
    after = _hf_eval_loss(tuned, files["pairs"], files["ckpt"])
    assert after < before - 0.5, (before, after)


def test_yaml_config_and_flags_override_it(tmp_path, files):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {files['ckpt']}\ndata: {files['pairs']}\nsteps: 4\n"
                      "workers: 2\nbatch: 6\nschedule: linear\n"
                      "eval_split: 0\nsave_every: 0\nreport_to: none\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--steps", "3", "--out", str(out)]) == 0
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3]  # the flag won; no eval split
    assert not (out / "tensorboard").exists()
    lrs = [r["lr"] for r in records]
    assert lrs[0] > lrs[1] > lrs[2] > 0  # linear decay (no warmup on 3 steps)
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1\n")
    assert main(["train", "--config", str(bad)]) == 2


def test_a_resumed_per_rank_run_without_sharding_names_where_per_rank_came_from(tmp_path):
    """Resuming a --checkpoint-per-rank run with --no-shard-optimizer: the refusal says the
    option came from the resumed run's config.yaml (not a flag the user gave) and how to
    leave it out; with --no-checkpoint-per-rank the options are accepted."""
    import argparse
    import functools

    from rpcompile.finetune import _check, add_train_arguments, option_origin, resolve_options

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (run / "config.yaml").write_text("model: m\nshard_optimizer: true\n"
                                     "checkpoint_per_rank: true\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)

    def check(*flags):
        args = parser.parse_args(["--resume", str(step), *flags])
        opts, checkpoint = resolve_options(args)
        assert checkpoint == step
        _check(opts, functools.partial(option_origin, args))

    with pytest.raises(ValueError) as info:
        check("--no-shard-optimizer")
    text = str(info.value)
    assert f"from the resumed run's {run / 'config.yaml'}" in text
    assert "needs --shard-optimizer" in text and "--no-checkpoint-per-rank" in text
    check("--no-shard-optimizer", "--no-checkpoint-per-rank")
    with pytest.raises(ValueError, match=r"^--checkpoint-per-rank writes"):
        check("--no-shard-optimizer", "--checkpoint-per-rank")


@pytest.mark.parametrize("logged", [True, False])
def test_a_run_folder_whose_config_says_tensorboard_resumes_with_report_to(tmp_path, capsys,
                                                                           logged):
    """A run folder's config.yaml with ``tensorboard: true|false`` (the key --report-to
    replaced) resumes: read as report_to tensorboard|none with a one-line notice, the
    same-run check passes it; a --config file with the key is refused, naming report_to."""
    import argparse

    from rpcompile.finetune import _Job, add_train_arguments, resolve_options

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    config = run / "config.yaml"
    config.write_text(f"model: m\nlr: 0.003\ntensorboard: {str(logged).lower()}\n")
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    opts, checkpoint = resolve_options(parser.parse_args(["--resume", str(step)]))
    assert checkpoint == step and opts["lr"] == 0.003
    assert opts["report_to"] == ("tensorboard" if logged else "none")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{config} says tensorboard: {str(logged).lower()}, which report_to replaces" in err
    job = _Job(opts, checkpoint, 0, 1, lambda name: "the default", None)
    job._check_same_run({"data": None, "eval_data": None})  # no refusal of the key
    user = tmp_path / "mine.yaml"
    user.write_text("tensorboard: true\n")
    with pytest.raises(ValueError, match=r"tensorboard: report_to replaces it: write "
                                         r"report_to: tensorboard or none"):
        resolve_options(parser.parse_args(["--config", str(user)]))


def test_shard_optimizer_with_async_mode_is_refused_in_the_command_lines_words(capsys):
    """`rpcompile train --shard-optimizer --mode async`: refused by PlanOptions' own rule (not
    a copy in finetune) before any model is loaded, its message naming the flags to change,
    not the Python keywords (shard_optimizer=False, mode='sync')."""
    from rpcompile.finetune import _check, add_train_arguments, resolve_options

    assert main(["train", "--shard-optimizer", "--mode", "async"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rpcompile: error: --shard-optimizer needs --mode sync:")
    assert "use --mode sync, or --no-shard-optimizer to keep async updates" in err
    assert "=" not in err and "shard_optimizer" not in err
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    _check(resolve_options(parser.parse_args(["--shard-optimizer", "--mode", "sync"]))[0])


def test_help_lists_every_option_with_its_default(capsys):
    from rpcompile.finetune import OPTIONS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in OPTIONS:
        assert "--" + option.name.replace("_", "-") in text
    assert "(default: cosine)" in text and "(default: 0.1)" in text
    assert "--overwrite" in text and "--out NEW branches it into a new folder" in text
    assert "saves a checkpoint of the last finished step and exits 130 / 143" in text


# -- the Python API -------------------------------------------------------------------------


def test_evaluate_touches_neither_masters_nor_optimizer_and_save_pretrained(tmp_path, files):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(files["ckpt"])
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear",
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (6, 16), generator=gen) for _ in range(3)]
    compiled = rpcompile.compile(
        model, gpus=2, microbatches=3, example_inputs=batches[0], device="virtual",
        hardware="cpu", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(compiled.optimizer, lambda k: 0.5 ** k)
    try:
        for batch in batches[:2]:
            compiled.step(batch)
            scheduler.step()
        assert compiled.optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-3)
        state = compiled.state_dict()
        loss = compiled.evaluate(batches[2])
        after = compiled.state_dict()
        assert after["step"] == state["step"]
        for key in ("masters", "optimizer"):
            assert json.dumps(_summary(after[key])) == json.dumps(_summary(state[key]))
        compiled.save_pretrained(tmp_path / "adapter")
        compiled.save_pretrained(tmp_path / "merged", merge=True)
        compiled.step(batches[2])  # still trains after saving a merged copy
    finally:
        compiled.close()
    fresh = AutoModelForCausalLM.from_pretrained(files["ckpt"])
    adapter = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        want = adapter(input_ids=batches[2], labels=batches[2]).loss
        got = merged(input_ids=batches[2], labels=batches[2]).loss
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float(got) == pytest.approx(float(want), rel=1e-4)


def _summary(state):
    """Exact fingerprint of nested tensors (sums of their bits as floats)."""
    if isinstance(state, torch.Tensor):
        return [list(state.shape), float(state.double().sum()), float(state.double().abs().sum())]
    if isinstance(state, dict):
        return {str(k): _summary(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_summary(v) for v in state]
    return state


# -- resume ------------------------------------------------------------------------------------

def test_sigkill_then_resume_logs_the_same_losses(tmp_path, files):
    # A kill after step 6 leaves the checkpoint of step 4; the resumed run replays steps 5-24
    # across the evals of steps 10 and 20 and the learning-rate schedule.
    args = ["--model", str(files["ckpt"]), "--data", str(files["pairs"]), "--steps", "24",
            "--workers", "2", "--batch", "6", "--lr", "3e-3",
            "--eval-every", "10", "--save-every", "4", "--keep-last", "2",
            "--report-to", "none"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "rpcompile.cli", "train"]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*cmd, *args, "--out", str(cut)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            steps = _logged_steps(cut)
            if steps and max(steps) >= 6:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (cut / "final").exists()  # killed mid-run, not after it
    # The resumed run goes on in its own process while the uninterrupted one runs in this
    # one; they share nothing but the input files.
    resumed = subprocess.Popen([*cmd, "--resume", str(cut)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        whole = tmp_path / "whole"
        assert main(["train", *args, "--out", str(whole)]) == 0
        _, err = resumed.communicate(timeout=300)
    finally:
        if resumed.poll() is None:  # a failure above, or a hang
            resumed.kill()
            resumed.wait()
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in err
    want = _records(whole)
    got = _records(cut)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["step"] for r in got if "eval_loss" in r] == [0, 10, 20, 24]
    for a, b in zip(got, want):
        assert a.get("loss") == b.get("loss"), (a, b)
        assert a.get("eval_loss") == b.get("eval_loss"), (a, b)
        assert a.get("lr") == b.get("lr"), (a, b)


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "loss" in record:
            steps.append(record["step"])
    return steps


def test_lr_schedule_warms_up_then_decays_to_zero():
    import math

    from rpcompile.finetune import lr_lambda

    cosine = lr_lambda("cosine", warmup=4, total=20)
    assert [cosine(k) for k in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert cosine(4) == 1.0
    assert cosine(12) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine(20) == pytest.approx(0.0)
    linear = lr_lambda("linear", warmup=0, total=10)
    assert [linear(k) for k in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_lambda("constant", warmup=2, total=10)(7) == 1.0


def test_the_readme_demo_runs_with_its_own_data_and_shape(tmp_path, capsys):
    # README's first command is `rpcompile train --out DIR`: the shipped corpus, --batch 20 and
    # --seq 128 must give whole batches (its paragraphs are longer than a row, so packing
    # splits them into pieces rather than keeping one truncated row each).
    out = tmp_path / "demo"
    assert main(["train", "--out", str(out), "--steps", "2", "--eval-every", "0"]) == 0
    err = capsys.readouterr().err
    assert "long texts split into pieces of 128 tokens" in err
    steps = [r for r in _records(out) if "loss" in r]
    assert len(steps) == 2 and all(r["tokens"] > 0 for r in steps)

"""rpcompile.trl.SFTTrainer against TRL's own SFTTrainer: the same SFT job (tiny Qwen3 from a
config, fp32, byte tokenizer, same data and seed) through plain TRL in eager PyTorch and
through rpcompile's virtual workers gives the same per-step losses, gradient norms, learning
rates and eval losses, and the same final weights."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from rpcompile.data.tokenizer import byte_tokenizer
from rpcompile.trl import RPCOMPILE_STATE, SFTTrainer
from tests.tiny_models import hf_model

# ChatML with the generation markers TRL's assistant_only_loss reads.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VIRTUAL = {"device": "virtual"}


def _tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model():
    return hf_model("qwen3", layers=2, vocab_size=260)


def _config(out, **fields):
    base = dict(output_dir=str(out), use_cpu=True, bf16=False, report_to="none",
                disable_tqdm=True, logging_steps=1, save_strategy="no", seed=0,
                lr_scheduler_type="constant", optim="sgd", learning_rate=0.1)
    return trl.SFTConfig(**{**base, **fields})


def _prompt_completion(n, start=0):
    return Dataset.from_list([{"prompt": f"Ledger, day {i}. Boats?",
                               "completion": f" {(7 * i) % 10} boats out, wind from the "
                                             + ("west" if i % 2 else "north")}
                              for i in range(start, start + n)])


def _logged(trainer, key, since=0):
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > since]


def _both(model, config, data, rp_options, **kwargs):
    """The job through plain TRL (eager, CPU) and through rpcompile's trainer."""
    reference = trl.SFTTrainer(model=copy.deepcopy(model), args=config, train_dataset=data,
                               processing_class=_tokenizer(), **kwargs)
    reference.train()
    ours = SFTTrainer(model=copy.deepcopy(model), args=config, train_dataset=data,
                      processing_class=_tokenizer(), rpcompile=rp_options, **kwargs)
    ours.train()
    return reference, ours


def _assert_same_run(reference, ours, keys=("loss", "learning_rate", "grad_norm")):
    for key in keys:
        expected, got = _logged(reference, key), _logged(ours, key)
        assert len(got) == len(expected) > 0, key
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    ours.compiled.sync_to_model()
    trained = dict(ours.model.named_parameters())
    for name, p in reference.model.named_parameters():
        assert torch.allclose(trained[name], p, rtol=0, atol=2e-6), name


class _Counts(TrainerCallback):
    def __init__(self):
        self.steps = self.evals = 0

    def on_step_end(self, args, state, control, **kw):
        self.steps += 1

    def on_evaluate(self, args, state, control, **kw):
        self.evals += 1


def test_prompt_completion_job_equals_trl(tmp_path):
    # 10 examples in global batches of 2 x 2: steps of 4, 4 and 2 sequences; the last fills
    # its 3 microbatches with an unlabelled row. Completion-only loss (TRL's default for
    # prompt/completion), clipping at 1.0, eval every 2 steps in batches of 6 (two pieces).
    config = _config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     num_train_epochs=1, max_grad_norm=1.0, eval_strategy="steps",
                     eval_steps=2, per_device_eval_batch_size=6)
    counts = {}
    runs = []
    for name in ("reference", "ours"):
        counts[name] = _Counts()
        runs.append(dict(callbacks=[counts[name]], eval_dataset=_prompt_completion(6, 100)))
    reference = trl.SFTTrainer(model=_model(), args=config, train_dataset=_prompt_completion(10),
                               processing_class=_tokenizer(), **runs[0])
    reference.train()
    ours = SFTTrainer(model=_model(), args=config, train_dataset=_prompt_completion(10),
                      processing_class=_tokenizer(), rpcompile=dict(VIRTUAL, gpus=2), **runs[1])
    ours.train()
    try:
        assert ours.compiled.microbatches == 3
        assert len(_logged(ours, "loss")) == 3
        assert all(n > 1.0 for n in _logged(ours, "grad_norm"))  # every step clipped
        _assert_same_run(reference, ours, ("loss", "learning_rate", "grad_norm", "eval_loss"))
        assert (counts["ours"].steps, counts["ours"].evals) == (3, 2)  # at steps 2 and 3
        assert (counts["reference"].steps, counts["reference"].evals) == (3, 2)
        assert _logged(ours, "num_tokens") == _logged(reference, "num_tokens")
    finally:
        ours.compiled.close()


def test_messages_assistant_only_adamw_cosine_equals_trl(tmp_path):
    # Conversations through the chat template, loss on assistant turns only; AdamW with weight
    # decay (norms excluded, as transformers groups them), warmup then cosine decay.
    data = Dataset.from_list([
        {"messages": [{"role": "user", "content": f"Day {i}: how many boats?"},
                      {"role": "assistant", "content": f"{(3 * i) % 7} boats, sea "
                                                       + ("calm" if i % 3 else "rough")}]}
        for i in range(12)])
    config = _config(tmp_path, per_device_train_batch_size=4, max_steps=3,
                     assistant_only_loss=True, optim="adamw_torch", learning_rate=1e-2,
                     adam_epsilon=1e-6, weight_decay=0.1, lr_scheduler_type="cosine",
                     warmup_steps=1)
    reference, ours = _both(_model(), config, data, dict(VIRTUAL, gpus=3))
    try:
        _assert_same_run(reference, ours)
        assert len(set(_logged(ours, "learning_rate"))) == 3
        accuracy = _logged(ours, "mean_token_accuracy")
        assert len(accuracy) == 3
        assert accuracy == pytest.approx(_logged(reference, "mean_token_accuracy"), rel=1e-6)
    finally:
        ours.compiled.close()


def test_lora_job_equals_trl(tmp_path):
    from peft import LoraConfig

    data = Dataset.from_list([{"text": f"Ledger {i}: {(5 * i) % 9} boats went out."}
                              for i in range(8)])
    config = _config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=2, optim="adamw_torch", learning_rate=1e-2, adam_epsilon=1e-6)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    reference, ours = _both(_model(), config, data, dict(VIRTUAL, gpus=2), peft_config=lora)
    try:
        trained = [n for n, p in ours.model.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n for n in trained)
        _assert_same_run(reference, ours)
    finally:
        ours.compiled.close()


def test_save_model_and_resume_continue_the_run(tmp_path):
    data = _prompt_completion(16)
    fields = dict(per_device_train_batch_size=4, max_steps=4, optim="adamw_torch",
                  learning_rate=1e-2, adam_epsilon=1e-6, lr_scheduler_type="linear",
                  save_strategy="steps", save_steps=2)
    options = dict(VIRTUAL, gpus=2)
    whole = SFTTrainer(model=_model(), args=_config(tmp_path / "whole", **fields),
                       train_dataset=data, processing_class=_tokenizer(), rpcompile=options)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / RPCOMPILE_STATE).is_dir() and (checkpoint / "scheduler.pt").is_file()
    whole.save_model(str(tmp_path / "final"))
    masters = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    whole.compiled.close()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for name, p in saved.named_parameters():
        assert torch.equal(p, masters[name]), name

    resumed = SFTTrainer(model=_model(), args=_config(tmp_path / "resumed", **fields),
                         train_dataset=data, processing_class=_tokenizer(), rpcompile=options)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    try:
        for key in ("loss", "learning_rate", "grad_norm"):  # the steps after the checkpoint
            after = [_logged(run, key, since=2) for run in (whole, resumed)]
            assert len(after[1]) == 2 and after[1] == pytest.approx(after[0], rel=1e-6), key
        resumed.compiled.sync_to_model()
        for name, p in resumed.model.named_parameters():
            assert torch.allclose(p, masters[name], rtol=0, atol=1e-7), name
    finally:
        resumed.compiled.close()


def _builds_from_model(model, **kwargs):  # the shape of transformers' optimizer factories
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("fields, extra, error, words", [
    (dict(packing=True), {}, ValueError, "packing=True"),
    (dict(bf16=True), {}, ValueError, "bf16=True"),
    (dict(neftune_noise_alpha=5.0), {}, ValueError, "neftune_noise_alpha"),
    ({}, dict(rpcompile={"optimizer": None}), ValueError, "optimizer"),
    ({}, dict(rpcompile={"gpu": 2}), TypeError, "gpu"),
    ({}, dict(optimizer_cls_and_kwargs=(_builds_from_model, {})), ValueError, "optim="),
])
def test_fields_that_cannot_apply_are_refused(tmp_path, fields, extra, error, words):
    with pytest.raises(error, match=words):
        SFTTrainer(model=_model(), args=_config(tmp_path, **fields),
                   train_dataset=_prompt_completion(4), processing_class=_tokenizer(), **extra)


def test_visible_gpus_are_workers_not_data_parallel(tmp_path):
    # As on a server with 2 visible GPUs and no launcher: transformers would replicate the module
    # over them (n_gpu 2, which TRL refuses) and multiply the per-device batch.
    config = _config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    config._n_gpu = 2
    trainer = SFTTrainer(model=_model(), args=config, train_dataset=_prompt_completion(4),
                         processing_class=_tokenizer(), rpcompile=VIRTUAL)
    assert trainer.args.n_gpu == 1 and config.n_gpu == 2
    assert trainer._train_batch_size == 2 and trainer._plan_rows == 6


def test_importing_rpcompile_does_not_import_trl():
    code = ("import sys, rpcompile; print(sorted(m for m in ('trl', 'transformers.trainer') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.strip() == "[]"

"""`rpcompile train --lora R --quantize nf4`: the frozen base of a checkpoint folder loaded
quantized by bitsandbytes, trained under LoRA adapters, and ``final/`` an adapter that PEFT
loads onto the same 4-bit base. Losses of the result are measured with plain Hugging Face /
PEFT / bitsandbytes code, not with rpcompile's."""

from __future__ import annotations

import logging

import pytest
import torch

from rpcompile.cli import main
from tests.finetune.test_finetune import COMMON, _hf_eval_loss, _records, files  # noqa: F401 (fixture)

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def test_train_quantize_nf4_writes_an_adapter_for_the_4bit_base(tmp_path, files, capsys):  # noqa: F811
    import transformers as tf
    from peft import PeftModel

    out = tmp_path / "qlora"
    args = ["train", "--model", str(files["ckpt"]), "--data", str(files["pairs"]), "--lora", "8",
            "--quantize", "nf4", "--out", str(out), *COMMON]
    args[args.index("--save-every") + 1] = "30"
    assert main(args) == 0
    evals = [r["eval_loss"] for r in _records(out) if "eval_loss" in r]
    assert len(evals) == 4 and evals[-1] < evals[0] - 0.5, evals
    assert (out / "final" / "adapter_config.json").is_file()
    assert not (out / "final" / "model.safetensors").exists()

    # What a user does with final/: the checkpoint loaded 4-bit the same way, the adapter on it.
    config = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
    base = tf.AutoModelForCausalLM.from_pretrained(files["ckpt"], quantization_config=config,
                                                   dtype=torch.float32)
    before = _hf_eval_loss(base, files["pairs"], files["ckpt"])
    tuned = PeftModel.from_pretrained(base, out / "final")
    assert any(type(m).__name__ == "Linear4bit" for m in tuned.modules())
    after = _hf_eval_loss(tuned, files["pairs"], files["ckpt"])
    assert after < before - 0.5, (before, after)
    # The logged eval losses are those of the quantized start and of the saved adapter.
    assert evals[0] == pytest.approx(before, rel=1e-4)
    assert evals[-1] == pytest.approx(after, rel=1e-4)

    # The run's config records the base's format: a resume that changes it is refused.
    assert "quantize: nf4" in (out / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--quantize is 'int8'" in err and "trained with 'nf4'" in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--quantize", "nf4"], "--quantize nf4 quantizes the frozen base under LoRA adapters; it "
                            "needs --lora R"),
    (["--quantize", "int8", "--lora", "8", "--merge"], "--merge with --quantize int8"),
])
def test_quantize_without_lora_or_with_merge_is_refused(capsys, flags, message):
    assert main(["train", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plan_quantize_nf4_plans_the_paper_model_with_an_nf4_base(monkeypatch, capsys):
    from rpcompile.workloads import paper

    planned = []
    units = paper.PaperModel.units

    def recording(self, *args, **kwargs):
        planned.append((self.name, self.base, self.lora_rank))
        return units(self, *args, **kwargs)

    monkeypatch.setattr(paper.PaperModel, "units", recording)
    assert main(["plan", "--model", "qwen3-1.7b", "--lora", "8", "--quantize", "nf4",
                 "--gpus", "2", "--batch", "6", "--microbatches", "3",
                 "--max-simulations", "4", "--no-fit-search"]) == 0
    out = capsys.readouterr().out
    assert set(planned) == {("qwen3-1.7b", "nf4", 8)}
    for line in ("predicted, steady state (sync):", "proven peak over the schedule:",
                 "host memory:"):
        assert line in out
    # Without adapters there is no frozen base to quantize; the paper path plans one server.
    assert main(["plan", "--model", "qwen3-1.7b", "--quantize", "nf4"]) == 2
    assert "pass --lora R" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen3-1.7b", "--lora", "8", "--quantize", "nf4",
                 "--nodes", "2"]) == 2
    assert "--nodes is not supported" in capsys.readouterr().err
